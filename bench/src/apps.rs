//! The benchmark's apps: servers and clients running inside pod netns. Sockets are created on a thread inside
//! the pod's netns and keep it afterwards, so the I/O itself runs on ordinary threads.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use testbed::NetnsGuard;

/// Port of the sink server (hello byte, read to EOF, ack byte).
pub const SINK_PORT: u16 = 9001;
/// Port of the echo server.
pub const ECHO_PORT: u16 = 9002;
/// Any single connect or read may take this long before the run is declared broken.
const IO_LIMIT: Duration = Duration::from_secs(30);
/// Write size of the throughput client.
const CHUNK: usize = 256 * 1024;

/// What a server does with each connection.
#[derive(Debug, Clone, Copy)]
pub enum Mode {
    /// Sends one byte at once (the client's "first byte"), reads until EOF, then sends one more byte.
    Sink,
    /// Echoes everything until EOF.
    Echo,
}

/// A server app in a pod: one thread per connection; stopped (and its listener closed) on drop.
pub struct Server {
    stop: Arc<AtomicBool>,
    addr: SocketAddr,
    ns: netns::Netns,
    accept: Option<JoinHandle<()>>,
}

impl Server {
    /// Listens on `port` in `pod` and serves every connection in `mode`.
    pub fn start(pod: &NetnsGuard, port: u16, mode: Mode) -> Server {
        let ns = pod.open().expect("open pod netns");
        let listener = ns.run(|| TcpListener::bind(("0.0.0.0", port))).expect("enter pod").expect("bind app port");
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let accept = std::thread::spawn(move || {
            for stream in listener.incoming() {
                if flag.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(stream) = stream else { continue };
                std::thread::spawn(move || {
                    let _ = serve(stream, mode);
                });
            }
        });
        Server { stop, addr: SocketAddr::from(([127, 0, 0, 1], port)), ns, accept: Some(accept) }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the blocking accept with one last connection from inside the pod.
        let _ = self.ns.run(|| TcpStream::connect_timeout(&self.addr, Duration::from_secs(1)));
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
    }
}

fn serve(mut stream: TcpStream, mode: Mode) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let mut buf = vec![0u8; CHUNK];
    match mode {
        Mode::Sink => {
            stream.write_all(b"h")?;
            while stream.read(&mut buf)? > 0 {}
            stream.write_all(b"k")?;
        }
        Mode::Echo => loop {
            let n = stream.read(&mut buf)?;
            if n == 0 {
                break;
            }
            stream.write_all(&buf[..n])?;
        },
    }
    Ok(())
}

/// Connects from inside `pod` to `addr` (the pod's own source address, through its in-pod rules).
pub fn connect(pod: &NetnsGuard, addr: SocketAddr) -> TcpStream {
    let ns = pod.open().expect("open pod netns");
    let stream = ns
        .run(|| TcpStream::connect_timeout(&addr, IO_LIMIT))
        .expect("enter pod")
        .unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    stream.set_read_timeout(Some(IO_LIMIT)).expect("read timeout");
    stream.set_nodelay(true).expect("nodelay");
    stream
}

/// Time from the start of connect until the sink server's first byte arrived, then closes the connection
/// cleanly.
pub fn first_byte(pod: &NetnsGuard, addr: SocketAddr) -> Duration {
    let ns = pod.open().expect("open pod netns");
    let start = Instant::now();
    let mut stream = ns.run(|| TcpStream::connect_timeout(&addr, IO_LIMIT)).expect("enter pod").expect("connect");
    stream.set_read_timeout(Some(IO_LIMIT)).expect("read timeout");
    let mut hello = [0u8; 1];
    stream.read_exact(&mut hello).expect("first byte");
    let took = start.elapsed();
    stream.shutdown(Shutdown::Write).expect("shutdown");
    stream.read_exact(&mut hello).expect("final byte");
    took
}

/// Sends `bytes` on each of `streams` parallel connections to the sink at `addr` and waits for every sink's
/// final byte (so everything was delivered); returns the wall time from the first connect.
pub fn transfer(pod: &NetnsGuard, addr: SocketAddr, streams: usize, bytes: u64) -> Duration {
    let start = Instant::now();
    let conns: Vec<TcpStream> = (0..streams).map(|_| connect(pod, addr)).collect();
    let workers: Vec<_> = conns
        .into_iter()
        .map(|mut s| {
            std::thread::spawn(move || {
                let chunk = vec![0x5a_u8; CHUNK];
                let mut one = [0u8; 1];
                s.read_exact(&mut one).expect("sink hello");
                let mut left = bytes;
                while left > 0 {
                    let n = left.min(CHUNK as u64) as usize;
                    s.write_all(&chunk[..n]).expect("send");
                    left -= n as u64;
                }
                s.shutdown(Shutdown::Write).expect("shutdown");
                s.read_exact(&mut one).expect("sink ack");
            })
        })
        .collect();
    for w in workers {
        w.join().expect("transfer worker");
    }
    start.elapsed()
}

/// Round trips of `size` bytes on one established echo connection; one sample per round trip.
pub fn round_trips(stream: &mut TcpStream, size: usize, count: usize) -> Vec<Duration> {
    let out = vec![0xa5_u8; size];
    let mut back = vec![0u8; size];
    (0..count)
        .map(|_| {
            let start = Instant::now();
            stream.write_all(&out).expect("send request");
            stream.read_exact(&mut back).expect("read response");
            start.elapsed()
        })
        .collect()
}
