//! The cursor codec (rule L6).
//!
//! A cursor is hex text of `position ‖ mac`, where `position` is the engine
//! key the page ended on and `mac` is SipHash-1-3, keyed by the store's
//! secret, over the listing kind, the listing's binding (tenant and
//! filters) and the position. A cursor handed to another listing, another
//! tenant, other filters or another store, or altered in any way, fails the
//! MAC and is `Invalid`.

use std::hash::Hasher;

use siphasher::sip::SipHasher13;

use crate::cursor::Cursor;
use crate::error::{Result, StateError};

/// Largest position a cursor carries (a key of ours is far smaller).
const POSITION_BYTES_MAX: usize = 8 * 1024;
const MAC_BYTES: usize = 8;

/// Which listing issued a cursor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Listing {
    Runs = 1,
    Trays = 2,
    Marked = 3,
    Alarms = 4,
    Export = 5,
    Sessions = 6,
    Budgets = 7,
}

fn mac(secret: &[u8; 16], listing: Listing, binding: &[u8], position: &[u8]) -> u64 {
    let mut h = SipHasher13::new_with_key(secret);
    h.write_u8(listing as u8);
    h.write_usize(binding.len());
    h.write(binding);
    h.write(position);
    h.finish()
}

/// Makes the cursor for a page that ended at `position`.
pub(crate) fn encode(
    secret: &[u8; 16],
    listing: Listing,
    binding: &[u8],
    position: &[u8],
) -> Cursor {
    debug_assert!(position.len() <= POSITION_BYTES_MAX);
    let m = mac(secret, listing, binding, position);
    let mut text = String::with_capacity((position.len() + MAC_BYTES) * 2);
    for b in position.iter().chain(m.to_le_bytes().iter()) {
        text.push_str(&format!("{b:02x}"));
    }
    let c = Cursor(text);
    debug_assert!(decode(secret, listing, binding, &c).is_ok_and(|p| p == position));
    c
}

/// Checks a cursor against this listing and returns its position.
pub(crate) fn decode(
    secret: &[u8; 16],
    listing: Listing,
    binding: &[u8],
    cursor: &Cursor,
) -> Result<Vec<u8>> {
    let invalid = || {
        StateError::invalid(
            "cursor: not issued by this listing (other tenant, filters or store, or altered)",
        )
    };
    let text = cursor.as_str().as_bytes();
    if !text.len().is_multiple_of(2)
        || text.len() < 2 * (MAC_BYTES + 1)
        || text.len() > 2 * (POSITION_BYTES_MAX + MAC_BYTES)
    {
        return Err(invalid());
    }
    let mut bytes = Vec::with_capacity(text.len() / 2);
    for pair in text.chunks_exact(2) {
        let hex = std::str::from_utf8(pair).map_err(|_| invalid())?;
        bytes.push(u8::from_str_radix(hex, 16).map_err(|_| invalid())?);
    }
    let (position, m) = bytes.split_at(bytes.len() - MAC_BYTES);
    let m = u64::from_le_bytes(m.try_into().expect("split gives 8 bytes"));
    if mac(secret, listing, binding, position) != m {
        return Err(invalid());
    }
    Ok(position.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binds_listing_binding_and_secret() {
        let s = [7u8; 16];
        let c = encode(&s, Listing::Runs, b"acme", b"pos");
        assert_eq!(decode(&s, Listing::Runs, b"acme", &c).unwrap(), b"pos");
        assert!(decode(&s, Listing::Runs, b"other", &c).is_err());
        assert!(decode(&s, Listing::Trays, b"acme", &c).is_err());
        assert!(decode(&[8u8; 16], Listing::Runs, b"acme", &c).is_err());
        for bad in ["", "zz", "0", &c.as_str()[2..], &c.as_str().to_uppercase()] {
            let _ = decode(&s, Listing::Runs, b"acme", &Cursor(bad.to_string()));
        }
        let mut t = c.as_str().to_string().into_bytes();
        t[0] = if t[0] == b'0' { b'1' } else { b'0' };
        let t = Cursor(String::from_utf8(t).unwrap());
        assert!(decode(&s, Listing::Runs, b"acme", &t).is_err());
    }
}
