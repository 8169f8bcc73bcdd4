//! Trays, epochs and alarms (rules T, A) on the seed's tables
//! `pinned_epoch` and `pinned_tray_index`. Every call's fence check locks
//! the instance's epoch row in the call's transaction, so the check and
//! the write are one atomic step across processes (T6).
//!
//! **One round trip.** The fence needs no decision in Rust, so the writing
//! calls (`read_tray`, `write_tray`, `delete_tray`, `apply_batch`,
//! `release`, `set_alarm`, `ack_alarm`) decide it in SQL and send
//! everything at once: `BEGIN`; a guarded upsert of the epoch row
//! ([`fence_sql`]: it stores the caller's epoch only when that is not
//! below the stored one, and locks the row either way); the call's writes,
//! each guarded by the row holding the caller's epoch ([`HELD`]); a last
//! statement that reads the stored epoch (and what the call answers);
//! `COMMIT`. A fence lost changed nothing, and the call answers
//! `FenceLost` with the epoch that last statement read. The keyed
//! `apply_batch`, `list_trays` lock the row and decide in Rust
//! ([`fence`]).
//!
//! **Shared with pinned** (schema 9). The tables are pinned's own: epochs
//! are bigint (a caller's epoch past `i64::MAX` is `Invalid` before any
//! statement; a negative epoch pinned stored is below every epoch this
//! store accepts, and reads as 0), docs jsonb. A doc goes in through the
//! server function `agentstate_doc_in` (JSON bytes as their jsonb, other
//! bytes as `{"agentstate:hex": …}`, and in `doc_raw` the bytes when the
//! jsonb's text differs) and comes out through `agentstate_doc_out`
//! ([`DOC`]), so a doc reads back byte for byte; [`doc_is_json`] only
//! spares the server a parse it would refuse. Rows pinned or plain SQL
//! wrote read as they are: ids not in this store's escaped form as their
//! text ([`id_read`]); a row that still does not decode is `Corrupt`
//! naming its key on a point read, and left out of a listing (reported).
//! Listings order by byte (`COLLATE "C"`) over schema 9's expression
//! indexes, whatever the database's collation.

use std::collections::BTreeMap;

use tokio_postgres::Row;

use agentstate_core::codec::cursor::{self as cursor_codec, Listing};
use agentstate_core::codec::key::{KeyBuf, KeyReader};
use agentstate_core::error::{Result, StateError};
use agentstate_core::idempotency::{IdempotencyKey, Keyed};
use agentstate_core::page::{Page, PageRequest};
use agentstate_core::record::Millis;
use agentstate_core::rules::{
    check_batch, check_id, check_instance, check_limit, check_tray, check_tray_key,
};
use agentstate_core::tray::{Alarm, InstanceKey, MarkedTray, Tray, TrayFilter, TrayKey, TrayOp};

use super::conn::{Tx, TxResult, params, txn};
use super::idempotency::txn_keyed;
use super::{Col, PostgresStore, epoch_in, epoch_out, id_in, id_read, num, num_out, own};
use agentstate_core::observe;

/// The stored epoch, locked for this transaction. An instance without a
/// row gets one holding the caller's epoch, so that a racing holder waits
/// on it too; a row at epoch 0 (or below: pinned's) reads like no row
/// (T2). Returns the stored epoch as stored, and whether this call wrote
/// the row.
async fn locked_epoch(tx: &mut Tx<'_>, i: &InstanceKey, caller: i64) -> TxResult<(i64, bool)> {
    let (ns, id) = (id_in(&i.ns), id_in(&i.id));
    let sel = "SELECT epoch FROM {s}pinned_epoch WHERE ns = $1 AND id = $2 FOR UPDATE";
    if let Some(r) = tx.query(sel, &[&ns, &id]).await?.first() {
        return Ok((stored_epoch(r, i)?, false));
    }
    let inserted = tx
        .execute(
            "INSERT INTO {s}pinned_epoch (ns, id, epoch) VALUES ($1, $2, $3) \
         ON CONFLICT (ns, id) DO NOTHING",
            &[&ns, &id, &caller],
        )
        .await?;
    if inserted == 1 {
        // Stored nothing before; the caller's epoch is stored now.
        return Ok((0, true));
    }
    // Another transaction created the row first (we waited for it).
    let rows = tx.query(sel, &[&ns, &id]).await?;
    let r = rows
        .first()
        .ok_or_else(|| StateError::corrupt("pinned_epoch row vanished under its lock"))?;
    Ok((stored_epoch(r, i)?, false))
}

/// Column 0 of a row of `pinned_epoch` (or NULL: no row), naming the
/// instance when it does not read.
fn stored_epoch_opt(r: &Row, i: &InstanceKey) -> Result<Option<i64>> {
    r.col(0)
        .map_err(|e| StateError::corrupt(format!("pinned_epoch of instance {i}: {e}")))
}

fn stored_epoch(r: &Row, i: &InstanceKey) -> Result<i64> {
    stored_epoch_opt(r, i)?
        .ok_or_else(|| StateError::corrupt(format!("pinned_epoch of instance {i}: NULL")))
}

/// T2: below the stored epoch is `FenceLost`; above it advances it.
async fn fence(tx: &mut Tx<'_>, i: &InstanceKey, epoch: u64) -> TxResult<()> {
    let caller = epoch_in(epoch)?;
    let (stored, written) = locked_epoch(tx, i, caller).await?;
    if caller < stored {
        return Err(StateError::FenceLost {
            instance: i.clone(),
            caller: epoch,
            stored: epoch_out(stored),
        }
        .into());
    }
    if caller > stored && !written {
        tx.defer(
            "UPDATE {s}pinned_epoch SET epoch = $3 WHERE ns = $1 AND id = $2",
            params![own(&i.ns), own(&i.id), caller],
        )
        .await?;
    }
    Ok(())
}

/// T2 decided in SQL, deferred (see the module's notes): the row is
/// created at the caller's epoch, advanced to it when below (a negative
/// epoch pinned stored included), and locked either way (`ON CONFLICT DO
/// UPDATE` locks the row it does not update).
async fn fence_sql(tx: &mut Tx<'_>, i: &InstanceKey, epoch: u64) -> TxResult<()> {
    let caller = epoch_in(epoch)?;
    tx.defer(
        "INSERT INTO {s}pinned_epoch AS e (ns, id, epoch) VALUES ($1, $2, $3) \
         ON CONFLICT (ns, id) DO UPDATE SET epoch = EXCLUDED.epoch WHERE e.epoch < EXCLUDED.epoch",
        params![own(&i.ns), own(&i.id), caller],
    )
    .await
}

/// The guard of a write after [`fence_sql`]: the epoch row holds the
/// caller's epoch (`$1`, `$2` the instance, `$E` the caller's epoch).
const HELD: &str = "EXISTS (SELECT 1 FROM {s}pinned_epoch \
     WHERE ns = $1 AND id = $2 AND epoch = $E::bigint)";

/// A statement with [`HELD`] in place of `{held}`, `$E` as `$n`.
fn held(sql: &str, n: usize) -> String {
    sql.replace("{held}", &HELD.replace("$E", &format!("${n}")))
}

/// The stored epoch as [`fence_sql`] left it, against the caller's: equal
/// is the fence held, above is `FenceLost` naming the instance (and
/// nothing was written).
fn verdict(
    stored: Option<i64>,
    caller: u64,
    instance: impl FnOnce() -> InstanceKey,
) -> TxResult<()> {
    let Some(stored) = stored else {
        return Err(StateError::corrupt("pinned_epoch row vanished under its lock").into());
    };
    if u64::try_from(stored).ok() != Some(caller) {
        return Err(StateError::FenceLost {
            instance: instance(),
            caller,
            stored: epoch_out(stored),
        }
        .into());
    }
    Ok(())
}

/// The last statement of a fenced write, sent with `COMMIT`: the stored
/// epoch, judged by [`verdict`].
async fn fence_commit(tx: &mut Tx<'_>, i: &InstanceKey, epoch: u64) -> TxResult<()> {
    let rows = tx
        .query_commit(
            "SELECT epoch FROM {s}pinned_epoch WHERE ns = $1 AND id = $2",
            &[&id_in(&i.ns), &id_in(&i.id)],
            false,
        )
        .await?;
    let stored = match rows.first() {
        Some(r) => stored_epoch_opt(r, i)?,
        None => None,
    };
    verdict(stored, epoch, || i.clone())
}

/// A tray's columns as read (`t` the row of `pinned_tray_index`): the doc
/// through the read rule of schema 9 (the bytes written, or the jsonb's
/// text). [`tray_of`] reads them.
pub(super) const TRAY_COLS: &str =
    "t.marked, {s}agentstate_doc_out(t.doc, t.doc_raw) AS doc, t.env, t.hostname";

/// The tray of a row read with [`TRAY_COLS`]; `Corrupt` naming the column
/// when one does not read (the caller names the tray).
pub(super) fn tray_of(row: &Row) -> Result<Tray> {
    Ok(Tray {
        marked: row.col("marked")?,
        doc: row.col("doc")?,
        env: id_read(row.col("env")?),
        hostname: id_read(row.col("hostname")?),
    })
}

/// A failure to read the row of tray `key`, naming it.
pub(super) fn in_tray(key: &TrayKey) -> impl FnOnce(StateError) -> StateError + '_ {
    move |e| match e {
        StateError::Corrupt { what } => StateError::corrupt(format!(
            "pinned_tray_index row of tray {key} (ns, id, tray_ns, tray_id as read): {what}"
        )),
        e => e,
    }
}

/// Whether a doc's bytes are worth offering to jsonb (UTF-8 that parses
/// as one JSON document). The server decides (`agentstate_doc_in`: what
/// jsonb refuses, a `\u0000` escape say, is stored as hex): this only
/// spares it the attempt for bytes that are plainly not JSON.
pub(crate) fn doc_is_json(doc: &[u8]) -> bool {
    std::str::from_utf8(doc).is_ok() && serde_json::from_slice::<serde::de::IgnoredAny>(doc).is_ok()
}

/// Writes one tray (import; the fenced calls write their own).
pub(crate) async fn put_tray(tx: &mut Tx<'_>, k: &TrayKey, t: &Tray) -> TxResult<()> {
    tx.defer(
        "INSERT INTO {s}pinned_tray_index \
         (ns, id, tray_ns, tray_id, marked, doc, env, hostname, doc_raw) \
         SELECT $1, $2, $3, $4, $5::boolean, d.doc, $7::text, $8::text, d.doc_raw \
         FROM {s}agentstate_doc_in($6::bytea, $9::boolean) d \
         ON CONFLICT (ns, id, tray_ns, tray_id) DO UPDATE SET marked = EXCLUDED.marked, \
         doc = EXCLUDED.doc, env = EXCLUDED.env, hostname = EXCLUDED.hostname, \
         doc_raw = EXCLUDED.doc_raw",
        params![
            own(&k.ns),
            own(&k.id),
            own(&k.tray_ns),
            own(&k.tray_id),
            t.marked,
            t.doc.clone(),
            own(&t.env),
            own(&t.hostname),
            doc_is_json(&t.doc),
        ],
    )
    .await?;
    Ok(())
}

/// A tray row's key as stored: the text of its four columns, which a
/// listing's cursor keeps, so that a walk can pass a row whose key does not
/// decode ([`read_page`]).
type StoredKey = [String; 4];

fn stored_key(row: &Row) -> Result<StoredKey> {
    Ok([
        row.col("ns")?,
        row.col("id")?,
        row.col("tray_ns")?,
        row.col("tray_id")?,
    ])
}

/// The position of a tray listing's page end: the stored key of the last
/// row read.
fn tray_pos(listing: Listing, k: &StoredKey) -> Vec<u8> {
    let mut b = KeyBuf::table(listing as u8);
    for part in k {
        b = b.str(part);
    }
    b.done()
}

fn read_tray_pos(listing: Listing, pos: &[u8]) -> Result<StoredKey> {
    let mut r = KeyReader::new(pos, listing as u8)?;
    let k = [r.str()?, r.str()?, r.str()?, r.str()?];
    r.end()?;
    // Stored text never holds NUL (a cursor from before positions were
    // stored text could).
    if k.iter().any(|p| p.contains('\0')) {
        return Err(StateError::invalid(
            "cursor: a position from an older version; start the walk again",
        ));
    }
    Ok(k)
}

/// What one read of `limit + 1` rows of a listing gives: the page, or
/// (when every row read was left out and more remain) the stored key to
/// read on after, so that a page is empty only at the walk's end (L3).
enum Step<T> {
    Page(Vec<T>, Option<StoredKey>),
    ReadOn(StoredKey),
}

/// One read of a listing's page, `limit + 1` rows after a stored position.
/// A row that does not decode (a column of another type than schema 9's,
/// made by another tool after setup) is reported
/// ([`observe::skipped_row`]) and left out; it never fails the page. The
/// cursor keeps the stored key of the last row read, kept or not, so the
/// walk passes such rows.
fn step<T>(
    rows: &[Row],
    limit: usize,
    decode: impl Fn(&Row) -> Result<T>,
    what: &'static str,
) -> Result<Step<T>> {
    let more = rows.len() > limit;
    let read = &rows[..rows.len().min(limit)];
    let mut items = Vec::with_capacity(read.len());
    for r in read {
        match decode(r) {
            Ok(t) => items.push(t),
            Err(e @ StateError::Corrupt { .. }) => {
                observe::skipped_row("postgres", what, &stored_key(r)?.join("/"), &e)
            }
            Err(e) => return Err(e),
        }
    }
    let end = read.last().map(stored_key).transpose()?;
    Ok(match end {
        Some(end) if more && items.is_empty() => Step::ReadOn(end),
        end => Step::Page(items, end.filter(|_| more)),
    })
}

/// A row's tray key (ids pinned or plain SQL wrote as their text: see
/// [`id_read`]).
fn key_of(row: &Row) -> Result<TrayKey> {
    Ok(TrayKey {
        ns: id_read(row.col("ns")?),
        id: id_read(row.col("id")?),
        tray_ns: id_read(row.col("tray_ns")?),
        tray_id: id_read(row.col("tray_id")?),
    })
}

/// A listed row: its key and tray.
fn keyed_tray(r: &Row) -> Result<(TrayKey, Tray)> {
    let key = key_of(r)?;
    let tray = tray_of(r).map_err(in_tray(&key))?;
    Ok((key, tray))
}

/// Items of a page read with one extra row, and the cursor to the next
/// page when that row exists (L3).
fn finish<T>(
    mut items: Vec<T>,
    limit: usize,
    cursor: impl FnOnce(&T) -> agentstate_core::cursor::Cursor,
) -> Result<Page<T>> {
    let more = items.len() > limit;
    items.truncate(limit);
    let c = match (more, items.last()) {
        (true, Some(last)) => Some(cursor(last)),
        _ => None,
    };
    Page::new(items, c)
}

/// The statement listing an instance's trays in byte order (`$1`, `$2`
/// the instance, `$3` the limit; `after`: `$4`, `$5` the stored key to
/// read after; `tray_ns`, `marked`: the filters, as `$n`), over the index
/// `pinned_tray_index_bytes`. The alarm row (A4) is not a tray.
fn instance_sql(after: bool, tray_ns: Option<usize>, marked: Option<usize>, limit: bool) -> String {
    let mut sql = format!(
        "SELECT t.ns, t.id, t.tray_ns, t.tray_id, {TRAY_COLS} FROM {{s}}pinned_tray_index t \
         WHERE t.ns COLLATE \"C\" = $1 AND t.id COLLATE \"C\" = $2 \
         AND NOT (t.tray_ns = 'pinned' AND t.tray_id = 'alarm')"
    );
    if after {
        sql.push_str(" AND (t.tray_ns COLLATE \"C\", t.tray_id COLLATE \"C\") > ($4, $5)");
    }
    if let Some(n) = tray_ns {
        sql.push_str(&format!(" AND t.tray_ns COLLATE \"C\" = ${n}"));
    }
    if let Some(n) = marked {
        sql.push_str(&format!(" AND t.marked = ${n}"));
    }
    sql.push_str(" ORDER BY t.tray_ns COLLATE \"C\", t.tray_id COLLATE \"C\"");
    if limit {
        sql.push_str(" LIMIT $3");
    }
    sql
}

impl PostgresStore {
    pub(super) async fn read_tray(&self, key: &TrayKey, epoch: u64) -> Result<Option<Tray>> {
        check_tray_key(key)?;
        epoch_in(epoch)?;
        txn!(self, |tx| {
            fence_sql(tx, &key.instance(), epoch).await?;
            let rows = tx
                .query_commit(
                    &format!(
                        "SELECT e.epoch AS stored, {TRAY_COLS} \
                         FROM {{s}}pinned_epoch e LEFT JOIN {{s}}pinned_tray_index t \
                         ON t.ns = e.ns AND t.id = e.id AND t.tray_ns = $3 AND t.tray_id = $4 \
                         WHERE e.ns = $1 AND e.id = $2"
                    ),
                    &[
                        &id_in(&key.ns),
                        &id_in(&key.id),
                        &id_in(&key.tray_ns),
                        &id_in(&key.tray_id),
                    ],
                    false,
                )
                .await?;
            let row = rows.first();
            let stored = match row {
                Some(r) => stored_epoch_opt(r, &key.instance())?,
                None => None,
            };
            verdict(stored, epoch, || key.instance())?;
            let Some(r) = row else { return Ok(None) };
            let present = r
                .col::<_, Option<bool>>("marked")
                .map_err(in_tray(key))?
                .is_some();
            Ok(if present {
                Some(tray_of(r).map_err(in_tray(key))?)
            } else {
                None
            })
        })
    }

    pub(super) async fn write_tray(&self, key: &TrayKey, epoch: u64, tray: Tray) -> Result<()> {
        check_tray_key(key)?;
        check_tray(&tray, self.max())?;
        let e = epoch_in(epoch)?;
        let json = doc_is_json(&tray.doc);
        let i = key.instance();
        txn!(self, |tx| {
            fence_sql(tx, &i, epoch).await?;
            tx.defer(
                &held(
                    "INSERT INTO {s}pinned_tray_index \
                     (ns, id, tray_ns, tray_id, marked, doc, env, hostname, doc_raw) \
                     SELECT $1, $2, $3, $4, $5::boolean, d.doc, $7::text, $8::text, d.doc_raw \
                     FROM {s}agentstate_doc_in($6::bytea, $10::boolean) d WHERE {held} \
                     ON CONFLICT (ns, id, tray_ns, tray_id) DO UPDATE SET marked = EXCLUDED.marked, \
                     doc = EXCLUDED.doc, env = EXCLUDED.env, hostname = EXCLUDED.hostname, \
                     doc_raw = EXCLUDED.doc_raw",
                    9,
                ),
                params![
                    own(&key.ns),
                    own(&key.id),
                    own(&key.tray_ns),
                    own(&key.tray_id),
                    tray.marked,
                    tray.doc.clone(),
                    own(&tray.env),
                    own(&tray.hostname),
                    e,
                    json,
                ],
            )
            .await?;
            fence_commit(tx, &i, epoch).await
        })
    }

    pub(super) async fn delete_tray(&self, key: &TrayKey, epoch: u64) -> Result<bool> {
        check_tray_key(key)?;
        let e = epoch_in(epoch)?;
        txn!(self, |tx| {
            fence_sql(tx, &key.instance(), epoch).await?;
            let rows = tx
                .query_commit(
                    &held(
                        "WITH d AS (DELETE FROM {s}pinned_tray_index \
                         WHERE ns = $1 AND id = $2 AND tray_ns = $3 AND tray_id = $4 AND {held} \
                         RETURNING 1) \
                         SELECT (SELECT epoch FROM {s}pinned_epoch WHERE ns = $1 AND id = $2), \
                         (SELECT count(*) FROM d)",
                        5,
                    ),
                    &[
                        &id_in(&key.ns),
                        &id_in(&key.id),
                        &id_in(&key.tray_ns),
                        &id_in(&key.tray_id),
                        &e,
                    ],
                    false,
                )
                .await?;
            let row = rows
                .first()
                .ok_or_else(|| StateError::corrupt("delete_tray: no answer row"))?;
            verdict(stored_epoch_opt(row, &key.instance())?, epoch, || {
                key.instance()
            })?;
            Ok(row.col::<_, i64>(1)? == 1)
        })
    }

    pub(super) async fn apply_batch(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        ops: Vec<TrayOp>,
    ) -> Result<()> {
        self.apply_batch_with(instance, epoch, ops, None).await
    }
    pub(super) async fn apply_batch_idempotent(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        ops: Vec<TrayOp>,
        key: &IdempotencyKey,
    ) -> Result<()> {
        epoch_in(epoch)?;
        let keyed = Keyed::apply_batch(instance, epoch, &ops, key)?;
        self.apply_batch_with(instance, epoch, ops, Some(keyed))
            .await
    }

    pub(super) async fn release(&self, instance: &InstanceKey, epoch: u64) -> Result<()> {
        check_instance(instance)?;
        let e = epoch_in(epoch)?;
        // T4: an older placement's release is a no-op, not an error: the
        // guard leaves its trays marked, and nothing is read back (all
        // sent with the COMMIT).
        txn!(self, |tx| {
            fence_sql(tx, instance, epoch).await?;
            tx.defer(
                &held(
                    "UPDATE {s}pinned_tray_index SET marked = false \
                     WHERE ns = $1 AND id = $2 AND marked \
                     AND NOT (tray_ns = 'pinned' AND tray_id = 'alarm') AND {held}",
                    3,
                ),
                params![own(&instance.ns), own(&instance.id), e],
            )
            .await?;
            Ok(())
        })
    }

    pub(super) async fn list_trays(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        page: &PageRequest,
    ) -> Result<Page<(TrayKey, Tray)>> {
        check_instance(instance)?;
        check_limit(page.limit)?;
        epoch_in(epoch)?;
        let secret = self.secret().await?;
        let binding = KeyBuf::table(Listing::Trays as u8)
            .str(&instance.ns)
            .str(&instance.id)
            .done();
        // E6: a bad cursor fails before the fence can move the epoch.
        let after = match &page.cursor {
            None => None,
            Some(c) => {
                let pos = cursor_codec::decode(&secret, Listing::Trays, &binding, c)?;
                let k = read_tray_pos(Listing::Trays, &pos)?;
                if k[0] != id_in(&instance.ns) || k[1] != id_in(&instance.id) {
                    return Err(StateError::invalid("cursor: position outside this listing"));
                }
                Some(k)
            }
        };
        let (ns, id) = (id_in(&instance.ns), id_in(&instance.id));
        let limit = (page.limit + 1) as i64;
        let mut after = after;
        let (items, end) = loop {
            let rows = txn!(self, |tx| {
                fence(tx, instance, epoch).await?;
                match &after {
                    None => {
                        tx.query(&instance_sql(false, None, None, true), &[&ns, &id, &limit])
                            .await
                    }
                    Some(k) => {
                        tx.query(
                            &instance_sql(true, None, None, true),
                            &[&ns, &id, &limit, &k[2], &k[3]],
                        )
                        .await
                    }
                }
            })?;
            match step(&rows, page.limit, keyed_tray, "list_trays")? {
                Step::Page(items, end) => break (items, end),
                Step::ReadOn(k) => after = Some(k),
            }
        };
        let cursor = end.map(|k| {
            cursor_codec::encode(
                &secret,
                Listing::Trays,
                &binding,
                &tray_pos(Listing::Trays, &k),
            )
        });
        Page::new(items, cursor)
    }

    /// T7 in one round trip: the fence ([`fence_sql`], deferred) and one
    /// statement reading the stored epoch and every tray of the instance
    /// that passes the filter (applied in SQL, `tray_ns` as an index
    /// condition), in byte order, the alarm row left out; one snapshot.
    pub(super) async fn instance_trays(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        filter: &TrayFilter,
    ) -> Result<Vec<(TrayKey, Tray)>> {
        check_instance(instance)?;
        filter.check()?;
        epoch_in(epoch)?;
        let (ns, id) = (id_in(&instance.ns), id_in(&instance.id));
        let tray_ns = filter.tray_ns.as_deref().map(id_in);
        let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = vec![&ns, &id];
        let tns_at = tray_ns.as_ref().map(|t| {
            params.push(t);
            params.len()
        });
        let marked_at = filter.marked.as_ref().map(|m| {
            params.push(m);
            params.len()
        });
        let sql = format!(
            "SELECT e.stored, t.* FROM (SELECT (SELECT epoch FROM {{s}}pinned_epoch \
             WHERE ns = $1 AND id = $2) AS stored) e \
             LEFT JOIN LATERAL ({}) t ON true \
             ORDER BY t.tray_ns COLLATE \"C\", t.tray_id COLLATE \"C\"",
            instance_sql(false, tns_at, marked_at, false)
        );
        let rows = txn!(self, |tx| {
            fence_sql(tx, instance, epoch).await?;
            let rows = tx.query_commit(&sql, &params, false).await?;
            let stored = match rows.first() {
                Some(r) => stored_epoch_opt(r, instance)?,
                None => None,
            };
            verdict(stored, epoch, || instance.clone())?;
            Ok(rows)
        })?;
        let mut out = Vec::with_capacity(rows.len());
        for r in &rows {
            if r.col::<_, Option<&str>>("ns")?.is_none() {
                continue; // no tray: the epoch's row alone
            }
            match keyed_tray(r) {
                Ok(t) => out.push(t),
                Err(e @ StateError::Corrupt { .. }) => observe::skipped_row(
                    "postgres",
                    "instance_trays",
                    &stored_key(r)?.join("/"),
                    &e,
                ),
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    pub(super) async fn marked_trays(
        &self,
        env: Option<&str>,
        page: &PageRequest,
    ) -> Result<Page<MarkedTray>> {
        if let Some(e) = env {
            check_id("env", e)?;
        }
        check_limit(page.limit)?;
        let secret = self.secret().await?;
        let mut binding = KeyBuf::table(Listing::Marked as u8);
        binding = match env {
            Some(e) => binding.u8(1).str(e),
            None => binding.u8(0),
        };
        let binding = binding.done();
        let after = page
            .cursor
            .as_ref()
            .map(|c| {
                let pos = cursor_codec::decode(&secret, Listing::Marked, &binding, c)?;
                read_tray_pos(Listing::Marked, &pos)
            })
            .transpose()?;
        let env_col = env.map(id_in);
        // Schema 9's partial indexes on marked trays in byte order serve
        // each shape (T5: O(page)); the alarm rows (A4) are not trays.
        let cols = "SELECT ns, id, tray_ns, tray_id, env, hostname FROM {s}pinned_tray_index \
                    WHERE marked AND NOT (tray_ns = 'pinned' AND tray_id = 'alarm')";
        let key =
            "(ns COLLATE \"C\", id COLLATE \"C\", tray_ns COLLATE \"C\", tray_id COLLATE \"C\")";
        let order = "ORDER BY ns COLLATE \"C\", id COLLATE \"C\", tray_ns COLLATE \"C\", \
                     tray_id COLLATE \"C\" LIMIT $1";
        // One env's: the position is compared with env in front, which
        // only the index by env takes as its condition; the planner, whose
        // guess of an env's share ignores how envs cluster, then never
        // walks every env's marked trays to find one env's.
        let env_key = "(env, ns COLLATE \"C\", id COLLATE \"C\", tray_ns COLLATE \"C\", \
                       tray_id COLLATE \"C\")";
        let limit = (page.limit + 1) as i64;
        let mut after = after;
        let (items, end) = loop {
            let rows = txn!(self, |tx| {
                tx.reads_only();
                match (&env_col, &after) {
                    (None, None) => tx.query(&format!("{cols} {order}"), &[&limit]).await,
                    (Some(e), None) => {
                        tx.query(
                            &format!(
                                "{cols} AND env = $2 AND {env_key} >= ($2, '', '', '', '') {order}"
                            ),
                            &[&limit, e],
                        )
                        .await
                    }
                    (None, Some(a)) => {
                        tx.query(
                            &format!("{cols} AND {key} > ($2, $3, $4, $5) {order}"),
                            &[&limit, &a[0], &a[1], &a[2], &a[3]],
                        )
                        .await
                    }
                    (Some(e), Some(a)) => {
                        tx.query(
                            &format!(
                                "{cols} AND env = $6 AND {env_key} > ($6, $2, $3, $4, $5) {order}"
                            ),
                            &[&limit, &a[0], &a[1], &a[2], &a[3], e],
                        )
                        .await
                    }
                }
            })?;
            let decode = |r: &Row| {
                let key = key_of(r)?;
                let env = r.col("env").map_err(in_tray(&key))?;
                let hostname = r.col("hostname").map_err(in_tray(&key))?;
                Ok(MarkedTray::new(key, id_read(env), id_read(hostname)))
            };
            match step(&rows, page.limit, decode, "marked_trays")? {
                Step::Page(items, end) => break (items, end),
                Step::ReadOn(k) => after = Some(k),
            }
        };
        let cursor = end.map(|k| {
            cursor_codec::encode(
                &secret,
                Listing::Marked,
                &binding,
                &tray_pos(Listing::Marked, &k),
            )
        });
        Page::new(items, cursor)
    }

    pub(super) async fn epoch(&self, instance: &InstanceKey) -> Result<u64> {
        check_instance(instance)?;
        txn!(self, |tx| {
            let rows = tx
                .query_commit(
                    "SELECT epoch FROM {s}pinned_epoch WHERE ns = $1 AND id = $2",
                    &[&id_in(&instance.ns), &id_in(&instance.id)],
                    true,
                )
                .await?;
            Ok(match rows.first() {
                Some(r) => epoch_out(stored_epoch(r, instance)?),
                None => 0,
            })
        })
    }

    pub(super) async fn set_alarm(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        due_at: Millis,
    ) -> Result<()> {
        check_instance(instance)?;
        let e = epoch_in(epoch)?;
        txn!(self, |tx| {
            fence_sql(tx, instance, epoch).await?;
            tx.defer(
                &held(
                    "INSERT INTO {s}agentstate_alarms (ns, id, due_at) \
                     SELECT $1, $2, $3::text::numeric WHERE {held} \
                     ON CONFLICT (ns, id) DO UPDATE SET due_at = EXCLUDED.due_at",
                    4,
                ),
                params![own(&instance.ns), own(&instance.id), num(due_at), e],
            )
            .await?;
            fence_commit(tx, instance, epoch).await
        })
    }

    pub(super) async fn due_alarms(&self, now: Millis, page: &PageRequest) -> Result<Page<Alarm>> {
        check_limit(page.limit)?;
        let secret = self.secret().await?;
        let binding = KeyBuf::table(Listing::Alarms as u8).done();
        let after = page
            .cursor
            .as_ref()
            .map(|c| {
                let pos = cursor_codec::decode(&secret, Listing::Alarms, &binding, c)?;
                let mut r = KeyReader::new(&pos, Listing::Alarms as u8)?;
                let a = (r.u64()?, r.str()?, r.str()?);
                r.end()?;
                Ok::<_, StateError>(a)
            })
            .transpose()?;
        let limit = (page.limit + 1) as i64;
        let now_s = num(now);
        let rows = txn!(self, |tx| {
            tx.reads_only();
            match &after {
            None => tx.query(
                "SELECT ns, id, due_at::text AS due_text FROM {s}agentstate_alarms \
                 WHERE due_at <= $1::text::numeric ORDER BY due_at, ns, id LIMIT $2",
                &[&now_s, &limit],
            ).await,
            Some((due, ns, id)) => tx.query(
                "SELECT ns, id, due_at::text AS due_text FROM {s}agentstate_alarms \
                 WHERE due_at <= $1::text::numeric AND (due_at, ns, id) > ($3::text::numeric, $4, $5) \
                 ORDER BY due_at, ns, id LIMIT $2",
                &[&now_s, &limit, &num(*due), &id_in(ns), &id_in(id)],
            ).await,
        }
        })?;
        let items = rows
            .iter()
            .map(|r| {
                let instance = InstanceKey {
                    ns: id_read(r.col(0)?),
                    id: id_read(r.col(1)?),
                };
                let due: &str = r
                    .col(2)
                    .map_err(|e| StateError::corrupt(format!("alarm of {instance}: {e}")))?;
                Ok(Alarm::new(
                    instance,
                    num_out(due, "agentstate_alarms.due_at")?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        finish(items, page.limit, |a| {
            let pos = KeyBuf::table(Listing::Alarms as u8)
                .u64(a.due_at)
                .str(&a.instance.ns)
                .str(&a.instance.id)
                .done();
            cursor_codec::encode(&secret, Listing::Alarms, &binding, &pos)
        })
    }

    pub(super) async fn ack_alarm(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        due_at: Millis,
    ) -> Result<bool> {
        check_instance(instance)?;
        let e = epoch_in(epoch)?;
        txn!(self, |tx| {
            fence_sql(tx, instance, epoch).await?;
            // A3: an ack for a replaced alarm removes nothing.
            let rows = tx
                .query_commit(
                    &held(
                        "WITH d AS (DELETE FROM {s}agentstate_alarms \
                         WHERE ns = $1 AND id = $2 AND due_at = $3::text::numeric AND {held} \
                         RETURNING 1) \
                         SELECT (SELECT epoch FROM {s}pinned_epoch WHERE ns = $1 AND id = $2), \
                         (SELECT count(*) FROM d)",
                        4,
                    ),
                    &[&id_in(&instance.ns), &id_in(&instance.id), &num(due_at), &e],
                    false,
                )
                .await?;
            let row = rows
                .first()
                .ok_or_else(|| StateError::corrupt("ack_alarm: no answer row"))?;
            verdict(stored_epoch_opt(row, instance)?, epoch, || instance.clone())?;
            Ok(row.col::<_, i64>(1)? == 1)
        })
    }
}

impl PostgresStore {
    /// `apply_batch`, under `keyed`'s idempotency key when there is one.
    // Rule T3: the fence once, then every op in one transaction.
    async fn apply_batch_with(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        ops: Vec<TrayOp>,
        keyed: Option<Keyed<'_>>,
    ) -> Result<()> {
        check_batch(instance, &ops, self.max())?;
        let e = epoch_in(epoch)?;
        // Each op replaces its tray whole, so a batch comes to the last op
        // on each tray, applied in one transaction (T3).
        let mut last: BTreeMap<(&str, &str), Option<&Tray>> = BTreeMap::new();
        for op in &ops {
            match op {
                TrayOp::Put {
                    tray_ns,
                    tray_id,
                    tray,
                } => last.insert((tray_ns, tray_id), Some(tray)),
                TrayOp::Delete { tray_ns, tray_id } => last.insert((tray_ns, tray_id), None),
            };
        }
        let (ns, id) = (id_in(&instance.ns), id_in(&instance.id));
        let mut put = Puts::default();
        let mut del = (Vec::new(), Vec::new());
        for ((tns, tid), t) in &last {
            match t {
                Some(t) => {
                    put.tray_ns.push(id_in(tns).into_owned());
                    put.tray_id.push(id_in(tid).into_owned());
                    put.marked.push(t.marked);
                    put.doc.push(t.doc.clone());
                    put.json.push(doc_is_json(&t.doc));
                    put.env.push(id_in(&t.env).into_owned());
                    put.hostname.push(id_in(&t.hostname).into_owned());
                }
                None => {
                    del.0.push(id_in(tns).into_owned());
                    del.1.push(id_in(tid).into_owned());
                }
            }
        }
        // Unkeyed: one round trip (see the module's notes). Keyed: the
        // fence decided in Rust, inside the key's savepoint. The writes
        // are guarded either way (after `fence` the row holds the
        // caller's epoch).
        let one_trip = keyed.is_none();
        txn_keyed!(self, keyed, |tx| {
            if one_trip {
                fence_sql(tx, instance, epoch).await?;
            } else {
                fence(tx, instance, epoch).await?;
            }
            // Deferred: they go out with the COMMIT.
            if !del.0.is_empty() {
                tx.defer(
                    &held(
                        "DELETE FROM {s}pinned_tray_index t \
                         USING unnest($3::text[], $4::text[]) AS d(tray_ns, tray_id) \
                         WHERE t.ns = $1 AND t.id = $2 AND t.tray_ns = d.tray_ns \
                         AND t.tray_id = d.tray_id AND {held}",
                        5,
                    ),
                    params![
                        ns.to_string(),
                        id.to_string(),
                        del.0.clone(),
                        del.1.clone(),
                        e
                    ],
                )
                .await?;
            }
            if !put.tray_ns.is_empty() {
                tx.defer(
                    &held(
                        "INSERT INTO {s}pinned_tray_index \
                         (ns, id, tray_ns, tray_id, marked, doc, env, hostname, doc_raw) \
                         SELECT $1, $2, u.tray_ns, u.tray_id, u.marked, d.doc, u.env, u.hostname, \
                         d.doc_raw FROM unnest($3::text[], $4::text[], $5::bool[], \
                         $6::bytea[], $7::text[], $8::text[], $10::bool[]) \
                         AS u(tray_ns, tray_id, marked, raw, env, hostname, json) \
                         CROSS JOIN LATERAL {s}agentstate_doc_in(u.raw, u.json) d WHERE {held} \
                         ON CONFLICT (ns, id, tray_ns, tray_id) DO UPDATE SET marked = EXCLUDED.marked, \
                         doc = EXCLUDED.doc, env = EXCLUDED.env, hostname = EXCLUDED.hostname, \
                         doc_raw = EXCLUDED.doc_raw",
                        9,
                    ),
                    params![
                        ns.to_string(),
                        id.to_string(),
                        put.tray_ns.clone(),
                        put.tray_id.clone(),
                        put.marked.clone(),
                        put.doc.clone(),
                        put.env.clone(),
                        put.hostname.clone(),
                        e,
                        put.json.clone(),
                    ],
                )
                .await?;
            }
            if one_trip {
                fence_commit(tx, instance, epoch).await
            } else {
                Ok(())
            }
        })
    }
}

/// A batch's puts, column by column (the arrays of its one statement).
#[derive(Default)]
struct Puts {
    tray_ns: Vec<String>,
    tray_id: Vec<String>,
    marked: Vec<bool>,
    doc: Vec<Vec<u8>>,
    json: Vec<bool>,
    env: Vec<String>,
    hostname: Vec<String>,
}
