//! The `ops` target: a sequence of operations over a small key space, run
//! against the FILE store and against a plain in-memory model of the spec
//! (maps, written here from SPEC.md, not from the store's code), compared
//! after every step: `Ok` values in full, errors by kind and facts.
//!
//! The model is the spec's reading of each rule: versions (R2, S1), patches
//! and overflow (R4), amounts a put may not move (R6), sessions that must
//! exist (R8), deletes with and without cascade (S2, S3), listings in seq
//! order with cursors bound to their listing (L1–L6), fences (T2–T4),
//! marked trays (T5), alarms (A1–A3), spend caps with holds that expire by
//! the clock (B1–B5), and "after any error the store reads exactly as
//! before the call" (E6). Reopen drops the store and opens it
//! again; nothing acknowledged may change.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::path::Path;
use std::sync::Arc;

use agentstate::{
    Alarm, Amount, Approval, BudgetKey, BudgetRecord, BudgetStatus, BudgetStore, CapLimit,
    CapScope, Caps, Cursor, Durability, FileStore, Hold, HoldRecord, InstanceKey, ManualClock,
    MarkedTray, Missing, Options, Page, PageRequest, RunKey, RunRecord, RunSpend, RunState,
    SessionKey, SessionRecord, Settled, Spend, StateDelta, StateError, StateQuery, StateStore,
    StoreAdmin, Tray, TrayKey, TrayOp, TrayStore,
};

use super::Input;

/// Operations per input; each is cheap, a reopen is not.
const OPS_MAX: usize = 64;
/// Walks stop here (a bug that loops forever fails instead of hanging).
const PAGES_MAX: usize = 200;
/// "" is not a valid id (K1): picked now and then to check `Invalid`.
const TENANTS: [&str; 3] = ["acme", "acme\0b", ""];
const RUNS: [&str; 3] = ["r0", "r/1", "r\0"];
const SESSIONS: [&str; 2] = ["s0", "s/1"];
const AGENTS: [&str; 2] = ["planner", "coder"];
const INSTANCES: [(&str, &str); 3] = [("ns", "w0"), ("ns", "w\u{e9}"), ("ns\0", "w0")];
const TRAYS: [(&str, &str); 3] = [("a", "0"), ("a", "1"), ("b", "0")];
const ENVS: [&str; 3] = ["prod", "dev", ""];
const LIMITS: [usize; 6] = [1, 1, 2, 3, 5, 0];
/// Budget names: one that can exist, one that never does.
const BUDGETS: [&str; 2] = ["b0", "b/1"];
const HOLDS: [&str; 3] = ["h0", "h1", ""];

/// A hold id: the invalid one now and then, not a third of the time.
fn read_hold(inp: &mut Input<'_>) -> &'static str {
    if inp.below(16) == 0 {
        HOLDS[2]
    } else {
        inp.pick(&HOLDS[..2])
    }
}

type TrayId = (String, String, String, String);

fn tray_tuple(k: &TrayKey) -> TrayId {
    (
        k.ns.clone(),
        k.id.clone(),
        k.tray_ns.clone(),
        k.tray_id.clone(),
    )
}
fn tray_key(t: &TrayId) -> TrayKey {
    TrayKey {
        ns: t.0.clone(),
        id: t.1.clone(),
        tray_ns: t.2.clone(),
        tray_id: t.3.clone(),
    }
}

/// Which listing a cursor came from, with everything it is bound to.
#[derive(Debug, Clone, PartialEq)]
enum Bind {
    Runs(Query),
    Trays(usize),
    Marked(Option<&'static str>),
    Alarms,
}

/// Where a page ended, in the model's terms.
#[derive(Debug, Clone)]
enum Resume {
    Seq(u64),
    Tray(TrayId),
    Alarm(u64, String, String),
}

#[derive(Debug, Clone, PartialEq)]
struct Query {
    tenant: &'static str,
    state: Option<RunState>,
    session: Option<&'static str>,
    agent: Option<&'static str>,
    updated_before: Option<u64>,
    limit: usize,
}

impl Query {
    fn read(inp: &mut Input<'_>) -> Query {
        let mask = inp.byte();
        Query {
            tenant: inp.pick(&TENANTS[..2]),
            state: (mask & 1 != 0).then(|| inp.pick(&RunState::ALL)),
            session: (mask & 2 != 0).then(|| inp.pick(&SESSIONS)),
            agent: (mask & 4 != 0).then(|| inp.pick(&AGENTS)),
            updated_before: (mask & 8 != 0).then(|| 1_000 + inp.below(8) as u64),
            limit: inp.pick(&LIMITS),
        }
    }
    fn to_store(&self) -> StateQuery {
        let mut q = StateQuery::new(self.tenant);
        q.state = self.state;
        q.session = self.session.map(str::to_string);
        q.agent = self.agent.map(str::to_string);
        q.updated_before = self.updated_before;
        q
    }
    fn page(&self, cursor: Option<&Cursor>) -> PageRequest {
        PageRequest::new(self.limit).after(cursor)
    }
    fn matches(&self, r: &RunRecord) -> bool {
        r.key.tenant == self.tenant
            && self.state.is_none_or(|s| s == r.state)
            && self
                .session
                .is_none_or(|s| r.session_id.as_deref() == Some(s))
            && self.agent.is_none_or(|a| r.agent_name == a)
            && self.updated_before.is_none_or(|t| r.updated_at < t)
    }
    fn bind(&self) -> Bind {
        Bind::Runs(Query {
            limit: 0,
            ..self.clone()
        })
    }
}

/// How a listing op walks: every page, or the first page only (keeping
/// its cursor), or one page from the kept cursor.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Walk {
    All,
    First,
    Saved,
}

#[derive(Debug, Clone)]
enum Op {
    CreateRun {
        tenant: &'static str,
        run: &'static str,
        session: Option<&'static str>,
        agent: &'static str,
    },
    PutRun {
        tenant: &'static str,
        run: &'static str,
        version: VersionPick,
        state: RunState,
        agent: &'static str,
        approval: bool,
        moves: u8,
    },
    PatchRun {
        tenant: &'static str,
        run: &'static str,
        cost: u64,
        iterations: u64,
        messages: u64,
    },
    GetRun {
        tenant: &'static str,
        run: &'static str,
    },
    PutSession {
        tenant: &'static str,
        session: &'static str,
        version: VersionPick,
        label: u8,
    },
    GetSession {
        tenant: &'static str,
        session: &'static str,
    },
    DeleteSession {
        tenant: &'static str,
        session: &'static str,
        cascade: bool,
    },
    ListRuns {
        query: Query,
        walk: Walk,
    },
    WriteTray {
        inst: usize,
        tray: usize,
        epoch: EpochPick,
        marked: bool,
        env: &'static str,
        doc: Vec<u8>,
    },
    ReadTray {
        inst: usize,
        tray: usize,
        epoch: EpochPick,
    },
    DeleteTray {
        inst: usize,
        tray: usize,
        epoch: EpochPick,
    },
    Batch {
        inst: usize,
        epoch: EpochPick,
        ops: BatchOps,
    },
    Release {
        inst: usize,
        epoch: EpochPick,
    },
    ListTrays {
        inst: usize,
        epoch: EpochPick,
        limit: usize,
        walk: Walk,
    },
    MarkedTrays {
        env: Option<&'static str>,
        limit: usize,
        walk: Walk,
    },
    Epoch {
        inst: usize,
    },
    SetAlarm {
        inst: usize,
        epoch: EpochPick,
        due: u64,
    },
    AckAlarm {
        inst: usize,
        epoch: EpochPick,
        due: Option<u64>,
    },
    DueAlarms {
        now: u64,
        limit: usize,
        walk: Walk,
    },
    AdvanceClock {
        by: u64,
    },
    Reopen,
    PutBudget {
        tenant: &'static str,
        budget: &'static str,
        version: VersionPick,
        cost_max: Option<u64>,
    },
    GetBudget {
        tenant: &'static str,
        budget: &'static str,
    },
    CreateCappedRun {
        tenant: &'static str,
        run: &'static str,
        cost_max: Option<u64>,
        iterations_max: Option<u64>,
        budget: Option<&'static str>,
    },
    Reserve {
        tenant: &'static str,
        run: &'static str,
        hold: &'static str,
        cost: u64,
        iterations: u64,
        ttl: u64,
    },
    Settle {
        tenant: &'static str,
        run: &'static str,
        hold: &'static str,
        cost: u64,
        iterations: u64,
    },
    ReleaseHold {
        tenant: &'static str,
        run: &'static str,
        hold: &'static str,
    },
    RunSpend {
        tenant: &'static str,
        run: &'static str,
    },
}

/// A batch's ops: a tray, and for a put its (marked, env, doc byte).
type BatchOps = Vec<(usize, Option<(bool, &'static str, u8)>)>;

/// A version relative to what the model holds, so most puts are near it.
#[derive(Debug, Clone, Copy)]
enum VersionPick {
    Current,
    Ahead,
    Behind,
    Zero,
}

/// An epoch relative to the stored one.
#[derive(Debug, Clone, Copy)]
enum EpochPick {
    Same,
    Next,
    Stale,
    Jump,
}

fn read_walk(inp: &mut Input<'_>) -> Walk {
    inp.pick(&[Walk::All, Walk::All, Walk::First, Walk::Saved])
}
fn read_epoch(inp: &mut Input<'_>) -> EpochPick {
    inp.pick(&[
        EpochPick::Same,
        EpochPick::Same,
        EpochPick::Next,
        EpochPick::Stale,
        EpochPick::Jump,
    ])
}
fn read_version(inp: &mut Input<'_>) -> VersionPick {
    inp.pick(&[
        VersionPick::Current,
        VersionPick::Current,
        VersionPick::Current,
        VersionPick::Ahead,
        VersionPick::Behind,
        VersionPick::Zero,
    ])
}
fn read_tenant(inp: &mut Input<'_>) -> &'static str {
    // The invalid tenant now and then, not half the time.
    if inp.below(16) == 0 {
        TENANTS[2]
    } else {
        inp.pick(&TENANTS[..2])
    }
}

impl Op {
    /// Reads one op. Selector bytes 242..=255 pick the spend-cap ops; below
    /// that the mapping is what it was before they existed (`byte % 22`),
    /// so committed regression inputs keep their meaning. With `caps_bias`
    /// (the seeded replay's second mode) half of the selectors pick a
    /// spend-cap op, so their sequences get deep without a fuzzer.
    fn read(inp: &mut Input<'_>, caps_bias: bool) -> Op {
        let b = inp.byte();
        if b >= 242 {
            return Op::read_budget(inp, b - 242);
        }
        if caps_bias && b & 1 == 1 {
            return Op::read_budget(inp, (b >> 1) % 14).narrowed();
        }
        match b as usize % 22 {
            0 | 1 => Op::CreateRun {
                tenant: read_tenant(inp),
                run: inp.pick(&RUNS),
                session: inp.bool().then(|| inp.pick(&SESSIONS)),
                agent: inp.pick(&AGENTS),
            },
            2 | 3 => Op::PutRun {
                tenant: read_tenant(inp),
                run: inp.pick(&RUNS),
                version: read_version(inp),
                state: inp.pick(&RunState::ALL),
                agent: inp.pick(&AGENTS),
                approval: inp.bool(),
                // Mostly 0; otherwise which rule-R6 field (or the session) to move.
                moves: inp.byte().saturating_sub(250),
            },
            4 => Op::PatchRun {
                tenant: read_tenant(inp),
                run: inp.pick(&RUNS),
                cost: match inp.below(8) {
                    0 => u64::MAX - inp.below(4) as u64,
                    n => n as u64 * 100,
                },
                iterations: inp.below(3) as u64,
                messages: inp.below(3) as u64,
            },
            5 => Op::GetRun {
                tenant: read_tenant(inp),
                run: inp.pick(&RUNS),
            },
            6 => Op::PutSession {
                tenant: read_tenant(inp),
                session: inp.pick(&SESSIONS),
                version: read_version(inp),
                label: inp.byte(),
            },
            7 => Op::GetSession {
                tenant: read_tenant(inp),
                session: inp.pick(&SESSIONS),
            },
            8 => Op::DeleteSession {
                tenant: read_tenant(inp),
                session: inp.pick(&SESSIONS),
                cascade: inp.bool(),
            },
            9 | 10 => Op::ListRuns {
                query: Query::read(inp),
                walk: read_walk(inp),
            },
            11 => Op::WriteTray {
                inst: inp.below(INSTANCES.len()),
                tray: inp.below(TRAYS.len()),
                epoch: read_epoch(inp),
                marked: inp.bool(),
                env: inp.pick(&ENVS),
                doc: inp.bytes(6).to_vec(),
            },
            12 => Op::ReadTray {
                inst: inp.below(INSTANCES.len()),
                tray: inp.below(TRAYS.len()),
                epoch: read_epoch(inp),
            },
            13 => Op::DeleteTray {
                inst: inp.below(INSTANCES.len()),
                tray: inp.below(TRAYS.len()),
                epoch: read_epoch(inp),
            },
            14 => {
                let inst = inp.below(INSTANCES.len());
                let epoch = read_epoch(inp);
                let n = inp.below(5);
                let ops = (0..n)
                    .map(|_| {
                        let t = inp.below(TRAYS.len());
                        let put = inp.below(3) != 0;
                        (t, put.then(|| (inp.bool(), inp.pick(&ENVS), inp.byte())))
                    })
                    .collect();
                Op::Batch { inst, epoch, ops }
            }
            15 => Op::Release {
                inst: inp.below(INSTANCES.len()),
                epoch: read_epoch(inp),
            },
            16 => Op::ListTrays {
                inst: inp.below(INSTANCES.len()),
                epoch: read_epoch(inp),
                limit: inp.pick(&LIMITS),
                walk: read_walk(inp),
            },
            17 => Op::MarkedTrays {
                env: inp.bool().then(|| inp.pick(&ENVS)),
                limit: inp.pick(&LIMITS),
                walk: read_walk(inp),
            },
            18 => Op::Epoch {
                inst: inp.below(INSTANCES.len()),
            },
            19 => match inp.below(3) {
                0 => Op::SetAlarm {
                    inst: inp.below(INSTANCES.len()),
                    epoch: read_epoch(inp),
                    due: read_due(inp),
                },
                1 => Op::AckAlarm {
                    inst: inp.below(INSTANCES.len()),
                    epoch: read_epoch(inp),
                    due: inp.bool().then(|| read_due(inp)),
                },
                _ => Op::DueAlarms {
                    now: read_due(inp),
                    limit: inp.pick(&LIMITS),
                    walk: read_walk(inp),
                },
            },
            20 => Op::AdvanceClock {
                by: inp.below(3) as u64,
            },
            _ => Op::Reopen,
        }
    }
}

impl Op {
    /// The spend-cap op on one tenant and two runs, so that reserves,
    /// settles and releases meet each other's holds often.
    fn narrowed(mut self) -> Op {
        let narrow = |t: &mut &'static str, r: &mut &'static str| {
            if !t.is_empty() {
                *t = TENANTS[0];
            }
            if *r == RUNS[2] {
                *r = RUNS[0];
            }
        };
        match &mut self {
            Op::CreateCappedRun { tenant, run, .. }
            | Op::Reserve { tenant, run, .. }
            | Op::Settle { tenant, run, .. }
            | Op::ReleaseHold { tenant, run, .. }
            | Op::RunSpend { tenant, run } => narrow(tenant, run),
            Op::PutBudget { tenant, .. } | Op::GetBudget { tenant, .. } => {
                let mut r = RUNS[0];
                narrow(tenant, &mut r);
            }
            _ => {}
        }
        self
    }

    fn read_budget(inp: &mut Input<'_>, which: u8) -> Op {
        let cost = |inp: &mut Input<'_>| match inp.below(8) {
            0 => u64::MAX - inp.below(2) as u64,
            n => n as u64 * 100,
        };
        match which {
            0 | 1 => Op::PutBudget {
                tenant: read_tenant(inp),
                budget: if inp.below(4) == 0 {
                    BUDGETS[1]
                } else {
                    BUDGETS[0]
                },
                version: read_version(inp),
                cost_max: inp.bool().then(|| inp.below(12) as u64 * 100),
            },
            2 => Op::GetBudget {
                tenant: read_tenant(inp),
                budget: inp.pick(&BUDGETS),
            },
            3 | 4 => Op::CreateCappedRun {
                tenant: read_tenant(inp),
                run: inp.pick(&RUNS),
                cost_max: inp.bool().then(|| inp.below(12) as u64 * 100),
                iterations_max: inp.bool().then(|| inp.below(4) as u64),
                budget: inp.bool().then(|| inp.pick(&BUDGETS)),
            },
            5..=7 => Op::Reserve {
                tenant: read_tenant(inp),
                run: inp.pick(&RUNS),
                hold: read_hold(inp),
                cost: cost(inp),
                iterations: inp.below(3) as u64,
                // 0 is Invalid; the clock moves by 0..=2 at a time.
                ttl: inp.below(10) as u64,
            },
            8 | 9 => Op::Settle {
                tenant: read_tenant(inp),
                run: inp.pick(&RUNS),
                hold: read_hold(inp),
                cost: cost(inp),
                iterations: inp.below(3) as u64,
            },
            10 | 11 => Op::ReleaseHold {
                tenant: read_tenant(inp),
                run: inp.pick(&RUNS),
                hold: read_hold(inp),
            },
            _ => Op::RunSpend {
                tenant: read_tenant(inp),
                run: inp.pick(&RUNS),
            },
        }
    }
}

fn read_due(inp: &mut Input<'_>) -> u64 {
    match inp.below(10) {
        0 => u64::MAX,
        n => 1_000 + n as u64,
    }
}

fn instance(i: usize) -> InstanceKey {
    InstanceKey::new(INSTANCES[i].0, INSTANCES[i].1)
}

fn tray_of(i: usize, t: usize) -> TrayKey {
    instance(i).tray(TRAYS[t].0, TRAYS[t].1)
}

fn make_tray(marked: bool, env: &str, doc: Vec<u8>) -> Tray {
    Tray {
        marked,
        doc,
        env: env.to_string(),
        hostname: format!("host-{env}"),
    }
}

/// An error as the comparison sees it: its kind and the facts the spec
/// says it carries.
fn kind(e: &StateError) -> String {
    match e {
        StateError::Conflict {
            expected, actual, ..
        } => {
            format!("Conflict {{ expected: {expected}, actual: {actual} }}")
        }
        StateError::NotFound(m) => format!("NotFound({m})"),
        StateError::InUse { runs, .. } => format!("InUse({runs:?})"),
        StateError::FenceLost { caller, stored, .. } => {
            format!("FenceLost {{ caller: {caller}, stored: {stored} }}")
        }
        StateError::Invalid { .. } => "Invalid".to_string(),
        StateError::BudgetExceeded {
            limit,
            spent,
            held,
            asked,
        } => format!("BudgetExceeded {{ {limit:?}, {spent}, {held}, {asked} }}"),
        StateError::Persistence { reason, .. } => format!("Persistence({reason:?})"),
        other => format!("unexpected error: {other}"),
    }
}

type Outcome = Result<String, String>;

fn show<T: Debug>(r: agentstate::Result<T>) -> Outcome {
    r.map(|v| format!("{v:?}")).map_err(|e| kind(&e))
}

fn invalid() -> Outcome {
    Err("Invalid".to_string())
}

fn ok<T: Debug>(v: T) -> Outcome {
    Ok(format!("{v:?}"))
}

/// The spec's store: plain maps.
#[derive(Default)]
struct Model {
    now: u64,
    next_seq: u64,
    runs: BTreeMap<(String, String), RunRecord>,
    sessions: BTreeMap<(String, String), SessionRecord>,
    epochs: BTreeMap<usize, u64>,
    trays: BTreeMap<TrayId, Tray>,
    /// (ns, id) → due.
    alarms: BTreeMap<(String, String), u64>,
    /// (tenant, name) → the budget and what its runs spent.
    budgets: BTreeMap<(String, String), (BudgetRecord, Spend)>,
    /// (tenant, run, hold id) → the hold, live or expired.
    holds: BTreeMap<(String, String, String), HoldRecord>,
    saved: Option<(Bind, Resume)>,
}

impl Model {
    /// B5: the live holds of a run at `now`, in id order.
    fn run_holds(&self, tenant: &str, run: &str) -> Vec<HoldRecord> {
        self.holds
            .iter()
            .filter(|((t, r, _), h)| t == tenant && r == run && self.now < h.expires_at)
            .map(|(_, h)| h.clone())
            .collect()
    }

    /// The live holds of every run drawing from the budget.
    fn budget_holds(&self, tenant: &str, budget: &str) -> Vec<HoldRecord> {
        self.holds
            .iter()
            .filter(|((t, r, _), h)| {
                t == tenant
                    && self.now < h.expires_at
                    && self
                        .runs
                        .get(&(t.clone(), r.clone()))
                        .is_some_and(|run| run.budget.as_deref() == Some(budget))
            })
            .map(|(_, h)| h.clone())
            .collect()
    }

    fn sum(holds: &[HoldRecord]) -> Spend {
        let mut s = Spend::default();
        for h in holds {
            s.cost_micros = s.cost_micros.saturating_add(h.amounts.cost_micros);
            s.tokens = s.tokens.saturating_add(h.amounts.tokens);
            s.iterations = s.iterations.saturating_add(h.amounts.iterations);
        }
        s
    }

    fn budget_status(&self, tenant: &str, name: &str) -> Option<BudgetStatus> {
        let (record, spent) = self.budgets.get(&(tenant.to_string(), name.to_string()))?;
        let holds = self.budget_holds(tenant, name);
        Some(BudgetStatus::new(
            record.clone(),
            *spent,
            Model::sum(&holds),
            holds.len() as u64,
        ))
    }

    fn run_spend(&self, r: &RunRecord) -> RunSpend {
        let holds = self.run_holds(&r.key.tenant, &r.key.run_id);
        RunSpend::new(
            r.key.clone(),
            r.caps,
            r.budget.clone(),
            Spend::of_run(r),
            Model::sum(&holds),
            holds,
        )
    }

    /// B3/B6: a run of a budget spent `cost` and `iterations`; saturating.
    fn spend_on_budget(&mut self, r: &RunRecord, cost: u64, iterations: u64) {
        if let Some(b) = &r.budget
            && let Some((_, spent)) = self.budgets.get_mut(&(r.key.tenant.clone(), b.clone()))
        {
            spent.cost_micros = spent.cost_micros.saturating_add(cost);
            spent.iterations = spent.iterations.saturating_add(iterations);
        }
    }

    /// B2 as the spec states it: spent + held + asked within every cap, the
    /// run's first, then its budget's.
    fn fits(&self, r: &RunRecord, asked: Spend) -> Result<(), String> {
        let check = |scope: CapScope, caps: &Caps, spent: Spend, held: Spend| {
            for amount in Amount::ALL {
                if let Some(max) = caps.max(amount) {
                    let (s, h, a) = (spent.get(amount), held.get(amount), asked.get(amount));
                    if s as u128 + h as u128 + a as u128 > max as u128 {
                        let limit = CapLimit::new(scope.clone(), amount, max);
                        return Err(format!("BudgetExceeded {{ {limit:?}, {s}, {h}, {a} }}"));
                    }
                }
            }
            Ok(())
        };
        let run_held = Model::sum(&self.run_holds(&r.key.tenant, &r.key.run_id));
        check(
            CapScope::Run(r.key.clone()),
            &r.caps,
            Spend::of_run(r),
            run_held,
        )?;
        if let Some(b) = &r.budget {
            let st = self
                .budget_status(&r.key.tenant, b)
                .expect("a run's budget exists");
            check(
                CapScope::Budget(st.record.key.clone()),
                &st.record.caps,
                st.spent,
                st.held,
            )?;
        }
        Ok(())
    }

    fn epoch(&self, inst: usize) -> u64 {
        self.epochs.get(&inst).copied().unwrap_or(0)
    }

    fn pick_epoch(&self, inst: usize, p: EpochPick) -> u64 {
        let e = self.epoch(inst);
        match p {
            EpochPick::Same => e,
            EpochPick::Next => e + 1,
            EpochPick::Stale => e.saturating_sub(1),
            EpochPick::Jump => e + 3,
        }
    }

    /// T2: the fence as the spec states it. Does not change anything on
    /// its own; the caller stores the epoch once the whole call succeeds.
    fn fence(&self, inst: usize, epoch: u64) -> Result<(), String> {
        let stored = self.epoch(inst);
        if epoch < stored {
            return Err(format!("FenceLost {{ caller: {epoch}, stored: {stored} }}"));
        }
        Ok(())
    }

    fn runs_sorted(&self, q: &Query) -> Vec<RunRecord> {
        let mut v: Vec<RunRecord> = self
            .runs
            .values()
            .filter(|r| q.matches(r))
            .cloned()
            .collect();
        v.sort_by_key(|r| r.seq);
        v
    }

    fn session_runs(&self, tenant: &str, session: &str) -> Vec<RunRecord> {
        let mut v: Vec<RunRecord> = self
            .runs
            .values()
            .filter(|r| r.key.tenant == tenant && r.session_id.as_deref() == Some(session))
            .cloned()
            .collect();
        v.sort_by_key(|r| r.seq);
        v
    }

    fn instance_trays(&self, inst: usize) -> Vec<(TrayKey, Tray)> {
        let (ns, id) = INSTANCES[inst];
        self.trays
            .iter()
            .filter(|(k, _)| k.0 == ns && k.1 == id)
            .map(|(k, t)| (tray_key(k), t.clone()))
            .collect()
    }

    fn marked(&self, env: Option<&str>) -> Vec<MarkedTray> {
        self.trays
            .iter()
            .filter(|(_, t)| t.marked && env.is_none_or(|e| e == t.env))
            .map(|(k, t)| MarkedTray::new(tray_key(k), t.env.clone(), t.hostname.clone()))
            .collect()
    }

    fn due(&self, now: u64) -> Vec<Alarm> {
        let mut v: Vec<Alarm> = self
            .alarms
            .iter()
            .filter(|(_, d)| **d <= now)
            .map(|((ns, id), d)| Alarm::new(InstanceKey::new(ns.clone(), id.clone()), *d))
            .collect();
        v.sort_by(|a, b| {
            (a.due_at, &a.instance.ns, &a.instance.id).cmp(&(
                b.due_at,
                &b.instance.ns,
                &b.instance.id,
            ))
        });
        v
    }

    fn set_tray(&mut self, inst: usize, t: usize, tray: Option<Tray>) -> bool {
        let k = tray_tuple(&tray_of(inst, t));
        match tray {
            Some(tray) => self.trays.insert(k, tray).is_some(),
            None => self.trays.remove(&k).is_some(),
        }
    }
}

/// The pages a walk over `items` yields from after `start`: each page's
/// items and whether it carries a cursor, plus where the last page ended.
fn paginate<T: Clone>(items: &[T], limit: usize, pages: usize) -> Vec<(Vec<T>, bool)> {
    let mut out = Vec::new();
    let mut rest = items;
    loop {
        let n = rest.len().min(limit);
        let more = rest.len() > limit;
        out.push((rest[..n].to_vec(), more));
        rest = &rest[n..];
        if !more || out.len() >= pages {
            return out;
        }
    }
}

/// What a listing op asks for, besides its closures.
struct Listing {
    walk: Walk,
    bind: Bind,
    limit: usize,
    /// Validity checks that precede the cursor's (ids, fence): the
    /// model's error for them, if any.
    pre: Option<String>,
}

/// The harness: the store, the model, the op being compared.
struct Harness<'a> {
    path: &'a Path,
    opts: Options,
    clock: Arc<ManualClock>,
    store: Option<FileStore>,
    model: Model,
    saved_cursor: Option<Cursor>,
    log: Vec<String>,
}

impl Harness<'_> {
    fn store(&self) -> &FileStore {
        self.store.as_ref().expect("store is open")
    }

    fn check(&self, what: &str, store: &Outcome, model: &Outcome) {
        if store != model {
            panic!(
                "store and model disagree on {what}\n store: {store:?}\n model: {model:?}\nops so far:\n  {}",
                self.log.join("\n  ")
            );
        }
    }

    /// Pages through a listing on both sides and compares page by page.
    /// `page(cursor)` calls the store; `items` is the model's full list
    /// from where the walk starts; `resume(item)` is where a page that
    /// ends at that item resumes.
    fn walk<T: Debug + Clone>(
        &mut self,
        listing: Listing,
        model_items: impl Fn(&Model, Option<&Resume>) -> Vec<T>,
        resume: impl Fn(&T) -> Resume,
        mut page: impl FnMut(&FileStore, Option<&Cursor>) -> agentstate::Result<Page<T>>,
    ) {
        let Listing {
            walk,
            bind,
            limit,
            pre,
        } = listing;
        let (start, start_cursor) = match walk {
            Walk::Saved => match (&self.model.saved, &self.saved_cursor) {
                (Some((b, r)), Some(c)) => (Some((b.clone(), r.clone())), Some(c.clone())),
                _ => return,
            },
            _ => (None, None),
        };
        let model_pages: Result<Vec<(Vec<T>, bool)>, String> = match (&pre, limit, &start) {
            (Some(e), _, _) => Err(e.clone()),
            (None, 0, _) => Err("Invalid".into()),
            (None, _, Some((b, _))) if *b != bind => Err("Invalid".into()),
            (None, _, start) => {
                let items = model_items(&self.model, start.as_ref().map(|s| &s.1));
                let pages = if walk == Walk::All { PAGES_MAX } else { 1 };
                Ok(paginate(&items, limit, pages))
            }
        };
        let mut cursor = start_cursor;
        let mut got: Vec<(Vec<T>, bool)> = Vec::new();
        let mut last_cursor = None;
        let store_pages: Result<Vec<(Vec<T>, bool)>, String> = loop {
            match page(self.store(), cursor.as_ref()) {
                Ok(p) => {
                    let (items, c) = p.into_parts();
                    got.push((items, c.is_some()));
                    last_cursor = c.clone();
                    if walk != Walk::All || c.is_none() || got.len() >= PAGES_MAX {
                        break Ok(got);
                    }
                    cursor = c;
                }
                Err(e) => break Err(kind(&e)),
            }
        };
        let show_pages = |p: &Result<Vec<(Vec<T>, bool)>, String>| {
            p.as_ref().map(|v| format!("{v:?}")).map_err(Clone::clone)
        };
        self.check(
            "a listing",
            &show_pages(&store_pages),
            &show_pages(&model_pages),
        );
        if walk == Walk::First
            && let Ok(pages) = &model_pages
            && let Some((items, true)) = pages.first()
        {
            let last = items.last().expect("a page with a cursor has items");
            self.model.saved = Some((bind, resume(last)));
            self.saved_cursor = last_cursor;
        }
    }

    fn step(&mut self, op: Op) {
        self.log.push(format!("{op:?}"));
        let what = format!("op {} {op:?}", self.log.len());
        let m = &mut self.model;
        let s = self.store.as_ref().expect("store is open");
        let now = m.now;
        let (got, want): (Outcome, Outcome) = match op {
            Op::CreateRun {
                tenant,
                run,
                session,
                agent,
            } => {
                let key = RunKey::new(tenant, run);
                let mut rec = RunRecord::new(key.clone(), agent);
                rec.session_id = session.map(str::to_string);
                let got = show(s.put_run(rec.clone()));
                let k = (tenant.to_string(), run.to_string());
                let want = if tenant.is_empty() {
                    invalid()
                } else if let Some(old) = m.runs.get(&k) {
                    Err(format!(
                        "Conflict {{ expected: 0, actual: {} }}",
                        old.version
                    ))
                } else if let Some(sid) = session
                    && !m
                        .sessions
                        .contains_key(&(tenant.to_string(), sid.to_string()))
                {
                    Err(format!(
                        "NotFound({})",
                        Missing::Session(SessionKey::new(tenant, sid))
                    ))
                } else {
                    m.next_seq += 1;
                    let new = RunRecord {
                        version: 1,
                        seq: m.next_seq,
                        created_at: now,
                        updated_at: now,
                        ..rec
                    };
                    m.runs.insert(k, new.clone());
                    ok(new)
                };
                (got, want)
            }
            Op::PutRun {
                tenant,
                run,
                version,
                state,
                agent,
                approval,
                moves,
            } => {
                let key = RunKey::new(tenant, run);
                let k = (tenant.to_string(), run.to_string());
                let stored = m.runs.get(&k).cloned();
                let mut rec = stored
                    .clone()
                    .unwrap_or_else(|| RunRecord::new(key.clone(), agent));
                let cur = stored.as_ref().map_or(1, |r| r.version);
                rec.version = match version {
                    VersionPick::Current => cur,
                    VersionPick::Ahead => cur + 1,
                    VersionPick::Behind => cur.saturating_sub(1),
                    VersionPick::Zero => 0,
                };
                rec.state = state;
                rec.agent_name = agent.to_string();
                rec.approval = approval.then(|| Approval {
                    id: "ap".into(),
                    prompt: "ok?".into(),
                });
                match moves {
                    1 => rec.cost_micros += 1,
                    2 => rec.usage.input_tokens += 1,
                    3 => rec.messages_read += 1,
                    4 => rec.iterations += 1,
                    5 => {
                        rec.session_id = if rec.session_id.is_some() {
                            None
                        } else {
                            Some(SESSIONS[0].into())
                        }
                    }
                    _ => {}
                }
                let got = show(s.put_run(rec.clone()));
                let want = if tenant.is_empty() {
                    invalid()
                } else {
                    match (rec.version, &stored) {
                        (0, Some(old)) => Err(format!(
                            "Conflict {{ expected: 0, actual: {} }}",
                            old.version
                        )),
                        (0, None) => match &rec.session_id {
                            Some(sid)
                                if !m.sessions.contains_key(&(tenant.to_string(), sid.clone())) =>
                            {
                                Err(format!(
                                    "NotFound({})",
                                    Missing::Session(SessionKey::new(tenant, sid.clone()))
                                ))
                            }
                            _ => {
                                m.next_seq += 1;
                                let new = RunRecord {
                                    version: 1,
                                    seq: m.next_seq,
                                    created_at: now,
                                    updated_at: now,
                                    ..rec
                                };
                                m.runs.insert(k, new.clone());
                                ok(new)
                            }
                        },
                        (n, None) => Err(format!("Conflict {{ expected: {n}, actual: 0 }}")),
                        (n, Some(old)) if old.version != n => Err(format!(
                            "Conflict {{ expected: {n}, actual: {} }}",
                            old.version
                        )),
                        (_, Some(old)) => {
                            if old.usage != rec.usage
                                || old.cost_micros != rec.cost_micros
                                || old.iterations != rec.iterations
                                || old.messages_read != rec.messages_read
                                || old.session_id != rec.session_id
                                // R9: a finished run stays finished.
                                || (old.state.is_finished() && old.state != rec.state)
                            {
                                invalid()
                            } else {
                                let new = RunRecord {
                                    version: old.version + 1,
                                    seq: old.seq,
                                    created_at: old.created_at,
                                    updated_at: now,
                                    ..rec
                                };
                                m.runs.insert(k, new.clone());
                                ok(new)
                            }
                        }
                    }
                };
                (got, want)
            }
            Op::PatchRun {
                tenant,
                run,
                cost,
                iterations,
                messages,
            } => {
                let key = RunKey::new(tenant, run);
                let delta = StateDelta {
                    cost_micros: cost,
                    iterations,
                    messages_read: messages,
                    ..Default::default()
                };
                let got = show(s.patch_run(&key, delta));
                let k = (tenant.to_string(), run.to_string());
                let want = if tenant.is_empty() {
                    invalid()
                } else {
                    match m.runs.get(&k).cloned() {
                        None => Err(format!("NotFound({})", Missing::Run(key))),
                        Some(old) => match (
                            old.cost_micros.checked_add(cost),
                            old.iterations.checked_add(iterations),
                            old.messages_read.checked_add(messages),
                        ) {
                            (Some(c), Some(i), Some(msg)) => {
                                let new = RunRecord {
                                    cost_micros: c,
                                    iterations: i,
                                    messages_read: msg,
                                    version: old.version + 1,
                                    updated_at: now,
                                    ..old
                                };
                                // B6: a patch counts toward its budget.
                                m.spend_on_budget(&new, cost, iterations);
                                m.runs.insert(k, new.clone());
                                ok(new)
                            }
                            _ => invalid(),
                        },
                    }
                };
                (got, want)
            }
            Op::GetRun { tenant, run } => {
                let got = show(s.get_run(&RunKey::new(tenant, run)));
                let want = if tenant.is_empty() {
                    invalid()
                } else {
                    ok(m.runs.get(&(tenant.to_string(), run.to_string())).cloned())
                };
                (got, want)
            }
            Op::PutSession {
                tenant,
                session,
                version,
                label,
            } => {
                let k = (tenant.to_string(), session.to_string());
                let stored = m.sessions.get(&k).cloned();
                let cur = stored.as_ref().map_or(1, |r| r.version);
                let mut rec = SessionRecord::new(SessionKey::new(tenant, session));
                rec.version = match version {
                    VersionPick::Current => cur,
                    VersionPick::Ahead => cur + 1,
                    VersionPick::Behind => cur.saturating_sub(1),
                    VersionPick::Zero => 0,
                };
                rec.metadata.insert("label".into(), label.to_string());
                let got = show(s.put_session(rec.clone()));
                let want = if tenant.is_empty() {
                    invalid()
                } else {
                    match (rec.version, stored) {
                        (0, Some(old)) => Err(format!(
                            "Conflict {{ expected: 0, actual: {} }}",
                            old.version
                        )),
                        (0, None) => {
                            let new = SessionRecord {
                                version: 1,
                                created_at: now,
                                updated_at: now,
                                ..rec
                            };
                            m.sessions.insert(k, new.clone());
                            ok(new)
                        }
                        (n, None) => Err(format!("Conflict {{ expected: {n}, actual: 0 }}")),
                        (n, Some(old)) if old.version != n => Err(format!(
                            "Conflict {{ expected: {n}, actual: {} }}",
                            old.version
                        )),
                        (_, Some(old)) => {
                            let new = SessionRecord {
                                version: old.version + 1,
                                created_at: old.created_at,
                                updated_at: now,
                                ..rec
                            };
                            m.sessions.insert(k, new.clone());
                            ok(new)
                        }
                    }
                };
                (got, want)
            }
            Op::GetSession { tenant, session } => {
                let got = show(s.get_session(&SessionKey::new(tenant, session)));
                let want = if tenant.is_empty() {
                    invalid()
                } else {
                    ok(m.sessions
                        .get(&(tenant.to_string(), session.to_string()))
                        .cloned())
                };
                (got, want)
            }
            Op::DeleteSession {
                tenant,
                session,
                cascade,
            } => {
                let key = SessionKey::new(tenant, session);
                let got = show(s.delete_session(&key, cascade));
                let k = (tenant.to_string(), session.to_string());
                let want = if tenant.is_empty() {
                    invalid()
                } else if !m.sessions.contains_key(&k) {
                    Err(format!("NotFound({})", Missing::Session(key)))
                } else {
                    let runs = m.session_runs(tenant, session);
                    let live: Vec<RunKey> = runs
                        .iter()
                        .filter(|r| !r.state.is_finished())
                        .map(|r| r.key.clone())
                        .collect();
                    if !cascade && !live.is_empty() {
                        Err(format!("InUse({live:?})"))
                    } else {
                        m.sessions.remove(&k);
                        if cascade {
                            for r in &runs {
                                m.runs.remove(&(r.key.tenant.clone(), r.key.run_id.clone()));
                                // A deleted run's holds go with it.
                                m.holds.retain(|(t, run, _), _| {
                                    (t, run) != (&r.key.tenant, &r.key.run_id)
                                });
                            }
                            ok(runs.into_iter().map(|r| r.key).collect::<Vec<_>>())
                        } else {
                            ok(Vec::<RunKey>::new())
                        }
                    }
                };
                (got, want)
            }
            Op::ListRuns { query, walk } => {
                let q = query.clone();
                self.walk(
                    Listing {
                        walk,
                        bind: query.bind(),
                        limit: query.limit,
                        pre: None,
                    },
                    |m, from| {
                        let after = match from {
                            Some(Resume::Seq(s)) => *s,
                            _ => 0,
                        };
                        m.runs_sorted(&q)
                            .into_iter()
                            .filter(|r| r.seq > after)
                            .collect()
                    },
                    |r: &RunRecord| Resume::Seq(r.seq),
                    |s, c| s.list_runs(&query.to_store(), &query.page(c)),
                );
                return;
            }
            Op::WriteTray {
                inst,
                tray,
                epoch,
                marked,
                env,
                doc,
            } => {
                let e = m.pick_epoch(inst, epoch);
                let t = make_tray(marked, env, doc);
                let got = show(s.write_tray(&tray_of(inst, tray), e, t.clone()));
                // A tray names its worker: env and hostname are ids (K1).
                let want = if env.is_empty() {
                    Err("Invalid".to_string())
                } else {
                    m.fence(inst, e)
                }
                .map(|()| {
                    m.epochs.insert(inst, e);
                    m.set_tray(inst, tray, Some(t));
                    format!("{:?}", ())
                });
                (got, want)
            }
            Op::ReadTray { inst, tray, epoch } => {
                let e = m.pick_epoch(inst, epoch);
                let got = show(s.read_tray(&tray_of(inst, tray), e));
                let want = m.fence(inst, e).map(|()| {
                    m.epochs.insert(inst, e);
                    format!("{:?}", m.trays.get(&tray_tuple(&tray_of(inst, tray))))
                });
                (got, want)
            }
            Op::DeleteTray { inst, tray, epoch } => {
                let e = m.pick_epoch(inst, epoch);
                let got = show(s.delete_tray(&tray_of(inst, tray), e));
                let want = m.fence(inst, e).map(|()| {
                    m.epochs.insert(inst, e);
                    format!("{:?}", m.set_tray(inst, tray, None))
                });
                (got, want)
            }
            Op::Batch { inst, epoch, ops } => {
                let e = m.pick_epoch(inst, epoch);
                let store_ops: Vec<TrayOp> = ops
                    .iter()
                    .map(|(t, put)| {
                        let (tray_ns, tray_id) = (TRAYS[*t].0.to_string(), TRAYS[*t].1.to_string());
                        match put {
                            Some((marked, env, d)) => TrayOp::Put {
                                tray_ns,
                                tray_id,
                                tray: make_tray(*marked, env, vec![*d]),
                            },
                            None => TrayOp::Delete { tray_ns, tray_id },
                        }
                    })
                    .collect();
                let got = show(s.apply_batch(&instance(inst), e, store_ops));
                let bad_env = ops
                    .iter()
                    .any(|(_, put)| put.is_some_and(|(_, env, _)| env.is_empty()));
                let want = if bad_env {
                    Err("Invalid".to_string())
                } else {
                    m.fence(inst, e)
                }
                .map(|()| {
                    m.epochs.insert(inst, e);
                    for (t, put) in &ops {
                        m.set_tray(
                            inst,
                            *t,
                            put.map(|(marked, env, d)| make_tray(marked, env, vec![d])),
                        );
                    }
                    format!("{:?}", ())
                });
                (got, want)
            }
            Op::Release { inst, epoch } => {
                let e = m.pick_epoch(inst, epoch);
                let got = show(s.release(&instance(inst), e));
                // T4: an older epoch's release is a no-op, not an error.
                if e >= m.epoch(inst) {
                    m.epochs.insert(inst, e);
                    let (ns, id) = INSTANCES[inst];
                    for (k, t) in m.trays.iter_mut() {
                        if k.0 == ns && k.1 == id {
                            t.marked = false;
                        }
                    }
                }
                (got, ok(()))
            }
            Op::ListTrays {
                inst,
                epoch,
                limit,
                walk,
            } => {
                let e = m.pick_epoch(inst, epoch);
                // The fence runs first; per E6 it takes effect only when
                // the whole call succeeds.
                // The limit is checked before the fence.
                let pre = if limit == 0 {
                    None
                } else {
                    m.fence(inst, e).err()
                };
                let cursor_ok = match (walk, &m.saved) {
                    (Walk::Saved, Some((b, _))) => *b == Bind::Trays(inst),
                    _ => true,
                };
                let advances = pre.is_none()
                    && limit != 0
                    && cursor_ok
                    && !(walk == Walk::Saved && m.saved.is_none());
                self.walk(
                    Listing {
                        walk,
                        bind: Bind::Trays(inst),
                        limit,
                        pre,
                    },
                    |m, from| {
                        m.instance_trays(inst)
                            .into_iter()
                            .filter(|(k, _)| match from {
                                Some(Resume::Tray(t)) => tray_tuple(k) > *t,
                                _ => true,
                            })
                            .collect()
                    },
                    |(k, _): &(TrayKey, Tray)| Resume::Tray(tray_tuple(k)),
                    |s, c| s.list_trays(&instance(inst), e, &PageRequest::new(limit).after(c)),
                );
                if advances {
                    self.model.epochs.insert(inst, e);
                }
                return;
            }
            Op::MarkedTrays { env, limit, walk } => {
                let pre = (env == Some("")).then(|| "Invalid".to_string());
                self.walk(
                    Listing {
                        walk,
                        bind: Bind::Marked(env),
                        limit,
                        pre,
                    },
                    |m, from| {
                        m.marked(env)
                            .into_iter()
                            .filter(|t| match from {
                                Some(Resume::Tray(k)) => tray_tuple(&t.key) > *k,
                                _ => true,
                            })
                            .collect()
                    },
                    |t: &MarkedTray| Resume::Tray(tray_tuple(&t.key)),
                    |s, c| s.marked_trays(env, &PageRequest::new(limit).after(c)),
                );
                return;
            }
            Op::Epoch { inst } => (show(s.epoch(&instance(inst))), ok(m.epoch(inst))),
            Op::SetAlarm { inst, epoch, due } => {
                let e = m.pick_epoch(inst, epoch);
                let got = show(s.set_alarm(&instance(inst), e, due));
                let want = m.fence(inst, e).map(|()| {
                    m.epochs.insert(inst, e);
                    let (ns, id) = INSTANCES[inst];
                    m.alarms.insert((ns.to_string(), id.to_string()), due);
                    format!("{:?}", ())
                });
                (got, want)
            }
            Op::AckAlarm { inst, epoch, due } => {
                let e = m.pick_epoch(inst, epoch);
                let (ns, id) = INSTANCES[inst];
                let k = (ns.to_string(), id.to_string());
                let due = due.or_else(|| m.alarms.get(&k).copied()).unwrap_or(1_000);
                let got = show(s.ack_alarm(&instance(inst), e, due));
                let want = m.fence(inst, e).map(|()| {
                    m.epochs.insert(inst, e);
                    let hit = m.alarms.get(&k) == Some(&due);
                    if hit {
                        m.alarms.remove(&k);
                    }
                    format!("{hit:?}")
                });
                (got, want)
            }
            Op::DueAlarms {
                now: at,
                limit,
                walk,
            } => {
                self.walk(
                    Listing {
                        walk,
                        bind: Bind::Alarms,
                        limit,
                        pre: None,
                    },
                    |m, from| {
                        m.due(at)
                            .into_iter()
                            .filter(|a| match from {
                                Some(Resume::Alarm(d, ns, id)) => {
                                    (a.due_at, &a.instance.ns, &a.instance.id) > (*d, ns, id)
                                }
                                _ => true,
                            })
                            .collect()
                    },
                    |a: &Alarm| {
                        Resume::Alarm(a.due_at, a.instance.ns.clone(), a.instance.id.clone())
                    },
                    |s, c| s.due_alarms(at, &PageRequest::new(limit).after(c)),
                );
                return;
            }
            Op::PutBudget {
                tenant,
                budget,
                version,
                cost_max,
            } => {
                let k = (tenant.to_string(), budget.to_string());
                let stored = m.budgets.get(&k).cloned();
                let cur = stored.as_ref().map_or(1, |r| r.0.version);
                let mut rec = BudgetRecord::new(
                    BudgetKey::new(tenant, budget),
                    Caps {
                        cost_micros_max: cost_max,
                        ..Caps::default()
                    },
                );
                rec.version = match version {
                    VersionPick::Current => cur,
                    VersionPick::Ahead => cur + 1,
                    VersionPick::Behind => cur.saturating_sub(1),
                    VersionPick::Zero => 0,
                };
                let got = show(s.put_budget(rec.clone()));
                let want = if tenant.is_empty() {
                    invalid()
                } else {
                    match (rec.version, stored) {
                        (0, Some(old)) => Err(format!(
                            "Conflict {{ expected: 0, actual: {} }}",
                            old.0.version
                        )),
                        (0, None) => {
                            let new = BudgetRecord {
                                version: 1,
                                created_at: now,
                                updated_at: now,
                                ..rec
                            };
                            m.budgets.insert(k, (new.clone(), Spend::default()));
                            ok(new)
                        }
                        (n, None) => Err(format!("Conflict {{ expected: {n}, actual: 0 }}")),
                        (n, Some(old)) if old.0.version != n => Err(format!(
                            "Conflict {{ expected: {n}, actual: {} }}",
                            old.0.version
                        )),
                        (_, Some((old, spent))) => {
                            let new = BudgetRecord {
                                version: old.version + 1,
                                created_at: old.created_at,
                                updated_at: now,
                                ..rec
                            };
                            m.budgets.insert(k, (new.clone(), spent));
                            ok(new)
                        }
                    }
                };
                (got, want)
            }
            Op::GetBudget { tenant, budget } => {
                let got = show(s.get_budget(&BudgetKey::new(tenant, budget)));
                let want = if tenant.is_empty() {
                    invalid()
                } else {
                    ok(m.budget_status(tenant, budget))
                };
                (got, want)
            }
            Op::CreateCappedRun {
                tenant,
                run,
                cost_max,
                iterations_max,
                budget,
            } => {
                let key = RunKey::new(tenant, run);
                let mut rec = RunRecord::new(key.clone(), AGENTS[0]).with_caps(Caps {
                    cost_micros_max: cost_max,
                    tokens_max: None,
                    iterations_max,
                });
                rec.budget = budget.map(str::to_string);
                let got = show(s.put_run(rec.clone()));
                let k = (tenant.to_string(), run.to_string());
                let want = if tenant.is_empty() {
                    invalid()
                } else if let Some(old) = m.runs.get(&k) {
                    Err(format!(
                        "Conflict {{ expected: 0, actual: {} }}",
                        old.version
                    ))
                } else if let Some(b) = budget
                    && !m.budgets.contains_key(&(tenant.to_string(), b.to_string()))
                {
                    Err(format!(
                        "NotFound({})",
                        Missing::Budget(BudgetKey::new(tenant, b))
                    ))
                } else {
                    m.next_seq += 1;
                    let new = RunRecord {
                        version: 1,
                        seq: m.next_seq,
                        created_at: now,
                        updated_at: now,
                        ..rec
                    };
                    m.runs.insert(k, new.clone());
                    ok(new)
                };
                (got, want)
            }
            Op::Reserve {
                tenant,
                run,
                hold,
                cost,
                iterations,
                ttl,
            } => {
                let key = RunKey::new(tenant, run);
                let h = Hold::new(hold, ttl)
                    .cost_micros(cost)
                    .iterations(iterations);
                let got = show(s.reserve(&key, h.clone()));
                let k = (tenant.to_string(), run.to_string());
                let want = if tenant.is_empty() || hold.is_empty() || ttl == 0 {
                    invalid()
                } else {
                    match m.runs.get(&k).cloned() {
                        None => Err(format!("NotFound({})", Missing::Run(key))),
                        Some(_) if m.run_holds(tenant, run).iter().any(|x| x.id == hold) => {
                            invalid()
                        }
                        Some(r) => match m.fits(&r, h.amounts()) {
                            Err(e) => Err(e),
                            Ok(()) => {
                                let rec = HoldRecord {
                                    id: hold.to_string(),
                                    amounts: h.amounts(),
                                    created_at: now,
                                    expires_at: now + ttl,
                                };
                                m.holds.insert(
                                    (tenant.to_string(), run.to_string(), hold.to_string()),
                                    rec.clone(),
                                );
                                ok(rec)
                            }
                        },
                    }
                };
                (got, want)
            }
            Op::Settle {
                tenant,
                run,
                hold,
                cost,
                iterations,
            } => {
                let key = RunKey::new(tenant, run);
                let delta = StateDelta {
                    cost_micros: cost,
                    iterations,
                    ..Default::default()
                };
                let got = show(s.settle(&key, hold, delta));
                let k = (tenant.to_string(), run.to_string());
                let hk = (tenant.to_string(), run.to_string(), hold.to_string());
                let want = if tenant.is_empty() || hold.is_empty() {
                    invalid()
                } else {
                    match m.runs.get(&k).cloned() {
                        None => Err(format!("NotFound({})", Missing::Run(key))),
                        Some(old) => match m.holds.get(&hk).filter(|h| now < h.expires_at).cloned()
                        {
                            None => Err(format!(
                                "NotFound({})",
                                Missing::Hold {
                                    run: key,
                                    hold_id: hold.to_string()
                                }
                            )),
                            Some(h) => match (
                                old.cost_micros.checked_add(cost),
                                old.iterations.checked_add(iterations),
                            ) {
                                (Some(c), Some(i)) => {
                                    let new = RunRecord {
                                        cost_micros: c,
                                        iterations: i,
                                        version: old.version + 1,
                                        updated_at: now,
                                        ..old
                                    };
                                    m.holds.remove(&hk);
                                    m.spend_on_budget(&new, cost, iterations);
                                    m.runs.insert(k, new.clone());
                                    ok(Settled::new(
                                        new,
                                        Spend {
                                            cost_micros: cost.saturating_sub(h.amounts.cost_micros),
                                            tokens: 0,
                                            iterations: iterations
                                                .saturating_sub(h.amounts.iterations),
                                        },
                                    ))
                                }
                                _ => invalid(),
                            },
                        },
                    }
                };
                (got, want)
            }
            Op::ReleaseHold { tenant, run, hold } => {
                let key = RunKey::new(tenant, run);
                let got = show(s.release_hold(&key, hold));
                let k = (tenant.to_string(), run.to_string());
                let hk = (tenant.to_string(), run.to_string(), hold.to_string());
                let want = if tenant.is_empty() || hold.is_empty() {
                    invalid()
                } else if !m.runs.contains_key(&k) {
                    Err(format!("NotFound({})", Missing::Run(key)))
                } else if m.holds.get(&hk).is_none_or(|h| now >= h.expires_at) {
                    Err(format!(
                        "NotFound({})",
                        Missing::Hold {
                            run: key,
                            hold_id: hold.to_string()
                        }
                    ))
                } else {
                    m.holds.remove(&hk);
                    ok(())
                };
                (got, want)
            }
            Op::RunSpend { tenant, run } => {
                let got = show(s.run_spend(&RunKey::new(tenant, run)));
                let want = if tenant.is_empty() {
                    invalid()
                } else {
                    ok(m.runs
                        .get(&(tenant.to_string(), run.to_string()))
                        .map(|r| m.run_spend(r)))
                };
                (got, want)
            }
            Op::AdvanceClock { by } => {
                self.clock.advance(by);
                m.now += by;
                return;
            }
            Op::Reopen => {
                drop(self.store.take());
                let store = FileStore::open_with(self.path, self.opts.clone());
                self.store = Some(store.unwrap_or_else(|e| {
                    panic!(
                        "reopen failed: {e}\nops so far:\n  {}",
                        self.log.join("\n  ")
                    )
                }));
                return;
            }
        };
        self.check(&what, &got, &want);
    }
}

/// Runs one fuzz input: ops decoded from `data`, against a fresh file
/// store at `path` (created there, or copied from `template` — an empty
/// store made earlier, which spares the fuzzer a creation per input) and
/// the model, compared after every step.
pub fn run_at(data: &[u8], path: &Path, template: Option<&Path>) {
    run_mode(data, path, template, false)
}

/// Like [`run`], with half of the ops spend-cap ops (see `Op::read`).
pub fn run_caps_biased(data: &[u8]) {
    let dir = tempfile::tempdir().expect("temp dir");
    run_mode(data, &dir.path().join("store"), None, true);
}

fn run_mode(data: &[u8], path: &Path, template: Option<&Path>, caps_bias: bool) {
    let mut inp = Input::new(data);
    let clock = Arc::new(ManualClock::new(1_000));
    let opts = Options::new()
        .clock(clock.clone())
        .durability(Durability::Buffered);
    if let Some(t) = template {
        copy_dir(t, path).expect("copy the template store");
    }
    let store = FileStore::open_with(path, opts.clone()).expect("open a new file store");
    let mut h = Harness {
        path,
        opts,
        clock,
        store: Some(store),
        model: Model {
            now: 1_000,
            ..Model::default()
        },
        saved_cursor: None,
        log: Vec::new(),
    };
    for _ in 0..OPS_MAX {
        if inp.is_empty() {
            break;
        }
        let op = Op::read(&mut inp, caps_bias);
        h.step(op);
    }
    let report = h.store().verify().expect("verify");
    assert!(
        report.is_ok(),
        "verify found {:?}\nops:\n  {}",
        report.problems,
        h.log.join("\n  ")
    );
}

/// Makes an empty file store at `path` to copy with [`run_at`].
pub fn make_template(path: &Path) {
    let opts = Options::new().durability(Durability::Buffered);
    drop(FileStore::open_with(path, opts).expect("create the template store"));
}

fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for e in std::fs::read_dir(from)? {
        let e = e?;
        let dest = to.join(e.file_name());
        if e.file_type()?.is_dir() {
            copy_dir(&e.path(), &dest)?;
        } else {
            std::fs::copy(e.path(), dest)?;
        }
    }
    Ok(())
}

/// Runs one fuzz input in a temporary directory, creating the store.
pub fn run(data: &[u8]) {
    let dir = tempfile::tempdir().expect("temp dir");
    run_at(data, &dir.path().join("store"), None);
}
