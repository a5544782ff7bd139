//! The directory source for a cluster: every pod the node agent has enrolled (annotated
//! `ambient.istio.io/redirection=enabled`) speaks HBONE, with the identity of its namespace and service account,
//! and the workload name and canonical service Istio derives from the pod (for the traffic metrics' labels).
//!
//! All pods are watched cluster-wide, because a destination can run on any node. The watcher relists and
//! retries with backoff when the API is away; entries stay as they were until it answers again.

use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;

use futures::StreamExt as _;
use istio_contract::canonical;
use istio_contract::names::{AMBIENT_REDIRECTION, AMBIENT_REDIRECTION_ENABLED};
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt as _;
use kube::{Api, Client};
use tokio::sync::oneshot;

use super::{Directory, Protocol, Workload};

/// The name this source's entries are kept under in the [`Directory`].
pub const SOURCE: &str = "kubernetes";

/// Watches with the client inferred from `KUBECONFIG` or the in-cluster service account. Without either, the
/// source stays off and says so; an unreachable API is retried for as long as the task runs. `listed` fires once
/// the directory holds the first complete list of pods (at once when the source is off).
pub async fn watch_inferred(directory: Directory, listed: oneshot::Sender<()>) {
    let client = kube::Config::infer().await.map_err(kube::Error::InferConfig).and_then(|mut config| {
        // Named in the API server's audit log.
        if let (Ok(name), Ok(value)) =
            ("user-agent".try_into(), concat!("hbone-proxy/", env!("CARGO_PKG_VERSION")).try_into())
        {
            config.headers.push((name, value));
        }
        Client::try_from(config)
    });
    match client {
        Ok(client) => watch(client, directory, listed).await,
        Err(error) => {
            tracing::info!(%error, "no Kubernetes configuration: pods are not a workload source");
            let _ = listed.send(());
        }
    }
}

/// Keeps this source's entries equal to the enrolled pods with an address, until the task is dropped; `listed`
/// fires after the first complete list is in the directory.
///
/// Each watch event costs one pod's worth of work in the directory, however many pods the cluster runs, and the
/// directory holds the only copy of each workload (the watch keeps none). A (re)list applies each pod as it comes
/// and, once complete, sweeps the ones it no longer holds (deleted or unenrolled while the watch was away).
pub async fn watch(client: Client, directory: Directory, listed: oneshot::Sender<()>) {
    let mut listed = Some(listed);
    let events = watcher::watcher(Api::<Pod>::all(client), watcher::Config::default()).default_backoff();
    let mut events = std::pin::pin!(events);
    // The uids a (re)list has applied so far; `None` between lists.
    let mut relisted: Option<HashSet<String>> = None;
    while let Some(event) = events.next().await {
        let event = match event {
            Ok(event) => event,
            Err(error) => {
                tracing::warn!(%error, "watching pods for the workload directory (retrying)");
                continue;
            }
        };
        match event {
            Event::Init => relisted = Some(HashSet::new()),
            Event::InitApply(pod) => {
                if let Some(workload) = workload(&pod) {
                    let uid = workload.uid.clone();
                    if apply(&directory, workload) {
                        relisted.get_or_insert_with(HashSet::new).insert(uid);
                    }
                }
            }
            Event::InitDone => {
                let seen = relisted.take().unwrap_or_default();
                directory.retain(SOURCE, |uid| seen.contains(uid));
                if let Some(listed) = listed.take() {
                    let _ = listed.send(());
                }
            }
            Event::Apply(pod) => match workload(&pod) {
                Some(workload) => {
                    apply(&directory, workload);
                }
                None => {
                    directory.remove(SOURCE, pod.metadata.uid.as_deref().unwrap_or_default());
                }
            },
            Event::Delete(pod) => {
                directory.remove(SOURCE, pod.metadata.uid.as_deref().unwrap_or_default());
            }
        }
    }
}

/// Puts `workload` in the directory; whether it is there (a pod whose identity is invalid is left out, logged).
fn apply(directory: &Directory, workload: Workload) -> bool {
    match directory.upsert(SOURCE, workload) {
        Ok(()) => true,
        Err(error) => {
            tracing::warn!(%error, "skipping pod");
            false
        }
    }
}

/// The pod as a mesh workload: `None` unless it is enrolled, has an address and is not finished
/// (a finished pod's address may already belong to someone else).
fn workload(pod: &Pod) -> Option<Workload> {
    let meta = &pod.metadata;
    let enrolled = meta.annotations.as_ref().and_then(|a| a.get(AMBIENT_REDIRECTION)).map(String::as_str);
    let status = pod.status.as_ref()?;
    if enrolled != Some(AMBIENT_REDIRECTION_ENABLED) || matches!(status.phase.as_deref(), Some("Succeeded" | "Failed"))
    {
        return None;
    }
    let workload_ips: Vec<IpAddr> = status.pod_ips.iter().flatten().filter_map(|ip| ip.ip.parse().ok()).collect();
    if workload_ips.is_empty() {
        return None;
    }
    let spec = pod.spec.as_ref();
    let workload_name = canonical::workload_name(meta);
    let (canonical_name, canonical_revision) =
        canonical::canonical_service(meta.labels.as_ref().unwrap_or(&BTreeMap::new()), &workload_name);
    Some(Workload {
        uid: meta.uid.clone().unwrap_or_default(),
        name: meta.name.clone().unwrap_or_default(),
        namespace: meta.namespace.clone().unwrap_or_default(),
        service_account: spec
            .and_then(|s| s.service_account_name.clone())
            .filter(|sa| !sa.is_empty())
            .unwrap_or_else(|| "default".to_owned()),
        trust_domain: String::new(),
        workload_ips,
        protocol: Protocol::Hbone,
        node: spec.and_then(|s| s.node_name.clone()).unwrap_or_default(),
        workload_name,
        canonical_name,
        canonical_revision,
        // This cluster: the proxy's own.
        cluster_id: String::new(),
        require_mtls: false,
    })
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use fake_apiserver::{FakeApiServer, Fault};
    use kube::config::{KubeConfigOptions, Kubeconfig};
    use serde_json::{json, Value};

    use super::super::SourceCount;
    use super::*;

    fn pod(name: &str, ip: &str, annotation: Option<&str>, service_account: Option<&str>) -> Value {
        let mut pod = json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "shop"},
            "spec": {"nodeName": "node-1", "containers": [{"name": "app", "image": "busybox"}]},
            "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]},
        });
        if let Some(value) = annotation {
            pod["metadata"]["annotations"] = json!({ AMBIENT_REDIRECTION: value });
        }
        if let Some(sa) = service_account {
            pod["spec"]["serviceAccountName"] = json!(sa);
        }
        pod
    }

    async fn client(server: &FakeApiServer) -> Client {
        let kubeconfig = Kubeconfig::from_yaml(&server.kubeconfig_yaml()).unwrap();
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await.unwrap();
        Client::try_from(config).unwrap()
    }

    async fn wait_for(what: &str, mut condition: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !condition() {
            assert!(Instant::now() < deadline, "timed out waiting until {what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn an_enrolled_pod_carries_istios_workload_and_canonical_names() {
        let mut object = pod("web-7d4b9c-x2x9z", "10.9.3.1", Some("enabled"), None);
        object["metadata"]["uid"] = json!("u-web");
        object["metadata"]["generateName"] = json!("web-7d4b9c-");
        object["metadata"]["labels"] = json!({ "pod-template-hash": "7d4b9c", "app": "shop", "version": "v2" });
        object["metadata"]["ownerReferences"] = json!([{
            "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-7d4b9c", "uid": "rs-1", "controller": true,
        }]);
        let listed = workload(&serde_json::from_value(object).unwrap()).expect("an enrolled pod");
        assert_eq!(listed.uid, "u-web");
        let names = (listed.workload_name.as_str(), listed.canonical_name.as_str(), listed.canonical_revision.as_str());
        assert_eq!(names, ("web", "shop", "v2"), "the Deployment's name; app and version labels");
        assert_eq!(listed.cluster_id, "", "the proxy's own cluster");
    }

    #[tokio::test]
    async fn enrolled_pods_appear_with_their_identity_and_leave_when_unenrolled_or_deleted() {
        let server = FakeApiServer::start().unwrap();
        // Present before the watch starts: exercises the initial list.
        server.upsert(pod("plain", "10.9.0.1", None, None)).unwrap();
        server.upsert(pod("web", "10.9.0.2", Some("enabled"), Some("web-sa"))).unwrap();
        let directory = Directory::new("example.org");
        let (listed_tx, listed) = oneshot::channel();
        let task = tokio::spawn(watch(client(&server).await, directory.clone(), listed_tx));

        // The proxy takes no pod before this fires: by then the first list is in the directory.
        tokio::time::timeout(Duration::from_secs(20), listed).await.expect("listed in time").expect("listed fires");
        assert!(directory.lookup(ip("10.9.0.2")).is_some(), "listed fired before the list was in the directory");
        let found = directory.lookup(ip("10.9.0.2")).unwrap();
        assert_eq!(found.identity.to_string(), "spiffe://example.org/ns/shop/sa/web-sa");
        assert_eq!(found.workload.protocol, Protocol::Hbone);
        assert!(directory.lookup(ip("10.9.0.1")).is_none(), "an unannotated pod is not a mesh workload");

        // Watch events, in order: the later enrolled pod showing up proves the earlier ones were seen.
        server.upsert(pod("late-plain", "10.9.0.3", None, None)).unwrap();
        server.upsert(pod("finished", "10.9.0.4", Some("enabled"), None)).unwrap();
        let mut finished = pod("finished", "10.9.0.4", Some("enabled"), None);
        finished["status"]["phase"] = json!("Succeeded");
        server.upsert(finished).unwrap();
        server.upsert(pod("db", "10.9.0.5", Some("enabled"), None)).unwrap();
        wait_for("the second enrolled pod is seen", || directory.lookup(ip("10.9.0.5")).is_some()).await;
        assert_eq!(
            directory.lookup(ip("10.9.0.5")).unwrap().identity.to_string(),
            "spiffe://example.org/ns/shop/sa/default",
            "no serviceAccountName means the default account"
        );
        assert!(directory.lookup(ip("10.9.0.3")).is_none(), "an unannotated pod never appears");
        assert!(directory.lookup(ip("10.9.0.4")).is_none(), "a finished pod's address is released");

        server.upsert(pod("web", "10.9.0.2", Some("disabled"), Some("web-sa"))).unwrap();
        wait_for("the unenrolled pod is gone", || directory.lookup(ip("10.9.0.2")).is_none()).await;

        server.delete("Pod", Some("shop"), "db").unwrap();
        wait_for("the deleted pod is gone", || directory.lookup(ip("10.9.0.5")).is_none()).await;
        task.abort();
    }

    #[tokio::test]
    async fn pods_deleted_while_the_api_was_away_are_dropped_on_the_relist() {
        let server = FakeApiServer::start().unwrap();
        server.upsert(pod("web", "10.9.1.2", Some("enabled"), None)).unwrap();
        let directory = Directory::new("example.org");
        let task = tokio::spawn(watch(client(&server).await, directory.clone(), oneshot::channel().0));
        wait_for("the enrolled pod is listed", || directory.lookup(ip("10.9.1.2")).is_some()).await;

        // The API goes away, the pod is deleted meanwhile and its history compacted: no watch event tells of
        // the deletion, only the fresh list the watcher makes once the API is back.
        server.cluster().set_fault(Some(Fault::Refuse));
        server.drop_watches();
        server.delete("Pod", Some("shop"), "web").unwrap();
        server.upsert(pod("other", "10.9.1.3", Some("enabled"), None)).unwrap();
        server.compact();
        server.cluster().set_fault(None);
        wait_for("the relist is seen", || directory.lookup(ip("10.9.1.3")).is_some()).await;
        assert!(directory.lookup(ip("10.9.1.2")).is_none(), "the pod deleted while away is gone");
        task.abort();
    }

    /// The old pod's deletion arrives after a new pod got its address: the address stays the new pod's.
    #[tokio::test]
    async fn a_reused_address_stays_with_the_new_pod_when_the_old_pods_deletion_arrives() {
        let server = FakeApiServer::start().unwrap();
        server.upsert(pod("old", "10.9.3.2", Some("enabled"), Some("old-sa"))).unwrap();
        let directory = Directory::new("example.org");
        let task = tokio::spawn(watch(client(&server).await, directory.clone(), oneshot::channel().0));
        wait_for("the old pod is listed", || directory.lookup(ip("10.9.3.2")).is_some()).await;

        server.upsert(pod("new", "10.9.3.2", Some("enabled"), Some("new-sa"))).unwrap();
        let owner = || directory.lookup(ip("10.9.3.2")).map(|d| d.identity.service_account.clone());
        wait_for("the new pod owns the address", || owner().as_deref() == Some("new-sa")).await;
        server.delete("Pod", Some("shop"), "old").unwrap();
        // Watch events, in order: the later pod showing up proves the deletion was seen.
        server.upsert(pod("later", "10.9.3.3", Some("enabled"), None)).unwrap();
        wait_for("the later pod is seen", || directory.lookup(ip("10.9.3.3")).is_some()).await;
        assert_eq!(owner().as_deref(), Some("new-sa"), "the old pod's deletion took the new pod's address");
        let listing = directory.listing(10);
        assert_eq!(listing.sources[SOURCE], SourceCount { workloads: 2, addresses: 2 }, "new and later");
        task.abort();
    }

    /// A pod shutting down (`deletionTimestamp` set, grace period running) still runs and still takes traffic,
    /// as the node agent keeps it enrolled: it stays a destination until the API server deletes it.
    #[tokio::test]
    async fn a_terminating_pod_stays_a_workload_until_it_is_deleted() {
        let server = FakeApiServer::start().unwrap();
        server.upsert(pod("web", "10.9.2.2", Some("enabled"), None)).unwrap();
        let directory = Directory::new("example.org");
        let task = tokio::spawn(watch(client(&server).await, directory.clone(), oneshot::channel().0));
        wait_for("the enrolled pod is listed", || directory.lookup(ip("10.9.2.2")).is_some()).await;

        let terminating = server.delete_gracefully("Pod", Some("shop"), "web", Some(3600)).unwrap();
        assert!(terminating["metadata"]["deletionTimestamp"].is_string(), "terminating: {terminating}");
        // Watch events, in order: the later pod showing up proves the deletion's MODIFIED was seen.
        server.upsert(pod("later", "10.9.2.3", Some("enabled"), None)).unwrap();
        wait_for("the later pod is seen", || directory.lookup(ip("10.9.2.3")).is_some()).await;
        assert!(directory.lookup(ip("10.9.2.2")).is_some(), "the terminating pod is still a destination");

        // The kubelet's final delete once its containers stopped: DELETED.
        server.delete_gracefully("Pod", Some("shop"), "web", Some(0));
        wait_for("the deleted pod is gone", || directory.lookup(ip("10.9.2.2")).is_none()).await;
        task.abort();
    }
}
