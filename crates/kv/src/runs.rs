//! Runs: versioned puts, commuting patches, listings (rules R, L, X).

use crate::key::table;
use agentstate_core::api::StateStore;
use agentstate_core::codec::cursor::Listing;
use agentstate_core::codec::key::{KeyBuf, prefix_end};
use agentstate_core::codec::value;
use agentstate_core::error::{RecordKey, Result, StateError};
use agentstate_core::idempotency::{IdempotencyKey, Keyed};
use agentstate_core::page::{Page, PageRequest};
use agentstate_core::record::{
    Millis, RunKey, RunRecord, RunState, SessionKey, SessionRecord, StateDelta, StateQuery,
};
use agentstate_core::rules::{
    check_record, check_run_key, check_version, created_run_in_place, patched_run, updated_run,
};
use serde::{Deserialize, Serialize};

use super::budgets::{after_patch, budget_key};
use super::commit::Txn;
use super::{KvStore, check_id, check_limit, check_size};
use agentstate_core::budget::BudgetKey;

// The keys a run write makes are sized for their strings (see
// `KeyBuf::sized`): a map holds four of them per run.

/// Where a run's record is: (tenant, seq).
pub(crate) fn run_key(tenant: &str, seq: u64) -> Vec<u8> {
    KeyBuf::sized(table::RUN, tenant.len() + 2 + 8)
        .str(tenant)
        .u64(seq)
        .done()
}
/// The run id map's key: (tenant, run_id) → seq.
pub(crate) fn run_id_key(k: &RunKey) -> Vec<u8> {
    KeyBuf::sized(table::RUN_ID, k.tenant.len() + 2 + k.run_id.len() + 2)
        .str(&k.tenant)
        .str(&k.run_id)
        .done()
}

/// Where `get_run` last found runs: id-map key → seq. A hint, never an
/// answer: a run's record is read at the hinted seq and used only when it
/// is there and names the run asked for. That is the answer the id map
/// would give at that moment, because the record at (tenant, seq) and the
/// id-map entry pointing at it are written and deleted in one batch, and a
/// seq is never given to a second run. A hint gone stale (the run was
/// deleted, or deleted and created again under a new seq) finds no record,
/// or another run's, and the read takes the id map. So a hint needs no
/// invalidation, and a hot run's read skips the id-map lookup, which for a
/// run created before the last flush is a table read (filter, index
/// partition, data block: about half of a `get_run`'s instructions).
///
/// Bounded: at [`SEQ_HINTS_MAX`] entries the map starts again empty.
#[derive(Debug, Default)]
pub(crate) struct SeqHints(crate::sync::Mutex<std::collections::HashMap<Vec<u8>, u64>>);

/// The most hints kept (a few hundred KiB at most).
pub(crate) const SEQ_HINTS_MAX: usize = 4096;

impl SeqHints {
    pub(crate) fn get(&self, id_key: &[u8]) -> Option<u64> {
        self.0.lock().get(id_key).copied()
    }

    pub(crate) fn note(&self, id_key: Vec<u8>, seq: u64) {
        let mut map = self.0.lock();
        if map.len() >= SEQ_HINTS_MAX && !map.contains_key(&id_key) {
            map.clear();
        }
        map.insert(id_key, seq);
    }

    /// How many hints are kept.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.0.lock().len()
    }
}

pub(crate) fn by_state_key(tenant: &str, state: RunState, seq: u64) -> Vec<u8> {
    KeyBuf::sized(table::RUN_BY_STATE, tenant.len() + 2 + 1 + 8)
        .str(tenant)
        .u8(state.tag())
        .u64(seq)
        .done()
}
pub(crate) fn by_session_key(tenant: &str, session: &str, seq: u64) -> Vec<u8> {
    KeyBuf::table(table::RUN_BY_SESSION)
        .str(tenant)
        .str(session)
        .u64(seq)
        .done()
}
pub(crate) fn by_touch_key(tenant: &str, state: RunState, updated_at: Millis, seq: u64) -> Vec<u8> {
    KeyBuf::sized(table::RUN_BY_TOUCH, tenant.len() + 2 + 1 + 8 + 8)
        .str(tenant)
        .u8(state.tag())
        .u64(updated_at)
        .u64(seq)
        .done()
}
/// The label index's key of a run's label `key` = `value` (its canonical
/// text).
pub(crate) fn by_label_key(tenant: &str, key: &str, value: &str, seq: u64) -> Vec<u8> {
    by_label_prefix(tenant, key, value).u64(seq).done()
}
fn by_label_prefix(tenant: &str, key: &str, value: &str) -> KeyBuf {
    KeyBuf::sized(
        table::RUN_BY_LABEL,
        tenant.len() + key.len() + value.len() + 6 + 8,
    )
    .str(tenant)
    .str(key)
    .str(value)
}

/// A run's label index keys.
pub(crate) fn label_keys(r: &RunRecord) -> Vec<Vec<u8>> {
    r.labels
        .iter()
        .map(|(k, v)| {
            by_label_key(
                &r.key.tenant,
                k,
                &agentstate_core::labels::canonical(v),
                r.seq,
            )
        })
        .collect()
}

pub(crate) fn session_key(k: &SessionKey) -> Vec<u8> {
    KeyBuf::table(table::SESSION)
        .str(&k.tenant)
        .str(&k.session_id)
        .done()
}

/// What a listing filters on, kept in the session index and in the state
/// index of finished states, so a page skips a run that does not match
/// without reading its record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RunSummary {
    pub(crate) state: RunState,
    pub(crate) agent_name: String,
    pub(crate) session_id: Option<String>,
    pub(crate) updated_at: Millis,
}

impl RunSummary {
    pub(crate) fn of(r: &RunRecord) -> RunSummary {
        RunSummary {
            state: r.state,
            agent_name: r.agent_name.clone(),
            session_id: r.session_id.clone(),
            updated_at: r.updated_at,
        }
    }

    fn matches(&self, q: &StateQuery) -> bool {
        answers(
            q,
            self.state,
            self.session_id.as_deref(),
            &self.agent_name,
            self.updated_at,
        )
    }
}

/// True when a run of these fields answers `q`: the one filter check of
/// records and summaries alike.
fn answers(
    q: &StateQuery,
    state: RunState,
    session_id: Option<&str>,
    agent_name: &str,
    updated_at: Millis,
) -> bool {
    q.state.is_none_or(|s| s == state)
        && q.session.as_deref().is_none_or(|s| session_id == Some(s))
        && q.agent.as_deref().is_none_or(|a| agent_name == a)
        && q.updated_before.is_none_or(|t| updated_at < t)
}

/// True when `r` answers `q`.
fn run_matches(q: &StateQuery, r: &RunRecord) -> bool {
    answers(
        q,
        r.state,
        r.session_id.as_deref(),
        &r.agent_name,
        r.updated_at,
    ) && q
        .label
        .as_ref()
        .is_none_or(|l| r.labels.get(&l.key) == Some(&l.value))
}

/// A run's id-map key: all of a write that does not depend on what the
/// store holds, so a caller builds it in its own thread before its job is
/// queued.
pub(crate) struct RunKeys {
    id: Vec<u8>,
}

impl RunKeys {
    pub(crate) fn of(k: &RunKey) -> RunKeys {
        RunKeys { id: run_id_key(k) }
    }
}

/// Something a run's writes go to: a job's view of the store, or the
/// plain batch of the format upgrade.
pub(crate) trait Writes {
    fn put(&mut self, key: Vec<u8>, value: Vec<u8>);
    fn delete(&mut self, key: Vec<u8>);
}

impl Writes for Txn<'_> {
    fn put(&mut self, key: Vec<u8>, value: Vec<u8>) {
        Txn::put(self, key, value);
    }
    fn delete(&mut self, key: Vec<u8>) {
        Txn::delete(self, key);
    }
}

impl Writes for Vec<crate::engine::Write> {
    fn put(&mut self, key: Vec<u8>, value: Vec<u8>) {
        self.push((key, Some(value)));
    }
    fn delete(&mut self, key: Vec<u8>) {
        self.push((key, None));
    }
}

/// The seq a run id maps to.
pub(crate) fn decode_seq(bytes: &[u8]) -> Result<u64> {
    value::decode(bytes, "run id map entry")
}

/// Reads and checks a stored run.
pub(crate) fn read_run(txn: &Txn<'_>, key: &RunKey) -> Result<Option<RunRecord>> {
    read_run_at(txn, &run_id_key(key), key)
}

/// Reads and checks the run the id-map entry `at` points at.
fn read_run_at(txn: &Txn<'_>, at: &[u8], key: &RunKey) -> Result<Option<RunRecord>> {
    // The hint's record, when it is this run's, is the answer in this
    // job's view too: each job writes a run's record and id-map entry
    // together (see `SeqHints`).
    if let Some(seq) = txn.seq_hint(at)
        && let Some(bytes) = txn.get(&run_key(&key.tenant, seq))?
    {
        let r = decode_run_at(&bytes, &key.tenant, seq)?;
        if &r.key == key {
            return Ok(Some(r));
        }
    }
    let Some(seq) = txn.get(at)? else {
        return Ok(None);
    };
    let seq = decode_seq(&seq)?;
    let bytes = txn.get(&run_key(&key.tenant, seq))?.ok_or_else(|| {
        StateError::corrupt(format!(
            "run {}/{} maps to seq {seq}, which holds no record",
            key.tenant, key.run_id
        ))
    })?;
    let r = decode_run_at(&bytes, &key.tenant, seq)?;
    if &r.key != key {
        return Err(StateError::corrupt(format!(
            "run {}/{} maps to seq {seq}, which holds run {}",
            key.tenant, key.run_id, r.key.run_id
        )));
    }
    txn.note_seq(at, seq);
    Ok(Some(r))
}

/// Reads the run stored at (tenant, seq) in a job.
pub(crate) fn read_run_by_seq(txn: &Txn<'_>, tenant: &str, seq: u64) -> Result<Option<RunRecord>> {
    txn.get(&run_key(tenant, seq))?
        .map(|v| decode_run_at(&v, tenant, seq))
        .transpose()
}

/// Decodes a run stored under (tenant, seq) and checks it names them.
pub(crate) fn decode_run_at(bytes: &[u8], tenant: &str, seq: u64) -> Result<RunRecord> {
    let r = value::decode_run(bytes)?;
    if r.key.tenant != tenant || r.seq != seq {
        return Err(StateError::corrupt(format!(
            "run stored at {tenant}/seq {seq} names {}/seq {}",
            r.key.tenant, r.seq
        )));
    }
    Ok(r)
}

/// The value of a run's state-index entry: the record itself while its
/// state is unfinished, its summary once finished.
pub(crate) fn state_entry(r: &RunRecord, bytes: &[u8]) -> Vec<u8> {
    if r.state.is_finished() {
        value::encode(&RunSummary::of(r))
    } else {
        bytes.to_vec()
    }
}

/// Writes a run and the index entries it needs; `old` is what was stored.
/// `keys` are `new.key`'s.
pub(crate) fn write_run(
    txn: &mut impl Writes,
    old: Option<&RunRecord>,
    new: &RunRecord,
    max: usize,
    keys: RunKeys,
) -> Result<()> {
    let bytes = value::encode_run(new);
    check_size("run record", bytes.len(), max)?;
    debug_assert!(decode_run_at(&bytes, &new.key.tenant, new.seq).is_ok_and(|r| &r == new));
    debug_assert!(keys.id == run_id_key(&new.key));
    debug_assert!(old.is_none_or(|o| o.seq == new.seq && o.key == new.key));
    let t = &new.key.tenant;
    let seq = new.seq;
    if old.is_none() {
        txn.put(keys.id, value::encode(&seq));
    }
    // The state index: moved when the state changes, rewritten always
    // (it holds the record, or a summary with `updated_at`).
    if let Some(o) = old
        && o.state != new.state
    {
        txn.delete(by_state_key(t, o.state, seq));
    }
    txn.put(by_state_key(t, new.state, seq), state_entry(new, &bytes));
    if let Some(o) = old
        && let Some(s) = &o.session_id
        && o.session_id != new.session_id
    {
        txn.delete(by_session_key(t, s, seq));
    }
    if let Some(s) = &new.session_id {
        txn.put(
            by_session_key(t, s, seq),
            value::encode(&RunSummary::of(new)),
        );
    }
    let touch = |r: &RunRecord| {
        (!r.state.is_finished()).then(|| by_touch_key(t, r.state, r.updated_at, seq))
    };
    let (was, now) = (old.and_then(touch), touch(new));
    if was != now {
        if let Some(k) = was {
            txn.delete(k);
        }
        if let Some(k) = now {
            txn.put(k, value::encode(&()));
        }
    }
    // The label index: touched only when the labels change (a patch never
    // changes them).
    if old.is_none_or(|o| o.labels != new.labels) {
        let was = old.map(label_keys).unwrap_or_default();
        let now = label_keys(new);
        for k in was.iter().filter(|k| !now.contains(k)) {
            txn.delete(k.clone());
        }
        for k in now.into_iter().filter(|k| !was.contains(k)) {
            txn.put(k, value::encode(&()));
        }
    }
    txn.put(run_key(t, seq), bytes);
    Ok(())
}

/// Deletes a run, its index entries and its holds (what it spent stays
/// spent against its budget).
pub(crate) fn delete_run(txn: &mut Txn<'_>, old: &RunRecord) -> Result<()> {
    super::budgets::delete_run_holds(txn, old)?;
    let t = &old.key.tenant;
    txn.delete(run_key(t, old.seq));
    txn.delete(run_id_key(&old.key));
    txn.delete(by_state_key(t, old.state, old.seq));
    if let Some(s) = &old.session_id {
        txn.delete(by_session_key(t, s, old.seq));
    }
    if !old.state.is_finished() {
        txn.delete(by_touch_key(t, old.state, old.updated_at, old.seq));
    }
    for k in label_keys(old) {
        txn.delete(k);
    }
    Ok(())
}

/// The most runs a page reads through the touch index (a point read each);
/// with more matches, the state index's scan answers.
const TOUCH_READS: usize = 16;

/// The seq at the end of an index key whose prefix is `plen` bytes long.
#[allow(
    clippy::expect_used,
    reason = "a slice cut to a fixed length by its range converts to an array of that length"
)]
fn seq_after(k: &[u8], plen: usize) -> Result<u64> {
    let b = k
        .get(plen..plen + 8)
        .ok_or_else(|| StateError::corrupt("run index key truncated"))?;
    Ok(u64::from_be_bytes(b.try_into().expect("8 bytes")))
}

impl KvStore {
    /// The run at (tenant, seq), if it is still there and matches `q`.
    fn run_at_if(&self, q: &StateQuery, seq: u64) -> Result<Option<RunRecord>> {
        let Some(bytes) = self.engine.get(&run_key(&q.tenant, seq))? else {
            // Deleted between the index read and this one.
            return Ok(None);
        };
        let r = decode_run_at(&bytes, &q.tenant, seq)?;
        Ok(run_matches(q, &r).then_some(r))
    }

    /// The first page of a reaper's walk (an unfinished state's runs last
    /// written before `before`) from the touch index, when that index holds
    /// at most `TOUCH_READS` such runs (and so all of them): a reaper's
    /// usual question, whether anything is stale at all, answered without
    /// reading a live run. `None` (the state index walks) when there are
    /// more. Later pages of a walk always walk the state index: the touch
    /// index could answer one only if the matches had fallen to its bound
    /// since the first, and asking it on every page had cost a walk whose
    /// runs mostly match 14% of each page. The same order, positions and
    /// cursors as the state index walk, so the two may answer pages of one
    /// walk (L4: the moment is a filter, never an order).
    fn touched_page(
        &self,
        q: &StateQuery,
        state: RunState,
        before: Millis,
        binding: &[u8],
        limit: usize,
    ) -> Result<Option<Page<RunRecord>>> {
        check_limit(limit)?;
        #[cfg(test)]
        tests::TOUCH_ASKED.with(|n| n.set(n.get() + 1));
        let lo = KeyBuf::table(table::RUN_BY_TOUCH)
            .str(&q.tenant)
            .u8(state.tag())
            .done();
        let hi = KeyBuf::table(table::RUN_BY_TOUCH)
            .str(&q.tenant)
            .u8(state.tag())
            .u64(before)
            .done();
        // A point read per match costs several scanned entries, so the
        // touch index answers only when matches are few.
        let bound = TOUCH_READS.min(limit + 1);
        let entries = self.engine.scan(&lo, &hi, bound + 1)?;
        if entries.len() > bound {
            return Ok(None);
        }
        let mut seqs = entries
            .iter()
            .map(|(k, _)| seq_after(k, lo.len() + 8))
            .collect::<Result<Vec<u64>>>()?;
        seqs.sort_unstable();
        seqs.dedup();
        let mut items = Vec::with_capacity(limit + 1);
        for seq in seqs {
            if let Some(r) = self.run_at_if(q, seq)? {
                items.push(r);
                if items.len() > limit {
                    break;
                }
            }
        }
        let more = items.len() > limit;
        items.truncate(limit);
        let cursor = match (more, items.last()) {
            (true, Some(r)) => Some(self.cursor_at(
                Listing::Runs,
                binding,
                &by_state_key(&q.tenant, state, r.seq),
            )),
            _ => None,
        };
        Page::new(items, cursor).map(Some)
    }
}

/// What a run index range holds as its values.
#[derive(Clone, Copy)]
enum Holds {
    /// The records (the run table, an unfinished state's index).
    Records,
    /// Summaries (the session index, a finished state's index): the record
    /// is read only for an entry whose summary matches.
    Summaries,
    /// Nothing (the label index): every entry's record is read.
    Nothing,
}

impl KvStore {
    /// A page of the runs under `prefix` (whose keys end in a seq) that
    /// match `q`.
    fn index_page(
        &self,
        q: &StateQuery,
        prefix: &[u8],
        holds: Holds,
        binding: &[u8],
        page: &PageRequest,
    ) -> Result<Page<RunRecord>> {
        let end = prefix_end(prefix);
        let plen = prefix.len();
        self.scan_page(Listing::Runs, binding, prefix, &end, page, |k, v| {
            let seq = seq_after(k, plen)?;
            match holds {
                Holds::Records => {
                    let r = decode_run_at(v, &q.tenant, seq)?;
                    Ok(run_matches(q, &r).then_some(r))
                }
                Holds::Summaries => {
                    let s: RunSummary = value::decode(v, "run summary")?;
                    if !s.matches(q) {
                        return Ok(None);
                    }
                    self.run_at_if(q, seq)
                }
                Holds::Nothing => self.run_at_if(q, seq),
            }
        })
    }
}

impl StateStore for KvStore {
    fn put_run(&self, record: RunRecord) -> Result<RunRecord> {
        self.put_run_with(record, None)
    }
    fn put_run_idempotent(&self, record: RunRecord, key: &IdempotencyKey) -> Result<RunRecord> {
        let tenant = record.key.tenant.clone();
        let keyed = Keyed::put_run(&tenant, &record, key)?;
        self.put_run_with(record, Some(keyed))
    }

    fn get_run(&self, key: &RunKey) -> Result<Option<RunRecord>> {
        check_run_key(key)?;
        let id = run_id_key(key);
        // The hint's record, when it is this run's, is the answer (see
        // `SeqHints`); otherwise the id map says where the run is.
        if let Some(seq) = self.seq_hints.get(&id)
            && let Some(bytes) = self.engine.get(&run_key(&key.tenant, seq))?
        {
            let r = decode_run_at(&bytes, &key.tenant, seq)?;
            if &r.key == key {
                return Ok(Some(r));
            }
        }
        let Some(seq) = self.engine.get(&id)? else {
            return Ok(None);
        };
        let seq = decode_seq(&seq)?;
        // A delete between the two reads leaves no record: not found.
        let Some(bytes) = self.engine.get(&run_key(&key.tenant, seq))? else {
            return Ok(None);
        };
        let r = decode_run_at(&bytes, &key.tenant, seq)?;
        if &r.key != key {
            return Err(StateError::corrupt(format!(
                "run {}/{} maps to seq {seq}, which holds run {}",
                key.tenant, key.run_id, r.key.run_id
            )));
        }
        self.seq_hints.note(id, seq);
        Ok(Some(r))
    }

    fn patch_run(&self, key: &RunKey, delta: StateDelta) -> Result<RunRecord> {
        self.patch_run_with(key, delta, None)
    }
    fn patch_run_idempotent(
        &self,
        key: &RunKey,
        delta: StateDelta,
        idempotency_key: &IdempotencyKey,
    ) -> Result<RunRecord> {
        let keyed = Keyed::patch_run(key, &delta, idempotency_key)?;
        self.patch_run_with(key, delta, Some(keyed))
    }

    // Rule R10: `check_delete` decides, in the job that deletes.
    fn delete_run(&self, key: &RunKey, expected_version: Option<u64>) -> Result<RunRecord> {
        check_run_key(key)?;
        let key = key.clone();
        self.submit(move |txn| {
            let Some(old) = read_run(txn, &key)? else {
                return Err(StateError::NotFound(RecordKey::Run(key)));
            };
            agentstate_core::rules::check_delete(&old, expected_version)?;
            delete_run(txn, &old)?;
            Ok(old)
        })
    }

    fn list_runs(&self, q: &StateQuery, page: &PageRequest) -> Result<Page<RunRecord>> {
        check_id("tenant", &q.tenant)?;
        if let Some(s) = &q.session {
            check_id("session", s)?;
        }
        if let Some(a) = &q.agent {
            check_id("agent", a)?;
        }
        // A next page may name only the tenant: its cursor's filters (L7).
        let walk = agentstate_core::codec::cursor::runs_query(&self.secret, q, page)?;
        let q = &*walk;
        // The narrowest index that answers the query: a reaper's
        // state query never walks finished runs (L5).
        let binding = agentstate_core::codec::cursor::runs_binding(q);
        let t = &q.tenant;
        if let (None, Some(l)) = (&q.session, &q.label) {
            // A label is usually narrower than a state: its index answers.
            let prefix =
                by_label_prefix(t, &l.key, &agentstate_core::labels::canonical(&l.value)).done();
            return self.index_page(q, &prefix, Holds::Nothing, &binding, page);
        }
        match (&q.session, q.state) {
            (Some(s), _) => {
                let prefix = KeyBuf::table(table::RUN_BY_SESSION).str(t).str(s).done();
                self.index_page(q, &prefix, Holds::Summaries, &binding, page)
            }
            (None, Some(st)) if st.is_finished() => {
                let prefix = KeyBuf::table(table::RUN_BY_STATE)
                    .str(t)
                    .u8(st.tag())
                    .done();
                self.index_page(q, &prefix, Holds::Summaries, &binding, page)
            }
            (None, Some(st)) => {
                let prefix = KeyBuf::table(table::RUN_BY_STATE)
                    .str(t)
                    .u8(st.tag())
                    .done();
                if let Some(before) = q.updated_before
                    && page.cursor.is_none()
                    && let Some(p) = self.touched_page(q, st, before, &binding, page.limit)?
                {
                    return Ok(p);
                }
                self.index_page(q, &prefix, Holds::Records, &binding, page)
            }
            (None, None) => {
                let prefix = KeyBuf::table(table::RUN).str(t).done();
                self.index_page(q, &prefix, Holds::Records, &binding, page)
            }
        }
    }

    fn put_session(&self, record: SessionRecord) -> Result<SessionRecord> {
        self.put_session_impl(record)
    }

    fn get_session(&self, key: &SessionKey) -> Result<Option<SessionRecord>> {
        self.get_session_impl(key)
    }

    fn delete_session(&self, key: &SessionKey, cascade: bool) -> Result<Vec<RunKey>> {
        self.delete_session_impl(key, cascade)
    }
}

impl KvStore {
    pub(crate) fn patch_run_with(
        &self,
        key: &RunKey,
        delta: StateDelta,
        keyed: Option<Keyed<'_>>,
    ) -> Result<RunRecord> {
        check_run_key(key)?;
        let key = key.clone();
        let now = self.now();
        let max = self.opts.record_bytes_max;
        let keys = RunKeys::of(&key);
        self.submit_keyed(keyed, move |txn| {
            let Some(old) = read_run_at(txn, &keys.id, &key)? else {
                return Err(StateError::NotFound(RecordKey::Run(key)));
            };
            let new = patched_run(&old, &delta, now)?;
            write_run(txn, Some(&old), &new, max, keys)?;
            // B6: a patch counts toward the caps' spent (its run's amounts
            // are the run's spent; its budget's is kept beside the budget)
            // and never refuses.
            if new.budget.is_some() || !new.caps.is_none() {
                after_patch(txn, &new, &delta, now)?;
            }
            Ok(new)
        })
    }
}

impl KvStore {
    pub(crate) fn put_run_with(
        &self,
        mut record: RunRecord,
        keyed: Option<Keyed<'_>>,
    ) -> Result<RunRecord> {
        check_record(&record)?;
        self.opts.scrubber.scrub_run_in_place(&mut record);
        let now = self.now();
        let max = self.opts.record_bytes_max;
        let keys = RunKeys::of(&record.key);
        let session = record
            .session_id
            .as_ref()
            .map(|s| session_key(&SessionKey::new(record.key.tenant.clone(), s.clone())));
        // Boxed, so the job that carries it to the leader, and its answer
        // back, move a pointer instead of the whole record at each step:
        // the box made here is the one returned.
        let record = Box::new(record);
        self.submit_keyed(keyed, move |txn| {
            let stored = read_run_at(txn, &keys.id, &record.key)?;
            check_version(record.version, stored.as_ref().map(|s| s.version), || {
                RecordKey::Run(record.key.clone())
            })?;
            let new = match &stored {
                None => {
                    // R8: a run's session exists at create.
                    if let (Some(s), Some(at)) = (&record.session_id, &session)
                        && txn.get(at)?.is_none()
                    {
                        let sk = SessionKey::new(record.key.tenant.clone(), s.clone());
                        return Err(StateError::NotFound(RecordKey::Session(sk)));
                    }
                    // B1: so does its budget.
                    if let Some(b) = &record.budget {
                        let bk = BudgetKey::new(record.key.tenant.clone(), b.clone());
                        if txn.get(&budget_key(&bk))?.is_none() {
                            return Err(StateError::NotFound(RecordKey::Budget(bk)));
                        }
                    }
                    let seq = txn.next_seq;
                    txn.next_seq += 1;
                    let mut new = record;
                    created_run_in_place(&mut new, seq, now);
                    // A run created with amounts already spent spends them
                    // on its budget too.
                    let delta = StateDelta {
                        usage: new.usage,
                        cost_micros: new.cost_micros,
                        iterations: new.iterations,
                        messages_read: 0,
                    };
                    if new.budget.is_some() {
                        after_patch(txn, &new, &delta, now)?;
                    }
                    new
                }
                Some(s) => Box::new(updated_run(s, *record, now)?),
            };
            write_run(txn, stored.as_ref(), &new, max, keys)?;
            Ok(new)
        })
        .map(|new| *new)
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    use super::{SEQ_HINTS_MAX, run_id_key};
    use crate::{FileStore, MemoryStore};
    use agentstate_core::api::StateStore;
    use agentstate_core::error::StateError;
    use agentstate_core::record::{RunKey, RunRecord, SessionKey, SessionRecord, StateDelta};

    /// Runs are deleted with their session, so each run here has one.
    fn session(id: &str) -> SessionKey {
        SessionKey::new("hints", format!("s-{id}"))
    }

    fn create(s: &dyn StateStore, id: &str) -> RunRecord {
        s.put_session(SessionRecord::new(session(id)))
            .expect("create session");
        let mut r = RunRecord::new(RunKey::new("hints", id), "agent");
        r.session_id = Some(session(id).session_id);
        s.put_run(r).expect("create")
    }

    fn delete(s: &dyn StateStore, id: &str) {
        let gone = s.delete_session(&session(id), true).expect("delete");
        assert_eq!(gone.len(), 1, "the session's one run");
    }

    /// A hint that points at another run's record, or at no record, is
    /// passed over for the id map; a run deleted and created again is read
    /// at its new seq.
    #[test]
    fn r1_a_get_answers_the_run_named_whatever_its_seq_hint_says() {
        let s = MemoryStore::new();
        let a = create(&s, "a");
        let b = create(&s, "b");
        let key_a = a.key.clone();
        let get = |k: &RunKey| s.get_run(k).expect("get_run");
        assert_eq!(get(&key_a).map(|r| r.seq), Some(a.seq));
        assert_eq!(get(&b.key).map(|r| r.seq), Some(b.seq));
        let hints = &s.0.seq_hints;
        hints.note(run_id_key(&key_a), b.seq);
        assert_eq!(
            get(&key_a).map(|r| (r.key, r.seq)),
            Some((key_a.clone(), a.seq))
        );
        hints.note(run_id_key(&key_a), a.seq + 1_000);
        assert_eq!(get(&key_a).map(|r| r.seq), Some(a.seq));
        // A job reads through the hints too: a patch of `a` hinted at
        // `b`'s seq patches `a`.
        hints.note(run_id_key(&key_a), b.seq);
        let patched = s
            .patch_run(
                &key_a,
                StateDelta {
                    iterations: 1,
                    ..Default::default()
                },
            )
            .expect("patch");
        assert_eq!((patched.key.clone(), patched.seq), (key_a.clone(), a.seq));
        assert_eq!(patched.version, a.version + 1);
        assert_eq!(get(&b.key).map(|r| r.version), Some(b.version));
        delete(&s, "a");
        assert_eq!(get(&key_a), None);
        let again = create(&s, "a");
        assert_ne!(again.seq, a.seq);
        assert_eq!(get(&key_a).map(|r| r.seq), Some(again.seq));
    }

    #[test]
    fn seq_hints_stay_bounded() {
        let s = MemoryStore::new();
        for i in 0..SEQ_HINTS_MAX + 10 {
            let r = create(&s, &format!("r{i}"));
            assert!(s.get_run(&r.key).expect("get_run").is_some());
            assert!(s.0.seq_hints.len() <= SEQ_HINTS_MAX);
        }
        assert!(s.0.seq_hints.len() > 0);
    }

    /// Readers racing a writer that deletes and creates the same run again
    /// never see an incarnation deleted before their read began, with real
    /// threads on both engines.
    fn no_read_of_a_deleted_incarnation(s: Arc<dyn StateStore>) {
        let key = RunKey::new("hints", "again");
        // The highest seq whose delete has returned.
        let dead = Arc::new(AtomicU64::new(0));
        let done = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = (0..3)
            .map(|_| {
                let (s, key, dead, done) = (s.clone(), key.clone(), dead.clone(), done.clone());
                std::thread::spawn(move || {
                    let mut seen = 0u64;
                    let mut n = 0u64;
                    while !done.load(Ordering::SeqCst) {
                        let before = dead.load(Ordering::SeqCst);
                        n += 1;
                        // Every other call a patch: a job reads through
                        // the hints as `get_run` does.
                        let found = if n.is_multiple_of(2) {
                            s.get_run(&key).expect("get_run")
                        } else {
                            let delta = StateDelta {
                                iterations: 1,
                                ..Default::default()
                            };
                            match s.patch_run(&key, delta) {
                                Ok(r) => Some(r),
                                Err(StateError::NotFound(_)) => None,
                                Err(e) => panic!("patch: {e}"),
                            }
                        };
                        if let Some(r) = found {
                            assert!(
                                r.seq > before,
                                "read seq {} after its delete returned (dead up to {before})",
                                r.seq
                            );
                            assert_eq!(r.key, key);
                            seen += 1;
                        }
                    }
                    seen
                })
            })
            .collect();
        for _ in 0..300 {
            let r = create(&*s, "again");
            // Give the readers a moment to read (and hint) this one.
            for _ in 0..3 {
                assert!(s.get_run(&key).expect("get_run").is_some());
            }
            delete(&*s, "again");
            dead.store(r.seq, Ordering::SeqCst);
        }
        done.store(true, Ordering::SeqCst);
        let seen: u64 = readers.into_iter().map(|h| h.join().expect("reader")).sum();
        assert!(seen > 0, "the readers read some incarnation");
    }

    #[test]
    fn r1_readers_racing_deletes_and_creates_never_see_a_deleted_run_memory() {
        no_read_of_a_deleted_incarnation(Arc::new(MemoryStore::new()));
    }

    #[test]
    fn r1_readers_racing_deletes_and_creates_never_see_a_deleted_run_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = FileStore::open_with(
            dir.path().join("s"),
            agentstate_core::Options::new().durability(agentstate_core::Durability::Buffered),
        )
        .expect("open");
        no_read_of_a_deleted_incarnation(Arc::new(s));
    }

    thread_local! {
        /// Times this thread's reaper walks asked the touch index.
        pub(super) static TOUCH_ASKED: Cell<usize> = const { Cell::new(0) };
    }

    /// A memory store of `n` running runs in tenant "reap", those whose
    /// index `stale(i)` holds written at 1,000 and the rest at 5,000;
    /// returns the stale ones' keys in seq order.
    fn reaper_store(n: usize, stale: impl Fn(usize) -> bool) -> (MemoryStore, Vec<RunKey>) {
        let clock = Arc::new(agentstate_core::ManualClock::new(0));
        let s = MemoryStore::with_options(agentstate_core::Options::new().clock(clock.clone()));
        let mut want = Vec::new();
        for i in 0..n {
            clock.set(if stale(i) { 1_000 } else { 5_000 });
            let mut r = RunRecord::new(RunKey::new("reap", format!("r{i:04}")), "agent");
            r.state = agentstate_core::RunState::Running;
            let r = s.put_run(r).expect("create");
            if stale(i) {
                want.push(r.key);
            }
        }
        (s, want)
    }

    /// Every page of a reaper's walk by `limit` (`updated_before` 2,000,
    /// or none), how many pages, and how often it asked the touch index.
    fn reap(s: &MemoryStore, limit: usize, moment: bool) -> (Vec<RunKey>, usize, usize) {
        let mut q =
            agentstate_core::StateQuery::new("reap").state(agentstate_core::RunState::Running);
        if moment {
            q = q.updated_before(2_000);
        }
        let before = TOUCH_ASKED.with(Cell::get);
        let (mut got, mut pages) = (Vec::new(), 0);
        let mut page = agentstate_core::PageRequest::new(limit);
        loop {
            let (items, cursor) = s.list_runs(&q, &page).expect("list").into_parts();
            pages += 1;
            got.extend(items.into_iter().map(|r| r.key));
            match cursor {
                Some(c) => page = page.with_cursor(Some(c)),
                None => break,
            }
        }
        (got, pages, TOUCH_ASKED.with(Cell::get) - before)
    }

    /// L4, L5: a reaper's walk asks the touch index on its first page only;
    /// it answers that page when it holds every match, else the state index
    /// walks, as on every later page. The same runs, in seq order,
    /// whichever answered.
    #[test]
    fn l4_a_reapers_walk_asks_the_touch_index_on_its_first_page_only() {
        // Every run stale: the touch index holds too many; 120 pages by
        // the state index, one question.
        let (s, want) = reaper_store(120, |_| true);
        for limit in [1, 7, 16, 100] {
            let (got, pages, asked) = reap(&s, limit, true);
            assert_eq!(got, want, "dense, limit {limit}");
            assert_eq!(pages, want.len().div_ceil(limit).max(1), "limit {limit}");
            assert_eq!(asked, 1, "dense, limit {limit}");
        }
        // 10 stale runs spread over 200: the touch index answers the first
        // page once it may read them all (a page of more than 9).
        let (s, want) = reaper_store(200, |i| i % 20 == 7);
        assert_eq!(want.len(), 10);
        for limit in [1, 5, 9, 10, 11, 16, 100] {
            let (got, pages, asked) = reap(&s, limit, true);
            assert_eq!(got, want, "spread, limit {limit}");
            assert_eq!(asked, 1, "spread, limit {limit}");
            if limit >= 10 {
                assert_eq!(pages, 1, "the touch index's one page, limit {limit}");
            }
        }
        // 40 stale runs over 400, and none at all.
        let (s, want) = reaper_store(400, |i| i % 10 == 3);
        for limit in [1, 16, 39, 40, 100] {
            assert_eq!(reap(&s, limit, true).0, want, "many, limit {limit}");
        }
        let (s, _) = reaper_store(50, |_| false);
        assert_eq!(reap(&s, 10, true), (vec![], 1, 1), "none stale");
        // Without a moment the touch index is never asked.
        let (s, _) = reaper_store(30, |i| i < 10);
        let (got, _, asked) = reap(&s, 7, false);
        assert_eq!((got.len(), asked), (30, 0));
    }
}
