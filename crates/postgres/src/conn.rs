//! Connections, the pool, and the one way a call talks to the server: a
//! transaction, tried again a bounded number of times after a
//! serialization failure, a deadlock or a lost creation race, and every
//! other server failure turned into `Unavailable`, except a failure after
//! `COMMIT` was sent, which is `OutcomeUnknown` (rule I7).
//!
//! The client is `tokio-postgres`, pooled by `deadpool` ([`Manager`]).
//! Every connection is dialed on the store's own runtime (its
//! [`Bridge`](agentstate_core::native::Bridge)) and its I/O task is spawned there,
//! so a pooled connection never belongs to a caller's runtime.
//!
//! Where a call can fail, and what it answers:
//!
//! | failure point                                    | answer           |
//! |--------------------------------------------------|------------------|
//! | the dial refused: authentication, `pg_hba.conf`, | `Refused`, as    |
//! | unknown database, TLS required or failing, a     | soon as the      |
//! | certificate that does not verify                 | server answers   |
//! | no connection (unreachable, too many clients,    | `Unavailable`    |
//! | starting up, the pool's wait)                    | after the timeout|
//! | a prepared statement the server connection lacks | `Refused`: a     |
//! | (a transaction-mode pooler and the cache on)     | pooler's mode    |
//! | `BEGIN` or a statement fails (server error, lost | `Unavailable`    |
//! | connection, timeout): the server aborts an open  | (or tried again) |
//! | transaction when its connection drops            |                  |
//! | a statement the server cannot run as written     | `Refused` (not   |
//! | against the tables it found (SQLSTATE class 42:  | retryable: the   |
//! | a type mismatch, a missing privilege) or a value | same statement   |
//! | it refuses (class 22); not an undefined table,   | fails the same   |
//! | column or function, which `setup()` brings       | way)             |
//! | a write refused by a read-only server (25006: a  | tried again on a |
//! | standby, a demoted primary): nothing written,    | new dial, else   |
//! | the connection closed, not pooled                | `Unavailable`    |
//! | a rule refuses (`Conflict`, …): rolled back      | the refusal      |
//! | the connection is seen closed before `COMMIT`    | `Unavailable`    |
//! | a write sent with `COMMIT` fails with a server   | `Unavailable`    |
//! | error: the transaction aborted, `COMMIT` rolled  | (or tried again) |
//! | it back                                          |                  |
//! | `COMMIT` answers a server error (serialization,  | `Unavailable`    |
//! | deadlock: the server rolled back)                | (or tried again) |
//! | `COMMIT` was sent and the connection broke (I/O, | `OutcomeUnknown` |
//! | closed, reset), or the server went down while    |                  |
//! | answering it (class 08, 57P): it may have landed |                  |
//! | the same, for a call that only reads             | `Unavailable`    |
//! | ([`Tx::reads_only`], or a read's `query_commit`) |                  |
//! | a connection cut anywhere else (mid-row,         | `Unavailable`;   |
//! | mid-`CommandComplete`, mid-handshake): the       | never `Corrupt`, |
//! | driver's I/O or closed error, no SQLSTATE        | which is for     |
//! |                                                  | stored bytes     |
//! | the call's future is dropped before `COMMIT` was | nothing applied  |
//! | handed to the connection: its connection is      |                  |
//! | closed, not pooled, and the server aborts the    |                  |
//! | transaction                                      |                  |
//! | the call's future is dropped after `COMMIT` was  | may land, even   |
//! | handed to the connection (it goes out: as        | after the drop   |
//! | `OutcomeUnknown`, with no one to tell)           |                  |
//!
//! **Round trips.** Requests polled together are pipelined on one
//! connection: a transaction's `BEGIN` (and its settings) goes out with
//! its first statement, writes whose answer the call does not need
//! ([`Tx::defer`]) wait and go out with the next statement or with
//! `COMMIT`, and [`Tx::query_commit`] sends its statement and `COMMIT`
//! together. The connection's task is held back while a pipeline is
//! queued ([`Gate`]), so a pipeline leaves as one write. An error of a
//! deferred write is reported before the answer of whatever followed it
//! (which then failed on the aborted transaction), so the rules see every
//! statement in order, as before. With the statement cache warm, on the
//! happy path (the issue-40 count → now):
//!
//! | call                                                | round trips |
//! |-----------------------------------------------------|-------------|
//! | `get_run`, `get_session`, `epoch`                   | 2 → 1       |
//! | `put_run` (update), `patch_run`: a run this store   | 2 → 1       |
//! | has seen, without budget or caps (`runs.rs`)        |             |
//! | the same, when another writer came first            | 2 → 3       |
//! | `put_run` (create)                                  | 3           |
//! | `read_tray`, `write_tray`, `delete_tray`,           | 2 → 1       |
//! | `apply_batch`, `release`, `set_alarm`, `ack_alarm`  |             |
//! | `instance_trays` (T7)                               | 1           |
//! | `reserve`, `settle` (budget or not): the run, its   | 3–5 → 1     |
//! | budget and the hold as this store last saw them,    |             |
//! | checked and written by a function of schema 8       |             |
//! | (`budgets.rs`)                                      |             |
//! | the same, when another writer came first: the       | 2 → 3       |
//! | locked path, its reads pipelined                    |             |
//! | a keyed call (`*_idempotent`)                       | as before   |
//!
//! (`tests/it/postgres.rs` `round_trips_per_call` counts them through a
//! proxy.)

use std::collections::HashMap;
use std::future::Future;
use std::ops::ControlFlow;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use deadpool::managed::{Metrics, Object, PoolError, RecycleError, RecycleResult};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, NoTls, Row, Statement};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::PostgresStore;
use agentstate_core::error::{Result, StateError};
use agentstate_core::native::Bridge;

/// The driver's error.
pub(crate) type PgError = tokio_postgres::Error;

/// One pooled connection and the statements prepared on it.
pub(crate) struct Conn {
    client: Client,
    /// Holds the connection's task while a pipeline is queued.
    gate: Arc<Gate>,
    statements: HashMap<String, Statement>,
    /// When it was dialed (for the max lifetime).
    born: Instant,
    /// When a call last gave it back (for the idle timeout).
    used: Instant,
    /// `BEGIN` was sent and the transaction is not known to be over: a
    /// call's future dropped mid-transaction leaves it set, and such a
    /// connection is closed instead of pooled (see [`Pooled`]) and fails
    /// `recycle` should it ever get back.
    in_txn: bool,
    /// What the server said of its replication when this connection was
    /// dialed (after a failover, each connection says it of the server it
    /// reached).
    pub(crate) replication: Arc<Replication>,
    /// Closed when given back, not pooled: the server refused a write as
    /// read-only (a standby, or a primary demoted or made read-only since
    /// the dial), so the next dial finds the server that takes writes
    /// (with `target_session_attrs=read-write`); or it was dialed to a
    /// server without the synchronous standby `require_sync_standby`
    /// asks for, so the next dial reads the settings again.
    retire: bool,
    /// [`NOTIFY_SQL`] prepared at the dial; `None` with the statement
    /// cache off (behind a transaction-mode pooler, where nothing is
    /// pipelined past a COMMIT).
    notify: Option<Statement>,
}

/// Sent after every write's `COMMIT`, in the same round trip: the feed's
/// notification the transaction recorded instead of sending it itself
/// (`schema/v10.sql`: the one scope written, or `*`), on the store's
/// channel (`$1`), in a transaction of its own that writes no WAL and so
/// commits without a flush. Built-in functions only, so it runs on a
/// database at any schema version (before schema 10 nothing is recorded:
/// it answers no rows).
pub(crate) const NOTIFY_SQL: &str = "SELECT pg_notify($1, t), \
     set_config('agentstate.feed_touched', '', false) \
     FROM (SELECT current_setting('agentstate.feed_touched', true) AS t) s WHERE t <> ''";

/// A server's replication settings, read on every connection it dials:
/// whether an acknowledged commit was flushed on a synchronous standby.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Replication {
    /// `synchronous_standby_names`: empty when no commit waits for a
    /// standby.
    pub(crate) standby_names: String,
    /// The server's default `synchronous_commit` (the store's own
    /// transactions set it `on`).
    pub(crate) synchronous_commit: String,
}

impl Replication {
    /// True when a commit acknowledged with `synchronous_commit = on` (the
    /// store's setting) was flushed on a synchronous standby too.
    pub(crate) fn synchronous(&self) -> bool {
        !self.standby_names.trim().is_empty()
    }

    /// What an `Ok` survives on this server, in words.
    pub(crate) fn describe(&self) -> String {
        if self.synchronous() {
            format!(
                "replicated before it is acknowledged: each commit waits for a synchronous \
                 standby (synchronous_standby_names = '{}'), so it survives losing the primary",
                self.standby_names
            )
        } else {
            format!(
                "on this server only: synchronous_standby_names is empty (the server's \
                 synchronous_commit is {}; the store commits with on), so a failover to a \
                 standby may lose the last acknowledged writes",
                self.synchronous_commit
            )
        }
    }
}

/// Reads the replication settings on a connection just dialed: one
/// simple query (one round trip), per dial.
async fn read_replication(client: &Client) -> std::result::Result<Replication, PgError> {
    let mut cols = Vec::new();
    for m in client
        .simple_query(
            "SELECT current_setting('synchronous_standby_names'), \
             current_setting('synchronous_commit')",
        )
        .await?
    {
        if let tokio_postgres::SimpleQueryMessage::Row(r) = m {
            for i in 0..2 {
                cols.push(r.get(i).unwrap_or_default().to_string());
            }
        }
    }
    let mut cols = cols.into_iter();
    Ok(Replication {
        standby_names: cols.next().unwrap_or_default(),
        synchronous_commit: cols.next().unwrap_or_default(),
    })
}

/// Holds a connection's I/O task back while a call queues a pipeline, so
/// the task finds every request of it queued and writes them as one
/// (otherwise a task woken on another thread by the first request sends
/// it alone: `BEGIN` would go out, and be answered, before the rest).
#[derive(Default)]
pub(crate) struct Gate {
    corked: AtomicBool,
    waker: parking_lot::Mutex<Option<Waker>>,
}

impl Gate {
    /// Holds the task until the guard is dropped (never across an await).
    fn cork(&self) -> Corked<'_> {
        self.corked.store(true, Ordering::SeqCst);
        Corked(self)
    }

    /// True when the task may run; else it is woken when it may.
    fn open(&self, cx: &mut Context<'_>) -> bool {
        if !self.corked.load(Ordering::SeqCst) {
            return true;
        }
        *self.waker.lock() = Some(cx.waker().clone());
        !self.corked.load(Ordering::SeqCst)
    }
}

struct Corked<'g>(&'g Gate);

impl Drop for Corked<'_> {
    fn drop(&mut self) {
        self.0.corked.store(false, Ordering::SeqCst);
        if let Some(w) = self.0.waker.lock().take() {
            w.wake();
        }
    }
}

/// Spawns a connection's I/O task (on the current runtime) behind a
/// [`Gate`].
fn drive<C>(conn: C) -> Arc<Gate>
where
    C: Future + Send + 'static,
{
    let gate = Arc::new(Gate::default());
    let g = gate.clone();
    tokio::spawn(async move {
        let mut conn = std::pin::pin!(conn);
        std::future::poll_fn(|cx| {
            if g.open(cx) {
                conn.as_mut().poll(cx).map(|_| ())
            } else {
                Poll::Pending
            }
        })
        .await;
    });
    gate
}

/// Dials connections for the pool, on the store's runtime.
pub(crate) struct Manager {
    pub(crate) config: tokio_postgres::Config,
    /// `None`: no TLS (`sslmode=disable`).
    pub(crate) tls: Option<MakeRustlsConnect>,
    pub(crate) bridge: Arc<Bridge>,
    pub(crate) max_lifetime: Option<Duration>,
    pub(crate) idle_timeout: Option<Duration>,
    /// The latest dial's reading of the server's replication (for
    /// `stats` and the log).
    pub(crate) replication: Arc<parking_lot::Mutex<Option<Arc<Replication>>>>,
    /// Statements are kept per connection (not behind a transaction-mode
    /// pooler).
    pub(crate) statement_cache: bool,
}

impl Manager {
    /// Closed, or left inside a transaction by a dropped future.
    fn broken(conn: &Conn) -> bool {
        conn.in_txn || conn.retire || conn.client.is_closed()
    }

    /// True when `conn`, given back by a call, must be closed instead of
    /// pooled: broken, or past its max lifetime (such a connection still
    /// serves the call that took it).
    pub(crate) fn spent(&self, conn: &Conn) -> bool {
        Self::broken(conn) || self.max_lifetime.is_some_and(|l| conn.born.elapsed() >= l)
    }

    /// True when an idle `conn` must be closed (checked at checkout and
    /// about every 30 s): broken, or unused for the idle timeout.
    pub(crate) fn stale(&self, conn: &Conn) -> bool {
        Self::broken(conn) || self.idle_timeout.is_some_and(|l| conn.used.elapsed() >= l)
    }
}

impl deadpool::managed::Manager for Manager {
    type Type = Conn;
    /// Shared (the driver's error is not `Clone`).
    type Error = Arc<PgError>;

    async fn create(&self) -> std::result::Result<Conn, Arc<PgError>> {
        let config = self.config.clone();
        let tls = self.tls.clone();
        // Dialed on the store's runtime, and the connection's task spawned
        // there: it outlives the caller's runtime.
        let (client, gate) = self
            .bridge
            .on_runtime(async move {
                match tls {
                    None => {
                        let (client, conn) = config.connect(NoTls).await?;
                        Ok::<_, PgError>((client, drive(conn)))
                    }
                    Some(tls) => {
                        let (client, conn) = config.connect(tls).await?;
                        Ok((client, drive(conn)))
                    }
                }
            })
            .await
            .map_err(Arc::new)?;
        // Pipelined: one round trip.
        let (read, notify) = if self.statement_cache {
            let (read, notify) =
                ordered(read_replication(&client), client.prepare(NOTIFY_SQL)).await;
            (read, Some(notify.map_err(Arc::new)?))
        } else {
            (read_replication(&client).await, None)
        };
        let read = read.map_err(Arc::new)?;
        let replication = {
            let mut last = self.replication.lock();
            match last.as_ref() {
                Some(r) if **r == read => r.clone(),
                before => {
                    // The first reading, or a server that changed (a
                    // failover, a new setting): said once, not per dial.
                    tracing::info!(
                        target: "agentstate::postgres",
                        changed = before.is_some(),
                        "postgres: every Ok is {}",
                        read.describe()
                    );
                    let r = Arc::new(read);
                    *last = Some(r.clone());
                    r
                }
            }
        };
        let now = Instant::now();
        Ok(Conn {
            client,
            statements: HashMap::new(),
            gate,
            born: now,
            used: now,
            in_txn: false,
            replication,
            retire: false,
            notify,
        })
    }

    async fn recycle(&self, conn: &mut Conn, _: &Metrics) -> RecycleResult<Arc<PgError>> {
        // No round trip: a connection closed since is noticed here, one
        // the server dropped unnoticed fails its BEGIN and is replaced at
        // once (`Verdict::Redial`).
        if self.stale(conn) {
            return Err(RecycleError::message(
                "closed, idle too long, or left inside a transaction",
            ));
        }
        Ok(())
    }
}

/// A connection lent to one call. Given back to the pool when dropped,
/// unless it must not serve again (closed, past its max lifetime, or left
/// inside a transaction by a dropped future): then it is closed at once,
/// so the server aborts that transaction and frees its locks now.
pub(crate) struct Pooled {
    obj: Option<Object<Manager>>,
}

impl Drop for Pooled {
    fn drop(&mut self) {
        let Some(mut obj) = self.obj.take() else {
            return;
        };
        let spent = Object::pool(&obj).is_none_or(|p| p.manager().spent(&obj));
        if spent {
            // Out of the pool; dropping the client ends its connection.
            drop(Object::take(obj));
        } else {
            obj.used = Instant::now();
        }
    }
}

impl Pooled {
    /// Looks at a try's outcome before the connection goes back: one a
    /// read-only server refused a write on is not pooled again.
    pub(crate) fn after<T>(&mut self, out: &TxResult<T>) {
        if let Err(Fail::Pg(e)) = out
            && e.code() == Some(&SqlState::READ_ONLY_SQL_TRANSACTION)
            && let Some(conn) = self.obj.as_mut()
        {
            conn.retire = true;
        }
    }

    /// A transaction on this connection: `BEGIN` (with the store's
    /// settings) goes out with its first statement.
    #[allow(clippy::expect_used, reason = "lent until dropped")]
    pub(crate) fn tx<'a>(&'a mut self, store: &'a PostgresStore) -> Tx<'a> {
        let conn: &mut Conn = self.obj.as_mut().expect("lent until dropped");
        Tx {
            client: &conn.client,
            gate: &conn.gate,
            statements: &mut conn.statements,
            in_txn: &mut conn.in_txn,
            prefix: &store.prefix,
            cache: store.opts.statement_cache,
            pending: vec![Pending::Begin(&store.begin)],
            notify: conn.notify.as_ref(),
            channel: &store.channel,
            began: false,
            committed: false,
            reads_only: false,
        }
    }
}

/// True when a failed dial is the server's (or the TLS layer's) "no" to
/// the configuration, which no retry fixes: authentication (28000 covers a
/// `pg_hba.conf` refusal, 28P01 a wrong password), an unknown database
/// (3D000), no `CONNECT` privilege (42501), the client's own TLS or
/// authentication settings, a certificate that does not verify, a server
/// that does not offer TLS when it is required.
pub(crate) fn is_refusal(e: &PgError) -> bool {
    if let Some(db) = e.as_db_error() {
        let c = db.code().code();
        return c.starts_with("28")
            || c == SqlState::INVALID_CATALOG_NAME.code()
            || c == SqlState::INSUFFICIENT_PRIVILEGE.code()
            || c == SqlState::PROTOCOL_VIOLATION.code()
            || c == SqlState::FEATURE_NOT_SUPPORTED.code();
    }
    // The driver's error kinds are private; its `Display` names them.
    let text = e.to_string();
    if text.starts_with("authentication error") || text.starts_with("invalid configuration") {
        return true;
    }
    if text.starts_with("error performing TLS handshake") {
        // A connection reset mid-handshake is the network's; a rustls
        // error (a certificate, a protocol mismatch) or a server without
        // TLS is the configuration's.
        return !transient_io(e);
    }
    false
}

/// An I/O error under `e` that is the network's doing, not TLS's.
fn transient_io(e: &PgError) -> bool {
    use std::error::Error as _;
    use std::io::ErrorKind as K;
    let mut cur: Option<&(dyn std::error::Error + 'static)> = e.source();
    while let Some(s) = cur {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            if io
                .get_ref()
                .is_some_and(|inner| inner.downcast_ref::<rustls::Error>().is_some())
            {
                return false;
            }
            return matches!(
                io.kind(),
                K::ConnectionReset
                    | K::ConnectionAborted
                    | K::UnexpectedEof
                    | K::BrokenPipe
                    | K::TimedOut
                    | K::NotConnected
            );
        }
        if s.downcast_ref::<rustls::Error>().is_some() {
            return false;
        }
        cur = s.source();
    }
    false
}

/// The driver's error in words: the server's message and SQLSTATE when the
/// server answered, its chain of causes otherwise.
pub(crate) fn describe(e: &PgError) -> String {
    use std::error::Error as _;
    if let Some(db) = e.as_db_error() {
        return format!("{} ({})", db.message(), db.code().code());
    }
    let mut s = e.to_string();
    // The driver's `Display` names only the kind of failure.
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}

/// Why a transaction did not commit: a rule said no (returned as is), or
/// the server failed; or why it may have: the connection broke after
/// `COMMIT` was sent (`Unknown`).
pub(crate) enum Fail {
    Rule(StateError),
    Pg(PgError),
    Unknown(PgError),
    /// The connection was seen closed before anything was sent on it:
    /// another one is taken (a pooled connection the server dropped).
    Closed,
}

impl From<StateError> for Fail {
    fn from(e: StateError) -> Self {
        Fail::Rule(e)
    }
}

impl From<PgError> for Fail {
    fn from(e: PgError) -> Self {
        Fail::Pg(e)
    }
}

pub(crate) type TxResult<T> = std::result::Result<T, Fail>;

/// An owned statement parameter, for a deferred write.
pub(crate) type Param = Box<dyn ToSql + Send + Sync>;

/// Owned parameters for [`Tx::defer`]: `params![a, b]`.
macro_rules! params {
    ($($p:expr),* $(,)?) => {
        vec![$(Box::new($p) as $crate::conn::Param),*]
    };
}
pub(crate) use params;

/// A request not sent yet: it goes out with the next one.
enum Pending<'a> {
    /// The transaction's `BEGIN` and settings.
    Begin(&'a str),
    /// Statements without parameters (`SAVEPOINT`).
    Batch(&'static str),
    /// A write whose answer the call does not need.
    Exec(Statement, Vec<Param>),
}

type PgFut<'f> = Pin<Box<dyn Future<Output = std::result::Result<(), PgError>> + Send + 'f>>;

impl Pending<'_> {
    fn send<'f>(&'f self, client: &'f Client) -> PgFut<'f> {
        match self {
            Pending::Begin(sql) => Box::pin(client.batch_execute(sql)),
            Pending::Batch(sql) => Box::pin(client.batch_execute(sql)),
            Pending::Exec(s, params) => Box::pin(async move {
                client
                    .execute_raw(s, params.iter().map(|p| &**p as &(dyn ToSql + Sync)))
                    .await
                    .map(|_| ())
            }),
        }
    }
}

/// One open transaction on a pooled connection, with the store's table
/// prefix and the connection's prepared statements. `BEGIN` and `COMMIT`
/// are sent by hand (not `tokio_postgres::Transaction`) so `BEGIN` can go
/// out with the first statement and `COMMIT` with the last writes, and so
/// the commit can look at the connection before it is sent. Not committed,
/// it is rolled back by [`finish`](Self::finish); a dropped future leaves
/// the connection marked inside a transaction, and it is closed.
pub(crate) struct Tx<'a> {
    client: &'a Client,
    gate: &'a Gate,
    statements: &'a mut HashMap<String, Statement>,
    in_txn: &'a mut bool,
    prefix: &'a str,
    /// Statements kept for the connection's next transactions.
    cache: bool,
    /// Not sent yet, in order.
    pending: Vec<Pending<'a>>,
    /// [`NOTIFY_SQL`] prepared on this connection.
    notify: Option<&'a Statement>,
    /// The store's feed channel (`feed.rs`).
    channel: &'a str,
    /// `BEGIN` answered.
    began: bool,
    /// `COMMIT` went out with the last statement ([`Tx::query_commit`]).
    committed: bool,
    /// The call only reads ([`Tx::reads_only`]): a `COMMIT` whose answer
    /// was lost committed nothing worth knowing, so it is `Unavailable`,
    /// never `OutcomeUnknown`.
    reads_only: bool,
}

/// Pins a transaction body's type: `TxResult<T>`.
pub(crate) async fn typed<T>(f: impl Future<Output = TxResult<T>>) -> TxResult<T> {
    f.await
}

impl<'a> Tx<'a> {
    /// Sends what is pending and then `main`, all pipelined (polled
    /// together, so they go out in order without waiting on each other's
    /// answers); the first failure in that order is the answer.
    async fn pipelined<T>(
        &mut self,
        main: impl Future<Output = std::result::Result<T, PgError>>,
    ) -> TxResult<T> {
        self.send_all(main).await.map_err(|(e, _)| Fail::Pg(e))
    }

    /// [`pipelined`](Self::pipelined), telling whether the failure was a
    /// pending request's (`true`) or `main`'s.
    #[allow(clippy::expect_used, reason = "polled to the end")]
    async fn send_all<T>(
        &mut self,
        main: impl Future<Output = std::result::Result<T, PgError>>,
    ) -> std::result::Result<T, (PgError, bool)> {
        let pending = std::mem::take(&mut self.pending);
        let begins = matches!(pending.first(), Some(Pending::Begin(_)));
        if begins {
            *self.in_txn = true;
        }
        let client = self.client;
        let (outs, main_out) = {
            let mut futs: Vec<PgFut<'_>> = pending.iter().map(|p| p.send(client)).collect();
            let mut outs: Vec<Option<std::result::Result<(), PgError>>> =
                futs.iter().map(|_| None).collect();
            let mut main = std::pin::pin!(main);
            let mut main_out = None;
            // In order on every poll: each request is queued on its first
            // poll, so they go out in this order.
            let gate = self.gate;
            std::future::poll_fn(|cx| {
                // All queued before the connection's task may write any.
                let _corked = gate.cork();
                for (f, o) in futs.iter_mut().zip(outs.iter_mut()) {
                    if o.is_none()
                        && let Poll::Ready(r) = f.as_mut().poll(cx)
                    {
                        *o = Some(r);
                    }
                }
                if main_out.is_none()
                    && let Poll::Ready(r) = main.as_mut().poll(cx)
                {
                    main_out = Some(r);
                }
                if main_out.is_some() && outs.iter().all(Option::is_some) {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            })
            .await;
            (outs, main_out)
        };
        for (i, o) in outs.into_iter().enumerate() {
            match o.expect("polled to the end") {
                Ok(()) if i == 0 && begins => self.began = true,
                Ok(()) => {}
                Err(e) => return Err((e, true)),
            }
        }
        main_out.expect("polled to the end").map_err(|e| (e, false))
    }

    /// The feed's notifications after this transaction's `COMMIT`
    /// ([`NOTIFY_SQL`]); `None` for a read, and behind a transaction-mode
    /// pooler (no statement cache, no [`NOTIFY_SQL`] prepared), where the
    /// triggers notify inside the transaction.
    fn notify_after(&self, client: &'a Client) -> Option<PgFut<'a>> {
        if self.reads_only {
            return None;
        }
        let (s, channel) = (self.notify?, self.channel);
        Some(Box::pin(async move {
            client.execute(s, &[&channel]).await.map(|_| ())
        }))
    }

    /// Marks the transaction as one that writes nothing (a read call): a
    /// failure of its `COMMIT` is `Unavailable`, never `OutcomeUnknown`.
    pub(crate) fn reads_only(&mut self) {
        self.reads_only = true;
    }

    /// Sends `COMMIT`, with whatever is pending (see the module's table
    /// for what each failure means).
    pub(crate) async fn commit(&mut self) -> TxResult<()> {
        if self.committed {
            return Ok(());
        }
        if matches!(self.pending.as_slice(), [Pending::Begin(_)]) {
            // Nothing was sent: nothing to commit.
            self.pending.clear();
            return Ok(());
        }
        // Seen closed before COMMIT is sent: the server aborted the
        // transaction when the connection dropped. Certainly not applied.
        if self.client.is_closed() {
            return Err(Fail::Rule(StateError::unavailable(
                "postgres: the connection was lost before the commit (nothing was applied)",
                None,
            )));
        }
        let client = self.client;
        let commit = then_notify(client.batch_execute("COMMIT"), self.notify_after(client));
        match self.send_all(commit).await {
            Ok(()) => {
                *self.in_txn = false;
                Ok(())
            }
            // A write sent with the COMMIT failed with the server's error:
            // the transaction aborted, and the COMMIT only rolled it back.
            // So did a COMMIT answered with a server error (serialization,
            // deadlock).
            Err((e, pending)) if (pending && e.code().is_some()) || !commit_outcome_unknown(&e) => {
                *self.in_txn = false;
                Err(Fail::Pg(e))
            }
            // A read's: nothing it could have committed matters.
            Err((e, _)) if self.reads_only => Err(Fail::Pg(e)),
            // No answer (or the server going down while answering), to the
            // COMMIT or to a request sent with it: the COMMIT may have
            // landed.
            Err((e, _)) => Err(Fail::Unknown(e)),
        }
    }

    /// Sends what is pending, then `sql`, then `COMMIT`, all pipelined (so
    /// a call whose writes are all deferred or guarded in SQL, or a read,
    /// takes one round trip), and returns `sql`'s rows. The transaction is
    /// over: the call's later [`commit`](Self::commit) does nothing, and
    /// whatever it decides from the rows must not need a rollback (its
    /// writes were guarded, or it only read). A failure is judged as
    /// `commit`'s, except that a read (`read_only`) is never
    /// `OutcomeUnknown`.
    pub(crate) async fn query_commit(
        &mut self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
        read_only: bool,
    ) -> TxResult<Vec<Row>> {
        let s = self.statement(sql).await?;
        let client = self.client;
        if client.is_closed() {
            // Nothing of this transaction went out (then another
            // connection is taken), or what did was aborted with it.
            return Err(if self.began {
                Fail::Rule(StateError::unavailable(
                    "postgres: the connection was lost before the commit (nothing was applied)",
                    None,
                ))
            } else {
                Fail::Closed
            });
        }
        let notify = (!(read_only || self.reads_only)).then(|| self.notify_after(client));
        let commit = then_notify(client.batch_execute("COMMIT"), notify.flatten());
        let both = Box::pin(ordered(client.query(&s, params), commit));
        let out = self.send_all(async { Ok::<_, PgError>(both.await) }).await;
        let (rows, commit) = match out {
            Ok(v) => v,
            Err((e, _)) => (Err(e), Ok(())),
        };
        let failed = match (rows, commit) {
            (Ok(rows), Ok(())) => {
                *self.in_txn = false;
                self.committed = true;
                return Ok(rows);
            }
            // A statement before the COMMIT failed.
            (Err(e), _) => (e, true),
            (Ok(_), Err(e)) => (e, false),
        };
        let (e, before) = failed;
        if read_only
            || self.reads_only
            || (before && e.code().is_some())
            || !commit_outcome_unknown(&e)
        {
            if e.code().is_some() {
                *self.in_txn = false;
            }
            Err(Fail::Pg(e))
        } else {
            Err(Fail::Unknown(e))
        }
    }

    /// Ends a transaction that did not commit: `ROLLBACK` when anything
    /// was sent (nothing pending is). Returns whether `BEGIN` answered.
    pub(crate) async fn finish(&mut self, committed: bool) -> bool {
        self.pending.clear();
        if !committed && *self.in_txn && !self.client.is_closed() {
            // A failed rollback leaves the flag set: the connection is
            // closed rather than pooled.
            if self.client.batch_execute("ROLLBACK").await.is_ok() {
                *self.in_txn = false;
            }
        }
        self.began
    }

    async fn statement(&mut self, sql: &str) -> TxResult<Statement> {
        let text = sql.replace("{s}", self.prefix);
        if let Some(s) = self.statements.get(&text) {
            return Ok(s.clone());
        }
        // Prepared inside the transaction (BEGIN goes out first): behind
        // a transaction-mode pooler, an uncached statement is on the
        // server connection that runs it.
        let client = self.client;
        let s = self.pipelined(client.prepare(&text)).await?;
        // Uncached, it is closed when dropped.
        if self.cache {
            self.statements.insert(text, s.clone());
        }
        Ok(s)
    }

    /// Runs a statement (`{s}` stands for the schema prefix), prepared once
    /// per connection.
    pub(crate) async fn query(
        &mut self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> TxResult<Vec<Row>> {
        let s = self.statement(sql).await?;
        let client = self.client;
        self.pipelined(client.query(&s, params)).await
    }

    /// Runs statements pipelined (sent together with what is pending, run
    /// by the server in order, each on its own snapshot), and returns each
    /// one's rows; the first failure in order is the answer.
    #[allow(clippy::expect_used, reason = "polled to the end")]
    pub(crate) async fn queries(
        &mut self,
        list: &[(&str, &[&(dyn ToSql + Sync)])],
    ) -> TxResult<Vec<Vec<Row>>> {
        let mut statements = Vec::with_capacity(list.len());
        for (sql, _) in list {
            statements.push(self.statement(sql).await?);
        }
        let client = self.client;
        type RowsFut<'f> =
            Pin<Box<dyn Future<Output = std::result::Result<Vec<Row>, PgError>> + Send + 'f>>;
        let mut futs: Vec<RowsFut<'_>> = statements
            .iter()
            .zip(list)
            .map(|(s, (_, p))| Box::pin(client.query(s, p)) as RowsFut<'_>)
            .collect();
        let all = async move {
            let mut outs: Vec<Option<std::result::Result<Vec<Row>, PgError>>> =
                futs.iter().map(|_| None).collect();
            std::future::poll_fn(|cx| {
                for (f, o) in futs.iter_mut().zip(outs.iter_mut()) {
                    if o.is_none()
                        && let Poll::Ready(r) = f.as_mut().poll(cx)
                    {
                        *o = Some(r);
                    }
                }
                if outs.iter().all(Option::is_some) {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            })
            .await;
            outs.into_iter()
                .map(|o| o.expect("polled to the end"))
                .collect::<std::result::Result<Vec<_>, PgError>>()
        };
        self.pipelined(all).await
    }

    /// Runs a statement and returns the rows it changed.
    pub(crate) async fn execute(
        &mut self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> TxResult<u64> {
        let s = self.statement(sql).await?;
        let client = self.client;
        self.pipelined(client.execute(&s, params)).await
    }

    /// A write whose answer the call does not need: sent with the next
    /// statement or with `COMMIT` (one round trip fewer). Its failure is
    /// reported there, before anything sent after it.
    pub(crate) async fn defer(&mut self, sql: &str, params: Vec<Param>) -> TxResult<()> {
        let s = self.statement(sql).await?;
        self.pending.push(Pending::Exec(s, params));
        Ok(())
    }

    /// Statements without parameters, sent with the next request.
    pub(crate) fn defer_batch(&mut self, sql: &'static str) {
        self.pending.push(Pending::Batch(sql));
    }

    /// Forgets the deferred writes not sent yet (a refusal rolls back
    /// anyway).
    pub(crate) fn discard(&mut self) {
        self.pending.retain(|p| matches!(p, Pending::Begin(_)));
    }

    /// A statement that is not cached (setup's, the schema's own).
    pub(crate) async fn query_text(
        &mut self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> TxResult<Vec<Row>> {
        let client = self.client;
        let s = self.pipelined(client.prepare(sql)).await?;
        self.pipelined(client.query(&s, params)).await
    }

    /// A statement that is not cached, returning the rows it changed.
    pub(crate) async fn execute_text(
        &mut self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> TxResult<u64> {
        let client = self.client;
        let s = self.pipelined(client.prepare(sql)).await?;
        self.pipelined(client.execute(&s, params)).await
    }

    /// Several statements without parameters (the schema files).
    pub(crate) async fn batch(&mut self, sql: &str) -> TxResult<()> {
        let client = self.client;
        self.pipelined(client.batch_execute(sql)).await
    }
}

/// `commit`, and `notify` queued right behind it (polled once after it,
/// so it goes out in the same round trip): answers `commit`'s outcome as
/// soon as it is known, without waiting for `notify`'s, which is dropped
/// (the connection reads and discards its answer). A notification lost
/// that way costs a waiter at most its periodic read (`feed.rs`).
async fn then_notify<'f>(
    commit: impl Future<Output = std::result::Result<(), PgError>>,
    notify: Option<PgFut<'f>>,
) -> std::result::Result<(), PgError> {
    let mut commit = std::pin::pin!(commit);
    let mut notify = notify;
    std::future::poll_fn(|cx| {
        let out = commit.as_mut().poll(cx);
        if let Some(n) = notify.as_mut()
            && n.as_mut().poll(cx).is_ready()
        {
            notify = None;
        }
        out
    })
    .await
}

/// Two requests polled in order on every poll (so the first is queued
/// first), answering both outcomes.
async fn ordered<A, B>(a: impl Future<Output = A>, b: impl Future<Output = B>) -> (A, B) {
    let (mut a, mut b) = (std::pin::pin!(a), std::pin::pin!(b));
    let (mut ra, mut rb) = (None, None);
    std::future::poll_fn(|cx| {
        if ra.is_none()
            && let Poll::Ready(r) = a.as_mut().poll(cx)
        {
            ra = Some(r);
        }
        if rb.is_none()
            && let Poll::Ready(r) = b.as_mut().poll(cx)
        {
            rb = Some(r);
        }
        match (ra.take(), rb.take()) {
            (Some(a), Some(b)) => Poll::Ready((a, b)),
            (a, b) => {
                (ra, rb) = (a, b);
                Poll::Pending
            }
        }
    })
    .await
}

/// True when a failed `COMMIT` may still have committed: no answer came
/// (the connection closed, reset, or an I/O error), or the server went
/// down while answering (connection exception 08, operator intervention
/// 57P: shutdown, crash). Other server errors roll the transaction back.
fn commit_outcome_unknown(e: &PgError) -> bool {
    match e.code() {
        None => true,
        Some(c) => {
            let c = c.code();
            c.starts_with("08") || c.starts_with("57P")
        }
    }
}

/// What a server failure means for the call.
enum Verdict {
    /// Try the whole transaction again (serialization failure, deadlock, a
    /// row another transaction created first).
    Again(&'static str),
    /// The connection was closed before anything was sent on it: take
    /// another one (a pooled connection the server dropped while idle).
    Redial,
    /// The call fails `Unavailable`.
    Fail,
}

fn verdict(e: &PgError, began: bool) -> Verdict {
    match e.code() {
        Some(c) if *c == SqlState::T_R_SERIALIZATION_FAILURE => Verdict::Again("serialization"),
        Some(c) if *c == SqlState::T_R_DEADLOCK_DETECTED => Verdict::Again("deadlock"),
        // A row, or (setup racing another program's `CREATE TABLE IF NOT
        // EXISTS`) a table, index or type another transaction created
        // first: the next try finds it.
        Some(c)
            if *c == SqlState::UNIQUE_VIOLATION
                || *c == SqlState::DUPLICATE_TABLE
                || *c == SqlState::DUPLICATE_OBJECT =>
        {
            Verdict::Again("creation race")
        }
        Some(c) if *c == SqlState::ADMIN_SHUTDOWN && !began => Verdict::Redial,
        // A read-only server refused a write statement: the transaction
        // aborted with nothing written, and its connection is not pooled
        // again (`Pooled::after`): another dial may reach the primary.
        Some(c) if *c == SqlState::READ_ONLY_SQL_TRANSACTION => Verdict::Redial,
        Some(_) => Verdict::Fail,
        None if !began => Verdict::Redial,
        None => Verdict::Fail,
    }
}

/// A prepared statement the server connection does not have, or has
/// already: what a transaction-mode pooler does to a statement cache.
fn lost_statement(e: &PgError) -> bool {
    e.code().is_some_and(|c| {
        *c == SqlState::INVALID_SQL_STATEMENT_NAME || *c == SqlState::DUPLICATE_PSTATEMENT
    })
}

/// True for a server error no retry can fix: a statement the server
/// cannot run as written against the tables it found (SQLSTATE class 42:
/// a type mismatch, a syntax error, a missing privilege) or a value it
/// refuses (class 22: out of range, not valid in the encoding). Not the
/// objects a database set up by an older build (or not set up yet) lacks
/// (undefined table, column, function): another worker's `setup()` fixes
/// those, so they stay `Unavailable`, naming `setup()`.
fn deterministic(e: &PgError) -> bool {
    let Some(c) = e.code() else {
        return false;
    };
    let undefined = *c == SqlState::UNDEFINED_TABLE
        || *c == SqlState::UNDEFINED_COLUMN
        || *c == SqlState::UNDEFINED_FUNCTION;
    let class = &c.code()[..2];
    (class == "42" || class == "22") && !undefined
}

/// A server failure as the crate's error: `Refused` (not retryable) when
/// [`deterministic`], else `Unavailable`.
pub(crate) fn server_error(e: &PgError) -> StateError {
    if deterministic(e) {
        return StateError::refused(format!("postgres: {}", describe(e)), None);
    }
    unavailable(e)
}

/// A server failure as `Unavailable`.
pub(crate) fn unavailable(e: &PgError) -> StateError {
    let detail = match e.as_db_error() {
        Some(db) if *db.code() == SqlState::UNDEFINED_TABLE => format!(
            "postgres: {} (run PostgresStore::setup() first)",
            db.message()
        ),
        // A database set up by an older build: this one's columns and
        // functions come with its schema version.
        Some(db)
            if *db.code() == SqlState::UNDEFINED_FUNCTION
                || *db.code() == SqlState::UNDEFINED_COLUMN =>
        {
            format!(
                "postgres: {} (the database's schema is older than this build: run \
                 PostgresStore::setup() to upgrade it)",
                db.message()
            )
        }
        Some(db) if *db.code() == SqlState::READ_ONLY_SQL_TRANSACTION => format!(
            "postgres: {} (the server is read-only: a standby, or a primary demoted since; \
             name every host with target_session_attrs=read-write so a dial finds the primary)",
            db.message()
        ),
        Some(db) if *db.code() == SqlState::QUERY_CANCELED => {
            format!("postgres: {} (the statement timeout)", db.message())
        }
        Some(db) => format!("postgres: {} ({})", db.message(), db.code().code()),
        None => format!("postgres: {e}"),
    };
    StateError::unavailable(detail, None)
}

/// The tries of one call: how many times it went again, and why.
pub(crate) struct Attempts<'s> {
    store: &'s PostgresStore,
    again: u32,
    /// Every pooled connection may have been dropped by a restarted
    /// server; each is replaced once, then the call fails.
    redials: u32,
}

impl<'s> Attempts<'s> {
    pub(crate) fn new(store: &'s PostgresStore) -> Self {
        Attempts {
            store,
            again: 0,
            redials: 0,
        }
    }

    /// A connection from the pool (see [`PostgresStore::conn`]).
    pub(crate) async fn checkout(&self) -> Result<Pooled> {
        self.store.conn().await
    }

    /// What a try's outcome means: the call's answer, or try again (after
    /// a short pause when the server asked for it).
    pub(crate) async fn judge<T>(
        &mut self,
        out: TxResult<T>,
        began: bool,
    ) -> ControlFlow<Result<T>> {
        let e = match out {
            Ok(v) => return ControlFlow::Break(Ok(v)),
            Err(Fail::Rule(e)) => return ControlFlow::Break(Err(e)),
            Err(Fail::Unknown(e)) => {
                return ControlFlow::Break(Err(StateError::outcome_unknown(
                    format!(
                        "postgres: the connection failed after the commit was sent, so the \
                         write may or may not have been applied: {e}"
                    ),
                    None,
                )));
            }
            Err(Fail::Closed) => {
                if self.redials <= self.store.opts.pool_size {
                    self.redials += 1;
                    agentstate_core::observe::retry("postgres", "redial", self.redials);
                    return ControlFlow::Continue(());
                }
                return ControlFlow::Break(Err(StateError::unavailable(
                    format!("postgres at {}: the connection closed", self.store.target),
                    None,
                )));
            }
            Err(Fail::Pg(e)) => e,
        };
        let store = self.store;
        match verdict(&e, began) {
            Verdict::Again(why) if self.again < store.opts.retries => {
                self.again += 1;
                agentstate_core::observe::retry("postgres", why, self.again);
                backoff(self.again).await;
                ControlFlow::Continue(())
            }
            Verdict::Redial if self.redials <= store.opts.pool_size => {
                self.redials += 1;
                agentstate_core::observe::retry("postgres", "redial", self.redials);
                ControlFlow::Continue(())
            }
            _ if lost_statement(&e) => ControlFlow::Break(Err(StateError::refused(
                format!(
                    "postgres at {}: {}: a pooler in transaction mode (PgBouncer's \
                     pool_mode = transaction) in front of the server? Connect to the \
                     server directly, use the pooler's session mode, or turn off \
                     PgOptions::statement_cache",
                    store.target,
                    describe(&e)
                ),
                Some(Box::new(e)),
            ))),
            _ => ControlFlow::Break(Err(server_error(&e))),
        }
    }
}

/// Runs a transaction body (`|tx| body`, an expression evaluated in an
/// async block, `tx: &mut Tx`) and commits it, trying again as
/// [`Verdict`] says; evaluates to `Result<T>`. The body may run more than
/// once; only the last run's writes are committed. A macro, not a function
/// over an async closure, so that the call's future is `Send` (a bound
/// an `AsyncFnMut` cannot carry yet).
macro_rules! txn {
    ($store:expr, |$tx:ident| $body:expr) => {{
        let store: &$crate::PostgresStore = $store;
        let mut attempts = $crate::conn::Attempts::new(store);
        loop {
            let mut conn = match attempts.checkout().await {
                Ok(c) => c,
                Err(e) => break Err(e),
            };
            let mut tx = conn.tx(store);
            // On the heap: a body's future can be large (a debug build
            // keeps every statement's future in it), and a synchronous
            // call polls it on the caller's stack.
            let out = ::std::boxed::Box::pin($crate::conn::typed(async {
                let $tx = &mut tx;
                let v = $crate::conn::typed(async { $body }).await?;
                $tx.commit().await?;
                Ok(v)
            }))
            .await;
            let began = tx.finish(out.is_ok()).await;
            conn.after(&out);
            drop(conn);
            match attempts.judge(out, began).await {
                ::std::ops::ControlFlow::Break(r) => break r,
                ::std::ops::ControlFlow::Continue(()) => {}
            }
        }
    }};
}
pub(crate) use txn;

impl PostgresStore {
    /// A connection from the pool, dialing one if none is free; waits at
    /// most the connect timeout. A dial the server (or TLS) refuses is
    /// `Refused` as soon as it answers; a server not reached in time is
    /// `Unavailable`, with the last dial's failure.
    pub(crate) async fn conn(&self) -> Result<Pooled> {
        let until = tokio::time::Instant::now() + self.opts.connect_timeout;
        let mut last: Option<Arc<PgError>> = None;
        let mut dials = 0u32;
        loop {
            let left = until.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                break;
            }
            match tokio::time::timeout(left, self.pool.get()).await {
                Ok(Ok(mut obj)) => {
                    if self.opts.require_sync_standby && !obj.replication.synchronous() {
                        // Not pooled again: the next call dials and reads
                        // the settings anew (a standby may be back).
                        obj.retire = true;
                        return Err(self.not_replicated(&obj.replication));
                    }
                    let st = self.pool.status();
                    agentstate_core::observe::pool(
                        "postgres",
                        st.size - st.available,
                        st.available,
                    );
                    return Ok(Pooled { obj: Some(obj) });
                }
                Ok(Err(PoolError::Backend(e))) => {
                    if is_refusal(&e) {
                        return Err(self.refused(e));
                    }
                    last = Some(e);
                    // Dialed again until the timeout (a server starting
                    // up, a standby being promoted): each seen in tracing
                    // and metrics as a `dial` retry.
                    dials += 1;
                    agentstate_core::observe::retry("postgres", "dial", dials);
                    let left = until.saturating_duration_since(tokio::time::Instant::now());
                    tokio::time::sleep(left.min(Duration::from_millis(25))).await;
                }
                Ok(Err(e)) => {
                    return Err(StateError::unavailable(
                        format!("postgres at {}: the pool: {e}", self.target),
                        None,
                    ));
                }
                Err(_) => break,
            }
        }
        let why = match last {
            Some(e) => describe(&e),
            None => "every connection is in use".to_string(),
        };
        Err(StateError::unavailable(
            format!(
                "postgres at {}: no connection within {:?}: {why}",
                self.target, self.opts.connect_timeout
            ),
            None,
        ))
    }

    /// The refusal of a server that does not replicate synchronously,
    /// under [`PgOptions::require_sync_standby`](crate::PgOptions::require_sync_standby).
    fn not_replicated(&self, r: &Replication) -> StateError {
        StateError::refused(
            format!(
                "postgres at {}: the store requires synchronous replication \
                 (require_sync_standby), but synchronous_standby_names is empty (and \
                 synchronous_commit is {}): an acknowledged write would live on this server \
                 alone, and a failover could lose it; name a synchronous standby in \
                 synchronous_standby_names, or drop require_sync_standby to accept that \
                 (nothing was written)",
                self.target, r.synchronous_commit
            ),
            None,
        )
    }

    /// A dial's refusal as the crate's error: the server's own words, and
    /// the driver's error as the source.
    fn refused(&self, e: Arc<PgError>) -> StateError {
        let mut detail = format!(
            "postgres at {} refused the connection: {}",
            self.target,
            describe(&e)
        );
        if let Some(hint) = refusal_hint(&e) {
            detail.push_str(" (");
            detail.push_str(hint);
            detail.push(')');
        }
        StateError::refused(detail, Some(Box::new(e)))
    }
}

/// A short, growing, jittered pause before trying a transaction again.
async fn backoff(attempt: u32) {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(attempt);
    let cap_us = 200u64 << attempt.min(6);
    tokio::time::sleep(Duration::from_micros(h.finish() % cap_us)).await;
}

/// What to change, for the refusals whose fix is not in the server's words.
fn refusal_hint(e: &PgError) -> Option<&'static str> {
    if let Some(db) = e.as_db_error() {
        let m = db.message();
        return if m.contains("no encryption") {
            Some("the server accepts this user only over TLS: sslmode=require or stronger")
        } else if *db.code() == SqlState::INVALID_PASSWORD {
            Some("check the user and password")
        } else {
            None
        };
    }
    let text = describe(e);
    if text.contains("server does not support TLS") {
        Some("the server offers no TLS; sslmode=prefer or disable, or turn ssl on at the server")
    } else if text.contains("NotValidForName") || text.contains("not valid for name") {
        Some("the host connected to is not a name in the server's certificate")
    } else if text.contains("invalid peer certificate") {
        Some("sslrootcert must name the CA that signed the server's certificate")
    } else if text.contains("password missing") {
        Some("the server asks for a password and the DSN has none")
    } else {
        None
    }
}
