//! The HBONE server's check of a CONNECT request (`hbone::connect::check_connect`, what `serve` runs on every
//! stream). The first byte picks the address the client dialled; the rest is `METHOD SP target`, and the target
//! is tried both as h2 hands a plain CONNECT over (authority only) and as a full URI. Invariants: only a
//! CONNECT to `local`'s own IP on a port that does not loop into the proxy is accepted, and what is accepted is
//! exactly the authority the client named; refusals are 400, or 503 for a looping port.

#![no_main]

use std::net::SocketAddr;

use hbone::connect::{check_connect, ILLEGAL_TARGET_PORTS};
use http::{Method, StatusCode, Uri};
use libfuzzer_sys::fuzz_target;

const LOCALS: [&str; 4] = ["10.0.0.5:15008", "[fd00::5]:15008", "127.0.0.1:15008", "[::1]:15008"];

fn check(method: &Method, uri: &Uri, local: SocketAddr) {
    let named: Option<SocketAddr> = uri
        .authority()
        .and_then(|a| a.as_str().parse().ok())
        .map(|a: SocketAddr| SocketAddr::new(a.ip().to_canonical(), a.port()));
    match check_connect(method, uri, local) {
        Ok(target) => {
            assert_eq!(method, Method::CONNECT);
            assert_eq!(Some(target), named, "accepted a target the client did not name");
            assert_eq!(target.ip(), local.ip(), "accepted a target on another IP");
            assert!(!ILLEGAL_TARGET_PORTS.contains(&target.port()), "accepted a proxy port");
        }
        Err(StatusCode::SERVICE_UNAVAILABLE) => {
            let named = named.expect("503 only for a parsed target");
            assert!(method == Method::CONNECT && named.ip() == local.ip());
            assert!(ILLEGAL_TARGET_PORTS.contains(&named.port()));
        }
        Err(status) => assert_eq!(status, StatusCode::BAD_REQUEST),
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((pick, rest)) = data.split_first() else { return };
    let local: SocketAddr = LOCALS[usize::from(*pick) % LOCALS.len()].parse().unwrap();
    let (method, target) = match rest.iter().position(|b| *b == b' ') {
        Some(i) => (&rest[..i], &rest[i + 1..]),
        None => (&b"CONNECT"[..], rest),
    };
    let Ok(method) = Method::from_bytes(method) else { return };
    if let Ok(authority) = http::uri::Authority::try_from(target) {
        let mut parts = http::uri::Parts::default();
        parts.authority = Some(authority);
        check(&method, &Uri::from_parts(parts).expect("authority-form URI"), local);
    }
    if let Ok(uri) = Uri::try_from(target) {
        check(&method, &uri, local);
    }
});
