//! Runs: versioned puts, commuting patches, listings (rules R, L, X).

use crate::api::StateStore;
use crate::codec::cursor::Listing;
use crate::codec::value;
use crate::error::{Missing, Result, StateError};
use crate::kv::key::{KeyBuf, prefix_end, table};
use crate::page::{Page, PageRequest};
use crate::record::{
    Millis, RunKey, RunRecord, RunState, SessionKey, SessionRecord, StateDelta, StateQuery,
};
use crate::rules::{
    check_record, check_run_key, check_version, created_run, patched_run, updated_run,
};

use super::budgets::{after_patch, budget_key};
use super::commit::Txn;
use super::{KvStore, check_id, check_size};
use crate::budget::BudgetKey;

pub(crate) fn run_key(k: &RunKey) -> Vec<u8> {
    KeyBuf::table(table::RUN)
        .str(&k.tenant)
        .str(&k.run_id)
        .done()
}
pub(crate) fn by_seq_key(tenant: &str, seq: u64) -> Vec<u8> {
    KeyBuf::table(table::RUN_BY_SEQ).str(tenant).u64(seq).done()
}
pub(crate) fn by_state_key(tenant: &str, state: RunState, seq: u64) -> Vec<u8> {
    KeyBuf::table(table::RUN_BY_STATE)
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
pub(crate) fn session_key(k: &SessionKey) -> Vec<u8> {
    KeyBuf::table(table::SESSION)
        .str(&k.tenant)
        .str(&k.session_id)
        .done()
}

/// A run's engine key and its index entries' value: all of a write that
/// does not depend on what the store holds, so a caller builds it in its
/// own thread before its job is queued.
pub(crate) struct RunKeys {
    key: Vec<u8>,
    id: Vec<u8>,
}

impl RunKeys {
    pub(crate) fn of(k: &RunKey) -> RunKeys {
        RunKeys {
            key: run_key(k),
            id: value::encode(&k.run_id),
        }
    }
}

/// Reads and checks a stored run.
pub(crate) fn read_run(txn: &Txn<'_>, key: &RunKey) -> Result<Option<RunRecord>> {
    read_run_at(txn, &run_key(key), key)
}

/// Reads and checks the run stored under the engine key `at`.
fn read_run_at(txn: &Txn<'_>, at: &[u8], key: &RunKey) -> Result<Option<RunRecord>> {
    txn.get(at)?.map(|v| decode_run(&v, key)).transpose()
}

pub(crate) fn decode_run(bytes: &[u8], key: &RunKey) -> Result<RunRecord> {
    let r = value::decode_run(bytes)?;
    if &r.key != key {
        return Err(StateError::corrupt(format!(
            "run stored under {}/{} names another key",
            key.tenant, key.run_id
        )));
    }
    Ok(r)
}

/// Writes a run and the index entries it needs; `old` is what was stored.
/// `keys` are `new.key`'s.
pub(crate) fn write_run(
    txn: &mut Txn<'_>,
    old: Option<&RunRecord>,
    new: &RunRecord,
    max: usize,
    keys: RunKeys,
) -> Result<()> {
    let bytes = value::encode_run(new);
    check_size("run record", bytes.len(), max)?;
    debug_assert!(decode_run(&bytes, &new.key).is_ok_and(|r| &r == new));
    debug_assert!(keys.key == run_key(&new.key));
    let RunKeys { key, id } = keys;
    let t = &new.key.tenant;
    match old {
        None => {
            txn.put(by_seq_key(t, new.seq), id.clone());
            if let Some(s) = &new.session_id {
                txn.put(by_session_key(t, s, new.seq), id.clone());
            }
            txn.put(by_state_key(t, new.state, new.seq), id);
        }
        Some(old) if old.state != new.state => {
            txn.delete(by_state_key(t, old.state, old.seq));
            txn.put(by_state_key(t, new.state, new.seq), id);
        }
        Some(_) => {}
    }
    txn.put(key, bytes);
    Ok(())
}

/// Deletes a run, its index entries and its holds (what it spent stays
/// spent against its budget).
pub(crate) fn delete_run(txn: &mut Txn<'_>, old: &RunRecord) -> Result<()> {
    super::budgets::delete_run_holds(txn, old)?;
    let t = &old.key.tenant;
    txn.delete(run_key(&old.key));
    txn.delete(by_seq_key(t, old.seq));
    txn.delete(by_state_key(t, old.state, old.seq));
    if let Some(s) = &old.session_id {
        txn.delete(by_session_key(t, s, old.seq));
    }
    Ok(())
}

impl KvStore {
    /// Reads the run an index entry points at, if it still matches.
    fn indexed_run(&self, q: &StateQuery, seq: u64, id_bytes: &[u8]) -> Result<Option<RunRecord>> {
        let run_id: String = value::decode(id_bytes, "run index entry")?;
        let key = RunKey::new(q.tenant.clone(), run_id);
        let Some(bytes) = self.engine.get(&run_key(&key))? else {
            // Deleted between the index read and this one.
            return Ok(None);
        };
        let r = decode_run(&bytes, &key)?;
        let matches = r.seq == seq
            && q.state.is_none_or(|s| s == r.state)
            && q.session
                .as_ref()
                .is_none_or(|s| r.session_id.as_ref() == Some(s))
            && q.agent.as_ref().is_none_or(|a| &r.agent_name == a)
            && q.updated_before.is_none_or(|t: Millis| r.updated_at < t);
        Ok(matches.then_some(r))
    }
}

impl StateStore for KvStore {
    fn put_run(&self, record: RunRecord) -> Result<RunRecord> {
        check_record(&record)?;
        let record = self.opts.scrubber.scrub_run(&record);
        let now = self.now();
        let max = self.opts.record_bytes_max;
        let keys = RunKeys::of(&record.key);
        let session = record
            .session_id
            .as_ref()
            .map(|s| session_key(&SessionKey::new(record.key.tenant.clone(), s.clone())));
        self.submit(move |txn| {
            let stored = read_run_at(txn, &keys.key, &record.key)?;
            check_version(record.version, stored.as_ref().map(|s| s.version))?;
            let new = match &stored {
                None => {
                    // R8: a run's session exists at create.
                    if let (Some(s), Some(at)) = (&record.session_id, &session)
                        && txn.get(at)?.is_none()
                    {
                        let sk = SessionKey::new(record.key.tenant.clone(), s.clone());
                        return Err(StateError::NotFound(Missing::Session(sk)));
                    }
                    // B1: so does its budget.
                    if let Some(b) = &record.budget {
                        let bk = BudgetKey::new(record.key.tenant.clone(), b.clone());
                        if txn.get(&budget_key(&bk))?.is_none() {
                            return Err(StateError::NotFound(Missing::Budget(bk)));
                        }
                    }
                    let seq = txn.next_seq;
                    txn.next_seq += 1;
                    let new = created_run(record, seq, now);
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
                Some(s) => updated_run(s, record, now)?,
            };
            write_run(txn, stored.as_ref(), &new, max, keys)?;
            Ok(new)
        })
    }

    fn get_run(&self, key: &RunKey) -> Result<Option<RunRecord>> {
        check_run_key(key)?;
        self.engine
            .get(&run_key(key))?
            .map(|v| decode_run(&v, key))
            .transpose()
    }

    fn patch_run(&self, key: &RunKey, delta: StateDelta) -> Result<RunRecord> {
        check_run_key(key)?;
        let key = key.clone();
        let now = self.now();
        let max = self.opts.record_bytes_max;
        let keys = RunKeys::of(&key);
        self.submit(move |txn| {
            let Some(old) = read_run_at(txn, &keys.key, &key)? else {
                return Err(StateError::NotFound(Missing::Run(key)));
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

    fn list_runs(&self, q: &StateQuery, page: &PageRequest) -> Result<Page<RunRecord>> {
        check_id("tenant", &q.tenant)?;
        if let Some(s) = &q.session {
            check_id("session", s)?;
        }
        if let Some(a) = &q.agent {
            check_id("agent", a)?;
        }
        // The narrowest index that answers the query: a reaper's
        // state query never walks finished runs (L5).
        let (table_byte, prefix) = match (&q.session, q.state) {
            (Some(s), _) => (
                table::RUN_BY_SESSION,
                KeyBuf::table(table::RUN_BY_SESSION)
                    .str(&q.tenant)
                    .str(s)
                    .done(),
            ),
            (None, Some(st)) => (
                table::RUN_BY_STATE,
                KeyBuf::table(table::RUN_BY_STATE)
                    .str(&q.tenant)
                    .u8(st.tag())
                    .done(),
            ),
            (None, None) => (
                table::RUN_BY_SEQ,
                KeyBuf::table(table::RUN_BY_SEQ).str(&q.tenant).done(),
            ),
        };
        debug_assert_eq!(prefix[0], table_byte);
        let binding = crate::codec::cursor::runs_binding(q);
        let end = prefix_end(&prefix);
        let plen = prefix.len();
        self.scan_page(Listing::Runs, &binding, &prefix, &end, page, |k, v| {
            let seq_bytes = k
                .get(plen..plen + 8)
                .ok_or_else(|| StateError::corrupt("run index key truncated"))?;
            let seq = u64::from_be_bytes(seq_bytes.try_into().expect("8 bytes"));
            self.indexed_run(q, seq, v)
        })
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
