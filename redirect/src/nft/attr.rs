//! Netlink message and attribute encoding for nfnetlink batches (native byte order headers, 4-byte alignment),
//! and reading attributes back from the kernel's answers.

use std::net::IpAddr;

use netns::netlink::uapi::{NLA_F_NESTED, NLA_TYPE_MASK};

/// A buffer of netlink messages being built.
#[derive(Default)]
pub(crate) struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    /// The encoded bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.buf
    }

    fn align(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }

    /// Appends one message: nlmsghdr, nfgenmsg (family, version 0, big-endian `res_id`), then attributes.
    pub(crate) fn message(
        &mut self,
        ty: u16,
        flags: u16,
        seq: u32,
        family: u8,
        res_id: u16,
        body: impl FnOnce(&mut Self),
    ) {
        let start = self.buf.len();
        self.buf.extend_from_slice(&0u32.to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(&flags.to_ne_bytes());
        self.buf.extend_from_slice(&seq.to_ne_bytes());
        self.buf.extend_from_slice(&0u32.to_ne_bytes());
        self.buf.push(family);
        self.buf.push(0);
        self.buf.extend_from_slice(&res_id.to_be_bytes());
        body(self);
        self.align();
        let len = (self.buf.len() - start) as u32;
        self.buf[start..start + 4].copy_from_slice(&len.to_ne_bytes());
    }

    /// An attribute with raw payload.
    pub(crate) fn put(&mut self, ty: u16, data: &[u8]) {
        let len = (4 + data.len()) as u16;
        self.buf.extend_from_slice(&len.to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(data);
        self.align();
    }

    /// A big-endian u32 attribute (nf_tables encodes all its integers this way).
    pub(crate) fn be32(&mut self, ty: u16, v: u32) {
        self.put(ty, &v.to_be_bytes());
    }

    /// A big-endian u64 attribute.
    pub(crate) fn be64(&mut self, ty: u16, v: u64) {
        self.put(ty, &v.to_be_bytes());
    }

    /// A NUL-terminated string attribute.
    pub(crate) fn string(&mut self, ty: u16, s: &str) {
        let mut data = Vec::with_capacity(s.len() + 1);
        data.extend_from_slice(s.as_bytes());
        data.push(0);
        self.put(ty, &data);
    }

    /// Appends already encoded bytes (tests build nested structures from parts).
    #[cfg(test)]
    pub(crate) fn put_raw(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// A nested attribute whose content `body` writes.
    pub(crate) fn nest(&mut self, ty: u16, body: impl FnOnce(&mut Self)) {
        let start = self.buf.len();
        self.buf.extend_from_slice(&[0; 4]);
        body(self);
        let len = (self.buf.len() - start) as u16;
        self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
        self.buf[start + 2..start + 4].copy_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
    }
}

/// Iterates the netlink attributes of `data` as (type without flags, payload); stops at a malformed one.
pub(crate) fn attrs(mut data: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if data.len() < 4 {
            return None;
        }
        let len = usize::from(u16::from_ne_bytes([data[0], data[1]]));
        let ty = u16::from_ne_bytes([data[2], data[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > data.len() {
            return None;
        }
        let payload = &data[4..len];
        data = &data[((len + 3) & !3).min(data.len())..];
        Some((ty, payload))
    })
}

/// A string payload up to its first NUL (or its end).
pub(crate) fn c_string(payload: &[u8]) -> String {
    let end = payload.iter().position(|b| *b == 0).unwrap_or(payload.len());
    String::from_utf8_lossy(&payload[..end]).into_owned()
}

/// An IPv4 (4 bytes) or IPv6 (16 bytes) address payload.
pub(crate) fn ip_addr(bytes: &[u8]) -> Option<IpAddr> {
    match bytes.len() {
        4 => Some(IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?)),
        16 => Some(IpAddr::from(<[u8; 16]>::try_from(bytes).ok()?)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_are_padded_and_nests_sized() {
        let mut w = Writer::default();
        w.nest(1, |w| w.string(2, "lo"));
        // nest header 4 + (attr header 4 + "lo\0" 3 + pad 1)
        assert_eq!(w.bytes(), &[12, 0, 1, 0x80, 7, 0, 2, 0, b'l', b'o', 0, 0]);
    }

    #[test]
    fn message_length_covers_header_and_body() {
        let mut w = Writer::default();
        w.message(0x0a00, 1, 7, 1, 0, |w| w.be32(1, 5));
        assert_eq!(w.bytes().len(), 16 + 4 + 8);
        assert_eq!(u32::from_ne_bytes(w.bytes()[0..4].try_into().unwrap()), 28);
        assert_eq!(&w.bytes()[20..28], &[8, 0, 1, 0, 0, 0, 0, 5]);
    }

    #[test]
    fn written_attributes_read_back() {
        let mut w = Writer::default();
        w.nest(1, |w| w.string(2, "lo"));
        w.put(3, &[10, 0, 0, 1]);
        let read: Vec<(u16, &[u8])> = attrs(w.bytes()).collect();
        assert_eq!(read.len(), 2);
        assert_eq!(read[0].0, 1, "nested flag masked off");
        let inner: Vec<(u16, &[u8])> = attrs(read[0].1).collect();
        assert_eq!((inner[0].0, c_string(inner[0].1)), (2, "lo".to_string()));
        assert_eq!(ip_addr(read[1].1), Some("10.0.0.1".parse().unwrap()));
    }
}
