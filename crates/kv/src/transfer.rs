//! Export and import: every record of a store as a sequence of entries, in
//! a deterministic order (runs, holds, sessions, budgets, epochs, trays,
//! alarms; each in
//! key order), and back into an empty store with versions, `seq`s and
//! timestamps kept, so export → import → export gives the same entries.

use crate::key::{meta, table};
use agentstate_core::codec::cursor::Listing;
use agentstate_core::codec::key::{KeyBuf, KeyReader};
use agentstate_core::codec::value;
use agentstate_core::entry::Entry;
use agentstate_core::error::{Result, StateError};
use agentstate_core::page::{Page, PageRequest};
use agentstate_core::record::RunKey;
use agentstate_core::rules::checked_entry;
use agentstate_core::tray::InstanceKey;

use super::KvStore;
use super::commit::Txn;
use super::runs::{RunKeys, by_state_key, read_run, run_key, session_key, write_run};
use super::trays::{alarm_due_key, alarm_key, epoch_key, read_tray_key, tray_key};

/// Entries an import stages (and later publishes) per atomic group.
const IMPORT_GROUP: usize = 1000;

/// The primary tables, in export order.
const TABLES: [u8; 7] = [
    table::RUN,
    table::HOLD,
    table::SESSION,
    table::BUDGET,
    table::EPOCH,
    table::TRAY,
    table::ALARM,
];

fn entry_of(k: &[u8], v: &[u8]) -> Result<Entry> {
    let t = *k.first().ok_or_else(|| StateError::corrupt("empty key"))?;
    let mut r = KeyReader::new(k, t)?;
    Ok(match t {
        table::RUN => Entry::Run(value::decode_run(v)?),
        table::SESSION => Entry::Session(value::decode_session(v)?),
        table::HOLD => {
            let (run, hold) = super::budgets::hold_entry(k, v)?;
            Entry::Hold { run, hold }
        }
        table::BUDGET => {
            let key = agentstate_core::budget::BudgetKey::new(r.str()?, r.str()?);
            let row = super::budgets::decode_budget(v, &key)?;
            Entry::Budget {
                budget: row.record,
                spent: row.spent,
            }
        }
        table::EPOCH => Entry::Epoch {
            instance: InstanceKey {
                ns: r.str()?,
                id: r.str()?,
            },
            epoch: value::decode(v, "epoch")?,
        },
        table::TRAY => Entry::Tray {
            key: read_tray_key(&mut r)?,
            tray: value::decode(v, "tray")?,
        },
        table::ALARM => Entry::Alarm {
            instance: InstanceKey {
                ns: r.str()?,
                id: r.str()?,
            },
            due_at: value::decode(v, "alarm")?,
        },
        other => {
            return Err(StateError::corrupt(format!(
                "unexpected table {other:#04x} in export"
            )));
        }
    })
}

impl KvStore {
    /// One page of the whole store's records, for export. Walk it with the
    /// cursor like any listing; the order is deterministic.
    pub(crate) fn export_page(&self, page: &PageRequest) -> Result<Page<Entry>> {
        let lo = KeyBuf::table(table::RUN).done();
        let hi = KeyBuf::table(table::ALARM + 1).done();
        self.scan_page(Listing::Export, b"export", &lo, &hi, page, |k, v| {
            if TABLES.contains(&k[0]) {
                entry_of(k, v).map(Some)
            } else {
                Ok(None)
            }
        })
    }

    /// True when the store holds no record of any kind.
    pub(crate) fn is_empty(&self) -> Result<bool> {
        Ok(self.export_page(&PageRequest::new(1))?.items().is_empty())
    }

    /// Writes exported entries into an empty store (see
    /// `StoreAdmin::import`), all or nothing.
    ///
    /// The entries are checked and written, in groups of `IMPORT_GROUP`,
    /// into the staging table (`table::STAGE`), which no listing, export or
    /// read sees. Only when the iterator has ended without an error and
    /// every entry passed its checks is the staging table moved into the
    /// live tables ("publishing"). On any error the staged entries are
    /// deleted and the store is as it was. Crash safety (file store): the
    /// first publishing group writes `meta::PUBLISHING`, the last deletes
    /// it; an open that finds it finishes the move, and an open that finds
    /// staged entries without it deletes them (`recover_import`).
    pub(crate) fn import(&self, entries: &mut dyn Iterator<Item = Result<Entry>>) -> Result<u64> {
        if !self.is_empty()? {
            return Err(StateError::invalid(
                "import: the store is not empty; import into a new store",
            ));
        }
        // Leftovers of an earlier failed import (whose clean-up failed).
        self.discard_staged()?;
        match self.stage(entries) {
            Ok((n, next_seq)) => {
                self.publish(next_seq)?;
                Ok(n)
            }
            Err(e) => {
                // Nothing was published; what was staged goes. Should this
                // fail too, the next open of a file store deletes it.
                let _ = self.discard_staged();
                Err(e)
            }
        }
    }

    /// Stages every entry; returns how many, and the `next_seq` the store
    /// needs once they are live.
    fn stage(&self, entries: &mut dyn Iterator<Item = Result<Entry>>) -> Result<(u64, u64)> {
        let mut n = 0u64;
        let mut next_seq = 0u64;
        let mut group = Vec::with_capacity(IMPORT_GROUP);
        loop {
            let next = entries.next().transpose()?;
            let done = next.is_none();
            if let Some(e) = next {
                if let Entry::Run(r) = &e {
                    next_seq = next_seq.max(r.seq.saturating_add(1));
                }
                group.push(e);
            }
            if group.len() == IMPORT_GROUP || (done && !group.is_empty()) {
                n += group.len() as u64;
                self.import_group(std::mem::take(&mut group))?;
            }
            if done {
                return Ok((n, next_seq));
            }
        }
    }

    /// Up to `IMPORT_GROUP` staged pairs, from the engine.
    fn staged_chunk(&self) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let lo = [table::STAGE];
        let hi = [table::STAGE + 1];
        self.engine.scan(&lo, &hi, IMPORT_GROUP)
    }

    /// Deletes every staged entry.
    fn discard_staged(&self) -> Result<()> {
        loop {
            let chunk = self.staged_chunk()?;
            if chunk.is_empty() {
                return Ok(());
            }
            self.submit(move |txn: &mut Txn<'_>| {
                for (k, _) in chunk {
                    txn.delete(k);
                }
                Ok(())
            })?;
        }
    }

    /// Moves the staged entries into the live tables. The memory store
    /// does it in one group (it cannot crash half-way, and readers see the
    /// import appear at once); the file store in groups, the first of
    /// which writes `meta::PUBLISHING` (holding `next_seq`) and the last
    /// deletes it, so a crash in between is finished at the next open.
    fn publish(&self, next_seq: u64) -> Result<()> {
        let whole = self.file.is_none();
        let mut first = true;
        loop {
            let chunk = if whole {
                let (lo, hi) = ([table::STAGE], [table::STAGE + 1]);
                self.engine.scan(&lo, &hi, usize::MAX)?
            } else {
                self.staged_chunk()?
            };
            let last = whole || chunk.len() < IMPORT_GROUP;
            let mark = first && !last;
            // The chunk may hold alarms due at any time.
            let _lowered = self.alarm_floor.lower(0);
            self.submit(move |txn: &mut Txn<'_>| {
                for (k, v) in chunk {
                    txn.put(k[1..].to_vec(), v);
                    txn.delete(k);
                }
                if mark {
                    txn.put(meta::PUBLISHING.to_vec(), value::encode(&next_seq));
                }
                if last {
                    txn.next_seq = txn.next_seq.max(next_seq);
                    txn.delete(meta::PUBLISHING.to_vec());
                }
                Ok(())
            })?;
            if last {
                return Ok(());
            }
            first = false;
        }
    }

    /// At open: finishes an import a crash cut short while publishing, or
    /// deletes one that never got that far.
    pub(crate) fn recover_import(&self) -> Result<()> {
        match self.engine.get(meta::PUBLISHING)? {
            Some(v) => self.publish(value::decode(&v, "import next seq")?),
            None => self.discard_staged(),
        }
    }

    /// One atomic group of an import: runs keep their version, `seq` and
    /// timestamps; indexes are rebuilt. An entry whose record already
    /// exists is refused (`Conflict`).
    fn import_group(&self, entries: Vec<Entry>) -> Result<()> {
        let max = self.opts.record_bytes_max;
        let entries = entries
            .into_iter()
            .map(|e| checked_entry(e, &self.opts.scrubber, max))
            .collect::<Result<Vec<_>>>()?;
        self.submit(move |txn: &mut Txn<'_>| {
            // Every read and write below is of the staging table.
            txn.staged = true;
            let exists = |txn: &Txn<'_>, k: &[u8], e: &Entry| -> Result<()> {
                match txn.get(k)? {
                    Some(_) => Err(StateError::Conflict {
                        record: e.record_key(),
                        expected: 0,
                        actual: 1,
                    }),
                    None => Ok(()),
                }
            };
            for e in entries {
                match &e {
                    Entry::Run(r) => {
                        if let Some(s) = read_run(txn, &r.key)? {
                            return Err(StateError::Conflict {
                                record: e.record_key(),
                                expected: 0,
                                actual: s.version,
                            });
                        }
                        if txn.get(&run_key(&r.key.tenant, r.seq))?.is_some() {
                            return Err(StateError::invalid(format!(
                                "run {}: seq {} is already used in tenant {}",
                                r.key.run_id, r.seq, r.key.tenant
                            )));
                        }
                        write_run(txn, None, r, max, RunKeys::of(&r.key))?;
                    }
                    Entry::Session(s) => {
                        let k = session_key(&s.key);
                        exists(txn, &k, &e)?;
                        txn.put(k, value::encode_session(s));
                    }
                    Entry::Epoch { instance, epoch } => {
                        let k = epoch_key(instance);
                        exists(txn, &k, &e)?;
                        txn.put(k, value::encode(epoch));
                    }
                    Entry::Tray { key, tray } => {
                        let k = tray_key(key);
                        exists(txn, &k, &e)?;
                        super::trays::import_tray(txn, key, tray);
                    }
                    Entry::Hold { run, hold } => {
                        super::budgets::import_hold(txn, run, hold)?;
                    }
                    Entry::Budget { budget, spent } => {
                        super::budgets::import_budget(txn, budget.clone(), *spent)?;
                    }
                    Entry::Alarm { instance, due_at } => {
                        let k = alarm_key(instance);
                        exists(txn, &k, &e)?;
                        txn.put(k, value::encode(due_at));
                        txn.put(alarm_due_key(*due_at, instance), value::encode(&()));
                    }
                }
            }
            Ok(())
        })
    }
}

// Meta values sort before every exported table, so an export never
// carries the store's secret or counters.
const _: () = assert!(meta::FORMAT[0] < table::RUN);

impl KvStore {
    /// See `FileStore::__unindex_run_for_tests`.
    pub(crate) fn unindex_run_for_tests(&self, key: &RunKey) -> Result<()> {
        let key = key.clone();
        self.submit(move |txn| {
            let r = read_run(txn, &key)?.ok_or_else(|| {
                StateError::NotFound(agentstate_core::error::RecordKey::Run(key.clone()))
            })?;
            txn.delete(by_state_key(&key.tenant, r.state, r.seq));
            Ok(())
        })
    }
}
