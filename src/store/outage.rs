//! One log line per store outage, not one per failed transaction: the first failure says what
//! happened and what callers do; the first success after it says how long it lasted.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::time::Instant;

use super::error::{ErrorClass, StoreError};

#[derive(Default)]
pub(super) struct OutageLog {
    /// Set while an outage is open; lets the success path skip the lock.
    open: AtomicBool,
    current: Mutex<Option<Outage>>,
}

struct Outage {
    since: Instant,
    failures: u64,
    class: ErrorClass,
}

impl OutageLog {
    pub(super) fn failed(&self, operation: &str, error: &StoreError) {
        let class = error.class();
        let mut current = self.current.lock().expect("outage lock poisoned");
        match current.as_mut() {
            Some(outage) if outage.class == class => {
                outage.failures += 1;
                tracing::debug!(operation, error = %error, "run store still unavailable");
                return;
            }
            Some(outage) => {
                outage.class = class;
                outage.failures += 1;
            }
            None => {
                *current = Some(Outage {
                    since: Instant::now(),
                    failures: 1,
                    class,
                });
                self.open.store(true, Ordering::Release);
            }
        }
        drop(current);
        if class == ErrorClass::Misconfigured {
            tracing::error!(operation, error = %error, "the run store refuses the worker");
        } else {
            tracing::warn!(operation, error = %error, "the run store is unavailable");
        }
    }

    pub(super) fn succeeded(&self, store: &str) {
        if !self.open.load(Ordering::Acquire) {
            return;
        }
        let mut current = self.current.lock().expect("outage lock poisoned");
        let Some(outage) = current.take() else {
            return;
        };
        // Under the lock, so a failure racing this success reopens the outage consistently.
        self.open.store(false, Ordering::Release);
        drop(current);
        tracing::info!(
            store,
            outage_ms = outage.since.elapsed().as_millis() as u64,
            failed_transactions = outage.failures,
            "the run store is available again"
        );
    }
}
