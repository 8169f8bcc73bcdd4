//! The SQLite side of the 1M-run figures (issue 13): the same runs as the
//! big tenant in a SQLite table, loaded once by a child that is killed with
//! un-checkpointed WAL content, then paged and opened beside the store.
//!
//! Table: one row per run (`seq INTEGER PRIMARY KEY`, tenant, run id,
//! version, state, session, `updated_at`, and a ~260-byte `body` blob: the
//! rest of the record, [`RunRest`], in postcard), `UNIQUE(tenant, run_id)`
//! for point reads, and the indexes a listing needs: `(tenant, seq)` and
//! `(tenant, state, seq)`. WAL mode, `synchronous=NORMAL` (a commit reaches
//! the OS before it returns, as `Durability::Buffered` does for the store).
//!
//! A page is timed two ways: [`Pager::page`] reads each row's columns and
//! copies its body out (the first definition of `page_1m_vs_sqlite`), and
//! [`Pager::page_records`] also decodes the body and builds the same
//! [`RunRecord`] our page returns (`page_1m_vs_sqlite_records`): the same
//! work for the caller, short of a checksum (SQLite checks none by default).

use std::io::Write as _;
use std::path::Path;
use std::time::Instant;

use agentstate::{Approval, Caps, Millis, RunKey, RunRecord, RunState, ToolCall, Usage};
use serde::{Deserialize, Serialize};

use super::{TENANT, listing_state, now_ms, record, run_id};

/// The runs table and the indexes both SQLite contenders use.
pub const RUNS_SCHEMA: &str = "CREATE TABLE runs(
    seq INTEGER PRIMARY KEY,
    tenant TEXT NOT NULL,
    run_id TEXT NOT NULL,
    version INTEGER NOT NULL,
    state INTEGER NOT NULL,
    session_id TEXT,
    updated_at INTEGER NOT NULL,
    body BLOB NOT NULL,
    UNIQUE(tenant, run_id));
CREATE INDEX runs_by_tenant ON runs(tenant, seq);
CREATE INDEX runs_by_state ON runs(tenant, state, seq);";

/// The database file inside its directory.
pub const DB_FILE: &str = "runs.db";
/// Rows per load transaction.
const LOAD_BATCH: u64 = 10_000;

/// The state column's value: the state's place in [`RunState::ALL`].
pub fn state_code(s: RunState) -> i64 {
    RunState::ALL
        .iter()
        .position(|&x| x == s)
        .expect("every state is in ALL") as i64
}

/// The state a state column holds.
fn state_of(code: i64) -> rusqlite::Result<RunState> {
    usize::try_from(code)
        .ok()
        .and_then(|i| RunState::ALL.get(i).copied())
        .ok_or(rusqlite::Error::IntegralValueOutOfRange(4, code))
}

/// What the body blob holds: every field of a run record that has no
/// column of its own, in postcard.
#[derive(Serialize, Deserialize)]
pub struct RunRest {
    agent_name: String,
    messages_read: u64,
    pending_tool_calls: Vec<ToolCall>,
    usage: Usage,
    cost_micros: u64,
    iterations: u64,
    approval: Option<Approval>,
    created_at: Millis,
    caps: Caps,
    budget: Option<String>,
}

/// The body of run `r`'s row.
pub fn body_of(r: &RunRecord) -> Vec<u8> {
    postcard::to_stdvec(&RunRest {
        agent_name: r.agent_name.clone(),
        messages_read: r.messages_read,
        pending_tool_calls: r.pending_tool_calls.clone(),
        usage: r.usage,
        cost_micros: r.cost_micros,
        iterations: r.iterations,
        approval: r.approval.clone(),
        created_at: r.created_at,
        caps: r.caps,
        budget: r.budget.clone(),
    })
    .expect("postcard encodes a run")
}

/// The body of the `i`-th run of the big tenant, created at `now`.
fn body(i: u64, now: Millis) -> Vec<u8> {
    let mut r = record(TENANT, run_id(i), listing_state(i));
    r.created_at = now;
    body_of(&r)
}

fn open(path: &Path) -> rusqlite::Connection {
    rusqlite::Connection::open(path).expect("sqlite open")
}

/// Rows loaded with the WAL checkpointed as usual before the un-checkpointed
/// tail: the tail is the last 1% of the rows.
pub fn tail_rows(n: u64) -> u64 {
    (n / 100).max(1)
}

/// Child: creates the table, loads `n` runs (the big tenant's ids and
/// states) in transactions of 10k rows with SQLite's default
/// autocheckpoint (and a 64 MiB page cache, so the random inserts into the
/// `(tenant, run_id)` index do not thrash the default 2 MiB one), truncates the WAL, turns autocheckpoint off, loads the
/// last 1% of the rows and then `patches` single-row updates of the last
/// runs (one transaction each), so every one of those writes is in the WAL
/// only. Prints `CHILD last_ack=<run id> <version>` after the last commit
/// returned and waits to be killed.
pub fn load_child(n: u64, patches: u64, dir: &Path) {
    std::fs::create_dir_all(dir).expect("sqlite dir");
    let path = dir.join(DB_FILE);
    let t = Instant::now();
    let mut conn = open(&path);
    let mode: String = conn
        .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
        .expect("wal");
    assert_eq!(mode.to_lowercase(), "wal");
    conn.execute_batch(&format!(
        "PRAGMA synchronous=NORMAL; PRAGMA cache_size=-65536; {RUNS_SCHEMA}"
    ))
    .expect("sqlite schema");
    let tail = tail_rows(n);
    let insert = |conn: &mut rusqlite::Connection, from: u64, to: u64| {
        let mut i = from;
        while i < to {
            let tx = conn.transaction().expect("begin");
            {
                let mut st = tx
                    .prepare_cached(
                        "INSERT INTO runs(seq, tenant, run_id, version, state, session_id, updated_at, body)
                         VALUES (?1, ?2, ?3, 1, ?4, NULL, ?5, ?6)",
                    )
                    .expect("prepare");
                for j in i..(i + LOAD_BATCH).min(to) {
                    let now = now_ms();
                    st.execute(rusqlite::params![
                        (j + 1) as i64,
                        TENANT,
                        run_id(j),
                        state_code(listing_state(j)),
                        now as i64,
                        body(j, now)
                    ])
                    .expect("insert");
                }
            }
            tx.commit().expect("commit");
            i += LOAD_BATCH;
        }
    };
    insert(&mut conn, 0, n - tail);
    // From here on nothing reaches the database file: the WAL starts empty
    // and is never checkpointed, so a kill leaves all of the rest in it.
    let (busy, _, _): (i64, i64, i64) = conn
        .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })
        .expect("checkpoint");
    assert_eq!(busy, 0, "checkpoint blocked");
    conn.execute_batch("PRAGMA wal_autocheckpoint=0;")
        .expect("autocheckpoint off");
    insert(&mut conn, n - tail, n);
    let mut last = (String::new(), 0i64);
    for j in n.saturating_sub(patches)..n {
        let id = run_id(j);
        let tx = conn.transaction().expect("begin");
        let version: i64 = tx
            .prepare_cached(
                "UPDATE runs SET version = version + 1, updated_at = ?1, body = ?2
                 WHERE tenant = ?3 AND run_id = ?4 RETURNING version",
            )
            .expect("prepare")
            .query_row(
                rusqlite::params![now_ms() as i64, body(j, now_ms()), TENANT, &id],
                |r| r.get(0),
            )
            .expect("update");
        tx.commit().expect("commit");
        last = (id, version);
    }
    let wal = std::fs::metadata(dir.join(format!("{DB_FILE}-wal")))
        .map(|m| m.len())
        .unwrap_or(0);
    assert!(wal > 0, "the WAL must hold the un-checkpointed writes");
    println!("CHILD load_s={:.3}", t.elapsed().as_secs_f64());
    println!("CHILD wal_bytes={wal}");
    println!("CHILD last_ack={} {}", last.0, last.1);
    std::io::stdout().flush().expect("flush");
    super::wait_for_kill();
}

/// Child: opens the database in `dir` and reads the run `id` by its key;
/// prints the open, the read, their sum (µs) and the version read.
pub fn open_child(dir: &Path, id: &str) {
    let t = Instant::now();
    let conn = open(&dir.join(DB_FILE));
    let open_us = t.elapsed().as_secs_f64() * 1e6;
    let (version, body): (i64, Vec<u8>) = conn
        .query_row(
            "SELECT version, body FROM runs WHERE tenant = ?1 AND run_id = ?2",
            rusqlite::params![TENANT, id],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .expect("point read");
    let total_us = t.elapsed().as_secs_f64() * 1e6;
    std::hint::black_box(body);
    println!("CHILD open_us={open_us:.1}");
    println!("CHILD total_us={total_us:.1}");
    println!("CHILD version={version}");
    let t = Instant::now();
    conn.close().map_err(|(_, e)| e).expect("close");
    println!("CHILD close_us={:.1}", t.elapsed().as_secs_f64() * 1e6);
}

/// One row, read whole.
#[allow(dead_code)] // the fields are read to be returned, as a page's records are
pub struct Row {
    pub seq: i64,
    pub tenant: String,
    pub run_id: String,
    pub version: i64,
    pub state: i64,
    pub session_id: Option<String>,
    pub updated_at: i64,
    pub body: Vec<u8>,
}

/// The parent's connection for the page and stale-reaper timings.
pub struct Pager {
    conn: rusqlite::Connection,
}

const COLUMNS: &str = "seq, tenant, run_id, version, state, session_id, updated_at, body";

fn row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Row> {
    Ok(Row {
        seq: r.get(0)?,
        tenant: r.get(1)?,
        run_id: r.get(2)?,
        version: r.get(3)?,
        state: r.get(4)?,
        session_id: r.get(5)?,
        updated_at: r.get(6)?,
        body: r.get(7)?,
    })
}

/// One row as the store's page returns it: the columns and the decoded
/// body built into a [`RunRecord`].
fn run_record(r: &rusqlite::Row<'_>) -> rusqlite::Result<RunRecord> {
    let seq: i64 = r.get(0)?;
    let version: i64 = r.get(3)?;
    let updated_at: i64 = r.get(6)?;
    let rest: RunRest = postcard::from_bytes(r.get_ref(7)?.as_blob()?).map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(7, rusqlite::types::Type::Blob, Box::new(e))
    })?;
    Ok(RunRecord {
        key: RunKey::new(r.get::<_, String>(1)?, r.get::<_, String>(2)?),
        version: version as u64,
        state: state_of(r.get(4)?)?,
        agent_name: rest.agent_name,
        session_id: r.get(5)?,
        messages_read: rest.messages_read,
        pending_tool_calls: rest.pending_tool_calls,
        usage: rest.usage,
        cost_micros: rest.cost_micros,
        iterations: rest.iterations,
        approval: rest.approval,
        created_at: rest.created_at,
        updated_at: updated_at as u64,
        seq: seq as u64,
        caps: rest.caps,
        budget: rest.budget,
        labels: Default::default(),
    })
}

impl Pager {
    /// Opens the database in `dir` (recovering its WAL) with a 32 MiB page
    /// cache, the size of the store's engine cache.
    pub fn open(dir: &Path) -> Pager {
        let conn = open(&dir.join(DB_FILE));
        conn.execute_batch("PRAGMA cache_size=-32768;")
            .expect("cache size");
        Pager { conn }
    }

    /// The plan SQLite picks for the page query, for the output.
    pub fn plan(&self) -> String {
        let mut st = self
            .conn
            .prepare(&format!(
                "EXPLAIN QUERY PLAN SELECT {COLUMNS} FROM runs
                 WHERE tenant = ?1 AND seq > ?2 ORDER BY seq LIMIT 101"
            ))
            .expect("explain");
        let rows = st
            .query_map(rusqlite::params![TENANT, 0], |r| r.get::<_, String>(3))
            .expect("explain rows");
        rows.map(|r| r.expect("plan row"))
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// A page of 100 after `after` (keyset pagination: 101 rows asked for,
    /// the 101st says whether a next page exists). Returns the page and
    /// the next page's `after`.
    pub fn page(&self, after: i64) -> (Vec<Row>, Option<i64>) {
        let mut st = self
            .conn
            .prepare_cached(&format!(
                "SELECT {COLUMNS} FROM runs WHERE tenant = ?1 AND seq > ?2 ORDER BY seq LIMIT 101"
            ))
            .expect("prepare page");
        let mut rows: Vec<Row> = st
            .query_map(rusqlite::params![TENANT, after], row)
            .expect("page")
            .map(|r| r.expect("row"))
            .collect();
        let next = if rows.len() > 100 {
            rows.truncate(100);
            rows.last().map(|r| r.seq)
        } else {
            None
        };
        (rows, next)
    }

    /// The same page as [`Pager::page`], each row built into the
    /// [`RunRecord`] our page returns (its body decoded, read in place).
    pub fn page_records(&self, after: i64) -> (Vec<RunRecord>, Option<i64>) {
        let mut st = self
            .conn
            .prepare_cached(&format!(
                "SELECT {COLUMNS} FROM runs WHERE tenant = ?1 AND seq > ?2 ORDER BY seq LIMIT 101"
            ))
            .expect("prepare page");
        // Sized once, as our page's is (a collect would grow it 7 times).
        let mut rows: Vec<RunRecord> = Vec::with_capacity(101);
        let mut q = st.query(rusqlite::params![TENANT, after]).expect("page");
        while let Some(r) = q.next().expect("row") {
            rows.push(run_record(r).expect("run row"));
        }
        let next = if rows.len() > 100 {
            rows.truncate(100);
            rows.last().map(|r| r.seq as i64)
        } else {
            None
        };
        (rows, next)
    }

    /// The stale-reaper page: running runs last written before `before`.
    pub fn stale(&self, before: u64) -> Vec<Row> {
        let mut st = self
            .conn
            .prepare_cached(&format!(
                "SELECT {COLUMNS} FROM runs WHERE tenant = ?1 AND state = ?2 AND updated_at < ?3
                 ORDER BY seq LIMIT 101"
            ))
            .expect("prepare stale");
        st.query_map(
            rusqlite::params![TENANT, state_code(RunState::Running), before as i64],
            row,
        )
        .expect("stale")
        .map(|r| r.expect("row"))
        .collect()
    }
}
