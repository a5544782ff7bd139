//! What istiod's CA returns, as the CA client checks it: the first byte picks the input's kind, the rest is the
//! bytes. 0: a serialized IstioCertificateResponse, decoded with its elements counted first, then its chain
//! verified; 1: the chain itself, elements separated by NUL bytes.
//! Invariants: no panic; a response holding more chain elements than the limit is refused as such before
//! decoding; a chain over the limits is refused; a chain that is accepted names the identity and has a leaf and a
//! root (random input cannot forge the CA's signature, so in practice nothing is accepted).

#![no_main]

use std::time::{Duration, UNIX_EPOCH};

use hbone::identity::Identity;
use libfuzzer_sys::fuzz_target;
use mesh_ca::chain::{decode_response, verify_chain, ChainError, Limits};
use xds::wire::scan::count_fields;

fn limits() -> Limits {
    Limits { max_elements: 8, max_element_bytes: 8 * 1024, max_bundle_bytes: 32 * 1024, max_roots: 8 }
}

fn verify(chain: &[String]) {
    let identity: Identity = "spiffe://cluster.local/ns/default/sa/bookinfo".parse().unwrap();
    let limits = limits();
    let now = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
    match verify_chain(chain, &identity, &[4u8; 65], now, &limits) {
        Ok(verified) => {
            assert!(!verified.chain.is_empty() && !verified.roots.is_empty());
            assert!(verified.roots.len() <= limits.max_roots);
        }
        Err(ChainError::TooManyElements { count, max }) => assert!(count > max && chain.len() == count),
        Err(e) => {
            let _ = e.to_string();
            if chain.len() > limits.max_elements {
                panic!("{} elements not refused for their count: {e}", chain.len());
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&kind, bytes)) = data.split_first() else { return };
    match kind % 2 {
        0 => {
            let limits = limits();
            match decode_response(bytes, &limits) {
                Ok(response) => {
                    assert!(response.cert_chain.len() <= limits.max_elements);
                    verify(&response.cert_chain);
                }
                Err(ChainError::TooManyElements { count, .. }) => {
                    assert_eq!(count_fields(bytes, [1]).unwrap()[0], count);
                }
                Err(e) => {
                    let _ = e.to_string();
                }
            }
        }
        _ => {
            let chain: Vec<String> =
                bytes.split(|b| *b == 0).map(|part| String::from_utf8_lossy(part).into_owned()).collect();
            verify(&chain);
        }
    }
});
