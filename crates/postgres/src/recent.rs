//! What a store last saw of the records it wrote or read (runs, budgets,
//! holds): the guesses its one-round-trip writes decide against. A hint
//! only (the server checks every guess against the locked row), so it is
//! bounded and forgets freely, but it must keep what is in use: a store
//! that cycles through many records must not evict the ones its callers
//! are working on (an arbitrary eviction did, often the newest).
//!
//! Two generations, the cheap approximation of least-recently-used: new
//! and refreshed entries go to the young map; when it is full (half the
//! bounds), the old map is dropped and the young one becomes old. A hit in
//! the old map moves the entry back to the young one. An entry in use
//! survives as long as it is touched once per generation.

use std::collections::HashMap;
use std::hash::Hash;

/// A [`Recent`] shared by a store's calls.
pub(crate) type Shared<K, V> = parking_lot::Mutex<Recent<K, V>>;

/// A bounded map of recently seen entries, each with a weight (its bytes).
pub(crate) struct Recent<K, V> {
    young: HashMap<K, (V, usize)>,
    old: HashMap<K, (V, usize)>,
    young_weight: usize,
    old_weight: usize,
    /// Most entries, and most weight, in both maps together.
    max_len: usize,
    max_weight: usize,
}

impl<K: Eq + Hash + Clone, V: Clone> Recent<K, V> {
    pub(crate) fn new(max_len: usize, max_weight: usize) -> Self {
        Recent {
            young: HashMap::new(),
            old: HashMap::new(),
            young_weight: 0,
            old_weight: 0,
            max_len,
            max_weight,
        }
    }

    /// The entry for `k`, which counts as a use.
    pub(crate) fn get(&mut self, k: &K) -> Option<V> {
        if let Some((v, _)) = self.young.get(k) {
            return Some(v.clone());
        }
        let (v, w) = self.old.remove(k)?;
        self.old_weight -= w;
        self.insert(k.clone(), v.clone(), w);
        Some(v)
    }

    /// Remembers `v` (of weight `w`) for `k`, in place of what was.
    pub(crate) fn insert(&mut self, k: K, v: V, w: usize) {
        self.remove(&k);
        if w > self.max_weight / 2 {
            return;
        }
        if self.young.len() + 1 > self.max_len / 2 || self.young_weight + w > self.max_weight / 2 {
            self.old = std::mem::take(&mut self.young);
            self.old_weight = std::mem::take(&mut self.young_weight);
        }
        self.young_weight += w;
        self.young.insert(k, (v, w));
    }

    pub(crate) fn remove(&mut self, k: &K) {
        if let Some((_, w)) = self.young.remove(k) {
            self.young_weight -= w;
        }
        if let Some((_, w)) = self.old.remove(k) {
            self.old_weight -= w;
        }
    }

    /// Keeps only the entries `keep` says to.
    pub(crate) fn retain(&mut self, keep: impl Fn(&K) -> bool) {
        for (map, weight) in [
            (&mut self.young, &mut self.young_weight),
            (&mut self.old, &mut self.old_weight),
        ] {
            map.retain(|k, (_, w)| {
                let kept = keep(k);
                if !kept {
                    *weight -= *w;
                }
                kept
            });
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.young.len() + self.old.len()
    }
}

#[cfg(test)]
mod tests {
    use super::Recent;

    #[test]
    fn entries_in_use_survive_a_stream_of_new_ones() {
        let mut r = Recent::new(100, usize::MAX);
        for k in 0..10u32 {
            r.insert(k, k, 1);
        }
        // 10,000 one-off entries pass through; the ten are used between.
        for k in 1_000..11_000u32 {
            r.insert(k, k, 1);
            if k % 20 == 0 {
                for used in 0..10u32 {
                    assert_eq!(r.get(&used), Some(used), "entry {used} in use was lost");
                }
            }
            assert!(r.len() <= 100);
        }
    }

    #[test]
    fn the_weight_is_bounded_and_an_entry_too_heavy_is_not_kept() {
        let mut r = Recent::new(usize::MAX, 1_000);
        for k in 0..1_000u32 {
            r.insert(k, (), 10);
            assert!(r.young_weight + r.old_weight <= 1_000);
        }
        r.insert(5_000, (), 501);
        assert_eq!(r.get(&5_000), None);
        r.remove(&999);
        r.retain(|k| k % 2 == 0);
        assert!(r.get(&998).is_some() && r.get(&997).is_none());
    }
}
