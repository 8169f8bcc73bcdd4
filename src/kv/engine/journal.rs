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
use std::path::{Path, PathBuf};

use crate::error::{Result, StateError};

/// Each key's last journaled write: `Some(value)` or `None` (deleted).
type LastWrites = HashMap<Vec<u8>, Option<Vec<u8>>>;

const TAG_START: u8 = 1;
const TAG_ITEM: u8 = 2;
const TAG_END: u8 = 3;
const TAG_CLEAR: u8 = 4;
const TRAILER: &[u8] = b"FJL\x03";

/// A cursor over one journal file's bytes.
struct Bytes<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Bytes<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n)?;
        let s = self.buf.get(self.at..end)?;
        self.at = end;
        Some(s)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }
}

/// One write of a batch, or a clear of a keyspace.
enum Op<'a> {
    Put(u64, &'a [u8], &'a [u8]),
    Delete(u64, &'a [u8]),
    /// A write the check cannot read (a compressed value): the key is
    /// left out of the check.
    Unknown(u64, &'a [u8]),
    Clear(u64),
}

/// The next whole batch and its sequence number, or `None` at the end of
/// what can be read.
fn next_batch<'a>(b: &mut Bytes<'a>) -> Option<(u64, Vec<Op<'a>>)> {
    if b.u8()? != TAG_START {
        return None;
    }
    let count = b.u32()?;
    let seqno = b.u64()?;
    let mut ops = Vec::with_capacity(count.min(1 << 16) as usize);
    for _ in 0..count {
        match b.u8()? {
            TAG_ITEM => {
                let value_type = b.u8()?;
                let compression = b.u8()?;
                let keyspace = b.u64()?;
                let key_len = usize::from(b.u16()?);
                let _value_len = b.u32()?;
                let stored_len = b.u32()? as usize;
                let key = b.take(key_len)?;
                let value = b.take(stored_len)?;
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
    if b.u8()? != TAG_END {
        return None;
    }
    let _checksum = b.u64()?;
    (b.take(TRAILER.len())? == TRAILER).then_some((seqno, ops))
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
    for file in journal_files(dir)? {
        let buf = match std::fs::read(&file) {
            Ok(buf) => buf,
            // Flushed and removed by the engine meanwhile.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                return Err(StateError::unavailable(
                    format!("reading {}: {e}", file.display()),
                    Some(e),
                ));
            }
        };
        let mut b = Bytes { buf: &buf, at: 0 };
        while let Some((seqno, ops)) = next_batch(&mut b) {
            if prev.is_some_and(|p| seqno <= p) {
                return Err(out_of_order(
                    dir,
                    &format!("batch {seqno} follows batch {}", prev.unwrap_or(0)),
                ));
            }
            prev = Some(seqno);
            let seed = first.is_none();
            let last = first.get_or_insert_with(LastWrites::new);
            for op in ops {
                let (ks, key, value) = match op {
                    Op::Put(ks, k, v) => (ks, k, Some(Some(v))),
                    Op::Delete(ks, k) => (ks, k, Some(None)),
                    Op::Unknown(ks, k) => (ks, k, None),
                    Op::Clear(ks) => {
                        if ks == keyspace {
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
        }
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
    fn garbage_is_read_as_no_batches_never_a_panic() {
        for bytes in [
            &b""[..],
            b"\x01",
            b"\x01\xff\xff\xff\xff",
            b"\x02\x00",
            &[1; 64],
        ] {
            let mut b = Bytes { buf: bytes, at: 0 };
            assert!(next_batch(&mut b).is_none());
        }
    }
}
