//! Shared by the kernel tests: fresh test netns and a normalised view of what the kernel holds.
//!
//! The normalisation compares effect: tables, chains with hooks/priorities/policies, and every chain's rules in
//! order. Within a rule the order of the match conditions is ignored (they are ANDed) and a `!= { a, b }` set
//! match counts as `!= a` plus `!= b`.
// Each test file compiles its own copy and uses part of it.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;

use netns::Netns;
use serde_json::Value;
use testbed::NetnsGuard;

/// A fresh netns (removed on drop, also on panic) with an open handle.
pub struct TestNetns {
    pub guard: NetnsGuard,
    pub ns: Netns,
}

impl TestNetns {
    pub fn new() -> Self {
        let guard = NetnsGuard::new("redirect-nft");
        let ns = guard.open().unwrap_or_else(|e| panic!("open netns {}: {e}", guard.name()));
        Self { guard, ns }
    }

    /// Runs a command inside the netns (tests only) and returns its stdout.
    pub fn exec(&self, args: &[&str]) -> String {
        self.guard.exec_ok(args)
    }

    /// `nft -j list ruleset` inside the netns, normalised (see the module docs).
    pub fn ruleset(&self) -> BTreeMap<String, Vec<String>> {
        normalize(&self.guard.exec_json(&["nft", "-j", "list", "ruleset"]))
    }

    /// `nft list ruleset` text, for failure messages.
    pub fn text(&self) -> String {
        self.guard.exec_ok(&["nft", "list", "ruleset"])
    }

    pub fn nft_file(&self, path: &Path) {
        self.guard.exec_ok(&["nft", "-f", path.to_str().expect("utf-8 path")]);
    }

    pub fn nft(&self, args: &[&str]) {
        let mut argv = vec!["nft"];
        argv.extend_from_slice(args);
        self.guard.exec_ok(&argv);
    }

    /// Loads the `golden` nft transaction into a fresh netns and asserts this netns holds the same (normalised)
    /// ruleset; `name` labels the failure, which shows the difference and both rulesets.
    pub fn assert_matches_golden(&self, name: &str, golden: &Path) {
        let reference = TestNetns::new();
        reference.nft_file(golden);
        let (expected, actual) = (reference.ruleset(), self.ruleset());
        assert!(
            expected == actual,
            "{name}: kernel state differs from the golden\n{}\n--- ours:\n{}\n--- golden:\n{}",
            diff(&expected, &actual),
            self.text(),
            reference.text()
        );
    }
}

/// `table/chain` -> chain properties then its rules, each rule as sorted match conditions and statements.
fn normalize(json: &Value) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let items = json["nftables"].as_array().expect("nftables array");
    for item in items {
        if let Some(c) = item.get("chain") {
            let key = format!("{} {}/{}", c["family"], c["table"], c["name"]).replace('"', "");
            let props = format!("type={} hook={} prio={} policy={}", c["type"], c["hook"], c["prio"], c["policy"]);
            out.entry(key).or_default().insert(0, props);
        }
    }
    for item in items {
        if let Some(r) = item.get("rule") {
            let key = format!("{} {}/{}", r["family"], r["table"], r["chain"]).replace('"', "");
            out.entry(key).or_default().push(normalize_rule(r["expr"].as_array().expect("expr")));
        }
    }
    out
}

fn normalize_rule(exprs: &[Value]) -> String {
    let mut matches: Vec<String> = Vec::new();
    let mut rest: Vec<String> = Vec::new();
    for e in exprs {
        match e.get("match") {
            Some(m) if rest.is_empty() => match m["right"].get("set").and_then(Value::as_array) {
                Some(set) if m["op"] == "!=" => {
                    for v in set {
                        matches.push(format!("{} {} {}", m["left"], m["op"], v));
                    }
                }
                _ => matches.push(format!("{} {} {}", m["left"], m["op"], m["right"])),
            },
            _ if e.get("counter").is_some() => rest.push("counter".into()),
            _ => rest.push(e.to_string()),
        }
    }
    matches.sort();
    format!("{} | {}", matches.join(" && "), rest.join(" ; "))
}

/// Line diff of two normalised rulesets, for readable failures.
pub fn diff(expected: &BTreeMap<String, Vec<String>>, actual: &BTreeMap<String, Vec<String>>) -> String {
    let mut out = String::new();
    let keys: std::collections::BTreeSet<&String> = expected.keys().chain(actual.keys()).collect();
    for k in keys {
        let (e, a) = (expected.get(k), actual.get(k));
        if e != a {
            out += &format!("chain {k}:\n  expected: {e:#?}\n  actual:   {a:#?}\n");
        }
    }
    out
}
