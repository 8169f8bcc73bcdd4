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
    BudgetKey, BudgetRecord, Caps, Changed, FeedScope, Hold, IdempotencyKey, InstanceKey,
    PgOptions, Position, PostgresStore, Result, RunKey, RunRecord, StateDelta, StateError,
    StateQuery, Store, Tray,
};

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

fn failovers() -> u32 {
    std::env::var("AGENTSTATE_FAILOVERS")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(1)
}

/// Both servers, primary first: libpq's multi-host form; the driver
/// takes the one that accepts writes.
fn fleet_url(a: &PgServer, b: &PgServer) -> String {
    format!(
        "postgres://agentstate@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
        a.port, b.port
    )
}

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
}

/// The moment the primary died, when it has.
static KILLED_AT: Mutex<Option<Instant>> = Mutex::new(None);

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
                if other.is_ok()
                    && let Some(at) = *KILLED_AT.lock().expect("lock")
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
    /// Holds acknowledged and then not found by their settle.
    lost_holds: Vec<String>,
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
        answered(seen, "patch", false, || {
            store.patch_run_idempotent(&patched, cost(amount), &key(format!("p-{t}-{i}")))
        })
        .expect("a keyed patch");
        {
            let mut a = acked.lock().expect("lock");
            *a.patched.entry(t).or_default() += amount;
            a.writes += 1;
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
                        a.lost_holds.push(hold.clone());
                        a.writes += 1;
                    }
                    Err(e) => panic!("settle: {e:?}"),
                }
            }
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

/// What a failover run found.
struct Outcome {
    acked_writes: u64,
    lost: Vec<String>,
    double_applied: Vec<String>,
    unknown: u64,
    unavailable: u64,
    /// Per failover: from the kill to the promoted server accepting
    /// writes (`pg_ctl promote -w`), and to a writer's first `Ok` on it.
    promote_ms: Vec<u128>,
    first_write_ms: Vec<u64>,
    refused_reserves: u64,
    view_mismatch: Vec<String>,
    repeats: Vec<String>,
    consumer_errors: Vec<String>,
    /// Connections LISTENing on the promoted server at the end.
    listening: i64,
}

/// The load through `a,b` (a the primary), `kills` times: kill -9 the
/// primary mid-load, promote its standby, and (for a next kill) make a new
/// standby of the promoted server.
fn load_across_failovers(sync: bool, kills: u32) -> Outcome {
    let name = "s1";
    let mut primary = PgServer::start_primary(sync.then_some(name));
    let mut standby = PgServer::standby_of(&primary, name);
    primary.await_standby(name, if sync { "sync" } else { "async" });
    let url = fleet_url(&primary, &standby);
    let pg = PostgresStore::connect_with(&url, opts()).expect("connect");
    pg.setup().expect("setup");
    let setup: &dyn Store = &pg;
    setup
        .put_budget(BudgetRecord::new(
            BudgetKey::new(TENANT, "shared"),
            Caps::new().cost_micros(cap()),
        ))
        .expect("the budget");
    for t in 0..WRITERS {
        setup
            .put_run(
                RunRecord::new(RunKey::new(TENANT, format!("spend-{t}")), "spender")
                    .with_budget("shared"),
            )
            .expect("a spend run");
        setup
            .put_run(RunRecord::new(
                RunKey::new(TENANT, format!("patch-{t}")),
                "patcher",
            ))
            .expect("a patched run");
    }
    drop(pg);

    let seen = Seen::default();
    let acked = Mutex::new(Acked::default());
    let stop = AtomicBool::new(false);
    let (mut promote_ms, mut first_write_ms) = (Vec::new(), Vec::new());
    let mut servers_left = Vec::new();
    let fleet = PostgresStore::connect_with(&url, opts()).expect("connect the fleet");
    let store: &dyn Store = &fleet;
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
            primary.kill9();
            let t0 = Instant::now();
            *KILLED_AT.lock().expect("lock") = Some(t0);
            standby.promote();
            promote_ms.push(t0.elapsed().as_millis());
            while seen.first_ok_after_kill.load(Ordering::Acquire) == 0
                && writers.iter().any(|w| !w.is_finished())
            {
                std::thread::sleep(Duration::from_millis(2));
            }
            first_write_ms.push(seen.first_ok_after_kill.load(Ordering::Acquire));
            *KILLED_AT.lock().expect("lock") = None;
            if k + 1 < kills {
                // The promoted server is the primary now; a new standby of
                // it takes the dead primary's port, so the URL names both
                // again, roles swapped.
                let next = PgServer::standby_of_on(&standby, name, Some(primary.port));
                standby.require_sync_standby(name);
                standby.await_standby(name, "sync");
                let promoted = std::mem::replace(&mut standby, next);
                servers_left.push(std::mem::replace(&mut primary, promoted));
            }
        }
        for w in writers {
            w.join().expect("a writer");
        }
        stop.store(true, Ordering::Release);
        consumer.join().expect("the consumer")
    });
    assert!(
        kills <= 1 || sync,
        "only the synchronous test kills more than once"
    );

    // Checked on the server that is the primary now.
    let now = PostgresStore::connect_with(
        &format!("postgres://agentstate@127.0.0.1:{}/postgres", standby.port),
        opts(),
    )
    .expect("connect to the promoted server");
    let now: &dyn Store = &now;
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
    let acked = acked.into_inner().expect("lock");
    let mut lost: Vec<String> = acked
        .lost_holds
        .iter()
        .map(|h| format!("hold {h}"))
        .collect();
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
            let got = now
                .get_run(&RunKey::new(TENANT, run.as_str()))
                .expect("read")
                .expect("the run")
                .cost_micros;
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
        .expect("read the budget")
        .expect("the budget");
    assert!(
        budget.spent.cost_micros + budget.held.cost_micros <= cap(),
        "the cap was exceeded: spent {} + held {} > {}",
        budget.spent.cost_micros,
        budget.held.cost_micros,
        cap()
    );
    if sync {
        assert_eq!(
            budget.spent.cost_micros, settled_total,
            "the budget's spend is the sum of the settles acknowledged"
        );
    }
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
    let acked_writes = acked.writes;
    drop(servers_left);
    Outcome {
        acked_writes,
        lost,
        double_applied: double,
        unknown: seen.unknown.load(Ordering::Relaxed),
        unavailable: seen.unavailable.load(Ordering::Relaxed),
        promote_ms,
        first_write_ms,
        refused_reserves: acked.refused,
        view_mismatch,
        repeats: view.repeats,
        consumer_errors: view.errors,
        listening,
    }
}

#[test]
fn i7_postgres_failover_to_a_sync_standby_keeps_every_ok_and_applies_each_keyed_retry_once() {
    let kills = failovers();
    let o = load_across_failovers(true, kills);
    eprintln!(
        "failover (postgres, synchronous standby): {} acknowledged writes across {kills} \
         failover(s), {} lost, {} double-applied; {} outcome-unknown and {} unavailable \
         answers retried; {} reserves refused by the cap; kill to promoted {:?} ms, kill to \
         the first Ok on the new primary {:?} ms",
        o.acked_writes,
        o.lost.len(),
        o.double_applied.len(),
        o.unknown,
        o.unavailable,
        o.refused_reserves,
        o.promote_ms,
        o.first_write_ms
    );
    assert!(o.lost.is_empty(), "acknowledged writes lost: {:?}", o.lost);
    assert!(
        o.double_applied.is_empty(),
        "applied twice: {:?}",
        o.double_applied
    );
    assert!(
        o.view_mismatch.is_empty(),
        "the consumer's view differs: {:?}",
        o.view_mismatch
    );
    assert!(o.repeats.is_empty(), "changes shown twice: {:?}", o.repeats);
    assert!(
        o.consumer_errors.is_empty(),
        "the consumer failed: {:?}",
        o.consumer_errors
    );
    assert_eq!(
        o.listening, 1,
        "the feed's listener LISTENs on the promoted server"
    );
    assert!(
        o.refused_reserves > 0,
        "the cap never refused a reserve: it tested nothing"
    );
    assert!(
        o.unknown + o.unavailable > 0,
        "no call met the failover: the kill came after the load"
    );
}

#[test]
fn i7_postgres_failover_to_an_async_standby_measures_what_an_ok_loses() {
    let o = load_across_failovers(false, 1);
    eprintln!(
        "failover (postgres, asynchronous standby): {} acknowledged writes, {} lost, {} \
         double-applied; kill to the first Ok on the new primary {:?} ms; the consumer \
         started over {} times and differs from the store on {} runs; lost: {:?}",
        o.acked_writes,
        o.lost.len(),
        o.double_applied.len(),
        o.first_write_ms,
        o.consumer_errors.len(),
        o.view_mismatch.len(),
        o.lost
    );
    // Whatever was lost, nothing was applied twice by the keyed retries
    // that reached the new primary, and the cap held.
    assert!(
        o.double_applied.is_empty(),
        "applied twice: {:?}",
        o.double_applied
    );
}

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
}

/// E3 across a switchover: a server that turns read-only under a pooled
/// connection (here `default_transaction_read_only`, as a demoted primary
/// or a standby answers) refuses the write with nothing written; the store
/// drops that connection and redials, and with both hosts in the URL
/// (`target_session_attrs=read-write`) the same call lands on the one that
/// takes writes. With one host the call is `Unavailable`, naming the fix.
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
