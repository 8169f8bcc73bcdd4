//! The store traits every backend implements.

use crate::admin::StoreAdmin;
use crate::budget::BudgetStore;
use crate::error::Result;
use crate::feed::FeedStore;
use crate::idempotency::IdempotencyKey;
use crate::page::{Page, PageRequest, Pages};
use crate::record::{Millis, RunKey, RunRecord, SessionKey, SessionRecord, StateDelta, StateQuery};
use crate::tray::{Alarm, InstanceKey, MarkedTray, Tray, TrayFilter, TrayKey, TrayOp};

/// Runs and sessions (rules R, S, L, X, E).
pub trait StateStore: Send + Sync {
    /// Creates (`record.version == 0`) or updates (`version == n`, commits
    /// at n + 1) a run; returns the stored record (rule R2).
    fn put_run(&self, record: RunRecord) -> Result<RunRecord>;
    /// Reads a run.
    fn get_run(&self, key: &RunKey) -> Result<Option<RunRecord>>;
    /// Adds amounts to a run and bumps its version (rule R4).
    fn patch_run(&self, key: &RunKey, delta: StateDelta) -> Result<RunRecord>;
    /// [`put_run`](Self::put_run) under an idempotency key (rules I1–I3):
    /// applied at most once. A repeat of the key with the same record
    /// answers what the first call answered (the stored record, even after
    /// later writes moved the run on; or the same `Conflict`), never a
    /// `Conflict` against its own write; with another record it is
    /// `Invalid`.
    fn put_run_idempotent(&self, record: RunRecord, key: &IdempotencyKey) -> Result<RunRecord>;
    /// [`patch_run`](Self::patch_run) under an idempotency key (rules
    /// I1–I3): the amounts are added at most once, whatever failed and
    /// however often the call is retried; a repeat answers the record the
    /// first call returned.
    fn patch_run_idempotent(
        &self,
        key: &RunKey,
        delta: StateDelta,
        idempotency_key: &IdempotencyKey,
    ) -> Result<RunRecord>;
    /// Deletes a run (rule R10): at `Some(version)` when that is its stored
    /// version (`Conflict` otherwise), at `None` only when it is finished
    /// (`InUse` naming it otherwise: an unfinished run is deleted only by
    /// stating the version its owner last saw). Its index entries and live
    /// holds go with it; what it spent stays spent against its budget.
    /// Returns the record as it was; `NotFound` when there is none.
    fn delete_run(&self, key: &RunKey, expected_version: Option<u64>) -> Result<RunRecord>;
    /// One page of a tenant's runs in `seq` order (rules L1–L6).
    fn list_runs(&self, query: &StateQuery, page: &PageRequest) -> Result<Page<RunRecord>>;
    /// Creates or updates a session, versioned like a run (rule S1).
    fn put_session(&self, record: SessionRecord) -> Result<SessionRecord>;
    /// Reads a session.
    fn get_session(&self, key: &SessionKey) -> Result<Option<SessionRecord>>;
    /// Deletes a session; with `cascade` its runs too, atomically (S2, S3).
    /// Returns the runs deleted with it.
    fn delete_session(&self, key: &SessionKey, cascade: bool) -> Result<Vec<RunKey>>;

    /// Every run the query matches, page after page (the L2 walk).
    fn iter_runs<'a>(&'a self, query: &'a StateQuery) -> Pages<'a, RunRecord> {
        Pages::new(move |req| self.list_runs(query, req))
    }
}

/// Trays, epochs and alarms of pinned workers (rules T, A).
///
/// Every call that names an instance carries the caller's epoch: at or above
/// the stored epoch it advances it and runs; below it fails with
/// `FenceLost` and changes nothing.
pub trait TrayStore: Send + Sync {
    /// Reads one tray.
    fn read_tray(&self, key: &TrayKey, epoch: u64) -> Result<Option<Tray>>;
    /// Writes one tray.
    fn write_tray(&self, key: &TrayKey, epoch: u64, tray: Tray) -> Result<()>;
    /// Deletes one tray; true when it existed.
    fn delete_tray(&self, key: &TrayKey, epoch: u64) -> Result<bool>;
    /// Applies many writes and deletes of one instance, all or nothing (T3).
    fn apply_batch(&self, instance: &InstanceKey, epoch: u64, ops: Vec<TrayOp>) -> Result<()>;
    /// [`apply_batch`](Self::apply_batch) under an idempotency key,
    /// scoped by the instance's namespace (rules I1–I3): applied at most
    /// once; a repeat answers the first call's outcome (`Ok`, or the same
    /// `FenceLost`).
    fn apply_batch_idempotent(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        ops: Vec<TrayOp>,
        key: &IdempotencyKey,
    ) -> Result<()>;
    /// Unmarks every tray of the instance. Older epochs are a no-op (T4).
    fn release(&self, instance: &InstanceKey, epoch: u64) -> Result<()>;
    /// One page of an instance's trays, for hydration after a restart.
    fn list_trays(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        page: &PageRequest,
    ) -> Result<Page<(TrayKey, Tray)>>;
    /// Every tray of an instance that passes `filter`, in (tray_ns,
    /// tray_id) byte order, in one fenced call (rule T7): the fence as
    /// every tray call (T2: at or above the stored epoch advances it,
    /// below is `FenceLost` and changes nothing), then every matching tray
    /// from one snapshot taken after it, nothing paged. The alarm's row
    /// never appears (A4); the filter's `tray_ns` is an id (K1), so a bad
    /// one is `Invalid` and changes nothing. How a worker hydrates after a
    /// restart, and what pinned's `list(ns, id, epoch, tray_ns=, marked=)`
    /// is.
    ///
    /// The default pages [`list_trays`](Self::list_trays) at `epoch` with
    /// the largest page (`limits::PAGE_ITEMS_MAX`) and filters and sorts
    /// in the client: correct for a third-party backend (each page is
    /// fenced at the same epoch, so a newer holder stops it with
    /// `FenceLost`), but one snapshot per page, so a writer's batch
    /// landing between two pages can be seen in part. Every backend of
    /// this crate answers from one snapshot.
    fn instance_trays(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        filter: &TrayFilter,
    ) -> Result<Vec<(TrayKey, Tray)>> {
        filter.check()?;
        let mut out = Vec::new();
        let mut req = PageRequest::new(crate::limits::PAGE_ITEMS_MAX);
        loop {
            let (items, next) = self.list_trays(instance, epoch, &req)?.into_parts();
            out.extend(items.into_iter().filter(|(k, t)| filter.matches(k, t)));
            match next {
                Some(c) => req = PageRequest::new(crate::limits::PAGE_ITEMS_MAX).after(Some(&c)),
                None => break,
            }
        }
        crate::tray::sort_trays(&mut out);
        Ok(out)
    }
    /// The sweeper's listing: marked trays of all instances, optionally of
    /// one env (T5).
    fn marked_trays(&self, env: Option<&str>, page: &PageRequest) -> Result<Page<MarkedTray>>;
    /// The stored epoch of an instance (0 when none); reads only.
    fn epoch(&self, instance: &InstanceKey) -> Result<u64>;
    /// Sets the instance's one alarm, replacing any earlier one (A1).
    fn set_alarm(&self, instance: &InstanceKey, epoch: u64, due_at: Millis) -> Result<()>;
    /// Alarms due at `now`, in `(due_at, ns, id)` order (A2).
    fn due_alarms(&self, now: Millis, page: &PageRequest) -> Result<Page<Alarm>>;
    /// Removes the alarm if it is still the one due at `due_at`; true when it
    /// removed one (A3).
    fn ack_alarm(&self, instance: &InstanceKey, epoch: u64, due_at: Millis) -> Result<bool>;

    /// Every tray of an instance, page after page. Each page's read carries
    /// the epoch, so a walk by a fenced holder stops with `FenceLost`.
    fn iter_trays<'a>(
        &'a self,
        instance: &'a InstanceKey,
        epoch: u64,
    ) -> Pages<'a, (TrayKey, Tray)> {
        Pages::new(move |req| self.list_trays(instance, epoch, req))
    }
    /// Every marked tray (optionally of one env), page after page (T5).
    fn iter_marked_trays<'a>(&'a self, env: Option<&'a str>) -> Pages<'a, MarkedTray> {
        Pages::new(move |req| self.marked_trays(env, req))
    }
    /// Every alarm due at `now`, page after page (A2).
    fn iter_due_alarms(&self, now: Millis) -> Pages<'_, Alarm> {
        Pages::new(move |req| self.due_alarms(now, req))
    }
}

/// A whole backend: runs and sessions, trays, spend caps, and the operator
/// functions. The CLI and [`AsyncStore`](crate) hold one as
/// `Arc<dyn Store>`; every backend is one.
pub trait Store: StateStore + TrayStore + BudgetStore + StoreAdmin + FeedStore {}

impl<T: StateStore + TrayStore + BudgetStore + StoreAdmin + FeedStore + ?Sized> Store for T {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryStore;

    /// A backend with every tray call but `instance_trays`, which it takes
    /// from the trait's default.
    struct Paged(MemoryStore);

    impl TrayStore for Paged {
        fn read_tray(&self, key: &TrayKey, epoch: u64) -> Result<Option<Tray>> {
            self.0.read_tray(key, epoch)
        }
        fn write_tray(&self, key: &TrayKey, epoch: u64, tray: Tray) -> Result<()> {
            self.0.write_tray(key, epoch, tray)
        }
        fn delete_tray(&self, key: &TrayKey, epoch: u64) -> Result<bool> {
            self.0.delete_tray(key, epoch)
        }
        fn apply_batch(&self, instance: &InstanceKey, epoch: u64, ops: Vec<TrayOp>) -> Result<()> {
            self.0.apply_batch(instance, epoch, ops)
        }
        fn apply_batch_idempotent(
            &self,
            instance: &InstanceKey,
            epoch: u64,
            ops: Vec<TrayOp>,
            key: &IdempotencyKey,
        ) -> Result<()> {
            self.0.apply_batch_idempotent(instance, epoch, ops, key)
        }
        fn release(&self, instance: &InstanceKey, epoch: u64) -> Result<()> {
            self.0.release(instance, epoch)
        }
        fn list_trays(
            &self,
            instance: &InstanceKey,
            epoch: u64,
            page: &PageRequest,
        ) -> Result<Page<(TrayKey, Tray)>> {
            self.0.list_trays(instance, epoch, page)
        }
        fn marked_trays(&self, env: Option<&str>, page: &PageRequest) -> Result<Page<MarkedTray>> {
            self.0.marked_trays(env, page)
        }
        fn epoch(&self, instance: &InstanceKey) -> Result<u64> {
            self.0.epoch(instance)
        }
        fn set_alarm(&self, instance: &InstanceKey, epoch: u64, due_at: Millis) -> Result<()> {
            self.0.set_alarm(instance, epoch, due_at)
        }
        fn due_alarms(&self, now: Millis, page: &PageRequest) -> Result<Page<Alarm>> {
            self.0.due_alarms(now, page)
        }
        fn ack_alarm(&self, instance: &InstanceKey, epoch: u64, due_at: Millis) -> Result<bool> {
            self.0.ack_alarm(instance, epoch, due_at)
        }
    }

    /// The default `instance_trays` pages past `PAGE_ITEMS_MAX`, filters,
    /// sorts, fences at its epoch and checks the filter's id first,
    /// answering what a backend's own one-snapshot call answers.
    #[test]
    fn default_instance_trays_pages_filters_and_fences() {
        let s = Paged(MemoryStore::new());
        let i = InstanceKey::new("ns", "i");
        let ops = (0..2_500)
            .map(|n| TrayOp::Put {
                tray_ns: ["b", "a", "B", "a\0"][n % 4].to_string(),
                tray_id: format!("{}", n * 7 % 2_500),
                tray: Tray {
                    marked: n % 3 == 0,
                    doc: n.to_string().into_bytes(),
                    env: "e".into(),
                    hostname: "h".into(),
                },
            })
            .collect();
        s.apply_batch(&i, 2, ops).unwrap();
        s.set_alarm(&i, 2, 5).unwrap();
        for f in [
            TrayFilter::new(),
            TrayFilter::new().marked(true),
            TrayFilter::new().marked(false),
            TrayFilter::new().tray_ns("a"),
            TrayFilter::new().tray_ns("a\0").marked(true),
            TrayFilter::new().tray_ns("pinned"),
        ] {
            let got = s.instance_trays(&i, 2, &f).unwrap();
            assert_eq!(got, s.0.instance_trays(&i, 2, &f).unwrap(), "{f:?}");
            assert!(got.iter().all(|(k, t)| f.matches(k, t)), "{f:?}");
        }
        assert_eq!(
            s.instance_trays(&i, 2, &TrayFilter::new()).unwrap().len(),
            2_500
        );
        // The fence, at every page: below it `FenceLost`, above it moved.
        assert!(matches!(
            s.instance_trays(&i, 1, &TrayFilter::new()),
            Err(crate::StateError::FenceLost {
                caller: 1,
                stored: 2,
                ..
            })
        ));
        assert_eq!(
            s.instance_trays(&i, 4, &TrayFilter::new()).unwrap().len(),
            2_500
        );
        assert_eq!(s.epoch(&i).unwrap(), 4);
        // A bad filter is refused before the fence could move.
        assert!(matches!(
            s.instance_trays(&i, 9, &TrayFilter::new().tray_ns("")),
            Err(crate::StateError::Invalid { .. })
        ));
        assert_eq!(s.epoch(&i).unwrap(), 4);
    }
}
