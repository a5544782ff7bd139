//! The plugin event the node agent reads from `POST /cmdadd` (it decodes the body exactly like this).
//! Invariants: a decoded event serialises back to JSON that decodes to the same event, and every address
//! it yields is one of its `IPs` entries' `address` without the prefix length.

#![no_main]

use cni::plugin_event::CmdAdd;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
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
