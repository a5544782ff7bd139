//! A plain HTTP/1.1 GET to a probe or metrics port inside a netns (the agents' `/readyz`, `/metrics`, ...), for
//! tests of every binary.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::Duration;

/// `GET path` on 127.0.0.1:`port` from inside the netns at `netns`: status code and body, or why it failed.
pub fn get(netns: &Path, port: u16, path: &str) -> Result<(u16, String), String> {
    let ns = netns::Netns::open(netns).map_err(|e| e.to_string())?;
    let raw = ns
        .run(|| -> std::io::Result<String> {
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
            stream.set_read_timeout(Some(Duration::from_secs(5)))?;
            write!(stream, "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")?;
            let mut raw = String::new();
            stream.read_to_string(&mut raw)?;
            Ok(raw)
        })
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    let (head, body) = raw.split_once("\r\n\r\n").ok_or_else(|| format!("no header end in {raw:?}"))?;
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| format!("bad head {head:?}"))?;
    Ok((status, body.to_owned()))
}
