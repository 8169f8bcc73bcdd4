//! The store format and the one-time upgrade of a format-1 store (rule D4).
//!
//! Format 1 kept a run under (tenant, run_id) and its seq, state and
//! session indexes as pointers to the run id, so a page read one record
//! per item at a random place. Format 2 clusters records under (tenant,
//! seq) and keeps what a page needs in its indexes (see `kv::runs`). The
//! upgrade rewrites every run in the new tables at open, in atomic engine
//! batches that each move whole runs (their new entries written, their old
//! ones deleted), so at every moment each run is in exactly one layout.
//! The marker file says format 2 before the first batch (a release that
//! knows only format 1 refuses the store from then on, rather than read it
//! half moved), and the store's own format value becomes 2 in the last
//! batch; an open that finds it still 1 goes on where the upgrade stopped.

use crate::engine::Write;
use crate::key::{meta, table::v1};
use agentstate_core::codec::key::{KeyBuf, KeyReader, prefix_end};
use agentstate_core::codec::value;
use agentstate_core::error::{Result, StateError};
use agentstate_core::options::UpgradeProgress;
use agentstate_core::record::{RunKey, RunRecord};

use super::KvStore;
use super::runs::{RunKeys, write_run};

/// The layout this release writes: format 2 (runs clustered by seq).
pub(crate) const STORE_FORMAT: u8 = 2;
/// The oldest layout this release opens (and upgrades).
pub(crate) const STORE_FORMAT_OLDEST: u8 = 1;

/// Runs moved per atomic batch.
const UPGRADE_BATCH: usize = 1000;

fn v1_run_key(k: &RunKey) -> Vec<u8> {
    KeyBuf::table(v1::RUN).str(&k.tenant).str(&k.run_id).done()
}

fn v1_index_keys(r: &RunRecord) -> Vec<Vec<u8>> {
    let t = &r.key.tenant;
    let mut keys = vec![
        KeyBuf::table(v1::RUN_BY_SEQ).str(t).u64(r.seq).done(),
        KeyBuf::table(v1::RUN_BY_STATE)
            .str(t)
            .u8(r.state.tag())
            .u64(r.seq)
            .done(),
    ];
    if let Some(s) = &r.session_id {
        keys.push(
            KeyBuf::table(v1::RUN_BY_SESSION)
                .str(t)
                .str(s)
                .u64(r.seq)
                .done(),
        );
    }
    keys
}

impl KvStore {
    /// The layout the engine holds (the meta format value).
    pub(crate) fn store_format(&self) -> Result<u8> {
        let v = self
            .engine
            .get(meta::FORMAT)?
            .ok_or_else(|| StateError::corrupt("meta value 'f' missing"))?;
        value::decode(&v, "format version")
    }

    /// Moves every format-1 run into the format-2 tables, then records
    /// format 2. Safe to stop at any moment and run again. Calls
    /// `progress` after every batch.
    pub(crate) fn upgrade(&self, progress: &dyn Fn(UpgradeProgress)) -> Result<()> {
        let format = self.store_format()?;
        if format >= STORE_FORMAT {
            return Ok(());
        }
        let lo = KeyBuf::table(v1::RUN).done();
        let hi = prefix_end(&lo);
        let total = self.count(v1::RUN_BY_SEQ)?;
        // A record format 1 stored is moved as it is, whatever today's size
        // limit: the upgrade refuses nothing the store already holds.
        let max = usize::MAX;
        let mut done = 0u64;
        // The moved runs are written here, outside the commit path: the
        // open's `fill_feed` gives them their feed entries after.
        self.engine
            .commit(vec![(meta::FEED_FILLED.to_vec(), None)])?;
        progress(UpgradeProgress::new(done, total));
        loop {
            // Moved runs leave the old table, so the next batch starts at
            // its beginning again.
            let chunk = self.engine.scan(&lo, &hi, UPGRADE_BATCH)?;
            if chunk.is_empty() {
                break;
            }
            let mut batch: Vec<Write> = Vec::with_capacity(chunk.len() * 8);
            for (k, v) in &chunk {
                let key = KeyReader::new(k, v1::RUN).and_then(|mut r| {
                    let key = RunKey::new(r.str()?, r.str()?);
                    r.end()?;
                    Ok(key)
                })?;
                let r = value::decode_run(v)?;
                if r.key != key || v1_run_key(&r.key) != *k {
                    return Err(StateError::corrupt(format!(
                        "format-1 run stored under {}/{} names another key",
                        key.tenant, key.run_id
                    )));
                }
                write_run(&mut batch, None, &r, max, RunKeys::of(&r.key))?;
                batch.push((k.clone(), None));
                for ik in v1_index_keys(&r) {
                    batch.push((ik, None));
                }
            }
            let n = chunk.len() as u64;
            self.engine.commit(batch)?;
            done += n;
            progress(UpgradeProgress::new(done, total.max(done)));
        }
        // Index entries left without their run (a format-1 store's own
        // inconsistency, which its verify reported) point at nothing.
        for tb in [v1::RUN_BY_SEQ, v1::RUN_BY_STATE, v1::RUN_BY_SESSION] {
            let lo = KeyBuf::table(tb).done();
            let hi = prefix_end(&lo);
            loop {
                let chunk = self.engine.scan(&lo, &hi, UPGRADE_BATCH)?;
                if chunk.is_empty() {
                    break;
                }
                self.engine
                    .commit(chunk.into_iter().map(|(k, _)| (k, None)).collect())?;
            }
        }
        self.engine.commit(vec![(
            meta::FORMAT.to_vec(),
            Some(value::encode(&STORE_FORMAT)),
        )])?;
        self.engine.sync()
    }

    /// Entries in one table.
    fn count(&self, table_byte: u8) -> Result<u64> {
        let mut n = 0u64;
        self.walk(table_byte, |_, _| {
            n += 1;
            Ok(())
        })?;
        Ok(n)
    }

    /// Writes `runs` in format 1's layout and marks the store format 1,
    /// as release 0.1 would have: for tests and benchmarks of the upgrade.
    pub(crate) fn write_format1_for_tests(&self, runs: &[RunRecord]) -> Result<()> {
        let mut next = self.committer.counters().next_seq;
        for chunk in runs.chunks(UPGRADE_BATCH) {
            let mut batch: Vec<Write> = Vec::new();
            for r in chunk {
                let id = value::encode(&r.key.run_id);
                for ik in v1_index_keys(r) {
                    batch.push((ik, Some(id.clone())));
                }
                batch.push((v1_run_key(&r.key), Some(value::encode_run(r))));
                next = next.max(r.seq + 1);
            }
            batch.push((meta::NEXT_SEQ.to_vec(), Some(value::encode(&next))));
            self.engine.commit(batch)?;
        }
        self.engine.commit(vec![
            (
                meta::FORMAT.to_vec(),
                Some(value::encode(&STORE_FORMAT_OLDEST)),
            ),
            // Release 0.1 had no change feed.
            (meta::FEED_FILLED.to_vec(), None),
        ])?;
        self.engine.sync()
    }
}
