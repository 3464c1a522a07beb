//! One access token shared by every caller in the process: an actor owns it, gets it from a
//! [`TokenSource`], publishes it through a `watch`, and replaces it ahead of expiry or when a
//! peer refuses it.
//!
//! Callers hold a cloneable [`TokenHandle`]. Reading the token never waits while it is valid:
//! past its refresh point a caller asks for a successor and goes on with the current one. A
//! caller with no usable token (none yet, expired, refused) sends a request and waits, bounded,
//! for the actor's next attempt to finish. Every request carries what the caller saw (the number
//! of finished attempts, the refused token), so a request that a finished attempt or a newer
//! token has answered already starts nothing. One owner means one grant at a time, and callers
//! that waited behind a failed grant share its error instead of each asking again.
//!
//! The schedule is tested here, under a paused clock, with a fake source; the OIDC source
//! (discovery, then the client-credentials grant) is in the parent module.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::AuthStatus;
use crate::secret::Secret;

/// How long a token without `expires_in` is trusted before it is refreshed.
pub(crate) const LIFETIME_WITHOUT_EXPIRY: Duration = Duration::from_secs(300);

/// The smallest head start a refresh gets before the token expires.
const MIN_REFRESH_MARGIN: Duration = Duration::from_secs(10);

/// After a failed early refresh, the longest wait before the next attempt.
const EARLY_RETRY_INTERVAL: Duration = Duration::from_secs(5);

/// How much longer than one grant's bound a caller waits: the time for the actor to publish.
const PUBLISH_MARGIN: Duration = Duration::from_secs(1);

/// What a source's error must tell the actor and its callers.
pub(crate) trait TokenError:
    std::error::Error + Clone + PartialEq + Send + Sync + 'static
{
    /// True when retrying cannot help until someone changes the configuration or the client's
    /// registration at the issuer (readiness says so).
    fn is_configuration_error(&self) -> bool;

    /// No token for a reason outside the source: the grant did not finish within its bound, or
    /// ended unexpectedly. Transient.
    fn unavailable(reason: String) -> Self;
}

/// A token as the issuer granted it.
#[derive(Debug)]
pub(crate) struct GrantedToken {
    pub(crate) access_token: Secret,
    /// Relative to the moment the response arrived; `None` when the issuer did not say.
    pub(crate) expires_in: Option<Duration>,
}

/// Where tokens come from: one grant per call, nothing cached between calls except what the
/// source keeps for itself (a discovery document).
pub(crate) trait TokenSource: Send + Sync + 'static {
    type Error: TokenError;

    fn fetch(&self) -> impl Future<Output = Result<GrantedToken, Self::Error>> + Send;
}

/// The token being served and its schedule.
#[derive(Clone)]
struct Current {
    token: Secret,
    /// From here on, callers ask for a successor (the token stays valid until `expires_at`).
    refresh_at: Instant,
    expires_at: Instant,
}

/// What the actor publishes; handles read it without waiting.
#[derive(Clone)]
struct Published<E> {
    /// The token to send; `None` before the first grant and after a peer refused it.
    current: Option<Current>,
    /// Finished grant attempts. A caller that needs a new token waits for this to pass the
    /// value it saw: whatever attempt finishes next answers it.
    attempts: u64,
    /// The last attempt's error, until an attempt succeeds.
    last_error: Option<E>,
}

impl<E> Published<E> {
    /// The current token while it is valid at `now`.
    fn valid(&self, now: Instant) -> Option<&Current> {
        self.current.as_ref().filter(|c| now < c.expires_at)
    }
}

enum Request {
    /// The caller has no usable token. Answered by the first attempt that finishes after the
    /// caller saw `seen` finished attempts; starts one only when none has finished since.
    Fetch { seen: u64 },
    /// The current token is past its refresh point; its holder keeps using it meanwhile.
    RefreshEarly,
    /// A peer answered 401 to `token`: it is never served again, and a successor is fetched
    /// unless `token` has been replaced already (then, as for `Fetch`).
    Refused { token: Secret, seen: u64 },
    /// A peer refused `token` for lack of a grant (403): it is no longer served; the next
    /// caller fetches a successor carrying the issuer's current grants.
    Discard { token: Secret },
}

/// A cloneable handle to a token actor; the actor stops when the last handle is dropped.
pub(crate) struct TokenHandle<E> {
    requests: mpsc::UnboundedSender<Request>,
    published: watch::Receiver<Published<E>>,
    /// How long a caller waits for an attempt: one grant's bound plus the time to publish it.
    wait_limit: Duration,
}

impl<E> Clone for TokenHandle<E> {
    fn clone(&self) -> Self {
        TokenHandle {
            requests: self.requests.clone(),
            published: self.published.clone(),
            wait_limit: self.wait_limit,
        }
    }
}

/// Starts a token actor on `source`; a grant taking longer than `grant_timeout` counts as
/// failed. `name` says in the logs which token it is (`oidc`, a tool server's name). Nothing is
/// fetched before the first [`TokenHandle::token`] call. Must be called within a tokio runtime.
pub(crate) fn spawn<S: TokenSource>(
    source: S,
    grant_timeout: Duration,
    name: impl Into<String>,
) -> TokenHandle<S::Error> {
    let (requests, rx) = mpsc::unbounded_channel();
    let (published, observed) = watch::channel(Published {
        current: None,
        attempts: 0,
        last_error: None,
    });
    let actor = Actor {
        source: Arc::new(source),
        grant_timeout,
        name: name.into(),
        published,
        grant: JoinSet::new(),
        last_warned: None,
    };
    tokio::spawn(actor.run(rx));
    TokenHandle {
        requests,
        published: observed,
        wait_limit: grant_timeout + PUBLISH_MARGIN,
    }
}

impl<E: TokenError> TokenHandle<E> {
    /// The current token; waits only when there is no valid one (then for one attempt).
    pub(crate) async fn token(&self) -> Result<Secret, E> {
        let now = Instant::now();
        let seen = {
            let published = self.published.borrow();
            if let Some(current) = published.valid(now) {
                if now >= current.refresh_at {
                    self.send(Request::RefreshEarly);
                }
                return Ok(current.token.clone());
            }
            published.attempts
        };
        self.ask(Request::Fetch { seen }, seen).await
    }

    /// A token other than `refused`, which a peer answered 401 to: the newer token when it
    /// has been replaced already, else the result of a new grant.
    pub(crate) async fn refresh_after_rejection(&self, refused: &Secret) -> Result<Secret, E> {
        let seen = {
            let published = self.published.borrow();
            if let Some(current) = published.valid(Instant::now())
                && current.token != *refused
            {
                return Ok(current.token.clone());
            }
            published.attempts
        };
        let request = Request::Refused {
            token: refused.clone(),
            seen,
        };
        self.ask(request, seen).await
    }

    /// Stops serving `token` without fetching another now; nothing happens when another token
    /// has replaced it already.
    pub(crate) fn discard(&self, token: &Secret) {
        self.send(Request::Discard {
            token: token.clone(),
        });
    }

    /// For readiness: authenticated, not yet, or failing with the reason.
    pub(crate) fn status(&self) -> AuthStatus {
        let published = self.published.borrow();
        if published.valid(Instant::now()).is_some() {
            return AuthStatus::Authenticated;
        }
        match &published.last_error {
            Some(error) => AuthStatus::Failing {
                reason: error.to_string(),
                configuration_error: error.is_configuration_error(),
            },
            None if published.attempts == 0 => AuthStatus::NotYet,
            None => AuthStatus::Failing {
                reason: "the token expired or was refused, and has not been replaced yet"
                    .to_string(),
                configuration_error: false,
            },
        }
    }

    fn send(&self, request: Request) {
        // The actor outlives every handle; a failed send means the runtime is shutting down.
        let _ = self.requests.send(request);
    }

    /// Sends `request` and waits for the first attempt to finish after `seen` ones had.
    async fn ask(&self, request: Request, seen: u64) -> Result<Secret, E> {
        let mut observed = self.published.clone();
        if self.requests.send(request).is_err() {
            return Err(E::unavailable("the token service has stopped".to_string()));
        }
        let answered =
            tokio::time::timeout(self.wait_limit, observed.wait_for(|p| p.attempts > seen)).await;
        match answered {
            Ok(Ok(published)) => match (published.valid(Instant::now()), &published.last_error) {
                (Some(current), _) => Ok(current.token.clone()),
                (None, Some(error)) => Err(error.clone()),
                // A token granted already expired (a lifetime shorter than the wait).
                (None, None) => Err(E::unavailable(
                    "the token granted expired before it could be used".to_string(),
                )),
            },
            Ok(Err(_closed)) => Err(E::unavailable("the token service has stopped".to_string())),
            Err(_elapsed) => Err(E::unavailable(format!(
                "no token within {} s",
                self.wait_limit.as_secs()
            ))),
        }
    }
}

struct Actor<S: TokenSource> {
    source: Arc<S>,
    grant_timeout: Duration,
    name: String,
    published: watch::Sender<Published<S::Error>>,
    /// The grant under way; at most one (single flight). It runs as its own task so that a
    /// panic in the source fails the attempt, not the actor.
    grant: JoinSet<(Instant, Result<GrantedToken, S::Error>)>,
    /// The last failure logged at warn level. A failure returned to a caller is the caller's to
    /// report (the runner logs it once), so only failures hidden behind a still-valid token are
    /// warned about here, each distinct one once.
    last_warned: Option<S::Error>,
}

impl<S: TokenSource> Actor<S> {
    async fn run(mut self, mut requests: mpsc::UnboundedReceiver<Request>) {
        loop {
            // Biased, a finished grant first: a request arriving as it ends is answered with its
            // token, not queued behind a grant that is over (and the order is the same on every
            // run, not tokio's random pick).
            tokio::select! {
                biased;
                Some(done) = self.grant.join_next(), if !self.grant.is_empty() => {
                    let (received_at, result) = done.unwrap_or_else(|_| {
                        (Instant::now(), Err(S::Error::unavailable(
                            "the token request ended unexpectedly".to_string(),
                        )))
                    });
                    self.on_grant(received_at, result);
                }
                request = requests.recv() => match request {
                    Some(request) => self.on_request(request),
                    None => break,
                },
            }
        }
        self.grant.abort_all();
    }

    fn on_request(&mut self, request: Request) {
        let now = Instant::now();
        match request {
            Request::Fetch { seen } => self.fetch_unless_answered(seen),
            Request::RefreshEarly => {
                let due = self
                    .published
                    .borrow()
                    .valid(now)
                    .is_some_and(|c| now >= c.refresh_at);
                if due {
                    self.start_grant();
                }
            }
            Request::Refused { token, seen } => {
                if self.forget(&token) {
                    tracing::debug!(token = %self.name, "a peer refused the access token; fetching another");
                }
                self.fetch_unless_answered(seen);
            }
            Request::Discard { token } => {
                if self.forget(&token) {
                    tracing::debug!(token = %self.name, "a peer refused the access token; another is fetched at the next call");
                }
            }
        }
    }

    /// Stops serving `token` if it is the current one; says whether it was.
    fn forget(&mut self, token: &Secret) -> bool {
        self.published.send_if_modified(|p| {
            let is_current = p.current.as_ref().is_some_and(|c| c.token == *token);
            if is_current {
                p.current = None;
            }
            is_current
        })
    }

    fn fetch_unless_answered(&mut self, seen: u64) {
        if self.published.borrow().attempts == seen {
            self.start_grant();
        }
    }

    fn start_grant(&mut self) {
        if !self.grant.is_empty() {
            return;
        }
        let source = self.source.clone();
        let limit = self.grant_timeout;
        self.grant.spawn(async move {
            let result = match tokio::time::timeout(limit, source.fetch()).await {
                Ok(result) => result,
                Err(_) => Err(S::Error::unavailable(format!(
                    "the issuer did not answer within {} s",
                    limit.as_secs()
                ))),
            };
            (Instant::now(), result)
        });
    }

    fn on_grant(&mut self, received_at: Instant, result: Result<GrantedToken, S::Error>) {
        match result {
            Ok(granted) => {
                let lifetime = granted.expires_in.unwrap_or(LIFETIME_WITHOUT_EXPIRY);
                let current = Current {
                    token: granted.access_token,
                    refresh_at: received_at + refresh_lead(lifetime),
                    expires_at: received_at + lifetime,
                };
                self.published.send_modify(|p| {
                    p.attempts += 1;
                    p.current = Some(current);
                    p.last_error = None;
                });
                self.last_warned = None;
                tracing::debug!(
                    token = %self.name,
                    expires_in_s = lifetime.as_secs(),
                    "obtained an access token"
                );
            }
            Err(error) => {
                let now = Instant::now();
                let mut still_valid = false;
                self.published.send_modify(|p| {
                    p.attempts += 1;
                    p.last_error = Some(error.clone());
                    if let Some(current) = p.current.as_mut().filter(|c| now < c.expires_at) {
                        // Served without another attempt for a while (at most
                        // EARLY_RETRY_INTERVAL, at most half its remaining life), so a down
                        // issuer is not asked on every call.
                        current.refresh_at =
                            now + EARLY_RETRY_INTERVAL.min((current.expires_at - now) / 2);
                        still_valid = true;
                    }
                });
                if !still_valid {
                    // Returned to the callers waiting for it; they report it.
                    tracing::debug!(token = %self.name, error = %error, "could not obtain an access token");
                } else if self.last_warned.as_ref() != Some(&error) {
                    tracing::warn!(token = %self.name, error = %error, "could not refresh the access token early; the current one is used until it expires");
                    self.last_warned = Some(error);
                } else {
                    tracing::debug!(token = %self.name, error = %error, "could not refresh the access token early, again");
                }
            }
        }
    }
}

/// How long after receipt a token of `lifetime` is refreshed: `lifetime` minus max(10 s, 10 %),
/// or half the lifetime for tokens too short for that margin.
pub(crate) fn refresh_lead(lifetime: Duration) -> Duration {
    let margin = MIN_REFRESH_MARGIN.max(lifetime / 10);
    if lifetime > margin {
        lifetime - margin
    } else {
        lifetime / 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[derive(Debug, Clone, PartialEq, thiserror::Error)]
    enum FakeError {
        #[error("issuer down")]
        Down,
        #[error("no token: {0}")]
        Unavailable(String),
    }

    impl TokenError for FakeError {
        fn is_configuration_error(&self) -> bool {
            false
        }
        fn unavailable(reason: String) -> Self {
            FakeError::Unavailable(reason)
        }
    }

    /// What the fake source does at its next grant.
    #[derive(Clone, Copy, PartialEq)]
    enum Mode {
        Grant,
        Fail,
        Hang,
        Panic,
    }

    /// Grants `token-1`, `token-2`, ... after a 50 ms round trip, or fails, hangs or panics as
    /// `mode` says. Counts every grant it starts.
    struct FakeSource {
        grants: Arc<AtomicU64>,
        lifetime: Option<Duration>,
        mode: Arc<Mutex<Mode>>,
        /// Fires when the source is dropped (the actor ended).
        dropped: Option<tokio::sync::oneshot::Sender<()>>,
    }

    impl Drop for FakeSource {
        fn drop(&mut self) {
            if let Some(tx) = self.dropped.take() {
                let _ = tx.send(());
            }
        }
    }

    impl TokenSource for FakeSource {
        type Error = FakeError;

        async fn fetch(&self) -> Result<GrantedToken, FakeError> {
            let n = self.grants.fetch_add(1, Ordering::SeqCst) + 1;
            let mode = *self.mode.lock().unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
            match mode {
                Mode::Grant => Ok(GrantedToken {
                    access_token: Secret::new(format!("token-{n}")),
                    expires_in: self.lifetime,
                }),
                Mode::Fail => Err(FakeError::Down),
                Mode::Hang => std::future::pending().await,
                Mode::Panic => panic!("the source broke"),
            }
        }
    }

    const GRANT_TIMEOUT: Duration = Duration::from_secs(30);

    struct Harness {
        tokens: TokenHandle<FakeError>,
        grants: Arc<AtomicU64>,
        mode: Arc<Mutex<Mode>>,
        dropped: tokio::sync::oneshot::Receiver<()>,
    }

    impl Harness {
        fn set(&self, mode: Mode) {
            *self.mode.lock().unwrap() = mode;
        }
        fn grants(&self) -> u64 {
            self.grants.load(Ordering::SeqCst)
        }
        async fn token(&self) -> String {
            self.tokens.token().await.unwrap().expose().to_string()
        }
    }

    fn harness(lifetime: Option<Duration>) -> Harness {
        let grants = Arc::new(AtomicU64::new(0));
        let mode = Arc::new(Mutex::new(Mode::Grant));
        let (tx, dropped) = tokio::sync::oneshot::channel();
        let tokens = spawn(
            FakeSource {
                grants: grants.clone(),
                lifetime,
                mode: mode.clone(),
                dropped: Some(tx),
            },
            GRANT_TIMEOUT,
            "test",
        );
        Harness {
            tokens,
            grants,
            mode,
            dropped,
        }
    }

    /// Lets the actor and a grant under way finish (virtual time: the clock is paused).
    async fn settle() {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }

    async fn hundred_callers(tokens: &TokenHandle<FakeError>) -> Vec<Result<Secret, FakeError>> {
        let calls: Vec<_> = (0..100)
            .map(|_| {
                let t = tokens.clone();
                tokio::spawn(async move { t.token().await })
            })
            .collect();
        let mut results = Vec::new();
        for call in calls {
            results.push(call.await.unwrap());
        }
        results
    }

    fn all_are(results: &[Result<Secret, FakeError>], token: &str) -> bool {
        results
            .iter()
            .all(|r| r.as_ref().is_ok_and(|t| t.expose() == token))
    }

    #[test]
    fn refresh_lead_keeps_ten_seconds_or_ten_percent() {
        assert_eq!(
            refresh_lead(Duration::from_secs(3600)),
            Duration::from_secs(3240)
        );
        assert_eq!(
            refresh_lead(Duration::from_secs(60)),
            Duration::from_secs(50)
        );
        assert_eq!(refresh_lead(Duration::from_secs(8)), Duration::from_secs(4));
    }

    #[tokio::test(start_paused = true)]
    async fn hundred_concurrent_callers_cause_one_grant_per_expiry_window() {
        let h = harness(Some(Duration::from_secs(300)));
        assert_eq!(h.tokens.status(), AuthStatus::NotYet);

        assert!(all_are(&hundred_callers(&h.tokens).await, "token-1"));
        assert_eq!(h.grants(), 1);
        assert_eq!(h.tokens.status(), AuthStatus::Authenticated);

        // Refresh at 300 s - 30 s (10 %): just before, still the first token, no grant.
        tokio::time::advance(Duration::from_secs(269)).await;
        assert!(all_are(&hundred_callers(&h.tokens).await, "token-1"));
        settle().await;
        assert_eq!(h.grants(), 1);

        // Past the refresh point: the callers ask for a successor and keep using the still
        // valid token meanwhile; one grant follows.
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(all_are(&hundred_callers(&h.tokens).await, "token-1"));
        settle().await;
        assert_eq!(h.grants(), 2);
        assert!(all_are(&hundred_callers(&h.tokens).await, "token-2"));
        settle().await;
        assert_eq!(h.grants(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn callers_never_wait_on_an_early_refresh_while_the_token_is_valid() {
        let h = harness(Some(Duration::from_secs(100)));
        h.token().await;
        h.set(Mode::Hang);
        tokio::time::advance(Duration::from_secs(95)).await;
        let before = Instant::now();
        for _ in 0..10 {
            assert_eq!(h.token().await, "token-1");
        }
        assert_eq!(Instant::now(), before, "no caller waited");
        settle().await;
        assert_eq!(h.grants(), 2, "one refresh under way, however many callers");
        assert_eq!(h.token().await, "token-1");
    }

    #[tokio::test(start_paused = true)]
    async fn callers_waiting_behind_a_failed_grant_share_its_error() {
        let h = harness(Some(Duration::from_secs(300)));
        h.set(Mode::Fail);
        let results = hundred_callers(&h.tokens).await;
        assert!(results.iter().all(|r| *r == Err(FakeError::Down)));
        assert_eq!(h.grants(), 1);
        assert!(matches!(
            h.tokens.status(),
            AuthStatus::Failing {
                configuration_error: false,
                ..
            }
        ));

        // The next call tries again.
        h.set(Mode::Grant);
        assert_eq!(h.token().await, "token-2");
        assert_eq!(h.tokens.status(), AuthStatus::Authenticated);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_early_refresh_keeps_serving_the_still_valid_token_and_backs_off() {
        let h = harness(Some(Duration::from_secs(100)));
        assert_eq!(h.token().await, "token-1");
        h.set(Mode::Fail);
        tokio::time::advance(Duration::from_secs(95)).await;
        assert_eq!(h.token().await, "token-1");
        settle().await;
        assert_eq!(h.tokens.status(), AuthStatus::Authenticated);
        assert_eq!(h.grants(), 2);
        // The next attempt waits a little (half the remaining 5 s), not every call.
        for _ in 0..10 {
            assert_eq!(h.token().await, "token-1");
        }
        settle().await;
        assert_eq!(h.grants(), 2);
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(h.token().await, "token-1");
        settle().await;
        assert_eq!(h.grants(), 3);
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(h.tokens.token().await, Err(FakeError::Down));
        assert!(matches!(h.tokens.status(), AuthStatus::Failing { .. }));
    }

    #[tokio::test(start_paused = true)]
    async fn rejection_refreshes_once_however_many_callers_report_it() {
        let h = harness(Some(Duration::from_secs(3600)));
        let refused = h.tokens.token().await.unwrap();
        let calls: Vec<_> = (0..20)
            .map(|_| {
                let t = h.tokens.clone();
                let r = refused.clone();
                tokio::spawn(async move { t.refresh_after_rejection(&r).await })
            })
            .collect();
        for call in calls {
            assert_eq!(call.await.unwrap().unwrap().expose(), "token-2");
        }
        assert_eq!(h.grants(), 2);
        assert_eq!(h.token().await, "token-2");
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_report_about_a_replaced_token_gets_the_newer_one_without_a_grant() {
        let h = harness(Some(Duration::from_secs(3600)));
        let first = h.tokens.token().await.unwrap();
        let second = h.tokens.refresh_after_rejection(&first).await.unwrap();
        assert_eq!(second.expose(), "token-2");
        // Another caller's request with the first token comes back refused too, later.
        assert_eq!(h.tokens.refresh_after_rejection(&first).await, Ok(second));
        settle().await;
        assert_eq!(h.grants(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_that_a_finished_attempt_answered_starts_no_grant() {
        let h = harness(Some(Duration::from_secs(3600)));
        h.set(Mode::Fail);
        assert_eq!(h.tokens.token().await, Err(FakeError::Down));
        h.set(Mode::Grant);
        assert_eq!(h.token().await, "token-2");
        // Requests from callers that looked before those attempts finished arrive late: the
        // finished attempts have answered them already.
        for seen in [0, 1] {
            let late = [
                Request::Fetch { seen },
                Request::Refused {
                    token: Secret::new("an-older-token"),
                    seen,
                },
            ];
            for request in late {
                h.tokens.requests.send(request).unwrap();
            }
        }
        settle().await;
        assert_eq!(h.grants(), 2);
        assert_eq!(h.token().await, "token-2");
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusal_during_an_early_refresh_is_answered_by_that_refresh() {
        let h = harness(Some(Duration::from_secs(100)));
        let first = h.tokens.token().await.unwrap();
        tokio::time::advance(Duration::from_secs(95)).await;
        assert_eq!(h.tokens.token().await, Ok(first.clone()));
        // The early refresh is under way when the engine refuses the first token.
        assert_eq!(
            h.tokens
                .refresh_after_rejection(&first)
                .await
                .unwrap()
                .expose(),
            "token-2"
        );
        assert_eq!(h.grants(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_rejected_token_is_not_served_again_when_its_refresh_fails() {
        let h = harness(Some(Duration::from_secs(3600)));
        let refused = h.tokens.token().await.unwrap();
        h.set(Mode::Fail);
        assert_eq!(
            h.tokens.refresh_after_rejection(&refused).await,
            Err(FakeError::Down)
        );
        assert_eq!(h.tokens.token().await, Err(FakeError::Down));
        assert_eq!(h.grants(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_token_without_expires_in_is_refreshed_after_the_default_lifetime() {
        let h = harness(None);
        h.token().await;
        tokio::time::advance(refresh_lead(LIFETIME_WITHOUT_EXPIRY) + Duration::from_secs(1)).await;
        assert_eq!(h.token().await, "token-1", "still valid: served at once");
        settle().await;
        assert_eq!(h.token().await, "token-2");
    }

    #[tokio::test(start_paused = true)]
    async fn a_discarded_token_is_replaced_at_the_next_call_and_only_that_token() {
        let h = harness(Some(Duration::from_secs(3600)));
        let first = h.tokens.token().await.unwrap();
        h.tokens.discard(&Secret::new("some-other-token"));
        settle().await;
        assert_eq!(h.tokens.token().await, Ok(first.clone()));
        assert_eq!(h.grants(), 1);
        h.tokens.discard(&first);
        settle().await;
        assert_eq!(h.grants(), 1, "nothing fetched until asked");
        assert!(matches!(h.tokens.status(), AuthStatus::Failing { .. }));
        assert_eq!(h.token().await, "token-2");
    }

    #[tokio::test(start_paused = true)]
    async fn a_hung_grant_fails_within_its_bound_and_the_next_call_tries_again() {
        let h = harness(Some(Duration::from_secs(3600)));
        h.set(Mode::Hang);
        let started = Instant::now();
        let error = h.tokens.token().await.unwrap_err();
        assert!(
            matches!(&error, FakeError::Unavailable(m) if m.contains("30 s")),
            "{error}"
        );
        let waited = started.elapsed();
        assert!(
            waited >= GRANT_TIMEOUT && waited < GRANT_TIMEOUT + PUBLISH_MARGIN,
            "{waited:?}"
        );
        h.set(Mode::Grant);
        assert_eq!(h.token().await, "token-2");
    }

    #[tokio::test(start_paused = true)]
    async fn a_panicking_source_fails_the_attempt_not_the_actor() {
        let h = harness(Some(Duration::from_secs(3600)));
        h.set(Mode::Panic);
        assert!(matches!(
            h.tokens.token().await,
            Err(FakeError::Unavailable(_))
        ));
        h.set(Mode::Grant);
        assert_eq!(h.token().await, "token-2");
    }

    #[tokio::test(start_paused = true)]
    async fn the_actor_ends_when_the_last_handle_is_dropped_even_during_a_grant() {
        let h = harness(Some(Duration::from_secs(3600)));
        h.set(Mode::Hang);
        let waiting = {
            let t = h.tokens.clone();
            tokio::spawn(async move { t.token().await })
        };
        settle().await;
        assert_eq!(h.grants(), 1, "the grant is under way");
        waiting.abort();
        let _ = waiting.await;
        let Harness {
            tokens, dropped, ..
        } = h;
        drop(tokens);
        tokio::time::timeout(Duration::from_secs(5), dropped)
            .await
            .expect("the actor stops")
            .expect("the source is dropped, not leaked");
    }

    /// Collects what the fmt subscriber writes.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Captured {
        fn warn_lines(&self) -> Vec<String> {
            String::from_utf8(self.0.lock().unwrap().clone())
                .unwrap()
                .lines()
                .filter(|l| l.contains("WARN"))
                .map(str::to_string)
                .collect()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn failures_are_the_callers_to_report_except_a_hidden_early_refresh_failure_once() {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        let _guard = tracing::subscriber::set_default(subscriber);

        // No token yet: every failure goes back to the caller, which logs it.
        let h = harness(Some(Duration::from_secs(100)));
        h.set(Mode::Fail);
        for _ in 0..3 {
            assert!(h.tokens.token().await.is_err());
        }
        assert!(
            captured.warn_lines().is_empty(),
            "{:?}",
            captured.warn_lines()
        );

        // A valid token hides failed early refreshes from the callers: warned once.
        h.set(Mode::Grant);
        h.token().await;
        h.set(Mode::Fail);
        tokio::time::advance(Duration::from_secs(95)).await;
        // Early attempts at 95 s and, backed off, at 99 s; none at 97 s.
        for _ in 0..3 {
            assert!(h.tokens.token().await.is_ok());
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        assert_eq!(h.grants(), 3 + 1 + 2);
        assert_eq!(
            captured.warn_lines().len(),
            1,
            "{:?}",
            captured.warn_lines()
        );
        // Once expired, the failure reaches the callers again.
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(h.tokens.token().await.is_err());
        assert_eq!(
            captured.warn_lines().len(),
            1,
            "{:?}",
            captured.warn_lines()
        );
    }
}
