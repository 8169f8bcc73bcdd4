//! Connections, the pool, and the one way a call talks to the server: a
//! transaction, tried again a bounded number of times after a
//! serialization failure, a deadlock or a lost creation race, and every
//! other server failure turned into `Unavailable`.

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
/// the server failed.
pub(crate) enum Fail {
    Rule(StateError),
    Pg(postgres::Error),
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
/// connection's prepared statements.
pub(crate) struct Tx<'a> {
    tx: postgres::Transaction<'a>,
    statements: &'a mut HashMap<String, Statement>,
    prefix: &'a str,
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
                let tx = client.transaction()?;
                began = true;
                let mut tx = Tx {
                    tx,
                    statements,
                    prefix: &self.prefix,
                };
                let v = f(&mut tx)?;
                tx.tx.commit()?;
                Ok(v)
            })();
            let e = match out {
                Ok(v) => return Ok(v),
                Err(Fail::Rule(e)) => return Err(e),
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
