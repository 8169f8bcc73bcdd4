//! Stress with a history check (issue 5).
//!
//! Eight threads run a seeded random mix of creates, version-checked puts,
//! patches, session creates and cascade deletes, listing walks, and tray
//! writes, batches, deletes and releases under moving epochs, against the
//! FILE store (`Durability::Immediate`: every `Ok` was synced, group commit
//! shares the syncs). Every call is recorded with a global logical
//! timestamp taken before and after it, and a checker then asserts over the
//! whole history:
//!
//! - no version of a run was acknowledged twice, and the versions
//!   acknowledged for a surviving run are exactly 1..=its final version;
//! - create seqs are unique and gap-free;
//! - every acknowledged patch is in the final totals exactly once;
//! - every listing walk saw each record that matched for the whole walk
//!   exactly once, no record twice, in `seq` order, and nothing that does
//!   not match its filter;
//! - no fenced write was acknowledged after a write of a newer epoch had
//!   been acknowledged for its instance, and `FenceLost` carries
//!   `stored >= caller + 1` and an epoch someone actually used;
//! - the final trays and epochs are what the acknowledged writes say;
//! - `verify()` is clean, before and after a reopen.
//!
//! `AGENTSTATE_STRESS_OPS` sets the total number of operations (default
//! 20,000); `AGENTSTATE_STRESS_SEED` the seed.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use agentstate::{
    FileStore, InstanceKey, PageRequest, RunKey, RunRecord, RunState, SessionKey, SessionRecord,
    StateDelta, StateError, StateQuery, StateStore, StoreAdmin, Tray, TrayOp, TrayStore,
};

const THREADS: usize = 8;
const OPS_DEFAULT: usize = 20_000;
const SEED_DEFAULT: u64 = 0x5eed_a9e7_57a7_e001;
const TENANT: &str = "acme";
const RUNS: u64 = 40;
const SESSIONS: u64 = 5;
const INSTANCES: usize = 3;
const TRAYS: usize = 3;
const AGENTS: [&str; 2] = ["planner", "coder"];

/// xorshift64*: small, seeded, no dependency.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.max(1))
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

fn run_id(n: u64) -> String {
    format!("run-{n}")
}
fn session_id(n: u64) -> String {
    format!("sess-{n}")
}
fn instance(i: usize) -> InstanceKey {
    InstanceKey::new("workers", format!("w{i}"))
}
fn tray_id(t: usize) -> String {
    format!("t{t}")
}

#[derive(Debug, Clone)]
enum Filter {
    All,
    State(RunState),
    Session(String),
    Agent(String),
}

impl Filter {
    fn query(&self) -> StateQuery {
        let q = StateQuery::new(TENANT);
        match self {
            Filter::All => q,
            Filter::State(s) => q.state(*s),
            Filter::Session(s) => q.session(s.clone()),
            Filter::Agent(a) => q.agent(a.clone()),
        }
    }
    /// Whether a record with these fields matches.
    fn matches(&self, state: RunState, session: Option<&str>, agent: &str) -> bool {
        match self {
            Filter::All => true,
            Filter::State(s) => *s == state,
            Filter::Session(s) => session == Some(s.as_str()),
            Filter::Agent(a) => a == agent,
        }
    }
}

#[derive(Debug)]
enum Call {
    Create {
        run: String,
        session: Option<String>,
        agent: &'static str,
    },
    Put {
        run: String,
        read_version: u64,
        state: RunState,
    },
    Patch {
        run: String,
        cost: u64,
    },
    CreateSession {
        // Read only through `Debug`, in violation messages.
        #[allow(dead_code)]
        session: String,
    },
    DeleteSession {
        session: String,
    },
    Walk {
        filter: Filter,
    },
    WriteTray {
        inst: usize,
        tray: usize,
        epoch: u64,
        doc: Vec<u8>,
    },
    Batch {
        inst: usize,
        epoch: u64,
        puts: Vec<(usize, Vec<u8>)>,
        deletes: Vec<usize>,
    },
    DeleteTray {
        inst: usize,
        tray: usize,
        epoch: u64,
    },
    Release {
        inst: usize,
        epoch: u64,
    },
}

/// What a walk saw: (run id, seq, state, session, agent) per item.
type Seen = Vec<(String, u64, RunState, Option<String>, String)>;

// One answer per call, moved once: boxing the run would only allocate.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum Out {
    Run(RunRecord),
    Deleted(Vec<RunKey>),
    Walk(Seen),
    Unit,
    Err(StateError),
}

#[derive(Debug)]
struct Event {
    start: u64,
    end: u64,
    /// Wall time of the call, for the report.
    micros: u64,
    call: Call,
    out: Out,
}

impl Event {
    fn ok(&self) -> bool {
        !matches!(self.out, Out::Err(_))
    }
    /// The kind of call, for the report.
    fn kind(&self) -> &'static str {
        match self.call {
            Call::Create { .. } => "create",
            Call::Put { .. } => "put",
            Call::Patch { .. } => "patch",
            Call::CreateSession { .. } => "session",
            Call::DeleteSession { .. } => "cascade",
            Call::Walk { .. } => "walk",
            Call::WriteTray { .. } => "tray",
            Call::Batch { .. } => "batch",
            Call::DeleteTray { .. } => "tray-del",
            Call::Release { .. } => "release",
        }
    }
    /// Happened entirely before `other` began.
    fn before(&self, other: &Event) -> bool {
        self.end < other.start
    }
}

fn tray(doc: Vec<u8>, marked: bool) -> Tray {
    Tray {
        marked,
        doc,
        env: "stress".into(),
        hostname: "localhost".into(),
    }
}

/// One thread's part of the workload.
fn worker(
    store: &FileStore,
    clock: &AtomicU64,
    thread: usize,
    ops: usize,
    seed: u64,
) -> Vec<Event> {
    let mut rng = Rng::new(seed ^ (thread as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut events = Vec::with_capacity(ops);
    let mut epochs = [0u64; INSTANCES];
    let mut docs = 0u64;
    let doc = |docs: &mut u64| {
        *docs += 1;
        format!("{thread}-{docs}").into_bytes()
    };
    let tick = || clock.fetch_add(1, Ordering::SeqCst);
    while events.len() < ops {
        let t0 = Instant::now();
        let roll = rng.below(100);
        let inst = rng.below(INSTANCES as u64) as usize;
        // A holder sometimes takes the instance over (a new placement, one
        // past the stored epoch) and sometimes carries on with an epoch
        // that may have gone stale meanwhile.
        if roll >= 60 && rng.chance(3) {
            epochs[inst] = store.epoch(&instance(inst)).expect("epoch") + 1;
        }
        let epoch = epochs[inst];
        let (call, start, out) = match roll {
            0..=9 => {
                let run = run_id(rng.below(RUNS));
                let session = rng.chance(60).then(|| session_id(rng.below(SESSIONS)));
                let agent = AGENTS[rng.below(2) as usize];
                let mut rec = RunRecord::new(RunKey::new(TENANT, run.clone()), agent);
                rec.session_id = session.clone();
                let start = tick();
                let out = store.put_run(rec);
                (
                    Call::Create {
                        run,
                        session,
                        agent,
                    },
                    start,
                    out.map(Out::Run),
                )
            }
            10..=25 => {
                let run = run_id(rng.below(RUNS));
                let key = RunKey::new(TENANT, run.clone());
                let Some(mut rec) = store.get_run(&key).expect("get_run") else {
                    continue;
                };
                let read_version = rec.version;
                let mut state = RunState::ALL[rng.below(RunState::ALL.len() as u64) as usize];
                // R9: a finished run stays finished.
                if rec.state.is_finished() {
                    state = rec.state;
                }
                rec.state = state;
                let start = tick();
                let out = store.put_run(rec);
                (
                    Call::Put {
                        run,
                        read_version,
                        state,
                    },
                    start,
                    out.map(Out::Run),
                )
            }
            26..=45 => {
                let run = run_id(rng.below(RUNS));
                let cost = 1 + rng.below(1_000);
                let delta = StateDelta {
                    cost_micros: cost,
                    iterations: 1,
                    ..Default::default()
                };
                let start = tick();
                let out = store.patch_run(&RunKey::new(TENANT, run.clone()), delta);
                (Call::Patch { run, cost }, start, out.map(Out::Run))
            }
            46..=50 => {
                let session = session_id(rng.below(SESSIONS));
                let start = tick();
                let out =
                    store.put_session(SessionRecord::new(SessionKey::new(TENANT, session.clone())));
                (
                    Call::CreateSession { session },
                    start,
                    out.map(|_| Out::Unit),
                )
            }
            51..=53 => {
                let session = session_id(rng.below(SESSIONS));
                let start = tick();
                let out = store.delete_session(&SessionKey::new(TENANT, session.clone()), true);
                (
                    Call::DeleteSession { session },
                    start,
                    out.map(Out::Deleted),
                )
            }
            54..=59 => {
                let filter = match rng.below(4) {
                    0 => Filter::All,
                    1 => {
                        Filter::State(RunState::ALL[rng.below(RunState::ALL.len() as u64) as usize])
                    }
                    2 => Filter::Session(session_id(rng.below(SESSIONS))),
                    _ => Filter::Agent(AGENTS[rng.below(2) as usize].to_string()),
                };
                let limit = 1 + rng.below(10) as usize;
                let start = tick();
                let mut seen = Seen::new();
                let q = filter.query();
                let mut req = PageRequest::new(limit);
                let out = loop {
                    match store.list_runs(&q, &req) {
                        Ok(page) => {
                            let (items, cursor) = page.into_parts();
                            seen.extend(items.into_iter().map(|r| {
                                (r.key.run_id, r.seq, r.state, r.session_id, r.agent_name)
                            }));
                            match cursor {
                                Some(c) => req = req.with_cursor(Some(c)),
                                None => break Ok(Out::Walk(seen)),
                            }
                        }
                        Err(e) => break Err(e),
                    }
                };
                (Call::Walk { filter }, start, out)
            }
            60..=79 => {
                let t = rng.below(TRAYS as u64) as usize;
                let d = doc(&mut docs);
                let marked = rng.chance(50);
                let start = tick();
                let out = store.write_tray(
                    &instance(inst).tray("tray", tray_id(t)),
                    epoch,
                    tray(d.clone(), marked),
                );
                (
                    Call::WriteTray {
                        inst,
                        tray: t,
                        epoch,
                        doc: d,
                    },
                    start,
                    out.map(|_| Out::Unit),
                )
            }
            80..=89 => {
                let mut puts = Vec::new();
                let mut deletes = Vec::new();
                let mut ops = Vec::new();
                for t in 0..TRAYS {
                    match rng.below(3) {
                        0 => {
                            let d = doc(&mut docs);
                            ops.push(TrayOp::Put {
                                tray_ns: "tray".into(),
                                tray_id: tray_id(t),
                                tray: tray(d.clone(), rng.chance(50)),
                            });
                            puts.push((t, d));
                        }
                        1 if rng.chance(30) => {
                            ops.push(TrayOp::Delete {
                                tray_ns: "tray".into(),
                                tray_id: tray_id(t),
                            });
                            deletes.push(t);
                        }
                        _ => {}
                    }
                }
                let start = tick();
                let out = store.apply_batch(&instance(inst), epoch, ops);
                (
                    Call::Batch {
                        inst,
                        epoch,
                        puts,
                        deletes,
                    },
                    start,
                    out.map(|_| Out::Unit),
                )
            }
            90..=93 => {
                let t = rng.below(TRAYS as u64) as usize;
                let start = tick();
                let out = store.delete_tray(&instance(inst).tray("tray", tray_id(t)), epoch);
                (
                    Call::DeleteTray {
                        inst,
                        tray: t,
                        epoch,
                    },
                    start,
                    out.map(|_| Out::Unit),
                )
            }
            _ => {
                let start = tick();
                let out = store.release(&instance(inst), epoch);
                (Call::Release { inst, epoch }, start, out.map(|_| Out::Unit))
            }
        };
        let end = tick();
        if let Err(StateError::FenceLost { stored, .. }) = &out
            && rng.chance(70)
        {
            // A fenced-out holder usually learns the new placement's epoch
            // (and so races its holder at an equal epoch); the rest stay
            // stale a while longer.
            epochs[inst] = *stored;
        }
        let micros = t0.elapsed().as_micros() as u64;
        events.push(Event {
            start,
            end,
            micros,
            call,
            out: out.unwrap_or_else(Out::Err),
        });
    }
    events
}

/// One incarnation of a run: its create and every acknowledged write.
#[derive(Debug, Default)]
struct Incarnation {
    create: usize,
    agent: String,
    session: Option<String>,
    versions: Vec<(u64, usize)>,
    /// (version, state, event) of acknowledged puts.
    puts: Vec<(u64, RunState, usize)>,
    patch_cost: u64,
    patches: u64,
}

/// An incarnation's acknowledged puts, for answering "what was its state
/// during this walk, if no put overlapped it" in O(log puts).
struct PutIndex {
    /// (end, version, state), by end.
    by_end: Vec<(u64, u64, RunState)>,
    /// The newest (version, state) among `by_end[..=i]`.
    newest_upto: Vec<(u64, RunState)>,
    /// The earliest start among `by_end[i..]`; `u64::MAX` past the end.
    min_start_from: Vec<u64>,
}

impl PutIndex {
    fn new(events: &[Event], inc: &Incarnation) -> PutIndex {
        let mut puts: Vec<(u64, u64, RunState, u64)> = inc
            .puts
            .iter()
            .map(|&(v, s, p)| (events[p].end, v, s, events[p].start))
            .collect();
        puts.sort_by_key(|p| p.0);
        let mut newest_upto = Vec::with_capacity(puts.len());
        let mut best = (0, RunState::Pending);
        for p in &puts {
            if p.1 > best.0 {
                best = (p.1, p.2);
            }
            newest_upto.push(best);
        }
        let mut min_start_from = vec![u64::MAX; puts.len() + 1];
        for i in (0..puts.len()).rev() {
            min_start_from[i] = min_start_from[i + 1].min(puts[i].3);
        }
        PutIndex {
            by_end: puts.iter().map(|p| (p.0, p.1, p.2)).collect(),
            newest_upto,
            min_start_from,
        }
    }
}

struct Checker<'a> {
    events: &'a [Event],
    violations: Vec<String>,
}

impl Checker<'_> {
    fn fail(&mut self, s: String) {
        if self.violations.len() < 50 {
            eprintln!("violation: {s}");
        }
        self.violations.push(s);
    }

    /// Every error is one the call can legitimately return, with the facts
    /// the spec names.
    fn check_errors(&mut self) {
        for (i, e) in self.events.iter().enumerate() {
            let Out::Err(err) = &e.out else { continue };
            let fine = match (&e.call, err) {
                (
                    Call::Create { .. },
                    StateError::Conflict {
                        expected: 0,
                        actual,
                        ..
                    },
                ) => *actual >= 1,
                (
                    Call::Create {
                        session: Some(_), ..
                    },
                    StateError::NotFound(_),
                ) => true,
                (
                    Call::Put { read_version, .. },
                    StateError::Conflict {
                        expected, actual, ..
                    },
                ) => expected == read_version && actual != read_version,
                (Call::Patch { .. }, StateError::NotFound(_)) => true,
                (
                    Call::CreateSession { .. },
                    StateError::Conflict {
                        expected: 0,
                        actual,
                        ..
                    },
                ) => *actual >= 1,
                (Call::DeleteSession { .. }, StateError::NotFound(_)) => true,
                (
                    Call::WriteTray { epoch, .. }
                    | Call::Batch { epoch, .. }
                    | Call::DeleteTray { epoch, .. },
                    StateError::FenceLost { caller, stored, .. },
                ) => caller == epoch && *stored > *caller,
                _ => false,
            };
            if !fine {
                self.fail(format!("event {i}: {:?} got unexpected {err:?}", e.call));
            }
        }
    }

    fn incarnations(&mut self) -> BTreeMap<(String, u64), Incarnation> {
        let mut incs: BTreeMap<(String, u64), Incarnation> = BTreeMap::new();
        let mut seqs = BTreeSet::new();
        for (i, e) in self.events.iter().enumerate() {
            if let (
                Call::Create {
                    run,
                    session,
                    agent,
                },
                Out::Run(r),
            ) = (&e.call, &e.out)
            {
                if !seqs.insert(r.seq) {
                    self.fail(format!("seq {} handed to two creates", r.seq));
                }
                if r.version != 1
                    || &r.key.run_id != run
                    || r.session_id != *session
                    || r.agent_name != *agent
                {
                    self.fail(format!("create {run} stored {r:?}"));
                }
                incs.insert(
                    (run.clone(), r.seq),
                    Incarnation {
                        create: i,
                        agent: agent.to_string(),
                        session: session.clone(),
                        versions: vec![(1, i)],
                        ..Default::default()
                    },
                );
            }
        }
        if let Some(&max) = seqs.last()
            && max != seqs.len() as u64
        {
            self.fail(format!(
                "create seqs have gaps: {} creates, highest seq {max}",
                seqs.len()
            ));
        }
        for (i, e) in self.events.iter().enumerate() {
            let (run, r) = match (&e.call, &e.out) {
                (Call::Put { run, .. } | Call::Patch { run, .. }, Out::Run(r)) => (run, r),
                _ => continue,
            };
            let Some(inc) = incs.get_mut(&(run.clone(), r.seq)) else {
                self.fail(format!(
                    "event {i}: write acknowledged for unknown run {run} seq {}",
                    r.seq
                ));
                continue;
            };
            inc.versions.push((r.version, i));
            match &e.call {
                Call::Put {
                    read_version,
                    state,
                    ..
                } => {
                    if r.version != read_version + 1 || r.state != *state {
                        self.fail(format!(
                            "event {i}: put from v{read_version} stored v{} {:?}",
                            r.version, r.state
                        ));
                    }
                    inc.puts.push((r.version, *state, i));
                }
                Call::Patch { cost, .. } => {
                    inc.patch_cost += cost;
                    inc.patches += 1;
                }
                _ => unreachable!(),
            }
        }
        for ((run, seq), inc) in incs.iter_mut() {
            inc.versions.sort();
            for w in inc.versions.windows(2) {
                if w[0].0 == w[1].0 {
                    self.fail(format!(
                        "run {run} seq {seq}: version {} acknowledged to events {} and {}",
                        w[0].0, w[0].1, w[1].1
                    ));
                }
            }
        }
        incs
    }

    /// Final records against the history.
    fn check_final_runs(&mut self, store: &FileStore, incs: &BTreeMap<(String, u64), Incarnation>) {
        let mut live = BTreeSet::new();
        for n in 0..RUNS {
            let run = run_id(n);
            let Some(r) = store
                .get_run(&RunKey::new(TENANT, run.clone()))
                .expect("get_run")
            else {
                continue;
            };
            live.insert((run.clone(), r.seq));
            let Some(inc) = incs.get(&(run.clone(), r.seq)) else {
                self.fail(format!("final {run} seq {} was never created", r.seq));
                continue;
            };
            if r.cost_micros != inc.patch_cost || r.iterations != inc.patches {
                self.fail(format!(
                    "{run}: final cost {} / iterations {}, acknowledged patches add to {} / {}",
                    r.cost_micros, r.iterations, inc.patch_cost, inc.patches
                ));
            }
            let acked: Vec<u64> = inc.versions.iter().map(|v| v.0).collect();
            if acked != (1..=r.version).collect::<Vec<_>>() {
                self.fail(format!(
                    "{run}: final version {} but acknowledged versions {acked:?}",
                    r.version
                ));
            }
            let want_state = inc
                .puts
                .iter()
                .max_by_key(|p| p.0)
                .map_or(RunState::Pending, |p| p.1);
            if r.state != want_state {
                self.fail(format!(
                    "{run}: final state {:?}, last acknowledged put set {want_state:?}",
                    r.state
                ));
            }
            if let Some(s) = &r.session_id
                && store
                    .get_session(&SessionKey::new(TENANT, s.clone()))
                    .expect("get_session")
                    .is_none()
            {
                self.fail(format!("{run}: outlived its session {s}"));
            }
        }
        // A run that is gone was deleted by an acknowledged cascade.
        for ((run, seq), inc) in incs {
            if live.contains(&(run.clone(), *seq)) {
                continue;
            }
            let created = &self.events[inc.create];
            let deleted = self.events.iter().any(|d| match (&d.call, &d.out) {
                (Call::DeleteSession { session }, Out::Deleted(runs)) => {
                    inc.session.as_ref() == Some(session)
                        && d.end > created.start
                        && runs.iter().any(|k| &k.run_id == run)
                }
                _ => false,
            });
            if !deleted {
                self.fail(format!(
                    "{run} seq {seq} vanished without an acknowledged delete"
                ));
            }
        }
    }

    fn check_walks(&mut self, incs: &BTreeMap<(String, u64), Incarnation>) -> (u64, u64) {
        let (mut walks, mut must_see) = (0u64, 0u64);
        let put_index: HashMap<&(String, u64), PutIndex> = incs
            .iter()
            .map(|(k, inc)| (k, PutIndex::new(self.events, inc)))
            .collect();
        // The acknowledged cascades that may have deleted each incarnation.
        let mut deleters: HashMap<&(String, u64), Vec<usize>> =
            incs.keys().map(|k| (k, Vec::new())).collect();
        for (i, d) in self.events.iter().enumerate() {
            if let (Call::DeleteSession { .. }, Out::Deleted(runs)) = (&d.call, &d.out) {
                for r in runs {
                    for (k, inc) in incs.range((r.run_id.clone(), 0)..=(r.run_id.clone(), u64::MAX))
                    {
                        if d.end > self.events[inc.create].start {
                            deleters.get_mut(k).expect("every incarnation").push(i);
                        }
                    }
                }
            }
        }
        for (i, w) in self.events.iter().enumerate() {
            let (Call::Walk { filter }, Out::Walk(seen)) = (&w.call, &w.out) else {
                continue;
            };
            walks += 1;
            let mut got: BTreeMap<(String, u64), usize> = BTreeMap::new();
            let mut last_seq = 0;
            for (run, seq, state, session, agent) in seen {
                if *seq <= last_seq {
                    self.fail(format!("walk {i}: seq {seq} after {last_seq}"));
                }
                last_seq = *seq;
                *got.entry((run.clone(), *seq)).or_default() += 1;
                if !filter.matches(*state, session.as_deref(), agent) {
                    self.fail(format!("walk {i} ({filter:?}) returned non-matching {run} {state:?} {session:?} {agent}"));
                }
                match incs.get(&(run.clone(), *seq)) {
                    Some(inc) if self.events[inc.create].start < w.end => {}
                    _ => self.fail(format!(
                        "walk {i} returned {run} seq {seq}, which no create had made"
                    )),
                }
            }
            for (k, n) in &got {
                if *n > 1 {
                    self.fail(format!("walk {i} saw {} seq {} {n} times", k.0, k.1));
                }
            }
            for (k, inc) in incs {
                let created = &self.events[inc.create];
                if !created.before(w) || deleters[k].iter().any(|&d| self.events[d].start < w.end) {
                    continue;
                }
                // The state during the walk is known only when no
                // acknowledged put overlaps it: then it is the state of the
                // newest put that ended before the walk began.
                let ix = &put_index[k];
                let before = ix.by_end.partition_point(|p| p.0 < w.start);
                if ix.min_start_from[before] <= w.end {
                    continue;
                }
                let state = if before == 0 {
                    RunState::Pending
                } else {
                    ix.newest_upto[before - 1].1
                };
                if !filter.matches(state, inc.session.as_deref(), &inc.agent) {
                    continue;
                }
                must_see += 1;
                if !got.contains_key(k) {
                    self.fail(format!("walk {i} ({filter:?}) missed {} seq {} that existed and matched throughout", k.0, k.1));
                }
            }
        }
        (walks, must_see)
    }

    fn check_fences(&mut self, store: &FileStore) -> u64 {
        let mut fence_lost = 0;
        for inst in 0..INSTANCES {
            // (epoch, event, is a write) of every acknowledged fenced call.
            let mut acked: Vec<(u64, usize, bool)> = Vec::new();
            let mut used: Vec<(u64, usize)> = Vec::new();
            for (i, e) in self.events.iter().enumerate() {
                let (epoch, write) = match &e.call {
                    Call::WriteTray { inst: n, epoch, .. }
                    | Call::Batch { inst: n, epoch, .. }
                    | Call::DeleteTray { inst: n, epoch, .. }
                        if *n == inst =>
                    {
                        (*epoch, true)
                    }
                    Call::Release { inst: n, epoch } if *n == inst => (*epoch, false),
                    _ => continue,
                };
                used.push((epoch, i));
                if e.ok() {
                    acked.push((epoch, i, write));
                }
            }
            // No write landed after a call with a newer epoch had been
            // acknowledged: walking epochs from the top down, keep the
            // earliest acknowledgement of any strictly newer epoch.
            acked.sort_by_key(|a| std::cmp::Reverse(a.0));
            let mut earliest_newer: Option<(u64, usize)> = None;
            let mut k = 0;
            while k < acked.len() {
                let e = acked[k].0;
                let same = acked[k..].iter().take_while(|a| a.0 == e).count();
                for &(_, w, write) in &acked[k..k + same] {
                    if let Some((end, x)) = earliest_newer
                        && write
                        && end < self.events[w].start
                    {
                        let newer = acked.iter().find(|a| a.1 == x).map_or(0, |a| a.0);
                        self.fail(format!("instance {inst}: event {w} at epoch {e} acknowledged after event {x} at epoch {newer}"));
                    }
                }
                for &(_, x, _) in &acked[k..k + same] {
                    let end = self.events[x].end;
                    if earliest_newer.is_none_or(|(m, _)| end < m) {
                        earliest_newer = Some((end, x));
                    }
                }
                k += same;
            }
            // The epoch a FenceLost names was used by a call that began
            // before the refusal ended.
            let mut first_use: HashMap<u64, u64> = HashMap::new();
            for &(ep, j) in &used {
                let s = first_use.entry(ep).or_insert(u64::MAX);
                *s = (*s).min(self.events[j].start);
            }
            for &(_, i) in &used {
                let e = &self.events[i];
                if let Out::Err(StateError::FenceLost { stored, .. }) = &e.out {
                    fence_lost += 1;
                    if first_use.get(stored).is_none_or(|&s| s >= e.end) {
                        self.fail(format!(
                            "event {i}: FenceLost names stored epoch {stored} no caller had used"
                        ));
                    }
                }
            }
            let max = acked.iter().map(|a| a.0).max().unwrap_or(0);
            let stored = store.epoch(&instance(inst)).expect("epoch");
            if stored != max {
                self.fail(format!(
                    "instance {inst}: stored epoch {stored}, highest acknowledged {max}"
                ));
            }
            self.check_final_trays(store, inst, stored);
        }
        fence_lost
    }

    /// The final doc of each tray is the one its last acknowledged write
    /// left: no acknowledged write or delete of that tray began after it.
    fn check_final_trays(&mut self, store: &FileStore, inst: usize, epoch: u64) {
        for t in 0..TRAYS {
            // (event, Some(doc) for a write, None for a delete), acknowledged.
            let mut muts: Vec<(usize, Option<&[u8]>)> = Vec::new();
            for (i, e) in self.events.iter().enumerate() {
                if !e.ok() {
                    continue;
                }
                match &e.call {
                    Call::WriteTray {
                        inst: n, tray, doc, ..
                    } if *n == inst && *tray == t => muts.push((i, Some(doc))),
                    Call::DeleteTray { inst: n, tray, .. } if *n == inst && *tray == t => {
                        muts.push((i, None))
                    }
                    Call::Batch {
                        inst: n,
                        puts,
                        deletes,
                        ..
                    } if *n == inst => {
                        if let Some((_, d)) = puts.iter().find(|p| p.0 == t) {
                            muts.push((i, Some(d)));
                        }
                        if deletes.contains(&t) {
                            muts.push((i, None));
                        }
                    }
                    _ => {}
                }
            }
            let key = instance(inst).tray("tray", tray_id(t));
            let fin = store
                .read_tray(&key, epoch)
                .expect("read_tray")
                .map(|t| t.doc);
            // The mutation that left the final state must not be followed
            // (strictly after it) by another acknowledged one.
            let latest_start = muts
                .iter()
                .map(|&(j, _)| self.events[j].start)
                .max()
                .unwrap_or(0);
            let last_ok = |this: usize| self.events[this].end >= latest_start;
            let explained = match &fin {
                Some(doc) => muts
                    .iter()
                    .any(|&(i, d)| d == Some(doc.as_slice()) && last_ok(i)),
                None => muts.is_empty() || muts.iter().any(|&(i, d)| d.is_none() && last_ok(i)),
            };
            if !explained {
                self.fail(format!("instance {inst} tray {t}: final {:?} is not what the last acknowledged write left", fin.as_deref().map(String::from_utf8_lossy)));
            }
        }
    }
}

#[test]
fn stress_history_is_linearizable_enough() {
    let ops: usize = std::env::var("AGENTSTATE_STRESS_OPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(OPS_DEFAULT);
    let seed: u64 = std::env::var("AGENTSTATE_STRESS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(SEED_DEFAULT);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("store");
    let store = Arc::new(FileStore::open(&path).expect("open file store"));
    let clock = Arc::new(AtomicU64::new(1));
    let t0 = Instant::now();
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (store, clock) = (store.clone(), clock.clone());
            let n = ops / THREADS + usize::from(t < ops % THREADS);
            std::thread::spawn(move || worker(&store, &clock, t, n, seed))
        })
        .collect();
    let mut events: Vec<Event> = handles
        .into_iter()
        .flat_map(|h| h.join().expect("worker panicked"))
        .collect();
    let secs = t0.elapsed().as_secs_f64();
    events.sort_by_key(|e| e.start);

    let t1 = Instant::now();
    let mut c = Checker {
        events: &events,
        violations: Vec::new(),
    };
    c.check_errors();
    let incs = c.incarnations();
    c.check_final_runs(&store, &incs);
    let (walks, must_see) = c.check_walks(&incs);
    let fence_lost = c.check_fences(&store);
    let report = store.verify().expect("verify");
    if !report.is_ok() {
        c.fail(format!("verify: {:?}", report.problems));
    }
    let marked = store
        .marked_trays(None, &PageRequest::new(1000))
        .expect("marked_trays");
    for m in marked.items() {
        let t = store
            .epoch(&m.key.instance())
            .and_then(|e| store.read_tray(&m.key, e))
            .expect("read_tray");
        if !t.is_some_and(|t| t.marked) {
            c.fail(format!(
                "marked index names {:?}, which is not marked",
                m.key
            ));
        }
    }
    let check_secs = t1.elapsed().as_secs_f64();
    let acked = events.iter().filter(|e| e.ok()).count();
    let commits = store.commits();
    println!(
        "stress: {} ops ({acked} ok, {fence_lost} fence-lost) in {secs:.2} s = {:.0} ops/s; {commits} group commits; \
         {} runs created, {walks} walks checked against {must_see} must-see records in {check_secs:.2} s; {} violations",
        events.len(),
        events.len() as f64 / secs,
        incs.len(),
        c.violations.len()
    );
    // Mean latency by kind of call, over the first and the last tenth of
    // the run: a store that slows down as its history grows shows here.
    let tenth = events.len() / 10;
    for (label, part) in [
        ("first tenth", &events[..tenth]),
        ("last tenth", &events[events.len() - tenth..]),
    ] {
        let mut by: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
        for e in part {
            let v = by.entry(e.kind()).or_default();
            v.0 += e.micros;
            v.1 += 1;
        }
        let means: Vec<String> = by
            .iter()
            .map(|(k, (us, n))| format!("{k} {:.1}", *us as f64 / *n as f64 / 1000.0))
            .collect();
        println!("stress: mean ms per call, {label}: {}", means.join(", "));
    }
    let violations = std::mem::take(&mut c.violations);
    assert!(
        violations.is_empty(),
        "{} violations, first: {:?}",
        violations.len(),
        &violations[..violations.len().min(10)]
    );

    // What was acknowledged survives a reopen, and the reopened store is clean.
    let expected: HashMap<String, Option<RunRecord>> = (0..RUNS)
        .map(|n| {
            (
                run_id(n),
                store
                    .get_run(&RunKey::new(TENANT, run_id(n)))
                    .expect("get_run"),
            )
        })
        .collect();
    drop(store);
    let store = FileStore::open(&path).expect("reopen");
    for (run, rec) in &expected {
        assert_eq!(
            &store
                .get_run(&RunKey::new(TENANT, run.clone()))
                .expect("get_run"),
            rec,
            "{run} after reopen"
        );
    }
    let report = store.verify().expect("verify after reopen");
    assert!(report.is_ok(), "verify after reopen: {:?}", report.problems);
}
