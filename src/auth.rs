//! The worker's identity towards the engine (protocol.md A.5): an OAuth 2.0 client-credentials
//! token from the OIDC issuer, found by discovery, cached once for the whole process, refreshed
//! ahead of expiry by one caller at a time, and refreshed on demand when the engine rejects it.
//!
//! The engine client depends only on [`TokenProvider`]; [`OidcTokenProvider`] is the real one.
//! The cache and its schedule live in [`OidcTokenProvider`]; the wire work (discovery, the grant)
//! sits behind the internal [`TokenGrant`] seam so the schedule is tested under a paused clock.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use async_trait::async_trait;
use openidconnect::core::{CoreClient, CoreErrorResponseType, CoreProviderMetadata};
use openidconnect::{
    AsyncHttpClient, AuthType, ClientId, ClientSecret, HttpRequest, HttpResponse, IssuerUrl,
    OAuth2TokenResponse, RequestTokenError, Scope, TokenUrl,
};
use tokio::sync::Mutex as AsyncMutex;
use tokio::time::Instant;

use crate::secret::{Secret, SecretSource};

/// The scope the engine requires of a worker (protocol.md A.5).
pub const DEFAULT_SCOPE: &str = "worker:execute";

/// How long a token without `expires_in` is trusted before it is refreshed.
const LIFETIME_WITHOUT_EXPIRY: Duration = Duration::from_secs(300);

/// The smallest head start a refresh gets before the token expires.
const MIN_REFRESH_MARGIN: Duration = Duration::from_secs(10);

/// After a failed early refresh, the longest wait before the next attempt.
const EARLY_RETRY_INTERVAL: Duration = Duration::from_secs(5);

/// Bound on one discovery or token request, so a hung issuer cannot hold the refresh lock.
const ISSUER_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Gives the engine client a bearer token.
///
/// The engine client calls [`token`](Self::token) before each request. When the engine answers
/// 401 `AUTHENTICATION_REQUIRED`, it calls [`refresh_after_rejection`](Self::refresh_after_rejection)
/// once with the token it sent and retries once with the result.
#[async_trait]
pub trait TokenProvider: Send + Sync + 'static {
    /// The current token, fetched or refreshed first when needed.
    async fn token(&self) -> Result<Secret, AuthError>;

    /// A token other than `rejected`: refreshes only if the cached token is still the rejected
    /// one (another caller may have refreshed already).
    async fn refresh_after_rejection(&self, rejected: &Secret) -> Result<Secret, AuthError>;

    /// Stops serving `token` without fetching another now: for a token the engine refused with
    /// 403 `ACCESS_DENIED`, so the next [`token`](Self::token) call (after the caller's backoff)
    /// gets a new one carrying the issuer's current grants, instead of the refused one until it
    /// expires. Does nothing when another token has replaced it already.
    fn discard(&self, _token: &Secret) {}
}

/// How the client authenticates at the token endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ClientAuth {
    /// HTTP Basic (`client_secret_basic`), the OAuth 2.0 default.
    #[default]
    Basic,
    /// `client_id` and `client_secret` in the form body (`client_secret_post`), which some
    /// issuers require.
    RequestBody,
}

/// What the worker needs to obtain its token; filled by the configuration module from the
/// `ABADA_AGENT_OIDC_*` variables.
#[derive(Debug, Clone)]
pub struct OidcSettings {
    /// Exactly as the issuer advertises itself (`issuer` in its discovery document), including
    /// or excluding a trailing slash the same way.
    pub issuer_url: String,
    pub client_id: String,
    /// Re-loaded at every grant, so a rotated secret file is used without a restart.
    pub client_secret: Arc<SecretSource>,
    pub scopes: Vec<String>,
    pub client_auth: ClientAuth,
}

impl OidcSettings {
    /// Settings with the default scope (`worker:execute`) and HTTP Basic client authentication.
    pub fn new(
        issuer_url: impl Into<String>,
        client_id: impl Into<String>,
        client_secret: Arc<SecretSource>,
    ) -> Self {
        OidcSettings {
            issuer_url: issuer_url.into(),
            client_id: client_id.into(),
            client_secret,
            scopes: vec![DEFAULT_SCOPE.to_string()],
            client_auth: ClientAuth::Basic,
        }
    }
}

/// Why no token could be had. Never carries the client secret or a token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error(
        "ABADA_AGENT_OIDC_ISSUER_URL {issuer_url:?} is not a valid URL: {reason}; give the issuer's base URL, e.g. https://login.example.com/realms/abada"
    )]
    InvalidIssuerUrl { issuer_url: String, reason: String },
    #[error(
        "cannot reach the OIDC issuer {issuer_url} for discovery: {reason}; check ABADA_AGENT_OIDC_ISSUER_URL, the network and ABADA_AGENT_CA_FILE"
    )]
    IssuerUnreachable { issuer_url: String, reason: String },
    #[error(
        "OIDC discovery at {issuer_url} failed: {reason}; ABADA_AGENT_OIDC_ISSUER_URL must be the issuer exactly as it advertises itself (same scheme, host, path and trailing slash)"
    )]
    DiscoveryFailed { issuer_url: String, reason: String },
    #[error(
        "cannot read the OIDC client secret: {reason}; check ABADA_AGENT_OIDC_CLIENT_SECRET or ABADA_AGENT_OIDC_CLIENT_SECRET_FILE"
    )]
    SecretUnavailable { reason: String },
    #[error(
        "the issuer rejected the client credentials for client id {client_id}; check ABADA_AGENT_OIDC_CLIENT_SECRET (and ABADA_AGENT_OIDC_CLIENT_AUTH if the issuer wants the secret in the request body)"
    )]
    InvalidClient { client_id: String },
    #[error(
        "the issuer refused a token to client id {client_id}: {error}{description}; check ABADA_AGENT_OIDC_SCOPES and the client's grants at the issuer"
    )]
    TokenRefused {
        client_id: String,
        /// The OAuth 2.0 error code, e.g. `invalid_scope`.
        error: String,
        /// `": <error_description>"` when the issuer gave one, else empty.
        description: String,
    },
    #[error("the token request to {token_url} failed: {reason}; the worker will try again")]
    TokenEndpoint { token_url: String, reason: String },
}

impl AuthError {
    /// True when retrying cannot help until someone changes the configuration or the client's
    /// registration at the issuer (report not ready, log clearly, back off).
    pub fn is_configuration_error(&self) -> bool {
        match self {
            AuthError::InvalidIssuerUrl { .. }
            | AuthError::DiscoveryFailed { .. }
            | AuthError::SecretUnavailable { .. }
            | AuthError::InvalidClient { .. }
            | AuthError::TokenRefused { .. } => true,
            AuthError::IssuerUnreachable { .. } | AuthError::TokenEndpoint { .. } => false,
        }
    }
}

/// What readiness reports about authentication.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthStatus {
    /// No token has been requested yet.
    NotYet,
    /// A token is held and has not expired (a failed early refresh does not change this).
    Authenticated,
    /// No usable token: the last attempt failed.
    Failing {
        reason: String,
        configuration_error: bool,
    },
}

impl fmt::Display for AuthStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AuthStatus::NotYet => f.write_str("not yet authenticated"),
            AuthStatus::Authenticated => f.write_str("authenticated"),
            AuthStatus::Failing { reason, .. } => write!(f, "failing: {reason}"),
        }
    }
}

/// A token as the issuer granted it.
pub(crate) struct GrantedToken {
    pub(crate) access_token: Secret,
    /// Relative to the moment the response arrived; `None` when the issuer did not say.
    pub(crate) expires_in: Option<Duration>,
}

/// The wire side of a grant: discovery (cached by the implementation) and one token request.
#[async_trait]
pub(crate) trait TokenGrant: Send + Sync + 'static {
    async fn grant(&self) -> Result<GrantedToken, AuthError>;
}

/// The cached token and when to replace it.
#[derive(Clone)]
struct CachedToken {
    token: Secret,
    /// From here on, callers refresh first (the token is still valid until `expires_at`).
    refresh_at: Instant,
    expires_at: Instant,
}

/// Guarded by the refresh lock: only the caller holding it talks to the issuer.
struct RefreshState {
    /// Counts grant attempts, so callers that waited behind a failed attempt share its error
    /// instead of each trying again.
    attempts: u64,
    last_error: Option<AuthError>,
    /// The last failure logged at warn level. A failure returned to the caller is the caller's
    /// to report (the runner logs it once), so only failures hidden behind a still-valid token
    /// are warned about here, each distinct one once.
    last_warned: Option<AuthError>,
}

/// The process-wide OIDC client-credentials token: one cached token shared by every task.
pub struct OidcTokenProvider {
    grant: Box<dyn TokenGrant>,
    /// Read on every request without waiting for a refresh in progress.
    cached: StdMutex<Option<CachedToken>>,
    /// Held for the whole of one refresh (single flight).
    refresh: AsyncMutex<RefreshState>,
    /// Mirrors `RefreshState::attempts` for callers not holding the lock.
    attempts_seen: StdMutex<(u64, Option<AuthError>)>,
    status: StdMutex<AuthStatus>,
}

impl fmt::Debug for OidcTokenProvider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OidcTokenProvider")
            .field("status", &self.status())
            .finish_non_exhaustive()
    }
}

impl OidcTokenProvider {
    /// A provider for `settings`, talking to the issuer with a client built from `http` (from
    /// [`crate::tls::http_client_builder`]); redirects are turned off as openidconnect requires.
    /// Nothing is sent until the first [`TokenProvider::token`] call.
    pub fn new(settings: OidcSettings, http: reqwest::ClientBuilder) -> Result<Self, AuthError> {
        let issuer_url = IssuerUrl::new(settings.issuer_url.clone()).map_err(|e| {
            AuthError::InvalidIssuerUrl {
                issuer_url: settings.issuer_url.clone(),
                reason: e.to_string(),
            }
        })?;
        let client = http
            .redirect(reqwest::redirect::Policy::none())
            .timeout(ISSUER_REQUEST_TIMEOUT)
            .build()
            .map_err(|e| AuthError::IssuerUnreachable {
                issuer_url: settings.issuer_url.clone(),
                reason: format!("cannot build the HTTP client: {e}"),
            })?;
        Ok(Self::with_grant(Box::new(OidcGrant {
            settings,
            issuer_url,
            http: IssuerHttpClient(client),
            discovered: StdMutex::new(None),
        })))
    }

    pub(crate) fn with_grant(grant: Box<dyn TokenGrant>) -> Self {
        OidcTokenProvider {
            grant,
            cached: StdMutex::new(None),
            refresh: AsyncMutex::new(RefreshState {
                attempts: 0,
                last_error: None,
                last_warned: None,
            }),
            attempts_seen: StdMutex::new((0, None)),
            status: StdMutex::new(AuthStatus::NotYet),
        }
    }

    /// For readiness: authenticated, not yet, or failing with the reason.
    pub fn status(&self) -> AuthStatus {
        let status = lock(&self.status).clone();
        if status == AuthStatus::Authenticated
            && lock(&self.cached)
                .as_ref()
                .is_none_or(|c| Instant::now() >= c.expires_at)
        {
            return AuthStatus::Failing {
                reason: "the token expired and has not been refreshed yet".to_string(),
                configuration_error: false,
            };
        }
        status
    }

    fn fresh_cached(&self, now: Instant) -> Option<Secret> {
        lock(&self.cached)
            .as_ref()
            .filter(|c| now < c.refresh_at)
            .map(|c| c.token.clone())
    }

    fn valid_cached(&self, now: Instant) -> Option<CachedToken> {
        lock(&self.cached)
            .as_ref()
            .filter(|c| now < c.expires_at)
            .cloned()
    }

    /// Runs one grant while holding the refresh lock, unless a caller we waited behind already
    /// tried (then its error is shared).
    async fn refresh_locked(
        &self,
        state: &mut RefreshState,
        attempts_before_wait: u64,
    ) -> Result<Secret, AuthError> {
        if state.attempts != attempts_before_wait
            && let Some(error) = &state.last_error
        {
            return Err(error.clone());
        }
        state.attempts += 1;
        let result = self.grant.grant().await;
        let received_at = Instant::now();
        match result {
            Ok(granted) => {
                let lifetime = granted.expires_in.unwrap_or(LIFETIME_WITHOUT_EXPIRY);
                let cached = CachedToken {
                    token: granted.access_token.clone(),
                    refresh_at: received_at + refresh_lead(lifetime),
                    expires_at: received_at + lifetime,
                };
                *lock(&self.cached) = Some(cached);
                state.last_error = None;
                state.last_warned = None;
                *lock(&self.status) = AuthStatus::Authenticated;
                *lock(&self.attempts_seen) = (state.attempts, None);
                tracing::debug!(
                    expires_in_s = lifetime.as_secs(),
                    "obtained an OIDC access token"
                );
                Ok(granted.access_token)
            }
            Err(error) => {
                state.last_error = Some(error.clone());
                *lock(&self.attempts_seen) = (state.attempts, Some(error.clone()));
                if self.valid_cached(received_at).is_none() {
                    *lock(&self.status) = AuthStatus::Failing {
                        reason: error.to_string(),
                        configuration_error: error.is_configuration_error(),
                    };
                    // Returned to the caller, who reports it.
                    tracing::debug!(error = %error, "could not obtain an OIDC access token");
                } else {
                    self.postpone_early_refresh(received_at);
                    if state.last_warned.as_ref() != Some(&error) {
                        tracing::warn!(error = %error, "could not refresh the OIDC access token early; the current one is used until it expires");
                        state.last_warned = Some(error.clone());
                    } else {
                        tracing::debug!(error = %error, "could not refresh the OIDC access token early, again");
                    }
                }
                Err(error)
            }
        }
    }

    /// After a failed early refresh, the still-valid token is served without another attempt
    /// for a while (at most [`EARLY_RETRY_INTERVAL`], at most half its remaining life), so a
    /// down issuer is not asked on every engine call.
    fn postpone_early_refresh(&self, now: Instant) {
        if let Some(cached) = lock(&self.cached).as_mut()
            && now < cached.expires_at
        {
            cached.refresh_at = now + EARLY_RETRY_INTERVAL.min((cached.expires_at - now) / 2);
        }
    }

    fn attempts_now(&self) -> u64 {
        lock(&self.attempts_seen).0
    }
}

#[async_trait]
impl TokenProvider for OidcTokenProvider {
    async fn token(&self) -> Result<Secret, AuthError> {
        if let Some(token) = self.fresh_cached(Instant::now()) {
            return Ok(token);
        }
        let attempts_before_wait = self.attempts_now();
        let mut state = match self.refresh.try_lock() {
            Ok(state) => state,
            // Someone is refreshing. While the current token is still valid, use it rather
            // than wait: a slow issuer must not hold up heartbeats.
            Err(_) => match self.valid_cached(Instant::now()) {
                Some(cached) => return Ok(cached.token),
                None => self.refresh.lock().await,
            },
        };
        let now = Instant::now();
        if let Some(token) = self.fresh_cached(now) {
            return Ok(token);
        }
        match self.refresh_locked(&mut state, attempts_before_wait).await {
            Ok(token) => Ok(token),
            // A failed early refresh still leaves a valid token: use it, try again next call.
            Err(error) => match self.valid_cached(Instant::now()) {
                Some(cached) => Ok(cached.token),
                None => Err(error),
            },
        }
    }

    async fn refresh_after_rejection(&self, rejected: &Secret) -> Result<Secret, AuthError> {
        let attempts_before_wait = self.attempts_now();
        let mut state = self.refresh.lock().await;
        if let Some(cached) = self.valid_cached(Instant::now())
            && cached.token != *rejected
        {
            return Ok(cached.token);
        }
        // The engine refused the cached token: never hand it out again.
        {
            let mut cached = lock(&self.cached);
            if cached.as_ref().is_some_and(|c| c.token == *rejected) {
                *cached = None;
            }
        }
        self.refresh_locked(&mut state, attempts_before_wait).await
    }

    fn discard(&self, token: &Secret) {
        let mut cached = lock(&self.cached);
        if cached.as_ref().is_some_and(|c| c.token == *token) {
            *cached = None;
            tracing::debug!(
                "the engine refused the OIDC access token; a new one is requested at the next call"
            );
        }
    }
}

/// How long after receipt a token of `lifetime` is refreshed: `lifetime` minus max(10 s, 10 %),
/// or half the lifetime for tokens too short for that margin.
fn refresh_lead(lifetime: Duration) -> Duration {
    let margin = MIN_REFRESH_MARGIN.max(lifetime / 10);
    if lifetime > margin {
        lifetime - margin
    } else {
        lifetime / 2
    }
}

fn lock<T>(mutex: &StdMutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The guarded values are plain data replaced whole, so a poisoned lock is still consistent.
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// Our reqwest client, handed to openidconnect (the orphan rule forbids implementing its
/// `AsyncHttpClient` for `reqwest::Client` here).
struct IssuerHttpClient(reqwest::Client);

/// A failed HTTP exchange with the issuer (never includes a request or response body).
#[derive(Debug, thiserror::Error)]
enum IssuerHttpError {
    #[error("{0}")]
    Request(String),
    #[error("{0}")]
    Reqwest(#[from] reqwest::Error),
    /// A server error without an OAuth 2.0 error body (a proxy's error page, an overloaded
    /// issuer): transient, and reported with its status instead of as an unreadable body.
    #[error("HTTP status {status} from {url}")]
    ServerError {
        status: reqwest::StatusCode,
        url: String,
    },
}

impl<'c> AsyncHttpClient<'c> for IssuerHttpClient {
    type Error = IssuerHttpError;
    type Future = Pin<Box<dyn Future<Output = Result<HttpResponse, IssuerHttpError>> + Send + 'c>>;

    fn call(&'c self, request: HttpRequest) -> Self::Future {
        Box::pin(async move {
            let request: reqwest::Request = request
                .try_into()
                .map_err(|e: reqwest::Error| IssuerHttpError::Request(e.to_string()))?;
            let url = request.url().clone();
            let response = self.0.execute(request).await?;
            let json = response
                .headers()
                .get(reqwest::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.contains("json"));
            if response.status().is_server_error() && !json {
                return Err(IssuerHttpError::ServerError {
                    status: response.status(),
                    url: url.to_string(),
                });
            }
            let mut builder = http_response_builder(response.status(), response.version());
            for (name, value) in response.headers() {
                builder = builder.header(name, value);
            }
            let body = response.bytes().await?.to_vec();
            builder
                .body(body)
                .map_err(|e| IssuerHttpError::Request(e.to_string()))
        })
    }
}

fn http_response_builder(
    status: reqwest::StatusCode,
    version: reqwest::Version,
) -> openidconnect::http::response::Builder {
    openidconnect::http::Response::builder()
        .status(status)
        .version(version)
}

/// Discovery, then the client-credentials grant, over openidconnect.
struct OidcGrant {
    settings: OidcSettings,
    issuer_url: IssuerUrl,
    http: IssuerHttpClient,
    /// Filled by the first successful discovery; a failed discovery is retried at the next grant.
    discovered: StdMutex<Option<Arc<Discovered>>>,
}

struct Discovered {
    metadata: CoreProviderMetadata,
    token_url: TokenUrl,
}

impl OidcGrant {
    async fn discovered(&self) -> Result<Arc<Discovered>, AuthError> {
        if let Some(d) = lock(&self.discovered).clone() {
            return Ok(d);
        }
        let issuer = &self.settings.issuer_url;
        let metadata = CoreProviderMetadata::discover_async(self.issuer_url.clone(), &self.http)
            .await
            .map_err(|e| discovery_error(issuer, e))?;
        let token_url =
            metadata
                .token_endpoint()
                .cloned()
                .ok_or_else(|| AuthError::DiscoveryFailed {
                    issuer_url: issuer.clone(),
                    reason: "the discovery document advertises no token_endpoint".to_string(),
                })?;
        let discovered = Arc::new(Discovered {
            metadata,
            token_url,
        });
        *lock(&self.discovered) = Some(discovered.clone());
        tracing::info!(issuer = %issuer, token_endpoint = %discovered.token_url.as_str(), "OIDC discovery done");
        Ok(discovered)
    }
}

fn discovery_error(
    issuer_url: &str,
    error: openidconnect::DiscoveryError<IssuerHttpError>,
) -> AuthError {
    use openidconnect::DiscoveryError as D;
    let issuer_url = issuer_url.to_string();
    match error {
        D::Request(e) => AuthError::IssuerUnreachable {
            issuer_url,
            reason: crate::errors::chain(&e),
        },
        D::Response(_, _, message) => AuthError::DiscoveryFailed {
            issuer_url,
            reason: message,
        },
        D::Parse(e) => AuthError::DiscoveryFailed {
            issuer_url,
            reason: format!("unreadable discovery document or JWKS: {e}"),
        },
        D::Validation(message) | D::Other(message) => AuthError::DiscoveryFailed {
            issuer_url,
            reason: message,
        },
        other => AuthError::DiscoveryFailed {
            issuer_url,
            reason: other.to_string(),
        },
    }
}

#[async_trait]
impl TokenGrant for OidcGrant {
    async fn grant(&self) -> Result<GrantedToken, AuthError> {
        let discovered = self.discovered().await?;
        let secret =
            self.settings
                .client_secret
                .load()
                .map_err(|e| AuthError::SecretUnavailable {
                    reason: e.to_string(),
                })?;
        let client_id = &self.settings.client_id;
        let auth_type = match self.settings.client_auth {
            ClientAuth::Basic => AuthType::BasicAuth,
            ClientAuth::RequestBody => AuthType::RequestBody,
        };
        let client = CoreClient::from_provider_metadata(
            discovered.metadata.clone(),
            ClientId::new(client_id.clone()),
            Some(ClientSecret::new(secret.expose().to_string())),
        )
        .set_token_uri(discovered.token_url.clone())
        .set_auth_type(auth_type);
        let request = client
            .exchange_client_credentials()
            .add_scopes(self.settings.scopes.iter().cloned().map(Scope::new));
        let token_url = discovered.token_url.as_str();
        match request.request_async(&self.http).await {
            Ok(response) => Ok(GrantedToken {
                access_token: Secret::new(response.access_token().secret().clone()),
                expires_in: response.expires_in(),
            }),
            Err(RequestTokenError::ServerResponse(e)) => Err(match e.error() {
                CoreErrorResponseType::InvalidClient => AuthError::InvalidClient {
                    client_id: client_id.clone(),
                },
                code => AuthError::TokenRefused {
                    client_id: client_id.clone(),
                    error: code.as_ref().to_string(),
                    description: e
                        .error_description()
                        .map(|d| format!(": {d}"))
                        .unwrap_or_default(),
                },
            }),
            Err(RequestTokenError::Request(e)) => Err(AuthError::TokenEndpoint {
                token_url: token_url.to_string(),
                reason: crate::errors::chain(&e),
            }),
            // The body is not quoted: a success response that fails to parse holds a token.
            Err(RequestTokenError::Parse(e, _body)) => Err(AuthError::TokenEndpoint {
                token_url: token_url.to_string(),
                reason: format!("unreadable token response: {}", e.path()),
            }),
            Err(RequestTokenError::Other(message)) => Err(AuthError::TokenEndpoint {
                token_url: token_url.to_string(),
                reason: message,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// Grants `token-1`, `token-2`, ... after a short simulated round trip, or fails while
    /// `failing` is set.
    struct FakeGrant {
        grants: Arc<AtomicU64>,
        lifetime: Option<Duration>,
        failing: Arc<StdMutex<Option<AuthError>>>,
    }

    #[async_trait]
    impl TokenGrant for FakeGrant {
        async fn grant(&self) -> Result<GrantedToken, AuthError> {
            tokio::time::sleep(Duration::from_millis(50)).await;
            if let Some(e) = lock(&self.failing).clone() {
                self.grants.fetch_add(1, Ordering::SeqCst);
                return Err(e);
            }
            let n = self.grants.fetch_add(1, Ordering::SeqCst) + 1;
            Ok(GrantedToken {
                access_token: Secret::new(format!("token-{n}")),
                expires_in: self.lifetime,
            })
        }
    }

    struct Harness {
        provider: Arc<OidcTokenProvider>,
        grants: Arc<AtomicU64>,
        failing: Arc<StdMutex<Option<AuthError>>>,
    }

    fn harness(lifetime: Option<Duration>) -> Harness {
        let grants = Arc::new(AtomicU64::new(0));
        let failing = Arc::new(StdMutex::new(None));
        let provider = Arc::new(OidcTokenProvider::with_grant(Box::new(FakeGrant {
            grants: grants.clone(),
            lifetime,
            failing: failing.clone(),
        })));
        Harness {
            provider,
            grants,
            failing,
        }
    }

    async fn hundred_callers(provider: &Arc<OidcTokenProvider>) -> Vec<String> {
        let tasks: Vec<_> = (0..100)
            .map(|_| {
                let p = provider.clone();
                tokio::spawn(async move { p.token().await })
            })
            .collect();
        let mut tokens = Vec::new();
        for t in tasks {
            tokens.push(t.await.unwrap().unwrap().expose().to_string());
        }
        tokens
    }

    fn unreachable() -> AuthError {
        AuthError::IssuerUnreachable {
            issuer_url: "http://issuer".into(),
            reason: "connection refused".into(),
        }
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
        assert_eq!(h.provider.status(), AuthStatus::NotYet);

        let tokens = hundred_callers(&h.provider).await;
        assert!(tokens.iter().all(|t| t == "token-1"));
        assert_eq!(h.grants.load(Ordering::SeqCst), 1);
        assert_eq!(h.provider.status(), AuthStatus::Authenticated);

        // Refresh at 300 s - 30 s (10 %): just before, still the first token.
        tokio::time::advance(Duration::from_secs(269)).await;
        assert!(
            hundred_callers(&h.provider)
                .await
                .iter()
                .all(|t| t == "token-1")
        );
        assert_eq!(h.grants.load(Ordering::SeqCst), 1);

        // Past the refresh point: one caller refreshes; the others keep using the still-valid
        // token meanwhile instead of waiting on the issuer.
        tokio::time::advance(Duration::from_secs(2)).await;
        let tokens = hundred_callers(&h.provider).await;
        assert!(tokens.iter().all(|t| t == "token-1" || t == "token-2"));
        assert!(tokens.iter().any(|t| t == "token-2"));
        assert_eq!(h.grants.load(Ordering::SeqCst), 2);
        assert!(
            hundred_callers(&h.provider)
                .await
                .iter()
                .all(|t| t == "token-2")
        );
        assert_eq!(h.grants.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn callers_waiting_behind_a_failed_grant_share_its_error() {
        let h = harness(Some(Duration::from_secs(300)));
        *lock(&h.failing) = Some(unreachable());
        let tasks: Vec<_> = (0..100)
            .map(|_| {
                let p = h.provider.clone();
                tokio::spawn(async move { p.token().await })
            })
            .collect();
        for t in tasks {
            assert_eq!(t.await.unwrap().unwrap_err(), unreachable());
        }
        assert_eq!(h.grants.load(Ordering::SeqCst), 1);
        assert!(matches!(
            h.provider.status(),
            AuthStatus::Failing {
                configuration_error: false,
                ..
            }
        ));

        // The next call tries again.
        *lock(&h.failing) = None;
        assert_eq!(h.provider.token().await.unwrap().expose(), "token-2");
        assert_eq!(h.provider.status(), AuthStatus::Authenticated);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_early_refresh_keeps_serving_the_still_valid_token() {
        let h = harness(Some(Duration::from_secs(100)));
        assert_eq!(h.provider.token().await.unwrap().expose(), "token-1");
        *lock(&h.failing) = Some(unreachable());
        tokio::time::advance(Duration::from_secs(95)).await;
        assert_eq!(h.provider.token().await.unwrap().expose(), "token-1");
        assert_eq!(h.provider.status(), AuthStatus::Authenticated);
        assert_eq!(h.grants.load(Ordering::SeqCst), 2);
        // The next attempt waits a little (half the remaining 5 s), not every call.
        for _ in 0..10 {
            assert_eq!(h.provider.token().await.unwrap().expose(), "token-1");
        }
        assert_eq!(h.grants.load(Ordering::SeqCst), 2);
        tokio::time::advance(Duration::from_secs(3)).await;
        assert_eq!(h.provider.token().await.unwrap().expose(), "token-1");
        assert_eq!(h.grants.load(Ordering::SeqCst), 3);
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(h.provider.token().await.unwrap_err(), unreachable());
        assert!(matches!(h.provider.status(), AuthStatus::Failing { .. }));
    }

    #[tokio::test(start_paused = true)]
    async fn rejection_refreshes_once_however_many_callers_report_it() {
        let h = harness(Some(Duration::from_secs(3600)));
        let rejected = h.provider.token().await.unwrap();
        let tasks: Vec<_> = (0..20)
            .map(|_| {
                let p = h.provider.clone();
                let r = rejected.clone();
                tokio::spawn(async move { p.refresh_after_rejection(&r).await })
            })
            .collect();
        for t in tasks {
            assert_eq!(t.await.unwrap().unwrap().expose(), "token-2");
        }
        assert_eq!(h.grants.load(Ordering::SeqCst), 2);
        assert_eq!(h.provider.token().await.unwrap().expose(), "token-2");
    }

    #[tokio::test(start_paused = true)]
    async fn a_rejected_token_is_not_served_again_when_its_refresh_fails() {
        let h = harness(Some(Duration::from_secs(3600)));
        let rejected = h.provider.token().await.unwrap();
        *lock(&h.failing) = Some(unreachable());
        assert!(h.provider.refresh_after_rejection(&rejected).await.is_err());
        assert!(h.provider.token().await.is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn a_token_without_expires_in_is_refreshed_after_the_default_lifetime() {
        let h = harness(None);
        h.provider.token().await.unwrap();
        tokio::time::advance(refresh_lead(LIFETIME_WITHOUT_EXPIRY) + Duration::from_secs(1)).await;
        assert_eq!(h.provider.token().await.unwrap().expose(), "token-2");
    }

    #[tokio::test(start_paused = true)]
    async fn a_discarded_token_is_replaced_at_the_next_call_and_only_that_token() {
        let h = harness(Some(Duration::from_secs(3600)));
        let first = h.provider.token().await.unwrap();
        h.provider.discard(&Secret::new("some-other-token"));
        assert_eq!(h.provider.token().await.unwrap(), first);
        assert_eq!(h.grants.load(Ordering::SeqCst), 1);
        h.provider.discard(&first);
        assert_eq!(
            h.grants.load(Ordering::SeqCst),
            1,
            "nothing fetched until asked"
        );
        assert_eq!(h.provider.token().await.unwrap().expose(), "token-2");
    }

    /// Collects what the fmt subscriber writes.
    #[derive(Clone, Default)]
    struct Captured(Arc<StdMutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            lock(&self.0).extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Captured {
        fn warn_lines(&self) -> Vec<String> {
            String::from_utf8(lock(&self.0).clone())
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
        *lock(&h.failing) = Some(unreachable());
        for _ in 0..3 {
            assert!(h.provider.token().await.is_err());
        }
        assert!(
            captured.warn_lines().is_empty(),
            "{:?}",
            captured.warn_lines()
        );

        // A valid token hides failed early refreshes from the callers: warned once.
        *lock(&h.failing) = None;
        h.provider.token().await.unwrap();
        *lock(&h.failing) = Some(unreachable());
        tokio::time::advance(Duration::from_secs(95)).await;
        for _ in 0..3 {
            assert!(h.provider.token().await.is_ok());
        }
        assert_eq!(
            captured.warn_lines().len(),
            1,
            "{:?}",
            captured.warn_lines()
        );
        // Once expired, the failure reaches the callers again.
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(h.provider.token().await.is_err());
        assert_eq!(
            captured.warn_lines().len(),
            1,
            "{:?}",
            captured.warn_lines()
        );
    }

    #[test]
    fn errors_say_what_to_do_and_classify_themselves() {
        let e = AuthError::InvalidClient {
            client_id: "worker-1".into(),
        };
        assert_eq!(
            e.to_string().split(';').next().unwrap(),
            "the issuer rejected the client credentials for client id worker-1"
        );
        assert!(
            e.to_string()
                .contains("check ABADA_AGENT_OIDC_CLIENT_SECRET")
        );
        assert!(e.is_configuration_error());
        assert!(!unreachable().is_configuration_error());
    }

    #[test]
    fn an_invalid_issuer_url_is_refused_up_front() {
        let settings = OidcSettings::new("not a url", "c", Arc::new(SecretSource::value("s3cr3t")));
        let e = OidcTokenProvider::new(settings, reqwest::Client::builder()).unwrap_err();
        assert!(matches!(e, AuthError::InvalidIssuerUrl { .. }), "{e}");
        assert!(!format!("{e} {e:?}").contains("s3cr3t"));
    }
}
