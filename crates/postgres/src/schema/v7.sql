-- agentstate PostgreSQL schema, version 7: the change feed (rules F1-F8).
--
-- Applied by `PostgresStore::setup()` after v6.sql, in the same
-- transaction under the same advisory lock; a database at versions 1-6 is
-- upgraded by it in place, and every record it already holds gets its
-- feed row here (at this transaction's position).
--
-- One row per record ever written (run, session, tray, alarm), keyed by
-- the record's identity, so each record has ONE row that moves to the
-- position of the last transaction that wrote or deleted it: the feed is
-- level-triggered, and a consumer catches up in time proportional to the
-- records that changed. The row holds no copy of the record; a read joins
-- the record's own table (present: its current state; absent: a
-- tombstone).
--
--   kind 1 run      (k1, k2) = (tenant, run_id)           feed 1, scope tenant
--   kind 2 session  (k1, k2) = (tenant, session_id)       feed 1, scope tenant
--   kind 3 tray     (k1, k2, k3, k4) = (ns, id, tray_ns, tray_id)
--                                                         feed 2, scope ''
--   kind 4 alarm    (k1, k2) = (ns, id)                   feed 2, scope ''
--
-- Ids are stored as every id is (see `id_in`). A tray's `env` is the env
-- it was last written with, kept on its delete (a tombstone belongs to the
-- env of the write before it); the alarm rows of `pinned_tray_index`
-- (v5.sql) are the alarms', which have their own kind.
--
-- A position is (xid, n): the writing transaction's id (`xid8`, which
-- never wraps) and a number from a sequence, ordered as a pair. Rows are
-- read only below the reader's snapshot `xmin` (every transaction below it
-- has ended, so nothing can later appear there): a transaction that
-- commits late is never skipped, and a long-open transaction anywhere on
-- the server holds the feed back until it ends.
--
-- AFTER triggers on the record tables keep the rows, in the writing
-- transaction, on every path that writes a record (the store's calls,
-- import, prune, cascades, purge, plain SQL), and `pg_notify` the channel
-- `agentstate_feed <schema>` (cut to 63 bytes) with the scope
-- ('t <tenant>' or 'trays'), delivered at commit: what wakes
-- `wait_changes`.

CREATE SEQUENCE IF NOT EXISTS {s}agentstate_changes_n AS bigint;

CREATE TABLE IF NOT EXISTS {s}agentstate_changes (
    kind    smallint NOT NULL CHECK (kind BETWEEN 1 AND 4),
    k1      text COLLATE "C" NOT NULL,
    k2      text COLLATE "C" NOT NULL,
    k3      text COLLATE "C" NOT NULL DEFAULT '',
    k4      text COLLATE "C" NOT NULL DEFAULT '',
    feed    smallint NOT NULL CHECK (feed IN (1, 2)),
    scope   text COLLATE "C" NOT NULL,
    env     text COLLATE "C",
    xid     xid8 NOT NULL,
    n       bigint NOT NULL,
    deleted boolean NOT NULL,
    PRIMARY KEY (kind, k1, k2, k3, k4)
);
-- A feed read: one scope, in position order.
CREATE INDEX IF NOT EXISTS agentstate_changes_by_position
    ON {s}agentstate_changes (feed, scope, xid, n);
-- One env's trays.
CREATE INDEX IF NOT EXISTS agentstate_changes_by_env
    ON {s}agentstate_changes (env, xid, n) WHERE kind = 3;
-- Pruning reads only the tombstones.
CREATE INDEX IF NOT EXISTS agentstate_changes_tombstones
    ON {s}agentstate_changes (feed, scope, xid, n) WHERE deleted;

-- Per feed (1 a tenant's, 2 the trays'): the position through which its
-- tombstones may have been dropped (`prune_changes`, `purge_tenant`). A
-- read after an older position is `FeedPruned`.
CREATE TABLE IF NOT EXISTS {s}agentstate_feed_horizons (
    feed  smallint NOT NULL CHECK (feed IN (1, 2)),
    scope text COLLATE "C" NOT NULL,
    xid   xid8 NOT NULL,
    n     bigint NOT NULL,
    PRIMARY KEY (feed, scope)
);

-- Moves a record's row to this transaction's position, and notifies.
CREATE OR REPLACE FUNCTION {s}agentstate_feed_put(
    p_kind smallint, p_k1 text, p_k2 text, p_k3 text, p_k4 text,
    p_feed smallint, p_scope text, p_env text, p_deleted boolean, p_schema text
) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO {s}agentstate_changes AS c
        (kind, k1, k2, k3, k4, feed, scope, env, xid, n, deleted)
    VALUES (p_kind, p_k1, p_k2, p_k3, p_k4, p_feed, p_scope, p_env,
            pg_current_xact_id(), nextval('{s}agentstate_changes_n'), p_deleted)
    ON CONFLICT (kind, k1, k2, k3, k4) DO UPDATE SET
        feed = EXCLUDED.feed, scope = EXCLUDED.scope, env = EXCLUDED.env,
        xid = EXCLUDED.xid, n = EXCLUDED.n, deleted = EXCLUDED.deleted;
    PERFORM pg_notify(left('agentstate_feed ' || p_schema, 63),
                      CASE WHEN p_feed = 1 THEN 't ' || p_scope ELSE 'trays' END);
END
$$;

CREATE OR REPLACE FUNCTION {s}agentstate_feed_run() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND (OLD.tenant, OLD.run_id) IS NOT DISTINCT FROM (NEW.tenant, NEW.run_id)
       AND OLD.record IS NOT DISTINCT FROM NEW.record AND OLD.seq = NEW.seq THEN
        -- Only columns derived from the record (setup's `fields`): no change.
        RETURN NULL;
    END IF;
    IF TG_OP <> 'INSERT' THEN
        IF TG_OP = 'DELETE' OR (OLD.tenant, OLD.run_id) IS DISTINCT FROM (NEW.tenant, NEW.run_id) THEN
            PERFORM {s}agentstate_feed_put(1::smallint, OLD.tenant, OLD.run_id, '', '',
                                           1::smallint, OLD.tenant, NULL, true, TG_TABLE_SCHEMA);
        END IF;
    END IF;
    IF TG_OP <> 'DELETE' THEN
        PERFORM {s}agentstate_feed_put(1::smallint, NEW.tenant, NEW.run_id, '', '',
                                       1::smallint, NEW.tenant, NULL, false, TG_TABLE_SCHEMA);
    END IF;
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION {s}agentstate_feed_session() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND (OLD.tenant, OLD.session_id) IS NOT DISTINCT FROM (NEW.tenant, NEW.session_id)
       AND OLD.record IS NOT DISTINCT FROM NEW.record THEN
        RETURN NULL;
    END IF;
    IF TG_OP <> 'INSERT' THEN
        IF TG_OP = 'DELETE' OR (OLD.tenant, OLD.session_id) IS DISTINCT FROM (NEW.tenant, NEW.session_id) THEN
            PERFORM {s}agentstate_feed_put(2::smallint, OLD.tenant, OLD.session_id, '', '',
                                           1::smallint, OLD.tenant, NULL, true, TG_TABLE_SCHEMA);
        END IF;
    END IF;
    IF TG_OP <> 'DELETE' THEN
        PERFORM {s}agentstate_feed_put(2::smallint, NEW.tenant, NEW.session_id, '', '',
                                       1::smallint, NEW.tenant, NULL, false, TG_TABLE_SCHEMA);
    END IF;
    RETURN NULL;
END
$$;

-- Trays; the alarm rows (v5.sql) are left to the alarms' trigger.
CREATE OR REPLACE FUNCTION {s}agentstate_feed_tray() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'INSERT' AND NOT (OLD.tray_ns = 'pinned' AND OLD.tray_id = 'alarm') THEN
        IF TG_OP = 'DELETE'
           OR (OLD.ns, OLD.id, OLD.tray_ns, OLD.tray_id) IS DISTINCT FROM (NEW.ns, NEW.id, NEW.tray_ns, NEW.tray_id) THEN
            PERFORM {s}agentstate_feed_put(3::smallint, OLD.ns, OLD.id, OLD.tray_ns, OLD.tray_id,
                                           2::smallint, '', OLD.env, true, TG_TABLE_SCHEMA);
        END IF;
    END IF;
    IF TG_OP <> 'DELETE' AND NOT (NEW.tray_ns = 'pinned' AND NEW.tray_id = 'alarm') THEN
        PERFORM {s}agentstate_feed_put(3::smallint, NEW.ns, NEW.id, NEW.tray_ns, NEW.tray_id,
                                       2::smallint, '', NEW.env, false, TG_TABLE_SCHEMA);
    END IF;
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION {s}agentstate_feed_alarm() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        IF TG_OP = 'DELETE' OR (OLD.ns, OLD.id) IS DISTINCT FROM (NEW.ns, NEW.id) THEN
            PERFORM {s}agentstate_feed_put(4::smallint, OLD.ns, OLD.id, '', '',
                                           2::smallint, '', NULL, true, TG_TABLE_SCHEMA);
        END IF;
    END IF;
    IF TG_OP <> 'DELETE' THEN
        PERFORM {s}agentstate_feed_put(4::smallint, NEW.ns, NEW.id, '', '',
                                       2::smallint, '', NULL, false, TG_TABLE_SCHEMA);
    END IF;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS agentstate_feed ON {s}agentstate_runs;
CREATE TRIGGER agentstate_feed
    AFTER INSERT OR UPDATE OR DELETE ON {s}agentstate_runs
    FOR EACH ROW EXECUTE FUNCTION {s}agentstate_feed_run();
DROP TRIGGER IF EXISTS agentstate_feed ON {s}agentstate_sessions;
CREATE TRIGGER agentstate_feed
    AFTER INSERT OR UPDATE OR DELETE ON {s}agentstate_sessions
    FOR EACH ROW EXECUTE FUNCTION {s}agentstate_feed_session();
DROP TRIGGER IF EXISTS agentstate_feed ON {s}pinned_tray_index;
CREATE TRIGGER agentstate_feed
    AFTER INSERT OR UPDATE OR DELETE ON {s}pinned_tray_index
    FOR EACH ROW EXECUTE FUNCTION {s}agentstate_feed_tray();
DROP TRIGGER IF EXISTS agentstate_feed ON {s}agentstate_alarms;
CREATE TRIGGER agentstate_feed
    AFTER INSERT OR UPDATE OR DELETE ON {s}agentstate_alarms
    FOR EACH ROW EXECUTE FUNCTION {s}agentstate_feed_alarm();

-- The records written before this version, at this transaction's
-- position.
INSERT INTO {s}agentstate_changes (kind, k1, k2, k3, k4, feed, scope, env, xid, n, deleted)
SELECT 1, tenant, run_id, '', '', 1, tenant, NULL, pg_current_xact_id(),
       nextval('{s}agentstate_changes_n'), false
FROM (SELECT tenant, run_id FROM {s}agentstate_runs ORDER BY tenant, run_id) r
ON CONFLICT DO NOTHING;
INSERT INTO {s}agentstate_changes (kind, k1, k2, k3, k4, feed, scope, env, xid, n, deleted)
SELECT 2, tenant, session_id, '', '', 1, tenant, NULL, pg_current_xact_id(),
       nextval('{s}agentstate_changes_n'), false
FROM (SELECT tenant, session_id FROM {s}agentstate_sessions ORDER BY tenant, session_id) s
ON CONFLICT DO NOTHING;
INSERT INTO {s}agentstate_changes (kind, k1, k2, k3, k4, feed, scope, env, xid, n, deleted)
SELECT 3, ns, id, tray_ns, tray_id, 2, '', env, pg_current_xact_id(),
       nextval('{s}agentstate_changes_n'), false
FROM (SELECT ns, id, tray_ns, tray_id, env FROM {s}pinned_tray_index
      WHERE NOT (tray_ns = 'pinned' AND tray_id = 'alarm')
      ORDER BY ns, id, tray_ns, tray_id) t
ON CONFLICT DO NOTHING;
INSERT INTO {s}agentstate_changes (kind, k1, k2, k3, k4, feed, scope, env, xid, n, deleted)
SELECT 4, ns, id, '', '', 2, '', NULL, pg_current_xact_id(),
       nextval('{s}agentstate_changes_n'), false
FROM (SELECT ns, id FROM {s}agentstate_alarms ORDER BY ns, id) a
ON CONFLICT DO NOTHING;
