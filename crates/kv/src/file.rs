//! The file store's life cycle: atomic creation (D7), one process per path
//! (D3), the high-water mark (D8) and the format check before anything is
//! touched (D4).
//!
//! A store is a directory:
//! - `AGENTSTATE` — the marker: `agentstate store format N`.
//! - `LOCK` — held with `flock` by the process that has the store open.
//! - `HWM` — the high-water mark: the number of groups committed, written
//!   (temp file, fsync, rename) at most every 200 ms while writing, by a
//!   thread of its own (off the commit path), and at close; it never runs
//!   ahead of the journal because it is only ever handed a count of groups
//!   whose sync returned.
//! - `ENGINE` — the engine the store was created with (`fjall` or
//!   `sled`); a store without one predates the file and is fjall's.
//! - `db/` — the fjall database, or `sled/` — the sled database. Distinct
//!   names, so a release that knows only fjall finds no database of its
//!   own in a sled store (and its D8 check then refuses it).

use std::collections::HashSet;
use std::fs::{self, File, OpenOptions};
use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::sync::{LazyLock, Mutex as StdMutex};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::upgrade::STORE_FORMAT;
use super::{Durability, KvStore, Options};
use crate::engine::file::SyncMode;
use agentstate_core::error::{Result, StateError};
use agentstate_core::options::FileEngine;

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
    hwm: std::sync::Arc<Hwm>,
    /// The thread that writes the mark, started by the first commit.
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// The high-water mark, shared with its writer thread.
struct Hwm {
    dir: PathBuf,
    state: Mutex<HwmState>,
    /// Wakes the writer: a newer synced count, or closing.
    wake: Condvar,
    /// Held while the file is written, so writes never interleave.
    io: Mutex<()>,
}

struct HwmState {
    /// The highest count of synced groups handed over.
    synced: u64,
    /// The count the file holds.
    written: u64,
    /// When the file was last written.
    at: Instant,
    closing: bool,
}

impl Hwm {
    /// Writes `commits` as the mark, if it is newer than what the file holds.
    fn write(&self, commits: u64) -> Result<()> {
        let _io = self.io.lock();
        if commits <= self.state.lock().written {
            return Ok(());
        }
        write_atomic(&self.dir, HWM, format!("{commits}\n").as_bytes())?;
        let mut h = self.state.lock();
        h.written = h.written.max(commits);
        h.at = Instant::now();
        Ok(())
    }

    /// The writer thread: at most one mark every `HWM_INTERVAL`, each the
    /// latest synced count at the time.
    fn run(&self) {
        let mut h = self.state.lock();
        loop {
            if h.closing {
                return;
            }
            if h.synced > h.written {
                let wait = HWM_INTERVAL.saturating_sub(h.at.elapsed());
                if wait.is_zero() {
                    let commits = h.synced;
                    drop(h);
                    // A failed mark write weakens only the D8 check, never
                    // data; the next commit tries again after the interval.
                    if self.write(commits).is_err() {
                        self.state.lock().at = Instant::now();
                    }
                    h = self.state.lock();
                } else {
                    self.wake.wait_for(&mut h, wait);
                }
            } else {
                self.wake.wait(&mut h);
            }
        }
    }
}

fn io_err(what: &str, path: &Path, e: std::io::Error) -> StateError {
    StateError::io(format_args!("{what} {}", path.display()), e)
}

/// The longest file name most file systems hold (ext4, xfs, btrfs, tmpfs).
const NAME_BYTES_MAX: usize = 255;

/// The name of the directory a creation of `name` builds beside it:
/// `.NAME.creating-PID`, with NAME shortened (and a hash of the whole name
/// added) when that would not fit in a file name, so every store name the
/// file system accepts can be created.
pub(crate) fn creating_prefix(name: &std::ffi::OsStr) -> String {
    use std::hash::{Hash, Hasher};
    let lossy = name.to_string_lossy();
    // ".", ".creating-" and a pid of up to 10 digits.
    if 1 + lossy.len() + 10 + 10 <= NAME_BYTES_MAX {
        return format!(".{lossy}.creating-");
    }
    let mut h = siphasher::sip::SipHasher13::new();
    name.hash(&mut h);
    let mut cut = 160;
    while !lossy.is_char_boundary(cut) {
        cut -= 1;
    }
    format!(".{}~{:016x}.creating-", &lossy[..cut], h.finish())
}

/// Refuses a store path whose parent directories are missing (unless
/// `create_parents`, which creates them) or where a component is a file,
/// naming the first directory that is missing or the component that is a
/// file.
fn check_parents(path: &Path, parent: &Path, create_parents: bool) -> Result<()> {
    let ancestors: Vec<&Path> = parent.ancestors().collect();
    for dir in ancestors.into_iter().rev() {
        if dir.as_os_str().is_empty() {
            continue;
        }
        match fs::metadata(dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(StateError::invalid(format!(
                    "store path {}: {} is a file, not a directory",
                    path.display(),
                    dir.display()
                )));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if create_parents {
                    return fs::create_dir_all(parent).map_err(|e| io_err("creating", parent, e));
                }
                return Err(StateError::invalid(format!(
                    "store path {}: directory {} does not exist (create it first, \
                     or open with Options::create_parents(true))",
                    path.display(),
                    dir.display()
                )));
            }
            Err(e) => return Err(io_err("reading", dir, e)),
        }
    }
    Ok(())
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

/// A small file's bytes, read to its end without asking its size first:
/// `fs::read` (and `File`'s own `read_to_end`, hence the `take`) asks, a
/// `statx` per file, and an open reads five to seven such files (marker,
/// `ENGINE`, `HWM`, each keyspace's `current` and version file).
pub(crate) fn read_small(path: &Path) -> std::io::Result<Vec<u8>> {
    // One read holds any of them but a version file of a store with
    // hundreds of tables, and that one reads on in growing steps.
    let mut bytes = Vec::with_capacity(4096);
    File::open(path)?.take(u64::MAX).read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// [`read_small`] as text: `InvalidData` when it is not UTF-8, as
/// `fs::read_to_string`.
fn read_small_text(path: &Path) -> std::io::Result<String> {
    String::from_utf8(read_small(path)?)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

fn read_hwm(dir: &Path) -> Result<u64> {
    let path = dir.join(HWM);
    match read_small_text(&path) {
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

/// Reads the marker's format; refuses a newer one before anything is
/// opened.
fn check_marker(path: &Path) -> Result<u8> {
    let marker = path.join(MARKER);
    let text = read_small_text(&marker).map_err(|e| {
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
    if version > STORE_FORMAT || version == 0 {
        return Err(StateError::UnsupportedFormat {
            found: version,
            supported: STORE_FORMAT,
        });
    }
    Ok(version)
}

/// Rewrites the marker to say `version` (atomically).
pub(super) fn write_marker(path: &Path, version: u8) -> Result<()> {
    write_atomic(
        path,
        MARKER,
        format!("{MARKER_PREFIX}{version}\n").as_bytes(),
    )
}

/// The engine the store at `path` was created with; refuses `wanted`
/// when it is the other one.
fn check_engine(path: &Path, wanted: FileEngine) -> Result<()> {
    let file = path.join(ENGINE);
    let found = match read_small(&file) {
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
    check_parents(path, &parent, opts.create_parents)?;
    let tmp = parent.join(format!("{}{}", creating_prefix(name), std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| io_err("removing", &tmp, e))?;
    }
    fs::create_dir(&tmp).map_err(|e| io_err("creating", &tmp, e))?;
    File::create(tmp.join(LOCK)).map_err(|e| io_err("creating lock in", &tmp, e))?;
    {
        let engine = crate::engine::open_file(
            opts.engine,
            &tmp.join(db_dir(opts.engine)),
            SyncMode::Data,
            opts.tuning(),
        )?;
        let store = KvStore::assemble(engine, opts.clone(), None)?;
        drop(store);
    }
    write_atomic(&tmp, HWM, b"0\n")?;
    write_atomic(&tmp, ENGINE, format!("{}\n", opts.engine.name()).as_bytes())?;
    write_marker(&tmp, STORE_FORMAT)?;
    // rename(2) replaces an empty directory, and fails on a non-empty one
    // (another process created the store first): then use theirs.
    match fs::rename(&tmp, path) {
        Ok(()) => sync_dir(&parent),
        Err(_) if path.join(MARKER).exists() => {
            let _ = fs::remove_dir_all(&tmp);
            Ok(())
        }
        // A mount point cannot be replaced by rename (EBUSY): no retry
        // changes that. The store goes in a directory below it.
        Err(e) if e.kind() == std::io::ErrorKind::ResourceBusy => {
            let _ = fs::remove_dir_all(&tmp);
            Err(StateError::Persistence {
                reason: agentstate_core::error::PersistenceReason::InvalidPath,
                detail: format!(
                    "moving the new store into place at {}: {e}: it is a mount point (or in use); \
                     create the store in a directory below it",
                    path.display()
                ),
                source: Some(e),
            })
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
    let prefix = creating_prefix(name);
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
                    this_process: false,
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
    // A store's marker is the first thing an open reads; only when it is
    // not there is the path looked at further (missing, a file, an empty
    // directory to create the store in). Three to seven system calls fewer
    // for every open of an existing store.
    if !path.join(MARKER).is_file() {
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
    }
    let marker = check_marker(path)?;
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
            this_process: true,
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
    let engine = crate::engine::open_file(
        opts.engine,
        &path.join(db_dir(opts.engine)),
        mode,
        opts.tuning(),
    )
    .map_err(unregister)?;
    let salvage = opts.salvage;
    let state = FileState {
        path: path.to_path_buf(),
        canonical: canonical.clone(),
        _lock: lock_file,
        hwm: std::sync::Arc::new(Hwm {
            dir: path.to_path_buf(),
            state: Mutex::new(HwmState {
                synced: hwm,
                written: hwm,
                at: Instant::now(),
                closing: false,
            }),
            wake: Condvar::new(),
            io: Mutex::new(()),
        }),
        writer: Mutex::new(None),
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
    // An import a crash cut short: finished if it was being published,
    // deleted if it was still being staged.
    store.recover_import()?;
    // D4: an older layout is upgraded once, here. The marker says the new
    // format before the engine's first change, so a release that knows
    // only the old one never reads a store half moved.
    if marker < STORE_FORMAT || store.store_format()? < STORE_FORMAT {
        if marker < STORE_FORMAT {
            write_marker(path, STORE_FORMAT)?;
        }
        let progress = store.opts.on_upgrade.clone();
        store.upgrade(&|p| {
            if let Some(f) = &progress {
                f(p)
            }
        })?;
    }
    // A store from before the change feed: every record gets its entry.
    store.fill_feed()?;
    Ok(store)
}

impl FileState {
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// After a synced commit: hands the count to the mark's writer thread
    /// (started here the first time), which writes it within
    /// `HWM_INTERVAL`. Only counts of synced groups may come here (D8).
    pub(crate) fn committed(&self, commits: u64) {
        let notify = {
            let mut h = self.hwm.state.lock();
            if commits <= h.synced {
                return;
            }
            // The writer waits for work when it has written all it had,
            // and otherwise sleeps out the interval on its own: wake it
            // only in the first case (once per mark, not per commit).
            let idle = h.synced == h.written;
            h.synced = commits;
            idle || h.at.elapsed() >= HWM_INTERVAL
        };
        let mut writer = self.writer.lock();
        if writer.is_none() {
            let hwm = std::sync::Arc::clone(&self.hwm);
            match std::thread::Builder::new()
                .name("agentstate-hwm".into())
                .spawn(move || hwm.run())
            {
                Ok(handle) => *writer = Some(handle),
                // No thread: write it here, as before, so the mark moves.
                Err(_) => {
                    let _ = self.hwm.write(commits);
                    return;
                }
            }
        }
        drop(writer);
        if notify {
            self.hwm.wake.notify_one();
        }
    }

    /// Stops the writer thread, if one runs.
    fn stop_writer(&self) {
        let handle = self.writer.lock().take();
        if let Some(handle) = handle {
            self.hwm.state.lock().closing = true;
            self.hwm.wake.notify_one();
            let _ = handle.join();
        }
    }

    /// Salvage: sets the mark to `commits`, lower than what it held.
    fn rewrite_hwm(&self, commits: u64) -> Result<()> {
        let _io = self.hwm.io.lock();
        write_atomic(&self.hwm.dir, HWM, format!("{commits}\n").as_bytes())?;
        let mut h = self.hwm.state.lock();
        (h.synced, h.written, h.at) = (commits, commits, Instant::now());
        Ok(())
    }

    /// At close: record the final mark (only when every write was synced).
    pub(crate) fn close(&self, commits: u64, healthy: bool) {
        self.stop_writer();
        if healthy {
            let _ = self.hwm.write(commits);
        }
    }
}

impl Drop for FileState {
    fn drop(&mut self) {
        self.stop_writer();
        OPEN_PATHS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.canonical);
    }
}
