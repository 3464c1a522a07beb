//! Configuration: every `ABADA_AGENT_*` variable, parsed once into a typed [`Config`] through an
//! injectable [`EnvSource`], so tests pass a map instead of mutating the process environment.
//!
//! A bad value is a [`ConfigError`] naming the variable, what is wrong with the value and the
//! allowed range; `main` prints it on one line and exits 2 before touching the network. Secret
//! values are never echoed.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::agent::limits::{self, Ceilings};
use crate::auth::{ClientAuth, DEFAULT_SCOPE, OidcSettings};
use crate::base_url::BaseUrl;
use crate::engine::headers::EngineHeaders;
use crate::secret::SecretSource;
use crate::tools::registry::UnregisteredPolicy;

pub const ENV_ENGINE_URL: &str = "ABADA_AGENT_ENGINE_URL";
pub const ENV_WORKER_ID: &str = "ABADA_AGENT_WORKER_ID";
const ENV_TOPICS: &str = "ABADA_AGENT_TOPICS";
pub const ENV_MAX_TASKS: &str = "ABADA_AGENT_MAX_TASKS";
pub const ENV_POLL_INTERVAL_MS: &str = "ABADA_AGENT_POLL_INTERVAL_MS";
pub const ENV_LOCK_DURATION_MS: &str = "ABADA_AGENT_LOCK_DURATION_MS";
pub const ENV_SHUTDOWN_GRACE_MS: &str = "ABADA_AGENT_SHUTDOWN_GRACE_MS";
pub const ENV_HTTP_ADDR: &str = "ABADA_AGENT_HTTP_ADDR";
/// Where the admin endpoints listen unless `ABADA_AGENT_HTTP_ADDR` says: loopback only.
pub(crate) const DEFAULT_HTTP_ADDR: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 9464);
const ENV_LOG_FORMAT: &str = "ABADA_AGENT_LOG_FORMAT";
pub const ENV_ENGINE_TIMEOUT_MS: &str = "ABADA_AGENT_ENGINE_TIMEOUT_MS";
const ENV_OIDC_ISSUER_URL: &str = "ABADA_AGENT_OIDC_ISSUER_URL";
const ENV_OIDC_CLIENT_ID: &str = "ABADA_AGENT_OIDC_CLIENT_ID";
const ENV_OIDC_CLIENT_SECRET: &str = "ABADA_AGENT_OIDC_CLIENT_SECRET";
const ENV_OIDC_CLIENT_SECRET_FILE: &str = "ABADA_AGENT_OIDC_CLIENT_SECRET_FILE";
const ENV_OIDC_SCOPES: &str = "ABADA_AGENT_OIDC_SCOPES";
const ENV_OIDC_CLIENT_AUTH: &str = "ABADA_AGENT_OIDC_CLIENT_AUTH";
pub const ENV_PROVIDERS: &str = "ABADA_AGENT_PROVIDERS";
pub const ENV_AGENTS_FILE: &str = "ABADA_AGENT_AGENTS_FILE";
pub(crate) const ENV_CA_FILE: &str = "ABADA_AGENT_CA_FILE";
pub const ENV_STORE_URL: &str = "ABADA_AGENT_STORE_URL";
const ENV_STORE_URL_FILE: &str = "ABADA_AGENT_STORE_URL_FILE";
const ENV_STORE_POOL_SIZE: &str = "ABADA_AGENT_STORE_POOL_SIZE";
const ENV_STORE_ACQUIRE_TIMEOUT_MS: &str = "ABADA_AGENT_STORE_ACQUIRE_TIMEOUT_MS";
const ENV_STORE_TRANSACTION_TIMEOUT_MS: &str = "ABADA_AGENT_STORE_TRANSACTION_TIMEOUT_MS";
const ENV_STORE_RETENTION: &str = "ABADA_AGENT_STORE_RETENTION";
const ENV_STORE_ABANDONED_AFTER: &str = "ABADA_AGENT_STORE_ABANDONED_AFTER";
pub(crate) const ENV_STORE_ALLOW_INSECURE: &str = "ABADA_AGENT_STORE_ALLOW_INSECURE";
pub const ENV_STORE_SHARED_PACING: &str = "ABADA_AGENT_STORE_SHARED_PACING";
pub const ENV_ENGINE_HEADERS_FILE: &str = "ABADA_AGENT_ENGINE_HEADERS_FILE";
pub const ENV_TOOLS_FILE: &str = "ABADA_AGENT_TOOLS_FILE";
pub const ENV_TOOLS_UNREGISTERED: &str = "ABADA_AGENT_TOOLS_UNREGISTERED";
const ENV_MAX_TOOL_CALLS_PER_ANSWER: &str = "ABADA_AGENT_MAX_TOOL_CALLS_PER_ANSWER";
const ENV_MAX_TOOL_CALLS_PER_TASK: &str = "ABADA_AGENT_MAX_TOOL_CALLS_PER_TASK";
const ENV_MAX_KEYED_WRITES_PER_TASK: &str = "ABADA_AGENT_MAX_KEYED_WRITES_PER_TASK";
const ENV_MAX_TURNS: &str = "ABADA_AGENT_MAX_TURNS";
const ENV_MAX_TASK_DURATION_MS: &str = "ABADA_AGENT_MAX_TASK_DURATION_MS";
pub const ENV_MAX_OUTPUT_TOKENS: &str = "ABADA_AGENT_MAX_OUTPUT_TOKENS";
pub const ENV_MAX_TOKEN_BUDGET: &str = "ABADA_AGENT_MAX_TOKEN_BUDGET";
pub const ENV_DEFAULT_TOKEN_BUDGET: &str = "ABADA_AGENT_DEFAULT_TOKEN_BUDGET";
/// The largest token figure the budget variables take: a trillion tokens.
const MAX_TOKEN_FIGURE: u64 = 1_000_000_000_000;
pub const ENV_ALLOW_INSECURE_HTTP: &str = "ABADA_AGENT_ALLOW_INSECURE_HTTP";
pub const ENV_MAX_DEFERRALS_PER_RUN: &str = "ABADA_AGENT_MAX_DEFERRALS_PER_RUN";
const ENV_MODEL_WAIT_MAX_MS: &str = "ABADA_AGENT_MODEL_WAIT_MAX_MS";

pub(crate) use crate::agent::DEFAULT_MAX_DEFERRALS_PER_RUN;

pub use crate::env::{EnvSource, ProcessEnv};

/// A configuration problem: which variable, what is wrong, what is allowed.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("{var}: {problem}")]
pub struct ConfigError {
    pub var: String,
    pub problem: String,
}

impl ConfigError {
    fn new(var: impl Into<String>, problem: impl Into<String>) -> Self {
        ConfigError {
            var: var.into(),
            problem: problem.into(),
        }
    }
}

pub use crate::telemetry::LogFormat;

/// One model provider as configured by `ABADA_AGENT_PROVIDER_<NAME>_*`.
#[derive(Clone, Debug)]
pub struct ProviderConfig {
    /// The name models are addressed by (`name/model`), lower case.
    pub name: String,
    /// `openai` or `anthropic`.
    pub kind: String,
    pub base_url: Option<String>,
    pub api_key: Option<Arc<SecretSource>>,
    pub max_concurrency: Option<usize>,
    pub request_timeout: Duration,
    /// `_CONTEXT_WINDOW`: the context window of every model of this provider, in tokens (None:
    /// the known window of a common model, else unknown).
    pub context_window: Option<u64>,
    /// `_MODELS`: the only models of this provider a definition may name (comma-separated);
    /// empty: any model.
    pub models: Vec<String>,
    /// `_TOOL_CALLS_IN_TEXT`: what a tool call its models write as text becomes (`repair`, the
    /// default, or `parse`).
    pub tool_calls_in_text: crate::provider::TextToolCalls,
    /// `_STRUCTURED_OUTPUT`: how an `outputSchema` is asked (`native`, the default, or
    /// `instructed`).
    pub structured_output: crate::provider::StructuredOutput,
}

pub use crate::store::StoreConfig;

/// The worker's whole configuration.
#[derive(Clone, Debug)]
pub struct Config {
    pub engine_url: String,
    pub worker_id: String,
    pub topics: Vec<String>,
    pub max_tasks: u32,
    pub poll_interval: Duration,
    pub lock_duration: Duration,
    pub shutdown_grace: Duration,
    pub http_addr: SocketAddr,
    pub log_format: LogFormat,
    pub(crate) engine_timeout: Duration,
    /// OIDC client-credentials settings (protocol.md A.5), when an issuer is set.
    pub oidc: Option<OidcSettings>,
    pub providers: Vec<ProviderConfig>,
    pub agents_file: Option<PathBuf>,
    /// The operator's tool-server registry (read by the agent runtime at start-up).
    pub(crate) tools_file: Option<PathBuf>,
    /// Whether definitions may use servers the registry does not list (with a registry only).
    pub(crate) tools_unregistered: UnregisteredPolicy,
    pub ca_file: Option<PathBuf>,
    /// `None` when `ABADA_AGENT_STORE_URL` (or its `_FILE`) is unset.
    pub store: Option<StoreConfig>,
    /// Extra headers for every engine request (an authenticating proxy in front of the
    /// engine); values are secrets.
    pub(crate) engine_headers: Option<Arc<EngineHeaders>>,
    /// What no agent definition gets more of (`ABADA_AGENT_MAX_*`).
    pub ceilings: Ceilings,
    /// Credentials may travel over http:// to hosts that are not loopback (`crate::channel`).
    pub allow_insecure_http: bool,
    /// How often one run in the run store may be deferred (every model unavailable) before it
    /// ends as an incident naming the count (`ABADA_AGENT_MAX_DEFERRALS_PER_RUN`).
    pub(crate) max_deferrals_per_run: u32,
    /// How long one model call may wait for its model's capacity (the provider's stated rate
    /// limit) before the model counts as unavailable (`ABADA_AGENT_MODEL_WAIT_MAX_MS`).
    pub(crate) model_wait_max: Duration,
}

impl Config {
    /// Parses every variable; the first problem found is returned.
    pub fn from_env(env: &dyn EnvSource) -> Result<Config, ConfigError> {
        let get = |key: &str| env.get(key).filter(|v| !v.trim().is_empty());

        let engine_url = match get(ENV_ENGINE_URL) {
            None => {
                return Err(ConfigError::new(
                    ENV_ENGINE_URL,
                    "is required: set it to the engine's API root, e.g. http://abada-engine:5601/api",
                ));
            }
            Some(v) => parse_http_url(ENV_ENGINE_URL, v.trim())?,
        };
        let worker_id = match get(ENV_WORKER_ID) {
            Some(v) => {
                let v = v.trim().to_string();
                if v.len() > 200 || v.chars().any(char::is_control) {
                    return Err(ConfigError::new(
                        ENV_WORKER_ID,
                        "must be at most 200 printable characters",
                    ));
                }
                v
            }
            None => default_worker_id(),
        };
        let topics = match get(ENV_TOPICS) {
            None => vec!["abada:agent".to_string()],
            Some(v) => {
                let topics: Vec<String> = v.split(',').map(|t| t.trim().to_string()).collect();
                if topics.iter().any(|t| t.is_empty()) {
                    return Err(ConfigError::new(
                        ENV_TOPICS,
                        format!(
                            "{v:?} has a blank entry: give comma-separated topic names, e.g. abada:agent"
                        ),
                    ));
                }
                topics
            }
        };
        let max_tasks = parse_range(&get, ENV_MAX_TASKS, 4, 1, 50)? as u32;
        let poll_interval = ms(parse_range(&get, ENV_POLL_INTERVAL_MS, 1000, 1, 3_600_000)?);
        let lock_duration = ms(parse_range(
            &get,
            ENV_LOCK_DURATION_MS,
            120_000,
            1,
            3_600_000,
        )?);
        let shutdown_grace = ms(parse_range(
            &get,
            ENV_SHUTDOWN_GRACE_MS,
            25_000,
            0,
            3_600_000,
        )?);
        let engine_timeout = ms(parse_range(
            &get,
            ENV_ENGINE_TIMEOUT_MS,
            10_000,
            100,
            600_000,
        )?);
        // Loopback unless the operator says otherwise: /metrics and /readyz tell whoever
        // reaches them what the worker runs and for whom. A pod's probes and scraper need it
        // on the pod's address: the deployment sets 0.0.0.0:9464 (config/deployment.yaml).
        let http_addr = match get(ENV_HTTP_ADDR) {
            None => DEFAULT_HTTP_ADDR,
            Some(v) => v.trim().parse().map_err(|_| {
                ConfigError::new(
                    ENV_HTTP_ADDR,
                    format!(
                        "{v:?} is not a socket address: use ip:port, e.g. 0.0.0.0:9464 for every interface"
                    ),
                )
            })?,
        };
        let log_format = match get(ENV_LOG_FORMAT).map(|v| v.trim().to_ascii_lowercase()) {
            None => LogFormat::Json,
            Some(v) if v == "json" => LogFormat::Json,
            Some(v) if v == "pretty" => LogFormat::Pretty,
            Some(v) => {
                return Err(ConfigError::new(
                    ENV_LOG_FORMAT,
                    format!("{v:?} is not a log format: allowed json or pretty"),
                ));
            }
        };
        let oidc = parse_oidc(env)?;
        let providers = parse_providers(env)?;
        let agents_file = get(ENV_AGENTS_FILE).map(PathBuf::from);
        let ca_file = get(ENV_CA_FILE).map(PathBuf::from);
        let store = parse_store(env, ca_file.clone())?;
        let engine_headers = get(ENV_ENGINE_HEADERS_FILE)
            .map(|path| {
                EngineHeaders::load(std::path::Path::new(path.trim()), oidc.is_some())
                    .map(Arc::new)
                    .map_err(|e| ConfigError::new(ENV_ENGINE_HEADERS_FILE, e.to_string()))
            })
            .transpose()?;
        let tools_file = get(ENV_TOOLS_FILE).map(|p| PathBuf::from(p.trim()));
        let tools_unregistered = match get(ENV_TOOLS_UNREGISTERED)
            .map(|v| v.trim().to_ascii_lowercase())
            .as_deref()
        {
            None | Some("refuse") => UnregisteredPolicy::Refuse,
            Some("allow") => UnregisteredPolicy::Allow,
            Some(v) => {
                return Err(ConfigError::new(
                    ENV_TOOLS_UNREGISTERED,
                    format!(
                        "{v:?} is not allowed: refuse (the default: definitions use the servers of {ENV_TOOLS_FILE} only) or allow"
                    ),
                ));
            }
        };
        let ceilings = parse_ceilings(&get)?;
        let max_deferrals_per_run = parse_range(
            &get,
            ENV_MAX_DEFERRALS_PER_RUN,
            u64::from(DEFAULT_MAX_DEFERRALS_PER_RUN),
            0,
            10_000,
        )? as u32;
        let model_wait_max = ms(parse_range(
            &get,
            ENV_MODEL_WAIT_MAX_MS,
            crate::provider::fallback::DEFAULT_CAPACITY_WAIT_MAX.as_millis() as u64,
            0,
            3_600_000,
        )?);
        let allow_insecure_http = parse_bool(&get, ENV_ALLOW_INSECURE_HTTP)?;
        Ok(Config {
            engine_url,
            worker_id,
            topics,
            max_tasks,
            poll_interval,
            lock_duration,
            shutdown_grace,
            http_addr,
            log_format,
            engine_timeout,
            oidc,
            providers,
            agents_file,
            tools_file,
            tools_unregistered,
            ca_file,
            store,
            engine_headers,
            ceilings,
            allow_insecure_http,
            max_deferrals_per_run,
            model_wait_max,
        })
        .and_then(|mut config| {
            if let Some(oidc) = &mut config.oidc {
                oidc.allow_insecure_http = config.allow_insecure_http;
            }
            for (var, what, url) in config.credential_channels() {
                crate::channel::check(&url, &what, config.allow_insecure_http)
                    .map_err(|e| ConfigError::new(var, e.to_string()))?;
            }
            Ok(config)
        })
    }

    /// Every credential the configuration sends and where: (variable, what, URL).
    fn credential_channels(&self) -> Vec<(&'static str, String, String)> {
        let mut channels = Vec::new();
        if let Some(oidc) = &self.oidc {
            channels.push((
                ENV_OIDC_ISSUER_URL,
                "the OIDC client secret".to_string(),
                oidc.issuer_url.clone(),
            ));
            channels.push((
                ENV_ENGINE_URL,
                "the engine access token".to_string(),
                self.engine_url.clone(),
            ));
        }
        if self.engine_headers.is_some() {
            // Its values are credentials of an authenticating proxy: the same rule.
            channels.push((
                ENV_ENGINE_HEADERS_FILE,
                "the engine headers file's values".to_string(),
                self.engine_url.clone(),
            ));
        }
        for p in &self.providers {
            if p.api_key.is_some()
                && let Some(url) = &p.base_url
            {
                channels.push((
                    ENV_PROVIDERS,
                    format!("the API key of provider {}", p.name),
                    url.clone(),
                ));
            }
        }
        channels
    }

    /// What travels in clear because `ABADA_AGENT_ALLOW_INSECURE_HTTP=true` allowed it, for the
    /// one warning at start-up: the configured URLs (the tools file's `oauth2` token endpoints
    /// are added by the worker from its one reading of the file, [`crate::app::Worker`]; tool
    /// credentials to a server's own URL are named by their servers at run time).
    pub fn credentials_in_clear(&self) -> Vec<String> {
        let mut clear: Vec<String> = self
            .credential_channels()
            .into_iter()
            .filter(|(_, what, url)| {
                crate::channel::check(url, what, true) == Ok(crate::channel::Channel::Clear)
            })
            .map(|(_, what, url)| format!("{what} to {}", crate::redact::url(&url)))
            .collect();
        if self.allow_insecure_http {
            clear.push("tool credentials to any http:// tool server".to_string());
        }
        clear
    }
}

/// The worker-wide limits of agent runs (`ABADA_AGENT_MAX_*`).
fn parse_ceilings(get: &dyn Fn(&str) -> Option<String>) -> Result<Ceilings, ConfigError> {
    let d = Ceilings::default();
    let token_budget = parse_optional(get, ENV_MAX_TOKEN_BUDGET, 1, MAX_TOKEN_FIGURE)?;
    let default_token_budget = parse_optional(get, ENV_DEFAULT_TOKEN_BUDGET, 1, MAX_TOKEN_FIGURE)?;
    if let (Some(default), Some(ceiling)) = (default_token_budget, token_budget)
        && default > ceiling
    {
        return Err(ConfigError::new(
            ENV_DEFAULT_TOKEN_BUDGET,
            format!(
                "{default} is above {ENV_MAX_TOKEN_BUDGET} ({ceiling}): the default budget must fit under the ceiling"
            ),
        ));
    }
    let n = |var, default: u32, min, max| -> Result<u32, ConfigError> {
        // The ranges below fit u32.
        Ok(parse_range(get, var, u64::from(default), min, max)? as u32)
    };
    Ok(Ceilings {
        tool_calls_per_answer: n(
            ENV_MAX_TOOL_CALLS_PER_ANSWER,
            d.tool_calls_per_answer,
            1,
            1000,
        )?,
        tool_calls_per_task: n(
            ENV_MAX_TOOL_CALLS_PER_TASK,
            d.tool_calls_per_task,
            1,
            100_000,
        )?,
        keyed_writes_per_task: n(
            ENV_MAX_KEYED_WRITES_PER_TASK,
            d.keyed_writes_per_task,
            0,
            100_000,
        )?,
        max_turns: n(
            ENV_MAX_TURNS,
            d.max_turns,
            1,
            u64::from(limits::MAX_TURNS_CEILING),
        )?,
        max_duration: ms(parse_range(
            get,
            ENV_MAX_TASK_DURATION_MS,
            d.max_duration.as_millis() as u64,
            1000,
            7 * 24 * 3_600_000,
        )?),
        max_output_tokens: n(ENV_MAX_OUTPUT_TOKENS, d.max_output_tokens, 1, 1_000_000)?,
        token_budget,
        default_token_budget,
    })
}

/// An optional whole number in `min..=max`: `None` when the variable is unset or blank.
fn parse_optional(
    get: &dyn Fn(&str) -> Option<String>,
    var: &str,
    min: u64,
    max: u64,
) -> Result<Option<u64>, ConfigError> {
    match get(var).filter(|v| !v.trim().is_empty()) {
        None => Ok(None),
        Some(_) => parse_range(get, var, 0, min, max).map(Some),
    }
}

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

fn parse_range(
    get: &dyn Fn(&str) -> Option<String>,
    var: &str,
    default: u64,
    min: u64,
    max: u64,
) -> Result<u64, ConfigError> {
    let Some(raw) = get(var) else {
        return Ok(default);
    };
    let n: u64 = raw.trim().parse().map_err(|_| {
        ConfigError::new(
            var,
            format!("{raw:?} is not a whole number: allowed {min}..={max}"),
        )
    })?;
    if n < min || n > max {
        return Err(ConfigError::new(
            var,
            format!("{n} is out of range: allowed {min}..={max}"),
        ));
    }
    Ok(n)
}

fn parse_http_url(var: &str, raw: &str) -> Result<String, ConfigError> {
    match BaseUrl::parse(raw) {
        Ok(_) => Ok(raw.trim_end_matches('/').to_string()),
        Err(why) => {
            // Shown without the parts that carry secrets (user information, query, fragment):
            // the reason says which of them is at fault.
            let shown = format!("{:?}", crate::redact::url(raw));
            Err(ConfigError::new(
                var,
                format!(
                    "{shown} is not an http(s) URL the worker can use: {why}; use e.g. http://abada-engine:5601/api"
                ),
            ))
        }
    }
}

/// `<hostname>-<random>`, unique per process.
fn default_worker_id() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|h| h.trim().to_string())
        })
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "worker".to_string());
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..8];
    format!("{host}-{suffix}")
}

/// A secret from `VAR` or `VAR_FILE`; both set is an error (which one wins would be a guess).
fn secret_source(env: &dyn EnvSource, var: &str) -> Result<Option<Arc<SecretSource>>, ConfigError> {
    let file_var = format!("{var}_FILE");
    let value = env.get(var).filter(|v| !v.is_empty());
    let file = env.get(&file_var).filter(|v| !v.trim().is_empty());
    match (value, file) {
        (Some(_), Some(_)) => Err(ConfigError::new(
            var,
            format!("is set together with {file_var}: set only one of them"),
        )),
        (Some(v), None) => Ok(Some(Arc::new(SecretSource::value(v)))),
        (None, Some(path)) => {
            let source = SecretSource::file(PathBuf::from(path.trim()));
            source
                .load()
                .map_err(|e| ConfigError::new(file_var.clone(), e.to_string()))?;
            Ok(Some(Arc::new(source)))
        }
        (None, None) => Ok(None),
    }
}

fn parse_oidc(env: &dyn EnvSource) -> Result<Option<OidcSettings>, ConfigError> {
    let get = |key: &str| env.get(key).filter(|v| !v.trim().is_empty());
    let Some(issuer) = get(ENV_OIDC_ISSUER_URL) else {
        for var in [
            ENV_OIDC_CLIENT_ID,
            ENV_OIDC_CLIENT_SECRET,
            ENV_OIDC_CLIENT_SECRET_FILE,
        ] {
            if get(var).is_some() {
                return Err(ConfigError::new(
                    ENV_OIDC_ISSUER_URL,
                    format!("is required when {var} is set"),
                ));
            }
        }
        return Ok(None);
    };
    // The issuer must match the discovery document exactly: keep it as written (no trimming of '/').
    let issuer_url = issuer.trim().to_string();
    parse_http_url(ENV_OIDC_ISSUER_URL, &issuer_url)?;
    let client_id = get(ENV_OIDC_CLIENT_ID).ok_or_else(|| {
        ConfigError::new(
            ENV_OIDC_CLIENT_ID,
            "is required when ABADA_AGENT_OIDC_ISSUER_URL is set",
        )
    })?;
    let client_secret = secret_source(env, ENV_OIDC_CLIENT_SECRET)?.ok_or_else(|| {
        ConfigError::new(
            ENV_OIDC_CLIENT_SECRET,
            "is required when ABADA_AGENT_OIDC_ISSUER_URL is set (or set ABADA_AGENT_OIDC_CLIENT_SECRET_FILE)",
        )
    })?;
    let scopes = match get(ENV_OIDC_SCOPES) {
        None => vec![DEFAULT_SCOPE.to_string()],
        Some(v) => {
            let s: Vec<String> = v
                .split([',', ' '])
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect();
            if s.is_empty() {
                return Err(ConfigError::new(ENV_OIDC_SCOPES, "lists no scope"));
            }
            s
        }
    };
    let client_auth = match get(ENV_OIDC_CLIENT_AUTH).map(|v| v.trim().to_ascii_lowercase()) {
        None => ClientAuth::Basic,
        Some(v) if v == "basic" => ClientAuth::Basic,
        Some(v) if v == "request-body" || v == "post" => ClientAuth::RequestBody,
        Some(v) => {
            return Err(ConfigError::new(
                ENV_OIDC_CLIENT_AUTH,
                format!(
                    "{v:?} is not a client authentication method: allowed basic or request-body"
                ),
            ));
        }
    };
    Ok(Some(OidcSettings {
        issuer_url,
        client_id: client_id.trim().to_string(),
        client_secret,
        scopes,
        client_auth,
        // Set from ABADA_AGENT_ALLOW_INSECURE_HTTP once that is read (`Config::from_env`).
        allow_insecure_http: false,
    }))
}

fn parse_store(
    env: &dyn EnvSource,
    ca_file: Option<PathBuf>,
) -> Result<Option<StoreConfig>, ConfigError> {
    let get = |key: &str| env.get(key).filter(|v| !v.trim().is_empty());
    let Some(url) = secret_source(env, ENV_STORE_URL)? else {
        for var in [
            ENV_STORE_POOL_SIZE,
            ENV_STORE_ACQUIRE_TIMEOUT_MS,
            ENV_STORE_TRANSACTION_TIMEOUT_MS,
            ENV_STORE_RETENTION,
            ENV_STORE_ABANDONED_AFTER,
            ENV_STORE_ALLOW_INSECURE,
            ENV_STORE_SHARED_PACING,
        ] {
            if get(var).is_some() {
                return Err(ConfigError::new(
                    ENV_STORE_URL,
                    format!("is required when {var} is set (or set {ENV_STORE_URL_FILE})"),
                ));
            }
        }
        return Ok(None);
    };
    let url_var = match &*url {
        SecretSource::File { .. } => ENV_STORE_URL_FILE,
        SecretSource::Value(_) => ENV_STORE_URL,
    };
    let raw = url
        .load()
        .map_err(|e| ConfigError::new(url_var, e.to_string()))?;
    let allow_insecure = parse_bool(&get, ENV_STORE_ALLOW_INSECURE)?;
    // The problem is named, the URL never echoed: it may hold the password.
    crate::store::StoreUrl::parse(raw.expose(), allow_insecure)
        .map_err(|e| ConfigError::new(url_var, e.to_string()))?;
    let mut store = StoreConfig::new(url);
    store.allow_insecure = allow_insecure;
    store.pool_size = parse_range(&get, ENV_STORE_POOL_SIZE, 8, 1, 1000)? as usize;
    store.acquire_timeout = ms(parse_range(
        &get,
        ENV_STORE_ACQUIRE_TIMEOUT_MS,
        5_000,
        10,
        600_000,
    )?);
    store.transaction_timeout = ms(parse_range(
        &get,
        ENV_STORE_TRANSACTION_TIMEOUT_MS,
        5_000,
        100,
        600_000,
    )?);
    if let Some(raw) = get(ENV_STORE_RETENTION) {
        store.retention = parse_duration(ENV_STORE_RETENTION, &raw, Duration::ZERO)?;
    }
    if let Some(raw) = get(ENV_STORE_ABANDONED_AFTER) {
        store.abandoned_after = match raw.trim() {
            "never" => None,
            v => Some(parse_duration(
                ENV_STORE_ABANDONED_AFTER,
                v,
                Duration::from_secs(3_600),
            )?),
        };
    }
    // On unless turned off: replicas sharing a store share their providers' quotas too.
    store.shared_pacing =
        get(ENV_STORE_SHARED_PACING).is_none() || parse_bool(&get, ENV_STORE_SHARED_PACING)?;
    store.ca_file = ca_file;
    Ok(Some(store))
}

/// `true` or `false` (any case), `false` when unset.
fn parse_bool(get: &dyn Fn(&str) -> Option<String>, var: &str) -> Result<bool, ConfigError> {
    match get(var).map(|v| v.trim().to_ascii_lowercase()).as_deref() {
        None | Some("false") => Ok(false),
        Some("true") => Ok(true),
        Some(v) => Err(ConfigError::new(
            var,
            format!("{v:?} is not a boolean: allowed true or false"),
        )),
    }
}

/// The longest duration any `ABADA_AGENT_STORE_*` duration takes: ten years.
const MAX_DURATION: Duration = Duration::from_secs(3_650 * 86_400);

/// A duration for a variable whose name has no unit: the value carries one (`ms`, `s`, `m`,
/// `h`, `d`), so `3600` can never be misread as seconds when it means milliseconds. `0` needs
/// none.
fn parse_duration(var: &str, raw: &str, min: Duration) -> Result<Duration, ConfigError> {
    let raw = raw.trim();
    let allowed = || {
        format!(
            "a whole number with a unit (ms, s, m, h, d), e.g. 30s, 15m, 24h, 7d{}; at least {} and at most 3650d",
            if min.is_zero() { ", or 0" } else { "" },
            human(min),
        )
    };
    let duration = if raw == "0" {
        Duration::ZERO
    } else {
        let split = raw.find(|c: char| !c.is_ascii_digit()).ok_or_else(|| {
            ConfigError::new(var, format!("{raw:?} has no unit: give {}", allowed()))
        })?;
        let (number, unit) = raw.split_at(split);
        let n: u64 = number
            .parse()
            .map_err(|_| ConfigError::new(var, format!("{raw:?} is not {}", allowed())))?;
        let unit_ms: u64 = match unit {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            _ => {
                return Err(ConfigError::new(
                    var,
                    format!("{raw:?} has an unknown unit: give {}", allowed()),
                ));
            }
        };
        Duration::from_millis(n.saturating_mul(unit_ms))
    };
    if duration < min || duration > MAX_DURATION {
        return Err(ConfigError::new(
            var,
            format!("{raw} is out of range: give {}", allowed()),
        ));
    }
    Ok(duration)
}

fn human(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0 => "0".into(),
        s if s % 86_400 == 0 => format!("{}d", s / 86_400),
        s if s % 3_600 == 0 => format!("{}h", s / 3_600),
        s if s % 60 == 0 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

fn parse_providers(env: &dyn EnvSource) -> Result<Vec<ProviderConfig>, ConfigError> {
    let Some(list) = env.get(ENV_PROVIDERS).filter(|v| !v.trim().is_empty()) else {
        return Ok(Vec::new());
    };
    let mut providers: Vec<ProviderConfig> = Vec::new();
    for raw in list.split(',') {
        let name = raw.trim().to_ascii_lowercase();
        let valid = !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !valid {
            return Err(ConfigError::new(
                ENV_PROVIDERS,
                format!(
                    "{raw:?} is not a provider name: use letters, digits, '-' or '_', comma-separated"
                ),
            ));
        }
        if providers.iter().any(|p| p.name == name) {
            return Err(ConfigError::new(
                ENV_PROVIDERS,
                format!("lists {name:?} twice"),
            ));
        }
        let prefix = format!(
            "ABADA_AGENT_PROVIDER_{}_",
            name.to_ascii_uppercase().replace('-', "_")
        );
        let var = |suffix: &str| format!("{prefix}{suffix}");
        let get = |suffix: &str| env.get(&var(suffix)).filter(|v| !v.trim().is_empty());
        let kind = get("KIND")
            .map(|k| k.trim().to_ascii_lowercase())
            .unwrap_or_else(|| name.clone());
        if kind != "openai" && kind != "anthropic" {
            return Err(ConfigError::new(
                var("KIND"),
                format!(
                    "{kind:?} is not a provider kind: allowed openai or anthropic (it defaults to the provider name)"
                ),
            ));
        }
        let base_url = get("BASE_URL")
            .map(|u| parse_http_url(&var("BASE_URL"), u.trim()))
            .transpose()?;
        let api_key = secret_source(env, &var("API_KEY"))?;
        let max_concurrency = get("MAX_CONCURRENCY")
            .map(|_| {
                parse_range(&|k| env.get(k), &var("MAX_CONCURRENCY"), 0, 1, 10_000)
                    .map(|n| n as usize)
            })
            .transpose()?;
        let request_timeout = ms(parse_range(
            &|k| env.get(k).filter(|v| !v.trim().is_empty()),
            &var("TIMEOUT_MS"),
            120_000,
            100,
            3_600_000,
        )?);
        let context_window = get("CONTEXT_WINDOW")
            .map(|_| {
                parse_range(
                    &|k| env.get(k),
                    &var("CONTEXT_WINDOW"),
                    0,
                    crate::provider::context::MIN_CONTEXT_WINDOW,
                    crate::provider::context::MAX_CONTEXT_WINDOW,
                )
            })
            .transpose()?;
        let models = match get("MODELS") {
            None => Vec::new(),
            Some(list) => {
                let models: Vec<String> = list
                    .split(',')
                    .map(str::trim)
                    .filter(|m| !m.is_empty())
                    .map(str::to_string)
                    .collect();
                if models.is_empty() || models.iter().any(|m| m.chars().any(char::is_control)) {
                    return Err(ConfigError::new(
                        var("MODELS"),
                        "is not a list of model names: write them comma-separated, e.g. gpt-4.1-mini,gpt-4.1 (unset for any model)",
                    ));
                }
                models
            }
        };
        let tool_calls_in_text = get("TOOL_CALLS_IN_TEXT")
            .map(|v| {
                crate::provider::TextToolCalls::parse(&v)
                    .map_err(|e| ConfigError::new(var("TOOL_CALLS_IN_TEXT"), e.to_string()))
            })
            .transpose()?
            .unwrap_or_default();
        let structured_output = get("STRUCTURED_OUTPUT")
            .map(|v| {
                crate::provider::StructuredOutput::parse(&v)
                    .map_err(|e| ConfigError::new(var("STRUCTURED_OUTPUT"), e.to_string()))
            })
            .transpose()?
            .unwrap_or_default();
        providers.push(ProviderConfig {
            name,
            kind,
            base_url,
            api_key,
            max_concurrency,
            request_timeout,
            context_window,
            models,
            tool_calls_in_text,
            structured_output,
        });
    }
    Ok(providers)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn base() -> Vec<(&'static str, &'static str)> {
        vec![(ENV_ENGINE_URL, "http://engine:5601/api/")]
    }

    fn err(extra: &[(&str, &str)]) -> ConfigError {
        let mut pairs = base();
        pairs.extend_from_slice(extra);
        Config::from_env(&env(&pairs)).unwrap_err()
    }

    #[test]
    fn engine_headers_go_over_https_or_to_loopback_only() {
        let dir = std::env::temp_dir().join(format!("abada-headers-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("headers");
        std::fs::write(&file, "X-Auth-Request-User: header-marker-7\n").unwrap();
        let path = file.to_str().unwrap();
        let with = |url: &str, insecure: Option<&str>| {
            let mut pairs = vec![(ENV_ENGINE_URL, url), (ENV_ENGINE_HEADERS_FILE, path)];
            if let Some(v) = insecure {
                pairs.push((ENV_ALLOW_INSECURE_HTTP, v));
            }
            Config::from_env(&env(&pairs))
        };
        let e = with("http://engine.internal:5601/api", None).unwrap_err();
        assert_eq!(e.var, ENV_ENGINE_HEADERS_FILE);
        let text = e.to_string();
        assert!(
            text.contains("ABADA_AGENT_ALLOW_INSECURE_HTTP=true"),
            "{text}"
        );
        assert!(!text.contains("header-marker-7"), "{text}");
        for ok in [
            "https://engine.internal/api",
            "http://127.0.0.1:5601/api",
            "http://[::1]:5601/api",
        ] {
            assert!(with(ok, None).is_ok(), "{ok}");
        }
        let allowed = with("http://engine.internal:5601/api", Some("true")).unwrap();
        let clear = allowed.credentials_in_clear().join("; ");
        assert!(
            clear.contains("the engine headers file's values"),
            "{clear}"
        );
        assert!(!clear.contains("header-marker-7"), "{clear}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unregistered_tool_servers_are_refused_unless_allowed() {
        let c = Config::from_env(&env(&base())).unwrap();
        assert_eq!(c.tools_unregistered, UnregisteredPolicy::Refuse);
        for (value, wanted) in [
            ("refuse", UnregisteredPolicy::Refuse),
            (" Allow ", UnregisteredPolicy::Allow),
            ("", UnregisteredPolicy::Refuse),
        ] {
            let mut pairs = base();
            pairs.push((ENV_TOOLS_UNREGISTERED, value));
            let c = Config::from_env(&env(&pairs)).unwrap();
            assert_eq!(c.tools_unregistered, wanted, "{value:?}");
        }
        let e = err(&[(ENV_TOOLS_UNREGISTERED, "yes")]);
        assert_eq!(e.var, ENV_TOOLS_UNREGISTERED);
        assert!(
            e.to_string().contains("\"yes\" is not allowed: refuse"),
            "{e}"
        );
    }

    /// A URL that a path appended to it would be read two ways (a query or fragment swallowing
    /// the path), or that carries credentials, is refused at start-up, and a password is never
    /// repeated in the message.
    #[test]
    fn urls_read_two_ways_or_carrying_credentials_are_refused() {
        for (value, why) in [
            ("http://engine:5601/api?tenant=a", "query"),
            ("http://engine:5601/api#x", "fragment"),
            ("http://admin:hunter2-marker@engine:5601/api", "password"),
            ("ftp://engine/api", "scheme"),
        ] {
            for var in [ENV_ENGINE_URL, "ABADA_AGENT_PROVIDER_OPENAI_BASE_URL"] {
                let mut pairs = vec![(ENV_ENGINE_URL, "http://engine:5601/api")];
                if var == ENV_ENGINE_URL {
                    pairs[0].1 = value;
                } else {
                    pairs.push((ENV_PROVIDERS, "openai"));
                    pairs.push((var, value));
                }
                let e = Config::from_env(&env(&pairs)).unwrap_err();
                assert_eq!(e.var, var);
                let text = e.to_string();
                assert!(text.contains(why), "{var}={value}: {text}");
                assert!(!text.contains("hunter2"), "{text}");
            }
        }
    }

    /// `/metrics` and `/readyz` say what the worker runs and for whom: unless the operator
    /// sets `ABADA_AGENT_HTTP_ADDR`, they are reachable from this host only. The deployment
    /// sets every interface for its probes and scraper (`.ci/config-check` holds it to that).
    #[test]
    fn the_admin_endpoints_listen_on_loopback_unless_the_operator_says_otherwise() {
        let c = Config::from_env(&env(&base())).unwrap();
        assert!(c.http_addr.ip().is_loopback(), "{}", c.http_addr);
        assert_eq!(c.http_addr.port(), 9464);
        for set in ["0.0.0.0:9464", "[::]:9464", "10.1.2.3:9000"] {
            let mut pairs = base();
            pairs.push((ENV_HTTP_ADDR, set));
            let c = Config::from_env(&env(&pairs)).unwrap();
            assert_eq!(c.http_addr, set.parse().unwrap());
        }
    }

    #[test]
    fn defaults() {
        let c = Config::from_env(&env(&base())).unwrap();
        assert_eq!(c.engine_url, "http://engine:5601/api");
        assert_eq!(c.topics, vec!["abada:agent"]);
        assert_eq!(c.max_tasks, 4);
        assert_eq!(c.poll_interval, Duration::from_millis(1000));
        assert_eq!(c.lock_duration, Duration::from_millis(120_000));
        assert_eq!(c.shutdown_grace, Duration::from_millis(25_000));
        assert_eq!(
            c.http_addr,
            "127.0.0.1:9464".parse().unwrap(),
            "the admin endpoints listen on loopback unless the operator says otherwise"
        );
        assert_eq!(c.log_format, LogFormat::Json);
        assert!(c.oidc.is_none());
        assert!(c.providers.is_empty());
        assert!(!c.worker_id.is_empty());
    }

    #[test]
    fn the_deferral_cap_per_run_is_parsed_with_its_range() {
        let c = Config::from_env(&env(&base())).unwrap();
        assert_eq!(c.max_deferrals_per_run, DEFAULT_MAX_DEFERRALS_PER_RUN);
        let mut pairs = base();
        pairs.push((ENV_MAX_DEFERRALS_PER_RUN, " 0 "));
        let c = Config::from_env(&env(&pairs)).unwrap();
        assert_eq!(c.max_deferrals_per_run, 0);
        assert_eq!(
            err(&[(ENV_MAX_DEFERRALS_PER_RUN, "10001")]).to_string(),
            "ABADA_AGENT_MAX_DEFERRALS_PER_RUN: 10001 is out of range: allowed 0..=10000"
        );
        assert_eq!(
            err(&[(ENV_MAX_DEFERRALS_PER_RUN, "-1")]).to_string(),
            "ABADA_AGENT_MAX_DEFERRALS_PER_RUN: \"-1\" is not a whole number: allowed 0..=10000"
        );
    }

    #[test]
    fn every_bad_value_names_the_variable_and_the_range() {
        let e = Config::from_env(&env(&[])).unwrap_err();
        assert_eq!(e.var, ENV_ENGINE_URL);
        assert!(e.problem.contains("required"));
        let e = err(&[(ENV_MAX_TASKS, "0")]);
        assert_eq!(
            e.to_string(),
            "ABADA_AGENT_MAX_TASKS: 0 is out of range: allowed 1..=50"
        );
        let e = err(&[(ENV_MAX_TASKS, "51")]);
        assert_eq!(
            e.to_string(),
            "ABADA_AGENT_MAX_TASKS: 51 is out of range: allowed 1..=50"
        );
        let e = err(&[(ENV_LOCK_DURATION_MS, "3600001")]);
        assert_eq!(
            e.to_string(),
            "ABADA_AGENT_LOCK_DURATION_MS: 3600001 is out of range: allowed 1..=3600000"
        );
        let e = err(&[(ENV_LOCK_DURATION_MS, "0")]);
        assert!(e.to_string().contains("allowed 1..=3600000"));
        let e = err(&[(ENV_POLL_INTERVAL_MS, "soon")]);
        assert_eq!(
            e.to_string(),
            "ABADA_AGENT_POLL_INTERVAL_MS: \"soon\" is not a whole number: allowed 1..=3600000"
        );
        let e = err(&[(ENV_LOG_FORMAT, "xml")]);
        assert_eq!(
            e.to_string(),
            "ABADA_AGENT_LOG_FORMAT: \"xml\" is not a log format: allowed json or pretty"
        );
        assert_eq!(err(&[(ENV_TOPICS, "a,,b")]).var, ENV_TOPICS);
        assert_eq!(err(&[(ENV_HTTP_ADDR, "nope")]).var, ENV_HTTP_ADDR);
        let e = Config::from_env(&env(&[(ENV_ENGINE_URL, "ftp://x")])).unwrap_err();
        assert_eq!(e.var, ENV_ENGINE_URL);
    }

    #[test]
    fn a_providers_context_window_is_a_token_count_in_range() {
        let c = Config::from_env(&env(&[
            (ENV_ENGINE_URL, "https://e/api"),
            (ENV_PROVIDERS, "openai,local"),
            ("ABADA_AGENT_PROVIDER_LOCAL_KIND", "openai"),
            ("ABADA_AGENT_PROVIDER_LOCAL_CONTEXT_WINDOW", " 4096 "),
        ]))
        .unwrap();
        assert_eq!(c.providers[0].context_window, None);
        assert_eq!(c.providers[1].context_window, Some(4096));
        for bad in ["100", "4k", "-1", "99999999999"] {
            let e = err(&[
                (ENV_PROVIDERS, "openai"),
                ("ABADA_AGENT_PROVIDER_OPENAI_CONTEXT_WINDOW", bad),
            ]);
            assert_eq!(e.var, "ABADA_AGENT_PROVIDER_OPENAI_CONTEXT_WINDOW", "{bad}");
            assert!(e.to_string().contains("allowed 256..=10000000"), "{e}");
        }
    }

    #[test]
    fn a_providers_tool_calls_in_text_and_structured_output_have_safe_defaults() {
        let c = Config::from_env(&env(&[
            (ENV_ENGINE_URL, "https://e/api"),
            (ENV_PROVIDERS, "openai,local"),
            ("ABADA_AGENT_PROVIDER_LOCAL_KIND", "openai"),
            ("ABADA_AGENT_PROVIDER_LOCAL_TOOL_CALLS_IN_TEXT", " Parse "),
        ]))
        .unwrap();
        use crate::provider::TextToolCalls;
        assert_eq!(c.providers[0].tool_calls_in_text, TextToolCalls::Repair);
        assert_eq!(c.providers[1].tool_calls_in_text, TextToolCalls::Parse);
        assert_eq!(
            c.providers[0].structured_output,
            crate::provider::StructuredOutput::Native
        );
        for bad in ["yes", "tolerant", "1"] {
            let e = err(&[
                (ENV_PROVIDERS, "openai"),
                ("ABADA_AGENT_PROVIDER_OPENAI_TOOL_CALLS_IN_TEXT", bad),
            ]);
            assert_eq!(
                e.var, "ABADA_AGENT_PROVIDER_OPENAI_TOOL_CALLS_IN_TEXT",
                "{bad}"
            );
            assert!(e.to_string().contains("repair (the default"), "{e}");
        }
        let c = Config::from_env(&env(&[
            (ENV_ENGINE_URL, "https://e/api"),
            (ENV_PROVIDERS, "local"),
            ("ABADA_AGENT_PROVIDER_LOCAL_KIND", "openai"),
            ("ABADA_AGENT_PROVIDER_LOCAL_STRUCTURED_OUTPUT", "Instructed"),
        ]))
        .unwrap();
        assert_eq!(
            c.providers[0].structured_output,
            crate::provider::StructuredOutput::Instructed
        );
        let e = err(&[
            (ENV_PROVIDERS, "openai"),
            ("ABADA_AGENT_PROVIDER_OPENAI_STRUCTURED_OUTPUT", "grammar"),
        ]);
        assert_eq!(e.var, "ABADA_AGENT_PROVIDER_OPENAI_STRUCTURED_OUTPUT");
    }

    #[test]
    fn providers_and_oidc() {
        let c = Config::from_env(&env(&[
            (ENV_ENGINE_URL, "https://e/api"),
            (ENV_PROVIDERS, "openai, Claude"),
            ("ABADA_AGENT_PROVIDER_OPENAI_API_KEY", "sk-marker-1"),
            ("ABADA_AGENT_PROVIDER_CLAUDE_KIND", "anthropic"),
            ("ABADA_AGENT_PROVIDER_CLAUDE_MAX_CONCURRENCY", "3"),
            (ENV_OIDC_ISSUER_URL, "http://localhost:8080"),
            (ENV_OIDC_CLIENT_ID, "worker"),
            (ENV_OIDC_CLIENT_SECRET, "oidc-marker-2"),
        ]))
        .unwrap();
        assert_eq!(c.providers.len(), 2);
        assert_eq!(c.providers[0].kind, "openai");
        assert_eq!(c.providers[1].name, "claude");
        assert_eq!(c.providers[1].kind, "anthropic");
        assert_eq!(c.providers[1].max_concurrency, Some(3));
        let oidc = c.oidc.as_ref().unwrap();
        assert_eq!(oidc.scopes, vec!["worker:execute"]);
        // The discovered token endpoint is checked by the token source with the same switch.
        assert!(!oidc.allow_insecure_http);
        let mut pairs = base();
        pairs.extend_from_slice(&[
            (ENV_OIDC_ISSUER_URL, "http://localhost:8080"),
            (ENV_OIDC_CLIENT_ID, "worker"),
            (ENV_OIDC_CLIENT_SECRET, "s"),
            (ENV_ALLOW_INSECURE_HTTP, "true"),
        ]);
        let allowed = Config::from_env(&env(&pairs)).unwrap();
        assert!(allowed.oidc.unwrap().allow_insecure_http);
        let printed = format!("{c:?}");
        assert!(!printed.contains("sk-marker-1"));
        assert!(!printed.contains("oidc-marker-2"));
        assert!(c.store.is_none());

        let e = err(&[(ENV_PROVIDERS, "mystery")]);
        assert_eq!(e.var, "ABADA_AGENT_PROVIDER_MYSTERY_KIND");
        let e = err(&[(ENV_OIDC_ISSUER_URL, "http://localhost:1")]);
        assert_eq!(e.var, ENV_OIDC_CLIENT_ID);
        let e = err(&[
            ("ABADA_AGENT_PROVIDER_OPENAI_API_KEY", "secret-value-3"),
            ("ABADA_AGENT_PROVIDER_OPENAI_API_KEY_FILE", "/nonexistent"),
            (ENV_PROVIDERS, "openai"),
        ]);
        assert!(!e.to_string().contains("secret-value-3"));
        let e = err(&[
            (
                "ABADA_AGENT_PROVIDER_OPENAI_API_KEY_FILE",
                "/nonexistent/key",
            ),
            (ENV_PROVIDERS, "openai"),
        ]);
        assert_eq!(e.var, "ABADA_AGENT_PROVIDER_OPENAI_API_KEY_FILE");
    }

    #[test]
    fn the_store_url_and_its_settings() {
        let url = "postgres://abada:store-marker-9@db:5432/runs?sslmode=verify-full";
        let c = Config::from_env(&env(&[
            (ENV_ENGINE_URL, "http://e/api"),
            (ENV_STORE_URL, url),
            (ENV_CA_FILE, "/etc/ca.pem"),
        ]))
        .unwrap();
        let store = c.store.as_ref().unwrap();
        assert_eq!(store.url.load().unwrap().expose(), url);
        assert_eq!(store.pool_size, 8);
        assert_eq!(store.acquire_timeout, Duration::from_millis(5_000));
        assert_eq!(store.transaction_timeout, Duration::from_millis(5_000));
        assert_eq!(store.retention, Duration::ZERO);
        assert_eq!(
            store.abandoned_after,
            Some(Duration::from_secs(30 * 86_400))
        );
        assert_eq!(
            store.ca_file.as_deref(),
            Some(std::path::Path::new("/etc/ca.pem"))
        );
        assert!(!format!("{c:?}").contains("store-marker-9"));

        let c = Config::from_env(&env(&[
            (ENV_ENGINE_URL, "http://e/api"),
            (ENV_STORE_URL, url),
            (ENV_STORE_POOL_SIZE, "3"),
            (ENV_STORE_ACQUIRE_TIMEOUT_MS, "250"),
            (ENV_STORE_TRANSACTION_TIMEOUT_MS, "900"),
            (ENV_STORE_RETENTION, "15m"),
            (ENV_STORE_ABANDONED_AFTER, "never"),
        ]))
        .unwrap();
        let store = c.store.unwrap();
        assert_eq!(store.pool_size, 3);
        assert_eq!(store.acquire_timeout, Duration::from_millis(250));
        assert_eq!(store.transaction_timeout, Duration::from_millis(900));
        assert_eq!(store.retention, Duration::from_secs(900));
        assert_eq!(store.abandoned_after, None);
    }

    /// Replicas sharing a store pace their model calls together in it unless told not to;
    /// the switch needs a store.
    #[test]
    fn shared_pacing_is_on_with_a_store_and_can_be_turned_off() {
        let url = "postgres://abada:p@127.0.0.1:5432/runs?sslmode=disable";
        let with = |extra: &[(&str, &str)]| {
            let mut vars = vec![(ENV_ENGINE_URL, "http://e/api"), (ENV_STORE_URL, url)];
            vars.extend_from_slice(extra);
            Config::from_env(&env(&vars))
        };
        assert!(with(&[]).unwrap().store.unwrap().shared_pacing);
        let off = with(&[(ENV_STORE_SHARED_PACING, "false")]).unwrap();
        assert!(!off.store.unwrap().shared_pacing);
        let e = with(&[(ENV_STORE_SHARED_PACING, "sometimes")]).unwrap_err();
        assert_eq!(e.var, ENV_STORE_SHARED_PACING);
        let e = err(&[(ENV_STORE_SHARED_PACING, "true")]);
        assert_eq!(e.var, ENV_STORE_URL);
    }

    #[test]
    fn a_remote_store_without_verified_tls_needs_the_explicit_allowance() {
        let url = "postgres://abada:store-marker-9@db:5432/runs?sslmode=require";
        let e = err(&[(ENV_STORE_URL, url)]);
        assert_eq!(e.var, ENV_STORE_URL);
        assert!(
            e.problem.contains("ABADA_AGENT_STORE_ALLOW_INSECURE=true"),
            "{e}"
        );
        assert!(!e.to_string().contains("store-marker-9"), "{e}");
        let c = Config::from_env(&env(&[
            (ENV_ENGINE_URL, "http://e/api"),
            (ENV_STORE_URL, url),
            (ENV_STORE_ALLOW_INSECURE, "TRUE"),
        ]))
        .unwrap();
        assert!(c.store.unwrap().allow_insecure);
        let e = err(&[(ENV_STORE_URL, url), (ENV_STORE_ALLOW_INSECURE, "yes")]);
        assert_eq!(e.var, ENV_STORE_ALLOW_INSECURE);
        assert!(e.problem.contains("true or false"), "{e}");
        let e = err(&[(ENV_STORE_ALLOW_INSECURE, "true")]);
        assert_eq!(e.var, ENV_STORE_URL);
        // Loopback by address needs no allowance.
        Config::from_env(&env(&[
            (ENV_ENGINE_URL, "http://e/api"),
            (
                ENV_STORE_URL,
                "postgres://abada:store-marker-9@127.0.0.1:5432/runs?sslmode=disable",
            ),
        ]))
        .unwrap();
    }

    #[test]
    fn store_errors_name_the_variable_and_never_the_password() {
        let url = "postgres://abada:store-marker-9@db/runs";
        let store_err = |extra: &[(&str, &str)]| {
            let mut pairs = vec![(ENV_STORE_URL, url)];
            pairs.extend_from_slice(extra);
            err(&pairs)
        };
        let e = err(&[(ENV_STORE_URL, "mysql://abada:store-marker-9@db/runs")]);
        assert_eq!(e.var, ENV_STORE_URL);
        assert!(e.problem.contains("postgres://"), "{e}");
        let e = err(&[(
            ENV_STORE_URL,
            "postgres://abada:store-marker-9@db/runs?sslmode=verify_full",
        )]);
        assert_eq!(e.var, ENV_STORE_URL);
        assert!(e.problem.contains("verify-full"), "{e}");
        let e = err(&[(ENV_STORE_URL, url), (ENV_STORE_URL_FILE, "/run/url")]);
        assert!(e.problem.contains("set only one"), "{e}");
        let e = err(&[(ENV_STORE_URL_FILE, "/nonexistent/store-url")]);
        assert_eq!(e.var, ENV_STORE_URL_FILE);
        let e = err(&[(ENV_STORE_POOL_SIZE, "4")]);
        assert_eq!(
            e.to_string(),
            "ABADA_AGENT_STORE_URL: is required when ABADA_AGENT_STORE_POOL_SIZE is set (or set ABADA_AGENT_STORE_URL_FILE)"
        );
        let e = store_err(&[(ENV_STORE_POOL_SIZE, "0")]);
        assert_eq!(
            e.to_string(),
            "ABADA_AGENT_STORE_POOL_SIZE: 0 is out of range: allowed 1..=1000"
        );
        let e = store_err(&[(ENV_STORE_RETENTION, "3600")]);
        assert_eq!(e.var, ENV_STORE_RETENTION);
        assert!(e.problem.contains("has no unit"), "{e}");
        let e = store_err(&[(ENV_STORE_RETENTION, "2w")]);
        assert!(e.problem.contains("unknown unit"), "{e}");
        let e = store_err(&[(ENV_STORE_RETENTION, "3651d")]);
        assert!(e.problem.contains("out of range"), "{e}");
        let e = store_err(&[(ENV_STORE_ABANDONED_AFTER, "30m")]);
        assert_eq!(e.var, ENV_STORE_ABANDONED_AFTER);
        assert!(e.problem.contains("at least 1h"), "{e}");
        let e = store_err(&[(ENV_STORE_ABANDONED_AFTER, "0")]);
        assert!(e.problem.contains("out of range"), "{e}");
        for e in [
            store_err(&[(ENV_STORE_RETENTION, "x")]),
            err(&[(
                ENV_STORE_URL,
                "postgres://abada:store-marker-9@db/runs?sslrootcert=/x",
            )]),
        ] {
            assert!(!e.to_string().contains("store-marker"), "{e}");
        }
    }

    #[test]
    fn durations_carry_their_unit() {
        let d = |raw: &str| parse_duration("V", raw, Duration::ZERO);
        assert_eq!(d("0").unwrap(), Duration::ZERO);
        assert_eq!(d("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(d("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(d("15m").unwrap(), Duration::from_secs(900));
        assert_eq!(d("24h").unwrap(), Duration::from_secs(86_400));
        assert_eq!(d("7d").unwrap(), Duration::from_secs(7 * 86_400));
        assert_eq!(d(" 2h ").unwrap(), Duration::from_secs(7_200));
        for bad in [
            "",
            "s",
            "1.5h",
            "-1s",
            "1 h",
            "1H",
            "12",
            "99999999999999999999d",
        ] {
            assert!(d(bad).is_err(), "{bad:?}");
        }
    }
}
