//! A real kube-apiserver (and its etcd) for tests that hold the fake API server to the real one.
//!
//! [`RealApiServer::start`] runs `etcd` and `kube-apiserver` built by `scripts/real-node/build.sh` (looked up in
//! `REAL_NODE_CACHE`, default `/var/cache/istio-cni-rs/real-node`) as child processes on free ports of
//! 127.0.0.1, with their data, certificates and logs in a temp dir; both are killed and the dir removed when
//! the value is dropped (also while a failing test unwinds; a test process killed outright takes them along
//! through `PR_SET_PDEATHSIG`). The server is configured as a kubeadm control plane would be, minus the
//! controllers: https with its own CA, static bearer tokens ([`ADMIN_TOKEN`] in `system:masters`, and
//! [`USER_NAME`], in no group that grants anything), `Node,RBAC` authorization, `NodeRestriction` and the
//! default admission plugins (ServiceAccount included: a namespace needs its `default` ServiceAccount
//! created before pods, no controller does it here), and service-account tokens signed by its own key.
//! ConfigMaps bypass the watch cache (`--watch-cache-sizes=configmaps#0`), so that their watches read etcd
//! and [`RealApiServer::compact`] makes older resourceVersions 410, as compaction does on a real cluster
//! once the cache no longer holds them; every other kind is served by the watch cache as in production.
//!
//! When the binaries are not built, [`RealApiServer::start`] prints `SKIPPED: ...` and returns `None`, so the
//! test passes without checking anything; with `REAL_NODE_REQUIRED=1` it panics instead.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The admin's bearer token (user `real-admin`, group `system:masters`).
pub const ADMIN_TOKEN: &str = "real-admin-token";
/// An authenticated user nothing is granted to (beyond what every authenticated user may do).
pub const USER_NAME: &str = "alice";
/// [`USER_NAME`]'s bearer token.
pub const USER_TOKEN: &str = "alice-token";
/// [`USER_NAME`]'s groups besides `system:authenticated` (which the server adds).
pub const USER_GROUPS: [&str; 1] = ["team-a"];

/// How long etcd and the apiserver may take to become ready (a cold start on a loaded 2-core machine).
const START_DEADLINE: Duration = Duration::from_secs(180);

const K8S_VERSION: &str = "1.34.4";
const ETCD_VERSION: &str = "3.6.16";

/// A running etcd + kube-apiserver pair; dropping it stops both and removes their data.
#[derive(Debug)]
pub struct RealApiServer {
    url: String,
    etcd_url: String,
    ca_pem: String,
    etcd: Option<Child>,
    apiserver: Option<Child>,
    dir: tempfile::TempDir,
}

/// Where `build.sh` leaves the binaries: `(kube-apiserver, etcd)`.
pub fn binaries() -> (PathBuf, PathBuf) {
    let cache =
        std::env::var_os("REAL_NODE_CACHE").map_or_else(|| "/var/cache/istio-cni-rs/real-node".into(), PathBuf::from);
    let k8s = std::env::var("K8S_VERSION").unwrap_or_else(|_| K8S_VERSION.to_string());
    let etcd = std::env::var("ETCD_VERSION").unwrap_or_else(|_| ETCD_VERSION.to_string());
    (cache.join(format!("kubernetes-v{k8s}/bin/kube-apiserver")), cache.join(format!("etcd-v{etcd}/bin/etcd")))
}

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("its address").port()
}

/// Runs `program` with `args`, its output in `log`, killed when the spawning thread (the test) dies.
fn spawn(program: &Path, args: &[String], log: &Path) -> Child {
    let out = std::fs::File::create(log).expect("create a log file");
    let err = out.try_clone().expect("clone the log file");
    let mut cmd = Command::new(program);
    cmd.args(args).stdin(Stdio::null()).stdout(out).stderr(err);
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    cmd.spawn().unwrap_or_else(|e| panic!("start {}: {e}", program.display()))
}

fn stop(child: &mut Option<Child>) {
    if let Some(mut child) = child.take() {
        if let Ok(pid) = i32::try_from(child.id()) {
            // SAFETY: signalling our own child by its pid, which it keeps until we reap it below.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        if crate::wait::exit_within(&mut child, Instant::now(), Duration::from_secs(5)).is_none() {
            let _ = child.kill();
        }
        let _ = child.wait();
    }
}

/// One HTTP/1.0 request over `stream` (plain or TLS): `(status, body)`.
fn exchange(
    mut stream: impl Read + Write,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> Result<(u16, String), String> {
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).and_then(|()| stream.write_all(body.as_bytes())).map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    match stream.read_to_end(&mut raw) {
        Ok(_) => {}
        // A TLS peer that closes without close_notify after a complete answer.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !raw.is_empty() => {}
        Err(e) => return Err(e.to_string()),
    }
    let raw = String::from_utf8_lossy(&raw);
    let (head, body) = raw.split_once("\r\n\r\n").ok_or_else(|| format!("no header end in {raw:?}"))?;
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| format!("bad head {head:?}"))?;
    Ok((status, body.to_string()))
}

fn connect(url: &str) -> Result<TcpStream, String> {
    let addr: SocketAddr = url.rsplit('/').next().unwrap_or_default().parse().map_err(|e| format!("{url}: {e}"))?;
    let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map_err(|e| e.to_string())?;
    stream.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
    Ok(stream)
}

/// A self-signed CA and a serving certificate for 127.0.0.1 it signed: `(ca.crt, apiserver.crt, apiserver.key)`.
fn pki() -> (String, String, String) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
    let ca_key = KeyPair::generate().expect("a CA key");
    let mut ca = CertificateParams::default();
    ca.distinguished_name.push(DnType::CommonName, "real-apiserver-ca");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let ca_cert = ca.self_signed(&ca_key).expect("the CA certificate");
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().expect("a serving key");
    let names = ["127.0.0.1", "localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"];
    let mut serving = CertificateParams::new(names.map(String::from).to_vec()).expect("serving names");
    serving.distinguished_name.push(DnType::CommonName, "kube-apiserver");
    serving.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let cert = serving.signed_by(&key, &issuer).expect("the serving certificate");
    (ca_cert.pem(), cert.pem(), key.serialize_pem())
}

impl RealApiServer {
    /// Starts etcd and kube-apiserver and waits until the apiserver is ready. `None` (after printing
    /// `SKIPPED: ...`) when the binaries are not built, unless `REAL_NODE_REQUIRED=1`: then it panics.
    pub fn start() -> Option<RealApiServer> {
        let (apiserver, etcd) = binaries();
        for bin in [&apiserver, &etcd] {
            if !bin.exists() {
                let name = bin.file_name().and_then(|n| n.to_str()).unwrap_or("binary");
                let why = format!("no {name} at {}; run scripts/real-node/build.sh", bin.display());
                if std::env::var("REAL_NODE_REQUIRED").is_ok_and(|v| v == "1") {
                    panic!("REAL_NODE_REQUIRED=1 but {why}");
                }
                println!("SKIPPED: {why}");
                return None;
            }
        }
        Some(RealApiServer::start_with(&apiserver, &etcd))
    }

    fn start_with(apiserver_bin: &Path, etcd_bin: &Path) -> RealApiServer {
        let dir = tempfile::Builder::new().prefix("real-apiserver-").tempdir().expect("a temp dir");
        let d = dir.path();
        let (client, peer) = (free_port(), free_port());
        let etcd_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let etcd_args = [
            "--name=default".to_string(),
            format!("--data-dir={}", d.join("etcd").display()),
            format!("--listen-client-urls={etcd_url}"),
            format!("--advertise-client-urls={etcd_url}"),
            format!("--listen-peer-urls={peer_url}"),
            format!("--initial-advertise-peer-urls={peer_url}"),
            format!("--initial-cluster=default={peer_url}"),
            "--unsafe-no-fsync=true".to_string(),
            "--log-level=warn".to_string(),
        ];
        let mut server = RealApiServer {
            url: String::new(),
            etcd_url: etcd_url.clone(),
            ca_pem: String::new(),
            etcd: Some(spawn(etcd_bin, &etcd_args, &d.join("etcd.log"))),
            apiserver: None,
            dir,
        };
        let d = server.dir.path().to_path_buf();
        server.wait_ready("etcd is healthy", "etcd.log", |s| {
            let (status, body) = exchange(connect(&s.etcd_url)?, "GET", "/health", None, "")?;
            (status == 200 && body.contains("true")).then_some(()).ok_or(body)
        });

        let (ca, cert, key) = pki();
        let sa_key = rcgen::KeyPair::generate().expect("a service-account signing key");
        let write = |name: &str, text: &str| std::fs::write(d.join(name), text).expect("write a server file");
        write("ca.crt", &ca);
        write("apiserver.crt", &cert);
        write("apiserver.key", &key);
        write("sa.key", &sa_key.serialize_pem());
        write("sa.pub", &sa_key.public_key_pem());
        write(
            "tokens.csv",
            &format!(
                "{ADMIN_TOKEN},real-admin,uid-admin,\"system:masters\"\n{USER_TOKEN},{USER_NAME},uid-alice,\"{}\"\n",
                USER_GROUPS.join(",")
            ),
        );
        let port = free_port();
        let path = |name: &str| d.join(name).display().to_string();
        let args = [
            format!("--etcd-servers={etcd_url}"),
            "--bind-address=127.0.0.1".to_string(),
            "--advertise-address=127.0.0.1".to_string(),
            format!("--secure-port={port}"),
            format!("--cert-dir={}", path("certs")),
            format!("--tls-cert-file={}", path("apiserver.crt")),
            format!("--tls-private-key-file={}", path("apiserver.key")),
            format!("--token-auth-file={}", path("tokens.csv")),
            "--authorization-mode=Node,RBAC".to_string(),
            "--enable-admission-plugins=NodeRestriction".to_string(),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".to_string(),
            format!("--service-account-key-file={}", path("sa.pub")),
            format!("--service-account-signing-key-file={}", path("sa.key")),
            "--service-cluster-ip-range=10.96.0.0/16".to_string(),
            "--allow-privileged=true".to_string(),
            // Compaction is the tests' to decide (RealApiServer::compact), not a timer's.
            "--etcd-compaction-interval=0".to_string(),
            "--watch-cache-sizes=configmaps#0".to_string(),
            "--profiling=false".to_string(),
            "--v=1".to_string(),
        ];
        server.url = format!("https://127.0.0.1:{port}");
        server.ca_pem = ca;
        server.apiserver = Some(spawn(apiserver_bin, &args, &d.join("kube-apiserver.log")));
        server.wait_ready("kube-apiserver is ready", "kube-apiserver.log", |s| {
            let (status, body) = s.request("GET", "/readyz", Some(ADMIN_TOKEN), "")?;
            (status == 200).then_some(()).ok_or(body)
        });
        server
    }

    /// Polls `probe` until it succeeds, failing with the process's log (and the last answer) after
    /// [`START_DEADLINE`] or when a process exits.
    fn wait_ready(&mut self, what: &str, log: &str, probe: impl Fn(&RealApiServer) -> Result<(), String>) {
        let mut last = String::new();
        let started = Instant::now();
        let ready = crate::wait::within(started, START_DEADLINE, || {
            for child in [&mut self.etcd, &mut self.apiserver].into_iter().flatten() {
                if let Ok(Some(status)) = child.try_wait() {
                    return Some(Err(format!("a server process exited ({status})")));
                }
            }
            match probe(self) {
                Ok(()) => Some(Ok(())),
                Err(e) => {
                    last = e;
                    None
                }
            }
        });
        let failure = match ready {
            Some(Ok(())) => return,
            Some(Err(e)) => e,
            None => format!("timed out after {START_DEADLINE:?}; last answer: {last}"),
        };
        let text = std::fs::read_to_string(self.dir.path().join(log)).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(40).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        panic!("waiting until {what}: {failure}\n--- {log} (last lines) ---\n{}", tail.join("\n"));
    }

    /// One request to the apiserver over https (trusting its CA), as `token`: `(status, body)`.
    pub fn request(&self, method: &str, path: &str, token: Option<&str>, body: &str) -> Result<(u16, String), String> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, ServerName};
        let mut roots = rustls::RootCertStore::empty();
        let ca = CertificateDer::from_pem_slice(self.ca_pem.as_bytes()).map_err(|e| e.to_string())?;
        roots.add(ca).map_err(|e| e.to_string())?;
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let name = ServerName::try_from("127.0.0.1").map_err(|e| e.to_string())?;
        let conn = rustls::ClientConnection::new(Arc::new(config), name).map_err(|e| e.to_string())?;
        exchange(rustls::StreamOwned::new(conn, connect(&self.url)?), method, path, token, body)
    }

    /// The base URL, `https://127.0.0.1:<port>`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// PEM of the CA that signed the serving certificate.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// A kubeconfig for this server that authenticates with `token` ([`ADMIN_TOKEN`], [`USER_TOKEN`], ...).
    pub fn kubeconfig_with_token(&self, token: &str) -> String {
        fake_apiserver::kubeconfig_yaml_with(&self.url, Some(&self.ca_pem), token)
    }

    /// A kubeconfig for the admin ([`ADMIN_TOKEN`]).
    pub fn kubeconfig_yaml(&self) -> String {
        self.kubeconfig_with_token(ADMIN_TOKEN)
    }

    fn etcd(&self, path: &str, body: &str) -> serde_json::Value {
        let (status, text) = connect(&self.etcd_url)
            .and_then(|s| exchange(s, "POST", path, None, body))
            .unwrap_or_else(|e| panic!("etcd {path}: {e}"));
        assert_eq!(status, 200, "etcd {path}: {text}");
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("etcd {path} answered {text:?}: {e}"))
    }

    /// Compacts etcd at its current revision (what the apiserver's periodic compaction does), so that watches
    /// read from etcd (ConfigMaps here) from any older resourceVersion get 410. Returns the revision.
    pub fn compact(&self) -> u64 {
        let range = self.etcd("/v3/kv/range", r#"{"key": "AA==", "limit": 1}"#);
        let revision: u64 = range["header"]["revision"]
            .as_str()
            .and_then(|r| r.parse().ok())
            .unwrap_or_else(|| panic!("etcd's revision in {range}"));
        self.etcd("/v3/kv/compaction", &format!(r#"{{"revision": "{revision}", "physical": true}}"#));
        revision
    }

    /// The kube-apiserver's log so far, for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("kube-apiserver.log")).unwrap_or_default()
    }
}

impl Drop for RealApiServer {
    fn drop(&mut self) {
        stop(&mut self.apiserver);
        stop(&mut self.etcd);
    }
}
