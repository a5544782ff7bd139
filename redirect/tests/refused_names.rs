//! Defence in depth, in real network namespaces: a plan built without validation (a caller that skipped
//! `istio_contract::validate`) whose interface name holds a newline and a rule, or is 16 bytes long, is refused
//! by every backend (iptables legacy, iptables nft, native nftables), for sidecar and ambient plans alike, and
//! leaves the netns without a rule.

use redirect::ambient::{self, InpodConfig};
use redirect::backend::Backend;
use redirect::iptables::IptablesBackend;
use redirect::sidecar::{build, SidecarConfig};
use support::TestNetns;

mod support;

const BACKENDS: [Backend; 3] =
    [Backend::Nftables, Backend::Iptables(IptablesBackend::Nft), Backend::Iptables(IptablesBackend::Legacy)];

/// Names no rule may carry: an injected rule, a 16-byte name (one over the kernel's limit), a blank.
const UNSAFE: [&str; 3] = ["eth9\n-I OUTPUT -j ACCEPT", "abcdefghijklmnop", "eth0 -j ACCEPT"];

/// Every rule in the netns: nf_tables rules (native nftables and iptables-nft) and x_tables rules (legacy), both
/// families. Empty tables and built-in chains, which a cleanup may leave, hold no rule.
fn rules(t: &TestNetns) -> Vec<String> {
    let nft = t.guard.exec_json(&["nft", "-j", "list", "ruleset"]);
    let nft_rules =
        nft["nftables"].as_array().into_iter().flatten().filter_map(|i| i.get("rule")).map(|r| r.to_string());
    let legacy = ["iptables-legacy-save", "ip6tables-legacy-save"].iter().flat_map(|tool| {
        t.exec(&[tool])
            .lines()
            .filter(|l| l.starts_with("-A ") || l.starts_with("-I "))
            .map(String::from)
            .collect::<Vec<_>>()
    });
    nft_rules.chain(legacy).collect()
}

fn assert_untouched(t: &TestNetns, backend: Backend, name: &str) {
    let left = rules(t);
    assert!(left.is_empty(), "{backend} {name:?} left rules:\n{}", left.join("\n"));
}

#[test]
fn a_sidecar_plan_with_an_unsafe_interface_name_is_refused_by_every_backend() {
    for backend in BACKENDS {
        for name in UNSAFE {
            for (what, cfg) in [
                (
                    "exclude",
                    SidecarConfig { exclude_interfaces: vec![name.into()], ..SidecarConfig::cni_pod_defaults() },
                ),
                (
                    "reroute",
                    SidecarConfig {
                        reroute_virtual_interfaces: vec![name.into()],
                        ..SidecarConfig::cni_pod_defaults()
                    },
                ),
            ] {
                let t = TestNetns::new();
                let err = backend.program(&t.ns, &build(&cfg)).expect_err("an unsafe name must be refused");
                assert!(err.to_string().contains("interface name"), "{backend} {what} {name:?}: {err}");
                assert_untouched(&t, backend, name);
            }
        }
    }
}

#[test]
fn an_ambient_plan_with_an_unsafe_interface_name_is_refused_by_every_backend() {
    for backend in BACKENDS {
        for name in UNSAFE {
            let t = TestNetns::new();
            let plan = ambient::build(&InpodConfig { virtual_interfaces: vec![name.into()], ..InpodConfig::default() });
            let err = backend.apply_ambient(&t.ns, &plan).expect_err("an unsafe name must be refused");
            assert!(err.to_string().contains("interface name"), "{backend} {name:?}: {err}");
            assert_untouched(&t, backend, name);
        }
    }
}

#[test]
fn a_15_byte_interface_name_is_programmed_whole_by_every_backend() {
    let name = "abcdefghijklmno";
    for backend in BACKENDS {
        let t = TestNetns::new();
        let cfg = SidecarConfig { exclude_interfaces: vec![name.into()], ..SidecarConfig::cni_pod_defaults() };
        backend.program(&t.ns, &build(&cfg)).unwrap_or_else(|e| panic!("{backend}: {e}"));
        let all = rules(&t).join("\n");
        assert!(all.contains(&format!("-o {name} ")) || all.contains(&format!("\"{name}\"")), "{backend}:\n{all}");
    }
}
