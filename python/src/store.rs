//! The stores: one base class (`StateStore`) whose methods return asyncio
//! awaitables, a subclass per backend, and the blocking facade
//! (`store.sync()`).

use std::time::Duration;

use agentstate as a;
use agentstate::AsyncStore;
use parking_lot::Mutex;
use pyo3::prelude::*;

use crate::clock::clock_of;
use crate::errors;
use crate::feed::{
    ChangePageOut, ChangeStream, FeedScope, Pos, SyncChangeStream, pos_or_start, wait_of,
};
use crate::rt;
use crate::types::*;

/// Any store of the package. Every method returns an awaitable; the
/// store's call runs on the package's tokio runtime, never holding the
/// GIL. `store.sync()` is the same store with blocking methods.
#[pyclass(subclass, frozen, module = "agentstate_rs")]
pub struct StateStore {
    inner: Mutex<Option<AsyncStore>>,
    /// The process that opened it: a forked child refuses to use it.
    pid: u32,
    /// What `repr()` shows: the backend, and where, never a password.
    label: String,
    /// PostgreSQL: the DSN and options `setup()` connects with.
    pg: Option<(String, a::PgOptions)>,
    /// The wait of each read of `watch`: short on the embedded stores,
    /// whose waits run on a blocking thread that a cancelled watch leaves
    /// waiting until the wait ends.
    watch_wait: Duration,
    /// A memory or file store: a call that can complete at once (every
    /// call but the feed's waits) runs in place and returns a finished
    /// awaitable ([`rt::Ready`]).
    pub(crate) in_place: bool,
    /// The env and hostname the seeds' tray calls (`set_tray`,
    /// `apply_batch` with tuples) stamp on the rows they write.
    pub(crate) env: String,
    pub(crate) hostname: String,
}

impl StateStore {
    fn new(
        store: AsyncStore,
        label: String,
        pg: Option<(String, a::PgOptions)>,
        in_place: bool,
        stamp: Stamp,
    ) -> Self {
        let watch_wait = if in_place { EMBEDDED_WAIT } else { SERVER_WAIT };
        StateStore {
            inner: Mutex::new(Some(store)),
            pid: std::process::id(),
            label,
            pg,
            in_place,
            watch_wait,
            env: stamp.env,
            hostname: stamp.hostname,
        }
    }

    pub(crate) fn handle(&self, py: Python<'_>) -> PyResult<AsyncStore> {
        if std::process::id() != self.pid {
            return Err(errors::forked(py, &self.label));
        }
        match &*self.inner.lock() {
            Some(s) => Ok(s.clone()),
            None => Err(errors::raise(
                py,
                "StateClosedError",
                &format!("{} is closed", self.label),
                &pyo3::types::PyDict::new(py),
            )),
        }
    }

    fn pg_setup(&self) -> Option<(String, a::PgOptions)> {
        self.pg.clone()
    }
}

impl Drop for StateStore {
    fn drop(&mut self) {
        let Some(store) = self.inner.get_mut().take() else {
            return;
        };
        if std::process::id() != self.pid {
            // The parent's store in a forked child: its threads are gone,
            // and closing it would write to the parent's files. Leaked.
            std::mem::forget(store);
            return;
        }
        // Closing may sync a file or shut a client down: not under the GIL.
        Python::attach(|py| py.detach(move || drop(store)));
    }
}

/// The env and hostname a store's seeds-shaped tray writes carry
/// (`env="*"`, `hostname="*"` by default, as pinned's PostgreSQL store).
pub(crate) struct Stamp {
    env: String,
    hostname: String,
}

impl Stamp {
    fn new(py: Python<'_>, env: String, hostname: String) -> PyResult<Self> {
        for (what, v) in [("env", &env), ("hostname", &hostname)] {
            if v.is_empty() || v.len() > a::limits::ID_BYTES_MAX {
                return Err(errors::invalid(
                    py,
                    format!(
                        "{what}: 1 to {} bytes of UTF-8, got {} bytes",
                        a::limits::ID_BYTES_MAX,
                        v.len()
                    ),
                ));
            }
        }
        Ok(Stamp { env, hostname })
    }
}

/// The wait of each read of `watch` on a memory or file store.
const EMBEDDED_WAIT: Duration = Duration::from_secs(5);
/// The wait of each read of `watch` on PostgreSQL or Redis (as the
/// crate's `AsyncStore::watch`).
const SERVER_WAIT: Duration = Duration::from_secs(60);

fn options(
    clock: Option<&Bound<'_, PyAny>>,
    record_bytes_max: Option<usize>,
) -> PyResult<a::Options> {
    let mut opts = a::Options::new();
    if let Some(c) = clock_of(clock)? {
        opts = opts.clock(c);
    }
    if let Some(n) = record_bytes_max {
        opts = opts.record_bytes_max(n);
    }
    Ok(opts)
}

/// Runs, sessions, trays and spend caps in this process's memory: gone
/// when it exits. For tests and for exercising the rules without a server.
#[pyclass(extends = StateStore, frozen, module = "agentstate_rs")]
pub struct MemoryStateStore;

#[pymethods]
impl MemoryStateStore {
    #[new]
    #[pyo3(signature = (*, clock=None, record_bytes_max=None, env="*".to_string(), hostname="*".to_string()))]
    fn new(
        py: Python<'_>,
        clock: Option<&Bound<'_, PyAny>>,
        record_bytes_max: Option<usize>,
        env: String,
        hostname: String,
    ) -> PyResult<PyClassInitializer<Self>> {
        let stamp = Stamp::new(py, env, hostname)?;
        let store = AsyncStore::new(a::MemoryStore::with_options(options(
            clock,
            record_bytes_max,
        )?));
        Ok(PyClassInitializer::from(StateStore::new(
            store,
            "MemoryStateStore()".into(),
            None,
            true,
            stamp,
        ))
        .add_subclass(MemoryStateStore))
    }
}

/// The embedded file store: one directory, one process at a time; a
/// returned call was synced to disk.
#[pyclass(extends = StateStore, frozen, module = "agentstate_rs")]
pub struct FileStateStore;

#[pymethods]
impl FileStateStore {
    #[new]
    #[pyo3(signature = (path, *, clock=None, record_bytes_max=None, env="*".to_string(), hostname="*".to_string()))]
    fn new(
        py: Python<'_>,
        path: std::path::PathBuf,
        clock: Option<&Bound<'_, PyAny>>,
        record_bytes_max: Option<usize>,
        env: String,
        hostname: String,
    ) -> PyResult<PyClassInitializer<Self>> {
        let stamp = Stamp::new(py, env, hostname)?;
        let opts = options(clock, record_bytes_max)?;
        let label = format!("FileStateStore({:?})", path.display().to_string());
        let store = py
            .detach(|| a::FileStore::open_with(&path, opts))
            .map_err(errors::to_py)?;
        Ok(PyClassInitializer::from(StateStore::new(
            AsyncStore::from(store),
            label,
            None,
            true,
            stamp,
        ))
        .add_subclass(FileStateStore))
    }
}

/// The PostgreSQL store, shared by every worker of a fleet. Opens no
/// connection until a call needs one (`pool_size` connections at most,
/// dialed lazily); `await store.setup()` once at boot creates the tables.
#[pyclass(extends = StateStore, frozen, module = "agentstate_rs")]
pub struct PostgresStateStore;

#[pymethods]
impl PostgresStateStore {
    #[new]
    #[pyo3(signature = (dsn, *, pool_size=8, schema="public".to_string(), clock=None, record_bytes_max=None, connect_timeout=None, statement_timeout=None, env="*".to_string(), hostname="*".to_string(), lazy=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        dsn: String,
        pool_size: u32,
        schema: String,
        clock: Option<&Bound<'_, PyAny>>,
        record_bytes_max: Option<usize>,
        connect_timeout: Option<f64>,
        statement_timeout: Option<f64>,
        env: String,
        hostname: String,
        lazy: bool,
    ) -> PyResult<PyClassInitializer<Self>> {
        let stamp = Stamp::new(py, env, hostname)?;
        let mut pg = a::PgOptions::new()
            .options(options(clock, record_bytes_max)?)
            .pool_size(pool_size)
            .schema(schema.clone())
            .lazy(lazy);
        if let Some(t) = connect_timeout {
            pg = pg.connect_timeout(seconds(py, t, "connect_timeout")?);
        }
        if let Some(t) = statement_timeout {
            pg = pg.statement_timeout(seconds(py, t, "statement_timeout")?);
        }
        let label = format!(
            "PostgresStateStore(dsn={:?}, pool_size={pool_size}, schema={schema:?})",
            a::redact_connection_string(&dsn)
        );
        let opts = pg.clone();
        let store = py
            .detach(|| {
                let _in = rt::runtime().enter();
                a::PostgresStore::connect_with(&dsn, opts).map(AsyncStore::new)
            })
            .map_err(errors::to_py)?;
        let setup = pg.pool_size(1);
        Ok(PyClassInitializer::from(StateStore::new(
            store,
            label,
            Some((dsn, setup)),
            false,
            stamp,
        ))
        .add_subclass(PostgresStateStore))
    }
}

fn seconds(py: Python<'_>, t: f64, what: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(t)
        .map_err(|_| errors::invalid(py, format!("{what}: seconds, a non-negative number")))
}

/// The Redis store: every write one Lua script on the server. `connect`
/// checks the server keeps what it acknowledged (`noeviction`, and with
/// `require_fsync` `appendfsync always`). `url` may be
/// `redis+sentinel://…` (a master found through Sentinel); with
/// `wait_replicas` every write waits for that many replicas (`WAIT`, up
/// to `wait_timeout` seconds).
#[pyclass(extends = StateStore, frozen, module = "agentstate_rs")]
pub struct RedisStateStore;

#[pymethods]
impl RedisStateStore {
    #[new]
    #[pyo3(signature = (url, *, pool_size=16, clock=None, record_bytes_max=None, require_fsync=true, connect_timeout=None, env="*".to_string(), hostname="*".to_string(), wait_replicas=0, wait_timeout=1.0, lazy=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        url: String,
        pool_size: u32,
        clock: Option<&Bound<'_, PyAny>>,
        record_bytes_max: Option<usize>,
        require_fsync: bool,
        connect_timeout: Option<f64>,
        env: String,
        hostname: String,
        wait_replicas: u32,
        wait_timeout: f64,
        lazy: bool,
    ) -> PyResult<PyClassInitializer<Self>> {
        let stamp = Stamp::new(py, env, hostname)?;
        let mut opts = a::RedisOptions::new()
            .options(options(clock, record_bytes_max)?)
            .pool_size(pool_size)
            .require_fsync(require_fsync)
            .lazy(lazy);
        if let Some(t) = connect_timeout {
            opts = opts.connect_timeout(seconds(py, t, "connect_timeout")?);
        }
        if wait_replicas > 0 {
            opts = opts.wait_replicas(wait_replicas, seconds(py, wait_timeout, "wait_timeout")?);
        }
        let label = format!(
            "RedisStateStore(url={:?}, pool_size={pool_size})",
            a::redact_connection_string(&url)
        );
        let store = py
            .detach(|| {
                let _in = rt::runtime().enter();
                a::RedisStore::connect_with(&url, opts).map(AsyncStore::new)
            })
            .map_err(errors::to_py)?;
        Ok(
            PyClassInitializer::from(StateStore::new(store, label, None, false, stamp))
                .add_subclass(RedisStateStore),
        )
    }
}

/// The blocking facade of a store (`store.sync()`): the same methods,
/// each returning its answer; the GIL is released while the call runs.
#[pyclass(frozen, module = "agentstate_rs")]
pub struct SyncStateStore(pub(crate) Py<StateStore>);

/// `agentstate_rs._defer.defer(store, name, kwargs)`: a coroutine that
/// calls `store.name(**kwargs)` when it is awaited.
fn defer<'py>(
    store: &Bound<'py, StateStore>,
    name: &str,
    kw: Bound<'py, pyo3::types::PyDict>,
) -> PyResult<Bound<'py, PyAny>> {
    store
        .py()
        .import("agentstate_rs._defer")?
        .getattr("defer")?
        .call1((store, name, kw))
}

fn key_of(k: String) -> a::Result<a::IdempotencyKey> {
    a::IdempotencyKey::new(k)
}

macro_rules! store_api {
    ($(
        $(#[doc = $doc:literal])*
        #[pyo3(signature = $sig:tt)]
        fn $name:ident($s:ident $(, $arg:ident : $ty:ty)*) -> $ret:ty $body:block
    )*) => {
        #[pymethods]
        impl StateStore {
            $(
                $(#[doc = $doc])*
                #[pyo3(signature = $sig)]
                fn $name<'py>(slf: &Bound<'py, Self> $(, $arg: $ty)*) -> PyResult<Bound<'py, PyAny>> {
                    let py = slf.py();
                    // A memory or file store answers here, with no thread hop;
                    // but a wait for the feed cannot complete at once (it waits
                    // for another task's write), so it stays on the runtime.
                    if slf.get().in_place && stringify!($name) != "wait_changes" {
                        let $s = slf.get().handle(py)?.in_caller();
                        return rt::in_place(py, async move {
                            let r: a::Result<$ret> = async move $body.await;
                            r.map_err(errors::to_py)
                        });
                    }
                    if pyo3_async_runtimes::get_running_loop(py).is_err() {
                        // Called outside a running loop (`asyncio.run(store.get_run(k))`):
                        // a coroutine that makes the call once a loop awaits it.
                        let kw = pyo3::types::PyDict::new(py);
                        $( kw.set_item(stringify!($arg), $arg)?; )*
                        return defer(slf, stringify!($name), kw);
                    }
                    let $s = slf.get().handle(py)?;
                    rt::future_into_py(py, async move {
                        let r: a::Result<$ret> = async move $body.await;
                        r.map_err(errors::to_py)
                    })
                }
            )*
        }

        #[pymethods]
        impl SyncStateStore {
            $(
                $(#[doc = $doc])*
                #[pyo3(signature = $sig)]
                fn $name(&self, py: Python<'_> $(, $arg: $ty)*) -> PyResult<$ret> {
                    let me = self.0.get();
                    // A memory or file store answers on this thread.
                    let $s = if me.in_place { me.handle(py)?.in_caller() } else { me.handle(py)? };
                    let r: a::Result<$ret> = py.detach(move || rt::block_on(async move $body));
                    r.map_err(errors::to_py)
                }
            )*
        }
    };
}

store_api! {
    /// Creates (version 0) or updates (version n, committed at n + 1) a
    /// run; raises StateConflictError when the stored version moved.
    #[pyo3(signature = (record))]
    fn put_run(s, record: RunRecord) -> RunRecord {
        s.put_run(record.inner).await.map(Into::into)
    }
    /// The run, or None.
    #[pyo3(signature = (key))]
    fn get_run(s, key: RunKey) -> Option<RunRecord> {
        s.get_run(&key.into()).await.map(|r| r.map(Into::into))
    }
    /// Adds the delta's amounts to the run (no version needed: they commute).
    #[pyo3(signature = (key, delta))]
    fn patch_run(s, key: RunKey, delta: StateDelta) -> RunRecord {
        s.patch_run(&key.into(), delta.inner).await.map(Into::into)
    }
    /// put_run applied at most once under the idempotency key.
    #[pyo3(signature = (record, idempotency_key))]
    fn put_run_idempotent(s, record: RunRecord, idempotency_key: String) -> RunRecord {
        let k = key_of(idempotency_key)?;
        s.put_run_idempotent(record.inner, &k).await.map(Into::into)
    }
    /// patch_run applied at most once under the idempotency key.
    #[pyo3(signature = (key, delta, idempotency_key))]
    fn patch_run_idempotent(s, key: RunKey, delta: StateDelta, idempotency_key: String) -> RunRecord {
        let k = key_of(idempotency_key)?;
        s.patch_run_idempotent(&key.into(), delta.inner, &k).await.map(Into::into)
    }
    /// One page of a tenant's runs, in the store's insertion order.
    #[pyo3(signature = (query))]
    fn list_runs(s, query: StateQuery) -> PageOut<RunRecord> {
        s.list_runs(&query.inner, &query.page()).await.map(Into::into)
    }
    /// Creates or updates a session, versioned like a run.
    #[pyo3(signature = (record))]
    fn put_session(s, record: SessionRecord) -> SessionRecord {
        s.put_session(record.inner).await.map(Into::into)
    }
    /// The session, or None.
    #[pyo3(signature = (key))]
    fn get_session(s, key: SessionKey) -> Option<SessionRecord> {
        s.get_session(&key.into()).await.map(|r| r.map(Into::into))
    }
    /// Deletes a session; raises StateInUseError naming its unfinished
    /// runs unless cascade=True, which deletes its runs with it. Returns
    /// the runs deleted.
    #[pyo3(signature = (key, cascade=false))]
    fn delete_session(s, key: SessionKey, cascade: bool) -> Vec<RunKey> {
        s.delete_session(&key.into(), cascade)
            .await
            .map(|v| v.into_iter().map(Into::into).collect())
    }
    /// One page of a tenant's sessions.
    #[pyo3(signature = (tenant, *, limit=100, cursor=None))]
    fn list_sessions(s, tenant: String, limit: usize, cursor: Option<String>) -> PageOut<SessionRecord> {
        s.list_sessions(&tenant, &page_request(limit, cursor)).await.map(Into::into)
    }
    /// Reads one tray at the caller's epoch.
    #[pyo3(signature = (key, epoch))]
    fn read_tray(s, key: TrayKey, epoch: u64) -> Option<Tray> {
        s.read_tray(&key.into(), epoch).await.map(|t| t.map(Into::into))
    }
    /// Writes one tray at the caller's epoch (FenceLostError below the stored one).
    #[pyo3(signature = (key, epoch, tray))]
    fn write_tray(s, key: TrayKey, epoch: u64, tray: Tray) -> () {
        s.write_tray(&key.into(), epoch, tray.into()).await
    }
    // delete_tray and apply_batch take the seeds' shape too: pinned.rs.
    /// apply_batch applied at most once under the idempotency key.
    #[pyo3(signature = (instance, epoch, ops, idempotency_key))]
    fn apply_batch_idempotent(s, instance: InstanceKey, epoch: u64, ops: Vec<TrayOp>, idempotency_key: String) -> () {
        let k = key_of(idempotency_key)?;
        let ops = ops.into_iter().map(|o| o.inner).collect();
        s.apply_batch_idempotent(&instance.into(), epoch, ops, &k).await
    }
    /// Unmarks every tray of the instance; an older epoch is a no-op.
    #[pyo3(signature = (instance, epoch))]
    fn release(s, instance: InstanceKey, epoch: u64) -> () {
        s.release(&instance.into(), epoch).await
    }
    /// One page of an instance's trays, as (TrayKey, Tray) pairs.
    #[pyo3(signature = (instance, epoch, *, limit=100, cursor=None))]
    fn list_trays(s, instance: InstanceKey, epoch: u64, limit: usize, cursor: Option<String>) -> PageOut<TrayItem> {
        s.list_trays(&instance.into(), epoch, &page_request(limit, cursor)).await.map(Into::into)
    }
    /// The sweeper's listing: marked trays of every instance (of one env).
    #[pyo3(signature = (env=None, *, limit=100, cursor=None))]
    fn marked_trays(s, env: Option<String>, limit: usize, cursor: Option<String>) -> PageOut<MarkedTray> {
        s.marked_trays(env.as_deref(), &page_request(limit, cursor)).await.map(Into::into)
    }
    /// The instance's stored epoch (0 when none).
    #[pyo3(signature = (instance))]
    fn epoch(s, instance: InstanceKey) -> u64 {
        s.epoch(&instance.into()).await
    }
    /// Sets the instance's one alarm.
    #[pyo3(signature = (instance, epoch, due_at))]
    fn set_alarm(s, instance: InstanceKey, epoch: u64, due_at: u64) -> () {
        s.set_alarm(&instance.into(), epoch, due_at).await
    }
    /// Alarms due at `now`, in (due_at, ns, id) order.
    #[pyo3(signature = (now, *, limit=100, cursor=None))]
    fn due_alarms(s, now: u64, limit: usize, cursor: Option<String>) -> PageOut<Alarm> {
        s.due_alarms(now, &page_request(limit, cursor)).await.map(Into::into)
    }
    /// Removes the alarm if it is still the one due at `due_at`.
    #[pyo3(signature = (instance, epoch, due_at))]
    fn ack_alarm(s, instance: InstanceKey, epoch: u64, due_at: u64) -> bool {
        s.ack_alarm(&instance.into(), epoch, due_at).await
    }
    /// Creates or updates a named tenant budget (versioned).
    #[pyo3(signature = (record))]
    fn put_budget(s, record: BudgetRecord) -> BudgetRecord {
        s.put_budget(record.inner).await.map(Into::into)
    }
    /// The budget with its spend and holds, or None.
    #[pyo3(signature = (key))]
    fn get_budget(s, key: BudgetKey) -> Option<BudgetStatus> {
        s.get_budget(&key.into()).await.map(|b| b.map(Into::into))
    }
    /// One page of a tenant's budgets.
    #[pyo3(signature = (tenant, *, limit=100, cursor=None))]
    fn list_budgets(s, tenant: String, limit: usize, cursor: Option<String>) -> PageOut<BudgetStatus> {
        s.list_budgets(&tenant, &page_request(limit, cursor)).await.map(Into::into)
    }
    /// Holds what a call may cost at most; BudgetExceededError past a cap.
    #[pyo3(signature = (run, hold))]
    fn reserve(s, run: RunKey, hold: Hold) -> HoldRecord {
        s.reserve(&run.into(), hold.into()).await.map(Into::into)
    }
    /// Drops the hold and adds what was spent, in one step.
    #[pyo3(signature = (run, hold_id, spent))]
    fn settle(s, run: RunKey, hold_id: String, spent: StateDelta) -> Settled {
        s.settle(&run.into(), &hold_id, spent.inner).await.map(Into::into)
    }
    /// Drops a hold with no spend.
    #[pyo3(signature = (run, hold_id))]
    fn release_hold(s, run: RunKey, hold_id: String) -> () {
        s.release_hold(&run.into(), &hold_id).await
    }
    /// reserve applied at most once under the idempotency key.
    #[pyo3(signature = (run, hold, idempotency_key))]
    fn reserve_idempotent(s, run: RunKey, hold: Hold, idempotency_key: String) -> HoldRecord {
        let k = key_of(idempotency_key)?;
        s.reserve_idempotent(&run.into(), hold.into(), &k).await.map(Into::into)
    }
    /// settle applied at most once under the idempotency key.
    #[pyo3(signature = (run, hold_id, spent, idempotency_key))]
    fn settle_idempotent(s, run: RunKey, hold_id: String, spent: StateDelta, idempotency_key: String) -> Settled {
        let k = key_of(idempotency_key)?;
        s.settle_idempotent(&run.into(), &hold_id, spent.inner, &k).await.map(Into::into)
    }
    /// release_hold applied at most once under the idempotency key.
    #[pyo3(signature = (run, hold_id, idempotency_key))]
    fn release_hold_idempotent(s, run: RunKey, hold_id: String, idempotency_key: String) -> () {
        let k = key_of(idempotency_key)?;
        s.release_hold_idempotent(&run.into(), &hold_id, &k).await
    }
    /// A run's caps, spend and live holds, or None.
    #[pyo3(signature = (run))]
    fn run_spend(s, run: RunKey) -> Option<RunSpend> {
        s.run_spend(&run.into()).await.map(|r| r.map(Into::into))
    }
    /// Up to `limit` changes of the scope after position `after` (None:
    /// the start), in position order, each record once in its current
    /// state (or its tombstone); the page's `next` is the next call's
    /// `after`. StateFeedPrunedError when `after` is before what
    /// prune_changes dropped.
    #[pyo3(signature = (scope, after=None, limit=100))]
    fn changes(s, scope: FeedScope, after: Option<Pos>, limit: usize) -> ChangePageOut {
        s.changes(&scope.inner, pos_or_start(after), limit).await.map(ChangePageOut)
    }
    /// Like changes, but when nothing is after `after` waits up to
    /// `timeout` seconds for a commit to the scope; at the timeout, an
    /// empty page whose `next` is `after`.
    #[pyo3(signature = (scope, after=None, limit=100, timeout=30.0))]
    fn wait_changes(s, scope: FeedScope, after: Option<Pos>, limit: usize, timeout: f64) -> ChangePageOut {
        let wait = wait_of(timeout)?;
        s.wait_changes(&scope.inner, pos_or_start(after), limit, wait).await.map(ChangePageOut)
    }
    /// The position to follow the scope from after listing its current
    /// state: every change committed after this call is after it.
    #[pyo3(signature = (scope))]
    fn feed_head(s, scope: FeedScope) -> u128 {
        s.feed_head(&scope.inner).await.map(|p| p.as_u128())
    }
    /// Drops the scope's tombstones at or before `through`; reading
    /// after an older position is then StateFeedPrunedError. Returns how
    /// many were dropped.
    #[pyo3(signature = (scope, through))]
    fn prune_changes(s, scope: FeedScope, through: Pos) -> u64 {
        s.prune_changes(&scope.inner, through.0).await
    }
}

#[pymethods]
impl StateStore {
    /// Every change of the scope after `after` (None: the start), without
    /// end, as an async iterator (`async for change in store.watch(...)`).
    #[pyo3(signature = (scope, after=None))]
    fn watch(
        slf: &Bound<'_, Self>,
        scope: FeedScope,
        after: Option<Pos>,
    ) -> PyResult<ChangeStream> {
        let me = slf.get();
        me.handle(slf.py())?;
        Ok(ChangeStream::new(
            slf.clone().unbind(),
            scope.inner,
            pos_or_start(after),
            me.watch_wait,
        ))
    }
}

#[pymethods]
impl SyncStateStore {
    /// Every change of the scope after `after` (None: the start), without
    /// end, as a blocking iterator.
    #[pyo3(signature = (scope, after=None))]
    fn watch(
        &self,
        py: Python<'_>,
        scope: FeedScope,
        after: Option<Pos>,
    ) -> PyResult<SyncChangeStream> {
        self.0.get().handle(py)?;
        Ok(SyncChangeStream::new(
            self.0.clone_ref(py),
            scope.inner,
            pos_or_start(after),
        ))
    }
}

#[pymethods]
impl StateStore {
    /// Creates the PostgreSQL tables once (idempotent, safe from many
    /// workers at once); a no-op on the other backends.
    fn setup<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        if slf.get().in_place {
            slf.get().handle(py)?;
            return rt::Ready::awaitable(py, Ok(py.None()));
        }
        if pyo3_async_runtimes::get_running_loop(py).is_err() {
            return defer(slf, "setup", pyo3::types::PyDict::new(py));
        }
        let me = slf.get();
        me.handle(py)?;
        let pg = me.pg_setup();
        rt::future_into_py(py, async move {
            if let Some((dsn, opts)) = pg {
                // The blocking client is made and closed on a thread
                // outside the runtime (closing it runs a runtime of its own).
                let r = rt::off_runtime(move || {
                    a::PostgresStore::connect_with(&dsn, opts).and_then(|s| s.setup())
                })
                .await
                .unwrap_or_else(|| {
                    Err(a::StateError::Invalid {
                        what: "setup: could not start its thread".into(),
                    })
                });
                r.map_err(errors::to_py)?;
            }
            Ok(())
        })
    }

    /// Closes the store (its files, its connections); later calls raise
    /// StateClosedError, but for close(), which does nothing again.
    fn close<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let me = slf.get();
        if me.pid == std::process::id() && me.inner.lock().is_none() {
            // Closing a closed store is a no-op.
            return rt::Ready::awaitable(py, Ok(py.None()));
        }
        if me.in_place {
            let store = me.handle(py)?;
            me.inner.lock().take();
            return rt::in_place(py, async move {
                store.close().await.map_err(errors::to_py)?;
                Ok(())
            });
        }
        if pyo3_async_runtimes::get_running_loop(py).is_err() {
            return defer(slf, "close", pyo3::types::PyDict::new(py));
        }
        let store = me.handle(py)?;
        me.inner.lock().take();
        rt::future_into_py(py, async move {
            store.close().await.map_err(errors::to_py)?;
            Ok(())
        })
    }

    /// The blocking facade over this store.
    fn sync(slf: &Bound<'_, Self>) -> SyncStateStore {
        SyncStateStore(slf.clone().unbind())
    }

    fn __aenter__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let me: Py<PyAny> = slf.clone().into_any().unbind();
        if slf.get().in_place {
            return rt::Ready::awaitable(slf.py(), Ok(me));
        }
        rt::future_into_py(slf.py(), async move { Ok(me) })
    }

    #[pyo3(signature = (*_exc))]
    fn __aexit__<'py>(
        &self,
        py: Python<'py>,
        _exc: &Bound<'py, pyo3::types::PyTuple>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let store = self.inner.lock().take();
        if self.in_place {
            return rt::in_place(py, async move {
                if let Some(store) = store {
                    store.close().await.map_err(errors::to_py)?;
                }
                Ok(())
            });
        }
        rt::future_into_py(py, async move {
            if let Some(store) = store {
                store.close().await.map_err(errors::to_py)?;
            }
            Ok(())
        })
    }

    fn __repr__(&self) -> String {
        let closed = if self.inner.lock().is_none() {
            " (closed)"
        } else {
            ""
        };
        format!("{}{closed}", self.label)
    }
}

#[pymethods]
impl SyncStateStore {
    /// Creates the PostgreSQL tables once; a no-op on the other backends.
    fn setup(&self, py: Python<'_>) -> PyResult<()> {
        let me = self.0.get();
        me.handle(py)?;
        if let Some((dsn, opts)) = me.pg_setup() {
            py.detach(move || a::PostgresStore::connect_with(&dsn, opts).and_then(|s| s.setup()))
                .map_err(errors::to_py)?;
        }
        Ok(())
    }

    /// Closes the store (a no-op when it is closed).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let me = self.0.get();
        if me.pid == std::process::id() && me.inner.lock().is_none() {
            return Ok(());
        }
        let store = me.handle(py)?;
        me.inner.lock().take();
        py.detach(move || rt::block_on(store.close()))
            .map_err(errors::to_py)?;
        Ok(())
    }

    /// The async store this facade is over.
    #[getter]
    fn store(&self, py: Python<'_>) -> Py<StateStore> {
        self.0.clone_ref(py)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<()> {
        let store = self.0.get().inner.lock().take();
        if let Some(store) = store {
            py.detach(move || rt::block_on(store.close()))
                .map_err(errors::to_py)?;
        }
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!("SyncStateStore({})", self.0.get().__repr__())
    }
}
