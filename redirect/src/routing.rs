//! Policy routing over rtnetlink, shared by the sidecar TPROXY step and the ambient connmark step: an rtnetlink
//! handle of the calling thread's netns, and idempotent `ip rule fwmark … lookup …` / `ip route add local default
//! dev lo table …`.

use std::future::Future;
use std::net::{Ipv4Addr, Ipv6Addr};

use futures::TryStreamExt as _;
use rtnetlink::packet_route::route::{RouteMessage, RouteScope, RouteType};
use rtnetlink::packet_route::rule::{RuleAction, RuleAttribute, RuleMessage};
use rtnetlink::{Handle, IpVersion, RouteMessageBuilder};

use crate::apply::ApplyError;
use crate::model::Family;

/// The loopback device always has this ifindex in every netns (LOOPBACK_IFINDEX in the kernel).
pub(crate) const LOOPBACK_IFINDEX: u32 = 1;

/// An `ip rule fwmark MARK[/MASK] [pref PRIORITY] lookup TABLE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FwmarkRule {
    /// Firewall mark.
    pub mark: u32,
    /// Mask of the mark; `None` adds none and matches rules whatever their mask.
    pub mask: Option<u32>,
    /// Rule priority; `None` lets the kernel pick one.
    pub priority: Option<u32>,
    /// Routing table looked up.
    pub table: u32,
}

/// Runs `f` with an rtnetlink handle on a current-thread runtime on the calling thread, so the socket lives in
/// this thread's netns.
pub(crate) fn with_handle<T, F, Fut>(f: F) -> Result<T, ApplyError>
where
    F: FnOnce(Handle) -> Fut,
    Fut: Future<Output = Result<T, ApplyError>>,
{
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(|source| ApplyError::Setup { what: "build netlink runtime".into(), source })?;
    rt.block_on(async {
        let (conn, handle, _) = rtnetlink::new_connection()
            .map_err(|source| ApplyError::Setup { what: "open rtnetlink socket".into(), source })?;
        let conn = tokio::spawn(conn);
        let result = f(handle).await;
        conn.abort();
        result
    })
}

/// Adds `rule` for `family` unless such a rule exists. Looked up first because without an explicit priority the
/// kernel picks a new one each time, so EEXIST never fires.
pub(crate) async fn ensure_rule(handle: &Handle, family: Family, rule: FwmarkRule) -> Result<(), rtnetlink::Error> {
    if !find_rules(handle, family, rule).await?.is_empty() {
        return Ok(());
    }
    let mut req = handle.rule().add().fw_mark(rule.mark).table_id(rule.table).action(RuleAction::ToTable);
    if let Some(priority) = rule.priority {
        req = req.priority(priority);
    }
    if let Some(mask) = rule.mask {
        req.message_mut().attributes.push(RuleAttribute::FwMask(mask));
    }
    let res = match family {
        Family::V4 => req.v4().execute().await,
        Family::V6 => req.v6().execute().await,
    };
    tolerate_exists(res)
}

/// The rules of `family` that match `rule` (its mark and table, and its mask if it has one).
pub(crate) async fn find_rules(
    handle: &Handle,
    family: Family,
    rule: FwmarkRule,
) -> Result<Vec<RuleMessage>, rtnetlink::Error> {
    let version = match family {
        Family::V4 => IpVersion::V4,
        Family::V6 => IpVersion::V6,
    };
    let rules: Vec<RuleMessage> = handle.rule().get(version).execute().try_collect().await?;
    Ok(rules
        .into_iter()
        .filter(|r| {
            let table = r
                .attributes
                .iter()
                .find_map(|a| match a {
                    RuleAttribute::Table(t) => Some(*t),
                    _ => None,
                })
                .unwrap_or(u32::from(r.header.table));
            table == rule.table
                && r.attributes.contains(&RuleAttribute::FwMark(rule.mark))
                && rule.mask.is_none_or(|mask| r.attributes.contains(&RuleAttribute::FwMask(mask)))
        })
        .collect())
}

/// `ip route add local default dev lo table <table>` for `family`; an existing route is fine.
pub(crate) async fn ensure_local_default(handle: &Handle, family: Family, table: u32) -> Result<(), rtnetlink::Error> {
    tolerate_exists(handle.route().add(local_default(family, table)).execute().await)
}

/// The `local default dev lo table <table>` route of `family`.
pub(crate) fn local_default(family: Family, table: u32) -> RouteMessage {
    fn finish<T>(builder: RouteMessageBuilder<T>, table: u32) -> RouteMessage {
        builder
            .output_interface(LOOPBACK_IFINDEX)
            .table_id(table)
            .kind(RouteType::Local)
            .scope(RouteScope::Host)
            .build()
    }
    match family {
        Family::V4 => {
            finish(RouteMessageBuilder::<Ipv4Addr>::new().destination_prefix(Ipv4Addr::UNSPECIFIED, 0), table)
        }
        Family::V6 => {
            finish(RouteMessageBuilder::<Ipv6Addr>::new().destination_prefix(Ipv6Addr::UNSPECIFIED, 0), table)
        }
    }
}

/// Treats the kernel's "already exists" as success (adding is idempotent).
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
