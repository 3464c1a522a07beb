//! Model providers: the provider-neutral request and response, the `ModelProvider` trait every
//! adapter implements, the classification of provider failures (protocol.md Part C), and the
//! registry that hands out one adapter per configured provider.
//!
//! Adapters never retry; the one retry loop lives in [`fallback`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use crate::conversation::{AssistantMessage, Message, ToolSpec, Usage};
use crate::secret::SecretSource;

pub mod anthropic;
pub mod capacity;
pub mod circuit;
pub mod context;
pub mod fallback;
mod http;
pub mod openai;
pub mod pacer;
pub mod rate_limits;
pub(crate) mod token_estimate;
pub mod tool_names;

/// Which wire format a provider speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProviderKind {
    /// OpenAI-compatible Chat Completions (OpenAI, Azure-style gateways, vLLM, Ollama, ...).
    OpenAi,
    /// Anthropic Messages.
    Anthropic,
}

/// A provider kind that is neither `openai` nor `anthropic`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown provider kind {0:?}; use \"openai\" (Chat Completions) or \"anthropic\" (Messages)"
)]
pub struct UnknownProviderKind(pub String);

impl ProviderKind {
    /// Parses `openai` or `anthropic`, case-insensitively, surrounding blanks ignored. No aliases.
    pub fn parse(value: &str) -> Result<Self, UnknownProviderKind> {
        match value.trim().to_ascii_lowercase().as_str() {
            "openai" => Ok(ProviderKind::OpenAi),
            "anthropic" => Ok(ProviderKind::Anthropic),
            _ => Err(UnknownProviderKind(value.to_string())),
        }
    }

    /// The public API root of the kind's own vendor.
    pub(crate) fn default_base_url(self) -> &'static str {
        match self {
            ProviderKind::OpenAi => "https://api.openai.com/v1",
            ProviderKind::Anthropic => "https://api.anthropic.com",
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ProviderKind::OpenAi => "openai",
            ProviderKind::Anthropic => "anthropic",
        }
    }
}

/// One configured model provider (from `ABADA_AGENT_PROVIDER_<NAME>_*`).
#[derive(Clone, Debug)]
pub struct ProviderSettings {
    /// The name models are prefixed with (`openai` in `openai/gpt-4.1-mini`).
    pub name: String,
    pub kind: ProviderKind,
    /// API root without a trailing path of the operation (`https://api.openai.com/v1`).
    pub base_url: String,
    /// None for local servers that need no key (Ollama, llama.cpp).
    pub api_key: Option<Arc<SecretSource>>,
    /// At most this many requests in flight to this provider from this process.
    pub max_concurrency: Option<usize>,
    /// Bounds one request, and separately the wait for a concurrency permit.
    pub request_timeout: Duration,
    /// How an `outputSchema` is asked of this provider's models (`_STRUCTURED_OUTPUT`).
    pub structured_output: StructuredOutput,
}

/// How an agent's `outputSchema` is asked of a provider's models
/// (`ABADA_AGENT_PROVIDER_<NAME>_STRUCTURED_OUTPUT`). The worker validates every final answer
/// either way (`agent::output`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StructuredOutput {
    /// The wire format's own structured output where it has one (OpenAI `response_format`
    /// `json_schema`), the instruction in the system prompt besides unless the schema is strict.
    #[default]
    Native,
    /// Only the instruction in the system prompt: for a server that turns `response_format`
    /// into a grammar of the whole answer, leaving the model no way to call a tool (llama.cpp's
    /// `llama-server`, whose parser is the schema alone once `response_format` is set).
    Instructed,
}

/// A `_STRUCTURED_OUTPUT` value that is neither `native` nor `instructed`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0:?} is not allowed: native (the default: the wire format's structured output, OpenAI response_format) or instructed (the schema asked in the system prompt only)"
)]
pub struct UnknownStructuredOutput(pub String);

impl StructuredOutput {
    /// Parses `native` or `instructed`, case-insensitively, surrounding blanks ignored.
    pub fn parse(value: &str) -> Result<Self, UnknownStructuredOutput> {
        match value.trim().to_ascii_lowercase().as_str() {
            "native" => Ok(StructuredOutput::Native),
            "instructed" => Ok(StructuredOutput::Instructed),
            _ => Err(UnknownStructuredOutput(value.to_string())),
        }
    }
}

/// What the worker makes of a tool call that a model of this provider wrote as text instead of
/// a tool call of its wire format (`{"name": ..., "arguments": {...}}` bare, in a Markdown fence
/// or in tags; `<tool_call>` markup in the content): never a final answer, whichever is chosen
/// (`agent::answer_shape`). `ABADA_AGENT_PROVIDER_<NAME>_TOOL_CALLS_IN_TEXT`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TextToolCalls {
    /// The model is told how to call tools and asked again (a repair turn, bounded by the
    /// definition's `answerRepairTurns`): nothing written as text is performed.
    #[default]
    Repair,
    /// The call is taken as the model's tool call (a tolerant parse, as vLLM's and Ollama's tool
    /// parsers do), then obeys every rule a tool call obeys: offered tools only, arguments, keys,
    /// approval, limits, the journal.
    Parse,
}

/// A `_TOOL_CALLS_IN_TEXT` value that is neither `repair` nor `parse`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0:?} is not allowed: repair (the default: the model is told how to call tools and asked again) or parse (the call written as text is taken as a tool call)"
)]
pub struct UnknownTextToolCalls(pub String);

impl TextToolCalls {
    /// Parses `repair` or `parse`, case-insensitively, surrounding blanks ignored.
    pub fn parse(value: &str) -> Result<Self, UnknownTextToolCalls> {
        match value.trim().to_ascii_lowercase().as_str() {
            "repair" => Ok(TextToolCalls::Repair),
            "parse" => Ok(TextToolCalls::Parse),
            _ => Err(UnknownTextToolCalls(value.to_string())),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            TextToolCalls::Repair => "repair",
            TextToolCalls::Parse => "parse",
        }
    }
}

/// A model named `provider/model`; the model part may itself contain `/`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ModelRef {
    pub provider: String,
    pub model: String,
}

/// A model name that is not `provider/model`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("model name {0:?} is not of the form \"provider/model\" (e.g. \"openai/gpt-4.1-mini\")")]
pub struct ModelRefError(pub String);

impl ModelRef {
    pub fn parse(value: &str) -> Result<Self, ModelRefError> {
        let trimmed = value.trim();
        match trimmed.split_once('/') {
            Some((provider, model)) if !provider.trim().is_empty() && !model.trim().is_empty() => {
                Ok(ModelRef {
                    provider: provider.trim().to_string(),
                    model: model.trim().to_string(),
                })
            }
            _ => Err(ModelRefError(value.to_string())),
        }
    }
}

impl std::str::FromStr for ModelRef {
    type Err = ModelRefError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ModelRef::parse(s)
    }
}

impl std::fmt::Display for ModelRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.provider, self.model)
    }
}

/// One model call, provider-neutral.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelRequest {
    /// The provider-local model name (`gpt-4.1-mini`, without the provider prefix).
    pub model: String,
    pub system: String,
    pub messages: Vec<Message>,
    pub tools: Vec<ToolSpec>,
    pub max_output_tokens: Option<u32>,
    /// W3C trace context of the task, sent as the `traceparent` header.
    pub traceparent: Option<String>,
    /// The JSON Schema the final answer must match (`outputSchema`), when the agent has one.
    pub output: Option<OutputFormat>,
}

/// Structured output asked of a model (`agent::output`): each adapter sends it natively where
/// its wire format can, and otherwise adds `instruction` to the system prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct OutputFormat {
    /// A name for the format (`a-zA-Z0-9_-`, at most 64 characters).
    pub name: String,
    pub schema: serde_json::Value,
    /// The schema qualifies for OpenAI's strict mode (every object closed, every property
    /// required, supported keywords only): the provider then guarantees it.
    pub strict: bool,
    /// The system-prompt paragraph that asks for the schema.
    pub instruction: String,
}

impl ModelRequest {
    /// The system prompt with `output`'s instruction appended, for a wire format that does not
    /// enforce the schema itself.
    pub(crate) fn system_with_output_instruction(&self) -> String {
        match &self.output {
            None => self.system.clone(),
            Some(o) if self.system.is_empty() => o.instruction.clone(),
            Some(o) => format!("{}\n\n{}", self.system, o.instruction),
        }
    }
}

/// What a model answered.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelResponse {
    pub message: AssistantMessage,
    /// None when the provider reported none (some OpenAI-compatible servers): the agent counts
    /// an estimate against the budget instead.
    pub usage: Option<Usage>,
    /// The provider's own word (`stop`, `tool_calls`, `end_turn`, `tool_use`, `max_tokens`, ...).
    pub stop_reason: String,
    /// The model that answered, as the provider names it (may differ from the one asked for:
    /// an alias resolved to a dated version). For spans only.
    pub response_model: Option<String>,
    /// Input tokens read from the provider's prompt cache, when it says (already counted in
    /// `usage.input_tokens`). For spans only.
    pub cache_read_tokens: Option<u64>,
    /// Input tokens written to the provider's prompt cache, when it says (already counted in
    /// `usage.input_tokens`). For spans only.
    pub cache_creation_tokens: Option<u64>,
}

/// A model behind one provider.
#[async_trait]
pub trait ModelProvider: Send + Sync {
    /// One request, one answer; never retries.
    async fn complete(&self, req: &ModelRequest) -> Result<ModelResponse, ProviderError>;

    /// The provider as the OpenTelemetry GenAI conventions name it (`gen_ai.provider.name`):
    /// the wire format's vendor for the adapters; `None` (the configured name is used) for
    /// anything else.
    fn semconv_name(&self) -> Option<&'static str> {
        None
    }
}

/// Why one model call failed, classified by what the caller should do about it (protocol.md
/// Part C). Messages name the provider and model, never the key.
#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    /// Rate-limited or overloaded (429, 503, 529, "overloaded"): try the next model at once.
    #[error(
        "model {provider}/{model} is unavailable now{}: {message}",
        status.map(|s| format!(" (HTTP {s})")).unwrap_or_default()
    )]
    Unavailable {
        provider: String,
        model: String,
        status: Option<u16>,
        message: String,
        /// What the provider asked us to wait (`Retry-After`, `retry-after-ms`).
        retry_after: Option<Duration>,
    },
    /// Other 5xx, timeouts, connection errors: worth a retry after a backoff.
    #[error("model {provider}/{model} failed transiently: {message}")]
    Transient {
        provider: String,
        model: String,
        message: String,
        /// The connection could not be made: the provider is unreachable for every request,
        /// not failing this one ([`circuit::Signal::Unreachable`]).
        connect: bool,
    },
    /// The conversation does not fit the model's context window (OpenAI
    /// `context_length_exceeded`, Anthropic "prompt is too long", llama.cpp "Context size has
    /// been exceeded" even as a 500): another model may take it; never retried or deferred.
    #[error("model {provider}/{model} refused the request as too long for its context: {message}")]
    ContextTooLong {
        provider: String,
        model: String,
        message: String,
    },
    /// Any other 4xx: the request itself is wrong (bad key, unknown model, invalid tools).
    #[error("model {provider}/{model} rejected the request (HTTP {status}): {message}")]
    Rejected {
        provider: String,
        model: String,
        status: u16,
        message: String,
    },
    /// A body that does not parse into an answer (truncated, missing fields, not JSON).
    #[error("model {provider}/{model} sent a malformed answer: {message}")]
    Malformed {
        provider: String,
        model: String,
        message: String,
    },
    /// The answer was larger than the worker reads from a model (`body::MODEL_RESPONSE_MAX_BYTES`):
    /// not read past the limit, and not retried (a model that answers this is broken or hostile).
    #[error("model {provider}/{model} sent an answer the worker does not read: {too_large}")]
    TooLarge {
        provider: String,
        model: String,
        too_large: crate::body::TooLarge,
    },
    /// The worker could not prepare the request (unreadable key file, invalid key characters).
    #[error("cannot call model {provider}/{model}: {message}")]
    Setup {
        provider: String,
        model: String,
        message: String,
    },
}

impl ProviderError {
    /// A short stable word for metrics and logs.
    pub fn outcome(&self) -> &'static str {
        match self {
            ProviderError::Unavailable { .. } => "unavailable",
            ProviderError::Transient { .. } => "transient",
            ProviderError::ContextTooLong { .. } => "context_too_long",
            ProviderError::Rejected { .. } => "rejected",
            ProviderError::Malformed { .. } => "malformed",
            ProviderError::Setup { .. } => "setup",
            ProviderError::TooLarge { .. } => "too_large",
        }
    }
}

/// Parses `retry-after-ms` (milliseconds, may be fractional), else `Retry-After` (seconds or
/// an HTTP date; a date in the past means zero). None when neither is present and valid.
pub(crate) fn parse_retry_after(
    headers: &reqwest::header::HeaderMap,
    now: SystemTime,
) -> Option<Duration> {
    let text = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
    };
    // Bounded like the seconds below: `Duration::from_secs_f64` panics on values too big for a
    // Duration (a `retry-after-ms` of 1e300 did, found by the property tests); an absurd value
    // is ignored.
    if let Some(ms) = text("retry-after-ms").and_then(|v| v.parse::<f64>().ok())
        && (0.0..1e12).contains(&ms)
    {
        return Some(Duration::from_secs_f64(ms / 1000.0));
    }
    let value = text("retry-after")?;
    if let Ok(secs) = value.parse::<f64>() {
        return (0.0..1e9)
            .contains(&secs)
            .then(|| Duration::from_secs_f64(secs));
    }
    let when = httpdate::parse_http_date(value).ok()?;
    Some(when.duration_since(now).unwrap_or(Duration::ZERO))
}

/// Provider names that reach another's quota, mapped to the name that paces it (the first of
/// them by name): configured with the same kind, the same base URL (a trailing `/` aside) and
/// the same key (the same value or key file, or none). A provider's limits are its account's
/// per model (OpenAI's a project's, Anthropic's an organisation's), so two names for one key
/// are one quota, and paced as one.
fn quota_names(settings: &[ProviderSettings]) -> HashMap<String, String> {
    let same_quota = |a: &ProviderSettings, b: &ProviderSettings| {
        a.kind == b.kind
            && a.base_url.trim_end_matches('/') == b.base_url.trim_end_matches('/')
            && match (&a.api_key, &b.api_key) {
                (Some(x), Some(y)) => x.same_as(y),
                (None, None) => true,
                _ => false,
            }
    };
    let mut sorted: Vec<&ProviderSettings> = settings.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let mut names = HashMap::new();
    for (i, s) in sorted.iter().enumerate() {
        if let Some(owner) = sorted[..i].iter().find(|o| same_quota(o, s)) {
            let owner = names.get(&owner.name).unwrap_or(&owner.name).clone();
            names.insert(s.name.clone(), owner);
        }
    }
    names
}

/// Every configured provider, by name, and the circuit of every model they serve (shared by
/// every clone: one per worker).
#[derive(Clone, Default)]
pub struct ProviderRegistry {
    providers: HashMap<String, Arc<dyn ModelProvider>>,
    circuits: Arc<circuit::ModelCircuits>,
    windows: context::ContextWindows,
    /// What a tool call written as text becomes, per provider (`_TOOL_CALLS_IN_TEXT`); the
    /// default, [`TextToolCalls::Repair`], for a provider not listed.
    text_tool_calls: HashMap<String, TextToolCalls>,
    /// What each model may start now, as its provider says (fed by the adapters' answers).
    capacities: Arc<capacity::ModelCapacities>,
    /// The worker's randomness: the jitter of the retry loop's backoffs.
    random: crate::random::Random,
}

impl std::fmt::Debug for ProviderRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut names: Vec<&String> = self.providers.keys().collect();
        names.sort();
        f.debug_struct("ProviderRegistry")
            .field("providers", &names)
            .finish()
    }
}

impl ProviderRegistry {
    /// Builds one adapter per setting, all sharing the one HTTP client (connection pool).
    pub fn new(settings: Vec<ProviderSettings>, http: reqwest::Client) -> Self {
        Self::with_capacity_policy(settings, http, capacity::CapacityPolicy::default())
    }

    /// [`ProviderRegistry::new`] with the models' pacing bounded by `policy` (its `max_wait` is
    /// `ABADA_AGENT_MODEL_WAIT_MAX_MS`).
    pub fn with_capacity_policy(
        settings: Vec<ProviderSettings>,
        http: reqwest::Client,
        policy: capacity::CapacityPolicy,
    ) -> Self {
        let mut registry = ProviderRegistry {
            capacities: Arc::new(
                capacity::ModelCapacities::new(policy).with_quota_names(quota_names(&settings)),
            ),
            ..ProviderRegistry::default()
        };
        for s in settings {
            let name = s.name.clone();
            let capacities = registry.capacities.clone();
            let provider: Arc<dyn ModelProvider> = match s.kind {
                ProviderKind::OpenAi => Arc::new(
                    openai::OpenAiProvider::new(s, http.clone()).with_capacities(capacities),
                ),
                ProviderKind::Anthropic => Arc::new(
                    anthropic::AnthropicProvider::new(s, http.clone()).with_capacities(capacities),
                ),
            };
            registry.providers.insert(name, provider);
        }
        registry
    }

    /// Adds or replaces a provider (tests and the devkit plug fakes in here).
    pub fn insert(&mut self, name: impl Into<String>, provider: Arc<dyn ModelProvider>) {
        self.providers.insert(name.into(), provider);
    }

    /// The registry with every model of provider `name` given a context window of `tokens`
    /// (`ABADA_AGENT_PROVIDER_<NAME>_CONTEXT_WINDOW`).
    pub fn with_context_window(mut self, name: impl Into<String>, tokens: u64) -> Self {
        self.windows.configure(name, tokens);
        self
    }

    /// The registry drawing its retry loop's jitter from `random` (the worker's).
    pub fn with_random(mut self, random: crate::random::Random) -> Self {
        self.random = random;
        self
    }

    /// The worker's randomness, for the retry loop's backoffs.
    pub(crate) fn random(&self) -> &crate::random::Random {
        &self.random
    }

    /// The registry with the models of provider `name` treating a tool call written as text as
    /// `policy` says (`ABADA_AGENT_PROVIDER_<NAME>_TOOL_CALLS_IN_TEXT`).
    pub fn with_text_tool_calls(mut self, name: impl Into<String>, policy: TextToolCalls) -> Self {
        self.text_tool_calls.insert(name.into(), policy);
        self
    }

    /// What a tool call written as text by a model of `provider` becomes.
    pub(crate) fn text_tool_calls(&self, provider: &str) -> TextToolCalls {
        self.text_tool_calls
            .get(provider)
            .copied()
            .unwrap_or_default()
    }

    /// The context window of each model, configured or known.
    pub(crate) fn context_windows(&self) -> &context::ContextWindows {
        &self.windows
    }

    /// Whether each model is unavailable for everyone now (every task of the worker feeds it).
    pub fn circuits(&self) -> &circuit::ModelCircuits {
        &self.circuits
    }

    /// What each model may start now (every task of the worker and the runner's admission).
    pub fn capacities(&self) -> &Arc<capacity::ModelCapacities> {
        &self.capacities
    }

    pub fn get(&self, name: &str) -> Option<Arc<dyn ModelProvider>> {
        self.providers.get(name).cloned()
    }

    /// The configured provider names, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.providers.keys().cloned().collect();
        names.sort();
        names
    }
}

/// One call to one model, for metrics (calls by provider, model and outcome).
#[derive(Clone, Debug, PartialEq)]
pub struct CallAttempt {
    pub model: ModelRef,
    /// The provider as the OpenTelemetry GenAI conventions name it (`openai`, `anthropic`, or
    /// the configured name of another).
    pub(crate) provider_name: String,
    /// 0 for the agent's model, 1.. for its `fallbackModels`.
    pub(crate) fallback_index: usize,
    /// `ok`, or [`ProviderError::outcome`] of the failure.
    pub outcome: &'static str,
    /// Tokens of a successful call, as the provider reported them.
    pub usage: Option<Usage>,
    /// How long the call took.
    pub duration: Duration,
    /// This call's outcome opened the model's circuit: unavailable for every task now.
    pub circuit_opened: bool,
    /// How long the call waited for its turn in its model's pacer (the provider's rate limit).
    pub capacity_wait: Duration,
    /// Calls the model may start just after this one by its provider's stated rate limit;
    /// `None` when it states none.
    pub capacity: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::{HeaderMap, HeaderValue};

    /// Which names share a quota: the same kind, base URL (a trailing `/` aside) and key (the
    /// same value or key file, or none); any difference, and each paces alone.
    #[test]
    fn names_for_one_key_share_a_quota_and_any_difference_keeps_them_apart() {
        let setting = |name: &str, kind, url: &str, key: Option<SecretSource>| ProviderSettings {
            name: name.into(),
            kind,
            base_url: url.into(),
            api_key: key.map(Arc::new),
            max_concurrency: None,
            request_timeout: Duration::from_secs(30),
            structured_output: StructuredOutput::default(),
        };
        let open = ProviderKind::OpenAi;
        let url = "https://api.openai.com/v1";
        let names = quota_names(&[
            setting("openai", open, url, Some(SecretSource::value("sk-one"))),
            setting(
                "openai-mini",
                open,
                "https://api.openai.com/v1/",
                Some(SecretSource::value("sk-one")),
            ),
            setting("b-first", open, url, Some(SecretSource::value("sk-one"))),
            setting("other-key", open, url, Some(SecretSource::value("sk-two"))),
            setting("no-key", open, url, None),
            setting(
                "other-url",
                open,
                "https://eu.api.openai.com/v1",
                Some(SecretSource::value("sk-one")),
            ),
            setting(
                "claude",
                ProviderKind::Anthropic,
                url,
                Some(SecretSource::value("sk-one")),
            ),
            setting(
                "file-a",
                open,
                url,
                Some(SecretSource::file("/run/keys/openai")),
            ),
            setting(
                "file-b",
                open,
                url,
                Some(SecretSource::file("/run/keys/openai")),
            ),
            setting(
                "file-c",
                open,
                url,
                Some(SecretSource::file("/run/keys/other")),
            ),
            setting("local-a", open, "http://127.0.0.1:8080/v1", None),
            setting("local-b", open, "http://127.0.0.1:8080/v1", None),
        ]);
        let owner = |n: &str| names.get(n).map(String::as_str);
        // The first by name paces the quota.
        assert_eq!(owner("b-first"), None);
        assert_eq!(owner("openai"), Some("b-first"));
        assert_eq!(owner("openai-mini"), Some("b-first"));
        assert_eq!(owner("file-b"), Some("file-a"));
        assert_eq!(owner("local-b"), Some("local-a"));
        for apart in [
            "other-key",
            "no-key",
            "other-url",
            "claude",
            "file-a",
            "file-c",
            "local-a",
        ] {
            assert_eq!(owner(apart), None, "{apart}");
        }
        assert_eq!(names.len(), 4);
        // Nothing of a key reaches the map.
        assert!(!format!("{names:?}").contains("sk-"));
        // The registry's capacities pace by it.
        let registry = ProviderRegistry::new(
            vec![
                setting("work", open, url, Some(SecretSource::value("sk-one"))),
                setting("batch", open, url, Some(SecretSource::value("sk-one"))),
            ],
            reqwest::Client::new(),
        );
        let m = ModelRef::parse("work/gpt-4.1-mini").unwrap();
        assert_eq!(
            registry.capacities().quota(&m).to_string(),
            "batch/gpt-4.1-mini"
        );
    }

    #[test]
    fn kinds_parse_case_insensitively() {
        assert_eq!(ProviderKind::parse("OpenAI"), Ok(ProviderKind::OpenAi));
        assert_eq!(
            ProviderKind::parse(" anthropic "),
            Ok(ProviderKind::Anthropic)
        );
        assert!(ProviderKind::parse("gemini").is_err());
    }

    #[test]
    fn model_refs_split_at_the_first_slash() {
        let m = ModelRef::parse("vllm/meta-llama/Llama-3.1-8B").unwrap();
        assert_eq!(m.provider, "vllm");
        assert_eq!(m.model, "meta-llama/Llama-3.1-8B");
        assert_eq!(m.to_string(), "vllm/meta-llama/Llama-3.1-8B");
        for bad in ["gpt-4", "/gpt", "openai/", ""] {
            assert!(ModelRef::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn retry_after_forms() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let mut h = HeaderMap::new();
        assert_eq!(parse_retry_after(&h, now), None);
        h.insert("retry-after", HeaderValue::from_static("7"));
        assert_eq!(parse_retry_after(&h, now), Some(Duration::from_secs(7)));
        h.insert("retry-after-ms", HeaderValue::from_static("1500"));
        assert_eq!(
            parse_retry_after(&h, now),
            Some(Duration::from_millis(1500))
        );
        let mut h = HeaderMap::new();
        let date = httpdate::fmt_http_date(now + Duration::from_secs(30));
        h.insert("retry-after", HeaderValue::from_str(&date).unwrap());
        assert_eq!(parse_retry_after(&h, now), Some(Duration::from_secs(30)));
        let past = httpdate::fmt_http_date(now - Duration::from_secs(30));
        h.insert("retry-after", HeaderValue::from_str(&past).unwrap());
        assert_eq!(parse_retry_after(&h, now), Some(Duration::ZERO));
        h.insert("retry-after", HeaderValue::from_static("soon"));
        assert_eq!(parse_retry_after(&h, now), None);
    }
}
