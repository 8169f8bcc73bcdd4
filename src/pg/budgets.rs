//! Spend caps (rules B1–B6) as server transactions: each reserve, settle,
//! release and patch locks the run's row, then its budget's row (always in
//! that order, so two calls never wait on each other in a cycle), reads the
//! holds, asks `crate::rules` what to write, and writes it before commit,
//! so the cap check and the hold it records are one atomic step.
//!
//! Every write of a hold of a budget's run happens with the budget's row
//! locked, so once a call holds that lock, the budget's holds it reads are
//! the ones that count.
//!
//! **Round trips.** `reserve` and `settle` send their reads at once
//! ([`around`]): the run's row locked, the hold (settle), the budget's row
//! locked and the holds around. The server runs them in that order, each
//! on a snapshot taken after the locks before it, so they read what the
//! sequential reads did. The budget is named by the run, so it is guessed
//! from the run as this store last saw it (a run's budget is fixed at
//! create); a wrong guess (or none) reads the budget in the old order.
//! The writes go out with `COMMIT`: 2 round trips each, budget or not.

use tokio_postgres::Row;
use tokio_postgres::types::ToSql;

use crate::budget::{
    BudgetKey, BudgetRecord, BudgetStatus, Hold, HoldRecord, RunSpend, Settled, Spend,
};
use crate::codec::cursor::{self as cursor_codec, Listing};
use crate::codec::value;
use crate::error::{RecordKey, Result, StateError};
use crate::idempotency::{IdempotencyKey, Keyed};
use crate::kv::key::KeyBuf;
use crate::page::{Page, PageRequest};
use crate::record::{Millis, RunKey, RunRecord, StateDelta};
use crate::rules::{
    BudgetSide, budget_spent, check_budget_key, check_hold, check_id, check_limit, check_new_hold,
    check_reserve, check_run_key, check_size, expired, held, new_hold, next_budget, overshoot,
    patched_run,
};

use super::conn::{Tx, TxResult, params, txn};
use super::idempotency::txn_keyed;
use super::runs::{LOCK_RUN, decode_run_at, read_run, write_run};
use super::{PostgresStore, id_in, id_out, num, own};

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

async fn read_budget(
    tx: &mut Tx<'_>,
    key: &BudgetKey,
    lock: bool,
) -> TxResult<Option<(BudgetRecord, Spend)>> {
    let sql = if lock {
        "SELECT record, spent FROM {s}agentstate_budgets WHERE tenant = $1 AND name = $2 FOR UPDATE"
    } else {
        "SELECT record, spent FROM {s}agentstate_budgets WHERE tenant = $1 AND name = $2"
    };
    let rows = tx
        .query(sql, &[&id_in(&key.tenant), &id_in(&key.name)])
        .await?;
    Ok(rows
        .first()
        .map(|r| decode_budget(r.get(0), r.get(1), key))
        .transpose()?)
}

/// Reads a budget and locks its row until commit.
pub(crate) async fn lock_budget(
    tx: &mut Tx<'_>,
    key: &BudgetKey,
) -> TxResult<Option<(BudgetRecord, Spend)>> {
    read_budget(tx, key, true).await
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

const LOCK_BUDGET: &str =
    "SELECT record, spent FROM {s}agentstate_budgets WHERE tenant = $1 AND name = $2 FOR UPDATE";
const RUN_HOLDS: &str = "SELECT run_id, hold_id, record FROM {s}agentstate_holds \
     WHERE tenant = $1 AND run_id = $2 ORDER BY hold_id";
const BUDGET_HOLDS: &str = "SELECT run_id, hold_id, record FROM {s}agentstate_holds \
     WHERE tenant = $1 AND budget = $2 ORDER BY run_id, hold_id";
const HOLD: &str =
    "SELECT record FROM {s}agentstate_holds WHERE tenant = $1 AND run_id = $2 AND hold_id = $3";

/// What a reserve or settle reads before deciding.
struct Around {
    /// The run, its row locked.
    run: RunRecord,
    /// The run's budget, its row locked, when the run has one (`None`
    /// inside: the budget does not exist).
    budget: Option<Option<(BudgetRecord, Spend)>>,
    /// [`holds_around`] the run.
    holds: Vec<(HoldAt, HoldRecord)>,
    /// The hold asked for's row, when one was.
    hold: Option<Vec<Row>>,
}

/// The reads of a reserve (`hold_id` `None`) or settle, pipelined (see
/// the module's notes): `guess` names the run's budget (`None`: no
/// budget). `None`: the run does not exist.
async fn around(
    tx: &mut Tx<'_>,
    run: &RunKey,
    guess: Option<&str>,
    hold_id: Option<&str>,
) -> TxResult<Option<Around>> {
    let (t, r) = (id_in(&run.tenant), id_in(&run.run_id));
    let hid = id_in(hold_id.unwrap_or_default());
    let bname = id_in(guess.unwrap_or_default());
    let run_p: [&(dyn ToSql + Sync); 2] = [&t, &r];
    let hold_p: [&(dyn ToSql + Sync); 3] = [&t, &r, &hid];
    let budget_p: [&(dyn ToSql + Sync); 2] = [&t, &bname];
    let mut list: Vec<(&str, &[&(dyn ToSql + Sync)])> = vec![(LOCK_RUN, &run_p)];
    if hold_id.is_some() {
        list.push((HOLD, &hold_p));
    }
    if guess.is_some() {
        list.push((LOCK_BUDGET, &budget_p));
        list.push((BUDGET_HOLDS, &budget_p));
    } else {
        list.push((RUN_HOLDS, &run_p));
    }
    let mut rows = tx.queries(&list).await?.into_iter();
    let mut next = || rows.next().expect("one answer per statement");
    let Some(row) = next().into_iter().next() else {
        return Ok(None);
    };
    let rec = decode_run_at(row.get(0), run, row.get(1))?;
    let hold = hold_id.map(|_| next());
    let (budget, holds) = match guess {
        Some(name) if rec.budget.as_deref() == Some(name) => {
            let bk = BudgetKey::new(run.tenant.clone(), name);
            let b = next()
                .first()
                .map(|r| decode_budget(r.get(0), r.get(1), &bk))
                .transpose()?;
            (Some(b), hold_rows(&next())?)
        }
        None if rec.budget.is_none() => (None, hold_rows(&next())?),
        // A wrong guess: the budget's row locked, then its holds read.
        _ => {
            let budget = match budget_of(&rec) {
                Some(b) => Some(lock_budget(tx, &b).await?),
                None => None,
            };
            (budget, holds_around(tx, &rec).await?)
        }
    };
    Ok(Some(Around {
        run: rec,
        budget,
        holds,
        hold,
    }))
}

/// A run's holds (expired ones too), in id order.
async fn run_holds(tx: &mut Tx<'_>, run: &RunKey) -> TxResult<Vec<(HoldAt, HoldRecord)>> {
    let rows = tx
        .query(
            "SELECT run_id, hold_id, record FROM {s}agentstate_holds \
         WHERE tenant = $1 AND run_id = $2 ORDER BY hold_id",
            &[&id_in(&run.tenant), &id_in(&run.run_id)],
        )
        .await?;
    Ok(hold_rows(&rows)?)
}

/// A budget's holds (expired ones too), in (run, hold) order.
async fn budget_holds(tx: &mut Tx<'_>, budget: &BudgetKey) -> TxResult<Vec<(HoldAt, HoldRecord)>> {
    let rows = tx
        .query(
            "SELECT run_id, hold_id, record FROM {s}agentstate_holds \
         WHERE tenant = $1 AND budget = $2 ORDER BY run_id, hold_id",
            &[&id_in(&budget.tenant), &id_in(&budget.name)],
        )
        .await?;
    Ok(hold_rows(&rows)?)
}

/// The holds a write to `run` looks at: its budget's (which hold the
/// run's) when it draws from one, else its own. The budget's row must be
/// locked already.
async fn holds_around(tx: &mut Tx<'_>, run: &RunRecord) -> TxResult<Vec<(HoldAt, HoldRecord)>> {
    match budget_of(run) {
        Some(b) => budget_holds(tx, &b).await,
        None => run_holds(tx, &run.key).await,
    }
}

async fn delete_hold(tx: &mut Tx<'_>, run: &RunKey, hold_id: &str) -> TxResult<()> {
    tx.defer(
        "DELETE FROM {s}agentstate_holds WHERE tenant = $1 AND run_id = $2 AND hold_id = $3",
        params![own(&run.tenant), own(&run.run_id), own(hold_id)],
    )
    .await?;
    Ok(())
}

/// B5: removes the holds among `holds` (of `tenant`) that have expired at
/// `now`. Called only by writes that go ahead, so a refused call still
/// changes nothing.
async fn purge_expired(
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
    tx.defer(
        "DELETE FROM {s}agentstate_holds WHERE tenant = $1 AND (run_id, hold_id) IN \
         (SELECT * FROM unnest($2::text[], $3::text[]))",
        params![own(tenant), runs, ids],
    )
    .await?;
    Ok(())
}

/// What a patch (or settle) does beyond the run itself: adds `delta` to
/// the budget the run draws from and removes the expired holds of the run
/// and its budget (B3, B5, B6). Locks the budget's row (after the run's).
pub(crate) async fn after_patch(
    tx: &mut Tx<'_>,
    run: &RunRecord,
    delta: &StateDelta,
    now: Millis,
) -> TxResult<()> {
    if let Some(b) = budget_of(run) {
        let Some((_, spent)) = lock_budget(tx, &b).await? else {
            return Err(StateError::NotFound(RecordKey::Budget(b)).into());
        };
        let spent = budget_spent(spent, delta);
        tx.defer(
            "UPDATE {s}agentstate_budgets SET spent = $3 WHERE tenant = $1 AND name = $2",
            params![own(&b.tenant), own(&b.name), value::encode(&spent)],
        )
        .await?;
    }
    let holds = holds_around(tx, run).await?;
    purge_expired(tx, &run.key.tenant, &holds, now).await
}

/// Writes a hold of `run` (whose budget column follows the run's budget).
pub(crate) async fn insert_hold(tx: &mut Tx<'_>, run: &RunRecord, h: &HoldRecord) -> TxResult<()> {
    let budget = run.budget.as_deref().map(own);
    tx.defer(
        "INSERT INTO {s}agentstate_holds (tenant, run_id, hold_id, budget, expires_at, record) \
         VALUES ($1, $2, $3, $4, $5::text::numeric, $6)",
        params![
            own(&run.key.tenant),
            own(&run.key.run_id),
            own(&h.id),
            budget,
            num(h.expires_at),
            value::encode(h),
        ],
    )
    .await?;
    Ok(())
}

/// Writes an imported budget.
pub(crate) async fn insert_budget(
    tx: &mut Tx<'_>,
    b: &BudgetRecord,
    spent: &Spend,
) -> TxResult<()> {
    tx.defer(
        "INSERT INTO {s}agentstate_budgets (tenant, name, record, spent) VALUES ($1, $2, $3, $4)",
        params![
            own(&b.key.tenant),
            own(&b.key.name),
            value::encode(b),
            value::encode(spent),
        ],
    )
    .await?;
    Ok(())
}

/// The run's hold `hold_id` if it still counts at `now`; `NotFound`
/// otherwise (B4, B5).
async fn live_hold(
    tx: &mut Tx<'_>,
    run: &RunKey,
    hold_id: &str,
    now: Millis,
) -> TxResult<HoldRecord> {
    let rows = tx
        .query(
            HOLD,
            &[&id_in(&run.tenant), &id_in(&run.run_id), &id_in(hold_id)],
        )
        .await?;
    Ok(hold_in(&rows, run, hold_id, now)?)
}

/// The hold read in `rows` if it still counts at `now`; `NotFound`
/// otherwise (B4, B5).
fn hold_in(rows: &[Row], run: &RunKey, hold_id: &str, now: Millis) -> Result<HoldRecord> {
    let missing = || {
        StateError::NotFound(RecordKey::Hold {
            run: run.clone(),
            hold_id: hold_id.to_string(),
        })
    };
    let Some(row) = rows.first() else {
        return Err(missing());
    };
    let h = decode_hold(row.get(0), hold_id)?;
    if !h.is_live(now) {
        return Err(missing());
    }
    Ok(h)
}

/// A budget's status at `now`, its holds read in `tx`.
async fn status_in(
    tx: &mut Tx<'_>,
    record: BudgetRecord,
    spent: Spend,
    now: Millis,
) -> TxResult<BudgetStatus> {
    let holds = budget_holds(tx, &record.key).await?;
    Ok(BudgetStatus {
        held: held(holds.iter().map(|(_, h)| h), now),
        holds: holds.iter().filter(|(_, h)| h.is_live(now)).count() as u64,
        record,
        spent,
    })
}

/// A run's spend at `now`, its holds read in `tx`.
pub(crate) async fn spend_in(tx: &mut Tx<'_>, run: &RunRecord, now: Millis) -> TxResult<RunSpend> {
    let holds: Vec<HoldRecord> = run_holds(tx, &run.key)
        .await?
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

impl PostgresStore {
    pub(super) async fn do_put_budget(&self, record: BudgetRecord) -> Result<BudgetRecord> {
        check_budget_key(&record.key)?;
        let now = self.now();
        let max = self.max();
        txn!(self, |tx| {
            let k = &record.key;
            let stored = lock_budget(tx, k).await?;
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
            tx.defer(
                sql,
                params![own(&k.tenant), own(&k.name), bytes, spent_bytes],
            )
            .await?;
            Ok(new)
        })
    }

    pub(super) async fn do_get_budget(&self, key: &BudgetKey) -> Result<Option<BudgetStatus>> {
        check_budget_key(key)?;
        let now = self.now();
        txn!(self, |tx| match read_budget(tx, key, false).await? {
            Some((r, s)) => Ok(Some(status_in(tx, r, s, now).await?)),
            None => Ok(None),
        })
    }

    pub(super) async fn do_list_budgets(
        &self,
        tenant: &str,
        page: &PageRequest,
    ) -> Result<Page<BudgetStatus>> {
        check_id("tenant", tenant)?;
        check_limit(page.limit)?;
        let now = self.now();
        let secret = self.secret().await?;
        let (binding, after) = super::tenant_cursor(&secret, Listing::Budgets, tenant, page)?;
        let limit = (page.limit + 1) as i64;
        let t = id_in(tenant);
        let mut items =
            txn!(self, |tx| {
                let rows = match &after {
                None => tx.query(
                    "SELECT name, record, spent FROM {s}agentstate_budgets WHERE tenant = $1 \
                     ORDER BY name LIMIT $2",
                    &[&t, &limit],
                ).await?,
                Some(a) => tx.query(
                    "SELECT name, record, spent FROM {s}agentstate_budgets WHERE tenant = $1 \
                     AND name > $3 ORDER BY name LIMIT $2",
                    &[&t, &limit, &id_in(a)],
                ).await?,
            };
                let mut items = Vec::with_capacity(rows.len());
                for r in &rows {
                    let key = BudgetKey::new(tenant, id_out(r.get(0))?);
                    let (rec, spent) = decode_budget(r.get(1), r.get(2), &key)?;
                    items.push(status_in(tx, rec, spent, now).await?);
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

    pub(super) async fn do_reserve(&self, run: &RunKey, hold: Hold) -> Result<HoldRecord> {
        self.reserve_with(run, hold, None).await
    }
    pub(super) async fn do_reserve_idempotent(
        &self,
        run: &RunKey,
        hold: Hold,
        key: &IdempotencyKey,
    ) -> Result<HoldRecord> {
        let keyed = Keyed::reserve(run, &hold, key)?;
        self.reserve_with(run, hold, Some(keyed)).await
    }

    pub(super) async fn do_settle(
        &self,
        run: &RunKey,
        hold_id: &str,
        spent: StateDelta,
    ) -> Result<Settled> {
        self.settle_with(run, hold_id, spent, None).await
    }
    pub(super) async fn do_settle_idempotent(
        &self,
        run: &RunKey,
        hold_id: &str,
        spent: StateDelta,
        key: &IdempotencyKey,
    ) -> Result<Settled> {
        let keyed = Keyed::settle(run, hold_id, &spent, key)?;
        self.settle_with(run, hold_id, spent, Some(keyed)).await
    }

    pub(super) async fn do_release_hold(&self, run: &RunKey, hold_id: &str) -> Result<()> {
        self.release_hold_with(run, hold_id, None).await
    }
    pub(super) async fn do_release_hold_idempotent(
        &self,
        run: &RunKey,
        hold_id: &str,
        key: &IdempotencyKey,
    ) -> Result<()> {
        let keyed = Keyed::release_hold(run, hold_id, key)?;
        self.release_hold_with(run, hold_id, Some(keyed)).await
    }

    pub(super) async fn do_run_spend(&self, run: &RunKey) -> Result<Option<RunSpend>> {
        check_run_key(run)?;
        let now = self.now();
        txn!(self, |tx| match read_run(tx, run, false).await? {
            Some(r) => Ok(Some(spend_in(tx, &r, now).await?)),
            None => Ok(None),
        })
    }
}

impl PostgresStore {
    /// `reserve`, under `keyed`'s idempotency key when there is one.
    async fn reserve_with(
        &self,
        run: &RunKey,
        hold: Hold,
        keyed: Option<Keyed<'_>>,
    ) -> Result<HoldRecord> {
        check_run_key(run)?;
        check_hold(&hold)?;
        let now = self.now();
        let guess = self.runs_seen.budget_of(run).flatten();
        txn_keyed!(self, keyed, |tx| {
            // The budget's row is locked before its holds are read (and
            // after the run's row: the one lock order).
            let Some(a) = around(tx, run, guess.as_deref(), None).await? else {
                return Err(StateError::NotFound(RecordKey::Run(run.clone())).into());
            };
            let (r, holds) = (a.run, a.holds);
            let budget = match (budget_of(&r), a.budget) {
                (Some(b), Some(found)) => Some(found.ok_or(b)),
                _ => None,
            };
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
                Some(Err(b)) => {
                    return Err(StateError::NotFound(RecordKey::Budget(b.clone())).into());
                }
                None => None,
            };
            check_reserve(&r, run_held, side.as_ref(), hold.amounts())?;
            let rec = new_hold(&hold, now)?;
            purge_expired(tx, &run.tenant, &holds, now).await?;
            insert_hold(tx, &r, &rec).await?;
            Ok(rec)
        })
    }

    /// `settle`, under `keyed`'s idempotency key when there is one.
    async fn settle_with(
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
        let guess = self.runs_seen.budget_of(run).flatten();
        let out = txn_keyed!(self, keyed, |tx| {
            let Some(a) = around(tx, run, guess.as_deref(), Some(hold_id)).await? else {
                return Err(StateError::NotFound(RecordKey::Run(run.clone())).into());
            };
            let old = a.run;
            let h = hold_in(a.hold.as_deref().unwrap_or_default(), run, hold_id, now)?;
            let new = patched_run(&old, &spent, now)?;
            write_run(tx, &new, Some(&old), max).await?;
            delete_hold(tx, run, hold_id).await?;
            // B3, B5, B6 as `after_patch`, on what was read: the holds
            // read before the settled one's delete count it, but it was
            // live, so it is not purged twice.
            if let Some(b) = budget_of(&new) {
                let Some(Some((_, was))) = a.budget else {
                    return Err(StateError::NotFound(RecordKey::Budget(b)).into());
                };
                let total = budget_spent(was, &spent);
                tx.defer(
                    "UPDATE {s}agentstate_budgets SET spent = $3 WHERE tenant = $1 AND name = $2",
                    params![own(&b.tenant), own(&b.name), value::encode(&total)],
                )
                .await?;
            }
            purge_expired(tx, &run.tenant, &a.holds, now).await?;
            Ok(Settled {
                record: new,
                overshoot: overshoot(&h, &spent),
            })
        });
        if let Ok(s) = &out {
            self.runs_seen.put_run(&s.record);
        }
        out
    }

    /// `release_hold`, under `keyed`'s idempotency key when there is one.
    async fn release_hold_with(
        &self,
        run: &RunKey,
        hold_id: &str,
        keyed: Option<Keyed<'_>>,
    ) -> Result<()> {
        check_run_key(run)?;
        check_id("hold id", hold_id)?;
        let now = self.now();
        txn_keyed!(self, keyed, |tx| {
            let Some(r) = read_run(tx, run, true).await? else {
                return Err(StateError::NotFound(RecordKey::Run(run.clone())).into());
            };
            live_hold(tx, run, hold_id, now).await?;
            // Its budget's holds are purged below: under its row's lock.
            if let Some(b) = budget_of(&r) {
                lock_budget(tx, &b).await?;
            }
            delete_hold(tx, run, hold_id).await?;
            let holds = holds_around(tx, &r).await?;
            purge_expired(tx, &run.tenant, &holds, now).await
        })
    }
}
