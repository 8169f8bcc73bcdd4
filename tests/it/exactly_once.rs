//! Rule I7 across a network that fails: PostgreSQL and Redis behind a
//! relay that cuts connections at random, some right after forwarding a
//! request and before its answer (`fault_proxy`). Eight threads patch,
//! reserve and settle known amounts, each call retried with its key until
//! it answers: the stored totals equal the sum of the distinct operations,
//! and every hold is settled once. The same patches without keys, retried
//! the way a caller that trusted "retry on failure" would, double-count:
//! the test shows it can see that.
//!
//! Size: `AGENTSTATE_FAULT_OPS` operations per thread (default 25 in CI;
//! a soak sets thousands).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use agentstate::{Hold, IdempotencyKey, Result, RunKey, RunRecord, StateDelta, StateError, Store};

use crate::fault_proxy::{FaultProxy, Plan};

const THREADS: u64 = 8;

fn ops_per_thread() -> u64 {
    std::env::var("AGENTSTATE_FAULT_OPS")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(25)
}

const PLAN: Plan = Plan {
    cut_before: 0.03,
    cut_after: 0.06,
};

fn cost(c: u64) -> StateDelta {
    StateDelta {
        cost_micros: c,
        iterations: 1,
        ..Default::default()
    }
}

/// What the retries saw.
#[derive(Default)]
struct Seen {
    unknown: AtomicU64,
    unavailable: AtomicU64,
}

/// Calls `op` until it answers; every failure of a keyed call must say a
/// retry is safe.
fn until_answered<T>(seen: &Seen, what: &str, mut op: impl FnMut() -> Result<T>) -> T {
    for _ in 0..500 {
        match op() {
            Ok(v) => return v,
            Err(e) if e.is_retryable() => {
                if e.is_outcome_unknown() {
                    seen.unknown.fetch_add(1, Ordering::Relaxed);
                } else {
                    seen.unavailable.fetch_add(1, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => panic!("{what}: a keyed call failed for good: {e:?}"),
        }
    }
    panic!("{what}: 500 attempts without an answer");
}

/// The keyed workload through `faulty`, checked through `direct`.
fn keyed_workload(faulty: &dyn Store, direct: &dyn Store, proxy: &FaultProxy, tenant: &str) {
    let n = ops_per_thread();
    let run = RunKey::new(tenant, "spend");
    direct
        .put_run(RunRecord::new(run.clone(), "planner"))
        .expect("create the run");
    let seen = Seen::default();
    proxy.faults(true);
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (run, seen) = (&run, &seen);
            scope.spawn(move || {
                for i in 0..n {
                    let amount = t * 1_000 + i + 1;
                    let k = |op: &str| IdempotencyKey::new(format!("{op}-{t}-{i}")).unwrap();
                    until_answered(seen, "patch", || {
                        faulty.patch_run_idempotent(run, cost(amount), &k("p"))
                    });
                    let hold = format!("h-{t}-{i}");
                    until_answered(seen, "reserve", || {
                        faulty.reserve_idempotent(
                            run,
                            Hold::new(hold.clone(), 600_000).cost_micros(5),
                            &k("r"),
                        )
                    });
                    until_answered(seen, "settle", || {
                        faulty.settle_idempotent(run, &hold, cost(3), &k("s"))
                    });
                }
            });
        }
    });
    proxy.faults(false);
    let want: u64 = (0..THREADS)
        .flat_map(|t| (0..n).map(move |i| t * 1_000 + i + 1 + 3))
        .sum();
    let r = direct.get_run(&run).unwrap().expect("the run");
    let spend = direct.run_spend(&run).unwrap().expect("the run");
    let (unknown, unavailable) = (
        seen.unknown.load(Ordering::Relaxed),
        seen.unavailable.load(Ordering::Relaxed),
    );
    eprintln!(
        "i7 keyed: {} ops, {unknown} outcome-unknown and {unavailable} unavailable answers retried; \
         relay cuts: {} before, {} after forwarding, {} connections",
        THREADS * n * 3,
        proxy.cuts.before.load(Ordering::Relaxed),
        proxy.cuts.after.load(Ordering::Relaxed),
        proxy.cuts.connections.load(Ordering::Relaxed)
    );
    assert!(
        unknown > 0,
        "no call saw an unknown outcome: the relay tested nothing"
    );
    assert_eq!(
        r.cost_micros, want,
        "the stored cost is not the sum of the distinct operations"
    );
    assert_eq!(
        r.iterations,
        THREADS * n * 2,
        "one iteration per patch and per settle"
    );
    assert!(
        spend.holds.is_empty(),
        "holds left unsettled: {:?}",
        spend.holds
    );
}

/// The same patches without keys, retried on every failure: the double
/// count a key prevents is there, and the test can see it. Runs until one
/// shows (at most `cap` patches).
fn unkeyed_double_counts(faulty: &dyn Store, direct: &dyn Store, proxy: &FaultProxy, tenant: &str) {
    let run = RunKey::new(tenant, "naive");
    direct
        .put_run(RunRecord::new(run.clone(), "planner"))
        .expect("create the run");
    proxy.faults(true);
    let cap = 2_000u64;
    let mut sent = 0u64;
    let mut over = 0u64;
    while sent < cap {
        sent += 1;
        loop {
            match faulty.patch_run(&run, cost(1)) {
                Ok(_) => break,
                Err(StateError::Persistence { .. }) => std::thread::sleep(Duration::from_millis(2)),
                Err(e) => panic!("unkeyed patch: {e:?}"),
            }
        }
        if sent.is_multiple_of(25) {
            let stored = direct.get_run(&run).unwrap().unwrap().cost_micros;
            over = stored - sent;
            if over > 0 {
                break;
            }
        }
    }
    proxy.faults(false);
    eprintln!("i7 unkeyed: {sent} patches sent, {over} counted twice");
    assert!(
        over > 0,
        "{sent} unkeyed patches retried across cut connections never double-counted: \
         the relay does not cut after commits"
    );
}

#[cfg(feature = "postgres")]
#[test]
fn i7_postgres_behind_a_cutting_relay_applies_each_keyed_op_once() {
    use agentstate::{PgOptions, PostgresStore};
    let dsn = crate::pg_server::fresh_db("i7");
    let proxy = FaultProxy::start(crate::fault_proxy::url_addr(&dsn), PLAN);
    let opts = || {
        PgOptions::new()
            .pool_size(8)
            .connect_timeout(Duration::from_secs(2))
    };
    let direct = PostgresStore::connect_with(&dsn, opts()).expect("connect");
    direct.setup().expect("setup");
    let faulty = PostgresStore::connect_with(&crate::fault_proxy::via(&dsn, proxy.addr), opts())
        .expect("connect through the relay");
    keyed_workload(&faulty, &direct, &proxy, "pg-keyed");
    unkeyed_double_counts(&faulty, &direct, &proxy, "pg-naive");
}

#[cfg(feature = "redis")]
#[test]
fn i7_redis_behind_a_cutting_relay_applies_each_keyed_op_once() {
    use agentstate::{RedisOptions, RedisStore};
    let url = crate::redis_server::shared_url(11);
    crate::redis_server::flush(&url);
    let proxy = FaultProxy::start(crate::fault_proxy::url_addr(&url), PLAN);
    let opts = || {
        RedisOptions::new()
            .pool_size(8)
            .connect_timeout(Duration::from_secs(2))
            .io_timeout(Duration::from_secs(2))
    };
    let direct = RedisStore::connect_with(&url, opts()).expect("connect");
    let faulty = RedisStore::connect_with(&crate::fault_proxy::via(&url, proxy.addr), opts())
        .expect("connect through the relay");
    keyed_workload(&faulty, &direct, &proxy, "redis-keyed");
    unkeyed_double_counts(&faulty, &direct, &proxy, "redis-naive");
}
