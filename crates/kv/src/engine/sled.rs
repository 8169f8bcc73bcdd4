//! The sled engine (feature `sled`): one tree of one sled 0.34 database.
//!
//! Three things sled 0.34 does not give on its own, added here:
//! - **A durable `Ok`.** `Db::flush` ends in `sync_file_range` on Linux,
//!   which writes the pages out but syncs neither the file's metadata nor
//!   the disk's cache, and values past sled's blob threshold go to files
//!   under `blobs/` that sled never syncs. After each flush the engine
//!   `fdatasync`s the data file and every blob file it has not synced yet
//!   (and the blob directory when it gained one).
//! - **No reader sees a batch before it is durable (D9).** sled publishes a
//!   batch when it applies it, before any flush, and its iterators are not
//!   isolated from a batch being applied. A reader-writer lock makes the
//!   apply-flush-sync of a batch exclusive with reads, so a read sees a
//!   batch whole and only once it is synced. Readers wait out a sync.
//! - **A panic on damaged files is an error (D5).** sled asserts on some of
//!   what it reads while it recovers; a panic inside sled is reported as
//!   `Corrupt`.

use std::collections::HashSet;
use std::fs::{File, TryLockError};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use super::file::SyncMode;
use super::{Engine, Write};
use agentstate_core::error::{Result, StateError};

/// sled behind the engine trait.
pub(crate) struct SledEngine {
    /// The database; taken only by `drop`.
    db: Option<sled::Db>,
    dir: PathBuf,
    /// Our own handle on sled's data file (`dir/db`), for `fdatasync`.
    data: File,
    /// Blob files already synced.
    synced_blobs: Mutex<HashSet<PathBuf>>,
    /// Held shared by reads, exclusive by a batch's apply-and-sync.
    gate: RwLock<()>,
    mode: SyncMode,
}

impl std::fmt::Debug for SledEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SledEngine")
            .field("dir", &self.dir)
            .field("mode", &self.mode)
            .finish()
    }
}

/// Maps a sled error to ours: I/O is `Unavailable`, the rest `Corrupt`.
fn map_err(e: sled::Error) -> StateError {
    match e {
        sled::Error::Io(io) => {
            StateError::unavailable(format!("engine I/O failed: {io}"), Some(io))
        }
        sled::Error::Corruption { at, .. } => {
            StateError::corrupt(format!("engine: damaged data at {at:?}"))
        }
        other => StateError::corrupt(format!("engine: {other}")),
    }
}

/// Runs `f`, turning a panic inside sled into `Corrupt` (D5).
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(panic) => {
            let why = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("no message");
            Err(StateError::corrupt(format!(
                "engine panicked while {what}: {why}"
            )))
        }
    }
}

fn io_err(what: &str, path: &Path, e: std::io::Error) -> StateError {
    StateError::unavailable(format!("{what} {}: {e}", path.display()), Some(e))
}

fn sync_path(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| io_err("syncing", path, e))
}

/// How long a close waits for sled to let go of its database (see
/// `SledEngine`'s `Drop`).
const RELEASE_WAIT: Duration = Duration::from_secs(10);

impl Drop for SledEngine {
    /// Drops the database, then waits until sled has let go of its data
    /// file. Work sled queued on its process-wide thread pool (an I/O
    /// buffer's write, a segment's truncation and `sync_all`) holds the
    /// database's file, and with it the file's lock, after its last handle
    /// is gone; a reopen in that moment failed with sled's "could not
    /// acquire lock". Once this returns the store can be opened again.
    fn drop(&mut self) {
        drop(self.db.take());
        let path = self.dir.join("db");
        let Ok(f) = File::open(&path) else { return };
        let start = Instant::now();
        loop {
            match f.try_lock() {
                // Free: let it go again at once (and with `f`).
                Ok(()) => return,
                Err(TryLockError::WouldBlock) if start.elapsed() < RELEASE_WAIT => {
                    std::thread::sleep(Duration::from_millis(1));
                }
                // Still held (or no lock to take): the open that follows
                // says so, naming the file.
                Err(_) => return,
            }
        }
    }
}

impl SledEngine {
    /// The database, open until the engine is dropped.
    fn db(&self) -> Result<&sled::Db> {
        self.db
            .as_ref()
            .ok_or_else(|| StateError::unavailable("the sled engine is closed".to_string(), None))
    }

    pub(crate) fn open(dir: &Path, mode: SyncMode) -> Result<Self> {
        let db = guarded(&format!("recovering {}", dir.display()), || {
            sled::Config::new()
                .path(dir)
                .cache_capacity(32 * 1024 * 1024)
                // Every batch is flushed by `commit`; no flushes of sled's
                // own on a timer.
                .flush_every_ms(None)
                .open()
                .map_err(map_err)
        })?;
        let data_path = dir.join("db");
        let data = File::open(&data_path).map_err(|e| io_err("opening", &data_path, e))?;
        let engine = SledEngine {
            db: Some(db),
            dir: dir.to_path_buf(),
            data,
            synced_blobs: Mutex::new(HashSet::new()),
            gate: RwLock::new(()),
            mode,
        };
        // Whatever sled wrote while it opened (a new database's files, its
        // recovery's rewrites) is durable before the first read.
        engine.sync_files(true)?;
        Ok(engine)
    }

    /// fsyncs sled's data file and the blob files not yet synced; with
    /// `all`, also every blob file and the directories.
    fn sync_files(&self, all: bool) -> Result<()> {
        self.data
            .sync_data()
            .map_err(|e| io_err("syncing", &self.dir.join("db"), e))?;
        let blobs = self.dir.join("blobs");
        let mut synced = self.synced_blobs.lock();
        let mut present = HashSet::new();
        let mut gained = false;
        match std::fs::read_dir(&blobs) {
            Ok(entries) => {
                for entry in entries {
                    let path = entry.map_err(|e| io_err("listing", &blobs, e))?.path();
                    if all || !synced.contains(&path) {
                        match File::open(&path).and_then(|f| f.sync_data()) {
                            Ok(()) => gained = true,
                            // sled removes blobs it no longer needs.
                            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                            Err(e) => return Err(io_err("syncing", &path, e)),
                        }
                    }
                    present.insert(path);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err("listing", &blobs, e)),
        }
        if (gained || all) && blobs.exists() {
            sync_path(&blobs)?;
        }
        if all {
            for name in ["conf", "snap"] {
                let p = self.dir.join(name);
                if p.exists() {
                    sync_path(&p)?;
                }
            }
            sync_path(&self.dir)?;
        }
        *synced = present;
        Ok(())
    }
}

impl Engine for SledEngine {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let _read = self.gate.read();
        guarded("reading", || {
            Ok(self.db()?.get(key).map_err(map_err)?.map(|v| v.to_vec()))
        })
    }

    fn scan(&self, start: &[u8], end: &[u8], limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        if start >= end {
            return Ok(Vec::new());
        }
        let _read = self.gate.read();
        guarded("scanning", || {
            let mut out = Vec::new();
            for pair in self.db()?.range(start..end).take(limit) {
                let (k, v) = pair.map_err(map_err)?;
                out.push((k.to_vec(), v.to_vec()));
            }
            Ok(out)
        })
    }

    fn commit(&self, batch: Vec<Write>) -> Result<()> {
        let mut b = sled::Batch::default();
        for (k, v) in batch {
            match v {
                Some(v) => b.insert(k, v),
                None => b.remove(k),
            }
        }
        let _write = self.gate.write();
        guarded("writing", || {
            self.db()?.apply_batch(b).map_err(map_err)?;
            // Out of sled's buffers into the file (and, on Linux, a
            // `sync_file_range`): enough for a process crash.
            self.db()?.flush().map_err(map_err)?;
            match self.mode {
                SyncMode::Data => self.sync_files(false),
                SyncMode::Buffer => Ok(()),
            }
        })
    }

    fn sync(&self) -> Result<()> {
        let _write = self.gate.write();
        guarded("syncing", || {
            self.db()?.flush().map_err(map_err)?;
            self.sync_files(true)
        })
    }

    fn disk_bytes(&self) -> u64 {
        self.db
            .as_ref()
            .and_then(|db| db.size_on_disk().ok())
            .unwrap_or(0)
    }
}
