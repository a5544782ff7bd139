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
