//! The one walk over a received datagram's netlink messages (`netns::netlink::messages`), which every reader of
//! the kernel's answers uses (address dumps, nf_tables and ipset dumps, batch acknowledgements).
//!
//! Invariants, besides no panic:
//! - every message it yields starts at the offset where the previous one ended, rounded up to 4 bytes, lies
//!   wholly inside the datagram, and its header's length field is its payload's length plus the header's;
//! - so the walk yields at most one message per 16 bytes and ends;
//! - where it stopped, either fewer bytes than a header are left (not malformed), or the length field found
//!   there is smaller than a header or runs past the datagram (malformed), and a malformed walk stays ended;
//! - a message has an errno exactly when it is an `NLMSG_ERROR` with room for its code.

#![no_main]

use libfuzzer_sys::fuzz_target;
use netns::netlink::messages;
use netns::netlink::uapi::{NLMSG_ALIGNTO, NLMSG_ERROR, NLMSG_HDRLEN};

fn length_at(data: &[u8], at: usize) -> usize {
    u32::from_ne_bytes(data[at..at + 4].try_into().unwrap()) as usize
}

fuzz_target!(|data: &[u8]| {
    let base = data.as_ptr() as usize;
    let mut walk = messages(data);
    let mut at = 0;
    let mut count = 0;
    for message in walk.by_ref() {
        let start = message.payload.as_ptr() as usize - base - NLMSG_HDRLEN;
        assert_eq!(start, at, "message {count} does not start where the previous one ended");
        let end = start + NLMSG_HDRLEN + message.payload.len();
        assert!(end <= data.len(), "message {count} runs past the datagram");
        assert_eq!(length_at(data, start), NLMSG_HDRLEN + message.payload.len());
        let ty = u16::from_ne_bytes(data[start + 4..start + 6].try_into().unwrap());
        assert_eq!(message.ty, ty);
        assert_eq!(message.errno().is_some(), ty == NLMSG_ERROR && message.payload.len() >= 4);
        at = end.next_multiple_of(NLMSG_ALIGNTO).min(data.len());
        count += 1;
    }
    assert!(count <= data.len() / NLMSG_HDRLEN, "{count} messages in {} bytes", data.len());
    let left = data.len() - at;
    if walk.malformed() {
        assert!(left >= NLMSG_HDRLEN, "malformed without a header left");
        let len = length_at(data, at);
        assert!(len < NLMSG_HDRLEN || len > left, "a well-formed length {len} with {left} bytes left ended the walk");
        assert!(walk.next().is_none() && walk.malformed(), "a malformed walk went on");
    } else {
        assert!(left < NLMSG_HDRLEN, "the walk ended with {left} bytes left and no malformed header");
    }
});
