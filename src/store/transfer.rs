//! Export and import: every record of a store as a sequence of entries, in
//! a deterministic order (runs, sessions, epochs, trays, alarms; each in
//! key order), and back into an empty store with versions, `seq`s and
//! timestamps kept, so export → import → export gives the same entries.

use serde::{Deserialize, Serialize};

use crate::codec::cursor::Listing;
use crate::codec::key::{KeyBuf, KeyReader, meta, table};
use crate::codec::value;
use crate::cursor::Cursor;
use crate::error::{Result, StateError};
use crate::record::{Millis, Page, RunKey, RunRecord, SessionRecord};
use crate::tray::{InstanceKey, Tray, TrayKey};

use super::commit::Txn;
use super::runs::{by_seq_key, check_record, read_run, session_key, write_run};
use super::trays::{
    alarm_due_key, alarm_key, check_instance, check_tray, check_tray_key, epoch_key, read_tray_key,
    tray_key,
};
use super::{Store, check_id};

/// One exported record. Serialized as one JSON object per line with a
/// `kind` field (`run`, `session`, `epoch`, `tray`, `alarm`); see the
/// README's "Export format".
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Entry {
    /// A run, exactly as stored.
    Run(RunRecord),
    /// A session, exactly as stored.
    Session(SessionRecord),
    /// An instance's stored epoch.
    Epoch {
        /// The instance.
        instance: InstanceKey,
        /// Its epoch.
        epoch: u64,
    },
    /// A tray.
    Tray {
        /// Its key.
        key: TrayKey,
        /// Its contents.
        tray: Tray,
    },
    /// An instance's alarm.
    Alarm {
        /// The instance.
        instance: InstanceKey,
        /// When it is due.
        due_at: Millis,
    },
}

/// The primary tables, in export order.
const TABLES: [u8; 5] = [
    table::RUN,
    table::SESSION,
    table::EPOCH,
    table::TRAY,
    table::ALARM,
];

fn entry_of(k: &[u8], v: &[u8]) -> Result<Entry> {
    let t = *k.first().ok_or_else(|| StateError::corrupt("empty key"))?;
    let mut r = KeyReader::new(k, t)?;
    Ok(match t {
        table::RUN => Entry::Run(value::decode(v, "run")?),
        table::SESSION => Entry::Session(value::decode(v, "session")?),
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

impl Store {
    /// One page of the whole store's records, for export. Walk it with the
    /// cursor like any listing; the order is deterministic.
    pub fn export_page(&self, limit: usize, cursor: Option<&Cursor>) -> Result<Page<Entry>> {
        let lo = KeyBuf::table(table::RUN).done();
        let hi = KeyBuf::table(table::ALARM + 1).done();
        self.scan_page(
            Listing::Export,
            b"export",
            &lo,
            &hi,
            cursor,
            limit,
            |k, v| {
                if TABLES.contains(&k[0]) {
                    entry_of(k, v).map(Some)
                } else {
                    Ok(None)
                }
            },
        )
    }

    /// True when the store holds no record of any kind.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.export_page(1, None)?.items().is_empty())
    }

    /// Writes exported entries back, in one atomic group: runs keep their
    /// version, `seq` and timestamps; indexes are rebuilt. An entry whose
    /// record already exists is refused (`Conflict`), so import into an
    /// empty store. Keep batches to a few thousand entries.
    pub fn import(&self, entries: Vec<Entry>) -> Result<()> {
        // Imported records meet every rule a write meets: ids (K1), sizes
        // (K2), pending calls (K5), and scrubbing (X1).
        let max = self.opts.record_bytes_max;
        let mut checked = Vec::with_capacity(entries.len());
        for e in entries {
            checked.push(match e {
                Entry::Run(r) => {
                    check_record(&r)?;
                    if r.seq == 0 || r.version == 0 {
                        return Err(StateError::invalid(format!(
                            "run {}: seq and version must be at least 1",
                            r.key.run_id
                        )));
                    }
                    Entry::Run(self.opts.scrubber.scrub_run(&r))
                }
                Entry::Session(s) => {
                    check_id("tenant", &s.key.tenant)?;
                    check_id("session_id", &s.key.session_id)?;
                    Entry::Session(s)
                }
                Entry::Epoch { instance, epoch } => {
                    check_instance(&instance)?;
                    Entry::Epoch { instance, epoch }
                }
                Entry::Alarm { instance, due_at } => {
                    check_instance(&instance)?;
                    Entry::Alarm { instance, due_at }
                }
                Entry::Tray { key, tray } => {
                    check_tray_key(&key)?;
                    check_tray(&tray, max)?;
                    Entry::Tray { key, tray }
                }
            });
        }
        let entries = checked;
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

impl Store {
    /// Deletes a run's `seq` index entry and nothing else, leaving the
    /// store inconsistent on purpose. Only for tests of `verify` and the
    /// tools built on it; never call it on a store you care about.
    #[doc(hidden)]
    pub fn __unindex_run_for_tests(&self, key: &RunKey) -> Result<()> {
        let key = key.clone();
        self.submit(move |txn| {
            let r = read_run(txn, &key)?
                .ok_or_else(|| StateError::NotFound(crate::error::Missing::Run(key.clone())))?;
            txn.delete(by_seq_key(&key.tenant, r.seq));
            Ok(())
        })
    }
}
