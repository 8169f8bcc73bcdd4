-- agentstate PostgreSQL schema, version 5: alarms as the seeds' rows
-- (rule A4).
--
-- Applied by `PostgresStore::setup()` after v4.sql, in the same
-- transaction under the same advisory lock; a database at versions 1-4 is
-- upgraded by it in place, and the alarms it already holds get their rows
-- here.
--
-- The seeds' sweeper pages the marked rows of `pinned_tray_index` and
-- fires the ones named ("pinned", "alarm"). `agentstate_alarms` stays the
-- store's own record of an instance's alarm (its due index serves
-- `due_alarms`); a trigger keeps, in the same transaction as every change
-- to it, one row of `pinned_tray_index` per alarm:
--
--   (ns, id, 'pinned', 'alarm', marked = true,
--    doc = the due time in milliseconds since the Unix epoch, as ASCII
--          decimal digits, env = '', hostname = '')
--
-- present exactly while the instance has an alarm (`set_alarm` writes
-- it, `ack_alarm` of the current due time deletes it). `ns` and `id` are
-- stored as every id is (see `id_in`). The store's own tray listings,
-- counts and `release` leave these rows alone, and tray calls refuse the
-- name.

CREATE OR REPLACE FUNCTION {s}agentstate_alarm_row() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        DELETE FROM {s}pinned_tray_index
        WHERE ns = OLD.ns AND id = OLD.id AND tray_ns = 'pinned' AND tray_id = 'alarm';
        RETURN OLD;
    END IF;
    IF TG_OP = 'UPDATE' AND (OLD.ns, OLD.id) IS DISTINCT FROM (NEW.ns, NEW.id) THEN
        DELETE FROM {s}pinned_tray_index
        WHERE ns = OLD.ns AND id = OLD.id AND tray_ns = 'pinned' AND tray_id = 'alarm';
    END IF;
    INSERT INTO {s}pinned_tray_index (ns, id, tray_ns, tray_id, marked, doc, env, hostname)
    VALUES (NEW.ns, NEW.id, 'pinned', 'alarm', true,
            convert_to(NEW.due_at::text, 'UTF8'), '', '')
    ON CONFLICT (ns, id, tray_ns, tray_id)
    DO UPDATE SET marked = true, doc = EXCLUDED.doc, env = '', hostname = '';
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS agentstate_alarm_row ON {s}agentstate_alarms;
CREATE TRIGGER agentstate_alarm_row
    AFTER INSERT OR UPDATE OR DELETE ON {s}agentstate_alarms
    FOR EACH ROW EXECUTE FUNCTION {s}agentstate_alarm_row();

-- The alarms set before this version. (Inside a block, planned only when
-- there are alarms to copy: on a new database `pinned_tray_index` may be
-- the seeds' own table, whose `doc` is jsonb, and schema 9 writes these
-- rows in that form.)
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM {s}agentstate_alarms) THEN
        INSERT INTO {s}pinned_tray_index (ns, id, tray_ns, tray_id, marked, doc, env, hostname)
        SELECT ns, id, 'pinned', 'alarm', true, convert_to(due_at::text, 'UTF8'), '', ''
        FROM {s}agentstate_alarms
        ON CONFLICT (ns, id, tray_ns, tray_id)
        DO UPDATE SET marked = true, doc = EXCLUDED.doc, env = '', hostname = '';
    END IF;
END
$$;

-- The store's marked listing leaves the alarm rows out; these indexes
-- hold only the trays, so it stays O(page) however many alarms are set
-- (T5). The v1 indexes on every marked row serve a seeds' sweeper.
CREATE INDEX IF NOT EXISTS pinned_tray_index_marked_trays
    ON {s}pinned_tray_index (ns, id, tray_ns, tray_id)
    WHERE marked AND NOT (tray_ns = 'pinned' AND tray_id = 'alarm');
CREATE INDEX IF NOT EXISTS pinned_tray_index_marked_trays_by_env
    ON {s}pinned_tray_index (env, ns, id, tray_ns, tray_id)
    WHERE marked AND NOT (tray_ns = 'pinned' AND tray_id = 'alarm');
