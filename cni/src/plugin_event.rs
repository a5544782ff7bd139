//! The event the plugin sends the node agent for an ambient pod (`POST /cmdadd` on
//! `<run dir>/pluginevent.sock`), in Istio's wire format, so either side can talk to Istio's counterpart.

use serde::{Deserialize, Serialize};

/// Path of the add endpoint on the agent's socket.
pub const CMDADD_PATH: &str = "/cmdadd";

/// The agent's answer (422) when the pod's annotations cannot become rules: the plugin fails ADD with CNI code 7
/// (invalid config) rather than 11 (try again), since no retry can fix the pod.
pub const INVALID_POD_STATUS: u16 = 422;

/// A pod the plugin hands over for enrollment. Field names are Istio's (Go's exported names).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CmdAdd {
    /// The pod's netns path as the runtime gave it (`CNI_NETNS`).
    #[serde(rename = "Netns")]
    pub netns: String,
    /// Pod name.
    #[serde(rename = "PodName")]
    pub pod_name: String,
    /// Pod namespace.
    #[serde(rename = "PodNamespace")]
    pub pod_namespace: String,
    /// The `ips` of the CNI result (each `{"address": "10.0.0.2/24", ...}`).
    #[serde(rename = "IPs", default)]
    pub ips: Vec<serde_json::Value>,
    /// The pod's UID (`K8S_POD_UID` from `CNI_ARGS`) when the runtime passed it: the agent enrolls the pod only if
    /// the API server's pod still has this UID, so an event cannot stand for a pod recreated under the same name.
    /// Our addition to Istio's event: sent only when present, and an event without it (Istio's plugin) is
    /// accepted without that check.
    #[serde(rename = "PodUID", default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
}

impl CmdAdd {
    /// The addresses without prefix length; unparsable entries are skipped.
    pub fn addresses(&self) -> Vec<std::net::IpAddr> {
        crate::result::addresses(&serde_json::json!({ "ips": self.ips }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_names_are_istios() {
        let e = CmdAdd {
            netns: "/var/run/netns/x".into(),
            pod_name: "web".into(),
            pod_namespace: "shop".into(),
            ips: vec![serde_json::json!({"address": "10.0.0.2/24", "gateway": "10.0.0.1", "interface": 0})],
            pod_uid: None,
        };
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v["Netns"], "/var/run/netns/x");
        assert_eq!(v["PodNamespace"], "shop");
        assert_eq!(v["IPs"][0]["address"], "10.0.0.2/24");
        assert_eq!(e.addresses(), vec!["10.0.0.2".parse::<std::net::IpAddr>().unwrap()]);
        // Without a UID the event is exactly Istio's four fields.
        let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["Netns", "PodName", "PodNamespace", "IPs"]);
    }

    #[test]
    fn the_pod_uid_is_sent_only_when_known_and_istios_event_without_it_decodes() {
        let mut e: CmdAdd =
            serde_json::from_str(r#"{"Netns":"/n","PodName":"web","PodNamespace":"shop","IPs":[]}"#).unwrap();
        assert_eq!(e.pod_uid, None);
        e.pod_uid = Some("4f1c-uid".into());
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v["PodUID"], "4f1c-uid");
        assert_eq!(serde_json::from_value::<CmdAdd>(v).unwrap(), e);
    }

    /// Found by the plugin_event fuzzer: an unknown field holding a number too big for u64 must come back from
    /// our own JSON as the same value, or a runtime's extra result fields would drift as they pass through.
    #[test]
    fn big_numbers_survive_a_round_trip() {
        let body = r#"{"Netns":"/n","PodName":"a","PodNamespace":"b","IPs":[{"x":222222222222282222222222222222220}]}"#;
        let e: CmdAdd = serde_json::from_str(body).unwrap();
        let again: CmdAdd = serde_json::from_slice(&serde_json::to_vec(&e).unwrap()).unwrap();
        assert_eq!(again, e);
    }
}
