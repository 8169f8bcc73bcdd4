//! The file store's life cycle: atomic creation (D7), one process per path
//! (D3), the high-water mark (D8) and the format check before anything is
//! touched (D4).
//!
//! A store is a directory:
//! - `AGENTSTATE` — the marker: `agentstate store format N`.
//! - `LOCK` — held with `flock` by the process that has the store open.
//! - `HWM` — the high-water mark: the number of groups committed, written
//!   (temp file, fsync, rename) at most every 200 ms after a commit and at
//!   close; it never runs ahead of the journal because it is written only
//!   after the commits it counts were synced.
//! - `ENGINE` — the engine the store was created with (`fjall` or
//!   `sled`); a store without one predates the file and is fjall's.
//! - `db/` — the fjall database, or `sled/` — the sled database. Distinct
//!   names, so a release that knows only fjall finds no database of its
//!   own in a sled store (and its D8 check then refuses it).

use std::collections::HashSet;
use std::fs::{self, File, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{LazyLock, Mutex as StdMutex};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{Durability, KvStore, Options};
use crate::codec::value::FORMAT_VERSION;
use crate::error::{Result, StateError};
use crate::kv::engine::file::SyncMode;
use crate::options::FileEngine;

const MARKER: &str = "AGENTSTATE";
const LOCK: &str = "LOCK";
const HWM: &str = "HWM";
const ENGINE: &str = "ENGINE";

/// The directory inside the store that holds `engine`'s database.
fn db_dir(engine: FileEngine) -> &'static str {
    match engine {
        FileEngine::Fjall => "db",
        FileEngine::Sled => "sled",
    }
}
const MARKER_PREFIX: &str = "agentstate store format ";
/// How often, at most, the high-water mark is rewritten while writing.
const HWM_INTERVAL: Duration = Duration::from_millis(200);
/// How long a lock held by a just-forked child (which shares the lock's
/// open file until it execs) is waited out before `Locked`.
const LOCK_RETRY: Duration = Duration::from_millis(250);

/// Paths open in this process: a second open is refused at once.
static OPEN_PATHS: LazyLock<StdMutex<HashSet<PathBuf>>> = LazyLock::new(Default::default);

/// What a file store holds beyond its engine.
pub(crate) struct FileState {
    path: PathBuf,
    canonical: PathBuf,
    _lock: File,
    hwm: Mutex<HwmState>,
}

struct HwmState {
    written: u64,
    at: Instant,
}

fn io_err(what: &str, path: &Path, e: std::io::Error) -> StateError {
    StateError::unavailable(format!("{what} {}: {e}", path.display()), Some(e))
}

fn sync_dir(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_err("syncing directory", path, e))
}

/// Writes `contents` to `dir/name` atomically and durably.
fn write_atomic(dir: &Path, name: &str, contents: &[u8]) -> Result<()> {
    let tmp = dir.join(format!("{name}.tmp"));
    let path = dir.join(name);
    let mut f = File::create(&tmp).map_err(|e| io_err("creating", &tmp, e))?;
    f.write_all(contents)
        .and_then(|_| f.sync_all())
        .map_err(|e| io_err("writing", &tmp, e))?;
    fs::rename(&tmp, &path).map_err(|e| io_err("renaming", &path, e))?;
    sync_dir(dir)
}

fn read_hwm(dir: &Path) -> Result<u64> {
    let path = dir.join(HWM);
    match fs::read_to_string(&path) {
        Ok(s) => s
            .trim()
            .parse()
            .map_err(|_| StateError::corrupt(format!("{} does not hold a number", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
        // Not UTF-8: damaged, like any other non-number (D5).
        Err(e) if e.kind() == std::io::ErrorKind::InvalidData => Err(StateError::corrupt(format!(
            "{} does not hold a number",
            path.display()
        ))),
        Err(e) => Err(io_err("reading", &path, e)),
    }
}

/// Reads the marker; refuses a newer format before anything is opened.
fn check_marker(path: &Path) -> Result<()> {
    let marker = path.join(MARKER);
    let text = fs::read_to_string(&marker).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            StateError::invalid(format!(
                "{} is not an agentstate store (no {MARKER} file); pick an empty or new path",
                path.display()
            ))
        } else if e.kind() == std::io::ErrorKind::InvalidData {
            // Not UTF-8: damaged, not unavailable (D5).
            StateError::corrupt(format!("{} is damaged", marker.display()))
        } else {
            io_err("reading", &marker, e)
        }
    })?;
    let version: u8 = text
        .trim()
        .strip_prefix(MARKER_PREFIX)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| StateError::corrupt(format!("{} is damaged", marker.display())))?;
    if version > FORMAT_VERSION {
        return Err(StateError::UnsupportedFormat {
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    Ok(())
}

/// The engine the store at `path` was created with; refuses `wanted`
/// when it is the other one.
fn check_engine(path: &Path, wanted: FileEngine) -> Result<()> {
    let file = path.join(ENGINE);
    let found = match fs::read(&file) {
        Ok(bytes) => match bytes.as_slice() {
            b"fjall\n" => FileEngine::Fjall,
            b"sled\n" => FileEngine::Sled,
            _ => {
                return Err(StateError::corrupt(format!(
                    "{} is damaged: it names no engine this release knows (fjall, sled)",
                    file.display()
                )));
            }
        },
        // Stores made before the file existed are fjall's.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => FileEngine::Fjall,
        Err(e) => return Err(io_err("reading", &file, e)),
    };
    if found != wanted {
        let how = match found {
            FileEngine::Fjall => "Options::engine(FileEngine::Fjall), the default",
            FileEngine::Sled => "Options::engine(FileEngine::Sled) or FileStore::open_sled",
        };
        return Err(StateError::invalid(format!(
            "{} was created with the {} engine, not {}: open it with {how}",
            path.display(),
            found.name(),
            wanted.name()
        )));
    }
    Ok(())
}

/// D7: builds a complete empty store beside `path` and renames it into
/// place, so a crash leaves nothing or a whole store.
fn create(path: &Path, opts: &Options) -> Result<()> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path.file_name().ok_or_else(|| {
        StateError::invalid(format!("store path {} has no file name", path.display()))
    })?;
    fs::create_dir_all(&parent).map_err(|e| io_err("creating", &parent, e))?;
    let tmp = parent.join(format!(
        ".{}.creating-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| io_err("removing", &tmp, e))?;
    }
    fs::create_dir(&tmp).map_err(|e| io_err("creating", &tmp, e))?;
    File::create(tmp.join(LOCK)).map_err(|e| io_err("creating lock in", &tmp, e))?;
    {
        let engine = crate::kv::engine::open_file(
            opts.engine,
            &tmp.join(db_dir(opts.engine)),
            SyncMode::Data,
        )?;
        let store = KvStore::assemble(engine, opts.clone(), None)?;
        drop(store);
    }
    write_atomic(&tmp, HWM, b"0\n")?;
    write_atomic(&tmp, ENGINE, format!("{}\n", opts.engine.name()).as_bytes())?;
    write_atomic(
        &tmp,
        MARKER,
        format!("{MARKER_PREFIX}{FORMAT_VERSION}\n").as_bytes(),
    )?;
    // rename(2) replaces an empty directory, and fails on a non-empty one
    // (another process created the store first): then use theirs.
    match fs::rename(&tmp, path) {
        Ok(()) => sync_dir(&parent),
        Err(_) if path.join(MARKER).exists() => {
            let _ = fs::remove_dir_all(&tmp);
            Ok(())
        }
        Err(e) => {
            let _ = fs::remove_dir_all(&tmp);
            Err(io_err("moving the new store into place at", path, e))
        }
    }
}

/// Removes leftovers of creations whose process is gone.
fn sweep_stale_creations(path: &Path) {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return;
    };
    let parent = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    let prefix = format!(".{}.creating-", name.to_string_lossy());
    let Ok(entries) = fs::read_dir(parent) else {
        return;
    };
    for e in entries.flatten() {
        let fname = e.file_name().to_string_lossy().into_owned();
        if let Some(pid) = fname
            .strip_prefix(&prefix)
            .and_then(|p| p.parse::<u32>().ok())
            && pid != std::process::id()
            && !Path::new(&format!("/proc/{pid}")).exists()
        {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}

fn lock(path: &Path) -> Result<File> {
    let lock_path = path.join(LOCK);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&lock_path)
        .map_err(|e| io_err("opening", &lock_path, e))?;
    let start = Instant::now();
    loop {
        match f.try_lock() {
            Ok(()) => return Ok(f),
            Err(std::fs::TryLockError::WouldBlock) if start.elapsed() < LOCK_RETRY => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(StateError::Locked {
                    path: path.to_path_buf(),
                });
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io_err("locking", &lock_path, e)),
        }
    }
}

/// Opens the store at `path`, creating it when absent or an empty directory.
pub(super) fn open(path: &Path, opts: Options) -> Result<KvStore> {
    if opts.engine == FileEngine::Sled && !cfg!(feature = "sled") {
        return Err(StateError::invalid(
            "the sled engine needs agentstate built with the `sled` feature",
        ));
    }
    if path.exists() && !path.is_dir() {
        return Err(StateError::invalid(format!(
            "{} is a file, not an agentstate store directory; pick a new path",
            path.display()
        )));
    }
    let is_empty_dir = fs::read_dir(path)
        .map(|mut d| d.next().is_none())
        .unwrap_or(false);
    if !path.exists() || is_empty_dir {
        sweep_stale_creations(path);
        create(path, &opts)?;
    }
    check_marker(path)?;
    check_engine(path, opts.engine)?;
    let canonical = fs::canonicalize(path).map_err(|e| io_err("resolving", path, e))?;
    // D3, within this process: refuse at once.
    if !OPEN_PATHS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(canonical.clone())
    {
        return Err(StateError::Locked {
            path: path.to_path_buf(),
        });
    }
    let unregister = |e| {
        OPEN_PATHS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&canonical);
        e
    };
    let lock_file = lock(path).map_err(unregister)?;
    let hwm = read_hwm(path).map_err(unregister)?;
    let mode = match opts.durability {
        Durability::Immediate => SyncMode::Data,
        Durability::Buffered => SyncMode::Buffer,
    };
    let engine = crate::kv::engine::open_file(opts.engine, &path.join(db_dir(opts.engine)), mode)
        .map_err(unregister)?;
    let salvage = opts.salvage;
    let state = FileState {
        path: path.to_path_buf(),
        canonical: canonical.clone(),
        _lock: lock_file,
        hwm: Mutex::new(HwmState {
            written: hwm,
            at: Instant::now(),
        }),
    };
    let store = KvStore::assemble(engine, opts, Some(state))?;
    let commits = store.commits();
    // D8: the journal recovered to fewer commits than were acknowledged.
    if commits < hwm {
        if !salvage {
            let e = StateError::corrupt(format!(
                "{} recovered to commit {commits} but had acknowledged commit {hwm}: its journal was cut short. \
                 Open it with Options::salvage(true) (CLI: --salvage) to keep what is left",
                path.display()
            ));
            return Err(e);
        }
        if let Some(f) = &store.file {
            f.rewrite_hwm(commits)?;
        }
    }
    Ok(store)
}

impl FileState {
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// After a synced commit: rewrite the mark if the last write is old.
    pub(crate) fn committed(&self, commits: u64) {
        let mut h = self.hwm.lock();
        if h.at.elapsed() >= HWM_INTERVAL && commits > h.written {
            // A failed mark write weakens only the D8 check, never data.
            if write_atomic(&self.path, HWM, format!("{commits}\n").as_bytes()).is_ok() {
                h.written = commits;
            }
            h.at = Instant::now();
        }
    }

    fn rewrite_hwm(&self, commits: u64) -> Result<()> {
        write_atomic(&self.path, HWM, format!("{commits}\n").as_bytes())?;
        let mut h = self.hwm.lock();
        h.written = commits;
        h.at = Instant::now();
        Ok(())
    }

    /// At close: record the final mark (only when every write was synced).
    pub(crate) fn close(&self, commits: u64, healthy: bool) {
        if healthy && commits > self.hwm.lock().written {
            let _ = self.rewrite_hwm(commits);
        }
    }
}

impl Drop for FileState {
    fn drop(&mut self) {
        OPEN_PATHS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.canonical);
    }
}
