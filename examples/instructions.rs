//! Creates N runs, for counting the instructions one create costs under
//! valgrind's callgrind (a figure that does not move with the machine's
//! load, unlike a timing):
//!
//! ```text
//! cargo build --release --example instructions
//! valgrind --tool=callgrind --callgrind-out-file=cg.%p \
//!     target/release/examples/instructions memory 2000
//! ```
//!
//! `memory N` creates N runs on a `MemoryStore`; `file N` on a `FileStore`
//! opened with `Durability::Buffered` (no fsync per commit, so the count is
//! the store's CPU, not the kernel's wait); `scrub N` scrubs the record N
//! times. Each record is the one `benches/compare.rs` writes: a run with a
//! pending tool call whose arguments are ~210 bytes of JSON. `warmup` runs
//! (default 200) come first, so one-time costs (the scrubber's rules, the
//! store's creation) fall outside; the program prints the counter it
//! wants subtracted. docs/benchmarks-lab-notes.md takes `instructions_per_create` as
//! (Ir of a run with N) − (Ir of a run with 0), divided by N — the
//! warmup and the setup cancel.

use agentstate::{
    Durability, FileStore, MemoryStore, Options, RunKey, RunRecord, Scrubber, StateStore, ToolCall,
};

const ARGS: &str = r#"{"query":"quarterly revenue by region for the last four quarters","max_results":25,"filters":{"region":["emea","apac","amer"],"currency":"EUR"},"include_sources":true,"note":"benchmark record of realistic size"}"#;

fn record(i: u64) -> RunRecord {
    let mut r = RunRecord::new(RunKey::new("acme", format!("run-{i:016x}")), "planner");
    r.pending_tool_calls = vec![ToolCall {
        id: "call_01".into(),
        name: "web_search".into(),
        arguments: ARGS.into(),
    }];
    r
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: instructions memory|file|scrub N [warmup]";
    let kind = args.get(1).expect(usage).as_str();
    let n: u64 = args.get(2).expect(usage).parse().expect(usage);
    let warmup: u64 = args.get(3).map_or(200, |w| w.parse().expect(usage));
    let total = warmup + n;
    match kind {
        "memory" => {
            let store = MemoryStore::new();
            for i in 0..total {
                store.put_run(record(i)).expect("create");
            }
        }
        "file" => {
            let dir = tempfile::tempdir().expect("tempdir");
            let store = FileStore::open_with(
                dir.path().join("store"),
                Options::default().durability(Durability::Buffered),
            )
            .expect("open");
            for i in 0..total {
                store.put_run(record(i)).expect("create");
            }
        }
        "scrub" => {
            let scrubber = Scrubber::default();
            let r = record(0);
            for _ in 0..total {
                std::hint::black_box(scrubber.scrub_run(std::hint::black_box(&r)));
            }
        }
        _ => panic!("{usage}"),
    }
    println!("{kind}: {n} measured after {warmup} warmup");
}
