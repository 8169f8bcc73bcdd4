//! An agent near its spend cap fans out 8 sub-agents; the cap holds.
//!
//! The parent run is capped at $1.00 and has spent $0.80. Eight sub-agents
//! share its cap and make model calls estimated at up to $0.05 each. The
//! example does it twice:
//!
//! 1. **Check, then record** — the bug agent frameworks keep shipping: each
//!    sub-agent reads the spend, sees room, makes the call, and records
//!    what it cost. All eight pass the same check, and the cap is overrun.
//! 2. **Reserve → call → settle** — each sub-agent reserves its estimate
//!    first (checked against spent + held atomically), makes the call only
//!    when the reserve succeeded, and settles with the actual cost. The
//!    cap holds, and every refusal says which cap and by how much.
//!
//! Run it with `cargo run --example budget_fanout`; with a path argument it
//! writes a file store there, to look at with
//! `agentstate budgets show --db PATH --tenant acme --run fanout-reserve`.

use std::sync::Arc;
use std::time::Duration;

use agentstate::{
    BudgetKey, BudgetRecord, Caps, FileStore, Hold, MemoryStore, RunKey, RunRecord, StateDelta,
    StateError, Store,
};

const CAP: u64 = 1_000_000; // $1.00 in micros
const ALREADY_SPENT: u64 = 800_000;
const ESTIMATE: u64 = 50_000; // the most one call may cost
const SUB_AGENTS: usize = 8;
const CALLS_EACH: usize = 6;

/// What a call really cost: 60–100 % of the estimate, by call number.
fn actual_cost(agent: usize, call: usize) -> u64 {
    ESTIMATE * (60 + ((agent * 7 + call * 13) % 41) as u64) / 100
}

/// A model call's latency: the window in which the naive check goes stale.
fn model_call() {
    std::thread::sleep(Duration::from_millis(5));
}

fn spend(cost_micros: u64) -> StateDelta {
    StateDelta {
        cost_micros,
        iterations: 1,
        ..Default::default()
    }
}

fn dollars(micros: u64) -> String {
    format!(
        "${}.{:02}",
        micros / 1_000_000,
        (micros % 1_000_000) / 10_000
    )
}

fn parent(store: &dyn Store, id: &str) -> Result<RunKey, StateError> {
    let key = RunKey::new("acme", id);
    store.put_run(
        RunRecord::new(key.clone(), "orchestrator")
            .with_caps(Caps::new().cost_micros(CAP))
            .with_budget("team"),
    )?;
    // What the orchestrator spent before fanning out.
    store.patch_run(&key, spend(ALREADY_SPENT))?;
    Ok(key)
}

/// The bug: check the spend, make the call, record the cost.
fn check_then_record(store: &Arc<dyn Store>) -> Result<u64, StateError> {
    let key = parent(&**store, "fanout-naive")?;
    std::thread::scope(|sc| {
        for agent in 0..SUB_AGENTS {
            let (store, key) = (store.clone(), key.clone());
            sc.spawn(move || -> Result<(), StateError> {
                for call in 0..CALLS_EACH {
                    let run = store.get_run(&key)?.expect("the parent run exists");
                    if run.cost_micros + ESTIMATE > CAP {
                        return Ok(()); // "the cap is reached"
                    }
                    model_call();
                    store.patch_run(&key, spend(actual_cost(agent, call)))?;
                }
                Ok(())
            });
        }
    });
    Ok(store.get_run(&key)?.expect("exists").cost_micros)
}

/// The fix: reserve the estimate, call only when it was granted, settle.
fn reserve_call_settle(store: &Arc<dyn Store>) -> Result<(u64, usize, usize), StateError> {
    let key = parent(&**store, "fanout-reserve")?;
    let results = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..SUB_AGENTS)
            .map(|agent| {
                let (store, key) = (store.clone(), key.clone());
                sc.spawn(move || -> Result<(usize, usize), StateError> {
                    let (mut calls, mut refused) = (0, 0);
                    for call in 0..CALLS_EACH {
                        let id = format!("sub{agent}-call{call}");
                        let hold = Hold::new(&id, 60_000).cost_micros(ESTIMATE).iterations(1);
                        match store.reserve(&key, hold) {
                            Ok(_) => {}
                            Err(StateError::BudgetExceeded {
                                limit,
                                spent,
                                held,
                                asked,
                            }) => {
                                if refused == 0 {
                                    println!(
                                        "  sub-agent {agent}: refused by the {limit}: spent {} + held {} + asked {}",
                                        dollars(spent),
                                        dollars(held),
                                        dollars(asked)
                                    );
                                }
                                refused += 1;
                                continue;
                            }
                            Err(e) => return Err(e),
                        }
                        model_call();
                        let settled = store.settle(&key, &id, spend(actual_cost(agent, call)))?;
                        assert!(settled.overshoot.is_zero(), "every call stayed within its estimate");
                        calls += 1;
                    }
                    Ok((calls, refused))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a sub-agent panicked"))
            .collect::<Result<Vec<_>, _>>()
    })?;
    let calls = results.iter().map(|r| r.0).sum();
    let refused = results.iter().map(|r| r.1).sum();
    Ok((
        store.get_run(&key)?.expect("exists").cost_micros,
        calls,
        refused,
    ))
}

fn main() -> Result<(), StateError> {
    let store: Arc<dyn Store> = match std::env::args_os().nth(1) {
        Some(path) => Arc::new(FileStore::open(path)?),
        None => Arc::new(MemoryStore::new()),
    };
    // The tenant's shared budget; the parent's own $1.00 cap is the
    // tighter one here.
    store.put_budget(BudgetRecord::new(
        BudgetKey::new("acme", "team"),
        Caps::new().cost_micros(50_000_000),
    ))?;
    println!(
        "parent capped at {}, {} spent; {SUB_AGENTS} sub-agents, calls estimated at up to {}",
        dollars(CAP),
        dollars(ALREADY_SPENT),
        dollars(ESTIMATE)
    );

    let naive = check_then_record(&store)?;
    println!(
        "check, then record:     spent {} of {} ({})",
        dollars(naive),
        dollars(CAP),
        if naive > CAP {
            format!("overrun by {}", dollars(naive - CAP))
        } else {
            "within the cap this time: the race did not hit".to_string()
        }
    );

    println!("reserve → call → settle:");
    let (spent, calls, refused) = reserve_call_settle(&store)?;
    println!(
        "  spent {} of {} in {calls} calls; {refused} reserves refused",
        dollars(spent),
        dollars(CAP)
    );
    assert!(spent <= CAP, "the cap held");
    println!("the cap held.");
    let b = store
        .get_budget(&BudgetKey::new("acme", "team"))?
        .expect("the budget exists");
    println!(
        "tenant budget \"team\": {} spent by both parents, {} held",
        dollars(b.spent.cost_micros),
        dollars(b.held.cost_micros)
    );
    Ok(())
}
