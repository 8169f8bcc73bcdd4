//! Opening connections and telling why one failed: the URL read once
//! (credentials and database taken out so the store authenticates itself
//! and keeps the server's own answer), TLS on rustls, the first
//! connection made outside the pool so its error comes back at once, and
//! the checks a server must pass before the store uses it (not a cluster
//! node, no eviction, fsync when required).

use std::sync::Arc;
use std::time::Duration;

use ::redis::{ConnectionAddr, ErrorKind, IntoConnectionInfo, RedisError, ServerErrorKind};
use parking_lot::Mutex;

use crate::error::{Result, StateError};

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

/// Opens connections with the store's timeouts; r2d2 pools them.
#[derive(Debug)]
pub(crate) struct Manager {
    client: ::redis::Client,
    auth: Option<Auth>,
    db: i64,
    connect_timeout: Duration,
    io_timeout: Duration,
    /// The last failure of a connection the pool opened (see [`KeepLast`]).
    pub(crate) last: Arc<Mutex<Option<RedisError>>>,
}

impl Manager {
    /// Reads `url` and the TLS options into a manager; `server` is the URL
    /// without its password, for messages.
    pub(crate) fn new(url: &str, server: &str, opts: &RedisOptions) -> Result<Manager> {
        let info = url
            .into_connection_info()
            .map_err(|e| StateError::invalid(format!("redis url {server}: {e}")))?;
        let tls = matches!(info.addr(), ConnectionAddr::TcpTls { .. });
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
        let client = match &opts.tls {
            Some(pems) => {
                if !tls {
                    return Err(StateError::invalid(format!(
                        "redis url {server}: TLS certificates were given (RedisOptions::tls_ca_pem / \
                         tls_client_pem) but the url is not rediss://"
                    )));
                }
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
                ::redis::Client::build_with_tls(info, certs).map_err(|e| {
                    StateError::invalid(format!("redis {server}: TLS certificates: {e}"))
                })?
            }
            None => ::redis::Client::open(info)
                .map_err(|e| StateError::invalid(format!("redis url {server}: {e}")))?,
        };
        Ok(Manager {
            client,
            auth,
            db,
            connect_timeout: opts.connect_timeout,
            io_timeout: opts.io_timeout,
            last: Arc::new(Mutex::new(None)),
        })
    }

    /// Opens one connection: TCP (and TLS), `AUTH`, `SELECT`.
    pub(crate) fn open(&self) -> std::result::Result<::redis::Connection, RedisError> {
        let mut c = self
            .client
            .get_connection_with_timeout(self.connect_timeout)?;
        c.set_read_timeout(Some(self.io_timeout))?;
        c.set_write_timeout(Some(self.io_timeout))?;
        if let Some(a) = &self.auth {
            let auth = |with_user: bool| {
                let mut cmd = ::redis::cmd("AUTH");
                if with_user && let Some(u) = &a.username {
                    cmd.arg(u);
                }
                cmd.arg(&a.password);
                cmd
            };
            match auth(true).query::<()>(&mut c) {
                // A server older than ACLs takes the password alone.
                Err(e)
                    if a.username.is_some()
                        && e.detail()
                            .is_some_and(|d| d.contains("wrong number of arguments")) =>
                {
                    auth(false).query::<()>(&mut c)?
                }
                r => r?,
            }
        }
        if self.db != 0 {
            ::redis::cmd("SELECT").arg(self.db).query::<()>(&mut c)?;
        }
        Ok(c)
    }
}

impl r2d2::ManageConnection for Manager {
    type Connection = ::redis::Connection;
    type Error = RedisError;

    fn connect(&self) -> std::result::Result<Self::Connection, Self::Error> {
        self.open()
    }

    fn is_valid(&self, conn: &mut Self::Connection) -> std::result::Result<(), Self::Error> {
        ::redis::cmd("PING").query::<String>(conn).map(|_| ())
    }

    fn has_broken(&self, conn: &mut Self::Connection) -> bool {
        !::redis::ConnectionLike::is_open(conn)
    }
}

/// Keeps the pool's last connection failure, so a checkout that times
/// out says why (r2d2 keeps only its text).
#[derive(Debug)]
pub(crate) struct KeepLast(pub(crate) Arc<Mutex<Option<RedisError>>>);

impl r2d2::HandleError<RedisError> for KeepLast {
    fn handle_error(&self, e: RedisError) {
        *self.0.lock() = Some(e);
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
            _ => format!("TLS failed ({tls}): is this port a TLS port?"),
        });
    }
    let code = e.code().unwrap_or("");
    let kind = e.kind();
    let said = server_text(e);
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
    let hint = if e.is_connection_dropped() || e.kind() == ErrorKind::Parse {
        " (if the server takes TLS only, use rediss://)"
    } else {
        ""
    };
    StateError::unavailable(
        format!("redis {server}: cannot connect: {}{hint}", server_text(&e)),
        Some(std::io::Error::other(e)),
    )
}

/// What `CONFIG GET` says about durability, or why it could not be read.
pub(crate) fn read_persistence(
    conn: &mut ::redis::Connection,
    server: &str,
    opts: &RedisOptions,
) -> Result<Persistence> {
    let read =
        |conn: &mut ::redis::Connection, name: &str| -> std::result::Result<String, RedisError> {
            let pair: Vec<String> = ::redis::cmd("CONFIG").arg("GET").arg(name).query(conn)?;
            Ok(pair.get(1).cloned().unwrap_or_default())
        };
    let got = read(conn, "maxmemory-policy").and_then(|policy| {
        Ok((
            policy,
            read(conn, "appendonly")?,
            read(conn, "appendfsync")?,
        ))
    });
    let p = match got {
        Ok((maxmemory_policy, appendonly, appendfsync)) => Persistence {
            appendonly,
            appendfsync,
            maxmemory_policy,
            stated: None,
        },
        Err(e) if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() => {
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
pub(crate) fn refuse_cluster(conn: &mut ::redis::Connection, server: &str) -> Result<()> {
    match ::redis::cmd("INFO").arg("cluster").query::<String>(conn) {
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
        Err(e) if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() => {
            Err(connect_error(server, e))
        }
        Err(e) if refusal(&e).is_some() && e.code() != Some("NOPERM") => {
            Err(connect_error(server, e))
        }
        Err(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::PersistenceReason;

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
