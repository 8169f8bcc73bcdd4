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
}

#[cfg(loom)]
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
}

pub(crate) use imp::*;
