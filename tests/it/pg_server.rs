//! A throwaway PostgreSQL server for the tests (and the benchmarks, which
//! include this file): initdb in a temp dir, a free loopback port, run as
//! an unprivileged user when the tests run as root, and stopped by a
//! watchdog process when the process that started it exits, however it
//! exits. `AGENTSTATE_TEST_PG_DSN` names a server to use instead.
//!
//! No server binaries → a panic naming the command that installs them: a
//! postgres test never passes because PostgreSQL is missing.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The command the panic names when no server binary is found.
pub const INSTALL: &str = "apt-get update && apt-get install -y postgresql-15";

/// One server this process started.
pub struct PgServer {
    pub port: u16,
    root: PathBuf,
    bindir: PathBuf,
    user: Option<String>,
    fsync: bool,
    /// More `-c name=value` settings for the postmaster.
    settings: Vec<String>,
    child: Mutex<Option<Child>>,
}

/// The files of a TLS server (see [`PgServer::start_tls`]): the CA that
/// signed the server's certificate (for `localhost` and `127.0.0.1`), a
/// client certificate for the user `certuser`, and a CA that signed nothing
/// here.
pub type TlsFiles = crate::certs::Certs;

/// The password of `pwuser` on a TLS server: the tests check that it
/// appears in no error.
pub const TEST_PASSWORD: &str = "Pw-s3cret-Xq7";

fn sh(cmd: &mut Command) -> std::io::Result<std::process::Output> {
    cmd.stdin(Stdio::null()).output()
}

fn has_all(dir: &Path) -> bool {
    ["initdb", "postgres", "pg_ctl"]
        .iter()
        .all(|b| dir.join(b).is_file())
}

/// Where the server binaries are: `PATH`, `pg_config --bindir`, the
/// distribution's versioned directories (newest first).
pub fn bindir() -> PathBuf {
    let mut tried = Vec::new();
    if let Some(path) = std::env::var_os("PATH") {
        for d in std::env::split_paths(&path) {
            let initdb = d.join("initdb");
            if initdb.is_file() {
                // /usr/local/bin/initdb is often a link into the real dir.
                let real = std::fs::canonicalize(&initdb).unwrap_or(initdb);
                if let Some(dir) = real.parent().filter(|d| has_all(d)) {
                    return dir.to_path_buf();
                }
                if has_all(&d) {
                    return d;
                }
            }
        }
        tried.push("PATH".to_string());
    }
    if let Ok(o) = sh(Command::new("pg_config").arg("--bindir")) {
        let d = PathBuf::from(String::from_utf8_lossy(&o.stdout).trim());
        if o.status.success() && has_all(&d) {
            return d;
        }
        tried.push(format!("pg_config --bindir ({})", d.display()));
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            Some((v, e.path().join("bin")))
        })
        .filter(|(_, d)| has_all(d))
        .collect();
    versions.sort();
    if let Some((_, d)) = versions.pop() {
        return d;
    }
    tried.push("/usr/lib/postgresql/*/bin".into());
    panic!(
        "the postgres tests need a PostgreSQL server (initdb, postgres, pg_ctl); none found in {}. \
         Install one with: {INSTALL} (or set AGENTSTATE_TEST_PG_DSN to a server's URL)",
        tried.join(", ")
    );
}

fn is_root() -> bool {
    sh(Command::new("id").arg("-u"))
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn user_exists(u: &str) -> bool {
    sh(Command::new("id").arg("-u").arg(u)).is_ok_and(|o| o.status.success())
}

/// The unprivileged user a root test process runs the server as: the
/// distribution's `postgres`, or one made for it.
fn server_user() -> Option<String> {
    if !is_root() {
        return None;
    }
    for u in ["postgres", "agentstate-pg"] {
        if user_exists(u) {
            return Some(u.into());
        }
    }
    let _ = sh(Command::new("useradd").args([
        "--system",
        "--no-create-home",
        "--shell",
        "/usr/sbin/nologin",
        "agentstate-pg",
    ]));
    assert!(
        user_exists("agentstate-pg"),
        "running as root, and no unprivileged user to run PostgreSQL as (useradd agentstate-pg failed)"
    );
    Some("agentstate-pg".into())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

impl PgServer {
    /// A command run as the server's user.
    fn cmd(&self, bin: &str) -> Command {
        let path = self.bindir.join(bin);
        match &self.user {
            None => Command::new(path),
            Some(u) => {
                let mut c = Command::new("setpriv");
                c.arg(format!("--reuid={u}"))
                    .arg(format!("--regid={}", group_of(u)))
                    .arg("--init-groups")
                    .arg("--")
                    .arg(path);
                c
            }
        }
    }

    fn data(&self) -> PathBuf {
        self.root.join("data")
    }

    /// Starts a new server. `fsync` off makes the tests fast (a process
    /// crash, what the fault test does, loses nothing either way); the
    /// benchmarks turn it on.
    pub fn start(fsync: bool) -> PgServer {
        Self::start_with(fsync, |_| Vec::new())
    }

    /// A server with TLS on (`ssl=on`, a certificate for `localhost` and
    /// `127.0.0.1`) and this `pg_hba.conf`: the superuser `agentstate` by
    /// `host` (TLS or not, trusted), `sslonly` only by `hostssl`,
    /// `certuser` by `hostssl … cert` (a client certificate), `pwuser` by
    /// password (`password`, checked by the server alone) and `scramuser`
    /// (`scram-sha-256`), both [`TEST_PASSWORD`], and `rejected`
    /// refused by a `reject` line. Every user may create in `postgres`.
    pub fn start_tls() -> (PgServer, TlsFiles) {
        let mut files = None;
        let s = Self::start_with(false, |s| {
            let dir = s.root.join("tls");
            std::fs::create_dir_all(&dir).expect("tls dir");
            let certs = crate::certs::Certs::make(&dir, "certuser");
            // The server refuses a key others may read, or not its own.
            if let Some(u) = &s.user {
                let st = sh(Command::new("chown")
                    .arg(format!("{u}:"))
                    .arg(&certs.server_key))
                .expect("chown");
                assert!(st.status.success(), "chown the server key");
            }
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&certs.server_key, std::fs::Permissions::from_mode(0o600))
                .expect("chmod the server key");
            std::fs::write(
                s.data().join("pg_hba.conf"),
                "local all all trust\n\
                 host all agentstate 127.0.0.1/32 trust\n\
                 hostssl all sslonly 127.0.0.1/32 trust\n\
                 hostssl all certuser 127.0.0.1/32 cert\n\
                 host all pwuser 127.0.0.1/32 password\n\
                 host all scramuser 127.0.0.1/32 scram-sha-256\n\
                 host all rejected 127.0.0.1/32 reject\n",
            )
            .expect("write pg_hba.conf");
            let settings = vec![
                "ssl=on".to_string(),
                format!("ssl_cert_file={}", certs.server_cert.display()),
                format!("ssl_key_file={}", certs.server_key.display()),
                format!("ssl_ca_file={}", certs.ca.display()),
                "password_encryption=scram-sha-256".to_string(),
            ];
            files = Some(certs);
            settings
        });
        let mut c =
            postgres::Client::connect(&s.dsn("postgres"), postgres::NoTls).expect("connect");
        c.batch_execute(&format!(
            "CREATE ROLE sslonly LOGIN SUPERUSER; CREATE ROLE certuser LOGIN SUPERUSER; \
             CREATE ROLE pwuser LOGIN PASSWORD '{TEST_PASSWORD}'; CREATE ROLE rejected LOGIN; \
             CREATE ROLE scramuser LOGIN PASSWORD '{TEST_PASSWORD}'; \
             GRANT ALL ON SCHEMA public TO PUBLIC"
        ))
        .expect("create the test roles");
        (s, files.expect("the tls files"))
    }

    /// Starts a new server; `prepare` runs after initdb (it may write into
    /// the data directory) and returns more settings.
    pub fn start_with(fsync: bool, prepare: impl FnOnce(&PgServer) -> Vec<String>) -> PgServer {
        let mut s = Self::unstarted(fsync);
        let o = sh(s
            .cmd("initdb")
            .args(["-U", "agentstate", "-A", "trust", "-E", "UTF8"])
            .args(["--locale=C", "-N", "-D"])
            .arg(s.data()))
        .expect("initdb runs");
        assert!(
            o.status.success(),
            "initdb failed: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        s.settings = prepare(&s);
        s.launch();
        s
    }

    /// A server's directory (owned by the server's user, watched by a
    /// watchdog), with no data directory yet and no process.
    fn unstarted(fsync: bool) -> PgServer {
        static N: AtomicU64 = AtomicU64::new(0);
        let bindir = bindir();
        let user = server_user();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let root = std::env::temp_dir().join(format!(
            "agentstate-pg-{}-{}-{:x}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed),
            nanos & 0xffff_ffff
        ));
        std::fs::create_dir_all(&root).expect("create the server's temp dir");
        if let Some(u) = &user {
            let st = sh(Command::new("chown").arg(format!("{u}:")).arg(&root)).expect("chown");
            assert!(st.status.success(), "chown {u} {}", root.display());
        }
        let s = PgServer {
            port: 0,
            root,
            bindir,
            user,
            fsync,
            settings: Vec::new(),
            child: Mutex::new(None),
        };
        watchdog(&s.root);
        s
    }

    /// Runs the postmaster on a free port.
    fn launch(&mut self) {
        for attempt in 0.. {
            self.port = free_port();
            if self.spawn() {
                break;
            }
            assert!(
                attempt < 5,
                "the server did not start; see {}",
                self.log().display()
            );
        }
    }

    /// A primary that streams its WAL to standbys (`wal_level=replica`);
    /// with `sync`, commits wait for the standby of that name
    /// (`synchronous_standby_names`).
    pub fn start_primary(sync: Option<&str>) -> PgServer {
        Self::start_with(false, |_| {
            let mut v = vec![
                "wal_level=replica".to_string(),
                "max_wal_senders=10".to_string(),
                "wal_keep_size=512MB".to_string(),
            ];
            if let Some(name) = sync {
                v.push(format!("synchronous_standby_names={name}"));
            }
            v
        })
    }

    /// A hot standby of `primary` named `name` (its `application_name`),
    /// made with `pg_basebackup` and streaming from it; promotable with
    /// [`promote`](Self::promote). It is not itself a primary with a
    /// synchronous standby (`synchronous_standby_names` stays empty).
    pub fn standby_of(primary: &PgServer, name: &str) -> PgServer {
        Self::standby_of_on(primary, name, None)
    }

    /// [`standby_of`](Self::standby_of) on `port` when given (a dead
    /// server's, so that a URL naming it reaches the new one).
    pub fn standby_of_on(primary: &PgServer, name: &str, port: Option<u16>) -> PgServer {
        let mut s = Self::unstarted(false);
        let conninfo = format!(
            "host=127.0.0.1 port={} user=agentstate application_name={name}",
            primary.port
        );
        let o = sh(s
            .cmd("pg_basebackup")
            .args(["-d", &conninfo, "-X", "stream", "-c", "fast", "-R", "-D"])
            .arg(s.data()))
        .expect("pg_basebackup runs");
        assert!(
            o.status.success(),
            "pg_basebackup failed: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        s.settings = vec![
            "wal_level=replica".to_string(),
            "max_wal_senders=10".to_string(),
            "wal_keep_size=512MB".to_string(),
            format!("primary_conninfo={conninfo}"),
        ];
        match port {
            Some(p) => {
                s.port = p;
                assert!(
                    s.spawn(),
                    "the standby did not start on port {p}; see {}",
                    s.log().display()
                );
            }
            None => s.launch(),
        }
        s
    }

    /// Makes commits wait for the standby `name` from now on
    /// (`ALTER SYSTEM`, then a reload).
    pub fn require_sync_standby(&self, name: &str) {
        let mut c =
            postgres::Client::connect(&self.dsn("postgres"), postgres::NoTls).expect("connect");
        // Not in one batch: ALTER SYSTEM refuses a transaction block.
        c.batch_execute(&format!(
            "ALTER SYSTEM SET synchronous_standby_names = '{name}'"
        ))
        .expect("ALTER SYSTEM");
        c.batch_execute("SELECT pg_reload_conf()").expect("reload");
    }

    /// Waits until the primary reports a standby named `name` streaming,
    /// with `sync_state` `want` (`sync` or `async`).
    pub fn await_standby(&self, name: &str, want: &str) {
        let until = Instant::now() + Duration::from_secs(60);
        let mut c = postgres::Client::connect(&self.dsn("postgres"), postgres::NoTls)
            .expect("connect to the primary");
        loop {
            let state: Option<String> = c
                .query_opt(
                    "SELECT sync_state FROM pg_stat_replication \
                     WHERE application_name = $1 AND state = 'streaming'",
                    &[&name],
                )
                .expect("pg_stat_replication")
                .map(|r| r.get(0));
            if state.as_deref() == Some(want) {
                return;
            }
            assert!(
                Instant::now() < until,
                "standby {name} not streaming as {want} in 60 s (now {state:?})"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `pg_ctl promote`: the standby becomes a primary (waits until it
    /// accepts writes).
    pub fn promote(&self) {
        let o = sh(self
            .cmd("pg_ctl")
            .args(["promote", "-w", "-D"])
            .arg(self.data()))
        .expect("pg_ctl runs");
        assert!(
            o.status.success(),
            "pg_ctl promote failed: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }

    /// kill -9 of the postmaster and every process it started, at once:
    /// the server dies as its machine would.
    pub fn kill9(&self) {
        let Some(mut child) = self.child.lock().expect("lock").take() else {
            return;
        };
        let pid = child.id();
        let mut pids = vec![pid];
        pids.extend(children_of(pid));
        kill9_all(&pids);
        let _ = child.wait();
    }

    fn log(&self) -> PathBuf {
        self.root.join("log")
    }

    /// Runs the postmaster and waits until it answers; false when it
    /// exited (a port taken in the meantime).
    fn spawn(&self) -> bool {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log())
            .expect("server log");
        let mut c = self.cmd("postgres");
        c.arg("-D")
            .arg(self.data())
            .args(["-p", &self.port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(format!("unix_socket_directories={}", self.root.display()))
            .args(["-c", "max_connections=300"])
            .args(["-c", if self.fsync { "fsync=on" } else { "fsync=off" }])
            .args(self.settings.iter().flat_map(|v| ["-c", v.as_str()]))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log);
        let mut child = c.spawn().expect("the postgres binary runs");
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(Some(_)) = child.try_wait() {
                return false;
            }
            if postgres::Client::connect(&self.dsn("postgres"), postgres::NoTls).is_ok() {
                *self.child.lock().expect("lock") = Some(child);
                return true;
            }
            assert!(
                Instant::now() < until,
                "the server did not answer in 60 s; see {}",
                self.log().display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The URL of database `db` on this server for `user`.
    pub fn dsn_as(&self, user: &str, db: &str) -> String {
        format!("postgres://{user}@127.0.0.1:{}/{db}", self.port)
    }

    /// The URL of database `db` on this server.
    pub fn dsn(&self, db: &str) -> String {
        format!("postgres://agentstate@127.0.0.1:{}/{db}", self.port)
    }

    /// `pg_ctl stop -m immediate`: the server dies as in a crash.
    pub fn stop_immediate(&self) {
        let o = sh(self
            .cmd("pg_ctl")
            .args(["stop", "-m", "immediate", "-w", "-D"])
            .arg(self.data()))
        .expect("pg_ctl runs");
        assert!(
            o.status.success(),
            "pg_ctl stop failed: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        if let Some(mut c) = self.child.lock().expect("lock").take() {
            let _ = c.wait();
        }
    }

    /// Starts the stopped server again on the same port and data.
    pub fn restart(&self) {
        assert!(
            self.spawn(),
            "the server did not restart; see {}",
            self.log().display()
        );
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let _ = sh(self
            .cmd("pg_ctl")
            .args(["stop", "-m", "immediate", "-w", "-D"])
            .arg(self.data()));
        if let Some(mut c) = self.child.lock().expect("lock").take() {
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn group_of(user: &str) -> String {
    sh(Command::new("id").arg("-g").arg(user))
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .expect("id -g")
}

/// A process in its own session that outlives this one by at most a
/// second: when this process is gone it stops the server (SIGQUIT to the
/// postmaster is an immediate shutdown) and removes its directory. A test
/// binary has no global teardown, and a server must not outlive its tests.
// The watchdog is meant to outlive this process: nobody waits for it.
#[allow(clippy::zombie_processes)]
fn watchdog(root: &Path) {
    let script = format!(
        "while kill -0 {pid} 2>/dev/null; do sleep 1; done; \
         pidfile='{root}/data/postmaster.pid'; \
         if [ -f \"$pidfile\" ]; then kill -QUIT \"$(head -n 1 \"$pidfile\")\" 2>/dev/null; fi; \
         i=0; while [ -f \"$pidfile\" ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done; \
         rm -rf '{root}'",
        pid = std::process::id(),
        root = root.display()
    );
    Command::new("setsid")
        .args(["sh", "-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the watchdog starts (setsid, sh)");
}

/// `dsn` with its database replaced by `db`.
pub fn with_db(dsn: &str, db: &str) -> String {
    if let Some((scheme, rest)) = dsn.split_once("://") {
        let (base, query) = match rest.split_once('?') {
            Some((b, q)) => (b, format!("?{q}")),
            None => (rest, String::new()),
        };
        let host = base.split('/').next().unwrap_or(base);
        format!("{scheme}://{host}/{db}{query}")
    } else {
        format!("{dsn} dbname={db}")
    }
}

/// The server every test of this process shares: `AGENTSTATE_TEST_PG_DSN`,
/// or one started on first use (and stopped by its watchdog).
pub fn shared_dsn() -> &'static str {
    static DSN: OnceLock<String> = OnceLock::new();
    static SERVER: OnceLock<PgServer> = OnceLock::new();
    DSN.get_or_init(|| match std::env::var("AGENTSTATE_TEST_PG_DSN") {
        Ok(d) if !d.is_empty() => d,
        _ => SERVER
            .get_or_init(|| PgServer::start(false))
            .dsn("postgres"),
    })
}

/// A new, empty database on the shared server; its URL.
pub fn fresh_db(tag: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let name = format!(
        "t_{tag}_{}_{}_{:x}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() & 0xffff_ffff)
            .unwrap_or(0)
    );
    let mut c = postgres::Client::connect(shared_dsn(), postgres::NoTls).expect("connect");
    c.batch_execute(&format!("CREATE DATABASE {name}"))
        .expect("create database");
    with_db(shared_dsn(), &name)
}

/// A PgBouncer in front of a server, in a temp dir, run as the server's
/// unprivileged user (it refuses to run as root), stopped when dropped or
/// when this process exits.
pub struct PgBouncer {
    pub port: u16,
    root: PathBuf,
    child: Mutex<Option<Child>>,
}

/// The PgBouncer binary, or a panic naming how to install it.
fn pgbouncer_bin() -> PathBuf {
    for d in ["/usr/sbin", "/usr/bin", "/usr/local/bin", "/usr/local/sbin"] {
        let p = Path::new(d).join("pgbouncer");
        if p.is_file() {
            return p;
        }
    }
    panic!("the PgBouncer tests need pgbouncer: apt-get install -y pgbouncer");
}

impl PgBouncer {
    /// PgBouncer on a free loopback port, `pool_mode` as given, every
    /// database of the server at `host:port` behind it, user `agentstate`
    /// trusted; 4 server connections per pool, reused last-in first-out.
    pub fn start(host: &str, upstream: u16, pool_mode: &str) -> PgBouncer {
        static N: AtomicU64 = AtomicU64::new(0);
        let bin = pgbouncer_bin();
        let user = server_user();
        let root = std::env::temp_dir().join(format!(
            "agentstate-pgbouncer-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&root).expect("create pgbouncer's temp dir");
        std::fs::write(root.join("users.txt"), "\"agentstate\" \"\"\n").expect("users");
        if let Some(u) = &user {
            let st = sh(Command::new("chown")
                .arg("-R")
                .arg(format!("{u}:"))
                .arg(&root))
            .expect("chown");
            assert!(st.status.success(), "chown {u} {}", root.display());
        }
        for attempt in 0.. {
            let port = free_port();
            let ini = root.join("pgbouncer.ini");
            std::fs::write(
                &ini,
                format!(
                    "[databases]\n* = host={host} port={upstream}\n\
                     [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\n\
                     unix_socket_dir =\nauth_type = trust\nauth_file = {users}\n\
                     pool_mode = {pool_mode}\ndefault_pool_size = 4\nmax_client_conn = 200\n\
                     logfile = {log}\n",
                    users = root.join("users.txt").display(),
                    log = root.join("pgbouncer.log").display(),
                ),
            )
            .expect("pgbouncer.ini");
            let mut c = match &user {
                None => Command::new(&bin),
                Some(u) => {
                    let mut c = Command::new("setpriv");
                    c.arg(format!("--reuid={u}"))
                        .arg(format!("--regid={}", group_of(u)))
                        .arg("--init-groups")
                        .arg("--")
                        .arg(&bin);
                    c
                }
            };
            let child = c
                .arg(&ini)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("pgbouncer runs");
            watch_child(child.id(), &root);
            let b = PgBouncer {
                port,
                root: root.clone(),
                child: Mutex::new(Some(child)),
            };
            let until = Instant::now() + Duration::from_secs(20);
            loop {
                let exited = matches!(
                    b.child.lock().expect("lock").as_mut().map(|c| c.try_wait()),
                    Some(Ok(Some(_)))
                );
                if exited {
                    break;
                }
                let dsn = format!("postgres://agentstate@127.0.0.1:{port}/postgres");
                if postgres::Client::connect(&dsn, postgres::NoTls).is_ok() {
                    return b;
                }
                if Instant::now() > until {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            assert!(
                attempt < 3,
                "pgbouncer did not start; see {}",
                root.join("pgbouncer.log").display()
            );
        }
        unreachable!()
    }

    /// The URL of database `db` through this PgBouncer.
    pub fn dsn(&self, db: &str) -> String {
        format!("postgres://agentstate@127.0.0.1:{}/{db}", self.port)
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.lock().expect("lock").take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// Stops process `pid` (and removes `root`) when this process is gone.
#[allow(clippy::zombie_processes)]
fn watch_child(pid: u32, root: &Path) {
    let script = format!(
        "while kill -0 {me} 2>/dev/null; do sleep 1; done; kill {pid} 2>/dev/null; rm -rf '{root}'",
        me = std::process::id(),
        root = root.display()
    );
    Command::new("setsid")
        .args(["sh", "-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the watchdog starts (setsid, sh)");
}

/// Runs `program` as the servers' unprivileged user (when the tests run
/// as root), as `PgServer::cmd` does.
fn as_server_user(user: &Option<String>, program: &Path) -> Command {
    match user {
        None => Command::new(program),
        Some(u) => {
            let mut c = Command::new("setpriv");
            c.arg(format!("--reuid={u}"))
                .arg(format!("--regid={}", group_of(u)))
                .arg("--init-groups")
                .arg("--")
                .arg(program);
            c
        }
    }
}

/// The pids of `pid`'s children.
fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
                continue;
            };
            // pid (comm) state ppid ...: comm may hold spaces.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok());
            if ppid == Some(pid)
                && let Ok(child) = e.file_name().to_string_lossy().parse()
            {
                out.push(child);
            }
        }
    }
    out
}

/// SIGKILL to `pids`, at once.
fn kill9_all(pids: &[u32]) {
    if pids.is_empty() {
        return;
    }
    let _ = sh(Command::new("kill")
        .arg("-KILL")
        .args(pids.iter().map(u32::to_string)));
}

/// A binary on PATH, or a panic naming the package that has it.
fn required(bin: &str, package: &str) -> PathBuf {
    std::env::var_os("PATH")
        .and_then(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join(bin))
                .find(|p| p.is_file())
        })
        .unwrap_or_else(|| {
            panic!(
                "{bin} is not installed; the failover tests need it: apt-get install -y {package}"
            )
        })
}

/// Two PostgreSQL nodes run by Patroni over a one-node etcd, on loopback,
/// as operators run a highly available PostgreSQL: Patroni bootstraps the
/// first, clones the second from it, keeps one the leader (with
/// `synchronous_mode`, the other its synchronous standby) and promotes
/// the standby when the leader's key expires (`ttl` 5 s). Everything is
/// killed when dropped, or by a watchdog when this process exits.
pub struct Patroni {
    root: PathBuf,
    /// The two nodes' PostgreSQL ports.
    pub ports: [u16; 2],
    user: Option<String>,
    /// etcd, then the two Patroni processes.
    procs: Mutex<Vec<Child>>,
}

impl Patroni {
    pub fn start() -> Patroni {
        let patroni = required("patroni", "patroni");
        let etcd = required("etcd", "etcd-server");
        let bindir = bindir();
        let user = server_user();
        let root = std::env::temp_dir().join(format!(
            "agentstate-patroni-{}-{:x}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() & 0xffff_ffff)
                .unwrap_or(0)
        ));
        std::fs::create_dir_all(&root).expect("the cluster's dir");
        let [client, peer, api1, api2, pg1, pg2] = std::array::from_fn(|_| free_port());
        for n in 1..=2 {
            let (api, pg) = if n == 1 { (api1, pg1) } else { (api2, pg2) };
            std::fs::write(
                root.join(format!("n{n}.yml")),
                format!(
                    "scope: fleet\nname: n{n}\n\
                     restapi:\n  listen: 127.0.0.1:{api}\n  connect_address: 127.0.0.1:{api}\n\
                     etcd3:\n  hosts: 127.0.0.1:{client}\n\
                     bootstrap:\n  dcs:\n    ttl: 5\n    loop_wait: 1\n    retry_timeout: 2\n\
                     \x20   maximum_lag_on_failover: 1048576\n    synchronous_mode: true\n\
                     \x20   postgresql:\n      use_pg_rewind: false\n      parameters:\n\
                     \x20       wal_level: replica\n        max_wal_senders: 10\n        fsync: 'off'\n\
                     \x20 initdb:\n    - encoding: UTF8\n    - locale: C\n\
                     \x20 pg_hba:\n    - local all all trust\n    - host all all 127.0.0.1/32 trust\n\
                     \x20   - host replication all 127.0.0.1/32 trust\n\
                     postgresql:\n  listen: 127.0.0.1:{pg}\n  connect_address: 127.0.0.1:{pg}\n\
                     \x20 data_dir: {root}/d{n}\n  bin_dir: {bindir}\n  pgpass: {root}/pgpass{n}\n\
                     \x20 authentication:\n    superuser:\n      username: agentstate\n      password: x\n\
                     \x20   replication:\n      username: agentstate\n      password: x\n\
                     \x20 parameters:\n    unix_socket_directories: {root}\n    max_connections: 100\n",
                    root = root.display(),
                    bindir = bindir.display(),
                ),
            )
            .expect("write the Patroni config");
        }
        if let Some(u) = &user {
            let st = sh(Command::new("chown")
                .arg("-R")
                .arg(format!("{u}:"))
                .arg(&root))
            .expect("chown");
            assert!(st.status.success(), "chown {u} {}", root.display());
        }
        let log = |name: &str| std::fs::File::create(root.join(name)).expect("a log file");
        let spawn = |mut c: Command, name: &str| -> Child {
            let l = log(name);
            c.stdin(Stdio::null())
                .stdout(l.try_clone().expect("log"))
                .stderr(l)
                .spawn()
                .unwrap_or_else(|e| panic!("start {name}: {e}"))
        };
        let mut e = as_server_user(&user, &etcd);
        e.args(["--name", "e1", "--data-dir"])
            .arg(root.join("etcd"))
            .arg("--listen-client-urls")
            .arg(format!("http://127.0.0.1:{client}"))
            .arg("--advertise-client-urls")
            .arg(format!("http://127.0.0.1:{client}"))
            .arg("--listen-peer-urls")
            .arg(format!("http://127.0.0.1:{peer}"))
            .arg("--initial-advertise-peer-urls")
            .arg(format!("http://127.0.0.1:{peer}"))
            .arg("--initial-cluster")
            .arg(format!("e1=http://127.0.0.1:{peer}"));
        let mut procs = vec![spawn(e, "etcd.log")];
        let node = |n: u32| {
            let mut c = as_server_user(&user, &patroni);
            c.arg(root.join(format!("n{n}.yml")));
            c
        };
        procs.push(spawn(node(1), "n1.log"));
        let p = Patroni {
            root: root.clone(),
            ports: [pg1, pg2],
            user: user.clone(),
            procs: Mutex::new(procs),
        };
        p.watchdog();
        // The first node bootstraps and leads before the second clones it.
        p.await_role(0, false, Duration::from_secs(90));
        let second = spawn(node(2), "n2.log");
        p.procs.lock().expect("lock").push(second);
        p.watchdog();
        p.await_role(1, true, Duration::from_secs(90));
        p.await_sync_standby(0);
        p
    }

    /// Writes the pids a watchdog kills when this process is gone (and the
    /// postmasters it finds), then removes the directory.
    fn watchdog(&self) {
        let pids: Vec<String> = self
            .procs
            .lock()
            .expect("lock")
            .iter()
            .map(|c| c.id().to_string())
            .collect();
        let pidfile = self.root.join("pids");
        std::fs::write(&pidfile, pids.join(" ")).expect("write the pids");
        if pids.len() > 2 {
            return; // one watchdog, started with the first pids
        }
        let script = format!(
            "while kill -0 {me} 2>/dev/null; do sleep 1; done; \
             kill -9 $(cat '{pids}') 2>/dev/null; \
             for d in '{root}/d1' '{root}/d2'; do \
               if [ -f \"$d/postmaster.pid\" ]; then kill -QUIT \"$(head -n 1 \"$d/postmaster.pid\")\" 2>/dev/null; fi; \
             done; sleep 2; rm -rf '{root}'",
            me = std::process::id(),
            pids = pidfile.display(),
            root = self.root.display()
        );
        let _ = Command::new("setsid")
            .args(["sh", "-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
    }

    /// The URL of database `db` on node `i` alone.
    pub fn dsn(&self, i: usize, db: &str) -> String {
        format!("postgres://agentstate@127.0.0.1:{}/{db}", self.ports[i])
    }

    /// Whether node `i` answers and is in recovery (a standby).
    fn in_recovery(&self, i: usize) -> Option<bool> {
        let mut c = postgres::Client::connect(&self.dsn(i, "postgres"), postgres::NoTls).ok()?;
        c.query_one("SELECT pg_is_in_recovery()", &[])
            .ok()
            .map(|r| r.get(0))
    }

    /// Waits until node `i` answers as a standby (`recovery`) or a primary.
    pub fn await_role(&self, i: usize, recovery: bool, within: Duration) {
        let until = Instant::now() + within;
        while self.in_recovery(i) != Some(recovery) {
            assert!(
                Instant::now() < until,
                "node {} is not {} after {within:?}; see {}",
                i + 1,
                if recovery { "a standby" } else { "the primary" },
                self.root.display()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until the leader `i` has a synchronous standby streaming.
    fn await_sync_standby(&self, i: usize) {
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            let sync = postgres::Client::connect(&self.dsn(i, "postgres"), postgres::NoTls)
                .ok()
                .and_then(|mut c| {
                    c.query_one(
                        "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'",
                        &[],
                    )
                    .ok()
                })
                .map(|r| r.get::<_, i64>(0));
            if sync == Some(1) {
                return;
            }
            assert!(Instant::now() < until, "no synchronous standby after 60 s");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// kill -9 of node `i`: its Patroni, its postmaster and every backend,
    /// at once, as its machine dying would.
    pub fn kill9_node(&self, i: usize) {
        let mut procs = self.procs.lock().expect("lock");
        let patroni = procs[i + 1].id();
        let mut pids = vec![patroni];
        if let Ok(pid) =
            std::fs::read_to_string(self.root.join(format!("d{}/postmaster.pid", i + 1)))
            && let Some(pm) = pid
                .lines()
                .next()
                .and_then(|l| l.trim().parse::<u32>().ok())
        {
            pids.push(pm);
            pids.extend(children_of(pm));
        }
        kill9_all(&pids);
        let _ = procs[i + 1].wait();
    }
}

impl Drop for Patroni {
    fn drop(&mut self) {
        let mut procs = self.procs.lock().expect("lock");
        let pids: Vec<u32> = procs.iter().map(Child::id).collect();
        kill9_all(&pids);
        for c in procs.iter_mut() {
            let _ = c.wait();
        }
        for d in ["d1", "d2"] {
            let _ = sh(as_server_user(&self.user, &bindir().join("pg_ctl"))
                .args(["stop", "-m", "immediate", "-w", "-D"])
                .arg(self.root.join(d)));
        }
        let _ = std::fs::remove_dir_all(&self.root);
    }
}
