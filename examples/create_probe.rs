//! The create probe: `memory_create_us` of `benches/compare.rs`, alone and
//! repeated, so two builds can be timed side by side.
//!
//! ```text
//! cargo build --release --example create_probe
//! target/release/examples/create_probe [N] [ROUNDS]
//! ```
//!
//! Each round makes a fresh `MemoryStore` and times exactly the bench's
//! loop: N creates (default 20,000, the full run's `ops * 10`) of
//! `record(TENANT, run_id(i), RunState::Pending)`, each built in the loop.
//! The scrubber's tables are built first, as the bench's scrub loop before
//! it builds them. It prints one line per round and the rounds' median:
//!
//! ```text
//! PROBE round=0 us_per_create=… cpu_us_per_create=…
//! PROBE median us_per_create=… load=…
//! ```

#![allow(clippy::print_stdout)]

use std::time::Instant;

use agentstate::{MemoryStore, RunState, StateStore};

#[path = "../benches/support/records.rs"]
#[allow(dead_code)]
mod records;
use records::{TENANT, record, run_id, thread_cpu_ns};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: u64 = args.get(1).map_or(20_000, |a| a.parse().expect("N"));
    let rounds: usize = args.get(2).map_or(5, |a| a.parse().expect("ROUNDS"));
    // The bench times scrubs just before, so the scrubber's tables are
    // built by then: build them here too, outside the timing.
    std::hint::black_box(agentstate::Scrubber::default().scrub_run(&record(
        TENANT,
        run_id(0),
        RunState::Pending,
    )));
    let mut times = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let mem = MemoryStore::new();
        let cpu = thread_cpu_ns();
        let t = Instant::now();
        for i in 0..n {
            mem.put_run(record(TENANT, run_id(i), RunState::Pending))
                .expect("create");
        }
        let us = t.elapsed().as_secs_f64() * 1e6 / n.max(1) as f64;
        let cpu_us = (thread_cpu_ns() - cpu) as f64 / 1e3 / n.max(1) as f64;
        println!("PROBE round={round} us_per_create={us:.3} cpu_us_per_create={cpu_us:.3}");
        times.push(us);
    }
    times.sort_by(f64::total_cmp);
    let median = times.get(times.len() / 2).copied().unwrap_or(0.0);
    let load = std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().next().unwrap_or("?").to_string())
        .unwrap_or_else(|_| "?".into());
    println!("PROBE median us_per_create={median:.3} load={load}");
}
