//! Group commit, measured: durable creates per second and syncs per create
//! with 1, 2, 4 and 8 concurrent writers on the file store, and the
//! process's CPU time per create and cores kept busy (user + system, the
//! engine's flush and compaction threads included; Linux `/proc`).
//!
//! `cargo run --release --example group_commit [-- CREATES_PER_WRITER]`

use std::time::Instant;

use agentstate::{FileStore, RunKey, RunRecord, StateStore};

fn main() -> agentstate::Result<()> {
    let per_writer: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(400);
    let dir = tempfile_dir();
    println!(
        "| writers | creates | durable creates/s | syncs per create | CPU µs per create | cores busy |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    for writers in [1usize, 2, 4, 8] {
        let path = dir.join(format!("w{writers}"));
        let store = FileStore::open(&path)?;
        let commits_before = store.commits();
        let cpu_before = cpu_secs();
        let start = Instant::now();
        std::thread::scope(|s| {
            for w in 0..writers {
                let store = &store;
                s.spawn(move || {
                    for i in 0..per_writer {
                        let key = RunKey::new("bench", format!("w{w}-{i}"));
                        store
                            .put_run(RunRecord::new(key, "planner"))
                            .expect("create");
                    }
                });
            }
        });
        let secs = start.elapsed().as_secs_f64();
        let creates = writers * per_writer;
        let syncs = store.commits() - commits_before;
        let cpu = cpu_secs().zip(cpu_before).map(|(a, b)| a - b);
        let (per, busy) = match cpu {
            Some(c) => (
                format!("{:.1}", c * 1e6 / creates as f64),
                format!("{:.2}", c / secs),
            ),
            None => ("-".into(), "-".into()),
        };
        println!(
            "| {writers} | {creates} | {:.0} | {:.2} | {per} | {busy} |",
            creates as f64 / secs,
            syncs as f64 / creates as f64
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// This process's CPU time so far, user + system (`/proc/self/stat`,
/// in clock ticks of 1/100 s); `None` off Linux.
fn cpu_secs() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The fields after the command name, which is in parentheses.
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("agentstate-group-commit-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // The stores are made inside it (a store's parent must exist).
    std::fs::create_dir_all(&dir).expect("create the example's temp dir");
    dir
}
