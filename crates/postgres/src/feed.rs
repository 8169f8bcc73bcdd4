//! The change feed (rules F1–F9) on the server: `agentstate_changes`
//! (`schema/v7.sql`), one row per record at the position `(xid, n)` of the
//! last transaction that wrote it, kept by triggers on the record tables.
//!
//! **No skipped commits.** A read returns only rows below its snapshot's
//! `xmin`: every transaction below it has ended, so no row can later
//! appear there, and a consumer's position never passes a transaction
//! still open. A long-open transaction anywhere on the server holds the
//! feed back (not the writes) until it ends.
//!
//! **Waking.** The triggers `pg_notify` at commit (for the store's own
//! transactions, the notification is recorded and sent right after the
//! COMMIT, outside the commit's lock: `schema/v10.sql`); one connection per
//! store (dialed on first `wait_changes`, on the store's runtime, with the
//! pool's configuration and TLS) `LISTEN`s and fans the notifications out
//! to the waiters ([`Hub`]). `changes` waits up to 2 s for commits
//! held back that way (so a writer reads its own writes on a busy server).
//! A notified commit may not be readable yet
//! (an older transaction still open): a waiter whose read finds committed
//! rows held back that way reads again after 1, 2, 4 … 20 ms. While the
//! listener is down (dialing, lost, redialing) waiters read every 50 ms,
//! and a waiter reads at least every second whatever it hears, so a lost
//! notification costs at most that.
//!
//! **Positions.** A row's `(xid, n)` packed in 96 bits ([`ordinal_of`]) is
//! its ordinal; a position handed out is [`bind`] of the store's secret
//! (`agentstate_meta`'s `cursor_secret`), the scope and the ordinal, and
//! one given to a call is read back with [`unbind`] before any SQL runs
//! (F9: another scope's, another store's or a forged one is `Invalid`).
//! Only the unbound `(xid, n)` reaches SQL.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{broadcast, watch};
use tokio_postgres::{AsyncMessage, Client, Connection, NoTls, Row};
use tokio_postgres_rustls::MakeRustlsConnect;

use agentstate_core::error::{Result, StateError};
use agentstate_core::feed::{
    Change, ChangePage, Changed, FeedScope, Position, ScopeView, bind, check_call, unbind,
};
use agentstate_core::observe;
use agentstate_core::record::{RunKey, SessionKey};
use agentstate_core::tray::{Alarm, InstanceKey, TrayKey};

use super::conn::txn;
use super::runs::{decode_run_at, decode_session};
use super::trays::{TRAY_COLS, in_tray, tray_of};
use super::{Col, PostgresStore, id_in, id_read, num_out};

const PG: &str = "postgres";

/// How often a waiter reads while no listener is in force.
const POLL: Duration = Duration::from_millis(50);
/// How often a waiter reads whatever it hears (a lost notification).
const SAFETY: Duration = Duration::from_secs(1);
/// How long `changes` waits for changes committed but held back by an
/// older transaction still open.
const HELD_WAIT: Duration = Duration::from_secs(2);
/// Tombstones dropped per transaction.
const BATCH: i64 = 1000;

/// The listener of one store and its waiters.
#[derive(Debug)]
pub(crate) struct Hub {
    /// Each notification's payload: `t <tenant>` (as stored), `trays`,
    /// or `*` (a commit that wrote more than one scope: every waiter reads).
    notes: broadcast::Sender<Arc<str>>,
    /// `Some(generation)` while a `LISTEN` is in force: every commit after
    /// the generation began is notified.
    state: watch::Sender<Option<u64>>,
    started: AtomicBool,
}

impl Default for Hub {
    fn default() -> Self {
        Hub {
            notes: broadcast::channel(1024).0,
            state: watch::channel(None).0,
            started: AtomicBool::new(false),
        }
    }
}

/// The channel the triggers notify (`schema/v7.sql`: cut to 63 bytes, as
/// the server cuts an identifier; schema names are ASCII).
pub(crate) fn channel(schema: &str) -> String {
    let mut c = format!("agentstate_feed {schema}");
    c.truncate(63);
    c
}

/// The payload a scope's commits are notified with.
fn note_of(scope: &FeedScope) -> String {
    match scope.view() {
        ScopeView::Tenant(tenant) => format!("t {}", id_in(tenant)),
        ScopeView::Trays(_) => "trays".to_string(),
    }
}

/// A scope's feed and horizon row: (feed, scope) as in `agentstate_changes`.
fn feed_of(scope: &FeedScope) -> (i16, String) {
    match scope.view() {
        ScopeView::Tenant(tenant) => (1, id_in(tenant).into_owned()),
        ScopeView::Trays(_) => (2, String::new()),
    }
}

/// Dials and serves the listener connection, redialing after a loss, for
/// as long as the store's runtime runs (it ends with the store).
async fn listen(
    hub: Arc<Hub>,
    config: tokio_postgres::Config,
    tls: Option<MakeRustlsConnect>,
    channel: String,
) {
    let mut generation = 0u64;
    let mut pause = POLL;
    loop {
        generation += 1;
        let served = match &tls {
            None => match config.connect(NoTls).await {
                Ok((client, conn)) => serve(&hub, client, conn, &channel, generation).await,
                Err(_) => false,
            },
            Some(tls) => match config.connect(tls.clone()).await {
                Ok((client, conn)) => serve(&hub, client, conn, &channel, generation).await,
                Err(_) => false,
            },
        };
        hub.state.send_replace(None);
        pause = if served {
            POLL
        } else {
            (pause * 2).min(Duration::from_secs(2))
        };
        tokio::time::sleep(pause).await;
    }
}

/// `LISTEN`s on a dialed connection and forwards its notifications until
/// it ends; true when the `LISTEN` was in force.
async fn serve<S, T>(
    hub: &Hub,
    client: Client,
    mut conn: Connection<S, T>,
    channel: &str,
    generation: u64,
) -> bool
where
    S: AsyncRead + AsyncWrite + Unpin,
    T: AsyncRead + AsyncWrite + Unpin,
{
    let sql = format!("LISTEN \"{channel}\"");
    let mut listen = std::pin::pin!(client.batch_execute(&sql));
    let mut listening = false;
    std::future::poll_fn(|cx| {
        loop {
            if !listening {
                match listen.as_mut().poll(cx) {
                    std::task::Poll::Ready(Ok(())) => {
                        listening = true;
                        hub.state.send_replace(Some(generation));
                    }
                    std::task::Poll::Ready(Err(_)) => return std::task::Poll::Ready(false),
                    std::task::Poll::Pending => {}
                }
            }
            // Drives the connection (the LISTEN's request too).
            match conn.poll_message(cx) {
                std::task::Poll::Ready(Some(Ok(AsyncMessage::Notification(n)))) => {
                    // No receiver: no waiter now, nothing to wake.
                    let _ = hub.notes.send(Arc::from(n.payload()));
                }
                std::task::Poll::Ready(Some(Ok(_))) => {}
                std::task::Poll::Ready(Some(Err(_)) | None) => {
                    return std::task::Poll::Ready(listening);
                }
                std::task::Poll::Pending => return std::task::Poll::Pending,
            }
        }
    })
    .await
}

/// One read of a feed: the page, and whether committed changes of the
/// scope after the position are held back (by a transaction below them
/// still open).
struct Read {
    page: ChangePage,
    held: bool,
}

/// The statement reading a scope's page: the snapshot's xmin, the
/// horizon, whether changes are held back, then the rows (each joined to
/// its record), in position order. `$1` the tenant or env as stored (''
/// for all trays), `$2`/`$3` the position read after, `$4` the limit.
fn page_sql(scope: &FeedScope) -> String {
    let (hfeed, hscope, filter, joins, cols) = match scope.view() {
        ScopeView::Tenant(_) => (
            1,
            "$1",
            "x.feed = 1 AND x.scope = $1",
            "LEFT JOIN {s}agentstate_runs r ON x.kind = 1 AND r.tenant = x.k1 AND r.run_id = x.k2 \
             LEFT JOIN {s}agentstate_sessions ss ON x.kind = 2 AND ss.tenant = x.k1 \
             AND ss.session_id = x.k2",
            "r.record AS run_record, r.seq AS run_seq, ss.record AS session_record",
        ),
        ScopeView::Trays(env) => (
            2,
            "''",
            if env.is_some() {
                "x.kind = 3 AND x.env = $1"
            } else {
                "x.feed = 2 AND x.scope = $1"
            },
            "LEFT JOIN {s}pinned_tray_index t ON x.kind = 3 AND t.ns = x.k1 AND t.id = x.k2 \
             AND t.tray_ns = x.k3 AND t.tray_id = x.k4 \
             LEFT JOIN {s}agentstate_alarms a ON x.kind = 4 AND a.ns = x.k1 AND a.id = x.k2",
            "{TRAY_COLS}, a.due_at::text AS due",
        ),
    };
    let cols = cols.replace("{TRAY_COLS}", TRAY_COLS);
    let w = filter.replace("x.", "w.");
    format!(
        "SELECT h.xid::text AS hx, h.n AS hn, \
         EXISTS (SELECT 1 FROM {{s}}agentstate_changes w WHERE {w} \
                 AND (w.xid, w.n) > ($2::text::xid8, $3) \
                 AND w.xid >= pg_snapshot_xmin(pg_current_snapshot())) AS held, c.* \
         FROM (SELECT 1) o \
         LEFT JOIN {{s}}agentstate_feed_horizons h ON h.feed = {hfeed} AND h.scope = {hscope} \
         LEFT JOIN LATERAL (SELECT x.kind, x.k1, x.k2, x.k3, x.k4, x.xid::text AS cx, x.n AS cn, \
                {cols} \
             FROM {{s}}agentstate_changes x {joins} \
             WHERE {filter} AND (x.xid, x.n) > ($2::text::xid8, $3) \
             AND x.xid < pg_snapshot_xmin(pg_current_snapshot()) \
             ORDER BY x.xid, x.n LIMIT $4) c ON true \
         ORDER BY c.cx::xid8, c.cn"
    )
}

/// The bits of an ordinal that hold `n`; the xid is above them.
///
/// A position keeps 96 bits for its ordinal (the top 32 are its scope's
/// tag, F9), and `(xid, n)` must pack into them keeping its order. `n` is
/// not a number within the transaction but the value of a store-wide
/// sequence (`agentstate_changes_n`), which a busy store takes past 2^32
/// within weeks, so the split is 48/48, not xid 64 + n 32: an `xid8` (an
/// epoch and a 32-bit xid) passes 2^48 after 2.8e14 transactions (about
/// 900 years at 10,000 a second), the sequence after as many feed writes.
/// A value past its 48 bits is `Corrupt`, never wrapped.
const N_BITS: u32 = 48;
const N_MAX: u64 = (1 << N_BITS) - 1;

/// The ordinal of `(xid, n)`: `xid << 48 | n`, ordered as the pair.
fn pack(xid: u64, n: u64, what: &str) -> Result<u128> {
    if xid > N_MAX || n > N_MAX {
        return Err(StateError::corrupt(format!(
            "{what}: position ({xid}, {n}) does not fit the 48 + 48 bits of a feed position"
        )));
    }
    Ok((u128::from(xid) << N_BITS) | u128::from(n))
}

/// An ordinal from its columns (`xid::text`, `n`).
fn ordinal_of(xid: &str, n: i64, what: &str) -> Result<u128> {
    let xid = num_out(xid, what)?;
    let n = u64::try_from(n).map_err(|_| StateError::corrupt(format!("{what}: n {n}")))?;
    pack(xid, n, what)
}

/// An ordinal as statement parameters: the xid as text, and `n` as a
/// bigint (48 bits each, see [`N_BITS`]; an ordinal past 96 bits, which
/// [`unbind`] never gives, reads as the largest xid).
fn ordinal_params(o: u128) -> (String, i64) {
    let xid = u64::try_from(o >> N_BITS).unwrap_or(u64::MAX);
    // At most 48 bits: fits a bigint.
    let n = (o & u128::from(N_MAX)) as i64;
    (xid.to_string(), n)
}

/// What one change row holds: its record's current state, or a tombstone.
fn change_of(r: &Row) -> Result<Changed> {
    let kind: i16 = r.col("kind")?;
    // Ids as the tray tables hold them: a row pinned wrote reads as its
    // text (see `id_read`).
    let k = |c: &str| r.col(c).map(id_read);
    Ok(match kind {
        1 => {
            let key = RunKey::new(k("k1")?, k("k2")?);
            match r.col::<_, Option<&[u8]>>("run_record")? {
                Some(b) => Changed::Run {
                    run: decode_run_at(b, &key, r.col("run_seq")?)?,
                },
                None => Changed::RunDeleted { key },
            }
        }
        2 => {
            let key = SessionKey::new(k("k1")?, k("k2")?);
            match r.col::<_, Option<&[u8]>>("session_record")? {
                Some(b) => Changed::Session {
                    session: decode_session(b, &key)?,
                },
                None => Changed::SessionDeleted { key },
            }
        }
        3 => {
            let key = TrayKey {
                ns: k("k1")?,
                id: k("k2")?,
                tray_ns: k("k3")?,
                tray_id: k("k4")?,
            };
            if r.col::<_, Option<bool>>("marked")
                .map_err(in_tray(&key))?
                .is_some()
            {
                let tray = tray_of(r).map_err(in_tray(&key))?;
                Changed::Tray { key, tray }
            } else {
                Changed::TrayDeleted { key }
            }
        }
        4 => {
            let instance = InstanceKey::new(k("k1")?, k("k2")?);
            match r.col::<_, Option<&str>>("due")? {
                Some(due) => Changed::Alarm {
                    alarm: Alarm::new(instance, num_out(due, "agentstate_alarms.due_at")?),
                },
                None => Changed::AlarmDeleted { instance },
            }
        }
        k => {
            return Err(StateError::corrupt(format!(
                "agentstate_changes: unknown kind {k}"
            )));
        }
    })
}

impl PostgresStore {
    /// One page of `scope` after `after`, whose ordinal is `after_n` (see
    /// [`Read`]); rows whose record does not decode are reported and
    /// passed, never failing the page.
    async fn read_changes(
        &self,
        scope: &FeedScope,
        after: Position,
        after_n: u128,
        limit: usize,
    ) -> Result<Read> {
        let secret = self.secret().await?;
        let sql = page_sql(scope);
        let key = match scope.view() {
            ScopeView::Tenant(tenant) => id_in(tenant).into_owned(),
            ScopeView::Trays(Some(env)) => id_in(env).into_owned(),
            ScopeView::Trays(None) => String::new(),
        };
        let lim = limit as i64;
        let mut at = after_n;
        let mut next = after;
        loop {
            let (xid, n) = ordinal_params(at);
            let rows = txn!(self, |tx| {
                tx.query_commit(&sql, &[&key, &xid, &n, &lim], true).await
            })?;
            let first = rows
                .first()
                .ok_or_else(|| StateError::corrupt("changes: no answer row"))?;
            if let Some(hx) = first.col::<_, Option<&str>>("hx")? {
                let horizon = ordinal_of(hx, first.col("hn")?, "agentstate_feed_horizons")?;
                if after_n < horizon {
                    return Err(StateError::FeedPruned {
                        scope: scope.clone(),
                        horizon: bind(&secret, scope, horizon)?,
                    });
                }
            }
            let held: bool = first.col("held")?;
            let mut changes = Vec::new();
            let mut read = 0usize;
            for r in &rows {
                let Some(cx) = r.col::<_, Option<&str>>("cx")? else {
                    continue;
                };
                read += 1;
                at = ordinal_of(cx, r.col("cn")?, "agentstate_changes")?;
                let pos = bind(&secret, scope, at)?;
                next = pos;
                match change_of(r) {
                    Ok(item) => changes.push(Change::new(pos, item)),
                    Err(e @ StateError::Corrupt { .. }) => {
                        observe::skipped_row(PG, "changes", &pos.to_string(), &e)
                    }
                    Err(e) => return Err(e),
                }
            }
            // A page is empty only at the feed's end (every row read was
            // left out and more remain: read on).
            if changes.is_empty() && read == limit {
                continue;
            }
            return Ok(Read {
                page: ChangePage::new(changes, next),
                held,
            });
        }
    }

    pub(super) async fn changes(
        &self,
        scope: &FeedScope,
        after: Position,
        limit: usize,
    ) -> Result<ChangePage> {
        check_call(scope, limit, None)?;
        let after_n = unbind(&self.secret().await?, scope, after)?;
        // Read your writes: changes committed but held back by a
        // transaction below them still open (on a busy server, usually a
        // few milliseconds) are waited for, up to `HELD_WAIT`.
        let until = tokio::time::Instant::now() + HELD_WAIT;
        let mut delay = Duration::from_millis(1);
        loop {
            let read = self.read_changes(scope, after, after_n, limit).await?;
            if !read.held
                || read.page.changes.len() == limit
                || tokio::time::Instant::now() + delay > until
            {
                return Ok(read.page);
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_millis(50));
        }
    }

    /// Starts the listener, once per store.
    fn start_listener(&self) {
        if self.feed.started.swap(true, Ordering::SeqCst) {
            return;
        }
        let m = self.pool.manager();
        self.bridge.handle().spawn(listen(
            self.feed.clone(),
            m.config.clone(),
            m.tls.clone(),
            channel(&self.opts.schema),
        ));
    }

    pub(super) async fn wait_changes(
        &self,
        scope: &FeedScope,
        after: Position,
        limit: usize,
        timeout: Duration,
    ) -> Result<ChangePage> {
        check_call(scope, limit, Some(timeout))?;
        // A foreign position is refused before any wait (F9).
        let after_n = unbind(&self.secret().await?, scope, after)?;
        let deadline = tokio::time::Instant::now() + timeout;
        self.start_listener();
        // Subscribed before the first read: a commit after it is heard.
        let mut notes = self.feed.notes.subscribe();
        let mut state = self.feed.state.subscribe();
        let want = note_of(scope);
        // Behind a pooler in transaction mode a LISTEN is not kept.
        let trust = self.opts.statement_cache;
        let mut delay = Duration::ZERO;
        let mut held_since: Option<tokio::time::Instant> = None;
        loop {
            let listening = state.borrow_and_update().is_some();
            let read = self.read_changes(scope, after, after_n, limit).await?;
            let now = tokio::time::Instant::now();
            if !read.page.changes.is_empty() || now >= deadline {
                return Ok(read.page);
            }
            let pause = if read.held {
                // Committed, not readable yet: read again soon.
                let since = *held_since.get_or_insert(now);
                let cap = if now - since < Duration::from_secs(1) {
                    Duration::from_millis(20)
                } else {
                    Duration::from_millis(200)
                };
                delay = (delay * 2).clamp(Duration::from_millis(1), cap);
                delay
            } else {
                held_since = None;
                delay = Duration::ZERO;
                if listening && trust { SAFETY } else { POLL }
            };
            let until = (now + pause).min(deadline);
            let sleep = tokio::time::sleep_until(until);
            tokio::pin!(sleep);
            loop {
                tokio::select! {
                    note = notes.recv() => match note {
                        // `*`: a commit of the store's that wrote more
                        // than one scope (`schema/v10.sql`).
                        Ok(p) if *p == *want || &*p == "*" => break,
                        Ok(_) => {}
                        Err(broadcast::error::RecvError::Lagged(_)) => break,
                        Err(broadcast::error::RecvError::Closed) => {
                            (&mut sleep).await;
                            break;
                        }
                    },
                    changed = state.changed() => {
                        if changed.is_err() {
                            (&mut sleep).await;
                        }
                        break;
                    }
                    _ = &mut sleep => break,
                }
            }
        }
    }

    pub(super) async fn feed_head(&self, scope: &FeedScope) -> Result<Position> {
        check_call(scope, 1, None)?;
        let (feed, key) = feed_of(scope);
        let row = txn!(self, |tx| {
            let rows = tx
                .query_commit(
                    "SELECT pg_snapshot_xmin(pg_current_snapshot())::text, h.xid::text, h.n \
                     FROM (SELECT 1) o LEFT JOIN {s}agentstate_feed_horizons h \
                     ON h.feed = $1 AND h.scope = $2",
                    &[&feed, &key],
                    true,
                )
                .await?;
            Ok(rows.into_iter().next())
        })?;
        let row = row.ok_or_else(|| StateError::corrupt("feed_head: no answer row"))?;
        let head = pack(num_out(row.col(0)?, "xmin")?, 0, "xmin")?;
        // Never before the horizon (a purge may have moved it past the
        // xmin of a snapshot with an older transaction open).
        let head = match row.col::<_, Option<&str>>(1)? {
            Some(hx) => head.max(ordinal_of(hx, row.col(2)?, "agentstate_feed_horizons")?),
            None => head,
        };
        bind(&self.secret().await?, scope, head)
    }

    pub(super) async fn prune_changes(&self, scope: &FeedScope, through: Position) -> Result<u64> {
        check_call(scope, 1, None)?;
        if let FeedScope::Trays { env: Some(_) } = scope {
            return Err(StateError::invalid(
                "prune_changes: tombstones are pruned store-wide; prune FeedScope::trays(), \
                 not one env's feed",
            ));
        }
        let through = unbind(&self.secret().await?, scope, through)?;
        let (feed, key) = feed_of(scope);
        // Never past the xmin: no change can land at or before the
        // horizon afterwards.
        let xmin: String = txn!(self, |tx| {
            let rows = tx
                .query_commit(
                    "SELECT pg_snapshot_xmin(pg_current_snapshot())::text",
                    &[],
                    true,
                )
                .await?;
            let row = rows
                .first()
                .ok_or_else(|| StateError::corrupt("prune_changes: no answer row"))?;
            Ok(row.col::<_, String>(0)?)
        })?;
        let through = through.min(pack(num_out(&xmin, "xmin")?, 0, "xmin")?);
        let (xid, n) = ordinal_params(through);
        let mut dropped = 0u64;
        // In bounded transactions; each moves the horizon with its
        // deletes (so no read sees a tombstone gone and the old horizon).
        loop {
            let gone = txn!(self, |tx| {
                tx.execute(
                    "INSERT INTO {s}agentstate_feed_horizons AS h (feed, scope, xid, n) \
                     VALUES ($1, $2, $3::text::xid8, $4) ON CONFLICT (feed, scope) \
                     DO UPDATE SET xid = EXCLUDED.xid, n = EXCLUDED.n \
                     WHERE (h.xid, h.n) < (EXCLUDED.xid, EXCLUDED.n)",
                    &[&feed, &key, &xid, &n],
                )
                .await?;
                tx.execute(
                    "DELETE FROM {s}agentstate_changes WHERE (kind, k1, k2, k3, k4) IN ( \
                     SELECT kind, k1, k2, k3, k4 FROM {s}agentstate_changes \
                     WHERE feed = $1 AND scope = $2 AND deleted \
                     AND (xid, n) <= ($3::text::xid8, $4) LIMIT $5 FOR UPDATE SKIP LOCKED)",
                    &[&feed, &key, &xid, &n, &BATCH],
                )
                .await
            })?;
            dropped += gone;
            if gone < BATCH as u64 {
                return Ok(dropped);
            }
        }
    }

    /// A purged tenant's feed: its tombstones dropped and its horizon moved
    /// past every change of it (and past the xmin), in bounded
    /// transactions. The last step of `purge_tenant`.
    pub(super) async fn purge_feed(&self, tenant: &str) -> Result<()> {
        let t = id_in(tenant);
        loop {
            let gone = txn!(self, |tx| {
                let rows = tx
                    .query(
                        "WITH d AS (DELETE FROM {s}agentstate_changes WHERE (kind, k1, k2, k3, k4) IN ( \
                         SELECT kind, k1, k2, k3, k4 FROM {s}agentstate_changes \
                         WHERE feed = 1 AND scope = $1 AND deleted LIMIT $2 FOR UPDATE SKIP LOCKED) \
                         RETURNING xid, n), \
                         m AS (SELECT xid, n FROM d UNION ALL \
                               SELECT pg_snapshot_xmin(pg_current_snapshot()), 0), \
                         top AS (SELECT xid, n FROM m ORDER BY xid DESC, n DESC LIMIT 1), \
                         h AS (INSERT INTO {s}agentstate_feed_horizons AS h (feed, scope, xid, n) \
                               SELECT 1, $1, xid, n FROM top ON CONFLICT (feed, scope) \
                               DO UPDATE SET xid = EXCLUDED.xid, n = EXCLUDED.n \
                               WHERE (h.xid, h.n) < (EXCLUDED.xid, EXCLUDED.n)) \
                         SELECT count(*) FROM d",
                        &[&t, &BATCH],
                    )
                    .await?;
                let row = rows
                    .first()
                    .ok_or_else(|| StateError::corrupt("purge_feed: no answer row"))?;
                Ok(row.col::<_, i64>(0)?)
            })?;
            if gone < BATCH {
                return Ok(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channels_fit_an_identifier() {
        assert_eq!(channel("public"), "agentstate_feed public");
        assert_eq!(channel(&"a".repeat(63)).len(), 63);
    }

    #[test]
    fn ordinals_pack_xid_and_n_in_order() {
        let o = ordinal_of("7", 3, "t").unwrap();
        assert_eq!(o, (7 << 48) | 3);
        assert_eq!(ordinal_params(o), ("7".to_string(), 3));
        assert!(ordinal_of("7", (N_MAX) as i64, "t").unwrap() < ordinal_of("8", 0, "t").unwrap());
        assert_eq!(
            ordinal_params(ordinal_of(&N_MAX.to_string(), N_MAX as i64, "t").unwrap()),
            (N_MAX.to_string(), N_MAX as i64)
        );
        // Past 48 bits: corrupt, never wrapped.
        assert!(ordinal_of("7", 1 << 48, "t").is_err());
        assert!(ordinal_of(&(1u64 << 48).to_string(), 0, "t").is_err());
        assert!(ordinal_of("7", -1, "t").is_err());
        // Past 96 bits (never unbound): the largest xid.
        assert_eq!(ordinal_params(u128::MAX).0, u64::MAX.to_string());
    }
}
