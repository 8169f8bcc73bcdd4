//! The CRC-32 of every stored value (rule D9): IEEE, the one
//! `crc32fast::hash` computes, through one of two paths.
//!
//! crc32fast's fast path (carry-less multiply) needs std's CPU feature
//! detection, which runs at the first checksum of a process: about ten
//! `cpuid` instructions. On a virtual machine each one traps to the
//! hypervisor (~8 µs each on this project's 2-core VM), so the detection
//! took 70–125 µs of an open of a 1M-run store and its first read, ~0.65
//! ms in all, which checksum a few hundred bytes (docs/benchmarks-lab-notes.md, "The open:
//! a CPU probe"). A process therefore checksums its first
//! `TABLE_BUDGET` bytes with a table (slicing by 8, ~0.5 ns a byte here,
//! where crc32fast takes 0.02–0.09 ns a byte for 64–1000 bytes), then
//! hands every later checksum to crc32fast. Both paths give the same CRC.
//! The budget bounds what the table can cost a process more than
//! crc32fast: ~35 µs, once, less than the detection on a VM and more than
//! it on bare metal, where `cpuid` is cheap.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

/// Bytes a process checksums by table before it asks crc32fast: an open
/// and its first reads and writes, many times over.
const TABLE_BUDGET: u64 = 64 << 10;

/// Set once this process has passed [`TABLE_BUDGET`].
static FAST: AtomicBool = AtomicBool::new(false);
/// Bytes checksummed by table so far.
static TABLED: AtomicU64 = AtomicU64::new(0);

/// The CRC-32 (IEEE) of `bytes`.
#[inline]
pub fn crc32(bytes: &[u8]) -> u32 {
    if FAST.load(Relaxed) {
        return crc32fast::hash(bytes);
    }
    let before = TABLED.fetch_add(bytes.len() as u64, Relaxed);
    if before + bytes.len() as u64 > TABLE_BUDGET {
        FAST.store(true, Relaxed);
        return crc32fast::hash(bytes);
    }
    by_table(bytes)
}

/// The reflected IEEE polynomial.
const POLY: u32 = 0xEDB8_8320;

/// `TABLES[0][b]` is the CRC of the byte `b`; `TABLES[k][b]` the CRC of
/// `b` followed by `k` zero bytes, so eight table reads fold eight bytes.
static TABLES: [[u32; 256]; 8] = tables();

const fn tables() -> [[u32; 256]; 8] {
    let mut t = [[0u32; 256]; 8];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut bit = 0;
        while bit < 8 {
            c = if c & 1 == 1 { POLY ^ (c >> 1) } else { c >> 1 };
            bit += 1;
        }
        t[0][i] = c;
        i += 1;
    }
    let mut k = 1;
    while k < 8 {
        let mut i = 0;
        while i < 256 {
            let prev = t[k - 1][i];
            t[k][i] = (prev >> 8) ^ t[0][(prev & 0xFF) as usize];
            i += 1;
        }
        k += 1;
    }
    t
}

/// The CRC-32 of `bytes`, by table.
fn by_table(bytes: &[u8]) -> u32 {
    let t = &TABLES;
    let mut crc = !0u32;
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let lo = u32::from_le_bytes([c[0], c[1], c[2], c[3]]) ^ crc;
        let hi = u32::from_le_bytes([c[4], c[5], c[6], c[7]]);
        crc = t[7][(lo & 0xFF) as usize]
            ^ t[6][((lo >> 8) & 0xFF) as usize]
            ^ t[5][((lo >> 16) & 0xFF) as usize]
            ^ t[4][(lo >> 24) as usize]
            ^ t[3][(hi & 0xFF) as usize]
            ^ t[2][((hi >> 8) & 0xFF) as usize]
            ^ t[1][((hi >> 16) & 0xFF) as usize]
            ^ t[0][(hi >> 24) as usize];
    }
    for &b in chunks.remainder() {
        crc = (crc >> 8) ^ t[0][((crc ^ u32::from(b)) & 0xFF) as usize];
    }
    !crc
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes from a fixed xorshift, so every length sees varied data.
    fn noise(n: usize, mut x: u64) -> Vec<u8> {
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn the_table_gives_crc32fasts_checksum_at_every_length() {
        for n in 0..=1100 {
            let b = noise(n, 0x9E37_79B9_7F4A_7C15 ^ n as u64);
            assert_eq!(by_table(&b), crc32fast::hash(&b), "length {n}");
        }
        // Known answer: the CRC-32 check value.
        assert_eq!(by_table(b"123456789"), 0xCBF4_3926);
        assert_eq!(by_table(&[0xFF; 64]), crc32fast::hash(&[0xFF; 64]));
    }

    #[test]
    fn a_checksum_is_the_same_before_and_after_the_budget() {
        let b = noise(4096, 7);
        let want = crc32fast::hash(&b);
        // Enough calls to pass the budget from any starting point (other
        // tests of this process checksum too).
        let calls = TABLE_BUDGET as usize / b.len() + 2;
        for _ in 0..calls {
            assert_eq!(crc32(&b), want);
        }
        assert!(FAST.load(Relaxed), "past the budget, crc32fast takes over");
        assert_eq!(crc32(&b), want);
    }
}
