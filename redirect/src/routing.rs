//! Policy routing over rtnetlink, done by both backends after the rules: a sidecar plan's IPv6 passthrough source
//! and TPROXY routing (`program_sidecar`), and an ambient pod's connmark routing (`program_fwmark`). All of it
//! is idempotent `ip rule fwmark … lookup …` / `ip route add local default dev lo table …` / `ip addr add`, on an
//! rtnetlink handle of the calling thread's netns. [`read_fwmark`] reads the connmark routing back for drift
//! checks.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use futures::TryStreamExt as _;
use rtnetlink::packet_route::address::{AddressAttribute, AddressFlags, AddressHeaderFlags};
use rtnetlink::packet_route::route::{RouteAttribute, RouteMessage, RouteProtocol, RouteScope, RouteType};
use rtnetlink::packet_route::rule::{RuleAction, RuleAttribute, RuleMessage};
use rtnetlink::{Handle, IpVersion, RouteMessageBuilder};

use crate::model::Family;
use crate::sidecar::{Plan, TproxyRoutes, PASSTHROUGH_SRC_V6};

/// Failures of the policy-routing step; both backends wrap it.
#[derive(Debug, thiserror::Error)]
pub enum RoutingError {
    /// A netlink request failed.
    #[error("{what} ({family}): {source}")]
    Netlink {
        /// The operation, e.g. `ip rule add fwmark 1337 lookup 133`.
        what: String,
        /// Address family.
        family: Family,
        /// Error from rtnetlink.
        source: rtnetlink::Error,
    },
    /// The netlink socket or its runtime could not be set up.
    #[error("{what}: {source}")]
    Setup {
        /// What was being set up.
        what: String,
        /// Underlying I/O error.
        source: std::io::Error,
    },
    /// The kernel did not answer the routing requests in time ([`netns::netlink::RECV_TIMEOUT`]).
    #[error("no rtnetlink answer within {after:?}")]
    Timeout {
        /// How long the requests waited.
        after: std::time::Duration,
    },
}

/// The loopback device always has this ifindex in every netns (LOOPBACK_IFINDEX in the kernel).
const LOOPBACK_IFINDEX: u32 = 1;

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
/// this thread's netns. `f` gets [`netns::netlink::RECV_TIMEOUT`] for all its requests, as every netlink socket of
/// ours does: a kernel that never answers is an error, not a thread blocked forever.
fn with_handle<T, F, Fut>(f: F) -> Result<T, RoutingError>
where
    F: FnOnce(Handle) -> Fut,
    Fut: Future<Output = Result<T, RoutingError>>,
{
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(|source| RoutingError::Setup { what: "build netlink runtime".into(), source })?;
    rt.block_on(async {
        let (conn, handle, _) = rtnetlink::new_connection()
            .map_err(|source| RoutingError::Setup { what: "open rtnetlink socket".into(), source })?;
        let conn = tokio::spawn(conn);
        let after = netns::netlink::RECV_TIMEOUT;
        let result = tokio::time::timeout(after, f(handle)).await.unwrap_or(Err(RoutingError::Timeout { after }));
        conn.abort();
        result
    })
}

/// Adds `rule` for `family` unless such a rule exists. Looked up first because without an explicit priority the
/// kernel picks a new one each time, so EEXIST never fires.
async fn ensure_rule(handle: &Handle, family: Family, rule: FwmarkRule) -> Result<(), rtnetlink::Error> {
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
async fn find_rules(handle: &Handle, family: Family, rule: FwmarkRule) -> Result<Vec<RuleMessage>, rtnetlink::Error> {
    let version = match family {
        Family::V4 => IpVersion::V4,
        Family::V6 => IpVersion::V6,
    };
    // Filtered as the dump streams in: only the matching rules are held, however many the netns has.
    let matches = |r: &RuleMessage| {
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
    };
    handle.rule().get(version).execute().try_filter(|r| std::future::ready(matches(r))).try_collect().await
}

/// `ip route add local default dev lo table <table>` for `family`; an existing route is fine.
async fn ensure_local_default(handle: &Handle, family: Family, table: u32) -> Result<(), rtnetlink::Error> {
    tolerate_exists(handle.route().add(local_default(family, table)).execute().await)
}

/// The `local default dev lo table <table>` route of `family`, with the protocol `ip route add` gives it
/// (`boot`), as Istio's plugin and agent leave it (netlink's builder would say `static`).
fn local_default(family: Family, table: u32) -> RouteMessage {
    fn finish<T>(builder: RouteMessageBuilder<T>, table: u32) -> RouteMessage {
        let mut route = builder
            .output_interface(LOOPBACK_IFINDEX)
            .table_id(table)
            .kind(RouteType::Local)
            .scope(RouteScope::Host)
            .build();
        route.header.protocol = RouteProtocol::Boot;
        route
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
fn tolerate_exists(res: Result<(), rtnetlink::Error>) -> Result<(), rtnetlink::Error> {
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

/// The routing of a sidecar `plan` in the calling (netns) thread, on one current-thread runtime: the IPv6
/// passthrough address when the plan has IPv6 rules, TPROXY routing when it has routes. No runtime if neither.
pub(crate) fn program_sidecar(plan: &Plan) -> Result<(), RoutingError> {
    if plan.v6.is_none() && plan.tproxy_routes.is_none() {
        return Ok(());
    }
    with_handle(|handle| async move {
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
async fn add_passthrough_v6(handle: &Handle) -> Result<(), RoutingError> {
    let mut req = handle.address().add(LOOPBACK_IFINDEX, IpAddr::V6(PASSTHROUGH_SRC_V6), 128);
    let msg = req.message_mut();
    msg.header.flags = AddressHeaderFlags::Nodad;
    msg.attributes.push(AddressAttribute::Flags(AddressFlags::Nodad));
    tolerate_exists(req.execute().await).map_err(|source| RoutingError::Netlink {
        what: format!("ip -6 addr add {PASSTHROUGH_SRC_V6}/128 dev lo nodad"),
        family: Family::V6,
        source,
    })
}

/// `ip rule add fwmark <mark> lookup <table>` and `ip route add local default dev lo table <table>` for each
/// family. Existing entries are fine (idempotent).
async fn add_tproxy_routes(handle: &Handle, routes: TproxyRoutes, families: &[Family]) -> Result<(), RoutingError> {
    let rule = FwmarkRule { mark: routes.mark, mask: None, priority: None, table: routes.table };
    for &family in families {
        let err = |what: String| move |source| RoutingError::Netlink { what, family, source };
        let rule_text = format!("ip rule add fwmark {} lookup {}", routes.mark, routes.table);
        ensure_rule(handle, family, rule).await.map_err(err(rule_text))?;
        let route_text = format!("ip route add local default dev lo table {}", routes.table);
        tolerate_exists(handle.route().add(local_default(family, routes.table)).execute().await)
            .map_err(err(route_text))?;
    }
    Ok(())
}

/// Adds (`add: true`) or deletes `ip rule fwmark MARK/MASK pref PRIORITY lookup TABLE` and `ip route local default
/// dev lo table TABLE` for `families` in the calling thread's netns (an ambient pod's connmark routing). Adding
/// what exists and deleting what is missing are both fine.
///
/// IPv6 is left out where the netns's loopback has it off ([`usable_families`]): its routes cannot be added there.
pub(crate) fn program_fwmark(rule: FwmarkRule, families: &[Family], add: bool) -> Result<(), RoutingError> {
    with_handle(|handle| async move {
        for family in usable_families(&handle, families).await {
            if add {
                add_fwmark(&handle, rule, family).await?;
            } else {
                del_fwmark(&handle, rule, family).await?;
            }
        }
        Ok(())
    })
}

/// `fwmark MARK[/MASK] [pref PRIORITY] lookup TABLE`: a rule as `ip rule` shows it (errors, drift reports).
pub(crate) fn rule_spec(r: FwmarkRule) -> String {
    let mask = r.mask.map(|m| format!("/{m:#x}")).unwrap_or_default();
    let pref = r.priority.map(|p| format!(" pref {p}")).unwrap_or_default();
    format!("fwmark {:#x}{mask}{pref} lookup {}", r.mark, r.table)
}

/// `local default dev lo table TABLE`: the table's route as `ip route` shows it (errors, drift reports).
pub(crate) fn route_spec(table: u32) -> String {
    format!("local default dev lo table {table}")
}

fn rule_text(r: FwmarkRule) -> String {
    format!("ip rule {}", rule_spec(r))
}

fn route_text(r: FwmarkRule) -> String {
    format!("ip route {}", route_spec(r.table))
}

async fn add_fwmark(handle: &Handle, rule: FwmarkRule, family: Family) -> Result<(), RoutingError> {
    let err = |what: String| move |source| RoutingError::Netlink { what: format!("add {what}"), family, source };
    ensure_rule(handle, family, rule).await.map_err(err(rule_text(rule)))?;
    ensure_local_default(handle, family, rule.table).await.map_err(err(route_text(rule)))
}

async fn del_fwmark(handle: &Handle, rule: FwmarkRule, family: Family) -> Result<(), RoutingError> {
    let err = |what: String| move |source| RoutingError::Netlink { what: format!("delete {what}"), family, source };
    for found in find_rules(handle, family, rule).await.map_err(err(rule_text(rule)))? {
        tolerate_missing(handle.rule().del(found).execute().await).map_err(err(rule_text(rule)))?;
    }
    // Any protocol: also the route an agent that said `static` left.
    let mut route = local_default(family, rule.table);
    route.header.protocol = RouteProtocol::Unspec;
    let res = handle.route().del(route).execute().await;
    tolerate_missing(res).map_err(err(route_text(rule)))
}

/// `families` less IPv6 when the handle's netns cannot route it on its loopback: IPv6 turned off there (the
/// loopback's `disable_ipv6` is 1, as on nodes that run IPv4 only) or absent from the kernel (no IPv6 settings on the
/// link). Istio's agent skips its IPv6 loopback route in the same case; adding it would fail (EACCES) and refuse the
/// pod. Read over rtnetlink (the loopback's IPv6 device settings, `IFLA_AF_SPEC`), not from
/// `/proc/sys/net/ipv6/conf/lo/disable_ipv6`: opening a `/proc/sys/net` file costs time in proportion to the
/// namespaces on the node, and this runs in every pod's enrollment.
async fn usable_families(handle: &Handle, families: &[Family]) -> Vec<Family> {
    let ipv6 = !families.contains(&Family::V6) || loopback_routes_ipv6(handle).await;
    families.iter().copied().filter(|&f| f == Family::V4 || ipv6).collect()
}

/// Whether the loopback of the handle's netns has IPv6 on (a failed read counts as off).
async fn loopback_routes_ipv6(handle: &Handle) -> bool {
    use rtnetlink::packet_route::link::{AfSpecInet6, AfSpecUnspec, LinkAttribute};
    let mut links = handle.link().get().match_index(LOOPBACK_IFINDEX).execute();
    let Ok(Some(lo)) = links.try_next().await else { return false };
    lo.attributes.iter().any(|attribute| match attribute {
        LinkAttribute::AfSpecUnspec(specs) => specs.iter().any(|spec| match spec {
            AfSpecUnspec::Inet6(inet6) => {
                inet6.iter().any(|i| matches!(i, AfSpecInet6::DevConf(c) if c.disable_ipv6 == 0))
            }
            _ => false,
        }),
        _ => false,
    })
}

/// An ambient pod's connmark routing in one family, as the netns holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FoundFwmark {
    /// The family read.
    pub family: Family,
    /// The `ip rule`s with the plan's mark and table, with the mask and priority they have.
    pub rules: Vec<FwmarkRule>,
    /// Whether the plan's table holds `local default dev lo`.
    pub local_default: bool,
    /// Other routes in the plan's table.
    pub other_routes: usize,
}

/// Reads, per family (of `families`, less IPv6 where the loopback has it off: [`usable_families`]), the rules with
/// `rule`'s mark and table (whatever their mask and priority) and the routes of its table, in the calling thread's
/// netns. Changes nothing.
pub(crate) fn read_fwmark(rule: FwmarkRule, families: &[Family]) -> Result<Vec<FoundFwmark>, RoutingError> {
    with_handle(|handle| async move {
        let mut found = Vec::new();
        for family in usable_families(&handle, families).await {
            let err = |what: &str| {
                let what = format!("read {what}");
                move |source| RoutingError::Netlink { what, family, source }
            };
            let any_mask = FwmarkRule { mask: None, priority: None, ..rule };
            let rules = find_rules(&handle, family, any_mask)
                .await
                .map_err(err(&rule_text(any_mask)))?
                .iter()
                .map(|r| {
                    let (mut mask, mut priority) = (None, None);
                    for attribute in &r.attributes {
                        match attribute {
                            RuleAttribute::FwMask(m) => mask = Some(*m),
                            RuleAttribute::Priority(p) => priority = Some(*p),
                            _ => {}
                        }
                    }
                    FwmarkRule { mask, priority, ..rule }
                })
                .collect();
            let (local_default, other_routes) =
                table_routes(&handle, family, rule.table).await.map_err(err(&route_text(rule)))?;
            found.push(FoundFwmark { family, rules, local_default, other_routes });
        }
        Ok(found)
    })
}

/// Whether `table` in `family` holds the local default route, and how many other routes it holds. Counted as the
/// dump streams in (without strict checking the kernel dumps every table), so nothing of it is held.
async fn table_routes(handle: &Handle, family: Family, table: u32) -> Result<(bool, usize), rtnetlink::Error> {
    let request = match family {
        Family::V4 => RouteMessageBuilder::<Ipv4Addr>::new().table_id(table).build(),
        Family::V6 => RouteMessageBuilder::<Ipv6Addr>::new().table_id(table).build(),
    };
    let in_table = |r: &RouteMessage| {
        let id = r.attributes.iter().find_map(|a| match a {
            RouteAttribute::Table(t) => Some(*t),
            _ => None,
        });
        id.unwrap_or(u32::from(r.header.table)) == table
    };
    let count = |(local_default, others): (bool, usize), r: RouteMessage| {
        let counted = match (in_table(&r), is_local_default(&r)) {
            (false, _) => (local_default, others),
            (true, true) => (true, others),
            (true, false) => (local_default, others + 1),
        };
        std::future::ready(Ok(counted))
    };
    handle.route().get(request).execute().try_fold((false, 0), count).await
}

/// `local default dev lo`, as [`local_default`] adds it.
fn is_local_default(route: &RouteMessage) -> bool {
    route.header.kind == RouteType::Local
        && route.header.destination_prefix_length == 0
        && route.attributes.contains(&RouteAttribute::Oif(LOOPBACK_IFINDEX))
}

/// Treats the kernel's "no such entry" as success (deleting is idempotent).
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
