//! The change feed (rules F1–F9): scopes, positions, changes and pages as
//! Python classes, and `watch`, a feed followed without end as an async
//! (or, on the blocking facade, a plain) iterator.
//!
//! Positions cross as Python ints (they are u128: exact, past 2**96, the
//! top bits a tag of their scope and store, opaque to Python); `None` (or
//! 0) is the start of the feed. A position the store did not hand out for
//! the scope raises StateInvalidError (F9).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use agentstate as a;
use agentstate::AsyncStore;
use parking_lot::Mutex;
use pyo3::exceptions::{PyStopAsyncIteration, PyStopIteration};
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::errors;
use crate::rt;
use crate::store::StateStore;
use crate::types::{
    Alarm, InstanceKey, RunKey, RunRecord, SessionKey, SessionRecord, Tray, TrayKey,
};

// --- positions ---------------------------------------------------------

/// A feed position from Python: an int in `0..2**128`.
#[derive(Clone, Copy)]
pub struct Pos(pub a::Position);

impl<'a, 'py> FromPyObject<'a, 'py> for Pos {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        obj.extract::<u128>()
            .map(|n| Pos(a::Position::from_u128(n)))
            .map_err(|_| {
                let shown = obj
                    .repr()
                    .map(|r| r.to_string())
                    .unwrap_or_else(|_| "?".into());
                errors::invalid(
                    obj.py(),
                    format!(
                        "feed position {shown}: must be an int in 0..2**128 (or None: the start)"
                    ),
                )
            })
    }
}

impl<'py> IntoPyObject<'py> for Pos {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;
    fn into_pyobject(self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(self.0.as_u128().into_pyobject(py)?.into_any())
    }
}

/// `after=None` is the start of the feed.
pub fn pos_or_start(p: Option<Pos>) -> a::Position {
    p.map_or(a::Position::START, |p| p.0)
}

/// A wait in seconds as a duration (`StateInvalidError` when negative or
/// not a number; the store refuses one past its longest wait).
pub fn wait_of(timeout: f64) -> a::Result<Duration> {
    Duration::try_from_secs_f64(timeout).map_err(|_| a::StateError::Invalid {
        what: format!("timeout: seconds, a non-negative number, got {timeout}"),
    })
}

// --- scopes ------------------------------------------------------------

/// Which feed: `FeedScope.tenant("acme")` (a tenant's runs and sessions),
/// `FeedScope.trays()` (every tray and alarm of the store) or
/// `FeedScope.trays(env="prod")` (one env's trays, no alarms).
#[pyclass(frozen, eq, hash, from_py_object, module = "agentstate_rs")]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct FeedScope {
    pub inner: a::FeedScope,
}

#[pymethods]
impl FeedScope {
    /// `FeedScope("tenant", "acme")`, `FeedScope("trays")`,
    /// `FeedScope("trays", "prod")`: `kind` and `name` as the properties
    /// spell them (the static constructors read better).
    #[new]
    #[pyo3(signature = (kind, name=None))]
    fn new(py: Python<'_>, kind: &str, name: Option<String>) -> PyResult<Self> {
        let inner = match (kind, name) {
            ("tenant", Some(t)) => a::FeedScope::tenant(t),
            ("tenant", None) => {
                return Err(errors::invalid(
                    py,
                    "FeedScope: a tenant scope names its tenant",
                ));
            }
            ("trays", None) => a::FeedScope::trays(),
            ("trays", Some(env)) => a::FeedScope::trays_in(env),
            (other, _) => {
                return Err(errors::invalid(
                    py,
                    format!("FeedScope: kind {other:?} is not \"tenant\" or \"trays\""),
                ));
            }
        };
        Ok(FeedScope { inner })
    }

    /// A tenant's runs and sessions.
    #[staticmethod]
    fn tenant(tenant: String) -> Self {
        FeedScope {
            inner: a::FeedScope::tenant(tenant),
        }
    }

    /// Every tray and alarm of the store; with `env`, only that env's
    /// trays (and no alarms).
    #[staticmethod]
    #[pyo3(signature = (env=None))]
    fn trays(env: Option<String>) -> Self {
        FeedScope {
            inner: match env {
                Some(env) => a::FeedScope::trays_in(env),
                None => a::FeedScope::trays(),
            },
        }
    }

    /// `"tenant"` or `"trays"`.
    #[getter]
    fn kind(&self) -> &'static str {
        match &self.inner {
            a::FeedScope::Tenant { .. } => "tenant",
            _ => "trays",
        }
    }

    /// The tenant of a tenant scope; the env of a trays scope (None: every env).
    #[getter]
    fn name(&self) -> Option<String> {
        match &self.inner {
            a::FeedScope::Tenant { tenant } => Some(tenant.clone()),
            a::FeedScope::Trays { env } => env.clone(),
            _ => None,
        }
    }

    /// Pickles as the class, its kind and its name (an exception carrying
    /// the scope crosses a process).
    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> (
        Bound<'py, pyo3::types::PyType>,
        (&'static str, Option<String>),
    ) {
        let me = slf.get();
        (slf.get_type(), (me.kind(), me.name()))
    }

    fn __repr__(&self) -> String {
        match &self.inner {
            a::FeedScope::Tenant { tenant } => format!("FeedScope.tenant({tenant:?})"),
            a::FeedScope::Trays { env: Some(env) } => format!("FeedScope.trays(env={env:?})"),
            _ => "FeedScope.trays()".into(),
        }
    }

    fn __str__(&self) -> String {
        self.inner.to_string()
    }
}

impl From<a::FeedScope> for FeedScope {
    fn from(inner: a::FeedScope) -> Self {
        FeedScope { inner }
    }
}

// --- changes -----------------------------------------------------------

/// One change: a record as it is now (`deleted` False) or its tombstone
/// (`deleted` True), at the position of the last commit that wrote it.
///
/// `kind`: `"run"`, `"run_deleted"`, `"session"`, `"session_deleted"`,
/// `"tray"`, `"tray_deleted"`, `"alarm"`, `"alarm_deleted"`. `key` is the
/// record's key on every change (RunKey, SessionKey, TrayKey, or the
/// InstanceKey of an alarm); the record itself is `run`, `session`,
/// `tray` or `alarm` (the one of its kind; None on a tombstone), also
/// as `record`.
#[pyclass(frozen, module = "agentstate_rs")]
pub struct Change {
    #[pyo3(get)]
    position: u128,
    #[pyo3(get)]
    kind: &'static str,
    #[pyo3(get)]
    deleted: bool,
    #[pyo3(get)]
    key: Py<PyAny>,
    #[pyo3(get)]
    run: Option<Py<RunRecord>>,
    #[pyo3(get)]
    session: Option<Py<SessionRecord>>,
    #[pyo3(get)]
    tray: Option<Py<Tray>>,
    #[pyo3(get)]
    alarm: Option<Py<Alarm>>,
}

#[pymethods]
impl Change {
    /// The record of the change (a RunRecord, SessionRecord, Tray or
    /// Alarm), or None on a tombstone.
    #[getter]
    fn record(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        let r = self.run.as_ref().map(|r| r.clone_ref(py).into_any());
        r.or_else(|| self.session.as_ref().map(|s| s.clone_ref(py).into_any()))
            .or_else(|| self.tray.as_ref().map(|t| t.clone_ref(py).into_any()))
            .or_else(|| self.alarm.as_ref().map(|a| a.clone_ref(py).into_any()))
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let key = self
            .key
            .bind(py)
            .repr()
            .map(|r| r.to_string())
            .unwrap_or_else(|_| "?".into());
        let version = match (&self.run, &self.session) {
            (Some(r), _) => r
                .try_borrow(py)
                .map(|r| format!(", version={}", r.inner.version))
                .unwrap_or_default(),
            (_, Some(s)) => s
                .try_borrow(py)
                .map(|s| format!(", version={}", s.inner.version))
                .unwrap_or_default(),
            _ => String::new(),
        };
        format!(
            "Change(position={}, kind={:?}, key={key}{version})",
            self.position, self.kind
        )
    }
}

fn change_to_py(py: Python<'_>, c: a::Change) -> PyResult<Change> {
    let mut out = Change {
        position: c.position.as_u128(),
        kind: "unknown",
        deleted: c.item.is_delete(),
        key: py.None(),
        run: None,
        session: None,
        tray: None,
        alarm: None,
    };
    match c.item {
        a::Changed::Run { run } => {
            out.kind = "run";
            out.key = Py::new(py, RunKey::from(run.key.clone()))?.into_any();
            out.run = Some(Py::new(py, RunRecord::from(run))?);
        }
        a::Changed::RunDeleted { key } => {
            out.kind = "run_deleted";
            out.key = Py::new(py, RunKey::from(key))?.into_any();
        }
        a::Changed::Session { session } => {
            out.kind = "session";
            out.key = Py::new(py, SessionKey::from(session.key.clone()))?.into_any();
            out.session = Some(Py::new(py, SessionRecord::from(session))?);
        }
        a::Changed::SessionDeleted { key } => {
            out.kind = "session_deleted";
            out.key = Py::new(py, SessionKey::from(key))?.into_any();
        }
        a::Changed::Tray { key, tray } => {
            out.kind = "tray";
            out.key = Py::new(py, TrayKey::from(key))?.into_any();
            out.tray = Some(Py::new(py, Tray::from(tray))?);
        }
        a::Changed::TrayDeleted { key } => {
            out.kind = "tray_deleted";
            out.key = Py::new(py, TrayKey::from(key))?.into_any();
        }
        a::Changed::Alarm { alarm } => {
            out.kind = "alarm";
            out.key = Py::new(py, InstanceKey::from(alarm.instance.clone()))?.into_any();
            out.alarm = Some(Py::new(py, Alarm::from(alarm))?);
        }
        a::Changed::AlarmDeleted { instance } => {
            out.kind = "alarm_deleted";
            out.key = Py::new(py, InstanceKey::from(instance))?.into_any();
        }
        // A kind of change this build does not know.
        _ => {}
    }
    Ok(out)
}

/// A page of a feed: `changes` in position order, and `next`, the
/// position the next call reads after.
#[pyclass(frozen, module = "agentstate_rs")]
pub struct ChangePage {
    #[pyo3(get)]
    changes: Py<PyList>,
    #[pyo3(get)]
    next: u128,
}

#[pymethods]
impl ChangePage {
    fn __len__(&self, py: Python<'_>) -> usize {
        self.changes.bind(py).len()
    }
    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(self.changes.bind(py).try_iter()?.into_any())
    }
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "ChangePage(changes=<{} changes>, next={})",
            self.changes.bind(py).len(),
            self.next
        )
    }
}

/// A page on its way to Python.
pub struct ChangePageOut(pub a::ChangePage);

impl<'py> IntoPyObject<'py> for ChangePageOut {
    type Target = ChangePage;
    type Output = Bound<'py, ChangePage>;
    type Error = PyErr;
    fn into_pyobject(self, py: Python<'py>) -> PyResult<Bound<'py, ChangePage>> {
        let changes = self
            .0
            .changes
            .into_iter()
            .map(|c| change_to_py(py, c))
            .collect::<PyResult<Vec<_>>>()?;
        let changes = PyList::new(py, changes)?.unbind();
        Bound::new(
            py,
            ChangePage {
                changes,
                next: self.0.next.as_u128(),
            },
        )
    }
}

// --- watch -------------------------------------------------------------

/// A feed followed without end: the changes read and not yet handed out,
/// and where the next read starts. Handing out a change (`pop`) is one
/// step under the GIL, and a read adds its whole page in one step: a read
/// cancelled half-way loses nothing, and neither does a cancelled
/// `async for`.
struct Feed {
    /// The store: each read takes a handle of it, so a closed store's
    /// watch raises StateClosedError (and holds none of its files).
    store: Py<StateStore>,
    scope: a::FeedScope,
    /// The wait of each `wait_changes` of an async watch.
    wait: Duration,
    pid: u32,
    state: Mutex<FeedState>,
    /// One read at a time.
    reading: tokio::sync::Mutex<()>,
}

struct FeedState {
    buf: VecDeque<a::Change>,
    /// Where the next read starts: the last page's `next`.
    at: a::Position,
    /// The position of the last change handed out.
    handed: a::Position,
    /// A read failed: the watch hands out what it holds, then ends.
    failed: bool,
}

/// Changes read a page at a time.
const WATCH_PAGE: usize = 100;

impl Feed {
    fn new(store: Py<StateStore>, scope: a::FeedScope, after: a::Position, wait: Duration) -> Self {
        Feed {
            store,
            scope,
            wait,
            pid: std::process::id(),
            state: Mutex::new(FeedState {
                buf: VecDeque::new(),
                at: after,
                handed: after,
                failed: false,
            }),
            reading: tokio::sync::Mutex::new(()),
        }
    }

    /// The store to read with (StateClosedError once it is closed,
    /// StoreForkedError in a forked child).
    fn handle(&self, py: Python<'_>) -> PyResult<AsyncStore> {
        if std::process::id() != self.pid {
            return Err(errors::forked(py, &format!("watch of {}", self.scope)));
        }
        self.store.get().handle(py)
    }

    /// The next change read and not handed out; `Err(())` when there is
    /// none and the watch has ended (after a failed read).
    fn pop(&self) -> Result<Option<a::Change>, ()> {
        let mut st = self.state.lock();
        match st.buf.pop_front() {
            Some(c) => {
                st.handed = c.position;
                Ok(Some(c))
            }
            None if st.failed => Err(()),
            None => Ok(None),
        }
    }

    /// Where a later watch resumes to miss nothing this one has not
    /// handed out.
    fn position(&self) -> a::Position {
        let st = self.state.lock();
        if st.buf.is_empty() { st.at } else { st.handed }
    }

    /// One `wait_changes` of up to `wait` (none when changes are held or
    /// the watch has ended); whether changes are held after it.
    async fn read(&self, store: &AsyncStore, wait: Duration) -> a::Result<bool> {
        let _one = self.reading.lock().await;
        let at = {
            let st = self.state.lock();
            if !st.buf.is_empty() || st.failed {
                return Ok(true);
            }
            st.at
        };
        let r = store.wait_changes(&self.scope, at, WATCH_PAGE, wait).await;
        let mut st = self.state.lock();
        match r {
            Ok(page) => {
                st.at = page.next;
                st.buf.extend(page.changes);
                Ok(!st.buf.is_empty())
            }
            Err(e) => {
                st.failed = true;
                Err(e)
            }
        }
    }
}

/// `store.watch(scope, after=None)`: every change of the scope after
/// `after`, in position order, without end, as an async iterator. It
/// waits whenever it has handed out every change; a cancelled `async for`
/// stops it cleanly and loses nothing (`position` is where a new watch
/// resumes). After an error (StateFeedPrunedError, a lost server) it
/// raises the error once and then ends.
#[pyclass(frozen, module = "agentstate_rs")]
pub struct ChangeStream(Arc<Feed>);

impl ChangeStream {
    pub fn new(
        store: Py<StateStore>,
        scope: a::FeedScope,
        after: a::Position,
        wait: Duration,
    ) -> Self {
        ChangeStream(Arc::new(Feed::new(store, scope, after, wait)))
    }
}

#[pymethods]
impl ChangeStream {
    fn __aiter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// A coroutine (`agentstate_rs._defer.next_change`) that hands out the
    /// next change held, reading (`_read`) until there is one.
    fn __anext__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        slf.get().0.handle(py)?;
        py.import("agentstate_rs._defer")?
            .getattr("next_change")?
            .call1((slf,))
    }

    /// The next change held, or None; raises StopAsyncIteration once the
    /// watch has ended.
    fn _pop(&self, py: Python<'_>) -> PyResult<Option<Change>> {
        match self.0.pop() {
            Ok(Some(c)) => change_to_py(py, c).map(Some),
            Ok(None) => Ok(None),
            Err(()) => Err(PyStopAsyncIteration::new_err(())),
        }
    }

    /// An awaitable that reads until a change is held (or the read fails).
    fn _read<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let store = self.0.handle(py)?;
        let feed = Arc::clone(&self.0);
        rt::future_into_py(py, async move {
            while !feed.read(&store, feed.wait).await.map_err(errors::to_py)? {}
            Ok(())
        })
    }

    /// Where a later watch resumes so that it misses nothing this one has
    /// not handed out.
    #[getter]
    fn position(&self) -> u128 {
        self.0.position().as_u128()
    }

    #[getter]
    fn scope(&self) -> FeedScope {
        self.0.scope.clone().into()
    }

    fn __repr__(&self) -> String {
        format!(
            "ChangeStream(scope={}, position={})",
            FeedScope::from(self.0.scope.clone()).__repr__(),
            self.0.position()
        )
    }
}

/// `store.sync().watch(scope, after=None)`: the same feed as a blocking
/// iterator, without end. Each wait is a second at most, then the
/// iterator checks for signals (Ctrl-C stops it).
#[pyclass(frozen, module = "agentstate_rs")]
pub struct SyncChangeStream(Arc<Feed>);

impl SyncChangeStream {
    pub fn new(store: Py<StateStore>, scope: a::FeedScope, after: a::Position) -> Self {
        SyncChangeStream(Arc::new(Feed::new(
            store,
            scope,
            after,
            Duration::from_secs(1),
        )))
    }
}

#[pymethods]
impl SyncChangeStream {
    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Change> {
        loop {
            let store = self.0.handle(py)?;
            match self.0.pop() {
                Ok(Some(c)) => return change_to_py(py, c),
                Ok(None) => {}
                Err(()) => return Err(PyStopIteration::new_err(())),
            }
            let feed = Arc::clone(&self.0);
            py.detach(move || rt::block_on(feed.read(&store, feed.wait)))
                .map_err(errors::to_py)?;
            py.check_signals()?;
        }
    }

    /// Where a later watch resumes so that it misses nothing this one has
    /// not handed out.
    #[getter]
    fn position(&self) -> u128 {
        self.0.position().as_u128()
    }

    #[getter]
    fn scope(&self) -> FeedScope {
        self.0.scope.clone().into()
    }

    fn __repr__(&self) -> String {
        format!(
            "SyncChangeStream(scope={}, position={})",
            FeedScope::from(self.0.scope.clone()).__repr__(),
            self.0.position()
        )
    }
}
