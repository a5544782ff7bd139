//! The admin endpoint on 127.0.0.1 (Istio's port 15000): `/config_dump`, a JSON view of what the proxy runs —
//! each pod's uid, name, namespace, netns, identity and certificate validity, and the pods still pending.

use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::SystemTime;

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::workloads::View;

/// Binds 127.0.0.1:`port` (only local users may read the dump) and serves until the process exits.
pub async fn serve(port: u16, workloads: View) -> std::io::Result<()> {
    let listener = TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, port))).await?;
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let workloads = workloads.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| {
                    let response = respond(&req, &workloads);
                    async move { Ok::<_, Infallible>(response) }
                });
                let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
            });
        }
    });
    Ok(())
}

fn respond<B>(req: &Request<B>, workloads: &View) -> Response<Full<Bytes>> {
    let (status, content_type, body) = match (req.uri().path(), workloads.dump()) {
        ("/config_dump", Some(dump)) => {
            let mut body = serde_json::to_string_pretty(&dump).unwrap_or_default();
            body.push('\n');
            (StatusCode::OK, "application/json", body)
        }
        ("/config_dump", None) => (StatusCode::SERVICE_UNAVAILABLE, "text/plain", "shutting down\n".to_owned()),
        _ => (StatusCode::NOT_FOUND, "text/plain", "not found\n".to_owned()),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

/// `at` as an RFC 3339 UTC timestamp with whole seconds (`2026-11-30T10:18:13Z`).
pub fn rfc3339(at: SystemTime) -> String {
    let secs = at.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or_default();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn timestamps_are_rfc3339_utc() {
        assert_eq!(rfc3339(SystemTime::UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_033_893);
        assert_eq!(rfc3339(at), "2026-11-30T10:18:13Z");
        let leap = SystemTime::UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(rfc3339(leap), "2000-02-29T00:00:00Z");
    }
}
