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

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3_async_runtimes::TaskLocals;
use pyo3_async_runtimes::generic::{self, ContextExt, Runtime as GenericRuntime};
use tokio::runtime::Runtime;

static RUNTIME: Mutex<Option<(u32, &'static Runtime)>> = Mutex::new(None);

/// The runtime of this process, built on first use (and again after a fork).
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
        runtime().spawn(fut)
    }

    fn spawn_blocking<F>(f: F) -> Self::JoinHandle
    where
        F: FnOnce() + Send + 'static,
    {
        runtime().spawn_blocking(f)
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
