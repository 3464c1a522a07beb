//! Bearer-token checks for the engine emulator's secured mode (protocol.md A.5): an OIDC JWT
//! signed by the configured issuer, unexpired, whose scope holds `worker:execute` or whose groups
//! hold `abada-worker`. Keys come from the issuer's JWKS (found by discovery), fetched up front so
//! checks are synchronous, and fetched again when a token names a key we do not know.
//!
//! [`JwtValidator`] is an [`Authorizer`]: put it in `EmulatorOptions::authorizer` (or
//! `StackOptions::authorizer`) to run the emulator as a secured engine.

use std::sync::{Arc, Mutex as StdMutex, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::jwk::Jwk;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde_json::{Map, Value};
use tokio::time::Instant;

use super::engine::{AuthRejection, Authorizer, HeaderMap};

/// The scope a worker's token must carry (in `scope` or `scp`).
pub const REQUIRED_SCOPE: &str = "worker:execute";
/// The group that grants the same right (in `groups`).
pub const REQUIRED_GROUP: &str = "abada-worker";

/// Clock skew tolerated on `exp` and `nbf`.
const LEEWAY_SECS: u64 = 30;
/// At most one JWKS refetch per interval, so tokens with made-up key ids cannot make us hammer
/// the issuer.
const MIN_REFETCH_INTERVAL: Duration = Duration::from_secs(10);
/// Bound on one discovery or JWKS request.
const FETCH_TIMEOUT: Duration = Duration::from_secs(10);

/// Signature algorithms accepted; symmetric ones never are (the key set is public).
const ACCEPTED_ALGORITHMS: &[Algorithm] = &[
    Algorithm::RS256,
    Algorithm::RS384,
    Algorithm::RS512,
    Algorithm::PS256,
    Algorithm::PS384,
    Algorithm::PS512,
    Algorithm::ES256,
    Algorithm::ES384,
    Algorithm::EdDSA,
];

/// Why a request is refused; the reason never quotes the token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JwtRejection {
    /// Missing, malformed, badly signed, expired or foreign token: 401 `AUTHENTICATION_REQUIRED`.
    #[error("authentication required: {0}")]
    Unauthenticated(String),
    /// A valid token without the right: 403 `ACCESS_DENIED`.
    #[error("access denied: {0}")]
    AccessDenied(String),
}

/// Why the validator could not be set up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JwtSetupError {
    #[error(
        "cannot fetch {url} from the OIDC issuer {issuer}: {reason}; check the issuer URL and that it is running"
    )]
    Fetch {
        issuer: String,
        url: String,
        reason: String,
    },
    #[error("the discovery document of {issuer} is unusable: {reason}")]
    Discovery { issuer: String, reason: String },
    #[error(
        "the issuer at {configured} calls itself {advertised}; configure the issuer URL exactly as it advertises itself"
    )]
    IssuerMismatch {
        configured: String,
        advertised: String,
    },
    #[error("the key set at {jwks_uri} holds no usable signature key (RSA, EC or Ed25519)")]
    NoUsableKey { jwks_uri: String },
}

/// What a valid token says about its holder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claims {
    pub subject: Option<String>,
    /// `client_id`, or `azp` when the issuer uses that.
    pub client_id: Option<String>,
    /// From `scope` (space-separated) and `scp` (array or string).
    pub scopes: Vec<String>,
    pub groups: Vec<String>,
    /// `exp`, seconds since the Unix epoch.
    pub expires_at: u64,
}

/// Checks bearer tokens against one issuer. Cheap to clone; clones share the key cache.
#[derive(Clone)]
pub struct JwtValidator {
    inner: Arc<Inner>,
}

struct Inner {
    issuer: String,
    jwks_uri: String,
    http: reqwest::Client,
    keys: RwLock<Arc<Vec<VerificationKey>>>,
    /// When the key set was last refetched (the initial load does not count, so the first key
    /// rotation is picked up at once).
    last_refetch: StdMutex<Option<Instant>>,
    /// One refetch at a time.
    refetching: tokio::sync::Mutex<()>,
}

struct VerificationKey {
    kid: Option<String>,
    /// The JWK's `alg`, when it pins one.
    alg: Option<Algorithm>,
    key: DecodingKey,
}

impl std::fmt::Debug for JwtValidator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JwtValidator")
            .field("issuer", &self.inner.issuer)
            .field("jwks_uri", &self.inner.jwks_uri)
            .finish_non_exhaustive()
    }
}

/// Outcome of a check that may need keys we do not have yet.
enum Checked {
    Done(Result<Claims, JwtRejection>),
    UnknownKey(String),
}

impl JwtValidator {
    /// Discovers `issuer` (its `jwks_uri`) and fetches its keys. `http` should trust what the worker trusts
    /// (the worker's `tls::http_client_builder`).
    pub async fn load(
        issuer: impl Into<String>,
        http: reqwest::ClientBuilder,
    ) -> Result<Self, JwtSetupError> {
        let issuer = issuer.into();
        let http = http
            .redirect(reqwest::redirect::Policy::none())
            .timeout(FETCH_TIMEOUT)
            .build()
            .map_err(|e| JwtSetupError::Fetch {
                issuer: issuer.clone(),
                url: issuer.clone(),
                reason: format!("cannot build the HTTP client: {e}"),
            })?;
        let discovery_url = format!(
            "{}/.well-known/openid-configuration",
            issuer.trim_end_matches('/')
        );
        let document = fetch_json(&http, &issuer, &discovery_url).await?;
        let advertised = document.get("issuer").and_then(Value::as_str).unwrap_or("");
        if advertised != issuer {
            return Err(JwtSetupError::IssuerMismatch {
                configured: issuer,
                advertised: advertised.to_string(),
            });
        }
        let jwks_uri = document
            .get("jwks_uri")
            .and_then(Value::as_str)
            .ok_or_else(|| JwtSetupError::Discovery {
                issuer: issuer.clone(),
                reason: "it has no jwks_uri".to_string(),
            })?
            .to_string();
        let keys = fetch_keys(&http, &issuer, &jwks_uri).await?;
        Ok(JwtValidator {
            inner: Arc::new(Inner {
                issuer,
                jwks_uri,
                http,
                keys: RwLock::new(Arc::new(keys)),
                last_refetch: StdMutex::new(None),
                refetching: tokio::sync::Mutex::new(()),
            }),
        })
    }

    /// The issuer tokens must come from.
    pub fn issuer(&self) -> &str {
        &self.inner.issuer
    }

    /// Checks an `Authorization` header value, refetching the key set once if the token names a
    /// key we do not know (rate-limited).
    pub async fn validate(&self, authorization: Option<&str>) -> Result<Claims, JwtRejection> {
        let now = SystemTime::now();
        match self.check(authorization, now) {
            Checked::Done(result) => result,
            Checked::UnknownKey(kid) => {
                if self.refetch_keys().await {
                    match self.check(authorization, now) {
                        Checked::Done(result) => result,
                        Checked::UnknownKey(kid) => Err(unknown_key(&kid)),
                    }
                } else {
                    Err(unknown_key(&kid))
                }
            }
        }
    }

    /// Synchronous check with the keys at hand, for the emulator's request hook. A token naming
    /// an unknown key is refused (401) and starts a background refetch, so the worker's one retry
    /// after refreshing its token usually passes.
    pub fn validate_header(&self, authorization: Option<&str>) -> Result<Claims, JwtRejection> {
        self.validate_header_at(authorization, SystemTime::now())
    }

    /// [`validate_header`](Self::validate_header) as if the time were `now` (tests, replays).
    pub fn validate_header_at(
        &self,
        authorization: Option<&str>,
        now: SystemTime,
    ) -> Result<Claims, JwtRejection> {
        match self.check(authorization, now) {
            Checked::Done(result) => result,
            Checked::UnknownKey(kid) => {
                if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                    let me = self.clone();
                    runtime.spawn(async move { me.refetch_keys().await });
                }
                Err(unknown_key(&kid))
            }
        }
    }

    /// Checks the `Authorization` header of a request.
    pub fn validate_headers(
        &self,
        headers: &axum::http::HeaderMap,
    ) -> Result<Claims, JwtRejection> {
        let mut values = headers.get_all(axum::http::header::AUTHORIZATION).iter();
        let value = values.next();
        if values.next().is_some() {
            return Err(JwtRejection::Unauthenticated(
                "more than one Authorization header".to_string(),
            ));
        }
        match value.map(|v| v.to_str()) {
            None => self.validate_header(None),
            Some(Ok(v)) => self.validate_header(Some(v)),
            Some(Err(_)) => Err(JwtRejection::Unauthenticated(
                "the Authorization header is not visible ASCII".to_string(),
            )),
        }
    }

    /// Fetches the key set again unless that happened less than [`MIN_REFETCH_INTERVAL`] ago;
    /// true when new keys were installed.
    async fn refetch_keys(&self) -> bool {
        let _one_at_a_time = self.inner.refetching.lock().await;
        {
            let mut last = lock(&self.inner.last_refetch);
            if last.is_some_and(|at| at.elapsed() < MIN_REFETCH_INTERVAL) {
                return false;
            }
            *last = Some(Instant::now());
        }
        match fetch_keys(&self.inner.http, &self.inner.issuer, &self.inner.jwks_uri).await {
            Ok(keys) => {
                *self.inner.keys.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(keys);
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not refetch the issuer's keys");
                false
            }
        }
    }

    fn check(&self, authorization: Option<&str>, now: SystemTime) -> Checked {
        let token = match bearer_token(authorization) {
            Ok(t) => t,
            Err(r) => return Checked::Done(Err(r)),
        };
        let header = match jsonwebtoken::decode_header(token) {
            Ok(h) => h,
            Err(e) => return Checked::Done(Err(unauthenticated("malformed token", &e))),
        };
        if !ACCEPTED_ALGORITHMS.contains(&header.alg) {
            return Checked::Done(Err(JwtRejection::Unauthenticated(format!(
                "signature algorithm {:?} is not accepted",
                header.alg
            ))));
        }
        let keys = self
            .inner
            .keys
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let candidates: Vec<&VerificationKey> = keys
            .iter()
            .filter(|k| match (&header.kid, &k.kid) {
                (Some(wanted), Some(kid)) => wanted == kid,
                (Some(_), None) => false,
                (None, _) => true,
            })
            .filter(|k| k.alg.is_none_or(|a| a == header.alg))
            .filter(|k| k.key.family() == header.alg.family())
            .collect();
        if candidates.is_empty() {
            return match header.kid {
                Some(kid) => Checked::UnknownKey(kid),
                None => Checked::Done(Err(JwtRejection::Unauthenticated(format!(
                    "no key of the issuer fits a {:?} token without a key id",
                    header.alg
                )))),
            };
        }
        let mut validation = Validation::new(header.alg);
        validation.validate_exp = false; // checked below against `now`
        validation.validate_nbf = false;
        validation.validate_aud = false;
        validation.set_issuer(&[&self.inner.issuer]);
        validation.set_required_spec_claims(&["exp", "iss"]);
        let mut last_error = None;
        for candidate in candidates {
            match jsonwebtoken::decode::<Map<String, Value>>(token, &candidate.key, &validation) {
                Ok(data) => {
                    return Checked::Done(authorize(data.claims, now, &self.inner.issuer));
                }
                Err(e) => last_error = Some(e),
            }
        }
        let error = last_error.expect("at least one candidate key was tried");
        Checked::Done(Err(match error.kind() {
            ErrorKind::InvalidSignature => {
                JwtRejection::Unauthenticated("the token's signature does not verify".to_string())
            }
            ErrorKind::InvalidIssuer => JwtRejection::Unauthenticated(format!(
                "the token was not issued by {}",
                self.inner.issuer
            )),
            ErrorKind::MissingRequiredClaim(claim) => {
                JwtRejection::Unauthenticated(format!("the token has no `{claim}` claim"))
            }
            _ => unauthenticated("invalid token", &error),
        }))
    }
}

impl From<JwtRejection> for AuthRejection {
    fn from(rejection: JwtRejection) -> Self {
        match rejection {
            JwtRejection::Unauthenticated(m) => AuthRejection::Unauthenticated(m),
            JwtRejection::AccessDenied(m) => AuthRejection::AccessDenied(m),
        }
    }
}

/// The emulator's secured mode: every `/api` request must carry a bearer JWT from this issuer
/// with the worker right; refusals become 401 `AUTHENTICATION_REQUIRED` or 403 `ACCESS_DENIED`
/// with the engine's error body.
impl Authorizer for JwtValidator {
    fn authorize(&self, headers: &HeaderMap) -> Result<(), AuthRejection> {
        self.validate_headers(headers)
            .map(|_| ())
            .map_err(AuthRejection::from)
    }
}

/// Time and right checks on a token whose signature and issuer are good.
fn authorize(
    claims: Map<String, Value>,
    now: SystemTime,
    issuer: &str,
) -> Result<Claims, JwtRejection> {
    let now = now
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let expires_at = numeric(&claims, "exp").ok_or_else(|| {
        JwtRejection::Unauthenticated("the token's `exp` is not a number".to_string())
    })?;
    if expires_at + LEEWAY_SECS <= now {
        return Err(JwtRejection::Unauthenticated(format!(
            "the token expired {} s ago; get a new one",
            now - expires_at
        )));
    }
    if let Some(not_before) = numeric(&claims, "nbf")
        && not_before > now + LEEWAY_SECS
    {
        return Err(JwtRejection::Unauthenticated(format!(
            "the token is not valid before {not_before} (now is {now})"
        )));
    }
    let mut scopes: Vec<String> = strings(claims.get("scope"));
    scopes.extend(strings(claims.get("scp")));
    let groups = strings(claims.get("groups"));
    let text = |name: &str| claims.get(name).and_then(Value::as_str).map(str::to_string);
    let result = Claims {
        subject: text("sub"),
        client_id: text("client_id").or_else(|| text("azp")),
        scopes,
        groups,
        expires_at,
    };
    if result.scopes.iter().any(|s| s == REQUIRED_SCOPE)
        || result.groups.iter().any(|g| g == REQUIRED_GROUP)
    {
        Ok(result)
    } else {
        Err(JwtRejection::AccessDenied(format!(
            "the token from {issuer} for {} has neither scope {REQUIRED_SCOPE} nor group {REQUIRED_GROUP}",
            result
                .client_id
                .as_deref()
                .or(result.subject.as_deref())
                .unwrap_or("an unnamed client")
        )))
    }
}

fn numeric(claims: &Map<String, Value>, name: &str) -> Option<u64> {
    let value = claims.get(name)?;
    value
        .as_u64()
        .or_else(|| value.as_f64().filter(|f| *f >= 0.0).map(|f| f as u64))
}

/// A space-separated string or an array of strings; anything else counts as nothing.
fn strings(value: Option<&Value>) -> Vec<String> {
    match value {
        Some(Value::String(s)) => s.split_whitespace().map(str::to_string).collect(),
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(Value::as_str)
            .map(str::to_string)
            .collect(),
        _ => Vec::new(),
    }
}

fn bearer_token(authorization: Option<&str>) -> Result<&str, JwtRejection> {
    let value = authorization.ok_or_else(|| {
        JwtRejection::Unauthenticated(
            "no Authorization header; send Authorization: Bearer <token>".to_string(),
        )
    })?;
    let (scheme, token) = value.trim().split_once(' ').ok_or_else(|| {
        JwtRejection::Unauthenticated(
            "the Authorization header is not of the form Bearer <token>".to_string(),
        )
    })?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Err(JwtRejection::Unauthenticated(
            "the Authorization scheme is not Bearer".to_string(),
        ));
    }
    let token = token.trim();
    if token.is_empty() {
        return Err(JwtRejection::Unauthenticated(
            "the bearer token is empty".to_string(),
        ));
    }
    Ok(token)
}

fn unauthenticated(what: &str, error: &jsonwebtoken::errors::Error) -> JwtRejection {
    JwtRejection::Unauthenticated(format!("{what}: {error}"))
}

fn unknown_key(kid: &str) -> JwtRejection {
    JwtRejection::Unauthenticated(format!(
        "the token is signed with key id {kid:?}, which the issuer does not publish"
    ))
}

async fn fetch_json(
    http: &reqwest::Client,
    issuer: &str,
    url: &str,
) -> Result<Value, JwtSetupError> {
    let fail = |reason: String| JwtSetupError::Fetch {
        issuer: issuer.to_string(),
        url: url.to_string(),
        reason,
    };
    let response = http
        .get(url)
        .header(reqwest::header::ACCEPT, "application/json")
        .send()
        .await
        .map_err(|e| fail(error_text(&e)))?;
    let status = response.status();
    if !status.is_success() {
        return Err(fail(format!("HTTP status {status}")));
    }
    response
        .json::<Value>()
        .await
        .map_err(|e| fail(format!("not JSON: {}", error_text(&e))))
}

async fn fetch_keys(
    http: &reqwest::Client,
    issuer: &str,
    jwks_uri: &str,
) -> Result<Vec<VerificationKey>, JwtSetupError> {
    let document = fetch_json(http, issuer, jwks_uri).await?;
    let keys = parse_key_set(&document);
    if keys.is_empty() {
        return Err(JwtSetupError::NoUsableKey {
            jwks_uri: jwks_uri.to_string(),
        });
    }
    Ok(keys)
}

/// The signature keys of a JWKS document; keys we cannot use (encryption keys, unknown types)
/// are skipped rather than failing the whole set.
fn parse_key_set(document: &Value) -> Vec<VerificationKey> {
    let Some(entries) = document.get("keys").and_then(Value::as_array) else {
        return Vec::new();
    };
    entries
        .iter()
        .filter(|entry| {
            entry
                .get("use")
                .and_then(Value::as_str)
                .is_none_or(|u| u == "sig")
        })
        .filter_map(|entry| serde_json::from_value::<Jwk>(entry.clone()).ok())
        .filter_map(|jwk| {
            let alg = match jwk.common.key_algorithm {
                None => None,
                Some(a) => Some(format!("{a:?}").parse::<Algorithm>().ok()?),
            };
            let key = DecodingKey::from_jwk(&jwk).ok()?;
            Some(VerificationKey {
                kid: jwk.common.key_id.clone(),
                alg,
                key,
            })
        })
        .collect()
}

/// An error and its sources on one line: the devkit's own copy of the worker's `errors::chain`
/// (this crate cannot depend on the worker).
fn error_text(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

fn lock<T>(mutex: &StdMutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use jsonwebtoken::{EncodingKey, Header};
    use serde_json::json;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct SigningKey {
        kid: String,
        key: EncodingKey,
        jwk: Value,
    }

    fn signing_key(kid: &str) -> SigningKey {
        let pair = rcgen::KeyPair::generate().unwrap();
        let key = EncodingKey::from_ec_der(&pair.serialize_der());
        let mut jwk = Jwk::from_encoding_key(&key, Algorithm::ES256).unwrap();
        jwk.common.key_id = Some(kid.to_string());
        SigningKey {
            kid: kid.to_string(),
            key,
            jwk: serde_json::to_value(jwk).unwrap(),
        }
    }

    fn sign(key: &SigningKey, claims: &Value) -> String {
        let mut header = Header::new(Algorithm::ES256);
        header.kid = Some(key.kid.clone());
        jsonwebtoken::encode(&header, claims, &key.key).unwrap()
    }

    /// Discovery and a JWKS that tests can rotate, on 127.0.0.1.
    struct TestIssuer {
        url: String,
        jwks: Arc<StdMutex<Value>>,
        jwks_fetches: Arc<AtomicUsize>,
    }

    async fn test_issuer(keys: &[&SigningKey]) -> TestIssuer {
        use axum::routing::get;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let jwks = Arc::new(StdMutex::new(
            json!({"keys": keys.iter().map(|k| k.jwk.clone()).collect::<Vec<_>>()}),
        ));
        let jwks_fetches = Arc::new(AtomicUsize::new(0));
        let discovery = json!({"issuer": url, "jwks_uri": format!("{url}/jwks")});
        let (jwks_state, fetches) = (jwks.clone(), jwks_fetches.clone());
        let router = axum::Router::new()
            .route(
                "/.well-known/openid-configuration",
                get(move || async move { axum::Json(discovery) }),
            )
            .route(
                "/jwks",
                get(move || async move {
                    fetches.fetch_add(1, Ordering::SeqCst);
                    axum::Json(lock(&jwks_state).clone())
                }),
            );
        tokio::spawn(async move { axum::serve(listener, router).await });
        TestIssuer {
            url,
            jwks,
            jwks_fetches,
        }
    }

    fn unix_now() -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs()
    }

    fn claims(issuer: &str, extra: Value) -> Value {
        let mut c =
            json!({"iss": issuer, "sub": "worker-1", "exp": unix_now() + 600, "iat": unix_now()});
        c.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        c
    }

    async fn setup() -> (TestIssuer, SigningKey, JwtValidator) {
        let key = signing_key("k1");
        let issuer = test_issuer(&[&key]).await;
        let validator = JwtValidator::load(&issuer.url, reqwest::Client::builder())
            .await
            .unwrap();
        (issuer, key, validator)
    }

    fn bearer(token: &str) -> String {
        format!("Bearer {token}")
    }

    #[tokio::test]
    async fn grants_the_scope_or_the_group() {
        let (issuer, key, v) = setup().await;
        let t = sign(
            &key,
            &claims(&issuer.url, json!({"scope": "openid worker:execute"})),
        );
        let c = v.validate_header(Some(&bearer(&t))).unwrap();
        assert_eq!(c.subject.as_deref(), Some("worker-1"));
        assert_eq!(c.scopes, ["openid", "worker:execute"]);

        let t = sign(
            &key,
            &claims(&issuer.url, json!({"scp": ["worker:execute"]})),
        );
        v.validate_header(Some(&bearer(&t))).unwrap();
        let t = sign(
            &key,
            &claims(&issuer.url, json!({"groups": ["abada-worker"]})),
        );
        v.validate(Some(&bearer(&t))).await.unwrap();
    }

    #[tokio::test]
    async fn a_valid_token_without_the_right_is_access_denied() {
        let (issuer, key, v) = setup().await;
        let t = sign(
            &key,
            &claims(
                &issuer.url,
                json!({"scope": "openid", "groups": ["ops"], "client_id": "c9"}),
            ),
        );
        let r = v.validate_header(Some(&bearer(&t))).unwrap_err();
        assert!(
            matches!(&r, JwtRejection::AccessDenied(m) if m.contains("c9")),
            "{r}"
        );
    }

    #[tokio::test]
    async fn bad_tokens_are_unauthenticated_and_never_quoted() {
        let (issuer, key, v) = setup().await;
        let good = sign(
            &key,
            &claims(&issuer.url, json!({"scope": "worker:execute"})),
        );
        let expired = sign(
            &key,
            &claims(
                &issuer.url,
                json!({"scope": "worker:execute", "exp": unix_now() - 120}),
            ),
        );
        let early = sign(
            &key,
            &claims(
                &issuer.url,
                json!({"scope": "worker:execute", "nbf": unix_now() + 600}),
            ),
        );
        let foreign = sign(
            &key,
            &claims("http://elsewhere", json!({"scope": "worker:execute"})),
        );
        let mut parts: Vec<&str> = good.split('.').collect();
        let forged_payload = jsonwebtoken_payload(&claims(
            &issuer.url,
            json!({"scope": "worker:execute", "sub": "admin"}),
        ));
        parts[1] = &forged_payload;
        let tampered = parts.join(".");
        let other_key = signing_key("k1");
        let wrong_signer = sign(
            &other_key,
            &claims(&issuer.url, json!({"scope": "worker:execute"})),
        );

        for (name, header) in [
            ("missing", None),
            ("basic", Some("Basic dXNlcjpwYXNz".to_string())),
            ("empty", Some("Bearer ".to_string())),
            ("garbage", Some(bearer("not.a.jwt"))),
            ("expired", Some(bearer(&expired))),
            ("not yet valid", Some(bearer(&early))),
            ("foreign issuer", Some(bearer(&foreign))),
            ("tampered", Some(bearer(&tampered))),
            ("wrong signer", Some(bearer(&wrong_signer))),
        ] {
            let r = v.validate_header(header.as_deref()).unwrap_err();
            assert!(matches!(r, JwtRejection::Unauthenticated(_)), "{name}: {r}");
            assert!(
                !r.to_string().contains(&good[..20]),
                "{name} quotes the token: {r}"
            );
        }
        // The same good token expires as the clock passes `exp` plus leeway.
        let later = SystemTime::now() + Duration::from_secs(600 + LEEWAY_SECS + 1);
        assert!(matches!(
            v.validate_header_at(Some(&bearer(&good)), later),
            Err(JwtRejection::Unauthenticated(_))
        ));
    }

    fn jsonwebtoken_payload(claims: &Value) -> String {
        // Re-sign with a throwaway key and keep only the payload segment.
        let t = sign(&signing_key("x"), claims);
        t.split('.').nth(1).unwrap().to_string()
    }

    #[tokio::test]
    async fn an_unknown_key_id_refetches_the_key_set_at_most_once_per_interval() {
        let (issuer, old, v) = setup().await;
        assert_eq!(issuer.jwks_fetches.load(Ordering::SeqCst), 1);
        let new = signing_key("k2");
        *lock(&issuer.jwks) = json!({"keys": [old.jwk, new.jwk]});
        let t = sign(
            &new,
            &claims(&issuer.url, json!({"scope": "worker:execute"})),
        );
        v.validate(Some(&bearer(&t))).await.unwrap();
        assert_eq!(issuer.jwks_fetches.load(Ordering::SeqCst), 2);

        let stranger = signing_key("k3");
        let t = sign(
            &stranger,
            &claims(&issuer.url, json!({"scope": "worker:execute"})),
        );
        let r = v.validate(Some(&bearer(&t))).await.unwrap_err();
        assert!(r.to_string().contains("k3"), "{r}");
        assert_eq!(issuer.jwks_fetches.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn the_sync_check_refuses_an_unknown_key_and_fetches_it_in_the_background() {
        let (issuer, old, v) = setup().await;
        let new = signing_key("k2");
        *lock(&issuer.jwks) = json!({"keys": [old.jwk, new.jwk]});
        let t = sign(
            &new,
            &claims(&issuer.url, json!({"scope": "worker:execute"})),
        );
        assert!(v.validate_header(Some(&bearer(&t))).is_err());
        // Wait (bounded) for the background refetch to land; no timing is asserted.
        for _ in 0..500 {
            if v.validate_header(Some(&bearer(&t))).is_ok() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the background refetch never installed key k2");
    }

    #[tokio::test]
    async fn load_refuses_an_issuer_that_calls_itself_otherwise() {
        let key = signing_key("k1");
        let issuer = test_issuer(&[&key]).await;
        let e = JwtValidator::load(format!("{}/", issuer.url), reqwest::Client::builder())
            .await
            .unwrap_err();
        assert!(matches!(e, JwtSetupError::IssuerMismatch { .. }), "{e}");
    }
}
