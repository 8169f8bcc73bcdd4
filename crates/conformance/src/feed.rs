//! F — the change feed: every change once, level-triggered, in commit
//! order, scoped, never skipping a late commit, woken by a commit, pruned
//! only with a clear error, and a head to follow from (F1–F9).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use super::helpers::{ok, rounds, unique};
use super::{ConformanceStore, Factory};
use agentstate_core::{
    Change, ChangePage, Changed, FEED_WAIT_MAX, FeedScope, InstanceKey, Position, RunKey,
    RunRecord, RunState, SessionKey, SessionRecord, StateDelta, StateError, StateQuery, Tray,
    TrayKey,
};

fn open(make: Factory<'_>) -> Arc<dyn ConformanceStore> {
    super::helpers::open(make).store
}

/// Every change of `scope` after `after`, page by page (`limit` each),
/// checking that positions strictly increase, that only the last page is
/// short of nothing (no empty page before the end) and that `next` is the
/// last position read. Returns the changes and the final position.
fn drain(
    s: &dyn ConformanceStore,
    scope: &FeedScope,
    after: Position,
    limit: usize,
    ctx: &str,
) -> (Vec<Change>, Position) {
    let mut at = after;
    let mut all = Vec::new();
    for _ in 0..1_000_000 {
        let page: ChangePage = ok(s.changes(scope, at, limit), format_args!("{ctx}: changes"));
        assert!(
            page.changes.len() <= limit,
            "{ctx}: a page of {} changes for a limit of {limit}",
            page.changes.len()
        );
        if page.changes.is_empty() {
            assert!(
                page.next >= at,
                "{ctx}: an empty page moved the position back ({} -> {})",
                at,
                page.next
            );
            return (all, page.next.max(at));
        }
        let mut last = at;
        for c in &page.changes {
            assert!(
                c.position > last,
                "F2 ({ctx}): positions must strictly increase ({} then {})",
                last,
                c.position
            );
            last = c.position;
        }
        assert!(
            page.next >= last,
            "F2 ({ctx}): the page's next ({}) is before its last change ({last})",
            page.next
        );
        at = page.next;
        all.extend(page.changes);
    }
    panic!("{ctx}: the feed never ended");
}

/// What a consumer that applies changes in order knows: records by key.
#[derive(Default, Debug)]
struct Model {
    runs: BTreeMap<RunKey, RunRecord>,
    sessions: BTreeMap<SessionKey, SessionRecord>,
    trays: BTreeMap<TrayKey, Tray>,
    alarms: BTreeMap<InstanceKey, u64>,
}

impl Model {
    fn apply(&mut self, changes: &[Change]) {
        for c in changes {
            match &c.item {
                Changed::Run { run } => {
                    self.runs.insert(run.key.clone(), run.clone());
                }
                Changed::RunDeleted { key } => {
                    self.runs.remove(key);
                }
                Changed::Session { session } => {
                    self.sessions.insert(session.key.clone(), session.clone());
                }
                Changed::SessionDeleted { key } => {
                    self.sessions.remove(key);
                }
                Changed::Tray { key, tray } => {
                    self.trays.insert(key.clone(), tray.clone());
                }
                Changed::TrayDeleted { key } => {
                    self.trays.remove(key);
                }
                Changed::Alarm { alarm } => {
                    self.alarms.insert(alarm.instance.clone(), alarm.due_at);
                }
                Changed::AlarmDeleted { instance } => {
                    self.alarms.remove(instance);
                }
                other => panic!("F: a change the suite does not know: {other:?}"),
            }
        }
    }

    /// Panics unless the runs and sessions are the tenant's, record by
    /// record.
    fn assert_is_tenant(&self, s: &dyn ConformanceStore, tenant: &str, ctx: &str) {
        let mut runs = BTreeMap::new();
        let q = StateQuery::new(tenant);
        for r in s.iter_runs(&q) {
            let r = ok(r, format_args!("{ctx}: list runs"));
            runs.insert(r.key.clone(), r);
        }
        assert_eq!(
            self.runs.len(),
            runs.len(),
            "{ctx}: the feed's runs are not the store's ({} against {})",
            self.runs.len(),
            runs.len()
        );
        for (k, r) in &runs {
            assert_eq!(
                self.runs.get(k),
                Some(r),
                "{ctx}: run {k} differs between the feed and the store"
            );
        }
    }
}

fn kinds(changes: &[Change]) -> Vec<String> {
    changes
        .iter()
        .map(|c| match &c.item {
            Changed::Run { run } => format!("run {}@{}", run.key.run_id, run.version),
            Changed::RunDeleted { key } => format!("-run {}", key.run_id),
            Changed::Session { session } => format!("session {}", session.key.session_id),
            Changed::SessionDeleted { key } => format!("-session {}", key.session_id),
            Changed::Tray { key, .. } => format!("tray {}/{}", key.id, key.tray_id),
            Changed::TrayDeleted { key } => format!("-tray {}/{}", key.id, key.tray_id),
            Changed::Alarm { alarm } => format!("alarm {}@{}", alarm.instance.id, alarm.due_at),
            Changed::AlarmDeleted { instance } => format!("-alarm {}", instance.id),
            other => format!("unknown {other:?}"),
        })
        .collect()
}

fn put(s: &dyn ConformanceStore, r: RunRecord, ctx: &str) -> RunRecord {
    ok(s.put_run(r), format_args!("{ctx}: put_run"))
}

fn delta(cost: u64) -> StateDelta {
    StateDelta {
        cost_micros: cost,
        ..StateDelta::default()
    }
}

/// F1: every committed write of a scope's records is in its feed, once
/// per record, in the record's current state at the position of its last
/// change; a delete is a tombstone.
pub fn f1_every_change_once_in_its_latest_state(make: Factory<'_>) {
    let s = &*open(make);
    let t = unique("f1");
    let scope = FeedScope::tenant(&t);
    let start = ok(s.feed_head(&scope), "F1: head");
    let ses = ok(
        s.put_session(SessionRecord::new(SessionKey::new(&t, "s"))),
        "F1: session",
    );
    let mut a = put(s, RunRecord::new(RunKey::new(&t, "a"), "agent"), "F1");
    for i in 0..5 {
        a = ok(s.patch_run(&a.key, delta(i + 1)), "F1: patch");
    }
    let b = put(s, RunRecord::new(RunKey::new(&t, "b"), "agent"), "F1");
    let mut c = RunRecord::new(RunKey::new(&t, "c"), "agent");
    c.state = RunState::Completed;
    let c = put(s, c, "F1");
    ok(s.delete_run(&c.key, None), "F1: delete c");
    let (changes, _) = drain(s, &scope, start, 100, "F1");
    let mut want = vec![
        format!("session {}", ses.key.session_id),
        format!("run a@{}", a.version),
        format!("run b@{}", b.version),
        "-run c".to_string(),
    ];
    let mut got = kinds(&changes);
    // The order across records is the order of their last commits.
    assert_eq!(
        got, want,
        "F1: one change per record, in the order of their last writes"
    );
    got.sort();
    want.sort();
    let Changed::Run { run } = &changes[1].item else {
        panic!("F1: the second change is not a run")
    };
    assert_eq!(run, &a, "F1: a run's change holds the run as stored");
    assert_eq!(run.cost_micros, 15, "F1: every patch is in the run's state");
    // Moving a record moves its one entry.
    let b2 = ok(s.patch_run(&b.key, delta(1)), "F1: patch b");
    let (changes, _) = drain(s, &scope, start, 100, "F1");
    assert_eq!(
        kinds(&changes),
        vec![
            format!("session {}", ses.key.session_id),
            format!("run a@{}", a.version),
            "-run c".to_string(),
            format!("run b@{}", b2.version),
        ],
        "F1: a written record moves to the end of its feed, once"
    );
    // A session delete with cascade: the session and its runs go.
    let mut d = RunRecord::new(RunKey::new(&t, "d"), "agent");
    d.session_id = Some("s".into());
    put(s, d, "F1");
    ok(s.delete_session(&ses.key, true), "F1: delete the session");
    let (changes, _) = drain(s, &scope, start, 100, "F1");
    let got = kinds(&changes);
    assert!(
        got.ends_with(&["-run d".to_string(), "-session s".to_string()])
            || got.ends_with(&["-session s".to_string(), "-run d".to_string()]),
        "F1: a cascade is a tombstone per record: {got:?}"
    );
    assert_eq!(got.len(), 5, "F1: one change per record: {got:?}");
}

/// F2: a feed is read in pages in position order: positions strictly
/// increase within and across pages, `next` continues exactly where the
/// page ended, and any page size reads the same changes.
pub fn f2_pages_continue_in_position_order(make: Factory<'_>) {
    let s = &*open(make);
    let t = unique("f2");
    let scope = FeedScope::tenant(&t);
    for i in 0..23 {
        put(
            s,
            RunRecord::new(RunKey::new(&t, format!("r{i:02}")), "agent"),
            "F2",
        );
        if i % 3 == 0 {
            ok(
                s.patch_run(&RunKey::new(&t, format!("r{:02}", i / 2)), delta(1)),
                "F2: patch",
            );
        }
    }
    let (whole, end) = drain(s, &scope, Position::START, 1000, "F2 whole");
    assert_eq!(whole.len(), 23, "F2: one change per run");
    for limit in [1, 2, 5, 22, 23, 24] {
        let (paged, e) = drain(s, &scope, Position::START, limit, "F2 paged");
        assert_eq!(
            paged, whole,
            "F2: pages of {limit} read what one page reads"
        );
        assert_eq!(e, end, "F2: the walk ends at the same position");
    }
    // Starting in the middle reads exactly the rest.
    let mid = whole[10].position;
    let (rest, _) = drain(s, &scope, mid, 4, "F2 rest");
    assert_eq!(
        rest,
        whole[11..].to_vec(),
        "F2: after a position, exactly what follows it"
    );
    // At the end, an empty page that stays there.
    let page = ok(s.changes(&scope, end, 10), "F2: at the end");
    assert!(page.changes.is_empty(), "F2: nothing after the end");
    assert_eq!(page.next, end, "F2: an empty page's next is its after");
}

/// F3: a tenant's feed holds its runs and sessions only; the trays feed
/// holds trays and alarms, and with an env only that env's trays.
pub fn f3_feeds_are_scoped(make: Factory<'_>) {
    let s = &*open(make);
    let (t, u) = (unique("f3t"), unique("f3u"));
    let ns = unique("f3ns");
    let (env_a, env_b) = (unique("f3a"), unique("f3b"));
    let head_trays = ok(s.feed_head(&FeedScope::trays()), "F3: head of trays");
    let head_a = ok(
        s.feed_head(&FeedScope::trays_in(&env_a)),
        "F3: head of env a",
    );
    put(s, RunRecord::new(RunKey::new(&t, "r"), "agent"), "F3");
    put(s, RunRecord::new(RunKey::new(&u, "r"), "agent"), "F3");
    ok(
        s.put_session(SessionRecord::new(SessionKey::new(&u, "s"))),
        "F3: session",
    );
    let i = InstanceKey::new(&ns, "i");
    let tray = |env: &str| super::helpers::tray(true, "doc", env);
    ok(
        s.write_tray(&i.tray("q", "1"), 1, tray(&env_a)),
        "F3: tray in a",
    );
    ok(
        s.write_tray(&i.tray("q", "2"), 1, tray(&env_b)),
        "F3: tray in b",
    );
    ok(s.set_alarm(&i, 1, 5_000), "F3: alarm");

    let (ct, _) = drain(s, &FeedScope::tenant(&t), Position::START, 100, "F3 t");
    assert_eq!(
        kinds(&ct),
        vec!["run r@1"],
        "F3: a tenant's feed holds its own records only"
    );
    let (cu, _) = drain(s, &FeedScope::tenant(&u), Position::START, 100, "F3 u");
    assert_eq!(
        kinds(&cu),
        vec!["run r@1", "session s"],
        "F3: runs and sessions"
    );

    let ours = |c: &Change| match &c.item {
        Changed::Tray { key, .. } | Changed::TrayDeleted { key } => key.ns == ns,
        Changed::Alarm { alarm } => alarm.instance.ns == ns,
        Changed::AlarmDeleted { instance } => instance.ns == ns,
        _ => panic!("F3: the trays feed holds a run or session: {c:?}"),
    };
    let (all, _) = drain(s, &FeedScope::trays(), head_trays, 1000, "F3 trays");
    let mine: Vec<Change> = all.into_iter().filter(ours).collect();
    assert_eq!(
        kinds(&mine),
        vec!["tray i/1", "tray i/2", "alarm i@5000"],
        "F3: the trays feed holds trays and alarms"
    );
    let Changed::Tray { tray: got, .. } = &mine[0].item else {
        unreachable!()
    };
    assert_eq!(got, &tray(&env_a), "F3: a tray's change holds the tray");
    let (in_a, _) = drain(s, &FeedScope::trays_in(&env_a), head_a, 1000, "F3 env a");
    assert_eq!(
        kinds(&in_a),
        vec!["tray i/1"],
        "F3: an env's feed holds its trays only"
    );
    let (in_a, _) = drain(
        s,
        &FeedScope::trays_in(&env_a),
        Position::START,
        1000,
        "F3 env a",
    );
    assert_eq!(
        kinds(&in_a),
        vec!["tray i/1"],
        "F3: an env's feed holds its trays only"
    );

    // Deletes: a tray and an acknowledged alarm; then a release, which
    // unmarks the instance's trays (T4) and leaves its alarm.
    ok(s.delete_tray(&i.tray("q", "2"), 1), "F3: delete a tray");
    ok(s.ack_alarm(&i, 1, 5_000), "F3: ack");
    let (all, _) = drain(s, &FeedScope::trays(), head_trays, 1000, "F3 trays");
    let mine: Vec<Change> = all.into_iter().filter(ours).collect();
    assert_eq!(
        kinds(&mine),
        vec!["tray i/1", "-tray i/2", "-alarm i"],
        "F3: a deleted tray and an acknowledged alarm are tombstones"
    );
    ok(s.set_alarm(&i, 1, 6_000), "F3: alarm again");
    ok(s.release(&i, 1), "F3: release");
    let (all, _) = drain(s, &FeedScope::trays(), head_trays, 1000, "F3 trays");
    let mine: Vec<Change> = all.into_iter().filter(ours).collect();
    assert_eq!(
        kinds(&mine),
        vec!["-tray i/2", "alarm i@6000", "tray i/1"],
        "F3: one change per tray and alarm, a release's unmarked tray last"
    );
    let Changed::Tray { tray: got, .. } = &mine[2].item else {
        unreachable!()
    };
    assert!(
        !got.marked,
        "F3: a released tray's change holds it unmarked"
    );
    let (in_a, _) = drain(s, &FeedScope::trays_in(&env_a), head_a, 1000, "F3 env a");
    assert_eq!(
        kinds(&in_a),
        vec!["tray i/1"],
        "F3: a released tray stays in its env's feed"
    );
    let (in_b, _) = drain(
        s,
        &FeedScope::trays_in(&env_b),
        Position::START,
        1000,
        "F3 env b",
    );
    assert_eq!(kinds(&in_b), vec!["-tray i/2"], "F3: an env's tombstone");
}

/// F4: no commit is ever skipped: a consumer following the feed while
/// writers race (creates, patches, deletes from several threads), and one
/// that stops, falls behind and resumes from its last position, each end
/// holding exactly the store's final state, record by record.
pub fn f4_no_commit_is_ever_skipped(make: Factory<'_>) {
    let store = open(make);
    let t = unique("f4");
    let scope = FeedScope::tenant(&t);
    let writers = 4;
    let per_writer = rounds(150);
    let done = AtomicBool::new(false);
    let start = Barrier::new(writers + 2);
    let mut follower = Model::default();
    let mut follower_at = Position::START;
    let mut late = Model::default();
    let mut late_at = Position::START;
    std::thread::scope(|sc| {
        let mut handles = Vec::new();
        for w in 0..writers {
            let (s, t, start) = (&*store, &t, &start);
            handles.push(sc.spawn(move || {
                start.wait();
                for i in 0..per_writer {
                    let k = RunKey::new(t, format!("w{w}-{}", i % 40));
                    let r = match s.get_run(&k) {
                        Ok(Some(r)) if i % 7 == 0 => s.delete_run(&k, Some(r.version)).map(|_| ()),
                        Ok(Some(_)) => s.patch_run(&k, delta(1)).map(|_| ()),
                        Ok(None) => s.put_run(RunRecord::new(k.clone(), "agent")).map(|_| ()),
                        Err(e) => Err(e),
                    };
                    match r {
                        Ok(())
                        | Err(StateError::Conflict { .. })
                        | Err(StateError::NotFound(_)) => {}
                        Err(e) => panic!("F4: writer {w}: {e}"),
                    }
                }
            }));
        }
        // The follower: reads while the writers write, until told they
        // are done and a page comes back empty.
        let (follower, follower_at, done, start, store, scope) = (
            &mut follower,
            &mut follower_at,
            &done,
            &start,
            &store,
            &scope,
        );
        sc.spawn(move || {
            start.wait();
            loop {
                let finished = done.load(Ordering::SeqCst);
                let page = ok(store.changes(scope, *follower_at, 7), "F4: follow");
                follower.apply(&page.changes);
                *follower_at = page.next;
                if finished && page.changes.is_empty() {
                    break;
                }
            }
        });
        // The late consumer: a few pages at the start, then away while
        // the writers write, then back once they are done.
        start.wait();
        for _ in 0..3 {
            let page = ok(store.changes(scope, late_at, 5), "F4: late");
            late.apply(&page.changes);
            late_at = page.next;
        }
        for h in handles {
            h.join().expect("F4: a writer panicked");
        }
        done.store(true, Ordering::SeqCst);
    });
    // Catch up both from where they are.
    let (rest, _) = drain(&*store, &scope, follower_at, 9, "F4 follower");
    follower.apply(&rest);
    follower.assert_is_tenant(&*store, &t, "F4: the follower");
    let (rest, _) = drain(&*store, &scope, late_at, 100, "F4 late");
    late.apply(&rest);
    late.assert_is_tenant(&*store, &t, "F4: the consumer that fell behind");
}

/// F5: `wait_changes` answers at once when something is after the
/// position, is woken by a commit to the scope (from another thread; on a
/// server, another process), and at its timeout answers an empty page.
pub fn f5_a_commit_wakes_a_waiter(make: Factory<'_>) {
    let store = open(make);
    let t = unique("f5");
    let scope = FeedScope::tenant(&t);
    let head = ok(store.feed_head(&scope), "F5: head");
    // Nothing to see: the timeout, with nothing.
    let began = Instant::now();
    let page = ok(
        store.wait_changes(&scope, head, 10, Duration::from_millis(200)),
        "F5: wait for nothing",
    );
    assert!(
        page.changes.is_empty(),
        "F5: a wait with no commit returned {page:?}"
    );
    assert_eq!(page.next, head, "F5: an empty wait stays at its position");
    assert!(
        began.elapsed() >= Duration::from_millis(150),
        "F5: returned after {:?}, before its timeout of 200 ms",
        began.elapsed()
    );
    // Another tenant's commit does not answer the wait.
    let other = unique("f5o");
    // A commit from another thread wakes it, long before its timeout.
    for round in 0..rounds(3) {
        let at = ok(store.feed_head(&scope), "F5: head");
        let began = Instant::now();
        let page = std::thread::scope(|sc| {
            let s = &*store;
            let (t, other) = (&t, &other);
            sc.spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                put(
                    s,
                    RunRecord::new(RunKey::new(other, format!("o{round}")), "agent"),
                    "F5",
                );
                std::thread::sleep(Duration::from_millis(100));
                put(
                    s,
                    RunRecord::new(RunKey::new(t, format!("r{round}")), "agent"),
                    "F5",
                );
            });
            ok(
                s.wait_changes(&scope, at, 10, Duration::from_secs(30)),
                "F5: wait for a commit",
            )
        });
        let took = began.elapsed();
        assert_eq!(
            kinds(&page.changes),
            vec![format!("run r{round}@1")],
            "F5: the waiter sees the commit that woke it"
        );
        assert!(
            took < Duration::from_secs(10),
            "F5: a commit 200 ms in woke a waiter only after {took:?}"
        );
    }
    // Something is already there: no wait at all.
    let began = Instant::now();
    let page = ok(
        store.wait_changes(&scope, Position::START, 10, Duration::from_secs(30)),
        "F5: wait with changes",
    );
    assert_eq!(page.changes.len(), rounds(3), "F5: everything after START");
    assert!(
        began.elapsed() < Duration::from_secs(10),
        "F5: a wait with changes already there waited"
    );
}

/// F6: tombstones stay until pruned; after `prune_changes` (and after a
/// tenant is purged) a position before the horizon is `FeedPruned`, never
/// a feed with deletes missing, and reading on from the horizon works.
pub fn f6_pruned_feeds_say_so(make: Factory<'_>) {
    let s = &*open(make);
    let t = unique("f6");
    let scope = FeedScope::tenant(&t);
    let mut done = RunRecord::new(RunKey::new(&t, "gone"), "agent");
    done.state = RunState::Completed;
    put(s, done.clone(), "F6");
    put(s, RunRecord::new(RunKey::new(&t, "kept"), "agent"), "F6");
    ok(s.delete_run(&done.key, None), "F6: delete");
    let (changes, end) = drain(s, &scope, Position::START, 100, "F6");
    assert_eq!(
        kinds(&changes),
        vec!["run kept@1", "-run gone"],
        "F6: the tombstone is kept"
    );
    let through = changes[1].position;
    let dropped = ok(s.prune_changes(&scope, through), "F6: prune");
    assert_eq!(dropped, 1, "F6: one tombstone dropped");
    let e = expect_err!(
        s.changes(&scope, Position::START, 100),
        StateError::FeedPruned { .. },
        "F6: a position before the horizon"
    );
    let StateError::FeedPruned {
        horizon,
        scope: named,
    } = e
    else {
        unreachable!()
    };
    assert_eq!(named, scope, "F6: the error names the feed");
    assert!(
        horizon >= through,
        "F6: the horizon is where it was pruned through"
    );
    assert!(
        !e_retryable(horizon, &scope),
        "F6: FeedPruned is not retryable as is"
    );
    let (after, _) = drain(s, &scope, horizon, 100, "F6 after the horizon");
    assert!(
        kinds(&after).iter().all(|k| !k.starts_with('-')),
        "F6: no tombstone at or before the horizon: {after:?}"
    );
    let (from_end, _) = drain(s, &scope, end, 100, "F6 from the end");
    assert!(from_end.is_empty(), "F6: nothing after the end");
    // A purged tenant's old positions are pruned too.
    ok(s.purge_tenant(&t), "F6: purge");
    expect_err!(
        s.changes(&scope, end, 100),
        StateError::FeedPruned { .. },
        "F6: a position before a purge"
    );
    let head = ok(s.feed_head(&scope), "F6: head after purge");
    let (after, _) = drain(s, &scope, head, 100, "F6 after the purge");
    assert!(
        after.is_empty(),
        "F6: a purged tenant's feed is empty: {after:?}"
    );
}

fn e_retryable(horizon: Position, scope: &FeedScope) -> bool {
    StateError::FeedPruned {
        scope: scope.clone(),
        horizon,
    }
    .is_retryable()
}

/// F7: the head: every change committed after `feed_head` returned is
/// after it. A change committed before it may be read again after it (a
/// server's head stays behind transactions still open when it was taken),
/// always in the record's current state, so list-then-follow misses
/// nothing and at worst reads a record twice.
pub fn f7_the_head_splits_before_from_after(make: Factory<'_>) {
    let s = &*open(make);
    let t = unique("f7");
    let scope = FeedScope::tenant(&t);
    let a = put(s, RunRecord::new(RunKey::new(&t, "a"), "agent"), "F7");
    let head = ok(s.feed_head(&scope), "F7: head");
    let (after, _) = drain(s, &scope, head, 100, "F7");
    assert!(
        kinds(&after).iter().all(|k| k == "run a@1"),
        "F7: only a write from before the head, in its current state, may follow it: {after:?}"
    );
    ok(s.patch_run(&a.key, delta(1)), "F7: patch");
    put(s, RunRecord::new(RunKey::new(&t, "b"), "agent"), "F7");
    let (after, _) = drain(s, &scope, head, 100, "F7");
    assert_eq!(
        kinds(&after),
        vec!["run a@2", "run b@1"],
        "F7: writes after the head"
    );
    let head2 = ok(s.feed_head(&scope), "F7: head again");
    assert!(head2 >= head, "F7: the head never moves back");
    let empty = FeedScope::tenant(unique("f7e"));
    let h = ok(s.feed_head(&empty), "F7: head of an empty feed");
    let (none, _) = drain(s, &empty, h, 100, "F7 empty");
    assert!(none.is_empty(), "F7: an empty feed");
}

/// F8: bad arguments are `Invalid` and change nothing: an empty or
/// oversized limit, a bad tenant or env, a wait past the longest, and
/// pruning one env's feed (tombstones are pruned store-wide).
pub fn f8_bad_feed_arguments_are_invalid(make: Factory<'_>) {
    let s = &*open(make);
    let t = unique("f8");
    let scope = FeedScope::tenant(&t);
    expect_err!(
        s.changes(&scope, Position::START, 0),
        StateError::Invalid { .. },
        "F8: limit 0"
    );
    expect_err!(
        s.changes(
            &scope,
            Position::START,
            agentstate_core::limits::PAGE_ITEMS_MAX + 1
        ),
        StateError::Invalid { .. },
        "F8: a limit past the page maximum"
    );
    expect_err!(
        s.changes(&FeedScope::tenant(""), Position::START, 10),
        StateError::Invalid { .. },
        "F8: an empty tenant"
    );
    expect_err!(
        s.changes(&FeedScope::trays_in(""), Position::START, 10),
        StateError::Invalid { .. },
        "F8: an empty env"
    );
    expect_err!(
        s.wait_changes(
            &scope,
            Position::START,
            10,
            FEED_WAIT_MAX + Duration::from_secs(1)
        ),
        StateError::Invalid { .. },
        "F8: a wait past the longest"
    );
    expect_err!(
        s.prune_changes(&FeedScope::trays_in(unique("f8e")), Position::START),
        StateError::Invalid { .. },
        "F8: pruning one env's feed"
    );
    expect_err!(
        s.feed_head(&FeedScope::tenant(
            "x".repeat(agentstate_core::limits::ID_BYTES_MAX + 1)
        )),
        StateError::Invalid { .. },
        "F8: an oversized tenant"
    );
}

/// Each way a call takes a position, with a foreign `p`: every one is
/// `Invalid` (F9), at once (the wait is short: a wait that was not refused
/// answers an empty page, which fails here).
#[track_caller]
fn refused(s: &dyn ConformanceStore, scope: &FeedScope, p: Position, ctx: &str) {
    expect_err!(
        s.changes(scope, p, 10),
        StateError::Invalid { .. },
        "F9: changes on {scope} after {ctx} ({p})"
    );
    expect_err!(
        s.wait_changes(scope, p, 10, Duration::from_millis(100)),
        StateError::Invalid { .. },
        "F9: wait_changes on {scope} after {ctx} ({p})"
    );
    expect_err!(
        s.prune_changes(scope, p),
        StateError::Invalid { .. },
        "F9: prune_changes on {scope} through {ctx} ({p})"
    );
}

/// The positions a store hands out for `scope` after `from`: the head, the
/// page's `next` and each change's position.
fn handed_out(s: &dyn ConformanceStore, scope: &FeedScope, from: Position) -> Vec<Position> {
    let page = ok(
        s.changes(scope, from, 100),
        format_args!("F9: changes of {scope}"),
    );
    let mut ps: Vec<Position> = page.changes.iter().map(|c| c.position).collect();
    assert!(!ps.is_empty(), "F9: {scope} has changes after {from}");
    ps.push(page.next);
    ps.push(ok(s.feed_head(scope), format_args!("F9: head of {scope}")));
    ps.retain(|p| *p != Position::START);
    ps
}

/// A number no one can guess (the std hasher's OS-seeded keys), never 0.
fn random_u128() -> u128 {
    use std::hash::{BuildHasher, Hasher};
    let half = || {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(0xf9);
        h.finish()
    };
    ((u128::from(half()) << 64) | u128::from(half())).max(1)
}

/// F9: a position belongs to its scope and its store. One from another
/// tenant, from the trays feed on a tenant's (and the other way), from
/// another env, from another store (when the factory gives distinct
/// stores), or forged (a hand-made number, a random one, a real one with
/// a bit of its tag flipped) is `Invalid` for `changes`, `wait_changes`
/// and `prune_changes`, and changes nothing: no page, no wait, no prune.
/// `Position::START` stays valid in every scope, and a `FeedPruned`
/// horizon is a position of its own scope.
pub fn f9_positions_belong_to_their_scope_and_store(make: Factory<'_>) {
    let s = &*open(make);
    let (a, b) = (unique("f9a"), unique("f9b"));
    let ns = unique("f9ns");
    let (env_a, env_b) = (unique("f9ea"), unique("f9eb"));
    let (ta, tb) = (FeedScope::tenant(&a), FeedScope::tenant(&b));
    let trays = FeedScope::trays();
    let (ea, eb) = (FeedScope::trays_in(&env_a), FeedScope::trays_in(&env_b));
    let trays_from = ok(s.feed_head(&trays), "F9: head of trays");
    // Every feed has a change, and each tenant a tombstone (which a prune
    // that should have been refused would drop).
    for t in [&a, &b] {
        put(s, RunRecord::new(RunKey::new(t, "kept"), "agent"), "F9");
        let mut gone = RunRecord::new(RunKey::new(t, "gone"), "agent");
        gone.state = RunState::Completed;
        let gone = put(s, gone, "F9");
        ok(s.delete_run(&gone.key, None), "F9: delete");
    }
    let i = InstanceKey::new(&ns, "i");
    let tray = |env: &str| super::helpers::tray(true, "doc", env);
    ok(
        s.write_tray(&i.tray("q", "1"), 1, tray(&env_a)),
        "F9: tray in a",
    );
    ok(
        s.write_tray(&i.tray("q", "2"), 1, tray(&env_b)),
        "F9: tray in b",
    );
    let want = vec!["run kept@1".to_string(), "-run gone".to_string()];
    for scope in [&ta, &tb] {
        let (got, _) = drain(s, scope, Position::START, 100, "F9");
        assert_eq!(kinds(&got), want, "F9: the feed of {scope}");
    }

    let of_a = handed_out(s, &ta, Position::START);
    let of_b = handed_out(s, &tb, Position::START);
    let of_trays = handed_out(s, &trays, trays_from);
    let of_ea = handed_out(s, &ea, Position::START);
    let of_eb = handed_out(s, &eb, Position::START);

    // Another tenant's, both ways.
    for &p in &of_a {
        refused(s, &tb, p, "a position of another tenant");
    }
    for &p in &of_b {
        refused(s, &ta, p, "a position of another tenant");
    }
    // The trays feed's on a tenant's, and a tenant's on the trays feed and
    // on an env's.
    for &p in of_trays.iter().chain(&of_ea) {
        refused(s, &ta, p, "a position of the trays feed");
    }
    for &p in &of_a {
        refused(s, &trays, p, "a position of a tenant's feed");
        refused(s, &ea, p, "a position of a tenant's feed");
    }
    // One env's on another env's, and on the whole trays feed (and the
    // other way): each is a feed of its own.
    for &p in &of_ea {
        refused(s, &eb, p, "a position of another env");
        refused(s, &trays, p, "a position of one env's feed");
    }
    for &p in &of_eb {
        refused(s, &ea, p, "a position of another env");
    }
    for &p in &of_trays {
        refused(s, &ea, p, "a position of the whole trays feed");
    }

    // Forged: hand-made numbers, a random one, real ones with a bit of
    // their tag (the top 32 bits) flipped. (A flipped bit below the tag
    // moves the position within its own feed: positions are ordered, so
    // the tag cannot depend on the place.)
    for scope in [&ta, &trays, &ea] {
        for n in [1u128, 2, 1 << 64, u128::MAX, random_u128()] {
            refused(s, scope, Position::from_u128(n), "a forged position");
        }
    }
    let real = of_a[0].as_u128();
    for bit in 96..128 {
        refused(
            s,
            &ta,
            Position::from_u128(real ^ (1 << bit)),
            "a position with a bit of its tag flipped",
        );
    }

    // Nothing was read, waited for or pruned: each feed is as it was.
    for scope in [&ta, &tb] {
        let (got, _) = drain(s, scope, Position::START, 100, "F9 after");
        assert_eq!(
            kinds(&got),
            want,
            "F9: refused positions changed nothing on {scope}"
        );
    }
    let (in_a, _) = drain(s, &ea, Position::START, 100, "F9 env a");
    assert_eq!(kinds(&in_a), vec!["tray i/1"], "F9: env a's feed");

    // START everywhere, and each scope's own positions on it.
    let c = FeedScope::tenant(unique("f9c"));
    for scope in [&ta, &tb, &trays, &ea, &eb, &c] {
        ok(
            s.changes(scope, Position::START, 1),
            format_args!("F9: START on {scope}"),
        );
    }
    for scope in [&eb, &c] {
        ok(
            s.wait_changes(scope, Position::START, 1, Duration::from_millis(50)),
            format_args!("F9: a wait from START on {scope}"),
        );
    }
    assert_eq!(
        ok(
            s.prune_changes(&c, Position::START),
            "F9: prune a tenant through START"
        ),
        0,
        "F9: nothing before START"
    );
    for (scope, own) in [(&ta, &of_a), (&tb, &of_b), (&ea, &of_ea), (&eb, &of_eb)] {
        for &p in own {
            ok(
                s.changes(scope, p, 10),
                format_args!("F9: {scope} after its own {p}"),
            );
            ok(
                s.wait_changes(scope, p, 10, Duration::from_millis(10)),
                format_args!("F9: {scope} waits after its own {p}"),
            );
        }
    }
    for &p in &of_trays {
        ok(
            s.changes(&trays, p, 10),
            format_args!("F9: trays after its own {p}"),
        );
    }

    // A horizon is a position of its own scope.
    let (got, _) = drain(s, &ta, Position::START, 100, "F9 prune");
    ok(s.prune_changes(&ta, got[1].position), "F9: prune a");
    let e = expect_err!(
        s.changes(&ta, Position::START, 100),
        StateError::FeedPruned { .. },
        "F9: a position before the horizon"
    );
    let StateError::FeedPruned { horizon, .. } = e else {
        unreachable!()
    };
    drain(s, &ta, horizon, 100, "F9: from the horizon");
    refused(s, &tb, horizon, "a horizon of another tenant");
    let (got, _) = drain(s, &tb, Position::START, 100, "F9 b after");
    assert_eq!(kinds(&got), want, "F9: b's feed is untouched");

    // Another store's, where the factory makes distinct stores (one that
    // hands out one shared store, as a server's may, is not asked).
    let other = open(make);
    let probe = RunKey::new(unique("f9p"), "probe");
    put(s, RunRecord::new(probe.clone(), "agent"), "F9");
    if ok(other.get_run(&probe), "F9: probe the second store").is_none() {
        put(
            &*other,
            RunRecord::new(RunKey::new(&a, "kept"), "agent"),
            "F9",
        );
        for &p in of_a.iter().chain(&of_b) {
            refused(&*other, &ta, p, "a position of another store");
        }
        for &p in &of_trays {
            refused(&*other, &trays, p, "a position of another store");
        }
        for &p in &of_ea {
            refused(&*other, &ea, p, "a position of another store");
        }
        let (got, _) = drain(&*other, &ta, Position::START, 100, "F9 other store");
        assert_eq!(
            kinds(&got),
            vec!["run kept@1"],
            "F9: the other store's feed"
        );
    }
}
