//! A pod attached by a timed CNI ADD through the fake runtime, torn down (DEL, netns removed) when dropped, so
//! every scenario cleans up after itself even when it panics.

use std::time::{Duration, Instant};

use serde_json::Value;
use testbed::runtime::RuntimeConf;
use testbed::{NetnsGuard, NetworkConfigList, Node, Runtime};

/// The attachment and how long its ADD took (netns creation excluded: the runtime makes it before ADD).
pub struct Attached {
    /// The pod's netns.
    pub netns: NetnsGuard,
    /// When the ADD started (after the netns was made): what later figures of the pod are timed from.
    pub started: Instant,
    /// Wall time of the ADD alone.
    pub took: Duration,
    /// The ADD result.
    pub result: Value,
    conf: RuntimeConf,
    list: NetworkConfigList,
    runtime: Runtime,
}

impl Attached {
    /// The pod's first IPv4 address.
    pub fn ip(&self) -> std::net::Ipv4Addr {
        testbed::node::first_ipv4(&self.result).expect("ADD result has an IPv4 address")
    }
}

/// Creates a fresh pod netns (untimed), then times CNI ADD of `list` for pod `namespace/name` on `node`, with the
/// CNI_ARGS kubelet's runtimes pass. Panics if ADD fails: a benchmark of a failing path measures nothing.
pub fn timed_add(node: &Node, list: &NetworkConfigList, namespace: &str, name: &str) -> Attached {
    let netns = node.pod_netns();
    let conf = testbed::node::pod_attachment(&netns, namespace, name, "");
    let runtime = node.runtime().clone();
    let start = Instant::now();
    let result = runtime.add(list, &conf).unwrap_or_else(|e| panic!("CNI ADD of {namespace}/{name}: {e}"));
    let took = start.elapsed();
    Attached { netns, started: start, took, result, conf, list: list.clone(), runtime }
}

impl Drop for Attached {
    fn drop(&mut self) {
        if let Err(e) = self.runtime.del(&self.list, &self.conf) {
            eprintln!("DEL of {}: {e}", self.conf.container_id);
        }
    }
}
