//! Differential conformance of the sidecar plugin against Istio's own `istio-cni` plugin (#29).
//!
//! Istio's binary, built from the Go module proxy at a pinned version by `scripts/istio-ref/build.sh` (a test
//! reference only: nothing of Istio's is in our code or images), and ours run on the same node, with the same
//! netconf (only `type` differs), the same kubeconfig and the same Pod object in the fake API server. Each pod is
//! added once through `bridge` + Istio's plugin in one netns and once through `bridge` + ours in another; then each
//! netns's `iptables-save` (both address families, nft and legacy) and its policy routing (TPROXY's `ip rule` and
//! table, IPv6's `::6` on `lo`) must be equal, normalized only for chain order, comment lines and counters. Where
//! Istio refuses a pod, ours must refuse it too with a CNI error (and program nothing); where Istio accepts it, so
//! must we. The differences we make on purpose (docs/plugin.md, "Where we differ from Istio") are listed in
//! [`intended`] and [`Difference`] with their reason; nothing else may differ.
//!
//! Without Istio's binaries the tests print `SKIPPED: ...` and pass, unless `ISTIO_REF_REQUIRED=1`.
//! `ISTIO_DIFF_PODS` sets the number of generated pods for iptables (default 500), `ISTIO_DIFF_NFT_PODS` for native
//! nftables (default 200), `ISTIO_DIFF_SEED` the seed (hex), `ISTIO_DIFF_JOBS` the pods run at once (default 2).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use istio_contract::names;
use serde_json::{json, Value};
use testbed::mesh::{annotate, proxy_env, sidecar_pod};
use testbed::node::pod_attachment;
use testbed::rule_dump::{normalize_iptables_save, normalize_nft_ruleset};
use testbed::runtime::{NetworkConfigList, RuntimeError};
use testbed::{Cluster, NetnsGuard};

const NS: &str = "shop";
/// The plugin type Istio's binary is installed under in the node's bin dir.
const ISTIO_TYPE: &str = "istio-cni-istio";

/// Istio's `istio-cni` binary, or `None` (after printing why) when it is not built and not required.
fn istio_plugin() -> Option<PathBuf> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/istio-ref/build.sh");
    let out = Command::new("bash").arg(&script).arg("bin-dir").output().expect("run scripts/istio-ref/build.sh");
    let bin = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("istio-cni");
    if bin.is_file() {
        return Some(bin);
    }
    let why = format!("Istio's binaries not built; run scripts/istio-ref/build.sh ({} missing)", bin.display());
    assert!(std::env::var("ISTIO_REF_REQUIRED").as_deref() != Ok("1"), "ISTIO_REF_REQUIRED=1: {why}");
    eprintln!("SKIPPED: {why}");
    None
}

/// A node with both plugins installed, and the conflists that run each (the same netconf, only `type` differs).
struct Bench {
    c: Cluster,
    v6_subnet: String,
    native_nftables: bool,
}

impl Bench {
    /// With `native_nftables` false, no backend override: both plugins pick the iptables flavour themselves (nft in
    /// a fresh pod netns). With it, both get `native_nftables: true`.
    fn new(istio: &Path, native_nftables: bool) -> Self {
        let mut c = Cluster::new();
        c.plugin_overrides = if native_nftables { json!({ "native_nftables": true }) } else { json!({}) };
        c.node.install_plugin(ISTIO_TYPE, istio);
        let v6_subnet = format!("fd00:{:x}:{:x}::/64", std::process::id() % 0xffff, c.node.gateway().octets()[2]);
        Self { c, v6_subnet, native_nftables }
    }

    fn conflist(&self, istio: bool, dual_stack: bool) -> NetworkConfigList {
        let mut list = self.c.conflist();
        if istio {
            list["plugins"][1]["type"] = json!(ISTIO_TYPE);
        }
        if dual_stack {
            list["plugins"][0]["ipam"]["ranges"].as_array_mut().unwrap().push(json!([{ "subnet": self.v6_subnet }]));
        }
        NetworkConfigList::from_value(list).unwrap()
    }

    /// ADD of the stored pod `name` through one plugin in a fresh netns; the netns's rules and routing after it
    /// (also after a failed ADD), then DEL (which releases the address).
    fn add(&self, istio: bool, name: &str, dual_stack: bool) -> (Outcome, Dump) {
        let list = self.conflist(istio, dual_stack);
        let netns = self.c.node.pod_netns();
        let uid = self.c.api.get("Pod", Some(NS), name).and_then(|p| p["metadata"]["uid"].as_str().map(String::from));
        let conf = pod_attachment(&netns, NS, name, uid.as_deref().unwrap_or_default());
        let outcome = match self.c.node.runtime().add(&list, &conf) {
            Ok(_) => Outcome::Added,
            Err(RuntimeError::Plugin(e)) => Outcome::Refused { plugin: e.plugin.clone(), code: e.code, msg: e.msg },
            Err(e) => panic!("ADD of {name} through {}: {e}", list.plugins[1]["type"]),
        };
        let state = dump(&netns, self.native_nftables);
        if let Err(e) = self.c.node.runtime().del(&list, &conf) {
            panic!("DEL of {name}: {e}");
        }
        (outcome, state)
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Outcome {
    Added,
    Refused { plugin: String, code: Option<u64>, msg: String },
}

/// Everything either plugin may change in the pod netns, in one exec, by section (`iptables-nft-save`,
/// `ip6tables-nft-save`, the legacy pair, `ip rule`, `ip -6 rule`, TPROXY's table 133 of each family and the
/// addresses on `lo`), each normalized ([`normalize`]). With `nft`, the whole `nft list ruleset` (normalized by
/// [`normalize_nft`]) instead of the `iptables-nft-save` pair.
fn dump(ns: &NetnsGuard, nft: bool) -> Dump {
    const IPTABLES: &str = "for t in iptables-nft-save ip6tables-nft-save; do echo \"## $t\"; $t; done; ";
    const NFT: &str = "echo '## nft'; nft list ruleset; ";
    const SCRIPT: &str = "for t in iptables-legacy-save ip6tables-legacy-save; do echo \"## $t\"; $t; done; \
        echo '## ip rule'; ip rule show; echo '## ip -6 rule'; ip -6 rule show; \
        echo '## route 133'; ip -d route show table 133; echo '## route6 133'; ip -d -6 route show table 133; \
        echo '## lo'; ip -o -4 addr show dev lo | awk '{print $3, $4}'; \
        echo '## lo6'; ip -o -6 addr show dev lo | awk '{print $3, $4}'";
    let script = format!("{}{SCRIPT}", if nft { NFT } else { IPTABLES });
    let out = ns.exec(&["sh", "-c", &script]);
    assert!(out.status.success(), "dump in {}: {}", ns.name(), String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let mut sections = BTreeMap::new();
    for part in text.split("## ").filter(|p| !p.is_empty()) {
        let (name, body) = part.split_once('\n').unwrap_or((part, ""));
        let body = if name == "nft" { normalize_nft_ruleset(body) } else { normalize_iptables_save(body) };
        sections.insert(name.to_string(), body);
    }
    Dump(sections)
}

/// A netns's state by section; IPv6 sections are those named `ip6…`, `… -6 …`, `route6 …` and `lo6`.
#[derive(Debug, Clone, PartialEq)]
struct Dump(BTreeMap<String, String>);

impl Dump {
    fn is_v6(section: &str) -> bool {
        section.starts_with("ip6") || section.contains("-6") || section.starts_with("route6") || section == "lo6"
    }

    /// Only the IPv4 sections.
    /// Only the IPv4 sections; in the nft ruleset, the rules that name no IPv6 address.
    fn v4(&self) -> Dump {
        let v4_lines = |v: &str| v.lines().filter(|l| !l.contains("ip6 ")).collect::<Vec<_>>().join("\n");
        Dump(
            self.0
                .iter()
                .filter(|(k, _)| !Self::is_v6(k))
                .map(|(k, v)| (k.clone(), if k == "nft" { v4_lines(v) } else { v.clone() }))
                .collect(),
        )
    }

    /// Every section's lines sorted: the same rules in any order (Istio's nft layout orders a chain's RETURN rules
    /// differently with and without IPv6).
    fn sorted(&self) -> Dump {
        let sorted = |v: &String| {
            let mut lines: Vec<&str> = v.lines().collect();
            lines.sort_unstable();
            lines.join("\n")
        };
        Dump(self.0.iter().map(|(k, v)| (k.clone(), sorted(v))).collect())
    }

    /// Whether IPv6 rules were programmed.
    fn has_v6_rules(&self) -> bool {
        self.0.get("ip6tables-nft-save").is_some_and(|t| t.contains("ISTIO"))
            || self.0.get("nft").is_some_and(|t| t.contains("ip6 "))
    }

    /// The nft ruleset with each rule's words in a canonical order and `X != { a, b }` spelled `X != a X != b`:
    /// equal when the rules are the same conjunctions of the same matches, in whatever order nft prints them.
    fn nft_matches(&self) -> Dump {
        let canonical = |rule: &str| {
            let mut words: Vec<String> = Vec::new();
            let mut rest = rule.split_whitespace().peekable();
            while let Some(w) = rest.next() {
                if w == "{" && words.len() >= 3 && words[words.len() - 1] == "!=" {
                    let prefix: Vec<String> = words.split_off(words.len() - 3);
                    for item in rest.by_ref().take_while(|w| *w != "}") {
                        words.extend(prefix.iter().cloned());
                        words.push(item.trim_end_matches(',').to_string());
                    }
                } else {
                    words.push(w.to_string());
                }
            }
            words.sort();
            words.join(" ")
        };
        let nft = self.0.get("nft").map(|v| v.lines().map(canonical).collect::<Vec<_>>().join("\n"));
        let mut d = self.clone();
        if let Some(nft) = nft {
            d.0.insert("nft".into(), nft);
        }
        d
    }

    /// Without the tables Istio's iptables detection leaves behind: a `nat` table holding only its built-in
    /// chains, all ACCEPT, no rules (see [`intended`]).
    fn without_probe_tables(&self) -> Dump {
        const PROBE: &str = "*nat\n:INPUT ACCEPT\n:OUTPUT ACCEPT\n:POSTROUTING ACCEPT\n:PREROUTING ACCEPT\nCOMMIT";
        Dump(self.0.iter().map(|(k, v)| (k.clone(), v.replace(PROBE, "").trim().to_string())).collect())
    }

    fn text(&self) -> String {
        self.0.iter().map(|(k, v)| format!("## {k}\n{v}")).collect::<Vec<_>>().join("\n")
    }
}

/// One generated (or hand-picked) pod and whether it gets an IPv6 address.
#[derive(Debug, Clone)]
struct Case {
    what: String,
    pod: Value,
    dual_stack: bool,
}

impl Case {
    fn annotation(&self, key: &str) -> Option<&str> {
        self.pod["metadata"]["annotations"][key].as_str()
    }

    fn proxy_env(&self, key: &str) -> Option<&str> {
        let containers = self.pod["spec"]["containers"].as_array()?;
        let proxy = containers.iter().find(|c| c["name"] == "istio-proxy")?;
        proxy["env"].as_array()?.iter().find(|e| e["name"] == key)?["value"].as_str()
    }
}

const PORT_ANNOTATIONS: [&str; 4] = [
    names::INCLUDE_INBOUND_PORTS,
    names::EXCLUDE_INBOUND_PORTS,
    names::INCLUDE_OUTBOUND_PORTS,
    names::EXCLUDE_OUTBOUND_PORTS,
];
const CIDR_ANNOTATIONS: [&str; 2] = [names::INCLUDE_OUTBOUND_IP_RANGES, names::EXCLUDE_OUTBOUND_IP_RANGES];

/// The differences we make on purpose, each listed in docs/plugin.md ("Where we differ from Istio").
///
/// - Istio's iptables detection probes every flavour and family by adding and deleting a rule in its `nat` table
///   (`-t nat -A INPUT -p 255 -j RETURN`), which leaves an empty `nat` table (built-in chains, ACCEPT, no rules) in
///   each of them; we touch only the tables we program. Stripped from both dumps before comparing.
/// - Port 0 is refused (code 7); Istio lets it through to a rule that matches nothing.
/// - A proxy uid or gid of 4294967295 (`(uid_t) -1`) is refused (code 7); Istio's native nftables programs an owner
///   match no process can meet (its iptables refuses it too).
/// - A failed ADD leaves no rules: where iptables refuses what Istio generated (`*` in an outbound port list), Istio
///   keeps the tables it had already restored; ours refuses the pod before programming anything.
///
/// Returns the difference's name and its reason.
fn intended(case: &Case, ours: &Outcome, istio: &Outcome, our_dump: &Dump) -> Option<(&'static str, &'static str)> {
    let programmed = |d: &Dump| d.text().contains("ISTIO") || d.text().contains("lookup 133");
    if matches!((ours, istio), (Outcome::Refused { code: Some(_), .. }, Outcome::Refused { .. }))
        && !programmed(our_dump)
    {
        return Some((
            "FailedAddLeavesNoRules",
            "Istio left the rules of its failed ADD behind (docs/plugin.md: a failed ADD leaves no partial rules)",
        ));
    }
    let has_port_zero =
        PORT_ANNOTATIONS.iter().filter_map(|a| case.annotation(a)).any(|v| v.split(',').any(|p| p.trim() == "0"));
    match (ours, istio) {
        (Outcome::Refused { code: Some(7), msg, .. }, Outcome::Added) if msg.contains("outside 0..=4294967294") => {
            Some((
                "UidMinusOneRefused",
                "uid/gid 4294967295, (uid_t) -1, is refused (docs/plugin.md); Istio's nft takes it, its iptables not",
            ))
        }
        (Outcome::Refused { code: Some(7), .. }, Outcome::Added) if has_port_zero => Some((
            "PortZeroRefused",
            "port 0 is refused (docs/plugin.md: no connection can use it, a rule naming it matches nothing)",
        )),
        _ => None,
    }
}

/// The intended differences that show in the rules or the outcome of a pod Istio and we both handle, each listed with
/// its reason in docs/plugin.md ("Where we differ from Istio, and why"). [`Difference::reason`] is the short form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Difference {
    /// Istio programs IPv6 rules only when the pod netns's first non-loopback, non-link-local address is IPv6,
    /// or `ISTIO_DUAL_STACK=true` and the netns has an IPv6 address; ours whenever the pod got an IPv6 address
    /// or `ISTIO_DUAL_STACK=true`.
    Ipv6Decision,
    /// `interceptionMode: NONE`: Istio refuses the pod (`interceptionMode invalid: NONE`); ours passes it through.
    InterceptionModeNone,
    /// A CIDR list item that is a bare address, has spaces around it or is empty: Istio refuses the pod (Go's
    /// `netip.ParsePrefix` on each `,`-separated item); ours accepts it.
    LenientCidrList,
    /// A port list with an empty item (`80,,90`, `80,`): Istio refuses the pod; ours skips the item.
    LenientPortList,
    /// An interface list item that does not match `^[a-zA-Z][a-zA-Z0-9_.-]*$` after trimming (`a:b`, `x@y`,
    /// `0eth`) or is empty: Istio refuses the pod; ours accepts `:` and `@`, a leading digit, and skips empty items.
    LenientInterfaceName,
    /// `*` in `excludeInboundPorts`, `includeOutboundPorts` or `excludeOutboundPorts`: Istio's checks take it (every
    /// port annotation takes the wildcard) and the pod starts where the list goes unused; ours refuses the pod.
    WildcardPortList,
    /// Native nftables: the same rules with their matches in another order (`iifname "lo" meta l4proto tcp` against
    /// our `meta l4proto tcp iifname "lo"`), or a set (`tcp dport != { 53, 15008 }`) spelled as two matches.
    NftMatchOrder,
    /// Native nftables with `INVALID_DROP=true`: Istio drops invalid TCP only (`meta l4proto tcp ct state invalid`);
    /// ours every protocol (`ct state invalid`), as both do with iptables.
    NftInvalidDropTcpOnly,
}

impl Difference {
    fn reason(self) -> &'static str {
        match self {
            Difference::Ipv6Decision => {
                "IPv6 is captured whenever the pod has an IPv6 address: Istio's first-address rule lets a dual-stack \
                 pod listed IPv4-first send IPv6 around the proxy"
            }
            Difference::InterceptionModeNone => {
                "interceptionMode NONE asks for no capture: we program nothing and let the pod start; Istio fails the ADD"
            }
            Difference::LenientCidrList => {
                "a bare address is its /32 or /128, spaces are trimmed, empty items skipped: each has one reading"
            }
            Difference::LenientPortList => "an empty port list item is skipped: it has one reading",
            Difference::LenientInterfaceName => {
                "interface names are checked as the kernel checks them (a leading digit, ':' and '@' are names), \
                 empty items skipped"
            }
            Difference::WildcardPortList => {
                "'*' is a port list only in includeInboundPorts: elsewhere Istio hands it to iptables, which refuses \
                 the rule where the list is used; we refuse the pod up front, naming the annotation"
            }
            Difference::NftMatchOrder => "the same nftables rule with its matches in another order",
            Difference::NftInvalidDropTcpOnly => {
                "INVALID_DROP drops every protocol's invalid packets with nftables too, as with iptables"
            }
        }
    }
}

/// The intended [`Difference`] that explains how the two outcomes differ, if one does.
fn difference(case: &Case, ours: &Outcome, istio: &Outcome, ours_dump: &Dump, istio_dump: &Dump) -> Option<Difference> {
    let dual_env = case.proxy_env("ISTIO_DUAL_STACK").is_some_and(|v| go_bool(v) == Some(true));
    if (case.dual_stack || dual_env)
        && ours == istio
        && *ours == Outcome::Added
        && ours_dump.v4().nft_matches().sorted() == nft_invalid_drop_as_ours(istio_dump).v4().nft_matches().sorted()
    {
        // Istio: the pod's first address is IPv4 here, so IPv6 rules only with ISTIO_DUAL_STACK and an address.
        if istio_dump.has_v6_rules() == (case.dual_stack && dual_env) && ours_dump.has_v6_rules() {
            return Some(Difference::Ipv6Decision);
        }
    }
    if ours == istio && *ours == Outcome::Added && ours_dump.0.contains_key("nft") {
        let (o, i) = (ours_dump.nft_matches(), istio_dump.nft_matches());
        if o == i {
            return Some(Difference::NftMatchOrder);
        }
        let i = nft_invalid_drop_as_ours(istio_dump).nft_matches();
        if case.proxy_env("INVALID_DROP").and_then(go_bool) == Some(true) && i == o {
            return Some(Difference::NftInvalidDropTcpOnly);
        }
    }
    let our_msg = |needle: &str| matches!(ours, Outcome::Refused { msg, .. } if msg.contains(needle));
    if matches!(istio, Outcome::Added)
        && our_msg("\"*\"")
        && PORT_ANNOTATIONS.iter().filter_map(|a| case.annotation(a)).any(|v| v == "*")
    {
        return Some(Difference::WildcardPortList);
    }
    // The rest: Istio refuses, we add; Istio's message must name the reason.
    let Outcome::Refused { msg: istio_msg, .. } = istio else { return None };
    if *ours != Outcome::Added {
        return None;
    }
    let istio_says = |needles: &[&str]| needles.iter().any(|n| istio_msg.contains(n));
    if case.annotation(names::INTERCEPTION_MODE) == Some("NONE") && istio_says(&["interceptionMode invalid: NONE"]) {
        return Some(Difference::InterceptionModeNone);
    }
    let go_cidr_ok = |item: &str| item == item.trim() && item.contains('/') && item.split('/').count() == 2;
    if CIDR_ANNOTATIONS
        .iter()
        .filter_map(|a| case.annotation(a))
        .any(|v| v != "*" && !v.is_empty() && v.split(',').any(|i| !go_cidr_ok(i)))
        && istio_says(&["failed parsing cidr"])
    {
        return Some(Difference::LenientCidrList);
    }
    if PORT_ANNOTATIONS
        .iter()
        .filter_map(|a| case.annotation(a))
        .any(|v| v != "*" && !v.trim().is_empty() && v.trim().split(',').any(|i| i.trim().is_empty()))
        && istio_says(&["failed parsing port \"\""])
    {
        return Some(Difference::LenientPortList);
    }
    let go_interface_ok = |item: &str| {
        let item = item.trim();
        item.starts_with(|c: char| c.is_ascii_alphabetic())
            && item.chars().all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
    };
    if [names::EXCLUDE_INTERFACES, names::REROUTE_VIRTUAL_INTERFACES, names::KUBEVIRT_INTERFACES]
        .iter()
        .filter_map(|a| case.annotation(a))
        .any(|v| !v.is_empty() && v.split(',').any(|i| !go_interface_ok(i)))
        && istio_says(&["contains invalid characters", "empty interface name"])
    {
        return Some(Difference::LenientInterfaceName);
    }
    None
}

/// Istio's nft dump with its TCP-only invalid drop spelled as ours ([`Difference::NftInvalidDropTcpOnly`]), so a pod that
/// also differs in another known way is compared on the rest.
fn nft_invalid_drop_as_ours(d: &Dump) -> Dump {
    let ours = |v: &String| v.replace("meta l4proto tcp ct state invalid", "ct state invalid");
    Dump(d.0.iter().map(|(k, v)| (k.clone(), if k == "nft" { ours(v) } else { v.clone() })).collect())
}

/// Go's `strconv.ParseBool`.
fn go_bool(v: &str) -> Option<bool> {
    match v {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

/// What a run found.
#[derive(Debug, Default)]
struct Tally {
    added: usize,
    refused: usize,
    intended: BTreeMap<String, usize>,
    unexplained: Vec<String>,
}

/// Runs every case through both plugins (`ISTIO_DIFF_JOBS` pods at a time, default 2) and tallies the outcomes.
fn differential(b: &Bench, cases: &[Case]) -> Tally {
    let jobs: usize = std::env::var("ISTIO_DIFF_JOBS").ok().and_then(|j| j.parse().ok()).unwrap_or(2).max(1);
    let started = Instant::now();
    let tally = std::sync::Mutex::new(Tally::default());
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(case) = cases.get(i) else { break };
                one(b, i, case, &tally);
            });
        }
    });
    let tally = tally.into_inner().unwrap();
    eprintln!(
        "{} pods in {:.1?}: {} added and {} refused alike, intended differences {:?}, {} unexplained",
        cases.len(),
        started.elapsed(),
        tally.added,
        tally.refused,
        tally.intended,
        tally.unexplained.len()
    );
    tally
}

fn one(b: &Bench, i: usize, case: &Case, tally: &std::sync::Mutex<Tally>) {
    let name = format!("p{i}");
    let mut pod = case.pod.clone();
    pod["metadata"]["name"] = json!(name);
    b.c.create(&pod);
    let (istio, istio_dump) = b.add(true, &name, case.dual_stack);
    let (ours, our_dump) = b.add(false, &name, case.dual_stack);
    b.c.api.delete("Pod", Some(NS), &name);
    let (istio_dump, our_dump) = (istio_dump.without_probe_tables(), our_dump.without_probe_tables());
    let what = format!("case {i} ({}; dual stack {}): {}", case.what, case.dual_stack, pod["metadata"]);
    let mut t = tally.lock().unwrap();
    let same = istio_dump == our_dump;
    match (&ours, &istio) {
        (Outcome::Added, Outcome::Added) if same => {
            t.added += 1;
            return;
        }
        (Outcome::Refused { code: Some(_), .. }, Outcome::Refused { .. }) if same => {
            t.refused += 1;
            eprintln!("both refused, {what}\n  Istio: {istio:?}\n  ours:  {ours:?}");
            return;
        }
        _ => {}
    }
    if let Some((name, reason)) = intended(case, &ours, &istio, &our_dump) {
        *t.intended.entry(name.into()).or_default() += 1;
        eprintln!("intended difference, {what}: {reason}");
        return;
    }
    if let Some(d) = difference(case, &ours, &istio, &our_dump, &istio_dump) {
        *t.intended.entry(format!("{d:?}")).or_default() += 1;
        eprintln!("intended difference {d:?} ({}), {what}\n  Istio: {istio:?}\n  ours:  {ours:?}", d.reason());
        return;
    }
    t.unexplained
        .push(format!("{what}\n  Istio: {istio:?}\n  ours:  {ours:?}\n{}", diff(&istio_dump.text(), &our_dump.text())));
}

/// `diff -u` of the two dumps, `-` Istio's, `+` ours.
fn diff(istio: &str, ours: &str) -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a, b) = (dir.path().join("istio"), dir.path().join("ours"));
    std::fs::write(&a, format!("{istio}\n")).unwrap();
    std::fs::write(&b, format!("{ours}\n")).unwrap();
    let out = Command::new("diff").arg("-U2").arg(&a).arg(&b).output().expect("run diff");
    String::from_utf8_lossy(&out.stdout).lines().skip(2).map(|l| format!("  {l}")).collect::<Vec<_>>().join("\n")
}

fn assert_none(tally: Tally) {
    let u = &tally.unexplained;
    assert!(u.is_empty(), "{} unexplained differences:\n{}", u.len(), u.join("\n\n"));
}

/// Sets the `istio-proxy` container's securityContext field `key`.
fn proxy_security(mut pod: Value, key: &str, value: i64) -> Value {
    let containers = pod["spec"]["containers"].as_array_mut().unwrap();
    let proxy = containers.iter_mut().find(|c| c["name"] == "istio-proxy").unwrap();
    proxy["securityContext"][key] = json!(value);
    pod
}

fn case(what: &str, pod: Value) -> Case {
    Case { what: what.into(), pod, dual_stack: false }
}

fn hand_picked() -> Vec<Case> {
    let p = || sidecar_pod(NS, "x");
    let a = |k: &str, v: &str| annotate(p(), k, v);
    let mut cases = vec![
        case("plain sidecar", p()),
        case("TPROXY", a(names::INTERCEPTION_MODE, "TPROXY")),
        case("REDIRECT", a(names::INTERCEPTION_MODE, "REDIRECT")),
        case("include inbound *", a(names::INCLUDE_INBOUND_PORTS, "*")),
        case("include inbound list", a(names::INCLUDE_INBOUND_PORTS, "80,8080")),
        case("include inbound empty", a(names::INCLUDE_INBOUND_PORTS, "")),
        case("exclude inbound", a(names::EXCLUDE_INBOUND_PORTS, "9090,15020")),
        case("include outbound ports", a(names::INCLUDE_OUTBOUND_PORTS, "3306")),
        case("exclude outbound ports", a(names::EXCLUDE_OUTBOUND_PORTS, "5432,6379")),
        case("include outbound ranges", a(names::INCLUDE_OUTBOUND_IP_RANGES, "10.0.0.0/8,192.168.0.0/16")),
        case("include outbound empty", a(names::INCLUDE_OUTBOUND_IP_RANGES, "")),
        case("exclude outbound ranges", a(names::EXCLUDE_OUTBOUND_IP_RANGES, "10.96.0.0/12")),
        case("exclude interfaces", a(names::EXCLUDE_INTERFACES, "eth1,net1")),
        case("reroute virtual interfaces", a(names::REROUTE_VIRTUAL_INTERFACES, "tap0,k6t-eth0")),
        case("kubevirt interfaces", a(names::KUBEVIRT_INTERFACES, "tap0")),
        case("proxy uid/gid", proxy_security(proxy_security(p(), "runAsUser", 1234), "runAsGroup", 4321)),
        case("proxy uid 0", proxy_security(p(), "runAsUser", 0)),
        case("DNS capture", proxy_env(p(), "ISTIO_META_DNS_CAPTURE", "true")),
        case("INVALID_DROP", proxy_env(p(), "INVALID_DROP", "true")),
        case("dual stack env", proxy_env(p(), "ISTIO_DUAL_STACK", "true")),
        case("invalid mode", a(names::INTERCEPTION_MODE, "FOO")),
        case("mode NONE", a(names::INTERCEPTION_MODE, "NONE")),
        case("invalid port", a(names::EXCLUDE_INBOUND_PORTS, "http")),
        case("port out of range", a(names::INCLUDE_OUTBOUND_PORTS, "70000")),
        case("invalid CIDR", a(names::EXCLUDE_OUTBOUND_IP_RANGES, "10.0.0.0/33")),
        case("bare address", a(names::EXCLUDE_OUTBOUND_IP_RANGES, "10.1.2.3")),
        case("interface name 16 bytes", a(names::EXCLUDE_INTERFACES, "abcdefghijklmnop")),
        case("interface name with a space", a(names::EXCLUDE_INTERFACES, "eth0 -j ACCEPT")),
    ];
    // Pods that pass through untouched, and proxy ids no uid can have.
    let mut no_status = p();
    no_status["metadata"]["annotations"].as_object_mut().unwrap().remove(names::SIDECAR_STATUS_ANNOTATION);
    cases.push(case("no sidecar status", no_status));
    cases.push(case("inject annotation false", a(names::SIDECAR_INJECT, "false")));
    let mut label_false = a(names::SIDECAR_INJECT, "true");
    label_false["metadata"]["labels"] = json!({ names::SIDECAR_INJECT: "false" });
    cases.push(case("inject label false wins", label_false));
    cases.push(case("DISABLE_ENVOY", proxy_env(p(), "DISABLE_ENVOY", "true")));
    let mut init = p();
    init["spec"]["initContainers"] = json!([{ "name": names::INIT_CONTAINER, "image": "proxyv2" }]);
    cases.push(case("istio-init present", init));
    let mut router = p();
    router["spec"]["containers"][1]["args"] = json!(["proxy", "router"]);
    cases.push(case("proxy type router", router));
    let mut native = p();
    let proxy = native["spec"]["containers"].as_array_mut().unwrap().remove(1);
    native["spec"]["initContainers"] = json!([proxy]);
    native["spec"]["initContainers"][0]["restartPolicy"] = json!("Always");
    cases.push(case("native sidecar", native));
    for id in [-1, 4294967295, 4294967296] {
        cases.push(case(&format!("runAsUser {id}"), proxy_security(p(), "runAsUser", id)));
        cases.push(case(&format!("runAsGroup {id}"), proxy_security(p(), "runAsGroup", id)));
    }
    let mut v6 = case("IPv6 address", p());
    v6.dual_stack = true;
    cases.push(v6);
    for (what, mode) in [("IPv6 with ISTIO_DUAL_STACK", "REDIRECT"), ("IPv6 TPROXY with ISTIO_DUAL_STACK", "TPROXY")] {
        let pod = proxy_env(a(names::INTERCEPTION_MODE, mode), "ISTIO_DUAL_STACK", "true");
        let pod = proxy_env(pod, "ISTIO_META_DNS_CAPTURE", "true");
        let pod = annotate(pod, names::EXCLUDE_OUTBOUND_IP_RANGES, "fd00::/8,10.0.0.0/8");
        let pod = annotate(pod, names::INCLUDE_INBOUND_PORTS, "80,8080");
        cases.push(Case { what: what.into(), pod, dual_stack: true });
    }
    let mut v6 = case("IPv6 TPROXY with v6 ranges", a(names::INTERCEPTION_MODE, "TPROXY"));
    v6.pod = annotate(v6.pod, names::EXCLUDE_OUTBOUND_IP_RANGES, "fd00::/8,10.0.0.0/8");
    v6.dual_stack = true;
    cases.push(v6);
    cases
}

#[test]
fn hand_picked_sidecar_pods_get_istios_rules_or_istios_refusal() {
    let Some(istio) = istio_plugin() else { return };
    let b = Bench::new(&istio, false);
    assert_none(differential(&b, &hand_picked()));
}

/// A deterministic generator (Knuth's MMIX LCG): the same seed, the same pods, so a failure replays.
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }

    /// True with probability `percent`/100.
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    fn pick<'a>(&mut self, from: &[&'a str]) -> &'a str {
        from[self.below(from.len() as u64) as usize]
    }

    /// 1 to `max` items drawn by `item`, joined with `,`.
    fn list(&mut self, max: u64, mut item: impl FnMut(&mut Self) -> String) -> String {
        let n = 1 + self.below(max);
        (0..n).map(|_| item(self)).collect::<Vec<_>>().join(",")
    }
}

fn port(r: &mut Lcg) -> String {
    if r.chance(30) {
        (1 + r.below(65535)).to_string()
    } else {
        r.pick(&["80", "443", "8080", "9090", "15001", "15006", "15008", "15020", "15021", "15090", "3306", "53"])
            .into()
    }
}

/// A port annotation value: mostly a valid list, sometimes `*`, empty, or malformed.
fn ports(r: &mut Lcg, wildcard: bool) -> String {
    match r.below(100) {
        0..=79 => r.list(4, port),
        80..=86 if wildcard => "*".into(),
        87..=89 => String::new(),
        _ => {
            let bad = r.pick(&["0", "65536", "http", " 80", "80 ", "-1", "+80", "0x50", "80,", ",80", "80,,90", "1e3"]);
            format!("{},{bad}", r.list(2, port))
        }
    }
}

fn cidr(r: &mut Lcg) -> String {
    match r.below(10) {
        0..=2 => format!("10.{}.0.0/16", r.below(256)),
        3 => format!("192.168.{}.0/24", r.below(256)),
        4 => format!("fd{:02x}::/16", r.below(256)),
        _ => r
            .pick(&["10.96.0.0/12", "172.16.0.0/12", "169.254.169.254/32", "0.0.0.0/0", "2001:db8::/32", "::/0"])
            .into(),
    }
}

/// An IP range annotation value: mostly a valid list, sometimes `*`, empty, or malformed.
fn cidrs(r: &mut Lcg, wildcard: bool) -> String {
    match r.below(100) {
        0..=79 => r.list(3, cidr),
        80..=86 if wildcard => "*".into(),
        87..=89 => String::new(),
        _ => {
            let bad = r.pick(&["10.1.2.3", " 10.0.0.0/8", "10.0.0.0/33", "10.0.0.0/8,", "300.0.0.0/8", "fd00::/129"]);
            format!("{},{bad}", r.list(2, cidr))
        }
    }
}

/// An interface list: mostly valid names, sometimes too long or with a forbidden byte.
fn interfaces(r: &mut Lcg) -> String {
    let name = |r: &mut Lcg| {
        if r.chance(95) {
            r.pick(&["eth1", "net1", "tap0", "k6t-eth0", "veth_a", "en0.100", "wg0", "a:b", "x@y"]).to_string()
        } else {
            r.pick(&["abcdefghijklmnop", "eth0;x", "eth 0", ""]).to_string()
        }
    };
    r.list(3, name)
}

/// A generated sidecar pod: every annotation and proxy setting the plugin reads, each present or not.
fn generated(r: &mut Lcg) -> Case {
    let mut pod = sidecar_pod(NS, "x");
    let mut what = Vec::new();
    let set = |pod: &mut Value, key: &str, value: String, what: &mut Vec<String>| {
        what.push(format!("{key}={value:?}"));
        pod["metadata"]["annotations"][key] = json!(value);
    };
    if r.chance(40) {
        let mode = if r.chance(95) { r.pick(&["REDIRECT", "TPROXY"]) } else { r.pick(&["NONE", "redirect", ""]) };
        set(&mut pod, names::INTERCEPTION_MODE, mode.into(), &mut what);
    }
    for (key, wildcard, percent) in [
        (names::INCLUDE_INBOUND_PORTS, true, 30),
        (names::EXCLUDE_INBOUND_PORTS, true, 30),
        (names::INCLUDE_OUTBOUND_PORTS, true, 20),
        (names::EXCLUDE_OUTBOUND_PORTS, true, 30),
    ] {
        if r.chance(percent) {
            let v = ports(r, wildcard);
            set(&mut pod, key, v, &mut what);
        }
    }
    for (key, wildcard) in [(names::INCLUDE_OUTBOUND_IP_RANGES, true), (names::EXCLUDE_OUTBOUND_IP_RANGES, false)] {
        if r.chance(30) {
            let v = cidrs(r, wildcard);
            set(&mut pod, key, v, &mut what);
        }
    }
    for key in [names::EXCLUDE_INTERFACES, names::REROUTE_VIRTUAL_INTERFACES, names::KUBEVIRT_INTERFACES] {
        if r.chance(15) {
            let v = interfaces(r);
            set(&mut pod, key, v, &mut what);
        }
    }
    for key in ["runAsUser", "runAsGroup"] {
        if r.chance(25) {
            let id = match r.below(10) {
                0 => 0,
                1 => 1337,
                _ => 1 + r.below(70000) as i64,
            };
            what.push(format!("{key}={id}"));
            pod = proxy_security(pod, key, id);
        }
    }
    for (key, percent) in [("ISTIO_META_DNS_CAPTURE", 30), ("INVALID_DROP", 15), ("ISTIO_DUAL_STACK", 15)] {
        if r.chance(percent) {
            let v = if r.chance(90) { r.pick(&["true", "false"]) } else { r.pick(&["1", "yes", "TRUE", ""]) };
            what.push(format!("{key}={v:?}"));
            pod = proxy_env(pod, key, v);
        }
    }
    let dual_stack = r.chance(25);
    Case { what: what.join(" "), pod, dual_stack }
}

/// `n` generated pods from `ISTIO_DIFF_SEED` (default 0x1529).
fn generated_cases(n: usize) -> Vec<Case> {
    let seed = std::env::var("ISTIO_DIFF_SEED")
        .ok()
        .and_then(|s| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok())
        .unwrap_or(0x1529);
    eprintln!("seed 0x{seed:x} (ISTIO_DIFF_SEED), {n} pods");
    let mut r = Lcg(seed);
    (0..n).map(|_| generated(&mut r)).collect()
}

fn env_count(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|n| n.parse().ok()).unwrap_or(default)
}

#[test]
fn generated_sidecar_pods_get_istios_rules_or_istios_refusal() {
    let Some(istio) = istio_plugin() else { return };
    let cases = generated_cases(env_count("ISTIO_DIFF_PODS", 500));
    let b = Bench::new(&istio, false);
    assert_none(differential(&b, &cases));
}

#[test]
fn generated_sidecar_pods_get_istios_native_nftables_rules_or_istios_refusal() {
    let Some(istio) = istio_plugin() else { return };
    let cases = generated_cases(env_count("ISTIO_DIFF_NFT_PODS", 200));
    let b = Bench::new(&istio, true);
    assert_none(differential(&b, &cases));
}

#[test]
fn hand_picked_sidecar_pods_get_istios_native_nftables_rules_or_istios_refusal() {
    let Some(istio) = istio_plugin() else { return };
    let b = Bench::new(&istio, true);
    assert_none(differential(&b, &hand_picked()));
}
