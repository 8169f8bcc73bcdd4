//! The read, check and retention commands.

use std::io::Write;

use super::output::{Align, Progress, Table, bytes, json_line, micros, thousands, with_spinner};
use super::time::{format_span, format_time, now_millis};
use super::{CliError, PageArgs};
use agentstate::{
    Cursor, InstanceKey, Millis, PageRequest, RunKey, RunRecord, RunState, SessionKey,
    SessionRecord, StateError, StateQuery, Store, Tray, TrayKey, VerifyReport,
};

/// The filters of `runs list`.
pub struct RunFilter {
    pub tenant: Option<String>,
    pub state: Option<RunState>,
    pub session: Option<String>,
    pub agent: Option<String>,
    pub updated_before: Option<Millis>,
}

/// Walks a paged listing: `fetch(request)` returns one page. Stops after
/// the first page unless `--all`, and then returns the cursor to go on
/// from. Hands each page's items to `each`.
pub(super) fn walk<T>(
    page: &PageArgs,
    what: &str,
    mut fetch: impl FnMut(&PageRequest) -> agentstate::Result<agentstate::Page<T>>,
    mut each: impl FnMut(Vec<T>) -> Result<(), CliError>,
) -> Result<Option<Cursor>, CliError> {
    let mut cursor = page.cursor.clone().map(Cursor::from_text);
    let mut progress = Progress::new(what);
    let rest = loop {
        let req = PageRequest::new(usize::from(page.limit)).with_cursor(cursor.take());
        let (items, next) = fetch(&req)?.into_parts();
        progress.inc(items.len() as u64);
        each(items)?;
        match next {
            Some(c) if page.all => cursor = Some(c),
            other => break other,
        }
    };
    progress.finish();
    Ok(rest)
}

/// Prints the table (unless JSON went out line by line), then, on stderr
/// and after the listing, how to get the next page.
pub(super) fn finish(
    table: &Table,
    what: &str,
    json: bool,
    rest: Option<Cursor>,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    if !json {
        if table.is_empty() {
            writeln!(out, "no {what}")?;
        } else {
            table.print(out)?;
        }
    }
    if let Some(c) = rest {
        out.flush()?;
        eprintln!("more {what}: add --cursor {c} for the next page, or --all");
    }
    Ok(())
}

fn run_table() -> Table {
    Table::new(&[
        ("TENANT", Align::Left),
        ("RUN", Align::Left),
        ("STATE", Align::Left),
        ("AGENT", Align::Left),
        ("SESSION", Align::Left),
        ("VER", Align::Right),
        ("MSGS", Align::Right),
        ("TOOLS", Align::Right),
        ("ITER", Align::Right),
        ("COST", Align::Right),
        ("UPDATED", Align::Left),
    ])
}

fn run_row(t: &mut Table, r: &RunRecord) {
    t.row(vec![
        r.key.tenant.clone(),
        r.key.run_id.clone(),
        r.state.as_str().to_string(),
        r.agent_name.clone(),
        r.session_id.clone().unwrap_or_else(|| "-".into()),
        r.version.to_string(),
        r.messages_read.to_string(),
        r.pending_tool_calls.len().to_string(),
        r.iterations.to_string(),
        micros(r.cost_micros),
        format_time(r.updated_at),
    ]);
}

/// `runs list`.
pub fn runs_list(
    store: &dyn Store,
    f: RunFilter,
    page: &PageArgs,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let tenants: Vec<String> = match &f.tenant {
        Some(t) => vec![t.clone()],
        None => {
            if page.cursor.is_some() {
                return Err(CliError::usage(
                    "--cursor needs --tenant (a cursor belongs to one tenant's listing)",
                ));
            }
            with_spinner("finding tenants", || store.stats())?
                .tenants
                .into_keys()
                .collect()
        }
    };
    let mut table = run_table();
    let limit = usize::from(page.limit);
    let mut shown = 0usize;
    for tenant in &tenants {
        let mut q = StateQuery::new(tenant.clone());
        q.state = f.state;
        q.session = f.session.clone();
        q.agent = f.agent.clone();
        q.updated_before = f.updated_before;
        if f.tenant.is_some() {
            let rest = walk(
                page,
                "runs",
                |req| store.list_runs(&q, req),
                |items| emit_runs(&items, page.json, &mut table, out),
            )?;
            return finish(&table, "runs", page.json, rest, out);
        }
        // Every tenant: `--limit` caps the whole listing unless `--all`.
        let mut cursor: Option<Cursor> = None;
        loop {
            if !page.all && shown >= limit {
                finish(&table, "runs", page.json, None, out)?;
                out.flush()?;
                eprintln!("more runs: narrow with --tenant, or add --all");
                return Ok(());
            }
            let want = if page.all { limit } else { limit - shown };
            let (items, next) = store
                .list_runs(&q, &PageRequest::new(want).with_cursor(cursor))?
                .into_parts();
            shown += items.len();
            emit_runs(&items, page.json, &mut table, out)?;
            match next {
                Some(c) => cursor = Some(c),
                None => break,
            }
        }
    }
    finish(&table, "runs", page.json, None, out)
}

fn emit_runs(
    items: &[RunRecord],
    json: bool,
    table: &mut Table,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    for r in items {
        if json {
            json_line(out, r)?;
        } else {
            run_row(table, r);
        }
    }
    Ok(())
}

/// `runs show`.
pub fn runs_show(
    store: &dyn Store,
    tenant: &str,
    run_id: &str,
    json: bool,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let key = RunKey::new(tenant, run_id);
    let Some(r) = store.get_run(&key)? else {
        return Err(CliError::failed(format!(
            "no run {tenant}/{run_id} (list them with `agentstate runs list --tenant {tenant}`)"
        )));
    };
    if json {
        return json_line(out, &r);
    }
    let now = now_millis();
    let ago = |t: Millis| {
        format!(
            "{} ({} ago)",
            format_time(t),
            format_span(now.saturating_sub(t))
        )
    };
    writeln!(out, "run            {}", r.key)?;
    writeln!(out, "state          {}", r.state)?;
    writeln!(out, "agent          {}", r.agent_name)?;
    writeln!(
        out,
        "session        {}",
        r.session_id.as_deref().unwrap_or("-")
    )?;
    writeln!(out, "version        {}", r.version)?;
    writeln!(out, "seq            {}", r.seq)?;
    writeln!(out, "messages read  {}", r.messages_read)?;
    writeln!(out, "iterations     {}", r.iterations)?;
    writeln!(
        out,
        "usage          {} input + {} output tokens",
        thousands(r.usage.input_tokens),
        thousands(r.usage.output_tokens)
    )?;
    writeln!(
        out,
        "cost           {} ({} micros)",
        micros(r.cost_micros),
        thousands(r.cost_micros)
    )?;
    writeln!(out, "budget         {}", r.budget.as_deref().unwrap_or("-"))?;
    let cap = |c: Option<u64>, money: bool| match c {
        None => "-".to_string(),
        Some(n) if money => micros(n),
        Some(n) => thousands(n),
    };
    writeln!(
        out,
        "caps           cost {}, tokens {}, iterations {} (agentstate budgets show --run for held)",
        cap(r.caps.cost_micros_max, true),
        cap(r.caps.tokens_max, false),
        cap(r.caps.iterations_max, false)
    )?;
    writeln!(out, "created        {}", ago(r.created_at))?;
    writeln!(out, "updated        {}", ago(r.updated_at))?;
    match &r.approval {
        Some(a) => writeln!(out, "approval       {}: {}", a.id, a.prompt)?,
        None => writeln!(out, "approval       -")?,
    }
    if r.mid_tool_call() {
        writeln!(
            out,
            "pending tool calls ({}), the run stopped mid tool call:",
            r.pending_tool_calls.len()
        )?;
        for c in &r.pending_tool_calls {
            writeln!(out, "  {}  {}({})", c.id, c.name, c.arguments)?;
        }
    } else {
        writeln!(out, "pending tool calls: none")?;
    }
    Ok(())
}

fn session_table() -> Table {
    Table::new(&[
        ("TENANT", Align::Left),
        ("SESSION", Align::Left),
        ("VER", Align::Right),
        ("CREATED", Align::Left),
        ("UPDATED", Align::Left),
        ("METADATA", Align::Left),
    ])
}

fn metadata(s: &SessionRecord) -> String {
    s.metadata
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// `sessions list`.
pub fn sessions_list(
    store: &dyn Store,
    tenant: &str,
    page: &PageArgs,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let mut table = session_table();
    let rest = walk(
        page,
        "sessions",
        |req| store.list_sessions(tenant, req),
        |items| {
            for s in items {
                if page.json {
                    json_line(out, &s)?;
                } else {
                    table.row(vec![
                        s.key.tenant.clone(),
                        s.key.session_id.clone(),
                        s.version.to_string(),
                        format_time(s.created_at),
                        format_time(s.updated_at),
                        metadata(&s),
                    ]);
                }
            }
            Ok(())
        },
    )?;
    finish(&table, "sessions", page.json, rest, out)
}

/// Every run of a session, walking the session index.
fn session_runs(
    store: &dyn Store,
    tenant: &str,
    session_id: &str,
) -> Result<Vec<RunRecord>, CliError> {
    let q = StateQuery::new(tenant).session(session_id);
    Ok(store
        .iter_runs(&q)
        .page_size(1000)
        .collect::<agentstate::Result<Vec<_>>>()?)
}

/// `sessions show`.
pub fn sessions_show(
    store: &dyn Store,
    tenant: &str,
    session_id: &str,
    json: bool,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let Some(s) = store.get_session(&SessionKey::new(tenant, session_id))? else {
        return Err(CliError::failed(format!(
            "no session {tenant}/{session_id} (list them with `agentstate sessions list --tenant {tenant}`)"
        )));
    };
    let runs = session_runs(store, tenant, session_id)?;
    if json {
        /// `sessions show --json`: the session and its runs.
        #[derive(serde::Serialize)]
        struct SessionShow<'a> {
            session: &'a SessionRecord,
            runs: &'a [RunRecord],
        }
        return json_line(
            out,
            &SessionShow {
                session: &s,
                runs: &runs,
            },
        );
    }
    writeln!(out, "session   {}", s.key)?;
    writeln!(out, "version   {}", s.version)?;
    writeln!(out, "created   {}", format_time(s.created_at))?;
    writeln!(out, "updated   {}", format_time(s.updated_at))?;
    writeln!(
        out,
        "metadata  {}",
        if s.metadata.is_empty() {
            "-".to_string()
        } else {
            metadata(&s)
        }
    )?;
    let unfinished = runs.iter().filter(|r| !r.state.is_finished()).count();
    writeln!(out, "runs      {} ({unfinished} unfinished)", runs.len())?;
    if !runs.is_empty() {
        writeln!(out)?;
        let mut t = run_table();
        for r in &runs {
            run_row(&mut t, r);
        }
        t.print(out)?;
    }
    Ok(())
}

/// Up to ten run ids, then how many more.
fn name_runs(runs: &[RunKey]) -> String {
    let mut s: Vec<&str> = runs.iter().take(10).map(|k| k.run_id.as_str()).collect();
    let more = runs.len().saturating_sub(10);
    let tail = format!("and {more} more");
    if more > 0 {
        s.push(&tail);
    }
    s.join(", ")
}

/// `sessions delete`.
pub fn sessions_delete(
    store: &dyn Store,
    tenant: &str,
    session_id: &str,
    cascade: bool,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    match store.delete_session(&SessionKey::new(tenant, session_id), cascade) {
        Ok(runs) if runs.is_empty() => writeln!(out, "deleted session {tenant}/{session_id}")?,
        Ok(runs) => writeln!(
            out,
            "deleted session {tenant}/{session_id} and its {} run(s): {}",
            runs.len(),
            name_runs(&runs)
        )?,
        Err(StateError::InUse { runs, .. }) => {
            return Err(CliError::failed(format!(
                "session {tenant}/{session_id} has {} unfinished run(s): {} (finish them first, or pass --cascade to delete them with it)",
                runs.len(),
                name_runs(&runs)
            )));
        }
        Err(StateError::NotFound(_)) => {
            return Err(CliError::failed(format!(
                "no session {tenant}/{session_id}"
            )));
        }
        Err(e) => return Err(e.into()),
    }
    Ok(())
}

/// A line of `trays list --json`: the tray's key and the tray, in their
/// own JSON shapes (the doc as text, or `doc_base64`), as an export's
/// `tray` entry has them.
#[derive(serde::Serialize)]
struct TrayLine<'a> {
    key: &'a TrayKey,
    tray: &'a Tray,
}

fn doc_preview(doc: &[u8]) -> String {
    match std::str::from_utf8(doc) {
        Ok(t) => {
            let t: String = t
                .chars()
                .map(|c| if c.is_control() { ' ' } else { c })
                .collect();
            if t.chars().count() > 40 {
                format!("{}…", t.chars().take(40).collect::<String>())
            } else {
                t
            }
        }
        Err(_) => "(binary)".into(),
    }
}

/// `trays list`.
pub fn trays_list(
    store: &dyn Store,
    ns: &str,
    id: &str,
    epoch: Option<u64>,
    page: &PageArgs,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let instance = InstanceKey::new(ns, id);
    let stored = store.epoch(&instance)?;
    let epoch = match epoch {
        Some(e) if e > stored => {
            eprintln!(
                "note: {ns}/{id} now at epoch {e} (was {stored}); its holder at epoch {stored} is fenced out"
            );
            e
        }
        Some(e) => e,
        None => stored,
    };
    let mut table = Table::new(&[
        ("TRAY_NS", Align::Left),
        ("TRAY_ID", Align::Left),
        ("MARKED", Align::Left),
        ("ENV", Align::Left),
        ("HOST", Align::Left),
        ("BYTES", Align::Right),
        ("DOC", Align::Left),
    ]);
    let rest = walk(
        page,
        "trays",
        |req| store.list_trays(&instance, epoch, req),
        |items| {
            for (k, t) in items {
                if page.json {
                    json_line(out, &TrayLine { key: &k, tray: &t })?;
                } else {
                    table.row(vec![
                        k.tray_ns.clone(),
                        k.tray_id.clone(),
                        if t.marked { "yes" } else { "no" }.into(),
                        t.env.clone(),
                        t.hostname.clone(),
                        t.doc.len().to_string(),
                        doc_preview(&t.doc),
                    ]);
                }
            }
            Ok(())
        },
    )?;
    finish(&table, "trays", page.json, rest, out)
}

/// `trays marked`.
pub fn trays_marked(
    store: &dyn Store,
    env: Option<&str>,
    page: &PageArgs,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let mut table = Table::new(&[
        ("NS", Align::Left),
        ("ID", Align::Left),
        ("TRAY_NS", Align::Left),
        ("TRAY_ID", Align::Left),
        ("ENV", Align::Left),
        ("HOST", Align::Left),
    ]);
    let rest = walk(
        page,
        "marked trays",
        |req| store.marked_trays(env, req),
        |items| {
            for m in items {
                if page.json {
                    json_line(out, &m)?;
                } else {
                    table.row(vec![
                        m.key.ns,
                        m.key.id,
                        m.key.tray_ns,
                        m.key.tray_id,
                        m.env,
                        m.hostname,
                    ]);
                }
            }
            Ok(())
        },
    )?;
    finish(&table, "marked trays", page.json, rest, out)
}

/// `alarms due`.
pub fn alarms_due(
    store: &dyn Store,
    now: Millis,
    page: &PageArgs,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let mut table = Table::new(&[
        ("NS", Align::Left),
        ("ID", Align::Left),
        ("DUE_AT", Align::Left),
        ("OVERDUE", Align::Right),
    ]);
    let rest = walk(
        page,
        "due alarms",
        |req| store.due_alarms(now, req),
        |items| {
            for a in items {
                if page.json {
                    json_line(out, &a)?;
                } else {
                    table.row(vec![
                        a.instance.ns,
                        a.instance.id,
                        format_time(a.due_at),
                        format_span(now.saturating_sub(a.due_at)),
                    ]);
                }
            }
            Ok(())
        },
    )?;
    finish(&table, "due alarms", page.json, rest, out)
}

/// `stats`.
pub fn stats(store: &dyn Store, json: bool, out: &mut dyn Write) -> Result<(), CliError> {
    let s = with_spinner("counting", || store.stats())?;
    if json {
        return json_line(out, &s);
    }
    let mut t = Table::new(&[
        ("TENANT", Align::Left),
        ("PENDING", Align::Right),
        ("RUNNING", Align::Right),
        ("AWAITING", Align::Right),
        ("PAUSED", Align::Right),
        ("COMPLETED", Align::Right),
        ("FAILED", Align::Right),
        ("CANCELLED", Align::Right),
        ("RUNS", Align::Right),
        ("SESSIONS", Align::Right),
        ("BUDGETS", Align::Right),
        ("HOLDS", Align::Right),
        ("AT CAP", Align::Right),
    ]);
    let (mut runs, mut sessions, mut at_cap) = (0u64, 0u64, 0u64);
    for (tenant, ts) in &s.tenants {
        let mut row = vec![tenant.clone()];
        row.extend(
            RunState::ALL
                .iter()
                .map(|st| thousands(ts.runs_by_state.get(st).copied().unwrap_or(0))),
        );
        let n: u64 = ts.runs_by_state.values().sum();
        row.push(thousands(n));
        row.push(thousands(ts.sessions));
        row.push(thousands(ts.budgets));
        row.push(thousands(ts.holds));
        row.push(thousands(ts.runs_at_cap));
        runs += n;
        sessions += ts.sessions;
        at_cap += ts.runs_at_cap;
        t.row(row);
    }
    if t.is_empty() {
        writeln!(out, "no runs or sessions")?;
    } else {
        t.print(out)?;
    }
    writeln!(out)?;
    writeln!(out, "tenants   {}", thousands(s.tenants.len() as u64))?;
    writeln!(out, "runs      {}", thousands(runs))?;
    writeln!(out, "sessions  {}", thousands(sessions))?;
    // Counted from the committed state: a refused reserve writes nothing,
    // so the runs at their cap are the runs that refuse now.
    writeln!(
        out,
        "at cap    {} run(s) at a cap of their own or their budget's (a reserve of that amount is refused now)",
        thousands(at_cap)
    )?;
    writeln!(
        out,
        "trays     {} ({} marked)",
        thousands(s.trays),
        thousands(s.marked_trays)
    )?;
    writeln!(out, "alarms    {}", thousands(s.alarms))?;
    writeln!(
        out,
        "disk      {} ({} bytes)",
        bytes(s.disk_bytes),
        thousands(s.disk_bytes)
    )?;
    writeln!(out, "backend   {}", s.backend)?;
    Ok(())
}

/// `verify`: exit 1 when anything is wrong.
pub fn verify(store: &dyn Store, json: bool, out: &mut dyn Write) -> Result<(), CliError> {
    let r = with_spinner("verifying", || store.verify())?;
    if json {
        /// `verify --json`: the report, and whether it found nothing wrong.
        #[derive(serde::Serialize)]
        struct VerifyLine<'a> {
            ok: bool,
            #[serde(flatten)]
            report: &'a VerifyReport,
        }
        json_line(
            out,
            &VerifyLine {
                ok: r.is_ok(),
                report: &r,
            },
        )?;
    } else {
        writeln!(
            out,
            "checked {} runs, {} sessions, {} trays, {} alarms ({} entries read)",
            thousands(r.runs),
            thousands(r.sessions),
            thousands(r.trays),
            thousands(r.alarms),
            thousands(r.entries)
        )?;
        for p in &r.problems {
            writeln!(out, "problem: {p}")?;
        }
        if r.is_ok() {
            writeln!(out, "ok: no problems found")?;
        }
    }
    if r.is_ok() {
        Ok(())
    } else {
        Err(CliError::failed(format!(
            "verify found {} problem(s) (listed above); restore the store from a backup, or export what reads well and import it into a new store",
            r.problems.len()
        )))
    }
}

/// `prune`.
pub fn prune(
    store: &dyn Store,
    tenant: &str,
    finished_before: Millis,
    dry_run: bool,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let when = format_time(finished_before);
    if dry_run {
        let mut n = 0u64;
        for state in RunState::ALL.into_iter().filter(|s| s.is_finished()) {
            let q = StateQuery::new(tenant)
                .state(state)
                .updated_before(finished_before);
            for r in store.iter_runs(&q).page_size(1000) {
                r?;
                n += 1;
            }
        }
        writeln!(
            out,
            "would prune {} finished run(s) of {tenant} last written before {when} (dry run: nothing deleted)",
            thousands(n)
        )?;
        return Ok(());
    }
    let n = with_spinner("pruning", || store.prune(tenant, finished_before))?;
    writeln!(
        out,
        "pruned {} finished run(s) of {tenant} last written before {when}",
        thousands(n)
    )?;
    Ok(())
}
