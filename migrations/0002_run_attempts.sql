-- Issue 23, findings 4 and 5: a fencing token that never repeats, and visits that never cross
-- (src/store/admission.rs has the rule; README.md "Run store" says it for operators).

-- Every claim takes its attempt from this sequence, which outlives the rows: a run deleted
-- (finished with a retention of 0, or swept as abandoned) and created again under the same key
-- gets an attempt that no earlier holder of that key ever had, so no stale fence can match the
-- new run. It starts above every attempt the per-key counting of 0001 could have handed out
-- (those fit a u32), so no fence of a worker from before this migration matches either.
CREATE SEQUENCE abada_agent_run_attempts AS bigint MINVALUE 1 NO CYCLE;
SELECT setval(
    'abada_agent_run_attempts',
    GREATEST(4294967296, (SELECT coalesce(max(attempt), 0) + 1 FROM abada_agent_runs)),
    false
);

-- The engine task of the latest claim. A process visit's run is taken by another task only when
-- its holder handed it over (it stopped for a person's decision), ended it (its final answer is
-- journaled), or went silent for a lock duration; never while that task is live. NULL on runs
-- claimed before this migration: their holder is unknown, so it is never "the same task".
ALTER TABLE abada_agent_runs ADD COLUMN holder_task text;
