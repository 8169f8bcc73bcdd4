//! Whole-store checks and counts: `verify` walks every record and index
//! entry and reports what disagrees; `stats` counts; `prune` is retention.

use crate::key::{meta, table};
use agentstate_core::codec::key::{KeyBuf, KeyReader, prefix_end, successor};
use agentstate_core::codec::value;
use agentstate_core::error::{Result, StateError};
use agentstate_core::record::{Millis, RunRecord, RunState};
use agentstate_core::tray::{InstanceKey, Tray};

use super::runs::{
    RunSummary, by_session_key, by_state_key, by_touch_key, decode_run_at, decode_seq, delete_run,
    label_keys, read_run_by_seq, run_id_key, run_key, state_entry,
};
use super::trays::{alarm_due_key, alarm_key, marked_env_key, marked_key, read_tray_key, tray_key};
use super::{KvStore, check_id};
use agentstate_core::admin::{StoreStats, VerifyReport};

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
        let mut entries = 0u64;
        rep.runs = self.verify_runs(next_seq, &mut entries, &mut p)?;
        self.walk(table::SESSION, |_, v| {
            entries += 1;
            rep.sessions += 1;
            if let Err(e) = value::decode_session(v) {
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
        self.verify_feed(&mut rep)?;
        self.verify_budgets(&mut rep)?;
        Ok(rep)
    }

    /// Counts runs per tenant and state, sessions, trays and alarms.
    pub(crate) fn stats(&self) -> Result<StoreStats> {
        let mut s = StoreStats::default();
        s.disk_bytes = self.engine.disk_bytes();
        s.backend = match (self.path(), self.opts.durability) {
            (None, _) => "memory: in this process only".to_string(),
            (Some(p), agentstate_core::options::Durability::Immediate) => format!(
                "file {} ({}): every Ok synced (fdatasync per commit group)",
                p.display(),
                self.opts.engine.name()
            ),
            (Some(p), _) => format!(
                "file {} ({}): buffered (an Ok survives a process crash, not an OS crash)",
                p.display(),
                self.opts.engine.name()
            ),
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
    #[allow(
        clippy::expect_used,
        reason = "a slice cut to a fixed length by its range converts to an array of that length"
    )]
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
                let plen = prefix.len();
                let seqs = chunk
                    .iter()
                    .map(|(k, _)| {
                        k.get(plen..plen + 8)
                            .map(|b| u64::from_be_bytes(b.try_into().expect("8 bytes")))
                            .ok_or_else(|| StateError::corrupt("run index key truncated"))
                    })
                    .collect::<Result<Vec<u64>>>()?;
                let tenant = tenant.to_string();
                let n = self.submit(move |txn| {
                    let mut n = 0u64;
                    for seq in seqs {
                        let Some(r): Option<RunRecord> = read_run_by_seq(txn, &tenant, seq)? else {
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

impl KvStore {
    /// P1 in one group: every table whose keys start with the tenant, and
    /// the tenant's idempotency scope.
    pub(crate) fn purge_tenant(&self, tenant: &str) -> Result<u64> {
        check_id("tenant", tenant)?;
        let tenant = tenant.to_owned();
        let secret = self.secret;
        self.submit(move |txn| {
            let mut counted = 0u64;
            for (tb, counts) in [
                (table::RUN, true),
                (table::RUN_ID, false),
                (table::RUN_BY_STATE, false),
                (table::RUN_BY_SESSION, false),
                (table::RUN_BY_TOUCH, false),
                (table::RUN_BY_LABEL, false),
                (table::HOLD, true),
                (table::SESSION, true),
                (table::BUDGET, true),
                (table::BUDGET_HOLD, false),
            ] {
                let lo = KeyBuf::table(tb).str(&tenant).done();
                counted += purge_range(txn, &lo, counts)?;
            }
            // The tenant's feed goes too; its horizon takes a position
            // after every change the tenant had (the leader gives it one),
            // so a consumer from before the purge is told to re-list.
            for lo in super::feed::tenant_ranges(&tenant) {
                purge_range(txn, &lo, false)?;
            }
            txn.put(
                super::feed::tenant_horizon_key(&tenant, &secret),
                Vec::new(),
            );
            let scope = agentstate_core::idempotency::Scope::Tenant(&tenant).kind();
            for tb in [table::IDEM, table::IDEM_ORDER, table::IDEM_SCOPE] {
                let lo = KeyBuf::table(tb).u8(scope).str(&tenant).done();
                purge_range(txn, &lo, false)?;
            }
            Ok(counted)
        })
    }
}

/// Deletes every key under `lo`; how many when `counts`.
fn purge_range(txn: &mut super::commit::Txn<'_>, lo: &[u8], counts: bool) -> Result<u64> {
    let keys = txn.scan(lo, &prefix_end(lo), usize::MAX)?;
    let n = keys.len() as u64;
    for (k, _) in keys {
        txn.delete(k);
    }
    Ok(if counts { n } else { 0 })
}

/// Which run index a key belongs to, for `verify_runs`' messages.
fn index_name(tb: u8) -> &'static str {
    match tb {
        table::RUN_ID => "run id map",
        table::RUN_BY_STATE => "state index",
        table::RUN_BY_SESSION => "session index",
        table::RUN_BY_LABEL => "label index",
        _ => "touch index",
    }
}

impl KvStore {
    /// `verify`'s run checks: every record decodes under its (tenant, seq)
    /// and has exactly its id-map, state, session and touch entries, with
    /// the values they must hold (the state index's copy or summary, the
    /// session index's summary); every index entry points at a run that
    /// has it.
    fn verify_runs(
        &self,
        next_seq: u64,
        entries: &mut u64,
        p: &mut impl FnMut(String),
    ) -> Result<u64> {
        let mut runs = 0u64;
        self.walk(table::RUN, |k, v| {
            *entries += 1;
            runs += 1;
            let (tenant, seq) = match KeyReader::new(k, table::RUN).and_then(|mut r| {
                let t = r.str()?;
                let seq = r.u64()?;
                r.end()?;
                Ok((t, seq))
            }) {
                Ok(at) => at,
                Err(e) => {
                    p(format!("run key undecodable: {e}"));
                    return Ok(());
                }
            };
            let r = match decode_run_at(v, &tenant, seq) {
                Ok(r) => r,
                Err(e) => {
                    p(format!("run at {tenant}/seq {seq}: {e}"));
                    return Ok(());
                }
            };
            let name = format!("run {}/{}", tenant, r.key.run_id);
            if seq == 0 || seq >= next_seq {
                p(format!("{name}: seq {seq} outside 1..{next_seq}"));
            }
            let summary = value::encode(&RunSummary::of(&r));
            let mut want = vec![
                ("run id map", run_id_key(&r.key), value::encode(&seq)),
                (
                    "state index",
                    by_state_key(&tenant, r.state, seq),
                    state_entry(&r, v),
                ),
            ];
            if let Some(s) = &r.session_id {
                want.push(("session index", by_session_key(&tenant, s, seq), summary));
            }
            if !r.state.is_finished() {
                want.push((
                    "touch index",
                    by_touch_key(&tenant, r.state, r.updated_at, seq),
                    value::encode(&()),
                ));
            }
            for k in label_keys(&r) {
                want.push(("label index", k, value::encode(&())));
            }
            for (what, ik, iv) in want {
                match self.engine.get(&ik)? {
                    None => p(format!("{name}: {what} entry missing")),
                    Some(got) if got != iv => p(format!("{name}: {what} entry wrong")),
                    Some(_) => {}
                }
            }
            Ok(())
        })?;
        let mut ids = 0u64;
        for tb in [
            table::RUN_ID,
            table::RUN_BY_STATE,
            table::RUN_BY_SESSION,
            table::RUN_BY_TOUCH,
            table::RUN_BY_LABEL,
        ] {
            self.walk(tb, |k, v| {
                *entries += 1;
                let check = || -> Result<bool> {
                    let mut r = KeyReader::new(k, tb)?;
                    let tenant = r.str()?;
                    let (mut state, mut session, mut touched, mut run_id) =
                        (None, None, None, None);
                    let mut label = None;
                    let seq = match tb {
                        table::RUN_ID => {
                            run_id = Some(r.str()?);
                            decode_seq(v)?
                        }
                        table::RUN_BY_STATE => {
                            state = Some(r.u8()?);
                            r.u64()?
                        }
                        table::RUN_BY_SESSION => {
                            session = Some(r.str()?);
                            r.u64()?
                        }
                        table::RUN_BY_LABEL => {
                            label = Some((r.str()?, r.str()?));
                            r.u64()?
                        }
                        _ => {
                            state = Some(r.u8()?);
                            touched = Some(r.u64()?);
                            r.u64()?
                        }
                    };
                    r.end()?;
                    let Some(bytes) = self.engine.get(&run_key(&tenant, seq))? else {
                        return Ok(false);
                    };
                    let run = decode_run_at(&bytes, &tenant, seq)?;
                    Ok(run_id.is_none_or(|id| id == run.key.run_id)
                        && state.is_none_or(|s| s == run.state.tag())
                        && session.is_none_or(|s| run.session_id.as_deref() == Some(s.as_str()))
                        && touched.is_none_or(|t| t == run.updated_at && !run.state.is_finished())
                        && label.is_none_or(|(k, v)| {
                            run.labels
                                .get(&k)
                                .is_some_and(|x| agentstate_core::labels::canonical(x) == v)
                        }))
                };
                if tb == table::RUN_ID {
                    ids += 1;
                }
                match check() {
                    Ok(true) => {}
                    Ok(false) => p(format!(
                        "{} entry (table {tb:#04x}) points at no matching run",
                        index_name(tb)
                    )),
                    Err(e) => p(format!("{} entry (table {tb:#04x}): {e}", index_name(tb))),
                }
                Ok(())
            })?;
        }
        // Each run has its one id entry (checked above), so a count that
        // differs means two ids map to one record.
        if ids != runs {
            p(format!("{ids} run id map entries for {runs} runs"));
        }
        Ok(runs)
    }
}
