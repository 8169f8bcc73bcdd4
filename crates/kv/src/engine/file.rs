//! The fjall engine: one keyspace of one fjall database.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use fjall::{AbstractTree, Database, Keyspace, KeyspaceCreateOptions, PersistMode, Readable};

use super::{Engine, Write};
use agentstate_core::error::{Result, StateError};
use agentstate_core::options::Tuning;

// The engine must be our patched fork (vendor/fjall, built from the patch
// queue in patches/): this store relies on its durability fixes and settings.
// Upstream fjall has no such constant, so a build against it fails here.
const _: &str = fjall::AGENTSTATE_PATCH_QUEUE;

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
    /// `None` only while the engine is dropped.
    open: Option<Open>,
    dir: PathBuf,
    mode: SyncMode,
    tuning: Tuning,
    /// A commit or sync failed: the close leaves every file as it is.
    failed: AtomicBool,
}

struct Open {
    db: Database,
    ks: Keyspace,
}

impl std::fmt::Debug for FjallEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FjallEngine")
            .field("mode", &self.mode)
            .field("tuning", &self.tuning)
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

/// D5: checks each keyspace's current version file against the checksum
/// its `current` file records. The vendored lsm-tree does the same check
/// before it parses a version file (upstream 3.1 does not: a damaged count
/// in one made it allocate without bound and abort), so an open that
/// succeeds has passed it; this runs only when the engine's open failed,
/// to name the damaged file in the error instead of fjall's
/// `Unrecoverable` or `ChecksumMismatch`. `current` is the version id
/// (u64 LE), the xxh3-128 of the whole version file (u128 LE) and the
/// checksum type (0 = xxh3).
#[allow(
    clippy::expect_used,
    reason = "a slice cut to a fixed length by its range converts to an array of that length"
)]
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
        let bytes = match crate::file::read_small(&current) {
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
        let body = crate::file::read_small(&version).map_err(|e| {
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

/// The first level's size under leveled compaction (see `open`).
const LEVEL_BASE_BYTES: u64 = 8 * 1024 * 1024;

/// How many tables the first level (L0) gathers before they are merged
/// into the next (fjall: 4). Each L0 table holds every key its memtable
/// held, so a scan seeks into every one of them: with 4, a short scan
/// merged the memtable, 0–3 L0 tables and the next level's, and cost more
/// the more there were. In the growth bench (8 threads, 200k calls, one
/// 200k-call run in ~9 s), two turns of five runs each: the scans' thread
/// CPU per call 37 µs instead of 60 (`alarm_due`), 38 instead of 46
/// (`list`), 31 instead of 40 (`marked`), the writes' 31 instead of 35,
/// and the first tenth to the last flatter (docs/benchmarks-lab-notes.md, "Full run R").
/// A threshold of 1 (a merge after every flush) was flatter still for the
/// scans but cost the eight writers a fifth of their throughput.
const L0_TABLES: u8 = 2;

/// How long a clean close waits for fjall to flush its memtables before it
/// gives up and leaves the journal in place (the next open replays it).
const CLOSE_FLUSH_WAIT: Duration = Duration::from_secs(30);

impl FjallEngine {
    pub(crate) fn open(dir: &Path, mode: SyncMode, tuning: Tuning) -> Result<Self> {
        Self::open_once(dir, mode, tuning, false)
    }

    /// `open`; `reconfigured` once the keyspace's settings were rewritten.
    fn open_once(dir: &Path, mode: SyncMode, tuning: Tuning, reconfigured: bool) -> Result<Self> {
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
                .cache_size(tuning.cache_bytes)
                // A new journal at every memtable flush once the active
                // one holds a memtable's worth (fjall: 64 MB), so a reopen
                // after a crash replays only what is not yet flushed (at
                // most the write buffer); fjall removes a sealed journal
                // once its memtable is flushed.
                .journal_rotation_size(memtable_bytes(tuning.write_buffer_bytes))
                // Each new journal, and the empty one a clean close
                // leaves, starts in a file already written with zeros
                // (prepared by a fjall worker, or at a clean close): a
                // synced append into written blocks commits no file-system
                // metadata (vendor fjall patch; docs/benchmarks-lab-notes.md, "Spare
                // journal").
                .journal_spare_size(spare_bytes(dir, &tuning))
                .open()
        });
        let db = match opened {
            Ok(Ok(db)) => db,
            // A damaged version file, named (the engine says only which
            // kind of damage it found).
            Ok(Err(e)) => {
                let e = map_err(e);
                return Err(match e {
                    StateError::Corrupt { .. } => check_version_files(dir).err().unwrap_or(e),
                    e => e,
                });
            }
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
                keyspace_options(KeyspaceCreateOptions::default(), &tuning)
            })
            .map_err(map_err)?;
        // fjall keeps the options a keyspace was created with and ignores
        // those given at a later open: a store created by an earlier
        // release, or opened now with another write buffer, would go on
        // with the old ones (a memtable sized for another write buffer,
        // the old compaction). Rewritten once, atomically, and the
        // database opened again to run with them.
        if db
            .reconfigure_keyspace(&ks, |o| keyspace_options(o, &tuning))
            .map_err(map_err)?
        {
            if reconfigured {
                return Err(StateError::corrupt(format!(
                    "the engine's settings in {} do not keep what was written",
                    dir.display()
                )));
            }
            drop(ks);
            drop(db);
            return Self::open_once(dir, mode, tuning, true);
        }
        // D5: fjall's checksums do not cover a batch's sequence number;
        // the replay must match the journal's order before any read.
        let snap = db.snapshot();
        super::journal::check_replay(dir, ks.id(), |k| {
            Ok(snap.get(&ks, k).map_err(map_err)?.map(|v| v.to_vec()))
        })?;
        drop(snap);
        Ok(FjallEngine {
            open: Some(Open { db, ks }),
            dir: dir.to_path_buf(),
            mode,
            tuning,
            failed: AtomicBool::new(false),
        })
    }

    #[allow(clippy::expect_used, reason = "the engine is open until dropped")]
    fn fj(&self) -> &Open {
        self.open
            .as_ref()
            .expect("the engine is open until dropped")
    }

    /// Records a failed commit or sync: the close then touches nothing.
    fn watch<T>(&self, r: fjall::Result<T>) -> Result<T> {
        r.map_err(|e| {
            self.failed.store(true, Ordering::SeqCst);
            map_err(e)
        })
    }
}

/// The spare journal's size: twice the rotation size (a memtable), as a
/// journal is rotated only at a flush after it passed that size, and at
/// most 8 MiB (appends past a spare's end work, each sync then also
/// commits the file's new blocks). None (0) on a file system with less
/// than 64 spares' worth free: zeros written ahead must never be what
/// fills a disk.
fn spare_bytes(dir: &Path, tuning: &Tuning) -> u64 {
    let want = (2 * memtable_bytes(tuning.write_buffer_bytes)).min(8 << 20);
    match free_bytes(dir) {
        Some(free) if free < 64 * want => 0,
        _ => want,
    }
}

/// Bytes free to an unprivileged user on the file system holding `dir`
/// (or its nearest existing parent); `None` when it cannot be told.
#[cfg(unix)]
fn free_bytes(dir: &Path) -> Option<u64> {
    let at = dir.ancestors().find(|p| p.exists())?;
    let s = rustix::fs::statvfs(at).ok()?;
    Some(s.f_bavail.saturating_mul(s.f_frsize))
}

#[cfg(not(unix))]
fn free_bytes(_dir: &Path) -> Option<u64> {
    None
}

/// The keyspace settings of this release, on top of `base` (fjall's
/// defaults for a new store, the stored settings for an existing one).
/// The block settings apply to the tables written from then on: each
/// table records its own, so a store's older tables read as they were
/// written until compaction rewrites them.
fn keyspace_options(base: KeyspaceCreateOptions, tuning: &Tuning) -> KeyspaceCreateOptions {
    base.max_memtable_size(memtable_bytes(tuning.write_buffer_bytes))
        // 16 KiB data blocks (fjall: 4 KiB): a page of 100
        // records loads a quarter as many blocks; measured on
        // fjall alone at 1M records, 49–54 µs a page instead
        // of 77–79 µs (docs/internals.md, "Storage layout").
        .data_block_size_policy(fjall::config::BlockSizePolicy::all(16 * 1024))
        // Bloom filters in partitions at every level (fjall:
        // from L3 on): a point read loads one partition of a
        // table's filter, not all of it. The first read after
        // opening a 1M-run store loaded 2.9 MB of whole filters
        // (262 KB to 1.5 MB each); the open probe's clean open
        // + first read went from ~8.9 ms to a 4.7 ms median,
        // and resident memory down with it.
        .filter_block_partitioning_policy(fjall::config::PartitioningPolicy::all(true))
        // Block indexes in partitions at every level too
        // (fjall: from L3 on): a table's index is one entry
        // per 16 KiB block, 120–190 KB for a 67 MB table, read
        // whole at open (L0, L1) or at the table's first read.
        // With partitions the open reads a small top-level
        // index and a point read one 4 KiB partition.
        .index_block_partitioning_policy(fjall::config::PartitioningPolicy::all(true))
        // Data blocks uncompressed at every level (fjall: lz4
        // from canonical L2 on, where the small first level
        // below puts the bulk of a store). A page of 100 at 1M
        // runs took 117–148 µs with lz4 against 115–119 µs
        // without, for a store of 119 MB against 387 MB.
        .data_block_compression_policy(fjall::config::CompressionPolicy::disabled())
        // Leveled compaction with an 8 MiB first level (fjall:
        // 4 x 64 MiB tables = 256 MiB). Every L0 table spans
        // the keys its memtable held, so each L0 merge
        // rewrites the first level whole: with fjall's base a
        // store under 256 MiB was rewritten every fourth
        // memtable flush. A short scan between tray writes on
        // a store holding 200k runs: 101–120 µs before, 52–79
        // µs after (docs/internals.md, "Compaction: a small
        // first level").
        .compaction_strategy(Arc::new(
            fjall::compaction::Leveled::default()
                .with_level_base_size(LEVEL_BASE_BYTES)
                .with_l0_threshold(L0_TABLES),
        ))
}

/// The size of one memtable for a write buffer of `bytes`: fjall 3.1
/// holds the active memtable and up to four sealed ones waiting for their
/// flush before it makes writers wait (`Keyspace::local_backpressure`;
/// its own write-buffer bound, `max_write_buffer_size`, is not
/// implemented), so a fifth keeps all of them within it.
fn memtable_bytes(write_buffer_bytes: u64) -> u64 {
    (write_buffer_bytes / 5).max(1 << 20)
}

/// Flushes every memtable of `ks` into tables and returns the highest
/// sequence number they now cover (every journaled batch is at or below
/// it), or `None` when fjall failed or did not finish within
/// `CLOSE_FLUSH_WAIT`. Runs with no writer left (the engine is dropped).
fn flush_all(db: &Database, ks: &Keyspace) -> Option<u64> {
    // The journal first, so a flush that fails midway loses nothing.
    db.persist(PersistMode::SyncAll).ok()?;
    let tree = &ks.tree;
    let covered = tree
        .get_highest_memtable_seqno()
        .max(tree.get_highest_persisted_seqno())
        .unwrap_or(0);
    ks.rotate_memtable().ok()?;
    let start = Instant::now();
    // Sealed memtables (this one and any rotated before) are flushed by
    // fjall's workers, each table synced before its memtable goes; a
    // worker that fails poisons the database and never flushes them,
    // hence the deadline.
    while tree.get_highest_memtable_seqno().is_some() {
        if start.elapsed() > CLOSE_FLUSH_WAIT {
            return None;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Some(covered)
}

impl Drop for FjallEngine {
    /// A clean close: flush the memtables into tables, close fjall, then
    /// remove the journals whose every batch the tables now hold, so the
    /// next open replays nothing (fjall's recovery reads and decodes every
    /// batch of every journal on disk, even those already in tables). A
    /// crash at any moment of it leaves journals that replay to the same
    /// data; any doubt keeps them.
    fn drop(&mut self) {
        let Some(Open { db, ks }) = self.open.take() else {
            return;
        };
        let persisted = (self.tuning.flush_at_close && !self.failed.load(Ordering::SeqCst))
            .then(|| flush_all(&db, &ks))
            .flatten();
        drop(ks);
        drop(db);
        if let Some(persisted) = persisted {
            // Best effort: a journal left behind is replayed, never lost.
            let _ = super::journal::remove_flushed(&self.dir, persisted);
            // The flush may have rotated the journal into the spare: leave
            // one for the next open's empty journal (a few ms of zeros,
            // only when there is none). Best effort as well.
            let _ = fjall::prepare_spare_journal(&self.dir, spare_bytes(&self.dir, &self.tuning));
        }
    }
}

impl Engine for FjallEngine {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        // Reads go through a snapshot, which sees only published batches:
        // `Keyspace::get` reads at the newest sequence number and can see
        // half of a batch that is being applied to the memtable.
        let fj = self.fj();
        let snap = fj.db.snapshot();
        Ok(snap.get(&fj.ks, key).map_err(map_err)?.map(|v| v.to_vec()))
    }

    fn scan(&self, start: &[u8], end: &[u8], limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        if start >= end {
            return Ok(Vec::new());
        }
        let fj = self.fj();
        let mut out = Vec::new();
        let snap = fj.db.snapshot();
        for guard in snap.range(&fj.ks, start..end).take(limit) {
            let (k, v) = guard.into_inner().map_err(map_err)?;
            out.push((k.to_vec(), v.to_vec()));
        }
        Ok(out)
    }

    fn scan_each(
        &self,
        start: &[u8],
        end: &[u8],
        _want: usize,
        visit: &mut super::Visit<'_>,
    ) -> Result<()> {
        if start >= end {
            return Ok(());
        }
        let fj = self.fj();
        // The iterator holds its own snapshot of the tree (no lock), and
        // hands out slices of the blocks it reads: nothing is copied.
        let snap = fj.db.snapshot();
        for guard in snap.range(&fj.ks, start..end) {
            let (k, v) = guard.into_inner().map_err(map_err)?;
            if !visit(&k, &v)? {
                break;
            }
        }
        Ok(())
    }

    fn commit(&self, batch: Vec<Write>) -> Result<()> {
        let mode = match self.mode {
            SyncMode::Data => PersistMode::SyncData,
            SyncMode::Buffer => PersistMode::Buffer,
        };
        let fj = self.fj();
        // fjall journals and persists the batch before it publishes the
        // batch's sequence number, so no reader sees it before the sync.
        let mut b = fj.db.batch().durability(Some(mode));
        for (k, v) in batch {
            match v {
                Some(v) => b.insert(&fj.ks, k, v),
                None => b.remove(&fj.ks, k),
            }
        }
        self.watch(b.commit())
    }

    fn sync(&self) -> Result<()> {
        self.watch(self.fj().db.persist(PersistMode::SyncAll))
    }

    fn disk_bytes(&self) -> u64 {
        self.fj().db.disk_space().unwrap_or(0)
    }

    /// Every table rewritten by a major compaction, which drops deleted
    /// and overwritten values and the tombstones that shadowed them, and
    /// the files they were in deleted, journals included.
    ///
    /// fjall drops a value only below its garbage-collection watermark,
    /// which a memtable rotation raises to the sequence number before the
    /// newest write (when no snapshot is open), and deletes the files a
    /// compaction retired, and the journals of flushed memtables, at a
    /// rotation. So: a write (a tombstone of a key never written) moves
    /// the sequence number past every earlier write; a rotation flushes
    /// the memtable, seals the journal (asked for: our patch) and raises
    /// the watermark past them; the major compaction rewrites the tables;
    /// a second write and rotation delete what it retired and the sealed
    /// journal.
    fn compact(&self) -> Result<()> {
        let fj = self.fj();
        let mark = || {
            let mut b = fj.db.batch().durability(Some(PersistMode::SyncAll));
            b.remove(&fj.ks, crate::key::meta::COMPACT_MARK);
            self.watch(b.commit())?;
            self.watch(fj.ks.rotate_memtable_and_wait())
        };
        fj.db.rotate_journal_at_next_flush();
        mark()?;
        self.watch(fj.ks.major_compact())?;
        mark()
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use fjall::{Database, KeyspaceCreateOptions};

    use super::{LEVEL_BASE_BYTES, keyspace_options};
    use agentstate_core::Options;

    fn copy_dir(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let entry = entry.unwrap();
            let dest = to.join(entry.file_name());
            if entry.file_type().unwrap().is_dir() {
                copy_dir(&entry.path(), &dest);
            } else {
                std::fs::copy(entry.path(), dest).unwrap();
            }
        }
    }

    /// The settings fjall recovered for the store's keyspace: its first
    /// level's size, and whether its data blocks are compressed anywhere.
    /// (Its memtable size: `tests/it/durability.rs`, by the tables a
    /// reopen flushes.)
    fn stored_settings(db_dir: &Path) -> (Option<u64>, bool) {
        let db = Database::builder(db_dir).open().unwrap();
        let ks = db
            .keyspace("agentstate", KeyspaceCreateOptions::default)
            .unwrap();
        let base = ks
            .config
            .compaction_strategy
            .get_config()
            .into_iter()
            .find(|(key, _)| &**key == b"leveled_level_base_size")
            .map(|(_, value)| u64::from_le_bytes((*value).try_into().unwrap()));
        let compressed =
            ks.config.data_block_compression_policy != fjall::config::CompressionPolicy::disabled();
        (base, compressed)
    }

    /// Stores written by earlier releases (the v1 and v2 fixtures, made
    /// with fjall's compaction and compression) open with this release's
    /// keyspace settings, and a store already on them is not rewritten
    /// (which would cost every open a second one).
    #[test]
    fn a_store_of_an_earlier_release_opens_with_this_releases_settings() {
        let tuning = Options::new().tuning();
        let now = (Some(LEVEL_BASE_BYTES), false);
        for fixture in ["v1", "v2"] {
            let tmp = tempfile::tempdir().unwrap();
            let store = tmp.path().join("store");
            let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
            copy_dir(&fixtures.join(fixture), &store);
            let before = stored_settings(&store.join("db"));
            assert_ne!(before, now, "{fixture}: already on this release's settings");

            drop(crate::FileStore::open(&store).unwrap());
            assert_eq!(stored_settings(&store.join("db")), now, "{fixture}");

            let db = Database::builder(store.join("db")).open().unwrap();
            let ks = db
                .keyspace("agentstate", KeyspaceCreateOptions::default)
                .unwrap();
            let changed = db
                .reconfigure_keyspace(&ks, |o| keyspace_options(o, &tuning))
                .unwrap();
            assert!(!changed, "{fixture}: settings rewritten at every open");
        }
    }
}
