//! ZDS datagrams as each side decodes them: the agent reads the proxy's hello and acks, the proxy reads the
//! agent's requests.
//! Invariants: whatever decodes re-encodes to exactly `encoded_len` bytes that decode to the same message,
//! and re-encoding grows a datagram by a few bytes at most (only a short varint of a negative enum grows).

#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message;
use zds::messages::{WorkloadRequest, WorkloadResponse, ZdsHello};

fn round_trips<M: Message + Default + PartialEq + std::fmt::Debug>(data: &[u8]) {
    let Ok(msg) = M::decode(data) else { return };
    let bytes = msg.encode_to_vec();
    assert_eq!(bytes.len(), msg.encoded_len());
    assert_eq!(M::decode(&bytes[..]).as_ref(), Ok(&msg), "re-encoded message decodes differently");
    assert!(bytes.len() <= data.len() + 16, "{} bytes re-encode to {}", data.len(), bytes.len());
}

fuzz_target!(|data: &[u8]| {
    round_trips::<ZdsHello>(data);
    round_trips::<WorkloadResponse>(data);
    round_trips::<WorkloadRequest>(data);
});
