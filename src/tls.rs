//! TLS trust for every outgoing HTTP client: the platform's roots plus an optional PEM bundle of
//! extra CA certificates (`ABADA_AGENT_CA_FILE`, e.g. a company CA in front of the engine or the
//! issuer). rustls only; no OpenSSL.

use std::path::{Path, PathBuf};

/// The variable that names the extra CA bundle.
pub(crate) const ENV_CA_FILE: &str = "ABADA_AGENT_CA_FILE";

/// Why the CA bundle cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error(
        "cannot read the CA bundle {path} ({ENV_CA_FILE}): {source}; check that the file exists and is readable"
    )]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the CA bundle {path} ({ENV_CA_FILE}) is not valid PEM: {reason}; give one or more -----BEGIN CERTIFICATE----- blocks"
    )]
    NotPem { path: PathBuf, reason: String },
    #[error(
        "the CA bundle {path} ({ENV_CA_FILE}) holds no certificate; give one or more -----BEGIN CERTIFICATE----- blocks"
    )]
    Empty { path: PathBuf },
    #[error(
        "certificate {index} (counting from 1) in the CA bundle {path} ({ENV_CA_FILE}) is not a usable X.509 CA certificate: {reason}"
    )]
    BadCertificate {
        path: PathBuf,
        index: usize,
        reason: String,
    },
}

/// A reqwest client builder that trusts the platform's roots and, when `ca_file` is given, the
/// certificates of that PEM bundle too. Callers add their own timeouts and policies.
pub fn http_client_builder(ca_file: Option<&Path>) -> Result<reqwest::ClientBuilder, TlsError> {
    let builder = reqwest::Client::builder();
    match ca_file {
        None => Ok(builder),
        Some(path) => Ok(builder.tls_certs_merge(load_ca_bundle(path)?)),
    }
}

/// Reads and checks a PEM bundle of CA certificates.
pub(crate) fn load_ca_bundle(path: &Path) -> Result<Vec<reqwest::Certificate>, TlsError> {
    let pem = std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let certs = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| TlsError::NotPem {
        path: path.to_path_buf(),
        reason: crate::errors::chain(&e),
    })?;
    if certs.is_empty() {
        return Err(TlsError::Empty {
            path: path.to_path_buf(),
        });
    }
    // PEM parsing does not look inside the DER; rustls does when it builds a root store. Probe
    // here so a bad file is reported at start-up with its name, not at the first connection.
    if trust_only(certs.clone()).is_err() {
        for (i, cert) in certs.iter().enumerate() {
            if let Err(e) = trust_only([cert.clone()]) {
                return Err(TlsError::BadCertificate {
                    path: path.to_path_buf(),
                    index: i + 1,
                    reason: crate::errors::chain(&e),
                });
            }
        }
    }
    Ok(certs)
}

/// The same bundle, checked the same way, as DER certificates for a rustls root store (the run
/// store's TLS, which is not reqwest).
pub(crate) fn load_ca_certificates(
    path: &Path,
) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, TlsError> {
    use rustls::pki_types::pem::PemObject;
    let count = load_ca_bundle(path)?.len();
    let pem = std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let certs = rustls::pki_types::CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::NotPem {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    if certs.len() != count {
        return Err(TlsError::NotPem {
            path: path.to_path_buf(),
            reason: format!(
                "{} certificates read, {count} expected: the file changed while it was read",
                certs.len()
            ),
        });
    }
    Ok(certs)
}

fn trust_only(
    certs: impl IntoIterator<Item = reqwest::Certificate>,
) -> Result<reqwest::Client, reqwest::Error> {
    reqwest::Client::builder().tls_certs_only(certs).build()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_file(content: &[u8]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("abada-tls-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ca.pem");
        std::fs::write(&path, content).unwrap();
        path
    }

    #[test]
    fn no_file_gives_a_plain_builder() {
        http_client_builder(None).unwrap().build().unwrap();
    }

    #[test]
    fn a_missing_file_is_named() {
        let e = http_client_builder(Some(Path::new("/nonexistent/ca.pem"))).unwrap_err();
        assert!(matches!(e, TlsError::Read { .. }));
        assert!(e.to_string().contains("/nonexistent/ca.pem"), "{e}");
    }

    #[test]
    fn a_file_without_certificates_is_refused() {
        let path = temp_file(b"just some text\n");
        let e = http_client_builder(Some(&path)).unwrap_err();
        assert!(matches!(e, TlsError::Empty { .. }), "{e}");
        assert!(e.to_string().contains(path.to_str().unwrap()), "{e}");
    }

    #[test]
    fn garbage_inside_a_certificate_block_is_refused_with_its_position() {
        let ca = ca_params()
            .self_signed(&rcgen::KeyPair::generate().unwrap())
            .unwrap();
        let bundle = format!(
            "{}-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n",
            ca.pem()
        );
        let path = temp_file(bundle.as_bytes());
        let e = http_client_builder(Some(&path)).unwrap_err();
        assert!(
            matches!(e, TlsError::BadCertificate { index: 2, .. }),
            "{e}"
        );
        assert!(e.to_string().contains(path.to_str().unwrap()), "{e}");
    }

    #[test]
    fn a_valid_bundle_is_accepted() {
        let mut bundle = String::new();
        for name in ["Test CA one", "Test CA two"] {
            let key = rcgen::KeyPair::generate().unwrap();
            let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            params
                .distinguished_name
                .push(rcgen::DnType::CommonName, name);
            bundle.push_str(&params.self_signed(&key).unwrap().pem());
        }
        let path = temp_file(bundle.as_bytes());
        assert_eq!(load_ca_bundle(&path).unwrap().len(), 2);
        http_client_builder(Some(&path)).unwrap().build().unwrap();
    }

    fn ca_params() -> rcgen::CertificateParams {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "Abada test CA");
        params
    }

    /// An HTTPS server on 127.0.0.1 whose certificate the returned CA (PEM) signed; it answers
    /// every request with 200 "ok".
    async fn https_server() -> (String, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        use tokio_rustls::rustls;

        let ca =
            rcgen::CertifiedIssuer::self_signed(ca_params(), rcgen::KeyPair::generate().unwrap())
                .unwrap();
        let server_key = rcgen::KeyPair::generate().unwrap();
        let server_cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])
            .unwrap()
            .signed_by(&server_key, &ca)
            .unwrap();
        let provider = std::sync::Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![server_cert.der().clone()],
                rustls::pki_types::PrivatePkcs8KeyDer::from(server_key.serialize_der()).into(),
            )
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}/", listener.local_addr().unwrap());
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let mut request = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                        match tls.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => request.extend_from_slice(&buf[..n]),
                        }
                    }
                    let response =
                        "HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok";
                    let _ = tls.write_all(response.as_bytes()).await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        (url, ca.pem())
    }

    #[tokio::test]
    async fn a_server_certified_by_the_bundle_ca_is_trusted_and_no_other_client_trusts_it() {
        let (url, ca_pem) = https_server().await;
        let path = temp_file(ca_pem.as_bytes());

        let trusting = http_client_builder(Some(&path)).unwrap().build().unwrap();
        let response = trusting.get(&url).send().await.unwrap();
        assert_eq!(response.status(), reqwest::StatusCode::OK);
        assert_eq!(response.text().await.unwrap(), "ok");

        let default = http_client_builder(None).unwrap().build().unwrap();
        assert!(default.get(&url).send().await.is_err());
    }
}
