//! The fjall engine: one keyspace of one fjall database.

use std::path::Path;

use fjall::{Database, Keyspace, KeyspaceCreateOptions, PersistMode, Readable};

use super::{Engine, Write};
use crate::error::{Result, StateError};

/// How a batch reaches the disk.
#[derive(Debug, Clone, Copy)]
pub(crate) enum SyncMode {
    /// fdatasync before the batch is visible.
    Data,
    /// Written to the OS, not synced.
    Buffer,
}

/// The memtable size, the most a store holds in memory of writes not yet
/// in a table (fjall's default is 64 MiB). A reopen still reads the whole
/// active journal, which fjall 3.1 rotates only past 64 MB.
const MEMTABLE_BYTES: u64 = 8 * 1024 * 1024;

/// fjall behind the engine trait.
pub(crate) struct FjallEngine {
    db: Database,
    ks: Keyspace,
    mode: SyncMode,
}

impl std::fmt::Debug for FjallEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FjallEngine")
            .field("mode", &self.mode)
            .finish()
    }
}

/// Maps an engine error to ours: I/O is `Unavailable` (retryable after a
/// reopen), anything about the files' contents is `Corrupt`.
pub(crate) fn map_err(e: fjall::Error) -> StateError {
    match e {
        fjall::Error::Io(io) => {
            StateError::unavailable(format!("engine I/O failed: {io}"), Some(io))
        }
        fjall::Error::Poisoned => StateError::unavailable(
            "engine refuses writes after a failed sync; reopen the store",
            None,
        ),
        fjall::Error::Locked => StateError::unavailable("engine directory is locked", None),
        other => StateError::corrupt(format!("engine: {other:?}")),
    }
}

/// D5: checks each keyspace's current version file against the checksum
/// its `current` file records, before fjall reads either. lsm-tree 3.1
/// does not (a TODO in its `version/recovery.rs`), and a damaged count in
/// a version file makes it allocate without bound and abort the process.
/// `current` is the version id (u64 LE), the xxh3-128 of the whole
/// version file (u128 LE) and the checksum type (0 = xxh3).
fn check_version_files(dir: &Path) -> Result<()> {
    let keyspaces = dir.join("keyspaces");
    let entries = match std::fs::read_dir(&keyspaces) {
        Ok(e) => e,
        // A database fjall has yet to create.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => {
            return Err(StateError::unavailable(
                format!("listing {}: {e}", keyspaces.display()),
                Some(e),
            ));
        }
    };
    let damaged = |what: &Path, why: &str| {
        StateError::corrupt(format!("{} is damaged: {why}", what.display()))
    };
    for entry in entries {
        let ks = entry
            .map_err(|e| {
                StateError::unavailable(format!("listing {}: {e}", keyspaces.display()), Some(e))
            })?
            .path();
        let current = ks.join("current");
        let bytes = match std::fs::read(&current) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                return Err(StateError::unavailable(
                    format!("reading {}: {e}", current.display()),
                    Some(e),
                ));
            }
        };
        if bytes.len() != 25 || bytes[24] != 0 {
            return Err(damaged(&current, "not a version pointer"));
        }
        let id = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
        let want = u128::from_le_bytes(bytes[8..24].try_into().expect("16 bytes"));
        let version = ks.join(format!("v{id}"));
        let body = std::fs::read(&version).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                damaged(&current, "it names a version file that does not exist")
            } else {
                StateError::unavailable(format!("reading {}: {e}", version.display()), Some(e))
            }
        })?;
        if xxhash_rust::xxh3::xxh3_128(&body) != want {
            return Err(damaged(&version, "its checksum does not match"));
        }
    }
    Ok(())
}

impl FjallEngine {
    pub(crate) fn open(dir: &Path, mode: SyncMode) -> Result<Self> {
        check_version_files(dir)?;
        // fjall 3.1 checks some on-disk lengths of its journal with
        // `debug_assert!` (journal/entry.rs), so a damaged journal panics a
        // debug build while it recovers. A panic here is damage, not a bug
        // of the caller: say so (D5). Nothing of the half-opened database
        // outlives the unwinding.
        let opened = std::panic::catch_unwind(|| {
            Database::builder(dir)
                // We sync per batch ourselves; fjall must not also sync in
                // the background on its own schedule.
                .manual_journal_persist(true)
                .cache_size(32 * 1024 * 1024)
                .open()
        });
        let db = match opened {
            Ok(db) => db.map_err(map_err)?,
            Err(panic) => {
                let why = panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("no message");
                return Err(StateError::corrupt(format!(
                    "engine panicked while recovering {}: {why}",
                    dir.display()
                )));
            }
        };
        let ks = db
            .keyspace("agentstate", || {
                KeyspaceCreateOptions::default().max_memtable_size(MEMTABLE_BYTES)
            })
            .map_err(map_err)?;
        // D5: fjall's checksums do not cover a batch's sequence number;
        // the replay must match the journal's order before any read.
        let snap = db.snapshot();
        super::journal::check_replay(dir, ks.id(), |k| {
            Ok(snap.get(&ks, k).map_err(map_err)?.map(|v| v.to_vec()))
        })?;
        drop(snap);
        Ok(FjallEngine { db, ks, mode })
    }
}

impl Engine for FjallEngine {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        // Reads go through a snapshot, which sees only published batches:
        // `Keyspace::get` reads at the newest sequence number and can see
        // half of a batch that is being applied to the memtable.
        let snap = self.db.snapshot();
        Ok(snap
            .get(&self.ks, key)
            .map_err(map_err)?
            .map(|v| v.to_vec()))
    }

    fn scan(&self, start: &[u8], end: &[u8], limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        if start >= end {
            return Ok(Vec::new());
        }
        let mut out = Vec::new();
        let snap = self.db.snapshot();
        for guard in snap.range(&self.ks, start..end).take(limit) {
            let (k, v) = guard.into_inner().map_err(map_err)?;
            out.push((k.to_vec(), v.to_vec()));
        }
        Ok(out)
    }

    fn commit(&self, batch: Vec<Write>) -> Result<()> {
        let mode = match self.mode {
            SyncMode::Data => PersistMode::SyncData,
            SyncMode::Buffer => PersistMode::Buffer,
        };
        // fjall journals and persists the batch before it publishes the
        // batch's sequence number, so no reader sees it before the sync.
        let mut b = self.db.batch().durability(Some(mode));
        for (k, v) in batch {
            match v {
                Some(v) => b.insert(&self.ks, k, v),
                None => b.remove(&self.ks, k),
            }
        }
        b.commit().map_err(map_err)
    }

    fn sync(&self) -> Result<()> {
        self.db.persist(PersistMode::SyncAll).map_err(map_err)
    }

    fn disk_bytes(&self) -> u64 {
        self.db.disk_space().unwrap_or(0)
    }
}
