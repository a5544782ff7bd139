//! The container image: scripts/build-image.sh builds the static binaries and a FROM scratch image with
//! Debian's podman (vfs storage, no registry), and the image's install-cni, run the way the chart runs it
//! (the chart's env, no capabilities, read-only root), installs and chains the plugin into a host conf dir
//! holding a real bridge conflist, then uninstalls it when stopped. The image's node agent programs rules with the
//! image's own iptables (nft and legacy), as Istio's default iptables mode needs.

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

/// `podman run --detach --name NAME` as the chart runs our containers: no network, a read-only root, every
/// capability dropped (then `extra`), root inside, and open-file and process limits a container may set here.
fn confined_run(name: &str, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> =
        ["run", "--detach", "--name", name, "--network", "none", "--read-only", "--cap-drop", "all"]
            .map(String::from)
            .into();
    args.extend(extra.iter().map(|s| s.to_string()));
    args.extend(["--user", "0:0", "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"].map(String::from));
    args
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

/// Lines of each stream a failure shows: the cause is at the end (a build's log is thousands of lines, and a CI
/// report keeps only a part of what a test prints).
const FAILURE_TAIL_LINES: usize = 60;

#[track_caller]
fn ok(out: Output, what: &str) -> String {
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        panic!(
            "{what} failed ({}):\n--- end of its stderr ---\n{}\n--- end of its stdout ---\n{}",
            out.status,
            tail(&stderr, FAILURE_TAIL_LINES),
            tail(&text, FAILURE_TAIL_LINES)
        );
    }
    text
}

/// The last `n` lines of `text`, saying how many were left out.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let skipped = lines.len().saturating_sub(n);
    let kept = lines[skipped..].join("\n");
    if skipped == 0 {
        kept
    } else {
        format!("[{skipped} earlier lines left out]\n{kept}")
    }
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
    let image = build_image(&podman, "install");

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
    let mut args = confined_run(&name, &["--security-opt", "no-new-privileges"]);
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

/// A representative in-pod rule set, in the form `iptables-save` prints it: Istio's ambient in-pod rules (mark,
/// connmark, CONNMARK, REDIRECT, CT zones, owner) and its TPROXY interception (socket, MARK, TPROXY), so every
/// extension module the node agent's rules load is exercised.
static POD_RULES: &str = "\
*mangle
:ISTIO_PRERT - [0:0]
:ISTIO_OUTPUT - [0:0]
:ISTIO_DIVERT - [0:0]
:ISTIO_TPROXY - [0:0]
-A PREROUTING -j ISTIO_PRERT
-A PREROUTING -p tcp -m socket -j ISTIO_DIVERT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_DIVERT -j MARK --set-xmark 0x539/0xffffffff
-A ISTIO_DIVERT -j ACCEPT
-A ISTIO_OUTPUT -m connmark --mark 0x111/0xfff -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff
-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff
-A ISTIO_PRERT -p tcp -m socket --transparent -j ISTIO_TPROXY
-A ISTIO_TPROXY ! -d 127.0.0.1/32 -p tcp -j TPROXY --on-port 15006 --on-ip 0.0.0.0 --tproxy-mark 0x539/0xffffffff
COMMIT
*nat
:ISTIO_PRERT - [0:0]
:ISTIO_OUTPUT - [0:0]
-A PREROUTING -j ISTIO_PRERT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -d 169.254.7.127/32 -p tcp -m tcp -j ACCEPT
-A ISTIO_OUTPUT ! -o lo -p udp -m mark ! --mark 0x539/0xfff -m udp --dport 53 -j REDIRECT --to-ports 15053
-A ISTIO_OUTPUT -p tcp -m mark --mark 0x111/0xfff -j ACCEPT
-A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -o lo -j ACCEPT
-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -p tcp -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15001
-A ISTIO_PRERT -s 169.254.7.127/32 -p tcp -m tcp -j ACCEPT
-A ISTIO_PRERT ! -d 127.0.0.1/32 -p tcp -m tcp ! --dport 15008 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15006
COMMIT
*raw
:ISTIO_PRERT - [0:0]
:ISTIO_OUTPUT - [0:0]
-A PREROUTING -j ISTIO_PRERT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -p udp -m mark --mark 0x539/0xfff -m udp --dport 53 -j CT --zone 1
-A ISTIO_PRERT -p udp -m mark ! --mark 0x539/0xfff -m udp --sport 53 -j CT --zone 1
COMMIT
";

/// Istio's default iptables mode (`global.nativeNftables=false`) in the image. The image's node agent runs as the
/// chart runs it for `profile=ambient`: the chart's env, the chart's capabilities and a read-only root without any
/// tmpfs (as a kubelet gives it: no writable /run or /tmp), in a netns of its own that stands for the node (no
/// HOST_NETNS) and with an API server that never answers. Before it needs the API it programs the host probe SNAT
/// rules (IPv4 and IPv6, an ipset match) with the image's own iptables: nft as detected, legacy as forced with
/// FORCE_IPTABLES_BINARY. Then the image's `iptables-<flavour>-restore` loads a representative in-pod rule set into
/// that netns and `iptables-<flavour>-save` shows every rule back.
#[test]
fn the_images_node_agent_programs_rules_with_the_images_iptables_nft_and_legacy() {
    let podman = Podman::new(Path::new("/usr/lib/cni"));
    let image = build_image(&podman, "iptables");
    let host = tempfile::Builder::new().prefix("image-iptables-").tempdir().expect("host tempdir");
    let dir = |name: &str| {
        let d = host.path().join(name);
        std::fs::create_dir(&d).expect("host dir");
        d
    };
    let (run_dir, ztunnel, sa, rules) = (dir("run"), dir("ztunnel"), dir("sa"), dir("rules"));
    // In-cluster config towards an API server that never answers, with a CA the client can load.
    let ca = rcgen::generate_simple_self_signed(vec!["kubernetes.default.svc".to_owned()]).expect("test CA");
    std::fs::write(sa.join("ca.crt"), ca.cert.pem()).expect("ca.crt");
    std::fs::write(sa.join("token"), "test-token").expect("token");
    std::fs::write(sa.join("namespace"), "istio-system").expect("namespace");
    std::fs::write(rules.join("pod.rules"), POD_RULES).expect("rules");

    let rendered = Rendered::new(&["profile=ambient"]);
    let mut env: Vec<(String, String)> = rendered.config_map("istio-cni-node-agent-config").into_iter().collect();
    assert!(env.contains(&("NATIVE_NFTABLES".to_owned(), "false".to_owned())), "Istio's default: {env:?}");
    // The container's own netns stands for the node's here.
    env.retain(|(k, _)| k != "HOST_NETNS");
    env.extend(
        [
            ("NODE_NAME", "node-1"),
            ("KUBERNETES_SERVICE_HOST", "127.0.0.1"),
            ("KUBERNETES_SERVICE_PORT", "1"),
            ("NO_COLOR", "1"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned())),
    );

    for (flavour, force) in [("nft", None), ("legacy", Some("iptables-legacy"))] {
        let name = format!("node-agent-{}-{flavour}", std::process::id());
        let mut args =
            confined_run(&name, &["--read-only-tmpfs=false", "--cap-add", "NET_ADMIN,NET_RAW,SYS_ADMIN,SYS_PTRACE"]);
        for (host_dir, mount) in [
            (&run_dir, "/var/run/istio-cni"),
            (&ztunnel, "/var/run/ztunnel"),
            (&sa, "/var/run/secrets/kubernetes.io/serviceaccount:ro"),
            (&rules, "/rules:ro"),
        ] {
            args.extend(["--volume".to_owned(), format!("{}:{mount}", host_dir.display())]);
        }
        for (k, v) in &env {
            args.extend(["--env".to_owned(), format!("{k}={v}")]);
        }
        if let Some(binary) = force {
            args.extend(["--env".to_owned(), format!("FORCE_IPTABLES_BINARY={binary}")]);
        }
        args.extend([image.clone(), "node-agent".to_owned()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let container = Container { podman: &podman, name: name.clone() };
        ok(container.podman(&args), "podman run node-agent");

        // The host probe rules, read with the image's own iptables-save of the flavour.
        let save = |family: &str, table: Option<&str>| {
            let binary = format!("{family}-{flavour}-save");
            let mut exec = vec!["exec", &name, &binary];
            exec.extend(table.map(|t| ["-t", t]).iter().flatten());
            let out = container.podman(&exec);
            out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
        };
        eventually_or(
            &format!("the node agent programs the host probe rules with iptables-{flavour}"),
            || {
                let v4 = save("iptables", Some("nat"))?;
                let v6 = save("ip6tables", Some("nat"))?;
                (v4.contains("-A POSTROUTING -j ISTIO_POSTRT")
                    && v4.contains("--match-set istio-inpod-probes-v4 dst -j SNAT --to-source 169.254.7.127")
                    && v6.contains("--match-set istio-inpod-probes-v6 dst -j SNAT"))
                .then_some(())
            },
            || container.logs(),
        );
        let logs = container.logs();
        assert!(logs.contains(&format!("in-pod rules backend backend=iptables-{flavour}")), "{logs}");
        assert!(!logs.contains("ERROR node_agent"), "{logs}");

        // The in-pod rule set through the image's restore (a private lock in /dev/shm, the writable dir a
        // read-only container has) and back through its save.
        let restore = format!("iptables-{flavour}-restore");
        let lock = "XTABLES_LOCKFILE=/dev/shm/xtables.lock";
        let out = container.podman(&["exec", "--env", lock, &name, &restore, "--noflush", "/rules/pod.rules"]);
        ok(out, &restore);
        let saved = save("iptables", None).unwrap_or_else(|| panic!("iptables-{flavour}-save failed"));
        let missing: Vec<&str> =
            POD_RULES.lines().filter(|l| l.starts_with("-A ") && !saved.lines().any(|s| s == *l)).collect();
        assert!(missing.is_empty(), "iptables-{flavour}-save lacks {missing:#?}\n{saved}");
        // The host probe rules are still there beside them (--noflush).
        assert!(saved.contains("istio-inpod-probes-v4"), "{saved}");
    }
    let _ = run_podman(&podman, &["rmi", "--force", &image]);
}

/// The image, built by the script users run into `podman`'s private storage, as `localhost/istio-cni-test:<pid>-<tag>`.
fn build_image(podman: &Podman, tag: &str) -> String {
    let image = format!("localhost/istio-cni-test:{}-{tag}", std::process::id());
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
    image
}

fn run_podman(podman: &Podman, args: &[&str]) -> Output {
    let mut cmd = podman.command();
    cmd.args(args);
    run(cmd, PODMAN_DEADLINE)
}
