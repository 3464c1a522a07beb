//! The admin HTTP endpoints Kubernetes and Prometheus use: `/healthz` (the process and its poll
//! loop are alive), `/readyz` (engine reachable and authenticated, not draining) and `/metrics`
//! (Prometheus text). The router is built by a function so tests can call it in-process.

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
use crate::runner::WorkerStatus;

/// What the endpoints read.
#[derive(Clone)]
pub struct AdminState {
    pub status: Arc<WorkerStatus>,
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
    if s.status.is_ready() {
        (StatusCode::OK, "ready\n".to_string())
    } else {
        let why = s.status.problem().unwrap_or_else(|| "not ready".into());
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        )
    }
}

async fn metrics(State(s): State<AdminState>) -> impl IntoResponse {
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
