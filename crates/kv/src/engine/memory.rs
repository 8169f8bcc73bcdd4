//! The memory engine: an ordered set of rows (key and value in one
//! allocation) behind a reader-writer lock.

use std::cell::RefCell;
use std::cmp::Ordering;
use std::collections::BTreeSet;
use std::ops::Bound;

use super::{Engine, Write};
use crate::sync::RwLock;
use agentstate_core::error::Result;

/// In-process rows; they go when the process does.
#[derive(Debug, Default)]
pub(crate) struct MemoryEngine {
    map: RwLock<BTreeSet<Key>>,
}

/// A stored row: its key and value in one allocation (`bytes` is the key
/// then the value, `len` the key's length), with the key's first 32 bytes
/// kept beside it as four big-endian numbers: most comparisons are decided
/// there, in a few instructions, without a call to `memcmp` (32 bytes hold
/// a run id map key's tenant and a 20-byte run id).
///
/// One allocation a row, not one for the key and one for the value: a
/// create keeps four rows, and what a row costs is mostly the allocator's
/// (the key and value a write brings are freed once copied, so the next
/// write's come back from the allocator's per-thread cache).
///
/// The numbers pad a shorter key with zeros, so two keys with different
/// heads compare as their bytes do (a byte that differs decides both; a
/// key that ends first is a prefix of the other and smaller both ways);
/// with equal heads, the bytes decide.
///
/// The map holds keys in *descending* byte order (`Ord` is the bytes'
/// order reversed), and scans walk it backwards. A `BTreeMap` searches
/// each node from its smallest key, and most writes append: a new run's
/// record, state index and touch index keys are each the greatest of
/// their prefix. In ascending order each such insert compared with every
/// key of every node down its path; in descending order it stops at a
/// node's first keys.
#[derive(Debug, Clone)]
struct Key {
    head: Head,
    /// The key's length: `bytes[..len]` is the key, the rest its value.
    len: usize,
    bytes: Vec<u8>,
}

/// A key's first 32 bytes, zero-padded, as big-endian numbers.
type Head = (u64, u64, u64, u64);

#[allow(
    clippy::expect_used,
    reason = "a slice cut to a fixed length by its range converts to an array of that length"
)]
fn head(bytes: &[u8]) -> Head {
    let mut head = [0u8; 32];
    let n = bytes.len().min(32);
    head[..n].copy_from_slice(&bytes[..n]);
    let word = |i: usize| u64::from_be_bytes(head[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    (word(0), word(1), word(2), word(3))
}

impl Key {
    /// A key with no value (a bound or a probe).
    fn new(bytes: Vec<u8>) -> Key {
        Key {
            head: head(&bytes),
            len: bytes.len(),
            bytes,
        }
    }

    /// A row: `key` and `value` copied into one allocation.
    fn row(key: &[u8], value: &[u8]) -> Key {
        let mut bytes = Vec::with_capacity(key.len() + value.len());
        bytes.extend_from_slice(key);
        bytes.extend_from_slice(value);
        Key {
            head: head(key),
            len: key.len(),
            bytes,
        }
    }

    fn key(&self) -> &[u8] {
        &self.bytes[..self.len]
    }

    fn value(&self) -> &[u8] {
        &self.bytes[self.len..]
    }

    /// The order of the keys' bytes.
    #[inline(always)]
    fn byte_order(&self, other: &Self) -> Ordering {
        self.head
            .cmp(&other.head)
            .then_with(|| self.key().cmp(other.key()))
    }
}

impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        self.byte_order(other) == Ordering::Equal
    }
}

impl Eq for Key {}

impl Ord for Key {
    /// The bytes' order reversed (see the type's docs).
    #[inline(always)]
    fn cmp(&self, other: &Self) -> Ordering {
        other.byte_order(self)
    }
}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

std::thread_local! {
    /// A key to search with, reused by each read of this thread, so a
    /// read allocates none.
    static PROBE: RefCell<Key> = const {
        RefCell::new(Key {
            head: (0, 0, 0, 0),
            len: 0,
            bytes: Vec::new(),
        })
    };
}

impl Engine for MemoryEngine {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let map = self.map.read();
        // Borrowed only while the map is searched (never across a lock);
        // should it be borrowed all the same, a key of its own searches.
        Ok(PROBE.with(|probe| match probe.try_borrow_mut() {
            Ok(mut probe) => {
                probe.head = head(key);
                probe.len = key.len();
                probe.bytes.clear();
                probe.bytes.extend_from_slice(key);
                map.get(&*probe).map(|row| row.value().to_vec())
            }
            Err(_) => map
                .get(&Key::new(key.to_vec()))
                .map(|row| row.value().to_vec()),
        }))
    }

    fn scan(&self, start: &[u8], end: &[u8], limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        if start >= end {
            return Ok(Vec::new());
        }
        let (start, end) = (Key::new(start.to_vec()), Key::new(end.to_vec()));
        let map = self.map.read();
        // Descending: `end` (excluded) comes first, `start` last.
        Ok(map
            .range((Bound::Excluded(&end), Bound::Included(&start)))
            .rev()
            .take(limit)
            .map(|row| (row.key().to_vec(), row.value().to_vec()))
            .collect())
    }

    fn commit(&self, batch: Vec<Write>) -> Result<()> {
        // One write lock for the whole batch: readers see all of it or none.
        let mut map = self.map.write();
        for (k, v) in batch {
            match v {
                Some(v) => {
                    map.replace(Key::row(&k, &v));
                }
                None => {
                    map.remove(&Key::new(k));
                }
            }
        }
        Ok(())
    }

    fn sync(&self) -> Result<()> {
        Ok(())
    }

    fn disk_bytes(&self) -> u64 {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Keys order exactly as their bytes do, reversed in the map (short
        /// keys, zeros, shared prefixes around the 32-byte head included).
        #[test]
        fn prop_key_order_is_byte_order(
            a in prop::collection::vec(prop_oneof![Just(0u8), Just(1u8), any::<u8>()], 0..40),
            b in prop::collection::vec(prop_oneof![Just(0u8), Just(1u8), any::<u8>()], 0..40),
            shared in 0usize..36,
        ) {
            // Half the time, b starts with a's first bytes.
            let b: Vec<u8> = a.iter().take(shared).chain(b.iter()).copied().collect();
            let (ka, kb) = (Key::new(a.clone()), Key::new(b.clone()));
            prop_assert_eq!(ka.byte_order(&kb), a.cmp(&b));
            prop_assert_eq!(ka.cmp(&kb), b.cmp(&a));
            prop_assert_eq!(ka == kb, a == b);
        }
    }

    #[test]
    fn scan_and_get_see_the_byte_order() {
        let e = MemoryEngine::default();
        let keys: Vec<Vec<u8>> = vec![
            vec![],
            vec![0],
            vec![0, 0],
            vec![1],
            vec![1; 16],
            [vec![1; 16], vec![0]].concat(),
            [vec![1; 16], vec![2]].concat(),
            vec![1, 2],
            vec![255; 20],
            vec![2; 32],
            [vec![2; 32], vec![0]].concat(),
            [vec![2; 31], vec![3]].concat(),
        ];
        e.commit(keys.iter().map(|k| (k.clone(), Some(k.clone()))).collect())
            .unwrap();
        let mut sorted = keys.clone();
        sorted.sort();
        let all: Vec<Vec<u8>> = e
            .scan(&[], &[255; 21], 100)
            .unwrap()
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        assert_eq!(all, sorted);
        for k in &keys {
            assert_eq!(e.get(k).unwrap().as_ref(), Some(k));
        }
        assert_eq!(e.get(&[0, 0, 0]).unwrap(), None);
        let mid: Vec<Vec<u8>> = e
            .scan(&[1; 16], &[1, 2], 100)
            .unwrap()
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        assert_eq!(mid, sorted[4..7].to_vec());
        // A limit keeps the smallest keys of the range, ascending.
        let first: Vec<Vec<u8>> = e
            .scan(&[0], &[255; 21], 3)
            .unwrap()
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        assert_eq!(first, sorted[1..4].to_vec());
        assert!(e.scan(&[1, 2], &[1, 2], 10).unwrap().is_empty());
        assert!(e.scan(&[1, 3], &[1, 2], 10).unwrap().is_empty());
        e.commit(vec![(vec![1; 16], None)]).unwrap();
        assert_eq!(e.get(&[1; 16]).unwrap(), None);
    }
}

#[cfg(all(test, loom))]
mod loom_models {
    use super::*;
    use crate::sync::Arc;

    /// A batch of two keys is seen whole or not at all by a concurrent reader.
    #[test]
    fn loom_memory_batch_is_atomic() {
        loom::model(|| {
            let e = Arc::new(MemoryEngine::default());
            let w = {
                let e = e.clone();
                loom::thread::spawn(move || {
                    e.commit(vec![
                        (b"a".to_vec(), Some(b"1".to_vec())),
                        (b"b".to_vec(), Some(b"1".to_vec())),
                    ])
                    .unwrap();
                })
            };
            let seen = e.scan(b"a", b"c", 10).unwrap();
            assert!(
                seen.is_empty() || seen.len() == 2,
                "saw half a batch: {seen:?}"
            );
            w.join().unwrap();
            assert_eq!(e.scan(b"a", b"c", 10).unwrap().len(), 2);
        });
    }
}
