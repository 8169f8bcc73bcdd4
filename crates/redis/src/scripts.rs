//! The Lua scripts, one `.lua` file each beside this one, each behind the
//! shared helpers of `lua/lib.lua`, and the one place they are called
//! ([`Call::invoke`], async, over one of the store's connections): by
//! SHA (`EVALSHA`), loading a script (`Script::load_async`) when the
//! server answers `NOSCRIPT` (after a restart or `SCRIPT FLUSH`).
//!
//! Every write script starts with the `#!lua` shebang: Redis then checks
//! for `OOM` and `MISCONF` before the script runs, and refuses it whole,
//! so a script never stops halfway through its writes. A write script
//! makes every refusal before its first write.
//!
//! A write script that takes idempotency keys has a keyed twin: the same
//! body wrapped as `local function body(KEYS, ARGV)`, followed by
//! `lua/idempotency.lua`, which takes the key's own KEYS and ARGV first
//! (see [`Idem`]), answers a kept key's reply, or runs the body and keeps
//! its reply with the key, in the same script.

use std::sync::LazyLock;

use ::redis::{FromRedisValue, Script, ToRedisArgs, Value};

use agentstate_core::error::{Result, StateError};
use agentstate_core::idempotency::{IdempotencyKey, Keyed, Scope, reused};
use agentstate_core::limits::IDEMPOTENCY_PRUNE_MAX;
use agentstate_core::options::IdempotencyWindow;

use super::connect::{Conn, Sent};
use super::{keys, map_err};

/// One script, and its keyed twin when it has one.
pub(crate) struct Lua {
    script: Script,
    keyed: Option<Script>,
    /// Whether the script may write: an I/O failure after it was sent
    /// leaves its outcome unknown.
    writes: bool,
}

macro_rules! script {
    ($name:ident, $file:literal) => {
        pub(crate) static $name: LazyLock<Lua> = LazyLock::new(|| Lua {
            script: Script::new(concat!(
                "#!lua\n",
                include_str!("lua/lib.lua"),
                include_str!(concat!("lua/", $file))
            )),
            keyed: None,
            writes: true,
        });
    };
    ($name:ident, $file:literal, keyed) => {
        pub(crate) static $name: LazyLock<Lua> = LazyLock::new(|| Lua {
            script: Script::new(concat!(
                "#!lua\n",
                include_str!("lua/lib.lua"),
                include_str!(concat!("lua/", $file))
            )),
            keyed: Some(Script::new(concat!(
                "#!lua\n",
                include_str!("lua/lib.lua"),
                "local function body(KEYS, ARGV)\n",
                include_str!(concat!("lua/", $file)),
                "\nend\n",
                include_str!("lua/idempotency.lua")
            ))),
            writes: true,
        });
    };
    ($name:ident, $file:literal, read_only) => {
        pub(crate) static $name: LazyLock<Lua> = LazyLock::new(|| Lua {
            script: Script::new(concat!(
                "#!lua flags=no-writes\n",
                include_str!("lua/lib.lua"),
                include_str!(concat!("lua/", $file))
            )),
            keyed: None,
            writes: false,
        });
    };
}

script!(PUT_RUN, "put_run.lua", keyed);
script!(PATCH_RUN, "patch_run.lua", keyed);
script!(PUT_SESSION, "put_session.lua");
script!(DELETE_SESSION, "delete_session.lua");
script!(DELETE_RUN, "delete_run.lua");
script!(TRAYS, "trays.lua", keyed);
script!(IMPORT, "import.lua");
script!(PRUNE, "prune.lua");
script!(PURGE, "purge.lua");
script!(LIST_RUNS, "list_runs.lua", read_only);
script!(READ_PAGES, "read_pages.lua", read_only);
script!(FEED, "feed.lua");
script!(FEED_READ, "feed_read.lua", read_only);
script!(BUDGETS, "budgets.lua", keyed);

/// A keyed call's idempotency arguments: its scope's keys (on the scope's
/// hash tag: a tenant's `ik`/`io`, or `{trays}`' `ik:`/`io:<ns>`), the
/// key, its fingerprint, the store's clock and its window.
pub(crate) struct Idem {
    hash: Vec<u8>,
    order: Vec<u8>,
    key: IdempotencyKey,
    fingerprint: [u8; 16],
    now: u64,
    window: IdempotencyWindow,
}

impl Idem {
    pub(crate) fn new(k: &Keyed<'_>, now: u64, window: IdempotencyWindow) -> Idem {
        let (hash, order) = match k.scope {
            Scope::Tenant(t) => {
                let p = keys::tenant(t);
                (keys::idem(&p), keys::idem_order(&p))
            }
            Scope::Trays(ns) => (keys::tray_idem(ns), keys::tray_idem_order(ns)),
        };
        Idem {
            hash,
            order,
            key: k.key.clone(),
            fingerprint: k.fingerprint,
            now,
            window,
        }
    }
}

impl Lua {
    pub(crate) fn prepare_invoke(&self) -> Call<'_> {
        Call {
            lua: self,
            keys: Vec::new(),
            args: Vec::new(),
            idem: None,
        }
    }
    pub(crate) fn key<T: ToRedisArgs>(&self, key: T) -> Call<'_> {
        let mut c = self.prepare_invoke();
        c.key(key);
        c
    }
}

/// One call of a script: its KEYS and ARGV, and its idempotency key.
pub(crate) struct Call<'a> {
    lua: &'a Lua,
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
    idem: Option<&'a Idem>,
}

impl<'a> Call<'a> {
    pub(crate) fn key<T: ToRedisArgs>(&mut self, key: T) -> &mut Self {
        self.keys.extend(key.to_redis_args());
        self
    }
    pub(crate) fn arg<T: ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        self.args.extend(arg.to_redis_args());
        self
    }
    /// Runs the call under `idem`'s key (the script's keyed twin).
    pub(crate) fn idem(&mut self, idem: Option<&'a Idem>) -> &mut Self {
        self.idem = idem;
        self
    }

    /// Runs the script and answers its reply.
    ///
    /// Which failure is which (rule I7), for a write script:
    /// - no connection (refused, unreachable, the dial timed out):
    ///   `Unavailable` or `Refused`, nothing was sent (that is the
    ///   caller's `conn()`, before this);
    /// - the connection was seen closed before the call was sent on it:
    ///   `Unavailable`, nothing was sent;
    /// - the call was handed to the connection, then it failed in
    ///   transport (dropped, reset, closed, the io timeout, a reply cut
    ///   short or garbled, whatever redis-rs calls it): the outcome is
    ///   unknown (`OutcomeUnknown { keyed: false }`;
    ///   keyed calls make it retryable with `StateError::keyed`). A
    ///   multiplexed connection cannot tell a command its socket never
    ///   took from one the server ran (nor a blocking one a write cut
    ///   short from one the server read whole), so any such failure is
    ///   unknown;
    /// - an error reply of the server (`OOM`, `MISCONF`, `BUSY`, `LOADING`,
    ///   `READONLY`, a script error raised before any write): as
    ///   [`map_err`] says (`Unavailable`, or `Corrupt`): the script did
    ///   not run, or refused before writing. `NOSCRIPT` loads the script
    ///   (redis-rs' `Script::load_async`) and sends the call again, judged
    ///   the same way.
    ///
    /// A read-only script's failures are all as [`map_err`] says.
    ///
    /// Dropped before it answers (a cancelled future), the call may still
    /// run on the server, whole: once handed to the connection's I/O task
    /// it is written even if no one waits for its answer.
    pub(crate) async fn invoke<T: FromRedisValue>(&self, conn: &mut Conn) -> Result<T> {
        let (script, cmd) = self.packed();
        let value = match self.send(conn, &cmd).await? {
            Value::ServerError(e) if e.code() == "NOSCRIPT" => {
                script.load_async(conn.raw()).await.map_err(|e| {
                    conn.note(&e);
                    map_err(e)
                })?;
                self.send(conn, &cmd).await?
            }
            v => v,
        };
        let value = match value {
            Value::ServerError(e) => {
                if e.code() == "IDEMREUSED"
                    && let Some(i) = self.idem
                {
                    return Err(reused(&i.key));
                }
                let e: ::redis::RedisError = e.into();
                conn.readonly(&e);
                return Err(map_err(e));
            }
            v => v,
        };
        if self.lua.writes
            && let Some((want, ms)) = conn.wait()
        {
            self.replicated(conn, want, ms).await?;
        }
        ::redis::from_redis_value(value)
            .map_err(|e| StateError::corrupt(format!("redis: script answer: {e}")))
    }

    /// `WAIT want ms` after a write ran on the master
    /// (`RedisOptions::wait_replicas`): fewer replicas confirming it in
    /// time, or the connection failing while waiting, leaves the write on
    /// the master and its survival of a failover unknown.
    async fn replicated(&self, conn: &mut Conn, want: u32, ms: u64) -> Result<()> {
        let mut cmd = ::redis::cmd("WAIT");
        cmd.arg(want).arg(ms);
        match conn.send(&cmd).await {
            Ok(Value::Int(n)) if n >= i64::from(want) => Ok(()),
            Ok(Value::Int(n)) => Err(StateError::outcome_unknown(
                format!(
                    "redis: the write ran on the master, but {n} of the {want} replica(s) \
                     wait_replicas asks for confirmed it within {ms} ms: it may not survive a \
                     failover; read the state before deciding again (or retry with the same \
                     idempotency key)"
                ),
                None,
            )),
            Ok(other) => Err(StateError::outcome_unknown(
                format!("redis: the write ran, and WAIT answered {other:?}"),
                None,
            )),
            Err(Sent::Maybe(e)) | Err(Sent::Not(e)) => {
                Err(unknown(e, "waiting for its replicas (WAIT)"))
            }
        }
    }

    /// The script to run and its `EVALSHA` command.
    fn packed(&self) -> (&Script, ::redis::Cmd) {
        let mut cmd = ::redis::cmd("EVALSHA");
        let script = match (self.idem, &self.lua.keyed) {
            (Some(i), Some(keyed)) => {
                cmd.arg(keyed.get_hash())
                    .arg(self.keys.len() + 2)
                    .arg(&i.hash)
                    .arg(&i.order)
                    .arg(&self.keys)
                    .arg(i.key.as_str())
                    .arg(&i.fingerprint[..])
                    .arg(i.now.to_string())
                    .arg(i.window.ttl_millis.to_string())
                    .arg(i.window.keys_max.to_string())
                    .arg(IDEMPOTENCY_PRUNE_MAX.to_string())
                    .arg(&self.args);
                keyed
            }
            (None, _) | (Some(_), None) => {
                debug_assert!(self.idem.is_none(), "a keyed call of a script without keys");
                cmd.arg(self.lua.script.get_hash())
                    .arg(self.keys.len())
                    .arg(&self.keys)
                    .arg(&self.args);
                &self.lua.script
            }
        };
        (script, cmd)
    }

    /// Sends one command and reads its reply, telling a failure before
    /// the command was handed to the connection from one after (see
    /// `invoke`).
    async fn send(&self, conn: &mut Conn, cmd: &::redis::Cmd) -> Result<Value> {
        match conn.send(cmd).await {
            Ok(v) => Ok(v),
            Err(Sent::Maybe(e)) if self.lua.writes => Err(unknown(e, "waiting for its answer")),
            // A read, or a write never sent (its connection was seen
            // closed first): whatever the transport failure, `Unavailable`.
            Err(s) => Err(s.unavailable()),
        }
    }
}

fn unknown(e: ::redis::RedisError, when: &str) -> StateError {
    StateError::outcome_unknown(
        format!(
            "redis: {e} while {when}: the write may have been applied or not; \
             read the state before deciding again (or retry with the same idempotency key)"
        ),
        Some(std::io::Error::other(e)),
    )
}
