//! Every value a pod (its annotations, its `istio-proxy` container) or a netconf hands us is checked here before
//! it can reach a packet-filter rule, and the rule renderers check names again with the same functions. Pod
//! annotations are written by whoever may create pods, which admission policies rarely restrict beyond the
//! well-known keys; a value that reaches `iptables-restore` unchecked can inject any rule into the pod's tables.
//!
//! The sidecar settings ([`crate::sidecar::settings`]) and the node agent's ambient annotations use these, so
//! both paths accept and refuse exactly the same values.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;

/// Longest interface name the kernel accepts: `IFNAMSIZ` (16) less the terminating NUL.
pub const MAX_INTERFACE_NAME: usize = 15;

/// Longest chain name iptables accepts (`XT_EXTENSION_MAXNAMELEN` less the NUL).
pub const MAX_IPTABLES_CHAIN: usize = 28;

/// Longest set name ipset accepts (`IPSET_MAXNAMELEN` less the NUL).
pub const MAX_IPSET_NAME: usize = 31;

/// Longest table, chain or set name nftables accepts (`NFT_NAME_MAXLEN` less the NUL); also the bound on user
/// and group names in owner matches (`LOGIN_NAME_MAX` less the NUL).
pub const MAX_NFT_NAME: usize = 255;

/// Characters of an interface name: what the kernel accepts that is also one plain word for every rule tool
/// (no space, quote, `!`, `#`, `+` wildcard or control character).
fn interface_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '@' | '-')
}

/// Characters of a chain, set, user or group name: the portable user-name set (POSIX), one word everywhere.
fn identifier_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')
}

/// Where a setting that shapes a pod's rules comes from, to name it when it is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setting {
    /// A pod annotation (one of [`crate::names`]).
    Annotation(&'static str),
    /// A field of the pod's `istio-proxy` container, e.g. [`crate::names::PROXY_RUN_AS_USER`].
    ProxyField(&'static str),
}

impl std::fmt::Display for Setting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Setting::Annotation(name) => write!(f, "annotation {name}"),
            Setting::ProxyField(field) => write!(f, "{} container's {field}", crate::names::PROXY_CONTAINER),
        }
    }
}

/// A pod setting (an annotation, or the proxy's uid or gid) that Istio's decision cannot turn into rules, or that
/// these checks refuse: the pod must not start (fail closed), and no rule is programmed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {setting}={value:?}: {why}")]
pub struct SettingsError {
    /// The setting at fault.
    pub setting: Setting,
    /// Its whole value as the pod carries it.
    pub value: String,
    /// What is wrong with it.
    pub why: String,
}

impl SettingsError {
    /// The annotation at fault, if the setting is one.
    pub fn annotation(&self) -> Option<&'static str> {
        match self.setting {
            Setting::Annotation(name) => Some(name),
            Setting::ProxyField(_) => None,
        }
    }

    /// The error for annotation `annotation`, whose whole value is `value`.
    pub fn annotation_value(annotation: &'static str, value: &str, why: impl std::fmt::Display) -> Self {
        SettingsError { setting: Setting::Annotation(annotation), value: value.to_owned(), why: why.to_string() }
    }
}

/// The interface names of `annotation`, each checked: none may reach a rule unchecked.
pub fn interfaces(
    annotations: &BTreeMap<String, String>,
    annotation: &'static str,
) -> Result<Vec<String>, SettingsError> {
    let Some(value) = annotations.get(annotation) else { return Ok(Vec::new()) };
    interface_list(value).map_err(|e| SettingsError::annotation_value(annotation, value, e))
}

/// Why a single value cannot go into a rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} {value:?} {why}")]
pub struct InvalidValue {
    /// The kind of value (`interface name`, `port`, `CIDR`, `uid`, ...).
    pub what: &'static str,
    /// The value as given.
    pub value: String,
    /// What is wrong with it.
    pub why: String,
}

fn invalid(what: &'static str, value: &str, why: impl Into<String>) -> InvalidValue {
    InvalidValue { what, value: value.to_owned(), why: why.into() }
}

/// The first character of `value` that `allowed` refuses, as the reason to give.
fn bad_char(value: &str, allowed: fn(char) -> bool, set: &str) -> Option<String> {
    value.chars().find(|&c| !allowed(c)).map(|c| format!("contains {c:?}; only {set} are allowed"))
}

/// A network interface name, `^[A-Za-z0-9_.:@-]{1,15}$`: refused, never truncated, when longer than the
/// kernel's limit or holding anything else (a newline would start a new `iptables-restore` line).
pub fn interface_name(name: &str) -> Result<&str, InvalidValue> {
    const WHAT: &str = "interface name";
    if name.is_empty() {
        return Err(invalid(WHAT, name, "is empty"));
    }
    if let Some(why) = bad_char(name, interface_char, "A-Z a-z 0-9 _ . : @ -") {
        return Err(invalid(WHAT, name, why));
    }
    if name.len() > MAX_INTERFACE_NAME {
        return Err(invalid(
            WHAT,
            name,
            format!("is {} bytes; the kernel's limit is {MAX_INTERFACE_NAME}", name.len()),
        ));
    }
    Ok(name)
}

/// A chain, set, user or group name of at most `max` bytes (see the `MAX_*` limits), starting with a letter,
/// digit or `_` so no tool takes it for an option. Our own names are constants; this is the renderers' last
/// line of defence, so a caller that skipped validation still cannot inject.
pub fn identifier(name: &str, max: usize) -> Result<&str, InvalidValue> {
    const WHAT: &str = "name";
    if name.is_empty() {
        return Err(invalid(WHAT, name, "is empty"));
    }
    if let Some(why) = bad_char(name, identifier_char, "A-Z a-z 0-9 _ . -") {
        return Err(invalid(WHAT, name, why));
    }
    if name.starts_with(['-', '.']) {
        return Err(invalid(WHAT, name, "starts with '-' or '.'"));
    }
    if name.len() > max {
        return Err(invalid(WHAT, name, format!("is {} bytes; the limit is {max}", name.len())));
    }
    Ok(name)
}

/// One port of an explicit port list: decimal digits only, 1 to 65535.
///
/// Port 0 is refused. Istio's goldens and tests never use it, and no TCP or UDP connection can be addressed to
/// port 0, so a rule naming it matches nothing: in an include list it would silently capture nothing, in an
/// exclude list it would exclude nothing. Either way the pod would run with a policy other than the one written,
/// which we refuse rather than guess at. (Istio's injector parses the lists as unsigned 16-bit numbers and lets
/// 0 through.)
pub fn port(value: &str) -> Result<u16, InvalidValue> {
    const WHAT: &str = "port";
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return Err(invalid(WHAT, value, "is not a decimal number"));
    }
    match value.parse::<u16>() {
        Ok(0) => Err(invalid(WHAT, value, "is 0, which no connection can use")),
        Ok(p) => Ok(p),
        Err(_) => Err(invalid(WHAT, value, "is above 65535")),
    }
}

/// A CIDR (`10.0.0.0/8`, `2001:db8::/32`) or a bare address (taken as a host route), as Istio accepts them.
pub fn cidr(value: &str) -> Result<IpNet, InvalidValue> {
    value
        .parse::<IpNet>()
        .or_else(|_| value.parse::<IpAddr>().map(IpNet::from))
        .map_err(|e| invalid("CIDR", value, format!("is not an address range: {e}")))
}

/// A uid or gid of an owner match, from a Kubernetes `int64` (`runAsUser`, `runAsGroup`): 0 to 4294967294.
/// 4294967295 is `(uid_t) -1`, which the kernel reserves, and anything outside `u32` is no id at all; both are
/// refused rather than replaced by a default, since the rules would then exempt another user's traffic.
pub fn owner_id(value: i64) -> Result<u32, InvalidValue> {
    match u32::try_from(value) {
        Ok(id) if id != u32::MAX => Ok(id),
        _ => Err(invalid("uid or gid", &value.to_string(), "is outside 0..=4294967294")),
    }
}

/// The items of a comma-separated annotation value, trimmed, without empty items (Istio tolerates `80,90,`).
pub fn items(value: &str) -> impl Iterator<Item = &str> {
    value.split(',').map(str::trim).filter(|s| !s.is_empty())
}

/// A comma-separated list of interface names, each checked by [`interface_name`].
pub fn interface_list(value: &str) -> Result<Vec<String>, InvalidValue> {
    items(value).map(|name| interface_name(name).map(String::from)).collect()
}

/// A comma-separated list of ports, each checked by [`port`].
pub fn port_list(value: &str) -> Result<Vec<u16>, InvalidValue> {
    items(value).map(port).collect()
}

/// A comma-separated list of CIDRs or addresses, each checked by [`cidr`].
pub fn cidr_list(value: &str) -> Result<Vec<IpNet>, InvalidValue> {
    items(value).map(cidr).collect()
}

#[cfg(test)]
mod tests;
