//! The checks behind the fuzz targets, shared with the test that replays
//! committed findings (`tests/it/fuzz_regressions.rs` includes this module
//! by path), so a minimized input fails the same way in both places.

pub mod codec;
pub mod ops;
pub mod scrub;

/// Reads structured choices from fuzz bytes.
///
/// A fixed, hand-written decoding rather than `arbitrary`'s derive: a
/// committed regression input then keeps meaning the same operations
/// whatever version of any crate is in use, and the replay test needs no
/// extra dependency. Past the end of the data every read yields zero.
pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Input { data }
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    pub fn byte(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }

    /// A choice in `0..n` (n at most 256).
    pub fn below(&mut self, n: usize) -> usize {
        debug_assert!((1..=256).contains(&n));
        self.byte() as usize % n
    }

    pub fn bool(&mut self) -> bool {
        self.byte() & 1 == 1
    }

    /// Picks one of `items`.
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    pub fn u64(&mut self) -> u64 {
        let mut b = [0u8; 8];
        for x in &mut b {
            *x = self.byte();
        }
        u64::from_le_bytes(b)
    }

    /// Up to `max` raw bytes (length first).
    pub fn bytes(&mut self, max: usize) -> &'a [u8] {
        let n = (self.byte() as usize % (max + 1)).min(self.data.len());
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        head
    }

    /// Up to `max` bytes as text (invalid UTF-8 replaced).
    pub fn string(&mut self, max: usize) -> String {
        String::from_utf8_lossy(self.bytes(max)).into_owned()
    }

    /// Everything that is left.
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.data)
    }
}
