//! Times the short index scan of `marked_trays` (issue 13,
//! `latency_growth`'s `marked`) on a store with and without other data,
//! and with and without tray writes between the scans:
//!
//! ```text
//! cargo build --release --example scan_probe
//! P=target/release/examples/scan_probe
//! $P load target/scan-big 200000            # a store holding 200k runs
//! $P scan target/scan-big 100000 writes     # 100k tray writes, a scan every 25
//! $P scan target/scan-big 100000 scans      # the same scans, no writes between
//! $P scan target/scan-empty 100000 writes   # the same on a new store
//! valgrind --tool=callgrind --toggle-collect='scan_probe::marked' $P scan …
//! ```
//!
//! `scan` opens the store at DIR (creating it if absent), writes 2,000
//! trays (3 instances × 3 trays, the growth bench's, marked half the
//! time), then goes on with `writes` tray writes in all (`writes`) or
//! none (`scans`), scanning every 25th step, and prints the scans'
//! mean wall and thread CPU time. The scan returns the ≤ 9 marked trays,
//! whatever else the store holds.

use std::path::Path;
use std::time::Instant;

use agentstate::{
    Durability, FileStore, InstanceKey, Options, PageRequest, RunKey, RunRecord, StateStore, Tray,
    TrayStore,
};

#[path = "../benches/support/records.rs"]
#[allow(dead_code)] // the records and ids the other probes write, unused here
mod records;
use records::{TENANT, thread_cpu_ns};

fn open(dir: &Path) -> FileStore {
    FileStore::open_with(dir, Options::new().durability(Durability::Buffered)).expect("open store")
}

fn load(dir: &Path, n: u64) {
    let _ = std::fs::remove_dir_all(dir);
    let store = open(dir);
    let t = Instant::now();
    for i in 0..n {
        let r = RunRecord::new(RunKey::new(TENANT, format!("pre-{i}")), "planner");
        store.put_run(r).expect("load");
    }
    println!("{n} runs in {:.1} s", t.elapsed().as_secs_f64());
}

fn scan(dir: &Path, steps: u64, writes: bool) {
    let store = open(dir);
    let inst: Vec<InstanceKey> = (0..3)
        .map(|i| InstanceKey::new("workers", format!("w{i}")))
        .collect();
    let epochs: Vec<u64> = inst
        .iter()
        .map(|k| store.epoch(k).expect("epoch") + 1)
        .collect();
    let mut x = 12345u64;
    let (mut scans, mut wall, mut cpu) = (0u64, 0f64, 0u64);
    for step in 0..steps {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if step < 2_000 || writes {
            let i = (x % 3) as usize;
            let tray = Tray {
                marked: (x >> 8).is_multiple_of(2),
                doc: vec![b'x'; 80],
                env: "growth".into(),
                hostname: "localhost".into(),
            };
            let key = inst[i].tray("tray", format!("t{}", (x >> 16) % 3));
            store.write_tray(&key, epochs[i], tray).expect("write");
        }
        if step.is_multiple_of(25) {
            let c = thread_cpu_ns();
            let t = Instant::now();
            marked(&store, (x >> 20).is_multiple_of(2));
            wall += t.elapsed().as_secs_f64();
            cpu += thread_cpu_ns() - c;
            scans += 1;
        }
    }
    println!(
        "{scans} scans: mean {:.1} us, thread CPU {:.1} us",
        wall * 1e6 / scans as f64,
        cpu as f64 / 1e3 / scans as f64
    );
}

#[inline(never)]
fn marked(store: &FileStore, by_env: bool) {
    let page = store
        .marked_trays(by_env.then_some("growth"), &PageRequest::new(10))
        .expect("marked_trays");
    std::hint::black_box(page);
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: scan_probe load DIR N | scan DIR STEPS writes|scans";
    let dir = Path::new(args.get(2).expect(usage));
    let n: u64 = args.get(3).expect(usage).parse().expect(usage);
    match (args[1].as_str(), args.get(4).map(String::as_str)) {
        ("load", None) => load(dir, n),
        ("scan", Some("writes")) => scan(dir, n, true),
        ("scan", Some("scans")) => scan(dir, n, false),
        _ => panic!("{usage}"),
    }
}
