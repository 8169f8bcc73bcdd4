-- agentstate PostgreSQL schema, version 10: the feed's notifications leave
-- the writers' commits (issue 53).
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
-- store's own transactions say otherwise (`SET LOCAL
-- agentstate.feed_notify = 'after_commit'` with their BEGIN): the trigger
-- then only records the notification in the session's setting
-- `agentstate.feed_touched` (a JSON array of [channel, payload] pairs,
-- each once), which a rollback takes back with the rest of the
-- transaction, and the store sends them right after its COMMIT, in the
-- same round trip (`NOTIFY_SQL` in `conn.rs`, which empties the setting). That second transaction writes no
-- WAL, so it commits without a flush and holds the lock for microseconds.
-- Its notifications are delivered after the writes they announce are
-- committed, as before. Should it be lost (the connection cut between the
-- two), a waiter still reads at least once a second (see `feed.rs`).

-- Moves a record's row to this transaction's position, and notifies (or,
-- in the store's own transactions, records the notification for after
-- the commit).
CREATE OR REPLACE FUNCTION {s}agentstate_feed_put(
    p_kind smallint, p_k1 text, p_k2 text, p_k3 text, p_k4 text,
    p_feed smallint, p_scope text, p_env text, p_deleted boolean, p_schema text
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    note jsonb;
    touched text;
BEGIN
    INSERT INTO {s}agentstate_changes AS c
        (kind, k1, k2, k3, k4, feed, scope, env, xid, n, deleted)
    VALUES (p_kind, p_k1, p_k2, p_k3, p_k4, p_feed, p_scope, p_env,
            pg_current_xact_id(), nextval('{s}agentstate_changes_n'), p_deleted)
    ON CONFLICT (kind, k1, k2, k3, k4) DO UPDATE SET
        feed = EXCLUDED.feed, scope = EXCLUDED.scope, env = EXCLUDED.env,
        xid = EXCLUDED.xid, n = EXCLUDED.n, deleted = EXCLUDED.deleted;
    note := jsonb_build_array(jsonb_build_array(
        left('agentstate_feed ' || p_schema, 63),
        CASE WHEN p_feed = 1 THEN 't ' || p_scope ELSE 'trays' END));
    IF current_setting('agentstate.feed_notify', true) IS DISTINCT FROM 'after_commit' THEN
        PERFORM pg_notify(note->0->>0, note->0->>1);
        RETURN;
    END IF;
    touched := current_setting('agentstate.feed_touched', true);
    IF touched IS NULL OR touched = '' THEN
        PERFORM set_config('agentstate.feed_touched', note::text, false);
    ELSIF NOT touched::jsonb @> note THEN
        PERFORM set_config('agentstate.feed_touched', (touched::jsonb || note)::text, false);
    END IF;
END
$$;
