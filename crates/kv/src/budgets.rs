//! Spend caps (rules B1–B6) as commit-path jobs: each reserve, settle,
//! release and patch reads the run, its holds, its budget and the budget's
//! holds, asks `agentstate_core::rules` what to write, and writes it in the same job,
//! so the cap check and the hold it records are one atomic step.

use agentstate_core::idempotency::{IdempotencyKey, Keyed};
use serde::{Deserialize, Serialize};

use crate::key::table;
use agentstate_core::budget::{
    BudgetKey, BudgetRecord, BudgetStatus, BudgetStore, Hold, HoldRecord, RunSpend, Settled, Spend,
};
use agentstate_core::codec::cursor::Listing;
use agentstate_core::codec::key::{KeyBuf, KeyReader, prefix_end};
use agentstate_core::codec::value;
use agentstate_core::error::{RecordKey, Result, StateError};
use agentstate_core::page::{Page, PageRequest};
use agentstate_core::record::{Millis, RunKey, RunRecord, StateDelta};
use agentstate_core::rules::{
    BudgetSide, budget_spent, check_budget_key, check_hold, check_new_hold, check_reserve,
    check_run_key, expired, held, new_hold, next_budget, overshoot, patched_run,
};

use super::commit::Txn;
use super::runs::{RunKeys, read_run, write_run};
use super::{KvStore, check_id, check_size};

/// A budget as stored: the record and what is spent against it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct BudgetRow {
    pub(crate) record: BudgetRecord,
    pub(crate) spent: Spend,
}

pub(crate) fn budget_key(k: &BudgetKey) -> Vec<u8> {
    KeyBuf::table(table::BUDGET)
        .str(&k.tenant)
        .str(&k.name)
        .done()
}
pub(crate) fn hold_key(run: &RunKey, hold_id: &str) -> Vec<u8> {
    KeyBuf::table(table::HOLD)
        .str(&run.tenant)
        .str(&run.run_id)
        .str(hold_id)
        .done()
}
fn run_holds_prefix(run: &RunKey) -> Vec<u8> {
    KeyBuf::table(table::HOLD)
        .str(&run.tenant)
        .str(&run.run_id)
        .done()
}
pub(crate) fn budget_hold_key(budget: &BudgetKey, run_id: &str, hold_id: &str) -> Vec<u8> {
    KeyBuf::table(table::BUDGET_HOLD)
        .str(&budget.tenant)
        .str(&budget.name)
        .str(run_id)
        .str(hold_id)
        .done()
}
fn budget_holds_prefix(budget: &BudgetKey) -> Vec<u8> {
    KeyBuf::table(table::BUDGET_HOLD)
        .str(&budget.tenant)
        .str(&budget.name)
        .done()
}

pub(crate) fn decode_budget(bytes: &[u8], key: &BudgetKey) -> Result<BudgetRow> {
    let row: BudgetRow = value::decode(bytes, "budget")?;
    if &row.record.key != key {
        return Err(StateError::corrupt("budget stored under another key"));
    }
    Ok(row)
}

/// The budget a run draws from, if any.
fn budget_of(run: &RunRecord) -> Option<BudgetKey> {
    run.budget
        .as_ref()
        .map(|n| BudgetKey::new(run.key.tenant.clone(), n.clone()))
}

fn read_budget(txn: &Txn<'_>, key: &BudgetKey) -> Result<BudgetRow> {
    match txn.get(&budget_key(key))? {
        Some(v) => decode_budget(&v, key),
        None => Err(StateError::NotFound(RecordKey::Budget(key.clone()))),
    }
}

/// A run's holds (expired ones too), in id order.
fn run_holds(txn: &Txn<'_>, run: &RunKey) -> Result<Vec<(String, HoldRecord)>> {
    let prefix = run_holds_prefix(run);
    txn.scan(&prefix, &prefix_end(&prefix), usize::MAX)?
        .into_iter()
        .map(|(_, v)| {
            let h: HoldRecord = value::decode(&v, "hold")?;
            Ok((h.id.clone(), h))
        })
        .collect()
}

/// A budget's holds (expired ones too), each with its run id.
fn budget_holds(txn: &Txn<'_>, budget: &BudgetKey) -> Result<Vec<((String, String), HoldRecord)>> {
    let prefix = budget_holds_prefix(budget);
    let plen = prefix.len();
    txn.scan(&prefix, &prefix_end(&prefix), usize::MAX)?
        .into_iter()
        .map(|(k, v)| {
            let mut r = KeyReader::new(&k, table::BUDGET_HOLD)?;
            // Skip the prefix's two components, then read run and hold ids.
            debug_assert!(k.len() > plen);
            r.str()?;
            r.str()?;
            let run_id = r.str()?;
            let hold_id = r.str()?;
            r.end()?;
            let h: HoldRecord = value::decode(&v, "budget hold")?;
            Ok(((run_id, hold_id), h))
        })
        .collect()
}

/// Deletes one hold and its budget index entry.
fn delete_hold(txn: &mut Txn<'_>, run: &RunKey, budget: Option<&BudgetKey>, hold_id: &str) {
    txn.delete(hold_key(run, hold_id));
    if let Some(b) = budget {
        txn.delete(budget_hold_key(b, &run.run_id, hold_id));
    }
}

/// B5: removes the holds of the run and of its budget that have expired
/// at `now`. Called only by writes that go ahead, so a refused call still
/// changes nothing (an expired hold counts for nothing either way).
fn purge_expired(txn: &mut Txn<'_>, run: &RunRecord, now: Millis) -> Result<()> {
    let budget = budget_of(run);
    let holds = run_holds(txn, &run.key)?;
    for id in expired(&holds, now) {
        delete_hold(txn, &run.key, budget.as_ref(), id);
    }
    if let Some(b) = &budget {
        let holds = budget_holds(txn, b)?;
        for (run_id, hold_id) in expired(&holds, now) {
            let rk = RunKey::new(run.key.tenant.clone(), run_id.clone());
            delete_hold(txn, &rk, Some(b), hold_id);
        }
    }
    Ok(())
}

/// Adds `delta` to the budget the run draws from (B3, B6).
fn spend_on_budget(txn: &mut Txn<'_>, run: &RunRecord, delta: &StateDelta) -> Result<()> {
    if let Some(b) = budget_of(run) {
        let mut row = read_budget(txn, &b)?;
        row.spent = budget_spent(row.spent, delta);
        txn.put(budget_key(&b), value::encode(&row));
    }
    Ok(())
}

/// What a patch does beyond the run itself when the run is capped or
/// draws from a budget: the budget's spend, and expired holds removed
/// (B5, B6). Runs without caps, budget or holds pay one empty scan.
pub(crate) fn after_patch(
    txn: &mut Txn<'_>,
    run: &RunRecord,
    delta: &StateDelta,
    now: Millis,
) -> Result<()> {
    spend_on_budget(txn, run, delta)?;
    purge_expired(txn, run, now)
}

/// Deletes a run's holds (the run is being deleted); spend stays spent.
pub(crate) fn delete_run_holds(txn: &mut Txn<'_>, run: &RunRecord) -> Result<()> {
    let budget = budget_of(run);
    for (id, _) in run_holds(txn, &run.key)? {
        delete_hold(txn, &run.key, budget.as_ref(), &id);
    }
    Ok(())
}

/// Writes an imported hold and its budget index entry; the run must be
/// there already (runs come before holds in an export).
pub(crate) fn import_hold(txn: &mut Txn<'_>, run: &RunKey, hold: &HoldRecord) -> Result<()> {
    let k = hold_key(run, &hold.id);
    if txn.get(&k)?.is_some() {
        return Err(StateError::Conflict {
            record: RecordKey::Hold {
                run: run.clone(),
                hold_id: hold.id.clone(),
            },
            expected: 0,
            actual: 1,
        });
    }
    let Some(r) = read_run(txn, run)? else {
        return Err(StateError::invalid(format!(
            "hold {}: its run {}/{} is not in the import before it",
            hold.id, run.tenant, run.run_id
        )));
    };
    let bytes = value::encode(hold);
    if let Some(b) = budget_of(&r) {
        txn.put(budget_hold_key(&b, &run.run_id, &hold.id), bytes.clone());
    }
    txn.put(k, bytes);
    Ok(())
}

/// Writes an imported budget.
pub(crate) fn import_budget(txn: &mut Txn<'_>, budget: BudgetRecord, spent: Spend) -> Result<()> {
    let k = budget_key(&budget.key);
    if txn.get(&k)?.is_some() {
        return Err(StateError::Conflict {
            record: RecordKey::Budget(budget.key.clone()),
            expected: 0,
            actual: 1,
        });
    }
    txn.put(
        k,
        value::encode(&BudgetRow {
            record: budget,
            spent,
        }),
    );
    Ok(())
}

/// For export: the entry of a hold key and value.
pub(crate) fn hold_entry(k: &[u8], v: &[u8]) -> Result<(RunKey, HoldRecord)> {
    let mut r = KeyReader::new(k, table::HOLD)?;
    let run = RunKey::new(r.str()?, r.str()?);
    let id = r.str()?;
    r.end()?;
    let h: HoldRecord = value::decode(v, "hold")?;
    if h.id != id {
        return Err(StateError::corrupt("hold stored under another id"));
    }
    Ok((run, h))
}

impl KvStore {
    /// A budget's status at `now`, read straight from the engine.
    fn budget_status(&self, row: BudgetRow, now: Millis) -> Result<BudgetStatus> {
        let prefix = budget_holds_prefix(&row.record.key);
        let mut holds = Vec::new();
        for (_, v) in self
            .engine
            .scan(&prefix, &prefix_end(&prefix), usize::MAX)?
        {
            holds.push(value::decode::<HoldRecord>(&v, "budget hold")?);
        }
        Ok(BudgetStatus::new(
            row.record,
            row.spent,
            held(&holds, now),
            holds.iter().filter(|h| h.is_live(now)).count() as u64,
        ))
    }

    /// The RunSpend of a run, read straight from the engine (used by
    /// `run_spend` and `stats`).
    pub(crate) fn spend_of(&self, run: &RunRecord, now: Millis) -> Result<RunSpend> {
        let prefix = run_holds_prefix(&run.key);
        let mut holds = Vec::new();
        for (_, v) in self
            .engine
            .scan(&prefix, &prefix_end(&prefix), usize::MAX)?
        {
            let h: HoldRecord = value::decode(&v, "hold")?;
            if h.is_live(now) {
                holds.push(h);
            }
        }
        Ok(RunSpend::new(
            run.key.clone(),
            run.caps,
            run.budget.clone(),
            Spend::of_run(run),
            held(&holds, now),
            holds,
        ))
    }

    /// A budget's status by key (for `stats`).
    pub(crate) fn budget_status_of(
        &self,
        key: &BudgetKey,
        now: Millis,
    ) -> Result<Option<BudgetStatus>> {
        match self.engine.get(&budget_key(key))? {
            Some(v) => Ok(Some(self.budget_status(decode_budget(&v, key)?, now)?)),
            None => Ok(None),
        }
    }
}

impl BudgetStore for KvStore {
    fn put_budget(&self, record: BudgetRecord) -> Result<BudgetRecord> {
        check_budget_key(&record.key)?;
        let now = self.now();
        let max = self.opts.record_bytes_max;
        self.submit(move |txn| {
            let k = budget_key(&record.key);
            let stored = txn
                .get(&k)?
                .map(|v| decode_budget(&v, &record.key))
                .transpose()?;
            let new = next_budget(stored.as_ref().map(|r| &r.record), record, now)?;
            let row = BudgetRow {
                record: new.clone(),
                spent: stored.map(|r| r.spent).unwrap_or_default(),
            };
            let bytes = value::encode(&row);
            check_size("budget record", bytes.len(), max)?;
            txn.put(k, bytes);
            Ok(new)
        })
    }

    fn get_budget(&self, key: &BudgetKey) -> Result<Option<BudgetStatus>> {
        check_budget_key(key)?;
        self.budget_status_of(key, self.now())
    }

    fn list_budgets(&self, tenant: &str, page: &PageRequest) -> Result<Page<BudgetStatus>> {
        check_id("tenant", tenant)?;
        let now = self.now();
        let prefix = KeyBuf::table(table::BUDGET).str(tenant).done();
        let end = prefix_end(&prefix);
        let binding = prefix.clone();
        self.scan_page(Listing::Budgets, &binding, &prefix, &end, page, |k, v| {
            let mut r = KeyReader::new(k, table::BUDGET)?;
            let key = BudgetKey::new(r.str()?, r.str()?);
            r.end()?;
            let row = decode_budget(v, &key)?;
            self.budget_status(row, now).map(Some)
        })
    }

    fn reserve(&self, run: &RunKey, hold: Hold) -> Result<HoldRecord> {
        self.reserve_with(run, hold, None)
    }
    fn reserve_idempotent(
        &self,
        run: &RunKey,
        hold: Hold,
        key: &IdempotencyKey,
    ) -> Result<HoldRecord> {
        let keyed = Keyed::reserve(run, &hold, key)?;
        self.reserve_with(run, hold, Some(keyed))
    }

    fn settle(&self, run: &RunKey, hold_id: &str, spent: StateDelta) -> Result<Settled> {
        self.settle_with(run, hold_id, spent, None)
    }
    fn settle_idempotent(
        &self,
        run: &RunKey,
        hold_id: &str,
        spent: StateDelta,
        key: &IdempotencyKey,
    ) -> Result<Settled> {
        let keyed = Keyed::settle(run, hold_id, &spent, key)?;
        self.settle_with(run, hold_id, spent, Some(keyed))
    }

    fn release_hold(&self, run: &RunKey, hold_id: &str) -> Result<()> {
        self.release_hold_with(run, hold_id, None)
    }
    fn release_hold_idempotent(
        &self,
        run: &RunKey,
        hold_id: &str,
        key: &IdempotencyKey,
    ) -> Result<()> {
        let keyed = Keyed::release_hold(run, hold_id, key)?;
        self.release_hold_with(run, hold_id, Some(keyed))
    }

    fn run_spend(&self, run: &RunKey) -> Result<Option<RunSpend>> {
        check_run_key(run)?;
        let now = self.now();
        match agentstate_core::api::StateStore::get_run(self, run)? {
            Some(r) => Ok(Some(self.spend_of(&r, now)?)),
            None => Ok(None),
        }
    }
}

/// The run's hold `hold_id` if it still counts at `now`; `NotFound`
/// otherwise (B4, B5).
fn live_hold(txn: &Txn<'_>, run: &RunKey, hold_id: &str, now: Millis) -> Result<HoldRecord> {
    let missing = || {
        StateError::NotFound(RecordKey::Hold {
            run: run.clone(),
            hold_id: hold_id.to_string(),
        })
    };
    let h: HoldRecord = match txn.get(&hold_key(run, hold_id))? {
        Some(v) => value::decode(&v, "hold")?,
        None => return Err(missing()),
    };
    if !h.is_live(now) {
        return Err(missing());
    }
    Ok(h)
}

impl KvStore {
    /// `stats`' budget counts: budgets, live holds, and runs at their cap.
    pub(crate) fn budget_stats(&self, s: &mut agentstate_core::admin::StoreStats) -> Result<()> {
        let now = self.now();
        let mut budgets: std::collections::HashMap<BudgetKey, BudgetStatus> = Default::default();
        self.walk(table::BUDGET, |k, v| {
            let mut r = KeyReader::new(k, table::BUDGET)?;
            let key = BudgetKey::new(r.str()?, r.str()?);
            let row = decode_budget(v, &key)?;
            s.tenants.entry(key.tenant.clone()).or_default().budgets += 1;
            budgets.insert(key, self.budget_status(row, now)?);
            Ok(())
        })?;
        self.walk(table::HOLD, |k, v| {
            let (run, h) = hold_entry(k, v)?;
            if h.is_live(now) {
                s.tenants.entry(run.tenant).or_default().holds += 1;
            }
            Ok(())
        })?;
        // Only runs with caps or a budget are written at the capped format,
        // so the others are skipped without being decoded.
        self.walk(table::RUN, |_, v| {
            if v.first() != Some(&value::RUN_FORMAT_CAPS) {
                return Ok(());
            }
            let run = value::decode_run(v)?;
            let spend = self.spend_of(&run, now)?;
            let mut at = agentstate_core::rules::at_cap(&run.caps, spend.spent, spend.held);
            if let Some(b) = budget_of(&run).and_then(|b| budgets.get(&b)) {
                at |= agentstate_core::rules::at_cap(&b.record.caps, b.spent, b.held);
            }
            if at {
                s.tenants.entry(run.key.tenant).or_default().runs_at_cap += 1;
            }
            Ok(())
        })
    }

    /// `verify`'s budget checks: every value decodes, every hold has its
    /// run and (when the run draws from a budget) its budget index entry
    /// with the same value, every budget index entry has its hold, and
    /// every run's budget exists.
    pub(crate) fn verify_budgets(
        &self,
        rep: &mut agentstate_core::admin::VerifyReport,
    ) -> Result<()> {
        let mut problems = Vec::new();
        let mut entries = 0u64;
        self.walk(table::BUDGET, |k, v| {
            entries += 1;
            let check = || -> Result<()> {
                let mut r = KeyReader::new(k, table::BUDGET)?;
                let key = BudgetKey::new(r.str()?, r.str()?);
                r.end()?;
                decode_budget(v, &key).map(|_| ())
            };
            if let Err(e) = check() {
                problems.push(format!("budget: {e}"));
            }
            Ok(())
        })?;
        self.walk(table::HOLD, |k, v| {
            entries += 1;
            let check = || -> Result<()> {
                let (run, _) = hold_entry(k, v)?;
                let r = agentstate_core::api::StateStore::get_run(self, &run)?
                    .ok_or_else(|| StateError::corrupt("hold of a missing run"))?;
                let id = KeyReader::new(k, table::HOLD).and_then(|mut r| {
                    r.str()?;
                    r.str()?;
                    r.str()
                })?;
                if let Some(b) = budget_of(&r)
                    && self
                        .engine
                        .get(&budget_hold_key(&b, &run.run_id, &id))?
                        .as_deref()
                        != Some(v)
                {
                    return Err(StateError::corrupt(format!(
                        "hold {id} of run {}/{} missing from its budget's index",
                        run.tenant, run.run_id
                    )));
                }
                Ok(())
            };
            if let Err(e) = check() {
                problems.push(format!("hold: {e}"));
            }
            Ok(())
        })?;
        self.walk(table::BUDGET_HOLD, |k, _| {
            entries += 1;
            let check = || -> Result<bool> {
                let mut r = KeyReader::new(k, table::BUDGET_HOLD)?;
                let tenant = r.str()?;
                let _name = r.str()?;
                let run_id = r.str()?;
                let hold_id = r.str()?;
                r.end()?;
                Ok(self
                    .engine
                    .get(&hold_key(&RunKey::new(tenant, run_id), &hold_id))?
                    .is_some())
            };
            if !matches!(check(), Ok(true)) {
                problems.push("budget hold index entry without its hold".to_string());
            }
            Ok(())
        })?;
        self.walk(table::RUN, |_, v| {
            if v.first() != Some(&value::RUN_FORMAT_CAPS) {
                return Ok(());
            }
            if let Ok(run) = value::decode_run(v)
                && let Some(b) = budget_of(&run)
                && self.engine.get(&budget_key(&b))?.is_none()
            {
                problems.push(format!(
                    "run {}/{} draws from missing budget {}",
                    run.key.tenant, run.key.run_id, b.name
                ));
            }
            Ok(())
        })?;
        rep.entries += entries;
        rep.problems.extend(problems);
        Ok(())
    }
}

impl KvStore {
    // Rule B2: `check_reserve` on the run, its holds and its budget read in this job.
    pub(crate) fn reserve_with(
        &self,
        run: &RunKey,
        hold: Hold,
        keyed: Option<Keyed<'_>>,
    ) -> Result<HoldRecord> {
        check_run_key(run)?;
        check_hold(&hold)?;
        let run = run.clone();
        let now = self.now();
        self.submit_keyed(keyed, move |txn| {
            let Some(r) = read_run(txn, &run)? else {
                return Err(StateError::NotFound(RecordKey::Run(run)));
            };
            let holds = run_holds(txn, &run)?;
            let live: Vec<&HoldRecord> = holds
                .iter()
                .map(|(_, h)| h)
                .filter(|h| h.is_live(now))
                .collect();
            check_new_hold(&hold, &live)?;
            let run_held = held(live.iter().copied(), now);
            let budget = match budget_of(&r) {
                Some(b) => {
                    let row = read_budget(txn, &b)?;
                    let bh = budget_holds(txn, &b)?;
                    Some((row, held(bh.iter().map(|(_, h)| h), now)))
                }
                None => None,
            };
            let side = budget.as_ref().map(|(row, h)| BudgetSide {
                record: &row.record,
                spent: row.spent,
                held: *h,
            });
            check_reserve(&r, run_held, side.as_ref(), hold.amounts())?;
            let rec = new_hold(&hold, now)?;
            purge_expired(txn, &r, now)?;
            let bytes = value::encode(&rec);
            if let Some(b) = budget_of(&r) {
                txn.put(budget_hold_key(&b, &run.run_id, &rec.id), bytes.clone());
            }
            txn.put(hold_key(&run, &rec.id), bytes);
            Ok(rec)
        })
    }
}

impl KvStore {
    // Rule B3: the hold goes and the spend is booked in one job.
    pub(crate) fn settle_with(
        &self,
        run: &RunKey,
        hold_id: &str,
        spent: StateDelta,
        keyed: Option<Keyed<'_>>,
    ) -> Result<Settled> {
        check_run_key(run)?;
        check_id("hold id", hold_id)?;
        let (run, hold_id) = (run.clone(), hold_id.to_string());
        let now = self.now();
        let max = self.opts.record_bytes_max;
        let keys = RunKeys::of(&run);
        self.submit_keyed(keyed, move |txn| {
            let Some(old) = read_run(txn, &run)? else {
                return Err(StateError::NotFound(RecordKey::Run(run)));
            };
            let h = live_hold(txn, &run, &hold_id, now)?;
            let new = patched_run(&old, &spent, now)?;
            write_run(txn, Some(&old), &new, max, keys)?;
            delete_hold(txn, &run, budget_of(&old).as_ref(), &hold_id);
            after_patch(txn, &new, &spent, now)?;
            Ok(Settled::new(new, overshoot(&h, &spent)))
        })
    }
}

impl KvStore {
    // Rule B4: an unknown or expired hold is NotFound.
    pub(crate) fn release_hold_with(
        &self,
        run: &RunKey,
        hold_id: &str,
        keyed: Option<Keyed<'_>>,
    ) -> Result<()> {
        check_run_key(run)?;
        check_id("hold id", hold_id)?;
        let (run, hold_id) = (run.clone(), hold_id.to_string());
        let now = self.now();
        self.submit_keyed(keyed, move |txn| {
            let Some(r) = read_run(txn, &run)? else {
                return Err(StateError::NotFound(RecordKey::Run(run)));
            };
            live_hold(txn, &run, &hold_id, now)?;
            delete_hold(txn, &run, budget_of(&r).as_ref(), &hold_id);
            purge_expired(txn, &r, now)
        })
    }
}
