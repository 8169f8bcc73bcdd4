//! `budgets list|show`: spend caps (rules B1–B6) — per budget and per run,
//! what is capped, what is spent, and what live holds hold.

use std::io::Write;

use super::commands::{finish, walk};
use super::output::{Align, Table, json_line, micros, thousands};
use super::time::format_time;
use super::{CliError, PageArgs};
use agentstate::{
    Amount, BudgetKey, BudgetStatus, Caps, RunKey, RunSpend, Spend, StateQuery, Store,
};

/// One amount as `spent + held / max` (money in units, counts with
/// thousands separators); `-` for no cap.
fn cell(amount: Amount, caps: &Caps, spent: Spend, held: Spend) -> String {
    let f = |n: u64| match amount {
        Amount::CostMicros => micros(n),
        _ => thousands(n),
    };
    let max = caps.max(amount).map(f).unwrap_or_else(|| "-".into());
    format!("{} + {} / {max}", f(spent.get(amount)), f(held.get(amount)))
}

fn amount_headers(first: &[(&'static str, Align)]) -> Table {
    let mut h = first.to_vec();
    h.extend([
        ("COST spent + held / cap", Align::Right),
        ("TOKENS spent + held / cap", Align::Right),
        ("ITER spent + held / cap", Align::Right),
        ("HOLDS", Align::Right),
    ]);
    Table::new(&h)
}

fn amount_cells(caps: &Caps, spent: Spend, held: Spend, holds: u64) -> Vec<String> {
    let mut row: Vec<String> = Amount::ALL
        .iter()
        .map(|a| cell(*a, caps, spent, held))
        .collect();
    row.push(thousands(holds));
    row
}

/// `budgets list`.
pub fn list(
    store: &dyn Store,
    tenant: &str,
    page: &PageArgs,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let mut table = amount_headers(&[
        ("TENANT", Align::Left),
        ("BUDGET", Align::Left),
        ("VER", Align::Right),
    ]);
    let rest = walk(
        page,
        "budgets",
        |req| store.list_budgets(tenant, req),
        |items| {
            for b in items {
                if page.json {
                    json_line(out, &b)?;
                } else {
                    let mut row = vec![
                        b.record.key.tenant.clone(),
                        b.record.key.name.clone(),
                        b.record.version.to_string(),
                    ];
                    row.extend(amount_cells(&b.record.caps, b.spent, b.held, b.holds));
                    table.row(row);
                }
            }
            Ok(())
        },
    )?;
    finish(&table, "budgets", page.json, rest, out)
}

/// `budgets show NAME`: one budget and the runs that draw from it (found
/// by walking the tenant's runs).
pub fn show_budget(
    store: &dyn Store,
    tenant: &str,
    name: &str,
    json: bool,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let Some(b) = store.get_budget(&BudgetKey::new(tenant, name))? else {
        return Err(CliError::failed(format!(
            "no budget {tenant}/{name} (list them with `agentstate budgets list --tenant {tenant}`)"
        )));
    };
    let mut runs = Vec::new();
    for r in store.iter_runs(&StateQuery::new(tenant)).page_size(1000) {
        let r = r?;
        if r.budget.as_deref() == Some(name)
            && let Some(sp) = store.run_spend(&r.key)?
        {
            runs.push(sp);
        }
    }
    if json {
        /// `budgets show NAME --json`: the budget and the runs that draw
        /// from it.
        #[derive(serde::Serialize)]
        struct BudgetShow<'a> {
            budget: &'a BudgetStatus,
            runs: &'a [RunSpend],
        }
        return json_line(
            out,
            &BudgetShow {
                budget: &b,
                runs: &runs,
            },
        );
    }
    writeln!(out, "budget      {}", b.record.key)?;
    writeln!(out, "version     {}", b.record.version)?;
    for a in Amount::ALL {
        writeln!(out, "{a:<11} {}", cell(a, &b.record.caps, b.spent, b.held))?;
    }
    writeln!(out, "live holds  {}", thousands(b.holds))?;
    writeln!(out, "created     {}", format_time(b.record.created_at))?;
    writeln!(out, "updated     {}", format_time(b.record.updated_at))?;
    writeln!(out)?;
    if runs.is_empty() {
        writeln!(out, "no runs draw from it")?;
        return Ok(());
    }
    let mut t = amount_headers(&[("RUN", Align::Left)]);
    for r in &runs {
        let mut row = vec![r.key.run_id.clone()];
        row.extend(amount_cells(&r.caps, r.spent, r.held, r.holds.len() as u64));
        t.row(row);
    }
    writeln!(out, "runs drawing from it (their own caps):")?;
    t.print(out)?;
    Ok(())
}

/// `budgets show --run RUN`: one run's caps, spent, held and holds.
pub fn show_run(
    store: &dyn Store,
    tenant: &str,
    run_id: &str,
    json: bool,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let Some(r) = store.run_spend(&RunKey::new(tenant, run_id))? else {
        return Err(CliError::failed(format!(
            "no run {tenant}/{run_id} (list them with `agentstate runs list --tenant {tenant}`)"
        )));
    };
    if json {
        return json_line(out, &r);
    }
    writeln!(out, "run         {}", r.key)?;
    writeln!(out, "budget      {}", r.budget.as_deref().unwrap_or("-"))?;
    for a in Amount::ALL {
        writeln!(out, "{a:<11} {}", cell(a, &r.caps, r.spent, r.held))?;
    }
    if r.holds.is_empty() {
        writeln!(out, "live holds  none")?;
        return Ok(());
    }
    writeln!(out, "live holds  {}", r.holds.len())?;
    for h in &r.holds {
        writeln!(
            out,
            "  {}  cost {}  tokens {}  iterations {}  expires {}",
            h.id,
            micros(h.amounts.cost_micros),
            thousands(h.amounts.tokens),
            thousands(h.amounts.iterations),
            format_time(h.expires_at)
        )?;
    }
    Ok(())
}
