//! Connections to the store: opening one (URL re-read, TLS per `sslmode`, session limits), the
//! bounded pool (deadpool), and the one way to use a connection, [`Pool::transaction`], which
//! bounds the wait for a connection and the transaction itself and records both.
//!
//! A connection is returned to the pool only after work that ran to its end on a connection that
//! is still open. One whose work was cut short (the worker's timeout, cancellation of the caller)
//! is closed, so the next caller never inherits a half-finished exchange.

use std::future::Future;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use deadpool::managed::{self, Object, RecycleError, RecycleResult};
use tokio::time::Instant;
use tokio_postgres::Client;

use super::StoreConfig;
use super::error::{ErrorClass, StoreError, classify};
use super::outage::OutageLog;
use super::runs::{PgConn, Statements};
use super::tls::StoreTls;
use super::url::StoreUrl;
use crate::metrics::Metrics;
use crate::secret::SecretSource;

/// What a transaction is for: the `operation` label of the store's metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Operation {
    Claim,
    Append,
    Finish,
    Sweep,
    Locate,
    /// A model call's start reserved in the fleet's shared pace (`pace`).
    Pace,
}

impl Operation {
    pub(super) fn label(self) -> &'static str {
        match self {
            Operation::Claim => "claim",
            Operation::Append => "append",
            Operation::Finish => "finish",
            Operation::Sweep => "sweep",
            Operation::Locate => "locate",
            Operation::Pace => "pace",
        }
    }
}

/// Opens connections; deadpool's manager.
pub(super) struct Connector {
    url: Arc<SecretSource>,
    /// `ABADA_AGENT_STORE_ALLOW_INSECURE`, applied at every parse of the URL.
    allow_insecure: bool,
    tls: StoreTls,
    /// Bound on opening a connection (TCP, TLS, authentication): one exchange with the server,
    /// like a transaction.
    transaction_timeout: Duration,
    /// The redacted URL of the latest parse, for messages about the store as a whole.
    store: RwLock<Arc<str>>,
}

impl Connector {
    pub(super) fn new(config: &StoreConfig) -> Result<Connector, StoreError> {
        let connector = Connector {
            url: config.url.clone(),
            allow_insecure: config.allow_insecure,
            tls: StoreTls::new(config.ca_file.clone()),
            transaction_timeout: config.transaction_timeout,
            store: RwLock::new(Arc::from("the configured run store")),
        };
        connector.url()?;
        Ok(connector)
    }

    /// The redacted URL.
    pub(super) fn store(&self) -> Arc<str> {
        self.store.read().expect("store name lock poisoned").clone()
    }

    /// The URL as it is now (a `_FILE` may have been rotated), checked again: a rotated file
    /// is held to the same rules as the first.
    pub(super) fn url(&self) -> Result<StoreUrl, StoreError> {
        let store = self.store();
        let raw = self.url.load().map_err(|e| StoreError::Misconfigured {
            store: store.to_string(),
            reason: e.to_string(),
            remedy: "check ABADA_AGENT_STORE_URL_FILE",
        })?;
        let url = StoreUrl::parse(raw.expose(), self.allow_insecure).map_err(|e| {
            StoreError::Misconfigured {
                store: store.to_string(),
                reason: format!("the URL {e}"),
                remedy: "fix ABADA_AGENT_STORE_URL (or its _FILE)",
            }
        })?;
        *self.store.write().expect("store name lock poisoned") = Arc::from(url.redacted());
        Ok(url)
    }

    /// A new connection, its driver spawned. Session limits ride on the start-up packet, so a
    /// frozen or vanished worker holds no lock and no transaction for longer than one
    /// transaction timeout.
    pub(super) async fn open(&self) -> Result<Client, StoreError> {
        let url = self.url()?;
        let store = url.redacted().to_string();
        let mut config = url.config().clone();
        let limit = self.transaction_timeout.as_millis();
        let options = format!(
            "{} -c statement_timeout={limit} -c lock_timeout={limit} -c idle_in_transaction_session_timeout={limit}",
            config.get_options().unwrap_or("")
        );
        config.options(options.trim());
        if config.get_application_name().is_none() {
            config.application_name("abada-agent-worker");
        }
        config.connect_timeout(self.transaction_timeout);
        let connecting = async {
            match self.tls.connector(url.ssl_mode(), &store)? {
                None => {
                    let (client, connection) = config
                        .connect(tokio_postgres::NoTls)
                        .await
                        .map_err(|e| classify(&store, &e))?;
                    spawn_driver(connection, store.clone());
                    Ok(client)
                }
                Some(tls) => {
                    let (client, connection) = config
                        .connect(tls)
                        .await
                        .map_err(|e| classify(&store, &e))?;
                    spawn_driver(connection, store.clone());
                    Ok(client)
                }
            }
        };
        // tokio-postgres bounds each address; this bounds the whole (several hosts, TLS, auth).
        tokio::time::timeout(self.transaction_timeout, connecting)
            .await
            .unwrap_or_else(|_| {
                Err(StoreError::Unavailable {
                    store: store.clone(),
                    reason: format!(
                        "opening a connection took longer than {} ms (ABADA_AGENT_STORE_TRANSACTION_TIMEOUT_MS)",
                        self.transaction_timeout.as_millis()
                    ),
                })
            })
    }
}

/// Drives a connection until it closes. Its end is logged at debug only: the outage log says
/// once what a caller saw.
fn spawn_driver<F>(connection: F, store: String)
where
    F: Future<Output = Result<(), tokio_postgres::Error>> + Send + 'static,
{
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(store = %store, error = %super::error::one_line(&e), "a run-store connection ended");
        }
    });
}

impl managed::Manager for Connector {
    type Type = PgConn;
    type Error = StoreError;

    async fn create(&self) -> Result<PgConn, StoreError> {
        let client = self.open().await?;
        let store = self.store();
        let statements = Statements::prepare(&client)
            .await
            .map_err(|e| classify(&store, &e))?;
        Ok(PgConn { client, statements })
    }

    async fn recycle(&self, conn: &mut PgConn, _: &managed::Metrics) -> RecycleResult<StoreError> {
        if conn.client.is_closed() {
            return Err(RecycleError::message("the connection is closed"));
        }
        Ok(())
    }
}

/// The bounded pool and the store-wide bookkeeping of every transaction.
pub(super) struct Pool {
    pool: managed::Pool<Connector>,
    size: usize,
    acquire_timeout: Duration,
    transaction_timeout: Duration,
    metrics: Arc<Metrics>,
    outage: OutageLog,
}

impl Pool {
    pub(super) fn new(connector: Connector, config: &StoreConfig, metrics: Arc<Metrics>) -> Pool {
        let size = config.pool_size.max(1);
        // The wait for a free slot is bounded here; opening a connection bounds itself
        // (`Connector::open`), and recycling is a flag check.
        let pool = managed::Pool::builder(connector)
            .max_size(size)
            .wait_timeout(Some(config.acquire_timeout))
            .runtime(deadpool::Runtime::Tokio1)
            .build()
            .expect("a pool with a runtime builds");
        metrics.store_pool_max.set(size as i64);
        Pool {
            pool,
            size,
            acquire_timeout: config.acquire_timeout,
            transaction_timeout: config.transaction_timeout,
            metrics,
            outage: OutageLog::default(),
        }
    }

    pub(super) fn store(&self) -> Arc<str> {
        self.pool.manager().store()
    }

    /// The URL as it is now, parsed and checked.
    pub(super) fn url(&self) -> Result<StoreUrl, StoreError> {
        self.pool.manager().url()
    }

    /// Why the store is unavailable now, while an outage is open.
    pub(super) fn outage(&self) -> Option<String> {
        self.outage.problem()
    }

    /// The worker's own bound on a transaction: a quarter (at least 100 ms) past the server's
    /// `statement_timeout` and `lock_timeout`, so the server cancels a slow statement first
    /// (precisely, keeping the connection) and this bound catches a server or network that no
    /// longer answers at all.
    fn client_bound(&self) -> Duration {
        self.transaction_timeout + (self.transaction_timeout / 4).max(Duration::from_millis(100))
    }

    /// Runs `work` on a pooled connection: waits at most the acquire timeout for the connection,
    /// at most [`Pool::client_bound`] for the work, records the duration, the error class and
    /// the outage state. `work` gets the connection and hands it back with its result, so the
    /// connection cannot outlive the call.
    pub(super) async fn transaction<T, F, Fut>(
        &self,
        operation: Operation,
        work: F,
    ) -> Result<T, StoreError>
    where
        F: FnOnce(Checkout) -> Fut,
        Fut: Future<Output = (Checkout, Result<T, StoreError>)>,
    {
        // Boxed: the checkout (deadpool's wait, the connect with TLS and the statements'
        // preparation) is some 29 KiB of future state, which would otherwise be carried by every
        // store call and every future that awaits one, up to the agent run. Unboxed, a debug
        // build ran a task with a tool call on the store path out of its 2 MiB thread stack.
        let result = match Box::pin(self.acquire()).await {
            Err(e) => Err(e),
            Ok(conn) => {
                let started = Instant::now();
                let result = match tokio::time::timeout(self.client_bound(), work(conn)).await {
                    // The work and its connection were dropped mid-way: the connection closes.
                    Err(_) => Err(StoreError::transaction_timeout(
                        &self.store(),
                        self.client_bound(),
                    )),
                    Ok((mut conn, result)) => {
                        // A statement the server cancelled (a timeout, a serialization failure)
                        // leaves a sound connection; one that broke is closed.
                        conn.reusable = !conn.conn().client.is_closed();
                        result
                    }
                };
                self.metrics
                    .observe_store_transaction(operation.label(), started.elapsed());
                result
            }
        };
        match &result {
            Ok(_) => self.outage.succeeded(&self.store()),
            Err(e) => {
                self.metrics
                    .count_store_error(operation.label(), e.class().label());
                if matches!(e.class(), ErrorClass::Transient | ErrorClass::Misconfigured) {
                    self.outage.failed(operation.label(), e);
                } else {
                    // The store answered: it is up, whatever it said.
                    self.outage.succeeded(&self.store());
                }
            }
        }
        result
    }

    /// A connection, or a transient error once no slot came free within the acquire timeout:
    /// waiting callers are the tasks themselves (bounded by the slots), each with its deadline.
    async fn acquire(&self) -> Result<Checkout, StoreError> {
        let started = Instant::now();
        let got = self.pool.get().await;
        self.metrics
            .store_pool_wait
            .observe(started.elapsed().as_secs_f64());
        let object = match got {
            Ok(object) => object,
            Err(managed::PoolError::Timeout(_)) => {
                return Err(StoreError::pool_timeout(
                    &self.store(),
                    self.acquire_timeout,
                    self.size,
                ));
            }
            Err(managed::PoolError::Backend(e)) => return Err(e),
            Err(e) => {
                return Err(StoreError::Internal(format!(
                    "the run-store pool failed: {e}"
                )));
            }
        };
        self.metrics.store_pool_in_use.inc();
        self.metrics
            .store_pool_open
            .set(self.pool.status().size as i64);
        Ok(Checkout {
            object: Some(object),
            reusable: false,
            metrics: self.metrics.clone(),
            pool: self.pool.clone(),
        })
    }

    /// A connection of its own (not pooled) for the migrations, which take longer.
    pub(super) async fn open_unpooled(&self) -> Result<Client, StoreError> {
        self.pool.manager().open().await
    }
}

/// A connection checked out of the pool. Dropped without being marked reusable (work cut
/// short, a connection-level error) it is closed instead of returned.
pub(super) struct Checkout {
    object: Option<Object<Connector>>,
    reusable: bool,
    metrics: Arc<Metrics>,
    pool: managed::Pool<Connector>,
}

impl Checkout {
    pub(super) fn conn(&mut self) -> &mut PgConn {
        self.object
            .as_mut()
            .expect("a checkout holds its connection until dropped")
    }
}

impl Drop for Checkout {
    fn drop(&mut self) {
        if let Some(object) = self.object.take() {
            if self.reusable {
                drop(object); // back to the pool
            } else {
                // Detached from the pool and dropped: the client closes, its slot frees.
                drop(Object::take(object));
            }
        }
        self.metrics.store_pool_in_use.dec();
        self.metrics
            .store_pool_open
            .set(self.pool.status().size as i64);
    }
}
