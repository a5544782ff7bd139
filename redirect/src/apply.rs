//! Programs a [`Plan`] into a pod's network namespace with iptables-restore, and with rtnetlink the IPv6
//! passthrough source address and TPROXY routing.

use std::net::IpAddr;
use std::process::{Command, ExitStatus, Stdio};

use netns::{Netns, NetnsError};
use rtnetlink::packet_route::address::{AddressAttribute, AddressFlags, AddressHeaderFlags};
use rtnetlink::Handle;

use crate::iptables::render;
use crate::model::{Family, Table};
use crate::routing::{self, FwmarkRule, LOOPBACK_IFINDEX};
use crate::sidecar::{Plan, TproxyRoutes, PASSTHROUGH_SRC_V6};
use crate::xtables::{self, RestoreMode, XtablesLock};

/// Which iptables flavour programs the rules; it must match what the node's kube-proxy uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IptablesBackend {
    /// x_tables via `iptables-legacy-*`.
    Legacy,
    /// nf_tables via `iptables-nft-*`.
    Nft,
}

impl IptablesBackend {
    pub(crate) fn binary(self, family: Family, tool: &str) -> String {
        let prefix = match family {
            Family::V4 => "iptables",
            Family::V6 => "ip6tables",
        };
        let flavour = match self {
            IptablesBackend::Legacy => "legacy",
            IptablesBackend::Nft => "nft",
        };
        match tool {
            "" => format!("{prefix}-{flavour}"),
            tool => format!("{prefix}-{flavour}-{tool}"),
        }
    }
}

/// Failures of backend detection and of programming a netns.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// An iptables binary ran and failed; carries what the plugin needs to report.
    #[error("{binary} ({family}) failed with {status}: {stderr}")]
    Command {
        /// Binary that failed (e.g. `iptables-nft-restore`).
        binary: String,
        /// Address family it was programming.
        family: Family,
        /// Exit status.
        status: ExitStatus,
        /// Its standard error, trimmed.
        stderr: String,
    },
    /// An iptables binary could not be started or fed.
    #[error("run {binary}: {source}")]
    Spawn {
        /// Binary that could not be run.
        binary: String,
        /// Underlying I/O error.
        source: std::io::Error,
    },
    /// Entering the pod's netns failed.
    #[error(transparent)]
    Netns(#[from] NetnsError),
    /// A netlink request (TPROXY policy routing) failed.
    #[error("{what} ({family}): {source}")]
    Netlink {
        /// The operation, e.g. `ip rule add fwmark 1337 lookup 133`.
        what: String,
        /// Address family.
        family: Family,
        /// Error from rtnetlink.
        source: rtnetlink::Error,
    },
    /// Local setup (lock directory, netlink socket, runtime) failed.
    #[error("{what}: {source}")]
    Setup {
        /// What was being set up.
        what: String,
        /// Underlying I/O error.
        source: std::io::Error,
    },
    /// `FORCE_IPTABLES_BINARY` names something we do not know.
    #[error("unsupported FORCE_IPTABLES_BINARY value {0:?} (want iptables, iptables-legacy or iptables-nft)")]
    UnknownForcedBinary(String),
}

/// Tables our payloads may touch; `remove` flushes exactly these.
const OWNED_TABLES: [Table; 3] = [Table::Mangle, Table::Nat, Table::Raw];
/// Chains kube components create in the host netns; their presence tells which backend the node uses.
const KUBE_HINT_CHAINS: [&str; 2] = [":KUBE-IPTABLES-HINT", ":KUBE-KUBELET-CANARY"];

/// Chooses the backend as Istio does: `force` (FORCE_IPTABLES_BINARY) wins; otherwise whichever flavour holds
/// kube's hint chains in the caller's (host) netns; otherwise nft if installed, else legacy.
///
/// Runs at most two `*-save` commands (nft first, as it is the common case).
pub fn detect_backend(force: Option<&str>) -> Result<IptablesBackend, ApplyError> {
    match force.map(str::trim).filter(|f| !f.is_empty()) {
        Some("iptables-legacy") => return Ok(IptablesBackend::Legacy),
        Some("iptables-nft") => return Ok(IptablesBackend::Nft),
        Some("iptables") => return plain_iptables_flavour(),
        Some(other) => return Err(ApplyError::UnknownForcedBinary(other.to_string())),
        None => {}
    }
    for backend in [IptablesBackend::Nft, IptablesBackend::Legacy] {
        let binary = backend.binary(Family::V4, "save");
        let out = Command::new(&binary).args(["-t", "mangle"]).stdin(Stdio::null()).output();
        if let Ok(out) = out {
            let text = String::from_utf8_lossy(&out.stdout);
            if text.lines().any(|l| KUBE_HINT_CHAINS.iter().any(|h| l.starts_with(h))) {
                return Ok(backend);
            }
        }
    }
    if in_path(&IptablesBackend::Nft.binary(Family::V4, "restore")) {
        Ok(IptablesBackend::Nft)
    } else {
        Ok(IptablesBackend::Legacy)
    }
}

/// What the distribution's plain `iptables` is (`iptables v1.8.9 (nf_tables)` vs `(legacy)`).
fn plain_iptables_flavour() -> Result<IptablesBackend, ApplyError> {
    let out = Command::new("iptables")
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .map_err(|source| ApplyError::Spawn { binary: "iptables".into(), source })?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(if text.contains("nf_tables") { IptablesBackend::Nft } else { IptablesBackend::Legacy })
}

fn in_path(binary: &str) -> bool {
    std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|dir| dir.join(binary).is_file()))
        .unwrap_or(false)
}

/// Programs `plan` inside `netns`: one iptables-restore per family (replacing the tables it names wholesale,
/// so re-applying is idempotent), then, if the plan has IPv6 rules, the passthrough source `::6/128` on `lo`,
/// and TPROXY policy routing if the plan needs it. Re-applying is idempotent throughout.
pub fn apply(netns: &Netns, plan: &Plan, backend: IptablesBackend) -> Result<(), ApplyError> {
    let lock = XtablesLock::new()?;
    netns.run(|| {
        let families = std::iter::once(&plan.v4).chain(plan.v6.as_ref());
        for rs in families {
            xtables::restore(backend, rs.family, &render(rs), RestoreMode::Replace, &lock.file())?;
        }
        program_netlink(plan)
    })?
}

/// Removes our rules from `netns` by replacing the tables we own (mangle, nat, raw) with empty ones, in both
/// families.
pub fn remove(netns: &Netns, backend: IptablesBackend) -> Result<(), ApplyError> {
    let payload: String = OWNED_TABLES.iter().map(|t| format!("* {}\nCOMMIT\n", t.name())).collect();
    let lock = XtablesLock::new()?;
    netns.run(|| {
        for family in [Family::V4, Family::V6] {
            xtables::restore(backend, family, &payload, RestoreMode::Replace, &lock.file())?;
        }
        Ok(())
    })?
}

/// Returns `iptables-save` output for `family` inside `netns` (for tests and diagnostics).
pub fn dump(netns: &Netns, backend: IptablesBackend, family: Family) -> Result<String, ApplyError> {
    netns.run(|| xtables::save(backend, family, None, None))?
}

/// The rtnetlink part of [`apply`], on one current-thread runtime on the calling (netns) thread: the IPv6
/// passthrough address when the plan has IPv6 rules, TPROXY routing when it has routes. No runtime if neither.
pub(crate) fn program_netlink(plan: &Plan) -> Result<(), ApplyError> {
    if plan.v6.is_none() && plan.tproxy_routes.is_none() {
        return Ok(());
    }
    routing::with_handle(|handle| async move {
        if plan.v6.is_some() {
            add_passthrough_v6(&handle).await?;
        }
        if let Some(routes) = plan.tproxy_routes {
            let families: &[Family] = if plan.v6.is_some() { &[Family::V4, Family::V6] } else { &[Family::V4] };
            add_tproxy_routes(&handle, routes, families).await?;
        }
        Ok(())
    })
}

/// `ip -6 addr add ::6/128 dev lo nodad`: Envoy binds inbound passthrough connections to `::6`, which is not
/// local until added (unlike 127.0.0.6). nodad makes it usable at once; an existing address is fine. No scope is
/// requested: the kernel derives an IPv6 address's scope from the address itself (global for `::6`).
async fn add_passthrough_v6(handle: &Handle) -> Result<(), ApplyError> {
    let mut req = handle.address().add(LOOPBACK_IFINDEX, IpAddr::V6(PASSTHROUGH_SRC_V6), 128);
    let msg = req.message_mut();
    msg.header.flags = AddressHeaderFlags::Nodad;
    msg.attributes.push(AddressAttribute::Flags(AddressFlags::Nodad));
    routing::tolerate_exists(req.execute().await).map_err(|source| ApplyError::Netlink {
        what: format!("ip -6 addr add {PASSTHROUGH_SRC_V6}/128 dev lo nodad"),
        family: Family::V6,
        source,
    })
}

/// `ip rule add fwmark <mark> lookup <table>` and `ip route add local default dev lo table <table>` for each
/// family. Existing entries are fine (idempotent).
async fn add_tproxy_routes(handle: &Handle, routes: TproxyRoutes, families: &[Family]) -> Result<(), ApplyError> {
    let rule = FwmarkRule { mark: routes.mark, mask: None, priority: None, table: routes.table };
    for &family in families {
        let err = |what: String| move |source| ApplyError::Netlink { what, family, source };
        let rule_text = format!("ip rule add fwmark {} lookup {}", routes.mark, routes.table);
        routing::ensure_rule(handle, family, rule).await.map_err(err(rule_text))?;
        let route_text = format!("ip route add local default dev lo table {}", routes.table);
        routing::ensure_local_default(handle, family, routes.table).await.map_err(err(route_text))?;
    }
    Ok(())
}
