//! Named network namespaces for tests, removed on drop (also when the test panics).

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

use netns::{Netns, NetnsError};

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A netns created with `ip netns add` under a unique name (`<prefix>-<pid>-<counter>`), deleted on drop.
#[derive(Debug)]
pub struct NetnsGuard {
    name: String,
}

impl NetnsGuard {
    /// Creates a new namespace whose name starts with `prefix`, with its loopback interface up.
    ///
    /// Panics when `ip netns add` fails: a test cannot proceed without its namespace.
    pub fn new(prefix: &str) -> Self {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!("{prefix}-{}-{n}", std::process::id());
        run_ok(Command::new("ip").args(["netns", "add", &name]));
        let guard = Self { name };
        guard.exec_ok(&["ip", "link", "set", "lo", "up"]);
        guard
    }

    /// The namespace's name as `ip netns` knows it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The bind-mounted namespace file, i.e. what a runtime passes as `CNI_NETNS`.
    pub fn path(&self) -> PathBuf {
        PathBuf::from("/var/run/netns").join(&self.name)
    }

    /// Opens a handle for entering the namespace from Rust (`Netns::run`).
    pub fn open(&self) -> Result<Netns, NetnsError> {
        Netns::open(self.path())
    }

    /// Runs `argv` inside the namespace (`ip netns exec`) and returns its output, whatever the exit code.
    pub fn exec(&self, argv: &[&str]) -> Output {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name]).args(argv);
        cmd.output().unwrap_or_else(|e| panic!("spawn {argv:?} in netns {}: {e}", self.name))
    }

    /// Runs `argv` inside the namespace, panics with its stderr unless it succeeds, and returns stdout.
    pub fn exec_ok(&self, argv: &[&str]) -> String {
        let out = self.exec(argv);
        assert!(
            out.status.success(),
            "{argv:?} in netns {} failed ({}): {}{}",
            self.name,
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs `argv` inside the namespace and parses its stdout as JSON (for `ip -j ...`).
    pub fn exec_json(&self, argv: &[&str]) -> serde_json::Value {
        let out = self.exec_ok(argv);
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{argv:?} printed invalid JSON ({e}): {out}"))
    }
}

impl Drop for NetnsGuard {
    fn drop(&mut self) {
        let out = Command::new("ip").args(["netns", "del", &self.name]).output();
        match out {
            Ok(o) if o.status.success() => {}
            Ok(o) => eprintln!("ip netns del {}: {}", self.name, String::from_utf8_lossy(&o.stderr)),
            Err(e) => eprintln!("ip netns del {}: {e}", self.name),
        }
    }
}

fn run_ok(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
}
