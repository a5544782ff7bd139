//! The hostile load of issue #33, shared by its end-to-end test and its benchmark: an app that accepts connections
//! and never reads them, and a client that pushes into every connection as long as it takes bytes.
//!
//! Guarantees: each runs on a thread of its own and hands its sockets back when it ends, so the caller decides
//! when they close; the client never blocks on one connection (non-blocking writes, poll(2) for writability, at
//! most 200 ms per round, so `stop` is seen within that).

use std::io::Write as _;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// The non-reading app: accepts `n` connections (counting each in `accepted`) and holds them without reading.
pub fn hold(listener: TcpListener, n: usize, accepted: Arc<AtomicU64>) -> JoinHandle<Vec<TcpStream>> {
    std::thread::spawn(move || {
        let mut held = Vec::with_capacity(n);
        while held.len() < n {
            let Ok((stream, _)) = listener.accept() else { break };
            held.push(stream);
            accepted.fetch_add(1, Ordering::Relaxed);
        }
        held
    })
}

/// The client: writes into every connection of `conns` while it takes bytes, up to `limit` bytes each (counted in
/// `pushed`), until every connection has taken its `limit` or `stop` is set.
pub fn push(
    conns: Vec<TcpStream>,
    limit: usize,
    stop: Arc<AtomicBool>,
    pushed: Arc<AtomicU64>,
) -> JoinHandle<Vec<TcpStream>> {
    std::thread::spawn(move || {
        let chunk = vec![0x5a_u8; 64 * 1024];
        let mut left = vec![limit; conns.len()];
        for conn in &conns {
            conn.set_nonblocking(true).expect("non-blocking");
        }
        while !stop.load(Ordering::Relaxed) && left.iter().any(|&l| l > 0) {
            let mut fds: Vec<libc::pollfd> = conns
                .iter()
                .zip(&left)
                .filter(|(_, &l)| l > 0)
                .map(|(c, _)| libc::pollfd { fd: c.as_raw_fd(), events: libc::POLLOUT, revents: 0 })
                .collect();
            // SAFETY: `fds` is a valid array of pollfd for the duration of the call.
            unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 200) };
            for (i, conn) in conns.iter().enumerate() {
                while left[i] > 0 {
                    match (&*conn).write(&chunk[..left[i].min(chunk.len())]) {
                        Ok(n) => {
                            left[i] -= n;
                            pushed.fetch_add(n as u64, Ordering::Relaxed);
                        }
                        Err(_) => break,
                    }
                }
            }
        }
        conns
    })
}
