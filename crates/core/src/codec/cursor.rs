//! The cursor codec (rule L6).
//!
//! A cursor is the canonical base64url text (RFC 4648 §5, no padding) of
//!
//! ```text
//! version (1 byte, = 3) ‖ nonce (24 bytes, random) ‖ XChaCha20-Poly1305(payload) ‖ tag (16 bytes)
//! payload = filters length (u16 LE) ‖ filters ‖ position
//! ```
//!
//! `position` is the engine key the page ended on. It is encrypted and
//! authenticated under a key derived (HKDF-SHA256, its own `info` label)
//! from the store's secret, with the listing kind and the listing's
//! binding as associated data. A binding is the tenant (or the whole
//! store) and the filters; a run listing's filters are sealed inside the
//! payload instead of the associated data, so a next-page query that names
//! only the tenant and the cursor continues the same filtered walk (L7,
//! [`runs_query`]), while one naming other filters is still refused. So a
//! cursor reveals
//! nothing but its length; one handed to another listing, another tenant,
//! other filters or another store fails authentication; and since decoding
//! is strict (only the one spelling `encode` writes is read, checked by
//! re-encoding), a cursor altered in any way at all is `Invalid`.
//! Cursors of formats 1 (hex with a SipHash tag) and 2 (the filters in
//! the associated data) are `Invalid` too: cursors are short-lived, and an
//! upgrade only ends the walks in progress.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use chacha20poly1305::aead::{Aead, AeadCore, KeyInit, OsRng, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};

use std::borrow::Cow;

use crate::codec::key::{KeyBuf, KeyReader};
use crate::cursor::Cursor;
use crate::error::{Result, StateError};
use crate::page::PageRequest;
use crate::record::{RunState, StateQuery};

/// Largest position a cursor carries (a key of ours is far smaller).
const POSITION_BYTES_MAX: usize = 8 * 1024;
/// Largest filters a cursor carries (two ids of at most 256 bytes, each
/// at most doubled by escaping, and a few flag bytes).
const FILTERS_BYTES_MAX: usize = 2 * 1024;
/// The format byte every cursor starts with.
const VERSION: u8 = 3;
const NONCE_BYTES: usize = 24;
const TAG_BYTES: usize = 16;
/// Domain separation of the cursor key from any other use of the secret.
const KEY_INFO: &[u8] = b"agentstate cursor key v2";
/// Prefix of the associated data.
const AD_LABEL: &[u8] = b"agentstate cursor v3";

/// A new store secret, the one its cursors are sealed under (the key-value
/// store keeps it in its meta table, Redis under its `{meta}` key;
/// PostgreSQL makes its own in SQL): 16 bytes nobody can guess, from the
/// OS-seeded std hasher keys.
pub fn new_secret() -> [u8; 16] {
    use std::hash::{BuildHasher, Hasher};
    let mut out = [0u8; 16];
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_usize(i);
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0),
        );
        chunk.copy_from_slice(&h.finish().to_le_bytes());
    }
    out
}

/// Which listing issued a cursor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Listing {
    Runs = 1,
    Trays = 2,
    Marked = 3,
    Alarms = 4,
    Export = 5,
    Sessions = 6,
    Budgets = 7,
}

/// The 32-byte cursor key derived from a store's secret.
#[allow(
    clippy::expect_used,
    reason = "32 bytes is a valid HKDF-SHA256 output length"
)]
fn derive(secret: &[u8; 16]) -> [u8; 32] {
    let hk = hkdf::Hkdf::<sha2::Sha256>::new(None, secret);
    let mut key = [0u8; 32];
    hk.expand(KEY_INFO, &mut key)
        .expect("32 bytes is a valid HKDF-SHA256 output length");
    key
}

std::thread_local! {
    /// The last secret this thread used and its derived key: the HKDF
    /// (four SHA-256 blocks) cost more than the AEAD of a cursor, and a
    /// thread pages one store at a time far more often than it switches.
    static DERIVED: std::cell::Cell<Option<([u8; 16], [u8; 32])>> =
        const { std::cell::Cell::new(None) };
}

/// The AEAD keyed by the 32-byte key derived from the store's secret.
fn cipher(secret: &[u8; 16]) -> XChaCha20Poly1305 {
    let key = DERIVED.with(|d| match d.get() {
        Some((s, key)) if &s == secret => key,
        _ => {
            let key = derive(secret);
            d.set(Some((*secret, key)));
            key
        }
    });
    debug_assert_eq!(key, derive(secret));
    XChaCha20Poly1305::new(&key.into())
}

/// Associated data: label, version, listing, and the length-prefixed
/// binding (so no two (listing, binding) pairs share a byte string).
fn associated(listing: Listing, binding: &[u8]) -> Vec<u8> {
    let mut ad = Vec::with_capacity(AD_LABEL.len() + 10 + binding.len());
    ad.extend_from_slice(AD_LABEL);
    ad.push(VERSION);
    ad.push(listing as u8);
    ad.extend_from_slice(&(binding.len() as u64).to_le_bytes());
    ad.extend_from_slice(binding);
    ad
}

/// Makes the cursor for a page that ended at `position`.
#[allow(
    clippy::expect_used,
    reason = "XChaCha20-Poly1305 encrypts any message of our size"
)]
pub fn encode(secret: &[u8; 16], listing: Listing, binding: &[u8], position: &[u8]) -> Cursor {
    debug_assert!(position.len() <= POSITION_BYTES_MAX);
    let (bound, filters) = split(listing, binding);
    debug_assert!(filters.len() <= FILTERS_BYTES_MAX);
    let mut msg = Vec::with_capacity(2 + filters.len() + position.len());
    msg.extend_from_slice(&(filters.len() as u16).to_le_bytes());
    msg.extend_from_slice(filters);
    msg.extend_from_slice(position);
    let nonce = XChaCha20Poly1305::generate_nonce(&mut OsRng);
    let ad = associated(listing, bound);
    let sealed = cipher(secret)
        .encrypt(
            &nonce,
            Payload {
                msg: &msg,
                aad: &ad,
            },
        )
        .expect("XChaCha20-Poly1305 encrypts any message of our size");
    let mut bytes = Vec::with_capacity(1 + NONCE_BYTES + sealed.len());
    bytes.push(VERSION);
    bytes.extend_from_slice(&nonce);
    bytes.extend_from_slice(&sealed);
    let c = Cursor(URL_SAFE_NO_PAD.encode(&bytes));
    debug_assert!(decode(secret, listing, binding, &c).is_ok_and(|p| p == position));
    c
}

/// Splits a binding into what is bound as associated data and what travels
/// sealed inside the payload: a run listing's filters, after its tenant
/// (L7). Every other binding is associated data whole.
fn split(listing: Listing, binding: &[u8]) -> (&[u8], &[u8]) {
    if listing == Listing::Runs
        && let Ok(mut r) = KeyReader::new(binding, Listing::Runs as u8)
        && r.str().is_ok()
    {
        let filters = r.rest();
        return binding.split_at(binding.len() - filters.len());
    }
    (binding, &[])
}

fn invalid() -> StateError {
    StateError::invalid(
        "cursor: not issued by this listing (other tenant, filters or store, altered, or from an older release)",
    )
}

/// Checks a cursor against this listing and returns its position.
pub fn decode(
    secret: &[u8; 16],
    listing: Listing,
    binding: &[u8],
    cursor: &Cursor,
) -> Result<Vec<u8>> {
    let (bound, filters) = split(listing, binding);
    let (sealed_filters, position) = open(secret, listing, bound, cursor)?;
    if sealed_filters != filters {
        return Err(invalid());
    }
    Ok(position)
}

/// Authenticates a cursor against its listing and the bound part of its
/// binding; returns the filters it carries and its position.
fn open(
    secret: &[u8; 16],
    listing: Listing,
    bound: &[u8],
    cursor: &Cursor,
) -> Result<(Vec<u8>, Vec<u8>)> {
    let text = cursor.as_str();
    let max_text =
        (1 + NONCE_BYTES + 2 + FILTERS_BYTES_MAX + POSITION_BYTES_MAX + TAG_BYTES).div_ceil(3) * 4;
    if text.len() > max_text {
        return Err(invalid());
    }
    let bytes = URL_SAFE_NO_PAD.decode(text).map_err(|_| invalid())?;
    // Exactly one spelling: the text must be what `encode` writes for
    // these bytes (no padding, no stray trailing bits, no other alphabet).
    if URL_SAFE_NO_PAD.encode(&bytes) != text {
        return Err(invalid());
    }
    if bytes.len() < 1 + NONCE_BYTES + TAG_BYTES || bytes[0] != VERSION {
        return Err(invalid());
    }
    let (nonce, sealed) = bytes[1..].split_at(NONCE_BYTES);
    let ad = associated(listing, bound);
    let mut msg = cipher(secret)
        .decrypt(
            XNonce::from_slice(nonce),
            Payload {
                msg: sealed,
                aad: &ad,
            },
        )
        .map_err(|_| invalid())?;
    // Authentic, so written by `encode`; checked all the same.
    let len = match msg.get(..2) {
        Some(l) => u16::from_le_bytes([l[0], l[1]]) as usize,
        None => return Err(invalid()),
    };
    if msg.len() < 2 + len {
        return Err(invalid());
    }
    let position = msg.split_off(2 + len);
    msg.drain(..2);
    Ok((msg, position))
}

/// The binding of a run listing's cursor, the same on every backend: the
/// tenant and every filter, so a cursor used with another tenant or other
/// filters is refused (L6). The filters travel sealed in the cursor (L7).
pub fn runs_binding(q: &StateQuery) -> Vec<u8> {
    let mut b = KeyBuf::table(Listing::Runs as u8).str(&q.tenant);
    b = match q.state {
        Some(s) => b.u8(1).u8(s.tag()),
        None => b.u8(0),
    };
    for opt in [&q.session, &q.agent] {
        b = match opt {
            Some(s) => b.u8(1).str(s),
            None => b.u8(0),
        };
    }
    b = match q.updated_before {
        Some(t) => b.u8(1).u64(t),
        None => b.u8(0),
    };
    // Last and only when set, so a cursor of a walk without a label reads
    // as it did before labels (R11).
    if let Some(l) = &q.label {
        b = b.str(&l.key).str(&crate::labels::canonical(&l.value));
    }
    b.done()
}

/// The query a run listing's page walks by (L7): `q` itself, unless `q`
/// names only its tenant and the page continues a walk, whose filters
/// then come from the cursor. A cursor of another tenant, store or
/// listing, or an altered one, is `Invalid` here already (L6); a query
/// naming other filters than its cursor's is refused by [`decode`].
pub fn runs_query<'q>(
    secret: &[u8; 16],
    q: &'q StateQuery,
    page: &PageRequest,
) -> Result<Cow<'q, StateQuery>> {
    if let Some(l) = &q.label {
        crate::labels::check_label(l)?;
    }
    let Some(cursor) = &page.cursor else {
        return Ok(Cow::Borrowed(q));
    };
    let named = q.state.is_some()
        || q.session.is_some()
        || q.agent.is_some()
        || q.updated_before.is_some()
        || q.label.is_some();
    if named {
        return Ok(Cow::Borrowed(q));
    }
    let bound = KeyBuf::table(Listing::Runs as u8).str(&q.tenant).done();
    let (filters, _) = open(secret, Listing::Runs, &bound, cursor)?;
    let mut full = bound;
    full.extend_from_slice(&filters);
    let mut r = KeyReader::new(&full, Listing::Runs as u8)?;
    let mut walk = StateQuery::new(r.str()?);
    let flag = |r: &mut KeyReader<'_>| -> Result<bool> {
        match r.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(invalid()),
        }
    };
    if flag(&mut r)? {
        let tag = r.u8()?;
        walk.state = Some(
            RunState::ALL
                .into_iter()
                .find(|s| s.tag() == tag)
                .ok_or_else(invalid)?,
        );
    }
    if flag(&mut r)? {
        walk.session = Some(r.str()?);
    }
    if flag(&mut r)? {
        walk.agent = Some(r.str()?);
    }
    if flag(&mut r)? {
        walk.updated_before = Some(r.u64()?);
    }
    if !r.at_end() {
        let key = r.str()?;
        let value = serde_json::from_str(&r.str()?).map_err(|_| invalid())?;
        walk.label = Some(crate::Label { key, value });
    }
    r.end().map_err(|_| invalid())?;
    debug_assert_eq!(runs_binding(&walk), full);
    Ok(Cow::Owned(walk))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const S: [u8; 16] = [7u8; 16];

    #[test]
    fn binds_listing_binding_and_secret() {
        let c = encode(&S, Listing::Runs, b"acme", b"pos");
        assert_eq!(decode(&S, Listing::Runs, b"acme", &c).unwrap(), b"pos");
        assert!(decode(&S, Listing::Runs, b"other", &c).is_err());
        assert!(decode(&S, Listing::Trays, b"acme", &c).is_err());
        assert!(decode(&[8u8; 16], Listing::Runs, b"acme", &c).is_err());
        for bad in ["", "zz", "0", &c.as_str()[2..], &c.as_str().to_uppercase()] {
            assert!(decode(&S, Listing::Runs, b"acme", &Cursor(bad.to_string())).is_err());
        }
    }

    #[test]
    fn a_cursor_of_format_1_is_invalid() {
        // Hex of position ‖ SipHash tag, as releases before format 2 wrote.
        for old in [
            "01616300ff0102030405060708",
            "0061636d6500000000000000010011223344556677",
        ] {
            assert!(decode(&S, Listing::Runs, b"acme", &Cursor(old.into())).is_err());
        }
    }

    #[test]
    fn each_cursor_is_fresh_and_hides_its_position() {
        let a = encode(&S, Listing::Runs, b"acme", b"acme-position");
        let b = encode(&S, Listing::Runs, b"acme", b"acme-position");
        assert_ne!(a, b, "a random nonce per cursor");
        let raw = URL_SAFE_NO_PAD.decode(a.as_str()).unwrap();
        assert!(!raw.windows(4).any(|w| w == b"acme"));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(6))]
        #[test]
        fn every_mutation_is_invalid(pos in proptest::collection::vec(any::<u8>(), 0..64),
                                     binding in proptest::collection::vec(any::<u8>(), 0..16)) {
            let c = encode(&S, Listing::Export, &binding, &pos);
            prop_assert_eq!(decode(&S, Listing::Export, &binding, &c).unwrap(), pos);
            for bad in mutations(c.as_str()) {
                prop_assert!(decode(&S, Listing::Export, &binding, &Cursor(bad)).is_err());
            }
        }
    }

    /// Every single-character and single-byte alteration of a cursor's text:
    /// each character replaced by every other printable ASCII character,
    /// each byte of its raw form flipped bit by bit (re-encoded), every
    /// truncation, and extensions by one character. For the L6 tests.
    fn mutations(text: &str) -> Vec<String> {
        let mut out = Vec::new();
        let chars: Vec<char> = text.chars().collect();
        for i in 0..chars.len() {
            for c in (0x20u8..0x7f).map(char::from) {
                if c != chars[i] {
                    let mut m = chars.clone();
                    m[i] = c;
                    out.push(m.into_iter().collect());
                }
            }
            for bad in ['=', '\n', 'é'] {
                let mut m = chars.clone();
                m[i] = bad;
                out.push(m.into_iter().collect());
            }
        }
        if let Ok(raw) = URL_SAFE_NO_PAD.decode(text) {
            for i in 0..raw.len() {
                for bit in 0..8 {
                    let mut m = raw.clone();
                    m[i] ^= 1 << bit;
                    out.push(URL_SAFE_NO_PAD.encode(&m));
                }
            }
            for n in 0..raw.len() {
                out.push(URL_SAFE_NO_PAD.encode(&raw[..n]));
            }
            let mut longer = raw.clone();
            longer.push(0);
            out.push(URL_SAFE_NO_PAD.encode(&longer));
        }
        for n in 0..chars.len() {
            out.push(chars[..n].iter().collect());
        }
        for c in ['A', 'a', '0', '-', '_', '=', ' ', '\n'] {
            out.push(format!("{text}{c}"));
            out.push(format!("{c}{text}"));
        }
        out
    }
}
