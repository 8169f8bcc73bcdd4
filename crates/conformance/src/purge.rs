//! P — erasure: a tenant purged leaves nothing of it behind (P1).

use super::Factory;
use super::helpers::*;
use agentstate_core::{
    BudgetKey, BudgetRecord, Caps, Hold, IdempotencyKey, InstanceKey, PageRequest, RunKey,
    RunRecord, RunState, SessionKey, SessionRecord, StateDelta, StateQuery,
};

/// Writes a tenant's worth of everything: sessions, runs in and out of
/// them (finished and not), a budget with a live hold, a keyed patch.
fn populate(s: &dyn super::ConformanceStore, t: &str) {
    let sk = SessionKey::new(t, "chat");
    ok(
        s.put_session(SessionRecord::new(sk)),
        "P1: create a session",
    );
    ok(
        s.put_budget(BudgetRecord::new(
            BudgetKey::new(t, "monthly"),
            Caps::new().cost_micros(10_000),
        )),
        "P1: create a budget",
    );
    for i in 0..5 {
        let mut r =
            RunRecord::new(RunKey::new(t, format!("run-{i}")), "planner").with_label("team", "a");
        if i % 2 == 0 {
            r = r.with_session("chat");
        }
        if i == 1 {
            r = r.with_budget("monthly");
        }
        create(s, r);
    }
    update(s, &RunKey::new(t, "run-3"), |r| r.state = RunState::Running);
    update(s, &RunKey::new(t, "run-3"), |r| {
        r.state = RunState::Completed
    });
    ok(
        s.reserve(
            &RunKey::new(t, "run-1"),
            Hold::new("h1", 60_000).cost_micros(100),
        ),
        "P1: hold",
    );
    ok(
        s.patch_run_idempotent(
            &RunKey::new(t, "run-0"),
            StateDelta {
                cost_micros: 5,
                ..Default::default()
            },
            &IdempotencyKey::new("pay-1").expect("a key"),
        ),
        "P1: a keyed patch",
    );
}

/// Everything the listings show of a tenant.
fn listed(s: &dyn super::ConformanceStore, t: &str) -> (Vec<RunRecord>, usize, usize) {
    let runs = walk_runs(s, &StateQuery::new(t));
    let sessions = ok(
        s.list_sessions(t, &PageRequest::new(1000)),
        "P1: list_sessions",
    )
    .items()
    .len();
    let budgets = ok(
        s.list_budgets(t, &PageRequest::new(1000)),
        "P1: list_budgets",
    )
    .items()
    .len();
    (runs, sessions, budgets)
}

/// P1: `purge_tenant` deletes every run, session, budget, hold, counter
/// and idempotency key of the tenant, and only of that tenant; trays (the
/// instances') stay; the ids are free again and a key of the purged
/// tenant applies anew; a second purge finds nothing.
pub fn p1_purge_tenant_erases_every_record(make: Factory<'_>) {
    let c = open(make);
    let s = &*c.store;
    let (t, u) = (unique("p1"), unique("p1keep"));
    populate(s, &t);
    populate(s, &u);
    // A tray whose namespace happens to be the tenant's name.
    let inst = InstanceKey::new(&t, "worker");
    ok(
        s.write_tray(&inst.tray("state", "main"), 1, tray(true, "{}", "prod")),
        "P1: write a tray",
    );
    let kept_before = listed(s, &u);

    let n = ok(s.purge_tenant(&t), "P1: purge_tenant");
    // 5 runs, 1 session, 1 budget, 1 hold.
    assert_eq!(
        n, 8,
        "P1: purge_tenant counts runs, sessions, budgets, holds"
    );
    let (runs, sessions, budgets) = listed(s, &t);
    assert!(
        runs.is_empty() && sessions == 0 && budgets == 0,
        "P1: the purged tenant still lists {} runs, {sessions} sessions, {budgets} budgets",
        runs.len()
    );
    for i in 0..5 {
        assert!(
            get(s, &RunKey::new(&t, format!("run-{i}"))).is_none(),
            "P1: run-{i} is still there"
        );
    }
    assert!(get_session(s, &SessionKey::new(&t, "chat")).is_none());
    assert!(
        ok(
            s.get_budget(&BudgetKey::new(&t, "monthly")),
            "P1: get_budget"
        )
        .is_none(),
        "P1: the budget is still there"
    );
    assert!(
        ok(s.run_spend(&RunKey::new(&t, "run-1")), "P1: run_spend").is_none(),
        "P1: the run's spend is still there"
    );
    let stats = ok(s.stats(), "P1: stats");
    assert!(
        stats
            .tenants
            .get(&t)
            .is_none_or(|ts| ts.runs_by_state.values().all(|&n| n == 0)
                && ts.sessions == 0
                && ts.budgets == 0
                && ts.holds == 0),
        "P1: stats still count the purged tenant: {:?}",
        stats.tenants.get(&t)
    );

    // Only that tenant: the other one lists exactly what it did.
    let kept_after = listed(s, &u);
    assert_eq!(kept_after, kept_before, "P1: another tenant was touched");
    assert!(
        read_tray(s, &inst.tray("state", "main"), 1).is_some(),
        "P1: a tray of the instance namespace named like the tenant was purged"
    );

    // The tenant starts afresh: ids free, seqs and keys forgotten.
    let again = create(s, RunRecord::new(RunKey::new(&t, "run-0"), "planner"));
    assert_eq!(again.version, 1, "P1: a purged id creates a new run");
    assert!(
        walk_runs(s, &StateQuery::new(&t).label("team", "a")).is_empty(),
        "P1: a purged run's label still lists it (R11's index outlived the purge)"
    );
    // One write more than before the purge, so a remembered answer
    // (version 2) would differ from a new application (version 3).
    update(s, &again.key, |r| r.agent_name = "reporter".into());
    let patched = ok(
        s.patch_run_idempotent(
            &RunKey::new(&t, "run-0"),
            StateDelta {
                cost_micros: 5,
                ..Default::default()
            },
            &IdempotencyKey::new("pay-1").expect("a key"),
        ),
        "P1: the purged tenant's key again",
    );
    assert_eq!(
        (patched.version, patched.cost_micros),
        (3, 5),
        "P1: a key of the purged tenant is forgotten, and applies anew"
    );
    ok(s.purge_tenant(&t), "P1: purge again");
    assert_eq!(
        ok(s.purge_tenant(&t), "P1: purge an empty tenant"),
        0,
        "P1: a purged tenant has nothing left to purge"
    );
}
