//! A one-line summary of the redirect rules inside a pod: which backend holds them, Istio's chain names and the
//! ports traffic is redirected to, read back from the kernel with each backend's own tool.

use std::collections::BTreeSet;

use testbed::NetnsGuard;

/// The rules found in one pod.
#[derive(Debug, Default)]
pub struct Summary {
    /// The backend that holds them (`iptables-nft`, `iptables-legacy` or `nftables`); `None` without rules.
    pub backend: Option<&'static str>,
    /// Istio's chains (iptables) or `table/chain` names (native nftables).
    pub chains: BTreeSet<String>,
    /// Ports traffic is redirected (REDIRECT) or diverted (TPROXY) to.
    pub targets: BTreeSet<u16>,
    /// How many rules.
    pub rules: usize,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Some(backend) = self.backend else { return write!(f, "no Istio rules") };
        let chains = self.chains.iter().cloned().collect::<Vec<_>>().join(" ");
        let targets = self.targets.iter().map(|p| format!(":{p}")).collect::<Vec<_>>().join(" ");
        write!(f, "{} rules ({backend}) in {chains}; redirect to {targets}", self.rules)
    }
}

/// Reads the rules in `ns`, trying the iptables backends first and native nftables last.
pub fn summarize(ns: &NetnsGuard) -> Summary {
    for (backend, tool) in [("iptables-nft", "iptables-nft-save"), ("iptables-legacy", "iptables-legacy-save")] {
        let dump = ns.exec(&[tool]);
        let summary = from_iptables(backend, &String::from_utf8_lossy(&dump.stdout));
        if summary.backend.is_some() {
            return summary;
        }
    }
    from_nft(&String::from_utf8_lossy(&ns.exec(&["nft", "list", "ruleset"]).stdout))
}

fn from_iptables(backend: &'static str, dump: &str) -> Summary {
    let mut summary = Summary::default();
    for line in dump.lines() {
        if let Some(chain) = line.strip_prefix(':').and_then(|l| l.split_whitespace().next()) {
            if chain.starts_with("ISTIO") {
                summary.chains.insert(chain.to_owned());
            }
        } else if line.starts_with("-A ") {
            summary.rules += 1;
            summary.targets.extend(port_after(line, "--to-ports").into_iter().chain(port_after(line, "--on-port")));
        }
    }
    if !summary.chains.is_empty() {
        summary.backend = Some(backend);
    }
    summary
}

fn from_nft(dump: &str) -> Summary {
    let mut summary = Summary::default();
    let mut table = None;
    for line in dump.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("table ") {
            table = rest.split_whitespace().nth(1).filter(|name| name.starts_with("istio")).map(str::to_owned);
        } else if let Some(table) = &table {
            if let Some(chain) = line.strip_prefix("chain ").and_then(|l| l.split_whitespace().next()) {
                summary.chains.insert(format!("{table}/{chain}"));
            } else if !line.is_empty() && !line.ends_with('{') && line != "}" && !line.starts_with("type ") {
                summary.rules += 1;
                if line.contains("redirect") || line.contains("tproxy") {
                    summary.targets.extend(port_after_colon(line));
                }
            }
        }
    }
    if !summary.chains.is_empty() {
        summary.backend = Some("nftables");
    }
    summary
}

/// The port in the word after `flag` (`--to-ports 15001`, `--on-port 15008`).
fn port_after(line: &str, flag: &str) -> Option<u16> {
    let mut words = line.split_whitespace();
    words.find(|w| *w == flag)?;
    words.next()?.trim_start_matches(':').split(['-', ':']).next()?.parse().ok()
}

/// The port in `redirect to :15001` or `tproxy ip to :15008`.
fn port_after_colon(line: &str) -> Option<u16> {
    let at = line.find(" to :")?;
    line[at + 5..].split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}
