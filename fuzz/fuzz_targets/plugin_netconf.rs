//! The plugin's stdin: netconf parsing, the version check, every accessor the commands use, and prevResult
//! conversion to each supported version. Invariants: errors carry the spec code the plugin documents and
//! render as a CNI error object; a converted result is in the requested version's shape, converting it again
//! changes nothing, and going through the newest version first gives the same result as converting directly.

#![no_main]

use cni::{result, CniError, Version, SUPPORTED_VERSIONS};
use libfuzzer_sys::fuzz_target;
use plugin::config::PluginConf;
use serde_json::Value;

fn assert_renders(e: &CniError) {
    let v: Value = serde_json::from_str(&e.to_json("1.0.0")).expect("a CNI error renders as JSON");
    assert_eq!(v["code"], Value::from(e.code));
    assert!(v["msg"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
}

fuzz_target!(|data: &[u8]| {
    let conf = match PluginConf::parse(data) {
        Ok(conf) => conf,
        Err(e) => {
            assert!(e.code == 6 || e.code == 7, "parse error code {}", e.code);
            return assert_renders(&e);
        }
    };
    match conf.version() {
        Ok(v) => assert!(SUPPORTED_VERSIONS.contains(&v.to_string().as_str()), "{v}"),
        Err(e) => {
            assert_eq!(e.code, 1);
            assert_renders(&e);
        }
    }
    let _ = (conf.run_dir(), conf.kubeconfig(), conf.log_level(), conf.excluded_namespaces().count());
    assert!(conf.pod_lookup().0 >= 1, "at least one pod lookup attempt");
    let Some(prev) = &conf.prev_result else { return };
    let via_latest = result::convert(prev, Version::LATEST);
    for to in SUPPORTED_VERSIONS.map(|v| Version::parse(v).unwrap()) {
        let out = match result::convert(prev, to) {
            Ok(out) => out,
            Err(e) => {
                assert_eq!(e.code, 6, "prevResult errors are decoding errors");
                assert!(via_latest.is_err(), "{to} failed but {} converted", Version::LATEST);
                assert_renders(&e);
                continue;
            }
        };
        assert_eq!(out["cniVersion"], Value::from(to.to_string()));
        for ip in out.get("ips").and_then(Value::as_array).into_iter().flatten() {
            assert!(ip["address"].is_string(), "{ip}");
            assert_eq!(ip.get("version").is_some(), to.ips_carry_version(), "{to}: {ip}");
        }
        assert_eq!(result::convert(&out, to).as_ref(), Ok(&out), "converting twice changed the result");
        let again = result::convert(via_latest.as_ref().expect("direct conversion worked"), to);
        assert_eq!(again.as_ref(), Ok(&out), "{to} via {} differs", Version::LATEST);
        let _ = result::addresses(&out);
    }
});
