//! The run store's configuration section (`ABADA_AGENT_STORE_*`): what the store needs to
//! connect, bound its pool and sweep, owned here so the store depends on no other module's
//! configuration; `config.rs` parses the variables into it.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::secret::SecretSource;

/// The run store (`ABADA_AGENT_STORE_*`): PostgreSQL for engines that keep no journal.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// The `postgres://` URL. A secret, since it may hold the password: read again for every new
    /// connection, so a rotated `_FILE` applies to new connections without a restart.
    pub url: Arc<SecretSource>,
    /// Connections at most; a caller beyond them waits up to `acquire_timeout`.
    pub pool_size: usize,
    /// Bound on waiting for a free pooled connection: backpressure with a limit, never an
    /// unbounded wait.
    pub acquire_timeout: Duration,
    /// Bound on one transaction, on the client and on the server (`statement_timeout`,
    /// `lock_timeout`, `idle_in_transaction_session_timeout`), so a frozen worker holds no lock
    /// for longer; also the bound on opening a connection.
    pub transaction_timeout: Duration,
    /// How long a finished run is kept; zero deletes it in the finishing transaction.
    pub retention: Duration,
    /// A run nobody finished and nobody touched for this long is deleted; `None`: never.
    pub abandoned_after: Option<Duration>,
    /// Runs deleted per sweeper transaction: small, so no transaction runs long.
    pub sweep_batch: usize,
    /// Extra trust roots (`ABADA_AGENT_CA_FILE`) for `sslmode=verify-ca`/`verify-full`.
    pub ca_file: Option<PathBuf>,
    /// `ABADA_AGENT_STORE_ALLOW_INSECURE`: a store that is not on a loopback address may be
    /// reached without verified TLS (`sslmode=disable`, `prefer`, `require`) or with a weak
    /// `channel_binding` (see `crate::store::StoreUrl`). Off: refused.
    pub allow_insecure: bool,
    /// `ABADA_AGENT_STORE_SHARED_PACING`: the replicas pace each model's calls as one queue in
    /// the store (`store::pace`). On by default.
    pub shared_pacing: bool,
}

impl StoreConfig {
    /// Defaults for everything but the URL.
    pub fn new(url: Arc<SecretSource>) -> StoreConfig {
        StoreConfig {
            url,
            pool_size: 8,
            acquire_timeout: Duration::from_millis(5_000),
            transaction_timeout: Duration::from_millis(5_000),
            retention: Duration::ZERO,
            abandoned_after: Some(Duration::from_secs(30 * 86_400)),
            sweep_batch: 100,
            ca_file: None,
            allow_insecure: false,
            shared_pacing: true,
        }
    }
}
