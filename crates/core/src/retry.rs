//! Read-modify-write that survives contention: [`StateStoreExt::update_run`]
//! re-reads on `Conflict` and calls the caller's edit again, with a bounded
//! number of attempts and jittered exponential backoff (the pattern of
//! Kubernetes' `RetryOnConflict` and etcd's STM), written once for every
//! backend.

use std::time::Duration;

use crate::api::StateStore;
use crate::error::{RecordKey, Result, StateError};
use crate::record::{RunKey, RunRecord};

/// How often and how patiently [`StateStoreExt::update_run_with`] retries.
///
/// In JSON the durations have serde's shape for `Duration`:
/// `{"attempts": 100, "base": {"secs": 0, "nanos": 1000000}, "max": {"secs": 0, "nanos": 50000000}}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RetryPolicy {
    /// Attempts in all, at least 1 (default 100).
    pub attempts: u32,
    /// The first backoff's upper bound (default 1 ms); it doubles after
    /// every conflict.
    pub base: Duration,
    /// The largest backoff (default 50 ms).
    pub max: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            attempts: 100,
            base: Duration::from_millis(1),
            max: Duration::from_millis(50),
        }
    }
}

impl RetryPolicy {
    /// The sleep before attempt `n + 1` (n ≥ 1): uniform in `[0, cap]`
    /// where `cap = min(max, base · 2^(n-1))` ("full jitter"), so writers
    /// that collided once do not collide again in step.
    pub fn backoff(&self, n: u32, seed: &mut u64) -> Duration {
        let cap = self
            .base
            .saturating_mul(1u32 << (n - 1).min(20))
            .min(self.max);
        // xorshift64*: plenty for spreading sleeps.
        *seed ^= *seed >> 12;
        *seed ^= *seed << 25;
        *seed ^= *seed >> 27;
        let r = seed.wrapping_mul(0x2545_F491_4F6C_DD1D);
        let nanos = cap.as_nanos() as u64;
        Duration::from_nanos(if nanos == 0 { 0 } else { r % (nanos + 1) })
    }
}

pub fn seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0),
    );
    h.finish() | 1
}

/// Read-modify-write helpers over any [`StateStore`] (also `dyn`).
pub trait StateStoreExt: StateStore {
    /// Reads the run, lets `edit` change it, and writes it with the version
    /// it read (rule R2). On `Conflict` it reads again and calls `edit`
    /// again, up to [`RetryPolicy::default`]'s attempts with jittered
    /// backoff; when it gives up it returns the last `Conflict`. An error
    /// from `edit` stops it and is returned as is; a missing run is
    /// `NotFound`. `edit` may run more than once: keep it free of side
    /// effects outside the record.
    ///
    /// ```
    /// use agentstate::{MemoryStore, RunKey, RunRecord, RunState, StateStore, StateStoreExt};
    /// let store = MemoryStore::new();
    /// let key = RunKey::new("acme", "run_1");
    /// store.put_run(RunRecord::new(key.clone(), "planner"))?;
    /// let run = store.update_run(&key, |run| {
    ///     run.state = RunState::Running;
    ///     Ok(())
    /// })?;
    /// assert_eq!((run.state, run.version), (RunState::Running, 2));
    /// # Ok::<(), agentstate::StateError>(())
    /// ```
    fn update_run<F>(&self, key: &RunKey, edit: F) -> Result<RunRecord>
    where
        F: FnMut(&mut RunRecord) -> Result<()>,
    {
        self.update_run_with(key, RetryPolicy::default(), edit)
    }

    /// [`update_run`](StateStoreExt::update_run) with its own retry policy.
    fn update_run_with<F>(
        &self,
        key: &RunKey,
        policy: RetryPolicy,
        mut edit: F,
    ) -> Result<RunRecord>
    where
        F: FnMut(&mut RunRecord) -> Result<()>,
    {
        let mut seed = seed();
        let attempts = policy.attempts.max(1);
        let mut n = 0;
        loop {
            n += 1;
            let Some(mut run) = self.get_run(key)? else {
                return Err(StateError::NotFound(RecordKey::Run(key.clone())));
            };
            edit(&mut run)?;
            match self.put_run(run) {
                Err(e @ StateError::Conflict { .. }) => {
                    if n >= attempts {
                        return Err(e);
                    }
                    std::thread::sleep(policy.backoff(n, &mut seed));
                }
                other => return other,
            }
        }
    }
}

impl<S: StateStore + ?Sized> StateStoreExt for S {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_stays_under_its_cap_and_grows() {
        let p = RetryPolicy::default();
        let mut s = 7;
        for n in 1..40 {
            let cap = p.base.saturating_mul(1u32 << (n - 1).min(20)).min(p.max);
            for _ in 0..50 {
                assert!(p.backoff(n, &mut s) <= cap);
            }
        }
        let mut mean = |n| {
            (0..200)
                .map(|_| p.backoff(n, &mut s).as_nanos())
                .sum::<u128>()
                / 200
        };
        let (early, late) = (mean(1), mean(8));
        assert!(early < late, "later backoffs are longer on average");
    }
}
