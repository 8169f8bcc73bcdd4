//! The helpers the rule families share: the store under test, fresh
//! names, result checks, reads and writes that name their rule, listing
//! walks that check every page (L3, K3), tray and alarm readers, writer
//! pacing and the racing-writers round (R3, S1).

use std::fmt::Display;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, OnceLock};
use std::time::{Duration, Instant};

use super::{ConformanceStore, Factory};
use agentstate_core::{
    Alarm, Cursor, InstanceKey, ManualClock, MarkedTray, Millis, Page, PageRequest, Result, RunKey,
    RunRecord, RunState, SessionKey, SessionRecord, StateError, StateQuery, ToolCall, Tray,
    TrayKey,
};

/// Where every check's manual clock starts (an ordinary 2023 timestamp, so
/// a backend that stores times as timestamps can hold it).
pub(super) const T0: Millis = 1_700_000_000_000;

/// The store under test and its clock.
pub(super) struct Ctx {
    pub(super) store: Arc<dyn ConformanceStore>,
    pub(super) clock: Arc<ManualClock>,
}

pub(super) fn open(make: Factory<'_>) -> Ctx {
    let clock = Arc::new(ManualClock::new(T0));
    let store = make(clock.clone());
    Ctx { store, clock }
}

/// A name no other check, process or run uses: the store may be shared.
pub(super) fn unique(tag: &str) -> String {
    static PREFIX: OnceLock<String> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let prefix = PREFIX.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        format!("{:x}{:x}", std::process::id(), nanos & 0xffff_ffff_ffff)
    });
    format!("cf{prefix}-{}-{tag}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// `base` rounds times the `AGENTSTATE_ROUNDS` multiplier (default 1).
pub(super) fn rounds(base: usize) -> usize {
    let m = std::env::var("AGENTSTATE_ROUNDS")
        .ok()
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|m| m.is_finite() && *m > 0.0)
        .unwrap_or(1.0);
    ((base as f64 * m).round() as usize).max(1)
}

#[track_caller]
pub(super) fn ok<T>(r: Result<T>, ctx: impl Display) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("{ctx}: expected Ok, got Err({e:?})"),
    }
}

/// Lower case, with `_`, `-` and `.` read as spaces: "run_id" and "run id"
/// name the same input.
fn norm(s: &str) -> String {
    s.chars()
        .map(|c| {
            if matches!(c, '_' | '-' | '.') {
                ' '
            } else {
                c.to_ascii_lowercase()
            }
        })
        .collect()
}

/// E6: an `Invalid` says which input; `inputs` are the acceptable names.
#[track_caller]
pub(super) fn assert_names(e: &StateError, inputs: &[&str], ctx: impl Display) {
    let StateError::Invalid { what } = e else {
        panic!("{ctx}: expected Invalid, got {e:?}");
    };
    let w = norm(what);
    assert!(
        inputs.iter().any(|i| w.contains(&norm(i))),
        "{ctx}: Invalid {{ what: {what:?} }} must name the input (one of {inputs:?}) and why"
    );
}

pub(super) fn get(s: &dyn ConformanceStore, k: &RunKey) -> Option<RunRecord> {
    ok(s.get_run(k), format_args!("get_run {k:?}"))
}

#[track_caller]
pub(super) fn must_get(s: &dyn ConformanceStore, k: &RunKey) -> RunRecord {
    get(s, k).unwrap_or_else(|| panic!("run {k:?} should exist"))
}

pub(super) fn get_session(s: &dyn ConformanceStore, k: &SessionKey) -> Option<SessionRecord> {
    ok(s.get_session(k), format_args!("get_session {k:?}"))
}

#[track_caller]
pub(super) fn create(s: &dyn ConformanceStore, r: RunRecord) -> RunRecord {
    let key = r.key.clone();
    ok(s.put_run(r), format_args!("creating run {key:?}"))
}

#[track_caller]
pub(super) fn create_session(s: &dyn ConformanceStore, k: &SessionKey) -> SessionRecord {
    ok(
        s.put_session(SessionRecord::new(k.clone())),
        format_args!("creating session {k:?}"),
    )
}

/// A new run in `state`.
pub(super) fn run_in(key: RunKey, agent: &str, state: RunState) -> RunRecord {
    let mut r = RunRecord::new(key, agent);
    r.state = state;
    r
}

/// Updates a run from what is stored now (`f` edits it); retries on
/// `Conflict`, since other threads may patch it meanwhile.
#[track_caller]
pub(super) fn update(
    s: &dyn ConformanceStore,
    k: &RunKey,
    f: impl Fn(&mut RunRecord),
) -> RunRecord {
    for _ in 0..10_000 {
        let mut r = must_get(s, k);
        f(&mut r);
        match s.put_run(r) {
            Ok(r) => return r,
            Err(StateError::Conflict { .. }) => continue,
            Err(e) => panic!("updating run {k:?}: {e:?}"),
        }
    }
    panic!("updating run {k:?}: 10,000 conflicts in a row")
}

/// Runs `f` on every item from 8 threads (so a group-committing store
/// shares its syncs) and returns the answers in item order.
pub(super) fn par_map<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    const WORKERS: usize = 8;
    let f = &f;
    let mut out: Vec<(usize, R)> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..WORKERS)
            .map(|w| {
                sc.spawn(move || {
                    (w..items.len())
                        .step_by(WORKERS)
                        .map(|i| (i, f(&items[i])))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| join(h.join())).collect()
    });
    out.sort_by_key(|(i, _)| *i);
    out.into_iter().map(|(_, r)| r).collect()
}

/// Creates runs from 8 threads; the answers in item order (their `seq`
/// order is whatever the store gave).
pub(super) fn create_many(s: &dyn ConformanceStore, recs: Vec<RunRecord>) -> Vec<RunRecord> {
    par_map(&recs, |r| create(s, r.clone()))
}

/// A scoped thread's result, re-raising its panic with its own message.
pub(super) fn join<T>(r: std::thread::Result<T>) -> T {
    r.unwrap_or_else(|p| std::panic::resume_unwind(p))
}

/// Calls `f`, turning a panic into a message: the suite reports "panicked"
/// instead of dying inside a worker thread (which could leave its partner
/// waiting at a barrier for ever).
pub(super) fn caught<T>(f: impl FnOnce() -> T) -> std::result::Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic".to_string())
    })
}

/// Walks a listing to its end, checking every page against L3 and K3:
/// at most `limit` items, no empty page that carries a cursor, and a walk
/// that ends. `between` runs after every page that carries a cursor.
pub(super) fn walk_with<T>(
    ctx: &str,
    limit: usize,
    mut fetch: impl FnMut(Option<&Cursor>) -> Result<Page<T>>,
    mut between: impl FnMut(),
) -> Vec<T> {
    let mut out = Vec::new();
    let mut cursor: Option<Cursor> = None;
    for page_no in 0.. {
        let page = ok(
            fetch(cursor.as_ref()),
            format_args!("{ctx}: page {page_no}"),
        );
        assert!(
            page.items().len() <= limit,
            "{ctx}: page {page_no} holds {} items, more than the limit {limit}",
            page.items().len()
        );
        assert!(
            !(page.items().is_empty() && page.cursor().is_some()),
            "{ctx}: page {page_no} is empty but carries a cursor (L3)"
        );
        let (items, next) = page.into_parts();
        out.extend(items);
        match next {
            None => return out,
            Some(c) => cursor = Some(c),
        }
        assert!(page_no < 200_000, "{ctx}: the walk does not end");
        between();
    }
    unreachable!()
}

pub(super) fn walk<T>(
    ctx: &str,
    limit: usize,
    fetch: impl FnMut(Option<&Cursor>) -> Result<Page<T>>,
) -> Vec<T> {
    walk_with(ctx, limit, fetch, || {})
}

/// Walks `list_runs` of `q` to its end, at the default page size.
pub(super) fn walk_runs(s: &dyn ConformanceStore, q: &StateQuery) -> Vec<RunRecord> {
    walk_runs_by(s, q, PageRequest::default().limit)
}

/// Walks `list_runs` of `q` to its end, `limit` runs a page.
pub(super) fn walk_runs_by(
    s: &dyn ConformanceStore,
    q: &StateQuery,
    limit: usize,
) -> Vec<RunRecord> {
    let ctx = format!("list_runs {q:?} limit {limit}");
    walk(&ctx, limit, |c| {
        s.list_runs(q, &PageRequest::new(limit).after(c))
    })
}

pub(super) fn keys(runs: &[RunRecord]) -> Vec<RunKey> {
    runs.iter().map(|r| r.key.clone()).collect()
}

pub(super) fn sorted<T: Ord + Clone>(v: &[T]) -> Vec<T> {
    let mut v = v.to_vec();
    v.sort();
    v
}

/// Runs sorted by `seq`: the order every run listing promises (L1).
pub(super) fn by_seq(mut runs: Vec<RunRecord>) -> Vec<RunRecord> {
    runs.sort_by_key(|r| r.seq);
    runs
}

pub(super) fn tray(marked: bool, doc: impl Into<Vec<u8>>, env: &str) -> Tray {
    Tray {
        marked,
        doc: doc.into(),
        env: env.to_string(),
        hostname: "host-1".to_string(),
    }
}

pub(super) fn read_tray(s: &dyn ConformanceStore, k: &TrayKey, epoch: u64) -> Option<Tray> {
    ok(
        s.read_tray(k, epoch),
        format_args!("read_tray {k:?} at epoch {epoch}"),
    )
}

pub(super) fn epoch_of(s: &dyn ConformanceStore, i: &InstanceKey) -> u64 {
    ok(s.epoch(i), format_args!("epoch {i:?}"))
}

/// An instance's stored epoch and every tray, read without moving the
/// epoch (every read carries the stored epoch).
pub(super) fn tray_state(s: &dyn ConformanceStore, i: &InstanceKey) -> (u64, Vec<(TrayKey, Tray)>) {
    let e = epoch_of(s, i);
    let trays = walk(&format!("list_trays {i:?}"), 1000, |c| {
        s.list_trays(i, e, &PageRequest::new(1000).after(c))
    });
    (e, trays)
}

/// All marked trays of `env` (or of every env) whose ns starts with
/// `ns_prefix`: the store may hold other checks' trays.
pub(super) fn marked_of(
    s: &dyn ConformanceStore,
    env: Option<&str>,
    ns_prefix: &str,
    limit: usize,
) -> Vec<MarkedTray> {
    let ctx = format!("marked_trays {env:?}");
    walk(&ctx, limit, |c| {
        s.marked_trays(env, &PageRequest::new(limit).after(c))
    })
    .into_iter()
    .filter(|m| m.key.ns.starts_with(ns_prefix))
    .collect()
}

/// The due alarms of instances whose ns starts with `ns_prefix`, in
/// listing order.
pub(super) fn due_of(
    s: &dyn ConformanceStore,
    now: Millis,
    ns_prefix: &str,
    limit: usize,
) -> Vec<Alarm> {
    let ctx = format!("due_alarms({now})");
    walk(&ctx, limit, |c| {
        s.due_alarms(now, &PageRequest::new(limit).after(c))
    })
    .into_iter()
    .filter(|a| a.instance.ns.starts_with(ns_prefix))
    .collect()
}

/// Runs its closure when dropped — also when the thread unwinds from a
/// failed check, so threads waiting on a flag it sets are never left
/// waiting (which would hang the test instead of failing it).
pub(super) struct OnDrop<F: FnMut()>(pub(super) F);

impl<F: FnMut()> Drop for OnDrop<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

/// Keeps writer threads in step with a walker: a writer makes at most
/// `per_page` writes per page the walker has read (so a walk whose
/// listing the writers keep growing still ends), and the walker waits
/// after each page until the writers have moved.
pub(super) struct Pace {
    pages: AtomicUsize,
    writes: AtomicUsize,
    stop: AtomicBool,
}

impl Pace {
    pub(super) fn new() -> Self {
        Pace {
            pages: AtomicUsize::new(0),
            writes: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
        }
    }

    /// Waits until a writer that has made `mine` writes may make another;
    /// false once the walk is over.
    pub(super) fn may_write(&self, mine: usize, per_page: usize) -> bool {
        loop {
            if self.stop.load(Ordering::SeqCst) {
                return false;
            }
            if mine < (self.pages.load(Ordering::SeqCst) + 1) * per_page {
                return true;
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// A writer made a write.
    pub(super) fn wrote(&self) {
        self.writes.fetch_add(1, Ordering::SeqCst);
    }

    /// The walker read a page: let the writers move, and wait (up to a
    /// quarter second) until they made `by` writes.
    pub(super) fn page_read(&self, by: usize) {
        let since = self.writes.load(Ordering::SeqCst);
        self.pages.fetch_add(1, Ordering::SeqCst);
        let deadline = Instant::now() + Duration::from_millis(250);
        while self.writes.load(Ordering::SeqCst) < since + by && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    pub(super) fn writes(&self) -> usize {
        self.writes.load(Ordering::SeqCst)
    }

    pub(super) fn finish(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

pub(super) fn tool_call(id: &str, arguments: &str) -> ToolCall {
    ToolCall {
        id: id.to_string(),
        name: "search".to_string(),
        arguments: arguments.to_string(),
    }
}

pub(super) fn alarm(i: &InstanceKey, due_at: Millis) -> Alarm {
    Alarm::new(i.clone(), due_at)
}

/// Races two writers per lane through `per_lane` rounds, in `lanes` lanes
/// at once (lanes share a group-committing store's syncs). Each round:
/// both create the same record, then both update it from version 1 with
/// their own label. Exactly one create and one update must win; the loser
/// gets `Conflict { 0, 1 }` and `Conflict { 1, 2 }`; the stored label is
/// the winner's.
// Every step of a round is a closure of the caller's; a struct for them
// would only be built to be taken apart here.
#[allow(clippy::too_many_arguments)]
pub(super) fn race_versions<K: Sync, R>(
    rule: &str,
    lanes: usize,
    per_lane: usize,
    key: impl Fn(usize, usize) -> K + Sync,
    create: impl Fn(&K) -> Result<u64> + Sync,
    read: impl Fn(&K) -> R + Sync,
    update: impl Fn(R, &str) -> Result<u64> + Sync,
    stored: impl Fn(&K) -> (u64, String),
) {
    type Outcome = std::result::Result<Result<u64>, String>;
    let (key, create, read, update) = (&key, &create, &read, &update);
    let label = |racer: usize| format!("racer-{racer}");
    let results: Vec<[Vec<(Outcome, Outcome)>; 2]> = std::thread::scope(|sc| {
        let lanes: Vec<_> = (0..lanes)
            .map(|lane| {
                let barrier = Arc::new(Barrier::new(2));
                let racers: Vec<_> = (0..2)
                    .map(|racer| {
                        let barrier = barrier.clone();
                        sc.spawn(move || {
                            let mut out = Vec::with_capacity(per_lane);
                            for round in 0..per_lane {
                                let k = key(lane, round);
                                barrier.wait();
                                let c = caught(|| create(&k));
                                // Both read version 1 before either updates.
                                barrier.wait();
                                let current = caught(|| read(&k));
                                barrier.wait();
                                let u = current.and_then(|c| caught(|| update(c, &label(racer))));
                                out.push((c, u));
                            }
                            out
                        })
                    })
                    .collect();
                racers
            })
            .collect();
        lanes
            .into_iter()
            .map(|racers| {
                let mut it = racers.into_iter().map(|h| join(h.join()));
                [it.next().expect("racer 0"), it.next().expect("racer 1")]
            })
            .collect()
    });
    for (lane, [a, b]) in results.iter().enumerate() {
        for (round, ((ca, ua), (cb, ub))) in a.iter().zip(b).enumerate() {
            let at = format!("{rule}: lane {lane} round {round}");
            let creates_ok = matches!(
                [ca, cb],
                [
                    Ok(Ok(1)),
                    Ok(Err(StateError::Conflict {
                        expected: 0,
                        actual: 1,
                        ..
                    }))
                ] | [
                    Ok(Err(StateError::Conflict {
                        expected: 0,
                        actual: 1,
                        ..
                    })),
                    Ok(Ok(1))
                ]
            );
            assert!(
                creates_ok,
                "{at}: racing creates must give exactly one Ok(version 1) and one Conflict {{ expected: 0, actual: 1 }}; got {ca:?} and {cb:?}"
            );
            let updates = [ua, ub];
            let winner = match updates {
                [
                    Ok(Ok(2)),
                    Ok(Err(StateError::Conflict {
                        expected: 1,
                        actual: 2,
                        ..
                    })),
                ] => 0,
                [
                    Ok(Err(StateError::Conflict {
                        expected: 1,
                        actual: 2,
                        ..
                    })),
                    Ok(Ok(2)),
                ] => 1,
                _ => panic!(
                    "{at}: racing updates from version 1 must give exactly one Ok(version 2) and one Conflict {{ expected: 1, actual: 2 }}; got {ua:?} and {ub:?}"
                ),
            };
            let k = key(lane, round);
            assert_eq!(
                stored(&k),
                (2, label(winner)),
                "{at}: the stored record is the winning update's"
            );
        }
    }
}
