//! hbone-proxy's local workload file (ztunnel's local-config YAML), parsed as the file source does, then each
//! workload's identity built as the directory does. Invariants: an identity that builds carries exactly the
//! workload's namespace, service account and trust domain, and its SPIFFE URI parses back to the same identity.

#![no_main]

use hbone::Identity;
use hbone_proxy::directory::parse_local_config;
use libfuzzer_sys::fuzz_target;

const DEFAULT_TRUST_DOMAIN: &str = "cluster.local";

fuzz_target!(|text: &str| {
    let Ok(workloads) = parse_local_config(text) else { return };
    for w in workloads {
        let td = if w.trust_domain.is_empty() { DEFAULT_TRUST_DOMAIN } else { &w.trust_domain };
        let Ok(id) = Identity::new(td, &w.namespace, &w.service_account) else { continue };
        assert_eq!(
            (id.trust_domain.as_str(), &id.namespace, &id.service_account),
            (td, &w.namespace, &w.service_account)
        );
        assert_eq!(id.to_string().parse::<Identity>().as_ref(), Ok(&id), "{id} does not parse back");
    }
});
