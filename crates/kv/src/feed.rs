//! The change feed on the key-value store (rules F1–F9).
//!
//! One mechanism: the group commit's leader, after a group's jobs ran and
//! before the group is committed, looks at the group's writes of record
//! tables (runs, sessions, trays, alarms) and moves each written record's
//! one feed entry to a new position ([`note`]). Positions come from one
//! store-wide counter kept with the commit counters, taken in the leader,
//! and a group is one atomic engine batch committed after every group
//! before it: a reader that sees a position sees every smaller one, so no
//! commit is ever skipped (F4), with no lock beyond the commit path's own.
//!
//! Tables (see `key::table`):
//! - `FEED` (scope, position) → [`Entry`]: the record's key, and a run's
//!   id (a run's key is (tenant, seq); its tombstone names the run).
//! - `FEED_AT` (record key) → [`At`]: where the record's entry is, and
//!   what its tombstone needs once the record is gone.
//! - `FEED_HORIZON` (scope) → the position pruned through; an empty value
//!   in a group's writes asks the leader for a fresh position (a purge).
//!
//! A tray has a second entry, at the same position, in its env's feed.
//!
//! The counter's values are the positions' ordinals: a position handed
//! out is [`bind`] of the store's secret, the scope and the ordinal, and
//! one given to a call is read back with [`unbind`] (F9: another scope's,
//! another store's or a forged one is `Invalid`).

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::engine::Engine;
use crate::key::{meta, table};
use agentstate_core::codec::key::{KeyBuf, KeyReader, prefix_end};
use agentstate_core::codec::value;
use agentstate_core::error::{Result, StateError};
use agentstate_core::feed::{
    Change, ChangePage, Changed, FeedScope, FeedStore, Position, ScopeView, bind, check_call,
    unbind,
};
use agentstate_core::record::{RunKey, SessionKey};
use agentstate_core::tray::{Alarm, InstanceKey, Tray};

use super::KvStore;
use super::commit::{Overlay, Txn};

const SCOPE_TENANT: u8 = 1;
const SCOPE_TRAYS: u8 = 2;
const SCOPE_ENV: u8 = 3;

/// The records a prune or a backfill handles per group.
const CHUNK: usize = 1000;

/// A feed entry's value.
#[derive(Debug, Serialize, Deserialize)]
struct Entry {
    /// The record's key in its table.
    record: Vec<u8>,
    /// A run's id; empty otherwise.
    run_id: String,
}

/// [`Entry`] borrowed, for writing: the same encoding (postcard writes a
/// byte slice as it writes a `Vec<u8>`), without copying the key.
#[derive(Serialize)]
struct EntryRef<'a> {
    record: &'a [u8],
    run_id: &'a str,
}

/// A record's `FEED_AT` value.
#[derive(Debug, Serialize, Deserialize)]
struct At {
    position: u64,
    /// A run's id; empty otherwise.
    run_id: String,
    /// A tray's env (of its last write); empty otherwise.
    env: String,
}

/// The key prefix of a scope's entries.
fn scope_prefix(scope: &FeedScope) -> Vec<u8> {
    match scope.view() {
        ScopeView::Tenant(tenant) => tenant_prefix(tenant),
        ScopeView::Trays(None) => KeyBuf::table(table::FEED).u8(SCOPE_TRAYS).done(),
        ScopeView::Trays(Some(env)) => env_prefix(env),
    }
}

fn tenant_prefix(tenant: &str) -> Vec<u8> {
    KeyBuf::table(table::FEED)
        .u8(SCOPE_TENANT)
        .str(tenant)
        .done()
}

fn env_prefix(env: &str) -> Vec<u8> {
    KeyBuf::table(table::FEED).u8(SCOPE_ENV).str(env).done()
}

/// The horizon's key: an env's feed is pruned with the store's trays. A
/// tenant's horizon outlives a purge of the tenant, so its key holds no
/// byte of the tenant's name: a SHA-256 of the store's secret and the
/// name (P1: after a purge and a compaction, no byte of the tenant's ids
/// is on disk).
fn horizon_key(scope: &FeedScope, secret: &[u8; 16]) -> Vec<u8> {
    use sha2::{Digest, Sha256};
    match scope.view() {
        ScopeView::Tenant(tenant) => {
            let mut h = Sha256::new();
            h.update(b"agentstate feed horizon\0");
            h.update(secret);
            h.update(tenant.as_bytes());
            let mut k = vec![table::FEED_HORIZON, SCOPE_TENANT];
            k.extend_from_slice(&h.finalize()[..16]);
            k
        }
        ScopeView::Trays(_) => vec![table::FEED_HORIZON, SCOPE_TRAYS],
    }
}

/// A tenant's horizon key (for `purge_tenant`).
pub(crate) fn tenant_horizon_key(tenant: &str, secret: &[u8; 16]) -> Vec<u8> {
    horizon_key(&FeedScope::tenant(tenant), secret)
}

/// The key ranges `purge_tenant` deletes with a tenant: its feed and
/// where its records' entries are.
pub(crate) fn tenant_ranges(tenant: &str) -> [Vec<u8>; 3] {
    [
        tenant_prefix(tenant),
        KeyBuf::table(table::FEED_AT)
            .u8(table::RUN)
            .str(tenant)
            .done(),
        KeyBuf::table(table::FEED_AT)
            .u8(table::SESSION)
            .str(tenant)
            .done(),
    ]
}

fn entry_key(prefix: &[u8], position: u64) -> Vec<u8> {
    let mut k = Vec::with_capacity(prefix.len() + 8);
    k.extend_from_slice(prefix);
    k.extend_from_slice(&position.to_be_bytes());
    k
}

fn at_key(record: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(record.len() + 1);
    k.push(table::FEED_AT);
    k.extend_from_slice(record);
    k
}

/// The position at the end of an entry's key.
#[allow(
    clippy::expect_used,
    reason = "a slice cut to a fixed length by its range converts to an array of that length"
)]
fn position_of(key: &[u8]) -> Result<u64> {
    key.len()
        .checked_sub(8)
        .map(|i| u64::from_be_bytes(key[i..].try_into().expect("8 bytes")))
        .ok_or_else(|| StateError::corrupt("feed entry key truncated"))
}

/// The feed a record of this key belongs to (`None`: not a record).
fn record_scope(key: &[u8]) -> Result<Option<Vec<u8>>> {
    match key.first() {
        Some(&t) if t == table::RUN || t == table::SESSION => {
            // The tenant's component as the key holds it (escaped and
            // terminated) is what `tenant_prefix` writes.
            let end = key[1..]
                .windows(2)
                .position(|w| w == [0x00, 0x01])
                .ok_or_else(|| StateError::corrupt("record key's tenant not terminated"))?;
            let mut p = Vec::with_capacity(end + 5 + 8);
            p.extend_from_slice(&[table::FEED, SCOPE_TENANT]);
            p.extend_from_slice(&key[1..end + 3]);
            Ok(Some(p))
        }
        Some(&t) if t == table::TRAY || t == table::ALARM => {
            Ok(Some(KeyBuf::table(table::FEED).u8(SCOPE_TRAYS).done()))
        }
        _ => Ok(None),
    }
}

fn is_record_key(key: &[u8]) -> bool {
    matches!(key.first(), Some(&t) if t == table::RUN || t == table::SESSION || t == table::TRAY || t == table::ALARM)
}

/// In a group's leader, before the group commits: moves the entry of
/// every record the group wrote or deleted to a new position, taken from
/// `next`, and gives every horizon a purge asked for a position of its
/// own (before the group's entries). A purge deletes its records' entries
/// (`FEED_AT`) in its own job, so its deletes leave no tombstone.
///
/// A run whose seq is `new_runs_from` or later was created in the group:
/// it has no entry to move, and its `FEED_AT` is not read.
pub(crate) fn note(
    engine: &dyn Engine,
    overlay: &mut Overlay,
    next: &mut u64,
    new_runs_from: u64,
) -> Result<()> {
    let mut records = Vec::new();
    let mut purged = Vec::new();
    let mut bad = None;
    // A written record's run id (runs) and env (trays) are read here, from
    // the pending value, so no value is copied.
    overlay.for_each(|k, v| {
        if is_record_key(k) {
            match v.map(|v| identity(k, v)).transpose() {
                // Kept as its `FEED_AT` key: the record's key after a byte.
                Ok(id) => records.push((at_key(k), id)),
                Err(e) => bad = Some(e),
            }
        } else if k.first() == Some(&table::FEED_HORIZON) && v.is_some_and(|v| v.is_empty()) {
            purged.push(k.to_vec());
        }
    });
    if let Some(e) = bad {
        return Err(e);
    }
    if records.is_empty() && purged.is_empty() {
        return Ok(());
    }
    for h in &purged {
        overlay.insert(h.clone(), Some(value::encode(&*next)));
        *next += 1;
    }
    records.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    for (at, id) in records {
        let key = &at[1..];
        let Some(scope) = record_scope(key)? else {
            continue;
        };
        let created = key[0] == table::RUN && position_of(key)? >= new_runs_from;
        let old: Option<At> = match overlay.get(&at) {
            _ if created => None,
            Some(v) => v.clone(),
            None => engine.get(&at)?,
        }
        .map(|v| value::decode(&v, "feed position"))
        .transpose()?;
        let Some(old) = old else {
            // A record with no entry yet: a new one, or (deleted) one that
            // never had an entry because it was made and deleted in this
            // group: nothing to read, no tombstone.
            let Some((run_id, env)) = id else { continue };
            write(overlay, scope, at, run_id, env, next);
            continue;
        };
        overlay.insert(entry_key(&scope, old.position), None);
        if !old.env.is_empty() {
            overlay.insert(entry_key(&env_prefix(&old.env), old.position), None);
        }
        let (run_id, env) = id.unwrap_or((old.run_id, old.env));
        write(overlay, scope, at, run_id, env, next);
    }
    Ok(())
}

/// A written record's run id (runs) and env (trays).
fn identity(key: &[u8], v: &[u8]) -> Result<(String, String)> {
    match key[0] {
        t if t == table::RUN => Ok((value::run_id_of(v)?, String::new())),
        t if t == table::TRAY => {
            let tray: Tray = value::decode(v, "tray")?;
            Ok((String::new(), tray.env))
        }
        _ => Ok((String::new(), String::new())),
    }
}

/// `scope` (the scope's key prefix) becomes the new entry's key.
fn write(
    overlay: &mut Overlay,
    mut scope: Vec<u8>,
    at: Vec<u8>,
    run_id: String,
    env: String,
    next: &mut u64,
) {
    let position = *next;
    *next += 1;
    // `at` is the record's key after the `FEED_AT` byte.
    let entry = value::encode(&EntryRef {
        record: &at[1..],
        run_id: &run_id,
    });
    if !env.is_empty() {
        overlay.insert(entry_key(&env_prefix(&env), position), Some(entry.clone()));
    }
    scope.extend_from_slice(&position.to_be_bytes());
    overlay.insert(scope, Some(entry));
    overlay.insert(
        at,
        Some(value::encode(&At {
            position,
            run_id,
            env,
        })),
    );
}

/// Wakes the waiters of `wait_changes` after each commit.
///
/// A commit costs its writer one atomic add, and a lock and a wake-up
/// only while a waiter sleeps: a consumer busy reading the feed costs the
/// writers nothing. No wake-up is lost: a waiter counts itself asleep
/// before it looks at `commits` a last time, and a writer adds to
/// `commits` before it looks at `asleep` (both `SeqCst`), so one of the
/// two sees the other.
#[derive(Debug, Default)]
pub(crate) struct Wake {
    commits: std::sync::atomic::AtomicU64,
    asleep: std::sync::atomic::AtomicUsize,
    lock: std::sync::Mutex<()>,
    cv: std::sync::Condvar,
}

impl Wake {
    /// After a group committed.
    pub(crate) fn committed(&self) {
        use std::sync::atomic::Ordering::SeqCst;
        self.commits.fetch_add(1, SeqCst);
        if self.asleep.load(SeqCst) > 0 {
            // Taking the lock waits out a waiter between its last look and
            // its sleep.
            drop(self.lock.lock().unwrap_or_else(|e| e.into_inner()));
            self.cv.notify_all();
        }
    }

    fn seen(&self) -> u64 {
        self.commits.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits until a commit after `seen`, or `deadline`.
    fn wait(&self, seen: u64, deadline: Instant) {
        use std::sync::atomic::Ordering::SeqCst;
        let mut guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.asleep.fetch_add(1, SeqCst);
        while self.commits.load(SeqCst) == seen {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            guard = self
                .cv
                .wait_timeout(guard, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        self.asleep.fetch_sub(1, SeqCst);
    }
}

impl KvStore {
    fn horizon(&self, scope: &FeedScope) -> Result<u64> {
        self.engine
            .get(&horizon_key(scope, &self.secret))?
            .map(|v| value::decode(&v, "feed horizon"))
            .transpose()
            .map(|h| h.unwrap_or(0))
    }

    /// `FeedPruned` (naming the horizon as a position of `scope`) when
    /// the ordinal `after` is before the scope's horizon.
    fn check_horizon(&self, scope: &FeedScope, after: u64) -> Result<()> {
        let horizon = self.horizon(scope)?;
        if after < horizon {
            return Err(StateError::FeedPruned {
                scope: scope.clone(),
                horizon: self.bound(scope, horizon)?,
            });
        }
        Ok(())
    }

    /// The position of the ordinal `n` of `scope` (F9).
    fn bound(&self, scope: &FeedScope, n: u64) -> Result<Position> {
        bind(&self.secret, scope, u128::from(n))
    }

    /// The ordinal of a position given for `scope`: `Invalid` unless this
    /// store handed it out for `scope` (F9).
    fn ordinal(&self, scope: &FeedScope, p: Position) -> Result<u64> {
        u64::try_from(unbind(&self.secret, scope, p)?).map_err(|_| {
            StateError::invalid(format!(
                "feed position {p} is not one this store handed out for {scope}"
            ))
        })
    }

    /// The record an entry names, as it is now, or its tombstone.
    fn read_change(&self, e: &Entry) -> Result<Changed> {
        let now = self.engine.get(&e.record)?;
        let t = *e
            .record
            .first()
            .ok_or_else(|| StateError::corrupt("empty feed entry"))?;
        let mut r = KeyReader::new(&e.record, t)?;
        Ok(match (t, now) {
            (t, Some(v)) if t == table::RUN => Changed::Run {
                run: value::decode_run(&v)?,
            },
            (t, None) if t == table::RUN => Changed::RunDeleted {
                key: RunKey::new(r.str()?, e.run_id.clone()),
            },
            (t, Some(v)) if t == table::SESSION => Changed::Session {
                session: value::decode_session(&v)?,
            },
            (t, None) if t == table::SESSION => Changed::SessionDeleted {
                key: SessionKey::new(r.str()?, r.str()?),
            },
            (t, Some(v)) if t == table::TRAY => Changed::Tray {
                key: super::trays::read_tray_key(&mut r)?,
                tray: value::decode(&v, "tray")?,
            },
            (t, None) if t == table::TRAY => Changed::TrayDeleted {
                key: super::trays::read_tray_key(&mut r)?,
            },
            (t, Some(v)) if t == table::ALARM => Changed::Alarm {
                alarm: Alarm::new(
                    InstanceKey::new(r.str()?, r.str()?),
                    value::decode(&v, "alarm")?,
                ),
            },
            (t, None) if t == table::ALARM => Changed::AlarmDeleted {
                instance: InstanceKey::new(r.str()?, r.str()?),
            },
            _ => return Err(StateError::corrupt("feed entry names no record table")),
        })
    }

    /// `verify`'s feed checks: every record has its one entry (once the
    /// feed is filled), every entry is where its record's `FEED_AT` says,
    /// a tray's also in its env's feed, and no position is past the
    /// counter.
    pub(crate) fn verify_feed(&self, rep: &mut agentstate_core::admin::VerifyReport) -> Result<()> {
        let next = self.committer.counters().next_feed;
        let filled = self.engine.get(meta::FEED_FILLED)?.is_some();
        let mut problems = Vec::new();
        if filled {
            for (t, what) in [
                (table::RUN, "runs"),
                (table::SESSION, "sessions"),
                (table::TRAY, "trays"),
                (table::ALARM, "alarms"),
            ] {
                let mut missing = 0u64;
                self.walk(t, |k, _| {
                    if self.engine.get(&at_key(k))?.is_none() {
                        missing += 1;
                    }
                    Ok(())
                })?;
                if missing > 0 {
                    problems.push(format!("{missing} {what} have no change-feed entry"));
                }
            }
        }
        self.walk(table::FEED_AT, |k, v| {
            rep.entries += 1;
            let check = || -> Result<Option<String>> {
                let at: At = value::decode(v, "feed position")?;
                let record = &k[1..];
                let Some(scope) = record_scope(record)? else {
                    return Ok(Some("a feed position of no record table".into()));
                };
                if at.position >= next {
                    return Ok(Some(format!(
                        "a feed position {} past the counter {next}",
                        at.position
                    )));
                }
                let mut places = vec![entry_key(&scope, at.position)];
                if !at.env.is_empty() {
                    places.push(entry_key(&env_prefix(&at.env), at.position));
                }
                for place in places {
                    match self.engine.get(&place)? {
                        Some(e) if value::decode::<Entry>(&e, "feed entry")?.record == record => {}
                        _ => {
                            return Ok(Some(
                                "a record's feed entry is missing or names another".into(),
                            ));
                        }
                    }
                }
                Ok(None)
            };
            match check() {
                Ok(None) => {}
                Ok(Some(why)) => problems.push(why),
                Err(e) => problems.push(format!("feed: {e}")),
            }
            Ok(())
        })?;
        self.walk(table::FEED, |k, v| {
            rep.entries += 1;
            let check = || -> Result<bool> {
                let e: Entry = value::decode(v, "feed entry")?;
                let Some(at) = self.engine.get(&at_key(&e.record))? else {
                    return Ok(false);
                };
                Ok(value::decode::<At>(&at, "feed position")?.position == position_of(k)?)
            };
            if !matches!(check(), Ok(true)) {
                problems.push("a feed entry that is not its record's".to_string());
            }
            Ok(())
        })?;
        rep.problems.extend(problems);
        Ok(())
    }

    /// At the open of a store from before the feed: every record is
    /// written again (the same bytes) through the commit path, whose
    /// leader gives it a feed entry; then `meta::FEED_FILLED`. A crash
    /// part way leaves the flag unset and the next open fills again
    /// (moving the entries already made).
    pub(crate) fn fill_feed(&self) -> Result<()> {
        if self.engine.get(meta::FEED_FILLED)?.is_some() {
            return Ok(());
        }
        for t in [table::RUN, table::SESSION, table::TRAY, table::ALARM] {
            let end = [t + 1];
            let mut from = vec![t];
            loop {
                let rows = self.engine.scan(&from, &end, CHUNK)?;
                let Some((last, _)) = rows.last() else { break };
                from = agentstate_core::codec::key::successor(last);
                let n = rows.len();
                self.submit(move |txn: &mut Txn<'_>| {
                    for (k, v) in rows {
                        txn.put(k, v);
                    }
                    Ok(())
                })?;
                if n < CHUNK {
                    break;
                }
            }
        }
        self.submit(|txn: &mut Txn<'_>| {
            txn.put(meta::FEED_FILLED.to_vec(), value::encode(&true));
            Ok(())
        })
    }
}

impl FeedStore for KvStore {
    /// See [`FeedStore::changes`](agentstate_core::FeedStore::changes).
    fn changes(&self, scope: &FeedScope, after: Position, limit: usize) -> Result<ChangePage> {
        check_call(scope, limit, None)?;
        let after_n = self.ordinal(scope, after)?;
        self.check_horizon(scope, after_n)?;
        let Some(from) = after_n.checked_add(1) else {
            return Ok(ChangePage::new(Vec::new(), after));
        };
        let prefix = scope_prefix(scope);
        let rows = self
            .engine
            .scan(&entry_key(&prefix, from), &prefix_end(&prefix), limit)?;
        let mut changes = Vec::with_capacity(rows.len());
        let mut next = after;
        for (k, v) in rows {
            let position = self.bound(scope, position_of(&k)?)?;
            let entry: Entry = value::decode(&v, "feed entry")?;
            changes.push(Change::new(position, self.read_change(&entry)?));
            next = position;
        }
        // A prune that ran during the scan may have taken tombstones the
        // scan passed: say so rather than skip them.
        self.check_horizon(scope, after_n)?;
        Ok(ChangePage::new(changes, next))
    }

    /// See [`FeedStore::wait_changes`](agentstate_core::FeedStore::wait_changes).
    fn wait_changes(
        &self,
        scope: &FeedScope,
        after: Position,
        limit: usize,
        timeout: Duration,
    ) -> Result<ChangePage> {
        check_call(scope, limit, Some(timeout))?;
        // A foreign position is refused before any wait (F9).
        self.ordinal(scope, after)?;
        let deadline = Instant::now() + timeout;
        loop {
            let seen = self.feed_wake.seen();
            let page = self.changes(scope, after, limit)?;
            if !page.changes.is_empty() || Instant::now() >= deadline {
                return Ok(page);
            }
            self.feed_wake.wait(seen, deadline);
        }
    }

    /// See [`FeedStore::feed_head`](agentstate_core::FeedStore::feed_head).
    fn feed_head(&self, scope: &FeedScope) -> Result<Position> {
        check_call(scope, 1, None)?;
        let next = self.committer.counters().next_feed;
        self.bound(scope, next.saturating_sub(1))
    }

    /// See [`FeedStore::prune_changes`](agentstate_core::FeedStore::prune_changes).
    fn prune_changes(&self, scope: &FeedScope, through: Position) -> Result<u64> {
        check_call(scope, 1, None)?;
        if let FeedScope::Trays { env: Some(_) } = scope {
            return Err(StateError::invalid(
                "prune_changes: an env's feed is pruned with the store's trays (FeedScope::trays())",
            ));
        }
        let through = self.ordinal(scope, through)?;
        let head = self.committer.counters().next_feed.saturating_sub(1);
        let through = through.min(head);
        let prefix = scope_prefix(scope);
        let horizon = horizon_key(scope, &self.secret);
        let mut from = 1u64;
        let mut dropped = 0u64;
        loop {
            let (prefix, horizon) = (prefix.clone(), horizon.clone());
            let (n, last) = self.submit(move |txn: &mut Txn<'_>| {
                // The horizon first: from this group on, a reader from
                // before it is told, whatever is dropped after.
                let old = txn
                    .get(&horizon)?
                    .map(|v| value::decode::<u64>(&v, "feed horizon"))
                    .transpose()?
                    .unwrap_or(0);
                if through > old {
                    txn.put(horizon, value::encode(&through));
                }
                let rows = txn.scan(
                    &entry_key(&prefix, from),
                    &entry_key(&prefix, through.saturating_add(1)),
                    CHUNK,
                )?;
                let mut n = 0u64;
                let last = rows.last().map(|(k, _)| position_of(k)).transpose()?;
                for (k, v) in rows {
                    let e: Entry = value::decode(&v, "feed entry")?;
                    if txn.get(&e.record)?.is_some() {
                        continue;
                    }
                    let position = position_of(&k)?;
                    txn.delete(k);
                    let at = at_key(&e.record);
                    if let Some(a) = txn.get(&at)? {
                        let a: At = value::decode(&a, "feed position")?;
                        if a.position == position {
                            if !a.env.is_empty() {
                                txn.delete(entry_key(&env_prefix(&a.env), position));
                            }
                            txn.delete(at);
                        }
                    }
                    n += 1;
                }
                Ok((n, last))
            })?;
            dropped += n;
            match last {
                Some(p) if p < through => from = p + 1,
                _ => return Ok(dropped),
            }
        }
    }
}
