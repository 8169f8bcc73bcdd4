-- agentstate PostgreSQL schema, version 9: one database with the seeds'
-- own store (pinned 0.16's PostgresStateStore).
--
-- Applied by `PostgresStore::setup()` after v8.sql, in the same
-- transaction under the same advisory lock; a database at versions 1-8 is
-- upgraded by it in place. (On a database agentstate never set up,
-- `pinned.sql` ran before v1.sql, so the two tray tables are pinned's own
-- and the conversions below find nothing to do.)
--
-- `pinned_epoch` and `pinned_tray_index` become exactly what pinned
-- creates: `epoch bigint`, `doc jsonb`, `env`/`hostname` DEFAULT '*', every
-- text column in the database's default collation, pinned's primary keys.
-- Both programs then read and write the same rows, and an epoch either
-- one stores fences the other. Everything agentstate adds is invisible to
-- pinned: the nullable column `doc_raw`, indexes, triggers, functions.
--
-- Docs. The Rust API's doc is bytes (rule T1); the column is jsonb:
--
--   * bytes that are one JSON document (UTF-8 text jsonb accepts) are
--     stored as that jsonb value, so pinned and plain SQL read the
--     document;
--   * any other bytes as {"agentstate:hex": "<the bytes in hex>"}, an
--     object (pinned expects one);
--   * `doc_raw` holds the bytes written when they differ from the jsonb's
--     canonical text (`convert_to(doc::text, 'UTF8')`), else NULL: a doc
--     written in jsonb's own spelling (every doc pinned writes) costs
--     nothing extra;
--   * a read gives back coalesce(doc_raw, convert_to(doc::text, 'UTF8')):
--     exactly the bytes agentstate wrote, or the canonical JSON text of a
--     doc someone else wrote;
--   * a write that changes `doc` and leaves `doc_raw` alone (pinned's
--     upsert, a plain UPDATE) clears `doc_raw` (a trigger), so the doc
--     read is the new one.
--
-- `agentstate_doc_in` and `agentstate_doc_out` are the only copies of the
-- write and read rules; every statement of the store goes through them.
--
-- Order. Agentstate's listings keep the byte order of every other backend
-- (COLLATE "C" in their ORDER BY and cursor comparisons), served by the
-- expression indexes below, so a page stays O(page) (L5, T5) whatever the
-- database's collation.
--
-- Epochs. A tray call's epoch is at most i64::MAX (checked before any
-- statement). pinned may store a negative epoch (its first acquire
-- inserts the caller's as is): that is below every epoch agentstate
-- accepts, and `epoch()` reads it as 0. An instance holding an epoch past
-- i64::MAX (possible under schemas 1-8) stops this upgrade with a
-- message naming it.
--
-- Alarms (rule A4): their rows of `pinned_tray_index` hold
-- {"due_at": <milliseconds>}.

-- The write rule: what a doc's bytes are stored as. `p_json` is the
-- store's own check (the bytes parse as one JSON document); jsonb has the
-- last word (its limits differ from the store's parser in corners), and
-- whatever it refuses is stored as hex.
CREATE OR REPLACE FUNCTION {s}agentstate_doc_in(
    p_raw bytea, p_json boolean, OUT doc jsonb, OUT doc_raw bytea
) LANGUAGE plpgsql STABLE AS $$
DECLARE
    parsed boolean := false;
BEGIN
    IF p_json THEN
        BEGIN
            doc := convert_from(p_raw, 'UTF8')::jsonb;
            parsed := true;
        EXCEPTION WHEN OTHERS THEN
            parsed := false;
        END;
    END IF;
    IF NOT parsed THEN
        doc := jsonb_build_object('agentstate:hex', encode(p_raw, 'hex'));
    END IF;
    doc_raw := nullif(p_raw, convert_to(doc::text, 'UTF8'));
END
$$;

-- The read rule: a row's doc as bytes.
CREATE OR REPLACE FUNCTION {s}agentstate_doc_out(p_doc jsonb, p_raw bytea) RETURNS bytea
LANGUAGE sql STABLE AS $$
    SELECT coalesce(p_raw, convert_to(p_doc::text, 'UTF8'))
$$;

-- pinned_epoch: bigint, no CHECK (pinned stores what its callers pass),
-- default collation.
ALTER TABLE {s}pinned_epoch DROP CONSTRAINT IF EXISTS pinned_epoch_epoch_check;
DO $$
DECLARE
    r record;
    cmds text[] := '{}';
BEGIN
    IF (SELECT format_type(atttypid, atttypmod) FROM pg_attribute
        WHERE attrelid = '{s}pinned_epoch'::regclass AND attname = 'epoch'
          AND NOT attisdropped) <> 'bigint' THEN
        SELECT ns, id, epoch INTO r FROM {s}pinned_epoch
        WHERE epoch > 9223372036854775807 ORDER BY epoch DESC LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'pinned_epoch: instance (ns %, id %) holds epoch %, above 9223372036854775807 (i64::MAX), the largest a bigint holds; schema 9 stores epochs as bigint, as pinned does. Lower that epoch (or delete the row), then run setup() again', quote_literal(r.ns), quote_literal(r.id), r.epoch
                USING ERRCODE = 'numeric_value_out_of_range';
        END IF;
        cmds := cmds || 'ALTER COLUMN epoch TYPE bigint'::text;
    END IF;
    FOR r IN SELECT attname FROM pg_attribute
             WHERE attrelid = '{s}pinned_epoch'::regclass AND attname IN ('ns', 'id')
               AND NOT attisdropped
               AND attcollation <> (SELECT oid FROM pg_collation WHERE collname = 'default')
             ORDER BY attnum LOOP
        cmds := cmds || format('ALTER COLUMN %I TYPE text COLLATE "default"', r.attname);
    END LOOP;
    IF cardinality(cmds) > 0 THEN
        EXECUTE 'ALTER TABLE {s}pinned_epoch ' || array_to_string(cmds, ', ');
    END IF;
END
$$;

-- pinned_tray_index: doc jsonb (with doc_raw), defaults, default collation.
ALTER TABLE {s}pinned_tray_index ADD COLUMN IF NOT EXISTS doc_raw bytea;
ALTER TABLE {s}pinned_tray_index
    ALTER COLUMN env SET DEFAULT '*',
    ALTER COLUMN hostname SET DEFAULT '*';
DO $$
DECLARE
    r record;
    cmds text[] := '{}';
BEGIN
    IF (SELECT format_type(atttypid, atttypmod) FROM pg_attribute
        WHERE attrelid = '{s}pinned_tray_index'::regclass AND attname = 'doc'
          AND NOT attisdropped) = 'bytea' THEN
        -- The docs of schemas 1-8 keep their exact bytes where the jsonb
        -- text differs. Not a change of any tray: the feed is left alone.
        ALTER TABLE {s}pinned_tray_index DISABLE TRIGGER agentstate_feed;
        UPDATE {s}pinned_tray_index SET doc_raw = doc
        WHERE ({s}agentstate_doc_in(doc, true)).doc_raw IS NOT NULL;
        ALTER TABLE {s}pinned_tray_index ENABLE TRIGGER agentstate_feed;
        cmds := cmds || 'ALTER COLUMN doc TYPE jsonb USING ({s}agentstate_doc_in(doc, true)).doc'::text;
    END IF;
    FOR r IN SELECT attname FROM pg_attribute
             WHERE attrelid = '{s}pinned_tray_index'::regclass
               AND attname IN ('ns', 'id', 'tray_ns', 'tray_id', 'env', 'hostname')
               AND NOT attisdropped
               AND attcollation <> (SELECT oid FROM pg_collation WHERE collname = 'default')
             ORDER BY attnum LOOP
        cmds := cmds || format('ALTER COLUMN %I TYPE text COLLATE "default"', r.attname);
    END LOOP;
    IF cardinality(cmds) > 0 THEN
        EXECUTE 'ALTER TABLE {s}pinned_tray_index ' || array_to_string(cmds, ', ');
    END IF;
END
$$;

-- A write that changes doc but not doc_raw (pinned's upsert sets marked,
-- doc, env and hostname; a plain UPDATE) leaves doc_raw describing the
-- old doc: cleared. The store's own writes set both, and pay only the
-- WHEN.
CREATE OR REPLACE FUNCTION {s}agentstate_doc_raw_clear() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.doc_raw := NULL;
    RETURN NEW;
END
$$;
DROP TRIGGER IF EXISTS agentstate_doc_raw ON {s}pinned_tray_index;
CREATE TRIGGER agentstate_doc_raw
    BEFORE UPDATE ON {s}pinned_tray_index
    FOR EACH ROW
    WHEN (OLD.doc_raw IS NOT NULL AND NEW.doc_raw IS NOT DISTINCT FROM OLD.doc_raw
          AND NEW.doc IS DISTINCT FROM OLD.doc)
    EXECUTE FUNCTION {s}agentstate_doc_raw_clear();

-- Alarms (A4): the row's doc is {"due_at": <milliseconds>}.
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
    INSERT INTO {s}pinned_tray_index
        (ns, id, tray_ns, tray_id, marked, doc, env, hostname, doc_raw)
    VALUES (NEW.ns, NEW.id, 'pinned', 'alarm', true,
            jsonb_build_object('due_at', NEW.due_at), '', '', NULL)
    ON CONFLICT (ns, id, tray_ns, tray_id)
    DO UPDATE SET marked = true, doc = EXCLUDED.doc, env = '', hostname = '', doc_raw = NULL;
    RETURN NEW;
END
$$;
UPDATE {s}pinned_tray_index t
SET doc = jsonb_build_object('due_at', a.due_at), doc_raw = NULL
FROM {s}agentstate_alarms a
WHERE t.ns = a.ns AND t.id = a.id AND t.tray_ns = 'pinned' AND t.tray_id = 'alarm'
  AND (t.doc IS DISTINCT FROM jsonb_build_object('due_at', a.due_at) OR t.doc_raw IS NOT NULL);

-- Byte order for the store's listings: an instance's trays (list_trays,
-- and export), the marked trays (T5's sweeper, all envs or one), epochs
-- (export). Schema 5's marked indexes are replaced by these; schema 1's,
-- in the default collation now, serve a seeds' sweeper ordering by it.
DROP INDEX IF EXISTS {s}pinned_tray_index_marked_trays;
DROP INDEX IF EXISTS {s}pinned_tray_index_marked_trays_by_env;
CREATE INDEX IF NOT EXISTS pinned_tray_index_bytes
    ON {s}pinned_tray_index ((ns COLLATE "C"), (id COLLATE "C"),
                             (tray_ns COLLATE "C"), (tray_id COLLATE "C"));
CREATE INDEX IF NOT EXISTS pinned_tray_index_marked_bytes
    ON {s}pinned_tray_index ((ns COLLATE "C"), (id COLLATE "C"),
                             (tray_ns COLLATE "C"), (tray_id COLLATE "C"))
    WHERE marked AND NOT (tray_ns = 'pinned' AND tray_id = 'alarm');
CREATE INDEX IF NOT EXISTS pinned_tray_index_marked_bytes_by_env
    ON {s}pinned_tray_index (env, (ns COLLATE "C"), (id COLLATE "C"),
                             (tray_ns COLLATE "C"), (tray_id COLLATE "C"))
    WHERE marked AND NOT (tray_ns = 'pinned' AND tray_id = 'alarm');
CREATE INDEX IF NOT EXISTS pinned_epoch_bytes
    ON {s}pinned_epoch ((ns COLLATE "C"), (id COLLATE "C"));
