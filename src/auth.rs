//! The worker's identity towards the engine (protocol.md A.5): an OAuth 2.0 client-credentials
//! token from the OIDC issuer, found by discovery, shared by the whole process, refreshed ahead
//! of expiry, and refreshed on demand when the engine rejects it.
//!
//! The engine client depends only on [`TokenProvider`]; [`OidcTokenProvider`] is the real one. It
//! is a [`token`] actor (which owns the token and its schedule) fed by the OIDC source defined
//! here: discovery, then the client-credentials grant of [`ClientCredentials`], which any other
//! source with a known token endpoint can reuse.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use async_trait::async_trait;
use oauth2::basic::{BasicClient, BasicErrorResponseType};
use openidconnect::core::CoreProviderMetadata;
use openidconnect::{
    AsyncHttpClient, AuthType, ClientId, ClientSecret, HttpRequest, HttpResponse, IssuerUrl,
    OAuth2TokenResponse, RequestTokenError, Scope, TokenUrl,
};

use crate::secret::{Secret, SecretSource};

pub(crate) mod token;

use token::{GrantedToken, TokenError, TokenHandle, TokenSource};

/// The scope the engine requires of a worker (protocol.md A.5).
pub(crate) const DEFAULT_SCOPE: &str = "worker:execute";

/// Bound on one discovery or token request, so a hung issuer cannot hold up a grant.
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
    /// The client secret may go to an `http://` token endpoint that is not loopback
    /// (`ABADA_AGENT_ALLOW_INSECURE_HTTP`). The issuer URL is checked with the configuration;
    /// the token endpoint is known only after discovery, so it is checked there
    /// (`crate::channel`).
    pub allow_insecure_http: bool,
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
            allow_insecure_http: false,
        }
    }
}

/// Why no token could be had. Never carries the client secret or a token, and every URL in it
/// (the issuer's, the token endpoint's, one inside a library's message) is shown through
/// [`crate::redact`]: no user information, query or fragment.
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
    /// Discovery named a token endpoint the client secret would reach in clear: nothing was
    /// sent to it.
    #[error(
        "the OIDC issuer {issuer_url} names the token endpoint {token_url} in its discovery document, and the client secret would travel there in clear (http:// to a host that is not loopback); nothing was sent to it. Make the issuer advertise an https:// token endpoint (its public URL), or set ABADA_AGENT_ALLOW_INSECURE_HTTP=true to allow it"
    )]
    InsecureTokenEndpoint {
        issuer_url: String,
        /// Redacted (no userinfo, query or fragment).
        token_url: String,
    },
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
    TokenEndpoint {
        /// Redacted ([`crate::redact::url`]).
        token_url: String,
        reason: String,
    },
    #[error("no OIDC access token: {reason}; the worker will try again")]
    Unavailable { reason: String },
}

impl AuthError {
    /// True when retrying cannot help until someone changes the configuration or the client's
    /// registration at the issuer (report not ready, log clearly, back off).
    pub fn is_configuration_error(&self) -> bool {
        match self {
            AuthError::InvalidIssuerUrl { .. }
            | AuthError::DiscoveryFailed { .. }
            | AuthError::InsecureTokenEndpoint { .. }
            | AuthError::SecretUnavailable { .. }
            | AuthError::InvalidClient { .. }
            | AuthError::TokenRefused { .. } => true,
            AuthError::IssuerUnreachable { .. }
            | AuthError::TokenEndpoint { .. }
            | AuthError::Unavailable { .. } => false,
        }
    }
}

impl TokenError for AuthError {
    fn is_configuration_error(&self) -> bool {
        AuthError::is_configuration_error(self)
    }

    fn unavailable(reason: String) -> Self {
        AuthError::Unavailable { reason }
    }
}

/// What readiness reports about authentication.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthStatus {
    /// No token has been requested yet.
    NotYet,
    /// A token is held and has not expired (a failed early refresh does not change this).
    Authenticated,
    /// No usable token: the last attempt failed, or the token expired or was refused and has
    /// not been replaced yet.
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

/// The process-wide OIDC client-credentials token: one token shared by every task, owned by a
/// [`token`] actor with the OIDC issuer as its source.
pub struct OidcTokenProvider {
    tokens: TokenHandle<AuthError>,
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
    /// Nothing is sent until the first [`TokenProvider::token`] call. Must be called within a
    /// tokio runtime (it starts the token actor).
    pub fn new(settings: OidcSettings, http: reqwest::ClientBuilder) -> Result<Self, AuthError> {
        let shown = crate::redact::url(&settings.issuer_url);
        let issuer_url = IssuerUrl::new(settings.issuer_url.clone()).map_err(|e| {
            AuthError::InvalidIssuerUrl {
                issuer_url: shown.clone(),
                reason: e.to_string(),
            }
        })?;
        let http = IssuerHttpClient::new(http).map_err(|e| AuthError::IssuerUnreachable {
            issuer_url: shown.clone(),
            reason: format!(
                "cannot build the HTTP client: {}",
                crate::redact::error_text(&e)
            ),
        })?;
        let source = OidcSource {
            grant: ClientCredentials {
                client_id: settings.client_id.clone(),
                client_secret: settings.client_secret.clone(),
                scopes: settings.scopes.clone(),
                client_auth: settings.client_auth,
                resource: None,
            },
            settings,
            issuer_url,
            http,
            discovered: StdMutex::new(None),
        };
        // Discovery and the token request, each bounded by the client's timeout.
        let tokens = token::spawn(source, 2 * ISSUER_REQUEST_TIMEOUT, "oidc");
        Ok(OidcTokenProvider { tokens })
    }

    /// For readiness: authenticated, not yet, or failing with the reason.
    pub fn status(&self) -> AuthStatus {
        self.tokens.status()
    }
}

#[async_trait]
impl TokenProvider for OidcTokenProvider {
    async fn token(&self) -> Result<Secret, AuthError> {
        self.tokens.token().await
    }

    async fn refresh_after_rejection(&self, rejected: &Secret) -> Result<Secret, AuthError> {
        self.tokens.refresh_after_rejection(rejected).await
    }

    fn discard(&self, token: &Secret) {
        self.tokens.discard(token);
    }
}

fn lock<T>(mutex: &StdMutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The guarded values are plain data replaced whole, so a poisoned lock is still consistent.
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// Our reqwest client, handed to openidconnect (the orphan rule forbids implementing its
/// `AsyncHttpClient` for `reqwest::Client` here).
pub(crate) struct IssuerHttpClient(reqwest::Client);

impl IssuerHttpClient {
    /// A client for an issuer built from `http`: redirects off (openidconnect requires it, and a
    /// client secret never follows a redirect), each request bounded by
    /// [`ISSUER_REQUEST_TIMEOUT`].
    pub(crate) fn new(http: reqwest::ClientBuilder) -> Result<Self, reqwest::Error> {
        let client = http
            .redirect(reqwest::redirect::Policy::none())
            .timeout(ISSUER_REQUEST_TIMEOUT)
            .build()?;
        Ok(IssuerHttpClient(client))
    }
}

/// A failed HTTP exchange with the issuer (never includes a request or response body).
#[derive(Debug, thiserror::Error)]
pub(crate) enum IssuerHttpError {
    #[error("{0}")]
    Request(String),
    #[error("{0}")]
    Reqwest(#[from] reqwest::Error),
    /// A document larger than the worker reads from an issuer (`body::ISSUER_DOCUMENT_MAX_BYTES`).
    #[error(transparent)]
    TooLarge(#[from] crate::body::TooLarge),
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
            let request: reqwest::Request = request.try_into().map_err(|e: reqwest::Error| {
                IssuerHttpError::Request(crate::redact::error_text(&e))
            })?;
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
                    url: crate::redact::url(url.as_str()),
                });
            }
            let mut builder = http_response_builder(response.status(), response.version());
            for (name, value) in response.headers() {
                builder = builder.header(name, value);
            }
            let what = format!("the answer of {}", crate::redact::url(url.as_str()));
            let body =
                crate::body::read_capped(response, crate::body::ISSUER_DOCUMENT_MAX_BYTES, &what)
                    .await
                    .map_err(|e| match e {
                        crate::body::ReadError::TooLarge(t) => IssuerHttpError::TooLarge(t),
                        crate::body::ReadError::Http(e) => IssuerHttpError::Reqwest(e),
                    })?;
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

/// The engine token's source: discovery (once, then cached), then the client-credentials grant
/// at the token endpoint the issuer advertises.
struct OidcSource {
    settings: OidcSettings,
    issuer_url: IssuerUrl,
    grant: ClientCredentials,
    http: IssuerHttpClient,
    /// Filled by the first successful discovery; a failed discovery is retried at the next grant.
    discovered: StdMutex<Option<TokenUrl>>,
}

impl OidcSource {
    async fn token_url(&self) -> Result<TokenUrl, AuthError> {
        if let Some(token_url) = lock(&self.discovered).clone() {
            return Ok(token_url);
        }
        let issuer = &crate::redact::url(&self.settings.issuer_url);
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
        // The client secret goes to this endpoint: the issuer URL passed the channel check with
        // the configuration, but the endpoint the issuer names may be anywhere. Checked before
        // the first token request and not cached when refused, so an issuer whose
        // configuration is fixed is used at the next grant.
        let channel = crate::channel::check(
            token_url.as_str(),
            "the OIDC client secret",
            self.settings.allow_insecure_http,
        )
        .map_err(|refused| AuthError::InsecureTokenEndpoint {
            issuer_url: issuer.clone(),
            token_url: refused.url,
        })?;
        if channel == crate::channel::Channel::Clear {
            tracing::warn!(
                issuer = %issuer,
                token_endpoint = %crate::redact::url(token_url.as_str()),
                "the OIDC client secret travels in clear to the token endpoint the issuer names (ABADA_AGENT_ALLOW_INSECURE_HTTP=true)"
            );
        }
        *lock(&self.discovered) = Some(token_url.clone());
        tracing::info!(issuer = %issuer, token_endpoint = %crate::redact::url(token_url.as_str()), "OIDC discovery done");
        Ok(token_url)
    }
}

impl TokenSource for OidcSource {
    type Error = AuthError;

    async fn fetch(&self) -> Result<GrantedToken, AuthError> {
        let token_url = self.token_url().await?;
        let client_id = &self.settings.client_id;
        self.grant
            .request(&self.http, &token_url)
            .await
            .map_err(|e| match e {
                GrantError::SecretUnavailable(reason) => AuthError::SecretUnavailable { reason },
                GrantError::InvalidClient => AuthError::InvalidClient {
                    client_id: client_id.clone(),
                },
                GrantError::Refused { error, description } => AuthError::TokenRefused {
                    client_id: client_id.clone(),
                    error,
                    description,
                },
                GrantError::Endpoint(reason) => AuthError::TokenEndpoint {
                    token_url: crate::redact::url(token_url.as_str()),
                    reason,
                },
            })
    }
}

/// The OAuth 2.0 client-credentials grant (RFC 6749 4.4) at a known token endpoint: the part
/// every token source shares (the OIDC source finds the endpoint by discovery; a source given
/// a token URL uses it directly).
pub(crate) struct ClientCredentials {
    pub(crate) client_id: String,
    /// Re-loaded at every grant, so a rotated secret file is used without a restart.
    pub(crate) client_secret: Arc<SecretSource>,
    pub(crate) scopes: Vec<String>,
    pub(crate) client_auth: ClientAuth,
    /// RFC 8707 resource indicator: the server the token is meant for, for issuers that issue
    /// tokens per audience.
    pub(crate) resource: Option<String>,
}

/// Why a token endpoint gave no token; each source words it for its operator. Never carries the
/// secret or a token.
#[derive(Debug, PartialEq)]
pub(crate) enum GrantError {
    /// The client secret could not be read.
    SecretUnavailable(String),
    /// The issuer refused the client credentials (`invalid_client`).
    InvalidClient,
    /// Another OAuth 2.0 error: its code, and `": <error_description>"` or empty.
    Refused { error: String, description: String },
    /// The request failed or the answer could not be read: transient.
    Endpoint(String),
}

impl ClientCredentials {
    /// One token request at `token_url`.
    pub(crate) async fn request(
        &self,
        http: &IssuerHttpClient,
        token_url: &TokenUrl,
    ) -> Result<GrantedToken, GrantError> {
        let secret = self
            .client_secret
            .load()
            .map_err(|e| GrantError::SecretUnavailable(e.to_string()))?;
        let auth_type = match self.client_auth {
            ClientAuth::Basic => AuthType::BasicAuth,
            ClientAuth::RequestBody => AuthType::RequestBody,
        };
        let client = BasicClient::new(ClientId::new(self.client_id.clone()))
            .set_client_secret(ClientSecret::new(secret.expose().to_string()))
            .set_token_uri(token_url.clone())
            .set_auth_type(auth_type);
        let mut request = client
            .exchange_client_credentials()
            .add_scopes(self.scopes.iter().cloned().map(Scope::new));
        if let Some(resource) = &self.resource {
            request = request.add_extra_param("resource", resource.clone());
        }
        match request.request_async(http).await {
            Ok(response) => Ok(GrantedToken {
                access_token: Secret::new(response.access_token().secret().clone()),
                expires_in: response.expires_in(),
            }),
            Err(RequestTokenError::ServerResponse(e)) => Err(match e.error() {
                BasicErrorResponseType::InvalidClient => GrantError::InvalidClient,
                code => GrantError::Refused {
                    error: code.as_ref().to_string(),
                    description: e
                        .error_description()
                        .map(|d| format!(": {d}"))
                        .unwrap_or_default(),
                },
            }),
            // reqwest writes the token URL, query included, into its message.
            Err(RequestTokenError::Request(e)) => {
                Err(GrantError::Endpoint(crate::redact::error_text(&e)))
            }
            // The body is not quoted: a success response that fails to parse holds a token.
            Err(RequestTokenError::Parse(e, _body)) => Err(GrantError::Endpoint(format!(
                "unreadable token response: {}",
                e.path()
            ))),
            Err(RequestTokenError::Other(message)) => {
                Err(GrantError::Endpoint(crate::redact::text(&message)))
            }
        }
    }
}

/// A failed discovery at `issuer_url` (already redacted). openidconnect's messages quote URLs
/// (the issuer it expected and the one advertised, the JWKS URL): every reason goes through
/// [`crate::redact`].
fn discovery_error(
    issuer_url: &str,
    error: openidconnect::DiscoveryError<IssuerHttpError>,
) -> AuthError {
    use openidconnect::DiscoveryError as D;
    let issuer_url = issuer_url.to_string();
    match error {
        D::Request(e) => AuthError::IssuerUnreachable {
            issuer_url,
            reason: crate::redact::error_text(&e),
        },
        D::Response(_, _, message) => AuthError::DiscoveryFailed {
            issuer_url,
            reason: crate::redact::text(&message),
        },
        D::Parse(e) => AuthError::DiscoveryFailed {
            issuer_url,
            reason: crate::redact::text(&format!("unreadable discovery document or JWKS: {e}")),
        },
        D::Validation(message) | D::Other(message) => AuthError::DiscoveryFailed {
            issuer_url,
            reason: crate::redact::text(&message),
        },
        other => AuthError::DiscoveryFailed {
            issuer_url,
            reason: crate::redact::error_text(&other),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// What the in-process token endpoint received.
    #[derive(Debug, Default, Clone)]
    struct Received {
        form: HashMap<String, String>,
        authorization: Option<String>,
    }

    /// A token endpoint on 127.0.0.1 that records each request and answers with `answer`.
    async fn token_endpoint(
        answer: (u16, serde_json::Value),
    ) -> (TokenUrl, Arc<StdMutex<Vec<Received>>>) {
        use axum::http::{HeaderMap, StatusCode};
        let received = Arc::new(StdMutex::new(Vec::new()));
        let log = received.clone();
        let router = axum::Router::new().route(
            "/token",
            axum::routing::post(move |headers: HeaderMap, body: String| async move {
                let form = reqwest::Url::parse(&format!("http://x/?{body}"))
                    .unwrap()
                    .query_pairs()
                    .map(|(k, v)| (k.into_owned(), v.into_owned()))
                    .collect();
                let authorization = headers
                    .get("authorization")
                    .map(|v| v.to_str().unwrap().to_string());
                lock(&log).push(Received {
                    form,
                    authorization,
                });
                (
                    StatusCode::from_u16(answer.0).unwrap(),
                    axum::Json(answer.1.clone()),
                )
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/token", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, router).await });
        (TokenUrl::new(url).unwrap(), received)
    }

    fn grant(client_auth: ClientAuth, resource: Option<&str>) -> ClientCredentials {
        ClientCredentials {
            client_id: "tool-client".into(),
            client_secret: Arc::new(SecretSource::value("s3cr3t")),
            scopes: vec!["orders:read".into(), "orders:write".into()],
            client_auth,
            resource: resource.map(str::to_string),
        }
    }

    fn http() -> IssuerHttpClient {
        IssuerHttpClient::new(reqwest::Client::builder()).unwrap()
    }

    #[tokio::test]
    async fn the_grant_sends_scopes_the_resource_and_either_client_authentication() {
        let granted = serde_json::json!({
            "access_token": "opaque-1", "token_type": "Bearer", "expires_in": 120
        });
        let (token_url, received) = token_endpoint((200, granted)).await;
        for (client_auth, resource) in [
            (ClientAuth::Basic, Some("https://orders-mcp:8080/mcp")),
            (ClientAuth::RequestBody, None),
        ] {
            let token = grant(client_auth, resource)
                .request(&http(), &token_url)
                .await
                .unwrap();
            assert_eq!(token.access_token.expose(), "opaque-1");
            assert_eq!(token.expires_in, Some(Duration::from_secs(120)));
            let seen = lock(&received).pop().unwrap();
            assert_eq!(seen.form["grant_type"], "client_credentials");
            assert_eq!(seen.form["scope"], "orders:read orders:write");
            assert_eq!(seen.form.get("resource").map(String::as_str), resource);
            match client_auth {
                ClientAuth::Basic => {
                    assert!(seen.authorization.unwrap().starts_with("Basic "));
                    assert!(!seen.form.contains_key("client_secret"));
                }
                ClientAuth::RequestBody => {
                    assert_eq!(seen.authorization, None);
                    assert_eq!(seen.form["client_id"], "tool-client");
                    assert_eq!(seen.form["client_secret"], "s3cr3t");
                }
            }
        }
    }

    #[tokio::test]
    async fn the_grant_types_the_issuers_refusals_without_quoting_secrets() {
        let (token_url, _) =
            token_endpoint((401, serde_json::json!({"error": "invalid_client"}))).await;
        let e = grant(ClientAuth::Basic, None)
            .request(&http(), &token_url)
            .await
            .unwrap_err();
        assert_eq!(e, GrantError::InvalidClient);

        let refused =
            serde_json::json!({"error": "invalid_scope", "error_description": "no such scope"});
        let (token_url, _) = token_endpoint((400, refused)).await;
        let e = grant(ClientAuth::Basic, None)
            .request(&http(), &token_url)
            .await
            .unwrap_err();
        assert_eq!(
            e,
            GrantError::Refused {
                error: "invalid_scope".into(),
                description: ": no such scope".into()
            }
        );

        // A success answer that cannot be read holds a token: it is never quoted.
        let unreadable = serde_json::json!({"access_token": "opaque-secret-token"});
        let (token_url, _) = token_endpoint((200, unreadable)).await;
        let e = grant(ClientAuth::Basic, None)
            .request(&http(), &token_url)
            .await
            .unwrap_err();
        assert!(matches!(&e, GrantError::Endpoint(_)), "{e:?}");
        assert!(!format!("{e:?}").contains("opaque-secret-token"), "{e:?}");
        assert!(!format!("{e:?}").contains("s3cr3t"), "{e:?}");
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
        let unreachable = AuthError::IssuerUnreachable {
            issuer_url: "http://issuer".into(),
            reason: "connection refused".into(),
        };
        assert!(!unreachable.is_configuration_error());
        let unavailable = <AuthError as TokenError>::unavailable("no token within 61 s".into());
        assert!(!unavailable.is_configuration_error());
        assert!(
            unavailable
                .to_string()
                .contains("the worker will try again")
        );
    }

    #[test]
    fn an_invalid_issuer_url_is_refused_up_front() {
        let settings = OidcSettings::new("not a url", "c", Arc::new(SecretSource::value("s3cr3t")));
        let e = OidcTokenProvider::new(settings, reqwest::Client::builder()).unwrap_err();
        assert!(matches!(e, AuthError::InvalidIssuerUrl { .. }), "{e}");
        assert!(!format!("{e} {e:?}").contains("s3cr3t"));
    }
}
