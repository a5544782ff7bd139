//! The pod setup fast path: the plugin's ADD asks the node agent, which answers from its watch of the node's pods,
//! so no pod or namespace GET reaches the API server per pod. When the agent is down, or its watch has not seen the
//! pod within its bounded wait, the plugin looks the pod up in the API as before, and logs that it did. The agent's
//! answer decides as a fresh GET would, for generated pods and namespaces.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

use istio_contract::enablement::{should_enroll, PodFacts, Selectors};
use istio_contract::names;
use istio_contract::paths::PLUGIN_EVENT_SOCKET;
use istio_contract::pod::PodInfo;
use k8s_openapi::api::core::v1::Pod as ApiPod;
use serde_json::{json, Value};
use testbed::mesh::{annotate, plain_pod, proxy_env, sidecar_pod, RuleBackend};
use testbed::node_agent::{ambient_conflist, ambient_node, ambient_pod, namespace, redirection, NodeAgent, ZdsPeer};
use testbed::wait::eventually_or;
use testbed::{Cluster, NetnsGuard};

const NS: &str = "shop";

/// A deterministic generator (Knuth's MMIX LCG): the same seed, the same pods, so a failure reproduces.
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

/// GETs of pod `name` (any namespace) or of any namespace object the API server answered.
fn lookups_of(c: &Cluster, name: &str) -> Vec<String> {
    c.api
        .requests()
        .into_iter()
        .filter(|r| r.verb == "get")
        .filter(|r| {
            r.path.ends_with(&format!("/pods/{name}"))
                || r.path.starts_with("/api/v1/namespaces/") && !r.path.contains("/pods")
        })
        .map(|r| format!("{} {} ({})", r.method, r.path, r.user))
        .collect()
}

/// Rules in `ns` without counter values, to compare two pods' rules.
fn rules(backend: RuleBackend, ns: &NetnsGuard) -> String {
    backend
        .dump(ns)
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            let kept =
                words.iter().enumerate().filter(|(i, _)| *i == 0 || !matches!(words[i - 1], "packets" | "bytes"));
            kept.map(|(_, w)| *w).collect::<Vec<_>>().join(" ")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The plugin's log file.
fn plugin_log(c: &Cluster) -> String {
    std::fs::read_to_string(c.run_dir().join("istio-cni.log")).unwrap_or_default()
}

/// A sidecar pod whose annotations and proxy settings shape every part of the rules.
fn shaped_sidecar(name: &str) -> Value {
    let pod = sidecar_pod(NS, name);
    let pod = annotate(pod, names::EXCLUDE_OUTBOUND_PORTS, "5432,6379");
    let pod = annotate(pod, names::EXCLUDE_INBOUND_PORTS, "9090");
    let pod = annotate(pod, names::EXCLUDE_OUTBOUND_IP_RANGES, "10.96.0.0/12");
    proxy_env(pod, "ISTIO_META_DNS_CAPTURE", "true")
}

#[test]
fn an_ambient_add_is_settled_by_the_agent_with_no_pod_or_namespace_get() {
    let (c, agent) = ambient_node(RuleBackend::Nftables, NS, &[]);
    let _peer = ZdsPeer::connect(&agent);
    c.create(&ambient_pod(NS, "web"));
    c.api.clear_requests();
    c.add_with(ambient_conflist(&c), "web", NS).expect("ADD of an ambient pod");
    assert_eq!(redirection(&c, NS, "web").as_deref(), Some("enabled"), "enrolled");
    assert_eq!(lookups_of(&c, "web"), Vec::<String>::new(), "no GET on the fast path");
    assert!(agent.metric("istio_cni_plugin_pod_lookups_total{source=\"agent\"}") >= Some(1), "{}", agent.metrics());
    assert!(!plugin_log(&c).contains("looking it up in the API server"), "no fallback:\n{}", plugin_log(&c));
    // Every step of the enrollment is in the phase histogram, so its sum accounts for the agent's part of the ADD.
    for phase in ["rules", "proxy_ack", "probe", "annotate"] {
        let count = format!("nodeagent_enrollment_duration_seconds_count{{phase=\"{phase}\"}}");
        assert_eq!(agent.metric(&count), Some(1), "{phase}: {}", agent.metrics());
    }
    // The request as a whole, from its arrival to the answer, once: it holds every phase above.
    assert_eq!(agent.metric("nodeagent_plugin_request_duration_seconds_count"), Some(1), "{}", agent.metrics());
    let phases: f64 = ["rules", "proxy_ack", "probe", "annotate"]
        .iter()
        .filter_map(|p| agent.metric_f64(&format!("nodeagent_enrollment_duration_seconds_sum{{phase=\"{p}\"}}")))
        .sum();
    let request = agent.metric_f64("nodeagent_plugin_request_duration_seconds_sum").expect("the request's time");
    assert!(request >= phases, "the request ({request} s) holds its phases ({phases} s)");
}

#[test]
fn a_sidecar_pod_gets_the_same_rules_from_the_agents_answer_as_from_the_api() {
    let backend = RuleBackend::Nftables;
    let (c, agent) = ambient_node(backend, NS, &[]);
    c.api.clear_requests();
    let fast = c.run(&shaped_sidecar("fast"));
    assert_eq!(lookups_of(&c, "fast"), Vec::<String>::new(), "no GET with the agent up");
    assert!(agent.metric("istio_cni_plugin_pod_lookups_total{source=\"agent\"}") >= Some(1), "{}", agent.metrics());

    // The agent goes away (its socket stays behind, refusing connections): the plugin asks the API, and says so.
    drop(agent);
    let slow = c.run(&shaped_sidecar("slow"));
    assert!(!lookups_of(&c, "slow").is_empty(), "the fallback GETs the pod: {:?}", c.api.requests());
    assert!(plugin_log(&c).contains("looking it up in the API server"), "the fallback is logged:\n{}", plugin_log(&c));
    let (fast, slow) = (rules(backend, &fast.netns), rules(backend, &slow.netns));
    assert!(fast.contains("redirect to :15001"), "the fast path programmed the sidecar rules:\n{fast}");
    assert_eq!(fast, slow, "the agent's answer and the API's give the same rules");
}

#[test]
fn a_pod_the_agents_watch_has_not_seen_is_looked_up_in_the_api_after_the_bounded_wait() {
    let backend = RuleBackend::Nftables;
    let (c, agent) = ambient_node(backend, NS, &[]);
    // Not (yet) bound to this node as the agent's watch sees it: the agent never gets it.
    let mut pod = shaped_sidecar("unseen");
    pod["spec"]["nodeName"] = json!(null);
    c.api.clear_requests();
    let unseen = c.run(&pod);
    assert!(!lookups_of(&c, "unseen").is_empty(), "the plugin fell back to a GET: {:?}", c.api.requests());
    assert!(rules(backend, &unseen.netns).contains("redirect to :15001"), "and programmed the rules");
    assert!(agent.metric("istio_cni_plugin_pod_lookups_total{source=\"api\"}") >= Some(1), "{}", agent.metrics());
    assert!(plugin_log(&c).contains("not seen by the node agent's watch"), "{}", plugin_log(&c));
}

/// POSTs a pod setup to the agent's socket as the plugin would: status and body.
fn pod_setup(c: &Cluster, name: &str, namespace: &str, ambient: bool) -> (u16, String) {
    let body = json!({
        "Netns": "/proc/self/ns/mnt", "PodName": name, "PodNamespace": namespace, "IPs": [],
        "AmbientEnabled": ambient,
    })
    .to_string();
    let mut stream = UnixStream::connect(c.run_dir().join(PLUGIN_EVENT_SOCKET)).expect("connect to the agent");
    write!(
        stream,
        "POST /podsetup HTTP/1.1\r\nHost: cni\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("send pod setup");
    let mut answer = String::new();
    stream.read_to_string(&mut answer).expect("read the answer");
    let status = answer.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = answer.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    (status, body)
}

/// Generated pods (labels, annotations, containers, host network) in generated namespaces: the agent's answer
/// from its watch takes the same decision as a fresh GET would, ambient or not, and carries the same facts for the
/// sidecar decision. An ambient decision shows as the agent going on to enroll the pod, which it refuses here
/// because the event names a mount namespace (403).
#[test]
fn the_agents_answer_decides_as_a_fresh_get_for_generated_pods_and_namespaces() {
    let (c, agent) = ambient_node(RuleBackend::Nftables, NS, &[]);
    let mut rng = Lcg(0x005e_ed18);
    let pick =
        |rng: &mut Lcg, options: &[Option<&str>]| options[rng.below(options.len() as u64) as usize].map(String::from);
    let namespaces = ["gen-a", "gen-b", "gen-c"];
    for ns in namespaces {
        let mode = pick(&mut rng, &[Some("ambient"), Some("none"), None]);
        let labels = mode.map_or(json!({}), |m| json!({ names::DATAPLANE_MODE_LABEL: m }));
        c.api.upsert(namespace(ns, labels)).expect("store namespace");
    }
    let mut pods = Vec::new();
    for i in 0..40 {
        let ns = namespaces[rng.below(3) as usize];
        let name = format!("gen-{i}");
        let mut pod = if rng.below(2) == 0 { sidecar_pod(ns, &name) } else { plain_pod(ns, &name) };
        if let Some(mode) = pick(&mut rng, &[Some("ambient"), Some("none"), Some("bogus"), None]) {
            pod["metadata"]["labels"][names::DATAPLANE_MODE_LABEL] = json!(mode);
        }
        if let Some(ports) = pick(&mut rng, &[Some("80,443"), Some("*"), Some(""), None]) {
            pod["metadata"]["annotations"][names::INCLUDE_INBOUND_PORTS] = json!(ports);
        }
        if let Some(mode) = pick(&mut rng, &[Some("TPROXY"), Some("REDIRECT"), None]) {
            pod["metadata"]["annotations"][names::INTERCEPTION_MODE] = json!(mode);
        }
        if rng.below(5) == 0 {
            pod["spec"]["hostNetwork"] = json!(true);
        }
        if rng.below(3) == 0 {
            pod["spec"]["initContainers"] = json!([{ "name": "istio-validation", "image": "proxyv2" }]);
        }
        if pod["spec"]["containers"].as_array().unwrap().len() > 1 && rng.below(2) == 0 {
            pod = proxy_env(pod, "ISTIO_META_DNS_CAPTURE", "true");
            pod["spec"]["containers"][1]["securityContext"] = json!({ "runAsUser": 1337 + rng.below(3) as i64 });
        }
        c.create(&pod);
        pods.push((ns, name));
    }
    let selectors = Selectors::default();
    let excluded = vec!["kube-system".to_owned()];
    let mut decided = [0; 2];
    for (ns, name) in pods {
        let fresh: ApiPod = serde_json::from_value(c.api.get("Pod", Some(ns), &name).unwrap()).unwrap();
        let ns_labels = c.api.get("Namespace", None, ns).unwrap()["metadata"]["labels"].clone();
        let ns_labels = serde_json::from_value(ns_labels).unwrap_or_default();
        let empty = Default::default();
        let facts = PodFacts::of(&fresh, &empty);
        let ambient = should_enroll(&selectors, &facts, &ns_labels, &excluded);
        decided[usize::from(ambient)] += 1;
        // The namespace may reach the agent's watch a little after the pods: an unknown namespace is a 404.
        let (status, body) = eventually_or(
            &format!("the agent answers for {ns}/{name}"),
            || Some(pod_setup(&c, &name, ns, true)).filter(|(s, _)| *s != 404),
            || agent.log(),
        );
        if ambient {
            assert_eq!(status, 403, "{ns}/{name} is ambient: the agent goes on to enroll it: {body}");
            assert!(body.contains("Netns"), "{ns}/{name}: refused for its netns, after the decision: {body}");
        } else {
            assert_eq!(status, 200, "{ns}/{name}: {body}");
            let answer: Value = serde_json::from_str(&body).expect("a JSON answer");
            assert_eq!(answer["outcome"], "sidecar", "{ns}/{name}: {body}");
            let pod: PodInfo = serde_json::from_value(answer["pod"].clone()).expect("pod facts");
            assert_eq!(pod, PodInfo::from(&fresh), "{ns}/{name}: the agent's facts are the API's");
        }
        // Without ambient in the plugin's netconf, every pod is answered for the sidecar path.
        let (status, body) = pod_setup(&c, &name, ns, false);
        assert_eq!(status, 200, "{ns}/{name}: {body}");
        assert!(body.contains("\"outcome\":\"sidecar\""), "{body}");
    }
    assert!(decided.iter().all(|n| *n >= 5), "the generated pods cover both decisions: {decided:?}");
}

/// A sidecar-only install (no ambient, no repair): the agent still runs, as the plugin's pod source.
#[test]
fn in_a_sidecar_only_install_the_agent_still_answers_the_plugin() {
    let backend = RuleBackend::Nftables;
    let c = Cluster::with_backend(backend);
    let agent = NodeAgent::start(&c, &[("AMBIENT_ENABLED", "false"), ("REPAIR_ENABLED", "false")]);
    c.api.clear_requests();
    let web = c.run(&shaped_sidecar("web"));
    assert_eq!(lookups_of(&c, "web"), Vec::<String>::new(), "no GET with the agent up");
    assert!(rules(backend, &web.netns).contains("redirect to :15001"), "the sidecar rules are in");
    assert!(agent.metric("istio_cni_plugin_pod_lookups_total{source=\"agent\"}") >= Some(1), "{}", agent.metrics());
}

/// Istio reads the pod at ADD time: an annotation changed after the pod was created (and seen by the agent's
/// watch) is what the ADD programs, not the version the pod was created with.
#[test]
fn an_annotation_changed_after_creation_is_what_the_add_programs() {
    let backend = RuleBackend::Nftables;
    let (c, _agent) = ambient_node(backend, NS, &[]);
    let pod = annotate(sidecar_pod(NS, "web"), names::EXCLUDE_OUTBOUND_PORTS, "5432");
    c.create(&pod);
    c.create(&annotate(pod.clone(), names::EXCLUDE_OUTBOUND_PORTS, "7777"));
    eventually_or(
        "the agent's watch has the changed annotation",
        || pod_setup(&c, "web", NS, false).1.contains("7777").then_some(()),
        || c.api.get("Pod", Some(NS), "web").unwrap().to_string(),
    );
    c.api.clear_requests();
    let web = c.add(&pod).expect("ADD");
    assert_eq!(lookups_of(&c, "web"), Vec::<String>::new(), "answered by the agent");
    let rules = rules(backend, &web.netns);
    assert!(rules.contains("tcp dport 7777"), "the changed exclusion is programmed:\n{rules}");
    assert!(!rules.contains("5432"), "the original one is not:\n{rules}");
}
