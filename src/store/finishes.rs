//! Finishes waiting for a transaction: once the engine accepted a task's end,
//! its run's finish (a delete with a retention of zero, a mark otherwise) waits here instead of
//! taking a transaction of its own, and rides with the store's next transaction, the next claim.
//! A worker with no claim to make flushes it after [`IDLE_FLUSH_AFTER`]; a worker shutting down
//! flushes it once its tasks are drained.
//!
//! The queue only says *which* runs to finish, as `(run key, attempt)`: the SQL that performs a
//! batch matches the run row on both (`runs::finish_queued`), so a finish queued by an attempt
//! that another claim has since replaced matches nothing and the newer attempt's run is left as
//! it is. A finish is idempotent, so one performed twice (its batch's commit unacknowledged,
//! the batch put back) changes nothing the second time.
//!
//! Bounded: at [`MAX_PENDING_FINISHES`] queued, the finishing caller flushes the queue itself.
//! A batch taken for a transaction goes back to the queue when that transaction fails or is
//! cancelled ([`Batch`]'s drop), so a claim cut short loses no finish; the queue then holds at
//! most twice its bound, beyond which what could not go back is dropped, and logged.
//!
//! A crash loses the queue: its runs stay `running`, final answer journaled, until the sweeper
//! deletes them as abandoned (`ABADA_AGENT_STORE_ABANDONED_AFTER`). The engine completed those
//! tasks and never hands them out again; a redelivered one would resume from its journal, final
//! answer included, and pay no model call.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::runs::PendingFinish;

/// The most finishes queued before the finishing caller flushes them itself.
pub const MAX_PENDING_FINISHES: usize = 512;

/// How long a queued finish waits for a claim to carry it before the idle flush performs it:
/// short, so a finished run does not linger, and long next to the gap between a busy worker's
/// claims, so a busy worker never flushes on its own.
pub(crate) const IDLE_FLUSH_AFTER: Duration = Duration::from_secs(1);

/// The queue is full: the caller performs the finishes itself.
#[derive(Debug)]
pub(super) struct Full(pub(super) PendingFinish);

/// The finishes waiting for a transaction, shared by every clone of the store.
pub(super) struct PendingFinishes {
    queue: Mutex<VecDeque<PendingFinish>>,
    bound: usize,
    /// Woken when the queue stops being empty (the idle flusher waits on it).
    arrived: Notify,
}

impl PendingFinishes {
    pub(super) fn new(bound: usize) -> PendingFinishes {
        PendingFinishes {
            queue: Mutex::new(VecDeque::new()),
            bound: bound.max(1),
            arrived: Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<PendingFinish>> {
        // Nothing panics while holding the lock; a poisoned queue is still a sound queue.
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `finish`, or hands it back when the queue holds its bound already.
    pub(super) fn push(&self, finish: PendingFinish) -> Result<(), Full> {
        let mut queue = self.lock();
        if queue.len() >= self.bound {
            return Err(Full(finish));
        }
        queue.push_back(finish);
        if queue.len() == 1 {
            self.arrived.notify_one();
        }
        Ok(())
    }

    /// Takes every queued finish for one transaction (plus `extra`, a finish that found the
    /// queue full). Put back unless the batch is marked [`Batch::done`].
    pub(super) fn take(self: &Arc<Self>, extra: Option<PendingFinish>) -> Batch {
        let mut items: Vec<PendingFinish> = self.lock().drain(..).collect();
        items.extend(extra);
        // One order for every transaction, so two claims finishing overlapping runs lock them
        // alike (PostgreSQL breaks a deadlock anyway: a transient error, retried).
        items.sort_by(|a, b| a.run_key.cmp(&b.run_key).then(a.attempt.cmp(&b.attempt)));
        Batch {
            queue: self.clone(),
            items,
            done: false,
        }
    }

    /// When the oldest queued finish was queued.
    pub(super) fn oldest(&self) -> Option<Instant> {
        self.lock().iter().map(|f| f.queued_at).min()
    }

    pub(super) fn len(&self) -> usize {
        self.lock().len()
    }

    /// Puts a batch whose transaction did not commit back in front, keeping its queue times.
    /// At most twice the bound stays queued; the rest is dropped and logged.
    fn restore(&self, items: Vec<PendingFinish>) {
        let mut queue = self.lock();
        let room = (2 * self.bound).saturating_sub(queue.len());
        let dropped = items.len().saturating_sub(room);
        let was_empty = queue.is_empty();
        for item in items.into_iter().take(room).rev() {
            queue.push_front(item);
        }
        if was_empty && !queue.is_empty() {
            self.arrived.notify_one();
        }
        drop(queue);
        if dropped > 0 {
            tracing::warn!(
                dropped,
                "finishes of runs whose tasks ended could not be written to the run store; those runs stay until ABADA_AGENT_STORE_ABANDONED_AFTER deletes them"
            );
        }
    }
}

/// Finishes taken for one transaction. Dropped without [`Batch::done`] (the transaction failed,
/// or its caller was cancelled), they go back to the queue.
pub(super) struct Batch {
    queue: Arc<PendingFinishes>,
    items: Vec<PendingFinish>,
    done: bool,
}

impl Batch {
    pub(super) fn items(&self) -> &[PendingFinish] {
        &self.items
    }

    /// The transaction carrying the batch committed: nothing goes back.
    pub(super) fn done(mut self) -> usize {
        self.done = true;
        self.items.len()
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        if !self.done && !self.items.is_empty() {
            self.queue.restore(std::mem::take(&mut self.items));
        }
    }
}

/// Flushes the queue whenever its oldest finish has waited `after` without a claim carrying it,
/// and no sooner than `after` since the previous flush (a store that is down is not hammered),
/// until `stop`. `flush` performs one batch (a failed one puts it back).
pub(super) async fn idle_flusher<F, Fut>(
    queue: Arc<PendingFinishes>,
    after: Duration,
    stop: CancellationToken,
    mut flush: F,
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    let mut not_before = Instant::now();
    loop {
        let Some(oldest) = queue.oldest() else {
            // Biased, the stop first: the drain writes what is left, not this loop.
            tokio::select! {
                biased;
                _ = stop.cancelled() => return,
                _ = queue.arrived.notified() => continue,
            }
        };
        let due = (oldest + after).max(not_before);
        tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep_until(due) => {}
        }
        // A claim may have carried the finishes meanwhile; flush only what waited its delay.
        if queue.oldest().is_some_and(|t| t + after <= Instant::now()) {
            flush().await;
            not_before = Instant::now() + after;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::RunKey;
    use crate::store::runs::{Fence, RunEnd};
    use std::sync::atomic::{AtomicU32, Ordering};

    fn finish(key: &str, attempt: u64) -> PendingFinish {
        let fence = Fence::issue(RunKey::for_task(key).unwrap(), attempt, 2, 3, 10);
        PendingFinish::of(&fence, RunEnd::Completed)
    }

    /// The queue is bounded: past its bound the caller gets its finish back to perform itself.
    #[test]
    fn a_full_queue_hands_the_finish_back() {
        let queue = Arc::new(PendingFinishes::new(2));
        queue.push(finish("a", 1)).unwrap();
        queue.push(finish("b", 2)).unwrap();
        let Err(Full(back)) = queue.push(finish("c", 3)) else {
            panic!("the third finish was queued past the bound")
        };
        assert_eq!((back.run_key.as_str(), back.attempt), ("c", 3));
        let batch = queue.take(Some(back));
        assert_eq!(batch.items().len(), 3);
        assert_eq!(batch.done(), 3);
        assert_eq!(queue.len(), 0);
    }

    /// A batch whose transaction did not commit (failed, or its claim was cancelled midway)
    /// goes back in front of what was queued since; at most twice the bound stays.
    #[tokio::test(start_paused = true)]
    async fn a_batch_not_done_goes_back_and_the_queue_stays_bounded() {
        let queue = Arc::new(PendingFinishes::new(2));
        queue.push(finish("a", 1)).unwrap();
        queue.push(finish("b", 2)).unwrap();
        let batch = queue.take(None);
        queue.push(finish("c", 3)).unwrap();
        drop(batch); // the claim carrying it was cancelled
        let keys: Vec<String> = queue
            .take(None)
            .items()
            .iter()
            .map(|f| f.run_key.clone())
            .collect();
        // (taken again and dropped again: back in the queue)
        assert_eq!(keys, ["a", "b", "c"]);
        assert_eq!(queue.len(), 3);
        // The queue is full; one more batch of three fails: only one more fits (2 x 2).
        let big = queue.take(Some(finish("d", 4)));
        queue.push(finish("e", 5)).unwrap();
        queue.push(finish("f", 6)).unwrap();
        drop(big);
        assert_eq!(queue.len(), 4, "twice the bound at most");
    }

    /// An idle worker's finish is flushed once it has waited the delay; not before, not twice.
    #[tokio::test(start_paused = true)]
    async fn an_idle_queue_is_flushed_after_the_delay() {
        let queue = Arc::new(PendingFinishes::new(8));
        let stop = CancellationToken::new();
        let flushes = Arc::new(AtomicU32::new(0));
        let flusher = tokio::spawn(idle_flusher(
            queue.clone(),
            IDLE_FLUSH_AFTER,
            stop.clone(),
            {
                let (queue, flushes) = (queue.clone(), flushes.clone());
                move || {
                    let (queue, flushes) = (queue.clone(), flushes.clone());
                    async move {
                        flushes.fetch_add(1, Ordering::SeqCst);
                        queue.take(None).done();
                    }
                }
            },
        ));
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(
            flushes.load(Ordering::SeqCst),
            0,
            "nothing queued, nothing flushed"
        );
        queue.push(finish("a", 1)).unwrap();
        tokio::time::sleep(IDLE_FLUSH_AFTER - Duration::from_millis(1)).await;
        assert_eq!(flushes.load(Ordering::SeqCst), 0, "not before the delay");
        tokio::time::sleep(Duration::from_millis(2)).await;
        assert_eq!(flushes.load(Ordering::SeqCst), 1);
        assert_eq!(queue.len(), 0);
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(
            flushes.load(Ordering::SeqCst),
            1,
            "one flush per idle queue"
        );
        stop.cancel();
        flusher.await.unwrap();
    }

    /// A claim that carries the finishes before the delay leaves the idle flush nothing to do:
    /// a busy worker pays no transaction of its own for them.
    #[tokio::test(start_paused = true)]
    async fn finishes_a_claim_carried_are_not_flushed_again() {
        let queue = Arc::new(PendingFinishes::new(8));
        let stop = CancellationToken::new();
        let flushes = Arc::new(AtomicU32::new(0));
        let flusher = tokio::spawn(idle_flusher(
            queue.clone(),
            IDLE_FLUSH_AFTER,
            stop.clone(),
            {
                let flushes = flushes.clone();
                move || {
                    let flushes = flushes.clone();
                    async move {
                        flushes.fetch_add(1, Ordering::SeqCst);
                    }
                }
            },
        ));
        // A finish every 300 ms, each carried by the next claim 300 ms later.
        for i in 0..20 {
            queue.push(finish(&format!("t-{i}"), i + 1)).unwrap();
            tokio::time::sleep(Duration::from_millis(300)).await;
            queue.take(None).done();
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(flushes.load(Ordering::SeqCst), 0);
        stop.cancel();
        flusher.await.unwrap();
    }

    /// A flush that fails (the store is down) puts its batch back and is tried again a delay
    /// later, not in a loop.
    #[tokio::test(start_paused = true)]
    async fn a_failing_flush_is_retried_a_delay_later_not_in_a_loop() {
        let queue = Arc::new(PendingFinishes::new(8));
        let stop = CancellationToken::new();
        let flushes = Arc::new(AtomicU32::new(0));
        let flusher = tokio::spawn(idle_flusher(
            queue.clone(),
            IDLE_FLUSH_AFTER,
            stop.clone(),
            {
                let (queue, flushes) = (queue.clone(), flushes.clone());
                move || {
                    let (queue, flushes) = (queue.clone(), flushes.clone());
                    async move {
                        flushes.fetch_add(1, Ordering::SeqCst);
                        drop(queue.take(None)); // failed: back in the queue
                    }
                }
            },
        ));
        queue.push(finish("a", 1)).unwrap();
        tokio::time::sleep(IDLE_FLUSH_AFTER * 10 + Duration::from_millis(1)).await;
        assert_eq!(flushes.load(Ordering::SeqCst), 10, "one try per delay");
        assert_eq!(queue.len(), 1, "still queued");
        stop.cancel();
        flusher.await.unwrap();
    }
}
