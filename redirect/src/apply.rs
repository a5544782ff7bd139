//! Programs a [`Plan`] into a pod's network namespace with iptables-restore, and with rtnetlink the IPv6
//! passthrough source address and TPROXY routing.

use std::io::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};

use futures::TryStreamExt as _;
use netns::{Netns, NetnsError};
use rtnetlink::packet_route::address::{AddressAttribute, AddressFlags, AddressHeaderFlags};
use rtnetlink::packet_route::route::{RouteScope, RouteType};
use rtnetlink::packet_route::rule::{RuleAction, RuleAttribute, RuleMessage};
use rtnetlink::{Handle, IpVersion, RouteMessageBuilder};

use crate::iptables::render;
use crate::model::{Family, Table};
use crate::sidecar::{Plan, TproxyRoutes, PASSTHROUGH_SRC_V6};

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
/// The loopback device always has this ifindex in every netns (LOOPBACK_IFINDEX in the kernel).
pub(crate) const LOOPBACK_IFINDEX: u32 = 1;

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
    let lock = private_lock_dir()?;
    let lockfile = lock.path().join("xtables.lock");
    netns.run(|| {
        let families = std::iter::once(&plan.v4).chain(plan.v6.as_ref());
        for rs in families {
            restore(backend, rs.family, &render(rs), &lockfile)?;
        }
        program_netlink(plan)
    })?
}

/// Removes our rules from `netns` by replacing the tables we own (mangle, nat, raw) with empty ones, in both
/// families.
pub fn remove(netns: &Netns, backend: IptablesBackend) -> Result<(), ApplyError> {
    let payload: String = OWNED_TABLES.iter().map(|t| format!("* {}\nCOMMIT\n", t.name())).collect();
    let lock = private_lock_dir()?;
    let lockfile = lock.path().join("xtables.lock");
    netns.run(|| {
        for family in [Family::V4, Family::V6] {
            restore(backend, family, &payload, &lockfile)?;
        }
        Ok(())
    })?
}

/// Returns `iptables-save` output for `family` inside `netns` (for tests and diagnostics).
pub fn dump(netns: &Netns, backend: IptablesBackend, family: Family) -> Result<String, ApplyError> {
    let binary = backend.binary(family, "save");
    netns.run(|| {
        let out = Command::new(&binary)
            .stdin(Stdio::null())
            .output()
            .map_err(|source| ApplyError::Spawn { binary: binary.clone(), source })?;
        if !out.status.success() {
            return Err(command_error(&binary, family, out.status, &out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    })?
}

/// A lock directory of our own, so iptables-legacy never waits on the host's /run/xtables.lock (kube-proxy).
pub(crate) fn private_lock_dir() -> Result<tempfile::TempDir, ApplyError> {
    let base: PathBuf =
        ["/run", "/tmp"].iter().map(PathBuf::from).find(|p| p.is_dir()).unwrap_or_else(std::env::temp_dir);
    tempfile::Builder::new()
        .prefix("istio-cni-xtables-")
        .tempdir_in(&base)
        .map_err(|source| ApplyError::Setup { what: format!("create lock dir in {}", base.display()), source })
}

pub(crate) fn command_error(binary: &str, family: Family, status: ExitStatus, stderr: &[u8]) -> ApplyError {
    ApplyError::Command {
        binary: binary.to_string(),
        family,
        status,
        stderr: String::from_utf8_lossy(stderr).trim().to_string(),
    }
}

/// Feeds `payload` to `<family>-<backend>-restore --wait` on stdin (no --noflush: named tables are replaced).
fn restore(backend: IptablesBackend, family: Family, payload: &str, lockfile: &Path) -> Result<(), ApplyError> {
    let binary = backend.binary(family, "restore");
    tracing::debug!(%binary, %family, payload, "running iptables-restore");
    let spawn_err = |source| ApplyError::Spawn { binary: binary.clone(), source };
    let mut child = Command::new(&binary)
        .arg("--wait")
        .env("XTABLES_LOCKFILE", lockfile)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(spawn_err)?;
    let written = child.stdin.take().map(|mut stdin| stdin.write_all(payload.as_bytes()));
    let out = child.wait_with_output().map_err(spawn_err)?;
    if !out.status.success() {
        return Err(command_error(&binary, family, out.status, &out.stderr));
    }
    if let Some(Err(source)) = written {
        return Err(spawn_err(source));
    }
    Ok(())
}

/// The rtnetlink part of [`apply`], on one current-thread runtime on the calling (netns) thread: the IPv6
/// passthrough address when the plan has IPv6 rules, TPROXY routing when it has routes. No runtime if neither.
pub(crate) fn program_netlink(plan: &Plan) -> Result<(), ApplyError> {
    if plan.v6.is_none() && plan.tproxy_routes.is_none() {
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(|source| ApplyError::Setup { what: "build netlink runtime".into(), source })?;
    rt.block_on(async {
        let (conn, handle, _) = rtnetlink::new_connection()
            .map_err(|source| ApplyError::Setup { what: "open rtnetlink socket".into(), source })?;
        let conn = tokio::spawn(conn);
        let result = async {
            if plan.v6.is_some() {
                add_passthrough_v6(&handle).await?;
            }
            if let Some(routes) = plan.tproxy_routes {
                let families: &[Family] = if plan.v6.is_some() { &[Family::V4, Family::V6] } else { &[Family::V4] };
                add_tproxy_routes(&handle, routes, families).await?;
            }
            Ok(())
        }
        .await;
        conn.abort();
        result
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
    tolerate_exists(req.execute().await).map_err(|source| ApplyError::Netlink {
        what: format!("ip -6 addr add {PASSTHROUGH_SRC_V6}/128 dev lo nodad"),
        family: Family::V6,
        source,
    })
}

/// `ip rule add fwmark <mark> lookup <table>` and `ip route add local default dev lo table <table>` for each
/// family. Existing entries are fine (idempotent).
async fn add_tproxy_routes(handle: &Handle, routes: TproxyRoutes, families: &[Family]) -> Result<(), ApplyError> {
    for &family in families {
        let what = format!("ip rule add fwmark {} lookup {}", routes.mark, routes.table);
        let netlink_err = |what: String| move |source| ApplyError::Netlink { what, family, source };
        // Without an explicit priority the kernel picks a new one each time, so EEXIST never fires:
        // look for our rule first.
        if !has_fwmark_rule(handle, family, routes).await.map_err(netlink_err(what.clone()))? {
            let rule = handle.rule().add().fw_mark(routes.mark).table_id(routes.table).action(RuleAction::ToTable);
            let res = match family {
                Family::V4 => rule.v4().execute().await,
                Family::V6 => rule.v6().execute().await,
            };
            tolerate_exists(res).map_err(netlink_err(what))?;
        }

        let what = format!("ip route add local default dev lo table {}", routes.table);
        let msg = match family {
            Family::V4 => local_default(
                RouteMessageBuilder::<Ipv4Addr>::new().destination_prefix(Ipv4Addr::UNSPECIFIED, 0),
                routes.table,
            ),
            Family::V6 => local_default(
                RouteMessageBuilder::<Ipv6Addr>::new().destination_prefix(Ipv6Addr::UNSPECIFIED, 0),
                routes.table,
            ),
        };
        let res = handle.route().add(msg).execute().await;
        tolerate_exists(res).map_err(|source| ApplyError::Netlink { what, family, source })?;
    }
    Ok(())
}

/// Whether a `fwmark <mark> lookup <table>` rule already exists for `family`.
async fn has_fwmark_rule(handle: &Handle, family: Family, routes: TproxyRoutes) -> Result<bool, rtnetlink::Error> {
    let version = match family {
        Family::V4 => IpVersion::V4,
        Family::V6 => IpVersion::V6,
    };
    let rules: Vec<RuleMessage> = handle.rule().get(version).execute().try_collect().await?;
    Ok(rules.iter().any(|r| {
        let table = r
            .attributes
            .iter()
            .find_map(|a| match a {
                RuleAttribute::Table(t) => Some(*t),
                _ => None,
            })
            .unwrap_or(u32::from(r.header.table));
        table == routes.table && r.attributes.contains(&RuleAttribute::FwMark(routes.mark))
    }))
}

pub(crate) fn local_default<T>(
    builder: RouteMessageBuilder<T>,
    table: u32,
) -> rtnetlink::packet_route::route::RouteMessage {
    builder.output_interface(LOOPBACK_IFINDEX).table_id(table).kind(RouteType::Local).scope(RouteScope::Host).build()
}

pub(crate) fn tolerate_exists(res: Result<(), rtnetlink::Error>) -> Result<(), rtnetlink::Error> {
    match res {
        Err(rtnetlink::Error::NetlinkError(msg))
            if msg.code.is_some_and(|c| {
                std::io::Error::from_raw_os_error(-c.get()).kind() == std::io::ErrorKind::AlreadyExists
            }) =>
        {
            Ok(())
        }
        other => other,
    }
}
