//! The get probe: what one `get_run` of a hot run costs once the store
//! has grown, so two builds can be counted side by side (callgrind) or
//! timed (docs/benchmarks-lab-notes.md, "Latency growth").
//!
//! ```text
//! cargo build --release --example get_probe
//! target/release/examples/get_probe DIR [RUNS] [GETS]
//! ```
//!
//! It creates `RUNS` runs (default 20,000; `Durability::Buffered`, so the
//! load is quick) in a fresh store under `DIR`, rewrites 40 of them with
//! patches (the growth bench's hot set: their records are in the
//! memtable, their id map entries in tables since their creates were
//! flushed), and then times `GETS` (default 200,000) reads of those 40,
//! and then `GETS / 10` patches of them (a job reads the run it patches
//! the same way), by wall clock and by the thread's CPU:
//!
//! ```text
//! PROBE gets=… us_per_get=… cpu_us_per_get=… us_per_patch=… cpu_us_per_patch=…
//! ```

#![allow(clippy::print_stdout)]

use std::time::Instant;

use agentstate::{Durability, FileStore, Options, RunKey, RunState, StateDelta, StateStore};

#[path = "../benches/support/records.rs"]
#[allow(dead_code)]
mod records;
use records::{TENANT, record, run_id, thread_cpu_ns};

const HOT: u64 = 40;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = std::path::PathBuf::from(args.get(1).expect("DIR"));
    let runs: u64 = args.get(2).map_or(20_000, |a| a.parse().expect("RUNS"));
    let gets: u64 = args.get(3).map_or(200_000, |a| a.parse().expect("GETS"));
    let path = dir.join("get-probe");
    let _ = std::fs::remove_dir_all(&path);
    let store =
        FileStore::open_with(&path, Options::new().durability(Durability::Buffered)).expect("open");
    for i in 0..runs {
        store
            .put_run(record(TENANT, run_id(i), RunState::Running))
            .expect("create");
    }
    let hot = |i: u64| RunKey::new(TENANT, run_id(i * (runs / HOT).max(1)));
    for round in 0..10 {
        for i in 0..HOT {
            let delta = StateDelta {
                cost_micros: 1 + round,
                iterations: 1,
                ..Default::default()
            };
            store.patch_run(&hot(i), delta).expect("patch");
        }
    }
    let cpu = thread_cpu_ns();
    let t = Instant::now();
    for n in 0..gets {
        let r = store.get_run(&hot(n % HOT)).expect("get");
        assert!(r.is_some(), "a hot run is there");
    }
    let us = t.elapsed().as_secs_f64() * 1e6 / gets.max(1) as f64;
    let cpu_us = (thread_cpu_ns() - cpu) as f64 / 1e3 / gets.max(1) as f64;
    let patches = gets / 10;
    let cpu = thread_cpu_ns();
    let t = Instant::now();
    for n in 0..patches {
        let delta = StateDelta {
            cost_micros: 1,
            ..Default::default()
        };
        store.patch_run(&hot(n % HOT), delta).expect("patch");
    }
    let patch_us = t.elapsed().as_secs_f64() * 1e6 / patches.max(1) as f64;
    let patch_cpu_us = (thread_cpu_ns() - cpu) as f64 / 1e3 / patches.max(1) as f64;
    println!(
        "PROBE gets={gets} us_per_get={us:.3} cpu_us_per_get={cpu_us:.3} us_per_patch={patch_us:.3} cpu_us_per_patch={patch_cpu_us:.3}"
    );
    drop(store);
    std::fs::remove_dir_all(&path).expect("remove the probe's store");
}
