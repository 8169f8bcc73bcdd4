//! E — errors: what each error carries, which are retryable, and that a
//! refused call changes nothing (E1–E6).

use super::Factory;
use super::helpers::*;
use agentstate_core::limits::BATCH_OPS_MAX;
use agentstate_core::{
    Alarm, Cursor, InstanceKey, MarkedTray, PageRequest, PersistenceReason, RecordKey, RunKey,
    RunRecord, RunState, SessionKey, SessionRecord, StateDelta, StateError, StateQuery, Tray,
    TrayKey, TrayOp,
};

/// E1: `Conflict { record, expected, actual }` says the version of
/// `record` moved; it is not retryable as is (the same call fails the same
/// way) — re-read, decide again, and the write goes through. Its message
/// names the record.
pub fn e1_conflict_not_retryable(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("e1");
    let key = RunKey::new(&t, "run");
    let v1 = create(s, RunRecord::new(key.clone(), "planner"));
    let v2 = update(s, &key, |r| r.state = RunState::Running);
    let mut stale = v1.clone();
    stale.state = RunState::Paused;
    for attempt in 0..3 {
        let e = expect_err!(
            s.put_run(stale.clone()),
            StateError::Conflict {
                ref record,
                expected: 1,
                actual: 2,
            } if *record == RecordKey::Run(key.clone()),
            "E1: stale put, attempt {attempt}"
        );
        assert!(!e.is_retryable(), "E1: Conflict is not retryable");
        assert!(
            e.to_string().contains(&format!("run {key}")),
            "E1: a Conflict's message names the run: {e}"
        );
        assert_eq!(
            get(s, &key).as_ref(),
            Some(&v2),
            "E1/E6: a conflicting put changed the run"
        );
    }
    // Re-read, decide again.
    let mut fresh = must_get(s, &key);
    fresh.state = RunState::Paused;
    let v3 = ok(s.put_run(fresh), "E1: put after re-reading");
    assert_eq!(
        (v3.version, v3.state),
        (3, RunState::Paused),
        "E1: a re-read write goes through"
    );

    // Sessions alike.
    let sk = SessionKey::new(&t, "sess");
    let s1 = create_session(s, &sk);
    ok(s.put_session(s1.clone()), "E1: session update");
    let e = expect_err!(
        s.put_session(s1.clone()),
        StateError::Conflict {
            ref record,
            expected: 1,
            actual: 2,
        } if *record == RecordKey::Session(sk.clone()),
        "E1: stale session put"
    );
    assert!(!e.is_retryable(), "E1: Conflict is not retryable");
    assert!(
        e.to_string().contains(&format!("session {sk}")),
        "E1: a Conflict's message names the session: {e}"
    );
    let fresh = get_session(s, &sk).expect("session");
    assert_eq!(
        ok(s.put_session(fresh), "E1: session put after re-reading").version,
        3,
        "E1: a re-read session write goes through"
    );
}

/// E2: `NotFound` names what is missing; a patch never invents a run.
pub fn e2_not_found_names_what_is_missing(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("e2");
    let missing = RunKey::new(&t, "no-such-run");
    let e = expect_err!(
        s.patch_run(&missing, StateDelta { cost_micros: 5, ..Default::default() }),
        StateError::NotFound(RecordKey::Run(ref k)) if *k == missing,
        "E2: patching a missing run"
    );
    assert!(!e.is_retryable(), "E2: NotFound is not retryable");
    assert!(
        e.to_string().contains("no-such-run"),
        "E2: the message names the run: {e}"
    );
    assert_eq!(get(s, &missing), None, "E2: a patch never invents a run");
    assert!(
        walk_runs(s, &StateQuery::new(&t)).is_empty(),
        "E2: a patch never invents a run"
    );

    let sk = SessionKey::new(&t, "no-such-session");
    let run = RunKey::new(&t, "run");
    let e = expect_err!(
        s.put_run(RunRecord::new(run.clone(), "planner").with_session("no-such-session")),
        StateError::NotFound(RecordKey::Session(ref k)) if *k == sk,
        "E2: a run in a missing session"
    );
    assert!(
        e.to_string().contains("no-such-session"),
        "E2: the message names the session: {e}"
    );
    assert_eq!(get(s, &run), None, "E2/E6: the refused run exists");
    let e = expect_err!(
        s.delete_session(&sk, true),
        StateError::NotFound(RecordKey::Session(ref k)) if *k == sk,
        "E2: deleting a missing session"
    );
    assert!(
        e.to_string().contains("no-such-session"),
        "E2: the message names the session: {e}"
    );
    assert_eq!(get_session(s, &sk), None, "E2: a delete never creates");
}

/// E3: only `Persistence { reason: Unavailable }` is retryable, and
/// `is_retryable` says so for every variant.
pub fn e3_only_unavailable_is_retryable(make: Factory<'_>) {
    let cases: Vec<(StateError, bool)> = vec![
        (
            StateError::Persistence {
                reason: PersistenceReason::Unavailable,
                detail: "disk full".into(),
                source: None,
            },
            true,
        ),
        (
            StateError::Persistence {
                reason: PersistenceReason::Unavailable,
                detail: "sync failed".into(),
                source: Some(std::io::Error::other("EIO")),
            },
            true,
        ),
        (
            StateError::Persistence {
                reason: PersistenceReason::TooLarge,
                detail: "2 MiB".into(),
                source: None,
            },
            false,
        ),
        (
            StateError::Conflict {
                record: RecordKey::Run(RunKey::new("t", "r")),
                expected: 1,
                actual: 2,
            },
            false,
        ),
        (
            StateError::NotFound(RecordKey::Run(RunKey::new("t", "r"))),
            false,
        ),
        (
            StateError::NotFound(RecordKey::Session(SessionKey::new("t", "s"))),
            false,
        ),
        (
            StateError::NotFound(RecordKey::Tray(InstanceKey::new("n", "i").tray("tn", "ti"))),
            false,
        ),
        (
            StateError::InUse {
                record: RecordKey::Session(SessionKey::new("t", "s")),
                runs: vec![RunKey::new("t", "r")],
            },
            false,
        ),
        (
            StateError::FenceLost {
                instance: InstanceKey::new("n", "i"),
                caller: 1,
                stored: 2,
            },
            false,
        ),
        (
            StateError::Invalid {
                what: "limit: 0".into(),
            },
            false,
        ),
        (
            StateError::Corrupt {
                what: "checksum".into(),
            },
            false,
        ),
        (
            StateError::UnsupportedFormat {
                found: 9,
                supported: 1,
            },
            false,
        ),
        (
            StateError::Locked {
                path: "/tmp/store".into(),
                this_process: false,
            },
            false,
        ),
        (
            StateError::Persistence {
                reason: PersistenceReason::ReadOnly,
                detail: "read-only file system".into(),
                source: None,
            },
            false,
        ),
        (
            StateError::Persistence {
                reason: PersistenceReason::InvalidPath,
                detail: "file name too long".into(),
                source: None,
            },
            false,
        ),
    ];
    for (e, want) in &cases {
        assert_eq!(e.is_retryable(), *want, "E3: is_retryable of {e:?}");
        assert!(!e.to_string().is_empty(), "E3: {e:?} displays");
    }
    // A real TooLarge from the store is not retryable either.
    let c = open(make);
    let mut rec = RunRecord::new(RunKey::new(unique("e3"), "run"), "planner");
    rec.pending_tool_calls = vec![tool_call(
        "big",
        &format!(r#"{{"blob":"{}"}}"#, "x".repeat(1_200_000)),
    )];
    let e = expect_err!(
        c.store.put_run(rec),
        StateError::Persistence {
            reason: PersistenceReason::TooLarge,
            ..
        },
        "E3: a 1.2 MiB run"
    );
    assert!(!e.is_retryable(), "E3: TooLarge is not retryable");
}

/// E4: `InUse { record, runs }` names the session whose delete was
/// refused, and every run that blocks it and only those.
pub fn e4_in_use_names_every_blocking_run(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("e4");
    let sk = SessionKey::new(&t, "sess");
    create_session(s, &sk);
    create_session(s, &SessionKey::new(&t, "other"));
    let recs: Vec<RunRecord> = (0..42)
        .map(|i| {
            run_in(
                RunKey::new(&t, format!("r{i}")),
                "planner",
                RunState::ALL[i % 7],
            )
            .with_session("sess")
        })
        .chain((0..5).map(|i| {
            run_in(
                RunKey::new(&t, format!("o{i}")),
                "planner",
                RunState::Running,
            )
            .with_session("other")
        }))
        .chain((0..5).map(|i| {
            run_in(
                RunKey::new(&t, format!("n{i}")),
                "planner",
                RunState::Running,
            )
        }))
        .collect();
    let runs = create_many(s, recs);
    let blocking: Vec<RunKey> = runs
        .iter()
        .filter(|r| r.session_id.as_deref() == Some("sess") && !r.state.is_finished())
        .map(|r| r.key.clone())
        .collect();
    assert_eq!(blocking.len(), 24, "E4: fixture");
    let e = expect_err!(
        s.delete_session(&sk, false),
        StateError::InUse { ref record, .. } if *record == RecordKey::Session(sk.clone()),
        "E4: deleting a session with 24 unfinished runs"
    );
    assert!(!e.is_retryable(), "E4: InUse is not retryable");
    assert!(
        e.to_string()
            .contains(&format!("session {sk} has 24 unfinished run(s)")),
        "E4: the message names the session and counts its runs: {e}"
    );
    let StateError::InUse { runs: named, .. } = e else {
        unreachable!()
    };
    let named_sorted = sorted(&named);
    assert_eq!(
        named_sorted.len(),
        named.len(),
        "E4: InUse names each run once"
    );
    assert_eq!(
        named_sorted,
        sorted(&blocking),
        "E4: InUse names every unfinished run of the session, and only those"
    );
    for r in &runs {
        assert_eq!(
            get(s, &r.key).as_ref(),
            Some(r),
            "E4/E6: the refused delete touched {:?}",
            r.key
        );
    }
    assert!(
        get_session(s, &sk).is_some(),
        "E4/E6: the refused delete deleted the session"
    );
}

/// E5: `FenceLost { instance, caller, stored }` names the instance and
/// carries both epochs, for every tray operation below the stored epoch.
pub fn e5_fence_lost_carries_both_epochs(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let ns = unique("e5");
    let i = InstanceKey::new(&ns, "i");
    let k = i.tray("t", "1");
    ok(
        s.write_tray(&k, 7, tray(true, "doc", "env")),
        "E5: write at epoch 7",
    );
    ok(s.set_alarm(&i, 7, 100), "E5: set_alarm at epoch 7");
    let before = tray_state(s, &i);
    macro_rules! fenced {
        ($what:literal, $call:expr) => {{
            let e = expect_err!(
                $call,
                StateError::FenceLost {
                    ref instance,
                    caller: 3,
                    stored: 7,
                } if *instance == i,
                "E5: {} at epoch 3",
                $what
            );
            assert!(!e.is_retryable(), "E5: FenceLost is not retryable");
            assert_eq!(
                tray_state(s, &i),
                before,
                "E5/E6: a fenced {} changed the instance",
                $what
            );
        }};
    }
    fenced!("read_tray", s.read_tray(&k, 3));
    fenced!(
        "write_tray",
        s.write_tray(&k, 3, tray(false, "stale", "env"))
    );
    fenced!("delete_tray", s.delete_tray(&k, 3));
    fenced!(
        "apply_batch",
        s.apply_batch(
            &i,
            3,
            vec![TrayOp::Delete {
                tray_ns: "t".into(),
                tray_id: "1".into()
            }]
        )
    );
    fenced!("list_trays", s.list_trays(&i, 3, &PageRequest::new(10)));
    fenced!("set_alarm", s.set_alarm(&i, 3, 5));
    fenced!("ack_alarm", s.ack_alarm(&i, 3, 100));
    assert_eq!(
        due_of(s, 100, &ns, 10).len(),
        1,
        "E5/E6: fenced alarm calls changed the alarm"
    );
    // release is the exception: an older release is a no-op (T4).
    ok(
        s.release(&i, 3),
        "E5: an older release is not an error (T4)",
    );
    assert_eq!(
        tray_state(s, &i),
        before,
        "E5: an older release changed the instance"
    );
    let e = expect_err!(
        s.write_tray(&k, 0, tray(false, "x", "env")),
        StateError::FenceLost {
            ref instance,
            caller: 0,
            stored: 7,
        } if *instance == i,
        "E5: epoch 0"
    );
    assert!(
        e.to_string().contains('7') && e.to_string().contains('0'),
        "E5: the message carries both epochs: {e}"
    );
    assert!(
        e.to_string().contains(&format!("instance {i}")),
        "E5: the message names the instance: {e}"
    );
}

/// Everything E6 compares before and after a refused call.
#[derive(Debug, PartialEq)]
struct Snapshot {
    runs: Vec<RunRecord>,
    session_runs: Vec<RunRecord>,
    sessions: Vec<Option<SessionRecord>>,
    epoch: u64,
    trays: Vec<(TrayKey, Tray)>,
    marked: Vec<MarkedTray>,
    alarms: Vec<Alarm>,
}

/// E6: nothing is ever partially applied — after any error the store reads
/// exactly as before the call; `Invalid { what }` says which input and why.
pub fn e6_errors_change_nothing_and_invalid_says_what(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("e6");
    let ns = unique("e6ns");
    let env = unique("e6env");
    let sk = SessionKey::new(&t, "s");
    let missing_sk = SessionKey::new(&t, "missing");
    create_session(s, &sk);
    let r1 = create(
        s,
        run_in(RunKey::new(&t, "r1"), "planner", RunState::Running).with_session("s"),
    );
    let mut r2 = RunRecord::new(RunKey::new(&t, "r2"), "planner");
    r2.pending_tool_calls = vec![tool_call("c", r#"{"city":"Paris"}"#)];
    let r2v1 = create(s, r2);
    ok(
        s.patch_run(
            &r2v1.key,
            StateDelta {
                cost_micros: u64::MAX - 1,
                iterations: 3,
                ..Default::default()
            },
        ),
        "E6: patch",
    );
    let r2 = must_get(s, &r2v1.key);
    let i = InstanceKey::new(&ns, "i");
    let (ka, kb) = (i.tray("t", "a"), i.tray("t", "b"));
    ok(s.write_tray(&ka, 5, tray(true, "a", &env)), "E6: tray a");
    ok(s.write_tray(&kb, 5, tray(false, "b", &env)), "E6: tray b");
    ok(s.set_alarm(&i, 5, 100), "E6: alarm");

    let snap = || Snapshot {
        runs: walk_runs_by(s, &StateQuery::new(&t), 1),
        session_runs: walk_runs(s, &StateQuery::new(&t).session("s")),
        sessions: vec![get_session(s, &sk), get_session(s, &missing_sk)],
        epoch: epoch_of(s, &i),
        trays: tray_state(s, &i).1,
        marked: marked_of(s, Some(&env), &ns, 1000),
        alarms: due_of(s, u64::MAX, &ns, 1000),
    };
    let before = snap();
    assert_eq!(before.runs.len(), 2, "E6: fixture");
    assert_eq!(before.marked.len(), 1, "E6: fixture");
    let big = "x".repeat(1_200_000);
    let big_tray = tray(false, vec![7u8; 1_100_000], &env);
    let put = |ns: &str, id: &str, t: Tray| TrayOp::Put {
        tray_ns: ns.into(),
        tray_id: id.into(),
        tray: t,
    };
    let del = |ns: &str, id: &str| TrayOp::Delete {
        tray_ns: ns.into(),
        tray_id: id.into(),
    };
    let with = |f: &dyn Fn(&mut RunRecord)| {
        let mut r = r2.clone();
        f(&mut r);
        r
    };

    // Each refused call: its error, then the whole fixture reads as before.
    let check = |what: &str, e: &StateError, names: &[&str]| {
        if !names.is_empty() {
            assert_names(e, names, format_args!("E6: {what}"));
        }
        assert_eq!(
            snap(),
            before,
            "E6: {what} failed with {e:?} but changed the store"
        );
    };
    macro_rules! refused {
        ($what:literal, $call:expr, $pat:pat, $names:expr) => {{
            let e = expect_err!($call, $pat, "E6: {}", $what);
            check($what, &e, &$names);
        }};
    }
    use StateError::{Conflict, FenceLost, InUse, Invalid, NotFound, Persistence};
    refused!(
        "creating an existing run",
        s.put_run(RunRecord::new(r1.key.clone(), "x")),
        Conflict { .. },
        []
    );
    refused!("a stale put", s.put_run(r2v1.clone()), Conflict { .. }, []);
    refused!(
        "a run in a missing session",
        s.put_run(RunRecord::new(RunKey::new(&t, "r3"), "planner").with_session("missing")),
        NotFound(_),
        []
    );
    refused!(
        "patching a missing run",
        s.patch_run(&RunKey::new(&t, "r3"), StateDelta::default()),
        NotFound(_),
        []
    );
    refused!(
        "an overflowing patch",
        s.patch_run(
            &r2.key,
            StateDelta {
                cost_micros: 2,
                iterations: 1,
                ..Default::default()
            }
        ),
        Invalid { .. },
        ["cost"]
    );
    refused!(
        "a put moving cost_micros",
        s.put_run(with(&|r| r.cost_micros = 0)),
        Invalid { .. },
        ["cost_micros"]
    );
    refused!(
        "a put changing session_id",
        s.put_run({
            let mut r = r1.clone();
            r.session_id = None;
            r
        }),
        Invalid { .. },
        ["session"]
    );
    refused!(
        "a put with 1,025 pending tool calls",
        s.put_run(with(&|r| r.pending_tool_calls =
            (0..1025).map(|n| tool_call(&n.to_string(), "{}")).collect())),
        Invalid { .. },
        ["pending_tool_calls", "tool calls"]
    );
    refused!(
        "a put past 1 MiB",
        s.put_run(with(
            &|r| r.pending_tool_calls = vec![tool_call("big", &big)]
        )),
        Persistence {
            reason: PersistenceReason::TooLarge,
            ..
        },
        []
    );
    refused!(
        "a run with an empty tenant",
        s.put_run(RunRecord::new(RunKey::new("", "r"), "planner")),
        Invalid { .. },
        ["tenant"]
    );
    refused!(
        "creating an existing session",
        s.put_session(SessionRecord::new(sk.clone())),
        Conflict { .. },
        []
    );
    refused!(
        "a stale session put",
        s.put_session({
            let mut x = SessionRecord::new(sk.clone());
            x.version = 7;
            x
        }),
        Conflict { .. },
        []
    );
    refused!(
        "deleting a session in use",
        s.delete_session(&sk, false),
        InUse { .. },
        []
    );
    refused!(
        "deleting a missing session",
        s.delete_session(&missing_sk, true),
        NotFound(_),
        []
    );
    refused!(
        "a fenced write",
        s.write_tray(&ka, 4, tray(false, "x", &env)),
        FenceLost { .. },
        []
    );
    refused!(
        "a tray past 1 MiB at a newer epoch",
        s.write_tray(&ka, 9, big_tray.clone()),
        Persistence {
            reason: PersistenceReason::TooLarge,
            ..
        },
        []
    );
    refused!(
        "a tray with an empty tray_id at a newer epoch",
        s.write_tray(&i.tray("t", ""), 9, tray(false, "x", &env)),
        Invalid { .. },
        ["tray_id"]
    );
    refused!(
        "a batch with a tray past 1 MiB last",
        s.apply_batch(
            &i,
            9,
            vec![
                put("t", "c", tray(true, "c", &env)),
                del("t", "a"),
                put("t", "d", big_tray.clone())
            ]
        ),
        Persistence {
            reason: PersistenceReason::TooLarge,
            ..
        },
        []
    );
    refused!(
        "a batch with an empty tray_id last",
        s.apply_batch(
            &i,
            9,
            vec![
                put("t", "c", tray(true, "c", &env)),
                del("t", "a"),
                put("t", "", tray(false, "x", &env))
            ]
        ),
        Invalid { .. },
        ["tray_id"]
    );
    refused!(
        "a batch of 10,001 ops",
        s.apply_batch(
            &i,
            9,
            (0..=BATCH_OPS_MAX)
                .map(|n| del("t", &n.to_string()))
                .collect()
        ),
        Invalid { .. },
        ["batch", "ops"]
    );
    refused!(
        "a fenced batch",
        s.apply_batch(&i, 4, vec![del("t", "a")]),
        FenceLost { .. },
        []
    );
    refused!(
        "a fenced delete",
        s.delete_tray(&ka, 4),
        FenceLost { .. },
        []
    );
    refused!("a fenced read", s.read_tray(&ka, 4), FenceLost { .. }, []);
    refused!(
        "a fenced listing",
        s.list_trays(&i, 4, &PageRequest::new(10)),
        FenceLost { .. },
        []
    );
    refused!(
        "a fenced set_alarm",
        s.set_alarm(&i, 4, 50),
        FenceLost { .. },
        []
    );
    refused!(
        "a fenced ack_alarm",
        s.ack_alarm(&i, 4, 100),
        FenceLost { .. },
        []
    );
    refused!(
        "list_trays with limit 0 at a newer epoch",
        s.list_trays(&i, 9, &PageRequest::new(0)),
        Invalid { .. },
        ["limit"]
    );
    refused!(
        "list_runs with limit 0",
        s.list_runs(&StateQuery::new(&t), &PageRequest::new(0)),
        Invalid { .. },
        ["limit"]
    );
    refused!(
        "list_runs with a garbage cursor",
        s.list_runs(
            &StateQuery::new(&t),
            &PageRequest::default().with_cursor(Some(Cursor::from_text("garbage"))),
        ),
        Invalid { .. },
        ["cursor"]
    );
    refused!(
        "marked_trays with limit 1001",
        s.marked_trays(Some(&env), &PageRequest::new(1001)),
        Invalid { .. },
        ["limit"]
    );
    refused!(
        "due_alarms with limit 0",
        s.due_alarms(100, &PageRequest::new(0)),
        Invalid { .. },
        ["limit"]
    );
    refused!(
        "set_alarm with an empty ns",
        s.set_alarm(&InstanceKey::new("", "i"), 9, 1),
        Invalid { .. },
        ["ns"]
    );
}
