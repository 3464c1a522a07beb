//! The admin HTTP endpoints Kubernetes and Prometheus use: `/healthz` (the process and its poll
//! loop are alive), `/readyz` (engine reachable and authenticated, the run store connected and
//! answering when one is configured, not draining) and `/metrics`
//! (Prometheus text). The router is built by a function so tests can call it in-process. They
//! listen where `ABADA_AGENT_HTTP_ADDR` says, loopback by default (`crate::config`): nothing
//! here authenticates, and `/metrics` and `/readyz` say what the worker runs.
//!
//! `/readyz` also names every model held now, why and for how long (a line each after the
//! status). A held model does not make the worker unready: it stops only the calls of that
//! model and the fetches of the topics whose tasks use it, and every hold ends by itself within
//! `ABADA_AGENT_MODEL_WAIT_MAX_MS`. `/metrics` counts them (`abada_agent_models_held`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::provider::capacity::ModelCapacities;
use crate::runner::WorkerStatus;
use crate::store::StoreHandle;

/// What the endpoints read.
#[derive(Clone)]
pub struct AdminState {
    pub status: Arc<WorkerStatus>,
    /// The run store, when one is configured: ready only while it answers.
    pub store: Option<StoreHandle>,
    /// The models' pacers, when the worker runs agents: which are held and why.
    pub models: Option<Arc<ModelCapacities>>,
    pub metrics: Arc<Metrics>,
    /// A poll loop that has not gone round for this long is stalled: `/healthz` fails.
    pub stall_limit: Duration,
}

pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state)
}

async fn healthz(State(s): State<AdminState>) -> impl IntoResponse {
    let since = s.status.since_last_tick();
    if since > s.stall_limit {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "poll loop stalled: no progress for {} ms\n",
                since.as_millis()
            ),
        )
    } else {
        (StatusCode::OK, "ok\n".to_string())
    }
}

async fn readyz(State(s): State<AdminState>) -> impl IntoResponse {
    let store_problem = s.store.as_ref().and_then(StoreHandle::problem);
    if s.status.is_ready() && store_problem.is_none() {
        (StatusCode::OK, format!("ready\n{}", held_models(&s)))
    } else {
        let why = s
            .status
            .problem()
            .or(store_problem)
            .unwrap_or_else(|| "not ready".into());
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        )
    }
}

/// A line per model held now: which, why, since when and until when.
fn held_models(s: &AdminState) -> String {
    let Some(models) = &s.models else {
        return String::new();
    };
    let now = tokio::time::Instant::now();
    models
        .held(now)
        .into_iter()
        .map(|(model, h)| {
            format!(
                "model {model} held: {} ({}), for {} ms more, since {} ms ago\n",
                h.reason.describe(),
                h.reason.as_str(),
                h.until.saturating_duration_since(now).as_millis(),
                now.saturating_duration_since(h.since).as_millis(),
            )
        })
        .collect()
}

async fn metrics(State(s): State<AdminState>) -> impl IntoResponse {
    if let Some(models) = &s.models {
        s.metrics
            .set_models_held(&models.held(tokio::time::Instant::now()));
    }
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.encode(),
    )
}

/// Why the admin server could not start.
#[derive(Debug, thiserror::Error)]
#[error(
    "cannot listen on {addr} for the admin endpoints: {source}; set ABADA_AGENT_HTTP_ADDR to a free address"
)]
pub struct AdminBindError {
    addr: SocketAddr,
    #[source]
    source: std::io::Error,
}

/// Binds `addr` and serves until `shutdown`; returns the bound address.
pub async fn serve(
    addr: SocketAddr,
    state: AdminState,
    shutdown: CancellationToken,
) -> Result<SocketAddr, AdminBindError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| AdminBindError { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| AdminBindError { addr, source })?;
    tokio::spawn(async move {
        let result = axum::serve(listener, router(state))
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await;
        if let Err(e) = result {
            tracing::error!(error = %e, "admin server failed");
        }
    });
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::response::Response;

    fn state(stall_limit: Duration) -> AdminState {
        AdminState {
            store: None,
            models: None,
            status: Arc::new(WorkerStatus::default()),
            metrics: Arc::new(Metrics::new()),
            stall_limit,
        }
    }

    /// Calls the endpoint's handler as the router would.
    async fn get(state: &AdminState, path: &str) -> (StatusCode, String) {
        let s = State(state.clone());
        let resp: Response = match path {
            "/healthz" => healthz(s).await.into_response(),
            "/readyz" => readyz(s).await.into_response(),
            "/metrics" => metrics(s).await.into_response(),
            other => panic!("no endpoint {other}"),
        };
        let status = resp.status();
        let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .expect("an in-memory body");
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test(start_paused = true)]
    async fn healthz_fails_once_the_poll_loop_has_not_gone_round_for_the_stall_limit() {
        let s = state(Duration::from_secs(60));
        assert_eq!(get(&s, "/healthz").await.0, StatusCode::OK);
        tokio::time::advance(Duration::from_secs(59)).await;
        assert_eq!(get(&s, "/healthz").await.0, StatusCode::OK);
        tokio::time::advance(Duration::from_secs(2)).await;
        let (status, body) = get(&s, "/healthz").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("poll loop stalled"), "{body}");
    }

    #[tokio::test]
    async fn readyz_is_not_ready_before_the_first_fetch_and_metrics_are_text() {
        let s = state(Duration::from_secs(60));
        let (status, body) = get(&s, "/readyz").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("no fetch has succeeded yet"), "{body}");
        let (status, body) = get(&s, "/metrics").await;
        assert_eq!(status, StatusCode::OK);
        assert!(body.contains("# TYPE abada_agent_slots gauge"), "{body}");
        assert!(body.ends_with("# EOF\n"), "{body}");
    }
}
