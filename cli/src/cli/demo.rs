//! `agentstate demo`: a short multi-worker workload on the file store that
//! shows, with real threads and real syncs, what the store guarantees.

use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Barrier;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::Instant;

use agentstate::{
    Approval, FileStore, InstanceKey, PageRequest, RunKey, RunRecord, RunState, SessionKey,
    SessionRecord, StateDelta, StateError, StateQuery, StateStore, StoreAdmin, ToolCall, Tray,
    TrayOp, TrayStore, Usage,
};

use super::output::{micros, thousands};
use super::time::{format_time, now_millis};
use super::{Cli, CliError};

const TENANT: &str = "acme";
/// Workers of the spend section, and the patches each applies.
const SPEND_WORKERS: u64 = 4;
const SPEND_PATCHES: u64 = 200;
const SPEND_COST_MICROS: u64 = 1_250;
/// Instances of the sweeper section, three trays each.
const INSTANCES: usize = 40;
/// Runs created before the listing walk, and during it.
const RUNS_BEFORE: usize = 60;
const RUNS_DURING: usize = 20;
const PAGE: usize = 16;
const RUNS_PER_PAGE: usize = 5;

/// A listing walk: each page's size, and each run seen with its seq.
type Walked = (Vec<usize>, Vec<(String, u64)>);

/// The store plus what the demo counts.
struct Demo {
    store: FileStore,
    ops: AtomicU64,
    writes: AtomicU64,
    conflicts: AtomicU64,
}

impl Demo {
    /// A write: counted as an op, and as a durable write when acknowledged.
    fn w<T>(&self, f: impl FnOnce(&FileStore) -> agentstate::Result<T>) -> agentstate::Result<T> {
        self.ops.fetch_add(1, Ordering::Relaxed);
        let r = f(&self.store);
        if r.is_ok() {
            self.writes.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    /// A read.
    fn r<T>(&self, f: impl FnOnce(&FileStore) -> agentstate::Result<T>) -> agentstate::Result<T> {
        self.ops.fetch_add(1, Ordering::Relaxed);
        f(&self.store)
    }

    fn resolved_conflict(&self) {
        self.conflicts.fetch_add(1, Ordering::Relaxed);
    }
}

/// Fails the demo: what it showed did not happen. A bug in the store.
fn broken(what: impl std::fmt::Display) -> CliError {
    CliError::failed(format!(
        "demo: {what} — the store broke a promise; please report this"
    ))
}

/// Removes the demo's temporary store when the demo ends, however it ends.
struct TempStore(Option<PathBuf>);

impl Drop for TempStore {
    fn drop(&mut self) {
        if let Some(p) = &self.0 {
            let _ = std::fs::remove_dir_all(p);
        }
    }
}

fn temp_path() -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    std::env::temp_dir().join(format!("agentstate-demo-{}-{nanos:09}", std::process::id()))
}

/// `agentstate demo [--db PATH]`.
pub fn run(cli: &Cli, out: &mut dyn Write) -> Result<(), CliError> {
    let started = Instant::now();
    let db = cli.db.as_deref().map(super::open::DbSpec::parse);
    let (path, temp) = match &db {
        Some(super::open::DbSpec::Path(p)) => (p.clone(), TempStore(None)),
        Some(other) => {
            return Err(CliError::usage(format!(
                "demo: --db {} is not a directory; the demo runs on the embedded file store",
                other.display()
            )));
        }
        None => {
            let p = temp_path();
            (p.clone(), TempStore(Some(p)))
        }
    };
    let store = FileStore::open_with(&path, cli.options())?;
    if !store.is_empty()? {
        return Err(CliError::usage(format!(
            "store {} is not empty; the demo needs a new store (pick a new --db path, or none for a temporary one)",
            path.display()
        )));
    }
    let d = Demo {
        store,
        ops: AtomicU64::new(0),
        writes: AtomicU64::new(0),
        conflicts: AtomicU64::new(0),
    };
    let commits_before = d.r(|s| Ok(s.commits()))?;
    writeln!(
        out,
        "agentstate demo: workers sharing one file store at {}",
        path.display()
    )?;
    writeln!(
        out,
        "(durability: immediate, so every Ok below was synced to disk first)"
    )?;

    versions(&d, out)?;
    spend(&d, out)?;
    fencing(&d, out)?;
    alarms(&d, out)?;
    sweeper(&d, out)?;
    listing(&d, out)?;
    sessions(&d, out)?;

    section(out, "verify")?;
    let report = d.r(|s| s.verify())?;
    writeln!(
        out,
        "  checked {} runs, {} sessions, {} trays, {} alarms ({} entries): {}",
        report.runs,
        report.sessions,
        report.trays,
        report.alarms,
        thousands(report.entries),
        if report.is_ok() {
            "no problems".to_string()
        } else {
            format!("{} PROBLEMS", report.problems.len())
        }
    )?;
    for p in &report.problems {
        writeln!(out, "  problem: {p}")?;
    }

    let syncs = d.r(|s| Ok(s.commits()))? - commits_before;
    section(out, "summary")?;
    writeln!(
        out,
        "  {} ops, {} durable writes in {} synced groups, {} conflicts resolved, {:.2} s",
        thousands(d.ops.load(Ordering::Relaxed)),
        thousands(d.writes.load(Ordering::Relaxed)),
        thousands(syncs),
        d.conflicts.load(Ordering::Relaxed),
        started.elapsed().as_secs_f64()
    )?;
    drop(d);
    if temp.0.is_some() {
        writeln!(
            out,
            "  (the temporary store was removed; pass --db PATH to keep one and look around:"
        )?;
        writeln!(
            out,
            "   agentstate runs list --db PATH --tenant acme; agentstate stats --db PATH)"
        )?;
    } else {
        let p = path.display();
        writeln!(
            out,
            "  look around: agentstate runs list --db {p} --tenant acme; agentstate trays marked --db {p}"
        )?;
    }
    drop(temp);
    if !report.is_ok() {
        return Err(broken("verify found problems"));
    }
    Ok(())
}

fn section(out: &mut dyn Write, title: &str) -> Result<(), CliError> {
    out.flush()?;
    writeln!(out)?;
    writeln!(out, "{title}")?;
    Ok(())
}

/// Two workers race to create one run; a stale update is refused with
/// both versions, re-read and retried.
#[allow(clippy::expect_used, reason = "a demo worker panicked")]
fn versions(d: &Demo, out: &mut dyn Write) -> Result<(), CliError> {
    section(out, "versions: every write states the version it read")?;
    let mut meta = SessionRecord::new(SessionKey::new(TENANT, "s-1"));
    meta.metadata.insert("title".into(), "trip planning".into());
    d.w(|s| s.put_session(meta))?;
    let key = RunKey::new(TENANT, "run-1");
    let start = Barrier::new(2);
    let results: Vec<(&str, agentstate::Result<RunRecord>)> = thread::scope(|scope| {
        let racers: Vec<_> = ["worker-1", "worker-2"]
            .into_iter()
            .map(|name| {
                let (start, key) = (&start, key.clone());
                scope.spawn(move || {
                    start.wait();
                    (
                        name,
                        d.w(|s| s.put_run(RunRecord::new(key, "planner").with_session("s-1"))),
                    )
                })
            })
            .collect();
        racers
            .into_iter()
            .map(|h| h.join().expect("a demo worker panicked"))
            .collect()
    });
    writeln!(
        out,
        "  worker-1 and worker-2 race to create {TENANT}/run-1:"
    )?;
    let mut winners = 0;
    // The winner first, then the loser.
    let mut results = results;
    results.sort_by_key(|(_, r)| r.is_err());
    for (name, r) in &results {
        match r {
            Ok(run) => {
                winners += 1;
                writeln!(out, "    {name} created it at version {}", run.version)?;
            }
            Err(
                e @ StateError::Conflict {
                    expected: 0,
                    actual: 1,
                    ..
                },
            ) => {
                d.r(|s| s.get_run(&key))?
                    .ok_or_else(|| broken("the race's winner is not stored"))?;
                d.resolved_conflict();
                writeln!(
                    out,
                    "    {name} got \"{e}\": it re-reads the run and leaves it to the winner"
                )?;
            }
            Err(e) => return Err(broken(format!("{name} failed with {e}"))),
        }
    }
    if winners != 1 {
        return Err(broken(format!("{winners} workers created the same run")));
    }

    let a = d
        .r(|s| s.get_run(&key))?
        .ok_or_else(|| broken("run-1 vanished"))?;
    let mut b = a.clone();
    writeln!(
        out,
        "  worker-1 and worker-2 both read run-1 at version {}",
        a.version
    )?;
    b.state = RunState::Running;
    let b = d.w(|s| s.put_run(b))?;
    writeln!(
        out,
        "    worker-2 moved it to running: version {}",
        b.version
    )?;
    let call = ToolCall {
        id: "call-1".into(),
        name: "web_search".into(),
        arguments: r#"{"query":"flights to Lisbon","api_key":"sk-live-4f9a8b7c6d5e4f3a2b1c"}"#
            .into(),
    };
    let mut stale = a.clone();
    stale.pending_tool_calls.push(call.clone());
    match d.w(|s| s.put_run(stale)) {
        Err(
            e @ StateError::Conflict {
                expected: 1,
                actual: 2,
                ..
            },
        ) => {
            writeln!(out, "    worker-1's write from version 1 was refused: {e}")?;
        }
        other => return Err(broken(format!("a stale write was not refused: {other:?}"))),
    }
    let mut fresh = d
        .r(|s| s.get_run(&key))?
        .ok_or_else(|| broken("run-1 vanished"))?;
    fresh.pending_tool_calls.push(call);
    let fresh = d.w(|s| s.put_run(fresh))?;
    d.resolved_conflict();
    writeln!(
        out,
        "    worker-1 re-read version 2, kept worker-2's state ({}) and retried: version {}",
        fresh.state.as_str(),
        fresh.version
    )?;
    writeln!(
        out,
        "    its tool call as stored (arguments are scrubbed on every write): {}",
        fresh.pending_tool_calls[0].arguments
    )?;
    Ok(())
}

/// Four workers patch one run's spend; the sum is exact.
#[allow(clippy::expect_used, reason = "a demo worker panicked")]
fn spend(d: &Demo, out: &mut dyn Write) -> Result<(), CliError> {
    section(
        out,
        "spend: amounts move only through patches, which commute",
    )?;
    let key = RunKey::new(TENANT, "run-1");
    let before = d
        .r(|s| s.get_run(&key))?
        .ok_or_else(|| broken("run-1 vanished"))?;
    let commits = d.r(|s| Ok(s.commits()))?;
    let t = Instant::now();
    thread::scope(|scope| -> agentstate::Result<()> {
        let workers: Vec<_> = (0..SPEND_WORKERS)
            .map(|_| {
                let key = key.clone();
                scope.spawn(move || -> agentstate::Result<()> {
                    for _ in 0..SPEND_PATCHES {
                        let delta = StateDelta {
                            usage: Usage {
                                input_tokens: 200,
                                output_tokens: 100,
                            },
                            cost_micros: SPEND_COST_MICROS,
                            iterations: 1,
                            messages_read: 1,
                        };
                        d.w(|s| s.patch_run(&key, delta))?;
                    }
                    Ok(())
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|h| h.join().expect("a demo worker panicked"))
    })?;
    let elapsed = t.elapsed();
    let syncs = d.r(|s| Ok(s.commits()))? - commits;
    let after = d
        .r(|s| s.get_run(&key))?
        .ok_or_else(|| broken("run-1 vanished"))?;
    let n = SPEND_WORKERS * SPEND_PATCHES;
    let want_cost = before.cost_micros + n * SPEND_COST_MICROS;
    writeln!(
        out,
        "  {SPEND_WORKERS} workers x {SPEND_PATCHES} patches of {SPEND_COST_MICROS} micros, 300 tokens and one message each"
    )?;
    writeln!(
        out,
        "  cost {} = {} micros (expected {}), tokens {}, messages read {}, version {} = {} + {n} patches",
        micros(after.cost_micros),
        thousands(after.cost_micros),
        thousands(want_cost),
        thousands(after.usage.input_tokens + after.usage.output_tokens),
        after.messages_read,
        after.version,
        before.version
    )?;
    writeln!(
        out,
        "  {n} durable patches in {:.2} s, sharing {syncs} syncs (group commit)",
        elapsed.as_secs_f64()
    )?;
    if after.cost_micros != want_cost
        || after.version != before.version + n
        || after.messages_read != before.messages_read + n
    {
        return Err(broken("patches did not add up"));
    }
    Ok(())
}

fn tray(doc: &str, marked: bool, env: &str, host: &str) -> Tray {
    Tray {
        marked,
        doc: doc.as_bytes().to_vec(),
        env: env.into(),
        hostname: host.into(),
    }
}

/// A newer worker takes an instance over; the old one is fenced out.
fn fencing(d: &Demo, out: &mut dyn Write) -> Result<(), CliError> {
    section(
        out,
        "fencing: every tray operation carries the worker's epoch",
    )?;
    let instance = InstanceKey::new("chat", "room-42");
    let key = instance.tray("state", "main");
    d.w(|s| s.write_tray(&key, 1, tray("draft from worker-1", true, "prod", "host-a")))?;
    writeln!(
        out,
        "  worker-1 (epoch 1) wrote tray chat/room-42/state/main and marked it in flight"
    )?;
    let seen = d
        .w(|s| s.read_tray(&key, 2))?
        .ok_or_else(|| broken("worker-1's tray is not stored"))?;
    writeln!(
        out,
        "  worker-2 took chat/room-42 over at epoch 2 and read worker-1's tray: {:?}",
        String::from_utf8_lossy(&seen.doc)
    )?;
    d.w(|s| {
        s.write_tray(
            &key,
            2,
            tray("taken over by worker-2", true, "prod", "host-b"),
        )
    })?;
    match d.w(|s| {
        s.write_tray(
            &key,
            1,
            tray("late write from worker-1", true, "prod", "host-a"),
        )
    }) {
        Err(
            e @ StateError::FenceLost {
                caller: 1,
                stored: 2,
                ..
            },
        ) => {
            writeln!(out, "  worker-1's late write was refused: {e}")?;
        }
        other => return Err(broken(format!("a stale epoch was not fenced: {other:?}"))),
    }
    d.w(|s| s.release(&instance, 1))?;
    let now = d
        .w(|s| s.read_tray(&key, 2))?
        .ok_or_else(|| broken("the tray vanished"))?;
    if now.doc != b"taken over by worker-2" || !now.marked {
        return Err(broken("a fenced worker changed the tray"));
    }
    writeln!(
        out,
        "  worker-1's release at epoch 1 is a no-op: the tray still holds {:?}, marked",
        String::from_utf8_lossy(&now.doc)
    )?;
    Ok(())
}

/// An alarm is set, comes due, and is acknowledged.
fn alarms(d: &Demo, out: &mut dyn Write) -> Result<(), CliError> {
    section(out, "alarms: one per instance, due until acknowledged")?;
    let instance = InstanceKey::new("chat", "room-42");
    let due_at = now_millis();
    d.w(|s| s.set_alarm(&instance, 2, due_at))?;
    writeln!(
        out,
        "  worker-2 set chat/room-42's alarm for {}",
        format_time(due_at)
    )?;
    let due = d.r(|s| s.due_alarms(now_millis(), &PageRequest::new(10)))?;
    let names: Vec<String> = due.items().iter().map(|a| a.instance.to_string()).collect();
    writeln!(out, "  due now: {}", names.join(", "))?;
    if !d.w(|s| s.ack_alarm(&instance, 2, due_at))? {
        return Err(broken("the alarm's ack removed nothing"));
    }
    let left = d.r(|s| s.due_alarms(now_millis(), &PageRequest::new(10)))?;
    writeln!(
        out,
        "  acknowledged after its work was done; due now: {}",
        if left.items().is_empty() {
            "none"
        } else {
            "some"
        }
    )?;
    if !left.items().is_empty() || names.len() != 1 {
        return Err(broken("alarms did not come due and go exactly once"));
    }
    Ok(())
}

/// Many instances mark trays; the sweeper pages through them.
#[allow(clippy::expect_used, reason = "a demo worker panicked")]
fn sweeper(d: &Demo, out: &mut dyn Write) -> Result<(), CliError> {
    section(out, "sweeper: marked trays of every instance, page by page")?;
    let env_of = |i: usize| {
        if i.is_multiple_of(4) {
            "staging"
        } else {
            "prod"
        }
    };
    thread::scope(|scope| -> agentstate::Result<()> {
        let workers: Vec<_> = (0..4)
            .map(|w| {
                scope.spawn(move || -> agentstate::Result<()> {
                    for i in (w..INSTANCES).step_by(4) {
                        let instance = InstanceKey::new("workers", format!("w-{i:03}"));
                        let host = format!("host-{w}");
                        let put = |ns: &str, marked: bool| TrayOp::Put {
                            tray_ns: ns.into(),
                            tray_id: "0".into(),
                            tray: tray(&format!("{ns} of w-{i:03}"), marked, env_of(i), &host),
                        };
                        let ops = vec![
                            put("inbox", true),
                            put("outbox", i.is_multiple_of(2)),
                            put("state", false),
                        ];
                        d.w(|s| s.apply_batch(&instance, 1, ops))?;
                    }
                    Ok(())
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|h| h.join().expect("a demo worker panicked"))
    })?;
    // Plus chat/room-42's tray from the fencing section.
    let marked_all = INSTANCES + INSTANCES / 2 + 1;
    let marked_staging = (0..INSTANCES)
        .filter(|i| i.is_multiple_of(4))
        .map(|i| if i.is_multiple_of(2) { 2 } else { 1 })
        .sum::<usize>();
    writeln!(
        out,
        "  {INSTANCES} instances each wrote 3 trays in one atomic batch, 1 or 2 of them marked (envs prod and staging)"
    )?;
    for (env, want) in [(None, marked_all), (Some("staging"), marked_staging)] {
        let mut seen = HashSet::new();
        let mut pages = Vec::new();
        let mut cursor = None;
        loop {
            let (items, next) = d
                .r(|s| s.marked_trays(env, &PageRequest::new(PAGE).after(cursor.as_ref())))?
                .into_parts();
            pages.push(items.len().to_string());
            for m in items {
                if !seen.insert(m.key) {
                    return Err(broken("the sweeper saw a tray twice"));
                }
            }
            match next {
                Some(c) => cursor = Some(c),
                None => break,
            }
        }
        writeln!(
            out,
            "  walked {} {PAGE} a page: pages of {} -> {} trays, each exactly once",
            env.map(|e| format!("the marked trays of {e}"))
                .unwrap_or_else(|| "every marked tray".into()),
            pages.join(", "),
            seen.len()
        )?;
        if seen.len() != want {
            return Err(broken(format!(
                "the sweeper found {} marked trays, not {want}",
                seen.len()
            )));
        }
    }
    Ok(())
}

/// A listing walk, while another worker creates runs.
#[allow(clippy::expect_used, reason = "a demo worker panicked")]
fn listing(d: &Demo, out: &mut dyn Write) -> Result<(), CliError> {
    section(out, "listings: walk a tenant's runs while others write")?;
    const STATES: [RunState; 5] = [
        RunState::Running,
        RunState::Completed,
        RunState::Pending,
        RunState::AwaitingApproval,
        RunState::Failed,
    ];
    thread::scope(|scope| -> agentstate::Result<()> {
        let workers: Vec<_> = (0..4)
            .map(|w| {
                scope.spawn(move || -> agentstate::Result<()> {
                    for i in (w..RUNS_BEFORE).step_by(4) {
                        let mut r = RunRecord::new(
                            RunKey::new(TENANT, format!("job-{i:03}")),
                            "researcher",
                        )
                        .with_session("s-1");
                        r.state = STATES[i % STATES.len()];
                        if r.state == RunState::AwaitingApproval {
                            r.approval = Some(Approval {
                                id: format!("ap-{i}"),
                                prompt: "book the flight?".into(),
                            });
                        }
                        d.w(|s| s.put_run(r))?;
                    }
                    Ok(())
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|h| h.join().expect("a demo worker panicked"))
    })?;
    // Every run that exists before the walk, by seq.
    let mut before = BTreeMap::new();
    let all = StateQuery::new(TENANT);
    for r in d.store.iter_runs(&all).page_size(1000) {
        let r = r?;
        before.insert(r.key.run_id, r.seq);
    }
    writeln!(
        out,
        "  4 workers created {RUNS_BEFORE} runs of session s-1 in five states"
    )?;

    // Between two pages of the walk, another worker creates runs and
    // updates earlier ones: the walk still sees each earlier run once.
    let (go_tx, go_rx) = std::sync::mpsc::channel::<usize>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<agentstate::Result<()>>();
    let earlier: Vec<String> = before.keys().cloned().collect();
    let (pages, seen) = thread::scope(|scope| -> agentstate::Result<Walked> {
        let earlier = &earlier;
        scope.spawn(move || {
            let mut created = 0;
            for page in go_rx {
                let mut step = || -> agentstate::Result<()> {
                    for _ in 0..RUNS_PER_PAGE {
                        let mut r = RunRecord::new(
                            RunKey::new(TENANT, format!("late-{created:03}")),
                            "researcher",
                        );
                        r.state = RunState::Completed;
                        d.w(|s| s.put_run(r))?;
                        created += 1;
                    }
                    let k = RunKey::new(TENANT, earlier[page * 7 % earlier.len()].clone());
                    let mut r = d.r(|s| s.get_run(&k))?.ok_or_else(|| StateError::Invalid {
                        what: "a run vanished".into(),
                    })?;
                    // R9: a finished run stays finished (the put still
                    // moves its `updated_at`).
                    r.state = if r.state.is_finished() {
                        r.state
                    } else if r.state == RunState::Paused {
                        RunState::Running
                    } else {
                        RunState::Paused
                    };
                    d.w(|s| s.put_run(r))?;
                    Ok(())
                };
                let _ = done_tx.send(step());
            }
        });
        let mut pages = Vec::new();
        let mut seen = Vec::new();
        let q = StateQuery::new(TENANT);
        let mut req = PageRequest::new(PAGE);
        loop {
            let (items, next) = d.r(|s| s.list_runs(&q, &req))?.into_parts();
            pages.push(items.len());
            seen.extend(items.into_iter().map(|r| (r.key.run_id, r.seq)));
            match next {
                Some(c) => req = req.with_cursor(Some(c)),
                None => break,
            }
            if pages.len() * RUNS_PER_PAGE <= RUNS_DURING {
                let _ = go_tx.send(pages.len());
                done_rx.recv().map_err(|_| StateError::Invalid {
                    what: "the demo writer stopped".into(),
                })??;
            }
        }
        drop(go_tx);
        Ok((pages, seen))
    })?;
    let ids: HashSet<&str> = seen.iter().map(|(id, _)| id.as_str()).collect();
    let in_order = seen.windows(2).all(|w| w[0].1 < w[1].1);
    let old_seen = before.keys().filter(|id| ids.contains(id.as_str())).count();
    let new_seen = ids.len() - old_seen;
    writeln!(
        out,
        "  walked {TENANT}'s runs {PAGE} a page; after each page worker-4 created {RUNS_PER_PAGE} runs and updated one: {} pages ({})",
        pages.len(),
        pages
            .iter()
            .map(|n| n.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )?;
    writeln!(
        out,
        "  all {} earlier runs seen exactly once, in seq order; {new_seen} of the new runs seen once each, after them",
        before.len()
    )?;
    if ids.len() != seen.len() || old_seen != before.len() || !in_order {
        return Err(broken("a listing walk skipped, repeated or reordered runs"));
    }
    let mut running = 0;
    let q = StateQuery::new(TENANT).state(RunState::Running);
    for r in d.store.iter_runs(&q).page_size(PAGE) {
        r?;
        running += 1;
    }
    writeln!(
        out,
        "  a reaper's walk of the running runs reads the state index only: {running} runs"
    )?;
    Ok(())
}

/// A session delete is refused while runs are live; cascade deletes all.
fn sessions(d: &Demo, out: &mut dyn Write) -> Result<(), CliError> {
    section(out, "sessions: a delete never orphans a live run")?;
    let key = SessionKey::new(TENANT, "s-1");
    match d.w(|s| s.delete_session(&key, false)) {
        Err(StateError::InUse { runs, .. }) => {
            let names: Vec<&str> = runs.iter().take(4).map(|k| k.run_id.as_str()).collect();
            writeln!(
                out,
                "  deleting s-1 was refused: InUse, {} unfinished runs ({}, …)",
                runs.len(),
                names.join(", ")
            )?;
        }
        other => {
            return Err(broken(format!(
                "a session with live runs was deleted: {other:?}"
            )));
        }
    }
    let deleted = d.w(|s| s.delete_session(&key, true))?;
    writeln!(
        out,
        "  with cascade: s-1 and its {} runs deleted in one atomic write",
        deleted.len()
    )?;
    if d.r(|s| s.get_run(&RunKey::new(TENANT, "run-1")))?.is_some() {
        return Err(broken("a cascaded run survived"));
    }
    let left = d.r(|s| s.list_runs(&StateQuery::new(TENANT), &PageRequest::new(1000)))?;
    writeln!(
        out,
        "  {TENANT} keeps its {} runs outside the session",
        left.items().len()
    )?;
    Ok(())
}
