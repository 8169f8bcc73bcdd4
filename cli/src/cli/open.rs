//! What `--db` names, and opening it: a path is the file store; a URL is
//! a server backend (`postgres://…`, `redis://…`), available when the
//! binary was built with that backend's feature. Every command then works
//! on a `Box<dyn Store>`, whatever the backend.

use std::path::PathBuf;

use agentstate::{FileStore, Options, Store};

use super::CliError;

/// A store named on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DbSpec {
    /// A file store's directory.
    Path(PathBuf),
    /// A server backend's URL; `scheme` is what stands before `://`.
    Url { scheme: String, url: String },
}

impl DbSpec {
    /// Reads `--db`: anything of the form `scheme://…` is a URL; libpq's
    /// `key=value` form (`host=db dbname=agents user=app`) is PostgreSQL;
    /// the rest is a path.
    pub fn parse(s: &str) -> DbSpec {
        if is_libpq_key_values(s) {
            return DbSpec::Url {
                scheme: "postgres".to_string(),
                url: s.to_string(),
            };
        }
        match s.split_once("://") {
            Some((scheme, _))
                if !scheme.is_empty()
                    && scheme
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c)) =>
            {
                DbSpec::Url {
                    scheme: scheme.to_ascii_lowercase(),
                    url: s.to_string(),
                }
            }
            _ => DbSpec::Path(PathBuf::from(s)),
        }
    }

    /// For messages: the path, or the URL without its password.
    pub fn display(&self) -> String {
        match self {
            DbSpec::Path(p) => p.display().to_string(),
            DbSpec::Url { url, .. } => agentstate::redact_connection_string(url),
        }
    }
}

/// True for a libpq `key=value` connection string: every
/// whitespace-separated word that is not inside a quoted value is
/// `key=…` with a key libpq knows, so a path that merely holds an `=` is
/// not taken for one.
fn is_libpq_key_values(s: &str) -> bool {
    const KEYS: &[&str] = &[
        "host",
        "hostaddr",
        "port",
        "dbname",
        "user",
        "password",
        "passfile",
        "sslmode",
        "sslrootcert",
        "sslcert",
        "sslkey",
        "sslpassword",
        "connect_timeout",
        "options",
        "application_name",
        "target_session_attrs",
        "channel_binding",
        "keepalives",
        "keepalives_idle",
        "load_balance_hosts",
    ];
    let mut any = false;
    let mut in_quote = false;
    for word in s.split_whitespace() {
        if in_quote {
            in_quote = word.matches('\'').count() % 2 == 0;
            continue;
        }
        let Some((key, value)) = word.split_once('=') else {
            return false;
        };
        if !KEYS.contains(&key) {
            return false;
        }
        in_quote = value.starts_with('\'') && value.matches('\'').count() % 2 == 1;
        any = true;
    }
    any
}

/// What opening a store takes besides its name: the common options, and
/// the server backends' connection settings from the command line.
#[derive(Clone, Default)]
pub struct Connect {
    pub opts: Options,
    /// Redis: what the service guarantees where `CONFIG GET` is disabled
    /// (noeviction, appendfsync always).
    pub redis_assume: Option<(bool, bool)>,
    /// Redis: every write waits for this many replicas (`WAIT`, 1 s).
    pub redis_wait_replicas: Option<u32>,
    /// Redis over TLS: a CA (PEM) to trust instead of the web PKI roots.
    pub tls_ca: Option<Vec<u8>>,
    /// Redis over TLS: a client certificate and its key (PEM).
    pub tls_client: Option<(Vec<u8>, Vec<u8>)>,
}

/// How a command may open the store.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Open {
    /// The store must already exist (read, check, delete).
    Existing,
    /// Create it when absent (import, copy's target).
    Create,
}

/// Opens the store `spec` names.
pub fn open(spec: &DbSpec, conn: &Connect, how: Open) -> Result<Box<dyn Store>, CliError> {
    let opts = conn.opts.clone();
    match spec {
        DbSpec::Path(path) => {
            if how == Open::Existing {
                let empty_dir = std::fs::read_dir(path)
                    .map(|mut d| d.next().is_none())
                    .unwrap_or(false);
                if !path.exists() || empty_dir {
                    return Err(CliError::usage(format!(
                        "no store at {} (check --db or AGENTSTATE_DB; `agentstate import` creates one)",
                        path.display()
                    )));
                }
            }
            Ok(Box::new(open_file(path, opts)?))
        }
        #[cfg(feature = "postgres")]
        DbSpec::Url { scheme, url } if scheme == "postgres" || scheme == "postgresql" => {
            let store = agentstate::PostgresStore::connect_with(
                url,
                agentstate::PgOptions::new().options(opts),
            )?;
            match how {
                // Creates the schema when it is missing (idempotent).
                Open::Create => store.setup()?,
                Open::Existing => {
                    if store.schema_version()?.is_none() {
                        return Err(CliError::usage(format!(
                            "no agentstate schema at {} (`agentstate import` or `agentstate copy` creates one)",
                            spec.display()
                        )));
                    }
                }
            }
            Ok(Box::new(store))
        }
        #[cfg(feature = "redis")]
        DbSpec::Url { scheme, url }
            if matches!(
                scheme.as_str(),
                "redis" | "rediss" | "redis+unix" | "redis+sentinel" | "rediss+sentinel"
            ) =>
        {
            // Every command works on a server store, new or not: a server
            // database needs no creating. `require_fsync` stays on: the CLI
            // refuses a server that could lose what it writes.
            let _ = how;
            let mut ro = agentstate::RedisOptions::new().options(opts);
            if let Some((noeviction, fsync)) = conn.redis_assume {
                ro = ro.durability_assumed(noeviction, fsync);
            }
            if let Some(n) = conn.redis_wait_replicas {
                ro = ro.wait_replicas(n, std::time::Duration::from_secs(1));
            }
            if let Some(ca) = &conn.tls_ca {
                ro = ro.tls_ca_pem(ca.clone());
            }
            if let Some((cert, key)) = &conn.tls_client {
                ro = ro.tls_client_pem(cert.clone(), key.clone());
            }
            let store = agentstate::RedisStore::connect_with(url, ro).map_err(|e| {
                // A server's "no" to the configuration is an unusable store
                // (exit 2); other failures keep exit 1.
                let refused = matches!(
                    e,
                    agentstate::StateError::Persistence {
                        reason: agentstate::PersistenceReason::Refused,
                        ..
                    }
                );
                let mut text = format!("--db {}: {e}", spec.display());
                if text.contains("durability_assumed") {
                    text.push_str(
                        " (on the command line: --redis-assume noeviction,appendfsync-always)",
                    );
                }
                if refused {
                    CliError::usage(text)
                } else {
                    CliError::failed(text)
                }
            })?;
            Ok(Box::new(store))
        }
        DbSpec::Url { scheme, .. } => {
            // Server backends add their arm here, behind their feature.
            let feature = match scheme.as_str() {
                "postgres" | "postgresql" => "postgres",
                "redis" | "rediss" | "redis+unix" | "redis+sentinel" | "rediss+sentinel" => "redis",
                other => {
                    return Err(CliError::usage(format!(
                        "--db {}: unknown scheme {other}:// (give a directory for the file store, or a postgres:// or redis:// URL)",
                        spec.display()
                    )));
                }
            };
            Err(CliError::usage(format!(
                "--db {}: this agentstate was built without the `{feature}` feature (cargo install agentstate --features {feature})",
                spec.display()
            )))
        }
    }
}

/// Opens a file store, showing the progress of a one-time layout upgrade
/// (a store written by an older release) on stderr.
fn open_file(path: &std::path::Path, opts: Options) -> Result<FileStore, CliError> {
    use std::sync::{Arc, Mutex};
    struct Upgrade {
        bar: crate::cli::output::Progress,
        done: u64,
        started: std::time::Instant,
    }
    let shown = path.display().to_string();
    let state: Arc<Mutex<Option<Upgrade>>> = Arc::default();
    let seen = state.clone();
    let opts = opts.on_upgrade(move |p| {
        let mut g = seen.lock().unwrap_or_else(|e| e.into_inner());
        let u = g.get_or_insert_with(|| {
            eprintln!(
                "upgrading {shown} to this release's store format ({} runs; once, crash-safe)…",
                p.total
            );
            Upgrade {
                bar: crate::cli::output::Progress::new("runs upgraded"),
                done: 0,
                started: std::time::Instant::now(),
            }
        });
        u.bar.inc(p.done.saturating_sub(u.done));
        u.done = u.done.max(p.done);
    });
    let store = FileStore::open_with(path, opts)?;
    if let Some(u) = state.lock().unwrap_or_else(|e| e.into_inner()).take() {
        u.bar.finish();
        eprintln!(
            "upgraded {}: {} runs in {:.1} s",
            path.display(),
            u.done,
            u.started.elapsed().as_secs_f64()
        );
    }
    Ok(store)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_paths() {
        assert_eq!(
            DbSpec::parse("/tmp/state"),
            DbSpec::Path("/tmp/state".into())
        );
        assert_eq!(DbSpec::parse("state"), DbSpec::Path("state".into()));
        assert_eq!(
            DbSpec::parse("a b://x"),
            DbSpec::Path("a b://x".into()),
            "not a scheme"
        );
        let DbSpec::Url { scheme, .. } = DbSpec::parse("PostgreSQL://u@h/db") else {
            panic!("a URL")
        };
        assert_eq!(scheme, "postgresql");
    }

    #[test]
    fn key_value_dsns_are_postgres_and_never_shown_with_their_password() {
        let spec = DbSpec::parse("host=db dbname=agents user=app password='hunter 2'");
        let DbSpec::Url { scheme, .. } = &spec else {
            panic!("a key=value DSN is PostgreSQL: {spec:?}")
        };
        assert_eq!(scheme, "postgres");
        assert!(!spec.display().contains("hunter"), "{}", spec.display());
        assert_eq!(
            DbSpec::parse("./dir=with=equals"),
            DbSpec::Path("./dir=with=equals".into())
        );
        assert_eq!(
            DbSpec::parse("postgres://me:hunter2@db:5432/x?sslmode=off").display(),
            "postgres://me:***@db:5432/x?sslmode=off"
        );
    }
}
