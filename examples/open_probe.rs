//! The open probe: how long a file store takes to open (and serve its first
//! point read) after a bulk load, after a clean close and after a kill -9,
//! and how much memory the load took.
//!
//! ```text
//! AGENTSTATE_PROBE_N=1000000 cargo run --release --example open_probe -- [--dir DIR] [--opens 5]
//! ```
//!
//! One binary is parent and children (`AGENTSTATE_PROBE_CHILD`). The
//! parent
//!
//! 1. runs a child that creates N runs with `Durability::Buffered` from 8
//!    threads, walks them all with pages of 1000 (its peak RSS, `VmHWM`,
//!    is `rss_mib_1m` of `benches/compare.rs` at N = 1M) and closes the
//!    store (`clean`);
//! 2. opens that store `--opens` times, each in a fresh child process that
//!    times `FileStore::open_with` and one `get_run` (`open_ms`, `read_ms`);
//! 3. runs a child that loads another N runs into a second store and is
//!    killed with SIGKILL once it reports the load done (`kill`), then times
//!    the opens of that store the same way (the first open recovers; the
//!    later ones open what the first one left).
//!
//! The lines it prints:
//!
//! ```text
//! PROBE load n=N clean=true load_s=… walk_s=… close_s=… hwm_load_mib=… hwm_mib=… journal_mib=…
//! PROBE open case=clean i=0 open_ms=… read_ms=… total_ms=… hwm_mib=… journal_mib=…
//! PROBE summary case=clean median_ms=… first_ms=… …
//! ```
//!
//! `total_ms` is open + first read, in a process that has not touched the
//! store before (the page cache is warm: the files were just written).
//!
//! For profiling: `AGENTSTATE_PROBE_KEEP=DIR` copies the killed store to
//! `DIR` before any open recovers it (to reopen fresh copies of it again
//! and again), and the child mode `open-loop:N:DIR` opens a store
//! `AGENTSTATE_PROBE_LOOPS` times (default 100) in one process and prints
//! the min, median and max of open + first read.

#![allow(clippy::print_stdout)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

use agentstate::{
    Durability, FileStore, Options, PageRequest, RunKey, RunRecord, StateQuery, StateStore,
};

/// `MODE:N:DIR` with MODE `load-close`, `load-kill` or `open`.
const CHILD_ENV: &str = "AGENTSTATE_PROBE_CHILD";
/// The number of runs each load creates.
const N_ENV: &str = "AGENTSTATE_PROBE_N";
const LOADERS: u64 = 8;

#[path = "../benches/support/records.rs"]
#[allow(dead_code)] // the bench's clock, unused here
mod records;
use records::{TENANT, listing_state, record as record_of, run_id};

/// The i-th run, as `benches/compare.rs` writes it.
fn record(i: u64) -> RunRecord {
    record_of(TENANT, run_id(i), listing_state(i))
}

/// `Durability::Buffered`, and the memory bounds from
/// `AGENTSTATE_PROBE_CACHE_MIB` / `AGENTSTATE_PROBE_WRITE_BUFFER_MIB` when
/// set (else the defaults).
fn buffered() -> Options {
    let mib = |var: &str| {
        std::env::var(var)
            .ok()
            .map(|v| v.parse::<u64>().expect("a number of MiB") << 20)
    };
    let mut o = Options::new().durability(Durability::Buffered);
    if let Some(b) = mib("AGENTSTATE_PROBE_CACHE_MIB") {
        o = o.cache_bytes(b);
    }
    if let Some(b) = mib("AGENTSTATE_PROBE_WRITE_BUFFER_MIB") {
        o = o.write_buffer_bytes(b);
    }
    o
}

fn vm_hwm_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .unwrap_or(0.0)
        / 1024.0
}

/// Bytes of fjall journal (`db/*.jnl`) data in the store: the file sizes
/// as `du` counts them (fjall preallocates its journals sparsely).
fn journal_mib(dir: &Path) -> f64 {
    let Ok(entries) = std::fs::read_dir(dir.join("db")) else {
        return 0.0;
    };
    // Each journal up to its last byte that is not zero: journals start
    // sparse (fjall) or in zeros written ahead (the spare), so neither
    // their length nor their blocks say how much was written.
    let bytes: u64 = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".jnl"))
        .map(|e| std::fs::read(e.path()).unwrap_or_default())
        .map(|b| b.iter().rposition(|&x| x != 0).map_or(0, |p| p + 1) as u64)
        .sum();
    bytes as f64 / (1024.0 * 1024.0)
}

fn load(dir: &Path, n: u64) -> Arc<FileStore> {
    let store = Arc::new(FileStore::open_with(dir, buffered()).expect("open for the load"));
    let handles: Vec<_> = (0..LOADERS)
        .map(|w| {
            let store = store.clone();
            std::thread::spawn(move || {
                let mut i = w;
                while i < n {
                    store.put_run(record(i)).expect("create");
                    i += LOADERS;
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("loader");
    }
    store
}

fn child(spec: &str) {
    let mut parts = spec.splitn(3, ':');
    let mode = parts.next().expect("mode");
    let n: u64 = parts.next().expect("n").parse().expect("n");
    let dir = PathBuf::from(parts.next().expect("dir"));
    match mode {
        "load-close" | "load-kill" => {
            let t = Instant::now();
            let store = load(&dir, n);
            let load_s = t.elapsed().as_secs_f64();
            if mode == "load-kill" {
                // The parent kills this process with SIGKILL on this line.
                println!(
                    "PROBE load n={n} clean=false load_s={load_s:.2} hwm_mib={:.1} journal_mib={:.1}",
                    vm_hwm_mib(),
                    journal_mib(&dir)
                );
                loop {
                    std::thread::sleep(std::time::Duration::from_secs(1));
                }
            }
            // As `rss_mib_1m` in benches/compare.rs: walk every run with
            // pages of 1000, then read the peak.
            let hwm_load = vm_hwm_mib();
            let walked = Instant::now();
            let mut seen = 0u64;
            let mut page = PageRequest::new(1000);
            loop {
                let got = store
                    .list_runs(&StateQuery::new(TENANT), &page)
                    .expect("list");
                let (items, cursor) = got.into_parts();
                seen += items.len() as u64;
                match cursor {
                    Some(c) => page = page.with_cursor(Some(c)),
                    None => break,
                }
            }
            assert_eq!(seen, n);
            let walk_s = walked.elapsed().as_secs_f64();
            let hwm_walk = vm_hwm_mib();
            let closing = Instant::now();
            drop(store);
            println!(
                "PROBE load n={n} clean=true load_s={load_s:.2} walk_s={walk_s:.2} close_s={:.2} hwm_load_mib={hwm_load:.1} hwm_mib={hwm_walk:.1} journal_mib={:.1}",
                closing.elapsed().as_secs_f64(),
                journal_mib(&dir)
            );
        }
        "open" => {
            let t = Instant::now();
            let store = FileStore::open_with(&dir, buffered()).expect("open");
            let open = t.elapsed();
            let key = RunKey::new(TENANT, run_id(n / 2));
            let got = store.get_run(&key).expect("first read");
            let total = t.elapsed();
            assert!(got.is_some(), "run {} is missing after the open", n / 2);
            let read = total - open;
            println!(
                "PROBE open open_ms={:.3} read_ms={:.3} total_ms={:.3} hwm_mib={:.1} journal_mib={:.1}",
                open.as_secs_f64() * 1e3,
                read.as_secs_f64() * 1e3,
                total.as_secs_f64() * 1e3,
                vm_hwm_mib(),
                journal_mib(&dir)
            );
        }
        "open-loop" => {
            // Opens (and first reads) over and over in one process: the
            // open's steady-state cost, for `perf record`.
            let loops: usize = std::env::var("AGENTSTATE_PROBE_LOOPS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(100);
            let mut times = Vec::with_capacity(loops);
            for _ in 0..loops {
                let t = Instant::now();
                let store = FileStore::open_with(&dir, buffered()).expect("open");
                let got = store.get_run(&RunKey::new(TENANT, run_id(n / 2)));
                assert!(got.expect("first read").is_some());
                times.push(t.elapsed().as_secs_f64() * 1e3);
                drop(store);
            }
            times.sort_by(f64::total_cmp);
            println!(
                "PROBE open-loop loops={loops} min_ms={:.3} median_ms={:.3} max_ms={:.3}",
                times[0],
                times[loops / 2],
                times[loops - 1]
            );
        }
        other => panic!("unknown probe mode {other}"),
    }
}

/// Runs a child and returns its `PROBE` line (the first one, for
/// `load-kill`, after which the child is killed).
fn run_child(mode: &str, n: u64, dir: &Path) -> String {
    let exe = std::env::current_exe().expect("current exe");
    let mut c = Command::new(exe)
        .env(CHILD_ENV, format!("{mode}:{n}:{}", dir.display()))
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn child");
    let out = c.stdout.take().expect("stdout");
    let mut line = String::new();
    for l in BufReader::new(out).lines() {
        let l = l.expect("child stdout");
        if l.starts_with("PROBE ") {
            line = l;
            break;
        }
    }
    if mode == "load-kill" {
        c.kill().expect("SIGKILL the loader");
    }
    let status = c.wait().expect("wait child");
    assert!(
        mode == "load-kill" || status.success(),
        "child {mode} failed: {status}"
    );
    assert!(!line.is_empty(), "child {mode} printed no PROBE line");
    line
}

fn field(line: &str, name: &str) -> f64 {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

fn opens(case: &str, n: u64, dir: &Path, count: usize) {
    let mut totals = Vec::new();
    for i in 0..count {
        let line = run_child("open", n, dir);
        println!(
            "PROBE open case={case} i={i} {}",
            line.trim_start_matches("PROBE open ")
        );
        totals.push(field(&line, "total_ms"));
    }
    let first = totals[0];
    let mut sorted = totals.clone();
    sorted.sort_by(f64::total_cmp);
    println!(
        "PROBE summary case={case} n={n} first_ms={first:.3} median_ms={:.3} max_ms={:.3}",
        sorted[sorted.len() / 2],
        sorted[sorted.len() - 1]
    );
}

fn main() {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        child(&spec);
        return;
    }
    let n: u64 = std::env::var(N_ENV)
        .ok()
        .map(|v| v.parse().expect("AGENTSTATE_PROBE_N is a number"))
        .unwrap_or(100_000);
    let mut args = std::env::args().skip(1);
    let mut base: Option<PathBuf> = None;
    let mut count = 5usize;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--dir" => base = Some(args.next().expect("--dir DIR").into()),
            "--opens" => count = args.next().expect("--opens K").parse().expect("K"),
            other => panic!("unknown argument {other}"),
        }
    }
    let tmp;
    let base = match base {
        Some(b) => b,
        None => {
            tmp = tempfile::tempdir().expect("tempdir");
            tmp.path().to_path_buf()
        }
    };
    let clean = base.join("clean");
    let killed = base.join("killed");
    for d in [&clean, &killed] {
        let _ = std::fs::remove_dir_all(d);
    }
    std::fs::create_dir_all(&base).expect("creating --dir");
    println!("PROBE loadavg {}", load_avg());
    println!("{}", run_child("load-close", n, &clean));
    opens("clean", n, &clean, count.max(1));
    println!("{}", run_child("load-kill", n, &killed));
    if let Ok(keep) = std::env::var("AGENTSTATE_PROBE_KEEP") {
        // A copy of the killed store before any open recovers it, for
        // profiling the recovery again and again.
        let ok = Command::new("cp")
            .args(["-a", "--sparse=always"])
            .arg(&killed)
            .arg(&keep)
            .status()
            .expect("cp");
        assert!(ok.success(), "copying the killed store to {keep}");
    }
    opens("kill", n, &killed, count.max(1));
    println!("PROBE loadavg {}", load_avg());
}

fn load_avg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}
