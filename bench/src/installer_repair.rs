//! Scenario 6, installer repair latency: another agent rewrites the primary conflist without our entry (an
//! atomic rename, as well-behaved CNI agents do); the time until install-cni has put `istio-cni` back.

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use istio_contract::names;
use serde_json::Value;
use testbed::install_cni::Installer;
use testbed::Cluster;

use crate::report::Section;
use crate::stats::Counts;
use crate::stats::Summary;

const CONF_FILE: &str = "10-bridge.conflist";
/// How long one repair may take before the run is declared broken.
const LIMIT: Duration = Duration::from_secs(10);

/// Whether the conflist at `path` chains our plugin (a half-written or missing file counts as no).
fn chained(path: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(path) else { return false };
    let Ok(list) = serde_json::from_str::<Value>(&text) else { return false };
    list["plugins"].as_array().is_some_and(|p| p.iter().any(|p| p["type"] == names::PLUGIN_TYPE))
}

/// Polls `probe` without sleeping (a repair takes about a millisecond; a sleep would dominate the figure).
fn spin_until(limit: Duration, mut probe: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if probe() {
            return Some(start.elapsed());
        }
        std::thread::yield_now();
    }
    None
}

/// Writes `text` to `path` by rename, as a rival CNI agent rewrites its config.
fn rival_write(path: &Path, text: &str) {
    let tmp = path.with_extension("rival-tmp");
    std::fs::write(&tmp, text).expect("write rival conflist");
    std::fs::rename(&tmp, path).expect("rename rival conflist");
}

/// Runs the scenario and returns its report section.
pub fn run(counts: Counts) -> Section {
    let cluster = Cluster::new();
    let conf = cluster.node.conf_dir().join(CONF_FILE);
    let rival = serde_json::to_string_pretty(&cluster.node.conflist(vec![])).expect("render conflist");
    rival_write(&conf, &rival);
    let mut installer = Installer::new(&cluster);
    installer.env("LOG_LEVEL", "warn");
    let install = installer.start();
    spin_until(Duration::from_secs(30), || chained(&conf)).expect("install-cni chains the plugin at start");
    let mut samples = Vec::with_capacity(counts.iterations);
    for round in 0..counts.warmup + counts.iterations {
        rival_write(&conf, &rival);
        let took = spin_until(LIMIT, || chained(&conf))
            .unwrap_or_else(|| panic!("no repair within {LIMIT:?}; install-cni log:\n{}", install.log()));
        if round >= counts.warmup {
            samples.push(took);
        }
    }
    let sum = Summary::of(&samples);
    let mut body = String::new();
    let _ = writeln!(
        body,
        "Timed: from the rename of a rival's conflist (the node's bridge + host-local config, without our entry) \
         until the file on disk chains `istio-cni` again, polled in a tight loop. Warm-up {} rewrites, then {} \
         timed rewrites, one after the other.\n",
        counts.warmup, counts.iterations
    );
    let _ = writeln!(body, "| figure | median µs | p90 µs | p99 µs |\n|---|---:|---:|---:|");
    let _ = writeln!(body, "| conflist rewrite → our entry back | {} |", sum.us_cells());
    Section { name: "installer-repair", title: "Installer repair latency".into(), body }
}
