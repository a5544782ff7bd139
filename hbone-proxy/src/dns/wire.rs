//! The DNS forwarder's wire parser: the few parts of a DNS message (RFC 1035, RFC 6891) the forwarder reads or
//! changes. Every other byte is relayed as it came.
//!
//! What it reads: the header (the id, the QR flag and the four section counts), where each name ends, where the
//! question section ends, and where the OPT record's UDP payload size is. What it changes: the id, the OPT
//! record's payload size (lowered, never raised), and, to make an answer, the header's flags and counts with the
//! message cut after its question.
//!
//! Guarantees, for any bytes at all (fuzzed by `fuzz/fuzz_targets/dns_messages.rs`):
//! - No function panics, and none loops longer than the message is long: each step consumes at least one byte.
//! - Every offset returned lies inside the message: a name's or the question section's end is at most its length,
//!   and the OPT payload size's two bytes are in the message, right after the OPT type.
//! - A message shorter than [`HEADER_LEN`] has no id, counts or question: those functions return `None`.
//! - [`servfail`] keeps the query's id, opcode, RD and CD flags, its counts and every byte after the header.
//! - [`fit_udp_answer`] returns the answer unchanged when it fits, otherwise at most `limit` bytes (for a `limit` of
//!   at least [`HEADER_LEN`]) of its header and question, with TC set and no records, and the same id.
//! - [`udp_answer_limit`] is between [`MIN_UDP_PAYLOAD`] and [`MAX_UDP_PAYLOAD`], and
//!   [`clamp_edns_payload_size`] leaves it as it was.
//!
//! Hand-written rather than `hickory-proto` (which ztunnel uses): this module reads the header, the question's end
//! and the OPT payload size and nothing else, in under 200 lines without a dependency, where hickory would add a
//! dependency tree and a full message model that decodes and re-encodes what the forwarder relays untouched.

/// Size of the DNS message header.
pub const HEADER_LEN: usize = 12;
/// The largest UDP message relayed either way, and the largest query taken over any transport. A query's larger
/// EDNS0 UDP payload size is lowered to it, so upstreams do not send more.
pub const MAX_UDP_PAYLOAD: usize = 4096;
/// The UDP answer size every client takes (RFC 1035), and the least an EDNS0 payload size means (RFC 6891).
pub const MIN_UDP_PAYLOAD: usize = 512;
/// RCODE of SERVFAIL.
pub const RCODE_SERVFAIL: u8 = 2;
/// The QR (response) flag in header byte 2.
pub const FLAG_QR: u8 = 0x80;
/// The TC (truncated) flag in header byte 2.
pub const FLAG_TC: u8 = 0x02;
/// The type of the EDNS0 OPT pseudo-record.
pub const TYPE_OPT: u16 = 41;
/// A name has at most 127 labels (255 bytes); a longer one is not a name.
const MAX_LABELS: usize = 128;

/// The four counts of the header, each the 16-bit field at its offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Section {
    /// QDCOUNT: the question section.
    Question = 4,
    /// ANCOUNT: the answer section.
    Answer = 6,
    /// NSCOUNT: the authority section.
    Authority = 8,
    /// ARCOUNT: the additional section (where the OPT record is).
    Additional = 10,
}

fn u16_at(message: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes(message.get(at..at.checked_add(2)?)?.try_into().ok()?))
}

/// The transaction id of `message`; `None` when it is shorter than a header.
pub fn id_of(message: &[u8]) -> Option<u16> {
    (message.len() >= HEADER_LEN).then(|| u16::from_be_bytes([message[0], message[1]]))
}

/// Sets the transaction id of `message`; `false` (and nothing changed) when it is shorter than a header.
pub fn set_id(message: &mut [u8], id: u16) -> bool {
    if message.len() < HEADER_LEN {
        return false;
    }
    message[..2].copy_from_slice(&id.to_be_bytes());
    true
}

/// The number of records `message`'s header counts in `section`; `None` when it is shorter than a header.
pub fn header_count(message: &[u8], section: Section) -> Option<usize> {
    if message.len() < HEADER_LEN {
        return None;
    }
    u16_at(message, section as usize).map(usize::from)
}

/// Whether `message` is a response: a full header with QR set.
pub fn is_response(message: &[u8]) -> bool {
    message.len() >= HEADER_LEN && message[2] & FLAG_QR != 0
}

/// Where the domain name starting at `pos` ends (just past its last label or its compression pointer, which is
/// not followed); `None` when it runs off the message or uses a reserved label type. The end is after `pos` and
/// at most `message.len()`.
pub fn name_end(message: &[u8], mut pos: usize) -> Option<usize> {
    for _ in 0..MAX_LABELS {
        let len = *message.get(pos)?;
        match len & 0xc0 {
            0x00 if len == 0 => return Some(pos + 1),
            0x00 => pos += 1 + usize::from(len),
            0xc0 => return message.get(pos + 1).map(|_| pos + 2),
            _ => return None,
        }
    }
    None
}

/// Where the question section of `message` ends: at least [`HEADER_LEN`], at most `message.len()`. `None` when
/// the message is shorter than a header or its question section does not parse.
pub fn question_end(message: &[u8]) -> Option<usize> {
    let mut pos = HEADER_LEN;
    // Each question takes at least 5 bytes, so a short message ends this loop early, whatever QDCOUNT says.
    for _ in 0..header_count(message, Section::Question)? {
        pos = name_end(message, pos)? + 4;
    }
    (pos <= message.len()).then_some(pos)
}

/// The question section of `message` (empty when it does not parse, or the message is shorter than a header).
pub fn question_of(message: &[u8]) -> &[u8] {
    question_end(message).map_or(&[], |end| &message[HEADER_LEN..end])
}

/// Whether `answer` echoes `question` (a query's [`question_of`]): the same question section, names compared
/// case-insensitively. An answer without a question (as some error answers are) echoes any, and so does every
/// answer when the query's question did not parse (`question` empty).
pub fn echoes(answer: &[u8], question: &[u8]) -> bool {
    header_count(answer, Section::Question) == Some(0)
        || question.is_empty()
        || question_of(answer).eq_ignore_ascii_case(question)
}

/// The offset of the OPT record's CLASS field (the requestor's UDP payload size) in `message`: the first record
/// of type OPT in the additional section. `None` without one, or when the message does not parse that far. The
/// field's two bytes are inside the message, right after the OPT type.
pub fn opt_payload_size_at(message: &[u8]) -> Option<usize> {
    let mut pos = question_end(message)?;
    let additional_from = header_count(message, Section::Answer)? + header_count(message, Section::Authority)?;
    // Each record takes at least 11 bytes, so a short message ends this loop early, whatever the counts say.
    for index in 0..additional_from + header_count(message, Section::Additional)? {
        let fixed = name_end(message, pos)?;
        let rr = message.get(fixed..fixed + 10)?;
        if index >= additional_from && u16::from_be_bytes([rr[0], rr[1]]) == TYPE_OPT {
            return Some(fixed + 2);
        }
        pos = fixed + 10 + usize::from(u16::from_be_bytes([rr[8], rr[9]]));
    }
    None
}

/// The EDNS0 UDP payload size `message`'s OPT record states, as it is (not clamped); `None` without one.
pub fn edns_payload_size(message: &[u8]) -> Option<u16> {
    u16_at(message, opt_payload_size_at(message)?)
}

/// The largest UDP answer the client of `query` takes: its EDNS0 UDP payload size (at least [`MIN_UDP_PAYLOAD`]),
/// at most [`MAX_UDP_PAYLOAD`]; [`MIN_UDP_PAYLOAD`] without EDNS.
pub fn udp_answer_limit(query: &[u8]) -> usize {
    let size = edns_payload_size(query).map(usize::from);
    size.unwrap_or(MIN_UDP_PAYLOAD).clamp(MIN_UDP_PAYLOAD, MAX_UDP_PAYLOAD)
}

/// Lowers the EDNS0 UDP payload size of `query` to [`MAX_UDP_PAYLOAD`] when it is larger, so the upstream does not
/// answer with more than the forwarder relays. Changes those two bytes at most.
pub fn clamp_edns_payload_size(query: &mut [u8]) {
    if let Some(at) = opt_payload_size_at(query) {
        if usize::from(u16::from_be_bytes([query[at], query[at + 1]])) > MAX_UDP_PAYLOAD {
            query[at..at + 2].copy_from_slice(&(MAX_UDP_PAYLOAD as u16).to_be_bytes());
        }
    }
}

/// The SERVFAIL answer to `query`: a copy of it with QR set, RCODE 2, OPCODE, RD and CD kept and every other flag
/// cleared. `None` when `query` is shorter than a header (there is no id to answer to).
pub fn servfail(query: &[u8]) -> Option<Vec<u8>> {
    if query.len() < HEADER_LEN {
        return None;
    }
    let mut answer = query.to_vec();
    // Byte 2: QR | OPCODE(4) | AA | TC | RD. Keep OPCODE and RD, set QR, clear AA and TC.
    answer[2] = (answer[2] & 0x79) | FLAG_QR;
    // Byte 3: RA | Z | AD | CD | RCODE(4). Keep CD.
    answer[3] = (answer[3] & 0x10) | RCODE_SERVFAIL;
    Some(answer)
}

/// `answer` as a UDP client taking at most `limit` bytes may get it: unchanged when it fits (or is shorter than a
/// header), otherwise its header and question with TC set and no records (the header alone, QDCOUNT 0, when the
/// question does not fit or parse), so the client asks again over TCP. A cut answer is at most
/// `limit.max(HEADER_LEN)` bytes long and keeps the id, the other flags and RCODE.
pub fn fit_udp_answer(answer: Vec<u8>, limit: usize) -> Vec<u8> {
    if answer.len() <= limit || answer.len() < HEADER_LEN {
        return answer;
    }
    let end = question_end(&answer).filter(|end| *end <= limit);
    let mut cut = answer[..end.unwrap_or(HEADER_LEN)].to_vec();
    cut[2] |= FLAG_TC;
    if end.is_none() {
        cut[4..6].fill(0);
    }
    cut[6..HEADER_LEN].fill(0);
    cut
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A query for `example.com. A` with id 0xbeef, RD and CD set, and an EDNS OPT record (payload size 1232).
    fn query() -> Vec<u8> {
        let mut q = vec![0xbe, 0xef, 0x01, 0x10, 0, 1, 0, 0, 0, 0, 0, 1];
        q.extend_from_slice(b"\x07example\x03com\x00\x00\x01\x00\x01");
        q.extend_from_slice(&[0, 0, 41, 0x04, 0xd0, 0, 0, 0, 0, 0, 0]);
        q
    }

    /// `query()` with the OPT record's UDP payload size set to `size`.
    fn query_with_edns(size: u16) -> Vec<u8> {
        let mut q = query();
        let at = q.len() - 11 + 3;
        q[at..at + 2].copy_from_slice(&size.to_be_bytes());
        q
    }

    /// `query()` without its OPT record.
    fn query_without_edns() -> Vec<u8> {
        let mut q = query();
        q.truncate(q.len() - 11);
        q[11] = 0;
        q
    }

    /// An answer to `query` (its question echoed, id `id`) with one A record whose data is `rdata_len` bytes.
    fn answer_to(query: &[u8], id: u16, rdata_len: u16) -> Vec<u8> {
        let end = question_end(query).unwrap();
        let mut a = id.to_be_bytes().to_vec();
        a.extend_from_slice(&[0x81, 0x80, 0, 1, 0, 1, 0, 0, 0, 0]);
        a.extend_from_slice(&query[HEADER_LEN..end]);
        a.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 60]);
        a.extend_from_slice(&rdata_len.to_be_bytes());
        a.extend(std::iter::repeat_n(7, usize::from(rdata_len)));
        a
    }

    #[test]
    fn servfail_answers_the_query_with_rcode_2() {
        let q = query();
        let answer = servfail(&q).expect("a full header");
        assert_eq!(answer[..2], [0xbe, 0xef], "same transaction id");
        assert_eq!(answer[2], 0x81, "QR set, OPCODE QUERY, RD kept");
        assert_eq!(answer[3], 0x12, "CD kept, RCODE SERVFAIL");
        assert_eq!(answer[4..], q[4..], "counts and question echoed unchanged");
    }

    #[test]
    fn servfail_clears_flags_a_query_should_not_carry() {
        let mut q = query();
        q[2] = 0x7f; // every flag but QR in byte 2
        q[3] = 0xff;
        let answer = servfail(&q).expect("a full header");
        assert_eq!(answer[2], 0xf9, "QR and OPCODE/RD set, AA and TC cleared");
        assert_eq!(answer[3], 0x12, "RA, Z, AD cleared; CD kept; RCODE 2");
    }

    #[test]
    fn servfail_needs_a_header() {
        assert_eq!(servfail(&[0xbe, 0xef, 1]), None);
    }

    #[test]
    fn udp_answer_limit_is_the_edns_size_between_512_and_4_kib() {
        assert_eq!(udp_answer_limit(&query()), 1232, "the OPT record's payload size");
        assert_eq!(udp_answer_limit(&query_without_edns()), 512, "512 without EDNS");
        assert_eq!(udp_answer_limit(&query_with_edns(100)), 512, "sizes below 512 mean 512");
        assert_eq!(udp_answer_limit(&query_with_edns(65535)), MAX_UDP_PAYLOAD, "at most 4 KiB");
        let mut garbled = query();
        garbled.truncate(20);
        assert_eq!(udp_answer_limit(&garbled), 512, "a question that does not parse: 512");
    }

    #[test]
    fn a_larger_edns_size_is_lowered_to_4_kib_and_others_left_alone() {
        let mut q = query_with_edns(65535);
        clamp_edns_payload_size(&mut q);
        assert_eq!(q, query_with_edns(4096));
        let mut q = query();
        clamp_edns_payload_size(&mut q);
        assert_eq!(q, query(), "1232 is kept");
        let mut q = query_without_edns();
        clamp_edns_payload_size(&mut q);
        assert_eq!(q, query_without_edns(), "no OPT record, nothing changed");
    }

    #[test]
    fn the_opt_record_is_found_after_answer_records() {
        let q = query();
        let mut message = answer_to(&q, 1, 40);
        message[11] = 1; // ARCOUNT
        message.extend_from_slice(&[0, 0, 41, 0x02, 0x00, 0, 0, 0, 0, 0, 0]);
        assert_eq!(udp_answer_limit(&message), 512);
        let at = opt_payload_size_at(&message).expect("the OPT record");
        assert_eq!(message[at..at + 2], [0x02, 0x00]);
    }

    #[test]
    fn an_answer_too_long_for_the_client_is_cut_to_its_question_with_tc() {
        let q = query();
        let fits = answer_to(&q, 0xbeef, 100);
        assert_eq!(fit_udp_answer(fits.clone(), 512), fits, "an answer that fits is relayed unchanged");
        let long = answer_to(&q, 0xbeef, 600);
        let cut = fit_udp_answer(long.clone(), 512);
        assert_eq!(cut.len(), question_end(&q).unwrap(), "header and question only");
        assert_eq!(cut[..2], [0xbe, 0xef], "same id");
        assert_eq!(cut[2], long[2] | FLAG_TC, "TC set, other flags kept");
        assert_eq!(cut[3], long[3], "RCODE kept");
        assert_eq!(cut[4..6], [0, 1], "the question is kept");
        assert_eq!(cut[6..12], [0; 6], "no records");
        assert_eq!(cut[HEADER_LEN..], q[HEADER_LEN..question_end(&q).unwrap()]);
        let mut upstream_tc = fits.clone();
        upstream_tc[2] |= FLAG_TC;
        assert_eq!(fit_udp_answer(upstream_tc.clone(), 512), upstream_tc, "an upstream's TC is relayed as is");
    }

    #[test]
    fn an_answer_echoes_its_question_case_insensitively_or_none() {
        let q = query();
        let question = question_of(&q);
        let mut answer = answer_to(&q, 1, 4);
        assert!(echoes(&answer, question));
        answer[HEADER_LEN + 1..HEADER_LEN + 8].make_ascii_uppercase();
        assert!(echoes(&answer, question), "names compare case-insensitively");
        answer[HEADER_LEN + 1] = b'X';
        assert!(!echoes(&answer, question), "another name");
        assert!(echoes(&answer, &[]), "a query whose question did not parse takes any");
        answer[5] = 0;
        assert!(echoes(&answer, question), "an answer without a question");
        assert!(!echoes(&answer[..5], question), "not even a header");
    }

    #[test]
    fn short_messages_have_no_header_fields() {
        for len in 0..HEADER_LEN {
            let mut message = vec![0xff; len];
            assert_eq!(id_of(&message), None);
            assert!(!set_id(&mut message, 1));
            assert_eq!(header_count(&message, Section::Question), None);
            assert_eq!(question_end(&message), None);
            assert!(!is_response(&message));
            assert_eq!(udp_answer_limit(&message), MIN_UDP_PAYLOAD);
        }
    }

    #[test]
    fn names_end_inside_the_message() {
        let message = b"\x03www\x07example\x03com\x00";
        assert_eq!(name_end(message, 0), Some(message.len()));
        assert_eq!(name_end(b"\xc0\x0c", 0), Some(2), "a pointer is not followed");
        assert_eq!(name_end(b"\xc0", 0), None, "a pointer cut short");
        assert_eq!(name_end(b"\x03ww", 0), None, "a label running off the message");
        assert_eq!(name_end(b"\x40\x00", 0), None, "a reserved label type");
        assert_eq!(name_end(&[1; 300], 0), None, "more labels than a name has");
    }
}
