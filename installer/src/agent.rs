//! The install itself and its upkeep: put binaries, kubeconfig and CNI config on the node, re-check them on
//! every change, repair what broke, and report readiness.

use std::path::{Path, PathBuf};
use std::time::Instant;

use daemon::probes::{Blocker, ProbeState};

use crate::binaries::{self, BinError, InstalledBinary};
use crate::cniconf::{self, Change, ConfSettings, Desired, Invalid, PluginEntry};
use crate::config::Config;
use crate::crash::{self, Step};
use crate::fight::{likely_culprit, FightDetector};
use crate::journal::{original_bytes, ConfRecord, Journal};
use crate::kubeconfig::{self, KubeconfigSettings};
use crate::metrics::{Metrics, Outcome};

/// Failures that stop the agent at startup.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Binaries could not be installed.
    #[error(transparent)]
    Binaries(#[from] BinError),
    /// The run dir could not be created.
    #[error("create run dir {path}: {source}")]
    RunDir {
        /// The run dir.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
}

/// The installer's state between reconcile passes.
pub struct Agent {
    config: Config,
    settings: ConfSettings,
    entry: PluginEntry,
    kube: KubeconfigSettings,
    binaries: Vec<InstalledBinary>,
    /// The file holding our config, once written.
    installed_conf: Option<PathBuf>,
    journal: Journal,
    metrics: Metrics,
    /// Blocks readiness while the install is missing or invalid.
    ready: Blocker,
    fight: FightDetector,
}

impl Agent {
    /// Builds the agent from its config and registers its readiness blocker (`install`) in `probes`; nothing is
    /// written yet.
    pub fn new(config: Config, metrics: Metrics, probes: &ProbeState) -> Self {
        let settings = ConfSettings {
            chained: config.chained_cni_plugin,
            conf_name: Some(config.cni_conf_name.clone()).filter(|n| !n.is_empty()),
            owned_filename: config.istio_owned_cni_config.then(|| config.istio_owned_cni_config_filename.clone()),
            ambient: config.ambient_enabled,
        };
        let entry = PluginEntry {
            plugin_log_level: config.plugin_log_level(),
            cni_agent_run_dir: config.cni_agent_run_dir.display().to_string(),
            ambient_enabled: config.ambient_enabled,
            enablement_selectors: config.ambient_enablement_selector.clone(),
            exclude_namespaces: Some(config.exclude_namespaces.clone()).filter(|n| !n.is_empty()),
            pod_namespace: config.pod_namespace.clone(),
            native_nftables: config.native_nftables,
            enable_ambient_detection_retry: config.enable_ambient_detection_retry,
        };
        let kube = config.kubeconfig_settings();
        let journal = Journal::load(&config.cni_agent_run_dir);
        let fight = FightDetector::new(config.config_fight_threshold, config.config_fight_window);
        Self {
            config,
            settings,
            entry,
            kube,
            binaries: Vec::new(),
            installed_conf: None,
            journal,
            metrics,
            ready: probes.blocker("install", "not installed yet"),
            fight,
        }
    }

    /// Directories whose changes can invalidate the install.
    pub fn watched_dirs(&self) -> Vec<PathBuf> {
        let mut dirs = vec![self.config.mounted_cni_net_dir.clone(), self.config.service_account_dir.clone()];
        dirs.extend(self.config.target_bin_dirs());
        dirs
    }

    /// The first install: binaries (fatal on failure), then what a crash of an earlier run left half done in the
    /// conf dir, then everything else through [`Agent::reconcile`].
    pub fn start(&mut self) -> Result<(), StartError> {
        let run_dir = &self.config.cni_agent_run_dir;
        std::fs::create_dir_all(run_dir).map_err(|source| StartError::RunDir { path: run_dir.clone(), source })?;
        self.install_binaries()?;
        self.recover_conf_dir();
        self.reconcile("startup");
        Ok(())
    }

    /// Removes our stale temp files from the conf dir and completes a `.conf` conversion an earlier run crashed
    /// in, so the first install sees the `.conflist` and no stale `.conf` shadows it. Failures are logged; the
    /// install then goes on with what is there.
    fn recover_conf_dir(&self) {
        let dir = &self.config.mounted_cni_net_dir;
        match crate::atomic::remove_stale_temps(dir) {
            Ok(stale) => stale.iter().for_each(|p| tracing::info!(temp = %p.display(), "removed stale temp file")),
            Err(e) => tracing::warn!(dir = %dir.display(), error = %e, "cannot remove stale temp files"),
        }
        match cniconf::complete_conversions(dir) {
            Ok(changes) => {
                for change in changes {
                    tracing::info!(change = ?change, "completed a CNI config conversion an earlier run left half done");
                }
            }
            Err(e) => tracing::error!(error = %e, "cannot complete an interrupted CNI config conversion"),
        }
    }

    fn install_binaries(&mut self) -> Result<(), BinError> {
        let result = binaries::install(&self.config.cni_bin_source_dir, &self.config.target_bin_dirs());
        if result.is_err() {
            // A success is counted once the whole install is done (the CNI config written), as in Istio.
            self.metrics.install(Outcome::CopyBinariesFailure);
        }
        self.binaries = result?;
        for bin in &self.binaries {
            self.journal.binary(&bin.path);
        }
        self.save_journal();
        Ok(())
    }

    /// Checks everything, repairs what is invalid and updates readiness. `trigger` says why, for the logs.
    pub fn reconcile(&mut self, trigger: &str) {
        if let Some(problem) = self.binaries.iter().find_map(InstalledBinary::problem) {
            tracing::warn!(%trigger, %problem, "reinstalling binaries");
            if let Err(e) = self.install_binaries() {
                tracing::error!(error = %e, "binary reinstall failed");
            }
        }
        if let Err(e) = self.ensure_kubeconfig() {
            tracing::error!(error = %e, "kubeconfig");
        }
        if let Err(problem) = self.ensure_conf(trigger) {
            self.not_ready(problem);
            return;
        }
        match self.problem() {
            None => {
                if self.ready.clear() {
                    tracing::info!("install is valid: ready");
                }
                self.metrics.ready.set(1);
            }
            Some(problem) => self.not_ready(problem),
        }
    }

    fn not_ready(&self, reason: String) {
        if self.ready.block(reason.clone()) {
            tracing::warn!(%reason, "not ready");
        }
        self.metrics.ready.set(0);
    }

    /// The first thing that makes the install invalid, if any.
    fn problem(&self) -> Option<String> {
        if let Some(p) = self.binaries.iter().find_map(InstalledBinary::problem) {
            return Some(p);
        }
        let path = self.config.kubeconfig_path();
        match kubeconfig::render(&self.kube) {
            Ok(want) if std::fs::read(&path).ok().as_deref() != Some(want.as_bytes()) => {
                return Some(format!("kubeconfig {} is missing or stale", path.display()));
            }
            Err(e) => return Some(format!("kubeconfig: {e}")),
            Ok(_) => {}
        }
        let installed = self.installed_conf.as_ref()?;
        cniconf::check(&self.config.mounted_cni_net_dir, &self.settings, &self.entry, installed)
            .err()
            .map(|e| e.to_string())
    }

    /// Writes the kubeconfig when it is missing or differs (e.g. the projected token rotated).
    fn ensure_kubeconfig(&mut self) -> Result<(), kubeconfig::KubeconfigError> {
        let want = kubeconfig::render(&self.kube).inspect_err(|e| {
            self.metrics.install(match e {
                kubeconfig::KubeconfigError::Read { .. } => Outcome::ReadServiceAccountFailure,
                _ => Outcome::CreateKubeconfigFailure,
            })
        })?;
        let path = self.config.kubeconfig_path();
        if std::fs::read(&path).ok().as_deref() == Some(want.as_bytes()) {
            return Ok(());
        }
        match crate::atomic::write_atomic(&path, want.as_bytes(), self.config.kubeconfig_mode) {
            Ok(()) => {
                tracing::info!(kubeconfig = %path.display(), "wrote kubeconfig (token not logged)");
                self.journal.kubeconfig = Some(path);
                self.save_journal();
            }
            Err(e) => {
                self.metrics.install(Outcome::CreateKubeconfigFailure);
                tracing::error!(kubeconfig = %path.display(), error = %e, "cannot write kubeconfig")
            }
        }
        Ok(())
    }

    /// Makes sure our CNI config is in effect; `Err` carries the not-ready reason.
    fn ensure_conf(&mut self, trigger: &str) -> Result<(), String> {
        let dir = self.config.mounted_cni_net_dir.clone();
        let invalid = match &self.installed_conf {
            Some(path) => match cniconf::check(&dir, &self.settings, &self.entry, path) {
                Ok(()) => return Ok(()),
                Err(e) => Some(e),
            },
            None => None,
        };
        if let Some(why) = &invalid {
            tracing::warn!(%trigger, reason = %why, "CNI config invalid, reinstalling");
            if matches!(why, Invalid::EntryMissing { .. } | Invalid::EntryChanged { .. } | Invalid::Missing { .. }) {
                self.reverted(why);
            }
        }
        let plan = match cniconf::desired(&dir, &self.settings, &self.entry) {
            Ok(Some(plan)) => {
                // As Istio: the primary we chain into keeps its own mode (another CNI's file, whose mode is that
                // CNI's call, and cleanup then leaves it as it was); a file of our own (standalone, Istio-owned)
                // gets the configured mode, 0640 with CNI_CONF_GROUP_READ, else 0600.
                let own_file = !self.settings.chained || self.settings.effective_owned().is_some();
                let mode = if own_file { self.config.conf_mode().unwrap_or(cniconf::NEW_FILE_MODE) } else { plan.mode };
                Desired { mode, ..plan }
            }
            Ok(None) => return Err(format!("waiting for a primary CNI config in {}", dir.display())),
            Err(e) => {
                self.metrics.install(Outcome::CreateCniConfigFailure);
                return Err(e.to_string());
            }
        };
        self.write_conf(&plan).inspect_err(|_| self.metrics.install(Outcome::CreateCniConfigFailure))
    }

    fn write_conf(&mut self, plan: &Desired) -> Result<(), String> {
        if let Some(from) = &plan.replaces {
            if let Err(e) = self.journal.converting(from, &plan.target) {
                return Err(format!("cannot record {} before converting it: {e}", from.display()));
            }
            crash::after(Step::ConfRecorded);
        }
        let existed = plan.target.exists();
        let change = cniconf::apply(plan).map_err(|e| e.to_string())?;
        tracing::info!(change = ?change, "CNI config installed");
        match change {
            Change::Wrote(file) if plan.primary.as_ref() == Some(&file) => {
                self.journal.conf(ConfRecord::Inserted { file })
            }
            Change::Wrote(file) if !existed => self.journal.conf(ConfRecord::Created { file }),
            _ => {}
        }
        if let Some(old) = self.installed_conf.clone().filter(|old| *old != plan.target) {
            self.leave(&old);
        }
        self.save_journal();
        self.metrics.install(Outcome::Success);
        self.installed_conf = Some(plan.target.clone());
        Ok(())
    }

    /// Our entry moved to another primary (a higher-priority file appeared, or the old one was unreadable for a
    /// moment, as a non-atomic rewrite leaves it): what we did to `old` (our entry, a conversion) is reverted now,
    /// not at cleanup, so only the file runtimes load holds our entry. (Istio instead stays with the first primary
    /// it chose.)
    fn leave(&mut self, old: &Path) {
        let was_old = |r: &ConfRecord| match r {
            ConfRecord::Inserted { file } => file == old,
            ConfRecord::Converted { to, .. } => to == old,
            ConfRecord::Created { .. } => false,
        };
        let (left, kept): (Vec<_>, Vec<_>) = self.journal.conf.drain(..).partition(was_old);
        self.journal.conf = kept;
        for record in &left {
            tracing::info!(file = %old.display(), "our entry moved to another primary; reverting this one");
            revert(record);
        }
    }

    fn reverted(&mut self, why: &Invalid) {
        if !self.fight.record(Instant::now()) {
            return;
        }
        let file = self.installed_conf.clone().unwrap_or_default();
        let contested = std::fs::read(&file).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
        self.metrics.config_fights.inc();
        tracing::warn!(
            file = %file.display(),
            culprit = likely_culprit(&contested),
            last = %why,
            threshold = self.config.config_fight_threshold,
            window_secs = self.config.config_fight_window.as_secs(),
            "config fight: another writer keeps reverting the istio-cni entry; still restoring it"
        );
    }

    fn save_journal(&self) {
        if let Err(e) = self.journal.save() {
            tracing::error!(error = %e, "cannot save install journal");
        }
    }

    /// Reverts exactly what the journal says we changed: our entry, files we created, a converted `.conf`
    /// (restored byte for byte when nobody else changed the list), the kubeconfig and our binaries.
    pub fn cleanup(&mut self) {
        self.ready.block("uninstalling");
        self.metrics.ready.set(0);
        let dir = &self.config.mounted_cni_net_dir;
        match cniconf::cleanup(dir, &self.settings) {
            Ok(changes) => changes.iter().for_each(|c| tracing::info!(change = ?c, "cleanup")),
            Err(e) => tracing::error!(error = %e, "cleanup of CNI config"),
        }
        for record in self.journal.conf.clone() {
            revert(&record);
        }
        if let Some(path) = &self.journal.kubeconfig {
            remove(path);
        }
        binaries::uninstall(&self.binaries);
        for path in &self.journal.binaries {
            remove(path);
        }
        self.journal.remove();
    }
}

fn revert(record: &ConfRecord) {
    match record {
        ConfRecord::Inserted { file } => {
            if let Err(e) = cniconf::strip_file(file) {
                tracing::error!(file = %file.display(), error = %e, "cannot remove our entry");
            }
        }
        ConfRecord::Created { file } => remove(file),
        ConfRecord::Converted { from, to, original, mode } => {
            if let Err(e) = cniconf::strip_file(to) {
                tracing::error!(file = %to.display(), error = %e, "cannot remove our entry");
                return;
            }
            restore_conversion(from, to, original, *mode);
        }
    }
}

/// Puts the original `.conf` back when the `.conflist` still holds exactly its one plugin (nobody else changed it).
fn restore_conversion(from: &Path, to: &Path, original: &str, mode: u32) {
    let Some(original) = original_bytes(original) else { return };
    let parse = |b: &[u8]| serde_json::from_slice::<serde_json::Value>(b).ok();
    let (Some(mut plugin), Some(list)) = (parse(&original), std::fs::read(to).ok().and_then(|b| parse(&b))) else {
        return;
    };
    if let Some(p) = plugin.as_object_mut() {
        p.remove("cniVersion");
    }
    if list["plugins"].as_array().map(Vec::as_slice) != Some(std::slice::from_ref(&plugin)) {
        tracing::info!(file = %to.display(), "list changed since we converted it; leaving it as a list");
        return;
    }
    match crate::atomic::write_atomic(from, &original, mode) {
        Ok(()) => {
            remove(to);
            tracing::info!(restored = %from.display(), "restored the original single-plugin config");
        }
        Err(e) => tracing::error!(file = %from.display(), error = %e, "cannot restore original config"),
    }
}

fn remove(path: &Path) {
    match std::fs::remove_file(path) {
        Ok(()) => tracing::info!(file = %path.display(), "removed"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(file = %path.display(), error = %e, "cannot remove"),
    }
}
