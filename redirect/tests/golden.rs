//! Golden tests: the sidecar generator + iptables renderer must reproduce Istio's payloads exactly.
//!
//! `plugin-sidecar` cases compare per table (as Istio's plugin test does); `sidecar-capture` cases compare the
//! whole v4 (+ v6) text after trimming. Goldens live in tests/golden and were written from the reference data.

use std::collections::BTreeMap;
use std::path::PathBuf;

use redirect::iptables::render;
use redirect::sidecar::{build, SidecarConfig};

#[macro_use]
mod sidecar_cases;

fn golden(dir: &str, name: &str) -> String {
    let path: PathBuf =
        [env!("CARGO_MANIFEST_DIR"), "tests", "golden", dir, &format!("{name}.golden")].iter().collect();
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// Line diff (LCS) so a failure shows exactly which lines are missing (-) or unexpected (+).
fn diff(expected: &str, actual: &str) -> String {
    let e: Vec<&str> = expected.lines().collect();
    let a: Vec<&str> = actual.lines().collect();
    let mut lcs = vec![vec![0usize; a.len() + 1]; e.len() + 1];
    for i in (0..e.len()).rev() {
        for j in (0..a.len()).rev() {
            lcs[i][j] = if e[i] == a[j] { lcs[i + 1][j + 1] + 1 } else { lcs[i + 1][j].max(lcs[i][j + 1]) };
        }
    }
    let (mut i, mut j, mut out) = (0, 0, String::new());
    while i < e.len() || j < a.len() {
        if i < e.len() && j < a.len() && e[i] == a[j] {
            out += &format!("  {}\n", e[i]);
            i += 1;
            j += 1;
        } else if j < a.len() && (i == e.len() || lcs[i][j + 1] >= lcs[i + 1][j]) {
            out += &format!("+ {}\n", a[j]);
            j += 1;
        } else {
            out += &format!("- {}\n", e[i]);
            i += 1;
        }
    }
    out
}

fn assert_text(case: &str, expected: &str, actual: &str) {
    let (expected, actual) = (expected.trim(), actual.trim());
    assert!(expected == actual, "{case}: payload differs (- expected, + actual):\n{}", diff(expected, actual));
}

/// Splits an iptables-restore payload into table -> block, as Istio's plugin dry-run test does.
fn tables(payload: &str) -> BTreeMap<String, String> {
    let mut map = BTreeMap::new();
    for block in payload.split("COMMIT").map(str::trim).filter(|b| !b.is_empty()) {
        let header = block.lines().next().unwrap_or_default().to_string();
        map.insert(header, block.to_string());
    }
    map
}

// ---- plugin-sidecar: settings the CNI plugin derives from the pod (INDEX §1) ----

fn check_plugin(name: &str, cfg: SidecarConfig) {
    let plan = build(&cfg);
    assert!(plan.v6.is_none(), "{name}: IPv4-only host expected");
    let expected = tables(&golden("plugin-sidecar", name));
    let actual = tables(&render(&plan.v4).unwrap());
    let keys = |m: &BTreeMap<String, String>| m.keys().cloned().collect::<Vec<_>>();
    assert_eq!(keys(&expected), keys(&actual), "{name}: tables differ");
    for (table, text) in &expected {
        assert_text(&format!("{name} {table}"), text, &actual[table]);
    }
}

plugin_tests!(check_plugin);

// ---- sidecar-capture: istio-iptables baseline plus per-case changes (INDEX §3) ----

fn check_capture(name: &str, cfg: SidecarConfig) {
    let plan = build(&cfg);
    assert_eq!(plan.v6.is_some(), cfg.enable_ipv6, "{name}: v6 payload presence");
    let mut actual = render(&plan.v4).unwrap();
    if let Some(v6) = &plan.v6 {
        actual += &render(v6).unwrap();
    }
    assert_text(name, &golden("sidecar-capture", name), &actual);
}

capture_tests!(check_capture);

// Owner groups are passed to iptables by name; nftables resolves them on the host (see nft.rs).
sidecar_tests! { check_capture, SidecarConfig::default();
    capture_outbound_owner_groups, "outbound-owner-groups", |c| {
        c.owner_groups_include = "java,202".into();
    };
    capture_outbound_owner_groups_exclude, "outbound-owner-groups-exclude", |c| {
        c.owner_groups_exclude = "888,ftp".into();
    };
    capture_ipv6_dns_outbound_owner_groups, "ipv6-dns-outbound-owner-groups", |c| {
        c.enable_ipv6 = true;
        c.redirect_dns = true;
        c.owner_groups_include = "java,202".into();
    };
    capture_ipv6_dns_outbound_owner_groups_exclude, "ipv6-dns-outbound-owner-groups-exclude", |c| {
        c.enable_ipv6 = true;
        c.redirect_dns = true;
        c.owner_groups_exclude = "888,ftp".into();
    };
}

/// The diff helper itself must flag a changed line, or the tests above could pass vacuously.
#[test]
fn diff_reports_changed_lines() {
    let d = diff("a\nb\nc", "a\nx\nc");
    assert!(d.contains("- b") && d.contains("+ x"), "{d}");
}
