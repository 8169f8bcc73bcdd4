//! The value codec (rules D4, D9): a format-version byte, the postcard
//! encoding, then a CRC-32 of both.

use serde::{Serialize, de::DeserializeOwned};

use crate::error::{Result, StateError};

/// The format this build writes. A value with a higher version was written
/// by a newer release and is refused.
pub(crate) const FORMAT_VERSION: u8 = 1;
/// Version byte plus checksum.
pub(crate) const OVERHEAD_BYTES: usize = 1 + 4;

/// Encodes `v` behind the version byte, with a trailing checksum.
pub(crate) fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    // postcard's std serializer only fails on types serde cannot express,
    // and every stored type is plain data.
    // Sized first: one allocation, instead of a dozen regrowths for a run.
    let size = postcard::experimental::serialized_size(v).expect("stored types always serialize");
    let mut buf = Vec::with_capacity(OVERHEAD_BYTES + size);
    buf.push(FORMAT_VERSION);
    let mut out = postcard::to_extend(v, buf).expect("stored types always serialize");
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// Decodes a value, checking its checksum and version. `what` names the
/// value in the error.
pub(crate) fn decode<T: DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T> {
    if bytes.len() < OVERHEAD_BYTES {
        return Err(StateError::corrupt(format!("{what}: value truncated")));
    }
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    let crc = u32::from_le_bytes(crc.try_into().expect("split gives 4 bytes"));
    if crc32fast::hash(body) != crc {
        return Err(StateError::corrupt(format!("{what}: checksum mismatch")));
    }
    let version = body[0];
    if version > FORMAT_VERSION {
        return Err(StateError::UnsupportedFormat {
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    if version == 0 {
        return Err(StateError::corrupt(format!("{what}: format version 0")));
    }
    let (v, rest) = postcard::take_from_bytes(&body[1..])
        .map_err(|e| StateError::corrupt(format!("{what}: undecodable ({e})")))?;
    if !rest.is_empty() {
        return Err(StateError::corrupt(format!("{what}: trailing bytes")));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_every_flip_is_caught() {
        let v = encode(&("abc".to_string(), 42u64));
        let back: (String, u64) = decode(&v, "t").unwrap();
        assert_eq!(back, ("abc".to_string(), 42));
        for i in 0..v.len() {
            for bit in 0..8 {
                let mut bad = v.clone();
                bad[i] ^= 1 << bit;
                assert!(
                    decode::<(String, u64)>(&bad, "t").is_err(),
                    "flip {i}/{bit}"
                );
            }
        }
        for n in 0..v.len() {
            assert!(decode::<(String, u64)>(&v[..n], "t").is_err());
        }
    }

    #[test]
    fn newer_version_is_refused_by_name() {
        let mut v = encode(&7u64);
        v[0] = FORMAT_VERSION + 1;
        let n = v.len() - 4;
        let crc = crc32fast::hash(&v[..n]);
        v[n..].copy_from_slice(&crc.to_le_bytes());
        assert!(matches!(
            decode::<u64>(&v, "t"),
            Err(StateError::UnsupportedFormat {
                found: 2,
                supported: 1
            })
        ));
    }
}
