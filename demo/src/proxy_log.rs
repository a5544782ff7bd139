//! Reading what `hbone-proxy` logged: its access-log lines (one per connection, with both SPIFFE identities and
//! byte counts) and the pod proxies it started for ZDS `AddWorkload`s.

/// One `connection complete` access-log line.
#[derive(Debug, Clone)]
pub struct Access {
    /// `outbound` (logged by the client pod's proxy) or `inbound` (the server pod's).
    pub direction: String,
    /// `HBONE` or `TCP`.
    pub protocol: String,
    /// The client's SPIFFE identity.
    pub src_identity: String,
    /// The server's SPIFFE identity.
    pub dst_identity: String,
    /// The destination the app dialled.
    pub dst_addr: String,
    /// Bytes the proxy delivered to the app on its side of the connection.
    pub bytes_sent: u64,
    /// Bytes the proxy took from that app.
    pub bytes_received: u64,
}

/// Every access-log line in `log`.
pub fn accesses(log: &str) -> Vec<Access> {
    log.lines()
        .filter(|l| l.contains(" access: ") && l.contains("connection complete"))
        .map(|l| {
            let text = |key| field(l, key).unwrap_or_default().to_owned();
            let number = |key| field(l, key).and_then(|v| v.parse().ok()).unwrap_or(0);
            Access {
                direction: text("direction"),
                protocol: text("protocol"),
                src_identity: text("src.identity"),
                dst_identity: text("dst.identity"),
                dst_addr: text("dst.addr"),
                bytes_sent: number("bytes_sent"),
                bytes_received: number("bytes_received"),
            }
        })
        .collect()
}

/// The identity the proxy gave pod `uid` when it started its pod proxy (after the agent's `AddWorkload`).
pub fn started_identity(log: &str, uid: &str) -> Option<String> {
    log.lines()
        .filter(|l| l.contains("pod proxy started"))
        .find(|l| field(l, "uid") == Some(uid))
        .and_then(|l| field(l, "identity"))
        .map(str::to_owned)
}

/// The value of `key=value` in a tracing line, without quotes.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let needle = format!(" {key}=");
    let rest = &line[line.find(&needle)? + needle.len()..];
    match rest.strip_prefix('"') {
        Some(quoted) => quoted.split('"').next(),
        None => rest.split_whitespace().next(),
    }
}
