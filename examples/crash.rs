//! The crash harness (rule D1): kill -9 a writer at random moments and check
//! that the file store kept every acknowledged write, tore none, and still
//! verifies.
//!
//! ```text
//! cargo run --release --example crash -- --cycles 50 [--seed 7] [--dir DIR] [--max-ms 1000] [--engine fjall|sled]
//! ```
//!
//! `--engine sled` runs it on the sled engine (build with `--features sled`).
//!
//! One binary is both parent and child; the child is chosen by the
//! `AGENTSTATE_CRASH_CHILD` environment variable. The child opens the store
//! and runs a mixed workload on 2–4 threads (creates, version-checked puts,
//! patches, a shared spend run every thread patches, sessions with cascade
//! deletes, tray batches and releases fenced at a rising epoch, alarms set
//! and acknowledged). Before each write it prints a `try` line with the
//! write's whole predicted effect, and after the write returned `Ok` an
//! `ack` line with its exact effect, both as JSON. The parent keeps the
//! model: it kills the child with SIGKILL after a random delay (some cycles
//! within the first 30 ms, while the child is still opening and recovering
//! the store; some on a fresh path, while the store is being created), then
//! reopens the store and checks that
//!
//! - every acknowledged write is there with exact values;
//! - every write in flight at the kill is wholly there or wholly absent;
//! - the shared spend run holds the acknowledged patches plus some of the
//!   ones in flight, and its version counts exactly those;
//! - `seq`s are never reused and versions never go backwards;
//! - `verify()` is clean, and the listings agree with the records.
//!
//! The last line is `crash: cycles=N acked=A lost=L torn=T
//! index_mismatch=I open_errors=O`; the exit status is nonzero when any of
//! L, T, I, O (or a child's own error) is nonzero.
//!
//! `tests/it/durability.rs` includes this file as a module and runs a short
//! version of the same harness with the test binary as the child.

#![allow(clippy::print_stdout)]

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentstate::{
    Approval, Entry, FileEngine, FileStore, InstanceKey, Options, RunKey, RunRecord, RunState,
    SessionKey, SessionRecord, StateDelta, StateError, StateQuery, StateStore, StoreAdmin,
    ToolCall, Tray, TrayOp, TrayStore, Usage,
};
use serde::{Deserialize, Serialize};

/// The environment variable that makes the binary a child:
/// `MODE:SEED:CYCLE:DIR` with MODE one of `work`, `create`, `open`.
pub const CHILD_ENV: &str = "AGENTSTATE_CRASH_CHILD";
/// The engine a child opens the store with (`fjall`, the default, or `sled`).
pub const ENGINE_ENV: &str = "AGENTSTATE_CRASH_ENGINE";
/// Every run the harness writes belongs to this tenant.
pub const TENANT: &str = "acme";
/// The run every child thread patches; its cost is checked as a sum.
pub const SPEND_RUN: &str = "spend";
/// A child stops on its own after this long, in case nobody kills it.
const CHILD_LIFETIME: Duration = Duration::from_secs(120);

// ---------------------------------------------------------------------------
// A tiny deterministic RNG (xorshift64*), so a seed replays a run's choices.

/// xorshift64*, seeded through splitmix64 so nearby seeds diverge.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed` (any value, 0 included).
    pub fn new(seed: u64) -> Rng {
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Rng((z ^ (z >> 31)) | 1)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "below(0)");
        self.next_u64() % n
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
    /// True with probability `percent`/100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

// ---------------------------------------------------------------------------
// What the child tells the parent.

/// A record as the harness models it: one per store key.
// Runs are most of what the harness holds; boxing them would only add an
// allocation per record.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Obj {
    /// A run.
    Run(RunRecord),
    /// A session.
    Session(SessionRecord),
    /// An instance's stored epoch.
    Epoch(u64),
    /// A tray.
    Tray(Tray),
    /// An instance's alarm.
    Alarm(u64),
}

/// One write: every key it changes with its value after the write (`None`:
/// deleted), and the cost it adds to the shared spend run.
///
/// In a `try` line, run and session timestamps and the `seq` of a new run
/// are 0: the store assigns them, so the parent accepts any value there. In
/// an `ack` line every value is exactly what the store returned.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Op {
    /// `cycle.thread.n`, unique in a cycle.
    pub id: String,
    /// What the write is, for reports.
    pub what: String,
    /// Key → value after the write.
    pub effects: BTreeMap<String, Option<Obj>>,
    /// Cost added to the spend run (0: the op does not patch it).
    pub spend: u64,
}

fn run_name(k: &RunKey) -> String {
    format!("run/{}/{}", k.tenant, k.run_id)
}
fn session_name(k: &SessionKey) -> String {
    format!("session/{}/{}", k.tenant, k.session_id)
}
fn epoch_name(i: &InstanceKey) -> String {
    format!("epoch/{}/{}", i.ns, i.id)
}
fn alarm_name(i: &InstanceKey) -> String {
    format!("alarm/{}/{}", i.ns, i.id)
}
fn tray_name(i: &InstanceKey, tray_id: &str) -> String {
    format!("tray/{}/{}/b/{}", i.ns, i.id, tray_id)
}

/// One line to the parent, written whole and flushed. A child whose parent
/// is gone has nobody to report to and stops.
fn emit(line: &str) {
    let mut out = std::io::stdout().lock();
    if writeln!(out, "{line}").and_then(|_| out.flush()).is_err() {
        std::process::exit(0);
    }
}

fn emit_op(kind: &str, op: &Op) {
    let json = serde_json::to_string(op).expect("ops serialize");
    emit(&format!("{kind} {json}"));
}

/// Reports a harness failure seen by the child (an unexpected error, or a
/// store answer that contradicts the rules). The parent counts these.
fn bug(msg: &str) {
    emit(&format!("bug {}", msg.replace('\n', " ")));
}

// ---------------------------------------------------------------------------
// The child.

/// Runs the child if `CHILD_ENV` is set; returns `false` otherwise. Never
/// returns when it ran (the parent kills it, or it exits).
pub fn child_main_if_requested() -> bool {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return false;
    };
    let mut parts = spec.splitn(4, ':');
    let (Some(mode), Some(seed), Some(cycle), Some(dir)) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        eprintln!("{CHILD_ENV} must be MODE:SEED:CYCLE:DIR, got {spec:?}");
        std::process::exit(2);
    };
    let seed: u64 = seed.parse().unwrap_or(0);
    let cycle: u64 = cycle.parse().unwrap_or(0);
    // A test harness may have printed half a line before us.
    emit("");
    match mode {
        "work" => child_work(Path::new(dir), seed, cycle),
        "create" => child_create(Path::new(dir), cycle, true),
        "open" => child_create(Path::new(dir), cycle, false),
        other => {
            bug(&format!("unknown child mode {other}"));
            std::process::exit(2);
        }
    }
    std::process::exit(0);
}

/// Parses an engine's name as `--engine` and `ENGINE_ENV` spell it.
pub fn parse_engine(name: &str) -> Option<FileEngine> {
    match name {
        "fjall" => Some(FileEngine::Fjall),
        "sled" => Some(FileEngine::Sled),
        _ => None,
    }
}

/// Opens the store at `dir` on `engine`.
pub fn open_store(dir: &Path, engine: FileEngine) -> Result<FileStore, StateError> {
    FileStore::open_with(dir, Options::new().engine(engine))
}

fn open_or_exit(dir: &Path) -> FileStore {
    emit("phase open");
    let engine = std::env::var(ENGINE_ENV)
        .ok()
        .and_then(|n| parse_engine(&n))
        .unwrap_or_default();
    match open_store(dir, engine) {
        Ok(s) => {
            emit("phase opened");
            s
        }
        Err(e) => {
            bug(&format!("open {}: {e}", dir.display()));
            std::process::exit(3);
        }
    }
}

/// `create`: opens (creating) a fresh store, then creates runs one after
/// another. `open`: only opens it, then waits to be killed.
fn child_create(dir: &Path, cycle: u64, write: bool) {
    let store = open_or_exit(dir);
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < CHILD_LIFETIME {
        if !write {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        n += 1;
        let key = RunKey::new(TENANT, format!("first.{n}"));
        let mut op = Op {
            id: format!("{cycle}.0.{n}"),
            what: "create run".into(),
            effects: BTreeMap::new(),
            spend: 0,
        };
        op.effects.insert(
            run_name(&key),
            Some(Obj::Run(
                RunRecord::new(key.clone(), "first").with_version(1),
            )),
        );
        emit_op("try", &op);
        match store.put_run(RunRecord::new(key.clone(), "first")) {
            Ok(r) => {
                op.effects.insert(run_name(&key), Some(Obj::Run(r)));
                emit_op("ack", &op);
            }
            Err(e) => {
                bug(&format!("create {}: {e}", key.run_id));
                std::process::exit(4);
            }
        }
    }
}

trait WithVersion {
    fn with_version(self, v: u64) -> Self;
}
impl WithVersion for RunRecord {
    fn with_version(mut self, v: u64) -> Self {
        self.version = v;
        self
    }
}

/// `work`: the mixed workload on 2–4 threads.
fn child_work(dir: &Path, seed: u64, cycle: u64) {
    let store = Arc::new(open_or_exit(dir));
    let mut rng = Rng::new(seed);
    let threads = rng.range(2, 4);
    emit(&format!("phase threads={threads}"));
    let handles: Vec<_> = (0..threads)
        .map(|tid| {
            let store = store.clone();
            let seed = rng.next_u64();
            std::thread::spawn(move || {
                let mut w = Worker::new(&store, tid, cycle, seed);
                w.run();
            })
        })
        .collect();
    for h in handles {
        let _ = h.join();
    }
    emit("phase done");
}

/// One thread of the workload. It owns its keys (its runs, sessions, long
/// run, instance), so it always knows their exact state and can predict
/// every write's effect; only the spend run is shared.
struct Worker<'a> {
    store: &'a FileStore,
    tid: u64,
    cycle: u64,
    rng: Rng,
    n: u64,
    /// This cycle's runs of this thread, as last returned by the store.
    runs: BTreeMap<String, RunRecord>,
    /// This thread's long-lived run (all cycles).
    long: Option<RunRecord>,
    /// This cycle's sessions of this thread, with their runs.
    sessions: BTreeMap<String, (SessionRecord, BTreeSet<String>)>,
    inst: InstanceKey,
    epoch: u64,
    /// The instance's trays, as this thread knows them.
    trays: BTreeMap<String, Tray>,
    alarm: Option<u64>,
}

impl<'a> Worker<'a> {
    fn new(store: &'a FileStore, tid: u64, cycle: u64, seed: u64) -> Self {
        Worker {
            store,
            tid,
            cycle,
            rng: Rng::new(seed),
            n: 0,
            runs: BTreeMap::new(),
            long: None,
            sessions: BTreeMap::new(),
            inst: InstanceKey::new("w", format!("t{tid}")),
            epoch: 0,
            trays: BTreeMap::new(),
            alarm: None,
        }
    }

    fn op(&mut self, what: &str) -> Op {
        self.n += 1;
        Op {
            id: format!("{}.{}.{}", self.cycle, self.tid, self.n),
            what: what.to_string(),
            effects: BTreeMap::new(),
            spend: 0,
        }
    }

    fn fail(&self, op: &Op, e: &StateError) -> ! {
        bug(&format!("{} ({}): {e}", op.what, op.id));
        std::process::exit(5);
    }

    fn run(&mut self) {
        let start = Instant::now();
        self.setup();
        while start.elapsed() < CHILD_LIFETIME {
            let pick = self.rng.below(100);
            match pick {
                0..=17 => self.create_run(),
                18..=35 => self.put_run(),
                36..=47 => self.patch_run(),
                48..=57 => self.patch_spend(),
                58..=62 => self.create_session(),
                63..=65 => self.put_session(),
                66..=69 => self.cascade(),
                70..=80 => self.batch(),
                81..=83 => self.release(),
                84..=88 => self.set_alarm(),
                89..=91 => self.ack_alarm(),
                92..=96 => self.put_long(),
                _ => self.stale_checks(),
            }
        }
    }

    /// Learns this thread's lasting state: its long run (created if
    /// absent), its instance's epoch (raised by one) and trays.
    fn setup(&mut self) {
        let key = RunKey::new(TENANT, format!("long.t{}", self.tid));
        match self.store.get_run(&key) {
            Ok(Some(r)) => self.long = Some(r),
            Ok(None) => {
                let mut op = self.op("create long run");
                let pred = RunRecord::new(key.clone(), "long").with_version(1);
                op.effects.insert(run_name(&key), Some(Obj::Run(pred)));
                emit_op("try", &op);
                match self.store.put_run(RunRecord::new(key.clone(), "long")) {
                    Ok(r) => {
                        op.effects.insert(run_name(&key), Some(Obj::Run(r.clone())));
                        emit_op("ack", &op);
                        self.long = Some(r);
                    }
                    Err(e) => self.fail(&op, &e),
                }
            }
            Err(e) => {
                bug(&format!("get long run: {e}"));
                std::process::exit(5);
            }
        }
        let stored = match self.store.epoch(&self.inst) {
            Ok(e) => e,
            Err(e) => {
                bug(&format!("epoch: {e}"));
                std::process::exit(5);
            }
        };
        self.epoch = stored + 1;
        // Listing the trays at the new epoch stores it: that is a write.
        let mut op = self.op("list trays at a new epoch");
        op.effects
            .insert(epoch_name(&self.inst), Some(Obj::Epoch(self.epoch)));
        emit_op("try", &op);
        let store = self.store;
        for item in store.iter_trays(&self.inst, self.epoch).page_size(100) {
            match item {
                Ok((k, t)) => {
                    if k.tray_ns == "b" {
                        self.trays.insert(k.tray_id, t);
                    }
                }
                Err(e) => self.fail(&op, &e),
            }
        }
        emit_op("ack", &op);
    }

    fn pick_run(&mut self) -> Option<RunRecord> {
        if self.runs.is_empty() {
            return None;
        }
        let i = self.rng.below(self.runs.len() as u64) as usize;
        self.runs.values().nth(i).cloned()
    }

    fn create_run(&mut self) {
        let id = format!("c{}.t{}.r{}", self.cycle, self.tid, self.n + 1);
        let key = RunKey::new(TENANT, id.clone());
        let mut rec = RunRecord::new(key.clone(), format!("agent{}", self.rng.below(3)));
        let mut session = None;
        if !self.sessions.is_empty() && self.rng.chance(50) {
            let i = self.rng.below(self.sessions.len() as u64) as usize;
            let s = self
                .sessions
                .keys()
                .nth(i)
                .cloned()
                .expect("index in range");
            rec = rec.with_session(s.clone());
            session = Some(s);
        }
        let mut op = self.op("create run");
        op.effects.insert(
            run_name(&key),
            Some(Obj::Run(rec.scrubbed().with_version(1))),
        );
        emit_op("try", &op);
        match self.store.put_run(rec) {
            Ok(r) => {
                op.effects.insert(run_name(&key), Some(Obj::Run(r.clone())));
                emit_op("ack", &op);
                if let Some((_, runs)) = session.and_then(|s| self.sessions.get_mut(&s)) {
                    runs.insert(id.clone());
                }
                self.runs.insert(id, r);
            }
            Err(e) => self.fail(&op, &e),
        }
    }

    /// A new state, tool calls and approval for `r`, as a put would send it.
    fn mutate(&mut self, r: &RunRecord) -> RunRecord {
        let mut next = r.clone();
        next.state = RunState::ALL[self.rng.below(RunState::ALL.len() as u64) as usize];
        let calls = self.rng.below(4);
        next.pending_tool_calls = (0..calls)
            .map(|i| ToolCall {
                id: format!("call_{}_{i}", self.n),
                name: ["search", "read_file", "http_get"][i as usize % 3].to_string(),
                arguments: format!(
                    r#"{{"q":"cycle {} op {} arg {i}","n":{}}}"#,
                    self.cycle,
                    self.n,
                    self.rng.below(1000)
                ),
            })
            .collect();
        next.approval = self.rng.chance(25).then(|| Approval {
            id: format!("ap_{}", self.n),
            prompt: format!("Approve step {}?", self.n),
        });
        if next.approval.is_some() {
            next.state = RunState::AwaitingApproval;
        }
        // R9: a finished run stays finished.
        if r.state.is_finished() {
            next.state = r.state;
        }
        next
    }

    fn put(&mut self, r: RunRecord, what: &str) -> Option<RunRecord> {
        let next = self.mutate(&r);
        // The store keeps what its scrubber makes of the record (X1).
        let mut pred = next.scrubbed();
        pred.version = r.version + 1;
        pred.updated_at = 0;
        let mut op = self.op(what);
        op.effects.insert(run_name(&r.key), Some(Obj::Run(pred)));
        emit_op("try", &op);
        match self.store.put_run(next) {
            Ok(stored) => {
                op.effects
                    .insert(run_name(&r.key), Some(Obj::Run(stored.clone())));
                emit_op("ack", &op);
                Some(stored)
            }
            Err(e) => self.fail(&op, &e),
        }
    }

    fn put_run(&mut self) {
        let Some(r) = self.pick_run() else {
            return self.create_run();
        };
        if let Some(stored) = self.put(r, "put run") {
            self.runs.insert(stored.key.run_id.clone(), stored);
        }
    }

    fn put_long(&mut self) {
        let Some(r) = self.long.clone() else { return };
        self.long = self.put(r, "put long run");
    }

    fn delta(&mut self) -> StateDelta {
        StateDelta {
            usage: Usage {
                input_tokens: self.rng.below(5000),
                output_tokens: self.rng.below(2000),
            },
            cost_micros: self.rng.range(1, 10_000),
            iterations: self.rng.below(3),
            messages_read: self.rng.below(4),
        }
    }

    fn patch_run(&mut self) {
        let Some(r) = self.pick_run() else {
            return self.create_run();
        };
        let d = self.delta();
        let mut pred = r.clone();
        pred.version += 1;
        pred.updated_at = 0;
        pred.usage.input_tokens += d.usage.input_tokens;
        pred.usage.output_tokens += d.usage.output_tokens;
        pred.cost_micros += d.cost_micros;
        pred.iterations += d.iterations;
        pred.messages_read += d.messages_read;
        let mut op = self.op("patch run");
        op.effects.insert(run_name(&r.key), Some(Obj::Run(pred)));
        emit_op("try", &op);
        match self.store.patch_run(&r.key, d) {
            Ok(stored) => {
                op.effects
                    .insert(run_name(&r.key), Some(Obj::Run(stored.clone())));
                emit_op("ack", &op);
                self.runs.insert(stored.key.run_id.clone(), stored);
            }
            Err(e) => self.fail(&op, &e),
        }
    }

    fn patch_spend(&mut self) {
        let cost = self.rng.range(1, 1_000);
        let mut op = self.op("patch spend");
        op.spend = cost;
        emit_op("try", &op);
        let d = StateDelta {
            cost_micros: cost,
            iterations: 1,
            ..Default::default()
        };
        match self.store.patch_run(&RunKey::new(TENANT, SPEND_RUN), d) {
            Ok(_) => emit_op("ack", &op),
            Err(e) => self.fail(&op, &e),
        }
    }

    fn create_session(&mut self) {
        let id = format!("c{}.t{}.s{}", self.cycle, self.tid, self.n + 1);
        let key = SessionKey::new(TENANT, id.clone());
        let mut rec = SessionRecord::new(key.clone());
        rec.metadata.insert("cycle".into(), self.cycle.to_string());
        rec.metadata
            .insert("title".into(), format!("session {}", self.n));
        let mut pred = rec.clone();
        pred.version = 1;
        let mut op = self.op("create session");
        op.effects
            .insert(session_name(&key), Some(Obj::Session(pred)));
        emit_op("try", &op);
        match self.store.put_session(rec) {
            Ok(s) => {
                op.effects
                    .insert(session_name(&key), Some(Obj::Session(s.clone())));
                emit_op("ack", &op);
                self.sessions.insert(id, (s, BTreeSet::new()));
            }
            Err(e) => self.fail(&op, &e),
        }
    }

    fn pick_session(&mut self) -> Option<String> {
        if self.sessions.is_empty() {
            return None;
        }
        let i = self.rng.below(self.sessions.len() as u64) as usize;
        self.sessions.keys().nth(i).cloned()
    }

    fn put_session(&mut self) {
        let Some(id) = self.pick_session() else {
            return self.create_session();
        };
        let (s, _) = self.sessions[&id].clone();
        let mut next = s.clone();
        next.metadata
            .insert(format!("k{}", self.rng.below(4)), format!("v{}", self.n));
        let mut pred = next.clone();
        pred.version += 1;
        pred.updated_at = 0;
        let mut op = self.op("put session");
        op.effects
            .insert(session_name(&s.key), Some(Obj::Session(pred)));
        emit_op("try", &op);
        match self.store.put_session(next) {
            Ok(stored) => {
                op.effects
                    .insert(session_name(&s.key), Some(Obj::Session(stored.clone())));
                emit_op("ack", &op);
                if let Some(entry) = self.sessions.get_mut(&id) {
                    entry.0 = stored;
                }
            }
            Err(e) => self.fail(&op, &e),
        }
    }

    /// Deletes a session and all its runs in one write (S3).
    fn cascade(&mut self) {
        let Some(id) = self.pick_session() else {
            return self.create_session();
        };
        let (s, runs) = self.sessions[&id].clone();
        let mut op = self.op("cascade delete session");
        op.effects.insert(session_name(&s.key), None);
        for r in &runs {
            op.effects
                .insert(run_name(&RunKey::new(TENANT, r.clone())), None);
        }
        emit_op("try", &op);
        match self.store.delete_session(&s.key, true) {
            Ok(deleted) => {
                let got: BTreeSet<String> = deleted.into_iter().map(|k| k.run_id).collect();
                if got != runs {
                    bug(&format!(
                        "cascade of {id} deleted {got:?}, expected {runs:?}"
                    ));
                }
                emit_op("ack", &op);
                self.sessions.remove(&id);
                for r in runs {
                    self.runs.remove(&r);
                }
            }
            Err(e) => self.fail(&op, &e),
        }
    }

    /// Sometimes moves to a newer epoch first, as a new placement would.
    fn next_epoch(&mut self) -> u64 {
        if self.rng.chance(10) {
            self.epoch += 1;
        }
        self.epoch
    }

    fn tray_value(&mut self) -> Tray {
        let len = self.rng.below(48) as usize;
        let fill = self.rng.below(256) as u8;
        let mut doc = format!("{}:{}:", self.cycle, self.n).into_bytes();
        doc.extend(std::iter::repeat_n(fill, len));
        Tray {
            marked: self.rng.chance(50),
            doc,
            env: ["prod", "dev"][self.rng.below(2) as usize].to_string(),
            hostname: format!("host-{}", self.tid),
        }
    }

    /// A tray batch of 1–24 puts and deletes over a small set of tray ids,
    /// so batches overwrite each other across cycles (T3).
    fn batch(&mut self) {
        let epoch = self.next_epoch();
        let count = self.rng.range(1, 24);
        let mut ops = Vec::new();
        let mut after: BTreeMap<String, Option<Tray>> = BTreeMap::new();
        for _ in 0..count {
            let tray_id = format!("k{}", self.rng.below(16));
            if self.rng.chance(75) {
                let t = self.tray_value();
                after.insert(tray_id.clone(), Some(t.clone()));
                ops.push(TrayOp::Put {
                    tray_ns: "b".into(),
                    tray_id,
                    tray: t,
                });
            } else {
                after.insert(tray_id.clone(), None);
                ops.push(TrayOp::Delete {
                    tray_ns: "b".into(),
                    tray_id,
                });
            }
        }
        let mut op = self.op("tray batch");
        op.effects
            .insert(epoch_name(&self.inst), Some(Obj::Epoch(epoch)));
        for (id, t) in &after {
            op.effects
                .insert(tray_name(&self.inst, id), t.clone().map(Obj::Tray));
        }
        emit_op("try", &op);
        match self.store.apply_batch(&self.inst, epoch, ops) {
            Ok(()) => {
                emit_op("ack", &op);
                for (id, t) in after {
                    match t {
                        Some(t) => self.trays.insert(id, t),
                        None => self.trays.remove(&id),
                    };
                }
            }
            Err(e) => self.fail(&op, &e),
        }
    }

    /// Unmarks every tray of the instance (T4).
    fn release(&mut self) {
        let epoch = self.next_epoch();
        let mut op = self.op("release");
        op.effects
            .insert(epoch_name(&self.inst), Some(Obj::Epoch(epoch)));
        let mut after = self.trays.clone();
        for (id, t) in after.iter_mut() {
            if t.marked {
                t.marked = false;
                op.effects
                    .insert(tray_name(&self.inst, id), Some(Obj::Tray(t.clone())));
            }
        }
        emit_op("try", &op);
        match self.store.release(&self.inst, epoch) {
            Ok(()) => {
                emit_op("ack", &op);
                self.trays = after;
            }
            Err(e) => self.fail(&op, &e),
        }
    }

    fn set_alarm(&mut self) {
        let epoch = self.next_epoch();
        let due = 1_000 + self.rng.below(1_000_000);
        let mut op = self.op("set alarm");
        op.effects
            .insert(epoch_name(&self.inst), Some(Obj::Epoch(epoch)));
        op.effects
            .insert(alarm_name(&self.inst), Some(Obj::Alarm(due)));
        emit_op("try", &op);
        match self.store.set_alarm(&self.inst, epoch, due) {
            Ok(()) => {
                emit_op("ack", &op);
                self.alarm = Some(due);
            }
            Err(e) => self.fail(&op, &e),
        }
    }

    /// Acks the alarm this thread set, or (when it set none) a `due_at`
    /// that is not stored, which must remove nothing (A3).
    fn ack_alarm(&mut self) {
        let epoch = self.next_epoch();
        let (due, hit) = match self.alarm {
            Some(d) => (d, true),
            None => (7, false),
        };
        let mut op = self.op("ack alarm");
        op.effects
            .insert(epoch_name(&self.inst), Some(Obj::Epoch(epoch)));
        if hit {
            op.effects.insert(alarm_name(&self.inst), None);
        }
        emit_op("try", &op);
        match self.store.ack_alarm(&self.inst, epoch, due) {
            Ok(removed) => {
                // An alarm left by an earlier cycle may be stored at 7 only
                // if an earlier cycle set it there, which none does.
                if removed != hit {
                    bug(&format!(
                        "ack_alarm({due}) removed={removed}, expected {hit}"
                    ));
                }
                emit_op("ack", &op);
                self.alarm = None;
            }
            Err(e) => self.fail(&op, &e),
        }
    }

    /// Writes that must be refused and change nothing: a stale version, a
    /// stale epoch. They print nothing unless the store gets them wrong.
    fn stale_checks(&mut self) {
        if let Some(r) = self.pick_run()
            && r.version > 1
        {
            let mut stale = r.clone();
            stale.version -= 1;
            match self.store.put_run(stale) {
                Err(StateError::Conflict {
                    expected, actual, ..
                }) if expected == r.version - 1 && actual == r.version => {}
                other => bug(&format!("stale put of {}: {other:?}", r.key.run_id)),
            }
        }
        if self.epoch > 1 {
            let old = self.epoch - 1;
            let t = self.tray_value();
            let ops = vec![TrayOp::Put {
                tray_ns: "b".into(),
                tray_id: "k0".into(),
                tray: t,
            }];
            match self.store.apply_batch(&self.inst, old, ops) {
                Err(StateError::FenceLost { caller, stored, .. })
                    if caller == old && stored == self.epoch => {}
                other => bug(&format!("stale batch at epoch {old}: {other:?}")),
            }
        }
    }
}

// ---------------------------------------------------------------------------
// The parent.

/// How a harness run is shaped.
#[derive(Debug, Clone)]
pub struct Config {
    /// Kill-and-check cycles.
    pub cycles: u64,
    /// Seeds the parent's choices and every child's.
    pub seed: u64,
    /// Where the stores live (`DIR/store`, `DIR/fresh-N`).
    pub dir: PathBuf,
    /// The longest a child runs before it is killed.
    pub max_ms: u64,
    /// Print one line per cycle.
    pub verbose: bool,
    /// The engine under the store.
    pub engine: FileEngine,
}

/// What a harness run found.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// Cycles run.
    pub cycles: u64,
    /// Writes the children acknowledged.
    pub acked: u64,
    /// Acknowledged writes missing or changed after the crash (and counters
    /// that went backwards).
    pub lost: u64,
    /// Writes found partly applied, or values nobody wrote.
    pub torn: u64,
    /// `verify()` problems and listings that disagree with the records.
    pub index_mismatch: u64,
    /// Reopens that failed.
    pub open_errors: u64,
    /// Failures the children reported themselves (`bug` lines, early exits).
    pub child_errors: u64,
    /// Writes in flight at a kill.
    pub in_flight: u64,
    /// Of which found applied.
    pub in_flight_applied: u64,
    /// Kills that landed while the child was still opening its store.
    pub kills_during_open: u64,
    /// Creation cycles that left no store / a complete one.
    pub fresh_absent: u64,
    /// See `fresh_absent`.
    pub fresh_complete: u64,
    /// Creation cycles that left a half-built store beside the path.
    pub fresh_partial: u64,
    /// One line per failure, for the report.
    pub details: Vec<String>,
}

impl Summary {
    /// True when nothing failed.
    pub fn ok(&self) -> bool {
        self.lost == 0
            && self.torn == 0
            && self.index_mismatch == 0
            && self.open_errors == 0
            && self.child_errors == 0
    }
    /// The harness's last line.
    pub fn last_line(&self) -> String {
        format!(
            "crash: cycles={} acked={} lost={} torn={} index_mismatch={} open_errors={}",
            self.cycles, self.acked, self.lost, self.torn, self.index_mismatch, self.open_errors
        )
    }
    fn fail(&mut self, kind: &str, msg: String) {
        match kind {
            "lost" => self.lost += 1,
            "torn" => self.torn += 1,
            "index" => self.index_mismatch += 1,
            "open" => self.open_errors += 1,
            _ => self.child_errors += 1,
        }
        if self.details.len() < 200 {
            self.details.push(format!("{kind}: {msg}"));
        }
    }
}

/// The parent's model of one store.
#[derive(Debug, Default)]
struct Model {
    /// Every record as last acknowledged or observed (the spend run aside).
    state: BTreeMap<String, Obj>,
    /// The spend run's cost and the patches committed to it.
    spend_cost: u64,
    spend_patches: u64,
    /// The highest `seq` acknowledged or observed.
    max_seq: u64,
    /// The store's commit count at the last check.
    commits: u64,
}

/// What one child said before it died.
#[derive(Debug, Default)]
struct Transcript {
    acked: Vec<Op>,
    in_flight: BTreeMap<String, Op>,
    opened: bool,
    done: bool,
    bugs: Vec<String>,
}

fn parse(lines: &[String], summary: &mut Summary) -> Transcript {
    let mut t = Transcript::default();
    for line in lines {
        if let Some(json) = line.strip_prefix("try ") {
            match serde_json::from_str::<Op>(json) {
                Ok(op) => {
                    t.in_flight.insert(op.id.clone(), op);
                }
                Err(e) => summary.fail("child", format!("unreadable line {line:?}: {e}")),
            }
        } else if let Some(json) = line.strip_prefix("ack ") {
            match serde_json::from_str::<Op>(json) {
                Ok(op) => {
                    if t.in_flight.remove(&op.id).is_none() {
                        summary.fail("child", format!("ack without try: {}", op.id));
                    }
                    t.acked.push(op);
                }
                Err(e) => summary.fail("child", format!("unreadable line {line:?}: {e}")),
            }
        } else if line == "phase opened" {
            t.opened = true;
        } else if line == "phase done" {
            t.done = true;
        } else if let Some(msg) = line.strip_prefix("bug ") {
            t.bugs.push(msg.to_string());
        }
    }
    t
}

/// Does the store's value `obs` match the predicted `pred`? Fields the
/// store assigns (timestamps, a new run's `seq`) are 0 in a prediction and
/// match anything.
fn matches(pred: &Obj, obs: &Obj) -> bool {
    match (pred, obs) {
        (Obj::Run(p), Obj::Run(o)) => {
            let mut p = p.clone();
            if p.seq == 0 {
                p.seq = o.seq;
            }
            if p.created_at == 0 {
                p.created_at = o.created_at;
            }
            if p.updated_at == 0 {
                p.updated_at = o.updated_at;
            }
            &p == o
        }
        (Obj::Session(p), Obj::Session(o)) => {
            let mut p = p.clone();
            if p.created_at == 0 {
                p.created_at = o.created_at;
            }
            if p.updated_at == 0 {
                p.updated_at = o.updated_at;
            }
            &p == o
        }
        (p, o) => p == o,
    }
}

fn same(a: Option<&Obj>, b: Option<&Obj>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => matches(a, b),
        _ => false,
    }
}

/// Reads every record of the store through its export listing.
fn observe(store: &FileStore) -> Result<BTreeMap<String, Obj>, StateError> {
    let mut out = BTreeMap::new();
    for e in store.iter_export().page_size(1000) {
        let (k, v) = match e? {
            Entry::Run(r) => (run_name(&r.key), Obj::Run(r)),
            Entry::Session(s) => (session_name(&s.key), Obj::Session(s)),
            Entry::Epoch { instance, epoch } => (epoch_name(&instance), Obj::Epoch(epoch)),
            Entry::Tray { key, tray } => (
                format!("tray/{}/{}/{}/{}", key.ns, key.id, key.tray_ns, key.tray_id),
                Obj::Tray(tray),
            ),
            Entry::Alarm { instance, due_at } => (alarm_name(&instance), Obj::Alarm(due_at)),
            // The harness writes no budgets and no holds: one would be a
            // record it never acknowledged.
            other => {
                return Err(StateError::Corrupt {
                    what: format!("unexpected record in the store: {other:?}"),
                });
            }
        };
        out.insert(k, v);
    }
    Ok(out)
}

/// Checks the indexes through the public listings: every run once in the
/// seq listing and in its state's listing, every marked tray in the
/// sweeper's listing, every alarm in the due listing.
fn check_listings(
    store: &FileStore,
    obs: &BTreeMap<String, Obj>,
    summary: &mut Summary,
) -> Result<(), StateError> {
    let mut runs: BTreeMap<String, &RunRecord> = BTreeMap::new();
    let mut marked = BTreeSet::new();
    let mut alarms = BTreeSet::new();
    for (k, v) in obs {
        match v {
            Obj::Run(r) if r.key.tenant == TENANT => {
                runs.insert(r.key.run_id.clone(), r);
            }
            Obj::Tray(t) if t.marked => {
                marked.insert(k.clone());
            }
            Obj::Alarm(due) => {
                alarms.insert((k.clone(), *due));
            }
            _ => {}
        }
    }
    let walk = |q: StateQuery| -> Result<Vec<RunRecord>, StateError> {
        store.iter_runs(&q).page_size(1000).collect()
    };
    let all = walk(StateQuery::new(TENANT))?;
    let listed: BTreeSet<String> = all.iter().map(|r| r.key.run_id.clone()).collect();
    if listed.len() != all.len() || listed != runs.keys().cloned().collect::<BTreeSet<_>>() {
        summary.fail(
            "index",
            format!(
                "seq listing has {} runs ({} distinct), records {}",
                all.len(),
                listed.len(),
                runs.len()
            ),
        );
    }
    if all.windows(2).any(|w| w[0].seq >= w[1].seq) {
        summary.fail("index", "seq listing out of order".into());
    }
    for state in RunState::ALL {
        let got: BTreeSet<String> = walk(StateQuery::new(TENANT).state(state))?
            .into_iter()
            .map(|r| r.key.run_id)
            .collect();
        let want: BTreeSet<String> = runs
            .values()
            .filter(|r| r.state == state)
            .map(|r| r.key.run_id.clone())
            .collect();
        if got != want {
            summary.fail(
                "index",
                format!(
                    "state listing {state:?}: {} listed, {} records",
                    got.len(),
                    want.len()
                ),
            );
        }
    }
    let mut got = BTreeSet::new();
    for m in store.iter_marked_trays(None).page_size(1000) {
        let m = m?;
        got.insert(format!(
            "tray/{}/{}/{}/{}",
            m.key.ns, m.key.id, m.key.tray_ns, m.key.tray_id
        ));
    }
    if got != marked {
        summary.fail(
            "index",
            format!(
                "marked listing: {} listed, {} marked trays",
                got.len(),
                marked.len()
            ),
        );
    }
    let mut got = BTreeSet::new();
    for a in store.iter_due_alarms(u64::MAX).page_size(1000) {
        let a = a?;
        got.insert((alarm_name(&a.instance), a.due_at));
    }
    if got != alarms {
        summary.fail(
            "index",
            format!("due listing: {} listed, {} alarms", got.len(), alarms.len()),
        );
    }
    Ok(())
}

/// Reopens the store after a kill and compares it with the model and the
/// child's transcript; then makes the model what was found.
fn check_store(
    dir: &Path,
    engine: FileEngine,
    model: &mut Model,
    t: &Transcript,
    summary: &mut Summary,
    cycle: u64,
) {
    let store = match open_store(dir, engine) {
        Ok(s) => s,
        Err(e) => {
            summary.fail(
                "open",
                format!("cycle {cycle}: reopening {}: {e}", dir.display()),
            );
            return;
        }
    };
    // Commits never go backwards: every acknowledged write added one.
    let commits = store.commits();
    if commits < model.commits {
        summary.fail(
            "lost",
            format!(
                "cycle {cycle}: commit count went back from {} to {commits}",
                model.commits
            ),
        );
    }
    let mut obs = match observe(&store) {
        Ok(o) => o,
        Err(e) => {
            summary.fail("open", format!("cycle {cycle}: reading the store: {e}"));
            return;
        }
    };
    match store.verify() {
        Ok(rep) => {
            for p in rep.problems {
                summary.fail("index", format!("cycle {cycle}: verify: {p}"));
            }
        }
        Err(e) => summary.fail("index", format!("cycle {cycle}: verify failed: {e}")),
    }
    if let Err(e) = check_listings(&store, &obs, summary) {
        summary.fail("index", format!("cycle {cycle}: listing: {e}"));
    }

    // The model after every acknowledged write, in acknowledgement order
    // (each key is written by one thread, so its acks are in commit order).
    let start_max_seq = model.max_seq;
    let mut expect = model.state.clone();
    let (mut spend_cost, mut spend_patches) = (model.spend_cost, model.spend_patches);
    for op in &t.acked {
        for (k, v) in &op.effects {
            match v {
                Some(v) => {
                    if let Obj::Run(r) = v {
                        model.max_seq = model.max_seq.max(r.seq);
                    }
                    expect.insert(k.clone(), v.clone())
                }
                None => expect.remove(k),
            };
        }
        if op.spend > 0 {
            spend_cost += op.spend;
            spend_patches += 1;
        }
    }

    // The spend run: the acknowledged patches plus some of those in flight.
    let spend_key = run_name(&RunKey::new(TENANT, SPEND_RUN));
    expect.remove(&spend_key);
    match obs.remove(&spend_key) {
        Some(Obj::Run(r)) => {
            let flying: Vec<u64> = t
                .in_flight
                .values()
                .filter(|o| o.spend > 0)
                .map(|o| o.spend)
                .collect();
            let extra_patches = (r.version - 1).checked_sub(spend_patches);
            let extra_cost = r.cost_micros.checked_sub(spend_cost);
            match (extra_patches, extra_cost) {
                (Some(n), Some(c)) if subset_sum(&flying, n as usize, c) && r.iterations == r.version - 1 => {}
                (None, _) | (_, None) => summary.fail(
                    "lost",
                    format!(
                        "cycle {cycle}: spend run at version {} cost {}, acknowledged {} patches costing {spend_cost}",
                        r.version, r.cost_micros, spend_patches
                    ),
                ),
                _ => summary.fail(
                    "torn",
                    format!(
                        "cycle {cycle}: spend run at version {} cost {} iterations {}: not the acknowledged {spend_patches} patches ({spend_cost}) plus some of {flying:?}",
                        r.version, r.cost_micros, r.iterations
                    ),
                ),
            }
            model.spend_cost = r.cost_micros;
            model.spend_patches = r.version - 1;
        }
        other => summary.fail("lost", format!("cycle {cycle}: spend run is {other:?}")),
    }

    // Every key some write in flight touched: which way did it go?
    let mut flying_keys: BTreeMap<&str, &Op> = BTreeMap::new();
    for op in t.in_flight.values() {
        for k in op.effects.keys() {
            flying_keys.insert(k, op);
        }
    }
    summary.in_flight += t.in_flight.len() as u64;
    for op in t.in_flight.values() {
        let (mut pre, mut post) = (Vec::new(), Vec::new());
        for (k, v) in &op.effects {
            let now = obs.get(k);
            let is_pre = same(expect.get(k), now);
            let is_post = same(v.as_ref(), now);
            if is_pre && !is_post {
                pre.push(k.clone());
            }
            if is_post && !is_pre {
                post.push(k.clone());
            }
        }
        if !pre.is_empty() && !post.is_empty() {
            summary.fail(
                "torn",
                format!(
                    "cycle {cycle}: {} {} applied to {post:?} but not {pre:?}",
                    op.what, op.id
                ),
            );
        }
        if !post.is_empty() {
            summary.in_flight_applied += 1;
        }
    }
    let keys: BTreeSet<&String> = expect.keys().chain(obs.keys()).collect();
    for k in keys {
        let (want, now) = (expect.get(k), obs.get(k));
        if same(want, now) {
            continue;
        }
        match flying_keys.get(k.as_str()) {
            Some(op) if same(op.effects[k.as_str()].as_ref(), now) => {}
            Some(op) => summary.fail(
                "torn",
                format!(
                    "cycle {cycle}: {k} is {now:?}: neither before ({want:?}) nor after {} {}",
                    op.what, op.id
                ),
            ),
            None if want.is_none() => summary.fail(
                "torn",
                format!("cycle {cycle}: {k} is {now:?}, never written"),
            ),
            None => summary.fail(
                "lost",
                format!("cycle {cycle}: {k} is {now:?}, acknowledged {want:?}"),
            ),
        }
    }

    // seq: never reused; a run first seen now was created after all before.
    let mut seqs = BTreeMap::new();
    for (k, v) in &obs {
        if let Obj::Run(r) = v {
            if let Some(other) = seqs.insert(r.seq, k.clone()) {
                summary.fail(
                    "lost",
                    format!("cycle {cycle}: seq {} held by {k} and {other}", r.seq),
                );
            }
            if !model.state.contains_key(k) && r.seq <= start_max_seq {
                summary.fail(
                    "lost",
                    format!(
                        "cycle {cycle}: new run {k} got seq {}, not above {start_max_seq}",
                        r.seq
                    ),
                );
            }
            model.max_seq = model.max_seq.max(r.seq);
        }
    }
    model.state = obs;
    model.commits = commits;
}

/// Is there a `k`-element subset of `xs` summing to `sum`? (Few elements.)
fn subset_sum(xs: &[u64], k: usize, sum: u64) -> bool {
    if xs.len() > 20 {
        return false;
    }
    (0u32..1 << xs.len()).any(|mask| {
        mask.count_ones() as usize == k
            && xs
                .iter()
                .enumerate()
                .filter(|(i, _)| mask & (1 << i) != 0)
                .map(|(_, x)| x)
                .sum::<u64>()
                == sum
    })
}

/// When the parent kills a child.
#[derive(Debug, Clone, Copy)]
pub enum KillAt {
    /// This long after it was started (it may still be opening the store).
    Start(Duration),
    /// This long after it said its store was open.
    Opened(Duration),
}

/// What one child printed, and when it opened.
#[derive(Debug, Default)]
pub struct Output {
    /// Every complete line, in order.
    pub lines: Vec<String>,
    /// When the child said `phase opened`, from its start.
    pub opened_after: Option<Duration>,
}

/// Starts a child, kills it at `kill` (or lets it finish), and returns
/// every complete line it printed and whether it exited on its own.
pub fn run_child(
    spawn: &dyn Fn() -> Command,
    spec: &str,
    kill: KillAt,
) -> std::io::Result<(Output, bool)> {
    let mut cmd = spawn();
    cmd.env(CHILD_ENV, spec)
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    let started = Instant::now();
    let mut child = cmd.spawn()?;
    let out = child.stdout.take().expect("stdout is piped");
    let shared = Arc::new(Mutex::new(Output::default()));
    let sink = shared.clone();
    let reader = std::thread::spawn(move || {
        let mut r = BufReader::new(out);
        let mut buf = String::new();
        // A line cut short by the kill has no newline: it was never said.
        while matches!(r.read_line(&mut buf), Ok(n) if n > 0) {
            if buf.ends_with('\n') {
                let line = buf.trim_end().to_string();
                let mut o = sink.lock().expect("reader lock");
                if line == "phase opened" {
                    o.opened_after = Some(started.elapsed());
                }
                o.lines.push(line);
            }
            buf.clear();
        }
    });
    let mut exited = false;
    loop {
        let due = match kill {
            KillAt::Start(d) => Some(d),
            KillAt::Opened(d) => shared
                .lock()
                .expect("reader lock")
                .opened_after
                .map(|o| o + d),
        };
        if due.is_some_and(|d| started.elapsed() >= d) {
            break;
        }
        if child.try_wait()?.is_some() {
            exited = true;
            break;
        }
        std::thread::sleep(Duration::from_micros(500));
    }
    if !exited {
        // std's kill is SIGKILL on Unix.
        child.kill()?;
    }
    child.wait()?;
    let _ = reader.join();
    let out = std::mem::take(&mut *shared.lock().expect("reader lock"));
    Ok((out, exited))
}

/// Runs the harness: `cfg.cycles` kill-and-check cycles, children started
/// by `spawn` (a command that runs this file's child when `CHILD_ENV` is
/// set).
pub fn run(cfg: &Config, spawn: &dyn Fn() -> Command) -> Summary {
    let spawn = &|| {
        let mut cmd = spawn();
        cmd.env(ENGINE_ENV, cfg.engine.name());
        cmd
    };
    let mut summary = Summary::default();
    let mut rng = Rng::new(cfg.seed);
    let store_dir = cfg.dir.join("store");
    let mut model = Model::default();
    // The spend run every child patches.
    match open_store(&store_dir, cfg.engine).and_then(|s| {
        let r = s.put_run(RunRecord::new(RunKey::new(TENANT, SPEND_RUN), "spend"))?;
        model.max_seq = r.seq;
        model.commits = s.commits();
        Ok(())
    }) {
        Ok(()) => {}
        Err(e) => {
            summary.fail("open", format!("setting up {}: {e}", store_dir.display()));
            return summary;
        }
    }
    let max_ms = cfg.max_ms;
    // How long the last child took to open the store (from its start).
    let mut last_open = Duration::from_millis(30);
    // How long the last creation took (from the child's start).
    let mut last_create = Duration::from_millis(250);
    for cycle in 1..=cfg.cycles {
        let child_seed = rng.next_u64();
        // Every fifth cycle creates a fresh store and is killed within
        // 20 ms of its start, or (every other time) anywhere within the
        // last creation's time; every fifth (offset) is killed while it
        // opens and recovers the store (within the last open's time); the
        // rest are killed mid-workload.
        let (kind, kill) = match cycle % 10 {
            1 => (
                "create",
                KillAt::Start(Duration::from_millis(rng.below(21))),
            ),
            6 => (
                "create",
                KillAt::Start(Duration::from_micros(
                    rng.below(last_create.as_micros() as u64 + 1),
                )),
            ),
            3 | 8 => (
                "open",
                KillAt::Start(Duration::from_micros(
                    rng.below(last_open.as_micros() as u64 + 1),
                )),
            ),
            _ => (
                "work",
                KillAt::Opened(Duration::from_millis(rng.below(max_ms + 1))),
            ),
        };
        let (dir, mode) = if kind == "create" {
            (cfg.dir.join(format!("fresh-{cycle}")), "create")
        } else {
            (store_dir.clone(), "work")
        };
        let spec = format!("{mode}:{child_seed}:{cycle}:{}", dir.display());
        let (out, exited) = match run_child(spawn, &spec, kill) {
            Ok(x) => x,
            Err(e) => {
                summary.fail("child", format!("cycle {cycle}: starting the child: {e}"));
                break;
            }
        };
        summary.cycles += 1;
        let t = parse(&out.lines, &mut summary);
        match (out.opened_after, kind) {
            (Some(o), "work") => last_open = o,
            (Some(o), "create") => last_create = o + Duration::from_millis(20),
            _ => {}
        }
        for b in &t.bugs {
            summary.fail("child", format!("cycle {cycle}: {b}"));
        }
        if exited && !t.done {
            summary.fail(
                "child",
                format!("cycle {cycle}: the child exited on its own"),
            );
        }
        if !t.opened {
            summary.kills_during_open += 1;
        }
        summary.acked += t.acked.len() as u64;
        let before = summary.clone();
        if kind == "create" {
            check_fresh(&dir, cfg.engine, &t, &mut summary, cycle);
        } else {
            check_store(&dir, cfg.engine, &mut model, &t, &mut summary, cycle);
        }
        if cfg.verbose {
            let bad = summary.details.len() - before.details.len();
            let at = match kill {
                KillAt::Start(d) => format!("{:>5.1} ms after start", d.as_secs_f64() * 1e3),
                KillAt::Opened(d) => format!("{:>5.1} ms after open ", d.as_secs_f64() * 1e3),
            };
            let opened = match out.opened_after {
                Some(o) => format!("opened at {:>5.1} ms", o.as_secs_f64() * 1e3),
                None => "killed opening   ".to_string(),
            };
            println!(
                "cycle {cycle:>3}: {kind:<6} killed {at} {opened} acked={:<5} in_flight={} {}",
                t.acked.len(),
                t.in_flight.len(),
                if bad == 0 {
                    "ok".to_string()
                } else {
                    format!("{bad} FAILURES")
                }
            );
            for d in &summary.details[before.details.len()..] {
                println!("  {d}");
            }
        }
        if summary.open_errors > before.open_errors {
            // The store cannot be opened: nothing more to learn from it.
            break;
        }
    }
    summary
}

/// D7 inside the harness: a store killed while being created is absent or
/// complete, and then holds exactly the acknowledged creates (plus maybe
/// the one in flight).
fn check_fresh(dir: &Path, engine: FileEngine, t: &Transcript, summary: &mut Summary, cycle: u64) {
    // Leftovers of an interrupted creation sit beside the store; the next
    // creation at that path sweeps them. Remove them here.
    if let (Some(parent), Some(name)) = (dir.parent(), dir.file_name()) {
        let prefix = format!(".{}.creating-", name.to_string_lossy());
        for e in std::fs::read_dir(parent).into_iter().flatten().flatten() {
            if e.file_name().to_string_lossy().starts_with(&prefix) {
                summary.fresh_partial += 1;
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    if !dir.exists() {
        summary.fresh_absent += 1;
        if t.opened {
            summary.fail(
                "lost",
                format!(
                    "cycle {cycle}: {} vanished after open returned",
                    dir.display()
                ),
            );
        }
        return;
    }
    summary.fresh_complete += 1;
    let mut model = Model::default();
    // The harness's own spend run is not in a fresh store.
    check_fresh_store(dir, engine, &mut model, t, summary, cycle);
    let _ = std::fs::remove_dir_all(dir);
}

fn check_fresh_store(
    dir: &Path,
    engine: FileEngine,
    model: &mut Model,
    t: &Transcript,
    summary: &mut Summary,
    cycle: u64,
) {
    let store = match open_store(dir, engine) {
        Ok(s) => s,
        Err(e) => {
            summary.fail(
                "open",
                format!(
                    "cycle {cycle}: opening the interrupted creation {}: {e}",
                    dir.display()
                ),
            );
            return;
        }
    };
    let obs = match observe(&store) {
        Ok(o) => o,
        Err(e) => {
            summary.fail(
                "open",
                format!("cycle {cycle}: reading {}: {e}", dir.display()),
            );
            return;
        }
    };
    match store.verify() {
        Ok(rep) => {
            for p in rep.problems {
                summary.fail("index", format!("cycle {cycle}: verify: {p}"));
            }
        }
        Err(e) => summary.fail("index", format!("cycle {cycle}: verify failed: {e}")),
    }
    for op in &t.acked {
        for (k, v) in &op.effects {
            match v {
                Some(v) => model.state.insert(k.clone(), v.clone()),
                None => model.state.remove(k),
            };
        }
    }
    let keys: BTreeSet<&String> = model.state.keys().chain(obs.keys()).collect();
    for k in keys {
        let (want, now) = (model.state.get(k), obs.get(k));
        if same(want, now) {
            continue;
        }
        let flying = t
            .in_flight
            .values()
            .find(|op| op.effects.contains_key(k.as_str()));
        match flying {
            Some(op) if same(op.effects[k.as_str()].as_ref(), now) => {
                summary.in_flight_applied += 1
            }
            _ if want.is_some() => summary.fail(
                "lost",
                format!("cycle {cycle}: {k} is {now:?}, acknowledged {want:?}"),
            ),
            _ => summary.fail(
                "torn",
                format!("cycle {cycle}: {k} is {now:?}, never written"),
            ),
        }
    }
    summary.in_flight += t.in_flight.len() as u64;
}

// ---------------------------------------------------------------------------

fn usage() -> ! {
    eprintln!(
        "usage: crash --cycles N [--seed S] [--dir DIR] [--max-ms MS] [--engine fjall|sled] [--quiet]"
    );
    std::process::exit(2);
}

#[allow(dead_code)]
fn main() {
    if child_main_if_requested() {
        return;
    }
    let mut cycles = None;
    let mut seed = 1u64;
    let mut dir = None;
    let mut max_ms = 600u64;
    let mut verbose = true;
    let mut engine = FileEngine::Fjall;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| usage());
        match a.as_str() {
            "--cycles" => cycles = Some(val().parse().unwrap_or_else(|_| usage())),
            "--seed" => seed = val().parse().unwrap_or_else(|_| usage()),
            "--dir" => dir = Some(PathBuf::from(val())),
            "--max-ms" => max_ms = val().parse().unwrap_or_else(|_| usage()),
            "--engine" => engine = parse_engine(&val()).unwrap_or_else(|| usage()),
            "--quiet" => verbose = false,
            _ => usage(),
        }
    }
    let Some(cycles) = cycles else { usage() };
    let (dir, scratch) = match dir {
        Some(d) => (d, false),
        None => (
            std::env::temp_dir().join(format!("agentstate-crash-{}", std::process::id())),
            true,
        ),
    };
    if dir.join("store").exists() {
        eprintln!(
            "{} already holds a store; pick a fresh --dir",
            dir.display()
        );
        std::process::exit(2);
    }
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("creating {}: {e}", dir.display());
        std::process::exit(2);
    }
    let exe = std::env::current_exe().expect("the harness knows its own path");
    let cfg = Config {
        cycles,
        seed,
        dir: dir.clone(),
        max_ms,
        verbose,
        engine,
    };
    let started = Instant::now();
    let summary = run(&cfg, &|| Command::new(&exe));
    println!(
        "in flight at kills: {} ({} found applied); kills while opening: {}; \
         creations killed: {} left nothing, {} a whole store, {} a half-built one beside the path; \
         child errors: {}; {:.1} s",
        summary.in_flight,
        summary.in_flight_applied,
        summary.kills_during_open,
        summary.fresh_absent,
        summary.fresh_complete,
        summary.fresh_partial,
        summary.child_errors,
        started.elapsed().as_secs_f64()
    );
    if !summary.ok() {
        println!("store kept at {}", dir.display());
    } else if scratch {
        let _ = std::fs::remove_dir_all(&dir);
    }
    println!("engine: {}", engine.name());
    println!("{}", summary.last_line());
    if !summary.ok() {
        std::process::exit(1);
    }
}
