//! Throwaway `redis-server`s for the tests: the shared one (started on
//! first use, one per test binary) or one a test owns (to kill and
//! restart). Each runs on a free loopback port, in a temp dir, with
//! `appendonly yes` and `appendfsync always`, under a shell watchdog that
//! stops it when the test process is gone (a test binary has no global
//! teardown). `AGENTSTATE_TEST_REDIS_URL` names a server to use instead of
//! the shared one. A missing `redis-server` fails the tests with the
//! command that installs it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use agentstate::{PersistenceReason, RedisOptions, RedisStore, StateError};

const INSTALL: &str = "apt-get update && apt-get install -y redis-server";

/// A server the tests started.
pub struct Server {
    /// The port clients use: the TLS port of a TLS server (which then
    /// listens on no plain port).
    pub port: u16,
    pub dir: PathBuf,
    child: Option<Child>,
    extra: Vec<String>,
    /// For a TLS server, what a client trusts and shows.
    tls: Option<TlsClient>,
}

/// What a client of a TLS test server uses: the CA that signed the
/// server's certificate, and (for `--tls-auth-clients yes`) its own.
#[derive(Clone)]
pub struct TlsClient {
    pub ca: Vec<u8>,
    pub client: Option<(Vec<u8>, Vec<u8>)>,
}

impl Server {
    /// Starts a server in `dir` (kept across restarts), with extra
    /// `--name value` settings.
    pub fn start(dir: &Path, extra: &[&str]) -> Server {
        std::fs::create_dir_all(dir).expect("create the server's dir");
        let port = free_port();
        let mut s = Server {
            port,
            dir: dir.to_path_buf(),
            child: None,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            tls: None,
        };
        s.spawn();
        s
    }

    /// Starts a server that takes TLS only (on `port`), its certificate
    /// for 127.0.0.1 and localhost signed by `certs`' CA; with
    /// `auth_clients` it asks for a client certificate that CA signed.
    pub fn start_tls(dir: &Path, certs: &Certs, auth_clients: bool, extra: &[&str]) -> Server {
        std::fs::create_dir_all(dir).expect("create the server's dir");
        let port = free_port();
        let path = |p: &Path| p.display().to_string();
        let mut args = vec![
            "--tls-cert-file".to_string(),
            path(&certs.server_cert),
            "--tls-key-file".into(),
            path(&certs.server_key),
            "--tls-ca-cert-file".into(),
            path(&certs.ca),
            "--tls-auth-clients".into(),
            if auth_clients { "yes" } else { "no" }.into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let client = TlsClient {
            ca: std::fs::read(&certs.ca).expect("read the CA"),
            client: Some((
                std::fs::read(&certs.client_cert).expect("read the client cert"),
                std::fs::read(&certs.client_key).expect("read the client key"),
            )),
        };
        let mut s = Server {
            port,
            dir: dir.to_path_buf(),
            child: None,
            extra: args,
            tls: Some(client),
        };
        s.spawn();
        s
    }

    /// `redis://127.0.0.1:port/db`, or `rediss://…` for a TLS server.
    pub fn url(&self, db: u32) -> String {
        let scheme = if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://127.0.0.1:{}/{db}", self.port)
    }

    /// Options that trust a TLS server's CA and show the client
    /// certificate (the default options for a plain server).
    pub fn opts(&self) -> RedisOptions {
        match &self.tls {
            Some(t) => {
                let o = RedisOptions::new().tls_ca_pem(t.ca.clone());
                match &t.client {
                    Some((cert, key)) => o.tls_client_pem(cert.clone(), key.clone()),
                    None => o,
                }
            }
            None => RedisOptions::new(),
        }
    }

    fn spawn(&mut self) {
        let bin = which("redis-server").unwrap_or_else(|| {
            panic!("redis-server is not installed; the Redis tests need it: {INSTALL}")
        });
        let (port, tls_port) = match self.tls {
            Some(_) => (0, self.port),
            None => (self.port, 0),
        };
        let mut args = vec![
            "--port".to_string(),
            port.to_string(),
            "--tls-port".into(),
            tls_port.to_string(),
            "--bind".into(),
            "127.0.0.1".into(),
            "--dir".into(),
            self.dir.display().to_string(),
            "--appendonly".into(),
            "yes".into(),
            "--appendfsync".into(),
            "always".into(),
            "--save".into(),
            "".into(),
            "--daemonize".into(),
            "no".into(),
            "--logfile".into(),
            self.dir.join("redis.log").display().to_string(),
        ];
        args.extend(self.extra.iter().cloned());
        let quoted: Vec<String> = args.iter().map(|a| format!("'{a}'")).collect();
        // The watchdog: the server runs as the shell's child; when the test
        // process (our pid) is gone, the shell kills it and exits. `exec`
        // is not used so the loop can outlive a dead parent.
        let script = format!(
            "{} {} & r=$!; echo $r > '{}'; while kill -0 {} 2>/dev/null && kill -0 $r 2>/dev/null; do sleep 0.5; done; kill -9 $r 2>/dev/null; wait $r",
            bin.display(),
            quoted.join(" "),
            self.dir.join("server.pid").display(),
            std::process::id()
        );
        let _ = std::fs::remove_file(self.dir.join("server.pid"));
        let child = Command::new("sh")
            .arg("-c")
            .arg(script)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the redis-server watchdog");
        self.child = Some(child);
        self.wait_ready();
    }

    /// A replica of the server on `master_port` (`--replicaof`), ready
    /// once its link to the master is up.
    /// Ready once the master streams to it: after a diskless sync the
    /// master holds writes back until the replica's first `REPLCONF ACK`
    /// (up to a second), and a master lost before that loses them all.
    pub fn start_replica(dir: &Path, master_port: u16) -> Server {
        let port = master_port.to_string();
        let s = Self::start(
            dir,
            &[
                "--replicaof",
                "127.0.0.1",
                &port,
                // Promoted, it syncs a new replica at once (not after the
                // default 5 s wait for more replicas to join).
                "--repl-diskless-sync-delay",
                "0",
            ],
        );
        // A write, then `WAIT 1` on the same connection: 1 once the replica
        // acknowledged it, which means the stream has started. (The probe
        // key is in database 9, no store's, and expires.)
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let mut cli = Command::new("redis-cli")
                .args(["-p", &port])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("redis-cli: {e}; install it: {INSTALL}"));
            if let Some(mut stdin) = cli.stdin.take() {
                use std::io::Write;
                let _ = stdin.write_all(b"SELECT 9\nSET replication-probe 1 PX 2000\nWAIT 1 300\n");
            }
            let out = cli.wait_with_output().expect("redis-cli");
            let text = String::from_utf8_lossy(&out.stdout);
            if text.lines().last().map(str::trim) == Some("1") {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "the master on port {port} does not stream to its replica on port {}",
                s.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `INFO replication` of this server, as text.
    pub fn replication(&self) -> String {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string(), "INFO", "replication"])
            .output()
            .unwrap_or_else(|e| panic!("redis-cli: {e}; install it: {INSTALL}"));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Waits until the server answers: a store connects, or the server
    /// refuses it (a test's misconfigured server, a password it wants);
    /// a replica, until its link to its master is up (a store does not
    /// connect to a replica: it writes).
    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        if self.extra.iter().any(|a| a == "--replicaof") {
            while !self.replication().contains("master_link_status:up") {
                assert!(
                    Instant::now() < deadline,
                    "the replica on port {} did not sync: {}",
                    self.port,
                    self.replication()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
            return;
        }
        loop {
            match RedisStore::connect_with(
                &self.url(0),
                self.opts().pool_size(1).require_fsync(false),
            ) {
                Ok(_) => return,
                Err(StateError::Persistence {
                    reason: PersistenceReason::Refused,
                    ..
                }) => return,
                Err(e) if Instant::now() > deadline => {
                    panic!("redis-server on port {} did not start: {e}", self.port)
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// The server's own pid (not the watchdog's).
    pub fn pid(&self) -> u32 {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Ok(p) = std::fs::read_to_string(self.dir.join("server.pid"))
                && let Ok(p) = p.trim().parse()
            {
                return p;
            }
            assert!(Instant::now() < deadline, "redis-server wrote no pid");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILLs the server (a crash: nothing flushed that was not already).
    pub fn kill9(&mut self) {
        let pid = self.pid();
        let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
    }

    /// Starts the server (killed) again on the same dir and port, as a
    /// replica of the server on `master_port`, as Sentinel would make a
    /// master it failed over from.
    pub fn restart_as_replica_of(&mut self, master_port: u16) {
        assert!(self.child.is_none(), "restart after kill9");
        if let Some(i) = self.extra.iter().position(|a| a == "--replicaof") {
            self.extra.drain(i..(i + 3).min(self.extra.len()));
        }
        self.extra.extend([
            "--replicaof".to_string(),
            "127.0.0.1".to_string(),
            master_port.to_string(),
        ]);
        self.spawn();
    }

    /// Starts the server again on the same dir and port.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "restart after kill9");
        self.spawn();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.child.is_some() {
            self.kill9();
        }
    }
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// A fresh temp dir for a server, under the target's temp dir.
pub fn temp_dir(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "redis-{name}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    ));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// The URL of the shared server, database `db` (0 for the conformance
/// suite; other tests that need an empty store take their own database).
pub fn shared_url(db: u32) -> String {
    if let Ok(url) = std::env::var("AGENTSTATE_TEST_REDIS_URL") {
        // The named server's own database number is replaced by `db`.
        let base = url.trim_end_matches('/');
        let base = match base.rsplit_once('/') {
            Some((b, tail))
                if tail.parse::<u32>().is_ok()
                    && b.contains("://")
                    && b.split("://").nth(1).is_some_and(|h| !h.is_empty()) =>
            {
                b.to_string()
            }
            _ => base.to_string(),
        };
        return format!("{base}/{db}");
    }
    static SHARED: OnceLock<Server> = OnceLock::new();
    SHARED
        .get_or_init(|| Server::start(&temp_dir("shared"), &[]))
        .url(db)
}

/// Empties one database of a server (`redis-cli FLUSHDB`), for a test that
/// needs an empty store.
pub fn flush(url: &str) {
    let ok = Command::new("redis-cli")
        .args(["-u", url, "FLUSHDB"])
        .stdout(Stdio::null())
        .status()
        .unwrap_or_else(|e| panic!("redis-cli: {e}; install it: {INSTALL}"))
        .success();
    assert!(ok, "redis-cli FLUSHDB on {url} failed");
}

pub use crate::certs::Certs;
