//! TLS for run-store connections: rustls with the aws-lc-rs provider reqwest already brings (no
//! OpenSSL, no second crypto backend), and libpq's `sslmode` semantics (see
//! docs/OPERATIONS.md's `sslmode` table).
//!
//! One certificate verifier covers every mode: without trust roots (`prefer`, `require`) it
//! accepts any certificate; with them it checks the chain (`verify-ca`) and, for `verify-full`,
//! the host name. The handshake signature is always checked, so the server proves it holds the
//! key of the certificate it shows, and SCRAM channel binding (tokio-postgres-rustls), which the
//! URL's rules require for a remote store wherever TLS may be used (`url`), ties the password
//! exchange to that certificate. Which modes a store may use at all is decided there, not here.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::ParsedCertificate;
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::error::StoreError;
use super::url::SslMode;

/// Builds the TLS connector for a mode; trust roots are loaded once, on first need.
pub(super) struct StoreTls {
    ca_file: Option<PathBuf>,
    roots: OnceLock<Result<Arc<RootCertStore>, String>>,
    provider: Arc<CryptoProvider>,
}

impl StoreTls {
    pub(super) fn new(ca_file: Option<PathBuf>) -> StoreTls {
        StoreTls {
            ca_file,
            roots: OnceLock::new(),
            provider: Arc::new(rustls::crypto::aws_lc_rs::default_provider()),
        }
    }

    /// The connector for `mode`; `None` for `disable`.
    pub(super) fn connector(
        &self,
        mode: SslMode,
        store: &str,
    ) -> Result<Option<MakeRustlsConnect>, StoreError> {
        let roots = match mode {
            SslMode::Disable => return Ok(None),
            SslMode::Prefer | SslMode::Require => None,
            SslMode::VerifyCa | SslMode::VerifyFull => Some(self.roots(store)?),
        };
        let verifier = Arc::new(ModeVerifier {
            roots,
            check_name: mode == SslMode::VerifyFull,
            provider: self.provider.clone(),
        });
        let config = rustls::ClientConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| StoreError::Internal(format!("TLS set-up: {e}")))?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        Ok(Some(MakeRustlsConnect::new(config)))
    }

    fn roots(&self, store: &str) -> Result<Arc<RootCertStore>, StoreError> {
        self.roots
            .get_or_init(|| load_roots(self.ca_file.as_deref()))
            .clone()
            .map_err(|reason| StoreError::Misconfigured {
                store: store.to_string(),
                reason,
                remedy: "set ABADA_AGENT_CA_FILE to the CA that signed the server's certificate",
            })
    }
}

/// The system's roots (as reqwest's platform verifier loads them on Linux) plus the CA bundle.
fn load_roots(ca_file: Option<&std::path::Path>) -> Result<Arc<RootCertStore>, String> {
    let mut roots = RootCertStore::empty();
    if let Some(path) = ca_file {
        let certs = crate::tls::load_ca_certificates(path).map_err(|e| e.to_string())?;
        for cert in certs {
            roots
                .add(cert)
                .map_err(|e| format!("{}: {e}", path.display()))?;
        }
    }
    // Unreadable system certificates are skipped, as the platform verifier does.
    let system = rustls_native_certs::load_native_certs();
    roots.add_parsable_certificates(system.certs);
    if roots.is_empty() {
        return Err(
            "sslmode verify-ca/verify-full needs trust roots, and neither the system nor ABADA_AGENT_CA_FILE has any".into(),
        );
    }
    Ok(Arc::new(roots))
}

#[derive(Debug)]
struct ModeVerifier {
    /// `None`: any certificate is accepted (`prefer`, `require`).
    roots: Option<Arc<RootCertStore>>,
    check_name: bool,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for ModeVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(roots) = &self.roots else {
            return Ok(ServerCertVerified::assertion());
        };
        let cert = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &cert,
            roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        if self.check_name {
            rustls::client::verify_server_name(&cert, server_name)?;
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disable_has_no_connector_and_the_others_build() {
        let tls = StoreTls::new(None);
        assert!(tls.connector(SslMode::Disable, "s").unwrap().is_none());
        for mode in [SslMode::Prefer, SslMode::Require, SslMode::VerifyFull] {
            assert!(tls.connector(mode, "s").unwrap().is_some(), "{mode}");
        }
    }

    #[test]
    fn a_bad_ca_file_is_a_configuration_error_naming_the_file() {
        let tls = StoreTls::new(Some(PathBuf::from("/nonexistent/store-ca.pem")));
        assert!(
            tls.connector(SslMode::Require, "s").is_ok(),
            "not needed without verification"
        );
        let e = match tls.connector(SslMode::VerifyCa, "s") {
            Err(e) => e,
            Ok(_) => panic!("a missing CA file must be refused"),
        };
        assert_eq!(e.class(), super::super::ErrorClass::Misconfigured);
        assert!(e.to_string().contains("/nonexistent/store-ca.pem"), "{e}");
    }
}
