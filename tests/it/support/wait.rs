//! Waiting without guessing: every wait in the tests polls for, or listens to, the thing it
//! waits for, under a deadline that names it when it passes.

use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// How often [`eventually`] looks again.
const POLL: Duration = Duration::from_millis(50);

/// Polls `check` until it holds; panics naming `what` once `limit` has passed.
pub async fn eventually(limit: Duration, what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !check().await {
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(POLL).await;
    }
}

/// The next message on `rx`; panics naming `what` when none comes within `limit` or the channel
/// closes first.
pub async fn recv_within<T>(rx: &mut mpsc::UnboundedReceiver<T>, limit: Duration, what: &str) -> T {
    match tokio::time::timeout(limit, rx.recv()).await {
        Ok(Some(message)) => message,
        Ok(None) => panic!("the channel closed while waiting for {what}"),
        Err(_) => panic!("timed out after {limit:?} waiting for {what}"),
    }
}

/// Reads a child's `output` line by line until `parse` accepts one (a process announcing the
/// port it bound, say); panics naming `what` when the output ends first or `limit` passes. The
/// rest of the output is read and dropped in the background, so the child never blocks on a
/// full pipe.
pub async fn announcement<T>(
    output: impl AsyncRead + Unpin + Send + 'static,
    limit: Duration,
    what: &str,
    mut parse: impl FnMut(&str) -> Option<T>,
) -> T {
    let mut lines = BufReader::new(output).lines();
    let found = tokio::time::timeout(limit, async {
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(found) = parse(&line) {
                return Some(found);
            }
        }
        None
    })
    .await;
    match found {
        Ok(Some(found)) => {
            tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
            found
        }
        Ok(None) => panic!("{what} ended its output before announcing itself"),
        Err(_) => panic!("{what} did not announce itself within {limit:?}"),
    }
}
