//! The plugin's log file in the RAM-backed run dir stays under its cap however many pods come and go: 10,000
//! ADDs of the real binary, run in parallel as a busy node's runtime runs them, leave at most two files, each
//! within the cap, with the newest lines in `istio-cni.log` and no line torn by a concurrent writer.

use std::sync::atomic::{AtomicUsize, Ordering};

use plugin::log_file;
use serde_json::json;
use testbed::{bins, Runtime};

/// How many ADDs the node sees.
const ADDS: usize = 10_000;

#[test]
fn ten_thousand_adds_leave_the_plugin_log_under_its_cap_with_the_newest_lines_kept() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let runtime = Runtime::new(vec![], dir.path().join("cache"));
    // Pass-through ADDs (no pod in CNI_ARGS) at debug: each writes a few lines naming its container.
    let conf = json!({ "cniVersion": "1.0.0", "name": "k8s-pod-network", "type": "istio-cni",
                       "cni_agent_run_dir": run_dir, "plugin_log_level": "debug" })
    .to_string();
    let add = |container: &str| {
        let env = [
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", container),
            ("CNI_NETNS", "/proc/self/ns/net"),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", "/opt/cni/bin"),
        ];
        let out = runtime.exec_raw(&bins::path("istio-cni"), &env, conf.as_bytes()).expect("exec istio-cni");
        assert!(out.status.success(), "ADD of {container}: {}{}", out.stdout_str(), out.stderr_str());
    };

    let next = AtomicUsize::new(0);
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get() * 2);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= ADDS - 1 {
                    break;
                }
                add(&format!("c{n}"));
            });
        }
    });
    // The last ADD runs alone, so its lines are the newest.
    add("newest");

    let mut files: Vec<String> = std::fs::read_dir(&run_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with(log_file::NAME))
        .collect();
    files.sort();
    let read = |name: &str| std::fs::read_to_string(run_dir.join(name)).unwrap();
    let texts: Vec<(String, String)> = files.iter().map(|name| (name.clone(), read(name))).collect();
    let longest = texts.iter().flat_map(|(_, text)| text.lines()).map(|l| l.len() as u64 + 1).max().unwrap();
    for (name, text) in &texts {
        let size = text.len() as u64;
        assert!(size <= log_file::MAX_BYTES + longest, "{name} is {size} bytes, over the cap {}", log_file::MAX_BYTES);
        assert!(text.ends_with('\n'), "{name} ends in a torn line");
        // Every line is one whole event of one ADD: concurrent writers never interleave within a line.
        for line in text.lines() {
            assert_eq!(line.matches("container=").count(), 1, "{name} holds a torn or merged line: {line:?}");
        }
    }
    assert_eq!(files, [log_file::NAME, log_file::ROTATED_NAME], "exactly the log file and one rotated file");
    let (current, rotated) = (&texts[0].1, &texts[1].1);
    assert!(current.contains("container=newest"), "the newest ADD's lines are in {}", log_file::NAME);
    assert!(!rotated.contains("container=newest"), "and only there");
}
