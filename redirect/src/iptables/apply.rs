//! Programs a sidecar [`Plan`] into a pod's network namespace: one `iptables-restore` per family that replaces the
//! tables it names, then the plan's policy routing (IPv6 passthrough source, TPROXY) over rtnetlink.

use netns::Netns;

use super::error::IptablesError;
use super::flavour::IptablesBackend;
use super::render::render;
use super::restore::{restore, save, RestoreMode, XtablesLock};
use crate::model::{Family, Table};
use crate::routing;
use crate::sidecar::Plan;

/// Tables our payloads may touch; `remove` flushes exactly these.
pub(crate) const OWNED_TABLES: [Table; 3] = [Table::Mangle, Table::Nat, Table::Raw];

/// Programs `plan` inside `netns`: one iptables-restore per family (replacing the tables it names wholesale,
/// so re-applying is idempotent), then, if the plan has IPv6 rules, the passthrough source `::6/128` on `lo`,
/// and TPROXY policy routing if the plan needs it. Re-applying is idempotent throughout.
pub fn apply(netns: &Netns, plan: &Plan, backend: IptablesBackend) -> Result<(), IptablesError> {
    // Rendered before anything runs: a refused name leaves the pod's tables untouched in both families.
    let payloads = std::iter::once(&plan.v4).chain(plan.v6.as_ref()).map(|rs| Ok((rs.family, render(rs)?)));
    let payloads: Vec<(Family, String)> = payloads.collect::<Result<_, IptablesError>>()?;
    let lock = XtablesLock::new()?;
    netns.run(|| {
        for (family, payload) in &payloads {
            restore(backend, *family, payload, RestoreMode::Replace, &lock.file())?;
        }
        Ok(routing::program_sidecar(plan)?)
    })?
}

/// Removes our rules from `netns` by replacing the tables we own (mangle, nat, raw) with empty ones, in both
/// families.
pub fn remove(netns: &Netns, backend: IptablesBackend) -> Result<(), IptablesError> {
    let payload: String = OWNED_TABLES.iter().map(|t| format!("* {}\nCOMMIT\n", t.name())).collect();
    let lock = XtablesLock::new()?;
    netns.run(|| {
        for family in [Family::V4, Family::V6] {
            restore(backend, family, &payload, RestoreMode::Replace, &lock.file())?;
        }
        Ok(())
    })?
}

/// Returns `iptables-save` output for `family` inside `netns` (for tests and diagnostics).
pub fn dump(netns: &Netns, backend: IptablesBackend, family: Family) -> Result<String, IptablesError> {
    netns.run(|| save(backend, family, None, None))?
}
