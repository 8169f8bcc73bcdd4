//! The `agentstate` command-line tool: a demo, and what an operator needs
//! to look into, check, move and trim a file store.
//!
//! Exit codes: 0 ok; 1 the store answered no (verify found a problem, a
//! record is missing, a session delete is refused, a fence is lost);
//! 2 bad usage or an unusable store (locked by another process, damaged,
//! from a newer release, not empty where it must be).

mod budgets;
mod commands;
mod copy;
mod demo;
mod open;
mod output;
mod time;
mod transfer;
mod watch;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use agentstate::{Millis, Options, PersistenceReason, RunState, StateError, Store};
use clap::{Args, Parser, Subcommand};
use open::{DbSpec, Open};

/// Durable state for AI-agent runtimes: look into, check, export, import and
/// prune an agentstate file store, or run the demo.
#[derive(Debug, Parser)]
#[command(name = "agentstate", version, about, long_about = None)]
#[command(
    after_help = "TIME is `now`, unix millis, a duration ago (45s, 10m, 2h, 3d, 1h30m) \
or an RFC 3339 time (2026-11-30T12:00:00Z; without a zone, UTC).\n\
Exit codes: 0 ok, 1 a check failed or the store said no, 2 bad usage or an unusable store."
)]
pub struct Cli {
    /// The store: a directory (the file store), or a server backend's URL
    /// (postgres://…, redis://…) when built with its feature. `demo` uses a
    /// fresh temporary directory when this is not given.
    #[arg(long, global = true, env = "AGENTSTATE_DB", value_name = "PATH|URL")]
    db: Option<String>,

    /// Open a store whose journal was cut short (it recovered to less than
    /// it had acknowledged), keeping what is left.
    #[arg(long, global = true)]
    salvage: bool,

    /// Redis: what the service guarantees, for managed services that
    /// disable `CONFIG GET` (the store then trusts this instead of reading
    /// the settings): `noeviction`, `appendfsync-always`, or both,
    /// comma-separated. Without `noeviction` such a server is refused.
    #[arg(long, global = true, value_delimiter = ',', value_name = "GUARANTEE")]
    redis_assume: Vec<Guarantee>,

    /// Redis: every write waits until N replicas have it (`WAIT`, up to
    /// 1 s; fewer is an unknown outcome), so it survives a Sentinel
    /// failover; a master with fewer replicas connected is refused.
    #[arg(long, global = true, value_name = "N")]
    redis_wait_replicas: Option<u32>,

    /// Redis over TLS (`rediss://`): a CA certificate (PEM file) to trust
    /// instead of the web PKI roots. (PostgreSQL takes `sslrootcert=…` in
    /// its URL.)
    #[arg(long, global = true, value_name = "FILE")]
    tls_ca: Option<PathBuf>,

    /// Redis over TLS: a client certificate (PEM file), with --tls-key.
    #[arg(long, global = true, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,

    /// Redis over TLS: the client certificate's key (PEM file).
    #[arg(long, global = true, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,

    #[command(subcommand)]
    command: Command,
}

/// A durability guarantee a managed Redis states (see `--redis-assume`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Guarantee {
    /// `maxmemory-policy noeviction`: no acknowledged key is evicted.
    Noeviction,
    /// `appendonly yes` + `appendfsync always`: every write is fsynced.
    AppendfsyncAlways,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a short multi-worker workload that shows what the store
    /// guarantees: versions, commuting spend, fencing, alarms, listings.
    Demo,
    /// List and show runs.
    #[command(subcommand)]
    Runs(RunsCmd),
    /// List, show and delete sessions.
    #[command(subcommand)]
    Sessions(SessionsCmd),
    /// List an instance's trays, or the marked trays the sweeper wakes.
    #[command(subcommand)]
    Trays(TraysCmd),
    /// Alarms of pinned workers.
    #[command(subcommand)]
    Alarms(AlarmsCmd),
    /// Spend caps: caps, spent and held per budget and per run.
    #[command(subcommand)]
    Budgets(BudgetsCmd),
    /// Count runs per tenant and state, sessions, budgets, holds, runs at
    /// their cap, trays, alarms, disk bytes.
    Stats {
        /// One JSON object instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Check every record and index entry; exits 1 when anything is wrong.
    Verify {
        /// One JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Write every record as JSON Lines (a header line, then one entry a line).
    Export {
        /// Where to write (atomically: a temporary file renamed into place);
        /// stdout when not given.
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
    },
    /// Copy a whole store into an empty one, between any two backends, then
    /// compare counts and per-record checksums.
    Copy {
        /// The store to read (a path or URL, like --db).
        #[arg(long, value_name = "PATH|URL")]
        from: String,
        /// The empty store to write (created when absent).
        #[arg(long, value_name = "PATH|URL")]
        to: String,
    },
    /// Read an export into an empty store (created when absent).
    Import {
        /// What to read; stdin when not given.
        #[arg(long = "in", value_name = "FILE")]
        input: Option<PathBuf>,
        /// Import a format-2 export that has no trailer line (it cannot be
        /// told whether it was cut short).
        #[arg(long)]
        allow_untrailed: bool,
    },
    /// Follow a change feed: one line per change (each record once, at its
    /// last change), waiting for new commits. With --sweep, the sweeper:
    /// each marked tray named the moment its mark commits, each alarm at
    /// its due time.
    Watch {
        /// A tenant's runs and sessions.
        #[arg(long, required_unless_present = "trays", conflicts_with = "trays")]
        tenant: Option<String>,
        /// The store's trays and alarms.
        #[arg(long)]
        trays: bool,
        /// With --trays: only this env's trays (and no alarms).
        #[arg(long, requires = "trays")]
        env: Option<String>,
        /// Where to start: "head" (what commits from now on), "start"
        /// (every record, then what follows), or a position an earlier
        /// watch printed.
        #[arg(long, default_value = "head", value_parser = watch::parse_from)]
        from: watch::From,
        /// Stop after this many lines.
        #[arg(long)]
        count: Option<u64>,
        /// Stop after this many seconds with nothing new.
        #[arg(long, value_name = "SECS")]
        idle: Option<f64>,
        /// The sweeper (needs --trays): name marked trays and due alarms.
        #[arg(long, requires = "trays")]
        sweep: bool,
        /// With --sweep: acknowledge each alarm as it comes due.
        #[arg(long, requires = "sweep")]
        ack: bool,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// Retention: delete a tenant's finished runs (completed, failed,
    /// cancelled) last written before a time. Unfinished runs are never
    /// touched.
    Prune {
        /// Whose runs.
        #[arg(long)]
        tenant: String,
        /// Delete finished runs last written before this TIME (e.g. 30d).
        #[arg(long, value_name = "TIME", value_parser = time::parse_time)]
        finished_before: Millis,
        /// Count what would be deleted; delete nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

/// Paging options shared by the listings.
#[derive(Debug, Args)]
struct PageArgs {
    /// Items per page (1..=1000).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u16).range(1..=1000))]
    limit: u16,
    /// Walk every page, not just the first.
    #[arg(long, conflicts_with = "cursor")]
    all: bool,
    /// Continue a listing where an earlier page ended.
    #[arg(long)]
    cursor: Option<String>,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Subcommand)]
enum RunsCmd {
    /// List runs in `seq` order (of every tenant, tenant by tenant, when
    /// --tenant is not given).
    List {
        /// Only this tenant's runs.
        #[arg(long)]
        tenant: Option<String>,
        /// Only runs in this state.
        #[arg(long, value_parser = parse_state)]
        state: Option<RunState>,
        /// Only runs of this session.
        #[arg(long)]
        session: Option<String>,
        /// Only runs of this agent.
        #[arg(long)]
        agent: Option<String>,
        /// Only runs last written before this TIME.
        #[arg(long, value_name = "TIME", value_parser = time::parse_time)]
        updated_before: Option<Millis>,
        #[command(flatten)]
        page: PageArgs,
    },
    /// Show one run: everything a worker would resume from.
    Show {
        /// The run's tenant.
        #[arg(long)]
        tenant: String,
        /// The run's id.
        run_id: String,
        /// JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
enum SessionsCmd {
    /// List a tenant's sessions in id order.
    List {
        /// Whose sessions.
        #[arg(long)]
        tenant: String,
        #[command(flatten)]
        page: PageArgs,
    },
    /// Show a session and its runs.
    Show {
        /// The session's tenant.
        #[arg(long)]
        tenant: String,
        /// The session's id.
        session_id: String,
        /// JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Delete a session. Refused (exit 1) while it has unfinished runs,
    /// unless --cascade, which deletes the session and all its runs at once.
    Delete {
        /// The session's tenant.
        #[arg(long)]
        tenant: String,
        /// The session's id.
        session_id: String,
        /// Delete the session's runs with it, finished or not.
        #[arg(long)]
        cascade: bool,
    },
}

#[derive(Debug, Subcommand)]
enum TraysCmd {
    /// List one instance's trays.
    List {
        /// The instance's namespace.
        #[arg(long)]
        ns: String,
        /// The instance's id.
        #[arg(long)]
        id: String,
        /// The epoch to read at. Defaults to the stored one, so listing
        /// never fences out the live worker; a higher epoch takes the
        /// instance over (its current holder gets FenceLost from then on).
        #[arg(long)]
        epoch: Option<u64>,
        #[command(flatten)]
        page: PageArgs,
    },
    /// The sweeper's view: marked trays of every instance.
    Marked {
        /// Only trays marked by workers of this env.
        #[arg(long)]
        env: Option<String>,
        #[command(flatten)]
        page: PageArgs,
    },
}

#[derive(Debug, Subcommand)]
enum BudgetsCmd {
    /// List a tenant's budgets in name order: caps, spent, held.
    List {
        /// Whose budgets.
        #[arg(long)]
        tenant: String,
        #[command(flatten)]
        page: PageArgs,
    },
    /// Show one budget and the runs that draw from it, or (with --run) one
    /// run's caps, spent and live holds.
    Show {
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// The budget's name.
        #[arg(required_unless_present = "run", conflicts_with = "run")]
        name: Option<String>,
        /// Show this run instead of a budget.
        #[arg(long, value_name = "RUN_ID")]
        run: Option<String>,
        /// JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
enum AlarmsCmd {
    /// Alarms due at a TIME (default now), earliest first.
    Due {
        /// Due at or before this TIME.
        #[arg(long, value_name = "TIME", value_parser = time::parse_time)]
        now: Option<Millis>,
        #[command(flatten)]
        page: PageArgs,
    },
}

fn parse_state(s: &str) -> Result<RunState, String> {
    s.parse::<RunState>().map_err(|e| match e {
        StateError::Invalid { what } => what,
        other => other.to_string(),
    })
}

/// A failure the CLI reports: one line on stderr, and an exit code.
#[derive(Debug)]
pub struct CliError {
    code: u8,
    message: String,
    /// Stdout went away (`| head`): stop quietly.
    broken_pipe: bool,
}

impl CliError {
    /// Bad usage or an unusable store: exit 2.
    pub fn usage(message: impl Into<String>) -> Self {
        CliError {
            code: 2,
            message: message.into(),
            broken_pipe: false,
        }
    }
    /// The store answered no, or a check failed: exit 1.
    pub fn failed(message: impl Into<String>) -> Self {
        CliError {
            code: 1,
            message: message.into(),
            broken_pipe: false,
        }
    }
    /// Writing output failed.
    pub fn io(message: impl Into<String>) -> Self {
        CliError {
            code: 2,
            message: message.into(),
            broken_pipe: false,
        }
    }
}

impl From<std::io::Error> for CliError {
    fn from(e: std::io::Error) -> Self {
        CliError {
            code: 2,
            broken_pipe: e.kind() == std::io::ErrorKind::BrokenPipe,
            message: format!("writing output: {e}"),
        }
    }
}

impl From<StateError> for CliError {
    fn from(e: StateError) -> Self {
        let text = e.to_string();
        match &e {
            StateError::Locked { .. } => CliError::usage(format!(
                "{text} (close the other agentstate or worker using it)"
            )),
            StateError::Corrupt { .. } if text.contains("salvage") => CliError::usage(text),
            StateError::Corrupt { .. } => CliError::usage(format!(
                "{text} (restore the store from a backup or an export)"
            )),
            StateError::UnsupportedFormat { .. } => CliError::usage(text),
            StateError::Persistence {
                reason: PersistenceReason::Unavailable,
                ..
            } => CliError::usage(format!(
                "{text} (check the disk's space and permissions, then try again)"
            )),
            StateError::Persistence {
                reason: PersistenceReason::ReadOnly,
                ..
            } => CliError::usage(format!(
                "{text} (the file system is read-only: remount it read-write or pick another --db path)"
            )),
            StateError::Persistence {
                reason: PersistenceReason::InvalidPath,
                ..
            } => CliError::usage(format!("{text} (pick another --db path)")),
            StateError::Persistence {
                reason: PersistenceReason::OutcomeUnknown { .. },
                ..
            } => CliError::usage(format!(
                "{text} (the write may have been applied: look before doing it again)"
            )),
            StateError::Persistence {
                reason: PersistenceReason::Refused,
                ..
            } => CliError::usage(format!(
                "{text} (the server said no: check the user, password, database, TLS and server settings in --db)"
            )),
            StateError::Persistence { .. } | StateError::Invalid { .. } => CliError::usage(text),
            StateError::FenceLost { stored, .. } => CliError::failed(format!(
                "{text} (a newer worker holds this instance; use --epoch {stored} or higher)"
            )),
            StateError::NotFound(_) | StateError::Conflict { .. } | StateError::InUse { .. } => {
                CliError::failed(text)
            }
            _ => CliError::usage(text),
        }
    }
}

impl Cli {
    fn db(&self) -> Result<DbSpec, CliError> {
        self.db.as_deref().map(DbSpec::parse).ok_or_else(|| {
            CliError::usage("no store given: pass --db PATH|URL or set AGENTSTATE_DB")
        })
    }

    fn options(&self) -> Options {
        Options::new().salvage(self.salvage)
    }

    /// The options and the server connection settings of the command line.
    fn connect(&self) -> Result<open::Connect, CliError> {
        let read = |what: &str, p: &PathBuf| {
            std::fs::read(p).map_err(|e| CliError::usage(format!("{what} {}: {e}", p.display())))
        };
        let tls_client = match (&self.tls_cert, &self.tls_key) {
            (Some(c), Some(k)) => Some((read("--tls-cert", c)?, read("--tls-key", k)?)),
            _ => None,
        };
        Ok(open::Connect {
            opts: self.options(),
            redis_assume: (!self.redis_assume.is_empty()).then(|| {
                (
                    self.redis_assume.contains(&Guarantee::Noeviction),
                    self.redis_assume.contains(&Guarantee::AppendfsyncAlways),
                )
            }),
            redis_wait_replicas: self.redis_wait_replicas,
            tls_ca: self
                .tls_ca
                .as_ref()
                .map(|p| read("--tls-ca", p))
                .transpose()?,
            tls_client,
        })
    }

    fn open(&self, how: Open) -> Result<Box<dyn Store>, CliError> {
        open::open(&self.db()?, &self.connect()?, how)
    }
}

/// Parses the command line, runs the command, and turns its outcome into
/// an exit code (printing the error line, if any).
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let result = run(&cli, &mut out).and_then(|()| out.flush().map_err(CliError::from));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.broken_pipe => ExitCode::SUCCESS,
        Err(e) => {
            // Whatever was printed before the failure is still worth seeing.
            let _ = out.flush();
            let line = e.message.replace(['\n', '\r'], " ");
            let _ = writeln!(std::io::stderr(), "error: {line}");
            ExitCode::from(e.code)
        }
    }
}

fn run(cli: &Cli, out: &mut dyn Write) -> Result<(), CliError> {
    match &cli.command {
        Command::Demo => demo::run(cli, out),
        Command::Runs(cmd) => {
            let store = cli.open(Open::Existing)?;
            match cmd {
                RunsCmd::List {
                    tenant,
                    state,
                    session,
                    agent,
                    updated_before,
                    page,
                } => commands::runs_list(
                    &*store,
                    commands::RunFilter {
                        tenant: tenant.clone(),
                        state: *state,
                        session: session.clone(),
                        agent: agent.clone(),
                        updated_before: *updated_before,
                    },
                    page,
                    out,
                ),
                RunsCmd::Show {
                    tenant,
                    run_id,
                    json,
                } => commands::runs_show(&*store, tenant, run_id, *json, out),
            }
        }
        Command::Sessions(cmd) => {
            let store = cli.open(Open::Existing)?;
            match cmd {
                SessionsCmd::List { tenant, page } => {
                    commands::sessions_list(&*store, tenant, page, out)
                }
                SessionsCmd::Show {
                    tenant,
                    session_id,
                    json,
                } => commands::sessions_show(&*store, tenant, session_id, *json, out),
                SessionsCmd::Delete {
                    tenant,
                    session_id,
                    cascade,
                } => commands::sessions_delete(&*store, tenant, session_id, *cascade, out),
            }
        }
        Command::Trays(cmd) => {
            let store = cli.open(Open::Existing)?;
            match cmd {
                TraysCmd::List {
                    ns,
                    id,
                    epoch,
                    page,
                } => commands::trays_list(&*store, ns, id, *epoch, page, out),
                TraysCmd::Marked { env, page } => {
                    commands::trays_marked(&*store, env.as_deref(), page, out)
                }
            }
        }
        Command::Alarms(AlarmsCmd::Due { now, page }) => {
            let store = cli.open(Open::Existing)?;
            commands::alarms_due(&*store, now.unwrap_or_else(time::now_millis), page, out)
        }
        Command::Budgets(cmd) => {
            let store = cli.open(Open::Existing)?;
            match cmd {
                BudgetsCmd::List { tenant, page } => budgets::list(&*store, tenant, page, out),
                BudgetsCmd::Show {
                    tenant,
                    name,
                    run,
                    json,
                } => match (name, run) {
                    (_, Some(run)) => budgets::show_run(&*store, tenant, run, *json, out),
                    (Some(name), None) => budgets::show_budget(&*store, tenant, name, *json, out),
                    (None, None) => Err(CliError::usage("budgets show: name a budget or --run")),
                },
            }
        }
        Command::Stats { json } => commands::stats(&*cli.open(Open::Existing)?, *json, out),
        Command::Verify { json } => commands::verify(&*cli.open(Open::Existing)?, *json, out),
        Command::Export { out: file } => {
            transfer::export(&*cli.open(Open::Existing)?, file.as_deref(), out)
        }
        Command::Import {
            input,
            allow_untrailed,
        } => {
            let spec = cli.db()?;
            let db = spec.display();
            // A store this import creates is removed again if it fails, so
            // a failed import leaves the path as it was.
            let fresh = match &spec {
                DbSpec::Path(p) if !p.exists() => Some(p.clone()),
                _ => None,
            };
            let store = cli.open(Open::Create)?;
            let r = transfer::import(&*store, &db, input.as_deref(), *allow_untrailed, out);
            if r.is_err() {
                drop(store);
                if let Some(p) = fresh {
                    let _ = std::fs::remove_dir_all(p);
                }
            }
            r
        }
        Command::Copy { from, to } => copy::run(
            &DbSpec::parse(from),
            &DbSpec::parse(to),
            &cli.connect()?,
            out,
        ),
        Command::Watch {
            tenant,
            trays,
            env,
            from,
            count,
            idle,
            sweep,
            ack,
            json,
        } => {
            let scope = match (tenant, trays, env) {
                (Some(t), _, _) => agentstate::FeedScope::tenant(t),
                (None, true, Some(e)) => agentstate::FeedScope::trays_in(e),
                (None, _, None) => agentstate::FeedScope::trays(),
                (None, false, Some(_)) => return Err(CliError::usage("--env needs --trays")),
            };
            let idle = match idle {
                Some(s) if !(s.is_finite() && *s >= 0.0) => {
                    return Err(CliError::usage("--idle: a number of seconds"));
                }
                Some(s) => Some(std::time::Duration::from_secs_f64(*s)),
                None => None,
            };
            let w = watch::Watch {
                scope,
                from: *from,
                json: *json,
                count: *count,
                idle,
                sweep: *sweep,
                ack: *ack,
            };
            watch::run(&*cli.open(Open::Existing)?, &w, out)
        }
        Command::Prune {
            tenant,
            finished_before,
            dry_run,
        } => commands::prune(
            &*cli.open(Open::Existing)?,
            tenant,
            *finished_before,
            *dry_run,
            out,
        ),
    }
}
