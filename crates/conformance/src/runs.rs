//! R — runs: keys, versions and conflicts, racing writers, commuting
//! patches, what a record holds, sessions at create, finished runs, deletes
//! (R1–R10).

use super::Factory;
use super::helpers::*;
use agentstate_core::{
    Approval, RecordKey, RunKey, RunRecord, RunState, SessionKey, StateDelta, StateError,
    StateQuery, ToolCall, Usage,
};

/// R1: every read and write names its `RunKey`, and touches only that run.
pub fn r1_run_key_names_every_read_and_write(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let (ta, tb) = (unique("r1a"), unique("r1b"));
    let runs = [
        (RunKey::new(&ta, "x"), "agent-ax"),
        (RunKey::new(&tb, "x"), "agent-bx"),
        (RunKey::new(&ta, "y"), "agent-ay"),
    ];
    for (k, agent) in &runs {
        let r = create(s, RunRecord::new(k.clone(), *agent));
        assert_eq!(
            &r.key, k,
            "R1: put_run returns the run of the key it was handed"
        );
    }
    for (k, agent) in &runs {
        let r = must_get(s, k);
        assert_eq!(
            (&r.key, r.agent_name.as_str()),
            (k, *agent),
            "R1: get_run {k:?} reads its own run"
        );
    }
    let [(ax, _), (bx, _), (ay, _)] = &runs;

    // A patch names one run: the same run id in another tenant, and another
    // run of the same tenant, do not move.
    let p = ok(
        s.patch_run(
            bx,
            StateDelta {
                iterations: 3,
                ..Default::default()
            },
        ),
        "R1: patch_run",
    );
    assert_eq!(&p.key, bx, "R1: patch_run returns the run it patched");
    for k in [ax, ay] {
        let r = must_get(s, k);
        assert_eq!(
            (r.iterations, r.version),
            (0, 1),
            "R1: patching {bx:?} moved {k:?}"
        );
    }

    // An update names one run.
    let u = update(s, ax, |r| r.state = RunState::Running);
    assert_eq!(&u.key, ax, "R1: put_run returns the run it updated");
    for k in [bx, ay] {
        assert_eq!(
            must_get(s, k).state,
            RunState::Pending,
            "R1: updating {ax:?} moved {k:?}"
        );
    }

    // Keys never written read nothing, in a known tenant and an unknown one.
    assert_eq!(
        get(s, &RunKey::new(&ta, "z")),
        None,
        "R1: a run never written reads None"
    );
    assert_eq!(
        get(s, &RunKey::new(unique("r1c"), "x")),
        None,
        "R1: a tenant never written reads None"
    );

    // A listing names its tenant.
    let a = keys(&walk_runs(s, &StateQuery::new(&ta)));
    assert_eq!(
        sorted(&a),
        sorted(&[ax.clone(), ay.clone()]),
        "R1: list_runs of tenant {ta:?}"
    );
    let b = keys(&walk_runs(s, &StateQuery::new(&tb)));
    assert_eq!(b, vec![bx.clone()], "R1: list_runs of tenant {tb:?}");
}

/// R2: version 0 creates; version n commits at n + 1 iff n is stored;
/// `Conflict { expected, actual }` otherwise (`actual: 0` when gone); the
/// stored record is returned, with the store's own seq and times.
pub fn r2_put_run_versions_and_conflicts(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("r2");
    let key = RunKey::new(&t, "run");

    // Create: the caller's seq and times are ignored.
    c.clock.set(T0 + 10);
    let mut rec = RunRecord::new(key.clone(), "planner");
    (rec.seq, rec.created_at, rec.updated_at) = (u64::MAX, 5, 6);
    let v1 = create(s, rec);
    assert_eq!(v1.version, 1, "R2: a create commits version 1");
    assert_eq!(
        (v1.created_at, v1.updated_at),
        (T0 + 10, T0 + 10),
        "R2/R7: create times come from the store's clock"
    );
    assert_ne!(
        v1.seq,
        u64::MAX,
        "R2/R7: seq is the store's counter, not the caller's"
    );
    assert_eq!(
        get(s, &key).as_ref(),
        Some(&v1),
        "R2: put_run returns the stored record"
    );

    // A second create conflicts.
    let e = expect_err!(
        s.put_run(RunRecord::new(key.clone(), "other")),
        StateError::Conflict {
            expected: 0,
            actual: 1,
            ..
        },
        "R2: creating an existing run"
    );
    assert!(!e.is_retryable(), "E1: Conflict is not retryable");
    assert_eq!(
        get(s, &key).as_ref(),
        Some(&v1),
        "E6: a refused create changed the run"
    );

    // Update from the stored version.
    c.clock.set(T0 + 20);
    let mut u = v1.clone();
    u.state = RunState::Running;
    (u.seq, u.created_at, u.updated_at) = (u64::MAX - 1, 1, 2);
    let v2 = ok(s.put_run(u), "R2: updating from the stored version");
    assert_eq!(v2.version, 2, "R2: an update from n commits n + 1");
    assert_eq!(v2.state, RunState::Running, "R2: the update was stored");
    assert_eq!(v2.seq, v1.seq, "R2/R7: seq is assigned at create and kept");
    assert_eq!(
        (v2.created_at, v2.updated_at),
        (T0 + 10, T0 + 20),
        "R2/R7: created_at kept, updated_at from the clock"
    );
    assert_eq!(
        get(s, &key).as_ref(),
        Some(&v2),
        "R2: put_run returns the stored record"
    );

    // A stale version, a version from the future, a run that never was.
    let mut stale = v1.clone();
    stale.state = RunState::Paused;
    expect_err!(
        s.put_run(stale),
        StateError::Conflict {
            expected: 1,
            actual: 2,
            ..
        },
        "R2: updating from a stale version"
    );
    let mut ahead = v2.clone();
    ahead.version = 5;
    expect_err!(
        s.put_run(ahead),
        StateError::Conflict {
            expected: 5,
            actual: 2,
            ..
        },
        "R2: updating from a version never stored"
    );
    assert_eq!(
        get(s, &key).as_ref(),
        Some(&v2),
        "E6: refused updates changed the run"
    );
    let missing = RunKey::new(&t, "missing");
    let mut ghost = RunRecord::new(missing.clone(), "planner");
    ghost.version = 3;
    expect_err!(
        s.put_run(ghost),
        StateError::Conflict {
            expected: 3,
            actual: 0,
            ..
        },
        "R2: updating a run that never existed"
    );
    assert_eq!(get(s, &missing), None, "R2: an update never creates");

    // A run that is gone (its session was deleted with it): actual 0.
    let sk = SessionKey::new(&t, "s");
    create_session(s, &sk);
    let doomed = create(
        s,
        RunRecord::new(RunKey::new(&t, "doomed"), "planner").with_session("s"),
    );
    ok(s.delete_session(&sk, true), "R2: cascade delete");
    let mut gone = doomed.clone();
    gone.state = RunState::Running;
    expect_err!(
        s.put_run(gone),
        StateError::Conflict {
            expected: 1,
            actual: 0,
            ..
        },
        "R2: updating a run that is gone"
    );
    assert_eq!(
        get(s, &doomed.key),
        None,
        "R2: an update of a deleted run re-created it"
    );

    // A later create gets a later seq.
    let later = create(s, RunRecord::new(RunKey::new(&t, "later"), "planner"));
    assert!(
        later.seq > v1.seq,
        "R2/R7: seq counts creates: {} then {}",
        v1.seq,
        later.seq
    );
}

/// R3: racing creators — exactly one wins; racing updaters from the same
/// version — exactly one wins. Real threads, thousands of rounds.
pub fn r3_racing_writers_exactly_one_wins(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("r3");
    let lanes = 4;
    let per_lane = rounds(500);
    race_versions(
        "R3",
        lanes,
        per_lane,
        |lane, round| RunKey::new(&t, format!("{lane}-{round}")),
        |k| {
            s.put_run(RunRecord::new(k.clone(), "racer"))
                .map(|r| r.version)
        },
        |k| get(s, k),
        |current, label| {
            let mut r = current.expect("both creates returned before the update race");
            r.agent_name = label.to_string();
            s.put_run(r).map(|r| r.version)
        },
        |k| {
            let r = must_get(s, k);
            (r.version, r.agent_name)
        },
    );
}

/// R4: a patch adds amounts, bumps the version by one and returns the new
/// record; a missing run is `NotFound` and never created; an overflowing
/// addition is `Invalid` and writes nothing.
pub fn r4_patch_adds_amounts_and_never_creates(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("r4");
    let key = RunKey::new(&t, "run");
    let mut rec = run_in(key.clone(), "planner", RunState::Running);
    rec.pending_tool_calls = vec![tool_call("call-1", r#"{"city":"Paris"}"#)];
    rec.approval = Some(Approval {
        id: "ap-1".into(),
        prompt: "go?".into(),
    });
    let before = create(s, rec);

    c.clock.set(T0 + 100);
    let d = StateDelta {
        usage: Usage {
            input_tokens: 10,
            output_tokens: 20,
        },
        cost_micros: 1_500,
        iterations: 1,
        messages_read: 4,
    };
    let p = ok(s.patch_run(&key, d), "R4: patch_run");
    let mut want = before.clone();
    want.usage = Usage {
        input_tokens: 10,
        output_tokens: 20,
    };
    (want.cost_micros, want.iterations, want.messages_read) = (1_500, 1, 4);
    want.version = 2;
    want.updated_at = T0 + 100;
    assert_eq!(
        p, want,
        "R4: a patch adds the amounts, bumps the version, sets updated_at and moves nothing else"
    );
    assert_eq!(
        get(s, &key).as_ref(),
        Some(&p),
        "R4: patch_run returns the stored record"
    );

    let p = ok(s.patch_run(&key, d), "R4: second patch");
    assert_eq!(
        (
            p.usage,
            p.cost_micros,
            p.iterations,
            p.messages_read,
            p.version
        ),
        (
            Usage {
                input_tokens: 20,
                output_tokens: 40
            },
            3_000,
            2,
            8,
            3
        ),
        "R4: patches add up"
    );
    let p = ok(s.patch_run(&key, StateDelta::default()), "R4: empty patch");
    assert_eq!(
        p.version, 4,
        "R4: every patch bumps the version, even an empty one"
    );

    // A missing run is NotFound, and stays missing.
    let missing = RunKey::new(&t, "missing");
    expect_err!(
        s.patch_run(&missing, d),
        StateError::NotFound(RecordKey::Run(ref k)) if *k == missing,
        "R4: patching a missing run"
    );
    assert_eq!(get(s, &missing), None, "R4: a patch never creates a run");
    assert_eq!(
        keys(&walk_runs(s, &StateQuery::new(&t))),
        vec![key.clone()],
        "R4: a patch never creates a run"
    );

    // Overflow, field by field: Invalid, and nothing written (not even the
    // other, harmless amounts of the same delta).
    type Field = (
        &'static str,
        &'static [&'static str],
        fn(&mut StateDelta, u64),
    );
    let fields: [Field; 5] = [
        ("usage.input_tokens", &["input tokens", "usage"], |d, n| {
            d.usage.input_tokens = n
        }),
        (
            "usage.output_tokens",
            &["output tokens", "usage"],
            |d, n| d.usage.output_tokens = n,
        ),
        ("cost_micros", &["cost micros", "cost"], |d, n| {
            d.cost_micros = n
        }),
        ("iterations", &["iterations"], |d, n| d.iterations = n),
        ("messages_read", &["messages read"], |d, n| {
            d.messages_read = n
        }),
    ];
    for (i, (name, names, set)) in fields.iter().enumerate() {
        let k = RunKey::new(&t, format!("overflow-{i}"));
        create(s, RunRecord::new(k.clone(), "planner"));
        let mut full = StateDelta::default();
        set(&mut full, u64::MAX);
        ok(
            s.patch_run(&k, full),
            format_args!("R4: patching {name} to u64::MAX"),
        );
        let stored = must_get(s, &k);
        let mut over = StateDelta {
            usage: Usage {
                input_tokens: 5,
                output_tokens: 5,
            },
            cost_micros: 5,
            iterations: 5,
            messages_read: 5,
        };
        set(&mut over, 1);
        let e = expect_err!(
            s.patch_run(&k, over),
            StateError::Invalid { .. },
            "R4: {name} overflowing u64"
        );
        assert_names(&e, names, format_args!("R4: {name} overflowing u64"));
        assert_eq!(
            get(s, &k).as_ref(),
            Some(&stored),
            "R4/E6: an overflowing patch wrote something ({name})"
        );
    }
}

/// R5: patches commute — 4 threads × 250 patches give exactly the sums,
/// and the final version counts every committed write (patches plus the
/// puts of a fifth thread that updates the same run meanwhile).
pub fn r5_patches_commute(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let key = RunKey::new(unique("r5"), "run");
    create(s, run_in(key.clone(), "planner", RunState::Running));
    let threads = 4u64;
    let per = rounds(250) as u64;
    let puts = rounds(25);
    let delta = |t: u64, i: u64| StateDelta {
        usage: Usage {
            input_tokens: t + 1,
            output_tokens: i + 1,
        },
        cost_micros: t * 1_000 + i,
        iterations: 1,
        messages_read: t + 1,
    };
    std::thread::scope(|sc| {
        for t in 0..threads {
            let key = &key;
            sc.spawn(move || {
                let mut last = 0;
                for i in 0..per {
                    let r = ok(
                        s.patch_run(key, delta(t, i)),
                        format_args!("R5: patch {i} of thread {t}"),
                    );
                    assert!(
                        r.version > last,
                        "R5: versions seen by one patcher must grow: {last} then {}",
                        r.version
                    );
                    last = r.version;
                }
            });
        }
        let key = &key;
        sc.spawn(move || {
            for i in 0..puts {
                update(s, key, |r| {
                    r.approval = Some(Approval {
                        id: format!("ap-{i}"),
                        prompt: "ok?".into(),
                    })
                });
            }
        });
    });
    let mut want = Usage::default();
    let (mut cost, mut msgs) = (0u64, 0u64);
    for t in 0..threads {
        for i in 0..per {
            let d = delta(t, i);
            want.input_tokens += d.usage.input_tokens;
            want.output_tokens += d.usage.output_tokens;
            cost += d.cost_micros;
            msgs += d.messages_read;
        }
    }
    let r = must_get(s, &key);
    assert_eq!(
        (r.usage, r.cost_micros, r.iterations, r.messages_read),
        (want, cost, threads * per, msgs),
        "R5: concurrent patches must sum exactly"
    );
    assert_eq!(
        r.version,
        1 + threads * per + puts as u64,
        "R5: the version counts the create, every patch and every committed put"
    );
    assert_eq!(
        r.approval.map(|a| a.id),
        Some(format!("ap-{}", puts - 1)),
        "R5: the last put's change survives the patches"
    );
}

/// R6: `put_run` never moves `usage`, `cost_micros`, `iterations` or
/// `messages_read` of an existing run: `Invalid` naming the field.
pub fn r6_put_never_moves_amounts(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let key = RunKey::new(unique("r6"), "run");
    create(s, RunRecord::new(key.clone(), "planner"));
    let d = StateDelta {
        usage: Usage {
            input_tokens: 5,
            output_tokens: 6,
        },
        cost_micros: 7,
        iterations: 8,
        messages_read: 9,
    };
    ok(s.patch_run(&key, d), "R6: patch");
    let cur = must_get(s, &key);
    type Move = (&'static str, fn(&mut RunRecord));
    let moves: [Move; 9] = [
        ("usage", |r| r.usage.input_tokens += 1),
        ("usage", |r| r.usage.output_tokens += 1),
        ("usage", |r| r.usage = Usage::default()),
        ("cost_micros", |r| r.cost_micros += 1_000),
        ("cost_micros", |r| r.cost_micros = 0),
        ("iterations", |r| r.iterations += 1),
        ("iterations", |r| r.iterations -= 1),
        ("messages_read", |r| r.messages_read += 1),
        ("messages_read", |r| r.messages_read = 0),
    ];
    for (field, mv) in moves {
        let mut r = cur.clone();
        r.state = RunState::Running; // a legitimate change alongside
        mv(&mut r);
        let e = expect_err!(
            s.put_run(r),
            StateError::Invalid { .. },
            "R6: put_run moving {field}"
        );
        assert_names(&e, &[field], format_args!("R6: put_run moving {field}"));
        assert_eq!(
            get(s, &key).as_ref(),
            Some(&cur),
            "R6/E6: a refused put moved the run ({field})"
        );
    }
    // The same amounts with other changes are fine.
    let r = update(s, &key, |r| r.state = RunState::Running);
    assert_eq!(
        (r.usage, r.cost_micros, r.iterations, r.messages_read),
        (
            cur.usage,
            cur.cost_micros,
            cur.iterations,
            cur.messages_read
        ),
        "R6: an update that keeps the amounts keeps them"
    );
}

/// R7: a run holds state, agent, session, message cursor, pending tool
/// calls (`mid_tool_call`), usage, cost, iterations, approval,
/// `created_at`/`updated_at` from the store's clock, and its `seq`.
pub fn r7_record_holds_what_resumes_a_run(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("r7");
    let sk = SessionKey::new(&t, "sess");
    create_session(s, &sk);
    let key = RunKey::new(&t, "run");
    let mut rec =
        run_in(key.clone(), "researcher", RunState::AwaitingApproval).with_session("sess");
    rec.pending_tool_calls = vec![
        tool_call("call-1", r#"{"city":"Paris","days":3}"#),
        ToolCall {
            id: "call-2".into(),
            name: "fetch".into(),
            arguments: r#"{"url":"https://example.com/a"}"#.into(),
        },
    ];
    rec.approval = Some(Approval {
        id: "ap-1".into(),
        prompt: "Book the flight?".into(),
    });
    assert!(
        rec.mid_tool_call(),
        "R7: mid_tool_call is true while a call is pending"
    );
    c.clock.set(T0 + 1_000);
    let v1 = create(s, rec.clone());
    let mut want = rec.scrubbed();
    (want.version, want.created_at, want.updated_at, want.seq) =
        (1, T0 + 1_000, T0 + 1_000, v1.seq);
    assert_eq!(
        v1, want,
        "R7: the stored run holds every field it was created with"
    );
    assert_eq!(
        get(s, &key).as_ref(),
        Some(&v1),
        "R7: get_run reads what was stored"
    );
    assert!(
        v1.mid_tool_call(),
        "R7: a stored run with pending calls is mid tool call"
    );

    // Amounts through a patch, then an update that answers the calls.
    c.clock.set(T0 + 2_000);
    ok(
        s.patch_run(
            &key,
            StateDelta {
                usage: Usage {
                    input_tokens: 3,
                    output_tokens: 4,
                },
                cost_micros: 99,
                iterations: 2,
                messages_read: 6,
            },
        ),
        "R7: patch",
    );
    c.clock.set(T0 + 3_000);
    let v3 = update(s, &key, |r| {
        r.state = RunState::Running;
        r.pending_tool_calls.clear();
        r.approval = None;
    });
    assert!(
        !v3.mid_tool_call(),
        "R7: no pending call, not mid tool call"
    );
    assert_eq!(
        (v3.usage, v3.cost_micros, v3.iterations, v3.messages_read),
        (
            Usage {
                input_tokens: 3,
                output_tokens: 4
            },
            99,
            2,
            6
        ),
        "R7: amounts are held"
    );
    assert_eq!(
        (v3.created_at, v3.updated_at, v3.seq, v3.version),
        (T0 + 1_000, T0 + 3_000, v1.seq, 3),
        "R7: times and seq"
    );
    assert_eq!(
        v3.session_id.as_deref(),
        Some("sess"),
        "R7: the session is held"
    );
    assert_eq!(
        get(s, &key).as_ref(),
        Some(&v3),
        "R7: get_run reads what was stored"
    );

    // The session id is fixed at create.
    for other in [Some("other".to_string()), None] {
        let mut r = v3.clone();
        r.session_id = other.clone();
        let e = expect_err!(
            s.put_run(r),
            StateError::Invalid { .. },
            "R7: changing session_id to {other:?}"
        );
        assert_names(&e, &["session"], "R7: changing session_id");
        assert_eq!(
            get(s, &key).as_ref(),
            Some(&v3),
            "R7/E6: a refused session change moved the run"
        );
    }
}

/// R8: a run that names a session needs that session to exist at create.
pub fn r8_run_session_must_exist(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let (t, other) = (unique("r8"), unique("r8other"));
    let key = RunKey::new(&t, "run");
    expect_err!(
        s.put_run(RunRecord::new(key.clone(), "planner").with_session("sess")),
        StateError::NotFound(RecordKey::Session(ref k)) if *k == SessionKey::new(&t, "sess"),
        "R8: creating a run in a missing session"
    );
    assert_eq!(get(s, &key), None, "R8/E6: the refused run was created");

    // A session of the same id in another tenant does not count.
    create_session(s, &SessionKey::new(&other, "sess"));
    expect_err!(
        s.put_run(RunRecord::new(key.clone(), "planner").with_session("sess")),
        StateError::NotFound(RecordKey::Session(ref k)) if *k == SessionKey::new(&t, "sess"),
        "R8: creating a run in a session of another tenant"
    );
    assert_eq!(get(s, &key), None, "R8/E6: the refused run was created");

    let sk = SessionKey::new(&t, "sess");
    create_session(s, &sk);
    let r = create(
        s,
        RunRecord::new(key.clone(), "planner").with_session("sess"),
    );
    assert_eq!(
        r.session_id.as_deref(),
        Some("sess"),
        "R8: a run in an existing session is created"
    );

    // Once the session is deleted, new runs cannot name it.
    update(s, &key, |r| r.state = RunState::Completed);
    ok(
        s.delete_session(&sk, false),
        "R8: deleting a session whose runs are finished",
    );
    let late = RunKey::new(&t, "late");
    expect_err!(
        s.put_run(RunRecord::new(late.clone(), "planner").with_session("sess")),
        StateError::NotFound(RecordKey::Session(_)),
        "R8: creating a run in a deleted session"
    );
    assert_eq!(get(s, &late), None, "R8/E6: the refused run was created");
}

/// R9: a finished run (completed, failed, cancelled) stays finished: a
/// `put_run` moving it to any other state is `Invalid` naming the state and
/// writes nothing; a put that keeps the state, and patches, still work.
pub fn r9_finished_run_stays_finished(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("r9");
    for (n, &done) in RunState::ALL
        .iter()
        .filter(|st| st.is_finished())
        .enumerate()
    {
        let key = RunKey::new(&t, format!("run-{n}"));
        create(s, RunRecord::new(key.clone(), "planner"));
        update(s, &key, |r| r.state = RunState::Running);
        let finished = update(s, &key, |r| r.state = done);
        assert_eq!(finished.state, done, "R9: a run moves into {done:?}");
        for &to in RunState::ALL.iter().filter(|&&st| st != done) {
            let mut revived = finished.clone();
            revived.state = to;
            let e = expect_err!(
                s.put_run(revived),
                StateError::Invalid { .. },
                "R9: put_run moving a {done:?} run to {to:?}"
            );
            for name in ["state", done.as_str()] {
                assert_names(
                    &e,
                    &[name],
                    format_args!("R9: moving a {done:?} run to {to:?}"),
                );
            }
            assert_eq!(
                get(s, &key).as_ref(),
                Some(&finished),
                "R9/E6: the refused put of a {done:?} run to {to:?} wrote something"
            );
        }
        // The same state, other fields: still a put.
        let renamed = update(s, &key, |r| r.agent_name = "reporter".into());
        assert_eq!(
            (renamed.state, renamed.version),
            (done, finished.version + 1),
            "R9: a put that keeps a {done:?} run {done:?} is written"
        );
        // Spend that happened is recorded.
        let patched = ok(
            s.patch_run(
                &key,
                StateDelta {
                    cost_micros: 5,
                    iterations: 1,
                    ..StateDelta::default()
                },
            ),
            format_args!("R9: patching a {done:?} run"),
        );
        assert_eq!(
            (
                patched.state,
                patched.cost_micros,
                patched.iterations,
                patched.version
            ),
            (
                done,
                renamed.cost_micros + 5,
                renamed.iterations + 1,
                renamed.version + 1
            ),
            "R9: a patch adds to a {done:?} run and leaves it {done:?}"
        );
    }
}

/// R10: `delete_run` deletes at the stated version, or, with none stated,
/// only a finished run; the record, every listing of it and its live holds
/// go (what it spent stays spent on its budget), and the id is free again.
pub fn r10_delete_run_versioned_and_whole(make: Factory<'_>) {
    use agentstate_core::{BudgetKey, BudgetRecord, Caps, Hold, PageRequest};
    let c = open(make);
    let s = &*c.store;
    let t = unique("r10");

    // An unfinished run: only its version deletes it.
    let key = RunKey::new(&t, "live");
    create(s, RunRecord::new(key.clone(), "planner"));
    let live = update(s, &key, |r| r.state = RunState::Running);
    let e = expect_err!(
        s.delete_run(&key, None),
        StateError::InUse { ref record, ref runs } if runs == &vec![key.clone()] && *record == RecordKey::Run(key.clone()),
        "R10: deleting an unfinished run without its version"
    );
    assert!(!e.is_retryable(), "R10: InUse is not retryable");
    expect_err!(
        s.delete_run(&key, Some(live.version - 1)),
        StateError::Conflict { ref record, expected, actual } if expected == live.version - 1 && actual == live.version && *record == RecordKey::Run(key.clone()),
        "R10: deleting at a stale version"
    );
    assert_eq!(
        get(s, &key).as_ref(),
        Some(&live),
        "R10/E6: a refused delete changed the run"
    );
    let gone = ok(
        s.delete_run(&key, Some(live.version)),
        "R10: delete at the stored version",
    );
    assert_eq!(gone, live, "R10: delete_run returns the record as it was");
    assert!(get(s, &key).is_none(), "R10: a deleted run reads as None");
    expect_err!(
        s.delete_run(&key, Some(live.version)),
        StateError::NotFound(RecordKey::Run(ref k)) if *k == key,
        "R10: deleting a missing run"
    );
    expect_err!(
        s.patch_run(&key, StateDelta::default()),
        StateError::NotFound(RecordKey::Run(_)),
        "R10: patching a deleted run"
    );

    // A finished run without a version; in a session, so its session
    // listing drops it and the session deletes without a cascade.
    let sk = SessionKey::new(&t, "s1");
    ok(
        s.put_session(agentstate_core::SessionRecord::new(sk.clone())),
        "R10: create a session",
    );
    let done_key = RunKey::new(&t, "done");
    create(
        s,
        RunRecord::new(done_key.clone(), "planner").with_session("s1"),
    );
    update(s, &done_key, |r| r.state = RunState::Running);
    update(s, &done_key, |r| r.state = RunState::Completed);
    ok(
        s.delete_run(&done_key, None),
        "R10: deleting a finished run",
    );

    // Other runs stay, and every listing forgets the deleted ones.
    let kept = create(s, RunRecord::new(RunKey::new(&t, "kept"), "planner"));
    for q in [
        StateQuery::new(&t),
        StateQuery::new(&t).state(RunState::Running),
        StateQuery::new(&t).state(RunState::Completed),
        StateQuery::new(&t).session("s1"),
        StateQuery::new(&t)
            .state(RunState::Running)
            .updated_before(u64::MAX / 2),
    ] {
        let ids: Vec<String> = walk_runs(s, &q).into_iter().map(|r| r.key.run_id).collect();
        assert!(
            !ids.iter().any(|i| i == "live" || i == "done"),
            "R10: a listing ({q:?}) still shows a deleted run: {ids:?}"
        );
    }
    assert_eq!(
        keys(&walk_runs(s, &StateQuery::new(&t))),
        vec![kept.key.clone()],
        "R10: the other runs stay"
    );
    ok(
        s.delete_session(&sk, false),
        "R10: a session whose runs were deleted deletes without a cascade",
    );

    // Its holds go with it; what it spent stays spent on its budget.
    let bk = BudgetKey::new(&t, "b");
    ok(
        s.put_budget(BudgetRecord::new(
            bk.clone(),
            Caps::new().cost_micros(1_000),
        )),
        "R10: create a budget",
    );
    let spender = RunKey::new(&t, "spender");
    let r = create(
        s,
        RunRecord::new(spender.clone(), "planner").with_budget("b"),
    );
    ok(
        s.patch_run(
            &spender,
            StateDelta {
                cost_micros: 100,
                ..Default::default()
            },
        ),
        "R10: spend",
    );
    ok(
        s.reserve(&spender, Hold::new("h1", 60_000).cost_micros(300)),
        "R10: hold",
    );
    let before = ok(s.get_budget(&bk), "R10: get_budget").expect("the budget");
    assert_eq!(
        (before.spent.cost_micros, before.held.cost_micros),
        (100, 300)
    );
    ok(
        s.delete_run(&spender, Some(r.version + 1)),
        "R10: delete a run with a hold",
    );
    let after = ok(s.get_budget(&bk), "R10: get_budget").expect("the budget");
    assert_eq!(
        (after.spent.cost_micros, after.held.cost_micros, after.holds),
        (100, 0, 0),
        "R10: the run's hold is gone and its spend stays"
    );
    assert!(
        ok(s.run_spend(&spender), "R10: run_spend").is_none(),
        "R10: a deleted run has no spend"
    );
    let page = ok(
        s.list_budgets(&t, &PageRequest::default()),
        "R10: list_budgets",
    );
    assert_eq!(page.items().len(), 1, "R10: the budget itself stays");

    // The id is free again: a new run at version 0, created afresh.
    let again = create(s, RunRecord::new(key.clone(), "reporter"));
    assert_eq!(
        (again.version, again.agent_name.as_str(), again.iterations),
        (1, "reporter", 0),
        "R10: a deleted run's id creates a new run"
    );
}

/// R11: labels are the application's own fields on runs and sessions:
/// stored and read back as given (JSON values, object keys in any order),
/// scrubbed like tool-call arguments, held to their limits, replaced whole
/// by a put and untouched by a patch; and a listing filters on one exact
/// label, alone or with the other filters, through pages whose cursor
/// carries the label (L7).
pub fn r11_labels_stored_scrubbed_limited_and_filterable(make: Factory<'_>) {
    use agentstate_core::limits::{LABEL_KEY_BYTES_MAX, LABEL_VALUE_BYTES_MAX, LABELS_MAX};
    use agentstate_core::{Labels, PageRequest, SessionRecord};
    use serde_json::json;
    let c = open(make);
    let s = &*c.store;
    let t = unique("r11");

    // Stored as given, read back equal.
    let key = RunKey::new(&t, "labelled");
    let labels = Labels::new()
        .with("user", "u-1")
        .with("n", 3)
        .with("flag", true)
        .with("nested", json!({"b": [1, {"y": null}], "a": "é\n\"q\""}));
    let mut rec = RunRecord::new(key.clone(), "planner");
    rec.labels = labels.clone();
    let created = create(s, rec);
    assert_eq!(created.labels, labels, "R11: put_run returns the labels");
    assert_eq!(must_get(s, &key).labels, labels, "R11: labels read back");

    // A patch leaves them; a put replaces them whole.
    let patched = ok(
        s.patch_run(
            &key,
            StateDelta {
                iterations: 1,
                ..Default::default()
            },
        ),
        "R11: patch",
    );
    assert_eq!(patched.labels, labels, "R11: a patch changed the labels");
    let replaced = update(s, &key, |r| {
        r.labels = Labels::new().with("user", "u-2");
    });
    assert_eq!(
        replaced.labels,
        Labels::new().with("user", "u-2"),
        "R11: a put replaces the labels whole"
    );

    // Scrubbed on every write, like tool-call arguments (X1).
    let secret_key = RunKey::new(&t, "secret");
    let rec = RunRecord::new(secret_key.clone(), "planner")
        .with_label("api_key", "k-one-value")
        .with_label("note", "sk-abcdefghijklmnopqrstuvwxyz123456")
        .with_label("city", "Paris");
    let stored = create(s, rec);
    let text = serde_json::to_string(&stored.labels).expect("labels serialize");
    assert!(
        !text.contains("k-one-value") && !text.contains("sk-abcdefghijklmnopqrstuvwxyz123456"),
        "R11/X1: labels stored unscrubbed: {text}"
    );
    assert_eq!(stored.labels.get("city"), Some(&json!("Paris")));
    assert_eq!(must_get(s, &secret_key).labels, stored.labels);

    // Limits: refused whole, nothing written.
    let before = must_get(s, &key);
    let too_many: Labels = (0..=LABELS_MAX)
        .map(|i| (format!("k{i}"), json!(i)))
        .collect();
    let bad: [(Labels, &str); 5] = [
        (too_many, "more than LABELS_MAX labels"),
        (Labels::new().with("", 1), "an empty label key"),
        (
            Labels::new().with("k".repeat(LABEL_KEY_BYTES_MAX + 1), 1),
            "a label key past its limit",
        ),
        (
            Labels::new().with("big", "v".repeat(LABEL_VALUE_BYTES_MAX)),
            "a label value past its limit",
        ),
        (Labels::new().with("nul", "a\0b"), "a NUL in a label value"),
    ];
    for (labels, what) in bad {
        let mut r = before.clone();
        r.labels = labels;
        expect_err!(s.put_run(r), StateError::Invalid { .. }, "R11: {what}");
    }
    assert_eq!(
        must_get(s, &key),
        before,
        "R11/E6: a refused put changed the run"
    );
    let most: Labels = (0..LABELS_MAX)
        .map(|i| (format!("k{i}"), json!(i)))
        .collect();
    let mut r = RunRecord::new(RunKey::new(&t, "most"), "planner");
    r.labels = most.clone();
    assert_eq!(
        create(s, r).labels,
        most,
        "R11: LABELS_MAX labels are allowed"
    );

    // Sessions carry labels too.
    let sk = SessionKey::new(&t, "sess");
    let sess = ok(
        s.put_session(SessionRecord::new(sk.clone()).with_label("title", "Trip to Lyon")),
        "R11: session create",
    );
    assert_eq!(
        get_session(s, &sk).map(|x| x.labels),
        Some(sess.labels.clone()),
        "R11: session labels read back"
    );
    let mut next = sess.clone();
    next.labels = Labels::new()
        .with("title", "Trip to Paris")
        .with("token", "t-one");
    let next = ok(s.put_session(next), "R11: session update");
    assert_eq!(next.labels.get("title"), Some(&json!("Trip to Paris")));
    assert_ne!(
        next.labels.get("token"),
        Some(&json!("t-one")),
        "R11/X1: session labels stored unscrubbed"
    );
    let mut bad = next.clone();
    bad.labels = Labels::new().with("", 1);
    expect_err!(
        s.put_session(bad),
        StateError::Invalid { .. },
        "R11: session label key"
    );

    // Filtering on one exact label.
    let t = unique("r11f");
    let sk = SessionKey::new(&t, "s");
    create_session(s, &sk);
    let mut made = Vec::new();
    for i in 0..24 {
        let mut r = RunRecord::new(RunKey::new(&t, format!("run{i:02}")), "planner")
            .with_label("team", if i % 3 == 0 { "a" } else { "b" })
            .with_label("obj", json!({"x": i % 2, "y": "z"}));
        if i % 4 == 0 {
            r = r.with_session("s");
        }
        made.push(create(s, r));
    }
    for i in [3, 6] {
        update(s, &made[i].key, |r| r.state = RunState::Running);
    }
    let want = |f: &dyn Fn(&RunRecord) -> bool| -> Vec<RunKey> {
        made.iter()
            .filter(|r| get(s, &r.key).is_some_and(|r| f(&r)))
            .map(|r| r.key.clone())
            .collect()
    };
    let team_a = want(&|r| r.labels.get("team") == Some(&json!("a")));
    assert_eq!(team_a.len(), 8);
    for limit in [1, 3, 100] {
        let got = keys(&walk_runs_by(
            s,
            &StateQuery::new(&t).label("team", "a"),
            limit,
        ));
        assert_eq!(got, team_a, "R11: the label filter at limit {limit}");
    }
    // Object values match whatever order their keys were written in.
    let q = StateQuery::new(&t).label("obj", json!({"y": "z", "x": 1}));
    assert_eq!(
        keys(&walk_runs(s, &q)),
        want(&|r| r.labels.get("obj") == Some(&json!({"x": 1, "y": "z"}))),
        "R11: an object label value in another key order"
    );
    assert!(
        walk_runs(s, &StateQuery::new(&t).label("team", "c")).is_empty(),
        "R11: a value no run holds"
    );
    assert!(
        walk_runs(s, &StateQuery::new(&t).label("team", json!(["a"]))).is_empty(),
        "R11: a value of another JSON type"
    );
    // With the other filters.
    let q = StateQuery::new(&t)
        .label("team", "a")
        .state(RunState::Running);
    assert_eq!(
        keys(&walk_runs(s, &q)),
        vec![made[3].key.clone(), made[6].key.clone()],
        "R11: label and state"
    );
    let q = StateQuery::new(&t).label("team", "a").session("s");
    assert_eq!(
        keys(&walk_runs(s, &q)),
        want(&|r| r.labels.get("team") == Some(&json!("a")) && r.session_id.is_some()),
        "R11: label and session"
    );
    // L7: a next page naming only the tenant continues the label's walk;
    // a cursor with another label is refused (L6).
    let q = StateQuery::new(&t).label("team", "a");
    let first = ok(s.list_runs(&q, &PageRequest::new(3)), "R11: first page");
    let cursor = first.cursor().cloned().expect("R11: more pages");
    let rest = ok(
        s.list_runs(
            &StateQuery::new(&t),
            &PageRequest::new(100).after(Some(&cursor)),
        ),
        "R11: next page by the cursor alone",
    );
    let mut walked = keys(first.items());
    walked.extend(keys(rest.items()));
    assert_eq!(walked, team_a, "R11/L7: the cursor carries the label");
    expect_err!(
        s.list_runs(
            &StateQuery::new(&t).label("team", "b"),
            &PageRequest::new(3).after(Some(&cursor))
        ),
        StateError::Invalid { .. },
        "R11/L6: a cursor used with another label"
    );
    // A label changed by a put moves the run between listings; a deleted
    // run leaves them.
    update(s, &made[0].key, |r| {
        r.labels.insert("team".into(), json!("b"));
    });
    let done = update(s, &made[9].key, |r| r.state = RunState::Completed);
    ok(
        s.delete_run(&made[9].key, Some(done.version)),
        "R11: delete",
    );
    let team_a = want(&|r| r.labels.get("team") == Some(&json!("a")));
    assert_eq!(
        keys(&walk_runs_by(s, &StateQuery::new(&t).label("team", "a"), 2)),
        team_a,
        "R11: after a label changed and a run was deleted"
    );
    assert!(
        keys(&walk_runs(s, &StateQuery::new(&t).label("team", "b"))).contains(&made[0].key),
        "R11: the run whose label changed is listed under its new value"
    );
    // A filter is held to the label limits.
    expect_err!(
        s.list_runs(&StateQuery::new(&t).label("", "a"), &PageRequest::default()),
        StateError::Invalid { .. },
        "R11: an empty label key in a filter"
    );
}
