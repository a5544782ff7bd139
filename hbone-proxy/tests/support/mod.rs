//! The real `hbone-proxy` in a test node's netns, shared by the end-to-end tests of this crate.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use netns::Netns;
use tests::install_cni::eventually;
use tests::node_agent::NodeAgent;
use tests::Cluster;

/// Where the proxy serves `/healthz/ready` (Istio's port), inside the node netns.
const READY_PORT: u16 = 15021;

/// The `hbone-proxy` binary running in the node netns; killed on drop, its log printed if the test failed.
pub struct Proxy {
    child: Child,
    log: PathBuf,
}

impl Proxy {
    /// Starts the proxy with the agent's ZDS socket, a state dir and local workloads file under `dir`, plus
    /// `env`; returns once it answers `/healthz/ready` with 200.
    pub fn start(cluster: &Cluster, agent: &NodeAgent, dir: &Path, workloads: &Path, env: &[(&str, &str)]) -> Self {
        let log =
            (0..).map(|n| dir.join(format!("hbone-proxy-{n}.log"))).find(|p| !p.exists()).expect("a free log name");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_hbone-proxy"));
        cmd.env_clear()
            .env("INPOD_UDS", agent.zds_socket())
            .env("STATE_DIR", dir.join("state"))
            .env("LOCAL_WORKLOADS", workloads)
            .env("LOG_LEVEL", "debug,h2=info,rustls=info,hyper=info")
            .env("NO_COLOR", "1")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(&log).expect("proxy log file"));
        let node = cluster.node.netns().open().expect("open node netns");
        let child = node.run(|| cmd.spawn()).expect("enter node netns").expect("spawn hbone-proxy");
        let mut proxy = Proxy { child, log };
        let netns = cluster.node.netns().path();
        eventually("hbone-proxy answers /healthz/ready with 200", || {
            if let Ok(Some(status)) = proxy.child.try_wait() {
                panic!("hbone-proxy exited with {status}; log:\n{}", proxy.log());
            }
            (http_get(&netns, READY_PORT, "/healthz/ready").map(|(status, _)| status) == Some(200)).then_some(())
        });
        proxy
    }

    /// Everything the proxy logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Kills the proxy (as a crash or a node reboot would) and reaps it.
    pub fn stop(&mut self) {
        self.child.kill().expect("kill hbone-proxy");
        self.child.wait().expect("reap hbone-proxy");
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("hbone-proxy log:\n{}", self.log());
        }
    }
}

/// A GET from inside `netns` to 127.0.0.1:`port`: (status, body).
pub fn http_get(netns: &Path, port: u16, path: &str) -> Option<(u16, String)> {
    let ns = Netns::open(netns).ok()?;
    let raw = ns
        .run(|| -> std::io::Result<String> {
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
            stream.set_read_timeout(Some(Duration::from_secs(5)))?;
            write!(stream, "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")?;
            let mut raw = String::new();
            stream.read_to_string(&mut raw)?;
            Ok(raw)
        })
        .ok()?
        .ok()?;
    let status = raw.split(' ').nth(1)?.parse().ok()?;
    let body = raw.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    Some((status, body))
}
