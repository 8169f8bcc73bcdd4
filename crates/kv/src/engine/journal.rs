//! A check of fjall's journal replay (rule D5), run at every open before
//! any read is served.
//!
//! fjall's batch checksum covers a batch's items but not its start
//! sequence number, so a damaged sequence number can replay a batch out of
//! order: a key then reads as an older version, with no error. This module
//! reads the journal files fjall replayed (after fjall opened them, so
//! after it cut off any torn tail) and checks that replay order is file
//! order:
//!
//! - the batches' sequence numbers strictly increase in file order (files
//!   oldest first); a batch whose number moved past a neighbour's breaks
//!   that, so every reordering inside the journals is caught;
//! - the first batch of the oldest journal has no neighbour before it (its
//!   journal's predecessor was flushed and removed): a number moved below
//!   what was flushed would hide its writes behind older table data, so
//!   each key it wrote must read back as its last write in file order.
//!
//! Either failing is `Corrupt`. The cost is one read of the journals (which
//! fjall's own replay reads anyway) and one point read per key of one
//! batch.
//!
//! The journal layout is fjall 3.1's (`src/journal/entry.rs`): a batch is
//! `Start { tag 1, item count u32, seqno u64 }`, that many `Item { tag 2,
//! value type u8, compression u8, keyspace id u64, key length u16, value
//! length u32, stored length u32, key, value }` or `Clear { tag 4, keyspace
//! id u64 }`, then `End { tag 3, checksum u64, "FJL\x03" }`; integers
//! little-endian. Only whole batches count; anything the parser cannot
//! read ends the file's batches there (fjall already refused or cut it).

use std::collections::HashMap;
use std::fs::File;
use std::hash::{BuildHasherDefault, Hasher};
use std::io::{BufRead, Read, Seek, SeekFrom};
use std::ops::Range;
use std::path::{Path, PathBuf};

use agentstate_core::error::{Result, StateError};

/// Each key's last journaled write: `Some(value)` or `None` (deleted).
type LastWrites = HashMap<Vec<u8>, Option<Vec<u8>>, BuildHasherDefault<KeyHasher>>;

/// The hash of the check's key set: a multiply-rotate over 8-byte words
/// (FxHash's step). Every replayed item of every later batch is looked up
/// in the oldest batch's keys, and std's SipHash made that lookup most of
/// the check's cost. The keys are the store's own journal's, so no
/// adversary chooses them to collide.
#[derive(Default, Clone, Copy)]
struct KeyHasher(u64);

impl KeyHasher {
    const K: u64 = 0x51_7c_c1_b7_27_22_0a_95;

    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(Self::K);
    }
}

impl Hasher for KeyHasher {
    #[allow(
        clippy::expect_used,
        reason = "a slice cut to a fixed length by its range converts to an array of that length"
    )]
    fn write(&mut self, bytes: &[u8]) {
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            self.add(u64::from_le_bytes(w.try_into().expect("8 bytes")));
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            let mut last = [0u8; 8];
            last[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(last));
        }
    }

    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

const TAG_START: u8 = 1;
const TAG_ITEM: u8 = 2;
const TAG_END: u8 = 3;
const TAG_CLEAR: u8 = 4;
const TRAILER: &[u8] = b"FJL\x03";

/// At most how much of a journal file is read at a time: the check
/// streams the files rather than holding one in memory.
const READ_BUF: usize = 256 * 1024;
/// The first read of a journal file. A clean close leaves an empty
/// journal in a file of written zeros, so a first read of `READ_BUF` copied
/// 256 KiB of zeros into a buffer mapped and unmapped for it at every open
/// (40–60 µs of a ~1 ms open); each later read doubles, up to `READ_BUF`.
const FIRST_READ: usize = 4 * 1024;

/// A buffered reader of a file whose reads start at `FIRST_READ` bytes and
/// double up to `READ_BUF`: a journal that ends early costs one small
/// read, a long one is streamed in large reads.
struct Growing {
    f: File,
    buf: Vec<u8>,
    /// The unread bytes are `buf[pos..end]`.
    pos: usize,
    end: usize,
    next: usize,
}

impl Growing {
    fn new(f: File) -> Growing {
        Growing {
            f,
            buf: Vec::new(),
            pos: 0,
            end: 0,
            next: FIRST_READ,
        }
    }
}

impl Read for Growing {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        let n = {
            let have = self.fill_buf()?;
            let n = have.len().min(out.len());
            out[..n].copy_from_slice(&have[..n]);
            n
        };
        self.consume(n);
        Ok(n)
    }
}

impl BufRead for Growing {
    fn fill_buf(&mut self) -> std::io::Result<&[u8]> {
        if self.pos == self.end {
            if self.buf.len() < self.next {
                self.buf.resize(self.next, 0);
            }
            self.pos = 0;
            self.end = 0;
            self.end = loop {
                match self.f.read(&mut self.buf[..self.next]) {
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    r => break r?,
                }
            };
            self.next = (self.next * 2).min(READ_BUF);
        }
        Ok(&self.buf[self.pos..self.end])
    }

    fn consume(&mut self, n: usize) {
        self.pos = (self.pos + n).min(self.end);
    }
}

/// A reader of one journal file's entries, counting the bytes consumed.
struct Bytes<R> {
    r: R,
    at: u64,
}

impl<R: BufRead> Bytes<R> {
    fn fill(&mut self, buf: &mut [u8]) -> Option<()> {
        self.r.read_exact(buf).ok()?;
        self.at += buf.len() as u64;
        Some(())
    }
    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        let mut b = [0u8; N];
        self.fill(&mut b)?;
        Some(b)
    }
    fn u8(&mut self) -> Option<u8> {
        self.array::<1>().map(|b| b[0])
    }
    fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_le_bytes)
    }
    /// Appends `n` bytes to `arena`; returns where they start.
    fn take_into(&mut self, n: usize, arena: &mut Vec<u8>) -> Option<usize> {
        let from = arena.len();
        let mut left = n;
        while left > 0 {
            let chunk = match self.r.fill_buf() {
                Ok(chunk) if !chunk.is_empty() => chunk,
                _ => {
                    arena.truncate(from);
                    return None;
                }
            };
            let k = chunk.len().min(left);
            arena.extend_from_slice(&chunk[..k]);
            self.r.consume(k);
            left -= k;
        }
        self.at += n as u64;
        Some(from)
    }
    /// Steps over `n` bytes without copying them.
    fn skip(&mut self, n: usize) -> Option<()> {
        let mut left = n;
        while left > 0 {
            let avail = self.r.fill_buf().ok()?.len();
            if avail == 0 {
                return None;
            }
            let k = avail.min(left);
            self.r.consume(k);
            left -= k;
        }
        self.at += n as u64;
        Some(())
    }
}

/// One write of a batch, or a clear of a keyspace; keys and values are
/// ranges of the batch's arena.
enum Op {
    Put(u64, Range<usize>, Range<usize>),
    Delete(u64, Range<usize>),
    /// A write the check cannot read (a compressed value): the key is
    /// left out of the check.
    Unknown(u64, Range<usize>),
    /// A write whose value the reader did not ask for (stepped over).
    Skipped,
    Clear(u64),
}

/// One whole batch of a journal.
struct Batch {
    seqno: u64,
    ops: Vec<Op>,
    /// The keys and values the ops point into.
    arena: Vec<u8>,
}

/// What a reader of batches wants of each write.
enum Want<'a> {
    /// Only the batches' numbers and ends.
    Numbers,
    /// Every key, and the value of the writes `value` says yes to
    /// (keyspace, key); the others are `Op::Skipped`.
    Keys(&'a dyn Fn(u64, &[u8]) -> bool),
}

/// The next whole batch, or `None` at the end of what can be read.
#[allow(
    clippy::expect_used,
    reason = "a slice cut to a fixed length by its range converts to an array of that length"
)]
fn next_batch<R: BufRead>(b: &mut Bytes<R>, arena: Vec<u8>, want: &Want<'_>) -> Option<Batch> {
    let mut arena = arena;
    arena.clear();
    if b.u8()? != TAG_START {
        return None;
    }
    let start: [u8; 12] = b.array()?;
    let count = u32::from_le_bytes(start[..4].try_into().expect("4 bytes"));
    let seqno = u64::from_le_bytes(start[4..].try_into().expect("8 bytes"));
    let mut ops = Vec::with_capacity(count.min(1 << 16) as usize);
    for _ in 0..count {
        match b.u8()? {
            TAG_ITEM => {
                // The item's fixed fields in one read: value type,
                // compression, keyspace id (8), key length (2), value
                // length (4), stored length (4).
                let h: [u8; 20] = b.array()?;
                let (value_type, compression) = (h[0], h[1]);
                let keyspace = u64::from_le_bytes(h[2..10].try_into().expect("8 bytes"));
                let key_len = usize::from(u16::from_le_bytes([h[10], h[11]]));
                let stored_len =
                    u32::from_le_bytes(h[16..20].try_into().expect("4 bytes")) as usize;
                let Want::Keys(wants_value) = want else {
                    b.skip(key_len + stored_len)?;
                    continue;
                };
                let k = b.take_into(key_len, &mut arena)?;
                let key = k..k + key_len;
                if !wants_value(keyspace, &arena[key.clone()]) {
                    b.skip(stored_len)?;
                    arena.truncate(k);
                    ops.push(Op::Skipped);
                    continue;
                }
                let v = b.take_into(stored_len, &mut arena)?;
                let value = v..v + stored_len;
                ops.push(match (value_type, compression) {
                    (0, 0) => Op::Put(keyspace, key, value),
                    // Tombstone and weak tombstone.
                    (1 | 2, _) => Op::Delete(keyspace, key),
                    _ => Op::Unknown(keyspace, key),
                });
            }
            TAG_CLEAR => ops.push(Op::Clear(b.u64()?)),
            _ => return None,
        }
    }
    // End: tag, checksum (8), trailer (4).
    let end: [u8; 13] = b.array()?;
    (end[0] == TAG_END && end[9..] == *TRAILER).then_some(Batch { seqno, ops, arena })
}

/// Opens a journal file for streaming, or `None` when it is gone (the
/// engine removed it meanwhile).
fn open_journal(file: &Path) -> Result<Option<Bytes<Growing>>> {
    match File::open(file) {
        Ok(f) => Ok(Some(Bytes {
            r: Growing::new(f),
            at: 0,
        })),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(StateError::unavailable(
            format!("reading {}: {e}", file.display()),
            Some(e),
        )),
    }
}

/// The journal files of the database at `dir`, oldest first.
fn journal_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| StateError::unavailable(format!("listing {}: {e}", dir.display()), Some(e)))?;
    let mut files: Vec<(u64, PathBuf)> = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| {
            StateError::unavailable(format!("listing {}: {e}", dir.display()), Some(e))
        })?;
        let name = entry.file_name();
        let Some(id) = name
            .to_str()
            .and_then(|n| n.strip_suffix(".jnl"))
            .and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        files.push((id, entry.path()));
    }
    files.sort();
    Ok(files.into_iter().map(|(_, p)| p).collect())
}

fn out_of_order(dir: &Path, why: &str) -> StateError {
    StateError::corrupt(format!(
        "the journal in {} replays out of order: {why} (a batch's sequence number is damaged); \
         the store is not served",
        dir.display()
    ))
}

/// Checks the journals under `dir` (see the module docs); `read` reads a
/// key of `keyspace` from the engine after its replay.
pub(crate) fn check_replay(
    dir: &Path,
    keyspace: u64,
    mut read: impl FnMut(&[u8]) -> Result<Option<Vec<u8>>>,
) -> Result<()> {
    // Each key of the oldest batch, with its last write in file order.
    let mut first: Option<LastWrites> = None;
    let mut prev: Option<u64> = None;
    let mut arena = Vec::new();
    for file in journal_files(dir)? {
        let Some(mut b) = open_journal(&file)? else {
            continue;
        };
        loop {
            // The oldest batch keeps every value of `keyspace`; later ones
            // only those of its keys still tracked.
            let wants = |ks: u64, key: &[u8]| {
                ks == keyspace && first.as_ref().is_none_or(|last| last.contains_key(key))
            };
            let Some(batch) = next_batch(&mut b, arena, &Want::Keys(&wants)) else {
                break;
            };
            let seqno = batch.seqno;
            if prev.is_some_and(|p| seqno <= p) {
                return Err(out_of_order(
                    dir,
                    &format!("batch {seqno} follows batch {}", prev.unwrap_or(0)),
                ));
            }
            prev = Some(seqno);
            let seed = first.is_none();
            let last = first.get_or_insert_with(LastWrites::default);
            let bytes = &batch.arena;
            for op in &batch.ops {
                let (ks, key, value) = match op {
                    Op::Put(ks, k, v) => (*ks, &bytes[k.clone()], Some(Some(&bytes[v.clone()]))),
                    Op::Delete(ks, k) => (*ks, &bytes[k.clone()], Some(None)),
                    Op::Unknown(ks, k) => (*ks, &bytes[k.clone()], None),
                    Op::Skipped => continue,
                    Op::Clear(ks) => {
                        if *ks == keyspace {
                            last.clear();
                        }
                        continue;
                    }
                };
                if ks != keyspace || !(seed || last.contains_key(key)) {
                    continue;
                }
                match value {
                    Some(v) => {
                        last.insert(key.to_vec(), v.map(<[u8]>::to_vec));
                    }
                    // A write the check cannot read: leave the key out.
                    None => {
                        last.remove(key);
                    }
                }
            }
            arena = batch.arena;
        }
        arena = Vec::new();
    }
    for (key, want) in first.unwrap_or_default() {
        if read(&key)? != want {
            return Err(out_of_order(
                dir,
                "a key of its oldest batch reads otherwise than its last journaled write",
            ));
        }
    }
    Ok(())
}

/// How far past the last whole batch a journal must hold only zeros for
/// `remove_flushed` to empty it.
const ZERO_TAIL: u64 = 64 * 1024;

/// Whether the bytes of `file` from `from` on are zeros, up to
/// `ZERO_TAIL` of them or the end. fjall preallocates its journals, so a
/// journal's last batch is followed by zeros, and its recovery stops at the
/// first byte that is no entry tag (0 is none) and cuts the file there:
/// nothing past it is ever replayed. The window is a margin beyond that.
fn zeros_from(file: &Path, from: u64) -> std::io::Result<bool> {
    let mut f = File::open(file)?;
    f.seek(SeekFrom::Start(from))?;
    let mut tail = Vec::new();
    f.take(ZERO_TAIL).read_to_end(&mut tail)?;
    Ok(tail.iter().all(|&b| b == 0))
}

/// After a clean close: empties, oldest first, the journal files under
/// `dir` whose every batch has a sequence number at or below `covered`
/// (the engine's tables hold all of them) and whose last batch is
/// followed by zeros or nothing (`zeros_from`); stops at the first file that does not qualify, so what is left
/// is always the newest journals, in order. Older files are removed; the
/// newest, the one fjall appends to, is replaced by an empty file (temp
/// file, fsync, rename), because fjall recovers its sequence counter from
/// the tables only when it finds an active journal to replay: with none it
/// would start again at 0 and hide every table entry from its snapshots.
/// Returns how many files were emptied.
///
/// Safe at any moment of a crash: every journal removed or emptied held
/// only batches the tables hold, and fjall's replay skips those of a
/// journal left behind.
pub(crate) fn remove_flushed(dir: &Path, covered: u64) -> Result<usize> {
    let files = journal_files(dir)?;
    let mut emptied = 0;
    for (i, file) in files.iter().enumerate() {
        let Some(mut b) = open_journal(file)? else {
            continue;
        };
        let mut arena = Vec::new();
        let mut end = 0;
        let mut newer = false;
        while let Some(batch) = next_batch(&mut b, arena, &Want::Numbers) {
            if batch.seqno > covered {
                newer = true;
                break;
            }
            end = b.at;
            arena = batch.arena;
        }
        drop(b);
        if end == 0 && std::fs::metadata(file).is_ok_and(|m| m.len() == 0) {
            // Already empty.
            continue;
        }
        let whole = zeros_from(file, end).map_err(|e| io_err(file, e))?;
        if newer || !whole {
            break;
        }
        if i + 1 < files.len() {
            std::fs::remove_file(file).map_err(|e| io_err(file, e))?;
        } else {
            let tmp = file.with_extension("jnl.tmp");
            File::create(&tmp)
                .and_then(|f| f.sync_all())
                .and_then(|()| std::fs::rename(&tmp, file))
                .map_err(|e| io_err(file, e))?;
        }
        emptied += 1;
    }
    if emptied > 0 {
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io_err(dir, e))?;
    }
    Ok(emptied)
}

fn io_err(path: &Path, e: std::io::Error) -> StateError {
    StateError::unavailable(format!("journal {}: {e}", path.display()), Some(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A test item: keyspace, key, value (`None` deletes).
    type Item<'a> = (u64, &'a [u8], Option<&'a [u8]>);

    fn batch(seqno: u64, items: &[Item<'_>]) -> Vec<u8> {
        let mut out = vec![TAG_START];
        out.extend((items.len() as u32).to_le_bytes());
        out.extend(seqno.to_le_bytes());
        for (ks, k, v) in items {
            out.push(TAG_ITEM);
            out.push(if v.is_some() { 0 } else { 1 });
            out.push(0);
            out.extend(ks.to_le_bytes());
            out.extend((k.len() as u16).to_le_bytes());
            let v = v.unwrap_or_default();
            out.extend((v.len() as u32).to_le_bytes());
            out.extend((v.len() as u32).to_le_bytes());
            out.extend(*k);
            out.extend(v);
        }
        out.push(TAG_END);
        out.extend(0u64.to_le_bytes());
        out.extend(TRAILER);
        out
    }

    fn write(dir: &Path, name: &str, batches: &[Vec<u8>]) {
        std::fs::write(dir.join(name), batches.concat()).unwrap();
    }

    #[test]
    fn replay_in_file_order_passes_and_torn_tails_are_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let torn = batch(9, &[(1, b"a", Some(b"9"))]);
        write(
            d,
            "0.jnl",
            &[
                batch(2, &[(1, b"a", Some(b"1")), (0, b"meta", Some(b"x"))]),
                batch(3, &[(1, b"a", Some(b"2")), (1, b"b", Some(b"1"))]),
            ],
        );
        write(
            d,
            "1.jnl",
            &[
                batch(5, &[(1, b"b", None)]),
                torn[..torn.len() - 2].to_vec(),
            ],
        );
        std::fs::write(d.join("junk.txt"), b"x").unwrap();
        // The oldest batch wrote `a`; its last write is "2".
        let engine = |k: &[u8]| Ok((k == b"a").then(|| b"2".to_vec()));
        check_replay(d, 1, engine).unwrap();
        // `a` reads older (the oldest batch hid behind flushed data).
        let older = |k: &[u8]| Ok((k == b"a").then(|| b"0".to_vec()));
        let e = check_replay(d, 1, older).unwrap_err();
        assert!(matches!(e, StateError::Corrupt { .. }), "{e:?}");
    }

    #[test]
    fn a_batch_numbered_past_a_neighbour_is_corrupt() {
        for (name, seqnos) in [("within a file", [2, 7, 4]), ("across files", [2, 3, 3])] {
            let dir = tempfile::tempdir().unwrap();
            let [a, b, c] = seqnos;
            write(dir.path(), "0.jnl", &[batch(a, &[]), batch(b, &[])]);
            write(dir.path(), "1.jnl", &[batch(c, &[])]);
            let e = check_replay(dir.path(), 1, |_| Ok(None)).unwrap_err();
            assert!(e.to_string().contains("out of order"), "{name}: {e}");
        }
    }

    #[test]
    fn only_whole_covered_journals_are_emptied_oldest_first() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let padded = |batches: &[Vec<u8>]| {
            let mut b = batches.concat();
            b.resize(b.len() + 100, 0);
            b
        };
        std::fs::write(d.join("1.jnl"), padded(&[batch(2, &[]), batch(3, &[])])).unwrap();
        std::fs::write(d.join("2.jnl"), padded(&[batch(4, &[])])).unwrap();
        std::fs::write(d.join("3.jnl"), padded(&[batch(5, &[])])).unwrap();
        // Batch 5 is newer than what the tables cover: 3.jnl stays.
        assert_eq!(remove_flushed(d, 4).unwrap(), 2);
        assert!(!d.join("1.jnl").exists() && !d.join("2.jnl").exists());
        assert!(std::fs::metadata(d.join("3.jnl")).unwrap().len() > 0);
        // Covered: the newest journal is emptied, not removed.
        assert_eq!(remove_flushed(d, 5).unwrap(), 1);
        assert_eq!(std::fs::metadata(d.join("3.jnl")).unwrap().len(), 0);
        assert_eq!(remove_flushed(d, 5).unwrap(), 0);
        // Bytes after the last batch that are not zeros (something the
        // parser cannot read) keep that journal and every newer one.
        let mut odd = batch(6, &[]);
        odd.extend(b"\x07junk");
        std::fs::write(d.join("4.jnl"), odd).unwrap();
        std::fs::write(d.join("5.jnl"), padded(&[batch(7, &[])])).unwrap();
        assert_eq!(remove_flushed(d, 100).unwrap(), 0);
        assert!(d.join("4.jnl").exists() && std::fs::metadata(d.join("5.jnl")).unwrap().len() > 0);
    }

    #[test]
    fn a_long_journal_is_read_whole_across_growing_reads() {
        // ~700 KB of batches: they straddle the first small reads, the
        // doubling ones and several of READ_BUF.
        let value = [7u8; 200];
        let batches: Vec<Vec<u8>> = (0..3000u64)
            .map(|i| {
                batch(
                    10 + i,
                    &[(1, format!("k{}", i % 50).as_bytes(), Some(&value))],
                )
            })
            .collect();
        assert!(batches.concat().len() > 2 * READ_BUF);
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "0.jnl", &batches);
        // The oldest batch wrote k0; its last write is the same value.
        let engine = |k: &[u8]| Ok((k == b"k0").then(|| value.to_vec()));
        check_replay(dir.path(), 1, engine).unwrap();
        // The last batch renumbered below its neighbour, far past the
        // first reads: found.
        let mut renumbered = batches.clone();
        *renumbered.last_mut().unwrap() = batch(5, &[(1, b"k0", Some(&value))]);
        write(dir.path(), "0.jnl", &renumbered);
        let e = check_replay(dir.path(), 1, engine).unwrap_err();
        assert!(e.to_string().contains("out of order"), "{e}");
        // Read through `Read` too, byte for byte.
        let mut g = Growing::new(File::open(dir.path().join("0.jnl")).unwrap());
        let mut all = Vec::new();
        g.read_to_end(&mut all).unwrap();
        assert_eq!(all, renumbered.concat());
    }

    #[test]
    fn garbage_is_read_as_no_batches_never_a_panic() {
        for bytes in [
            &b""[..],
            b"\x01",
            b"\x01\xff\xff\xff\xff",
            b"\x02\x00",
            &[1; 64],
        ] {
            let mut b = Bytes { r: bytes, at: 0 };
            assert!(next_batch(&mut b, Vec::new(), &Want::Numbers).is_none());
            let mut b = Bytes { r: bytes, at: 0 };
            assert!(next_batch(&mut b, Vec::new(), &Want::Keys(&|_, _| true)).is_none());
        }
    }
}
