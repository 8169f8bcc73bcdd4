//! A check of fjall's journal replay (rule D5), run at every open before
//! any read is served.
//!
//! fjall's batch checksum covers a batch's items but not its start
//! sequence number, so a damaged sequence number can replay a batch out of
//! order: a key then reads as an older version, with no error. This module
//! reads the journal files fjall replayed (after fjall opened them, so
//! after it cut off any torn tail) in file order, takes each key's last
//! write in that order, and the engine must read exactly that back. A key
//! that reads otherwise was reordered: the store is `Corrupt`.
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
pub(crate) type LastWrites = HashMap<Vec<u8>, Option<Vec<u8>>>;

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

/// The next whole batch, or `None` at the end of what can be read.
fn next_batch<'a>(b: &mut Bytes<'a>) -> Option<Vec<Op<'a>>> {
    if b.u8()? != TAG_START {
        return None;
    }
    let count = b.u32()?;
    let _seqno = b.u64()?;
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
    (b.take(TRAILER.len())? == TRAILER).then_some(ops)
}

/// The journal files of the database at `dir`, oldest first.
fn journal_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir).map_err(|e| {
        StateError::unavailable(format!("listing {}: {e}", dir.display()), Some(e))
    })?;
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

/// Every key of `keyspace` written in the journals under `dir`, with its
/// last write in journal order. Keys whose last write cannot be read (a
/// compressed value) are left out. A file that is gone was flushed and
/// removed by the engine meanwhile: what it held is in the tables.
pub(crate) fn last_writes(dir: &Path, keyspace: u64) -> Result<LastWrites> {
    let mut last = LastWrites::new();
    for file in journal_files(dir)? {
        let buf = match std::fs::read(&file) {
            Ok(buf) => buf,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                return Err(StateError::unavailable(
                    format!("reading {}: {e}", file.display()),
                    Some(e),
                ));
            }
        };
        let mut b = Bytes { buf: &buf, at: 0 };
        while let Some(ops) = next_batch(&mut b) {
            for op in ops {
                match op {
                    Op::Put(ks, k, v) if ks == keyspace => {
                        last.insert(k.to_vec(), Some(v.to_vec()));
                    }
                    Op::Delete(ks, k) if ks == keyspace => {
                        last.insert(k.to_vec(), None);
                    }
                    Op::Unknown(ks, k) if ks == keyspace => {
                        last.remove(k);
                    }
                    Op::Clear(ks) if ks == keyspace => last.clear(),
                    _ => {}
                }
            }
        }
    }
    Ok(last)
}

/// Checks that `read` (the engine after its replay) returns each key's
/// last journaled write.
pub(crate) fn check_replay(
    dir: &Path,
    keyspace: u64,
    mut read: impl FnMut(&[u8]) -> Result<Option<Vec<u8>>>,
) -> Result<()> {
    for (key, want) in last_writes(dir, keyspace)? {
        let got = read(&key)?;
        if got != want {
            return Err(StateError::corrupt(format!(
                "the journal in {} replayed out of order: a key reads {} instead of its last \
                 journaled write (a batch's sequence number is damaged); the store is not served",
                dir.display(),
                if got.is_none() {
                    "as deleted"
                } else {
                    "an older value"
                }
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(seqno: u64, items: &[(u64, &[u8], Option<&[u8]>)]) -> Vec<u8> {
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

    #[test]
    fn last_write_in_file_order_wins_and_torn_tails_are_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let mut j0 = batch(1, &[(1, b"a", Some(b"1")), (0, b"meta", Some(b"x"))]);
        j0.extend(batch(2, &[(1, b"a", Some(b"2")), (1, b"b", Some(b"1"))]));
        let mut j1 = batch(3, &[(1, b"b", None)]);
        // A torn batch at the end: not counted.
        let torn = batch(4, &[(1, b"a", Some(b"3"))]);
        j1.extend(&torn[..torn.len() - 2]);
        std::fs::write(dir.path().join("0.jnl"), j0).unwrap();
        std::fs::write(dir.path().join("1.jnl"), j1).unwrap();
        std::fs::write(dir.path().join("junk.txt"), b"x").unwrap();
        let last = last_writes(dir.path(), 1).unwrap();
        assert_eq!(last.len(), 2);
        assert_eq!(last[&b"a".to_vec()], Some(b"2".to_vec()));
        assert_eq!(last[&b"b".to_vec()], None);
        // The engine agrees: fine. It reads an older value: Corrupt.
        let ok = |k: &[u8]| Ok(last.get(k).cloned().flatten());
        check_replay(dir.path(), 1, ok).unwrap();
        let old = |k: &[u8]| Ok(if k == b"a" { Some(b"1".to_vec()) } else { None });
        let err = check_replay(dir.path(), 1, old).unwrap_err();
        assert!(matches!(err, StateError::Corrupt { .. }), "{err:?}");
    }

    #[test]
    fn garbage_is_read_as_no_batches_never_a_panic() {
        for bytes in [&b""[..], b"\x01", b"\x01\xff\xff\xff\xff", b"\x02\x00", &[1; 64]] {
            let mut b = Bytes { buf: bytes, at: 0 };
            assert!(next_batch(&mut b).is_none());
        }
    }
}
