//! Export and import: every record of a store as a sequence of entries, in
//! a deterministic order (runs, holds, sessions, budgets, epochs, trays,
//! alarms; each in
//! key order), and back into an empty store with versions, `seq`s and
//! timestamps kept, so export → import → export gives the same entries.

use crate::codec::cursor::Listing;
use crate::codec::value;
use crate::entry::Entry;
use crate::error::{Result, StateError};
use crate::kv::key::{KeyBuf, KeyReader, meta, table};
use crate::page::{Page, PageRequest};
use crate::record::RunKey;
use crate::rules::checked_entry;
use crate::tray::InstanceKey;

use super::KvStore;
use super::commit::Txn;
use super::runs::{by_seq_key, read_run, session_key, write_run};
use super::trays::{alarm_due_key, alarm_key, epoch_key, read_tray_key, tray_key};

/// Entries an import commits as one atomic group.
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
        table::SESSION => Entry::Session(value::decode(v, "session")?),
        table::HOLD => {
            let (run, hold) = super::budgets::hold_entry(k, v)?;
            Entry::Hold { run, hold }
        }
        table::BUDGET => {
            let key = crate::budget::BudgetKey::new(r.str()?, r.str()?);
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
    /// `StoreAdmin::import`), in atomic groups of `IMPORT_GROUP` entries.
    pub(crate) fn import(&self, entries: &mut dyn Iterator<Item = Result<Entry>>) -> Result<u64> {
        if !self.is_empty()? {
            return Err(StateError::invalid(
                "import: the store is not empty; import into a new store",
            ));
        }
        let mut n = 0u64;
        let mut group = Vec::with_capacity(IMPORT_GROUP);
        loop {
            let next = entries.next().transpose()?;
            let done = next.is_none();
            if let Some(e) = next {
                group.push(e);
            }
            if group.len() == IMPORT_GROUP || (done && !group.is_empty()) {
                n += group.len() as u64;
                self.import_group(std::mem::take(&mut group))?;
            }
            if done {
                return Ok(n);
            }
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
            let exists = |txn: &Txn<'_>, k: &[u8]| -> Result<()> {
                match txn.get(k)? {
                    Some(_) => Err(StateError::Conflict {
                        expected: 0,
                        actual: 1,
                    }),
                    None => Ok(()),
                }
            };
            for e in entries {
                match e {
                    Entry::Run(r) => {
                        if let Some(s) = read_run(txn, &r.key)? {
                            return Err(StateError::Conflict {
                                expected: 0,
                                actual: s.version,
                            });
                        }
                        if txn.get(&by_seq_key(&r.key.tenant, r.seq))?.is_some() {
                            return Err(StateError::invalid(format!(
                                "run {}: seq {} is already used in tenant {}",
                                r.key.run_id, r.seq, r.key.tenant
                            )));
                        }
                        txn.next_seq = txn.next_seq.max(r.seq + 1);
                        write_run(txn, None, &r, max)?;
                    }
                    Entry::Session(s) => {
                        let k = session_key(&s.key);
                        exists(txn, &k)?;
                        txn.put(k, value::encode(&s));
                    }
                    Entry::Epoch { instance, epoch } => {
                        let k = epoch_key(&instance);
                        exists(txn, &k)?;
                        txn.put(k, value::encode(&epoch));
                    }
                    Entry::Tray { key, tray } => {
                        let k = tray_key(&key);
                        exists(txn, &k)?;
                        super::trays::import_tray(txn, &key, &tray);
                    }
                    Entry::Hold { run, hold } => {
                        super::budgets::import_hold(txn, &run, &hold)?;
                    }
                    Entry::Budget { budget, spent } => {
                        super::budgets::import_budget(txn, budget, spent)?;
                    }
                    Entry::Alarm { instance, due_at } => {
                        let k = alarm_key(&instance);
                        exists(txn, &k)?;
                        txn.put(k, value::encode(&due_at));
                        txn.put(alarm_due_key(due_at, &instance), value::encode(&()));
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
            let r = read_run(txn, &key)?
                .ok_or_else(|| StateError::NotFound(crate::error::Missing::Run(key.clone())))?;
            txn.delete(by_seq_key(&key.tenant, r.seq));
            Ok(())
        })
    }
}
