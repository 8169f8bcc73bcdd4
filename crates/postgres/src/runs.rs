//! Runs and sessions (rules R, S, L, X) as server transactions: read the
//! row `FOR UPDATE`, decide with `agentstate_core::rules`, write.
//!
//! **One round trip.** A read sends `BEGIN`, its `SELECT` and `COMMIT`
//! together. A `put_run` update or a `patch_run` on a run this store has
//! seen ([`Seen`]: the bytes it last read or wrote) decides against that
//! record, exactly as the locked path would, and sends `BEGIN`, an
//! `UPDATE … WHERE record = <the bytes it decided on>` and `COMMIT`
//! together: a compare-and-swap, so the write lands only on the record
//! it was decided against. No row changed (another writer came first, or
//! the run is gone): the entry is dropped and the call takes the locked
//! path. A refusal decided on a seen record is never answered from it
//! (the record may be stale): the locked path decides it again. Only calls
//! that write the run's row alone take the swap: a run with a budget or
//! caps, a create, and a keyed call take the locked path.

use std::sync::Arc;

use tokio_postgres::Row;
use tokio_postgres::types::ToSql;

use agentstate_core::codec::cursor::{self as cursor_codec, Listing};
use agentstate_core::codec::key::{KeyBuf, KeyReader};
use agentstate_core::codec::value;
use agentstate_core::error::{RecordKey, Result, StateError};
use agentstate_core::idempotency::{IdempotencyKey, Keyed};
use agentstate_core::page::{Page, PageRequest};
use agentstate_core::record::{
    Millis, RunKey, RunRecord, SessionKey, SessionRecord, StateDelta, StateQuery,
};
use agentstate_core::rules::{
    check_id, check_limit, check_record, check_run_key, check_session_key, check_size,
    check_version, created_run, next_session, patched_run, updated_run,
};

use agentstate_core::budget::BudgetKey;

use super::budgets::{after_patch, lock_budget};
use super::conn::{Tx, TxResult, params, txn};
use super::idempotency::txn_keyed;
use super::recent::{Recent, Shared};
use super::{Col, PostgresStore, fields, id_in, id_out, num, own};

/// Most runs a store remembers the bytes of.
const SEEN_MAX: usize = 8192;

/// The last stored bytes of each run a store read or wrote (a hint, see
/// the module's notes): a run's stored bytes and its seq column.
pub(crate) struct Seen(Shared<RunKey, (Arc<[u8]>, i64)>);

impl Default for Seen {
    fn default() -> Self {
        Seen(parking_lot::Mutex::new(Recent::new(
            SEEN_MAX,
            SEEN_BYTES_MAX,
        )))
    }
}

/// The most bytes the hint holds in all, and the largest record it keeps
/// (a larger one always takes the locked path): the hint's memory stays
/// small whatever the records' limit.
const SEEN_BYTES_MAX: usize = 16 << 20;
const SEEN_RECORD_MAX: usize = 64 << 10;

impl Seen {
    pub(crate) fn get(&self, k: &RunKey) -> Option<(Arc<[u8]>, i64)> {
        self.0.lock().get(k)
    }

    pub(crate) fn put(&self, k: &RunKey, bytes: Arc<[u8]>, seq: i64) {
        let mut m = self.0.lock();
        if bytes.len() > SEEN_RECORD_MAX {
            m.remove(k);
            return;
        }
        let w = bytes.len();
        m.insert(k.clone(), (bytes, seq), w);
    }

    /// The budget the run draws from, as last seen (fixed at create): a
    /// guess, checked against the run's locked row.
    pub(crate) fn budget_of(&self, k: &RunKey) -> Option<Option<String>> {
        let (bytes, _) = self.get(k)?;
        decode_run(&bytes, k).ok().map(|r| r.budget)
    }

    /// Remembers `r` as stored (by [`write_run`]).
    pub(crate) fn put_run(&self, r: &RunRecord) {
        if let Ok(seq) = seq_col(r.seq) {
            self.put(&r.key, stored_bytes(r).into(), seq);
        }
    }

    fn forget(&self, k: &RunKey) {
        self.0.lock().remove(k);
    }

    /// Forgets every run of `tenant` (a purge).
    pub(crate) fn forget_tenant(&self, tenant: &str) {
        self.0.lock().retain(|k| k.tenant != tenant);
    }
}

pub(crate) const LOCK_RUN: &str =
    "SELECT record, seq FROM {s}agentstate_runs WHERE tenant = $1 AND run_id = $2 FOR UPDATE";

const SELECT_RUN: &str =
    "SELECT record, seq FROM {s}agentstate_runs WHERE tenant = $1 AND run_id = $2";

/// A run's bytes as this store writes them: its seq is its row's `seq`
/// column, which a create's statement assigns on the server (one round
/// trip), so the record holds 0 there. Rows written before hold their
/// seq in both; [`decode_run_at`] reads either.
pub(crate) fn stored_bytes(r: &RunRecord) -> Vec<u8> {
    value::encode_run_at(r, 0)
}

/// Decodes a stored run under its row's `seq` column: the record's own
/// seq is 0 (written by [`stored_bytes`]) or, from an older build, the
/// same as the column; anything else is corruption.
pub(crate) fn decode_run_at(bytes: &[u8], key: &RunKey, seq: i64) -> Result<RunRecord> {
    let mut r = decode_run(bytes, key)?;
    let col = u64::try_from(seq)
        .map_err(|_| StateError::corrupt(format!("run {}: negative seq {seq}", key.run_id)))?;
    if r.seq != 0 && r.seq != col {
        return Err(StateError::corrupt(format!(
            "run {}: seq column {col} differs from the record's {}",
            key.run_id, r.seq
        )));
    }
    r.seq = col;
    Ok(r)
}

/// Decodes a stored run and checks it is the one asked for; its seq is
/// the record's (0 for this build's writes: [`decode_run_at`] gives the
/// column's). For reads that need no seq.
pub(crate) fn decode_run(bytes: &[u8], key: &RunKey) -> Result<RunRecord> {
    // Both run formats: uncapped runs as every earlier release wrote them.
    let r = value::decode_run(bytes)?;
    if &r.key != key {
        return Err(StateError::corrupt(format!(
            "run stored under {}/{} names another key",
            key.tenant, key.run_id
        )));
    }
    Ok(r)
}

pub(crate) fn decode_session(bytes: &[u8], key: &SessionKey) -> Result<SessionRecord> {
    let s = value::decode_session(bytes)?;
    if &s.key != key {
        return Err(StateError::corrupt("session stored under another key"));
    }
    Ok(s)
}

/// A seq as its column (bigint): ours never pass i64::MAX; an imported one
/// that does is refused.
pub(crate) fn seq_col(seq: u64) -> Result<i64> {
    i64::try_from(seq).map_err(|_| {
        StateError::invalid(format!(
            "seq {seq}: the PostgreSQL store keeps seqs up to {}",
            i64::MAX
        ))
    })
}

pub(crate) async fn read_run(
    tx: &mut Tx<'_>,
    key: &RunKey,
    lock: bool,
) -> TxResult<Option<RunRecord>> {
    let sql = if lock { LOCK_RUN } else { SELECT_RUN };
    let rows = tx
        .query(sql, &[&id_in(&key.tenant), &id_in(&key.run_id)])
        .await?;
    Ok(rows
        .first()
        .map(|r| decode_run_at(r.col(0)?, key, r.col(1)?))
        .transpose()?)
}

/// Writes a new run (`old` is `None`) or the next version of `old`, and
/// its label rows when its labels changed (R11).
pub(crate) async fn write_run(
    tx: &mut Tx<'_>,
    new: &RunRecord,
    old: Option<&RunRecord>,
    max: usize,
) -> TxResult<()> {
    let created = old.is_none();
    let bytes = stored_bytes(new);
    check_size("run record", bytes.len(), max)?;
    debug_assert!(
        decode_run_at(&bytes, &new.key, seq_col(new.seq).unwrap_or(0)).is_ok_and(|r| &r == new)
    );
    let k = &new.key;
    let state = new.state.as_str();
    let updated = num(new.updated_at);
    // Deferred: it goes out with the next statement or the COMMIT (its
    // failure, a racing create's key, is reported there).
    if created {
        let session = new.session_id.as_deref().map(|s| id_in(s).into_owned());
        tx.defer(
            "INSERT INTO {s}agentstate_runs \
             (tenant, run_id, seq, state, session_id, agent_name, updated_at, record, fields) \
             VALUES ($1, $2, $3, $4, $5, $6, $7::text::numeric, $8, $9::text::jsonb)",
            params![
                own(&k.tenant),
                own(&k.run_id),
                seq_col(new.seq)?,
                state,
                session,
                own(&new.agent_name),
                updated,
                bytes,
                fields::run_text(new),
            ],
        )
        .await?;
    } else {
        tx.defer(
            "UPDATE {s}agentstate_runs SET state = $3, agent_name = $4, \
             updated_at = $5::text::numeric, record = $6, fields = $7::text::jsonb \
             WHERE tenant = $1 AND run_id = $2",
            params![
                own(&k.tenant),
                own(&k.run_id),
                state,
                own(&new.agent_name),
                updated,
                bytes,
                fields::run_text(new),
            ],
        )
        .await?;
    }
    let was = old.map(|o| &o.labels);
    if was != Some(&new.labels) {
        write_labels(tx, new, created).await?;
    }
    Ok(())
}

/// A run's label rows' `label` and `value` columns: each label's key and
/// its value as canonical JSON text (R11).
fn label_rows(r: &RunRecord) -> (Vec<String>, Vec<String>) {
    r.labels
        .iter()
        .map(|(k, v)| (k.clone(), agentstate_core::labels::canonical(v)))
        .unzip()
}

/// Replaces a run's label rows (deferred, after its own row's write).
async fn write_labels(tx: &mut Tx<'_>, new: &RunRecord, created: bool) -> TxResult<()> {
    let k = &new.key;
    if !created {
        tx.defer(
            "DELETE FROM {s}agentstate_run_labels WHERE tenant = $1 AND run_id = $2",
            params![own(&k.tenant), own(&k.run_id)],
        )
        .await?;
    }
    if new.labels.is_empty() {
        return Ok(());
    }
    let (names, values) = label_rows(new);
    tx.defer(
        "INSERT INTO {s}agentstate_run_labels (tenant, label, value, seq, run_id) \
         SELECT $1, l, v, $3, $2 FROM unnest($4::text[], $5::text[]) AS u(l, v)",
        params![
            own(&k.tenant),
            own(&k.run_id),
            seq_col(new.seq)?,
            names,
            values
        ],
    )
    .await?;
    Ok(())
}

/// The tenant's next seq, taken in this transaction: the counter row stays
/// locked until commit, so the tenant's creates commit in seq order.
async fn next_seq(tx: &mut Tx<'_>, tenant: &str) -> TxResult<u64> {
    let rows = tx
        .query(
            "INSERT INTO {s}agentstate_counters AS c (tenant, next_seq) VALUES ($1, 2) \
         ON CONFLICT (tenant) DO UPDATE SET next_seq = c.next_seq + 1 \
         RETURNING next_seq - 1",
            &[&id_in(tenant)],
        )
        .await?;
    let seq: i64 = rows[0].col(0)?;
    Ok(u64::try_from(seq).map_err(|_| StateError::corrupt("negative seq counter"))?)
}

/// A run from a row of (run_id, record, seq).
fn run_of(row: &Row, tenant: &str) -> Result<RunRecord> {
    let run_id = id_out(row.col(0)?)?;
    decode_run_at(row.col(1)?, &RunKey::new(tenant, run_id), row.col(2)?)
}

impl PostgresStore {
    /// `put_run`, under `keyed`'s idempotency key when there is one.
    async fn put_run_with(&self, record: RunRecord, keyed: Option<Keyed<'_>>) -> Result<RunRecord> {
        check_record(&record)?;
        // X1: scrubbed before anything reaches the server.
        let record = self.opts.options.scrubber.scrub_run_owned(record);
        let now = self.now();
        let max = self.max();
        if keyed.is_none()
            && let Some(new) = self
                .swap_run(&record.key, |s| {
                    check_version(record.version, Some(s.version), || {
                        RecordKey::Run(record.key.clone())
                    })?;
                    updated_run(s, record.clone(), now)
                })
                .await?
        {
            return Ok(new);
        }
        if keyed.is_none()
            && record.version == 0
            && record.session_id.is_none()
            && record.budget.is_none()
            && let Some(new) = self.create_run_at_once(&record, now).await?
        {
            self.saw(&record.key, &Ok(new.clone()));
            return Ok(new);
        }
        let out = txn_keyed!(self, keyed, |tx| {
            let stored = read_run(tx, &record.key, true).await?;
            check_version(record.version, stored.as_ref().map(|s| s.version), || {
                RecordKey::Run(record.key.clone())
            })?;
            let new = match &stored {
                None => {
                    // R8: the session exists at create, and stays until
                    // this run commits (a cascade waits for the lock).
                    if let Some(s) = &record.session_id {
                        let found = tx
                            .query(
                                "SELECT 1 FROM {s}agentstate_sessions \
                             WHERE tenant = $1 AND session_id = $2 FOR KEY SHARE",
                                &[&id_in(&record.key.tenant), &id_in(s)],
                            )
                            .await?;
                        if found.is_empty() {
                            return Err(StateError::NotFound(RecordKey::Session(SessionKey::new(
                                record.key.tenant.clone(),
                                s.clone(),
                            )))
                            .into());
                        }
                    }
                    // B1: so does its budget; its row stays locked until
                    // commit, since what the run was created with is spent
                    // on it.
                    if let Some(b) = &record.budget {
                        let bk = BudgetKey::new(record.key.tenant.clone(), b.clone());
                        if lock_budget(tx, &bk).await?.is_none() {
                            return Err(StateError::NotFound(RecordKey::Budget(bk)).into());
                        }
                    }
                    let seq = next_seq(tx, &record.key.tenant).await?;
                    created_run(record.clone(), seq, now)
                }
                Some(s) => updated_run(s, record.clone(), now)?,
            };
            write_run(tx, &new, stored.as_ref(), max).await?;
            if stored.is_none() && new.budget.is_some() {
                // A run created with amounts already spent spends them on
                // its budget too.
                let delta = StateDelta {
                    usage: new.usage,
                    cost_micros: new.cost_micros,
                    iterations: new.iterations,
                    messages_read: 0,
                };
                after_patch(tx, &new, &delta, now).await?;
            }
            Ok(new)
        });
        self.saw(&record.key, &out);
        out
    }

    /// A create in one round trip: one statement takes the tenant's next
    /// seq (its counter row stays locked until the pipelined COMMIT, so
    /// the tenant's creates still commit in seq order), inserts the run
    /// under it (the record holds 0 there: [`stored_bytes`]) and its label
    /// rows. For a run with no session and no budget (whose checks and
    /// locks take the locked path). `None` when the run exists (or a racing
    /// create won): nothing was written but perhaps a seq skipped, and the
    /// locked path answers (a `Conflict`).
    async fn create_run_at_once(
        &self,
        record: &RunRecord,
        now: Millis,
    ) -> Result<Option<RunRecord>> {
        let mut new = created_run(record.clone(), 0, now);
        let bytes = stored_bytes(&new);
        if check_size("run record", bytes.len(), self.max()).is_err() {
            return Ok(None);
        }
        let cols = fields::run_text(&new);
        let (names, values) = label_rows(&new);
        let k = &new.key;
        let (tenant, run_id, agent) = (id_in(&k.tenant), id_in(&k.run_id), id_in(&new.agent_name));
        let (state, updated) = (new.state.as_str(), num(new.updated_at));
        let seq: Option<i64> = txn!(self, |tx| {
            let rows = tx
                .query_commit(
                    "WITH e AS (SELECT 1 FROM {s}agentstate_runs WHERE tenant = $1 AND run_id = $2), \
                     c AS (INSERT INTO {s}agentstate_counters AS c (tenant, next_seq) \
                           SELECT $1, 2 WHERE NOT EXISTS (SELECT 1 FROM e) \
                           ON CONFLICT (tenant) DO UPDATE SET next_seq = c.next_seq + 1 \
                           RETURNING next_seq - 1 AS seq), \
                     r AS (INSERT INTO {s}agentstate_runs \
                           (tenant, run_id, seq, state, session_id, agent_name, updated_at, record, fields) \
                           SELECT $1, $2, c.seq, $3, NULL, $4, $5::text::numeric, $6, $7::text::jsonb \
                           FROM c ON CONFLICT (tenant, run_id) DO NOTHING RETURNING seq), \
                     l AS (INSERT INTO {s}agentstate_run_labels (tenant, label, value, seq, run_id) \
                           SELECT $1, u.l, u.v, r.seq, $2 \
                           FROM r, unnest($8::text[], $9::text[]) AS u(l, v)) \
                     SELECT (SELECT seq FROM r)",
                    &[
                        &tenant, &run_id, &state, &agent, &updated, &bytes, &cols, &names,
                        &values,
                    ],
                    false,
                )
                .await?;
            Ok(match rows.first() {
                Some(r) => r.col::<_, Option<i64>>(0)?,
                None => None,
            })
        })?;
        Ok(seq.map(|seq| {
            new.seq = seq as u64;
            new
        }))
    }

    /// `patch_run`, under `keyed`'s idempotency key when there is one.
    async fn patch_run_with(
        &self,
        key: &RunKey,
        delta: StateDelta,
        keyed: Option<Keyed<'_>>,
    ) -> Result<RunRecord> {
        check_run_key(key)?;
        let now = self.now();
        let max = self.max();
        if keyed.is_none()
            && let Some(new) = self
                .swap_run(key, |old| patched_run(old, &delta, now))
                .await?
        {
            return Ok(new);
        }
        let out = txn_keyed!(self, keyed, |tx| {
            let Some(old) = read_run(tx, key, true).await? else {
                return Err(StateError::NotFound(RecordKey::Run(key.clone())).into());
            };
            // R4: the amounts are added inside the record (u64, checked),
            // never in a column that could wrap.
            let new = patched_run(&old, &delta, now)?;
            write_run(tx, &new, Some(&old), max).await?;
            // B6: a patch counts toward the caps' spent (the run's amounts
            // are the run's spent; its budget's is kept in the budget's
            // row) and never refuses.
            if new.budget.is_some() || !new.caps.is_none() {
                after_patch(tx, &new, &delta, now).await?;
            }
            Ok(new)
        });
        self.saw(key, &out);
        out
    }
}

impl PostgresStore {
    pub(super) async fn put_run(&self, record: RunRecord) -> Result<RunRecord> {
        self.put_run_with(record, None).await
    }
    pub(super) async fn put_run_idempotent(
        &self,
        record: RunRecord,
        key: &IdempotencyKey,
    ) -> Result<RunRecord> {
        let tenant = record.key.tenant.clone();
        let keyed = Keyed::put_run(&tenant, &record, key)?;
        self.put_run_with(record, Some(keyed)).await
    }

    pub(super) async fn get_run(&self, key: &RunKey) -> Result<Option<RunRecord>> {
        check_run_key(key)?;
        // One round trip: BEGIN, the SELECT and COMMIT together.
        let got = txn!(self, |tx| {
            let rows = tx
                .query_commit(
                    SELECT_RUN,
                    &[&id_in(&key.tenant), &id_in(&key.run_id)],
                    true,
                )
                .await?;
            Ok(rows
                .first()
                .map(|r| {
                    let (b, seq): (&[u8], i64) = (r.col(0)?, r.col(1)?);
                    decode_run_at(b, key, seq).map(|run| (run, Arc::<[u8]>::from(b), seq))
                })
                .transpose()?)
        })?;
        Ok(match got {
            Some((run, bytes, seq)) => {
                self.runs_seen.put(key, bytes, seq);
                Some(run)
            }
            None => {
                self.runs_seen.forget(key);
                None
            }
        })
    }

    /// Remembers what a write stored (or forgets the run, on a failure).
    fn saw(&self, key: &RunKey, out: &Result<RunRecord>) {
        match out {
            Ok(r) => self.runs_seen.put_run(r),
            Err(_) => self.runs_seen.forget(key),
        }
    }

    /// The one-round-trip write (see the module's notes): `next` decides
    /// against the run as this store last saw it, and the new record is
    /// swapped in only if the stored one is still that. `None`: not taken
    /// (nothing seen, a refusal, a budget or caps) or the swap missed;
    /// the caller takes the locked path.
    async fn swap_run(
        &self,
        key: &RunKey,
        next: impl FnOnce(&RunRecord) -> Result<RunRecord>,
    ) -> Result<Option<RunRecord>> {
        let Some((seen, seq)) = self.runs_seen.get(key) else {
            return Ok(None);
        };
        let Ok(old) = decode_run_at(&seen, key, seq) else {
            self.runs_seen.forget(key);
            return Ok(None);
        };
        let alone = |r: &RunRecord| r.budget.is_none() && r.caps.is_none();
        if !alone(&old) {
            return Ok(None);
        }
        let Ok(new) = next(&old) else {
            return Ok(None);
        };
        let bytes = stored_bytes(&new);
        // A change of labels rewrites the run's label rows too (R11).
        if !alone(&new)
            || new.labels != old.labels
            || new.key != *key
            || check_size("run record", bytes.len(), self.max()).is_err()
        {
            return Ok(None);
        }
        let (tenant, run_id) = (id_in(&key.tenant), id_in(&key.run_id));
        let (state, agent, updated) = (
            new.state.as_str(),
            id_in(&new.agent_name),
            num(new.updated_at),
        );
        let was: &[u8] = &seen;
        let cols = fields::run_text(&new);
        let swapped = txn!(self, |tx| {
            let rows = tx
                .query_commit(
                    "UPDATE {s}agentstate_runs SET state = $3, agent_name = $4, \
                     updated_at = $5::text::numeric, record = $6, fields = $8::text::jsonb \
                     WHERE tenant = $1 AND run_id = $2 AND record = $7 RETURNING 1",
                    &[
                        &tenant, &run_id, &state, &agent, &updated, &bytes, &was, &cols,
                    ],
                    false,
                )
                .await?;
            Ok(rows.len() == 1)
        })?;
        if swapped {
            self.runs_seen.put(key, bytes.into(), seq);
            Ok(Some(new))
        } else {
            agentstate_core::observe::fast_path_declined("postgres", "run_write");
            self.runs_seen.forget(key);
            Ok(None)
        }
    }

    pub(super) async fn patch_run(&self, key: &RunKey, delta: StateDelta) -> Result<RunRecord> {
        self.patch_run_with(key, delta, None).await
    }
    pub(super) async fn patch_run_idempotent(
        &self,
        key: &RunKey,
        delta: StateDelta,
        idempotency_key: &IdempotencyKey,
    ) -> Result<RunRecord> {
        let keyed = Keyed::patch_run(key, &delta, idempotency_key)?;
        self.patch_run_with(key, delta, Some(keyed)).await
    }

    pub(super) async fn list_runs(
        &self,
        q: &StateQuery,
        page: &PageRequest,
    ) -> Result<Page<RunRecord>> {
        check_id("tenant", &q.tenant)?;
        if let Some(s) = &q.session {
            check_id("session", s)?;
        }
        if let Some(a) = &q.agent {
            check_id("agent", a)?;
        }
        check_limit(page.limit)?;
        let secret = self.secret().await?;
        // A next page may name only the tenant: its cursor's filters (L7).
        let walk = agentstate_core::codec::cursor::runs_query(&secret, q, page)?;
        let q = &*walk;
        let binding = agentstate_core::codec::cursor::runs_binding(q);
        let after: i64 = match &page.cursor {
            None => 0,
            Some(c) => {
                let pos = cursor_codec::decode(&secret, Listing::Runs, &binding, c)?;
                let mut r = KeyReader::new(&pos, Listing::Runs as u8)?;
                let seq = r.u64()?;
                r.end()?;
                seq_col(seq).map_err(|_| StateError::invalid("cursor: bad position"))?
            }
        };
        // One statement per combination of filters, so each is planned on
        // the narrowest index: (tenant, session, seq), (tenant, state,
        // seq) or (tenant, seq) (L5).
        let tenant = id_in(&q.tenant);
        let session = q.session.as_deref().map(id_in);
        let state = q.state.map(|s| s.as_str());
        let agent = q.agent.as_deref().map(id_in);
        let before = q.updated_before.map(num);
        let label = q
            .label
            .as_ref()
            .map(|l| (l.key.as_str(), agentstate_core::labels::canonical(&l.value)));
        let limit = (page.limit + 1) as i64;
        // A label filter walks the label's rows, (tenant, label, value,
        // seq), joined to their runs (R11).
        let mut sql = String::from(match label {
            None => {
                "SELECT r.run_id, r.record, r.seq FROM {s}agentstate_runs r \
                 WHERE r.tenant = $1 AND r.seq > $2"
            }
            Some(_) => {
                "SELECT r.run_id, r.record, r.seq FROM {s}agentstate_run_labels l \
                 JOIN {s}agentstate_runs r ON r.tenant = l.tenant AND r.run_id = l.run_id \
                 WHERE l.tenant = $1 AND l.seq > $2 AND l.label = $4 AND l.value = $5"
            }
        });
        let mut params: Vec<&(dyn ToSql + Sync)> = vec![&tenant, &after, &limit];
        if let Some((k, v)) = &label {
            params.push(k);
            params.push(v);
        }
        let filters: [(&str, Option<&(dyn ToSql + Sync)>); 4] = [
            ("r.session_id = $", session.as_ref().map(|s| s as _)),
            ("r.state = $", state.as_ref().map(|s| s as _)),
            ("r.agent_name = $", agent.as_ref().map(|s| s as _)),
            ("r.updated_at < $", before.as_ref().map(|s| s as _)),
        ];
        for (i, (cond, p)) in filters.into_iter().enumerate() {
            if let Some(p) = p {
                params.push(p);
                let cast = if i == 3 { "::text::numeric" } else { "" };
                sql.push_str(&format!(" AND {cond}{}{cast}", params.len()));
            }
        }
        sql.push_str(match label {
            None => " ORDER BY r.seq LIMIT $3",
            Some(_) => " ORDER BY l.seq LIMIT $3",
        });
        let rows = txn!(self, |tx| {
            tx.reads_only();
            tx.query(&sql, &params).await
        })?;
        let more = rows.len() > page.limit;
        let mut items = Vec::with_capacity(page.limit);
        let mut last = 0u64;
        for row in rows.iter().take(page.limit) {
            let r = run_of(row, &q.tenant)?;
            last = r.seq;
            items.push(r);
        }
        let cursor = more.then(|| {
            let pos = KeyBuf::table(Listing::Runs as u8).u64(last).done();
            cursor_codec::encode(&secret, Listing::Runs, &binding, &pos)
        });
        Page::new(items, cursor)
    }

    pub(super) async fn put_session(&self, mut record: SessionRecord) -> Result<SessionRecord> {
        agentstate_core::rules::check_session(&record)?;
        self.opts
            .options
            .scrubber
            .scrub_session_in_place(&mut record);
        let now = self.now();
        let max = self.max();
        txn!(self, |tx| {
            let k = &record.key;
            let rows = tx
                .query(
                    "SELECT record FROM {s}agentstate_sessions \
                 WHERE tenant = $1 AND session_id = $2 FOR UPDATE",
                    &[&id_in(&k.tenant), &id_in(&k.session_id)],
                )
                .await?;
            let stored = rows
                .first()
                .map(|r| decode_session(r.col(0)?, k))
                .transpose()?;
            let new = next_session(stored.as_ref(), record.clone(), now)?;
            let bytes = value::encode_session(&new);
            check_size("session record", bytes.len(), max)?;
            // A create racing another create fails its insert on the key
            // and is tried again, when it sees the winner (S1).
            let sql = if stored.is_none() {
                "INSERT INTO {s}agentstate_sessions (tenant, session_id, record, fields) \
                 VALUES ($1, $2, $3, $4::text::jsonb)"
            } else {
                "UPDATE {s}agentstate_sessions SET record = $3, fields = $4::text::jsonb \
                 WHERE tenant = $1 AND session_id = $2"
            };
            let cols = fields::session_text(&new);
            tx.execute(
                sql,
                &[&id_in(&k.tenant), &id_in(&k.session_id), &bytes, &cols],
            )
            .await?;
            Ok(new)
        })
    }

    pub(super) async fn get_session(&self, key: &SessionKey) -> Result<Option<SessionRecord>> {
        check_session_key(key)?;
        txn!(self, |tx| {
            let rows = tx
                .query_commit(
                    "SELECT record FROM {s}agentstate_sessions \
                     WHERE tenant = $1 AND session_id = $2",
                    &[&id_in(&key.tenant), &id_in(&key.session_id)],
                    true,
                )
                .await?;
            Ok(rows
                .first()
                .map(|r| decode_session(r.col(0)?, key))
                .transpose()?)
        })
    }

    /// R10: the run read `FOR UPDATE`, the rule decided in Rust, the row
    /// deleted (its holds go with it: `ON DELETE CASCADE`).
    pub(super) async fn delete_run(
        &self,
        key: &RunKey,
        expected_version: Option<u64>,
    ) -> Result<RunRecord> {
        check_run_key(key)?;
        txn!(self, |tx| {
            let Some(old) = read_run(tx, key, true).await? else {
                return Err(StateError::NotFound(RecordKey::Run(key.clone())).into());
            };
            agentstate_core::rules::check_delete(&old, expected_version)?;
            self.runs_seen.forget(key);
            tx.execute(
                "DELETE FROM {s}agentstate_runs WHERE tenant = $1 AND run_id = $2",
                &[&id_in(&key.tenant), &id_in(&key.run_id)],
            )
            .await?;
            Ok(old)
        })
    }

    // Rule S2: the in-use check, decided here (each backend has its own
    // copy: docs/RULES.md). Rule S3: the cascade, in one transaction.
    pub(super) async fn delete_session(
        &self,
        key: &SessionKey,
        cascade: bool,
    ) -> Result<Vec<RunKey>> {
        check_session_key(key)?;
        let (tenant, sid) = (id_in(&key.tenant), id_in(&key.session_id));
        txn!(self, |tx| {
            let found = tx
                .query(
                    "SELECT 1 FROM {s}agentstate_sessions \
                 WHERE tenant = $1 AND session_id = $2 FOR UPDATE",
                    &[&tenant, &sid],
                )
                .await?;
            if found.is_empty() {
                return Err(StateError::NotFound(RecordKey::Session(key.clone())).into());
            }
            let rows = tx
                .query(
                    "SELECT run_id, record, seq FROM {s}agentstate_runs \
                 WHERE tenant = $1 AND session_id = $2 ORDER BY seq FOR UPDATE",
                    &[&tenant, &sid],
                )
                .await?;
            let runs = rows
                .iter()
                .map(|r| run_of(r, &key.tenant))
                .collect::<Result<Vec<_>>>()?;
            if !cascade {
                let live: Vec<RunKey> = runs
                    .iter()
                    .filter(|r| !r.state.is_finished())
                    .map(|r| r.key.clone())
                    .collect();
                if !live.is_empty() {
                    return Err(StateError::InUse {
                        record: RecordKey::Session(key.clone()),
                        runs: live,
                    }
                    .into());
                }
            } else {
                tx.execute(
                    "DELETE FROM {s}agentstate_runs WHERE tenant = $1 AND session_id = $2",
                    &[&tenant, &sid],
                )
                .await?;
            }
            tx.execute(
                "DELETE FROM {s}agentstate_sessions WHERE tenant = $1 AND session_id = $2",
                &[&tenant, &sid],
            )
            .await?;
            Ok(if cascade {
                runs.into_iter().map(|r| r.key).collect()
            } else {
                Vec::new()
            })
        })
    }
}
