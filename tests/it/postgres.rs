//! The PostgreSQL backend on a real server (see `pg_server`): setup from 8
//! processes at once, rules across OS processes (R3, T6), seq order under
//! out-of-order commits, the seed's sweeper query, amounts past i64, a
//! server killed mid-workload, and the CLI over `postgres://`.
//!
//! The cross-process tests run this test binary again as their second
//! process: the same test function, told its role by
//! `AGENTSTATE_PG_ROLE`.

use std::collections::BTreeSet;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex, OnceLock};
use std::time::{Duration, Instant};

use agentstate::{
    InstanceKey, Options, PageRequest, PersistenceReason, PgOptions, PostgresStore, RunKey,
    RunRecord, RunState, StateDelta, StateError, StateQuery, StateStore, StoreAdmin, Tray, TrayOp,
    TrayStore,
};

use crate::pg_server::{PgServer, fresh_db, shared_dsn};

/// The schema this test process keeps its tables in on the shared server.
pub fn schema() -> &'static str {
    static S: OnceLock<String> = OnceLock::new();
    S.get_or_init(|| {
        // A child process works in its parent's schema.
        if let Ok(s) = std::env::var("AGENTSTATE_PG_SCHEMA") {
            return s;
        }
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() & 0xffff_ffff)
            .unwrap_or(0);
        let s = format!("t{}_{nanos:x}", std::process::id());
        let store = PostgresStore::connect_with(shared_dsn(), PgOptions::new().schema(&s))
            .expect("connect");
        store.setup().expect("setup");
        s
    })
}

/// A store on the shared server, in this process's schema.
pub fn store(opts: Options) -> PostgresStore {
    PostgresStore::connect_with(
        shared_dsn(),
        PgOptions::new().schema(schema()).options(opts),
    )
    .expect("connect")
}

fn unique(tag: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{tag}-{}-{}-{:x}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() & 0xffff_ffff)
            .unwrap_or(0)
    )
}

fn rounds(default: u64) -> u64 {
    let k: u64 = std::env::var("AGENTSTATE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    default * k.max(1)
}

/// This process's role, when a parent test started it.
fn role() -> Option<String> {
    std::env::var("AGENTSTATE_PG_ROLE").ok()
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is set for a child"))
}

/// Runs `test` of this binary again as a child with `vars`.
fn spawn_child(test: &str, vars: &[(&str, String)]) -> std::process::Child {
    let mut c = Command::new(std::env::current_exe().expect("the test binary"));
    c.args([test, "--exact", "--nocapture", "--test-threads", "1"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in vars {
        c.env(k, v);
    }
    c.spawn().expect("the test binary runs again")
}

/// Waits for a child; its report: what follows `@@ ` on each line.
fn child_lines(child: std::process::Child, what: &str) -> Vec<String> {
    let o = child.wait_with_output().expect("the child ends");
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{what} failed: {}\n{}",
        stdout,
        String::from_utf8_lossy(&o.stderr)
    );
    stdout
        .lines()
        // The harness may print its `test … ` header on the same line.
        .filter_map(|l| l.split_once("@@ ").map(|(_, r)| r.to_string()))
        .collect()
}

/// Waits until the unix time in milliseconds `AGENTSTATE_PG_START` names,
/// so that children start their work together.
fn wait_for_start() {
    let at: u128 = env("AGENTSTATE_PG_START").parse().expect("a time");
    loop {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_millis();
        if now >= at {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn start_in(ms: u128) -> String {
    (std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis()
        + ms)
        .to_string()
}

#[test]
fn setup_is_idempotent_and_refuses_a_newer_schema_untouched() {
    let dsn = fresh_db("setup");
    let s = PostgresStore::connect(&dsn).expect("connect");
    assert_eq!(s.schema_version().expect("version"), None, "before setup");
    assert!(
        matches!(s.get_run(&RunKey::new("t", "r")), Err(e) if e.is_retryable() && e.to_string().contains("setup")),
        "a call before setup names setup()"
    );
    s.setup().expect("setup");
    s.setup().expect("setup again");
    assert_eq!(s.schema_version().expect("version"), Some(10));
    s.put_run(RunRecord::new(RunKey::new("t", "r"), "a"))
        .expect("put");
    // A newer release wrote version 11: refused, and nothing is changed.
    let mut c = postgres::Client::connect(&dsn, postgres::NoTls).expect("raw");
    c.execute(
        "UPDATE public.agentstate_meta SET value = '11' WHERE name = 'schema_version'",
        &[],
    )
    .expect("bump");
    let e = PostgresStore::connect(&dsn)
        .expect("connect")
        .setup()
        .expect_err("a newer schema is refused");
    assert!(
        matches!(
            e,
            StateError::UnsupportedFormat {
                found: 11,
                supported: 10
            }
        ),
        "{e:?}"
    );
    let v: String = c
        .query_one(
            "SELECT value FROM public.agentstate_meta WHERE name = 'schema_version'",
            &[],
        )
        .expect("read")
        .get(0);
    assert_eq!(v, "11", "the newer schema is not touched");
    assert!(s.get_run(&RunKey::new("t", "r")).expect("get").is_some());
}

/// A database a version-1 build set up (no budget tables) and wrote runs
/// to is upgraded by `setup()` in place, from 4 workers at once: its runs
/// are kept, and spend caps and labels then work on it.
#[test]
fn setup_upgrades_a_version_1_database() {
    let dsn = fresh_db("upgrade");
    let mut c = postgres::Client::connect(&dsn, postgres::NoTls).expect("raw");
    // An uncapped run is written byte for byte as version 1 wrote it, and
    // an alarm is a row of agentstate_alarms: written by this build in
    // another schema, copied into a version-1 layout.
    let cur = PostgresStore::connect_with(&dsn, PgOptions::new().schema("cur")).expect("connect");
    cur.setup().expect("setup");
    let old = cur
        .put_run(RunRecord::new(RunKey::new("t", "old"), "a"))
        .expect("put");
    let w = InstanceKey::new("w", "1");
    cur.set_alarm(&w, 1, 1234).expect("alarm");
    old_layout(&mut c, "cur", "public", 1);
    let s = PostgresStore::connect(&dsn).expect("connect");
    assert_eq!(s.schema_version().expect("version"), Some(1));
    std::thread::scope(|sc| {
        for _ in 0..4 {
            sc.spawn(|| {
                PostgresStore::connect(&dsn)
                    .expect("connect")
                    .setup()
                    .expect("upgrade")
            });
        }
    });
    assert_eq!(s.schema_version().expect("version"), Some(10));
    assert_eq!(s.get_run(&old.key).expect("get"), Some(old.clone()));
    use agentstate::{BudgetKey, BudgetRecord, BudgetStore, Caps, Hold};
    s.put_budget(BudgetRecord::new(
        BudgetKey::new("t", "b"),
        Caps::new().cost_micros(10),
    ))
    .expect("budget after upgrade");
    let run = s
        .put_run(RunRecord::new(RunKey::new("t", "new"), "a").with_budget("b"))
        .expect("capped run after upgrade");
    s.reserve(&run.key, Hold::new("h", 60_000).cost_micros(10))
        .expect("reserve");
    s.reserve(&old.key, Hold::new("h", 60_000).cost_micros(1))
        .expect("an uncapped run from v1 reserves too");
    assert!(matches!(
        s.reserve(&run.key, Hold::new("h2", 60_000).cost_micros(1)),
        Err(StateError::BudgetExceeded { .. })
    ));
    // Labels (schema 4) on a run from v1 and a new one.
    let mut labelled = s.get_run(&old.key).expect("get").expect("old run");
    labelled.labels = agentstate::Labels::new().with("team", "a");
    s.put_run(labelled).expect("label a v1 run");
    s.put_run(RunRecord::new(RunKey::new("t", "newer"), "a").with_label("team", "a"))
        .expect("a labelled run after upgrade");
    let page = s
        .list_runs(
            &StateQuery::new("t").label("team", "a"),
            &agentstate::PageRequest::new(10),
        )
        .expect("list by label");
    let ids: Vec<&str> = page.items().iter().map(|r| r.key.run_id.as_str()).collect();
    assert_eq!(ids, ["old", "newer"], "the label filter after an upgrade");
    let doc: String = c
        .query_one(
            "SELECT doc::text FROM public.pinned_tray_index WHERE ns = 'w' AND id = '1' \
             AND tray_ns = 'pinned' AND tray_id = 'alarm' AND marked",
            &[],
        )
        .expect("the v1 alarm's row after the upgrade")
        .get(0);
    assert_eq!(doc, r#"{"due_at": 1234}"#);
    assert!(s.verify().expect("verify").is_ok());
}

/// The schema files a database at `version` was set up with.
fn schema_files(version: u8) -> String {
    [
        include_str!("../../crates/postgres/src/schema/v1.sql"),
        include_str!("../../crates/postgres/src/schema/v2.sql"),
        include_str!("../../crates/postgres/src/schema/v3.sql"),
        include_str!("../../crates/postgres/src/schema/v4.sql"),
        include_str!("../../crates/postgres/src/schema/v5.sql"),
        include_str!("../../crates/postgres/src/schema/v6.sql"),
    ][..usize::from(version)]
        .concat()
}

/// Copies the rows of schema `from` (set up by this build) into a new
/// schema `to` laid out as a database at schema `version` was: the tables
/// of that version, each with the columns it had then (later versions
/// only add tables and columns), and its meta rows. Records without labels
/// are encoded byte for byte as every earlier version wrote them, so this
/// is the database an older build left.
fn old_layout(c: &mut postgres::Client, from: &str, to: &str, version: u8) {
    if to != "public" {
        c.batch_execute(&format!("CREATE SCHEMA \"{to}\""))
            .expect("schema");
    }
    c.batch_execute(&schema_files(version).replace("{s}", &format!("\"{to}\".")))
        .expect("the old schema files");
    let tables: Vec<String> = c
        .query(
            "SELECT table_name::text FROM information_schema.tables WHERE table_schema = $1 \
             AND table_type = 'BASE TABLE' AND table_name <> 'agentstate_meta' \
             ORDER BY table_name IN ('agentstate_holds', 'agentstate_run_labels'), 1",
            &[&to],
        )
        .expect("tables")
        .iter()
        .map(|r| r.get(0))
        .collect();
    for t in tables {
        let cols: String = c
            .query_one(
                "SELECT string_agg(quote_ident(column_name), ', ' ORDER BY ordinal_position) \
                 FROM information_schema.columns WHERE table_schema = $1 AND table_name = $2 \
                 AND is_generated = 'NEVER'",
                &[&to, &t],
            )
            .expect("columns")
            .get(0);
        // Before schema 9 a doc was its bytes (and an epoch numeric,
        // which a bigint converts to as it is).
        let select = if t == "pinned_tray_index" {
            cols.replace(
                ", doc,",
                &format!(", \"{from}\".agentstate_doc_out(doc, doc_raw),"),
            )
        } else {
            cols.clone()
        };
        // From schema 5 the alarms' trigger has written their tray rows.
        c.batch_execute(&format!(
            "INSERT INTO \"{to}\".{t} ({cols}) SELECT {select} FROM \"{from}\".{t} \
             ON CONFLICT DO NOTHING"
        ))
        .expect("copy");
    }
    // Alarm rows (schema 5) are not trays of an older layout.
    if version < 5 {
        c.batch_execute(&format!(
            "DELETE FROM \"{to}\".pinned_tray_index WHERE tray_ns = 'pinned' AND tray_id = 'alarm'"
        ))
        .expect("alarm rows");
    }
    c.batch_execute(&format!(
        "INSERT INTO \"{to}\".agentstate_meta (name, value) VALUES ('schema_version', '{version}') \
         ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value; \
         INSERT INTO \"{to}\".agentstate_meta (name, value) \
         SELECT name, value FROM \"{from}\".agentstate_meta WHERE name = 'cursor_secret'"
    ))
    .expect("meta");
}

/// The golden schema-2 database (tests/fixtures/pg_schema2.sql): what a
/// schema-2 build left, runs (one in a session, one capped and drawing on
/// a budget, mid tool call), a session, a budget and its hold, an epoch, a
/// marked tray and an alarm, on a manual clock. `AGENTSTATE_BLESS=1`
/// writes it again.
const GOLDEN_SCHEMA2: &str = "tests/fixtures/pg_schema2.sql";
const GOLDEN_NOW: u64 = 1_750_000_000_000;

fn write_golden_schema2() {
    use agentstate::{
        BudgetKey, BudgetRecord, BudgetStore, Caps, Hold, ManualClock, SessionKey, SessionRecord,
        ToolCall, Usage,
    };
    let dsn = fresh_db("golden");
    let clock = Arc::new(ManualClock::new(GOLDEN_NOW));
    let s = PostgresStore::connect_with(
        &dsn,
        PgOptions::new()
            .schema("cur")
            .options(Options::new().clock(clock.clone())),
    )
    .expect("connect");
    s.setup().expect("setup");
    let mut session = SessionRecord::new(SessionKey::new("acme", "s1"));
    session.metadata.insert("title".into(), "hello".into());
    s.put_session(session).expect("session");
    clock.advance(1_000);
    let r1 = s
        .put_run(RunRecord::new(RunKey::new("acme", "r1"), "planner").with_session("s1"))
        .expect("r1");
    let spent = StateDelta {
        usage: Usage {
            input_tokens: 10,
            output_tokens: 20,
        },
        cost_micros: 1_200,
        iterations: 3,
        messages_read: 4,
    };
    s.patch_run(&r1.key, spent).expect("patch r1");
    s.put_budget(BudgetRecord::new(
        BudgetKey::new("acme", "monthly"),
        Caps::new().cost_micros(10_000),
    ))
    .expect("budget");
    clock.advance(1_000);
    let mut r2 = RunRecord::new(RunKey::new("acme", "r2"), "coder")
        .with_caps(Caps::new().cost_micros(500))
        .with_budget("monthly");
    r2.pending_tool_calls = vec![ToolCall {
        id: "c1".into(),
        name: "search".into(),
        arguments: "{\"q\":\"rust\"}".into(),
    }];
    let r2 = s.put_run(r2).expect("r2");
    s.reserve(&r2.key, Hold::new("h1", 86_400_000).cost_micros(200))
        .expect("hold");
    let at_cap = StateDelta {
        cost_micros: 300,
        ..StateDelta::default()
    };
    s.patch_run(&r2.key, at_cap).expect("patch r2");
    let w = InstanceKey::new("py", "w1");
    let t = Tray {
        marked: true,
        doc: b"hello".to_vec(),
        env: "prod".into(),
        hostname: "host1".into(),
    };
    s.write_tray(&w.tray("chat", "main"), 2, t).expect("tray");
    s.set_alarm(&w, 2, GOLDEN_NOW + 60_000).expect("alarm");
    let mut c = postgres::Client::connect(&dsn, postgres::NoTls).expect("raw");
    old_layout(&mut c, "cur", "golden", 2);
    let mut out = String::from(
        "-- A PostgreSQL database at agentstate schema 2: the schema files a\n\
         -- schema-2 build applied, then rows in the encodings it wrote (records\n\
         -- without labels are byte for byte the same in every build). Written by\n\
         -- tests/it/postgres.rs, write_golden_schema2 (AGENTSTATE_BLESS=1), and\n\
         -- kept as it is so that upgrades from it stay tested. Do not edit.\n\n",
    );
    out.push_str(&schema_files(2).replace("{s}", "public."));
    let tables: Vec<String> = c
        .query(
            "SELECT table_name::text FROM information_schema.tables WHERE table_schema = 'golden' \
             AND table_type = 'BASE TABLE' \
             ORDER BY table_name IN ('agentstate_holds', 'agentstate_run_labels'), 1",
            &[],
        )
        .expect("tables")
        .iter()
        .map(|r| r.get(0))
        .collect();
    out.push_str("\n-- The rows.\n");
    for t in tables {
        for r in c
            .query(
                &format!(
                    "SELECT format('INSERT INTO public.%I SELECT * FROM \
                     json_populate_record(NULL::public.%I, %L);', $1::text, $1::text, \
                     row_to_json(t)::text) FROM golden.{t} t ORDER BY row_to_json(t)::text"
                ),
                &[&t],
            )
            .expect("rows")
        {
            out.push_str(&r.get::<_, String>(0));
            out.push('\n');
        }
    }
    std::fs::create_dir_all("tests/fixtures").expect("dir");
    std::fs::write(GOLDEN_SCHEMA2, out).expect("write the fixture");
}

/// An upgrade from the golden schema-2 database: `setup()` brings it to
/// the current schema in place, every record reads back as written, the
/// rows get their columns (schema 6) and the alarm its row (schema 5), and
/// the store goes on working on it.
#[test]
fn setup_upgrades_the_golden_schema_2_database() {
    use agentstate::{BudgetKey, BudgetStore, Hold, ManualClock, SessionKey, TrayStore};
    if std::env::var_os("AGENTSTATE_BLESS").is_some() {
        write_golden_schema2();
    }
    let fixture = std::fs::read_to_string(GOLDEN_SCHEMA2).expect("the golden fixture");
    let dsn = fresh_db("schema2");
    let mut c = postgres::Client::connect(&dsn, postgres::NoTls).expect("raw");
    c.batch_execute(&fixture).expect("load the fixture");
    let clock = Arc::new(ManualClock::new(GOLDEN_NOW + 10_000));
    let s =
        PostgresStore::connect_with(&dsn, PgOptions::new().options(Options::new().clock(clock)))
            .expect("connect");
    assert_eq!(s.schema_version().expect("version"), Some(2));
    s.setup().expect("upgrade");
    assert_eq!(s.schema_version().expect("version"), Some(10));
    let r1 = s
        .get_run(&RunKey::new("acme", "r1"))
        .expect("get")
        .expect("r1");
    assert_eq!(
        (
            r1.cost_micros,
            r1.usage.input_tokens,
            r1.usage.output_tokens
        ),
        (1_200, 10, 20)
    );
    assert_eq!((r1.iterations, r1.messages_read, r1.version), (3, 4, 2));
    assert_eq!(r1.session_id.as_deref(), Some("s1"));
    let r2 = s
        .get_run(&RunKey::new("acme", "r2"))
        .expect("get")
        .expect("r2");
    assert_eq!(r2.cost_micros, 300);
    assert_eq!(r2.caps.cost_micros_max, Some(500));
    assert_eq!(r2.budget.as_deref(), Some("monthly"));
    assert_eq!(r2.pending_tool_calls[0].name, "search");
    let session = s
        .get_session(&SessionKey::new("acme", "s1"))
        .expect("get")
        .expect("s1");
    assert_eq!(session.metadata["title"], "hello");
    // The hold of 200 still counts against r2's cap of 500 (300 spent).
    assert!(matches!(
        s.reserve(&r2.key, Hold::new("h2", 60_000).cost_micros(1)),
        Err(StateError::BudgetExceeded { .. })
    ));
    s.settle(&r2.key, "h1", StateDelta::default())
        .expect("settle the old hold");
    let budget = s
        .get_budget(&BudgetKey::new("acme", "monthly"))
        .expect("get")
        .expect("budget");
    // The budget's spend: r2's 300 before the hold was settled (nothing more).
    assert_eq!(budget.record.key.name, "monthly");
    assert_eq!((budget.spent.cost_micros, budget.holds), (300, 0));
    let w = InstanceKey::new("py", "w1");
    assert_eq!(s.epoch(&w).expect("epoch"), 2);
    let tray = s
        .read_tray(&w.tray("chat", "main"), 2)
        .expect("read")
        .expect("tray");
    assert_eq!(tray.doc, b"hello");
    // Schema 5: the alarm's row; schema 6: every row has its columns.
    let doc: String = c
        .query_one(
            "SELECT doc ->> 'due_at' FROM public.pinned_tray_index WHERE ns = 'py' AND id = 'w1' \
             AND tray_ns = 'pinned' AND tray_id = 'alarm' AND marked",
            &[],
        )
        .expect("the alarm's row")
        .get(0);
    assert_eq!(doc, (GOLDEN_NOW + 60_000).to_string());
    let unfilled: i64 = c
        .query_one(
            "SELECT (SELECT count(*) FROM public.agentstate_runs WHERE fields IS NULL) + \
             (SELECT count(*) FROM public.agentstate_sessions WHERE fields IS NULL)",
            &[],
        )
        .expect("count")
        .get(0);
    assert_eq!(unfilled, 0, "setup fills the columns of older rows");
    let (cost, tool): (String, String) = {
        let r = c
            .query_one(
                "SELECT cost_micros::text, pending_tool_calls -> 0 ->> 'name' \
                 FROM public.agentstate_runs_view WHERE tenant = 'acme' AND run_id = 'r2'",
                &[],
            )
            .expect("r2's columns");
        (r.get(0), r.get(1))
    };
    assert_eq!((cost.as_str(), tool.as_str()), ("300", "search"));
    s.patch_run(&r1.key, StateDelta::default())
        .expect("writes go on");
    let report = s.verify().expect("verify");
    assert!(report.is_ok(), "{:?}", report.problems);
    // A build from before schema 6, still running, rewrites a record and
    // not its fields: the columns are cleared rather than left stale, and
    // the next setup() fills them again.
    let r1_fields = |c: &mut postgres::Client| -> Option<String> {
        c.query_one(
            "SELECT fields::text FROM public.agentstate_runs WHERE run_id = 'r1'",
            &[],
        )
        .expect("r1")
        .get(0)
    };
    let before = r1_fields(&mut c).expect("filled");
    let saved: Vec<u8> = c
        .query_one(
            "SELECT record FROM public.agentstate_runs WHERE run_id = 'r1'",
            &[],
        )
        .expect("r1")
        .get(0);
    for record in [b"old build".to_vec(), saved] {
        c.execute(
            "UPDATE public.agentstate_runs SET record = $1 WHERE run_id = 'r1'",
            &[&record],
        )
        .expect("an old build's write");
        assert_eq!(r1_fields(&mut c), None, "stale columns are cleared");
    }
    s.setup().expect("setup again");
    assert_eq!(r1_fields(&mut c).as_deref(), Some(before.as_str()));
    assert!(s.verify().expect("verify").is_ok());
}

/// B2/B6 across processes: 2 processes of 4 threads each reserve 1 and
/// settle 1 in a loop, each thread on its own run, all drawing from one
/// budget capped at `n`. Exactly `n` reserves win in all, the budget's
/// spend ends at exactly `n`, and nothing stays held.
#[test]
fn b6_processes_share_one_budget_cap_exactly() {
    use agentstate::{BudgetKey, BudgetRecord, BudgetStore, Caps, Hold};
    if role().as_deref() == Some("b6") {
        let s = store(Options::new());
        let (tenant, who) = (env("AGENTSTATE_PG_PREFIX"), env("AGENTSTATE_PG_WHO"));
        wait_for_start();
        let won = AtomicU64::new(0);
        std::thread::scope(|sc| {
            for t in 0..4 {
                let (s, won, tenant) = (&s, &won, &tenant);
                let key = RunKey::new(tenant, format!("{who}-{t}"));
                sc.spawn(move || {
                    for i in 0.. {
                        let id = format!("h{i}");
                        match s.reserve(&key, Hold::new(&id, 600_000).cost_micros(1)) {
                            Ok(_) => {}
                            // Every hold is settled with what it held, so
                            // spent + held never shrinks: a refusal is final.
                            Err(StateError::BudgetExceeded { .. }) => return,
                            Err(e) => panic!("B6: reserve: {e:?}"),
                        }
                        let spent = StateDelta {
                            cost_micros: 1,
                            ..Default::default()
                        };
                        let st = s.settle(&key, &id, spent).expect("settle");
                        assert!(st.overshoot.is_zero());
                        won.fetch_add(1, Ordering::Relaxed);
                    }
                });
            }
        });
        println!("@@ {}", won.load(Ordering::Relaxed));
        return;
    }
    let tenant = unique("b6x");
    let n = rounds(150);
    let s = store(Options::new());
    let bk = BudgetKey::new(&tenant, "shared");
    s.put_budget(BudgetRecord::new(bk.clone(), Caps::new().cost_micros(n)))
        .expect("budget");
    for who in ["p0", "p1"] {
        for t in 0..4 {
            s.put_run(
                RunRecord::new(RunKey::new(&tenant, format!("{who}-{t}")), "a")
                    .with_budget("shared"),
            )
            .expect("run");
        }
    }
    let start = start_in(1500);
    let children: Vec<_> = ["p0", "p1"]
        .into_iter()
        .map(|who| {
            spawn_child(
                "postgres::b6_processes_share_one_budget_cap_exactly",
                &[
                    ("AGENTSTATE_PG_ROLE", "b6".into()),
                    ("AGENTSTATE_PG_PREFIX", tenant.clone()),
                    ("AGENTSTATE_PG_WHO", who.into()),
                    ("AGENTSTATE_PG_START", start.clone()),
                    ("AGENTSTATE_TEST_PG_DSN", shared_dsn().to_string()),
                    ("AGENTSTATE_PG_SCHEMA", schema().to_string()),
                ],
            )
        })
        .collect();
    let per: Vec<u64> = children
        .into_iter()
        .map(|c| {
            let l = child_lines(c, "a B6 process");
            assert_eq!(l.len(), 1, "{l:?}");
            l[0].parse().expect("a count")
        })
        .collect();
    assert_eq!(
        per.iter().sum::<u64>(),
        n,
        "B2: exactly the cap is reserved ({per:?})"
    );
    let b = s.get_budget(&bk).expect("get").expect("budget");
    assert_eq!(
        b.spent.cost_micros, n,
        "B6: the budget's spend is every settle"
    );
    assert_eq!((b.held.cost_micros, b.holds), (0, 0));
    eprintln!("B6 across processes: cap {n}, won per process {per:?}");
}

/// 8 processes run `setup()` at the same moment on an empty database; all
/// succeed and the schema is whole.
#[test]
fn setup_from_8_processes_at_once() {
    if role().as_deref() == Some("setup") {
        wait_for_start();
        let s = PostgresStore::connect(&env("AGENTSTATE_PG_DSN")).expect("connect");
        s.setup().expect("setup in a child");
        println!("@@ ok");
        return;
    }
    for _ in 0..rounds(2) {
        let dsn = fresh_db("setup8");
        let start = start_in(1500);
        let children: Vec<_> = (0..8)
            .map(|_| {
                spawn_child(
                    "postgres::setup_from_8_processes_at_once",
                    &[
                        ("AGENTSTATE_PG_ROLE", "setup".into()),
                        ("AGENTSTATE_PG_DSN", dsn.clone()),
                        ("AGENTSTATE_PG_START", start.clone()),
                    ],
                )
            })
            .collect();
        for (i, c) in children.into_iter().enumerate() {
            assert_eq!(child_lines(c, &format!("setup child {i}")), ["ok"]);
        }
        let s = PostgresStore::connect(&dsn).expect("connect");
        assert_eq!(s.schema_version().expect("version"), Some(10));
        let r = s
            .put_run(RunRecord::new(RunKey::new("t", "r"), "a"))
            .expect("put after setup");
        assert_eq!(r.seq, 1);
    }
}

/// R3 across processes: two processes race to create, then to update from
/// version 1, the same runs; exactly one wins each race.
#[test]
fn r3_racing_processes_exactly_one_wins() {
    if role().as_deref() == Some("r3") {
        let s = store(Options::new());
        let (prefix, n): (String, u64) = (
            env("AGENTSTATE_PG_PREFIX"),
            env("AGENTSTATE_PG_N").parse().expect("n"),
        );
        wait_for_start();
        for i in 0..n {
            let key = RunKey::new(&prefix, format!("r{i}"));
            let created = match s.put_run(RunRecord::new(key.clone(), "racer")) {
                Ok(r) => {
                    assert_eq!(r.version, 1);
                    1
                }
                Err(StateError::Conflict {
                    expected: 0,
                    actual,
                    ..
                }) if actual >= 1 => 0,
                Err(e) => panic!("R3: create {i}: {e:?}"),
            };
            let mut upd = RunRecord::new(key.clone(), "racer");
            upd.version = 1;
            upd.state = RunState::Running;
            let updated = match s.put_run(upd) {
                Ok(r) => {
                    assert_eq!(r.version, 2);
                    1
                }
                Err(StateError::Conflict {
                    expected: 1,
                    actual: 2,
                    ..
                }) => 0,
                Err(e) => panic!("R3: update {i}: {e:?}"),
            };
            println!("@@ {i} {created} {updated}");
        }
        return;
    }
    let prefix = unique("r3x");
    let n = rounds(1500);
    let start = start_in(1500);
    let children: Vec<_> = (0..2)
        .map(|_| {
            spawn_child(
                "postgres::r3_racing_processes_exactly_one_wins",
                &[
                    ("AGENTSTATE_PG_ROLE", "r3".into()),
                    ("AGENTSTATE_PG_PREFIX", prefix.clone()),
                    ("AGENTSTATE_PG_N", n.to_string()),
                    ("AGENTSTATE_PG_START", start.clone()),
                    ("AGENTSTATE_TEST_PG_DSN", shared_dsn().to_string()),
                    ("AGENTSTATE_PG_SCHEMA", schema().to_string()),
                ],
            )
        })
        .collect();
    let mut wins = vec![(0u32, 0u32); n as usize];
    let mut both_sides = [0u64; 2];
    for (who, c) in children.into_iter().enumerate() {
        let lines = child_lines(c, "an R3 racer");
        assert_eq!(lines.len() as u64, n, "every round reported");
        for l in lines {
            let v: Vec<u64> = l.split(' ').map(|x| x.parse().expect("number")).collect();
            wins[v[0] as usize].0 += v[1] as u32;
            wins[v[0] as usize].1 += v[2] as u32;
            both_sides[who] += v[1];
        }
    }
    for (i, (c, u)) in wins.iter().enumerate() {
        assert_eq!(
            (*c, *u),
            (1, 1),
            "R3: round {i}: one create and one update win"
        );
    }
    let s = store(Options::new());
    for i in 0..n {
        let r = s
            .get_run(&RunKey::new(&prefix, format!("r{i}")))
            .expect("get")
            .expect("created");
        assert_eq!((r.version, r.state), (2, RunState::Running));
    }
    eprintln!("R3 across processes: {n} rounds, creates won per process {both_sides:?}");
}

/// T6 across processes: per instance, one process writes at epoch e, the
/// other at e+1; nothing from e is stored once e+1 is.
#[test]
fn t6_epochs_e_and_e_plus_1_across_processes() {
    if let Some(r) = role().filter(|r| r.starts_with("t6")) {
        let s = store(Options::new());
        let (prefix, n): (String, u64) = (
            env("AGENTSTATE_PG_PREFIX"),
            env("AGENTSTATE_PG_N").parse().expect("n"),
        );
        let (epoch, doc, tries) = if r == "t6-old" {
            (1, "old", 3)
        } else {
            (2, "new", 1)
        };
        wait_for_start();
        let mut won = 0;
        for i in 0..n {
            let inst = InstanceKey::new(&prefix, format!("i{i}"));
            let key = inst.tray("t", "x");
            for _ in 0..tries {
                let tray = Tray {
                    marked: true,
                    doc: doc.as_bytes().to_vec(),
                    env: "e".into(),
                    hostname: "h".into(),
                };
                match s.write_tray(&key, epoch, tray) {
                    Ok(()) => won += 1,
                    Err(StateError::FenceLost {
                        caller: 1,
                        stored: 2,
                        ..
                    }) if epoch == 1 => break,
                    Err(e) => panic!("T6: {r} round {i}: {e:?}"),
                }
            }
        }
        println!("@@ {won}");
        return;
    }
    let prefix = unique("t6x");
    let n = rounds(1500);
    let start = start_in(1500);
    let children: Vec<_> = ["t6-old", "t6-new"]
        .iter()
        .map(|r| {
            spawn_child(
                "postgres::t6_epochs_e_and_e_plus_1_across_processes",
                &[
                    ("AGENTSTATE_PG_ROLE", r.to_string()),
                    ("AGENTSTATE_PG_PREFIX", prefix.clone()),
                    ("AGENTSTATE_PG_N", n.to_string()),
                    ("AGENTSTATE_PG_START", start.clone()),
                    ("AGENTSTATE_TEST_PG_DSN", shared_dsn().to_string()),
                    ("AGENTSTATE_PG_SCHEMA", schema().to_string()),
                ],
            )
        })
        .collect();
    let won: Vec<String> = children
        .into_iter()
        .flat_map(|c| child_lines(c, "a T6 holder"))
        .collect();
    let s = store(Options::new());
    for i in 0..n {
        let inst = InstanceKey::new(&prefix, format!("i{i}"));
        assert_eq!(s.epoch(&inst).expect("epoch"), 2, "T6: round {i}");
        let t = s
            .read_tray(&inst.tray("t", "x"), 2)
            .expect("read")
            .expect("written");
        assert_eq!(
            t.doc, b"new",
            "T6: round {i}: a write at epoch 1 landed after epoch 2"
        );
    }
    eprintln!("T6 across processes: {n} rounds; writes that won (old, new): {won:?}");
}

/// A creator that takes its seq and then stalls does not let a later
/// creator of the same tenant commit first: a walk never skips a record
/// that commits late.
#[test]
fn seq_never_lets_a_walk_skip_a_late_commit() {
    let s = Arc::new(store(Options::new()));
    let tenant = unique("seq");
    s.put_run(RunRecord::new(RunKey::new(&tenant, "first"), "a"))
        .expect("first");
    // Stall creator A inside its transaction after it took its seq: an
    // uncommitted row with A's key makes A's insert wait.
    let mut raw = postgres::Client::connect(shared_dsn(), postgres::NoTls).expect("raw");
    let mut blocker = raw.transaction().expect("begin");
    blocker
        .execute(
            &format!(
                "INSERT INTO \"{}\".agentstate_runs (tenant, run_id, seq, state, agent_name, updated_at, record) \
                 VALUES ($1, 'late', 999999, 'pending', 'x', 0, '\\x00')",
                schema()
            ),
            &[&tenant],
        )
        .expect("blocker row");
    let a = {
        let s = s.clone();
        let t = tenant.clone();
        std::thread::spawn(move || s.put_run(RunRecord::new(RunKey::new(t, "late"), "a")))
    };
    std::thread::sleep(Duration::from_millis(300));
    let b_done = Arc::new(AtomicBool::new(false));
    let b = {
        let (s, t, done) = (s.clone(), tenant.clone(), b_done.clone());
        std::thread::spawn(move || {
            let r = s.put_run(RunRecord::new(RunKey::new(t, "early"), "a"));
            done.store(true, Ordering::SeqCst);
            r
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    let page = s
        .list_runs(&StateQuery::new(&tenant), &PageRequest::new(10))
        .expect("walk while A stalls");
    let ids: Vec<&str> = page.items().iter().map(|r| r.key.run_id.as_str()).collect();
    assert_eq!(
        ids,
        ["first"],
        "no later seq is visible while an earlier one is uncommitted"
    );
    assert!(
        !b_done.load(Ordering::SeqCst),
        "B waits for A's seq to commit"
    );
    blocker.rollback().expect("release A");
    let a = a.join().expect("A").expect("A commits");
    let b = b.join().expect("B").expect("B commits");
    assert!(
        a.seq < b.seq,
        "seq order is commit order: {} {}",
        a.seq,
        b.seq
    );
    let ids: Vec<String> = s
        .iter_runs(&StateQuery::new(&tenant))
        .map(|r| r.expect("walk").key.run_id)
        .collect();
    assert_eq!(ids, ["first", "late", "early"]);
}

/// The seed's sweeper reads `pinned_tray_index` with plain SQL and sees
/// exactly the marked trays the store wrote, each JSON doc as its jsonb.
#[test]
fn sweeper_sql_sees_exactly_the_marked_trays() {
    let s = store(Options::new());
    let ns = unique("sweep");
    let mut want = BTreeSet::new();
    for i in 0..25 {
        let inst = InstanceKey::new(&ns, format!("i{i:02}"));
        let mut ops = Vec::new();
        for j in 0..4 {
            let marked = (i + j) % 3 != 0;
            ops.push(TrayOp::Put {
                tray_ns: "chat".into(),
                tray_id: format!("t{j}"),
                tray: Tray {
                    marked,
                    doc: format!(r#"{{"tray":"{}/t{j}"}}"#, inst.id).into_bytes(),
                    env: format!("env{}", i % 2),
                    hostname: format!("host{i}"),
                },
            });
            if marked && i % 5 != 0 {
                want.insert((
                    inst.id.clone(),
                    format!("t{j}"),
                    format!("env{}", i % 2),
                    format!("host{i}"),
                ));
            }
        }
        s.apply_batch(&inst, 1, ops).expect("batch");
        if i % 5 == 0 {
            s.release(&inst, 1).expect("release");
        }
    }
    // A delete removes a marked tray from the sweeper's view.
    let gone = InstanceKey::new(&ns, "i01");
    assert!(s.delete_tray(&gone.tray("chat", "t0"), 1).expect("delete"));
    want.remove(&(
        "i01".to_string(),
        "t0".to_string(),
        "env1".into(),
        "host1".into(),
    ));

    let mut c = postgres::Client::connect(shared_dsn(), postgres::NoTls).expect("raw");
    let sql = format!(
        "SELECT ns, id, tray_ns, tray_id, env, hostname, doc ->> 'tray' FROM \"{}\".pinned_tray_index \
         WHERE marked AND ns = $1 AND (id, tray_ns, tray_id) > ($2, $3, $4) \
         ORDER BY ns, id, tray_ns, tray_id LIMIT 7",
        schema()
    );
    let mut got = BTreeSet::new();
    let mut after = (String::new(), String::new(), String::new());
    loop {
        let rows = c
            .query(&sql, &[&ns, &after.0, &after.1, &after.2])
            .expect("the sweeper's query");
        for r in &rows {
            let (id, tns, tid): (String, String, String) = (r.get(1), r.get(2), r.get(3));
            assert_eq!(tns, "chat");
            let doc: String = r.get(6);
            assert_eq!(doc, format!("{id}/{tid}"), "the doc as written");
            assert!(
                got.insert((id.clone(), tid.clone(), r.get(4), r.get(5))),
                "seen once"
            );
            after = (id, tns, tid);
        }
        if rows.len() < 7 {
            break;
        }
    }
    assert_eq!(got, want, "the sweeper sees exactly the marked trays");
    // The store's own listing agrees.
    let listed: BTreeSet<_> = s
        .iter_marked_trays(None)
        .map(|m| m.expect("walk"))
        .filter(|m| m.key.ns == ns)
        .map(|m| (m.key.id, m.key.tray_id, m.env, m.hostname))
        .collect();
    assert_eq!(listed, want);
}

/// Amounts live inside the encoded record: values past i64::MAX round-trip
/// and add up to u64::MAX; one more is `Invalid` and nothing is written.
/// A patch of a run is a HOT update (no index entry rewritten): schema 6's
/// `fields` and its generated columns are in no index and no index's
/// predicate, so its writes cost what they did before it.
#[test]
fn patches_are_hot_updates() {
    let schema = unique("hot").replace('-', "_");
    {
        let s = PostgresStore::connect_with(shared_dsn(), PgOptions::new().schema(&schema))
            .expect("connect");
        s.setup().expect("setup");
        let run = s
            .put_run(RunRecord::new(RunKey::new("t", "r"), "a").with_label("k", "v"))
            .expect("put");
        let one = StateDelta {
            cost_micros: 1,
            ..StateDelta::default()
        };
        for _ in 0..50 {
            s.patch_run(&run.key, one).expect("patch");
        }
        // Dropped: its connections close, and their statistics are sent.
    }
    let mut c = postgres::Client::connect(shared_dsn(), postgres::NoTls).expect("raw");
    let deadline = Instant::now() + Duration::from_secs(30);
    let (upd, hot) = loop {
        let r = c
            .query_one(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables \
                 WHERE schemaname = $1 AND relname = 'agentstate_runs'",
                &[&schema],
            )
            .expect("stats");
        let (upd, hot): (i64, i64) = (r.get(0), r.get(1));
        if upd >= 50 || Instant::now() > deadline {
            break (upd, hot);
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(upd >= 50, "the server counted {upd} updates");
    assert!(hot * 10 >= upd * 9, "{hot} of {upd} updates were HOT");
    c.batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .expect("drop");
}

/// `verify` checks the label index (R11) against each run's labels: a
/// label row lost, one added, or one at another seq is reported.
#[test]
fn verify_checks_the_label_rows() {
    let schema = unique("labelrows").replace('-', "_");
    let s = PostgresStore::connect_with(shared_dsn(), PgOptions::new().schema(&schema))
        .expect("connect");
    s.setup().expect("setup");
    let run = s
        .put_run(
            RunRecord::new(RunKey::new("t", "r"), "a")
                .with_label("team", "a")
                .with_label("n", 1),
        )
        .expect("put");
    assert!(s.verify().expect("verify").is_ok());
    let mut c = postgres::Client::connect(shared_dsn(), postgres::NoTls).expect("raw");
    let labels = format!("\"{schema}\".agentstate_run_labels");
    for (tamper, undo) in [
        (
            format!("DELETE FROM {labels} WHERE label = 'n'"),
            format!(
                "INSERT INTO {labels} VALUES ('t', 'n', '1', {}, 'r')",
                run.seq
            ),
        ),
        (
            format!(
                "INSERT INTO {labels} VALUES ('t', 'x', '2', {}, 'r')",
                run.seq
            ),
            format!("DELETE FROM {labels} WHERE label = 'x'"),
        ),
        (
            format!("UPDATE {labels} SET value = '\"b\"' WHERE label = 'team'"),
            format!("UPDATE {labels} SET value = '\"a\"' WHERE label = 'team'"),
        ),
    ] {
        c.batch_execute(&tamper).expect("tamper");
        let report = s.verify().expect("verify");
        assert!(
            report.problems.iter().any(|p| p.contains("label rows")),
            "{tamper}: {:?}",
            report.problems
        );
        c.batch_execute(&undo).expect("undo");
        assert!(s.verify().expect("verify").is_ok(), "after {undo}");
    }
    c.batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .expect("drop");
}

/// Rows another program writes into `pinned_tray_index` with plain SQL
/// never fail a listing: text that reads back as an id lists as that id,
/// and a row whose text holds an escape the store cannot read is left out
/// alone (`verify` names it), at every page size, with the walk going on
/// past runs of such rows (a page is never empty before the end, L3).
/// The example queries of docs/queries.sql, each run by its name on rows
/// the store wrote (schema 6's generated columns), with the answers they
/// must give; and the columns of a run hold its fields exactly, amounts
/// past i64 and text holding NUL included.
#[test]
fn example_queries_run_on_rows_the_store_wrote() {
    use agentstate::{Caps, ToolCall, Usage};
    let s = store(Options::new());
    let t = unique("queries");
    let delta = |cost: u64, input: u64, output: u64, iterations: u64| StateDelta {
        usage: Usage {
            input_tokens: input,
            output_tokens: output,
        },
        cost_micros: cost,
        iterations,
        messages_read: 0,
    };
    let put = |id: &str, agent: &str, f: &dyn Fn(RunRecord) -> RunRecord| {
        s.put_run(f(RunRecord::new(RunKey::new(&t, id), agent)))
            .expect("put")
    };
    let p1 = put("p1", "planner", &|r| r.with_label("team", "a"));
    s.patch_run(&p1.key, delta(100, 10, 5, 2)).expect("patch");
    let p2 = put("p2", "planner", &|r| r.with_label("team", "a"));
    s.patch_run(&p2.key, delta(50, 1, 1, 1)).expect("patch");
    let c1 = put("c1", "coder", &|mut r| {
        r.pending_tool_calls = vec![ToolCall {
            id: "call-1".into(),
            name: "search".into(),
            arguments: "{\"q\": \"a\u{0}b\"}".into(),
        }];
        r.with_caps(Caps::new().cost_micros(100))
            .with_label("team", "b")
    });
    s.patch_run(&c1.key, delta(100, 0, 0, 1)).expect("patch");
    let c2 = put("c2", "coder", &|r| r.with_caps(Caps::new().iterations(3)));
    s.patch_run(&c2.key, delta(u64::MAX - 1, 0, 0, 1))
        .expect("past i64");

    let file = include_str!("../../docs/queries.sql");
    let query = |name: &str| -> String {
        let start = file
            .find(&format!("-- name: {name}\n"))
            .unwrap_or_else(|| panic!("docs/queries.sql has no query {name}"));
        let rest = &file[start..];
        rest[..rest.find(';').expect("a query ends with ;")].to_string()
    };
    let names: Vec<&str> = file
        .lines()
        .filter_map(|l| l.strip_prefix("-- name: "))
        .collect();
    assert_eq!(
        names,
        [
            "spend_per_agent_per_day",
            "runs_mid_tool_call",
            "runs_at_their_cap",
            "runs_by_label"
        ],
        "each documented query is checked below"
    );
    let mut c = postgres::Client::connect(shared_dsn(), postgres::NoTls).expect("raw");
    c.batch_execute(&format!("SET search_path TO \"{}\"", schema()))
        .expect("search_path");
    // Each row as a JSON object of its columns.
    let rows = |c: &mut postgres::Client, name: &str| -> Vec<serde_json::Value> {
        // Every column as its text, exactly (numeric sums pass u64).
        let sql = format!(
            "SELECT (SELECT jsonb_object_agg(key, value #>> '{{}}') FROM jsonb_each(to_jsonb(q)))::text \
             FROM ({}) q",
            query(name)
        );
        c.query(&sql, &[&t])
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .iter()
            .map(|r| serde_json::from_str(&r.get::<_, String>(0)).expect("json"))
            .collect()
    };
    let pick = |rows: &[serde_json::Value], keys: &[&str]| -> Vec<String> {
        rows.iter()
            .map(|r| {
                let v: Vec<String> = keys
                    .iter()
                    .map(|k| r[*k].as_str().unwrap_or("null").to_string())
                    .collect();
                v.join(" ")
            })
            .collect()
    };
    let spend = rows(&mut c, "spend_per_agent_per_day");
    // Amounts are numeric: the coder's sum is past u64, exactly.
    let coder = u128::from(u64::MAX) - 1 + 100;
    assert_eq!(
        pick(
            &spend,
            &["agent_name", "runs", "cost_micros", "tokens", "iterations"]
        ),
        [
            format!("coder 2 {coder} 0 2"),
            "planner 2 150 17 3".to_string()
        ]
    );
    let mid = rows(&mut c, "runs_mid_tool_call");
    assert_eq!(
        pick(&mid, &["run_id", "pending", "first_tool"]),
        ["c1 1 search"]
    );
    let capped = rows(&mut c, "runs_at_their_cap");
    assert_eq!(
        pick(&capped, &["run_id", "cost_micros", "cost_micros_max"]),
        ["c1 100 100"]
    );
    let teams = rows(&mut c, "runs_by_label");
    assert_eq!(
        pick(&teams, &["team", "runs", "cost_micros"]),
        ["a 2 150", "b 1 100"]
    );

    // A run's columns, exactly.
    let r = c
        .query_one(
            "SELECT version::text, cost_micros::text, iterations::text, created_at::text, \
             iterations_max::text, cost_micros_max::text, pending_tool_calls::text, labels::text, \
             budget FROM agentstate_runs WHERE tenant = $1 AND run_id = 'c2'",
            &[&t],
        )
        .expect("c2's columns");
    let c2 = s.get_run(&c2.key).expect("get").expect("c2");
    assert_eq!(r.get::<_, String>(0), c2.version.to_string());
    assert_eq!(r.get::<_, String>(1), (u64::MAX - 1).to_string());
    assert_eq!(r.get::<_, String>(2), "1");
    assert_eq!(r.get::<_, String>(3), c2.created_at.to_string());
    assert_eq!(r.get::<_, String>(4), "3");
    assert_eq!(r.get::<_, Option<String>>(5), None);
    assert_eq!(r.get::<_, String>(6), "[]");
    assert_eq!(r.get::<_, String>(7), "{}");
    assert_eq!(r.get::<_, Option<String>>(8), None);
    // The NUL in c1's tool call arguments is stored as ids are (escaped).
    let args: String = c
        .query_one(
            "SELECT pending_tool_calls -> 0 ->> 'arguments' FROM agentstate_runs \
             WHERE tenant = $1 AND run_id = 'c1'",
            &[&t],
        )
        .expect("c1")
        .get(0);
    assert_eq!(args, "{\"q\": \"a\u{1}\u{1}b\"}");
    assert!(s.verify().expect("verify").is_ok());
}

/// A4 on PostgreSQL: a sweeper reading `pinned_tray_index` with the seeds'
/// SQL finds each alarm as its marked `("pinned", "alarm")` row, its doc
/// `{"due_at": <milliseconds>}`, for exactly as long as the alarm is set;
/// `release` does not unmark it.
#[test]
fn a4_a_seed_sweeper_reads_alarms_as_rows() {
    let s = store(Options::new());
    let ns = unique("alarmrows");
    let mut c = postgres::Client::connect(shared_dsn(), postgres::NoTls).expect("raw");
    // What the seeds' sweeper reads: the marked ("pinned", "alarm") rows.
    let sql = format!(
        "SELECT id, doc ->> 'due_at', env, hostname, doc::text FROM \"{}\".pinned_tray_index \
         WHERE marked AND ns = $1 \
         AND tray_ns = 'pinned' AND tray_id = 'alarm' ORDER BY id",
        schema()
    );
    let rows = |c: &mut postgres::Client| -> Vec<(String, String)> {
        c.query(&sql, &[&ns])
            .expect("the sweeper's query")
            .iter()
            .map(|r| {
                let (env, host): (String, String) = (r.get(2), r.get(3));
                assert_eq!((env.as_str(), host.as_str()), ("", ""));
                let (due, doc): (String, String) = (r.get(1), r.get(4));
                assert_eq!(doc, format!(r#"{{"due_at": {due}}}"#), "a JSON object");
                (r.get(0), due)
            })
            .collect()
    };
    let (a, b) = (InstanceKey::new(&ns, "a"), InstanceKey::new(&ns, "b"));
    s.set_alarm(&a, 1, 1_700_000_000_000).expect("set a");
    s.set_alarm(&b, 3, u64::MAX).expect("set b");
    let t = Tray {
        marked: true,
        doc: b"x".to_vec(),
        env: "env".into(),
        hostname: "host".into(),
    };
    s.write_tray(&a.tray("chat", "t"), 1, t)
        .expect("a marked tray");
    assert_eq!(
        rows(&mut c),
        [
            ("a".into(), "1700000000000".into()),
            ("b".into(), u64::MAX.to_string())
        ]
    );
    s.set_alarm(&a, 1, 5).expect("set a again");
    s.release(&a, 1).expect("release leaves the alarm");
    assert_eq!(rows(&mut c)[0], ("a".into(), "5".into()));
    assert!(s.ack_alarm(&a, 1, 5).expect("ack"));
    assert_eq!(rows(&mut c), [("b".into(), u64::MAX.to_string())]);
    assert!(s.ack_alarm(&b, 3, u64::MAX).expect("ack"));
    assert!(rows(&mut c).is_empty());
}

/// Rows another program wrote with plain SQL, ids holding U+0001 outside
/// this store's escaped form included, never fail a listing: each is
/// listed under its text (an escaped one under its id), once per walk.
#[test]
fn foreign_rows_never_fail_a_listing() {
    let schema = unique("foreign").replace('-', "_");
    let s = PostgresStore::connect_with(shared_dsn(), PgOptions::new().schema(&schema))
        .expect("connect");
    s.setup().expect("setup");
    let mut c = postgres::Client::connect(shared_dsn(), postgres::NoTls).expect("raw");
    let insert = format!(
        "INSERT INTO \"{schema}\".pinned_tray_index VALUES ($1, $2, $3, $4, true, '{{}}', $5, $6)"
    );
    // (id, tray_id, env, reads back as): an id not in the escaped form
    // reads as its text.
    let rows: &[(&str, &str, &str, &str)] = &[
        ("a", "main", "prod", "a"),
        ("b\u{1}\u{2}x", "main", "prod", "b\u{1}x"),
        ("odd\u{1}id", "main", "prod", "odd\u{1}id"),
        ("odd\u{1}ie", "main", "prod", "odd\u{1}ie"),
        ("odd\u{1}if", "main", "prod", "odd\u{1}if"),
        ("p", "main", "prod", "p"),
        ("q", "main", "prod\u{1}", "q"),
        ("q", "zz", "dev", "q"),
        ("tail\u{1}", "main", "prod", "tail\u{1}"),
        ("z", "main", "prod", "z"),
    ];
    for (id, tray_id, env, _) in rows {
        c.execute(&insert, &[&"py", id, &"state", tray_id, env, &"py"])
            .expect("a foreign writer's row");
    }
    for env in [None, Some("prod")] {
        let want: Vec<(String, String)> = rows
            .iter()
            .filter(|r| env.is_none_or(|e| r.2 == e))
            .map(|r| (r.3.to_string(), r.1.to_string()))
            .collect();
        for limit in [1, 2, 3, 100] {
            let mut got = Vec::new();
            let mut cursor = None;
            loop {
                let page = s
                    .marked_trays(env, &PageRequest::new(limit).with_cursor(cursor))
                    .unwrap_or_else(|e| panic!("a foreign row failed the page ({limit}): {e}"));
                assert!(!page.items().is_empty() || page.cursor().is_none(), "L3");
                got.extend(
                    page.items()
                        .iter()
                        .map(|m| (m.key.id.clone(), m.key.tray_id.clone())),
                );
                cursor = page.cursor().cloned();
                if cursor.is_none() {
                    break;
                }
            }
            assert_eq!(got, want, "env {env:?}, limit {limit}");
        }
    }
    // The instance's own listing too; a row read back through an escape is
    // addressed by the id it reads as.
    for limit in [1, 2, 100] {
        let inst = InstanceKey::new("py", "q");
        let mut got = Vec::new();
        let mut cursor = None;
        loop {
            let page = s
                .list_trays(&inst, 1, &PageRequest::new(limit).with_cursor(cursor))
                .expect("list_trays past a foreign row");
            got.extend(page.items().iter().map(|(k, _)| k.tray_id.clone()));
            cursor = page.cursor().cloned();
            if cursor.is_none() {
                break;
            }
        }
        assert_eq!(got, ["main", "zz"], "limit {limit}");
    }
    let b = InstanceKey::new("py", "b\u{1}x");
    let tray = s.read_tray(&b.tray("state", "main"), 1).expect("read");
    assert_eq!(tray.expect("the foreign row").env, "prod");
    // An env not in the escaped form reads as its text too.
    let q = InstanceKey::new("py", "q");
    let tray = s.read_tray(&q.tray("state", "main"), 1).expect("read");
    assert_eq!(tray.expect("the foreign row").env, "prod\u{1}");
    let report = s.verify().expect("verify");
    let named: Vec<_> = report
        .problems
        .iter()
        .filter(|p| p.contains("listings show this row under its text"))
        .collect();
    assert_eq!(named.len(), 5, "{:?}", report.problems);
    c.batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .expect("drop");
}

#[test]
fn amounts_past_i64_never_wrap() {
    let s = store(Options::new());
    let key = RunKey::new(unique("amt"), "r");
    s.put_run(RunRecord::new(key.clone(), "a")).expect("create");
    let big = i64::MAX as u64 + 5;
    let r = s
        .patch_run(
            &key,
            StateDelta {
                cost_micros: big,
                ..Default::default()
            },
        )
        .expect("past i64::MAX");
    assert_eq!(r.cost_micros, big);
    let r = s
        .patch_run(
            &key,
            StateDelta {
                cost_micros: u64::MAX - big,
                ..Default::default()
            },
        )
        .expect("to u64::MAX");
    assert_eq!(r.cost_micros, u64::MAX);
    let e = s
        .patch_run(
            &key,
            StateDelta {
                cost_micros: 1,
                ..Default::default()
            },
        )
        .expect_err("overflow");
    assert!(matches!(e, StateError::Invalid { .. }), "{e:?}");
    let r = s.get_run(&key).expect("get").expect("run");
    assert_eq!((r.cost_micros, r.version), (u64::MAX, 3), "nothing written");
}

/// A server stopped with `pg_ctl stop -m immediate` under 8 threads: every
/// call while it is down is `Unavailable` within bounded time, nothing
/// panics; after a restart the same store works and every acknowledged
/// write is there, none half-applied.
#[test]
fn server_killed_mid_workload() {
    let server = PgServer::start(false);
    let connect = Duration::from_secs(1);
    let s = Arc::new(
        PostgresStore::connect_with(
            &server.dsn("postgres"),
            PgOptions::new()
                .connect_timeout(connect)
                .statement_timeout(Duration::from_secs(5)),
        )
        .expect("connect"),
    );
    s.setup().expect("setup");
    const THREADS: usize = 8;
    // 0 running, 1 stopped, 2 restarted.
    let phase = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(Mutex::new(vec![(0u64, 0u64); THREADS]));
    let start = Arc::new(Barrier::new(THREADS + 1));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (s, phase, done, acked, start) = (
                s.clone(),
                phase.clone(),
                done.clone(),
                acked.clone(),
                start.clone(),
            );
            std::thread::spawn(move || {
                let key = RunKey::new("fault", format!("r{t}"));
                let inst = InstanceKey::new("fault", format!("i{t}"));
                s.put_run(RunRecord::new(key.clone(), "w")).expect("create");
                start.wait();
                let (mut patches, mut batches) = (0u64, 0u64);
                let mut down_calls = 0u64;
                let mut slowest_down = Duration::ZERO;
                let mut i = 0u64;
                while !done.load(Ordering::SeqCst) {
                    i += 1;
                    let before = phase.load(Ordering::SeqCst);
                    let t0 = Instant::now();
                    let r = if i.is_multiple_of(2) {
                        s.patch_run(
                            &key,
                            StateDelta {
                                iterations: 1,
                                ..Default::default()
                            },
                        )
                        .map(|_| true)
                    } else {
                        let doc = (batches + 1).to_string().into_bytes();
                        let put = |id: &str| TrayOp::Put {
                            tray_ns: "t".into(),
                            tray_id: id.into(),
                            tray: Tray {
                                marked: true,
                                doc: doc.clone(),
                                env: "e".into(),
                                hostname: "h".into(),
                            },
                        };
                        s.apply_batch(&inst, 1, vec![put("a"), put("b")])
                            .map(|_| false)
                    };
                    let after = phase.load(Ordering::SeqCst);
                    assert!(
                        r.is_err() || before != 1 || after != 1,
                        "thread {t}: Ok from a server that was down"
                    );
                    match r {
                        Ok(true) => patches += 1,
                        Ok(false) => batches += 1,
                        // A call whose COMMIT was sent when the server
                        // died may have landed: OutcomeUnknown (I7).
                        Err(StateError::Persistence {
                            reason:
                                PersistenceReason::Unavailable
                                | PersistenceReason::OutcomeUnknown { keyed: false },
                            ..
                        }) => {
                            if before == 1 && after == 1 {
                                down_calls += 1;
                                slowest_down = slowest_down.max(t0.elapsed());
                            }
                            assert!(before != 2, "thread {t}: a call after the restart failed");
                        }
                        Err(e) => panic!("thread {t}: {e:?}"),
                    }
                    acked.lock().expect("lock")[t] = (patches, batches);
                }
                (down_calls, slowest_down)
            })
        })
        .collect();
    start.wait();
    std::thread::sleep(Duration::from_millis(1500));
    server.stop_immediate();
    phase.store(1, Ordering::SeqCst);
    std::thread::sleep(Duration::from_secs(3));
    // Calls that started while it was down must have failed: checked by
    // the threads (any Ok while down would be counted below).
    let acked_at_stop = acked.lock().expect("lock").clone();
    phase.store(3, Ordering::SeqCst);
    server.restart();
    // Let calls that were waiting for a connection give up, then require
    // success.
    std::thread::sleep(connect + Duration::from_millis(500));
    phase.store(2, Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(1000));
    done.store(true, Ordering::SeqCst);
    let mut down_total = 0;
    for h in handles {
        let (down, slowest) = h.join().expect("no thread panicked");
        down_total += down;
        assert!(
            slowest < connect + Duration::from_secs(3),
            "a call on a dead server took {slowest:?}"
        );
    }
    assert!(down_total > 0, "calls were made while the server was down");
    let final_acked = acked.lock().expect("lock").clone();
    for t in 0..THREADS {
        let (patches, batches) = final_acked[t];
        assert!(
            patches > acked_at_stop[t].0 || batches > acked_at_stop[t].1,
            "thread {t} worked after the restart"
        );
        let r = s
            .get_run(&RunKey::new("fault", format!("r{t}")))
            .expect("get")
            .expect("run");
        // At most one call per thread was in flight when the server died:
        // it may have committed without its Ok arriving.
        assert!(
            r.iterations == patches || r.iterations == patches + 1,
            "thread {t}: {} iterations stored, {patches} acknowledged",
            r.iterations
        );
        assert_eq!(
            r.version,
            r.iterations + 1,
            "thread {t}: no half-applied patch"
        );
        let inst = InstanceKey::new("fault", format!("i{t}"));
        let a = s
            .read_tray(&inst.tray("t", "a"), 1)
            .expect("read")
            .expect("a");
        let b = s
            .read_tray(&inst.tray("t", "b"), 1)
            .expect("read")
            .expect("b");
        assert_eq!(a.doc, b.doc, "thread {t}: a batch was half-applied");
        let n: u64 = String::from_utf8(a.doc).expect("utf8").parse().expect("n");
        assert!(
            n == batches || n == batches + 1,
            "thread {t}: batch {n} stored, {batches} acknowledged"
        );
    }
    eprintln!("fault: {down_total} calls refused while the server was down");
}

/// What the cutting proxy of `i7_…` does to the next transaction.
mod cut {
    /// Pass everything through.
    pub const NONE: u8 = 0;
    /// Forward the COMMIT, but close the client's side first: the server
    /// commits and the answer is lost.
    pub const AFTER_COMMIT: u8 = 1;
    /// Close both sides instead of forwarding the COMMIT: the server
    /// aborts, and the client cannot tell.
    pub const INSTEAD_OF_COMMIT: u8 = 2;
    /// Close both sides at the first message after BEGIN, before the
    /// COMMIT is sent.
    pub const BEFORE_COMMIT: u8 = 3;
}

/// A TCP proxy to the shared server that cuts a connection where `mode`
/// says (once, then passes through again); its port.
fn cutting_proxy(mode: Arc<std::sync::atomic::AtomicU8>) -> (u16, tokio_postgres::Config) {
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener, TcpStream};
    let cfg: tokio_postgres::Config = shared_dsn().parse().expect("the shared dsn");
    let port = cfg.get_ports().first().copied().unwrap_or(5432);
    let host = match cfg.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        _ => "127.0.0.1".to_string(),
    };
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let proxy_port = listener.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { return };
            let server = TcpStream::connect((host.as_str(), port)).expect("the server");
            let (c2, s2) = (
                client.try_clone().expect("clone"),
                server.try_clone().expect("clone"),
            );
            // Server to client: copied as is until either side closes.
            std::thread::spawn(move || {
                let (mut from, mut to) = (s2, c2);
                let _ = std::io::copy(&mut from, &mut to);
                let _ = to.shutdown(Shutdown::Both);
            });
            let mode = mode.clone();
            std::thread::spawn(move || {
                let (mut from, mut to) = (client, server);
                let mut buf = vec![0u8; 64 * 1024];
                let mut in_txn = false;
                loop {
                    let n = match from.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    let chunk = &buf[..n];
                    let has = |s: &[u8]| chunk.windows(s.len()).any(|w| w == s);
                    let m = mode.load(Ordering::SeqCst);
                    let commit = has(b"COMMIT\0");
                    let cut_now = match m {
                        cut::AFTER_COMMIT | cut::INSTEAD_OF_COMMIT => commit,
                        cut::BEFORE_COMMIT => in_txn && !commit,
                        _ => false,
                    };
                    if cut_now {
                        mode.store(cut::NONE, Ordering::SeqCst);
                        let _ = from.shutdown(Shutdown::Both);
                        if m == cut::AFTER_COMMIT {
                            let _ = to.write_all(chunk);
                            std::thread::sleep(Duration::from_millis(200));
                        }
                        let _ = to.shutdown(Shutdown::Both);
                        return;
                    }
                    // `BEGIN` alone, or the store's `BEGIN; SET LOCAL …` batch.
                    if has(b"BEGIN\0") || has(b"BEGIN;") {
                        in_txn = true;
                    }
                    if to.write_all(chunk).is_err() {
                        break;
                    }
                }
                let _ = to.shutdown(Shutdown::Both);
            });
        }
    });
    (proxy_port, cfg)
}

/// I7: a call whose connection broke after its COMMIT was sent is
/// `OutcomeUnknown` (it may have landed, or not), retryable only when it
/// carried a key, and the keyed retry answers the first outcome if it
/// landed and applies it if it did not: once either way. A break before
/// the COMMIT is `Unavailable`, and nothing was applied.
#[test]
fn i7_a_lost_commit_is_outcome_unknown_and_a_keyed_retry_applies_once() {
    use agentstate::IdempotencyKey;
    let mode = Arc::new(std::sync::atomic::AtomicU8::new(cut::NONE));
    let (port, cfg) = cutting_proxy(mode.clone());
    let mut dsn = format!(
        "host=127.0.0.1 port={port} user={} dbname={}",
        cfg.get_user().unwrap_or("postgres"),
        cfg.get_dbname().unwrap_or("postgres")
    );
    if let Some(p) = cfg.get_password() {
        dsn.push_str(&format!(" password={}", String::from_utf8_lossy(p)));
    }
    // Lazy: the connection is dialed by the first call, as the cuts expect.
    let cutting = PostgresStore::connect_with(
        &dsn,
        PgOptions::new().schema(schema()).pool_size(1).lazy(true),
    )
    .expect("connect through the proxy");
    let direct = store(Options::new());
    let rk = RunKey::new(unique("i7"), "r");
    direct
        .put_run(RunRecord::new(rk.clone(), "a"))
        .expect("create");
    let spend = |c: u64| StateDelta {
        cost_micros: c,
        ..Default::default()
    };
    let unknown = |e: &StateError, keyed: bool| {
        matches!(e, StateError::Persistence {
            reason: PersistenceReason::OutcomeUnknown { keyed: k },
            ..
        } if *k == keyed)
    };
    let cost = || direct.get_run(&rk).expect("get").expect("run").cost_micros;
    // Warm the proxied pool's connection (and its prepared statements).
    cutting.get_run(&rk).expect("through the proxy");

    // The COMMIT landed, its answer was lost.
    let k1 = IdempotencyKey::new("i7-landed").expect("key");
    mode.store(cut::AFTER_COMMIT, Ordering::SeqCst);
    let e = cutting
        .patch_run_idempotent(&rk, spend(5), &k1)
        .expect_err("the answer is lost");
    assert!(unknown(&e, true) && e.is_retryable(), "{e:?}");
    let again = direct
        .patch_run_idempotent(&rk, spend(5), &k1)
        .expect("the keyed retry");
    assert_eq!((again.cost_micros, cost()), (5, 5), "applied once");

    // The COMMIT never reached the server: the retry applies it.
    let k2 = IdempotencyKey::new("i7-lost").expect("key");
    mode.store(cut::INSTEAD_OF_COMMIT, Ordering::SeqCst);
    let e = cutting
        .patch_run_idempotent(&rk, spend(7), &k2)
        .expect_err("the commit is lost");
    assert!(unknown(&e, true) && e.is_retryable(), "{e:?}");
    assert_eq!(cost(), 5, "the server rolled it back");
    let again = cutting
        .patch_run_idempotent(&rk, spend(7), &k2)
        .expect("the keyed retry, through a new connection");
    assert_eq!((again.cost_micros, cost()), (12, 12), "applied once");
    let replay = direct
        .patch_run_idempotent(&rk, spend(7), &k2)
        .expect("a later repeat");
    assert_eq!(replay, again, "the repeat answers the retry's record");

    // Unkeyed: unknown and not retryable (a retry might apply twice).
    mode.store(cut::AFTER_COMMIT, Ordering::SeqCst);
    let e = cutting.patch_run(&rk, spend(1)).expect_err("lost answer");
    assert!(unknown(&e, false) && !e.is_retryable(), "{e:?}");
    // The proxy forwards the COMMIT just after cutting the client off.
    let deadline = Instant::now() + Duration::from_secs(5);
    while cost() != 13 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(cost(), 13, "it had landed");

    // Cut before the COMMIT was sent: certainly not applied. A run the
    // cutting store has not seen takes the locked path (BEGIN and the
    // locking read first, the COMMIT a round trip later); a seen run's
    // patch sends its COMMIT with its BEGIN, so it has no such moment.
    let rk2 = RunKey::new(rk.tenant.clone(), "r2");
    direct
        .put_run(RunRecord::new(rk2.clone(), "a"))
        .expect("create");
    let cost2 = || direct.get_run(&rk2).expect("get").expect("run").cost_micros;
    mode.store(cut::BEFORE_COMMIT, Ordering::SeqCst);
    let e = cutting
        .patch_run(&rk2, spend(100))
        .expect_err("cut mid-call");
    assert!(
        matches!(
            e,
            StateError::Persistence {
                reason: PersistenceReason::Unavailable,
                ..
            }
        ) && e.is_retryable(),
        "{e:?}"
    );
    assert_eq!((cost(), cost2()), (13, 0), "nothing was applied");
    assert_eq!(mode.load(Ordering::SeqCst), cut::NONE, "every cut happened");
}

/// TLS (libpq's `sslmode` on rustls), client certificates, and the
/// refusals a misconfigured client gets, on a server of their own (see
/// `PgServer::start_tls`).
mod tls {
    use super::*;
    use crate::pg_server::{TEST_PASSWORD, TlsFiles};

    fn server() -> &'static (PgServer, TlsFiles) {
        static S: OnceLock<(PgServer, TlsFiles)> = OnceLock::new();
        S.get_or_init(PgServer::start_tls)
    }

    /// Every error these tests saw, as `Display` and `{:?}`, for the
    /// password check.
    fn seen() -> &'static Mutex<Vec<String>> {
        static S: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
        S.get_or_init(|| Mutex::new(Vec::new()))
    }

    fn note(e: &StateError) {
        let mut s = format!("{e} | {e:?}");
        let mut cur = std::error::Error::source(e);
        while let Some(c) = cur {
            s.push_str(&format!(" | {c} | {c:?}"));
            cur = c.source();
        }
        assert!(
            !s.contains(TEST_PASSWORD) && !s.contains(WRONG),
            "a password in an error: {s}"
        );
        seen().lock().expect("lock").push(s);
    }

    const WRONG: &str = "Wr0ng-pass-Zk9";

    fn opts() -> PgOptions {
        PgOptions::new().schema("tls_checks")
    }

    /// Opens a connection (a read through the store): Ok, or the error
    /// and how long it took.
    /// The error and how long it took to come, boxed (a `Result` with a
    /// large `Err` is clippy's `result_large_err`).
    fn try_dsn(dsn: &str, o: PgOptions) -> std::result::Result<(), Box<(StateError, Duration)>> {
        let t = Instant::now();
        let r = PostgresStore::connect_with(dsn, o).and_then(|s| s.schema_version().map(|_| ()));
        r.map_err(|e| {
            note(&e);
            Box::new((e, t.elapsed()))
        })
    }

    fn ok(dsn: &str, o: PgOptions) {
        if let Err(x) = try_dsn(dsn, o) {
            panic!("{dsn}: {}", x.0);
        }
    }

    /// Refused, not retryable, quickly (the connect timeout is 5 s), with
    /// `words` in the message.
    fn refused(dsn: &str, o: PgOptions, words: &str) -> Duration {
        refused_within(dsn, o, words, Duration::ZERO)
    }

    /// [`refused`], allowing `client` for the client's own work before the
    /// server answers (SCRAM's key derivation takes most of a second in a
    /// debug build).
    fn refused_within(dsn: &str, o: PgOptions, words: &str, client: Duration) -> Duration {
        let (e, took) = match try_dsn(dsn, o) {
            Ok(()) => panic!("{dsn}: connected"),
            Err(x) => *x,
        };
        assert!(
            matches!(
                e,
                StateError::Persistence {
                    reason: PersistenceReason::Refused,
                    ..
                }
            ),
            "{dsn}: {e:?}"
        );
        assert!(!e.is_retryable(), "{e}");
        assert!(e.to_string().contains(words), "{dsn}: {e} lacks {words:?}");
        assert!(
            std::error::Error::source(&e).is_some(),
            "the driver's error"
        );
        assert!(took < client + Duration::from_secs(1), "{dsn}: {took:?}");
        eprintln!("@@ refused in {took:?}: {e}");
        took
    }

    fn url(user: &str, host: &str, query: &str) -> String {
        format!(
            "postgres://{user}@{host}:{}/postgres?{query}",
            server().0.port
        )
    }

    #[test]
    fn each_sslmode_connects_or_refuses_as_libpq_does() {
        let (_, f) = server();
        let ca = f.ca.display().to_string();
        let other = f.other_ca.display().to_string();
        let h = "127.0.0.1";
        // The hostssl-only user: no TLS is the server's refusal.
        refused(
            &url("sslonly", h, "sslmode=disable"),
            opts(),
            "no encryption",
        );
        ok(&url("sslonly", h, "sslmode=prefer"), opts());
        ok(&url("sslonly", h, ""), opts());
        ok(&url("sslonly", h, "sslmode=require"), opts());
        // require with a root certificate is verify-ca.
        ok(
            &url("sslonly", h, &format!("sslmode=require&sslrootcert={ca}")),
            opts(),
        );
        refused(
            &url(
                "sslonly",
                h,
                &format!("sslmode=require&sslrootcert={other}"),
            ),
            opts(),
            "certificate",
        );
        ok(
            &url("sslonly", h, &format!("sslmode=verify-ca&sslrootcert={ca}")),
            opts(),
        );
        refused(
            &url(
                "sslonly",
                h,
                &format!("sslmode=verify-ca&sslrootcert={other}"),
            ),
            opts(),
            "certificate",
        );
        for host in ["localhost", "127.0.0.1"] {
            ok(
                &url(
                    "sslonly",
                    host,
                    &format!("sslmode=verify-full&sslrootcert={ca}"),
                ),
                opts(),
            );
        }
        // A name not in the certificate: verify-ca does not look, verify-full does.
        let wrong = |mode: &str| {
            url(
                "sslonly",
                "db.wrong.invalid",
                &format!("sslmode={mode}&sslrootcert={ca}&hostaddr=127.0.0.1"),
            )
        };
        ok(&wrong("verify-ca"), opts());
        refused(
            &wrong("verify-full"),
            opts(),
            "not a name in the server's certificate",
        );
        // libpq's key=value form, quoted values included.
        ok(
            &format!(
                "host=localhost port={} user=sslonly dbname=postgres sslmode=verify-full sslrootcert='{ca}'",
                server().0.port
            ),
            opts(),
        );
        // The options in code override the DSN.
        ok(
            &url("sslonly", "localhost", "sslmode=disable"),
            opts().ssl_mode("verify-full").ssl_root_cert(&f.ca),
        );
        // A rustls configuration built in code.
        let mut roots = rustls::RootCertStore::empty();
        use rustls::pki_types::pem::PemObject;
        for c in rustls::pki_types::CertificateDer::pem_file_iter(&f.ca).expect("ca") {
            roots.add(c.expect("pem")).expect("add");
        }
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            #[allow(deprecated)]
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
        ok(&url("sslonly", "localhost", ""), opts().tls(config));
        // libpq 16's `sslrootcert=system`: the OS's roots, which do not
        // hold this test CA; verify-full is implied, weaker is an error.
        let sys = url("sslonly", "localhost", "sslrootcert=system");
        if std::path::Path::new("/etc/ssl/certs")
            .read_dir()
            .is_ok_and(|mut d| d.next().is_some())
        {
            refused(&sys, opts(), "sslrootcert must name the CA");
        }
        let e = PostgresStore::connect_with(
            &url("sslonly", "localhost", "sslrootcert=system&sslmode=require"),
            opts(),
        )
        .expect_err("invalid");
        assert!(matches!(e, StateError::Invalid { .. }), "{e:?}");
        // A word libpq does not know, and a verify mode without a root.
        for (dsn, o) in [
            (url("sslonly", h, "sslmode=verify"), opts()),
            (url("sslonly", h, ""), opts().ssl_mode("full")),
            (url("sslonly", h, "sslmode=verify-full"), opts()),
        ] {
            let e = PostgresStore::connect_with(&dsn, o).expect_err("invalid");
            assert!(matches!(e, StateError::Invalid { .. }), "{e:?}");
        }
        // A server without TLS, when TLS is required.
        let plain = format!("{}?sslmode=require", shared_dsn());
        if !shared_dsn().contains('?') {
            refused(&plain, opts(), "no TLS");
        }
    }

    #[test]
    fn client_certificates() {
        let (_, f) = server();
        let ca = f.ca.display().to_string();
        let q = format!(
            "sslmode=verify-full&sslrootcert={ca}&sslcert={}&sslkey={}",
            f.client_cert.display(),
            f.client_key.display()
        );
        ok(&url("certuser", "localhost", &q), opts());
        ok(
            &url("certuser", "localhost", "sslmode=require"),
            opts().ssl_client_cert(&f.client_cert, &f.client_key),
        );
        refused(
            &url(
                "certuser",
                "localhost",
                &format!("sslmode=verify-full&sslrootcert={ca}"),
            ),
            opts(),
            "certificate",
        );
        // Only one of the two is a configuration error.
        let e = PostgresStore::connect_with(
            &url(
                "certuser",
                "localhost",
                &format!("sslcert={}", f.client_cert.display()),
            ),
            opts(),
        )
        .expect_err("invalid");
        assert!(matches!(e, StateError::Invalid { .. }), "{e:?}");
    }

    /// E3, fail fast: `connect_with` itself dials, so a wrong password or
    /// a user the server takes only over TLS is `Refused` from `connect`
    /// (not from the first call), quickly, and a server that is not there
    /// is `Unavailable` after the connect timeout. With `lazy(true)`
    /// `connect` opens nothing, and the first call answers the same.
    #[test]
    fn e3_connect_dials_once_and_refuses_at_once_unless_lazy() {
        let (s, _) = server();
        let port = s.port;
        let wrong = format!("postgres://pwuser:{WRONG}@127.0.0.1:{port}/postgres?sslmode=disable");
        let refused_now = |e: &StateError, words: &str| {
            note(e);
            assert!(
                matches!(
                    e,
                    StateError::Persistence {
                        reason: PersistenceReason::Refused,
                        ..
                    }
                ),
                "{e:?}"
            );
            assert!(!e.is_retryable(), "{e}");
            assert!(e.to_string().contains(words), "{e} lacks {words:?}");
        };
        let t = Instant::now();
        let e = PostgresStore::connect_with(&wrong, opts()).expect_err("a wrong password");
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        refused_now(&e, "28P01");
        // The same through connect_config.
        let mut config = tokio_postgres::Config::new();
        config
            .host("127.0.0.1")
            .port(port)
            .user("pwuser")
            .password(WRONG)
            .dbname("postgres")
            .ssl_mode(tokio_postgres::config::SslMode::Disable);
        let e = PostgresStore::connect_config(config, opts()).expect_err("a wrong password");
        refused_now(&e, "28P01");
        // Lazy: nothing opened; the first call answers the same error.
        let lazy = PostgresStore::connect_with(&wrong, opts().lazy(true)).expect("lazy");
        let e = lazy.schema_version().expect_err("the first call dials");
        refused_now(&e, "28P01");
        // Nothing listens: Unavailable from connect, after its timeout;
        // lazy, from the first call.
        let dead = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("port");
            l.local_addr().expect("addr").port()
        };
        let nobody = format!("postgres://agentstate@127.0.0.1:{dead}/postgres");
        let e = PostgresStore::connect_with(
            &nobody,
            opts().connect_timeout(Duration::from_millis(300)),
        )
        .expect_err("nothing listens");
        assert!(e.is_retryable(), "{e:?}");
        let lazy = PostgresStore::connect_with(
            &nobody,
            opts()
                .connect_timeout(Duration::from_millis(300))
                .lazy(true),
        )
        .expect("lazy opens nothing");
        assert!(
            lazy.schema_version()
                .expect_err("nothing listens")
                .is_retryable()
        );
        // The one dial is kept: the store works on it.
        PostgresStore::connect_with(&s.dsn("postgres"), opts())
            .expect("connect")
            .schema_version()
            .expect("a call");
    }

    /// E3, protocol mismatches named: `sslmode=require` to a server
    /// without TLS, and `sslmode=disable` for a user the server takes only
    /// over TLS (its `pg_hba.conf` has only a `hostssl` line for it), are
    /// `Refused` from `connect`, naming `sslmode`.
    #[test]
    fn e3_sslmode_mismatch_is_refused_naming_sslmode() {
        let (s, _) = server();
        // A server without TLS (the shared one, started without ssl).
        let plain = crate::pg_server::PgServer::start(false);
        let e = PostgresStore::connect_with(
            &format!("{}?sslmode=require", plain.dsn("postgres")),
            opts(),
        )
        .expect_err("TLS required of a server without it");
        note(&e);
        assert!(
            matches!(
                e,
                StateError::Persistence {
                    reason: PersistenceReason::Refused,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("sslmode"), "{e}");
        let e = PostgresStore::connect_with(
            &format!("{}?sslmode=disable", s.dsn_as("sslonly", "postgres")),
            opts(),
        )
        .expect_err("a TLS-only user without TLS");
        note(&e);
        assert!(
            matches!(
                e,
                StateError::Persistence {
                    reason: PersistenceReason::Refused,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(!e.is_retryable(), "{e}");
        assert!(e.to_string().contains("sslmode"), "{e}");
    }

    #[test]
    fn misconfigurations_are_refused_at_once_with_the_servers_words() {
        let (s, _) = server();
        let port = s.port;
        let pw =
            |p: &str| format!("postgres://pwuser:{p}@127.0.0.1:{port}/postgres?sslmode=disable");
        ok(&pw(TEST_PASSWORD), opts());
        let mut took = Vec::new();
        took.push((
            "wrong password",
            refused(
                &pw(WRONG),
                opts(),
                "password authentication failed for user \"pwuser\"",
            ),
        ));
        took.push((
            "wrong password, key=value",
            refused(
                &format!(
                    "host=127.0.0.1 port={port} user=pwuser password='{WRONG}' dbname=postgres"
                ),
                opts(),
                "28P01",
            ),
        ));
        // SCRAM: the client derives its key before the server answers
        // (most of a second in a debug build), allowed on top of the second.
        let scram = |p: &str| format!("postgres://scramuser:{p}@127.0.0.1:{port}/postgres");
        let t = Instant::now();
        ok(&scram(TEST_PASSWORD), opts());
        let client = t.elapsed();
        eprintln!("@@ a SCRAM connection with the right password: {client:?}");
        took.push((
            "wrong password, scram-sha-256",
            refused_within(&scram(WRONG), opts(), "28P01", client),
        ));
        took.push((
            "no password",
            refused(&s.dsn_as("pwuser", "postgres"), opts(), "password"),
        ));
        took.push((
            "unknown database",
            refused(
                &format!("postgres://pwuser:{TEST_PASSWORD}@127.0.0.1:{port}/no_such_db"),
                opts(),
                "database \"no_such_db\" does not exist",
            ),
        ));
        took.push((
            "pg_hba reject",
            refused(
                &s.dsn_as("rejected", "postgres"),
                opts(),
                "pg_hba.conf rejects connection",
            ),
        ));
        took.push((
            "hostssl only",
            refused(
                &format!("{}?sslmode=disable", s.dsn_as("sslonly", "postgres")),
                opts(),
                "28000",
            ),
        ));
        for (what, t) in &took {
            eprintln!("@@ {what}: {t:?}");
        }
        // Nothing listens: Unavailable after the timeout, naming host and
        // port, never the password.
        let dead = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("port");
            l.local_addr().expect("addr").port()
        };
        let t = Instant::now();
        let e = PostgresStore::connect_with(
            &format!("postgres://pwuser:{TEST_PASSWORD}@127.0.0.1:{dead}/postgres"),
            opts().connect_timeout(Duration::from_millis(300)),
        )
        .and_then(|s| s.schema_version())
        .expect_err("nothing listens");
        note(&e);
        assert!(e.is_retryable(), "{e}");
        assert!(
            matches!(
                e,
                StateError::Persistence {
                    reason: PersistenceReason::Unavailable,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains(&format!("127.0.0.1:{dead}")), "{e}");
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
        // The store's own Debug hides the password too.
        let store = PostgresStore::connect_with(&pw(TEST_PASSWORD), opts()).expect("connect");
        assert!(!format!("{store:?}").contains(TEST_PASSWORD));
        // Every error these tests saw so far, once more (each is checked
        // as it is seen, in `note`).
        let seen = seen().lock().expect("lock");
        assert!(seen.len() >= 7, "{}", seen.len());
        for s in seen.iter() {
            assert!(!s.contains(TEST_PASSWORD) && !s.contains(WRONG), "{s}");
        }
    }

    /// The whole conformance suite over `sslmode=verify-full`, as the
    /// user the server lets in only over TLS.
    #[cfg(feature = "conformance")]
    #[test]
    fn conformance_over_verify_full() {
        use agentstate::ManualClock;
        use agentstate::conformance::{ConformanceStore, RULES};
        let (s, f) = server();
        let dsn = format!(
            "postgres://sslonly@localhost:{}/postgres?sslmode=verify-full&sslrootcert={}",
            s.port,
            f.ca.display()
        );
        let o = || PgOptions::new().schema("conformance_tls");
        PostgresStore::connect_with(&dsn, o())
            .expect("connect")
            .setup()
            .expect("setup over TLS");
        let factory = |clock: Arc<ManualClock>| -> Arc<dyn ConformanceStore> {
            Arc::new(
                PostgresStore::connect_with(&dsn, o().options(Options::new().clock(clock)))
                    .expect("connect"),
            )
        };
        for (id, check) in RULES {
            eprintln!("@@ {id}");
            check(&factory);
        }
    }
}

/// The store behind PgBouncer in transaction mode: with the statement
/// cache off, every rule holds; with it on, a statement the next server
/// connection lacks is `Refused`, naming the fix.
mod pgbouncer {
    use super::*;
    use crate::pg_server::PgBouncer;

    fn bouncer() -> &'static PgBouncer {
        static B: OnceLock<PgBouncer> = OnceLock::new();
        B.get_or_init(|| {
            let cfg: tokio_postgres::Config = shared_dsn().parse().expect("the shared dsn");
            let host = match cfg.get_hosts().first() {
                Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
                _ => "127.0.0.1".to_string(),
            };
            let port = cfg.get_ports().first().copied().unwrap_or(5432);
            PgBouncer::start(&host, port, "transaction")
        })
    }

    #[test]
    fn a_cached_statement_on_another_server_connection_is_refused_naming_the_fix() {
        let b = bouncer();
        let o = PgOptions::new().schema("bouncer_cached").pool_size(1);
        let store = PostgresStore::connect_with(&b.dsn("postgres"), o.clone()).expect("connect");
        store.setup().expect("setup through the bouncer");
        // The cached statements are prepared on the server connection the
        // bouncer lent this transaction…
        assert!(store.schema_version().expect("read").is_some());
        // …which another client now holds (PgBouncer lends the last
        // released connection first), so the next transaction gets another.
        let mut other = postgres::Client::connect(&b.dsn("postgres"), postgres::NoTls).expect("c");
        other.batch_execute("BEGIN; SELECT 1").expect("pin");
        let e = store
            .schema_version()
            .expect_err("the statement is on the other connection");
        other.batch_execute("COMMIT").expect("unpin");
        assert!(
            matches!(
                e,
                StateError::Persistence {
                    reason: PersistenceReason::Refused,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("statement_cache"), "{e}");
        assert!(e.to_string().contains("session mode"), "{e}");
        eprintln!("@@ {e}");
        // Without the cache, the same works.
        let store =
            PostgresStore::connect_with(&b.dsn("postgres"), o.statement_cache(false)).expect("c");
        assert!(store.schema_version().expect("read").is_some());
        let mut other = postgres::Client::connect(&b.dsn("postgres"), postgres::NoTls).expect("c");
        other.batch_execute("BEGIN; SELECT 1").expect("pin");
        assert!(store.schema_version().expect("read").is_some());
        other.batch_execute("COMMIT").expect("unpin");
    }

    /// Session mode: the store works as over a direct connection, its
    /// statement cache on (nothing is sent as startup `options`, which
    /// PgBouncer refuses).
    #[test]
    fn session_mode_works_as_a_direct_connection() {
        let cfg: tokio_postgres::Config = shared_dsn().parse().expect("the shared dsn");
        let host = match cfg.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
            _ => "127.0.0.1".to_string(),
        };
        let port = cfg.get_ports().first().copied().unwrap_or(5432);
        let b = PgBouncer::start(&host, port, "session");
        let store = PostgresStore::connect_with(
            &b.dsn("postgres"),
            PgOptions::new().schema("bouncer_session"),
        )
        .expect("connect");
        store.setup().expect("setup");
        let rk = RunKey::new(unique("session"), "r");
        store.put_run(RunRecord::new(rk.clone(), "a")).expect("put");
        for _ in 0..3 {
            assert!(store.get_run(&rk).expect("get").is_some());
        }
    }

    /// The whole conformance suite through PgBouncer in transaction mode.
    #[cfg(feature = "conformance")]
    #[test]
    fn conformance_through_pgbouncer_in_transaction_mode() {
        use agentstate::ManualClock;
        use agentstate::conformance::{ConformanceStore, RULES};
        let dsn = bouncer().dsn("postgres");
        let o = || {
            PgOptions::new()
                .schema("bouncer_conformance")
                .statement_cache(false)
        };
        PostgresStore::connect_with(&dsn, o())
            .expect("connect")
            .setup()
            .expect("setup through the bouncer");
        let factory = |clock: Arc<ManualClock>| -> Arc<dyn ConformanceStore> {
            Arc::new(
                PostgresStore::connect_with(&dsn, o().options(Options::new().clock(clock)))
                    .expect("connect"),
            )
        };
        for (id, check) in RULES {
            eprintln!("@@ {id}");
            check(&factory);
        }
    }
}

/// `max_lifetime`: a connection past it is closed when its call gives it
/// back, and the next call dials a new one.
#[test]
fn a_connection_past_its_max_lifetime_is_replaced() {
    let app = unique("lifetime").replace('-', "_");
    let sep = if shared_dsn().contains('?') { '&' } else { '?' };
    let dsn = format!("{}{sep}application_name={app}", shared_dsn());
    let store = PostgresStore::connect_with(
        &dsn,
        PgOptions::new()
            .schema(schema())
            .pool_size(1)
            .max_lifetime(Some(Duration::from_millis(300))),
    )
    .expect("connect");
    let mut admin = postgres::Client::connect(shared_dsn(), postgres::NoTls).expect("admin");
    let mut pids = || -> Vec<i32> {
        admin
            .query(
                "SELECT pid FROM pg_stat_activity WHERE application_name = $1",
                &[&app],
            )
            .expect("pg_stat_activity")
            .iter()
            .map(|r| r.get(0))
            .collect()
    };
    store.schema_version().expect("read");
    let first = pids();
    assert_eq!(first.len(), 1, "{first:?}");
    // Young: kept.
    store.schema_version().expect("read");
    assert_eq!(pids(), first);
    std::thread::sleep(Duration::from_millis(400));
    // Old: used once more, then closed as it comes back.
    store.schema_version().expect("read");
    let until = Instant::now() + Duration::from_secs(5);
    while !pids().is_empty() {
        assert!(Instant::now() < until, "still open: {:?}", pids());
        std::thread::sleep(Duration::from_millis(20));
    }
    store.schema_version().expect("read");
    let second = pids();
    assert_eq!(second.len(), 1, "{second:?}");
    assert_ne!(second, first);
}

/// Async-native (issue 40): the store's own runtime, and the sync API
/// over it, from inside and outside callers' runtimes.
mod native {
    use super::*;
    use agentstate::AsyncStore;

    /// The shared DSN under an application name of this test's own (to
    /// find its server connections in `pg_stat_activity`), and that name.
    /// (The test harness's servers and schema are made with a sync
    /// client: in an async test, through `spawn_blocking`.)
    fn tagged_dsn(tag: &str) -> (String, String) {
        schema();
        let app = unique(tag).replace('-', "_");
        let sep = if shared_dsn().contains('?') { '&' } else { '?' };
        (format!("{}{sep}application_name={app}", shared_dsn()), app)
    }

    fn connect(dsn: &str, pool: u32) -> PostgresStore {
        PostgresStore::connect_with(dsn, PgOptions::new().schema(schema()).pool_size(pool))
            .expect("connect")
    }

    /// Made, used (natively through `AsyncStore` and through the sync API
    /// from an executor thread) and dropped inside a runtime.
    async fn inside_a_runtime(flavor: &str) {
        let key = RunKey::new(unique("native"), flavor);
        let (dsn, _) = tokio::task::spawn_blocking(|| tagged_dsn("native"))
            .await
            .expect("the harness");
        // Native.
        let store = AsyncStore::new(connect(&dsn, 2));
        let put = store
            .put_run(RunRecord::new(key.clone(), "a"))
            .await
            .expect("put");
        assert_eq!(put.version, 1);
        let patched = store
            .patch_run(
                &key,
                StateDelta {
                    iterations: 2,
                    ..Default::default()
                },
            )
            .await
            .expect("patch");
        assert_eq!(patched.iterations, 2);
        let from: AsyncStore = connect(&dsn, 1).into();
        assert_eq!(
            from.get_run(&key).await.expect("get"),
            Some(patched.clone())
        );
        drop(from);
        drop(store);
        // The sync API, on this executor thread: it blocks the thread for
        // the call, and works on either flavor.
        let sync = connect(&dsn, 2);
        assert_eq!(sync.get_run(&key).expect("sync get"), Some(patched));
        sync.patch_run(
            &key,
            StateDelta {
                iterations: 1,
                ..Default::default()
            },
        )
        .expect("sync patch");
        assert_eq!(
            sync.schema_version_async().await.expect("version"),
            Some(10)
        );
        assert!(
            sync.list_sessions(&key.tenant, &PageRequest::new(10))
                .is_ok()
        );
        // Its async calls too, in this task.
        let got = sync.setup_async().await;
        assert!(got.is_ok(), "{got:?}");
        drop(sync);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_store_lives_and_dies_inside_a_current_thread_runtime() {
        inside_a_runtime("current").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_lives_and_dies_inside_a_multi_thread_runtime() {
        inside_a_runtime("multi").await;
    }

    /// Server connections of `app` still inside a transaction.
    fn idle_in_transaction(app: &str) -> i64 {
        let mut admin = postgres::Client::connect(shared_dsn(), postgres::NoTls).expect("admin");
        admin
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 \
                 AND state LIKE 'idle in transaction%'",
                &[&app],
            )
            .expect("pg_stat_activity")
            .get(0)
    }

    /// W3: a `put_run` future dropped at any point (a timeout of a few
    /// microseconds to a few milliseconds, many times) leaves the record
    /// at its old version or its new one, never half-written, and no
    /// connection inside a transaction: afterwards every pooled connection
    /// works.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropped_put_run_futures_leave_no_partial_write_and_no_open_transaction() {
        const POOL: u32 = 3;
        let (dsn, app) = tokio::task::spawn_blocking(|| tagged_dsn("dropped"))
            .await
            .expect("the harness");
        let store = AsyncStore::new(connect(&dsn, POOL));
        let key = RunKey::new(unique("dropped"), "r");
        let mut stored = store
            .put_run(RunRecord::new(key.clone(), "agent0"))
            .await
            .expect("create");
        let (mut finished, mut landed, mut cut, mut late) = (0u32, 0u32, 0u32, 0u32);
        // The rounds that tried to write each version: the one stored
        // must be one of them, whole.
        let mut tried: std::collections::HashMap<u64, Vec<String>> = Default::default();
        tried.insert(1, vec!["agent0".to_string()]);
        let mut dropped = 0u32;
        for round in 1..=rounds(300) {
            let mut next = stored.clone();
            next.agent_name = format!("agent{round}");
            tried
                .entry(stored.version + 1)
                .or_default()
                .push(next.agent_name.clone());
            // Dropped after 0 to ~600 turns of the scheduler (tokio's
            // timers tick in milliseconds, longer than a call here):
            // before the checkout, mid-pipeline, after the COMMIT was
            // sent, or not at all. Every tenth round is never dropped: on
            // a slow disk 600 turns can pass before any commit's flush
            // does, and a finished call must be seen too.
            let turns = (round * 7919) % 600;
            let done = tokio::select! {
                biased;
                r = store.put_run(next) => Some(r),
                _ = async {
                    if round % 10 == 0 {
                        std::future::pending::<()>().await;
                    }
                    for _ in 0..turns {
                        tokio::task::yield_now().await;
                    }
                } => None,
            };
            let now = store.get_run(&key).await.expect("get").expect("run");
            assert!(
                tried[&now.version].contains(&now.agent_name),
                "round {round}: version {} holds {:?}, which no round wrote as it",
                now.version,
                now.agent_name
            );
            match done {
                Some(Ok(r)) => {
                    assert_eq!(now, r, "round {round}: the answer is what is stored");
                    finished += 1;
                }
                // An earlier dropped call whose COMMIT had been sent
                // landed after that round read the record.
                Some(Err(StateError::Conflict { .. })) => {
                    late += 1;
                    assert!(
                        late <= dropped,
                        "round {round}: a conflict no drop explains"
                    );
                }
                Some(Err(e)) => panic!("round {round}: {e:?}"),
                None if now.version == stored.version => {
                    dropped += 1;
                    cut += 1;
                }
                // Landed: this round's write, or an earlier dropped one's
                // (checked whole above).
                None => {
                    dropped += 1;
                    landed += 1;
                }
            }
            stored = now;
        }
        assert!(cut > 0 && finished > 0, "{cut} cut, {finished} finished");
        // Every connection of the pool works: POOL calls at once, each
        // holding its connection (a write under the same row lock waits
        // on the others).
        let calls = (0..POOL).map(|_| {
            let (store, key) = (store.clone(), key.clone());
            async move {
                store
                    .patch_run(
                        &key,
                        StateDelta {
                            iterations: 1,
                            ..Default::default()
                        },
                    )
                    .await
            }
        });
        for r in futures_join(calls).await {
            r.expect("every pooled connection works");
        }
        let r = store.get_run(&key).await.expect("get").expect("run");
        assert_eq!(r.iterations, u64::from(POOL));
        // None of this store's server connections is left inside a
        // transaction (a dropped call's connection is closed, and the
        // server aborts its transaction).
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            let app = app.clone();
            let stuck = tokio::task::spawn_blocking(move || idle_in_transaction(&app))
                .await
                .expect("the harness");
            if stuck == 0 {
                break;
            }
            assert!(
                Instant::now() < until,
                "a connection stuck in a transaction"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        eprintln!(
            "dropped put_run: {cut} cut (not applied when read), {landed} dropped after \
             landing, {late} conflicts with a late landing, {finished} finished"
        );
    }

    /// Awaits every future, concurrently.
    async fn futures_join<F>(futs: impl Iterator<Item = F>) -> Vec<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let handles: Vec<_> = futs.map(tokio::spawn).collect();
        let mut out = Vec::new();
        for h in handles {
            out.push(h.await.expect("no task panicked"));
        }
        out
    }

    /// The sync API from many OS threads at once, over a small pool: every
    /// call lands once.
    #[test]
    fn the_sync_api_from_many_threads_at_once() {
        const THREADS: usize = 32;
        const CALLS: u64 = 10;
        let (dsn, _) = tagged_dsn("threads");
        let store = Arc::new(connect(&dsn, 4));
        let key = RunKey::new(unique("threads"), "r");
        store
            .put_run(RunRecord::new(key.clone(), "a"))
            .expect("create");
        let start = Arc::new(Barrier::new(THREADS));
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let (store, key, start) = (store.clone(), key.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    for _ in 0..CALLS {
                        store
                            .patch_run(
                                &key,
                                StateDelta {
                                    iterations: 1,
                                    ..Default::default()
                                },
                            )
                            .expect("patch");
                        let mine = RunKey::new(key.tenant.clone(), format!("t{t}"));
                        match store.get_run(&mine).expect("get") {
                            None => store.put_run(RunRecord::new(mine, "b")).map(|_| ()),
                            Some(r) => store.put_run(r).map(|_| ()),
                        }
                        .expect("put");
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().expect("no thread panicked");
        }
        let r = store.get_run(&key).expect("get").expect("run");
        assert_eq!(r.iterations, THREADS as u64 * CALLS);
        assert_eq!(r.version, THREADS as u64 * CALLS + 1);
    }

    /// A client configuration built in code (`connect_config`).
    #[test]
    fn a_store_over_a_config_built_in_code() {
        let mut config: tokio_postgres::Config = shared_dsn().parse().expect("the shared dsn");
        config.application_name("agentstate-config-test");
        let store = PostgresStore::connect_config(config, PgOptions::new().schema(schema()))
            .expect("connect");
        let key = RunKey::new(unique("config"), "r");
        let put = store
            .put_run(RunRecord::new(key.clone(), "a"))
            .expect("put");
        assert_eq!(store.get_run(&key).expect("get"), Some(put));
        assert!(format!("{store:?}").contains("postgres://"));
    }
}

/// The one-round-trip `put_run`/`patch_run` (a compare-and-swap on the
/// bytes a store last saw) across two stores, so two caches, over one
/// database: 8 threads interleave patches and version-checked puts on the
/// same 3 runs, each call through either store. Every stale cache falls
/// back to the locked path: no patch is lost or applied twice, and each
/// run's version counts every write exactly.
#[test]
fn two_caches_interleave_puts_and_patches_exactly() {
    let stores = [store(Options::new()), store(Options::new())];
    let tenant = unique("cas");
    let keys: Vec<RunKey> = (0..3)
        .map(|i| RunKey::new(tenant.clone(), format!("r{i}")))
        .collect();
    let mut first = Vec::new();
    for k in &keys {
        first.push(
            stores[0]
                .put_run(RunRecord::new(k.clone(), "a"))
                .expect("create")
                .version,
        );
    }
    const THREADS: usize = 8;
    let calls = rounds(60) as usize;
    // Per run: patches and puts that succeeded.
    let patches: Vec<AtomicU64> = keys.iter().map(|_| AtomicU64::new(0)).collect();
    let puts: Vec<AtomicU64> = keys.iter().map(|_| AtomicU64::new(0)).collect();
    std::thread::scope(|sc| {
        for t in 0..THREADS {
            let (stores, keys, patches, puts) = (&stores, &keys, &patches, &puts);
            sc.spawn(move || {
                for i in 0..calls {
                    let r = (t + i) % keys.len();
                    let s = &stores[(t + i / 2) % 2];
                    if i % 3 == 2 {
                        // A put of what this store reads now, renamed; a
                        // racing write makes it a Conflict, read again.
                        loop {
                            let mut cur = s.get_run(&keys[r]).expect("get").expect("run");
                            cur.agent_name = format!("w{t}-{i}");
                            match s.put_run(cur.clone()) {
                                Ok(new) => {
                                    assert_eq!(new.version, cur.version + 1);
                                    assert_eq!(new.agent_name, cur.agent_name);
                                    puts[r].fetch_add(1, Ordering::Relaxed);
                                    break;
                                }
                                Err(StateError::Conflict { .. }) => continue,
                                Err(e) => panic!("put: {e:?}"),
                            }
                        }
                    } else {
                        let before = patches[r].load(Ordering::Relaxed);
                        let new = s
                            .patch_run(
                                &keys[r],
                                StateDelta {
                                    cost_micros: 1,
                                    iterations: 2,
                                    ..Default::default()
                                },
                            )
                            .expect("patch");
                        assert!(new.cost_micros > before, "a patch sees every earlier one");
                        patches[r].fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    for (i, k) in keys.iter().enumerate() {
        let p = patches[i].load(Ordering::Relaxed);
        let w = puts[i].load(Ordering::Relaxed);
        for s in &stores {
            let got = s.get_run(k).expect("get").expect("run");
            assert_eq!(
                (got.cost_micros, got.iterations, got.version),
                (p, 2 * p, first[i] + p + w),
                "{k:?}: every patch once, every write one version"
            );
        }
    }
    // And a warm store's next patch still lands once.
    let k = &keys[0];
    let before = stores[1].get_run(k).expect("get").expect("run");
    let after = stores[1]
        .patch_run(
            k,
            StateDelta {
                cost_micros: 5,
                ..Default::default()
            },
        )
        .expect("patch");
    assert_eq!(
        (after.cost_micros, after.version),
        (before.cost_micros + 5, before.version + 1)
    );
    let other = stores[0].get_run(k).expect("get").expect("run");
    assert_eq!(other, after, "the other store reads what was swapped in");
}

/// Issue 40: the common calls take one round trip on the happy path
/// (warm statement cache, a run this store has seen). Counted by a TCP
/// proxy: on its connection, each time the client starts sending after
/// the server last sent is one round trip. The median over many calls
/// (a pipeline split by the kernel can look like two).
#[test]
fn round_trips_per_call() {
    use agentstate::{BudgetKey, BudgetRecord, BudgetStore, Caps, Hold, InstanceKey, TrayKey};
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener, TcpStream};
    let cfg: tokio_postgres::Config = shared_dsn().parse().expect("the shared dsn");
    let port = cfg.get_ports().first().copied().unwrap_or(5432);
    let host = match cfg.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        _ => "127.0.0.1".to_string(),
    };
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let proxy_port = listener.local_addr().expect("addr").port();
    let trips = Arc::new(AtomicU64::new(0));
    {
        let trips = trips.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let server = TcpStream::connect((host.as_str(), port)).expect("the server");
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                // The server spoke since the client last sent.
                let answered = Arc::new(AtomicBool::new(true));
                let (c2, s2) = (
                    client.try_clone().expect("clone"),
                    server.try_clone().expect("clone"),
                );
                let a = answered.clone();
                std::thread::spawn(move || {
                    let (mut from, mut to) = (s2, c2);
                    let mut buf = vec![0u8; 64 * 1024];
                    while let Ok(n) = from.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        a.store(true, Ordering::SeqCst);
                        if to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown(Shutdown::Both);
                });
                let trips = trips.clone();
                std::thread::spawn(move || {
                    let (mut from, mut to) = (client, server);
                    let mut buf = vec![0u8; 64 * 1024];
                    while let Ok(n) = from.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        if answered.swap(false, Ordering::SeqCst) {
                            trips.fetch_add(1, Ordering::SeqCst);
                        }
                        if to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown(Shutdown::Both);
                });
            }
        });
    }
    let mut dsn = format!(
        "host=127.0.0.1 port={proxy_port} user={} dbname={}",
        cfg.get_user().unwrap_or("postgres"),
        cfg.get_dbname().unwrap_or("postgres")
    );
    if let Some(p) = cfg.get_password() {
        dsn.push_str(&format!(" password={}", String::from_utf8_lossy(p)));
    }
    // Lazy: the first call dials, as the counts expect.
    let s = PostgresStore::connect_with(
        &dsn,
        PgOptions::new().schema(schema()).pool_size(1).lazy(true),
    )
    .expect("connect through the proxy");
    let tenant = unique("rtt");
    let run = RunKey::new(tenant.clone(), "r");
    s.put_run(RunRecord::new(run.clone(), "a")).expect("create");
    let bk = BudgetKey::new(tenant.clone(), "b");
    s.put_budget(BudgetRecord::new(bk, Caps::new().cost_micros(1 << 40)))
        .expect("budget");
    let brun = RunKey::new(tenant.clone(), "rb");
    s.put_run(RunRecord::new(brun.clone(), "a").with_budget("b"))
        .expect("budgeted run");
    let inst = InstanceKey {
        ns: tenant.clone(),
        id: "i".into(),
    };
    let tk = TrayKey {
        ns: inst.ns.clone(),
        id: inst.id.clone(),
        tray_ns: "t".into(),
        tray_id: "1".into(),
    };
    let tray = Tray {
        marked: true,
        doc: b"doc".to_vec(),
        env: "e".into(),
        hostname: "h".into(),
    };
    let delta = StateDelta {
        cost_micros: 1,
        ..Default::default()
    };
    let mut n = 0u64;
    // The round trips of each of `times` calls of `f` (after one to warm
    // the statements), their median.
    let count = |what: &str, times: usize, f: &mut dyn FnMut(usize)| -> u64 {
        f(usize::MAX);
        let mut seen: Vec<u64> = (0..times)
            .map(|i| {
                let t0 = trips.load(Ordering::SeqCst);
                f(i);
                trips.load(Ordering::SeqCst) - t0
            })
            .collect();
        seen.sort_unstable();
        let median = seen[seen.len() / 2];
        eprintln!("@@ round trips: {what}: median {median}, all {seen:?}");
        median
    };
    let times = 15;
    let mut got = Vec::new();
    got.push((
        "get_run",
        count("get_run", times, &mut |_| {
            s.get_run(&run).expect("get");
        }),
        1,
    ));
    got.push((
        "patch_run",
        count("patch_run", times, &mut |_| {
            s.patch_run(&run, delta).expect("patch");
        }),
        1,
    ));
    let mut cur = s.get_run(&run).expect("get").expect("run");
    got.push((
        "put_run (update)",
        count("put_run (update)", times, &mut |_| {
            cur = s.put_run(cur.clone()).expect("put");
        }),
        1,
    ));
    got.push((
        "write_tray",
        count("write_tray", times, &mut |_| {
            s.write_tray(&tk, 1, tray.clone()).expect("write");
        }),
        1,
    ));
    got.push((
        "read_tray",
        count("read_tray", times, &mut |_| {
            s.read_tray(&tk, 1).expect("read");
        }),
        1,
    ));
    got.push((
        "apply_batch",
        count("apply_batch", times, &mut |_| {
            s.apply_batch(
                &inst,
                1,
                vec![TrayOp::Put {
                    tray_ns: "t".into(),
                    tray_id: "2".into(),
                    tray: tray.clone(),
                }],
            )
            .expect("batch");
        }),
        1,
    ));
    got.push((
        "set_alarm",
        count("set_alarm", times, &mut |i| {
            s.set_alarm(&inst, 1, 1_000 + (i % 1_000) as u64)
                .expect("alarm");
        }),
        1,
    ));
    got.push((
        "epoch",
        count("epoch", times, &mut |_| {
            s.epoch(&inst).expect("epoch");
        }),
        1,
    ));
    // T7: the fence and one statement reading every tray, filters in SQL.
    for (what, filter) in [
        ("instance_trays", agentstate::TrayFilter::new()),
        (
            "instance_trays (filtered)",
            agentstate::TrayFilter::new().tray_ns("t").marked(true),
        ),
    ] {
        let c = count(what, times, &mut |_| {
            let trays = s.instance_trays(&inst, 1, &filter).expect("instance_trays");
            assert_eq!(trays.len(), 2, "{what}");
        });
        got.push((what, c, 1));
    }
    got.push((
        "delete_tray",
        count("delete_tray", times, &mut |_| {
            s.delete_tray(&tk, 1).expect("delete");
        }),
        1,
    ));
    got.push((
        "release",
        count("release", times, &mut |_| {
            s.release(&inst, 1).expect("release");
        }),
        1,
    ));
    // A create of a run without a session or budget: one statement takes
    // the seq and inserts the run and its label rows.
    let c = count("put_run (create)", times, &mut |_| {
        n += 1;
        s.put_run(RunRecord::new(
            RunKey::new(tenant.clone(), format!("c{n}")),
            "a",
        ))
        .expect("create");
    });
    got.push(("put_run (create)", c, 1));
    let c = count("put_run (create, labels)", times, &mut |_| {
        n += 1;
        s.put_run(
            RunRecord::new(RunKey::new(tenant.clone(), format!("c{n}")), "a")
                .with_label("team", "a")
                .with_label("n", n),
        )
        .expect("create");
    });
    got.push(("put_run (create, labels)", c, 1));
    // A reserve and a settle: one round trip each (schema 8's functions),
    // with a budget, and on a capped run without one.
    let mut h = 0u64;
    let c = count("reserve + settle (budget)", times, &mut |_| {
        h += 1;
        let id = format!("h{h}");
        s.reserve(&brun, Hold::new(id.clone(), 60_000).cost_micros(2))
            .expect("reserve");
        s.settle(&brun, &id, delta).expect("settle");
    });
    got.push(("reserve + settle (budget)", c, 2));
    let crun = RunKey::new(tenant.clone(), "rc");
    s.put_run(RunRecord::new(crun.clone(), "a").with_caps(Caps::new().cost_micros(1 << 40)))
        .expect("capped run");
    let c = count("reserve + settle (capped run)", times, &mut |_| {
        h += 1;
        let id = format!("h{h}");
        s.reserve(&crun, Hold::new(id.clone(), 60_000).cost_micros(2))
            .expect("reserve");
        s.settle(&crun, &id, delta).expect("settle");
    });
    got.push(("reserve + settle (capped run)", c, 2));
    // A budget and run another store wrote: the first (locked) reserve and
    // settle read them, and the calls after are one round trip each.
    let other = store(Options::new());
    other
        .put_budget(BudgetRecord::new(
            BudgetKey::new(tenant.clone(), "b2"),
            Caps::new().cost_micros(1 << 40),
        ))
        .expect("budget");
    let orun = RunKey::new(tenant.clone(), "ro");
    other
        .put_run(RunRecord::new(orun.clone(), "a").with_budget("b2"))
        .expect("run");
    let c = count("reserve + settle (written elsewhere)", times, &mut |_| {
        h += 1;
        let id = format!("h{h}");
        s.reserve(&orun, Hold::new(id.clone(), 60_000).cost_micros(2))
            .expect("reserve");
        s.settle(&orun, &id, delta).expect("settle");
    });
    got.push(("reserve + settle (written elsewhere)", c, 2));
    for (what, median, most) in got {
        assert!(
            median <= most,
            "{what}: {median} round trips, at most {most} expected"
        );
    }
}

/// `reserve` and `settle` guess the run's budget from the run as the store
/// last saw it, and read in the old order when the guess is wrong or
/// missing: a store that never saw the run, and one that saw no budget
/// where there is one, keep the caps exactly.
#[test]
fn reserve_and_settle_without_a_right_budget_guess() {
    use agentstate::{BudgetKey, BudgetRecord, BudgetStore, Caps, Hold};
    let (a, b) = (store(Options::new()), store(Options::new()));
    let tenant = unique("guess");
    let bk = BudgetKey::new(tenant.clone(), "b");
    a.put_budget(BudgetRecord::new(bk.clone(), Caps::new().cost_micros(10)))
        .expect("budget");
    let run = RunKey::new(tenant.clone(), "r");
    a.put_run(RunRecord::new(run.clone(), "x").with_budget("b"))
        .expect("run");
    // `b` never saw the run: no guess.
    b.reserve(&run, Hold::new("h1", 60_000).cost_micros(6))
        .expect("reserve");
    assert!(matches!(
        b.reserve(&run, Hold::new("h2", 60_000).cost_micros(6)),
        Err(StateError::BudgetExceeded { .. })
    ));
    let s = b
        .settle(
            &run,
            "h1",
            StateDelta {
                cost_micros: 4,
                ..Default::default()
            },
        )
        .expect("settle");
    assert_eq!(s.record.cost_micros, 4);
    // Now both saw it; either reserves against the same budget.
    a.reserve(&run, Hold::new("h3", 60_000).cost_micros(6))
        .expect("reserve the rest");
    assert!(matches!(
        b.reserve(&run, Hold::new("h4", 60_000).cost_micros(1)),
        Err(StateError::BudgetExceeded { .. })
    ));
    a.settle(&run, "h3", StateDelta::default()).expect("settle");
    let st = a.get_budget(&bk).expect("get").expect("budget");
    assert_eq!((st.spent.cost_micros, st.holds), (4, 0));
    // A run without a budget, seen by `a` only: its own holds.
    let free = RunKey::new(tenant, "free");
    a.put_run(RunRecord::new(free.clone(), "x")).expect("run");
    b.reserve(&free, Hold::new("h", 60_000).cost_micros(1))
        .expect("reserve");
    a.settle(&free, "h", StateDelta::default()).expect("settle");
    assert!(matches!(
        b.settle(&free, "h", StateDelta::default()),
        Err(StateError::NotFound(_))
    ));
}

/// A feed position's server transaction id: below the scope's 32-bit tag
/// (F9), the ordinal is `xid << 48 | n` (`crates/postgres/src/feed.rs`).
fn xid_of(p: agentstate::Position) -> u64 {
    ((p.as_u128() & ((1u128 << 96) - 1)) >> 48) as u64
}

fn unix_micros() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_micros()
}

/// The feed never passes a transaction still open (F4 across processes):
/// transaction A, a create in another OS process, takes its place (its
/// seq, and so its transaction id) and then stalls before it commits;
/// transaction B, a patch of another run of the same tenant, starts after
/// it and commits. A consumer following the feed reads nothing of B while
/// A is open (reading B would move its position past A's, and skip A),
/// not even when woken by B's commit; once A commits, the consumer,
/// continuing from where it was, reads A's run, then B's. On a server of
/// its own: its open transaction would hold back every feed of the shared
/// one.
#[test]
fn feed_never_passes_a_transaction_open_in_another_process() {
    use agentstate::{FeedScope, FeedStore};
    if role().as_deref() == Some("feed-late") {
        let s = PostgresStore::connect(&env("AGENTSTATE_PG_DSN")).expect("connect");
        let r = s
            .put_run(RunRecord::new(
                RunKey::new(env("AGENTSTATE_PG_PREFIX"), "late"),
                "a",
            ))
            .expect("A commits");
        println!("@@ {}", r.seq);
        return;
    }
    let server = PgServer::start(false);
    let dsn = server.dsn("postgres");
    let s = PostgresStore::connect(&dsn).expect("connect");
    s.setup().expect("setup");
    let tenant = unique("feedlate");
    let scope = FeedScope::tenant(&tenant);
    let b = s
        .put_run(RunRecord::new(RunKey::new(&tenant, "b"), "a"))
        .expect("b");
    // The consumer has read everything so far.
    let first = s
        .changes(&scope, agentstate::Position::START, 100)
        .expect("read");
    assert_eq!(first.changes.len(), 1, "{first:?}");
    let at = first.next;
    // A blocker row with A's key: A's insert waits on it, after A took
    // its seq (and its transaction id).
    let mut raw = postgres::Client::connect(&dsn, postgres::NoTls).expect("raw");
    let mut blocker = raw.transaction().expect("begin");
    blocker
        .execute(
            "INSERT INTO public.agentstate_runs (tenant, run_id, seq, state, agent_name, updated_at, record) \
             VALUES ($1, 'late', 999999, 'pending', 'x', 0, '\\x00')",
            &[&tenant],
        )
        .expect("blocker row");
    let blocker_xid: String = blocker
        .query_one(
            "SELECT (pg_current_xact_id()::text::numeric % 4294967296)::text",
            &[],
        )
        .expect("blocker xid")
        .get(0);
    let child = spawn_child(
        "postgres::feed_never_passes_a_transaction_open_in_another_process",
        &[
            ("AGENTSTATE_PG_ROLE", "feed-late".into()),
            ("AGENTSTATE_PG_PREFIX", tenant.clone()),
            ("AGENTSTATE_PG_DSN", dsn.clone()),
        ],
    );
    // A waits on the blocker: it has its transaction id.
    let mut watch = postgres::Client::connect(&dsn, postgres::NoTls).expect("raw");
    let began = Instant::now();
    loop {
        let waiting: i64 = watch
            .query_one(
                "SELECT count(*) FROM pg_locks WHERE NOT granted \
                 AND locktype = 'transactionid' AND transactionid::text = $1",
                &[&blocker_xid],
            )
            .expect("locks")
            .get(0);
        if waiting > 0 {
            break;
        }
        assert!(
            began.elapsed() < Duration::from_secs(60),
            "A never reached its insert"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // B: starts after A and commits first.
    let b2 = s
        .patch_run(&b.key, StateDelta::default())
        .expect("B commits");
    assert_eq!(b2.version, 2);
    let page = s.changes(&scope, at, 100).expect("read while A is open");
    assert!(
        page.changes.is_empty(),
        "B is read while A, below it, is open: {page:?}"
    );
    assert_eq!(page.next, at, "the position stays before A");
    let waited = Instant::now();
    let page = s
        .wait_changes(&scope, at, 100, Duration::from_millis(300))
        .expect("wait while A is open");
    assert!(
        page.changes.is_empty() && page.next == at,
        "a waiter woken by B's commit reads B while A is open: {page:?}"
    );
    assert!(waited.elapsed() >= Duration::from_millis(250));
    blocker.rollback().expect("release A");
    let lines = child_lines(child, "transaction A's process");
    assert_eq!(lines.len(), 1, "{lines:?}");
    // The consumer goes on from where it was: A, then B.
    let mut got = Vec::new();
    let mut next = at;
    loop {
        let page = s.changes(&scope, next, 1).expect("read after A");
        if page.changes.is_empty() {
            break;
        }
        next = page.next;
        got.extend(page.changes);
    }
    let names: Vec<String> = got
        .iter()
        .map(|c| match &c.item {
            agentstate::Changed::Run { run } => format!("{}@{}", run.key.run_id, run.version),
            other => panic!("not a run: {other:?}"),
        })
        .collect();
    assert_eq!(names, ["late@1", "b@2"], "A's change is read, before B's");
    assert!(
        xid_of(got[0].position) < xid_of(got[1].position),
        "A's transaction began first"
    );
    eprintln!(
        "feed across processes: consumer at {at}, A at {}, B at {}",
        got[0].position, got[1].position
    );
}

/// F5 across processes: `wait_changes` here is woken by a commit of
/// another OS process within well under a second (the listener's
/// notification), each time.
#[test]
fn wait_changes_is_woken_by_a_commit_in_another_process() {
    use agentstate::{FeedScope, FeedStore};
    const ROUNDS: usize = 5;
    if role().as_deref() == Some("feed-writer") {
        let s = store(Options::new());
        let tenant = env("AGENTSTATE_PG_PREFIX");
        // Connected before the clock starts.
        s.get_run(&RunKey::new(&tenant, "none")).expect("warm");
        wait_for_start();
        for i in 0..ROUNDS {
            std::thread::sleep(Duration::from_millis(400));
            let before = unix_micros();
            s.put_run(RunRecord::new(RunKey::new(&tenant, format!("r{i}")), "a"))
                .expect("put");
            println!("@@ {before}");
        }
        return;
    }
    let s = store(Options::new());
    let tenant = unique("feedwake");
    let scope = FeedScope::tenant(&tenant);
    let mut at = s.feed_head(&scope).expect("head");
    // The first wait dials the listener.
    let page = s
        .wait_changes(&scope, at, 10, Duration::from_millis(100))
        .expect("first wait");
    assert!(page.changes.is_empty());
    let child = spawn_child(
        "postgres::wait_changes_is_woken_by_a_commit_in_another_process",
        &[
            ("AGENTSTATE_PG_ROLE", "feed-writer".into()),
            ("AGENTSTATE_PG_PREFIX", tenant.clone()),
            ("AGENTSTATE_PG_START", start_in(1500)),
            ("AGENTSTATE_TEST_PG_DSN", shared_dsn().to_string()),
            ("AGENTSTATE_PG_SCHEMA", schema().to_string()),
        ],
    );
    // Each change's wake. A page may hold two: a read is held back while
    // any transaction on the server is open below the commit (the other
    // tests share this server), and the next commit may land meanwhile.
    let mut woke = Vec::new();
    while woke.len() < ROUNDS {
        let page = s
            .wait_changes(&scope, at, 10, Duration::from_secs(30))
            .expect("wait");
        let now = unix_micros();
        assert!(!page.changes.is_empty(), "no change within 30 s");
        for c in &page.changes {
            let agentstate::Changed::Run { run } = &c.item else {
                panic!("a run's change: {c:?}")
            };
            assert_eq!(run.key.run_id, format!("r{}", woke.len()), "{page:?}");
            woke.push(now);
        }
        at = page.next;
    }
    let sent: Vec<u128> = child_lines(child, "the writing process")
        .iter()
        .map(|l| l.parse().expect("a time"))
        .collect();
    assert_eq!(sent.len(), ROUNDS);
    // From before the other process's put_run to the waiter's return.
    let mut ms: Vec<f64> = woke
        .iter()
        .zip(&sent)
        .map(|(w, s)| w.saturating_sub(*s) as f64 / 1000.0)
        .collect();
    eprintln!("wait_changes woken across processes after (ms): {ms:?}");
    ms.sort_by(f64::total_cmp);
    assert!(
        ms[ROUNDS / 2] < 250.0,
        "the median wake took {} ms: {ms:?}",
        ms[ROUNDS / 2]
    );
    assert!(
        ms[ROUNDS - 1] < 5_000.0,
        "a wake took {} ms: {ms:?}",
        ms[ROUNDS - 1]
    );
}

/// F5 for every writer, schema 10: a plain-SQL write (pinned's, a
/// script's) notifies from its own transaction, so a waiter wakes at once
/// (well before its one-second safety read); a transaction that says it
/// is the store's (`agentstate.notify = 'after_commit'`) notifies
/// nothing itself, and records the notification for after its commit
/// (what the store sends after every COMMIT), and a rollback takes the
/// record back.
#[test]
fn plain_sql_writers_wake_waiters_and_the_stores_commits_notify_after() {
    use agentstate::{FeedScope, FeedStore};
    use postgres::fallible_iterator::FallibleIterator;
    let s = store(Options::new());
    // An env of its own: only this test's trays are in its feed.
    let env = unique("sqlwake");
    let scope = FeedScope::trays_in(&env);
    let trays = format!("\"{}\".pinned_tray_index", schema());
    // pinned's `set_tray`, as plain SQL.
    let upsert = format!(
        "INSERT INTO {trays} (ns, id, tray_ns, tray_id, marked, doc, env, hostname) \
         VALUES ('w', $1, 'q', 'a', true, $2::text::jsonb, $1, '*') \
         ON CONFLICT (ns, id, tray_ns, tray_id) DO UPDATE SET doc = EXCLUDED.doc, \
         env = EXCLUDED.env"
    );
    let mut at = s.feed_head(&scope).expect("head");
    let mut ms = Vec::new();
    for i in 0..5 {
        let (env2, upsert2, dsn) = (env.clone(), upsert.clone(), shared_dsn().to_string());
        let writer = std::thread::spawn(move || {
            let mut c = postgres::Client::connect(&dsn, postgres::NoTls).expect("raw");
            std::thread::sleep(Duration::from_millis(200));
            let t = Instant::now();
            c.execute(&upsert2, &[&env2, &format!("{{\"n\": {i}}}")])
                .expect("pinned's upsert");
            t
        });
        let page = s
            .wait_changes(&scope, at, 10, Duration::from_secs(10))
            .expect("wait");
        let woke = Instant::now();
        let sent = writer.join().expect("writer");
        assert_eq!(page.changes.len(), 1, "round {i}: {page:?}");
        ms.push(woke.duration_since(sent).as_secs_f64() * 1000.0);
        at = page.next;
    }
    ms.sort_by(f64::total_cmp);
    assert!(
        ms[2] < 250.0,
        "plain SQL writes woke the waiter after (ms) {ms:?}: not notified"
    );

    // The store's way: nothing notified inside; recorded, once per scope.
    let mut c = postgres::Client::connect(shared_dsn(), postgres::NoTls).expect("raw");
    let mut l = postgres::Client::connect(shared_dsn(), postgres::NoTls).expect("listener");
    let mut channel = format!("agentstate_feed {}", schema());
    channel.truncate(63);
    l.batch_execute(&format!("LISTEN \"{channel}\""))
        .expect("listen");
    let touched = |c: &mut postgres::Client| -> String {
        c.query_one(
            "SELECT coalesce(current_setting('agentstate.feed_touched', true), '')",
            &[],
        )
        .expect("setting")
        .get(0)
    };
    for end in ["ROLLBACK", "COMMIT"] {
        c.batch_execute("BEGIN; SET LOCAL agentstate.notify = 'after_commit'")
            .expect("begin");
        c.execute(&upsert, &[&env, &"{\"n\": 10}"]).expect("upsert");
        c.execute(&upsert, &[&env, &"{\"n\": 11}"]).expect("again");
        c.batch_execute(end).expect("end");
    }
    assert_eq!(
        touched(&mut c),
        "trays",
        "the scope written, recorded once; the rollback's taken back"
    );
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        l.notifications().iter().count().expect("read"),
        0,
        "the store's transaction notified nothing itself"
    );
    // What the store sends after its COMMIT.
    c.execute(
        "SELECT pg_notify($1, t), set_config('agentstate.feed_touched', '', false) \
         FROM (SELECT current_setting('agentstate.feed_touched', true) AS t) s WHERE t <> ''",
        &[&channel],
    )
    .expect("notify");
    assert_eq!(touched(&mut c), "", "sent once");
    let mut n = l.notifications();
    let heard = n
        .timeout_iter(Duration::from_secs(5))
        .next()
        .expect("listen")
        .map(|n| (n.channel().to_string(), n.payload().to_string()));
    assert_eq!(heard, Some((channel.clone(), "trays".to_string())));
    let page = s.changes(&scope, at, 10).expect("changes");
    assert_eq!(page.changes.len(), 1, "the committed write: {page:?}");

    // Two scopes in one transaction record `*`, which wakes a waiter of
    // any scope (here a tenant's: a run's entry with no run, read as its
    // tombstone).
    let tenant = unique("star");
    let tscope = FeedScope::tenant(&tenant);
    let tat = s.feed_head(&tscope).expect("head");
    let waiter = {
        let (s, tscope) = (store(Options::new()), tscope.clone());
        std::thread::spawn(move || {
            let t = Instant::now();
            let page = s
                .wait_changes(&tscope, tat, 10, Duration::from_secs(10))
                .expect("wait");
            (page.changes.len(), t.elapsed())
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    c.batch_execute("BEGIN; SET LOCAL agentstate.notify = 'after_commit'")
        .expect("begin");
    c.execute(&upsert, &[&env, &"{\"n\": 12}"]).expect("tray");
    c.execute(
        &format!(
            "SELECT \"{0}\".agentstate_feed_put(1::smallint, $1, 'r', '', '', 1::smallint, $1, \
             NULL, true, '{0}')",
            schema()
        ),
        &[&tenant],
    )
    .expect("a tenant's entry");
    c.batch_execute("COMMIT").expect("commit");
    assert_eq!(touched(&mut c), "*", "more than one scope");
    c.execute(
        "SELECT pg_notify($1, t), set_config('agentstate.feed_touched', '', false) \
         FROM (SELECT current_setting('agentstate.feed_touched', true) AS t) s WHERE t <> ''",
        &[&channel],
    )
    .expect("notify");
    let (n, took) = waiter.join().expect("waiter");
    assert_eq!(n, 1, "the tenant's change");
    assert!(
        took < Duration::from_millis(800),
        "woken by `*`, not by the one-second read: {took:?}"
    );
}

/// A database a schema-6 build wrote is upgraded by `setup()`: the feed
/// then holds every record it had, once, in its current state (trays by
/// env too), and the writes after the upgrade follow them.
#[test]
fn setup_backfills_the_feed_of_a_schema_6_database() {
    use agentstate::{Changed, FeedScope, FeedStore, Position, SessionKey, SessionRecord};
    let dsn = fresh_db("feed6");
    let mut c = postgres::Client::connect(&dsn, postgres::NoTls).expect("raw");
    let cur = PostgresStore::connect_with(&dsn, PgOptions::new().schema("cur")).expect("connect");
    cur.setup().expect("setup");
    let r1 = cur
        .put_run(RunRecord::new(RunKey::new("t", "r1"), "a"))
        .expect("r1");
    cur.put_run(RunRecord::new(RunKey::new("t", "r2"), "a"))
        .expect("r2");
    cur.put_session(SessionRecord::new(SessionKey::new("t", "s1")))
        .expect("s1");
    let w = InstanceKey::new("w", "1");
    let tray = |env: &str| Tray {
        marked: true,
        doc: b"doc".to_vec(),
        env: env.into(),
        hostname: "h".into(),
    };
    cur.write_tray(&w.tray("q", "a"), 1, tray("e1"))
        .expect("tray a");
    cur.write_tray(&w.tray("q", "b"), 1, tray("e2"))
        .expect("tray b");
    cur.set_alarm(&w, 1, 5_000).expect("alarm");
    old_layout(&mut c, "cur", "public", 6);
    let s = PostgresStore::connect(&dsn).expect("connect");
    assert_eq!(s.schema_version().expect("version"), Some(6));
    s.setup().expect("upgrade");
    assert_eq!(s.schema_version().expect("version"), Some(10));
    let kinds = |scope: &FeedScope, after: Position| -> (Vec<String>, Position) {
        let page = s.changes(scope, after, 100).expect("changes");
        let k = page
            .changes
            .iter()
            .map(|c| match &c.item {
                Changed::Run { run } => format!("run {}@{}", run.key.run_id, run.version),
                Changed::Session { session } => format!("session {}", session.key.session_id),
                Changed::Tray { key, tray } => format!("tray {} {}", key.tray_id, tray.env),
                Changed::Alarm { alarm } => format!("alarm {}", alarm.due_at),
                other => format!("{other:?}"),
            })
            .collect();
        (k, page.next)
    };
    let (got, end) = kinds(&FeedScope::tenant("t"), Position::START);
    assert_eq!(got, ["run r1@1", "run r2@1", "session s1"]);
    assert_eq!(
        kinds(&FeedScope::trays(), Position::START).0,
        ["tray a e1", "tray b e2", "alarm 5000"]
    );
    assert_eq!(
        kinds(&FeedScope::trays_in("e2"), Position::START).0,
        ["tray b e2"]
    );
    // The writes after the upgrade follow.
    s.patch_run(&r1.key, StateDelta::default()).expect("patch");
    assert_eq!(kinds(&FeedScope::tenant("t"), end).0, ["run r1@2"]);
    let report = s.verify().expect("verify");
    assert!(report.is_ok(), "{:?}", report.problems);
}

/// Schema 8's one-round-trip `reserve` and `settle` decide against what
/// the store last saw of the run, its budget and the hold; the server
/// declines a guess another store made stale, and the locked path answers
/// exactly, refusals' facts included. Two stores on one database, one
/// clock, each change made by one and seen by the other.
#[test]
fn reserve_and_settle_with_stale_guesses_keep_the_caps_exactly() {
    use agentstate::{BudgetKey, BudgetRecord, BudgetStore, Caps, Hold, ManualClock};
    let clock = Arc::new(ManualClock::new(1_000_000));
    let (a, b) = (
        store(Options::new().clock(clock.clone())),
        store(Options::new().clock(clock.clone())),
    );
    let tenant = unique("stale");
    let bk = BudgetKey::new(tenant.clone(), "b");
    a.put_budget(BudgetRecord::new(bk.clone(), Caps::new().cost_micros(100)))
        .expect("budget");
    let (r1, r2) = (
        RunKey::new(tenant.clone(), "r1"),
        RunKey::new(tenant.clone(), "r2"),
    );
    for r in [&r1, &r2] {
        a.put_run(RunRecord::new(r.clone(), "x").with_budget("b"))
            .expect("run");
    }
    b.get_run(&r2).expect("b sees r2");
    let cost = |c: u64| StateDelta {
        cost_micros: c,
        ..Default::default()
    };
    let spent_held = |s: &PostgresStore| {
        let st = s.get_budget(&bk).expect("status").expect("budget");
        (st.spent.cost_micros, st.held.cost_micros)
    };
    // Warm: `a` has seen the run, the budget and its holds.
    a.reserve(&r1, Hold::new("h1", 60_000).cost_micros(30))
        .expect("reserve");
    a.settle(&r1, "h1", cost(30)).expect("settle");
    a.reserve(&r1, Hold::new("h2", 60_000).cost_micros(30))
        .expect("reserve, warm");
    // `b` holds 30 more (the budget's bytes unchanged: only its holds):
    // `a` counts it.
    b.reserve(&r2, Hold::new("g1", 60_000).cost_micros(30))
        .expect("b reserves");
    match a.reserve(&r1, Hold::new("h3", 60_000).cost_micros(11)) {
        Err(StateError::BudgetExceeded {
            spent, held, asked, ..
        }) => assert_eq!((spent, held, asked), (30, 60, 11)),
        other => panic!("spent 30 + held 60 + 11 > 100 must be refused: {other:?}"),
    }
    // `b` settles: the budget's spent moves under `a`'s guess.
    b.settle(&r2, "g1", cost(10)).expect("b settles");
    assert_eq!(spent_held(&a), (40, 30));
    a.reserve(&r1, Hold::new("h3", 60_000).cost_micros(30))
        .expect("40 + 30 + 30 fits exactly");
    match a.reserve(&r1, Hold::new("h4", 60_000).cost_micros(1)) {
        Err(StateError::BudgetExceeded {
            spent, held, asked, ..
        }) => assert_eq!((spent, held, asked), (40, 60, 1)),
        other => panic!("at the cap: {other:?}"),
    }
    a.settle(&r1, "h2", cost(5)).expect("settle");
    assert_eq!(spent_held(&b), (45, 30));
    // `b` patches r1: `a`'s run bytes go stale.
    b.patch_run(&r1, cost(1)).expect("b patches");
    let s = a.settle(&r1, "h3", cost(2)).expect("settle a stale run");
    assert_eq!(s.record.cost_micros, 30 + 5 + 1 + 2);
    assert_eq!(s.record.version, b.get_run(&r1).unwrap().unwrap().version);
    assert_eq!(spent_held(&b), (48, 0));
    // `b` releases a hold `a` reserved: `a`'s settle finds it gone.
    a.reserve(&r1, Hold::new("h5", 60_000).cost_micros(10))
        .expect("reserve");
    b.release_hold(&r1, "h5").expect("b releases");
    assert!(
        matches!(a.settle(&r1, "h5", cost(1)), Err(StateError::NotFound(_))),
        "a released hold is not settled"
    );
    // A hold that expired stops counting, and the next reserve removes it.
    a.reserve(&r1, Hold::new("h6", 1_000).cost_micros(50))
        .expect("reserve");
    assert_eq!(spent_held(&b), (48, 50));
    clock.advance(1_000);
    assert!(
        matches!(a.settle(&r1, "h6", cost(1)), Err(StateError::NotFound(_))),
        "an expired hold is not settled"
    );
    a.reserve(&r1, Hold::new("h7", 60_000).cost_micros(52))
        .expect("the expired hold no longer counts: 48 + 52");
    let spend = b.run_spend(&r1).expect("spend").expect("run");
    let ids: Vec<&str> = spend.holds.iter().map(|h| h.id.as_str()).collect();
    assert_eq!(ids, ["h7"], "the expired hold was removed");
    assert_eq!(spent_held(&b), (48, 52));
}

/// A hold written before schema 8 (or by an older build during a rolling
/// upgrade) has no amount columns: the server cannot sum it, declines,
/// and the locked path counts it from its record.
#[test]
fn holds_without_amount_columns_still_count() {
    use agentstate::{BudgetKey, BudgetRecord, BudgetStore, Caps, Hold};
    // A database of its own: `verify` reads all of it.
    let dsn = fresh_db("nulls");
    let s = PostgresStore::connect(&dsn).expect("connect");
    s.setup().expect("setup");
    let tenant = unique("nulls");
    let bk = BudgetKey::new(tenant.clone(), "b");
    s.put_budget(BudgetRecord::new(bk.clone(), Caps::new().cost_micros(100)))
        .expect("budget");
    let (run, capped) = (
        RunKey::new(tenant.clone(), "r"),
        RunKey::new(tenant.clone(), "c"),
    );
    s.put_run(RunRecord::new(run.clone(), "x").with_budget("b"))
        .expect("run");
    s.put_run(RunRecord::new(capped.clone(), "x").with_caps(Caps::new().cost_micros(100)))
        .expect("capped run");
    for r in [&run, &capped] {
        s.reserve(r, Hold::new("old", 60_000).cost_micros(60))
            .expect("reserve");
    }
    let mut raw = postgres::Client::connect(&dsn, postgres::NoTls).expect("raw");
    // `verify` names a hold whose columns disagree with its record.
    let mine = |s: &PostgresStore| -> Vec<String> {
        let report = s.verify().expect("verify");
        report
            .problems
            .into_iter()
            .filter(|p| p.contains(&tenant))
            .collect()
    };
    assert_eq!(mine(&s), Vec::<String>::new());
    raw.execute(
        "UPDATE public.agentstate_holds SET cost_micros = 1 WHERE tenant = $1 AND run_id = 'r'",
        &[&tenant],
    )
    .expect("tamper");
    let found = mine(&s);
    assert!(
        found.len() == 1 && found[0].contains("amount columns"),
        "{found:?}"
    );
    let n = raw
        .execute(
            "UPDATE public.agentstate_holds SET cost_micros = NULL, tokens = NULL, \
             iterations = NULL WHERE tenant = $1",
            &[&tenant],
        )
        .expect("clear the columns");
    assert_eq!(n, 2);
    assert_eq!(mine(&s), Vec::<String>::new(), "NULL: from before schema 8");
    for r in [&run, &capped] {
        // Summed without the old hold, 60 would fit.
        assert!(
            matches!(
                s.reserve(r, Hold::new("new", 60_000).cost_micros(60)),
                Err(StateError::BudgetExceeded { held: 60, .. })
            ),
            "the hold without columns counts"
        );
        s.reserve(r, Hold::new("new", 60_000).cost_micros(40))
            .expect("60 + 40 fits");
        s.settle(
            r,
            "old",
            StateDelta {
                cost_micros: 60,
                ..Default::default()
            },
        )
        .expect("settle the old hold");
    }
}

/// Workers on two stores (so each one's guesses go stale under the
/// other's writes) race reserve-then-settle against one budget until it
/// refuses: every reserve that was allowed fit, so the budget ends spent
/// exactly to its cap, never past it.
#[test]
fn racing_reserves_on_two_stores_spend_a_shared_budget_exactly() {
    use agentstate::{BudgetKey, BudgetRecord, BudgetStore, Caps, Hold};
    let stores = [
        Arc::new(store(Options::new())),
        Arc::new(store(Options::new())),
    ];
    let tenant = unique("race8");
    let bk = BudgetKey::new(tenant.clone(), "b");
    let (unit, cap) = (100u64, 6_000u64);
    stores[0]
        .put_budget(BudgetRecord::new(bk.clone(), Caps::new().cost_micros(cap)))
        .expect("budget");
    let handles: Vec<_> = (0..6)
        .map(|w| {
            let s = stores[w % 2].clone();
            let run = RunKey::new(tenant.clone(), format!("r{w}"));
            std::thread::spawn(move || {
                s.put_run(RunRecord::new(run.clone(), "x").with_budget("b"))
                    .expect("run");
                let mut n = 0u64;
                loop {
                    // Past the cap alone: the caps did not hold.
                    assert!(n * unit <= cap, "worker {w} spent past the cap");
                    let id = format!("h{n}");
                    match s.reserve(&run, Hold::new(id.clone(), 60_000).cost_micros(unit)) {
                        Ok(_) => {}
                        Err(StateError::BudgetExceeded { .. }) => return n,
                        Err(e) => panic!("reserve: {e:?}"),
                    }
                    s.settle(
                        &run,
                        &id,
                        StateDelta {
                            cost_micros: unit,
                            ..Default::default()
                        },
                    )
                    .expect("settle");
                    n += 1;
                }
            })
        })
        .collect();
    let settled: u64 = handles.into_iter().map(|h| h.join().expect("worker")).sum();
    let st = stores[1].get_budget(&bk).expect("status").expect("budget");
    assert_eq!(st.spent.cost_micros, settled * unit);
    assert_eq!(st.spent.cost_micros, cap, "spent exactly to the cap");
    assert_eq!(st.held.cost_micros, 0);
}

/// A database a schema-7 build set up and holds a live hold in: this
/// build's reserve names `setup()` (its function and columns are missing),
/// `setup()` upgrades it in place, and the old hold (no amount columns)
/// still counts against the caps.
#[test]
fn setup_upgrades_a_schema_7_database_with_live_holds() {
    use agentstate::{BudgetKey, BudgetRecord, BudgetStore, Caps, Hold};
    let dsn = fresh_db("v7");
    let s = PostgresStore::connect(&dsn).expect("connect");
    s.setup().expect("setup");
    let bk = BudgetKey::new("t", "b");
    s.put_budget(BudgetRecord::new(bk.clone(), Caps::new().cost_micros(100)))
        .expect("budget");
    let run = RunKey::new("t", "r");
    s.put_run(RunRecord::new(run.clone(), "x").with_budget("b"))
        .expect("run");
    s.reserve(&run, Hold::new("old", 60_000).cost_micros(70))
        .expect("reserve");
    drop(s);
    // Back to schema 7's layout.
    let mut c = postgres::Client::connect(&dsn, postgres::NoTls).expect("raw");
    c.batch_execute(
        "DROP FUNCTION public.agentstate_reserve, public.agentstate_settle, \
         public.agentstate_lock_seen, public.agentstate_live_holds, \
         public.agentstate_purge_expired, public.agentstate_fits; \
         ALTER TABLE public.agentstate_holds DROP COLUMN cost_micros, DROP COLUMN tokens, \
         DROP COLUMN iterations; \
         UPDATE public.agentstate_meta SET value = '7' WHERE name = 'schema_version'",
    )
    .expect("schema 7");
    let s = PostgresStore::connect(&dsn).expect("connect");
    let e = s
        .reserve(&run, Hold::new("new", 60_000).cost_micros(10))
        .expect_err("schema 7 has no amount columns");
    assert!(e.to_string().contains("setup()"), "{e}");
    s.setup().expect("upgrade");
    assert_eq!(s.schema_version().expect("version"), Some(10));
    assert!(
        matches!(
            s.reserve(&run, Hold::new("new", 60_000).cost_micros(31)),
            Err(StateError::BudgetExceeded { held: 70, .. })
        ),
        "the schema-7 hold counts"
    );
    s.reserve(&run, Hold::new("new", 60_000).cost_micros(30))
        .expect("70 + 30 fits");
    let cost = |c: u64| StateDelta {
        cost_micros: c,
        ..Default::default()
    };
    s.settle(&run, "old", cost(70))
        .expect("settle the old hold");
    s.settle(&run, "new", cost(30)).expect("settle the new one");
    let st = s.get_budget(&bk).expect("status").expect("budget");
    assert_eq!((st.spent.cost_micros, st.held.cost_micros), (100, 0));
    assert!(s.verify().expect("verify").is_ok());
}

/// D5 on PostgreSQL: rows lost under the store (deleted by hand) are named
/// by `verify()`: a run whose session row is gone. (Trays with no epoch
/// row are at epoch 0, as pinned's own store leaves them: not named.)
#[test]
fn d5_verify_names_a_lost_session_row() {
    use agentstate::{InstanceKey, SessionKey, SessionRecord, Tray, TrayOp, TrayStore};
    let schema = unique("lostrows").replace('-', "_");
    let s = PostgresStore::connect_with(shared_dsn(), PgOptions::new().schema(&schema))
        .expect("connect");
    s.setup().expect("setup");
    s.put_session(SessionRecord::new(SessionKey::new("t", "s1")))
        .expect("session");
    let mut r = RunRecord::new(RunKey::new("t", "r1"), "a");
    r.session_id = Some("s1".into());
    s.put_run(r).expect("run");
    let put = TrayOp::Put {
        tray_ns: "n".into(),
        tray_id: "x".into(),
        tray: Tray {
            marked: false,
            doc: b"{}".to_vec(),
            env: "e".into(),
            hostname: "h".into(),
        },
    };
    s.apply_batch(&InstanceKey::new("ns", "w1"), 3, vec![put])
        .expect("tray");
    // A session whose runs all finished may be deleted (S2): its runs
    // name it, and that is no loss.
    s.put_session(SessionRecord::new(SessionKey::new("t", "s2")))
        .expect("session");
    let mut done = RunRecord::new(RunKey::new("t", "r2"), "a");
    done.session_id = Some("s2".into());
    let mut done = s.put_run(done).expect("run");
    done.state = agentstate::RunState::Completed;
    s.put_run(done).expect("finish");
    s.delete_session(&SessionKey::new("t", "s2"), false)
        .expect("a session of finished runs");
    let report = s.verify().expect("verify");
    assert!(report.is_ok(), "a sound store: {:?}", report.problems);

    let mut c = postgres::Client::connect(shared_dsn(), postgres::NoTls).expect("raw");
    c.batch_execute(&format!(
        "DELETE FROM \"{schema}\".agentstate_sessions; DELETE FROM \"{schema}\".pinned_epoch"
    ))
    .expect("tamper");
    let text = s.verify().expect("verify").problems.join("\n");
    assert!(
        text.contains("run t/r1: its session s1 is missing"),
        "verify names the lost session; it said:\n{text}"
    );
    assert!(!text.contains("epoch"), "{text}");
    c.batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .expect("drop");
}

/// Schema 10: a shared budget's spend is booked into its row's
/// `charged_*`, never by rewriting its encoded `spent`, so what each store
/// saw of the budget stays true and its one-round-trip reserve is not
/// declined. Four stores (each its own pool and view) draw on one budget
/// from four threads: the caps hold exactly (every reserve that would
/// pass the cap is refused, the spent equals the sum of what was
/// settled), `spent` is the bytes the budget was created with, and the
/// store reads spent + charged everywhere (status, listing, export).
/// An older build's `agentstate_reserve` call counts the charged spend;
/// a hold written around it (an older build's locked path, plain SQL) is
/// refused while charged spend exists.
#[test]
fn a_shared_budget_books_spend_into_charged_columns() {
    use agentstate::{BudgetKey, BudgetRecord, BudgetStore, Caps, Hold, PageRequest, StoreAdmin};
    const THREADS: u64 = 4;
    let rounds = rounds(25);
    // A database of its own: verify and export read all of it.
    let dsn = fresh_db("charged");
    let s = PostgresStore::connect(&dsn).expect("connect");
    s.setup().expect("setup");
    let tenant = unique("charged");
    let bk = BudgetKey::new(tenant.clone(), "shared");
    // Room for exactly 3/4 of what the threads ask to settle.
    let cap = THREADS * rounds * 10 * 3 / 4;
    s.put_budget(BudgetRecord::new(bk.clone(), Caps::new().cost_micros(cap)))
        .expect("budget");
    let mut raw = postgres::Client::connect(&dsn, postgres::NoTls).expect("raw");
    let spent_bytes = |raw: &mut postgres::Client| -> Vec<u8> {
        raw.query_one(
            "SELECT spent FROM public.agentstate_budgets WHERE tenant = $1 AND name = 'shared'",
            &[&tenant],
        )
        .expect("spent")
        .get(0)
    };
    let before = spent_bytes(&mut raw);
    let settled = Arc::new(AtomicU64::new(0));
    let refused = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = (0..THREADS)
        .map(|w| {
            let (dsn, tenant, settled, refused) = (
                dsn.clone(),
                tenant.clone(),
                settled.clone(),
                refused.clone(),
            );
            std::thread::spawn(move || {
                let s = PostgresStore::connect(&dsn).expect("connect");
                let run = RunKey::new(&tenant, format!("r{w}"));
                s.put_run(RunRecord::new(run.clone(), "x").with_budget("shared"))
                    .expect("run");
                for i in 0..rounds {
                    let id = format!("h{i}");
                    match s.reserve(&run, Hold::new(&id, 60_000).cost_micros(10)) {
                        Ok(_) => {
                            s.settle(
                                &run,
                                &id,
                                StateDelta {
                                    cost_micros: 10,
                                    ..StateDelta::default()
                                },
                            )
                            .expect("settle");
                            settled.fetch_add(10, Ordering::SeqCst);
                        }
                        Err(StateError::BudgetExceeded { .. }) => {
                            refused.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(e) => panic!("reserve: {e:?}"),
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("thread");
    }
    let settled = settled.load(Ordering::SeqCst);
    assert_eq!(settled, cap, "every reserve that fit was granted, no more");
    assert_eq!(refused.load(Ordering::SeqCst), THREADS * rounds / 4);
    let status = s.get_budget(&bk).expect("get").expect("budget");
    assert_eq!(status.spent.cost_micros, cap, "spent + charged");
    assert_eq!(status.held.cost_micros, 0);
    let listed = s
        .list_budgets(&tenant, &PageRequest::new(10))
        .expect("list");
    assert_eq!(listed.items()[0].spent.cost_micros, cap);
    assert_eq!(spent_bytes(&mut raw), before, "spent never rewritten");
    let charged: String = raw
        .query_one(
            "SELECT charged_cost_micros::text FROM public.agentstate_budgets \
             WHERE tenant = $1 AND name = 'shared'",
            &[&tenant],
        )
        .expect("charged")
        .get(0);
    assert_eq!(charged, cap.to_string());
    let exported = s
        .export_page(&PageRequest::new(1000))
        .expect("export")
        .items()
        .iter()
        .filter_map(|e| match e {
            agentstate::Entry::Budget { spent, .. } => Some(spent.cost_micros),
            _ => None,
        })
        .collect::<Vec<_>>();
    assert_eq!(exported, vec![cap]);
    assert!(s.verify().expect("verify").problems.is_empty());

    // An older build: its one-statement reserve counts what is charged.
    let run = RunKey::new(&tenant, "old");
    s.put_run(RunRecord::new(run.clone(), "x").with_budget("shared"))
        .expect("run");
    let mut raised = status.record.clone();
    raised.caps = Caps::new().cost_micros(cap + 5);
    s.put_budget(raised).expect("raise the cap");
    // put_budget wrote the whole row: spent took the charged spend in.
    assert_ne!(spent_bytes(&mut raw), before);
    s.settle(
        &run,
        &s.reserve(&run, Hold::new("a", 60_000).cost_micros(1))
            .expect("reserve")
            .id,
        StateDelta {
            cost_micros: 1,
            ..StateDelta::default()
        },
    )
    .expect("settle");
    let (record, spent): (Vec<u8>, Vec<u8>) = {
        let r = raw
            .query_one(
                "SELECT record, spent FROM public.agentstate_budgets \
                 WHERE tenant = $1 AND name = 'shared'",
                &[&tenant],
            )
            .expect("row");
        (r.get(0), r.get(1))
    };
    let run_record: Vec<u8> = raw
        .query_one(
            "SELECT record FROM public.agentstate_runs WHERE tenant = $1 AND run_id = 'old'",
            &[&tenant],
        )
        .expect("run row")
        .get(0);
    // 4 left under the cap by spent alone (as an older build read it),
    // 4 - 1 charged = 3 in truth: asking 4 must be declined.
    let old_reserve = |raw: &mut postgres::Client, asked: u64| -> bool {
        raw.query_one(
            "SELECT public.agentstate_reserve($1, 'old', $2, 'shared', $3, $4, 'x', '\\x00', \
             9e15, 0, ARRAY[$5::text::numeric, 0, 0], ARRAY[0, 0, 0]::numeric[], \
             ARRAY[NULL, NULL, NULL]::numeric[], ARRAY[$6::text::numeric, 0, 0], \
             ARRAY[$7::text::numeric, NULL, NULL], 100)",
            &[
                &tenant,
                &run_record,
                &record,
                &spent,
                &asked.to_string(),
                &cap.to_string(),
                &(cap + 5).to_string(),
            ],
        )
        .expect("agentstate_reserve")
        .get(0)
    };
    assert!(!old_reserve(&mut raw, 5), "1 charged leaves 4, not 5");
    assert!(old_reserve(&mut raw, 4), "4 fit");
    // A hold written around the function while spend is charged.
    let e = raw
        .execute(
            "INSERT INTO public.agentstate_holds \
             (tenant, run_id, hold_id, budget, expires_at, record, cost_micros, tokens, iterations) \
             VALUES ($1, 'old', 'plain', 'shared', 9e15, '\\x00', 1, 0, 0)",
            &[&tenant],
        )
        .expect_err("refused");
    let msg = e.as_db_error().map(|d| d.message().to_string());
    assert!(
        msg.as_deref().is_some_and(|m| m.contains("upgrade")),
        "{e:?}"
    );
}

/// Every transaction of the store runs with its settings, whatever the
/// server's defaults: `synchronous_commit = on` (the durability promise),
/// its statement timeout, twice that for idling in a transaction, and
/// the `agentstate.writer` the triggers look at (each transaction sets
/// them with `SET LOCAL`; the server's defaults are left alone), with the
/// statement cache on and off (behind a transaction-mode pooler). Seen
/// from inside the store's transactions by a trigger.
#[test]
fn the_stores_transactions_run_with_its_settings_on_a_server_that_defaults_otherwise() {
    let dsn = fresh_db("settings");
    let mut c = postgres::Client::connect(&dsn, postgres::NoTls).expect("raw");
    let db: String = c
        .query_one("SELECT current_database()", &[])
        .expect("db")
        .get(0);
    c.batch_execute(&format!(
        "ALTER DATABASE {db} SET synchronous_commit = off; \
         ALTER DATABASE {db} SET statement_timeout = '1h'; \
         ALTER DATABASE {db} SET idle_in_transaction_session_timeout = 0"
    ))
    .expect("defaults");
    for cache in [true, false] {
        let schema = if cache { "with_cache" } else { "without_cache" };
        let s = PostgresStore::connect_with(
            &dsn,
            PgOptions::new()
                .schema(schema)
                .statement_timeout(Duration::from_millis(4500))
                .statement_cache(cache),
        )
        .expect("connect");
        s.setup().expect("setup");
        c.batch_execute(&format!(
            "CREATE TABLE {schema}.seen (sync text, timeout text, idle text, writer text); \
             CREATE FUNCTION {schema}.see() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
               INSERT INTO {schema}.seen VALUES (current_setting('synchronous_commit'), \
                 current_setting('statement_timeout'), \
                 current_setting('idle_in_transaction_session_timeout'), \
                 current_setting('agentstate.writer', true)); RETURN NULL; END $$; \
             CREATE TRIGGER see AFTER INSERT OR UPDATE ON {schema}.agentstate_runs \
               FOR EACH ROW EXECUTE FUNCTION {schema}.see()"
        ))
        .expect("the trigger");
        // Several calls, so a pooled connection serves more than one.
        let key = RunKey::new("t", "r");
        s.put_run(RunRecord::new(key.clone(), "a")).expect("create");
        for _ in 0..3 {
            s.patch_run(&key, StateDelta::default()).expect("patch");
        }
        let seen: Vec<(String, String, String, Option<String>)> = c
            .query(&format!("SELECT * FROM {schema}.seen"), &[])
            .expect("seen")
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
            .collect();
        assert_eq!(seen.len(), 4, "{seen:?}");
        for row in &seen {
            assert_eq!(
                row,
                &(
                    "on".to_string(),
                    "4500ms".to_string(),
                    "9s".to_string(),
                    Some("store".to_string())
                ),
                "statement cache {cache}: the store's transaction ran with {row:?}"
            );
        }
        // A connection of its own keeps the database's defaults.
        let plain: String = postgres::Client::connect(&dsn, postgres::NoTls)
            .expect("plain")
            .query_one("SELECT current_setting('synchronous_commit')", &[])
            .expect("plain")
            .get(0);
        assert_eq!(plain, "off");
    }
}
