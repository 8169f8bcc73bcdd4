//! The `agentstate` binary, run for real on real stores in temp dirs, and
//! `StoreAdmin::prune`'s own rules.

use std::collections::{BTreeMap, HashSet};
use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Barrier};

use agentstate::{
    Alarm, Approval, BudgetStatus, Entry, FileStore, InstanceKey, ManualClock, MarkedTray,
    MemoryStore, Options, PageRequest, RecordKey, RunKey, RunRecord, RunSpend, RunState,
    SessionKey, SessionRecord, StateDelta, StateError, StateQuery, StateStore, StoreAdmin,
    StoreStats, ToolCall, Tray, TrayStore, VerifyReport,
};

/// 2023-11-14T22:13:20Z: when the fixture's first records were written.
const T0: u64 = 1_700_000_000_000;
const HOUR: u64 = 3_600_000;

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn output(o: Output) -> Run {
    Run {
        code: o.status.code().expect("the binary exited (no signal)"),
        stdout: String::from_utf8(o.stdout).expect("stdout is UTF-8"),
        stderr: String::from_utf8(o.stderr).expect("stderr is UTF-8"),
    }
}

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_agentstate"));
    c.env_remove("AGENTSTATE_DB");
    c
}

/// Runs the binary with `args`.
fn cli(args: &[&str]) -> Run {
    output(bin().args(args).output().expect("the binary runs"))
}

/// Runs the binary with `args` and `stdin`.
fn cli_stdin(args: &[&str], stdin: &[u8]) -> Run {
    let mut child = bin()
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary runs");
    // The binary may stop reading early (a bad line): a broken pipe is
    // its answer, not the test's failure.
    match child.stdin.take().expect("piped").write_all(stdin) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        r => r.expect("stdin written"),
    }
    output(child.wait_with_output().expect("the binary ends"))
}

/// Runs the binary and expects exit 0.
fn ok(args: &[&str]) -> String {
    let r = cli(args);
    assert_eq!(r.code, 0, "{args:?} failed: {}", r.stderr);
    r.stdout
}

fn p(path: &Path) -> &str {
    path.to_str().expect("temp paths are UTF-8")
}

/// Table rows after the header.
fn rows(stdout: &str) -> Vec<&str> {
    stdout.lines().skip(1).filter(|l| !l.is_empty()).collect()
}

fn json_lines<T: serde::de::DeserializeOwned>(stdout: &str) -> Vec<T> {
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect()
}

fn clock_opts(clock: &Arc<ManualClock>) -> Options {
    Options::new().clock(clock.clone())
}

fn tool_call(id: &str) -> ToolCall {
    ToolCall {
        id: id.into(),
        name: "search".into(),
        arguments: r#"{"q":"lisbon"}"#.into(),
    }
}

fn tray(doc: &[u8], marked: bool, env: &str) -> Tray {
    Tray {
        marked,
        doc: doc.to_vec(),
        env: env.into(),
        hostname: "host-1".into(),
    }
}

/// A store with a bit of everything:
/// - acme: sessions s1 (3 runs) and s2 (none); runs r1 running (s1, a
///   pending tool call, spend), r2 completed (s1), r3 awaiting approval
///   (s1), all at T0; r4 failed (coder) and r5 pending at T0 + 1h.
/// - beta: b1 running, b2 completed.
/// - chat/room-1 at epoch 3: state/main marked (prod), state/aux unmarked
///   with a binary doc; chat/room-2 at epoch 1: one tray marked (staging).
/// - alarms: chat/room-1 at T0 + 10 min, chat/room-2 at T0 + 2 h.
fn fixture(path: &Path) {
    let clock = Arc::new(ManualClock::new(T0));
    let s = FileStore::open_with(path, clock_opts(&clock)).expect("open");
    let mut s1 = SessionRecord::new(SessionKey::new("acme", "s1"));
    s1.metadata.insert("title".into(), "trip".into());
    s.put_session(s1).unwrap();
    s.put_session(SessionRecord::new(SessionKey::new("acme", "s2")))
        .unwrap();
    let mut r1 = RunRecord::new(RunKey::new("acme", "r1"), "planner").with_session("s1");
    r1.state = RunState::Running;
    r1.pending_tool_calls.push(tool_call("c1"));
    let r1 = s.put_run(r1).unwrap();
    s.patch_run(
        &r1.key,
        StateDelta {
            cost_micros: 2_500,
            messages_read: 4,
            iterations: 2,
            ..Default::default()
        },
    )
    .unwrap();
    let mut r2 = RunRecord::new(RunKey::new("acme", "r2"), "planner").with_session("s1");
    r2.state = RunState::Completed;
    s.put_run(r2).unwrap();
    let mut r3 = RunRecord::new(RunKey::new("acme", "r3"), "coder").with_session("s1");
    r3.state = RunState::AwaitingApproval;
    r3.approval = Some(Approval {
        id: "ap1".into(),
        prompt: "deploy?".into(),
    });
    s.put_run(r3).unwrap();
    clock.advance(HOUR);
    let mut r4 = RunRecord::new(RunKey::new("acme", "r4"), "coder");
    r4.state = RunState::Failed;
    s.put_run(r4).unwrap();
    s.put_run(RunRecord::new(RunKey::new("acme", "r5"), "planner"))
        .unwrap();
    let mut b1 = RunRecord::new(RunKey::new("beta", "b1"), "planner");
    b1.state = RunState::Running;
    s.put_run(b1).unwrap();
    let mut b2 = RunRecord::new(RunKey::new("beta", "b2"), "planner");
    b2.state = RunState::Completed;
    s.put_run(b2).unwrap();
    let room1 = InstanceKey::new("chat", "room-1");
    s.write_tray(
        &room1.tray("state", "main"),
        3,
        tray(b"hello", true, "prod"),
    )
    .unwrap();
    s.write_tray(
        &room1.tray("state", "aux"),
        3,
        tray(&[0, 159, 146, 150], false, "prod"),
    )
    .unwrap();
    let room2 = InstanceKey::new("chat", "room-2");
    s.write_tray(
        &room2.tray("state", "main"),
        1,
        tray(b"{}", true, "staging"),
    )
    .unwrap();
    s.set_alarm(&room1, 3, T0 + 10 * 60_000).unwrap();
    s.set_alarm(&room2, 1, T0 + 2 * HOUR).unwrap();
}

fn fixture_dir() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("db");
    fixture(&db);
    (dir, db)
}

#[test]
fn cli_demo_shows_each_promise_and_leaves_a_sound_store() {
    // Without --db: a temporary store, removed at the end.
    let r = cli(&["demo"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    for needle in [
        "version conflict on run acme/run-1: expected 0, stored 1",
        "version conflict on run acme/run-1: expected 1, stored 2",
        "fence lost on instance chat/room-42: caller epoch 1 < stored epoch 2",
        "cost 1 = 1,000,000 micros (expected 1,000,000)",
        "due now: chat/room-42",
        "each exactly once",
        "refused: InUse",
        "with cascade",
        "no problems",
        "conflicts resolved",
    ] {
        assert!(
            r.stdout.contains(needle),
            "demo output lacks {needle:?}:\n{}",
            r.stdout
        );
    }
    let first = r.stdout.lines().next().unwrap();
    let temp = first.rsplit(' ').next().unwrap();
    assert!(
        !Path::new(temp).exists(),
        "the demo's temporary store {temp} was left behind"
    );

    // With --db: the store is kept, sound, and a second demo refuses it.
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("demo");
    let r = cli(&["demo", "--db", p(&db)]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(ok(&["verify", "--db", p(&db)]).contains("ok: no problems found"));
    let r = cli(&["demo", "--db", p(&db)]);
    assert_eq!(r.code, 2);
    assert!(r.stderr.contains("is not empty"), "{}", r.stderr);
}

#[test]
fn cli_runs_list_filters_pages_and_json() {
    let (_dir, db) = fixture_dir();
    let db = p(&db);
    let all = ok(&["runs", "list", "--db", db, "--tenant", "acme"]);
    assert!(all.starts_with("TENANT"), "{all}");
    let ids: Vec<&str> = rows(&all)
        .iter()
        .map(|l| l.split_whitespace().nth(1).unwrap())
        .collect();
    assert_eq!(ids, ["r1", "r2", "r3", "r4", "r5"], "seq order");

    let count = |args: &[&str]| rows(&ok(args)).len();
    assert_eq!(
        count(&[
            "runs", "list", "--db", db, "--tenant", "acme", "--state", "running"
        ]),
        1
    );
    assert_eq!(
        count(&[
            "runs",
            "list",
            "--db",
            db,
            "--tenant",
            "acme",
            "--session",
            "s1"
        ]),
        3
    );
    assert_eq!(
        count(&[
            "runs", "list", "--db", db, "--tenant", "acme", "--agent", "coder"
        ]),
        2
    );
    // r1..r3 were last written at T0 (ms), r4 and r5 an hour later.
    let cut = (T0 + 1).to_string();
    assert_eq!(
        count(&[
            "runs",
            "list",
            "--db",
            db,
            "--tenant",
            "acme",
            "--updated-before",
            &cut
        ]),
        3
    );
    assert_eq!(
        count(&[
            "runs",
            "list",
            "--db",
            db,
            "--tenant",
            "acme",
            "--updated-before",
            "2023-11-14T22:30:00Z"
        ]),
        3
    );
    assert_eq!(
        count(&[
            "runs",
            "list",
            "--db",
            db,
            "--tenant",
            "acme",
            "--updated-before",
            "10m"
        ]),
        5
    );
    // Every tenant, tenant by tenant.
    assert_eq!(count(&["runs", "list", "--db", db]), 7);

    // JSON: one stored record per line.
    let json: Vec<RunRecord> = json_lines(&ok(&[
        "runs", "list", "--db", db, "--tenant", "acme", "--json",
    ]));
    assert_eq!(json.len(), 5);
    assert_eq!(json[0].cost_micros, 2_500);
    assert_eq!(json[0].pending_tool_calls, vec![tool_call("c1")]);

    // Paging: a page, then the cursor it hands out, or --all.
    let r = cli(&[
        "runs", "list", "--db", db, "--tenant", "acme", "--limit", "2", "--json",
    ]);
    assert_eq!(r.code, 0);
    let page1: Vec<RunRecord> = json_lines(&r.stdout);
    assert_eq!(page1.len(), 2);
    let cursor = r
        .stderr
        .split("--cursor ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .expect(&r.stderr);
    let page2: Vec<RunRecord> = json_lines(&ok(&[
        "runs", "list", "--db", db, "--tenant", "acme", "--limit", "2", "--json", "--cursor",
        cursor,
    ]));
    assert_eq!(
        page2
            .iter()
            .map(|r| r.key.run_id.as_str())
            .collect::<Vec<_>>(),
        ["r3", "r4"]
    );
    assert_eq!(
        count(&[
            "runs", "list", "--db", db, "--tenant", "acme", "--limit", "2", "--all"
        ]),
        5
    );
    assert_eq!(
        count(&["runs", "list", "--db", db, "--limit", "3", "--all"]),
        7
    );
    assert_eq!(count(&["runs", "list", "--db", db, "--limit", "3"]), 3);
    // A cursor of another listing is refused, never another tenant's data.
    let r = cli(&[
        "runs", "list", "--db", db, "--tenant", "beta", "--cursor", cursor,
    ]);
    assert_eq!(r.code, 2);
    assert!(
        r.stderr.starts_with("error: invalid input: cursor"),
        "{}",
        r.stderr
    );
}

#[test]
fn cli_runs_show_text_json_and_missing() {
    let (_dir, db) = fixture_dir();
    let db = p(&db);
    let text = ok(&["runs", "show", "--db", db, "--tenant", "acme", "r1"]);
    for needle in [
        "acme/r1",
        "running",
        "planner",
        "s1",
        "messages read  4",
        "0.0025",
        "c1  search",
        "mid tool call",
    ] {
        assert!(text.contains(needle), "lacks {needle:?}:\n{text}");
    }
    let approval = ok(&["runs", "show", "--db", db, "--tenant", "acme", "r3"]);
    assert!(approval.contains("ap1: deploy?"), "{approval}");
    let json: Vec<RunRecord> = json_lines(&ok(&[
        "runs", "show", "--db", db, "--tenant", "acme", "r1", "--json",
    ]));
    assert_eq!((json[0].key.run_id.as_str(), json[0].version), ("r1", 2));
    let r = cli(&["runs", "show", "--db", db, "--tenant", "acme", "nope"]);
    assert_eq!(r.code, 1);
    assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
    assert!(
        r.stderr.starts_with("error: no run acme/nope"),
        "{}",
        r.stderr
    );
}

#[test]
fn cli_sessions_list_show_and_delete() {
    let (_dir, db) = fixture_dir();
    let db_s = p(&db);
    let list = ok(&["sessions", "list", "--db", db_s, "--tenant", "acme"]);
    let ids: Vec<&str> = rows(&list)
        .iter()
        .map(|l| l.split_whitespace().nth(1).unwrap())
        .collect();
    assert_eq!(ids, ["s1", "s2"]);
    assert!(list.contains("title=trip"), "{list}");
    let json: Vec<SessionRecord> = json_lines(&ok(&[
        "sessions", "list", "--db", db_s, "--tenant", "acme", "--json",
    ]));
    assert_eq!(
        json[0].metadata.get("title").map(String::as_str),
        Some("trip")
    );
    let r = cli(&[
        "sessions", "list", "--db", db_s, "--tenant", "acme", "--limit", "1",
    ]);
    assert_eq!((r.code, rows(&r.stdout).len()), (0, 1));
    assert!(r.stderr.contains("--cursor"), "{}", r.stderr);
    assert_eq!(
        rows(&ok(&["sessions", "list", "--db", db_s, "--tenant", "beta"])).len(),
        0
    );

    let show = ok(&["sessions", "show", "--db", db_s, "--tenant", "acme", "s1"]);
    assert!(show.contains("runs      3 (2 unfinished)"), "{show}");
    for run in ["r1", "r2", "r3"] {
        assert!(show.contains(run), "{show}");
    }
    let v: Vec<serde_json::Value> = json_lines(&ok(&[
        "sessions", "show", "--db", db_s, "--tenant", "acme", "s1", "--json",
    ]));
    assert_eq!(v[0]["runs"].as_array().map(Vec::len), Some(3));

    // Refused while r1 and r3 are unfinished: exit 1, one line, the way out.
    let r = cli(&["sessions", "delete", "--db", db_s, "--tenant", "acme", "s1"]);
    assert_eq!(r.code, 1);
    assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
    assert!(
        r.stderr.contains("2 unfinished run(s): r1, r3") && r.stderr.contains("--cascade"),
        "{}",
        r.stderr
    );
    assert!(
        ok(&["sessions", "delete", "--db", db_s, "--tenant", "acme", "s2"])
            .contains("deleted session acme/s2")
    );
    let out = ok(&[
        "sessions",
        "delete",
        "--db",
        db_s,
        "--tenant",
        "acme",
        "s1",
        "--cascade",
    ]);
    assert!(out.contains("and its 3 run(s): r1, r2, r3"), "{out}");
    assert_eq!(
        cli(&["sessions", "delete", "--db", db_s, "--tenant", "acme", "s1"]).code,
        1
    );
    assert_eq!(
        cli(&["sessions", "show", "--db", db_s, "--tenant", "acme", "s1"]).code,
        1
    );

    let s = FileStore::open(&db).unwrap();
    assert!(
        s.get_session(&SessionKey::new("acme", "s1"))
            .unwrap()
            .is_none()
    );
    for run in ["r1", "r2", "r3"] {
        assert!(s.get_run(&RunKey::new("acme", run)).unwrap().is_none());
    }
    assert!(s.get_run(&RunKey::new("acme", "r4")).unwrap().is_some());
    assert!(s.verify().unwrap().is_ok());
}

#[test]
fn cli_trays_and_alarms() {
    let (_dir, db) = fixture_dir();
    let db_s = p(&db);
    // Without --epoch: read at the stored epoch, never fencing the holder out.
    let list = ok(&[
        "trays", "list", "--db", db_s, "--ns", "chat", "--id", "room-1",
    ]);
    assert_eq!(rows(&list).len(), 2, "{list}");
    assert!(
        list.contains("hello") && list.contains("(binary)"),
        "{list}"
    );
    // A line is the tray's key and the tray, in the library's shapes (a
    // binary doc as `doc_base64`).
    let text = ok(&[
        "trays", "list", "--db", db_s, "--ns", "chat", "--id", "room-1", "--json",
    ]);
    let json: Vec<serde_json::Value> = json_lines(&text);
    assert_eq!(json[0]["key"]["tray_id"], "aux");
    assert_eq!(json[0]["tray"]["doc_base64"], "AJ+Slg==");
    assert_eq!(json[1]["tray"]["doc"], "hello");
    assert_eq!(json[1]["tray"]["marked"], true);
    #[derive(serde::Deserialize)]
    struct TrayLine {
        key: agentstate::TrayKey,
        tray: Tray,
    }
    let lines: Vec<TrayLine> = json_lines(&text);
    assert_eq!(
        (lines[0].key.to_string(), lines[0].tray.doc.as_slice()),
        (
            "chat/room-1/state/aux".to_string(),
            &[0x00, 0x9f, 0x92, 0x96][..]
        )
    );
    // An older epoch is fenced: exit 1 and the epoch to use.
    let r = cli(&[
        "trays", "list", "--db", db_s, "--ns", "chat", "--id", "room-1", "--epoch", "2",
    ]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains("FenceLost") || r.stderr.contains("fence lost"),
        "{}",
        r.stderr
    );
    assert!(r.stderr.contains("--epoch 3"), "{}", r.stderr);
    // A newer one takes the instance over, and says so.
    let r = cli(&[
        "trays", "list", "--db", db_s, "--ns", "chat", "--id", "room-1", "--epoch", "5",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stderr.contains("now at epoch 5 (was 3)"), "{}", r.stderr);

    let marked = ok(&["trays", "marked", "--db", db_s]);
    assert_eq!(rows(&marked).len(), 2, "{marked}");
    let staging = ok(&[
        "trays", "marked", "--db", db_s, "--env", "staging", "--json",
    ]);
    let staging: Vec<MarkedTray> = json_lines(&staging);
    assert_eq!(staging.len(), 1);
    assert_eq!(
        staging[0].key.instance(),
        InstanceKey::new("chat", "room-2")
    );

    assert_eq!(
        rows(&ok(&[
            "alarms",
            "due",
            "--db",
            db_s,
            "--now",
            &T0.to_string()
        ]))
        .len(),
        0
    );
    let due = ok(&[
        "alarms",
        "due",
        "--db",
        db_s,
        "--now",
        "2023-11-14T23:00:00Z",
    ]);
    assert_eq!(rows(&due).len(), 1, "{due}");
    assert!(
        due.contains("room-1") && due.contains("2023-11-14T22:23:20Z") && due.contains("36m 40s"),
        "{due}"
    );
    let all: Vec<Alarm> = json_lines(&ok(&["alarms", "due", "--db", db_s, "--json"]));
    assert_eq!(all.len(), 2);
    assert_eq!(all[1].due_at, T0 + 2 * HOUR);

    let s = FileStore::open(&db).unwrap();
    assert_eq!(s.epoch(&InstanceKey::new("chat", "room-1")).unwrap(), 5);
    assert_eq!(s.epoch(&InstanceKey::new("chat", "room-2")).unwrap(), 1);
}

#[test]
fn cli_stats_and_verify() {
    let (_dir, db) = fixture_dir();
    let db = p(&db);
    let text = ok(&["stats", "--db", db]);
    for needle in [
        "acme",
        "beta",
        "runs      7",
        "sessions  2",
        "trays     3 (2 marked)",
        "alarms    2",
        "disk",
    ] {
        assert!(text.contains(needle), "lacks {needle:?}:\n{text}");
    }
    // The line is the library's StoreStats.
    let v: Vec<serde_json::Value> = json_lines(&ok(&["stats", "--db", db, "--json"]));
    assert_eq!(v[0]["tenants"]["acme"]["runs_by_state"]["running"], 1);
    assert_eq!(v[0]["tenants"]["acme"]["sessions"], 2);
    assert_eq!(v[0]["tenants"]["beta"]["runs_by_state"]["completed"], 1);
    assert_eq!(v[0]["marked_trays"], 2);
    assert!(v[0]["disk_bytes"].as_u64().unwrap() > 0);
    let stats: Vec<StoreStats> = json_lines(&ok(&["stats", "--db", db, "--json"]));
    assert_eq!(stats[0], FileStore::open(db).unwrap().stats().unwrap());

    let r = cli(&["verify", "--db", db]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout
            .contains("checked 7 runs, 2 sessions, 3 trays, 2 alarms"),
        "{}",
        r.stdout
    );
    // The library's VerifyReport, with `ok`.
    let text = ok(&["verify", "--db", db, "--json"]);
    let v: Vec<serde_json::Value> = json_lines(&text);
    assert_eq!(v[0]["ok"], true);
    let report: Vec<VerifyReport> = json_lines(&text);
    assert_eq!((report[0].runs, report[0].sessions), (7, 2));
}

#[test]
fn cli_verify_exits_1_on_an_inconsistent_store() {
    // A run whose state index entry is gone: the store's own writes never
    // leave one, so the test makes it through a hook kept for this.
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("db");
    {
        let s = FileStore::open(&db).unwrap();
        let r = s
            .put_run(RunRecord::new(RunKey::new("acme", "a"), "planner"))
            .unwrap();
        s.__unindex_run_for_tests(&r.key).unwrap();
    }
    let r = cli(&["verify", "--db", p(&db)]);
    assert_eq!(r.code, 1, "{}", r.stdout);
    assert!(
        r.stdout.contains("problem: ") && r.stdout.contains("state index entry missing"),
        "{}",
        r.stdout
    );
    assert_eq!(r.stderr.lines().count(), 1);
    assert!(r.stderr.starts_with("error: verify found"), "{}", r.stderr);
}

#[test]
fn cli_import_refuses_a_seq_used_twice_and_bad_ids() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("db");
    let mut a = RunRecord::new(RunKey::new("acme", "a"), "planner");
    (a.version, a.seq) = (1, 7);
    let mut b = a.clone();
    b.key.run_id = "b".into();
    let import = |entries: Vec<Entry>| {
        let mut text = String::from("{\"agentstate_export\":1}\n");
        for e in entries {
            text.push_str(&serde_json::to_string(&e).unwrap());
            text.push('\n');
        }
        cli_stdin(&["import", "--db", p(&db)], text.as_bytes())
    };
    let r = import(vec![Entry::Run(a.clone()), Entry::Run(b)]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("seq 7 is already used"), "{}", r.stderr);
    let mut c = a;
    c.key.tenant = String::new();
    let r = import(vec![Entry::Run(c)]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("tenant"), "{}", r.stderr);
    // Nothing of the refused batches landed.
    assert!(FileStore::open(&db).unwrap().is_empty().unwrap());
}

/// Every entry of a store, via the library.
fn entries(db: &Path) -> Vec<Entry> {
    let s = FileStore::open(db).unwrap();
    s.iter_export()
        .page_size(3)
        .collect::<agentstate::Result<_>>()
        .unwrap()
}

#[test]
fn cli_export_import_round_trip_is_byte_identical() {
    let (dir, db) = fixture_dir();
    let (f1, f2) = (dir.path().join("one.jsonl"), dir.path().join("two.jsonl"));
    let (db2, db3) = (dir.path().join("db2"), dir.path().join("db3"));
    let r = cli(&["export", "--db", p(&db), "--out", p(&f1)]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let one = std::fs::read(&f1).unwrap();
    let text = String::from_utf8(one.clone()).unwrap();
    assert!(text.starts_with("{\"agentstate_export\":2}\n"), "{text}");
    // 7 runs, 2 sessions, 2 epochs, 3 trays, 2 alarms, and the trailer.
    assert_eq!(text.lines().count(), 1 + 7 + 2 + 2 + 3 + 2 + 1, "{text}");
    let cut = text.len() - trailer_len(&text);
    assert_eq!(
        with_trailer(&text[..cut]),
        text,
        "the trailer counts and hashes the rest"
    );
    assert!(text.ends_with('\n'));
    // Stdout gives the same bytes as --out.
    assert_eq!(ok(&["export", "--db", p(&db)]).as_bytes(), one.as_slice());

    assert!(ok(&["import", "--db", p(&db2), "--in", p(&f1)]).contains("imported 16 entries"));
    let r = cli(&["export", "--db", p(&db2), "--out", p(&f2)]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(
        std::fs::read(&f2).unwrap(),
        one,
        "export -> import -> export changed bytes"
    );
    // From stdin, too.
    let r = cli_stdin(&["import", "--db", p(&db3)], &one);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(ok(&["export", "--db", p(&db3)]).as_bytes(), one.as_slice());

    // Record by record, and through the ordinary API.
    let (a, b) = (entries(&db), entries(&db2));
    assert_eq!(a.len(), 16);
    assert_eq!(a, b);
    {
        let (s1, s2) = (
            FileStore::open(&db).unwrap(),
            FileStore::open(&db2).unwrap(),
        );
        for (t, id) in [("acme", "r1"), ("acme", "r3"), ("beta", "b2")] {
            let k = RunKey::new(t, id);
            assert_eq!(s1.get_run(&k).unwrap(), s2.get_run(&k).unwrap());
        }
        let room1 = InstanceKey::new("chat", "room-1");
        assert_eq!(s2.epoch(&room1).unwrap(), 3);
        let marked = s2.marked_trays(None, &PageRequest::new(10)).unwrap();
        assert_eq!(marked.items().len(), 2, "the sweeper's index was rebuilt");
        let due = s2.due_alarms(u64::MAX, &PageRequest::new(10)).unwrap();
        assert_eq!(due.items().len(), 2);
        assert_eq!(
            s2.list_runs(
                &StateQuery::new("acme").state(RunState::Running),
                &PageRequest::default()
            )
            .unwrap()
            .items()
            .len(),
            1
        );
        assert!(s2.verify().unwrap().is_ok());
        // A new run after an import takes a seq after every imported one.
        let fresh = s2
            .put_run(RunRecord::new(RunKey::new("acme", "r9"), "planner"))
            .unwrap();
        assert!(fresh.seq > s1.get_run(&RunKey::new("beta", "b2")).unwrap().unwrap().seq);
    }

    // A non-empty store is refused, with exit 2 and nothing written.
    let r = cli(&["import", "--db", p(&db2), "--in", p(&f1)]);
    assert_eq!(r.code, 2);
    assert!(r.stderr.contains("is not empty"), "{}", r.stderr);
    // Not an export, or a newer format: exit 2, nothing imported.
    let db4 = dir.path().join("db4");
    let r = cli_stdin(&["import", "--db", p(&db4)], b"{\"kind\":\"run\"}\n");
    assert_eq!(r.code, 2);
    assert!(
        r.stderr.contains("not an agentstate export"),
        "{}",
        r.stderr
    );
    let r = cli_stdin(&["import", "--db", p(&db4)], b"{\"agentstate_export\":3}\n");
    assert_eq!(r.code, 2);
    assert!(r.stderr.contains("format 3"), "{}", r.stderr);
    let r = cli_stdin(
        &["import", "--db", p(&db4)],
        b"{\"agentstate_export\":1}\n{\"kind\":\"nope\"}\n",
    );
    assert_eq!(r.code, 2);
    assert!(
        r.stderr.contains("line 2") && r.stderr.contains("nothing was imported"),
        "{}",
        r.stderr
    );
    assert!(entries(&db4).is_empty());
}

#[test]
fn cli_import_batches_a_larger_export() {
    // More entries than one import batch (1000), through stdin.
    let dir = tempfile::tempdir().unwrap();
    let mut text = String::from("{\"agentstate_export\":1}\n");
    let mut body = String::new();
    for i in 0..2_345u64 {
        let mut r = RunRecord::new(RunKey::new("bulk", format!("run-{i:05}")), "planner");
        (r.version, r.seq, r.created_at, r.updated_at) = (1, i + 1, T0, T0);
        body.push_str(&serde_json::to_string(&Entry::Run(r)).unwrap());
        body.push('\n');
    }
    text.push_str(&body);
    let db = dir.path().join("db");
    // Format 1 still imports, with a warning.
    let r = cli_stdin(&["import", "--db", p(&db)], text.as_bytes());
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.contains("imported 2,345 entries"), "{}", r.stdout);
    assert!(
        r.stderr.contains(
            "is export format 1, which has no trailer: a file cut short cannot be noticed"
        ),
        "{}",
        r.stderr
    );
    // And exports as format 2.
    let two = with_trailer(&format!("{{\"agentstate_export\":2}}\n{body}"));
    assert_eq!(ok(&["export", "--db", p(&db)]), two);
}

/// `text` (header and entry lines) with its format-2 trailer appended.
fn with_trailer(text: &str) -> String {
    use sha2::Digest;
    let n = text.lines().count() - 1;
    let sha: String = sha2::Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("{text}{{\"agentstate_export_end\":{{\"entries\":{n},\"sha256\":\"{sha}\"}}}}\n")
}

/// A bad entry is reported at its own line, even when the store reads it
/// in a group that ends many lines later (here at the trailer).
#[test]
fn cli_import_names_the_line_of_a_bad_entry() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("db");
    let mut text = String::from("{\"agentstate_export\":2}\n");
    for i in 0..200u64 {
        let mut r = RunRecord::new(RunKey::new("acme", format!("r{i}")), "planner");
        (r.version, r.seq) = (1, i + 1);
        if i == 1 {
            r.key.run_id = String::new();
        }
        text.push_str(&serde_json::to_string(&Entry::Run(r)).unwrap());
        text.push('\n');
    }
    let r = cli_stdin(&["import", "--db", p(&db)], with_trailer(&text).as_bytes());
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("line 3:"), "{}", r.stderr);
    assert!(r.stderr.contains("run_id"), "{}", r.stderr);
    assert!(!r.stderr.contains("line 202"), "{}", r.stderr);
    assert!(FileStore::open(&db).unwrap().is_empty().unwrap());
}

/// The length of the last line of `text`, newline included.
fn trailer_len(text: &str) -> usize {
    text.trim_end_matches('\n')
        .rsplit('\n')
        .next()
        .unwrap()
        .len()
        + 1
}

#[test]
fn cli_prune_never_touches_unfinished_runs() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("db");
    {
        // Old runs of every state, written at T0...
        let clock = Arc::new(ManualClock::new(T0));
        let s = FileStore::open_with(&db, clock_opts(&clock)).unwrap();
        for st in RunState::ALL {
            let mut r = RunRecord::new(
                RunKey::new("acme", format!("old-{}", st.as_str())),
                "planner",
            );
            r.state = st;
            s.put_run(r).unwrap();
        }
        let mut other = RunRecord::new(RunKey::new("beta", "old-completed"), "planner");
        other.state = RunState::Completed;
        s.put_run(other).unwrap();
    }
    {
        // ...and finished runs written just now.
        let s = FileStore::open(&db).unwrap();
        for st in [RunState::Completed, RunState::Failed] {
            let mut r = RunRecord::new(
                RunKey::new("acme", format!("new-{}", st.as_str())),
                "planner",
            );
            r.state = st;
            s.put_run(r).unwrap();
        }
    }
    let db_s = p(&db);
    let dry = ok(&[
        "prune",
        "--db",
        db_s,
        "--tenant",
        "acme",
        "--finished-before",
        "1h",
        "--dry-run",
    ]);
    assert!(
        dry.contains("would prune 3 finished run(s) of acme"),
        "{dry}"
    );
    let out = ok(&[
        "prune",
        "--db",
        db_s,
        "--tenant",
        "acme",
        "--finished-before",
        "1h",
    ]);
    assert!(out.contains("pruned 3 finished run(s) of acme"), "{out}");
    assert!(
        ok(&[
            "prune",
            "--db",
            db_s,
            "--tenant",
            "acme",
            "--finished-before",
            "1h"
        ])
        .contains("pruned 0")
    );

    let s = FileStore::open(&db).unwrap();
    for st in RunState::ALL {
        let there = s
            .get_run(&RunKey::new("acme", format!("old-{}", st.as_str())))
            .unwrap()
            .is_some();
        assert_eq!(there, !st.is_finished(), "old {} run", st.as_str());
    }
    for name in ["new-completed", "new-failed"] {
        assert!(
            s.get_run(&RunKey::new("acme", name)).unwrap().is_some(),
            "a recent finished run was pruned"
        );
    }
    assert!(
        s.get_run(&RunKey::new("beta", "old-completed"))
            .unwrap()
            .is_some(),
        "another tenant was pruned"
    );
    assert!(s.verify().unwrap().is_ok());
}

#[test]
fn prune_deletes_old_finished_runs_while_a_listing_walks() {
    const RUNS: usize = 900;
    let clock = Arc::new(ManualClock::new(T0));
    let s = MemoryStore::with_options(clock_opts(&clock));
    // Old runs cycle through every state; every tenth finished one is
    // touched (written again, still finished: R9) while the prune runs.
    let mut old = Vec::new();
    for i in 0..RUNS {
        let mut r = RunRecord::new(RunKey::new("acme", format!("old-{i:04}")), "planner");
        r.state = RunState::ALL[i % RunState::ALL.len()];
        old.push(s.put_run(r).unwrap());
    }
    clock.set(T0 + 2 * HOUR);
    for i in 0..50 {
        let mut r = RunRecord::new(RunKey::new("acme", format!("new-{i:03}")), "planner");
        r.state = RunState::Completed;
        s.put_run(r).unwrap();
    }
    let mut other = RunRecord::new(RunKey::new("beta", "old"), "planner");
    other.state = RunState::Completed;
    s.put_run(other).unwrap();
    let revive: Vec<RunRecord> = old
        .iter()
        .filter(|r| r.state.is_finished())
        .step_by(10)
        .cloned()
        .collect();

    let start = Barrier::new(3);
    let (pruned, walked, revived) = std::thread::scope(|scope| {
        let pruner = scope.spawn(|| {
            start.wait();
            s.prune("acme", T0 + HOUR).unwrap()
        });
        let walker = scope.spawn(|| {
            start.wait();
            s.iter_runs(&StateQuery::new("acme"))
                .page_size(7)
                .map(|r| r.unwrap().key.run_id)
                .collect::<Vec<_>>()
        });
        let reviver = scope.spawn(|| {
            start.wait();
            revive
                .iter()
                .map(|r| {
                    let mut r = r.clone();
                    r.agent_name = "touched".into();
                    (r.key.clone(), s.put_run(r))
                })
                .collect::<Vec<_>>()
        });
        (
            pruner.join().unwrap(),
            walker.join().unwrap(),
            reviver.join().unwrap(),
        )
    });

    // The walk saw every run that lived through it exactly once.
    let seen: HashSet<&str> = walked.iter().map(String::as_str).collect();
    assert_eq!(seen.len(), walked.len(), "the walk saw a run twice");
    for r in old.iter().filter(|r| !r.state.is_finished()) {
        assert!(
            seen.contains(r.key.run_id.as_str()),
            "the walk missed unfinished {}",
            r.key.run_id
        );
    }
    for i in 0..50 {
        assert!(seen.contains(format!("new-{i:03}").as_str()));
    }

    // A touched run either lost the race (pruned first: Conflict, actual 0)
    // or won it and was kept: updated now, so no longer old, and finished.
    let mut revived_ok = HashSet::new();
    for (k, res) in &revived {
        match res {
            Ok(r) => {
                let kept = s.get_run(k).unwrap().expect("a touched run is kept");
                assert_eq!(
                    (kept.state, kept.agent_name.as_str()),
                    (r.state, "touched"),
                    "{}",
                    r.key.run_id
                );
                revived_ok.insert(k.run_id.clone());
            }
            Err(StateError::Conflict {
                record,
                expected: 1,
                actual: 0,
            }) => {
                assert_eq!(*record, RecordKey::Run(k.clone()));
                assert!(s.get_run(k).unwrap().is_none())
            }
            Err(e) => panic!("touching {}: {e}", k.run_id),
        }
    }
    let finished_old = old.iter().filter(|r| r.state.is_finished()).count() as u64;
    assert_eq!(pruned, finished_old - revived_ok.len() as u64);
    for r in &old {
        let there = s.get_run(&r.key).unwrap().is_some();
        let want = !r.state.is_finished() || revived_ok.contains(&r.key.run_id);
        assert_eq!(there, want, "{} ({})", r.key.run_id, r.state.as_str());
    }
    let left = s
        .list_runs(&StateQuery::new("acme"), &PageRequest::new(1000))
        .unwrap();
    let by_state: BTreeMap<RunState, usize> =
        left.items().iter().fold(BTreeMap::new(), |mut m, r| {
            *m.entry(r.state).or_default() += 1;
            m
        });
    let touched_completed = revived
        .iter()
        .filter(|(_, res)| matches!(res, Ok(r) if r.state == RunState::Completed))
        .count();
    assert_eq!(
        by_state.get(&RunState::Completed),
        Some(&(50 + touched_completed)),
        "recent finished runs kept: {by_state:?}"
    );
    assert!(s.get_run(&RunKey::new("beta", "old")).unwrap().is_some());
    assert!(s.verify().unwrap().is_ok());
    // Nothing left to prune; bad input is Invalid.
    assert_eq!(s.prune("acme", T0 + HOUR).unwrap(), 0);
    assert!(matches!(s.prune("", T0), Err(StateError::Invalid { .. })));
}

#[test]
fn cli_a_store_held_by_another_process_exits_2() {
    let (_dir, db) = fixture_dir();
    let _held = FileStore::open(&db).unwrap();
    let r = cli(&["stats", "--db", p(&db)]);
    assert_eq!(r.code, 2);
    assert_eq!(
        r.stderr,
        format!(
            "error: store {} is already open in another process (close the other agentstate or worker using it)\n",
            db.display()
        )
    );
    assert_eq!(r.stdout, "");
}

#[test]
fn cli_bad_usage_exits_2() {
    let (_dir, db) = fixture_dir();
    let db = p(&db);
    let cases: &[&[&str]] = &[
        &[],
        &["frobnicate"],
        &["runs"],
        &["runs", "list", "--tenant", "acme"],
        &["runs", "list", "--db", db, "--state", "sleeping"],
        &["runs", "list", "--db", db, "--limit", "0"],
        &["runs", "list", "--db", db, "--limit", "1001"],
        &["runs", "list", "--db", db, "--all", "--cursor", "00"],
        &["runs", "list", "--db", db, "--cursor", "00"],
        &["runs", "list", "--db", db, "--updated-before", "yesterday"],
        &["runs", "show", "--db", db, "r1"],
        &["prune", "--db", db, "--tenant", "acme"],
        &[
            "prune",
            "--db",
            db,
            "--tenant",
            "acme",
            "--finished-before",
            "2026-02-30",
        ],
        &["alarms", "due", "--db", db, "--now", "soon"],
        &["trays", "list", "--db", db, "--ns", "chat"],
        &["runs", "list", "--db", "/nonexistent/agentstate-store"],
        &["export", "--db", db, "--out", "/nonexistent/dir/out.jsonl"],
        &["import", "--db", db, "--in", "/nonexistent/in.jsonl"],
    ];
    for args in cases {
        let r = cli(args);
        assert_eq!(r.code, 2, "{args:?} exited {}: {}", r.code, r.stderr);
        assert!(
            r.stderr.starts_with("error:") || r.stderr.contains("Usage:"),
            "{args:?}: {}",
            r.stderr
        );
    }
    let r = cli(&["runs", "list", "--tenant", "acme"]);
    assert_eq!(
        r.stderr,
        "error: no store given: pass --db PATH|URL or set AGENTSTATE_DB\n"
    );
    let r = cli(&["runs", "list", "--db", "/nonexistent/agentstate-store"]);
    assert!(
        r.stderr
            .contains("no store at /nonexistent/agentstate-store"),
        "{}",
        r.stderr
    );
    assert!(!Path::new("/nonexistent/agentstate-store").exists());
    // Help is not an error.
    assert!(ok(&["--help"]).contains("demo"));
    assert!(ok(&["runs", "list", "--help"]).contains("--updated-before"));
}

#[test]
fn cli_db_goes_before_or_after_the_subcommand_or_in_the_env() {
    let (_dir, db) = fixture_dir();
    let db = p(&db);
    let after = ok(&["runs", "list", "--tenant", "acme", "--db", db]);
    assert_eq!(rows(&after).len(), 5);
    assert_eq!(ok(&["--db", db, "runs", "list", "--tenant", "acme"]), after);
    assert_eq!(ok(&["runs", "--db", db, "list", "--tenant", "acme"]), after);
    let env = output(
        bin()
            .env("AGENTSTATE_DB", db)
            .args(["runs", "list", "--tenant", "acme"])
            .output()
            .unwrap(),
    );
    assert_eq!(
        (env.code, env.stdout.as_str()),
        (0, after.as_str()),
        "{}",
        env.stderr
    );
    // The flag wins over the env.
    let other = output(
        bin()
            .env("AGENTSTATE_DB", "/nonexistent/agentstate-store")
            .args(["stats", "--db", db])
            .output()
            .unwrap(),
    );
    assert_eq!(other.code, 0, "{}", other.stderr);
}

/// A format-2 export of `n` runs (made by the binary).
fn bulk_export(dir: &Path, n: u64) -> Vec<u8> {
    let src = dir.join("src");
    {
        let opts = clock_opts(&Arc::new(ManualClock::new(T0)))
            .durability(agentstate::Durability::Buffered);
        let s = FileStore::open_with(&src, opts).unwrap();
        let recs: Vec<RunRecord> = (0..n)
            .map(|i| RunRecord::new(RunKey::new("bulk", format!("run-{i:05}")), "planner"))
            .collect();
        for chunk in recs.chunks(500) {
            for r in chunk {
                s.put_run(r.clone()).unwrap();
            }
        }
    }
    let r = cli(&["export", "--db", p(&src)]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    r.stdout.into_bytes()
}

#[test]
fn cli_import_of_a_cut_file_is_refused_and_imports_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let full = bulk_export(dir.path(), 2_500);
    let text = String::from_utf8(full.clone()).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    // Cut at a line boundary: the last 100 lines dropped.
    let cut = lines[..lines.len() - 100].join("\n") + "\n";
    let db = dir.path().join("db");
    // From a file, so the importer may stop reading early.
    let input = dir.path().join("in.jsonl");
    let import = |text: &[u8], extra: &[&str]| {
        std::fs::write(&input, text).unwrap();
        let mut args = vec!["import", "--db", p(&db), "--in", p(&input)];
        args.extend_from_slice(extra);
        cli(&args)
    };
    let r = import(cut.as_bytes(), &[]);
    assert_eq!(r.code, 2, "{}", r.stdout);
    assert!(
        r.stderr
            .contains("ends without its trailer line after 2,401 entries")
            && r.stderr.contains("cut short")
            && r.stderr.contains("nothing was imported"),
        "{}",
        r.stderr
    );
    assert!(
        !db.exists(),
        "a failed import left a store at {}",
        db.display()
    );
    // Allowed: imports what is there, with a warning.
    let r = cli_stdin(
        &["import", "--db", p(&db), "--allow-untrailed"],
        cut.as_bytes(),
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.contains("imported 2,401 entries"), "{}", r.stdout);
    assert!(r.stderr.contains("no trailer"), "{}", r.stderr);
    std::fs::remove_dir_all(&db).unwrap();

    // An altered entry line, a wrong count, data after the trailer, a
    // damaged trailer: each refused, nothing imported.
    let trailer = *lines.last().unwrap();
    let body = &lines[..lines.len() - 1];
    let altered = {
        let mut b = body.to_vec();
        let changed = b[1700].replace("\"version\":1", "\"version\":2");
        b[1700] = &changed;
        b.join("\n") + "\n" + trailer + "\n"
    };
    let miscounted =
        body.join("\n") + "\n" + &trailer.replace("\"entries\":2500", "\"entries\":2499") + "\n";
    let extra = text.clone() + lines[5] + "\n";
    let damaged = body.join("\n") + "\n" + &trailer[..trailer.len() - 3] + "\n";
    for (what, input, says) in [
        ("altered", altered, "does not match the file"),
        (
            "miscounted",
            miscounted,
            "counts 2,499 entries but the file holds 2,500",
        ),
        ("extra", extra, "data after the trailer"),
        ("damaged", damaged, "a damaged trailer"),
    ] {
        let r = import(input.as_bytes(), &[]);
        assert_eq!(r.code, 2, "{what}: {}", r.stdout);
        assert!(
            r.stderr.contains(says) && r.stderr.contains("nothing was imported"),
            "{what}: {}",
            r.stderr
        );
        assert!(!db.exists(), "{what}: a failed import left a store");
    }
    // Into an existing empty store: it stays exactly as it was.
    drop(FileStore::open(&db).unwrap());
    let before = (entries(&db), std::fs::read_dir(&db).unwrap().count());
    let mut bad = body.to_vec();
    bad[1500] = "{\"kind\":\"run\"}";
    let r = import((bad.join("\n") + "\n").as_bytes(), &[]);
    assert_eq!(r.code, 2);
    assert!(
        r.stderr.contains("line 1501") && r.stderr.contains("nothing was imported"),
        "{}",
        r.stderr
    );
    assert_eq!(
        (entries(&db), std::fs::read_dir(&db).unwrap().count()),
        before
    );
    assert!(FileStore::open(&db).unwrap().verify().unwrap().is_ok());
    // The whole file imports.
    let r = import(&full, &[]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(ok(&["export", "--db", p(&db)]).as_bytes(), full.as_slice());
}

#[test]
fn cli_import_killed_at_any_moment_leaves_nothing_or_everything() {
    let dir = tempfile::tempdir().unwrap();
    let n = 3_000;
    let full = bulk_export(dir.path(), n);
    let file = dir.path().join("all.jsonl");
    std::fs::write(&file, &full).unwrap();
    let rounds: u64 = std::env::var("AGENTSTATE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
        * 4;
    // How long a whole import takes, to spread the kills over it.
    let t = std::time::Instant::now();
    let r = cli(&[
        "import",
        "--db",
        p(&dir.path().join("whole")),
        "--in",
        p(&file),
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let whole = t.elapsed();
    let (mut none, mut all) = (0, 0);
    for i in 0..rounds {
        let db = dir.path().join(format!("db{i}"));
        let mut child = bin()
            .args(["import", "--db", p(&db), "--in", p(&file)])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(whole.mul_f64((i as f64 + 0.5) / rounds as f64));
        let _ = child.kill();
        let _ = child.wait();
        if !db.exists() {
            none += 1;
            continue;
        }
        let s = FileStore::open(&db).unwrap();
        let got = s.iter_export().count() as u64;
        assert!(
            got == 0 || got == n,
            "a killed import left {got} of {n} entries"
        );
        if got == n {
            all += 1;
        } else {
            none += 1;
        }
        assert!(s.verify().unwrap().is_ok());
    }
    eprintln!(
        "import ({whole:?} whole) killed {rounds} times: {none} left nothing, {all} everything"
    );
}

/// `agentstate copy` from a file store to Redis and back: every record
/// arrives (the copy's own checksum comparison), the other subcommands work
/// on `--db redis://…`, and the round trip exports the same entries.
#[cfg(feature = "redis")]
#[test]
fn cli_copy_file_to_redis_and_back() {
    let (dir, db) = fixture_dir();
    let url = crate::redis_server::shared_url(7);
    crate::redis_server::flush(&url);
    let out = ok(&["copy", "--from", p(&db), "--to", &url]);
    assert!(out.contains("verified"), "{out}");
    let stats = ok(&["--db", &url, "stats"]);
    assert!(
        stats.contains("appendfsync always"),
        "stats shows the mode: {stats}"
    );
    let verify = ok(&["--db", &url, "verify"]);
    assert!(!verify.is_empty());
    let back = dir.path().join("back");
    let out = ok(&["copy", "--from", &url, "--to", p(&back)]);
    assert!(out.contains("verified"), "{out}");
    let mut a = entries(&db);
    let mut b = entries(&back);
    let key = |e: &Entry| serde_json::to_string(e).unwrap();
    a.sort_by_key(key);
    b.sort_by_key(key);
    assert_eq!(a, b, "file → redis → file keeps every entry");
    let again = cli(&["copy", "--from", p(&db), "--to", &url]);
    assert_ne!(
        again.code, 0,
        "copy into a non-empty redis store is refused"
    );
}

/// A store with one budget, two runs drawing from it (one capped and at
/// its cap), live holds, and an untouched tenant.
fn budget_store() -> (tempfile::TempDir, std::path::PathBuf) {
    use agentstate::{BudgetKey, BudgetRecord, BudgetStore, Caps, Hold};
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("db");
    let s = FileStore::open(&db).unwrap();
    s.put_budget(BudgetRecord::new(
        BudgetKey::new("acme", "monthly"),
        Caps::new().cost_micros(5_000_000).tokens(100_000),
    ))
    .unwrap();
    let a = RunKey::new("acme", "capped");
    let b = RunKey::new("acme", "open");
    s.put_run(
        RunRecord::new(a.clone(), "planner")
            .with_caps(Caps::new().cost_micros(1_000_000))
            .with_budget("monthly"),
    )
    .unwrap();
    s.put_run(RunRecord::new(b.clone(), "planner").with_budget("monthly"))
        .unwrap();
    s.put_run(RunRecord::new(RunKey::new("acme", "plain"), "planner"))
        .unwrap();
    s.reserve(&a, Hold::new("call-1", 3_600_000).cost_micros(700_000))
        .unwrap();
    s.settle(
        &a,
        "call-1",
        StateDelta {
            cost_micros: 750_000,
            ..Default::default()
        },
    )
    .unwrap();
    s.reserve(&a, Hold::new("call-2", 3_600_000).cost_micros(250_000))
        .unwrap();
    s.reserve(
        &b,
        Hold::new("call-1", 3_600_000)
            .cost_micros(100_000)
            .tokens(2_000),
    )
    .unwrap();
    // A refusal: the cap is reached (750k spent + 250k held).
    assert!(
        s.reserve(&a, Hold::new("call-3", 3_600_000).cost_micros(1))
            .is_err()
    );
    (dir, db)
}

#[test]
fn cli_budgets_list_show_and_stats_count_runs_at_their_cap() {
    let (_dir, db) = budget_store();
    let db = p(&db);
    let text = ok(&["budgets", "list", "--db", db, "--tenant", "acme"]);
    let r = rows(&text);
    assert_eq!(r.len(), 1, "{text}");
    for needle in ["monthly", "0.75 + 0.35 / 5", "0 + 2,000 / 100,000", "2"] {
        assert!(r[0].contains(needle), "lacks {needle:?}:\n{text}");
    }
    // Each line is the library's BudgetStatus.
    let v: Vec<BudgetStatus> = json_lines(&ok(&[
        "budgets", "list", "--db", db, "--tenant", "acme", "--json",
    ]));
    assert_eq!(v[0].spent.cost_micros, 750_000);
    assert_eq!(v[0].held.cost_micros, 350_000);
    assert_eq!(v[0].record.caps.tokens_max, Some(100_000));
    assert_eq!(v[0].holds, 2);
    assert_eq!(
        ok(&["budgets", "list", "--db", db, "--tenant", "nobody"]).trim(),
        "no budgets"
    );

    let text = ok(&["budgets", "show", "--db", db, "--tenant", "acme", "monthly"]);
    for needle in [
        "acme/monthly",
        "cost_micros 0.75 + 0.35 / 5",
        "live holds  2",
        "capped",
        "0.75 + 0.25 / 1",
        "open",
    ] {
        assert!(text.contains(needle), "lacks {needle:?}:\n{text}");
    }
    assert!(!text.contains("plain"), "a run without the budget: {text}");
    let v: Vec<serde_json::Value> = json_lines(&ok(&[
        "budgets", "show", "--db", db, "--tenant", "acme", "monthly", "--json",
    ]));
    assert_eq!(v[0]["budget"]["record"]["key"]["name"], "monthly");
    let runs: Vec<RunSpend> = serde_json::from_value(v[0]["runs"].clone()).unwrap();
    assert_eq!(runs.len(), 2);
    assert!(runs.iter().all(|r| r.budget.as_deref() == Some("monthly")));

    let text = ok(&[
        "budgets", "show", "--db", db, "--tenant", "acme", "--run", "capped",
    ]);
    for needle in [
        "acme/capped",
        "budget      monthly",
        "0.75 + 0.25 / 1",
        "call-2",
        "live holds  1",
    ] {
        assert!(text.contains(needle), "lacks {needle:?}:\n{text}");
    }
    let v: Vec<RunSpend> = json_lines(&ok(&[
        "budgets", "show", "--db", db, "--tenant", "acme", "--run", "capped", "--json",
    ]));
    assert_eq!(v[0].caps.cost_micros_max, Some(1_000_000));
    assert_eq!(v[0].holds[0].id, "call-2");

    let r = cli(&["budgets", "show", "--db", db, "--tenant", "acme", "nope"]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.starts_with("error: no budget acme/nope"),
        "{}",
        r.stderr
    );
    let r = cli(&[
        "budgets", "show", "--db", db, "--tenant", "acme", "--run", "nope",
    ]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.starts_with("error: no run acme/nope"),
        "{}",
        r.stderr
    );
    let r = cli(&["budgets", "show", "--db", db, "--tenant", "acme"]);
    assert_eq!(r.code, 2, "neither a budget nor --run: {}", r.stderr);

    let text = ok(&["runs", "show", "--db", db, "--tenant", "acme", "capped"]);
    assert!(text.contains("budget         monthly"), "{text}");
    assert!(
        text.contains("caps           cost 1, tokens -, iterations -"),
        "{text}"
    );

    // stats: one run is at its cap (its own), counted from the committed
    // state; the refused reserve wrote nothing.
    let text = ok(&["stats", "--db", db]);
    assert!(text.contains("at cap    1 run(s)"), "{text}");
    let v: Vec<serde_json::Value> = json_lines(&ok(&["stats", "--db", db, "--json"]));
    let t = &v[0]["tenants"]["acme"];
    assert_eq!(
        (
            t["budgets"].as_u64(),
            t["holds"].as_u64(),
            t["runs_at_cap"].as_u64()
        ),
        (Some(1), Some(2), Some(1))
    );
    let r = cli(&["verify", "--db", db]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    // The export carries the budget and the holds, and imports back.
    let exported = ok(&["export", "--db", db]);
    assert!(exported.contains(r#""kind":"budget""#) && exported.contains(r#""kind":"hold""#));
    let dir2 = tempfile::tempdir().unwrap();
    let db2 = dir2.path().join("copy");
    let r = cli_stdin(&["import", "--db", p(&db2)], exported.as_bytes());
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(ok(&["export", "--db", p(&db2)]), exported);
}

/// `agentstate copy` file → redis → file keeps budgets (with their spend)
/// and holds.
#[cfg(feature = "redis")]
#[test]
fn cli_copy_budgets_and_holds_file_to_redis_and_back() {
    let (dir, db) = budget_store();
    let url = crate::redis_server::shared_url(9);
    crate::redis_server::flush(&url);
    let out = ok(&["copy", "--from", p(&db), "--to", &url]);
    assert!(out.contains("verified"), "{out}");
    let back = dir.path().join("back");
    let out = ok(&["copy", "--from", &url, "--to", p(&back)]);
    assert!(out.contains("verified"), "{out}");
    let (a, b) = (entries(&db), entries(&back));
    assert!(a.iter().any(|e| matches!(e, Entry::Budget { .. })));
    assert_eq!(
        a.iter().filter(|e| matches!(e, Entry::Hold { .. })).count(),
        2
    );
    assert_eq!(a, b, "file → redis → file keeps every entry, in order");
}

#[test]
fn cli_upgrades_a_format_1_store_once_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("old");
    std::fs::create_dir_all(&db).unwrap();
    let golden = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/v1");
    let status = std::process::Command::new("cp")
        .args(["-a", &format!("{}/.", golden.display()), p(&db)])
        .status()
        .unwrap();
    assert!(status.success());
    let r = cli(&["verify", "--db", p(&db)]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("upgrading") && r.stderr.contains("(7 runs; once, crash-safe)"),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr.contains("upgraded") && r.stderr.contains(": 7 runs in "),
        "{}",
        r.stderr
    );
    // Once: the next command opens it as it is.
    let r = cli(&["verify", "--db", p(&db)]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(!r.stderr.contains("upgrad"), "{}", r.stderr);
}

/// A managed Redis without `CONFIG GET` (an ACL user without `+config`):
/// refused (exit 2, naming `--redis-assume`'s library twin) until the
/// command line states what the service guarantees; the password is in no
/// output.
#[test]
fn cli_redis_without_config_needs_redis_assume() {
    use crate::redis_server::{Server, temp_dir};
    let server = Server::start(
        &temp_dir("cli-acl"),
        &[
            "--user",
            "app",
            "on",
            ">cli-pw-7731",
            "~*",
            "&*",
            "+@all",
            "-config",
        ],
    );
    let url = format!("redis://app:cli-pw-7731@127.0.0.1:{}/0", server.port);
    let r = cli(&["stats", "--db", &url]);
    assert_eq!(r.code, 2, "{}{}", r.stdout, r.stderr);
    assert!(r.stderr.contains("durability_assumed"), "{}", r.stderr);
    assert!(r.stderr.contains("--redis-assume"), "{}", r.stderr);
    let r = cli(&[
        "stats",
        "--db",
        &url,
        "--redis-assume",
        "noeviction,appendfsync-always",
    ]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("stated by the caller"), "{}", r.stdout);
    for out in [&r.stdout, &r.stderr] {
        assert!(!out.contains("cli-pw-7731"), "a password was shown: {out}");
    }
}

/// `--redis-wait-replicas N`: a server with fewer replicas connected is
/// refused (exit 2) naming `connected_slaves`; with a replica, writes wait
/// for it and succeed.
#[test]
fn cli_redis_wait_replicas_needs_the_replicas() {
    use crate::redis_server::{Server, temp_dir};
    let dir = temp_dir("cli-wait");
    let master = Server::start(&dir.join("m"), &[]);
    let url = master.url(0);
    let r = cli(&["stats", "--db", &url, "--redis-wait-replicas", "1"]);
    assert_eq!(r.code, 2, "{}{}", r.stdout, r.stderr);
    assert!(r.stderr.contains("connected_slaves:0"), "{}", r.stderr);
    let _replica = Server::start_replica(&dir.join("r"), master.port);
    let r = cli(&["stats", "--db", &url, "--redis-wait-replicas", "1"]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
}

/// `watch`: a tenant's feed from the start (each record once, in position
/// order), from the head (nothing), the sweeper on the trays feed (marked
/// trays named, due alarms named and acked), and its usage errors.
#[test]
fn cli_watch_follows_feeds_and_sweeps() {
    let (_dir, db) = fixture_dir();
    let db = p(&db);
    // JSON: the library's Change shape, one per record of the tenant.
    let out = ok(&[
        "--db", db, "watch", "--tenant", "acme", "--from", "start", "--json", "--idle", "0.2",
    ]);
    let changes: Vec<agentstate::Change> = json_lines(&out);
    let mut got: Vec<String> = changes
        .iter()
        .map(|c| match &c.item {
            agentstate::Changed::Run { run } => run.key.run_id.clone(),
            agentstate::Changed::Session { session } => session.key.session_id.clone(),
            other => panic!("acme's feed holds {other:?}"),
        })
        .collect();
    assert!(
        changes.windows(2).all(|w| w[0].position < w[1].position),
        "positions increase"
    );
    got.sort();
    assert_eq!(got, ["r1", "r2", "r3", "r4", "r5", "s1", "s2"]);
    // Text, stopped by --count.
    let out = ok(&[
        "--db", db, "watch", "--tenant", "acme", "--from", "start", "--count", "2",
    ]);
    let lines = out.lines().collect::<Vec<_>>();
    assert_eq!(lines.len(), 2, "{out}");
    assert!(
        lines.iter().any(|l| l.contains("session acme/s1 v1")),
        "{out}"
    );
    // Resuming after the second change reads the other five.
    let second = lines[1].split_whitespace().next().unwrap();
    let out = ok(&[
        "--db", db, "watch", "--tenant", "acme", "--from", second, "--idle", "0.2",
    ]);
    assert_eq!(out.lines().collect::<Vec<_>>().len(), 5, "{out}");
    assert!(out.contains("run acme/r1 v2 running"), "{out}");
    // From the head: nothing has committed since.
    let out = ok(&["--db", db, "watch", "--tenant", "acme", "--idle", "0.2"]);
    assert_eq!(out, "");

    // The sweeper: both marked trays named; both alarms (due in 2023)
    // named at once and, with --ack, acknowledged.
    let out = ok(&[
        "--db", db, "watch", "--trays", "--from", "start", "--sweep", "--ack", "--json", "--idle",
        "0.3",
    ]);
    let actions: Vec<serde_json::Value> = json_lines(&out);
    let wakes: Vec<String> = actions
        .iter()
        .filter(|a| a["action"] == "wake")
        .map(|a| {
            format!(
                "{}/{}",
                a["key"]["id"].as_str().unwrap(),
                a["env"].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(wakes, ["room-1/prod", "room-2/staging"], "{out}");
    let dues: Vec<(String, bool)> = actions
        .iter()
        .filter(|a| a["action"] == "due")
        .map(|a| {
            (
                a["instance"]["id"].as_str().unwrap().to_string(),
                a["acked"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        dues,
        [("room-1".to_string(), true), ("room-2".to_string(), true)],
        "{out}"
    );
    let out = ok(&["--db", db, "alarms", "due", "--now", "2100-01-01T00:00:00Z"]);
    assert!(!out.contains("room-"), "acked alarms are gone: {out}");
    // One env's trays; the tray feed's tombstones of the acked alarms.
    let out = ok(&[
        "--db", db, "watch", "--trays", "--env", "staging", "--from", "start", "--idle", "0.2",
    ]);
    assert_eq!(out.lines().collect::<Vec<_>>().len(), 1, "{out}");
    assert!(
        out.contains("tray chat/room-2/state/main marked env=staging"),
        "{out}"
    );
    let out = ok(&[
        "--db", db, "watch", "--trays", "--from", "start", "--idle", "0.2",
    ]);
    assert!(out.contains("alarm chat/room-1 deleted"), "{out}");

    // Usage: a sweep of a tenant's feed, a bad position, no scope.
    for args in [
        vec!["watch", "--tenant", "acme", "--sweep"],
        vec!["watch", "--tenant", "acme", "--from", "yesterday"],
        vec!["watch"],
        vec!["watch", "--tenant", "acme", "--idle", "-1"],
    ] {
        let mut full = vec!["--db", db];
        full.extend(args.iter());
        let r = cli(&full);
        assert_eq!(r.code, 2, "{args:?}: {}", r.stderr);
    }
}
