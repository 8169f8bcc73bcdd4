-- agentstate PostgreSQL schema, version 10: a write costs the server less
-- (issue 53): the feed's notifications leave the writers' commits, the
-- store's writes skip the `fields` trigger, and a budget's spend is booked
-- without rewriting its encoded `spent`.
--
-- Applied by `PostgresStore::setup()` after v9.sql, in the same
-- transaction under the same advisory lock; a database at versions 1-9 is
-- upgraded by it in place.
--
-- A transaction that calls `pg_notify` takes one lock for the whole
-- database while it commits, through its commit's WAL flush: notifying
-- writers commit one at a time and never share a flush (at 8 writers a
-- run update ran at half the rate it has without the notify). So the
-- feed's triggers notify in the writing transaction only for writers
-- that do not say otherwise: plain SQL, pinned, an older build. The
-- store's own transactions say otherwise (`SET LOCAL agentstate.notify =
-- 'after_commit'` with their BEGIN; not behind a transaction-mode pooler,
-- which could hand the second transaction's answer to another client):
-- the trigger then only records the notification in the session's
-- setting `agentstate.feed_touched` (the payload of the one scope the
-- transaction wrote, or '*' for more than one, which wakes every waiter
-- to read), which a rollback takes back with the rest of the
-- transaction, and the store sends it on its schema's channel right after
-- its COMMIT, in the same round trip (`NOTIFY_SQL` in `conn.rs`, which
-- empties the setting). That second transaction writes no WAL, so it
-- commits without a flush and holds the lock for microseconds.
-- Its notifications are delivered after the writes they announce are
-- committed, as before. Should it be lost (the connection cut between the
-- two), a waiter still reads at least once a second (see `feed.rs`).

-- rules: F1, F5. Moves a record's row to this transaction's position
-- (F1), and notifies (F5; in the store's own transactions, records the
-- notification for after the commit).
CREATE OR REPLACE FUNCTION {s}agentstate_feed_put(
    p_kind smallint, p_k1 text, p_k2 text, p_k3 text, p_k4 text,
    p_feed smallint, p_scope text, p_env text, p_deleted boolean, p_schema text
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    note text := CASE WHEN p_feed = 1 THEN 't ' || p_scope ELSE 'trays' END;
    touched text;
BEGIN
    INSERT INTO {s}agentstate_changes AS c
        (kind, k1, k2, k3, k4, feed, scope, env, xid, n, deleted)
    VALUES (p_kind, p_k1, p_k2, p_k3, p_k4, p_feed, p_scope, p_env,
            pg_current_xact_id(), nextval('{s}agentstate_changes_n'), p_deleted)
    ON CONFLICT (kind, k1, k2, k3, k4) DO UPDATE SET
        feed = EXCLUDED.feed, scope = EXCLUDED.scope, env = EXCLUDED.env,
        xid = EXCLUDED.xid, n = EXCLUDED.n, deleted = EXCLUDED.deleted;
    IF current_setting('agentstate.notify', true) IS DISTINCT FROM 'after_commit' THEN
        PERFORM pg_notify(left('agentstate_feed ' || p_schema, 63), note);
        RETURN;
    END IF;
    -- The scope written ('*': more than one; no scope's note is '*').
    touched := current_setting('agentstate.feed_touched', true);
    IF touched IS NULL OR touched = '' THEN
        PERFORM set_config('agentstate.feed_touched', note, false);
    ELSIF touched <> note AND touched <> '*' THEN
        PERFORM set_config('agentstate.feed_touched', '*', false);
    END IF;
END
$$;

-- v6.sql's trigger clears `fields` when a writer rewrites `record`
-- without it (a build from before schema 6). The store's own writes
-- always write both: the trigger's WHEN skips them without entering
-- plpgsql (a tenth of a run update's server time).
DROP TRIGGER IF EXISTS agentstate_fields_follow_record ON {s}agentstate_runs;
CREATE TRIGGER agentstate_fields_follow_record
    BEFORE INSERT OR UPDATE ON {s}agentstate_runs
    FOR EACH ROW
    WHEN (current_setting('agentstate.writer', true) IS DISTINCT FROM 'store')
    EXECUTE FUNCTION {s}agentstate_fields_follow_record();
DROP TRIGGER IF EXISTS agentstate_fields_follow_record ON {s}agentstate_sessions;
CREATE TRIGGER agentstate_fields_follow_record
    BEFORE INSERT OR UPDATE ON {s}agentstate_sessions
    FOR EACH ROW
    WHEN (current_setting('agentstate.writer', true) IS DISTINCT FROM 'store')
    EXECUTE FUNCTION {s}agentstate_fields_follow_record();


-- Spend settled into a budget is added to columns of the budget's row
-- (`charged_*`) instead of rewriting its encoded `spent`: the store
-- decided a new `spent` in Rust from the bytes it had seen, so every
-- caller drawing on one budget invalidated the others' view of it, and
-- they fell back to the locked path, holding the budget's row across
-- round trips (at 8 workers on one budget, a twentieth of the calls per
-- second of a budget each). A budget's spent is now `spent` (as of the
-- last write of the whole row: `put_budget`, import) plus `charged_*`,
-- which only ever grow by the amounts a settle or a patch books, under
-- the row's lock; `spent` itself no longer moves, so what a store saw of
-- it stays true and its one-round-trip reserve is not declined. The caps
-- are checked against the sum (exact: numeric does not wrap).
ALTER TABLE {s}agentstate_budgets
    ADD COLUMN IF NOT EXISTS charged_cost_micros numeric(20, 0) NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS charged_tokens numeric(20, 0) NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS charged_iterations numeric(20, 0) NOT NULL DEFAULT 0;

-- rule B2: reserve (v8.sql's, same arguments; an older build calling it
-- during a rolling upgrade gets the same exact answer): the budget's
-- `p_budget_spent_amounts` are its `spent` bytes' (unchanged since the
-- store read them: checked), and its `charged_*` are added here, read
-- after the row's lock.
CREATE OR REPLACE FUNCTION {s}agentstate_reserve(
    p_tenant text, p_run text, p_run_record bytea,
    p_budget text, p_budget_record bytea, p_budget_spent bytea,
    p_hold text, p_hold_record bytea, p_expires numeric, p_now numeric,
    p_asked numeric[], p_run_spent numeric[], p_run_max numeric[],
    p_budget_spent_amounts numeric[], p_budget_max numeric[],
    p_holds_max bigint
) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    h record;
    spent numeric[];
BEGIN
    IF NOT {s}agentstate_lock_seen(p_tenant, p_run, p_run_record,
                                   p_budget, p_budget_record, p_budget_spent) THEN
        RETURN false;
    END IF;
    SELECT * INTO h FROM {s}agentstate_live_holds(p_tenant, p_run, NULL, p_hold, p_now);
    IF h.unknown OR h.dup OR h.n >= p_holds_max
       OR NOT {s}agentstate_fits(p_run_spent, h.held, p_asked, p_run_max) THEN
        RETURN false;
    END IF;
    IF p_budget IS NOT NULL THEN
        SELECT ARRAY[p_budget_spent_amounts[1] + charged_cost_micros,
                     p_budget_spent_amounts[2] + charged_tokens,
                     p_budget_spent_amounts[3] + charged_iterations]
          INTO spent
          FROM {s}agentstate_budgets WHERE tenant = p_tenant AND name = p_budget;
        SELECT * INTO h FROM {s}agentstate_live_holds(p_tenant, NULL, p_budget, NULL, p_now);
        IF h.unknown
           OR NOT {s}agentstate_fits(spent, h.held, p_asked, p_budget_max) THEN
            RETURN false;
        END IF;
    END IF;
    PERFORM {s}agentstate_purge_expired(p_tenant, p_run, p_budget, p_now);
    PERFORM set_config('agentstate.reserving', 'on', true);
    INSERT INTO {s}agentstate_holds
        (tenant, run_id, hold_id, budget, expires_at, record, cost_micros, tokens, iterations)
    VALUES (p_tenant, p_run, p_hold, p_budget, p_expires, p_hold_record,
            p_asked[1], p_asked[2], p_asked[3]);
    PERFORM set_config('agentstate.reserving', '', true);
    RETURN true;
END
$$;

-- rule B3: settle, booking the spend into the budget's `charged_*`: the
-- run (still p_run_record) becomes p_new_record, the hold (still live and
-- still p_hold_record) goes, and the budget's charged amounts grow by
-- p_charge. Checks first (the run's and the hold's rows locked, the
-- budget's row locked by its update), writes after, so a false wrote
-- nothing. The store's one-round-trip settle since schema 10 (v8.sql's
-- `agentstate_settle` stays for older builds).
CREATE OR REPLACE FUNCTION {s}agentstate_settle_charged(
    p_tenant text, p_run text, p_run_record bytea, p_budget text,
    p_hold text, p_hold_record bytea, p_now numeric,
    p_new_record bytea, p_fields text, p_updated numeric, p_charge numeric[]
) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    IF NOT {s}agentstate_lock_seen(p_tenant, p_run, p_run_record, NULL, NULL, NULL) THEN
        RETURN false;
    END IF;
    PERFORM 1 FROM {s}agentstate_holds
     WHERE tenant = p_tenant AND run_id = p_run AND hold_id = p_hold
       AND record = p_hold_record AND expires_at > p_now
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF p_budget IS NOT NULL THEN
        UPDATE {s}agentstate_budgets
           SET charged_cost_micros = charged_cost_micros + p_charge[1],
               charged_tokens = charged_tokens + p_charge[2],
               charged_iterations = charged_iterations + p_charge[3]
         WHERE tenant = p_tenant AND name = p_budget;
        IF NOT FOUND THEN
            RETURN false;
        END IF;
    END IF;
    DELETE FROM {s}agentstate_holds
     WHERE tenant = p_tenant AND run_id = p_run AND hold_id = p_hold;
    UPDATE {s}agentstate_runs
       SET updated_at = p_updated, record = p_new_record, fields = p_fields::jsonb
     WHERE tenant = p_tenant AND run_id = p_run;
    PERFORM {s}agentstate_purge_expired(p_tenant, p_run, p_budget, p_now);
    RETURN true;
END
$$;

-- A hold on a budget with spend in `charged_*`, written by anything but
-- the store or `agentstate_reserve` (which count it): an older build's
-- locked reserve decides from `spent` alone and could grant past the cap,
-- so it is refused until that build is upgraded.
CREATE OR REPLACE FUNCTION {s}agentstate_hold_counts_charged() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM {s}agentstate_budgets
                WHERE tenant = NEW.tenant AND name = NEW.budget
                  AND (charged_cost_micros, charged_tokens, charged_iterations) <> (0, 0, 0)) THEN
        RAISE EXCEPTION 'agentstate: budget % has spend booked by agentstate schema 10, which this writer does not count; upgrade it', NEW.budget
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    RETURN NEW;
END
$$;
DROP TRIGGER IF EXISTS agentstate_hold_counts_charged ON {s}agentstate_holds;
CREATE TRIGGER agentstate_hold_counts_charged
    BEFORE INSERT ON {s}agentstate_holds
    FOR EACH ROW
    WHEN (NEW.budget IS NOT NULL
          AND current_setting('agentstate.writer', true) IS DISTINCT FROM 'store'
          AND current_setting('agentstate.reserving', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION {s}agentstate_hold_counts_charged();
