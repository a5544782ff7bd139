//! hbone-proxy's DNS wire parser (`hbone_proxy::dns::wire`), over a query from a pod and an upstream's answer to
//! it, as the forwarder runs it: the query's UDP answer limit, its EDNS0 size lowered, its SERVFAIL; the answer
//! taken (a response echoing the query's question), given the client's id back and fitted to the limit.
//!
//! Input: a 2-byte UDP limit, a 2-byte query length, then the query and the answer (the rest).
//!
//! Invariants, on the query and the answer alike, and on the whole input as one message:
//! - every offset the parser returns lies inside the message (a name's end, the question's end, the OPT payload
//!   size's two bytes, which follow the OPT type), and a message shorter than a header has no id, counts or
//!   question;
//! - the answer limit is between 512 and 4096, and lowering the EDNS0 size changes those two bytes alone, to at
//!   most 4096, and leaves the limit as it was;
//! - a SERVFAIL keeps the query's id, opcode, RD, CD and every byte after the header, is a response with RCODE 2,
//!   echoes the query's question, and still does when fitted to the limit;
//! - a fitted answer never exceeds its limit (any limit of at least a header): it is the answer unchanged when it
//!   fits, otherwise its header (same id, TC set, flags and RCODE kept, no records) and, when that fits, its
//!   question unchanged; what is cut parses to its end.

#![no_main]

use hbone_proxy::dns::wire::{self, Section, FLAG_QR, FLAG_TC, HEADER_LEN, MAX_UDP_PAYLOAD, MIN_UDP_PAYLOAD};
use libfuzzer_sys::fuzz_target;

const SECTIONS: [Section; 4] = [Section::Question, Section::Answer, Section::Authority, Section::Additional];

fn be16(bytes: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([bytes[at], bytes[at + 1]])
}

/// The parser's reading of any message: every offset inside it, the header fields where there is a header.
fn offsets_stay_inside(m: &[u8]) {
    let full = m.len() >= HEADER_LEN;
    assert_eq!(wire::id_of(m), full.then(|| be16(m, 0)));
    for section in SECTIONS {
        assert_eq!(wire::header_count(m, section), full.then(|| usize::from(be16(m, section as usize))));
    }
    assert_eq!(wire::is_response(m), full && m[2] & FLAG_QR != 0);
    // Names start anywhere a pointer or a count may put them; the first and last positions cover every shape
    // (every position would make each run quadratic in the message's length).
    for pos in (0..=m.len().min(256)).chain(m.len().saturating_sub(16)..=m.len()) {
        if let Some(end) = wire::name_end(m, pos) {
            assert!(pos < end && end <= m.len(), "name at {pos} ends at {end}, message of {}", m.len());
        }
    }
    match wire::question_end(m) {
        Some(end) => {
            assert!(full && (HEADER_LEN..=m.len()).contains(&end), "question ends at {end} of {}", m.len());
            assert_eq!(wire::question_of(m), &m[HEADER_LEN..end]);
            // As many names as QDCOUNT says, each followed by type and class, end to end.
            let mut pos = HEADER_LEN;
            for _ in 0..be16(m, 4) {
                pos = wire::name_end(m, pos).expect("a question's name") + 4;
            }
            assert_eq!(pos, end);
            assert!(wire::echoes(m, wire::question_of(m)), "a message echoes its own question");
        }
        None => assert!(wire::question_of(m).is_empty()),
    }
    match wire::opt_payload_size_at(m) {
        Some(at) => {
            let question_end = wire::question_end(m).expect("the OPT record follows a question section");
            assert!(at >= question_end + 3 && at + 2 <= m.len(), "OPT size at {at}, message of {}", m.len());
            assert_eq!(be16(m, at - 2), wire::TYPE_OPT, "the payload size follows the OPT type");
            assert_eq!(wire::edns_payload_size(m), Some(be16(m, at)));
        }
        None => assert_eq!(wire::edns_payload_size(m), None),
    }
    let limit = wire::udp_answer_limit(m);
    assert!((MIN_UDP_PAYLOAD..=MAX_UDP_PAYLOAD).contains(&limit));
    if let Some(size) = wire::edns_payload_size(m) {
        assert_eq!(limit, usize::from(size).clamp(MIN_UDP_PAYLOAD, MAX_UDP_PAYLOAD));
    }

    let mut clamped = m.to_vec();
    wire::clamp_edns_payload_size(&mut clamped);
    assert_eq!(wire::opt_payload_size_at(&clamped), wire::opt_payload_size_at(m), "the OPT record stays put");
    assert_eq!(wire::udp_answer_limit(&clamped), limit, "lowering the size keeps the limit");
    let changed: Vec<usize> = (0..m.len()).filter(|i| clamped[*i] != m[*i]).collect();
    if let Some(at) = wire::opt_payload_size_at(m) {
        assert!(changed.iter().all(|i| (at..at + 2).contains(i)), "only the payload size changes");
        assert!(usize::from(be16(&clamped, at)) <= MAX_UDP_PAYLOAD);
    } else {
        assert!(changed.is_empty(), "nothing changes without an OPT record");
    }

    let mut renumbered = m.to_vec();
    assert_eq!(wire::set_id(&mut renumbered, 0x1234), full);
    if full {
        assert_eq!(wire::id_of(&renumbered), Some(0x1234));
        assert_eq!(renumbered[2..], m[2..], "only the id changes");
    } else {
        assert_eq!(renumbered, m);
    }
}

/// The SERVFAIL answer to `query`.
fn servfail_keeps_the_query(query: &[u8], limit: usize) {
    let Some(answer) = wire::servfail(query) else {
        assert!(query.len() < HEADER_LEN, "a query with a header gets a SERVFAIL");
        return;
    };
    assert_eq!(answer.len(), query.len());
    assert_eq!(wire::id_of(&answer), wire::id_of(query), "a SERVFAIL keeps the query's id");
    assert_eq!(answer[2] & 0x79, query[2] & 0x79, "OPCODE and RD kept");
    assert_eq!(answer[2] & 0x86, FLAG_QR, "QR set, AA and TC cleared");
    assert_eq!(answer[3], (query[3] & 0x10) | wire::RCODE_SERVFAIL, "CD kept, RCODE 2, the rest cleared");
    assert_eq!(answer[4..], query[4..], "counts and question unchanged");
    assert!(wire::is_response(&answer) && wire::echoes(&answer, wire::question_of(query)));
    let fitted = wire::fit_udp_answer(answer.clone(), limit);
    fits(&answer, &fitted, limit);
    assert_eq!(wire::id_of(&fitted), wire::id_of(query), "a fitted SERVFAIL keeps the query's id");
    assert_eq!(fitted[3] & 0x0f, wire::RCODE_SERVFAIL);
    assert!(wire::echoes(&fitted, wire::question_of(query)), "a fitted SERVFAIL still answers the query");
}

/// `fitted` is `answer` fitted to `limit` (at least a header).
fn fits(answer: &[u8], fitted: &[u8], limit: usize) {
    if answer.len() <= limit || answer.len() < HEADER_LEN {
        assert_eq!(fitted, answer, "an answer that fits is relayed unchanged");
        return;
    }
    assert!((HEADER_LEN..=limit).contains(&fitted.len()), "{} bytes fitted to {limit}", fitted.len());
    assert_eq!(fitted[..2], answer[..2], "same id");
    assert_eq!(fitted[2], answer[2] | FLAG_TC, "TC set, the other flags kept");
    assert_eq!(fitted[3], answer[3], "RCODE kept");
    assert_eq!(fitted[6..HEADER_LEN], [0; 6], "no records");
    match wire::question_end(answer).filter(|end| *end <= limit) {
        Some(end) => {
            assert_eq!(fitted[4..6], answer[4..6], "QDCOUNT kept");
            assert_eq!(fitted[HEADER_LEN..], answer[HEADER_LEN..end], "the question kept as it was");
        }
        None => assert_eq!((fitted.len(), be16(fitted, 4)), (HEADER_LEN, 0), "the header alone"),
    }
    assert_eq!(wire::question_end(fitted), Some(fitted.len()), "what is cut parses to its end");
}

fuzz_target!(|data: &[u8]| {
    offsets_stay_inside(data);
    if data.len() < 4 {
        return;
    }
    let (head, rest) = data.split_at(4);
    // Any limit of at least a header, as well as the query's own.
    let any_limit = usize::from(be16(head, 0)).max(HEADER_LEN);
    let split = usize::from(be16(head, 2)) % (rest.len() + 1);
    let (query, answer) = rest.split_at(split);
    offsets_stay_inside(query);
    offsets_stay_inside(answer);

    // The query, as `serve_udp` and `resolve` take it.
    let limit = wire::udp_answer_limit(query);
    let mut sent = query.to_vec();
    wire::clamp_edns_payload_size(&mut sent);
    servfail_keeps_the_query(query, limit);
    servfail_keeps_the_query(&sent, limit);
    servfail_keeps_the_query(query, any_limit);

    // The answer, as `Pending::deliver` takes it and `serve_udp` relays it.
    fits(answer, &wire::fit_udp_answer(answer.to_vec(), any_limit), any_limit);
    let admitted = wire::id_of(query);
    if let Some(client_id) =
        admitted.filter(|_| wire::is_response(answer) && wire::echoes(answer, wire::question_of(&sent)))
    {
        let mut relayed = answer.to_vec();
        assert!(wire::set_id(&mut relayed, client_id));
        let fitted = wire::fit_udp_answer(relayed.clone(), limit);
        fits(&relayed, &fitted, limit);
        assert_eq!(wire::id_of(&fitted), Some(client_id), "the client gets its own id back");
    }
});
