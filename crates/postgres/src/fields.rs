//! The `fields` column of runs and sessions (schema v6): the record as
//! JSON, from which PostgreSQL generates a column per field for SQL
//! readers. The store never reads it back except in `verify`, which checks
//! it against the record (the record, with its checksum, is what the store
//! reads).
//!
//! The JSON is built here, field by field, rather than from the types'
//! public serde shapes, so the columns' meaning does not move when those
//! do. Amounts are JSON integers (exact in `jsonb`, which keeps numbers as
//! `numeric`). Text is written as ids are stored (`id_in`: `jsonb` text
//! cannot hold NUL, so U+0001 escapes NUL and itself); labels cannot hold
//! NUL (R11) and are written as they are.

use serde_json::{Value, json};

use super::conn::txn;
use super::runs::{decode_run, decode_session};
use super::{Col, PostgresStore, id_out, own as text};
use agentstate_core::error::Result;
use agentstate_core::record::{RunKey, RunRecord, SessionKey, SessionRecord};

/// A run's `fields`.
pub(crate) fn run(r: &RunRecord) -> Value {
    json!({
        "version": r.version,
        "messages_read": r.messages_read,
        "input_tokens": r.usage.input_tokens,
        "output_tokens": r.usage.output_tokens,
        "cost_micros": r.cost_micros,
        "iterations": r.iterations,
        "pending_tool_calls": r.pending_tool_calls.iter().map(|c| json!({
            "id": text(&c.id),
            "name": text(&c.name),
            "arguments": text(&c.arguments),
        })).collect::<Vec<_>>(),
        "approval": r.approval.as_ref().map(|a| json!({"id": text(&a.id), "prompt": text(&a.prompt)})),
        "created_at": r.created_at,
        "cost_micros_max": r.caps.cost_micros_max,
        "tokens_max": r.caps.tokens_max,
        "iterations_max": r.caps.iterations_max,
        "budget": r.budget.as_deref().map(text),
        "labels": r.labels,
    })
}

/// A session's `fields`.
pub(crate) fn session(s: &SessionRecord) -> Value {
    json!({
        "version": s.version,
        "metadata": s.metadata.iter().map(|(k, v)| (text(k), Value::String(text(v)))).collect::<serde_json::Map<_, _>>(),
        "created_at": s.created_at,
        "updated_at": s.updated_at,
        "labels": s.labels,
    })
}

/// A run's `fields` as the text a statement sends (cast to `jsonb`).
pub(crate) fn run_text(r: &RunRecord) -> String {
    run(r).to_string()
}

/// A session's `fields` as the text a statement sends.
pub(crate) fn session_text(s: &SessionRecord) -> String {
    session(s).to_string()
}

/// Rows per transaction when `setup()` fills the `fields` of rows written
/// before schema v6.
const FILL_BATCH: i64 = 500;

/// A table whose rows carry `fields`.
#[derive(Clone, Copy)]
enum Table {
    Runs,
    Sessions,
}

impl Table {
    fn name(self) -> &'static str {
        match self {
            Table::Runs => "agentstate_runs",
            Table::Sessions => "agentstate_sessions",
        }
    }
    fn id(self) -> &'static str {
        match self {
            Table::Runs => "run_id",
            Table::Sessions => "session_id",
        }
    }
    /// The `fields` of a row, or `None` when its record does not read
    /// (left for `verify` to report).
    fn fields_of(self, tenant: &str, id: &str, record: &[u8]) -> Option<String> {
        let (tenant, id) = (id_out(tenant.into()).ok()?, id_out(id.into()).ok()?);
        match self {
            Table::Runs => decode_run(record, &RunKey::new(tenant, id))
                .ok()
                .map(|r| run_text(&r)),
            Table::Sessions => decode_session(record, &SessionKey::new(tenant, id))
                .ok()
                .map(|s| session_text(&s)),
        }
    }
}

impl PostgresStore {
    /// Fills `fields` where it is NULL (rows written before schema v6, or
    /// by an older build since), in key order, a batch per transaction:
    /// a fill that stops part way is resumed by the next `setup()`. A row
    /// whose record does not read is left NULL (`verify` reports it).
    /// Returns how many rows were filled.
    pub(super) async fn fill_fields(&self) -> Result<u64> {
        // 'true': nothing to fill. Otherwise 'scanning' while this walks;
        // a write without fields meanwhile sets 'false' (the schema's
        // trigger), and then the flag stays so for the next setup.
        let flag = "SELECT value FROM {s}agentstate_meta WHERE name = 'fields_filled'";
        let filled_already = txn!(self, |tx| {
            let rows = tx.query(flag, &[]).await?;
            let done = match rows.first() {
                Some(r) => r.col::<_, &str>(0)? == "true",
                None => false,
            };
            if !done {
                tx.execute(
                    "UPDATE {s}agentstate_meta SET value = 'scanning' WHERE name = 'fields_filled'",
                    &[],
                )
                .await?;
            }
            Ok(done)
        })?;
        if filled_already {
            return Ok(0);
        }
        let mut filled = 0u64;
        for table in [Table::Runs, Table::Sessions] {
            let (name, id) = (table.name(), table.id());
            let select = format!(
                "SELECT tenant, {id}, record FROM {{s}}{name} \
                 WHERE fields IS NULL AND (tenant, {id}) > ($1, $2) \
                 ORDER BY tenant, {id} LIMIT {FILL_BATCH} FOR UPDATE"
            );
            let update = format!(
                "UPDATE {{s}}{name} AS t SET fields = u.f::jsonb \
                 FROM unnest($1::text[], $2::text[], $3::text[]) AS u(tenant, id, f) \
                 WHERE t.tenant = u.tenant AND t.{id} = u.id AND t.fields IS NULL"
            );
            let mut after = (String::new(), String::new());
            loop {
                let (read, n, last) = txn!(self, |tx| {
                    let rows = tx.query(&select, &[&after.0, &after.1]).await?;
                    let mut cols: (Vec<String>, Vec<String>, Vec<String>) = Default::default();
                    let mut last = None;
                    for r in &rows {
                        let (tenant, key): (String, String) = (r.col(0)?, r.col(1)?);
                        if let Some(f) = table.fields_of(&tenant, &key, r.col(2)?) {
                            cols.0.push(tenant.clone());
                            cols.1.push(key.clone());
                            cols.2.push(f);
                        }
                        last = Some((tenant, key));
                    }
                    let n = cols.0.len() as u64;
                    if n > 0 {
                        tx.execute(&update, &[&cols.0, &cols.1, &cols.2]).await?;
                    }
                    Ok((rows.len() as i64, n, last))
                })?;
                filled += n;
                if n > 0 {
                    tracing::info!(
                        table = name,
                        filled,
                        "setup: filling the fields of older rows"
                    );
                }
                match last {
                    Some(last) if read == FILL_BATCH => after = last,
                    _ => break,
                }
            }
        }
        txn!(self, |tx| {
            tx.execute(
                "UPDATE {s}agentstate_meta SET value = 'true' \
                 WHERE name = 'fields_filled' AND value = 'scanning'",
                &[],
            )
            .await?;
            Ok(())
        })?;
        Ok(filled)
    }
}
