//! The one error type of the crate.

use std::path::PathBuf;
use std::time::Duration;

/// Everything that can go wrong on either side of a ZDS connection.
#[derive(Debug, thiserror::Error)]
pub enum ZdsError {
    /// The agent has no proxy connection to send an Add to; the caller should fail closed and retry.
    #[error("no node proxy is connected to the ZDS socket")]
    NoProxy,
    /// The proxy answered with a non-empty `Ack.error`.
    #[error("node proxy rejected the request: {0}")]
    Nack(String),
    /// A read or write did not finish within the deadline.
    #[error("ZDS {op} timed out after {after:?}")]
    Timeout {
        /// What was being waited for.
        op: &'static str,
        /// The deadline that passed.
        after: Duration,
    },
    /// The peer closed the connection.
    #[error("ZDS peer closed the connection")]
    PeerClosed,
    /// The peer sent something the protocol does not allow (wrong message, bad fds, truncated datagram).
    #[error("ZDS protocol violation: {0}")]
    Protocol(String),
    /// A datagram did not decode as the expected protobuf message.
    #[error("ZDS message is not a valid {what}: {source}")]
    Decode {
        /// Name of the expected message.
        what: &'static str,
        /// Decoder error.
        source: prost::DecodeError,
    },
    /// A message to send is larger than the protocol allows.
    #[error("ZDS message of {len} bytes is over the {max}-byte limit")]
    TooLarge {
        /// Encoded length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Setting up the socket at `path` failed.
    #[error("ZDS socket {path}: {op}: {source}")]
    Socket {
        /// Socket path.
        path: PathBuf,
        /// Which step failed.
        op: &'static str,
        /// Underlying error.
        source: std::io::Error,
    },
    /// A system call on an established connection failed.
    #[error("ZDS {op}: {source}")]
    Io {
        /// Which operation failed.
        op: &'static str,
        /// Underlying error.
        source: std::io::Error,
    },
}

impl ZdsError {
    /// A copy of this error, for when both the caller of a request and the connection's log need it.
    /// (`std::io::Error` is not `Clone`; its OS error code or kind and message are kept.)
    pub(crate) fn duplicate(&self) -> ZdsError {
        fn io(e: &std::io::Error) -> std::io::Error {
            match e.raw_os_error() {
                Some(code) => std::io::Error::from_raw_os_error(code),
                None => std::io::Error::new(e.kind(), e.to_string()),
            }
        }
        match self {
            ZdsError::NoProxy => ZdsError::NoProxy,
            ZdsError::Nack(r) => ZdsError::Nack(r.clone()),
            ZdsError::Timeout { op, after } => ZdsError::Timeout { op, after: *after },
            ZdsError::PeerClosed => ZdsError::PeerClosed,
            ZdsError::Protocol(m) => ZdsError::Protocol(m.clone()),
            ZdsError::Decode { what, source } => ZdsError::Decode { what, source: source.clone() },
            ZdsError::TooLarge { len, max } => ZdsError::TooLarge { len: *len, max: *max },
            ZdsError::Socket { path, op, source } => ZdsError::Socket { path: path.clone(), op, source: io(source) },
            ZdsError::Io { op, source } => ZdsError::Io { op, source: io(source) },
        }
    }
}
