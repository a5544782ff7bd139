//! Istio's own istiod (`pilot-discovery`, built from the pinned `istio.io/istio` module by
//! `scripts/istio-ref/build.sh pilot-discovery`) running beside the real node (issue #32): the control plane our
//! proxy's xDS client is tested against, as an Istio ambient install runs it.
//!
//! Guarantees: [`RealIstiod::start`] returns once istiod has synced its caches and written the mesh root
//! certificate (ConfigMap `istio-ca-root-cert`), with ambient on (`PILOT_ENABLE_AMBIENT=true`), Istio's CRDs applied
//! (so `AuthorizationPolicy` objects reach it), its own self-signed CA, `istio-system/ztunnel` (Istio's chart's) and
//! `istio-system/hbone-proxy` (ours) as the trusted node accounts, and a token of `ztunnel` (audience `istio-ca`)
//! for the xDS client; [`RealIstiod::pod_token`] mints the pod-bound token istiod's impersonation check needs. istiod serves xDS and its CA
//! on the host's end of the link to the node ([`HOST_IP`]:[`SECURE_GRPC_PORT`]), where the host and the node's pods
//! (our proxy's among them) reach it, with its serving certificate for [`SERVER_NAME`]. It is killed on drop.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::real_node::{RealNode, HOST_IP, RELEASE_NAMESPACE};
use crate::wait::within_every;

/// istiod's TLS port for xDS and its CA (Istio's 15012), on the host's loopback.
pub const SECURE_GRPC_PORT: u16 = 15012;
/// The name istiod's own serving certificate carries (its Service in the release namespace); clients dial
/// [`RealIstiod::address`] and check the certificate against this name (`ALT_XDS_HOSTNAME`, `ALT_CA_HOSTNAME`).
pub const SERVER_NAME: &str = "istiod.istio-system.svc";
/// The service account ztunnel runs as in Istio's chart: the node account istiod trusts to impersonate.
pub const NODE_PROXY_ACCOUNT: &str = "ztunnel";
/// How long istiod may take to start and sync.
const START_LIMIT: Duration = Duration::from_secs(120);
/// How often its progress is looked at (a `kubectl` each time).
const POLL: Duration = Duration::from_millis(250);

/// A running istiod; killed on drop.
#[derive(Debug)]
pub struct RealIstiod {
    child: Child,
    dir: TempDir,
}

impl RealIstiod {
    /// Starts istiod against `node`'s API server; `None` (after printing why) when `pilot-discovery` is not built
    /// and `ISTIO_REF_REQUIRED` is not `1` (scripts/test.sh builds it and sets it).
    pub fn start(node: &RealNode) -> Option<RealIstiod> {
        let binary = crate::istio_agent::istio_bin_dir().join("pilot-discovery");
        if !binary.is_file() {
            let why = format!("{} is not built (scripts/istio-ref/build.sh pilot-discovery)", binary.display());
            if std::env::var("ISTIO_REF_REQUIRED").as_deref() == Ok("1") {
                panic!("ISTIO_REF_REQUIRED=1 but {why}");
            }
            eprintln!("SKIPPED: {why}");
            return None;
        }
        node.ok("kubectl", &["apply", "--server-side", "-f", &crd_file()]);
        node.apply(&format!(
            "apiVersion: v1\nkind: ServiceAccount\nmetadata: {{name: {NODE_PROXY_ACCOUNT}, namespace: {RELEASE_NAMESPACE}}}\n"
        ));
        let dir = tempfile::Builder::new().prefix("real-istiod-").tempdir().expect("istiod's dir");
        std::fs::write(dir.path().join("mesh.yaml"), "trustDomain: cluster.local\n").expect("mesh config");
        let log = std::fs::File::create(dir.path().join("istiod.log")).expect("istiod's log");
        let child = Command::new(&binary)
            .current_dir(dir.path())
            .args(["discovery", "--meshConfig=mesh.yaml", "--domain=cluster.local"])
            .arg(format!("--kubeconfig={}", node.kubeconfig().display()))
            .arg(format!("--secureGRPCAddr={HOST_IP}:{SECURE_GRPC_PORT}"))
            .args(["--grpcAddr=127.0.0.1:15010", "--httpAddr=127.0.0.1:15080", "--monitoringAddr=127.0.0.1:15014"])
            .env("POD_NAMESPACE", RELEASE_NAMESPACE)
            .env("PILOT_ENABLE_AMBIENT", "true")
            .env(
                "CA_TRUSTED_NODE_ACCOUNTS",
                format!(
                    "{RELEASE_NAMESPACE}/{NODE_PROXY_ACCOUNT},{RELEASE_NAMESPACE}/{}",
                    crate::chart::PROXY_SERVICE_ACCOUNT
                ),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log fd"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", binary.display()));
        let mut istiod = RealIstiod { child, dir };
        let started = Instant::now();
        within_every(started, START_LIMIT, POLL, || {
            assert!(matches!(istiod.child.try_wait(), Ok(None)), "istiod exited:\n{}", istiod.log());
            istiod.log().contains("marking server ready").then_some(())
        })
        .unwrap_or_else(|| panic!("istiod not ready within {START_LIMIT:?}:\n{}", istiod.log()));
        let root = within_every(started, START_LIMIT, POLL, || {
            let args = [
                "get",
                "configmap",
                "istio-ca-root-cert",
                "-n",
                RELEASE_NAMESPACE,
                "-o",
                "jsonpath={.data.root-cert\\.pem}",
            ];
            let out = node.run("kubectl", &args);
            let pem = String::from_utf8_lossy(&out.stdout).into_owned();
            pem.contains("BEGIN CERTIFICATE").then_some(pem)
        })
        .unwrap_or_else(|| panic!("istiod wrote no istio-ca-root-cert:\n{}", istiod.log()));
        std::fs::write(istiod.root_cert(), root).expect("write the root certificate");
        let token = node.ok(
            "kubectl",
            &["create", "token", NODE_PROXY_ACCOUNT, "-n", RELEASE_NAMESPACE, "--audience=istio-ca", "--duration=1h"],
        );
        std::fs::write(istiod.token(), token.trim()).expect("write the token");
        Some(istiod)
    }

    /// `https://10.251.0.1:15012`: the address a client dials, on the host or in a pod of the node (the serving
    /// certificate names [`SERVER_NAME`]).
    pub fn address(&self) -> String {
        format!("https://{HOST_IP}:{SECURE_GRPC_PORT}")
    }

    /// The mesh root certificate (PEM), as the chart mounts it from `istio-ca-root-cert`.
    pub fn root_cert(&self) -> PathBuf {
        self.dir.path().join("root-cert.pem")
    }

    /// A token of `istio-system/ztunnel` with audience `istio-ca`.
    pub fn token(&self) -> PathBuf {
        self.dir.path().join("istio-token")
    }

    /// A token of service account `account` bound to pod `pod` of the release namespace (audience `istio-ca`), as
    /// the kubelet projects it into a node proxy's pod: istiod's impersonation check needs the caller's pod.
    pub fn pod_token(&self, node: &RealNode, account: &str, pod: &str) -> PathBuf {
        let uid = node.kubectl(&["get", "pod", pod, "-n", RELEASE_NAMESPACE, "-o", "jsonpath={.metadata.uid}"]);
        let token = node.kubectl(&[
            "create",
            "token",
            account,
            "-n",
            RELEASE_NAMESPACE,
            "--audience=istio-ca",
            "--duration=1h",
            "--bound-object-kind=Pod",
            &format!("--bound-object-name={pod}"),
            &format!("--bound-object-uid={}", uid.trim()),
        ]);
        let path = self.dir.path().join(format!("{account}-{pod}-token"));
        std::fs::write(&path, token.trim()).expect("write the pod's token");
        path
    }

    /// Everything istiod logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("istiod.log")).unwrap_or_default()
    }
}

impl Drop for RealIstiod {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Istio's CRDs in the pinned module (`scripts/istio-ref/build.sh crd-file`).
fn crd_file() -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/istio-ref/build.sh");
    let out = Command::new("bash").arg(&script).arg("crd-file").output().expect("run scripts/istio-ref/build.sh");
    assert!(out.status.success(), "crd-file: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}
