-- The run store (issue 12; design.md "The run store"; protocol.md B.2 and Part D).
-- Applied once by the first worker that starts, under an advisory lock (src/store/migrate.rs).
-- Never edit a migration that has been released: add the next one.

-- One row per agent run. The attempt number is the fencing token: every claim increments it,
-- and every append is a compare-and-set on (attempt, version).
CREATE TABLE abada_agent_runs (
    -- Opaque: the engine's task id today. A run that spans several engine tasks (a conversation
    -- waiting for an approval, issue 14) keys itself by process instance, activity and loop
    -- counter instead, with no change to this table.
    run_key       text        PRIMARY KEY,
    -- Incremented by every claim; a step written by an older attempt is refused.
    attempt       bigint      NOT NULL CHECK (attempt >= 1),
    -- The worker id of the latest claim, for operators.
    owner         text        NOT NULL,
    -- Incremented by every change of the run (claim, append, finish): the compare-and-set token.
    version       bigint      NOT NULL CHECK (version >= 1),
    -- The seq the next step must have: steps are contiguous from 1.
    next_seq      bigint      NOT NULL CHECK (next_seq >= 1),
    -- Sum of the step bodies' sizes in bytes: the journal is bounded by construction.
    journal_bytes bigint      NOT NULL DEFAULT 0 CHECK (journal_bytes >= 0),
    status        text        NOT NULL CHECK (status IN ('running', 'completed', 'failed')),
    created_at    timestamptz NOT NULL DEFAULT now(),
    -- Set by every claim and append: the sweeper deletes unfinished runs idle for too long.
    updated_at    timestamptz NOT NULL DEFAULT now(),
    finished_at   timestamptz,
    CHECK ((status = 'running') = (finished_at IS NULL))
);

-- The sweeper's two scans: finished runs past retention, unfinished runs idle for too long.
CREATE INDEX abada_agent_runs_finished_at ON abada_agent_runs (finished_at)
    WHERE finished_at IS NOT NULL;
CREATE INDEX abada_agent_runs_idle_since ON abada_agent_runs (updated_at)
    WHERE finished_at IS NULL;

-- One row per journal step, exactly the step shapes of protocol.md B.2: seq, kind, state, key,
-- and the step's data as body.
CREATE TABLE abada_agent_steps (
    run_key     text        NOT NULL REFERENCES abada_agent_runs (run_key) ON DELETE CASCADE,
    seq         bigint      NOT NULL CHECK (seq >= 1),
    -- The attempt that wrote the step.
    attempt     bigint      NOT NULL,
    -- The run's version after this step: a retried append whose first commit was not
    -- acknowledged recognises its own step by it.
    run_version bigint      NOT NULL,
    kind        text        NOT NULL,
    state       text        NOT NULL,
    key         text,
    body        jsonb       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_key, seq)
);
