//! Redis Sentinel: a `redis+sentinel://` (or `rediss+sentinel://`) URL
//! names the sentinels and the master's name; every connection the store
//! dials asks the sentinels, in the URL's order, where that master is
//! (`SENTINEL get-master-addr-by-name`), dials it as a plain URL would
//! (its credentials, database and TLS), and checks with `ROLE` that it is
//! the master before any call runs on it. After a failover the old
//! master's connections fail (or, if it lives on as a replica, answer
//! `READONLY`, which takes the connection out of the pool), and the next
//! dial finds the promoted replica.
//!
//! ```text
//! redis+sentinel://[user:password@]host:port[,host:port…]/<master name>[/<db>]
//!     [?sentinel_username=…&sentinel_password=…]
//! ```
//!
//! The user and password are the master's (and its replicas'); the
//! sentinels' own, when they require one, are the query's. A sentinel's
//! port defaults to 26379.

use std::time::Duration;

use ::redis::{
    AsyncConnectionConfig, ConnectionAddr, ConnectionInfo, ErrorKind, IntoConnectionInfo,
    RedisError,
};

use agentstate_core::error::{Result, StateError};

/// A sentinel URL, read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SentinelUrl {
    /// The sentinels, in the URL's order.
    pub(crate) sentinels: Vec<(String, u16)>,
    /// The master's name, as the sentinels know it.
    pub(crate) master: String,
    /// The master's URL with the first sentinel's address standing in for
    /// the master's (credentials, database, TLS and the rest of the query
    /// as the URL says); each dial puts the master's address in.
    pub(crate) template: String,
    /// The sentinels' own user and password.
    pub(crate) sentinel_auth: Option<(Option<String>, String)>,
    pub(crate) tls: bool,
}

/// Reads `url` when it is a sentinel URL; `None` for any other.
pub(crate) fn parse(url: &str, server: &str) -> Option<Result<SentinelUrl>> {
    let (tls, rest) = if let Some(r) = url.strip_prefix("redis+sentinel://") {
        (false, r)
    } else if let Some(r) = url.strip_prefix("rediss+sentinel://") {
        (true, r)
    } else {
        return None;
    };
    Some(parse_rest(tls, rest).map_err(|why| {
        StateError::invalid(format!(
            "redis url {server}: {why} (the form is \
             redis+sentinel://[user:password@]host:port[,host:port…]/<master name>[/<db>])"
        ))
    }))
}

fn parse_rest(tls: bool, rest: &str) -> std::result::Result<SentinelUrl, String> {
    let (rest, query) = match rest.split_once('?') {
        Some((r, q)) => (r, q),
        None => (rest, ""),
    };
    let (authority, path) = match rest.split_once('/') {
        Some((a, p)) => (a, p),
        None => (rest, ""),
    };
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    let mut sentinels = Vec::new();
    for h in hosts.split(',') {
        sentinels.push(host_port(h)?);
    }
    let mut segments = path.split('/');
    let master = segments
        .next()
        .map(percent_decode)
        .filter(|m| !m.is_empty())
        .ok_or("no master name after the sentinels")?;
    let db = match segments.next() {
        None | Some("") => 0,
        Some(d) => d
            .parse::<i64>()
            .map_err(|_| format!("database {d:?} is not a number"))?,
    };
    if segments.next().is_some_and(|s| !s.is_empty()) {
        return Err("more than a master name and a database in the path".into());
    }
    let mut kept = Vec::new();
    let (mut s_user, mut s_pass) = (None, None);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("sentinel_username", v)) => s_user = Some(percent_decode(v)),
            Some(("sentinel_password", v)) => s_pass = Some(percent_decode(v)),
            _ => kept.push(pair),
        }
    }
    let sentinel_auth = match (s_user, s_pass) {
        (u, Some(p)) => Some((u, p)),
        (Some(_), None) => return Err("sentinel_username without sentinel_password".into()),
        (None, None) => None,
    };
    let (h0, p0) = &sentinels[0];
    let host = if h0.contains(':') {
        format!("[{h0}]")
    } else {
        h0.clone()
    };
    let mut template = format!(
        "{}://{}{host}:{p0}/{db}",
        if tls { "rediss" } else { "redis" },
        userinfo.map(|u| format!("{u}@")).unwrap_or_default()
    );
    if !kept.is_empty() {
        template.push('?');
        template.push_str(&kept.join("&"));
    }
    Ok(SentinelUrl {
        sentinels,
        master,
        template,
        sentinel_auth,
        tls,
    })
}

/// `host:port`, `host` (port 26379) or `[v6]:port`.
fn host_port(h: &str) -> std::result::Result<(String, u16), String> {
    if h.is_empty() {
        return Err("an empty sentinel address".into());
    }
    let (host, port) = if let Some(r) = h.strip_prefix('[') {
        let (host, after) = r
            .split_once(']')
            .ok_or_else(|| format!("sentinel {h:?}: no closing ]"))?;
        (host, after.strip_prefix(':'))
    } else {
        match h.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (h, None),
        }
    };
    let port = match port {
        None => 26379,
        Some(p) => p
            .parse::<u16>()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| format!("sentinel {h:?}: port {p:?} is not a port"))?,
    };
    if host.is_empty() {
        return Err(format!("sentinel {h:?}: no host"));
    }
    Ok((host.to_string(), port))
}

fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}

/// The sentinels a dialer asks, and how.
#[derive(Debug)]
pub(crate) struct Sentinels {
    /// A client per sentinel, in the URL's order.
    nodes: Vec<(String, ::redis::Client)>,
    master: String,
    tls: bool,
}

impl Sentinels {
    /// Clients for the sentinels of `url` (TLS as the URL's scheme says,
    /// trusting what `build` trusts).
    pub(crate) fn new(
        url: &SentinelUrl,
        build: impl Fn(ConnectionInfo) -> Result<::redis::Client>,
    ) -> Result<Sentinels> {
        let mut nodes = Vec::with_capacity(url.sentinels.len());
        for (host, port) in &url.sentinels {
            let addr = if url.tls {
                ConnectionAddr::TcpTls {
                    host: host.clone(),
                    port: *port,
                    insecure: false,
                    tls_params: None,
                }
            } else {
                ConnectionAddr::Tcp(host.clone(), *port)
            };
            let mut settings = ::redis::RedisConnectionInfo::default();
            if let Some((user, pass)) = &url.sentinel_auth {
                settings = settings.set_password(pass);
                if let Some(u) = user {
                    settings = settings.set_username(u);
                }
            }
            let info = addr
                .into_connection_info()
                .map_err(|e| StateError::invalid(format!("sentinel {host}:{port}: {e}")))?
                .set_redis_settings(settings);
            nodes.push((format!("{host}:{port}"), build(info)?));
        }
        Ok(Sentinels {
            nodes,
            master: url.master.clone(),
            tls: url.tls,
        })
    }

    /// The master's name.
    pub(crate) fn master(&self) -> &str {
        &self.master
    }

    /// Where the sentinels say the master is: the first sentinel that
    /// answers with an address. No sentinel reached, or none that knows
    /// the master yet, is a transport-like failure (retryable); every
    /// reachable sentinel answering that it knows no master of that name
    /// is the configuration's (`InvalidClientConfig`, refused).
    pub(crate) async fn master_addr(
        &self,
        timeout: Duration,
        insecure: bool,
    ) -> std::result::Result<ConnectionAddr, RedisError> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout));
        let mut failures = Vec::new();
        let mut unknown = 0;
        for (name, client) in &self.nodes {
            let mut c = match client
                .get_multiplexed_async_connection_with_config(&config)
                .await
            {
                Ok(c) => c,
                Err(e) => {
                    failures.push(format!("{name}: {e}"));
                    continue;
                }
            };
            let r: std::result::Result<Option<(String, u16)>, RedisError> =
                ::redis::cmd("SENTINEL")
                    .arg("get-master-addr-by-name")
                    .arg(&self.master)
                    .query_async(&mut c)
                    .await;
            match r {
                Ok(Some((host, port))) => {
                    return Ok(if self.tls {
                        ConnectionAddr::TcpTls {
                            host,
                            port,
                            insecure,
                            tls_params: None,
                        }
                    } else {
                        ConnectionAddr::Tcp(host, port)
                    });
                }
                Ok(None) => {
                    unknown += 1;
                    failures.push(format!("{name}: knows no master named {:?}", self.master));
                }
                Err(e) => failures.push(format!("{name}: {e}")),
            }
        }
        let detail = failures.join("; ");
        if unknown > 0 && unknown == self.nodes.len() {
            return Err(RedisError::from((
                ErrorKind::InvalidClientConfig,
                "no sentinel knows the master",
                detail,
            )));
        }
        Err(RedisError::from(std::io::Error::new(
            std::io::ErrorKind::NotConnected,
            format!("no sentinel named the master: {detail}"),
        )))
    }
}

/// Checks with `ROLE` that `conn` reached a master: a sentinel's answer
/// from before a failover finished may name a replica (or a demoted
/// master). Not a master is a transport-like failure: the next dial asks
/// again.
pub(crate) async fn check_master(
    conn: &mut (impl ::redis::aio::ConnectionLike + Send),
    master: &str,
) -> std::result::Result<(), RedisError> {
    let role: Vec<::redis::Value> = ::redis::cmd("ROLE").query_async(conn).await?;
    let first = role.first().and_then(|v| match v {
        ::redis::Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        ::redis::Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    });
    if first.as_deref() == Some("master") {
        return Ok(());
    }
    Err(RedisError::from(std::io::Error::new(
        std::io::ErrorKind::NotConnected,
        format!(
            "the server the sentinels named for {master:?} is a {} now, not the master (a \
             failover under way)",
            first.unwrap_or_else(|| "server of unknown role".into())
        ),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentinel_urls_are_read() {
        let u = parse(
            "redis+sentinel://app:pw@s1:26380,s2,[::1]:26381/mymaster/3?sentinel_password=sp&protocol=resp3",
            "x",
        )
        .expect("a sentinel url")
        .expect("valid");
        assert_eq!(
            u.sentinels,
            vec![
                ("s1".to_string(), 26380),
                ("s2".to_string(), 26379),
                ("::1".to_string(), 26381)
            ]
        );
        assert_eq!(u.master, "mymaster");
        assert_eq!(u.template, "redis://app:pw@s1:26380/3?protocol=resp3");
        assert_eq!(u.sentinel_auth, Some((None, "sp".to_string())));
        assert!(!u.tls);
        let t = parse("rediss+sentinel://h:1/m", "x").unwrap().unwrap();
        assert!(t.tls);
        assert_eq!(t.template, "rediss://h:1/0");
        assert!(parse("redis://h:1/0", "x").is_none());
        for bad in [
            "redis+sentinel://h:1",
            "redis+sentinel://h:1/",
            "redis+sentinel:///m",
            "redis+sentinel://h:x/m",
            "redis+sentinel://h:0/m",
            "redis+sentinel://h:1/m/db",
            "redis+sentinel://h:1/m/0/extra",
            "redis+sentinel://h:1,/m",
            "redis+sentinel://h:1/m?sentinel_username=u",
        ] {
            let e = parse(bad, "x").expect("a sentinel url").expect_err(bad);
            assert!(matches!(e, StateError::Invalid { .. }), "{bad}: {e:?}");
        }
    }
}
