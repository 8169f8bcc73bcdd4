//! The change feed (rules F1–F9): what changed since a position, in commit
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
/// before every change, in every scope. Its text (and JSON) is a decimal
/// number.
///
/// A position belongs to the scope and the store that handed it out (rule
/// F9): its top 32 bits are a tag of the two, its low 96 bits the place
/// in that feed. Any other position (of another scope or store, made by
/// hand, altered) is [`Invalid`](crate::StateError::Invalid) wherever a
/// store takes one; only [`Position::START`] is valid everywhere.
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

    /// A position from [`as_u128`](Self::as_u128) (one a store handed out
    /// and the consumer kept). A number that is not one the same store
    /// handed out for the same scope is `Invalid` there (F9), except 0,
    /// [`Position::START`].
    pub fn from_u128(n: u128) -> Self {
        Position([(n >> 64) as u64, n as u64])
    }

    /// A position made of two 64-bit parts, `hi` more significant:
    /// `from_u128((hi << 64) | lo)`. As with [`from_u128`](Self::from_u128),
    /// a hand-made position is `Invalid` unless it is one the same store
    /// handed out for the same scope (F9). Kept for compatibility: no
    /// backend builds its positions this way any more.
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

/// The bits of a [`Position`] below its tag: a backend's ordinal within
/// the scope (see [`bind`]).
pub const ORDINAL_BITS: u32 = 96;

/// The largest ordinal a [`Position`] carries: `2^96 - 1`.
pub const ORDINAL_MAX: u128 = (1 << ORDINAL_BITS) - 1;

/// Domain separation of the position key from every other use of the
/// store's secret (the cursor key, the horizon keys).
const POSITION_KEY_LABEL: &[u8] = b"agentstate feed position key v1\0";

/// The 16-byte SipHash key of positions derived from a store's secret.
fn derive(secret: &[u8; 16]) -> [u8; 16] {
    use sha2::{Digest, Sha256};
    let mut kdf = Sha256::new();
    kdf.update(POSITION_KEY_LABEL);
    kdf.update(secret);
    let derived = kdf.finalize();
    let mut key = [0u8; 16];
    key.copy_from_slice(&derived[..16]);
    key
}

std::thread_local! {
    /// The last secret this thread bound positions for and its derived
    /// key: a page binds a position per change, and a thread reads one
    /// store's feed far more often than it switches.
    static DERIVED: std::cell::Cell<Option<([u8; 16], [u8; 16])>> =
        const { std::cell::Cell::new(None) };
}

/// The 32-bit tag of a scope of the store whose secret this is (F9):
/// SipHash-2-4, under a key derived from the secret (SHA-256 of a label
/// and the secret, cut to 16 bytes), of the scope's kind and its name,
/// length-prefixed (so no two scopes share a byte string). Never 0, the
/// top of [`Position::START`]: a 0 is 1.
fn tag(secret: &[u8; 16], scope: &FeedScope) -> u32 {
    use std::hash::Hasher;
    let key = DERIVED.with(|d| match d.get() {
        Some((s, key)) if &s == secret => key,
        _ => {
            let key = derive(secret);
            d.set(Some((*secret, key)));
            key
        }
    });
    let mut h = siphasher::sip::SipHasher24::new_with_key(&key);
    let (kind, name): (u8, &str) = match scope.view() {
        ScopeView::Tenant(tenant) => (1, tenant),
        ScopeView::Trays(None) => (2, ""),
        ScopeView::Trays(Some(env)) => (3, env),
    };
    h.write_u8(kind);
    h.write(&(name.len() as u64).to_le_bytes());
    h.write(name.as_bytes());
    match (h.finish() >> 32) as u32 {
        0 => 1,
        t => t,
    }
}

/// The position of a backend's `ordinal` within `scope` (F9): the
/// scope's tag (of the store's `secret` and the scope) in the top 32
/// bits, the ordinal in the low 96. Ordinal 0 (before every change) is
/// [`Position::START`]. Positions of one scope are ordered as their
/// ordinals. `Corrupt` for an ordinal past [`ORDINAL_MAX`] (no backend's
/// counter gets there). Every backend makes its positions here.
pub fn bind(secret: &[u8; 16], scope: &FeedScope, ordinal: u128) -> Result<Position> {
    if ordinal == 0 {
        return Ok(Position::START);
    }
    if ordinal > ORDINAL_MAX {
        return Err(StateError::corrupt(format!(
            "feed position: ordinal {ordinal} of {scope} is past 2^{ORDINAL_BITS}"
        )));
    }
    Ok(Position::from_u128(
        (u128::from(tag(secret, scope)) << ORDINAL_BITS) | ordinal,
    ))
}

/// The backend's ordinal of a position given to a call on `scope` (F9):
/// 0 for [`Position::START`]; `Invalid` for a position this store did not
/// hand out for this scope (another scope's, another store's, or a
/// forged one: its tag is not the scope's). Every backend reads the
/// positions it is given here.
pub fn unbind(secret: &[u8; 16], scope: &FeedScope, p: Position) -> Result<u128> {
    let n = p.as_u128();
    if n == 0 {
        return Ok(0);
    }
    let top = (n >> ORDINAL_BITS) as u32;
    if top != tag(secret, scope) {
        return Err(StateError::invalid(format!(
            "feed position {p} is not one this store handed out for {scope}: it belongs to \
             another feed or another store, or was made by hand (start from 0 or feed_head)"
        )));
    }
    Ok(n & ORDINAL_MAX)
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

/// The change feed (rules F1–F9). Every backend implements it. Every
/// position it takes must be one the same store handed out for the same
/// scope, or [`Position::START`]: any other is `Invalid` (F9).
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

    #[test]
    fn positions_are_bound_to_their_scope_and_store() {
        let (s1, s2) = ([1u8; 16], [2u8; 16]);
        let scopes = [
            FeedScope::tenant("a"),
            FeedScope::tenant("b"),
            FeedScope::tenant(""),
            FeedScope::trays(),
            FeedScope::trays_in("a"),
            FeedScope::trays_in("b"),
            FeedScope::trays_in(""),
        ];
        for (i, scope) in scopes.iter().enumerate() {
            assert_eq!(bind(&s1, scope, 0).unwrap(), Position::START);
            assert_eq!(unbind(&s1, scope, Position::START).unwrap(), 0);
            let p = bind(&s1, scope, 42).unwrap();
            assert_ne!(p.as_u128() >> ORDINAL_BITS, 0);
            assert_eq!(unbind(&s1, scope, p).unwrap(), 42);
            // Ordered as the ordinals.
            assert!(bind(&s1, scope, 43).unwrap() > p);
            assert!(bind(&s1, scope, 1).unwrap() > Position::START);
            assert_eq!(
                unbind(&s1, scope, bind(&s1, scope, ORDINAL_MAX).unwrap()).unwrap(),
                ORDINAL_MAX
            );
            // Another store's.
            assert!(matches!(
                unbind(&s2, scope, p),
                Err(StateError::Invalid { .. })
            ));
            // Another scope's.
            for (j, other) in scopes.iter().enumerate() {
                if i != j {
                    assert!(
                        matches!(unbind(&s1, other, p), Err(StateError::Invalid { .. })),
                        "{scope} on {other}"
                    );
                }
            }
            // A tag bit flipped.
            for bit in ORDINAL_BITS..128 {
                let flipped = Position::from_u128(p.as_u128() ^ (1 << bit));
                assert!(unbind(&s1, scope, flipped).is_err(), "bit {bit}");
            }
            // Hand-made: no tag.
            assert!(unbind(&s1, scope, Position::from_u128(1)).is_err());
        }
        assert!(matches!(
            bind(&s1, &scopes[0], ORDINAL_MAX + 1),
            Err(StateError::Corrupt { .. })
        ));
        // No ambiguity between a tenant and an env of the same name, nor
        // between names that run into each other.
        assert_ne!(
            tag(&s1, &FeedScope::tenant("ab")),
            tag(&s1, &FeedScope::trays_in("ab"))
        );
    }
}
