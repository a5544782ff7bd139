//! CNI results the way libcni handles them: a plugin's result is decoded as the typed result of its own
//! `cniVersion` (the config's when it names none), which keeps only the fields that version defines, and a
//! cached result is converted to the list's version before a plugin gets it as `prevResult`.
//!
//! Written from the spec's result shapes, independently of the plugin's own conversion code, so the runtime
//! can catch it out.

use std::net::IpAddr;

use serde_json::{json, Map, Value};

/// The three result shapes the spec has had.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// 0.1.0 and 0.2.0: `ip4`, `ip6`, `dns`.
    V020,
    /// 0.3.0 to 0.4.0: `interfaces`, `ips` with a `version`, `routes`, `dns`.
    V040,
    /// 1.0.0 and 1.1.0: as 0.4.0 without `ips[].version`, with more interface keys.
    V100,
}

fn shape(version: &str) -> Result<Shape, String> {
    match version {
        "0.1.0" | "0.2.0" => Ok(Shape::V020),
        "0.3.0" | "0.3.1" | "0.4.0" => Ok(Shape::V040),
        "1.0.0" | "1.1.0" => Ok(Shape::V100),
        other => Err(format!("unsupported CNI result version {other:?}")),
    }
}

/// A plugin's stdout as libcni reads it: a JSON object (`null` reads as `{}`) whose missing or empty
/// `cniVersion` becomes the config's, decoded as the typed result of that version.
pub(super) fn from_plugin(stdout: &[u8], conf_version: &str) -> Result<Value, String> {
    let mut raw = match serde_json::from_slice::<Value>(stdout).map_err(|e| e.to_string())? {
        Value::Null => Value::Object(Map::new()),
        v @ Value::Object(_) => v,
        _ => return Err("not a JSON object".into()),
    };
    if raw.get("cniVersion").and_then(Value::as_str).is_none_or(str::is_empty) {
        raw["cniVersion"] = Value::String(conf_version.to_owned());
    }
    decode(&raw)
}

/// Decodes `raw` as the typed result of its own `cniVersion`, dropping keys that version does not define.
pub(super) fn decode(raw: &Value) -> Result<Value, String> {
    let version = raw.get("cniVersion").and_then(Value::as_str).unwrap_or("0.1.0");
    let mut out = Map::new();
    out.insert("cniVersion".into(), json!(version));
    match shape(version)? {
        Shape::V020 => {
            for key in ["ip4", "ip6"] {
                if let Some(ip) = raw.get(key).filter(|v| !v.is_null()) {
                    let mut conf = pick(ip, &["ip", "gateway"]);
                    cidr(&conf, "ip").map_err(|e| format!("{key}: {e}"))?;
                    if let Some(routes) = list(ip, "routes", &ROUTE_KEYS) {
                        conf.insert("routes".into(), routes);
                    }
                    out.insert(key.into(), Value::Object(conf));
                }
            }
        }
        s @ (Shape::V040 | Shape::V100) => {
            let (iface_keys, ip_keys): (&[&str], &[&str]) = match s {
                Shape::V040 => (&["name", "mac", "sandbox"], &["version", "interface", "address", "gateway"]),
                _ => (&["name", "mac", "mtu", "sandbox", "socketPath", "pciID"], &["interface", "address", "gateway"]),
            };
            if let Some(ifaces) = list(raw, "interfaces", iface_keys) {
                out.insert("interfaces".into(), ifaces);
            }
            if let Some(ips) = list(raw, "ips", ip_keys) {
                for (i, ip) in ips.as_array().into_iter().flatten().enumerate() {
                    cidr(ip.as_object().expect("picked object"), "address").map_err(|e| format!("ips[{i}]: {e}"))?;
                }
                out.insert("ips".into(), ips);
            }
            if let Some(routes) = list(raw, "routes", &ROUTE_KEYS) {
                out.insert("routes".into(), routes);
            }
        }
    }
    // libcni's typed results always print `dns`, as `{}` when empty.
    out.insert("dns".into(), Value::Object(raw.get("dns").map(|d| pick(d, &DNS_KEYS)).unwrap_or_default()));
    Ok(Value::Object(out))
}

/// Converts a decoded result to version `to`, as libcni's `GetAsVersion` does.
pub(super) fn convert(result: &Value, to: &str) -> Result<Value, String> {
    let result = decode(result)?;
    let from = shape(result["cniVersion"].as_str().unwrap_or_default())?;
    let target = shape(to)?;
    let mut out = match (from, target) {
        (a, b) if a == b => result,
        (Shape::V020, _) => {
            let mid = from_020(&result);
            if target == Shape::V100 {
                to_100(&mid)
            } else {
                mid
            }
        }
        (_, Shape::V020) => to_020(&if from == Shape::V100 { to_040(&result) } else { result })?,
        (Shape::V100, Shape::V040) => to_040(&result),
        (Shape::V040, Shape::V100) => to_100(&result),
        _ => unreachable!("every pair of shapes is covered"),
    };
    out["cniVersion"] = json!(to);
    Ok(out)
}

const ROUTE_KEYS: [&str; 7] = ["dst", "gw", "mtu", "advmss", "priority", "table", "scope"];
const DNS_KEYS: [&str; 4] = ["nameservers", "domain", "search", "options"];

/// 1.x to 0.4.0: each IP gets its `version`; interfaces lose the keys 0.4.0 does not know.
fn to_040(r: &Value) -> Value {
    let mut out = r.clone();
    if let Some(ips) = out.get_mut("ips").and_then(Value::as_array_mut) {
        for ip in ips {
            let v4 = ip_of(ip["address"].as_str().unwrap_or_default()).is_some_and(|a| a.is_ipv4());
            ip["version"] = json!(if v4 { "4" } else { "6" });
        }
    }
    if let Some(ifaces) = out.get_mut("interfaces").and_then(Value::as_array_mut) {
        for iface in ifaces {
            *iface = Value::Object(pick(iface, &["name", "mac", "sandbox"]));
        }
    }
    out
}

/// 0.4.0 to 1.x: IPs lose their `version`.
fn to_100(r: &Value) -> Value {
    let mut out = r.clone();
    if let Some(ips) = out.get_mut("ips").and_then(Value::as_array_mut) {
        for ip in ips.iter_mut().filter_map(Value::as_object_mut) {
            ip.remove("version");
        }
    }
    out
}

/// 0.2.0 to 0.4.0: `ip4`/`ip6` become `ips`, their routes `routes`.
fn from_020(r: &Value) -> Value {
    let mut ips = Vec::new();
    let mut routes = Vec::new();
    for (key, version) in [("ip4", "4"), ("ip6", "6")] {
        if let Some(ip) = r.get(key) {
            let mut conf = json!({"version": version, "address": ip["ip"]});
            if let Some(gw) = ip.get("gateway") {
                conf["gateway"] = gw.clone();
            }
            ips.push(conf);
            routes.extend(
                ip["routes"].as_array().into_iter().flatten().map(|rt| Value::Object(pick(rt, &["dst", "gw"]))),
            );
        }
    }
    let mut out = json!({"cniVersion": "0.4.0", "dns": r["dns"]});
    if !ips.is_empty() {
        out["ips"] = Value::Array(ips);
    }
    if !routes.is_empty() {
        out["routes"] = Value::Array(routes);
    }
    out
}

/// 0.4.0 to 0.2.0: the first IP of each family, routes sorted to the family of their `dst`; at least one IP.
fn to_020(r: &Value) -> Result<Value, String> {
    let mut out = json!({"cniVersion": "0.2.0", "dns": r["dns"]});
    for ip in r["ips"].as_array().into_iter().flatten() {
        let key = if ip["version"] == "4" { "ip4" } else { "ip6" };
        if out.get(key).is_none() {
            let mut conf = json!({"ip": ip["address"]});
            if let Some(gw) = ip.get("gateway") {
                conf["gateway"] = gw.clone();
            }
            out[key] = conf;
        }
    }
    for route in r["routes"].as_array().into_iter().flatten() {
        let v4 = ip_of(route["dst"].as_str().unwrap_or_default()).is_some_and(|a| a.is_ipv4());
        let key = if v4 { "ip4" } else { "ip6" };
        if let Some(conf) = out.get_mut(key) {
            let routes = conf.as_object_mut().expect("ip conf").entry("routes").or_insert_with(|| json!([]));
            routes.as_array_mut().expect("routes").push(Value::Object(pick(route, &["dst", "gw"])));
        }
    }
    if out.get("ip4").is_none() && out.get("ip6").is_none() {
        return Err("cannot convert: no valid IP addresses".into());
    }
    Ok(out)
}

/// The keys of object `v` that are in `keys` and not null.
fn pick(v: &Value, keys: &[&str]) -> Map<String, Value> {
    keys.iter().filter_map(|k| v.get(*k).filter(|x| !x.is_null()).map(|x| ((*k).to_owned(), x.clone()))).collect()
}

/// `v[key]` as a list of objects with only `keys`; `None` when absent or empty (Go's `omitempty`).
fn list(v: &Value, key: &str, keys: &[&str]) -> Option<Value> {
    let items = v.get(key)?.as_array().filter(|a| !a.is_empty())?;
    Some(Value::Array(items.iter().map(|i| Value::Object(pick(i, keys))).collect()))
}

fn cidr(conf: &Map<String, Value>, key: &str) -> Result<(), String> {
    let text = conf.get(key).and_then(Value::as_str).unwrap_or_default();
    let (addr, prefix) = text.split_once('/').ok_or_else(|| format!("{key} {text:?} is not a CIDR"))?;
    let ok = addr.parse::<IpAddr>().is_ok() && prefix.parse::<u8>().is_ok();
    ok.then_some(()).ok_or_else(|| format!("{key} {text:?} is not a CIDR"))
}

fn ip_of(cidr: &str) -> Option<IpAddr> {
    cidr.split('/').next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_result_without_version_takes_the_configs_and_unknown_keys_go() {
        let r = from_plugin(br#"{"ips":[{"address":"10.0.0.2/24","extra":1}],"x":1}"#, "1.0.0").unwrap();
        assert_eq!(r, json!({"cniVersion": "1.0.0", "ips": [{"address": "10.0.0.2/24"}], "dns": {}}));
        assert_eq!(from_plugin(b"null", "0.4.0").unwrap(), json!({"cniVersion": "0.4.0", "dns": {}}));
        assert!(from_plugin(br#"{"cniVersion":"9.9.9"}"#, "1.0.0").unwrap_err().contains("unsupported"));
    }

    #[test]
    fn converts_between_every_shape() {
        let v100 = json!({
            "cniVersion": "1.0.0",
            "interfaces": [{"name": "eth0", "mtu": 1500, "sandbox": "/ns"}],
            "ips": [{"interface": 0, "address": "10.0.0.2/24", "gateway": "10.0.0.1"}, {"address": "fd00::2/64"}],
            "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}],
            "dns": {},
        });
        let v040 = convert(&v100, "0.4.0").unwrap();
        assert_eq!(v040["ips"][0]["version"], "4");
        assert_eq!(v040["ips"][1]["version"], "6");
        assert_eq!(v040["interfaces"], json!([{"name": "eth0", "sandbox": "/ns"}]));
        let back = convert(&v040, "1.1.0").unwrap();
        assert_eq!(back["cniVersion"], "1.1.0");
        assert!(back["ips"][0].get("version").is_none(), "{back}");

        let v020 = convert(&v100, "0.2.0").unwrap();
        assert_eq!(v020["ip4"], json!({"ip": "10.0.0.2/24", "gateway": "10.0.0.1", "routes": [{"dst": "0.0.0.0/0"}]}));
        assert_eq!(v020["ip6"], json!({"ip": "fd00::2/64", "routes": [{"dst": "::/0"}]}));
        let up = convert(&v020, "1.0.0").unwrap();
        assert_eq!(up["ips"][0], json!({"address": "10.0.0.2/24", "gateway": "10.0.0.1"}));

        let err = convert(&json!({"cniVersion": "1.0.0"}), "0.2.0").unwrap_err();
        assert!(err.contains("no valid IP"), "{err}");
    }
}
