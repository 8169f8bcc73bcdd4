//! The store's injected clock.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::record::Millis;

/// Where the store reads `created_at` and `updated_at` from. Never used for
/// ordering: listings are ordered by the store's own `seq`.
pub trait Clock: Send + Sync + 'static {
    /// Milliseconds since the Unix epoch.
    fn now_millis(&self) -> Millis;
}

/// The system's wall clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_millis(&self) -> Millis {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
    }
}

/// A clock that moves only when told; for tests.
///
/// ```
/// use agentstate::{Clock, ManualClock};
/// let clock = ManualClock::new(1_000);
/// clock.advance(500);
/// assert_eq!(clock.now_millis(), 1_500);
/// ```
#[derive(Debug, Default)]
pub struct ManualClock(AtomicU64);

impl ManualClock {
    /// A clock reading `start`.
    pub fn new(start: Millis) -> Self {
        ManualClock(AtomicU64::new(start))
    }
    /// Sets the time.
    pub fn set(&self, t: Millis) {
        self.0.store(t, Ordering::SeqCst);
    }
    /// Moves the time forward.
    pub fn advance(&self, by: Millis) {
        self.0.fetch_add(by, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_millis(&self) -> Millis {
        self.0.load(Ordering::SeqCst)
    }
}

impl<C: Clock> Clock for std::sync::Arc<C> {
    fn now_millis(&self) -> Millis {
        (**self).now_millis()
    }
}
