//! `CNI_ARGS` and the `CNI_*` environment. The input is up to six newline-separated values for
//! `CNI_COMMAND`, `CNI_CONTAINERID`, `CNI_NETNS`, `CNI_IFNAME`, `CNI_ARGS` and `CNI_PATH`. Invariants: parsed
//! args are trimmed, non-empty keys that survive rendering and re-parsing unchanged; an accepted invocation has
//! every variable its command requires and a usable interface name; a rejected one is spec error 4.

#![no_main]

use std::collections::HashMap;

use cni::{CniArgs, Command, Invocation};
use libfuzzer_sys::fuzz_target;

const VARS: [&str; 6] = ["CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_ARGS", "CNI_PATH"];

fuzz_target!(|text: &str| {
    let args = CniArgs::parse(text);
    for (k, v) in &args.all {
        assert!(!k.is_empty() && k.trim() == k && !k.contains(['=', ';']), "key {k:?}");
        assert!(v.trim() == v && !v.contains(';'), "value {v:?}");
    }
    let rendered = args.all.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(";");
    assert_eq!(CniArgs::parse(&rendered), args, "re-parsing {rendered:?}");
    assert_eq!(args.pod_name(), args.all.get("K8S_POD_NAME").map(String::as_str).filter(|v| !v.is_empty()));

    let env: HashMap<String, String> =
        VARS.iter().zip(text.split('\n')).map(|(k, v)| (k.to_string(), v.into())).collect();
    match Invocation::from_env(&env) {
        Ok(inv) => {
            let required: &[&str] = match inv.command {
                Command::Add | Command::Check => &[&inv.container_id, &inv.netns, &inv.ifname],
                Command::Del => &[&inv.container_id, &inv.ifname],
                Command::Version | Command::Status | Command::Gc => &[],
            };
            assert!(required.iter().all(|v| !v.is_empty()), "{inv:?}");
            assert!(inv.ifname.len() <= 15 && !inv.ifname.contains('/'), "{inv:?}");
            assert!(inv.path.iter().all(|p| !p.is_empty() && !p.contains(':')), "{inv:?}");
        }
        Err(e) => assert_eq!(e.code, 4, "{e}"),
    }
});
