//! The store traits every backend implements.

use crate::cursor::Cursor;
use crate::error::Result;
use crate::record::{
    Millis, Page, RunKey, RunRecord, SessionKey, SessionRecord, StateDelta, StateQuery,
};
use crate::tray::{Alarm, InstanceKey, MarkedTray, Tray, TrayKey, TrayOp};

/// Runs and sessions (rules R, S, L, X, E).
pub trait StateStore: Send + Sync {
    /// Creates (`record.version == 0`) or updates (`version == n`, commits
    /// at n + 1) a run; returns the stored record (rule R2).
    fn put_run(&self, record: RunRecord) -> Result<RunRecord>;
    /// Reads a run.
    fn get_run(&self, key: &RunKey) -> Result<Option<RunRecord>>;
    /// Adds amounts to a run and bumps its version (rule R4).
    fn patch_run(&self, key: &RunKey, delta: StateDelta) -> Result<RunRecord>;
    /// One page of a tenant's runs in `seq` order (rules L1–L6).
    fn list_runs(&self, query: &StateQuery) -> Result<Page<RunRecord>>;
    /// Creates or updates a session, versioned like a run (rule S1).
    fn put_session(&self, record: SessionRecord) -> Result<SessionRecord>;
    /// Reads a session.
    fn get_session(&self, key: &SessionKey) -> Result<Option<SessionRecord>>;
    /// Deletes a session; with `cascade` its runs too, atomically (S2, S3).
    /// Returns the runs deleted with it.
    fn delete_session(&self, key: &SessionKey, cascade: bool) -> Result<Vec<RunKey>>;
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
    /// Unmarks every tray of the instance. Older epochs are a no-op (T4).
    fn release(&self, instance: &InstanceKey, epoch: u64) -> Result<()>;
    /// One page of an instance's trays, for hydration after a restart.
    fn list_trays(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        limit: usize,
        cursor: Option<&Cursor>,
    ) -> Result<Page<(TrayKey, Tray)>>;
    /// The sweeper's listing: marked trays of all instances, optionally of
    /// one env (T5).
    fn marked_trays(
        &self,
        env: Option<&str>,
        limit: usize,
        cursor: Option<&Cursor>,
    ) -> Result<Page<MarkedTray>>;
    /// The stored epoch of an instance (0 when none); reads only.
    fn epoch(&self, instance: &InstanceKey) -> Result<u64>;
    /// Sets the instance's one alarm, replacing any earlier one (A1).
    fn set_alarm(&self, instance: &InstanceKey, epoch: u64, due_at: Millis) -> Result<()>;
    /// Alarms due at `now`, in `(due_at, ns, id)` order (A2).
    fn due_alarms(&self, now: Millis, limit: usize, cursor: Option<&Cursor>)
    -> Result<Page<Alarm>>;
    /// Removes the alarm if it is still the one due at `due_at`; true when it
    /// removed one (A3).
    fn ack_alarm(&self, instance: &InstanceKey, epoch: u64, due_at: Millis) -> Result<bool>;
}
