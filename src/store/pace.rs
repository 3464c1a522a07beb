//! The fleet's shared pace: replicas sharing one provider quota reserve each model call's start
//! in one row per model, so their calls are spaced as one queue's
//! ([`crate::provider::capacity::SharedPace`]). Without it, each replica paces from its own view
//! and their calls meet at random phases: against a provider enforcing a second's worth per
//! second window, four replicas each pacing at a quarter of the limit put three calls in one
//! window about a quarter of the time (BENCHMARKS.md, "Many replicas, one quota").
//!
//! One statement per call: lock the model's row, take `max(next_at, now)` as this call's start
//! if it comes within the wait the call has left, and move `next_at` on by the call's spacing.
//! Instants are the store's clock (`clock_timestamp()`); only the wait is returned, so the
//! replicas' clocks never meet. The row is created on a model's first call.

use std::time::Duration;

use tokio_postgres::Client;

use super::error::{StoreError, classify};
use crate::provider::capacity::SharedTurn;

/// Reserves the start, or says when the next one is when that is beyond the wait.
const RESERVE: &str = "
WITH c AS (SELECT clock_timestamp() AS now),
old AS (
    SELECT greatest(p.next_at, c.now) AS slot
      FROM abada_agent_model_pace p, c
     WHERE p.model = $1
       FOR UPDATE OF p
),
moved AS (
    UPDATE abada_agent_model_pace p
       SET next_at = old.slot + make_interval(secs => $2)
      FROM old, c
     WHERE p.model = $1 AND old.slot <= c.now + make_interval(secs => $3)
 RETURNING 1
)
SELECT extract(epoch FROM old.slot - c.now)::float8, EXISTS (SELECT 1 FROM moved)
  FROM old, c";

/// A model's row, created at its first call (its first start is now).
const CREATE: &str = "
INSERT INTO abada_agent_model_pace (model, next_at)
VALUES ($1, clock_timestamp()) ON CONFLICT (model) DO NOTHING";

/// The longest model name kept as a key: a longer one is cut (names come from definitions).
const MAX_MODEL_LEN: usize = 512;

/// Reserves the next start of `model`, `spacing` after the one reserved before it by any
/// replica, if it comes within `within`.
pub(super) async fn reserve(
    client: &Client,
    store: &str,
    model: &str,
    spacing: Duration,
    within: Duration,
) -> Result<SharedTurn, StoreError> {
    let mut end = model.len().min(MAX_MODEL_LEN);
    while !model.is_char_boundary(end) {
        end -= 1;
    }
    let model = &model[..end];
    let spacing = spacing.as_secs_f64();
    let within = within.as_secs_f64();
    let pg = |e: tokio_postgres::Error| classify(store, &e);
    for _ in 0..2 {
        if let Some(row) = client
            .query_opt(RESERVE, &[&model, &spacing, &within])
            .await
            .map_err(pg)?
        {
            let secs: f64 = row.get(0);
            let reserved: bool = row.get(1);
            let wait = Duration::from_secs_f64(if secs.is_finite() {
                secs.clamp(0.0, 1e9)
            } else {
                0.0
            });
            return Ok(if reserved {
                SharedTurn::In(wait)
            } else {
                SharedTurn::Beyond(wait)
            });
        }
        client.execute(CREATE, &[&model]).await.map_err(pg)?;
    }
    Err(StoreError::Internal(format!(
        "the shared pace of model {model} has no row after it was created"
    )))
}
