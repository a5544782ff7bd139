//! What istiod sends, as the xDS client decodes it: the first byte picks the input's kind, the rest is the bytes.
//! 0: a DeltaDiscoveryResponse, each of its resources decoded as both types, its fields counted as the client
//! does before decoding; 1/2: an Address/Authorization body,
//! named by the key its content gives (so validation, not just the name check, runs); 3: a gRPC body split into
//! messages.
//! Invariants: no panic; a resource over the size limit is rejected whatever its bytes; an accepted resource
//! re-encodes to bytes that decode to the same message; the frame decoder only yields messages within its limit
//! and never more bytes than it was given.

#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message;
use xds::grpc::FrameDecoder;
use xds::wire::scan::count_fields;
use xds::wire::security::Authorization;
use xds::wire::workload::{address, Address};
use xds::wire::{decode_resource, Any, DecodedResource, DeltaDiscoveryResponse, Resource, ResourceError, ResourceType};

const MAX: usize = 4096;

fn check(ty: ResourceType, resource: &Resource) {
    let result = decode_resource(ty, resource, MAX);
    if let Some(any) = &resource.resource {
        if any.value.len() > MAX && !resource.name.is_empty() && any.type_url == ty.type_url() {
            assert!(matches!(result, Err(ResourceError::TooLarge { .. })), "{result:?}");
        }
    }
    match result {
        Ok(DecodedResource::Address(a)) => {
            assert_eq!(Address::decode(&a.encode_to_vec()[..]).as_ref(), Ok(&a));
        }
        Ok(DecodedResource::Authorization(p)) => {
            assert_eq!(Authorization::decode(&p.encode_to_vec()[..]).as_ref(), Ok(&p));
            assert_eq!(resource.name, format!("{}/{}", p.namespace, p.name));
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
}

fn wrap(ty: ResourceType, name: String, value: &[u8]) -> Resource {
    Resource {
        name,
        version: "v".into(),
        resource: Some(Any { type_url: ty.type_url().into(), value: value.to_vec() }),
        aliases: vec![],
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&kind, body)) = data.split_first() else { return };
    match kind % 4 {
        0 => {
            let counts = count_fields(body, [2, 6]);
            let Ok(response) = DeltaDiscoveryResponse::decode(body) else { return };
            // The pre-decode count the client limits on agrees with what prost decodes (when both succeed).
            if let Ok(counts) = counts {
                assert_eq!(counts, [response.resources.len(), response.removed_resources.len()]);
            }
            for resource in &response.resources {
                check(ResourceType::Address, resource);
                check(ResourceType::Authorization, resource);
            }
        }
        1 => {
            let name = match Address::decode(body).ok().and_then(|a| a.r#type) {
                Some(address::Type::Workload(w)) => w.uid,
                Some(address::Type::Service(s)) => format!("{}/{}", s.namespace, s.hostname),
                None => "x".into(),
            };
            check(ResourceType::Address, &wrap(ResourceType::Address, name, body));
        }
        2 => {
            let name = Authorization::decode(body).map(|p| format!("{}/{}", p.namespace, p.name)).unwrap_or_default();
            check(ResourceType::Authorization, &wrap(ResourceType::Authorization, name, body));
        }
        _ => {
            let mut decoder = FrameDecoder::new(64);
            let mut yielded = 0;
            for chunk in body.chunks(7) {
                decoder.push(chunk);
                while let Ok(Some(message)) = decoder.next_message() {
                    assert!(message.len() <= 64);
                    yielded += message.len() + 5;
                }
            }
            assert!(yielded <= body.len());
        }
    }
});
