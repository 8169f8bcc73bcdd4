//! Sessions: versioned like runs; deletes that never orphan a live run
//! (rules S1–S4).

use crate::key::table;
use agentstate_core::codec::key::{KeyBuf, KeyReader, prefix_end};
use agentstate_core::codec::value;
use agentstate_core::error::{RecordKey, Result, StateError};
use agentstate_core::record::{RunKey, SessionKey, SessionRecord};

use super::runs::{delete_run, read_run_by_seq, session_key};
use super::{KvStore, check_size};
use agentstate_core::rules::{check_session, check_session_key, next_session};

pub(crate) fn decode_session(bytes: &[u8], key: &SessionKey) -> Result<SessionRecord> {
    let s = value::decode_session(bytes)?;
    if &s.key != key {
        return Err(StateError::corrupt("session stored under another key"));
    }
    Ok(s)
}

impl KvStore {
    pub(super) fn put_session_impl(&self, mut record: SessionRecord) -> Result<SessionRecord> {
        check_session(&record)?;
        self.opts.scrubber.scrub_session_in_place(&mut record);
        let now = self.now();
        let max = self.opts.record_bytes_max;
        self.submit(move |txn| {
            let k = session_key(&record.key);
            let stored = txn
                .get(&k)?
                .map(|v| decode_session(&v, &record.key))
                .transpose()?;
            let new = next_session(stored.as_ref(), record, now)?;
            let bytes = value::encode_session(&new);
            check_size("session record", bytes.len(), max)?;
            txn.put(k, bytes);
            Ok(new)
        })
    }

    pub(super) fn get_session_impl(&self, key: &SessionKey) -> Result<Option<SessionRecord>> {
        check_session_key(key)?;
        self.engine
            .get(&session_key(key))?
            .map(|v| decode_session(&v, key))
            .transpose()
    }

    // Rule S2: the in-use check, decided here (each backend has its own
    // copy: docs/RULES.md). Rule S3: the cascade, in one job.
    pub(super) fn delete_session_impl(
        &self,
        key: &SessionKey,
        cascade: bool,
    ) -> Result<Vec<RunKey>> {
        check_session_key(key)?;
        let key = key.clone();
        self.submit(move |txn| {
            let k = session_key(&key);
            if txn.get(&k)?.is_none() {
                return Err(StateError::NotFound(RecordKey::Session(key)));
            }
            let prefix = KeyBuf::table(table::RUN_BY_SESSION)
                .str(&key.tenant)
                .str(&key.session_id)
                .done();
            let entries = txn.scan(&prefix, &prefix_end(&prefix), usize::MAX)?;
            let mut runs = Vec::with_capacity(entries.len());
            for (k, _) in entries {
                let seq = KeyReader::new(&k, table::RUN_BY_SESSION).and_then(|mut r| {
                    r.str()?;
                    r.str()?;
                    r.u64()
                })?;
                let r = read_run_by_seq(txn, &key.tenant, seq)?.ok_or_else(|| {
                    StateError::corrupt(format!("session index names missing run seq {seq}"))
                })?;
                runs.push(r);
            }
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
                    });
                }
                txn.delete(k);
                return Ok(Vec::new());
            }
            for r in &runs {
                delete_run(txn, r)?;
            }
            txn.delete(k);
            Ok(runs.into_iter().map(|r| r.key).collect())
        })
    }
}
