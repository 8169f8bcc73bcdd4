//! Latency growth over a long run (issue 13, `latency_growth`).
//!
//! Eight threads run a seeded mix like the stress test's
//! (`tests/it/stress.rs`) against one durable `FileStore`
//! (`Durability::Immediate`): creates (half of them fresh runs, half of a
//! hot set of 40 that may exist already), version-checked puts, patches,
//! reads, first pages of listings by state, session and agent, session
//! creates and cascade deletes, tray writes, batches, deletes, reads and
//! releases under moving epochs, tray and marked-tray listings, and
//! alarms set, listed when due and acknowledged. Every call's wall time is
//! recorded by kind and by the tenth of the run it started in (a global
//! counter numbers the calls), and the figure per kind is the mean of the
//! last tenth over the mean of the first: a store whose costs follow the
//! work asked for stays near 1.
//!
//! `AGENTSTATE_GROWTH_OPS` sets the total (default 200,000, `--quick`
//! 20,000); `AGENTSTATE_GROWTH_SEED` the seed; `AGENTSTATE_GROWTH_RUNS`
//! how many times the workload runs, each in a new store (default 3,
//! `--quick` 1). Every run prints its tables; each RESULT line is the
//! median of that figure over the runs (`latency_growth_runs_max` the
//! largest run's `latency_growth`), since one run's ratio of means moved
//! 1.13–4.82 between runs of one build.
//!
//! RESULT lines: `latency_growth` (the largest ratio over the kinds), one
//! `latency_growth_<kind>` per kind, `latency_growth_p50`, the largest
//! ratio of medians (a mean of a few microseconds moves with a single
//! preemption on a loaded machine; a median does not), and
//! `latency_growth_trim`, the largest ratio of means without the slowest
//! 1% of each tenth's calls of the kind (still a mean of the work asked
//! for, without the calls a preemption or a page fault stretched to
//! milliseconds), and `latency_growth_cpu`, the largest ratio of the
//! mean CPU time the calling thread spent in the call (the work a call
//! costs, whatever the other processes on the machine take of its cores;
//! a write's caller that leads its group commit also runs the others'
//! jobs, so for writes it is the noisier one), and `latency_growth_clean`,
//! the largest ratio of means over the calls during which the calling
//! thread neither was preempted nor waited (no context switch of either
//! kind, `getrusage(RUSAGE_THREAD)` read outside the timed span; kinds
//! with at least 100 such calls in both tenths, so the reads: a write
//! waits for its group's sync on nearly every call; the
//! table beside it gives each tenth's share of preempted and of waiting
//! calls). `latency_growth` is the figure; the others are beside
//! it, never instead of it.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::records::{context_switches, thread_cpu_ns};

use agentstate::{
    FileStore, InstanceKey, PageRequest, RunKey, RunRecord, RunState, SessionKey, SessionRecord,
    StateDelta, StateQuery, StateStore, Tray, TrayOp, TrayStore,
};

const THREADS: usize = 8;
const OPS_DEFAULT: u64 = 200_000;
const OPS_QUICK: u64 = 20_000;
/// Runs of the workload, each in a new store: one run's ratio of means
/// moved 1.13–4.82 between runs of the same build (a few preempted calls
/// decide a tenth's mean of a 2–5 µs read), so the RESULT lines are the
/// medians over the runs, and every run's table is printed.
const RUNS_DEFAULT: usize = 3;
const RUNS_QUICK: usize = 1;
const SEED_DEFAULT: u64 = 0x6e0e_7a11_5eed_0013;
const TENANT: &str = "acme";
/// Run ids every thread writes to (the stress test's 40).
const HOT_RUNS: u64 = 40;
const SESSIONS: u64 = 5;
const INSTANCES: u64 = 3;
const TRAYS: u64 = 3;
const AGENTS: [&str; 2] = ["planner", "coder"];
const TENTHS: usize = 10;
/// The fewest clean calls (no context switch) in both the first and the
/// last tenth for a kind to count in `latency_growth_clean`.
const CLEAN_MIN: u64 = 100;

/// The kinds of call, in report order, with their share of the mix (%).
const KINDS: [(&str, u64); 18] = [
    ("create", 8),
    ("put", 12),
    ("patch", 14),
    ("get", 6),
    ("list", 5),
    ("session", 3),
    ("cascade", 2),
    ("tray", 14),
    ("batch", 8),
    ("tray_del", 4),
    ("tray_read", 2),
    ("release", 5),
    ("list_trays", 3),
    ("marked", 2),
    ("epoch", 2),
    ("alarm_set", 5),
    ("alarm_due", 3),
    ("alarm_ack", 2),
];

/// xorshift64*: small, seeded, no dependency.
struct Rng(u64);

impl Rng {
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

/// Histogram buckets per doubling of the latency (about 9% wide).
const PER_DOUBLING: f64 = 8.0;
const BUCKETS: usize = 8 * 28;

/// The calls of one kind in one tenth: total time, count, a log-scale
/// histogram for the median, and every call's time for the trimmed mean.
/// Times are kept in nanoseconds (a read takes 2–5 µs: whole microseconds
/// would move its mean by up to a third and its median by a whole step)
/// and reported in µs.
#[derive(Clone)]
struct Cell {
    sum: u64,
    n: u64,
    hist: Vec<u32>,
    /// Every call's time, ns.
    all: Vec<u64>,
    /// Thread CPU time of the calls, ns.
    cpu: u64,
    /// Calls the scheduler preempted (an involuntary context switch of
    /// the calling thread during the call), and their total ns.
    preempted: u64,
    preempted_sum: u64,
    /// Calls that waited (a voluntary switch: a lock, a condvar, I/O) and
    /// were not preempted, and their total ns.
    waited: u64,
    waited_sum: u64,
    /// Total ns and count of the calls with neither.
    clean_sum: u64,
    clean_n: u64,
}

impl Cell {
    fn new() -> Cell {
        Cell {
            sum: 0,
            n: 0,
            hist: vec![0; BUCKETS],
            all: Vec::new(),
            cpu: 0,
            preempted: 0,
            preempted_sum: 0,
            waited: 0,
            waited_sum: 0,
            clean_sum: 0,
            clean_n: 0,
        }
    }
    /// `switches`: the calling thread's (voluntary, involuntary) context
    /// switches during the call.
    fn add(&mut self, nanos: u64, cpu_ns: u64, switches: (u64, u64)) {
        match switches {
            (_, i) if i > 0 => {
                self.preempted += 1;
                self.preempted_sum += nanos;
            }
            (v, _) if v > 0 => {
                self.waited += 1;
                self.waited_sum += nanos;
            }
            _ => {
                self.clean_sum += nanos;
                self.clean_n += 1;
            }
        }
        self.cpu += cpu_ns;
        self.sum += nanos;
        self.n += 1;
        let b = ((nanos as f64 / 1000.0 + 1.0).log2() * PER_DOUBLING) as usize;
        self.hist[b.min(BUCKETS - 1)] += 1;
        self.all.push(nanos);
    }
    fn merge(&mut self, other: &Cell) {
        self.sum += other.sum;
        self.n += other.n;
        for (a, b) in self.hist.iter_mut().zip(&other.hist) {
            *a += b;
        }
        self.all.extend_from_slice(&other.all);
        self.cpu += other.cpu;
        self.preempted += other.preempted;
        self.preempted_sum += other.preempted_sum;
        self.waited += other.waited;
        self.waited_sum += other.waited_sum;
        self.clean_sum += other.clean_sum;
        self.clean_n += other.clean_n;
    }
    /// Mean µs of the calls neither preempted nor waiting.
    fn clean_mean(&self) -> f64 {
        self.clean_sum as f64 / 1000.0 / self.clean_n.max(1) as f64
    }
    /// The share of the calls preempted, %.
    fn preempted_pct(&self) -> f64 {
        100.0 * self.preempted as f64 / self.n.max(1) as f64
    }
    /// The share of the calls that waited (and were not preempted), %.
    fn waited_pct(&self) -> f64 {
        100.0 * self.waited as f64 / self.n.max(1) as f64
    }
    /// What the preempted calls and the waiting ones add to the mean of
    /// all calls, µs: the mean is the clean calls' share plus these two.
    fn preempted_share(&self) -> f64 {
        self.preempted_sum as f64 / 1000.0 / self.n.max(1) as f64
    }
    fn waited_share(&self) -> f64 {
        self.waited_sum as f64 / 1000.0 / self.n.max(1) as f64
    }
    /// Mean thread CPU µs per call.
    fn cpu_mean(&self) -> f64 {
        self.cpu as f64 / 1000.0 / self.n.max(1) as f64
    }
    /// The mean without the slowest 1% of the calls.
    fn trimmed_mean(&self) -> f64 {
        let mut v = self.all.clone();
        v.sort_unstable();
        let keep = v.len() - v.len().div_ceil(100);
        let kept = &v[..keep.max(v.len().min(1))];
        kept.iter().map(|&x| x as f64).sum::<f64>() / 1000.0 / kept.len().max(1) as f64
    }
    /// Mean µs per call.
    fn mean(&self) -> f64 {
        self.sum as f64 / 1000.0 / self.n.max(1) as f64
    }
    /// The median, as the middle of its bucket.
    fn median(&self) -> f64 {
        let mut left = self.n.div_ceil(2);
        for (b, &c) in self.hist.iter().enumerate() {
            if u64::from(c) >= left {
                return 2f64.powf((b as f64 + 0.5) / PER_DOUBLING) - 1.0;
            }
            left -= u64::from(c);
        }
        0.0
    }
}

/// Per kind, per tenth.
type Cells = Vec<Vec<Cell>>;

fn cells() -> Cells {
    vec![vec![Cell::new(); TENTHS]; KINDS.len()]
}

fn instance(i: u64) -> InstanceKey {
    InstanceKey::new("workers", format!("w{i}"))
}

fn tray(doc: Vec<u8>, marked: bool) -> Tray {
    Tray {
        marked,
        doc,
        env: "growth".into(),
        hostname: "localhost".into(),
    }
}

fn pick_kind(rng: &mut Rng) -> usize {
    let mut roll = rng.below(100);
    for (i, (_, share)) in KINDS.iter().enumerate() {
        if roll < *share {
            return i;
        }
        roll -= share;
    }
    unreachable!("the shares add up to 100")
}

fn worker(store: &FileStore, counter: &AtomicU64, total: u64, thread: u64, seed: u64) -> Cells {
    let mut rng = Rng((seed ^ (thread + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)).max(1));
    let mut cells = cells();
    let mut epochs = [0u64; INSTANCES as usize];
    let mut fresh = 0u64;
    let mut docs = 0u64;
    let hot = |rng: &mut Rng| format!("run-{}", rng.below(HOT_RUNS));
    loop {
        if counter.load(Ordering::Relaxed) >= total {
            return cells;
        }
        let kind = pick_kind(&mut rng);
        let inst = rng.below(INSTANCES);
        // A holder sometimes takes its instance over (one past the stored
        // epoch) and otherwise carries on with an epoch that may be stale.
        if kind >= 7 && rng.chance(3) {
            epochs[inst as usize] = store.epoch(&instance(inst)).expect("epoch") + 1;
        }
        let epoch = epochs[inst as usize];
        let i = instance(inst);
        docs += 1;
        let doc = format!("{thread}-{docs}-{}", "x".repeat(64)).into_bytes();
        // Reads a call needs before it (a put's read) are not timed.
        let mut prepared = None;
        let mut due_at = None;
        match KINDS[kind].0 {
            "put" => match store
                .get_run(&RunKey::new(TENANT, hot(&mut rng)))
                .expect("get_run")
            {
                Some(r) => prepared = Some(r),
                None => continue,
            },
            // An ack names an alarm of this instance that is due.
            "alarm_ack" => {
                let due = store
                    .due_alarms(now_millis(), &PageRequest::new(10))
                    .expect("due_alarms");
                match due.items().iter().find(|a| a.instance == i) {
                    Some(a) => due_at = Some(a.due_at),
                    None => continue,
                }
            }
            _ => {}
        }
        let n = counter.fetch_add(1, Ordering::Relaxed);
        if n >= total {
            return cells;
        }
        let tenth = (n * TENTHS as u64 / total) as usize;
        let switches0 = context_switches(true);
        let cpu0 = thread_cpu_ns();
        let t0 = Instant::now();
        // Errors a concurrent mix produces (conflicts, lost fences, runs
        // deleted meanwhile) are answers like any other; only the time
        // counts.
        let fenced = match KINDS[kind].0 {
            "create" => {
                let run = if rng.chance(50) {
                    fresh += 1;
                    format!("fresh-{thread}-{fresh}")
                } else {
                    hot(&mut rng)
                };
                let mut rec =
                    RunRecord::new(RunKey::new(TENANT, run), AGENTS[rng.below(2) as usize]);
                rec.session_id = rng
                    .chance(60)
                    .then(|| format!("sess-{}", rng.below(SESSIONS)));
                store.put_run(rec).err()
            }
            "put" => {
                let mut rec = prepared.take().expect("read above");
                if !rec.state.is_finished() {
                    rec.state = RunState::ALL[rng.below(RunState::ALL.len() as u64) as usize];
                }
                store.put_run(rec).err()
            }
            "patch" => {
                let delta = StateDelta {
                    cost_micros: 1 + rng.below(1_000),
                    iterations: 1,
                    ..Default::default()
                };
                store
                    .patch_run(&RunKey::new(TENANT, hot(&mut rng)), delta)
                    .err()
            }
            "get" => store.get_run(&RunKey::new(TENANT, hot(&mut rng))).err(),
            "list" => {
                let q = StateQuery::new(TENANT);
                let q = match rng.below(4) {
                    0 => q,
                    1 => q.state(RunState::ALL[rng.below(RunState::ALL.len() as u64) as usize]),
                    2 => q.session(format!("sess-{}", rng.below(SESSIONS))),
                    _ => q.agent(AGENTS[rng.below(2) as usize]),
                };
                store.list_runs(&q, &PageRequest::new(10)).err()
            }
            "session" => store
                .put_session(SessionRecord::new(SessionKey::new(
                    TENANT,
                    format!("sess-{}", rng.below(SESSIONS)),
                )))
                .err(),
            "cascade" => store
                .delete_session(
                    &SessionKey::new(TENANT, format!("sess-{}", rng.below(SESSIONS))),
                    true,
                )
                .err(),
            "tray" => store
                .write_tray(
                    &i.tray("tray", format!("t{}", rng.below(TRAYS))),
                    epoch,
                    tray(doc, rng.chance(50)),
                )
                .err(),
            "batch" => {
                let mut ops = Vec::new();
                for t in 0..TRAYS {
                    match rng.below(3) {
                        0 => ops.push(TrayOp::Put {
                            tray_ns: "tray".into(),
                            tray_id: format!("t{t}"),
                            tray: tray(doc.clone(), rng.chance(50)),
                        }),
                        1 if rng.chance(30) => ops.push(TrayOp::Delete {
                            tray_ns: "tray".into(),
                            tray_id: format!("t{t}"),
                        }),
                        _ => {}
                    }
                }
                store.apply_batch(&i, epoch, ops).err()
            }
            "tray_del" => store
                .delete_tray(&i.tray("tray", format!("t{}", rng.below(TRAYS))), epoch)
                .err(),
            "tray_read" => store
                .read_tray(&i.tray("tray", format!("t{}", rng.below(TRAYS))), epoch)
                .err(),
            "release" => store.release(&i, epoch).err(),
            "list_trays" => store.list_trays(&i, epoch, &PageRequest::new(10)).err(),
            "marked" => {
                let env = rng.chance(50).then_some("growth");
                store.marked_trays(env, &PageRequest::new(10)).err()
            }
            "epoch" => store.epoch(&i).err(),
            "alarm_set" => {
                // Most alarms are due at once, some a moment later.
                let due = (now_millis() + rng.below(1_500)).saturating_sub(1_000);
                store.set_alarm(&i, epoch, due).err()
            }
            "alarm_due" => store.due_alarms(now_millis(), &PageRequest::new(10)).err(),
            "alarm_ack" => store
                .ack_alarm(&i, epoch, due_at.expect("read above"))
                .err(),
            other => unreachable!("kind {other}"),
        };
        let nanos = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let cpu_ns = thread_cpu_ns().saturating_sub(cpu0);
        let switches1 = context_switches(true);
        let switches = (
            switches1.0.saturating_sub(switches0.0),
            switches1.1.saturating_sub(switches0.1),
        );
        cells[kind][tenth].add(nanos, cpu_ns, switches);
        if let Some(agentstate::StateError::FenceLost { stored, .. }) = fenced
            && rng.chance(70)
        {
            epochs[inst as usize] = stored;
        }
    }
}

fn now_millis() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Runs the workload in a new store under `dir` and prints its table and
/// RESULT lines.
pub fn run(dir: &Path, quick: bool) {
    let total: u64 = std::env::var("AGENTSTATE_GROWTH_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if quick { OPS_QUICK } else { OPS_DEFAULT });
    let seed: u64 = std::env::var("AGENTSTATE_GROWTH_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(SEED_DEFAULT);
    let runs: usize = std::env::var("AGENTSTATE_GROWTH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if quick { RUNS_QUICK } else { RUNS_DEFAULT })
        .max(1);
    let figures: Vec<Figures> = (1..=runs)
        .map(|i| {
            println!();
            println!("### growth run {i} of {runs}");
            one_run(&dir.join(format!("growth-{i}")), total, seed)
        })
        .collect();
    let median = |f: &dyn Fn(&Figures) -> f64| {
        let mut v: Vec<f64> = figures.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!();
    println!(
        "latency_growth of each run: {} (the RESULT lines are the medians over the runs)",
        figures
            .iter()
            .map(|f| format!("{:.3}", f.worst))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!("RESULT latency_growth={:.3}", median(&|f| f.worst));
    println!("RESULT latency_growth_clean={:.3}", median(&|f| f.clean));
    println!("RESULT latency_growth_p50={:.3}", median(&|f| f.p50));
    println!("RESULT latency_growth_trim={:.3}", median(&|f| f.trim));
    println!("RESULT latency_growth_cpu={:.3}", median(&|f| f.cpu));
    println!(
        "RESULT latency_growth_runs_max={:.3}",
        figures.iter().map(|f| f.worst).fold(0.0, f64::max)
    );
    for (k, (name, _)) in KINDS.iter().enumerate() {
        println!(
            "RESULT latency_growth_{name}={:.3}",
            median(&|f| f.kinds[k])
        );
    }
}

/// One run's figures: the largest ratio over the kinds of each statistic,
/// and each kind's ratio of means.
struct Figures {
    worst: f64,
    clean: f64,
    p50: f64,
    trim: f64,
    cpu: f64,
    kinds: Vec<f64>,
}

/// Runs the workload once in a new store at `path` and prints its tables.
fn one_run(path: &Path, total: u64, seed: u64) -> Figures {
    let store = Arc::new(FileStore::open(path).expect("open growth store"));
    let counter = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let host = {
        let counter = Arc::clone(&counter);
        std::thread::spawn(move || host_by_tenth(&counter, total))
    };
    let handles: Vec<_> = (0..THREADS as u64)
        .map(|t| {
            let (store, counter) = (Arc::clone(&store), Arc::clone(&counter));
            std::thread::spawn(move || worker(&store, &counter, total, t, seed))
        })
        .collect();
    let mut all = cells();
    for h in handles {
        for (k, tenths) in h.join().expect("growth worker").iter().enumerate() {
            for (t, cell) in tenths.iter().enumerate() {
                all[k][t].merge(cell);
            }
        }
    }
    let cells = all;
    let elapsed = started.elapsed();
    let host = host.join().expect("host sampler");
    println!();
    println!(
        "## latency growth: {total} calls from {THREADS} threads in {:.1} s, {} groups committed; load average {}",
        elapsed.as_secs_f64(),
        store.commits(),
        super::loadavg()
    );
    println!(
        "mean µs per call by tenth of the run; growth = mean of the last tenth / mean of the first; p50 and trim the same for medians and for means without each tenth's slowest 1%"
    );
    print!("{:<11}", "kind");
    for t in 1..=TENTHS {
        print!("{:>8}", format!("{t}/10"));
    }
    println!(
        "{:>8}{:>8}{:>8}{:>8}{:>8}",
        "calls", "growth", "p50", "trim", "cpu"
    );
    let ratio = |last: f64, first: f64| last / first.max(1.0);
    let (mut worst, mut worst_p50, mut worst_trim, mut worst_cpu) = (0f64, 0f64, 0f64, 0f64);
    // The CPU ratio's first tenth must be long enough to divide by.
    let cpu_ratio = |last: f64, first: f64| last / first.max(0.1);
    let mut kinds = Vec::new();
    for (k, (name, _)) in KINDS.iter().enumerate() {
        let row = &cells[k];
        print!("{name:<11}");
        for cell in row {
            print!("{:>8.1}", cell.mean());
        }
        let growth = ratio(row[TENTHS - 1].mean(), row[0].mean());
        let p50 = ratio(row[TENTHS - 1].median(), row[0].median());
        let trim = ratio(row[TENTHS - 1].trimmed_mean(), row[0].trimmed_mean());
        let cpu = cpu_ratio(row[TENTHS - 1].cpu_mean(), row[0].cpu_mean());
        let calls: u64 = row.iter().map(|c| c.n).sum();
        println!("{calls:>8}{growth:>8.2}{p50:>8.2}{trim:>8.2}{cpu:>8.2}");
        worst_cpu = worst_cpu.max(cpu);
        worst = worst.max(growth);
        worst_p50 = worst_p50.max(p50);
        worst_trim = worst_trim.max(trim);
        kinds.push(growth);
    }
    println!("thread CPU µs per call by tenth");
    for (k, (name, _)) in KINDS.iter().enumerate() {
        print!("{name:<11}");
        for cell in &cells[k] {
            print!("{:>8.1}", cell.cpu_mean());
        }
        println!();
    }
    // What the hypervisor took: a tenth whose calls all cost more thread
    // CPU at once, reads and writes alike, with steal beside it, is the
    // host's doing, not the store's.
    print!("{:<11}", "steal %");
    for (wall, steal) in &host {
        print!(
            "{:>8.1}",
            100.0 * steal / (wall * super::cpus() as f64).max(1e-9)
        );
    }
    println!("  (host steal, % of the CPUs' time in the tenth; /proc/stat)");
    println!(
        "context switches during the calls, first tenth / last: % preempted (involuntary), % waited (voluntary only), the mean µs of the calls with neither, and the µs the preempted calls (p-) and the waiting ones (w-) add to the mean of all calls"
    );
    println!(
        "{:<11}{:>10}{:>10}{:>10}{:>10}{:>10}{:>10}{:>8}{:>8}{:>8}{:>8}{:>8}",
        "kind",
        "preempt1",
        "preempt10",
        "waited1",
        "waited10",
        "clean1",
        "clean10",
        "growth",
        "p-µs1",
        "p-µs10",
        "w-µs1",
        "w-µs10"
    );
    let mut worst_clean = 0f64;
    for (k, (name, _)) in KINDS.iter().enumerate() {
        let (first, last) = (&cells[k][0], &cells[k][TENTHS - 1]);
        // Kinds that wait on most calls (every write: its group's sync)
        // have too few clean calls to compare.
        let clean = (first.clean_n >= CLEAN_MIN && last.clean_n >= CLEAN_MIN)
            .then(|| ratio(last.clean_mean(), first.clean_mean()));
        worst_clean = worst_clean.max(clean.unwrap_or(0.0));
        println!(
            "{name:<11}{:>10.1}{:>10.1}{:>10.1}{:>10.1}{:>10.1}{:>10.1}{:>8}{:>8.1}{:>8.1}{:>8.1}{:>8.1}",
            first.preempted_pct(),
            last.preempted_pct(),
            first.waited_pct(),
            last.waited_pct(),
            first.clean_mean(),
            last.clean_mean(),
            clean.map_or_else(|| "-".to_string(), |c| format!("{c:.2}")),
            first.preempted_share(),
            last.preempted_share(),
            first.waited_share(),
            last.waited_share(),
        );
    }
    drop(store);
    println!(
        "latency_growth={worst:.3} clean={worst_clean:.3} p50={worst_p50:.3} trim={worst_trim:.3} cpu={worst_cpu:.3}"
    );
    Figures {
        worst,
        clean: worst_clean,
        p50: worst_p50,
        trim: worst_trim,
        cpu: worst_cpu,
        kinds,
    }
}

/// The CPUs' steal time so far, seconds: time the hypervisor ran something
/// else while this VM's CPUs had work (the `steal` column of
/// `/proc/stat`'s `cpu` line, in USER_HZ ticks of 10 ms). `None` where
/// there is no such file.
fn steal_s() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: u64 = stat
        .lines()
        .next()?
        .split_whitespace()
        .nth(8)?
        .parse()
        .ok()?;
    Some(ticks as f64 / 100.0)
}

/// Samples the call counter and the host's steal time every 20 ms until
/// the run's last call: per tenth of the calls, its wall time and the
/// steal time that fell in it (both seconds).
fn host_by_tenth(counter: &AtomicU64, total: u64) -> Vec<(f64, f64)> {
    let mut out = vec![(0.0, 0.0); TENTHS];
    let mut at = Instant::now();
    let mut steal = steal_s().unwrap_or(0.0);
    loop {
        std::thread::sleep(std::time::Duration::from_millis(20));
        let n = counter.load(Ordering::Relaxed);
        let tenth = ((n.min(total.saturating_sub(1)) * TENTHS as u64) / total.max(1)) as usize;
        let now = steal_s().unwrap_or(steal);
        let cell = &mut out[tenth.min(TENTHS - 1)];
        cell.0 += at.elapsed().as_secs_f64();
        cell.1 += (now - steal).max(0.0);
        at = Instant::now();
        steal = now;
        if n >= total {
            return out;
        }
    }
}
