//! The decisions of the spend caps (rules B1–B6), as pure functions every
//! backend calls: does a reserve fit, what a hold is as stored, what a
//! settle reports, which holds have expired by the injected clock, and
//! what a budget write stores. A backend reads the run, its holds, its
//! budget and the budget's holds, asks these, and writes the answer in the
//! same atomic step as the reads.

use crate::budget::{
    Amount, BudgetKey, BudgetRecord, CapLimit, CapScope, Caps, Hold, HoldRecord, Spend,
};
use crate::error::{RecordKey, Result, StateError};
use crate::limits::{HOLD_TTL_MILLIS_MAX, HOLDS_PER_RUN_MAX};
use crate::record::{Millis, RunRecord, StateDelta};

use super::check::check_id;
use super::decide::check_version;

/// K1 for a budget's key.
pub fn check_budget_key(k: &BudgetKey) -> Result<()> {
    check_id("tenant", &k.tenant)?;
    check_id("budget name", &k.name)
}

/// A hold's id is an id (K1); its ttl is 1..=`HOLD_TTL_MILLIS_MAX`.
pub fn check_hold(h: &Hold) -> Result<()> {
    check_id("hold id", &h.id)?;
    if h.ttl_millis == 0 || h.ttl_millis > HOLD_TTL_MILLIS_MAX {
        return Err(StateError::invalid(format!(
            "hold ttl_millis: must be 1..={HOLD_TTL_MILLIS_MAX}, got {}",
            h.ttl_millis
        )));
    }
    Ok(())
}

/// B5: the sum of the holds that still count at `now`. Sums saturate: a
/// sum past `u64::MAX` is past every cap anyway.
pub fn held<'a>(holds: impl IntoIterator<Item = &'a HoldRecord>, now: Millis) -> Spend {
    let mut s = Spend::default();
    for h in holds.into_iter().filter(|h| h.is_live(now)) {
        s.cost_micros = s.cost_micros.saturating_add(h.amounts.cost_micros);
        s.tokens = s.tokens.saturating_add(h.amounts.tokens);
        s.iterations = s.iterations.saturating_add(h.amounts.iterations);
    }
    s
}

/// B5: the holds that no longer count at `now` (to be removed by the
/// write that found them).
pub fn expired<'a, T>(
    holds: impl IntoIterator<Item = &'a (T, HoldRecord)>,
    now: Millis,
) -> Vec<&'a T>
where
    T: 'a,
{
    holds
        .into_iter()
        .filter(|(_, h)| !h.is_live(now))
        .map(|(k, _)| k)
        .collect()
}

/// One scope's side of the B2 check: `spent + held + asked <= max` for
/// every capped amount, or the `BudgetExceeded` of the first that is not.
fn fits(scope: &CapScope, caps: &Caps, spent: Spend, held: Spend, asked: Spend) -> Result<()> {
    for amount in Amount::ALL {
        let Some(max) = caps.max(amount) else {
            continue;
        };
        let (s, h, a) = (spent.get(amount), held.get(amount), asked.get(amount));
        // In u128 the sum cannot overflow.
        if s as u128 + h as u128 + a as u128 > max as u128 {
            return Err(StateError::BudgetExceeded {
                limit: CapLimit {
                    scope: scope.clone(),
                    amount,
                    max,
                },
                spent: s,
                held: h,
                asked: a,
            });
        }
    }
    Ok(())
}

/// The budget side of a reserve: the budget, what is spent against it, and
/// its live holds' sum.
pub struct BudgetSide<'a> {
    pub record: &'a BudgetRecord,
    pub spent: Spend,
    pub held: Spend,
}

/// B2: may `asked` be held for `run` (whose live holds sum to `run_held`)
/// and its budget? The run's caps are checked first, then the budget's.
pub fn check_reserve(
    run: &RunRecord,
    run_held: Spend,
    budget: Option<&BudgetSide<'_>>,
    asked: Spend,
) -> Result<()> {
    fits(
        &CapScope::Run(run.key.clone()),
        &run.caps,
        Spend::of_run(run),
        run_held,
        asked,
    )?;
    if let Some(b) = budget {
        fits(
            &CapScope::Budget(b.record.key.clone()),
            &b.record.caps,
            b.spent,
            b.held,
            asked,
        )?;
    }
    Ok(())
}

/// B2: a run may hold at most `HOLDS_PER_RUN_MAX` live holds, and a hold
/// id names one live hold.
pub fn check_new_hold(hold: &Hold, live: &[&HoldRecord]) -> Result<()> {
    if live.iter().any(|h| h.id == hold.id) {
        return Err(StateError::invalid(format!(
            "hold id {:?}: the run already holds it; settle or release it first",
            hold.id
        )));
    }
    if live.len() >= HOLDS_PER_RUN_MAX {
        return Err(StateError::invalid(format!(
            "holds: a run has at most {HOLDS_PER_RUN_MAX} live holds"
        )));
    }
    Ok(())
}

/// The hold as stored: its amounts, reserved `now`, expiring `ttl` later.
pub fn new_hold(hold: &Hold, now: Millis) -> Result<HoldRecord> {
    let expires_at = now
        .checked_add(hold.ttl_millis)
        .ok_or_else(|| StateError::invalid("hold ttl_millis: the clock plus the ttl overflows"))?;
    Ok(HoldRecord {
        id: hold.id.clone(),
        amounts: hold.amounts(),
        created_at: now,
        expires_at,
    })
}

/// B3: how far the actual spend exceeded the hold, per amount.
pub fn overshoot(hold: &HoldRecord, delta: &StateDelta) -> Spend {
    let actual = Spend::of_delta(delta);
    Spend {
        cost_micros: actual.cost_micros.saturating_sub(hold.amounts.cost_micros),
        tokens: actual.tokens.saturating_sub(hold.amounts.tokens),
        iterations: actual.iterations.saturating_sub(hold.amounts.iterations),
    }
}

/// B3/B6: a budget's spend after a run of it spent `delta`. Never refuses
/// (spend that happened is recorded); it saturates at `u64::MAX`, where
/// every cap is long past.
pub fn budget_spent(spent: Spend, delta: &StateDelta) -> Spend {
    let d = Spend::of_delta(delta);
    Spend {
        cost_micros: spent.cost_micros.saturating_add(d.cost_micros),
        tokens: spent.tokens.saturating_add(d.tokens),
        iterations: spent.iterations.saturating_add(d.iterations),
    }
}

/// B1: a budget as written by a put whose version matched `stored`
/// (versioned like a session).
pub fn next_budget(
    stored: Option<&BudgetRecord>,
    record: BudgetRecord,
    now: Millis,
) -> Result<BudgetRecord> {
    check_version(record.version, stored.map(|s| s.version), || {
        RecordKey::Budget(record.key.clone())
    })?;
    Ok(match stored {
        None => BudgetRecord {
            version: 1,
            created_at: now,
            updated_at: now,
            ..record
        },
        Some(s) => BudgetRecord {
            version: s.version + 1,
            created_at: s.created_at,
            updated_at: now,
            ..record
        },
    })
}

/// For `stats` and the CLI: true when some cap of the scope is reached
/// (`spent + held >= max`), so a reserve asking for any of that amount is
/// refused now.
pub fn at_cap(caps: &Caps, spent: Spend, held: Spend) -> bool {
    Amount::ALL.into_iter().any(|a| {
        caps.max(a)
            .is_some_and(|max| spent.get(a) as u128 + held.get(a) as u128 >= max as u128)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::RunKey;

    fn hold(id: &str, cost: u64, expires_at: Millis) -> HoldRecord {
        HoldRecord {
            id: id.into(),
            amounts: Spend {
                cost_micros: cost,
                ..Default::default()
            },
            created_at: 0,
            expires_at,
        }
    }

    #[test]
    fn reserve_fits_exactly_at_the_cap_and_not_past_it() {
        let mut run =
            RunRecord::new(RunKey::new("t", "r"), "a").with_caps(Caps::new().cost_micros(100));
        run.cost_micros = 40;
        let held = Spend {
            cost_micros: 30,
            ..Default::default()
        };
        let ask = |n| Spend {
            cost_micros: n,
            ..Default::default()
        };
        assert!(check_reserve(&run, held, None, ask(30)).is_ok());
        match check_reserve(&run, held, None, ask(31)) {
            Err(StateError::BudgetExceeded {
                limit,
                spent: 40,
                held: 30,
                asked: 31,
            }) => {
                assert_eq!(limit.amount, Amount::CostMicros);
                assert_eq!(limit.max, 100);
                assert!(matches!(limit.scope, CapScope::Run(_)));
            }
            other => panic!("{other:?}"),
        }
        // Near u64::MAX the check does not wrap.
        assert!(check_reserve(&run, held, None, ask(u64::MAX)).is_err());
    }

    #[test]
    fn expired_holds_stop_counting_at_their_expiry() {
        let hs = [("a", hold("a", 5, 10)), ("b", hold("b", 7, 20))];
        assert_eq!(held(hs.iter().map(|(_, h)| h), 9).cost_micros, 12);
        assert_eq!(held(hs.iter().map(|(_, h)| h), 10).cost_micros, 7);
        assert_eq!(expired(&hs, 10), vec![&"a"]);
        assert!(expired(&hs, 9).is_empty());
    }

    #[test]
    fn overshoot_is_what_went_past_the_hold() {
        let h = hold("a", 5, 10);
        let d = StateDelta {
            cost_micros: 8,
            iterations: 1,
            ..Default::default()
        };
        assert_eq!(
            overshoot(&h, &d),
            Spend {
                cost_micros: 3,
                tokens: 0,
                iterations: 1
            }
        );
        let d = StateDelta {
            cost_micros: 2,
            ..Default::default()
        };
        assert!(overshoot(&h, &d).is_zero());
    }
}
