//! B — spend caps: caps fixed at create, reserves checked atomically,
//! settles that record what was spent, releases, expiry by the injected
//! clock, and caps that hold under concurrency (B1–B6).

use std::collections::BTreeMap;
use std::sync::Barrier;
use std::sync::atomic::{AtomicU64, Ordering};

use super::Factory;
use super::helpers::*;
use agentstate_core::{
    Amount, BudgetKey, BudgetRecord, CapScope, Caps, Entry, Hold, RecordKey, RunKey, RunRecord,
    Spend, StateDelta, StateError, Usage,
};

/// Creates a budget and returns it.
#[track_caller]
fn budget(s: &dyn super::ConformanceStore, k: &BudgetKey, caps: Caps) -> BudgetRecord {
    ok(
        s.put_budget(BudgetRecord::new(k.clone(), caps)),
        format_args!("creating budget {k:?}"),
    )
}

fn cost(n: u64) -> StateDelta {
    StateDelta {
        cost_micros: n,
        ..Default::default()
    }
}

/// The (spent, held) a store reports for a run.
#[track_caller]
fn run_amounts(s: &dyn super::ConformanceStore, k: &RunKey) -> (Spend, Spend, usize) {
    let sp = ok(s.run_spend(k), format_args!("run_spend {k:?}"))
        .unwrap_or_else(|| panic!("run_spend {k:?}: the run exists"));
    (sp.spent, sp.held, sp.holds.len())
}

/// The (spent, held, live holds) a store reports for a budget.
#[track_caller]
fn budget_amounts(s: &dyn super::ConformanceStore, k: &BudgetKey) -> (Spend, Spend, u64) {
    let b = ok(s.get_budget(k), format_args!("get_budget {k:?}"))
        .unwrap_or_else(|| panic!("get_budget {k:?}: the budget exists"));
    (b.spent, b.held, b.holds)
}

/// The hold entries an export holds for one tenant, as (run id, hold id).
fn exported_holds(s: &dyn super::ConformanceStore, tenant: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for e in s.iter_export() {
        if let Entry::Hold { run, hold } = ok(e, "B: export")
            && run.tenant == tenant
        {
            out.push((run.run_id, hold.id));
        }
    }
    out.sort();
    out
}

/// B1: a run carries caps and a named budget fixed at create; the budget
/// must exist then, and is versioned like a session.
pub fn b1_caps_and_budget_fixed_at_create(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("b1");
    let bk = BudgetKey::new(&t, "monthly");

    // Versioned like a session (S1): create at 1, update at n + 1, stale
    // versions conflict.
    let b = budget(s, &bk, Caps::new().cost_micros(1_000));
    assert_eq!(b.version, 1, "B1: a budget is created at version 1");
    assert_eq!(
        b.created_at,
        super::helpers::T0,
        "B1: created_at from the clock"
    );
    expect_err!(
        s.put_budget(BudgetRecord::new(bk.clone(), Caps::new())),
        StateError::Conflict {
            ref record,
            expected: 0,
            actual: 1,
        } if *record == RecordKey::Budget(bk.clone()),
        "B1: creating an existing budget"
    );
    let mut up = b.clone();
    up.caps = Caps::new().cost_micros(2_000).tokens(500);
    let up = ok(s.put_budget(up), "B1: updating a budget");
    assert_eq!(up.version, 2, "B1: an update commits at n + 1");
    expect_err!(
        s.put_budget(b.clone()),
        StateError::Conflict {
            ref record,
            expected: 1,
            actual: 2,
        } if *record == RecordKey::Budget(bk.clone()),
        "B1: a stale budget update"
    );
    let got = ok(s.get_budget(&bk), "B1: get_budget").expect("B1: the budget exists");
    assert_eq!(got.record, up, "B1: get_budget reads what was stored");
    assert!(
        got.spent.is_zero() && got.held.is_zero(),
        "B1: a new budget has spent and held nothing"
    );
    assert!(
        ok(s.get_budget(&BudgetKey::new(&t, "other")), "B1: get_budget").is_none(),
        "B1: a missing budget reads as None"
    );

    // A run names an existing budget at create.
    let missing = BudgetKey::new(&t, "nope");
    let rk = RunKey::new(&t, "r-missing");
    expect_err!(
        s.put_run(RunRecord::new(rk.clone(), "a").with_budget("nope")),
        StateError::NotFound(RecordKey::Budget(ref k)) if *k == missing,
        "B1: a run naming a missing budget"
    );
    assert!(get(s, &rk).is_none(), "B1: the refused run was not created");

    // Caps and budget are stored, read back, and fixed.
    let caps = Caps::new().cost_micros(500).tokens(100).iterations(3);
    let rk = RunKey::new(&t, "r1");
    let r = create(
        s,
        RunRecord::new(rk.clone(), "a")
            .with_caps(caps)
            .with_budget("monthly"),
    );
    assert_eq!(
        (r.caps, r.budget.as_deref()),
        (caps, Some("monthly")),
        "B1: put_run returns the caps and budget"
    );
    let back = must_get(s, &rk);
    assert_eq!(
        (back.caps, back.budget.as_deref()),
        (caps, Some("monthly")),
        "B1: get_run reads the caps and budget"
    );
    let mut moved = back.clone();
    moved.caps = Caps::new().cost_micros(10_000);
    let e = expect_err!(
        s.put_run(moved),
        StateError::Invalid { .. },
        "B1: put_run moving the caps"
    );
    assert_names(&e, &["caps"], "B1: moving the caps");
    let mut moved = back.clone();
    moved.budget = None;
    let e = expect_err!(
        s.put_run(moved),
        StateError::Invalid { .. },
        "B1: put_run dropping the budget"
    );
    assert_names(&e, &["budget"], "B1: dropping the budget");
    assert_eq!(must_get(s, &rk), back, "B1: refused puts changed nothing");
    // An ordinary update keeps them.
    let mut next = back.clone();
    next.state = agentstate_core::RunState::Running;
    let next = ok(s.put_run(next), "B1: updating a capped run");
    assert_eq!(
        (next.caps, next.budget.as_deref()),
        (caps, Some("monthly")),
        "B1: an update keeps the caps and budget"
    );
    let sp = ok(s.run_spend(&rk), "B1: run_spend").expect("B1: run_spend of an existing run");
    assert_eq!(
        (sp.caps, sp.budget.as_deref()),
        (caps, Some("monthly")),
        "B1: run_spend reports the caps and budget"
    );
    assert!(
        ok(s.run_spend(&RunKey::new(&t, "ghost")), "B1: run_spend").is_none(),
        "B1: run_spend of a missing run is None"
    );
    // The budget's listing names it.
    let listed: Vec<String> = s
        .iter_budgets(&t)
        .map(|b| ok(b, "B1: list_budgets").record.key.name)
        .collect();
    assert_eq!(
        listed,
        ["monthly"],
        "B1: list_budgets lists the tenant's budgets"
    );
}

/// B2: a reserve fits within every cap of the run and of its budget and
/// records the hold atomically with the check; otherwise `BudgetExceeded`
/// with the facts, and nothing changes.
pub fn b2_reserve_within_every_cap_or_changes_nothing(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("b2");
    let bk = BudgetKey::new(&t, "shared");
    budget(s, &bk, Caps::new().cost_micros(150));
    let a = RunKey::new(&t, "a");
    let b = RunKey::new(&t, "b");
    create(
        s,
        RunRecord::new(a.clone(), "x")
            .with_caps(Caps::new().cost_micros(100).tokens(50).iterations(2))
            .with_budget("shared"),
    );
    create(s, RunRecord::new(b.clone(), "x").with_budget("shared"));

    let h = ok(
        s.reserve(&a, Hold::new("h1", 60_000).cost_micros(60).tokens(10)),
        "B2: a reserve that fits",
    );
    assert_eq!(
        (h.id.as_str(), h.amounts.cost_micros, h.amounts.tokens),
        ("h1", 60, 10),
        "B2: reserve returns the hold"
    );
    assert_eq!(
        (h.created_at, h.expires_at),
        (super::helpers::T0, super::helpers::T0 + 60_000),
        "B2: a hold expires ttl after the store's clock"
    );
    let before = (must_get(s, &a), run_amounts(s, &a), budget_amounts(s, &bk));
    assert_eq!(
        before.0.version, 1,
        "B2: a reserve does not write the run record"
    );
    let e = expect_err!(
        s.reserve(&a, Hold::new("h2", 60_000).cost_micros(41)),
        StateError::BudgetExceeded { .. },
        "B2: a reserve past the run's cost cap"
    );
    let StateError::BudgetExceeded {
        limit,
        spent,
        held,
        asked,
    } = &e
    else {
        unreachable!()
    };
    assert_eq!(
        (&limit.scope, limit.amount, limit.max, *spent, *held, *asked),
        (
            &CapScope::Run(a.clone()),
            Amount::CostMicros,
            100,
            0,
            60,
            41
        ),
        "B2: BudgetExceeded names the cap and carries spent, held and asked"
    );
    assert!(
        !e.is_retryable(),
        "B2: BudgetExceeded is not retryable as is"
    );
    assert_eq!(
        (must_get(s, &a), run_amounts(s, &a), budget_amounts(s, &bk)),
        before,
        "B2: a refused reserve changes nothing"
    );
    // Tokens and iterations are capped too.
    let e = expect_err!(
        s.reserve(&a, Hold::new("h2", 60_000).tokens(41)),
        StateError::BudgetExceeded { .. },
        "B2: a reserve past the run's token cap"
    );
    assert!(
        matches!(&e, StateError::BudgetExceeded { limit, spent: 0, held: 10, asked: 41 } if limit.amount == Amount::Tokens && limit.max == 50),
        "B2: the token cap refused: {e:?}"
    );
    let e = expect_err!(
        s.reserve(&a, Hold::new("h2", 60_000).iterations(3)),
        StateError::BudgetExceeded { .. },
        "B2: a reserve past the run's iteration cap"
    );
    assert!(
        matches!(&e, StateError::BudgetExceeded { limit, .. } if limit.amount == Amount::Iterations),
        "B2: the iteration cap refused: {e:?}"
    );
    // Exactly at the cap fits.
    ok(
        s.reserve(&a, Hold::new("h2", 60_000).cost_micros(40)),
        "B2: a reserve reaching the cap exactly",
    );
    assert_eq!(
        run_amounts(s, &a).1.cost_micros,
        100,
        "B2: both holds count"
    );

    // The budget is shared: b has no caps of its own, but a holds 100 of
    // the budget's 150.
    let e = expect_err!(
        s.reserve(&b, Hold::new("h1", 60_000).cost_micros(51)),
        StateError::BudgetExceeded { .. },
        "B2: a reserve past the shared budget"
    );
    assert!(
        matches!(&e, StateError::BudgetExceeded { limit, spent: 0, held: 100, asked: 51 } if limit.scope == CapScope::Budget(bk.clone()) && limit.max == 150),
        "B2: the budget's cap refused with its facts: {e:?}"
    );
    ok(
        s.reserve(&b, Hold::new("h1", 60_000).cost_micros(50)),
        "B2: a reserve that fits the budget",
    );
    let (_, held, holds) = budget_amounts(s, &bk);
    assert_eq!(
        (held.cost_micros, holds),
        (150, 3),
        "B2: the budget counts every run's holds"
    );

    // Bad input: a hold id already held, a ttl of 0, a missing run.
    let e = expect_err!(
        s.reserve(&b, Hold::new("h1", 60_000)),
        StateError::Invalid { .. },
        "B2: a hold id the run already holds"
    );
    assert_names(&e, &["hold"], "B2: a duplicate hold id");
    let e = expect_err!(
        s.reserve(&b, Hold::new("h9", 0)),
        StateError::Invalid { .. },
        "B2: a ttl of 0"
    );
    assert_names(&e, &["ttl"], "B2: a ttl of 0");
    let ghost = RunKey::new(&t, "ghost");
    expect_err!(
        s.reserve(&ghost, Hold::new("h1", 1_000)),
        StateError::NotFound(RecordKey::Run(ref k)) if *k == ghost,
        "B2: a reserve on a missing run"
    );
    // A run without caps or budget takes any hold.
    let free = RunKey::new(&t, "free");
    create(s, RunRecord::new(free.clone(), "x"));
    ok(
        s.reserve(&free, Hold::new("h", 1_000).cost_micros(u64::MAX)),
        "B2: an uncapped run",
    );
}

/// B3: settle drops the hold and adds the actual amounts in one step;
/// spend past a cap is recorded and the overshoot reported; `patch_run`
/// counts toward spent.
pub fn b3_settle_records_actual_spend_and_overshoot(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("b3");
    let bk = BudgetKey::new(&t, "pool");
    budget(s, &bk, Caps::new().cost_micros(1_000));
    let rk = RunKey::new(&t, "r");
    create(
        s,
        RunRecord::new(rk.clone(), "x")
            .with_caps(Caps::new().cost_micros(100))
            .with_budget("pool"),
    );
    ok(
        s.reserve(&rk, Hold::new("h1", 60_000).cost_micros(50).tokens(20)),
        "B3: reserve",
    );
    let spent = StateDelta {
        usage: Usage {
            input_tokens: 15,
            output_tokens: 10,
        },
        cost_micros: 40,
        iterations: 1,
        messages_read: 2,
    };
    let st = ok(s.settle(&rk, "h1", spent), "B3: settle");
    assert_eq!(
        (
            st.record.version,
            st.record.cost_micros,
            st.record.iterations,
            st.record.messages_read
        ),
        (2, 40, 1, 2),
        "B3: settle adds the actual amounts to the run, one version later"
    );
    assert_eq!(
        st.overshoot,
        Spend {
            cost_micros: 0,
            tokens: 5,
            iterations: 1
        },
        "B3: the overshoot is what went past the hold, per amount"
    );
    assert_eq!(
        must_get(s, &rk),
        st.record,
        "B3: settle returns the stored run"
    );
    let (rs, rh, n) = run_amounts(s, &rk);
    assert_eq!(
        (rs.cost_micros, rs.tokens, rh, n),
        (40, 25, Spend::default(), 0),
        "B3: the hold is gone and the spend is counted"
    );
    let (bs, bh, _) = budget_amounts(s, &bk);
    assert_eq!(
        (bs.cost_micros, bs.tokens, bs.iterations, bh),
        (40, 25, 1, Spend::default()),
        "B3: the budget counts the run's spend and not its settled hold"
    );

    // Spend past the cap is a fact: recorded, and the overshoot reported.
    ok(
        s.reserve(&rk, Hold::new("h2", 60_000).cost_micros(60)),
        "B3: reserve to the cap",
    );
    let st = ok(s.settle(&rk, "h2", cost(200)), "B3: settle past the cap");
    assert_eq!(
        (st.record.cost_micros, st.overshoot.cost_micros),
        (240, 140),
        "B3: spend past the cap is recorded, with its overshoot"
    );
    let e = expect_err!(
        s.reserve(&rk, Hold::new("h3", 60_000).cost_micros(1)),
        StateError::BudgetExceeded { .. },
        "B3: a run past its cap"
    );
    assert!(
        matches!(
            e,
            StateError::BudgetExceeded {
                spent: 240,
                held: 0,
                asked: 1,
                ..
            }
        ),
        "B3: the refusal reports the recorded spend: {e:?}"
    );

    // A plain patch counts toward spent (the run's and the budget's) and
    // never refuses, even past the caps.
    let p = ok(s.patch_run(&rk, cost(900)), "B3: patch_run past the caps");
    assert_eq!(p.cost_micros, 1_140, "B3: patch_run adds as ever");
    assert_eq!(
        budget_amounts(s, &bk).0.cost_micros,
        1_140,
        "B3: patch_run counts toward the budget's spent"
    );
    let other = RunKey::new(&t, "other");
    create(s, RunRecord::new(other.clone(), "x").with_budget("pool"));
    let e = expect_err!(
        s.reserve(&other, Hold::new("h", 60_000).cost_micros(1)),
        StateError::BudgetExceeded { .. },
        "B3: another run of a spent budget"
    );
    assert!(
        matches!(&e, StateError::BudgetExceeded { limit, spent: 1_140, .. } if limit.scope == CapScope::Budget(bk.clone())),
        "B3: the budget refuses with its spend: {e:?}"
    );
    // Raising the budget's cap keeps what was spent.
    let mut b = ok(s.get_budget(&bk), "B3: get_budget")
        .expect("exists")
        .record;
    b.caps = Caps::new().cost_micros(5_000);
    ok(s.put_budget(b), "B3: raising the cap");
    assert_eq!(
        budget_amounts(s, &bk).0.cost_micros,
        1_140,
        "B3: put_budget keeps the spend"
    );
    ok(
        s.reserve(&other, Hold::new("h", 60_000).cost_micros(1)),
        "B3: a reserve under the raised cap",
    );
}

/// B4: release drops a hold with no spend; settling or releasing an
/// unknown or finished hold is `NotFound` and changes nothing.
pub fn b4_release_and_unknown_holds(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("b4");
    let rk = RunKey::new(&t, "r");
    create(
        s,
        RunRecord::new(rk.clone(), "x").with_caps(Caps::new().cost_micros(100)),
    );
    ok(
        s.reserve(&rk, Hold::new("h1", 60_000).cost_micros(100)),
        "B4: reserve",
    );
    ok(s.release_hold(&rk, "h1"), "B4: release");
    let r = must_get(s, &rk);
    assert_eq!(
        (r.version, r.cost_micros),
        (1, 0),
        "B4: a release spends nothing and does not write the run"
    );
    assert_eq!(
        run_amounts(s, &rk).1,
        Spend::default(),
        "B4: the hold is gone"
    );
    ok(
        s.reserve(&rk, Hold::new("h2", 60_000).cost_micros(100)),
        "B4: the released amount is free again",
    );
    ok(s.settle(&rk, "h2", cost(10)), "B4: settle");
    let before = (must_get(s, &rk), run_amounts(s, &rk));
    let gone = |id: &str| RecordKey::Hold {
        run: rk.clone(),
        hold_id: id.to_string(),
    };
    for id in ["h1", "h2", "never"] {
        expect_err!(
            s.release_hold(&rk, id),
            StateError::NotFound(ref m) if *m == gone(id),
            "B4: releasing hold {id} (released, settled or unknown)"
        );
        expect_err!(
            s.settle(&rk, id, cost(5)),
            StateError::NotFound(ref m) if *m == gone(id),
            "B4: settling hold {id} (released, settled or unknown)"
        );
    }
    assert_eq!(
        (must_get(s, &rk), run_amounts(s, &rk)),
        before,
        "B4: refused settles and releases changed nothing"
    );
    let ghost = RunKey::new(&t, "ghost");
    expect_err!(
        s.settle(&ghost, "h", cost(1)),
        StateError::NotFound(RecordKey::Run(ref k)) if *k == ghost,
        "B4: settling on a missing run"
    );
    expect_err!(
        s.release_hold(&ghost, "h"),
        StateError::NotFound(RecordKey::Run(ref k)) if *k == ghost,
        "B4: releasing on a missing run"
    );
}

/// B5: a hold expires after its ttl by the store's clock: it stops
/// counting at once and the next write touching the budget removes it.
pub fn b5_expired_holds_free_their_amount(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let t = unique("b5");
    let bk = BudgetKey::new(&t, "pool");
    budget(s, &bk, Caps::new().cost_micros(100));
    let a = RunKey::new(&t, "a");
    let b = RunKey::new(&t, "b");
    for k in [&a, &b] {
        create(
            s,
            RunRecord::new(k.clone(), "x")
                .with_caps(Caps::new().cost_micros(100))
                .with_budget("pool"),
        );
    }
    ok(
        s.reserve(&a, Hold::new("h1", 1_000).cost_micros(100)),
        "B5: a hold of the whole budget",
    );
    expect_err!(
        s.reserve(&b, Hold::new("h1", 1_000).cost_micros(1)),
        StateError::BudgetExceeded { .. },
        "B5: the budget is held"
    );
    c.clock.advance(999);
    assert_eq!(
        budget_amounts(s, &bk).1.cost_micros,
        100,
        "B5: a hold counts until its ttl has passed"
    );
    expect_err!(
        s.reserve(&b, Hold::new("h1", 1_000).cost_micros(1)),
        StateError::BudgetExceeded { .. },
        "B5: one millisecond before expiry the budget is still held"
    );
    c.clock.advance(1);
    // At once: reads no longer count it, before any write.
    assert_eq!(
        (budget_amounts(s, &bk).1, run_amounts(s, &a).1),
        (Spend::default(), Spend::default()),
        "B5: an expired hold stops counting at once"
    );
    // A refused call leaves it in place (it changes nothing), but it
    // counts for nothing either.
    expect_err!(
        s.reserve(&b, Hold::new("h1", 1_000).cost_micros(101)),
        StateError::BudgetExceeded { held: 0, .. },
        "B5: a refusal counts no expired hold"
    );
    // The next write touching the budget (another run's reserve) removes it.
    ok(
        s.reserve(&b, Hold::new("h1", 1_000).cost_micros(100)),
        "B5: the expired amount is free",
    );
    assert_eq!(
        exported_holds(s, &t),
        [("b".to_string(), "h1".to_string())],
        "B5: the write that touched the budget removed the expired hold"
    );
    // An expired hold cannot be settled or released.
    expect_err!(
        s.settle(&a, "h1", cost(1)),
        StateError::NotFound(RecordKey::Hold { .. }),
        "B5: settling an expired hold"
    );
    c.clock.advance(1_000);
    expect_err!(
        s.release_hold(&b, "h1"),
        StateError::NotFound(RecordKey::Hold { .. }),
        "B5: releasing an expired hold"
    );
    // A patch touches the budget too.
    ok(s.patch_run(&a, cost(1)), "B5: patch");
    assert!(
        exported_holds(s, &t).is_empty(),
        "B5: the patch removed the expired hold: {:?}",
        exported_holds(s, &t)
    );
}

/// What one call of the B6 workers did, with its ticks on a shared
/// counter taken just before the call and just after it returned.
#[derive(Debug, Clone)]
struct Call {
    run: usize,
    /// The hold (for a reserve) or the spend (for a settle).
    amounts: Spend,
    inv: u64,
    ret: u64,
}

#[derive(Debug, Clone)]
struct Refusal {
    run: usize,
    scope: CapScope,
    amount: Amount,
    spent: u64,
    held: u64,
    asked: u64,
    inv: u64,
    ret: u64,
}

/// A hold's life: its reserve, and its settle or release (if any).
#[derive(Debug, Clone)]
struct Life {
    reserved: Call,
    ended: Option<(u64, u64)>,
}

/// B6: under concurrency the caps hold. 16 threads reserve and settle in a
/// loop (each settle at most its hold) against one run cap and one shared
/// tenant budget; settled spend never passes a cap, the sum is exact, and
/// every refusal is justified by the committed state at its moment (the
/// spent and held it reports are within what the history allows then).
pub fn b6_caps_hold_under_concurrency(make: Factory<'_>) {
    const THREADS: usize = 16;
    const RUN_CAP: u64 = 12_000;
    const BUDGET_TOKENS: u64 = 15_000;
    let c = open(make);
    let s = &*c.store;
    let t = unique("b6");
    let bk = BudgetKey::new(&t, "shared");
    budget(s, &bk, Caps::new().tokens(BUDGET_TOKENS));
    // Threads 0..8 work on run 0, capped on cost; 8..16 on run 1, which
    // has no caps of its own and spends the budget's tokens. Both spend
    // cost against the budget. Run 0 asks for no tokens, so whichever way
    // the threads are scheduled it meets its own cap (and never the
    // budget's), and run 1 meets the budget's: both caps are raced.
    let runs = [RunKey::new(&t, "capped"), RunKey::new(&t, "open")];
    create(
        s,
        RunRecord::new(runs[0].clone(), "x")
            .with_caps(Caps::new().cost_micros(RUN_CAP))
            .with_budget("shared"),
    );
    create(
        s,
        RunRecord::new(runs[1].clone(), "x").with_budget("shared"),
    );
    let per_thread = rounds(60);
    let tick = AtomicU64::new(0);
    let barrier = Barrier::new(THREADS);
    type Out = (Vec<Life>, Vec<Call>, Vec<Refusal>);
    let outs: Vec<Out> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..THREADS)
            .map(|th| {
                let (runs, tick, barrier) = (&runs, &tick, &barrier);
                sc.spawn(move || {
                    let run = th / (THREADS / 2);
                    let key = &runs[run];
                    let mut rng = 0x9e37_79b9_7f4a_7c15u64
                        ^ (th as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                    let mut next = move || {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        rng
                    };
                    let (mut lives, mut settles, mut refusals) =
                        (Vec::new(), Vec::new(), Vec::new());
                    barrier.wait();
                    for i in 0..per_thread {
                        let ask = if run == 0 {
                            Spend {
                                cost_micros: 100 + next() % 500,
                                tokens: 0,
                                iterations: 1,
                            }
                        } else {
                            Spend {
                                cost_micros: 10 + next() % 50,
                                tokens: 50 + next() % 300,
                                iterations: 1,
                            }
                        };
                        let id = format!("t{th}-{i}");
                        let hold = Hold::new(&id, 3_600_000)
                            .cost_micros(ask.cost_micros)
                            .tokens(ask.tokens)
                            .iterations(1);
                        let inv = tick.fetch_add(1, Ordering::SeqCst);
                        let r = s.reserve(key, hold);
                        let ret = tick.fetch_add(1, Ordering::SeqCst);
                        match r {
                            Ok(_) => {}
                            Err(StateError::BudgetExceeded {
                                limit,
                                spent,
                                held,
                                asked,
                            }) => {
                                refusals.push(Refusal {
                                    run,
                                    scope: limit.scope,
                                    amount: limit.amount,
                                    spent,
                                    held,
                                    asked,
                                    inv,
                                    ret,
                                });
                                continue;
                            }
                            Err(e) => panic!("B6: reserve {id}: {e:?}"),
                        }
                        let reserved = Call {
                            run,
                            amounts: ask,
                            inv,
                            ret,
                        };
                        // One in four calls is abandoned (released); the
                        // others spend at most what they held.
                        let release = next() % 4 == 0;
                        let actual = Spend {
                            cost_micros: ask.cost_micros / 2 + next() % (ask.cost_micros / 2 + 1),
                            tokens: next() % (ask.tokens + 1),
                            iterations: 1,
                        };
                        let inv = tick.fetch_add(1, Ordering::SeqCst);
                        let r = if release {
                            s.release_hold(key, &id).map(|_| None)
                        } else {
                            let d = StateDelta {
                                usage: Usage {
                                    input_tokens: actual.tokens,
                                    output_tokens: 0,
                                },
                                cost_micros: actual.cost_micros,
                                iterations: 1,
                                messages_read: 0,
                            };
                            s.settle(key, &id, d).map(Some)
                        };
                        let ret = tick.fetch_add(1, Ordering::SeqCst);
                        match r {
                            Ok(None) => {}
                            Ok(Some(st)) => {
                                assert!(
                                    st.overshoot.is_zero(),
                                    "B6: a settle within its hold reports no overshoot"
                                );
                                if run == 0 {
                                    assert!(
                                        st.record.cost_micros <= RUN_CAP,
                                        "B6: run spend {} passed its cap {RUN_CAP}",
                                        st.record.cost_micros
                                    );
                                }
                                settles.push(Call {
                                    run,
                                    amounts: actual,
                                    inv,
                                    ret,
                                });
                            }
                            Err(e) => panic!("B6: settling {id}: {e:?}"),
                        }
                        lives.push(Life {
                            reserved,
                            ended: Some((inv, ret)),
                        });
                    }
                    (lives, settles, refusals)
                })
            })
            .collect();
        hs.into_iter().map(|h| join(h.join())).collect()
    });
    let mut lives = Vec::new();
    let mut settles = Vec::new();
    let mut refusals = Vec::new();
    for (l, st, r) in outs {
        lives.extend(l);
        settles.extend(st);
        refusals.extend(r);
    }
    // The caps held, and the sums are exact.
    let total = |run: Option<usize>, a: Amount| -> u64 {
        settles
            .iter()
            .filter(|c| run.is_none_or(|r| r == c.run))
            .map(|c| c.amounts.get(a))
            .sum()
    };
    let (r0, h0, n0) = run_amounts(s, &runs[0]);
    let (r1, _, _) = run_amounts(s, &runs[1]);
    let (bs, bh, bn) = budget_amounts(s, &bk);
    assert_eq!(
        (h0, n0, bh, bn),
        (Spend::default(), 0, Spend::default(), 0),
        "B6: every hold was settled or released"
    );
    assert_eq!(
        (r0.cost_micros, r1.cost_micros, bs.cost_micros, bs.tokens),
        (
            total(Some(0), Amount::CostMicros),
            total(Some(1), Amount::CostMicros),
            total(None, Amount::CostMicros),
            total(None, Amount::Tokens)
        ),
        "B6: spent is exactly the sum of the settles"
    );
    assert!(
        r0.cost_micros <= RUN_CAP && bs.tokens <= BUDGET_TOKENS,
        "B6: settled spend passed a cap: run {} / {RUN_CAP}, budget tokens {} / {BUDGET_TOKENS}",
        r0.cost_micros,
        bs.tokens
    );
    assert!(
        !refusals.is_empty() && !settles.is_empty(),
        "B6: the run must both settle and reach its caps ({} settles, {} refusals)",
        settles.len(),
        refusals.len()
    );

    // Every refusal is justified by a state the history allows at its
    // moment (some point between its two ticks): the spent it reports lies
    // between the settles surely committed before it and those that may
    // have been, likewise the held, and spent + held + asked passes the cap.
    let mut by_scope: BTreeMap<&str, usize> = BTreeMap::new();
    for rf in &refusals {
        let (in_scope, max): (Box<dyn Fn(usize) -> bool>, u64) = match &rf.scope {
            CapScope::Run(k) => {
                assert_eq!(k, &runs[rf.run], "B6: a run cap names the run: {rf:?}");
                assert_eq!(
                    rf.amount,
                    Amount::CostMicros,
                    "B6: only cost is capped on the run"
                );
                let r = rf.run;
                (Box::new(move |x| x == r), RUN_CAP)
            }
            CapScope::Budget(k) => {
                assert_eq!(k, &bk, "B6: a budget cap names the budget: {rf:?}");
                let max = match rf.amount {
                    Amount::Tokens => BUDGET_TOKENS,
                    _ => panic!("B6: only tokens are capped on the budget: {rf:?}"),
                };
                (Box::new(|_| true), max)
            }
            other => panic!("B6: a cap scope the suite does not know: {other:?}"),
        };
        *by_scope
            .entry(match rf.scope {
                CapScope::Run(_) => "run",
                CapScope::Budget(_) => "budget",
                _ => "unknown",
            })
            .or_default() += 1;
        let a = rf.amount;
        assert!(
            rf.spent as u128 + rf.held as u128 + rf.asked as u128 > max as u128,
            "B6: a refusal within the cap: {rf:?} (cap {max})"
        );
        let spent_lo: u64 = settles
            .iter()
            .filter(|c| in_scope(c.run) && c.ret < rf.inv)
            .map(|c| c.amounts.get(a))
            .sum();
        let spent_hi: u64 = settles
            .iter()
            .filter(|c| in_scope(c.run) && c.inv < rf.ret)
            .map(|c| c.amounts.get(a))
            .sum();
        let held_lo: u64 = lives
            .iter()
            .filter(|l| {
                in_scope(l.reserved.run)
                    && l.reserved.ret < rf.inv
                    && l.ended.is_none_or(|(inv, _)| inv > rf.ret)
            })
            .map(|l| l.reserved.amounts.get(a))
            .sum();
        let held_hi: u64 = lives
            .iter()
            .filter(|l| {
                in_scope(l.reserved.run)
                    && l.reserved.inv < rf.ret
                    && l.ended.is_none_or(|(_, ret)| ret > rf.inv)
            })
            .map(|l| l.reserved.amounts.get(a))
            .sum();
        assert!(
            (spent_lo..=spent_hi).contains(&rf.spent) && (held_lo..=held_hi).contains(&rf.held),
            "B6: a refusal not justified by the committed state at its moment: {rf:?}; \
             the history allows spent {spent_lo}..={spent_hi}, held {held_lo}..={held_hi}"
        );
    }
    assert!(
        by_scope.contains_key("run") && by_scope.contains_key("budget"),
        "B6: both the run's cap and the budget's refused some reserves: {by_scope:?}"
    );
}
