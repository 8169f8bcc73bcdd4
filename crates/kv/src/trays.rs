//! Trays, epochs and alarms (rules T1–T6, A1–A3).
//!
//! Every operation that names an instance runs its fence check inside the
//! same commit-path job as its reads and writes, so the check and the write
//! are one atomic step (T6).

use agentstate_core::idempotency::{IdempotencyKey, Keyed};
use serde::{Deserialize, Serialize};

use crate::key::table;
use agentstate_core::api::TrayStore;
use agentstate_core::codec::cursor::Listing;
use agentstate_core::codec::key::{KeyBuf, KeyReader, prefix_end};
use agentstate_core::codec::value;
use agentstate_core::error::{Result, StateError};
use agentstate_core::page::{Page, PageRequest};
use agentstate_core::record::Millis;
use agentstate_core::rules::{
    check_batch, check_epoch, check_instance, check_tray, check_tray_key,
};
use agentstate_core::tray::{Alarm, InstanceKey, MarkedTray, Tray, TrayFilter, TrayKey, TrayOp};

use super::commit::Txn;
use super::{KvStore, check_id, check_limit};

/// A lower bound, kept in memory, on the due time of every live entry of
/// the due-time index (`ALARM_BY_DUE`), so a due listing's first page
/// seeks past the tombstones that replaced and acknowledged alarms leave
/// below it (they stay in the engine's memtables and L0 tables until a
/// compaction into the last level drops them, and a scan from the index's
/// start steps over every one).
///
/// Invariant: every live entry that a reader's snapshot can hold has a due
/// time `>= at` when the reader reads `at`. It holds because:
/// - a writer of the index that can add an entry below `at` (`set_alarm`,
///   an import's publish) lowers `at` and counts itself in `started`
///   before it queues its write, and counts itself in `done` only after
///   its commit (or failure) is known;
/// - a first page raises `at` to the first live due time its snapshot
///   held (or past `now` when it held none at or below it) only when no
///   such writer was in flight when it read `at` (`started == done`) and
///   none started since (`started` unchanged): every write it could have
///   missed lowers `at` after the raise.
#[derive(Debug, Default)]
pub(crate) struct AlarmFloor(crate::sync::Mutex<Floor>);

#[derive(Debug, Default)]
struct Floor {
    at: Millis,
    started: u64,
    done: u64,
}

/// A writer of the due-time index in flight: counted in `done` when
/// dropped, whatever became of its write.
pub(crate) struct Lowered<'a>(&'a AlarmFloor);

impl Drop for Lowered<'_> {
    fn drop(&mut self) {
        self.0.0.lock().done += 1;
    }
}

impl AlarmFloor {
    /// Before a write that may add index entries due at `due` or later.
    pub(crate) fn lower(&self, due: Millis) -> Lowered<'_> {
        let mut f = self.0.lock();
        f.at = f.at.min(due);
        f.started += 1;
        Lowered(self)
    }

    /// Where a first page may start, and the token a raise needs (`None`
    /// while a writer is in flight).
    fn start(&self) -> (Millis, Option<u64>) {
        let f = self.0.lock();
        (f.at, (f.started == f.done).then_some(f.started))
    }

    /// After a first page read from `start()`'s bound: no live entry is
    /// due before `due`.
    fn raise(&self, token: u64, due: Millis) {
        let mut f = self.0.lock();
        if f.started == token {
            f.at = f.at.max(due);
        }
    }
}

/// Who to wake for a marked tray: the value of both marked indexes.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Waker {
    env: String,
    hostname: String,
}

pub(crate) fn epoch_key(i: &InstanceKey) -> Vec<u8> {
    KeyBuf::table(table::EPOCH).str(&i.ns).str(&i.id).done()
}
pub(crate) fn tray_key(k: &TrayKey) -> Vec<u8> {
    KeyBuf::table(table::TRAY)
        .str(&k.ns)
        .str(&k.id)
        .str(&k.tray_ns)
        .str(&k.tray_id)
        .done()
}
fn instance_trays(i: &InstanceKey) -> Vec<u8> {
    KeyBuf::table(table::TRAY).str(&i.ns).str(&i.id).done()
}
fn instance_marked(i: &InstanceKey) -> Vec<u8> {
    KeyBuf::table(table::MARKED).str(&i.ns).str(&i.id).done()
}
pub(crate) fn marked_key(k: &TrayKey) -> Vec<u8> {
    KeyBuf::table(table::MARKED)
        .str(&k.ns)
        .str(&k.id)
        .str(&k.tray_ns)
        .str(&k.tray_id)
        .done()
}
pub(crate) fn marked_env_key(env: &str, k: &TrayKey) -> Vec<u8> {
    KeyBuf::table(table::MARKED_BY_ENV)
        .str(env)
        .str(&k.ns)
        .str(&k.id)
        .str(&k.tray_ns)
        .str(&k.tray_id)
        .done()
}
pub(crate) fn alarm_key(i: &InstanceKey) -> Vec<u8> {
    KeyBuf::table(table::ALARM).str(&i.ns).str(&i.id).done()
}
pub(crate) fn alarm_due_key(due: Millis, i: &InstanceKey) -> Vec<u8> {
    KeyBuf::table(table::ALARM_BY_DUE)
        .u64(due)
        .str(&i.ns)
        .str(&i.id)
        .done()
}

/// Reads a tray key back from the trailing four components of `r`.
pub(crate) fn read_tray_key(r: &mut KeyReader<'_>) -> Result<TrayKey> {
    Ok(TrayKey {
        ns: r.str()?,
        id: r.str()?,
        tray_ns: r.str()?,
        tray_id: r.str()?,
    })
}

pub(crate) fn read_epoch(txn: &Txn<'_>, i: &InstanceKey) -> Result<u64> {
    txn.get(&epoch_key(i))?
        .map(|v| value::decode(&v, "epoch"))
        .transpose()
        .map(|e| e.unwrap_or(0))
}

/// T2: below the stored epoch is `FenceLost`; above it advances it.
fn fence(txn: &mut Txn<'_>, i: &InstanceKey, epoch: u64) -> Result<()> {
    let stored = read_epoch(txn, i)?;
    if epoch < stored {
        return Err(StateError::FenceLost {
            instance: i.clone(),
            caller: epoch,
            stored,
        });
    }
    if epoch > stored {
        txn.put(epoch_key(i), value::encode(&epoch));
    }
    Ok(())
}

fn read_tray(txn: &Txn<'_>, k: &TrayKey) -> Result<Option<Tray>> {
    txn.get(&tray_key(k))?
        .map(|v| value::decode(&v, "tray"))
        .transpose()
}

/// The marked indexes' value of a tray, or `None` when it is not marked.
fn waker(t: &Tray) -> Option<(&str, &str)> {
    t.marked.then_some((t.env.as_str(), t.hostname.as_str()))
}

/// Writes (`Some`) or deletes (`None`) a tray with its marked indexes.
///
/// The marked index entries are written only when they change: a tray is
/// rewritten far more often than it is marked or unmarked, and every
/// write of a key leaves one more version of it in the engine's memtable
/// for each range scan of the index (`marked_trays`, `release`) to step
/// over until the memtable is flushed.
fn set_tray(txn: &mut Txn<'_>, k: &TrayKey, new: Option<&Tray>) -> Result<bool> {
    let old = read_tray(txn, k)?;
    let was = old.as_ref().and_then(waker);
    let now = new.and_then(waker);
    if was != now {
        if let Some((env, _)) = was {
            txn.delete(marked_key(k));
            txn.delete(marked_env_key(env, k));
        }
        if let Some((env, hostname)) = now {
            let w = value::encode(&Waker {
                env: env.to_string(),
                hostname: hostname.to_string(),
            });
            txn.put(marked_key(k), w.clone());
            txn.put(marked_env_key(env, k), w);
        }
    }
    match new {
        Some(t) => txn.put(tray_key(k), value::encode(t)),
        None => txn.delete(tray_key(k)),
    }
    Ok(old.is_some())
}

impl TrayStore for KvStore {
    fn read_tray(&self, key: &TrayKey, epoch: u64) -> Result<Option<Tray>> {
        check_tray_key(key)?;
        check_epoch(epoch)?;
        let key = key.clone();
        self.submit(move |txn| {
            fence(txn, &key.instance(), epoch)?;
            read_tray(txn, &key)
        })
    }

    fn write_tray(&self, key: &TrayKey, epoch: u64, tray: Tray) -> Result<()> {
        check_tray_key(key)?;
        check_epoch(epoch)?;
        check_tray(&tray, self.opts.record_bytes_max)?;
        let key = key.clone();
        self.submit(move |txn| {
            fence(txn, &key.instance(), epoch)?;
            set_tray(txn, &key, Some(&tray)).map(|_| ())
        })
    }

    fn delete_tray(&self, key: &TrayKey, epoch: u64) -> Result<bool> {
        check_tray_key(key)?;
        check_epoch(epoch)?;
        let key = key.clone();
        self.submit(move |txn| {
            fence(txn, &key.instance(), epoch)?;
            set_tray(txn, &key, None)
        })
    }

    fn apply_batch(&self, instance: &InstanceKey, epoch: u64, ops: Vec<TrayOp>) -> Result<()> {
        self.apply_batch_with(instance, epoch, ops, None)
    }
    fn apply_batch_idempotent(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        ops: Vec<TrayOp>,
        key: &IdempotencyKey,
    ) -> Result<()> {
        let keyed = Keyed::apply_batch(instance, epoch, &ops, key)?;
        self.apply_batch_with(instance, epoch, ops, Some(keyed))
    }

    fn release(&self, instance: &InstanceKey, epoch: u64) -> Result<()> {
        check_instance(instance)?;
        check_epoch(epoch)?;
        let instance = instance.clone();
        self.submit(move |txn| {
            // T4: an older placement's release is a no-op, not an error.
            if epoch < read_epoch(txn, &instance)? {
                return Ok(());
            }
            fence(txn, &instance, epoch)?;
            // The instance's marked trays, from the marked index: its
            // entries change only when a tray is marked or unmarked, while
            // the trays themselves are rewritten on every write, so a scan
            // of the trays would step over every version of them that the
            // engine's memtable still holds.
            let prefix = instance_marked(&instance);
            for (k, _) in txn.scan(&prefix, &prefix_end(&prefix), usize::MAX)? {
                let mut r = KeyReader::new(&k, table::MARKED)?;
                let key = read_tray_key(&mut r)?;
                r.end()?;
                let mut tray = read_tray(txn, &key)?.ok_or_else(|| {
                    StateError::corrupt(format!(
                        "marked index names tray {}/{}/{}/{}, which is not stored",
                        key.ns, key.id, key.tray_ns, key.tray_id
                    ))
                })?;
                tray.marked = false;
                set_tray(txn, &key, Some(&tray))?;
            }
            Ok(())
        })
    }

    fn list_trays(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        page: &PageRequest,
    ) -> Result<Page<(TrayKey, Tray)>> {
        check_instance(instance)?;
        check_epoch(epoch)?;
        check_limit(page.limit)?;
        let prefix = instance_trays(instance);
        // E6: a cursor of another listing fails before the fence below can
        // advance the epoch, so the failed call changes nothing.
        if let Some(c) = &page.cursor {
            agentstate_core::codec::cursor::decode(&self.secret, Listing::Trays, &prefix, c)?;
        }
        // The fence check (which may advance the epoch) goes through the
        // commit path; the page is then read like every other listing.
        let inst = instance.clone();
        self.submit(move |txn| fence(txn, &inst, epoch))?;
        self.scan_page(
            Listing::Trays,
            &prefix,
            &prefix,
            &prefix_end(&prefix),
            page,
            |k, v| {
                let mut r = KeyReader::new(k, table::TRAY)?;
                let key = read_tray_key(&mut r)?;
                r.end()?;
                Ok(Some((key, value::decode(v, "tray")?)))
            },
        )
    }

    fn instance_trays(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        filter: &TrayFilter,
    ) -> Result<Vec<(TrayKey, Tray)>> {
        check_instance(instance)?;
        check_epoch(epoch)?;
        filter.check()?;
        // A tray namespace narrows the scan to its trays: a key's
        // components are self-delimiting and order as their bytes do, so
        // the instance's trays of one namespace are one range, in
        // (tray_ns, tray_id) order.
        let prefix = match &filter.tray_ns {
            Some(ns) => KeyBuf::table(table::TRAY)
                .str(&instance.ns)
                .str(&instance.id)
                .str(ns)
                .done(),
            None => instance_trays(instance),
        };
        // T2 through the commit path (it may advance the epoch), then one
        // scan: every engine's `scan` reads at one moment (memory: under
        // its read lock; fjall: one snapshot; sled: under the gate that
        // commits wait for), and sees only what is durable (D9).
        let inst = instance.clone();
        self.submit(move |txn| fence(txn, &inst, epoch))?;
        let mut out = Vec::new();
        for (k, v) in self
            .engine
            .scan(&prefix, &prefix_end(&prefix), usize::MAX)?
        {
            let tray: Tray = value::decode(&v, "tray")?;
            if filter.marked.is_some_and(|m| m != tray.marked) {
                continue;
            }
            let mut r = KeyReader::new(&k, table::TRAY)?;
            let key = read_tray_key(&mut r)?;
            r.end()?;
            out.push((key, tray));
        }
        Ok(out)
    }

    fn marked_trays(&self, env: Option<&str>, page: &PageRequest) -> Result<Page<MarkedTray>> {
        if let Some(e) = env {
            check_id("env", e)?;
        }
        let (prefix, table_byte) = match env {
            Some(e) => (
                KeyBuf::table(table::MARKED_BY_ENV).str(e).done(),
                table::MARKED_BY_ENV,
            ),
            None => (KeyBuf::table(table::MARKED).done(), table::MARKED),
        };
        self.scan_page(
            Listing::Marked,
            &prefix,
            &prefix,
            &prefix_end(&prefix),
            page,
            |k, v| {
                let mut r = KeyReader::new(k, table_byte)?;
                if table_byte == table::MARKED_BY_ENV {
                    r.str()?;
                }
                let key = read_tray_key(&mut r)?;
                r.end()?;
                let w: Waker = value::decode(v, "marked index entry")?;
                Ok(Some(MarkedTray::new(key, w.env, w.hostname)))
            },
        )
    }

    fn epoch(&self, instance: &InstanceKey) -> Result<u64> {
        check_instance(instance)?;
        self.engine
            .get(&epoch_key(instance))?
            .map(|v| value::decode(&v, "epoch"))
            .transpose()
            .map(|e| e.unwrap_or(0))
    }

    fn set_alarm(&self, instance: &InstanceKey, epoch: u64, due_at: Millis) -> Result<()> {
        check_instance(instance)?;
        check_epoch(epoch)?;
        let instance = instance.clone();
        let _lowered = self.alarm_floor.lower(due_at);
        self.submit(move |txn| {
            fence(txn, &instance, epoch)?;
            let k = alarm_key(&instance);
            if let Some(old) = txn.get(&k)? {
                let old: Millis = value::decode(&old, "alarm")?;
                // The same alarm again writes nothing (each write leaves a
                // version for `due_alarms` to step over).
                if old == due_at {
                    return Ok(());
                }
                txn.delete(alarm_due_key(old, &instance));
            }
            txn.put(k, value::encode(&due_at));
            txn.put(alarm_due_key(due_at, &instance), value::encode(&()));
            Ok(())
        })
    }

    fn due_alarms(&self, now: Millis, page: &PageRequest) -> Result<Page<Alarm>> {
        let index = KeyBuf::table(table::ALARM_BY_DUE).done();
        let hi = match now.checked_add(1) {
            Some(n) => KeyBuf::table(table::ALARM_BY_DUE).u64(n).done(),
            None => prefix_end(&index),
        };
        // A first page starts at the floor (no live entry is below it); a
        // later one at its cursor, checked against the whole index.
        let (lo, raise) = match page.cursor {
            None => {
                let (at, token) = self.alarm_floor.start();
                (KeyBuf::table(table::ALARM_BY_DUE).u64(at).done(), token)
            }
            Some(_) => (index.clone(), None),
        };
        let answer = self.scan_page(Listing::Alarms, &index, &lo, &hi, page, |k, _| {
            let mut r = KeyReader::new(k, table::ALARM_BY_DUE)?;
            let due_at = r.u64()?;
            let instance = InstanceKey {
                ns: r.str()?,
                id: r.str()?,
            };
            r.end()?;
            Ok(Some(Alarm::new(instance, due_at)))
        })?;
        if let Some(token) = raise {
            let first = match answer.items().first() {
                Some(a) => a.due_at,
                None => now.saturating_add(1),
            };
            self.alarm_floor.raise(token, first);
        }
        Ok(answer)
    }

    fn ack_alarm(&self, instance: &InstanceKey, epoch: u64, due_at: Millis) -> Result<bool> {
        check_instance(instance)?;
        check_epoch(epoch)?;
        let instance = instance.clone();
        self.submit(move |txn| {
            fence(txn, &instance, epoch)?;
            let k = alarm_key(&instance);
            let Some(stored) = txn.get(&k)? else {
                return Ok(false);
            };
            let stored: Millis = value::decode(&stored, "alarm")?;
            // A3: an ack for a replaced alarm removes nothing.
            if stored != due_at {
                return Ok(false);
            }
            txn.delete(k);
            txn.delete(alarm_due_key(due_at, &instance));
            Ok(true)
        })
    }
}

/// Writes an imported tray and its marked indexes (the key is free).
pub(crate) fn import_tray(txn: &mut Txn<'_>, k: &TrayKey, t: &Tray) {
    if t.marked {
        let w = value::encode(&Waker {
            env: t.env.clone(),
            hostname: t.hostname.clone(),
        });
        txn.put(marked_key(k), w.clone());
        txn.put(marked_env_key(&t.env, k), w);
    }
    txn.put(tray_key(k), value::encode(t));
}

impl KvStore {
    // Rule T3: the fence once, then every op in one job.
    pub(crate) fn apply_batch_with(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        ops: Vec<TrayOp>,
        keyed: Option<Keyed<'_>>,
    ) -> Result<()> {
        check_batch(instance, &ops, self.opts.record_bytes_max)?;
        check_epoch(epoch)?;
        let instance = instance.clone();
        self.submit_keyed(keyed, move |txn| {
            fence(txn, &instance, epoch)?;
            for op in ops {
                match op {
                    TrayOp::Put {
                        tray_ns,
                        tray_id,
                        tray,
                    } => {
                        set_tray(txn, &instance.tray(tray_ns, tray_id), Some(&tray))?;
                    }
                    TrayOp::Delete { tray_ns, tray_id } => {
                        set_tray(txn, &instance.tray(tray_ns, tray_id), None)?;
                    }
                }
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::{FileStore, MemoryStore};
    use agentstate_core::api::TrayStore;
    use agentstate_core::page::PageRequest;
    use agentstate_core::tray::{Alarm, InstanceKey};

    fn inst(n: u64) -> InstanceKey {
        InstanceKey::new("floor", format!("i{n}"))
    }

    /// Every due alarm, following cursors.
    fn all_due(s: &dyn TrayStore, now: u64, limit: usize) -> Vec<Alarm> {
        let mut out = Vec::new();
        let mut page = PageRequest::new(limit);
        loop {
            let p = s.due_alarms(now, &page).expect("due_alarms");
            out.extend(p.items().iter().cloned());
            match p.cursor() {
                Some(c) => page = PageRequest::new(limit).after(Some(c)),
                None => return out,
            }
        }
    }

    /// The floor a first page raises never hides an alarm set below it
    /// afterwards, nor one a later page reaches by its cursor.
    #[test]
    fn alarm_floor_keeps_every_alarm_due() {
        let s = MemoryStore::new();
        let due = |now| {
            all_due(&s, now, 1)
                .into_iter()
                .map(|a| (a.instance.id, a.due_at))
                .collect::<Vec<_>>()
        };
        s.set_alarm(&inst(1), 0, 1_000).unwrap();
        assert_eq!(due(2_000), [("i1".to_string(), 1_000)]);
        // Below the floor the first page raised to 1000.
        s.set_alarm(&inst(2), 0, 10).unwrap();
        assert_eq!(due(2_000), [("i2".into(), 10), ("i1".into(), 1_000)]);
        // Nothing due: the floor moves past `now`; an alarm below it and
        // an earlier `now` still answer.
        assert!(s.ack_alarm(&inst(1), 0, 1_000).unwrap());
        assert!(s.ack_alarm(&inst(2), 0, 10).unwrap());
        assert_eq!(due(5_000), []);
        s.set_alarm(&inst(3), 0, 3).unwrap();
        assert_eq!(due(2), []);
        assert_eq!(due(3), [("i3".into(), 3)]);
        // Replacing an alarm with an earlier one.
        s.set_alarm(&inst(4), 0, 7_000).unwrap();
        assert_eq!(due(9_000), [("i3".into(), 3), ("i4".into(), 7_000)]);
        assert!(s.ack_alarm(&inst(3), 0, 3).unwrap());
        assert_eq!(due(9_000), [("i4".into(), 7_000)]);
        s.set_alarm(&inst(4), 0, 5).unwrap();
        assert_eq!(due(9_000), [("i4".into(), 5)]);
        // An import publishes alarms of any time.
        let entries: Vec<_> = {
            let mut page = PageRequest::new(100);
            let mut out = Vec::new();
            loop {
                let p = agentstate_core::admin::StoreAdmin::export_page(&s, &page).unwrap();
                out.extend(p.items().iter().cloned());
                match p.cursor() {
                    Some(c) => page = PageRequest::new(100).after(Some(c)),
                    None => break out,
                }
            }
        };
        // The empty store's first page raises its floor past `now`.
        let u = MemoryStore::new();
        assert!(all_due(&u, 9_000, 10).is_empty());
        agentstate_core::admin::StoreAdmin::import(&u, &mut entries.into_iter().map(Ok)).unwrap();
        assert_eq!(
            all_due(&u, 9_000, 10)
                .into_iter()
                .map(|a| (a.instance.id, a.due_at))
                .collect::<Vec<_>>(),
            [("i4".to_string(), 5)]
        );
    }

    /// Writers set alarms at random times while readers list due ones
    /// (and so raise the floor): a writer's alarm is due as soon as its
    /// set returns, until it acks it.
    fn race(s: Arc<dyn TrayStore + Send + Sync>, rounds: u64) {
        const NOW: u64 = 1 << 20;
        let writers: Vec<_> = (0..3u64)
            .map(|w| {
                let s = Arc::clone(&s);
                std::thread::spawn(move || {
                    let mut x = 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(w + 1);
                    for _ in 0..rounds {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let due = x % NOW;
                        s.set_alarm(&inst(w), 0, due).unwrap();
                        let seen = all_due(&*s, NOW, 2);
                        assert!(
                            seen.iter()
                                .any(|a| a.instance == inst(w) && a.due_at == due),
                            "alarm {w}@{due} missing from {seen:?}"
                        );
                        if x.is_multiple_of(3) {
                            assert!(s.ack_alarm(&inst(w), 0, due).unwrap());
                        }
                    }
                })
            })
            .collect();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let readers: Vec<_> = (0..2u64)
            .map(|r| {
                let (s, stop) = (Arc::clone(&s), Arc::clone(&stop));
                std::thread::spawn(move || {
                    let mut n = r;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        n += 1;
                        let now = (n * 7_919) % (NOW + NOW / 8);
                        s.due_alarms(now, &PageRequest::new(1)).unwrap();
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().expect("writer");
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for r in readers {
            r.join().expect("reader");
        }
    }

    #[test]
    fn alarm_floor_races_memory() {
        race(Arc::new(MemoryStore::new()), 2_000);
    }

    #[test]
    fn alarm_floor_races_file() {
        let dir = tempfile::tempdir().unwrap();
        race(
            Arc::new(FileStore::open(dir.path().join("s")).unwrap()),
            150,
        );
    }
}
