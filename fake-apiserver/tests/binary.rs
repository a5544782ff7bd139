//! The `fake-apiserver` binary: seeds objects, writes a kubeconfig, serves, and exits on SIGTERM.

mod support;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::Api;
use kube::ResourceExt;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use support::client_from_kubeconfig;

const SEED: &str = r#"
apiVersion: v1
kind: Pod
metadata:
  name: seeded
  namespace: workloads
  labels: {app: seeded}
spec:
  nodeName: node-1
  containers: [{name: app, image: busybox}]
---
apiVersion: v1
kind: Node
metadata:
  name: node-1
"#;

/// Kills the server if the test fails before it shut it down.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

fn wait_for_file(path: &Path) {
    testbed::wait::eventually(&format!("{} is written", path.display()), || path.exists().then_some(()));
}

#[tokio::test]
async fn binary_serves_seed_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let seed = dir.path().join("seed.yaml");
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&seed, SEED).unwrap();

    let child = Command::new(env!("CARGO_BIN_EXE_fake-apiserver"))
        .args(["--listen", "127.0.0.1:0", "--seed"])
        .arg(&seed)
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .stdout(Stdio::piped())
        .spawn()
        .expect("the binary starts");
    let mut child = ChildGuard(child);

    wait_for_file(&kubeconfig);
    let yaml = std::fs::read_to_string(&kubeconfig).unwrap();
    let mut first_line = String::new();
    BufReader::new(child.0.stdout.take().unwrap()).read_line(&mut first_line).unwrap();
    let url = first_line.trim().strip_prefix("listening on ").expect("the announced address").to_string();
    assert!(url.starts_with("http://127.0.0.1:") && !url.ends_with(":0"), "{url}");
    assert!(yaml.contains(&url), "the kubeconfig points at {url}:\n{yaml}");

    let client = client_from_kubeconfig(&yaml).await;
    let pod = Api::<Pod>::namespaced(client.clone(), "workloads").get("seeded").await.unwrap();
    assert_eq!(pod.spec.as_ref().and_then(|s| s.node_name.as_deref()), Some("node-1"));
    assert!(pod.uid().is_some() && pod.resource_version().is_some());
    assert_eq!(Api::<Node>::all(client).get("node-1").await.unwrap().name_any(), "node-1");

    let status = Command::new("kill").args(["-TERM", &child.0.id().to_string()]).status().unwrap();
    assert!(status.success());
    let exit = testbed::wait::eventually("the server exits after SIGTERM", || child.0.try_wait().unwrap());
    assert!(exit.success(), "clean exit on SIGTERM: {exit:?}");
}

/// Starts the binary with `args` and returns it with the URL it announced.
fn start_binary(args: &[&str], dir: &Path) -> (ChildGuard, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_fake-apiserver"))
        .args(args)
        .arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--kubeconfig")
        .arg(dir.join("kubeconfig"))
        .arg("--seed")
        .arg(dir.join("seed.yaml"))
        .stdout(Stdio::piped())
        .spawn()
        .expect("the binary starts");
    let mut first_line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut first_line).unwrap();
    let url = first_line.trim().strip_prefix("listening on ").expect("the announced address").to_string();
    (ChildGuard(child), url)
}

fn stop(mut child: ChildGuard) {
    let status = Command::new("kill").args(["-TERM", &child.0.id().to_string()]).status().unwrap();
    assert!(status.success());
    let exit = testbed::wait::eventually("the server exits after SIGTERM", || child.0.try_wait().unwrap());
    assert!(exit.success(), "clean exit on SIGTERM: {exit:?}");
}

#[tokio::test]
async fn strict_binary_serves_https_and_a_restart_keeps_its_clients() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("seed.yaml"), SEED).unwrap();
    let (child, url) = start_binary(&["--strict", "--listen", "127.0.0.1:0"], dir.path());
    assert!(url.starts_with("https://127.0.0.1:"), "{url}");
    let yaml = std::fs::read_to_string(dir.path().join("kubeconfig")).unwrap();
    assert!(yaml.contains("certificate-authority-data") && !yaml.contains("fake-token"), "{yaml}");
    let client = client_from_kubeconfig(&yaml).await;
    let pods = Api::<Pod>::namespaced(client.clone(), "workloads");
    assert_eq!(pods.get("seeded").await.unwrap().name_any(), "seeded");

    // The test endpoints: a service-account token, and the request log.
    let (status, _, token) = support::raw(
        &client,
        "POST",
        "/fake/tokens",
        "application/json",
        r#"{"serviceAccount": "istio-system/istio-cni"}"#,
    )
    .await;
    assert_eq!(status, 200);
    let token = token["token"].as_str().unwrap().to_string();
    let sa = support::client_with_token_yaml(&yaml, &token).await;
    let refused = Api::<Pod>::namespaced(sa.clone(), "workloads").get("seeded").await;
    assert_eq!(support::api_error(refused).0, 403, "no RBAC seeded for the service account");
    let (_, _, log) = support::raw(&client, "GET", "/fake/requests", "", "").await;
    let statuses: Vec<u64> = log.as_array().unwrap().iter().filter_map(|r| r["status"].as_u64()).collect();
    assert_eq!(statuses, [200, 403]);

    // Same port, same state dir: the old client objects still trust the server and their tokens still work.
    let port = url.rsplit(':').next().unwrap().to_string();
    stop(child);
    let (child, again) = start_binary(&["--strict", "--listen", &format!("127.0.0.1:{port}")], dir.path());
    assert_eq!(again, url);
    let pod = testbed::wait::eventually_awaiting("the old client reaches the restarted binary", || async {
        match pods.get("seeded").await {
            Ok(p) => Some(p),
            Err(kube::Error::Api(s)) => panic!("refused after the restart: {s:?}"),
            Err(_) => None,
        }
    })
    .await;
    assert_eq!(pod.name_any(), "seeded");
    let refused = Api::<Pod>::namespaced(sa, "workloads").get("seeded").await;
    assert_eq!(support::api_error(refused).0, 403, "authenticated (not 401) with the token from before the restart");
    stop(child);
}

#[test]
fn help_documents_every_option_and_its_default() {
    let out = Command::new(env!("CARGO_BIN_EXE_fake-apiserver")).arg("--help").output().unwrap();
    let help = String::from_utf8(out.stdout).unwrap();
    for flag in [
        "--strict",
        "--tls",
        "--tls-san",
        "--state-dir",
        "--authentication",
        "--token-rotation-grace",
        "--rbac",
        "--graceful-deletion",
        "--strict-field-selectors",
        "--watch-timeout",
        "--bookmark-interval",
        "--history-events",
        "--history-age",
        "--expire-unissued-resource-versions",
    ] {
        assert!(help.contains(flag), "--help lacks {flag}:\n{help}");
    }
    assert!(help.contains("[default: 90s]") && help.contains("[default: 10000; --strict: 1000]"), "{help}");
}
