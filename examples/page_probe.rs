//! Pages a prepared big tenant on the file store and on SQLite, for timing
//! and for counting the instructions one page costs under valgrind's
//! callgrind (issue 13, `page_1m_vs_sqlite`):
//!
//! ```text
//! cargo build --release --example page_probe
//! P=target/release/examples/page_probe
//! $P load target/page-probe 1000000      # once: our store and SQLite's table
//! $P walk target/page-probe all 3        # median page of each, side by side
//! valgrind --tool=callgrind --toggle-collect='*list_runs*' \
//!     $P walk target/page-probe ours 1    # Ir of every page of one walk
//! valgrind --tool=callgrind --toggle-collect='*Pager*page_records*' \
//!     $P walk target/page-probe sqlite-records 1
//! ```
//!
//! The runs are those of `benches/compare.rs`'s big tenant (UUID-like ids,
//! 1% `Running`, a pending tool call with ~210 bytes of JSON arguments),
//! loaded from 8 threads with `Durability::Buffered` and closed cleanly;
//! SQLite's table is `benches/support/sqlite.rs`'s, loaded by its loader.
//! `walk DIR WHICH REPS` opens what `WHICH` names (`ours`, `floor`, `sqlite-rows`,
//! `sqlite-records` or `all`), walks the whole tenant by pages of 100
//! `REPS` times (for `all`, page i of each right after the other's, as the
//! bench does) and prints each one's median page and its page count. The
//! instructions per page are callgrind's total for the toggled function
//! divided by the page count. `floor` walks ours and times, after each
//! page, a copy of its 100 records (every owned field allocated and
//! copied, nothing read or decoded): what building the page's records
//! costs on its own, whatever store they come from.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use agentstate::{Durability, FileStore, Options, PageRequest, StateQuery, StateStore};

#[path = "../benches/support/records.rs"]
#[allow(dead_code)] // the thread clock, unused here
mod records;
#[path = "../benches/support/sqlite.rs"]
#[allow(dead_code)] // the bench's loader and reaper, unused here
mod sqlite_side;
use records::{TENANT, listing_state, now_ms, record, run_id};

const LOADERS: u64 = 8;

/// The bench's SQLite loader waits here to be killed; the probe goes on.
fn wait_for_kill() {}

fn load(dir: &Path, n: u64) {
    std::fs::create_dir_all(dir).expect("probe dir");
    let t = Instant::now();
    let store = Arc::new(
        FileStore::open_with(
            dir.join("store"),
            Options::new().durability(Durability::Buffered),
        )
        .expect("open store"),
    );
    let handles: Vec<_> = (0..LOADERS)
        .map(|w| {
            let store = store.clone();
            std::thread::spawn(move || {
                let mut i = w;
                while i < n {
                    store
                        .put_run(record(TENANT, run_id(i), listing_state(i)))
                        .expect("load");
                    i += LOADERS;
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("loader");
    }
    drop(store);
    println!("ours: {n} runs in {:.1} s", t.elapsed().as_secs_f64());
    sqlite_side::load_child(n, 0, &dir.join("sqlite"));
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn walk(dir: &Path, which: &str, reps: usize) {
    let (ours, sqlite) = match which {
        "ours" | "floor" => (true, None),
        "sqlite-rows" => (false, Some(false)),
        "sqlite-records" => (false, Some(true)),
        "all" => (true, Some(true)),
        _ => panic!("walk DIR ours|floor|sqlite-rows|sqlite-records|all REPS"),
    };
    let store = ours.then(|| {
        FileStore::open_with(
            dir.join("store"),
            Options::new().durability(Durability::Buffered),
        )
        .expect("open store")
    });
    let pager = sqlite.map(|_| sqlite_side::Pager::open(&dir.join("sqlite")));
    let both = which == "all";
    let floor = which == "floor";
    let (mut t_ours, mut t_rows, mut t_records) = (Vec::new(), Vec::new(), Vec::new());
    let mut t_clone = Vec::new();
    let (mut n_ours, mut n_rows, mut n_records) = (0, 0, 0);
    for _ in 0..reps {
        let mut page = store.as_ref().map(|_| PageRequest::new(100));
        let mut rows = (sqlite == Some(false) || both).then_some(0i64);
        let mut records = (sqlite == Some(true)).then_some(0i64);
        while page.is_some() || rows.is_some() || records.is_some() {
            if let (Some(p), Some(s)) = (page.take(), &store) {
                let t = Instant::now();
                let got = s.list_runs(&StateQuery::new(TENANT), &p).expect("list");
                t_ours.push(t.elapsed().as_secs_f64() * 1e6);
                let (items, cursor) = got.into_parts();
                n_ours += items.len();
                std::hint::black_box(&items);
                if floor {
                    // The records alone: every owned field allocated and
                    // copied again, nothing read, parsed or checked.
                    let t = Instant::now();
                    let mut copy = Vec::with_capacity(items.len());
                    copy.extend(items.iter().cloned());
                    std::hint::black_box(&copy);
                    t_clone.push(t.elapsed().as_secs_f64() * 1e6);
                    drop(copy);
                }
                page = cursor.map(|c| p.with_cursor(Some(c)));
            }
            if let (Some(a), Some(p)) = (rows.take(), &pager) {
                let t = Instant::now();
                let (got, next) = p.page(a);
                t_rows.push(t.elapsed().as_secs_f64() * 1e6);
                n_rows += got.len();
                std::hint::black_box(&got);
                rows = next;
            }
            if let (Some(a), Some(p)) = (records.take(), &pager) {
                let t = Instant::now();
                let (got, next) = p.page_records(a);
                t_records.push(t.elapsed().as_secs_f64() * 1e6);
                n_records += got.len();
                std::hint::black_box(&got);
                records = next;
            }
        }
    }
    let n_clone = if floor { n_ours } else { 0 };
    for (name, t, n) in [
        ("ours", t_ours, n_ours),
        ("ours-clone", t_clone, n_clone),
        ("sqlite-rows", t_rows, n_rows),
        ("sqlite-records", t_records, n_records),
    ] {
        if !t.is_empty() {
            let mean = t.iter().sum::<f64>() / t.len() as f64;
            println!(
                "{name}: {} pages, {n} runs, median page {:.1} us, mean {mean:.1} us",
                t.len(),
                median(t)
            );
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage =
        "usage: page_probe load DIR N | walk DIR ours|floor|sqlite-rows|sqlite-records|all REPS";
    match args.get(1).map(String::as_str) {
        Some("load") => load(
            Path::new(args.get(2).expect(usage)),
            args.get(3).expect(usage).parse().expect(usage),
        ),
        Some("walk") => walk(
            Path::new(args.get(2).expect(usage)),
            args.get(3).expect(usage),
            args.get(4).map_or(1, |r| r.parse().expect(usage)),
        ),
        _ => panic!("{usage}"),
    }
}
