//! The run store's URL and TLS rules on the wire, as an attacker in the middle would test them:
//! a fake PostgreSQL server on 127.0.0.1 speaks just enough of the start-up protocol to refuse
//! TLS or to take it with a certificate of its own, then asks for the password in clear, as
//! MD5, or by SCRAM without channel binding, and records every byte the worker sent it (after
//! TLS, what the man in the middle reads). The password must never be among them.
//!
//! The fake server is reached as `localhost`: a name, which the worker counts as remote (only an
//! address is loopback), so the rules for remote stores apply while the socket stays on
//! 127.0.0.1.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use abada_agent_worker::config::StoreConfig;
use abada_agent_worker::metrics::Metrics;
use abada_agent_worker::secret::SecretSource;
use abada_agent_worker::store::{ErrorClass, PgRunStore, StoreError};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_rustls::rustls;

const PASSWORD: &str = "store-pw-3c9e1a77";
/// PostgreSQL's SSLRequest code.
const SSL_REQUEST: i32 = 80_877_103;

/// How the fake server answers the SSLRequest.
#[derive(Clone, Copy, Debug)]
enum Tls {
    /// 'N': no TLS here.
    Refuse,
    /// 'S', then a handshake with a certificate for `localhost` signed by the fake's own CA.
    Accept,
}

/// What the fake server asks for after the start-up message.
#[derive(Clone, Copy, Debug)]
enum Ask {
    Cleartext,
    Md5,
    /// SASL offering SCRAM-SHA-256 only (no `-PLUS`): no channel binding.
    ScramWithoutBinding,
}

/// What one connection sent the fake server.
#[derive(Clone, Debug, Default)]
struct Received {
    /// Every byte read (after the TLS handshake, the decrypted stream).
    bytes: Vec<u8>,
    /// Whether the start-up message (user, database) arrived.
    startup: bool,
    /// The types of the messages after the start-up message ('p' is a password or SASL answer).
    messages: Vec<u8>,
}

struct FakePostgres {
    addr: SocketAddr,
    /// The CA that signed its certificate (PEM), for `ABADA_AGENT_CA_FILE`.
    ca_pem: String,
    /// Connections accepted so far.
    accepted: Arc<AtomicUsize>,
    connections: Arc<Mutex<Vec<Received>>>,
}

impl FakePostgres {
    async fn start(tls: Tls, ask: Ask) -> FakePostgres {
        let (acceptor, ca_pem) = acceptor();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(Mutex::new(Vec::new()));
        let log = connections.clone();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let acceptor = acceptor.clone();
                let log = log.clone();
                tokio::spawn(async move {
                    let received = serve(tcp, tls, ask, acceptor).await;
                    log.lock().unwrap().push(received);
                });
            }
        });
        FakePostgres {
            addr,
            ca_pem,
            accepted,
            connections,
        }
    }

    /// Every accepted connection once it has ended (the worker hung up, which follows its
    /// error at once; bounded by the fake's own read limit).
    async fn received(&self) -> Vec<Received> {
        for _ in 0..1500 {
            if self.connections.lock().unwrap().len() >= self.accepted.load(Ordering::SeqCst) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.connections.lock().unwrap().clone()
    }

    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    fn url(&self, query: &str) -> String {
        format!(
            "postgres://abada:{PASSWORD}@localhost:{}/runs{query}",
            self.addr.port()
        )
    }
}

/// One connection: SSLRequest and TLS as told, the start-up message, the password request, then
/// everything the client sends until it hangs up (bounded, so a test never hangs on it).
async fn serve(
    mut tcp: tokio::net::TcpStream,
    tls: Tls,
    ask: Ask,
    acceptor: tokio_rustls::TlsAcceptor,
) -> Received {
    let mut received = Received::default();
    let mut head = [0u8; 8];
    if tcp.read_exact(&mut head).await.is_err() {
        return received;
    }
    received.bytes.extend_from_slice(&head);
    let code = i32::from_be_bytes(head[4..8].try_into().unwrap());
    if code != SSL_REQUEST {
        converse(tcp, Some(head), ask, &mut received).await;
        return received;
    }
    match tls {
        Tls::Refuse => {
            if tcp.write_all(b"N").await.is_ok() {
                converse(tcp, None, ask, &mut received).await;
            }
        }
        Tls::Accept => {
            if tcp.write_all(b"S").await.is_err() {
                return received;
            }
            if let Ok(stream) = acceptor.accept(tcp).await {
                converse(stream, None, ask, &mut received).await;
            }
        }
    }
    received
}

async fn converse<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    head: Option<[u8; 8]>,
    ask: Ask,
    received: &mut Received,
) {
    let within = Duration::from_secs(10);
    let startup = async {
        let head = match head {
            Some(head) => head,
            None => {
                let mut head = [0u8; 8];
                stream.read_exact(&mut head).await.ok()?;
                received.bytes.extend_from_slice(&head);
                head
            }
        };
        let len = i32::from_be_bytes(head[..4].try_into().unwrap()) as usize;
        let mut rest = vec![0u8; len.saturating_sub(8).min(10_000)];
        stream.read_exact(&mut rest).await.ok()?;
        received.bytes.extend_from_slice(&rest);
        Some(())
    };
    if tokio::time::timeout(within, startup)
        .await
        .ok()
        .flatten()
        .is_none()
    {
        return;
    }
    received.startup = true;
    let request: Vec<u8> = match ask {
        Ask::Cleartext => [&b"R"[..], &8i32.to_be_bytes(), &3i32.to_be_bytes()].concat(),
        Ask::Md5 => [
            &b"R"[..],
            &12i32.to_be_bytes(),
            &5i32.to_be_bytes(),
            &[1, 2, 3, 4],
        ]
        .concat(),
        Ask::ScramWithoutBinding => {
            let body = b"SCRAM-SHA-256\0\0";
            [
                &b"R"[..],
                &(8 + body.len() as i32).to_be_bytes(),
                &10i32.to_be_bytes(),
                body,
            ]
            .concat()
        }
    };
    if stream.write_all(&request).await.is_err() {
        return;
    }
    let _ = stream.flush().await;
    // Everything that follows, until the client hangs up.
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(within, async {
        let mut buf = [0u8; 4096];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => rest.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    let mut at = 0;
    while at + 5 <= rest.len() {
        received.messages.push(rest[at]);
        let len = i32::from_be_bytes(rest[at + 1..at + 5].try_into().unwrap()) as usize;
        at += 1 + len.max(4);
    }
    received.bytes.extend_from_slice(&rest);
}

/// A TLS acceptor with a certificate for `localhost` and 127.0.0.1, signed by a fresh CA
/// (returned as PEM): trusted by nobody unless a test hands the CA to the worker.
fn acceptor() -> (tokio_rustls::TlsAcceptor, String) {
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "Fake PostgreSQL CA");
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, rcgen::KeyPair::generate().unwrap())
        .unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".into()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls::pki_types::PrivatePkcs8KeyDer::from(key.serialize_der()).into(),
        )
        .unwrap();
    (tokio_rustls::TlsAcceptor::from(Arc::new(config)), ca.pem())
}

fn store_config(
    url: String,
    allow_insecure: bool,
    ca_file: Option<std::path::PathBuf>,
) -> StoreConfig {
    let mut config = StoreConfig::new(Arc::new(SecretSource::value(url)));
    config.transaction_timeout = Duration::from_secs(10);
    config.allow_insecure = allow_insecure;
    config.ca_file = ca_file;
    config
}

async fn connect(config: &StoreConfig) -> StoreError {
    match PgRunStore::connect(config, Arc::new(Metrics::new())).await {
        Ok(_) => panic!("the fake server cannot be a store"),
        Err(e) => e,
    }
}

/// No password, cleartext or MD5, in anything the fake server received.
fn assert_no_password(connections: &[Received]) {
    let md5_prefix = b"md5";
    for c in connections {
        let text = String::from_utf8_lossy(&c.bytes);
        assert!(
            !text.contains(PASSWORD),
            "the password reached the wire: {text:?}"
        );
        assert!(
            !c.messages.contains(&b'p'),
            "a password message was sent: {:?} ({text:?})",
            c.messages
        );
        assert!(
            !c.bytes.windows(3).any(|w| w == md5_prefix),
            "an MD5 answer was sent: {text:?}"
        );
    }
}

fn ca_file(pem: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("abada-fake-pg-ca-{}.pem", uuid::Uuid::new_v4()));
    std::fs::write(&path, pem).unwrap();
    path
}

/// Finding 2 on the wire: with a raw '@' in the query, the old parser saw no query, so
/// `sslmode=require` became `prefer`, the server refused TLS and the password went in clear.
/// The URL is now refused before any connection; written with %40 it keeps `require`.
#[tokio::test]
async fn an_at_sign_in_the_query_never_turns_require_into_a_password_in_clear() {
    let fake = FakePostgres::start(Tls::Refuse, Ask::Cleartext).await;
    let raw = fake.url("?application_name=worker@prod&sslmode=require");
    for allow in [false, true] {
        let e = connect(&store_config(raw.clone(), allow, None)).await;
        assert_no_password(&fake.received().await);
        assert_eq!(e.class(), ErrorClass::Misconfigured, "{e:?}");
        let text = e.to_string();
        assert!(text.contains("raw '@'"), "{text}");
        assert!(!text.contains(PASSWORD) && !text.contains("prod"), "{text}");
    }
    assert_eq!(fake.accepted(), 0, "refused before any connection");

    let encoded = fake.url("?application_name=worker%40prod&sslmode=require");
    let e = connect(&store_config(encoded, true, None)).await;
    assert_eq!(e.class(), ErrorClass::Misconfigured, "{e:?}");
    assert!(e.to_string().contains("sslmode"), "{e}");
    let connections = fake.received().await;
    assert!(
        !connections.is_empty(),
        "the worker did reach the fake server"
    );
    assert!(
        connections.iter().all(|c| !c.startup),
        "nothing but the SSLRequest was sent: {connections:?}"
    );
    assert_no_password(&connections);
}

/// `prefer` to a remote store, allowed by the operator: the server refuses TLS and asks for the
/// password in clear. Channel binding, which the worker requires wherever TLS may be used,
/// refuses before anything is sent.
#[tokio::test]
async fn prefer_against_a_server_refusing_tls_sends_no_password() {
    for ask in [Ask::Cleartext, Ask::Md5, Ask::ScramWithoutBinding] {
        let fake = FakePostgres::start(Tls::Refuse, ask).await;
        let e = connect(&store_config(fake.url("?sslmode=prefer"), true, None)).await;
        let connections = fake.received().await;
        assert_no_password(&connections);
        assert!(
            connections.iter().any(|c| c.startup),
            "{ask:?}: {connections:?}"
        );
        assert_eq!(e.class(), ErrorClass::Misconfigured, "{ask:?}: {e:?}");
        assert!(e.to_string().contains("channel binding"), "{ask:?}: {e}");
    }
}

/// Finding 3: under `require` (and formerly `prefer`) tokio-postgres with channel_binding=prefer
/// answered a request for a cleartext or MD5 password from anyone in the middle with a
/// certificate of their own. Now: refused, nothing sent.
#[tokio::test]
async fn a_man_in_the_middle_with_his_own_certificate_gets_no_password() {
    for ask in [Ask::Cleartext, Ask::Md5, Ask::ScramWithoutBinding] {
        let fake = FakePostgres::start(Tls::Accept, ask).await;
        let e = connect(&store_config(fake.url("?sslmode=require"), true, None)).await;
        let connections = fake.received().await;
        assert!(
            connections.iter().any(|c| c.startup),
            "TLS was set up and the start-up message sent: {connections:?}"
        );
        assert_no_password(&connections);
        assert_eq!(e.class(), ErrorClass::Misconfigured, "{ask:?}: {e:?}");
        assert!(e.to_string().contains("channel binding"), "{ask:?}: {e}");
    }
}

/// Without `sslmode`, a remote store is `verify-full`: a certificate from a CA the worker does
/// not trust ends the connection in the handshake, before the start-up message. `require`
/// without the operator's allowance is refused before any connection.
#[tokio::test]
async fn a_remote_store_defaults_to_verify_full_and_insecure_modes_need_the_allowance() {
    let fake = FakePostgres::start(Tls::Accept, Ask::Cleartext).await;
    let e = connect(&store_config(fake.url(""), false, None)).await;
    let connections = fake.received().await;
    assert!(
        connections.iter().all(|c| !c.startup),
        "the handshake failed before the start-up message: {connections:?}"
    );
    assert_no_password(&connections);
    assert_eq!(e.class(), ErrorClass::Misconfigured, "{e:?}");
    assert!(e.to_string().contains("sslmode=verify-full"), "{e}");

    for mode in ["disable", "prefer", "require"] {
        let fake = FakePostgres::start(Tls::Accept, Ask::Cleartext).await;
        let e = connect(&store_config(
            fake.url(&format!("?sslmode={mode}")),
            false,
            None,
        ))
        .await;
        assert_eq!(e.class(), ErrorClass::Misconfigured, "{e:?}");
        assert!(
            e.to_string()
                .contains("ABADA_AGENT_STORE_ALLOW_INSECURE=true"),
            "{e}"
        );
        assert_eq!(fake.accepted(), 0, "{mode}: refused before any connection");
    }
}

/// The one exception to channel binding: `verify-full` with `channel_binding=prefer` (PgBouncer
/// and MD5 roles): a cleartext password goes to the server whose certificate names the host, and
/// only to it; the same URL to a server the CA did not certify sends nothing.
#[tokio::test]
async fn a_cleartext_password_goes_only_to_a_verified_server() {
    let fake = FakePostgres::start(Tls::Accept, Ask::Cleartext).await;
    let ca = ca_file(&fake.ca_pem);
    let url = fake.url("?sslmode=verify-full&channel_binding=prefer");
    // The fake never says AuthenticationOk: the worker waits, then gives up.
    let mut config = store_config(url.clone(), false, Some(ca.clone()));
    config.transaction_timeout = Duration::from_secs(2);
    let _ = connect(&config).await;
    let connections = fake.received().await;
    assert!(
        connections
            .iter()
            .any(|c| String::from_utf8_lossy(&c.bytes).contains(PASSWORD)),
        "the verified server got the password it asked for: {connections:?}"
    );

    // Another CA's server at the same name: nothing.
    let other = FakePostgres::start(Tls::Accept, Ask::Cleartext).await;
    let e = connect(&store_config(
        other.url("?sslmode=verify-full&channel_binding=prefer"),
        false,
        Some(ca.clone()),
    ))
    .await;
    assert_eq!(e.class(), ErrorClass::Misconfigured, "{e:?}");
    assert_no_password(&other.received().await);
    std::fs::remove_file(ca).unwrap();
}
