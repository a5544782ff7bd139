//! The connmark policy routing of an ambient pod over rtnetlink: `ip rule add fwmark 0x111/0xfff pref 32764
//! lookup 100` and `ip route add local default dev lo table 100`, per family; idempotent, and removable.

use rtnetlink::Handle;

use super::ConnmarkRoutes;
use crate::apply::ApplyError;
use crate::model::Family;
use crate::routing::{self, FwmarkRule};

/// Adds (`add: true`) or deletes the routing of `routes` for `families` in the calling thread's netns.
/// Adding what exists and deleting what is missing are both fine.
pub(crate) fn program(routes: ConnmarkRoutes, families: &[Family], add: bool) -> Result<(), ApplyError> {
    routing::with_handle(|handle| async move {
        for &family in families {
            if add {
                add_family(&handle, routes, family).await?;
            } else {
                del_family(&handle, routes, family).await?;
            }
        }
        Ok(())
    })
}

fn rule(r: ConnmarkRoutes) -> FwmarkRule {
    FwmarkRule { mark: r.mark, mask: Some(r.mask), priority: Some(r.priority), table: r.table }
}

fn rule_text(r: ConnmarkRoutes) -> String {
    format!("ip rule fwmark {:#x}/{:#x} pref {} lookup {}", r.mark, r.mask, r.priority, r.table)
}

fn route_text(r: ConnmarkRoutes) -> String {
    format!("ip route local default dev lo table {}", r.table)
}

async fn add_family(handle: &Handle, routes: ConnmarkRoutes, family: Family) -> Result<(), ApplyError> {
    let err = |what: String| move |source| ApplyError::Netlink { what: format!("add {what}"), family, source };
    routing::ensure_rule(handle, family, rule(routes)).await.map_err(err(rule_text(routes)))?;
    routing::ensure_local_default(handle, family, routes.table).await.map_err(err(route_text(routes)))
}

async fn del_family(handle: &Handle, routes: ConnmarkRoutes, family: Family) -> Result<(), ApplyError> {
    let err = |what: String| move |source| ApplyError::Netlink { what: format!("delete {what}"), family, source };
    for found in routing::find_rules(handle, family, rule(routes)).await.map_err(err(rule_text(routes)))? {
        tolerate_missing(handle.rule().del(found).execute().await).map_err(err(rule_text(routes)))?;
    }
    let res = handle.route().del(routing::local_default(family, routes.table)).execute().await;
    tolerate_missing(res).map_err(err(route_text(routes)))
}

fn tolerate_missing(res: Result<(), rtnetlink::Error>) -> Result<(), rtnetlink::Error> {
    match res {
        Err(rtnetlink::Error::NetlinkError(msg))
            if msg.code.is_some_and(|c| matches!(-c.get(), libc::ENOENT | libc::ESRCH)) =>
        {
            Ok(())
        }
        other => other,
    }
}
