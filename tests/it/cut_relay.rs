//! Rule E3 across a connection cut at every byte: PostgreSQL and Redis
//! behind a relay that, once armed, forwards exactly N more bytes in one
//! direction (a request, client → server; or a reply, server → client)
//! and then cuts the connection, for N from 0 to past the end of one
//! call's traffic, for every kind of call: a read (`get_run`), a plain
//! write (`put_run` creating and updating, `patch_run`), a keyed write
//! (`patch_run_idempotent`), a tray write, `reserve` and `settle`, a
//! listing and a feed read. Whatever the cut, the answer is `Ok`,
//! `Unavailable` (and then nothing was written), or, for a write,
//! `OutcomeUnknown`; never `Corrupt` (a reply cut short is the
//! transport's failure, not damaged stored bytes). A keyed write whose
//! outcome is unknown, retried with its key, applies exactly once (I7).
//! And the call right after each cut, on a fresh connection, answers.
//!
//! Size: each call's request and reply are measured through the relay
//! first; `AGENTSTATE_CUT_OFFSETS` caps how many offsets of each are cut
//! (spread evenly over it, the first and last byte always among them;
//! `all` cuts every one: about 4,200 cuts on Redis and 7,600 on
//! PostgreSQL, about 4 minutes). The default, 48 per direction and call kind
//! (about 960 cuts per backend), keeps the file within about a minute.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use agentstate::{
    FeedScope, Hold, IdempotencyKey, InstanceKey, PageRequest, PersistenceReason, Position, Result,
    RunKey, RunRecord, StateDelta, StateError, StateQuery, Store, Tray, TrayKey,
};

/// Which way the bytes a cut counts go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    /// Client → server: a request.
    Request,
    /// Server → client: a reply.
    Reply,
}

#[derive(Default)]
struct Arm {
    /// Bytes seen each way since the last `measure` or `arm`.
    seen: [u64; 2],
    /// Armed: cut after this many more bytes in that direction.
    cut: Option<(Dir, u64)>,
    /// The armed cut happened.
    fired: bool,
}

/// A loopback relay to one server that cuts at an exact byte offset.
pub struct CutRelay {
    pub addr: SocketAddr,
    arm: Arc<Mutex<Arm>>,
    stop: Arc<AtomicBool>,
}

fn idx(d: Dir) -> usize {
    match d {
        Dir::Request => 0,
        Dir::Reply => 1,
    }
}

impl CutRelay {
    pub fn start(upstream: SocketAddr) -> CutRelay {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
        let addr = listener.local_addr().expect("its address");
        let arm = Arc::new(Mutex::new(Arm::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (a, s) = (arm.clone(), stop.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if s.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(upstream) else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let pair = || {
                    (
                        client.try_clone().expect("clone"),
                        server.try_clone().expect("clone"),
                    )
                };
                let (c1, s1) = pair();
                let (c2, s2) = pair();
                let (a1, a2) = (a.clone(), a.clone());
                std::thread::spawn(move || pump(c1, s1, Dir::Request, a1));
                std::thread::spawn(move || pump(s2, c2, Dir::Reply, a2));
            }
        });
        CutRelay { addr, arm, stop }
    }

    /// Counts from zero, cutting nothing.
    pub fn measure(&self) {
        *self.arm.lock().unwrap() = Arm::default();
    }

    /// The bytes seen each way since `measure` (request, reply).
    pub fn seen(&self) -> (u64, u64) {
        let a = self.arm.lock().unwrap();
        (a.seen[0], a.seen[1])
    }

    /// Cuts after `n` more bytes going `dir`.
    pub fn arm(&self, dir: Dir, n: u64) {
        *self.arm.lock().unwrap() = Arm {
            cut: Some((dir, n)),
            ..Arm::default()
        };
    }

    /// Disarms; true when the armed cut happened.
    pub fn disarm(&self) -> bool {
        let mut a = self.arm.lock().unwrap();
        a.cut = None;
        a.fired
    }
}

impl Drop for CutRelay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
    }
}

/// Forwards `from` → `to`, cutting both when the armed offset is reached.
fn pump(mut from: TcpStream, mut to: TcpStream, dir: Dir, arm: Arc<Mutex<Arm>>) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let mut a = arm.lock().unwrap();
        a.seen[idx(dir)] += n as u64;
        let keep = match a.cut {
            Some((d, left)) if d == dir => {
                if (n as u64) <= left {
                    a.cut = Some((d, left - n as u64));
                    None
                } else {
                    a.cut = None;
                    a.fired = true;
                    Some(left as usize)
                }
            }
            _ => None,
        };
        // Forwarded under the lock, so a cut and the bytes before it are
        // one step for the other direction too.
        match keep {
            None => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Some(k) => {
                let _ = to.write_all(&buf[..k]);
                let _ = to.flush();
                let _ = to.shutdown(Shutdown::Both);
                let _ = from.shutdown(Shutdown::Both);
                return;
            }
        }
        drop(a);
    }
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}

/// How many offsets of each request and reply are cut.
fn offsets_max() -> Option<u64> {
    match std::env::var("AGENTSTATE_CUT_OFFSETS") {
        Ok(s) if s.trim() == "all" => None,
        Ok(s) => Some(s.trim().parse().ok().filter(|n| *n > 0).unwrap_or(48)),
        Err(_) => Some(48),
    }
}

/// The offsets to cut a stream of `len` bytes at: every one, or at most
/// `max` spread evenly (0 and `len - 1` always among them).
fn offsets(len: u64) -> Vec<u64> {
    match offsets_max() {
        Some(max) if len > max && max > 1 => {
            let mut v: Vec<u64> = (0..max).map(|i| i * (len - 1) / (max - 1)).collect();
            v.dedup();
            v
        }
        Some(1) if len > 1 => vec![len / 2],
        _ => (0..len).collect(),
    }
}

/// What a cut call answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    Ok,
    Unavailable,
    Unknown,
}

fn answer<T>(what: &str, off: u64, dir: Dir, r: &Result<T>, writes: bool, keyed: bool) -> Answer {
    match r {
        Ok(_) => Answer::Ok,
        Err(StateError::Persistence {
            reason: PersistenceReason::Unavailable,
            ..
        }) => Answer::Unavailable,
        Err(StateError::Persistence {
            reason: PersistenceReason::OutcomeUnknown { keyed: k },
            ..
        }) if writes => {
            assert_eq!(*k, keyed, "{what} cut at {dir:?} byte {off}: keyed flag");
            Answer::Unknown
        }
        Err(e) => panic!("{what} cut at {dir:?} byte {off}: {e:?}"),
    }
}

/// The tallies of one backend's run.
#[derive(Default, Debug)]
struct Tally {
    cuts: u64,
    ok: u64,
    unavailable: u64,
    unknown: u64,
    /// Armed offsets past the end of the call's traffic (no cut).
    uncut: u64,
}

/// One kind of call, cut.
trait Case {
    fn name(&self) -> &'static str;
    fn writes(&self) -> bool;
    fn keyed(&self) -> bool {
        false
    }
    /// Unarmed, before the call (its setup).
    fn before(&mut self, _s: &dyn Store, _i: u64) {}
    /// The call.
    fn call(&mut self, s: &dyn Store, i: u64) -> Answerable;
    /// Unarmed, after the call answered `a`: the state is what `a` says.
    fn after(&mut self, s: &dyn Store, i: u64, a: Answer);
}

/// A call's result, with its value dropped.
type Answerable = Result<()>;

fn cost(c: u64) -> StateDelta {
    StateDelta {
        cost_micros: c,
        iterations: 1,
        ..Default::default()
    }
}

fn run_of(s: &dyn Store, k: &RunKey) -> RunRecord {
    s.get_run(k)
        .unwrap_or_else(|e| panic!("the call after a cut: {e:?}"))
        .expect("the run")
}

struct GetRun(RunKey);
impl Case for GetRun {
    fn name(&self) -> &'static str {
        "get_run"
    }
    fn writes(&self) -> bool {
        false
    }
    fn call(&mut self, s: &dyn Store, _: u64) -> Answerable {
        let r = s.get_run(&self.0)?;
        assert!(
            r.is_some_and(|r| r.key == self.0),
            "get_run answered Ok with another run"
        );
        Ok(())
    }
    fn after(&mut self, _: &dyn Store, _: u64, _: Answer) {}
}

struct Create(String);
impl Create {
    fn key(&self, i: u64) -> RunKey {
        RunKey::new(&self.0, format!("new-{i}"))
    }
}
impl Case for Create {
    fn name(&self) -> &'static str {
        "put_run (create)"
    }
    fn writes(&self) -> bool {
        true
    }
    fn call(&mut self, s: &dyn Store, i: u64) -> Answerable {
        s.put_run(RunRecord::new(self.key(i), "agent")).map(drop)
    }
    fn after(&mut self, s: &dyn Store, i: u64, a: Answer) {
        let got = s
            .get_run(&self.key(i))
            .unwrap_or_else(|e| panic!("the call after a cut: {e:?}"));
        match a {
            Answer::Ok => assert!(got.is_some(), "an acknowledged create is missing"),
            Answer::Unavailable => assert!(got.is_none(), "an Unavailable create was written"),
            Answer::Unknown => {}
        }
    }
}

/// `put_run` of the stored version, holding the record read before the
/// call (so the armed call is the put alone).
struct UpdateWith {
    key: RunKey,
    read: Option<RunRecord>,
}
impl Case for UpdateWith {
    fn name(&self) -> &'static str {
        "put_run (update)"
    }
    fn writes(&self) -> bool {
        true
    }
    fn before(&mut self, s: &dyn Store, _: u64) {
        self.read = Some(run_of(s, &self.key));
    }
    fn call(&mut self, s: &dyn Store, i: u64) -> Answerable {
        let mut r = self.read.clone().expect("read before");
        r.agent_name = format!("agent-{i}");
        s.put_run(r).map(drop)
    }
    fn after(&mut self, s: &dyn Store, _: u64, a: Answer) {
        let before = self.read.take().expect("read before").version;
        let now = run_of(s, &self.key).version;
        match a {
            Answer::Ok => assert_eq!(now, before + 1, "an acknowledged update"),
            Answer::Unavailable => assert_eq!(now, before, "an Unavailable update was written"),
            Answer::Unknown => assert!(now == before || now == before + 1, "{now} vs {before}"),
        }
    }
}

/// `patch_run`, with or without a key.
struct Patch {
    key: RunKey,
    idem: bool,
    before: u64,
}
impl Case for Patch {
    fn name(&self) -> &'static str {
        if self.idem {
            "patch_run_idempotent"
        } else {
            "patch_run"
        }
    }
    fn writes(&self) -> bool {
        true
    }
    fn keyed(&self) -> bool {
        self.idem
    }
    fn before(&mut self, s: &dyn Store, _: u64) {
        self.before = run_of(s, &self.key).cost_micros;
    }
    fn call(&mut self, s: &dyn Store, i: u64) -> Answerable {
        if self.idem {
            let k = IdempotencyKey::new(format!("p-{i}")).expect("key");
            s.patch_run_idempotent(&self.key, cost(1), &k).map(drop)
        } else {
            s.patch_run(&self.key, cost(1)).map(drop)
        }
    }
    fn after(&mut self, s: &dyn Store, i: u64, a: Answer) {
        let now = run_of(s, &self.key).cost_micros;
        match a {
            Answer::Ok => assert_eq!(now, self.before + 1, "an acknowledged patch"),
            Answer::Unavailable => assert_eq!(now, self.before, "an Unavailable patch was applied"),
            Answer::Unknown => assert!(now == self.before || now == self.before + 1),
        }
        if self.idem && a != Answer::Ok {
            // The keyed retry applies it exactly once, however the first
            // try ended.
            let k = IdempotencyKey::new(format!("p-{i}")).expect("key");
            s.patch_run_idempotent(&self.key, cost(1), &k)
                .unwrap_or_else(|e| panic!("the keyed retry after a cut: {e:?}"));
            s.patch_run_idempotent(&self.key, cost(1), &k)
                .unwrap_or_else(|e| panic!("the keyed retry after a cut: {e:?}"));
            let again = run_of(s, &self.key).cost_micros;
            assert_eq!(
                again,
                self.before + 1,
                "a keyed retry applied twice or never"
            );
        }
    }
}

struct WriteTray {
    key: TrayKey,
    before: Vec<u8>,
}
impl Case for WriteTray {
    fn name(&self) -> &'static str {
        "write_tray"
    }
    fn writes(&self) -> bool {
        true
    }
    fn before(&mut self, s: &dyn Store, _: u64) {
        self.before = s
            .read_tray(&self.key, 1)
            .unwrap_or_else(|e| panic!("read_tray: {e:?}"))
            .map(|t| t.doc)
            .unwrap_or_default();
    }
    fn call(&mut self, s: &dyn Store, i: u64) -> Answerable {
        s.write_tray(&self.key, 1, tray(i))
    }
    fn after(&mut self, s: &dyn Store, i: u64, a: Answer) {
        let now = s
            .read_tray(&self.key, 1)
            .unwrap_or_else(|e| panic!("the call after a cut: {e:?}"))
            .map(|t| t.doc)
            .unwrap_or_default();
        let new = tray(i).doc;
        match a {
            Answer::Ok => assert_eq!(now, new, "an acknowledged tray write"),
            Answer::Unavailable => assert_eq!(now, self.before, "an Unavailable tray write"),
            Answer::Unknown => assert!(now == new || now == self.before),
        }
    }
}

fn tray(i: u64) -> Tray {
    Tray {
        marked: i.is_multiple_of(2),
        doc: format!("{{\"i\":{i}}}").into_bytes(),
        env: "e".into(),
        hostname: "h".into(),
    }
}

fn holds(s: &dyn Store, run: &RunKey) -> Vec<String> {
    s.run_spend(run)
        .unwrap_or_else(|e| panic!("the call after a cut: {e:?}"))
        .expect("the run")
        .holds
        .into_iter()
        .map(|h| h.id)
        .collect()
}

struct Reserve(RunKey);
impl Case for Reserve {
    fn name(&self) -> &'static str {
        "reserve"
    }
    fn writes(&self) -> bool {
        true
    }
    fn call(&mut self, s: &dyn Store, i: u64) -> Answerable {
        s.reserve(&self.0, Hold::new(format!("r{i}"), 600_000).cost_micros(5))
            .map(drop)
    }
    fn after(&mut self, s: &dyn Store, i: u64, a: Answer) {
        let id = format!("r{i}");
        let held = holds(s, &self.0).contains(&id);
        match a {
            Answer::Ok => assert!(held, "an acknowledged hold is missing"),
            Answer::Unavailable => assert!(!held, "an Unavailable reserve was written"),
            Answer::Unknown => {}
        }
        if held {
            s.release_hold(&self.0, &id).expect("release");
        }
    }
}

struct Settle {
    run: RunKey,
    cost: u64,
}
impl Case for Settle {
    fn name(&self) -> &'static str {
        "settle"
    }
    fn writes(&self) -> bool {
        true
    }
    fn before(&mut self, s: &dyn Store, i: u64) {
        s.reserve(
            &self.run,
            Hold::new(format!("s{i}"), 600_000).cost_micros(5),
        )
        .expect("reserve before the settle");
        self.cost = run_of(s, &self.run).cost_micros;
    }
    fn call(&mut self, s: &dyn Store, i: u64) -> Answerable {
        s.settle(&self.run, &format!("s{i}"), cost(3)).map(drop)
    }
    fn after(&mut self, s: &dyn Store, i: u64, a: Answer) {
        let id = format!("s{i}");
        let held = holds(s, &self.run).contains(&id);
        let now = run_of(s, &self.run).cost_micros;
        match a {
            Answer::Ok => assert!(!held && now == self.cost + 3, "an acknowledged settle"),
            Answer::Unavailable => {
                assert!(
                    held && now == self.cost,
                    "an Unavailable settle was applied"
                )
            }
            Answer::Unknown => assert!(
                (held && now == self.cost) || (!held && now == self.cost + 3),
                "a settle half applied: held {held}, cost {now} from {}",
                self.cost
            ),
        }
        if held {
            s.release_hold(&self.run, &id).expect("release");
        }
    }
}

struct List(String);
impl Case for List {
    fn name(&self) -> &'static str {
        "list_runs"
    }
    fn writes(&self) -> bool {
        false
    }
    fn call(&mut self, s: &dyn Store, _: u64) -> Answerable {
        let p = s.list_runs(&StateQuery::new(&self.0), &PageRequest::new(5))?;
        assert!(!p.items().is_empty(), "a listing answered Ok and empty");
        Ok(())
    }
    fn after(&mut self, _: &dyn Store, _: u64, _: Answer) {}
}

struct Feed(String);
impl Case for Feed {
    fn name(&self) -> &'static str {
        "changes"
    }
    fn writes(&self) -> bool {
        false
    }
    fn call(&mut self, s: &dyn Store, _: u64) -> Answerable {
        let scope = FeedScope::Tenant {
            tenant: self.0.clone(),
        };
        let p = s.changes(&scope, Position::START, 5)?;
        assert!(!p.changes.is_empty(), "a feed read answered Ok and empty");
        Ok(())
    }
    fn after(&mut self, _: &dyn Store, _: u64, _: Answer) {}
}

/// Every case, cut at every chosen offset of its request and its reply,
/// through `relay` (`s` is connected through it).
fn cut_everything(s: &dyn Store, relay: &CutRelay, tenant: &str, backend: &str) -> Tally {
    let run = |id: &str| {
        let k = RunKey::new(tenant, id);
        s.put_run(RunRecord::new(k.clone(), "agent"))
            .expect("create a run");
        k
    };
    let (read, upd, patched, keyed, spend, settled) = (
        run("read"),
        run("upd"),
        run("patched"),
        run("keyed"),
        run("spend"),
        run("settled"),
    );
    let mut cases: Vec<Box<dyn Case>> = vec![
        Box::new(GetRun(read)),
        Box::new(Create(tenant.to_string())),
        Box::new(UpdateWith {
            key: upd,
            read: None,
        }),
        Box::new(Patch {
            key: patched,
            idem: false,
            before: 0,
        }),
        Box::new(Patch {
            key: keyed,
            idem: true,
            before: 0,
        }),
        Box::new(WriteTray {
            key: InstanceKey::new(tenant, "w").tray("state", "main"),
            before: Vec::new(),
        }),
        Box::new(Reserve(spend)),
        Box::new(Settle {
            run: settled,
            cost: 0,
        }),
        Box::new(List(tenant.to_string())),
        Box::new(Feed(tenant.to_string())),
    ];
    let probe = RunKey::new(tenant, "read");
    // Written before each cut: on Redis the first write on a connection
    // dialed after a cut reads the server's settings first (issue 54), and
    // that read must not take the cut meant for the call.
    let settings = RunKey::new(tenant, "settings");
    s.put_run(RunRecord::new(settings.clone(), "probe"))
        .expect("the settings run");
    let mut total = Tally::default();
    let mut i = 0u64;
    for case in cases.iter_mut() {
        // Warm (statements prepared, scripts loaded), then measured.
        i += 1;
        case.before(s, i);
        case.call(s, i)
            .unwrap_or_else(|e| panic!("{}: {e:?}", case.name()));
        case.after(s, i, Answer::Ok);
        i += 1;
        case.before(s, i);
        relay.measure();
        case.call(s, i)
            .unwrap_or_else(|e| panic!("{}: {e:?}", case.name()));
        let (req, rep) = relay.seen();
        case.after(s, i, Answer::Ok);
        let mut t = Tally::default();
        for dir in [Dir::Request, Dir::Reply] {
            let len = if dir == Dir::Request { req } else { rep };
            for off in offsets(len) {
                i += 1;
                case.before(s, i);
                s.patch_run(&settings, StateDelta::default())
                    .unwrap_or_else(|e| panic!("the write before a cut: {e:?}"));
                relay.arm(dir, off);
                let t0 = std::time::Instant::now();
                let r = case.call(s, i);
                let fired = relay.disarm();
                if std::env::var_os("AGENTSTATE_CUT_TRACE").is_some() {
                    eprintln!(
                        "{} {dir:?} {off}: {:?} in {:?}",
                        case.name(),
                        r.as_ref().err(),
                        t0.elapsed()
                    );
                }
                let a = answer(case.name(), off, dir, &r, case.writes(), case.keyed());
                t.cuts += 1;
                if !fired {
                    t.uncut += 1;
                }
                match a {
                    Answer::Ok => t.ok += 1,
                    Answer::Unavailable => t.unavailable += 1,
                    Answer::Unknown => t.unknown += 1,
                }
                // A write whose outcome is unknown may still be landing
                // (the server read it whole before the cut): let it.
                if a == Answer::Unknown {
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                // The call right after (on a fresh connection when the
                // cut one was cut) answers, and so do those that check
                // the state is what the answer said.
                if let Err(e) = s.get_run(&probe) {
                    panic!(
                        "{} cut at {dir:?} byte {off}: the next call: {e:?}",
                        case.name()
                    );
                }
                case.after(s, i, a);
            }
        }
        eprintln!(
            "e3 cut relay {backend} {}: request {req} B, reply {rep} B: {} cuts: {} ok, {} \
             unavailable, {} outcome-unknown ({} past the end)",
            case.name(),
            t.cuts,
            t.ok,
            t.unavailable,
            t.unknown,
            t.uncut
        );
        total.cuts += t.cuts;
        total.ok += t.ok;
        total.unavailable += t.unavailable;
        total.unknown += t.unknown;
        total.uncut += t.uncut;
    }
    eprintln!("e3 cut relay {backend} total: {total:?}, 0 corrupt");
    total
}

#[cfg(feature = "postgres")]
#[test]
fn e3_postgres_cut_at_every_byte_is_never_corrupt() {
    use agentstate::{PgOptions, PostgresStore};
    use std::time::Duration;
    let server = crate::pg_server::PgServer::start(false);
    let dsn = server.dsn("postgres");
    let relay = CutRelay::start(crate::fault_proxy::url_addr(&dsn));
    let direct = PostgresStore::connect(&dsn).expect("connect");
    direct.setup().expect("setup");
    let s = PostgresStore::connect_with(
        &crate::fault_proxy::via(&dsn, relay.addr),
        PgOptions::new()
            .pool_size(1)
            .connect_timeout(Duration::from_secs(5))
            .statement_timeout(Duration::from_secs(5)),
    )
    .expect("connect through the relay");
    let t = cut_everything(&s, &relay, "pg", "postgres");
    assert!(t.cuts > t.uncut, "no cut happened");
}

#[cfg(feature = "redis")]
#[test]
fn e3_redis_cut_at_every_byte_is_never_corrupt() {
    use agentstate::{RedisOptions, RedisStore};
    use std::time::Duration;
    let server = crate::redis_server::Server::start(&crate::redis_server::temp_dir("cut"), &[]);
    let url = server.url(0);
    let relay = CutRelay::start(crate::fault_proxy::url_addr(&url));
    let s = RedisStore::connect_with(
        &crate::fault_proxy::via(&url, relay.addr),
        RedisOptions::new()
            .pool_size(1)
            .connect_timeout(Duration::from_secs(5))
            .io_timeout(Duration::from_secs(5))
            // Read again only on a new connection (absorbed before each
            // cut), not by the clock in the middle of a measured call.
            .settings_interval(Duration::from_secs(3_600)),
    )
    .expect("connect through the relay");
    let t = cut_everything(&s, &relay, "redis", "redis");
    assert!(t.cuts > t.uncut, "no cut happened");
}
