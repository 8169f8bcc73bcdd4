//! The CLI over `postgres://`: copy a file store to PostgreSQL and back.

use std::process::Command;

use agentstate::{
    InstanceKey, PostgresStore, RunKey, RunRecord, RunState, StateDelta, StateStore, StoreAdmin,
    Tray, TrayStore,
};

use crate::pg_server::fresh_db;

fn bin(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_agentstate"))
        .env_remove("AGENTSTATE_DB")
        .args(args)
        .output()
        .expect("the binary runs")
}

fn ok(args: &[&str]) -> String {
    let o = bin(args);
    assert!(
        o.status.success(),
        "{args:?}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// `agentstate copy`: file → postgres → file gives the same records;
/// every subcommand reads the postgres store.
#[test]
fn copy_file_to_postgres_and_back() {
    let dir = tempfile::tempdir().expect("tmp");
    let src = dir.path().join("src");
    {
        let f = agentstate::FileStore::open(&src).expect("open");
        f.put_session(agentstate::SessionRecord::new(agentstate::SessionKey::new(
            "acme", "s\0x",
        )))
        .expect("session");
        for i in 0..30 {
            let mut r = RunRecord::new(RunKey::new("acme", format!("run-{i}")), "planner")
                .with_session("s\0x");
            r.state = if i % 3 == 0 {
                RunState::Completed
            } else {
                RunState::Running
            };
            f.put_run(r).expect("run");
            f.patch_run(
                &RunKey::new("acme", format!("run-{i}")),
                StateDelta {
                    cost_micros: u64::MAX - i,
                    ..Default::default()
                },
            )
            .expect("patch");
        }
        let inst = InstanceKey::new("pinned", "w1");
        f.write_tray(
            &inst.tray("chat", "t1"),
            3,
            Tray {
                marked: true,
                doc: b"d".to_vec(),
                env: "prod".into(),
                hostname: "h".into(),
            },
        )
        .expect("tray");
        f.set_alarm(&inst, 3, u64::MAX).expect("alarm");
        // Spend caps: a budget, a capped run drawing from it, a live
        // hold and a settled one (ids with the escaped characters).
        use agentstate::{BudgetKey, BudgetRecord, BudgetStore, Caps, Hold};
        let ttl = agentstate::limits::HOLD_TTL_MILLIS_MAX;
        f.put_budget(BudgetRecord::new(
            BudgetKey::new("acme", "b\0x"),
            Caps::new().cost_micros(1_000).tokens(500),
        ))
        .expect("budget");
        f.put_budget(BudgetRecord::new(
            BudgetKey::new("acme", "a"),
            Caps::new().iterations(1),
        ))
        .expect("budget a");
        for id in ["capped", "capped\u{1}2"] {
            let run = f
                .put_run(
                    RunRecord::new(RunKey::new("acme", id), "planner")
                        .with_caps(Caps::new().iterations(9))
                        .with_budget("b\0x"),
                )
                .expect("capped run");
            f.reserve(&run.key, Hold::new("h\u{1}1", ttl).cost_micros(300))
                .expect("hold");
            f.reserve(&run.key, Hold::new("h\u{0}", ttl).tokens(100))
                .expect("hold 2");
            f.settle(
                &run.key,
                "h\u{0}",
                StateDelta {
                    cost_micros: 200,
                    iterations: 9,
                    ..Default::default()
                },
            )
            .expect("settle");
        }
    }
    let pg = fresh_db("copy");
    let out = ok(&["copy", "--from", src.to_str().expect("utf8"), "--to", &pg]);
    assert!(out.contains("match"), "copy says the stores match: {out}");
    // Subcommands over --db postgres://.
    let runs = ok(&["--db", &pg, "runs", "list", "--tenant", "acme"]);
    assert!(runs.contains("run-29"), "{runs}");
    let stats = ok(&["--db", &pg, "stats"]);
    assert!(stats.contains("postgres"), "{stats}");
    let verify = ok(&["--db", &pg, "verify"]);
    assert!(!verify.to_lowercase().contains("problem:"), "{verify}");
    let back = dir.path().join("back");
    let out = ok(&["copy", "--from", &pg, "--to", back.to_str().expect("utf8")]);
    assert!(out.contains("match"), "{out}");
    let a: Vec<_> = agentstate::FileStore::open(&src)
        .expect("src")
        .iter_export()
        .map(|e| e.expect("entry"))
        .collect();
    let b: Vec<_> = agentstate::FileStore::open(&back)
        .expect("back")
        .iter_export()
        .map(|e| e.expect("entry"))
        .collect();
    assert_eq!(a, b, "file → postgres → file keeps every record");
    assert_eq!(
        a.iter()
            .filter(|e| matches!(
                e,
                agentstate::Entry::Hold { .. } | agentstate::Entry::Budget { .. }
            ))
            .count(),
        4,
        "two live holds and two budgets are exported"
    );
    // The same counts on both backends.
    let on_pg = PostgresStore::connect(&pg)
        .expect("pg")
        .stats()
        .expect("stats");
    let on_file = agentstate::FileStore::open(&back)
        .expect("back")
        .stats()
        .expect("stats");
    assert_eq!(on_pg.tenants, on_file.tenants);
    let t = &on_pg.tenants["acme"];
    assert_eq!((t.budgets, t.holds, t.runs_at_cap), (2, 2, 2));
    // A database without the schema is a clear error for reads.
    let empty = fresh_db("empty");
    let o = bin(&["--db", &empty, "stats"]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("setup")
            || String::from_utf8_lossy(&o.stderr).contains("schema"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// `watch` over `postgres://` is woken by another process's commit: the
/// CLI waits in LISTEN; this test process writes; the CLI prints the run
/// and exits (`--count 1`).
#[test]
fn watch_is_woken_by_another_process_commit() {
    let pg = fresh_db("watch");
    let store = PostgresStore::connect(&pg).expect("connect");
    store.setup().expect("setup");
    let child = Command::new(env!("CARGO_BIN_EXE_agentstate"))
        .env_remove("AGENTSTATE_DB")
        .args([
            "--db", &pg, "watch", "--tenant", "acme", "--count", "1", "--json",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the binary runs");
    // The watch takes its head before it waits: give it time to start.
    std::thread::sleep(std::time::Duration::from_millis(500));
    store
        .put_run(RunRecord::new(RunKey::new("acme", "woken"), "planner"))
        .expect("put");
    let began = std::time::Instant::now();
    let out = child.wait_with_output().expect("the watch ends");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = String::from_utf8(out.stdout).expect("UTF-8");
    let change: agentstate::Change = serde_json::from_str(line.trim()).expect("one Change");
    assert!(
        matches!(&change.item, agentstate::Changed::Run { run } if run.key.run_id == "woken"),
        "{line}"
    );
    assert!(
        began.elapsed() < std::time::Duration::from_secs(10),
        "woken after {:?}",
        began.elapsed()
    );
}
