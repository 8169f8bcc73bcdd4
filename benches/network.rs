//! What a call costs across a network (issue 40): PostgreSQL and Redis
//! behind a loopback proxy that delays every byte by a fixed time each way
//! (0.5 ms, so a 1 ms round trip, as between a worker and a managed server
//! in one region), 1 and 8 workers, each of the common writes against the
//! floor: the same kind of write issued by hand as one statement (one
//! round trip plus the server's commit) over the same proxy.
//!
//! ```text
//! cargo bench --all-features --bench network
//! cargo bench --all-features --bench network -- --quick
//! cargo bench --all-features --bench network -- --quick --only redis
//! AGENTSTATE_BENCH_DELAY_US=250 cargo bench --all-features --bench network
//! ```
//!
//! The proxy counts round trips: on each connection, every time the
//! client starts sending after the server last spoke is one turn. Turns
//! per call are printed beside each figure (1 worker). Every contender
//! runs on the same throwaway servers in one process; only ratios of one
//! run are compared. Prints one `RESULT name=value` line per figure.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, mpsc};
use std::time::{Duration, Instant};

use agentstate::{
    BudgetKey, BudgetRecord, Caps, Hold, InstanceKey, PgOptions, PostgresStore, RedisOptions,
    RedisStore, RunKey, RunRecord, StateDelta, Store, Tray, TrayOp,
};

// The test servers (their TLS variants unused here).
#[allow(dead_code)]
#[path = "../tests/it/certs.rs"]
mod certs;
#[path = "../tests/it/pg_server.rs"]
mod pg_server;
#[allow(dead_code)]
#[path = "../tests/it/redis_server.rs"]
mod redis_server;

/// A TCP proxy on loopback that holds every chunk for `delay` before
/// passing it on, in order, each way; and counts the turns.
struct DelayProxy {
    port: u16,
    turns: Arc<AtomicU64>,
}

const CLIENT: u8 = 1;
const SERVER: u8 = 2;

impl DelayProxy {
    fn start(upstream: u16, delay: Duration) -> DelayProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let port = listener.local_addr().unwrap().port();
        let turns = Arc::new(AtomicU64::new(0));
        let t = Arc::clone(&turns);
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let last = Arc::new(AtomicU8::new(SERVER));
                pump(
                    client.try_clone().unwrap(),
                    server.try_clone().unwrap(),
                    delay,
                    CLIENT,
                    Arc::clone(&last),
                    Arc::clone(&t),
                );
                pump(server, client, delay, SERVER, last, Arc::clone(&t));
            }
        });
        DelayProxy { port, turns }
    }

    fn turns(&self) -> u64 {
        self.turns.load(Ordering::Relaxed)
    }
}

/// One direction: a reader stamps each chunk, a writer sends it when due.
fn pump(
    mut from: TcpStream,
    mut to: TcpStream,
    delay: Duration,
    side: u8,
    last: Arc<AtomicU8>,
    turns: Arc<AtomicU64>,
) {
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if last.swap(side, Ordering::Relaxed) != side && side == CLIENT {
                turns.fetch_add(1, Ordering::Relaxed);
            }
            if tx
                .send((Instant::now() + delay, buf[..n].to_vec()))
                .is_err()
            {
                break;
            }
        }
    });
    std::thread::spawn(move || {
        for (due, bytes) in rx {
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            if to.write_all(&bytes).is_err() {
                break;
            }
        }
        let _ = to.shutdown(std::net::Shutdown::Write);
    });
}

/// The common writes, each a function of (worker, i) on one store.
#[derive(Clone, Copy, Debug)]
enum Op {
    Create,
    Put,
    Patch,
    WriteTray,
    ApplyBatch,
    ReserveSettle,
    /// The same on runs drawing from a budget, one budget per worker.
    ReserveSettleBudget,
    /// The same, every worker's runs drawing from one shared budget (the
    /// budget's row serializes them; the store's guesses go stale).
    ReserveSettleShared,
}

const OPS: [Op; 8] = [
    Op::Create,
    Op::Put,
    Op::Patch,
    Op::WriteTray,
    Op::ApplyBatch,
    Op::ReserveSettle,
    Op::ReserveSettleBudget,
    Op::ReserveSettleShared,
];

/// Is `op` a reserve and a settle (two calls)?
fn pairs(op: Op) -> bool {
    matches!(
        op,
        Op::ReserveSettle | Op::ReserveSettleBudget | Op::ReserveSettleShared
    )
}

fn op_name(op: Op) -> &'static str {
    match op {
        Op::Create => "create",
        Op::Put => "put_run",
        Op::Patch => "patch_run",
        Op::WriteTray => "write_tray",
        Op::ApplyBatch => "apply_batch",
        Op::ReserveSettle => "reserve+settle",
        Op::ReserveSettleBudget => "res+set budget",
        Op::ReserveSettleShared => "res+set shared",
    }
}

fn tray() -> Tray {
    Tray {
        marked: true,
        doc: vec![b'x'; 200],
        env: "prod".into(),
        hostname: "bench".into(),
    }
}

/// Runs `op` `n` times on each of `workers` threads; calls per second (a
/// reserve+settle pair counts as two calls) and the proxy's turns during
/// the timed part (`turns` reads its counter).
fn ours(
    store: &Arc<dyn Store>,
    tag: &str,
    op: Op,
    workers: usize,
    n: usize,
    turns: &dyn Fn() -> u64,
) -> (f64, u64) {
    let barrier = Arc::new(Barrier::new(workers + 1));
    let handles: Vec<_> = (0..workers)
        .map(|w| {
            let (store, barrier) = (Arc::clone(store), Arc::clone(&barrier));
            let tenant = if matches!(op, Op::ReserveSettleShared) {
                format!("{tag}-shared")
            } else {
                format!("{tag}-{w}")
            };
            std::thread::spawn(move || {
                let keys: Vec<RunKey> = (0..n)
                    .map(|i| RunKey::new(tenant.clone(), format!("run-{w}-{i}")))
                    .collect();
                let inst = InstanceKey::new(tenant.clone(), "worker");
                // Setup outside the timed part.
                let mut runs = Vec::new();
                let budgeted = matches!(op, Op::ReserveSettleBudget | Op::ReserveSettleShared);
                if budgeted {
                    let b = BudgetKey::new(tenant.clone(), "b");
                    // Every worker of the shared budget puts it; one wins.
                    let _ =
                        store.put_budget(BudgetRecord::new(b, Caps::new().cost_micros(1 << 50)));
                }
                if !matches!(op, Op::Create) {
                    for k in &keys {
                        let r = RunRecord::new(k.clone(), "bench");
                        let r = if budgeted { r.with_budget("b") } else { r };
                        runs.push(store.put_run(r).unwrap());
                    }
                }
                barrier.wait();
                for i in 0..n {
                    match op {
                        Op::Create => {
                            store
                                .put_run(RunRecord::new(keys[i].clone(), "bench"))
                                .unwrap();
                        }
                        Op::Put => {
                            let mut r = runs[i].clone();
                            r.agent_name = "bench-2".into();
                            runs[i] = store.put_run(r).unwrap();
                        }
                        Op::Patch => {
                            store
                                .patch_run(
                                    &keys[i],
                                    StateDelta {
                                        cost_micros: 7,
                                        iterations: 1,
                                        ..Default::default()
                                    },
                                )
                                .unwrap();
                        }
                        Op::WriteTray => {
                            store
                                .write_tray(&inst.tray("state", format!("t{i}")), 1, tray())
                                .unwrap();
                        }
                        Op::ApplyBatch => {
                            let ops = (0..3)
                                .map(|j| TrayOp::Put {
                                    tray_ns: "state".into(),
                                    tray_id: format!("b{i}-{j}"),
                                    tray: tray(),
                                })
                                .collect();
                            store.apply_batch(&inst, 1, ops).unwrap();
                        }
                        Op::ReserveSettle | Op::ReserveSettleBudget | Op::ReserveSettleShared => {
                            let hold = store
                                .reserve(&keys[i], Hold::new("h", 60_000).cost_micros(10))
                                .unwrap();
                            store
                                .settle(
                                    &keys[i],
                                    &hold.id,
                                    StateDelta {
                                        cost_micros: 9,
                                        ..Default::default()
                                    },
                                )
                                .unwrap();
                        }
                    }
                }
                barrier.wait();
            })
        })
        .collect();
    barrier.wait();
    let (t, before) = (Instant::now(), turns());
    barrier.wait();
    let (secs, after) = (t.elapsed().as_secs_f64(), turns());
    for h in handles {
        h.join().unwrap();
    }
    let per = if pairs(op) { 2 } else { 1 };
    ((per * workers * n) as f64 / secs, after - before)
}

/// The floor: one hand-issued write, one round trip and the server's
/// commit, `n` times on each of `workers` threads; calls per second.
fn floor(write: &(dyn Fn(usize, usize) + Sync), workers: usize, n: usize) -> f64 {
    let t = Instant::now();
    std::thread::scope(|s| {
        for w in 0..workers {
            s.spawn(move || {
                for i in 0..n {
                    write(w, i);
                }
            });
        }
    });
    (workers * n) as f64 / t.elapsed().as_secs_f64()
}

struct Line {
    backend: &'static str,
    op: Op,
    workers: usize,
    ours: f64,
    floor: f64,
    turns: Option<f64>,
}

fn print(lines: &[Line]) {
    println!(
        "{:<9} {:<15} {:>7} {:>11} {:>11} {:>7} {:>12}",
        "backend", "call", "workers", "calls/s", "floor/s", "ratio", "round trips"
    );
    for l in lines {
        println!(
            "{:<9} {:<15} {:>7} {:>11.0} {:>11.0} {:>7.3} {:>12}",
            l.backend,
            op_name(l.op),
            l.workers,
            l.ours,
            l.floor,
            l.ours / l.floor,
            l.turns.map(|t| format!("{t:.2}")).unwrap_or_default()
        );
    }
    for l in lines {
        let name = op_name(l.op).replace(['+', ' '], "_");
        println!(
            "RESULT net_{}_{}_w{}_vs_floor={:.3}",
            l.backend,
            name,
            l.workers,
            l.ours / l.floor
        );
        if let Some(t) = l.turns {
            println!("RESULT net_{}_{}_round_trips={t:.2}", l.backend, name);
        }
    }
}

/// Each op, 1 then 8 workers, against `floor_rate`.
fn section(
    backend: &'static str,
    store: Arc<dyn Store>,
    proxy: &DelayProxy,
    floor_rate: &dyn Fn(usize, usize) -> f64,
    n: usize,
    tag: &str,
) -> Vec<Line> {
    let mut lines = Vec::new();
    let f1 = floor_rate(1, n);
    let f8 = floor_rate(8, n);
    for op in OPS {
        let (r1, turns) = ours(
            &store,
            &format!("{tag}-{}-1", op_name(op)),
            op,
            1,
            n,
            &|| proxy.turns(),
        );
        let calls = if pairs(op) { 2 * n } else { n };
        let turns = turns as f64 / calls as f64;
        lines.push(Line {
            backend,
            op,
            workers: 1,
            ours: r1,
            floor: f1,
            turns: Some(turns),
        });
        let (r8, _) = ours(
            &store,
            &format!("{tag}-{}-8", op_name(op)),
            op,
            8,
            n,
            &|| proxy.turns(),
        );
        lines.push(Line {
            backend,
            op,
            workers: 8,
            ours: r8,
            floor: f8,
            turns: None,
        });
    }
    lines
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    // `--only postgres` or `--only redis`: that backend's section alone.
    let args: Vec<String> = std::env::args().collect();
    let only = args
        .iter()
        .position(|a| a == "--only")
        .map(|i| args.get(i + 1).map_or("", String::as_str));
    if let Some(o) = only
        && o != "postgres"
        && o != "redis"
    {
        eprintln!("--only takes postgres or redis, not {o:?}");
        std::process::exit(2);
    }
    let runs = |backend: &str| only.is_none_or(|o| o == backend);
    let n = if quick { 60 } else { 300 };
    let delay_us: u64 = std::env::var("AGENTSTATE_BENCH_DELAY_US")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(500);
    let delay = Duration::from_micros(delay_us);
    let tag = format!("net{}", std::process::id());
    println!(
        "# agentstate network ({n} calls per worker per figure; {delay_us} us each way through a loopback proxy)"
    );
    let mut lines = Vec::new();
    let round = std::sync::atomic::AtomicU64::new(0);
    if runs("postgres") {
        postgres_section(&mut lines, delay, n, &tag, &round);
    }
    if runs("redis") {
        redis_section(&mut lines, delay, n, &tag, &round);
    }
    print(&lines);
}

/// PostgreSQL, fsync on, synchronous_commit on.
fn postgres_section(
    lines: &mut Vec<Line>,
    delay: Duration,
    n: usize,
    tag: &str,
    round: &std::sync::atomic::AtomicU64,
) {
    let pg = pg_server::PgServer::start(true);
    let pg_proxy = DelayProxy::start(pg.port, delay);
    let dsn = format!("postgres://agentstate@127.0.0.1:{}/postgres", pg_proxy.port);
    let store = PostgresStore::connect_with(&dsn, PgOptions::new().schema(tag).pool_size(16))
        .expect("connect");
    store.setup().expect("setup");
    let floor_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let floor_clients: Vec<tokio_postgres::Client> = (0..8)
        .map(|_| {
            floor_rt.block_on(async {
                let (client, conn) = tokio_postgres::connect(&dsn, tokio_postgres::NoTls)
                    .await
                    .expect("floor connect");
                tokio::spawn(conn);
                client
            })
        })
        .collect();
    floor_rt
        .block_on(floor_clients[0].batch_execute(
            "CREATE TABLE IF NOT EXISTS bench_floor (k text PRIMARY KEY, v bytea NOT NULL)",
        ))
        .expect("floor table");
    let stmts: Vec<tokio_postgres::Statement> = floor_clients
        .iter()
        .map(|c| {
            floor_rt
                .block_on(c.prepare(
                    "INSERT INTO bench_floor (k, v) VALUES ($1, $2) \
                     ON CONFLICT (k) DO UPDATE SET v = EXCLUDED.v",
                ))
                .expect("prepare")
        })
        .collect();
    let body = vec![7u8; 300];
    let pg_floor = |workers: usize, n: usize| {
        let r = round.fetch_add(1, Ordering::Relaxed);
        floor(
            &|w, i| {
                let c = &floor_clients[w];
                let k = format!("{r}-{w}-{i}");
                floor_rt
                    .block_on(c.execute(&stmts[w], &[&k, &body]))
                    .expect("floor write");
            },
            workers,
            n,
        )
    };
    lines.extend(section(
        "postgres",
        Arc::new(store),
        &pg_proxy,
        &pg_floor,
        n,
        tag,
    ));
}

/// Redis: the shared test server's settings.
fn redis_section(
    lines: &mut Vec<Line>,
    delay: Duration,
    n: usize,
    tag: &str,
    round: &std::sync::atomic::AtomicU64,
) {
    let body = vec![7u8; 300];
    let dir = redis_server::temp_dir("network-bench");
    let redis = redis_server::Server::start(&dir, &[]);
    let redis_proxy = DelayProxy::start(redis.port, delay);
    let url = format!("redis://127.0.0.1:{}/0", redis_proxy.port);
    let rstore =
        RedisStore::connect_with(&url, RedisOptions::new().pool_size(16)).expect("connect");
    let rclient = redis::Client::open(url.as_str()).unwrap();
    let rconns: Vec<std::sync::Mutex<redis::Connection>> = (0..8)
        .map(|_| std::sync::Mutex::new(rclient.get_connection().unwrap()))
        .collect();
    let script = redis::Script::new("return redis.call('SET', KEYS[1], ARGV[1])");
    let redis_floor = |workers: usize, n: usize| {
        let r = round.fetch_add(1, Ordering::Relaxed);
        floor(
            &|w, i| {
                let mut c = rconns[w].lock().unwrap();
                let _: () = script
                    .key(format!("floor:{r}:{w}:{i}"))
                    .arg(&body[..])
                    .invoke(&mut *c)
                    .expect("floor script");
            },
            workers,
            n,
        )
    };
    lines.extend(section(
        "redis",
        Arc::new(rstore),
        &redis_proxy,
        &redis_floor,
        n,
        tag,
    ));
}
