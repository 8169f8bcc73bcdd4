//! The conformance suite through [`AsyncStore`] (rules W1, W2): every rule
//! of every backend, each call awaited through the async wrapper inside a
//! multi-threaded runtime (`<backend>_mt`, the call spawned onto a worker
//! thread) and a current-thread runtime (`<backend>_ct`, the call driven
//! by `block_on` on the runtime's own thread, several test threads taking
//! turns). The server backends are awaited natively (no blocking pool),
//! the memory store in the caller's task, the file store on the blocking
//! pool.

use std::future::Future;
use std::sync::Arc;

use agentstate::conformance::ConformanceStore;
use agentstate::{
    Alarm, AsyncStore, BudgetKey, BudgetRecord, BudgetStatus, BudgetStore, Entry, Hold, HoldRecord,
    IdempotencyKey, InstanceKey, ManualClock, MarkedTray, Millis, Page, PageRequest, Result,
    RunKey, RunRecord, RunSpend, SessionKey, SessionRecord, Settled, StateDelta, StateQuery,
    StateStore, StoreAdmin, StoreStats, Tray, TrayFilter, TrayKey, TrayOp, TrayStore, VerifyReport,
};

#[derive(Clone, Copy)]
enum Flavor {
    MultiThread,
    CurrentThread,
}

/// A `Store` whose every call is an `AsyncStore` call on a runtime.
struct ViaAsync {
    store: AsyncStore,
    rt: Arc<tokio::runtime::Runtime>,
    flavor: Flavor,
}

impl ViaAsync {
    fn wrap(store: AsyncStore, flavor: Flavor) -> Arc<dyn ConformanceStore> {
        let rt = match flavor {
            Flavor::MultiThread => tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build(),
            Flavor::CurrentThread => tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build(),
        }
        .expect("a runtime");
        Arc::new(ViaAsync {
            store,
            rt: Arc::new(rt),
            flavor,
        })
    }

    fn go<T: Send + 'static>(&self, fut: impl Future<Output = T> + Send + 'static) -> T {
        match self.flavor {
            Flavor::MultiThread => self
                .rt
                .block_on(self.rt.spawn(fut))
                .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic())),
            Flavor::CurrentThread => self.rt.block_on(fut),
        }
    }
}

/// Clones the wrapper's store into an `async move` block run by `go`.
macro_rules! fwd {
    ($self:ident, |$s:ident| $call:expr) => {{
        let $s = $self.store.clone();
        $self.go(async move { $call })
    }};
}

impl StateStore for ViaAsync {
    fn put_run(&self, record: RunRecord) -> Result<RunRecord> {
        fwd!(self, |s| s.put_run(record).await)
    }
    fn get_run(&self, key: &RunKey) -> Result<Option<RunRecord>> {
        let key = key.clone();
        fwd!(self, |s| s.get_run(&key).await)
    }
    fn patch_run(&self, key: &RunKey, delta: StateDelta) -> Result<RunRecord> {
        let key = key.clone();
        fwd!(self, |s| s.patch_run(&key, delta).await)
    }
    fn put_run_idempotent(&self, record: RunRecord, key: &IdempotencyKey) -> Result<RunRecord> {
        let key = key.clone();
        fwd!(self, |s| s.put_run_idempotent(record, &key).await)
    }
    fn patch_run_idempotent(
        &self,
        key: &RunKey,
        delta: StateDelta,
        idempotency_key: &IdempotencyKey,
    ) -> Result<RunRecord> {
        let (key, idem) = (key.clone(), idempotency_key.clone());
        fwd!(self, |s| s.patch_run_idempotent(&key, delta, &idem).await)
    }
    fn delete_run(&self, key: &RunKey, expected_version: Option<u64>) -> Result<RunRecord> {
        let key = key.clone();
        fwd!(self, |s| s.delete_run(&key, expected_version).await)
    }
    fn list_runs(&self, query: &StateQuery, page: &PageRequest) -> Result<Page<RunRecord>> {
        let (query, page) = (query.clone(), page.clone());
        fwd!(self, |s| s.list_runs(&query, &page).await)
    }
    fn put_session(&self, record: SessionRecord) -> Result<SessionRecord> {
        fwd!(self, |s| s.put_session(record).await)
    }
    fn get_session(&self, key: &SessionKey) -> Result<Option<SessionRecord>> {
        let key = key.clone();
        fwd!(self, |s| s.get_session(&key).await)
    }
    fn delete_session(&self, key: &SessionKey, cascade: bool) -> Result<Vec<RunKey>> {
        let key = key.clone();
        fwd!(self, |s| s.delete_session(&key, cascade).await)
    }
}

impl TrayStore for ViaAsync {
    fn read_tray(&self, key: &TrayKey, epoch: u64) -> Result<Option<Tray>> {
        let key = key.clone();
        fwd!(self, |s| s.read_tray(&key, epoch).await)
    }
    fn write_tray(&self, key: &TrayKey, epoch: u64, tray: Tray) -> Result<()> {
        let key = key.clone();
        fwd!(self, |s| s.write_tray(&key, epoch, tray).await)
    }
    fn delete_tray(&self, key: &TrayKey, epoch: u64) -> Result<bool> {
        let key = key.clone();
        fwd!(self, |s| s.delete_tray(&key, epoch).await)
    }
    fn apply_batch(&self, instance: &InstanceKey, epoch: u64, ops: Vec<TrayOp>) -> Result<()> {
        let instance = instance.clone();
        fwd!(self, |s| s.apply_batch(&instance, epoch, ops).await)
    }
    fn apply_batch_idempotent(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        ops: Vec<TrayOp>,
        key: &IdempotencyKey,
    ) -> Result<()> {
        let (instance, key) = (instance.clone(), key.clone());
        fwd!(self, |s| s
            .apply_batch_idempotent(&instance, epoch, ops, &key)
            .await)
    }
    fn release(&self, instance: &InstanceKey, epoch: u64) -> Result<()> {
        let instance = instance.clone();
        fwd!(self, |s| s.release(&instance, epoch).await)
    }
    fn list_trays(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        page: &PageRequest,
    ) -> Result<Page<(TrayKey, Tray)>> {
        let (instance, page) = (instance.clone(), page.clone());
        fwd!(self, |s| s.list_trays(&instance, epoch, &page).await)
    }
    fn instance_trays(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        filter: &TrayFilter,
    ) -> Result<Vec<(TrayKey, Tray)>> {
        let (instance, filter) = (instance.clone(), filter.clone());
        fwd!(self, |s| s.instance_trays(&instance, epoch, &filter).await)
    }
    fn marked_trays(&self, env: Option<&str>, page: &PageRequest) -> Result<Page<MarkedTray>> {
        let (env, page) = (env.map(str::to_owned), page.clone());
        fwd!(self, |s| s.marked_trays(env.as_deref(), &page).await)
    }
    fn epoch(&self, instance: &InstanceKey) -> Result<u64> {
        let instance = instance.clone();
        fwd!(self, |s| s.epoch(&instance).await)
    }
    fn set_alarm(&self, instance: &InstanceKey, epoch: u64, due_at: Millis) -> Result<()> {
        let instance = instance.clone();
        fwd!(self, |s| s.set_alarm(&instance, epoch, due_at).await)
    }
    fn due_alarms(&self, now: Millis, page: &PageRequest) -> Result<Page<Alarm>> {
        let page = page.clone();
        fwd!(self, |s| s.due_alarms(now, &page).await)
    }
    fn ack_alarm(&self, instance: &InstanceKey, epoch: u64, due_at: Millis) -> Result<bool> {
        let instance = instance.clone();
        fwd!(self, |s| s.ack_alarm(&instance, epoch, due_at).await)
    }
}

impl BudgetStore for ViaAsync {
    fn put_budget(&self, record: BudgetRecord) -> Result<BudgetRecord> {
        fwd!(self, |s| s.put_budget(record).await)
    }
    fn get_budget(&self, key: &BudgetKey) -> Result<Option<BudgetStatus>> {
        let key = key.clone();
        fwd!(self, |s| s.get_budget(&key).await)
    }
    fn list_budgets(&self, tenant: &str, page: &PageRequest) -> Result<Page<BudgetStatus>> {
        let (tenant, page) = (tenant.to_owned(), page.clone());
        fwd!(self, |s| s.list_budgets(&tenant, &page).await)
    }
    fn reserve(&self, run: &RunKey, hold: Hold) -> Result<HoldRecord> {
        let run = run.clone();
        fwd!(self, |s| s.reserve(&run, hold).await)
    }
    fn settle(&self, run: &RunKey, hold_id: &str, spent: StateDelta) -> Result<Settled> {
        let (run, hold_id) = (run.clone(), hold_id.to_owned());
        fwd!(self, |s| s.settle(&run, &hold_id, spent).await)
    }
    fn release_hold(&self, run: &RunKey, hold_id: &str) -> Result<()> {
        let (run, hold_id) = (run.clone(), hold_id.to_owned());
        fwd!(self, |s| s.release_hold(&run, &hold_id).await)
    }
    fn reserve_idempotent(
        &self,
        run: &RunKey,
        hold: Hold,
        key: &IdempotencyKey,
    ) -> Result<HoldRecord> {
        let (run, key) = (run.clone(), key.clone());
        fwd!(self, |s| s.reserve_idempotent(&run, hold, &key).await)
    }
    fn settle_idempotent(
        &self,
        run: &RunKey,
        hold_id: &str,
        spent: StateDelta,
        key: &IdempotencyKey,
    ) -> Result<Settled> {
        let (run, hold_id, key) = (run.clone(), hold_id.to_owned(), key.clone());
        fwd!(self, |s| s
            .settle_idempotent(&run, &hold_id, spent, &key)
            .await)
    }
    fn release_hold_idempotent(
        &self,
        run: &RunKey,
        hold_id: &str,
        key: &IdempotencyKey,
    ) -> Result<()> {
        let (run, hold_id, key) = (run.clone(), hold_id.to_owned(), key.clone());
        fwd!(self, |s| s
            .release_hold_idempotent(&run, &hold_id, &key)
            .await)
    }
    fn run_spend(&self, run: &RunKey) -> Result<Option<RunSpend>> {
        let run = run.clone();
        fwd!(self, |s| s.run_spend(&run).await)
    }
}

impl agentstate::FeedStore for ViaAsync {
    fn changes(
        &self,
        scope: &agentstate::FeedScope,
        after: agentstate::Position,
        limit: usize,
    ) -> Result<agentstate::ChangePage> {
        let scope = scope.clone();
        fwd!(self, |s| s.changes(&scope, after, limit).await)
    }
    fn wait_changes(
        &self,
        scope: &agentstate::FeedScope,
        after: agentstate::Position,
        limit: usize,
        timeout: std::time::Duration,
    ) -> Result<agentstate::ChangePage> {
        let scope = scope.clone();
        fwd!(self, |s| s
            .wait_changes(&scope, after, limit, timeout)
            .await)
    }
    fn feed_head(&self, scope: &agentstate::FeedScope) -> Result<agentstate::Position> {
        let scope = scope.clone();
        fwd!(self, |s| s.feed_head(&scope).await)
    }
    fn prune_changes(
        &self,
        scope: &agentstate::FeedScope,
        through: agentstate::Position,
    ) -> Result<u64> {
        let scope = scope.clone();
        fwd!(self, |s| s.prune_changes(&scope, through).await)
    }
}

impl StoreAdmin for ViaAsync {
    fn list_sessions(&self, tenant: &str, page: &PageRequest) -> Result<Page<SessionRecord>> {
        let (tenant, page) = (tenant.to_owned(), page.clone());
        fwd!(self, |s| s.list_sessions(&tenant, &page).await)
    }
    fn is_empty(&self) -> Result<bool> {
        fwd!(self, |s| s.is_empty().await)
    }
    fn stats(&self) -> Result<StoreStats> {
        fwd!(self, |s| s.stats().await)
    }
    fn verify(&self) -> Result<VerifyReport> {
        fwd!(self, |s| s.verify().await)
    }
    fn prune(&self, tenant: &str, finished_before: Millis) -> Result<u64> {
        let tenant = tenant.to_owned();
        fwd!(self, |s| s.prune(&tenant, finished_before).await)
    }
    fn purge_tenant(&self, tenant: &str) -> Result<u64> {
        let tenant = tenant.to_owned();
        fwd!(self, |s| s.purge_tenant(&tenant).await)
    }
    fn export_page(&self, page: &PageRequest) -> Result<Page<Entry>> {
        let page = page.clone();
        fwd!(self, |s| s.export_page(&page).await)
    }
    fn import(&self, entries: &mut dyn Iterator<Item = Result<Entry>>) -> Result<u64> {
        let entries: Vec<Entry> = entries.collect::<Result<_>>()?;
        fwd!(self, |s| s.import(entries).await)
    }
}

/// One module per backend and flavor, each the whole suite.
macro_rules! async_suite {
    ($($name:ident: $flavor:expr, $make:expr;)*) => {$(
        mod $name {
            use super::*;

            fn factory(clock: Arc<ManualClock>) -> Arc<dyn ConformanceStore> {
                let make: fn(Arc<ManualClock>) -> AsyncStore = $make;
                ViaAsync::wrap(make(clock), $flavor)
            }

            agentstate::conformance_tests!(factory);
        }
    )*};
}

fn memory(clock: Arc<ManualClock>) -> AsyncStore {
    AsyncStore::new(agentstate::MemoryStore::with_options(
        agentstate::Options::new().clock(clock),
    ))
}

fn file(clock: Arc<ManualClock>) -> AsyncStore {
    AsyncStore::from(crate::conformance::file_stores::open_file(
        clock,
        agentstate::FileEngine::Fjall,
    ))
}

async_suite! {
    memory_mt: Flavor::MultiThread, memory;
    memory_ct: Flavor::CurrentThread, memory;
    file_mt: Flavor::MultiThread, file;
    file_ct: Flavor::CurrentThread, file;
}

#[cfg(feature = "postgres")]
fn postgres(clock: Arc<ManualClock>) -> AsyncStore {
    AsyncStore::new(crate::postgres::store(
        agentstate::Options::new().clock(clock),
    ))
}

#[cfg(feature = "postgres")]
async_suite! {
    postgres_mt: Flavor::MultiThread, postgres;
    postgres_ct: Flavor::CurrentThread, postgres;
}

#[cfg(feature = "redis")]
fn redis(clock: Arc<ManualClock>) -> AsyncStore {
    let url = crate::redis_server::shared_url(0);
    AsyncStore::new(
        agentstate::RedisStore::connect_with(
            &url,
            agentstate::RedisOptions::new()
                .options(agentstate::Options::new().clock(clock))
                .pool_size(16),
        )
        .expect("connect to the test redis-server"),
    )
}

#[cfg(feature = "redis")]
async_suite! {
    redis_mt: Flavor::MultiThread, redis;
    redis_ct: Flavor::CurrentThread, redis;
}
