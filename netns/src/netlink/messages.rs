//! The one walk over the netlink messages of a received datagram ([`messages`]), shared by every reader of
//! netlink answers in the workspace (rtnetlink here, nfnetlink in `redirect`).
//!
//! It guarantees that no input makes it panic, loop or read past a message: it yields each message whose length
//! field covers at least the header and fits the rest of the buffer, then skips to the next aligned offset
//! (clamped to the buffer's end); it ends at the end of the buffer, at a tail shorter than a header (ignored),
//! or at a length field smaller than the header or beyond the buffer, after which [`Messages::malformed`] says
//! so. Every step consumes at least one header, so the walk is finite.

use super::uapi::{NLMSG_ALIGNTO, NLMSG_ERROR, NLMSG_HDRLEN};

/// One netlink message: its header's fields and its payload (the bytes after the header, up to its length).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Message<'a> {
    /// `nlmsg_type`: `NLMSG_DONE`, `NLMSG_ERROR` or the family's own type.
    pub ty: u16,
    /// `nlmsg_flags`.
    pub flags: u16,
    /// `nlmsg_seq`: the request's sequence number the message answers.
    pub seq: u32,
    /// `nlmsg_pid`: the sender's port.
    pub port: u32,
    /// The payload, without the header and without the alignment padding after it.
    pub payload: &'a [u8],
}

impl Message<'_> {
    /// The errno an `NLMSG_ERROR` carries, positive (0 is an acknowledgement); `None` for any other type, or for
    /// an error message too short to hold its code.
    pub fn errno(&self) -> Option<i32> {
        if self.ty != NLMSG_ERROR {
            return None;
        }
        let code = self.payload.get(..4)?;
        Some(i32::from_ne_bytes(code.try_into().ok()?).wrapping_neg())
    }
}

/// Walks the messages of `buf` (one datagram, as the kernel sent it); see the module doc for where it ends.
pub fn messages(buf: &[u8]) -> Messages<'_> {
    Messages { rest: buf, malformed: false }
}

/// The iterator [`messages`] returns.
#[derive(Debug, Clone)]
pub struct Messages<'a> {
    rest: &'a [u8],
    malformed: bool,
}

impl Messages<'_> {
    /// Whether the walk stopped at a header whose length field was smaller than the header or larger than what
    /// was left of the buffer (the messages before it were yielded).
    pub fn malformed(&self) -> bool {
        self.malformed
    }
}

impl<'a> Iterator for Messages<'a> {
    type Item = Message<'a>;

    fn next(&mut self) -> Option<Message<'a>> {
        let header = self.rest.get(..NLMSG_HDRLEN)?;
        let word = |at: usize| u32::from_ne_bytes(header[at..at + 4].try_into().expect("4 bytes"));
        let half = |at: usize| u16::from_ne_bytes(header[at..at + 2].try_into().expect("2 bytes"));
        let len = word(0) as usize;
        if len < NLMSG_HDRLEN || len > self.rest.len() {
            self.rest = &[];
            self.malformed = true;
            return None;
        }
        let message = Message {
            ty: half(4),
            flags: half(6),
            seq: word(8),
            port: word(12),
            payload: &self.rest[NLMSG_HDRLEN..len],
        };
        let next = len.next_multiple_of(NLMSG_ALIGNTO).min(self.rest.len());
        self.rest = &self.rest[next..];
        Some(message)
    }
}

#[cfg(test)]
mod tests {
    use super::super::uapi::NLMSG_DONE;
    use super::*;

    /// A message of type `ty` and sequence `seq` whose length field says `len` (the real length if `None`),
    /// padded to the alignment.
    fn message(ty: u16, seq: u32, payload: &[u8], len: Option<u32>) -> Vec<u8> {
        let mut m = Vec::new();
        m.extend_from_slice(&len.unwrap_or((NLMSG_HDRLEN + payload.len()) as u32).to_ne_bytes());
        m.extend_from_slice(&ty.to_ne_bytes());
        m.extend_from_slice(&0x2u16.to_ne_bytes());
        m.extend_from_slice(&seq.to_ne_bytes());
        m.extend_from_slice(&77u32.to_ne_bytes());
        m.extend_from_slice(payload);
        m.resize(m.len().next_multiple_of(NLMSG_ALIGNTO), 0);
        m
    }

    fn walk(buf: &[u8]) -> (Vec<(u16, u32, Vec<u8>)>, bool) {
        let mut it = messages(buf);
        let seen = it.by_ref().map(|m| (m.ty, m.seq, m.payload.to_vec())).collect();
        (seen, it.malformed())
    }

    #[test]
    fn several_messages_are_yielded_in_order_with_their_fields() {
        let buf =
            [message(20, 1, b"abcd", None), message(21, 2, b"", None), message(NLMSG_DONE, 3, &[0; 4], None)].concat();
        let all: Vec<Message<'_>> = messages(&buf).collect();
        assert_eq!(all.len(), 3);
        assert_eq!(all[0], Message { ty: 20, flags: 2, seq: 1, port: 77, payload: b"abcd" });
        assert_eq!((all[1].ty, all[1].payload), (21, &b""[..]));
        assert_eq!((all[2].ty, all[2].seq), (NLMSG_DONE, 3));
        let (_, malformed) = walk(&buf);
        assert!(!malformed);
    }

    #[test]
    fn alignment_padding_is_skipped_and_not_part_of_the_payload() {
        // 16 + 5 = 21 bytes, padded to 24: the next message starts at 24.
        let buf = [message(20, 1, b"abcde", None), message(21, 2, b"xyz", None)].concat();
        assert_eq!(buf.len(), 24 + 20);
        let (seen, malformed) = walk(&buf);
        assert_eq!(seen, vec![(20, 1, b"abcde".to_vec()), (21, 2, b"xyz".to_vec())]);
        assert!(!malformed);
    }

    #[test]
    fn an_unpadded_last_message_ends_the_walk_cleanly() {
        // The padding of the last message is missing: its aligned end lies past the buffer.
        let mut buf = message(20, 1, b"abcde", None);
        buf.truncate(NLMSG_HDRLEN + 5);
        let (seen, malformed) = walk(&buf);
        assert_eq!(seen, vec![(20, 1, b"abcde".to_vec())]);
        assert!(!malformed);
    }

    #[test]
    fn a_truncated_header_ends_the_walk() {
        let whole = message(20, 1, b"abcd", None);
        for cut in 0..NLMSG_HDRLEN {
            let (seen, malformed) = walk(&whole[..cut]);
            assert!(seen.is_empty() && !malformed, "cut at {cut}");
        }
        // After a whole message, a tail shorter than a header is ignored.
        let buf = [whole.clone(), whole[..NLMSG_HDRLEN - 1].to_vec()].concat();
        let (seen, malformed) = walk(&buf);
        assert_eq!((seen.len(), malformed), (1, false));
    }

    #[test]
    fn a_length_beyond_the_buffer_ends_the_walk_as_malformed() {
        for len in [21, 100, u32::MAX] {
            let buf = [message(20, 1, b"ab", None), message(21, 2, b"abcd", Some(len))].concat();
            let (seen, malformed) = walk(&buf);
            assert_eq!(seen, vec![(20, 1, b"ab".to_vec())], "len {len}");
            assert!(malformed, "len {len}");
        }
    }

    #[test]
    fn a_length_smaller_than_the_header_ends_the_walk_as_malformed() {
        for len in [0, 1, 15] {
            let buf = [message(21, 2, b"abcd", Some(len)), message(20, 1, b"ab", None)].concat();
            let (seen, malformed) = walk(&buf);
            assert!(seen.is_empty(), "len {len}: {seen:?}");
            assert!(malformed, "len {len}");
        }
    }

    #[test]
    fn a_malformed_walk_stays_ended() {
        let buf = message(21, 2, b"abcd", Some(3));
        let mut it = messages(&buf);
        assert!(it.next().is_none() && it.next().is_none() && it.malformed());
    }

    #[test]
    fn errors_carry_their_errno_and_short_ones_none() {
        let ack = message(NLMSG_ERROR, 1, &0i32.to_ne_bytes(), None);
        let eperm = message(NLMSG_ERROR, 2, &(-libc::EPERM).to_ne_bytes(), None);
        let short = message(NLMSG_ERROR, 3, &[1, 2], None);
        let other = message(20, 4, &(-libc::EPERM).to_ne_bytes(), None);
        let buf = [ack, eperm, short, other].concat();
        let errnos: Vec<Option<i32>> = messages(&buf).map(|m| m.errno()).collect();
        assert_eq!(errnos, vec![Some(0), Some(libc::EPERM), None, None]);
    }
}
