//! CNI results: converting a prevResult to the version a request asked for, and the empty result.
//!
//! Results are kept as JSON so fields added by other plugins survive the pass-through; only the fields whose
//! shape differs between versions are rewritten.

use std::net::IpAddr;

use serde_json::{json, Map, Value};

use crate::error::{CniError, ErrorCode};
use crate::version::Version;

/// Interface keys that only exist from spec 1.1.0 on.
const IFACE_KEYS_1_1: [&str; 3] = ["mtu", "socketPath", "pciID"];
/// Route keys that only exist from spec 1.1.0 on.
const ROUTE_KEYS_1_1: [&str; 5] = ["mtu", "advmss", "priority", "table", "scope"];

/// The result a plugin returns when nothing came before it.
pub fn empty(version: Version) -> Value {
    json!({ "cniVersion": version.to_string(), "dns": {} })
}

fn decode_err(msg: impl Into<String>) -> CniError {
    CniError::new(ErrorCode::Decoding, msg)
}

/// Converts `prev` (a prevResult of any supported shape) to the result shape of `to`.
pub fn convert(prev: &Value, to: Version) -> Result<Value, CniError> {
    let obj = prev.as_object().ok_or_else(|| decode_err("prevResult is not a JSON object"))?;
    let mut out = Map::new();
    out.insert("cniVersion".into(), Value::String(to.to_string()));
    let legacy = obj.contains_key("ip4") || obj.contains_key("ip6");
    for (k, v) in obj {
        if matches!(k.as_str(), "cniVersion" | "cniversion" | "ip4" | "ip6") {
            continue;
        }
        out.insert(k.clone(), v.clone());
    }
    if legacy {
        let (ips, routes) = from_legacy(obj)?;
        out.insert("ips".into(), Value::Array(ips));
        out.insert("routes".into(), Value::Array(routes));
    }
    if let Some(ips) = out.get_mut("ips") {
        let ips = ips.as_array_mut().ok_or_else(|| decode_err("prevResult.ips is not a list"))?;
        for ip in ips {
            let ip = ip.as_object_mut().ok_or_else(|| decode_err("prevResult.ips entry is not an object"))?;
            let addr = ip
                .get("address")
                .and_then(Value::as_str)
                .ok_or_else(|| decode_err("prevResult.ips entry has no address"))?;
            let family = if addr.contains(':') { "6" } else { "4" };
            if to.ips_carry_version() {
                ip.insert("version".into(), Value::String(family.into()));
            } else {
                ip.remove("version");
            }
        }
    }
    // Checked for every version, so a malformed result is refused whatever version the request asks for.
    for list in ["interfaces", "routes"] {
        if out.get(list).is_some_and(|items| !items.is_array()) {
            return Err(decode_err(format!("prevResult.{list} is not a list")));
        }
    }
    if to < Version(1, 1, 0) {
        strip(&mut out, "interfaces", &IFACE_KEYS_1_1);
        strip(&mut out, "routes", &ROUTE_KEYS_1_1);
    }
    Ok(Value::Object(out))
}

fn strip(out: &mut Map<String, Value>, list: &str, keys: &[&str]) {
    let items = out.get_mut(list).and_then(Value::as_array_mut).into_iter().flatten();
    for item in items.filter_map(Value::as_object_mut) {
        for k in keys {
            item.remove(*k);
        }
    }
}

/// Converts the pre-0.3.0 `ip4`/`ip6` shape into `ips` and `routes`.
fn from_legacy(obj: &Map<String, Value>) -> Result<(Vec<Value>, Vec<Value>), CniError> {
    let mut ips = Vec::new();
    let mut routes = Vec::new();
    for (key, version) in [("ip4", "4"), ("ip6", "6")] {
        let Some(section) = obj.get(key) else {
            continue;
        };
        let ip = section.get("ip").and_then(Value::as_str).ok_or_else(|| decode_err(format!("{key}.ip missing")))?;
        let mut entry = json!({ "version": version, "address": ip });
        if let Some(gw) = section.get("gateway") {
            entry["gateway"] = gw.clone();
        }
        ips.push(entry);
        if let Some(r) = section.get("routes").and_then(Value::as_array) {
            routes.extend(r.iter().cloned());
        }
    }
    Ok((ips, routes))
}

/// The addresses in a result's `ips`, without prefix length; unparsable entries are skipped.
pub fn addresses(result: &Value) -> Vec<IpAddr> {
    result
        .get("ips")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|ip| ip.get("address")?.as_str()?.split('/').next()?.parse().ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v1_result() -> Value {
        json!({
            "cniVersion": "1.0.0",
            "interfaces": [{"name": "eth0", "mac": "aa:bb:cc:dd:ee:ff", "sandbox": "/var/run/netns/x"}],
            "ips": [
                {"interface": 0, "address": "10.0.0.2/24", "gateway": "10.0.0.1"},
                {"interface": 0, "address": "fd00::2/64"}
            ],
            "routes": [{"dst": "0.0.0.0/0"}],
            "dns": {"nameservers": ["10.0.0.10"]}
        })
    }

    #[test]
    fn down_converts_to_0_3_with_ip_versions() {
        let r = convert(&v1_result(), Version(0, 3, 1)).unwrap();
        assert_eq!(r["cniVersion"], "0.3.1");
        assert_eq!(r["ips"][0]["version"], "4");
        assert_eq!(r["ips"][1]["version"], "6");
        assert_eq!(r["ips"][0]["address"], "10.0.0.2/24");
        assert_eq!(r["interfaces"][0]["sandbox"], "/var/run/netns/x");
        assert_eq!(r["dns"]["nameservers"][0], "10.0.0.10");
    }

    #[test]
    fn up_converts_to_1_0_without_ip_versions() {
        let old = convert(&v1_result(), Version(0, 4, 0)).unwrap();
        let new = convert(&old, Version(1, 0, 0)).unwrap();
        assert_eq!(new, v1_result());
    }

    #[test]
    fn strips_1_1_fields_for_older_versions() {
        let mut r = v1_result();
        r["interfaces"][0]["mtu"] = json!(1400);
        r["routes"][0]["priority"] = json!(5);
        assert_eq!(convert(&r, Version(1, 1, 0)).unwrap()["interfaces"][0]["mtu"], 1400);
        let down = convert(&r, Version(1, 0, 0)).unwrap();
        assert!(down["interfaces"][0].get("mtu").is_none());
        assert!(down["routes"][0].get("priority").is_none());
    }

    #[test]
    fn legacy_ip4_shape_is_understood() {
        let r = convert(&json!({"ip4": {"ip": "10.1.0.5/16", "gateway": "10.1.0.1"}}), Version(1, 0, 0)).unwrap();
        assert_eq!(r["ips"][0]["address"], "10.1.0.5/16");
        assert!(r.get("ip4").is_none());
    }

    #[test]
    fn bad_shapes_are_decoding_errors() {
        for bad in [json!([]), json!({"ips": 3}), json!({"ips": [{"gateway": "x"}]}), json!({"ips": ["x"]})] {
            assert_eq!(convert(&bad, Version(1, 0, 0)).unwrap_err().code, 6, "{bad}");
        }
    }

    #[test]
    fn a_list_that_is_not_a_list_is_refused_for_every_version() {
        // Found by the plugin_netconf fuzz target: accepted for 1.1.0, refused only when converting down.
        let prev = json!({"cniVersion": "1.1.0", "interfaces": {"nameservers": ["10.0.0.10"]}});
        let routes = json!({"cniVersion": "1.1.0", "routes": {"dst": "0.0.0.0/0"}});
        for to in crate::SUPPORTED_VERSIONS.map(|v| Version::parse(v).unwrap()) {
            assert_eq!(convert(&prev, to).unwrap_err().code, 6, "{to}");
            assert_eq!(convert(&routes, to).unwrap_err().code, 6, "{to}");
        }
    }

    #[test]
    fn addresses_are_extracted() {
        let a = addresses(&v1_result());
        assert_eq!(a, vec!["10.0.0.2".parse::<IpAddr>().unwrap(), "fd00::2".parse().unwrap()]);
    }
}
