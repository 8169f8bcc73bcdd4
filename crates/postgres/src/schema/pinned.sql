-- The seeds' own tray tables, exactly as pinned's PostgresStateStore
-- (pinned 0.16, `setup()`) creates them: same names, columns, types,
-- defaults and primary keys, text in the database's default collation.
--
-- `PostgresStore::setup()` runs this before v1.sql on a database it has
-- never set up, so that either program may set the database up first and
-- both then share these tables (IF NOT EXISTS: whichever comes second
-- creates nothing). What agentstate adds to them (schema 9: the nullable
-- `doc_raw` column, indexes, triggers) pinned never reads or writes.

CREATE TABLE IF NOT EXISTS {s}pinned_epoch (
    ns TEXT NOT NULL, id TEXT NOT NULL, epoch BIGINT NOT NULL,
    PRIMARY KEY (ns, id)
);
CREATE TABLE IF NOT EXISTS {s}pinned_tray_index (
    ns TEXT NOT NULL, id TEXT NOT NULL,
    tray_ns TEXT NOT NULL, tray_id TEXT NOT NULL,
    marked BOOLEAN NOT NULL, doc JSONB NOT NULL,
    env TEXT NOT NULL DEFAULT '*', hostname TEXT NOT NULL DEFAULT '*',
    PRIMARY KEY (ns, id, tray_ns, tray_id)
);
