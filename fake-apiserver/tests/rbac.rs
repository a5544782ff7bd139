//! RBAC through the real kube client: seeded ClusterRoles, Roles and bindings decide, by verb, group, resource,
//! subresource and name; refusals are 403 `Status`es, and the request log (library and `/fake/requests`) shows
//! every request's verb, user and status.

mod support;

use fake_apiserver::{Config, FakeApiServer};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, WatchParams};
use serde_json::{json, Value};
use support::{api_error, client, client_with_token, pod_json, raw};

fn strict_auth() -> Config {
    Config { tls: true, authentication: true, rbac: true, ..Config::default() }
}

/// What a node agent might be granted: read pods cluster-wide, write their status, and in namespace `apps`
/// delete the pod `doomed` only.
fn seed(server: &FakeApiServer) {
    let rbac = "rbac.authorization.k8s.io/v1";
    for obj in [
        json!({"apiVersion": rbac, "kind": "ClusterRole", "metadata": {"name": "agent"}, "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]}
        ]}),
        json!({"apiVersion": rbac, "kind": "ClusterRoleBinding", "metadata": {"name": "agent"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "agent"},
               "subjects": [{"kind": "ServiceAccount", "name": "agent", "namespace": "istio-system"}]}),
        json!({"apiVersion": rbac, "kind": "Role", "metadata": {"name": "reaper", "namespace": "apps"}, "rules": [
            {"apiGroups": [""], "resources": ["pods"], "resourceNames": ["doomed"], "verbs": ["delete"]}
        ]}),
        json!({"apiVersion": rbac, "kind": "RoleBinding", "metadata": {"name": "reaper", "namespace": "apps"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "reaper"},
               "subjects": [{"kind": "ServiceAccount", "name": "agent", "namespace": "istio-system"}]}),
        pod_json("apps", "doomed", "n1", json!({})),
        pod_json("apps", "kept", "n1", json!({})),
        pod_json("other", "doomed", "n1", json!({})),
    ] {
        server.upsert(obj).unwrap();
    }
}

#[tokio::test]
async fn seeded_roles_decide_verb_resource_subresource_and_name() {
    let server = FakeApiServer::builder().config(strict_auth()).start().unwrap();
    seed(&server);
    let agent = client_with_token(&server, &server.service_account_token("istio-system", "agent")).await;
    let all: Api<Pod> = Api::all(agent.clone());
    let apps: Api<Pod> = Api::namespaced(agent.clone(), "apps");
    let other: Api<Pod> = Api::namespaced(agent.clone(), "other");

    assert_eq!(all.list(&ListParams::default()).await.unwrap().items.len(), 3);
    apps.get("kept").await.unwrap();
    let rv = all.list(&ListParams::default()).await.unwrap().metadata.resource_version.unwrap();
    drop(all.watch(&WatchParams::default(), &rv).await.unwrap());
    let status = Patch::Merge(json!({"status": {"phase": "Running"}}));
    apps.patch_status("kept", &PatchParams::default(), &status).await.unwrap();

    let label = Patch::Merge(json!({"metadata": {"labels": {"x": "y"}}}));
    let (code, reason, message) = api_error(apps.patch("kept", &PatchParams::default(), &label).await);
    assert_eq!((code, reason.as_str()), (403, "Forbidden"));
    assert_eq!(
        message,
        "pods \"kept\" is forbidden: User \"system:serviceaccount:istio-system:agent\" cannot patch resource \
         \"pods\" in API group \"\" in the namespace \"apps\""
    );
    let (code, _, message) = api_error(Api::<Node>::all(agent.clone()).list(&ListParams::default()).await);
    assert_eq!(code, 403);
    assert!(message.ends_with("cannot list resource \"nodes\" in API group \"\" at the cluster scope"), "{message}");

    assert_eq!(api_error(apps.delete("kept", &DeleteParams::default()).await).0, 403, "not a granted name");
    assert_eq!(api_error(other.delete("doomed", &DeleteParams::default()).await).0, 403, "not the Role's namespace");
    apps.delete("doomed", &DeleteParams::default()).await.unwrap();

    // The raw 403 is a Kubernetes Status with details.
    let (status, _, body) = raw(&agent, "DELETE", "/api/v1/namespaces/apps/pods/kept", "application/json", "").await;
    assert_eq!(status, 403);
    assert_eq!(body["kind"], "Status");
    assert_eq!(body["details"], json!({"name": "kept", "kind": "pods"}), "empty fields left out, as the real server");

    // The log tells who did what and how it went; a test can assert "no 403" over it.
    let log = server.requests();
    let refused: Vec<(String, String)> =
        log.iter().filter(|r| r.status == 403).map(|r| (r.verb.clone(), r.path.clone())).collect();
    assert_eq!(
        refused,
        [
            ("patch".to_string(), "/api/v1/namespaces/apps/pods/kept".to_string()),
            ("list".to_string(), "/api/v1/nodes".to_string()),
            ("delete".to_string(), "/api/v1/namespaces/apps/pods/kept".to_string()),
            ("delete".to_string(), "/api/v1/namespaces/other/pods/doomed".to_string()),
            ("delete".to_string(), "/api/v1/namespaces/apps/pods/kept".to_string()),
        ]
    );
    assert!(log.iter().all(|r| r.user == "system:serviceaccount:istio-system:agent"), "{log:?}");
    let verbs: Vec<&str> = log.iter().filter(|r| r.status == 200).map(|r| r.verb.as_str()).collect();
    assert_eq!(verbs, ["list", "get", "list", "watch", "patch", "delete"]);

    // The same log over HTTP, for tests that run the binary (not logged itself).
    let admin = client(&server).await;
    let (status, _, listed) = raw(&admin, "GET", "/fake/requests", "application/json", "").await;
    assert_eq!(status, 200);
    let listed: Vec<Value> = listed.as_array().cloned().unwrap_or_default();
    assert_eq!(listed.len(), log.len());
    assert_eq!(listed[1]["verb"], "get");
    assert_eq!(listed[1]["status"], 200);
    assert_eq!(listed[1]["user"], "system:serviceaccount:istio-system:agent");
    assert_eq!(server.requests().len(), log.len(), "test endpoints are not logged");
}

#[tokio::test]
async fn groups_admin_discovery_and_live_changes() {
    let server = FakeApiServer::builder().config(strict_auth()).start().unwrap();
    seed(&server);
    let stranger = client_with_token(&server, &server.service_account_token("default", "stranger")).await;
    let pods: Api<Pod> = Api::all(stranger.clone());
    assert_eq!(api_error(pods.list(&ListParams::default()).await).0, 403);
    let version = raw(&stranger, "GET", "/version", "application/json", "").await;
    assert_eq!(version.0, 200, "discovery is open to every authenticated user");
    assert_eq!(raw(&stranger, "GET", "/api/v1", "application/json", "").await.0, 200);

    // Bindings are read on every request: binding a group grants at once.
    server
        .upsert(json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                       "metadata": {"name": "all-sas"},
                       "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "agent"},
                       "subjects": [{"kind": "Group", "name": "system:serviceaccounts"}]}))
        .unwrap();
    assert_eq!(pods.list(&ListParams::default()).await.unwrap().items.len(), 3);

    // The kubeconfig's admin is in system:masters and may do anything.
    let admin = client(&server).await;
    Api::<Node>::all(admin.clone()).list(&ListParams::default()).await.unwrap();
    Api::<Pod>::namespaced(admin, "apps").delete("kept", &DeleteParams::default()).await.unwrap();
    assert!(server.requests().iter().filter(|r| r.user == "fake-admin").all(|r| r.status == 200));
}
