//! The memory engine: a `BTreeMap` behind a reader-writer lock.

use std::collections::BTreeMap;
use std::ops::Bound;

use super::{Engine, Write};
use crate::error::Result;
use crate::sync::RwLock;

/// In-process rows; they go when the process does.
#[derive(Debug, Default)]
pub(crate) struct MemoryEngine {
    map: RwLock<BTreeMap<Vec<u8>, Vec<u8>>>,
}

impl Engine for MemoryEngine {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        Ok(self.map.read().get(key).cloned())
    }

    fn scan(&self, start: &[u8], end: &[u8], limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        if start >= end {
            return Ok(Vec::new());
        }
        let map = self.map.read();
        Ok(map
            .range::<[u8], _>((Bound::Included(start), Bound::Excluded(end)))
            .take(limit)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect())
    }

    fn commit(&self, batch: Vec<Write>) -> Result<()> {
        // One write lock for the whole batch: readers see all of it or none.
        let mut map = self.map.write();
        for (k, v) in batch {
            match v {
                Some(v) => map.insert(k, v),
                None => map.remove(&k),
            };
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
