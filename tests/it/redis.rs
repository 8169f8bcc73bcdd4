//! The Redis backend against real servers: durability settings, a SIGKILL
//! of the server during an 8-thread workload, and two OS processes racing.
//! (The conformance suite runs on it in `conformance.rs`.)

use agentstate::{Options, RedisOptions, RedisStore, StateError, StoreAdmin};

use crate::redis_server::{Server, temp_dir};

/// `require_fsync` (the default) refuses a server with `appendfsync
/// everysec`, naming the setting; without it the store connects and says
/// what an `Ok` survives.
#[test]
fn require_fsync_refuses_everysec() {
    let server = Server::start(&temp_dir("everysec"), &["--appendfsync", "everysec"]);
    let e = RedisStore::connect(&server.url(0)).expect_err("everysec must be refused");
    assert!(
        e.is_retryable() || matches!(e, StateError::Persistence { .. }),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("appendfsync always"),
        "names the setting: {msg}"
    );
    assert!(msg.contains("everysec"), "names what it found: {msg}");
    let s = RedisStore::connect_with(&server.url(0), RedisOptions::new().require_fsync(false))
        .expect("require_fsync(false) connects");
    let backend = s.stats().expect("stats").backend;
    assert!(
        backend.contains("everysec"),
        "stats shows the mode: {backend}"
    );
    let fsynced = Server::start(&temp_dir("always"), &[]);
    let s = RedisStore::connect(&fsynced.url(0)).expect("appendfsync always connects");
    assert!(
        s.stats()
            .expect("stats")
            .backend
            .contains("appendfsync always")
    );
    let _ = Options::new();
}

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use agentstate::{
    InstanceKey, PageRequest, RunKey, RunRecord, StateDelta, StateStore, Tray, TrayOp, TrayStore,
};

fn rounds(default: usize) -> usize {
    std::env::var("AGENTSTATE_ROUNDS")
        .ok()
        .and_then(|r| r.parse::<usize>().ok())
        .map_or(default, |m| default * m.max(1))
}

/// What one worker thread saw acknowledged before the server died.
#[derive(Default, Debug)]
struct Acked {
    creates: Vec<String>,
    patches: u64,
    /// A patch whose answer was lost (it may or may not have applied).
    patch_in_flight: bool,
    last_batch: Option<u64>,
    batch_in_flight: Option<u64>,
}

fn worker(store: &RedisStore, t: usize, stop: &AtomicBool) -> Acked {
    let mut a = Acked::default();
    let patched = RunKey::new("crash", format!("t{t}-patched"));
    let inst = InstanceKey::new("crash", format!("t{t}"));
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let id = format!("t{t}-{i}");
        match store.put_run(RunRecord::new(RunKey::new("crash", &id), "agent")) {
            Ok(_) => a.creates.push(id),
            Err(_) => return a,
        }
        match store.patch_run(
            &patched,
            StateDelta {
                cost_micros: 1,
                ..Default::default()
            },
        ) {
            Ok(_) => a.patches += 1,
            Err(_) => {
                a.patch_in_flight = true;
                return a;
            }
        }
        let ops = (0..4)
            .map(|k| TrayOp::Put {
                tray_ns: "b".into(),
                tray_id: format!("{k}"),
                tray: Tray {
                    marked: k % 2 == 0,
                    doc: i.to_string().into_bytes(),
                    env: "e".into(),
                    hostname: "h".into(),
                },
            })
            .collect();
        match store.apply_batch(&inst, 1, ops) {
            Ok(()) => a.last_batch = Some(i),
            Err(_) => {
                a.batch_in_flight = Some(i);
                return a;
            }
        }
        i += 1;
    }
    a
}

/// SIGKILL of the server during an 8-thread workload, then a restart on
/// the same dir: every acknowledged write is there, none is half-applied
/// (a batch is all or nothing; a patched sum is the acknowledged patches
/// plus at most the one in flight).
#[test]
fn sigkill_during_workload_keeps_every_acknowledged_write() {
    for round in 0..rounds(1) {
        let mut server = Server::start(&temp_dir(&format!("crash{round}")), &[]);
        let opts = || {
            RedisOptions::new()
                .pool_size(8)
                .io_timeout(Duration::from_secs(5))
                .connect_timeout(Duration::from_secs(2))
        };
        let store = Arc::new(RedisStore::connect_with(&server.url(0), opts()).expect("connect"));
        for t in 0..8 {
            store
                .put_run(RunRecord::new(
                    RunKey::new("crash", format!("t{t}-patched")),
                    "agent",
                ))
                .expect("create the patched run");
        }
        let stop = Arc::new(AtomicBool::new(false));
        let handles: Vec<_> = (0..8)
            .map(|t| {
                let (store, stop) = (store.clone(), stop.clone());
                std::thread::spawn(move || worker(&store, t, &stop))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(1500));
        server.kill9();
        let acked: Vec<Acked> = handles
            .into_iter()
            .map(|h| h.join().expect("worker"))
            .collect();
        stop.store(true, Ordering::Relaxed);
        let total: usize = acked.iter().map(|a| a.creates.len()).sum();
        assert!(
            total > 8,
            "the workload ran before the kill ({total} creates)"
        );
        drop(store);
        server.restart();
        let store = RedisStore::connect_with(&server.url(0), opts()).expect("reconnect");
        for (t, a) in acked.iter().enumerate() {
            for id in &a.creates {
                assert!(
                    store
                        .get_run(&RunKey::new("crash", id))
                        .expect("get")
                        .is_some(),
                    "acknowledged create {id} lost"
                );
            }
            let cost = store
                .get_run(&RunKey::new("crash", format!("t{t}-patched")))
                .expect("get")
                .expect("patched run")
                .cost_micros;
            let hi = a.patches + u64::from(a.patch_in_flight);
            assert!(
                (a.patches..=hi).contains(&cost),
                "thread {t}: cost {cost}, acknowledged {} patches (+{} in flight)",
                a.patches,
                u64::from(a.patch_in_flight)
            );
            let inst = InstanceKey::new("crash", format!("t{t}"));
            let trays = store
                .list_trays(&inst, 1, &PageRequest::new(10))
                .expect("list trays");
            let docs: Vec<Vec<u8>> = trays.items().iter().map(|(_, t)| t.doc.clone()).collect();
            if let Some(first) = docs.first() {
                assert_eq!(docs.len(), 4, "thread {t}: a batch half-applied: {docs:?}");
                assert!(
                    docs.iter().all(|d| d == first),
                    "thread {t}: a batch half-applied: {docs:?}"
                );
                let n: u64 = String::from_utf8_lossy(first).parse().expect("doc");
                assert!(
                    Some(n) == a.last_batch || Some(n) == a.batch_in_flight,
                    "thread {t}: trays hold batch {n}, acknowledged {:?}, in flight {:?}",
                    a.last_batch,
                    a.batch_in_flight
                );
            } else {
                assert_eq!(a.last_batch, None, "thread {t}: acknowledged batch lost");
            }
        }
        let report = store.verify().expect("verify");
        assert!(
            report.is_ok(),
            "verify after the crash: {:?}",
            report.problems
        );
    }
}

/// Two OS processes (this test binary run again as a child) racing
/// creators, updaters and epochs e/e+1 on one server: exactly one winner
/// per round, and the holder of e never succeeds after e+1 was stored.
#[test]
fn two_processes_race_exactly_one_winner() {
    const ROLE: &str = "AGENTSTATE_REDIS_RACE_ROLE";
    let n = rounds(200);
    if let Ok(role) = std::env::var(ROLE) {
        // The child: race as the process that holds epoch e (odd) rounds.
        let url = std::env::var("AGENTSTATE_REDIS_RACE_URL").expect("url");
        let out = std::env::var("AGENTSTATE_REDIS_RACE_OUT").expect("out");
        let store = RedisStore::connect(&url).expect("child connects");
        let lines = race(&store, &role, n);
        std::fs::write(out, lines.join("\n")).expect("write results");
        return;
    }
    let url = crate::redis_server::shared_url(0);
    let tenant = format!("race-{}", std::process::id());
    let store = RedisStore::connect(&url).expect("connect");
    for k in 0..n {
        store
            .put_run(RunRecord::new(RunKey::new(&tenant, format!("u{k}")), "a"))
            .expect("the updaters' runs");
    }
    let out = temp_dir("race").with_extension("txt");
    std::fs::create_dir_all(out.parent().expect("parent")).expect("dir");
    let mut child = std::process::Command::new(std::env::current_exe().expect("exe"))
        .args([
            "--exact",
            "redis::two_processes_race_exactly_one_winner",
            "--test-threads",
            "1",
        ])
        .env(ROLE, format!("child:{tenant}"))
        .env("AGENTSTATE_REDIS_RACE_URL", &url)
        .env("AGENTSTATE_REDIS_RACE_OUT", &out)
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("spawn the second process");
    let mine = race(&store, &format!("parent:{tenant}"), n);
    assert!(
        child.wait().expect("child").success(),
        "the second process failed"
    );
    let theirs: Vec<String> = std::fs::read_to_string(&out)
        .expect("child's results")
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(theirs.len(), mine.len(), "both raced every round");
    let mut contested = 0;
    for (k, (a, b)) in mine.iter().zip(&theirs).enumerate() {
        let (a, b): (Vec<&str>, Vec<&str>) = (a.split(' ').collect(), b.split(' ').collect());
        assert_eq!(
            (a[0] == "1") as u8 + (b[0] == "1") as u8,
            1,
            "round {k}: creators {a:?} / {b:?}"
        );
        assert_eq!(
            (a[1] == "1") as u8 + (b[1] == "1") as u8,
            1,
            "round {k}: updaters {a:?} / {b:?}"
        );
        if a[2] == "0" || b[2] == "0" {
            contested += 1;
        }
        let inst = InstanceKey::new(&tenant, format!("i{k}"));
        assert_eq!(
            store.epoch(&inst).expect("epoch"),
            2 * k as u64 + 2,
            "round {k}: e+1 stored"
        );
        let t = store
            .read_tray(&inst.tray("t", "x"), 2 * k as u64 + 2)
            .expect("read");
        assert_eq!(
            t.map(|t| t.doc),
            Some(b"e+1".to_vec()),
            "round {k}: the e holder's write landed after e+1's"
        );
    }
    let _ = contested;
}

/// One process's side of the race; a line per round: created, updated,
/// fenced write ok (1/0).
fn race(store: &RedisStore, role: &str, n: usize) -> Vec<String> {
    let (who, tenant) = role.split_once(':').expect("role");
    let high = who == "parent";
    let mut lines = Vec::with_capacity(n);
    for k in 0..n {
        let created = store
            .put_run(RunRecord::new(RunKey::new(tenant, format!("c{k}")), who))
            .is_ok();
        let key = RunKey::new(tenant, format!("u{k}"));
        let mut r = RunRecord::new(key, who);
        r.version = 1;
        let updated = match store.put_run(r) {
            Ok(_) => true,
            Err(StateError::Conflict {
                expected: 1,
                actual: 2,
                ..
            }) => false,
            Err(e) => panic!("{who} round {k}: updater got {e:?}"),
        };
        // The parent holds e+1, the child e.
        let inst = InstanceKey::new(tenant, format!("i{k}"));
        let epoch = 2 * k as u64 + 1 + u64::from(high);
        let doc: &[u8] = if high { b"e+1" } else { b"e" };
        let wrote = match store.write_tray(
            &inst.tray("t", "x"),
            epoch,
            Tray {
                marked: false,
                doc: doc.to_vec(),
                env: "e".into(),
                hostname: "h".into(),
            },
        ) {
            Ok(()) => true,
            Err(StateError::FenceLost { caller, stored, .. }) => {
                assert!(
                    !high && caller == epoch && stored == epoch + 1,
                    "{who}: {caller}/{stored}"
                );
                false
            }
            Err(e) => panic!("{who} round {k}: fenced write got {e:?}"),
        };
        lines.push(format!(
            "{} {} {}",
            created as u8, updated as u8, wrote as u8
        ));
    }
    lines
}

/// The scripts' u64 arithmetic is exact at the edge: amounts near
/// u64::MAX add up exactly, and one past it is `Invalid` with nothing
/// written.
#[test]
fn patch_arithmetic_exact_near_u64_max() {
    let store = RedisStore::connect(&crate::redis_server::shared_url(0)).expect("connect");
    let key = RunKey::new(format!("u64-{}", std::process::id()), "edge");
    let mut r = RunRecord::new(key.clone(), "a");
    r.cost_micros = u64::MAX - 3;
    r.usage.input_tokens = (1 << 53) + 1;
    r.iterations = u32::MAX as u64;
    store.put_run(r).expect("create near the edge");
    let d = StateDelta {
        cost_micros: 3,
        iterations: 1,
        usage: agentstate::Usage {
            input_tokens: 2,
            output_tokens: u64::MAX,
        },
        ..Default::default()
    };
    let got = store.patch_run(&key, d).expect("exact up to u64::MAX");
    assert_eq!(got.cost_micros, u64::MAX);
    assert_eq!(got.usage.input_tokens, (1 << 53) + 3);
    assert_eq!(got.usage.output_tokens, u64::MAX);
    assert_eq!(got.iterations, 1 << 32);
    let one = StateDelta {
        cost_micros: 1,
        ..Default::default()
    };
    match store.patch_run(&key, one) {
        Err(StateError::Invalid { what }) => assert!(what.contains("cost_micros"), "{what}"),
        other => panic!("overflow must be Invalid, got {other:?}"),
    }
    assert_eq!(
        store.get_run(&key).expect("get"),
        Some(got),
        "nothing written"
    );
}

/// Spend caps on Redis against the memory store (whose decisions are
/// `rules::budget`): the same calls at the same clock give the same
/// answers, `BudgetExceeded` fields included, near `u64::MAX` too; holds
/// expire at `expires_at` exactly; cascade delete and prune drop holds;
/// and both export the same entries (budgets and holds included), which
/// import back unchanged, with export pages of 1.
#[test]
fn spend_caps_answer_like_the_memory_store() {
    use agentstate::{
        BudgetKey, BudgetRecord, Caps, Entry, Hold, ManualClock, MemoryStore, SessionKey,
        SessionRecord,
    };
    let url = crate::redis_server::shared_url(8);
    crate::redis_server::flush(&url);
    let clock = Arc::new(ManualClock::new(1_000));
    let redis = RedisStore::connect_with(
        &url,
        RedisOptions::new().options(Options::new().clock(clock.clone())),
    )
    .expect("connect");
    let mem = MemoryStore::with_options(Options::new().clock(clock.clone()));
    let stores: [&dyn agentstate::Store; 2] = [&mem, &redis];
    // Runs every call on both stores and compares what they answered.
    macro_rules! both {
        ($s:ident => $e:expr) => {{
            let got: Vec<String> = stores.iter().map(|$s| format!("{:?}", $e)).collect();
            assert_eq!(got[0], got[1], "memory vs redis: {}", stringify!($e));
            got.into_iter().next().unwrap()
        }};
    }
    let max = u64::MAX;
    let bk = BudgetKey::new("acme", "monthly");
    let big = BudgetKey::new("acme", "huge");
    both!(s => s.put_budget(BudgetRecord::new(bk.clone(), Caps::new().cost_micros(1_000).tokens(500).iterations(3))));
    both!(s => s.put_budget(BudgetRecord::new(big.clone(), Caps::new().cost_micros(max).tokens(max - 1))));
    both!(s => s.put_budget(BudgetRecord::new(bk.clone(), Caps::new())));
    both!(s => s.put_session(SessionRecord::new(SessionKey::new("acme", "s1"))));
    let a = RunKey::new("acme", "a");
    let b = RunKey::new("acme", "b");
    let c = RunKey::new("acme", "c");
    let d = RunKey::new("acme", "d");
    both!(s => s.put_run(RunRecord::new(a.clone(), "p").with_caps(Caps::new().cost_micros(600).iterations(2)).with_budget("monthly")));
    both!(s => s.put_run(RunRecord::new(b.clone(), "p").with_budget("monthly").with_session("s1")));
    both!(s => s.put_run(RunRecord::new(c.clone(), "p").with_budget("huge").with_caps(Caps::new().tokens(max))));
    both!(s => s.put_run(RunRecord::new(d.clone(), "p").with_budget("nope")));
    both!(s => s.put_run(RunRecord { cost_micros: 7, ..RunRecord::new(RunKey::new("acme", "e"), "p").with_budget("monthly") }));
    // B1: fixed at create.
    let stored = redis.get_run(&a).unwrap().unwrap();
    both!(s => s.put_run(RunRecord { caps: Caps::new(), ..stored.clone() }));
    both!(s => s.put_run(RunRecord { budget: None, ..stored.clone() }));
    both!(s => s.put_run(RunRecord { agent_name: "q".into(), ..stored.clone() }));
    // B2: run caps first, then the budget's; cost, tokens, iterations.
    both!(s => s.reserve(&a, Hold::new("h1", 100).cost_micros(500)));
    both!(s => s.reserve(&a, Hold::new("h1", 100).cost_micros(1)));
    both!(s => s.reserve(&a, Hold::new("h2", 100).cost_micros(94)));
    both!(s => s.reserve(&b, Hold::new("h1", 50).cost_micros(300).tokens(400)));
    both!(s => s.reserve(&b, Hold::new("h2", 50).cost_micros(193)));
    both!(s => s.reserve(&b, Hold::new("h2", 50).tokens(101)));
    both!(s => s.reserve(&b, Hold::new("h2", 50).iterations(4)));
    both!(s => s.reserve(&a, Hold::new("h3", 50).iterations(3)));
    both!(s => s.reserve(&c, Hold::new("h1", 50).cost_micros(max).tokens(max - 1)));
    both!(s => s.reserve(&c, Hold::new("h2", 50).cost_micros(1)));
    both!(s => s.reserve(&c, Hold::new("h2", 50).tokens(1)));
    both!(s => s.reserve(&c, Hold::new("h2", 0)));
    both!(s => s.reserve(&d, Hold::new("h2", 10)));
    both!(s => s.get_budget(&bk));
    both!(s => s.get_budget(&big));
    both!(s => s.run_spend(&a));
    both!(s => s.run_spend(&c));
    // B3, B4.
    let spend = StateDelta {
        cost_micros: 520,
        iterations: 1,
        ..Default::default()
    };
    both!(s => s.settle(&a, "h1", spend));
    both!(s => s.settle(&a, "h1", spend));
    both!(s => s.release_hold(&a, "h2"));
    both!(s => s.release_hold(&a, "h2"));
    both!(s => s.patch_run(&b, StateDelta { cost_micros: 5, ..Default::default() }));
    // (Cursors differ: each store has its own secret.)
    both!(s => s.list_budgets("acme", &PageRequest::new(1)).map(|p| p.into_parts().0));
    both!(s => s.iter_budgets("acme").page_size(1).collect::<agentstate::Result<Vec<_>>>());
    // B5: b's holds (ttl 50 from 1000) count until 1050.
    clock.set(1_049);
    both!(s => s.get_budget(&bk));
    both!(s => s.reserve(&a, Hold::new("h4", 1000).cost_micros(80)));
    // stats: budgets, live holds, runs at their cap.
    both!(s => s.stats().map(|s| s.tenants));
    let export = |s: &dyn agentstate::Store| -> Vec<Entry> {
        s.iter_export()
            .collect::<agentstate::Result<Vec<_>>>()
            .unwrap()
    };
    let mut paged: Vec<Entry> = Vec::new();
    let mut page = PageRequest::new(1);
    loop {
        let (items, cursor) = redis.export_page(&page).unwrap().into_parts();
        paged.extend(items);
        match cursor {
            Some(c) => page = PageRequest::new(1).with_cursor(Some(c)),
            None => break,
        }
    }
    assert_eq!(
        paged,
        export(&redis),
        "export pages of 1 see every entry once"
    );
    clock.set(1_050);
    both!(s => s.get_budget(&bk));
    both!(s => s.run_spend(&b));
    both!(s => s.reserve(&a, Hold::new("h5", 1000).cost_micros(1)));
    both!(s => s.get_budget(&bk));
    both!(s => s.stats().map(|s| s.tenants));
    // Cascade delete and prune drop the run's holds; spend stays.
    both!(s => s.reserve(&b, Hold::new("h9", 1000).cost_micros(1)));
    both!(s => s.delete_session(&SessionKey::new("acme", "s1"), true));
    both!(s => s.get_budget(&bk));
    both!(s => s.run_spend(&b));
    let mut run_a = redis.get_run(&a).unwrap().unwrap();
    run_a.state = agentstate::RunState::Completed;
    both!(s => s.put_run(run_a.clone()));
    clock.set(5_000);
    both!(s => s.prune("acme", 4_000));
    both!(s => s.get_budget(&bk));
    // Export: the same entries, in the same order; import round-trips.
    let (em, er) = (export(&mem), export(&redis));
    assert!(em.iter().any(|e| matches!(e, Entry::Budget { .. })));
    assert!(em.iter().any(|e| matches!(e, Entry::Hold { .. })));
    assert_eq!(em, er, "memory and redis export the same entries");
    crate::redis_server::flush(&url);
    // A new client imports: the old one remembers the tenants it
    // registered (the later calls read what it imported).
    let fresh = RedisStore::connect_with(
        &url,
        RedisOptions::new().options(Options::new().clock(clock.clone())),
    )
    .expect("connect");
    fresh.import(&mut em.clone().into_iter().map(Ok)).unwrap();
    assert_eq!(
        export(&fresh),
        em,
        "export -> import -> export is identical"
    );
    both!(s => s.get_budget(&big));
    both!(s => s.run_spend(&c));
    both!(s => s.reserve(&c, Hold::new("h1", 10)));
}

/// Blocks the server for `millis` with a busy script on its own
/// connection (`redis-cli`), from a thread; returns once the script runs.
fn block_server(url: &str, millis: u64) -> std::thread::JoinHandle<()> {
    let script = format!(
        "local t = redis.call('TIME') local s = t[1] * 1000000 + t[2] \
         while true do local n = redis.call('TIME') \
         if n[1] * 1000000 + n[2] - s > {} then break end end return 1",
        millis * 1000
    );
    let url = url.to_string();
    let h = std::thread::spawn(move || {
        let ok = std::process::Command::new("redis-cli")
            .args(["-u", &url, "EVAL", &script, "0"])
            .stdout(std::process::Stdio::null())
            .status()
            .expect("redis-cli")
            .success();
        assert!(ok, "the blocking script failed");
    });
    std::thread::sleep(Duration::from_millis(millis / 4));
    h
}

/// I7 on Redis: a write whose reply is lost after it was sent (here: the
/// server is busy past the io timeout, then runs it) is `OutcomeUnknown`,
/// retryable only when keyed; the keyed retry answers the first outcome
/// and applies nothing again. The keys are no records: verify, stats and
/// export do not see them.
#[test]
fn a_lost_reply_is_outcome_unknown_and_a_keyed_retry_applies_once() {
    use agentstate::IdempotencyKey;
    let server = Server::start(&temp_dir("lost"), &[]);
    let url = server.url(0);
    let store = RedisStore::connect_with(
        &url,
        RedisOptions::new().io_timeout(Duration::from_millis(200)),
    )
    .expect("connect");
    let rk = RunKey::new("lost", "r");
    store
        .put_run(RunRecord::new(rk.clone(), "agent"))
        .expect("create");
    let one = StateDelta {
        cost_micros: 1,
        ..Default::default()
    };
    // Load both scripts first: a lost NOSCRIPT would apply nothing.
    store.patch_run(&rk, one).expect("patch");
    store
        .patch_run_idempotent(&rk, one, &IdempotencyKey::new("warm").expect("key"))
        .expect("keyed patch");
    let blocker = block_server(&url, 1_200);
    let e = store.patch_run(&rk, one).expect_err("the reply is lost");
    assert!(
        e.is_outcome_unknown() && !e.is_retryable(),
        "an unkeyed lost reply: {e:?}"
    );
    blocker.join().expect("blocker");
    let cost = |s: &RedisStore| s.get_run(&rk).expect("get").expect("run").cost_micros;
    assert_eq!(cost(&store), 3, "the server ran the patch after all");

    // The lost reply's connection was dropped: a write on the new one
    // reads the server's settings first (issue 54), so one is made before
    // the server is blocked again.
    store
        .patch_run(&rk, StateDelta::default())
        .expect("a write on the redialed connection");
    let key = IdempotencyKey::new("lost-1").expect("key");
    let blocker = block_server(&url, 1_200);
    let e = store
        .patch_run_idempotent(&rk, one, &key)
        .expect_err("the reply is lost");
    assert!(
        e.is_outcome_unknown() && e.is_retryable(),
        "a keyed lost reply: {e:?}"
    );
    blocker.join().expect("blocker");
    let again = store
        .patch_run_idempotent(&rk, one, &key)
        .expect("the keyed retry");
    assert_eq!(again.cost_micros, 4, "the retry answers the first outcome");
    assert_eq!(cost(&store), 4, "and applied nothing again");

    let report = store.verify().expect("verify");
    assert!(report.is_ok(), "verify: {:?}", report.problems);
    let page = store.export_page(&PageRequest::new(100)).expect("export");
    assert_eq!(page.items().len(), 1, "export: the run only");
    let stats = store.stats().expect("stats");
    assert_eq!(stats.tenants.len(), 1);
}

/// I5 on Redis with a count bound: a scope keeps at most `keys_max` keys;
/// the oldest are forgotten first.
#[test]
fn keys_beyond_keys_max_are_forgotten_oldest_first() {
    use agentstate::{IdempotencyKey, IdempotencyWindow};
    let url = crate::redis_server::shared_url(11);
    crate::redis_server::flush(&url);
    let store = RedisStore::connect_with(
        &url,
        RedisOptions::new().options(Options::new().idempotency_window(IdempotencyWindow {
            keys_max: 2,
            ttl_millis: 60_000,
        })),
    )
    .expect("connect");
    let rk = RunKey::new("kmax", "r");
    store
        .put_run(RunRecord::new(rk.clone(), "agent"))
        .expect("create");
    let one = StateDelta {
        cost_micros: 1,
        ..Default::default()
    };
    let key = |k: &str| IdempotencyKey::new(k).expect("key");
    for k in ["k1", "k2", "k3"] {
        store
            .patch_run_idempotent(&rk, one, &key(k))
            .expect("patch");
    }
    let cost = || store.get_run(&rk).expect("get").expect("run").cost_micros;
    assert_eq!(cost(), 3);
    // k1 was forgotten when k3 came; k2 when k1 came again.
    store
        .patch_run_idempotent(&rk, one, &key("k1"))
        .expect("k1");
    assert_eq!(cost(), 4, "k1, beyond keys_max, applies again");
    store
        .patch_run_idempotent(&rk, one, &key("k3"))
        .expect("k3");
    assert_eq!(cost(), 4, "k3 is kept");
    store
        .patch_run_idempotent(&rk, one, &key("k2"))
        .expect("k2");
    assert_eq!(cost(), 5, "k2 was forgotten");
}

// ---------------------------------------------------------------------------
// Production connections: TLS, a server's "no", what the server guarantees.

mod production {
    use std::time::{Duration, Instant};

    use agentstate::conformance::RULES;
    use agentstate::{
        ManualClock, PersistenceReason, RedisOptions, RedisStore, RunKey, RunRecord, StateError,
        StateStore,
    };

    use crate::redis_server::{Certs, Server, temp_dir};

    /// Every password these tests give a server or a client.
    const SECRETS: &[&str] = &["hunter2-requirepass", "wrong-pass-7731", "app-pw-5521"];

    /// Fails when a password shows in an error's `Display`, `{:?}`, or any
    /// error in its `source()` chain.
    fn no_secret(e: &StateError) {
        let mut shown = vec![e.to_string(), format!("{e:?}")];
        let mut src = std::error::Error::source(e);
        while let Some(s) = src {
            shown.push(s.to_string());
            shown.push(format!("{s:?}"));
            src = s.source();
        }
        for text in &shown {
            for pw in SECRETS {
                assert!(!text.contains(pw), "a password in an error: {text}");
            }
        }
    }

    /// A connect that must be `Refused`: within 1 s (the connect timeout
    /// is 5 s), not retryable, its detail holding every `words`, no
    /// password anywhere. Returns the message.
    fn refused(url: &str, opts: RedisOptions, words: &[&str]) -> String {
        let started = Instant::now();
        let e = RedisStore::connect_with(url, opts.connect_timeout(Duration::from_secs(5)))
            .expect_err("must be refused");
        let took = started.elapsed();
        no_secret(&e);
        assert!(
            matches!(
                e,
                StateError::Persistence {
                    reason: PersistenceReason::Refused,
                    ..
                }
            ),
            "Refused: {e:?}"
        );
        assert!(!e.is_retryable(), "{e}");
        assert!(took < Duration::from_secs(1), "took {took:?}: {e}");
        let msg = e.to_string();
        for w in words {
            assert!(msg.contains(w), "{w:?} missing from: {msg}");
        }
        eprintln!("refused in {took:?}: {msg}");
        msg
    }

    fn put_get(store: &RedisStore, tenant: &str) {
        let key = RunKey::new(tenant, "run_1");
        store
            .put_run(RunRecord::new(key.clone(), "agent"))
            .expect("put over the connection");
        assert_eq!(store.get_run(&key).expect("get").expect("stored").key, key);
    }

    /// Every rule of the conformance suite over `rediss://`, trusting the
    /// test CA given in code.
    #[test]
    fn conformance_over_tls() {
        let dir = temp_dir("tls-conf");
        let certs = Certs::make(&dir.join("certs"), "agentstate test client");
        let server = Server::start_tls(&dir.join("server"), &certs, false, &[]);
        let ca = std::fs::read(&certs.ca).expect("ca");
        let url = server.url(0);
        assert!(url.starts_with("rediss://"), "{url}");
        let factory = |clock: std::sync::Arc<ManualClock>| {
            std::sync::Arc::new(
                RedisStore::connect_with(
                    &url,
                    RedisOptions::new()
                        .options(agentstate::Options::new().clock(clock))
                        .tls_ca_pem(ca.clone())
                        .pool_size(4),
                )
                .expect("connect over TLS"),
            ) as std::sync::Arc<dyn agentstate::conformance::ConformanceStore>
        };
        let started = Instant::now();
        for (name, check) in RULES {
            eprintln!("rule {name} over rediss://");
            check(&factory);
        }
        eprintln!("{} rules over TLS in {:?}", RULES.len(), started.elapsed());
        assert!(RULES.len() > 10);
    }

    /// The URL forms redis-rs users write: `localhost` (the certificate's
    /// DNS name) as well as the IP, and `#insecure` (no verification).
    /// A wrong CA is refused, naming the certificate check.
    #[test]
    fn tls_urls_and_a_wrong_ca() {
        let dir = temp_dir("tls-urls");
        let certs = Certs::make(&dir.join("certs"), "agentstate test client");
        let server = Server::start_tls(&dir.join("server"), &certs, false, &[]);
        let ca = std::fs::read(&certs.ca).expect("ca");
        let s = RedisStore::connect_with(
            &format!("rediss://localhost:{}/0", server.port),
            RedisOptions::new().tls_ca_pem(ca.clone()),
        )
        .expect("localhost matches the certificate");
        put_get(&s, "tls-localhost");
        let s = RedisStore::connect_with(
            &format!("rediss://127.0.0.1:{}/0#insecure", server.port),
            RedisOptions::new(),
        )
        .expect("#insecure skips verification");
        put_get(&s, "tls-insecure");
        let other = std::fs::read(&certs.other_ca).expect("other ca");
        let msg = refused(
            &server.url(0),
            RedisOptions::new().tls_ca_pem(other),
            &["does not verify", "127.0.0.1"],
        );
        assert!(
            msg.contains("UnknownIssuer") || msg.contains("issuer"),
            "{msg}"
        );
        // No CA given: the built-in web PKI roots do not know the test CA.
        refused(&server.url(0), RedisOptions::new(), &["does not verify"]);
        // TLS options with a redis:// URL is a caller's mistake.
        let e = RedisStore::connect_with(
            &format!("redis://127.0.0.1:{}/0", server.port),
            RedisOptions::new().tls_ca_pem(ca),
        )
        .expect_err("TLS options need rediss://");
        assert!(matches!(e, StateError::Invalid { .. }), "{e:?}");
        // Plain text to the TLS port: an error, at once.
        let started = Instant::now();
        let e = RedisStore::connect_with(
            &format!("redis://127.0.0.1:{}/0", server.port),
            RedisOptions::new(),
        )
        .expect_err("plain text to a TLS port");
        eprintln!("plain to TLS port in {:?}: {e}", started.elapsed());
        assert!(started.elapsed() < Duration::from_secs(1), "{e}");
    }

    /// `--tls-auth-clients yes`: the client certificate given in code
    /// connects; without it the server's refusal comes back as `Refused`.
    #[test]
    fn tls_client_certificate() {
        let dir = temp_dir("tls-mtls");
        let certs = Certs::make(&dir.join("certs"), "agentstate test client");
        let server = Server::start_tls(&dir.join("server"), &certs, true, &[]);
        let s = RedisStore::connect_with(&server.url(0), server.opts())
            .expect("the client certificate is accepted");
        put_get(&s, "tls-mtls");
        assert!(format!("{:?}", server.opts()).contains("<cert and key>"));
        let ca = std::fs::read(&certs.ca).expect("ca");
        refused(
            &server.url(0),
            RedisOptions::new().tls_ca_pem(ca.clone()),
            &["TLS", "client certificate"],
        );
        // A certificate the server's CA did not sign.
        let other = Certs::make(&dir.join("other"), "agentstate test client");
        refused(
            &server.url(0),
            RedisOptions::new().tls_ca_pem(ca).tls_client_pem(
                std::fs::read(&other.client_cert).expect("cert"),
                std::fs::read(&other.client_key).expect("key"),
            ),
            &["TLS"],
        );
    }

    /// A wrong password, none, and the right one (`requirepass`); the
    /// password shows in no error.
    #[test]
    fn wrong_password_is_refused_at_once() {
        let server = Server::start(
            &temp_dir("requirepass"),
            &["--requirepass", "hunter2-requirepass"],
        );
        let p = server.port;
        refused(
            &format!("redis://:wrong-pass-7731@127.0.0.1:{p}/0"),
            RedisOptions::new(),
            &[
                "WRONGPASS",
                "authentication failed",
                &format!("127.0.0.1:{p}"),
            ],
        );
        refused(
            &format!("redis://default:wrong-pass-7731@127.0.0.1:{p}/0"),
            RedisOptions::new(),
            &["WRONGPASS", "***"],
        );
        refused(
            &format!("redis://127.0.0.1:{p}/0"),
            RedisOptions::new(),
            &["NOAUTH"],
        );
        let s = RedisStore::connect(&format!("redis://:hunter2-requirepass@127.0.0.1:{p}/3"))
            .expect("the right password connects");
        put_get(&s, "requirepass");
        assert!(!format!("{s:?}").contains("hunter2"), "{s:?}");
        // A database that does not exist.
        refused(
            &format!("redis://:hunter2-requirepass@127.0.0.1:{p}/99"),
            RedisOptions::new(),
            &["database does not exist", "DB index"],
        );
    }

    /// An ACL user without `+config`: refused, naming both ways out,
    /// until the caller states what the service guarantees; then it
    /// connects and says what was stated. A user without `EVALSHA` gets
    /// `Refused` (`NOPERM`) from the first write, not `Corrupt`.
    #[test]
    fn acl_user_without_config_needs_a_statement() {
        let server = Server::start(
            &temp_dir("acl"),
            &[
                // One argv each: redis-server joins them into the line.
                "--user",
                "app",
                "on",
                ">app-pw-5521",
                "~*",
                "&*",
                "+@all",
                "-config",
                "--user",
                "noscript",
                "on",
                ">app-pw-5521",
                "~*",
                "&*",
                "+@all",
                "-config",
                "-evalsha",
                "-eval",
                "-script",
            ],
        );
        let url = format!("redis://app:app-pw-5521@127.0.0.1:{}/0", server.port);
        refused(
            &url,
            RedisOptions::new(),
            &[
                "NOPERM",
                "config",
                "+config|get",
                "durability_assumed",
                "noeviction",
            ],
        );
        refused(
            &url,
            RedisOptions::new().durability_assumed(false, true),
            &["may evict keys"],
        );
        refused(
            &url,
            RedisOptions::new().durability_assumed(true, false),
            &["appendfsync unknown", "require_fsync(false)"],
        );
        let s = RedisStore::connect_with(&url, RedisOptions::new().durability_assumed(true, true))
            .expect("the statement connects");
        let d = s.durability();
        assert!(
            d.contains("stated by the caller") && d.contains("NOPERM"),
            "{d}"
        );
        assert!(
            d.contains("appendfsync always") && d.contains("noeviction"),
            "{d}"
        );
        put_get(&s, "acl");
        let s = RedisStore::connect_with(
            &url,
            RedisOptions::new()
                .durability_assumed(true, false)
                .require_fsync(false),
        )
        .expect("no fsync statement, require_fsync(false)");
        assert!(
            s.durability().contains("appendfsync unknown"),
            "{}",
            s.durability()
        );

        let url = format!("redis://noscript:app-pw-5521@127.0.0.1:{}/0", server.port);
        let s = RedisStore::connect_with(&url, RedisOptions::new().durability_assumed(true, true))
            .expect("connects: the checks need no script");
        let started = Instant::now();
        let e = s
            .put_run(RunRecord::new(RunKey::new("acl", "r"), "agent"))
            .expect_err("no EVALSHA");
        no_secret(&e);
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
        assert!(e.to_string().contains("NOPERM"), "{e}");
        assert!(started.elapsed() < Duration::from_secs(1));
        // A server that reads CONFIG is checked, the statement unused.
        let plain = Server::start(&temp_dir("acl-plain"), &[]);
        let s = RedisStore::connect_with(
            &plain.url(0),
            RedisOptions::new().durability_assumed(true, false),
        )
        .expect("connects");
        assert!(
            s.durability().contains("read with CONFIG GET"),
            "{}",
            s.durability()
        );
    }

    /// `maxmemory-policy allkeys-lru` is refused, fsync or not, naming the
    /// setting and the command that changes it.
    #[test]
    fn an_evicting_server_is_refused() {
        let server = Server::start(
            &temp_dir("evict"),
            &["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"],
        );
        for opts in [
            RedisOptions::new(),
            RedisOptions::new().require_fsync(false),
        ] {
            refused(
                &server.url(0),
                opts,
                &[
                    "maxmemory-policy is allkeys-lru",
                    "CONFIG SET maxmemory-policy noeviction",
                ],
            );
        }
    }

    /// `appendonly no` with `require_fsync` (the default) is refused.
    #[test]
    fn appendonly_no_is_refused() {
        let server = Server::start(&temp_dir("aof-off"), &["--appendonly", "no"]);
        refused(
            &server.url(0),
            RedisOptions::new(),
            &[
                "appendonly no",
                "appendfsync always",
                "require_fsync(false)",
            ],
        );
        let s = RedisStore::connect_with(&server.url(0), RedisOptions::new().require_fsync(false))
            .expect("require_fsync(false) connects");
        assert!(
            s.durability().contains("appendonly no"),
            "{}",
            s.durability()
        );
    }

    /// A cluster-mode server is refused at connect, not `Corrupt` later.
    #[test]
    fn a_cluster_node_is_refused() {
        let server = Server::start(&temp_dir("cluster"), &["--cluster-enabled", "yes"]);
        refused(
            &server.url(0),
            RedisOptions::new(),
            &["cluster mode", "not supported", "cluster_enabled:1"],
        );
    }

    /// The pool's idle timeout and lifetime are taken, and a store with
    /// short ones keeps working across them.
    #[test]
    fn pool_idle_timeout_and_max_lifetime() {
        let server = Server::start(&temp_dir("pool"), &[]);
        let s = RedisStore::connect_with(
            &server.url(0),
            RedisOptions::new()
                .pool_size(2)
                .idle_timeout(Some(Duration::from_millis(50)))
                .max_lifetime(Some(Duration::from_millis(200))),
        )
        .expect("connects");
        put_get(&s, "pool-a");
        std::thread::sleep(Duration::from_millis(300));
        put_get(&s, "pool-b");
        let _ = RedisOptions::new()
            .idle_timeout(None)
            .max_lifetime(Some(Duration::ZERO));
    }

    /// E3, protocol mismatches named: a plain `redis://` URL to a port
    /// that takes TLS only, and a `rediss://` URL to a plain port, are
    /// `Refused` at once (never a retryable `Unavailable`), naming the
    /// scheme that fits; lazily opened, the first call answers the same.
    #[test]
    fn e3_plain_to_tls_and_tls_to_plain_are_refused_naming_the_scheme() {
        let dir = temp_dir("tls-mismatch");
        let certs = Certs::make(&dir.join("certs"), "agentstate test client");
        let tls = Server::start_tls(&dir.join("server"), &certs, false, &[]);
        let to_tls = format!("redis://127.0.0.1:{}/0", tls.port);
        refused(&to_tls, RedisOptions::new(), &["use rediss://", "TLS only"]);
        let plain = Server::start(&dir.join("plain"), &[]);
        let ca = std::fs::read(&certs.ca).expect("ca");
        let to_plain = format!("rediss://127.0.0.1:{}/0", plain.port);
        refused(
            &to_plain,
            RedisOptions::new().tls_ca_pem(ca.clone()),
            &["use redis://", "does not speak TLS"],
        );
        for (url, o, words) in [
            (&to_tls, RedisOptions::new(), "use rediss://"),
            (
                &to_plain,
                RedisOptions::new().tls_ca_pem(ca),
                "use redis://",
            ),
        ] {
            let s = RedisStore::connect_with(url, o.lazy(true)).expect("lazy opens nothing");
            assert!(
                s.durability().contains("not checked yet"),
                "{}",
                s.durability()
            );
            let e = s
                .get_run(&RunKey::new("t", "r"))
                .expect_err("the first call dials");
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
            assert!(e.to_string().contains(words), "{e}");
        }
    }

    /// E3, fail fast unless lazy: `connect_with` dials and checks before it
    /// returns (a wrong password is `Refused` from it); with
    /// `lazy(true)` it opens nothing and the first call answers the same
    /// errors: `Refused` for the password, `Unavailable` where nothing
    /// listens; the server checks run on that first call too.
    #[test]
    fn e3_lazy_open_answers_the_same_errors_at_the_first_call() {
        let server = Server::start(&temp_dir("lazy"), &["--requirepass", "hunter2-requirepass"]);
        let p = server.port;
        let wrong = format!("redis://:wrong-pass-7731@127.0.0.1:{p}/0");
        refused(&wrong, RedisOptions::new(), &["WRONGPASS"]);
        let s = RedisStore::connect_with(&wrong, RedisOptions::new().lazy(true))
            .expect("lazy opens nothing");
        let e = s
            .get_run(&RunKey::new("t", "r"))
            .expect_err("the first call dials");
        no_secret(&e);
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
        assert!(e.to_string().contains("WRONGPASS"), "{e}");
        let dead = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("port");
        let s = RedisStore::connect_with(
            &format!("redis://127.0.0.1:{dead}/0"),
            RedisOptions::new()
                .connect_timeout(Duration::from_millis(300))
                .lazy(true),
        )
        .expect("lazy opens nothing");
        let e = s
            .get_run(&RunKey::new("t", "r"))
            .expect_err("nothing listens");
        assert!(e.is_retryable(), "{e:?}");
        // The right password, lazily: the first call checks and works.
        let s = RedisStore::connect_with(
            &format!("redis://:hunter2-requirepass@127.0.0.1:{p}/0"),
            RedisOptions::new().lazy(true),
        )
        .expect("lazy");
        put_get(&s, "lazy");
        assert!(
            s.durability().contains("appendfsync always"),
            "{}",
            s.durability()
        );
    }

    /// An unreachable server stays `Unavailable` (retryable), naming host
    /// and port, never the password.
    #[test]
    fn unreachable_is_unavailable() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("port");
        let e = RedisStore::connect_with(
            &format!("redis://app:app-pw-5521@127.0.0.1:{port}/0"),
            RedisOptions::new().connect_timeout(Duration::from_millis(500)),
        )
        .expect_err("nothing listens");
        no_secret(&e);
        assert!(e.is_retryable(), "{e:?}");
        assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
    }
}

// ---------------------------------------------------------------------------
// Async-native (issue 40): the store inside runtimes, dropped futures,
// and the synchronous API from many threads.

/// A tenant no other test (or earlier run on a named server) uses.
fn fresh_tenant(tag: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_nanos();
    format!("{tag}-{}-{nanos}", std::process::id())
}

fn tray_doc(doc: &str) -> Tray {
    Tray {
        marked: false,
        doc: doc.as_bytes().to_vec(),
        env: "e".into(),
        hostname: "h".into(),
    }
}

/// Connects, uses and drops stores inside a runtime: one dialed with
/// `connect_async` and used through `AsyncStore` (natively), one dialed
/// with the synchronous `connect_with` and used through the synchronous
/// API on the executor thread. Nothing panics, and each sees the other's
/// writes.
#[cfg(feature = "async")]
async fn used_and_dropped_inside_a_runtime(tag: &str) {
    use agentstate::{AsyncStore, StateQuery};
    let url = crate::redis_server::shared_url(12);
    let tenant = fresh_tenant(tag);
    let store = RedisStore::connect_async(&url, RedisOptions::new())
        .await
        .expect("connect_async");
    let a = AsyncStore::new(store);
    let rk = RunKey::new(&tenant, "r");
    let run = a
        .put_run(RunRecord::new(rk.clone(), "agent"))
        .await
        .expect("put_run");
    assert_eq!(run.version, 1);
    let run = a
        .patch_run(
            &rk,
            StateDelta {
                iterations: 1,
                ..Default::default()
            },
        )
        .await
        .expect("patch_run");
    assert_eq!((run.version, run.iterations), (2, 1));
    let inst = InstanceKey::new(&tenant, "w");
    a.apply_batch(
        &inst,
        1,
        vec![TrayOp::Put {
            tray_ns: "n".into(),
            tray_id: "t".into(),
            tray: tray_doc("async"),
        }],
    )
    .await
    .expect("apply_batch");
    let page = a
        .list_runs(&StateQuery::new(&tenant), &PageRequest::new(10))
        .await
        .expect("list_runs");
    assert_eq!(page.items().len(), 1);
    // An admin call (the blocking pool) on the same store.
    assert!(a.verify().await.expect("verify").is_ok());
    drop(a);

    // The synchronous API, called on the executor thread: it blocks that
    // thread for the call, and works.
    let s = RedisStore::connect_with(&url, RedisOptions::new()).expect("connect_with");
    let got = s.get_run(&rk).expect("get_run").expect("the run");
    assert_eq!(got.version, 2);
    s.patch_run(
        &rk,
        StateDelta {
            iterations: 1,
            ..Default::default()
        },
    )
    .expect("sync patch_run");
    let tray = s
        .read_tray(&inst.tray("n", "t"), 1)
        .expect("read_tray")
        .expect("the tray");
    assert_eq!(tray.doc, b"async");
    assert!(!s.stats().expect("stats").tenants.is_empty());
    drop(s);

    // A store dialed synchronously, then used through AsyncStore.
    let a = AsyncStore::from(RedisStore::connect_with(&url, RedisOptions::new()).expect("connect"));
    let got = a.get_run(&rk).await.expect("get_run").expect("the run");
    assert_eq!(got.version, 3);
    drop(a);
}

#[cfg(feature = "async")]
#[tokio::test(flavor = "current_thread")]
async fn used_and_dropped_inside_a_current_thread_runtime() {
    used_and_dropped_inside_a_runtime("rt-current").await;
}

#[cfg(feature = "async")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn used_and_dropped_inside_a_multi_thread_runtime() {
    used_and_dropped_inside_a_runtime("rt-multi").await;
}

/// A store dialed inside a runtime that then ends keeps working: its
/// connections live on the store's own runtime.
#[test]
fn a_store_outlives_the_runtime_it_was_dialed_in() {
    let url = crate::redis_server::shared_url(12);
    let tenant = fresh_tenant("outlives");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let store = rt
        .block_on(RedisStore::connect_async(&url, RedisOptions::new()))
        .expect("connect_async");
    let rk = RunKey::new(&tenant, "r");
    rt.block_on(async { store.put_run(RunRecord::new(rk.clone(), "agent")) })
        .expect("put_run inside the runtime");
    drop(rt);
    let run = store
        .patch_run(
            &rk,
            StateDelta {
                iterations: 1,
                ..Default::default()
            },
        )
        .expect("patch_run after the runtime ended");
    assert_eq!(run.version, 2);
}

/// W3 on Redis: futures of `AsyncStore` writes dropped at every point of
/// their flight (`tokio::time::timeout` with tiny durations) never leave
/// part of a write: each patch adds one iteration, one version and its
/// amounts together, and each batch writes all its trays or none.
#[cfg(feature = "async")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_async_writes_never_leave_part_of_a_write() {
    use agentstate::AsyncStore;
    let url = crate::redis_server::shared_url(12);
    let tenant = fresh_tenant("dropped");
    let store = AsyncStore::new(
        RedisStore::connect_async(&url, RedisOptions::new().pool_size(4))
            .await
            .expect("connect_async"),
    );
    let rk = RunKey::new(&tenant, "r");
    store
        .put_run(RunRecord::new(rk.clone(), "agent"))
        .await
        .expect("create");
    let inst = InstanceKey::new(&tenant, "w");
    let delta = StateDelta {
        iterations: 1,
        cost_micros: 3,
        usage: agentstate::Usage {
            input_tokens: 5,
            output_tokens: 7,
        },
        ..Default::default()
    };
    let (mut cut, mut done) = (0u32, 0u32);
    for i in 0..rounds(400) {
        // 0 µs to ~1.5 ms: from before anything is sent to after the answer.
        let limit = Duration::from_micros((i as u64 * 37) % 1_500);
        match tokio::time::timeout(limit, store.patch_run(&rk, delta)).await {
            Ok(r) => {
                r.expect("a patch that answered");
                done += 1;
            }
            Err(_) => cut += 1,
        }
        let doc = format!("batch-{i}");
        let ops = (0..4)
            .map(|k| TrayOp::Put {
                tray_ns: "n".into(),
                tray_id: format!("t{k}"),
                tray: tray_doc(&doc),
            })
            .collect();
        match tokio::time::timeout(limit, store.apply_batch(&inst, 1, ops)).await {
            Ok(r) => {
                r.expect("a batch that answered");
                done += 1;
            }
            Err(_) => cut += 1,
        }
        if i % 50 == 0 {
            check_whole(&store, &rk, &inst).await;
        }
    }
    eprintln!("dropped writes: {cut} cut, {done} answered");
    assert!(
        cut > 0,
        "no future was dropped in flight: the test tested nothing"
    );
    assert!(done > 0, "no write answered");
    // Writes handed over before their future was dropped may still land.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let run = check_whole(&store, &rk, &inst).await;
    assert!(
        run.iterations >= u64::from(done) / 2,
        "fewer patches stored than answered"
    );
    assert!(store.verify().await.expect("verify").is_ok());
}

/// Every patch of the run whole (its version, iterations and amounts
/// agree), and the instance's trays all from one batch.
#[cfg(feature = "async")]
async fn check_whole(store: &agentstate::AsyncStore, rk: &RunKey, inst: &InstanceKey) -> RunRecord {
    let run = store.get_run(rk).await.expect("get").expect("the run");
    let n = run.iterations;
    assert_eq!(
        run.version,
        1 + n,
        "version and iterations disagree: {run:?}"
    );
    assert_eq!(run.cost_micros, 3 * n, "{run:?}");
    assert_eq!(run.usage.input_tokens, 5 * n, "{run:?}");
    assert_eq!(run.usage.output_tokens, 7 * n, "{run:?}");
    let trays = store
        .list_trays(inst, 1, &PageRequest::new(10))
        .await
        .expect("list_trays");
    let docs: std::collections::BTreeSet<Vec<u8>> =
        trays.items().iter().map(|(_, t)| t.doc.clone()).collect();
    assert!(
        trays.items().is_empty() || (trays.items().len() == 4 && docs.len() == 1),
        "a batch landed in part: {:?}",
        trays.items()
    );
    run
}

/// The synchronous API from many OS threads at once, on one store: every
/// patch counted once, every thread's own runs there.
#[test]
fn the_sync_api_from_many_threads_at_once() {
    let url = crate::redis_server::shared_url(12);
    let tenant = fresh_tenant("threads");
    let store = RedisStore::connect_with(&url, RedisOptions::new().pool_size(4)).expect("connect");
    let shared = RunKey::new(&tenant, "shared");
    store
        .put_run(RunRecord::new(shared.clone(), "agent"))
        .expect("create");
    const THREADS: usize = 24;
    let per = rounds(40);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (store, shared, tenant) = (&store, &shared, &tenant);
            s.spawn(move || {
                for i in 0..per {
                    store
                        .patch_run(
                            shared,
                            StateDelta {
                                iterations: 1,
                                ..Default::default()
                            },
                        )
                        .expect("patch");
                    if i % 10 == 0 {
                        let own = RunKey::new(tenant, format!("t{t}-{i}"));
                        store
                            .put_run(RunRecord::new(own.clone(), "agent"))
                            .expect("put");
                        assert!(store.get_run(&own).expect("get").is_some());
                    }
                }
            });
        }
    });
    let run = store.get_run(&shared).expect("get").expect("the run");
    assert_eq!(run.iterations, (THREADS * per) as u64);
    assert_eq!(run.version, 1 + (THREADS * per) as u64);
    let page = store
        .list_runs(
            &agentstate::StateQuery::new(&tenant),
            &PageRequest::new(1000),
        )
        .expect("list");
    assert_eq!(page.items().len(), 1 + THREADS * per.div_ceil(10));
}

// ---------------------------------------------------------------------------
// Labels (R11) in the Redis layout: the stored format, the label indexes
// and the run hash's `lb` field, through every write that touches them.

mod labels {
    use std::process::Command;

    use agentstate::{
        Entry, Labels, PageRequest, RedisStore, RunKey, RunRecord, RunState, SessionKey,
        SessionRecord, StateDelta, StateQuery, StateStore, StoreAdmin,
    };
    use serde_json::json;

    /// Runs a read-only (or test-only) Lua script on database `url`; its
    /// answer as `redis-cli` prints it, one line per element. The store's
    /// keys hold NULs, so scripts find them by pattern (`KEYS`) instead of
    /// being given them: each test database holds one tenant.
    fn lua(url: &str, script: &str) -> Vec<String> {
        let out = Command::new("redis-cli")
            .args(["-u", url, "EVAL", script, "0"])
            .output()
            .expect("redis-cli");
        assert!(out.status.success(), "redis-cli EVAL failed");
        String::from_utf8(out.stdout)
            .expect("text")
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// A run's format byte and its `lb` field ('' when absent).
    fn stored(url: &str, run_id: &str) -> (String, String) {
        let a = lua(
            url,
            &format!(
                "local k = redis.call('KEYS', '*}}:r:{run_id}')[1] \
                 local h = redis.call('HMGET', k, 'v', 'lb') \
                 return {{tostring(string.byte(h[1], 1)), h[2] or ''}}"
            ),
        );
        (a[0].clone(), a.get(1).cloned().unwrap_or_default())
    }

    /// A session's format byte.
    fn session_format(url: &str, id: &str) -> String {
        lua(
            url,
            &format!(
                "local k = redis.call('KEYS', '*}}:s:{id}')[1] \
                 return tostring(string.byte(redis.call('HGET', k, 'v'), 1))"
            ),
        )[0]
        .clone()
    }

    /// Every label index entry, as `suffix=run id`, sorted.
    fn index(url: &str) -> Vec<String> {
        let mut v = lua(
            url,
            "local out = {} \
             for _, k in ipairs(redis.call('KEYS', '*}:lb:*')) do \
               local suffix = string.match(k, '}:lb:(.*)$') \
               for _, m in ipairs(redis.call('ZRANGE', k, 0, -1)) do \
                 out[#out + 1] = suffix .. '=' .. m end end \
             return out",
        );
        // redis-cli prints an empty array as an empty line.
        v.retain(|l| !l.is_empty());
        v.sort();
        v
    }

    fn list(s: &RedisStore, q: &StateQuery) -> Vec<String> {
        s.list_runs(q, &PageRequest::new(100))
            .expect("list")
            .items()
            .iter()
            .map(|r| r.key.run_id.clone())
            .collect()
    }

    fn fresh(db: u32) -> (String, RedisStore) {
        let url = crate::redis_server::shared_url(db);
        crate::redis_server::flush(&url);
        let s = RedisStore::connect(&url).expect("connect");
        (url, s)
    }

    #[test]
    fn formats_index_entries_and_the_lb_field_follow_every_write() {
        let (url, s) = fresh(13);
        let t = "lbl";
        // No labels: format 1, as before labels, and no `lb` field.
        let plain = s
            .put_run(RunRecord::new(RunKey::new(t, "plain"), "a"))
            .expect("create");
        assert_eq!(stored(&url, "plain"), ("1".into(), String::new()));
        assert!(index(&url).is_empty());
        assert!(
            s.get_run(&plain.key)
                .expect("get")
                .expect("run")
                .labels
                .is_empty()
        );

        // Labels: format 2, one index entry per label.
        let r = s
            .put_run(
                RunRecord::new(RunKey::new(t, "r"), "a")
                    .with_label("team", "a")
                    .with_label("n", 1),
            )
            .expect("create");
        assert_eq!(
            stored(&url, "r"),
            ("2".into(), "4:1:n19:4:team\"a\"".into())
        );
        assert_eq!(index(&url), vec!["1:n1=r", "4:team\"a\"=r"]);

        // A patch keeps the labels, the field and the entries.
        let r = s
            .patch_run(
                &r.key,
                StateDelta {
                    iterations: 1,
                    ..Default::default()
                },
            )
            .expect("patch");
        assert_eq!(r.labels, Labels::new().with("team", "a").with("n", 1));
        assert_eq!(stored(&url, "r").0, "2");
        assert_eq!(index(&url), vec!["1:n1=r", "4:team\"a\"=r"]);

        // A label changed: the old entry goes, the new one comes.
        let mut next = r.clone();
        next.labels = Labels::new().with("team", "b").with("n", 1);
        let r = s.put_run(next).expect("relabel");
        assert_eq!(index(&url), vec!["1:n1=r", "4:team\"b\"=r"]);
        assert_eq!(
            list(&s, &StateQuery::new(t).label("team", "a")),
            Vec::<String>::new()
        );
        assert_eq!(list(&s, &StateQuery::new(t).label("team", "b")), vec!["r"]);

        // Labels removed: format 1 again, no field, no entries.
        let mut next = r.clone();
        next.labels = Labels::new();
        let r = s.put_run(next).expect("unlabel");
        assert_eq!(stored(&url, "r"), ("1".into(), String::new()));
        assert!(index(&url).is_empty());
        assert!(s.verify().expect("verify").is_ok());

        // And back; then a delete takes its entries with it.
        let mut next = r.clone();
        next.labels = Labels::new().with("team", "a");
        next.state = RunState::Completed;
        let r = s.put_run(next).expect("label again");
        assert_eq!(index(&url), vec!["4:team\"a\"=r"]);
        s.delete_run(&r.key, None).expect("delete");
        assert!(index(&url).is_empty());

        // Sessions: format 2 only with labels.
        let sk = SessionKey::new(t, "s");
        let sess = s
            .put_session(SessionRecord::new(sk.clone()))
            .expect("session");
        assert_eq!(session_format(&url, "s"), "1");
        let mut next = sess.clone();
        next.labels = Labels::new().with("title", json!({"b": 1, "a": [true]}));
        s.put_session(next.clone()).expect("label the session");
        assert_eq!(session_format(&url, "s"), "2");
        let got = s.get_session(&sk).expect("get").expect("session");
        assert_eq!(got.labels, next.labels);
        assert!(s.verify().expect("verify").is_ok());
    }

    #[test]
    fn cascades_prune_import_and_verify_keep_the_label_indexes() {
        let (url, s) = fresh(14);
        let t = "lbc";
        let sk = SessionKey::new(t, "s");
        s.put_session(SessionRecord::new(sk.clone()))
            .expect("session");
        for i in 0..4 {
            let mut r = RunRecord::new(RunKey::new(t, format!("r{i}")), "a")
                .with_label("team", if i % 2 == 0 { "a" } else { "b" });
            if i < 2 {
                r = r.with_session("s");
            }
            r.state = RunState::Completed;
            s.put_run(r).expect("create");
        }
        assert_eq!(index(&url).len(), 4);
        assert!(s.verify().expect("verify").is_ok());

        // Export and import into an empty database: the labels and their
        // index come along.
        let mut entries = Vec::new();
        let mut page = PageRequest::new(2);
        loop {
            let p = s.export_page(&page).expect("export");
            entries.extend(p.items().iter().cloned());
            match p.cursor() {
                Some(c) => page = PageRequest::new(2).after(Some(c)),
                None => break,
            }
        }
        let (url2, s2) = fresh(15);
        let n = s2
            .import(
                &mut entries
                    .clone()
                    .into_iter()
                    .map(Ok::<Entry, agentstate::StateError>),
            )
            .expect("import");
        assert_eq!(n, entries.len() as u64);
        assert_eq!(index(&url2), index(&url));
        assert_eq!(
            list(&s2, &StateQuery::new(t).label("team", "a")),
            vec!["r0", "r2"]
        );
        assert!(s2.verify().expect("verify").is_ok());

        // A cascade takes the session's runs out of the label indexes.
        s.delete_session(&sk, true).expect("cascade");
        assert_eq!(index(&url), vec!["4:team\"a\"=r2", "4:team\"b\"=r3"]);
        // So does a prune.
        assert_eq!(s.prune(t, u64::MAX).expect("prune"), 2);
        assert!(index(&url).is_empty());
        assert!(s.verify().expect("verify").is_ok());

        // verify sees an index entry missing, and one too many.
        lua(
            &url2,
            "local k = redis.call('KEYS', '*}:lb:4:team\"a\"')[1] \
             redis.call('ZREM', k, 'r0') return 1",
        );
        let rep = s2.verify().expect("verify");
        assert!(
            rep.problems
                .iter()
                .any(|p| p.contains("label index entry missing")),
            "{:?}",
            rep.problems
        );
        lua(
            &url2,
            "local k = redis.call('KEYS', '*}:lb:4:team\"a\"')[1] \
             redis.call('ZADD', k, 1, 'r0') redis.call('ZADD', k, 9, 'ghost') return 1",
        );
        let rep = s2.verify().expect("verify");
        assert!(
            rep.problems
                .iter()
                .any(|p| p.contains("5 label index entries for 4 labels")),
            "{:?}",
            rep.problems
        );
    }
}

// ---------------------------------------------------------------------------
// The change feed beyond its rules (F1–F9 run in `conformance.rs`): a
// waiter woken by another process, the subscriber connection's password
// and database, and the store-wide trays feed pruned on a database of its
// own (pruning the shared database's would break the other tests'
// feeds).

mod feed {
    use std::path::Path;
    use std::process::Command;
    use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

    use agentstate::{
        Changed, FeedScope, FeedStore, InstanceKey, Position, RedisStore, RunKey, RunRecord,
        StateError, StateStore, Tray, TrayOp, TrayStore,
    };

    use crate::redis_server::{Server, flush, shared_url, temp_dir};

    fn micros_now() -> u128 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("clock")
            .as_micros()
    }

    /// Waits until `path` exists (another process writes it), and reads it.
    fn await_file(path: &Path) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(s) = std::fs::read_to_string(path)
                && s.ends_with('\n')
            {
                return s.trim().to_string();
            }
            assert!(Instant::now() < deadline, "{} never came", path.display());
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    const ROUNDS: usize = 3;

    /// A waiter in this process is woken by a write from a second OS
    /// process (this test binary run again) well under a second after the
    /// write began, each of several rounds: the write's script publishes,
    /// the store's subscriber connection hears it. (Re-reading the feed on
    /// its own happens only every 2 s.)
    #[test]
    fn a_write_from_another_process_wakes_a_waiter() {
        const ROLE: &str = "AGENTSTATE_REDIS_FEED_WRITER";
        if let Ok(dir) = std::env::var(ROLE) {
            // The writer: for each round, once the waiter says it is about
            // to wait, a pause, then one write, and when it began.
            let dir = Path::new(&dir);
            let url = std::env::var("AGENTSTATE_REDIS_FEED_URL").expect("url");
            let tenant = std::env::var("AGENTSTATE_REDIS_FEED_TENANT").expect("tenant");
            let store = RedisStore::connect(&url).expect("the writer connects");
            for round in 0..ROUNDS {
                await_file(&dir.join(format!("wait-{round}")));
                std::thread::sleep(Duration::from_millis(300));
                let began = micros_now();
                store
                    .put_run(RunRecord::new(
                        RunKey::new(&tenant, format!("r{round}")),
                        "writer",
                    ))
                    .expect("the writer's write");
                std::fs::write(dir.join(format!("wrote-{round}")), format!("{began}\n"))
                    .expect("note the write");
            }
            return;
        }
        let url = shared_url(0);
        let tenant = super::fresh_tenant("feed-wake");
        let scope = FeedScope::tenant(&tenant);
        let store = RedisStore::connect(&url).expect("connect");
        let dir = temp_dir("feed-wake");
        std::fs::create_dir_all(&dir).expect("dir");
        let mut child = Command::new(std::env::current_exe().expect("exe"))
            .args([
                "--exact",
                "redis::feed::a_write_from_another_process_wakes_a_waiter",
                "--test-threads",
                "1",
            ])
            .env(ROLE, &dir)
            .env("AGENTSTATE_REDIS_FEED_URL", &url)
            .env("AGENTSTATE_REDIS_FEED_TENANT", &tenant)
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("spawn the writer");
        let mut at = store.feed_head(&scope).expect("head");
        let mut lags = Vec::new();
        for round in 0..ROUNDS {
            std::fs::write(dir.join(format!("wait-{round}")), "go\n").expect("signal");
            let page = store
                .wait_changes(&scope, at, 10, Duration::from_secs(30))
                .expect("wait");
            let woke = micros_now();
            let began: u128 = await_file(&dir.join(format!("wrote-{round}")))
                .parse()
                .expect("a time");
            assert_eq!(page.changes.len(), 1, "round {round}: {page:?}");
            let Changed::Run { run } = &page.changes[0].item else {
                panic!("round {round}: {page:?}")
            };
            assert_eq!(run.key.run_id, format!("r{round}"));
            assert!(page.next > at, "round {round}: the position moves on");
            at = page.next;
            lags.push(Duration::from_micros(
                woke.saturating_sub(began).try_into().expect("small"),
            ));
        }
        assert!(child.wait().expect("writer").success(), "the writer failed");
        eprintln!("woken after the other process's write began: {lags:?}");
        for (round, lag) in lags.iter().enumerate() {
            assert!(
                *lag < Duration::from_millis(500),
                "round {round}: woken {lag:?} after the write began"
            );
        }
    }

    /// `redis-cli` on `url`, its output.
    fn cli(url: &str, args: &[&str]) -> String {
        redis_cli(&["-u", url], args)
    }

    /// `redis-cli` with connection arguments `to`, its output.
    fn redis_cli(to: &[&str], args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(to)
            .args(args)
            .output()
            .expect("redis-cli");
        assert!(out.status.success(), "redis-cli {args:?} failed");
        String::from_utf8(out.stdout)
            .expect("text")
            .trim()
            .to_string()
    }

    /// The subscriber connection logs in with the URL's password and
    /// selects its database (a waiter there is woken at once), and it is
    /// one connection for the store whatever the number of waiters.
    #[test]
    fn the_subscriber_uses_the_urls_password_and_database() {
        let server = Server::start(&temp_dir("feed-auth"), &["--requirepass", "feed-pw-3391"]);
        let url = format!("redis://:feed-pw-3391@127.0.0.1:{}/5", server.port);
        let store = RedisStore::connect(&url).expect("connect");
        let port = server.port.to_string();
        let to = ["-p", &port, "-a", "feed-pw-3391", "--no-auth-warning"];
        let clients = || redis_cli(&to, &["CLIENT", "LIST"]);
        let scopes: Vec<FeedScope> = (0..3).map(|n| FeedScope::tenant(format!("t{n}"))).collect();
        let subscribers = || {
            clients()
                .lines()
                .filter(|l| l.contains(" sub=") && !l.contains(" sub=0 "))
                .map(str::to_string)
                .collect::<Vec<_>>()
        };
        std::thread::scope(|sc| {
            let waiters: Vec<_> = scopes
                .iter()
                .map(|scope| {
                    let store = &store;
                    sc.spawn(move || {
                        let head = store.feed_head(scope).expect("head");
                        let page = store
                            .wait_changes(scope, head, 10, Duration::from_secs(20))
                            .expect("wait");
                        (page, Instant::now())
                    })
                })
                .collect();
            // Every waiter subscribed, all on one connection, in db 5.
            let deadline = Instant::now() + Duration::from_secs(10);
            let subs = loop {
                let subs = subscribers();
                if subs.len() == 1 && subs[0].contains(" sub=3 ") {
                    break subs;
                }
                assert!(
                    Instant::now() < deadline,
                    "no subscriber: {subs:?} in {}",
                    clients()
                );
                std::thread::sleep(Duration::from_millis(20));
            };
            assert!(subs[0].contains(" db=5 "), "{subs:?}");
            let wrote = Instant::now();
            for (n, scope) in scopes.iter().enumerate() {
                let FeedScope::Tenant { tenant } = scope else {
                    unreachable!()
                };
                store
                    .put_run(RunRecord::new(RunKey::new(tenant, format!("r{n}")), "a"))
                    .expect("write");
            }
            for w in waiters {
                let (page, woke) = w.join().expect("waiter");
                assert_eq!(page.changes.len(), 1, "{page:?}");
                let lag = woke.duration_since(wrote);
                assert!(lag < Duration::from_millis(500), "woken after {lag:?}");
            }
        });
    }

    /// An ACL user without channels (`resetchannels`, Redis 7's default
    /// for a new user): its writes succeed (their publish is refused
    /// without failing them), and its waiters, refused a subscription,
    /// poll: woken soon after a write, and back at their timeout when
    /// nothing comes.
    #[test]
    fn without_channels_writes_work_and_waiters_poll() {
        let server = Server::start(
            &temp_dir("feed-nochan"),
            &[
                "--user",
                "nochan",
                "on",
                ">nochan-pw-8812",
                "~*",
                "resetchannels",
                "+@all",
            ],
        );
        let url = format!("redis://nochan:nochan-pw-8812@127.0.0.1:{}/0", server.port);
        let store = RedisStore::connect(&url).expect("connect");
        let scope = FeedScope::tenant("nochan");
        let head = store.feed_head(&scope).expect("head");
        let began = Instant::now();
        let page = store
            .wait_changes(&scope, head, 10, Duration::from_millis(300))
            .expect("wait for nothing");
        let took = began.elapsed();
        assert!(page.changes.is_empty(), "{page:?}");
        assert!(
            took >= Duration::from_millis(300) && took < Duration::from_secs(2),
            "a 300 ms wait took {took:?}"
        );
        std::thread::scope(|sc| {
            let store = &store;
            let w = sc.spawn(move || {
                store
                    .wait_changes(&scope, head, 10, Duration::from_secs(20))
                    .map(|p| (p, Instant::now()))
            });
            std::thread::sleep(Duration::from_millis(300));
            let wrote = Instant::now();
            store
                .put_run(RunRecord::new(RunKey::new("nochan", "r"), "a"))
                .expect("a write without channels");
            let (page, woke) = w.join().expect("waiter").expect("wait");
            assert_eq!(page.changes.len(), 1, "{page:?}");
            let lag = woke.duration_since(wrote);
            assert!(lag < Duration::from_millis(500), "woken after {lag:?}");
        });
    }

    fn tray(env: &str) -> Tray {
        Tray {
            marked: true,
            doc: b"doc".to_vec(),
            env: env.into(),
            hostname: "h".into(),
        }
    }

    fn puts(env: &str, ids: impl Iterator<Item = String>) -> Vec<TrayOp> {
        ids.map(|id| TrayOp::Put {
            tray_ns: "t".into(),
            tray_id: id,
            tray: tray(env),
        })
        .collect()
    }

    fn deletes(ids: impl Iterator<Item = String>) -> Vec<TrayOp> {
        ids.map(|id| TrayOp::Delete {
            tray_ns: "t".into(),
            tray_id: id,
        })
        .collect()
    }

    /// `prune_changes` on the trays feed (database 9, which no other test
    /// uses): tombstones of trays and alarms go, from the env feeds too,
    /// in batches past the script's (1000 entries); live records stay; the
    /// horizon moves to `through` (and no further than the head), and a
    /// position before it is `FeedPruned`; an env's feed is pruned only
    /// with the trays feed.
    #[test]
    fn prune_the_trays_feed() {
        let url = shared_url(9);
        flush(&url);
        let s = RedisStore::connect(&url).expect("connect");
        let trays = FeedScope::trays();
        let (a, b) = ("prune-a", "prune-b");
        let (i, j) = (InstanceKey::new("pr", "i"), InstanceKey::new("pr", "j"));
        let zcard = |key: &str| -> u64 { cli(&url, &["ZCARD", key]).parse().expect("a count") };
        let env_set = |env: &str| format!("as:{{trays}}:fd:e:{env}");

        s.apply_batch(&i, 1, puts(a, (0..1200).map(|n| format!("a{n}"))))
            .expect("env a's trays");
        s.apply_batch(&i, 1, puts(b, (0..10).map(|n| format!("b{n}"))))
            .expect("env b's trays");
        s.set_alarm(&i, 1, 5_000).expect("alarm");
        s.set_alarm(&j, 1, 6_000).expect("another alarm");
        let before_deletes = s.feed_head(&trays).expect("head");
        // Each env's feed has positions of its own (F9), at the same
        // counter.
        let envs = [FeedScope::trays_in(a), FeedScope::trays_in(b)];
        let env_before: Vec<Position> = envs
            .iter()
            .map(|e| s.feed_head(e).expect("env head"))
            .collect();
        // The counter's value, below the scope's 32-bit tag (F9).
        assert_eq!(before_deletes.as_u128() & ((1u128 << 96) - 1), 1212);

        // Tombstones: 600 of a's, 4 of b's (b0 is written again, into env
        // a, so it is no tombstone), and i's alarm.
        s.apply_batch(&i, 1, deletes((0..600).map(|n| format!("a{n}"))))
            .expect("delete a's");
        s.apply_batch(&i, 1, deletes((0..5).map(|n| format!("b{n}"))))
            .expect("delete b's");
        s.write_tray(&i.tray("t", "b0"), 1, tray(a))
            .expect("b0 again, in a");
        s.ack_alarm(&i, 1, 5_000).expect("ack");
        let head = s.feed_head(&trays).expect("head");
        let env_heads: Vec<Position> = envs
            .iter()
            .map(|e| s.feed_head(e).expect("env head"))
            .collect();
        assert_eq!(zcard(&env_set(a)), 1201, "a's trays and b0");
        assert_eq!(zcard(&env_set(b)), 9, "b's, b0 gone to a");
        assert_eq!(zcard("as:{trays}:fd"), 1212);

        // Nothing to drop before the deletes; the horizon moves all the same.
        assert_eq!(s.prune_changes(&trays, before_deletes).expect("prune"), 0);
        match s.changes(&trays, Position::START, 10) {
            Err(StateError::FeedPruned { horizon, scope }) => {
                assert_eq!((horizon, scope), (before_deletes, trays.clone()))
            }
            other => panic!("a position before the horizon: {other:?}"),
        }
        let page = s
            .changes(&trays, before_deletes, 1000)
            .expect("from the horizon");
        assert_eq!(page.changes.len(), 605 + 1, "the tombstones and b0");

        // An env's feed is pruned only with the trays feed's.
        assert!(matches!(
            s.prune_changes(&FeedScope::trays_in(a), env_heads[0]),
            Err(StateError::Invalid { .. })
        ));

        // Past the head (the feed's own tag, the largest ordinal): pruned
        // through the head, no further.
        let dropped = s
            .prune_changes(
                &trays,
                Position::from_u128(head.as_u128() | ((1u128 << 96) - 1)),
            )
            .expect("prune");
        assert_eq!(dropped, 605);
        for (scope, before_deletes, head) in [
            (trays.clone(), before_deletes, head),
            (envs[0].clone(), env_before[0], env_heads[0]),
            (envs[1].clone(), env_before[1], env_heads[1]),
        ] {
            match s.changes(&scope, before_deletes, 10) {
                Err(StateError::FeedPruned { horizon, .. }) => assert_eq!(horizon, head),
                other => panic!("{scope}: a position before the horizon: {other:?}"),
            }
            let page = s.changes(&scope, head, 10).expect("at the horizon");
            assert!(page.changes.is_empty(), "{scope}: {page:?}");
        }
        assert_eq!(zcard(&env_set(a)), 601, "a's live trays and b0");
        assert_eq!(zcard(&env_set(b)), 5, "b5..b9");
        assert_eq!(
            zcard("as:{trays}:fd"),
            601 + 5 + 1,
            "live trays and j's alarm"
        );
        assert_eq!(cli(&url, &["HLEN", "as:{trays}:fd:g"]), "0");
        // New writes follow the horizon; live records keep their entries.
        s.write_tray(&i.tray("t", "new"), 1, tray(b))
            .expect("a write");
        let page = s.changes(&trays, head, 10).expect("the write");
        assert_eq!(page.changes.len(), 1, "{page:?}");
        assert_eq!(s.prune_changes(&trays, page.next).expect("prune"), 0);
        assert_eq!(zcard("as:{trays}:fd"), 601 + 5 + 1 + 1);
    }
}

/// D5 on Redis: keys lost under the store (evicted, or deleted by hand)
/// are named by `verify()` whichever side of an index they were on — a
/// record an index names, an index that no longer names a record, the
/// tenant registry, the `seq` counter, a tray and its instance's index —
/// never a clean report over a store that lost records.
#[test]
fn d5_verify_names_every_record_the_indexes_lost() {
    use agentstate::{SessionKey, SessionRecord, TrayKey};
    let url = crate::redis_server::shared_url(15);
    crate::redis_server::flush(&url);
    let store = RedisStore::connect(&url).expect("connect");
    store
        .put_session(SessionRecord::new(SessionKey::new("acme", "s1")))
        .expect("session");
    for n in 1..=5 {
        let mut r = RunRecord::new(RunKey::new("acme", format!("r{n}")), "agent");
        if n <= 2 {
            r.session_id = Some("s1".into());
        }
        store.put_run(r).expect("run");
    }
    let inst = InstanceKey::new("ns", "w1");
    let tray = |id: &str| TrayOp::Put {
        tray_ns: "t".into(),
        tray_id: id.into(),
        tray: Tray {
            marked: false,
            doc: b"{}".to_vec(),
            env: "e".into(),
            hostname: "h".into(),
        },
    };
    store
        .apply_batch(&inst, 1, vec![tray("a"), tray("b")])
        .expect("trays");
    // A session whose runs all finished may be deleted (S2): its runs
    // name it, and that is no loss.
    store
        .put_session(SessionRecord::new(SessionKey::new("acme", "s2")))
        .expect("session");
    let mut done = RunRecord::new(RunKey::new("acme", "done"), "agent");
    done.session_id = Some("s2".into());
    let mut done = store.put_run(done).expect("run");
    done.state = agentstate::RunState::Completed;
    store.put_run(done).expect("finish");
    store
        .delete_session(&SessionKey::new("acme", "s2"), false)
        .expect("a session of finished runs");
    let before = store.verify().expect("verify");
    assert!(before.is_ok(), "a sound store: {:?}", before.problems);

    // Lose keys the way an evicting server does: whole keys, any of them.
    let client = redis::Client::open(url.as_str()).expect("client");
    let mut raw = client.get_connection().expect("raw connection");
    let all: Vec<Vec<u8>> = redis::cmd("KEYS")
        .arg("as:*")
        .query(&mut raw)
        .expect("KEYS");
    let one = |suffix: &[u8]| -> Vec<u8> {
        let found: Vec<&Vec<u8>> = all.iter().filter(|k| k.ends_with(suffix)).collect();
        assert_eq!(
            found.len(),
            1,
            "one key ends with {:?}",
            String::from_utf8_lossy(suffix)
        );
        found[0].clone()
    };
    // Tray b's hash: the later of the instance's two (ids "a" < "b").
    let tray_b = all
        .iter()
        .filter(|k| k.starts_with(b"as:{trays}:y:"))
        .max()
        .expect("tray b's hash")
        .clone();
    let lost = [
        one(b":s:s1"),
        one(b":r:r1"),
        one(b"}:runs"),
        one(b"}:seq"),
        b"as:{meta}:tenants".to_vec(),
        tray_b,
        b"as:{trays}:insts".to_vec(),
    ];
    for k in &lost {
        let n: u64 = redis::cmd("DEL").arg(k).query(&mut raw).expect("DEL");
        assert_eq!(n, 1, "{:?} existed", String::from_utf8_lossy(k));
    }
    let report = store.verify().expect("verify");
    let text = report.problems.join("\n");
    for want in [
        "run acme/r1: named by index",
        "run acme/r2: missing from the tenant's run index",
        "run acme/r5: missing from the tenant's run index",
        "tenant acme: has keys but is missing from the tenant registry",
        "tenant acme: its seq counter is missing",
        "session acme/s1: runs name it but it is missing",
        "tray index names a missing tray",
        "instance ns/w1: has keys but is missing from the instance registry",
    ] {
        assert!(
            text.contains(want),
            "verify names {want:?}; it said:\n{text}"
        );
    }
    assert!(!report.is_ok());
    // What is left still reads.
    let a = TrayKey {
        ns: "ns".into(),
        id: "w1".into(),
        tray_ns: "t".into(),
        tray_id: "a".into(),
    };
    assert!(store.read_tray(&a, 1).expect("read").is_some());
}

/// E3 on Redis, settings watched: a server switched to an evicting
/// `maxmemory-policy` (or away from fsync on every write) after the store
/// connected gets no write acknowledged: the next write reads the settings
/// again and is `Refused`, naming the setting, with nothing written; reads
/// go on; switched back, writes are taken again. With the default
/// interval the reading is at most a second old.
#[test]
fn e3_a_server_made_unsafe_after_connect_refuses_writes() {
    use agentstate::PersistenceReason;
    let server = Server::start(&temp_dir("watched"), &[]);
    let url = server.url(0);
    let set = |name: &str, value: &str| {
        let client = redis::Client::open(url.as_str()).expect("client");
        let mut raw = client.get_connection().expect("raw connection");
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query(&mut raw)
            .expect("CONFIG SET");
    };
    let refused = |e: StateError, setting: &str| {
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
        assert!(e.to_string().contains(setting), "names {setting}: {e}");
    };
    let store =
        RedisStore::connect_with(&url, RedisOptions::new().settings_interval(Duration::ZERO))
            .expect("connect");
    let key = RunKey::new("acme", "r1");
    store
        .put_run(RunRecord::new(key.clone(), "a"))
        .expect("put");

    set("maxmemory-policy", "allkeys-lru");
    let one = StateDelta {
        iterations: 1,
        ..Default::default()
    };
    refused(
        store.patch_run(&key, one).expect_err("evicting"),
        "maxmemory-policy",
    );
    refused(
        store
            .put_run(RunRecord::new(RunKey::new("acme", "r2"), "a"))
            .expect_err("evicting"),
        "maxmemory-policy",
    );
    let inst = InstanceKey::new("ns", "w");
    refused(
        store.release(&inst, 1).expect_err("evicting"),
        "maxmemory-policy",
    );
    // Reads go on, and nothing was written.
    let run = store.get_run(&key).expect("read").expect("there");
    assert_eq!((run.version, run.iterations), (1, 0));
    assert!(
        store
            .get_run(&RunKey::new("acme", "r2"))
            .expect("read")
            .is_none()
    );

    set("maxmemory-policy", "noeviction");
    assert_eq!(store.patch_run(&key, one).expect("safe again").version, 2);
    set("appendfsync", "everysec");
    refused(
        store.patch_run(&key, one).expect_err("no fsync"),
        "appendfsync",
    );
    set("appendfsync", "always");
    assert_eq!(store.patch_run(&key, one).expect("safe again").version, 3);

    // The default interval: a reading at most a second old.
    let store = RedisStore::connect(&url).expect("connect");
    store.patch_run(&key, one).expect("safe");
    set("maxmemory-policy", "volatile-lru");
    std::thread::sleep(Duration::from_millis(1_100));
    refused(
        store.patch_run(&key, one).expect_err("evicting"),
        "maxmemory-policy",
    );
    set("maxmemory-policy", "noeviction");
    std::thread::sleep(Duration::from_millis(1_100));
    store.patch_run(&key, one).expect("safe again");

    // A new connection is a new reading, however long the interval: the
    // store's connections are cut, the settings changed meanwhile, and the
    // first write on the redialed connection is refused.
    let store = RedisStore::connect_with(
        &url,
        RedisOptions::new().settings_interval(Duration::from_secs(3_600)),
    )
    .expect("connect");
    let before = store.patch_run(&key, one).expect("safe").version;
    set("maxmemory-policy", "allkeys-lru");
    assert_eq!(
        store.patch_run(&key, one).expect("not due yet").version,
        before + 1,
        "the interval holds until a redial"
    );
    let client = redis::Client::open(url.as_str()).expect("client");
    let mut raw = client.get_connection().expect("raw connection");
    let _: i64 = redis::cmd("CLIENT")
        .arg(&["KILL", "TYPE", "normal", "SKIPME", "yes"])
        .query(&mut raw)
        .expect("CLIENT KILL");
    let mut answers = Vec::new();
    let refusal = loop {
        match store.patch_run(&key, one) {
            Err(
                e @ StateError::Persistence {
                    reason: PersistenceReason::Refused,
                    ..
                },
            ) => break e,
            // The call the cut met: Unavailable, or OutcomeUnknown if the
            // patch was on its way.
            other => answers.push(format!("{other:?}")),
        }
        assert!(
            answers.len() < 3,
            "never refused after a redial: {answers:?}"
        );
    };
    refused(refusal, "maxmemory-policy");
    // At most the cut call wrote; nothing after the redial did.
    let run = store.get_run(&key).expect("read").expect("there");
    assert!(run.version <= before + 2, "{run:?}");
    set("maxmemory-policy", "noeviction");
}

/// A current-thread runtime of the test's own.
#[cfg(feature = "async")]
fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// A patch that counts one iteration.
fn one_iteration() -> StateDelta {
    StateDelta {
        iterations: 1,
        ..Default::default()
    }
}

/// The store's connections to `url`'s server, counted by the server
/// (`CLIENT LIST TYPE normal`, less the one asking).
fn store_connections(url: &str) -> usize {
    let client = redis::Client::open(url).expect("client");
    let mut raw = client.get_connection().expect("raw connection");
    let me: i64 = redis::cmd("CLIENT")
        .arg("ID")
        .query(&mut raw)
        .expect("CLIENT ID");
    let list: String = redis::cmd("CLIENT")
        .arg(&["LIST", "TYPE", "normal"])
        .query(&mut raw)
        .expect("CLIENT LIST");
    list.lines()
        .filter(|l| !l.starts_with(&format!("id={me} ")))
        .count()
}

/// A synchronous caller's calls run on a blocking connection of its own
/// (its thread writes and reads the socket: no hop to the store's
/// runtime), one kept between calls; an async caller's on the
/// multiplexed ones. At most `pool_size` of each are open, however many
/// threads call at once, and a call that finds every blocking one taken
/// goes to a multiplexed one.
#[test]
fn a_synchronous_caller_has_a_blocking_connection_of_its_own() {
    let server = Server::start(&temp_dir("own-conn"), &[]);
    let url = server.url(0);
    let rk = RunKey::new("own", "r");
    let store = RedisStore::connect_with(&url, RedisOptions::new().pool_size(2)).expect("connect");
    assert_eq!(
        store_connections(&url),
        1,
        "the connection open checked the server on"
    );
    store
        .put_run(RunRecord::new(rk.clone(), "agent"))
        .expect("create");
    assert_eq!(store_connections(&url), 2, "the caller's own beside it");
    for _ in 0..20 {
        store.patch_run(&rk, StateDelta::default()).expect("patch");
        store.get_run(&rk).expect("get").expect("run");
    }
    assert_eq!(
        store_connections(&url),
        2,
        "kept between calls, not redialed"
    );

    let threads = 6;
    let each = 40;
    std::thread::scope(|sc| {
        for _ in 0..threads {
            sc.spawn(|| {
                for _ in 0..each {
                    store
                        .patch_run(&rk, one_iteration())
                        .expect("patch under contention");
                }
            });
        }
    });
    let run = store.get_run(&rk).expect("get").expect("run");
    assert_eq!(run.iterations, (threads * each) as u64, "every patch once");
    let open = store_connections(&url);
    assert!(
        (3..=4).contains(&open),
        "2 blocking and 1 or 2 multiplexed connections, not one a thread: {open}"
    );
    drop(store);

    // Through AsyncStore the same calls take the multiplexed connection.
    #[cfg(feature = "async")]
    {
        current_thread().block_on(async {
            let store = RedisStore::connect_async(&url, RedisOptions::new().pool_size(2))
                .await
                .expect("connect_async");
            let a = agentstate::AsyncStore::new(store);
            for _ in 0..20 {
                a.patch_run(&rk, StateDelta::default())
                    .await
                    .expect("patch");
            }
            // The sync store's are gone once dropped; the async one's is
            // the only one.
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while store_connections(&url) != 1 {
                assert!(
                    std::time::Instant::now() < deadline,
                    "one connection for async calls"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        });
    }
}

/// A server at `maxclients` takes a new connection and then refuses it:
/// a synchronous call whose blocking connection cannot be had runs on the
/// multiplexed one instead, and succeeds.
#[test]
fn a_refused_blocking_dial_leaves_the_call_to_the_multiplexed_connection() {
    let server = Server::start(&temp_dir("maxclients"), &[]);
    let url = server.url(0);
    let store = RedisStore::connect(&url).expect("connect");
    assert_eq!(
        store_connections(&url),
        1,
        "the store's multiplexed connection"
    );
    // The server full: the store's connection and this one.
    let client = redis::Client::open(url.as_str()).expect("client");
    let mut raw = client.get_connection().expect("raw connection");
    let () = redis::cmd("CONFIG")
        .arg(&["SET", "maxclients", "2"])
        .query(&mut raw)
        .expect("CONFIG SET maxclients");
    let rk = RunKey::new("full", "r");
    store
        .put_run(RunRecord::new(rk.clone(), "agent"))
        .expect("create on the multiplexed connection");
    for n in 1..=20u64 {
        let run = store.patch_run(&rk, one_iteration()).expect("patch");
        assert_eq!(run.iterations, n);
    }
    drop(raw);
}

/// A server that closes idle connections (its `timeout`, as managed
/// Redis services set one): a write after the store sat idle past it is
/// not failed for it. Its first command (the settings' re-reading, due
/// after a second) meets the closed connection before anything of the
/// write was sent, and goes again on a fresh one, synchronous and async.
#[test]
fn a_write_after_the_server_closed_the_idle_connections_succeeds() {
    let server = Server::start(&temp_dir("idle-close"), &["--timeout", "1"]);
    let url = server.url(0);
    let rk = RunKey::new("idle", "r");
    let store = RedisStore::connect(&url).expect("connect");
    store
        .put_run(RunRecord::new(rk.clone(), "agent"))
        .expect("create");
    let closed = || {
        // The server closes an idle client within a second or two of its
        // timeout; wait until it did.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while store_connections(&url) > 0 {
            assert!(std::time::Instant::now() < deadline, "the server kept them");
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    for n in 1..=3u64 {
        closed();
        let run = store
            .patch_run(&rk, one_iteration())
            .expect("a write after the idle connections were closed");
        assert_eq!(run.iterations, n);
    }
    drop(store);
    #[cfg(feature = "async")]
    {
        current_thread().block_on(async {
            let store = RedisStore::connect_async(&url, RedisOptions::new())
                .await
                .expect("connect_async");
            let a = agentstate::AsyncStore::new(store);
            for n in 4..=5u64 {
                closed();
                let run = a
                    .patch_run(&rk, one_iteration())
                    .await
                    .expect("an async write after the idle connections were closed");
                assert_eq!(run.iterations, n);
            }
        });
    }
}

/// E3 on a blocking connection: a read whose answer did not come within
/// the io timeout is `Unavailable`, and its late answer is never taken
/// for a later call's (the store drops the connection; redis-rs would
/// also skip the late answer on it). The calls after it get their own
/// answers.
#[test]
fn e3_a_timed_out_blocking_connection_is_not_used_again() {
    let server = Server::start(&temp_dir("own-timeout"), &[]);
    let url = server.url(0);
    let store = RedisStore::connect_with(
        &url,
        RedisOptions::new()
            .io_timeout(Duration::from_millis(200))
            .pool_size(1),
    )
    .expect("connect");
    let keys: Vec<RunKey> = (0..4)
        .map(|i| RunKey::new("late", format!("r{i}")))
        .collect();
    for k in &keys {
        store
            .put_run(RunRecord::new(k.clone(), "agent"))
            .expect("create");
    }
    let blocker = block_server(&url, 1_200);
    let e = store.get_run(&keys[0]).expect_err("no answer in time");
    assert!(e.is_retryable(), "a read that timed out: {e:?}");
    blocker.join().expect("blocker");
    for _ in 0..3 {
        for k in &keys[1..] {
            let run = store.get_run(k).expect("get").expect("the run");
            assert_eq!(&run.key, k, "each call reads its own answer");
        }
    }
}
