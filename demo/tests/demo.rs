//! The README's demo (`target/debug/demo`), run as a user runs it: it must show a whole node working (rules, ZDS
//! enrollments, an HBONE connection with both identities, bytes and latency), exit 0, and leave no namespace or
//! process behind; and a Ctrl-C in the middle must tear everything down and exit non-zero.

use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::mpsc;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use testbed::wait::{eventually, DEADLINE};

fn demo() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_demo"));
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd
}

/// The namespaces process `pid` created (NetnsGuard names them `<prefix>-<pid>-<n>`) that still exist.
fn netns_of(pid: u32) -> Vec<String> {
    let out = Command::new("ip").args(["netns", "list"]).output().expect("ip netns list");
    let tag = format!("-{pid}-");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| name.contains(&tag))
        .map(str::to_owned)
        .collect()
}

/// The pids the demo printed as `(pid N)` in its progress lines.
fn printed_pids(lines: &[String]) -> Vec<u32> {
    lines.iter().filter_map(|l| l.split("(pid ").nth(1)?.split(')').next()?.parse().ok()).collect()
}

#[test]
fn demo_shows_a_whole_node_and_leaves_nothing_behind() {
    let child = demo().spawn().expect("start the demo");
    let pid = child.id();
    let out = child.wait_with_output().expect("run the demo");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "demo exited with {}:\n{stdout}\n{stderr}", out.status);
    for expected in [
        "[1/9] node: netns node-",
        "conf dir: 10-bridge.conflist = bridge cni0 + host-local",
        "-> istio-cni (ambient_enabled=true)",
        "[4/9] node-agent (pid ",
        "[5/9] hbone-proxy (pid ",
        "[6/9] pod shop/web (sidecar)",
        "ISTIO_REDIRECT; redirect to :15001 :15006",
        "[7/9] pod shop/frontend (ambient)",
        "pod proxy spiffe://cluster.local/ns/shop/sa/frontend listens in the pod on :15001 :15006 :15008",
        "pod proxy spiffe://cluster.local/ns/shop/sa/backend listens in the pod on :15001 :15006 :15008",
        "HBONE (mTLS to ",
        ":15008): spiffe://cluster.local/ns/shop/sa/frontend -> spiffe://cluster.local/ns/shop/sa/backend",
        "bytes: 1048576 sent, 1048576 echoed back",
        "connect latency: HBONE connect ",
        "teardown: done; 3 processes stopped",
        "demo OK",
    ] {
        assert!(stdout.contains(expected), "demo output lacks {expected:?}:\n{stdout}");
    }
    let rules: Vec<_> = stdout.lines().filter(|l| l.trim_start().starts_with("rules: ")).collect();
    assert_eq!(rules.len(), 3, "one rules line per pod:\n{stdout}");
    assert!(rules.iter().all(|l| l.contains(" rules (") && l.contains("redirect to :15001")), "{rules:#?}");
    assert_eq!(netns_of(pid), Vec::<String>::new(), "namespaces left behind");
    let lines: Vec<String> = stdout.lines().map(str::to_owned).collect();
    for p in printed_pids(&lines) {
        assert!(!std::path::Path::new(&format!("/proc/{p}")).exists(), "process {p} still runs");
    }
}

#[test]
fn ctrl_c_mid_run_tears_everything_down() {
    // Its own process group, like a shell job: Ctrl-C reaches the demo and every process it started.
    let mut child = demo().process_group(0).spawn().expect("start the demo");
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take().expect("demo stdout");
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut stderr = child.stderr.take().expect("demo stderr");
    let errors = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });

    let mut lines = Vec::new();
    while !lines.last().is_some_and(|l: &String| l.starts_with("[5/9]")) {
        match rx.recv_timeout(DEADLINE) {
            Ok(line) => lines.push(line),
            Err(e) => panic!("no [5/9] line ({e}); output so far:\n{}", lines.join("\n")),
        }
    }
    let started = printed_pids(&lines);
    assert_eq!(started.len(), 3, "install-cni, node-agent and hbone-proxy pids in:\n{}", lines.join("\n"));
    kill(Pid::from_raw(-(pid as i32)), Signal::SIGINT).expect("Ctrl-C the demo's process group");

    let status = eventually("the demo exits after Ctrl-C", || child.try_wait().expect("poll the demo"));
    lines.extend(rx.iter());
    let (stdout, stderr) = (lines.join("\n"), errors.join().expect("stderr reader"));
    assert_eq!(status.code(), Some(130), "exit status after Ctrl-C:\n{stdout}\n{stderr}");
    assert!(stdout.contains("teardown: done") && stdout.contains("demo interrupted"), "{stdout}\n{stderr}");
    assert!(!stdout.contains("demo OK"), "{stdout}");
    assert_eq!(netns_of(pid), Vec::<String>::new(), "namespaces left behind:\n{stdout}\n{stderr}");
    for p in started {
        assert!(!std::path::Path::new(&format!("/proc/{p}")).exists(), "process {p} still runs");
    }
}
