//! The write probe: durable creates on a fresh file store
//! (`Durability::Immediate`, the default), from one writer or from eight,
//! in fresh stores side by side with the disk's floor, so two builds can
//! be compared run against run (docs/benchmarks-lab-notes.md, "Spare journal"):
//!
//! ```text
//! cargo run --release --example write_probe -- [--rounds 5] [--ops 2000] [--dir DIR] \
//!     [--write-buffer-mib N]
//! ```
//!
//! Each round makes one store and runs, one after the other, `ops`
//! appends of 300 bytes + `fdatasync` to a file of its own (the floor),
//! `ops` creates from one writer, and `ops` creates from eight writers
//! (`ops / 8` each, a tenant each). It prints one line per round and the
//! medians:
//!
//! ```text
//! PROBE round=0 floor_us=… one_us=… eight_us=… per_group=… one_vs_floor=… eight_vs_one=… \
//!     one_cpu_us=… eight_cpu_us=… one_switches=V/I eight_switches=V/I
//! PROBE median … one_switches=V+I eight_switches=V+I
//! ```
//!
//! `*_us` are µs per op (wall clock); `per_group` is creates per group
//! commit with eight writers; `*_cpu_us` the process's CPU time (user +
//! system, all threads, the engine's too) per create, in 10 ms ticks;
//! `*_switches` the process's context switches per create (every
//! thread's, `getrusage`), voluntary (a wait) / involuntary (preempted).

#![allow(clippy::print_stdout)]

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use agentstate::{FileStore, RunState, StateStore};

#[path = "../benches/support/records.rs"]
#[allow(dead_code)] // the listing helpers and the clock, unused here
mod records;
use records::{context_switches, record, run_id};

/// The process's context switches per op since `before`: (voluntary,
/// involuntary), every thread's.
fn switches_per(before: (u64, u64), n: f64) -> (f64, f64) {
    let now = context_switches(false);
    ((now.0 - before.0) as f64 / n, (now.1 - before.1) as f64 / n)
}

fn floor_us(dir: &Path, ops: usize) -> f64 {
    let path = dir.join("floor.log");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .expect("floor file");
    let buf = [b'r'; 300];
    let t = Instant::now();
    for _ in 0..ops {
        f.write_all(&buf).expect("floor write");
        f.sync_data().expect("floor sync");
    }
    let us = t.elapsed().as_secs_f64() * 1e6 / ops as f64;
    drop(f);
    std::fs::remove_file(&path).expect("floor remove");
    us
}

/// The CPU time (user + system) this process has used, every thread's,
/// the engine's and the ended ones' included, in µs: `/proc/self/stat`'s
/// `utime` + `stime`, in clock ticks of 10 ms (Linux's `USER_HZ`), so a
/// phase needs a few hundred ms for a figure to the percent.
fn process_cpu_us() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The fields after the command name, which ends with the last ')'.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let ticks: u64 = rest
        .split_whitespace()
        .skip(11) // state … cmajflt: `utime` is field 14 of the line
        .take(2)
        .map(|f| f.parse::<u64>().unwrap_or(0))
        .sum();
    ticks as f64 * 10_000.0
}

/// µs per create, wall and process CPU, and context switches per create,
/// one writer.
fn one_us(store: &FileStore, ops: usize) -> (f64, f64, (f64, f64)) {
    let switches = context_switches(false);
    let cpu = process_cpu_us();
    let t = Instant::now();
    for i in 0..ops as u64 {
        store
            .put_run(record("solo", run_id(i), RunState::Pending))
            .expect("create");
    }
    let n = ops as f64;
    (
        t.elapsed().as_secs_f64() * 1e6 / n,
        (process_cpu_us() - cpu) / n,
        switches_per(switches, n),
    )
}

/// µs per create (wall), creates per group, µs of process CPU per create
/// and context switches per create, eight writers.
fn eight_us(store: &Arc<FileStore>, ops: usize) -> (f64, f64, f64, (f64, f64)) {
    let per = (ops / 8).max(1) as u64;
    let before = store.commits();
    let switches = context_switches(false);
    let cpu = process_cpu_us();
    let t = Instant::now();
    let writers: Vec<_> = (0..8)
        .map(|w| {
            let store = store.clone();
            std::thread::spawn(move || {
                for i in 0..per {
                    store
                        .put_run(record(&format!("w{w}"), run_id(i), RunState::Pending))
                        .expect("create");
                }
            })
        })
        .collect();
    for w in writers {
        w.join().expect("writer");
    }
    let n = (8 * per) as f64;
    let wall = t.elapsed().as_secs_f64() * 1e6 / n;
    let cpu = (process_cpu_us() - cpu) / n;
    let groups = (store.commits() - before).max(1) as f64;
    (wall, n / groups, cpu, switches_per(switches, n))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut rounds = 5usize;
    let mut ops = 2000usize;
    let mut base: Option<PathBuf> = None;
    let mut options = agentstate::Options::default();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--rounds" => rounds = value().parse().expect("--rounds N"),
            "--ops" => ops = value().parse().expect("--ops N"),
            "--dir" => base = Some(PathBuf::from(value())),
            "--write-buffer-mib" => {
                let mib: u64 = value().parse().expect("--write-buffer-mib N");
                options = options.write_buffer_bytes(mib << 20);
            }
            _ => panic!(
                "usage: write_probe [--rounds N] [--ops N] [--dir DIR] [--write-buffer-mib N]"
            ),
        }
    }
    let tmp = match &base {
        Some(b) => tempfile::tempdir_in(b),
        None => tempfile::tempdir(),
    }
    .expect("scratch dir");
    let (mut floor, mut one, mut eight, mut groups) = (vec![], vec![], vec![], vec![]);
    let (mut one_cpu, mut eight_cpu) = (vec![], vec![]);
    let (mut one_sw, mut eight_sw) = (vec![], vec![]);
    for round in 0..rounds {
        let dir = tmp.path().join(format!("r{round}"));
        std::fs::create_dir_all(&dir).expect("round dir");
        let store =
            Arc::new(FileStore::open_with(dir.join("store"), options.clone()).expect("open"));
        let f = floor_us(&dir, ops);
        let (o, oc, os) = one_us(&store, ops);
        let (e, g, ec, es) = eight_us(&store, ops);
        println!(
            "PROBE round={round} floor_us={f:.1} one_us={o:.1} eight_us={e:.1} per_group={g:.2} \
             one_vs_floor={:.3} eight_vs_one={:.3} one_cpu_us={oc:.1} eight_cpu_us={ec:.1} \
             one_switches={:.2}/{:.2} eight_switches={:.2}/{:.2}",
            f / o,
            o / e,
            os.0,
            os.1,
            es.0,
            es.1
        );
        one_cpu.push(oc);
        eight_cpu.push(ec);
        one_sw.push(os.0 + os.1);
        eight_sw.push(es.0 + es.1);
        drop(store);
        std::fs::remove_dir_all(&dir).expect("round cleanup");
        floor.push(f);
        one.push(o);
        eight.push(e);
        groups.push(g);
    }
    let (f, o, e) = (median(floor), median(one), median(eight));
    println!(
        "PROBE median floor_us={f:.1} one_us={o:.1} eight_us={e:.1} per_group={:.2} \
         one_vs_floor={:.3} eight_vs_one={:.3} one_cpu_us={:.1} eight_cpu_us={:.1} \
         one_switches={:.2} eight_switches={:.2}",
        median(groups),
        f / o,
        o / e,
        median(one_cpu),
        median(eight_cpu),
        median(one_sw),
        median(eight_sw)
    );
}
