-- agentstate PostgreSQL schema, version 8: reserve and settle in one round
-- trip (issue 40).
--
-- Applied by `PostgresStore::setup()` after v7.sql, in the same
-- transaction under the same advisory lock; a database at versions 1-7 is
-- upgraded by it in place.
--
-- A hold's amounts get columns of their own (a projection of its record,
-- which never changes after the reserve that wrote it), so the server can
-- sum the holds a cap check counts. A hold written before this version
-- (or by an older build during a rolling upgrade) has NULL there: the
-- functions below then decline and the store decides on the record, as
-- before.
--
-- `agentstate_reserve` and `agentstate_settle` are the one-statement
-- forms of `reserve` and `settle`. The store decides in Rust, against the
-- run, budget and hold as it last saw them, what the call writes, and
-- sends the decision with those records' bytes. The function locks the
-- run's row, then the budget's (the order every other write takes),
-- checks that each still holds exactly those bytes, re-checks the caps
-- against the holds as they are now (each statement of a plpgsql function
-- reads a snapshot taken after the locks before it), and writes only when
-- every check passes. It returns false, having written nothing, when
-- anything differs or the call would be refused: the store then takes its
-- locked path, which decides again on fresh reads and produces the exact
-- answer (a refusal's facts included). So a function can only ever agree
-- with the locked path, never allow what it would refuse.

ALTER TABLE {s}agentstate_holds
    ADD COLUMN IF NOT EXISTS cost_micros numeric(20, 0),
    ADD COLUMN IF NOT EXISTS tokens numeric(20, 0),
    ADD COLUMN IF NOT EXISTS iterations numeric(20, 0);

-- B2 for one scope: spent + held + asked <= max for each capped amount
-- (arrays of cost_micros, tokens, iterations; a NULL max is no cap).
-- Exact: numeric does not wrap.
CREATE OR REPLACE FUNCTION {s}agentstate_fits(
    spent numeric[], held numeric[], asked numeric[], max numeric[]
) RETURNS boolean LANGUAGE sql IMMUTABLE AS $$
    SELECT coalesce(bool_and(m IS NULL OR s + h + a <= m), true)
    FROM unnest(spent, held, asked, max) AS x(s, h, a, m)
$$;

-- The live holds of a run (p_run not NULL) or of a budget: how many, does
-- one have id p_hold, is any without its amounts, and their sums. (Two
-- static statements, so each keeps its index.)
CREATE OR REPLACE FUNCTION {s}agentstate_live_holds(
    p_tenant text, p_run text, p_budget text, p_hold text, p_now numeric,
    OUT n bigint, OUT dup boolean, OUT unknown boolean, OUT held numeric[]
) LANGUAGE plpgsql AS $$
BEGIN
    IF p_run IS NOT NULL THEN
        SELECT count(*),
               coalesce(bool_or(hold_id = p_hold), false),
               coalesce(bool_or(cost_micros IS NULL OR tokens IS NULL OR iterations IS NULL), false),
               ARRAY[coalesce(sum(cost_micros), 0), coalesce(sum(tokens), 0),
                     coalesce(sum(iterations), 0)]
          INTO n, dup, unknown, held
          FROM {s}agentstate_holds
         WHERE tenant = p_tenant AND run_id = p_run AND expires_at > p_now;
    ELSE
        SELECT count(*),
               false,
               coalesce(bool_or(cost_micros IS NULL OR tokens IS NULL OR iterations IS NULL), false),
               ARRAY[coalesce(sum(cost_micros), 0), coalesce(sum(tokens), 0),
                     coalesce(sum(iterations), 0)]
          INTO n, dup, unknown, held
          FROM {s}agentstate_holds
         WHERE tenant = p_tenant AND budget = p_budget AND expires_at > p_now;
    END IF;
END
$$;

-- Locks the run's row (and the budget's, when p_budget is not NULL) if
-- they still hold the bytes given; false (nothing locked that matters:
-- the caller writes nothing) otherwise.
CREATE OR REPLACE FUNCTION {s}agentstate_lock_seen(
    p_tenant text, p_run text, p_run_record bytea,
    p_budget text, p_budget_record bytea, p_budget_spent bytea
) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM {s}agentstate_runs
     WHERE tenant = p_tenant AND run_id = p_run AND record = p_run_record
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF p_budget IS NOT NULL THEN
        PERFORM 1 FROM {s}agentstate_budgets
         WHERE tenant = p_tenant AND name = p_budget
           AND record = p_budget_record AND spent = p_budget_spent
           FOR UPDATE;
        IF NOT FOUND THEN
            RETURN false;
        END IF;
    END IF;
    RETURN true;
END
$$;

-- Deletes the holds that expired by p_now among the budget's (when the run
-- draws from one) or else the run's (rule B5).
CREATE OR REPLACE FUNCTION {s}agentstate_purge_expired(
    p_tenant text, p_run text, p_budget text, p_now numeric
) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF p_budget IS NOT NULL THEN
        DELETE FROM {s}agentstate_holds
         WHERE tenant = p_tenant AND budget = p_budget AND expires_at <= p_now;
    ELSE
        DELETE FROM {s}agentstate_holds
         WHERE tenant = p_tenant AND run_id = p_run AND expires_at <= p_now;
    END IF;
END
$$;

-- rule B2: reserve: the hold p_hold (its record p_hold_record, expiring at
-- p_expires, amounts p_asked) for the run, when it fits. p_run_spent and
-- p_run_max are the run's own, read from p_run_record by the store;
-- p_budget_spent_amounts and p_budget_max the budget's, from its bytes.
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
        SELECT * INTO h FROM {s}agentstate_live_holds(p_tenant, NULL, p_budget, NULL, p_now);
        IF h.unknown
           OR NOT {s}agentstate_fits(p_budget_spent_amounts, h.held, p_asked, p_budget_max) THEN
            RETURN false;
        END IF;
    END IF;
    PERFORM {s}agentstate_purge_expired(p_tenant, p_run, p_budget, p_now);
    INSERT INTO {s}agentstate_holds
        (tenant, run_id, hold_id, budget, expires_at, record, cost_micros, tokens, iterations)
    VALUES (p_tenant, p_run, p_hold, p_budget, p_expires, p_hold_record,
            p_asked[1], p_asked[2], p_asked[3]);
    RETURN true;
END
$$;

-- rule B3: settle: the run becomes p_new_record (its `fields`, `updated_at`), the
-- hold (still live and still p_hold_record) goes, and the budget's spent
-- becomes p_new_spent.
CREATE OR REPLACE FUNCTION {s}agentstate_settle(
    p_tenant text, p_run text, p_run_record bytea,
    p_budget text, p_budget_record bytea, p_budget_spent bytea,
    p_hold text, p_hold_record bytea, p_now numeric,
    p_new_record bytea, p_fields text, p_updated numeric, p_new_spent bytea
) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    IF NOT {s}agentstate_lock_seen(p_tenant, p_run, p_run_record,
                                   p_budget, p_budget_record, p_budget_spent) THEN
        RETURN false;
    END IF;
    DELETE FROM {s}agentstate_holds
     WHERE tenant = p_tenant AND run_id = p_run AND hold_id = p_hold
       AND record = p_hold_record AND expires_at > p_now;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    UPDATE {s}agentstate_runs
       SET updated_at = p_updated, record = p_new_record, fields = p_fields::jsonb
     WHERE tenant = p_tenant AND run_id = p_run;
    IF p_budget IS NOT NULL THEN
        UPDATE {s}agentstate_budgets SET spent = p_new_spent
         WHERE tenant = p_tenant AND name = p_budget;
    END IF;
    PERFORM {s}agentstate_purge_expired(p_tenant, p_run, p_budget, p_now);
    RETURN true;
END
$$;
