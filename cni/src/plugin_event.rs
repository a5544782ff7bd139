//! What the plugin sends the node agent on `<run dir>/pluginevent.sock`:
//! - `POST /cmdadd`, the event for an ambient pod, in Istio's wire format, so either side can talk to Istio's
//!   counterpart;
//! - `POST /podsetup`, our plugin's one round trip at ADD: the agent answers from its watch of the node's pods
//!   (no API request per pod), enrolling the pod when it is ambient, else returning what the sidecar decision
//!   needs. An agent that does not know the pod in time, or that does not serve the path (Istio's, or an older
//!   one: 404), sends the plugin back to its own API lookup.

use istio_contract::pod::PodInfo;
use serde::{Deserialize, Serialize};

/// Path of the add endpoint on the agent's socket.
pub const CMDADD_PATH: &str = "/cmdadd";

/// How long the plugin waits for the agent's answer to one request before it fails the ADD. The agent answers a
/// request it could not finish a while before that ([`AGENT_ANSWER_DEADLINE`]) and undoes what it did, so it
/// never completes an enrollment the plugin has given up on: the failed ADD makes the runtime tear the sandbox
/// down, and a pod enrolled after all would hold its netns, and the proxy run it, until the pod is deleted.
pub const PLUGIN_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// How long after receiving a request the agent may still complete its enrollment: [`PLUGIN_WAIT`] less a second
/// for the plugin's connect and the answer's way back.
pub const AGENT_ANSWER_DEADLINE: std::time::Duration = std::time::Duration::from_secs(4);

/// The agent's answer (422) when the pod's annotations cannot become rules: the plugin fails ADD with CNI code 7
/// (invalid config) rather than 11 (try again), since no retry can fix the pod.
pub const INVALID_POD_STATUS: u16 = 422;

/// Path of the one-round-trip pod setup on the agent's socket.
pub const PODSETUP_PATH: &str = "/podsetup";

/// The agent's answer (404) when its watch has not seen the pod within its bounded wait (or when it does not serve
/// [`PODSETUP_PATH`] at all): the plugin looks the pod up in the API itself, as without an agent.
pub const UNKNOWN_POD_STATUS: u16 = 404;

/// The plugin's pod setup request: the ADD's event, and whether the plugin's netconf enables ambient (the agent
/// enrolls the pod then, if its selectors say so).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PodSetup {
    /// The pod, as for `/cmdadd`.
    #[serde(flatten)]
    pub event: CmdAdd,
    /// The netconf's `ambient_enabled`.
    #[serde(rename = "AmbientEnabled", default)]
    pub ambient_enabled: bool,
}

/// What the agent did with a [`PodSetup`] (status 200).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "camelCase")]
pub enum PodSetupAnswer {
    /// An ambient pod, now fully enrolled: nothing left for the plugin to do.
    Enrolled,
    /// Not an ambient pod: the plugin takes the sidecar decision on `pod`, the newest version the agent has seen.
    Sidecar {
        /// The facts the sidecar decision and rules need.
        pod: PodInfo,
    },
}

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

    #[test]
    fn a_pod_setup_is_the_event_plus_the_ambient_flag_and_answers_are_tagged() {
        let body =
            r#"{"Netns":"/n","PodName":"web","PodNamespace":"shop","IPs":[],"PodUID":"u1","AmbientEnabled":true}"#;
        let setup: PodSetup = serde_json::from_str(body).unwrap();
        assert_eq!(setup.event.pod_uid.as_deref(), Some("u1"));
        assert!(setup.ambient_enabled);
        assert_eq!(serde_json::from_slice::<PodSetup>(&serde_json::to_vec(&setup).unwrap()).unwrap(), setup);
        let enrolled = serde_json::to_value(PodSetupAnswer::Enrolled).unwrap();
        assert_eq!(enrolled, serde_json::json!({ "outcome": "enrolled" }));
        let mut pod = PodInfo::default();
        pod.annotations.insert("sidecar.istio.io/status".into(), "{}".into());
        pod.init_containers.push("istio-init".into());
        let sidecar = PodSetupAnswer::Sidecar { pod };
        let v = serde_json::to_value(&sidecar).unwrap();
        assert_eq!(v["outcome"], "sidecar");
        assert_eq!(v["pod"]["initContainers"][0], "istio-init");
        assert_eq!(serde_json::from_value::<PodSetupAnswer>(v).unwrap(), sidecar);
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
