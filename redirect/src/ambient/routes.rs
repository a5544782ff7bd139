//! The connmark policy routing of an ambient pod over rtnetlink: `ip rule add fwmark 0x111/0xfff pref 32764
//! lookup 100` and `ip route add local default dev lo table 100`, per family; idempotent, and removable.

use std::net::{Ipv4Addr, Ipv6Addr};

use futures::TryStreamExt as _;
use rtnetlink::packet_route::route::RouteMessage;
use rtnetlink::packet_route::rule::{RuleAction, RuleAttribute, RuleMessage};
use rtnetlink::{Handle, IpVersion, RouteMessageBuilder};

use super::ConnmarkRoutes;
use crate::apply::{local_default, tolerate_exists, ApplyError};
use crate::model::Family;

/// Adds (`add: true`) or deletes the routing of `routes` for `families` in the calling thread's netns.
/// Adding what exists and deleting what is missing are both fine.
pub(crate) fn program(routes: ConnmarkRoutes, families: &[Family], add: bool) -> Result<(), ApplyError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(|source| ApplyError::Setup { what: "build netlink runtime".into(), source })?;
    rt.block_on(async {
        let (conn, handle, _) = rtnetlink::new_connection()
            .map_err(|source| ApplyError::Setup { what: "open rtnetlink socket".into(), source })?;
        let conn = tokio::spawn(conn);
        let mut result = Ok(());
        for &family in families {
            result =
                if add { add_family(&handle, routes, family).await } else { del_family(&handle, routes, family).await };
            if result.is_err() {
                break;
            }
        }
        conn.abort();
        result
    })
}

fn rule_text(r: ConnmarkRoutes) -> String {
    format!("ip rule fwmark {:#x}/{:#x} pref {} lookup {}", r.mark, r.mask, r.priority, r.table)
}

fn route_text(r: ConnmarkRoutes) -> String {
    format!("ip route local default dev lo table {}", r.table)
}

async fn add_family(handle: &Handle, routes: ConnmarkRoutes, family: Family) -> Result<(), ApplyError> {
    let err = |what: String| move |source| ApplyError::Netlink { what: format!("add {what}"), family, source };
    if ours(handle, routes, family).await.map_err(err(rule_text(routes)))?.is_empty() {
        let rule = handle
            .rule()
            .add()
            .fw_mark(routes.mark)
            .table_id(routes.table)
            .priority(routes.priority)
            .action(RuleAction::ToTable);
        let mask = RuleAttribute::FwMask(routes.mask);
        let res = match family {
            Family::V4 => {
                let mut rule = rule.v4();
                rule.message_mut().attributes.push(mask);
                rule.execute().await
            }
            Family::V6 => {
                let mut rule = rule.v6();
                rule.message_mut().attributes.push(mask);
                rule.execute().await
            }
        };
        tolerate_exists(res).map_err(err(rule_text(routes)))?;
    }
    let res = handle.route().add(default_local(routes, family)).execute().await;
    tolerate_exists(res).map_err(err(route_text(routes)))
}

async fn del_family(handle: &Handle, routes: ConnmarkRoutes, family: Family) -> Result<(), ApplyError> {
    let err = |what: String| move |source| ApplyError::Netlink { what: format!("delete {what}"), family, source };
    for rule in ours(handle, routes, family).await.map_err(err(rule_text(routes)))? {
        tolerate_missing(handle.rule().del(rule).execute().await).map_err(err(rule_text(routes)))?;
    }
    let res = handle.route().del(default_local(routes, family)).execute().await;
    tolerate_missing(res).map_err(err(route_text(routes)))
}

fn default_local(routes: ConnmarkRoutes, family: Family) -> RouteMessage {
    match family {
        Family::V4 => local_default(
            RouteMessageBuilder::<Ipv4Addr>::new().destination_prefix(Ipv4Addr::UNSPECIFIED, 0),
            routes.table,
        ),
        Family::V6 => local_default(
            RouteMessageBuilder::<Ipv6Addr>::new().destination_prefix(Ipv6Addr::UNSPECIFIED, 0),
            routes.table,
        ),
    }
}

/// Our `fwmark MARK/MASK lookup TABLE` rules of `family`.
async fn ours(handle: &Handle, routes: ConnmarkRoutes, family: Family) -> Result<Vec<RuleMessage>, rtnetlink::Error> {
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
            table == routes.table
                && r.attributes.contains(&RuleAttribute::FwMark(routes.mark))
                && r.attributes.contains(&RuleAttribute::FwMask(routes.mask))
        })
        .collect())
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
