//! Real app traffic between two pods: a client app in one pod sends a payload to an echo app in another and
//! reads it back, timing the first echoed byte (the connect latency the app sees, tunnel setup included).

use std::io::{Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use testbed::NetnsGuard;

use crate::control::{checkpoint, Stop};

/// How long any single read or accept may take.
const IO_LIMIT: Duration = Duration::from_secs(10);

/// What the client app observed.
#[derive(Debug)]
pub struct Exchange {
    /// Connect until the first echoed byte came back.
    pub first_echo: Duration,
    /// Connect until the last echoed byte came back.
    pub total: Duration,
    /// Bytes sent (and received back).
    pub bytes: usize,
    /// The peer address the server app saw.
    pub server_saw: IpAddr,
}

/// The echo app: listens on `port` in `server`, serves one connection. Start it before [`echo`].
pub fn echo_app(server: &NetnsGuard, port: u16) -> Result<EchoApp, Stop> {
    let ns = server.open().map_err(|e| Stop::Failed(format!("open {}: {e}", server.name())))?;
    let listener = ns
        .run(|| TcpListener::bind(("0.0.0.0", port)))
        .map_err(|e| Stop::Failed(format!("enter {}: {e}", server.name())))?
        .map_err(|e| Stop::Failed(format!("echo app binds :{port}: {e}")))?;
    listener.set_nonblocking(true).map_err(|e| Stop::Failed(format!("echo app: {e}")))?;
    Ok(std::thread::spawn(move || {
        let started = Instant::now();
        let (mut stream, peer) = loop {
            match listener.accept() {
                Ok(accepted) => break accepted,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && started.elapsed() < IO_LIMIT => {
                    if checkpoint().is_err() {
                        return Err("interrupted".to_owned());
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(format!("echo app accept: {e}")),
            }
        };
        let io = |e: std::io::Error| format!("echo app: {e}");
        stream.set_nonblocking(false).map_err(io)?;
        stream.set_read_timeout(Some(IO_LIMIT)).map_err(io)?;
        let mut buf = vec![0; 64 * 1024];
        loop {
            let n = stream.read(&mut buf).map_err(io)?;
            if n == 0 {
                break;
            }
            stream.write_all(&buf[..n]).map_err(io)?;
        }
        stream.shutdown(Shutdown::Write).map_err(io)?;
        Ok(peer.ip())
    }))
}

/// The client app in `client` connects to `dst`, sends `len` bytes and reads them back, checking every byte.
pub fn echo(client: &NetnsGuard, dst: SocketAddr, len: usize, app: EchoApp) -> Result<Exchange, Stop> {
    let fail = |what: &str, e: &dyn std::fmt::Display| Stop::Failed(format!("client app {what}: {e}"));
    let ns = client.open().map_err(|e| fail("opens its netns", &e))?;
    let started = Instant::now();
    let stream = ns
        .run(|| TcpStream::connect_timeout(&dst, IO_LIMIT))
        .map_err(|e| fail("enters its netns", &e))?
        .map_err(|e| fail(&format!("connects to {dst}"), &e))?;
    stream.set_read_timeout(Some(IO_LIMIT)).map_err(|e| fail("sets a timeout", &e))?;
    let payload: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let mut reader = stream.try_clone().map_err(|e| fail("clones its socket", &e))?;
    let mut writer = stream;
    writer.write_all(&payload[..1]).map_err(|e| fail("sends", &e))?;
    let mut got = vec![0; len];
    reader.read_exact(&mut got[..1]).map_err(|e| fail("reads the first echoed byte", &e))?;
    let first_echo = started.elapsed();
    checkpoint()?;
    let rest = payload[1..].to_vec();
    let sender = std::thread::spawn(move || -> std::io::Result<()> {
        writer.write_all(&rest)?;
        writer.shutdown(Shutdown::Write)
    });
    reader.read_exact(&mut got[1..]).map_err(|e| fail("reads the echo", &e))?;
    let total = started.elapsed();
    let mut tail = [0; 1];
    let eof = reader.read(&mut tail).map_err(|e| fail("reads the end of the echo", &e))?;
    sender.join().map_err(|_| fail("sends", &"sender thread panicked"))?.map_err(|e| fail("sends", &e))?;
    if got != payload || eof != 0 {
        return Err(Stop::Failed("the echo differs from what the client app sent".to_owned()));
    }
    let server_saw = app.join().map_err(|_| Stop::Failed("echo app panicked".to_owned()))?.map_err(Stop::Failed)?;
    Ok(Exchange { first_echo, total, bytes: len, server_saw })
}

/// The running echo app, as [`echo_app`] returns it.
pub type EchoApp = std::thread::JoinHandle<Result<IpAddr, String>>;
