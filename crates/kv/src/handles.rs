//! The two public handles on the key-value store: [`MemoryStore`] (in the
//! process) and [`FileStore`] (one directory on disk). Each holds a
//! [`KvStore`] and hands every trait call to it, so both run one logic.

use agentstate_core::idempotency::IdempotencyKey;
use std::path::Path;

use super::KvStore;
use super::engine::memory::MemoryEngine;
use agentstate_core::admin::{StoreAdmin, StoreStats, VerifyReport};
use agentstate_core::api::{StateStore, TrayStore};
use agentstate_core::budget::{
    BudgetKey, BudgetRecord, BudgetStatus, BudgetStore, Hold, HoldRecord, RunSpend, Settled,
};
use agentstate_core::entry::Entry;
use agentstate_core::error::Result;
use agentstate_core::options::Options;
use agentstate_core::page::{Page, PageRequest};
use agentstate_core::record::{
    Millis, RunKey, RunRecord, SessionKey, SessionRecord, StateDelta, StateQuery,
};
use agentstate_core::tray::{Alarm, InstanceKey, MarkedTray, Tray, TrayFilter, TrayKey, TrayOp};

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
macro_rules! forward_to_kv {
    ($handle:ty, $backend:literal, runs_in_caller: $runs_in_caller:literal) => {
        impl StateStore for $handle {
            fn put_run(&self, record: RunRecord) -> Result<RunRecord> {
                let span =
                    agentstate_core::observe::span($backend, "put_run", Some(&record.key.tenant));
                agentstate_core::observe::call_sync(span, $backend, "put_run", || {
                    self.0.put_run(record)
                })
            }
            fn get_run(&self, key: &RunKey) -> Result<Option<RunRecord>> {
                let span = agentstate_core::observe::span($backend, "get_run", Some(&key.tenant));
                agentstate_core::observe::call_sync(span, $backend, "get_run", || {
                    self.0.get_run(key)
                })
            }
            fn patch_run(&self, key: &RunKey, delta: StateDelta) -> Result<RunRecord> {
                let span = agentstate_core::observe::span($backend, "patch_run", Some(&key.tenant));
                agentstate_core::observe::call_sync(span, $backend, "patch_run", || {
                    self.0.patch_run(key, delta)
                })
            }
            fn put_run_idempotent(
                &self,
                record: RunRecord,
                key: &IdempotencyKey,
            ) -> Result<RunRecord> {
                let span = agentstate_core::observe::span(
                    $backend,
                    "put_run_idempotent",
                    Some(&record.key.tenant),
                );
                agentstate_core::observe::call_sync(span, $backend, "put_run_idempotent", || {
                    self.0.put_run_idempotent(record, key)
                })
            }
            fn patch_run_idempotent(
                &self,
                key: &RunKey,
                delta: StateDelta,
                idempotency_key: &IdempotencyKey,
            ) -> Result<RunRecord> {
                let span = agentstate_core::observe::span(
                    $backend,
                    "patch_run_idempotent",
                    Some(&key.tenant),
                );
                agentstate_core::observe::call_sync(span, $backend, "patch_run_idempotent", || {
                    self.0.patch_run_idempotent(key, delta, idempotency_key)
                })
            }
            fn delete_run(&self, key: &RunKey, expected_version: Option<u64>) -> Result<RunRecord> {
                let span =
                    agentstate_core::observe::span($backend, "delete_run", Some(&key.tenant));
                agentstate_core::observe::call_sync(span, $backend, "delete_run", || {
                    self.0.delete_run(key, expected_version)
                })
            }
            fn list_runs(&self, query: &StateQuery, page: &PageRequest) -> Result<Page<RunRecord>> {
                let span = agentstate_core::observe::span($backend, "list_runs", None);
                agentstate_core::observe::call_sync(span, $backend, "list_runs", || {
                    self.0.list_runs(query, page)
                })
            }
            fn put_session(&self, record: SessionRecord) -> Result<SessionRecord> {
                let span = agentstate_core::observe::span(
                    $backend,
                    "put_session",
                    Some(&record.key.tenant),
                );
                agentstate_core::observe::call_sync(span, $backend, "put_session", || {
                    self.0.put_session(record)
                })
            }
            fn get_session(&self, key: &SessionKey) -> Result<Option<SessionRecord>> {
                let span =
                    agentstate_core::observe::span($backend, "get_session", Some(&key.tenant));
                agentstate_core::observe::call_sync(span, $backend, "get_session", || {
                    self.0.get_session(key)
                })
            }
            fn delete_session(&self, key: &SessionKey, cascade: bool) -> Result<Vec<RunKey>> {
                let span =
                    agentstate_core::observe::span($backend, "delete_session", Some(&key.tenant));
                agentstate_core::observe::call_sync(span, $backend, "delete_session", || {
                    self.0.delete_session(key, cascade)
                })
            }
        }

        impl TrayStore for $handle {
            fn read_tray(&self, key: &TrayKey, epoch: u64) -> Result<Option<Tray>> {
                let span = agentstate_core::observe::span($backend, "read_tray", None);
                agentstate_core::observe::call_sync(span, $backend, "read_tray", || {
                    self.0.read_tray(key, epoch)
                })
            }
            fn write_tray(&self, key: &TrayKey, epoch: u64, tray: Tray) -> Result<()> {
                let span = agentstate_core::observe::span($backend, "write_tray", None);
                agentstate_core::observe::call_sync(span, $backend, "write_tray", || {
                    self.0.write_tray(key, epoch, tray)
                })
            }
            fn delete_tray(&self, key: &TrayKey, epoch: u64) -> Result<bool> {
                let span = agentstate_core::observe::span($backend, "delete_tray", None);
                agentstate_core::observe::call_sync(span, $backend, "delete_tray", || {
                    self.0.delete_tray(key, epoch)
                })
            }
            fn apply_batch(
                &self,
                instance: &InstanceKey,
                epoch: u64,
                ops: Vec<TrayOp>,
            ) -> Result<()> {
                let span = agentstate_core::observe::span($backend, "apply_batch", None);
                agentstate_core::observe::call_sync(span, $backend, "apply_batch", || {
                    self.0.apply_batch(instance, epoch, ops)
                })
            }
            fn apply_batch_idempotent(
                &self,
                instance: &InstanceKey,
                epoch: u64,
                ops: Vec<TrayOp>,
                key: &IdempotencyKey,
            ) -> Result<()> {
                let span = agentstate_core::observe::span($backend, "apply_batch_idempotent", None);
                agentstate_core::observe::call_sync(
                    span,
                    $backend,
                    "apply_batch_idempotent",
                    || self.0.apply_batch_idempotent(instance, epoch, ops, key),
                )
            }
            fn release(&self, instance: &InstanceKey, epoch: u64) -> Result<()> {
                let span = agentstate_core::observe::span($backend, "release", None);
                agentstate_core::observe::call_sync(span, $backend, "release", || {
                    self.0.release(instance, epoch)
                })
            }
            fn list_trays(
                &self,
                instance: &InstanceKey,
                epoch: u64,
                page: &PageRequest,
            ) -> Result<Page<(TrayKey, Tray)>> {
                let span = agentstate_core::observe::span($backend, "list_trays", None);
                agentstate_core::observe::call_sync(span, $backend, "list_trays", || {
                    self.0.list_trays(instance, epoch, page)
                })
            }
            fn instance_trays(
                &self,
                instance: &InstanceKey,
                epoch: u64,
                filter: &TrayFilter,
            ) -> Result<Vec<(TrayKey, Tray)>> {
                let span = agentstate_core::observe::span($backend, "instance_trays", None);
                agentstate_core::observe::call_sync(span, $backend, "instance_trays", || {
                    self.0.instance_trays(instance, epoch, filter)
                })
            }
            fn marked_trays(
                &self,
                env: Option<&str>,
                page: &PageRequest,
            ) -> Result<Page<MarkedTray>> {
                let span = agentstate_core::observe::span($backend, "marked_trays", None);
                agentstate_core::observe::call_sync(span, $backend, "marked_trays", || {
                    self.0.marked_trays(env, page)
                })
            }
            fn epoch(&self, instance: &InstanceKey) -> Result<u64> {
                let span = agentstate_core::observe::span($backend, "epoch", None);
                agentstate_core::observe::call_sync(span, $backend, "epoch", || {
                    self.0.epoch(instance)
                })
            }
            fn set_alarm(&self, instance: &InstanceKey, epoch: u64, due_at: Millis) -> Result<()> {
                let span = agentstate_core::observe::span($backend, "set_alarm", None);
                agentstate_core::observe::call_sync(span, $backend, "set_alarm", || {
                    self.0.set_alarm(instance, epoch, due_at)
                })
            }
            fn due_alarms(&self, now: Millis, page: &PageRequest) -> Result<Page<Alarm>> {
                let span = agentstate_core::observe::span($backend, "due_alarms", None);
                agentstate_core::observe::call_sync(span, $backend, "due_alarms", || {
                    self.0.due_alarms(now, page)
                })
            }
            fn ack_alarm(
                &self,
                instance: &InstanceKey,
                epoch: u64,
                due_at: Millis,
            ) -> Result<bool> {
                let span = agentstate_core::observe::span($backend, "ack_alarm", None);
                agentstate_core::observe::call_sync(span, $backend, "ack_alarm", || {
                    self.0.ack_alarm(instance, epoch, due_at)
                })
            }
        }

        impl BudgetStore for $handle {
            fn put_budget(&self, record: BudgetRecord) -> Result<BudgetRecord> {
                let span = agentstate_core::observe::span(
                    $backend,
                    "put_budget",
                    Some(&record.key.tenant),
                );
                agentstate_core::observe::call_sync(span, $backend, "put_budget", || {
                    self.0.put_budget(record)
                })
            }
            fn get_budget(&self, key: &BudgetKey) -> Result<Option<BudgetStatus>> {
                let span =
                    agentstate_core::observe::span($backend, "get_budget", Some(&key.tenant));
                agentstate_core::observe::call_sync(span, $backend, "get_budget", || {
                    self.0.get_budget(key)
                })
            }
            fn list_budgets(&self, tenant: &str, page: &PageRequest) -> Result<Page<BudgetStatus>> {
                let span = agentstate_core::observe::span($backend, "list_budgets", Some(tenant));
                agentstate_core::observe::call_sync(span, $backend, "list_budgets", || {
                    self.0.list_budgets(tenant, page)
                })
            }
            fn reserve(&self, run: &RunKey, hold: Hold) -> Result<HoldRecord> {
                let span = agentstate_core::observe::span($backend, "reserve", Some(&run.tenant));
                agentstate_core::observe::call_sync(span, $backend, "reserve", || {
                    self.0.reserve(run, hold)
                })
            }
            fn settle(&self, run: &RunKey, hold_id: &str, spent: StateDelta) -> Result<Settled> {
                let span = agentstate_core::observe::span($backend, "settle", Some(&run.tenant));
                agentstate_core::observe::call_sync(span, $backend, "settle", || {
                    self.0.settle(run, hold_id, spent)
                })
            }
            fn release_hold(&self, run: &RunKey, hold_id: &str) -> Result<()> {
                let span =
                    agentstate_core::observe::span($backend, "release_hold", Some(&run.tenant));
                agentstate_core::observe::call_sync(span, $backend, "release_hold", || {
                    self.0.release_hold(run, hold_id)
                })
            }
            fn reserve_idempotent(
                &self,
                run: &RunKey,
                hold: Hold,
                key: &IdempotencyKey,
            ) -> Result<HoldRecord> {
                let span = agentstate_core::observe::span(
                    $backend,
                    "reserve_idempotent",
                    Some(&run.tenant),
                );
                agentstate_core::observe::call_sync(span, $backend, "reserve_idempotent", || {
                    self.0.reserve_idempotent(run, hold, key)
                })
            }
            fn settle_idempotent(
                &self,
                run: &RunKey,
                hold_id: &str,
                spent: StateDelta,
                key: &IdempotencyKey,
            ) -> Result<Settled> {
                let span = agentstate_core::observe::span(
                    $backend,
                    "settle_idempotent",
                    Some(&run.tenant),
                );
                agentstate_core::observe::call_sync(span, $backend, "settle_idempotent", || {
                    self.0.settle_idempotent(run, hold_id, spent, key)
                })
            }
            fn release_hold_idempotent(
                &self,
                run: &RunKey,
                hold_id: &str,
                key: &IdempotencyKey,
            ) -> Result<()> {
                let span = agentstate_core::observe::span(
                    $backend,
                    "release_hold_idempotent",
                    Some(&run.tenant),
                );
                agentstate_core::observe::call_sync(
                    span,
                    $backend,
                    "release_hold_idempotent",
                    || self.0.release_hold_idempotent(run, hold_id, key),
                )
            }
            fn run_spend(&self, run: &RunKey) -> Result<Option<RunSpend>> {
                let span = agentstate_core::observe::span($backend, "run_spend", Some(&run.tenant));
                agentstate_core::observe::call_sync(span, $backend, "run_spend", || {
                    self.0.run_spend(run)
                })
            }
        }

        impl agentstate_core::feed::FeedStore for $handle {
            fn changes(
                &self,
                scope: &agentstate_core::feed::FeedScope,
                after: agentstate_core::feed::Position,
                limit: usize,
            ) -> Result<agentstate_core::feed::ChangePage> {
                self.0.changes(scope, after, limit)
            }
            fn wait_changes(
                &self,
                scope: &agentstate_core::feed::FeedScope,
                after: agentstate_core::feed::Position,
                limit: usize,
                timeout: std::time::Duration,
            ) -> Result<agentstate_core::feed::ChangePage> {
                self.0.wait_changes(scope, after, limit, timeout)
            }
            fn feed_head(
                &self,
                scope: &agentstate_core::feed::FeedScope,
            ) -> Result<agentstate_core::feed::Position> {
                self.0.feed_head(scope)
            }
            fn prune_changes(
                &self,
                scope: &agentstate_core::feed::FeedScope,
                through: agentstate_core::feed::Position,
            ) -> Result<u64> {
                self.0.prune_changes(scope, through)
            }
        }
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
forward_to_kv!(MemoryStore, "memory", runs_in_caller: true);
forward_to_kv!(FileStore, "file", runs_in_caller: false);

const _: () = {
    const fn is_send_sync<T: Send + Sync>() {}
    is_send_sync::<MemoryStore>();
    is_send_sync::<FileStore>();
};
