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
/// functions. The CLI and `AsyncStore` hold one as
/// `Arc<dyn Store>`; every backend is one.
pub trait Store: StateStore + TrayStore + BudgetStore + StoreAdmin + FeedStore {}

impl<T: StateStore + TrayStore + BudgetStore + StoreAdmin + FeedStore + ?Sized> Store for T {}
