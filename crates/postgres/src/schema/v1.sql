-- agentstate PostgreSQL schema, version 1.
--
-- Applied by `PostgresStore::setup()` inside one transaction that first
-- takes a transaction-scoped advisory lock, so any number of workers may
-- run it at once. `{s}` is the configured schema, quoted, with its dot.
--
-- Every id column is text in the "C" collation (byte order, the order of
-- every other backend). An id holding a NUL or U+0001 (which text cannot
-- hold as is) is stored with U+0001 as an escape: U+0001 U+0001 for NUL,
-- U+0001 U+0002 for U+0001. Every other id is stored verbatim.
--
-- u64 amounts that the server compares (epochs, due times, update times)
-- are numeric(20,0), so the whole u64 range orders correctly; a run's
-- amounts live inside its encoded record and never wrap.

-- Names and values of the store itself: the schema version, the cursor
-- secret.
CREATE TABLE IF NOT EXISTS {s}agentstate_meta (
    name  text PRIMARY KEY,
    value text NOT NULL
);

-- The next run `seq` of each tenant. Taken in the creating transaction, so
-- a tenant's creates commit in `seq` order and a walk never skips one.
CREATE TABLE IF NOT EXISTS {s}agentstate_counters (
    tenant   text COLLATE "C" PRIMARY KEY,
    next_seq bigint NOT NULL CHECK (next_seq >= 1)
);

-- Runs: the record (the crate's record codec: format byte, postcard,
-- CRC-32) and the columns that listings filter and order on.
CREATE TABLE IF NOT EXISTS {s}agentstate_runs (
    tenant     text COLLATE "C" NOT NULL,
    run_id     text COLLATE "C" NOT NULL,
    seq        bigint NOT NULL CHECK (seq >= 1),
    state      text NOT NULL,
    session_id text COLLATE "C",
    agent_name text COLLATE "C" NOT NULL,
    updated_at numeric(20, 0) NOT NULL,
    record     bytea NOT NULL,
    PRIMARY KEY (tenant, run_id)
);
CREATE UNIQUE INDEX IF NOT EXISTS agentstate_runs_by_seq
    ON {s}agentstate_runs (tenant, seq);
CREATE INDEX IF NOT EXISTS agentstate_runs_by_state
    ON {s}agentstate_runs (tenant, state, seq);
CREATE INDEX IF NOT EXISTS agentstate_runs_by_session
    ON {s}agentstate_runs (tenant, session_id, seq) WHERE session_id IS NOT NULL;

-- Sessions, versioned like runs.
CREATE TABLE IF NOT EXISTS {s}agentstate_sessions (
    tenant     text COLLATE "C" NOT NULL,
    session_id text COLLATE "C" NOT NULL,
    record     bytea NOT NULL,
    PRIMARY KEY (tenant, session_id)
);

-- The seed's tray tables, by name and column, so a sweeper that reads them
-- directly keeps working.
CREATE TABLE IF NOT EXISTS {s}pinned_epoch (
    ns    text COLLATE "C" NOT NULL,
    id    text COLLATE "C" NOT NULL,
    epoch numeric(20, 0) NOT NULL CHECK (epoch >= 0),
    PRIMARY KEY (ns, id)
);
CREATE TABLE IF NOT EXISTS {s}pinned_tray_index (
    ns       text COLLATE "C" NOT NULL,
    id       text COLLATE "C" NOT NULL,
    tray_ns  text COLLATE "C" NOT NULL,
    tray_id  text COLLATE "C" NOT NULL,
    marked   boolean NOT NULL,
    doc      bytea NOT NULL,
    env      text COLLATE "C" NOT NULL,
    hostname text COLLATE "C" NOT NULL,
    PRIMARY KEY (ns, id, tray_ns, tray_id)
);
CREATE INDEX IF NOT EXISTS pinned_tray_index_marked
    ON {s}pinned_tray_index (ns, id, tray_ns, tray_id) WHERE marked;
CREATE INDEX IF NOT EXISTS pinned_tray_index_marked_by_env
    ON {s}pinned_tray_index (env, ns, id, tray_ns, tray_id) WHERE marked;

-- One alarm per instance (rule A1).
CREATE TABLE IF NOT EXISTS {s}agentstate_alarms (
    ns     text COLLATE "C" NOT NULL,
    id     text COLLATE "C" NOT NULL,
    due_at numeric(20, 0) NOT NULL,
    PRIMARY KEY (ns, id)
);
CREATE INDEX IF NOT EXISTS agentstate_alarms_by_due
    ON {s}agentstate_alarms (due_at, ns, id);
