//! Group commit, measured: durable creates per second and syncs per create
//! with 1, 2, 4 and 8 concurrent writers on the file store.
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
    println!("| writers | creates | durable creates/s | syncs per create |");
    println!("|---:|---:|---:|---:|");
    for writers in [1usize, 2, 4, 8] {
        let path = dir.join(format!("w{writers}"));
        let store = FileStore::open(&path)?;
        let commits_before = store.commits();
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
        println!(
            "| {writers} | {creates} | {:.0} | {:.2} |",
            creates as f64 / secs,
            syncs as f64 / creates as f64
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("agentstate-group-commit-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}
