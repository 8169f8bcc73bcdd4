//! Spend caps (rules B1–B6) as server transactions: each reserve, settle,
//! release and patch locks the run's row, then its budget's row (always in
//! that order, so two calls never wait on each other in a cycle), reads the
//! holds, asks `crate::rules` what to write, and writes it before commit,
//! so the cap check and the hold it records are one atomic step.
//!
//! Every write of a hold of a budget's run happens with the budget's row
//! locked, so once a call holds that lock, the budget's holds it reads are
//! the ones that count.

use postgres::Row;

use crate::budget::{
    BudgetKey, BudgetRecord, BudgetStatus, BudgetStore, Hold, HoldRecord, RunSpend, Settled, Spend,
};
use crate::codec::cursor::{self as cursor_codec, Listing};
use crate::codec::value;
use crate::error::{Missing, Result, StateError};
use crate::idempotency::{IdempotencyKey, Keyed};
use crate::kv::key::KeyBuf;
use crate::page::{Page, PageRequest};
use crate::record::{Millis, RunKey, RunRecord, StateDelta};
use crate::rules::{
    BudgetSide, budget_spent, check_budget_key, check_hold, check_id, check_limit, check_new_hold,
    check_reserve, check_run_key, check_size, expired, held, new_hold, next_budget, overshoot,
    patched_run,
};

use super::conn::{Tx, TxResult};
use super::runs::{read_run, write_run};
use super::{PostgresStore, id_in, id_out, num};

/// A hold's place: its run's id and its own.
type HoldAt = (String, String);

/// The budget a run draws from, if any.
pub(crate) fn budget_of(run: &RunRecord) -> Option<BudgetKey> {
    run.budget
        .as_ref()
        .map(|n| BudgetKey::new(run.key.tenant.clone(), n.clone()))
}

/// Decodes a budget row's record and spent columns, checking the key.
pub(crate) fn decode_budget(
    record: &[u8],
    spent: &[u8],
    key: &BudgetKey,
) -> Result<(BudgetRecord, Spend)> {
    let r: BudgetRecord = value::decode(record, "budget")?;
    if &r.key != key {
        return Err(StateError::corrupt("budget stored under another key"));
    }
    Ok((r, value::decode(spent, "budget spent")?))
}

/// Decodes a hold row's record, checking its id.
pub(crate) fn decode_hold(bytes: &[u8], hold_id: &str) -> Result<HoldRecord> {
    let h: HoldRecord = value::decode(bytes, "hold")?;
    if h.id != hold_id {
        return Err(StateError::corrupt("hold stored under another id"));
    }
    Ok(h)
}

fn read_budget(
    tx: &mut Tx<'_>,
    key: &BudgetKey,
    lock: bool,
) -> TxResult<Option<(BudgetRecord, Spend)>> {
    let sql = if lock {
        "SELECT record, spent FROM {s}agentstate_budgets WHERE tenant = $1 AND name = $2 FOR UPDATE"
    } else {
        "SELECT record, spent FROM {s}agentstate_budgets WHERE tenant = $1 AND name = $2"
    };
    let rows = tx.query(sql, &[&id_in(&key.tenant), &id_in(&key.name)])?;
    Ok(rows
        .first()
        .map(|r| decode_budget(r.get(0), r.get(1), key))
        .transpose()?)
}

/// Reads a budget and locks its row until commit.
pub(crate) fn lock_budget(
    tx: &mut Tx<'_>,
    key: &BudgetKey,
) -> TxResult<Option<(BudgetRecord, Spend)>> {
    read_budget(tx, key, true)
}

fn hold_rows(rows: &[Row]) -> Result<Vec<(HoldAt, HoldRecord)>> {
    rows.iter()
        .map(|r| {
            let run_id = id_out(r.get(0))?;
            let hold_id = id_out(r.get(1))?;
            let h = decode_hold(r.get(2), &hold_id)?;
            Ok(((run_id, hold_id), h))
        })
        .collect()
}

/// A run's holds (expired ones too), in id order.
fn run_holds(tx: &mut Tx<'_>, run: &RunKey) -> TxResult<Vec<(HoldAt, HoldRecord)>> {
    let rows = tx.query(
        "SELECT run_id, hold_id, record FROM {s}agentstate_holds \
         WHERE tenant = $1 AND run_id = $2 ORDER BY hold_id",
        &[&id_in(&run.tenant), &id_in(&run.run_id)],
    )?;
    Ok(hold_rows(&rows)?)
}

/// A budget's holds (expired ones too), in (run, hold) order.
fn budget_holds(tx: &mut Tx<'_>, budget: &BudgetKey) -> TxResult<Vec<(HoldAt, HoldRecord)>> {
    let rows = tx.query(
        "SELECT run_id, hold_id, record FROM {s}agentstate_holds \
         WHERE tenant = $1 AND budget = $2 ORDER BY run_id, hold_id",
        &[&id_in(&budget.tenant), &id_in(&budget.name)],
    )?;
    Ok(hold_rows(&rows)?)
}

/// The holds a write to `run` looks at: its budget's (which hold the
/// run's) when it draws from one, else its own. The budget's row must be
/// locked already.
fn holds_around(tx: &mut Tx<'_>, run: &RunRecord) -> TxResult<Vec<(HoldAt, HoldRecord)>> {
    match budget_of(run) {
        Some(b) => budget_holds(tx, &b),
        None => run_holds(tx, &run.key),
    }
}

fn delete_hold(tx: &mut Tx<'_>, run: &RunKey, hold_id: &str) -> TxResult<()> {
    tx.execute(
        "DELETE FROM {s}agentstate_holds WHERE tenant = $1 AND run_id = $2 AND hold_id = $3",
        &[&id_in(&run.tenant), &id_in(&run.run_id), &id_in(hold_id)],
    )?;
    Ok(())
}

/// B5: removes the holds among `holds` (of `tenant`) that have expired at
/// `now`. Called only by writes that go ahead, so a refused call still
/// changes nothing.
fn purge_expired(
    tx: &mut Tx<'_>,
    tenant: &str,
    holds: &[(HoldAt, HoldRecord)],
    now: Millis,
) -> TxResult<()> {
    let gone = expired(holds, now);
    if gone.is_empty() {
        return Ok(());
    }
    let runs: Vec<String> = gone.iter().map(|(r, _)| id_in(r).into_owned()).collect();
    let ids: Vec<String> = gone.iter().map(|(_, h)| id_in(h).into_owned()).collect();
    tx.execute(
        "DELETE FROM {s}agentstate_holds WHERE tenant = $1 AND (run_id, hold_id) IN \
         (SELECT * FROM unnest($2::text[], $3::text[]))",
        &[&id_in(tenant), &runs, &ids],
    )?;
    Ok(())
}

/// What a patch (or settle) does beyond the run itself: adds `delta` to
/// the budget the run draws from and removes the expired holds of the run
/// and its budget (B3, B5, B6). Locks the budget's row (after the run's).
pub(crate) fn after_patch(
    tx: &mut Tx<'_>,
    run: &RunRecord,
    delta: &StateDelta,
    now: Millis,
) -> TxResult<()> {
    if let Some(b) = budget_of(run) {
        let Some((_, spent)) = lock_budget(tx, &b)? else {
            return Err(StateError::NotFound(Missing::Budget(b)).into());
        };
        let spent = budget_spent(spent, delta);
        tx.execute(
            "UPDATE {s}agentstate_budgets SET spent = $3 WHERE tenant = $1 AND name = $2",
            &[&id_in(&b.tenant), &id_in(&b.name), &value::encode(&spent)],
        )?;
    }
    let holds = holds_around(tx, run)?;
    purge_expired(tx, &run.key.tenant, &holds, now)
}

/// Writes a hold of `run` (whose budget column follows the run's budget).
pub(crate) fn insert_hold(tx: &mut Tx<'_>, run: &RunRecord, h: &HoldRecord) -> TxResult<()> {
    let budget = run.budget.as_deref().map(id_in);
    tx.execute(
        "INSERT INTO {s}agentstate_holds (tenant, run_id, hold_id, budget, expires_at, record) \
         VALUES ($1, $2, $3, $4, $5::text::numeric, $6)",
        &[
            &id_in(&run.key.tenant),
            &id_in(&run.key.run_id),
            &id_in(&h.id),
            &budget,
            &num(h.expires_at),
            &value::encode(h),
        ],
    )?;
    Ok(())
}

/// Writes an imported budget.
pub(crate) fn insert_budget(tx: &mut Tx<'_>, b: &BudgetRecord, spent: &Spend) -> TxResult<()> {
    tx.execute(
        "INSERT INTO {s}agentstate_budgets (tenant, name, record, spent) VALUES ($1, $2, $3, $4)",
        &[
            &id_in(&b.key.tenant),
            &id_in(&b.key.name),
            &value::encode(b),
            &value::encode(spent),
        ],
    )?;
    Ok(())
}

/// The run's hold `hold_id` if it still counts at `now`; `NotFound`
/// otherwise (B4, B5).
fn live_hold(tx: &mut Tx<'_>, run: &RunKey, hold_id: &str, now: Millis) -> TxResult<HoldRecord> {
    let missing = || {
        StateError::NotFound(Missing::Hold {
            run: run.clone(),
            hold_id: hold_id.to_string(),
        })
    };
    let rows = tx.query(
        "SELECT record FROM {s}agentstate_holds WHERE tenant = $1 AND run_id = $2 AND hold_id = $3",
        &[&id_in(&run.tenant), &id_in(&run.run_id), &id_in(hold_id)],
    )?;
    let Some(row) = rows.first() else {
        return Err(missing().into());
    };
    let h = decode_hold(row.get(0), hold_id)?;
    if !h.is_live(now) {
        return Err(missing().into());
    }
    Ok(h)
}

/// A budget's status at `now`, its holds read in `tx`.
fn status_in(
    tx: &mut Tx<'_>,
    record: BudgetRecord,
    spent: Spend,
    now: Millis,
) -> TxResult<BudgetStatus> {
    let holds = budget_holds(tx, &record.key)?;
    Ok(BudgetStatus {
        held: held(holds.iter().map(|(_, h)| h), now),
        holds: holds.iter().filter(|(_, h)| h.is_live(now)).count() as u64,
        record,
        spent,
    })
}

/// A run's spend at `now`, its holds read in `tx`.
pub(crate) fn spend_in(tx: &mut Tx<'_>, run: &RunRecord, now: Millis) -> TxResult<RunSpend> {
    let holds: Vec<HoldRecord> = run_holds(tx, &run.key)?
        .into_iter()
        .map(|(_, h)| h)
        .filter(|h| h.is_live(now))
        .collect();
    Ok(RunSpend {
        key: run.key.clone(),
        caps: run.caps,
        budget: run.budget.clone(),
        spent: Spend::of_run(run),
        held: held(&holds, now),
        holds,
    })
}

impl BudgetStore for PostgresStore {
    fn put_budget(&self, record: BudgetRecord) -> Result<BudgetRecord> {
        check_budget_key(&record.key)?;
        let now = self.now();
        let max = self.max();
        self.txn(|tx| {
            let k = &record.key;
            let stored = lock_budget(tx, k)?;
            let new = next_budget(stored.as_ref().map(|(r, _)| r), record.clone(), now)?;
            let bytes = value::encode(&new);
            let spent = stored.map(|(_, s)| s).unwrap_or_default();
            let spent_bytes = value::encode(&spent);
            // The KV store keeps record and spent in one value.
            check_size(
                "budget record",
                bytes.len() + spent_bytes.len() - value::OVERHEAD_BYTES,
                max,
            )?;
            // A create racing another create fails its insert on the key
            // and is tried again, when it sees the winner (B1, like S1).
            let sql = if new.version == 1 {
                "INSERT INTO {s}agentstate_budgets (tenant, name, record, spent) \
                 VALUES ($1, $2, $3, $4)"
            } else {
                "UPDATE {s}agentstate_budgets SET record = $3, spent = $4 \
                 WHERE tenant = $1 AND name = $2"
            };
            tx.execute(
                sql,
                &[&id_in(&k.tenant), &id_in(&k.name), &bytes, &spent_bytes],
            )?;
            Ok(new)
        })
    }

    fn get_budget(&self, key: &BudgetKey) -> Result<Option<BudgetStatus>> {
        check_budget_key(key)?;
        let now = self.now();
        self.txn(|tx| match read_budget(tx, key, false)? {
            Some((r, s)) => Ok(Some(status_in(tx, r, s, now)?)),
            None => Ok(None),
        })
    }

    fn list_budgets(&self, tenant: &str, page: &PageRequest) -> Result<Page<BudgetStatus>> {
        check_id("tenant", tenant)?;
        check_limit(page.limit)?;
        let now = self.now();
        let secret = self.secret()?;
        let (binding, after) = super::tenant_cursor(&secret, Listing::Budgets, tenant, page)?;
        let limit = (page.limit + 1) as i64;
        let t = id_in(tenant);
        let mut items = self.txn(|tx| {
            let rows = match &after {
                None => tx.query(
                    "SELECT name, record, spent FROM {s}agentstate_budgets WHERE tenant = $1 \
                     ORDER BY name LIMIT $2",
                    &[&t, &limit],
                )?,
                Some(a) => tx.query(
                    "SELECT name, record, spent FROM {s}agentstate_budgets WHERE tenant = $1 \
                     AND name > $3 ORDER BY name LIMIT $2",
                    &[&t, &limit, &id_in(a)],
                )?,
            };
            let mut items = Vec::with_capacity(rows.len());
            for r in &rows {
                let key = BudgetKey::new(tenant, id_out(r.get(0))?);
                let (rec, spent) = decode_budget(r.get(1), r.get(2), &key)?;
                items.push(status_in(tx, rec, spent, now)?);
            }
            Ok(items)
        })?;
        let more = items.len() > page.limit;
        items.truncate(page.limit);
        let cursor = match (more, items.last()) {
            (true, Some(b)) => Some(cursor_codec::encode(
                &secret,
                Listing::Budgets,
                &binding,
                &KeyBuf::table(Listing::Budgets as u8)
                    .str(&b.record.key.name)
                    .done(),
            )),
            _ => None,
        };
        Page::new(items, cursor)
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
        self.txn(|tx| match read_run(tx, run, false)? {
            Some(r) => Ok(Some(spend_in(tx, &r, now)?)),
            None => Ok(None),
        })
    }
}

impl PostgresStore {
    /// `reserve`, under `keyed`'s idempotency key when there is one.
    fn reserve_with(
        &self,
        run: &RunKey,
        hold: Hold,
        keyed: Option<Keyed<'_>>,
    ) -> Result<HoldRecord> {
        check_run_key(run)?;
        check_hold(&hold)?;
        let now = self.now();
        self.txn_keyed(keyed, |tx| {
            let Some(r) = read_run(tx, run, true)? else {
                return Err(StateError::NotFound(Missing::Run(run.clone())).into());
            };
            // The budget's row is locked before its holds are read (and
            // after the run's row: the one lock order).
            let budget = match budget_of(&r) {
                Some(b) => Some(lock_budget(tx, &b)?.ok_or(b)),
                None => None,
            };
            let holds = holds_around(tx, &r)?;
            let live: Vec<&HoldRecord> = holds
                .iter()
                .filter(|((run_id, _), h)| run_id == &run.run_id && h.is_live(now))
                .map(|(_, h)| h)
                .collect();
            check_new_hold(&hold, &live)?;
            let run_held = held(live.iter().copied(), now);
            let side = match &budget {
                Some(Ok((record, spent))) => Some(BudgetSide {
                    record,
                    spent: *spent,
                    held: held(holds.iter().map(|(_, h)| h), now),
                }),
                Some(Err(b)) => return Err(StateError::NotFound(Missing::Budget(b.clone())).into()),
                None => None,
            };
            check_reserve(&r, run_held, side.as_ref(), hold.amounts())?;
            let rec = new_hold(&hold, now)?;
            purge_expired(tx, &run.tenant, &holds, now)?;
            insert_hold(tx, &r, &rec)?;
            Ok(rec)
        })
    }

    /// `settle`, under `keyed`'s idempotency key when there is one.
    fn settle_with(
        &self,
        run: &RunKey,
        hold_id: &str,
        spent: StateDelta,
        keyed: Option<Keyed<'_>>,
    ) -> Result<Settled> {
        check_run_key(run)?;
        check_id("hold id", hold_id)?;
        let now = self.now();
        let max = self.max();
        self.txn_keyed(keyed, |tx| {
            let Some(old) = read_run(tx, run, true)? else {
                return Err(StateError::NotFound(Missing::Run(run.clone())).into());
            };
            let h = live_hold(tx, run, hold_id, now)?;
            let new = patched_run(&old, &spent, now)?;
            write_run(tx, &new, false, max)?;
            delete_hold(tx, run, hold_id)?;
            after_patch(tx, &new, &spent, now)?;
            Ok(Settled {
                record: new,
                overshoot: overshoot(&h, &spent),
            })
        })
    }

    /// `release_hold`, under `keyed`'s idempotency key when there is one.
    fn release_hold_with(
        &self,
        run: &RunKey,
        hold_id: &str,
        keyed: Option<Keyed<'_>>,
    ) -> Result<()> {
        check_run_key(run)?;
        check_id("hold id", hold_id)?;
        let now = self.now();
        self.txn_keyed(keyed, |tx| {
            let Some(r) = read_run(tx, run, true)? else {
                return Err(StateError::NotFound(Missing::Run(run.clone())).into());
            };
            live_hold(tx, run, hold_id, now)?;
            // Its budget's holds are purged below: under its row's lock.
            if let Some(b) = budget_of(&r) {
                lock_budget(tx, &b)?;
            }
            delete_hold(tx, run, hold_id)?;
            let holds = holds_around(tx, &r)?;
            purge_expired(tx, &run.tenant, &holds, now)
        })
    }
}
