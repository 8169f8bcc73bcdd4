//! Spend caps (rules B1–B6): caps on a run and on named tenant budgets,
//! holds reserved before a model call and settled after it.
//!
//! The pattern is **reserve → call → settle**:
//!
//! 1. [`BudgetStore::reserve`] asks for what the call may cost at most. It
//!    checks, for the run and for the named budget it draws from, that
//!    `spent + held + asked` stays within every cap, and records the hold in
//!    the same atomic step — so N workers racing for the last bit of a cap
//!    cannot all pass the check. A refusal is
//!    [`StateError::BudgetExceeded`](crate::StateError::BudgetExceeded) and
//!    changes nothing.
//! 2. The caller makes the call.
//! 3. [`BudgetStore::settle`] drops the hold and adds what was actually
//!    spent, in one step. Spend is always recorded, even past a cap (spend
//!    that happened is a fact); the overshoot over the hold is reported.
//!
//! A hold carries a time to live, read against the store's injected clock:
//! once it has passed, the hold no longer counts and the next write that
//! touches the run or its budget removes it, so a crashed worker cannot
//! lock a budget forever. [`BudgetStore::release_hold`] drops a hold with
//! no spend. Plain [`patch_run`](crate::StateStore::patch_run) keeps
//! working and counts toward `spent`; it never refuses.
//!
//! ```
//! use agentstate::{BudgetStore, Caps, Hold, MemoryStore, RunKey, RunRecord, StateDelta, StateStore, Usage};
//! let store = MemoryStore::new();
//! let run = RunRecord::new(RunKey::new("acme", "run_1"), "planner")
//!     .with_caps(Caps::new().cost_micros(1_000_000));
//! let run = store.put_run(run)?;
//! // Before the model call: hold the most it may cost.
//! store.reserve(&run.key, Hold::new("call-1", 60_000).cost_micros(400_000))?;
//! // After it: settle with what it did cost.
//! let spent = StateDelta { cost_micros: 310_000, ..Default::default() };
//! let settled = store.settle(&run.key, "call-1", spent)?;
//! assert_eq!(settled.record.cost_micros, 310_000);
//! assert!(settled.overshoot.is_zero());
//! # Ok::<(), agentstate::StateError>(())
//! ```

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::idempotency::IdempotencyKey;
use crate::page::{Page, PageRequest, Pages};
use crate::record::{Millis, RunKey, RunRecord, StateDelta};

/// Caps on spend (rule B1), each optional: `None` is no cap. Tokens count
/// input and output tokens together.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Caps {
    /// Most money, in millionths.
    pub cost_micros_max: Option<u64>,
    /// Most tokens (input plus output).
    pub tokens_max: Option<u64>,
    /// Most loop passes.
    pub iterations_max: Option<u64>,
}

impl Caps {
    /// No caps.
    pub fn new() -> Self {
        Caps::default()
    }
    /// Caps the cost, in millionths.
    pub fn cost_micros(mut self, max: u64) -> Self {
        self.cost_micros_max = Some(max);
        self
    }
    /// Caps the tokens (input plus output).
    pub fn tokens(mut self, max: u64) -> Self {
        self.tokens_max = Some(max);
        self
    }
    /// Caps the loop passes.
    pub fn iterations(mut self, max: u64) -> Self {
        self.iterations_max = Some(max);
        self
    }
    /// True when no amount is capped.
    pub fn is_none(&self) -> bool {
        self.cost_micros_max.is_none() && self.tokens_max.is_none() && self.iterations_max.is_none()
    }
    /// The cap on `amount`, if any.
    pub fn max(&self, amount: Amount) -> Option<u64> {
        match amount {
            Amount::CostMicros => self.cost_micros_max,
            Amount::Tokens => self.tokens_max,
            Amount::Iterations => self.iterations_max,
        }
    }
}

/// One capped amount.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Amount {
    /// Money, in millionths.
    CostMicros,
    /// Tokens, input plus output.
    Tokens,
    /// Loop passes.
    Iterations,
}

impl Amount {
    /// Every amount, in declaration order.
    pub const ALL: [Amount; 3] = [Amount::CostMicros, Amount::Tokens, Amount::Iterations];

    /// The name used by the CLI and in errors.
    pub fn as_str(self) -> &'static str {
        match self {
            Amount::CostMicros => "cost_micros",
            Amount::Tokens => "tokens",
            Amount::Iterations => "iterations",
        }
    }
}

/// Amounts spent or held: money, tokens, loop passes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Spend {
    /// Money, in millionths.
    pub cost_micros: u64,
    /// Tokens, input plus output.
    pub tokens: u64,
    /// Loop passes.
    pub iterations: u64,
}

impl Spend {
    /// The value of `amount`.
    pub fn get(&self, amount: Amount) -> u64 {
        match amount {
            Amount::CostMicros => self.cost_micros,
            Amount::Tokens => self.tokens,
            Amount::Iterations => self.iterations,
        }
    }
    /// True when every amount is 0.
    pub fn is_zero(&self) -> bool {
        *self == Spend::default()
    }
    /// What a delta spends: its cost, its tokens (input plus output, which
    /// saturates rather than wrap) and its loop passes.
    pub fn of_delta(d: &StateDelta) -> Spend {
        Spend {
            cost_micros: d.cost_micros,
            tokens: d.usage.input_tokens.saturating_add(d.usage.output_tokens),
            iterations: d.iterations,
        }
    }
    /// What a run has spent so far.
    pub fn of_run(r: &RunRecord) -> Spend {
        Spend {
            cost_micros: r.cost_micros,
            tokens: r.usage.input_tokens.saturating_add(r.usage.output_tokens),
            iterations: r.iterations,
        }
    }
}

/// The key of a named tenant budget (rule B1): many runs of one tenant may
/// draw from it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct BudgetKey {
    /// The owner.
    pub tenant: String,
    /// The budget's name, unique within the tenant.
    pub name: String,
}

impl BudgetKey {
    /// A key from its two parts.
    pub fn new(tenant: impl Into<String>, name: impl Into<String>) -> Self {
        BudgetKey {
            tenant: tenant.into(),
            name: name.into(),
        }
    }
}

/// A named tenant budget: its caps, versioned like a session (rule B1).
///
/// The version counts writes of the budget itself (`put_budget`); what is
/// spent against it is kept beside it ([`BudgetStatus::spent`]), so raising
/// a cap never races with the workers spending.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetRecord {
    /// Tenant and name.
    pub key: BudgetKey,
    /// The version the caller read; 0 to create.
    pub version: u64,
    /// The caps every run drawing from it shares.
    pub caps: Caps,
    /// Set by the store at create.
    pub created_at: Millis,
    /// Set by the store on every write of the budget.
    pub updated_at: Millis,
}

impl BudgetRecord {
    /// A new budget, ready to create with `put_budget`.
    pub fn new(key: BudgetKey, caps: Caps) -> Self {
        BudgetRecord {
            key,
            version: 0,
            caps,
            created_at: 0,
            updated_at: 0,
        }
    }
}

/// What a caller asks to hold before a call (rule B2): the most it may
/// cost, and how long the hold lasts if it is neither settled nor released.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hold {
    /// The hold's id, unique among the run's live holds (1..=256 bytes).
    pub id: String,
    /// Money to hold, in millionths.
    pub cost_micros: u64,
    /// Tokens to hold.
    pub tokens: u64,
    /// Loop passes to hold.
    pub iterations: u64,
    /// Milliseconds, by the store's clock, until the hold expires
    /// (1..=[`HOLD_TTL_MILLIS_MAX`](crate::limits::HOLD_TTL_MILLIS_MAX)).
    pub ttl_millis: u64,
}

impl Hold {
    /// A hold of nothing yet, for `ttl_millis`; add amounts with the
    /// builder methods.
    pub fn new(id: impl Into<String>, ttl_millis: u64) -> Self {
        Hold {
            id: id.into(),
            cost_micros: 0,
            tokens: 0,
            iterations: 0,
            ttl_millis,
        }
    }
    /// Holds money, in millionths.
    pub fn cost_micros(mut self, n: u64) -> Self {
        self.cost_micros = n;
        self
    }
    /// Holds tokens.
    pub fn tokens(mut self, n: u64) -> Self {
        self.tokens = n;
        self
    }
    /// Holds loop passes.
    pub fn iterations(mut self, n: u64) -> Self {
        self.iterations = n;
        self
    }
    /// The amounts asked for.
    pub fn amounts(&self) -> Spend {
        Spend {
            cost_micros: self.cost_micros,
            tokens: self.tokens,
            iterations: self.iterations,
        }
    }
}

/// A hold as stored: its amounts and when it expires.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HoldRecord {
    /// The hold's id.
    pub id: String,
    /// What it holds.
    pub amounts: Spend,
    /// When it was reserved, by the store's clock.
    pub created_at: Millis,
    /// When it stops counting, by the store's clock (it counts while
    /// `now < expires_at`).
    pub expires_at: Millis,
}

impl HoldRecord {
    /// True while the hold counts at `now`.
    pub fn is_live(&self, now: Millis) -> bool {
        now < self.expires_at
    }
}

/// Where a cap lives. In JSON: `{"run": {...}}` or `{"budget": {...}}`.
/// More scopes may come, so a `match` on it needs a wildcard arm.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum CapScope {
    /// The run's own caps.
    Run(RunKey),
    /// The named budget the run draws from.
    Budget(BudgetKey),
}

/// Which cap refused a reserve: where it lives, which amount, and its
/// value. Part of a report ([`StateError::BudgetExceeded`](crate::StateError::BudgetExceeded)),
/// so it may gain fields: a backend makes one with [`CapLimit::new`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub struct CapLimit {
    /// The run's caps, or its budget's.
    pub scope: CapScope,
    /// The capped amount.
    pub amount: Amount,
    /// The cap.
    pub max: u64,
}

impl CapLimit {
    /// The cap on `amount` in `scope`, `max`.
    pub fn new(scope: CapScope, amount: Amount, max: u64) -> Self {
        CapLimit { scope, amount, max }
    }
}

/// `budget acme/monthly cost_micros cap 5000000`.
impl std::fmt::Display for CapLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} cap {}", self.scope, self.amount, self.max)
    }
}

/// `run acme/run_1` or `budget acme/monthly`.
impl std::fmt::Display for CapScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CapScope::Run(k) => write!(f, "run {k}"),
            CapScope::Budget(k) => write!(f, "budget {k}"),
        }
    }
}

/// The amount's name as the CLI prints it (`cost_micros`, `tokens`,
/// `iterations`); width and alignment apply.
impl std::fmt::Display for Amount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

/// What [`BudgetStore::settle`] did. A report that may gain fields: a
/// backend makes one with [`Settled::new`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Settled {
    /// The run after the spend was added (one version later).
    pub record: RunRecord,
    /// How much the actual spend exceeded the hold, per amount (0 where it
    /// stayed within): the estimate was that much too low. An amount the
    /// hold did not ask for (say, iterations held at 0) is overshot by all
    /// of it.
    pub overshoot: Spend,
}

/// A budget with what is spent against it and what is held. A report that
/// may gain fields: a backend makes one with [`BudgetStatus::new`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct BudgetStatus {
    /// The budget.
    pub record: BudgetRecord,
    /// Spent by every run drawing from it (settles and patches).
    pub spent: Spend,
    /// Held by live holds of those runs, at the store's clock now.
    pub held: Spend,
    /// How many live holds.
    pub holds: u64,
}

/// A run's caps with what it has spent and what it holds. A report that
/// may gain fields: a backend makes one with [`RunSpend::new`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct RunSpend {
    /// The run.
    pub key: RunKey,
    /// Its own caps.
    pub caps: Caps,
    /// The budget it draws from, if any.
    pub budget: Option<String>,
    /// What it has spent (its cost, tokens and iterations).
    pub spent: Spend,
    /// What its live holds hold, at the store's clock now.
    pub held: Spend,
    /// Its live holds, in id order.
    pub holds: Vec<HoldRecord>,
}

impl Settled {
    /// The run after the settle, and the overshoot over the hold.
    pub fn new(record: RunRecord, overshoot: Spend) -> Self {
        Settled { record, overshoot }
    }
}

impl BudgetStatus {
    /// A budget, what is spent against it, what its live holds hold, and
    /// how many they are.
    pub fn new(record: BudgetRecord, spent: Spend, held: Spend, holds: u64) -> Self {
        BudgetStatus {
            record,
            spent,
            held,
            holds,
        }
    }
}

impl RunSpend {
    /// A run's key, caps and budget, what it spent, what its live holds
    /// hold, and those holds (in id order).
    pub fn new(
        key: RunKey,
        caps: Caps,
        budget: Option<String>,
        spent: Spend,
        held: Spend,
        holds: Vec<HoldRecord>,
    ) -> Self {
        RunSpend {
            key,
            caps,
            budget,
            spent,
            held,
            holds,
        }
    }
}

/// Spend caps on runs and named budgets (rules B1–B6).
///
/// A run's caps and budget are fields of its [`RunRecord`] (`caps`,
/// `budget`), fixed at create; the budget must exist then (`NotFound`
/// otherwise). Every call here is one atomic step.
pub trait BudgetStore: Send + Sync {
    /// Creates (`version == 0`) or updates (`version == n`) a named budget;
    /// versioned like a session (R2). Spend against it is kept; only its
    /// caps change. Returns the stored record.
    fn put_budget(&self, record: BudgetRecord) -> Result<BudgetRecord>;
    /// Reads a budget with its spent and held amounts.
    fn get_budget(&self, key: &BudgetKey) -> Result<Option<BudgetStatus>>;
    /// One page of a tenant's budgets, in name order (the L rules).
    fn list_budgets(&self, tenant: &str, page: &PageRequest) -> Result<Page<BudgetStatus>>;
    /// Reserves `hold` against the run and its budget (B2): succeeds only
    /// when `spent + held + asked` stays within every cap of both, and
    /// records the hold atomically with the check. Otherwise
    /// `BudgetExceeded` naming the first cap that refused, and nothing
    /// changes. A hold id the run already holds is `Invalid`.
    fn reserve(&self, run: &RunKey, hold: Hold) -> Result<HoldRecord>;
    /// Drops the hold and adds `spent` to the run (and its budget) in one
    /// step (B3); the spend is recorded even past a cap. An unknown,
    /// settled, released or expired hold is `NotFound` and changes nothing
    /// (record such spend with `patch_run`).
    fn settle(&self, run: &RunKey, hold_id: &str, spent: StateDelta) -> Result<Settled>;
    /// Drops a hold with no spend (B4); `NotFound` like `settle`.
    fn release_hold(&self, run: &RunKey, hold_id: &str) -> Result<()>;
    /// [`reserve`](Self::reserve) under an idempotency key (rules I1–I3):
    /// a repeat answers the first call's hold (or its `BudgetExceeded`)
    /// and reserves nothing again.
    fn reserve_idempotent(
        &self,
        run: &RunKey,
        hold: Hold,
        key: &IdempotencyKey,
    ) -> Result<HoldRecord>;
    /// [`settle`](Self::settle) under an idempotency key (rules I1–I3): a
    /// repeat answers the first call's [`Settled`], not `NotFound` for the
    /// hold it settled, and adds nothing again.
    fn settle_idempotent(
        &self,
        run: &RunKey,
        hold_id: &str,
        spent: StateDelta,
        key: &IdempotencyKey,
    ) -> Result<Settled>;
    /// [`release_hold`](Self::release_hold) under an idempotency key: a
    /// repeat answers the first call's outcome.
    fn release_hold_idempotent(
        &self,
        run: &RunKey,
        hold_id: &str,
        key: &IdempotencyKey,
    ) -> Result<()>;
    /// A run's caps, spent and live holds; `None` when the run is missing.
    fn run_spend(&self, run: &RunKey) -> Result<Option<RunSpend>>;

    /// Every budget of a tenant, page after page.
    fn iter_budgets<'a>(&'a self, tenant: &'a str) -> Pages<'a, BudgetStatus> {
        Pages::new(move |req| self.list_budgets(tenant, req))
    }
}

/// `tenant/name`.
impl std::fmt::Display for BudgetKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.tenant, self.name)
    }
}
