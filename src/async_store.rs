//! The async wrapper (rules W1–W3).
//!
//! [`AsyncStore`] mirrors every method of [`StateStore`], [`TrayStore`],
//! [`BudgetStore`] and [`StoreAdmin`] as an `async fn`, over any backend.
//! How a call runs depends on the backend:
//!
//! - a server backend (PostgreSQL, Redis) has an async core
//!   (`agentstate_core::native`): the call is awaited in the caller's task over the
//!   backend's async client, no thread hop;
//! - the memory store never syncs or sleeps: the call runs in the caller's
//!   task;
//! - the file store (and any `Arc<dyn Store>` handed in) may sync: the
//!   call is cloned onto tokio's blocking pool and awaited there.
//!
//! It holds no logic of its own: every rule is the store's (W1), and no
//! blocking work runs on an executor thread (W2).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::async_stream::{ChangeStream, PageStream};
#[cfg(doc)]
use crate::{BudgetStore, StateStore, StateStoreExt, StoreAdmin, TrayStore};
use agentstate_core::admin::{StoreStats, VerifyReport};
use agentstate_core::api::Store;
use agentstate_core::budget::BudgetStatus;
use agentstate_core::entry::Entry;
use agentstate_core::error::{Result, StateError};
use agentstate_core::feed::{ChangePage, FeedScope, Position};
use agentstate_core::options::Options;
use agentstate_core::page::{Page, PageRequest};
use agentstate_core::record::{Millis, RunKey, RunRecord, SessionRecord, StateQuery};
use agentstate_core::retry::RetryPolicy;
use agentstate_core::tray::{Alarm, InstanceKey, MarkedTray, Tray, TrayKey};
use agentstate_kv::{FileStore, MemoryStore};

/// Any [`Store`] for async code. A server backend's calls (PostgreSQL,
/// Redis) are awaited natively in the caller's task; a memory store's run
/// in the caller's task; a file store's (and any `Arc<dyn Store>`'s) on
/// tokio's blocking pool, so a sync never holds an executor thread.
///
/// Cheap to clone (an `Arc`); clones share one store. The methods have the
/// same names, arguments and results as the synchronous ones, so the store's
/// docs and rules apply unchanged.
///
/// # Cancellation (W3)
///
/// Dropping a returned future never leaves a partial write, but it does
/// not always cancel the call: a call handed to the blocking pool runs to
/// completion, and a server write whose request was already sent
/// (PostgreSQL: its `COMMIT`; Redis: its script) may still commit. A
/// dropped future's write may therefore still land — whole, never in
/// part — and its answer is discarded. If you need to know whether it landed, read the record
/// back (a versioned write tells you by its version). A call the runtime
/// never started (the runtime was shutting down) writes nothing and fails
/// with a retryable `Persistence { reason: Unavailable }`.
///
/// # Closing
///
/// The store closes when its last handle is dropped; closing a file store
/// writes its high-water mark (a small synced file write) and, by default,
/// flushes its memtables, and closing a server store stops its own small
/// runtime (in the background) and drops its connections. Dropped inside a
/// tokio runtime, the last handle closes the store on a thread of its own and
/// waits for it, so no store's close ever runs a runtime inside the
/// caller's (which would panic); outside a runtime it closes in place. In
/// async code, prefer ending with [`AsyncStore::close`], which closes on
/// the blocking pool without holding the executor thread.
///
/// # Panics
///
/// A panic inside the store call (a bug, never an operating error) is
/// resumed in the awaiting task, exactly as the synchronous call would have
/// panicked in its caller. It is not turned into a [`StateError`], because
/// no variant could say truthfully whether the call's write landed.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> agentstate::Result<()> {
/// use agentstate::{AsyncStore, RunKey, RunRecord, StateDelta};
/// let store = AsyncStore::memory();
/// let run = store.put_run(RunRecord::new(RunKey::new("acme", "run_1"), "planner")).await?;
/// let run = store.patch_run(&run.key, StateDelta { iterations: 1, ..Default::default() }).await?;
/// assert_eq!((run.version, run.iterations), (2, 1));
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct AsyncStore {
    /// Always `Some` but while the handle closes (see `Drop`).
    inner: Option<Arc<dyn Store>>,
    /// The same store when it has an async core (a server backend, see
    /// `StoreAdmin::async_core`): its calls are awaited natively, in the
    /// caller's task.
    native: Option<Arc<dyn agentstate_core::native::DynCore>>,
    /// A store whose calls never sync or sleep (the memory store, see
    /// `StoreAdmin::runs_in_caller`): they run in the caller's task (W2
    /// keeps only blocking work off the executor).
    inline: bool,
    path: Option<PathBuf>,
}

/// Awaits the call natively when the store has an async core, and returns.
macro_rules! native {
    ($self:ident . $m:ident ( $($a:expr),* )) => {
        if let Some(n) = &$self.native {
            return agentstate_core::native::DynCore::$m(&**n, $($a),*).await;
        }
    };
}

/// The last handle of a store closes it off the runtime's threads: inside
/// a tokio runtime the close (a file store's flush and syncs) runs on a
/// thread of its own, and the drop returns once it is done (so a file
/// store's directory is free again when the drop returns, as it is outside
/// a runtime).
impl Drop for AsyncStore {
    fn drop(&mut self) {
        drop(self.native.take());
        let Some(store) = self.inner.take() else {
            return;
        };
        if Arc::strong_count(&store) > 1 || tokio::runtime::Handle::try_current().is_err() {
            return; // not the last handle, or no runtime here: drops as is
        }
        std::thread::scope(|scope| {
            let closed = std::thread::Builder::new()
                .name("agentstate-close".into())
                .spawn_scoped(scope, move || drop(store));
            if let Ok(closer) = closed {
                // A panic while closing is a bug; it surfaces here as it
                // would have in the dropping thread.
                if let Err(panic) = closer.join() {
                    std::panic::resume_unwind(panic);
                }
            }
        });
    }
}

impl std::fmt::Debug for AsyncStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncStore")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl From<MemoryStore> for AsyncStore {
    fn from(store: MemoryStore) -> Self {
        AsyncStore::new(store)
    }
}

impl From<FileStore> for AsyncStore {
    fn from(store: FileStore) -> Self {
        let path = Some(store.path().to_path_buf());
        AsyncStore::blocking_pool(Arc::new(store), path)
    }
}

/// Native: each call is awaited in the caller's task
/// ([`AsyncStore::new`]).
#[cfg(feature = "postgres")]
impl From<crate::PostgresStore> for AsyncStore {
    fn from(store: crate::PostgresStore) -> Self {
        AsyncStore::new(store)
    }
}

#[cfg(feature = "redis")]
impl From<crate::RedisStore> for AsyncStore {
    /// The store, its calls awaited natively (see [`RedisStore`](crate::RedisStore)).
    fn from(store: crate::RedisStore) -> Self {
        AsyncStore::new(store)
    }
}

impl From<Arc<dyn Store>> for AsyncStore {
    /// Every call of a store handed in this way goes through the blocking
    /// pool, whatever its backend; wrap a server backend's own type
    /// ([`AsyncStore::new`]) to have its calls awaited natively.
    fn from(store: Arc<dyn Store>) -> Self {
        AsyncStore::blocking_pool(store, None)
    }
}

impl AsyncStore {
    /// Wraps a store of any backend.
    ///
    /// A server backend (PostgreSQL, Redis) is called natively: each call
    /// is awaited in the caller's task over the backend's async client,
    /// with no thread hop. A memory store runs each call in the caller's
    /// task (it never syncs); a file store on tokio's blocking pool.
    pub fn new<S: Store + 'static>(store: S) -> Self {
        let store = Arc::new(store);
        if let Some(native) = Arc::clone(&store).async_core() {
            return AsyncStore {
                inner: Some(store),
                native: Some(native),
                inline: false,
                path: None,
            };
        }
        let inline = store.runs_in_caller();
        let mut wrapped = AsyncStore::blocking_pool(store, None);
        wrapped.inline = inline;
        wrapped
    }

    fn blocking_pool(store: Arc<dyn Store>, path: Option<PathBuf>) -> Self {
        AsyncStore {
            inner: Some(store),
            native: None,
            inline: false,
            path,
        }
    }

    /// An empty in-memory store ([`MemoryStore::new`]); creating one does no I/O.
    pub fn memory() -> Self {
        AsyncStore::new(MemoryStore::new())
    }

    /// Opens (creating if needed) the file store at `path` ([`FileStore::open`]).
    pub async fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_with(path, Options::default()).await
    }

    /// Opens the file store at `path` with options ([`FileStore::open_with`]).
    pub async fn open_with(path: impl AsRef<Path>, opts: Options) -> Result<Self> {
        let path: PathBuf = path.as_ref().to_path_buf();
        blocking(move || FileStore::open_with(path, opts))
            .await
            .map(AsyncStore::from)
    }

    /// The synchronous store underneath, for code that is already on a
    /// blocking thread.
    pub fn sync_store(&self) -> &Arc<dyn Store> {
        self.store()
    }

    /// Another handle on the same store whose calls run in the task that
    /// polls them, with no blocking pool (a server backend's stay native):
    /// for a caller that is not an async executor's thread and waits for
    /// the answer anyway, such as a language binding answering on its
    /// caller's thread. Polled on an executor's thread, a file store's
    /// syncs would hold that thread (rule W2): don't.
    pub fn in_caller(&self) -> AsyncStore {
        let mut handle = self.clone();
        handle.inline = true;
        handle
    }

    #[allow(
        clippy::expect_used,
        reason = "a handle holds its store until it is dropped"
    )]
    fn store(&self) -> &Arc<dyn Store> {
        self.inner
            .as_ref()
            .expect("a handle holds its store until it is dropped")
    }

    /// The directory of a file store; `None` for other backends. Reads no
    /// file.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Drops this handle on the blocking pool; when it was the last one,
    /// the store is closed (and its directory free to open again) when this
    /// returns, and the answer is `true`. With other handles alive it only
    /// drops this one and answers `false`.
    #[allow(
        clippy::expect_used,
        reason = "a handle holds its store until it is dropped"
    )]
    pub async fn close(mut self) -> Result<bool> {
        drop(self.native.take());
        let mut store = self
            .inner
            .take()
            .expect("a handle holds its store until it is dropped");
        blocking(move || {
            let last = Arc::get_mut(&mut store).is_some();
            drop(store);
            Ok(last)
        })
        .await
    }

    /// Runs `f` on the blocking pool with the store (in the caller's task
    /// for a memory store).
    async fn run<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&dyn Store) -> Result<T> + Send + 'static,
    {
        if self.inline {
            return f(&**self.store());
        }
        let store = Arc::clone(self.store());
        blocking(move || f(&*store)).await
    }

    // --- the calls: generated from the one list (`async_calls!` below) ----

    /// [`FeedStore::wait_changes`](crate::FeedStore::wait_changes). A
    /// server backend's wait is awaited natively (its listener wakes the
    /// task); an embedded store's waits on a thread of tokio's blocking
    /// pool, so many waiters hold as many threads: follow one feed with
    /// [`watch`](Self::watch) and fan out in the application. A dropped
    /// future stops waiting (a blocking-pool wait ends at its timeout).
    pub async fn wait_changes(
        &self,
        scope: &FeedScope,
        after: Position,
        limit: usize,
        timeout: std::time::Duration,
    ) -> Result<ChangePage> {
        native!(self.wait_changes(scope, after, limit, timeout));
        let scope = scope.clone();
        let store = Arc::clone(self.store());
        blocking(move || store.wait_changes(&scope, after, limit, timeout)).await
    }

    /// Follows `scope`'s feed from `after`, without end: every change, in
    /// position order, as a [`Stream`](futures_core::Stream), waiting (in
    /// [`wait_changes`](Self::wait_changes) of up to a minute at a time)
    /// whenever it is caught up. Read 100 changes at a time.
    pub fn watch(&self, scope: &FeedScope, after: Position) -> ChangeStream {
        let (store, scope) = (self.clone(), scope.clone());
        ChangeStream::new(after, move |at| {
            let (store, scope) = (store.clone(), scope.clone());
            async move {
                store
                    .wait_changes(&scope, at, 100, std::time::Duration::from_secs(60))
                    .await
            }
        })
    }

    // --- walks and read-modify-write ------------------------------------

    /// Every run the query matches, page after page (the L2 walk), as a
    /// [`Stream`](futures_core::Stream): [`StateStore::iter_runs`].
    pub fn iter_runs(&self, query: &StateQuery) -> PageStream<RunRecord> {
        let (store, query) = (self.clone(), query.clone());
        PageStream::new(move |req| {
            let (store, query) = (store.clone(), query.clone());
            async move { store.list_runs(&query, &req).await }
        })
    }

    /// Every session of a tenant: [`StoreAdmin::iter_sessions`].
    pub fn iter_sessions(&self, tenant: &str) -> PageStream<SessionRecord> {
        let (store, tenant) = (self.clone(), tenant.to_owned());
        PageStream::new(move |req| {
            let (store, tenant) = (store.clone(), tenant.clone());
            async move { store.list_sessions(&tenant, &req).await }
        })
    }

    /// Every tray of an instance; each page's read carries the epoch, so a
    /// walk by a fenced holder stops with `FenceLost`:
    /// [`TrayStore::iter_trays`].
    pub fn iter_trays(&self, instance: &InstanceKey, epoch: u64) -> PageStream<(TrayKey, Tray)> {
        let (store, instance) = (self.clone(), instance.clone());
        PageStream::new(move |req| {
            let (store, instance) = (store.clone(), instance.clone());
            async move { store.list_trays(&instance, epoch, &req).await }
        })
    }

    /// Every marked tray, optionally of one env (T5):
    /// [`TrayStore::iter_marked_trays`].
    pub fn iter_marked_trays(&self, env: Option<&str>) -> PageStream<MarkedTray> {
        let (store, env) = (self.clone(), env.map(str::to_owned));
        PageStream::new(move |req| {
            let (store, env) = (store.clone(), env.clone());
            async move { store.marked_trays(env.as_deref(), &req).await }
        })
    }

    /// Every alarm due at `now` (A2): [`TrayStore::iter_due_alarms`].
    pub fn iter_due_alarms(&self, now: Millis) -> PageStream<Alarm> {
        let store = self.clone();
        PageStream::new(move |req| {
            let store = store.clone();
            async move { store.due_alarms(now, &req).await }
        })
    }

    /// Every budget of a tenant: [`BudgetStore::iter_budgets`].
    pub fn iter_budgets(&self, tenant: &str) -> PageStream<BudgetStatus> {
        let (store, tenant) = (self.clone(), tenant.to_owned());
        PageStream::new(move |req| {
            let (store, tenant) = (store.clone(), tenant.clone());
            async move { store.list_budgets(&tenant, &req).await }
        })
    }

    /// Every entry of the store, for a backup: [`StoreAdmin::iter_export`].
    pub fn iter_export(&self) -> PageStream<Entry> {
        let store = self.clone();
        PageStream::new(move |req| {
            let store = store.clone();
            async move { store.export_page(&req).await }
        })
    }

    /// Reads the run, applies `edit`, and puts it at the version read,
    /// again on a `Conflict` after a jittered pause on the runtime's timer
    /// (never sleeping a thread): [`StateStoreExt::update_run`] with the
    /// default [`RetryPolicy`]. `edit` may run more than once; only its
    /// last run is stored.
    pub async fn update_run<F>(&self, key: &RunKey, edit: F) -> Result<RunRecord>
    where
        F: FnMut(&mut RunRecord) -> Result<()>,
    {
        self.update_run_with(key, RetryPolicy::default(), edit)
            .await
    }

    /// [`update_run`](Self::update_run) with its own retry policy.
    pub async fn update_run_with<F>(
        &self,
        key: &RunKey,
        policy: RetryPolicy,
        mut edit: F,
    ) -> Result<RunRecord>
    where
        F: FnMut(&mut RunRecord) -> Result<()>,
    {
        let mut seed = agentstate_core::retry::seed();
        let attempts = policy.attempts.max(1);
        let mut n = 0;
        loop {
            n += 1;
            let Some(mut run) = self.get_run(key).await? else {
                return Err(StateError::NotFound(
                    agentstate_core::error::RecordKey::Run(key.clone()),
                ));
            };
            edit(&mut run)?;
            match self.put_run(run).await {
                Err(e @ StateError::Conflict { .. }) => {
                    if n >= attempts {
                        return Err(e);
                    }
                    tokio::time::sleep(policy.backoff(n, &mut seed)).await;
                }
                other => return other,
            }
        }
    }

    // --- whole-store operations -----------------------------------------

    /// [`StoreAdmin::verify`].
    pub async fn verify(&self) -> Result<VerifyReport> {
        self.run(|s| s.verify()).await
    }

    /// [`StoreAdmin::stats`].
    pub async fn stats(&self) -> Result<StoreStats> {
        self.run(|s| s.stats()).await
    }

    /// [`StoreAdmin::prune`].
    pub async fn prune(&self, tenant: &str, finished_before: Millis) -> Result<u64> {
        let tenant = tenant.to_owned();
        self.run(move |s| s.prune(&tenant, finished_before)).await
    }

    /// [`StoreAdmin::purge_tenant`].
    pub async fn purge_tenant(&self, tenant: &str) -> Result<u64> {
        let tenant = tenant.to_owned();
        self.run(move |s| s.purge_tenant(&tenant)).await
    }

    /// [`StoreAdmin::export_page`].
    pub async fn export_page(&self, page: &PageRequest) -> Result<Page<Entry>> {
        let page = page.clone();
        self.run(move |s| s.export_page(&page)).await
    }

    /// [`StoreAdmin::import`]: every entry, into an empty store; returns
    /// how many were imported.
    pub async fn import(&self, entries: Vec<Entry>) -> Result<u64> {
        self.run(move |s| s.import(&mut entries.into_iter().map(Ok)))
            .await
    }

    /// [`StoreAdmin::is_empty`].
    pub async fn is_empty(&self) -> Result<bool> {
        self.run(|s| s.is_empty()).await
    }
}

/// Runs `f` on tokio's blocking pool and returns its answer; a panic in `f`
/// is resumed here (see the type's docs).
async fn blocking<T, F>(f: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T> + Send + 'static,
{
    match tokio::task::spawn_blocking(f).await {
        Ok(answer) => answer,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        // Only a task that never started is cancelled: nothing ran.
        Err(_) => Err(StateError::unavailable(
            "the async runtime shut down before the store call started; nothing was written",
            None,
        )),
    }
}

/// `AsyncStore`'s method for each call of the one list of calls
/// (`agentstate_core::calls`), but `wait_changes` (above): awaited
/// natively on a store with an async core, else the store's synchronous
/// call in the caller's task (`inline`) or on the blocking pool, with its
/// borrowed arguments carried there as owned copies.
macro_rules! async_calls {
    ([] $( $trait:ident { $( $name:ident ( $($args:tt)* ) -> $answer:ty, tenant: $tenant:expr; )* } )*) => {
        impl AsyncStore {
            $($( async_calls!(@munch $trait $name $answer [] [] [] [] $($args)*); )*)*
        }
    };
    // The one call whose blocking-pool path differs (it waits): written out above.
    (@munch FeedStore wait_changes $($rest:tt)*) => {};
    // Each argument: its parameter, its native argument, how it is carried
    // to the pool, and how the synchronous call takes it there.
    (@munch $trait:ident $name:ident $answer:ty [$($p:tt)*] [$($n:ident)*] [$($own:tt)*] [$($c:tt)*]
        $arg:ident : Option<&'a str> $(, $($rest:tt)*)?) => {
        async_calls!(@munch $trait $name $answer [$($p)* $arg: Option<&'a str>,] [$($n)* $arg]
            [$($own)* let $arg = $arg.map(str::to_owned);] [$($c)* $arg.as_deref(),] $($($rest)*)?);
    };
    (@munch $trait:ident $name:ident $answer:ty [$($p:tt)*] [$($n:ident)*] [$($own:tt)*] [$($c:tt)*]
        $arg:ident : &'a $t:ty $(, $($rest:tt)*)?) => {
        async_calls!(@munch $trait $name $answer [$($p)* $arg: &'a $t,] [$($n)* $arg]
            [$($own)* let $arg = ToOwned::to_owned($arg);] [$($c)* &$arg,] $($($rest)*)?);
    };
    (@munch $trait:ident $name:ident $answer:ty [$($p:tt)*] [$($n:ident)*] [$($own:tt)*] [$($c:tt)*]
        $arg:ident : $t:ty $(, $($rest:tt)*)?) => {
        async_calls!(@munch $trait $name $answer [$($p)* $arg: $t,] [$($n)* $arg]
            [$($own)*] [$($c)* $arg,] $($($rest)*)?);
    };
    (@munch $trait:ident $name:ident $answer:ty [$($p:tt)*] [$($n:ident)*] [$($own:tt)*] [$($c:tt)*]) => {
        #[doc = concat!(
            "[`", stringify!($trait), "::", stringify!($name), "`](crate::",
            stringify!($trait), "::", stringify!($name), "), awaited."
        )]
        // One lifetime for every borrow, as the list writes them.
        #[allow(clippy::needless_lifetimes)]
        pub async fn $name<'a>(&'a self, $($p)*) -> Result<$answer> {
            native!(self.$name($($n),*));
            $($own)*
            self.run(move |s| s.$name($($c)*)).await
        }
    };
}

agentstate_core::for_each_call!(async_calls, []);
