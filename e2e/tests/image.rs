//! The container image: scripts/build-image.sh builds the static binaries and a FROM scratch image with
//! Debian's podman (vfs storage, no registry), and the image's install-cni, run the way the chart runs it
//! (the chart's env, no capabilities, read-only root), installs and chains the plugin into a host conf dir
//! holding a real bridge conflist, then uninstalls it when stopped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testbed::chart::Rendered;
use testbed::podman::Podman;
use testbed::wait::eventually_or;

/// The static build may compile the whole dependency tree on a fresh machine.
const BUILD_DEADLINE: Duration = Duration::from_secs(20 * 60);
/// Any single podman command other than the build.
const PODMAN_DEADLINE: Duration = Duration::from_secs(120);

static CONFLIST: &str = r#"{
  "cniVersion": "1.0.0",
  "name": "podnet",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": true,
      "ipam": { "type": "host-local", "ranges": [[{ "subnet": "10.88.0.0/16" }]] }
    }
  ]
}
"#;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs `cmd` with piped output, killing it when `deadline` passes; panics saying what timed out.
fn run(mut cmd: Command, deadline: Duration) -> Output {
    let what = format!("{:?}", cmd.get_program());
    let child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn();
    let mut child: Child = child.unwrap_or_else(|e| panic!("spawn {what}: {e}"));
    let start = Instant::now();
    let outputs = {
        let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
        let out = std::thread::spawn(move || read_all(&mut out));
        let err = std::thread::spawn(move || read_all(&mut err));
        (out, err)
    };
    let Some(status) = testbed::wait::exit_within(&mut child, start, deadline) else {
        let _ = child.kill();
        panic!("{what} did not finish within {deadline:?}");
    };
    Output { status, stdout: outputs.0.join().unwrap(), stderr: outputs.1.join().unwrap() }
}

fn read_all(r: &mut impl std::io::Read) -> Vec<u8> {
    let mut buf = Vec::new();
    let _ = r.read_to_end(&mut buf);
    buf
}

#[track_caller]
fn ok(out: Output, what: &str) -> String {
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{what} failed ({}):\n{text}{}", out.status, String::from_utf8_lossy(&out.stderr));
    text
}

/// A detached container, removed (with force) when dropped, even on panic.
struct Container<'a> {
    podman: &'a Podman,
    name: String,
}

impl Container<'_> {
    fn podman(&self, args: &[&str]) -> Output {
        let mut cmd = self.podman.command();
        cmd.args(args);
        run(cmd, PODMAN_DEADLINE)
    }

    fn logs(&self) -> String {
        let out = self.podman(&["logs", &self.name]);
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    }
}

impl Drop for Container<'_> {
    fn drop(&mut self) {
        let _ = self.podman(&["rm", "--force", "--time", "0", &self.name]);
    }
}

#[test]
fn scratch_image_installs_and_chains_the_plugin_then_uninstalls_on_stop() {
    let podman = Podman::new(Path::new("/usr/lib/cni"));
    let image = format!("localhost/istio-cni-test:{}", std::process::id());

    // The image, built by the script users run, with this test's private podman storage.
    let base = podman.command();
    let mut prefix = vec![base.get_program().to_string_lossy().into_owned()];
    prefix.extend(base.get_args().map(|a| a.to_string_lossy().into_owned()));
    assert!(prefix.iter().all(|a| !a.contains(char::is_whitespace)), "PODMAN is word-split: {prefix:?}");
    let mut build = Command::new(repo().join("scripts/build-image.sh"));
    build.arg(&image).env("PODMAN", prefix.join(" "));
    for (key, value) in base.get_envs() {
        if let Some(value) = value {
            build.env(key, value);
        }
    }
    ok(run(build, BUILD_DEADLINE), "scripts/build-image.sh");

    // The node: bin dir, a conf dir holding a real bridge conflist, the run dir and a service account.
    let host = tempfile::Builder::new().prefix("image-host-").tempdir().expect("host tempdir");
    let dir = |name: &str| {
        let d = host.path().join(name);
        std::fs::create_dir(&d).expect("host dir");
        d
    };
    let (bin, net_d, run_dir, sa) = (dir("bin"), dir("net.d"), dir("run"), dir("sa"));
    std::fs::write(net_d.join("10-bridge.conflist"), CONFLIST).expect("conflist");
    std::fs::write(sa.join("token"), "test-token").expect("token");
    std::fs::write(sa.join("ca.crt"), "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n").expect("ca");

    // install-cni as the chart runs it: the chart's ConfigMap as env, no capabilities, read-only root.
    let rendered = Rendered::new(&[]);
    let mut env: Vec<(String, String)> = rendered.config_map("istio-cni-config").into_iter().collect();
    env.extend(
        [
            ("NODE_NAME", "node-1"),
            ("POD_NAME", "istio-cni-node-test"),
            ("POD_NAMESPACE", "istio-system"),
            ("KUBERNETES_SERVICE_HOST", "10.96.0.1"),
            ("KUBERNETES_SERVICE_PORT", "443"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned())),
    );
    let name = format!("install-cni-{}", std::process::id());
    let volume = |host: &Path, container: &str| format!("{}:{container}", host.display());
    let mut args: Vec<String> = [
        "run",
        "--detach",
        "--name",
        &name,
        "--network",
        "none",
        "--read-only",
        "--cap-drop",
        "all",
        "--security-opt",
        "no-new-privileges",
        "--user",
        "0:0",
        "--ulimit",
        "nofile=4096:4096",
        "--ulimit",
        "nproc=4096:4096",
    ]
    .map(String::from)
    .into();
    for (host_dir, mount) in [
        (&bin, "/host/opt/cni/bin"),
        (&net_d, "/host/etc/cni/net.d"),
        (&run_dir, "/var/run/istio-cni"),
        (&sa, "/var/run/secrets/kubernetes.io/serviceaccount"),
    ] {
        args.extend(["--volume".to_owned(), volume(host_dir, mount)]);
    }
    for (k, v) in &env {
        args.extend(["--env".to_owned(), format!("{k}={v}")]);
    }
    args.extend([image.clone(), "install-cni".to_owned()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let container = Container { podman: &podman, name: name.clone() };
    ok(container.podman(&args), "podman run");

    let conflist = net_d.join("10-bridge.conflist");
    let chained =
        |conf: &Value| conf["plugins"].as_array().and_then(|p| p.last()).is_some_and(|p| p["type"] == "istio-cni");
    let conf: Value = eventually_or(
        "the plugin is chained into the bridge conflist",
        || {
            let conf: Value = serde_json::from_slice(&std::fs::read(&conflist).ok()?).ok()?;
            chained(&conf).then_some(conf)
        },
        || container.logs(),
    );
    assert_eq!(conf["plugins"][0]["type"], "bridge", "{conf}");
    assert_eq!(conf["plugins"].as_array().unwrap().len(), 2, "{conf}");
    let entry = &conf["plugins"][1];
    assert_eq!(entry["cni_agent_run_dir"], "/var/run/istio-cni", "{entry}");
    // Istio's chart default.
    assert_eq!(entry["exclude_namespaces"], json!(["kube-system"]), "{entry}");

    let plugin = bin.join("istio-cni");
    let built = repo().join("target/static/x86_64-unknown-linux-gnu/debug/istio-cni");
    assert_eq!(std::fs::read(&plugin).expect("plugin installed"), std::fs::read(&built).expect("built plugin"));
    use std::os::unix::fs::PermissionsExt;
    assert_ne!(std::fs::metadata(&plugin).unwrap().permissions().mode() & 0o111, 0, "plugin not executable");

    let kubeconfig = eventually_or(
        "the plugin's kubeconfig is written into the run dir",
        || std::fs::read_to_string(run_dir.join("istio-cni-kubeconfig")).ok(),
        || container.logs(),
    );
    assert!(kubeconfig.contains("server: https://10.96.0.1:443") && kubeconfig.contains("token: test-token"));
    let conf_files: Vec<_> = std::fs::read_dir(&net_d).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(conf_files, ["10-bridge.conflist"], "only the conflist lives in the conf dir");

    // Stopping the container (SIGTERM, as on uninstall with ambient off) removes the plugin again.
    ok(container.podman(&["stop", "--time", "20", &name]), "podman stop");
    let restored: Value = serde_json::from_slice(&std::fs::read(&conflist).unwrap()).unwrap();
    assert!(!chained(&restored), "plugin still chained after stop: {restored}\n{}", container.logs());
    assert!(!plugin.exists(), "plugin binary left behind after stop");
    assert!(!run_dir.join("istio-cni-kubeconfig").exists(), "kubeconfig left behind after stop");
    let code = ok(container.podman(&["inspect", "--format", "{{.State.ExitCode}}", &name]), "inspect");
    assert_eq!(code.trim(), "0", "install-cni exit code\n{}", container.logs());
    drop(container);
    let _ = run_podman(&podman, &["rmi", "--force", &image]);
}

fn run_podman(podman: &Podman, args: &[&str]) -> Output {
    let mut cmd = podman.command();
    cmd.args(args);
    run(cmd, PODMAN_DEADLINE)
}
