//! The one place that picks synchronisation primitives: loom's under
//! `cfg(loom)` (so the models in `store::commit` and `engine::memory` explore
//! every interleaving), parking_lot's otherwise.

#[cfg(not(loom))]
mod imp {
    pub(crate) use std::sync::Arc;
    pub(crate) use std::sync::atomic::{AtomicBool, Ordering};

    /// A mutex whose `lock` cannot fail.
    #[derive(Debug, Default)]
    pub(crate) struct Mutex<T>(parking_lot::Mutex<T>);
    impl<T> Mutex<T> {
        pub(crate) fn new(t: T) -> Self {
            Mutex(parking_lot::Mutex::new(t))
        }
        pub(crate) fn lock(&self) -> parking_lot::MutexGuard<'_, T> {
            self.0.lock()
        }
    }

    /// A reader-writer lock whose `read`/`write` cannot fail.
    #[derive(Debug, Default)]
    pub(crate) struct RwLock<T>(parking_lot::RwLock<T>);
    impl<T> RwLock<T> {
        #[allow(dead_code)]
        pub(crate) fn new(t: T) -> Self {
            RwLock(parking_lot::RwLock::new(t))
        }
        pub(crate) fn read(&self) -> parking_lot::RwLockReadGuard<'_, T> {
            self.0.read()
        }
        pub(crate) fn write(&self) -> parking_lot::RwLockWriteGuard<'_, T> {
            self.0.write()
        }
    }

    /// A condition variable over [`Mutex`]'s guards, taking and giving the
    /// guard back by value (loom's shape).
    #[derive(Debug, Default)]
    pub(crate) struct Condvar(parking_lot::Condvar);
    impl Condvar {
        pub(crate) fn new() -> Self {
            Condvar(parking_lot::Condvar::new())
        }
        /// Blocks until notified.
        pub(crate) fn wait<'a, T>(
            &self,
            mut guard: parking_lot::MutexGuard<'a, T>,
        ) -> parking_lot::MutexGuard<'a, T> {
            self.0.wait(&mut guard);
            guard
        }
        /// Blocks until notified or `timeout` passed; `mutex` is the one
        /// `guard` locks (the loom shim needs it).
        pub(crate) fn wait_timeout<'a, T>(
            &self,
            _mutex: &'a Mutex<T>,
            mut guard: parking_lot::MutexGuard<'a, T>,
            timeout: std::time::Duration,
        ) -> parking_lot::MutexGuard<'a, T> {
            self.0.wait_for(&mut guard, timeout);
            guard
        }
        pub(crate) fn notify_one(&self) {
            self.0.notify_one();
        }
        pub(crate) fn notify_all(&self) {
            self.0.notify_all();
        }
    }
}

#[cfg(loom)]
#[allow(
    clippy::expect_used,
    reason = "loom models only: a poisoned lock means a model already panicked"
)]
mod imp {
    pub(crate) use loom::sync::Arc;
    pub(crate) use loom::sync::atomic::{AtomicBool, Ordering};

    /// loom's mutex behind the same surface as the parking_lot one.
    #[derive(Debug, Default)]
    pub(crate) struct Mutex<T>(loom::sync::Mutex<T>);
    impl<T> Mutex<T> {
        pub(crate) fn new(t: T) -> Self {
            Mutex(loom::sync::Mutex::new(t))
        }
        pub(crate) fn lock(&self) -> loom::sync::MutexGuard<'_, T> {
            // A poisoned lock means a model already panicked; surface it.
            self.0.lock().expect("loom mutex poisoned")
        }
    }

    /// loom's reader-writer lock behind the same surface.
    #[derive(Debug, Default)]
    pub(crate) struct RwLock<T>(loom::sync::RwLock<T>);
    impl<T> RwLock<T> {
        pub(crate) fn new(t: T) -> Self {
            RwLock(loom::sync::RwLock::new(t))
        }
        pub(crate) fn read(&self) -> loom::sync::RwLockReadGuard<'_, T> {
            self.0.read().expect("loom rwlock poisoned")
        }
        pub(crate) fn write(&self) -> loom::sync::RwLockWriteGuard<'_, T> {
            self.0.write().expect("loom rwlock poisoned")
        }
    }

    /// loom's condition variable behind the same surface.
    #[derive(Debug, Default)]
    pub(crate) struct Condvar(loom::sync::Condvar);
    impl Condvar {
        pub(crate) fn new() -> Self {
            Condvar(loom::sync::Condvar::new())
        }
        pub(crate) fn wait<'a, T>(
            &self,
            guard: loom::sync::MutexGuard<'a, T>,
        ) -> loom::sync::MutexGuard<'a, T> {
            self.0.wait(guard).expect("loom mutex poisoned")
        }
        /// loom does not model time, and its own `wait_timeout` never times
        /// out. A timeout may be as short as nothing, so this one lets go
        /// of the lock and takes it again: every other thread may run in
        /// between, which is all a timed-out wait promises.
        pub(crate) fn wait_timeout<'a, T>(
            &self,
            mutex: &'a Mutex<T>,
            guard: loom::sync::MutexGuard<'a, T>,
            _timeout: std::time::Duration,
        ) -> loom::sync::MutexGuard<'a, T> {
            drop(guard);
            loom::thread::yield_now();
            mutex.lock()
        }
        pub(crate) fn notify_one(&self) {
            self.0.notify_one();
        }
        pub(crate) fn notify_all(&self) {
            self.0.notify_all();
        }
    }
}

pub(crate) use imp::*;
