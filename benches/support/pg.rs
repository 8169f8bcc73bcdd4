//! The PostgreSQL section of `compare`: `PostgresStore` against the same
//! statements issued by hand over the same client (the floor of our
//! layer), 1 and 8 writers, and a reaper's page at 100k runs — all on one
//! throwaway server with `fsync=on`, in one run.
//!
//! Runs with `--pg` (or `AGENTSTATE_BENCH_PG=1`); `AGENTSTATE_TEST_PG_DSN`
//! names a server to use instead of starting one.

use std::sync::{Arc, Barrier};
use std::time::Instant;

use agentstate::{
    Entry, PageRequest, PgOptions, PostgresStore, RunKey, RunState, StateDelta, StateQuery,
    StateStore, StoreAdmin,
};
use postgres::{Client, NoTls, Statement};

use super::pg_server::PgServer;
use super::{median, pct, rate, record, timed};

/// The hand-written floor: the statements `PostgresStore` sends for a
/// create, a versioned put and a patch, prepared once, on one client.
struct Floor {
    c: Client,
    select: Statement,
    counter: Statement,
    insert: Statement,
    update: Statement,
    body: Vec<u8>,
}

impl Floor {
    fn new(dsn: &str, schema: &str) -> Floor {
        let mut c = Client::connect(dsn, NoTls).expect("floor connect");
        c.batch_execute("SET synchronous_commit = on")
            .expect("sync");
        let t = |x: &str| format!("\"{schema}\".{x}");
        let select = c
            .prepare(&format!(
                "SELECT record FROM {} WHERE tenant = $1 AND run_id = $2 FOR UPDATE",
                t("agentstate_runs")
            ))
            .expect("prepare");
        let counter = c
            .prepare(&format!(
                "INSERT INTO {} AS c (tenant, next_seq) VALUES ($1, 2) ON CONFLICT (tenant) \
                 DO UPDATE SET next_seq = c.next_seq + 1 RETURNING next_seq - 1",
                t("agentstate_counters")
            ))
            .expect("prepare");
        let insert = c
            .prepare(&format!(
                "INSERT INTO {} (tenant, run_id, seq, state, session_id, agent_name, updated_at, record) \
                 VALUES ($1, $2, $3, $4, NULL, $5, $6::text::numeric, $7)",
                t("agentstate_runs")
            ))
            .expect("prepare");
        let update = c
            .prepare(&format!(
                "UPDATE {} SET state = $3, agent_name = $4, updated_at = $5::text::numeric, record = $6 \
                 WHERE tenant = $1 AND run_id = $2",
                t("agentstate_runs")
            ))
            .expect("prepare");
        Floor {
            c,
            select,
            counter,
            insert,
            update,
            // About one encoded run record.
            body: vec![7u8; 300],
        }
    }

    fn create(&mut self, tenant: &str, id: &str) {
        let mut tx = self.c.transaction().expect("begin");
        let rows = tx.query(&self.select, &[&tenant, &id]).expect("select");
        assert!(rows.is_empty());
        let seq: i64 = tx.query_one(&self.counter, &[&tenant]).expect("seq").get(0);
        tx.execute(
            &self.insert,
            &[&tenant, &id, &seq, &"pending", &"planner", &"1", &self.body],
        )
        .expect("insert");
        tx.commit().expect("commit");
    }

    /// A versioned put and a patch send the same statements.
    fn update(&mut self, tenant: &str, id: &str) {
        let mut tx = self.c.transaction().expect("begin");
        let rows = tx.query(&self.select, &[&tenant, &id]).expect("select");
        let old: Vec<u8> = rows[0].get(0);
        std::hint::black_box(old);
        tx.execute(
            &self.update,
            &[&tenant, &id, &"running", &"planner", &"2", &self.body],
        )
        .expect("update");
        tx.commit().expect("commit");
    }
}

/// One writer's create: (tenant, run id).
type Writer = Box<dyn FnMut(&str, &str) + Send>;

/// Creates per second with `writers` threads, each in its own tenant.
fn writers_rate(make: &(dyn Fn() -> Writer + Sync), writers: usize, per: usize, tag: &str) -> f64 {
    let barrier = Arc::new(Barrier::new(writers + 1));
    let elapsed = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..writers)
            .map(|w| {
                let barrier = barrier.clone();
                let mut f = make();
                let tenant = format!("{tag}-w{w}");
                sc.spawn(move || {
                    barrier.wait();
                    for i in 0..per {
                        f(&tenant, &format!("r{i}"));
                    }
                })
            })
            .collect();
        barrier.wait();
        let t = Instant::now();
        for h in hs {
            h.join().expect("writer");
        }
        t.elapsed()
    });
    (writers * per) as f64 / elapsed.as_secs_f64()
}

pub fn run(quick: bool) {
    let server;
    let dsn = match std::env::var("AGENTSTATE_TEST_PG_DSN") {
        Ok(d) if !d.is_empty() => d,
        _ => {
            server = PgServer::start(true);
            server.dsn("postgres")
        }
    };
    let schema = format!("bench_{}", std::process::id());
    let opts = || PgOptions::new().schema(&schema);
    let store = Arc::new(PostgresStore::connect_with(&dsn, opts()).expect("connect"));
    store.setup().expect("setup");
    let n = if quick { 300 } else { 2000 };
    let mut floor = Floor::new(&dsn, &schema);
    let (mut fc, mut fu, mut oc, mut op, mut oq) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // Interleaved op by op, so both see the same server and noise.
    for i in 0..n {
        let id = format!("r{i}");
        timed(&mut fc, || floor.create("floor", &id));
        timed(&mut oc, || {
            store
                .put_run(record("ours", id.clone(), RunState::Pending))
                .expect("create");
        });
    }
    for i in 0..n {
        let id = format!("r{i}");
        timed(&mut fu, || floor.update("floor", &id));
        timed(&mut op, || {
            let mut r = store
                .get_run(&RunKey::new("ours", id.clone()))
                .expect("get")
                .expect("run");
            r.state = RunState::Running;
            store.put_run(r).expect("put");
        });
        timed(&mut oq, || {
            store
                .patch_run(
                    &RunKey::new("ours", id.clone()),
                    StateDelta {
                        cost_micros: 10,
                        ..Default::default()
                    },
                )
                .expect("patch");
        });
    }
    // The timing above includes the caller's get; time puts alone too.
    let mut op_only = Vec::new();
    for i in 0..n {
        let id = format!("r{i}");
        let mut r = store
            .get_run(&RunKey::new("ours", id))
            .expect("get")
            .expect("run");
        r.state = RunState::Paused;
        timed(&mut op_only, || {
            store.put_run(r).expect("put");
        });
    }

    let per = if quick { 100 } else { 500 };
    let ours_make = {
        let store = store.clone();
        move || -> Writer {
            let store = store.clone();
            Box::new(move |t: &str, id: &str| {
                store
                    .put_run(record(t, id.to_string(), RunState::Pending))
                    .expect("create");
            })
        }
    };
    let floor_make = {
        let (dsn, schema) = (dsn.clone(), schema.clone());
        move || -> Writer {
            let mut f = Floor::new(&dsn, &schema);
            Box::new(move |t: &str, id: &str| f.create(t, id))
        }
    };
    let ours1 = writers_rate(&ours_make, 1, per * 2, "o1");
    let ours8 = writers_rate(&ours_make, 8, per, "o8");
    let floor1 = writers_rate(&floor_make, 1, per * 2, "f1");
    let floor8 = writers_rate(&floor_make, 8, per, "f8");

    // The reaper's page: 1% of the runs unfinished, a page of them by the
    // (tenant, state, seq) index, at 100k runs.
    let runs: u64 = if quick { 10_000 } else { 100_000 };
    let lschema = format!("bench_list_{}", std::process::id());
    let lstore =
        PostgresStore::connect_with(&dsn, PgOptions::new().schema(&lschema)).expect("connect");
    lstore.setup().expect("setup");
    let t = Instant::now();
    let mut entries = (0..runs).map(|i| {
        let mut r = record(
            "acme",
            format!("run-{i:08}"),
            if i % 100 == 0 {
                RunState::Running
            } else {
                RunState::Completed
            },
        );
        (r.version, r.seq, r.created_at, r.updated_at) = (1, i + 1, 1, 1);
        Ok(Entry::Run(r))
    });
    lstore.import(&mut entries).expect("load");
    let load = t.elapsed();
    let q = StateQuery::new("acme").state(RunState::Running);
    let mut page_ours = Vec::new();
    let mut walk_pages = 0;
    let t = Instant::now();
    for _ in 0..3 {
        let mut cursor = None;
        loop {
            let t0 = Instant::now();
            let p = lstore
                .list_runs(&q, &PageRequest::new(100).with_cursor(cursor))
                .expect("page");
            page_ours.push(t0.elapsed().as_secs_f64() * 1e6);
            walk_pages += 1;
            cursor = p.cursor().cloned();
            if cursor.is_none() {
                break;
            }
        }
    }
    let walk = t.elapsed() / 3;
    let mut raw = Client::connect(&dsn, NoTls).expect("raw");
    let st = raw
        .prepare(&format!(
            "SELECT run_id, record, seq FROM \"{lschema}\".agentstate_runs \
             WHERE tenant = $1 AND seq > $2 AND state = $4 ORDER BY seq LIMIT $3"
        ))
        .expect("prepare");
    let mut page_floor = Vec::new();
    for _ in 0..3 {
        let mut after = 0i64;
        loop {
            let t0 = Instant::now();
            let mut tx = raw.transaction().expect("begin");
            let rows = tx
                .query(&st, &[&"acme", &after, &101i64, &"running"])
                .expect("page");
            tx.commit().expect("commit");
            page_floor.push(t0.elapsed().as_secs_f64() * 1e6);
            if rows.len() <= 100 {
                break;
            }
            after = rows[99].get(2);
        }
    }

    let sorted = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        v
    };
    println!();
    println!("## PostgreSQL (one throwaway server, fsync=on, synchronous_commit=on, loopback TCP)");
    println!();
    println!("| figure | ours | hand-written SQL | ours / hand |");
    println!("|---|---:|---:|---:|");
    for (name, o, f) in [
        ("1 writer create", &oc, &fc),
        ("1 writer versioned put", &op_only, &fu),
        ("1 writer patch", &oq, &fu),
    ] {
        let (so, sf) = (sorted(o), sorted(f));
        println!(
            "| {name} | {:.0} ops/s (p50 {:.0} µs, p99 {:.0} µs) | {:.0} ops/s (p50 {:.0} µs, p99 {:.0} µs) | {:.2}x |",
            rate(o),
            pct(&so, 0.5),
            pct(&so, 0.99),
            rate(f),
            pct(&sf, 0.5),
            pct(&sf, 0.99),
            rate(o) / rate(f)
        );
    }
    println!(
        "| 1 writer get + put (a caller's read-modify-write) | {:.0} ops/s | | |",
        rate(&op)
    );
    println!(
        "| 1 writer durable create, own tenant | {ours1:.0} ops/s | {floor1:.0} ops/s | {:.2}x |",
        ours1 / floor1
    );
    println!(
        "| 8 writers durable create, a tenant each | {ours8:.0} ops/s | {floor8:.0} ops/s | {:.2}x |",
        ours8 / floor8
    );
    println!(
        "| 8 writers / 1 writer | {:.2}x | {:.2}x | |",
        ours8 / ours1,
        floor8 / floor1
    );
    let (so, sf) = (sorted(&page_ours), sorted(&page_floor));
    println!(
        "| reaper page (state=running, 100 of {}k runs, 1% unfinished) | p50 {:.0} µs, p99 {:.0} µs | p50 {:.0} µs, p99 {:.0} µs | {:.2}x |",
        runs / 1000,
        pct(&so, 0.5),
        pct(&so, 0.99),
        pct(&sf, 0.5),
        pct(&sf, 0.99),
        median(&page_floor) / median(&page_ours)
    );
    println!(
        "| reaper walk, all {} unfinished runs | {:.1} ms ({} pages) | | |",
        runs / 100,
        walk.as_secs_f64() * 1e3,
        walk_pages / 3
    );
    println!(
        "| load {}k runs by import (1000 a transaction) | {:.1} s | | |",
        runs / 1000,
        load.as_secs_f64()
    );
}
