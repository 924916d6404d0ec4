-- Fleet queries over the facts the cells export to PostgreSQL (docs/fleet.md).
-- The cells create and fill the table egress_facts in [export] schema:
--   egress_facts(cell, epoch, seq, id UNIQUE, at, run_id, tool, reason, mode,
--                policy, body jsonb, PRIMARY KEY (cell, epoch, seq))
-- where body is the fact as the proxy's facts API returns it (docs/facts.md).
-- These views only read it. Install or update them (idempotent) with
--   psql "$DSN" -v ON_ERROR_STOP=1 -c 'SET search_path TO public' -f deploy/sql/fleet-views.sql
-- with the schema of [export] in place of public.
-- A fact stands for `count` identical denials (folded at commit), so
-- "denials" sums it and "facts" counts rows.

-- Denials by tool and reason over time: one row per hour, tool, reason and
-- mode (report = let through by a report-mode tool).
CREATE OR REPLACE VIEW egress_denials_hourly AS
SELECT date_trunc('hour', f.at::timestamptz) AS hour,
       f.tool,
       f.reason,
       f.mode,
       count(*) AS facts,
       sum(coalesce((f.body ->> 'count')::bigint, 1)) AS denials,
       count(DISTINCT f.run_id) AS runs,
       count(DISTINCT f.cell) AS cells
FROM egress_facts AS f
GROUP BY 1, f.tool, f.reason, f.mode;

-- Per run: where it lived, when it was denied, why, under which policies.
-- A run lives on one cell, so `cells` is 1 unless a run id was reused.
CREATE OR REPLACE VIEW egress_denials_by_run AS
SELECT f.run_id,
       f.tool,
       min(f.cell) AS cell,
       count(DISTINCT f.cell) AS cells,
       min(f.at::timestamptz) AS first_at,
       max(f.at::timestamptz) AS last_at,
       count(*) AS facts,
       sum(coalesce((f.body ->> 'count')::bigint, 1)) AS denials,
       array_agg(DISTINCT f.reason ORDER BY f.reason) AS reasons,
       count(DISTINCT f.policy) AS policies
FROM egress_facts AS f
WHERE f.run_id IS NOT NULL
GROUP BY f.run_id, f.tool;

-- Every fact of every run, in the order its cell committed them, with the
-- target and detail taken out of the body.
CREATE OR REPLACE VIEW egress_run_facts AS
SELECT f.run_id,
       f.cell,
       f.epoch,
       f.seq,
       f.id,
       f.at::timestamptz AS at,
       f.tool,
       f.reason,
       f.mode,
       f.policy,
       f.body -> 'target' AS target,
       f.body ->> 'detail' AS detail,
       coalesce((f.body ->> 'count')::bigint, 1) AS denials
FROM egress_facts AS f;

-- Per cell and store epoch: what has arrived. `seq` is gap-free on a cell
-- and each fact is exported exactly once, so seq_gaps is 0; first_seq above 1
-- means the store's first facts were pruned before it exported (a store that
-- predates its [export]).
CREATE OR REPLACE VIEW egress_export_by_cell AS
SELECT f.cell,
       f.epoch,
       count(*) AS facts,
       min(f.seq) AS first_seq,
       max(f.seq) AS last_seq,
       max(f.seq) - min(f.seq) + 1 - count(*) AS seq_gaps,
       min(f.at::timestamptz) AS first_at,
       max(f.at::timestamptz) AS last_at
FROM egress_facts AS f
GROUP BY f.cell, f.epoch;
