//! Native nftables backend: programs a [`Plan`] as Istio's nftables layout over NETLINK_NETFILTER, in one
//! atomic transaction per pod netns, with no `nft` or `iptables` binary involved.
//!
//! [`layout`] translates the typed rules into tables, chains and rule statements; the private modules encode
//! them as nf_tables netlink messages (`attr`, `expr`, `msg`) and commit them (`socket`).

pub(crate) mod attr;
mod error;
mod expr;
pub mod layout;
mod list;
mod merge;
mod msg;
pub(crate) mod netlink_dump;
pub mod set;
pub(crate) mod socket;
pub mod stmt;

use netns::Netns;

pub use error::NftError;
use layout::{owned_tables, NftLayout, SIDECAR_PREFIX};
pub use list::TableId;

use crate::sidecar::Plan;

/// First sequence number of a batch; each batch uses its own socket, so numbers never collide.
const FIRST_SEQ: u32 = 1;

/// Programs `plan` inside `netns`: one transaction deletes any `istio-proxy-*` tables (stale, partial or
/// current) and creates the plan's tables, so re-applying is idempotent and there is never a moment without
/// rules; then, as the iptables backend does, adds `::6` to `lo` for IPv6 plans and TPROXY policy routing.
///
/// On a kernel error nothing of the transaction is applied and the previous tables stay as they were.
pub fn apply(netns: &Netns, plan: &Plan) -> Result<(), NftError> {
    let layout = NftLayout::sidecar(plan)?;
    let batch = msg::replace(FIRST_SEQ, &owned_tables(SIDECAR_PREFIX), &layout)?;
    netns.run(|| -> Result<(), NftError> {
        socket::commit(&batch)?;
        crate::apply::program_netlink(plan)?;
        Ok(())
    })?
}

/// Deletes exactly our sidecar tables (`istio-proxy-nat`, `-mangle`, `-raw`, `-filter`) from `netns`, whether or
/// not they exist, in one transaction. Other tables are untouched.
pub fn remove(netns: &Netns) -> Result<(), NftError> {
    let empty = NftLayout { tables: Vec::new() };
    let batch = msg::replace(FIRST_SEQ, &owned_tables(SIDECAR_PREFIX), &empty)?;
    netns.run(|| socket::commit(&batch))?
}

/// Replaces every table named `<prefix>-<table>` in `netns` with the tables of `layout`, in one transaction
/// (an empty layout removes them). Tables of other names are untouched.
pub fn replace_tables(netns: &Netns, prefix: &str, layout: &NftLayout) -> Result<(), NftError> {
    let batch = msg::replace(FIRST_SEQ, &owned_tables(prefix), layout)?;
    netns.run(|| socket::commit(&batch))?
}

/// Lists every nftables table in `netns` (any family, also iptables-nft's `ip nat` etc.), read over netlink:
/// lets callers check what is programmed and whether another backend holds rules too.
pub fn tables(netns: &Netns) -> Result<Vec<TableId>, NftError> {
    netns.run(list::tables)?
}
