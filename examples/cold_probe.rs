//! The cold probe: what a call costs when the caches and the TLB hold none
//! of the store's code and data, as they do when an agent runtime calls the
//! store between model calls, tool calls and JSON parsing, and as they do
//! in `benches/compare.rs`'s one-writer part, which interleaves six
//! contenders op by op (docs/benchmarks-lab-notes.md, "Cold calls"):
//!
//! ```text
//! cargo run --release --example cold_probe -- [--ops 3000] [--sweep-mib 32]
//! ```
//!
//! Before each timed call the probe writes one byte in every cache line of
//! a buffer (`--sweep-mib`: 32 MiB evicts this machine's 32 MiB L3 too; 2
//! evicts L1 and L2 only), then times one call. It prints the median of
//! each kind of call, warm (no sweep) and cold, side by side:
//!
//! ```text
//! PROBE warm|cold sweep_mib=… empty_us=… malloc_us=… clone_us=… scrub_us=… memory_create_us=… file_create_us=… file_create_no_tool_us=… file_get_us=…
//! ```
//!
//! `empty` is an empty timed region (the clock's own cost), `malloc` one
//! 210-byte allocation and its free, `clone` a clone of the bench record,
//! `scrub` the default scrubber's `scrub_run` of it; the creates are on a
//! `MemoryStore` and on a `FileStore` opened `Durability::Buffered` (no
//! sync: the store's CPU alone), with and without the pending tool call,
//! and `file_get` a `get_run` of a run created before.

#![allow(clippy::print_stdout)]

use std::time::Instant;

use agentstate::{
    Durability, FileStore, MemoryStore, Options, RunKey, RunState, Scrubber, StateStore,
};

#[path = "../benches/support/records.rs"]
#[allow(dead_code)] // the listing helpers and the clock, unused here
mod records;
use records::{TENANT, record, run_id};

/// Writes one byte in every cache line of `buf`.
fn sweep(buf: &mut [u8]) {
    for i in (0..buf.len()).step_by(64) {
        buf[i] = buf[i].wrapping_add(1);
    }
    std::hint::black_box(&buf);
}

/// µs `f` takes, after a sweep when `buf` is given.
fn timed(buf: Option<&mut Vec<u8>>, f: impl FnOnce()) -> f64 {
    if let Some(buf) = buf {
        sweep(buf);
    }
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64() * 1e6
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let (mut ops, mut sweep_mib) = (3000u64, 32usize);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--ops" => ops = value().parse().expect("--ops N"),
            "--sweep-mib" => sweep_mib = value().parse().expect("--sweep-mib N"),
            _ => panic!("usage: cold_probe [--ops N] [--sweep-mib N]"),
        }
    }
    let scrubber = Scrubber::default();
    let bench = record(TENANT, run_id(0), RunState::Pending);
    // The scrubber's tables are built at its first scrub.
    std::hint::black_box(scrubber.scrub_run(&bench));
    let mut buf = vec![0u8; sweep_mib << 20];
    for cold in [false, true] {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = FileStore::open_with(
            dir.path().join("store"),
            Options::new().durability(Durability::Buffered),
        )
        .expect("open file store");
        let memory = MemoryStore::new();
        let mut cols: [Vec<f64>; 8] = Default::default();
        for i in 0..ops {
            cols[0].push(timed(cold.then_some(&mut buf), || ()));
            cols[1].push(timed(cold.then_some(&mut buf), || {
                drop(std::hint::black_box(Vec::<u8>::with_capacity(
                    std::hint::black_box(210),
                )))
            }));
            cols[2].push(timed(cold.then_some(&mut buf), || {
                drop(std::hint::black_box(std::hint::black_box(&bench).clone()))
            }));
            cols[3].push(timed(cold.then_some(&mut buf), || {
                drop(std::hint::black_box(scrubber.scrub_run(&bench)))
            }));
            let r = record(TENANT, run_id(i), RunState::Pending);
            cols[4].push(timed(cold.then_some(&mut buf), || {
                memory.put_run(r).expect("memory create");
            }));
            let r = record(TENANT, run_id(i), RunState::Pending);
            cols[5].push(timed(cold.then_some(&mut buf), || {
                file.put_run(r).expect("file create");
            }));
            let mut r = record(TENANT, run_id(i + (1 << 40)), RunState::Pending);
            r.pending_tool_calls.clear();
            cols[6].push(timed(cold.then_some(&mut buf), || {
                file.put_run(r).expect("file create");
            }));
            let key = RunKey::new(TENANT, run_id(i));
            cols[7].push(timed(cold.then_some(&mut buf), || {
                std::hint::black_box(file.get_run(&key).expect("get"));
            }));
        }
        let [empty, malloc, clone, scrub, mem, fc, fcn, fg] = cols.map(median);
        println!(
            "PROBE {} sweep_mib={sweep_mib} empty_us={empty:.2} malloc_us={malloc:.2} clone_us={clone:.2} scrub_us={scrub:.2} memory_create_us={mem:.2} file_create_us={fc:.2} file_create_no_tool_us={fcn:.2} file_get_us={fg:.2}",
            if cold { "cold" } else { "warm" },
        );
    }
}
