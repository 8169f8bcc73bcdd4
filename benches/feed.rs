//! The change feed on the embedded stores (issue 42), side by side in one
//! run:
//!
//! - **wake latency**: a consumer blocked in `wait_changes`, a writer that
//!   commits one run at a time once the consumer has seen the last: the
//!   time from the writer's `Ok` to the consumer holding the change,
//!   median and p99 (target ≤ 5 ms);
//! - **catch-up**: a consumer `AGENTSTATE_FEED_WRITES` writes behind
//!   (default 1M) over `AGENTSTATE_FEED_RECORDS` runs (default 100k) reads
//!   the feed from the start, against a plain listing of the same runs
//!   (target: proportional to the records, not the writes);
//! - **writers with a consumer**: creates per second from 1 and 8 writers
//!   with no consumer and with one following the feed (target: ≤ 10% lost).
//!
//! With the `postgres` and `redis` features, the same wake latency and
//! writer figures on a throwaway PostgreSQL server (fsync on) and
//! redis-server on loopback, the consumer woken across connections
//! (LISTEN/NOTIFY, pub/sub); on PostgreSQL also writers with the feed's
//! triggers dropped (the feed's own cost; target ≤ 10%).
//!
//! ```text
//! cargo bench --bench feed
//! cargo bench --bench feed --features postgres,redis -- --quick
//! ```
//!
//! Prints one `RESULT name=value` line per figure; no test asserts a time.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use agentstate::{
    Changed, Durability, FeedScope, FileStore, MemoryStore, Options, Position, RunKey, RunRecord,
    StateDelta, StateQuery, Store,
};

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Commit → waiting consumer woken, per change (µs).
fn wake_latency(name: &str, store: Arc<dyn Store>, n: usize) {
    let tenant = format!("wake-{name}");
    let scope = FeedScope::tenant(&tenant);
    let head = store.feed_head(&scope).unwrap();
    let committed: Arc<Vec<AtomicU64>> = Arc::new((0..n).map(|_| AtomicU64::new(0)).collect());
    let seen = Arc::new(AtomicU64::new(0));
    let origin = Instant::now();
    let consumer = {
        let (store, committed, seen, scope) = (
            store.clone(),
            committed.clone(),
            seen.clone(),
            scope.clone(),
        );
        std::thread::spawn(move || {
            let mut at = head;
            let mut lat = Vec::with_capacity(n);
            while lat.len() < n {
                let page = store
                    .wait_changes(&scope, at, 100, Duration::from_secs(10))
                    .unwrap();
                let now = origin.elapsed().as_nanos() as u64;
                for c in &page.changes {
                    if let Changed::Run { run } = &c.item {
                        let i: usize = run.key.run_id[1..].parse().unwrap();
                        // The writer notes its Ok after the call returns:
                        // wait for the note (it is on its way).
                        let mut t = committed[i].load(Ordering::SeqCst);
                        while t == 0 {
                            std::hint::spin_loop();
                            t = committed[i].load(Ordering::SeqCst);
                        }
                        lat.push(now.saturating_sub(t) as f64 / 1000.0);
                        seen.store(i as u64 + 1, Ordering::SeqCst);
                    }
                }
                at = page.next;
            }
            lat
        })
    };
    for i in 0..n {
        store
            .put_run(RunRecord::new(
                RunKey::new(&tenant, format!("r{i}")),
                "agent",
            ))
            .unwrap();
        committed[i].store(origin.elapsed().as_nanos() as u64, Ordering::SeqCst);
        while seen.load(Ordering::SeqCst) < i as u64 + 1 {
            std::hint::spin_loop();
        }
    }
    let mut lat = consumer.join().unwrap();
    let (p50, p99) = (percentile(&mut lat, 0.5), percentile(&mut lat, 0.99));
    println!("wake latency on {name}: median {p50:.1} µs, p99 {p99:.1} µs over {n} changes");
    println!("RESULT feed_wake_{name}_median_us={p50:.1}");
    println!("RESULT feed_wake_{name}_p99_us={p99:.1}");
}

/// A consumer `writes` behind over `records` runs, against a listing.
fn catch_up(name: &str, store: Arc<dyn Store>, records: usize, writes: usize) {
    let tenant = format!("catch-{name}");
    let scope = FeedScope::tenant(&tenant);
    let keys: Vec<RunKey> = (0..records)
        .map(|i| RunKey::new(&tenant, format!("r{i:07}")))
        .collect();
    let t = Instant::now();
    for k in &keys {
        store.put_run(RunRecord::new(k.clone(), "agent")).unwrap();
    }
    let delta = StateDelta {
        iterations: 1,
        ..StateDelta::default()
    };
    for w in records..writes {
        store.patch_run(&keys[w % records], delta).unwrap();
    }
    let wrote = t.elapsed();
    let mut list = Vec::new();
    let mut feed = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        let mut n = 0;
        for r in store.iter_runs(&StateQuery::new(&tenant)) {
            std::hint::black_box(r.unwrap());
            n += 1;
        }
        assert_eq!(n, records);
        list.push(t.elapsed().as_secs_f64() * 1000.0);
        let t = Instant::now();
        let (mut at, mut n) = (Position::START, 0);
        loop {
            let page = store.changes(&scope, at, 100).unwrap();
            if page.changes.is_empty() {
                break;
            }
            n += page.changes.len();
            at = page.next;
            std::hint::black_box(page);
        }
        assert_eq!(n, records, "one change per record");
        feed.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    let (l, f) = (percentile(&mut list, 0.5), percentile(&mut feed, 0.5));
    println!(
        "catch-up on {name}: {records} runs after {writes} writes (written in {:.1} s): feed {f:.1} ms, listing {l:.1} ms, ratio {:.2}",
        wrote.as_secs_f64(),
        f / l
    );
    println!("RESULT feed_catch_up_{name}_ms={f:.1}");
    println!("RESULT feed_list_{name}_ms={l:.1}");
    println!("RESULT feed_catch_up_over_list_{name}={:.2}", f / l);
}

/// Creates per second from `writers` threads for `secs`, with or without
/// a consumer following the tenant's feed.
fn writers(store: Arc<dyn Store>, tag: &str, writers: usize, consumer: bool, secs: f64) -> f64 {
    let tenant = format!("w-{tag}-{writers}-{consumer}");
    let scope = FeedScope::tenant(&tenant);
    let stop = Arc::new(AtomicBool::new(false));
    let follower = consumer.then(|| {
        let (store, stop, scope) = (store.clone(), stop.clone(), scope.clone());
        std::thread::spawn(move || {
            let mut at = store.feed_head(&scope).unwrap();
            while !stop.load(Ordering::SeqCst) {
                let page = store
                    .wait_changes(&scope, at, 1000, Duration::from_millis(100))
                    .unwrap();
                at = page.next;
            }
        })
    });
    let made = Arc::new(AtomicU64::new(0));
    let t = Instant::now();
    let handles: Vec<_> = (0..writers)
        .map(|w| {
            let (store, made, tenant) = (store.clone(), made.clone(), tenant.clone());
            std::thread::spawn(move || {
                let mut i = 0;
                while t.elapsed().as_secs_f64() < secs {
                    store
                        .put_run(RunRecord::new(
                            RunKey::new(&tenant, format!("w{w}-{i}")),
                            "agent",
                        ))
                        .unwrap();
                    i += 1;
                }
                made.fetch_add(i, Ordering::SeqCst);
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let rate = made.load(Ordering::SeqCst) as f64 / t.elapsed().as_secs_f64();
    stop.store(true, Ordering::SeqCst);
    if let Some(f) = follower {
        f.join().unwrap();
    }
    rate
}

// The test servers (their TLS variants unused here).
#[cfg(all(feature = "postgres", feature = "redis"))]
#[allow(dead_code)]
#[path = "../tests/it/certs.rs"]
mod certs;
#[cfg(all(feature = "postgres", feature = "redis"))]
#[path = "../tests/it/pg_server.rs"]
mod pg_server;
#[cfg(all(feature = "postgres", feature = "redis"))]
#[allow(dead_code)]
#[path = "../tests/it/redis_server.rs"]
mod redis_server;

/// Writers with and without a consumer (and, given `bare`, on a store
/// whose feed is switched off), median of three rounds each.
fn writer_figures(
    name: &str,
    make: &mut dyn FnMut() -> Arc<dyn Store>,
    bare: Option<&mut dyn FnMut() -> Arc<dyn Store>>,
    secs: f64,
) {
    let mut bare = bare;
    for w in [1, 8] {
        let (mut without, mut with, mut off) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..3 {
            let store = make();
            let tag = format!("{name}{round}");
            without.push(writers(store.clone(), &tag, w, false, secs));
            with.push(writers(store, &tag, w, true, secs));
            if let Some(b) = bare.as_mut() {
                off.push(writers(b(), &format!("{tag}off"), w, false, secs));
            }
        }
        let (a, b) = (percentile(&mut without, 0.5), percentile(&mut with, 0.5));
        println!(
            "{w} writer(s) on {name}: {a:.0} creates/s without a consumer, {b:.0} with one (ratio {:.2})",
            b / a
        );
        println!(
            "RESULT feed_writers_{name}_{w}_with_over_without={:.2}",
            b / a
        );
        if !off.is_empty() {
            let o = percentile(&mut off, 0.5);
            println!(
                "{w} writer(s) on {name}: {o:.0} creates/s with the feed's triggers dropped: the feed costs {:.0}%",
                (1.0 - a / o) * 100.0
            );
            println!("RESULT feed_writers_{name}_{w}_feed_over_none={:.2}", a / o);
        }
    }
}

#[cfg(all(feature = "postgres", feature = "redis"))]
fn servers(wakes: usize, secs: f64) {
    use agentstate::{PgOptions, PostgresStore, RedisOptions, RedisStore};
    let pg = pg_server::PgServer::start(true);
    let dsn = pg.dsn("postgres");
    let schemas = std::cell::Cell::new(0);
    let pg_store = |feed: bool| -> Arc<dyn Store> {
        schemas.set(schemas.get() + 1);
        let schema = format!("feedbench{}", schemas.get());
        let store =
            PostgresStore::connect_with(&dsn, PgOptions::new().schema(&schema).pool_size(16))
                .expect("connect");
        store.setup().expect("setup");
        if !feed {
            let mut c = postgres::Client::connect(&dsn, postgres::NoTls).expect("connect");
            for t in [
                "agentstate_runs",
                "agentstate_sessions",
                "pinned_tray_index",
                "agentstate_alarms",
            ] {
                c.batch_execute(&format!("DROP TRIGGER agentstate_feed ON \"{schema}\".{t}"))
                    .expect("drop the feed's trigger");
            }
        }
        Arc::new(store)
    };
    wake_latency("postgres", pg_store(true), wakes);
    let dir = redis_server::temp_dir("feed-bench");
    let redis = redis_server::Server::start(&dir, &[]);
    let mut db = 0;
    let mut redis_store = || -> Arc<dyn Store> {
        db = (db + 1) % 16;
        let url = format!("redis://127.0.0.1:{}/{db}", redis.port);
        Arc::new(
            RedisStore::connect_with(&url, RedisOptions::new().pool_size(16)).expect("connect"),
        )
    };
    wake_latency("redis", redis_store(), wakes);
    let mut pg_bare = || pg_store(false);
    let mut pg_fed = || pg_store(true);
    writer_figures("postgres", &mut pg_fed, Some(&mut pg_bare), secs);
    writer_figures("redis", &mut redis_store, None, secs);
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let dir = tempfile::tempdir().unwrap();
    let memory = || -> Arc<dyn Store> { Arc::new(MemoryStore::new()) };
    let mut n = 0;
    let mut file = |durability: Durability| -> Arc<dyn Store> {
        n += 1;
        Arc::new(
            FileStore::open_with(
                dir.path().join(format!("s{n}")),
                Options::new().durability(durability),
            )
            .unwrap(),
        )
    };

    let wakes = env_usize("AGENTSTATE_FEED_WAKES", if quick { 1_000 } else { 10_000 });
    wake_latency("memory", memory(), wakes);
    wake_latency("file", file(Durability::Immediate), wakes / 5);

    let records = env_usize(
        "AGENTSTATE_FEED_RECORDS",
        if quick { 10_000 } else { 100_000 },
    );
    let writes = env_usize("AGENTSTATE_FEED_WRITES", records * 10);
    catch_up("memory", memory(), records, writes);
    catch_up("file", file(Durability::Buffered), records, writes);

    let secs = if quick { 1.0 } else { 3.0 };
    writer_figures("memory", &mut || memory(), None, secs);
    writer_figures("file", &mut || file(Durability::Immediate), None, secs);
    #[cfg(all(feature = "postgres", feature = "redis"))]
    servers(wakes / 5, secs);
}
