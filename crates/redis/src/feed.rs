//! The change feed on Redis (rules F1–F9).
//!
//! Each scope is a sorted set (see `lua/lib.lua`): a tenant's runs and
//! sessions under the tenant's hash tag (`as:{t…}:fd`), the store's trays
//! and alarms under `{trays}` (`as:{trays}:fd`), and each env's trays
//! beside it (`as:{trays}:fd:e:<env>`, positions of the trays feed). A
//! record's member is its identity in the key codec, scored by the
//! position of its last change, taken from the scope's counter (`…fd:n`)
//! by the write script itself: every write is one Lua script, and Redis
//! runs one at a time, so positions are handed out in commit order and no
//! reader ever sees a later position before an earlier one (F4). A
//! delete leaves the member, whose record a reader then finds absent: a
//! tombstone. `changes` is one read-only script (`lua/feed_read.lua`):
//! the horizon check, the range by score and each member's record, all
//! at one instant.
//!
//! Waiting (F5): every script that changes a scope publishes on the
//! scope's channel (`…fd:c`, an env's `…fd:c:<env>`). [`Hub`] holds one
//! subscriber connection per store, dialed when a waiter first needs it
//! (on the store's runtime, with the URL's credentials and TLS), and fans
//! each message out to the waiters of its channel. A waiter subscribes,
//! then reads the feed again (a commit between its first read and its
//! subscription is seen by that read), then waits for a message, a
//! periodic re-read, or its timeout. Without a subscription (the server
//! refused it, or the connection broke) it polls instead, and the hub
//! dials again a little later.
//!
//! The counters' values are the positions' ordinals: a position handed out
//! is [`bind`] of the store's secret, the scope and the ordinal (an env's
//! feed's positions are bound to the env's scope), and one given to a
//! call is read back with [`unbind`] before any script runs (F9: another
//! scope's, another store's or a forged one is `Invalid`). Only ordinals
//! reach the scripts.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use ::redis::aio::PubSubSink;
use tokio::sync::watch;

use agentstate_core::codec::key::KeyReader;
use agentstate_core::error::{Result, StateError};
use agentstate_core::feed::{
    Change, ChangePage, Changed, FeedScope, Position, ScopeView, bind, check_call, unbind,
};
use agentstate_core::record::{RunKey, SessionKey};
use agentstate_core::tray::Alarm;

use super::connect::{Dialer, QueryOn};
use super::runs::{Reply, decode_run, decode_session, num, text};
use super::scripts::{FEED, FEED_READ};
use super::trays::decode_tray;
use super::{RedisStore, keys};

/// How often a waiter polls while it has no subscription.
const POLL: Duration = Duration::from_millis(50);
/// How often a subscribed waiter reads the feed anyway (a message lost
/// with a connection that died silently costs at most this).
const RECHECK: Duration = Duration::from_secs(2);
/// How long the hub waits before dialing again after a failure.
const REDIAL: Duration = Duration::from_millis(500);
/// How often an idle subscriber connection is pinged.
const PING: Duration = Duration::from_secs(30);
/// Channels kept subscribed with no waiter before they are dropped.
const IDLE_CHANNELS: usize = 256;
/// Entries one prune script reads at most.
const PRUNE_BATCH: usize = 1000;

/// The keys and arguments of one scope's feed.
struct Scope {
    /// The sorted set read.
    set: Vec<u8>,
    /// The scope's own feed (a tenant's, or the trays'): its counter and
    /// horizon.
    fd: Vec<u8>,
    channel: Vec<u8>,
    kind: &'static str,
    /// The prefixes of the records' hashes: a tenant's runs and sessions,
    /// or the trays and the instances.
    a: Vec<u8>,
    b: Vec<u8>,
}

impl Scope {
    fn of(scope: &FeedScope) -> Scope {
        match scope.view() {
            ScopeView::Tenant(tenant) => {
                let p = keys::tenant(tenant);
                let fd = keys::feed(&p);
                Scope {
                    set: fd.clone(),
                    channel: keys::feed_channel(&fd),
                    fd,
                    kind: "tenant",
                    a: keys::run_base(&p),
                    b: keys::session_base(&p),
                }
            }
            ScopeView::Trays(env) => {
                let fd = keys::trays_feed();
                let (set, channel) = match env {
                    Some(e) => (keys::env_feed(e), keys::env_channel(e)),
                    None => (fd.clone(), keys::feed_channel(&fd)),
                };
                Scope {
                    set,
                    channel,
                    fd,
                    kind: "trays",
                    a: keys::all_tray_base(),
                    b: keys::instance_base(),
                }
            }
        }
    }
}

/// An ordinal as the scripts take it: a decimal u64 (no ordinal of a
/// Redis feed is past 2^53; a larger one, which only a store's own secret
/// could bind, reads as the largest).
fn dec(n: u128) -> String {
    u64::try_from(n).unwrap_or(u64::MAX).to_string()
}

/// An ordinal as the scripts answer it (a counter, or a sorted set's
/// score).
fn ordinal(b: &[u8]) -> Result<u64> {
    let s = std::str::from_utf8(b)
        .map_err(|_| StateError::corrupt("redis: a feed position is not text"))?;
    if let Ok(n) = s.parse::<u64>() {
        return Ok(n);
    }
    match s.parse::<f64>() {
        Ok(f) if f >= 0.0 && f.fract() == 0.0 && f < 2f64.powi(64) => Ok(f as u64),
        _ => Err(StateError::corrupt(format!(
            "redis: feed position {s:?} is not a whole number"
        ))),
    }
}

/// One entry of a feed as its record: the member, and the stored value
/// (`None` for a tombstone).
fn decode(scope: &FeedScope, member: &[u8], value: Option<&[u8]>) -> Result<Changed> {
    match scope.view() {
        ScopeView::Tenant(tenant) => match member.first() {
            Some(b'r') => {
                let mut r = KeyReader::new(member, b'r')?;
                let key = RunKey::new(tenant, r.str()?);
                r.end()?;
                Ok(match value {
                    Some(v) => Changed::Run {
                        run: decode_run(v, &key)?,
                    },
                    None => Changed::RunDeleted { key },
                })
            }
            Some(b's') => {
                let mut r = KeyReader::new(member, b's')?;
                let key = SessionKey::new(tenant, r.str()?);
                r.end()?;
                Ok(match value {
                    Some(v) => Changed::Session {
                        session: decode_session(v, &key)?,
                    },
                    None => Changed::SessionDeleted { key },
                })
            }
            _ => Err(StateError::corrupt(
                "redis: a tenant's feed holds a member that is no run or session",
            )),
        },
        ScopeView::Trays(_) => {
            let (instance, rest) = keys::read_inst(member)?;
            if rest.is_empty() {
                return Ok(match value {
                    Some(v) => Changed::Alarm {
                        alarm: Alarm::new(instance, num(v, "an alarm's due_at")?),
                    },
                    None => Changed::AlarmDeleted { instance },
                });
            }
            let (tray_ns, tray_id) = keys::read_tray_member(rest)?;
            let key = instance.tray(tray_ns, tray_id);
            Ok(match value {
                Some(v) => Changed::Tray {
                    tray: decode_tray(v)?,
                    key,
                },
                None => Changed::TrayDeleted { key },
            })
        }
    }
}

impl RedisStore {
    pub(super) async fn changes(
        &self,
        scope: &FeedScope,
        after: Position,
        limit: usize,
    ) -> Result<ChangePage> {
        check_call(scope, limit, None)?;
        let after_n = unbind(&self.secret().await?, scope, after)?;
        self.read_changes(scope, after, after_n, limit).await
    }

    /// The position of the ordinal `n` of `scope` (F9).
    async fn bound(&self, scope: &FeedScope, n: u64) -> Result<Position> {
        bind(&self.secret().await?, scope, u128::from(n))
    }

    /// `changes`, its arguments checked and `after` unbound (`after_n`).
    async fn read_changes(
        &self,
        scope: &FeedScope,
        after: Position,
        after_n: u128,
        limit: usize,
    ) -> Result<ChangePage> {
        let s = Scope::of(scope);
        let mut conn = self.conn().await?;
        let reply: Reply = FEED_READ
            .key(&s.set)
            .key(keys::feed_counter(&s.fd))
            .key(keys::feed_horizon(&s.fd))
            .arg(s.kind)
            .arg(&s.a)
            .arg(&s.b)
            .arg(dec(after_n))
            .arg(limit.to_string())
            .invoke(&mut conn)
            .await?;
        let mut it = reply.into_iter();
        match it.next().as_deref() {
            Some(b"ok") => {}
            Some(b"pruned") => {
                let horizon = it.next().unwrap_or_default();
                return Err(StateError::FeedPruned {
                    scope: scope.clone(),
                    horizon: self.bound(scope, ordinal(&horizon)?).await?,
                });
            }
            other => {
                return Err(StateError::corrupt(format!(
                    "redis: unexpected feed answer {:?}",
                    other.map(text)
                )));
            }
        }
        let rest: Reply = it.collect();
        if !rest.len().is_multiple_of(4) {
            return Err(StateError::corrupt("redis: feed answer malformed"));
        }
        let mut changes = Vec::with_capacity(rest.len() / 4);
        for e in rest.chunks_exact(4) {
            let value = (e[2] == b"1").then_some(e[3].as_slice());
            changes.push(Change::new(
                self.bound(scope, ordinal(&e[1])?).await?,
                decode(scope, &e[0], value)?,
            ));
        }
        let next = changes.last().map_or(after, |c| c.position);
        Ok(ChangePage::new(changes, next))
    }

    pub(super) async fn feed_head(&self, scope: &FeedScope) -> Result<Position> {
        check_call(scope, 1, None)?;
        let s = Scope::of(scope);
        let mut conn = self.conn().await?;
        let n: Option<Vec<u8>> = ::redis::cmd("GET")
            .arg(keys::feed_counter(&s.fd))
            .query_on(&mut conn)
            .await?;
        match n {
            Some(n) => self.bound(scope, ordinal(&n)?).await,
            None => Ok(Position::START),
        }
    }

    pub(super) async fn prune_changes(&self, scope: &FeedScope, through: Position) -> Result<u64> {
        if let FeedScope::Trays { env: Some(env) } = scope {
            return Err(StateError::invalid(format!(
                "prune_changes: the feed of env {env:?} is pruned with the trays feed's \
                 (FeedScope::trays()); tombstones are pruned store-wide"
            )));
        }
        check_call(scope, 1, None)?;
        let through = unbind(&self.secret().await?, scope, through)?;
        let s = Scope::of(scope);
        let mut conn = self.conn().await?;
        self.writable(&mut conn).await?;
        let mut through = dec(through);
        let mut from = String::new();
        let mut dropped = 0u64;
        loop {
            let reply: Reply = FEED
                .key(&s.fd)
                .arg("prune")
                .arg(s.kind)
                .arg(&s.a)
                .arg(&s.b)
                .arg(&through)
                .arg(&from)
                .arg(PRUNE_BATCH.to_string())
                .invoke(&mut conn)
                .await?;
            let [n, last, upto] = reply.as_slice() else {
                return Err(StateError::corrupt("redis: prune answer malformed"));
            };
            dropped += num(n, "pruned tombstones")?;
            if last.is_empty() {
                return Ok(dropped);
            }
            through = text(upto);
            from = text(last);
        }
    }

    pub(super) async fn wait_changes(
        &self,
        scope: &FeedScope,
        after: Position,
        limit: usize,
        timeout: Duration,
    ) -> Result<ChangePage> {
        check_call(scope, limit, Some(timeout))?;
        let after_n = unbind(&self.secret().await?, scope, after)?;
        let deadline = Instant::now() + timeout;
        let channel = Scope::of(scope).channel;
        let mut listener: Option<Listener> = None;
        loop {
            let page = self.read_changes(scope, after, after_n, limit).await?;
            if !page.changes.is_empty() || Instant::now() >= deadline {
                return Ok(page);
            }
            if listener.is_none() {
                // On the store's runtime, so a listen cut short by the
                // wait's end still finishes (its channel stays coherent).
                let left = deadline.saturating_duration_since(Instant::now());
                let listen = self
                    .bridge
                    .handle()
                    .spawn(listen(self.hub.inner.clone(), channel.clone()));
                listener = match tokio::time::timeout(left, listen).await {
                    Ok(Ok(l)) => l,
                    _ => None,
                };
                if listener.is_some() {
                    // Subscribed: what committed before is seen by this
                    // read, what commits after publishes to us.
                    let page = self.read_changes(scope, after, after_n, limit).await?;
                    if !page.changes.is_empty() {
                        return Ok(page);
                    }
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match &mut listener {
                Some(l) => {
                    // A message or the wait's end (at most RECHECK): read
                    // again. The sender gone is the connection gone:
                    // listen again (or poll) after reading.
                    if let Ok(Err(_)) =
                        tokio::time::timeout(left.min(RECHECK), l.rx.changed()).await
                    {
                        listener = None;
                    }
                }
                None => tokio::time::sleep(left.min(POLL)).await,
            }
        }
    }
}

/// The store's subscriber connection and the waiters of each channel.
pub(super) struct Hub {
    inner: Arc<HubInner>,
}

struct HubInner {
    dialer: Arc<Dialer>,
    /// The live subscription; its lock is held while (un)subscribing, so
    /// a channel in `chans` is subscribed once a listener has it.
    conn: tokio::sync::Mutex<Option<Sub>>,
    chans: parking_lot::Mutex<HashMap<Vec<u8>, Chan>>,
    /// No dial before this, after one failed or a connection broke.
    retry_at: parking_lot::Mutex<Option<Instant>>,
    next_id: AtomicU64,
}

/// A live subscriber connection.
struct Sub {
    sink: PubSubSink,
    /// Its number: the reader of a connection that was replaced tears
    /// nothing down.
    id: u64,
    reader: tokio::task::JoinHandle<()>,
}

/// One channel's waiters.
struct Chan {
    tx: watch::Sender<u64>,
    users: usize,
    id: u64,
}

/// A waiter's subscription to one channel: `rx` changes on every message.
pub(super) struct Listener {
    rx: watch::Receiver<u64>,
    hub: Weak<HubInner>,
    channel: Vec<u8>,
    id: u64,
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Some(hub) = self.hub.upgrade()
            && let Some(c) = hub.chans.lock().get_mut(&self.channel)
            && c.id == self.id
        {
            c.users = c.users.saturating_sub(1);
        }
    }
}

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub")
            .field("channels", &self.inner.chans.lock().len())
            .finish_non_exhaustive()
    }
}

impl Hub {
    pub(super) fn new(dialer: Arc<Dialer>) -> Hub {
        Hub {
            inner: Arc::new(HubInner {
                dialer,
                conn: tokio::sync::Mutex::new(None),
                chans: parking_lot::Mutex::new(HashMap::new()),
                retry_at: parking_lot::Mutex::new(None),
                next_id: AtomicU64::new(1),
            }),
        }
    }
}

/// Subscribes to `channel` (dialing the subscriber connection first if
/// there is none): `Some` once the server confirmed the subscription,
/// `None` when there is none to be had now (the waiter polls). Runs on the
/// store's runtime (the connection's driver and reader are spawned there).
#[allow(clippy::expect_used, reason = "dialed above")]
async fn listen(inner: Arc<HubInner>, channel: Vec<u8>) -> Option<Listener> {
    let channel = &channel[..];
    let io_timeout = inner.dialer.io_timeout();
    let mut conn = inner.conn.lock().await;
    if conn.is_none() {
        if inner.retry_at.lock().is_some_and(|t| Instant::now() < t) {
            return None;
        }
        match inner.dialer.open_pubsub().await {
            Ok(ps) => {
                let (sink, stream) = ps.split();
                let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
                let reader = tokio::spawn(read(
                    stream,
                    sink.clone(),
                    Arc::downgrade(&inner),
                    id,
                    io_timeout,
                ));
                *conn = Some(Sub { sink, id, reader });
            }
            Err(e) => {
                agentstate_core::observe::retry("redis", "feed_subscribe", 1);
                tracing::debug!(error = %e, "redis: no subscriber connection; waiters poll");
                *inner.retry_at.lock() = Some(Instant::now() + REDIAL);
                return None;
            }
        }
    }
    let sub = conn.as_mut().expect("dialed above");
    let (listener, fresh) = {
        let mut chans = inner.chans.lock();
        let fresh = !chans.contains_key(channel);
        let c = chans.entry(channel.to_vec()).or_insert_with(|| Chan {
            tx: watch::channel(0).0,
            users: 0,
            id: inner.next_id.fetch_add(1, Ordering::Relaxed),
        });
        c.users += 1;
        let l = Listener {
            rx: c.tx.subscribe(),
            hub: Arc::downgrade(&inner),
            channel: channel.to_vec(),
            id: c.id,
        };
        (l, fresh)
    };
    if !fresh {
        return Some(listener);
    }
    // Channels nobody waits on any more go, a batch at a time.
    let idle: Vec<Vec<u8>> = {
        let mut chans = inner.chans.lock();
        if chans.len() > IDLE_CHANNELS * 2 {
            let idle: Vec<Vec<u8>> = chans
                .iter()
                .filter(|(_, c)| c.users == 0)
                .map(|(k, _)| k.clone())
                .collect();
            for k in &idle {
                chans.remove(k);
            }
            idle
        } else {
            Vec::new()
        }
    };
    let mut ok = idle.is_empty()
        || matches!(
            tokio::time::timeout(io_timeout, sub.sink.unsubscribe(&idle)).await,
            Ok(Ok(()))
        );
    ok = ok
        && matches!(
            tokio::time::timeout(io_timeout, sub.sink.subscribe(channel)).await,
            Ok(Ok(()))
        );
    if ok {
        return Some(listener);
    }
    // The connection is no good: drop it and wake every waiter.
    if let Some(sub) = conn.take() {
        sub.reader.abort();
    }
    inner.chans.lock().clear();
    *inner.retry_at.lock() = Some(Instant::now() + REDIAL);
    None
}

/// The reader of one subscriber connection: each message wakes its
/// channel's waiters. When the connection ends (or stops answering a
/// ping), it is dropped and every waiter is woken to read and listen
/// again.
async fn read(
    mut stream: ::redis::aio::PubSubStream,
    mut sink: PubSubSink,
    hub: Weak<HubInner>,
    id: u64,
    io_timeout: Duration,
) {
    loop {
        let next = std::future::poll_fn(|cx| {
            futures_core::Stream::poll_next(std::pin::Pin::new(&mut stream), cx)
        });
        match tokio::time::timeout(PING, next).await {
            Ok(Some(msg)) => {
                let Some(hub) = hub.upgrade() else { return };
                let channel: Vec<u8> = msg.get_channel().unwrap_or_default();
                if let Some(c) = hub.chans.lock().get(&channel) {
                    c.tx.send_modify(|n| *n = n.wrapping_add(1));
                }
            }
            Ok(None) => break,
            Err(_) => {
                let pong = tokio::time::timeout(io_timeout, sink.ping::<::redis::Value>()).await;
                if !matches!(pong, Ok(Ok(_))) {
                    break;
                }
            }
        }
    }
    let Some(hub) = hub.upgrade() else { return };
    let mut conn = hub.conn.lock().await;
    if conn.as_ref().is_some_and(|s| s.id == id) {
        *conn = None;
        hub.chans.lock().clear();
        *hub.retry_at.lock() = Some(Instant::now() + REDIAL);
    }
}
