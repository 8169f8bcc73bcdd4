//! The two public handles on the key-value store: [`MemoryStore`] (in the
//! process) and [`FileStore`] (one directory on disk). Each holds a
//! [`KvStore`] and hands every trait call to it, so both run one logic.

use std::path::Path;

use super::KvStore;
use super::engine::memory::MemoryEngine;
use agentstate_core::admin::{StoreAdmin, StoreStats, VerifyReport};
use agentstate_core::entry::Entry;
use agentstate_core::error::Result;
use agentstate_core::options::Options;
use agentstate_core::page::{Page, PageRequest};
use agentstate_core::record::{Millis, RunKey, RunRecord, SessionRecord};

/// The in-process backend: every record lives in this process's memory and
/// is gone when the store is dropped. For tests, examples and caches; the
/// rules are the file store's, without a disk.
///
/// ```
/// use agentstate::{MemoryStore, RunKey, RunRecord, StateStore};
/// let store = MemoryStore::new();
/// store.put_run(RunRecord::new(RunKey::new("acme", "run_1"), "planner"))?;
/// # Ok::<(), agentstate::StateError>(())
/// ```
#[derive(Debug)]
pub struct MemoryStore(pub(crate) KvStore);

/// The embedded file backend: one directory on disk, one process at a time
/// (rule D3), and an `Ok` means the write was synced ([`Durability`](agentstate_core::Durability)).
/// Share one handle between the threads of a process (wrap it in an `Arc`).
///
/// ```
/// use agentstate::{FileStore, RunKey, RunRecord, StateStore};
/// # let dir = tempfile::tempdir().unwrap();
/// let store = FileStore::open(dir.path().join("state"))?;
/// store.put_run(RunRecord::new(RunKey::new("acme", "run_1"), "planner"))?;
/// # Ok::<(), agentstate::StateError>(())
/// ```
#[derive(Debug)]
pub struct FileStore(KvStore);

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty in-memory store with the system clock.
    pub fn new() -> MemoryStore {
        Self::with_options(Options::default())
    }

    /// An empty in-memory store. The file store's options (durability,
    /// salvage) mean nothing here and are ignored.
    #[allow(
        clippy::expect_used,
        reason = "a new memory store cannot fail to start"
    )]
    pub fn with_options(opts: Options) -> MemoryStore {
        let engine = MemoryEngine::default();
        MemoryStore(
            KvStore::assemble(Box::new(engine), opts, None)
                .expect("a new memory store cannot fail to start"),
        )
    }

    /// Groups committed since the store was made.
    pub fn commits(&self) -> u64 {
        self.0.commits()
    }
}

impl FileStore {
    /// Opens (creating if needed) the file store at `path`, a directory.
    pub fn open(path: impl AsRef<Path>) -> Result<FileStore> {
        Self::open_with(path, Options::default())
    }

    /// Opens (creating if needed) the file store at `path` with options.
    pub fn open_with(path: impl AsRef<Path>, opts: Options) -> Result<FileStore> {
        super::file::open(path.as_ref(), opts).map(FileStore)
    }

    /// Opens (creating if needed) the file store at `path` on the sled
    /// engine: `open_with(path, Options::new().engine(`[`FileEngine::Sled`]`))`.
    /// Needs the `sled` feature (else `InvalidInput`).
    ///
    /// [`FileEngine::Sled`]: agentstate_core::FileEngine::Sled
    pub fn open_sled(path: impl AsRef<Path>) -> Result<FileStore> {
        Self::open_with(
            path,
            Options::default().engine(agentstate_core::options::FileEngine::Sled),
        )
    }

    /// The store's directory.
    #[allow(clippy::expect_used, reason = "a file store has a path")]
    pub fn path(&self) -> &Path {
        self.0.path().expect("a file store has a path")
    }

    /// Groups committed since the store was created.
    pub fn commits(&self) -> u64 {
        self.0.commits()
    }

    /// Rewrites the store's files without what has been deleted or
    /// overwritten, blocking until done: after
    /// [`purge_tenant`](agentstate_core::StoreAdmin::purge_tenant), no byte of the
    /// tenant's records or ids is left on disk (without it, fjall's
    /// background compaction drops them in its own time). Costs a rewrite
    /// of the whole store; writes go on meanwhile. On the sled engine it
    /// does nothing (sled reclaims space by itself).
    pub fn compact(&self) -> Result<()> {
        self.0.compact()
    }

    /// Deletes a run's state index entry and nothing else, leaving the
    /// store inconsistent on purpose. Only for tests of `verify` and the
    /// tools built on it; never call it on a store you care about.
    #[doc(hidden)]
    pub fn __unindex_run_for_tests(&self, key: &RunKey) -> Result<()> {
        self.0.unindex_run_for_tests(key)
    }

    /// Makes the store at `path` (created if absent) a store in layout
    /// format 1 holding `runs` (with their `seq`s, versions and times as
    /// given), exactly as release 0.1 wrote them, for tests and benchmarks
    /// of the upgrade. Never call it on a store you care about.
    #[doc(hidden)]
    pub fn __write_format1_for_tests(path: impl AsRef<Path>, runs: &[RunRecord]) -> Result<()> {
        let path = path.as_ref();
        let store = FileStore::open(path)?;
        store.0.write_format1_for_tests(runs)?;
        drop(store);
        super::file::write_marker(path, super::upgrade::STORE_FORMAT_OLDEST)
    }
}

/// Hands every trait call of a handle to its `KvStore`.
/// A handle's `StoreAdmin`: every call the inner store's. (Its data
/// traits are generated from the list of calls, `forward_sync!` below.)
macro_rules! admin_of_kv {
    ($handle:ty, $backend:literal, runs_in_caller: $runs_in_caller:literal) => {
        impl StoreAdmin for $handle {
            fn list_sessions(
                &self,
                tenant: &str,
                page: &PageRequest,
            ) -> Result<Page<SessionRecord>> {
                self.0.list_sessions(tenant, page)
            }
            fn is_empty(&self) -> Result<bool> {
                self.0.is_empty()
            }
            fn stats(&self) -> Result<StoreStats> {
                self.0.stats()
            }
            fn verify(&self) -> Result<VerifyReport> {
                self.0.verify()
            }
            fn prune(&self, tenant: &str, finished_before: Millis) -> Result<u64> {
                self.0.prune(tenant, finished_before)
            }
            fn export_page(&self, page: &PageRequest) -> Result<Page<Entry>> {
                self.0.export_page(page)
            }
            fn purge_tenant(&self, tenant: &str) -> Result<u64> {
                let span = agentstate_core::observe::span($backend, "purge_tenant", Some(tenant));
                agentstate_core::observe::call_sync(span, $backend, "purge_tenant", || {
                    self.0.purge_tenant(tenant)
                })
            }
            fn import(&self, entries: &mut dyn Iterator<Item = Result<Entry>>) -> Result<u64> {
                self.0.import(entries)
            }
            fn runs_in_caller(&self) -> bool {
                $runs_in_caller
            }
        }
    };
}

// A memory store never syncs or sleeps: `AsyncStore` runs its calls in the
// caller's task; a file store's go to the blocking pool.
admin_of_kv!(MemoryStore, "memory", runs_in_caller: true);
admin_of_kv!(FileStore, "file", runs_in_caller: false);
agentstate_core::forward_sync!(MemoryStore, "memory", 0);
agentstate_core::forward_sync!(FileStore, "file", 0);

const _: () = {
    const fn is_send_sync<T: Send + Sync>() {}
    is_send_sync::<MemoryStore>();
    is_send_sync::<FileStore>();
};
