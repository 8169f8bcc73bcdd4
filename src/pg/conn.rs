//! Connections, the pool, and the one way a call talks to the server: a
//! transaction, tried again a bounded number of times after a
//! serialization failure, a deadlock or a lost creation race, and every
//! other server failure turned into `Unavailable`, except a failure after
//! `COMMIT` was sent, which is `OutcomeUnknown` (rule I7).
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
//! | a rule refuses (`Conflict`, …): rolled back      | the refusal      |
//! | the connection is seen closed before `COMMIT`    | `Unavailable`    |
//! | `COMMIT` answers a server error (serialization,  | `Unavailable`    |
//! | deadlock: the server rolled back)                | (or tried again) |
//! | `COMMIT` was sent and the connection broke (I/O, | `OutcomeUnknown` |
//! | closed, reset), or the server went down while    |                  |
//! | answering it (class 08, 57P): it may have landed |                  |

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use postgres::error::SqlState;
use postgres::types::ToSql;
use postgres::{NoTls, Row, Statement};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::PostgresStore;
use crate::error::{Result, StateError};

/// One pooled connection and the statements prepared on it.
pub(crate) struct Conn {
    client: postgres::Client,
    statements: HashMap<String, Statement>,
    /// When it was dialed (for the max lifetime).
    born: Instant,
}

/// Dials connections for the pool, and keeps the last dial's failure so a
/// caller waiting for a connection learns why none comes.
pub(crate) struct Manager {
    pub(crate) config: postgres::Config,
    /// `None`: no TLS (`sslmode=disable`).
    pub(crate) tls: Option<MakeRustlsConnect>,
    /// The last dial's failure; cleared by a dial that succeeds. Shared
    /// with the store (r2d2 does not lend its manager back).
    pub(crate) failure: Failure,
    /// A connection older than this is closed when it comes back to the
    /// pool (r2d2's own check only looks at idle ones, every 30 s).
    pub(crate) max_lifetime: Option<Duration>,
}

impl Manager {
    /// Dials one connection: plain, or TLS as the store's `sslmode` says.
    fn dial(&self) -> std::result::Result<postgres::Client, postgres::Error> {
        match &self.tls {
            None => self.config.connect(NoTls),
            Some(tls) => self.config.connect(tls.clone()),
        }
    }
}

/// The last dial's failure, if it failed.
#[derive(Clone, Default)]
pub(crate) struct Failure(Arc<Mutex<Option<Arc<postgres::Error>>>>);

impl Failure {
    fn get(&self) -> Option<Arc<postgres::Error>> {
        self.0.lock().map(|f| f.clone()).unwrap_or(None)
    }

    fn set(&self, e: Option<Arc<postgres::Error>>) {
        if let Ok(mut f) = self.0.lock() {
            *f = e;
        }
    }
}

impl r2d2::ManageConnection for Manager {
    type Connection = Conn;
    /// Shared with the failure slot (the driver's error is not `Clone`).
    type Error = Arc<postgres::Error>;

    fn connect(&self) -> std::result::Result<Conn, Arc<postgres::Error>> {
        let dialed = self.dial().map_err(Arc::new);
        self.failure.set(dialed.as_ref().err().cloned());
        Ok(Conn {
            client: dialed?,
            statements: HashMap::new(),
            born: Instant::now(),
        })
    }

    fn is_valid(&self, conn: &mut Conn) -> std::result::Result<(), Arc<postgres::Error>> {
        conn.client.simple_query("").map(|_| ()).map_err(Arc::new)
    }

    fn has_broken(&self, conn: &mut Conn) -> bool {
        conn.client.is_closed() || self.max_lifetime.is_some_and(|l| conn.born.elapsed() >= l)
    }
}

/// True when a failed dial is the server's (or the TLS layer's) "no" to
/// the configuration, which no retry fixes: authentication (28000 covers a
/// `pg_hba.conf` refusal, 28P01 a wrong password), an unknown database
/// (3D000), no `CONNECT` privilege (42501), the client's own TLS or
/// authentication settings, a certificate that does not verify, a server
/// that does not offer TLS when it is required.
pub(crate) fn is_refusal(e: &postgres::Error) -> bool {
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
fn transient_io(e: &postgres::Error) -> bool {
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
pub(crate) fn describe(e: &postgres::Error) -> String {
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
    Pg(postgres::Error),
    Unknown(postgres::Error),
}

impl From<StateError> for Fail {
    fn from(e: StateError) -> Self {
        Fail::Rule(e)
    }
}

impl From<postgres::Error> for Fail {
    fn from(e: postgres::Error) -> Self {
        Fail::Pg(e)
    }
}

pub(crate) type TxResult<T> = std::result::Result<T, Fail>;

/// One open transaction, with the store's table prefix and the
/// connection's prepared statements. `BEGIN` and `COMMIT` are sent by hand
/// (not `postgres::Transaction`) so the commit can look at the connection
/// before it is sent; dropped without [`commit`](Self::commit), it rolls
/// back.
pub(crate) struct Tx<'a> {
    tx: &'a mut postgres::Client,
    statements: &'a mut HashMap<String, Statement>,
    prefix: &'a str,
    /// Statements kept for the connection's next transactions.
    cache: bool,
    /// `BEGIN` answered and neither `COMMIT` nor `ROLLBACK` sent yet.
    open: bool,
}

impl Drop for Tx<'_> {
    fn drop(&mut self) {
        // What `postgres::Transaction` does: a connection never goes back
        // to the pool inside a transaction (a failed rollback leaves it
        // closed, and the pool drops it).
        if self.open && !self.tx.is_closed() {
            let _ = self.tx.batch_execute("ROLLBACK");
        }
    }
}

impl<'a> Tx<'a> {
    /// `BEGIN` (and the store's settings, `begin`) on `client`.
    fn begin(
        client: &'a mut postgres::Client,
        statements: &'a mut HashMap<String, Statement>,
        store: &'a PostgresStore,
    ) -> std::result::Result<Self, postgres::Error> {
        client.batch_execute(&store.begin)?;
        Ok(Tx {
            tx: client,
            statements,
            prefix: &store.prefix,
            cache: store.opts.statement_cache,
            open: true,
        })
    }

    /// Sends `COMMIT` (see the module's table for what each failure
    /// means).
    fn commit(&mut self) -> TxResult<()> {
        self.open = false;
        // Seen closed before COMMIT is sent: the server aborted the
        // transaction when the connection dropped. Certainly not applied.
        if self.tx.is_closed() {
            return Err(Fail::Rule(StateError::unavailable(
                "postgres: the connection was lost before the commit (nothing was applied)",
                None,
            )));
        }
        match self.tx.batch_execute("COMMIT") {
            Ok(()) => Ok(()),
            Err(e) if commit_outcome_unknown(&e) => Err(Fail::Unknown(e)),
            // The server answered the COMMIT with an error: it rolled the
            // transaction back.
            Err(e) => Err(Fail::Pg(e)),
        }
    }
}

/// True when a failed `COMMIT` may still have committed: no answer came
/// (the connection closed, reset, or an I/O error), or the server went
/// down while answering (connection exception 08, operator intervention
/// 57P: shutdown, crash). Other server errors roll the transaction back.
fn commit_outcome_unknown(e: &postgres::Error) -> bool {
    match e.code() {
        None => true,
        Some(c) => {
            let c = c.code();
            c.starts_with("08") || c.starts_with("57P")
        }
    }
}

impl Tx<'_> {
    fn statement(&mut self, sql: &str) -> TxResult<Statement> {
        let text = sql.replace("{s}", self.prefix);
        if let Some(s) = self.statements.get(&text) {
            return Ok(s.clone());
        }
        let s = self.tx.prepare(&text)?;
        // Uncached, it is closed when dropped, inside its transaction.
        if self.cache {
            self.statements.insert(text, s.clone());
        }
        Ok(s)
    }

    /// Runs a statement (`{s}` stands for the schema prefix), prepared once
    /// per connection.
    pub(crate) fn query(
        &mut self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> TxResult<Vec<Row>> {
        let s = self.statement(sql)?;
        Ok(self.tx.query(&s, params)?)
    }

    /// Runs a statement and returns the rows it changed.
    pub(crate) fn execute(&mut self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> TxResult<u64> {
        let s = self.statement(sql)?;
        Ok(self.tx.execute(&s, params)?)
    }

    /// A statement that is not cached (setup's, the schema's own).
    pub(crate) fn query_text(
        &mut self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> TxResult<Vec<Row>> {
        Ok(self.tx.query(sql, params)?)
    }

    /// A statement that is not cached, returning the rows it changed.
    pub(crate) fn execute_text(
        &mut self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> TxResult<u64> {
        Ok(self.tx.execute(sql, params)?)
    }

    /// Several statements without parameters (the schema files).
    pub(crate) fn batch(&mut self, sql: &str) -> TxResult<()> {
        Ok(self.tx.batch_execute(sql)?)
    }
}

/// What a server failure means for the call.
enum Verdict {
    /// Try the whole transaction again (serialization failure, deadlock, a
    /// row another transaction created first).
    Again,
    /// The connection was closed before anything was sent on it: take
    /// another one (a pooled connection the server dropped while idle).
    Redial,
    /// The call fails `Unavailable`.
    Fail,
}

fn verdict(e: &postgres::Error, began: bool) -> Verdict {
    match e.code() {
        Some(c)
            if *c == SqlState::T_R_SERIALIZATION_FAILURE
                || *c == SqlState::T_R_DEADLOCK_DETECTED
                || *c == SqlState::UNIQUE_VIOLATION =>
        {
            Verdict::Again
        }
        Some(c) if *c == SqlState::ADMIN_SHUTDOWN && !began => Verdict::Redial,
        Some(_) => Verdict::Fail,
        None if !began => Verdict::Redial,
        None => Verdict::Fail,
    }
}

/// A prepared statement the server connection does not have, or has
/// already: what a transaction-mode pooler does to a statement cache.
fn lost_statement(e: &postgres::Error) -> bool {
    e.code().is_some_and(|c| {
        *c == SqlState::INVALID_SQL_STATEMENT_NAME || *c == SqlState::DUPLICATE_PSTATEMENT
    })
}

/// A server failure as the crate's error.
pub(crate) fn unavailable(e: &postgres::Error) -> StateError {
    let detail = match e.as_db_error() {
        Some(db) if *db.code() == SqlState::UNDEFINED_TABLE => format!(
            "postgres: {} (run PostgresStore::setup() first)",
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

impl PostgresStore {
    /// A connection from the pool, dialing one if none is free; waits at
    /// most the connect timeout. A dial the server (or TLS) refuses is
    /// `Refused` as soon as it answers; a server not reached in time is
    /// `Unavailable`, with the last dial's failure.
    pub(crate) fn conn(&self) -> Result<r2d2::PooledConnection<Manager>> {
        if let Some(c) = self.pool.try_get() {
            return Ok(c);
        }
        // r2d2 dials in the background and retries a failed dial until the
        // timeout: wait in short slices, and look at the last dial's
        // failure between them.
        const SLICE: Duration = Duration::from_millis(10);
        let until = Instant::now() + self.opts.connect_timeout;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if let Ok(c) = self.pool.get_timeout(left.min(SLICE)) {
                return Ok(c);
            }
            let failure = self.failure.get();
            if let Some(e) = failure.as_ref().filter(|e| is_refusal(e)) {
                return Err(self.refused(e.clone()));
            }
            if Instant::now() >= until {
                let why = match failure {
                    Some(e) => describe(&e),
                    None => "every connection is in use".to_string(),
                };
                return Err(StateError::unavailable(
                    format!(
                        "postgres at {}: no connection within {:?}: {why}",
                        self.target, self.opts.connect_timeout
                    ),
                    None,
                ));
            }
        }
    }

    /// A dial's refusal as the crate's error: the server's own words, and
    /// the driver's error as the source.
    fn refused(&self, e: Arc<postgres::Error>) -> StateError {
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

    /// Runs `f` in one transaction and commits it. `f` may run more than
    /// once (see [`Verdict`]); only the last run's writes are committed.
    pub(crate) fn txn<T>(&self, mut f: impl FnMut(&mut Tx<'_>) -> TxResult<T>) -> Result<T> {
        let mut again = 0u32;
        // Every pooled connection may have been dropped by a restarted
        // server; each is replaced once, then the call fails.
        let mut redials = 0u32;
        loop {
            let mut conn = self.conn()?;
            let mut began = false;
            let out = (|| {
                let Conn {
                    client, statements, ..
                } = &mut *conn;
                let mut tx = Tx::begin(client, statements, self)?;
                began = true;
                let v = f(&mut tx)?;
                tx.commit()?;
                Ok(v)
            })();
            let e = match out {
                Ok(v) => return Ok(v),
                Err(Fail::Rule(e)) => return Err(e),
                Err(Fail::Unknown(e)) => {
                    return Err(StateError::outcome_unknown(
                        format!(
                            "postgres: the connection failed after the commit was sent, so the \
                             write may or may not have been applied: {e}"
                        ),
                        None,
                    ));
                }
                Err(Fail::Pg(e)) => e,
            };
            match verdict(&e, began) {
                Verdict::Again if again < self.opts.retries => {
                    again += 1;
                    backoff(again);
                }
                Verdict::Redial if redials <= self.opts.pool_size => {
                    redials += 1;
                }
                _ if lost_statement(&e) => {
                    return Err(StateError::refused(
                        format!(
                            "postgres at {}: {}: a pooler in transaction mode (PgBouncer's \
                             pool_mode = transaction) in front of the server? Connect to the \
                             server directly, use the pooler's session mode, or turn off \
                             PgOptions::statement_cache",
                            self.target,
                            describe(&e)
                        ),
                        Some(Box::new(e)),
                    ));
                }
                _ => return Err(unavailable(&e)),
            }
        }
    }
}

/// A short, growing, jittered pause before trying a transaction again.
fn backoff(attempt: u32) {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(attempt);
    let cap_us = 200u64 << attempt.min(6);
    std::thread::sleep(Duration::from_micros(h.finish() % cap_us));
}

/// What to change, for the refusals whose fix is not in the server's words.
fn refusal_hint(e: &postgres::Error) -> Option<&'static str> {
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
