//! Spend caps (rules B1–B6) as server transactions: each reserve, settle,
//! release and patch locks the run's row, then its budget's row (always in
//! that order, so two calls never wait on each other in a cycle), reads the
//! holds, asks `agentstate_core::rules` what to write, and writes it before commit,
//! so the cap check and the hold it records are one atomic step.
//!
//! Every write of a hold of a budget's run happens with the budget's row
//! locked, so once a call holds that lock, the budget's holds it reads are
//! the ones that count.
//!
//! **One round trip** (schema 8). `reserve` and `settle` first try the
//! server's `agentstate_reserve` / `agentstate_settle` (v8.sql), sent with
//! `BEGIN` and `COMMIT` as one pipeline: the store decides against the run,
//! budget and hold as it last saw them ([`Seen`], `runs::Seen`), and the
//! function writes that decision only if, under the same locks in the same
//! order, those rows still hold exactly the bytes decided on and the caps
//! still fit the holds as they are now (summed by the server from their
//! amount columns). It writes nothing and answers false otherwise, and the
//! call takes the locked path below, which decides again on fresh reads
//! (and gives a refusal its facts): so the fast path can agree with the
//! locked path but never allow what it would refuse. Keyed calls take the
//! locked path.
//!
//! **The locked path.** Its reads go out at once ([`around`]): the run's
//! row locked, the hold (settle), the budget's row locked and the holds
//! around. The server runs them in that order, each on a snapshot taken
//! after the locks before it, so they read what sequential reads did. The
//! budget is named by the run, so it is guessed from the run as this store
//! last saw it (a run's budget is fixed at create); a wrong guess (or none)
//! reads the budget in the old order. The writes go out with `COMMIT`: 2
//! round trips each, budget or not, and what it read becomes what the
//! store has seen.

use std::sync::Arc;

use tokio_postgres::Row;
use tokio_postgres::types::ToSql;

use agentstate_core::budget::{
    Amount, BudgetKey, BudgetRecord, BudgetStatus, Caps, Hold, HoldRecord, RunSpend, Settled, Spend,
};
use agentstate_core::codec::cursor::{self as cursor_codec, Listing};
use agentstate_core::codec::key::KeyBuf;
use agentstate_core::codec::value;
use agentstate_core::error::{RecordKey, Result, StateError};
use agentstate_core::idempotency::{IdempotencyKey, Keyed};
use agentstate_core::limits::HOLDS_PER_RUN_MAX;
use agentstate_core::page::{Page, PageRequest};
use agentstate_core::record::{Millis, RunKey, RunRecord, StateDelta};
use agentstate_core::rules::{
    BudgetSide, check_budget_key, check_hold, check_id, check_limit, check_new_hold, check_reserve,
    check_run_key, check_size, expired, held, new_hold, next_budget, overshoot, patched_run,
};

use super::conn::{Tx, TxResult, params, txn};
use super::idempotency::txn_keyed;
use super::recent::{Recent, Shared};
use super::runs::{LOCK_RUN, decode_run_at, read_run, stored_bytes, write_run};
use super::{Col, PostgresStore, fields, id_in, id_out, num, own};

/// A hold's place: its run's id and its own.
type HoldAt = (String, String);

/// A budget's row as stored: its record's bytes and its spent's.
type BudgetRow = (Arc<[u8]>, Arc<[u8]>);

/// A budget's row decoded.
type BudgetRead = (BudgetRecord, Spend);

/// Most budgets, and most holds, a store remembers the bytes of.
const SEEN_BUDGETS_MAX: usize = 4096;
const SEEN_HOLDS_MAX: usize = 16384;
/// Most bytes of either (records are small; this bounds a hostile size).
const SEEN_BYTES_MAX: usize = 8 << 20;

/// The bytes of the budgets (record, spent) and holds this store last read
/// or wrote: the guesses of the one-round-trip `reserve` and `settle`
/// (with `runs::Seen` for the runs). A hint only: the server checks each
/// guess against the locked row before anything is written.
pub(crate) struct Seen {
    budgets: Shared<BudgetKey, BudgetRow>,
    holds: Shared<(RunKey, String), Arc<[u8]>>,
}

impl Default for Seen {
    fn default() -> Self {
        Seen {
            budgets: parking_lot::Mutex::new(Recent::new(SEEN_BUDGETS_MAX, SEEN_BYTES_MAX)),
            holds: parking_lot::Mutex::new(Recent::new(SEEN_HOLDS_MAX, SEEN_BYTES_MAX)),
        }
    }
}

impl Seen {
    fn budget(&self, k: &BudgetKey) -> Option<BudgetRow> {
        self.budgets.lock().get(k)
    }
    fn put_budget(&self, k: &BudgetKey, record: Arc<[u8]>, spent: Arc<[u8]>) {
        let w = record.len() + spent.len();
        self.budgets.lock().insert(k.clone(), (record, spent), w);
    }
    pub(crate) fn forget_budget(&self, k: &BudgetKey) {
        self.budgets.lock().remove(k);
    }
    fn hold(&self, run: &RunKey, id: &str) -> Option<Arc<[u8]>> {
        self.holds.lock().get(&(run.clone(), id.to_string()))
    }
    fn put_hold(&self, run: &RunKey, id: &str, bytes: Arc<[u8]>) {
        let w = bytes.len();
        self.holds
            .lock()
            .insert((run.clone(), id.to_string()), bytes, w);
    }
    fn forget_hold(&self, run: &RunKey, id: &str) {
        self.holds.lock().remove(&(run.clone(), id.to_string()));
    }
    /// Forgets every budget and hold of `tenant` (a purge).
    pub(crate) fn forget_tenant(&self, tenant: &str) {
        self.budgets.lock().retain(|k| k.tenant != tenant);
        self.holds.lock().retain(|(k, _)| k.tenant != tenant);
    }
}

/// A [`Spend`] as the `numeric[]` a function of v8.sql takes (cost_micros,
/// tokens, iterations).
fn amounts(s: Spend) -> Vec<String> {
    vec![num(s.cost_micros), num(s.tokens), num(s.iterations)]
}

/// [`Caps`] as the same, NULL where an amount is not capped.
fn maxes(c: &Caps) -> Vec<Option<String>> {
    Amount::ALL.iter().map(|a| c.max(*a).map(num)).collect()
}

/// The budget a run draws from, if any.
pub(crate) fn budget_of(run: &RunRecord) -> Option<BudgetKey> {
    run.budget
        .as_ref()
        .map(|n| BudgetKey::new(run.key.tenant.clone(), n.clone()))
}

/// The columns a budget's reads select after its `record`: `spent` and
/// [`CHARGED`].
macro_rules! budget_cols {
    () => {
        "record, spent, ARRAY[charged_cost_micros, charged_tokens, charged_iterations]::text[]"
    };
}
pub(crate) use budget_cols;

/// Decodes a budget row's record and `spent` columns, checking the key:
/// the spent as of the row's last whole write (schema 10: see
/// [`decode_budget`]).
fn decode_budget_base(
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

/// Decodes a budget row read with [`budget_cols!`]: its record, and its
/// spent, the encoded `spent` plus the amounts settles and patches booked
/// since (`charged_*`, schema 10), saturating as a spend always does.
pub(crate) fn decode_budget(
    record: &[u8],
    spent: &[u8],
    charged: Vec<String>,
    key: &BudgetKey,
) -> Result<(BudgetRecord, Spend)> {
    let (r, base) = decode_budget_base(record, spent, key)?;
    let [cost, tokens, iterations]: [String; 3] = charged
        .try_into()
        .map_err(|_| StateError::corrupt("budget charged amounts: not three"))?;
    // numeric(20, 0) holds more than a u64: a sum past it saturates.
    let amount = |t: String| -> Result<u64> {
        let n: u128 = t.parse().map_err(|_| {
            StateError::corrupt(format!("budget charged amount: {t:?} is not a count"))
        })?;
        Ok(u64::try_from(n).unwrap_or(u64::MAX))
    };
    Ok((
        r,
        Spend {
            cost_micros: base.cost_micros.saturating_add(amount(cost)?),
            tokens: base.tokens.saturating_add(amount(tokens)?),
            iterations: base.iterations.saturating_add(amount(iterations)?),
        },
    ))
}

/// Books `delta` into a budget's `charged_*` (schema 10), under its row's
/// lock; `$1`, `$2` the key, `$3` the amounts ([`amounts`]).
const CHARGE: &str = "UPDATE {s}agentstate_budgets \
     SET charged_cost_micros = charged_cost_micros + ($3::text[]::numeric[])[1], \
     charged_tokens = charged_tokens + ($3::text[]::numeric[])[2], \
     charged_iterations = charged_iterations + ($3::text[]::numeric[])[3] \
     WHERE tenant = $1 AND name = $2 RETURNING 1";

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
        LOCK_BUDGET
    } else {
        concat!(
            "SELECT ",
            budget_cols!(),
            " FROM {s}agentstate_budgets WHERE tenant = $1 AND name = $2"
        )
    };
    let rows = tx
        .query(sql, &[&id_in(&key.tenant), &id_in(&key.name)])
        .await?;
    Ok(rows
        .first()
        .map(|r| decode_budget(r.col(0)?, r.col(1)?, r.col(2)?, key))
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
            let run_id = id_out(r.col(0)?)?;
            let hold_id = id_out(r.col(1)?)?;
            let h = decode_hold(r.col(2)?, &hold_id)?;
            Ok(((run_id, hold_id), h))
        })
        .collect()
}

const LOCK_BUDGET: &str = concat!(
    "SELECT ",
    budget_cols!(),
    " FROM {s}agentstate_budgets WHERE tenant = $1 AND name = $2 FOR UPDATE"
);
const RUN_HOLDS: &str = "SELECT run_id, hold_id, record FROM {s}agentstate_holds \
     WHERE tenant = $1 AND run_id = $2 ORDER BY hold_id";
const BUDGET_HOLDS: &str = "SELECT run_id, hold_id, record FROM {s}agentstate_holds \
     WHERE tenant = $1 AND budget = $2 ORDER BY run_id, hold_id";
const HOLD: &str =
    "SELECT record FROM {s}agentstate_holds WHERE tenant = $1 AND run_id = $2 AND hold_id = $3";

/// A budget as this store last saw it: its row's bytes, decoded.
struct SeenBudget {
    key: BudgetKey,
    record_bytes: Arc<[u8]>,
    spent_bytes: Arc<[u8]>,
    record: BudgetRecord,
    spent: Spend,
}

impl SeenBudget {
    /// The budget's name and the bytes it was seen with, as a function of
    /// schema 8 takes them (NULL: the run draws from no budget).
    fn params(b: Option<&SeenBudget>) -> (Option<String>, Option<&[u8]>, Option<&[u8]>) {
        match b {
            Some(b) => (
                Some(own(&b.key.name)),
                Some(&b.record_bytes),
                Some(&b.spent_bytes),
            ),
            None => (None, None, None),
        }
    }
}

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
    /// The run's row as read: its bytes and seq column.
    run_row: (Arc<[u8]>, i64),
    /// The budget's row as read (record, spent), when the guess was right.
    budget_row: Option<BudgetRow>,
}

/// A budget's row read by [`LOCK_BUDGET`], decoded and as stored (`None`
/// both: no such budget).
fn budget_in(rows: &[Row], key: &BudgetKey) -> Result<(Option<BudgetRead>, Option<BudgetRow>)> {
    let Some(r) = rows.first() else {
        return Ok((None, None));
    };
    let (record, spent): (&[u8], &[u8]) = (r.col(0)?, r.col(1)?);
    Ok((
        Some(decode_budget(record, spent, r.col(2)?, key)?),
        Some((record.into(), spent.into())),
    ))
}

/// The reads of a reserve (`hold_id` `None`) or settle, pipelined (see
/// the module's notes): `guess` names the run's budget (`None`: no
/// budget). `None`: the run does not exist.
#[allow(clippy::expect_used, reason = "one answer per statement")]
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
    let rec = decode_run_at(row.col(0)?, run, row.col(1)?)?;
    let run_row = (Arc::<[u8]>::from(row.col::<_, &[u8]>(0)?), row.col(1)?);
    let hold = hold_id.map(|_| next());
    let mut budget_row = None;
    let (budget, holds) = match guess {
        Some(name) if rec.budget.as_deref() == Some(name) => {
            let bk = BudgetKey::new(run.tenant.clone(), name);
            let (b, row) = budget_in(&next(), &bk)?;
            budget_row = row;
            (Some(b), hold_rows(&next())?)
        }
        None if rec.budget.is_none() => (None, hold_rows(&next())?),
        // A wrong guess: the budget's row locked, then its holds read.
        _ => {
            let budget = match budget_of(&rec) {
                Some(b) => {
                    let rows = tx
                        .query(LOCK_BUDGET, &[&id_in(&b.tenant), &id_in(&b.name)])
                        .await?;
                    let (found, row) = budget_in(&rows, &b)?;
                    budget_row = row;
                    Some(found)
                }
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
        run_row,
        budget_row,
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
        charge(tx, &b, delta).await?;
    }
    let holds = holds_around(tx, run).await?;
    purge_expired(tx, &run.key.tenant, &holds, now).await
}

/// Books `delta` into budget `b` ([`CHARGE`]); `NotFound` when there is
/// no such budget.
async fn charge(tx: &mut Tx<'_>, b: &BudgetKey, delta: &StateDelta) -> TxResult<()> {
    let rows = tx
        .query(
            CHARGE,
            &[
                &id_in(&b.tenant),
                &id_in(&b.name),
                &amounts(Spend::of_delta(delta)),
            ],
        )
        .await?;
    if rows.is_empty() {
        return Err(StateError::NotFound(RecordKey::Budget(b.clone())).into());
    }
    Ok(())
}

/// Writes a hold of `run` (whose budget column follows the run's budget).
pub(crate) async fn insert_hold(tx: &mut Tx<'_>, run: &RunRecord, h: &HoldRecord) -> TxResult<()> {
    let budget = run.budget.as_deref().map(own);
    tx.defer(
        "INSERT INTO {s}agentstate_holds \
         (tenant, run_id, hold_id, budget, expires_at, record, cost_micros, tokens, iterations) \
         VALUES ($1, $2, $3, $4, $5::text::numeric, $6, \
         $7::text::numeric, $8::text::numeric, $9::text::numeric)",
        params![
            own(&run.key.tenant),
            own(&run.key.run_id),
            own(&h.id),
            budget,
            num(h.expires_at),
            value::encode(h),
            num(h.amounts.cost_micros),
            num(h.amounts.tokens),
            num(h.amounts.iterations),
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
    let h = decode_hold(row.col(0)?, hold_id)?;
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
    Ok(BudgetStatus::new(
        record,
        spent,
        held(holds.iter().map(|(_, h)| h), now),
        holds.iter().filter(|(_, h)| h.is_live(now)).count() as u64,
    ))
}

/// A run's spend at `now`, its holds read in `tx`.
pub(crate) async fn spend_in(tx: &mut Tx<'_>, run: &RunRecord, now: Millis) -> TxResult<RunSpend> {
    let holds: Vec<HoldRecord> = run_holds(tx, &run.key)
        .await?
        .into_iter()
        .map(|(_, h)| h)
        .filter(|h| h.is_live(now))
        .collect();
    Ok(RunSpend::new(
        run.key.clone(),
        run.caps,
        run.budget.clone(),
        Spend::of_run(run),
        held(&holds, now),
        holds,
    ))
}

impl PostgresStore {
    pub(super) async fn put_budget(&self, record: BudgetRecord) -> Result<BudgetRecord> {
        check_budget_key(&record.key)?;
        let now = self.now();
        let max = self.max();
        let mut wrote = None;
        let out = txn!(self, |tx| {
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
                // The whole row: `spent` takes in what was charged.
                "UPDATE {s}agentstate_budgets SET record = $3, spent = $4, \
                 charged_cost_micros = 0, charged_tokens = 0, charged_iterations = 0 \
                 WHERE tenant = $1 AND name = $2"
            };
            wrote = Some((
                Arc::<[u8]>::from(&bytes[..]),
                Arc::<[u8]>::from(&spent_bytes[..]),
            ));
            tx.defer(
                sql,
                params![own(&k.tenant), own(&k.name), bytes, spent_bytes],
            )
            .await?;
            Ok(new)
        });
        match (&out, wrote) {
            (Ok(b), Some((record, spent))) => self.spend_seen.put_budget(&b.key, record, spent),
            _ => self.spend_seen.forget_budget(&record.key),
        }
        out
    }

    pub(super) async fn get_budget(&self, key: &BudgetKey) -> Result<Option<BudgetStatus>> {
        check_budget_key(key)?;
        let now = self.now();
        txn!(self, |tx| {
            tx.reads_only();
            match read_budget(tx, key, false).await? {
                Some((r, s)) => Ok(Some(status_in(tx, r, s, now).await?)),
                None => Ok(None),
            }
        })
    }

    pub(super) async fn list_budgets(
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
        let mut items = txn!(self, |tx| {
            tx.reads_only();
            let rows = match &after {
                None => {
                    tx.query(
                        concat!(
                            "SELECT name, ",
                            budget_cols!(),
                            " FROM {s}agentstate_budgets WHERE tenant = $1 \
                     ORDER BY name LIMIT $2"
                        ),
                        &[&t, &limit],
                    )
                    .await?
                }
                Some(a) => {
                    tx.query(
                        concat!(
                            "SELECT name, ",
                            budget_cols!(),
                            " FROM {s}agentstate_budgets WHERE tenant = $1 \
                     AND name > $3 ORDER BY name LIMIT $2"
                        ),
                        &[&t, &limit, &id_in(a)],
                    )
                    .await?
                }
            };
            let mut items = Vec::with_capacity(rows.len());
            for r in &rows {
                let key = BudgetKey::new(tenant, id_out(r.col(0)?)?);
                let (rec, spent) = decode_budget(r.col(1)?, r.col(2)?, r.col(3)?, &key)?;
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

    pub(super) async fn reserve(&self, run: &RunKey, hold: Hold) -> Result<HoldRecord> {
        self.reserve_with(run, hold, None).await
    }
    pub(super) async fn reserve_idempotent(
        &self,
        run: &RunKey,
        hold: Hold,
        key: &IdempotencyKey,
    ) -> Result<HoldRecord> {
        let keyed = Keyed::reserve(run, &hold, key)?;
        self.reserve_with(run, hold, Some(keyed)).await
    }

    pub(super) async fn settle(
        &self,
        run: &RunKey,
        hold_id: &str,
        spent: StateDelta,
    ) -> Result<Settled> {
        self.settle_with(run, hold_id, spent, None).await
    }
    pub(super) async fn settle_idempotent(
        &self,
        run: &RunKey,
        hold_id: &str,
        spent: StateDelta,
        key: &IdempotencyKey,
    ) -> Result<Settled> {
        let keyed = Keyed::settle(run, hold_id, &spent, key)?;
        self.settle_with(run, hold_id, spent, Some(keyed)).await
    }

    pub(super) async fn release_hold(&self, run: &RunKey, hold_id: &str) -> Result<()> {
        self.release_hold_with(run, hold_id, None).await
    }
    pub(super) async fn release_hold_idempotent(
        &self,
        run: &RunKey,
        hold_id: &str,
        key: &IdempotencyKey,
    ) -> Result<()> {
        let keyed = Keyed::release_hold(run, hold_id, key)?;
        self.release_hold_with(run, hold_id, Some(keyed)).await
    }

    pub(super) async fn run_spend(&self, run: &RunKey) -> Result<Option<RunSpend>> {
        check_run_key(run)?;
        let now = self.now();
        txn!(self, |tx| {
            tx.reads_only();
            match read_run(tx, run, false).await? {
                Some(r) => Ok(Some(spend_in(tx, &r, now).await?)),
                None => Ok(None),
            }
        })
    }
}

impl PostgresStore {
    /// `reserve`, under `keyed`'s idempotency key when there is one.
    // Rule B2: `check_reserve` on rows read FOR UPDATE (the fast path's
    // server copy: agentstate_reserve in v8.sql).
    async fn reserve_with(
        &self,
        run: &RunKey,
        hold: Hold,
        keyed: Option<Keyed<'_>>,
    ) -> Result<HoldRecord> {
        check_run_key(run)?;
        check_hold(&hold)?;
        let now = self.now();
        if keyed.is_none()
            && let Some(h) = self.fast_reserve(run, &hold, now).await?
        {
            return Ok(h);
        }
        let guess = self.runs_seen.budget_of(run).flatten();
        let mut read = None;
        let out = txn_keyed!(self, keyed, |tx| {
            // The budget's row is locked before its holds are read (and
            // after the run's row: the one lock order).
            let Some(a) = around(tx, run, guess.as_deref(), None).await? else {
                return Err(StateError::NotFound(RecordKey::Run(run.clone())).into());
            };
            read = Some((
                a.run_row.clone(),
                budget_of(&a.run).zip(a.budget_row.clone()),
            ));
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
        });
        if let (Ok(h), Some(((bytes, seq), budget))) = (&out, read) {
            self.runs_seen.put(run, bytes, seq);
            if let Some((b, (record, spent))) = budget {
                self.spend_seen.put_budget(&b, record, spent);
            }
            self.spend_seen
                .put_hold(run, &h.id, value::encode(h).into());
        }
        out
    }

    /// The one-round-trip reserve (the module's notes): `None` when not
    /// taken (the run or its budget not seen) or declined by the server.
    // Rule B2, server copy: agentstate_reserve / agentstate_fits (v8.sql) may only decline.
    async fn fast_reserve(
        &self,
        run: &RunKey,
        hold: &Hold,
        now: Millis,
    ) -> Result<Option<HoldRecord>> {
        let Some((seen, seq)) = self.runs_seen.get(run) else {
            return Ok(None);
        };
        let Ok(r) = decode_run_at(&seen, run, seq) else {
            return Ok(None);
        };
        let Some(b) = self.seen_budget(&r) else {
            return Ok(None);
        };
        let Ok(h) = new_hold(hold, now) else {
            return Ok(None);
        };
        let bytes = value::encode(&h);
        let (t, rid, hid) = (id_in(&run.tenant), id_in(&run.run_id), id_in(&h.id));
        let (bname, brec, bspent) = SeenBudget::params(b.as_ref());
        let (bused, bmax) = match &b {
            Some(b) => (amounts(b.spent), maxes(&b.record.caps)),
            None => (Vec::new(), Vec::new()),
        };
        let (asked, run_spent, run_max) = (
            amounts(h.amounts),
            amounts(Spend::of_run(&r)),
            maxes(&r.caps),
        );
        let (expires, at) = (num(h.expires_at), num(now));
        let holds_max = HOLDS_PER_RUN_MAX as i64;
        let seen_bytes: &[u8] = &seen;
        let done = self
            .guessed(
                "SELECT {s}agentstate_reserve($1, $2, $3, $4, $5, $6, $7, $8, \
                     $9::text::numeric, $10::text::numeric, $11::text[]::numeric[], \
                     $12::text[]::numeric[], $13::text[]::numeric[], $14::text[]::numeric[], \
                     $15::text[]::numeric[], $16)",
                &[
                    &t,
                    &rid,
                    &seen_bytes,
                    &bname,
                    &brec,
                    &bspent,
                    &hid,
                    &bytes,
                    &expires,
                    &at,
                    &asked,
                    &run_spent,
                    &run_max,
                    &bused,
                    &bmax,
                    &holds_max,
                ],
            )
            .await?;
        if done {
            self.spend_seen.put_hold(run, &h.id, bytes.into());
            return Ok(Some(h));
        }
        self.declined("reserve", &r);
        Ok(None)
    }

    /// Runs one of schema 8's functions (`sql`) in one round trip: true
    /// when it wrote, the guess holding; false when it declined, having
    /// written nothing.
    async fn guessed(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<bool> {
        txn!(self, |tx| {
            let rows = tx.query_commit(sql, params, false).await?;
            Ok(match rows.first() {
                Some(r) => r.col::<_, bool>(0)?,
                None => false,
            })
        })
    }

    /// The budget `r` draws from as this store last saw it: `Some(None)`
    /// when it draws from none, `None` when the budget was not seen.
    fn seen_budget(&self, r: &RunRecord) -> Option<Option<SeenBudget>> {
        let Some(key) = budget_of(r) else {
            return Some(None);
        };
        let (record_bytes, spent_bytes) = self.spend_seen.budget(&key)?;
        let (record, spent) = decode_budget_base(&record_bytes, &spent_bytes, &key).ok()?;
        Some(Some(SeenBudget {
            key,
            record_bytes,
            spent_bytes,
            record,
            spent,
        }))
    }

    /// After the server declined a guess: the budget is read afresh by the
    /// locked path (the run's bytes are replaced by what it reads).
    fn declined(&self, op: &'static str, r: &RunRecord) {
        agentstate_core::observe::fast_path_declined("postgres", op);
        if let Some(b) = budget_of(r) {
            self.spend_seen.forget_budget(&b);
        }
    }

    /// The one-round-trip settle (the module's notes): `None` when not
    /// taken (the run, its budget or the hold not seen, a refusal) or
    /// declined by the server.
    // Rule B3, server copy: agentstate_settle (v8.sql) may only decline.
    async fn fast_settle(
        &self,
        run: &RunKey,
        hold_id: &str,
        spent: &StateDelta,
        now: Millis,
    ) -> Result<Option<Settled>> {
        let Some((seen, seq)) = self.runs_seen.get(run) else {
            return Ok(None);
        };
        let Some(hold_bytes) = self.spend_seen.hold(run, hold_id) else {
            return Ok(None);
        };
        let (Ok(old), Ok(h)) = (
            decode_run_at(&seen, run, seq),
            decode_hold(&hold_bytes, hold_id),
        ) else {
            return Ok(None);
        };
        if !h.is_live(now) {
            return Ok(None);
        }
        let Ok(new) = patched_run(&old, spent, now) else {
            return Ok(None);
        };
        let bytes = stored_bytes(&new);
        if check_size("run record", bytes.len(), self.max()).is_err() {
            return Ok(None);
        }
        // The spend is added to the budget's row on the server (schema
        // 10): nothing of the budget is guessed.
        let bname = budget_of(&old).map(|b| own(&b.name));
        let charge = amounts(Spend::of_delta(spent));
        let (t, rid, hid) = (id_in(&run.tenant), id_in(&run.run_id), id_in(hold_id));
        let (at, updated, cols) = (num(now), num(new.updated_at), fields::run_text(&new));
        let (seen_bytes, hold_seen): (&[u8], &[u8]) = (&seen, &hold_bytes);
        let done = self
            .guessed(
                "SELECT {s}agentstate_settle_charged($1, $2, $3, $4, $5, $6, \
                     $7::text::numeric, $8, $9, $10::text::numeric, $11::text[]::numeric[])",
                &[
                    &t,
                    &rid,
                    &seen_bytes,
                    &bname,
                    &hid,
                    &hold_seen,
                    &at,
                    &bytes,
                    &cols,
                    &updated,
                    &charge,
                ],
            )
            .await?;
        if !done {
            self.declined("settle", &old);
            return Ok(None);
        }
        self.runs_seen.put(run, bytes.into(), seq);
        self.spend_seen.forget_hold(run, hold_id);
        Ok(Some(Settled::new(new, overshoot(&h, spent))))
    }

    /// `settle`, under `keyed`'s idempotency key when there is one.
    // Rule B3: the hold goes and the spend is booked in one transaction.
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
        if keyed.is_none()
            && let Some(s) = self.fast_settle(run, hold_id, &spent, now).await?
        {
            return Ok(s);
        }
        let max = self.max();
        let guess = self.runs_seen.budget_of(run).flatten();
        let mut read = None;
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
                let Some(Some(_)) = a.budget else {
                    return Err(StateError::NotFound(RecordKey::Budget(b)).into());
                };
                // Booked into `charged_*` (schema 10): the row, locked
                // above, keeps the bytes read, which stay true.
                tx.defer(
                    CHARGE,
                    params![
                        own(&b.tenant),
                        own(&b.name),
                        amounts(Spend::of_delta(&spent))
                    ],
                )
                .await?;
            }
            read = a.budget_row;
            purge_expired(tx, &run.tenant, &a.holds, now).await?;
            Ok(Settled::new(new, overshoot(&h, &spent)))
        });
        if let Ok(s) = &out {
            self.runs_seen.put_run(&s.record);
            self.spend_seen.forget_hold(run, hold_id);
            if let Some(b) = budget_of(&s.record) {
                // The row as read: its `spent` bytes stay true (the
                // spend went to `charged_*`).
                match read {
                    Some((record, spent)) => self.spend_seen.put_budget(&b, record, spent),
                    None => self.spend_seen.forget_budget(&b),
                }
            }
        }
        out
    }

    /// `release_hold`, under `keyed`'s idempotency key when there is one.
    // Rule B4: an unknown or expired hold is NotFound.
    async fn release_hold_with(
        &self,
        run: &RunKey,
        hold_id: &str,
        keyed: Option<Keyed<'_>>,
    ) -> Result<()> {
        check_run_key(run)?;
        check_id("hold id", hold_id)?;
        let now = self.now();
        let out = txn_keyed!(self, keyed, |tx| {
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
        });
        if out.is_ok() {
            self.spend_seen.forget_hold(run, hold_id);
        }
        out
    }
}
