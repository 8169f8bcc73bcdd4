//! The async core of the server backends, and the two ways it is called.
//!
//! A server backend (PostgreSQL, Redis) implements every call once, as an
//! `async fn` of [`AsyncCore`] over its native async client. Then:
//!
//! - `AsyncStore` awaits those futures in the caller's
//!   own task, through the object-safe [`DynCore`] (one boxed future per
//!   call; no thread hop, no `spawn_blocking`);
//! - the synchronous traits ([`StateStore`](crate::StateStore) and the
//!   rest) are `sync_over_async!` impls that drive the same future to
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

use crate::error::{Result, StateError};

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

    #[allow(
        clippy::expect_used,
        reason = "the runtime lives until the bridge is dropped"
    )]
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
    ///
    /// While `fut` runs, [`on_blocking_caller`] is true on this thread:
    /// nothing else runs on it until `fut` is done, so a backend may do
    /// its I/O on this thread with a blocking socket (no hop to the
    /// runtime's thread and back).
    pub fn block_on<F: Future>(&self, fut: F) -> F::Output {
        let _entered = self.handle().enter();
        let _blocking = BlockingCaller::enter();
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

thread_local! {
    /// Whether this thread is in [`Bridge::block_on`].
    static BLOCKING_CALLER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// True while this thread drives a synchronous call through
/// [`Bridge::block_on`]: the thread waits for that call alone, so a
/// backend may read and write a socket of its own on it, blocking,
/// rather than hand the call to its runtime's thread and be woken with
/// the answer (two thread hops a command). False on a runtime's threads
/// and in `AsyncStore`'s calls, which must never block.
pub fn on_blocking_caller() -> bool {
    BLOCKING_CALLER.with(std::cell::Cell::get)
}

/// Sets [`on_blocking_caller`] for its life, then puts back what was
/// there (a `block_on` inside another).
struct BlockingCaller(bool);

impl BlockingCaller {
    fn enter() -> BlockingCaller {
        BlockingCaller(BLOCKING_CALLER.with(|b| b.replace(true)))
    }
}

impl Drop for BlockingCaller {
    fn drop(&mut self) {
        let was = self.0;
        BLOCKING_CALLER.with(|b| b.set(was));
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

/// Declares [`AsyncCore`] and [`DynCore`] from the list of calls.
macro_rules! declare_cores {
    (
        []
        $(
            $trait:ident {
                $(
                    $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) -> $answer:ty,
                    tenant: $tenant:expr;
                )*
            }
        )*
    ) => {
        /// Every call of the data traits and `list_sessions` as an `async
        /// fn` (the list in `calls.rs`): what a server backend implements
        /// once, with [`impl_async_core!`](crate::impl_async_core). Same
        /// names, arguments and rules as the synchronous traits.
        pub trait AsyncCore: Send + Sync {
            /// The store's runtime, for the synchronous impls.
            fn bridge(&self) -> &Bridge;
            $($(
                #[doc = concat!("`", stringify!($trait), "::", stringify!($name), "`, awaited.")]
                fn $name<'a>(
                    &'a self,
                    $($arg: $ty),*
                ) -> impl Future<Output = Result<$answer>> + Send + 'a;
            )*)*
        }

        /// [`AsyncCore`] as a trait object, for `AsyncStore`: every backend
        /// with an async core is one, through the blanket impl, and hands
        /// itself out as one from
        /// [`StoreAdmin::async_core`](crate::StoreAdmin::async_core).
        #[allow(clippy::too_many_arguments)]
        pub trait DynCore: Send + Sync {
            $($(
                #[doc = concat!("`", stringify!($trait), "::", stringify!($name), "`, boxed.")]
                fn $name<'a>(&'a self, $($arg: $ty),*) -> BoxFut<'a, $answer>;
            )*)*
        }

        impl<T: AsyncCore> DynCore for T {
            $($(
                fn $name<'a>(&'a self, $($arg: $ty),*) -> BoxFut<'a, $answer> {
                    Box::pin(AsyncCore::$name(self, $($arg),*))
                }
            )*)*
        }
    };
}

/// A boxed call of [`DynCore`].
pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = Result<T>> + Send + 'a>>;

crate::for_each_call!(declare_cores, []);

/// A server backend `$t`, from its inherent `async fn`s (one per call of
/// the list in `calls.rs`, same name and arguments) and its field
/// `bridge: Bridge`:
///
/// - its [`AsyncCore`]: each call the inherent one, inside a span and
///   metrics as backend `$backend` (`observe`);
/// - its synchronous `StateStore`, `FeedStore`, `TrayStore` and
///   `BudgetStore`: each call the async one, driven by
///   [`Bridge::block_on`]. (`StoreAdmin` stays the backend's own.)
///
/// A call the backend lacks is a compile error naming it (an `async fn`
/// cannot await itself). Not part of the API.
#[doc(hidden)]
#[macro_export]
macro_rules! impl_async_core {
    ($t:ty, $backend:literal) => {
        $crate::for_each_call!($crate::__impl_async_core, [$t, $backend]);
        $crate::for_each_call!($crate::__data_traits, [bridge, $t]);
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __impl_async_core {
    (
        [$t:ty, $backend:literal]
        $(
            $trait:ident {
                $(
                    $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) -> $answer:ty,
                    tenant: $tenant:expr;
                )*
            }
        )*
    ) => {
        impl $crate::native::AsyncCore for $t {
            fn bridge(&self) -> &$crate::native::Bridge {
                &self.bridge
            }
            $($(
                async fn $name<'a>(&'a self, $($arg: $ty),*) -> $crate::Result<$answer> {
                    let span = $crate::observe::span($backend, stringify!($name), $tenant);
                    let call = <$t>::$name(self, $($arg),*);
                    $crate::observe::instrument(span, $backend, stringify!($name), call).await
                }
            )*)*
        }
    };
}

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
