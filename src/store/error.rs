//! The run store's typed errors, one variant per thing a caller does differently, and the one
//! classification of PostgreSQL and connection failures into them.
//!
//! Messages name the store by its redacted URL (never the password), say what failed and what
//! to do.

use std::time::Duration;

use super::admission::ClaimRefusal;

/// Why an append (or a finish) was refused because the run is not this attempt's any more.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FenceReason {
    /// A newer claim took the run: the attempt number moved on (like `STALE_ATTEMPT`).
    StaleAttempt { current: u64 },
    /// Same attempt, but the run's version moved: this fence is an out-of-date copy.
    StaleVersion { expected: i64, current: i64 },
    /// The run was finished (and maybe deleted by retention).
    Finished,
    /// The run no longer exists.
    Gone,
}

impl std::fmt::Display for FenceReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FenceReason::StaleAttempt { current } => {
                write!(f, "attempt {current} has claimed the run since")
            }
            FenceReason::StaleVersion { expected, current } => write!(
                f,
                "the run is at version {current}, this fence expected {expected}"
            ),
            FenceReason::Finished => f.write_str("the run is finished"),
            FenceReason::Gone => f.write_str("the run no longer exists"),
        }
    }
}

/// The class of an error: the label of `abada_agent_store_errors_total` and what a caller does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    /// The store is unreachable, busy or slow: wait and retry within the lease.
    Transient,
    /// Another attempt owns the run: stop silently.
    Fenced,
    /// The journal holds a different step at that `seq`, or the `seq` leaves a gap.
    Conflict,
    /// The store refuses the worker (credentials, database, TLS): an operator must act.
    Misconfigured,
    /// A claim the visit rule refuses (`admission`): the run is another task's conversation.
    Refused,
    /// The input cannot be stored (a run key or step the store refuses).
    Invalid,
    /// Anything else: a bug, or a schema or row the worker does not understand.
    Internal,
}

impl ErrorClass {
    pub fn label(self) -> &'static str {
        match self {
            ErrorClass::Transient => "transient",
            ErrorClass::Fenced => "fenced",
            ErrorClass::Conflict => "conflict",
            ErrorClass::Misconfigured => "misconfigured",
            ErrorClass::Refused => "refused",
            ErrorClass::Invalid => "invalid",
            ErrorClass::Internal => "internal",
        }
    }
}

/// An error of the run store.
#[derive(Clone, Debug, thiserror::Error)]
pub enum StoreError {
    #[error(
        "run {run_key}: attempt {attempt} no longer owns the run ({reason}); it must stop and report nothing"
    )]
    Fenced {
        run_key: String,
        attempt: u64,
        reason: FenceReason,
    },
    #[error("run {run_key}: task {task_id} may not take the run: {reason}")]
    Refused {
        run_key: String,
        task_id: String,
        /// Boxed: a refusal carries the run's journaled definition, and every store result
        /// would otherwise carry its size.
        reason: Box<ClaimRefusal>,
    },
    #[error("run {run_key}: step {seq} conflicts with the journal: {reason}")]
    Conflict {
        run_key: String,
        seq: u64,
        reason: String,
    },
    #[error(
        "the run store at {store} is unavailable: {reason}; callers wait and retry within their lease"
    )]
    Unavailable { store: String, reason: String },
    #[error("the run store at {store} refuses the worker: {reason}; {remedy}")]
    Misconfigured {
        store: String,
        reason: String,
        remedy: &'static str,
    },
    #[error("the run store cannot take this: {0}")]
    Invalid(String),
    #[error("the run store failed unexpectedly: {0}")]
    Internal(String),
}

impl StoreError {
    pub fn class(&self) -> ErrorClass {
        match self {
            StoreError::Fenced { .. } => ErrorClass::Fenced,
            StoreError::Conflict { .. } => ErrorClass::Conflict,
            StoreError::Unavailable { .. } => ErrorClass::Transient,
            StoreError::Misconfigured { .. } => ErrorClass::Misconfigured,
            StoreError::Refused { .. } => ErrorClass::Refused,
            StoreError::Invalid(_) => ErrorClass::Invalid,
            StoreError::Internal(_) => ErrorClass::Internal,
        }
    }

    /// Worth waiting for: the same call may succeed later.
    pub fn is_transient(&self) -> bool {
        self.class() == ErrorClass::Transient
    }

    pub(crate) fn pool_timeout(store: &str, waited: Duration, pool_size: usize) -> StoreError {
        StoreError::Unavailable {
            store: store.to_string(),
            reason: format!(
                "no connection of the pool ({pool_size}) came free within {} ms (ABADA_AGENT_STORE_ACQUIRE_TIMEOUT_MS)",
                waited.as_millis()
            ),
        }
    }

    pub(crate) fn transaction_timeout(store: &str, limit: Duration) -> StoreError {
        StoreError::Unavailable {
            store: store.to_string(),
            reason: format!(
                "no answer to a transaction within {} ms (ABADA_AGENT_STORE_TRANSACTION_TIMEOUT_MS plus a quarter); its connection was closed",
                limit.as_millis()
            ),
        }
    }
}

const FIX_URL: &str =
    "check ABADA_AGENT_STORE_URL (user, password, database) and the role's rights";
const FIX_TLS: &str =
    "check the sslmode of ABADA_AGENT_STORE_URL, the server's certificate and ABADA_AGENT_CA_FILE";

/// Classifies a failure of tokio-postgres talking to the store at `store` (a redacted URL).
pub(crate) fn classify(store: &str, error: &tokio_postgres::Error) -> StoreError {
    let text = match error.as_db_error() {
        // "FATAL 28P01: password authentication failed for user \"abada\""
        Some(db) => {
            let mut text = format!("{} {}: {}", db.severity(), db.code().code(), db.message());
            for (label, part) in [("detail", db.detail()), ("hint", db.hint())] {
                if let Some(part) = part {
                    text.push_str(&format!("; {label}: {part}"));
                }
            }
            text.replace('\n', " ")
        }
        None => one_line(error),
    };
    let unavailable = || StoreError::Unavailable {
        store: store.to_string(),
        reason: text.clone(),
    };
    let misconfigured = |remedy| StoreError::Misconfigured {
        store: store.to_string(),
        reason: text.clone(),
        remedy,
    };
    if let Some(db) = error.as_db_error() {
        let code = db.code().code();
        return match code {
            // serialization failure, deadlock, lock or statement timeout (lock_timeout,
            // statement_timeout), idle-in-transaction timeout, shutdown and start-up, a read-only
            // server (a standby after a failover), too many connections and other resources.
            "40001" | "40P01" | "55P03" | "57014" | "25P03" | "25006" | "57P01" | "57P02"
            | "57P03" | "57P05" => unavailable(),
            c if c.starts_with("08") || c.starts_with("53") || c.starts_with("58") => unavailable(),
            // authentication, unknown database, missing rights, unknown schema
            c if c.starts_with("28") => misconfigured(FIX_URL),
            "3D000" | "42501" | "3F000" => misconfigured(FIX_URL),
            _ => StoreError::Internal(format!("the run store at {store} answered: {text}")),
        };
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    let mut io = false;
    while let Some(e) = source {
        if e.downcast_ref::<rustls::Error>().is_some() {
            return misconfigured(FIX_TLS);
        }
        if let Some(io_error) = e.downcast_ref::<std::io::Error>() {
            if io_error
                .get_ref()
                .is_some_and(|inner| inner.downcast_ref::<rustls::Error>().is_some())
            {
                return misconfigured(FIX_TLS);
            }
            io = true;
        }
        source = e.source();
    }
    if io || error.is_closed() {
        return unavailable();
    }
    let top = error.to_string();
    match top.as_str() {
        "timeout waiting for server" => unavailable(),
        // "server does not support TLS" and other handshake refusals without an I/O error
        "error performing TLS handshake" => misconfigured(FIX_TLS),
        "authentication error" | "invalid configuration" | "invalid connection string" => {
            misconfigured(FIX_URL)
        }
        _ => StoreError::Internal(format!("the run store at {store}: {text}")),
    }
}

/// An error and its sources on one line (server messages may span several).
pub(crate) fn one_line(error: &dyn std::error::Error) -> String {
    crate::errors::chain(error).replace('\n', "; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variant_has_its_class() {
        let cases = [
            (
                StoreError::Fenced {
                    run_key: "t".into(),
                    attempt: 1,
                    reason: FenceReason::Gone,
                },
                ErrorClass::Fenced,
            ),
            (
                StoreError::Conflict {
                    run_key: "t".into(),
                    seq: 2,
                    reason: "x".into(),
                },
                ErrorClass::Conflict,
            ),
            (
                StoreError::pool_timeout("s", Duration::from_millis(5), 2),
                ErrorClass::Transient,
            ),
            (
                StoreError::transaction_timeout("s", Duration::from_millis(5)),
                ErrorClass::Transient,
            ),
            (
                StoreError::Refused {
                    run_key: "process/p/a".into(),
                    task_id: "t-2".into(),
                    reason: Box::new(ClaimRefusal::HeldByAnotherTask {
                        holder: "t-1".into(),
                        hold_ms: 5,
                    }),
                },
                ErrorClass::Refused,
            ),
            (StoreError::Invalid("x".into()), ErrorClass::Invalid),
            (StoreError::Internal("x".into()), ErrorClass::Internal),
        ];
        for (error, class) in cases {
            assert_eq!(error.class(), class, "{error}");
            assert_eq!(error.is_transient(), class == ErrorClass::Transient);
        }
    }

    #[test]
    fn a_pool_timeout_names_the_variable_and_the_wait() {
        let e = StoreError::pool_timeout(
            "postgres://db:5432/abada?sslmode=verify-full",
            Duration::from_millis(250),
            3,
        );
        assert_eq!(
            e.to_string(),
            "the run store at postgres://db:5432/abada?sslmode=verify-full is unavailable: no connection of the pool (3) came free within 250 ms (ABADA_AGENT_STORE_ACQUIRE_TIMEOUT_MS); callers wait and retry within their lease"
        );
    }
}
