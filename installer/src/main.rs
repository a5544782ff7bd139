//! `install-cni`: installs the istio-cni plugin on this node and keeps it installed until SIGTERM.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use daemon::lifecycle::Context;
use installer::agent::Agent;
use installer::config::Config;
use installer::metrics::Metrics;
use installer::safe_upgrade::{self, Verdict};
use notify::{RecursiveMode, Watcher as _};

/// Re-check even without events, in case the kernel dropped some (inotify queue overflow).
const RESYNC: Duration = Duration::from_secs(30);

fn main() -> ExitCode {
    daemon::lifecycle::main(run)
}

async fn run(config: Config, ctx: Context) -> anyhow::Result<()> {
    // Only the servers hold watchers; keeping this one would make every shutdown wait out the drain deadline.
    drop(ctx.drain);
    let metrics = ctx.probes.with_registry(Metrics::register);

    let (tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let _ = tx.send(event);
    })
    .context("create file watcher")?;
    let mut agent = Agent::new(config.clone(), metrics, &ctx.probes);
    for dir in agent.watched_dirs() {
        if let Err(e) = std::fs::create_dir_all(&dir) {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot create watched dir");
        }
        watcher.watch(&dir, RecursiveMode::NonRecursive).with_context(|| format!("watch {}", dir.display()))?;
    }
    // The signal handlers are in (the shared main installs them first), so a SIGTERM during the possibly slow first
    // install still gets a cleanup. From here on, the agent's own blocker tells readiness.
    agent.start()?;
    ctx.startup.clear();

    let mut resync = tokio::time::interval(RESYNC);
    resync.reset();
    let mut signal = ctx.shutdown;
    loop {
        tokio::select! {
            sig = &mut signal => {
                tracing::info!(signal = ?sig, "shutting down");
                break;
            }
            Some(event) = events.recv() => {
                let mut why = relevant(&event).then(|| describe(&event));
                while let Ok(more) = events.try_recv() {
                    if relevant(&more) {
                        why = Some(describe(&more));
                    }
                }
                if let Some(why) = why {
                    agent.reconcile(&why);
                }
            }
            _ = resync.tick() => agent.reconcile("periodic resync"),
        }
    }
    drop(watcher);
    if keep_installed(&config).await {
        tracing::info!("safe upgrade: our DaemonSet still targets this node, leaving the plugin installed");
    } else {
        agent.cleanup();
    }
    Ok(())
}

/// Opening, reading or closing a file unwritten changes nothing. Reacting to those would let every reconcile
/// (which opens the conf dir, the configs and the token) wake the next one: a busy loop.
fn relevant(event: &notify::Result<notify::Event>) -> bool {
    use notify::event::{AccessKind, AccessMode, EventKind};
    match event {
        Ok(e) => !matches!(e.kind, EventKind::Access(kind) if kind != AccessKind::Close(AccessMode::Write)),
        Err(_) => true,
    }
}

fn describe(event: &notify::Result<notify::Event>) -> String {
    match event {
        Ok(e) => format!("{:?} {:?}", e.kind, e.paths),
        Err(e) => format!("watch error: {e}"),
    }
}

/// Safe upgrade applies with ambient on and not disabled; API errors keep the install (fail closed: pods wait
/// for the next agent rather than start outside the mesh).
async fn keep_installed(config: &Config) -> bool {
    if !config.ambient_enabled || config.ambient_disable_safe_upgrade {
        return false;
    }
    let verdict = match safe_upgrade::client(&config.kubeconfig_settings()).await {
        Ok(client) => {
            safe_upgrade::verdict(client, &config.pod_namespace, &config.node_name).await.map_err(|e| e.to_string())
        }
        Err(e) => Err(e.to_string()),
    };
    match verdict {
        Ok(Verdict::KeepInstalled) => true,
        Ok(Verdict::CleanUp(reason)) => {
            tracing::info!(%reason, "uninstalling");
            false
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot tell upgrade from uninstall; keeping the plugin installed");
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use notify::event::{AccessKind, AccessMode, CreateKind, EventKind, ModifyKind};

    #[test]
    fn our_own_reads_do_not_wake_the_loop() {
        let event = |kind| Ok(notify::Event::new(kind));
        assert!(!relevant(&event(EventKind::Access(AccessKind::Open(AccessMode::Any)))));
        assert!(!relevant(&event(EventKind::Access(AccessKind::Close(AccessMode::Read)))));
        assert!(relevant(&event(EventKind::Access(AccessKind::Close(AccessMode::Write)))));
        assert!(relevant(&event(EventKind::Create(CreateKind::File))));
        assert!(relevant(&event(EventKind::Modify(ModifyKind::Any))));
        assert!(relevant(&Err(notify::Error::generic("queue overflow"))));
    }
}
