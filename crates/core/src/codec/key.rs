//! The key codec (rule K6), shared by every backend: the key-value
//! store's engine keys, the positions the cursor codec seals, and the
//! members PostgreSQL's and Redis's listings page by.
//!
//! Every key is one table byte followed by components. A string component
//! is escaped and terminated: `0x00` becomes `0x00 0xFF` and the component
//! ends with `0x00 0x01`. No escaped byte sequence contains the terminator,
//! so the encoding is injective (two different component lists never share
//! bytes) and preserves order (byte order of keys is the lexicographic order
//! of their components). Integers are fixed-width big-endian. Which table
//! bytes exist is each user's own (the key-value store's are `kv::key::table`).

use crate::error::{Result, StateError};

const ESC: u8 = 0x00;
const ESCAPED_NUL: u8 = 0xFF;
const TERMINATOR: u8 = 0x01;

/// Builds a key component by component.
#[derive(Debug, Clone)]
pub struct KeyBuf(Vec<u8>);

impl KeyBuf {
    pub fn table(table: u8) -> Self {
        let mut v = Vec::with_capacity(64);
        v.push(table);
        KeyBuf(v)
    }
    /// A key whose components after the table byte take `rest` bytes (a
    /// string its length and 2 for its terminator; a NUL in it 1 more, and
    /// the buffer then grows): sized exactly, so a key kept in a map holds
    /// no spare capacity.
    pub fn sized(table: u8, rest: usize) -> Self {
        let mut v = Vec::with_capacity(1 + rest);
        v.push(table);
        KeyBuf(v)
    }
    pub fn str(mut self, s: &str) -> Self {
        // The stretches between NULs are copied whole: most strings have
        // none, and go in one copy.
        let mut rest = s.as_bytes();
        while let Some(i) = rest.iter().position(|&b| b == ESC) {
            self.0.extend_from_slice(&rest[..i]);
            self.0.extend_from_slice(&[ESC, ESCAPED_NUL]);
            rest = &rest[i + 1..];
        }
        self.0.extend_from_slice(rest);
        self.0.extend_from_slice(&[ESC, TERMINATOR]);
        self
    }
    pub fn u64(mut self, n: u64) -> Self {
        self.0.extend_from_slice(&n.to_be_bytes());
        self
    }
    pub fn u8(mut self, n: u8) -> Self {
        self.0.push(n);
        self
    }
    pub fn done(self) -> Vec<u8> {
        self.0
    }
}

/// Reads a key back, component by component.
#[derive(Debug)]
pub struct KeyReader<'a> {
    rest: &'a [u8],
}

impl<'a> KeyReader<'a> {
    /// Starts after checking the table byte.
    pub fn new(key: &'a [u8], table: u8) -> Result<Self> {
        match key.split_first() {
            Some((&t, rest)) if t == table => Ok(KeyReader { rest }),
            _ => Err(StateError::corrupt(format!(
                "key of table {table:#04x} expected"
            ))),
        }
    }
    pub fn str(&mut self) -> Result<String> {
        let mut out = Vec::new();
        let mut i = 0;
        loop {
            match self.rest.get(i) {
                None => return Err(StateError::corrupt("key component not terminated")),
                Some(&ESC) => match self.rest.get(i + 1) {
                    Some(&ESCAPED_NUL) => {
                        out.push(0);
                        i += 2;
                    }
                    Some(&TERMINATOR) => {
                        self.rest = &self.rest[i + 2..];
                        return String::from_utf8(out)
                            .map_err(|_| StateError::corrupt("key component is not UTF-8"));
                    }
                    _ => return Err(StateError::corrupt("bad escape in key")),
                },
                Some(&b) => {
                    out.push(b);
                    i += 1;
                }
            }
        }
    }
    pub fn u64(&mut self) -> Result<u64> {
        let Some((n, rest)) = self.rest.split_first_chunk::<8>() else {
            return Err(StateError::corrupt("key integer truncated"));
        };
        self.rest = rest;
        Ok(u64::from_be_bytes(*n))
    }
    pub fn u8(&mut self) -> Result<u8> {
        let (&n, rest) = self
            .rest
            .split_first()
            .ok_or_else(|| StateError::corrupt("key byte truncated"))?;
        self.rest = rest;
        Ok(n)
    }
    /// The bytes not read yet.
    pub fn rest(&self) -> &'a [u8] {
        self.rest
    }
    /// True when every byte of the key was read.
    pub fn at_end(&self) -> bool {
        self.rest.is_empty()
    }
    /// Checks that the whole key was read.
    pub fn end(self) -> Result<()> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(StateError::corrupt("trailing bytes in key"))
        }
    }
}

/// The smallest key strictly greater than every key that starts with
/// `prefix`, or `None` when there is none (all bytes 0xFF).
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xFF {
            end.push(last + 1);
            return end;
        }
    }
    // Every key of ours starts with a table byte below 0xFF.
    vec![0xFF; 1]
}

/// The smallest key strictly greater than `key`.
pub fn successor(key: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(key.len() + 1);
    k.extend_from_slice(key);
    k.push(0);
    k
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Table bytes for the tests (the key-value store's run and tray
    /// tables; any byte would do).
    mod table {
        pub const RUN: u8 = 0x08;
        pub const TRAY: u8 = 0x31;
    }

    fn two(a: &str, b: &str) -> Vec<u8> {
        KeyBuf::table(table::RUN).str(a).str(b).done()
    }

    #[test]
    fn separators_and_nuls_never_collide() {
        assert_ne!(two("a", "b/c"), two("a/b", "c"));
        assert_ne!(two("a\0", "b"), two("a", "\0b"));
        assert_ne!(two("a\0\u{1}", ""), two("a", ""));
    }

    #[test]
    fn order_is_component_order() {
        assert!(two("a", "z") < two("ab", ""));
        assert!(two("a", "b") < two("a", "c"));
        assert!(two("a\0", "") > two("a", "zzzz"));
    }

    #[test]
    fn round_trip() {
        let k = KeyBuf::table(table::TRAY)
            .str("n\0s")
            .str("")
            .u64(7)
            .u8(3)
            .done();
        let mut r = KeyReader::new(&k, table::TRAY).unwrap();
        assert_eq!(r.str().unwrap(), "n\0s");
        assert_eq!(r.str().unwrap(), "");
        assert_eq!(r.u64().unwrap(), 7);
        assert_eq!(r.u8().unwrap(), 3);
        r.end().unwrap();
    }

    #[test]
    fn strings_are_escaped_byte_for_byte_as_stored() {
        let k = KeyBuf::table(table::TRAY)
            .str("\0a\0\0b\0")
            .str("plain")
            .done();
        let want: &[u8] = &[
            table::TRAY,
            0,
            0xFF,
            b'a',
            0,
            0xFF,
            0,
            0xFF,
            b'b',
            0,
            0xFF,
            0,
            1,
            b'p',
            b'l',
            b'a',
            b'i',
            b'n',
            0,
            1,
        ];
        assert_eq!(k, want);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for bad in [
            &[][..],
            &[table::RUN],
            &[table::RUN, 0],
            &[table::RUN, 0, 7],
            &[table::RUN, b'a'],
        ] {
            if let Ok(mut r) = KeyReader::new(bad, table::RUN) {
                assert!(r.str().is_err());
            }
        }
    }

    #[test]
    fn prefix_end_bounds_prefix() {
        let p = KeyBuf::table(table::RUN).str("t").done();
        let end = prefix_end(&p);
        assert!(two("t", "\u{10FFFF}") < end);
        assert!(two("t\0", "") >= end || two("t\0", "") < p);
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        /// Ids that stress the escaping: separators, NUL, the terminator
        /// byte 0x01, U+00FF, other non-ASCII, plus any string at all.
        fn id() -> impl Strategy<Value = String> {
            prop_oneof![
                "[ab/:\\x00\\x01\u{7f}\u{e9}\u{ff}\u{4e2d}\u{10ffff}]{0,6}",
                any::<String>(),
            ]
        }

        fn encode(parts: &[String]) -> Vec<u8> {
            parts
                .iter()
                .fold(KeyBuf::table(table::RUN), |b, s| b.str(s))
                .done()
        }

        fn decode(key: &[u8], n: usize) -> Vec<String> {
            let mut r = KeyReader::new(key, table::RUN).unwrap();
            let parts = (0..n).map(|_| r.str().unwrap()).collect();
            r.end().unwrap();
            parts
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(1000))]

            /// K6: distinct component lists (of any lengths) never share
            /// bytes, and each key reads back to exactly its components.
            #[test]
            fn prop_key_is_injective_and_round_trips(
                a in prop::collection::vec(id(), 1..4),
                b in prop::collection::vec(id(), 1..4),
            ) {
                let (ka, kb) = (encode(&a), encode(&b));
                prop_assert_eq!(a == b, ka == kb);
                prop_assert_eq!(decode(&ka, a.len()), a);
                prop_assert_eq!(decode(&kb, b.len()), b);
            }

            /// Byte order of keys is the lexicographic order of their
            /// component lists (strings by bytes, a prefix list first), so
            /// a range scan over a prefix is exactly that prefix's keys.
            #[test]
            fn prop_key_order_is_component_order(
                a in prop::collection::vec(id(), 1..4),
                b in prop::collection::vec(id(), 1..4),
            ) {
                prop_assert_eq!(encode(&a).cmp(&encode(&b)), a.cmp(&b));
            }

            /// Strings then a fixed-width integer (the index keys' shape)
            /// keep order and injectivity too, and every key of a prefix
            /// sorts below `prefix_end`.
            #[test]
            fn prop_key_with_seq_orders_and_bounds(
                a in (id(), any::<u64>()),
                b in (id(), any::<u64>()),
            ) {
                let k = |(s, n): &(String, u64)| KeyBuf::table(table::RUN).str(s).u64(*n).done();
                let (ka, kb) = (k(&a), k(&b));
                prop_assert_eq!(ka.cmp(&kb), a.cmp(&b));
                let prefix = KeyBuf::table(table::RUN).str(&a.0).done();
                prop_assert!(ka.starts_with(&prefix) && ka < prefix_end(&prefix));
                prop_assert_eq!(kb.starts_with(&prefix), a.0 == b.0);
            }

            /// Garbage never panics the reader.
            #[test]
            fn prop_key_reader_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..40)) {
                if let Ok(mut r) = KeyReader::new(&bytes, table::RUN) {
                    while r.str().is_ok() {}
                    let _ = r.u64();
                    let _ = r.u8();
                    let _ = r.end();
                }
            }
        }
    }
}
