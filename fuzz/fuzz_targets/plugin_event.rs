//! The plugin event the node agent reads from `POST /cmdadd` and `POST /podsetup`, and the answer the plugin reads
//! back (each decoded exactly like this). Invariants: a decoded message serialises back to JSON that decodes to
//! the same message, and every address an event yields is one of its `IPs` entries' `address` without the prefix
//! length.

#![no_main]

use cni::plugin_event::{CmdAdd, PodSetup, PodSetupAnswer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(setup) = serde_json::from_slice::<PodSetup>(data) {
        let json = serde_json::to_vec(&setup).expect("a pod setup serialises");
        assert_eq!(serde_json::from_slice::<PodSetup>(&json).expect("our own JSON decodes"), setup);
    }
    if let Ok(answer) = serde_json::from_slice::<PodSetupAnswer>(data) {
        let json = serde_json::to_vec(&answer).expect("an answer serialises");
        assert_eq!(serde_json::from_slice::<PodSetupAnswer>(&json).expect("our own JSON decodes"), answer);
    }
    let Ok(event) = serde_json::from_slice::<CmdAdd>(data) else { return };
    let json = serde_json::to_vec(&event).expect("an event serialises");
    assert_eq!(serde_json::from_slice::<CmdAdd>(&json).expect("our own JSON decodes"), event);
    let listed: Vec<&str> = event.ips.iter().filter_map(|ip| ip.get("address")?.as_str()).collect();
    for addr in event.addresses() {
        let found = listed.iter().any(|a| a.split('/').next().and_then(|a| a.parse().ok()) == Some(addr));
        assert!(found, "{addr} is not in {listed:?}");
    }
    assert!(event.addresses().len() <= event.ips.len());
});
