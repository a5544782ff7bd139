//! Native nftables backend: programs a [`Plan`] as Istio's nftables layout over NETLINK_NETFILTER, in one
//! atomic transaction per pod netns, with no `nft` or `iptables` binary involved.
//!
//! [`layout`] translates the typed rules into tables, chains and rule statements; the private modules encode
//! them as nf_tables netlink messages (`attr`, `expr`, `msg`) and commit them (`socket`); the kernel's numbers
//! they use are spelled once, in `uapi`.

pub(crate) mod attr;
mod error;
mod expr;
pub mod layout;
mod list;
mod merge;
mod msg;
pub(crate) mod netlink_dump;
pub mod rules;
pub mod set;
pub(crate) mod socket;
pub mod stmt;
pub mod tag;
pub(crate) mod uapi;

use std::os::fd::AsFd;

use netns::Netns;

pub use error::NftError;
use layout::{owned_tables, NftLayout, SIDECAR_PREFIX};
pub use list::TableId;

use crate::sidecar::Plan;
use uapi::netfilter::NFPROTO_INET;

/// First sequence number of a batch on a fresh socket.
const FIRST_SEQ: u32 = 1;
/// First sequence number of the fallback batch sent after a failed fast path on the same socket.
const FALLBACK_SEQ: u32 = 1 << 16;

/// Programs `plan` inside `netns`: one transaction deletes any `istio-proxy-*` tables (stale, partial or
/// current) and creates the plan's tables, so re-applying is idempotent and there is never a moment without
/// rules; then, as the iptables backend does, adds `::6` to `lo` for IPv6 plans and TPROXY policy routing.
///
/// On a kernel error nothing of the transaction is applied and the previous tables stay as they were.
///
/// Cost: in a netns that holds none of our tables (a new pod, the common case) the transaction only adds. The
/// kernel frees deleted objects of a transaction after an RCU grace period, and closing a netfilter socket waits
/// for that pending work (several ms); a deletion-free batch leaves none, so a pod's programming costs about
/// one netlink round trip. Re-programming an existing pod takes the replace path and pays the wait.
pub fn apply(netns: &Netns, plan: &Plan) -> Result<(), NftError> {
    let layout = NftLayout::sidecar(plan)?;
    netns.run(|| -> Result<(), NftError> {
        replace_here(SIDECAR_PREFIX, &layout)?;
        crate::routing::program_sidecar(plan)?;
        Ok(())
    })?
}

/// Replaces the `<prefix>-*` tables of the calling thread's netns with `layout`, over one socket: if none exists,
/// one create-only batch (its EEXIST, from a table created meanwhile, falls back); otherwise, or on that
/// fallback, one batch that drops all of them and creates the layout.
fn replace_here(prefix: &str, layout: &NftLayout) -> Result<(), NftError> {
    let fd = socket::open()?;
    let owned = owned_tables(prefix);
    let ours = list::tables_on(fd.as_fd())?.into_iter().any(|t| t.family == NFPROTO_INET && owned.contains(&t.name));
    if !ours {
        if layout.tables.is_empty() {
            return Ok(());
        }
        match socket::commit_on(fd.as_fd(), &msg::create(FIRST_SEQ, layout)?) {
            Err(err) if err.is_already_exists() => {}
            done => return done,
        }
    }
    socket::commit_on(fd.as_fd(), &msg::replace(FALLBACK_SEQ, &owned, layout)?)
}

/// Deletes exactly our sidecar tables (`istio-proxy-nat`, `-mangle`, `-raw`, `-filter`) from `netns`, whether or
/// not they exist, in one transaction. Other tables are untouched.
pub fn remove(netns: &Netns) -> Result<(), NftError> {
    netns.run(|| replace_here(SIDECAR_PREFIX, &NftLayout { tables: Vec::new() }))?
}

/// Replaces every table named `<prefix>-<table>` in `netns` with the tables of `layout`, in one transaction
/// (an empty layout removes them). Tables of other names are untouched.
pub fn replace_tables(netns: &Netns, prefix: &str, layout: &NftLayout) -> Result<(), NftError> {
    netns.run(|| replace_here(prefix, layout))?
}

/// Lists every nftables table of the calling thread's netns (for a caller already running inside a pod's netns).
pub(crate) fn tables_here() -> Result<Vec<TableId>, NftError> {
    list::tables()
}

/// Lists every nftables table in `netns` (any family, also iptables-nft's `ip nat` etc.), read over netlink:
/// lets callers check what is programmed and whether another backend holds rules too.
pub fn tables(netns: &Netns) -> Result<Vec<TableId>, NftError> {
    netns.run(list::tables)?
}
