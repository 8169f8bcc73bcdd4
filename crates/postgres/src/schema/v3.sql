-- agentstate PostgreSQL schema, version 3: idempotency keys (rules I1-I7).
--
-- Applied by `PostgresStore::setup()` after v2.sql, in the same
-- transaction under the same advisory lock; a database at version 1 or 2
-- is upgraded by it in place (it only adds tables).

-- One row per kept key: scope kind 1 is a tenant (runs, budgets), 2 an
-- instance namespace (trays); `scope` and `key` are escaped like every id.
-- A keyed call inserts its row first (the claim: a racing call with the
-- same key waits on it, then reads it), runs, then fills `ordinal` and
-- `outcome` (the crate's value codec of `Remembered`: the fingerprint,
-- when, the ordinal, and the answer or remembered refusal) in the same
-- transaction. A committed row always has both.
CREATE TABLE IF NOT EXISTS {s}agentstate_idempotency (
    kind        smallint NOT NULL CHECK (kind IN (1, 2)),
    scope       text COLLATE "C" NOT NULL,
    key         text COLLATE "C" NOT NULL,
    fingerprint bytea NOT NULL,
    created_at  numeric(20, 0) NOT NULL,
    ordinal     bigint,
    outcome     bytea,
    PRIMARY KEY (kind, scope, key)
);
-- Pruning reads a scope's oldest keys first.
CREATE INDEX IF NOT EXISTS agentstate_idempotency_by_ordinal
    ON {s}agentstate_idempotency (kind, scope, ordinal);

-- Per scope: the next ordinal and how many keys it keeps, so `keys_max` is
-- enforced without counting. Its row is locked last in a keyed write (after
-- the write's own rows), and every delete of the scope's keys happens
-- under it, so `kept` stays exact.
CREATE TABLE IF NOT EXISTS {s}agentstate_idempotency_scopes (
    kind         smallint NOT NULL,
    scope        text COLLATE "C" NOT NULL,
    next_ordinal bigint NOT NULL CHECK (next_ordinal >= 1),
    kept         bigint NOT NULL CHECK (kept >= 0),
    PRIMARY KEY (kind, scope)
);
