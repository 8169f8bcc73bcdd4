-- agentstate PostgreSQL schema, version 6: rows an operator can query.
--
-- Applied by `PostgresStore::setup()` after v5.sql, in the same
-- transaction under the same advisory lock; a database at versions 1-5 is
-- upgraded by it in place. The rows written before it get their `fields`
-- from `setup()` right after, in batches of their own transactions
-- (`fields IS NULL` marks the ones left, and the meta row `fields_filled`
-- says whether any may be left; a setup that stops part way resumes, and
-- the store reads runs from `record` either way).
--
-- Every field of a run and a session gets a column of its own, generated
-- by PostgreSQL from `fields`, the record as JSON, which the store writes
-- in the same statement as `record`. `record` stays what the store reads
-- (its checksum guards every read); the columns are its projection, for
-- SQL, BI tools and dashboards, and `verify` reports a row whose `fields`
-- disagrees with its record. Amounts and counters are exact integers
-- (`numeric(20, 0)`: u64 without wrapping), times are milliseconds since
-- the Unix epoch (the `*_view` views show them as `timestamptz`), tool
-- calls, the approval, labels and session metadata are `jsonb`.
-- docs/queries.sql holds example queries, which the tests run.

ALTER TABLE {s}agentstate_runs
    ADD COLUMN IF NOT EXISTS fields jsonb,
    ADD COLUMN IF NOT EXISTS version numeric(20, 0)
        GENERATED ALWAYS AS ((fields ->> 'version')::numeric(20, 0)) STORED,
    ADD COLUMN IF NOT EXISTS messages_read numeric(20, 0)
        GENERATED ALWAYS AS ((fields ->> 'messages_read')::numeric(20, 0)) STORED,
    ADD COLUMN IF NOT EXISTS input_tokens numeric(20, 0)
        GENERATED ALWAYS AS ((fields ->> 'input_tokens')::numeric(20, 0)) STORED,
    ADD COLUMN IF NOT EXISTS output_tokens numeric(20, 0)
        GENERATED ALWAYS AS ((fields ->> 'output_tokens')::numeric(20, 0)) STORED,
    ADD COLUMN IF NOT EXISTS cost_micros numeric(20, 0)
        GENERATED ALWAYS AS ((fields ->> 'cost_micros')::numeric(20, 0)) STORED,
    ADD COLUMN IF NOT EXISTS iterations numeric(20, 0)
        GENERATED ALWAYS AS ((fields ->> 'iterations')::numeric(20, 0)) STORED,
    ADD COLUMN IF NOT EXISTS pending_tool_calls jsonb
        GENERATED ALWAYS AS (fields -> 'pending_tool_calls') STORED,
    ADD COLUMN IF NOT EXISTS approval jsonb
        GENERATED ALWAYS AS (fields -> 'approval') STORED,
    ADD COLUMN IF NOT EXISTS created_at numeric(20, 0)
        GENERATED ALWAYS AS ((fields ->> 'created_at')::numeric(20, 0)) STORED,
    ADD COLUMN IF NOT EXISTS cost_micros_max numeric(20, 0)
        GENERATED ALWAYS AS ((fields ->> 'cost_micros_max')::numeric(20, 0)) STORED,
    ADD COLUMN IF NOT EXISTS tokens_max numeric(20, 0)
        GENERATED ALWAYS AS ((fields ->> 'tokens_max')::numeric(20, 0)) STORED,
    ADD COLUMN IF NOT EXISTS iterations_max numeric(20, 0)
        GENERATED ALWAYS AS ((fields ->> 'iterations_max')::numeric(20, 0)) STORED,
    ADD COLUMN IF NOT EXISTS budget text COLLATE "C"
        GENERATED ALWAYS AS (fields ->> 'budget') STORED,
    ADD COLUMN IF NOT EXISTS labels jsonb
        GENERATED ALWAYS AS (fields -> 'labels') STORED;

ALTER TABLE {s}agentstate_sessions
    ADD COLUMN IF NOT EXISTS fields jsonb,
    ADD COLUMN IF NOT EXISTS version numeric(20, 0)
        GENERATED ALWAYS AS ((fields ->> 'version')::numeric(20, 0)) STORED,
    ADD COLUMN IF NOT EXISTS metadata jsonb
        GENERATED ALWAYS AS (fields -> 'metadata') STORED,
    ADD COLUMN IF NOT EXISTS created_at numeric(20, 0)
        GENERATED ALWAYS AS ((fields ->> 'created_at')::numeric(20, 0)) STORED,
    ADD COLUMN IF NOT EXISTS updated_at numeric(20, 0)
        GENERATED ALWAYS AS ((fields ->> 'updated_at')::numeric(20, 0)) STORED,
    ADD COLUMN IF NOT EXISTS labels jsonb
        GENERATED ALWAYS AS (fields -> 'labels') STORED;

-- Whether rows without `fields` may exist: 'true' once a setup() has
-- filled them all, 'false' or 'scanning' otherwise (see `fill_fields`).
-- A flag rather than an index on `fields IS NULL`: an index whose
-- predicate names `fields` would make every write of a run a non-HOT
-- update.
INSERT INTO {s}agentstate_meta (name, value) VALUES ('fields_filled', 'false')
ON CONFLICT (name) DO UPDATE SET value = 'false';

-- A build from before schema 6, still running during a rolling upgrade,
-- rewrites `record` and leaves `fields` as it was: the row's columns are
-- then cleared (NULL: not known) rather than left stale; that build's
-- creates leave them NULL too. Either clears the flag, and the next
-- setup() fills them. This build's writes always change `fields` (its
-- version moves with every write).
CREATE OR REPLACE FUNCTION {s}agentstate_fields_follow_record() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND NEW.record IS DISTINCT FROM OLD.record
       AND NEW.fields IS NOT DISTINCT FROM OLD.fields THEN
        NEW.fields := NULL;
    END IF;
    IF NEW.fields IS NULL THEN
        UPDATE {s}agentstate_meta SET value = 'false'
        WHERE name = 'fields_filled' AND value <> 'false';
    END IF;
    RETURN NEW;
END
$$;
DROP TRIGGER IF EXISTS agentstate_fields_follow_record ON {s}agentstate_runs;
CREATE TRIGGER agentstate_fields_follow_record
    BEFORE INSERT OR UPDATE ON {s}agentstate_runs
    FOR EACH ROW EXECUTE FUNCTION {s}agentstate_fields_follow_record();
DROP TRIGGER IF EXISTS agentstate_fields_follow_record ON {s}agentstate_sessions;
CREATE TRIGGER agentstate_fields_follow_record
    BEFORE INSERT OR UPDATE ON {s}agentstate_sessions
    FOR EACH ROW EXECUTE FUNCTION {s}agentstate_fields_follow_record();

-- The same rows with times as timestamptz, without the encoded record.
CREATE OR REPLACE VIEW {s}agentstate_runs_view AS
SELECT tenant, run_id, seq, version, state, agent_name, session_id,
       messages_read, input_tokens, output_tokens, cost_micros, iterations,
       pending_tool_calls, approval,
       to_timestamp(created_at / 1000.0) AS created_time,
       to_timestamp(updated_at / 1000.0) AS updated_time,
       cost_micros_max, tokens_max, iterations_max, budget, labels,
       created_at, updated_at
FROM {s}agentstate_runs;

CREATE OR REPLACE VIEW {s}agentstate_sessions_view AS
SELECT tenant, session_id, version, metadata, labels,
       to_timestamp(created_at / 1000.0) AS created_time,
       to_timestamp(updated_at / 1000.0) AS updated_time,
       created_at, updated_at
FROM {s}agentstate_sessions;
