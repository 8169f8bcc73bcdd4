//! The server-CPU probe: what one PostgreSQL call of the store costs the
//! server, so two builds can be compared side by side.
//!
//! ```text
//! cargo build --release --features postgres --example pg_server_cpu
//! target/release/examples/pg_server_cpu DSN [CALLS] [ROUNDS]
//! ```
//!
//! For a server on this machine (it reads the CPU time of every process
//! of the server's OS user from `/proc`, so run nothing else against that
//! server meanwhile). In a schema of its own (dropped after), it creates
//! 1,000 runs, then times `CALLS` (default 20,000) `patch_run`s of them
//! from one thread, `ROUNDS` times (default 3), and prints per call the
//! wall time and the server's CPU time (user and system, its background
//! processes included; a process that exits within a round, such as an
//! autovacuum worker, is not counted):
//!
//! ```text
//! PROBE round=0 calls=… us_per_call=… server_cpu_us_per_call=…
//! ```
//!
//! With `AGENTSTATE_PROBE_SQL=FILE`, the file's SQL runs on the probe's
//! schema right after `setup()` (`{s}` is the schema with its dot, as in
//! `crates/postgres/src/schema/`): a variant of a trigger or function,
//! measured against the shipped one by the same binary.

#![allow(clippy::print_stdout)]

use std::time::Instant;

use agentstate::{PgOptions, PostgresStore, RunKey, RunRecord, StateDelta, StateStore};

/// Every process: its real user, whether it is named `postgres`, and the
/// numeric fields of its `stat` after the command's closing parenthesis
/// (field 3 of the line is the first of them).
fn processes() -> Vec<(u32, bool, Vec<u64>)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let path = e.path();
        let (Ok(status), Ok(stat)) = (
            std::fs::read_to_string(path.join("status")),
            std::fs::read_to_string(path.join("stat")),
        ) else {
            continue;
        };
        let uid = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|u| u.parse::<u32>().ok());
        let (Some(uid), Some((head, rest))) = (uid, stat.rsplit_once(')')) else {
            continue;
        };
        let fields = rest
            .split_whitespace()
            .map(|x| x.parse().unwrap_or(0))
            .collect();
        out.push((uid, head.ends_with("(postgres"), fields));
    }
    out
}

/// Ticks of CPU (utime, stime, cutime, cstime: fields 14-17 of the line)
/// of every process whose real user is `uid`.
fn cpu_ticks_of(uid: u32) -> u64 {
    processes()
        .iter()
        .filter(|p| p.0 == uid)
        .map(|p| p.2.get(11..15).map_or(0, |t| t.iter().sum::<u64>()))
        .sum()
}

/// The server's OS user: the owner of the oldest process named
/// `postgres` (its postmaster; start time is field 22 of the line).
fn server_uid() -> u32 {
    processes()
        .into_iter()
        .filter(|p| p.1)
        .min_by_key(|p| p.2.get(19).copied().unwrap_or(u64::MAX))
        .map(|p| p.0)
        .expect("a PostgreSQL server runs on this machine")
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dsn = args.get(1).expect("DSN");
    let calls: u64 = args.get(2).map_or(20_000, |a| a.parse().expect("CALLS"));
    let rounds: u64 = args.get(3).map_or(3, |a| a.parse().expect("ROUNDS"));
    let schema = format!("cpu_probe_{}", std::process::id());
    let store =
        PostgresStore::connect_with(dsn, PgOptions::new().schema(&schema)).expect("connect");
    store.setup().expect("setup");
    let mut c = postgres::Client::connect(dsn, postgres::NoTls).expect("raw");
    if let Ok(file) = std::env::var("AGENTSTATE_PROBE_SQL") {
        let sql = std::fs::read_to_string(&file).expect("AGENTSTATE_PROBE_SQL: a readable file");
        c.batch_execute(&sql.replace("{s}", &format!("{schema}.")))
            .expect("AGENTSTATE_PROBE_SQL: its SQL");
        println!("PROBE variant={file}");
    }
    let keys: Vec<RunKey> = (0..1000)
        .map(|i| RunKey::new("t", format!("r{i:04}")))
        .collect();
    for k in &keys {
        store
            .put_run(RunRecord::new(k.clone(), "agent"))
            .expect("create");
    }
    let uid = server_uid();
    // `/proc` counts in USER_HZ, 100 a second on Linux.
    let hz = 100.0;
    for round in 0..rounds {
        let cpu = cpu_ticks_of(uid);
        let t = Instant::now();
        for i in 0..calls {
            store
                .patch_run(&keys[(i % 1000) as usize], StateDelta::default())
                .expect("patch");
        }
        let us = t.elapsed().as_secs_f64() * 1e6 / calls as f64;
        let server = (cpu_ticks_of(uid).saturating_sub(cpu)) as f64 / hz * 1e6 / calls as f64;
        println!(
            "PROBE round={round} calls={calls} us_per_call={us:.1} server_cpu_us_per_call={server:.1}"
        );
    }
    drop(store);
    c.batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .expect("drop the probe's schema");
}
