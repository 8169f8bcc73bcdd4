//! The operator functions (`StoreAdmin`) on the server: session listing,
//! counts, checks, retention, export and import.

use agentstate_core::admin::{StoreAdmin, StoreStats, VerifyReport};
use std::collections::HashMap;

use agentstate_core::budget::{BudgetKey, Caps, HoldRecord, Spend};
use agentstate_core::codec::cursor::{self as cursor_codec, Listing};
use agentstate_core::codec::key::{KeyBuf, KeyReader};
use agentstate_core::codec::value;
use agentstate_core::entry::Entry;
use agentstate_core::error::{Result, StateError};
use agentstate_core::page::{Page, PageRequest};
use agentstate_core::record::{Millis, RunKey, RunState, SessionKey, SessionRecord};
use agentstate_core::rules::{at_cap, check_id, check_limit, checked_entry, held};
use agentstate_core::tray::{InstanceKey, Tray, TrayKey};

use super::budgets::{
    budget_cols, budget_of, decode_budget, decode_hold, insert_budget, insert_hold,
};
use super::conn::{Tx, TxResult, txn};
use super::runs::{decode_run, decode_run_at, decode_session, read_run, seq_col, write_run};
use super::trays::{in_tray, put_tray};
use super::{Col, PostgresStore, epoch_in, epoch_out, id_in, id_out, id_read, num, num_out};

/// The tables of an export, in order; each is walked in key order (the
/// same order as every other backend's export).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Table {
    Runs = 1,
    Holds = 2,
    Sessions = 3,
    Budgets = 4,
    Epochs = 5,
    Trays = 6,
    Alarms = 7,
}

const TABLES: [Table; 7] = [
    Table::Runs,
    Table::Holds,
    Table::Sessions,
    Table::Budgets,
    Table::Epochs,
    Table::Trays,
    Table::Alarms,
];

impl Table {
    fn of(b: u8) -> Result<Table> {
        TABLES
            .into_iter()
            .find(|t| *t as u8 == b)
            .ok_or_else(|| StateError::invalid("cursor: bad position"))
    }
    /// The key columns, and the statement reading rows after a key. The
    /// tray tables (pinned's, in the database's collation) are walked in
    /// byte order all the same (`COLLATE "C"`, schema 9's indexes).
    fn sql(self, first: bool) -> String {
        let (cols, key, table, filter) = match self {
            Table::Runs => ("tenant, run_id, record, seq", 2, "agentstate_runs", ""),
            Table::Holds => ("tenant, run_id, hold_id, record", 3, "agentstate_holds", ""),
            Table::Sessions => ("tenant, session_id, record", 2, "agentstate_sessions", ""),
            Table::Budgets => (
                concat!("tenant, name, ", budget_cols!()),
                2,
                "agentstate_budgets",
                "",
            ),
            // An epoch row at 0 reads like no row (T2); it is not a record.
            Table::Epochs => ("ns, id, epoch", 2, "pinned_epoch", "epoch > 0"),
            // The alarm rows (A4) are the alarms' own, exported as alarms.
            Table::Trays => (
                "ns, id, tray_ns, tray_id, marked, {s}agentstate_doc_out(doc, doc_raw), env, hostname",
                4,
                "pinned_tray_index",
                "NOT (tray_ns = 'pinned' AND tray_id = 'alarm')",
            ),
            Table::Alarms => ("ns, id, due_at::text", 2, "agentstate_alarms", ""),
        };
        let bytes = matches!(self, Table::Epochs | Table::Trays);
        let names: Vec<String> = cols
            .split(", ")
            .take(key)
            .map(|n| {
                if bytes {
                    format!("{n} COLLATE \"C\"")
                } else {
                    n.to_string()
                }
            })
            .collect();
        let names = names.join(", ");
        let mut conds: Vec<String> = Vec::new();
        if !filter.is_empty() {
            conds.push(filter.to_string());
        }
        if !first {
            let ps: Vec<String> = (0..key).map(|i| format!("${}", i + 2)).collect();
            conds.push(format!("({names}) > ({})", ps.join(", ")));
        }
        let wh = if conds.is_empty() {
            String::new()
        } else {
            format!("WHERE {}", conds.join(" AND "))
        };
        format!("SELECT {cols} FROM {{s}}{table} {wh} ORDER BY {names} LIMIT $1")
    }
}

/// An export entry and its key, as read from a row of `t`. Ids of the
/// tray tables, which pinned shares, read as their text when not in this
/// store's escaped form ([`id_read`]).
fn entry_of(t: Table, r: &tokio_postgres::Row) -> Result<(Vec<String>, Entry)> {
    let s = |i: usize| -> Result<String> {
        let text: String = r.col(i)?;
        Ok(match t {
            Table::Epochs | Table::Trays => id_read(text),
            _ => id_out(text)?,
        })
    };
    Ok(match t {
        Table::Runs => {
            let key = RunKey::new(s(0)?, s(1)?);
            let run = decode_run_at(r.col(2)?, &key, r.col(3)?)?;
            (vec![key.tenant, key.run_id], Entry::Run(run))
        }
        Table::Holds => {
            let run = RunKey::new(s(0)?, s(1)?);
            let hold_id = s(2)?;
            let hold = decode_hold(r.col(3)?, &hold_id)?;
            (
                vec![run.tenant.clone(), run.run_id.clone(), hold_id],
                Entry::Hold { run, hold },
            )
        }
        Table::Budgets => {
            let key = BudgetKey::new(s(0)?, s(1)?);
            let (budget, spent) = decode_budget(r.col(2)?, r.col(3)?, r.col(4)?, &key)?;
            (vec![key.tenant, key.name], Entry::Budget { budget, spent })
        }
        Table::Sessions => {
            let key = SessionKey::new(s(0)?, s(1)?);
            let sess = decode_session(r.col(2)?, &key)?;
            (vec![key.tenant, key.session_id], Entry::Session(sess))
        }
        Table::Epochs => {
            let instance = InstanceKey::new(s(0)?, s(1)?);
            let epoch = epoch_out(r.col(2)?);
            (
                vec![instance.ns.clone(), instance.id.clone()],
                Entry::Epoch { instance, epoch },
            )
        }
        Table::Trays => {
            let key = TrayKey {
                ns: s(0)?,
                id: s(1)?,
                tray_ns: s(2)?,
                tray_id: s(3)?,
            };
            let tray = Tray {
                marked: r.col(4).map_err(in_tray(&key))?,
                doc: r.col(5).map_err(in_tray(&key))?,
                env: s(6)?,
                hostname: s(7)?,
            };
            (
                vec![
                    key.ns.clone(),
                    key.id.clone(),
                    key.tray_ns.clone(),
                    key.tray_id.clone(),
                ],
                Entry::Tray { key, tray },
            )
        }
        Table::Alarms => {
            let instance = InstanceKey::new(s(0)?, s(1)?);
            let due_at = num_out(r.col(2)?, "agentstate_alarms.due_at")?;
            (
                vec![instance.ns.clone(), instance.id.clone()],
                Entry::Alarm { instance, due_at },
            )
        }
    })
}

/// Rows of `t` after `after` (its key, unescaped), at most `limit`.
async fn rows_after(
    tx: &mut Tx<'_>,
    t: Table,
    after: Option<&[String]>,
    limit: i64,
) -> TxResult<Vec<tokio_postgres::Row>> {
    match after {
        None => tx.query(&t.sql(true), &[&limit]).await,
        Some(k) => {
            let esc: Vec<String> = k.iter().map(|s| id_in(s).into_owned()).collect();
            let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = vec![&limit];
            for e in &esc {
                params.push(e);
            }
            tx.query(&t.sql(false), &params).await
        }
    }
}

impl PostgresStore {
    async fn exists(tx: &mut Tx<'_>, sql: &str, key: &[&str]) -> TxResult<bool> {
        let esc: Vec<String> = key.iter().map(|s| id_in(s).into_owned()).collect();
        let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = esc
            .iter()
            .map(|e| e as &(dyn tokio_postgres::types::ToSql + Sync))
            .collect();
        Ok(!tx.query(sql, &params).await?.is_empty())
    }

    /// The one transaction of an import: every entry, or none.
    async fn import_group(&self, entries: Vec<Entry>) -> Result<()> {
        let max = self.max();
        let entries = entries
            .into_iter()
            .map(|e| checked_entry(e, &self.opts.options.scrubber, max))
            .collect::<Result<Vec<_>>>()?;
        txn!(self, |tx| {
            for e in &entries {
                let taken = || StateError::Conflict {
                    record: e.record_key(),
                    expected: 0,
                    actual: 1,
                };
                match e {
                    Entry::Run(r) => {
                        let rows = tx.query(
                            "SELECT record FROM {s}agentstate_runs WHERE tenant = $1 AND run_id = $2",
                            &[&id_in(&r.key.tenant), &id_in(&r.key.run_id)],
                        ).await?;
                        if let Some(row) = rows.first() {
                            let s = decode_run(row.col(0)?, &r.key)?;
                            return Err(StateError::Conflict {
                                record: e.record_key(),
                                expected: 0,
                                actual: s.version,
                            }
                            .into());
                        }
                        let seq = seq_col(r.seq)?;
                        let used = tx
                            .query(
                                "SELECT 1 FROM {s}agentstate_runs WHERE tenant = $1 AND seq = $2",
                                &[&id_in(&r.key.tenant), &seq],
                            )
                            .await?;
                        if !used.is_empty() {
                            return Err(StateError::invalid(format!(
                                "run {}: seq {} is already used in tenant {}",
                                r.key.run_id, r.seq, r.key.tenant
                            ))
                            .into());
                        }
                        let next = seq_col(r.seq.saturating_add(1))?;
                        tx.execute(
                            "INSERT INTO {s}agentstate_counters AS c (tenant, next_seq) VALUES ($1, $2) \
                             ON CONFLICT (tenant) DO UPDATE SET next_seq = GREATEST(c.next_seq, EXCLUDED.next_seq)",
                            &[&id_in(&r.key.tenant), &next],
                        ).await?;
                        write_run(tx, r, None, max).await?;
                    }
                    Entry::Session(s) => {
                        if Self::exists(
                            tx,
                            "SELECT 1 FROM {s}agentstate_sessions WHERE tenant = $1 AND session_id = $2",
                            &[&s.key.tenant, &s.key.session_id],
                        ).await? {
                            return Err(taken().into());
                        }
                        tx.execute(
                            "INSERT INTO {s}agentstate_sessions (tenant, session_id, record, fields) \
                             VALUES ($1, $2, $3, $4::text::jsonb)",
                            &[
                                &id_in(&s.key.tenant),
                                &id_in(&s.key.session_id),
                                &value::encode_session(s),
                                &super::fields::session_text(s),
                            ],
                        ).await?;
                    }
                    Entry::Epoch { instance, epoch } => {
                        let e = epoch_in(*epoch)?;
                        if Self::exists(
                            tx,
                            "SELECT 1 FROM {s}pinned_epoch WHERE ns = $1 AND id = $2 AND epoch > 0",
                            &[&instance.ns, &instance.id],
                        )
                        .await?
                        {
                            return Err(taken().into());
                        }
                        tx.execute(
                            "INSERT INTO {s}pinned_epoch (ns, id, epoch) VALUES ($1, $2, $3) \
                             ON CONFLICT (ns, id) DO UPDATE SET epoch = EXCLUDED.epoch",
                            &[&id_in(&instance.ns), &id_in(&instance.id), &e],
                        )
                        .await?;
                    }
                    Entry::Tray { key, tray } => {
                        if Self::exists(
                            tx,
                            "SELECT 1 FROM {s}pinned_tray_index WHERE ns = $1 AND id = $2 AND tray_ns = $3 AND tray_id = $4",
                            &[&key.ns, &key.id, &key.tray_ns, &key.tray_id],
                        ).await? {
                            return Err(taken().into());
                        }
                        put_tray(tx, key, tray).await?;
                    }
                    Entry::Hold { run, hold } => {
                        if Self::exists(
                            tx,
                            "SELECT 1 FROM {s}agentstate_holds WHERE tenant = $1 AND run_id = $2 AND hold_id = $3",
                            &[&run.tenant, &run.run_id, &hold.id],
                        ).await? {
                            return Err(taken().into());
                        }
                        let Some(r) = read_run(tx, run, false).await? else {
                            return Err(StateError::invalid(format!(
                                "hold {}: its run {}/{} is not in the import before it",
                                hold.id, run.tenant, run.run_id
                            ))
                            .into());
                        };
                        insert_hold(tx, &r, hold).await?;
                    }
                    Entry::Budget { budget, spent } => {
                        if Self::exists(
                            tx,
                            "SELECT 1 FROM {s}agentstate_budgets WHERE tenant = $1 AND name = $2",
                            &[&budget.key.tenant, &budget.key.name],
                        )
                        .await?
                        {
                            return Err(taken().into());
                        }
                        insert_budget(tx, budget, spent).await?;
                    }
                    Entry::Alarm { instance, due_at } => {
                        if Self::exists(
                            tx,
                            "SELECT 1 FROM {s}agentstate_alarms WHERE ns = $1 AND id = $2",
                            &[&instance.ns, &instance.id],
                        )
                        .await?
                        {
                            return Err(taken().into());
                        }
                        tx.execute(
                            "INSERT INTO {s}agentstate_alarms (ns, id, due_at) VALUES ($1, $2, $3::text::numeric)",
                            &[&id_in(&instance.ns), &id_in(&instance.id), &num(*due_at)],
                        ).await?;
                    }
                }
            }
            Ok(())
        })
    }
}

/// `stats`' budget counts: budgets, live holds, and runs at their cap
/// (their own or their budget's), all read in `tx`.
async fn budget_stats(tx: &mut Tx<'_>, st: &mut StoreStats, now: Millis) -> TxResult<()> {
    let mut budgets: HashMap<BudgetKey, (Caps, Spend, Vec<HoldRecord>)> = HashMap::new();
    for r in tx
        .query(
            concat!(
                "SELECT tenant, name, ",
                budget_cols!(),
                " FROM {s}agentstate_budgets"
            ),
            &[],
        )
        .await?
    {
        let key = BudgetKey::new(id_out(r.col(0)?)?, id_out(r.col(1)?)?);
        let (rec, spent) = decode_budget(r.col(2)?, r.col(3)?, r.col(4)?, &key)?;
        st.tenants.entry(key.tenant.clone()).or_default().budgets += 1;
        budgets.insert(key, (rec.caps, spent, Vec::new()));
    }
    let mut runs: HashMap<RunKey, Vec<HoldRecord>> = HashMap::new();
    for r in tx
        .query(
            "SELECT tenant, run_id, hold_id, budget, record FROM {s}agentstate_holds",
            &[],
        )
        .await?
    {
        let run = RunKey::new(id_out(r.col(0)?)?, id_out(r.col(1)?)?);
        let h = decode_hold(r.col(4)?, &id_out(r.col(2)?)?)?;
        if !h.is_live(now) {
            continue;
        }
        st.tenants.entry(run.tenant.clone()).or_default().holds += 1;
        if let Some(name) = r.col::<_, Option<String>>(3)? {
            let key = BudgetKey::new(run.tenant.clone(), id_out(name)?);
            if let Some(b) = budgets.get_mut(&key) {
                b.2.push(h.clone());
            }
        }
        runs.entry(run).or_default().push(h);
    }
    // Only runs with caps or a budget are written at the capped format, so
    // the others are not read.
    for r in tx
        .query(
            "SELECT tenant, run_id, record FROM {s}agentstate_runs WHERE get_byte(record, 0) = $1",
            &[&i32::from(value::RUN_FORMAT_CAPS)],
        )
        .await?
    {
        let key = RunKey::new(id_out(r.col(0)?)?, id_out(r.col(1)?)?);
        let run = decode_run(r.col(2)?, &key)?;
        let run_held = held(runs.get(&key).into_iter().flatten(), now);
        let mut at = at_cap(&run.caps, Spend::of_run(&run), run_held);
        if let Some((caps, spent, holds)) = budget_of(&run).and_then(|b| budgets.get(&b)) {
            at |= at_cap(caps, *spent, held(holds, now));
        }
        if at {
            st.tenants.entry(key.tenant).or_default().runs_at_cap += 1;
        }
    }
    Ok(())
}

/// `verify`'s budget checks: every budget and hold decodes under its key,
/// every hold names its run's budget (the run's row is there: a foreign
/// key), and every run's budget exists. Returns the problems and how many
/// rows were read.
async fn verify_budgets(tx: &mut Tx<'_>) -> TxResult<(Vec<String>, u64)> {
    let mut problems = Vec::new();
    let mut entries = 0u64;
    for r in tx
        .query(
            concat!(
                "SELECT tenant, name, ",
                budget_cols!(),
                " FROM {s}agentstate_budgets"
            ),
            &[],
        )
        .await?
    {
        entries += 1;
        let key = BudgetKey::new(id_out(r.col(0)?)?, id_out(r.col(1)?)?);
        if let Err(e) = decode_budget(r.col(2)?, r.col(3)?, r.col(4)?, &key) {
            problems.push(format!("budget {}/{}: {e}", key.tenant, key.name));
        }
    }
    for r in tx
        .query(
            "SELECT h.tenant, h.run_id, h.hold_id, h.budget, h.record, r.record, \
         h.cost_micros::text, h.tokens::text, h.iterations::text \
         FROM {s}agentstate_holds h JOIN {s}agentstate_runs r \
         ON r.tenant = h.tenant AND r.run_id = h.run_id",
            &[],
        )
        .await?
    {
        entries += 1;
        let run = RunKey::new(id_out(r.col(0)?)?, id_out(r.col(1)?)?);
        let id = id_out(r.col(2)?)?;
        let check = || -> Result<()> {
            let h = decode_hold(r.col(4)?, &id)?;
            // Its amount columns (schema 8; NULL on a hold from before),
            // which the one-round-trip reserve sums, are its record's.
            let cols: [Option<&str>; 3] = [r.col(6)?, r.col(7)?, r.col(8)?];
            let want = [
                h.amounts.cost_micros,
                h.amounts.tokens,
                h.amounts.iterations,
            ]
            .map(|n| n.to_string());
            if cols.iter().any(Option::is_some)
                && cols.iter().zip(&want).any(|(c, w)| *c != Some(w.as_str()))
            {
                return Err(StateError::corrupt(format!(
                    "its amount columns {cols:?} differ from its record's {want:?}"
                )));
            }
            let owner = decode_run(r.col(5)?, &run)?;
            let budget = r.col::<_, Option<String>>(3)?.map(id_out).transpose()?;
            if budget != owner.budget {
                return Err(StateError::corrupt(format!(
                    "its budget column {budget:?} differs from its run's budget {:?}",
                    owner.budget
                )));
            }
            Ok(())
        };
        if let Err(e) = check() {
            problems.push(format!(
                "hold {id} of run {}/{}: {e}",
                run.tenant, run.run_id
            ));
        }
    }
    for r in tx.query(
        "SELECT tenant, run_id, record FROM {s}agentstate_runs r WHERE get_byte(record, 0) = $1",
        &[&i32::from(value::RUN_FORMAT_CAPS)],
    ).await? {
        let key = RunKey::new(id_out(r.col(0)?)?, id_out(r.col(1)?)?);
        let Ok(run) = decode_run(r.col(2)?, &key) else {
            continue; // reported with the runs
        };
        if let Some(b) = budget_of(&run)
            && tx
                .query(
                    "SELECT 1 FROM {s}agentstate_budgets WHERE tenant = $1 AND name = $2",
                    &[&id_in(&b.tenant), &id_in(&b.name)],
                )
                .await?
                .is_empty()
        {
            problems.push(format!(
                "run {}/{} draws from missing budget {}",
                key.tenant, key.run_id, b.name
            ));
        }
    }
    Ok((problems, entries))
}

impl PostgresStore {
    pub(super) async fn list_sessions(
        &self,
        tenant: &str,
        page: &PageRequest,
    ) -> Result<Page<SessionRecord>> {
        check_id("tenant", tenant)?;
        check_limit(page.limit)?;
        let secret = self.secret().await?;
        let (binding, after) = super::tenant_cursor(&secret, Listing::Sessions, tenant, page)?;
        let limit = (page.limit + 1) as i64;
        let t = id_in(tenant);
        let rows =
            txn!(self, |tx| {
                tx.reads_only();
                match &after {
            None =>
                tx.query(
                    "SELECT session_id, record FROM {s}agentstate_sessions WHERE tenant = $1 \
                 ORDER BY session_id LIMIT $2",
                    &[&t, &limit],
                )
                .await,
            Some(a) =>
                tx.query(
                    "SELECT session_id, record FROM {s}agentstate_sessions WHERE tenant = $1 \
                 AND session_id > $3 ORDER BY session_id LIMIT $2",
                    &[&t, &limit, &id_in(a)],
                )
                .await,
            }
            })?;
        let mut items = Vec::with_capacity(rows.len());
        for r in &rows {
            let key = SessionKey::new(tenant, id_out(r.col(0)?)?);
            items.push(decode_session(r.col(1)?, &key)?);
        }
        let more = items.len() > page.limit;
        items.truncate(page.limit);
        let cursor = match (more, items.last()) {
            (true, Some(s)) => Some(cursor_codec::encode(
                &secret,
                Listing::Sessions,
                &binding,
                &KeyBuf::table(Listing::Sessions as u8)
                    .str(&s.key.session_id)
                    .done(),
            )),
            _ => None,
        };
        Page::new(items, cursor)
    }

    pub(super) async fn do_is_empty(&self) -> Result<bool> {
        Ok(self
            .do_export_page(&PageRequest::new(1))
            .await?
            .items()
            .is_empty())
    }

    pub(super) async fn do_stats(&self) -> Result<StoreStats> {
        let now = self.now();
        let mut s = StoreStats::default();
        let replication = match self.pool.manager().replication.lock().as_ref() {
            Some(r) => r.describe(),
            None => "not read yet".to_string(),
        };
        s.backend = format!(
            "postgres {} (schema {}): every Ok a committed transaction, synchronous_commit on, \
             {replication}",
            self.display, self.opts.schema
        );
        txn!(self, |tx| {
            tx.reads_only();
            let mut st = StoreStats::default();
            for r in tx
                .query(
                    "SELECT tenant, state, count(*) FROM {s}agentstate_runs GROUP BY tenant, state",
                    &[],
                )
                .await?
            {
                let tenant = id_out(r.col(0)?)?;
                let state: RunState = r.col::<_, String>(1)?.parse()?;
                let n: i64 = r.col(2)?;
                st.tenants
                    .entry(tenant)
                    .or_default()
                    .runs_by_state
                    .insert(state, n as u64);
            }
            for r in tx
                .query(
                    "SELECT tenant, count(*) FROM {s}agentstate_sessions GROUP BY tenant",
                    &[],
                )
                .await?
            {
                let n: i64 = r.col(1)?;
                st.tenants.entry(id_out(r.col(0)?)?).or_default().sessions = n as u64;
            }
            let r = &tx
                .query(
                    "SELECT count(*), count(*) FILTER (WHERE marked) FROM {s}pinned_tray_index \
                     WHERE NOT (tray_ns = 'pinned' AND tray_id = 'alarm')",
                    &[],
                )
                .await?[0];
            st.trays = r.col::<_, i64>(0)? as u64;
            st.marked_trays = r.col::<_, i64>(1)? as u64;
            let r = &tx
                .query("SELECT count(*) FROM {s}agentstate_alarms", &[])
                .await?[0];
            st.alarms = r.col::<_, i64>(0)? as u64;
            budget_stats(tx, &mut st, now).await?;
            s.tenants = st.tenants;
            s.trays = st.trays;
            s.marked_trays = st.marked_trays;
            s.alarms = st.alarms;
            Ok(())
        })?;
        Ok(s)
    }

    pub(super) async fn do_verify(&self) -> Result<VerifyReport> {
        let mut rep = VerifyReport::default();
        // Runs: each record decodes, names its row's key, and agrees with
        // the columns the listings read.
        let mut after: Option<Vec<String>> = None;
        loop {
            let rows = txn!(self, |tx| {
                tx.reads_only();
                // With each run, its label rows (R11): (label, value, seq).
                let sql = match after {
                    None => {
                        "SELECT tenant, run_id, record, seq, state, session_id, agent_name, updated_at::text, fields::text, \
                             ARRAY(SELECT jsonb_build_array(l.label, l.value, l.seq)::text FROM {s}agentstate_run_labels l \
                                   WHERE l.tenant = r.tenant AND l.run_id = r.run_id ORDER BY l.label) \
                             FROM {s}agentstate_runs r ORDER BY tenant, run_id LIMIT 1000"
                    }
                    Some(_) => {
                        "SELECT tenant, run_id, record, seq, state, session_id, agent_name, updated_at::text, fields::text, \
                             ARRAY(SELECT jsonb_build_array(l.label, l.value, l.seq)::text FROM {s}agentstate_run_labels l \
                                   WHERE l.tenant = r.tenant AND l.run_id = r.run_id ORDER BY l.label) \
                                FROM {s}agentstate_runs r WHERE (tenant, run_id) > ($1, $2) ORDER BY tenant, run_id LIMIT 1000"
                    }
                };
                match &after {
                    None => tx.query(sql, &[]).await,
                    Some(k) => tx.query(sql, &[&id_in(&k[0]), &id_in(&k[1])]).await,
                }
            })?;
            for r in &rows {
                rep.entries += 1;
                let key = RunKey::new(id_out(r.col(0)?)?, id_out(r.col(1)?)?);
                after = Some(vec![key.tenant.clone(), key.run_id.clone()]);
                // The record's seq is 0 (this build) or its column's.
                let seq: i64 = r.col(3)?;
                let run = match decode_run_at(r.col(2)?, &key, seq) {
                    Ok(run) => run,
                    Err(e) => {
                        rep.problems
                            .push(format!("run {}/{}: {e}", key.tenant, key.run_id));
                        continue;
                    }
                };
                rep.runs += 1;
                let state: String = r.col(4)?;
                let session: Option<String> = r.col(5)?;
                let agent: String = r.col(6)?;
                let updated: String = r.col(7)?;
                let session = session.map(id_out).transpose()?;
                let mut bad = Vec::new();
                if run.state.as_str() != state {
                    bad.push("state");
                }
                if run.session_id != session {
                    bad.push("session_id");
                }
                if run.agent_name != id_out(agent)? {
                    bad.push("agent_name");
                }
                if run.updated_at.to_string() != updated {
                    bad.push("updated_at");
                }
                if !fields_agree(r.col(8)?, super::fields::run(&run)) {
                    bad.push("fields");
                }
                // The label index holds exactly the run's labels, at its seq.
                let rows: Vec<serde_json::Value> = r
                    .col::<_, Vec<String>>(9)?
                    .iter()
                    .map(|t| serde_json::from_str(t).unwrap_or_default())
                    .collect();
                let want: Vec<serde_json::Value> = run
                    .labels
                    .iter()
                    .map(|(k, v)| {
                        serde_json::json!([k, agentstate_core::labels::canonical(v), seq])
                    })
                    .collect();
                if rows != want {
                    bad.push("label rows");
                }
                if !bad.is_empty() {
                    rep.problems.push(format!(
                        "run {}/{}: columns {} differ from the record",
                        key.tenant,
                        key.run_id,
                        bad.join(", ")
                    ));
                }
            }
            if rows.len() < 1000 {
                break;
            }
        }
        let counts = txn!(self, |tx| {
            tx.reads_only();
            let mut problems = Vec::new();
            // Every tenant's counter is past its largest seq.
            for r in tx.query(
                "SELECT r.tenant, max(r.seq), c.next_seq FROM {s}agentstate_runs r \
                 LEFT JOIN {s}agentstate_counters c ON c.tenant = r.tenant GROUP BY r.tenant, c.next_seq",
                &[],
            ).await? {
                let max: i64 = r.col(1)?;
                let next: Option<i64> = r.col(2)?;
                if next.is_none_or(|n| n <= max) {
                    let t: String = r.col(0)?;
                    problems.push(format!(
                        "tenant {}: seq counter {next:?} is not past the largest seq {max}",
                        id_out(t.clone()).unwrap_or(t)
                    ));
                }
            }
            // Every unfinished run's session is there (S2 keeps a session
            // in use; one whose runs all finished may be deleted). Ids as
            // stored when they are not this store's escaped form (a
            // foreign row, reported below): verify names, never fails.
            let shown = |t: String| id_out(t.clone()).unwrap_or(t);
            for r in tx
                .query(
                    "SELECT r.tenant, r.run_id, r.session_id FROM {s}agentstate_runs r \
                 WHERE r.session_id IS NOT NULL \
                 AND r.state NOT IN ('completed', 'failed', 'cancelled') \
                 AND NOT EXISTS (SELECT 1 FROM {s}agentstate_sessions s \
                 WHERE s.tenant = r.tenant AND s.session_id = r.session_id)",
                    &[],
                )
                .await?
            {
                problems.push(format!(
                    "run {}/{}: its session {} is missing",
                    shown(r.col(0)?),
                    shown(r.col(1)?),
                    shown(r.col(2)?)
                ));
            }
            // (An instance with trays and no epoch row is at epoch 0, as
            // pinned's own store leaves it: not a loss verify can tell.)
            // Tray rows whose text is not in this store's escaped form
            // (written by pinned or plain SQL): they read as their text,
            // which a point read of that id does not reach.
            for r in tx
                .query(
                    "SELECT ns, id, tray_ns, tray_id, env, hostname FROM {s}pinned_tray_index \
                     WHERE strpos(ns || id || tray_ns || tray_id || env || hostname, chr(1)) > 0",
                    &[],
                )
                .await?
            {
                let mut cols: Vec<String> = Vec::with_capacity(6);
                for i in 0..6 {
                    cols.push(r.col(i)?);
                }
                if let Some(e) = cols.iter().find_map(|c| id_out(c.clone()).err()) {
                    problems.push(format!(
                        "tray {:?}: {e}; listings show this row under its text, and a point \
                         read of those ids reaches another row",
                        &cols[..4]
                    ));
                }
            }
            // Each alarm has its row in the tray table, and each such row an
            // alarm (A4).
            for r in tx
                .query(
                    "SELECT coalesce(a.ns, t.ns), coalesce(a.id, t.id) \
                     FROM {s}agentstate_alarms a FULL JOIN (SELECT * FROM {s}pinned_tray_index \
                     WHERE tray_ns = 'pinned' AND tray_id = 'alarm') t ON t.ns = a.ns AND t.id = a.id \
                     WHERE a.ns IS NULL OR t.ns IS NULL OR NOT t.marked \
                     OR t.doc IS DISTINCT FROM jsonb_build_object('due_at', a.due_at) \
                     OR t.doc_raw IS NOT NULL",
                    &[],
                )
                .await?
            {
                problems.push(format!(
                    "alarm {}/{}: its pinned_tray_index row (\"pinned\", \"alarm\") does not match it",
                    id_out(r.col(0)?)?,
                    id_out(r.col(1)?)?
                ));
            }
            let mut n = [0u64; 3];
            for (i, sql) in [
                "SELECT record, tenant, session_id, fields::text FROM {s}agentstate_sessions",
                "SELECT count(*) FROM {s}pinned_tray_index \
                 WHERE NOT (tray_ns = 'pinned' AND tray_id = 'alarm')",
                "SELECT count(*) FROM {s}agentstate_alarms",
            ]
            .iter()
            .enumerate()
            {
                let rows = tx.query(sql, &[]).await?;
                if i == 0 {
                    for r in &rows {
                        let key = SessionKey::new(id_out(r.col(1)?)?, id_out(r.col(2)?)?);
                        match decode_session(r.col(0)?, &key) {
                            Ok(s) if !fields_agree(r.col(3)?, super::fields::session(&s)) => {
                                problems.push(format!(
                                    "session {}/{}: its fields disagree with its record",
                                    key.tenant, key.session_id
                                ))
                            }
                            Ok(_) => n[0] += 1,
                            Err(e) => problems
                                .push(format!("session {}/{}: {e}", key.tenant, key.session_id)),
                        }
                    }
                } else {
                    n[i] = rows[0].col::<_, i64>(0)? as u64;
                }
            }
            Ok((problems, n))
        })?;
        rep.problems.extend(counts.0);
        rep.sessions = counts.1[0];
        rep.trays = counts.1[1];
        rep.alarms = counts.1[2];
        rep.entries += rep.sessions + rep.trays + rep.alarms;
        let (problems, entries) = txn!(self, |tx| {
            tx.reads_only();
            verify_budgets(tx).await
        })?;
        rep.problems.extend(problems);
        rep.entries += entries;
        Ok(rep)
    }

    pub(super) async fn do_prune(&self, tenant: &str, finished_before: Millis) -> Result<u64> {
        check_id("tenant", tenant)?;
        let finished: Vec<&str> = RunState::ALL
            .into_iter()
            .filter(|s| s.is_finished())
            .map(|s| s.as_str())
            .collect();
        let before = num(finished_before);
        let t = id_in(tenant);
        let mut deleted = 0u64;
        // In bounded transactions, so a prune never holds many locks long.
        loop {
            let n = txn!(self, |tx| {
                tx.execute(
                    "DELETE FROM {s}agentstate_runs WHERE (tenant, run_id) IN ( \
                     SELECT tenant, run_id FROM {s}agentstate_runs WHERE tenant = $1 \
                     AND state = ANY($2) AND updated_at < $3::text::numeric LIMIT 1000 \
                     FOR UPDATE SKIP LOCKED)",
                    &[&t, &finished, &before],
                )
                .await
            })?;
            deleted += n;
            if n < 1000 {
                return Ok(deleted);
            }
        }
    }

    /// P1 in bounded batches, each its own transaction: holds, runs (the
    /// holds of any run written meanwhile go with it by the foreign key),
    /// sessions, budgets, the seq counter, the idempotency scope, then the
    /// tenant's feed (its tombstones dropped, its horizon moved past them).
    /// A purge cut short is finished by running it again.
    pub(super) async fn do_purge_tenant(&self, tenant: &str) -> Result<u64> {
        check_id("tenant", tenant)?;
        self.runs_seen.forget_tenant(tenant);
        self.spend_seen.forget_tenant(tenant);
        let t = id_in(tenant);
        const BATCH: u64 = 1000;
        let mut counted = 0u64;
        for (sql, counts) in [
            (
                "DELETE FROM {s}agentstate_holds WHERE (tenant, run_id, hold_id) IN ( \
                 SELECT tenant, run_id, hold_id FROM {s}agentstate_holds WHERE tenant = $1 \
                 LIMIT 1000)",
                true,
            ),
            (
                "DELETE FROM {s}agentstate_runs WHERE (tenant, run_id) IN ( \
                 SELECT tenant, run_id FROM {s}agentstate_runs WHERE tenant = $1 LIMIT 1000)",
                true,
            ),
            (
                "DELETE FROM {s}agentstate_sessions WHERE (tenant, session_id) IN ( \
                 SELECT tenant, session_id FROM {s}agentstate_sessions WHERE tenant = $1 \
                 LIMIT 1000)",
                true,
            ),
            (
                "DELETE FROM {s}agentstate_budgets WHERE (tenant, name) IN ( \
                 SELECT tenant, name FROM {s}agentstate_budgets WHERE tenant = $1 LIMIT 1000)",
                true,
            ),
            (
                "DELETE FROM {s}agentstate_counters WHERE tenant = $1",
                false,
            ),
            (
                "DELETE FROM {s}agentstate_idempotency WHERE (kind, scope, key) IN ( \
                 SELECT kind, scope, key FROM {s}agentstate_idempotency \
                 WHERE kind = 1 AND scope = $1 LIMIT 1000)",
                false,
            ),
            (
                "DELETE FROM {s}agentstate_idempotency_scopes WHERE kind = 1 AND scope = $1",
                false,
            ),
        ] {
            loop {
                let n = txn!(self, |tx| tx.execute(sql, &[&t]).await)?;
                if counts {
                    counted += n;
                }
                if n < BATCH {
                    break;
                }
            }
        }
        // The feed last: the deletes above left tombstones.
        self.purge_feed(tenant).await?;
        Ok(counted)
    }

    pub(super) async fn do_export_page(&self, page: &PageRequest) -> Result<Page<Entry>> {
        check_limit(page.limit)?;
        let secret = self.secret().await?;
        let binding = b"export";
        let start = match &page.cursor {
            None => None,
            Some(c) => {
                let pos = cursor_codec::decode(&secret, Listing::Export, binding, c)?;
                let t = Table::of(*pos.first().ok_or_else(|| StateError::invalid("cursor"))?)?;
                let mut r = KeyReader::new(&pos, t as u8)?;
                let mut key = Vec::new();
                while !r.at_end() {
                    key.push(r.str()?);
                }
                Some((t, key))
            }
        };
        let want = page.limit + 1;
        let items = txn!(self, |tx| {
            tx.reads_only();
            // One snapshot would need REPEATABLE READ; the walk's guarantee
            // is the other listings' (each record that stays is seen once).
            let mut items: Vec<(Table, Vec<String>, Entry)> = Vec::new();
            for t in TABLES {
                if let Some((st, _)) = &start
                    && t < *st
                {
                    continue;
                }
                let after = match &start {
                    Some((st, k)) if *st == t => Some(k.as_slice()),
                    _ => None,
                };
                let rows = rows_after(tx, t, after, (want - items.len()) as i64).await?;
                for r in &rows {
                    let (k, e) = entry_of(t, r)?;
                    items.push((t, k, e));
                }
                if items.len() >= want {
                    break;
                }
            }
            Ok(items)
        })?;
        let more = items.len() > page.limit;
        let mut items = items;
        items.truncate(page.limit);
        let cursor = match (more, items.last()) {
            (true, Some((t, k, _))) => {
                let mut b = KeyBuf::table(*t as u8);
                for s in k {
                    b = b.str(s);
                }
                Some(cursor_codec::encode(
                    &secret,
                    Listing::Export,
                    binding,
                    &b.done(),
                ))
            }
            _ => None,
        };
        Page::new(items.into_iter().map(|(_, _, e)| e).collect(), cursor)
    }
}

/// The operator functions, synchronous: each waits on its async
/// implementation with the store's bridge (see [`PostgresStore`]).
impl StoreAdmin for PostgresStore {
    /// Its calls are awaited natively by `AsyncStore`, over its async core.
    fn async_core(
        self: std::sync::Arc<Self>,
    ) -> Option<std::sync::Arc<dyn agentstate_core::native::DynCore>> {
        Some(self)
    }

    fn list_sessions(&self, tenant: &str, page: &PageRequest) -> Result<Page<SessionRecord>> {
        use agentstate_core::native::AsyncCore;
        self.bridge
            .block_on(AsyncCore::list_sessions(self, tenant, page))
    }

    fn is_empty(&self) -> Result<bool> {
        self.bridge.block_on(self.do_is_empty())
    }

    fn stats(&self) -> Result<StoreStats> {
        self.bridge.block_on(self.do_stats())
    }

    fn verify(&self) -> Result<VerifyReport> {
        self.bridge.block_on(self.do_verify())
    }

    fn prune(&self, tenant: &str, finished_before: Millis) -> Result<u64> {
        self.bridge.block_on(self.do_prune(tenant, finished_before))
    }

    fn purge_tenant(&self, tenant: &str) -> Result<u64> {
        self.bridge.block_on(agentstate_core::observe::call(
            "postgres",
            "purge_tenant",
            Some(tenant),
            self.do_purge_tenant(tenant),
        ))
    }

    fn export_page(&self, page: &PageRequest) -> Result<Page<Entry>> {
        self.bridge.block_on(self.do_export_page(page))
    }

    fn import(&self, entries: &mut dyn Iterator<Item = Result<Entry>>) -> Result<u64> {
        if !self.is_empty()? {
            return Err(StateError::invalid(
                "import: the store is not empty; import into a new store",
            ));
        }
        // All or nothing: the whole input is read (an error from the
        // iterator writes nothing), then written in one transaction.
        let all = entries.collect::<Result<Vec<Entry>>>()?;
        let n = all.len() as u64;
        if n > 0 {
            self.bridge.block_on(self.import_group(all))?;
        }
        Ok(n)
    }
}

/// Whether a row's `fields` (as text) is the JSON its record projects to
/// (schema v6; `None` is a row `setup()` has still to fill).
fn fields_agree(stored: Option<String>, want: serde_json::Value) -> bool {
    stored.is_some_and(|t| serde_json::from_str::<serde_json::Value>(&t).is_ok_and(|v| v == want))
}
