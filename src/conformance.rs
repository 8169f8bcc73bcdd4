//! The public conformance suite: every numbered rule of the contract
//! (R runs, S sessions, L listings, X scrubbing, E errors, T trays, A alarms,
//! K limits) as one function that checks it against a backend.
//!
//! Enabled by the `conformance` feature. A backend is done when every
//! function in [`RULES`] passes against it; each panics with a message that
//! names the rule and what broke it.
//!
//! # Running the suite against your own backend
//!
//! Hand each rule a [`Factory`]: a function that builds your store over the
//! [`ManualClock`] it is given (the store must read `created_at` and
//! `updated_at` from that clock). One `#[test]` per rule keeps failures
//! named after their rule:
//!
//! ```
//! # fn main() {} // the tests below compile here; `cargo test` runs them
//! use std::sync::Arc;
//! use agentstate::conformance::ConformanceStore;
//! use agentstate::{ManualClock, MemoryStore, Options};
//!
//! fn factory(clock: Arc<ManualClock>) -> Arc<dyn ConformanceStore> {
//!     // Your backend here; it may hand out one shared store (say, one
//!     // PostgreSQL server) to every call: the checks never assume an
//!     // empty store.
//!     Arc::new(MemoryStore::with_options(Options::new().clock(clock)))
//! }
//!
//! macro_rules! conformance_tests {
//!     ($($rule:ident),* $(,)?) => {$(
//!         #[test]
//!         fn $rule() {
//!             agentstate::conformance::$rule(&factory)
//!         }
//!     )*};
//! }
//!
//! conformance_tests!(
//!     r1_run_key_names_every_read_and_write,
//!     r2_put_run_versions_and_conflicts,
//!     // … every function listed in `RULES`
//! );
//! ```
//!
//! Or walk [`RULES`] (each entry is `(rule id, check)`):
//!
//! ```
//! use std::sync::Arc;
//! use agentstate::conformance::{ConformanceStore, RULES};
//! use agentstate::{ManualClock, MemoryStore, Options};
//!
//! let factory = |clock: Arc<ManualClock>| -> Arc<dyn ConformanceStore> {
//!     Arc::new(MemoryStore::with_options(Options::new().clock(clock)))
//! };
//! for (id, check) in RULES.iter().filter(|(id, _)| id.starts_with('a')) {
//!     println!("checking {id}");
//!     check(&factory);
//! }
//! ```
//!
//! The concurrency rules (R3, R5, L2, T5, T6) run real threads for many
//! rounds; the environment variable `AGENTSTATE_ROUNDS` multiplies their
//! rounds (default 1; e.g. `AGENTSTATE_ROUNDS=10` for a soak run).
//!
//! Every check uses its own fresh tenants, session ids, instances and envs
//! (a process-wide counter behind a prefix made of the process id and the
//! time), so a store shared between checks, test processes or machines
//! works, and nothing assumes the store is otherwise empty.

// The example above shows a backend's `#[test]` functions; in the doctest
// they only compile, which is all it needs to show.
#![allow(clippy::test_attr_in_doctest)]

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt::Display;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, OnceLock};
use std::time::{Duration, Instant};

use crate::limits::{
    BATCH_OPS_MAX, ID_BYTES_MAX, PAGE_ITEMS_DEFAULT, PAGE_ITEMS_MAX, PENDING_TOOL_CALLS_MAX,
};
use crate::{
    Alarm, Approval, Cursor, InstanceKey, ManualClock, MarkedTray, Millis, Missing, Page,
    PersistenceReason, REDACTED, Result, RunKey, RunRecord, RunState, Scrubber, SessionKey,
    SessionRecord, StateDelta, StateError, StateQuery, StateStore, ToolCall, Tray, TrayKey, TrayOp,
    TrayStore, Usage,
};

/// What the suite needs of a backend: both store traits.
pub trait ConformanceStore: StateStore + TrayStore {}
impl<T: StateStore + TrayStore + ?Sized> ConformanceStore for T {}

/// Makes a store whose clock is the given manual clock.
///
/// The store may be shared with other checks (a PostgreSQL backend runs the
/// suite on one server): every check uses its own fresh tenants, ids,
/// instances and envs, and never assumes the store is otherwise empty.
pub type Factory<'a> = &'a dyn Fn(Arc<ManualClock>) -> Arc<dyn ConformanceStore>;

/// One rule check: panics, naming the rule, when the store breaks it.
pub type Check = for<'a> fn(Factory<'a>);

/// Every rule check, by rule id, in spec order (R, S, L, X, E, T, A, K).
pub const RULES: &[(&str, Check)] = &[
    ("r1", r1_run_key_names_every_read_and_write),
    ("r2", r2_put_run_versions_and_conflicts),
    ("r3", r3_racing_writers_exactly_one_wins),
    ("r4", r4_patch_adds_amounts_and_never_creates),
    ("r5", r5_patches_commute),
    ("r6", r6_put_never_moves_amounts),
    ("r7", r7_record_holds_what_resumes_a_run),
    ("r8", r8_run_session_must_exist),
    ("s1", s1_sessions_versioned_like_runs),
    ("s2", s2_delete_refuses_unfinished_runs),
    ("s3", s3_cascade_deletes_session_and_runs_atomically),
    ("s4", s4_session_runs_listed),
    ("l1", l1_list_runs_in_seq_order_with_filters),
    ("l2", l2_walk_sees_stable_records_exactly_once),
    ("l3", l3_last_page_has_no_cursor),
    ("l4", l4_updated_before_filters_never_orders),
    ("l5", l5_page_limit_and_default),
    ("l6", l6_cursor_bound_to_listing_and_untampered),
    ("x1", x1_every_write_stores_scrubbed_record),
    ("x2", x2_secret_keys_redacted),
    ("x3", x3_secret_shapes_redacted_anywhere),
    ("x4", x4_scrubbing_idempotent_no_secret_persists),
    ("e1", e1_conflict_not_retryable),
    ("e2", e2_not_found_names_what_is_missing),
    ("e3", e3_only_unavailable_is_retryable),
    ("e4", e4_in_use_names_every_blocking_run),
    ("e5", e5_fence_lost_carries_both_epochs),
    ("e6", e6_errors_change_nothing_and_invalid_says_what),
    ("t1", t1_tray_holds_marked_doc_env_hostname),
    ("t2", t2_epoch_fences_every_tray_operation),
    ("t3", t3_batch_all_or_nothing),
    ("t4", t4_release_unmarks_and_stale_release_is_noop),
    ("t5", t5_sweeper_pages_marked_trays_exactly_once),
    ("t6", t6_fence_check_and_write_are_atomic),
    ("a1", a1_one_alarm_per_instance),
    ("a2", a2_due_alarms_in_order),
    ("a3", a3_alarm_stays_due_until_acked),
    ("k1", k1_ids_are_1_to_256_bytes),
    ("k2", k2_records_and_docs_past_limit_too_large),
    ("k3", k3_page_limit_1_to_1000),
    ("k4", k4_batch_at_most_10000_ops),
    ("k5", k5_at_most_1024_pending_tool_calls),
    ("k6", k6_key_encoding_injective),
];

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

/// Where every check's manual clock starts (an ordinary 2023 timestamp, so
/// a backend that stores times as timestamps can hold it).
const T0: Millis = 1_700_000_000_000;

/// The store under test and its clock.
struct Ctx {
    store: Arc<dyn ConformanceStore>,
    clock: Arc<ManualClock>,
}

fn open(make: Factory<'_>) -> Ctx {
    let clock = Arc::new(ManualClock::new(T0));
    let store = make(clock.clone());
    Ctx { store, clock }
}

/// A name no other check, process or run uses: the store may be shared.
fn unique(tag: &str) -> String {
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
fn rounds(base: usize) -> usize {
    let m = std::env::var("AGENTSTATE_ROUNDS")
        .ok()
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|m| m.is_finite() && *m > 0.0)
        .unwrap_or(1.0);
    ((base as f64 * m).round() as usize).max(1)
}

#[track_caller]
fn ok<T>(r: Result<T>, ctx: impl Display) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("{ctx}: expected Ok, got Err({e:?})"),
    }
}

/// Checks that `$res` is an `Err` matching `$pat` and returns the error.
macro_rules! expect_err {
    ($res:expr, $pat:pat $(if $guard:expr)?, $($ctx:tt)+) => {{
        match $res {
            Ok(v) => panic!(
                "{}: expected Err({}), got Ok({:?})",
                format_args!($($ctx)+),
                stringify!($pat),
                v
            ),
            Err(e) => {
                if !matches!(e, $pat $(if $guard)?) {
                    panic!(
                        "{}: expected Err({}), got Err({:?})",
                        format_args!($($ctx)+),
                        stringify!($pat),
                        e
                    );
                }
                e
            }
        }
    }};
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
fn assert_names(e: &StateError, inputs: &[&str], ctx: impl Display) {
    let StateError::Invalid { what } = e else {
        panic!("{ctx}: expected Invalid, got {e:?}");
    };
    let w = norm(what);
    assert!(
        inputs.iter().any(|i| w.contains(&norm(i))),
        "{ctx}: Invalid {{ what: {what:?} }} must name the input (one of {inputs:?}) and why"
    );
}

fn get(s: &dyn ConformanceStore, k: &RunKey) -> Option<RunRecord> {
    ok(s.get_run(k), format_args!("get_run {k:?}"))
}

#[track_caller]
fn must_get(s: &dyn ConformanceStore, k: &RunKey) -> RunRecord {
    get(s, k).unwrap_or_else(|| panic!("run {k:?} should exist"))
}

fn get_session(s: &dyn ConformanceStore, k: &SessionKey) -> Option<SessionRecord> {
    ok(s.get_session(k), format_args!("get_session {k:?}"))
}

#[track_caller]
fn create(s: &dyn ConformanceStore, r: RunRecord) -> RunRecord {
    let key = r.key.clone();
    ok(s.put_run(r), format_args!("creating run {key:?}"))
}

#[track_caller]
fn create_session(s: &dyn ConformanceStore, k: &SessionKey) -> SessionRecord {
    ok(
        s.put_session(SessionRecord::new(k.clone())),
        format_args!("creating session {k:?}"),
    )
}

/// A new run in `state`.
fn run_in(key: RunKey, agent: &str, state: RunState) -> RunRecord {
    let mut r = RunRecord::new(key, agent);
    r.state = state;
    r
}

/// Updates a run from what is stored now (`f` edits it); retries on
/// `Conflict`, since other threads may patch it meanwhile.
#[track_caller]
fn update(s: &dyn ConformanceStore, k: &RunKey, f: impl Fn(&mut RunRecord)) -> RunRecord {
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
fn par_map<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
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
fn create_many(s: &dyn ConformanceStore, recs: Vec<RunRecord>) -> Vec<RunRecord> {
    par_map(&recs, |r| create(s, r.clone()))
}

/// A scoped thread's result, re-raising its panic with its own message.
fn join<T>(r: std::thread::Result<T>) -> T {
    r.unwrap_or_else(|p| std::panic::resume_unwind(p))
}

/// Calls `f`, turning a panic into a message: the suite reports "panicked"
/// instead of dying inside a worker thread (which could leave its partner
/// waiting at a barrier for ever).
fn caught<T>(f: impl FnOnce() -> T) -> std::result::Result<T, String> {
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
fn walk_with<T>(
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

fn walk<T>(
    ctx: &str,
    limit: usize,
    fetch: impl FnMut(Option<&Cursor>) -> Result<Page<T>>,
) -> Vec<T> {
    walk_with(ctx, limit, fetch, || {})
}

fn walk_runs(s: &dyn ConformanceStore, q: &StateQuery) -> Vec<RunRecord> {
    let ctx = format!("list_runs {q:?}");
    walk(&ctx, q.limit, |c| {
        s.list_runs(&q.clone().cursor(c.cloned()))
    })
}

fn keys(runs: &[RunRecord]) -> Vec<RunKey> {
    runs.iter().map(|r| r.key.clone()).collect()
}

fn sorted<T: Ord + Clone>(v: &[T]) -> Vec<T> {
    let mut v = v.to_vec();
    v.sort();
    v
}

/// Runs sorted by `seq`: the order every run listing promises (L1).
fn by_seq(mut runs: Vec<RunRecord>) -> Vec<RunRecord> {
    runs.sort_by_key(|r| r.seq);
    runs
}

fn tray(marked: bool, doc: impl Into<Vec<u8>>, env: &str) -> Tray {
    Tray {
        marked,
        doc: doc.into(),
        env: env.to_string(),
        hostname: "host-1".to_string(),
    }
}

fn read_tray(s: &dyn ConformanceStore, k: &TrayKey, epoch: u64) -> Option<Tray> {
    ok(
        s.read_tray(k, epoch),
        format_args!("read_tray {k:?} at epoch {epoch}"),
    )
}

fn epoch_of(s: &dyn ConformanceStore, i: &InstanceKey) -> u64 {
    ok(s.epoch(i), format_args!("epoch {i:?}"))
}

/// An instance's stored epoch and every tray, read without moving the
/// epoch (every read carries the stored epoch).
fn tray_state(s: &dyn ConformanceStore, i: &InstanceKey) -> (u64, Vec<(TrayKey, Tray)>) {
    let e = epoch_of(s, i);
    let trays = walk(&format!("list_trays {i:?}"), 1000, |c| {
        s.list_trays(i, e, 1000, c)
    });
    (e, trays)
}

/// All marked trays of `env` (or of every env) whose ns starts with
/// `ns_prefix`: the store may hold other checks' trays.
fn marked_of(
    s: &dyn ConformanceStore,
    env: Option<&str>,
    ns_prefix: &str,
    limit: usize,
) -> Vec<MarkedTray> {
    let ctx = format!("marked_trays {env:?}");
    walk(&ctx, limit, |c| s.marked_trays(env, limit, c))
        .into_iter()
        .filter(|m| m.key.ns.starts_with(ns_prefix))
        .collect()
}

/// The due alarms of instances whose ns starts with `ns_prefix`, in
/// listing order.
fn due_of(s: &dyn ConformanceStore, now: Millis, ns_prefix: &str, limit: usize) -> Vec<Alarm> {
    let ctx = format!("due_alarms({now})");
    walk(&ctx, limit, |c| s.due_alarms(now, limit, c))
        .into_iter()
        .filter(|a| a.instance.ns.starts_with(ns_prefix))
        .collect()
}

/// Runs its closure when dropped — also when the thread unwinds from a
/// failed check, so threads waiting on a flag it sets are never left
/// waiting (which would hang the test instead of failing it).
struct OnDrop<F: FnMut()>(F);

impl<F: FnMut()> Drop for OnDrop<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

/// Keeps writer threads in step with a walker: a writer makes at most
/// `per_page` writes per page the walker has read (so a walk whose
/// listing the writers keep growing still ends), and the walker waits
/// after each page until the writers have moved.
struct Pace {
    pages: AtomicUsize,
    writes: AtomicUsize,
    stop: AtomicBool,
}

impl Pace {
    fn new() -> Self {
        Pace {
            pages: AtomicUsize::new(0),
            writes: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
        }
    }

    /// Waits until a writer that has made `mine` writes may make another;
    /// false once the walk is over.
    fn may_write(&self, mine: usize, per_page: usize) -> bool {
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
    fn wrote(&self) {
        self.writes.fetch_add(1, Ordering::SeqCst);
    }

    /// The walker read a page: let the writers move, and wait (up to a
    /// quarter second) until they made `by` writes.
    fn page_read(&self, by: usize) {
        let since = self.writes.load(Ordering::SeqCst);
        self.pages.fetch_add(1, Ordering::SeqCst);
        let deadline = Instant::now() + Duration::from_millis(250);
        while self.writes.load(Ordering::SeqCst) < since + by && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    fn writes(&self) -> usize {
        self.writes.load(Ordering::SeqCst)
    }

    fn finish(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn tool_call(id: &str, arguments: &str) -> ToolCall {
    ToolCall {
        id: id.to_string(),
        name: "search".to_string(),
        arguments: arguments.to_string(),
    }
}

/// An id of exactly `ID_BYTES_MAX` bytes: `base`, then `fill` characters,
/// then ASCII to make up an odd remainder.
fn id_of_max_len(base: &str, fill: char) -> String {
    let mut s = base.to_string();
    while s.len() + fill.len_utf8() <= ID_BYTES_MAX {
        s.push(fill);
    }
    while s.len() < ID_BYTES_MAX {
        s.push('x');
    }
    s
}

// ---------------------------------------------------------------------------
// R — runs
// ---------------------------------------------------------------------------

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
            actual: 1
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
            actual: 2
        },
        "R2: updating from a stale version"
    );
    let mut ahead = v2.clone();
    ahead.version = 5;
    expect_err!(
        s.put_run(ahead),
        StateError::Conflict {
            expected: 5,
            actual: 2
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
            actual: 0
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
            actual: 0
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

/// Races two writers per lane through `per_lane` rounds, in `lanes` lanes
/// at once (lanes share a group-committing store's syncs). Each round:
/// both create the same record, then both update it from version 1 with
/// their own label. Exactly one create and one update must win; the loser
/// gets `Conflict { 0, 1 }` and `Conflict { 1, 2 }`; the stored label is
/// the winner's.
// Every step of a round is a closure of the caller's; a struct for them
// would only be built to be taken apart here.
#[allow(clippy::too_many_arguments)]
fn race_versions<K: Sync, R>(
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
                        actual: 1
                    }))
                ] | [
                    Ok(Err(StateError::Conflict {
                        expected: 0,
                        actual: 1
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
                    })),
                ] => 0,
                [
                    Ok(Err(StateError::Conflict {
                        expected: 1,
                        actual: 2,
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
        StateError::NotFound(Missing::Run(ref k)) if *k == missing,
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
        StateError::NotFound(Missing::Session(ref k)) if *k == SessionKey::new(&t, "sess"),
        "R8: creating a run in a missing session"
    );
    assert_eq!(get(s, &key), None, "R8/E6: the refused run was created");

    // A session of the same id in another tenant does not count.
    create_session(s, &SessionKey::new(&other, "sess"));
    expect_err!(
        s.put_run(RunRecord::new(key.clone(), "planner").with_session("sess")),
        StateError::NotFound(Missing::Session(ref k)) if *k == SessionKey::new(&t, "sess"),
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
        StateError::NotFound(Missing::Session(_)),
        "R8: creating a run in a deleted session"
    );
    assert_eq!(get(s, &late), None, "R8/E6: the refused run was created");
}

// ---------------------------------------------------------------------------
// S — sessions
// ---------------------------------------------------------------------------

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
            actual: 1
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
            actual: 2
        },
        "S1: updating from a stale version"
    );
    let mut ahead = v2.clone();
    ahead.version = 9;
    expect_err!(
        s.put_session(ahead),
        StateError::Conflict {
            expected: 9,
            actual: 2
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
            actual: 0
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
            actual: 0
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
    let StateError::InUse { runs: named } = e else {
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
    let StateError::InUse { runs: named } = e else {
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
        StateError::NotFound(Missing::Session(ref k)) if *k == sk,
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
        StateError::NotFound(Missing::Session(ref k)) if *k == sk,
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
            let got = walk_runs(s, &StateQuery::new(&t).session(sess).limit(limit));
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
        let got = walk_runs(
            s,
            &StateQuery::new(&t)
                .session(sess)
                .state(RunState::Running)
                .limit(2),
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

// ---------------------------------------------------------------------------
// L — listings
// ---------------------------------------------------------------------------

/// L1: `list_runs` pages a tenant's runs in `seq` order, filtered by state,
/// session and agent (alone and together).
pub fn l1_list_runs_in_seq_order_with_filters(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("l1");
    for sess in ["s1", "s2"] {
        create_session(s, &SessionKey::new(&t, sess));
    }
    let recs: Vec<RunRecord> = (0..42)
        .map(|i| {
            let r = run_in(
                RunKey::new(&t, format!("r{i:02}")),
                ["a1", "a2", "a3"][i % 3],
                RunState::ALL[i % 7],
            );
            match (i / 3) % 3 {
                0 => r,
                1 => r.with_session("s1"),
                _ => r.with_session("s2"),
            }
        })
        .collect();
    let mut created = create_many(s, recs);
    // A state change keeps a run's place in the listing (its seq).
    for r in created.iter_mut().step_by(4) {
        let k = r.key.clone();
        *r = update(s, &k, |r| r.state = RunState::Running);
    }
    // Another tenant's run with the same ids never shows.
    create(
        s,
        RunRecord::new(RunKey::new(unique("l1other"), "r00"), "a1"),
    );
    let all = by_seq(created);
    assert!(
        all.windows(2).all(|w| w[0].seq < w[1].seq),
        "L1: every run has its own seq"
    );

    type Filter = Box<dyn Fn(&RunRecord) -> bool>;
    let st = |x: RunState| move |r: &RunRecord| r.state == x;
    let queries: Vec<(StateQuery, Filter)> = vec![
        (StateQuery::new(&t), Box::new(|_| true)),
        (
            StateQuery::new(&t).state(RunState::Running),
            Box::new(st(RunState::Running)),
        ),
        (
            StateQuery::new(&t).state(RunState::Completed),
            Box::new(st(RunState::Completed)),
        ),
        (
            StateQuery::new(&t).agent("a2"),
            Box::new(|r| r.agent_name == "a2"),
        ),
        (
            StateQuery::new(&t).session("s1"),
            Box::new(|r| r.session_id.as_deref() == Some("s1")),
        ),
        (
            StateQuery::new(&t).state(RunState::Running).agent("a1"),
            Box::new(|r| r.state == RunState::Running && r.agent_name == "a1"),
        ),
        (
            StateQuery::new(&t).session("s2").agent("a3"),
            Box::new(|r| r.session_id.as_deref() == Some("s2") && r.agent_name == "a3"),
        ),
        (
            StateQuery::new(&t)
                .session("s1")
                .state(RunState::Running)
                .agent("a1"),
            Box::new(|r| {
                r.session_id.as_deref() == Some("s1")
                    && r.state == RunState::Running
                    && r.agent_name == "a1"
            }),
        ),
        (StateQuery::new(&t).agent("nobody"), Box::new(|_| false)),
    ];
    for (q, keep) in &queries {
        let want: Vec<RunRecord> = all.iter().filter(|r| keep(r)).cloned().collect();
        for limit in [1, 4, 1000] {
            let q = q.clone().limit(limit);
            let got = walk_runs(s, &q);
            assert_eq!(
                keys(&got),
                keys(&want),
                "L1: {q:?} lists the matching runs in seq order"
            );
            assert_eq!(got, want, "L1: {q:?} lists the stored records");
        }
    }
}

/// The kind of an L2 fixture run, from its id.
fn l2_kind(k: &RunKey) -> &str {
    k.run_id.split('-').next().unwrap_or("")
}

/// One L2 walk over a fresh tenant while three threads create, update and
/// delete its runs.
fn l2_walk(s: &dyn ConformanceStore, walk_no: usize, by_agent: bool) {
    let rule = format!(
        "L2 walk {walk_no} ({} filter)",
        if by_agent { "agent" } else { "state" }
    );
    let t = unique("l2");
    let doomed: Vec<SessionKey> = (0..5)
        .map(|i| SessionKey::new(&t, format!("doomed-{i}")))
        .collect();
    par_map(&doomed, |k| create_session(s, k));
    // Kinds: stable (Running, "keep"), volatile ("keep", state flips),
    // other (Running, "other"), finished (Completed, "other"), doomed
    // (Running, "keep", deleted with its session during the walk).
    let mut recs = Vec::new();
    for i in 0..40 {
        recs.push(run_in(
            RunKey::new(&t, format!("stable-{i}")),
            "keep",
            RunState::Running,
        ));
        if i < 20 {
            recs.push(run_in(
                RunKey::new(&t, format!("volatile-{i}")),
                "keep",
                RunState::Running,
            ));
            recs.push(run_in(
                RunKey::new(&t, format!("other-{i}")),
                "other",
                RunState::Running,
            ));
            recs.push(run_in(
                RunKey::new(&t, format!("finished-{i}")),
                "other",
                RunState::Completed,
            ));
            recs.push(
                run_in(
                    RunKey::new(&t, format!("doomed-{i}")),
                    "keep",
                    RunState::Running,
                )
                .with_session(format!("doomed-{}", i % 5)),
            );
        }
    }
    let before: HashSet<RunKey> = keys(&create_many(s, recs)).into_iter().collect();
    let of_kind = |kind: &str| -> Vec<RunKey> {
        let mut v: Vec<RunKey> = before
            .iter()
            .filter(|k| l2_kind(k) == kind)
            .cloned()
            .collect();
        v.sort();
        v
    };
    let (stable, volatile, other) = (of_kind("stable"), of_kind("volatile"), of_kind("other"));
    // What matches the filter for the whole walk, whatever the writers do.
    let must_see: Vec<RunKey> = stable
        .iter()
        .chain(if by_agent { &volatile } else { &other })
        .cloned()
        .collect();
    let q = if by_agent {
        StateQuery::new(&t).agent("keep")
    } else {
        StateQuery::new(&t).state(RunState::Running)
    }
    .limit(3);
    let matches = |r: &RunRecord| {
        if by_agent {
            r.agent_name == "keep"
        } else {
            r.state == RunState::Running
        }
    };
    let updated: Vec<RunKey> = stable.iter().chain(&other).cloned().collect();

    let pace = Pace::new();
    let (seen, made, ops) = std::thread::scope(|sc| {
        let pace = &pace;
        let creator = sc.spawn(|| {
            let mut made = Vec::new();
            let kinds = [
                ("keep", RunState::Running),
                ("keep", RunState::Paused),
                ("other", RunState::Running),
                ("other", RunState::Completed),
            ];
            for i in 0..400 {
                if !pace.may_write(i, 2) {
                    break;
                }
                let (agent, state) = kinds[i % kinds.len()];
                made.push(create(s, run_in(RunKey::new(&t, format!("new-{i}")), agent, state)).key);
                pace.wrote();
            }
            made
        });
        sc.spawn(|| {
            for i in 0.. {
                if !pace.may_write(i, 2) {
                    break;
                }
                let k = &updated[i % updated.len()];
                match i % 3 {
                    0 => {
                        update(s, k, |r| {
                            r.approval = Some(Approval {
                                id: format!("ap-{i}"),
                                prompt: "ok?".into(),
                            })
                        });
                    }
                    1 => {
                        ok(
                            s.patch_run(
                                k,
                                StateDelta {
                                    iterations: 1,
                                    ..Default::default()
                                },
                            ),
                            "L2: patch",
                        );
                    }
                    _ => {
                        let v = &volatile[i % volatile.len()];
                        update(s, v, |r| {
                            r.state = if r.state == RunState::Running {
                                RunState::Paused
                            } else {
                                RunState::Running
                            }
                        });
                    }
                }
                pace.wrote();
            }
        });
        sc.spawn(|| {
            // One session (four matching runs) every other page.
            for (n, sk) in doomed.iter().enumerate() {
                if !pace.may_write(n * 2 + 1, 1) {
                    break;
                }
                ok(s.delete_session(sk, true), "L2: cascade delete");
                pace.wrote();
            }
        });
        let _stop = OnDrop(|| pace.finish());
        let start = pace.writes();
        let seen = walk_with(
            &rule,
            q.limit,
            |c| s.list_runs(&q.clone().cursor(c.cloned())),
            || pace.page_read(2),
        );
        let ops = pace.writes() - start;
        pace.finish();
        (seen, join(creator.join()), ops)
    });
    assert!(
        ops > 0,
        "{rule}: the writers made no progress during the walk, so it tested nothing"
    );

    let made: HashSet<RunKey> = made.into_iter().collect();
    let mut count: HashMap<&RunKey, usize> = HashMap::new();
    for r in &seen {
        *count.entry(&r.key).or_default() += 1;
        assert!(
            before.contains(&r.key) || made.contains(&r.key),
            "{rule}: the walk returned a run never written: {:?}",
            r.key
        );
        assert!(
            matches(r),
            "{rule}: the walk returned {:?}, which does not match {q:?}",
            r.key
        );
    }
    let twice: Vec<_> = count.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.is_empty(),
        "{rule}: runs seen more than once in one walk: {twice:?}"
    );
    for k in &must_see {
        assert_eq!(
            count.get(k).copied().unwrap_or(0),
            1,
            "{rule}: {k:?} existed and matched during the whole walk, so it must be seen exactly once"
        );
    }
    assert!(
        seen.windows(2).all(|w| w[0].seq < w[1].seq),
        "{rule}: the walk is not in seq order: {:?}",
        seen.iter().map(|r| r.seq).collect::<Vec<_>>()
    );
    let last_old = seen.iter().rposition(|r| before.contains(&r.key));
    let first_new = seen.iter().position(|r| made.contains(&r.key));
    if let (Some(o), Some(n)) = (last_old, first_new) {
        assert!(
            n > o,
            "{rule}: a run created during the walk came before a run that existed at its start"
        );
    }
}

/// L2: walking the cursors visits every record that matched for the whole
/// walk exactly once, while other threads create, update and delete
/// records; records created during the walk appear at most once, after all
/// earlier ones.
pub fn l2_walk_sees_stable_records_exactly_once(make: Factory<'_>) {
    let c = open(make);
    for walk_no in 0..rounds(4).max(2) {
        l2_walk(&*c.store, walk_no, walk_no % 2 == 1);
    }
}

/// L3: the page that ends a walk has no cursor, an empty page never carries
/// one (`Page::new` refuses it), on every listing.
pub fn l3_last_page_has_no_cursor(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    assert!(Page::new(vec![1], None).is_ok(), "L3: a last page");
    assert!(
        Page::new(Vec::<u8>::new(), None).is_ok(),
        "L3: an empty last page"
    );
    assert!(
        Page::new(vec![1], Some(Cursor::from_text("00"))).is_ok(),
        "L3: a page with a cursor"
    );
    expect_err!(
        Page::new(Vec::<u8>::new(), Some(Cursor::from_text("00"))),
        StateError::Invalid { .. },
        "L3: an empty page with a cursor"
    );

    for n in [0usize, 1, 2, 3, 4, 6, 7] {
        let t = unique("l3");
        let recs: Vec<RunRecord> = (0..n)
            .map(|i| RunRecord::new(RunKey::new(&t, format!("r{i}")), "planner"))
            .collect();
        let all = keys(&by_seq(create_many(s, recs)));
        for limit in [1, 2, 3, 1000] {
            let got = walk_runs(s, &StateQuery::new(&t).limit(limit));
            assert_eq!(keys(&got), all, "L3: a walk of {n} runs, {limit} a page");
        }
        // A real cursor on an empty page is refused too.
        if n > 1 {
            let p = ok(s.list_runs(&StateQuery::new(&t).limit(1)), "L3: first page");
            let cur = p.cursor().cloned().expect("more runs follow");
            expect_err!(
                Page::new(Vec::<RunRecord>::new(), Some(cur)),
                StateError::Invalid { .. },
                "L3: an empty page with a real cursor"
            );
        }
    }

    // Trays, marked trays and alarms.
    for n in [0usize, 3, 6] {
        let ns = unique("l3ns");
        let env = unique("l3env");
        let inst = InstanceKey::new(&ns, "i");
        let ops: Vec<TrayOp> = (0..n)
            .map(|i| TrayOp::Put {
                tray_ns: "t".into(),
                tray_id: format!("{i}"),
                tray: tray(true, vec![i as u8], &env),
            })
            .collect();
        ok(s.apply_batch(&inst, 1, ops), "L3: batch");
        let trays = walk("L3: list_trays", 3, |c| s.list_trays(&inst, 1, 3, c));
        assert_eq!(trays.len(), n, "L3: list_trays walks all {n} trays");
        let marked = walk("L3: marked_trays", 3, |c| s.marked_trays(Some(&env), 3, c));
        assert_eq!(
            marked.len(),
            n,
            "L3: marked_trays walks all {n} marked trays"
        );
        for i in 0..n {
            ok(
                s.set_alarm(&InstanceKey::new(&ns, format!("a{i}")), 1, 7),
                "L3: set_alarm",
            );
        }
        let due = due_of(s, 7, &ns, 3);
        assert_eq!(due.len(), n, "L3: due_alarms walks all {n} due alarms");
    }
}

/// L4: `updated_before` filters (strictly before); it never orders — the
/// listing stays in `seq` order whatever the times.
pub fn l4_updated_before_filters_never_orders(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("l4");
    // The clock goes back and forth: updated_at is not seq order.
    let mk = |id: &str, at: Millis, state: RunState| {
        c.clock.set(T0 + at);
        create(s, run_in(RunKey::new(&t, id), "planner", state)).key
    };
    let a = mk("a", 5_000, RunState::Pending);
    let b = mk("b", 3_000, RunState::Running);
    let cc = mk("c", 9_000, RunState::Pending);
    let d = mk("d", 1_000, RunState::Pending);
    let list = |before: Millis, limit: usize| {
        keys(&walk_runs(
            s,
            &StateQuery::new(&t).updated_before(before).limit(limit),
        ))
    };
    for limit in [1, 2, 100] {
        assert_eq!(
            list(T0 + 5_000, limit),
            vec![b.clone(), d.clone()],
            "L4: before T0+5000, in seq order (not time order)"
        );
        assert_eq!(
            list(T0 + 5_001, limit),
            vec![a.clone(), b.clone(), d.clone()],
            "L4: before T0+5001"
        );
        assert_eq!(
            list(T0 + 1_000, limit),
            Vec::<RunKey>::new(),
            "L4: updated_before is strict"
        );
        assert_eq!(
            list(T0 + 1_001, limit),
            vec![d.clone()],
            "L4: before T0+1001"
        );
        assert_eq!(
            list(u64::MAX, limit),
            vec![a.clone(), b.clone(), cc.clone(), d.clone()],
            "L4: before the end of time"
        );
        assert_eq!(list(0, limit), Vec::<RunKey>::new(), "L4: before 0");
    }
    let q = StateQuery::new(&t)
        .state(RunState::Running)
        .updated_before(T0 + 5_000);
    assert_eq!(
        keys(&walk_runs(s, &q)),
        vec![b.clone()],
        "L4: with a state filter"
    );
    let q = StateQuery::new(&t)
        .state(RunState::Pending)
        .updated_before(T0 + 5_000)
        .limit(1);
    assert_eq!(
        keys(&walk_runs(s, &q)),
        vec![d.clone()],
        "L4: with a state filter"
    );

    // A write moves updated_at, and with it the filter's answer; never the order.
    c.clock.set(T0 + 10_000);
    update(s, &b, |r| r.state = RunState::Paused);
    assert_eq!(
        list(T0 + 5_000, 1),
        vec![d.clone()],
        "L4: b was written after T0+5000"
    );
    c.clock.set(T0 + 500);
    ok(
        s.patch_run(
            &a,
            StateDelta {
                iterations: 1,
                ..Default::default()
            },
        ),
        "L4: patch",
    );
    assert_eq!(
        list(T0 + 1_000, 1),
        vec![a.clone()],
        "L4: a patch sets updated_at from the clock"
    );
    assert_eq!(
        list(T0 + 5_000, 1),
        vec![a.clone(), d.clone()],
        "L4: seq order, not time order"
    );
}

/// L5: `limit` is 1..=1000, default 100; pages hold `limit` items while
/// more follow; an indexed filter finds its few runs among many others.
pub fn l5_page_limit_and_default(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("l5");
    assert_eq!(PAGE_ITEMS_DEFAULT, 100, "L5: the default page is 100 items");
    assert_eq!(
        StateQuery::new(&t).limit,
        100,
        "L5: StateQuery::new pages 100 at a time"
    );
    let recs: Vec<RunRecord> = (0..150)
        .map(|i| {
            let state = if i % 15 == 7 {
                RunState::Running
            } else {
                RunState::Completed
            };
            run_in(RunKey::new(&t, format!("r{i:03}")), "planner", state)
        })
        .collect();
    let all = by_seq(create_many(s, recs));
    let first = ok(
        s.list_runs(&StateQuery::new(&t)),
        "L5: first page, default limit",
    );
    assert_eq!(
        first.items().len(),
        100,
        "L5: a default page holds 100 runs when more follow"
    );
    assert!(
        first.cursor().is_some(),
        "L5: 50 more runs follow the first page"
    );
    assert_eq!(
        keys(&walk_runs(s, &StateQuery::new(&t))),
        keys(&all),
        "L5: default-limit walk"
    );
    assert_eq!(
        keys(&walk_runs(s, &StateQuery::new(&t).limit(PAGE_ITEMS_MAX))),
        keys(&all),
        "L5: a 1000-item page"
    );
    let running: Vec<RunKey> = all
        .iter()
        .filter(|r| r.state == RunState::Running)
        .map(|r| r.key.clone())
        .collect();
    assert_eq!(running.len(), 10, "L5: fixture");
    assert_eq!(
        keys(&walk_runs(
            s,
            &StateQuery::new(&t).state(RunState::Running).limit(4)
        )),
        running,
        "L5: a reaper's state query among finished runs"
    );
    let page = ok(
        s.list_runs(&StateQuery::new(&t).state(RunState::Running).limit(4)),
        "L5: first reaper page",
    );
    assert_eq!(
        page.items().len(),
        4,
        "L5: a filtered page holds `limit` runs when more match"
    );
    for limit in [0, PAGE_ITEMS_MAX + 1] {
        let e = expect_err!(
            s.list_runs(&StateQuery::new(&t).limit(limit)),
            StateError::Invalid { .. },
            "L5: limit {limit}"
        );
        assert_names(&e, &["limit"], format_args!("L5: limit {limit}"));
    }
}

/// Calls a listing with a cursor it must refuse: `Invalid`, never a panic,
/// never a page (which could hold another tenant's data).
#[track_caller]
fn assert_refused<T: std::fmt::Debug>(ctx: impl Display, f: impl FnOnce() -> Result<Page<T>>) {
    match caught(f) {
        Err(p) => {
            panic!("{ctx}: the store panicked ({p}) — L6: a bad cursor is Invalid, never a panic")
        }
        Ok(Ok(page)) => panic!(
            "{ctx}: accepted (a page of {} items: {:?}) — L6: a cursor of another tenant, filter or listing, or an altered one, is Invalid",
            page.items().len(),
            page.items().iter().take(3).collect::<Vec<_>>()
        ),
        Ok(Err(StateError::Invalid { .. })) => {}
        Ok(Err(e)) => panic!("{ctx}: expected Invalid, got {e:?}"),
    }
}

/// Altered versions of a cursor's text: every character flipped in turn,
/// truncations, extensions and garbage.
fn tampered(c: &Cursor) -> Vec<(String, Cursor)> {
    let chars: Vec<char> = c.as_str().chars().collect();
    let text = |cs: &[char]| cs.iter().collect::<String>();
    let mut out = Vec::new();
    for i in 0..chars.len() {
        let mut cs = chars.clone();
        cs[i] = if cs[i] == '0' { '1' } else { '0' };
        out.push((format!("char {i} flipped"), text(&cs)));
    }
    let n = chars.len();
    for (what, cs) in [
        ("last char cut", &chars[..n.saturating_sub(1)]),
        ("cut in half", &chars[..n / 2]),
        ("first char cut", &chars[n.min(1)..]),
        ("one char left", &chars[..n.min(1)]),
    ] {
        out.push((what.to_string(), text(cs)));
    }
    let whole = c.as_str();
    for (what, t) in [
        ("a char added", format!("{whole}0")),
        ("two chars added", format!("{whole}00")),
        ("doubled", format!("{whole}{whole}")),
        ("empty", String::new()),
        ("a space", " ".into()),
        ("padded", format!(" {whole} ")),
        ("garbage", "not a cursor".into()),
        ("non-hex", "zz".repeat(20)),
        ("non-ASCII", "é☃".repeat(10)),
        ("a NUL", "\0".into()),
        ("zeros", "0".repeat(64)),
        ("fs", "f".repeat(64)),
        ("JSON", "{}".into()),
        ("huge", "ab".repeat(100_000)),
    ] {
        out.push((what.to_string(), t));
    }
    out.into_iter()
        .filter(|(_, t)| t != whole)
        .map(|(w, t)| (w, Cursor::from_text(t)))
        .collect()
}

/// L6: a cursor is opaque and bound to its listing, tenant and filters;
/// with another tenant, other filters, another listing, or altered, it is
/// `Invalid` — never a panic, never another tenant's data.
pub fn l6_cursor_bound_to_listing_and_untampered(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let (ta, tb) = (unique("l6a"), unique("l6b"));
    for t in [&ta, &tb] {
        create_session(s, &SessionKey::new(t, "sa"));
        create_session(s, &SessionKey::new(t, "sb"));
        let recs: Vec<RunRecord> = (0..10)
            .map(|i| {
                RunRecord::new(RunKey::new(t, format!("r{i}")), "planner")
                    .with_session(["sa", "sb"][i % 2])
            })
            .collect();
        create_many(s, recs);
    }
    let qa = StateQuery::new(&ta).limit(3);
    let first = ok(s.list_runs(&qa), "L6: first page of tenant A");
    let cur = first
        .cursor()
        .cloned()
        .expect("L6: more runs follow the first page");
    let rest = ok(
        s.list_runs(&qa.clone().cursor(Some(cur.clone()))),
        "L6: the cursor continues its own listing",
    );
    let all_a = walk_runs(s, &qa);
    assert_eq!(
        keys(rest.items()),
        keys(&all_a[3..all_a.len().min(6)]),
        "L6: a cursor continues its listing where the page ended"
    );

    // Other tenant, other filters.
    let with = |q: StateQuery, c: &Cursor| q.cursor(Some(c.clone()));
    let others = [
        ("tenant B", StateQuery::new(&tb).limit(3)),
        (
            "a state filter",
            StateQuery::new(&ta).state(RunState::Pending).limit(3),
        ),
        (
            "an agent filter",
            StateQuery::new(&ta).agent("planner").limit(3),
        ),
        (
            "a session filter",
            StateQuery::new(&ta).session("sa").limit(3),
        ),
        (
            "an updated_before filter",
            StateQuery::new(&ta).updated_before(u64::MAX).limit(3),
        ),
    ];
    for (what, q) in &others {
        assert_refused(format_args!("L6: tenant A's cursor with {what}"), || {
            s.list_runs(&with(q.clone(), &cur))
        });
    }
    let filtered = StateQuery::new(&ta).state(RunState::Pending).limit(2);
    let fcur = ok(s.list_runs(&filtered), "L6: filtered first page")
        .cursor()
        .cloned()
        .expect("L6: more follow");
    for (what, q) in [
        ("no filter", StateQuery::new(&ta).limit(2)),
        (
            "another state",
            StateQuery::new(&ta).state(RunState::Running).limit(2),
        ),
        (
            "tenant B",
            StateQuery::new(&tb).state(RunState::Pending).limit(2),
        ),
    ] {
        assert_refused(
            format_args!("L6: a state-filtered cursor with {what}"),
            || s.list_runs(&with(q, &fcur)),
        );
    }
    let scur = ok(
        s.list_runs(&StateQuery::new(&ta).session("sa").limit(2)),
        "L6: session page",
    )
    .cursor()
    .cloned()
    .expect("L6: more follow");
    for (what, q) in [
        (
            "another session",
            StateQuery::new(&ta).session("sb").limit(2),
        ),
        ("no filter", StateQuery::new(&ta).limit(2)),
        (
            "tenant B's same session",
            StateQuery::new(&tb).session("sa").limit(2),
        ),
    ] {
        assert_refused(format_args!("L6: a session cursor with {what}"), || {
            s.list_runs(&with(q, &scur))
        });
    }

    // Trays, marked trays, alarms.
    let ns = unique("l6ns");
    let (env1, env2) = (unique("l6e1"), unique("l6e2"));
    let (i1, i2, i3) = (
        InstanceKey::new(&ns, "i1"),
        InstanceKey::new(&ns, "i2"),
        InstanceKey::new(&ns, "i3"),
    );
    for i in [&i1, &i2] {
        let ops = (0..6)
            .map(|n| TrayOp::Put {
                tray_ns: "t".into(),
                tray_id: format!("{n}"),
                tray: tray(false, "d", &env1),
            })
            .collect();
        ok(s.apply_batch(i, 1, ops), "L6: batch");
    }
    let ops = (0..12)
        .map(|n| TrayOp::Put {
            tray_ns: "m".into(),
            tray_id: format!("{n}"),
            tray: tray(true, "d", [&env1, &env2][n % 2]),
        })
        .collect();
    ok(s.apply_batch(&i3, 1, ops), "L6: marked batch");
    for n in 0..6 {
        ok(
            s.set_alarm(&InstanceKey::new(&ns, format!("alarm-{n}")), 1, 10 + n),
            "L6: set_alarm",
        );
    }
    let tcur = ok(s.list_trays(&i1, 1, 2, None), "L6: list_trays")
        .cursor()
        .cloned()
        .expect("L6: more trays follow");
    let mcur = ok(s.marked_trays(Some(&env1), 2, None), "L6: marked_trays")
        .cursor()
        .cloned()
        .expect("L6: more marked follow");
    let ncur = ok(s.marked_trays(None, 2, None), "L6: marked_trays(None)")
        .cursor()
        .cloned()
        .expect("L6: more marked follow");
    let acur = ok(s.due_alarms(20, 2, None), "L6: due_alarms")
        .cursor()
        .cloned()
        .expect("L6: more alarms follow");
    ok(
        s.list_trays(&i1, 1, 2, Some(&tcur)),
        "L6: a trays cursor continues its listing",
    );
    ok(
        s.marked_trays(Some(&env1), 2, Some(&mcur)),
        "L6: a marked cursor continues its listing",
    );
    ok(
        s.due_alarms(20, 2, Some(&acur)),
        "L6: an alarms cursor continues its listing",
    );

    assert_refused("L6: instance i1's trays cursor with i2", || {
        s.list_trays(&i2, 1, 2, Some(&tcur))
    });
    assert_refused("L6: env1's marked cursor with env2", || {
        s.marked_trays(Some(&env2), 2, Some(&mcur))
    });
    assert_refused("L6: env1's marked cursor with every env", || {
        s.marked_trays(None, 2, Some(&mcur))
    });
    assert_refused("L6: an every-env marked cursor with env1", || {
        s.marked_trays(Some(&env1), 2, Some(&ncur))
    });
    // Another listing.
    assert_refused("L6: a runs cursor on list_trays", || {
        s.list_trays(&i1, 1, 2, Some(&cur))
    });
    assert_refused("L6: a runs cursor on marked_trays", || {
        s.marked_trays(None, 2, Some(&cur))
    });
    assert_refused("L6: a runs cursor on due_alarms", || {
        s.due_alarms(20, 2, Some(&cur))
    });
    assert_refused("L6: a trays cursor on list_runs", || {
        s.list_runs(&with(qa.clone(), &tcur))
    });
    assert_refused("L6: a marked cursor on due_alarms", || {
        s.due_alarms(20, 2, Some(&mcur))
    });
    assert_refused("L6: an alarms cursor on marked_trays", || {
        s.marked_trays(Some(&env1), 2, Some(&acur))
    });
    assert_refused("L6: an alarms cursor on list_runs", || {
        s.list_runs(&with(qa.clone(), &acur))
    });

    // Altered cursors, on every listing.
    for (what, bad) in tampered(&cur) {
        assert_refused(format_args!("L6: runs cursor, {what}"), || {
            s.list_runs(&with(qa.clone(), &bad))
        });
        assert_refused(format_args!("L6: runs cursor, {what}, tenant B"), || {
            s.list_runs(&with(StateQuery::new(&tb).limit(3), &bad))
        });
    }
    for (what, bad) in tampered(&tcur) {
        assert_refused(format_args!("L6: trays cursor, {what}"), || {
            s.list_trays(&i1, 1, 2, Some(&bad))
        });
    }
    for (what, bad) in tampered(&mcur) {
        assert_refused(format_args!("L6: marked cursor, {what}"), || {
            s.marked_trays(Some(&env1), 2, Some(&bad))
        });
    }
    for (what, bad) in tampered(&acur) {
        assert_refused(format_args!("L6: alarms cursor, {what}"), || {
            s.due_alarms(20, 2, Some(&bad))
        });
    }
    // Nothing above moved anything.
    assert_eq!(
        walk_runs(s, &qa),
        all_a,
        "L6/E6: refused cursors changed tenant A's runs"
    );
    assert_eq!(
        epoch_of(s, &i1),
        1,
        "L6/E6: a refused trays cursor moved the epoch"
    );
}

// ---------------------------------------------------------------------------
// X — scrubbing
// ---------------------------------------------------------------------------

/// A GitHub token: `ghp_` and 36 letters and digits (built, not written
/// out, so secret scanners do not flag this file).
fn github_token() -> String {
    format!(
        "ghp_{}",
        "aB3dE5fG7hJ9kL1mN2pQ4rS6tU8vW0xY2zA4"
            .chars()
            .take(36)
            .collect::<String>()
    )
}

/// A Slack bot token.
fn slack_token() -> String {
    format!(
        "xoxb-{}-{}-{}",
        "123456789012", "1234567890123", "AbCdEfGhIjKlMnOpQrStUvWx"
    )
}

/// A JWT (the jwt.io example).
const JWT: &str = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4gRG9lIiwiaWF0IjoxNTE2MjM5MDIyfQ.SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c";

/// The body of a PEM private-key block.
const PEM_BODY: &str = "MIIEowIBAAKCAQEAu1SU1LfVLPHCozMxH2Mo4lgOEePzNm0tRgeLezV6ffAt0gun";

fn pem_block() -> String {
    format!(
        "-----BEGIN RSA PRIVATE KEY-----\n{PEM_BODY}\nVTLw7onLRnrq0IzW7yWR7QkrmBL7jTKEn5uqKhbwKfBstIsbMY2Zkp18gnTxK\n-----END RSA PRIVATE KEY-----"
    )
}

/// Secrets planted in tool-call arguments, and what must survive them.
struct Planted {
    /// The arguments, as JSON text.
    args: String,
    /// Substrings that must not be stored.
    secrets: Vec<String>,
    /// Substrings that must survive.
    keep: Vec<&'static str>,
}

fn planted() -> Planted {
    let ghp = github_token();
    let args = serde_json::json!({
        "password": "hunter2",
        "q": "Bearer abcdefghijklmnop.qrstuvwx",
        "k": "sk-abcdefghijklmnopqrstuvwxyz123456",
        "gh": ghp,
        "aws": "AKIAIOSFODNN7EXAMPLE",
        "jwt": JWT,
        "city": "Paris",
    })
    .to_string();
    Planted {
        args,
        secrets: vec![
            "hunter2".into(),
            "abcdefghijklmnop.qrstuvwx".into(),
            "sk-abcdefghijklmnopqrstuvwxyz123456".into(),
            ghp,
            "AKIAIOSFODNN7EXAMPLE".into(),
            JWT.into(),
            "SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c".into(),
        ],
        keep: vec!["Paris", "city"],
    }
}

/// X4: no stored argument holds a planted secret; the kept parts survive.
#[track_caller]
fn assert_clean(args: &str, secrets: &[String], keep: &[&str], ctx: impl Display) {
    for secret in secrets {
        assert!(
            !args.contains(secret.as_str()),
            "{ctx}: the store persisted the secret {secret:?} in {args:?} (X1–X4)"
        );
    }
    for k in keep {
        assert!(
            args.contains(k),
            "{ctx}: the non-secret {k:?} did not survive scrubbing: {args:?}"
        );
    }
}

/// Every tool call's arguments of `r`, as read from get_run and list_runs.
fn stored_arguments(s: &dyn ConformanceStore, k: &RunKey) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let r = must_get(s, k);
    out.extend(
        r.pending_tool_calls
            .iter()
            .map(|c| (format!("get_run {}", c.id), c.arguments.clone())),
    );
    for r in walk_runs(s, &StateQuery::new(&k.tenant))
        .iter()
        .filter(|r| r.key == *k)
    {
        out.extend(
            r.pending_tool_calls
                .iter()
                .map(|c| (format!("list_runs {}", c.id), c.arguments.clone())),
        );
    }
    out
}

/// X1: every write stores `record.scrubbed()`, never what it was handed:
/// creates and updates, as returned, read and listed.
pub fn x1_every_write_stores_scrubbed_record(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let p = planted();
    let key = RunKey::new(unique("x1"), "run");
    let mut rec = run_in(key.clone(), "planner", RunState::Running);
    rec.pending_tool_calls = vec![
        tool_call("json", &p.args),
        tool_call(
            "text",
            "token sk-abcdefghijklmnopqrstuvwxyz123456 from Paris, city",
        ),
    ];
    let v1 = create(s, rec.clone());
    let mut want = rec.scrubbed();
    (want.version, want.created_at, want.updated_at, want.seq) =
        (v1.version, v1.created_at, v1.updated_at, v1.seq);
    assert_eq!(v1, want, "X1: put_run returns record.scrubbed()");
    assert_eq!(
        get(s, &key).as_ref(),
        Some(&want),
        "X1: the store holds record.scrubbed()"
    );
    for call in &v1.pending_tool_calls {
        assert_clean(
            &call.arguments,
            &p.secrets,
            &p.keep,
            format_args!("X1: create, returned call {}", call.id),
        );
    }
    for (at, args) in stored_arguments(s, &key) {
        assert_clean(&args, &p.secrets, &p.keep, format_args!("X1: create, {at}"));
    }

    // An update that hands new secrets.
    let mut u = must_get(s, &key);
    u.pending_tool_calls.push(tool_call(
        "update",
        &format!(r#"{{"api_key":"{}","city":"Paris"}}"#, github_token()),
    ));
    let v2 = ok(s.put_run(u.clone()), "X1: update");
    let mut want = u.scrubbed();
    (want.version, want.updated_at) = (v2.version, v2.updated_at);
    assert_eq!(v2, want, "X1: an update stores record.scrubbed()");
    for (at, args) in stored_arguments(s, &key) {
        assert_clean(
            &args,
            &p.secrets,
            &["Paris"],
            format_args!("X1: update, {at}"),
        );
    }
    // A patch keeps the scrubbed arguments.
    ok(
        s.patch_run(
            &key,
            StateDelta {
                iterations: 1,
                ..Default::default()
            },
        ),
        "X1: patch",
    );
    for (at, args) in stored_arguments(s, &key) {
        assert_clean(
            &args,
            &p.secrets,
            &["Paris"],
            format_args!("X1: after a patch, {at}"),
        );
    }
}

/// X2: values under keys that name secrets become `"[REDACTED]"`, whatever
/// the key's case and separators, at any depth; other values survive.
pub fn x2_secret_keys_redacted(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let args = serde_json::json!({
        "password": "p-one",
        "PASSWORD": "p-two",
        "secret": "s-one",
        "Secret": 424242,
        "token": "t-one",
        "api_key": "k-one",
        "apiKey": "k-two",
        "API-KEY": "k-three",
        "Api Key": "k-four",
        "authorization": "Basic dXNlcjpwYXNz",
        "Authorization": "a-two",
        "credential": {"user": "u-one", "pass": "c-one"},
        "private_key": "pk-one",
        "privateKey": "pk-two",
        "access_key": "ak-one",
        "AccessKey": "ak-two",
        "cookie": "session=c-two",
        "Cookie": "c-three",
        "login": {"password": "p-three", "user": "bob"},
        "list": [{"token": "t-two"}, {"city": "Lyon"}],
        "city": "Paris",
        "count": 3,
        "note": "nothing to hide",
    })
    .to_string();
    let key = RunKey::new(unique("x2"), "run");
    let mut rec = RunRecord::new(key.clone(), "planner");
    rec.pending_tool_calls = vec![tool_call("c", &args)];
    create(s, rec);
    let secrets: Vec<String> = [
        "p-one",
        "p-two",
        "s-one",
        "424242",
        "t-one",
        "k-one",
        "k-two",
        "k-three",
        "k-four",
        "dXNlcjpwYXNz",
        "a-two",
        "u-one",
        "c-one",
        "pk-one",
        "pk-two",
        "ak-one",
        "ak-two",
        "c-two",
        "c-three",
        "p-three",
        "t-two",
    ]
    .map(String::from)
    .to_vec();
    let redacted_at = [
        "/password",
        "/PASSWORD",
        "/secret",
        "/Secret",
        "/token",
        "/api_key",
        "/apiKey",
        "/API-KEY",
        "/Api Key",
        "/authorization",
        "/Authorization",
        "/credential",
        "/private_key",
        "/privateKey",
        "/access_key",
        "/AccessKey",
        "/cookie",
        "/Cookie",
        "/login/password",
        "/list/0/token",
    ];
    let kept = [
        ("/city", serde_json::json!("Paris")),
        ("/count", serde_json::json!(3)),
        ("/note", serde_json::json!("nothing to hide")),
        ("/login/user", serde_json::json!("bob")),
        ("/list/1/city", serde_json::json!("Lyon")),
    ];
    for (at, stored) in stored_arguments(s, &key) {
        assert_clean(&stored, &secrets, &["Paris"], format_args!("X2: {at}"));
        let v: serde_json::Value = serde_json::from_str(&stored).unwrap_or_else(|e| {
            panic!("X2: {at}: scrubbed JSON arguments must stay JSON ({e}): {stored:?}")
        });
        for ptr in redacted_at {
            assert_eq!(
                v.pointer(ptr),
                Some(&serde_json::Value::String(REDACTED.to_string())),
                "X2: {at}: the value at {ptr:?} names a secret and must be {REDACTED:?}; stored {stored}"
            );
        }
        for (ptr, want) in &kept {
            assert_eq!(
                v.pointer(ptr),
                Some(want),
                "X2: {at}: the non-secret value at {ptr:?} must survive; stored {stored}"
            );
        }
    }
}

/// X3: secret-shaped strings are redacted anywhere in the arguments
/// (bearer tokens, `sk-` keys, GitHub and Slack tokens, AWS key ids, JWTs,
/// PEM private keys); arguments that are not JSON are scrubbed as text.
pub fn x3_secret_shapes_redacted_anywhere(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let (ghp, slack, pem) = (github_token(), slack_token(), pem_block());
    let json = serde_json::json!({
        "note": "call it with Bearer abcdefghijklmnop.qrstuvwx please",
        "list": ["sk-abcdefghijklmnopqrstuvwxyz123456", {"deep": [ghp]}],
        "aws": "the key AKIAIOSFODNN7EXAMPLE is here",
        "slack": slack,
        "header": JWT,
        "file": pem,
        "city": "Paris",
    })
    .to_string();
    let text = format!(
        "curl -H 'Authorization: Bearer abcdefghijklmnop.qrstuvwx' 'https://api.example.com/?k=sk-abcdefghijklmnopqrstuvwxyz123456' \
         AKIAIOSFODNN7EXAMPLE {slack} {ghp} {JWT} {pem} from Paris"
    );
    let secrets: Vec<String> = vec![
        "abcdefghijklmnop.qrstuvwx".into(),
        "sk-abcdefghijklmnopqrstuvwxyz123456".into(),
        ghp.clone(),
        "AKIAIOSFODNN7EXAMPLE".into(),
        slack.clone(),
        JWT.into(),
        "SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c".into(),
        PEM_BODY.into(),
    ];
    let key = RunKey::new(unique("x3"), "run");
    let mut rec = RunRecord::new(key.clone(), "planner");
    rec.pending_tool_calls = vec![tool_call("json", &json), tool_call("text", &text)];
    create(s, rec);
    for (at, stored) in stored_arguments(s, &key) {
        assert_clean(&stored, &secrets, &["Paris"], format_args!("X3: {at}"));
        assert!(
            stored.contains(REDACTED),
            "X3: {at}: redactions are marked {REDACTED:?}: {stored:?}"
        );
        if at.ends_with("json") {
            let v: std::result::Result<serde_json::Value, _> = serde_json::from_str(&stored);
            assert!(
                v.is_ok(),
                "X3: {at}: scrubbed JSON arguments must stay JSON: {stored:?}"
            );
        }
    }
}

/// X4: scrubbing is idempotent (scrubbing stored arguments changes nothing)
/// and the suite fails a store that persists a secret.
pub fn x4_scrubbing_idempotent_no_secret_persists(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let p = planted();
    // The default rules are what X4 names; `default()` stays right whatever
    // fields the scrubber grows.
    #[allow(clippy::default_constructed_unit_structs)]
    let scrubber = Scrubber::default();
    let inputs: Vec<String> = vec![
        p.args.clone(),
        format!(
            "Bearer abcdefghijklmnop.qrstuvwx and {} and {JWT}",
            github_token()
        ),
        pem_block(),
        String::new(),
        "{}".into(),
        "[]".into(),
        REDACTED.into(),
        format!("{REDACTED}{REDACTED}"),
        format!(r#"{{"password":"{REDACTED}","city":"Paris"}}"#),
        r#"{"password": {"nested": ["a", 1, null]}, "list": [[["token"]]]}"#.into(),
        r#"{"password":"unterminated"#.into(),
        "plain words, no secrets, ünïcödé ☃".into(),
        r#""just a JSON string with sk-abcdefghijklmnopqrstuvwxyz123456""#.into(),
    ];
    for input in &inputs {
        let once = scrubber.scrub_arguments(input);
        assert_eq!(
            scrubber.scrub_arguments(&once),
            once,
            "X4: scrubbing {input:?} twice differs from once"
        );
    }
    let key = RunKey::new(unique("x4"), "run");
    let mut rec = RunRecord::new(key.clone(), "planner");
    rec.pending_tool_calls = inputs
        .iter()
        .enumerate()
        .map(|(i, a)| tool_call(&format!("c{i}"), a))
        .collect();
    create(s, rec);
    let stored = must_get(s, &key);
    assert_eq!(
        stored.scrubbed(),
        stored,
        "X4: a stored run scrubs to itself"
    );
    for (at, args) in stored_arguments(s, &key) {
        assert_eq!(
            scrubber.scrub_arguments(&args),
            args,
            "X4: {at}: scrubbing stored arguments changes them"
        );
    }
    let (_, planted_args) = stored_arguments(s, &key)
        .into_iter()
        .find(|(at, _)| at == "get_run c0")
        .expect("call c0");
    assert_clean(&planted_args, &p.secrets, &p.keep, "X4: get_run c0");
    for (at, args) in stored_arguments(s, &key) {
        assert_clean(&args, &p.secrets, &[], format_args!("X4: {at}"));
    }
}

// ---------------------------------------------------------------------------
// E — errors
// ---------------------------------------------------------------------------

/// E1: `Conflict { expected, actual }` says the version moved; it is not
/// retryable as is (the same call fails the same way) — re-read, decide
/// again, and the write goes through.
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
                expected: 1,
                actual: 2
            },
            "E1: stale put, attempt {attempt}"
        );
        assert!(!e.is_retryable(), "E1: Conflict is not retryable");
        assert!(!e.to_string().is_empty(), "E1: a Conflict displays");
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
            expected: 1,
            actual: 2
        },
        "E1: stale session put"
    );
    assert!(!e.is_retryable(), "E1: Conflict is not retryable");
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
        StateError::NotFound(Missing::Run(ref k)) if *k == missing,
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
        StateError::NotFound(Missing::Session(ref k)) if *k == sk,
        "E2: a run in a missing session"
    );
    assert!(
        e.to_string().contains("no-such-session"),
        "E2: the message names the session: {e}"
    );
    assert_eq!(get(s, &run), None, "E2/E6: the refused run exists");
    let e = expect_err!(
        s.delete_session(&sk, true),
        StateError::NotFound(Missing::Session(ref k)) if *k == sk,
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
                expected: 1,
                actual: 2,
            },
            false,
        ),
        (
            StateError::NotFound(Missing::Run(RunKey::new("t", "r"))),
            false,
        ),
        (
            StateError::NotFound(Missing::Session(SessionKey::new("t", "s"))),
            false,
        ),
        (
            StateError::NotFound(Missing::Tray(InstanceKey::new("n", "i").tray("tn", "ti"))),
            false,
        ),
        (
            StateError::InUse {
                runs: vec![RunKey::new("t", "r")],
            },
            false,
        ),
        (
            StateError::FenceLost {
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

/// E4: `InUse { runs }` names every run that blocks a session delete, and
/// only those.
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
        StateError::InUse { .. },
        "E4: deleting a session with 24 unfinished runs"
    );
    assert!(!e.is_retryable(), "E4: InUse is not retryable");
    let StateError::InUse { runs: named } = e else {
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

/// E5: `FenceLost { caller, stored }` carries both epochs, for every tray
/// operation below the stored epoch.
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
                    caller: 3,
                    stored: 7
                },
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
    fenced!("list_trays", s.list_trays(&i, 3, 10, None));
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
            caller: 0,
            stored: 7
        },
        "E5: epoch 0"
    );
    assert!(
        e.to_string().contains('7') && e.to_string().contains('0'),
        "E5: the message carries both epochs: {e}"
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
        runs: walk_runs(s, &StateQuery::new(&t).limit(1)),
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
        s.list_trays(&i, 4, 10, None),
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
        s.list_trays(&i, 9, 0, None),
        Invalid { .. },
        ["limit"]
    );
    refused!(
        "list_runs with limit 0",
        s.list_runs(&StateQuery::new(&t).limit(0)),
        Invalid { .. },
        ["limit"]
    );
    refused!(
        "list_runs with a garbage cursor",
        s.list_runs(&StateQuery::new(&t).cursor(Some(Cursor::from_text("garbage")))),
        Invalid { .. },
        ["cursor"]
    );
    refused!(
        "marked_trays with limit 1001",
        s.marked_trays(Some(&env), 1001, None),
        Invalid { .. },
        ["limit"]
    );
    refused!(
        "due_alarms with limit 0",
        s.due_alarms(100, 0, None),
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

// ---------------------------------------------------------------------------
// T — trays, epochs and fencing
// ---------------------------------------------------------------------------

/// T1: a tray holds `marked`, the whole `doc` (any bytes), `env` and
/// `hostname`; a write replaces it whole; the sweeper sees marked trays.
pub fn t1_tray_holds_marked_doc_env_hostname(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let ns = unique("t1");
    let (env, env2) = (unique("t1env"), unique("t1env2"));
    let i = InstanceKey::new(&ns, "i");
    let k = i.tray("inbox", "1");
    let k2 = i.tray("outbox", "1");
    assert_eq!(
        read_tray(s, &k, 1),
        None,
        "T1: a tray never written reads None"
    );

    let doc: Vec<u8> = (0..65_536u32)
        .map(|n| (n.wrapping_mul(2_654_435_761) >> 13) as u8)
        .chain([0, 0xff, 0])
        .collect();
    let t1 = Tray {
        marked: true,
        doc,
        env: env.clone(),
        hostname: "host-a".into(),
    };
    ok(s.write_tray(&k, 1, t1.clone()), "T1: write");
    assert_eq!(
        read_tray(s, &k, 1).as_ref(),
        Some(&t1),
        "T1: a tray reads back whole"
    );
    assert_eq!(
        tray_state(s, &i).1,
        vec![(k.clone(), t1.clone())],
        "T1: list_trays holds the tray"
    );
    assert_eq!(
        marked_of(s, Some(&env), &ns, 10),
        vec![MarkedTray {
            key: k.clone(),
            env: env.clone(),
            hostname: "host-a".into()
        }],
        "T1: a marked tray is listed for the sweeper with its env and host"
    );

    let t2 = Tray {
        marked: false,
        doc: Vec::new(),
        env: env.clone(),
        hostname: "host-b".into(),
    };
    ok(s.write_tray(&k, 1, t2.clone()), "T1: overwrite");
    assert_eq!(
        read_tray(s, &k, 1).as_ref(),
        Some(&t2),
        "T1: a write replaces the whole tray (an empty doc too)"
    );
    assert!(
        marked_of(s, Some(&env), &ns, 10).is_empty(),
        "T1: an unmarked tray is not listed"
    );

    let t3 = Tray {
        marked: true,
        doc: b"moved".to_vec(),
        env: env2.clone(),
        hostname: "host-c".into(),
    };
    ok(s.write_tray(&k, 1, t3.clone()), "T1: marked in another env");
    assert!(
        marked_of(s, Some(&env), &ns, 10).is_empty(),
        "T1: a tray marked in env2 is not listed under env"
    );
    assert_eq!(
        marked_of(s, Some(&env2), &ns, 10),
        vec![MarkedTray {
            key: k.clone(),
            env: env2.clone(),
            hostname: "host-c".into()
        }],
        "T1: the sweeper sees the tray's current env and host"
    );
    assert_eq!(
        marked_of(s, None, &ns, 1000).len(),
        1,
        "T1: the all-env listing sees it once"
    );

    let other = tray(false, "other", &env);
    ok(s.write_tray(&k2, 1, other.clone()), "T1: a second tray");
    assert_eq!(
        read_tray(s, &k, 1).as_ref(),
        Some(&t3),
        "T1: trays of one instance are separate"
    );
    assert!(
        ok(s.delete_tray(&k, 1), "T1: delete"),
        "T1: deleting an existing tray says true"
    );
    assert_eq!(read_tray(s, &k, 1), None, "T1: a deleted tray reads None");
    assert!(
        !ok(s.delete_tray(&k, 1), "T1: delete again"),
        "T1: deleting a missing tray says false"
    );
    assert!(
        marked_of(s, None, &ns, 1000).is_empty(),
        "T1: a deleted tray is not listed as marked"
    );
    assert_eq!(
        tray_state(s, &i).1,
        vec![(k2.clone(), other)],
        "T1: only the other tray is left"
    );
}

/// T2: each instance has a stored epoch (0 when none); every tray operation
/// at or above it advances it and runs; below it, `FenceLost` and nothing
/// changes. Epochs are per instance, and `u64::MAX` is an epoch.
pub fn t2_epoch_fences_every_tray_operation(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let ns = unique("t2");
    let env = unique("t2env");
    let i = InstanceKey::new(&ns, "i");
    let k = i.tray("t", "1");
    assert_eq!(epoch_of(s, &i), 0, "T2: a new instance's epoch is 0");
    assert_eq!(
        read_tray(s, &k, 0),
        None,
        "T2: epoch 0 reads a new instance"
    );
    assert_eq!(
        epoch_of(s, &i),
        0,
        "T2: a read at the stored epoch keeps it"
    );

    // Each operation at a higher epoch advances it.
    type Step<'a> = (&'static str, u64, Box<dyn Fn(u64) -> Result<()> + 'a>);
    let steps: Vec<Step<'_>> = vec![
        (
            "write_tray",
            3,
            Box::new(|e| s.write_tray(&k, e, tray(true, "w", &env))),
        ),
        (
            "write_tray at the same epoch",
            3,
            Box::new(|e| s.write_tray(&k, e, tray(true, "w3", &env))),
        ),
        ("read_tray", 5, Box::new(|e| s.read_tray(&k, e).map(|_| ()))),
        (
            "delete_tray",
            6,
            Box::new(|e| s.delete_tray(&i.tray("t", "none"), e).map(|_| ())),
        ),
        (
            "apply_batch",
            7,
            Box::new(|e| {
                s.apply_batch(
                    &i,
                    e,
                    vec![TrayOp::Put {
                        tray_ns: "t".into(),
                        tray_id: "2".into(),
                        tray: tray(true, "b", &env),
                    }],
                )
            }),
        ),
        ("release", 8, Box::new(|e| s.release(&i, e))),
        (
            "list_trays",
            9,
            Box::new(|e| s.list_trays(&i, e, 10, None).map(|_| ())),
        ),
        ("set_alarm", 10, Box::new(|e| s.set_alarm(&i, e, 500))),
        (
            "ack_alarm",
            11,
            Box::new(|e| s.ack_alarm(&i, e, 1).map(|_| ())),
        ),
        (
            "an empty batch",
            12,
            Box::new(|e| s.apply_batch(&i, e, Vec::new())),
        ),
    ];
    for (what, e, op) in &steps {
        ok(op(*e), format_args!("T2: {what} at epoch {e}"));
        assert_eq!(
            epoch_of(s, &i),
            *e,
            "T2: {what} at epoch {e} advances the stored epoch"
        );
    }
    ok(
        s.write_tray(&k, 12, tray(true, "at 12", &env)),
        "T2: write at 12",
    );
    ok(s.set_alarm(&i, 12, 500), "T2: alarm at 12");
    // Below: FenceLost, nothing changes.
    let before = (
        tray_state(s, &i),
        due_of(s, 1_000, &ns, 100),
        marked_of(s, Some(&env), &ns, 100),
    );
    for (what, _, op) in &steps {
        if what.starts_with("release") {
            continue;
        }
        expect_err!(
            op(11),
            StateError::FenceLost {
                caller: 11,
                stored: 12
            },
            "T2: {what} at epoch 11 after 12"
        );
        assert_eq!(
            (
                tray_state(s, &i),
                due_of(s, 1_000, &ns, 100),
                marked_of(s, Some(&env), &ns, 100)
            ),
            before,
            "T2/E6: a fenced {what} changed the instance"
        );
    }

    // Epochs are per instance: same ns other id, same id other ns, and
    // look-alike ids are untouched.
    for other in [
        InstanceKey::new(&ns, "i2"),
        InstanceKey::new(format!("{ns}x"), "i"),
        InstanceKey::new(&ns, "i\0"),
    ] {
        assert_eq!(
            epoch_of(s, &other),
            0,
            "T2: {other:?} shares no epoch with {i:?}"
        );
        ok(
            s.write_tray(&other.tray("t", "1"), 1, tray(false, "o", &env)),
            "T2: another instance at epoch 1",
        );
    }
    // Trays of one instance share its epoch.
    expect_err!(
        s.write_tray(&i.tray("other-ns", "x"), 11, tray(false, "x", &env)),
        StateError::FenceLost {
            caller: 11,
            stored: 12
        },
        "T2: another tray of the instance at an older epoch"
    );

    // The top of the range.
    ok(
        s.write_tray(&k, u64::MAX, tray(false, "max", &env)),
        "T2: epoch u64::MAX",
    );
    assert_eq!(epoch_of(s, &i), u64::MAX, "T2: the epoch is u64::MAX");
    ok(
        s.write_tray(&k, u64::MAX, tray(false, "max again", &env)),
        "T2: u64::MAX again",
    );
    expect_err!(
        s.write_tray(&k, u64::MAX - 1, tray(false, "x", &env)),
        StateError::FenceLost { caller, stored: u64::MAX } if caller == u64::MAX - 1,
        "T2: below u64::MAX"
    );
    assert_eq!(
        read_tray(s, &k, u64::MAX).map(|t| t.doc),
        Some(b"max again".to_vec()),
        "T2: the last write at u64::MAX"
    );
}

/// T3: a batch applies all its writes and deletes atomically with one
/// fence check — all or nothing, and a reader never sees part of it.
pub fn t3_batch_all_or_nothing(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let ns = unique("t3");
    let env = unique("t3env");
    let i = InstanceKey::new(&ns, "i");
    let put = |id: &str, doc: &str, marked: bool| TrayOp::Put {
        tray_ns: "t".into(),
        tray_id: id.into(),
        tray: tray(marked, doc, &env),
    };
    let del = |id: &str| TrayOp::Delete {
        tray_ns: "t".into(),
        tray_id: id.into(),
    };
    let docs = |s: &dyn ConformanceStore| -> BTreeMap<String, Vec<u8>> {
        tray_state(s, &i)
            .1
            .into_iter()
            .map(|(k, t)| (k.tray_id, t.doc))
            .collect()
    };
    ok(
        s.apply_batch(&i, 1, vec![put("a", "a0", false), put("b", "b0", true)]),
        "T3: first batch",
    );
    ok(
        s.apply_batch(
            &i,
            1,
            vec![
                put("c", "c1", true),
                del("a"),
                put("b", "b1", false),
                del("never"),
            ],
        ),
        "T3: mixed batch",
    );
    let want: BTreeMap<String, Vec<u8>> = [
        ("b".to_string(), b"b1".to_vec()),
        ("c".to_string(), b"c1".to_vec()),
    ]
    .into();
    assert_eq!(docs(s), want, "T3: a batch applies every write and delete");
    assert_eq!(
        marked_of(s, Some(&env), &ns, 10)
            .into_iter()
            .map(|m| m.key.tray_id)
            .collect::<Vec<_>>(),
        vec!["c".to_string()],
        "T3: a batch keeps the sweeper's listing in step"
    );

    // Refused batches apply nothing, and move no epoch.
    let before = (tray_state(s, &i), marked_of(s, Some(&env), &ns, 10));
    let big = TrayOp::Put {
        tray_ns: "t".into(),
        tray_id: "big".into(),
        tray: tray(false, vec![1u8; 1_100_000], &env),
    };
    expect_err!(
        s.apply_batch(&i, 2, vec![put("d", "d", true), del("b"), big]),
        StateError::Persistence {
            reason: PersistenceReason::TooLarge,
            ..
        },
        "T3: a batch whose last op is too large"
    );
    assert_eq!(
        (tray_state(s, &i), marked_of(s, Some(&env), &ns, 10)),
        before,
        "T3: a refused batch applied part of itself"
    );
    expect_err!(
        s.apply_batch(
            &i,
            2,
            vec![
                put("d", "d", true),
                del("b"),
                put(&"x".repeat(257), "x", false)
            ]
        ),
        StateError::Invalid { .. },
        "T3: a batch whose last op has a bad id"
    );
    assert_eq!(
        (tray_state(s, &i), marked_of(s, Some(&env), &ns, 10)),
        before,
        "T3: a refused batch applied part of itself"
    );
    ok(
        s.write_tray(&i.tray("t", "c"), 3, tray(true, "c3", &env)),
        "T3: epoch 3",
    );
    let before = (tray_state(s, &i), marked_of(s, Some(&env), &ns, 10));
    expect_err!(
        s.apply_batch(&i, 2, vec![put("d", "d", true), del("b")]),
        StateError::FenceLost {
            caller: 2,
            stored: 3
        },
        "T3: a fenced batch"
    );
    assert_eq!(
        (tray_state(s, &i), marked_of(s, Some(&env), &ns, 10)),
        before,
        "T3: a fenced batch applied part of itself"
    );

    // Ops apply in order: the last write of a tray wins.
    ok(
        s.apply_batch(
            &i,
            3,
            vec![
                put("x", "1", false),
                put("x", "2", false),
                put("y", "1", false),
                del("y"),
            ],
        ),
        "T3: ordered ops",
    );
    assert_eq!(
        read_tray(s, &i.tray("t", "x"), 3).map(|t| t.doc),
        Some(b"2".to_vec()),
        "T3: the later write of a tray wins"
    );
    assert_eq!(
        read_tray(s, &i.tray("t", "y"), 3),
        None,
        "T3: a delete after a write deletes"
    );

    // A reader never sees part of a batch: each batch writes one
    // generation to every tray, so trays read one after another (in
    // either order) show generations that never go back.
    let j = InstanceKey::new(&ns, "gen");
    let n = 8usize;
    let gen_batch = |g: u64| {
        (0..n)
            .map(|t| TrayOp::Put {
                tray_ns: "g".into(),
                tray_id: t.to_string(),
                tray: tray(false, g.to_be_bytes(), &env),
            })
            .collect::<Vec<_>>()
    };
    ok(s.apply_batch(&j, 1, gen_batch(0)), "T3: generation 0");
    let gens = rounds(150) as u64;
    let done = AtomicBool::new(false);
    let read_gen = |t: usize| -> u64 {
        let doc = read_tray(s, &j.tray("g", t.to_string()), 1)
            .expect("generation tray exists")
            .doc;
        u64::from_be_bytes(doc.try_into().expect("8-byte generation"))
    };
    std::thread::scope(|sc| {
        let reader = sc.spawn(|| {
            let mut passes = 0u64;
            while !done.load(Ordering::SeqCst) || passes == 0 {
                let order: Vec<usize> = (0..n).chain((0..n).rev()).collect();
                let seen: Vec<u64> = order.iter().map(|t| read_gen(*t)).collect();
                assert!(
                    seen.windows(2).all(|w| w[0] <= w[1]),
                    "T3: a reader saw part of a batch (trays {order:?} read generations {seen:?})"
                );
                passes += 1;
            }
        });
        let _done = OnDrop(|| done.store(true, Ordering::SeqCst));
        for g in 1..=gens {
            ok(
                s.apply_batch(&j, 1, gen_batch(g)),
                format_args!("T3: generation {g}"),
            );
        }
        done.store(true, Ordering::SeqCst);
        join(reader.join());
    });
    assert!(
        (0..n).all(|t| read_gen(t) == gens),
        "T3: every tray holds the last generation"
    );
}

/// T4: `release` unmarks the instance's trays (and only its); a release
/// with an older epoch is a no-op, not an error.
pub fn t4_release_unmarks_and_stale_release_is_noop(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let ns = unique("t4");
    let env = unique("t4env");
    let (i, other) = (InstanceKey::new(&ns, "i"), InstanceKey::new(&ns, "other"));
    let fill = |inst: &InstanceKey, e: u64| {
        let ops = (0..5)
            .map(|n| TrayOp::Put {
                tray_ns: "t".into(),
                tray_id: n.to_string(),
                tray: tray(n != 4, format!("doc-{n}"), &env),
            })
            .collect();
        ok(s.apply_batch(inst, e, ops), "T4: fill");
    };
    fill(&i, 5);
    fill(&other, 1);
    assert_eq!(marked_of(s, Some(&env), &ns, 100).len(), 8, "T4: fixture");

    // An older placement's release: Ok, and nothing changes.
    let before = (tray_state(s, &i), marked_of(s, Some(&env), &ns, 100));
    ok(
        s.release(&i, 4),
        "T4: release at an older epoch is not an error",
    );
    assert_eq!(
        (tray_state(s, &i), marked_of(s, Some(&env), &ns, 100)),
        before,
        "T4: an older release changed the instance"
    );
    ok(s.release(&i, 0), "T4: release at epoch 0");
    assert_eq!(
        (tray_state(s, &i), marked_of(s, Some(&env), &ns, 100)),
        before,
        "T4: an older release changed the instance"
    );

    // The current placement's release unmarks, and keeps the docs.
    ok(s.release(&i, 5), "T4: release at the stored epoch");
    let (e, trays) = tray_state(s, &i);
    assert_eq!(e, 5, "T4: a release at the stored epoch keeps it");
    assert_eq!(trays.len(), 5, "T4: a release deletes no tray");
    for (k, t) in &trays {
        assert!(!t.marked, "T4: {k:?} is still marked after release");
        assert_eq!(
            t.doc,
            format!("doc-{}", k.tray_id).into_bytes(),
            "T4: a release keeps the doc"
        );
        assert_eq!(t.env, env, "T4: a release keeps the env");
    }
    let left: Vec<InstanceKey> = marked_of(s, Some(&env), &ns, 100)
        .iter()
        .map(|m| m.key.instance())
        .collect();
    assert_eq!(
        left,
        vec![other.clone(); 4],
        "T4: only the other instance's trays are still marked"
    );

    // A newer release advances the epoch, and fences the old holder.
    fill(&i, 5);
    ok(s.release(&i, 8), "T4: release at a newer epoch");
    assert_eq!(epoch_of(s, &i), 8, "T4: a newer release advances the epoch");
    assert!(
        tray_state(s, &i).1.iter().all(|(_, t)| !t.marked),
        "T4: a newer release unmarks"
    );
    expect_err!(
        s.write_tray(&i.tray("t", "0"), 5, tray(true, "late", &env)),
        StateError::FenceLost {
            caller: 5,
            stored: 8
        },
        "T4: the old holder after a newer release"
    );
    ok(
        s.release(&InstanceKey::new(&ns, "empty"), 1),
        "T4: releasing an instance with no trays",
    );
}

/// One T5 walk over a fresh env while three threads mark and unmark other
/// trays of that env.
fn t5_walk(s: &dyn ConformanceStore, walk_no: usize, all_envs: bool) {
    let rule = format!(
        "T5 walk {walk_no} ({})",
        if all_envs { "every env" } else { "one env" }
    );
    let ns = unique("t5");
    let (env, env2) = (unique("t5env"), unique("t5env2"));
    let stable: Vec<InstanceKey> = (0..4)
        .map(|n| InstanceKey::new(&ns, format!("stable-{n}")))
        .collect();
    let churn: Vec<InstanceKey> = (0..3)
        .map(|n| InstanceKey::new(&ns, format!("churn-{n}")))
        .collect();
    let mk = |marked: bool, env: &str, host: &str| Tray {
        marked,
        doc: b"doc".to_vec(),
        env: env.into(),
        hostname: host.into(),
    };
    par_map(&stable, |i| {
        let mut ops: Vec<TrayOp> = (0..6)
            .map(|n| TrayOp::Put {
                tray_ns: "m".into(),
                tray_id: n.to_string(),
                tray: mk(true, &env, "h-stable"),
            })
            .collect();
        ops.extend((0..2).map(|n| TrayOp::Put {
            tray_ns: "u".into(),
            tray_id: n.to_string(),
            tray: mk(false, &env, "h-stable"),
        }));
        ops.push(TrayOp::Put {
            tray_ns: "e2".into(),
            tray_id: "0".into(),
            tray: mk(true, &env2, "h-stable"),
        });
        ok(s.apply_batch(i, 1, ops), "T5: stable trays");
    });
    let churn_trays = |i: &InstanceKey| {
        (0..6)
            .map(|n| i.tray("c", n.to_string()))
            .collect::<Vec<_>>()
    };
    let mut must_see: Vec<TrayKey> = stable
        .iter()
        .flat_map(|i| (0..6).map(move |n| i.tray("m", n.to_string())))
        .collect();
    if all_envs {
        must_see.extend(stable.iter().map(|i| i.tray("e2", "0")));
    }
    let may_see: HashSet<TrayKey> = must_see
        .iter()
        .cloned()
        .chain(churn.iter().flat_map(churn_trays))
        .collect();

    let pace = Pace::new();
    let limit = 3;
    let (seen, ops) = std::thread::scope(|sc| {
        let (pace, churn, env, env2) = (&pace, &churn, &env, &env2);
        // Marks and unmarks single trays.
        sc.spawn(move || {
            for n in 0.. {
                if !pace.may_write(n, 2) {
                    break;
                }
                let k = churn[0].tray("c", (n % 6).to_string());
                ok(
                    s.write_tray(&k, 1, mk((n / 6) % 2 == 0, env, "h-churn")),
                    "T5: churn write",
                );
                pace.wrote();
            }
        });
        // Marks and unmarks whole batches, sometimes into the other env.
        sc.spawn(move || {
            for n in 0.. {
                if !pace.may_write(n, 1) {
                    break;
                }
                let e = if n % 4 == 1 { env2 } else { env };
                let ops = (0..6)
                    .map(|t| TrayOp::Put {
                        tray_ns: "c".into(),
                        tray_id: t.to_string(),
                        tray: mk(n % 2 == 0, e, "h-churn"),
                    })
                    .collect();
                ok(s.apply_batch(&churn[1], 1, ops), "T5: churn batch");
                pace.wrote();
            }
        });
        // Marks everything, then releases.
        sc.spawn(move || {
            for n in 0.. {
                if !pace.may_write(n, 1) {
                    break;
                }
                if n % 2 == 0 {
                    let ops = (0..6)
                        .map(|t| TrayOp::Put {
                            tray_ns: "c".into(),
                            tray_id: t.to_string(),
                            tray: mk(true, env, "h-churn"),
                        })
                        .collect();
                    ok(s.apply_batch(&churn[2], 1, ops), "T5: churn mark");
                } else {
                    ok(s.release(&churn[2], 1), "T5: churn release");
                }
                pace.wrote();
            }
        });
        let filter = if all_envs { None } else { Some(env.as_str()) };
        let _stop = OnDrop(|| pace.finish());
        let start = pace.writes();
        let seen = walk_with(
            &rule,
            limit,
            |c| s.marked_trays(filter, limit, c),
            || pace.page_read(2),
        );
        let ops = pace.writes() - start;
        pace.finish();
        (seen, ops)
    });
    assert!(
        ops > 0,
        "{rule}: the churn threads made no progress during the walk, so it tested nothing"
    );
    let ours: Vec<&MarkedTray> = seen.iter().filter(|m| m.key.ns == ns).collect();
    let mut count: HashMap<&TrayKey, usize> = HashMap::new();
    for m in &ours {
        *count.entry(&m.key).or_default() += 1;
        assert!(
            may_see.contains(&m.key),
            "{rule}: listed a tray that was never marked: {:?}",
            m.key
        );
        if !all_envs {
            assert_eq!(m.env, env, "{rule}: {:?} listed under another env", m.key);
        }
        let host = if m.key.id.starts_with("stable") {
            "h-stable"
        } else {
            "h-churn"
        };
        assert_eq!(
            m.hostname, host,
            "{rule}: {:?} listed with the wrong host",
            m.key
        );
    }
    let twice: Vec<_> = count.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.is_empty(),
        "{rule}: trays listed more than once in one walk: {twice:?}"
    );
    for k in &must_see {
        assert_eq!(
            count.get(k).copied().unwrap_or(0),
            1,
            "{rule}: {k:?} was marked during the whole walk, so it must be listed exactly once"
        );
    }
}

/// T5: the sweeper's listing pages every marked tray (optionally of one
/// env) exactly once per walk — unmarked trays and other envs never — while
/// other trays of the env are marked and unmarked.
pub fn t5_sweeper_pages_marked_trays_exactly_once(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    // At rest.
    let ns = unique("t5rest");
    let (env, env2) = (unique("t5e"), unique("t5e2"));
    let mut want_env: Vec<TrayKey> = Vec::new();
    let mut want_all: Vec<TrayKey> = Vec::new();
    for n in 0..3 {
        let i = InstanceKey::new(&ns, format!("i{n}"));
        let mut ops = Vec::new();
        for t in 0..7 {
            let (marked, e) = match t {
                0..=4 => (true, &env),
                5 => (false, &env),
                _ => (true, &env2),
            };
            ops.push(TrayOp::Put {
                tray_ns: "t".into(),
                tray_id: t.to_string(),
                tray: tray(marked, "d", e),
            });
            if marked {
                want_all.push(i.tray("t", t.to_string()));
                if e == &env {
                    want_env.push(i.tray("t", t.to_string()));
                }
            }
        }
        ok(s.apply_batch(&i, 1, ops), "T5: fill");
    }
    for limit in [1, 2, 1000] {
        let got: Vec<TrayKey> = marked_of(s, Some(&env), &ns, limit)
            .into_iter()
            .map(|m| m.key)
            .collect();
        assert_eq!(
            sorted(&got),
            sorted(&want_env),
            "T5: marked trays of one env, {limit} a page"
        );
        assert_eq!(got.len(), want_env.len(), "T5: each once");
        let got: Vec<TrayKey> = marked_of(s, None, &ns, limit)
            .into_iter()
            .map(|m| m.key)
            .collect();
        assert_eq!(
            sorted(&got),
            sorted(&want_all),
            "T5: marked trays of every env, {limit} a page"
        );
        assert_eq!(got.len(), want_all.len(), "T5: each once");
    }
    // While others mark and unmark.
    for walk_no in 0..rounds(4).max(2) {
        t5_walk(s, walk_no, walk_no % 2 == 1);
    }
}

/// T6: the epoch check and the write are one atomic step — once the
/// holder of epoch e + 1 has had an `Ok`, no write of the holder of epoch
/// e lands: it gets `FenceLost { caller: e, stored: e + 1 }`, and the
/// final doc is the e + 1 holder's last write.
pub fn t6_fence_check_and_write_are_atomic(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let ns = unique("t6");
    let total = rounds(300);
    let mut violations: Vec<String> = Vec::new();
    for round in 0..total {
        let i = InstanceKey::new(&ns, format!("r{round}"));
        let k = i.tray("t", "doc");
        let e: u64 = if round % 50 == 49 {
            u64::MAX - 1
        } else {
            round as u64 * 2 + 1
        };
        // Alternate how the holders write: one tray write or a batch.
        let write = |epoch: u64, doc: String| -> Result<()> {
            let t = tray(true, doc, "env");
            if round % 2 == 0 {
                s.write_tray(&k, epoch, t)
            } else {
                s.apply_batch(
                    &i,
                    epoch,
                    vec![TrayOp::Put {
                        tray_ns: "t".into(),
                        tray_id: "doc".into(),
                        tray: t,
                    }],
                )
            }
        };
        let new_holder_ok = AtomicBool::new(false);
        let barrier = Barrier::new(2);
        let b_writes = 3;
        let (old_log, new_log) = std::thread::scope(|sc| {
            let old = sc.spawn(|| {
                let mut log = Vec::new();
                barrier.wait();
                let mut fenced = 0;
                for n in 0..2_000 {
                    let after_new_ok = new_holder_ok.load(Ordering::SeqCst);
                    let r = caught(|| write(e, format!("old-{n}")));
                    match r {
                        Ok(Ok(())) if fenced > 0 => log.push(format!("write {n} at epoch {e} was Ok after an earlier FenceLost")),
                        Ok(Ok(())) if after_new_ok => {
                            log.push(format!("write {n} at epoch {e} was Ok after the epoch-{} holder's Ok", e + 1))
                        }
                        Ok(Ok(())) => {}
                        Ok(Err(StateError::FenceLost { caller, stored })) if caller == e && stored == e + 1 => {
                            fenced += 1;
                            if fenced == 3 {
                                break;
                            }
                        }
                        Ok(Err(other)) => log.push(format!("write {n} at epoch {e}: expected Ok or FenceLost {{ caller: {e}, stored: {} }}, got {other:?}", e + 1)),
                        Err(p) => log.push(format!("write {n} at epoch {e} panicked: {p}")),
                    }
                }
                log
            });
            let new = sc.spawn(|| {
                let mut log = Vec::new();
                barrier.wait();
                for n in 0..b_writes {
                    match caught(|| write(e + 1, format!("new-{n}"))) {
                        Ok(Ok(())) => new_holder_ok.store(true, Ordering::SeqCst),
                        other => log.push(format!(
                            "write {n} at the newest epoch {}: expected Ok, got {other:?}",
                            e + 1
                        )),
                    }
                }
                log
            });
            (join(old.join()), join(new.join()))
        });
        for v in old_log.iter().chain(&new_log) {
            violations.push(format!("round {round}: {v}"));
        }
        let last = read_tray(s, &k, e + 1).map(|t| String::from_utf8_lossy(&t.doc).into_owned());
        if last.as_deref() != Some(&format!("new-{}", b_writes - 1)) {
            violations.push(format!(
                "round {round}: the final doc is {last:?}, not the epoch-{} holder's last write",
                e + 1
            ));
        }
        if epoch_of(s, &i) != e + 1 {
            violations.push(format!(
                "round {round}: the stored epoch is {}, not {}",
                epoch_of(s, &i),
                e + 1
            ));
        }
        assert!(
            violations.len() < 20,
            "T6: the fence check and the write are not one step: {violations:#?}"
        );
    }
    assert!(
        violations.is_empty(),
        "T6: the fence check and the write are not one step: {violations:#?}"
    );
}

// ---------------------------------------------------------------------------
// A — alarms
// ---------------------------------------------------------------------------

fn alarm(i: &InstanceKey, due_at: Millis) -> Alarm {
    Alarm {
        instance: i.clone(),
        due_at,
    }
}

/// A1: one alarm per instance; `set_alarm` replaces it.
pub fn a1_one_alarm_per_instance(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let ns = unique("a1");
    let (i, j) = (InstanceKey::new(&ns, "i"), InstanceKey::new(&ns, "j"));
    ok(s.set_alarm(&i, 1, 500), "A1: set");
    ok(s.set_alarm(&i, 1, 300), "A1: replace with an earlier time");
    assert_eq!(
        due_of(s, 1_000, &ns, 10),
        vec![alarm(&i, 300)],
        "A1: the later set replaces the earlier"
    );
    ok(s.set_alarm(&j, 1, 400), "A1: another instance");
    assert_eq!(
        due_of(s, 1_000, &ns, 10),
        vec![alarm(&i, 300), alarm(&j, 400)],
        "A1: one alarm per instance"
    );
    ok(s.set_alarm(&i, 1, 2_000), "A1: replace with a later time");
    assert_eq!(
        due_of(s, 1_000, &ns, 10),
        vec![alarm(&j, 400)],
        "A1: the replaced alarm is no longer due"
    );
    assert_eq!(
        due_of(s, 2_000, &ns, 1),
        vec![alarm(&j, 400), alarm(&i, 2_000)],
        "A1: the new alarm is due at its time"
    );
    ok(s.set_alarm(&i, 1, 2_000), "A1: the same time again");
    assert_eq!(
        due_of(s, 2_000, &ns, 10),
        vec![alarm(&j, 400), alarm(&i, 2_000)],
        "A1: setting the same time keeps one alarm"
    );
    ok(
        s.write_tray(&i.tray("t", "1"), 2, tray(false, "x", "env")),
        "A1: epoch 2",
    );
    expect_err!(
        s.set_alarm(&i, 1, 5),
        StateError::FenceLost {
            caller: 1,
            stored: 2
        },
        "A1: a fenced set_alarm"
    );
    assert_eq!(
        due_of(s, 2_000, &ns, 10),
        vec![alarm(&j, 400), alarm(&i, 2_000)],
        "A1/E6: a fenced set_alarm changed the alarm"
    );
}

/// A2: `due_alarms(now, ..)` pages the alarms with `due_at <= now` in
/// `(due_at, ns, id)` order.
pub fn a2_due_alarms_in_order(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let p = unique("a2");
    let spec: [(&str, &str, Millis); 9] = [
        ("b", "2", 200),
        ("a", "9", 200),
        ("a", "10", 200),
        ("c", "1", 100),
        ("a", "1", 300),
        ("z", "z", 301),
        ("m", "max", u64::MAX),
        ("a", "zero", 0),
        ("a\0", "1", 200),
    ];
    let alarms: Vec<Alarm> = spec
        .iter()
        .map(|(ns, id, due)| alarm(&InstanceKey::new(format!("{p}{ns}"), *id), *due))
        .collect();
    par_map(&alarms, |a| {
        ok(s.set_alarm(&a.instance, 1, a.due_at), "A2: set_alarm")
    });
    let order = |a: &Alarm| (a.due_at, a.instance.ns.clone(), a.instance.id.clone());
    let due_by = |now: Millis| {
        let mut v: Vec<Alarm> = alarms.iter().filter(|a| a.due_at <= now).cloned().collect();
        v.sort_by_key(order);
        v
    };
    for now in [0, 99, 100, 199, 200, 300, 301, u64::MAX - 1, u64::MAX] {
        for limit in [1, 2, 1000] {
            assert_eq!(
                due_of(s, now, &p, limit),
                due_by(now),
                "A2: due at {now}, {limit} a page, in (due_at, ns, id) order"
            );
        }
    }
    // The whole listing, others' alarms included, is in order.
    let everything = walk("A2: due_alarms", 7, |c| s.due_alarms(u64::MAX, 7, c));
    assert!(
        everything.windows(2).all(|w| order(&w[0]) < order(&w[1])),
        "A2: the due listing is not in strictly ascending (due_at, ns, id) order"
    );
}

/// A3: an alarm stays due until acked with its `due_at`; an ack for a
/// replaced `due_at` removes nothing, so a failed run fires again.
pub fn a3_alarm_stays_due_until_acked(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let ns = unique("a3");
    let i = InstanceKey::new(&ns, "i");
    ok(s.set_alarm(&i, 1, 100), "A3: set");
    for pass in 0..3 {
        assert_eq!(
            due_of(s, 150, &ns, 10),
            vec![alarm(&i, 100)],
            "A3: pass {pass}: an unacked alarm stays due (at-least-once)"
        );
    }
    assert!(
        ok(s.ack_alarm(&i, 1, 100), "A3: ack"),
        "A3: an ack of the due alarm removes it"
    );
    assert!(
        due_of(s, u64::MAX, &ns, 10).is_empty(),
        "A3: an acked alarm is gone"
    );
    assert!(
        !ok(s.ack_alarm(&i, 1, 100), "A3: ack again"),
        "A3: a second ack removes nothing"
    );

    // Replaced between the sweep and the ack.
    ok(s.set_alarm(&i, 1, 100), "A3: set again");
    let fired = due_of(s, 150, &ns, 10);
    assert_eq!(fired, vec![alarm(&i, 100)], "A3: due");
    ok(
        s.set_alarm(&i, 1, 120),
        "A3: rescheduled while the first fired",
    );
    assert!(
        !ok(
            s.ack_alarm(&i, 1, fired[0].due_at),
            "A3: ack of the replaced time"
        ),
        "A3: an ack of a replaced due_at removes nothing"
    );
    assert_eq!(
        due_of(s, 150, &ns, 10),
        vec![alarm(&i, 120)],
        "A3: the replacing alarm stays due"
    );
    assert!(
        !ok(s.ack_alarm(&i, 1, 121), "A3: ack of a time never set"),
        "A3: an ack of another time removes nothing"
    );
    assert_eq!(
        due_of(s, 150, &ns, 10),
        vec![alarm(&i, 120)],
        "A3: the alarm stays due"
    );

    // A fenced ack removes nothing either.
    ok(
        s.write_tray(&i.tray("t", "1"), 2, tray(false, "x", "env")),
        "A3: epoch 2",
    );
    expect_err!(
        s.ack_alarm(&i, 1, 120),
        StateError::FenceLost {
            caller: 1,
            stored: 2
        },
        "A3: a fenced ack"
    );
    assert_eq!(
        due_of(s, 150, &ns, 10),
        vec![alarm(&i, 120)],
        "A3: a fenced ack removed the alarm"
    );
    assert!(
        ok(s.ack_alarm(&i, 2, 120), "A3: ack at the current epoch"),
        "A3: the current holder's ack removes it"
    );
    assert!(due_of(s, u64::MAX, &ns, 10).is_empty(), "A3: acked");
}

// ---------------------------------------------------------------------------
// K — limits
// ---------------------------------------------------------------------------

/// Ids that break K1: empty, 257 ASCII bytes, and 257 bytes of mostly
/// two-byte characters (129 characters — the limit is bytes, not chars).
fn bad_ids() -> Vec<(&'static str, String)> {
    vec![
        ("an empty id", String::new()),
        ("a 257-byte id", "x".repeat(ID_BYTES_MAX + 1)),
        (
            "a 257-byte UTF-8 id",
            format!("{}x", "é".repeat(ID_BYTES_MAX / 2)),
        ),
    ]
}

/// K1: ids (tenant, run, session, ns, id, tray ns and id) are 1..=256
/// bytes of UTF-8: every operation refuses others with `Invalid` naming
/// the id, and changes nothing.
pub fn k1_ids_are_1_to_256_bytes(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("k1");
    let ns = unique("k1ns");
    let sk = SessionKey::new(&t, "s");
    create_session(s, &sk);
    let run = create(
        s,
        RunRecord::new(RunKey::new(&t, "r"), "planner").with_session("s"),
    );
    let i = InstanceKey::new(&ns, "i");
    let good_tray = i.tray("t", "1");
    ok(
        s.write_tray(&good_tray, 1, tray(true, "doc", "env")),
        "K1: tray",
    );
    ok(s.set_alarm(&i, 1, 10), "K1: alarm");
    let snap = || {
        (
            walk_runs(s, &StateQuery::new(&t)),
            get_session(s, &sk),
            tray_state(s, &i),
            due_of(s, 10, &ns, 10),
        )
    };
    let before = snap();
    let tk = |ns: &str, id: &str, tns: &str, tid: &str| TrayKey {
        ns: ns.into(),
        id: id.into(),
        tray_ns: tns.into(),
        tray_id: tid.into(),
    };
    type Case<'a> = (
        String,
        &'static [&'static str],
        Box<dyn Fn() -> Result<()> + 'a>,
    );
    for (what, b) in bad_ids() {
        let b = b.as_str();
        let put = |tns: &str, tid: &str| TrayOp::Put {
            tray_ns: tns.into(),
            tray_id: tid.into(),
            tray: tray(false, "x", "env"),
        };
        let del = |tns: &str, tid: &str| TrayOp::Delete {
            tray_ns: tns.into(),
            tray_id: tid.into(),
        };
        let cases: Vec<Case<'_>> = vec![
            (
                "put_run tenant".into(),
                &["tenant"],
                Box::new(|| {
                    s.put_run(RunRecord::new(RunKey::new(b, "r"), "a"))
                        .map(drop)
                }),
            ),
            (
                "put_run run_id".into(),
                &["run_id", "run id"],
                Box::new(|| s.put_run(RunRecord::new(RunKey::new(&t, b), "a")).map(drop)),
            ),
            (
                "put_run session_id".into(),
                &["session"],
                Box::new(|| {
                    s.put_run(RunRecord::new(RunKey::new(&t, "new"), "a").with_session(b))
                        .map(drop)
                }),
            ),
            (
                "get_run tenant".into(),
                &["tenant"],
                Box::new(|| s.get_run(&RunKey::new(b, "r")).map(drop)),
            ),
            (
                "get_run run_id".into(),
                &["run_id", "run id"],
                Box::new(|| s.get_run(&RunKey::new(&t, b)).map(drop)),
            ),
            (
                "patch_run tenant".into(),
                &["tenant"],
                Box::new(|| {
                    s.patch_run(&RunKey::new(b, "r"), StateDelta::default())
                        .map(drop)
                }),
            ),
            (
                "patch_run run_id".into(),
                &["run_id", "run id"],
                Box::new(|| {
                    s.patch_run(&RunKey::new(&t, b), StateDelta::default())
                        .map(drop)
                }),
            ),
            (
                "list_runs tenant".into(),
                &["tenant"],
                Box::new(|| s.list_runs(&StateQuery::new(b)).map(drop)),
            ),
            (
                "list_runs session".into(),
                &["session"],
                Box::new(|| s.list_runs(&StateQuery::new(&t).session(b)).map(drop)),
            ),
            (
                "put_session tenant".into(),
                &["tenant"],
                Box::new(|| {
                    s.put_session(SessionRecord::new(SessionKey::new(b, "s")))
                        .map(drop)
                }),
            ),
            (
                "put_session session_id".into(),
                &["session"],
                Box::new(|| {
                    s.put_session(SessionRecord::new(SessionKey::new(&t, b)))
                        .map(drop)
                }),
            ),
            (
                "get_session tenant".into(),
                &["tenant"],
                Box::new(|| s.get_session(&SessionKey::new(b, "s")).map(drop)),
            ),
            (
                "get_session session_id".into(),
                &["session"],
                Box::new(|| s.get_session(&SessionKey::new(&t, b)).map(drop)),
            ),
            (
                "delete_session tenant".into(),
                &["tenant"],
                Box::new(|| s.delete_session(&SessionKey::new(b, "s"), true).map(drop)),
            ),
            (
                "delete_session session_id".into(),
                &["session"],
                Box::new(|| s.delete_session(&SessionKey::new(&t, b), true).map(drop)),
            ),
            (
                "read_tray ns".into(),
                &["ns"],
                Box::new(|| s.read_tray(&tk(b, "i", "t", "1"), 4).map(drop)),
            ),
            (
                "read_tray id".into(),
                &["id"],
                Box::new(|| s.read_tray(&tk(&ns, b, "t", "1"), 4).map(drop)),
            ),
            (
                "read_tray tray_ns".into(),
                &["tray_ns", "tray ns"],
                Box::new(|| s.read_tray(&tk(&ns, "i", b, "1"), 4).map(drop)),
            ),
            (
                "read_tray tray_id".into(),
                &["tray_id", "tray id"],
                Box::new(|| s.read_tray(&tk(&ns, "i", "t", b), 4).map(drop)),
            ),
            (
                "write_tray ns".into(),
                &["ns"],
                Box::new(|| s.write_tray(&tk(b, "i", "t", "1"), 4, tray(false, "x", "env"))),
            ),
            (
                "write_tray id".into(),
                &["id"],
                Box::new(|| s.write_tray(&tk(&ns, b, "t", "1"), 4, tray(false, "x", "env"))),
            ),
            (
                "write_tray tray_ns".into(),
                &["tray_ns", "tray ns"],
                Box::new(|| s.write_tray(&tk(&ns, "i", b, "1"), 4, tray(false, "x", "env"))),
            ),
            (
                "write_tray tray_id".into(),
                &["tray_id", "tray id"],
                Box::new(|| s.write_tray(&tk(&ns, "i", "t", b), 4, tray(false, "x", "env"))),
            ),
            (
                "delete_tray ns".into(),
                &["ns"],
                Box::new(|| s.delete_tray(&tk(b, "i", "t", "1"), 4).map(drop)),
            ),
            (
                "delete_tray id".into(),
                &["id"],
                Box::new(|| s.delete_tray(&tk(&ns, b, "t", "1"), 4).map(drop)),
            ),
            (
                "delete_tray tray_ns".into(),
                &["tray_ns", "tray ns"],
                Box::new(|| s.delete_tray(&tk(&ns, "i", b, "1"), 4).map(drop)),
            ),
            (
                "delete_tray tray_id".into(),
                &["tray_id", "tray id"],
                Box::new(|| s.delete_tray(&tk(&ns, "i", "t", b), 4).map(drop)),
            ),
            (
                "apply_batch ns".into(),
                &["ns"],
                Box::new(|| s.apply_batch(&InstanceKey::new(b, "i"), 4, vec![put("t", "1")])),
            ),
            (
                "apply_batch id".into(),
                &["id"],
                Box::new(|| s.apply_batch(&InstanceKey::new(&ns, b), 4, vec![put("t", "1")])),
            ),
            (
                "apply_batch put tray_ns".into(),
                &["tray_ns", "tray ns"],
                Box::new(|| s.apply_batch(&i, 4, vec![put("t", "2"), put(b, "1")])),
            ),
            (
                "apply_batch put tray_id".into(),
                &["tray_id", "tray id"],
                Box::new(|| s.apply_batch(&i, 4, vec![put("t", "2"), put("t", b)])),
            ),
            (
                "apply_batch delete tray_ns".into(),
                &["tray_ns", "tray ns"],
                Box::new(|| s.apply_batch(&i, 4, vec![del("t", "1"), del(b, "1")])),
            ),
            (
                "apply_batch delete tray_id".into(),
                &["tray_id", "tray id"],
                Box::new(|| s.apply_batch(&i, 4, vec![del("t", "1"), del("t", b)])),
            ),
            (
                "release ns".into(),
                &["ns"],
                Box::new(|| s.release(&InstanceKey::new(b, "i"), 4)),
            ),
            (
                "release id".into(),
                &["id"],
                Box::new(|| s.release(&InstanceKey::new(&ns, b), 4)),
            ),
            (
                "list_trays ns".into(),
                &["ns"],
                Box::new(|| {
                    s.list_trays(&InstanceKey::new(b, "i"), 4, 10, None)
                        .map(drop)
                }),
            ),
            (
                "list_trays id".into(),
                &["id"],
                Box::new(|| {
                    s.list_trays(&InstanceKey::new(&ns, b), 4, 10, None)
                        .map(drop)
                }),
            ),
            (
                "epoch ns".into(),
                &["ns"],
                Box::new(|| s.epoch(&InstanceKey::new(b, "i")).map(drop)),
            ),
            (
                "epoch id".into(),
                &["id"],
                Box::new(|| s.epoch(&InstanceKey::new(&ns, b)).map(drop)),
            ),
            (
                "set_alarm ns".into(),
                &["ns"],
                Box::new(|| s.set_alarm(&InstanceKey::new(b, "i"), 4, 1)),
            ),
            (
                "set_alarm id".into(),
                &["id"],
                Box::new(|| s.set_alarm(&InstanceKey::new(&ns, b), 4, 1)),
            ),
            (
                "ack_alarm ns".into(),
                &["ns"],
                Box::new(|| s.ack_alarm(&InstanceKey::new(b, "i"), 4, 10).map(drop)),
            ),
            (
                "ack_alarm id".into(),
                &["id"],
                Box::new(|| s.ack_alarm(&InstanceKey::new(&ns, b), 4, 10).map(drop)),
            ),
        ];
        for (call, names, f) in &cases {
            let e = expect_err!(f(), StateError::Invalid { .. }, "K1: {call} with {what}");
            assert_names(&e, names, format_args!("K1: {call} with {what}"));
            assert_eq!(
                snap(),
                before,
                "K1/E6: {call} with {what} was refused but changed the store"
            );
        }
    }
    assert_eq!(
        get(s, &run.key).as_ref(),
        Some(&run),
        "K1: the fixture run is untouched"
    );

    // The longest ids, in ASCII and in two-byte characters, work everywhere.
    for fill in ['x', 'é'] {
        let long = |tag: &str| id_of_max_len(&unique(tag), fill);
        let (lt, lr, ls) = (long("t"), long("r"), long("s"));
        assert_eq!(lt.len(), ID_BYTES_MAX, "K1: fixture");
        let lsk = SessionKey::new(&lt, &ls);
        create_session(s, &lsk);
        let lk = RunKey::new(&lt, &lr);
        create(
            s,
            RunRecord::new(lk.clone(), "planner").with_session(ls.clone()),
        );
        ok(
            s.patch_run(
                &lk,
                StateDelta {
                    iterations: 1,
                    ..Default::default()
                },
            ),
            "K1: patch a 256-byte key",
        );
        assert_eq!(
            must_get(s, &lk).iterations,
            1,
            "K1: a 256-byte key reads back"
        );
        assert_eq!(
            keys(&walk_runs(s, &StateQuery::new(&lt).session(ls.clone()))),
            vec![lk.clone()],
            "K1: 256-byte listing"
        );
        let li = InstanceKey::new(long("ns"), long("id"));
        let ltk = li.tray(long("tns"), long("tid"));
        ok(
            s.write_tray(&ltk, 1, tray(true, "d", "env")),
            "K1: a tray with 256-byte ids",
        );
        assert_eq!(
            read_tray(s, &ltk, 1).map(|t| t.doc),
            Some(b"d".to_vec()),
            "K1: it reads back"
        );
        assert_eq!(tray_state(s, &li).1.len(), 1, "K1: it lists");
        ok(s.set_alarm(&li, 1, 5), "K1: an alarm with 256-byte ids");
        assert_eq!(
            due_of(s, 5, &li.ns, 10),
            vec![alarm(&li, 5)],
            "K1: it is due"
        );
        ok(
            s.delete_session(&lsk, true),
            "K1: cascade a 256-byte session",
        );
    }
}

/// K2: a record or tray doc past 1 MiB is `Persistence { reason: TooLarge }`
/// and nothing is written; below it, it is stored.
pub fn k2_records_and_docs_past_limit_too_large(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("k2");
    let args = |bytes: usize| format!(r#"{{"blob":"{}"}}"#, "x".repeat(bytes));
    macro_rules! too_large {
        ($call:expr, $($ctx:tt)+) => {{
            let e = expect_err!($call, StateError::Persistence { reason: PersistenceReason::TooLarge, .. }, $($ctx)+);
            assert!(!e.is_retryable(), "K2/E3: TooLarge is not retryable");
        }};
    }
    let key = RunKey::new(&t, "big");
    let mut rec = RunRecord::new(key.clone(), "planner");
    rec.pending_tool_calls = vec![tool_call("c", &args(1_150_000))];
    too_large!(
        s.put_run(rec),
        "K2: creating a run with 1.1 MiB of tool-call arguments"
    );
    assert_eq!(get(s, &key), None, "K2/E6: the refused run exists");
    assert!(
        walk_runs(s, &StateQuery::new(&t)).is_empty(),
        "K2/E6: the refused run is listed"
    );

    let mut rec = RunRecord::new(key.clone(), "planner");
    rec.pending_tool_calls = vec![tool_call("c", &args(900_000))];
    let stored = create(s, rec);
    assert_eq!(
        stored.pending_tool_calls[0].arguments.len(),
        args(900_000).len(),
        "K2: a 900 KB run is stored whole"
    );
    let mut grown = stored.clone();
    grown
        .pending_tool_calls
        .push(tool_call("d", &args(250_000)));
    too_large!(s.put_run(grown), "K2: growing a run past 1 MiB");
    assert_eq!(
        get(s, &key).as_ref(),
        Some(&stored),
        "K2/E6: the refused update changed the run"
    );

    let sk = SessionKey::new(&t, "big");
    let mut srec = SessionRecord::new(sk.clone());
    srec.metadata.insert("blob".into(), "x".repeat(1_150_000));
    too_large!(s.put_session(srec), "K2: a 1.1 MiB session");
    assert_eq!(
        get_session(s, &sk),
        None,
        "K2/E6: the refused session exists"
    );

    let ns = unique("k2ns");
    let i = InstanceKey::new(&ns, "i");
    let k = i.tray("t", "big");
    ok(
        s.write_tray(&k, 1, tray(false, "small", "env")),
        "K2: a small tray",
    );
    let over = tray(true, vec![0xAB; (1 << 20) + 1], "env");
    too_large!(
        s.write_tray(&k, 3, over.clone()),
        "K2: a tray doc of 1 MiB + 1 byte"
    );
    too_large!(
        s.apply_batch(
            &i,
            3,
            vec![TrayOp::Put {
                tray_ns: "t".into(),
                tray_id: "big".into(),
                tray: over
            }]
        ),
        "K2: a batch with a tray doc of 1 MiB + 1 byte"
    );
    assert_eq!(
        read_tray(s, &k, 1).map(|t| t.doc),
        Some(b"small".to_vec()),
        "K2/E6: a refused tray was written"
    );
    assert_eq!(
        epoch_of(s, &i),
        1,
        "K2/E6: a refused tray write moved the epoch"
    );
    assert!(
        marked_of(s, None, &ns, 1000).is_empty(),
        "K2/E6: a refused tray was marked"
    );
    let under = tray(false, vec![0xCD; (1 << 20) - 4096], "env");
    ok(
        s.write_tray(&k, 1, under.clone()),
        "K2: a tray doc just under 1 MiB",
    );
    assert_eq!(
        read_tray(s, &k, 1).as_ref(),
        Some(&under),
        "K2: a doc just under 1 MiB is stored whole"
    );
}

/// K3: a page is 1..=1000 items; 0 and 1,001 are `Invalid` on every
/// listing.
pub fn k3_page_limit_1_to_1000(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("k3");
    let ns = unique("k3ns");
    let env = unique("k3env");
    let i = InstanceKey::new(&ns, "i");
    create(s, RunRecord::new(RunKey::new(&t, "r"), "planner"));
    ok(
        s.write_tray(&i.tray("t", "1"), 1, tray(true, "d", &env)),
        "K3: tray",
    );
    ok(s.set_alarm(&i, 1, 5), "K3: alarm");
    for limit in [0, PAGE_ITEMS_MAX + 1, usize::MAX] {
        let ctx = |call: &str| format!("K3: {call} with limit {limit}");
        let e = expect_err!(
            s.list_runs(&StateQuery::new(&t).limit(limit)),
            StateError::Invalid { .. },
            "{}",
            ctx("list_runs")
        );
        assert_names(&e, &["limit"], ctx("list_runs"));
        let e = expect_err!(
            s.list_trays(&i, 2, limit, None),
            StateError::Invalid { .. },
            "{}",
            ctx("list_trays")
        );
        assert_names(&e, &["limit"], ctx("list_trays"));
        assert_eq!(
            epoch_of(s, &i),
            1,
            "K3/E6: a refused list_trays moved the epoch"
        );
        let e = expect_err!(
            s.marked_trays(None, limit, None),
            StateError::Invalid { .. },
            "{}",
            ctx("marked_trays(None)")
        );
        assert_names(&e, &["limit"], ctx("marked_trays(None)"));
        let e = expect_err!(
            s.marked_trays(Some(&env), limit, None),
            StateError::Invalid { .. },
            "{}",
            ctx("marked_trays(env)")
        );
        assert_names(&e, &["limit"], ctx("marked_trays(env)"));
        let e = expect_err!(
            s.due_alarms(5, limit, None),
            StateError::Invalid { .. },
            "{}",
            ctx("due_alarms")
        );
        assert_names(&e, &["limit"], ctx("due_alarms"));
    }
    for limit in [1, PAGE_ITEMS_MAX] {
        assert_eq!(
            ok(
                s.list_runs(&StateQuery::new(&t).limit(limit)),
                "K3: list_runs"
            )
            .items()
            .len(),
            1,
            "K3: limit {limit}"
        );
        assert_eq!(
            ok(s.list_trays(&i, 1, limit, None), "K3: list_trays")
                .items()
                .len(),
            1,
            "K3: limit {limit}"
        );
        assert_eq!(
            ok(s.marked_trays(Some(&env), limit, None), "K3: marked_trays")
                .items()
                .len(),
            1,
            "K3: limit {limit}"
        );
        assert!(
            ok(s.marked_trays(None, limit, None), "K3: marked_trays(None)")
                .items()
                .len()
                <= limit,
            "K3: limit {limit}"
        );
        assert!(
            ok(s.due_alarms(5, limit, None), "K3: due_alarms")
                .items()
                .len()
                <= limit,
            "K3: limit {limit}"
        );
    }
}

/// K4: a tray batch holds at most 10,000 ops: 10,001 is `Invalid` and
/// applies nothing; 10,000 applies whole.
pub fn k4_batch_at_most_10000_ops(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let ns = unique("k4");
    let i = InstanceKey::new(&ns, "i");
    ok(
        s.write_tray(&i.tray("keep", "1"), 1, tray(false, "keep", "env")),
        "K4: fixture",
    );
    let ops = |n: usize| -> Vec<TrayOp> {
        (0..n)
            .map(|k| TrayOp::Put {
                tray_ns: "b".into(),
                tray_id: format!("{k:05}"),
                tray: tray(false, "d", "env"),
            })
            .collect()
    };
    let before = tray_state(s, &i);
    let e = expect_err!(
        s.apply_batch(&i, 2, ops(BATCH_OPS_MAX + 1)),
        StateError::Invalid { .. },
        "K4: a batch of 10,001 ops"
    );
    assert_names(&e, &["batch", "ops"], "K4: a batch of 10,001 ops");
    assert_eq!(
        tray_state(s, &i),
        before,
        "K4/E6: a refused batch applied something or moved the epoch"
    );
    let mut deletes: Vec<TrayOp> = (0..BATCH_OPS_MAX)
        .map(|k| TrayOp::Delete {
            tray_ns: "b".into(),
            tray_id: k.to_string(),
        })
        .collect();
    deletes.push(TrayOp::Delete {
        tray_ns: "keep".into(),
        tray_id: "1".into(),
    });
    expect_err!(
        s.apply_batch(&i, 2, deletes),
        StateError::Invalid { .. },
        "K4: a batch of 10,001 deletes"
    );
    assert_eq!(
        tray_state(s, &i),
        before,
        "K4/E6: a refused batch of deletes applied something"
    );

    ok(
        s.apply_batch(&i, 2, ops(BATCH_OPS_MAX)),
        "K4: a batch of 10,000 ops",
    );
    let (e, trays) = tray_state(s, &i);
    assert_eq!(e, 2, "K4: the batch ran at its epoch");
    assert_eq!(
        trays.len(),
        BATCH_OPS_MAX + 1,
        "K4: all 10,000 writes applied"
    );
}

/// K5: a run holds at most 1,024 pending tool calls: 1,025 is `Invalid`
/// (create and update), 1,024 is stored.
pub fn k5_at_most_1024_pending_tool_calls(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("k5");
    let calls = |n: usize| {
        (0..n)
            .map(|k| tool_call(&format!("call-{k}"), r#"{"q":1}"#))
            .collect::<Vec<_>>()
    };
    let key = RunKey::new(&t, "run");
    let mut rec = RunRecord::new(key.clone(), "planner");
    rec.pending_tool_calls = calls(PENDING_TOOL_CALLS_MAX + 1);
    let e = expect_err!(
        s.put_run(rec),
        StateError::Invalid { .. },
        "K5: creating a run with 1,025 pending calls"
    );
    assert_names(
        &e,
        &["pending_tool_calls", "tool calls"],
        "K5: 1,025 pending calls",
    );
    assert_eq!(get(s, &key), None, "K5/E6: the refused run exists");

    let mut rec = RunRecord::new(key.clone(), "planner");
    rec.pending_tool_calls = calls(PENDING_TOOL_CALLS_MAX);
    let stored = create(s, rec);
    assert_eq!(
        stored.pending_tool_calls.len(),
        1024,
        "K5: 1,024 pending calls are stored"
    );
    assert_eq!(
        must_get(s, &key).pending_tool_calls,
        calls(1024),
        "K5: in order"
    );
    assert!(stored.mid_tool_call(), "K5: mid tool call");
    let mut more = stored.clone();
    more.pending_tool_calls.push(tool_call("one-more", "{}"));
    let e = expect_err!(
        s.put_run(more),
        StateError::Invalid { .. },
        "K5: growing a run to 1,025 pending calls"
    );
    assert_names(
        &e,
        &["pending_tool_calls", "tool calls"],
        "K5: 1,025 pending calls",
    );
    assert_eq!(
        get(s, &key).as_ref(),
        Some(&stored),
        "K5/E6: the refused update changed the run"
    );
}

/// Pieces of keys that a naive encoding would confuse: separators, NUL
/// bytes, a byte-1 terminator look-alike, prefixes of each other.
const K6_PIECES: [&str; 11] = [
    "a", "a/b", "b", "b/c", "c", "a\0", "\0b", "a\0b", "\0", "a\u{1}", "\u{1}b",
];

/// K6: the key encoding is injective — tenant "a" + run "b/c" and tenant
/// "a/b" + run "c", ids differing by a separator or a NUL byte, "a\0" and
/// "a": distinct records that never read each other; for runs, sessions,
/// trays, epochs, alarms and the listings.
pub fn k6_key_encoding_injective(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let p = unique("k6");
    let tenant = |x: &str| format!("{p}{x}");

    // Runs: every tenant piece × every run piece.
    let mut recs = Vec::new();
    for (ti, tp) in K6_PIECES.iter().enumerate() {
        for (ri, rp) in K6_PIECES.iter().enumerate() {
            recs.push(RunRecord::new(
                RunKey::new(tenant(tp), *rp),
                format!("k6-{ti}-{ri}"),
            ));
        }
    }
    create_many(s, recs.clone());
    let twin = RunKey::new(tenant("a"), "b/c");
    ok(
        s.patch_run(
            &twin,
            StateDelta {
                iterations: 7,
                ..Default::default()
            },
        ),
        "K6: patch one of a pair",
    );
    for r in &recs {
        let got = must_get(s, &r.key);
        assert_eq!(
            got.agent_name, r.agent_name,
            "K6: {:?} read another run's record",
            r.key
        );
        let want_iter = if r.key == twin { 7 } else { 0 };
        assert_eq!(
            got.iterations, want_iter,
            "K6: patching {twin:?} reached {:?}",
            r.key
        );
    }
    for tp in K6_PIECES {
        let want: BTreeSet<String> = K6_PIECES.iter().map(|x| x.to_string()).collect();
        let got: BTreeSet<String> = walk_runs(s, &StateQuery::new(tenant(tp)))
            .into_iter()
            .map(|r| r.key.run_id)
            .collect();
        assert_eq!(
            got,
            want,
            "K6: tenant {:?} lists exactly its own runs",
            tenant(tp)
        );
    }

    // Sessions, and runs listed by session.
    let mut sessions = Vec::new();
    for tp in K6_PIECES {
        for sp in K6_PIECES {
            sessions.push(SessionKey::new(tenant(tp), sp));
        }
    }
    par_map(&sessions, |k| {
        let mut r = SessionRecord::new(k.clone());
        r.metadata
            .insert("who".into(), format!("{:?}", (&k.tenant, &k.session_id)));
        ok(s.put_session(r), "K6: session");
        let run = RunRecord::new(
            RunKey::new(k.tenant.clone(), format!("in-{:?}", k.session_id)),
            "planner",
        )
        .with_session(k.session_id.clone());
        create(s, run);
    });
    for k in &sessions {
        let got = get_session(s, k).expect("K6: session exists");
        assert_eq!(
            got.metadata["who"],
            format!("{:?}", (&k.tenant, &k.session_id)),
            "K6: {k:?} read another session"
        );
        let listed: Vec<String> = walk_runs(
            s,
            &StateQuery::new(k.tenant.clone()).session(k.session_id.clone()),
        )
        .into_iter()
        .map(|r| r.key.run_id)
        .collect();
        assert_eq!(
            listed,
            vec![format!("in-{:?}", k.session_id)],
            "K6: session {k:?} lists exactly its own run"
        );
    }
    let gone = SessionKey::new(tenant("a"), "b/c");
    let deleted = ok(s.delete_session(&gone, true), "K6: cascade one of a pair");
    assert_eq!(
        deleted.len(),
        1,
        "K6: a cascade reached another session's runs: {deleted:?}"
    );
    for k in sessions.iter().filter(|k| **k != gone) {
        assert!(
            get_session(s, k).is_some(),
            "K6: deleting {gone:?} deleted {k:?}"
        );
    }

    // Trays: every (ns, id, tray ns, tray id) from a smaller set of pieces.
    let pieces = ["a", "a/b", "b", "\0", "a\0", "\u{1}b"];
    let instances: Vec<InstanceKey> = pieces
        .iter()
        .flat_map(|n| pieces.iter().map(move |i| InstanceKey::new(tenant(n), *i)))
        .collect();
    let doc =
        |i: &InstanceKey, tn: &str, ti: &str| format!("{:?}", (&i.ns, &i.id, tn, ti)).into_bytes();
    let env_of = |tn: &str| format!("{p}{tn}");
    par_map(
        &instances.iter().enumerate().collect::<Vec<_>>(),
        |(n, i)| {
            let ops = pieces
                .iter()
                .flat_map(|tn| pieces.iter().map(move |ti| (*tn, *ti)))
                .map(|(tn, ti)| TrayOp::Put {
                    tray_ns: tn.into(),
                    tray_id: ti.into(),
                    tray: Tray {
                        marked: ti == "a",
                        doc: doc(i, tn, ti),
                        env: env_of(tn),
                        hostname: "h".into(),
                    },
                })
                .collect();
            ok(s.apply_batch(i, *n as u64 + 1, ops), "K6: trays");
            ok(
                s.set_alarm(i, *n as u64 + 1, 1_000 + *n as u64),
                "K6: alarm",
            );
        },
    );
    for (n, i) in instances.iter().enumerate() {
        assert_eq!(
            epoch_of(s, i),
            n as u64 + 1,
            "K6: {i:?} read another instance's epoch"
        );
        let (_, trays) = tray_state(s, i);
        assert_eq!(
            trays.len(),
            pieces.len() * pieces.len(),
            "K6: {i:?} lists exactly its own trays"
        );
        for (k, t) in &trays {
            assert_eq!(
                k.instance(),
                *i,
                "K6: {i:?} listed another instance's tray {k:?}"
            );
            assert_eq!(
                t.doc,
                doc(i, &k.tray_ns, &k.tray_id),
                "K6: {k:?} holds another tray's doc"
            );
        }
        let k = i.tray("a", "a/b");
        assert_eq!(
            read_tray(s, &k, n as u64 + 1).map(|t| t.doc),
            Some(doc(i, "a", "a/b")),
            "K6: {k:?} reads its own doc"
        );
    }
    for tn in pieces {
        let env = env_of(tn);
        let got: BTreeSet<TrayKey> = marked_of(s, Some(&env), &p, 1000)
            .into_iter()
            .map(|m| m.key)
            .collect();
        let want: BTreeSet<TrayKey> = instances.iter().map(|i| i.tray(tn, "a")).collect();
        assert_eq!(
            got, want,
            "K6: env {env:?} lists exactly its own marked trays"
        );
    }
    let due = due_of(s, 1_000 + instances.len() as u64, &p, 1000);
    let want: Vec<Alarm> = instances
        .iter()
        .enumerate()
        .map(|(n, i)| alarm(i, 1_000 + n as u64))
        .collect();
    assert_eq!(due, want, "K6: every instance has exactly its own alarm");
}
