//! agentstate's PostgreSQL backend (the `agentstate` facade's feature
//! `postgres`, which re-exports it): one server every worker of
//! a fleet reads and writes, with the rules of every other backend held
//! across processes.
//!
//! Each call is one server transaction: it reads the rows it decides on
//! `FOR UPDATE`, asks the shared rules (`agentstate_core::rules`) what to write, and
//! writes in the same transaction. Run `seq`s come from a per-tenant
//! counter row updated in the creating transaction, so a tenant's creates
//! commit in `seq` order. The schema is `schema/v*.sql`, applied by
//! [`PostgresStore::setup`].
//!
//! Async-native: every call is an `async fn` over `tokio-postgres`
//! (`core.rs`, the `AsyncCore` of `agentstate_core::native`), pooled by `deadpool`
//! (`conn.rs`); the synchronous traits wait on those futures with the
//! store's bridge. Files: `conn.rs` the pool and the transaction runner
//! (retries, verdicts, pipelining), `runs.rs`, `trays.rs`, `budgets.rs`
//! the calls, `idempotency.rs` keyed calls, `admin.rs` the operator
//! functions, `tls.rs` libpq's `sslmode` on rustls.
//!
//! The tray tables `pinned_epoch` and `pinned_tray_index` are the seeds'
//! own, exactly as pinned 0.16's `PostgresStateStore` creates them
//! (`schema/pinned.sql`; schema 9 converts a database of schemas 1-8):
//! both programs share one database, set up in either order, and fence
//! each other. What this store adds there (`doc_raw`, indexes, triggers)
//! pinned never sees; see `schema/v9.sql` and `trays.rs`.

// No unsafe code in this crate.
#![forbid(unsafe_code)]
// Every public item is documented; the docs are part of the contract.
#![warn(missing_docs)]
// Operating errors are handled, never unwrapped, outside tests: each
// remaining `expect` states the invariant that makes it unreachable.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

mod admin;
mod budgets;
pub(crate) mod conn;
mod feed;
mod fields;
pub(crate) mod idempotency;
mod recent;
mod runs;
mod tls;
mod trays;

// The store's calls: its `AsyncCore` (each call an inherent `async fn` of
// the same name, in `runs.rs`, `trays.rs`, `budgets.rs`, `feed.rs` and
// `admin.rs`, inside a span and metrics) and its synchronous traits over
// it, generated from the one list of calls (`agentstate_core::calls`).
agentstate_core::impl_async_core!(PostgresStore, "postgres");

use std::borrow::Cow;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use agentstate_core::error::{Result, StateError};
use agentstate_core::native::Bridge;
use agentstate_core::options::Options;

use conn::{Manager, Tx, txn};

/// The schema files, in order; `SCHEMA[i]` brings a database from version
/// `i` to `i + 1`.
const SCHEMA: &[&str] = &[
    include_str!("schema/v1.sql"),
    include_str!("schema/v2.sql"),
    include_str!("schema/v3.sql"),
    include_str!("schema/v4.sql"),
    include_str!("schema/v5.sql"),
    include_str!("schema/v6.sql"),
    include_str!("schema/v7.sql"),
    include_str!("schema/v8.sql"),
    include_str!("schema/v9.sql"),
    include_str!("schema/v10.sql"),
];
/// The seeds' two tray tables as pinned creates them, run before
/// `SCHEMA[0]` on a database this store never set up (see the file).
const PINNED_TABLES: &str = include_str!("schema/pinned.sql");
/// The schema version this build writes.
pub(crate) const SCHEMA_VERSION: u8 = SCHEMA.len() as u8;

/// How a [`PostgresStore`] connects: the options every backend reads
/// ([`Options`]: clock, record limit, scrubber) and the server's own.
///
/// ```
/// use std::time::Duration;
/// use agentstate::{Options, PgOptions};
/// let opts = PgOptions::new()
///     .pool_size(16)
///     .connect_timeout(Duration::from_secs(2))
///     .schema("agents")
///     .idle_timeout(Some(Duration::from_secs(300)))
///     .max_lifetime(Some(Duration::from_secs(1800)))
///     .ssl_mode("verify-full")
///     .ssl_root_cert("/etc/ssl/certs/db-ca.pem")
///     .options(Options::new().record_bytes_max(256 * 1024));
/// # let _ = opts;
/// ```
///
/// **TLS** (on rustls, libpq's `sslmode`): the DSN's `sslmode`,
/// `sslrootcert`, `sslcert` and `sslkey` (URL query or `key=value`) are
/// read as libpq reads them, and the options below override them:
///
/// | `sslmode`     | TLS                          | server certificate checked          |
/// |---------------|------------------------------|-------------------------------------|
/// | `disable`     | never                        | —                                   |
/// | `prefer` (default), `allow` | if the server offers it | no                       |
/// | `require`     | always                       | no; with a root certificate, as `verify-ca` |
/// | `verify-ca`   | always                       | chains to the root certificate      |
/// | `verify-full` | always                       | chain, and it names the host        |
///
/// `verify-ca` and `verify-full` need the root certificate
/// (`sslrootcert`, else libpq's `~/.postgresql/root.crt`).
#[derive(Clone)]
pub struct PgOptions {
    pub(crate) options: Options,
    pub(crate) pool_size: u32,
    pub(crate) connect_timeout: Duration,
    pub(crate) statement_timeout: Duration,
    pub(crate) schema: String,
    pub(crate) retries: u32,
    pub(crate) statement_cache: bool,
    pub(crate) idle_timeout: Option<Duration>,
    pub(crate) max_lifetime: Option<Duration>,
    /// As written; checked by `connect_with`.
    pub(crate) ssl_mode: Option<String>,
    pub(crate) ssl_root_cert: Option<PathBuf>,
    pub(crate) ssl_client_cert: Option<(PathBuf, PathBuf)>,
    pub(crate) tls: Option<Arc<rustls::ClientConfig>>,
    pub(crate) lazy: bool,
    pub(crate) require_sync_standby: bool,
}

impl std::fmt::Debug for PgOptions {
    // By hand: a rustls configuration holds the client's key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgOptions")
            .field("options", &self.options)
            .field("pool_size", &self.pool_size)
            .field("connect_timeout", &self.connect_timeout)
            .field("statement_timeout", &self.statement_timeout)
            .field("schema", &self.schema)
            .field("retries", &self.retries)
            .field("statement_cache", &self.statement_cache)
            .field("idle_timeout", &self.idle_timeout)
            .field("max_lifetime", &self.max_lifetime)
            .field("ssl_mode", &self.ssl_mode)
            .field("ssl_root_cert", &self.ssl_root_cert)
            .field("ssl_client_cert", &self.ssl_client_cert)
            .field("tls", &self.tls.as_ref().map(|_| "a rustls ClientConfig"))
            .field("lazy", &self.lazy)
            .field("require_sync_standby", &self.require_sync_standby)
            .finish()
    }
}

impl Default for PgOptions {
    fn default() -> Self {
        PgOptions {
            options: Options::default(),
            pool_size: 8,
            connect_timeout: Duration::from_secs(5),
            statement_timeout: Duration::from_secs(30),
            schema: "public".to_string(),
            retries: 16,
            statement_cache: true,
            idle_timeout: Some(Duration::from_secs(600)),
            max_lifetime: Some(Duration::from_secs(1800)),
            ssl_mode: None,
            ssl_root_cert: None,
            ssl_client_cert: None,
            tls: None,
            lazy: false,
            require_sync_standby: false,
        }
    }
}

impl PgOptions {
    /// 8 connections, 5 s to connect, 30 s per statement, schema `public`,
    /// the default [`Options`], not lazy.
    pub fn new() -> Self {
        Self::default()
    }
    /// The options every backend reads (clock, record limit, scrubber); the
    /// file store's durability and salvage mean nothing here.
    pub fn options(mut self, options: Options) -> Self {
        self.options = options;
        self
    }
    /// Connections per process (at least 1, default 8), dialed when a call
    /// first needs one.
    pub fn pool_size(mut self, n: u32) -> Self {
        self.pool_size = n.max(1);
        self
    }
    /// How long dialing the server may take, and how long a call waits for a
    /// free connection, before it is `Unavailable` (default 5 s).
    pub fn connect_timeout(mut self, t: Duration) -> Self {
        self.connect_timeout = t.max(Duration::from_millis(10));
        self
    }
    /// The server cancels a statement that runs (or waits on a lock) longer
    /// than this, and the call is `Unavailable` (default 30 s). A server
    /// that stops answering is noticed by TCP keepalives and the TCP user
    /// timeout within about the same time.
    pub fn statement_timeout(mut self, t: Duration) -> Self {
        self.statement_timeout = t.max(Duration::from_millis(10));
        self
    }
    /// The PostgreSQL schema holding the tables (default `public`): a
    /// lowercase SQL identifier (`[a-z_][a-z0-9_]*`, at most 63 bytes).
    /// [`PostgresStore::setup`] creates it.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }
    /// How many times a call is tried again after a serialization failure
    /// or a deadlock the server reported (default 16).
    pub fn retries(mut self, n: u32) -> Self {
        self.retries = n;
        self
    }
    /// Whether each connection keeps its prepared statements from one
    /// transaction to the next (default on: a statement is parsed once
    /// per connection). Turn it off behind a pooler in transaction mode
    /// (PgBouncer's `pool_mode = transaction`), which hands each
    /// transaction whichever server connection is free, so a statement
    /// prepared on one is unknown on the next: each statement is then
    /// prepared in its transaction (one more round trip each). With it
    /// on, such a pooler's "prepared statement does not exist" is
    /// `Refused`, naming this fix.
    pub fn statement_cache(mut self, on: bool) -> Self {
        self.statement_cache = on;
        self
    }
    /// A pooled connection unused this long is closed (default 10 min;
    /// `None`: never). Idle connections are looked at about every 30 s.
    pub fn idle_timeout(mut self, t: Option<Duration>) -> Self {
        self.idle_timeout = t;
        self
    }
    /// A connection older than this is closed when a call gives it back,
    /// or, idle, at the next look (about every 30 s); default 30 min,
    /// `None`: never. Under a server that fails over behind one name, or
    /// a proxy or firewall that drops old connections, set it below their
    /// limit.
    pub fn max_lifetime(mut self, t: Option<Duration>) -> Self {
        self.max_lifetime = t;
        self
    }
    /// libpq's `sslmode`, spelled as libpq spells it: `disable`, `allow`,
    /// `prefer`, `require`, `verify-ca` or `verify-full` (see the table
    /// above); overrides the DSN's. Another word is `Invalid` at
    /// [`PostgresStore::connect_with`].
    pub fn ssl_mode(mut self, mode: &str) -> Self {
        self.ssl_mode = Some(mode.to_string());
        self
    }
    /// The PEM file of the certificate(s) the server's certificate must
    /// chain to (libpq's `sslrootcert`); overrides the DSN's. With it,
    /// `require` checks the chain as `verify-ca` does.
    pub fn ssl_root_cert(mut self, pem: impl Into<PathBuf>) -> Self {
        self.ssl_root_cert = Some(pem.into());
        self
    }
    /// A client certificate (PEM, its chain after it) and its private key
    /// (PEM: PKCS#8, PKCS#1 or SEC1), for servers that authenticate by
    /// certificate (`hostssl … cert` in `pg_hba.conf`); libpq's `sslcert`
    /// and `sslkey`, overriding the DSN's.
    pub fn ssl_client_cert(
        mut self,
        cert_pem: impl Into<PathBuf>,
        key_pem: impl Into<PathBuf>,
    ) -> Self {
        self.ssl_client_cert = Some((cert_pem.into(), key_pem.into()));
        self
    }
    /// A rustls client configuration built in code (its roots, its
    /// verifier, its client certificate), used for every TLS connection
    /// instead of the root and client certificates from the DSN or the
    /// options. TLS is then required unless `sslmode` says otherwise.
    /// `rustls` 0.23.
    pub fn tls(mut self, config: rustls::ClientConfig) -> Self {
        self.tls = Some(Arc::new(config));
        self
    }
    /// With `false` (the default), [`PostgresStore::connect_with`] (and
    /// `connect`, `connect_config`) dials the server once before it
    /// returns, and keeps the connection in the pool: a wrong password, a
    /// `pg_hba.conf` refusal, an unknown database, a certificate that does
    /// not verify, an `sslmode` the server cannot meet (TLS required of a
    /// server without it, or a user the server takes only over TLS) are
    /// `Refused` at once, with the server's words, and a server not
    /// reached within the connect timeout is `Unavailable`: the errors the
    /// first call would answer. With `true` it opens nothing: the first
    /// call dials, and answers those errors; use it for a server that may
    /// not be up yet when the store is made. Redis's store has the same
    /// option (`RedisOptions::lazy`).
    pub fn lazy(mut self, lazy: bool) -> Self {
        self.lazy = lazy;
        self
    }
    /// With `true`, every connection must reach a server that replicates
    /// each commit to a synchronous standby before acknowledging it
    /// (`synchronous_standby_names` not empty; the store commits with
    /// `synchronous_commit = on`), so that an `Ok` survives losing the
    /// primary. The settings are read on every connection the store dials
    /// (one query), so a failover to a server without a synchronous
    /// standby is noticed; while they do not hold, every call is
    /// `Refused` (not retryable), naming both settings, and nothing is
    /// written. In a DSN: `require_sync_standby=true`. Default `false`:
    /// the store runs on any server and says what an `Ok` survives in the
    /// log (target `agentstate::postgres`, once per reading) and in
    /// [`StoreStats::backend`](agentstate_core::StoreStats).
    pub fn require_sync_standby(mut self, require: bool) -> Self {
        self.require_sync_standby = require;
        self
    }
}

/// The PostgreSQL backend: every worker of a fleet connects to one server
/// and shares its rows; every rule holds across processes (versions and
/// fences are each one transaction, a walk in `seq` order never skips a
/// record that commits late).
///
/// `connect` dials one connection and keeps it (unless
/// [`PgOptions::lazy`]); the rest of a pool of [`PgOptions::pool_size`]
/// connections is dialed as calls need them, over TLS as the DSN's
/// `sslmode` says (see [`PgOptions`]). A dial the server refuses (a wrong
/// password, `pg_hba.conf`, an unknown database, a certificate that does
/// not verify) is `Persistence { reason: Refused }` with the server's
/// words as soon as it answers: from `connect`, or (lazy, or a later
/// dial) from the call that needed the connection.
///
/// **Poolers:** through PgBouncer in session mode the store works as
/// over a direct connection; in transaction mode turn off
/// [`PgOptions::statement_cache`] (its settings are per transaction, so
/// nothing else leaks between the server connections it is lent). Call [`setup`](Self::setup)
/// once at boot (every worker may, at the same time) before any other call.
///
/// **Durability:** an `Ok` means the call's transaction committed with
/// `synchronous_commit = on` (set on every connection), so it survives a
/// server crash. A server that cannot be reached, a connection lost
/// mid-call, or a server shut down is `Persistence { reason: Unavailable }`
/// within the timeouts of [`PgOptions`], and nothing of the call was
/// applied; only a connection that broke after the call's `COMMIT` was
/// sent leaves it unknown whether it committed: `OutcomeUnknown` (rule I7),
/// retryable when the call carried an idempotency key (`*_idempotent`).
///
/// **Async-native:** every call is implemented once, as a future over the
/// `tokio-postgres` client, its connections pooled by `deadpool` and
/// dialed and driven on a small runtime of the store's own (one worker
/// thread, started by `connect`), so a pooled connection never belongs to
/// the runtime of whichever caller dialed it, and the store may be made,
/// used and dropped inside or outside any runtime.
/// `AsyncStore::new` (or `.into()`) awaits
/// those futures in the caller's own task: the way to use the store from
/// async code. The synchronous API ([`StateStore`](agentstate_core::StateStore) and
/// the rest) drives the same future to completion on the calling thread:
/// an ordinary blocking call on a plain thread; called from inside a
/// runtime it does not panic, but it blocks that executor thread for the
/// whole call, so async code should use `AsyncStore`. [`setup_async`](Self::setup_async)
/// and [`schema_version_async`](Self::schema_version_async) are the async
/// forms of the two calls of the store's own.
///
/// **Cancellation:** a call's future dropped before its `COMMIT` was handed
/// to the connection applies nothing: the connection, left inside its
/// transaction, is closed rather than pooled, and the server rolls the
/// transaction back. Dropped after that, the write may still land (as
/// after an `OutcomeUnknown`, with no one to tell): drop writes only when
/// a keyed retry (`*_idempotent`) can settle what happened.
///
/// ```no_run
/// use agentstate::{PostgresStore, RunKey, RunRecord, StateStore};
/// let store = PostgresStore::connect("postgres://agent@db.internal/agents")?;
/// store.setup()?;
/// store.put_run(RunRecord::new(RunKey::new("acme", "run_1"), "planner"))?;
/// # Ok::<(), agentstate::StateError>(())
/// ```
pub struct PostgresStore {
    pool: deadpool::managed::Pool<Manager>,
    /// The store's runtime: its connections are dialed and driven there.
    bridge: Arc<Bridge>,
    opts: PgOptions,
    /// `"schema".`, prefixed to every table name.
    prefix: String,
    /// The feed's notification channel (`feed.rs`).
    channel: String,
    /// The cursor secret, read from the database on first use.
    secret: OnceLock<[u8; 16]>,
    /// The DSN without its password, for messages.
    display: String,
    /// What starts every transaction: `BEGIN` and the settings.
    begin: String,
    /// `host:port` (each, when several), for messages.
    target: String,
    /// The last stored bytes of runs this store read or wrote: what a
    /// `put_run` or `patch_run` decides against and compares-and-swaps in
    /// one round trip (see `runs.rs`). Only a hint: a stale entry costs a
    /// failed swap and the locked path.
    pub(crate) runs_seen: runs::Seen,
    /// The budgets and holds it last read or wrote (`budgets.rs`).
    pub(crate) spend_seen: budgets::Seen,
    /// The change feed's listener and its waiters (`feed.rs`).
    feed: Arc<feed::Hub>,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("dsn", &self.display)
            .field("schema", &self.opts.schema)
            .field("pool_size", &self.opts.pool_size)
            .finish_non_exhaustive()
    }
}

/// The hosts and ports a configuration names, `host:port,…`.
fn target(config: &tokio_postgres::Config) -> String {
    use tokio_postgres::config::Host;
    let ports = config.get_ports();
    config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let port = ports
                .get(i)
                .or_else(|| ports.first())
                .copied()
                .unwrap_or(5432);
            match h {
                Host::Tcp(h) => format!("{h}:{port}"),
                Host::Unix(p) => format!("{}/.s.PGSQL.{port}", p.display()),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

fn valid_schema(s: &str) -> bool {
    let mut chars = s.chars();
    s.len() <= 63
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

impl PostgresStore {
    /// A store over the server `dsn` names (a `postgres://` URL or a
    /// `key=value` string), with the default [`PgOptions`]: dials the
    /// server once, as [`connect_with`](Self::connect_with) says; a bad
    /// DSN is `Invalid`.
    pub fn connect(dsn: &str) -> Result<PostgresStore> {
        Self::connect_with(dsn, PgOptions::default())
    }

    /// A store over the server `dsn` names, with options. Reads the TLS
    /// files the DSN or the options name (one missing or unreadable is
    /// `Invalid`), then dials one connection (kept in the pool) unless
    /// [`PgOptions::lazy`].
    ///
    /// That dial, or with `lazy` the first call's, fails `Refused` as soon
    /// as the server (or TLS) says no to the configuration — a wrong
    /// password, a `pg_hba.conf` refusal, an unknown database, a user
    /// allowed only over TLS, TLS required of a server without it, a
    /// certificate that does not verify — with the server's own words and
    /// a hint naming the setting (`sslmode`, the password); and
    /// `Unavailable` when the server is not reached within the connect
    /// timeout (down, unreachable, restarting).
    pub fn connect_with(dsn: &str, opts: PgOptions) -> Result<PostgresStore> {
        let display = agentstate_core::redact_connection_string(dsn);
        let (rest, dsn_tls) =
            tls::split_dsn(dsn).map_err(|e| StateError::invalid(format!("dsn {display}: {e}")))?;
        let config: tokio_postgres::Config = rest
            .parse()
            .map_err(|e| StateError::invalid(format!("dsn {display}: {e}")))?;
        Self::build(config, dsn_tls, display, opts)
    }

    /// A store over a client configuration built in code (hosts, user,
    /// password, database, application name, timeouts, keepalives: any
    /// `tokio_postgres::Config` setting), with options. Its `ssl_mode`
    /// (disable, prefer, require) is read as the DSN's `sslmode` would be;
    /// root and client certificates come from the options
    /// ([`PgOptions::ssl_root_cert`], [`PgOptions::ssl_client_cert`],
    /// [`PgOptions::tls`]). Like [`connect_with`](Self::connect_with), it
    /// dials once unless [`PgOptions::lazy`]. `tokio-postgres` 0.7.
    ///
    /// ```
    /// use agentstate::{PgOptions, PostgresStore};
    /// let mut config = tokio_postgres::Config::new();
    /// config.host("db.internal").user("agent").dbname("agents");
    /// let store = PostgresStore::connect_config(config, PgOptions::new().lazy(true))?;
    /// # Ok::<(), agentstate::StateError>(())
    /// ```
    pub fn connect_config(
        config: tokio_postgres::Config,
        opts: PgOptions,
    ) -> Result<PostgresStore> {
        use tokio_postgres::config::SslMode as S;
        let dsn_tls = tls::DsnTls {
            mode: Some(match config.get_ssl_mode() {
                S::Disable => tls::PgSslMode::Disable,
                S::Require => tls::PgSslMode::Require,
                _ => tls::PgSslMode::Prefer,
            }),
            ..Default::default()
        };
        let display = format!(
            "postgres://{}@{}/{}",
            config.get_user().unwrap_or(""),
            target(&config),
            config.get_dbname().unwrap_or("")
        );
        Self::build(config, dsn_tls, display, opts)
    }

    fn build(
        mut config: tokio_postgres::Config,
        dsn_tls: tls::DsnTls,
        display: String,
        opts: PgOptions,
    ) -> Result<PostgresStore> {
        if !valid_schema(&opts.schema) {
            return Err(StateError::invalid(format!(
                "schema {:?}: must be a lowercase SQL identifier ([a-z_][a-z0-9_]*, at most 63 bytes)",
                opts.schema
            )));
        }
        let mode = opts
            .ssl_mode
            .as_deref()
            .map(|m| {
                tls::PgSslMode::parse(m).ok_or_else(|| {
                    StateError::invalid(format!(
                        "ssl_mode {m:?}: must be disable, allow, prefer, require, verify-ca or verify-full"
                    ))
                })
            })
            .transpose()?;
        // The DSN's `require_sync_standby=true` or the option's: either
        // asks for it.
        let mut opts = opts;
        opts.require_sync_standby |= dsn_tls.require_sync_standby == Some(true);
        let tls = tls::resolve(tls::TlsSettings {
            dsn: dsn_tls,
            mode,
            root_cert: opts.ssl_root_cert.as_deref(),
            client_cert: opts
                .ssl_client_cert
                .as_ref()
                .map(|(c, k)| (c.as_path(), k.as_path())),
            config: opts.tls.as_ref(),
        })?;
        config.ssl_mode(tls.mode.driver());
        let target = target(&config);
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(opts.connect_timeout);
        }
        let ms = opts.statement_timeout.as_millis();
        // Every transaction commits synchronously (the durability promise),
        // cancels long statements, and is dropped by the server if a client
        // dies inside it. Set with `SET LOCAL` in the `BEGIN` batch (no
        // extra round trip), not as startup `options`, which PgBouncer
        // refuses (or, told to ignore them, drops).
        // The store writes the columns derived from `fields` itself, and
        // (unless behind a transaction-mode pooler, which could hand a
        // second transaction pipelined after the COMMIT to another
        // client) the feed's triggers record their notifications for
        // after the commit rather than sending them (`schema/v10.sql`).
        let begin = format!(
            "BEGIN; SET LOCAL synchronous_commit = on; SET LOCAL statement_timeout = {ms}; \
             SET LOCAL idle_in_transaction_session_timeout = {}; \
             SET LOCAL agentstate.writer = 'store'{}",
            ms.saturating_mul(2),
            if opts.statement_cache {
                "; SET LOCAL agentstate.notify = 'after_commit'"
            } else {
                ""
            }
        );
        if config.get_application_name().is_none() {
            config.application_name("agentstate");
        }
        config
            .keepalives(true)
            .keepalives_idle(Duration::from_secs(5))
            .keepalives_interval(Duration::from_secs(2))
            .keepalives_retries(3)
            .tcp_user_timeout(opts.statement_timeout + Duration::from_secs(5));
        let bridge = Arc::new(Bridge::new("agentstate-pg")?);
        let pool = deadpool::managed::Pool::builder(Manager {
            config,
            tls: tls
                .config
                .map(|c| tokio_postgres_rustls::MakeRustlsConnect::new((*c).clone())),
            bridge: bridge.clone(),
            max_lifetime: opts.max_lifetime,
            idle_timeout: opts.idle_timeout,
            replication: Arc::default(),
            statement_cache: opts.statement_cache,
        })
        // Dialed lazily: a store never used opened no connection. The
        // waits are the store's own (see `conn`).
        .max_size(opts.pool_size as usize)
        .build()
        .map_err(|e| StateError::invalid(format!("postgres: the pool: {e}")))?;
        if opts.idle_timeout.is_some() || opts.max_lifetime.is_some() {
            // Idle connections are looked at about every 30 s (a
            // connection in use is checked when it comes back).
            let weak = pool.weak();
            bridge.handle().spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    let Some(pool) = weak.upgrade() else { return };
                    pool.retain(|c, _| {
                        let m = pool.manager();
                        !(m.spent(c) || m.stale(c))
                    });
                }
            });
        }
        let store = PostgresStore {
            pool,
            bridge,
            begin,
            target,
            prefix: format!("\"{}\".", opts.schema),
            channel: feed::channel(&opts.schema),
            opts,
            secret: OnceLock::new(),
            display,
            runs_seen: runs::Seen::default(),
            spend_seen: budgets::Seen::default(),
            feed: Arc::default(),
        };
        if !store.opts.lazy {
            // One dial now, kept in the pool: the server's "no" (or its
            // absence) comes back from here, as the first call would
            // answer it.
            drop(store.bridge.block_on(store.conn())?);
        }
        Ok(store)
    }

    /// Creates the schema, its tables and indexes, once: idempotent, and
    /// safe when many workers run it at the same moment (it runs in one
    /// transaction under an advisory lock). Records the schema version; a
    /// database whose schema is newer than this build knows is refused with
    /// `UnsupportedFormat` and not touched.
    ///
    /// The tray tables `pinned_epoch` and `pinned_tray_index` are the
    /// seeds' own (pinned's `PostgresStateStore`), shared with it: either
    /// may set the database up first, or both at once. Tables of those
    /// names whose columns are not what pinned creates (say a `doc` of
    /// type text, made by another tool) are refused, `Refused` naming
    /// table, column and both types, and nothing is changed.
    pub fn setup(&self) -> Result<()> {
        self.bridge.block_on(self.setup_async())
    }

    /// [`setup`](Self::setup), for async code: awaits in the caller's
    /// task.
    pub async fn setup_async(&self) -> Result<()> {
        let schema = self.opts.schema.clone();
        let prefix = self.prefix.clone();
        txn!(self, |tx| {
            tx.execute_text(
                "SELECT pg_advisory_xact_lock(hashtext('agentstate setup ' || $1))",
                &[&schema],
            )
            .await?;
            // Not `CREATE SCHEMA IF NOT EXISTS`, which creates nothing but
            // still needs the CREATE privilege on the database.
            let exists = tx
                .query_text("SELECT 1 FROM pg_namespace WHERE nspname = $1", &[&schema])
                .await?
                .len()
                == 1;
            if !exists {
                tx.batch(&format!("CREATE SCHEMA \"{schema}\"")).await?;
            }
            let found = schema_version_in(tx, &prefix).await?;
            if found > SCHEMA_VERSION {
                return Err(StateError::UnsupportedFormat {
                    found,
                    supported: SCHEMA_VERSION,
                }
                .into());
            }
            check_pinned_tables(tx, &schema, found).await?;
            if found == 0 {
                tx.batch(&PINNED_TABLES.replace("{s}", &prefix)).await?;
            }
            for sql in &SCHEMA[found as usize..] {
                tx.batch(&sql.replace("{s}", &prefix)).await?;
            }
            tx.execute(
                "INSERT INTO {s}agentstate_meta (name, value) VALUES ('schema_version', $1) \
                 ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value",
                &[&SCHEMA_VERSION.to_string()],
            )
            .await?;
            // 16 random bytes (gen_random_uuid is built in since 13).
            tx.execute(
                "INSERT INTO {s}agentstate_meta (name, value) \
                 VALUES ('cursor_secret', replace(gen_random_uuid()::text, '-', '')) \
                 ON CONFLICT (name) DO NOTHING",
                &[],
            )
            .await?;
            Ok(())
        })?;
        // Rows from before schema 6 get their columns (their own
        // transactions, resumable).
        self.fill_fields().await?;
        Ok(())
    }

    /// The schema version the database holds (`None` before
    /// [`setup`](Self::setup)); reads only.
    pub fn schema_version(&self) -> Result<Option<u8>> {
        self.bridge.block_on(self.schema_version_async())
    }

    /// [`schema_version`](Self::schema_version), for async code.
    pub async fn schema_version_async(&self) -> Result<Option<u8>> {
        let prefix = self.prefix.clone();
        txn!(self, |tx| {
            tx.reads_only();
            let v = schema_version_in(tx, &prefix).await?;
            Ok((v > 0).then_some(v))
        })
    }

    fn now(&self) -> u64 {
        self.opts.options.clock.now_millis()
    }

    fn max(&self) -> usize {
        self.opts.options.record_bytes_max
    }

    /// The cursor secret, stored in the database so that a cursor from one
    /// worker pages on another.
    async fn secret(&self) -> Result<[u8; 16]> {
        if let Some(s) = self.secret.get() {
            return Ok(*s);
        }
        let hex: Option<String> = txn!(self, |tx| {
            tx.reads_only();
            Ok(tx
                .query(
                    "SELECT value FROM {s}agentstate_meta WHERE name = 'cursor_secret'",
                    &[],
                )
                .await?
                .first()
                .map(|r| r.col(0))
                .transpose()?)
        })?;
        let hex = hex.ok_or_else(|| {
            StateError::unavailable(
                "the database has no agentstate schema: run PostgresStore::setup() first",
                None,
            )
        })?;
        let secret = parse_secret(&hex)?;
        Ok(*self.secret.get_or_init(|| secret))
    }
}

/// The schema version stored under `prefix`, 0 when none.
async fn schema_version_in(tx: &mut Tx<'_>, prefix: &str) -> std::result::Result<u8, conn::Fail> {
    let table = format!("{prefix}agentstate_meta");
    let rows = tx
        .query_text("SELECT to_regclass($1) IS NOT NULL", &[&table])
        .await?;
    let exists: bool = match rows.first() {
        Some(r) => r.col(0)?,
        None => false,
    };
    if !exists {
        return Ok(0);
    }
    let rows = tx
        .query(
            "SELECT value FROM {s}agentstate_meta WHERE name = 'schema_version'",
            &[],
        )
        .await?;
    let Some(row) = rows.first() else {
        return Ok(0);
    };
    let v: String = row.col(0)?;
    Ok(v.parse::<u8>().map_err(|_| {
        StateError::corrupt(format!(
            "agentstate_meta: schema_version {v:?} is not a number"
        ))
    })?)
}

fn parse_secret(hex: &str) -> Result<[u8; 16]> {
    let bad = || StateError::corrupt("agentstate_meta: cursor_secret is not 32 hex digits");
    if hex.len() != 32 || !hex.is_ascii() {
        return Err(bad());
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
    }
    Ok(out)
}

/// An id as stored: text cannot hold NUL, so U+0001 escapes NUL (as
/// U+0001 U+0001) and itself (as U+0001 U+0002). The mapping keeps byte
/// order and is injective; ids without either character are stored as is.
pub(crate) fn id_in(s: &str) -> Cow<'_, str> {
    if !s.contains(['\0', '\u{1}']) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 4);
    for c in s.chars() {
        match c {
            '\0' => out.push_str("\u{1}\u{1}"),
            '\u{1}' => out.push_str("\u{1}\u{2}"),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// An id of a row another program may have written (the seeds' store,
/// plain SQL), as read back: [`id_out`] when the text is in this store's
/// escaped form, else the text as it is. Such a row is then listed under
/// that text (never dropped, never a failure); a point read with that id
/// reaches the row this store would write for it, which is another.
pub(crate) fn id_read(s: String) -> String {
    if !s.contains('\u{1}') {
        return s;
    }
    id_out(s.clone()).unwrap_or(s)
}

/// An id as read back (the inverse of [`id_in`]).
pub(crate) fn id_out(s: String) -> Result<String> {
    if !s.contains('\u{1}') {
        return Ok(s);
    }
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1}' {
            match chars.next() {
                Some('\u{1}') => out.push('\0'),
                Some('\u{2}') => out.push('\u{1}'),
                _ => return Err(StateError::corrupt(format!("stored id {s:?}: bad escape"))),
            }
        } else {
            out.push(c);
        }
    }
    Ok(out)
}

/// An id as stored, owned (a deferred write's parameter).
pub(crate) fn own(s: &str) -> String {
    id_in(s).into_owned()
}

/// A caller's epoch as the bigint parameter of `pinned_epoch.epoch`; every
/// tray call checks it first (`check_epoch`: at most `i64::MAX`).
pub(crate) fn epoch_in(epoch: u64) -> Result<i64> {
    agentstate_core::rules::check_epoch(epoch)?;
    i64::try_from(epoch).map_err(|_| StateError::invalid(format!("epoch {epoch}: past i64::MAX")))
}

/// A stored epoch as the store reports it: pinned may store a negative
/// one (its first acquire stores what its caller passed), which is below
/// every epoch this store accepts and reads as 0, as no row does (T2).
pub(crate) fn epoch_out(stored: i64) -> u64 {
    u64::try_from(stored).unwrap_or(0)
}

/// Reading a column without a panic: a value of another type (or a NULL
/// where one is not expected) is `Corrupt`, naming the column.
pub(crate) trait Col {
    fn col<'a, I, T>(&'a self, idx: I) -> Result<T>
    where
        I: tokio_postgres::row::RowIndex + std::fmt::Display + Copy,
        T: tokio_postgres::types::FromSql<'a>;
}

impl Col for tokio_postgres::Row {
    fn col<'a, I, T>(&'a self, idx: I) -> Result<T>
    where
        I: tokio_postgres::row::RowIndex + std::fmt::Display + Copy,
        T: tokio_postgres::types::FromSql<'a>,
    {
        self.try_get(idx)
            .map_err(|e| StateError::corrupt(format!("column {idx}: {e}")))
    }
}

/// The expected columns of the seeds' tray tables: table, column, type
/// (`format_type`), and the type schemas 1-8 gave it, which schema 9
/// converts.
const PINNED_COLUMNS: &[(&str, &str, &str, Option<&str>)] = &[
    ("pinned_epoch", "ns", "text", None),
    ("pinned_epoch", "id", "text", None),
    ("pinned_epoch", "epoch", "bigint", Some("numeric(20,0)")),
    ("pinned_tray_index", "ns", "text", None),
    ("pinned_tray_index", "id", "text", None),
    ("pinned_tray_index", "tray_ns", "text", None),
    ("pinned_tray_index", "tray_id", "text", None),
    ("pinned_tray_index", "marked", "boolean", None),
    ("pinned_tray_index", "doc", "jsonb", Some("bytea")),
    ("pinned_tray_index", "env", "text", None),
    ("pinned_tray_index", "hostname", "text", None),
];

/// setup()'s check of the seeds' tray tables as it finds them (before it
/// changes anything): each column pinned creates, of pinned's type (or,
/// in a database at schema `found` 1-8, of the type this store gave it
/// then), `doc_raw` (this store's) bytea, and pinned's primary keys. A
/// table made by another tool that differs is `Refused` (not retryable:
/// the table stays as it is), naming the table, the column, the type
/// found and the type expected.
async fn check_pinned_tables(tx: &mut Tx<'_>, schema: &str, found: u8) -> conn::TxResult<()> {
    let refuse = |what: String| -> conn::Fail {
        StateError::refused(
            format!(
                "postgres: schema {schema:?}: {what}; agentstate shares these tables with                  pinned's PostgresStateStore and needs them as pinned creates them                  (see crates/postgres/src/schema/pinned.sql): fix or rename the table, then run setup() again"
            ),
            None,
        )
        .into()
    };
    let rows = tx
        .query_text(
            "SELECT c.relname::text, c.relkind::text, a.attname::text,              format_type(a.atttypid, a.atttypmod)              FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace              LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped              WHERE n.nspname = $1 AND c.relname IN ('pinned_epoch', 'pinned_tray_index')",
            &[&schema],
        )
        .await?;
    let mut tables: std::collections::BTreeMap<String, Vec<(String, String)>> =
        std::collections::BTreeMap::new();
    for r in &rows {
        let table: String = r.col(0)?;
        let kind: String = r.col(1)?;
        if kind != "r" && kind != "p" {
            return Err(refuse(format!("{table} is not a table (relkind {kind:?})")));
        }
        let cols = tables.entry(table).or_default();
        if let (Some(name), Some(ty)) = (r.col::<_, Option<String>>(2)?, r.col(3)?) {
            cols.push((name, ty));
        }
    }
    let legacy_ok = (1..=8).contains(&found);
    for (table, column, want, legacy) in PINNED_COLUMNS {
        let Some(cols) = tables.get(*table) else {
            continue;
        };
        match cols.iter().find(|(n, _)| n == column) {
            None => {
                return Err(refuse(format!(
                    "{table} has no column {column} (expected {want})"
                )));
            }
            Some((_, ty)) if ty == want => {}
            Some((_, ty)) if legacy_ok && Some(ty.as_str()) == *legacy => {}
            Some((_, ty)) => {
                return Err(refuse(format!(
                    "column {table}.{column} is of type {ty}, expected {want}"
                )));
            }
        }
    }
    if let Some(cols) = tables.get("pinned_tray_index")
        && let Some((_, ty)) = cols.iter().find(|(n, _)| n == "doc_raw")
        && ty != "bytea"
    {
        return Err(refuse(format!(
            "column pinned_tray_index.doc_raw is of type {ty}, expected bytea"
        )));
    }
    let keys = tx
        .query_text(
            "SELECT c.relname::text, array_agg(a.attname::text ORDER BY k.ord)              FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid              JOIN pg_namespace n ON n.oid = c.relnamespace              CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)              JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = k.attnum              WHERE n.nspname = $1 AND c.relname IN ('pinned_epoch', 'pinned_tray_index')              AND i.indisprimary GROUP BY c.relname",
            &[&schema],
        )
        .await?;
    for (table, want) in [
        ("pinned_epoch", &["ns", "id"][..]),
        ("pinned_tray_index", &["ns", "id", "tray_ns", "tray_id"][..]),
    ] {
        if !tables.contains_key(table) {
            continue;
        }
        let mut got: Option<Vec<String>> = None;
        for r in &keys {
            if r.col::<_, String>(0)? == table {
                got = Some(r.col(1)?);
            }
        }
        if got.as_deref().is_none_or(|g| g != want) {
            return Err(refuse(format!(
                "{table}'s primary key is {}, expected ({})",
                got.map_or("missing".to_string(), |g| format!("({})", g.join(", "))),
                want.join(", ")
            )));
        }
    }
    Ok(())
}

/// A u64 as a numeric(20,0) parameter (`$n::text::numeric` in SQL).
pub(crate) fn num(n: u64) -> String {
    n.to_string()
}

/// A numeric(20,0) read back as text (`col::text` in SQL).
pub(crate) fn num_out(s: &str, what: &str) -> Result<u64> {
    s.parse()
        .map_err(|_| StateError::corrupt(format!("{what}: {s:?} is not a u64")))
}

const _: () = {
    const fn is_send_sync<T: Send + Sync>() {}
    is_send_sync::<PostgresStore>();
};

/// The binding of a listing over one tenant's records keyed by one id
/// (sessions, budgets), and the id the page's cursor ends at, if any.
pub(crate) fn tenant_cursor(
    secret: &[u8; 16],
    listing: agentstate_core::codec::cursor::Listing,
    tenant: &str,
    page: &agentstate_core::page::PageRequest,
) -> Result<(Vec<u8>, Option<String>)> {
    use agentstate_core::codec::key::{KeyBuf, KeyReader};
    let binding = KeyBuf::table(listing as u8).str(tenant).done();
    let after = page
        .cursor
        .as_ref()
        .map(|c| {
            let pos = agentstate_core::codec::cursor::decode(secret, listing, &binding, c)?;
            let mut r = KeyReader::new(&pos, listing as u8)?;
            let s = r.str()?;
            r.end()?;
            Ok::<_, StateError>(s)
        })
        .transpose()?;
    Ok((binding, after))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_keep_order() {
        let ids = [
            "", "a", "a\0", "a\0b", "a\u{1}", "a\u{1}b", "a\u{2}", "\0", "b", "é",
        ];
        for a in ids {
            assert_eq!(id_out(id_in(a).into_owned()).unwrap(), a);
            assert!(!id_in(a).contains('\0'));
            for b in ids {
                assert_eq!(
                    a.cmp(b),
                    id_in(a).as_bytes().cmp(id_in(b).as_bytes()),
                    "{a:?} {b:?}"
                );
            }
        }
        assert!(id_out("a\u{1}x".into()).is_err());
        assert!(id_out("a\u{1}".into()).is_err());
    }

    #[test]
    fn schema_names() {
        assert!(valid_schema("public") && valid_schema("_a1"));
        for bad in ["", "A", "1a", "a-b", "a\"b", &"a".repeat(64)] {
            assert!(!valid_schema(bad), "{bad:?}");
        }
    }

    #[test]
    fn connect_dials_unless_lazy_and_checks_input() {
        // Nothing listens on port 1: a lazy connect still succeeds, an
        // eager one is Unavailable after its connect timeout.
        assert!(
            PostgresStore::connect_with("postgres://u@127.0.0.1:1/db", PgOptions::new().lazy(true))
                .is_ok()
        );
        let e = PostgresStore::connect_with(
            "postgres://u@127.0.0.1:1/db",
            PgOptions::new().connect_timeout(Duration::from_millis(50)),
        )
        .expect_err("nothing listens");
        assert!(e.is_retryable(), "{e:?}");
        assert!(matches!(
            PostgresStore::connect("postgres://u@h:notaport/db"),
            Err(StateError::Invalid { .. })
        ));
        assert!(matches!(
            PostgresStore::connect_with("host=h", PgOptions::new().schema("Bad")),
            Err(StateError::Invalid { .. })
        ));
    }
}
