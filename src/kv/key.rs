//! The key codec (rule K6).
//!
//! Every key is one table byte followed by components. A string component
//! is escaped and terminated: `0x00` becomes `0x00 0xFF` and the component
//! ends with `0x00 0x01`. No escaped byte sequence contains the terminator,
//! so the encoding is injective (two different component lists never share
//! bytes) and preserves order (byte order of keys is the lexicographic order
//! of their components). Integers are fixed-width big-endian.

use crate::error::{Result, StateError};

/// Table bytes: each table is a key prefix in one ordered keyspace.
pub(crate) mod table {
    /// KvStore-wide values: format version, next seq, commit counter, secret.
    pub const META: u8 = 0x01;
    /// (tenant, seq) → RunRecord: a tenant's runs clustered in `seq`
    /// order, so a plain listing page is one range scan (store format 2).
    pub const RUN: u8 = 0x08;
    /// (tenant, run_id) → seq: where a run is, for point reads.
    pub const RUN_ID: u8 = 0x09;
    /// (tenant, state, seq) → the RunRecord again while the state is
    /// unfinished (a reaper's page is one range scan); a `RunSummary` once
    /// finished.
    pub const RUN_BY_STATE: u8 = 0x0A;
    /// (tenant, session, seq) → RunSummary.
    pub const RUN_BY_SESSION: u8 = 0x0B;
    /// (tenant, state, updated_at, seq) → (), unfinished runs only: which
    /// runs of a state were last written before a moment, without reading
    /// the others.
    pub const RUN_BY_TOUCH: u8 = 0x0C;
    /// (tenant, label key, label value's canonical JSON, seq) → (): the
    /// runs carrying a label (rule R11), so a label's listing is one range
    /// scan.
    pub const RUN_BY_LABEL: u8 = 0x0D;
    /// (tenant, run_id, hold_id) → HoldRecord (rule B2).
    pub const HOLD: u8 = 0x14;
    /// (tenant, session_id) → SessionRecord.
    pub const SESSION: u8 = 0x20;
    /// (tenant, name) → BudgetRecord and what is spent against it (B1).
    pub const BUDGET: u8 = 0x21;
    /// (tenant, budget name, run_id, hold_id) → HoldRecord: a budget's
    /// holds, so one scan sums them.
    pub const BUDGET_HOLD: u8 = 0x22;
    /// (ns, id) → epoch.
    pub const EPOCH: u8 = 0x30;
    /// (ns, id, tray_ns, tray_id) → Tray.
    pub const TRAY: u8 = 0x31;
    /// (ns, id, tray_ns, tray_id) → (env, hostname), while marked.
    pub const MARKED: u8 = 0x32;
    /// (env, ns, id, tray_ns, tray_id) → (env, hostname), while marked.
    pub const MARKED_BY_ENV: u8 = 0x33;
    /// (ns, id) → due_at.
    pub const ALARM: u8 = 0x40;
    /// (due_at, ns, id) → ().
    pub const ALARM_BY_DUE: u8 = 0x41;
    /// (scope kind, scope, idempotency key) → `Remembered` (rules I1–I6).
    pub const IDEM: u8 = 0x50;
    /// (scope kind, scope, ordinal) → (key, at): a scope's keys, oldest
    /// first, for pruning the window.
    pub const IDEM_ORDER: u8 = 0x51;
    /// (scope kind, scope) → (next ordinal, keys kept).
    pub const IDEM_SCOPE: u8 = 0x52;
    /// (scope, position) → the record's key (and a run's id): the change
    /// feed (rules F1–F8), one entry per record at its last change. A
    /// scope is `FEED_TENANT` + tenant, `FEED_TRAYS`, or `FEED_ENV` + env.
    pub const FEED: u8 = 0x60;
    /// (record key) → its feed position (and a run's id, a tray's env).
    pub const FEED_AT: u8 = 0x61;
    /// (scope) → the position a feed was pruned through.
    pub const FEED_HORIZON: u8 = 0x62;
    /// An import being built: the whole key of a live table after this
    /// byte (see `kv::transfer`). Past every exported table, so listings,
    /// exports, `is_empty` and `verify` never see it.
    pub const STAGE: u8 = 0x7F;

    /// Store format 1's run tables, read only by the upgrade
    /// (`kv::upgrade`) and never written.
    pub mod v1 {
        /// (tenant, run_id) → RunRecord.
        pub const RUN: u8 = 0x10;
        /// (tenant, seq) → run_id.
        pub const RUN_BY_SEQ: u8 = 0x11;
        /// (tenant, state, seq) → run_id.
        pub const RUN_BY_STATE: u8 = 0x12;
        /// (tenant, session, seq) → run_id.
        pub const RUN_BY_SESSION: u8 = 0x13;
    }
}

/// `key` moved into the staging table.
pub(crate) fn staged(key: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(key.len() + 1);
    k.push(table::STAGE);
    k.extend_from_slice(key);
    k
}

/// Meta keys (table META, then one byte).
pub(crate) mod meta {
    pub const FORMAT: &[u8] = &[super::table::META, b'f'];
    pub const NEXT_SEQ: &[u8] = &[super::table::META, b's'];
    pub const COMMITS: &[u8] = &[super::table::META, b'c'];
    pub const SECRET: &[u8] = &[super::table::META, b'k'];
    /// Present while a staged import is being moved into the live tables:
    /// holds the `next_seq` the store has once it is (see `kv::transfer`).
    pub const PUBLISHING: &[u8] = &[super::table::META, b'i'];
    /// Never written: `compact` deletes it to move the engine's sequence
    /// number past every write before it (see `FjallEngine::compact`).
    pub const COMPACT_MARK: &[u8] = &[super::table::META, b'x'];
    /// The next change-feed position; absent in a store from before the
    /// feed, whose open adds every record to it.
    pub const NEXT_FEED: &[u8] = &[super::table::META, b'p'];
    /// Present once every record has a feed entry (a new store, or an
    /// older one after its open filled the feed).
    pub const FEED_FILLED: &[u8] = &[super::table::META, b'e'];
}

const ESC: u8 = 0x00;
const ESCAPED_NUL: u8 = 0xFF;
const TERMINATOR: u8 = 0x01;

/// Builds a key component by component.
#[derive(Debug, Clone)]
pub(crate) struct KeyBuf(Vec<u8>);

impl KeyBuf {
    pub(crate) fn table(table: u8) -> Self {
        let mut v = Vec::with_capacity(64);
        v.push(table);
        KeyBuf(v)
    }
    /// A key whose components after the table byte take `rest` bytes (a
    /// string its length and 2 for its terminator; a NUL in it 1 more, and
    /// the buffer then grows): sized exactly, so a key kept in a map holds
    /// no spare capacity.
    pub(crate) fn sized(table: u8, rest: usize) -> Self {
        let mut v = Vec::with_capacity(1 + rest);
        v.push(table);
        KeyBuf(v)
    }
    pub(crate) fn str(mut self, s: &str) -> Self {
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
    pub(crate) fn u64(mut self, n: u64) -> Self {
        self.0.extend_from_slice(&n.to_be_bytes());
        self
    }
    pub(crate) fn u8(mut self, n: u8) -> Self {
        self.0.push(n);
        self
    }
    pub(crate) fn done(self) -> Vec<u8> {
        self.0
    }
}

/// Reads a key back, component by component.
#[derive(Debug)]
pub(crate) struct KeyReader<'a> {
    rest: &'a [u8],
}

impl<'a> KeyReader<'a> {
    /// Starts after checking the table byte.
    pub(crate) fn new(key: &'a [u8], table: u8) -> Result<Self> {
        match key.split_first() {
            Some((&t, rest)) if t == table => Ok(KeyReader { rest }),
            _ => Err(StateError::corrupt(format!(
                "key of table {table:#04x} expected"
            ))),
        }
    }
    pub(crate) fn str(&mut self) -> Result<String> {
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
    pub(crate) fn u64(&mut self) -> Result<u64> {
        if self.rest.len() < 8 {
            return Err(StateError::corrupt("key integer truncated"));
        }
        let (n, rest) = self.rest.split_at(8);
        self.rest = rest;
        Ok(u64::from_be_bytes(
            n.try_into().expect("split_at(8) gives 8 bytes"),
        ))
    }
    pub(crate) fn u8(&mut self) -> Result<u8> {
        let (&n, rest) = self
            .rest
            .split_first()
            .ok_or_else(|| StateError::corrupt("key byte truncated"))?;
        self.rest = rest;
        Ok(n)
    }
    /// The bytes not read yet.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn rest(&self) -> &'a [u8] {
        self.rest
    }
    /// True when every byte of the key was read.
    pub(crate) fn at_end(&self) -> bool {
        self.rest.is_empty()
    }
    /// Checks that the whole key was read.
    pub(crate) fn end(self) -> Result<()> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(StateError::corrupt("trailing bytes in key"))
        }
    }
}

/// The smallest key strictly greater than every key that starts with
/// `prefix`, or `None` when there is none (all bytes 0xFF).
pub(crate) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
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
pub(crate) fn successor(key: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(key.len() + 1);
    k.extend_from_slice(key);
    k.push(0);
    k
}

#[cfg(test)]
mod tests {
    use super::*;

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
