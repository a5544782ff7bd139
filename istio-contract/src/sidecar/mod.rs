//! Istio's sidecar decision: whether a pod gets redirect rules, and which ones (istio-iptables' settings), from
//! its annotations and its `istio-proxy` container. The plugin decides at ADD, the node agent when it repairs a
//! pod that started before the plugin was chained; both call this, so they cannot disagree.

use std::net::IpAddr;

use ipnet::{IpNet, Ipv4Net};

use crate::names::{
    EXCLUDE_INBOUND_PORTS, EXCLUDE_INTERFACES, EXCLUDE_OUTBOUND_IP_RANGES, EXCLUDE_OUTBOUND_PORTS,
    INCLUDE_INBOUND_PORTS, INCLUDE_OUTBOUND_IP_RANGES, INCLUDE_OUTBOUND_PORTS, INIT_CONTAINER, INTERCEPTION_MODE,
    KUBEVIRT_INTERFACES, PROXY_RUN_AS_GROUP, PROXY_RUN_AS_USER, REROUTE_VIRTUAL_INTERFACES, SIDECAR_INJECT,
    SIDECAR_STATUS_ANNOTATION,
};
use crate::pod::PodInfo;
use crate::ports;
use crate::proxy::{PROXY_GID, PROXY_UID, TPROXY_MARK};
/// Kept under this name here, where the settings are built; defined with the other checks.
pub use crate::validate::SettingsError;
use crate::validate::{self, interfaces, Setting};

/// Ports of the sidecar's own health, status and metrics endpoints, never captured inbound.
const ALWAYS_EXCLUDED_INBOUND: [u16; 3] = [ports::STATS, ports::READINESS, ports::ENVOY_PROMETHEUS];

/// Istio's verdict on a pod: redirect it, or pass it through for the reason given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// An injected sidecar pod: program its redirect rules (see [`settings`]).
    Redirect,
    /// Pass the pod through without rules.
    Skip(Skip),
}

/// Why a pod is passed through without rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Skip {
    /// `istio-init` programs the rules itself.
    HasInitContainer,
    /// No `istio-proxy` container.
    NoProxy,
    /// `DISABLE_ENVOY=true` on the proxy.
    EnvoyDisabled,
    /// The proxy is not a sidecar (for example `proxy router`).
    NotSidecar(String),
    /// `sidecar.istio.io/inject` is false.
    InjectionDisabled,
    /// No `sidecar.istio.io/status` annotation: the pod was never injected.
    NotInjected,
    /// `sidecar.istio.io/interceptionMode: NONE`.
    InterceptionNone,
}

/// Go's `strconv.ParseBool`, which Istio uses for these flags.
fn parse_bool(s: &str) -> Option<bool> {
    match s.trim() {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Some(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Some(false),
        _ => None,
    }
}

/// Decides whether the pod is redirected.
pub fn decide(pod: &PodInfo) -> Decision {
    match skip_reason(pod) {
        Some(why) => Decision::Skip(why),
        None => Decision::Redirect,
    }
}

fn skip_reason(pod: &PodInfo) -> Option<Skip> {
    if pod.init_containers.iter().any(|c| c == INIT_CONTAINER) {
        return Some(Skip::HasInitContainer);
    }
    let Some(proxy) = pod.proxy.as_ref() else { return Some(Skip::NoProxy) };
    if proxy.env.get("DISABLE_ENVOY").and_then(|v| parse_bool(v)) == Some(true) {
        return Some(Skip::EnvoyDisabled);
    }
    if proxy.args.len() >= 2 && proxy.args[0] == "proxy" && proxy.args[1] != "sidecar" {
        return Some(Skip::NotSidecar(proxy.args[1].clone()));
    }
    let inject = pod.labels.get(SIDECAR_INJECT).or_else(|| pod.annotations.get(SIDECAR_INJECT));
    if inject.and_then(|v| parse_bool(v)) == Some(false) {
        return Some(Skip::InjectionDisabled);
    }
    if !pod.annotations.contains_key(SIDECAR_STATUS_ANNOTATION) {
        return Some(Skip::NotInjected);
    }
    if pod.annotations.get(INTERCEPTION_MODE).map(|m| m.trim()) == Some("NONE") {
        return Some(Skip::InterceptionNone);
    }
    None
}

fn invalid(annotation: &'static str, value: &str, why: impl std::fmt::Display) -> SettingsError {
    SettingsError::annotation_value(annotation, value, why)
}

fn port_list(pod: &PodInfo, annotation: &'static str, default: &str) -> Result<Vec<u16>, SettingsError> {
    let value = pod.annotations.get(annotation).map(String::as_str).unwrap_or(default);
    validate::port_list(value).map_err(|e| invalid(annotation, value, e))
}

fn port_spec(pod: &PodInfo, annotation: &'static str) -> Result<PortSpec, SettingsError> {
    match pod.annotations.get(annotation).map(|v| v.trim()) {
        None | Some("*") => Ok(PortSpec::All),
        Some(_) => Ok(PortSpec::List(port_list(pod, annotation, "")?)),
    }
}

fn cidrs(pod: &PodInfo, annotation: &'static str) -> Result<Vec<IpNet>, SettingsError> {
    let Some(value) = pod.annotations.get(annotation) else { return Ok(Vec::new()) };
    validate::cidr_list(value).map_err(|e| invalid(annotation, value, e))
}

/// The proxy's uid or gid from its container's `field`: unset or 0 means Istio's default (1337, as Istio's plugin
/// treats them); a value that is no valid id is an error, never silently the default.
fn id(value: Option<i64>, field: &'static str, default: u32) -> Result<u32, SettingsError> {
    match value {
        None | Some(0) => Ok(default),
        Some(v) => validate::owner_id(v).map_err(|e| SettingsError {
            setting: Setting::ProxyField(field),
            value: v.to_string(),
            why: e.to_string(),
        }),
    }
}

/// Builds the redirect settings for a pod that [`decide`] redirects, exactly as Istio's plugin does.
/// `pod_has_ipv6` comes from the addresses the previous plugins assigned.
pub fn settings(pod: &PodInfo, pod_has_ipv6: bool) -> Result<SidecarConfig, SettingsError> {
    let proxy = pod.proxy.clone().unwrap_or_default();
    let env_true = |k: &str| proxy.env.get(k).and_then(|v| parse_bool(v)) == Some(true);
    let mode = match pod.annotations.get(INTERCEPTION_MODE).map(|m| m.trim()) {
        None | Some("REDIRECT") => InterceptMode::Redirect,
        Some("TPROXY") => InterceptMode::Tproxy,
        Some(other) => return Err(invalid(INTERCEPTION_MODE, other, "expected REDIRECT, TPROXY or NONE")),
    };
    // Istio's plugin appends the sidecar's own ports and then drops repeats (the first one stays), so a port
    // named twice gets one rule.
    let mut inbound_exclude = Vec::new();
    for p in port_list(pod, EXCLUDE_INBOUND_PORTS, "15020")?.into_iter().chain(ALWAYS_EXCLUDED_INBOUND) {
        if !inbound_exclude.contains(&p) {
            inbound_exclude.push(p);
        }
    }
    let include_ranges = match pod.annotations.get(INCLUDE_OUTBOUND_IP_RANGES).map(|v| v.trim()) {
        None | Some("*") => CidrSpec::All,
        Some(_) => CidrSpec::List(cidrs(pod, INCLUDE_OUTBOUND_IP_RANGES)?),
    };
    let mut reroute = interfaces(&pod.annotations, REROUTE_VIRTUAL_INTERFACES)?;
    if reroute.is_empty() {
        reroute = interfaces(&pod.annotations, KUBEVIRT_INTERFACES)?;
    }
    let dns = env_true("ISTIO_META_DNS_CAPTURE");
    Ok(SidecarConfig {
        proxy_uids: vec![id(proxy.run_as_user, PROXY_RUN_AS_USER, PROXY_UID)?],
        proxy_gids: vec![id(proxy.run_as_group, PROXY_RUN_AS_GROUP, PROXY_GID)?],
        mode,
        inbound_ports_include: port_spec(pod, INCLUDE_INBOUND_PORTS)?,
        inbound_ports_exclude: inbound_exclude,
        outbound_ports_include: port_list(pod, INCLUDE_OUTBOUND_PORTS, "")?,
        outbound_ports_exclude: port_list(pod, EXCLUDE_OUTBOUND_PORTS, "15020")?,
        outbound_ip_ranges_include: include_ranges,
        outbound_ip_ranges_exclude: cidrs(pod, EXCLUDE_OUTBOUND_IP_RANGES)?,
        exclude_interfaces: interfaces(&pod.annotations, EXCLUDE_INTERFACES)?,
        reroute_virtual_interfaces: reroute,
        redirect_dns: dns,
        capture_all_dns: dns,
        drop_invalid: env_true("INVALID_DROP"),
        enable_ipv6: pod_has_ipv6 || env_true("ISTIO_DUAL_STACK"),
        ..SidecarConfig::default()
    })
}

/// How inbound traffic reaches the proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InterceptMode {
    /// nat REDIRECT (the default); the original destination is recovered with SO_ORIGINAL_DST.
    Redirect,
    /// mangle TPROXY with policy routing; preserves the source address.
    Tproxy,
}

/// Inbound ports to capture: `*` or an explicit list (an empty list captures nothing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PortSpec {
    /// Every port (`*`).
    All,
    /// Only these ports, in this order.
    List(Vec<u16>),
}

/// Outbound destinations to capture: `*` or an explicit list of ranges (empty captures nothing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CidrSpec {
    /// Every destination (`*`).
    All,
    /// Only these ranges (both families mixed; each lands in its family's payload).
    List(Vec<IpNet>),
}

/// Inputs of the sidecar rule generator; field meanings follow istio-iptables' flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SidecarConfig {
    /// Proxy outbound port (15001).
    pub proxy_port: u16,
    /// Proxy inbound capture port (15006).
    pub inbound_capture_port: u16,
    /// HBONE tunnel port, never captured (15008).
    pub inbound_tunnel_port: u16,
    /// UIDs whose traffic is the proxy's own (default 1337).
    pub proxy_uids: Vec<u32>,
    /// GIDs whose traffic is the proxy's own (default 1337).
    pub proxy_gids: Vec<u32>,
    /// Inbound interception mode.
    pub mode: InterceptMode,
    /// Inbound ports to capture.
    pub inbound_ports_include: PortSpec,
    /// Inbound ports to leave alone (only effective with [`PortSpec::All`]).
    pub inbound_ports_exclude: Vec<u16>,
    /// Outbound ports always captured.
    pub outbound_ports_include: Vec<u16>,
    /// Outbound ports (TCP and UDP) never captured.
    pub outbound_ports_exclude: Vec<u16>,
    /// Outbound destination ranges to capture.
    pub outbound_ip_ranges_include: CidrSpec,
    /// Outbound destination ranges never captured.
    pub outbound_ip_ranges_exclude: Vec<IpNet>,
    /// Interfaces whose traffic is never captured.
    pub exclude_interfaces: Vec<String>,
    /// Virtual interfaces (e.g. KubeVirt) whose inbound traffic is treated as outbound.
    pub reroute_virtual_interfaces: Vec<String>,
    /// Redirect DNS to the agent's DNS proxy (needs `capture_all_dns` or `dns_servers`).
    pub redirect_dns: bool,
    /// Capture all port-53 traffic rather than only traffic to `dns_servers`.
    pub capture_all_dns: bool,
    /// DNS servers (from resolv.conf) whose traffic is captured when not capturing all DNS.
    pub dns_servers: Vec<IpAddr>,
    /// Drop conntrack-INVALID packets instead of letting them reset connections.
    pub drop_invalid: bool,
    /// Owner groups whose outbound traffic is captured (`*` for all).
    pub owner_groups_include: String,
    /// Owner groups whose outbound traffic is not captured (only used with include `*`).
    pub owner_groups_exclude: String,
    /// The IPv4 loopback range treated as "local" (127.0.0.1/32).
    pub host_ipv4_loopback_cidr: Ipv4Net,
    /// Also produce the ip6tables payload.
    pub enable_ipv6: bool,
    /// Mark TPROXY sets on inbound packets (1337).
    pub tproxy_mark: u32,
    /// Policy routing table for TPROXY (133).
    pub tproxy_route_table: u32,
}

impl SidecarConfig {
    /// Where Istio's CNI plugin starts for an injected pod before its annotations: capture every inbound port but
    /// the sidecar's own (15020, 15021, 15090) and every outbound address, and let 15020 out uncaptured.
    pub fn cni_pod_defaults() -> Self {
        Self {
            inbound_ports_include: PortSpec::All,
            inbound_ports_exclude: ALWAYS_EXCLUDED_INBOUND.to_vec(),
            outbound_ports_exclude: vec![ports::STATS],
            outbound_ip_ranges_include: CidrSpec::All,
            ..Self::default()
        }
    }
}

impl Default for SidecarConfig {
    /// The istio-iptables baseline: no inbound capture, no outbound catch-all, IPv4 only.
    fn default() -> Self {
        Self {
            proxy_port: ports::OUTBOUND,
            inbound_capture_port: ports::INBOUND_PLAINTEXT,
            inbound_tunnel_port: ports::HBONE,
            proxy_uids: vec![PROXY_UID],
            proxy_gids: vec![PROXY_GID],
            mode: InterceptMode::Redirect,
            inbound_ports_include: PortSpec::List(Vec::new()),
            inbound_ports_exclude: Vec::new(),
            outbound_ports_include: Vec::new(),
            outbound_ports_exclude: Vec::new(),
            outbound_ip_ranges_include: CidrSpec::List(Vec::new()),
            outbound_ip_ranges_exclude: Vec::new(),
            exclude_interfaces: Vec::new(),
            reroute_virtual_interfaces: Vec::new(),
            redirect_dns: false,
            capture_all_dns: false,
            dns_servers: Vec::new(),
            drop_invalid: false,
            owner_groups_include: "*".into(),
            owner_groups_exclude: String::new(),
            host_ipv4_loopback_cidr: Ipv4Net::new([127, 0, 0, 1].into(), 32).expect("valid /32"),
            enable_ipv6: false,
            tproxy_mark: TPROXY_MARK,
            tproxy_route_table: 133,
        }
    }
}

#[cfg(test)]
mod tests;
