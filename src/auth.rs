//! Access tokens for the engine (protocol.md A.5): the seam the engine client asks for a bearer
//! token. (Placeholder trait; the OIDC implementation lands with its own change.)

use async_trait::async_trait;

use crate::secret::Secret;

/// Why no token could be had.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("{0}")]
    Other(String),
}

impl AuthError {
    pub fn is_configuration_error(&self) -> bool {
        false
    }
}

/// A shared, cached access token.
#[async_trait]
pub trait TokenProvider: Send + Sync + 'static {
    async fn token(&self) -> Result<Secret, AuthError>;
    async fn refresh_after_rejection(&self, rejected: &Secret) -> Result<Secret, AuthError>;
}
