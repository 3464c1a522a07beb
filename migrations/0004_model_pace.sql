-- One row per model whose calls the replicas of a fleet pace together (src/store/pace.rs): the
-- earliest instant, on the store's clock, at which the next call of the model may start. Each
-- call reserves the instant in one short statement and moves it on by the model's pace, so the
-- replicas' calls are spaced as one queue's, whatever their number (a provider's per-second
-- enforcement refuses the crowds that independent replicas send at random phases).
CREATE TABLE abada_agent_model_pace (
    model   text        PRIMARY KEY,
    next_at timestamptz NOT NULL
);
