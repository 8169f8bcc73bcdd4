//! A PostgreSQL primary lost mid-load (issue 52): a primary and a standby
//! made with `pg_basebackup`, on loopback; eight writers (keyed creates,
//! keyed patches, keyed reserve/settle on one capped budget, tray writes)
//! and a feed consumer, all through one multi-host URL
//! (`host=primary,standby`, `target_session_attrs=read-write`). The
//! primary is killed with SIGKILL (postmaster and every backend at once)
//! in the middle of the load, the standby promoted with `pg_ctl promote`,
//! and the writers carry on against it.
//!
//! With a synchronous standby every acknowledged write is there after the
//! failover, spend totals are exact, the cap is never exceeded, every keyed
//! retry applied once, and the consumer's view equals the store record for
//! record, no change seen twice. With an asynchronous standby the same
//! load measures what an `Ok` does not survive (reported, not asserted
//! zero: the store says so in `stats`).
//!
//! Size: `AGENTSTATE_FAILOVER_OPS` rounds per writer (default 30) and
//! `AGENTSTATE_FAILOVERS` failovers in the synchronous test (default 1;
//! each next one makes a new standby of the promoted server). Figures go
//! to stderr (BENCHMARKS.md, "Failover").

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use agentstate::{
    BudgetKey, BudgetRecord, Caps, Changed, FeedScope, Hold, IdempotencyKey, InstanceKey, Position,
    Result, RunKey, RunRecord, StateDelta, StateError, StateQuery, Store, Tray,
};
#[cfg(feature = "postgres")]
use agentstate::{PgOptions, PostgresStore};

#[cfg(feature = "postgres")]
use crate::pg_server::PgServer;

const WRITERS: u64 = 8;
const TENANT: &str = "fleet";

fn ops() -> u64 {
    std::env::var("AGENTSTATE_FAILOVER_OPS")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(30)
}

#[cfg(feature = "postgres")]
fn failovers() -> u32 {
    std::env::var("AGENTSTATE_FAILOVERS")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(1)
}

/// Both servers, primary first: libpq's multi-host form; the driver
/// takes the one that accepts writes.
#[cfg(feature = "postgres")]
fn fleet_url(a: &PgServer, b: &PgServer) -> String {
    format!(
        "postgres://agentstate@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
        a.port, b.port
    )
}

#[cfg(feature = "postgres")]
fn opts() -> PgOptions {
    PgOptions::new()
        .pool_size(12)
        .connect_timeout(Duration::from_secs(2))
}

/// How one call was answered, for the counts.
#[derive(Default)]
struct Seen {
    unknown: AtomicU64,
    unavailable: AtomicU64,
    /// Milliseconds from the kill to the first `Ok` after it, once.
    first_ok_after_kill: AtomicU64,
    /// The moment the primary died, while a failover is measured.
    killed_at: Mutex<Option<Instant>>,
}

/// Calls `op` until it answers (an `Ok` or a refusal that is the call's
/// own answer); a failure that says a retry is safe is retried, for up to
/// a minute (the failover's length). `idempotent` marks a call safe to
/// repeat even after an unknown outcome (a tray write of the same value).
fn answered<T>(
    seen: &Seen,
    what: &str,
    idempotent: bool,
    mut op: impl FnMut() -> Result<T>,
) -> Result<T> {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let started = Instant::now();
        match op() {
            Err(e) if e.is_retryable() || (idempotent && e.is_outcome_unknown()) => {
                if e.is_outcome_unknown() {
                    seen.unknown.fetch_add(1, Ordering::Relaxed);
                } else {
                    seen.unavailable.fetch_add(1, Ordering::Relaxed);
                }
                assert!(Instant::now() < until, "{what}: no answer in 60 s: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
            other => {
                // The first Ok of a call made after the kill (not a reply
                // the dying server had already sent).
                if other.is_ok()
                    && let Some(at) = *seen.killed_at.lock().expect("lock")
                    && started >= at
                {
                    let ms = at.elapsed().as_millis() as u64;
                    let _ = seen.first_ok_after_kill.compare_exchange(
                        0,
                        ms.max(1),
                        Ordering::AcqRel,
                        Ordering::Relaxed,
                    );
                }
                return other;
            }
        }
    }
}

fn cost(c: u64) -> StateDelta {
    StateDelta {
        cost_micros: c,
        iterations: 1,
        ..Default::default()
    }
}

fn key(s: String) -> IdempotencyKey {
    IdempotencyKey::new(s).expect("a valid key")
}

/// What the writers were told `Ok` to.
#[derive(Default)]
struct Acked {
    /// Writes acknowledged, of every kind.
    writes: u64,
    /// Runs created.
    created: Vec<RunKey>,
    /// Per writer: the cost patched onto its run `patch-t`, and settled
    /// on its run `spend-t` (which draws on the shared budget).
    patched: BTreeMap<u64, u64>,
    settled: BTreeMap<u64, u64>,
    /// Reserves the cap refused.
    refused: u64,
    /// Acknowledged writes a later call found missing (a hold its settle
    /// did not find, a run a patch did not).
    lost: Vec<String>,
    /// Per writer: the last tray doc written.
    tray: BTreeMap<u64, Vec<u8>>,
}

/// The budget's cap: about 70% of what the writers' settles would spend,
/// so the last reserves meet it.
fn cap() -> u64 {
    WRITERS * ops() * 3 * 7 / 10
}

/// One writer's rounds through `store`.
fn writer(store: &dyn Store, t: u64, seen: &Seen, acked: &Mutex<Acked>) {
    let spend = RunKey::new(TENANT, format!("spend-{t}"));
    let patched = RunKey::new(TENANT, format!("patch-{t}"));
    let inst = InstanceKey::new("workers", format!("w{t}"));
    for i in 0..ops() {
        let run = RunKey::new(TENANT, format!("r-{t}-{i}"));
        answered(seen, "create", false, || {
            store.put_run_idempotent(
                RunRecord::new(run.clone(), "planner"),
                &key(format!("c-{t}-{i}")),
            )
        })
        .expect("a keyed create");
        {
            let mut a = acked.lock().expect("lock");
            a.created.push(run);
            a.writes += 1;
        }

        let amount = t * 1_000 + i + 1;
        match answered(seen, "patch", false, || {
            store.patch_run_idempotent(&patched, cost(amount), &key(format!("p-{t}-{i}")))
        }) {
            Ok(_) => {
                let mut a = acked.lock().expect("lock");
                *a.patched.entry(t).or_default() += amount;
                a.writes += 1;
            }
            // The run's acknowledged create did not survive a failover
            // (Redis without WAIT: a master failed over from, then wiped
            // by its resync): a lost write, counted once.
            Err(StateError::NotFound(_)) => lost_once(acked, &patched),
            Err(e) => panic!("patch: {e:?}"),
        }

        let hold = format!("h-{t}-{i}");
        match answered(seen, "reserve", false, || {
            store.reserve_idempotent(
                &spend,
                Hold::new(hold.clone(), 600_000).cost_micros(3),
                &key(format!("r-{t}-{i}")),
            )
        }) {
            Ok(_) => {
                match answered(seen, "settle", false, || {
                    store.settle_idempotent(&spend, &hold, cost(3), &key(format!("s-{t}-{i}")))
                }) {
                    Ok(_) => {
                        let mut a = acked.lock().expect("lock");
                        *a.settled.entry(t).or_default() += 3;
                        a.writes += 2;
                    }
                    // The acknowledged reserve did not survive the
                    // failover (an asynchronous standby): a lost write.
                    Err(StateError::NotFound(_)) => {
                        let mut a = acked.lock().expect("lock");
                        a.lost.push(format!("hold {hold}"));
                        a.writes += 1;
                    }
                    Err(e) => panic!("settle: {e:?}"),
                }
            }
            Err(StateError::NotFound(_)) => lost_once(acked, &spend),
            Err(StateError::BudgetExceeded { .. }) => {
                let mut a = acked.lock().expect("lock");
                a.refused += 1;
                a.writes += 1;
            }
            Err(e) => panic!("reserve: {e:?}"),
        }

        let doc = format!("{t}:{i}").into_bytes();
        let tray = Tray {
            marked: i % 2 == 0,
            doc: doc.clone(),
            env: "*".into(),
            hostname: "*".into(),
        };
        answered(seen, "write_tray", true, || {
            store.write_tray(&inst.tray("state", "main"), 1, tray.clone())
        })
        .expect("a tray write");
        let mut a = acked.lock().expect("lock");
        a.tray.insert(t, doc);
        a.writes += 1;
    }
}

/// Notes once that an acknowledged run is gone.
fn lost_once(acked: &Mutex<Acked>, run: &RunKey) {
    let what = format!("run {}", run.run_id);
    let mut a = acked.lock().expect("lock");
    if !a.lost.contains(&what) {
        a.lost.push(what);
    }
}

/// The feed consumer's view: each run as its latest change says, and
/// every (run, version) it was shown, to find a change shown twice.
#[derive(Default)]
struct View {
    runs: BTreeMap<String, RunRecord>,
    repeats: Vec<String>,
    /// Errors that made the consumer start over.
    errors: Vec<String>,
    pages: u64,
}

fn consume(store: &dyn Store, stop: &AtomicBool, seen: &Seen) -> View {
    let scope = FeedScope::tenant(TENANT);
    let mut view = View::default();
    let mut shown: BTreeMap<String, u64> = BTreeMap::new();
    let mut at = Position::START;
    let mut drained_after_stop = false;
    loop {
        let page = match answered(seen, "changes", false, || {
            store.wait_changes(&scope, at, 200, Duration::from_millis(200))
        }) {
            Ok(p) => p,
            Err(e) => {
                // A position the new primary does not know (changes lost
                // with an asynchronous standby): start over, as a
                // consumer would, and say so.
                view.errors.push(e.to_string());
                at = Position::START;
                shown.clear();
                view.runs.clear();
                continue;
            }
        };
        view.pages += 1;
        let empty = page.changes.is_empty();
        for c in page.changes {
            match c.item {
                Changed::Run { run } => {
                    let id = run.key.run_id.clone();
                    if shown.get(&id).is_some_and(|v| *v >= run.version) {
                        view.repeats
                            .push(format!("{id} v{} after v{}", run.version, shown[&id]));
                    }
                    shown.insert(id.clone(), run.version);
                    view.runs.insert(id, run);
                }
                Changed::RunDeleted { key } => {
                    view.runs.remove(&key.run_id);
                }
                _ => {}
            }
        }
        at = page.next;
        if empty && stop.load(Ordering::Acquire) {
            if drained_after_stop {
                return view;
            }
            // One more pass after the writers stopped: what they wrote
            // last is in it.
            drained_after_stop = true;
        }
    }
}

/// Creates the shared budget and each writer's two runs.
fn prepare(store: &dyn Store) {
    store
        .put_budget(BudgetRecord::new(
            BudgetKey::new(TENANT, "shared"),
            Caps::new().cost_micros(cap()),
        ))
        .expect("the budget");
    for t in 0..WRITERS {
        store
            .put_run(
                RunRecord::new(RunKey::new(TENANT, format!("spend-{t}")), "spender")
                    .with_budget("shared"),
            )
            .expect("a spend run");
        store
            .put_run(RunRecord::new(
                RunKey::new(TENANT, format!("patch-{t}")),
                "patcher",
            ))
            .expect("a patched run");
    }
}

/// What the load saw while its server failed over.
struct Loaded {
    acked: Acked,
    view: View,
    seen: Seen,
    /// Per failover: from the kill to the new primary taking writes (as
    /// `fail_over` reports it), and to a writer's first `Ok` after it.
    promote_ms: Vec<u128>,
    first_write_ms: Vec<u64>,
}

/// The writers and a feed consumer through `store`; `kills` times, once a
/// share of the rounds is written, `kill(k)` kills the primary,
/// `promote(k)` brings the new one up (timed), and once a writer's call
/// made after the kill answered `Ok` (timed), `then(k)` readies the next
/// failover (a new standby).
fn load(
    store: &dyn Store,
    kills: u32,
    mut kill: impl FnMut(u32),
    mut promote: impl FnMut(u32),
    mut then: impl FnMut(u32),
) -> Loaded {
    let seen = Seen::default();
    let acked = Mutex::new(Acked::default());
    let stop = AtomicBool::new(false);
    let (mut promote_ms, mut first_write_ms) = (Vec::new(), Vec::new());
    /// Stops the consumer however the scope ends (a failed assertion
    /// in it must not leave the consumer polling forever).
    struct StopOnDrop<'a>(&'a AtomicBool);
    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
        }
    }
    let view = std::thread::scope(|scope| {
        let _stop = StopOnDrop(&stop);
        let consumer = {
            // Its own counts: the failover's first Ok is a writer's.
            let stop = &stop;
            scope.spawn(move || consume(store, stop, &Seen::default()))
        };
        let writers: Vec<_> = (0..WRITERS)
            .map(|t| {
                let (seen, acked) = (&seen, &acked);
                scope.spawn(move || writer(store, t, seen, acked))
            })
            .collect();
        for k in 0..kills {
            // Mid-load: a share of the rounds written.
            let want = (WRITERS * ops() * (k as u64 + 1)) / (kills as u64 + 1);
            while (acked.lock().expect("lock").created.len() as u64) < want {
                std::thread::sleep(Duration::from_millis(5));
            }
            seen.first_ok_after_kill.store(0, Ordering::Release);
            kill(k);
            let t0 = Instant::now();
            *seen.killed_at.lock().expect("lock") = Some(t0);
            promote(k);
            promote_ms.push(t0.elapsed().as_millis());
            while seen.first_ok_after_kill.load(Ordering::Acquire) == 0
                && writers.iter().any(|w| !w.is_finished())
            {
                std::thread::sleep(Duration::from_millis(2));
            }
            first_write_ms.push(seen.first_ok_after_kill.load(Ordering::Acquire));
            *seen.killed_at.lock().expect("lock") = None;
            then(k);
        }
        for w in writers {
            w.join().expect("a writer");
        }
        stop.store(true, Ordering::Release);
        consumer.join().expect("the consumer")
    });
    Loaded {
        acked: acked.into_inner().expect("lock"),
        view,
        seen,
        promote_ms,
        first_write_ms,
    }
}

/// What the store holds after the failover, against what was acknowledged
/// and what the consumer was shown.
struct Audit {
    lost: Vec<String>,
    double_applied: Vec<String>,
    view_mismatch: Vec<String>,
    /// The budget's spend over the settles acknowledged (equal when
    /// nothing was lost).
    spent: u64,
    settled: u64,
}

fn audit(now: &dyn Store, acked: &Acked, view: &View) -> Audit {
    let mut lost: Vec<String> = acked.lost.clone();
    let mut double = Vec::new();
    for run in &acked.created {
        if now.get_run(run).expect("read").is_none() {
            lost.push(format!("created run {}", run.run_id));
        }
    }
    let mut settled_total = 0;
    for t in 0..WRITERS {
        settled_total += acked.settled.get(&t).copied().unwrap_or(0);
        for (run, want) in [
            (
                format!("patch-{t}"),
                acked.patched.get(&t).copied().unwrap_or(0),
            ),
            (
                format!("spend-{t}"),
                acked.settled.get(&t).copied().unwrap_or(0),
            ),
        ] {
            let Some(got) = now
                .get_run(&RunKey::new(TENANT, run.as_str()))
                .expect("read")
                .map(|r| r.cost_micros)
            else {
                lost.push(format!("{run}: missing"));
                continue;
            };
            match got.cmp(&want) {
                std::cmp::Ordering::Less => {
                    lost.push(format!("{run}: cost {got} < acknowledged {want}"))
                }
                std::cmp::Ordering::Greater => {
                    double.push(format!("{run}: cost {got} > acknowledged {want}"))
                }
                std::cmp::Ordering::Equal => {}
            }
        }
        let tray = now
            .read_tray(
                &InstanceKey::new("workers", format!("w{t}")).tray("state", "main"),
                1,
            )
            .expect("read the tray");
        if tray.as_ref().map(|t| &t.doc) != acked.tray.get(&t) {
            lost.push(format!(
                "writer {t}: tray {:?}, acknowledged {:?}",
                tray.map(|t| t.doc),
                acked.tray.get(&t)
            ));
        }
    }
    let budget = now
        .get_budget(&BudgetKey::new(TENANT, "shared"))
        .expect("read the budget");
    let spent = match &budget {
        Some(b) => {
            assert!(
                b.spent.cost_micros + b.held.cost_micros <= cap(),
                "the cap was exceeded: spent {} + held {} > {}",
                b.spent.cost_micros,
                b.held.cost_micros,
                cap()
            );
            b.spent.cost_micros
        }
        None => {
            lost.push("the budget: missing".to_string());
            0
        }
    };
    // The consumer's view against the store, record for record.
    let mut view_mismatch = Vec::new();
    let stored: BTreeMap<String, RunRecord> = now
        .iter_runs(&StateQuery::new(TENANT))
        .map(|r| r.map(|r| (r.key.run_id.clone(), r)))
        .collect::<Result<_>>()
        .expect("list the runs");
    for (id, r) in &stored {
        match view.runs.get(id) {
            None => view_mismatch.push(format!("{id}: in the store, never shown")),
            Some(v) if v.version != r.version || v.cost_micros != r.cost_micros => view_mismatch
                .push(format!(
                    "{id}: shown v{} cost {}, stored v{} cost {}",
                    v.version, v.cost_micros, r.version, r.cost_micros
                )),
            Some(_) => {}
        }
    }
    for id in view.runs.keys() {
        if !stored.contains_key(id) {
            view_mismatch.push(format!("{id}: shown, not in the store"));
        }
    }
    Audit {
        lost,
        double_applied: double,
        view_mismatch,
        spent,
        settled: settled_total,
    }
}

/// What a PostgreSQL failover run found.
#[cfg(feature = "postgres")]
struct Outcome {
    loaded: Loaded,
    audit: Audit,
    /// Connections LISTENing on the promoted server at the end.
    listening: i64,
}

/// The load through `a,b` (a the primary), `kills` times: kill -9 the
/// primary mid-load, promote its standby, and (for a next kill) make a new
/// standby of the promoted server on the dead one's port.
#[cfg(feature = "postgres")]
fn load_across_failovers(sync: bool, kills: u32) -> Outcome {
    assert!(
        kills <= 1 || sync,
        "only the synchronous test kills more than once"
    );
    let name = "s1";
    let primary = PgServer::start_primary(sync.then_some(name));
    let standby = PgServer::standby_of(&primary, name);
    primary.await_standby(name, if sync { "sync" } else { "async" });
    let url = fleet_url(&primary, &standby);
    let pg = PostgresStore::connect_with(&url, opts()).expect("connect");
    pg.setup().expect("setup");
    prepare(&pg);
    drop(pg);

    let fleet = PostgresStore::connect_with(&url, opts()).expect("connect the fleet");
    let servers = Mutex::new((primary, standby, Vec::new()));
    let loaded = load(
        &fleet,
        kills,
        |_| servers.lock().expect("lock").0.kill9(),
        |_| servers.lock().expect("lock").1.promote(),
        |k| {
            let mut g = servers.lock().expect("lock");
            let (primary, standby, left) = &mut *g;
            if k + 1 < kills {
                // The promoted server is the primary now; a new standby of
                // it takes the dead primary's port, so the URL names both
                // again, roles swapped.
                let next = PgServer::standby_of_on(standby, name, Some(primary.port));
                standby.require_sync_standby(name);
                standby.await_standby(name, "sync");
                let promoted = std::mem::replace(standby, next);
                left.push(std::mem::replace(primary, promoted));
            }
        },
    );
    let (_, standby, _left) = servers.into_inner().expect("lock");

    // Checked on the server that is the primary now.
    let now = PostgresStore::connect_with(
        &format!("postgres://agentstate@127.0.0.1:{}/postgres", standby.port),
        opts(),
    )
    .expect("connect to the promoted server");
    // The fleet's listener dialed the promoted server and LISTENs there
    // (its connection's last statement).
    let mut raw = postgres::Client::connect(&standby.dsn("postgres"), postgres::NoTls)
        .expect("connect to the promoted server");
    let listening: i64 = raw
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN %'",
            &[],
        )
        .expect("pg_stat_activity")
        .get(0);
    drop(fleet);
    let audit = audit(&now, &loaded.acked, &loaded.view);
    Outcome {
        loaded,
        audit,
        listening,
    }
}

/// One line of figures for BENCHMARKS.md.
fn report(what: &str, kills: u32, l: &Loaded, a: &Audit) {
    eprintln!(
        "failover ({what}): {} acknowledged writes across {kills} failover(s), {} lost, {} \
         double-applied; {} outcome-unknown and {} unavailable answers retried; {} reserves \
         refused by the cap; kill to the new primary taking writes {:?} ms, to the first Ok \
         on it {:?} ms; the consumer started over {} times, differs from the store on {} \
         runs; lost: {:?}",
        l.acked.writes,
        a.lost.len(),
        a.double_applied.len(),
        l.seen.unknown.load(Ordering::Relaxed),
        l.seen.unavailable.load(Ordering::Relaxed),
        l.acked.refused,
        l.promote_ms,
        l.first_write_ms,
        l.view.errors.len(),
        a.view_mismatch.len(),
        a.lost
    );
}

/// What a failover that keeps every `Ok` must show.
fn assert_nothing_lost(l: &Loaded, a: &Audit) {
    assert!(a.lost.is_empty(), "acknowledged writes lost: {:?}", a.lost);
    assert!(
        a.double_applied.is_empty(),
        "applied twice: {:?}",
        a.double_applied
    );
    assert_eq!(
        a.spent, a.settled,
        "the budget's spend is the sum of the settles acknowledged"
    );
    assert!(
        l.acked.refused > 0,
        "the cap never refused a reserve: it tested nothing"
    );
    assert!(
        l.seen.unknown.load(Ordering::Relaxed) + l.seen.unavailable.load(Ordering::Relaxed) > 0,
        "no call met the failover: the kill came after the load"
    );
}

#[cfg(feature = "postgres")]
#[test]
fn i7_postgres_failover_to_a_sync_standby_keeps_every_ok_and_applies_each_keyed_retry_once() {
    let kills = failovers();
    let o = load_across_failovers(true, kills);
    report("postgres, synchronous standby", kills, &o.loaded, &o.audit);
    assert_nothing_lost(&o.loaded, &o.audit);
    assert!(
        o.audit.view_mismatch.is_empty(),
        "the consumer's view differs: {:?}",
        o.audit.view_mismatch
    );
    assert!(
        o.loaded.view.repeats.is_empty(),
        "changes shown twice: {:?}",
        o.loaded.view.repeats
    );
    assert!(
        o.loaded.view.errors.is_empty(),
        "the consumer failed: {:?}",
        o.loaded.view.errors
    );
    assert_eq!(
        o.listening, 1,
        "the feed's listener LISTENs on the promoted server"
    );
}

#[cfg(feature = "postgres")]
#[test]
fn i7_postgres_failover_to_an_async_standby_measures_what_an_ok_loses() {
    let o = load_across_failovers(false, 1);
    report("postgres, asynchronous standby", 1, &o.loaded, &o.audit);
    // Whatever was lost, nothing was applied twice by the keyed retries
    // that reached the new primary, and the cap held (`audit`).
    assert!(
        o.audit.double_applied.is_empty(),
        "applied twice: {:?}",
        o.audit.double_applied
    );
}

#[cfg(feature = "postgres")]
#[test]
fn e3_postgres_require_sync_standby_refuses_a_server_without_one() {
    let primary = PgServer::start_primary(Some("s1"));
    let standby = PgServer::standby_of(&primary, "s1");
    primary.await_standby("s1", "sync");
    let require = || opts().require_sync_standby(true);

    // A primary with a synchronous standby: accepted, and stats say so.
    let pg = PostgresStore::connect_with(&primary.dsn("postgres"), require()).expect("connect");
    pg.setup().expect("setup");
    let s: &dyn Store = &pg;
    s.put_run(RunRecord::new(RunKey::new("t", "r"), "a"))
        .expect("a write");
    let backend = s.stats().expect("stats").backend;
    assert!(
        backend.contains("synchronous_standby_names = 's1'"),
        "{backend}"
    );
    drop(pg);

    // The same option in the URL, to the standby promoted with no
    // standby of its own: refused at connect, naming both settings.
    primary.kill9();
    standby.promote();
    let url = format!("{}?require_sync_standby=true", standby.dsn("postgres"));
    let e = PostgresStore::connect_with(&url, opts()).expect_err("no synchronous standby");
    assert!(
        matches!(
            &e,
            StateError::Persistence {
                reason: agentstate::PersistenceReason::Refused,
                ..
            }
        ) && !e.is_retryable(),
        "{e:?}"
    );
    let text = e.to_string();
    for setting in [
        "synchronous_standby_names",
        "synchronous_commit",
        "require_sync_standby",
    ] {
        assert!(text.contains(setting), "names {setting}: {text}");
    }
    // Without the option the store runs there, and says what an Ok is.
    let pg = PostgresStore::connect_with(&standby.dsn("postgres"), opts()).expect("connect");
    let s: &dyn Store = &pg;
    s.put_run(RunRecord::new(RunKey::new("t", "r2"), "a"))
        .expect("a write");
    let backend = s.stats().expect("stats").backend;
    assert!(backend.contains("on this server only"), "{backend}");
    assert!(
        PostgresStore::connect_with(
            &format!("{}?require_sync_standby=maybe", standby.dsn("postgres")),
            opts()
        )
        .is_err_and(|e| matches!(e, StateError::Invalid { .. })),
        "a bad value is Invalid"
    );

    // A store that requires it, opened before a standby is back: refused,
    // then, once one is back and synchronous, the next call dials again
    // and writes (the refused connection was not kept).
    let waiting = PostgresStore::connect_with(&url, opts().lazy(true)).expect("a lazy store");
    let w: &dyn Store = &waiting;
    let e = w
        .put_run(RunRecord::new(RunKey::new("t", "r3"), "a"))
        .expect_err("still no synchronous standby");
    assert!(e.to_string().contains("synchronous_standby_names"), "{e}");
    let again = PgServer::standby_of(&standby, "s2");
    standby.require_sync_standby("s2");
    standby.await_standby("s2", "sync");
    w.put_run(RunRecord::new(RunKey::new("t", "r3"), "a"))
        .expect("a synchronous standby is back");
    drop(again);
}

/// The same load on a cluster run the way operators run one: Patroni
/// over etcd, `synchronous_mode` on. The leader node is killed with
/// SIGKILL (Patroni, postmaster and backends); Patroni promotes the
/// synchronous standby once the leader's key expires, and the writers,
/// through both hosts in one URL, carry on: nothing acknowledged lost.
#[cfg(feature = "postgres")]
#[test]
fn i7_postgres_failover_under_patroni_keeps_every_ok() {
    let cluster = crate::pg_server::Patroni::start();
    let url = format!(
        "postgres://agentstate@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
        cluster.ports[0], cluster.ports[1]
    );
    let pg = PostgresStore::connect_with(&url, opts()).expect("connect");
    pg.setup().expect("setup");
    prepare(&pg);
    let backend = agentstate::StoreAdmin::stats(&pg).expect("stats").backend;
    assert!(
        backend.contains("replicated before it is acknowledged"),
        "Patroni's synchronous_mode is seen: {backend}"
    );
    drop(pg);
    let fleet = PostgresStore::connect_with(&url, opts()).expect("connect the fleet");
    let loaded = load(
        &fleet,
        1,
        |_| cluster.kill9_node(0),
        |_| cluster.await_role(1, false, Duration::from_secs(60)),
        |_| {},
    );
    let now = PostgresStore::connect_with(&cluster.dsn(1, "postgres"), opts())
        .expect("connect to the promoted node");
    let audit = audit(&now, &loaded.acked, &loaded.view);
    drop(fleet);
    report(
        "postgres under patroni, synchronous_mode",
        1,
        &loaded,
        &audit,
    );
    assert_nothing_lost(&loaded, &audit);
    assert!(
        audit.view_mismatch.is_empty(),
        "the consumer's view differs: {:?}",
        audit.view_mismatch
    );
}

/// E3 across a switchover: a server that turns read-only under a pooled
/// connection (here `default_transaction_read_only`, as a demoted primary
/// or a standby answers) refuses the write with nothing written; the store
/// drops that connection and redials, and with both hosts in the URL
/// (`target_session_attrs=read-write`) the same call lands on the one that
/// takes writes. With one host the call is `Unavailable`, naming the fix.
#[cfg(feature = "postgres")]
#[test]
fn e3_postgres_a_server_turned_read_only_is_left_for_the_one_that_takes_writes() {
    let (a, b) = (PgServer::start(false), PgServer::start(false));
    for s in [&a, &b] {
        let pg = PostgresStore::connect_with(&s.dsn("postgres"), opts()).expect("connect");
        pg.setup().expect("setup");
    }
    let pg = PostgresStore::connect_with(&fleet_url(&a, &b), opts()).expect("connect");
    let store: &dyn Store = &pg;
    let single = PostgresStore::connect_with(&a.dsn("postgres"), opts()).expect("connect");
    let single: &dyn Store = &single;
    store
        .put_run(RunRecord::new(RunKey::new("t", "on-a"), "x"))
        .expect("a write on a");
    single
        .put_run(RunRecord::new(RunKey::new("t", "single"), "x"))
        .expect("a write on a");

    let mut raw = postgres::Client::connect(&a.dsn("postgres"), postgres::NoTls).expect("raw");
    raw.batch_execute("ALTER SYSTEM SET default_transaction_read_only = on")
        .expect("ALTER SYSTEM");
    raw.batch_execute("SELECT pg_reload_conf()")
        .expect("reload");
    std::thread::sleep(Duration::from_millis(300));

    let moved = store
        .put_run(RunRecord::new(RunKey::new("t", "on-b"), "x"))
        .expect("the write finds the server that takes writes");
    assert_eq!(moved.version, 1);
    let on_b = PostgresStore::connect_with(&b.dsn("postgres"), opts()).expect("connect");
    let on_b: &dyn Store = &on_b;
    assert!(
        on_b.get_run(&RunKey::new("t", "on-b"))
            .expect("read")
            .is_some()
    );

    let e = single
        .patch_run(&RunKey::new("t", "single"), cost(1))
        .expect_err("a read-only server, and no other");
    assert!(e.is_retryable() && !e.is_outcome_unknown(), "{e:?}");
    assert!(
        e.to_string().contains("target_session_attrs=read-write"),
        "{e}"
    );
    assert_eq!(
        single
            .get_run(&RunKey::new("t", "single"))
            .expect("reads go on")
            .expect("there")
            .cost_micros,
        0,
        "nothing written"
    );
}

/// A `redis-server --sentinel` watching one master (quorum 1, the master
/// deemed down after 2 s: less fails over spuriously when CI's load
/// stalls an `fsync`), in its own dir, under a watchdog that kills
/// it when this process is gone; killed when dropped.
#[cfg(feature = "redis")]
struct SentinelProc {
    port: u16,
    dir: std::path::PathBuf,
    child: Option<std::process::Child>,
}

#[cfg(feature = "redis")]
impl SentinelProc {
    fn start(dir: &std::path::Path, master: &str, master_port: u16) -> SentinelProc {
        use std::process::{Command, Stdio};
        std::fs::create_dir_all(dir).expect("the sentinel's dir");
        let port = crate::redis_server::free_port();
        let conf = dir.join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {dir}\n\
                 sentinel monitor {master} 127.0.0.1 {master_port} 1\n\
                 sentinel down-after-milliseconds {master} 2000\n\
                 sentinel failover-timeout {master} 2000\n\
                 sentinel parallel-syncs {master} 1\n",
                dir = dir.display()
            ),
        )
        .expect("write sentinel.conf");
        let script = format!(
            "redis-server '{}' --sentinel >'{}' 2>&1 & r=$!; echo $r > '{}'; \
             while kill -0 {} 2>/dev/null && kill -0 $r 2>/dev/null; do sleep 0.5; done; \
             kill -9 $r 2>/dev/null; wait $r",
            conf.display(),
            dir.join("sentinel.log").display(),
            dir.join("sentinel.pid").display(),
            std::process::id()
        );
        let child = Command::new("sh")
            .arg("-c")
            .arg(script)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server --sentinel");
        let s = SentinelProc {
            port,
            dir: dir.to_path_buf(),
            child: Some(child),
        };
        let until = Instant::now() + Duration::from_secs(30);
        while s.master_port(master).is_none() {
            assert!(Instant::now() < until, "the sentinel did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        s
    }

    fn cli(&self, args: &[&str]) -> String {
        let out = std::process::Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The master's port as the sentinel says it now.
    fn master_port(&self, master: &str) -> Option<u16> {
        let out = self.cli(&["SENTINEL", "get-master-addr-by-name", master]);
        out.lines().nth(1)?.trim().parse().ok()
    }

    /// Waits until the sentinel knows `n` replicas of `master`.
    fn await_replicas(&self, master: &str, n: usize) {
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let out = self.cli(&["SENTINEL", "master", master]);
            let mut lines = out.lines();
            let mut seen = None;
            while let Some(l) = lines.next() {
                if l.trim() == "num-slaves" {
                    seen = lines.next().and_then(|v| v.trim().parse::<usize>().ok());
                }
            }
            if seen.is_some_and(|s| s >= n) {
                return;
            }
            assert!(
                Instant::now() < until,
                "the sentinel knows {seen:?} replicas of {master}, not {n}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until the sentinel names `port` as the master.
    fn await_master(&self, master: &str, port: u16) {
        let until = Instant::now() + Duration::from_secs(30);
        while self.master_port(master) != Some(port) {
            assert!(
                Instant::now() < until,
                "the sentinel did not fail over to port {port}; its log: {}",
                std::fs::read_to_string(self.dir.join("sentinel.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[cfg(feature = "redis")]
impl Drop for SentinelProc {
    fn drop(&mut self) {
        if let Ok(pid) = std::fs::read_to_string(self.dir.join("sentinel.pid")) {
            let _ = std::process::Command::new("kill")
                .args(["-9", pid.trim()])
                .status();
        }
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
    }
}

/// The load through a `redis+sentinel://` URL: a master, a replica and a
/// sentinel; the master killed with SIGKILL mid-load, the sentinel
/// promoting the replica, the old master back as a replica of the new one.
/// With `wait`, every write waits for one replica (`wait_replicas`).
#[cfg(feature = "redis")]
fn load_across_a_sentinel_failover(wait: bool) -> (Loaded, Audit) {
    use crate::redis_server::{Server, temp_dir};
    use agentstate::{RedisOptions, RedisStore};
    let dir = temp_dir(if wait { "sentinel-wait" } else { "sentinel" });
    let master = Server::start(&dir.join("m"), &["--repl-diskless-sync-delay", "0"]);
    let replica = Server::start_replica(&dir.join("r"), master.port);
    let sentinel = SentinelProc::start(&dir.join("s"), "m", master.port);
    sentinel.await_replicas("m", 1);
    let url = format!("redis+sentinel://127.0.0.1:{}/m/0", sentinel.port);
    let opts = RedisOptions::new()
        .pool_size(8)
        .connect_timeout(Duration::from_secs(2))
        .io_timeout(Duration::from_secs(2));
    let opts = if wait {
        opts.wait_replicas(1, Duration::from_secs(1))
    } else {
        opts
    };
    let store = RedisStore::connect_with(&url, opts).expect("connect through the sentinel");
    prepare(&store);
    let master = Mutex::new(master);
    let loaded = load(
        &store,
        1,
        |_| master.lock().expect("lock").kill9(),
        |_| {
            sentinel.await_master("m", replica.port);
            // Without wait_replicas the writers go on now; with it they
            // wait for a replica: the old master, back as one.
            if wait {
                master
                    .lock()
                    .expect("lock")
                    .restart_as_replica_of(replica.port);
            }
        },
        |_| {},
    );
    let now = RedisStore::connect(&replica.url(0)).expect("connect to the promoted replica");
    let audit = audit(&now, &loaded.acked, &loaded.view);
    drop(store);
    (loaded, audit)
}

#[cfg(feature = "redis")]
#[test]
fn i7_redis_sentinel_failover_with_wait_replicas_keeps_every_ok() {
    let (l, a) = load_across_a_sentinel_failover(true);
    report("redis sentinel, wait_replicas(1)", 1, &l, &a);
    assert_nothing_lost(&l, &a);
}

#[cfg(feature = "redis")]
#[test]
fn i7_redis_sentinel_failover_without_wait_measures_what_an_ok_loses() {
    let (l, a) = load_across_a_sentinel_failover(false);
    report("redis sentinel, no wait", 1, &l, &a);
    assert!(
        a.double_applied.is_empty(),
        "applied twice: {:?}",
        a.double_applied
    );
}

/// E3 for Sentinel: what cannot work is refused at connect, naming why;
/// what may work later is `Unavailable`.
#[cfg(feature = "redis")]
#[test]
fn e3_redis_sentinel_refuses_an_unknown_master_and_too_few_replicas() {
    use crate::redis_server::{Server, temp_dir};
    use agentstate::{PersistenceReason, RedisOptions, RedisStore};
    let dir = temp_dir("sentinel-refusals");
    let master = Server::start(&dir.join("m"), &[]);
    let _replica = Server::start_replica(&dir.join("r"), master.port);
    let sentinel = SentinelProc::start(&dir.join("s"), "m", master.port);
    sentinel.await_replicas("m", 1);
    let refused = |e: StateError, says: &str| {
        assert!(
            matches!(
                &e,
                StateError::Persistence {
                    reason: PersistenceReason::Refused,
                    ..
                }
            ) && !e.is_retryable(),
            "{e:?}"
        );
        assert!(e.to_string().contains(says), "says {says}: {e}");
    };
    let opts = || RedisOptions::new().connect_timeout(Duration::from_secs(2));
    let url = |name: &str| format!("redis+sentinel://127.0.0.1:{}/{name}/0", sentinel.port);

    let ok = RedisStore::connect_with(&url("m"), opts().wait_replicas(1, Duration::from_secs(1)))
        .expect("a master with one replica");
    let ok: &dyn Store = &ok;
    ok.put_run(RunRecord::new(RunKey::new("t", "r"), "a"))
        .expect("a write one replica confirmed");

    refused(
        RedisStore::connect_with(&url("nosuch"), opts()).expect_err("no such master"),
        "master name",
    );
    refused(
        RedisStore::connect_with(&url("m"), opts().wait_replicas(2, Duration::from_secs(1)))
            .expect_err("one replica, two asked for"),
        "connected_slaves:1",
    );
    // No sentinel reached: it may come up; retryable.
    let free = crate::redis_server::free_port();
    let e = RedisStore::connect_with(
        &format!("redis+sentinel://127.0.0.1:{free}/m/0"),
        opts().connect_timeout(Duration::from_millis(300)),
    )
    .expect_err("no sentinel");
    assert!(e.is_retryable(), "{e:?}");
    let e = RedisStore::connect(&format!("redis+sentinel://127.0.0.1:{}", sentinel.port))
        .expect_err("no master name");
    assert!(matches!(e, StateError::Invalid { .. }), "{e:?}");
}
