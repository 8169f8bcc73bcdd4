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
        fjall::Error::Io(io) => StateError::io("engine I/O", io),
        fjall::Error::Poisoned => StateError::unavailable(
            "engine refuses writes after a failed sync; reopen the store",
            None,
        ),
        fjall::Error::Locked => StateError::unavailable("engine directory is locked", None),
        other => StateError::corrupt(format!("engine: {other:?}")),
    }
}

impl FjallEngine {
    pub(crate) fn open(dir: &Path, mode: SyncMode) -> Result<Self> {
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
            .keyspace("agentstate", KeyspaceCreateOptions::default)
            .map_err(map_err)?;
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
