//! Istio's sidecar decision: whether a pod gets redirect rules, and which ones, from its annotations and its
//! `istio-proxy` container; and programming them. The plugin uses it at ADD, the node agent to repair a pod that
//! started before the plugin was chained.

use std::net::IpAddr;

use cni::{CniError, ErrorCode};
use ipnet::IpNet;
use netns::Netns;
use redirect::backend::Backend;
use redirect::sidecar::{CidrSpec, InterceptMode, Plan, PortSpec, SidecarConfig};

use crate::pod::{PodInfo, INIT_CONTAINER};

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

const ANN_STATUS: &str = "sidecar.istio.io/status";
const ANN_INJECT: &str = "sidecar.istio.io/inject";
const ANN_MODE: &str = "sidecar.istio.io/interceptionMode";
const ANN_INCLUDE_IN_PORTS: &str = "traffic.sidecar.istio.io/includeInboundPorts";
const ANN_EXCLUDE_IN_PORTS: &str = "traffic.sidecar.istio.io/excludeInboundPorts";
const ANN_INCLUDE_OUT_PORTS: &str = "traffic.sidecar.istio.io/includeOutboundPorts";
const ANN_EXCLUDE_OUT_PORTS: &str = "traffic.sidecar.istio.io/excludeOutboundPorts";
const ANN_INCLUDE_OUT_RANGES: &str = "traffic.sidecar.istio.io/includeOutboundIPRanges";
const ANN_EXCLUDE_OUT_RANGES: &str = "traffic.sidecar.istio.io/excludeOutboundIPRanges";
const ANN_EXCLUDE_IFACES: &str = "traffic.sidecar.istio.io/excludeInterfaces";
const ANN_REROUTE_IFACES: &str = "istio.io/reroute-virtual-interfaces";
const ANN_KUBEVIRT_IFACES: &str = "traffic.sidecar.istio.io/kubevirtInterfaces";

/// Default proxy uid and gid.
const PROXY_ID: u32 = 1337;
/// Ports of the sidecar's own health, status and metrics endpoints, never captured inbound.
const ALWAYS_EXCLUDED_INBOUND: [u16; 3] = [15020, 15021, 15090];

/// Go's `strconv.ParseBool`, which Istio uses for these flags.
fn parse_bool(s: &str) -> Option<bool> {
    match s.trim() {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Some(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Some(false),
        _ => None,
    }
}

/// Decides whether the pod is redirected; `Ok(None)`'s counterpart is `Err(Skip)` with the reason.
pub fn decide(pod: &PodInfo) -> Result<(), Skip> {
    if pod.init_containers.iter().any(|c| c == INIT_CONTAINER) {
        return Err(Skip::HasInitContainer);
    }
    let proxy = pod.proxy.as_ref().ok_or(Skip::NoProxy)?;
    if proxy.env.get("DISABLE_ENVOY").and_then(|v| parse_bool(v)) == Some(true) {
        return Err(Skip::EnvoyDisabled);
    }
    if proxy.args.len() >= 2 && proxy.args[0] == "proxy" && proxy.args[1] != "sidecar" {
        return Err(Skip::NotSidecar(proxy.args[1].clone()));
    }
    let inject = pod.labels.get(ANN_INJECT).or_else(|| pod.annotations.get(ANN_INJECT));
    if inject.and_then(|v| parse_bool(v)) == Some(false) {
        return Err(Skip::InjectionDisabled);
    }
    if !pod.annotations.contains_key(ANN_STATUS) {
        return Err(Skip::NotInjected);
    }
    if pod.annotations.get(ANN_MODE).map(|m| m.trim()) == Some("NONE") {
        return Err(Skip::InterceptionNone);
    }
    Ok(())
}

fn invalid(annotation: &str, value: &str, why: impl std::fmt::Display) -> CniError {
    CniError::new(ErrorCode::InvalidConfig, format!("invalid annotation {annotation}={value:?}: {why}"))
}

fn list(value: &str) -> impl Iterator<Item = &str> {
    value.split(',').map(str::trim).filter(|s| !s.is_empty())
}

fn ports(pod: &PodInfo, annotation: &str, default: &str) -> Result<Vec<u16>, CniError> {
    let value = pod.annotations.get(annotation).map(String::as_str).unwrap_or(default);
    list(value).map(|p| p.parse::<u16>().map_err(|e| invalid(annotation, value, e))).collect()
}

fn port_spec(pod: &PodInfo, annotation: &str) -> Result<PortSpec, CniError> {
    match pod.annotations.get(annotation).map(|v| v.trim()) {
        None | Some("*") => Ok(PortSpec::All),
        Some(_) => Ok(PortSpec::List(ports(pod, annotation, "")?)),
    }
}

fn cidrs(pod: &PodInfo, annotation: &str) -> Result<Vec<IpNet>, CniError> {
    let Some(value) = pod.annotations.get(annotation) else { return Ok(Vec::new()) };
    list(value)
        .map(|c| {
            c.parse::<IpNet>()
                .or_else(|_| c.parse::<IpAddr>().map(IpNet::from))
                .map_err(|e| invalid(annotation, value, e))
        })
        .collect()
}

fn names(pod: &PodInfo, annotation: &str) -> Vec<String> {
    pod.annotations.get(annotation).map(|v| list(v).map(String::from).collect()).unwrap_or_default()
}

fn id(v: Option<i64>) -> u32 {
    v.filter(|&v| v > 0).and_then(|v| u32::try_from(v).ok()).unwrap_or(PROXY_ID)
}

/// Builds the redirect settings for a pod that [`decide`] accepted, exactly as Istio's plugin does.
/// `pod_has_ipv6` comes from the addresses the previous plugins assigned.
pub fn settings(pod: &PodInfo, pod_has_ipv6: bool) -> Result<SidecarConfig, CniError> {
    let proxy = pod.proxy.clone().unwrap_or_default();
    let env_true = |k: &str| proxy.env.get(k).and_then(|v| parse_bool(v)) == Some(true);
    let mode = match pod.annotations.get(ANN_MODE).map(|m| m.trim()) {
        None | Some("REDIRECT") => InterceptMode::Redirect,
        Some("TPROXY") => InterceptMode::Tproxy,
        Some(other) => return Err(invalid(ANN_MODE, other, "expected REDIRECT, TPROXY or NONE")),
    };
    let mut inbound_exclude = ports(pod, ANN_EXCLUDE_IN_PORTS, "15020")?;
    for p in ALWAYS_EXCLUDED_INBOUND {
        if !inbound_exclude.contains(&p) {
            inbound_exclude.push(p);
        }
    }
    let include_ranges = match pod.annotations.get(ANN_INCLUDE_OUT_RANGES).map(|v| v.trim()) {
        None | Some("*") => CidrSpec::All,
        Some(_) => CidrSpec::List(cidrs(pod, ANN_INCLUDE_OUT_RANGES)?),
    };
    let mut reroute = names(pod, ANN_REROUTE_IFACES);
    if reroute.is_empty() {
        reroute = names(pod, ANN_KUBEVIRT_IFACES);
    }
    let dns = env_true("ISTIO_META_DNS_CAPTURE");
    Ok(SidecarConfig {
        proxy_uids: vec![id(proxy.run_as_user)],
        proxy_gids: vec![id(proxy.run_as_group)],
        mode,
        inbound_ports_include: port_spec(pod, ANN_INCLUDE_IN_PORTS)?,
        inbound_ports_exclude: inbound_exclude,
        outbound_ports_include: ports(pod, ANN_INCLUDE_OUT_PORTS, "")?,
        outbound_ports_exclude: ports(pod, ANN_EXCLUDE_OUT_PORTS, "15020")?,
        outbound_ip_ranges_include: include_ranges,
        outbound_ip_ranges_exclude: cidrs(pod, ANN_EXCLUDE_OUT_RANGES)?,
        exclude_interfaces: names(pod, ANN_EXCLUDE_IFACES),
        reroute_virtual_interfaces: reroute,
        redirect_dns: dns,
        capture_all_dns: dns,
        drop_invalid: env_true("INVALID_DROP"),
        enable_ipv6: pod_has_ipv6 || env_true("ISTIO_DUAL_STACK"),
        ..SidecarConfig::default()
    })
}

/// Programs a pod's sidecar `plan` into `netns` with `backend`, all or nothing: on failure the partial rules are
/// removed, so the next attempt (the kubelet's retry of ADD, the agent's next repair) starts from a clean slate.
pub fn program(backend: Backend, netns: &Netns, plan: &Plan) -> Result<(), CniError> {
    if let Err(e) = backend.apply(netns, plan) {
        if let Err(cleanup) = backend.remove(netns) {
            tracing::error!(error = %cleanup, "could not remove partial rules");
        }
        return Err(CniError::new(ErrorCode::Internal, format!("programming redirect rules with {backend} failed"))
            .with_details(e.to_string()));
    }
    Ok(())
}

#[cfg(test)]
#[path = "sidecar_tests.rs"]
mod tests;
