//! OIDC: the worker's token provider and the devkit's JWT validator against oauth2-mock-server
//! (a real issuer with real keys, installed by `scripts/install-oidc-peer`), plus error mapping
//! against small in-process issuers where the mock cannot misbehave on demand (it accepts any
//! client secret).

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use abada_agent_worker::auth::{
    AuthError, AuthStatus, ClientAuth, OidcSettings, OidcTokenProvider, TokenProvider,
};
use abada_agent_worker::devkit::jwt::{JwtRejection, JwtValidator};
use abada_agent_worker::secret::SecretSource;
use axum::http::{HeaderMap, StatusCode};
use serde_json::{Value, json};

use crate::support::net::refusing_address;
use crate::support::peers::mock_issuer;

fn provider(issuer: &str, secret: SecretSource, scopes: &[&str]) -> OidcTokenProvider {
    let mut settings = OidcSettings::new(issuer, "worker-client", Arc::new(secret));
    if !scopes.is_empty() {
        settings.scopes = scopes.iter().map(|s| s.to_string()).collect();
    }
    OidcTokenProvider::new(settings, reqwest::Client::builder()).unwrap()
}

/// The claims of a JWT, unverified (for looking at what the issuer put in).
fn payload(token: &str) -> Value {
    jsonwebtoken::dangerous::insecure_decode_claims::<Value>(token).unwrap()
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

#[tokio::test]
async fn discovery_and_client_credentials_against_the_mock_issuer() {
    let Some(mock) = mock_issuer().await else {
        return;
    };
    for client_auth in [ClientAuth::Basic, ClientAuth::RequestBody] {
        let mut settings = OidcSettings::new(
            &mock.issuer,
            "worker-client",
            Arc::new(SecretSource::value("any-secret")),
        );
        settings.client_auth = client_auth;
        let p = OidcTokenProvider::new(settings, reqwest::Client::builder()).unwrap();
        assert_eq!(p.status(), AuthStatus::NotYet);
        let token = p.token().await.unwrap();
        let claims = payload(token.expose());
        assert_eq!(claims["scope"], "worker:execute", "{client_auth:?}");
        assert_eq!(claims["iss"], mock.issuer.as_str());
        assert_eq!(p.token().await.unwrap(), token, "the token is cached");
        assert_eq!(p.status(), AuthStatus::Authenticated);
        assert!(!format!("{p:?}").contains(token.expose()));
    }
}

#[tokio::test]
async fn the_validator_accepts_mock_tokens_and_refuses_bad_ones() {
    let Some(mock) = mock_issuer().await else {
        return;
    };
    let validator = JwtValidator::load(&mock.issuer, reqwest::Client::builder())
        .await
        .unwrap();
    let good = provider(&mock.issuer, SecretSource::value("s"), &[])
        .token()
        .await
        .unwrap();
    let good = good.expose();

    let claims = validator.validate_header(Some(&bearer(good))).unwrap();
    assert!(claims.scopes.iter().any(|s| s == "worker:execute"));
    let mut headers = HeaderMap::new();
    headers.insert("authorization", bearer(good).parse().unwrap());
    validator.validate_headers(&headers).unwrap();
    validator.validate(Some(&bearer(good))).await.unwrap();

    // Tampered: the payload of a token with another scope, the signature of the good one.
    let other = provider(&mock.issuer, SecretSource::value("s"), &["openid"])
        .token()
        .await
        .unwrap();
    let mut parts: Vec<&str> = good.split('.').collect();
    parts[1] = other.expose().split('.').nth(1).unwrap();
    let tampered = parts.join(".");
    assert!(matches!(
        validator.validate_header(Some(&bearer(&tampered))),
        Err(JwtRejection::Unauthenticated(_))
    ));

    // Expired: the mock issues one-hour tokens (not adjustable from its CLI), so check the same
    // token as of two hours from now.
    let later = SystemTime::now() + Duration::from_secs(2 * 3600);
    assert!(matches!(
        validator.validate_header_at(Some(&bearer(good)), later),
        Err(JwtRejection::Unauthenticated(m)) if m.contains("expired")
    ));

    // Without the scope: signed correctly, no right.
    assert!(matches!(
        validator.validate_header(Some(&bearer(other.expose()))),
        Err(JwtRejection::AccessDenied(_))
    ));
    assert!(matches!(
        validator.validate_headers(&HeaderMap::new()),
        Err(JwtRejection::Unauthenticated(_))
    ));
}

#[tokio::test]
async fn an_unreachable_issuer_is_named_and_not_a_configuration_error() {
    let (_held, addr) = refusing_address();
    let issuer = format!("http://{addr}");
    let p = provider(&issuer, SecretSource::value("s3cr3t"), &[]);
    let e = p.token().await.unwrap_err();
    eprintln!("{e}");
    assert!(
        matches!(&e, AuthError::IssuerUnreachable { issuer_url, .. } if *issuer_url == issuer),
        "{e}"
    );
    assert!(!e.is_configuration_error());
    assert!(e.to_string().contains(&issuer), "{e}");
    assert!(!format!("{e} {e:?}").contains("s3cr3t"));
    assert!(matches!(
        p.status(),
        AuthStatus::Failing {
            configuration_error: false,
            ..
        }
    ));
}

/// What the in-process issuer saw and how its token endpoint answers.
#[derive(Default)]
struct IssuerState {
    /// The secret the token endpoint accepts; anything else gets 401 `invalid_client`.
    accepted_secret: String,
    grants: usize,
    /// Token requests received, accepted or not.
    token_requests: usize,
    /// The host the discovery document names for the token endpoint (with the issuer's port),
    /// instead of the issuer's own loopback address.
    token_host: Option<String>,
    /// The whole token endpoint the discovery document names, when set.
    token_endpoint: Option<String>,
}

/// A minimal issuer on 127.0.0.1: discovery, an empty JWKS, and a token endpoint that checks the
/// client secret in either the Basic header or the form body.
async fn in_process_issuer(state: Arc<Mutex<IssuerState>>) -> String {
    use axum::routing::{get, post};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let issuer = format!("http://{addr}");
    let token_endpoint = {
        let s = state.lock().unwrap();
        match (&s.token_endpoint, &s.token_host) {
            (Some(endpoint), _) => endpoint.clone(),
            (None, Some(host)) => format!("http://{host}:{}/token", addr.port()),
            (None, None) => format!("{issuer}/token"),
        }
    };
    let discovery = json!({
        "issuer": issuer,
        "authorization_endpoint": format!("{issuer}/authorize"),
        "token_endpoint": token_endpoint,
        "jwks_uri": format!("{issuer}/jwks"),
        "response_types_supported": ["code"],
        "subject_types_supported": ["public"],
        "id_token_signing_alg_values_supported": ["RS256"],
    });
    let router = axum::Router::new()
        .route(
            "/.well-known/openid-configuration",
            get(move || async move { axum::Json(discovery) }),
        )
        .route("/jwks", get(|| async { axum::Json(json!({"keys": []})) }))
        .route(
            "/token",
            post(move |headers: HeaderMap, body: String| async move {
                let form: Vec<(String, String)> = url_decoded_pairs(&body);
                let from_body = form
                    .iter()
                    .find(|(k, _)| k == "client_secret")
                    .map(|(_, v)| v.clone());
                let from_basic = headers
                    .get("authorization")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.strip_prefix("Basic "))
                    .map(basic_password);
                let presented = from_body.or(from_basic).unwrap_or_default();
                let mut s = state.lock().unwrap();
                s.token_requests += 1;
                if presented != s.accepted_secret {
                    return (
                        StatusCode::UNAUTHORIZED,
                        axum::Json(json!({"error": "invalid_client"})),
                    );
                }
                s.grants += 1;
                (
                    StatusCode::OK,
                    axum::Json(json!({
                        "access_token": format!("opaque-token-{}", s.grants),
                        "token_type": "Bearer",
                        "expires_in": 3600,
                    })),
                )
            }),
        );
    tokio::spawn(async move { axum::serve(listener, router).await });
    issuer
}

fn url_decoded_pairs(body: &str) -> Vec<(String, String)> {
    reqwest::Url::parse(&format!("http://x/?{body}"))
        .unwrap()
        .query_pairs()
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}

/// The password of a Basic credential (`client_id:client_secret`, each form-urlencoded as
/// RFC 6749 2.3.1 asks).
fn basic_password(encoded: &str) -> String {
    use base64_decode::decode;
    let decoded = String::from_utf8(decode(encoded)).unwrap();
    let (_, password) = decoded.split_once(':').unwrap();
    url_decoded_pairs(&format!("p={password}")).remove(0).1
}

/// Enough base64 to read a Basic header without another dependency.
mod base64_decode {
    pub fn decode(input: &str) -> Vec<u8> {
        const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = Vec::new();
        let (mut buffer, mut bits) = (0u32, 0);
        for c in input.bytes().filter(|c| *c != b'=') {
            let value = ALPHABET.iter().position(|a| *a == c).unwrap() as u32;
            buffer = (buffer << 6) | value;
            bits += 6;
            if bits >= 8 {
                bits -= 8;
                out.push((buffer >> bits) as u8);
                buffer &= (1 << bits) - 1;
            }
        }
        out
    }
}

#[tokio::test]
async fn a_wrong_client_secret_gives_the_clear_error_and_a_rotated_file_is_picked_up() {
    let state = Arc::new(Mutex::new(IssuerState {
        accepted_secret: "right secret/+".to_string(),
        ..Default::default()
    }));
    let issuer = in_process_issuer(state.clone()).await;
    let dir = std::env::temp_dir().join(format!("abada-oidc-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let secret_file = dir.join("client-secret");
    std::fs::write(&secret_file, "wrong secret\n").unwrap();

    for client_auth in [ClientAuth::Basic, ClientAuth::RequestBody] {
        std::fs::write(&secret_file, "wrong secret\n").unwrap();
        let mut settings = OidcSettings::new(
            &issuer,
            "worker-client",
            Arc::new(SecretSource::file(&secret_file)),
        );
        settings.client_auth = client_auth;
        let p = OidcTokenProvider::new(settings, reqwest::Client::builder()).unwrap();

        let e = p.token().await.unwrap_err();
        assert_eq!(
            e,
            AuthError::InvalidClient {
                client_id: "worker-client".into()
            },
            "{client_auth:?}"
        );
        assert!(e.to_string().starts_with(
            "the issuer rejected the client credentials for client id worker-client; check ABADA_AGENT_OIDC_CLIENT_SECRET"
        ));
        assert!(e.is_configuration_error());
        assert!(!format!("{e} {e:?}").contains("wrong secret"));
        assert!(matches!(
            p.status(),
            AuthStatus::Failing {
                configuration_error: true,
                ..
            }
        ));

        // Rotate the mounted secret: the next call uses it, no restart.
        std::fs::write(&secret_file, "right secret/+\n").unwrap();
        let token = p.token().await.unwrap();
        assert!(
            token.expose().starts_with("opaque-token-"),
            "{client_auth:?}"
        );
        assert_eq!(p.status(), AuthStatus::Authenticated);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn an_issuer_url_other_than_the_advertised_one_is_a_configuration_error() {
    let Some(mock) = mock_issuer().await else {
        return;
    };
    // Same server, but not the issuer string it advertises (`http://localhost:<port>`).
    let configured = mock.issuer.replace("localhost", "127.0.0.1");
    let e = provider(&configured, SecretSource::value("s"), &[])
        .token()
        .await
        .unwrap_err();
    eprintln!("{e}");
    assert!(
        matches!(&e, AuthError::DiscoveryFailed { issuer_url, .. } if *issuer_url == configured),
        "{e}"
    );
    assert!(e.is_configuration_error());
}

#[tokio::test]
async fn an_issuer_answering_server_errors_is_transient_and_says_the_status() {
    use axum::routing::get;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let issuer = format!("http://{}", listener.local_addr().unwrap());
    let router = axum::Router::new().route(
        "/.well-known/openid-configuration",
        get(|| async { (StatusCode::SERVICE_UNAVAILABLE, "<html>down</html>") }),
    );
    tokio::spawn(async move { axum::serve(listener, router).await });
    let e = provider(&issuer, SecretSource::value("s"), &[])
        .token()
        .await
        .unwrap_err();
    assert!(matches!(e, AuthError::IssuerUnreachable { .. }), "{e}");
    assert!(e.to_string().contains("503"), "{e}");
    assert!(!e.is_configuration_error());
}

/// The client secret goes to the token endpoint the issuer's discovery document names, which
/// the configuration's channel check never saw: an `http://` endpoint on a host that is not
/// loopback is refused after discovery, before any token request, with an error that says so;
/// `ABADA_AGENT_ALLOW_INSECURE_HTTP=true` allows it.
///
/// The named host, `token.example`, is resolved to the issuer's own loopback listener by the
/// test's client, so the issuer sees any request that would have gone out, and no traffic ever
/// leaves loopback.
#[tokio::test]
async fn a_discovered_http_token_endpoint_off_loopback_is_refused_before_any_request() {
    let state = Arc::new(Mutex::new(IssuerState {
        accepted_secret: "s3cr3t".to_string(),
        token_host: Some("token.example".to_string()),
        ..Default::default()
    }));
    let issuer = in_process_issuer(state.clone()).await;
    let loopback: std::net::SocketAddr = issuer.trim_start_matches("http://").parse().unwrap();
    let client = || reqwest::Client::builder().resolve("token.example", loopback);

    let settings = OidcSettings::new(
        &issuer,
        "worker-client",
        Arc::new(SecretSource::value("s3cr3t")),
    );
    let p = OidcTokenProvider::new(settings.clone(), client()).unwrap();
    let e = p.token().await.unwrap_err();
    // The refusal names where the secret would go: scheme, host and port.
    let token_url = format!("http://token.example:{}", loopback.port());
    assert_eq!(
        e,
        AuthError::InsecureTokenEndpoint {
            issuer_url: issuer.clone(),
            token_url: token_url.clone(),
        }
    );
    let text = e.to_string();
    for part in [
        token_url.as_str(),
        "would travel there in clear",
        "nothing was sent to it",
        "ABADA_AGENT_ALLOW_INSECURE_HTTP=true",
    ] {
        assert!(text.contains(part), "{part:?} in {text}");
    }
    assert!(!format!("{e} {e:?}").contains("s3cr3t"));
    assert!(e.is_configuration_error());
    assert!(matches!(
        p.status(),
        AuthStatus::Failing {
            configuration_error: true,
            ..
        }
    ));
    // Refused again at the next grant (not cached), and still nothing sent.
    assert!(matches!(
        p.token().await,
        Err(AuthError::InsecureTokenEndpoint { .. })
    ));
    assert_eq!(state.lock().unwrap().token_requests, 0, "no token request");

    // Allowed by the operator: the same endpoint gets the grant (the test's resolver sends it
    // to loopback), which shows a request would have been seen above.
    let allowed = OidcSettings {
        allow_insecure_http: true,
        ..settings
    };
    let token = OidcTokenProvider::new(allowed, client())
        .unwrap()
        .token()
        .await
        .unwrap();
    assert!(token.expose().starts_with("opaque-token-"));
    assert_eq!(state.lock().unwrap().token_requests, 1);
}

/// The token endpoint a discovery document names may carry a key (user information, a query),
/// and a failed token request's error is reqwest's text, which quotes the URL whole: the error,
/// its reason and the status `/readyz` reports show it redacted. The endpoint refuses the
/// connection (a held loopback port), so the request fails on the wire.
#[tokio::test]
async fn a_failed_token_request_never_shows_the_token_endpoints_secrets() {
    let (_held, refusing) = refusing_address();
    let state = Arc::new(Mutex::new(IssuerState {
        accepted_secret: "s3cr3t".to_string(),
        token_endpoint: Some(format!(
            "http://svc-user:PASSMARK@{refusing}/realms/x/token?tenant_key=KEYMARK#FRAGMARK"
        )),
        ..Default::default()
    }));
    let issuer = in_process_issuer(state).await;
    let p = provider(&issuer, SecretSource::value("s3cr3t"), &[]);
    let e = p.token().await.unwrap_err();
    let AuthError::TokenEndpoint { token_url, reason } = &e else {
        panic!("{e}")
    };
    assert_eq!(*token_url, format!("http://{refusing}/realms/x/token"));
    assert!(!reason.is_empty(), "{e}");
    let status = p.status().to_string();
    let shown = format!("{e} | {e:?} | {status}");
    eprintln!("{shown}");
    for secret in ["PASSMARK", "KEYMARK", "FRAGMARK", "svc-user", "s3cr3t"] {
        assert!(!shown.contains(secret), "{secret} shown: {shown}");
    }
    assert!(!e.is_configuration_error());
}
