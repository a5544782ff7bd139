//! gRPC over HTTP/2 without I/O: the 5-byte message framing and the status codes of `grpc-status` trailers.
//!
//! Guarantees: [`FrameDecoder`] rejects a message longer than its limit as soon as the 5-byte prefix arrives, so it
//! never buffers more than one bounded message plus the bytes already received; compressed messages (flag 1) are
//! refused since this client never negotiates compression. Nothing here panics on input.

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// The length of the prefix before every gRPC message: a compression flag and a big-endian u32 length.
pub const PREFIX_LEN: usize = 5;

/// Frames one encoded message for a gRPC body.
pub fn encode_frame(message: &impl prost::Message) -> Bytes {
    let len = message.encoded_len();
    let mut buf = BytesMut::with_capacity(PREFIX_LEN + len);
    buf.put_u8(0);
    // A message never reaches 4 GiB: requests are built by this crate.
    buf.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
    // Encoding into a buffer with enough capacity cannot fail.
    let _ = message.encode(&mut buf);
    buf.freeze()
}

/// A framing violation by the peer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The message is longer than the limit.
    #[error("gRPC message of {len} bytes is over the {max} byte limit")]
    TooLarge {
        /// Announced length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The compression flag is set (or not 0/1).
    #[error("gRPC message with compression flag {0}, none was negotiated")]
    Compressed(u8),
    /// The body ended inside a message.
    #[error("gRPC body ended inside a message ({0} bytes left over)")]
    Truncated(usize),
}

/// Splits a gRPC body into messages, refusing any over `max` bytes.
#[derive(Debug)]
pub struct FrameDecoder {
    buf: BytesMut,
    max: usize,
}

impl FrameDecoder {
    /// A decoder for messages of at most `max` bytes.
    pub fn new(max: usize) -> Self {
        FrameDecoder { buf: BytesMut::new(), max }
    }

    /// Appends received body bytes.
    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next complete message, `None` if more bytes are needed; checks the prefix as soon as it is complete.
    pub fn next_message(&mut self) -> Result<Option<Bytes>, FrameError> {
        if self.buf.len() < PREFIX_LEN {
            return Ok(None);
        }
        let flag = self.buf[0];
        if flag != 0 {
            return Err(FrameError::Compressed(flag));
        }
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > self.max {
            return Err(FrameError::TooLarge { len, max: self.max });
        }
        if self.buf.len() < PREFIX_LEN + len {
            // Room for the rest of this one message only; the limit bounds it.
            self.buf.reserve(PREFIX_LEN + len - self.buf.len());
            return Ok(None);
        }
        self.buf.advance(PREFIX_LEN);
        Ok(Some(self.buf.split_to(len).freeze()))
    }

    /// Call at end of body: an error if a partial message is left.
    pub fn finish(&self) -> Result<(), FrameError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(FrameError::Truncated(self.buf.len()))
        }
    }
}

/// gRPC status codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(missing_docs)]
pub enum Code {
    Ok = 0,
    Cancelled = 1,
    Unknown = 2,
    InvalidArgument = 3,
    DeadlineExceeded = 4,
    NotFound = 5,
    AlreadyExists = 6,
    PermissionDenied = 7,
    ResourceExhausted = 8,
    FailedPrecondition = 9,
    Aborted = 10,
    OutOfRange = 11,
    Unimplemented = 12,
    Internal = 13,
    Unavailable = 14,
    DataLoss = 15,
    Unauthenticated = 16,
}

impl Code {
    /// The code of a `grpc-status` value; anything unparsable or out of range is `Unknown`, as gRPC specifies.
    pub fn from_header(value: &[u8]) -> Code {
        std::str::from_utf8(value).ok().and_then(|s| s.trim().parse::<i32>().ok()).map_or(Code::Unknown, Code::from_i32)
    }

    /// The code of a number; out of range is `Unknown`.
    pub fn from_i32(n: i32) -> Code {
        use Code::*;
        const ALL: [Code; 17] = [
            Ok,
            Cancelled,
            Unknown,
            InvalidArgument,
            DeadlineExceeded,
            NotFound,
            AlreadyExists,
            PermissionDenied,
            ResourceExhausted,
            FailedPrecondition,
            Aborted,
            OutOfRange,
            Unimplemented,
            Internal,
            Unavailable,
            DataLoss,
            Unauthenticated,
        ];
        usize::try_from(n).ok().and_then(|i| ALL.get(i).copied()).unwrap_or(Unknown)
    }
}

/// A non-OK gRPC status from the server.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("gRPC status {code:?}: {message}")]
pub struct GrpcStatus {
    /// The code.
    pub code: Code,
    /// `grpc-message`, percent-decoded and truncated.
    pub message: String,
}

/// Longest `grpc-message` kept, so a hostile server cannot bloat logs and errors.
pub const MAX_STATUS_MESSAGE: usize = 1024;

/// Decodes a `grpc-message` value (percent-encoded UTF-8), keeping at most [`MAX_STATUS_MESSAGE`] bytes.
pub fn decode_status_message(value: &[u8]) -> String {
    let mut out = Vec::with_capacity(value.len().min(MAX_STATUS_MESSAGE));
    let mut i = 0;
    while i < value.len() && out.len() < MAX_STATUS_MESSAGE {
        let b = value[i];
        if b == b'%' && i + 2 < value.len() {
            let hex = std::str::from_utf8(&value[i + 1..i + 3]).ok().and_then(|h| u8::from_str_radix(h, 16).ok());
            if let Some(byte) = hex {
                out.push(byte);
                i += 3;
                continue;
            }
        }
        out.push(b);
        i += 1;
    }
    crate::wire::resource::truncate(&String::from_utf8_lossy(&out), MAX_STATUS_MESSAGE)
}

/// Encodes a `grpc-message` value (percent-encoding as the gRPC spec asks), for the fake server.
pub fn encode_status_message(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for b in message.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Status;

    #[test]
    fn frame_bytes() {
        let msg = Status { code: 1, ..Default::default() };
        assert_eq!(&encode_frame(&msg)[..], [0, 0, 0, 0, 2, 0x08, 0x01]);
    }

    #[test]
    fn decoder_splits_and_bounds() {
        let mut d = FrameDecoder::new(4);
        d.push(&[0, 0, 0]);
        assert_eq!(d.next_message(), Ok(None));
        d.push(&[0, 2, 0xaa]);
        assert_eq!(d.next_message(), Ok(None));
        d.push(&[0xbb, 0, 0, 0, 0, 0]);
        assert_eq!(d.next_message().unwrap().unwrap().as_ref(), [0xaa, 0xbb]);
        assert_eq!(d.next_message().unwrap().unwrap().as_ref(), [] as [u8; 0]);
        assert_eq!(d.finish(), Ok(()));
        let mut d = FrameDecoder::new(4);
        d.push(&[0, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(d.next_message(), Err(FrameError::TooLarge { len: u32::MAX as usize, max: 4 }));
        let mut d = FrameDecoder::new(4);
        d.push(&[1, 0, 0, 0, 0]);
        assert_eq!(d.next_message(), Err(FrameError::Compressed(1)));
        let mut d = FrameDecoder::new(4);
        d.push(&[0, 0]);
        assert_eq!(d.finish(), Err(FrameError::Truncated(2)));
    }

    #[test]
    fn status_codes_and_messages() {
        assert_eq!(Code::from_header(b"14"), Code::Unavailable);
        assert_eq!(Code::from_header(b"99"), Code::Unknown);
        assert_eq!(Code::from_header(b"x"), Code::Unknown);
        assert_eq!(Code::from_header(b"-1"), Code::Unknown);
        assert_eq!(decode_status_message(b"a%20b%zz%"), "a b%zz%");
        assert_eq!(decode_status_message(encode_status_message("é 100%").as_bytes()), "é 100%");
    }
}
