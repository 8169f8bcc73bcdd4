//! Whole-store checks and counts: `verify` walks every record and index
//! entry and reports what disagrees; `stats` counts; `prune` is retention.

use std::collections::HashSet;

use crate::codec::value;
use crate::error::{Result, StateError};
use crate::kv::key::{KeyBuf, KeyReader, meta, prefix_end, successor, table};
use crate::record::{Millis, RunKey, RunRecord, RunState, SessionRecord};
use crate::tray::{InstanceKey, Tray};

use super::runs::{
    by_seq_key, by_session_key, by_state_key, decode_run, delete_run, read_run, run_key,
};
use super::trays::{alarm_due_key, alarm_key, marked_env_key, marked_key, read_tray_key, tray_key};
use super::{KvStore, check_id};
use crate::admin::{StoreStats, VerifyReport};

const WALK_CHUNK: usize = 1024;

impl KvStore {
    /// Calls `f` on every entry of a table, in key order, a chunk at a time.
    pub(crate) fn walk(
        &self,
        table_byte: u8,
        mut f: impl FnMut(&[u8], &[u8]) -> Result<()>,
    ) -> Result<()> {
        let lo = KeyBuf::table(table_byte).done();
        let hi = prefix_end(&lo);
        let mut start = lo;
        loop {
            let chunk = self.engine.scan(&start, &hi, WALK_CHUNK)?;
            let n = chunk.len();
            for (k, v) in &chunk {
                f(k, v)?;
            }
            match chunk.last() {
                Some((k, _)) if n == WALK_CHUNK => start = successor(k),
                _ => return Ok(()),
            }
        }
    }

    /// Walks every record and index entry and reports every inconsistency:
    /// values that fail their checksum, index entries without their record,
    /// records without their index entries, duplicate or future `seq`s.
    /// Reading is all it does. Walks run concurrently with writes may report
    /// entries written during the walk; run it on a quiet store.
    pub(crate) fn verify(&self) -> Result<VerifyReport> {
        let mut rep = VerifyReport::default();
        let next_seq = self.committer.counters().next_seq;
        for k in [meta::FORMAT, meta::NEXT_SEQ, meta::COMMITS, meta::SECRET] {
            if self.engine.get(k)?.is_none() {
                rep.problems
                    .push(format!("meta value {:?} missing", k[1] as char));
            }
        }
        let mut problems = Vec::new();
        let mut p = |s: String| problems.push(s);
        let mut seqs = HashSet::new();
        let mut entries = 0u64;
        self.walk(table::RUN, |k, v| {
            entries += 1;
            rep.runs += 1;
            let key = match KeyReader::new(k, table::RUN)
                .and_then(|mut r| Ok(RunKey::new(r.str()?, r.str()?)))
            {
                Ok(key) => key,
                Err(e) => {
                    p(format!("run key undecodable: {e}"));
                    return Ok(());
                }
            };
            let r = match decode_run(v, &key) {
                Ok(r) => r,
                Err(e) => {
                    p(format!("run {}/{}: {e}", key.tenant, key.run_id));
                    return Ok(());
                }
            };
            if r.seq == 0 || r.seq >= next_seq {
                p(format!(
                    "run {}/{}: seq {} outside 1..{next_seq}",
                    key.tenant, key.run_id, r.seq
                ));
            }
            // Listings order a tenant's runs by seq: it must be unique
            // within the tenant.
            if !seqs.insert((key.tenant.clone(), r.seq)) {
                p(format!(
                    "run {}/{}: seq {} used twice",
                    key.tenant, key.run_id, r.seq
                ));
            }
            let id = value::encode(&r.key.run_id);
            let t = &key.tenant;
            let mut want = vec![
                ("seq", by_seq_key(t, r.seq)),
                ("state", by_state_key(t, r.state, r.seq)),
            ];
            if let Some(s) = &r.session_id {
                want.push(("session", by_session_key(t, s, r.seq)));
            }
            for (what, ik) in want {
                if self.engine.get(&ik)?.as_deref() != Some(id.as_slice()) {
                    p(format!(
                        "run {}/{}: {what} index entry missing or wrong",
                        key.tenant, key.run_id
                    ));
                }
            }
            Ok(())
        })?;
        for tb in [
            table::RUN_BY_SEQ,
            table::RUN_BY_STATE,
            table::RUN_BY_SESSION,
        ] {
            self.walk(tb, |k, v| {
                entries += 1;
                let check = || -> Result<bool> {
                    let mut r = KeyReader::new(k, tb)?;
                    let tenant = r.str()?;
                    let state = if tb == table::RUN_BY_STATE {
                        Some(r.u8()?)
                    } else {
                        None
                    };
                    let session = if tb == table::RUN_BY_SESSION {
                        Some(r.str()?)
                    } else {
                        None
                    };
                    let seq = r.u64()?;
                    r.end()?;
                    let run_id: String = value::decode(v, "run index entry")?;
                    let Some(bytes) = self
                        .engine
                        .get(&run_key(&RunKey::new(tenant.clone(), run_id.clone())))?
                    else {
                        return Ok(false);
                    };
                    let run = decode_run(&bytes, &RunKey::new(tenant, run_id))?;
                    Ok(run.seq == seq
                        && state.is_none_or(|s| s == run.state.tag())
                        && session.is_none_or(|s| run.session_id.as_deref() == Some(s.as_str())))
                };
                match check() {
                    Ok(true) => {}
                    Ok(false) => p(format!(
                        "index entry (table {tb:#04x}) points at no matching run"
                    )),
                    Err(e) => p(format!("index entry (table {tb:#04x}): {e}")),
                }
                Ok(())
            })?;
        }
        self.walk(table::SESSION, |_, v| {
            entries += 1;
            rep.sessions += 1;
            if let Err(e) = value::decode::<SessionRecord>(v, "session") {
                p(e.to_string());
            }
            Ok(())
        })?;
        self.walk(table::EPOCH, |_, v| {
            entries += 1;
            if let Err(e) = value::decode::<u64>(v, "epoch") {
                p(e.to_string());
            }
            Ok(())
        })?;
        let mut marked = 0u64;
        self.walk(table::TRAY, |k, v| {
            entries += 1;
            rep.trays += 1;
            let mut check = || -> Result<()> {
                let key = read_tray_key(&mut KeyReader::new(k, table::TRAY)?)?;
                let tray: Tray = value::decode(v, "tray")?;
                if tray.marked {
                    marked += 1;
                    if self.engine.get(&marked_key(&key))?.is_none()
                        || self.engine.get(&marked_env_key(&tray.env, &key))?.is_none()
                    {
                        return Err(StateError::corrupt(format!(
                            "marked tray {}/{}/{}/{} missing from the sweeper's index",
                            key.ns, key.id, key.tray_ns, key.tray_id
                        )));
                    }
                }
                Ok(())
            };
            if let Err(e) = check() {
                p(e.to_string());
            }
            Ok(())
        })?;
        for tb in [table::MARKED, table::MARKED_BY_ENV] {
            let mut n = 0u64;
            self.walk(tb, |k, _| {
                entries += 1;
                n += 1;
                let check = || -> Result<bool> {
                    let mut r = KeyReader::new(k, tb)?;
                    let env = if tb == table::MARKED_BY_ENV {
                        Some(r.str()?)
                    } else {
                        None
                    };
                    let key = read_tray_key(&mut r)?;
                    let Some(t) = self.engine.get(&tray_key(&key))? else {
                        return Ok(false);
                    };
                    let t: Tray = value::decode(&t, "tray")?;
                    Ok(t.marked && env.is_none_or(|e| e == t.env))
                };
                if !matches!(check(), Ok(true)) {
                    p(format!(
                        "sweeper index entry (table {tb:#04x}) points at no marked tray"
                    ));
                }
                Ok(())
            })?;
            if n != marked {
                p(format!(
                    "sweeper index (table {tb:#04x}) has {n} entries for {marked} marked trays"
                ));
            }
        }
        self.walk(table::ALARM, |k, v| {
            entries += 1;
            rep.alarms += 1;
            let check = || -> Result<bool> {
                let mut r = KeyReader::new(k, table::ALARM)?;
                let i = InstanceKey {
                    ns: r.str()?,
                    id: r.str()?,
                };
                let due: Millis = value::decode(v, "alarm")?;
                Ok(self.engine.get(&alarm_due_key(due, &i))?.is_some())
            };
            if !matches!(check(), Ok(true)) {
                p("alarm without its due-index entry, or undecodable".to_string());
            }
            Ok(())
        })?;
        self.walk(table::ALARM_BY_DUE, |k, _| {
            entries += 1;
            let check = || -> Result<bool> {
                let mut r = KeyReader::new(k, table::ALARM_BY_DUE)?;
                let due = r.u64()?;
                let i = InstanceKey {
                    ns: r.str()?,
                    id: r.str()?,
                };
                let Some(v) = self.engine.get(&alarm_key(&i))? else {
                    return Ok(false);
                };
                Ok(value::decode::<Millis>(&v, "alarm")? == due)
            };
            if !matches!(check(), Ok(true)) {
                p("due-index entry without its alarm".to_string());
            }
            Ok(())
        })?;
        rep.entries = entries;
        rep.problems.extend(problems);
        self.verify_budgets(&mut rep)?;
        Ok(rep)
    }

    /// Counts runs per tenant and state, sessions, trays and alarms.
    pub(crate) fn stats(&self) -> Result<StoreStats> {
        let mut s = StoreStats {
            disk_bytes: self.engine.disk_bytes(),
            backend: match (self.path(), self.opts.durability) {
                (None, _) => "memory: in this process only".to_string(),
                (Some(p), crate::options::Durability::Immediate) => format!(
                    "file {} ({}): every Ok synced (fdatasync per commit group)",
                    p.display(),
                    self.opts.engine.name()
                ),
                (Some(p), _) => format!(
                    "file {} ({}): buffered (an Ok survives a process crash, not an OS crash)",
                    p.display(),
                    self.opts.engine.name()
                ),
            },
            ..Default::default()
        };
        self.walk(table::RUN_BY_STATE, |k, _| {
            let mut r = KeyReader::new(k, table::RUN_BY_STATE)?;
            let tenant = r.str()?;
            let tag = r.u8()?;
            let state = RunState::ALL
                .into_iter()
                .find(|st| st.tag() == tag)
                .ok_or_else(|| StateError::corrupt(format!("unknown state tag {tag}")))?;
            *s.tenants
                .entry(tenant)
                .or_default()
                .runs_by_state
                .entry(state)
                .or_default() += 1;
            Ok(())
        })?;
        self.walk(table::SESSION, |k, _| {
            let tenant = KeyReader::new(k, table::SESSION)?.str()?;
            s.tenants.entry(tenant).or_default().sessions += 1;
            Ok(())
        })?;
        self.budget_stats(&mut s)?;
        self.walk(table::TRAY, |_, _| {
            s.trays += 1;
            Ok(())
        })?;
        self.walk(table::MARKED, |_, _| {
            s.marked_trays += 1;
            Ok(())
        })?;
        self.walk(table::ALARM, |_, _| {
            s.alarms += 1;
            Ok(())
        })?;
        Ok(s)
    }

    /// Retention: deletes the tenant's finished runs (`Completed`, `Failed`,
    /// `Cancelled`) last written before `finished_before`, and returns how
    /// many. Never touches an unfinished run: each deletion re-checks the
    /// run inside the commit path, so a run that was revived or rewritten
    /// meanwhile stays. Safe while workers and listings run: listings skip
    /// deleted runs, and deletes go in groups of at most 256.
    pub(crate) fn prune(&self, tenant: &str, finished_before: Millis) -> Result<u64> {
        check_id("tenant", tenant)?;
        let mut deleted = 0u64;
        for state in RunState::ALL.into_iter().filter(|s| s.is_finished()) {
            let prefix = KeyBuf::table(table::RUN_BY_STATE)
                .str(tenant)
                .u8(state.tag())
                .done();
            let hi = prefix_end(&prefix);
            let mut start = prefix.clone();
            loop {
                let chunk = self.engine.scan(&start, &hi, 256)?;
                let Some((last, _)) = chunk.last() else { break };
                start = successor(last);
                let mut keys = Vec::new();
                for (_, v) in &chunk {
                    let run_id: String = value::decode(v, "run index entry")?;
                    keys.push(RunKey::new(tenant, run_id));
                }
                let n = self.submit(move |txn| {
                    let mut n = 0u64;
                    for k in keys {
                        let Some(r): Option<RunRecord> = read_run(txn, &k)? else {
                            continue;
                        };
                        if r.state.is_finished() && r.updated_at < finished_before {
                            delete_run(txn, &r)?;
                            n += 1;
                        }
                    }
                    Ok(n)
                })?;
                deleted += n;
                if chunk.len() < 256 {
                    break;
                }
            }
        }
        Ok(deleted)
    }
}
