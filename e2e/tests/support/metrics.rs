//! The proxy's `/metrics` as series (name, labels, value), so a test selects on the labels it means (a reporter, a
//! workload) instead of spelling a whole line: the `istio_tcp_*` series carry ztunnel's 23 labels.

use std::collections::BTreeMap;
use std::path::Path;

use istio_contract::ports;
use istio_contract::telemetry::{label, REPORTER_DESTINATION, REPORTER_SOURCE, SECURITY_POLICY_MUTUAL_TLS};

/// One line of the exposition: a sample.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// The metric name, with its suffix (`istio_tcp_sent_bytes_total`).
    pub name: String,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Its value.
    pub value: f64,
}

impl Series {
    /// Whether every `(label, value)` of `matchers` is on the series.
    pub fn matches(&self, matchers: &[(&str, &str)]) -> bool {
        matchers.iter().all(|(k, v)| self.labels.get(*k).map(String::as_str) == Some(*v))
    }
}

/// Every sample of a Prometheus text exposition (comments skipped).
pub fn parse(text: &str) -> Vec<Series> {
    text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()).filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Series> {
    let (head, value) = line.rsplit_once(' ')?;
    let value = value.parse().ok()?;
    let Some((name, rest)) = head.split_once('{') else {
        return Some(Series { name: head.to_owned(), labels: BTreeMap::new(), value });
    };
    let mut labels = BTreeMap::new();
    let mut rest = rest.strip_suffix('}')?;
    while !rest.is_empty() {
        let (key, after) = rest.split_once("=\"")?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next()? {
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                (i, '"') => break i,
                (_, c) => value.push(c),
            }
        };
        labels.insert(key.trim_start_matches(',').to_owned(), value);
        rest = &after[end + 1..];
    }
    Some(Series { name: name.to_owned(), labels, value })
}

/// The proxy's samples, scraped in the node netns `netns` (none if it does not answer).
pub fn scrape(netns: &Path) -> Vec<Series> {
    testbed::http::get(netns, ports::STATS, "/metrics").map(|(_, body)| parse(&body)).unwrap_or_default()
}

/// The sum of the samples named `name` that carry every label of `matchers` (0 if there are none).
pub fn sum(netns: &Path, name: &str, matchers: &[(&str, &str)]) -> f64 {
    scrape(netns).iter().filter(|s| s.name == name && s.matches(matchers)).map(|s| s.value).sum()
}

/// The labels of the HBONE traffic a proxy reports as the client's (`outbound`) or the server's side.
pub fn hbone(outbound: bool) -> [(&'static str, &'static str); 2] {
    let reporter = if outbound { REPORTER_SOURCE } else { REPORTER_DESTINATION };
    [(label::REPORTER, reporter), (label::CONNECTION_SECURITY_POLICY, SECURITY_POLICY_MUTUAL_TLS)]
}
