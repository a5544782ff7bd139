//! TLS and authentication through the real kube client: the kubeconfig's CA and token, 401s, token rotation,
//! and a restart on the same state directory that old clients and tokens survive.

mod support;

use fake_apiserver::{Config, FakeApiServer, User};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use serde_json::json;
use std::time::Duration;
use support::{api_error, client, client_from_kubeconfig_with, client_with_token, pod_json, raw};
use testbed::wait::eventually_awaiting;

fn secured(config: Config) -> Config {
    Config { tls: true, authentication: true, ..config }
}

async fn list_pods(client: &kube::Client) -> Result<Vec<String>, kube::Error> {
    let pods = Api::<Pod>::all(client.clone()).list(&ListParams::default()).await?;
    Ok(pods.items.into_iter().filter_map(|p| p.metadata.name).collect())
}

#[tokio::test]
async fn https_with_the_kubeconfigs_ca_and_token() {
    let server = FakeApiServer::builder().config(secured(Config::default())).start().unwrap();
    assert!(server.url().starts_with("https://127.0.0.1:"), "{}", server.url());
    let yaml = server.kubeconfig_yaml();
    assert!(yaml.contains("certificate-authority-data"), "the kubeconfig carries the CA:\n{yaml}");
    assert!(!yaml.contains("fake-token"), "and a real token:\n{yaml}");
    server.upsert(pod_json("default", "a", "n1", json!({}))).unwrap();

    assert_eq!(list_pods(&client(&server).await).await.unwrap(), ["a"]);
    let log = server.requests();
    assert_eq!(log.last().map(|r| (r.user.as_str(), r.verb.as_str(), r.status)), Some(("fake-admin", "list", 200)));

    // A client that does not trust the fake's CA cannot talk to it at all.
    let other = FakeApiServer::builder().config(secured(Config::default())).start().unwrap();
    let wrong_ca = server.kubeconfig_yaml().replace(
        &yaml_field(&server.kubeconfig_yaml(), "certificate-authority-data"),
        &yaml_field(&other.kubeconfig_yaml(), "certificate-authority-data"),
    );
    let untrusting = client_from_kubeconfig_with(&wrong_ca, |c| c.default_retry = false).await;
    match list_pods(&untrusting).await {
        Err(kube::Error::Api(status)) => panic!("a TLS failure must not reach the API: {status:?}"),
        Err(_) => {}
        Ok(pods) => panic!("an untrusted server answered: {pods:?}"),
    }
}

/// The value of `field` in a kubeconfig's YAML.
fn yaml_field(yaml: &str, field: &str) -> String {
    let line = yaml.lines().find(|l| l.trim_start().starts_with(&format!("{field}:"))).expect("the field is there");
    line.split_once(':').unwrap().1.trim().to_string()
}

#[tokio::test]
async fn requests_without_a_valid_token_get_401() {
    let server = FakeApiServer::builder().config(secured(Config::default())).start().unwrap();
    let foreign = FakeApiServer::builder().config(secured(Config::default())).start().unwrap();
    let forged = foreign.service_account_token("default", "sa");
    for token in ["fake-token", forged.as_str()] {
        let client = client_with_token(&server, token).await;
        let (code, reason, message) = api_error(list_pods(&client).await);
        assert_eq!((code, reason.as_str(), message.as_str()), (401, "Unauthorized", "Unauthorized"), "token {token:?}");
    }
    let forged_client = client_with_token(&server, &forged).await;
    let (status, _, body) = raw(&forged_client, "GET", "/api/v1/pods", "application/json", "").await;
    assert_eq!((status, body["kind"].as_str(), body["code"].as_u64()), (401, Some("Status"), Some(401)));
    let refused = server.requests();
    assert!(refused.iter().all(|r| r.status == 401 && r.user.is_empty()), "{refused:?}");

    // No token at all is system:anonymous, as on a real server (--anonymous-auth=true): authorization decides
    // (everything here, without RBAC; tests/real_conformance.rs shows the 403s with it).
    server.clear_requests();
    let anonymous = client_with_token(&server, "").await;
    assert!(list_pods(&anonymous).await.is_ok());
    assert_eq!(server.requests()[0].user, "system:anonymous");

    // The lenient default runs such requests as system:anonymous.
    let lenient = FakeApiServer::start().unwrap();
    let client = client_with_token(&lenient, "fake-token").await;
    assert!(list_pods(&client).await.is_ok());
    assert_eq!(lenient.requests()[0].user, "system:anonymous");
}

#[tokio::test]
async fn rotated_tokens_stop_working_after_the_grace_period() {
    let grace = Duration::from_secs(1);
    let server = FakeApiServer::builder()
        .config(secured(Config { token_rotation_grace: grace, ..Config::default() }))
        .start()
        .unwrap();
    let old = server.service_account_token("istio-system", "istio-cni");
    let old_client = client_with_token(&server, &old).await;
    assert!(list_pods(&old_client).await.is_ok());
    let other_user = client_with_token(&server, &server.cluster().token_for(&User::new("someone", &[]))).await;

    let new = server.rotate_service_account_token("istio-system", "istio-cni").unwrap();
    assert_ne!(new, old);
    let new_client = client_with_token(&server, &new).await;
    assert!(list_pods(&new_client).await.is_ok());
    eventually_awaiting("the old token expires after the rotation's grace period", || async {
        match list_pods(&old_client).await {
            Err(kube::Error::Api(s)) if s.code == 401 => Some(()),
            Ok(_) => None,
            Err(e) => panic!("only 401 may end the old token: {e}"),
        }
    })
    .await;
    assert!(list_pods(&new_client).await.is_ok(), "the new token works");
    assert!(list_pods(&other_user).await.is_ok(), "other subjects' tokens are untouched");
    let fresh = client_with_token(&server, &server.service_account_token("istio-system", "istio-cni")).await;
    assert!(list_pods(&fresh).await.is_ok(), "tokens issued after the rotation are of the new generation");
}

#[tokio::test]
async fn a_restart_on_the_same_state_dir_keeps_clients_and_tokens_working() {
    let dir = tempfile::tempdir().unwrap();
    let state_dir = Some(dir.path().to_path_buf());
    let config = secured(Config { state_dir, token_rotation_grace: Duration::ZERO, ..Config::default() });
    let first = FakeApiServer::builder().config(config.clone()).start().unwrap();
    let addr = first.addr();
    first.upsert(pod_json("default", "before", "n1", json!({}))).unwrap();
    let token = first.service_account_token("istio-system", "istio-cni");
    let rotated_away = first.service_account_token("kube-system", "old");
    first.rotate_service_account_token("kube-system", "old").unwrap();
    let admin = client(&first).await;
    let sa = client_with_token(&first, &token).await;
    assert_eq!(list_pods(&admin).await.unwrap(), ["before"]);
    for file in ["ca.crt", "ca.key", "apiserver.crt", "apiserver.key", "sa.key", "token-rotations.json"] {
        assert!(dir.path().join(file).exists(), "{file} is kept in the state dir");
    }
    drop(first);

    let second = FakeApiServer::builder().config(config).listen_on(addr).start().unwrap();
    second.upsert(pod_json("default", "after", "n1", json!({}))).unwrap();
    // The same client objects: same trusted CA, same tokens, new server process state. A pooled connection to
    // the old server may fail once in transport, as it would against a restarted real apiserver.
    for c in [&admin, &sa] {
        let pods = eventually_awaiting("the client reaches the restarted server", || async {
            match list_pods(c).await {
                Ok(pods) => Some(pods),
                Err(kube::Error::Api(s)) => panic!("the restarted server refused an old client: {s:?}"),
                Err(_) => None,
            }
        })
        .await;
        assert_eq!(pods, ["after"]);
    }
    assert!(second.requests().iter().all(|r| r.status == 200), "{:?}", second.requests());
    let stale = client_with_token(&second, &rotated_away).await;
    assert_eq!(api_error(list_pods(&stale).await).0, 401, "a rotation survives the restart too");

    // A server with a fresh state dir is a different cluster: the old CA does not trust it.
    drop(second);
    let elsewhere = tempfile::tempdir().unwrap();
    let config = secured(Config { state_dir: Some(elsewhere.path().to_path_buf()), ..Config::default() });
    let third = FakeApiServer::builder().config(config).listen_on(addr).start().unwrap();
    let no_retry = client_from_kubeconfig_with(&third.kubeconfig_with_token(&token), |c| c.default_retry = false).await;
    assert!(
        matches!(list_pods(&no_retry).await, Err(kube::Error::Api(s)) if s.code == 401),
        "the old token is foreign"
    );
    assert!(list_pods(&admin).await.is_err(), "the old CA does not trust the new server");
}
