//! Istio's sidecar cases, written once for both golden suites: golden.rs checks the iptables text of each case,
//! nft.rs what the nftables backend programs into a kernel. A case is a test name, a golden name and the
//! changes to a base `SidecarConfig`; [`capture_tests!`] and [`plugin_tests!`] declare one `#[test]` per case
//! that hands the golden name and the config to the suite's check function.
//!
//! Cases only one backend has a golden for stay in that suite, declared with [`sidecar_tests!`].

use ipnet::IpNet;
use redirect::sidecar::{CidrSpec, PortSpec, SidecarConfig};

/// Parses CIDR literals.
pub fn nets(list: &[&str]) -> Vec<IpNet> {
    list.iter().map(|s| s.parse().expect("cidr")).collect()
}

/// DNS redirection with proxy uids 3, 4 and gids 1, 2: the base of several of Istio's capture cases.
pub fn dns_uid_gid(c: &mut SidecarConfig) {
    c.redirect_dns = true;
    c.proxy_uids = vec![3, 4];
    c.proxy_gids = vec![1, 2];
}

/// IPv6 with inbound ports, virtual interfaces and v6 ranges: `ipv6-ipnets`, which `ipv6-uid-gid` extends.
pub fn ipv6_ipnets(c: &mut SidecarConfig) {
    c.enable_ipv6 = true;
    c.inbound_ports_include = PortSpec::List(vec![4000, 5000]);
    c.inbound_ports_exclude = vec![6000, 7000];
    c.reroute_virtual_interfaces = vec!["eth0".into(), "eth1".into()];
    c.outbound_ip_ranges_exclude = nets(&["2001:db8::/32"]);
    c.outbound_ip_ranges_include = CidrSpec::List(nets(&["2001:db8::/32"]));
}

/// One `#[test] fn <name>()` per case that calls `$check(<golden>, config)`, config being `$base` changed by
/// the case body.
macro_rules! sidecar_tests {
    ($check:path, $base:expr; $($fn:ident, $golden:literal, |$c:ident| $body:block;)*) => {
        $(
            #[test]
            fn $fn() {
                #[allow(unused_imports)]
                use redirect::sidecar::{CidrSpec, InterceptMode, PortSpec};
                #[allow(unused_imports)]
                use $crate::sidecar_cases::{dns_uid_gid, ipv6_ipnets, nets};
                #[allow(unused_mut)]
                let mut $c = $base;
                $body
                $check($golden, $c);
            }
        )*
    };
}

/// The sidecar-capture cases (istio-iptables baseline plus per-case changes, INDEX §3) both backends have
/// goldens for.
macro_rules! capture_tests {
    ($check:path) => {
        sidecar_tests! { $check, redirect::sidecar::SidecarConfig::default();
            capture_empty, "empty", |c| {};
            capture_basic_exclude_nic, "basic-exclude-nic", |c| {
                c.exclude_interfaces = vec!["not-istio-nic".into()];
            };
            capture_drop_invalid, "drop-invalid", |c| {
                c.drop_invalid = true;
            };
            capture_host_ipv4_loopback_cidr, "host-ipv4-loopback-cidr", |c| {
                c.host_ipv4_loopback_cidr = "127.0.0.1/8".parse().unwrap();
            };
            capture_inbound_ports_include, "inbound-ports-include", |c| {
                c.inbound_ports_include = PortSpec::List(vec![32000, 31000]);
            };
            capture_inbound_ports_wildcard, "inbound-ports-wildcard", |c| {
                c.inbound_ports_include = PortSpec::All;
            };
            capture_inbound_ports_tproxy, "inbound-ports-tproxy", |c| {
                c.inbound_ports_include = PortSpec::List(vec![32000, 31000]);
                c.mode = InterceptMode::Tproxy;
            };
            capture_inbound_ports_wildcard_tproxy, "inbound-ports-wildcard-tproxy", |c| {
                c.inbound_ports_include = PortSpec::All;
                c.mode = InterceptMode::Tproxy;
            };
            capture_outbound_ports_include, "outbound-ports-include", |c| {
                c.outbound_ports_include = vec![32000, 31000];
            };
            capture_ipnets, "ipnets", |c| {
                c.outbound_ip_ranges_include = CidrSpec::List(nets(&["10.0.0.0/8"]));
            };
            capture_kube_virt_interfaces, "kube-virt-interfaces", |c| {
                c.reroute_virtual_interfaces = vec!["eth1".into(), "eth2".into()];
                c.outbound_ip_ranges_include = CidrSpec::All;
            };
            capture_ipnets_with_kube_virt_interfaces, "ipnets-with-kube-virt-interfaces", |c| {
                c.reroute_virtual_interfaces = vec!["eth1".into(), "eth2".into()];
                c.outbound_ip_ranges_include = CidrSpec::List(nets(&["10.0.0.0/8"]));
            };
            capture_ip_range, "ip-range", |c| {
                dns_uid_gid(&mut c);
                c.outbound_ip_ranges_exclude = nets(&["1.1.0.0/16"]);
                c.outbound_ip_ranges_include = CidrSpec::List(nets(&["9.9.0.0/16"]));
                c.dns_servers = vec!["127.0.0.53".parse().unwrap()];
            };
            capture_loopback_outbound_iprange, "loopback-outbound-iprange", |c| {
                dns_uid_gid(&mut c);
                c.outbound_ip_ranges_include = CidrSpec::List(nets(&["127.1.2.3/32"]));
                c.dns_servers = vec!["127.0.0.53".parse().unwrap()];
            };
            capture_tproxy, "tproxy", |c| {
                c.enable_ipv6 = true;
                c.mode = InterceptMode::Tproxy;
                c.inbound_ports_include = PortSpec::All;
                c.outbound_ip_ranges_exclude = nets(&["1.1.0.0/16"]);
                c.outbound_ip_ranges_include = CidrSpec::List(nets(&["9.9.0.0/16"]));
                c.redirect_dns = true;
                c.dns_servers = vec!["127.0.0.53".parse().unwrap()];
                c.exclude_interfaces = vec!["not-istio-nic".into()];
            };
            capture_ipv6_empty_inbound_ports, "ipv6-empty-inbound-ports", |c| {
                c.enable_ipv6 = true;
            };
            capture_ipv6_inbound_ports, "ipv6-inbound-ports", |c| {
                c.enable_ipv6 = true;
                c.inbound_ports_include = PortSpec::List(vec![4000, 5000]);
            };
            capture_ipv6_virt_interfaces, "ipv6-virt-interfaces", |c| {
                c.enable_ipv6 = true;
                c.inbound_ports_include = PortSpec::List(vec![4000, 5000]);
                c.reroute_virtual_interfaces = vec!["eth0".into(), "eth1".into()];
            };
            capture_ipv6_ipnets, "ipv6-ipnets", |c| {
                ipv6_ipnets(&mut c);
            };
            capture_ipv6_uid_gid, "ipv6-uid-gid", |c| {
                ipv6_ipnets(&mut c);
                c.proxy_uids = vec![3, 4];
                c.proxy_gids = vec![1, 2];
            };
            capture_ipv6_outbound_ports, "ipv6-outbound-ports", |c| {
                c.enable_ipv6 = true;
                c.outbound_ports_include = vec![32000, 31000];
            };
            capture_dns_uid_gid, "dns-uid-gid", |c| {
                c.enable_ipv6 = true;
                dns_uid_gid(&mut c);
                c.dns_servers = vec!["127.0.0.53".parse().unwrap(), "::127.0.0.53".parse().unwrap()];
            };
            capture_ipv6_dns_uid_gid, "ipv6-dns-uid-gid", |c| {
                c.enable_ipv6 = true;
                dns_uid_gid(&mut c);
            };
        }
    };
}

/// The CNI plugin's cases (settings it derives from the pod, INDEX §1) both backends have goldens for.
macro_rules! plugin_tests {
    ($check:path) => {
        sidecar_tests! { $check, redirect::sidecar::SidecarConfig::cni_pod_defaults();
            plugin_basic, "basic", |c| {};
            plugin_include_exclude_ip, "include-exclude-ip", |c| {
                c.outbound_ip_ranges_include = CidrSpec::List(nets(&["127.0.0.0/8"]));
                c.outbound_ip_ranges_exclude = nets(&["10.0.0.0/8"]);
            };
            plugin_include_exclude_ports, "include-exclude-ports", |c| {
                c.inbound_ports_include = PortSpec::List(vec![1111, 2222]);
                use istio_contract::ports::{ENVOY_PROMETHEUS, READINESS, STATS};
                c.inbound_ports_exclude = vec![3333, 4444, STATS, READINESS, ENVOY_PROMETHEUS];
                c.outbound_ports_exclude = vec![5555, 6666];
            };
            plugin_tproxy, "tproxy", |c| {
                c.mode = InterceptMode::Tproxy;
            };
            plugin_dns, "dns", |c| {
                c.redirect_dns = true;
                c.capture_all_dns = true;
            };
            plugin_invalid_drop, "invalid-drop", |c| {
                c.drop_invalid = true;
            };
            plugin_custom_uid, "custom-uid", |c| {
                c.proxy_uids = vec![1000670000];
                c.proxy_gids = vec![1000670001];
            };
            plugin_custom_uid_tproxy, "custom-uid-tproxy", |c| {
                c.proxy_uids = vec![1000670000];
                c.proxy_gids = vec![1000670001];
                c.mode = InterceptMode::Tproxy;
            };
        }
    };
}
