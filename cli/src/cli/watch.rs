//! `agentstate watch`: follow a change feed (rules F1–F9), one line per
//! change; with `--sweep`, the sweeper of the trays feed: each marked tray
//! named the moment its mark commits, each alarm named (and with `--ack`
//! acknowledged) at its due time, from a timer kept from the feed.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use agentstate::{Change, Changed, FeedScope, InstanceKey, Position, Store, TrayKey};

use super::CliError;
use super::output::json_line;

/// Where a watch starts.
#[derive(Debug, Clone, Copy)]
pub enum From {
    /// Only what commits from now on (the head, F7).
    Head,
    /// Every record of the scope, then what follows.
    Start,
    /// After a position an earlier watch printed.
    After(Position),
}

pub fn parse_from(s: &str) -> Result<From, String> {
    match s {
        "head" => Ok(From::Head),
        "start" => Ok(From::Start),
        n => n
            .parse::<Position>()
            .map(From::After)
            .map_err(|e| format!("{e} (or \"head\", \"start\")")),
    }
}

/// What to watch and how long.
#[derive(Debug)]
pub struct Watch {
    pub scope: FeedScope,
    pub from: From,
    pub json: bool,
    /// Stop after this many changes (or sweeper actions).
    pub count: Option<u64>,
    /// Stop after this long with nothing new.
    pub idle: Option<Duration>,
    /// The sweeper: name marked trays and due alarms.
    pub sweep: bool,
    /// With `sweep`: acknowledge each alarm as it comes due.
    pub ack: bool,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// One change as a line: its position, what it is, and the record's
/// headline facts.
fn line(c: &Change) -> String {
    let p = c.position;
    match &c.item {
        Changed::Run { run } => format!(
            "{p}  run {} v{} {}",
            run.key,
            run.version,
            run.state.as_str()
        ),
        Changed::RunDeleted { key } => format!("{p}  run {key} deleted"),
        Changed::Session { session } => format!(
            "{p}  session {}/{} v{}",
            session.key.tenant, session.key.session_id, session.version
        ),
        Changed::SessionDeleted { key } => {
            format!("{p}  session {}/{} deleted", key.tenant, key.session_id)
        }
        Changed::Tray { key, tray } => format!(
            "{p}  tray {key} {} env={} host={}",
            if tray.marked { "marked" } else { "unmarked" },
            tray.env,
            tray.hostname
        ),
        Changed::TrayDeleted { key } => format!("{p}  tray {key} deleted"),
        Changed::Alarm { alarm } => format!("{p}  alarm {} due {}", alarm.instance, alarm.due_at),
        Changed::AlarmDeleted { instance } => format!("{p}  alarm {instance} deleted"),
        other => format!("{p}  {other:?}"),
    }
}

/// What the sweeper prints.
#[derive(serde::Serialize)]
#[serde(tag = "action", rename_all = "snake_case")]
enum Action<'a> {
    /// A marked tray: its worker is to be woken.
    Wake {
        position: Position,
        key: &'a TrayKey,
        env: &'a str,
        hostname: &'a str,
    },
    /// An alarm came due.
    Due {
        instance: &'a InstanceKey,
        due_at: u64,
        acked: bool,
    },
}

pub fn run(store: &dyn Store, w: &Watch, out: &mut dyn Write) -> Result<(), CliError> {
    if w.sweep && !matches!(w.scope, FeedScope::Trays { .. }) {
        return Err(CliError::usage(
            "watch --sweep follows the trays feed: use --trays",
        ));
    }
    let mut at = match w.from {
        From::Head => store.feed_head(&w.scope)?,
        From::Start => Position::START,
        From::After(p) => p,
    };
    let mut done = 0u64;
    let mut last_news = Instant::now();
    // The sweeper's state: alarms by instance, and the marked trays named.
    let mut alarms: BTreeMap<InstanceKey, u64> = BTreeMap::new();
    let mut named: BTreeSet<TrayKey> = BTreeSet::new();
    loop {
        if w.count.is_some_and(|n| done >= n) {
            return Ok(());
        }
        let mut wait = Duration::from_secs(60);
        if let Some(due) = alarms.values().min() {
            wait = wait.min(Duration::from_millis(due.saturating_sub(now_ms())));
        }
        if let Some(idle) = w.idle {
            wait = wait.min(idle.saturating_sub(last_news.elapsed()));
        }
        let page = store.wait_changes(&w.scope, at, 100, wait.max(Duration::from_millis(1)))?;
        at = page.next;
        if !page.changes.is_empty() {
            last_news = Instant::now();
        }
        for c in &page.changes {
            if w.count.is_some_and(|n| done >= n) {
                return Ok(());
            }
            if !w.sweep {
                if w.json {
                    json_line(out, c)?;
                } else {
                    writeln!(out, "{}", line(c))?;
                }
                done += 1;
                continue;
            }
            match &c.item {
                Changed::Tray { key, tray } if tray.marked && !named.contains(key) => {
                    named.insert(key.clone());
                    let a = Action::Wake {
                        position: c.position,
                        key,
                        env: &tray.env,
                        hostname: &tray.hostname,
                    };
                    print_action(out, w.json, &a)?;
                    done += 1;
                }
                Changed::Tray { tray, .. } if tray.marked => {}
                Changed::Tray { key, .. } | Changed::TrayDeleted { key } => {
                    named.remove(key);
                }
                Changed::Alarm { alarm } => {
                    alarms.insert(alarm.instance.clone(), alarm.due_at);
                }
                Changed::AlarmDeleted { instance } => {
                    alarms.remove(instance);
                }
                _ => {}
            }
        }
        // The timer: what is due now.
        let now = now_ms();
        let due: Vec<(InstanceKey, u64)> = alarms
            .iter()
            .filter(|(_, d)| **d <= now)
            .map(|(i, d)| (i.clone(), *d))
            .collect();
        for (instance, due_at) in due {
            if w.count.is_some_and(|n| done >= n) {
                return Ok(());
            }
            alarms.remove(&instance);
            let acked = w.ack && {
                let epoch = store.epoch(&instance)?;
                store.ack_alarm(&instance, epoch, due_at)?
            };
            print_action(
                out,
                w.json,
                &Action::Due {
                    instance: &instance,
                    due_at,
                    acked,
                },
            )?;
            last_news = Instant::now();
            done += 1;
        }
        out.flush()?;
        if w.idle.is_some_and(|idle| last_news.elapsed() >= idle) {
            return Ok(());
        }
    }
}

fn print_action(out: &mut dyn Write, json: bool, a: &Action<'_>) -> Result<(), CliError> {
    if json {
        return json_line(out, a);
    }
    match a {
        Action::Wake {
            position,
            key,
            env,
            hostname,
        } => writeln!(out, "{position}  wake {key} env={env} host={hostname}")?,
        Action::Due {
            instance,
            due_at,
            acked,
        } => writeln!(
            out,
            "due  {instance} at {due_at}{}",
            if *acked { " (acked)" } else { "" }
        )?,
    }
    Ok(())
}
