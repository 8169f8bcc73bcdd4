//! The Redis backend (feature `redis`): every write is one Lua script run
//! on the server, so its checks (versions, amounts, epochs) and all of its
//! writes (the record, its indexes, the tenant's `seq`) are one atomic step.
//! Nothing is read by the client and then written.
//!
//! # Keys and hash tags
//!
//! Every key of one tenant carries the hash tag `{t<tenant>}` (the tenant
//! escaped as in the key codec), so every run and session script touches
//! one slot. Trays, epochs and alarms all carry the one tag `{trays}`:
//! the sweeper's index of marked trays and the index of alarms by due
//! time span every instance and are written in the same script as the
//! tray or alarm, so they must share its slot. On a Redis Cluster that
//! puts all tray traffic on one node (runs and sessions spread by tenant);
//! the scripts need no change. Two keys in `{meta}` hold the cursor secret
//! and the tenant registry (a superset of the tenants with records, written
//! before a tenant's first write and read only by admin walks).
//!
//! | key | type | holds |
//! |---|---|---|
//! | `as:{t…}:r:<run_id>` | hash | `v` record, its mirrors (`ver`, `seq`, `st`, `ss`, `ag`, `ca`, `ua`, amounts), `hl`/`hc` head length and CRC |
//! | `as:{t…}:seq` | string | the tenant's `seq` counter (`INCR`) |
//! | `as:{t…}:runs`, `:st:<tag>`, `:ss:<session>` | sorted set | run ids by `seq`: all, by state, by session |
//! | `as:{t…}:s:<session_id>`, `:sessions` | hash, sorted set | sessions; their ids (by id) |
//! | `as:{t…}:ik`, `:io` | hash, sorted set | idempotency keys (key → fingerprint, time, reply); the keys by ordinal |
//! | `as:{trays}:i:<inst>` | hash | `ep` epoch, `al` due_at, `am` its due-index member |
//! | `as:{trays}:y:<inst><tray>` | hash | `v` tray, `m` marked, `e` env, `h` hostname |
//! | `as:{trays}:yz:<inst>`, `:ym:<inst>` | sorted set | an instance's trays, its marked trays |
//! | `as:{trays}:m`, `:me:<env>` | sorted set | marked trays of all instances, of one env |
//! | `as:{trays}:a` | sorted set | alarms by (due_at, ns, id) |
//! | `as:{trays}:insts` | sorted set | every instance with an epoch, tray or alarm |
//! | `as:{trays}:ik:<ns>`, `:io:<ns>` | hash, sorted set | an instance namespace's idempotency keys, as a tenant's |
//!
//! The idempotency keys are no records: no index names them, so export,
//! `verify` and `stats` (which walk the indexes) never see them.
//!
//! # Records
//!
//! A stored value is the crate's codec (format byte, postcard, CRC-32,
//! checked on every read) of a layout whose store-owned fields come last:
//! the client encodes the head (everything the caller gives) and its CRC;
//! the script appends the tail (amounts, version, timestamps, `seq`, a
//! tray's marked flag) and finishes the CRC over it. u64 arithmetic in the
//! scripts is exact (decimal strings, two 32-bit limbs), never Lua doubles.

mod admin;
mod budgets;
mod keys;
mod runs;
mod scripts;
mod trays;

use std::collections::HashSet;
use std::time::Duration;

use parking_lot::Mutex;

use crate::error::{Result, StateError};
use crate::options::Options;

/// How a [`RedisStore`] connects: the common [`Options`] (clock, record
/// limit, scrubber), timeouts, the pool's size, and whether to refuse a
/// server that could lose acknowledged writes.
///
/// ```
/// use std::time::Duration;
/// use agentstate::{Options, RedisOptions};
/// let opts = RedisOptions::new()
///     .options(Options::new().record_bytes_max(256 * 1024))
///     .pool_size(16)
///     .io_timeout(Duration::from_secs(2))
///     .require_fsync(true);
/// # let _ = opts;
/// ```
#[derive(Debug, Clone)]
pub struct RedisOptions {
    pub(crate) options: Options,
    pub(crate) connect_timeout: Duration,
    pub(crate) io_timeout: Duration,
    pub(crate) pool_size: u32,
    pub(crate) require_fsync: bool,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            options: Options::default(),
            connect_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(10),
            pool_size: 16,
            require_fsync: true,
        }
    }
}

impl RedisOptions {
    /// Default options: 5 s to connect, 10 s per command, 16 connections,
    /// `require_fsync(true)`.
    pub fn new() -> Self {
        Self::default()
    }
    /// The options every backend reads (clock, record limit, scrubber).
    /// The file store's durability and salvage options mean nothing here.
    pub fn options(mut self, options: Options) -> Self {
        self.options = options;
        self
    }
    /// How long opening a connection (or waiting for a free one in the
    /// pool) may take before the call is `Unavailable`.
    pub fn connect_timeout(mut self, t: Duration) -> Self {
        self.connect_timeout = t.max(Duration::from_millis(1));
        self
    }
    /// How long one command or script may take to answer. Past it a read
    /// is `Unavailable`, and a write, sent and maybe applied, is
    /// `OutcomeUnknown`: re-read before deciding again, or retry it with
    /// the same idempotency key (rule I7).
    pub fn io_timeout(mut self, t: Duration) -> Self {
        self.io_timeout = t.max(Duration::from_millis(1));
        self
    }
    /// Connections kept open (at least 1).
    pub fn pool_size(mut self, n: u32) -> Self {
        self.pool_size = n.max(1);
        self
    }
    /// With `true` (the default), [`RedisStore::connect_with`] refuses a
    /// server that would lose acknowledged writes in a crash: one without
    /// `appendonly yes` and `appendfsync always`, or one whose settings
    /// cannot be read. With `false` it connects anyway and
    /// [`StoreStats::backend`](crate::StoreStats) says what an `Ok` survives.
    pub fn require_fsync(mut self, require: bool) -> Self {
        self.require_fsync = require;
        self
    }
}

/// The server's persistence settings, as read at connect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Persistence {
    appendonly: String,
    appendfsync: String,
}

impl Persistence {
    fn survives_crash(&self) -> bool {
        self.appendonly == "yes" && self.appendfsync == "always"
    }

    fn describe(&self) -> String {
        if self.survives_crash() {
            "appendonly yes, appendfsync always: every Ok was fsynced to the append-only file"
                .to_string()
        } else if self.appendonly == "yes" {
            format!(
                "appendonly yes, appendfsync {}: a server crash can lose the last acknowledged writes",
                self.appendfsync
            )
        } else {
            "appendonly no: a server crash loses every write since the last snapshot".to_string()
        }
    }
}

/// Opens connections with the store's timeouts; r2d2 pools them.
#[derive(Debug)]
struct Manager {
    client: ::redis::Client,
    connect_timeout: Duration,
    io_timeout: Duration,
}

impl r2d2::ManageConnection for Manager {
    type Connection = ::redis::Connection;
    type Error = ::redis::RedisError;

    fn connect(&self) -> std::result::Result<Self::Connection, Self::Error> {
        let c = self
            .client
            .get_connection_with_timeout(self.connect_timeout)?;
        c.set_read_timeout(Some(self.io_timeout))?;
        c.set_write_timeout(Some(self.io_timeout))?;
        Ok(c)
    }

    fn is_valid(&self, conn: &mut Self::Connection) -> std::result::Result<(), Self::Error> {
        ::redis::cmd("PING").query::<String>(conn).map(|_| ())
    }

    fn has_broken(&self, conn: &mut Self::Connection) -> bool {
        !::redis::ConnectionLike::is_open(conn)
    }
}

type Conn = r2d2::PooledConnection<Manager>;

/// The Redis backend: every rule of the contract, with each write one Lua
/// script on the server. Share one handle between threads; it holds a pool
/// of connections.
///
/// An `Ok` survives a server crash only when the server runs with
/// `appendonly yes` and `appendfsync always`; by default
/// [`connect`](RedisStore::connect) refuses any other server (see
/// [`RedisOptions::require_fsync`]).
///
/// ```no_run
/// use agentstate::{RedisStore, RunKey, RunRecord, StateStore};
/// let store = RedisStore::connect("redis://127.0.0.1:6379/0")?;
/// store.put_run(RunRecord::new(RunKey::new("acme", "run_1"), "planner"))?;
/// # Ok::<(), agentstate::StateError>(())
/// ```
pub struct RedisStore {
    pool: r2d2::Pool<Manager>,
    opts: RedisOptions,
    secret: [u8; 16],
    persistence: Persistence,
    /// Where the server is, without a password, for messages.
    server: String,
    /// Tenants this handle has put in the registry already.
    registered: Mutex<HashSet<String>>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("server", &self.server)
            .field("persistence", &self.persistence)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Connects with default options (`require_fsync(true)`).
    pub fn connect(url: &str) -> Result<RedisStore> {
        Self::connect_with(url, RedisOptions::default())
    }

    /// Connects to the server at `url` (`redis://[user:password@]host:port/db`),
    /// reads its persistence settings (refusing, with `require_fsync`, a
    /// server that could lose acknowledged writes), and loads or creates
    /// the store's cursor secret on the server.
    pub fn connect_with(url: &str, opts: RedisOptions) -> Result<RedisStore> {
        let server = redact(url);
        let client = ::redis::Client::open(url)
            .map_err(|e| StateError::invalid(format!("redis url {server}: {e}")))?;
        let pool = r2d2::Pool::builder()
            .max_size(opts.pool_size)
            .min_idle(Some(1))
            .connection_timeout(opts.connect_timeout)
            .test_on_check_out(false)
            .error_handler(Box::new(r2d2::NopErrorHandler))
            .build(Manager {
                client,
                connect_timeout: opts.connect_timeout,
                io_timeout: opts.io_timeout,
            })
            .map_err(|e| {
                StateError::unavailable(format!("redis {server}: cannot connect: {e}"), None)
            })?;
        let mut conn = pool.get().map_err(|e| {
            StateError::unavailable(format!("redis {server}: cannot connect: {e}"), None)
        })?;
        let persistence = read_persistence(&mut conn, &server, opts.require_fsync)?;
        if opts.require_fsync && !persistence.survives_crash() {
            return Err(StateError::unavailable(
                format!(
                    "redis {server}: {}; refusing to connect because RedisOptions::require_fsync is on: \
                     run the server with `appendonly yes` and `appendfsync always` \
                     (CONFIG SET appendonly yes; CONFIG SET appendfsync always; and in redis.conf), \
                     or connect with require_fsync(false) to accept the loss",
                    persistence.describe()
                ),
                None,
            ));
        }
        let secret = load_secret(&mut conn)?;
        drop(conn);
        Ok(RedisStore {
            pool,
            opts,
            secret,
            persistence,
            server,
            registered: Mutex::new(HashSet::new()),
        })
    }

    /// What an `Ok` survives on this server, as read at connect.
    pub fn durability(&self) -> String {
        self.persistence.describe()
    }

    fn conn(&self) -> Result<Conn> {
        self.pool.get().map_err(|e| {
            StateError::unavailable(format!("redis {}: no connection: {e}", self.server), None)
        })
    }

    fn now(&self) -> u64 {
        self.opts.options.clock.now_millis()
    }

    fn max(&self) -> usize {
        self.opts.options.record_bytes_max
    }

    /// Puts the tenant in the registry before its first write (idempotent;
    /// the registry is a superset of the tenants with records).
    fn register(&self, conn: &mut Conn, tenant: &str) -> Result<()> {
        if self.registered.lock().contains(tenant) {
            return Ok(());
        }
        ::redis::cmd("ZADD")
            .arg(keys::TENANTS)
            .arg(0)
            .arg(tenant)
            .query::<i64>(&mut **conn)
            .map_err(map_err)?;
        self.registered.lock().insert(tenant.to_string());
        Ok(())
    }
}

fn read_persistence(conn: &mut Conn, server: &str, require: bool) -> Result<Persistence> {
    let read = |conn: &mut Conn, name: &str| -> std::result::Result<String, ::redis::RedisError> {
        let pair: Vec<String> = ::redis::cmd("CONFIG")
            .arg("GET")
            .arg(name)
            .query(&mut **conn)?;
        Ok(pair.get(1).cloned().unwrap_or_default())
    };
    match (read(conn, "appendonly"), read(conn, "appendfsync")) {
        (Ok(appendonly), Ok(appendfsync)) => Ok(Persistence {
            appendonly,
            appendfsync,
        }),
        (Err(e), _) | (_, Err(e)) if e.is_io_error() || e.is_timeout() => Err(map_err(e)),
        (Err(e), _) | (_, Err(e)) => {
            if require {
                Err(StateError::unavailable(
                    format!(
                        "redis {server}: cannot read appendonly/appendfsync ({e}); \
                         refusing to connect because RedisOptions::require_fsync is on \
                         (allow CONFIG GET, or connect with require_fsync(false))"
                    ),
                    None,
                ))
            } else {
                Ok(Persistence {
                    appendonly: "unknown".into(),
                    appendfsync: "unknown".into(),
                })
            }
        }
    }
}

/// The store's cursor secret lives on the server, so every client of one
/// store accepts the others' cursors; the first client to connect makes it.
fn load_secret(conn: &mut Conn) -> Result<[u8; 16]> {
    let fresh = crate::kv::new_secret();
    ::redis::cmd("SET")
        .arg(keys::SECRET)
        .arg(&fresh[..])
        .arg("NX")
        .query::<Option<String>>(&mut **conn)
        .map_err(map_err)?;
    let got: Vec<u8> = ::redis::cmd("GET")
        .arg(keys::SECRET)
        .query(&mut **conn)
        .map_err(map_err)?;
    got.try_into()
        .map_err(|_| StateError::corrupt("redis: the cursor secret is not 16 bytes"))
}

/// `redis://user:secret@host` → `redis://user:***@host`.
fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (auth, tail) = rest.split_at(end);
    match auth.rsplit_once('@') {
        Some((user, host)) => {
            let user = user.split_once(':').map_or(user, |(u, _)| u);
            format!("{scheme}://{user}:***@{host}{tail}")
        }
        None => url.to_string(),
    }
}

/// A Redis failure as the crate's error: a server that cannot be reached,
/// a dropped connection, a timeout, or a server refusing writes (`OOM`,
/// `MISCONF`, `BUSY`, `LOADING`, `READONLY`, …) is `Unavailable`
/// (retryable); anything else (a script error, a key of the wrong type) is
/// `Corrupt`. A write script's failure after it was sent is not this
/// function's: see `scripts::Call::invoke` (`OutcomeUnknown`).
pub(crate) fn map_err(e: ::redis::RedisError) -> StateError {
    const RETRYABLE: &[&str] = &[
        "OOM",
        "MISCONF",
        "BUSY",
        "LOADING",
        "READONLY",
        "MASTERDOWN",
        "TRYAGAIN",
        "CLUSTERDOWN",
        "NOREPLICAS",
        "NOSCRIPT",
    ];
    let transient = e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.code().is_some_and(|c| RETRYABLE.contains(&c))
        || e.to_string().contains("OOM command not allowed");
    if transient {
        let detail = format!("redis: {e}");
        StateError::unavailable(detail, Some(std::io::Error::other(e)))
    } else {
        StateError::corrupt(format!("redis: {e}"))
    }
}

const _: () = {
    const fn is_send_sync<T: Send + Sync>() {}
    is_send_sync::<RedisStore>();
};
