//! Opening connections and telling why one failed: the URL read once
//! (credentials and database taken out so the store authenticates itself
//! and keeps the server's own answer), TLS on rustls, the first
//! connection made before the pool so its error comes back at once, the
//! checks a server must pass before the store uses it (not a cluster
//! node, no eviction, fsync when required), and the pool of connections
//! ([`Pool`]) every call takes one from: multiplexed ones for async
//! callers, and blocking ones a synchronous caller's thread drives itself.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ::redis::aio::MultiplexedConnection;
use ::redis::{
    AsyncConnectionConfig, ConnectionAddr, ErrorKind, FromRedisValue, IntoConnectionInfo,
    RedisError, ServerErrorKind,
};
use ::redis::{RedisFuture, Value};

use agentstate_core::error::{Result, StateError};

use super::sentinel::{self, Sentinels};
use super::{Persistence, RedisOptions};

/// The certificates a `rediss://` connection uses besides the URL: a CA to
/// trust instead of the built-in roots, and a client certificate for
/// mutual TLS. PEM bytes, never printed.
#[derive(Clone, Default)]
pub(crate) struct TlsPems {
    pub(crate) ca: Option<Vec<u8>>,
    pub(crate) client: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for TlsPems {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsPems")
            .field("ca", &self.ca.as_ref().map(|_| "<pem>"))
            .field("client", &self.client.as_ref().map(|_| "<cert and key>"))
            .finish()
    }
}

/// `AUTH`'s arguments, kept out of the redis-rs client so the store sends
/// `AUTH` itself and keeps the server's reply (redis-rs replaces it with
/// "Password authentication failed").
#[derive(Clone)]
struct Auth {
    username: Option<String>,
    password: String,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("username", &self.username)
            .field("password", &"***")
            .finish()
    }
}

/// How long a TLS dial may go unanswered before the port is asked what
/// it speaks (a plain Redis never answers a TLS handshake).
const PROBE_AFTER: Duration = Duration::from_millis(300);

/// One connection just opened, and the flag a call sets when it sees the
/// connection fail in transport.
pub(crate) struct Opened {
    pub(crate) conn: MultiplexedConnection,
    broken: Arc<AtomicBool>,
}

/// One connection to the server, as a call uses it (redis-rs'
/// `aio::ConnectionLike`, so redis-rs' own calls take it too):
///
/// - `Shared`: a clone of a pooled multiplexed connection. Its I/O task
///   runs on the store's runtime; a command goes there through a channel
///   and its answer comes back through another (two thread hops).
/// - `Own`: a blocking connection held by one call of a synchronous
///   caller ([`agentstate_core::native::on_blocking_caller`]). A command
///   is written and its answer read on the caller's thread as it is
///   issued (its future is ready at once); the socket's read and write
///   timeouts are the store's io timeout.
pub(crate) enum Link {
    Shared(MultiplexedConnection),
    Own(Box<::redis::Connection>),
    /// An `Own` connection handed back to the pool (only while its
    /// `Conn` is dropped).
    Returned,
}

impl ::redis::aio::ConnectionLike for Link {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a ::redis::Cmd) -> RedisFuture<'a, Value> {
        match self {
            Link::Shared(c) => c.req_packed_command(cmd),
            Link::Own(c) => {
                let r = ::redis::ConnectionLike::req_packed_command(
                    &mut **c,
                    &cmd.get_packed_command(),
                );
                Box::pin(std::future::ready(r))
            }
            Link::Returned => Box::pin(std::future::ready(Err(closed()))),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a ::redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Link::Shared(c) => c.req_packed_commands(pipeline, offset, count),
            Link::Own(c) => {
                let r = ::redis::ConnectionLike::req_packed_commands(
                    &mut **c,
                    &pipeline.get_packed_pipeline(),
                    offset,
                    count,
                );
                Box::pin(std::future::ready(r))
            }
            Link::Returned => Box::pin(std::future::ready(Err(closed()))),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Link::Shared(c) => c.get_db(),
            Link::Own(c) => ::redis::ConnectionLike::get_db(&**c),
            Link::Returned => 0,
        }
    }
}

/// Opens connections with the store's timeouts: redis-rs
/// `MultiplexedConnection`s, and blocking ones for synchronous callers
/// (see [`Pool`]).
#[derive(Debug)]
pub(crate) struct Dialer {
    client: ::redis::Client,
    /// For the change feed's subscriber connection (`open_pubsub`): the
    /// URL as given, credentials and database included, which redis-rs
    /// sends itself (a subscriber connection takes no other command).
    pubsub: ::redis::Client,
    auth: Option<Auth>,
    db: i64,
    connect_timeout: Duration,
    io_timeout: Duration,
    /// The server's host and port (none for a Unix socket), and whether
    /// the URL asks for TLS: what a failed dial probes.
    addr: Option<(String, u16)>,
    tls: bool,
    /// Where the server is, without a password, for messages.
    server: String,
    /// For a `redis+sentinel://` URL: the sentinels each dial asks where
    /// the master is, and the connection settings (`plain` for the
    /// store's connections, `full` for the subscriber's) its address is
    /// put into, with the TLS options to build its client.
    sentinel: Option<SentinelDial>,
}

/// What a dial through Sentinel needs besides the sentinels.
#[derive(Debug)]
struct SentinelDial {
    sentinels: Sentinels,
    plain: ::redis::ConnectionInfo,
    full: ::redis::ConnectionInfo,
    pems: Option<TlsPems>,
    /// `#insecure` on a `rediss+sentinel://` URL (tests only).
    insecure: bool,
}

/// A redis-rs client for `info`, trusting the TLS options' CA and showing
/// their client certificate (for TLS addresses).
fn build_client(
    info: ::redis::ConnectionInfo,
    pems: Option<&TlsPems>,
    server: &str,
) -> Result<::redis::Client> {
    match pems {
        Some(pems) => {
            let certs = ::redis::TlsCertificates {
                client_tls: pems
                    .client
                    .as_ref()
                    .map(|(cert, key)| ::redis::ClientTlsConfig {
                        client_cert: cert.clone(),
                        client_key: key.clone(),
                    }),
                root_cert: pems.ca.clone(),
            };
            ::redis::Client::build_with_tls(info, certs)
                .map_err(|e| StateError::invalid(format!("redis {server}: TLS certificates: {e}")))
        }
        None => ::redis::Client::open(info)
            .map_err(|e| StateError::invalid(format!("redis url {server}: {e}"))),
    }
}

impl Dialer {
    /// Reads `url` and the TLS options into a dialer; `server` is the URL
    /// without its password, for messages.
    pub(crate) fn new(url: &str, server: &str, opts: &RedisOptions) -> Result<Dialer> {
        let sentinel_url = sentinel::parse(url, server).transpose()?;
        let url = sentinel_url.as_ref().map_or(url, |s| s.template.as_str());
        let info = url
            .into_connection_info()
            .map_err(|e| StateError::invalid(format!("redis url {server}: {e}")))?;
        let tls = matches!(info.addr(), ConnectionAddr::TcpTls { .. });
        let insecure = matches!(info.addr(), ConnectionAddr::TcpTls { insecure: true, .. });
        // What a failed dial probes (not through Sentinel: the master's
        // address changes).
        let addr = match info.addr() {
            _ if sentinel_url.is_some() => None,
            ConnectionAddr::Tcp(host, port) => Some((host.clone(), *port)),
            ConnectionAddr::TcpTls { host, port, .. } => Some((host.clone(), *port)),
            _ => None,
        };
        if tls {
            // rustls needs a process-wide crypto provider when more than
            // one is compiled in (and always for `#insecure`); ring is the
            // one this crate brings. One installed already stays. (rustls
            // 0.23.48 deprecates ring's provider for lacking post-quantum
            // key exchange; rustls itself still installs it the same way.)
            if rustls::crypto::CryptoProvider::get_default().is_none() {
                #[allow(deprecated)]
                let _ = rustls::crypto::ring::default_provider().install_default();
            }
        }
        let settings = info.redis_settings().clone();
        // The subscriber speaks RESP2 whatever the URL says (redis-rs'
        // `PubSub` is a RESP2 connection).
        let full = info.clone().set_redis_settings(
            settings
                .clone()
                .set_protocol(::redis::ProtocolVersion::RESP2),
        );
        let (auth, db, info) = if settings.protocol().supports_resp3() {
            // HELLO carries AUTH under RESP3, and keeps the server's reply.
            (None, 0, info)
        } else {
            let auth = settings.password().map(|p| Auth {
                username: settings.username().map(str::to_string),
                password: p.to_string(),
            });
            let mut plain =
                ::redis::RedisConnectionInfo::default().set_protocol(settings.protocol());
            if auth.is_some() {
                // CLIENT SETINFO before AUTH would only be refused.
                plain = plain.set_skip_set_lib_name();
            }
            (auth, settings.db(), info.set_redis_settings(plain))
        };
        if opts.tls.is_some() && !tls {
            return Err(StateError::invalid(format!(
                "redis url {server}: TLS certificates were given (RedisOptions::tls_ca_pem / \
                 tls_client_pem) but the url is not rediss://"
            )));
        }
        let build = |info: ::redis::ConnectionInfo| build_client(info, opts.tls.as_ref(), server);
        let sentinel = match &sentinel_url {
            None => None,
            Some(u) => Some(SentinelDial {
                sentinels: Sentinels::new(u, build)?,
                plain: info.clone(),
                full: full.clone(),
                pems: opts.tls.clone(),
                insecure,
            }),
        };
        let client = build(info)?;
        let pubsub = build(full)?;
        Ok(Dialer {
            client,
            pubsub,
            auth,
            db,
            connect_timeout: opts.connect_timeout,
            io_timeout: opts.io_timeout,
            addr,
            tls,
            server: server.to_string(),
            sentinel,
        })
    }

    /// A client for the master the sentinels name now, with `info`'s
    /// settings (`plain` or `full`).
    async fn master_client(
        &self,
        s: &SentinelDial,
        info: &::redis::ConnectionInfo,
    ) -> std::result::Result<::redis::Client, RedisError> {
        let addr = s
            .sentinels
            .master_addr(self.connect_timeout, s.insecure)
            .await?;
        build_client(info.clone().set_addr(addr), s.pems.as_ref(), &self.server)
            .map_err(|e| RedisError::from(std::io::Error::other(e.to_string())))
    }

    /// [`open`](Self::open), its failure told as the crate's error: a
    /// server's "no" is `Refused` ([`refusal`]); a dial that got no answer
    /// of the server's own is probed for the other protocol (a `redis://`
    /// URL to a port that takes TLS only, a `rediss://` URL to a plain
    /// port), which is `Refused` naming the fix, never retryable; anything
    /// else is `Unavailable` ([`connect_error`]). Call it on the store's
    /// runtime, as `open`.
    pub(crate) async fn open_or_explain(&self) -> Result<Opened> {
        let mut open = std::pin::pin!(self.open());
        let early = match (&self.addr, self.tls) {
            // A TLS handshake with a plain port goes unanswered until the
            // connect timeout (a plain Redis waits for the end of a line):
            // a dial not done in a moment asks the port what it speaks.
            (Some((host, port)), true) => {
                tokio::select! {
                    r = &mut open => Some(r),
                    _ = tokio::time::sleep(PROBE_AFTER) => {
                        if speaks_other(host, *port, true, self.probe_within()).await {
                            return Err(self.mismatch(None));
                        }
                        None
                    }
                }
            }
            _ => None,
        };
        let r = match early {
            Some(r) => r,
            None => open.await,
        };
        let e = match r {
            Ok(c) => return Ok(c),
            Err(e) => e,
        };
        if refusal(&e).is_none()
            && !is_server_reply(&e)
            && let Some((host, port)) = &self.addr
            && speaks_other(host, *port, self.tls, self.probe_within()).await
        {
            return Err(self.mismatch(Some(e)));
        }
        Err(connect_error(&self.server, e))
    }

    /// How long a probe of the port may take.
    fn probe_within(&self) -> Duration {
        self.connect_timeout.min(Duration::from_secs(2))
    }

    /// The URL's protocol is not the port's: `Refused`, naming the fix.
    fn mismatch(&self, e: Option<RedisError>) -> StateError {
        let server = &self.server;
        let why = if self.tls {
            "the server does not speak TLS on this port and the url is rediss://: use redis:// \
             (or turn TLS on at the server)"
        } else {
            "the server takes TLS only on this port and the url is plain redis://: use rediss:// \
             (with RedisOptions::tls_ca_pem for a private CA)"
        };
        StateError::refused(
            format!("redis {server}: {why}"),
            e.map(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>),
        )
    }

    /// Opens one connection: TCP (and TLS), `AUTH`, `SELECT`, all within
    /// the connect timeout. Its I/O task is spawned on the runtime this
    /// runs on: call it through `Bridge::on_runtime` (the store's).
    pub(crate) async fn open(&self) -> std::result::Result<Opened, RedisError> {
        match tokio::time::timeout(self.connect_timeout, self.open_untimed()).await {
            Ok(r) => r.map(|conn| Opened {
                conn,
                broken: Arc::new(AtomicBool::new(false)),
            }),
            Err(_) => Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "no connection within the connect timeout ({:?})",
                    self.connect_timeout
                ),
            ))),
        }
    }

    /// Opens a subscriber connection (RESP2 pub/sub: TCP, TLS, `AUTH` and
    /// `SELECT` as the URL says), within the connect timeout. Like
    /// [`open`](Self::open), call it on the store's runtime.
    pub(crate) async fn open_pubsub(
        &self,
    ) -> std::result::Result<::redis::aio::PubSub, RedisError> {
        let dial = async {
            match &self.sentinel {
                None => self.pubsub.get_async_pubsub().await,
                Some(s) => {
                    self.master_client(s, &s.full)
                        .await?
                        .get_async_pubsub()
                        .await
                }
            }
        };
        match tokio::time::timeout(self.connect_timeout, dial).await {
            Ok(r) => r,
            Err(_) => Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no subscriber connection within the connect timeout",
            ))),
        }
    }

    /// How long one command may take to answer.
    pub(crate) fn io_timeout(&self) -> Duration {
        self.io_timeout
    }

    /// The client the store's connections are dialed with: the URL's, or
    /// through Sentinel one for the master the sentinels name now.
    async fn store_client(
        &self,
    ) -> std::result::Result<std::borrow::Cow<'_, ::redis::Client>, RedisError> {
        Ok(match &self.sentinel {
            None => std::borrow::Cow::Borrowed(&self.client),
            Some(s) => std::borrow::Cow::Owned(self.master_client(s, &s.plain).await?),
        })
    }

    async fn open_untimed(&self) -> std::result::Result<MultiplexedConnection, RedisError> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.connect_timeout))
            .set_response_timeout(Some(self.io_timeout));
        let client = self.store_client().await?;
        let mut c = client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        self.setup(&mut c).await?;
        Ok(c)
    }

    /// Opens a blocking connection for one synchronous caller's calls
    /// ([`Link::Own`]): TCP (and TLS) within the connect timeout, every
    /// read and write of it within the io timeout, then `AUTH`, `SELECT`
    /// and (through Sentinel) the check that it reached the master, as
    /// [`open`](Self::open). It blocks the calling thread: call it only
    /// on a blocking caller's.
    pub(crate) async fn open_own(
        &self,
    ) -> std::result::Result<Box<::redis::Connection>, RedisError> {
        let client = self.store_client().await?;
        let c = client.get_connection_with_timeout(self.connect_timeout)?;
        c.set_read_timeout(Some(self.io_timeout))?;
        c.set_write_timeout(Some(self.io_timeout))?;
        let mut link = Link::Own(Box::new(c));
        self.setup(&mut link).await?;
        match link {
            Link::Own(c) => Ok(c),
            Link::Shared(_) | Link::Returned => Err(closed()),
        }
    }

    /// What a connection is told before any call: `AUTH` (when the URL
    /// has credentials and speaks RESP2), `SELECT`, and through Sentinel
    /// the check that it reached the master.
    async fn setup(
        &self,
        c: &mut (impl ::redis::aio::ConnectionLike + Send),
    ) -> std::result::Result<(), RedisError> {
        if let Some(a) = &self.auth {
            let auth = |with_user: bool| {
                let mut cmd = ::redis::cmd("AUTH");
                if with_user && let Some(u) = &a.username {
                    cmd.arg(u);
                }
                cmd.arg(&a.password);
                cmd
            };
            match auth(true).query_async::<()>(c).await {
                // A server older than ACLs takes the password alone.
                Err(e)
                    if a.username.is_some()
                        && e.detail()
                            .is_some_and(|d| d.contains("wrong number of arguments")) =>
                {
                    auth(false).query_async::<()>(c).await?
                }
                r => r?,
            }
        }
        if self.db != 0 {
            ::redis::cmd("SELECT")
                .arg(self.db)
                .query_async::<()>(c)
                .await?;
        }
        if let Some(s) = &self.sentinel {
            sentinel::check_master(c, s.sentinels.master()).await?;
        }
        Ok(())
    }
}

/// The store's connections: up to `pool_size` redis-rs
/// `MultiplexedConnection`s, each carrying any number of calls at once
/// (pipelined on one socket). A call takes the open connection with the
/// fewest calls in flight; when every open one is busy and the pool is
/// not full, one more is dialed in the background (the call does not wait
/// for it). A call waits for a dial only when no connection is open. A
/// connection is dropped from the pool after a call on it failed in
/// transport (dropped, reset, timed out, a reply cut short or garbled:
/// anything but the server's own error reply), once it lived past
/// `max_lifetime`, and once idle past `idle_timeout` (one idle
/// connection is kept); a reaper task on the store's runtime does this
/// between calls too. Every dial runs on the store's runtime, so every
/// connection's I/O task lives there, never on a caller's runtime.
///
/// A synchronous caller (the `StateStore` traits, the CLI) takes a blocking
/// connection of its own instead when it can ([`Link::Own`]): its thread
/// writes the command and reads the answer itself, sparing the two thread
/// hops of a multiplexed connection (45–55 µs of a ~170 µs call on
/// loopback). Up to `pool_size` of them are open besides the multiplexed
/// ones; each serves one call at a time and goes back to the pool after
/// it (unless it failed in transport, or outlived `max_lifetime` or
/// `idle_timeout`: the reaper drops those too). One is dialed on the
/// caller's thread only while a multiplexed connection is open (the
/// server answered lately); when none can be had (all taken, the dial
/// failed) the call takes a multiplexed one, and after a failed dial no
/// other is tried until the pool dials again. So a call that found no
/// connection fails as before, with the dial's own words.
///
/// Why several connections rather than one (redis-rs' `ConnectionManager`
/// is one socket): under concurrent calls a large answer (a listing, an
/// export page) on one socket holds up only the calls that share it, and
/// a socket that dies fails only the calls in flight on it. And each
/// connection is dialed by the store itself (its `AUTH`, so a server's
/// refusal keeps the server's words, with the store's own timeouts), so
/// a call that found no connection is told apart from one that was
/// handed to one (rule I7).
pub(crate) struct Pool {
    inner: Arc<PoolInner>,
}

struct PoolInner {
    dialer: Arc<Dialer>,
    size: usize,
    idle_timeout: Option<Duration>,
    max_lifetime: Option<Duration>,
    conns: parking_lot::Mutex<Vec<Live>>,
    /// Whether a background dial is under way (one at a time).
    dialing: AtomicBool,
    /// Serializes the dials callers wait for (when none is open).
    dial: tokio::sync::Mutex<()>,
    next: AtomicUsize,
    /// Connections opened so far (the store re-reads the server's
    /// settings after each).
    dials: AtomicU64,
    /// `WAIT` after each write (`RedisOptions::wait_replicas`), in
    /// replicas and milliseconds.
    wait: Option<(u32, u64)>,
    rt: tokio::runtime::Handle,
    /// Blocking connections waiting for a synchronous caller.
    own: parking_lot::Mutex<Vec<Idle>>,
    /// Blocking connections open: idle or serving a call.
    own_open: AtomicUsize,
    /// `dials` when a blocking dial last failed (`u64::MAX`: none did):
    /// none is tried again until the pool has dialed since.
    own_failed: AtomicU64,
}

/// A blocking connection between calls.
struct Idle {
    conn: Box<::redis::Connection>,
    born: Instant,
    used: Instant,
}

impl Idle {
    /// Whether it must take no further call.
    fn stale(&self, p: &PoolInner, now: Instant) -> bool {
        p.outlived(self.born, now) || p.idled(self.used, now)
    }
}

/// One open connection.
struct Live {
    conn: MultiplexedConnection,
    born: Instant,
    /// When a call last took it.
    used: Instant,
    /// Set by a call that saw the connection fail in transport.
    broken: Arc<AtomicBool>,
    /// Calls in flight on it.
    busy: Arc<AtomicUsize>,
}

impl Live {
    fn new(opened: Opened) -> Live {
        let now = Instant::now();
        Live {
            conn: opened.conn,
            born: now,
            used: now,
            broken: opened.broken,
            busy: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Why the connection must take no further call, if so; `keep_idle`
    /// keeps it however long idle.
    fn stale(&self, p: &PoolInner, now: Instant, keep_idle: bool) -> Option<&'static str> {
        if self.broken.load(Ordering::Relaxed) {
            return Some("redial");
        }
        if p.outlived(self.born, now) {
            return Some("max_lifetime");
        }
        if !keep_idle && self.busy.load(Ordering::Relaxed) == 0 && p.idled(self.used, now) {
            return Some("idle_timeout");
        }
        None
    }

    fn take(&mut self, now: Instant, wait: Option<(u32, u64)>) -> Conn {
        self.used = now;
        self.busy.fetch_add(1, Ordering::Relaxed);
        Conn {
            conn: Link::Shared(self.conn.clone()),
            broken: self.broken.clone(),
            held: Held::Shared(self.busy.clone()),
            wait,
        }
    }
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("size", &self.inner.size)
            .finish_non_exhaustive()
    }
}

impl Pool {
    /// A pool of at most `opts.pool_size` connections, holding `first`
    /// (the connection the store checked the server on; none for a lazy
    /// open); dials and the reaper run on `rt` (the store's runtime).
    pub(crate) fn new(
        dialer: Arc<Dialer>,
        opts: &RedisOptions,
        first: Option<Opened>,
        rt: &tokio::runtime::Handle,
    ) -> Pool {
        let inner = Arc::new(PoolInner {
            dialer,
            size: opts.pool_size.max(1) as usize,
            idle_timeout: opts.idle_timeout,
            max_lifetime: opts.max_lifetime,
            conns: parking_lot::Mutex::new(first.into_iter().map(Live::new).collect()),
            dialing: AtomicBool::new(false),
            dial: tokio::sync::Mutex::new(()),
            next: AtomicUsize::new(0),
            dials: AtomicU64::new(0),
            wait: opts
                .wait_replicas
                .map(|(n, t)| (n, u64::try_from(t.as_millis()).unwrap_or(u64::MAX))),
            rt: rt.clone(),
            own: parking_lot::Mutex::new(Vec::new()),
            own_open: AtomicUsize::new(0),
            own_failed: AtomicU64::new(u64::MAX),
        });
        let every = [opts.idle_timeout, opts.max_lifetime]
            .into_iter()
            .flatten()
            .min()
            .map(|t| (t / 2).clamp(Duration::from_millis(10), Duration::from_secs(30)));
        if let Some(every) = every {
            let weak = Arc::downgrade(&inner);
            rt.spawn(async move {
                loop {
                    tokio::time::sleep(every).await;
                    let Some(pool) = weak.upgrade() else { return };
                    pool.prune(Instant::now());
                }
            });
        }
        Pool { inner }
    }

    /// A connection for one call. An error means nothing of the call was
    /// sent (no connection could be opened): `Refused` or `Unavailable`,
    /// as [`Dialer::open_or_explain`] says.
    pub(crate) async fn get(&self, bridge: &agentstate_core::native::Bridge) -> Result<Conn> {
        if agentstate_core::native::on_blocking_caller()
            && let Some(c) = self.inner.own().await
        {
            return Ok(c);
        }
        if let Some(c) = self.inner.pick() {
            return Ok(c);
        }
        // None open: dial one, and wait for it (one dial at a time; those
        // waiting take the one it opened).
        let _dialing = self.inner.dial.lock().await;
        if let Some(c) = self.inner.pick() {
            return Ok(c);
        }
        let dialer = self.inner.dialer.clone();
        let conn = bridge
            .on_runtime(async move { dialer.open_or_explain().await })
            .await?;
        let mut live = Live::new(conn);
        let c = live.take(Instant::now(), self.inner.wait);
        self.inner.conns.lock().push(live);
        self.inner.dials.fetch_add(1, Ordering::AcqRel);
        Ok(c)
    }

    /// How many connections the pool has opened (not counting the one it
    /// was made with): the server may have changed since the last.
    pub(crate) fn dials(&self) -> u64 {
        self.inner.dials.load(Ordering::Acquire)
    }
}

impl PoolInner {
    /// Whether a connection opened at `born` outlived `max_lifetime`.
    fn outlived(&self, born: Instant, now: Instant) -> bool {
        self.max_lifetime
            .is_some_and(|t| now.duration_since(born) >= t)
    }

    /// Whether a connection last taken at `used` sat idle past
    /// `idle_timeout`.
    fn idled(&self, used: Instant, now: Instant) -> bool {
        self.idle_timeout
            .is_some_and(|t| now.duration_since(used) >= t)
    }

    /// Drops the connections that must take no further call (keeping one
    /// idle one).
    fn prune(&self, now: Instant) -> usize {
        let stale: Vec<Idle> = {
            let mut own = self.own.lock();
            if own.iter().any(|i| i.stale(self, now)) {
                let (stale, kept) = std::mem::take(&mut *own)
                    .into_iter()
                    .partition(|i| i.stale(self, now));
                *own = kept;
                stale
            } else {
                // The common case, on every multiplexed call: nothing to
                // drop, nothing allocated.
                Vec::new()
            }
        };
        // Closed outside the lock.
        self.own_open.fetch_sub(stale.len(), Ordering::AcqRel);
        drop(stale);
        let mut conns = self.conns.lock();
        let mut kept_idle = false;
        conns.retain(|l| match l.stale(self, now, !kept_idle) {
            None => {
                kept_idle = true;
                true
            }
            Some(why) => {
                if why == "redial" {
                    agentstate_core::observe::retry("redis", "redial", 1);
                }
                false
            }
        });
        conns.len()
    }

    /// A blocking connection for a synchronous caller's call: an idle one,
    /// or one dialed now on the caller's thread (see [`Pool`] for when);
    /// `None` sends the call to a multiplexed one.
    async fn own(self: &Arc<Self>) -> Option<Conn> {
        let now = Instant::now();
        loop {
            let idle = self.own.lock().pop();
            let Some(idle) = idle else { break };
            if idle.stale(self, now) {
                self.own_open.fetch_sub(1, Ordering::AcqRel);
                continue;
            }
            return Some(self.lend(idle.conn, idle.born));
        }
        let dials = self.dials.load(Ordering::Acquire);
        if self.own_failed.load(Ordering::Acquire) == dials || self.conns.lock().is_empty() {
            return None;
        }
        if self.own_open.fetch_add(1, Ordering::AcqRel) >= self.size {
            self.own_open.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        match self.dialer.open_own().await {
            Ok(conn) => {
                self.dials.fetch_add(1, Ordering::AcqRel);
                Some(self.lend(conn, Instant::now()))
            }
            Err(_) => {
                self.own_open.fetch_sub(1, Ordering::AcqRel);
                self.own_failed.store(dials, Ordering::Release);
                None
            }
        }
    }

    /// `conn` as one call's, going back to the pool when dropped.
    fn lend(self: &Arc<Self>, conn: Box<::redis::Connection>, born: Instant) -> Conn {
        Conn {
            conn: Link::Own(conn),
            broken: Arc::new(AtomicBool::new(false)),
            held: Held::Own {
                pool: Arc::downgrade(self),
                born,
            },
            wait: self.wait,
        }
    }

    /// The open connection with the fewest calls in flight, if any; when
    /// even that one is busy, one more is dialed in the background.
    fn pick(self: &Arc<Self>) -> Option<Conn> {
        let now = Instant::now();
        self.prune(now);
        let mut conns = self.conns.lock();
        let n = conns.len();
        if n == 0 {
            return None;
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        let best = (0..n)
            .map(|k| (start + k) % n)
            .min_by_key(|&i| conns[i].busy.load(Ordering::Relaxed))?;
        let busy = conns[best].busy.load(Ordering::Relaxed) > 0;
        let c = conns[best].take(now, self.wait);
        if busy && n < self.size && !self.dialing.swap(true, Ordering::AcqRel) {
            let pool = self.clone();
            self.rt.spawn(async move {
                if let Ok(conn) = pool.dialer.open().await {
                    let mut conns = pool.conns.lock();
                    if conns.len() < pool.size {
                        conns.push(Live::new(conn));
                        pool.dials.fetch_add(1, Ordering::AcqRel);
                    }
                }
                pool.dialing.store(false, Ordering::Release);
            });
        }
        Some(c)
    }
}

/// One call's connection: a clone of a pooled multiplexed connection, or
/// a blocking one it holds alone (see [`Link`]).
pub(crate) struct Conn {
    conn: Link,
    broken: Arc<AtomicBool>,
    held: Held,
    /// `WAIT` after each write script: replicas, milliseconds.
    wait: Option<(u32, u64)>,
}

/// What a [`Conn`] gives back when dropped.
enum Held {
    /// Its multiplexed connection's count of calls in flight.
    Shared(Arc<AtomicUsize>),
    /// Its blocking connection, to the pool it came from.
    Own {
        pool: std::sync::Weak<PoolInner>,
        born: Instant,
    },
}

impl Drop for Conn {
    fn drop(&mut self) {
        match &self.held {
            Held::Shared(busy) => {
                busy.fetch_sub(1, Ordering::Relaxed);
            }
            Held::Own { pool, born } => {
                let Some(pool) = pool.upgrade() else { return };
                let link = std::mem::replace(&mut self.conn, Link::Returned);
                match link {
                    Link::Own(conn) if !self.broken.load(Ordering::SeqCst) => {
                        pool.own.lock().push(Idle {
                            conn,
                            born: *born,
                            used: Instant::now(),
                        });
                    }
                    _ => {
                        if self.broken.load(Ordering::SeqCst) {
                            agentstate_core::observe::retry("redis", "redial", 1);
                        }
                        pool.own_open.fetch_sub(1, Ordering::AcqRel);
                    }
                }
            }
        }
    }
}

impl Conn {
    /// Notes a failure of `e`: a connection that failed in transport
    /// (dropped, reset, timed out, a reply cut short or garbled: anything
    /// but the server's own error reply) takes no further call. A
    /// multiplexed connection whose reply was half read is poisoned: the
    /// next reply read on it would be the rest of this one.
    pub(crate) fn note(&self, e: &RedisError) {
        if e.is_unrecoverable_error() || !is_server_reply(e) {
            self.broken.store(true, Ordering::SeqCst);
        }
    }

    /// `WAIT` after each write script (`RedisOptions::wait_replicas`):
    /// replicas, milliseconds.
    pub(crate) fn wait(&self) -> Option<(u32, u64)> {
        self.wait
    }

    /// Takes the connection out of the pool (a check on it failed).
    pub(crate) fn poison(&self) {
        self.broken.store(true, Ordering::SeqCst);
    }

    /// True when the connection was seen failing (by a call on it):
    /// nothing more is sent on it.
    pub(crate) fn is_broken(&self) -> bool {
        self.broken.load(Ordering::SeqCst)
    }

    /// Sends one command and answers its raw reply (a server's error
    /// reply is `Ok(Value::ServerError)`). Every `Err` is the transport's
    /// (see [`Sent`]).
    pub(crate) async fn send(
        &mut self,
        cmd: &::redis::Cmd,
    ) -> std::result::Result<::redis::Value, Sent> {
        if self.is_broken() {
            return Err(Sent::Not(closed()));
        }
        let r = ::redis::aio::ConnectionLike::req_packed_command(&mut self.conn, cmd).await;
        r.map_err(|e| {
            self.note(&e);
            Sent::Maybe(e)
        })
    }

    /// The connection, for redis-rs' own calls (loading a script).
    pub(crate) fn raw(&mut self) -> &mut Link {
        &mut self.conn
    }

    /// Runs one command (a read, or a write no reader sees) and converts
    /// its reply: a transport failure is `Unavailable`, the server's
    /// error reply as [`map_err`](super::map_err) says, and a complete
    /// reply of another shape than expected `Corrupt`.
    pub(crate) async fn query<T: FromRedisValue>(&mut self, cmd: &::redis::Cmd) -> Result<T> {
        let v = self.send(cmd).await.map_err(Sent::unavailable)?;
        let v = v.extract_error().map_err(|e| {
            self.readonly(&e);
            super::map_err(e)
        })?;
        decode(v)
    }

    /// A `READONLY` answer: the server is a replica now (a master demoted
    /// by a failover); the connection takes no further call, so the next
    /// dial finds the master.
    pub(crate) fn readonly(&self, e: &RedisError) {
        if e.code() == Some("READONLY") {
            self.poison();
        }
    }

    /// Runs a pipeline (a `MULTI` when atomic) and converts its replies,
    /// judged as [`query`](Self::query)'s.
    pub(crate) async fn pipe<T: FromRedisValue>(&mut self, p: &::redis::Pipeline) -> Result<T> {
        if self.is_broken() {
            return Err(Sent::Not(closed()).unavailable());
        }
        // As `Value`, which every reply converts to: an error here is the
        // transport's, or the server's error replies.
        let r = p.query_async::<::redis::Value>(&mut self.conn).await;
        let v = r.map_err(|e| {
            self.note(&e);
            if is_server_reply(&e) {
                super::map_err(e)
            } else {
                Sent::Maybe(e).unavailable()
            }
        })?;
        decode(v)
    }
}

/// A complete reply converted to what the call expects; a reply of
/// another shape is the stored data's (or a script's) fault: `Corrupt`.
pub(crate) fn decode<T: FromRedisValue>(v: ::redis::Value) -> Result<T> {
    ::redis::from_redis_value(v)
        .map_err(|e| StateError::corrupt(format!("redis: an answer of an unexpected shape: {e}")))
}

/// True when `e` is an error reply the server sent (`-ERR …`, `-NOPERM
/// …`, a pipeline's or a transaction's error replies): the server read
/// the request and answered, and the connection is sound. Every other
/// failure of a call is the transport's, whatever redis-rs calls it: I/O
/// (reset, EOF, a broken pipe), a timeout, a reply cut short or garbled
/// (its parser's "Unexpected end of input" is `ErrorKind::Parse`), a
/// connection seen closed.
pub(crate) fn is_server_reply(e: &RedisError) -> bool {
    matches!(e.kind(), ErrorKind::Server(_) | ErrorKind::Extension)
}

/// The error of a connection seen closed before anything was sent on it.
fn closed() -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::NotConnected,
        "the connection was seen closed before the call was sent on it",
    ))
}

/// A transport failure of one call, and whether its request may have
/// reached the server.
#[derive(Debug)]
pub(crate) enum Sent {
    /// Nothing of the call was sent (its connection was already seen
    /// closed).
    Not(RedisError),
    /// Handed to the connection: a multiplexed connection cannot tell a
    /// request its socket never took from one the server ran.
    Maybe(RedisError),
}

impl Sent {
    /// The failure of a read (or of a write known not sent): `Unavailable`.
    pub(crate) fn unavailable(self) -> StateError {
        let e = match self {
            Sent::Not(e) | Sent::Maybe(e) => e,
        };
        StateError::unavailable(
            format!("redis: the connection failed ({}); retry", server_text(&e)),
            Some(std::io::Error::other(e)),
        )
    }
}

/// `cmd.query_on(&mut conn).await`: a command or pipeline run on one of
/// the store's connections, its failure as the crate's error.
pub(crate) trait QueryOn {
    async fn query_on<T: FromRedisValue>(&self, conn: &mut Conn) -> Result<T>;
}

impl QueryOn for ::redis::Cmd {
    async fn query_on<T: FromRedisValue>(&self, conn: &mut Conn) -> Result<T> {
        conn.query(self).await
    }
}

impl QueryOn for ::redis::Pipeline {
    async fn query_on<T: FromRedisValue>(&self, conn: &mut Conn) -> Result<T> {
        conn.pipe(self).await
    }
}

/// Why a server said "no" to how it was asked, when it did: the first
/// words of a `Refused` error's detail. `None` for everything else.
pub(crate) fn refusal(e: &RedisError) -> Option<String> {
    if let Some(tls) = tls_error(e) {
        return Some(match tls {
            rustls::Error::InvalidCertificate(_) => format!(
                "the server's TLS certificate does not verify ({tls}): trust its CA with \
                 RedisOptions::tls_ca_pem, or check the host name in the url"
            ),
            rustls::Error::AlertReceived(_) => format!(
                "the server refused the TLS handshake ({tls}): it may require a client \
                 certificate (RedisOptions::tls_client_pem) or one it trusts"
            ),
            _ => format!(
                "TLS failed ({tls}): if the server takes plain connections on this port, \
                 use redis://"
            ),
        });
    }
    let code = e.code().unwrap_or("");
    let kind = e.kind();
    let said = server_text(e);
    if kind == ErrorKind::InvalidClientConfig {
        return Some(format!(
            "{said}: check the master name in the redis+sentinel:// url"
        ));
    }
    if kind == ErrorKind::AuthenticationFailed || code == "WRONGPASS" || code == "NOAUTH" {
        return Some(format!(
            "authentication failed ({said}): check the user and password in the url"
        ));
    }
    if code == "NOPERM" {
        return Some(format!(
            "the user may not run a command the store needs ({said}): grant it with ACL SETUSER"
        ));
    }
    if matches!(
        kind,
        ErrorKind::Server(ServerErrorKind::Moved) | ErrorKind::Server(ServerErrorKind::Ask)
    ) {
        return Some(format!(
            "the server is a Redis Cluster node ({said}); cluster mode is not supported: \
             connect to a single node or a managed non-cluster endpoint"
        ));
    }
    if e.detail().is_some_and(|d| d.contains("DB index")) {
        return Some(format!("the database does not exist ({said})"));
    }
    None
}

/// A driver error in the server's own words when the server answered
/// (`NOPERM this user has no permissions …`: redis-rs prints the code as
/// `NoPerm` or `"WRONGPASS"`), else as the driver prints it.
pub(crate) fn server_text(e: &RedisError) -> String {
    match (e.code(), e.detail()) {
        (Some(code), Some(detail))
            if matches!(e.kind(), ErrorKind::Server(_) | ErrorKind::Extension) =>
        {
            format!("{code} {detail}")
        }
        _ => e.to_string(),
    }
}

/// The TLS error under a driver error: rustls's own, or one an I/O error
/// carries.
fn tls_error(e: &RedisError) -> Option<&rustls::Error> {
    let src = std::error::Error::source(e)?;
    // redis-rs keeps the cause as an `Arc<dyn Error>`, which `source()`
    // hands out as itself.
    let inner: &(dyn std::error::Error + 'static) =
        match src.downcast_ref::<Arc<dyn std::error::Error + Send + Sync>>() {
            Some(a) => &**a,
            None => src,
        };
    if let Some(t) = inner.downcast_ref::<rustls::Error>() {
        return Some(t);
    }
    inner
        .downcast_ref::<std::io::Error>()?
        .get_ref()?
        .downcast_ref::<rustls::Error>()
}

/// A failure to open the first connection, or of a check made on it.
pub(crate) fn connect_error(server: &str, e: RedisError) -> StateError {
    if let Some(why) = refusal(&e) {
        return StateError::refused(format!("redis {server}: {why}"), Some(Box::new(e)));
    }
    StateError::unavailable(
        format!("redis {server}: cannot connect: {}", server_text(&e)),
        Some(std::io::Error::other(e)),
    )
}

/// What `CONFIG GET` says about durability, or why it could not be read.
pub(crate) async fn read_persistence(
    conn: &mut (impl ::redis::aio::ConnectionLike + Send),
    server: &str,
    opts: &RedisOptions,
) -> Result<Persistence> {
    async fn read(
        conn: &mut (impl ::redis::aio::ConnectionLike + Send),
        name: &str,
    ) -> std::result::Result<String, RedisError> {
        let pair: Vec<String> = ::redis::cmd("CONFIG")
            .arg("GET")
            .arg(name)
            .query_async(conn)
            .await?;
        Ok(pair.get(1).cloned().unwrap_or_default())
    }
    let got = async {
        Ok::<_, RedisError>((
            read(conn, "maxmemory-policy").await?,
            read(conn, "appendonly").await?,
            read(conn, "appendfsync").await?,
        ))
    }
    .await;
    let p = match got {
        Ok((maxmemory_policy, appendonly, appendfsync)) => Persistence {
            appendonly,
            appendfsync,
            maxmemory_policy,
            stated: None,
        },
        Err(e) if !is_server_reply(&e) => {
            return Err(connect_error(server, e));
        }
        Err(e) => match opts.assumed {
            Some(a) => Persistence {
                appendonly: if a.appendfsync_always {
                    "yes"
                } else {
                    "unknown"
                }
                .into(),
                appendfsync: if a.appendfsync_always {
                    "always"
                } else {
                    "unknown"
                }
                .into(),
                maxmemory_policy: if a.noeviction {
                    "noeviction"
                } else {
                    "unknown"
                }
                .into(),
                stated: Some(server_text(&e)),
            },
            None => {
                let fsync = if opts.require_fsync {
                    " and that it fsyncs every write (appendfsync always)"
                } else {
                    ""
                };
                return Err(StateError::refused(
                    format!(
                        "redis {server}: cannot read the server's settings with CONFIG GET ({}); \
                         the store must know that the server never evicts keys \
                         (maxmemory-policy noeviction){fsync}. Either let this user run it \
                         (ACL SETUSER <user> +config|get), or, for a managed service that \
                         disables CONFIG, state what the service guarantees with \
                         RedisOptions::durability_assumed(true, <fsyncs every write>)",
                        server_text(&e)
                    ),
                    Some(Box::new(e)),
                ));
            }
        },
    };
    if p.maxmemory_policy != "noeviction" {
        let how = if p.stated.is_some() {
            "RedisOptions::durability_assumed(false, _) states that the server may evict keys"
                .to_string()
        } else {
            format!("maxmemory-policy is {}", p.maxmemory_policy)
        };
        return Err(StateError::refused(
            format!(
                "redis {server}: {how}: under memory pressure the server would delete records \
                 without an error; run it with noeviction (CONFIG SET maxmemory-policy \
                 noeviction, and in redis.conf), so a full server refuses writes (OOM) instead"
            ),
            None,
        ));
    }
    if opts.require_fsync && !p.survives_crash() {
        let fix = if p.stated.is_some() {
            "state that the service fsyncs every write \
             (RedisOptions::durability_assumed(true, true)) if it does"
        } else {
            "run the server with `appendonly yes` and `appendfsync always` \
             (CONFIG SET appendonly yes; CONFIG SET appendfsync always; and in redis.conf)"
        };
        return Err(StateError::refused(
            format!(
                "redis {server}: {}; refusing to connect because RedisOptions::require_fsync \
                 is on: {fix}, or connect with require_fsync(false) to accept the loss",
                p.describe()
            ),
            None,
        ));
    }
    Ok(p)
}

/// Refuses a Redis Cluster node (`INFO cluster` says `cluster_enabled:1`).
/// A server that hides `INFO` passes; a `MOVED` reply later is refused
/// the same way (see [`refusal`]).
/// With `RedisOptions::wait_replicas(want, …)`: the server must be a
/// master with at least `want` replicas connected, else `Refused`.
pub(crate) async fn refuse_too_few_replicas(
    conn: &mut (impl ::redis::aio::ConnectionLike + Send),
    server: &str,
    want: u32,
) -> Result<()> {
    let info: String = ::redis::cmd("INFO")
        .arg("replication")
        .query_async(conn)
        .await
        .map_err(|e| connect_error(server, e))?;
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
            .map(str::to_string)
    };
    let role = field("role").unwrap_or_default();
    let replicas: u32 = field("connected_slaves")
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    if role != "master" || replicas < want {
        return Err(StateError::refused(
            format!(
                "redis {server}: wait_replicas asks {want} replica(s) to confirm every write, \
                 but the server is a {role} with connected_slaves:{replicas}: an acknowledged \
                 write could not wait for them; add replicas, or lower or drop wait_replicas"
            ),
            None,
        ));
    }
    Ok(())
}

pub(crate) async fn refuse_cluster(
    conn: &mut (impl ::redis::aio::ConnectionLike + Send),
    server: &str,
) -> Result<()> {
    match ::redis::cmd("INFO")
        .arg("cluster")
        .query_async::<String>(conn)
        .await
    {
        Ok(info) if info.lines().any(|l| l.trim() == "cluster_enabled:1") => {
            Err(StateError::refused(
                format!(
                    "redis {server}: the server runs in cluster mode (cluster_enabled:1); \
                     cluster mode is not supported: connect to a single node or a managed \
                     non-cluster endpoint"
                ),
                None,
            ))
        }
        Ok(_) => Ok(()),
        Err(e) if !is_server_reply(&e) => Err(connect_error(server, e)),
        Err(e) if refusal(&e).is_some() && e.code() != Some("NOPERM") => {
            Err(connect_error(server, e))
        }
        Err(_) => Ok(()),
    }
}

/// Writes all of `buf` to `s`, within the caller's timeout.
async fn write_all(s: &tokio::net::TcpStream, mut buf: &[u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        s.writable().await?;
        match s.try_write(buf) {
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads the first bytes `s` answers (none when it closes first).
async fn read_some(s: &tokio::net::TcpStream) -> std::io::Result<Vec<u8>> {
    let mut buf = [0u8; 16];
    loop {
        s.readable().await?;
        match s.try_read(&mut buf) {
            Ok(n) => return Ok(buf[..n].to_vec()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
}

/// Whether the server at `host:port` speaks the other protocol than the
/// URL's, asked after a dial failed without a server's answer (or, for
/// TLS, went unanswered a moment). For a plain URL (`url_tls` false) a
/// TLS `ClientHello` is sent: a TLS server answers a TLS record. For a
/// `rediss://` URL a plain `PING` is sent: a plain Redis answers `+PONG`
/// or an error reply (a TLS server drops the connection). `false` when
/// neither came within `within`.
pub(crate) async fn speaks_other(host: &str, port: u16, url_tls: bool, within: Duration) -> bool {
    let probe = async {
        let s = tokio::net::TcpStream::connect((host, port)).await.ok()?;
        if url_tls {
            write_all(&s, b"PING\r\n").await.ok()?;
            let got = read_some(&s).await.ok()?;
            Some(matches!(got.first(), Some(b'+' | b'-')))
        } else {
            write_all(&s, &client_hello(host)?).await.ok()?;
            let got = read_some(&s).await.ok()?;
            // A TLS record: handshake (0x16) or alert (0x15), version 3.x.
            Some(matches!(got.as_slice(), [0x15 | 0x16, 3, ..]))
        }
    };
    matches!(tokio::time::timeout(within, probe).await, Ok(Some(true)))
}

/// A TLS `ClientHello` for `host`, as rustls writes it (no certificate is
/// checked: the probe reads only the first bytes of the answer).
fn client_hello(host: &str) -> Option<Vec<u8>> {
    #[allow(deprecated)]
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .ok()?
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from(host.to_string()).ok()?;
    let mut conn = rustls::ClientConnection::new(Arc::new(config), name).ok()?;
    let mut out = Vec::new();
    conn.write_tls(&mut out).ok()?;
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentstate_core::error::PersistenceReason;

    /// A server's error reply as redis-rs hands it over.
    fn reply(wire: &str) -> RedisError {
        match ::redis::parse_redis_value(wire.as_bytes()).expect("parses") {
            ::redis::Value::ServerError(e) => e.into(),
            v => panic!("not an error: {v:?}"),
        }
    }

    #[test]
    fn moved_and_ask_are_refused_not_corrupt() {
        for wire in [
            "-MOVED 3999 127.0.0.1:6381\r\n",
            "-ASK 3999 127.0.0.1:6381\r\n",
        ] {
            let e = super::super::map_err(reply(wire));
            assert!(
                matches!(
                    e,
                    StateError::Persistence {
                        reason: PersistenceReason::Refused,
                        ..
                    }
                ),
                "{e:?}"
            );
            let msg = e.to_string();
            assert!(msg.contains("cluster mode is not supported"), "{msg}");
            assert!(msg.contains("3999 127.0.0.1:6381"), "{msg}");
        }
    }

    /// E3: what redis-rs reports for a reply cut short (its parser's
    /// "Unexpected end of input", an EOF, a reset) is the transport's:
    /// `Unavailable`, never `Corrupt`; a server's error reply is not.
    #[test]
    fn e3_a_cut_reply_is_unavailable_not_corrupt() {
        let cut = [
            RedisError::from(::redis::ParsingError::from(
                "Parse error at 0\nUnexpected end of input\nexpected 3 more elements",
            )),
            RedisError::from(std::io::Error::from(std::io::ErrorKind::UnexpectedEof)),
            RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset)),
            RedisError::from(std::io::Error::from(std::io::ErrorKind::BrokenPipe)),
        ];
        for e in cut {
            assert!(!is_server_reply(&e), "{e:?}");
            let s = super::super::map_err(e);
            assert!(
                matches!(
                    s,
                    StateError::Persistence {
                        reason: PersistenceReason::Unavailable,
                        ..
                    }
                ),
                "{s:?}"
            );
        }
        assert!(is_server_reply(&reply("-ERR user_script:1: boom\r\n")));
        assert!(is_server_reply(&reply("-OOM command not allowed\r\n")));
        // A complete reply of another shape than asked for is ours to
        // decode: Corrupt.
        let e = decode::<i64>(::redis::Value::BulkString(b"not a number".to_vec()))
            .expect_err("not an integer");
        assert!(matches!(e, StateError::Corrupt { .. }), "{e:?}");
    }

    #[test]
    fn refusals_keep_the_servers_words() {
        for (wire, said) in [
            (
                "-NOPERM this user has no permissions to run the 'evalsha' command\r\n",
                "NOPERM this user has no permissions to run the 'evalsha' command",
            ),
            (
                "-WRONGPASS invalid username-password pair or user is disabled.\r\n",
                "WRONGPASS invalid username-password pair",
            ),
            (
                "-NOAUTH Authentication required.\r\n",
                "NOAUTH Authentication required.",
            ),
        ] {
            let e = super::super::map_err(reply(wire));
            assert!(!e.is_retryable(), "{e:?}");
            assert!(e.to_string().contains(said), "{e}");
        }
        // Still as before: a script's own error is Corrupt, OOM Unavailable.
        let e = super::super::map_err(reply("-ERR user_script:1: boom\r\n"));
        assert!(matches!(e, StateError::Corrupt { .. }), "{e:?}");
        let e = super::super::map_err(reply(
            "-OOM command not allowed when used memory > 'maxmemory'.\r\n",
        ));
        assert!(e.is_retryable(), "{e:?}");
    }
}
