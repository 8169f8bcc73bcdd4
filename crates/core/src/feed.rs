//! The change feed (rules F1–F8): what changed since a position, in commit
//! order, level-triggered, on every backend.
//!
//! A feed is one [`FeedScope`]: a tenant's runs and sessions, or the
//! store's trays and alarms (optionally one env's trays). Each record of
//! the scope has one entry in its feed, at the position of the last
//! commit that wrote or deleted it, so a record written ten times while a
//! consumer was away is read once, in its current state: a consumer any
//! distance behind catches up in time proportional to the records that
//! changed, not to the writes.
//!
//! ```
//! use agentstate::{FeedScope, FeedStore, MemoryStore, RunKey, RunRecord, StateStore};
//!
//! let store = MemoryStore::new();
//! let scope = FeedScope::tenant("acme");
//! // List-then-watch: take the head first, then read the current state
//! // (here: nothing), then follow the feed from the head.
//! let mut at = store.feed_head(&scope)?;
//! store.put_run(RunRecord::new(RunKey::new("acme", "r1"), "planner"))?;
//! let page = store.changes(&scope, at, 100)?;
//! assert_eq!(page.changes.len(), 1);
//! at = page.next;
//! assert!(store.changes(&scope, at, 100)?.changes.is_empty());
//! # Ok::<(), agentstate::StateError>(())
//! ```
//!
//! Deletes appear as tombstones ([`Changed::RunDeleted`], …), kept until
//! [`FeedStore::prune_changes`] drops them; a consumer whose position is
//! older than what was pruned gets [`StateError::FeedPruned`] (re-list and
//! follow on from the position it names), never a feed with a delete
//! missing.
//!
//! [`StateError::FeedPruned`]: crate::StateError::FeedPruned

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Result, StateError};
use crate::record::{RunKey, RunRecord, SessionKey, SessionRecord};
use crate::tray::{Alarm, InstanceKey, Tray, TrayKey};

/// Which feed (rule F3).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum FeedScope {
    /// One tenant's runs and sessions.
    Tenant {
        /// The tenant.
        tenant: String,
    },
    /// Every tray and alarm of the store; with `env`, only the trays whose
    /// last write (or, for a tombstone, the write before the delete) was in
    /// that env, and no alarms.
    Trays {
        /// Only this env's trays.
        env: Option<String>,
    },
}

/// A [`FeedScope`] as a backend matches on it. `FeedScope` is
/// `#[non_exhaustive]`, so a backend crate's `match` on it would need a
/// wildcard arm; on this view a new kind of scope is a compile error in
/// every backend until it handles it. Not part of the API.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScopeView<'a> {
    /// [`FeedScope::Tenant`].
    Tenant(&'a str),
    /// [`FeedScope::Trays`], with its env if it names one.
    Trays(Option<&'a str>),
}

impl FeedScope {
    /// The scope as a backend matches on it (see [`ScopeView`]).
    #[doc(hidden)]
    pub fn view(&self) -> ScopeView<'_> {
        match self {
            FeedScope::Tenant { tenant } => ScopeView::Tenant(tenant),
            FeedScope::Trays { env } => ScopeView::Trays(env.as_deref()),
        }
    }

    /// A tenant's runs and sessions.
    pub fn tenant(tenant: impl Into<String>) -> Self {
        FeedScope::Tenant {
            tenant: tenant.into(),
        }
    }

    /// Every tray and alarm of the store.
    pub fn trays() -> Self {
        FeedScope::Trays { env: None }
    }

    /// One env's trays.
    pub fn trays_in(env: impl Into<String>) -> Self {
        FeedScope::Trays {
            env: Some(env.into()),
        }
    }
}

impl fmt::Display for FeedScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FeedScope::Tenant { tenant } => write!(f, "tenant {tenant:?}"),
            FeedScope::Trays { env: None } => f.write_str("trays"),
            FeedScope::Trays { env: Some(env) } => write!(f, "trays of env {env:?}"),
        }
    }
}

/// A point in one scope's feed: every change is at a position, and a
/// consumer keeps the position it has read up to. Positions of one scope
/// of one store are ordered; compare no others. [`Position::START`] is
/// before every change. Its text (and JSON) is a decimal number.
// Two u64s, high first (ordered as the u128), not a u128: its 16-byte
// alignment would grow `StateError`, which holds one in `FeedPruned`, past
// clippy's `result_large_err` bound.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Position([u64; 2]);

impl Position {
    /// Before every change.
    pub const START: Position = Position([0, 0]);

    /// The position as a number (for storing it beside the consumer's own
    /// state).
    pub fn as_u128(self) -> u128 {
        (u128::from(self.0[0]) << 64) | u128::from(self.0[1])
    }

    /// A position from [`as_u128`](Self::as_u128).
    pub fn from_u128(n: u128) -> Self {
        Position([(n >> 64) as u64, n as u64])
    }

    /// A position made of two 64-bit parts, `hi` more significant (a
    /// server's transaction id and the change's number within it).
    pub fn from_parts(hi: u64, lo: u64) -> Self {
        Position([hi, lo])
    }

    /// The two 64-bit parts of [`from_parts`](Self::from_parts).
    pub fn parts(self) -> (u64, u64) {
        (self.0[0], self.0[1])
    }
}

impl fmt::Debug for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Position({})", self.as_u128())
    }
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.as_u128(), f)
    }
}

impl FromStr for Position {
    type Err = StateError;

    fn from_str(s: &str) -> Result<Self> {
        // One spelling per position: no sign, no leading zeros.
        if s.is_empty()
            || !s.bytes().all(|b| b.is_ascii_digit())
            || (s.len() > 1 && s.starts_with('0'))
        {
            return Err(StateError::invalid(format!(
                "feed position {s:?} is not a decimal number"
            )));
        }
        s.parse::<u128>()
            .map(Position::from_u128)
            .map_err(|_| StateError::invalid(format!("feed position {s:?} is out of range")))
    }
}

impl Serialize for Position {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Position {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// What a change is: a record's current state, or a tombstone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Changed {
    /// A run, as it is now.
    Run {
        /// The run.
        run: RunRecord,
    },
    /// A run was deleted.
    RunDeleted {
        /// Which run.
        key: RunKey,
    },
    /// A session, as it is now.
    Session {
        /// The session.
        session: SessionRecord,
    },
    /// A session was deleted.
    SessionDeleted {
        /// Which session.
        key: SessionKey,
    },
    /// A tray, as it is now.
    Tray {
        /// Which tray.
        key: TrayKey,
        /// The tray.
        tray: Tray,
    },
    /// A tray was deleted (or released with its instance).
    TrayDeleted {
        /// Which tray.
        key: TrayKey,
    },
    /// An instance's alarm, as it is now.
    Alarm {
        /// The alarm.
        alarm: Alarm,
    },
    /// An instance's alarm was acknowledged or released.
    AlarmDeleted {
        /// Whose alarm.
        instance: InstanceKey,
    },
}

impl Changed {
    /// Whether this is a tombstone.
    pub fn is_delete(&self) -> bool {
        matches!(
            self,
            Changed::RunDeleted { .. }
                | Changed::SessionDeleted { .. }
                | Changed::TrayDeleted { .. }
                | Changed::AlarmDeleted { .. }
        )
    }
}

/// One change: a record's state (or tombstone) and the position of the
/// last commit that wrote it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Change {
    /// Where in the feed.
    pub position: Position,
    /// What changed.
    #[serde(flatten)]
    pub item: Changed,
}

impl Change {
    /// A change at a position.
    pub fn new(position: Position, item: Changed) -> Self {
        Change { position, item }
    }
}

/// A page of a feed: changes in position order, and where the next page
/// starts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ChangePage {
    /// The changes, positions strictly increasing.
    pub changes: Vec<Change>,
    /// The `after` of the next call: the position of the last change read
    /// (or skipped by a filter), or the `after` given when there was none.
    pub next: Position,
}

impl ChangePage {
    /// A page.
    pub fn new(changes: Vec<Change>, next: Position) -> Self {
        ChangePage { changes, next }
    }
}

/// The longest [`FeedStore::wait_changes`] waits (rule K).
pub const FEED_WAIT_MAX: Duration = Duration::from_secs(600);

/// The change feed (rules F1–F8). Every backend implements it.
pub trait FeedStore: Send + Sync {
    /// Up to `limit` changes of `scope` after position `after`, in
    /// position order (F1, F2). Each record appears once, in its current
    /// state, at the position of its last change; a page is empty only
    /// when nothing is after `after`. `FeedPruned` when tombstones after
    /// `after` may have been pruned (F6).
    fn changes(&self, scope: &FeedScope, after: Position, limit: usize) -> Result<ChangePage>;

    /// Like [`changes`](Self::changes), but when nothing is after `after`
    /// waits up to `timeout` for a commit that changes the scope, and
    /// returns as soon as one has (F5). At the timeout, an empty page with
    /// `next == after`. Across processes on the server backends.
    fn wait_changes(
        &self,
        scope: &FeedScope,
        after: Position,
        limit: usize,
        timeout: Duration,
    ) -> Result<ChangePage>;

    /// A position such that every change committed after this call is
    /// after it (F7): take it before listing the current state, then
    /// follow the feed from it. A change committed before the call may
    /// still be read after it (on a server, while older transactions were
    /// open), in the record's current state.
    fn feed_head(&self, scope: &FeedScope) -> Result<Position>;

    /// Drops the tombstones of `scope` at or before `through` and moves
    /// the scope's horizon there: from then on, `changes` after a position
    /// before `through` is `FeedPruned` (F6). Returns how many tombstones
    /// were dropped. Records that exist keep their entries.
    fn prune_changes(&self, scope: &FeedScope, through: Position) -> Result<u64>;
}

/// The tenant a scope names, for a call's span.
pub fn tenant_of(scope: &FeedScope) -> Option<&str> {
    match scope {
        FeedScope::Tenant { tenant } => Some(tenant),
        FeedScope::Trays { .. } => None,
    }
}

/// Checks a feed call's arguments (F8): the scope's names, the page's
/// limit and the wait.
pub fn check_call(scope: &FeedScope, limit: usize, timeout: Option<Duration>) -> Result<()> {
    match scope {
        FeedScope::Tenant { tenant } => crate::rules::check::check_id("tenant", tenant)?,
        FeedScope::Trays { env: Some(env) } => crate::rules::check::check_id("env", env)?,
        FeedScope::Trays { env: None } => {}
    }
    crate::rules::check::check_limit(limit)?;
    if let Some(t) = timeout
        && t > FEED_WAIT_MAX
    {
        return Err(StateError::invalid(format!(
            "wait of {t:?} is longer than the longest wait, {FEED_WAIT_MAX:?}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_have_one_spelling() {
        assert_eq!("0".parse::<Position>().unwrap(), Position::START);
        let p = Position::from_parts(7, 3);
        assert_eq!(p.to_string().parse::<Position>().unwrap(), p);
        assert_eq!(p.parts(), (7, 3));
        assert_eq!(p.as_u128(), (7 << 64) | 3);
        assert_eq!(Position::from_u128(p.as_u128()), p);
        assert!(Position::from_parts(7, u64::MAX) < Position::from_parts(8, 0));
        assert_eq!(format!("{p:?}"), format!("Position({})", p.as_u128()));
        for bad in [
            "",
            "01",
            "-1",
            "+1",
            "1.0",
            " 1",
            "340282366920938463463374607431768211456",
        ] {
            assert!(bad.parse::<Position>().is_err(), "{bad:?}");
        }
        assert_eq!(serde_json::to_string(&p).unwrap(), format!("\"{p}\""));
    }
}
