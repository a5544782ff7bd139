//! Appending another local process's metrics to ours. The istio-cni pod runs install-cni and the node agent as two
//! containers, each with its own registry, but Prometheus scrapes the one port the pod's `prometheus.io/port`
//! names (15014, as in Istio's chart, where one process serves every istio-cni metric). So the node agent's
//! `/metrics` fetches install-cni's over loopback and appends the families it does not export itself.
//!
//! The source is a peer, not a trusted part of us: with `ambient.shareHostNetworkNamespace` the pod shares the
//! node's loopback, where any host process could hold the port. So the fetch is bounded in time and size, and the
//! text is checked line by line (names, label sets and escapes, values, each sample in its own family) before
//! anything of it is served: a malformed exposition would make Prometheus drop the whole scrape, the node agent's
//! own metrics with it.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::{Request, StatusCode};

/// The most a merged source's exposition may hold.
const MAX_BODY: usize = 4 << 20;
/// How long fetching it may take, from connect to its last byte: well inside Prometheus's default scrape timeout
/// (10 s), so a hung source costs its metrics, not the scrape.
pub(super) const FETCH_TIMEOUT: Duration = Duration::from_secs(2);
/// The line an OpenMetrics exposition ends with.
const EOF: &str = "# EOF";

/// Why a source's metrics were left out of a scrape.
#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    /// Connecting, the exchange or reading the body failed, or took longer than [`FETCH_TIMEOUT`].
    #[error("fetching http://{addr}/metrics: {reason}")]
    Fetch {
        /// The source.
        addr: SocketAddr,
        /// What failed.
        reason: String,
    },
    /// Another scrape's fetch from the source did not end within [`FETCH_TIMEOUT`].
    #[error("metrics of {addr}: another scrape was fetching them for longer than {FETCH_TIMEOUT:?}")]
    Busy {
        /// The source.
        addr: SocketAddr,
    },
    /// The source's text is not an OpenMetrics exposition this server can pass on.
    #[error("metrics of {addr} are malformed, line {line}: {reason}")]
    Malformed {
        /// The source.
        addr: SocketAddr,
        /// 1-based line number in the fetched text.
        line: usize,
        /// What is wrong with it.
        reason: &'static str,
    },
}

/// A local process whose metrics `/metrics` appends, fetched by one scrape at a time: a flood of scrapes, or a
/// slow source, holds one fetch's connection and buffers (at most [`MAX_BODY`] and its copies), not one per
/// scrape.
#[derive(Debug)]
pub struct Source {
    addr: SocketAddr,
    fetching: tokio::sync::Mutex<()>,
}

impl Source {
    /// The process serving `GET http://{addr}/metrics`.
    pub fn new(addr: SocketAddr) -> Self {
        Source { addr, fetching: tokio::sync::Mutex::new(()) }
    }

    /// Fetches the source's metrics and appends them to `own` (see [`append`]). Waits at most [`FETCH_TIMEOUT`]
    /// for another scrape's fetch to end.
    pub async fn append_to(&self, own: &mut String) -> Result<Vec<String>, MergeError> {
        let addr = self.addr;
        let _turn =
            tokio::time::timeout(FETCH_TIMEOUT, self.fetching.lock()).await.map_err(|_| MergeError::Busy { addr })?;
        let text = fetch(addr).await?;
        append(own, &text, addr)
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.addr.fmt(f)
    }
}

/// Fetches `GET /metrics` from `addr`, bounded in time ([`FETCH_TIMEOUT`]) and size ([`MAX_BODY`]).
async fn fetch(addr: SocketAddr) -> Result<String, MergeError> {
    let failed = |reason: String| MergeError::Fetch { addr, reason };
    tokio::time::timeout(FETCH_TIMEOUT, exchange(addr))
        .await
        .map_err(|_| failed(format!("no answer within {FETCH_TIMEOUT:?}")))?
        .map_err(failed)
}

async fn exchange(addr: SocketAddr) -> Result<String, String> {
    let stream = tokio::net::TcpStream::connect(addr).await.map_err(|e| format!("connect: {e}"))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let request = Request::get("/metrics")
        .header(hyper::header::HOST, addr.to_string())
        .body(Empty::<Bytes>::new())
        .map_err(|e| e.to_string())?;
    let answer = async move {
        let response = sender.send_request(request).await.map_err(|e| format!("request: {e}"))?;
        if response.status() != StatusCode::OK {
            return Err(format!("status {}", response.status()));
        }
        let body = Limited::new(response.into_body(), MAX_BODY)
            .collect()
            .await
            .map_err(|e| format!("body (at most {MAX_BODY} bytes): {e}"))?
            .to_bytes();
        String::from_utf8(Vec::from(body)).map_err(|_| "body is not UTF-8".to_owned())
        // The sender goes here, so the connection below ends once the answer is read.
    };
    // The connection is driven here, not on a task of its own, so nothing of it outlives the fetch: the caller's
    // timeout drops it with the socket.
    let (answer, _) = tokio::join!(answer, conn);
    answer
}

/// The suffixes OpenMetrics lets a sample's name add to its family's name.
const SUFFIXES: [&str; 9] = ["", "_total", "_created", "_bucket", "_count", "_sum", "_info", "_gcount", "_gsum"];
/// The metric types of a `# TYPE` line.
const TYPES: [&str; 8] = ["counter", "gauge", "histogram", "gaugehistogram", "stateset", "info", "summary", "unknown"];

/// Appends the families of `source` (an OpenMetrics exposition fetched from `addr`) to `own` (ours, as
/// `prometheus_client` encodes it, ending with `# EOF`), leaving out families `own` already has: a name exported
/// twice would make Prometheus reject the scrape. Returns the names left out. On error `own` is unchanged.
fn append(own: &mut String, source: &str, addr: SocketAddr) -> Result<Vec<String>, MergeError> {
    let ours: HashSet<&str> = own.lines().filter_map(|l| descriptor(l).map(|(name, _)| name)).collect();
    let mut kept = String::new();
    let mut skipped: Vec<String> = Vec::new();
    let mut seen: HashSet<&str> = HashSet::new();
    // The family the current lines belong to, and whether they are kept.
    let mut family: Option<(&str, bool)> = None;
    let mut ended = false;
    for (index, line) in source.lines().enumerate() {
        let malformed = |reason| MergeError::Malformed { addr, line: index + 1, reason };
        if ended {
            return Err(malformed("text after # EOF"));
        }
        if line == EOF {
            ended = true;
            continue;
        }
        if line.starts_with('#') {
            let (name, _) = descriptor(line).ok_or_else(|| malformed("a malformed # line"))?;
            if family.is_none_or(|(current, _)| current != name) {
                if !seen.insert(name) {
                    return Err(malformed("a family appears twice"));
                }
                let keep = !ours.contains(name);
                if !keep {
                    skipped.push(name.to_owned());
                }
                family = Some((name, keep));
            }
        } else {
            let name = sample_name(line).ok_or_else(|| malformed("not a sample line"))?;
            let of_family =
                |(current, _): (&str, bool)| name.strip_prefix(current).is_some_and(|s| SUFFIXES.contains(&s));
            if !family.is_some_and(of_family) {
                return Err(malformed("a sample outside its family"));
            }
        }
        if family.is_some_and(|(_, keep)| keep) {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    if !ended {
        let line = source.lines().count();
        return Err(MergeError::Malformed { addr, line, reason: "no # EOF at the end" });
    }
    let body = own.strip_suffix("# EOF\n").unwrap_or(own).to_owned();
    *own = body + &kept + EOF + "\n";
    Ok(skipped)
}

/// `# HELP`, `# TYPE` (with a known type) or `# UNIT` line: the family name and the rest.
fn descriptor(line: &str) -> Option<(&str, &str)> {
    let (kind, rest) = ["HELP", "TYPE", "UNIT"].iter().find_map(|kind| {
        let rest = line.strip_prefix("# ")?.strip_prefix(kind)?.strip_prefix(' ')?;
        Some((*kind, rest))
    })?;
    let (name, rest) = rest.split_once(' ').unwrap_or((rest, ""));
    (is_metric_name(name) && (kind != "TYPE" || TYPES.contains(&rest))).then_some((name, rest))
}

/// The metric name of a whole, well-formed sample line: `name[{label="value",...}] value [timestamp]`.
fn sample_name(line: &str) -> Option<&str> {
    let (name, mut rest) = line.split_at(line.find(['{', ' '])?);
    if let Some(labels) = rest.strip_prefix('{') {
        rest = after_labels(labels)?;
    }
    let mut numbers = rest.strip_prefix(' ')?.split(' ');
    let value_and_time_parse = numbers.by_ref().take(2).all(|n| n.parse::<f64>().is_ok());
    (is_metric_name(name) && value_and_time_parse && numbers.next().is_none()).then_some(name)
}

/// The text after a label set's closing brace, if `labels` (the text after its opening brace) is a well-formed
/// `name="value",...}` with only the escapes `\\`, `\"` and `\n` in values.
fn after_labels(labels: &str) -> Option<&str> {
    let mut rest = labels;
    if let Some(after) = rest.strip_prefix('}') {
        return Some(after);
    }
    loop {
        let (name, value) = rest.split_once("=\"")?;
        if !is_label_name(name) {
            return None;
        }
        let mut escaped = false;
        let close = value.char_indices().find_map(|(i, c)| match (escaped, c) {
            (true, '\\' | '"' | 'n') => {
                escaped = false;
                None
            }
            (true, _) => Some(None),
            (false, '\\') => {
                escaped = true;
                None
            }
            (false, '"') => Some(Some(i)),
            (false, _) => None,
        })??;
        rest = &value[close + 1..];
        if let Some(after) = rest.strip_prefix('}') {
            return Some(after);
        }
        rest = rest.strip_prefix(',')?;
    }
}

/// `[a-zA-Z_:][a-zA-Z0-9_:]*`, the metric name syntax.
fn is_metric_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// `[a-zA-Z_][a-zA-Z0-9_]*`, the label name syntax.
fn is_label_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr() -> SocketAddr {
        "127.0.0.1:15015".parse().unwrap()
    }

    const OWN: &str = "# HELP nodeagent_up Up.\n# TYPE nodeagent_up gauge\nnodeagent_up 1\n\
                       # HELP istio_build Build.\n# TYPE istio_build gauge\nistio_build{tag=\"a\"} 1\n# EOF\n";
    const INSTALL: &str = "# HELP istio_cni_install_ready Ready.\n# TYPE istio_cni_install_ready gauge\n\
                           istio_cni_install_ready 1\n# HELP istio_build Build.\n# TYPE istio_build gauge\n\
                           istio_build{tag=\"b\"} 1\n# HELP istio_cni_installs Installs.\n\
                           # TYPE istio_cni_installs counter\nistio_cni_installs_total{result=\"SUCCESS\"} 2\n# EOF\n";

    #[test]
    fn the_source_families_follow_ours_and_one_eof_ends_the_text() {
        let mut own = OWN.to_owned();
        let skipped = append(&mut own, INSTALL, addr()).unwrap();
        assert_eq!(skipped, ["istio_build"], "a family we export ourselves is left out");
        assert!(own.starts_with(OWN.strip_suffix("# EOF\n").unwrap()), "ours come first, unchanged:\n{own}");
        assert!(own.contains("istio_cni_install_ready 1\n"));
        assert!(own.contains("istio_cni_installs_total{result=\"SUCCESS\"} 2\n"));
        assert!(!own.contains("tag=\"b\""), "the source's istio_build is not served:\n{own}");
        assert_eq!(own.matches("# EOF").count(), 1);
        assert!(own.ends_with("\n# EOF\n"));
    }

    #[test]
    fn a_malformed_source_leaves_ours_unchanged() {
        for (source, reason) in [
            ("# TYPE a gauge\na 1\n", "no # EOF at the end"),
            ("# TYPE a gauge\na 1\n# EOF\nb 1\n", "text after # EOF"),
            ("b 1\n# EOF\n", "a sample outside its family"),
            ("# TYPE a gauge\nb 1\n# EOF\n", "a sample outside its family"),
            ("# TYPE a gauge\n\n# EOF\n", "not a sample line"),
            ("# TYPE a gauge\na 1\n# TYPE c gauge\nc 1\n# TYPE a gauge\n# EOF\n", "a family appears twice"),
            ("# TYPE 1a gauge\n# EOF\n", "a malformed # line"),
            ("# TYPE a gauges\n# EOF\n", "a malformed # line"),
            ("# comment\n# EOF\n", "a malformed # line"),
            // What would make Prometheus reject the whole scrape, ours included.
            ("# TYPE a gauge\na{x=\"1} 1\n# EOF\n", "not a sample line"),
            ("# TYPE a gauge\na{x=\"1\\q\"} 1\n# EOF\n", "not a sample line"),
            ("# TYPE a gauge\na{1x=\"1\"} 1\n# EOF\n", "not a sample line"),
            ("# TYPE a gauge\na{x=\"1\"}} 1\n# EOF\n", "not a sample line"),
            ("# TYPE a gauge\na one\n# EOF\n", "not a sample line"),
            ("# TYPE a gauge\na 1 2 3\n# EOF\n", "not a sample line"),
            // A family that is a prefix of ours must not smuggle in our series.
            ("# TYPE nodeagent gauge\nnodeagent_up 5\n# EOF\n", "a sample outside its family"),
        ] {
            let mut own = OWN.to_owned();
            match append(&mut own, source, addr()) {
                Err(MergeError::Malformed { reason: got, .. }) => assert_eq!(got, reason, "{source:?}"),
                other => panic!("{source:?}: {other:?}"),
            }
            assert_eq!(own, OWN, "{source:?}");
        }
    }

    #[tokio::test]
    async fn fetching_from_a_port_nobody_listens_on_names_the_source() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let error = fetch(addr).await.unwrap_err().to_string();
        assert!(error.starts_with(&format!("fetching http://{addr}/metrics: connect")), "{error}");
    }
}
