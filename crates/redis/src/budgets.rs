//! Spend caps (rules B1–B6) on Redis: budgets, holds and their writes as
//! `budgets.lua` (put_budget, reserve, release) and `patch_run.lua`
//! (settle), all on the tenant's hash tag. The scripts mirror
//! `rules::budget`; the reads here use its functions (`held`,
//! `overshoot`) directly.

use agentstate_core::budget::{
    Amount, BudgetKey, BudgetRecord, BudgetStatus, CapLimit, CapScope, Caps, Hold, HoldRecord,
    RunSpend, Settled, Spend,
};
use agentstate_core::codec::cursor::{self as cursor_codec, Listing};
use agentstate_core::codec::key::KeyBuf;
use agentstate_core::error::{RecordKey, Result, StateError};
use agentstate_core::limits::HOLDS_PER_RUN_MAX;
use agentstate_core::page::{Page, PageRequest};
use agentstate_core::record::{RunKey, StateDelta};
use agentstate_core::rules::{
    check_budget_key, check_hold, check_id, check_limit, check_run_key, held, overshoot,
};

use super::runs::{Reply, caps_arg, decode_run, no_budget, num, outcome, text};
use agentstate_core::idempotency::{IdempotencyKey, Keyed};

use super::connect::QueryOn;
use super::scripts::BUDGETS;
use super::{Conn, RedisStore, keys};

/// A hash's fields and values, as HGETALL answers.
type HashPairs = Vec<(Vec<u8>, Vec<u8>)>;

/// A hold as the scripts store it: 'cost tokens iterations created expires'.
pub(super) fn parse_hold(id: &str, v: &[u8]) -> Result<HoldRecord> {
    let s = std::str::from_utf8(v).map_err(|_| StateError::corrupt("redis: hold not UTF-8"))?;
    let f: Vec<&str> = s.split(' ').collect();
    let [c, t, i, ca, ea] = f.as_slice() else {
        return Err(StateError::corrupt("redis: hold malformed"));
    };
    Ok(HoldRecord {
        id: id.to_string(),
        amounts: Spend {
            cost_micros: num(c.as_bytes(), "hold cost")?,
            tokens: num(t.as_bytes(), "hold tokens")?,
            iterations: num(i.as_bytes(), "hold iterations")?,
        },
        created_at: num(ca.as_bytes(), "hold created_at")?,
        expires_at: num(ea.as_bytes(), "hold expires_at")?,
    })
}

/// A hold as the scripts store it (import).
pub(super) fn hold_value(h: &HoldRecord) -> String {
    let a = h.amounts;
    format!(
        "{} {} {} {} {}",
        a.cost_micros, a.tokens, a.iterations, h.created_at, h.expires_at
    )
}

/// Caps from the scripts' 'cost tokens iterations' ('-' for none).
pub(super) fn parse_caps(s: &[u8]) -> Result<Caps> {
    let s = std::str::from_utf8(s).map_err(|_| StateError::corrupt("redis: caps not UTF-8"))?;
    let f: Vec<&str> = s.split(' ').collect();
    let [c, t, i] = f.as_slice() else {
        return Err(StateError::corrupt("redis: caps malformed"));
    };
    let one = |v: &str| -> Result<Option<u64>> {
        if v == "-" {
            Ok(None)
        } else {
            num(v.as_bytes(), "cap").map(Some)
        }
    };
    Ok(Caps {
        cost_micros_max: one(c)?,
        tokens_max: one(t)?,
        iterations_max: one(i)?,
    })
}

/// A budget hash's fields, in the order `budget_fields` reads them.
pub(super) const BUDGET_FIELDS: [&str; 7] = ["ver", "ca", "ua", "cp", "sc", "st", "si"];

/// The budget and what is spent against it, from its hash's fields; None
/// when the hash is missing.
pub(super) fn budget_row(
    key: &BudgetKey,
    f: &[Option<Vec<u8>>],
) -> Result<Option<(BudgetRecord, Spend)>> {
    let [
        Some(ver),
        Some(ca),
        Some(ua),
        Some(cp),
        Some(sc),
        Some(st),
        Some(si),
    ] = f
    else {
        if f.iter().all(Option::is_none) {
            return Ok(None);
        }
        return Err(StateError::corrupt("redis: budget hash incomplete"));
    };
    Ok(Some((
        BudgetRecord {
            key: key.clone(),
            version: num(ver, "budget version")?,
            caps: parse_caps(cp)?,
            created_at: num(ca, "budget created_at")?,
            updated_at: num(ua, "budget updated_at")?,
        },
        Spend {
            cost_micros: num(sc, "budget spent cost")?,
            tokens: num(st, "budget spent tokens")?,
            iterations: num(si, "budget spent iterations")?,
        },
    )))
}

/// The holds of a budget-holds hash, each with its run id.
pub(super) fn budget_holds(all: Vec<(Vec<u8>, Vec<u8>)>) -> Result<Vec<(String, HoldRecord)>> {
    all.into_iter()
        .map(|(f, v)| {
            let f = text(&f);
            let (len, rest) = f
                .split_once(':')
                .ok_or_else(|| StateError::corrupt("redis: budget hold field malformed"))?;
            let len: usize = len
                .parse()
                .map_err(|_| StateError::corrupt("redis: budget hold field malformed"))?;
            if rest.len() < len || !rest.is_char_boundary(len) {
                return Err(StateError::corrupt("redis: budget hold field malformed"));
            }
            let (run_id, hold_id) = rest.split_at(len);
            Ok((run_id.to_string(), parse_hold(hold_id, &v)?))
        })
        .collect()
}

impl RedisStore {
    /// A budget's status at `now`, read in one MULTI.
    pub(super) async fn budget_status(
        &self,
        conn: &mut Conn,
        key: &BudgetKey,
        now: u64,
    ) -> Result<Option<BudgetStatus>> {
        let p = keys::tenant(&key.tenant);
        let mut hm = ::redis::cmd("HMGET");
        hm.arg(keys::budget(&p, &key.name)).arg(&BUDGET_FIELDS[..]);
        let (fields, holds): (Vec<Option<Vec<u8>>>, HashPairs) = ::redis::pipe()
            .atomic()
            .add_command(hm)
            .cmd("HGETALL")
            .arg(keys::budget_holds(&p, &key.name))
            .query_on(conn)
            .await?;
        let Some((record, spent)) = budget_row(key, &fields)? else {
            return Ok(None);
        };
        let holds = budget_holds(holds)?;
        Ok(Some(BudgetStatus::new(
            record,
            spent,
            held(holds.iter().map(|(_, h)| h), now),
            holds.iter().filter(|(_, h)| h.is_live(now)).count() as u64,
        )))
    }
}

impl RedisStore {
    /// `stats`' budget counts for one tenant: budgets, live holds, and
    /// runs at their cap (their own or their budget's, `rules::at_cap`).
    pub(super) async fn budget_stats(
        &self,
        conn: &mut Conn,
        tenant: &str,
        ts: &mut agentstate_core::admin::TenantStats,
    ) -> Result<()> {
        use std::collections::HashMap;
        let now = self.now();
        let p = keys::tenant(tenant);
        async fn zall(conn: &mut Conn, key: Vec<u8>) -> Result<Vec<Vec<u8>>> {
            ::redis::cmd("ZRANGE")
                .arg(key)
                .arg(0)
                .arg(-1)
                .query_on(conn)
                .await
        }
        let mut budgets: HashMap<String, BudgetStatus> = HashMap::new();
        for name in zall(conn, keys::budgets(&p)).await? {
            let key = BudgetKey::new(tenant, text(&name));
            if let Some(st) = self.budget_status(conn, &key, now).await? {
                ts.budgets += 1;
                budgets.insert(key.name, st);
            }
        }
        let mut run_held: HashMap<String, Spend> = HashMap::new();
        for run in zall(conn, keys::holds_index(&p)).await? {
            let run_id = text(&run);
            let all: Vec<(Vec<u8>, Vec<u8>)> = ::redis::cmd("HGETALL")
                .arg(keys::holds(&p, &run_id))
                .query_on(conn)
                .await?;
            let holds = all
                .into_iter()
                .map(|(id, v)| parse_hold(&text(&id), &v))
                .collect::<Result<Vec<_>>>()?;
            ts.holds += holds.iter().filter(|h| h.is_live(now)).count() as u64;
            run_held.insert(run_id, held(&holds, now));
        }
        for run in zall(conn, keys::runs(&p)).await? {
            let run_id = text(&run);
            let f: Vec<Option<Vec<u8>>> = ::redis::cmd("HMGET")
                .arg(keys::run(&p, &run_id))
                .arg(&["cp", "bg", "it", "ot", "co", "ir"][..])
                .query_on(conn)
                .await?;
            let [cp, bg, Some(it), Some(ot), Some(co), Some(ir)] = f.as_slice() else {
                continue;
            };
            if cp.is_none() && bg.is_none() {
                continue;
            }
            let caps = cp
                .as_deref()
                .map(parse_caps)
                .transpose()?
                .unwrap_or_default();
            let spent = Spend {
                cost_micros: num(co, "run cost")?,
                tokens: num(it, "run tokens")?.saturating_add(num(ot, "run tokens")?),
                iterations: num(ir, "run iterations")?,
            };
            let h = run_held.get(&run_id).copied().unwrap_or_default();
            let mut at = agentstate_core::rules::at_cap(&caps, spent, h);
            if let Some(b) = bg.as_ref().and_then(|b| budgets.get(&text(b))) {
                at |= agentstate_core::rules::at_cap(&b.record.caps, b.spent, b.held);
            }
            if at {
                ts.runs_at_cap += 1;
            }
        }
        Ok(())
    }
}

fn amount_of(b: &[u8]) -> Result<Amount> {
    match b {
        b"1" => Ok(Amount::CostMicros),
        b"2" => Ok(Amount::Tokens),
        b"3" => Ok(Amount::Iterations),
        _ => Err(StateError::corrupt("redis: reserve named no amount")),
    }
}

impl RedisStore {
    pub(super) async fn put_budget(&self, record: BudgetRecord) -> Result<BudgetRecord> {
        check_budget_key(&record.key)?;
        let p = keys::tenant(&record.key.tenant);
        let mut conn = self.conn().await?;
        self.writable(&mut conn).await?;
        self.register(&mut conn, &record.key.tenant).await?;
        let reply: Reply = BUDGETS
            .key(keys::budget(&p, &record.key.name))
            .key(keys::budgets(&p))
            .arg("put_budget")
            .arg(&p)
            .arg(&record.key.name)
            .arg(record.version.to_string())
            .arg(caps_arg(&record.caps))
            .arg(self.now().to_string())
            .invoke(&mut conn)
            .await?;
        let rest = outcome(
            reply,
            || RecordKey::Budget(record.key.clone()),
            record.version,
        )?;
        let [ver, ca, ua] = rest.as_slice() else {
            return Err(StateError::corrupt("redis: put_budget answer malformed"));
        };
        Ok(BudgetRecord {
            version: num(ver, "budget version")?,
            created_at: num(ca, "budget created_at")?,
            updated_at: num(ua, "budget updated_at")?,
            ..record
        })
    }

    pub(super) async fn get_budget(&self, key: &BudgetKey) -> Result<Option<BudgetStatus>> {
        check_budget_key(key)?;
        let mut conn = self.conn().await?;
        self.budget_status(&mut conn, key, self.now()).await
    }

    pub(super) async fn list_budgets(
        &self,
        tenant: &str,
        page: &PageRequest,
    ) -> Result<Page<BudgetStatus>> {
        check_id("tenant", tenant)?;
        check_limit(page.limit)?;
        let binding = KeyBuf::table(Listing::Budgets as u8).str(tenant).done();
        let after = match &page.cursor {
            None => None,
            Some(c) => Some(cursor_codec::decode(
                &self.secret().await?,
                Listing::Budgets,
                &binding,
                c,
            )?),
        };
        let now = self.now();
        let p = keys::tenant(tenant);
        let mut conn = self.conn().await?;
        let mut items: Vec<(Vec<u8>, BudgetStatus)> = Vec::with_capacity(page.limit + 1);
        let mut after = after;
        loop {
            let want = page.limit + 1 - items.len();
            let names = self
                .lex_after(&mut conn, &keys::budgets(&p), after.as_deref(), want)
                .await?;
            let got = names.len();
            for n in names {
                let key = BudgetKey::new(tenant, text(&n));
                if let Some(s) = self.budget_status(&mut conn, &key, now).await? {
                    items.push((n.clone(), s));
                }
                after = Some(n);
            }
            if got < want || items.len() > page.limit {
                break;
            }
        }
        let more = items.len() > page.limit;
        items.truncate(page.limit);
        let cursor = match (more, items.last()) {
            (true, Some((n, _))) => Some(cursor_codec::encode(
                &self.secret().await?,
                Listing::Budgets,
                &binding,
                n,
            )),
            _ => None,
        };
        Page::new(items.into_iter().map(|(_, s)| s).collect(), cursor)
    }

    pub(super) async fn reserve(&self, run: &RunKey, hold: Hold) -> Result<HoldRecord> {
        self.reserve_with(run, hold, None).await
    }
    pub(super) async fn reserve_idempotent(
        &self,
        run: &RunKey,
        hold: Hold,
        key: &IdempotencyKey,
    ) -> Result<HoldRecord> {
        let keyed = Keyed::reserve(run, &hold, key)?;
        self.reserve_with(run, hold, Some(keyed))
            .await
            .map_err(StateError::keyed)
    }

    pub(super) async fn settle(
        &self,
        run: &RunKey,
        hold_id: &str,
        spent: StateDelta,
    ) -> Result<Settled> {
        self.settle_with(run, hold_id, spent, None).await
    }
    pub(super) async fn settle_idempotent(
        &self,
        run: &RunKey,
        hold_id: &str,
        spent: StateDelta,
        key: &IdempotencyKey,
    ) -> Result<Settled> {
        let keyed = Keyed::settle(run, hold_id, &spent, key)?;
        self.settle_with(run, hold_id, spent, Some(keyed))
            .await
            .map_err(StateError::keyed)
    }

    pub(super) async fn release_hold(&self, run: &RunKey, hold_id: &str) -> Result<()> {
        self.release_hold_with(run, hold_id, None).await
    }
    pub(super) async fn release_hold_idempotent(
        &self,
        run: &RunKey,
        hold_id: &str,
        key: &IdempotencyKey,
    ) -> Result<()> {
        let keyed = Keyed::release_hold(run, hold_id, key)?;
        self.release_hold_with(run, hold_id, Some(keyed))
            .await
            .map_err(StateError::keyed)
    }
    pub(super) async fn run_spend(&self, run: &RunKey) -> Result<Option<RunSpend>> {
        check_run_key(run)?;
        let now = self.now();
        let p = keys::tenant(&run.tenant);
        let mut conn = self.conn().await?;
        let (v, holds): (Option<Vec<u8>>, HashPairs) = ::redis::pipe()
            .atomic()
            .cmd("HGET")
            .arg(keys::run(&p, &run.run_id))
            .arg("v")
            .cmd("HGETALL")
            .arg(keys::holds(&p, &run.run_id))
            .query_on(&mut conn)
            .await?;
        let Some(v) = v else {
            return Ok(None);
        };
        let r = decode_run(&v, run)?;
        let mut live = Vec::new();
        for (id, h) in holds {
            let h = parse_hold(&text(&id), &h)?;
            if h.is_live(now) {
                live.push(h);
            }
        }
        live.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(Some(RunSpend::new(
            r.key.clone(),
            r.caps,
            r.budget.clone(),
            Spend::of_run(&r),
            held(&live, now),
            live,
        )))
    }
}

impl RedisStore {
    // Rule B2: decided by the server's copy, lua/budgets.lua's reserve.
    async fn reserve_with(
        &self,
        run: &RunKey,
        hold: Hold,
        keyed: Option<Keyed<'_>>,
    ) -> Result<HoldRecord> {
        check_run_key(run)?;
        check_hold(&hold)?;

        let idem = self.idem(keyed);
        let p = keys::tenant(&run.tenant);
        let mut conn = self.conn().await?;
        self.writable(&mut conn).await?;
        let reply: Reply = BUDGETS
            .key(keys::run(&p, &run.run_id))
            .key(keys::holds(&p, &run.run_id))
            .arg("reserve")
            .arg(&p)
            .arg(&run.run_id)
            .arg(&hold.id)
            .arg(hold.cost_micros.to_string())
            .arg(hold.tokens.to_string())
            .arg(hold.iterations.to_string())
            .arg(hold.ttl_millis.to_string())
            .arg(self.now().to_string())
            .arg(HOLDS_PER_RUN_MAX.to_string())
            .idem(idem.as_ref())
            .invoke(&mut conn)
            .await?;
        match reply.first().map(Vec::as_slice) {
            Some(b"duphold") => {
                return Err(StateError::invalid(format!(
                    "hold id {:?}: the run already holds it; settle or release it first",
                    hold.id
                )));
            }
            Some(b"toomany") => {
                return Err(StateError::invalid(format!(
                    "holds: a run has at most {HOLDS_PER_RUN_MAX} live holds"
                )));
            }
            Some(b"nobudget") => return Err(no_budget(&run.tenant, &reply)),
            Some(b"exceeded") => {
                let f = &reply[1..];
                if f.len() < 6 {
                    return Err(StateError::corrupt("redis: reserve answer malformed"));
                }
                let scope = match f[0].as_slice() {
                    b"run" => CapScope::Run(run.clone()),
                    b"budget" => CapScope::Budget(BudgetKey::new(
                        run.tenant.clone(),
                        text(f.get(6).map_or(&b""[..], |v| v)),
                    )),
                    _ => return Err(StateError::corrupt("redis: reserve named no scope")),
                };
                return Err(StateError::BudgetExceeded {
                    limit: CapLimit::new(scope, amount_of(&f[1])?, num(&f[2], "cap")?),
                    spent: num(&f[3], "spent")?,
                    held: num(&f[4], "held")?,
                    asked: num(&f[5], "asked")?,
                });
            }
            _ => {}
        }
        let rest = outcome(reply, || RecordKey::Run(run.clone()), 0)?;
        let [ca, ea] = rest.as_slice() else {
            return Err(StateError::corrupt("redis: reserve answer malformed"));
        };
        Ok(HoldRecord {
            id: hold.id.clone(),
            amounts: hold.amounts(),
            created_at: num(ca, "hold created_at")?,
            expires_at: num(ea, "hold expires_at")?,
        })
    }

    // Rule B3: decided by the server's copy, lua/patch_run.lua with the hold id.
    async fn settle_with(
        &self,
        run: &RunKey,
        hold_id: &str,
        spent: StateDelta,
        keyed: Option<Keyed<'_>>,
    ) -> Result<Settled> {
        check_run_key(run)?;
        check_id("hold id", hold_id)?;
        let (record, hold) = self.patch(run, &spent, Some(hold_id), keyed).await?;
        let hold = hold.ok_or_else(|| StateError::corrupt("redis: settle answered no hold"))?;
        Ok(Settled::new(record, overshoot(&hold, &spent)))
    }

    // Rule B4: decided by the server's copy, lua/budgets.lua's release.
    async fn release_hold_with(
        &self,
        run: &RunKey,
        hold_id: &str,
        keyed: Option<Keyed<'_>>,
    ) -> Result<()> {
        check_run_key(run)?;
        check_id("hold id", hold_id)?;
        let idem = self.idem(keyed);
        let p = keys::tenant(&run.tenant);
        let mut conn = self.conn().await?;
        self.writable(&mut conn).await?;
        let reply: Reply = BUDGETS
            .key(keys::run(&p, &run.run_id))
            .key(keys::holds(&p, &run.run_id))
            .arg("release")
            .arg(&p)
            .arg(&run.run_id)
            .arg(hold_id)
            .arg(self.now().to_string())
            .idem(idem.as_ref())
            .invoke(&mut conn)
            .await?;
        if reply.first().map(Vec::as_slice) == Some(b"nohold") {
            return Err(StateError::NotFound(RecordKey::Hold {
                run: run.clone(),
                hold_id: hold_id.to_string(),
            }));
        }
        outcome(reply, || RecordKey::Run(run.clone()), 0).map(|_| ())
    }
}
