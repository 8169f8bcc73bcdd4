//! Side-by-side durability and listing benchmark (issue 7).
//!
//! ```text
//! cargo bench --bench compare              # full: 1M-run listing and RSS
//! cargo bench --bench compare -- --quick   # smaller counts, same RESULT names
//! cargo bench --features postgres --bench compare -- --only pg   # PostgreSQL section alone
//! ```
//!
//! PostgreSQL (feature `postgres`, with `--pg` or `AGENTSTATE_BENCH_PG=1`,
//! or alone with `--only pg`): on one throwaway server (`fsync=on`,
//! `synchronous_commit=on`; `AGENTSTATE_TEST_PG_DSN` names another),
//! `PostgresStore`'s create, versioned put and patch against the same
//! statements prepared and issued by hand over the same client, 1 and 8
//! writers, and a reaper's page at 100k runs (`benches/support/pg.rs`).
//!
//! Everything runs in one process (plus one child for the RSS figure), in
//! one temporary directory under the crate's `target/` directory (override
//! with `AGENTSTATE_BENCH_DIR`), so every contender writes to the same disk:
//!
//! - `floor`: `write` of a 300-byte record to an append-only file, then
//!   `File::sync_data` (fdatasync) — the least a durable append can cost;
//!   `floor prealloc` overwrites a file written and synced beforehand (no
//!   block allocation, no size change);
//! - `sqlite`: rusqlite (bundled SQLite), WAL, `synchronous=FULL`; a create
//!   inserts the run row (and SQLite its three index rows) in a transaction,
//!   an update is `UPDATE … WHERE tenant = ? AND run_id = ? AND version = ?`;
//! - `fjall raw`: the engine alone, one batch (run + two index entries) and
//!   `PersistMode::SyncData` per op;
//! - `agentstate`: a `FileStore` with `Durability::Immediate`: create,
//!   version-checked put, patch with one writer; creates from 8 threads
//!   (group commit) against one writer in alternating rounds;
//! - `bare group commit`: in the same rounds, the store's group commit
//!   with no store work (870-byte appends and `fdatasync` only,
//!   `support/bare_group.rs`), whose 8-over-1 ratio is the ceiling of
//!   `writers8_vs_writers1` here; and `durable_vs_sqlite_ceiling`, the
//!   floor's rate over SQLite's create (a store with one sync per create
//!   scores at most that).
//!
//! The one-writer contenders are interleaved op by op (floor, sqlite, fjall,
//! agentstate, floor, …) so a slow spell of the shared disk hits all of
//! them alike; a rate is a contender's op count over the sum of its own op
//! times, and ratios are taken between rates of the same run.
//!
//! Listing: a page of 100 in a tenant of 10k runs and of 1M runs (200k with
//! `--quick`), 1% `Running` and 99% `Completed`, with UUID-like run ids,
//! loaded with `Durability::Buffered` from 8 threads (a durable load of 1M
//! runs would take most of an hour of syncs). The reaper's query
//! (`state(Running).updated_before(T)`) is timed in both. The same pages
//! are timed on fjall alone, in the store's layout (index scan + a point
//! read per item) and with records clustered by seq (one range scan).
//!
//! Memory: the binary re-executes itself with `AGENTSTATE_BENCH_CHILD` set;
//! the child only loads the big tenant and walks it with pages of 1000, and
//! reports its peak RSS (`VmHWM`). It then patches the last 1000 runs it
//! loaded and is killed (SIGKILL) as soon as the last patch has returned.
//! The parent reopens the child's store for the 1M listing timings.
//!
//! SQLite beside the big tenant (issue 13, `benches/support/sqlite.rs`):
//! a second child loads the same runs into a SQLite table (WAL; indexes
//! `(tenant, seq)` and `(tenant, state, seq)`; a ~260-byte body blob per
//! row: the record's fields without a column, in postcard), the last 1% of them and the same 1000 patches with the WAL
//! truncated first and autocheckpoint off, and is killed the same way.
//! Then, side by side: open + first read after the kill (each rep in a
//! fresh process on a fresh copy of the killed directory, ours and
//! SQLite's alternating); our page walk with SQLite's keyset walk
//! (`WHERE tenant = ? AND seq > ? ORDER BY seq LIMIT 101`) page by page,
//! twice (whole rows; and the rows built into `RunRecord`s, as ours);
//! the stale reaper (`updated_before` earlier than every write: matches
//! nothing); and, after both close cleanly, open + first read in fresh
//! processes again.
//!
//! `--only durable|listing|writers|agentstate|engines|growth` runs one part (for
//! strace and perf). With `--features sled`, the `engines` part runs fjall
//! and sled side by side under the store (`engines_section`). `AGENTSTATE_BENCH_IDS=sequential` makes run ids ascend.
//!
//! The output is a table, then one `RESULT name=value` line per figure.

use std::fs::OpenOptions;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use agentstate::{
    Durability, FileStore, Options, PageRequest, RunKey, RunRecord, RunState, StateDelta,
    StateQuery, StateStore, Usage,
};

const CHILD_ENV: &str = "AGENTSTATE_BENCH_CHILD";
const DIR_ENV: &str = "AGENTSTATE_BENCH_DIR";
/// Bytes per floor write (about one encoded run record plus its index keys).
const RECORD_BYTES: usize = 300;
/// Loader threads for the buffered bulk loads.
const LOADERS: usize = 8;

#[derive(Clone, Copy)]
struct Sizes {
    quick: bool,
    /// Ops per one-writer contender (interleaved op by op).
    ops: usize,
    /// Rounds of one writer vs eight writers.
    rounds: usize,
    /// Creates per round of the one writer, and per thread of the eight.
    ops_per_writer8: usize,
    small: usize,
    big: usize,
    /// Fresh-process reopens per contender after the kill (each of a new
    /// copy of the killed store).
    open_reps: usize,
    /// Fresh-process opens per contender after the clean close: a
    /// millisecond each, and a median of 7 moved by a third between runs.
    clean_open_reps: usize,
    /// Stale-reaper queries per contender.
    stale_reps: usize,
}

impl Sizes {
    fn new(quick: bool) -> Sizes {
        if quick {
            Sizes {
                quick,
                ops: 300,
                rounds: 6,
                ops_per_writer8: 40,
                small: 10_000,
                big: 200_000,
                open_reps: 5,
                clean_open_reps: 11,
                stale_reps: 10,
            }
        } else {
            Sizes {
                quick,
                ops: 2000,
                rounds: 12,
                ops_per_writer8: 100,
                small: 10_000,
                big: 1_000_000,
                open_reps: 7,
                clean_open_reps: 31,
                stale_reps: 15,
            }
        }
    }
}

fn main() {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        child(&spec);
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    // `--only durable` / `--only listing`: one half, for profiling.
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let sizes = Sizes::new(quick);
    let started = Instant::now();
    let base = bench_base();
    std::fs::create_dir_all(&base).expect("bench base dir");
    let tmp = tempfile::Builder::new()
        .prefix("compare-")
        .tempdir_in(&base)
        .expect("tempdir");
    let dir = tmp.path().to_path_buf();

    println!(
        "# agentstate compare ({})",
        if quick { "--quick" } else { "full" }
    );
    println!("dir: {}", dir.display());
    println!("cpus: {}, load average at start: {}", cpus(), loadavg());
    println!(
        "sizes: {} ops per one-writer contender; {} rounds of 1 writer x {} creates vs 8 writers x {} creates; listing at {} and {} runs",
        sizes.ops,
        sizes.rounds,
        sizes.ops_per_writer8,
        sizes.ops_per_writer8,
        sizes.small,
        sizes.big
    );
    println!();

    // The PostgreSQL section needs a server; it runs when asked for.
    let pg = args.iter().any(|a| a == "--pg")
        || std::env::var("AGENTSTATE_BENCH_PG").is_ok_and(|v| v == "1");
    if only.as_deref() == Some("pg") {
        run_pg(quick);
        return;
    }
    if only.as_deref() == Some("agentstate") {
        // For strace/perf: agentstate's one-writer create, put and patch only.
        let mut a = Agent::new(&dir.join("store1"));
        let (mut c, mut p, mut q) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..sizes.ops {
            timed(&mut c, || a.create(i as u64));
        }
        for i in 0..sizes.ops {
            timed(&mut p, || a.put(i));
            timed(&mut q, || a.patch(i));
        }
        println!(
            "create {:.0}/s put {:.0}/s patch {:.0}/s",
            rate(&c),
            rate(&p),
            rate(&q)
        );
        return;
    }
    #[cfg(feature = "redis")]
    if only.as_deref() == Some("redis") {
        redis_section(sizes);
        return;
    }
    #[cfg(feature = "sled")]
    if only.as_deref() == Some("engines") {
        engines_section(&dir, sizes);
        return;
    }
    if only.as_deref() == Some("growth") {
        growth::run(&dir, quick);
        return;
    }
    if only.as_deref() == Some("writers") {
        let mut d = Durable::default();
        writers(&dir, sizes, &mut d);
        println!(
            "1 writer {:.0}/s, 8 writers {:.0}/s ({:.2}x), {:.2} creates per group; bare group commit: 1 writer {:.0}/s, 8 writers {:.0}/s ({:.2}x), {:.2} appends per group",
            median(&d.writers1),
            median(&d.writers8),
            median_ratio(&d.writers8, &d.writers1),
            d.writers8_ops as f64 / d.writers8_groups.max(1) as f64,
            median(&d.bare1),
            median(&d.bare8),
            median_ratio(&d.bare8, &d.bare1),
            d.bare8_ops as f64 / d.bare8_groups.max(1) as f64
        );
        return;
    }
    let d = if only.as_deref() == Some("listing") {
        Durable::default()
    } else {
        durable(&dir, sizes)
    };
    let l = if only.as_deref() == Some("durable") {
        Listing::default()
    } else {
        listing(&dir, sizes)
    };

    let elapsed = started.elapsed();
    report(sizes, &d, &l, elapsed);
    growth::run(&dir, quick);
    #[cfg(feature = "redis")]
    redis_section(sizes);
    #[cfg(feature = "sled")]
    engines_section(&dir, sizes);
    if pg {
        run_pg(quick);
    } else {
        println!();
        println!(
            "PostgreSQL section skipped: pass --pg or set AGENTSTATE_BENCH_PG=1 (build with --features postgres)"
        );
    }
}

#[path = "support/bare_group.rs"]
mod bare_group;
#[path = "support/growth.rs"]
mod growth;
#[cfg(feature = "postgres")]
#[path = "support/pg.rs"]
mod pg_section;
// The test server's certificates (its TLS variant), unused by the bench.
#[cfg(feature = "postgres")]
#[allow(dead_code)]
#[path = "../tests/it/certs.rs"]
mod certs;
#[cfg(feature = "postgres")]
#[path = "../tests/it/pg_server.rs"]
mod pg_server;
#[path = "support/records.rs"]
mod records;
#[path = "support/sqlite.rs"]
mod sqlite_side;
use records::{ARGS, TENANT, listing_state, mix, now_ms, record, run_id};

#[cfg(feature = "postgres")]
fn run_pg(quick: bool) {
    pg_section::run(quick);
}

#[cfg(not(feature = "postgres"))]
fn run_pg(_quick: bool) {
    println!(
        "PostgreSQL section: this bench was built without the postgres feature (cargo bench --features postgres -- --pg)"
    );
}

// ---------------------------------------------------------------------------
// Redis

/// The Redis backend beside the others, when `AGENTSTATE_BENCH_REDIS_URL`
/// names a server (run with `--features redis`; a server with
/// `appendfsync always`, or the numbers mean nothing for durability):
/// 1 writer create/put/patch, 8 writers creating, and the reaper's first
/// page at 100k runs (`AGENTSTATE_BENCH_REDIS_RUNS` to change).
#[cfg(feature = "redis")]
fn redis_section(s: Sizes) {
    use agentstate::{RedisOptions, RedisStore, StateDelta};
    let Ok(url) = std::env::var("AGENTSTATE_BENCH_REDIS_URL") else {
        println!(
            "redis: skipped (set AGENTSTATE_BENCH_REDIS_URL to a server with appendfsync always)"
        );
        return;
    };
    let store = Arc::new(
        RedisStore::connect_with(&url, RedisOptions::new().pool_size(16))
            .expect("connect to redis"),
    );
    let run = format!("bench-{}-{}", std::process::id(), now_ms());
    println!("\n## redis ({})", store.durability());
    let n = s.ops;
    let t1 = format!("{run}-1");
    let (mut c, mut p, mut q) = (Vec::new(), Vec::new(), Vec::new());
    let mut stored = Vec::with_capacity(n);
    for i in 0..n {
        timed(&mut c, || {
            stored.push(
                store
                    .put_run(record(&t1, run_id(i as u64), RunState::Pending))
                    .expect("create"),
            )
        });
    }
    for r in stored.iter_mut() {
        let mut next = r.clone();
        next.state = RunState::Running;
        timed(&mut p, || *r = store.put_run(next).expect("put"));
        let key = r.key.clone();
        timed(&mut q, || {
            *r = store
                .patch_run(
                    &key,
                    StateDelta {
                        cost_micros: 7,
                        ..Default::default()
                    },
                )
                .expect("patch")
        });
    }
    println!(
        "1 writer: create {:.0}/s, put {:.0}/s, patch {:.0}/s ({n} each)",
        rate(&c),
        rate(&p),
        rate(&q)
    );
    let per = s.ops_per_writer8;
    let t = Instant::now();
    let handles: Vec<_> = (0..8)
        .map(|w| {
            let store = store.clone();
            let tenant = format!("{run}-8w{w}");
            std::thread::spawn(move || {
                for i in 0..per as u64 {
                    store
                        .put_run(record(&tenant, run_id(i), RunState::Pending))
                        .expect("create");
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("writer");
    }
    println!(
        "8 writers: create {:.0}/s ({} each)",
        per_sec(8 * per, t.elapsed()),
        per
    );
    let runs: u64 = std::env::var("AGENTSTATE_BENCH_REDIS_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let tenant = format!("{run}-reaper");
    let t = Instant::now();
    let handles: Vec<_> = (0..8u64)
        .map(|w| {
            let store = store.clone();
            let tenant = tenant.clone();
            std::thread::spawn(move || {
                let mut i = w;
                while i < runs {
                    store
                        .put_run(record(&tenant, run_id(i), listing_state(i)))
                        .expect("load");
                    i += 8;
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("loader");
    }
    let load = t.elapsed();
    let q = StateQuery::new(&tenant)
        .state(RunState::Running)
        .updated_before(now_ms() + 3_600_000);
    let mut first = Vec::new();
    for _ in 0..20 {
        let t = Instant::now();
        let page = store
            .list_runs(&q, &PageRequest::new(100))
            .expect("reaper page");
        first.push(t.elapsed().as_secs_f64() * 1e6);
        std::hint::black_box(page);
    }
    let st = stats(first);
    println!(
        "reaper first page (100 running runs) at {runs} runs: median {:.0} us, p90 {:.0} us (loaded in {:.1} s)",
        st.median_us,
        st.p90_us,
        load.as_secs_f64()
    );
}

// ---------------------------------------------------------------------------
// Records

// ---------------------------------------------------------------------------
// Durable writes
//
// One-writer contenders are interleaved op by op (a floor write, a SQLite
// insert, a fjall batch, an agentstate create, the next floor write, …) so
// each sees the same disk at the same moment; a contender's rate is its op
// count over the sum of its own op times. The 8-writer figure alternates
// short rounds of one writer and of eight writers on the same store.

#[derive(Default)]
struct Durable {
    /// Per-op latencies (µs), phase A (creates).
    floor: Vec<f64>,
    floor_prealloc: Vec<f64>,
    sqlite_create: Vec<f64>,
    fjall: Vec<f64>,
    create: Vec<f64>,
    create_plain: Vec<f64>,
    /// Per-op latencies (µs), phase B (updates).
    floor_b: Vec<f64>,
    sqlite_update: Vec<f64>,
    put: Vec<f64>,
    patch: Vec<f64>,
    /// Per-round rates (ops/s), phase C.
    writers1: Vec<f64>,
    writers8: Vec<f64>,
    /// agentstate groups committed by the 8-writer creates, and creates.
    writers8_groups: u64,
    writers8_ops: u64,
    /// Per-round rates (ops/s) of the bare group commit (the ceiling of
    /// `writers8_vs_writers1`: `support/bare_group.rs`), one writer and
    /// eight, in the same rounds; and the eight's groups and appends.
    bare1: Vec<f64>,
    bare8: Vec<f64>,
    bare8_groups: u64,
    bare8_ops: u64,
    /// µs per `Scrubber::scrub_run` of the bench record, and per create on
    /// the memory store.
    scrub_us: f64,
    memory_create_us: f64,
}

/// ops/s from per-op latencies in µs.
fn rate(lat: &[f64]) -> f64 {
    if lat.is_empty() {
        return f64::NAN;
    }
    lat.len() as f64 * 1e6 / lat.iter().sum::<f64>()
}

fn timed(lat: &mut Vec<f64>, f: impl FnOnce()) {
    let t = Instant::now();
    f();
    lat.push(t.elapsed().as_secs_f64() * 1e6);
}

fn durable(dir: &Path, s: Sizes) -> Durable {
    let mut d = Durable::default();
    let n = s.ops;

    // Phase A: creates.
    let mut floor = Floor::new(&dir.join("floor.log"));
    let mut prealloc = Prealloc::new(&dir.join("floor-prealloc.log"), n);
    let mut sqlite = Sqlite::new(&dir.join("sqlite.db"));
    let mut fjall = FjallRaw::new(&dir.join("fjall"));
    let mut agent = Agent::new(&dir.join("store1"));
    let plain = FileStore::open(dir.join("store1-plain")).expect("store open");
    for i in 0..n as u64 {
        // Rotate the order every op, so each contender follows each other
        // one equally often (a sync can pay for what the one before left).
        for k in 0..6 {
            match (i as usize + k) % 6 {
                0 => timed(&mut d.floor, || floor.op()),
                1 => timed(&mut d.floor_prealloc, || prealloc.op()),
                2 => timed(&mut d.sqlite_create, || sqlite.insert(i)),
                3 => timed(&mut d.fjall, || fjall.op(i)),
                4 => timed(&mut d.create, || agent.create(i)),
                _ => timed(&mut d.create_plain, || {
                    // The same create without a pending tool call: nothing
                    // for the scrubber to parse.
                    let mut r = record(TENANT, run_id(i), RunState::Pending);
                    r.pending_tool_calls.clear();
                    plain.put_run(r).expect("create");
                }),
            }
        }
        if (i + 1) % (n as u64 / 4).max(1) == 0 {
            eprintln!("creates {}/{n} (load {})", i + 1, loadavg());
        }
    }
    drop((fjall, plain));

    // Phase B: version-checked updates and patches of the runs just made.
    for i in 0..n {
        for k in 0..4 {
            match (i + k) % 4 {
                0 => timed(&mut d.floor_b, || floor.op()),
                1 => timed(&mut d.sqlite_update, || sqlite.update(i as u64)),
                2 => timed(&mut d.put, || agent.put(i)),
                _ => timed(&mut d.patch, || agent.patch(i)),
            }
        }
    }
    eprintln!("updates {n}/{n} (load {})", loadavg());
    drop((floor, prealloc, sqlite, agent));

    writers(dir, s, &mut d);
    cpu_path(s, &mut d);
    d
}

/// The CPU a create costs without any disk: the scrubber alone, a create on
/// the memory store, and a buffered create on the file store.
fn cpu_path(s: Sizes, d: &mut Durable) {
    let n = s.ops * 10;
    let scrubber = agentstate::Scrubber::default();
    let r = record(TENANT, run_id(0), RunState::Pending);
    let t = Instant::now();
    for _ in 0..n {
        std::hint::black_box(scrubber.scrub_run(std::hint::black_box(&r)));
    }
    d.scrub_us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
    let mem = agentstate::MemoryStore::new();
    let t = Instant::now();
    for i in 0..n as u64 {
        mem.put_run(record(TENANT, run_id(i), RunState::Pending))
            .expect("create");
    }
    d.memory_create_us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
}

/// Phase C: one writer, then eight, in alternating short rounds.
fn writers(dir: &Path, s: Sizes, d: &mut Durable) {
    let store = Arc::new(FileStore::open(dir.join("store8")).expect("store open"));
    for round in 0..s.rounds {
        let tenant = format!("solo{round}");
        let per1 = s.ops_per_writer8;
        let t = Instant::now();
        for i in 0..per1 as u64 {
            store
                .put_run(record(&tenant, run_id(i), RunState::Pending))
                .expect("create");
        }
        d.writers1.push(per_sec(per1, t.elapsed()));
        let (w, groups, ops) = agentstate_writers(&store, round, 8, s.ops_per_writer8);
        d.writers8.push(w);
        d.writers8_groups += groups;
        d.writers8_ops += ops;
        // The same round on the bare group commit: one writer, then eight.
        let bare = dir.join(format!("bare{round}"));
        std::fs::create_dir_all(&bare).expect("bare dir");
        d.bare1.push(bare_group::run(&bare, 1, per1).0);
        let (b8, bare_groups) = bare_group::run(&bare, 8, s.ops_per_writer8);
        d.bare8.push(b8);
        d.bare8_groups += bare_groups;
        d.bare8_ops += 8 * s.ops_per_writer8 as u64;
        std::fs::remove_dir_all(&bare).expect("remove bare dir");
    }
    eprintln!("writers: {} rounds (load {})", s.rounds, loadavg());
}

fn per_sec(n: usize, t: Duration) -> f64 {
    n as f64 / t.as_secs_f64()
}

/// Append + fdatasync per op.
struct Floor {
    f: std::fs::File,
    buf: [u8; RECORD_BYTES],
}

impl Floor {
    fn new(path: &Path) -> Floor {
        let f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .expect("floor file");
        Floor {
            f,
            buf: [b'r'; RECORD_BYTES],
        }
    }
    fn op(&mut self) {
        self.f.write_all(&self.buf).expect("floor write");
        self.f.sync_data().expect("floor sync");
    }
}

/// Overwrite + fdatasync per op in a file written and synced beforehand:
/// no block allocation or size change to journal, so the cheapest sync the
/// disk offers (a journal that preallocates, as fjall's does, gets near it).
struct Prealloc {
    f: std::fs::File,
    off: u64,
    buf: [u8; RECORD_BYTES],
}

impl Prealloc {
    fn new(path: &Path, n: usize) -> Prealloc {
        use std::os::unix::fs::FileExt;
        let f = OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(path)
            .expect("floor file");
        f.write_all_at(&vec![0u8; n * RECORD_BYTES], 0)
            .expect("prefill");
        f.sync_all().expect("prefill sync");
        Prealloc {
            f,
            off: 0,
            buf: [b'r'; RECORD_BYTES],
        }
    }
    fn op(&mut self) {
        use std::os::unix::fs::FileExt;
        self.f
            .write_all_at(&self.buf, self.off)
            .expect("floor write");
        self.f.sync_data().expect("floor sync");
        self.off += RECORD_BYTES as u64;
    }
}

/// SQLite in WAL mode with synchronous=FULL.
struct Sqlite {
    conn: rusqlite::Connection,
    body: Vec<u8>,
}

impl Sqlite {
    fn new(path: &Path) -> Sqlite {
        let conn = rusqlite::Connection::open(path).expect("sqlite open");
        let mode: String = conn
            .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
            .expect("wal");
        assert_eq!(mode.to_lowercase(), "wal");
        conn.execute_batch(&format!(
            "PRAGMA synchronous=FULL; {}
             CREATE INDEX runs_by_session ON runs(tenant, session_id, seq) WHERE session_id IS NOT NULL;",
            sqlite_side::RUNS_SCHEMA
        ))
        .expect("sqlite schema");
        Sqlite {
            conn,
            body: body_bytes(),
        }
    }

    /// The run row (and SQLite's three index rows) in one transaction.
    fn insert(&mut self, i: u64) {
        let tx = self.conn.transaction().expect("begin");
        tx.prepare_cached(
            "INSERT INTO runs(tenant, run_id, version, state, session_id, updated_at, body)
             VALUES (?1, ?2, 1, ?3, NULL, ?4, ?5)",
        )
        .expect("prepare")
        .execute(rusqlite::params![
            TENANT,
            run_id(i),
            0,
            now_ms() as i64,
            &self.body
        ])
        .expect("insert");
        tx.commit().expect("commit");
    }

    /// A version-checked update (state change, so an index row moves too).
    fn update(&mut self, i: u64) {
        let tx = self.conn.transaction().expect("begin");
        let changed = tx
            .prepare_cached(
                "UPDATE runs SET version = version + 1, state = ?1, updated_at = ?2, body = ?3
                 WHERE tenant = ?4 AND run_id = ?5 AND version = ?6",
            )
            .expect("prepare")
            .execute(rusqlite::params![
                1,
                now_ms() as i64,
                &self.body,
                TENANT,
                run_id(i),
                1
            ])
            .expect("update");
        assert_eq!(changed, 1, "version check");
        tx.commit().expect("commit");
    }
}

fn body_bytes() -> Vec<u8> {
    let mut b = ARGS.as_bytes().to_vec();
    b.resize(RECORD_BYTES - 40, b' ');
    b
}

/// fjall alone: one batch of the run and two index entries, synced, per op.
struct FjallRaw {
    db: fjall::Database,
    ks: fjall::Keyspace,
    value: Vec<u8>,
}

impl FjallRaw {
    fn new(path: &Path) -> FjallRaw {
        let db = fjall::Database::builder(path)
            .manual_journal_persist(true)
            .open()
            .expect("fjall open");
        let ks = db
            .keyspace("bench", fjall::KeyspaceCreateOptions::default)
            .expect("keyspace");
        FjallRaw {
            db,
            ks,
            value: body_bytes(),
        }
    }
    fn op(&mut self, i: u64) {
        let id = run_id(i);
        let mut run_key = b"r\0acme\0".to_vec();
        run_key.extend_from_slice(id.as_bytes());
        let mut seq_key = b"q\0acme\0".to_vec();
        seq_key.extend_from_slice(&i.to_be_bytes());
        let mut state_key = b"s\0acme\0\x01".to_vec();
        state_key.extend_from_slice(&i.to_be_bytes());
        let mut b = self
            .db
            .batch()
            .durability(Some(fjall::PersistMode::SyncData));
        b.insert(&self.ks, run_key, self.value.clone());
        b.insert(&self.ks, seq_key, id.as_bytes().to_vec());
        b.insert(&self.ks, state_key, id.as_bytes().to_vec());
        b.commit().expect("fjall commit");
    }
}

/// agentstate, one writer, `Durability::Immediate`.
struct Agent {
    store: FileStore,
    runs: Vec<RunRecord>,
}

impl Agent {
    fn new(path: &Path) -> Agent {
        Agent {
            store: FileStore::open(path).expect("store open"),
            runs: Vec::new(),
        }
    }
    fn create(&mut self, i: u64) {
        let r = self
            .store
            .put_run(record(TENANT, run_id(i), RunState::Pending))
            .expect("create");
        self.runs.push(r);
    }
    /// A version-checked put that moves the run to `Running`.
    fn put(&mut self, i: usize) {
        let mut next = self.runs[i].clone();
        next.state = RunState::Running;
        self.runs[i] = self.store.put_run(next).expect("versioned put");
    }
    fn patch(&mut self, i: usize) {
        let delta = StateDelta {
            usage: Usage {
                input_tokens: 1200,
                output_tokens: 300,
            },
            cost_micros: 4_500,
            iterations: 1,
            messages_read: 2,
        };
        // Keep the version a later put states current.
        self.runs[i] = self
            .store
            .patch_run(&self.runs[i].key, delta)
            .expect("patch");
    }
}

/// `writers` threads each creating `per` runs of their own tenant; returns
/// ops/s, groups committed and creates.
fn agentstate_writers(
    store: &Arc<FileStore>,
    round: usize,
    writers: usize,
    per: usize,
) -> (f64, u64, u64) {
    let before = store.commits();
    let barrier = Arc::new(Barrier::new(writers + 1));
    let handles: Vec<_> = (0..writers)
        .map(|w| {
            let store = store.clone();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let tenant = format!("r{round}w{w}");
                barrier.wait();
                for i in 0..per as u64 {
                    store
                        .put_run(record(&tenant, run_id(i), RunState::Pending))
                        .expect("create");
                }
            })
        })
        .collect();
    barrier.wait();
    let t = Instant::now();
    for h in handles {
        h.join().expect("writer");
    }
    let elapsed = t.elapsed();
    let n = writers * per;
    (per_sec(n, elapsed), store.commits() - before, n as u64)
}

// ---------------------------------------------------------------------------
// Listing

#[derive(Default)]
struct Listing {
    page_small: Stats,
    page_big: Stats,
    page_big_first: Stats,
    reaper_big_first: Stats,
    reaper_small: Stats,
    reaper_big: Stats,
    small_load_s: f64,
    child: ChildReport,
    /// fjall alone, small and big: index scan + a point read per item, and
    /// a scan of records clustered by seq.
    engine_small: EnginePages,
    engine_big: EnginePages,
    /// SQLite's keyset page of the same runs, timed beside `page_big`:
    /// whole rows (columns and the body copied out), and the same rows
    /// built into the `RunRecord`s our page returns.
    page_sqlite: Stats,
    page_sqlite_records: Stats,
    sqlite_plan: String,
    sqlite_load_s: f64,
    /// The stale reaper at the big size (µs to learn that nothing
    /// matches: the sum of the requests it takes), and SQLite's.
    stale: Stats,
    stale_requests: usize,
    stale_sqlite: Stats,
    /// Open + first read in a fresh process (µs), after the clean close
    /// and after the kill.
    open_ours: Stats,
    open_sqlite: Stats,
    kill_ours: Stats,
    kill_sqlite: Stats,
    /// At the kill: our journal files, SQLite's WAL.
    journal_bytes: u64,
    sqlite_wal_bytes: u64,
}

#[derive(Default)]
struct EnginePages {
    indexed: Stats,
    clustered: Stats,
}

#[derive(Clone, Copy, Default)]
struct Stats {
    median_us: f64,
    p90_us: f64,
    mean_us: f64,
    pages: usize,
}

fn stats(mut v: Vec<f64>) -> Stats {
    if v.is_empty() {
        return Stats::default();
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    Stats {
        median_us: pct(&v, 0.5),
        p90_us: pct(&v, 0.9),
        mean_us: mean,
        pages: v.len(),
    }
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    pct(&v, 0.5)
}

/// The median of the round-by-round ratios `a[i] / b[i]`.
fn median_ratio(a: &[f64], b: &[f64]) -> f64 {
    median(&a.iter().zip(b).map(|(x, y)| x / y).collect::<Vec<_>>())
}

fn buffered() -> Options {
    Options::new().durability(Durability::Buffered)
}

/// Loads `n` runs into tenant `TENANT` from `LOADERS` threads.
fn load(store: &Arc<FileStore>, n: u64) {
    let handles: Vec<_> = (0..LOADERS as u64)
        .map(|w| {
            let store = store.clone();
            std::thread::spawn(move || {
                let mut i = w;
                while i < n {
                    store
                        .put_run(record(TENANT, run_id(i), listing_state(i)))
                        .expect("load");
                    i += LOADERS as u64;
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("loader");
    }
}

/// Walks a query page by page, `limit` runs a page; returns per-page times
/// (µs) and items seen.
fn walk(store: &FileStore, q: StateQuery, limit: usize) -> (Vec<f64>, usize) {
    let mut times = Vec::new();
    let mut seen = 0;
    let mut page = PageRequest::new(limit);
    loop {
        let t = Instant::now();
        let got = store.list_runs(&q, &page).expect("list");
        times.push(t.elapsed().as_secs_f64() * 1e6);
        let (items, cursor) = got.into_parts();
        seen += items.len();
        std::hint::black_box(&items);
        match cursor {
            Some(c) => page = page.with_cursor(Some(c)),
            None => break,
        }
    }
    (times, seen)
}

fn reaper_query() -> StateQuery {
    // Every running run was written before this moment.
    StateQuery::new(TENANT)
        .state(RunState::Running)
        .updated_before(now_ms() + 3_600_000)
}

fn listing(dir: &Path, s: Sizes) -> Listing {
    // The small tenant, in this process.
    let small_dir = dir.join("list-small");
    let t = Instant::now();
    let small = Arc::new(FileStore::open_with(&small_dir, buffered()).expect("open small"));
    load(&small, s.small as u64);
    let small_load_s = t.elapsed().as_secs_f64();
    let mut page_small = Vec::new();
    let mut reaper_small = Vec::new();
    // Repeat the small walks so both sizes time about as many pages.
    let reps = (s.big / s.small).max(1);
    for _ in 0..reps {
        let (t, seen) = walk(&small, StateQuery::new(TENANT), 100);
        assert_eq!(seen, s.small);
        page_small.extend(t);
        let (t, seen) = walk(&small, reaper_query(), 100);
        assert_eq!(seen, s.small.div_ceil(100));
        reaper_small.extend(t);
    }
    drop(small);

    // The big tenant: loaded and walked by a child (peak RSS), which then
    // patches its last runs and is killed right after the last one returned.
    let big_dir = dir.join("list-big");
    // Every run of either big load is written after this moment.
    let before_loads = now_ms() - 1;
    eprintln!("loading {} runs in a child process…", s.big);
    let child = run_child(&big_dir, s.big);
    // The same runs into SQLite, by a child killed with them in its WAL.
    let sqlite_dir = dir.join("sqlite-big");
    eprintln!("loading {} runs into SQLite in a child process…", s.big);
    let phase = Instant::now();
    let sqlite_load = killed_child(&format!(
        "sqlite-load\t{}\t{KILL_PATCHES}\t{}",
        s.big,
        sqlite_dir.display()
    ));
    let sqlite_load_s: f64 = sqlite_load.get("load_s").parse().expect("load_s");
    let sqlite_wal_bytes: u64 = sqlite_load.get("wal_bytes").parse().expect("wal_bytes");
    let sqlite_last = LastAck::parse(sqlite_load.get("last_ack"));
    eprintln!("  … {:.1} s", phase.elapsed().as_secs_f64());
    let phase = Instant::now();
    assert_eq!(
        sqlite_last.id, child.last.id,
        "both patch the same run last"
    );

    // Reopen after the kills: open + first read (the last acknowledged
    // write) in a fresh process, each time on a fresh copy of the killed
    // directory; ours and SQLite's alternate.
    let journal_bytes = files_bytes(&big_dir, ".jnl");
    eprintln!(
        "reopening after kill -9 ({} reps each; journal {:.1} MiB, WAL {:.1} MiB)…",
        s.open_reps,
        journal_bytes as f64 / MIB,
        sqlite_wal_bytes as f64 / MIB
    );
    let (mut kill_ours, mut kill_sqlite) = (Vec::new(), Vec::new());
    let rep_dir = dir.join("reopen-rep");
    for _ in 0..s.open_reps {
        for (src, kind, last, out) in [
            (&big_dir, "open-ours", &child.last, &mut kill_ours),
            (&sqlite_dir, "open-sqlite", &sqlite_last, &mut kill_sqlite),
        ] {
            let _ = std::fs::remove_dir_all(&rep_dir);
            copy_dir(src, &rep_dir);
            out.push(timed_open(kind, &rep_dir, last));
        }
    }
    let _ = std::fs::remove_dir_all(&rep_dir);
    eprintln!("  … {:.1} s", phase.elapsed().as_secs_f64());

    eprintln!("walking {} runs beside SQLite; stale reaper…", s.big);
    let phase = Instant::now();
    let big = FileStore::open_with(&big_dir, buffered()).expect("reopen big");
    let sqlite = sqlite_side::Pager::open(&sqlite_dir);
    let sqlite_plan = sqlite.plan();
    // Two walks: the first runs while fjall may still flush and compact
    // what the reopen recovered; the second is the figure, SQLite's page
    // after the same page of ours, page by page.
    let (first, seen) = walk(&big, StateQuery::new(TENANT), 100);
    assert_eq!(seen, s.big);
    let (reaper_first, _) = walk(&big, reaper_query(), 100);
    let (page_big, page_sqlite, page_sqlite_records, seen) = walk_beside_sqlite(&big, &sqlite);
    assert_eq!(seen, (s.big, s.big, s.big));
    let (reaper_big, seen) = walk(&big, reaper_query(), 100);
    assert_eq!(seen, s.big.div_ceil(100));
    // The stale reaper: running runs last written before any run was.
    let (mut stale, mut stale_sqlite, mut stale_requests) = (Vec::new(), Vec::new(), 0);
    for _ in 0..s.stale_reps {
        let q = StateQuery::new(TENANT)
            .state(RunState::Running)
            .updated_before(before_loads);
        let (t, seen) = walk(&big, q, 100);
        assert_eq!(seen, 0, "nothing is that stale");
        stale_requests = t.len();
        stale.push(t.iter().sum::<f64>());
        let t = Instant::now();
        let rows = sqlite.stale(before_loads);
        stale_sqlite.push(t.elapsed().as_secs_f64() * 1e6);
        assert!(rows.is_empty(), "nothing is that stale in SQLite either");
    }
    eprintln!("  … {:.1} s", phase.elapsed().as_secs_f64());
    // Clean closes: ours drops the store, SQLite's last connection
    // checkpoints its WAL into the database file and removes it.
    drop(big);
    drop(sqlite);

    // Open + first read after the clean close, in fresh processes, alternating.
    eprintln!(
        "opening after a clean close ({} reps each)…",
        s.clean_open_reps
    );
    let phase = Instant::now();
    let mid = ReadBack {
        id: run_id(s.big as u64 / 2),
        version: 1,
    };
    let (mut open_ours, mut open_sqlite) = (Vec::new(), Vec::new());
    for _ in 0..s.clean_open_reps {
        open_ours.push(timed_open("open-ours", &big_dir, &mid));
        open_sqlite.push(timed_open("open-sqlite", &sqlite_dir, &mid));
    }
    eprintln!("  … {:.1} s", phase.elapsed().as_secs_f64());

    eprintln!("fjall alone: {} and {} records…", s.small, s.big);
    let engine_small = engine_pages(&dir.join("engine-small"), s.small as u64);
    let engine_big = engine_pages(&dir.join("engine-big"), s.big as u64);

    Listing {
        page_small: stats(page_small),
        page_big: stats(page_big),
        page_big_first: stats(first),
        reaper_big_first: stats(reaper_first),
        reaper_small: stats(reaper_small),
        reaper_big: stats(reaper_big),
        small_load_s,
        child: child.report,
        engine_small,
        engine_big,
        page_sqlite: stats(page_sqlite),
        page_sqlite_records: stats(page_sqlite_records),
        sqlite_plan,
        sqlite_load_s,
        stale: stats(stale),
        stale_requests,
        stale_sqlite: stats(stale_sqlite),
        open_ours: stats(open_ours),
        open_sqlite: stats(open_sqlite),
        kill_ours: stats(kill_ours),
        kill_sqlite: stats(kill_sqlite),
        journal_bytes,
        sqlite_wal_bytes,
    }
}

const MIB: f64 = 1024.0 * 1024.0;

/// Runs the big-tenant child patches at the end of its writes (the last
/// runs it loaded, one patch each), and so does the SQLite child: the
/// last acknowledged write a reopen after the kill must read back.
const KILL_PATCHES: u64 = 1000;

/// Our page walk with SQLite's keyset walks of the same runs: SQLite's
/// page i (whole rows), then the same page built into `RunRecord`s, right
/// after our page i. Returns the three page times (µs) and the runs each
/// walk saw.
/// Page times (µs) of one walk beside SQLite: ours, SQLite's whole rows,
/// SQLite's records; and the runs each walk saw.
type BesideSqlite = (Vec<f64>, Vec<f64>, Vec<f64>, (usize, usize, usize));

fn walk_beside_sqlite(store: &FileStore, sqlite: &sqlite_side::Pager) -> BesideSqlite {
    let (mut ours, mut theirs, mut records) = (Vec::new(), Vec::new(), Vec::new());
    let (mut seen, mut seen_sqlite, mut seen_records) = (0, 0, 0);
    let mut page = Some(PageRequest::new(100));
    let mut after = Some(0i64);
    let mut after_records = Some(0i64);
    while page.is_some() || after.is_some() || after_records.is_some() {
        if let Some(p) = page.take() {
            let t = Instant::now();
            let got = store.list_runs(&StateQuery::new(TENANT), &p).expect("list");
            ours.push(t.elapsed().as_secs_f64() * 1e6);
            let (items, cursor) = got.into_parts();
            seen += items.len();
            std::hint::black_box(&items);
            page = cursor.map(|c| p.with_cursor(Some(c)));
        }
        if let Some(a) = after.take() {
            let t = Instant::now();
            let (rows, next) = sqlite.page(a);
            theirs.push(t.elapsed().as_secs_f64() * 1e6);
            seen_sqlite += rows.len();
            std::hint::black_box(&rows);
            after = next;
        }
        if let Some(a) = after_records.take() {
            let t = Instant::now();
            let (rows, next) = sqlite.page_records(a);
            records.push(t.elapsed().as_secs_f64() * 1e6);
            seen_records += rows.len();
            std::hint::black_box(&rows);
            after_records = next;
        }
    }
    (ours, theirs, records, (seen, seen_sqlite, seen_records))
}

/// The run a reopen reads first, and the version it must find.
struct ReadBack {
    id: String,
    version: u64,
}

type LastAck = ReadBack;

impl ReadBack {
    /// `<run id> <version>`, as a child prints its last acknowledged write.
    fn parse(v: &str) -> ReadBack {
        let (id, version) = v.split_once(' ').expect("last_ack: id version");
        ReadBack {
            id: id.to_string(),
            version: version.parse().expect("last_ack version"),
        }
    }
}

/// One open + first read in a fresh process (`kind`: `open-ours` or
/// `open-sqlite`): the child's own time for both (µs), after checking it
/// read the expected version.
fn timed_open(kind: &str, dir: &Path, read: &ReadBack) -> f64 {
    let out = exited_child(&format!("{kind}\t{}\t{}", dir.display(), read.id));
    let version: u64 = out.get("version").parse().expect("version");
    assert_eq!(
        version, read.version,
        "{kind}: the first read after the reopen found another version"
    );
    out.get("total_us").parse().expect("total_us")
}

/// Bytes of journal data in the files under `dir` whose names end with
/// `suffix`: each up to its last byte that is not zero (fjall sizes a new
/// journal to 64 MiB sparsely, and ours start in a file of written zeros:
/// neither its length nor its blocks say how much was written).
fn files_bytes(dir: &Path, suffix: &str) -> u64 {
    let mut total = 0;
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let Ok(m) = e.metadata() else { continue };
        if m.is_dir() {
            total += files_bytes(&e.path(), suffix);
        } else if e.file_name().to_string_lossy().ends_with(suffix) {
            let bytes = std::fs::read(e.path()).unwrap_or_default();
            total += bytes.iter().rposition(|&b| b != 0).map_or(0, |p| p + 1) as u64;
        }
    }
    total
}

/// Copies the directory tree `from` to `to` (files, not links), holes
/// kept as holes: fjall sizes a journal to 64 MiB sparsely, and a plain
/// copy would write those zeros out, which the reopen's cut of the
/// journal's tail then has to free (about 50 ms at 200k runs) — a cost of
/// the copy, not of a reopen after a real kill.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("copy: create dir");
    for e in std::fs::read_dir(from).expect("copy: read dir") {
        let e = e.expect("copy: entry");
        let target = to.join(e.file_name());
        if e.file_type().expect("copy: file type").is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            copy_sparse(&e.path(), &target);
        }
    }
}

/// Copies the data extents of `from` (`SEEK_DATA`/`SEEK_HOLE`) into a file
/// of the same length at `to`.
fn copy_sparse(from: &Path, to: &Path) {
    use std::os::unix::fs::FileExt as _;
    use std::os::unix::io::AsRawFd as _;
    let src = std::fs::File::open(from).expect("copy: open");
    let len = src.metadata().expect("copy: metadata").len();
    let dst = std::fs::File::create(to).expect("copy: create");
    dst.set_len(len).expect("copy: set_len");
    let fd = src.as_raw_fd();
    let mut buf = vec![0u8; 1 << 20];
    let mut pos = 0u64;
    while pos < len {
        // SAFETY: lseek on a descriptor this function owns; no memory is passed.
        let data = unsafe { libc::lseek(fd, pos as libc::off_t, libc::SEEK_DATA) };
        if data < 0 {
            break; // ENXIO: only a hole is left
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        let (mut at, end) = (data as u64, (hole.max(data) as u64).min(len));
        while at < end {
            let n = buf.len().min((end - at) as usize);
            src.read_exact_at(&mut buf[..n], at).expect("copy: read");
            dst.write_all_at(&buf[..n], at).expect("copy: write");
            at += n as u64;
        }
        pos = end.max(pos + 1);
    }
}

/// fjall alone, with the 32 MiB cache the store's engine uses: `n` records
/// under their run id plus a seq index (the store's layout), and the same
/// records again clustered under their seq. Times pages of 100 starting at
/// random seqs: (index scan + one point read per item, clustered scan).
fn engine_pages(path: &Path, n: u64) -> EnginePages {
    use fjall::{Database, KeyspaceCreateOptions, PersistMode};
    let open = |name: &str| {
        let db = Database::builder(path.join(name))
            .manual_journal_persist(true)
            .cache_size(32 * 1024 * 1024)
            .open()
            .expect("fjall open");
        let ks = db
            .keyspace("bench", KeyspaceCreateOptions::default)
            .expect("keyspace");
        (db, ks)
    };
    // `layout`: the store's (record under run id + seq index); `clustered`:
    // the record under its seq. Separate databases, 32 MiB of cache each.
    let (db, ks) = open("layout");
    let (cdb, cks) = open("clustered");
    let value = body_bytes();
    let run_key = |id: &str| [b"r\0acme\0".as_slice(), id.as_bytes()].concat();
    let seq_key = |p: &[u8], i: u64| [p, &i.to_be_bytes()].concat();
    let mut i = 0;
    while i < n {
        let mut b = db.batch().durability(Some(PersistMode::Buffer));
        let mut c = cdb.batch().durability(Some(PersistMode::Buffer));
        for j in i..(i + 1000).min(n) {
            let id = run_id(j);
            b.insert(&ks, run_key(&id), value.clone());
            b.insert(&ks, seq_key(b"q\0acme\0", j), id.into_bytes());
            c.insert(&cks, seq_key(b"c\0acme\0", j), value.clone());
        }
        b.commit().expect("fjall load");
        c.commit().expect("fjall load");
        i += 1000;
    }
    let samples = 2000;
    let (mut indexed, mut clustered) = (Vec::with_capacity(samples), Vec::with_capacity(samples));
    for k in 0..samples as u64 {
        let start = mix(k) % n.saturating_sub(101).max(1);
        let t = Instant::now();
        let mut got = 0;
        for kv in ks
            .range(seq_key(b"q\0acme\0", start)..seq_key(b"q\0acme\0", u64::MAX))
            .take(101)
        {
            let (_, id) = kv.into_inner().expect("scan");
            let v = ks
                .get(run_key(std::str::from_utf8(&id).expect("id")))
                .expect("get")
                .expect("present");
            got += v.len();
        }
        indexed.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        for kv in cks
            .range(seq_key(b"c\0acme\0", start)..seq_key(b"c\0acme\0", u64::MAX))
            .take(101)
        {
            let (_, v) = kv.into_inner().expect("scan");
            got += v.len();
        }
        clustered.push(t.elapsed().as_secs_f64() * 1e6);
        std::hint::black_box(got);
    }
    EnginePages {
        indexed: stats(indexed),
        clustered: stats(clustered),
    }
}

// ---------------------------------------------------------------------------
// The children
//
// The binary re-executes itself with `AGENTSTATE_BENCH_CHILD` set to a
// tab-separated spec; a child prints `CHILD key=value` lines.

#[derive(Default)]
struct ChildReport {
    load_s: f64,
    walk_s: f64,
    hwm_after_load_kib: u64,
    hwm_kib: u64,
}

/// A child's `CHILD key=value` lines.
struct ChildLines(Vec<(String, String)>);

impl ChildLines {
    fn get(&self, key: &str) -> &str {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .unwrap_or_else(|| panic!("child printed no {key}"))
    }
}

fn child_command(spec: &str) -> Command {
    let exe = std::env::current_exe().expect("current exe");
    let mut c = Command::new(exe);
    c.env(CHILD_ENV, spec);
    c
}

/// Runs a child to its end.
fn exited_child(spec: &str) -> ChildLines {
    let out = child_command(spec).output().expect("spawn child");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child {spec:?} failed: {}\n{}",
        text,
        String::from_utf8_lossy(&out.stderr)
    );
    ChildLines(child_lines(text.lines()))
}

fn child_lines<'a>(lines: impl Iterator<Item = &'a str>) -> Vec<(String, String)> {
    lines
        .filter_map(|l| l.strip_prefix("CHILD ")?.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Runs a child until it prints `CHILD last_ack=…` (its last write
/// returned), then kills it (SIGKILL) at once.
fn killed_child(spec: &str) -> ChildLines {
    use std::io::BufRead as _;
    use std::process::Stdio;
    let mut c = child_command(spec)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn child");
    let out = std::io::BufReader::new(c.stdout.take().expect("child stdout"));
    let mut text = Vec::new();
    for line in out.lines() {
        let line = line.expect("child stdout");
        let last = line.starts_with("CHILD last_ack=");
        text.push(line);
        if last {
            c.kill().expect("kill child");
            break;
        }
    }
    let status = c.wait().expect("wait child");
    assert!(
        text.last()
            .is_some_and(|l| l.starts_with("CHILD last_ack=")),
        "child {spec:?} ended ({status}) before its last write: {}",
        text.join("\n")
    );
    assert!(!status.success(), "the child was killed, not closed");
    ChildLines(child_lines(text.iter().map(String::as_str)))
}

/// What a killed child waits in: until killed (or its stdin closes, when
/// the parent died).
fn wait_for_kill() {
    use std::io::Read as _;
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    std::process::exit(3);
}

/// The big-tenant child's figures and its last acknowledged write.
struct BigChild {
    report: ChildReport,
    last: LastAck,
}

fn run_child(dir: &Path, n: usize) -> BigChild {
    let out = killed_child(&format!("load\t{n}\t{KILL_PATCHES}\t{}", dir.display()));
    BigChild {
        report: ChildReport {
            load_s: out.get("load_s").parse().expect("load_s"),
            walk_s: out.get("walk_s").parse().expect("walk_s"),
            hwm_after_load_kib: out.get("hwm_after_load_kib").parse().expect("hwm"),
            hwm_kib: out.get("hwm_kib").parse().expect("hwm"),
        },
        last: LastAck::parse(out.get("last_ack")),
    }
}

fn child(spec: &str) {
    let f: Vec<&str> = spec.split('\t').collect();
    match f.as_slice() {
        ["load", n, patches, dir] => big_child(
            n.parse().expect("n"),
            patches.parse().expect("patches"),
            dir,
        ),
        ["sqlite-load", n, patches, dir] => sqlite_side::load_child(
            n.parse().expect("n"),
            patches.parse().expect("patches"),
            Path::new(dir),
        ),
        ["open-ours", dir, id] => open_child(Path::new(dir), id),
        ["open-sqlite", dir, id] => sqlite_side::open_child(Path::new(dir), id),
        _ => panic!("unknown child spec {spec:?}"),
    }
}

/// Child: load `n` runs (buffered), walk them all with pages of 1000, report
/// peak RSS; then patch the last `patches` runs loaded and wait to be
/// killed right after the last patch returned.
fn big_child(n: u64, patches: u64, dir: &str) {
    let t = Instant::now();
    let store = Arc::new(FileStore::open_with(dir, buffered()).expect("child open"));
    load(&store, n);
    println!("CHILD load_s={:.3}", t.elapsed().as_secs_f64());
    println!("CHILD hwm_after_load_kib={}", vm_hwm_kib());
    let t = Instant::now();
    let (_, seen) = walk(&store, StateQuery::new(TENANT), 1000);
    assert_eq!(seen as u64, n);
    println!("CHILD walk_s={:.3}", t.elapsed().as_secs_f64());
    println!("CHILD hwm_kib={}", vm_hwm_kib());
    let mut last = None;
    for i in n.saturating_sub(patches)..n {
        let key = RunKey::new(TENANT, run_id(i));
        let r = store
            .patch_run(
                &key,
                StateDelta {
                    cost_micros: 1,
                    ..Default::default()
                },
            )
            .expect("patch");
        last = Some(r);
    }
    let last = last.expect("at least one patch");
    println!("CHILD last_ack={} {}", last.key.run_id, last.version);
    std::io::stdout().flush().expect("flush");
    wait_for_kill();
}

/// Child: open the store in `dir` (default options) and read the run `id`;
/// prints the open, the read, their sum (µs) and the version read, then
/// closes the store.
fn open_child(dir: &Path, id: &str) {
    let t = Instant::now();
    let store = FileStore::open(dir).expect("open");
    let open_us = t.elapsed().as_secs_f64() * 1e6;
    let got = store
        .get_run(&RunKey::new(TENANT, id))
        .expect("point read")
        .expect("the run is there");
    let total_us = t.elapsed().as_secs_f64() * 1e6;
    println!("CHILD open_us={open_us:.1}");
    println!("CHILD total_us={total_us:.1}");
    println!("CHILD version={}", got.version);
    let t = Instant::now();
    drop(store);
    println!("CHILD close_us={:.1}", t.elapsed().as_secs_f64() * 1e6);
}

fn vm_hwm_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------
// Environment

/// `AGENTSTATE_BENCH_DIR`, else `target/bench-tmp` next to this binary's
/// profile directory (`target/release/deps/compare-…`).
fn bench_base() -> PathBuf {
    if let Some(d) = std::env::var_os(DIR_ENV) {
        return PathBuf::from(d);
    }
    let exe = std::env::current_exe().expect("current exe");
    match exe.ancestors().nth(3) {
        Some(target) => target.join("bench-tmp"),
        None => std::env::temp_dir(),
    }
}

fn cpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

// ---------------------------------------------------------------------------
// Report

fn report(s: Sizes, d: &Durable, l: &Listing, elapsed: Duration) {
    let big = if s.big >= 1_000_000 {
        format!("{}M", s.big / 1_000_000)
    } else {
        format!("{}k", s.big / 1000)
    };
    let small = format!("{}k", s.small / 1000);
    println!();
    println!("| figure | value | notes |");
    println!("|---|---:|---|");
    let row = |name: &str, v: String, note: &str| println!("| {name} | {v} | {note} |");
    let ops = |lat: &[f64], note: &str| {
        let mut v = lat.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        (
            format!("{:.0} ops/s", rate(lat)),
            format!(
                "{note}; p50 {:.0} µs, p99 {:.0} µs",
                pct(&v, 0.5),
                pct(&v, 0.99)
            ),
        )
    };
    for (name, lat, note) in [
        (
            "floor: append + fdatasync",
            &d.floor,
            "300 B write per op, file grows",
        ),
        (
            "floor: overwrite preallocated + fdatasync",
            &d.floor_prealloc,
            "no allocation, no size change",
        ),
        (
            "sqlite create (WAL, synchronous=FULL)",
            &d.sqlite_create,
            "run row + 3 index rows, one tx",
        ),
        (
            "fjall raw: batch + SyncData",
            &d.fjall,
            "run + 2 index entries per batch",
        ),
        (
            "agentstate create, 1 writer",
            &d.create,
            "Durability::Immediate",
        ),
        (
            "agentstate create, no tool call",
            &d.create_plain,
            "same, record without pending tool call (no scrubbing)",
        ),
        ("floor (during updates)", &d.floor_b, "same file as above"),
        (
            "sqlite versioned update",
            &d.sqlite_update,
            "UPDATE … WHERE version = ?",
        ),
        (
            "agentstate versioned put, 1 writer",
            &d.put,
            "state Pending → Running",
        ),
        (
            "agentstate patch, 1 writer",
            &d.patch,
            "usage, cost, iterations, cursor",
        ),
    ] {
        let (v, n) = ops(lat, note);
        row(name, v, &n);
    }
    row(
        "agentstate create, 1 writer (rounds)",
        format!("{:.0} ops/s", median(&d.writers1)),
        &format!(
            "median of {} rounds of {} creates",
            d.writers1.len(),
            s.ops_per_writer8
        ),
    );
    row(
        "agentstate create, 8 writers (rounds)",
        format!("{:.0} ops/s", median(&d.writers8)),
        &format!(
            "median of {} rounds of 8 x {} creates; {:.1} creates per group commit",
            d.writers8.len(),
            s.ops_per_writer8,
            d.writers8_ops as f64 / d.writers8_groups.max(1) as f64
        ),
    );
    row(
        "bare group commit, 1 writer / 8 writers (rounds)",
        format!("{:.0} / {:.0} ops/s", median(&d.bare1), median(&d.bare8)),
        &format!(
            "{} B appends, no store work, same rounds; {:.1} appends per group",
            bare_group::CREATE_JOURNAL_BYTES,
            d.bare8_ops as f64 / d.bare8_groups.max(1) as f64
        ),
    );
    row(
        "CPU: scrub_run of one record",
        format!("{:.1} µs", d.scrub_us),
        "default Scrubber, the bench record's tool call",
    );
    row(
        "CPU: create on the memory store",
        format!("{:.1} µs", d.memory_create_us),
        "the store's logic without a disk",
    );
    let page = |st: &Stats| format!("{:.0} µs", st.median_us);
    let pnote = |st: &Stats, what: &str| {
        format!(
            "{what}; median of {} pages, p90 {:.0} µs, mean {:.0} µs",
            st.pages, st.p90_us, st.mean_us
        )
    };
    row(
        &format!("page of 100 at {small} runs"),
        page(&l.page_small),
        &pnote(&l.page_small, "all runs of the tenant"),
    );
    row(
        &format!("page of 100 at {big} runs"),
        page(&l.page_big),
        &pnote(&l.page_big, "all runs of the tenant, loaded Buffered"),
    );
    row(
        &format!("page of 100 at {big} runs, first walk"),
        page(&l.page_big_first),
        &pnote(&l.page_big_first, "right after reopening the child's store"),
    );
    row(
        &format!("reaper page at {small} runs"),
        page(&l.reaper_small),
        &pnote(
            &l.reaper_small,
            "state(Running).updated_before(T), 99% Completed",
        ),
    );
    row(
        &format!("reaper page at {big} runs"),
        page(&l.reaper_big),
        &pnote(
            &l.reaper_big,
            "state(Running).updated_before(T), 99% Completed",
        ),
    );
    row(
        &format!("reaper page at {big} runs, first walk"),
        page(&l.reaper_big_first),
        &pnote(&l.reaper_big_first, "right after the first plain walk"),
    );
    row(
        &format!("fjall alone: index + get page at {small}"),
        page(&l.engine_small.indexed),
        &pnote(
            &l.engine_small.indexed,
            "the store's layout, random page starts",
        ),
    );
    row(
        &format!("fjall alone: index + get page at {big}"),
        page(&l.engine_big.indexed),
        &pnote(
            &l.engine_big.indexed,
            "the store's layout, random page starts",
        ),
    );
    row(
        &format!("fjall alone: clustered page at {small}"),
        page(&l.engine_small.clustered),
        &pnote(
            &l.engine_small.clustered,
            "records keyed by seq, one range scan",
        ),
    );
    row(
        &format!("fjall alone: clustered page at {big}"),
        page(&l.engine_big.clustered),
        &pnote(
            &l.engine_big.clustered,
            "records keyed by seq, one range scan",
        ),
    );
    row(
        &format!("load {big} runs (child)"),
        format!("{:.1} s", l.child.load_s),
        &format!(
            "Buffered, {LOADERS} threads; {small}: {:.2} s",
            l.small_load_s
        ),
    );
    row(
        &format!("walk {big} runs, pages of 1000 (child)"),
        format!("{:.1} s", l.child.walk_s),
        "",
    );
    row(
        &format!("peak RSS, load + walk {big} (child)"),
        format!("{:.0} MiB", l.child.hwm_kib as f64 / 1024.0),
        &format!(
            "VmHWM; {:.0} MiB after the load",
            l.child.hwm_after_load_kib as f64 / 1024.0
        ),
    );
    row(
        &format!("sqlite: page of 100 at {big} runs"),
        page(&l.page_sqlite),
        &pnote(
            &l.page_sqlite,
            &format!(
                "keyset by seq, whole rows, each right after our page of the same runs; plan: {}",
                l.sqlite_plan
            ),
        ),
    );
    row(
        &format!("sqlite: page of 100 at {big} runs, as RunRecords"),
        page(&l.page_sqlite_records),
        &pnote(
            &l.page_sqlite_records,
            "the same rows, each built into the RunRecord our page returns (body decoded; no checksum)",
        ),
    );
    row(
        &format!("stale reaper at {big} runs"),
        page(&l.stale),
        &pnote(
            &l.stale,
            &format!(
                "state(Running).updated_before(before any write), matches nothing; {} request(s)",
                l.stale_requests
            ),
        ),
    );
    row(
        &format!("sqlite: stale reaper at {big} runs"),
        page(&l.stale_sqlite),
        &pnote(
            &l.stale_sqlite,
            "state = running AND updated_at < T, LIMIT 101",
        ),
    );
    let open = |st: &Stats| format!("{:.2} ms", st.median_us / 1000.0);
    let onote = |st: &Stats, what: &str| {
        format!(
            "{what}; median of {} fresh processes, p90 {:.2} ms",
            st.pages,
            st.p90_us / 1000.0
        )
    };
    row(
        &format!("open + first read, {big} runs, clean close"),
        open(&l.open_ours),
        &onote(&l.open_ours, "FileStore::open + get_run, in the child"),
    );
    row(
        &format!("sqlite: open + first read, {big} runs, clean close"),
        open(&l.open_sqlite),
        &onote(
            &l.open_sqlite,
            "Connection::open + SELECT by (tenant, run_id)",
        ),
    );
    row(
        &format!("open + first read, {big} runs, after kill -9"),
        open(&l.kill_ours),
        &onote(
            &l.kill_ours,
            &format!(
                "copy of the killed store; {:.1} MiB of journal (*.jnl, up to the last byte written) at the kill",
                l.journal_bytes as f64 / MIB
            ),
        ),
    );
    row(
        &format!("sqlite: open + first read, {big} runs, after kill -9"),
        open(&l.kill_sqlite),
        &onote(
            &l.kill_sqlite,
            &format!(
                "WAL recovery; {:.1} MiB of un-checkpointed WAL at the kill",
                l.sqlite_wal_bytes as f64 / MIB
            ),
        ),
    );
    row(
        &format!("sqlite: load {big} runs (child)"),
        format!("{:.1} s", l.sqlite_load_s),
        "synchronous=NORMAL, transactions of 10k rows",
    );
    println!();
    println!(
        "sizes: small={} big={} ops={} rounds={} per_round={}{}",
        s.small,
        s.big,
        s.ops,
        s.rounds,
        s.ops_per_writer8,
        if s.quick {
            " (--quick: the *_1m figures are measured at the big size above)"
        } else {
            ""
        }
    );
    println!(
        "load average at end: {}; elapsed {:.1} s",
        loadavg(),
        elapsed.as_secs_f64()
    );
    println!();

    let res = |name: &str, v: f64| println!("RESULT {name}={v:.3}");
    let writers_ratio = median_ratio(&d.writers8, &d.writers1);
    res("floor_ops_s", rate(&d.floor));
    res("floor_prealloc_ops_s", rate(&d.floor_prealloc));
    res("sqlite_create_ops_s", rate(&d.sqlite_create));
    res("sqlite_update_ops_s", rate(&d.sqlite_update));
    res("fjall_raw_ops_s", rate(&d.fjall));
    res("create_ops_s", rate(&d.create));
    res("create_no_tool_call_ops_s", rate(&d.create_plain));
    res("put_ops_s", rate(&d.put));
    res("patch_ops_s", rate(&d.patch));
    res("writers1_ops_s", median(&d.writers1));
    res("writers8_ops_s", median(&d.writers8));
    res("durable_vs_floor", rate(&d.create) / rate(&d.floor));
    res(
        "durable_no_tool_call_vs_floor",
        rate(&d.create_plain) / rate(&d.floor),
    );
    res(
        "durable_vs_floor_prealloc",
        rate(&d.create) / rate(&d.floor_prealloc),
    );
    res(
        "durable_vs_sqlite",
        rate(&d.create) / rate(&d.sqlite_create),
    );
    res("fjall_vs_floor", rate(&d.fjall) / rate(&d.floor));
    res("durable_vs_fjall", rate(&d.create) / rate(&d.fjall));
    res("put_vs_floor", rate(&d.put) / rate(&d.floor_b));
    res(
        "put_vs_sqlite_update",
        rate(&d.put) / rate(&d.sqlite_update),
    );
    res("writers8_vs_writers1", writers_ratio);
    // The ceiling: the same ratio for a group commit with no store work,
    // round by round, and ours as a share of it.
    let bare_ratio = median_ratio(&d.bare8, &d.bare1);
    res("bare_writers8_vs_writers1", bare_ratio);
    res(
        "writers8_of_bare",
        writers_ratio / bare_ratio.max(f64::MIN_POSITIVE),
    );
    res(
        "bare_appends_per_group_8w",
        d.bare8_ops as f64 / d.bare8_groups.max(1) as f64,
    );
    // What a store at the floor would score against SQLite (a durable
    // create pays one sync at least, D1).
    res(
        "durable_vs_sqlite_ceiling",
        rate(&d.floor) / rate(&d.sqlite_create),
    );
    res(
        "creates_per_group_8w",
        d.writers8_ops as f64 / d.writers8_groups.max(1) as f64,
    );
    res("scrub_us", d.scrub_us);
    res("memory_create_us", d.memory_create_us);
    res("page_10k_us", l.page_small.median_us);
    res("page_1m_us", l.page_big.median_us);
    res("page_1m_first_walk_us", l.page_big_first.median_us);
    res(
        "page_1m_vs_10k",
        l.page_big.median_us / l.page_small.median_us,
    );
    res("reaper_10k_us", l.reaper_small.median_us);
    res("reaper_1m_us", l.reaper_big.median_us);
    res(
        "reaper_1m_vs_page_10k",
        l.reaper_big.median_us / l.page_small.median_us,
    );
    res(
        "engine_indexed_page_1m_vs_10k",
        l.engine_big.indexed.median_us / l.engine_small.indexed.median_us,
    );
    res(
        "engine_clustered_page_1m_vs_10k",
        l.engine_big.clustered.median_us / l.engine_small.clustered.median_us,
    );
    res("rss_mib_1m", l.child.hwm_kib as f64 / 1024.0);
    res("page_1m_sqlite_us", l.page_sqlite.median_us);
    res(
        "page_1m_vs_sqlite",
        l.page_big.median_us / l.page_sqlite.median_us,
    );
    res("page_1m_sqlite_records_us", l.page_sqlite_records.median_us);
    res(
        "page_1m_vs_sqlite_records",
        l.page_big.median_us / l.page_sqlite_records.median_us,
    );
    res("reaper_stale_1m_us", l.stale.median_us);
    res("reaper_stale_1m_sqlite_us", l.stale_sqlite.median_us);
    res(
        "reaper_stale_1m_vs_page_10k",
        l.stale.median_us / l.page_small.median_us,
    );
    res("open_1m_us", l.open_ours.median_us);
    res("open_1m_sqlite_us", l.open_sqlite.median_us);
    res(
        "open_1m_vs_sqlite",
        l.open_ours.median_us / l.open_sqlite.median_us,
    );
    res("reopen_after_kill_us", l.kill_ours.median_us);
    res("reopen_after_kill_sqlite_us", l.kill_sqlite.median_us);
    res(
        "reopen_after_kill_vs_sqlite",
        l.kill_ours.median_us / l.kill_sqlite.median_us,
    );
    res("kill_journal_mib", l.journal_bytes as f64 / MIB);
    res("kill_sqlite_wal_mib", l.sqlite_wal_bytes as f64 / MIB);
    res("big_runs", s.big as f64);
    res("elapsed_s", elapsed.as_secs_f64());
}

// ---------------------------------------------------------------------------
// Engines: fjall and sled side by side (feature `sled`)

/// One engine's figures in `engines_section`.
#[cfg(feature = "sled")]
#[derive(Default)]
struct EngineFigures {
    create: Vec<f64>,
    put: Vec<f64>,
    patch: Vec<f64>,
    writers1: Vec<f64>,
    writers8: Vec<f64>,
    load_s: f64,
    page: Stats,
    reaper_first: Stats,
    disk_bytes: u64,
}

/// Bytes the files under `dir` occupy on disk (allocated blocks).
#[cfg(feature = "sled")]
fn dir_disk_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt as _;
    let mut total = 0;
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let Ok(m) = e.metadata() else { continue };
        total += if m.is_dir() {
            dir_disk_bytes(&e.path())
        } else {
            m.blocks() * 512
        };
    }
    total
}

/// fjall and sled under the same store, in one run: one writer's durable
/// create, put and patch (interleaved op by op across the engines), one
/// writer vs eight in alternating rounds (engines alternating too), and at
/// `AGENTSTATE_BENCH_ENGINE_RUNS` runs (100k by default) the load time,
/// a full listing walk in pages of 100, the reaper's first page, and the
/// bytes the store takes on disk once closed.
#[cfg(feature = "sled")]
fn engines_section(dir: &Path, s: Sizes) {
    use agentstate::FileEngine;
    let engines = [FileEngine::Fjall, FileEngine::Sled];
    let open = |name: &str, e: FileEngine, o: Options| {
        FileStore::open_with(dir.join(format!("engine-{}-{name}", e.name())), o.engine(e))
            .expect("store open")
    };
    let mut figs: Vec<EngineFigures> = engines.iter().map(|_| EngineFigures::default()).collect();
    eprintln!("engines: one writer (load {})", loadavg());
    let mut agents: Vec<Agent> = engines
        .iter()
        .map(|&e| Agent {
            store: open("one", e, Options::new()),
            runs: Vec::new(),
        })
        .collect();
    for i in 0..s.ops {
        for k in 0..engines.len() {
            let j = (i + k) % engines.len();
            timed(&mut figs[j].create, || agents[j].create(i as u64));
        }
    }
    for i in 0..s.ops {
        for k in 0..engines.len() {
            let j = (i + k) % engines.len();
            timed(&mut figs[j].put, || agents[j].put(i));
            timed(&mut figs[j].patch, || agents[j].patch(i));
        }
    }
    drop(agents);
    eprintln!("engines: eight writers (load {})", loadavg());
    let stores: Vec<Arc<FileStore>> = engines
        .iter()
        .map(|&e| Arc::new(open("eight", e, Options::new())))
        .collect();
    for round in 0..s.rounds {
        for (j, store) in stores.iter().enumerate() {
            let tenant = format!("solo{round}");
            let t = Instant::now();
            for i in 0..s.ops_per_writer8 as u64 {
                store
                    .put_run(record(&tenant, run_id(i), RunState::Pending))
                    .expect("create");
            }
            figs[j]
                .writers1
                .push(per_sec(s.ops_per_writer8, t.elapsed()));
            let (w, _, _) = agentstate_writers(store, round, 8, s.ops_per_writer8);
            figs[j].writers8.push(w);
        }
    }
    drop(stores);
    let runs: u64 = std::env::var("AGENTSTATE_BENCH_ENGINE_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    for (j, &e) in engines.iter().enumerate() {
        eprintln!(
            "engines: {} listing at {runs} runs (load {})",
            e.name(),
            loadavg()
        );
        let path = dir.join(format!("engine-{}-list", e.name()));
        let t = Instant::now();
        let store =
            Arc::new(FileStore::open_with(&path, buffered().engine(e)).expect("store open"));
        load(&store, runs);
        drop(store);
        figs[j].load_s = t.elapsed().as_secs_f64();
        figs[j].disk_bytes = dir_disk_bytes(&path);
        let store = FileStore::open_with(&path, buffered().engine(e)).expect("reopen");
        let mut first = Vec::new();
        for _ in 0..20 {
            let t = Instant::now();
            let page = store
                .list_runs(&reaper_query(), &PageRequest::new(100))
                .expect("reaper page");
            first.push(t.elapsed().as_secs_f64() * 1e6);
            std::hint::black_box(page);
        }
        let (pages, seen) = walk(&store, StateQuery::new(TENANT), 100);
        assert_eq!(seen as u64, runs);
        figs[j].page = stats(pages);
        figs[j].reaper_first = stats(first);
    }
    println!(
        "\n## engines (one run, side by side; load average now {})",
        loadavg()
    );
    println!(
        "| engine | create/s | put/s | patch/s | 1 writer/s | 8 writers/s | load {runs} (s) | page of 100 (µs, median) | reaper first page (µs, median) | disk bytes at {runs} runs |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (e, f) in engines.iter().zip(&figs) {
        println!(
            "| {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1} | {:.0} | {:.0} | {} |",
            e.name(),
            rate(&f.create),
            rate(&f.put),
            rate(&f.patch),
            median(&f.writers1),
            median(&f.writers8),
            f.load_s,
            f.page.median_us,
            f.reaper_first.median_us,
            f.disk_bytes
        );
    }
    let (a, b) = (&figs[0], &figs[1]);
    println!(
        "sled / fjall: create {:.2}, put {:.2}, patch {:.2}, 1 writer {:.2}, 8 writers {:.2}, page {:.2}, reaper {:.2}, disk {:.2}",
        rate(&b.create) / rate(&a.create),
        rate(&b.put) / rate(&a.put),
        rate(&b.patch) / rate(&a.patch),
        median(&b.writers1) / median(&a.writers1),
        median(&b.writers8) / median(&a.writers8),
        b.page.median_us / a.page.median_us,
        b.reaper_first.median_us / a.reaper_first.median_us,
        b.disk_bytes as f64 / a.disk_bytes.max(1) as f64
    );
    for (e, f) in engines.iter().zip(&figs) {
        let n = e.name();
        println!("RESULT engine_{n}_create_per_s={:.0}", rate(&f.create));
        println!("RESULT engine_{n}_put_per_s={:.0}", rate(&f.put));
        println!("RESULT engine_{n}_patch_per_s={:.0}", rate(&f.patch));
        println!(
            "RESULT engine_{n}_writers1_per_s={:.0}",
            median(&f.writers1)
        );
        println!(
            "RESULT engine_{n}_writers8_per_s={:.0}",
            median(&f.writers8)
        );
        println!("RESULT engine_{n}_page_median_us={:.0}", f.page.median_us);
        println!(
            "RESULT engine_{n}_reaper_first_median_us={:.0}",
            f.reaper_first.median_us
        );
        println!(
            "RESULT engine_{n}_disk_bytes_per_{runs}_runs={}",
            f.disk_bytes
        );
    }
}
