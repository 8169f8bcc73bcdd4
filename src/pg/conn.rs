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
//! | no connection (dial, pool wait)                  | `Unavailable`    |
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
use std::time::Duration;

use postgres::error::SqlState;
use postgres::types::ToSql;
use postgres::{NoTls, Row, Statement};

use super::PostgresStore;
use crate::error::{Result, StateError};

/// One pooled connection and the statements prepared on it.
pub(crate) struct Conn {
    client: postgres::Client,
    statements: HashMap<String, Statement>,
}

/// Dials connections for the pool.
pub(crate) struct Manager {
    pub(crate) config: postgres::Config,
}

impl r2d2::ManageConnection for Manager {
    type Connection = Conn;
    type Error = postgres::Error;

    fn connect(&self) -> std::result::Result<Conn, postgres::Error> {
        Ok(Conn {
            client: self.config.connect(NoTls)?,
            statements: HashMap::new(),
        })
    }

    fn is_valid(&self, conn: &mut Conn) -> std::result::Result<(), postgres::Error> {
        conn.client.simple_query("").map(|_| ())
    }

    fn has_broken(&self, conn: &mut Conn) -> bool {
        conn.client.is_closed()
    }
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
    /// `BEGIN` on `client`.
    fn begin(
        client: &'a mut postgres::Client,
        statements: &'a mut HashMap<String, Statement>,
        prefix: &'a str,
    ) -> std::result::Result<Self, postgres::Error> {
        client.batch_execute("BEGIN")?;
        Ok(Tx {
            tx: client,
            statements,
            prefix,
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
        self.statements.insert(text, s.clone());
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
    /// most the connect timeout.
    pub(crate) fn conn(&self) -> Result<r2d2::PooledConnection<Manager>> {
        self.pool.get().map_err(|e| {
            StateError::unavailable(
                format!(
                    "postgres {}: no connection within {:?}: {e}",
                    self.display, self.opts.connect_timeout
                ),
                None,
            )
        })
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
                let Conn { client, statements } = &mut *conn;
                let mut tx = Tx::begin(client, statements, &self.prefix)?;
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

/// `postgres://user:secret@host/…` → `postgres://user:***@host/…`; a
/// `key=value` DSN loses its `password=…`.
pub(crate) fn redact(dsn: &str) -> String {
    if let Some((scheme, rest)) = dsn.split_once("://") {
        let auth_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (auth, tail) = rest.split_at(auth_end);
        return match auth.rsplit_once('@') {
            Some((userinfo, host)) => match userinfo.split_once(':') {
                Some((user, _)) => format!("{scheme}://{user}:***@{host}{tail}"),
                None => dsn.to_string(),
            },
            None => dsn.to_string(),
        };
    }
    dsn.split_whitespace()
        .map(|kv| {
            if kv.starts_with("password=") {
                "password=***"
            } else {
                kv
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    #[test]
    fn passwords_never_shown() {
        assert_eq!(
            super::redact("postgres://me:hunter2@db:5432/x"),
            "postgres://me:***@db:5432/x"
        );
        assert_eq!(
            super::redact("host=db password=hunter2 user=me"),
            "host=db password=*** user=me"
        );
    }
}
