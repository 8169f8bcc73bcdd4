-- agentstate PostgreSQL schema, version 4: run labels (rule R11).
--
-- Applied by `PostgresStore::setup()` after v3.sql, in the same
-- transaction under the same advisory lock; a database at version 1, 2 or
-- 3 is upgraded by it in place (it only adds a table: runs written before
-- it carry no labels).

-- One row per label of a run: the label's key and its value as canonical
-- JSON text (compact, object keys sorted), so a listing filtered by one
-- exact label walks (tenant, label, value, seq) in seq order and reads one
-- page (L5). The run's record holds the labels too; these rows are its
-- index, written in the same transaction, and leave with the run.
-- `tenant` and `run_id` are escaped like every id; `label` and `value`
-- never hold a NUL (R11 refuses one), so they are stored verbatim.
CREATE TABLE IF NOT EXISTS {s}agentstate_run_labels (
    tenant text COLLATE "C" NOT NULL,
    label  text COLLATE "C" NOT NULL,
    value  text COLLATE "C" NOT NULL,
    seq    bigint NOT NULL,
    run_id text COLLATE "C" NOT NULL,
    PRIMARY KEY (tenant, label, value, seq),
    FOREIGN KEY (tenant, run_id) REFERENCES {s}agentstate_runs (tenant, run_id)
        ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS agentstate_run_labels_by_run
    ON {s}agentstate_run_labels (tenant, run_id);
