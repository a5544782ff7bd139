//! Large transfers between two apps without holding the payload in memory: each side streams a deterministic
//! pseudo-random payload (ChaCha20 keystream, fast even in debug builds) while hashing what it reads, so the
//! hashes on both ends prove every byte arrived intact and in order.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::Duration;

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305};
use ring::digest::{Context, SHA256};

/// Bytes generated per step.
const CHUNK: usize = 1024 * 1024;
/// With a marker, it is written at every multiple of this offset.
const MARKER_EVERY: usize = 4096;

/// A distinctive 64-byte plaintext marker: finding it on the wire means payload crossed in the clear.
pub const MARKER: &[u8; 64] = b"HBONE-TEST-PLAINTEXT-MARKER:if-you-see-me-on-the-wire-TLS-failed";

/// A deterministic payload of `len` bytes, different per `seed`, optionally with [`MARKER`] every 4 KiB.
#[derive(Debug, Clone, Copy)]
pub struct Payload {
    /// Selects the keystream.
    pub seed: u8,
    /// Total bytes.
    pub len: u64,
    /// Whether [`MARKER`] is stamped into the payload.
    pub marked: bool,
}

impl Payload {
    /// A payload of `len` random-looking bytes.
    pub fn new(seed: u8, len: u64) -> Self {
        Payload { seed, len, marked: false }
    }

    /// The same, with [`MARKER`] stamped every 4 KiB.
    pub fn marked(self) -> Self {
        Payload { marked: true, ..self }
    }

    /// Calls `sink` with the payload in order, chunk by chunk.
    pub fn generate(&self, mut sink: impl FnMut(&[u8])) {
        let key = LessSafeKey::new(UnboundKey::new(&CHACHA20_POLY1305, &[self.seed; 32]).expect("chacha key"));
        let mut buf = vec![0u8; CHUNK];
        let mut left = self.len;
        let mut index: u64 = 0;
        while left > 0 {
            let n = left.min(CHUNK as u64) as usize;
            buf.fill(0);
            let mut nonce = [0u8; 12];
            nonce[..8].copy_from_slice(&index.to_le_bytes());
            let _tag = key
                .seal_in_place_separate_tag(Nonce::assume_unique_for_key(nonce), Aad::empty(), &mut buf)
                .expect("keystream");
            if self.marked {
                for at in (0..CHUNK).step_by(MARKER_EVERY) {
                    buf[at..at + MARKER.len()].copy_from_slice(MARKER);
                }
            }
            sink(&buf[..n]);
            left -= n as u64;
            index += 1;
        }
    }
}

/// What one side of an exchange sent and received.
#[derive(Debug)]
pub struct Exchanged {
    /// SHA-256 of everything sent.
    pub sent_sha256: Vec<u8>,
    /// SHA-256 of everything read until EOF.
    pub received_sha256: Vec<u8>,
    /// How many bytes were read.
    pub received: u64,
}

/// Sends `payload` (then shuts down the write side) while reading to EOF, hashing both directions.
pub fn exchange(stream: TcpStream, payload: Payload) -> Exchanged {
    let mut writer = stream.try_clone().expect("clone socket");
    let sender = std::thread::spawn(move || {
        let mut hash = Context::new(&SHA256);
        payload.generate(|chunk| {
            hash.update(chunk);
            writer.write_all(chunk).expect("send payload");
        });
        writer.shutdown(Shutdown::Write).expect("shut down write side");
        hash.finish().as_ref().to_vec()
    });
    let mut reader = stream;
    reader.set_read_timeout(Some(Duration::from_secs(60))).expect("read timeout");
    let mut hash = Context::new(&SHA256);
    let mut buf = vec![0; 256 * 1024];
    let mut len = 0u64;
    loop {
        let n = reader.read(&mut buf).expect("read payload");
        if n == 0 {
            break;
        }
        hash.update(&buf[..n]);
        len += n as u64;
    }
    let sent_sha256 = sender.join().expect("sender thread");
    Exchanged { sent_sha256, received_sha256: hash.finish().as_ref().to_vec(), received: len }
}

/// A server app on `listener`: serves one connection with [`exchange`]; yields (peer, what it read).
pub fn serve_one(listener: TcpListener, payload: Payload) -> JoinHandle<(SocketAddr, Exchanged)> {
    std::thread::spawn(move || {
        let (stream, peer) = listener.accept().expect("accept");
        (peer, exchange(stream, payload))
    })
}

/// Runs an exchange of `len` bytes each way between a client connected with `connect` and a server on
/// `listener`, asserts both ends received exactly what the other sent (length and SHA-256), and returns the
/// peer address the server saw.
pub fn transfer(
    listener: TcpListener,
    connect: impl FnOnce() -> TcpStream,
    client: Payload,
    server: Payload,
) -> SocketAddr {
    let server_app = serve_one(listener, server);
    let at_client = exchange(connect(), client);
    let (peer, at_server) = server_app.join().expect("server app");
    assert_eq!(at_client.received, server.len, "bytes the client received");
    assert_eq!(at_server.received, client.len, "bytes the server received");
    assert_eq!(at_client.received_sha256, at_server.sent_sha256, "the client got exactly what the server sent");
    assert_eq!(at_server.received_sha256, at_client.sent_sha256, "the server got exactly what the client sent");
    peer
}

/// An echo app on `listener` serving any number of connections (each echoed until EOF, then shut down for
/// writing); counts the connections it accepted.
pub fn echo_app(listener: std::net::TcpListener) -> std::sync::Arc<std::sync::atomic::AtomicUsize> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let accepted = std::sync::Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            count.fetch_add(1, Ordering::SeqCst);
            std::thread::spawn(move || {
                let mut reader = stream.try_clone().expect("clone socket");
                let _ = std::io::copy(&mut reader, &mut stream);
                let _ = stream.shutdown(std::net::Shutdown::Write);
            });
        }
    });
    accepted
}
