//! The tokio runtime the module runs its calls on, rebuilt after a fork.
//!
//! A tokio runtime does not survive `fork()`: the child has the runtime's
//! memory but none of its threads, so a task spawned on it never runs. The
//! runtime here is keyed by the process id: a child process gets a new
//! one (the parent's is leaked, never dropped, since dropping it would
//! wait for threads that do not exist in the child). Stores opened before
//! the fork refuse every call in the child (see `store.rs`); stores opened
//! in the child work.

use std::cell::OnceCell;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3_async_runtimes::TaskLocals;
use pyo3_async_runtimes::generic::{self, ContextExt, Runtime as GenericRuntime};
use tokio::runtime::Runtime;

static RUNTIME: Mutex<Option<(u32, &'static Runtime)>> = Mutex::new(None);

/// Tasks of this process's runtime not yet finished (see [`quiesce`]).
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);

/// One task counted in [`IN_FLIGHT`] until it ends (or is dropped).
struct InFlight;

impl InFlight {
    fn new() -> Self {
        IN_FLIGHT.fetch_add(1, Ordering::AcqRel);
        InFlight
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        IN_FLIGHT.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Waits, with the GIL released, until no task of the runtime is running
/// or `timeout_s` has passed; whether none is. Registered with `atexit`
/// by the package: a task that is still handing its result to asyncio
/// when the interpreter starts finalizing needs the GIL once more, and
/// a thread that asks for it then is stopped mid-way (a crash at exit).
/// Waiting for them while the interpreter is still whole avoids that.
#[pyfunction]
pub fn _quiesce(py: Python<'_>, timeout_s: f64) -> bool {
    let owner = RUNTIME.lock().map(|(pid, _)| pid);
    if owner != Some(std::process::id()) {
        // No runtime in this process (or only a parent's, whose tasks
        // never run here).
        return true;
    }
    let deadline = Instant::now() + Duration::from_secs_f64(timeout_s.clamp(0.0, 60.0));
    py.detach(|| {
        while IN_FLIGHT.load(Ordering::Acquire) > 0 {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    })
}

/// The runtime of this process, built on first use (and again after a fork).
#[allow(
    clippy::expect_used,
    reason = "a process that cannot start two threads cannot use the module; PyO3 raises the panic as PanicException"
)]
pub fn runtime() -> &'static Runtime {
    let pid = std::process::id();
    let mut slot = RUNTIME.lock();
    if let Some((owner, rt)) = *slot
        && owner == pid
    {
        return rt;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("agentstate-rs")
        .enable_all()
        .build()
        .expect("build the tokio runtime");
    // Leaked: it lives as long as the process (and a forked child must
    // never drop its parent's).
    let rt: &'static Runtime = Box::leak(Box::new(rt));
    // A parent's tasks never run (nor end) in a forked child.
    IN_FLIGHT.store(0, Ordering::Release);
    *slot = Some((pid, rt));
    rt
}

/// Runs a future to completion on the runtime, from a thread outside it
/// (a Python thread that released the GIL).
pub fn block_on<F: Future>(fut: F) -> F::Output {
    runtime().block_on(fut)
}

/// Runs `f` on a new plain thread (outside the runtime) and awaits its
/// answer: for a call that must not run inside a runtime, such as
/// closing a blocking PostgreSQL client.
pub async fn off_runtime<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("agentstate-rs-blocking".into())
        .spawn(move || {
            let _ = tx.send(f());
        })
        .ok()?;
    rx.await.ok()
}

/// pyo3-async-runtimes' bridge over [`runtime`].
pub struct ForkAwareTokio;

tokio::task_local! {
    static TASK_LOCALS: OnceCell<TaskLocals>;
}

impl GenericRuntime for ForkAwareTokio {
    type JoinError = tokio::task::JoinError;
    type JoinHandle = tokio::task::JoinHandle<()>;

    fn spawn<F>(fut: F) -> Self::JoinHandle
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let rt = runtime();
        let counted = InFlight::new();
        rt.spawn(async move {
            let _counted = counted;
            fut.await
        })
    }

    fn spawn_blocking<F>(f: F) -> Self::JoinHandle
    where
        F: FnOnce() + Send + 'static,
    {
        let rt = runtime();
        let counted = InFlight::new();
        rt.spawn_blocking(move || {
            let _counted = counted;
            f()
        })
    }
}

impl ContextExt for ForkAwareTokio {
    fn scope<F, R>(locals: TaskLocals, fut: F) -> Pin<Box<dyn Future<Output = R> + Send>>
    where
        F: Future<Output = R> + Send + 'static,
    {
        let cell = OnceCell::new();
        let _ = cell.set(locals);
        Box::pin(TASK_LOCALS.scope(cell, fut))
    }

    fn get_task_locals() -> Option<TaskLocals> {
        TASK_LOCALS
            .try_with(|c| c.get().cloned())
            .unwrap_or_default()
    }
}

/// An asyncio awaitable over a Rust future run on [`runtime`].
pub fn future_into_py<F, T>(py: Python<'_>, fut: F) -> PyResult<Bound<'_, PyAny>>
where
    F: Future<Output = PyResult<T>> + Send + 'static,
    T: for<'py> IntoPyObject<'py> + Send + 'static,
{
    generic::future_into_py::<ForkAwareTokio, F, T>(py, fut)
}

/// An awaitable whose answer is already there: what a memory or file
/// store's call returns. The call ran in place, on the caller's thread
/// (the GIL released while it ran); awaiting this hands its answer back
/// without yielding to the event loop, so the call takes no loop
/// iteration and no other thread (a simulation on virtual time, such as
/// pinned's, sees the same schedule every run). It is a coroutine in the
/// sense of `collections.abc.Coroutine` (`send`, `throw`, `close`), so
/// `asyncio.run`, `create_task` and `gather` take it as well as `await`.
#[pyclass(module = "agentstate_rs._native", name = "Done")]
pub struct Ready {
    answer: Option<PyResult<Py<PyAny>>>,
}

impl Ready {
    /// The awaitable of an answer (a value or the exception to raise).
    pub fn awaitable<'py>(
        py: Python<'py>,
        answer: PyResult<Py<PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        Ok(Bound::new(
            py,
            Ready {
                answer: Some(answer),
            },
        )?
        .into_any())
    }

    fn step(&mut self) -> PyResult<Py<PyAny>> {
        match self.answer.take() {
            Some(Ok(v)) => Err(pyo3::exceptions::PyStopIteration::new_err((v,))),
            Some(Err(e)) => Err(e),
            None => Err(pyo3::exceptions::PyRuntimeError::new_err(
                "cannot reuse an already awaited store call",
            )),
        }
    }
}

#[pymethods]
impl Ready {
    fn __await__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&mut self) -> PyResult<Py<PyAny>> {
        self.step()
    }

    /// As `__next__` (the first step of a coroutine is `send(None)`).
    #[pyo3(signature = (_value=None))]
    fn send(&mut self, _value: Option<&Bound<'_, PyAny>>) -> PyResult<Py<PyAny>> {
        self.step()
    }

    /// Raises what is thrown in: the call already ran, nothing is undone.
    #[pyo3(signature = (typ, val=None, _tb=None))]
    fn throw(
        &mut self,
        py: Python<'_>,
        typ: &Bound<'_, PyAny>,
        val: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        self.answer = None;
        let exc = match val {
            Some(v) if !v.is_none() => v.clone(),
            _ if typ.is_instance_of::<pyo3::types::PyType>() => typ.call0()?,
            _ => typ.clone(),
        };
        let _ = py;
        Err(PyErr::from_value(exc))
    }

    /// Drops the answer (an awaitable never awaited is not an error: the
    /// call already ran).
    fn close(&mut self) {
        self.answer = None;
    }
}

/// Runs a store call in place with the GIL released and returns its
/// answer as a [`Ready`] awaitable.
pub fn in_place<'py, F, T>(py: Python<'py>, fut: F) -> PyResult<Bound<'py, PyAny>>
where
    F: Future<Output = PyResult<T>> + Send,
    T: for<'a> IntoPyObject<'a> + Send,
{
    let answer = py.detach(|| block_on(fut));
    let answer = answer.and_then(|v| pyo3::IntoPyObjectExt::into_py_any(v, py));
    Ready::awaitable(py, answer)
}
