//! The checks every value passes before it may reach a rule: what they accept (everything Istio's goldens and
//! users write) and what they refuse (injection, truncation, out-of-range numbers).

use std::collections::BTreeMap;

use super::*;

#[test]
fn interface_names_are_what_the_kernel_accepts_and_one_word() {
    for ok in ["eth0", "not-istio-nic", "fake1s0f0", "a", "eth0.100", "eth0:1", "veth@if3", "br_int", "abcdefghijklmno"]
    {
        assert_eq!(interface_name(ok), Ok(ok), "{ok}");
    }
    for bad in [
        "",
        "eth9\n-I OUTPUT -j ACCEPT",
        "eth0 -j ACCEPT",
        "eth0\t",
        "eth\r0",
        "eth+",
        "eth0!",
        "eth\"0",
        "eth'0",
        "eth0#",
        "eth/0",
        "eth0,eth1",
        "eth\u{0}0",
        "ethé",
        "eth0;",
    ] {
        let err = interface_name(bad).unwrap_err();
        assert_eq!((err.what, err.value.as_str()), ("interface name", bad));
    }
}

#[test]
fn a_16_byte_interface_name_is_refused_not_truncated() {
    let err = interface_name("abcdefghijklmnop").unwrap_err();
    assert!(err.why.contains("16 bytes") && err.why.contains("15"), "{err}");
    assert_eq!(interface_name("abcdefghijklmno"), Ok("abcdefghijklmno"), "15 bytes is the kernel's limit");
}

#[test]
fn interface_lists_are_trimmed_and_every_item_is_checked() {
    assert_eq!(interface_list(" eth1, eth2 ,,").unwrap(), ["eth1", "eth2"]);
    assert_eq!(interface_list("").unwrap(), Vec::<String>::new());
    assert_eq!(interface_list("eth0\n").unwrap(), ["eth0"], "a trailing newline (YAML block scalar) is whitespace");
    let err = interface_list("eth0,eth9\n-I OUTPUT -j ACCEPT").unwrap_err();
    assert_eq!(err.value, "eth9\n-I OUTPUT -j ACCEPT");
}

#[test]
fn ports_are_1_to_65535_in_plain_decimal() {
    assert_eq!(port("1"), Ok(1));
    assert_eq!(port("65535"), Ok(65535));
    assert_eq!(port_list("15020,15021, 15090,").unwrap(), [15020, 15021, 15090]);
    for bad in ["0", "65536", "99999", "-1", "+80", "80-90", "http", "", " 80", "8\n0", "0x50", "1e3"] {
        assert_eq!(port(bad).unwrap_err().what, "port", "{bad:?}");
    }
    assert!(port("0").unwrap_err().why.contains("0"), "port 0 says why");
    assert!(port_list("80,0").is_err());
}

#[test]
fn cidrs_and_bare_addresses_are_ranges() {
    assert_eq!(cidr("10.0.0.0/8").unwrap().to_string(), "10.0.0.0/8");
    assert_eq!(cidr("127.0.0.1/8").unwrap().to_string(), "127.0.0.1/8", "host bits are kept, as Istio writes them");
    assert_eq!(cidr("2001:db8::/32").unwrap().to_string(), "2001:db8::/32");
    assert_eq!(cidr("10.1.2.3").unwrap().to_string(), "10.1.2.3/32");
    assert_eq!(cidr("::1").unwrap().to_string(), "::1/128");
    for bad in ["10.0.0.0/33", "not-a-cidr", "10.0.0.0/8\n-j ACCEPT", "10.0.0.0 /8", "", "10.0.0/8"] {
        assert_eq!(cidr(bad).unwrap_err().what, "CIDR", "{bad:?}");
    }
    assert_eq!(cidr_list("10.0.0.0/8, 2001:db8::/32").unwrap().len(), 2);
}

#[test]
fn owner_ids_are_u32_without_the_reserved_minus_one() {
    assert_eq!(owner_id(0), Ok(0));
    assert_eq!(owner_id(1_000_670_000), Ok(1_000_670_000));
    assert_eq!(owner_id(4_294_967_294), Ok(4_294_967_294));
    for bad in [-1, i64::MIN, 4_294_967_295, 4_294_967_296, i64::MAX] {
        assert!(owner_id(bad).is_err(), "{bad}");
    }
}

#[test]
fn identifiers_are_one_word_within_their_tools_limit() {
    assert_eq!(identifier("ISTIO_OUTPUT", MAX_IPTABLES_CHAIN), Ok("ISTIO_OUTPUT"));
    assert_eq!(identifier("istio-inpod-probes-v4", MAX_IPSET_NAME), Ok("istio-inpod-probes-v4"));
    assert_eq!(identifier("java", MAX_NFT_NAME), Ok("java"));
    for bad in ["", "-j", ".x", "a b", "a\nb", "a:b", "ISTIO\n-A", "x!"] {
        assert!(identifier(bad, MAX_NFT_NAME).is_err(), "{bad:?}");
    }
    assert!(identifier(&"A".repeat(29), MAX_IPTABLES_CHAIN).is_err());
    assert!(identifier(&"A".repeat(28), MAX_IPTABLES_CHAIN).is_ok());
}

#[test]
fn an_annotation_error_names_the_annotation_and_its_whole_value() {
    let annotations = BTreeMap::from([("a/b".to_owned(), "eth0,eth9\n-I OUTPUT -j ACCEPT".to_owned())]);
    let err = interfaces(&annotations, "a/b").unwrap_err();
    assert_eq!(err.annotation(), Some("a/b"));
    assert_eq!(err.value, "eth0,eth9\n-I OUTPUT -j ACCEPT");
    let text = err.to_string();
    assert!(text.starts_with("invalid annotation a/b="), "{text}");
    assert!(!text.contains('\n'), "the message is one line: {text}");
    assert_eq!(interfaces(&annotations, "absent").unwrap(), Vec::<String>::new());
}
