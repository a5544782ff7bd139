//! The rules a CONNECT request must pass before the server tunnels it anywhere, as a pure function of what the
//! client sent (kept free of the server's runtime: it builds without the `runtime` feature, which is how the fuzz
//! targets use it).

use std::net::SocketAddr;

use http::{Method, StatusCode, Uri};
use istio_contract::ports;

/// Targets that would loop traffic back into the proxy itself: outbound capture, inbound plaintext
/// capture and HBONE.
pub const ILLEGAL_TARGET_PORTS: [u16; 3] = [ports::OUTBOUND, ports::INBOUND_PLAINTEXT, ports::HBONE];

/// Checks a CONNECT request's method and target against the HBONE rules, returning the target or the status
/// to refuse with: only CONNECT (else 400), to an `ip:port` authority (else 400) whose IP is the one the client
/// dialled, `local` (else 400), on a port that does not loop back into the proxy (else 503).
///
/// What the HBONE server runs on every stream.
pub fn check_connect(method: &Method, uri: &Uri, local: SocketAddr) -> Result<SocketAddr, StatusCode> {
    if method != Method::CONNECT {
        return Err(StatusCode::BAD_REQUEST);
    }
    let authority: SocketAddr = uri.authority().and_then(|a| a.as_str().parse().ok()).ok_or(StatusCode::BAD_REQUEST)?;
    let authority = SocketAddr::new(authority.ip().to_canonical(), authority.port());
    if authority.ip() != local.ip() {
        return Err(StatusCode::BAD_REQUEST);
    }
    if ILLEGAL_TARGET_PORTS.contains(&authority.port()) {
        return Err(StatusCode::SERVICE_UNAVAILABLE);
    }
    Ok(authority)
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;

    /// Checks a request to a server whose client dialled `local` on the HBONE port.
    fn check(method: Method, uri: &str, local: &str) -> Result<SocketAddr, StatusCode> {
        let local = SocketAddr::new(local.parse::<IpAddr>().unwrap(), ports::HBONE);
        check_connect(&method, &uri.parse().unwrap(), local)
    }

    #[test]
    fn connect_to_the_dialled_ip_is_accepted_in_canonical_form() {
        assert_eq!(check(Method::CONNECT, "10.0.0.5:8080", "10.0.0.5"), Ok("10.0.0.5:8080".parse().unwrap()));
        assert_eq!(check(Method::CONNECT, "[fd00::5]:80", "fd00::5"), Ok("[fd00::5]:80".parse().unwrap()));
        let mapped = check(Method::CONNECT, "[::ffff:10.0.0.5]:80", "10.0.0.5");
        assert_eq!(mapped, Ok("10.0.0.5:80".parse().unwrap()));
    }

    #[test]
    fn other_methods_ips_names_and_proxy_ports_are_refused() {
        assert_eq!(check(Method::GET, "10.0.0.5:8080", "10.0.0.5"), Err(StatusCode::BAD_REQUEST));
        assert_eq!(check(Method::CONNECT, "10.0.0.6:8080", "10.0.0.5"), Err(StatusCode::BAD_REQUEST));
        assert_eq!(check(Method::CONNECT, "web.shop:8080", "10.0.0.5"), Err(StatusCode::BAD_REQUEST));
        assert_eq!(check(Method::CONNECT, "http://10.0.0.5/", "10.0.0.5"), Err(StatusCode::BAD_REQUEST));
        for port in ILLEGAL_TARGET_PORTS {
            let target = format!("10.0.0.5:{port}");
            assert_eq!(check(Method::CONNECT, &target, "10.0.0.5"), Err(StatusCode::SERVICE_UNAVAILABLE));
        }
    }
}
