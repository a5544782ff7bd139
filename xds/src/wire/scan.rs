//! A walk over the top-level fields of a serialized protobuf message, without decoding it.
//!
//! Guarantees: [`count_fields`] reads each field's key and skips its value by the wire type, allocating nothing;
//! it never reads past the input and reports malformed input as an error instead of panicking. The ADS client
//! uses it to refuse a response holding more resources than it accepts *before* prost materialises them (a
//! 2-byte empty `Resource` on the wire costs over 100 bytes in memory).

/// Why the walk stopped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScanError {
    /// A varint ran past the input or over 10 bytes.
    #[error("malformed varint at byte {0}")]
    Varint(usize),
    /// A field's value runs past the input.
    #[error("field at byte {0} runs past the message")]
    Truncated(usize),
    /// A wire type this walk does not skip (groups, or invalid).
    #[error("unsupported wire type {wire_type} at byte {at}")]
    WireType {
        /// The wire type.
        wire_type: u64,
        /// Where.
        at: usize,
    },
}

fn varint(bytes: &[u8], pos: &mut usize) -> Result<u64, ScanError> {
    let start = *pos;
    let mut value = 0u64;
    for shift in 0..10 {
        let Some(&b) = bytes.get(*pos) else { return Err(ScanError::Varint(start)) };
        *pos += 1;
        value |= u64::from(b & 0x7f) << (7 * shift);
        if b & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err(ScanError::Varint(start))
}

/// How many top-level fields with each of `tags` the message holds (`counts[i]` for `tags[i]`).
pub fn count_fields<const N: usize>(bytes: &[u8], tags: [u32; N]) -> Result<[usize; N], ScanError> {
    let mut counts = [0usize; N];
    let mut pos = 0;
    while pos < bytes.len() {
        let at = pos;
        let key = varint(bytes, &mut pos)?;
        let (field, wire_type) = (key >> 3, key & 7);
        if let Some(i) = tags.iter().position(|t| u64::from(*t) == field) {
            counts[i] += 1;
        }
        let skip = match wire_type {
            0 => {
                varint(bytes, &mut pos)?;
                0
            }
            1 => 8,
            2 => usize::try_from(varint(bytes, &mut pos)?).map_err(|_| ScanError::Truncated(at))?,
            5 => 4,
            _ => return Err(ScanError::WireType { wire_type, at }),
        };
        pos = pos.checked_add(skip).filter(|end| *end <= bytes.len()).ok_or(ScanError::Truncated(at))?;
    }
    Ok(counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_top_level_fields_only() {
        // resources=2 (twice, one holding a nested field 2), type_url=4, a fixed64 field 9, removed=6.
        let bytes = [0x12, 0x00, 0x12, 0x02, 0x12, 0x00, 0x22, 0x01, b't', 0x49, 0, 0, 0, 0, 0, 0, 0, 0, 0x32, 0x00];
        assert_eq!(count_fields(&bytes, [2, 6]), Ok([2, 1]));
        assert_eq!(count_fields(&[], [2]), Ok([0]));
    }

    #[test]
    fn malformed_input_is_an_error() {
        assert_eq!(count_fields(&[0x12, 0x05, 0x00], [2]), Err(ScanError::Truncated(0)));
        assert_eq!(count_fields(&[0x12], [2]), Err(ScanError::Varint(1)));
        assert_eq!(count_fields(&[0xff; 11], [2]), Err(ScanError::Varint(0)));
        assert_eq!(count_fields(&[0x0b], [2]), Err(ScanError::WireType { wire_type: 3, at: 0 }));
        assert_eq!(
            count_fields(&[0x12, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01], [2]),
            Err(ScanError::Truncated(0))
        );
    }
}
