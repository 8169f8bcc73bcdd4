-- agentstate PostgreSQL schema, version 2: spend caps (rules B1-B6).
--
-- Applied by `PostgresStore::setup()` after v1.sql, in the same
-- transaction under the same advisory lock; a database at version 1 is
-- upgraded by it in place (existing rows are kept: a run without caps is
-- stored byte for byte as version 1 stored it).

-- Named tenant budgets: the record (caps, version, times) and what every
-- run drawing from it has spent, each in the crate's record codec.
CREATE TABLE IF NOT EXISTS {s}agentstate_budgets (
    tenant text COLLATE "C" NOT NULL,
    name   text COLLATE "C" NOT NULL,
    record bytea NOT NULL,
    spent  bytea NOT NULL,
    PRIMARY KEY (tenant, name)
);

-- Holds reserved against a run and, when the run draws from a budget
-- (`budget`, fixed with the run at create), against that budget. Deleting
-- a run (cascade, prune) deletes its holds.
CREATE TABLE IF NOT EXISTS {s}agentstate_holds (
    tenant     text COLLATE "C" NOT NULL,
    run_id     text COLLATE "C" NOT NULL,
    hold_id    text COLLATE "C" NOT NULL,
    budget     text COLLATE "C",
    expires_at numeric(20, 0) NOT NULL,
    record     bytea NOT NULL,
    PRIMARY KEY (tenant, run_id, hold_id),
    FOREIGN KEY (tenant, run_id) REFERENCES {s}agentstate_runs (tenant, run_id)
        ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS agentstate_holds_by_budget
    ON {s}agentstate_holds (tenant, budget, run_id, hold_id) WHERE budget IS NOT NULL;
