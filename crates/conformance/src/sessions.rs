//! S — sessions: versions, deletes that refuse to orphan live runs,
//! cascades, a session's runs (S1–S4).

use std::sync::atomic::{AtomicBool, Ordering};

use super::helpers::*;
use super::{ConformanceStore, Factory};
use agentstate_core::{
    RecordKey, RunKey, RunRecord, RunState, SessionKey, SessionRecord, StateError, StateQuery,
};

/// S1: sessions are versioned exactly like runs (R2, R3).
pub fn s1_sessions_versioned_like_runs(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("s1");
    let key = SessionKey::new(&t, "sess");

    c.clock.set(T0 + 10);
    let mut rec = SessionRecord::new(key.clone());
    rec.metadata.insert("title".into(), "trip".into());
    (rec.created_at, rec.updated_at) = (1, 2);
    let v1 = ok(s.put_session(rec), "S1: creating a session");
    assert_eq!(v1.version, 1, "S1: a create commits version 1");
    assert_eq!(
        (v1.created_at, v1.updated_at),
        (T0 + 10, T0 + 10),
        "S1: times come from the store's clock"
    );
    assert_eq!(
        v1.metadata.get("title").map(String::as_str),
        Some("trip"),
        "S1: metadata is stored"
    );
    assert_eq!(
        get_session(s, &key).as_ref(),
        Some(&v1),
        "S1: put_session returns the stored record"
    );

    expect_err!(
        s.put_session(SessionRecord::new(key.clone())),
        StateError::Conflict {
            expected: 0,
            actual: 1,
            ..
        },
        "S1: creating an existing session"
    );
    assert_eq!(
        get_session(s, &key).as_ref(),
        Some(&v1),
        "S1/E6: a refused create changed the session"
    );

    c.clock.set(T0 + 20);
    let mut u = v1.clone();
    u.metadata.insert("user".into(), "ada".into());
    let v2 = ok(s.put_session(u), "S1: updating from the stored version");
    assert_eq!(
        (v2.version, v2.created_at, v2.updated_at),
        (2, T0 + 10, T0 + 20),
        "S1: version, created_at kept, updated_at"
    );
    assert_eq!(v2.metadata.len(), 2, "S1: the update was stored");
    assert_eq!(
        get_session(s, &key).as_ref(),
        Some(&v2),
        "S1: put_session returns the stored record"
    );

    let mut stale = v1.clone();
    stale.metadata.clear();
    expect_err!(
        s.put_session(stale),
        StateError::Conflict {
            expected: 1,
            actual: 2,
            ..
        },
        "S1: updating from a stale version"
    );
    let mut ahead = v2.clone();
    ahead.version = 9;
    expect_err!(
        s.put_session(ahead),
        StateError::Conflict {
            expected: 9,
            actual: 2,
            ..
        },
        "S1: updating from a future version"
    );
    assert_eq!(
        get_session(s, &key).as_ref(),
        Some(&v2),
        "S1/E6: refused updates changed the session"
    );

    let missing = SessionKey::new(&t, "missing");
    let mut ghost = SessionRecord::new(missing.clone());
    ghost.version = 4;
    expect_err!(
        s.put_session(ghost),
        StateError::Conflict {
            expected: 4,
            actual: 0,
            ..
        },
        "S1: updating a missing session"
    );
    assert_eq!(
        get_session(s, &missing),
        None,
        "S1: an update never creates a session"
    );

    ok(s.delete_session(&key, false), "S1: deleting the session");
    expect_err!(
        s.put_session(v2.clone()),
        StateError::Conflict {
            expected: 2,
            actual: 0,
            ..
        },
        "S1: updating a deleted session"
    );
    assert_eq!(
        get_session(s, &key),
        None,
        "S1: an update re-created a deleted session"
    );

    // R3 for sessions: racing creators and racing updaters.
    race_versions(
        "S1 (R3 for sessions)",
        4,
        rounds(250),
        |lane, round| SessionKey::new(&t, format!("race-{lane}-{round}")),
        |k| {
            s.put_session(SessionRecord::new(k.clone()))
                .map(|r| r.version)
        },
        |k| get_session(s, k),
        |current, label| {
            let mut r = current.expect("both creates returned before the update race");
            r.metadata.insert("winner".into(), label.to_string());
            s.put_session(r).map(|r| r.version)
        },
        |k| {
            let r = get_session(s, k).expect("raced session exists");
            (
                r.version,
                r.metadata.get("winner").cloned().unwrap_or_default(),
            )
        },
    );
}

/// Creates one run per state in `session` of `tenant`; their keys, in
/// `RunState::ALL` order.
fn runs_in_every_state(
    s: &dyn ConformanceStore,
    tenant: &str,
    session: &str,
    tag: &str,
) -> Vec<RunRecord> {
    let recs: Vec<RunRecord> = RunState::ALL
        .iter()
        .map(|st| {
            run_in(
                RunKey::new(tenant, format!("{tag}-{}", st.as_str())),
                "planner",
                *st,
            )
            .with_session(session)
        })
        .collect();
    create_many(s, recs)
}

/// S2: deleting a session with unfinished runs (cascade off) fails with
/// `InUse` naming every unfinished run, and deletes nothing.
pub fn s2_delete_refuses_unfinished_runs(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("s2");
    let sk = SessionKey::new(&t, "sess");
    let session = create_session(s, &sk);
    let runs = runs_in_every_state(s, &t, "sess", "r");
    // A session of the same id in another tenant is not touched.
    let other_t = unique("s2other");
    let other = SessionKey::new(&other_t, "sess");
    create_session(s, &other);
    let other_run = create(
        s,
        RunRecord::new(RunKey::new(&other_t, "r"), "planner").with_session("sess"),
    );

    let unfinished: Vec<RunKey> = runs
        .iter()
        .filter(|r| !r.state.is_finished())
        .map(|r| r.key.clone())
        .collect();
    assert_eq!(unfinished.len(), 4, "S2: fixture");
    let e = expect_err!(
        s.delete_session(&sk, false),
        StateError::InUse { .. },
        "S2: deleting a session with unfinished runs"
    );
    let StateError::InUse { runs: named, .. } = e else {
        unreachable!()
    };
    assert_eq!(
        sorted(&named),
        sorted(&unfinished),
        "S2/E4: InUse names every unfinished run, and only those"
    );
    assert_eq!(
        get_session(s, &sk).as_ref(),
        Some(&session),
        "S2: the refused delete deleted the session"
    );
    for r in &runs {
        assert_eq!(
            get(s, &r.key).as_ref(),
            Some(r),
            "S2: the refused delete touched run {:?}",
            r.key
        );
    }
    assert_eq!(
        keys(&walk_runs(s, &StateQuery::new(&t).session("sess"))),
        keys(&by_seq(runs.clone())),
        "S2: the session's runs are all still listed"
    );

    // One unfinished run left: still refused, naming just it.
    for r in runs.iter().filter(|r| !r.state.is_finished()).skip(1) {
        update(s, &r.key, |r| r.state = RunState::Cancelled);
    }
    let e = expect_err!(
        s.delete_session(&sk, false),
        StateError::InUse { .. },
        "S2: one unfinished run left"
    );
    let StateError::InUse { runs: named, .. } = e else {
        unreachable!()
    };
    assert_eq!(
        named,
        vec![unfinished[0].clone()],
        "S2: InUse names the one unfinished run"
    );

    // All finished: the delete goes through.
    update(s, &unfinished[0], |r| r.state = RunState::Completed);
    let deleted = ok(
        s.delete_session(&sk, false),
        "S2: deleting a session whose runs are all finished",
    );
    assert_eq!(get_session(s, &sk), None, "S2: the session is gone");
    for k in &deleted {
        assert_eq!(
            get(s, k),
            None,
            "S2: delete_session reported {k:?} deleted, but it still reads"
        );
    }
    assert_eq!(
        get_session(s, &other).map(|x| x.version),
        Some(1),
        "S2: the other tenant's session was touched"
    );
    assert_eq!(
        get(s, &other_run.key).as_ref(),
        Some(&other_run),
        "S2: the other tenant's run was touched"
    );

    // A missing session is NotFound.
    expect_err!(
        s.delete_session(&sk, false),
        StateError::NotFound(RecordKey::Session(ref k)) if *k == sk,
        "S2: deleting a missing session"
    );
}

/// S3: `cascade: true` deletes the session and all its runs, atomically:
/// a reader never sees part of the delete.
pub fn s3_cascade_deletes_session_and_runs_atomically(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("s3");
    let sk = SessionKey::new(&t, "sess");
    create_session(s, &sk);
    let runs = runs_in_every_state(s, &t, "sess", "r");
    let keep_session = SessionKey::new(&t, "keep");
    create_session(s, &keep_session);
    let kept = runs_in_every_state(s, &t, "keep", "k");
    let loose = create(s, RunRecord::new(RunKey::new(&t, "loose"), "planner"));

    let deleted = ok(s.delete_session(&sk, true), "S3: cascade delete");
    assert_eq!(
        sorted(&deleted),
        sorted(&keys(&runs)),
        "S3: cascade returns exactly the session's runs"
    );
    assert_eq!(get_session(s, &sk), None, "S3: the session is gone");
    for r in &runs {
        assert_eq!(
            get(s, &r.key),
            None,
            "S3: run {:?} survived its session's cascade delete",
            r.key
        );
    }
    assert!(
        walk_runs(s, &StateQuery::new(&t).session("sess")).is_empty(),
        "S3: a deleted session lists no runs"
    );
    let mut rest = kept.clone();
    rest.push(loose.clone());
    assert_eq!(
        keys(&walk_runs(s, &StateQuery::new(&t))),
        keys(&by_seq(rest)),
        "S3: only the session's runs went"
    );
    assert!(
        get_session(s, &keep_session).is_some(),
        "S3: another session was deleted"
    );
    expect_err!(
        s.delete_session(&sk, true),
        StateError::NotFound(RecordKey::Session(ref k)) if *k == sk,
        "S3: cascade-deleting a missing session"
    );

    // Atomicity, seen from outside: a reader reads every run and then the
    // session (and then in reverse) while the cascade runs. If the delete
    // is one step, what it reads in sequence is "present" up to some point
    // and "absent" after it; anything else saw part of the delete.
    let cycles = rounds(20);
    for cycle in 0..cycles {
        let sk = SessionKey::new(&t, format!("atomic-{cycle}"));
        create_session(s, &sk);
        let recs: Vec<RunRecord> = (0..8)
            .map(|i| {
                RunRecord::new(RunKey::new(&t, format!("atomic-{cycle}-{i}")), "planner")
                    .with_session(sk.session_id.clone())
            })
            .collect();
        let run_keys = keys(&create_many(s, recs));
        let done = AtomicBool::new(false);
        std::thread::scope(|sc| {
            let reader = sc.spawn(|| {
                let mut reads = 0usize;
                loop {
                    let finished = done.load(Ordering::SeqCst);
                    for reverse in [false, true] {
                        let mut seen: Vec<bool> = Vec::with_capacity(run_keys.len() + 1);
                        if reverse {
                            seen.push(get_session(s, &sk).is_some());
                            seen.extend(run_keys.iter().rev().map(|k| get(s, k).is_some()));
                        } else {
                            seen.extend(run_keys.iter().map(|k| get(s, k).is_some()));
                            seen.push(get_session(s, &sk).is_some());
                        }
                        let first_gone = seen.iter().position(|p| !p).unwrap_or(seen.len());
                        assert!(
                            seen[first_gone..].iter().all(|p| !p),
                            "S3: cycle {cycle}: a reader saw part of a cascade delete (reading {}: {seen:?})",
                            if reverse { "session, then runs in reverse" } else { "runs, then session" }
                        );
                    }
                    reads += 1;
                    if finished {
                        return reads;
                    }
                }
            });
            let _done = OnDrop(|| done.store(true, Ordering::SeqCst));
            let deleted = ok(
                s.delete_session(&sk, true),
                "S3: cascade delete under a reader",
            );
            assert_eq!(
                sorted(&deleted),
                sorted(&run_keys),
                "S3: cascade returns exactly the session's runs"
            );
            done.store(true, Ordering::SeqCst);
            join(reader.join());
        });
    }
}

/// S4: a session's runs are listed from the session, in `seq` order,
/// with the other L rules (paging, other filters).
pub fn s4_session_runs_listed(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("s4");
    for sess in ["a", "b", "a/b", "a\0"] {
        create_session(s, &SessionKey::new(&t, sess));
    }
    let recs: Vec<RunRecord> = (0..40)
        .map(|i| {
            let r = run_in(
                RunKey::new(&t, format!("r{i}")),
                "planner",
                RunState::ALL[i % 7],
            );
            match i % 5 {
                0 | 1 => r.with_session("a"),
                2 => r.with_session("b"),
                3 => r.with_session(if i % 2 == 0 { "a/b" } else { "a\0" }),
                _ => r,
            }
        })
        .collect();
    let all = by_seq(create_many(s, recs));
    for sess in ["a", "b", "a/b", "a\0"] {
        let want: Vec<RunKey> = all
            .iter()
            .filter(|r| r.session_id.as_deref() == Some(sess))
            .map(|r| r.key.clone())
            .collect();
        assert!(!want.is_empty(), "S4: fixture");
        for limit in [1, 3, 100] {
            let got = walk_runs_by(s, &StateQuery::new(&t).session(sess), limit);
            assert_eq!(
                keys(&got),
                want,
                "S4: the runs of session {sess:?}, {limit} a page, in seq order"
            );
        }
        let want_running: Vec<RunKey> = all
            .iter()
            .filter(|r| r.session_id.as_deref() == Some(sess) && r.state == RunState::Running)
            .map(|r| r.key.clone())
            .collect();
        let got = walk_runs_by(
            s,
            &StateQuery::new(&t).session(sess).state(RunState::Running),
            2,
        );
        assert_eq!(
            keys(&got),
            want_running,
            "S4: the running runs of session {sess:?}"
        );
    }
    assert!(
        walk_runs(s, &StateQuery::new(&t).session("none")).is_empty(),
        "S4: a session with no runs lists none"
    );
}
