//! Golden tests: the sidecar generator + iptables renderer must reproduce Istio's payloads exactly.
//!
//! `plugin-sidecar` cases compare per table (as Istio's plugin test does); `sidecar-capture` cases compare the
//! whole v4 (+ v6) text after trimming. Goldens live in tests/golden and were written from the reference data.

use std::collections::BTreeMap;
use std::path::PathBuf;

use ipnet::IpNet;
use redirect::iptables::render;
use redirect::sidecar::{build, CidrSpec, InterceptMode, PortSpec, SidecarConfig};

fn golden(dir: &str, name: &str) -> String {
    let path: PathBuf =
        [env!("CARGO_MANIFEST_DIR"), "tests", "golden", dir, &format!("{name}.golden")].iter().collect();
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn nets(list: &[&str]) -> Vec<IpNet> {
    list.iter().map(|s| s.parse().expect("cidr")).collect()
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
    let actual = tables(&render(&plan.v4));
    let keys = |m: &BTreeMap<String, String>| m.keys().cloned().collect::<Vec<_>>();
    assert_eq!(keys(&expected), keys(&actual), "{name}: tables differ");
    for (table, text) in &expected {
        assert_text(&format!("{name} {table}"), text, &actual[table]);
    }
}

macro_rules! plugin_case {
    ($fn:ident, $golden:literal, |$c:ident| $body:block) => {
        #[test]
        fn $fn() {
            let mut $c = SidecarConfig::cni_pod_defaults();
            $body
            check_plugin($golden, $c);
        }
    };
}

plugin_case!(plugin_basic, "basic", |_c| {});
plugin_case!(plugin_include_exclude_ip, "include-exclude-ip", |c| {
    c.outbound_ip_ranges_include = CidrSpec::List(nets(&["127.0.0.0/8"]));
    c.outbound_ip_ranges_exclude = nets(&["10.0.0.0/8"]);
});
plugin_case!(plugin_include_exclude_ports, "include-exclude-ports", |c| {
    c.inbound_ports_include = PortSpec::List(vec![1111, 2222]);
    c.inbound_ports_exclude = vec![3333, 4444, 15020, 15021, 15090];
    c.outbound_ports_exclude = vec![5555, 6666];
});
plugin_case!(plugin_tproxy, "tproxy", |c| {
    c.mode = InterceptMode::Tproxy;
});
plugin_case!(plugin_dns, "dns", |c| {
    c.redirect_dns = true;
    c.capture_all_dns = true;
});
plugin_case!(plugin_invalid_drop, "invalid-drop", |c| {
    c.drop_invalid = true;
});
plugin_case!(plugin_custom_uid, "custom-uid", |c| {
    c.proxy_uids = vec![1000670000];
    c.proxy_gids = vec![1000670001];
});
plugin_case!(plugin_custom_uid_tproxy, "custom-uid-tproxy", |c| {
    c.proxy_uids = vec![1000670000];
    c.proxy_gids = vec![1000670001];
    c.mode = InterceptMode::Tproxy;
});

// ---- sidecar-capture: istio-iptables baseline plus per-case changes (INDEX §3) ----

fn check_capture(name: &str, cfg: SidecarConfig) {
    let plan = build(&cfg);
    assert_eq!(plan.v6.is_some(), cfg.enable_ipv6, "{name}: v6 payload presence");
    let mut actual = render(&plan.v4);
    if let Some(v6) = &plan.v6 {
        actual += &render(v6);
    }
    assert_text(name, &golden("sidecar-capture", name), &actual);
}

macro_rules! capture_case {
    ($fn:ident, $golden:literal, |$c:ident| $body:block) => {
        #[test]
        fn $fn() {
            #[allow(unused_mut)]
            let mut $c = SidecarConfig::default();
            $body
            check_capture($golden, $c);
        }
    };
}

fn dns_uid_gid(c: &mut SidecarConfig) {
    c.redirect_dns = true;
    c.proxy_uids = vec![3, 4];
    c.proxy_gids = vec![1, 2];
}

capture_case!(capture_empty, "empty", |c| {});
capture_case!(capture_basic_exclude_nic, "basic-exclude-nic", |c| {
    c.exclude_interfaces = vec!["not-istio-nic".into()];
});
capture_case!(capture_drop_invalid, "drop-invalid", |c| {
    c.drop_invalid = true;
});
capture_case!(capture_host_ipv4_loopback_cidr, "host-ipv4-loopback-cidr", |c| {
    c.host_ipv4_loopback_cidr = "127.0.0.1/8".parse().unwrap();
});
capture_case!(capture_inbound_ports_include, "inbound-ports-include", |c| {
    c.inbound_ports_include = PortSpec::List(vec![32000, 31000]);
});
capture_case!(capture_inbound_ports_wildcard, "inbound-ports-wildcard", |c| {
    c.inbound_ports_include = PortSpec::All;
});
capture_case!(capture_inbound_ports_tproxy, "inbound-ports-tproxy", |c| {
    c.inbound_ports_include = PortSpec::List(vec![32000, 31000]);
    c.mode = InterceptMode::Tproxy;
});
capture_case!(capture_inbound_ports_wildcard_tproxy, "inbound-ports-wildcard-tproxy", |c| {
    c.inbound_ports_include = PortSpec::All;
    c.mode = InterceptMode::Tproxy;
});
capture_case!(capture_outbound_ports_include, "outbound-ports-include", |c| {
    c.outbound_ports_include = vec![32000, 31000];
});
capture_case!(capture_outbound_owner_groups, "outbound-owner-groups", |c| {
    c.owner_groups_include = "java,202".into();
});
capture_case!(capture_outbound_owner_groups_exclude, "outbound-owner-groups-exclude", |c| {
    c.owner_groups_exclude = "888,ftp".into();
});
capture_case!(capture_ipnets, "ipnets", |c| {
    c.outbound_ip_ranges_include = CidrSpec::List(nets(&["10.0.0.0/8"]));
});
capture_case!(capture_kube_virt_interfaces, "kube-virt-interfaces", |c| {
    c.reroute_virtual_interfaces = vec!["eth1".into(), "eth2".into()];
    c.outbound_ip_ranges_include = CidrSpec::All;
});
capture_case!(capture_ipnets_with_kube_virt_interfaces, "ipnets-with-kube-virt-interfaces", |c| {
    c.reroute_virtual_interfaces = vec!["eth1".into(), "eth2".into()];
    c.outbound_ip_ranges_include = CidrSpec::List(nets(&["10.0.0.0/8"]));
});
capture_case!(capture_ip_range, "ip-range", |c| {
    dns_uid_gid(&mut c);
    c.outbound_ip_ranges_exclude = nets(&["1.1.0.0/16"]);
    c.outbound_ip_ranges_include = CidrSpec::List(nets(&["9.9.0.0/16"]));
    c.dns_servers = vec!["127.0.0.53".parse().unwrap()];
});
capture_case!(capture_loopback_outbound_iprange, "loopback-outbound-iprange", |c| {
    dns_uid_gid(&mut c);
    c.outbound_ip_ranges_include = CidrSpec::List(nets(&["127.1.2.3/32"]));
    c.dns_servers = vec!["127.0.0.53".parse().unwrap()];
});
capture_case!(capture_tproxy, "tproxy", |c| {
    c.enable_ipv6 = true;
    c.mode = InterceptMode::Tproxy;
    c.inbound_ports_include = PortSpec::All;
    c.outbound_ip_ranges_exclude = nets(&["1.1.0.0/16"]);
    c.outbound_ip_ranges_include = CidrSpec::List(nets(&["9.9.0.0/16"]));
    c.redirect_dns = true;
    c.dns_servers = vec!["127.0.0.53".parse().unwrap()];
    c.exclude_interfaces = vec!["not-istio-nic".into()];
});
capture_case!(capture_ipv6_empty_inbound_ports, "ipv6-empty-inbound-ports", |c| {
    c.enable_ipv6 = true;
});
capture_case!(capture_ipv6_inbound_ports, "ipv6-inbound-ports", |c| {
    c.enable_ipv6 = true;
    c.inbound_ports_include = PortSpec::List(vec![4000, 5000]);
});
capture_case!(capture_ipv6_virt_interfaces, "ipv6-virt-interfaces", |c| {
    c.enable_ipv6 = true;
    c.inbound_ports_include = PortSpec::List(vec![4000, 5000]);
    c.reroute_virtual_interfaces = vec!["eth0".into(), "eth1".into()];
});
capture_case!(capture_ipv6_ipnets, "ipv6-ipnets", |c| {
    c.enable_ipv6 = true;
    c.inbound_ports_include = PortSpec::List(vec![4000, 5000]);
    c.inbound_ports_exclude = vec![6000, 7000];
    c.reroute_virtual_interfaces = vec!["eth0".into(), "eth1".into()];
    c.outbound_ip_ranges_exclude = nets(&["2001:db8::/32"]);
    c.outbound_ip_ranges_include = CidrSpec::List(nets(&["2001:db8::/32"]));
});
capture_case!(capture_ipv6_uid_gid, "ipv6-uid-gid", |c| {
    c.enable_ipv6 = true;
    c.inbound_ports_include = PortSpec::List(vec![4000, 5000]);
    c.inbound_ports_exclude = vec![6000, 7000];
    c.reroute_virtual_interfaces = vec!["eth0".into(), "eth1".into()];
    c.outbound_ip_ranges_exclude = nets(&["2001:db8::/32"]);
    c.outbound_ip_ranges_include = CidrSpec::List(nets(&["2001:db8::/32"]));
    c.proxy_uids = vec![3, 4];
    c.proxy_gids = vec![1, 2];
});
capture_case!(capture_ipv6_outbound_ports, "ipv6-outbound-ports", |c| {
    c.enable_ipv6 = true;
    c.outbound_ports_include = vec![32000, 31000];
});
capture_case!(capture_dns_uid_gid, "dns-uid-gid", |c| {
    c.enable_ipv6 = true;
    dns_uid_gid(&mut c);
    c.dns_servers = vec!["127.0.0.53".parse().unwrap(), "::127.0.0.53".parse().unwrap()];
});
capture_case!(capture_ipv6_dns_uid_gid, "ipv6-dns-uid-gid", |c| {
    c.enable_ipv6 = true;
    dns_uid_gid(&mut c);
});
capture_case!(capture_ipv6_dns_outbound_owner_groups, "ipv6-dns-outbound-owner-groups", |c| {
    c.enable_ipv6 = true;
    c.redirect_dns = true;
    c.owner_groups_include = "java,202".into();
});
capture_case!(capture_ipv6_dns_outbound_owner_groups_exclude, "ipv6-dns-outbound-owner-groups-exclude", |c| {
    c.enable_ipv6 = true;
    c.redirect_dns = true;
    c.owner_groups_exclude = "888,ftp".into();
});

/// The diff helper itself must flag a changed line, or the tests above could pass vacuously.
#[test]
fn diff_reports_changed_lines() {
    let d = diff("a\nb\nc", "a\nx\nc");
    assert!(d.contains("- b") && d.contains("+ x"), "{d}");
}
