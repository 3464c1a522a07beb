-- A task finds the open runs that may be its own before it reads any agent definition
-- (src/agent/run_home.rs): by exact key (its own, its node's visit, a key its variables name)
-- or, for a run it holds under its node's visit key with a loop counter, by that key's prefix.
-- The prefix is compared byte-wise (text_pattern_ops), whatever the database's collation; only
-- running runs are indexed.
CREATE INDEX abada_agent_runs_open_keys ON abada_agent_runs (run_key text_pattern_ops)
    WHERE status = 'running';
