//! The async core of the server backends, and the two ways it is called.
//!
//! A server backend (PostgreSQL, Redis) implements every call once, as an
//! `async fn` of [`AsyncCore`] over its native async client. Then:
//!
//! - `AsyncStore` awaits those futures in the caller's
//!   own task, through the object-safe [`DynCore`] (one boxed future per
//!   call; no thread hop, no `spawn_blocking`);
//! - the synchronous traits ([`StateStore`](crate::StateStore) and the
//!   rest) are [`sync_over_async!`] impls that drive the same future to
//!   completion on the calling thread with [`Bridge::block_on`].
//!
//! The [`Bridge`] is a small runtime of the store's own (one worker
//! thread). Its connections live there: a dial runs on it, and the
//! connection's I/O task is spawned on it, so a pooled connection outlives
//! the runtime of whichever caller dialed it (a `#[tokio::test]` runtime
//! ends with its test; the store's pool does not). `block_on` never starts
//! a runtime, so it cannot panic inside one: it polls the future on the
//! calling thread with the store's runtime entered (its timers and
//! sockets), parking the thread between wake-ups. Called from an executor
//! thread it blocks that thread for the call (use `AsyncStore` there);
//! called anywhere else it is an ordinary blocking call.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use crate::budget::{BudgetKey, BudgetRecord, BudgetStatus, Hold, HoldRecord, RunSpend, Settled};
use crate::error::{Result, StateError};
use crate::idempotency::IdempotencyKey;
use crate::page::{Page, PageRequest};
use crate::record::{Millis, RunKey, RunRecord, SessionKey, SessionRecord, StateDelta, StateQuery};
use crate::tray::{Alarm, InstanceKey, MarkedTray, Tray, TrayFilter, TrayKey, TrayOp};

/// A store's own small runtime, and the way synchronous calls wait on it.
pub struct Bridge {
    /// `Some` until dropped; shut down in the background so dropping it
    /// never blocks and never panics inside another runtime.
    rt: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for Bridge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Bridge")
    }
}

impl Bridge {
    /// A runtime of one worker thread named `name` (its connections' I/O
    /// and timers).
    pub fn new(name: &str) -> Result<Bridge> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name(name)
            .enable_all()
            .build()
            .map_err(|e| {
                StateError::unavailable(format!("{name}: cannot start its runtime: {e}"), None)
            })?;
        Ok(Bridge { rt: Some(rt) })
    }

    pub fn handle(&self) -> &tokio::runtime::Handle {
        self.rt
            .as_ref()
            .expect("the runtime lives until the bridge is dropped")
            .handle()
    }

    /// Drives `fut` to completion on this thread, inside or outside any
    /// runtime (see the module's docs).
    ///
    /// `fut` runs unconstrained by tokio's cooperative budget: called from
    /// inside a task, it would otherwise spend that task's budget, and once
    /// the budget is gone every tokio resource answers `Pending` until the
    /// task yields to its scheduler, which it cannot do while this thread
    /// waits here (a spin on a multi-thread runtime, a hang on a
    /// current-thread one).
    pub fn block_on<F: Future>(&self, fut: F) -> F::Output {
        let _entered = self.handle().enter();
        block_on(tokio::task::unconstrained(fut))
    }

    /// Runs `fut` on the store's runtime and awaits its answer from any
    /// executor: how a connection is dialed (so its socket belongs to the
    /// store's runtime, not the caller's).
    pub async fn on_runtime<F>(&self, fut: F) -> F::Output
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        match self.handle().spawn(fut).await {
            Ok(v) => v,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // Only a runtime shutting down cancels its tasks: the store
            // is being dropped, and no caller can still hold it.
            Err(e) => panic!("the store's runtime stopped while it was in use: {e}"),
        }
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// Wakes the parked thread that polls.
struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// Polls `fut` on this thread until it is ready, parking in between.
pub fn block_on<F: Future>(fut: F) -> F::Output {
    let mut fut = std::pin::pin!(fut);
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

/// Every call of [`StateStore`](crate::StateStore),
/// [`TrayStore`](crate::TrayStore), [`BudgetStore`](crate::BudgetStore)
/// and `list_sessions`, as an `async fn`: what a server backend implements
/// once. Same names, arguments and rules as the synchronous traits.
pub trait AsyncCore: Send + Sync {
    /// The store's runtime, for the synchronous impls.
    fn bridge(&self) -> &Bridge;

    fn put_run(&self, record: RunRecord) -> impl Future<Output = Result<RunRecord>> + Send;
    fn get_run(&self, key: &RunKey) -> impl Future<Output = Result<Option<RunRecord>>> + Send;
    fn patch_run(
        &self,
        key: &RunKey,
        delta: StateDelta,
    ) -> impl Future<Output = Result<RunRecord>> + Send;
    fn put_run_idempotent(
        &self,
        record: RunRecord,
        key: &IdempotencyKey,
    ) -> impl Future<Output = Result<RunRecord>> + Send;
    fn patch_run_idempotent(
        &self,
        key: &RunKey,
        delta: StateDelta,
        idempotency_key: &IdempotencyKey,
    ) -> impl Future<Output = Result<RunRecord>> + Send;
    fn delete_run(
        &self,
        key: &RunKey,
        expected_version: Option<u64>,
    ) -> impl Future<Output = Result<RunRecord>> + Send;
    fn list_runs(
        &self,
        query: &StateQuery,
        page: &PageRequest,
    ) -> impl Future<Output = Result<Page<RunRecord>>> + Send;
    fn put_session(
        &self,
        record: SessionRecord,
    ) -> impl Future<Output = Result<SessionRecord>> + Send;
    fn get_session(
        &self,
        key: &SessionKey,
    ) -> impl Future<Output = Result<Option<SessionRecord>>> + Send;
    fn delete_session(
        &self,
        key: &SessionKey,
        cascade: bool,
    ) -> impl Future<Output = Result<Vec<RunKey>>> + Send;
    fn list_sessions(
        &self,
        tenant: &str,
        page: &PageRequest,
    ) -> impl Future<Output = Result<Page<SessionRecord>>> + Send;

    fn changes(
        &self,
        scope: &crate::feed::FeedScope,
        after: crate::feed::Position,
        limit: usize,
    ) -> impl Future<Output = Result<crate::feed::ChangePage>> + Send;
    fn wait_changes(
        &self,
        scope: &crate::feed::FeedScope,
        after: crate::feed::Position,
        limit: usize,
        timeout: std::time::Duration,
    ) -> impl Future<Output = Result<crate::feed::ChangePage>> + Send;
    fn feed_head(
        &self,
        scope: &crate::feed::FeedScope,
    ) -> impl Future<Output = Result<crate::feed::Position>> + Send;
    fn prune_changes(
        &self,
        scope: &crate::feed::FeedScope,
        through: crate::feed::Position,
    ) -> impl Future<Output = Result<u64>> + Send;

    fn read_tray(
        &self,
        key: &TrayKey,
        epoch: u64,
    ) -> impl Future<Output = Result<Option<Tray>>> + Send;
    fn write_tray(
        &self,
        key: &TrayKey,
        epoch: u64,
        tray: Tray,
    ) -> impl Future<Output = Result<()>> + Send;
    fn delete_tray(&self, key: &TrayKey, epoch: u64) -> impl Future<Output = Result<bool>> + Send;
    fn apply_batch(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        ops: Vec<TrayOp>,
    ) -> impl Future<Output = Result<()>> + Send;
    fn apply_batch_idempotent(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        ops: Vec<TrayOp>,
        key: &IdempotencyKey,
    ) -> impl Future<Output = Result<()>> + Send;
    fn release(
        &self,
        instance: &InstanceKey,
        epoch: u64,
    ) -> impl Future<Output = Result<()>> + Send;
    fn list_trays(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        page: &PageRequest,
    ) -> impl Future<Output = Result<Page<(TrayKey, Tray)>>> + Send;
    /// [`TrayStore::instance_trays`](crate::TrayStore::instance_trays).
    /// The default pages `list_trays` at `epoch` with the largest page and
    /// filters and sorts here, as the sync trait's default does (one
    /// snapshot per page); a backend answers from one snapshot by
    /// overriding it.
    fn instance_trays(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        filter: &TrayFilter,
    ) -> impl Future<Output = Result<Vec<(TrayKey, Tray)>>> + Send {
        async move {
            filter.check()?;
            let max = crate::limits::PAGE_ITEMS_MAX;
            let mut out = Vec::new();
            let mut req = PageRequest::new(max);
            loop {
                let (items, next) = self.list_trays(instance, epoch, &req).await?.into_parts();
                out.extend(items.into_iter().filter(|(k, t)| filter.matches(k, t)));
                match next {
                    Some(c) => req = PageRequest::new(max).after(Some(&c)),
                    None => break,
                }
            }
            crate::tray::sort_trays(&mut out);
            Ok(out)
        }
    }
    fn marked_trays(
        &self,
        env: Option<&str>,
        page: &PageRequest,
    ) -> impl Future<Output = Result<Page<MarkedTray>>> + Send;
    fn epoch(&self, instance: &InstanceKey) -> impl Future<Output = Result<u64>> + Send;
    fn set_alarm(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        due_at: Millis,
    ) -> impl Future<Output = Result<()>> + Send;
    fn due_alarms(
        &self,
        now: Millis,
        page: &PageRequest,
    ) -> impl Future<Output = Result<Page<Alarm>>> + Send;
    fn ack_alarm(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        due_at: Millis,
    ) -> impl Future<Output = Result<bool>> + Send;

    fn put_budget(&self, record: BudgetRecord)
    -> impl Future<Output = Result<BudgetRecord>> + Send;
    fn get_budget(
        &self,
        key: &BudgetKey,
    ) -> impl Future<Output = Result<Option<BudgetStatus>>> + Send;
    fn list_budgets(
        &self,
        tenant: &str,
        page: &PageRequest,
    ) -> impl Future<Output = Result<Page<BudgetStatus>>> + Send;
    fn reserve(&self, run: &RunKey, hold: Hold) -> impl Future<Output = Result<HoldRecord>> + Send;
    fn settle(
        &self,
        run: &RunKey,
        hold_id: &str,
        spent: StateDelta,
    ) -> impl Future<Output = Result<Settled>> + Send;
    fn release_hold(&self, run: &RunKey, hold_id: &str) -> impl Future<Output = Result<()>> + Send;
    fn reserve_idempotent(
        &self,
        run: &RunKey,
        hold: Hold,
        key: &IdempotencyKey,
    ) -> impl Future<Output = Result<HoldRecord>> + Send;
    fn settle_idempotent(
        &self,
        run: &RunKey,
        hold_id: &str,
        spent: StateDelta,
        key: &IdempotencyKey,
    ) -> impl Future<Output = Result<Settled>> + Send;
    fn release_hold_idempotent(
        &self,
        run: &RunKey,
        hold_id: &str,
        key: &IdempotencyKey,
    ) -> impl Future<Output = Result<()>> + Send;
    fn run_spend(&self, run: &RunKey) -> impl Future<Output = Result<Option<RunSpend>>> + Send;
}

/// A boxed call of [`DynCore`].
pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = Result<T>> + Send + 'a>>;

/// [`AsyncCore`] as a trait object, for `AsyncStore`:
/// every backend with an async core is one, through the blanket impl, and
/// hands itself out as one from
/// [`StoreAdmin::async_core`](crate::StoreAdmin::async_core). Public only
/// so that trait method may name it; this module is not reachable from
/// outside the crate.
#[allow(clippy::too_many_arguments)]
pub trait DynCore: Send + Sync {
    fn put_run<'a>(&'a self, record: RunRecord) -> BoxFut<'a, RunRecord>;
    fn get_run<'a>(&'a self, key: &'a RunKey) -> BoxFut<'a, Option<RunRecord>>;
    fn patch_run<'a>(&'a self, key: &'a RunKey, delta: StateDelta) -> BoxFut<'a, RunRecord>;
    fn put_run_idempotent<'a>(
        &'a self,
        record: RunRecord,
        key: &'a IdempotencyKey,
    ) -> BoxFut<'a, RunRecord>;
    fn patch_run_idempotent<'a>(
        &'a self,
        key: &'a RunKey,
        delta: StateDelta,
        idempotency_key: &'a IdempotencyKey,
    ) -> BoxFut<'a, RunRecord>;
    fn delete_run<'a>(
        &'a self,
        key: &'a RunKey,
        expected_version: Option<u64>,
    ) -> BoxFut<'a, RunRecord>;
    fn list_runs<'a>(
        &'a self,
        query: &'a StateQuery,
        page: &'a PageRequest,
    ) -> BoxFut<'a, Page<RunRecord>>;
    fn put_session<'a>(&'a self, record: SessionRecord) -> BoxFut<'a, SessionRecord>;
    fn get_session<'a>(&'a self, key: &'a SessionKey) -> BoxFut<'a, Option<SessionRecord>>;
    fn delete_session<'a>(&'a self, key: &'a SessionKey, cascade: bool) -> BoxFut<'a, Vec<RunKey>>;
    fn list_sessions<'a>(
        &'a self,
        tenant: &'a str,
        page: &'a PageRequest,
    ) -> BoxFut<'a, Page<SessionRecord>>;
    fn changes<'a>(
        &'a self,
        scope: &'a crate::feed::FeedScope,
        after: crate::feed::Position,
        limit: usize,
    ) -> BoxFut<'a, crate::feed::ChangePage>;
    fn wait_changes<'a>(
        &'a self,
        scope: &'a crate::feed::FeedScope,
        after: crate::feed::Position,
        limit: usize,
        timeout: std::time::Duration,
    ) -> BoxFut<'a, crate::feed::ChangePage>;
    fn feed_head<'a>(
        &'a self,
        scope: &'a crate::feed::FeedScope,
    ) -> BoxFut<'a, crate::feed::Position>;
    fn prune_changes<'a>(
        &'a self,
        scope: &'a crate::feed::FeedScope,
        through: crate::feed::Position,
    ) -> BoxFut<'a, u64>;
    fn read_tray<'a>(&'a self, key: &'a TrayKey, epoch: u64) -> BoxFut<'a, Option<Tray>>;
    fn write_tray<'a>(&'a self, key: &'a TrayKey, epoch: u64, tray: Tray) -> BoxFut<'a, ()>;
    fn delete_tray<'a>(&'a self, key: &'a TrayKey, epoch: u64) -> BoxFut<'a, bool>;
    fn apply_batch<'a>(
        &'a self,
        instance: &'a InstanceKey,
        epoch: u64,
        ops: Vec<TrayOp>,
    ) -> BoxFut<'a, ()>;
    fn apply_batch_idempotent<'a>(
        &'a self,
        instance: &'a InstanceKey,
        epoch: u64,
        ops: Vec<TrayOp>,
        key: &'a IdempotencyKey,
    ) -> BoxFut<'a, ()>;
    fn release<'a>(&'a self, instance: &'a InstanceKey, epoch: u64) -> BoxFut<'a, ()>;
    fn list_trays<'a>(
        &'a self,
        instance: &'a InstanceKey,
        epoch: u64,
        page: &'a PageRequest,
    ) -> BoxFut<'a, Page<(TrayKey, Tray)>>;
    fn instance_trays<'a>(
        &'a self,
        instance: &'a InstanceKey,
        epoch: u64,
        filter: &'a TrayFilter,
    ) -> BoxFut<'a, Vec<(TrayKey, Tray)>>;
    fn marked_trays<'a>(
        &'a self,
        env: Option<&'a str>,
        page: &'a PageRequest,
    ) -> BoxFut<'a, Page<MarkedTray>>;
    fn epoch<'a>(&'a self, instance: &'a InstanceKey) -> BoxFut<'a, u64>;
    fn set_alarm<'a>(
        &'a self,
        instance: &'a InstanceKey,
        epoch: u64,
        due_at: Millis,
    ) -> BoxFut<'a, ()>;
    fn due_alarms<'a>(&'a self, now: Millis, page: &'a PageRequest) -> BoxFut<'a, Page<Alarm>>;
    fn ack_alarm<'a>(
        &'a self,
        instance: &'a InstanceKey,
        epoch: u64,
        due_at: Millis,
    ) -> BoxFut<'a, bool>;
    fn put_budget<'a>(&'a self, record: BudgetRecord) -> BoxFut<'a, BudgetRecord>;
    fn get_budget<'a>(&'a self, key: &'a BudgetKey) -> BoxFut<'a, Option<BudgetStatus>>;
    fn list_budgets<'a>(
        &'a self,
        tenant: &'a str,
        page: &'a PageRequest,
    ) -> BoxFut<'a, Page<BudgetStatus>>;
    fn reserve<'a>(&'a self, run: &'a RunKey, hold: Hold) -> BoxFut<'a, HoldRecord>;
    fn settle<'a>(
        &'a self,
        run: &'a RunKey,
        hold_id: &'a str,
        spent: StateDelta,
    ) -> BoxFut<'a, Settled>;
    fn release_hold<'a>(&'a self, run: &'a RunKey, hold_id: &'a str) -> BoxFut<'a, ()>;
    fn reserve_idempotent<'a>(
        &'a self,
        run: &'a RunKey,
        hold: Hold,
        key: &'a IdempotencyKey,
    ) -> BoxFut<'a, HoldRecord>;
    fn settle_idempotent<'a>(
        &'a self,
        run: &'a RunKey,
        hold_id: &'a str,
        spent: StateDelta,
        key: &'a IdempotencyKey,
    ) -> BoxFut<'a, Settled>;
    fn release_hold_idempotent<'a>(
        &'a self,
        run: &'a RunKey,
        hold_id: &'a str,
        key: &'a IdempotencyKey,
    ) -> BoxFut<'a, ()>;
    fn run_spend<'a>(&'a self, run: &'a RunKey) -> BoxFut<'a, Option<RunSpend>>;
}

impl<T: AsyncCore> DynCore for T {
    fn put_run<'a>(&'a self, record: RunRecord) -> BoxFut<'a, RunRecord> {
        Box::pin(AsyncCore::put_run(self, record))
    }
    fn get_run<'a>(&'a self, key: &'a RunKey) -> BoxFut<'a, Option<RunRecord>> {
        Box::pin(AsyncCore::get_run(self, key))
    }
    fn patch_run<'a>(&'a self, key: &'a RunKey, delta: StateDelta) -> BoxFut<'a, RunRecord> {
        Box::pin(AsyncCore::patch_run(self, key, delta))
    }
    fn put_run_idempotent<'a>(
        &'a self,
        record: RunRecord,
        key: &'a IdempotencyKey,
    ) -> BoxFut<'a, RunRecord> {
        Box::pin(AsyncCore::put_run_idempotent(self, record, key))
    }
    fn patch_run_idempotent<'a>(
        &'a self,
        key: &'a RunKey,
        delta: StateDelta,
        idempotency_key: &'a IdempotencyKey,
    ) -> BoxFut<'a, RunRecord> {
        Box::pin(AsyncCore::patch_run_idempotent(
            self,
            key,
            delta,
            idempotency_key,
        ))
    }
    fn delete_run<'a>(
        &'a self,
        key: &'a RunKey,
        expected_version: Option<u64>,
    ) -> BoxFut<'a, RunRecord> {
        Box::pin(AsyncCore::delete_run(self, key, expected_version))
    }
    fn list_runs<'a>(
        &'a self,
        query: &'a StateQuery,
        page: &'a PageRequest,
    ) -> BoxFut<'a, Page<RunRecord>> {
        Box::pin(AsyncCore::list_runs(self, query, page))
    }
    fn put_session<'a>(&'a self, record: SessionRecord) -> BoxFut<'a, SessionRecord> {
        Box::pin(AsyncCore::put_session(self, record))
    }
    fn get_session<'a>(&'a self, key: &'a SessionKey) -> BoxFut<'a, Option<SessionRecord>> {
        Box::pin(AsyncCore::get_session(self, key))
    }
    fn delete_session<'a>(&'a self, key: &'a SessionKey, cascade: bool) -> BoxFut<'a, Vec<RunKey>> {
        Box::pin(AsyncCore::delete_session(self, key, cascade))
    }
    fn list_sessions<'a>(
        &'a self,
        tenant: &'a str,
        page: &'a PageRequest,
    ) -> BoxFut<'a, Page<SessionRecord>> {
        Box::pin(AsyncCore::list_sessions(self, tenant, page))
    }
    fn changes<'a>(
        &'a self,
        scope: &'a crate::feed::FeedScope,
        after: crate::feed::Position,
        limit: usize,
    ) -> BoxFut<'a, crate::feed::ChangePage> {
        Box::pin(AsyncCore::changes(self, scope, after, limit))
    }
    fn wait_changes<'a>(
        &'a self,
        scope: &'a crate::feed::FeedScope,
        after: crate::feed::Position,
        limit: usize,
        timeout: std::time::Duration,
    ) -> BoxFut<'a, crate::feed::ChangePage> {
        Box::pin(AsyncCore::wait_changes(self, scope, after, limit, timeout))
    }
    fn feed_head<'a>(
        &'a self,
        scope: &'a crate::feed::FeedScope,
    ) -> BoxFut<'a, crate::feed::Position> {
        Box::pin(AsyncCore::feed_head(self, scope))
    }
    fn prune_changes<'a>(
        &'a self,
        scope: &'a crate::feed::FeedScope,
        through: crate::feed::Position,
    ) -> BoxFut<'a, u64> {
        Box::pin(AsyncCore::prune_changes(self, scope, through))
    }
    fn read_tray<'a>(&'a self, key: &'a TrayKey, epoch: u64) -> BoxFut<'a, Option<Tray>> {
        Box::pin(AsyncCore::read_tray(self, key, epoch))
    }
    fn write_tray<'a>(&'a self, key: &'a TrayKey, epoch: u64, tray: Tray) -> BoxFut<'a, ()> {
        Box::pin(AsyncCore::write_tray(self, key, epoch, tray))
    }
    fn delete_tray<'a>(&'a self, key: &'a TrayKey, epoch: u64) -> BoxFut<'a, bool> {
        Box::pin(AsyncCore::delete_tray(self, key, epoch))
    }
    fn apply_batch<'a>(
        &'a self,
        instance: &'a InstanceKey,
        epoch: u64,
        ops: Vec<TrayOp>,
    ) -> BoxFut<'a, ()> {
        Box::pin(AsyncCore::apply_batch(self, instance, epoch, ops))
    }
    fn apply_batch_idempotent<'a>(
        &'a self,
        instance: &'a InstanceKey,
        epoch: u64,
        ops: Vec<TrayOp>,
        key: &'a IdempotencyKey,
    ) -> BoxFut<'a, ()> {
        Box::pin(AsyncCore::apply_batch_idempotent(
            self, instance, epoch, ops, key,
        ))
    }
    fn release<'a>(&'a self, instance: &'a InstanceKey, epoch: u64) -> BoxFut<'a, ()> {
        Box::pin(AsyncCore::release(self, instance, epoch))
    }
    fn list_trays<'a>(
        &'a self,
        instance: &'a InstanceKey,
        epoch: u64,
        page: &'a PageRequest,
    ) -> BoxFut<'a, Page<(TrayKey, Tray)>> {
        Box::pin(AsyncCore::list_trays(self, instance, epoch, page))
    }
    fn instance_trays<'a>(
        &'a self,
        instance: &'a InstanceKey,
        epoch: u64,
        filter: &'a TrayFilter,
    ) -> BoxFut<'a, Vec<(TrayKey, Tray)>> {
        Box::pin(AsyncCore::instance_trays(self, instance, epoch, filter))
    }
    fn marked_trays<'a>(
        &'a self,
        env: Option<&'a str>,
        page: &'a PageRequest,
    ) -> BoxFut<'a, Page<MarkedTray>> {
        Box::pin(AsyncCore::marked_trays(self, env, page))
    }
    fn epoch<'a>(&'a self, instance: &'a InstanceKey) -> BoxFut<'a, u64> {
        Box::pin(AsyncCore::epoch(self, instance))
    }
    fn set_alarm<'a>(
        &'a self,
        instance: &'a InstanceKey,
        epoch: u64,
        due_at: Millis,
    ) -> BoxFut<'a, ()> {
        Box::pin(AsyncCore::set_alarm(self, instance, epoch, due_at))
    }
    fn due_alarms<'a>(&'a self, now: Millis, page: &'a PageRequest) -> BoxFut<'a, Page<Alarm>> {
        Box::pin(AsyncCore::due_alarms(self, now, page))
    }
    fn ack_alarm<'a>(
        &'a self,
        instance: &'a InstanceKey,
        epoch: u64,
        due_at: Millis,
    ) -> BoxFut<'a, bool> {
        Box::pin(AsyncCore::ack_alarm(self, instance, epoch, due_at))
    }
    fn put_budget<'a>(&'a self, record: BudgetRecord) -> BoxFut<'a, BudgetRecord> {
        Box::pin(AsyncCore::put_budget(self, record))
    }
    fn get_budget<'a>(&'a self, key: &'a BudgetKey) -> BoxFut<'a, Option<BudgetStatus>> {
        Box::pin(AsyncCore::get_budget(self, key))
    }
    fn list_budgets<'a>(
        &'a self,
        tenant: &'a str,
        page: &'a PageRequest,
    ) -> BoxFut<'a, Page<BudgetStatus>> {
        Box::pin(AsyncCore::list_budgets(self, tenant, page))
    }
    fn reserve<'a>(&'a self, run: &'a RunKey, hold: Hold) -> BoxFut<'a, HoldRecord> {
        Box::pin(AsyncCore::reserve(self, run, hold))
    }
    fn settle<'a>(
        &'a self,
        run: &'a RunKey,
        hold_id: &'a str,
        spent: StateDelta,
    ) -> BoxFut<'a, Settled> {
        Box::pin(AsyncCore::settle(self, run, hold_id, spent))
    }
    fn release_hold<'a>(&'a self, run: &'a RunKey, hold_id: &'a str) -> BoxFut<'a, ()> {
        Box::pin(AsyncCore::release_hold(self, run, hold_id))
    }
    fn reserve_idempotent<'a>(
        &'a self,
        run: &'a RunKey,
        hold: Hold,
        key: &'a IdempotencyKey,
    ) -> BoxFut<'a, HoldRecord> {
        Box::pin(AsyncCore::reserve_idempotent(self, run, hold, key))
    }
    fn settle_idempotent<'a>(
        &'a self,
        run: &'a RunKey,
        hold_id: &'a str,
        spent: StateDelta,
        key: &'a IdempotencyKey,
    ) -> BoxFut<'a, Settled> {
        Box::pin(AsyncCore::settle_idempotent(self, run, hold_id, spent, key))
    }
    fn release_hold_idempotent<'a>(
        &'a self,
        run: &'a RunKey,
        hold_id: &'a str,
        key: &'a IdempotencyKey,
    ) -> BoxFut<'a, ()> {
        Box::pin(AsyncCore::release_hold_idempotent(self, run, hold_id, key))
    }
    fn run_spend<'a>(&'a self, run: &'a RunKey) -> BoxFut<'a, Option<RunSpend>> {
        Box::pin(AsyncCore::run_spend(self, run))
    }
}

/// The synchronous [`StateStore`](crate::StateStore),
/// [`TrayStore`](crate::TrayStore) and [`BudgetStore`](crate::BudgetStore)
/// of a type with an [`AsyncCore`]: each call is the async one, driven by
/// [`Bridge::block_on`]. (`StoreAdmin` stays the backend's own.)
#[doc(hidden)]
#[macro_export]
macro_rules! sync_over_async {
    ($t:ty) => {
        impl $crate::FeedStore for $t {
            fn changes(
                &self,
                scope: &$crate::FeedScope,
                after: $crate::Position,
                limit: usize,
            ) -> $crate::Result<$crate::ChangePage> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::changes(self, scope, after, limit))
            }
            fn wait_changes(
                &self,
                scope: &$crate::FeedScope,
                after: $crate::Position,
                limit: usize,
                timeout: std::time::Duration,
            ) -> $crate::Result<$crate::ChangePage> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::wait_changes(self, scope, after, limit, timeout))
            }
            fn feed_head(&self, scope: &$crate::FeedScope) -> $crate::Result<$crate::Position> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::feed_head(self, scope))
            }
            fn prune_changes(
                &self,
                scope: &$crate::FeedScope,
                through: $crate::Position,
            ) -> $crate::Result<u64> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::prune_changes(self, scope, through))
            }
        }
        impl $crate::api::StateStore for $t {
            fn put_run(&self, record: $crate::RunRecord) -> $crate::Result<$crate::RunRecord> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::put_run(self, record))
            }
            fn get_run(&self, key: &$crate::RunKey) -> $crate::Result<Option<$crate::RunRecord>> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::get_run(self, key))
            }
            fn patch_run(
                &self,
                key: &$crate::RunKey,
                delta: $crate::StateDelta,
            ) -> $crate::Result<$crate::RunRecord> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::patch_run(self, key, delta))
            }
            fn put_run_idempotent(
                &self,
                record: $crate::RunRecord,
                key: &$crate::IdempotencyKey,
            ) -> $crate::Result<$crate::RunRecord> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::put_run_idempotent(self, record, key))
            }
            fn patch_run_idempotent(
                &self,
                key: &$crate::RunKey,
                delta: $crate::StateDelta,
                idempotency_key: &$crate::IdempotencyKey,
            ) -> $crate::Result<$crate::RunRecord> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::patch_run_idempotent(self, key, delta, idempotency_key))
            }
            fn delete_run(
                &self,
                key: &$crate::RunKey,
                expected_version: Option<u64>,
            ) -> $crate::Result<$crate::RunRecord> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::delete_run(self, key, expected_version))
            }
            fn list_runs(
                &self,
                query: &$crate::StateQuery,
                page: &$crate::PageRequest,
            ) -> $crate::Result<$crate::Page<$crate::RunRecord>> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::list_runs(self, query, page))
            }
            fn put_session(
                &self,
                record: $crate::SessionRecord,
            ) -> $crate::Result<$crate::SessionRecord> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::put_session(self, record))
            }
            fn get_session(
                &self,
                key: &$crate::SessionKey,
            ) -> $crate::Result<Option<$crate::SessionRecord>> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::get_session(self, key))
            }
            fn delete_session(
                &self,
                key: &$crate::SessionKey,
                cascade: bool,
            ) -> $crate::Result<Vec<$crate::RunKey>> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::delete_session(self, key, cascade))
            }
        }

        impl $crate::api::TrayStore for $t {
            fn read_tray(
                &self,
                key: &$crate::TrayKey,
                epoch: u64,
            ) -> $crate::Result<Option<$crate::Tray>> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::read_tray(self, key, epoch))
            }
            fn write_tray(
                &self,
                key: &$crate::TrayKey,
                epoch: u64,
                tray: $crate::Tray,
            ) -> $crate::Result<()> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::write_tray(self, key, epoch, tray))
            }
            fn delete_tray(&self, key: &$crate::TrayKey, epoch: u64) -> $crate::Result<bool> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::delete_tray(self, key, epoch))
            }
            fn apply_batch(
                &self,
                instance: &$crate::InstanceKey,
                epoch: u64,
                ops: Vec<$crate::TrayOp>,
            ) -> $crate::Result<()> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::apply_batch(self, instance, epoch, ops))
            }
            fn apply_batch_idempotent(
                &self,
                instance: &$crate::InstanceKey,
                epoch: u64,
                ops: Vec<$crate::TrayOp>,
                key: &$crate::IdempotencyKey,
            ) -> $crate::Result<()> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::apply_batch_idempotent(self, instance, epoch, ops, key))
            }
            fn release(&self, instance: &$crate::InstanceKey, epoch: u64) -> $crate::Result<()> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::release(self, instance, epoch))
            }
            fn list_trays(
                &self,
                instance: &$crate::InstanceKey,
                epoch: u64,
                page: &$crate::PageRequest,
            ) -> $crate::Result<$crate::Page<($crate::TrayKey, $crate::Tray)>> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::list_trays(self, instance, epoch, page))
            }
            fn instance_trays(
                &self,
                instance: &$crate::InstanceKey,
                epoch: u64,
                filter: &$crate::TrayFilter,
            ) -> $crate::Result<Vec<($crate::TrayKey, $crate::Tray)>> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::instance_trays(self, instance, epoch, filter))
            }
            fn marked_trays(
                &self,
                env: Option<&str>,
                page: &$crate::PageRequest,
            ) -> $crate::Result<$crate::Page<$crate::MarkedTray>> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::marked_trays(self, env, page))
            }
            fn epoch(&self, instance: &$crate::InstanceKey) -> $crate::Result<u64> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::epoch(self, instance))
            }
            fn set_alarm(
                &self,
                instance: &$crate::InstanceKey,
                epoch: u64,
                due_at: $crate::Millis,
            ) -> $crate::Result<()> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::set_alarm(self, instance, epoch, due_at))
            }
            fn due_alarms(
                &self,
                now: $crate::Millis,
                page: &$crate::PageRequest,
            ) -> $crate::Result<$crate::Page<$crate::Alarm>> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::due_alarms(self, now, page))
            }
            fn ack_alarm(
                &self,
                instance: &$crate::InstanceKey,
                epoch: u64,
                due_at: $crate::Millis,
            ) -> $crate::Result<bool> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::ack_alarm(self, instance, epoch, due_at))
            }
        }

        impl $crate::budget::BudgetStore for $t {
            fn put_budget(
                &self,
                record: $crate::BudgetRecord,
            ) -> $crate::Result<$crate::BudgetRecord> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::put_budget(self, record))
            }
            fn get_budget(
                &self,
                key: &$crate::BudgetKey,
            ) -> $crate::Result<Option<$crate::BudgetStatus>> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::get_budget(self, key))
            }
            fn list_budgets(
                &self,
                tenant: &str,
                page: &$crate::PageRequest,
            ) -> $crate::Result<$crate::Page<$crate::BudgetStatus>> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::list_budgets(self, tenant, page))
            }
            fn reserve(
                &self,
                run: &$crate::RunKey,
                hold: $crate::Hold,
            ) -> $crate::Result<$crate::HoldRecord> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::reserve(self, run, hold))
            }
            fn settle(
                &self,
                run: &$crate::RunKey,
                hold_id: &str,
                spent: $crate::StateDelta,
            ) -> $crate::Result<$crate::Settled> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::settle(self, run, hold_id, spent))
            }
            fn release_hold(&self, run: &$crate::RunKey, hold_id: &str) -> $crate::Result<()> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::release_hold(self, run, hold_id))
            }
            fn reserve_idempotent(
                &self,
                run: &$crate::RunKey,
                hold: $crate::Hold,
                key: &$crate::IdempotencyKey,
            ) -> $crate::Result<$crate::HoldRecord> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::reserve_idempotent(self, run, hold, key))
            }
            fn settle_idempotent(
                &self,
                run: &$crate::RunKey,
                hold_id: &str,
                spent: $crate::StateDelta,
                key: &$crate::IdempotencyKey,
            ) -> $crate::Result<$crate::Settled> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::settle_idempotent(self, run, hold_id, spent, key))
            }
            fn release_hold_idempotent(
                &self,
                run: &$crate::RunKey,
                hold_id: &str,
                key: &$crate::IdempotencyKey,
            ) -> $crate::Result<()> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::release_hold_idempotent(self, run, hold_id, key))
            }
            fn run_spend(&self, run: &$crate::RunKey) -> $crate::Result<Option<$crate::RunSpend>> {
                use $crate::native::AsyncCore as C;
                C::bridge(self).block_on(C::run_spend(self, run))
            }
        }
    };
}
pub use crate::sync_over_async;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_on_runs_inside_and_outside_a_runtime() {
        let bridge = Bridge::new("agentstate-test").unwrap();
        // Outside: a timer of the store's runtime fires.
        let slept = bridge.block_on(async {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            7
        });
        assert_eq!(slept, 7);
        // Inside a current-thread runtime (whose only thread this is):
        // no panic, and the store's runtime does the I/O.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let v = rt.block_on(async {
            bridge.block_on(bridge.on_runtime(async {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                9
            }))
        });
        assert_eq!(v, 9);
        // Many tokio operations inside a task (past its coop budget of
        // 128): no spin, no hang.
        let n = rt.block_on(async {
            bridge.block_on(async {
                let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
                let mut n = 0u32;
                for i in 0..1000u32 {
                    tx.send(i).unwrap();
                    n += rx.recv().await.unwrap();
                    tokio::time::sleep(std::time::Duration::ZERO).await;
                }
                n
            })
        });
        assert_eq!(n, 499_500);
        // Dropped inside a runtime: no panic.
        rt.block_on(async move { drop(bridge) });
    }
}
