//! Differential conformance of `install-cni` against Istio's own `install-cni` (#29).
//!
//! Istio's binaries, built from the Go module proxy at a pinned version by `scripts/istio-ref/build.sh` (a test
//! reference only: nothing of Istio's is in our code or images), and ours run every installer integration fixture
//! of Istio (`cni/test/testdata`, copied into `installer/tests/data/integration/`; the 16 cases of
//! `../shared/istio-reference/INDEX.md` §4b: a `.conf`, a `.conflist`, invalid files to skip, a missing primary,
//! a primary written late, and standalone mode) from identical starting conf dirs, with the same settings (Istio's
//! env names, the same `--log_output_level`, the same service-account token and CA, the same API server address).
//! Istio's runs chrooted into a private root (testbed's `istio_install_cni`), ours as the DaemonSet runs it. Beyond
//! the fixtures, the chart's other install-cni settings: `AMBIENT_ENABLEMENT_SELECTOR` unset, `SKIP_TLS_VERIFY`,
//! `KUBERNETES_SERVICE_PROTOCOL=http` and `CNI_CONF_GROUP_READ` (on a `.conflist`, a converted `.conf`, standalone);
//! and a higher-priority primary written after the install (compared at a fourth point, "preempted").
//!
//! For each case, at four points (installed; after someone removed our entry, or deleted the standalone file, and
//! the installer restored it; after the kubelet rotated the service-account token and both rewrote the kubeconfig;
//! after SIGTERM and cleanup), the two must agree on:
//! - the conf dir: every file's name, mode and content (JSON up to key order, other files byte for byte), with only
//!   the plugin's `cni_agent_run_dir` normalized, since it names each installer's own run dir;
//! - the plugin's kubeconfig in the run dir: its effective fields (current context, cluster and user names,
//!   server, CA data or insecure, token or token file), parsed, not bytes; after cleanup, whether it is there;
//! - the bin dir's file names (our plugin installed beside a pre-existing one; after cleanup, removed);
//! - after cleanup, the run dir's file names (while running each keeps its own files there: see [`State::run`]);
//! - readiness, and the exit status after SIGTERM.
//!
//! What we do differently on purpose (docs/installer.md, "Where we differ from Istio, and why") is listed in
//! [`Difference`], each checked narrowly: it may explain exactly its own difference, nothing else may differ.
//!
//! Without Istio's binaries the test prints `SKIPPED: ...` and passes, unless `ISTIO_REF_REQUIRED=1`.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use istio_contract::enablement::Selectors;
use istio_contract::paths;
use serde_json::Value;
use testbed::install_cni::{InstallCni, Installer};
use testbed::istio_install_cni::{self, IstioInstallCni, IstioInstaller};
use testbed::Cluster;

/// The settings both installers get (Istio's names), besides the paths, API server address and service account.
const SETTINGS: &[(&str, &str)] = &[
    ("EXCLUDE_NAMESPACES", "istio-system"),
    ("POD_NAMESPACE", "istio-system"),
    ("KUBERNETES_NODE_NAME", "node-1"),
    ("AMBIENT_ENABLED", "false"),
    ("MONITORING_PORT", "15014"),
    ("AMBIENT_ENABLEMENT_SELECTOR", CHART_SELECTORS),
];
/// `AMBIENT_ENABLEMENT_SELECTOR` as Istio's chart sets it (its `ambient.enablementSelectors` default).
const CHART_SELECTORS: &str = r#"[{"podSelector":{"matchLabels":{"istio.io/dataplane-mode":"ambient"}}},{"podSelector":{"matchExpressions":[{"key":"istio.io/dataplane-mode","operator":"NotIn","values":["none"]}]},"namespaceSelector":{"matchLabels":{"istio.io/dataplane-mode":"ambient"}}}]"#;
/// Istio's flag form of the log level, the fixture's: debug, and the plugin's own scope at debug.
const LOG_FLAG: &str = "--log_output_level=default:debug,cni-plugin:debug";
/// A CNI plugin already on the node, which neither installer may touch.
const OTHER_PLUGIN: &str = "bridge";

/// Istio's bin dir (`install-cni`, `istio-cni`), or `None` (after printing why) when it is not built and not
/// required.
fn istio_bin_dir() -> Option<PathBuf> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/istio-ref/build.sh");
    let out = Command::new("bash").arg(&script).arg("bin-dir").output().expect("run scripts/istio-ref/build.sh");
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if dir.join("install-cni").is_file() && dir.join("istio-cni").is_file() {
        return Some(dir);
    }
    let why = format!("Istio's binaries not built; run scripts/istio-ref/build.sh ({} missing)", dir.display());
    assert!(std::env::var("ISTIO_REF_REQUIRED").as_deref() != Ok("1"), "ISTIO_REF_REQUIRED=1: {why}");
    eprintln!("SKIPPED: {why}");
    None
}

fn fixture(rel: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../installer/tests/data/integration").join(rel);
    fs::read(&path).unwrap_or_else(|e| panic!("read fixture {}: {e}", path.display()))
}

/// One row of INDEX.md §4b.
struct Case {
    what: &'static str,
    chained: bool,
    conf_name: Option<&'static str>,
    /// `pre/` files, copied in as `0<i>-<name>`.
    pre: &'static [&'static str],
    /// A `pre/` file written as the given name once both installers are seen waiting for a primary.
    delayed: Option<(&'static str, &'static str)>,
    /// The file holding (or being) the plugin's config.
    checked: &'static str,
    /// Runs without `AMBIENT_ENABLEMENT_SELECTOR` (not one of Istio's fixtures: the binaries' own defaults).
    selector_unset: bool,
    /// A `pre/` file written as the given (higher-priority) name once both have installed and restored.
    higher: Option<(&'static str, &'static str)>,
    /// Settings beyond [`SETTINGS`], for both (not in Istio's fixtures: the chart's other install-cni settings).
    env: &'static [(&'static str, &'static str)],
}

fn cases() -> Vec<Case> {
    let c = |what, conf_name, pre, checked| Case {
        what,
        chained: true,
        conf_name,
        pre,
        delayed: None,
        checked,
        selector_unset: false,
        higher: None,
        env: &[],
    };
    vec![
        c("pre-plugins .conflist", Some("00-calico.conflist"), &["calico.conflist"], "00-calico.conflist"),
        c("no pre-plugins .conf", Some("00-minikube_cni.conf"), &["minikube_cni.conf"], "00-minikube_cni.conflist"),
        c("first file conflist", None, &["calico.conflist", "minikube_cni.conf"], "00-calico.conflist"),
        c("first file conf", None, &["minikube_cni.conf", "calico.conflist"], "00-minikube_cni.conflist"),
        c(
            "skip non-JSON -> .conf",
            None,
            &["non_json.conf", "minikube_cni.conf", "calico.conflist"],
            "01-minikube_cni.conflist",
        ),
        c(
            "skip non-JSON -> .conflist",
            None,
            &["non_json.conf", "calico.conflist", "minikube_cni.conf"],
            "01-calico.conflist",
        ),
        c(
            "skip typeless .conf -> .conf",
            None,
            &["bad_minikube_cni.conf", "minikube_cni.conf", "calico.conflist"],
            "01-minikube_cni.conflist",
        ),
        c(
            "skip typeless .conf -> .conflist",
            None,
            &["bad_minikube_cni.conf", "calico.conflist", "minikube_cni.conf"],
            "01-calico.conflist",
        ),
        c(
            "skip bad lists -> .conf",
            None,
            &["noname_calico.conflist", "noplugins_calico.conflist", "minikube_cni.conf", "calico.conflist"],
            "02-minikube_cni.conflist",
        ),
        c(
            "skip bad lists -> .conflist",
            None,
            &["noname_calico.conflist", "noplugins_calico.conflist", "calico.conflist", "minikube_cni.conf"],
            "02-calico.conflist",
        ),
        c("conf name .conf, only .conflist exists", Some("00-calico.conf"), &["calico.conflist"], "00-calico.conflist"),
        c(
            "conf name .conflist, only .conf exists",
            Some("00-minikube_cni.conflist"),
            &["minikube_cni.conf"],
            "00-minikube_cni.conflist",
        ),
        Case {
            delayed: Some(("calico.conflist", "missing_initially.conf")),
            ..c("named file appears late", Some("missing_initially.conf"), &[], "missing_initially.conflist")
        },
        Case {
            delayed: Some(("calico.conflist", "calico.conflist")),
            ..c("no name, no file initially", None, &[], "calico.conflist")
        },
        Case { chained: false, ..c("standalone default", None, &[], "YYY-istio-cni.conf") },
        Case { chained: false, ..c("standalone named", Some("user-defined.conf"), &[], "user-defined.conf") },
        Case {
            selector_unset: true,
            ..c("pre-plugins .conflist, no selector set", None, &["calico.conflist"], "00-calico.conflist")
        },
        Case {
            higher: Some(("calico.conflist", "00-a-late.conflist")),
            ..c("a higher-priority primary appears", None, &["calico.conflist"], "00-calico.conflist")
        },
        Case {
            env: &[("SKIP_TLS_VERIFY", "true")],
            ..c("pre-plugins .conflist, SKIP_TLS_VERIFY", None, &["calico.conflist"], "00-calico.conflist")
        },
        Case {
            env: &[("KUBERNETES_SERVICE_PROTOCOL", "http")],
            ..c("pre-plugins .conflist, http API server", None, &["calico.conflist"], "00-calico.conflist")
        },
        Case {
            env: &[("CNI_CONF_GROUP_READ", "true")],
            ..c("pre-plugins .conflist, group read", None, &["calico.conflist"], "00-calico.conflist")
        },
        Case {
            env: &[("CNI_CONF_GROUP_READ", "true")],
            ..c("no pre-plugins .conf, group read", None, &["minikube_cni.conf"], "00-minikube_cni.conflist")
        },
        Case {
            chained: false,
            env: &[("CNI_CONF_GROUP_READ", "true")],
            ..c("standalone default, group read", None, &[], "YYY-istio-cni.conf")
        },
    ]
}

/// A file's content: JSON (compared up to key order) or anything else (byte for byte).
#[derive(Debug, Clone, PartialEq)]
enum Content {
    Json(Value),
    Other(String),
}

/// A conf dir: file name -> (mode, content).
type ConfDir = BTreeMap<String, (u32, Content)>;

/// The kubeconfig fields the plugin's client uses.
#[derive(Debug, Clone, PartialEq)]
struct Kubeconfig {
    current_context: String,
    cluster: String,
    user: String,
    server: String,
    ca_data: Option<Vec<u8>>,
    insecure: bool,
    token: Option<String>,
    token_file: Option<String>,
    mode: u32,
}

/// What one installer left at one point.
#[derive(Debug, Clone, PartialEq)]
struct State {
    conf: ConfDir,
    kubeconfig: Option<Kubeconfig>,
    bins: Vec<String>,
    /// The run dir's file names (compared after cleanup only: while running, each keeps its own files there, our
    /// install journal and Istio's plugin log socket, which in ours the node agent serves).
    run: Vec<String>,
}

/// The dirs of one side of a case.
struct Side {
    net_d: PathBuf,
    bin_dir: PathBuf,
    run_dir: PathBuf,
}

impl Side {
    fn new(root: &Path, name: &str) -> Self {
        let dir = root.join(name);
        let side = Self { net_d: dir.join("net.d"), bin_dir: dir.join("bin"), run_dir: dir.join("run") };
        for d in [&side.net_d, &side.bin_dir, &side.run_dir] {
            fs::create_dir_all(d).expect("case dir");
        }
        write_file(&side.bin_dir.join(OTHER_PLUGIN), b"", 0o755);
        side
    }

    /// The conf dir, kubeconfig and bin dir now; `run_dir` is how this side's plugin netconf names its run dir.
    fn state(&self, run_dir: &str) -> State {
        let mut conf = ConfDir::new();
        for entry in fs::read_dir(&self.net_d).expect("read conf dir") {
            let entry = entry.expect("conf dir entry");
            let bytes = fs::read(entry.path()).expect("read conf file");
            let mode = entry.metadata().expect("conf file metadata").permissions().mode() & 0o7777;
            let content = match serde_json::from_slice::<Value>(&bytes) {
                Ok(mut v) => {
                    normalize_run_dir(&mut v, run_dir);
                    Content::Json(v)
                }
                Err(_) => Content::Other(String::from_utf8_lossy(&bytes).into_owned()),
            };
            conf.insert(entry.file_name().to_string_lossy().into_owned(), (mode, content));
        }
        State {
            conf,
            kubeconfig: kubeconfig(&self.run_dir.join(paths::KUBECONFIG_FILE)),
            bins: file_names(&self.bin_dir),
            run: file_names(&self.run_dir),
        }
    }

    fn has_entry(&self, checked: &str) -> bool {
        Self::has_entry_in(&self.net_d.join(checked))
    }

    fn has_entry_in(path: &Path) -> bool {
        let Ok(bytes) = fs::read(path) else { return false };
        let Ok(v) = serde_json::from_slice::<Value>(&bytes) else { return false };
        v["type"] == "istio-cni" || v["plugins"].as_array().is_some_and(|p| p.iter().any(|p| p["type"] == "istio-cni"))
    }
}

/// The names of the files in `dir`, sorted.
fn file_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn write_file(path: &Path, bytes: &[u8], mode: u32) {
    fs::write(path, bytes).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).expect("set mode");
}

/// Replaces the plugin's `cni_agent_run_dir` (each installer's own run dir) with a placeholder.
fn normalize_run_dir(v: &mut Value, run_dir: &str) {
    match v {
        Value::Object(map) => {
            if map.get("cni_agent_run_dir").and_then(Value::as_str) == Some(run_dir) {
                map.insert("cni_agent_run_dir".into(), Value::from("<run dir>"));
            }
            map.values_mut().for_each(|v| normalize_run_dir(v, run_dir));
        }
        Value::Array(items) => items.iter_mut().for_each(|v| normalize_run_dir(v, run_dir)),
        _ => {}
    }
}

/// The effective fields of the kubeconfig at `path`, or `None` when there is none.
fn kubeconfig(path: &Path) -> Option<Kubeconfig> {
    let text = fs::read_to_string(path).ok()?;
    let mode = fs::metadata(path).ok()?.permissions().mode() & 0o7777;
    let y: serde_yaml::Value =
        serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}\n{text}", path.display()));
    let str_of = |v: &serde_yaml::Value| v.as_str().map(str::to_owned);
    let named = |list: &str, name: &str| -> serde_yaml::Value {
        y[list]
            .as_sequence()
            .into_iter()
            .flatten()
            .find(|e| e["name"].as_str() == Some(name))
            .cloned()
            .unwrap_or_else(|| panic!("{}: no {list} entry named {name:?}\n{text}", path.display()))
    };
    let current_context = str_of(&y["current-context"]).expect("current-context");
    let context = named("contexts", &current_context);
    let cluster_name = str_of(&context["context"]["cluster"]).expect("context's cluster");
    let user_name = str_of(&context["context"]["user"]).expect("context's user");
    let cluster = named("clusters", &cluster_name);
    let user = named("users", &user_name);
    use base64::Engine as _;
    let ca_data = str_of(&cluster["cluster"]["certificate-authority-data"])
        .map(|b| base64::engine::general_purpose::STANDARD.decode(b).expect("CA data is base64"));
    Some(Kubeconfig {
        current_context,
        cluster: cluster_name,
        user: user_name,
        server: str_of(&cluster["cluster"]["server"]).expect("server"),
        ca_data,
        insecure: cluster["cluster"]["insecure-skip-tls-verify"].as_bool().unwrap_or(false),
        token: str_of(&user["user"]["token"]),
        token_file: str_of(&user["user"]["tokenFile"]),
        mode,
    })
}

/// A difference we make on purpose (docs/installer.md, "Where we differ from Istio, and why"). Each one is checked
/// narrowly: [`Difference::as_istio`] turns our state into what Istio leaves, undoing only that difference, and the
/// result must then equal Istio's in every respect.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Difference {
    /// Istio leaves `X.conflist` (without its entry) after removing itself from a `.conf` it converted; we put the
    /// original `X.conf` back, byte for byte and with its mode, so uninstall leaves the node as it was.
    ConvertedConfRestored,
    /// Without `AMBIENT_ENABLEMENT_SELECTOR`, Istio's binary writes `enablement_selectors: []` (no pod would ever be
    /// ambient); ours writes the chart's default selectors, the same as when the chart sets them.
    DefaultEnablementSelectors,
    /// When a higher-priority primary appears, Istio keeps its entry in the primary it chose first, which runtimes
    /// no longer load (its pods start without the plugin); ours moves into the new primary and leaves the old one
    /// as it was.
    FollowsHigherPriorityPrimary,
}

impl Difference {
    const ALL: [Difference; 3] = [
        Difference::ConvertedConfRestored,
        Difference::DefaultEnablementSelectors,
        Difference::FollowsHigherPriorityPrimary,
    ];

    fn reason(self) -> &'static str {
        match self {
            Difference::ConvertedConfRestored => {
                "a converted .conf is restored on cleanup (Istio leaves the .conflist): uninstall leaves the node as it was"
            }
            Difference::DefaultEnablementSelectors => {
                "without AMBIENT_ENABLEMENT_SELECTOR we write the chart's default selectors (Istio's binary writes [])"
            }
            Difference::FollowsHigherPriorityPrimary => {
                "a higher-priority primary takes our entry (Istio's stays in a file runtimes no longer load)"
            }
        }
    }

    /// Our state with only this difference undone, or `None` when it does not apply at this point of `case`.
    fn as_istio(
        self,
        case: &Case,
        point: &str,
        conf_at_start: &ConfDir,
        installed: Option<&State>,
        ours: &State,
    ) -> Option<State> {
        let mut state = ours.clone();
        match self {
            Difference::ConvertedConfRestored => {
                // Ours has the fixture's `X.conf` back where Istio leaves `X.conflist`: the list both had while
                // installed, without the entry.
                let conf = case.checked.strip_suffix("list").filter(|c| c.ends_with(".conf"))?;
                if point != "after cleanup" || state.conf.contains_key(case.checked) {
                    return None;
                }
                if state.conf.remove(conf).as_ref() != conf_at_start.get(conf) {
                    return None;
                }
                let (mode, Content::Json(mut list)) = installed?.conf.get(case.checked)?.clone() else { return None };
                list["plugins"].as_array_mut()?.retain(|p| p["type"] != "istio-cni");
                state.conf.insert(case.checked.to_owned(), (mode, Content::Json(list)));
            }
            Difference::FollowsHigherPriorityPrimary => {
                // Ours has the entry in the higher-priority file; Istio's is still in the first primary.
                let (_, higher) = case.higher?;
                if point != "preempted" {
                    return None;
                }
                let (_, Content::Json(late)) = state.conf.get_mut(higher)? else { return None };
                let plugins = late["plugins"].as_array_mut()?;
                let at = plugins.iter().position(|p| p["type"] == "istio-cni")?;
                let entry = plugins.remove(at);
                let (_, Content::Json(first)) = state.conf.get_mut(case.checked)? else { return None };
                first["plugins"].as_array_mut()?.push(entry);
            }
            Difference::DefaultEnablementSelectors => {
                if !case.selector_unset {
                    return None;
                }
                for (_, content) in state.conf.values_mut() {
                    if let Content::Json(v) = content {
                        let entries = match v.get_mut("plugins").and_then(Value::as_array_mut) {
                            Some(plugins) => plugins.iter_mut().collect::<Vec<_>>(),
                            None => vec![v],
                        };
                        for entry in entries.into_iter().filter(|e| e["type"] == "istio-cni") {
                            let ours = Selectors::from_json(Some(&entry["enablement_selectors"]));
                            if ours.is_ok_and(|s| s == Selectors::default()) {
                                entry["enablement_selectors"] = Value::Array(vec![]);
                            }
                        }
                    }
                }
            }
        }
        Some(state)
    }
}

/// How the two compared at one point.
#[derive(Debug)]
enum Verdict {
    Same,
    Intended(Difference),
    Differs(String),
}

fn compare(point: &str, ours: &State, istio: &State) -> Vec<String> {
    let mut out = Vec::new();
    if ours.conf != istio.conf {
        out.push(format!("{point}: conf dir differs\n  ours:  {}\n  istio: {}", show(&ours.conf), show(&istio.conf)));
    }
    if ours.kubeconfig != istio.kubeconfig {
        out.push(format!(
            "{point}: kubeconfig differs\n  ours:  {:?}\n  istio: {:?}",
            ours.kubeconfig, istio.kubeconfig
        ));
    }
    if ours.bins != istio.bins {
        out.push(format!("{point}: bin dir differs: ours {:?}, istio {:?}", ours.bins, istio.bins));
    }
    if point == "after cleanup" && ours.run != istio.run {
        out.push(format!("{point}: run dir differs: ours {:?}, istio {:?}", ours.run, istio.run));
    }
    out
}

fn show(conf: &ConfDir) -> String {
    conf.iter()
        .map(|(name, (mode, c))| {
            let c = match c {
                Content::Json(v) => serde_json::to_string(v).unwrap(),
                Content::Other(s) => format!("{s:?}"),
            };
            format!("\n    {name} ({mode:o}): {c}")
        })
        .collect()
}

/// Both installers on one case.
struct Run {
    ours: InstallCni,
    istio: IstioInstallCni,
    our_side: Side,
    istio_side: Side,
    our_run_dir: String,
}

impl Run {
    fn states(&self) -> (State, State) {
        (self.our_side.state(&self.our_run_dir), self.istio_side.state(istio_install_cni::RUN_DIR))
    }

    #[track_caller]
    fn wait_installed(&mut self, case: &Case) {
        self.ours.until("ours installed and ready", || {
            (self.our_side.has_entry(case.checked)
                && matches!(self.ours.get(istio_contract::ports::CNI_READINESS, "/readyz"), Ok((200, _))))
            .then_some(())
        });
        let side = &self.istio_side;
        self.istio.until("Istio's installed and ready", |i| (side.has_entry(case.checked) && i.ready()).then_some(()));
    }
}

/// Runs `case` through both installers and returns the verdict at each point.
fn run_case(cluster: &Cluster, istio_bin: &Path, case: &Case) -> Vec<(&'static str, Verdict)> {
    let scratch = tempfile::Builder::new().prefix("installer-diff-").tempdir().expect("case tempdir");
    let (our_side, istio_side) = (Side::new(scratch.path(), "ours"), Side::new(scratch.path(), "istio"));
    for side in [&our_side, &istio_side] {
        for (i, name) in case.pre.iter().enumerate() {
            write_file(&side.net_d.join(format!("0{i}-{name}")), &fixture(&format!("pre/{name}")), 0o644);
        }
    }
    let conf_at_start = our_side.state("").conf;

    let mut ours = Installer::new(cluster);
    let path = |p: &Path| p.display().to_string();
    ours.env("MOUNTED_CNI_NET_DIR", &path(&our_side.net_d))
        .env("HOST_CNI_BIN_DIR", &path(&our_side.bin_dir))
        .env("CNI_AGENT_RUN_DIR", &path(&our_side.run_dir))
        .arg(LOG_FLAG);
    let mut istio =
        IstioInstaller::new(istio_bin, &istio_side.net_d, &istio_side.bin_dir, &istio_side.run_dir, ours.sa.path());
    istio
        .env("KUBERNETES_SERVICE_HOST", &cluster.api.addr().ip().to_string())
        .env("KUBERNETES_SERVICE_PORT", &cluster.api.addr().port().to_string())
        .arg(LOG_FLAG);
    let mut common: Vec<(&str, String)> = SETTINGS
        .iter()
        .filter(|(k, _)| !(case.selector_unset && *k == "AMBIENT_ENABLEMENT_SELECTOR"))
        .map(|(k, v)| (*k, v.to_string()))
        .collect();
    common.push(("CHAINED_CNI_PLUGIN", case.chained.to_string()));
    if let Some(name) = case.conf_name {
        common.push(("CNI_CONF_NAME", name.into()));
    }
    common.extend(case.env.iter().map(|(k, v)| (*k, v.to_string())));
    for (k, v) in &common {
        ours.env(k, v);
        istio.env(k, v);
    }

    let mut run =
        Run { ours: ours.start(), istio: istio.start(), our_run_dir: path(&our_side.run_dir), our_side, istio_side };
    let mut verdicts = Vec::new();

    if let Some((src, name)) = case.delayed {
        run.ours.until("ours waits for a primary", || {
            matches!(run.ours.get(istio_contract::ports::CNI_READINESS, "/readyz"), Ok((503, b)) if b.contains("waiting for a primary"))
                .then_some(())
        });
        run.istio.until("Istio's waits for a primary", |i| i.log().contains("Waiting for").then_some(()));
        let (o, i) = run.states();
        verdicts.push(("waiting", judge(case, "waiting", &conf_at_start, None, &o, &i, vec![])));
        assert!(o.conf.is_empty() && i.conf.is_empty(), "{}: something written before the primary", case.what);
        for side in [&run.our_side, &run.istio_side] {
            write_file(&side.net_d.join(name), &fixture(&format!("pre/{src}")), 0o644);
        }
    }

    run.wait_installed(case);
    let (o, i) = run.states();
    verdicts.push(("installed", judge(case, "installed", &conf_at_start, None, &o, &i, vec![])));
    let our_installed = o;

    // Someone removes our entry (or the standalone file): both restore it.
    for side in [&run.our_side, &run.istio_side] {
        let file = side.net_d.join(case.checked);
        if case.chained {
            let mut v: Value = serde_json::from_slice(&fs::read(&file).unwrap()).unwrap();
            v["plugins"].as_array_mut().unwrap().retain(|p| p["type"] != "istio-cni");
            // Atomically, as a well-behaved writer: a reader never sees a half-written file.
            let tmp = side.net_d.join(".rewrite.tmp");
            fs::write(&tmp, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
            fs::rename(&tmp, &file).unwrap();
        } else {
            fs::remove_file(&file).unwrap();
        }
    }
    run.wait_installed(case);
    let (o, i) = run.states();
    verdicts.push(("restored", judge(case, "restored", &conf_at_start, Some(&our_installed), &o, &i, vec![])));

    // The kubelet rotates the projected token: both rewrite the kubeconfig with the new one.
    let token = cluster.token(testbed::chart::CNI_SERVICE_ACCOUNT);
    assert_ne!(Some(&token), our_installed.kubeconfig.as_ref().and_then(|k| k.token.as_ref()), "a fresh token");
    ours.sa.rotate(&token);
    let has_token = |side: &Side| {
        kubeconfig(&side.run_dir.join(paths::KUBECONFIG_FILE)).and_then(|k| k.token).as_deref() == Some(token.as_str())
    };
    run.ours.until("ours writes the rotated token", || has_token(&run.our_side).then_some(()));
    let istio_side = &run.istio_side;
    run.istio.until("Istio's writes the rotated token", |_| has_token(istio_side).then_some(()));
    let (o, i) = run.states();
    verdicts.push(("rotated", judge(case, "rotated", &conf_at_start, Some(&our_installed), &o, &i, vec![])));

    if let Some((src, name)) = case.higher {
        for side in [&run.our_side, &run.istio_side] {
            let tmp = side.net_d.join(".late.tmp");
            write_file(&tmp, &fixture(&format!("pre/{src}")), 0o644);
            fs::rename(&tmp, side.net_d.join(name)).unwrap();
        }
        let higher = run.our_side.net_d.join(name);
        run.ours.until("ours moves into the higher-priority primary", || {
            (Side::has_entry_in(&higher)
                && matches!(run.ours.get(istio_contract::ports::CNI_READINESS, "/readyz"), Ok((200, _))))
            .then_some(())
        });
        run.istio.until("Istio's sees the higher-priority primary", |i| i.log().contains("preempted by").then_some(()));
        let (o, i) = run.states();
        verdicts.push(("preempted", judge(case, "preempted", &conf_at_start, Some(&our_installed), &o, &i, vec![])));
    }

    let our_exit = run.ours.terminate();
    let istio_exit = run.istio.terminate();
    let (o, i) = run.states();
    let mut exits = Vec::new();
    if our_exit.code() != istio_exit.code() {
        exits.push(format!("exit after SIGTERM: ours {our_exit}, istio {istio_exit}"));
    }
    let cleanup = judge(case, "after cleanup", &conf_at_start, Some(&our_installed), &o, &i, exits);
    verdicts.push(("after cleanup", cleanup));
    if verdicts.iter().any(|(_, v)| matches!(v, Verdict::Differs(_))) {
        eprintln!("--- ours log:\n{}\n--- istio log:\n{}", run.ours.log(), run.istio.log());
    }
    verdicts
}

/// The verdict at one point: the same, one intended [`Difference`] that explains everything that differs, or the
/// differences (`extra`: ones no intended difference may explain).
fn judge(
    case: &Case,
    point: &str,
    conf_at_start: &ConfDir,
    installed: Option<&State>,
    ours: &State,
    istio: &State,
    extra: Vec<String>,
) -> Verdict {
    let diffs = compare(point, ours, istio);
    if diffs.is_empty() && extra.is_empty() {
        return Verdict::Same;
    }
    if extra.is_empty() {
        let explained = Difference::ALL.into_iter().find(|d| {
            d.as_istio(case, point, conf_at_start, installed, ours)
                .is_some_and(|as_istio| compare(point, &as_istio, istio).is_empty())
        });
        if let Some(d) = explained {
            return Verdict::Intended(d);
        }
    }
    Verdict::Differs(diffs.into_iter().chain(extra).collect::<Vec<_>>().join("\n"))
}

/// Every installer integration fixture of Istio, run through Istio's `install-cni` and ours: the same conf dir,
/// kubeconfig and bin dir at every point, except the differences we make on purpose.
#[test]
fn install_cni_agrees_with_istios_on_every_integration_fixture() {
    let Some(istio_bin) = istio_bin_dir() else { return };
    let cluster = Cluster::new();
    let mut failures = Vec::new();
    for case in cases() {
        let verdicts = run_case(&cluster, &istio_bin, &case);
        for (point, v) in verdicts {
            match v {
                Verdict::Same => eprintln!("{:<40} {point:<14} same", case.what),
                Verdict::Intended(d) => eprintln!("{:<40} {point:<14} different on purpose: {}", case.what, d.reason()),
                Verdict::Differs(why) => {
                    eprintln!("{:<40} {point:<14} DIFFERENT\n{why}", case.what);
                    failures.push(format!("{} / {point}:\n{why}", case.what));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} unexpected differences:\n{}", failures.len(), failures.join("\n\n"));
}

/// Sanity check of the comparison: it tells apart what it must.
#[test]
fn the_comparison_sees_a_different_entry() {
    let mut a: Value = serde_json::json!({"plugins": [{"type": "istio-cni", "cni_agent_run_dir": "/a"}]});
    let mut b: Value = serde_json::json!({"plugins": [{"type": "istio-cni", "cni_agent_run_dir": "/b"}]});
    normalize_run_dir(&mut a, "/a");
    normalize_run_dir(&mut b, "/b");
    assert_eq!(a, b);
    let mut c: Value = serde_json::json!({"plugins": [{"type": "istio-cni", "cni_agent_run_dir": "/other"}]});
    normalize_run_dir(&mut c, "/b");
    assert_ne!(a, c);
}
