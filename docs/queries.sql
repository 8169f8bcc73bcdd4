-- Example queries over the PostgreSQL store's rows (schema 6).
--
-- Each query takes the tenant as $1. Run them with the store's schema on
-- the search path (`SET search_path TO <PgOptions::schema>`, `public` by
-- default). The tests run every query here, by its `-- name:` line,
-- against rows the store wrote (tests/it/postgres.rs,
-- `example_queries_run_on_rows_the_store_wrote`), so they stay true.
--
-- The columns are generated from each row's `fields` (see
-- src/pg/schema/v6.sql): amounts are exact integers, times are
-- milliseconds since the Unix epoch (`*_time` columns of the views are the
-- same as timestamptz), tool calls, approvals, labels and session metadata
-- are jsonb. Read them; write only through the store.

-- name: spend_per_agent_per_day
-- The spend of each agent, per day its runs started.
SELECT agent_name,
       date_trunc('day', created_time) AS day,
       count(*) AS runs,
       sum(cost_micros) AS cost_micros,
       sum(input_tokens + output_tokens) AS tokens,
       sum(iterations) AS iterations
FROM agentstate_runs_view
WHERE tenant = $1
GROUP BY agent_name, day
ORDER BY agent_name, day;

-- name: runs_mid_tool_call
-- Runs waiting on tool calls (`RunRecord::mid_tool_call`), oldest change
-- first, with the first pending call's tool.
SELECT run_id, agent_name, state,
       jsonb_array_length(pending_tool_calls) AS pending,
       pending_tool_calls -> 0 ->> 'name' AS first_tool,
       updated_time
FROM agentstate_runs_view
WHERE tenant = $1 AND jsonb_array_length(pending_tool_calls) > 0
ORDER BY updated_at, run_id;

-- name: runs_at_their_cap
-- Runs that have reached one of their own caps (cost, tokens counted as
-- input plus output, or iterations).
SELECT run_id, agent_name,
       cost_micros, cost_micros_max,
       input_tokens + output_tokens AS tokens, tokens_max,
       iterations, iterations_max
FROM agentstate_runs_view
WHERE tenant = $1
  AND (cost_micros >= cost_micros_max
       OR input_tokens + output_tokens >= tokens_max
       OR iterations >= iterations_max)
ORDER BY run_id;

-- name: runs_by_label
-- Runs carrying a label, by the label's value (here the label `team`).
SELECT labels ->> 'team' AS team, count(*) AS runs, sum(cost_micros) AS cost_micros
FROM agentstate_runs_view
WHERE tenant = $1 AND labels ? 'team'
GROUP BY team
ORDER BY team;
