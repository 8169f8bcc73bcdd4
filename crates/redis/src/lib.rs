//! agentstate's Redis backend (the `agentstate` facade's feature `redis`,
//! which re-exports it): every write is one Lua script run
//! on the server, so its checks (versions, amounts, epochs) and all of its
//! writes (the record, its indexes, the tenant's `seq`) are one atomic step.
//! Nothing is read by the client and then written.
//!
//! # Async-native
//!
//! Every call is an `async fn` of [`AsyncCore`](agentstate_core::native::AsyncCore)
//! (`core.rs`) over redis-rs' async client: a small pool of
//! `MultiplexedConnection`s (`connect.rs`, `connect::Pool`) dialed on
//! the store's own runtime ([`Bridge`]), each script sent as `EVALSHA`
//! and loaded with `Script::load_async` when the server answers
//! `NOSCRIPT` (`scripts.rs`). `AsyncStore` awaits those futures in the
//! caller's task; the synchronous traits are `sync_over_async!` impls that
//! drive them on the calling thread (`Bridge::block_on`), and
//! `StoreAdmin` does the same over its own async walks (`admin.rs`). A
//! synchronous call runs on a blocking connection of the pool's own
//! (`connect::Link::Own`), read and written by the calling thread: the
//! same code, without the multiplexed connection's two thread hops.
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
//! | `as:{t…}:r:<run_id>` | hash | `v` record, its mirrors (`ver`, `seq`, `st`, `ss`, `ag`, `ca`, `ua`, amounts), `hl`/`hc` head length and CRC, `lb` its label suffixes (absent with no labels) |
//! | `as:{t…}:seq` | string | the tenant's `seq` counter (`INCR`) |
//! | `as:{t…}:runs`, `:st:<tag>`, `:ss:<session>` | sorted set | run ids by `seq`: all, by state, by session |
//! | `as:{t…}:lb:<#key>:<key><value>` | sorted set | run ids by `seq` carrying one label (R11; the value's canonical JSON) |
//! | `as:{t…}:s:<session_id>`, `:sessions` | hash, sorted set | sessions; their ids (by id) |
//! | `as:{t…}:ik`, `:io` | hash, sorted set | idempotency keys (key → fingerprint, time, reply); the keys by ordinal |
//! | `as:{trays}:i:<inst>` | hash | `ep` epoch, `al` due_at, `am` its due-index member |
//! | `as:{trays}:y:<inst><tray>` | hash | `v` tray, `m` marked, `e` env, `h` hostname |
//! | `as:{trays}:yz:<inst>`, `:ym:<inst>` | sorted set | an instance's trays, its marked trays |
//! | `as:{trays}:m`, `:me:<env>` | sorted set | marked trays of all instances, of one env |
//! | `as:{trays}:a` | sorted set | alarms by (due_at, ns, id) |
//! | `as:{trays}:insts` | sorted set | every instance with an epoch, tray or alarm |
//! | `as:{trays}:ik:<ns>`, `:io:<ns>` | hash, sorted set | an instance namespace's idempotency keys, as a tenant's |
//! | `as:{t…}:fd`, `as:{trays}:fd` | sorted set | a change feed (`feed.rs`): run and session members, or tray and alarm members, by position |
//! | `…:fd:n`, `…:fd:h` | string | a feed's counter (`INCR`), its horizon (kept by a purge) |
//! | `as:{trays}:fd:e:<env>`, `:fd:g` | sorted set, hash | one env's trays by position; a deleted tray's last env |
//!
//! A write that changes a feed also publishes on `…:fd:c` (an env's trays
//! on `as:{trays}:fd:c:<env>`), a channel, not a key.
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
//!
//! A run's or session's head is format 1 without labels (the layout before
//! them, byte for byte) and format 2 with them: format 1's head fields,
//! then the labels (R11). The scripts never read the format byte; they
//! keep a run's label indexes in step from its `lb` field.

// No unsafe code in this crate.
#![forbid(unsafe_code)]
// Every public item is documented; the docs are part of the contract.
#![warn(missing_docs)]
// Operating errors are handled, never unwrapped, outside tests: each
// remaining `expect` states the invariant that makes it unreachable.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

mod admin;
mod budgets;
mod connect;
mod feed;
mod keys;
mod runs;
mod scripts;
mod sentinel;
mod trays;

// The store's calls: its `AsyncCore` (each call an inherent `async fn` of
// the same name, in `runs.rs`, `trays.rs`, `budgets.rs`, `feed.rs` and
// `admin.rs`, inside a span and metrics) and its synchronous traits over
// it, generated from the one list of calls (`agentstate_core::calls`).
agentstate_core::impl_async_core!(RedisStore, "redis");

use std::collections::HashSet;
use std::time::Duration;

use parking_lot::Mutex;

use agentstate_core::error::{Result, StateError};
use agentstate_core::options::Options;

use agentstate_core::native::Bridge;

use connect::{Dialer, TlsPems};

/// How a [`RedisStore`] connects: the common [`Options`] (clock, record
/// limit, scrubber), TLS certificates, timeouts, how many connections it
/// multiplexes its calls over and their lifetimes, and what the server
/// must guarantee.
///
/// ```
/// use std::time::Duration;
/// use agentstate::{Options, RedisOptions};
/// let ca = std::fs::read("ca.pem").unwrap_or_default();
/// let opts = RedisOptions::new()
///     .options(Options::new().record_bytes_max(256 * 1024))
///     .tls_ca_pem(ca) // for rediss:// URLs
///     .pool_size(16)
///     .idle_timeout(Some(Duration::from_secs(300)))
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
    pub(crate) idle_timeout: Option<Duration>,
    pub(crate) max_lifetime: Option<Duration>,
    pub(crate) require_fsync: bool,
    pub(crate) tls: Option<TlsPems>,
    pub(crate) assumed: Option<Assumed>,
    pub(crate) settings_interval: Duration,
    pub(crate) lazy: bool,
    /// `WAIT` after every write: this many replicas, within this long.
    pub(crate) wait_replicas: Option<(u32, Duration)>,
}

/// What the caller states a server guarantees when `CONFIG GET` cannot
/// be read (see [`RedisOptions::durability_assumed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Assumed {
    pub(crate) noeviction: bool,
    pub(crate) appendfsync_always: bool,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            options: Options::default(),
            connect_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(10),
            pool_size: 16,
            idle_timeout: Some(Duration::from_secs(10 * 60)),
            max_lifetime: Some(Duration::from_secs(30 * 60)),
            require_fsync: true,
            tls: None,
            assumed: None,
            settings_interval: Duration::from_secs(1),
            lazy: false,
            wait_replicas: None,
        }
    }
}

impl RedisOptions {
    /// Default options: 5 s to connect, 10 s per command, 16 connections
    /// closed after 10 minutes idle or 30 minutes open, `require_fsync(true)`,
    /// TLS (for `rediss://`) trusting the built-in web PKI roots, no
    /// durability statement, not lazy.
    pub fn new() -> Self {
        Self::default()
    }
    /// The options every backend reads (clock, record limit, scrubber).
    /// The file store's durability and salvage options mean nothing here.
    pub fn options(mut self, options: Options) -> Self {
        self.options = options;
        self
    }
    /// How long opening a connection (TCP, TLS, `AUTH`, `SELECT`) may
    /// take before the call is `Unavailable` (nothing was sent). A call
    /// waits for a dial only when the store has no open connection. A
    /// server that answers "no" (a wrong password, a certificate it
    /// refuses, …) is `Refused` as soon as it answers, not after this.
    pub fn connect_timeout(mut self, t: Duration) -> Self {
        self.connect_timeout = t.max(Duration::from_millis(1));
        self
    }
    /// How long one command or script may take to answer (redis-rs'
    /// response timeout). Past it a read is `Unavailable`, and a write,
    /// sent and maybe applied, is `OutcomeUnknown`: re-read before
    /// deciding again, or retry it with the same idempotency key (rule
    /// I7). The connection it timed out on takes no further call.
    pub fn io_timeout(mut self, t: Duration) -> Self {
        self.io_timeout = t.max(Duration::from_millis(1));
        self
    }
    /// At most this many connections of each kind (at least 1). Async
    /// calls (`AsyncStore`) run on redis-rs multiplexed connections, each
    /// carrying any number of calls at once: a call takes the one with
    /// the fewest calls in flight, and one more is opened (in the
    /// background) only while every open one is busy. Synchronous calls
    /// run on blocking connections, one call at a time each, kept between
    /// calls (so `n` threads calling at once keep up to `n`); when all
    /// `pool_size` are taken a call runs on a multiplexed one. A store
    /// used by one synchronous caller at a time keeps two connections
    /// (the multiplexed one it checked the server on, and the caller's).
    pub fn pool_size(mut self, n: u32) -> Self {
        self.pool_size = n.max(1);
        self
    }
    /// A connection idle this long is closed (one is always kept);
    /// `None` keeps idle connections. Default 10 minutes: below a managed
    /// service's or a firewall's idle cut-off, set it lower.
    pub fn idle_timeout(mut self, t: Option<Duration>) -> Self {
        self.idle_timeout = t.map(|t| t.max(Duration::from_millis(1)));
        self
    }
    /// A connection open this long takes no new call and is closed once
    /// its calls in flight are answered (a new one is dialed when needed);
    /// `None` keeps it. Default 30 minutes.
    pub fn max_lifetime(mut self, t: Option<Duration>) -> Self {
        self.max_lifetime = t.map(|t| t.max(Duration::from_millis(1)));
        self
    }
    /// For `rediss://` URLs: trust the CA certificate(s) in `pem` (PEM
    /// bytes) instead of the built-in web PKI roots, as for a server whose
    /// certificate a private CA signed. A `rediss://…/#insecure` URL turns
    /// certificate checks off altogether (tests only).
    pub fn tls_ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls.get_or_insert_with(TlsPems::default).ca = Some(pem.into());
        self
    }
    /// For `rediss://` URLs to a server that asks for a client certificate
    /// (mutual TLS, `tls-auth-clients yes`): the certificate chain and its
    /// private key, PEM bytes. Never printed.
    pub fn tls_client_pem(mut self, cert: impl Into<Vec<u8>>, key: impl Into<Vec<u8>>) -> Self {
        self.tls.get_or_insert_with(TlsPems::default).client = Some((cert.into(), key.into()));
        self
    }
    /// With `true` (the default), [`RedisStore::connect_with`] refuses a
    /// server that would lose acknowledged writes in a crash: one without
    /// `appendonly yes` and `appendfsync always`. With `false` it connects
    /// anyway and [`StoreStats::backend`](agentstate_core::StoreStats) says what an
    /// `Ok` survives. Either way a server that may evict keys
    /// (`maxmemory-policy` other than `noeviction`) is refused.
    pub fn require_fsync(mut self, require: bool) -> Self {
        self.require_fsync = require;
        self
    }
    /// The caller's statement of what a server guarantees, for a managed
    /// service whose `CONFIG GET` is disabled (or an ACL user without
    /// `+config|get`): `noeviction`, it never evicts keys; and
    /// `appendfsync_always`, it fsyncs every acknowledged write. Used only
    /// when `CONFIG GET` fails; a server that answers it is checked instead.
    ///
    /// Without it such a server is refused. With `noeviction` false it is
    /// refused too (a server that may evict keys loses records silently);
    /// with `appendfsync_always` false it is refused while
    /// [`require_fsync`](Self::require_fsync) is on.
    /// [`RedisStore::durability`] says which settings were read and which
    /// stated.
    ///
    /// ```
    /// # use agentstate::RedisOptions;
    /// // A service documented as noeviction with fsync on every write:
    /// let opts = RedisOptions::new().durability_assumed(true, true);
    /// # let _ = opts;
    /// ```
    pub fn durability_assumed(mut self, noeviction: bool, appendfsync_always: bool) -> Self {
        self.assumed = Some(Assumed {
            noeviction,
            appendfsync_always,
        });
        self
    }
    /// How old the store's reading of the server's settings
    /// (`maxmemory-policy`, `appendonly`, `appendfsync`) may be when it
    /// writes (default 1 s). A write finding it older reads them again
    /// first (one round trip); while they are unsafe (a policy that evicts
    /// keys; no fsync on every write under
    /// [`require_fsync`](Self::require_fsync)) every write is `Refused`,
    /// naming the setting, and nothing is written. `Duration::ZERO`
    /// reads them before every write. Settings stated with
    /// [`durability_assumed`](Self::durability_assumed) are not read again.
    pub fn settings_interval(mut self, interval: Duration) -> Self {
        self.settings_interval = interval;
        self
    }
    /// With `false` (the default), [`RedisStore::connect_with`] dials the
    /// server once and checks it before it returns: a wrong password, a
    /// certificate that does not verify, a `redis://` URL to a TLS-only
    /// port (or `rediss://` to a plain one), a server that may evict keys
    /// are `Refused` at once, and a server not reached within the connect
    /// timeout is `Unavailable`. With `true` it opens nothing: the first
    /// call dials and checks, and answers those same errors; use it for a
    /// server that may not be up yet when the store is made. PostgreSQL's
    /// store has the same option (`PgOptions::lazy`).
    pub fn lazy(mut self, lazy: bool) -> Self {
        self.lazy = lazy;
        self
    }
    /// Makes every write wait, after its script ran on the master, until
    /// `replicas` replicas have it (`WAIT replicas timeout`), so that an
    /// `Ok` survives losing the master to a failover (Sentinel promotes a
    /// replica that has it). A write the replicas did not all confirm
    /// within `timeout` answers `OutcomeUnknown` (it is on the master and
    /// may or may not survive a failover): retry it with its idempotency
    /// key, which answers the first outcome and waits again. At connect
    /// the master must have at least `replicas` replicas connected
    /// (`INFO replication`'s `connected_slaves`), else `Refused`, naming
    /// both. One more round trip per write, which waits for the replica.
    /// `replicas` 0 turns it off (the default).
    pub fn wait_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.wait_replicas =
            (replicas > 0).then_some((replicas, timeout.max(Duration::from_millis(1))));
        self
    }
}

/// The store's latest reading of the server's settings, for writes.
#[derive(Debug)]
struct Settings {
    /// When they were last read (at connect, checked); `None`: read them
    /// at the next write.
    read_at: Option<std::time::Instant>,
    /// The pool's dial count at that reading: a connection opened since
    /// (perhaps to a server restarted with other settings) makes the
    /// next write read them again.
    dials: u64,
    /// Why writes are refused, while the settings are unsafe.
    refusal: Option<String>,
}

/// The server's persistence and eviction settings, as read at connect
/// (or as the caller stated them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Persistence {
    appendonly: String,
    appendfsync: String,
    maxmemory_policy: String,
    /// `Some(why CONFIG GET failed)` when the settings are the caller's
    /// statement ([`RedisOptions::durability_assumed`]), not read.
    stated: Option<String>,
}

impl Persistence {
    fn survives_crash(&self) -> bool {
        self.appendonly == "yes" && self.appendfsync == "always"
    }

    fn describe(&self) -> String {
        let fsync = if self.survives_crash() {
            "appendonly yes, appendfsync always: every Ok was fsynced to the append-only file"
                .to_string()
        } else if self.appendonly == "unknown" {
            "appendfsync unknown: a server crash may lose acknowledged writes".to_string()
        } else if self.appendonly == "yes" {
            format!(
                "appendonly yes, appendfsync {}: a server crash can lose the last acknowledged writes",
                self.appendfsync
            )
        } else {
            "appendonly no: a server crash loses every write since the last snapshot".to_string()
        };
        match &self.stated {
            None => format!(
                "{fsync}; maxmemory-policy {} (read with CONFIG GET)",
                self.maxmemory_policy
            ),
            Some(why) => format!(
                "{fsync}; maxmemory-policy {} (stated by the caller with \
                 RedisOptions::durability_assumed, not checked: CONFIG GET failed: {why})",
                self.maxmemory_policy
            ),
        }
    }
}

pub(crate) use connect::Conn;

/// The Redis backend: every rule of the contract, with each write one Lua
/// script on the server. Share one handle between threads and tasks.
///
/// An `Ok` survives a server crash only when the server runs with
/// `appendonly yes` and `appendfsync always`; by default
/// [`connect`](RedisStore::connect) refuses any other server (see
/// [`RedisOptions::require_fsync`]), and always one that may evict keys.
///
/// ```no_run
/// use agentstate::{RedisStore, RunKey, RunRecord, StateStore};
/// let store = RedisStore::connect("redis://127.0.0.1:6379/0")?;
/// store.put_run(RunRecord::new(RunKey::new("acme", "run_1"), "planner"))?;
/// # Ok::<(), agentstate::StateError>(())
/// ```
///
/// # Async-native
///
/// The store is written once, as async code over redis-rs' async client
/// (`MultiplexedConnection`s, scripts sent with `EVALSHA` and loaded with
/// `Script::load_async`). It owns a small tokio runtime of its own (one
/// worker thread) where its connections are dialed and where their I/O
/// tasks live, so a connection never belongs to a caller's runtime (a
/// `#[tokio::test]`'s runtime ends with its test; the store's connections
/// do not).
///
/// - From async code, wrap it in `AsyncStore`
///   (`AsyncStore::new(store)` or `AsyncStore::from(store)`, feature
///   `async`): each call is awaited in the caller's task, with no thread
///   hop and no blocking. Dial with [`connect_async`](RedisStore::connect_async)
///   so connecting does not block either. The caller's runtime needs its
///   time driver (tokio's default; `enable_all`), which the io timeout
///   uses.
/// - The synchronous traits ([`StateStore`](agentstate_core::StateStore) and the
///   rest) drive the same futures on the calling thread. Called from a
///   plain thread, that is an ordinary blocking call; called on an
///   executor thread (inside a runtime) it works and never panics, but it
///   blocks that executor thread for the call, so async code should use
///   `AsyncStore` instead.
///
/// Dropping the store (inside a runtime or not) never blocks on its
/// runtime and never panics: its runtime is shut down in the background.
///
/// # Cancellation (W3)
///
/// Every write is one Lua script, which Redis runs atomically: a dropped
/// write leaves all of it or none of it, never part. A future dropped
/// before its call was handed to a connection (still waiting for a
/// connection to be dialed) writes nothing. A future dropped after that
/// may still land: redis-rs writes a command its I/O task has taken even
/// when no one waits for the answer, and the server then runs it whole.
/// So each write may land after its future is dropped: `put_run`,
/// `patch_run`, `put_session`, `delete_session`, every tray call that
/// writes (`write_tray`, `delete_tray`, `apply_batch`, `release`,
/// `set_alarm`, `ack_alarm`, and `read_tray`/`list_trays`, which advance
/// the instance's epoch when a newer fence calls), `put_budget`,
/// `reserve`, `settle`, `release_hold`, their `_idempotent` forms, and
/// `prune`/`import` (one script per chunk or entry: a dropped call may
/// leave some chunks done). A write's tenant registration (`ZADD` to the
/// tenant registry, before its first write) may land alone, which no
/// read sees. To know whether a dropped write landed, read the record
/// back (its version says), or retry it with the same idempotency key.
///
/// # Errors
///
/// A server's "no" is `Persistence { reason: Refused }` (so is a
/// `redis://` URL to a port that takes TLS only, or `rediss://` to a
/// plain one, naming the scheme that fits); no connection (unreachable,
/// reset, the connect timeout) is `Unavailable` and nothing was sent; a
/// read that failed in transport (reset, closed, the io timeout, a reply
/// cut short, which redis-rs reports as a parse error) is `Unavailable`;
/// a write that failed in transport after it was handed to a connection
/// is `OutcomeUnknown` (rule I7; retryable only with an idempotency key).
/// `Corrupt` only says that stored data, or a complete reply, is not what
/// the store wrote, never that a connection failed. A connection that
/// failed in transport takes no further call (a half-read reply would
/// poison the next).
pub struct RedisStore {
    pool: connect::Pool,
    opts: RedisOptions,
    /// What the checks of the server found: at connect, or (lazy) at the
    /// first call.
    checked: tokio::sync::OnceCell<Checked>,
    /// Where the server is, without a password, for messages.
    server: String,
    /// Tenants this handle has put in the registry already.
    registered: Mutex<HashSet<String>>,
    /// The change feed's subscriber connection and its waiters.
    hub: feed::Hub,
    /// The server's settings as last read (watched, not checked once).
    settings: Mutex<Settings>,
    /// The store's runtime (dropped last: the connections' tasks live on it).
    bridge: Bridge,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("server", &self.server)
            .field("persistence", &self.checked.get().map(|c| &c.persistence))
            .finish_non_exhaustive()
    }
}

/// What the checks of a server found.
struct Checked {
    secret: [u8; 16],
    persistence: Persistence,
}

/// What connecting found, before the store is put together.
struct Dialed {
    pool: connect::Pool,
    dialer: std::sync::Arc<Dialer>,
    opts: RedisOptions,
    checked: Option<Checked>,
    server: String,
}

impl RedisStore {
    /// Connects with default options (`require_fsync(true)`).
    pub fn connect(url: &str) -> Result<RedisStore> {
        Self::connect_with(url, RedisOptions::default())
    }

    /// Connects to the server at `url` (`redis://[user:password@]host:port/db`,
    /// or `rediss://…` for TLS), checks it, and loads or creates the
    /// store's cursor secret on the server.
    ///
    /// The first connection is opened and checked before any call can use
    /// the store (unless [`RedisOptions::lazy`]: then by the first call,
    /// which answers the same errors), so a server's "no" comes back at
    /// once as
    /// `Persistence { reason: Refused }` with the server's own words: a
    /// wrong password (`WRONGPASS`, `NOAUTH`), a user without a command
    /// the store needs (`NOPERM`), a TLS certificate that does not verify
    /// or a handshake the server refuses, a database that does not exist,
    /// a Redis Cluster node, a `maxmemory-policy` other than `noeviction`,
    /// with `require_fsync` a server that could lose acknowledged writes,
    /// a server whose `CONFIG GET` fails without
    /// [`RedisOptions::durability_assumed`], and a URL whose scheme is not
    /// what the port speaks (`redis://` to a TLS-only port: "use
    /// rediss://"; `rediss://` to a plain port: "use redis://"). What a
    /// retry can fix
    /// (unreachable, reset, timed out, loading) is `Unavailable`. Messages
    /// name the server, never its password.
    ///
    /// This blocks the calling thread until connected; from async code use
    /// [`connect_async`](RedisStore::connect_async), which does not.
    pub fn connect_with(url: &str, opts: RedisOptions) -> Result<RedisStore> {
        let bridge = Bridge::new("agentstate-redis")?;
        let dialed = bridge.block_on(Self::dial(url, opts, &bridge))?;
        Ok(Self::assemble(dialed, bridge))
    }

    /// [`connect_with`](RedisStore::connect_with) for async code: dials
    /// and checks the server without blocking the caller's executor
    /// thread (the connection is opened on the store's own runtime, so it
    /// outlives the caller's runtime). The same checks and errors.
    ///
    /// ```no_run
    /// # #[cfg(feature = "async")]
    /// # async fn f() -> agentstate::Result<()> {
    /// use agentstate::{AsyncStore, RedisOptions, RedisStore, RunKey, RunRecord};
    /// let store = RedisStore::connect_async("redis://127.0.0.1:6379/0", RedisOptions::new()).await?;
    /// let store = AsyncStore::new(store);
    /// store.put_run(RunRecord::new(RunKey::new("acme", "run_1"), "planner")).await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect_async(url: &str, opts: RedisOptions) -> Result<RedisStore> {
        let bridge = Bridge::new("agentstate-redis")?;
        let dialed = Self::dial(url, opts, &bridge).await?;
        Ok(Self::assemble(dialed, bridge))
    }

    async fn dial(url: &str, opts: RedisOptions, bridge: &Bridge) -> Result<Dialed> {
        let server = agentstate_core::redact_connection_string(url);
        let dialer = std::sync::Arc::new(Dialer::new(url, &server, &opts)?);
        if opts.lazy {
            let pool = connect::Pool::new(dialer.clone(), &opts, None, bridge.handle());
            return Ok(Dialed {
                pool,
                dialer,
                opts,
                checked: None,
                server,
            });
        }
        let d = dialer.clone();
        let mut first = bridge
            .on_runtime(async move { d.open_or_explain().await })
            .await?;
        let checked = check(&mut first.conn, &server, &opts).await?;
        tracing::info!(
            target: "agentstate::redis",
            "redis {server}: {}; {}",
            checked.persistence.describe(),
            match opts.wait_replicas {
                Some((n, _)) => format!("each write waits for {n} replica(s)"),
                None => "replication (if any) is asynchronous".to_string(),
            }
        );
        let pool = connect::Pool::new(dialer.clone(), &opts, Some(first), bridge.handle());
        Ok(Dialed {
            pool,
            dialer,
            opts,
            checked: Some(checked),
            server,
        })
    }

    fn assemble(d: Dialed, bridge: Bridge) -> RedisStore {
        RedisStore {
            pool: d.pool,
            opts: d.opts,
            checked: match d.checked {
                Some(c) => tokio::sync::OnceCell::new_with(Some(c)),
                None => tokio::sync::OnceCell::new(),
            },
            server: d.server,
            registered: Mutex::new(HashSet::new()),
            hub: feed::Hub::new(d.dialer),
            settings: Mutex::new(Settings {
                read_at: Some(std::time::Instant::now()),
                dials: 0,
                refusal: None,
            }),
            bridge,
        }
    }

    /// What an `Ok` survives on this server: its `appendfsync` and
    /// `maxmemory-policy`, and whether they were read with `CONFIG GET` at
    /// connect or stated by the caller
    /// ([`RedisOptions::durability_assumed`]).
    ///
    /// Opened lazily ([`RedisOptions::lazy`]) and not used yet, it says
    /// so: nothing was read.
    pub fn durability(&self) -> String {
        match self.checked.get() {
            Some(c) => c.persistence.describe(),
            None => "not checked yet: the store was opened lazily (RedisOptions::lazy) and has \
                     made no call"
                .to_string(),
        }
    }

    /// What the checks of the server found; a lazily opened store checks
    /// it on its first call (and again after a check that failed).
    async fn checked(&self) -> Result<&Checked> {
        self.checked
            .get_or_try_init(|| async {
                let mut c = self.pool.get(&self.bridge).await?;
                let r = check(c.raw(), &self.server, &self.opts).await;
                if r.is_err() {
                    c.poison();
                }
                r
            })
            .await
    }

    /// The store's cursor secret (read from the server by the checks).
    async fn secret(&self) -> Result<[u8; 16]> {
        Ok(self.checked().await?.secret)
    }

    /// Refuses a write while the server's settings are unsafe, reading
    /// them again first when the last reading is older than
    /// [`RedisOptions::settings_interval`]: a server switched to an
    /// evicting policy after connect stops acknowledging writes it could
    /// drop, and one switched back is written to again. A connection
    /// dialed since the last reading (a redial after a cut, a restarted
    /// server) makes it due at once. The rules are
    /// connect's own (`connect::read_persistence`). Settings the caller
    /// stated are not read again.
    pub(crate) async fn writable(&self, conn: &mut Conn) -> Result<()> {
        if self.checked().await?.persistence.stated.is_none() {
            let due = {
                let mut s = self.settings.lock();
                let dials = self.pool.dials();
                let due = s.dials != dials
                    || s.read_at
                        .is_none_or(|at| at.elapsed() >= self.opts.settings_interval);
                if due {
                    // One reader at a time; the others go by the verdict
                    // in hand.
                    s.read_at = Some(std::time::Instant::now());
                    s.dials = dials;
                }
                due
            };
            if due {
                let mut read =
                    connect::read_persistence(conn.raw(), &self.server, &self.opts).await;
                if read.as_ref().is_err_and(StateError::is_retryable) {
                    // The connection failed in transport before anything
                    // of the write went on it: most often one the server
                    // closed while it sat idle (its `timeout`). The read
                    // goes again on another connection, and the write
                    // follows it there.
                    conn.poison();
                    match self.pool.get(&self.bridge).await {
                        Ok(fresh) => {
                            *conn = fresh;
                            read = connect::read_persistence(conn.raw(), &self.server, &self.opts)
                                .await;
                        }
                        Err(e) => {
                            // No connection: nothing was read, and the
                            // next write reads again.
                            self.settings.lock().read_at = None;
                            return Err(e);
                        }
                    }
                }
                let refusal = match read {
                    Ok(p) if p.stated.is_none() => None,
                    // CONFIG GET now fails where it worked at connect:
                    // nothing was read, so nothing is assumed either.
                    Ok(_) => Some(format!(
                        "redis {}: CONFIG GET no longer answers, so the store cannot see \
                         whether the server may evict keys",
                        self.server
                    )),
                    Err(e) if e.is_retryable() => {
                        // The fresh connection failed in transport too:
                        // it takes no further call, and the next write
                        // reads again.
                        conn.poison();
                        self.settings.lock().read_at = None;
                        return Err(e);
                    }
                    Err(StateError::Persistence { detail, .. }) => Some(detail),
                    Err(e) => Some(e.to_string()),
                };
                self.settings.lock().refusal = refusal;
            }
        }
        match &self.settings.lock().refusal {
            Some(why) => Err(StateError::refused(
                format!("{why}; writes are refused until it is fixed (nothing was written)"),
                None,
            )),
            None => Ok(()),
        }
    }

    /// A connection for one call; an error means nothing was sent.
    async fn conn(&self) -> Result<Conn> {
        if !self.checked.initialized() {
            self.checked().await?;
        }
        self.pool.get(&self.bridge).await
    }

    fn now(&self) -> u64 {
        self.opts.options.clock.now_millis()
    }

    fn max(&self) -> usize {
        self.opts.options.record_bytes_max
    }

    /// Puts the tenant in the registry before its first write (idempotent;
    /// the registry is a superset of the tenants with records).
    async fn register(&self, conn: &mut Conn, tenant: &str) -> Result<()> {
        if self.registered.lock().contains(tenant) {
            return Ok(());
        }
        conn.query::<i64>(::redis::cmd("ZADD").arg(keys::TENANTS).arg(0).arg(tenant))
            .await?;
        self.registered.lock().insert(tenant.to_string());
        Ok(())
    }
}

/// The checks a server must pass before the store uses it (not a cluster
/// node, no eviction, fsync when required), and the cursor secret, made
/// on `conn`.
async fn check(
    conn: &mut (impl ::redis::aio::ConnectionLike + Send),
    server: &str,
    opts: &RedisOptions,
) -> Result<Checked> {
    connect::refuse_cluster(conn, server).await?;
    let persistence = connect::read_persistence(conn, server, opts).await?;
    if let Some((want, _)) = opts.wait_replicas {
        connect::refuse_too_few_replicas(conn, server, want).await?;
    }
    let secret = load_secret(conn)
        .await
        .map_err(|e| with_server(e, server))?;
    Ok(Checked {
        secret,
        persistence,
    })
}

/// The store's cursor secret lives on the server, so every client of one
/// store accepts the others' cursors; the first client to connect makes it.
async fn load_secret(conn: &mut (impl ::redis::aio::ConnectionLike + Send)) -> Result<[u8; 16]> {
    let fresh = agentstate_core::codec::cursor::new_secret();
    ::redis::cmd("SET")
        .arg(keys::SECRET)
        .arg(&fresh[..])
        .arg("NX")
        .query_async::<Option<String>>(conn)
        .await
        .map_err(map_err)?;
    let got: Vec<u8> = ::redis::cmd("GET")
        .arg(keys::SECRET)
        .query_async(conn)
        .await
        .map_err(map_err)?;
    got.try_into()
        .map_err(|_| StateError::corrupt("redis: the cursor secret is not 16 bytes"))
}

/// A connect-time error with the server named (for errors `map_err`
/// made, which name none).
fn with_server(e: StateError, server: &str) -> StateError {
    match e {
        StateError::Persistence {
            reason,
            detail,
            source,
        } => StateError::Persistence {
            reason,
            detail: detail.replacen("redis:", &format!("redis {server}:"), 1),
            source,
        },
        other => other,
    }
}

/// A Redis failure as the crate's error: a server's "no" to how it was
/// asked (`NOPERM`, `WRONGPASS`, `NOAUTH`, a TLS failure, a cluster's
/// `MOVED`/`ASK`) is `Refused` (not retryable); every failure of the
/// transport, whatever redis-rs calls it (I/O, a reset, a timeout, a
/// reply cut short or garbled, which its parser reports as a parse
/// error: see [`connect::is_server_reply`]), and a server refusing writes
/// (`OOM`, `MISCONF`, `BUSY`, `LOADING`, `READONLY`, …), is `Unavailable`
/// (retryable); any other error reply of the server (a script's error, a
/// key of the wrong type: the stored data is not what the store wrote)
/// is `Corrupt`. A write script's transport failure after it was sent is
/// not this function's: see `scripts::Call::invoke` (`OutcomeUnknown`).
pub(crate) fn map_err(e: ::redis::RedisError) -> StateError {
    if let Some(why) = connect::refusal(&e) {
        return StateError::refused(format!("redis: {why}"), Some(Box::new(e)));
    }
    if !connect::is_server_reply(&e) {
        return StateError::unavailable(
            format!("redis: the connection failed ({e}); retry"),
            Some(std::io::Error::other(e)),
        );
    }
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
