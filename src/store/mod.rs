//! The store's logic, written once over the engine trait.

mod commit;
mod file;
#[cfg(all(test, loom))]
mod loom_models;
mod runs;
mod sessions;
mod sessions_list;
mod transfer;
mod trays;
mod verify;

use std::path::Path;
use std::sync::Arc as StdArc;

pub use transfer::Entry;
pub use verify::{StoreStats, TenantStats, VerifyReport};

use crate::clock::{Clock, SystemClock};
use crate::codec::key::meta;
use crate::codec::value;
use crate::engine::memory::MemoryEngine;
use crate::engine::{Engine, Write};
use crate::error::{Result, StateError};
use crate::limits::{ID_BYTES_MAX, PAGE_ITEMS_MAX, RECORD_BYTES_MAX_DEFAULT};
use crate::scrub::Scrubber;
use crate::sync::{AtomicBool, Ordering};
use commit::{Committer, Counters, Sink, Txn};

/// What an acknowledged write survives (file store only; the memory store
/// keeps nothing past its process).
///
/// | mode | process crash (`kill -9`) | OS crash / power loss |
/// |---|---|---|
/// | `Immediate` (default) | survives | survives, on disks that honour `fdatasync` |
/// | `Buffered` | survives | may lose the last writes (never a torn one) |
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Durability {
    /// Every acknowledged write was synced (`fdatasync`) before `Ok`; writers
    /// that arrive together share one sync.
    #[default]
    Immediate,
    /// Writes reach the operating system before `Ok` but are not synced. A
    /// process crash loses nothing; an OS crash or power cut can lose the
    /// most recent acknowledged writes (whole groups, never part of one).
    Buffered,
}

/// How a store is opened.
#[derive(Clone)]
pub struct Options {
    pub(crate) clock: StdArc<dyn Clock>,
    pub(crate) record_bytes_max: usize,
    pub(crate) scrubber: Scrubber,
    pub(crate) durability: Durability,
    pub(crate) salvage: bool,
}

impl std::fmt::Debug for Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Options")
            .field("record_bytes_max", &self.record_bytes_max)
            .field("durability", &self.durability)
            .field("salvage", &self.salvage)
            .finish_non_exhaustive()
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            clock: StdArc::new(SystemClock),
            record_bytes_max: RECORD_BYTES_MAX_DEFAULT,
            scrubber: Scrubber::default(),
            durability: Durability::Immediate,
            salvage: false,
        }
    }
}

impl Options {
    /// System clock, 1 MiB records, default scrubber, `Durability::Immediate`.
    pub fn new() -> Self {
        Self::default()
    }
    /// The clock `created_at`/`updated_at` are read from.
    pub fn clock(mut self, clock: StdArc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }
    /// The largest encoded record or tray doc (K2), at least 4 KiB.
    pub fn record_bytes_max(mut self, bytes: usize) -> Self {
        self.record_bytes_max = bytes.max(4096);
        self
    }
    /// The scrubber applied to every run written (X1).
    pub fn scrubber(mut self, scrubber: Scrubber) -> Self {
        self.scrubber = scrubber;
        self
    }
    /// What an `Ok` survives (file store).
    pub fn durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }
    /// Open a file store even when it recovered to less than it had
    /// acknowledged (D8). For operators rescuing what is left; the store's
    /// high-water mark is reset to what was recovered.
    pub fn salvage(mut self, salvage: bool) -> Self {
        self.salvage = salvage;
        self
    }
}

/// A store: the memory or the file backend behind the same logic.
///
/// [`MemoryStore`] and [`FileStore`] name the two ways to make one.
/// Share one `Store` between threads (it is `Send + Sync`; wrap it in an
/// `Arc`).
pub struct Store {
    engine: Box<dyn Engine>,
    committer: Committer,
    opts: Options,
    secret: [u8; 16],
    /// Set when a commit failed; writes are refused until reopened (D6).
    poisoned: AtomicBool,
    file: Option<file::FileState>,
}

/// The in-process backend: `MemoryStore::new()`.
pub type MemoryStore = Store;
/// The embedded file backend: `FileStore::open(path)`.
pub type FileStore = Store;

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("path", &self.path())
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

impl Default for Store {
    fn default() -> Self {
        Self::new()
    }
}

impl Store {
    /// An empty in-memory store with the system clock.
    pub fn new() -> Store {
        Self::with_options(Options::default())
    }

    /// An empty in-memory store.
    pub fn with_options(opts: Options) -> Store {
        let engine = MemoryEngine::default();
        Self::assemble(Box::new(engine), opts, None)
            .expect("a new memory store cannot fail to start")
    }

    /// Opens (creating if needed) the file store at `path`, a directory.
    pub fn open(path: impl AsRef<Path>) -> Result<Store> {
        Self::open_with(path, Options::default())
    }

    /// Opens (creating if needed) the file store at `path` with options.
    pub fn open_with(path: impl AsRef<Path>, opts: Options) -> Result<Store> {
        file::open(path.as_ref(), opts)
    }

    /// The directory of a file store; `None` in memory.
    pub fn path(&self) -> Option<&Path> {
        self.file.as_ref().map(|f| f.path())
    }

    /// Builds a store over an engine, writing the meta values of a new one.
    fn assemble(
        engine: Box<dyn Engine>,
        opts: Options,
        file: Option<file::FileState>,
    ) -> Result<Store> {
        let format: Option<u8> = match engine.get(meta::FORMAT)? {
            Some(v) => Some(value::decode(&v, "format version")?),
            None => None,
        };
        let (secret, counters) = match format {
            Some(_) => {
                let secret: [u8; 16] = read_meta(&*engine, meta::SECRET)?;
                let next_seq: u64 = read_meta(&*engine, meta::NEXT_SEQ)?;
                let commits: u64 = read_meta(&*engine, meta::COMMITS)?;
                (secret, Counters { next_seq, commits })
            }
            None => {
                let secret = new_secret();
                let counters = Counters {
                    next_seq: 1,
                    commits: 0,
                };
                engine.commit(vec![
                    (
                        meta::FORMAT.to_vec(),
                        Some(value::encode(&value::FORMAT_VERSION)),
                    ),
                    (meta::SECRET.to_vec(), Some(value::encode(&secret))),
                    (
                        meta::NEXT_SEQ.to_vec(),
                        Some(value::encode(&counters.next_seq)),
                    ),
                    (
                        meta::COMMITS.to_vec(),
                        Some(value::encode(&counters.commits)),
                    ),
                ])?;
                (secret, counters)
            }
        };
        Ok(Store {
            engine,
            committer: Committer::new(counters),
            opts,
            secret,
            poisoned: AtomicBool::new(false),
            file,
        })
    }

    /// Runs `f` through the commit path (see `store::commit`).
    fn submit<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Txn<'_>) -> Result<T> + Send + 'static,
    {
        self.committer.submit(self, f)
    }

    fn now(&self) -> u64 {
        self.opts.clock.now_millis()
    }

    /// Groups committed since the store was created.
    pub fn commits(&self) -> u64 {
        self.committer.counters().commits
    }
}

impl Sink for Store {
    fn commit(&self, mut batch: Vec<Write>, counters: Counters) -> Result<()> {
        batch.push((
            meta::NEXT_SEQ.to_vec(),
            Some(value::encode(&counters.next_seq)),
        ));
        batch.push((
            meta::COMMITS.to_vec(),
            Some(value::encode(&counters.commits)),
        ));
        match self.engine.commit(batch) {
            Ok(()) => {
                if let (Some(f), Durability::Immediate) = (&self.file, self.opts.durability) {
                    f.committed(counters.commits);
                }
                Ok(())
            }
            Err(e) => {
                // D6: never acknowledge again until reopened.
                self.poisoned.store(true, Ordering::SeqCst);
                Err(e)
            }
        }
    }

    fn refused(&self) -> Option<StateError> {
        self.poisoned.load(Ordering::SeqCst).then(|| {
            StateError::unavailable(
                "an earlier write failed to persist; the store refuses writes until reopened",
                None,
            )
        })
    }

    fn engine(&self) -> &dyn Engine {
        &*self.engine
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        if let Some(f) = &self.file {
            // The mark may only count commits that are on disk: in
            // `Buffered` mode, sync them first.
            let synced =
                self.opts.durability == Durability::Immediate || self.engine.sync().is_ok();
            f.close(
                self.committer.counters().commits,
                synced && !self.poisoned.load(Ordering::SeqCst),
            );
        }
    }
}

fn read_meta<T: serde::de::DeserializeOwned>(engine: &dyn Engine, key: &[u8]) -> Result<T> {
    let v = engine
        .get(key)?
        .ok_or_else(|| StateError::corrupt(format!("meta value {:?} missing", key[1] as char)))?;
    value::decode(&v, "meta value")
}

/// 16 bytes nobody can guess, from the OS-seeded std hasher keys.
fn new_secret() -> [u8; 16] {
    use std::hash::{BuildHasher, Hasher};
    let mut out = [0u8; 16];
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_usize(i);
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0),
        );
        chunk.copy_from_slice(&h.finish().to_le_bytes());
    }
    out
}

/// K1: ids are 1..=256 bytes of UTF-8 (UTF-8 is given by `&str`).
pub(crate) fn check_id(what: &str, id: &str) -> Result<()> {
    if id.is_empty() || id.len() > ID_BYTES_MAX {
        return Err(StateError::invalid(format!(
            "{what}: must be 1..={ID_BYTES_MAX} bytes, got {}",
            id.len()
        )));
    }
    Ok(())
}

/// K3: a page is 1..=1000 items.
pub(crate) fn check_limit(limit: usize) -> Result<()> {
    if limit == 0 || limit > PAGE_ITEMS_MAX {
        return Err(StateError::invalid(format!(
            "limit: must be 1..={PAGE_ITEMS_MAX}, got {limit}"
        )));
    }
    Ok(())
}

/// K2: an encoded value past the store's limit is `TooLarge`.
pub(crate) fn check_size(what: &str, bytes: usize, max: usize) -> Result<()> {
    if bytes > max {
        return Err(StateError::too_large(format!(
            "{what} is {bytes} bytes, the limit is {max}"
        )));
    }
    Ok(())
}

const _: () = {
    const fn is_send_sync<T: Send + Sync>() {}
    is_send_sync::<Store>();
};

use crate::codec::cursor::{self as cursor_codec, Listing};
use crate::codec::key::successor;
use crate::cursor::Cursor;
use crate::record::Page;

impl Store {
    /// One page of a listing over the keys in `lo..hi`, read straight from
    /// the engine: `accept` turns an entry into an item or skips it. Reads
    /// one matching entry past the page to know whether the walk ends here
    /// (L3), and costs O(limit + skipped entries) (L5).
    // Every listing states all of these; a struct for them would only be
    // built to be taken apart here.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn scan_page<T>(
        &self,
        listing: Listing,
        binding: &[u8],
        lo: &[u8],
        hi: &[u8],
        cursor: Option<&Cursor>,
        limit: usize,
        mut accept: impl FnMut(&[u8], &[u8]) -> Result<Option<T>>,
    ) -> Result<Page<T>> {
        check_limit(limit)?;
        let mut start = match cursor {
            None => lo.to_vec(),
            Some(c) => {
                let pos = cursor_codec::decode(&self.secret, listing, binding, c)?;
                // A position is inside the listing's range. The export
                // spans several tables, so its positions need not share
                // `lo`'s table byte; a due-alarm listing asked again with an
                // earlier `now` may hold a position past `hi` in its table.
                if pos.as_slice() < lo || (pos.as_slice() >= hi && !pos.starts_with(&lo[..1])) {
                    return Err(StateError::invalid("cursor: position outside this listing"));
                }
                successor(&pos)
            }
        };
        let mut items: Vec<(Vec<u8>, T)> = Vec::with_capacity(limit + 1);
        let chunk = (limit + 1).clamp(16, 1024);
        'outer: loop {
            let entries = self.engine.scan(&start, hi, chunk)?;
            let exhausted = entries.len() < chunk;
            for (k, v) in entries {
                start = successor(&k);
                if let Some(item) = accept(&k, &v)? {
                    items.push((k, item));
                    if items.len() > limit {
                        break 'outer;
                    }
                }
            }
            if exhausted {
                break;
            }
        }
        let more = items.len() > limit;
        items.truncate(limit);
        let cursor = match (more, items.last()) {
            (true, Some((k, _))) => Some(cursor_codec::encode(&self.secret, listing, binding, k)),
            _ => None,
        };
        Page::new(items.into_iter().map(|(_, t)| t).collect(), cursor)
    }
}
