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
//! (our proxy's among them) reach it, with its serving certificate for [`SERVER_NAME`]; while it runs, the cluster
//! DNS answers that name with that address, so a pod finds istiod by its Service name as in a cluster. It is killed
//! on drop.

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
    _dns: ServiceDns,
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
        let mut istiod = RealIstiod { child, dir, _dns: ServiceDns::start() };
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

/// The cluster's DNS for istiod's Service, as CoreDNS would answer it: the node's kubelet gives pods
/// `nameserver` [`HOST_IP`] (`clusterDNS` in `scripts/cluster.sh`) with the cluster's search domains, and this answers
/// `A` queries for [`SERVER_NAME`] (and it under `cluster.local`) with [`HOST_IP`], where istiod listens; any other
/// name gets NXDOMAIN, any other type for those names an empty answer. UDP only (its answers are small, so clients
/// never retry over TCP). Stops on drop.
#[derive(Debug)]
struct ServiceDns {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ServiceDns {
    fn start() -> ServiceDns {
        let socket = std::net::UdpSocket::bind((HOST_IP, 53)).unwrap_or_else(|e| panic!("bind {HOST_IP}:53: {e}"));
        // The loop looks at the stop flag between datagrams.
        socket.set_read_timeout(Some(Duration::from_millis(200))).expect("read timeout");
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopping = stop.clone();
        let address: std::net::Ipv4Addr = HOST_IP.parse().expect("the host IP");
        let thread = std::thread::spawn(move || {
            let mut buf = [0u8; 512];
            while !stopping.load(std::sync::atomic::Ordering::Relaxed) {
                let Ok((len, from)) = socket.recv_from(&mut buf) else { continue };
                if let Some(answer) = dns_answer(&buf[..len], address) {
                    let _ = socket.send_to(&answer, from);
                }
            }
        });
        ServiceDns { stop, thread: Some(thread) }
    }
}

impl Drop for ServiceDns {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The answer to one DNS query (RFC 1035): `address` for an `A` query of istiod's Service name; `None` for what is
/// not a query of one question.
fn dns_answer(query: &[u8], address: std::net::Ipv4Addr) -> Option<Vec<u8>> {
    let header = query.get(..12)?;
    if header[2] & 0x80 != 0 || u16::from_be_bytes([header[4], header[5]]) != 1 {
        return None;
    }
    let mut at = 12;
    let mut labels = Vec::new();
    loop {
        let len = usize::from(*query.get(at)?);
        at += 1;
        if len == 0 {
            break;
        }
        if len > 63 {
            return None;
        }
        labels.push(String::from_utf8_lossy(query.get(at..at + len)?).to_ascii_lowercase());
        at += len;
    }
    let question_end = at + 4;
    let qtype = u16::from_be_bytes([*query.get(at)?, *query.get(at + 1)?]);
    let name = labels.join(".");
    let ours = name == SERVER_NAME || name == format!("{SERVER_NAME}.cluster.local");
    let answer = ours && qtype == 1;
    let mut out = Vec::with_capacity(question_end + 16);
    out.extend_from_slice(&header[..2]);
    // QR, the query's opcode and RD, RA; NXDOMAIN for a name that is not ours.
    out.push(0x80 | (header[2] & 0x79));
    out.push(if ours { 0x80 } else { 0x83 });
    out.extend_from_slice(&[0, 1, 0, u8::from(answer), 0, 0, 0, 0]);
    out.extend_from_slice(query.get(12..question_end)?);
    if answer {
        out.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 30, 0, 4]);
        out.extend_from_slice(&address.octets());
    }
    Some(out)
}

/// Istio's CRDs in the pinned module (`scripts/istio-ref/build.sh crd-file`).
fn crd_file() -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/istio-ref/build.sh");
    let out = Command::new("bash").arg(&script).arg("crd-file").output().expect("run scripts/istio-ref/build.sh");
    assert!(out.status.success(), "crd-file: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(name: &str, qtype: u16) -> Vec<u8> {
        let mut q = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        for label in name.split('.') {
            q.push(label.len() as u8);
            q.extend_from_slice(label.as_bytes());
        }
        q.push(0);
        q.extend_from_slice(&qtype.to_be_bytes());
        q.extend_from_slice(&[0, 1]);
        q
    }

    #[test]
    fn istiods_name_is_answered_with_the_host_and_other_names_are_not_found() {
        let address: std::net::Ipv4Addr = HOST_IP.parse().unwrap();
        for name in [SERVER_NAME.to_string(), format!("{SERVER_NAME}.cluster.local")] {
            let q = query(&name, 1);
            let a = dns_answer(&q, address).unwrap();
            assert_eq!(&a[..2], &[0x12, 0x34], "the query's id");
            assert_eq!((a[2] & 0x80, a[3] & 0x0f), (0x80, 0), "a response, NOERROR");
            assert_eq!(&a[6..8], &[0, 1], "one answer");
            assert_eq!(&a[a.len() - 4..], &address.octets());
        }
        let aaaa = dns_answer(&query(SERVER_NAME, 28), address).unwrap();
        assert_eq!((aaaa[3] & 0x0f, &aaaa[6..8]), (0, &[0u8, 0][..]), "no IPv6 address, not an error");
        let other = dns_answer(&query("istiod.istio-system.svc.istio-system.svc.cluster.local", 1), address).unwrap();
        assert_eq!((other[3] & 0x0f, &other[6..8]), (3, &[0u8, 0][..]), "NXDOMAIN");
        assert!(dns_answer(&[0; 5], address).is_none());
    }
}
