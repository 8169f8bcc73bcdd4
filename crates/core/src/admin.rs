//! Operator functions every backend implements: listing sessions,
//! counting, checking, retention, export and import. The CLI runs over
//! these (and the two store traits) only, so it works on every backend.

use std::collections::BTreeMap;
#[cfg(feature = "native")]
use std::sync::Arc;

use crate::entry::Entry;
use crate::error::Result;
use crate::page::{Page, PageRequest, Pages};
use crate::record::{Millis, RunState, SessionRecord};

/// Operator functions: what an admin tool or a maintenance job needs, on
/// every backend (the CLI holds a `Box<dyn Store>`).
pub trait StoreAdmin: Send + Sync {
    /// One page of a tenant's sessions, in session-id order (byte order of
    /// the ids), with the L rules: every session that exists for the whole
    /// walk is visited exactly once, the last page has no cursor, and a
    /// cursor is bound to its tenant.
    fn list_sessions(&self, tenant: &str, page: &PageRequest) -> Result<Page<SessionRecord>>;
    /// True when the store holds no record of any kind.
    fn is_empty(&self) -> Result<bool>;
    /// Counts runs per tenant and state, sessions, trays and alarms.
    fn stats(&self) -> Result<StoreStats>;
    /// Walks every record and index entry and reports every inconsistency.
    /// Reading is all it does; run it on a quiet store.
    fn verify(&self) -> Result<VerifyReport>;
    /// Retention: deletes the tenant's finished runs (completed, failed,
    /// cancelled) last written before `finished_before` and returns how
    /// many. Never touches an unfinished run; safe while workers run.
    fn prune(&self, tenant: &str, finished_before: Millis) -> Result<u64>;
    /// Erasure (rule P1): deletes every record of `tenant` — runs (finished
    /// or not), sessions, budgets, holds, its counters and its idempotency
    /// keys — and returns how many runs, sessions, budgets and holds went.
    /// Trays are the instances' (their namespaces are not tenants) and stay.
    /// On the embedded stores one atomic step; on a server in bounded
    /// batches, each its own transaction or script: a purge cut short
    /// leaves part of the tenant, and calling it again finishes it. Writes
    /// to the tenant while it runs may survive it: stop its workers first.
    fn purge_tenant(&self, tenant: &str) -> Result<u64>;
    /// One page of every record of the store, for export: runs, sessions,
    /// epochs, trays, alarms, each in key order. Walk it with the cursor.
    fn export_page(&self, page: &PageRequest) -> Result<Page<Entry>>;
    /// Writes exported entries into an **empty** store (`Invalid`
    /// otherwise), keeping versions, `seq`s and timestamps, so export →
    /// import → export gives the same entries. Every entry meets the checks
    /// of a write (ids, sizes, scrubbing, a unique `seq` per tenant).
    /// Returns how many entries were imported. An error from the iterator
    /// stops the import and is returned.
    ///
    /// All or nothing: nothing of the import is visible until the iterator
    /// has ended and every entry passed its checks; after any error the
    /// store is exactly as it was (empty). A crash during an import leaves
    /// it empty or holding the whole import, never part of it.
    fn import(&self, entries: &mut dyn Iterator<Item = Result<Entry>>) -> Result<u64>;

    /// Every session of a tenant, page after page.
    fn iter_sessions<'a>(&'a self, tenant: &'a str) -> Pages<'a, SessionRecord> {
        Pages::new(move |req| self.list_sessions(tenant, req))
    }
    /// Every record of the store, in export order, page after page.
    fn iter_export(&self) -> Pages<'_, Entry> {
        Pages::new(move |req| self.export_page(req))
    }

    /// The store's async core, when it has one: how
    /// `AsyncStore::new` knows to await its calls
    /// natively in the caller's task. `None` (the default): its calls run
    /// on tokio's blocking pool, or in the caller's task when
    /// [`runs_in_caller`](StoreAdmin::runs_in_caller). The server backends
    /// (PostgreSQL, Redis) answer `Some(self)`. Not part of the API: it may
    /// change in any release.
    #[doc(hidden)]
    #[cfg(feature = "native")]
    fn async_core(self: Arc<Self>) -> Option<Arc<dyn crate::native::DynCore>> {
        None
    }

    /// True when no call of the store ever syncs, sleeps or waits on I/O,
    /// so `AsyncStore` runs its calls in the caller's
    /// task instead of on the blocking pool (W2 keeps only blocking work
    /// off the executor). `false` (the default); the memory store answers
    /// `true`. Not part of the API: it may change in any release.
    #[doc(hidden)]
    fn runs_in_caller(&self) -> bool {
        false
    }
}

/// What [`StoreAdmin::verify`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct VerifyReport {
    /// Runs checked.
    pub runs: u64,
    /// Sessions checked.
    pub sessions: u64,
    /// Trays checked.
    pub trays: u64,
    /// Alarms checked.
    pub alarms: u64,
    /// Engine entries read in all.
    pub entries: u64,
    /// Every inconsistency, one line each; empty when the store is sound.
    pub problems: Vec<String>,
}

impl VerifyReport {
    /// True when nothing was found wrong.
    pub fn is_ok(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Counts of one tenant.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct TenantStats {
    /// Runs per state.
    pub runs_by_state: BTreeMap<RunState, u64>,
    /// Sessions.
    pub sessions: u64,
    /// Named budgets (rule B1).
    pub budgets: u64,
    /// Live holds, at the store's clock now (rule B2).
    pub holds: u64,
    /// Runs at their cap: runs for which some cap, their own or their
    /// budget's, is reached (`spent + held >= max`), so a reserve asking
    /// for any of that amount is refused now. Counted from the committed
    /// state, not from a tally of refusals: a refused reserve changes
    /// nothing (B2, E6), not even a counter.
    pub runs_at_cap: u64,
}

/// What [`StoreAdmin::stats`] counted.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct StoreStats {
    /// Per tenant, in tenant order.
    pub tenants: BTreeMap<String, TenantStats>,
    /// Trays of all instances.
    pub trays: u64,
    /// Of which marked.
    pub marked_trays: u64,
    /// Alarms set.
    pub alarms: u64,
    /// Bytes on disk (0 in memory and on server backends).
    pub disk_bytes: u64,
    /// Which backend answered and what an `Ok` survives there, for
    /// operators (for example `file: fdatasync per commit group`).
    pub backend: String,
}
