//! The D rules: durability and files of the embedded file store.
//!
//! Several tests need a second process. They start this test binary again
//! (`std::env::current_exe()`), running only one `*_child_entry` test with
//! `--exact`, selected by an environment variable; without it those entries
//! return at once. The crash harness itself is `examples/crash.rs`, included
//! here as a module so the test and the example run the same code.
//!
//! Slow checks take their size from the environment (short defaults):
//! `AGENTSTATE_CRASH_CYCLES` (d1, default 5), `AGENTSTATE_CRASH_SEED`,
//! `AGENTSTATE_D5_SWEEP=1` (d5: flip every byte of a journal window, not a
//! few), `AGENTSTATE_D5_TABLES=1` (d5: damage the data keyspace's table
//! files, which takes writing 64 MiB first), `AGENTSTATE_D7_TRIES` (default 30), `AGENTSTATE_D9_ROUNDS`
//! (default 200). `AGENTSTATE_D6_NO_MOUNT=1` runs d6's fallback (a file-size
//! limit instead of a full tmpfs) even as root.
//!
//! fjall 3.1.13 checksums a journal batch's items but not its `Start` entry
//! (item count and sequence number), so a flipped sequence number silently
//! moves the batch after its neighbours: a run written again in the batches
//! it jumps over read as its older version (in a 120-run store, 43 of 226
//! flips), with no error. The store now checks the replay against the
//! journal's order at open (`kv/engine/journal.rs`);
//! `d5_renumbered_journal_batches_are_corrupt_never_older_data` flips the low
//! byte of every batch's sequence number.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentstate::{
    Approval, Entry, FileStore, InstanceKey, ManualClock, Options, PageRequest, PersistenceReason,
    RunKey, RunRecord, RunState, SessionKey, SessionRecord, StateDelta, StateError, StateQuery,
    StateStore, StoreAdmin, ToolCall, Tray, TrayKey, TrayOp, TrayStore, Usage,
};

#[path = "../../examples/crash.rs"]
#[allow(dead_code)]
mod crash;

// ---------------------------------------------------------------------------
// Helpers.

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// This test binary, running only the test `entry` (a child entry point).
fn self_command(entry: &str) -> Command {
    let mut c = Command::new(std::env::current_exe().expect("test binary path"));
    c.args(["--exact", entry, "--nocapture", "--test-threads=1", "-q"]);
    c
}

/// The lines of a child's stdout that start with `prefix`, without it.
fn child_lines(stdout: &[u8], prefix: &str) -> Vec<String> {
    String::from_utf8_lossy(stdout)
        .lines()
        .filter_map(|l| l.strip_prefix(prefix).map(str::to_string))
        .collect()
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        let to = dst.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to);
        } else {
            std::fs::copy(e.path(), &to).unwrap();
        }
    }
}

/// Every file under `dir` (relative path → bytes).
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, Vec<u8>>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                walk(root, &e.path(), out);
            } else {
                let rel = e.path().strip_prefix(root).unwrap().to_path_buf();
                out.insert(rel, std::fs::read(e.path()).unwrap());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

/// A printable name for an exported entry.
fn entry_key(e: &Entry) -> String {
    match e {
        Entry::Run(r) => format!("run/{}/{}", r.key.tenant, r.key.run_id),
        Entry::Session(s) => format!("session/{}/{}", s.key.tenant, s.key.session_id),
        Entry::Epoch { instance, .. } => format!("epoch/{}/{}", instance.ns, instance.id),
        Entry::Tray { key, .. } => {
            format!("tray/{}/{}/{}/{}", key.ns, key.id, key.tray_ns, key.tray_id)
        }
        Entry::Alarm { instance, .. } => format!("alarm/{}/{}", instance.ns, instance.id),
        Entry::Budget { budget, .. } => format!("budget/{}/{}", budget.key.tenant, budget.key.name),
        Entry::Hold { run, hold } => format!("hold/{}/{}/{}", run.tenant, run.run_id, hold.id),
    }
}

/// Every record of a store, through the export listing (`limit` a page).
fn export_list(store: &FileStore, limit: usize) -> Result<Vec<Entry>, StateError> {
    store.iter_export().page_size(limit).collect()
}

/// `export_list` by key; a key listed twice fails the test.
fn export_all(store: &FileStore, limit: usize) -> Result<BTreeMap<String, Entry>, StateError> {
    let mut out = BTreeMap::new();
    for e in export_list(store, limit)? {
        let k = entry_key(&e);
        assert!(out.insert(k.clone(), e).is_none(), "{k} exported twice");
    }
    Ok(out)
}

fn tray(marked: bool, doc: &[u8], env: &str) -> Tray {
    Tray {
        marked,
        doc: doc.to_vec(),
        env: env.to_string(),
        hostname: "host-a".to_string(),
    }
}

// ---------------------------------------------------------------------------
// D1: a kill -9 at any moment loses no acknowledged write, tears none.

/// Child entry point of the crash harness (d1) and of creation kills (d7);
/// does nothing unless `AGENTSTATE_CRASH_CHILD` is set.
#[test]
fn d1_child_entry() {
    crash::child_main_if_requested();
}

#[test]
fn d1_acknowledged_writes_survive_kill_9() {
    d1_on(agentstate::FileEngine::Fjall);
}

/// D1 on the sled engine: its `flush` alone is no durable sync.
#[cfg(feature = "sled")]
#[test]
fn d1_sled_acknowledged_writes_survive_kill_9() {
    d1_on(agentstate::FileEngine::Sled);
}

fn d1_on(engine: agentstate::FileEngine) {
    let cycles = env_u64("AGENTSTATE_CRASH_CYCLES", 5);
    let dir = tempfile::tempdir().unwrap();
    let cfg = crash::Config {
        cycles,
        seed: env_u64("AGENTSTATE_CRASH_SEED", 11),
        dir: dir.path().to_path_buf(),
        max_ms: 300,
        verbose: false,
        engine,
    };
    let started = Instant::now();
    let s = crash::run(&cfg, &|| self_command("durability::d1_child_entry"));
    eprintln!(
        "d1 ({}): {} in {:.1} s; {} in flight at kills ({} applied), {} kills while opening",
        engine.name(),
        s.last_line(),
        started.elapsed().as_secs_f64(),
        s.in_flight,
        s.in_flight_applied,
        s.kills_during_open
    );
    assert!(s.ok(), "{}\n{}", s.details.join("\n"), s.last_line());
    assert_eq!(s.cycles, cycles);
    assert!(s.acked > 0, "no write was acknowledged: {}", s.last_line());
}

// ---------------------------------------------------------------------------
// D3: one process per store path.

const D3_ENV: &str = "AGENTSTATE_D3_CHILD";

/// Child entry point of d3: tries to open the store at `$AGENTSTATE_D3_CHILD`
/// and says how it went.
#[test]
fn d3_child_entry() {
    let Some(path) = std::env::var_os(D3_ENV) else {
        return;
    };
    let t = Instant::now();
    let r = FileStore::open(&path);
    let ms = t.elapsed().as_millis();
    let line = match &r {
        Ok(_) => format!("d3 opened {ms}"),
        Err(StateError::Locked {
            path,
            this_process: false,
        }) => format!("d3 locked {ms} {}", path.display()),
        Err(e) => format!("d3 error {ms} {e}"),
    };
    let mut out = std::io::stdout().lock();
    writeln!(out, "\n{line}").unwrap();
    out.flush().unwrap();
    drop(r);
    std::process::exit(0);
}

/// Opens the store from another process; returns its `d3 …` line.
fn d3_probe(path: &Path) -> String {
    let out = self_command("durability::d3_child_entry")
        .env(D3_ENV, path)
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    let lines = child_lines(&out.stdout, "d3 ");
    assert_eq!(
        lines.len(),
        1,
        "child said {:?}",
        String::from_utf8_lossy(&out.stdout)
    );
    lines[0].clone()
}

/// D3's other side: once the last handle is dropped the path is free, so
/// the same process reopens it at once, on every engine, however busy the
/// engine's own threads were at the close (sled's once held its file lock
/// for a moment after its last handle went).
fn d3_reopens_at_once_after_a_close_on(engine: agentstate::FileEngine) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let rounds = env_u64("AGENTSTATE_D3_REOPENS", 20);
    for round in 0..rounds {
        let t = Instant::now();
        let opts = agentstate::Options::new()
            .engine(engine)
            .flush_at_close(round % 2 == 0);
        let store = FileStore::open_with(&path, opts).unwrap_or_else(|e| {
            panic!("{} round {round}: reopen after a close: {e}", engine.name())
        });
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{} round {round}: the open took {:?}",
            engine.name(),
            t.elapsed()
        );
        for i in 0..8 {
            store
                .put_run(RunRecord::new(
                    RunKey::new("t", format!("r{round}-{i}")),
                    "a",
                ))
                .unwrap();
        }
        // A big value, which sled writes out through threads of its own;
        // every other round closed without the flush at close.
        let doc: Vec<u8> = (0..300_000u64).map(|j| (j ^ round) as u8).collect();
        let tray = Tray {
            marked: false,
            doc,
            env: "prod".into(),
            hostname: "h".into(),
        };
        store
            .write_tray(&InstanceKey::new("w", "1").tray("big", "d"), 1, tray)
            .unwrap();
        assert!(
            store
                .get_run(&RunKey::new("t", format!("r{round}-7")))
                .unwrap()
                .is_some()
        );
        drop(store);
    }
}

const D3_THREADS_ENV: &str = "AGENTSTATE_D3_THREADS_CHILD";

/// The threads of this process named `name` (`/proc/self/task/*/comm`).
#[cfg(target_os = "linux")]
fn threads_named(name: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.trim_end() == name)
        .count()
}

/// Child entry point: opens, writes to and drops a store, round after
/// round, and counts the engine's worker threads left right after each
/// drop (alone in its process, so no other test's store has any).
#[cfg(target_os = "linux")]
#[test]
fn d3_threads_child_entry() {
    let Some(rounds) = std::env::var_os(D3_THREADS_ENV) else {
        return;
    };
    let rounds: u64 = rounds.to_str().unwrap().parse().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut out = std::io::stdout().lock();
    for round in 0..rounds {
        let path = dir.path().join(format!("store-{}", round % 2));
        let store = FileStore::open(&path).unwrap();
        for i in 0..4 {
            store
                .put_run(RunRecord::new(
                    RunKey::new("t", format!("r{round}-{i}")),
                    "a",
                ))
                .unwrap();
        }
        drop(store);
        let left = threads_named("fjall:worker");
        writeln!(out, "\nd3threads {round} {left}").unwrap();
    }
    out.flush().unwrap();
    std::process::exit(0);
}

/// D3's close: dropping the last handle stops every engine worker thread
/// before it returns, so nothing of the store runs on after its close (a
/// worker finishing its exit after the drop returned was seen as a leak
/// by the fuzzers' leak check when the process ended right then).
#[cfg(target_os = "linux")]
#[test]
fn d3_a_closed_store_leaves_no_engine_thread() {
    let rounds = env_u64("AGENTSTATE_D3_REOPENS", 20);
    let out = self_command("durability::d3_threads_child_entry")
        .env(D3_THREADS_ENV, rounds.to_string())
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    let lines = child_lines(&out.stdout, "d3threads ");
    assert_eq!(
        lines.len() as u64,
        rounds,
        "child said {:?}",
        String::from_utf8_lossy(&out.stdout)
    );
    let lingering: Vec<_> = lines.iter().filter(|l| !l.ends_with(" 0")).collect();
    assert!(
        lingering.is_empty(),
        "worker threads still there right after the drop (round, count): {lingering:?}"
    );
}

#[test]
fn d3_a_closed_store_reopens_at_once() {
    d3_reopens_at_once_after_a_close_on(agentstate::FileEngine::Fjall);
}

#[cfg(feature = "sled")]
#[test]
fn d3_sled_a_closed_store_reopens_at_once() {
    // Other sled stores of the process busy beside it, as in a test run:
    // sled's writes go through one thread pool per process.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let dir = tempfile::tempdir().unwrap();
    let busy: Vec<_> = (0..2)
        .map(|n| {
            let (stop, path) = (stop.clone(), dir.path().join(format!("busy{n}")));
            std::thread::spawn(move || {
                let store = FileStore::open_with(
                    &path,
                    agentstate::Options::new().engine(agentstate::FileEngine::Sled),
                )
                .unwrap();
                let mut i = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let tray = Tray {
                        marked: false,
                        doc: vec![i as u8; 300_000],
                        env: "prod".into(),
                        hostname: "h".into(),
                    };
                    store
                        .write_tray(
                            &InstanceKey::new("w", "1").tray("b", format!("{}", i % 4)),
                            1,
                            tray,
                        )
                        .unwrap();
                    i += 1;
                }
            })
        })
        .collect();
    d3_reopens_at_once_after_a_close_on(agentstate::FileEngine::Sled);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for b in busy {
        b.join().unwrap();
    }
}

#[test]
fn d3_a_second_open_fails_at_once_naming_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let store = FileStore::open(&path).unwrap();
    store
        .put_run(RunRecord::new(RunKey::new("t", "r"), "a"))
        .unwrap();

    // Another process: Locked, naming the path, well within a second.
    let line = d3_probe(&path);
    let rest = line
        .strip_prefix("locked ")
        .unwrap_or_else(|| panic!("child: {line}"));
    let (ms, named) = rest.split_once(' ').unwrap();
    let ms: u64 = ms.parse().unwrap();
    assert!(ms < 1000, "the child waited {ms} ms for Locked");
    eprintln!("d3: another process got Locked after {ms} ms");
    assert_eq!(Path::new(named), path, "Locked must name the store's path");

    // This process: at once, also through another spelling of the path.
    for p in [path.clone(), dir.path().join(".").join("store")] {
        let t = Instant::now();
        match FileStore::open(&p) {
            Err(
                e @ StateError::Locked {
                    this_process: true, ..
                },
            ) => {
                let StateError::Locked { path: named, .. } = &e else {
                    unreachable!()
                };
                assert_eq!(named, &p);
                assert_eq!(
                    e.to_string(),
                    format!(
                        "store {} is already open in this process (drop the other handle first)",
                        p.display()
                    )
                );
            }
            other => panic!("second open in-process: {other:?}"),
        }
        assert!(
            t.elapsed() < Duration::from_millis(100),
            "in-process refusal took {:?}",
            t.elapsed()
        );
    }

    // Threads of this process share the one handle.
    let store = Arc::new(store);
    std::thread::scope(|s| {
        for i in 0..4 {
            let store = store.clone();
            s.spawn(move || {
                store
                    .patch_run(
                        &RunKey::new("t", "r"),
                        StateDelta {
                            cost_micros: 1 + i,
                            ..Default::default()
                        },
                    )
                    .unwrap();
            });
        }
    });
    assert_eq!(
        store
            .get_run(&RunKey::new("t", "r"))
            .unwrap()
            .unwrap()
            .cost_micros,
        1 + 2 + 3 + 4
    );

    // Once closed, both this process and another can open it.
    drop(store);
    let again = FileStore::open(&path).unwrap();
    assert_eq!(
        again
            .get_run(&RunKey::new("t", "r"))
            .unwrap()
            .unwrap()
            .version,
        5
    );
    drop(again);
    let line = d3_probe(&path);
    assert!(
        line.starts_with("opened "),
        "after close, the child got: {line}"
    );
}

// ---------------------------------------------------------------------------
// D4: golden fixtures of earlier releases open and read; a newer format is
// refused without a byte changed.

fn fixture_v1() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/v1")
}

/// The clock reading of the fixture's `n`th write (see make_fixtures).
const fn at(n: u64) -> u64 {
    1_700_000_000_000 + n * 1_000
}

fn run_rec(tenant: &str, id: &str, agent: &str) -> RunRecord {
    RunRecord::new(RunKey::new(tenant, id), agent)
}

/// The fixture's runs, exactly as `examples/make_fixtures.rs` left them.
fn fixture_runs() -> Vec<RunRecord> {
    let s1 = Some("s1".to_string());
    vec![
        RunRecord {
            version: 1,
            seq: 1,
            created_at: at(2),
            updated_at: at(2),
            ..run_rec("acme", "r_pending", "planner")
        },
        RunRecord {
            version: 3,
            state: RunState::Running,
            session_id: s1.clone(),
            messages_read: 3,
            usage: Usage {
                input_tokens: 1_200,
                output_tokens: 340,
            },
            cost_micros: 5_250,
            iterations: 2,
            seq: 2,
            created_at: at(3),
            updated_at: at(5),
            ..run_rec("acme", "r_running", "planner")
        },
        RunRecord {
            version: 2,
            state: RunState::Running,
            session_id: s1.clone(),
            pending_tool_calls: vec![
                ToolCall {
                    id: "call_1".into(),
                    name: "search".into(),
                    arguments: r#"{"q":"rust fjall"}"#.into(),
                },
                ToolCall {
                    id: "call_2".into(),
                    name: "read_file".into(),
                    arguments: r#"{"path":"src/lib.rs"}"#.into(),
                },
            ],
            seq: 3,
            created_at: at(6),
            updated_at: at(7),
            ..run_rec("acme", "r_tools", "coder")
        },
        RunRecord {
            version: 2,
            state: RunState::AwaitingApproval,
            approval: Some(Approval {
                id: "ap_1".into(),
                prompt: "Send the email to the board?".into(),
            }),
            pending_tool_calls: vec![ToolCall {
                id: "call_9".into(),
                name: "send_email".into(),
                arguments: r#"{"to":"board@example.com"}"#.into(),
            }],
            seq: 4,
            created_at: at(8),
            updated_at: at(9),
            ..run_rec("acme", "r_approval", "mailer")
        },
        RunRecord {
            version: 3,
            state: RunState::Completed,
            session_id: s1,
            cost_micros: 900,
            iterations: 1,
            seq: 5,
            created_at: at(10),
            updated_at: at(12),
            ..run_rec("acme", "r_done", "planner")
        },
        RunRecord {
            version: 2,
            state: RunState::Failed,
            seq: 6,
            created_at: at(13),
            updated_at: at(14),
            ..run_rec("acme", "r_failed", "coder")
        },
        RunRecord {
            version: 2,
            state: RunState::Paused,
            seq: 7,
            created_at: at(15),
            updated_at: at(16),
            ..run_rec("globex", "r_paused", "planner")
        },
    ]
}

fn fixture_session() -> SessionRecord {
    let mut s = SessionRecord::new(SessionKey::new("acme", "s1"));
    s.version = 2;
    s.created_at = at(0);
    s.updated_at = at(1);
    for (k, v) in [
        ("title", "Fixture session"),
        ("user", "u_42"),
        ("channel", "web"),
    ] {
        s.metadata.insert(k.into(), v.into());
    }
    s
}

#[test]
fn d4_golden_fixture_v1_opens_and_reads_exactly() {
    golden_fixture_opens_and_reads_exactly("v1");
}

/// The fixture `make_fixtures` writes in this release's layout (format 2).
#[test]
fn d4_golden_fixture_v2_opens_and_reads_exactly() {
    golden_fixture_opens_and_reads_exactly("v2");
}

fn golden_fixture_opens_and_reads_exactly(name: &str) {
    let golden = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let before = snapshot(&golden);
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join(name);
    copy_dir(&golden, &path);
    let upgraded = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = upgraded.clone();
    let store = FileStore::open_with(
        &path,
        Options::new().on_upgrade(move |p| seen.lock().unwrap().push((p.done, p.total))),
    )
    .unwrap();
    // A format-1 store is upgraded once, at its first open, with its
    // progress reported; a format-2 one is not touched.
    let progress = upgraded.lock().unwrap().clone();
    if name == "v1" {
        assert_eq!(progress, [(0, 7), (7, 7)]);
    } else {
        assert!(progress.is_empty(), "{progress:?}");
    }
    assert_eq!(
        std::fs::read_to_string(path.join("AGENTSTATE")).unwrap(),
        "agentstate store format 2\n"
    );

    // Every run, by key, exactly.
    let runs = fixture_runs();
    for want in &runs {
        assert_eq!(
            store.get_run(&want.key).unwrap().as_ref(),
            Some(want),
            "{}",
            want.key.run_id
        );
    }
    assert!(
        store
            .get_run(&RunKey::new("acme", "r_running"))
            .unwrap()
            .unwrap()
            .session_id
            .is_some()
    );
    assert!(runs[2].mid_tool_call() && runs[3].mid_tool_call());
    assert_eq!(
        store.get_session(&SessionKey::new("acme", "s1")).unwrap(),
        Some(fixture_session())
    );

    // A store from before the change feed: its open gave every record
    // an entry (F1), so a consumer from the start reads the whole store.
    use agentstate::{Changed, FeedScope, FeedStore, Position};
    let feed = store
        .changes(&FeedScope::tenant("acme"), Position::START, 100)
        .unwrap();
    let mut got: Vec<String> = feed
        .changes
        .iter()
        .map(|c| match &c.item {
            Changed::Run { run } => {
                assert_eq!(Some(run), runs.iter().find(|r| r.key == run.key));
                run.key.run_id.clone()
            }
            Changed::Session { session } => {
                assert_eq!(session, &fixture_session());
                session.key.session_id.clone()
            }
            other => panic!("the filled feed holds {other:?}"),
        })
        .collect();
    got.sort();
    assert_eq!(
        got,
        [
            "r_approval",
            "r_done",
            "r_failed",
            "r_pending",
            "r_running",
            "r_tools",
            "s1"
        ]
    );
    let globex = store
        .changes(&FeedScope::tenant("globex"), Position::START, 100)
        .unwrap();
    assert_eq!(globex.changes.len(), 1);

    // Listings: seq order, the state and session indexes.
    let page = store
        .list_runs(&StateQuery::new("acme"), &PageRequest::default())
        .unwrap();
    let ids: Vec<&str> = page.items().iter().map(|r| r.key.run_id.as_str()).collect();
    assert_eq!(
        ids,
        [
            "r_pending",
            "r_running",
            "r_tools",
            "r_approval",
            "r_done",
            "r_failed"
        ]
    );
    assert!(page.cursor().is_none());
    let running = store
        .list_runs(
            &StateQuery::new("acme").state(RunState::Running),
            &PageRequest::default(),
        )
        .unwrap();
    assert_eq!(running.items(), &runs[1..3]);
    let in_s1 = store
        .list_runs(
            &StateQuery::new("acme").session("s1"),
            &PageRequest::default(),
        )
        .unwrap();
    let ids: Vec<&str> = in_s1
        .items()
        .iter()
        .map(|r| r.key.run_id.as_str())
        .collect();
    assert_eq!(ids, ["r_running", "r_tools", "r_done"]);
    let globex = store
        .list_runs(&StateQuery::new("globex"), &PageRequest::default())
        .unwrap();
    assert_eq!(globex.items(), &runs[6..]);

    // Trays, epochs, alarms.
    let w1 = InstanceKey::new("workers", "w1");
    let w2 = InstanceKey::new("workers", "w2");
    assert_eq!(store.epoch(&w1).unwrap(), 3);
    assert_eq!(store.epoch(&w2).unwrap(), 1);
    let trays = store.list_trays(&w1, 3, &PageRequest::new(100)).unwrap();
    let want_w1 = vec![
        (w1.tray("inbox", "t1"), tray(true, b"hello", "prod")),
        (w1.tray("inbox", "t2"), tray(false, b"world", "prod")),
        (w1.tray("state", "main"), tray(true, &[0, 1, 2, 255], "dev")),
    ];
    assert_eq!(trays.items(), want_w1.as_slice());
    assert_eq!(store.read_tray(&w1.tray("inbox", "gone"), 3).unwrap(), None);
    assert_eq!(
        store.read_tray(&w2.tray("state", "main"), 1).unwrap(),
        Some(tray(false, b"{\"n\":1}", "prod"))
    );
    let marked = store.marked_trays(None, &PageRequest::new(100)).unwrap();
    let keys: Vec<&TrayKey> = marked.items().iter().map(|m| &m.key).collect();
    assert_eq!(keys, [&w1.tray("inbox", "t1"), &w1.tray("state", "main")]);
    let dev = store
        .marked_trays(Some("dev"), &PageRequest::new(100))
        .unwrap();
    assert_eq!(dev.items().len(), 1);
    assert_eq!(dev.items()[0].key, w1.tray("state", "main"));
    let due = store.due_alarms(u64::MAX, &PageRequest::new(100)).unwrap();
    let due: Vec<(&str, u64)> = due
        .items()
        .iter()
        .map(|a| (a.instance.id.as_str(), a.due_at))
        .collect();
    assert_eq!(due, [("w2", 1_700_000_060_000), ("w1", 1_700_000_100_000)]);
    // Stale epochs are still fenced.
    assert!(matches!(
        store.read_tray(&w1.tray("inbox", "t1"), 2),
        Err(StateError::FenceLost {
            caller: 2,
            stored: 3,
            ..
        })
    ));

    // The whole store, a record a page: exactly these records.
    let all = export_all(&store, 1).unwrap();
    assert_eq!(
        all.len(),
        7 + 1 + 2 + 4 + 2,
        "{:?}",
        all.keys().collect::<Vec<_>>()
    );
    let report = store.verify().unwrap();
    assert!(report.is_ok(), "{:?}", report.problems);

    // The store takes new writes, and they survive a reopen.
    let r = store
        .put_run(RunRecord::new(RunKey::new("acme", "r_new"), "planner"))
        .unwrap();
    assert_eq!(r.seq, 8, "seq continues after the fixture's");
    drop(store);
    let upgraded_again = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let again = upgraded_again.clone();
    let store = FileStore::open_with(
        &path,
        Options::new().on_upgrade(move |_| again.store(true, Ordering::SeqCst)),
    )
    .unwrap();
    assert!(!upgraded_again.load(Ordering::SeqCst), "upgraded twice");
    assert_eq!(store.get_run(&r.key).unwrap(), Some(r));
    drop(store);

    assert!(
        snapshot(&golden) == before,
        "the checked-in fixture changed"
    );
}

#[test]
fn d4_a_newer_format_is_refused_and_no_file_is_touched() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("v2");
    copy_dir(&fixture_v1(), &path);
    std::fs::write(path.join("AGENTSTATE"), "agentstate store format 3\n").unwrap();
    let before = snapshot(&path);
    let mtimes: Vec<_> = before
        .keys()
        .map(|p| std::fs::metadata(path.join(p)).unwrap().modified().unwrap())
        .collect();
    for opts in [Options::new(), Options::new().salvage(true)] {
        match FileStore::open_with(&path, opts) {
            Err(StateError::UnsupportedFormat {
                found: 3,
                supported: 2,
            }) => {}
            other => panic!("a format-3 store must be refused: {other:?}"),
        }
    }
    let after = snapshot(&path);
    assert_eq!(
        before.keys().collect::<Vec<_>>(),
        after.keys().collect::<Vec<_>>(),
        "files added or removed"
    );
    for (p, bytes) in &before {
        assert!(after[p] == *bytes, "{} changed", p.display());
    }
    let mtimes_after: Vec<_> = before
        .keys()
        .map(|p| std::fs::metadata(path.join(p)).unwrap().modified().unwrap())
        .collect();
    assert_eq!(mtimes, mtimes_after, "a file was rewritten");
    // Back to format 1, it opens (the refusal left it whole).
    std::fs::write(path.join("AGENTSTATE"), "agentstate store format 1\n").unwrap();
    let store = FileStore::open(&path).unwrap();
    assert_eq!(
        store
            .get_run(&RunKey::new("acme", "r_done"))
            .unwrap()
            .unwrap()
            .version,
        3
    );
    // A value whose own version byte is newer is refused by the codec
    // (unit test `newer_version_is_refused_by_name` in crates/core/src/codec/value.rs):
    // no public API writes one.
}

/// `n` runs as release 0.1 could have left them: three tenants, every
/// state, some in a session, some mid tool call, versions and times set.
fn format1_runs(n: u64) -> Vec<RunRecord> {
    (0..n)
        .map(|i| {
            let tenant = ["acme", "globex", "initech"][(i % 3) as usize];
            let mut r = run_rec(
                tenant,
                &format!("run-{i:06}"),
                ["planner", "coder"][(i % 2) as usize],
            );
            r.state = RunState::ALL[(i % 7) as usize];
            r.seq = i + 1;
            r.version = 1 + i % 4;
            r.created_at = at(i);
            r.updated_at = at(i + i % 5);
            r.cost_micros = i * 7;
            if tenant == "acme" && i % 4 == 0 {
                r.session_id = Some("s1".into());
            }
            if i % 9 == 0 {
                r.pending_tool_calls = vec![ToolCall {
                    id: format!("call_{i}"),
                    name: "search".into(),
                    arguments: format!(r#"{{"q":"item {i}"}}"#),
                }];
            }
            r
        })
        .collect()
}

/// A fresh copy of `golden` at `path`, opened by the upgrade kills' child
/// (`d4_upgrade_child_entry`), which is killed as `kill` says; what it said
/// and whether it exited on its own.
fn open_copy_in_child(golden: &Path, path: &Path, kill: crash::KillAt) -> (crash::Output, bool) {
    copy_dir(golden, path);
    crash::run_child(
        &|| self_command("durability::d4_upgrade_child_entry"),
        &path.display().to_string(),
        kill,
    )
    .unwrap()
}

/// Child entry point of the upgrade kills: opens (and so upgrades) the
/// store at `$AGENTSTATE_CRASH_CHILD`, saying each step of the progress
/// (`phase opened` here means: the upgrade has begun).
#[test]
fn d4_upgrade_child_entry() {
    let Ok(path) = std::env::var(crash::CHILD_ENV) else {
        return;
    };
    let store = FileStore::open_with(
        &path,
        Options::new().on_upgrade(|p| {
            static BEGAN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
            let began = BEGAN.get_or_init(Instant::now);
            let mut out = std::io::stdout().lock();
            if p.done == 0 {
                writeln!(out, "phase opened").unwrap();
            }
            writeln!(out, "progress {} {}", p.done, p.total).unwrap();
            writeln!(out, "at {}", began.elapsed().as_micros()).unwrap();
            out.flush().unwrap();
        }),
    )
    .unwrap();
    println!("phase done");
    drop(store);
    std::process::exit(0);
}

/// D4: the open that moves a store of an earlier release (the v2 fixture,
/// written with fjall's compaction and a 1 MiB memtable) onto this
/// release's engine settings rewrites them and opens the engine again;
/// killed at any moment of it, the store opens next time with every
/// record of the fixture.
#[test]
fn d4_an_open_killed_while_it_moves_the_engine_settings_loses_nothing() {
    let kills = env_u64("AGENTSTATE_D4_SETTINGS_KILLS", 16);
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/v2");
    let tmp = tempfile::tempdir().unwrap();
    // One whole open in a child, timed from its spawn.
    let whole = tmp.path().join("whole");
    let began = Instant::now();
    let (out, exited) = open_copy_in_child(
        &golden,
        &whole,
        crash::KillAt::Start(Duration::from_secs(600)),
    );
    let took = began.elapsed();
    assert!(exited, "the child did not finish: {:?}", out.lines);
    assert!(
        out.lines.iter().any(|l| l == "phase done"),
        "{:?}",
        out.lines
    );

    let mut rng = crash::Rng::new(env_u64("AGENTSTATE_CRASH_SEED", 11));
    let (mut killed, mut finished) = (0, 0);
    for i in 0..=kills {
        let path = tmp.path().join(format!("k{i}"));
        // The last child is not killed: the whole open, for comparison.
        let delay = Duration::from_micros(rng.below(took.as_micros() as u64 + 1));
        let kill = if i == kills {
            Duration::from_secs(600)
        } else {
            delay
        };
        let (out, _) = open_copy_in_child(&golden, &path, crash::KillAt::Start(kill));
        if out.lines.iter().any(|l| l == "phase done") {
            finished += 1;
        } else {
            killed += 1;
        }
        let store = FileStore::open(&path).unwrap_or_else(|e| panic!("kill {i} at {delay:?}: {e}"));
        for want in fixture_runs() {
            assert_eq!(
                store.get_run(&want.key).unwrap().as_ref(),
                Some(&want),
                "kill {i} at {delay:?}"
            );
        }
        assert_eq!(
            store.get_session(&SessionKey::new("acme", "s1")).unwrap(),
            Some(fixture_session()),
            "kill {i} at {delay:?}"
        );
        let report = store.verify().unwrap();
        assert!(
            report.is_ok(),
            "kill {i} at {delay:?}: {:?}",
            report.problems
        );
    }
    eprintln!(
        "d4 settings: a whole open took {took:?} from spawn; {killed} children killed before they finished, {finished} finished"
    );
    assert!(killed > 0, "no kill landed before the open finished");
}

/// Checks that the store at `path` holds exactly `runs` (and the session),
/// by key and in every listing, and verifies.
fn assert_holds_exactly(path: &Path, runs: &[RunRecord], what: &str) {
    let store = FileStore::open(path).unwrap_or_else(|e| panic!("{what}: {e}"));
    for want in runs {
        assert_eq!(
            store.get_run(&want.key).unwrap().as_ref(),
            Some(want),
            "{what}: {}",
            want.key.run_id
        );
    }
    for tenant in ["acme", "globex", "initech"] {
        for q in [
            StateQuery::new(tenant),
            StateQuery::new(tenant).state(RunState::Running),
            StateQuery::new(tenant).state(RunState::Completed),
            StateQuery::new(tenant).session("s1"),
            StateQuery::new(tenant)
                .state(RunState::Paused)
                .updated_before(at(runs.len() as u64 / 2)),
        ] {
            let got: Vec<RunRecord> = store
                .iter_runs(&q)
                .page_size(97)
                .collect::<agentstate::Result<_>>()
                .unwrap();
            let want: Vec<&RunRecord> = runs
                .iter()
                .filter(|r| {
                    r.key.tenant == tenant
                        && q.state.is_none_or(|s| s == r.state)
                        && q.session
                            .as_ref()
                            .is_none_or(|s| r.session_id.as_ref() == Some(s))
                        && q.updated_before.is_none_or(|t| r.updated_at < t)
                })
                .collect();
            assert_eq!(got.iter().collect::<Vec<_>>(), want, "{what}: {q:?}");
        }
    }
    let report = store.verify().unwrap();
    assert!(report.is_ok(), "{what}: {:?}", report.problems);
    assert_eq!(report.runs, runs.len() as u64, "{what}");
}

/// D4: the upgrade of a format-1 store killed at any moment leaves a store
/// that opens (as format 1, or as format 2 once the upgrade goes on) with
/// every record exactly as it was; never one that opens as neither.
#[test]
fn d4_an_upgrade_killed_at_any_moment_leaves_every_record() {
    let n = env_u64("AGENTSTATE_D4_UPGRADE_RUNS", 4000);
    let kills = env_u64("AGENTSTATE_D4_UPGRADE_KILLS", 12);
    let tmp = tempfile::tempdir().unwrap();
    let golden = tmp.path().join("golden");
    {
        let store = FileStore::open(&golden).unwrap();
        store
            .put_session(SessionRecord::new(SessionKey::new("acme", "s1")))
            .unwrap();
    }
    let runs = format1_runs(n);
    FileStore::__write_format1_for_tests(&golden, &runs).unwrap();
    assert_eq!(
        std::fs::read_to_string(golden.join("AGENTSTATE")).unwrap(),
        "agentstate store format 1\n"
    );

    // One whole upgrade in a child: how long it takes, what it says.
    let whole = tmp.path().join("whole");
    let (out, exited) = open_copy_in_child(
        &golden,
        &whole,
        crash::KillAt::Start(Duration::from_secs(600)),
    );
    // From the upgrade's start to its last step.
    let took = Duration::from_micros(
        out.lines
            .iter()
            .rev()
            .find_map(|l| l.strip_prefix("at ")?.parse().ok())
            .expect("the child timed its upgrade"),
    );
    assert!(exited, "the upgrade child did not finish: {:?}", out.lines);
    let steps: Vec<&String> = out
        .lines
        .iter()
        .filter(|l| l.starts_with("progress "))
        .collect();
    assert_eq!(
        steps.first().map(|s| s.as_str()),
        Some(format!("progress 0 {n}").as_str())
    );
    assert_eq!(
        steps.last().map(|s| s.as_str()),
        Some(format!("progress {n} {n}").as_str())
    );
    assert!(steps.len() as u64 > n.div_ceil(1000), "{steps:?}");
    assert_holds_exactly(&whole, &runs, "after a whole upgrade");

    let mut rng = crash::Rng::new(env_u64("AGENTSTATE_CRASH_SEED", 7));
    let (mut before, mut during, mut after) = (0, 0, 0);
    for i in 0..kills {
        let path = tmp.path().join(format!("k{i}"));
        let delay = Duration::from_micros(rng.below(took.as_micros() as u64 + 1));
        let (out, _) = open_copy_in_child(&golden, &path, crash::KillAt::Opened(delay));
        let last = out.lines.iter().rev().find(|l| l.starts_with("progress "));
        match last.map(|l| l.as_str()) {
            None => before += 1,
            Some(l) if l == format!("progress {n} {n}") => after += 1,
            Some(l) if l == format!("progress 0 {n}") => before += 1,
            _ => during += 1,
        }
        let marker = std::fs::read_to_string(path.join("AGENTSTATE")).unwrap();
        assert!(
            marker == "agentstate store format 1\n" || marker == "agentstate store format 2\n",
            "kill {i} at {delay:?}: marker {marker:?}"
        );
        assert_holds_exactly(&path, &runs, &format!("kill {i} at {delay:?}"));
    }
    eprintln!(
        "d4 upgrade: {n} runs upgraded in {took:?}; {kills} kills: {before} before its first batch, {during} during, {after} after its last"
    );
    assert!(
        during > 0,
        "no kill landed during the upgrade; raise AGENTSTATE_D4_UPGRADE_KILLS"
    );
}

// ---------------------------------------------------------------------------
// D5: damaged files are a clear error or correct data; never a panic,
// never silently wrong data.

const D5_ENV: &str = "AGENTSTATE_D5_CHILD";

/// A digest of each record: what the child compares against.
fn digest(e: &Entry) -> u64 {
    // A tray's doc may be a megabyte: checksum its bytes directly (JSON of
    // it is slow in a debug build); everything else through its JSON.
    match e {
        Entry::Tray { key, tray } => {
            let head =
                serde_json::to_string(&(key, tray.marked, &tray.env, &tray.hostname)).unwrap();
            let doc = crc32fast::hash(&tray.doc);
            u64::from(crc32fast::hash(head.as_bytes())) << 32
                | u64::from(doc) ^ tray.doc.len() as u64
        }
        other => {
            let json = serde_json::to_string(other).unwrap();
            u64::from(crc32fast::hash(json.as_bytes())) << 32 | json.len() as u64
        }
    }
}

/// Panics of threads other than the caller's (fjall's background workers),
/// which no `catch_unwind` of the caller sees.
static PANICS: Mutex<Vec<String>> = Mutex::new(Vec::new());

fn record_background_panics() {
    let caller = std::thread::current().id();
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let me = std::thread::current();
        if me.id() != caller
            && let Ok(mut p) = PANICS.lock()
        {
            p.push(format!(
                "thread {}: {info}",
                me.name().unwrap_or("<unnamed>")
            ));
        }
        previous(info);
    }));
}

/// How one damaged store behaved.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    /// Opened and every record read back exactly.
    Correct,
    /// Refused or failed with a clear error (its kind and text).
    Error(String),
    /// Read, but some record differs or is missing: a failure.
    Wrong(String),
    /// Panicked, aborted or hung: a failure.
    Crashed(String),
}

fn error_kind(e: &StateError) -> String {
    let kind = match e {
        StateError::Corrupt { .. } => "Corrupt",
        StateError::UnsupportedFormat { .. } => "UnsupportedFormat",
        StateError::Invalid { .. } => "Invalid",
        StateError::Persistence { .. } => "Persistence",
        StateError::Locked { .. } => "Locked",
        _ => "other",
    };
    format!("{kind}: {e}")
}

/// Child entry point of d5: opens the damaged store named by
/// `$AGENTSTATE_D5_CHILD` (`STORE\tEXPECTED.json`), reads every record,
/// compares, and prints one `d5 outcome` line.
#[test]
fn d5_child_entry() {
    let Ok(spec) = std::env::var(D5_ENV) else {
        return;
    };
    record_background_panics();
    let mut fields = spec.split('\t');
    let (store_dir, expected) = (fields.next().unwrap(), fields.next().unwrap());
    let engine = match fields.next() {
        Some("sled") => agentstate::FileEngine::Sled,
        _ => agentstate::FileEngine::Fjall,
    };
    let expected: BTreeMap<String, u64> =
        serde_json::from_slice(&std::fs::read(expected).unwrap()).unwrap();
    let store_dir = PathBuf::from(store_dir);
    let result = std::panic::catch_unwind(|| -> Result<Result<(), String>, StateError> {
        let store = FileStore::open_with(&store_dir, Options::new().engine(engine))?;
        let list = export_list(&store, 1000)?;
        let report = store.verify()?;
        if !report.is_ok() {
            // The store noticed: a record failed its check.
            return Err(StateError::Corrupt {
                what: format!("verify: {}", report.problems.join("; ")),
            });
        }
        let mut wrong = Vec::new();
        let mut got = BTreeMap::new();
        for e in list {
            let k = entry_key(&e);
            if got.insert(k.clone(), e).is_some() {
                wrong.push(format!("{k} listed twice"));
            }
        }
        for (k, d) in &expected {
            match got.get(k) {
                None => wrong.push(format!("{k} missing")),
                Some(e) if digest(e) != *d => wrong.push(format!("{k} differs")),
                Some(_) => {}
            }
        }
        for k in got.keys().filter(|k| !expected.contains_key(*k)) {
            wrong.push(format!("{k} appeared"));
        }
        // Reads by key agree with the listing.
        for e in got.values() {
            if let Entry::Run(r) = e
                && store.get_run(&r.key)?.as_ref() != Some(r)
            {
                wrong.push(format!(
                    "get_run({}) disagrees with the export",
                    r.key.run_id
                ));
            }
        }
        drop(store);
        Ok(if wrong.is_empty() {
            Ok(())
        } else {
            Err(wrong.join(", "))
        })
    });
    let panics = PANICS.lock().map(|p| p.clone()).unwrap_or_default();
    // A panic the store caught and turned into an error is an error; one
    // that reached the caller, or hit a background thread, is a crash.
    let outcome = match result {
        _ if !panics.is_empty() => Outcome::Crashed(format!("panic: {}", panics.join(" | "))),
        Err(p) => {
            let why = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
            Outcome::Crashed(format!(
                "panic reached the caller: {}",
                why.unwrap_or_default()
            ))
        }
        Ok(Ok(Ok(()))) => Outcome::Correct,
        Ok(Ok(Err(w))) => Outcome::Wrong(w),
        Ok(Err(e)) => Outcome::Error(error_kind(&e)),
    };
    let line = match outcome {
        Outcome::Correct => "correct".to_string(),
        Outcome::Error(e) => format!("error {e}"),
        Outcome::Wrong(w) => format!("wrong {w}"),
        Outcome::Crashed(c) => format!("crashed {c}"),
    };
    let mut out = std::io::stdout().lock();
    writeln!(out, "\nd5 outcome {}", line.replace('\n', " ")).unwrap();
    out.flush().unwrap();
    std::process::exit(0);
}

/// One way to damage one file.
#[derive(Debug, Clone)]
enum Damage {
    /// Leave it alone (the control case).
    Nothing,
    /// XOR the byte at this offset with 0xff.
    Flip(u64),
    /// Cut the file to this length.
    Truncate(u64),
}

impl std::fmt::Display for Damage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Damage::Nothing => write!(f, "no damage"),
            Damage::Flip(at) => write!(f, "flip byte {at}"),
            Damage::Truncate(len) => write!(f, "truncate to {len}"),
        }
    }
}

fn damage(file: &Path, d: &Damage) {
    match *d {
        Damage::Nothing => {}
        Damage::Flip(at) => {
            let mut bytes = std::fs::read(file).unwrap();
            bytes[at as usize] ^= 0xff;
            std::fs::write(file, bytes).unwrap();
        }
        Damage::Truncate(len) => {
            std::fs::OpenOptions::new()
                .write(true)
                .open(file)
                .unwrap()
                .set_len(len)
                .unwrap();
        }
    }
}

/// Copies `src` to `dst`, hard-linking fjall's table files (immutable once
/// written) except `fresh`, which is copied so it can be damaged.
fn copy_store(src: &Path, dst: &Path, fresh: &Path) {
    fn walk(root: &Path, dir: &Path, dst: &Path, fresh: &Path) {
        for e in std::fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            let rel = e.path().strip_prefix(root).unwrap().to_path_buf();
            let to = dst.join(&rel);
            if e.file_type().unwrap().is_dir() {
                std::fs::create_dir_all(&to).unwrap();
                walk(root, &e.path(), dst, fresh);
            } else if rel.components().any(|c| c.as_os_str() == "tables") && rel != fresh {
                std::fs::hard_link(e.path(), &to).unwrap();
            } else {
                std::fs::copy(e.path(), &to).unwrap();
            }
        }
    }
    std::fs::create_dir_all(dst).unwrap();
    walk(src, src, dst, fresh);
}

/// Runs each case in its own child process (a panic, an abort or a hang
/// there cannot take this test with it), two at a time. Returns the
/// outcomes in case order.
fn run_cases(
    pristine: &Path,
    expected: &Path,
    cases: &[(PathBuf, Damage)],
    scratch: &Path,
) -> Vec<Outcome> {
    run_cases_on(
        agentstate::FileEngine::Fjall,
        pristine,
        expected,
        cases,
        scratch,
    )
}

/// `run_cases` on a store of `engine`.
fn run_cases_on(
    engine: agentstate::FileEngine,
    pristine: &Path,
    expected: &Path,
    cases: &[(PathBuf, Damage)],
    scratch: &Path,
) -> Vec<Outcome> {
    let next = AtomicU64::new(0);
    let results = Mutex::new(vec![None; cases.len()]);
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst) as usize;
                    let Some((file, d)) = cases.get(i) else { break };
                    let dir = scratch.join(format!("case{i}"));
                    copy_store(pristine, &dir, file);
                    damage(&dir.join(file), d);
                    let spec = format!(
                        "{}\t{}\t{}",
                        dir.display(),
                        expected.display(),
                        engine.name()
                    );
                    let outcome = run_case_child(&spec);
                    let _ = std::fs::remove_dir_all(&dir);
                    results.lock().unwrap()[i] = Some(outcome);
                }
            });
        }
    });
    results
        .into_inner()
        .unwrap()
        .into_iter()
        .map(|o| o.expect("every case ran"))
        .collect()
}

fn run_case_child(spec: &str) -> Outcome {
    let mut child = self_command("durability::d5_child_entry")
        .env(D5_ENV, spec)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if started.elapsed() > Duration::from_secs(60) {
            child.kill().unwrap();
            child.wait().unwrap();
            break None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let mut stdout = Vec::new();
    std::io::Read::read_to_end(child.stdout.as_mut().unwrap(), &mut stdout).unwrap();
    let Some(status) = status else {
        return Outcome::Crashed("hung for 60 s".into());
    };
    let lines = child_lines(&stdout, "d5 outcome ");
    match lines.first().map(String::as_str) {
        Some("correct") => Outcome::Correct,
        Some(l) if l.starts_with("error ") => Outcome::Error(l["error ".len()..].to_string()),
        Some(l) if l.starts_with("wrong ") => Outcome::Wrong(l["wrong ".len()..].to_string()),
        Some(l) => Outcome::Crashed(l.to_string()),
        None => Outcome::Crashed(format!("child died: {status}")),
    }
}

/// Writes a store with runs, a session, trays and alarms over many
/// commits, closes it, and returns what it holds.
fn build_store(path: &Path, runs: u64, big_docs: u64) -> BTreeMap<String, Entry> {
    build_store_on(agentstate::FileEngine::Fjall, path, runs, big_docs)
}

/// `build_store` on `engine`.
fn build_store_on(
    engine: agentstate::FileEngine,
    path: &Path,
    runs: u64,
    big_docs: u64,
) -> BTreeMap<String, Entry> {
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    // Closed without the flush at close, so the journal keeps every write
    // for the journal damages below (as after a crash).
    let store = FileStore::open_with(
        path,
        Options::new()
            .clock(clock.clone())
            .engine(engine)
            .flush_at_close(false),
    )
    .unwrap();
    let mut want = BTreeMap::new();
    let session = store
        .put_session(SessionRecord::new(SessionKey::new("acme", "s1")))
        .unwrap();
    let inst = InstanceKey::new("w", "1");
    for i in 0..big_docs {
        // Big docs fill fjall's memtable, so it flushes a table file.
        let doc: Vec<u8> = (0..1_000_000u64)
            .map(|j| (j.wrapping_mul(31) ^ i) as u8)
            .collect();
        let t = Tray {
            marked: i % 2 == 0,
            doc,
            env: "prod".into(),
            hostname: "h".into(),
        };
        store
            .write_tray(&inst.tray("big", format!("d{i}")), 1, t.clone())
            .unwrap();
        want.insert(
            format!("tray/w/1/big/d{i}"),
            Entry::Tray {
                key: inst.tray("big", format!("d{i}")),
                tray: t,
            },
        );
    }
    for i in 0..runs {
        clock.advance(1_000);
        let mut r = RunRecord::new(RunKey::new("acme", format!("r{i:04}")), "agent");
        if i % 3 == 0 {
            r = r.with_session("s1");
        }
        let mut r = store.put_run(r).unwrap();
        if i % 2 == 0 {
            r = store
                .patch_run(
                    &r.key,
                    StateDelta {
                        cost_micros: i + 1,
                        iterations: 1,
                        ..Default::default()
                    },
                )
                .unwrap();
        }
        if i % 5 == 0 {
            r.state = RunState::ALL[(i / 5) as usize % RunState::ALL.len()];
            r.pending_tool_calls = vec![ToolCall {
                id: format!("c{i}"),
                name: "search".into(),
                arguments: format!("{{\"q\":{i}}}"),
            }];
            r = store.put_run(r).unwrap();
        }
        want.insert(format!("run/acme/{}", r.key.run_id), Entry::Run(r));
        if i % 10 == 0 {
            let t = tray(i % 20 == 0, format!("doc {i}").as_bytes(), "dev");
            store
                .apply_batch(
                    &inst,
                    1,
                    vec![TrayOp::Put {
                        tray_ns: "b".into(),
                        tray_id: format!("k{i}"),
                        tray: t.clone(),
                    }],
                )
                .unwrap();
            want.insert(
                format!("tray/w/1/b/k{i}"),
                Entry::Tray {
                    key: inst.tray("b", format!("k{i}")),
                    tray: t,
                },
            );
        }
    }
    store.set_alarm(&inst, 1, 5_000).unwrap();
    want.insert(
        "alarm/w/1".into(),
        Entry::Alarm {
            instance: inst.clone(),
            due_at: 5_000,
        },
    );
    want.insert(
        "epoch/w/1".into(),
        Entry::Epoch {
            instance: inst.clone(),
            epoch: 1,
        },
    );
    want.insert("session/acme/s1".into(), Entry::Session(session));
    drop(store);
    // What was written is exactly what a clean reopen reads (which keeps
    // the journal too).
    let store =
        FileStore::open_with(path, Options::new().engine(engine).flush_at_close(false)).unwrap();
    let got = export_all(&store, 1000).unwrap();
    assert_eq!(got.len(), want.len());
    for (k, e) in &want {
        assert!(got.get(k) == Some(e), "{k} not read back as written");
    }
    drop(store);
    want
}

/// Every file of a store, relative to it.
fn store_files(path: &Path) -> Vec<PathBuf> {
    snapshot(path).into_keys().collect()
}

/// The damage done to each file: flips at the start, quarters and end,
/// cuts to nothing, a half, and one byte short.
fn damages(len: u64) -> Vec<Damage> {
    if len == 0 {
        return Vec::new();
    }
    let mut d: Vec<Damage> = [0, len / 4, len / 2, 3 * len / 4, len - 1]
        .into_iter()
        .map(Damage::Flip)
        .collect();
    d.dedup_by(|a, b| matches!((a, b), (Damage::Flip(x), Damage::Flip(y)) if x == y));
    d.extend([
        Damage::Truncate(0),
        Damage::Truncate(len / 2),
        Damage::Truncate(len - 1),
    ]);
    d
}

fn report_cases(title: &str, cases: &[(PathBuf, Damage)], outcomes: &[Outcome]) -> Vec<String> {
    let mut failures = Vec::new();
    eprintln!("d5: {title}");
    for ((file, d), o) in cases.iter().zip(outcomes) {
        let text = match o {
            Outcome::Correct => "correct data".to_string(),
            Outcome::Error(e) => e.chars().take(160).collect(),
            Outcome::Wrong(w) => format!("WRONG DATA: {}", w.chars().take(300).collect::<String>()),
            Outcome::Crashed(c) => format!("CRASH: {}", c.chars().take(300).collect::<String>()),
        };
        eprintln!("  {:<32} {:<18} {text}", file.display(), d.to_string());
        if matches!(o, Outcome::Wrong(_) | Outcome::Crashed(_)) {
            failures.push(format!("{} {d}: {text}", file.display()));
        }
    }
    failures
}

#[test]
fn d5_damaged_files_are_an_error_or_correct_never_a_panic_or_wrong() {
    let tmp = tempfile::tempdir().unwrap();
    let pristine = tmp.path().join("pristine");
    let want = build_store(&pristine, 120, 0);
    let expected = tmp.path().join("expected.json");
    let digests: BTreeMap<&String, u64> = want.iter().map(|(k, e)| (k, digest(e))).collect();
    std::fs::write(&expected, serde_json::to_vec(&digests).unwrap()).unwrap();
    let mut cases = Vec::new();
    for file in store_files(&pristine) {
        let len = std::fs::metadata(pristine.join(&file)).unwrap().len();
        for d in damages(len) {
            cases.push((file.clone(), d));
        }
    }
    // Inside the journal, each field of one batch in the middle: its
    // Start entry, first item and End entry (layout: fjall 3.1,
    // src/journal/entry.rs). With AGENTSTATE_D5_SWEEP=1, every byte of
    // that batch. Sequence numbers: the test below.
    let jnl = store_files(&pristine)
        .into_iter()
        .find(|f| f.extension().is_some_and(|e| e == "jnl"))
        .expect("a journal");
    let bytes = std::fs::read(pristine.join(&jnl)).unwrap();
    let start = middle_trailer(&bytes) + BATCH_TRAILER.len();
    // The batch ends with the next trailer.
    let end = (start..bytes.len() - BATCH_TRAILER.len() + 1)
        .find(|&i| &bytes[i..i + BATCH_TRAILER.len()] == BATCH_TRAILER)
        .expect("the batch has a trailer")
        + BATCH_TRAILER.len();
    let item = start + 13;
    let fields: Vec<(&str, usize)> = vec![
        ("start tag", start),
        ("start item count", start + 1),
        ("start seqno, high byte", start + 12),
        ("item tag", item),
        ("item value type", item + 1),
        ("item compression", item + 2),
        ("item keyspace id", item + 3),
        ("item key length", item + 11),
        ("item value length", item + 13),
        ("item stored length", item + 17),
        ("item key", item + 21),
        (
            "item value",
            item + 21 + usize::from(u16::from_le_bytes([bytes[item + 11], bytes[item + 12]])) + 2,
        ),
        ("end tag", end - BATCH_TRAILER.len() - 9),
        ("end checksum", end - BATCH_TRAILER.len() - 4),
        ("end trailer", end - 2),
    ];
    if env_u64("AGENTSTATE_D5_SWEEP", 0) == 1 {
        for at in start..end {
            cases.push((jnl.clone(), Damage::Flip(at as u64)));
        }
    } else {
        for (what, at) in &fields {
            eprintln!("d5: journal byte {at}: {what}");
            cases.push((jnl.clone(), Damage::Flip(*at as u64)));
        }
    }
    let outcomes = run_cases(&pristine, &expected, &cases, tmp.path());
    let failures = report_cases(
        "small store (journal, meta table, version files, marker, HWM)",
        &cases,
        &outcomes,
    );
    assert!(failures.is_empty(), "D5 violated:\n{}", failures.join("\n"));
    // The undamaged copy reads correctly through the same path.
    assert_eq!(
        run_cases(
            &pristine,
            &expected,
            &[(PathBuf::from("HWM"), Damage::Nothing)],
            tmp.path()
        ),
        [Outcome::Correct]
    );
}

#[test]
fn d5_renumbered_journal_batches_are_corrupt_never_older_data() {
    // The low byte of every journal batch's start sequence number, which
    // fjall's checksum does not cover (see the module docs).
    let tmp = tempfile::tempdir().unwrap();
    let pristine = tmp.path().join("pristine");
    let want = build_store(&pristine, 120, 0);
    let expected = tmp.path().join("expected.json");
    let digests: BTreeMap<&String, u64> = want.iter().map(|(k, e)| (k, digest(e))).collect();
    std::fs::write(&expected, serde_json::to_vec(&digests).unwrap()).unwrap();
    let jnl = store_files(&pristine)
        .into_iter()
        .find(|f| f.extension().is_some_and(|e| e == "jnl"))
        .expect("a journal");
    let bytes = std::fs::read(pristine.join(&jnl)).unwrap();
    // Every batch starts right after the trailer of the one before it (the
    // first at byte 0).
    let starts: Vec<usize> = std::iter::once(0)
        .chain(
            (0..bytes.len() - BATCH_TRAILER.len())
                .filter(|&i| &bytes[i..i + BATCH_TRAILER.len()] == BATCH_TRAILER)
                .map(|t| t + BATCH_TRAILER.len()),
        )
        .filter(|&s| s + 13 <= bytes.len())
        .collect();
    assert!(starts.len() > 100, "only {} batches", starts.len());
    let cases: Vec<(PathBuf, Damage)> = starts
        .iter()
        .map(|&s| (jnl.clone(), Damage::Flip((s + 5) as u64)))
        .collect();
    let outcomes = run_cases(&pristine, &expected, &cases, tmp.path());
    let failures = report_cases("journal batch sequence numbers", &cases, &outcomes);
    assert!(failures.is_empty(), "D5 violated:\n{}", failures.join("\n"));
    // The check is what caught them: some flips reorder batches.
    let caught = outcomes
        .iter()
        .filter(|o| matches!(o, Outcome::Error(e) if e.contains("replays out of order")))
        .count();
    assert!(
        caught > 0,
        "none of {} flips was caught by the replay check",
        outcomes.len()
    );
}

#[test]
fn d5_damaged_table_files_are_an_error_or_correct() {
    // fjall flushes a keyspace's memtable to a table file at 64 MiB: write
    // that much in 1 MB docs, then damage the table files it made. That
    // takes about 100 s in a debug build, so it runs only when asked; the
    // default run damages the meta keyspace's table (the same format) in
    // the test above.
    if env_u64("AGENTSTATE_D5_TABLES", 0) != 1 {
        eprintln!("d5: data table files skipped (70 MB to write; set AGENTSTATE_D5_TABLES=1)");
        return;
    }
    let started = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let pristine = tmp.path().join("pristine");
    let want = build_store(&pristine, 40, 70);
    let built = started.elapsed();
    let tables: Vec<PathBuf> = store_files(&pristine)
        .into_iter()
        .filter(|f| f.starts_with("db/keyspaces/1/tables"))
        .collect();
    let listing: Vec<String> = store_files(&pristine)
        .iter()
        .map(|f| {
            format!(
                "{} ({} bytes)",
                f.display(),
                std::fs::metadata(pristine.join(f)).unwrap().len()
            )
        })
        .collect();
    eprintln!("d5: big store files: {}", listing.join(", "));
    assert!(
        !tables.is_empty(),
        "fjall wrote no table file for the data keyspace: {listing:?}"
    );
    let expected = tmp.path().join("expected.json");
    let digests: BTreeMap<&String, u64> = want.iter().map(|(k, e)| (k, digest(e))).collect();
    std::fs::write(&expected, serde_json::to_vec(&digests).unwrap()).unwrap();
    // Every damage of the small tables; of the 64 MiB one, the header, a
    // middle block, the trailer and a cut (all of them with the sweep on).
    let sweep = env_u64("AGENTSTATE_D5_SWEEP", 0) == 1;
    let mut cases = Vec::new();
    for file in &tables {
        let len = std::fs::metadata(pristine.join(file)).unwrap().len();
        let ds = if len < 1 << 20 || sweep {
            damages(len)
        } else {
            vec![
                Damage::Flip(0),
                Damage::Flip(len / 2),
                Damage::Flip(len - 1),
                Damage::Truncate(len / 2),
            ]
        };
        for d in ds {
            cases.push((file.clone(), d));
        }
    }
    let outcomes = run_cases(&pristine, &expected, &cases, tmp.path());
    eprintln!(
        "d5: built the 70 MB store in {:.1} s, ran {} cases in {:.1} s",
        built.as_secs_f64(),
        cases.len(),
        (started.elapsed() - built).as_secs_f64()
    );
    let failures = report_cases("data table files", &cases, &outcomes);
    assert!(failures.is_empty(), "D5 violated:\n{}", failures.join("\n"));
}

/// D5 on the sled engine: every file of a small sled store (sled's data
/// file, config and snapshot, and ours), damaged as above, opens to an
/// error or to exactly what was written; never a panic or wrong data.
/// sled checksums its log and snapshot but may read a damaged log as
/// ending early: then the high-water mark (D8) refuses the store.
#[cfg(feature = "sled")]
#[test]
fn d5_sled_damaged_files_are_an_error_or_correct() {
    let engine = agentstate::FileEngine::Sled;
    let tmp = tempfile::tempdir().unwrap();
    let pristine = tmp.path().join("pristine");
    let want = build_store_on(engine, &pristine, 120, 0);
    let expected = tmp.path().join("expected.json");
    let digests: BTreeMap<&String, u64> = want.iter().map(|(k, e)| (k, digest(e))).collect();
    std::fs::write(&expected, serde_json::to_vec(&digests).unwrap()).unwrap();
    let files = store_files(&pristine);
    assert!(
        files.iter().any(|f| f == Path::new("sled/db")),
        "no sled data file among {files:?}"
    );
    let mut cases = Vec::new();
    for file in files {
        let len = std::fs::metadata(pristine.join(&file)).unwrap().len();
        for d in damages(len) {
            cases.push((file.clone(), d));
        }
    }
    // The live log sits at the start of sled's 512 KiB segments: flips
    // every 512 bytes through the first 8 KiB, then every 16 KiB.
    let db_len = std::fs::metadata(pristine.join("sled/db")).unwrap().len();
    for at in (0..8192.min(db_len))
        .step_by(512)
        .chain((16384..db_len).step_by(16384))
    {
        cases.push((PathBuf::from("sled/db"), Damage::Flip(at)));
    }
    cases.push((PathBuf::from("sled/db"), Damage::Nothing));
    let outcomes = run_cases_on(engine, &pristine, &expected, &cases, tmp.path());
    let failures = report_cases(
        "sled store (data file, conf, snapshot, marker, HWM)",
        &cases,
        &outcomes,
    );
    assert!(failures.is_empty(), "D5 violated:\n{}", failures.join("\n"));
    // The control case reads back exactly.
    assert!(
        matches!(outcomes.last(), Some(Outcome::Correct)),
        "the undamaged copy: {:?}",
        outcomes.last()
    );
}

/// A store remembers its engine: opening it with the other one is a clear
/// error naming the right one, and touches nothing.
#[test]
fn a_store_opened_with_the_other_engine_is_refused() {
    use agentstate::FileEngine;
    let tmp = tempfile::tempdir().unwrap();
    let fjall = tmp.path().join("fjall");
    FileStore::open(&fjall)
        .unwrap()
        .put_run(RunRecord::new(RunKey::new("t", "r"), "a"))
        .unwrap();
    let before = snapshot(&fjall);
    let err = FileStore::open_with(&fjall, Options::new().engine(FileEngine::Sled)).unwrap_err();
    assert!(
        matches!(err, StateError::Invalid { .. }) && err.to_string().contains("fjall engine"),
        "{err:?}"
    );
    assert_eq!(
        snapshot(&fjall).keys().collect::<Vec<_>>(),
        before.keys().collect::<Vec<_>>()
    );
    // A damaged ENGINE file is damage, not a guess.
    std::fs::write(fjall.join("ENGINE"), b"leveldb\n").unwrap();
    assert!(matches!(
        FileStore::open(&fjall),
        Err(StateError::Corrupt { .. })
    ));
    #[cfg(feature = "sled")]
    {
        let sled = tmp.path().join("sled");
        FileStore::open_sled(&sled)
            .unwrap()
            .put_run(RunRecord::new(RunKey::new("t", "r"), "a"))
            .unwrap();
        let err = FileStore::open(&sled).unwrap_err();
        assert!(
            matches!(err, StateError::Invalid { .. }) && err.to_string().contains("open_sled"),
            "{err:?}"
        );
        let again = FileStore::open_sled(&sled).unwrap();
        assert_eq!(
            again
                .get_run(&RunKey::new("t", "r"))
                .unwrap()
                .unwrap()
                .version,
            1
        );
    }
    #[cfg(not(feature = "sled"))]
    {
        let err = FileStore::open_sled(tmp.path().join("sled")).unwrap_err();
        assert!(err.to_string().contains("`sled` feature"), "{err:?}");
    }
}

// ---------------------------------------------------------------------------
// D6: after a failed write the store refuses writes until reopened, and
// never acknowledges what it could not persist.

/// A tmpfs mounted for the test's life; unmounted on drop, also on panic.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Result<Tmpfs, String> {
        if std::env::var_os("AGENTSTATE_D6_NO_MOUNT").is_some() {
            return Err("AGENTSTATE_D6_NO_MOUNT is set".into());
        }
        std::fs::create_dir_all(dir).unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .map_err(|e| format!("running mount: {e}"))?;
        if out.status.success() {
            Ok(Tmpfs(dir.to_path_buf()))
        } else {
            Err(format!(
                "mount failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let ok = Command::new("umount")
            .arg(&self.0)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
}

/// `len` bytes nobody can compress (fjall may compress its journal).
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = crash::Rng::new(seed);
    let mut out: Vec<u8> = (0..len.div_ceil(8))
        .flat_map(|_| rng.next_u64().to_le_bytes())
        .collect();
    out.truncate(len);
    out
}

/// The `i`th tray a filling writer writes: `len` bytes of noise.
fn filler(i: u64, len: usize) -> (TrayKey, Tray) {
    let key = InstanceKey::new("w", "1").tray("fill", format!("k{i:05}"));
    (key, tray(true, &noise(i, len), "prod"))
}

fn is_unavailable(e: &StateError) -> bool {
    matches!(
        e,
        StateError::Persistence {
            reason: PersistenceReason::Unavailable,
            ..
        }
    ) && e.is_retryable()
}

/// What a write that had to be refused returned, without its payload.
fn shape<T>(r: &Result<T, StateError>) -> String {
    match r {
        Ok(_) => "Ok".into(),
        Err(e) => format!("{e:?}"),
    }
}

/// Writes a run, then trays until a write fails; checks the failure and
/// the refusals after it. Returns the run, the acknowledged trays and the
/// tray whose write failed.
fn fill_until_failure(
    store: &FileStore,
    len: usize,
) -> (RunRecord, Vec<(TrayKey, Tray)>, (TrayKey, Tray)) {
    let run = store
        .put_run(RunRecord::new(RunKey::new("acme", "first"), "a"))
        .unwrap();
    let mut acked = Vec::new();
    for i in 0..100_000 {
        let (key, t) = filler(i, len);
        match store.write_tray(&key, 1, t.clone()) {
            Ok(()) => acked.push((key, t)),
            Err(e) => {
                // The failed group reached the journal: its outcome is
                // unknown (I7); what is refused after it certainly did not
                // apply (D6).
                assert!(
                    e.is_outcome_unknown(),
                    "a failed write must be Persistence{{OutcomeUnknown}}: {e:?}"
                );
                // Every later write is refused, even one that would fit.
                let small = store.put_run(RunRecord::new(RunKey::new("acme", "tiny"), "a"));
                assert!(
                    small.as_ref().is_err_and(is_unavailable),
                    "after a failure: {}",
                    shape(&small)
                );
                let p = store.patch_run(
                    &run.key,
                    StateDelta {
                        cost_micros: 1,
                        ..Default::default()
                    },
                );
                assert!(
                    p.as_ref().is_err_and(is_unavailable),
                    "after a failure: {}",
                    shape(&p)
                );
                let t = store.write_tray(
                    &InstanceKey::new("w", "1").tray("b", "k"),
                    1,
                    tray(true, b"x", "e"),
                );
                assert!(
                    t.as_ref().is_err_and(is_unavailable),
                    "after a failure: {}",
                    shape(&t)
                );
                // Plain reads still answer.
                assert_eq!(store.get_run(&run.key).unwrap().as_ref(), Some(&run));
                return (run, acked, filler(i, len));
            }
        }
    }
    panic!("100000 writes of {len} bytes never failed");
}

/// Reopens `path` and checks every acknowledged write is there exactly; the
/// failed one is there whole or not at all; nothing refused is there.
fn check_after_failure(
    path: &Path,
    run: &RunRecord,
    acked: &[(TrayKey, Tray)],
    failed: &(TrayKey, Tray),
) {
    let store = FileStore::open(path).unwrap();
    assert_eq!(store.get_run(&run.key).unwrap().as_ref(), Some(run));
    for (k, t) in acked {
        let got = store.read_tray(k, 1).unwrap();
        assert!(
            got.as_ref() == Some(t),
            "acknowledged {} lost or changed",
            k.tray_id
        );
    }
    let got = store.read_tray(&failed.0, 1).unwrap();
    assert!(
        got.is_none() || got.as_ref() == Some(&failed.1),
        "the failed write is there, but not whole"
    );
    assert_eq!(store.get_run(&RunKey::new("acme", "tiny")).unwrap(), None);
    assert_eq!(store.get_run(&run.key).unwrap().unwrap().cost_micros, 0);
    let report = store.verify().unwrap();
    assert!(report.is_ok(), "{:?}", report.problems);
    // A reopened store with room writes again.
    store
        .put_run(RunRecord::new(RunKey::new("acme", "after"), "a"))
        .unwrap();
}

const D6_ENV: &str = "AGENTSTATE_D6_CHILD";
/// fjall preallocates its 64 MiB journal with `ftruncate`, so a file-size
/// limit fails a write only past 64 MiB: fill it with big docs.
const FALLBACK_DOC_BYTES: usize = 1_000_000;
const FALLBACK_FSIZE: &str = "--fsize=67108864";

/// Child entry point of d6's fallback: runs under a file-size limit, fills
/// the store until a write fails, and prints what it acknowledged.
#[test]
fn d6_child_entry() {
    let Some(path) = std::env::var_os(D6_ENV) else {
        return;
    };
    let store = FileStore::open(&path).unwrap();
    let (run, acked, failed) = fill_until_failure(&store, FALLBACK_DOC_BYTES);
    let mut out = std::io::stdout().lock();
    writeln!(out, "\nd6 run {}", serde_json::to_string(&run).unwrap()).unwrap();
    writeln!(out, "d6 acked {}", acked.len()).unwrap();
    writeln!(out, "d6 failed {}", failed.0.tray_id).unwrap();
    out.flush().unwrap();
    drop(store);
    std::process::exit(0);
}

#[test]
fn d6_a_full_disk_is_unavailable_and_the_store_refuses_until_reopened() {
    let tmp = tempfile::tempdir().unwrap();
    let mnt = tmp.path().join("mnt");
    match Tmpfs::mount(&mnt, "4m") {
        Ok(fs) => {
            let path = mnt.join("store");
            // Memtables bigger than the disk: nothing is flushed into a
            // table (which would free journal space on the reopen), so the
            // disk stays full.
            let opts = || Options::new().write_buffer_bytes(40 << 20);
            let store = FileStore::open_with(&path, opts()).unwrap();
            let (run, acked, failed) = fill_until_failure(&store, 16 * 1024);
            assert!(acked.len() > 10, "only {} writes fit in 4 MiB", acked.len());
            drop(store);
            // Reopened on the still-full disk, it opens (or says why not)
            // and refuses what it cannot persist.
            match FileStore::open_with(&path, opts()) {
                Ok(store) => {
                    let (key, _) = filler(1_000_000, 0);
                    let big = tray(true, &noise(7, 64 * 1024), "prod");
                    let r = store.write_tray(&key, 1, big);
                    assert!(
                        r.as_ref().is_err_and(|e| e.is_outcome_unknown()),
                        "a full disk acknowledged a write: {}",
                        shape(&r)
                    );
                }
                Err(e) => eprintln!("d6: reopening on the full disk: {e}"),
            }
            let roomy = tmp.path().join("roomy");
            copy_dir(&path, &roomy);
            drop(fs);
            check_after_failure(&roomy, &run, &acked, &failed);
            eprintln!(
                "d6: a 4 MiB tmpfs took {} writes of 16 KiB, then refused",
                acked.len()
            );
        }
        Err(why) => {
            // Without mount: a real failed write all the same, from a file
            // size limit (RLIMIT_FSIZE, SIGXFSZ ignored) on a child.
            eprintln!("d6: no tmpfs ({why}); using a file-size limit instead");
            let path = tmp.path().join("store");
            let exe = std::env::current_exe().unwrap();
            let out = Command::new("sh")
                .args(["-c", "trap '' XFSZ; exec prlimit \"$0\" -- \"$@\""])
                .arg(FALLBACK_FSIZE)
                .arg(exe)
                .args([
                    "--exact",
                    "durability::d6_child_entry",
                    "--nocapture",
                    "--test-threads=1",
                    "-q",
                ])
                .env(D6_ENV, &path)
                .stderr(Stdio::inherit())
                .output()
                .unwrap();
            let said = |what: &str| child_lines(&out.stdout, &format!("d6 {what} ")).pop();
            let (Some(run), Some(acked), Some(failed)) =
                (said("run"), said("acked"), said("failed"))
            else {
                panic!(
                    "the child never failed: {}",
                    String::from_utf8_lossy(&out.stdout)
                );
            };
            let run: RunRecord = serde_json::from_str(&run).unwrap();
            let acked: u64 = acked.parse().unwrap();
            let failed: u64 = failed.trim_start_matches('k').parse().unwrap();
            assert_eq!(failed, acked, "the child's writes are numbered in order");
            assert!(acked > 10, "only {acked} writes fit");
            let acked: Vec<(TrayKey, Tray)> =
                (0..acked).map(|i| filler(i, FALLBACK_DOC_BYTES)).collect();
            check_after_failure(&path, &run, &acked, &filler(failed, FALLBACK_DOC_BYTES));
            eprintln!(
                "d6: a 64 MiB file-size limit took {} writes of 1 MB, then refused",
                acked.len()
            );
        }
    }
}

// ---------------------------------------------------------------------------
// D7: creating a store is atomic.

#[test]
fn d7_a_kill_during_creation_leaves_nothing_or_a_whole_empty_store() {
    let tries = env_u64("AGENTSTATE_D7_TRIES", 30);
    let tmp = tempfile::tempdir().unwrap();
    let mut rng = crash::Rng::new(env_u64("AGENTSTATE_CRASH_SEED", 7));
    let (mut absent, mut whole, mut partial) = (0, 0, 0);
    // How long a whole creation takes, to spread some kills over it.
    let mut creation = Duration::from_millis(300);
    for i in 0..tries {
        let path = tmp.path().join(format!("s{i}"));
        // Most kills land in the first 30 ms; every third anywhere in a
        // whole creation.
        let delay = if i % 3 == 2 {
            Duration::from_micros(rng.below(creation.as_micros() as u64 + 1))
        } else {
            Duration::from_micros(rng.below(30_001))
        };
        let spec = format!("open:0:{i}:{}", path.display());
        let (out, _) = crash::run_child(
            &|| self_command("durability::d1_child_entry"),
            &spec,
            crash::KillAt::Start(delay),
        )
        .unwrap();
        if let Some(o) = out.opened_after {
            creation = o + Duration::from_millis(10);
        }
        let prefix = format!(".s{i}.creating-");
        partial += std::fs::read_dir(tmp.path())
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
            .count();
        if !path.exists() {
            assert!(
                out.opened_after.is_none(),
                "{} vanished after open returned",
                path.display()
            );
            absent += 1;
            continue;
        }
        whole += 1;
        let store = FileStore::open(&path)
            .unwrap_or_else(|e| panic!("{} after a kill at {delay:?}: {e}", path.display()));
        assert!(store.is_empty().unwrap(), "a new store must be empty");
        assert_eq!(store.commits(), 0);
        assert!(store.verify().unwrap().is_ok());
    }
    eprintln!(
        "d7: {tries} kills: {absent} left nothing, {whole} a whole store, {partial} a half-built one beside the path"
    );
    // A creation at a path whose earlier creation was killed sweeps the
    // leftovers of that dead process and builds a whole store.
    for i in 0..tries {
        let path = tmp.path().join(format!("s{i}"));
        if !path.exists() {
            let store = FileStore::open(&path).unwrap();
            assert!(store.is_empty().unwrap());
        }
    }
    let left: Vec<String> = std::fs::read_dir(tmp.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".creating-"))
        .collect();
    assert!(left.is_empty(), "leftovers not swept: {left:?}");
}

// ---------------------------------------------------------------------------
// D8: a journal cut short is refused unless opened for salvage.

fn journal_of(path: &Path) -> PathBuf {
    let jnls: Vec<PathBuf> = store_files(path)
        .into_iter()
        .filter(|f| f.extension().is_some_and(|e| e == "jnl"))
        .collect();
    assert_eq!(jnls.len(), 1, "{jnls:?}");
    path.join(&jnls[0])
}

/// A store of `n` runs created one commit each, cleanly closed without the
/// flush at close (so its journal holds every commit).
fn many_commits(path: &Path, n: u64) -> Vec<RunRecord> {
    let store = FileStore::open_with(path, Options::new().flush_at_close(false)).unwrap();
    let runs: Vec<RunRecord> = (0..n)
        .map(|i| {
            store
                .put_run(RunRecord::new(RunKey::new("acme", format!("r{i:04}")), "a"))
                .unwrap()
        })
        .collect();
    assert_eq!(store.commits(), n);
    drop(store);
    runs
}

/// Opens `path` for salvage and checks it kept a prefix of `runs`, each
/// exact; returns how many.
fn salvage_prefix(path: &Path, runs: &[RunRecord]) -> usize {
    let store = FileStore::open_with(path, Options::new().salvage(true)).unwrap();
    let kept = runs
        .iter()
        .take_while(|r| store.get_run(&r.key).unwrap().as_ref() == Some(r))
        .count();
    for r in &runs[kept..] {
        assert_eq!(
            store.get_run(&r.key).unwrap(),
            None,
            "a hole: {} kept after a lost run",
            r.key.run_id
        );
    }
    assert!(kept < runs.len(), "nothing was lost");
    assert!(store.verify().unwrap().is_ok());
    assert_eq!(store.commits(), kept as u64);
    // It writes again, and from now on opens normally.
    store
        .put_run(RunRecord::new(RunKey::new("acme", "after"), "a"))
        .unwrap();
    drop(store);
    let store = FileStore::open(path).unwrap();
    assert!(
        store
            .get_run(&RunKey::new("acme", "after"))
            .unwrap()
            .is_some()
    );
    kept
}

fn assert_refused_for_salvage(path: &Path) {
    match FileStore::open(path) {
        Err(StateError::Corrupt { what }) => assert!(
            what.contains("salvage"),
            "the refusal must say how to salvage: {what}"
        ),
        other => panic!("a store cut short must be refused: {other:?}"),
    }
    // Still refused the second time (the mark did not move).
    assert!(matches!(
        FileStore::open(path),
        Err(StateError::Corrupt { .. })
    ));
}

/// The trailer fjall 3.1 ends every journal batch with (`file.rs`,
/// `MAGIC_BYTES`): `End` tag, 8-byte checksum, then these 4 bytes. The byte
/// after it is the next batch's `Start` tag (1).
const BATCH_TRAILER: &[u8] = b"FJL\x03";

/// The offset of the batch trailer nearest the middle of a journal.
fn middle_trailer(jnl: &[u8]) -> usize {
    let mid = jnl.len() / 2;
    let at = (0..jnl.len() - BATCH_TRAILER.len())
        .filter(|&i| &jnl[i..i + BATCH_TRAILER.len()] == BATCH_TRAILER)
        .min_by_key(|&i| i.abs_diff(mid))
        .expect("a journal has batch trailers");
    assert_eq!(
        jnl[at + BATCH_TRAILER.len()],
        1,
        "a batch Start tag follows the trailer"
    );
    at
}

#[test]
fn d8_a_journal_cut_short_is_refused_unless_salvaged() {
    let tmp = tempfile::tempdir().unwrap();
    let pristine = tmp.path().join("pristine");
    let runs = many_commits(&pristine, 300);
    let jnl = std::fs::read(journal_of(&pristine)).unwrap();
    let trailer = middle_trailer(&jnl);
    let copy = |name: &str| {
        let dir = tmp.path().join(name);
        copy_dir(&pristine, &dir);
        dir
    };

    // Ways fjall takes for the journal's end: it recovers the batches
    // before, drops the rest, truncates the file there and says nothing.
    // The high-water mark tells.
    let mut kept_by = Vec::new();
    for (name, d) in [
        (
            "truncated mid-journal",
            Damage::Truncate(jnl.len() as u64 / 2),
        ),
        (
            "next batch's Start tag flipped",
            Damage::Flip((trailer + BATCH_TRAILER.len()) as u64),
        ),
        ("batch trailer flipped", Damage::Flip(trailer as u64 + 1)),
    ] {
        let dir = copy(name);
        damage(&journal_of(&dir), &d);
        assert_refused_for_salvage(&dir);
        let kept = salvage_prefix(&dir, &runs);
        eprintln!(
            "d8: {name}: refused; salvage kept {kept} of {} runs",
            runs.len()
        );
        assert!(kept > 50 && kept < 250, "{name}: kept {kept} of 300");
        kept_by.push(kept);
    }

    // A damaged Start tag loses its batch and all after; a damaged trailer
    // loses the batch it ends, one more.
    assert_eq!(
        kept_by[1],
        kept_by[2] + 1,
        "kept after the Start tag / the trailer flipped"
    );

    // A flipped byte inside a batch fails fjall's batch checksum: fjall
    // refuses the whole journal, and salvage cannot open it either (fjall
    // has no mode that stops at the bad batch). Refused, never wrong.
    let dir = copy("checksum");
    damage(&journal_of(&dir), &Damage::Flip(trailer as u64 - 4));
    for opts in [Options::new(), Options::new().salvage(true)] {
        match FileStore::open_with(&dir, opts.clone()) {
            Err(StateError::Corrupt { what }) => {
                eprintln!("d8: checksum flipped ({opts:?}): {what}")
            }
            other => panic!("a batch failing its checksum must be refused: {other:?}"),
        }
    }
}

// ---------------------------------------------------------------------------
/// Bytes of journal data in the store at `path` (fjall's `*.jnl` files).
fn journal_bytes(path: &Path) -> u64 {
    store_files(path)
        .into_iter()
        .filter(|f| f.extension().is_some_and(|e| e == "jnl"))
        .map(|f| std::fs::metadata(path.join(f)).unwrap().len())
        .sum()
}

/// The ids of the data tables in the store at `path`: fjall's table files
/// of every keyspace but its meta keyspace (`keyspaces/0`).
fn data_table_ids(path: &Path) -> std::collections::BTreeSet<u64> {
    store_files(path)
        .into_iter()
        .filter(|f| {
            let parts: Vec<_> = f.iter().map(|p| p.to_string_lossy().into_owned()).collect();
            parts.len() == 5
                && parts[..2] == ["db", "keyspaces"]
                && parts[2] != "0"
                && parts[3] == "tables"
        })
        .map(|f| f.file_name().unwrap().to_str().unwrap().parse().unwrap())
        .collect()
}

#[test]
fn the_write_buffer_of_each_open_applies_to_an_existing_store() {
    // `Options::write_buffer_bytes` bounds the memory unflushed writes
    // hold, one memtable a fifth of it. fjall keeps the memtable size a
    // keyspace was created with; the store's open must apply the one
    // asked for now, in both directions. Observed by the tables written:
    // ~6 MiB of runs flush a 1 MiB memtable several times and a 40 MiB
    // one never (no flush at close either). Compaction merges the flushed
    // tables as it goes, so what counts is the highest table id (fjall
    // numbers a tree's tables in the order it writes them), not the tables
    // left.
    let tmp = tempfile::tempdir().unwrap();
    let opts = |buffer: u64| {
        Options::new()
            .durability(agentstate::Durability::Buffered)
            .write_buffer_bytes(buffer)
            .flush_at_close(false)
    };
    let (small, big) = (4 << 20, 200 << 20);
    for (created, reopened) in [(big, small), (small, big)] {
        let path = tmp.path().join(format!("store-{created}"));
        let store = FileStore::open_with(&path, opts(created)).unwrap();
        store.put_run(padded_run(0, 10)).unwrap();
        drop(store);
        // Tables written so far: one past the highest id (ids from 0).
        let written = |path: &Path| data_table_ids(path).last().map_or(0, |id| id + 1);
        let before = written(&path);
        let store = FileStore::open_with(&path, opts(reopened)).unwrap();
        let runs: Vec<RunRecord> = (1..3_000)
            .map(|i| store.put_run(padded_run(i, 1_000)).unwrap())
            .collect();
        drop(store);
        let new = written(&path) - before;
        if reopened == small {
            assert!(new >= 2, "a 1 MiB memtable wrote {new} tables");
        } else {
            assert_eq!(new, 0, "a 40 MiB memtable was flushed");
        }
        // And the next open, with the same options, reads everything.
        let store = FileStore::open_with(&path, opts(reopened)).unwrap();
        for r in &runs {
            assert_eq!(store.get_run(&r.key).unwrap().as_ref(), Some(r));
        }
    }
}

/// Run `r{i:05}` of tenant `acme` with a pending tool call whose arguments
/// carry `pad` bytes, so a few thousand of them fill memtables.
fn padded_run(i: u64, pad: usize) -> RunRecord {
    let mut r = RunRecord::new(RunKey::new("acme", format!("r{i:05}")), "a");
    r.pending_tool_calls = vec![ToolCall {
        id: "c".into(),
        name: "t".into(),
        arguments: format!("{{\"pad\":\"{}\"}}", "x".repeat(pad)),
    }];
    r
}

/// The active (newest) journal of the store at `path`: its path, length
/// and allocated bytes.
fn active_journal(path: &Path) -> (PathBuf, u64, u64) {
    use std::os::unix::fs::MetadataExt as _;
    let mut journals: Vec<(u64, PathBuf)> = std::fs::read_dir(path.join("db"))
        .unwrap()
        .filter_map(|e| {
            let p = e.unwrap().path();
            let id = p
                .file_name()?
                .to_str()?
                .strip_suffix(".jnl")?
                .parse()
                .ok()?;
            Some((id, p))
        })
        .collect();
    journals.sort();
    let (_, newest) = journals.pop().expect("a journal");
    let m = std::fs::metadata(&newest).unwrap();
    (newest, m.len(), m.blocks() * 512)
}

#[test]
fn d1_new_journals_start_in_zeros_written_ahead_and_lose_nothing() {
    // fjall's journals are sparse files; ours start in a spare file written
    // with zeros ahead of time (patches/fjall/0008-spare-journal.patch),
    // so a synced append commits no file-system metadata. The spare is
    // taken by an empty journal at open and by every rotation.
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("store");
    let spare = path.join("db").join("journal.spare");
    let big = |i: u64| padded_run(i, 1000);
    let mut runs: Vec<RunRecord> = Vec::new();
    {
        let store = FileStore::open(&path).unwrap();
        runs.extend((0..5).map(|i| store.put_run(big(i)).unwrap()));
    }
    // The clean close emptied the journal and left a spare; the first
    // write after the reopen moves the empty journal into it: allocated,
    // zeros after that write's batch.
    let store = FileStore::open(&path).unwrap();
    assert_eq!(
        active_journal(&path).1,
        0,
        "the clean close left the journal empty"
    );
    runs.push(store.put_run(big(5)).unwrap());
    let (jnl, len, allocated) = active_journal(&path);
    assert!(
        len >= 1 << 20 && allocated >= 1 << 20,
        "{} is {len} bytes long with {allocated} allocated: not the spare",
        jnl.display()
    );
    let bytes = std::fs::read(&jnl).unwrap();
    let written = bytes.iter().rposition(|&b| b != 0).map_or(0, |p| p + 1);
    assert!(
        written > 1000 && written < 4096,
        "{written} bytes of one batch"
    );
    // Rotations (a memtable is 1 MiB) take the spare; a worker writes the
    // next one.
    runs.extend((6..3006).map(|i| store.put_run(big(i)).unwrap()));
    let deadline = Instant::now() + Duration::from_secs(20);
    while !spare.exists() {
        assert!(Instant::now() < deadline, "no spare after the rotations");
        std::thread::sleep(Duration::from_millis(10));
    }
    let (rotated, _, _) = active_journal(&path);
    assert_ne!(rotated, jnl, "3000 runs of 1 KB rotated no journal");
    drop(store);
    let zeros = std::fs::read(&spare).unwrap();
    assert!(zeros.len() >= 1 << 20 && zeros.iter().all(|&b| b == 0));

    let store = FileStore::open(&path).unwrap();
    for r in &runs {
        assert_eq!(store.get_run(&r.key).unwrap().as_ref(), Some(r));
    }
    let report = store.verify().unwrap();
    assert!(report.is_ok(), "{:?}", report.problems);
}

/// The table files of agentstate's keyspace in the store at `path`, by id.
fn table_ids(path: &Path) -> Vec<u64> {
    let mut ids: Vec<u64> = std::fs::read_dir(path.join("db/keyspaces/1/tables"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_str().unwrap().parse().unwrap())
        .collect();
    ids.sort_unstable();
    ids
}

#[test]
fn d1_tables_an_interrupted_compaction_left_leave_at_open_and_are_deleted_after() {
    // A kill during a compaction leaves its new tables in no version. The
    // open moves them out of `tables/` before it returns (the next table
    // takes the next id, maybe an orphan's) and deletes them afterwards,
    // with what an earlier open left to delete (patches/lsm-tree/0004-orphaned-tables-leave-the-open.patch).
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("store");
    let mut runs: Vec<RunRecord> = Vec::new();
    {
        let store = FileStore::open(&path).unwrap();
        runs.extend((0..200).map(|i| store.put_run(padded_run(i, 1000)).unwrap()));
    }
    let tables = path.join("db/keyspaces/1/tables");
    let trash = path.join("db/keyspaces/1/trash");
    let ids = table_ids(&path);
    let newest = *ids.last().expect("the clean close flushed a table");
    // Orphans: a copy of the newest table under the id the next flush
    // takes and another further on, and a file an earlier open moved out.
    for orphan in [newest + 1, newest + 7] {
        std::fs::copy(
            tables.join(newest.to_string()),
            tables.join(orphan.to_string()),
        )
        .unwrap();
    }
    std::fs::create_dir_all(&trash).unwrap();
    std::fs::write(trash.join("999999"), b"left by an earlier open").unwrap();

    let store = FileStore::open(&path).unwrap();
    assert_eq!(
        table_ids(&path),
        ids,
        "orphans still in tables/ after the open"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::fs::read_dir(&trash).unwrap().next().is_some() {
        assert!(Instant::now() < deadline, "trash/ was never emptied");
        std::thread::sleep(Duration::from_millis(10));
    }
    // New tables take the orphans' ids and lose nothing.
    runs.extend((200..400).map(|i| store.put_run(padded_run(i, 1000)).unwrap()));
    drop(store);
    assert!(
        table_ids(&path).iter().any(|&id| id > newest),
        "the close flushed no new table"
    );
    let store = FileStore::open(&path).unwrap();
    for r in &runs {
        assert_eq!(store.get_run(&r.key).unwrap().as_ref(), Some(r));
    }
    let report = store.verify().unwrap();
    assert!(report.is_ok(), "{:?}", report.problems);
}

#[test]
fn d8_a_clean_close_empties_the_journal_and_loses_nothing() {
    // A clean close flushes the memtables and empties the journals they
    // made redundant (kv/engine/file.rs). Runs big enough that memtables
    // also rotate and flush while writing; a small write buffer.
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("store");
    let opts = || {
        Options::new()
            .durability(agentstate::Durability::Buffered)
            .write_buffer_bytes(4 << 20)
    };
    let big = |i: u64| padded_run(i, 1500);
    let n = 2500;
    let store = FileStore::open_with(&path, opts()).unwrap();
    let mut runs: Vec<RunRecord> = (0..n).map(|i| store.put_run(big(i)).unwrap()).collect();
    assert_eq!(store.commits(), n);
    drop(store);
    assert_eq!(journal_bytes(&path), 0, "the clean close left journal data");
    let hwm: u64 = std::fs::read_to_string(path.join("HWM"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(hwm, n, "the mark counts every commit");

    // Everything is there, and writes after the reopen are newer than
    // everything the tables hold (the engine's sequence numbers went on).
    for round in 0..2u64 {
        let store = FileStore::open_with(&path, opts().flush_at_close(round == 0)).unwrap();
        assert_eq!(store.commits(), n + round * 100);
        for r in &runs {
            assert_eq!(store.get_run(&r.key).unwrap().as_ref(), Some(r));
        }
        for r in runs.iter_mut().take(100) {
            let mut next = r.clone();
            next.state = RunState::Completed;
            *r = store.put_run(next).unwrap();
        }
        drop(store);
        if round == 0 {
            assert_eq!(journal_bytes(&path), 0);
        } else {
            // Closed without the flush: the next open replays the journal.
            assert!(journal_bytes(&path) > 0);
        }
    }
    let store = FileStore::open_with(&path, opts()).unwrap();
    assert_eq!(store.commits(), n + 200);
    for r in &runs {
        assert_eq!(store.get_run(&r.key).unwrap().as_ref(), Some(r));
    }
    let report = store.verify().unwrap();
    assert!(report.is_ok(), "{:?}", report.problems);
}

// D9: readers never see a write before it is durable, nor part of a group.

/// D9 at the engine: fjall's flushes and compactions take a sequence number
/// when they register a new tree version and publish it, and before the
/// vendored patch (`patches/fjall/0006-no-snapshot-above-an-applying-batch.patch`)
/// that made a batch still being
/// inserted into the memtable visible: a snapshot opened in that window read
/// part of the batch. Here a thread flushes without pause while batches of
/// synced writes move a set of keys, and readers count the set.
#[test]
fn d9_engine_flushes_never_show_part_of_a_batch() {
    use fjall::{KeyspaceCreateOptions, PersistMode, Readable as _};
    let rounds = env_u64("AGENTSTATE_D9_ROUNDS", 200);
    let size = 100usize;
    let tmp = tempfile::tempdir().unwrap();
    let db = fjall::Database::builder(tmp.path()).open().unwrap();
    let ks = db.keyspace("d9", KeyspaceCreateOptions::default).unwrap();
    let done = AtomicBool::new(false);
    let committed = AtomicU64::new(0);
    let seen = Mutex::new(BTreeMap::<bool, u64>::new());
    std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(Ordering::SeqCst) {
                ks.rotate_memtable_and_wait().unwrap();
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        for _ in 0..2 {
            s.spawn(|| {
                while !done.load(Ordering::SeqCst) {
                    // Every batch rewrites the same keys with its round.
                    let committed = committed.load(Ordering::SeqCst);
                    let snap = db.snapshot();
                    let mut rounds = Vec::with_capacity(size);
                    for kv in snap.iter(&ks) {
                        let v = kv.value().unwrap();
                        rounds.push(u64::from_be_bytes(v[..8].try_into().unwrap()));
                    }
                    let whole = rounds.len() == size && rounds.iter().all(|r| *r == rounds[0]);
                    assert!(
                        (rounds.is_empty() && committed == 0) || whole,
                        "a snapshot read {} keys of rounds {rounds:?}: part of a batch",
                        rounds.len()
                    );
                    *seen.lock().unwrap().entry(whole).or_default() += 1;
                }
            });
        }
        for round in 1..=rounds {
            let mut b = db.batch().durability(Some(PersistMode::SyncData));
            for i in 0..size {
                let mut v = round.to_be_bytes().to_vec();
                v.resize(200, b'.');
                b.insert(&ks, format!("k{i:03}"), v);
            }
            b.commit().unwrap();
            committed.store(round, Ordering::SeqCst);
        }
        done.store(true, Ordering::SeqCst);
    });
    let seen = seen.into_inner().unwrap();
    eprintln!("d9 engine: {rounds} batches of {size}; snapshots (whole?): {seen:?}");
    assert!(seen.get(&true).copied().unwrap_or(0) > 0);
}

#[test]
fn d9_a_reader_never_sees_part_of_a_tray_batch() {
    let rounds = env_u64("AGENTSTATE_D9_ROUNDS", 200);
    // Trays a batch writes (and deletes of the round before); half marked.
    let size = env_u64("AGENTSTATE_D9_BATCH", 50).clamp(2, 998) as usize;
    // Each tray's doc carries this much padding, so the rounds fill
    // memtables and the engine flushes and compacts while batches commit
    // (a flush racing a batch is how a reader once saw part of one).
    let pad = env_u64("AGENTSTATE_D9_PAD", 1024) as usize;
    let doc = |round: u64| {
        let mut d = format!("round {round} ").into_bytes();
        d.resize(d.len() + pad, b'.');
        d
    };
    let tmp = tempfile::tempdir().unwrap();
    let store = Arc::new(FileStore::open(tmp.path().join("store")).unwrap());
    let inst = InstanceKey::new("w", "1");
    let done = AtomicBool::new(false);
    let seen = Mutex::new(BTreeMap::<usize, u64>::new());
    // Which round a reader saw, from the tray namespaces `r{round}`.
    fn one_round<'a>(
        what: &str,
        ns: impl Iterator<Item = &'a str>,
        want: usize,
        last: &mut u64,
    ) -> usize {
        let rounds: Vec<u64> = ns
            .map(|ns| ns.trim_start_matches('r').parse().unwrap())
            .collect();
        let n = rounds.len();
        assert!(
            n == 0 || n == want,
            "a reader of {what} saw {n} entries, not 0 or {want}: part of a batch"
        );
        if let Some(&r) = rounds.first() {
            assert!(
                rounds.iter().all(|&x| x == r),
                "a reader of {what} saw rounds {rounds:?} at once"
            );
            assert!(
                r >= *last,
                "a reader of {what} went back from round {last} to {r}"
            );
            *last = r;
        }
        n
    }
    std::thread::scope(|s| {
        // The sweeper's listing reads without the commit lock; the tray
        // listing takes it for its fence check, then reads.
        s.spawn(|| {
            let mut last = 0;
            while !done.load(Ordering::SeqCst) {
                let page = store.marked_trays(None, &PageRequest::new(1000)).unwrap();
                let n = one_round(
                    "marked_trays",
                    page.items().iter().map(|m| m.key.tray_ns.as_str()),
                    size / 2,
                    &mut last,
                );
                *seen.lock().unwrap().entry(n).or_default() += 1;
            }
        });
        s.spawn(|| {
            let mut last = 0;
            while !done.load(Ordering::SeqCst) {
                let page = store.list_trays(&inst, 1, &PageRequest::new(1000)).unwrap();
                for (k, t) in page.items() {
                    assert!(t.doc == doc(k.tray_ns[1..].parse::<u64>().unwrap()));
                }
                let n = one_round(
                    "list_trays",
                    page.items().iter().map(|(k, _)| k.tray_ns.as_str()),
                    size,
                    &mut last,
                );
                *seen.lock().unwrap().entry(n).or_default() += 1;
            }
        });
        for round in 1..=rounds {
            let mut ops = Vec::with_capacity(2 * size);
            for i in 0..size {
                if round > 1 {
                    ops.push(TrayOp::Delete {
                        tray_ns: format!("r{:06}", round - 1),
                        tray_id: format!("k{i}"),
                    });
                }
                // Zero-padded, so each round's keys sort after the last
                // round's: a reader walking the range meets the new keys
                // while the writer may still be inserting them.
                ops.push(TrayOp::Put {
                    tray_ns: format!("r{round:06}"),
                    tray_id: format!("k{i}"),
                    tray: tray(i % 2 == 0, &doc(round), "prod"),
                });
            }
            store.apply_batch(&inst, 1, ops).unwrap();
        }
        done.store(true, Ordering::SeqCst);
    });
    let seen = seen.into_inner().unwrap();
    eprintln!("d9: {rounds} batches of {size}; reader pages by size: {seen:?}");
    assert!(
        seen.get(&size).copied().unwrap_or(0) > 0,
        "the readers never saw a batch"
    );
    // And the marked index moved with the trays, all or nothing.
    let marked = store.marked_trays(None, &PageRequest::new(1000)).unwrap();
    assert_eq!(marked.items().len(), size / 2);
    assert!(
        marked
            .items()
            .iter()
            .all(|m| m.key.tray_ns == format!("r{rounds:06}"))
    );
}
