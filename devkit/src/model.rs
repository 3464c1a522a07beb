//! A scripted model provider: one loopback HTTP server speaking both the OpenAI Chat
//! Completions (`/v1/chat/completions`) and the Anthropic Messages (`/v1/messages`) wire formats.
//!
//! A script is chosen by the request's model name (or the `*` script); its turn is chosen
//! statelessly by how many assistant turns the request's conversation already holds, so a
//! resumed conversation continues at the right turn. Past the end, the last turn repeats.
//! Faults, latency and token usage are configurable per model, and every call is counted and
//! its body recorded, so tests can check isolation between tasks.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::serve::ListenerExt;
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The script used for models that have none of their own.
pub const DEFAULT_SCRIPT: &str = "*";

/// Which wire format a call used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WireFormat {
    OpenAi,
    Anthropic,
}

/// One tool call of a scripted turn.
#[derive(Clone, Debug, PartialEq)]
pub struct ScriptedCall {
    /// The MCP tool name; the call uses the offered function name that equals it or ends in
    /// `__<tool>`, else this name as it is (a tool nobody offered).
    pub tool: String,
    /// A JSON template: every string in it is rendered like a text template, except that a
    /// string that is exactly one `${input.<field>}` becomes the field's JSON value (a number
    /// stays a number: `"amountCents": "${input.amountCents}"`).
    pub arguments: Value,
}

/// One answer of a script.
#[derive(Clone, Debug, PartialEq)]
pub enum Turn {
    ToolCalls(Vec<ScriptedCall>),
    /// Text and tool calls in one answer, as real models often do ("Refunding 1500 cents needs
    /// approval." then the call); the text is a template like [`Turn::Text`]'s.
    Say(String, Vec<ScriptedCall>),
    /// A final answer; a template with `${input}`, `${input.<field>}` (a field of the input
    /// read as a JSON object, as a model reads structured input), `${last_tool_result}` and
    /// `${call_index}` (this model's call count including this call, from 1).
    Text(String),
    /// A final answer cut by the output limit: the text as a template like [`Turn::Text`]'s,
    /// answered with OpenAI's `finish_reason: "length"` or Anthropic's `stop_reason:
    /// "max_tokens"`.
    Cut(String),
    /// The response body exactly as given, whichever format was asked (status 200, JSON): a
    /// real server's answer captured byte for byte (the worker's `tests/data/real_model/`),
    /// replayed on the wire.
    Raw(String),
}

impl Turn {
    pub fn text(template: impl Into<String>) -> Self {
        Turn::Text(template.into())
    }

    pub fn call(tool: impl Into<String>, arguments: Value) -> Self {
        Turn::ToolCalls(vec![ScriptedCall {
            tool: tool.into(),
            arguments,
        }])
    }

    /// One tool call with the model's text of the same turn.
    pub fn say_and_call(
        text: impl Into<String>,
        tool: impl Into<String>,
        arguments: Value,
    ) -> Self {
        Turn::Say(
            text.into(),
            vec![ScriptedCall {
                tool: tool.into(),
                arguments,
            }],
        )
    }
}

/// Token usage a scripted answer reports (the shape of the worker's `conversation::Usage`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
}

impl Usage {
    /// Saturates: a hostile script may report `u64::MAX`.
    pub fn total(&self) -> u64 {
        self.input_tokens.saturating_add(self.output_tokens)
    }
}

/// What recorded request headers carrying a credential show instead of it (the worker's
/// `secret::MASK`), so a test can print a recorded request without leaking a key.
pub const MASK: &str = "<redacted>";

/// What a model answers, turn by turn.
#[derive(Clone, Debug, PartialEq)]
pub struct Script {
    pub turns: Vec<Turn>,
    /// Waited before every answer.
    pub latency: Duration,
    /// Usage reported per call; None estimates about four characters per token.
    pub usage: Option<Usage>,
    /// Leave `usage` out of OpenAI-format answers (as some compatible servers do).
    pub omit_usage: bool,
    /// Number tool calls from 0 in every answer (`call_0`, `call_1`, ... as several
    /// OpenAI-compatible servers do), so two answers reuse the same call ids; by default an id
    /// also names its turn (`call_{turn}_{i}`).
    pub call_ids_per_answer: bool,
    /// The model's context window, in the devkit's tokens ([`prompt_tokens`]): a request whose
    /// prompt and output cap exceed it is refused in the wire format's own words (OpenAI's rule:
    /// `max_completion_tokens` counts against the window). None: any length.
    pub context_window: Option<u64>,
}

impl Script {
    pub fn new(turns: Vec<Turn>) -> Self {
        Script {
            turns,
            latency: Duration::ZERO,
            usage: None,
            omit_usage: false,
            call_ids_per_answer: false,
            context_window: None,
        }
    }

    /// Refuses a request whose [`prompt_tokens`] and output cap exceed `tokens`.
    pub fn with_context_window(mut self, tokens: u64) -> Self {
        self.context_window = Some(tokens);
        self
    }

    /// Numbers tool calls from 0 in every answer: `call_0` again and again.
    pub fn with_call_ids_per_answer(mut self) -> Self {
        self.call_ids_per_answer = true;
        self
    }

    /// Answers in the OpenAI format without `usage` (Anthropic's format requires it).
    pub fn without_usage(mut self) -> Self {
        self.omit_usage = true;
        self
    }

    pub fn with_latency(mut self, latency: Duration) -> Self {
        self.latency = latency;
        self
    }

    pub fn with_usage(mut self, input_tokens: u64, output_tokens: u64) -> Self {
        self.usage = Some(Usage {
            input_tokens,
            output_tokens,
        });
        self
    }
}

/// A failure to inject.
#[derive(Clone, Debug, PartialEq)]
pub enum Fault {
    /// 429 with `retry-after` (whole seconds, rounded up) and `retry-after-ms` when given.
    RateLimited { retry_after: Option<Duration> },
    /// 503.
    ServiceUnavailable,
    /// 503 with a `retry-after` (OpenAI: and `retry-after-ms`): the provider down for a while,
    /// an outage (a 429 is a busy limit, waited out inside the task).
    Outage { retry_after: Duration },
    /// 529 `overloaded_error`.
    Overloaded,
    /// 500.
    ServerError,
    /// 200 with JSON that is no response of the format.
    MalformedBody,
    /// 200 with the first half of a valid response.
    TruncatedBody,
    /// Waits this long (longer than the client timeout) before answering normally.
    Hang(Duration),
    /// The conversation does not fit the context, as the vendor of the wire format says it:
    /// OpenAI 400 `context_length_exceeded`, Anthropic 400 "prompt is too long".
    ContextExceeded,
    /// llama.cpp's older answer to a conversation past its context: a 500 `server_error`
    /// "Context size has been exceeded." (in either wire format's envelope).
    LlamaCppContextExceeded,
}

/// A provider's rate limit, modelled on what OpenAI and Anthropic document, not on what the
/// worker expects:
///
/// - **Stated per minute.** Every answer, 200 or 429, states the per-minute budgets: OpenAI
///   `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, the reset a Go duration, "the time
///   until the rate limit resets to its initial state" (the bucket full again); Anthropic
///   `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,remaining,reset}`,
///   the reset an RFC 3339 instant when the bucket is full again
///   (<https://platform.openai.com/docs/guides/rate-limits>,
///   <https://docs.anthropic.com/en/api/rate-limits>). The per-minute buckets refill
///   continuously ("token bucket ... continuously replenished", Anthropic) and a request counts
///   when it arrives and is let through; a refused one costs nothing. `limit` is the per-minute
///   figure: no burst is stated that the providers do not state. One limit per model for
///   every client, as the providers' are their organisation's (replicas on one key share it).
/// - **Enforced quantized.** "Rate limits may be quantized, meaning they are enforced over
///   shorter periods of time in proportion to your rate limit" (OpenAI: 60,000 requests a
///   minute "may be enforced as 1,000 requests/second"; Anthropic the same with 60 RPM as 1 a
///   second). So a burst is refused while `remaining` still shows plenty. The documents do not
///   say in what shape the second's worth is enforced, so both are here ([`Quantization`]): a
///   fixed window per second of the provider's clock (harsher: two calls 10 ms apart across a
///   window's edge pass, three in one window do not, whatever their spacing), or a bucket
///   holding a second's worth, refilled evenly. Benchmarks measure against the window.
/// - **Refused with a wait.** Beyond either, 429 with the figures, a `rate_limit_exceeded` /
///   `rate_limit_error` body and the wait until a request would pass: OpenAI `retry-after-ms`
///   and `retry-after` (whole seconds, rounded up), Anthropic `retry-after` (whole seconds,
///   rounded up).
/// - **Or stating nothing** ([`RateLimit::stated`] false): vLLM, Ollama and llama.cpp send no
///   rate-limit headers; only their refusals (429, here without a wait) teach a client.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RateLimit {
    /// Requests per minute: the stated `limit`.
    pub requests_per_minute: u32,
    /// Tokens per minute (input and the request's output cap, as OpenAI counts them at
    /// arrival); `None`: a large budget stated that never binds.
    pub tokens_per_minute: Option<u64>,
    /// How the per-minute limits are enforced over each second.
    pub quantization: Quantization,
    /// Whether answers state the figures (OpenAI, Anthropic) or nothing (vLLM, Ollama).
    pub stated: bool,
}

impl RateLimit {
    /// `requests_per_minute`, stated, enforced as a second's worth per second window.
    pub fn per_minute(requests_per_minute: u32) -> Self {
        RateLimit {
            requests_per_minute,
            tokens_per_minute: None,
            quantization: Quantization::SecondWindow,
            stated: true,
        }
    }
}

/// How a per-minute limit is enforced over each second (see [`RateLimit`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quantization {
    /// At most a second's worth (rounded down, at least 1) arrives in each window
    /// `[k s, (k + 1) s)` of the provider's clock.
    SecondWindow,
    /// A bucket holding a second's worth, refilled evenly, full at the start.
    SecondBucket,
}

/// What a model's rate limit saw ([`ScriptedModel::rate_limit_use`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RateLimitUse {
    pub admitted: u64,
    pub refused: u64,
    /// The rate requests were let through at, over the limit's rate: the requests let through
    /// after the first one, over the limit's rate times the time from the first one let
    /// through to the last (a pace of exactly the limit is 1; counting from the first request
    /// let through leaves out the fencepost and a run's first and last partial windows).
    pub share_used: f64,
    /// The most requests that arrived within any 100 ms: a crowd sent at once (a herd at the
    /// end of a wait) shows here.
    pub most_in_100ms: u64,
    /// The shortest time between two requests, one after the other (`None` below two): how
    /// evenly they were spaced.
    pub closest: Option<Duration>,
}

/// Arrivals remembered per model for [`RateLimitUse::most_in_100ms`].
const MAX_ARRIVALS: usize = 100_000;

/// One per-minute budget and its per-second enforcement.
#[derive(Clone, Copy, Debug)]
struct Quota {
    per_minute: f64,
    /// The per-minute bucket (what is stated).
    level: f64,
    /// The second's-worth bucket ([`Quantization::SecondBucket`]).
    second_level: f64,
    /// The window ([`Quantization::SecondWindow`]) and what arrived in it.
    window: i64,
    in_window: f64,
}

impl Quota {
    fn new(per_minute: f64) -> Self {
        Quota {
            per_minute,
            level: per_minute,
            second_level: (per_minute / 60.0).max(1.0),
            window: i64::MIN,
            in_window: 0.0,
        }
    }

    fn per_second(&self) -> f64 {
        self.per_minute / 60.0
    }

    /// The most a window lets through: a second's worth, at least one request's cost.
    fn window_cap(&self, cost: f64) -> f64 {
        self.per_second().floor().max(cost)
    }

    /// The second's-worth bucket's size: at least one request.
    fn second_cap(&self) -> f64 {
        self.per_second().max(1.0)
    }

    fn refill(&mut self, elapsed: f64) {
        self.level = (self.level + elapsed * self.per_second()).min(self.per_minute);
        self.second_level =
            (self.second_level + elapsed * self.per_second()).min(self.second_cap());
    }

    /// The wait before `cost` would pass at `secs` on the provider's clock (zero: now).
    fn wait(&self, cost: f64, secs: f64, shape: Quantization) -> f64 {
        let rate = self.per_second().max(1e-9);
        let minute = ((cost.min(self.per_minute) - self.level) / rate).max(0.0);
        let second = match shape {
            // A request larger than the bucket passes when it is full.
            Quantization::SecondBucket => {
                ((cost.min(self.second_cap()) - self.second_level) / rate).max(0.0)
            }
            Quantization::SecondWindow => {
                let window = secs.floor() as i64;
                let used = if window == self.window {
                    self.in_window
                } else {
                    0.0
                };
                if used + cost <= self.window_cap(cost) {
                    0.0
                } else {
                    (window + 1) as f64 - secs
                }
            }
        };
        minute.max(second)
    }

    fn take(&mut self, cost: f64, secs: f64) {
        self.level -= cost.min(self.level);
        self.second_level -= cost.min(self.second_level);
        let window = secs.floor() as i64;
        if window != self.window {
            self.window = window;
            self.in_window = 0.0;
        }
        self.in_window += cost;
    }

    /// Until the per-minute bucket is full again.
    fn until_full(&self) -> Duration {
        ceil_ms(((self.per_minute - self.level) / self.per_second().max(1e-9)).max(0.0))
    }
}

/// The state of one model's rate limit.
#[derive(Clone, Debug)]
struct LimitState {
    limit: RateLimit,
    requests: Quota,
    tokens: Quota,
    /// The provider's clock: its second windows start at whole seconds since this.
    origin: tokio::time::Instant,
    at: tokio::time::Instant,
    /// Requests answered 429 by the limit.
    refused: u64,
    /// Requests let through.
    admitted: u64,
    /// When the first request let through came, and the last.
    first_admitted: Option<tokio::time::Instant>,
    last_admitted: Option<tokio::time::Instant>,
    /// When each request came, in order (at most [`MAX_ARRIVALS`]).
    arrivals: Vec<tokio::time::Instant>,
}

/// The tokens budget stated when none binds: large.
const STATED_TOKENS_LIMIT: u64 = 1_000_000;

/// What the rate limit decided for one request: the headers to state, and whether it is over.
struct LimitVerdict {
    headers: Vec<(&'static str, String)>,
    /// Over the limit: answer 429, retry after this.
    retry_after: Option<Duration>,
}

impl LimitState {
    fn new(limit: RateLimit, now: tokio::time::Instant) -> Self {
        LimitState {
            limit,
            requests: Quota::new(f64::from(limit.requests_per_minute.max(1))),
            tokens: Quota::new(limit.tokens_per_minute.unwrap_or(STATED_TOKENS_LIMIT) as f64),
            origin: now,
            at: now,
            refused: 0,
            admitted: 0,
            first_admitted: None,
            last_admitted: None,
            arrivals: Vec::new(),
        }
    }

    /// A request costing `tokens` arrives at `now`.
    fn take(&mut self, format: WireFormat, tokens: u64, now: tokio::time::Instant) -> LimitVerdict {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.requests.refill(elapsed);
        self.tokens.refill(elapsed);
        self.at = now;
        if self.arrivals.len() < MAX_ARRIVALS {
            self.arrivals.push(now);
        }
        let secs = now.saturating_duration_since(self.origin).as_secs_f64();
        let shape = self.limit.quantization;
        let tokens = tokens as f64;
        let mut wait = self.requests.wait(1.0, secs, shape);
        if self.limit.tokens_per_minute.is_some() {
            wait = wait.max(self.tokens.wait(tokens, secs, shape));
        }
        let retry_after = if wait <= 0.0 {
            self.requests.take(1.0, secs);
            self.tokens.take(tokens, secs);
            self.admitted += 1;
            self.first_admitted.get_or_insert(now);
            self.last_admitted = Some(now);
            None
        } else {
            self.refused += 1;
            Some(ceil_ms(wait))
        };
        let headers = if self.limit.stated {
            self.headers(format)
        } else {
            Vec::new()
        };
        LimitVerdict {
            headers,
            retry_after,
        }
    }

    fn headers(&self, format: WireFormat) -> Vec<(&'static str, String)> {
        let figures = |q: &Quota| {
            (
                (q.per_minute as u64).to_string(),
                (q.level.max(0.0).floor() as u64).to_string(),
                q.until_full(),
            )
        };
        let (rl, rr, rt) = figures(&self.requests);
        let (tl, tr, tt) = figures(&self.tokens);
        match format {
            WireFormat::OpenAi => vec![
                ("x-ratelimit-limit-requests", rl),
                ("x-ratelimit-remaining-requests", rr),
                ("x-ratelimit-reset-requests", go_duration(rt)),
                ("x-ratelimit-limit-tokens", tl),
                ("x-ratelimit-remaining-tokens", tr),
                ("x-ratelimit-reset-tokens", go_duration(tt)),
            ],
            WireFormat::Anthropic => {
                let stamp = |d: Duration| {
                    (chrono::Utc::now() + chrono::Duration::from_std(d).unwrap_or_default())
                        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
                };
                vec![
                    ("anthropic-ratelimit-requests-limit", rl),
                    ("anthropic-ratelimit-requests-remaining", rr),
                    ("anthropic-ratelimit-requests-reset", stamp(rt)),
                    ("anthropic-ratelimit-tokens-limit", tl.clone()),
                    ("anthropic-ratelimit-tokens-remaining", tr.clone()),
                    ("anthropic-ratelimit-tokens-reset", stamp(tt)),
                    ("anthropic-ratelimit-input-tokens-limit", tl),
                    ("anthropic-ratelimit-input-tokens-remaining", tr),
                    ("anthropic-ratelimit-input-tokens-reset", stamp(tt)),
                ]
            }
        }
    }

    fn most_in_100ms(&self) -> u64 {
        let mut most = 0;
        let mut from = 0;
        for (i, at) in self.arrivals.iter().enumerate() {
            while self.arrivals[from] + Duration::from_millis(100) <= *at {
                from += 1;
            }
            most = most.max(i + 1 - from);
        }
        most as u64
    }

    fn share_used(&self) -> f64 {
        let (Some(first), Some(last)) = (self.first_admitted, self.last_admitted) else {
            return 0.0;
        };
        let span = last.saturating_duration_since(first).as_secs_f64();
        if span <= 0.0 {
            return 0.0;
        }
        self.admitted.saturating_sub(1) as f64 / (self.requests.per_second() * span)
    }
}

/// A provider's rate limit on its own, for an in-process stand-in (the simulator's world): the
/// very state [`ScriptedModel::set_rate_limit`] enforces over HTTP (see [`RateLimit`]), so the
/// two cannot disagree. Its answers state OpenAI's headers.
#[derive(Clone, Debug)]
pub struct LimitCore(LimitState);

impl LimitCore {
    /// `limit`, its buckets full at `now` and its second windows starting at `now`.
    pub fn new(limit: RateLimit, now: tokio::time::Instant) -> Self {
        LimitCore(LimitState::new(limit, now))
    }

    /// A request costing `tokens` arrives at `now`: the headers its answer states (none when
    /// the limit states nothing) and, over the limit, the wait until a request would pass.
    pub fn take(
        &mut self,
        tokens: u64,
        now: tokio::time::Instant,
    ) -> (Vec<(&'static str, String)>, Option<Duration>) {
        let verdict = self.0.take(WireFormat::OpenAi, tokens, now);
        (verdict.headers, verdict.retry_after)
    }
}

/// `secs` rounded up to the millisecond: a client that waits what it is told is not early.
fn ceil_ms(secs: f64) -> Duration {
    Duration::from_millis((secs * 1000.0).ceil().clamp(0.0, 1e12) as u64)
}

/// A duration as Go prints it, as OpenAI sends its resets: `1s`, `6m0s`, `20ms`, `1.5s`.
pub fn go_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let secs = d.as_secs_f64();
    let minutes = (secs / 60.0).floor() as u64;
    let rest = secs - (minutes * 60) as f64;
    let rest = format!("{rest:.3}");
    let rest = rest.trim_end_matches('0').trim_end_matches('.');
    if minutes == 0 {
        format!("{rest}s")
    } else {
        format!("{minutes}m{rest}s")
    }
}

/// How often a fault applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultTimes {
    Next(u32),
    Always,
}

/// One call as the server received it.
#[derive(Clone, Debug)]
pub struct RecordedRequest {
    pub format: WireFormat,
    pub model: String,
    pub body: Value,
    /// Request headers; `authorization` and `x-api-key` values are masked.
    pub headers: Vec<(String, String)>,
    /// The prompt's length in the devkit's tokens ([`prompt_tokens`]).
    pub prompt_tokens: u64,
}

/// Bytes per token of the devkit's stand-in tokenizer: the usual average of BPE tokenizers over
/// English text and JSON.
pub const DEVKIT_BYTES_PER_TOKEN: u64 = 4;
/// What the devkit's stand-in chat template adds around each message and each tool.
pub const DEVKIT_TOKENS_PER_ITEM: u64 = 4;

/// A request's prompt in the devkit's tokens, as a server counts the text its template renders
/// rather than the JSON: every string and number of the system prompt, the messages and the
/// tools at [`DEVKIT_BYTES_PER_TOKEN`], plus [`DEVKIT_TOKENS_PER_ITEM`] per message and tool.
pub fn prompt_tokens(body: &Value) -> u64 {
    fn text_bytes(v: &Value) -> u64 {
        match v {
            Value::String(s) => s.len() as u64,
            Value::Number(n) => n.to_string().len() as u64,
            Value::Array(items) => items.iter().map(text_bytes).sum(),
            Value::Object(map) => map.values().map(text_bytes).sum(),
            Value::Bool(_) | Value::Null => 0,
        }
    }
    let count = |key: &str| {
        body.get(key)
            .and_then(Value::as_array)
            .map_or(0, |a| a.len() as u64)
    };
    let bytes: u64 = ["system", "messages", "tools"]
        .iter()
        .filter_map(|k| body.get(*k))
        .map(text_bytes)
        .sum();
    bytes.div_ceil(DEVKIT_BYTES_PER_TOKEN)
        + (count("messages") + count("tools")) * DEVKIT_TOKENS_PER_ITEM
}

/// The output cap a request asks for, in either wire format.
fn output_cap(body: &Value) -> u64 {
    ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|k| body.get(*k).and_then(Value::as_u64))
        .unwrap_or(0)
}

#[derive(Default)]
struct Shared {
    scripts: HashMap<String, Script>,
    faults: HashMap<String, Vec<(Fault, Option<u32>)>>,
    /// Faults of one request: (model, text the request body must contain, fault, remaining).
    request_faults: Vec<(String, String, Fault, Option<u32>)>,
    calls: HashMap<(String, WireFormat), u64>,
    requests: Vec<RecordedRequest>,
    /// Rate limits by model.
    limits: HashMap<String, LimitState>,
    /// Headers every answer of a model carries, whatever it is (a hostile provider's).
    answer_headers: HashMap<String, Vec<(String, String)>>,
}

struct Inner {
    shared: Mutex<Shared>,
    /// Models whose answers wait (counted and recorded, not answered) until released.
    held: tokio::sync::watch::Sender<std::collections::HashSet<String>>,
    stop: CancellationToken,
    addr: SocketAddr,
    server: Mutex<Option<JoinHandle<()>>>,
}

/// A running scripted model server; clones share it.
#[derive(Clone)]
pub struct ScriptedModel {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ScriptedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScriptedModel")
            .field("addr", &self.inner.addr)
            .finish()
    }
}

impl ScriptedModel {
    /// Starts the server on `127.0.0.1`, on a free port.
    pub async fn start() -> std::io::Result<Self> {
        Self::start_on(SocketAddr::from(([127, 0, 0, 1], 0))).await
    }

    pub async fn start_on(addr: SocketAddr) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let inner = Arc::new(Inner {
            shared: Mutex::new(Shared::default()),
            held: tokio::sync::watch::Sender::default(),
            stop: CancellationToken::new(),
            addr,
            server: Mutex::new(None),
        });
        let app = Router::new()
            .route("/v1/chat/completions", post(openai_handler))
            .route("/v1/messages", post(anthropic_handler))
            .layer(DefaultBodyLimit::max(64 * 1024 * 1024))
            .with_state(inner.clone());
        // Without TCP_NODELAY, Nagle plus delayed ACKs add tens of ms per call.
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let stop = inner.stop.clone();
        let handle = tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await;
        });
        *lock(&inner.server) = Some(handle);
        Ok(ScriptedModel { inner })
    }

    pub fn addr(&self) -> SocketAddr {
        self.inner.addr
    }

    /// Base URL for an OpenAI-kind provider.
    pub fn base_url_openai(&self) -> String {
        format!("http://{}/v1", self.inner.addr)
    }

    /// Base URL for an Anthropic-kind provider.
    pub fn base_url_anthropic(&self) -> String {
        format!("http://{}", self.inner.addr)
    }

    /// Sets the script of `model` ([`DEFAULT_SCRIPT`] for every model without one).
    pub fn set_script(&self, model: impl Into<String>, script: Script) {
        lock(&self.inner.shared)
            .scripts
            .insert(model.into(), script);
    }

    /// Adds a fault for `model`; faults apply in the order added, each until used up.
    pub fn inject_fault(&self, model: impl Into<String>, fault: Fault, times: FaultTimes) {
        let remaining = match times {
            FaultTimes::Next(n) => Some(n),
            FaultTimes::Always => None,
        };
        lock(&self.inner.shared)
            .faults
            .entry(model.into())
            .or_default()
            .push((fault, remaining));
    }

    /// Adds a fault for the requests of `model` whose body contains `needle` (a task's own
    /// input, say): one poison request fails while the model answers every other. Checked
    /// before the model's own faults.
    pub fn inject_request_fault(
        &self,
        model: impl Into<String>,
        needle: impl Into<String>,
        fault: Fault,
        times: FaultTimes,
    ) {
        let remaining = match times {
            FaultTimes::Next(n) => Some(n),
            FaultTimes::Always => None,
        };
        lock(&self.inner.shared).request_faults.push((
            model.into(),
            needle.into(),
            fault,
            remaining,
        ));
    }

    /// Calls of `model` are counted and recorded as they come, but answered only once
    /// [`ScriptedModel::release`] is called: a worker frozen inside its model call for exactly
    /// as long as a test needs, whatever the machine's load.
    pub fn hold(&self, model: &str) {
        self.inner.held.send_modify(|held| {
            held.insert(model.to_string());
        });
    }

    /// Lets the held calls of `model` (and later ones) be answered.
    pub fn release(&self, model: &str) {
        self.inner.held.send_modify(|held| {
            held.remove(model);
        });
    }

    /// Puts `model` under `limit` (its buckets full now, its second windows starting now):
    /// answers state it (unless it states nothing), a request beyond it is answered 429 with
    /// the wait (see [`RateLimit`]).
    pub fn set_rate_limit(&self, model: impl Into<String>, limit: RateLimit) {
        lock(&self.inner.shared).limits.insert(
            model.into(),
            LimitState::new(limit, tokio::time::Instant::now()),
        );
    }

    /// What the rate limit of `model` saw: the requests it let through and those it answered
    /// 429, and the share of the limit used between the first request and the last one let
    /// through (the calls let through over the most the limit allowed in that time: the full
    /// bucket, then its refill).
    pub fn rate_limit_use(&self, model: &str) -> Option<RateLimitUse> {
        let shared = lock(&self.inner.shared);
        let l = shared.limits.get(model)?;
        Some(RateLimitUse {
            admitted: l.admitted,
            refused: l.refused,
            share_used: l.share_used(),
            most_in_100ms: l.most_in_100ms(),
            closest: l
                .arrivals
                .windows(2)
                .map(|w| w[1].saturating_duration_since(w[0]))
                .min(),
        })
    }

    /// Every answer of `model` (200, 429 or any other) carries `headers`, set last: what a
    /// hostile or broken provider (or gateway) states, e.g. `x-ratelimit-remaining-requests: 0`
    /// with a reset in plain seconds, as Azure-style gateways send. Values that are no valid
    /// header are dropped.
    pub fn set_answer_headers(&self, model: &str, headers: &[(&str, &str)]) {
        lock(&self.inner.shared).answer_headers.insert(
            model.to_string(),
            headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
    }

    /// Removes the faults of `model`, its requests' faults included.
    pub fn clear_faults(&self, model: &str) {
        let mut shared = lock(&self.inner.shared);
        shared.faults.remove(model);
        shared.request_faults.retain(|(m, ..)| m != model);
    }

    /// Calls received for `model`, in both formats, faulted ones included.
    pub fn calls(&self, model: &str) -> u64 {
        lock(&self.inner.shared)
            .calls
            .iter()
            .filter(|((m, _), _)| m == model)
            .map(|(_, n)| n)
            .sum()
    }

    pub fn calls_in_format(&self, model: &str, format: WireFormat) -> u64 {
        lock(&self.inner.shared)
            .calls
            .get(&(model.to_string(), format))
            .copied()
            .unwrap_or(0)
    }

    pub fn total_calls(&self) -> u64 {
        lock(&self.inner.shared).calls.values().sum()
    }

    /// Every request received so far, in arrival order.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        lock(&self.inner.shared).requests.clone()
    }

    /// Stops the server; hanging calls are cut short.
    pub async fn shutdown(&self) {
        self.inner.stop.cancel();
        let handle = lock(&self.inner.server).take();
        if let Some(h) = handle {
            let _ = h.await;
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding this lock cannot leave the counters inconsistent enough to matter.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

async fn openai_handler(
    State(inner): State<Arc<Inner>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    handle(inner, WireFormat::OpenAi, headers, body).await
}

async fn anthropic_handler(
    State(inner): State<Arc<Inner>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    handle(inner, WireFormat::Anthropic, headers, body).await
}

/// What the script needs from the conversation of one request.
struct Conversation {
    assistant_turns: usize,
    input: String,
    last_tool_result: String,
    offered_tools: Vec<String>,
}

/// [`answer_request`], with the headers set for the model ([`ScriptedModel::set_answer_headers`])
/// on whatever it answers.
async fn handle(inner: Arc<Inner>, format: WireFormat, headers: HeaderMap, raw: Bytes) -> Response {
    let model = serde_json::from_slice::<Value>(&raw)
        .ok()
        .and_then(|b| b.get("model").and_then(Value::as_str).map(str::to_string))
        .unwrap_or_default();
    let extra = lock(&inner.shared).answer_headers.get(&model).cloned();
    let mut response = answer_request(inner, format, headers, raw).await;
    for (name, value) in extra.unwrap_or_default() {
        if let (Ok(n), Ok(v)) = (
            axum::http::HeaderName::from_bytes(name.as_bytes()),
            axum::http::HeaderValue::from_str(&value),
        ) {
            response.headers_mut().insert(n, v);
        }
    }
    response
}

async fn answer_request(
    inner: Arc<Inner>,
    format: WireFormat,
    headers: HeaderMap,
    raw: Bytes,
) -> Response {
    let Ok(body) = serde_json::from_slice::<Value>(&raw) else {
        return error(format, 400, "invalid_request_error", "the body is not JSON");
    };
    let model = body
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let (call_index, fault, script, limit_headers) = {
        let mut shared = lock(&inner.shared);
        let count = shared.calls.entry((model.clone(), format)).or_default();
        *count += 1;
        let call_index = shared
            .calls
            .iter()
            .filter(|((m, _), _)| *m == model)
            .map(|(_, n)| *n)
            .sum::<u64>();
        shared.requests.push(RecordedRequest {
            format,
            model: model.clone(),
            prompt_tokens: prompt_tokens(&body),
            body: body.clone(),
            headers: headers
                .iter()
                .map(|(k, v)| {
                    let value = if k == "authorization" || k == "x-api-key" {
                        MASK.to_string()
                    } else {
                        String::from_utf8_lossy(v.as_bytes()).into_owned()
                    };
                    (k.as_str().to_string(), value)
                })
                .collect(),
        });
        // Tokens as OpenAI counts them when a request arrives: its prompt and its output cap.
        let tokens = prompt_tokens(&body).saturating_add(output_cap(&body));
        let verdict = shared
            .limits
            .get_mut(&model)
            .map(|l| l.take(format, tokens, tokio::time::Instant::now()));
        if let Some(LimitVerdict {
            headers,
            retry_after: Some(retry_after),
        }) = verdict
        {
            let stated = shared.limits.get(&model).is_none_or(|l| l.limit.stated);
            drop(shared);
            let mut response = fault_response(
                format,
                &model,
                &Fault::RateLimited {
                    // A server that states nothing says no wait either.
                    retry_after: stated.then_some(retry_after),
                },
                None,
                &body,
            );
            with_headers(&mut response, &headers);
            return response;
        }
        let limit_headers = verdict.map(|v| v.headers);
        let fault = take_request_fault(&mut shared, &model, &raw)
            .or_else(|| take_fault(&mut shared, &model));
        let script = shared
            .scripts
            .get(&model)
            .or_else(|| shared.scripts.get(DEFAULT_SCRIPT))
            .cloned();
        (call_index, fault, script, limit_headers)
    };
    let mut held = inner.held.subscribe();
    let released = tokio::select! {
        released = held.wait_for(|held| !held.contains(&model)) => released.is_ok(),
        _ = inner.stop.cancelled() => false,
    };
    if !released {
        return error(format, 503, "api_error", "server shutting down");
    }
    if let Some(script) = &script
        && !script.latency.is_zero()
        && !sleep_or_stop(&inner, script.latency).await
    {
        return error(format, 503, "api_error", "server shutting down");
    }
    if let Some(fault) = fault {
        match fault {
            Fault::Hang(d) => {
                if !sleep_or_stop(&inner, d).await {
                    return error(format, 503, "api_error", "server shutting down");
                }
            }
            other => return fault_response(format, &model, &other, script.as_ref(), &body),
        }
    }
    let Some(script) = script else {
        return not_found(format, &model);
    };
    if let Some(window) = script.context_window {
        let prompt = prompt_tokens(&body);
        let cap = output_cap(&body);
        if prompt + cap > window {
            return context_exceeded(format, &model, window, prompt, cap);
        }
    }
    let mut response = answer(format, &model, &script, &body, call_index);
    if let Some(headers) = &limit_headers {
        with_headers(&mut response, headers);
    }
    response
}

fn with_headers(response: &mut Response, headers: &[(&'static str, String)]) {
    for (name, value) in headers {
        if let Ok(v) = axum::http::HeaderValue::from_str(value) {
            response.headers_mut().insert(*name, v);
        }
    }
}

fn take_request_fault(shared: &mut Shared, model: &str, raw: &[u8]) -> Option<Fault> {
    let body = String::from_utf8_lossy(raw);
    let index = shared
        .request_faults
        .iter()
        .position(|(m, needle, ..)| m == model && body.contains(needle.as_str()))?;
    let (_, _, fault, remaining) = &mut shared.request_faults[index];
    let fault = fault.clone();
    if let Some(n) = remaining {
        *n = n.saturating_sub(1);
        if *n == 0 {
            shared.request_faults.remove(index);
        }
    }
    Some(fault)
}

fn take_fault(shared: &mut Shared, model: &str) -> Option<Fault> {
    let faults = shared.faults.get_mut(model)?;
    let (fault, remaining) = faults.first_mut()?;
    let fault = fault.clone();
    if let Some(n) = remaining {
        *n = n.saturating_sub(1);
        if *n == 0 {
            faults.remove(0);
        }
    }
    Some(fault)
}

async fn sleep_or_stop(inner: &Inner, d: Duration) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(d) => true,
        _ = inner.stop.cancelled() => false,
    }
}

fn json_response(status: u16, body: &Value) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        status,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn error_body(format: WireFormat, kind: &str, code: Option<&str>, message: &str) -> Value {
    match format {
        WireFormat::OpenAi => json!({
            "error": {"message": message, "type": kind, "param": null, "code": code}
        }),
        WireFormat::Anthropic => json!({
            "type": "error",
            "error": {"type": kind, "message": message},
            "request_id": "req_devkit"
        }),
    }
}

fn error(format: WireFormat, status: u16, kind: &str, message: &str) -> Response {
    json_response(status, &error_body(format, kind, None, message))
}

fn not_found(format: WireFormat, model: &str) -> Response {
    let body = match format {
        WireFormat::OpenAi => error_body(
            format,
            "invalid_request_error",
            Some("model_not_found"),
            &format!("The model `{model}` does not exist or you do not have access to it."),
        ),
        WireFormat::Anthropic => {
            error_body(format, "not_found_error", None, &format!("model: {model}"))
        }
    };
    json_response(404, &body)
}

fn fault_response(
    format: WireFormat,
    model: &str,
    fault: &Fault,
    script: Option<&Script>,
    request: &Value,
) -> Response {
    let anthropic = format == WireFormat::Anthropic;
    match fault {
        Fault::RateLimited { retry_after } => {
            let body = if anthropic {
                error_body(
                    format,
                    "rate_limit_error",
                    None,
                    "This request would exceed the rate limit for your organization.",
                )
            } else {
                error_body(
                    format,
                    "requests",
                    Some("rate_limit_exceeded"),
                    &format!("Rate limit reached for {model} on requests per min (RPM)."),
                )
            };
            let mut response = json_response(429, &body);
            if let Some(ra) = retry_after {
                // OpenAI sends both; Anthropic whole seconds only.
                let h = response.headers_mut();
                let millis = u64::try_from(ra.as_millis()).unwrap_or(u64::MAX);
                h.insert("retry-after", millis.div_ceil(1000).into());
                if !anthropic {
                    h.insert("retry-after-ms", millis.into());
                }
            }
            response
        }
        Fault::ServiceUnavailable => error(
            format,
            503,
            if anthropic {
                "api_error"
            } else {
                "server_error"
            },
            "The service is temporarily unavailable.",
        ),
        Fault::Outage { retry_after } => {
            let mut response = error(
                format,
                503,
                if anthropic {
                    "api_error"
                } else {
                    "server_error"
                },
                "The service is temporarily unavailable.",
            );
            let h = response.headers_mut();
            let millis = u64::try_from(retry_after.as_millis()).unwrap_or(u64::MAX);
            h.insert("retry-after", millis.div_ceil(1000).into());
            if !anthropic {
                h.insert("retry-after-ms", millis.into());
            }
            response
        }
        Fault::Overloaded => error(
            format,
            529,
            if anthropic {
                "overloaded_error"
            } else {
                "server_error"
            },
            "Overloaded",
        ),
        Fault::ServerError => error(
            format,
            500,
            if anthropic {
                "api_error"
            } else {
                "server_error"
            },
            "The server had an error while processing your request.",
        ),
        Fault::MalformedBody => json_response(200, &json!({"unexpected": "not a model response"})),
        Fault::TruncatedBody => {
            let fallback = Script::new(vec![Turn::text("truncated")]);
            let full = answer_body(format, model, script.unwrap_or(&fallback), request, 0);
            let text = full.to_string();
            let half = &text.as_bytes()[..text.len() / 2];
            (
                StatusCode::OK,
                [(axum::http::header::CONTENT_TYPE, "application/json")],
                half.to_vec(),
            )
                .into_response()
        }
        Fault::ContextExceeded if anthropic => error(
            format,
            400,
            "invalid_request_error",
            "prompt is too long: 208310 tokens > 200000 maximum",
        ),
        Fault::ContextExceeded => json_response(
            400,
            &error_body(
                format,
                "invalid_request_error",
                Some("context_length_exceeded"),
                &format!(
                    "This model's maximum context length is 128000 tokens. However, your messages resulted in 131542 tokens ({model})."
                ),
            ),
        ),
        Fault::LlamaCppContextExceeded => json_response(
            500,
            &json!({"error": {"code": 500, "message": "Context size has been exceeded.", "type": "server_error"}}),
        ),
        Fault::Hang(_) => error(format, 500, "api_error", "unreachable fault"),
    }
}

/// A request past the script's window, refused as the wire format's vendor words it, with the
/// sizes.
fn context_exceeded(
    format: WireFormat,
    model: &str,
    window: u64,
    prompt: u64,
    cap: u64,
) -> Response {
    match format {
        WireFormat::Anthropic => error(
            format,
            400,
            "invalid_request_error",
            &format!(
                "prompt is too long: {} tokens > {window} maximum",
                prompt + cap
            ),
        ),
        WireFormat::OpenAi => json_response(
            400,
            &error_body(
                format,
                "invalid_request_error",
                Some("context_length_exceeded"),
                &format!(
                    "This model's maximum context length is {window} tokens. However, you requested {} tokens ({prompt} in the messages, {cap} in the completion) ({model}).",
                    prompt + cap
                ),
            ),
        ),
    }
}

fn answer(
    format: WireFormat,
    model: &str,
    script: &Script,
    request: &Value,
    call_index: u64,
) -> Response {
    let turns = conversation(format, request).assistant_turns;
    if let Some(Turn::Raw(body)) = script.turns.get(turns).or(script.turns.last()) {
        return (
            StatusCode::OK,
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            body.clone(),
        )
            .into_response();
    }
    json_response(
        200,
        &answer_body(format, model, script, request, call_index),
    )
}

fn conversation(format: WireFormat, request: &Value) -> Conversation {
    let empty = Vec::new();
    let messages = request
        .get("messages")
        .and_then(Value::as_array)
        .unwrap_or(&empty);
    let role = |m: &Value, r: &str| m.get("role").and_then(Value::as_str) == Some(r);
    let assistant_turns = messages.iter().filter(|m| role(m, "assistant")).count();
    let input = messages
        .iter()
        .find(|m| role(m, "user"))
        .map(|m| content_text(m.get("content")))
        .unwrap_or_default();
    let last_tool_result = match format {
        WireFormat::OpenAi => messages
            .iter()
            .rev()
            .find(|m| role(m, "tool"))
            .map(|m| content_text(m.get("content"))),
        WireFormat::Anthropic => messages
            .iter()
            .rev()
            .filter_map(|m| m.get("content").and_then(Value::as_array))
            .flat_map(|blocks| blocks.iter().rev())
            .find(|b| b.get("type").and_then(Value::as_str) == Some("tool_result"))
            .map(|b| content_text(b.get("content"))),
    }
    .unwrap_or_default();
    let offered_tools = request
        .get("tools")
        .and_then(Value::as_array)
        .map(|tools| {
            tools
                .iter()
                .filter_map(|t| {
                    t.get("function")
                        .and_then(|f| f.get("name"))
                        .or_else(|| t.get("name"))
                        .and_then(Value::as_str)
                        .map(str::to_string)
                })
                .collect()
        })
        .unwrap_or_default();
    Conversation {
        assistant_turns,
        input,
        last_tool_result,
        offered_tools,
    }
}

/// The text of a message content: a string, or the text blocks/parts of an array.
fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter(|p| matches!(p.get("type").and_then(Value::as_str), Some("text") | None))
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// The marker of an input field placeholder, `${input.<field>}`.
const INPUT_FIELD: &str = "${input.";

/// A field of the conversation's input read as a JSON object; None when the input is not one or
/// lacks the field.
fn input_field(conv: &Conversation, field: &str) -> Option<Value> {
    serde_json::from_str::<Value>(&conv.input)
        .ok()?
        .get(field)
        .cloned()
}

/// Replaces each `${input.<field>}` by the field (a string as it is, other values as JSON); a
/// field that is not there stays as written, so a script's mistake shows in its output.
fn render_input_fields(template: &str, conv: &Conversation) -> String {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(start) = rest.find(INPUT_FIELD) {
        let after = &rest[start + INPUT_FIELD.len()..];
        let Some(end) = after.find('}') else {
            break;
        };
        out.push_str(&rest[..start]);
        match input_field(conv, &after[..end]) {
            Some(Value::String(s)) => out.push_str(&s),
            Some(v) => out.push_str(&v.to_string()),
            None => out.push_str(&rest[start..start + INPUT_FIELD.len() + end + 1]),
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    out
}

fn render(template: &str, conv: &Conversation, call_index: u64) -> String {
    render_input_fields(template, conv)
        .replace("${input}", &conv.input)
        .replace("${last_tool_result}", &conv.last_tool_result)
        .replace("${call_index}", &call_index.to_string())
}

fn render_value(template: &Value, conv: &Conversation, call_index: u64) -> Value {
    let whole_field = |s: &str| {
        s.strip_prefix(INPUT_FIELD)?
            .strip_suffix('}')
            .filter(|f| !f.contains('}'))
            .and_then(|f| input_field(conv, f))
    };
    match template {
        Value::String(s) => {
            whole_field(s).unwrap_or_else(|| Value::String(render(s, conv, call_index)))
        }
        Value::Array(items) => Value::Array(
            items
                .iter()
                .map(|v| render_value(v, conv, call_index))
                .collect(),
        ),
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| (k.clone(), render_value(v, conv, call_index)))
                .collect(),
        ),
        other => other.clone(),
    }
}

fn offered_name(conv: &Conversation, tool: &str) -> String {
    let suffix = format!("__{tool}");
    conv.offered_tools
        .iter()
        .find(|n| n.as_str() == tool)
        .or_else(|| conv.offered_tools.iter().find(|n| n.ends_with(&suffix)))
        .cloned()
        .unwrap_or_else(|| tool.to_string())
}

fn answer_body(
    format: WireFormat,
    model: &str,
    script: &Script,
    request: &Value,
    call_index: u64,
) -> Value {
    let conv = conversation(format, request);
    let turn = script
        .turns
        .get(conv.assistant_turns)
        .or(script.turns.last())
        .cloned()
        .unwrap_or_else(|| Turn::text("(empty script)"));
    let (text, calls) = match &turn {
        Turn::Text(t) => (Some(t.as_str()), &[][..]),
        Turn::ToolCalls(calls) => (None, calls.as_slice()),
        Turn::Say(t, calls) => (Some(t.as_str()), calls.as_slice()),
        Turn::Cut(t) | Turn::Raw(t) => (Some(t.as_str()), &[][..]),
    };
    let cut = matches!(turn, Turn::Cut(_));
    let text = text.map(|t| render(t, &conv, call_index));
    let calls: Vec<_> = calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            (
                if script.call_ids_per_answer {
                    i.to_string()
                } else {
                    format!("{}_{}", conv.assistant_turns, i)
                },
                offered_name(&conv, &c.tool),
                render_value(&c.arguments, &conv, call_index),
            )
        })
        .collect();
    let output_chars = text.as_ref().map_or(0, String::len)
        + calls.iter().map(|c| c.2.to_string().len()).sum::<usize>();
    let usage = script.usage.unwrap_or(Usage {
        input_tokens: (request.to_string().len() as u64 / 4).max(1),
        output_tokens: (output_chars as u64 / 4).max(1),
    });
    match format {
        WireFormat::OpenAi => {
            let mut message = json!({"role": "assistant", "content": text, "refusal": null});
            if !calls.is_empty() {
                message["tool_calls"] = calls
                    .iter()
                    .map(|(id, name, args)| {
                        json!({
                            "id": format!("call_{id}"),
                            "type": "function",
                            "function": {"name": name, "arguments": args.to_string()},
                        })
                    })
                    .collect();
            }
            let mut body = json!({
                "id": format!("chatcmpl-devkit-{call_index}"),
                "object": "chat.completion",
                "created": chrono::Utc::now().timestamp(),
                "model": model,
                "choices": [{
                    "index": 0,
                    "message": message,
                    "logprobs": null,
                    "finish_reason": if cut { "length" } else if calls.is_empty() { "stop" } else { "tool_calls" },
                }],
                "usage": {
                    "prompt_tokens": usage.input_tokens,
                    "completion_tokens": usage.output_tokens,
                    "total_tokens": usage.total(),
                },
            });
            if script.omit_usage
                && let Some(o) = body.as_object_mut()
            {
                o.remove("usage");
            }
            body
        }
        WireFormat::Anthropic => {
            let mut content: Vec<Value> = text
                .iter()
                .map(|t| json!({"type": "text", "text": t}))
                .collect();
            content.extend(calls.iter().map(|(id, name, args)| {
                json!({"type": "tool_use", "id": format!("toolu_{id}"), "name": name, "input": args})
            }));
            json!({
                "id": format!("msg_devkit_{call_index}"),
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": content,
                "stop_reason": if cut { "max_tokens" } else if calls.is_empty() { "end_turn" } else { "tool_use" },
                "stop_sequence": null,
                "usage": {
                    "input_tokens": usage.input_tokens,
                    "output_tokens": usage.output_tokens,
                },
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv(input: &str) -> Conversation {
        Conversation {
            assistant_turns: 0,
            input: input.to_string(),
            last_tool_result: "refunded".into(),
            offered_tools: Vec::new(),
        }
    }

    #[test]
    fn input_fields_render_as_text_and_keep_their_type_as_a_whole_argument() {
        let c = conv(r#"{"orderId": "o-1", "amountCents": 25000, "nested": {"a": 1}}"#);
        assert_eq!(
            render(
                "Order ${input.orderId}: ${input.amountCents} cents, ${last_tool_result}",
                &c,
                1
            ),
            "Order o-1: 25000 cents, refunded"
        );
        assert_eq!(
            render_value(
                &json!({"orderId": "${input.orderId}", "amountCents": "${input.amountCents}",
                        "nested": "${input.nested}", "text": "n=${input.amountCents}"}),
                &c,
                1
            ),
            json!({"orderId": "o-1", "amountCents": 25000, "nested": {"a": 1}, "text": "n=25000"})
        );
        // A missing field, or an input that is not JSON, leaves the placeholder as written.
        assert_eq!(
            render("${input.missing} ${input.orderId", &c, 1),
            "${input.missing} ${input.orderId"
        );
        let plain = conv("o-2");
        assert_eq!(
            render_value(&json!("${input.amountCents}"), &plain, 1),
            json!("${input.amountCents}")
        );
        assert_eq!(render("${input}", &plain, 1), "o-2");
    }

    #[test]
    fn a_request_fault_hits_only_the_requests_that_hold_its_text_and_comes_first() {
        let mut shared = Shared::default();
        shared
            .request_faults
            .push(("m".into(), "poison-0".into(), Fault::ServerError, Some(2)));
        shared
            .faults
            .insert("m".into(), vec![(Fault::Overloaded, None)]);
        let poison = br#"{"model": "m", "messages": [{"role": "user", "content": "poison-0"}]}"#;
        let healthy = br#"{"model": "m", "messages": [{"role": "user", "content": "healthy-0"}]}"#;
        assert_eq!(take_request_fault(&mut shared, "m", healthy), None);
        assert_eq!(take_request_fault(&mut shared, "other", poison), None);
        assert_eq!(
            take_request_fault(&mut shared, "m", poison),
            Some(Fault::ServerError)
        );
        assert_eq!(
            take_request_fault(&mut shared, "m", poison),
            Some(Fault::ServerError)
        );
        assert_eq!(
            take_request_fault(&mut shared, "m", poison),
            None,
            "used up"
        );
        assert_eq!(take_fault(&mut shared, "m"), Some(Fault::Overloaded));
    }

    fn header<'a>(v: &'a LimitVerdict, name: &str) -> Option<&'a str> {
        v.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    /// OpenAI's documented shape: 120 a minute stated, a second's worth (2) let through in
    /// each second window while `remaining` still shows plenty, a refused request costing
    /// nothing and told when the next window opens.
    #[test]
    fn a_per_minute_limit_is_stated_and_enforced_a_seconds_worth_per_window() {
        let t0 = tokio::time::Instant::now();
        let mut l = LimitState::new(RateLimit::per_minute(120), t0);
        let a = l.take(WireFormat::OpenAi, 10, t0);
        assert_eq!(a.retry_after, None);
        assert_eq!(header(&a, "x-ratelimit-limit-requests"), Some("120"));
        assert_eq!(header(&a, "x-ratelimit-remaining-requests"), Some("119"));
        assert_eq!(header(&a, "x-ratelimit-reset-requests"), Some("500ms"));
        let b = l.take(WireFormat::OpenAi, 10, t0 + Duration::from_millis(10));
        assert_eq!(b.retry_after, None);
        let c = l.take(WireFormat::OpenAi, 10, t0 + Duration::from_millis(20));
        assert_eq!(
            c.retry_after,
            Some(Duration::from_millis(980)),
            "the third in a window"
        );
        assert_eq!(
            header(&c, "x-ratelimit-remaining-requests"),
            Some("118"),
            "refused while the minute shows plenty, and free"
        );
        // The next window lets two more through, however close to the last.
        let d = l.take(WireFormat::OpenAi, 10, t0 + Duration::from_millis(1000));
        assert_eq!(d.retry_after, None);
        assert_eq!((l.admitted, l.refused), (3, 1));
    }

    /// One quota for every client (OpenAI's and Anthropic's limits are their organisation's,
    /// so replicas on one key share them), and a quantized one keeps its stated per-minute
    /// bucket nearly full: a fleet using the whole limit, one call every 0.5 s, reads the same
    /// `remaining` and reset after each call as a lone client calling every 2 s. Replicas cannot read
    /// their company from it (the pacer's module docs, "Replicas pacing alone").
    #[test]
    fn a_quantized_quota_is_shared_and_its_stated_bucket_stays_nearly_full() {
        let t0 = tokio::time::Instant::now();
        let remaining_after = |every_ms: u64| {
            let mut l = LimitState::new(RateLimit::per_minute(120), t0);
            let mut seen = std::collections::BTreeSet::new();
            for k in 0..(60_000 / every_ms) {
                let v = l.take(
                    WireFormat::OpenAi,
                    1,
                    t0 + Duration::from_millis(k * every_ms),
                );
                assert_eq!(v.retry_after, None, "call {k}, every {every_ms} ms");
                seen.insert(["remaining", "reset"].map(|f| {
                    header(&v, &format!("x-ratelimit-{f}-requests"))
                        .unwrap()
                        .to_string()
                }));
            }
            seen
        };
        // Four replicas, each a call every 2 s, at phases 0.5 s apart: the whole limit.
        let fleet = remaining_after(500);
        let alone = remaining_after(2000);
        assert_eq!(fleet, alone, "the fleet's calls do not show in remaining");
        assert_eq!(
            fleet.into_iter().collect::<Vec<_>>(),
            vec![["119".to_string(), "500ms".to_string()]]
        );
    }

    /// The bucket shape: a second's worth at most at once, refilled evenly.
    #[test]
    fn the_bucket_shape_lets_a_seconds_worth_through_then_the_refill() {
        let t0 = tokio::time::Instant::now();
        let limit = RateLimit {
            quantization: Quantization::SecondBucket,
            ..RateLimit::per_minute(120)
        };
        let mut l = LimitState::new(limit, t0);
        assert_eq!(l.take(WireFormat::OpenAi, 1, t0).retry_after, None);
        assert_eq!(l.take(WireFormat::OpenAi, 1, t0).retry_after, None);
        assert_eq!(
            l.take(WireFormat::OpenAi, 1, t0).retry_after,
            Some(Duration::from_millis(500))
        );
        let later = t0 + Duration::from_millis(500);
        assert_eq!(l.take(WireFormat::OpenAi, 1, later).retry_after, None);
    }

    /// Anthropic states every budget with RFC 3339 resets; a server like vLLM states nothing.
    #[test]
    fn anthropic_states_rfc3339_resets_and_a_local_server_nothing() {
        let t0 = tokio::time::Instant::now();
        let mut l = LimitState::new(RateLimit::per_minute(60), t0);
        let v = l.take(WireFormat::Anthropic, 10, t0);
        assert_eq!(header(&v, "anthropic-ratelimit-requests-limit"), Some("60"));
        let reset = header(&v, "anthropic-ratelimit-requests-reset").unwrap();
        assert!(
            chrono::DateTime::parse_from_rfc3339(reset).is_ok(),
            "{reset}"
        );
        assert!(header(&v, "x-ratelimit-limit-requests").is_none());
        let quiet = RateLimit {
            stated: false,
            ..RateLimit::per_minute(60)
        };
        let mut l = LimitState::new(quiet, t0);
        assert!(l.take(WireFormat::OpenAi, 10, t0).headers.is_empty());
        let refused = l.take(WireFormat::OpenAi, 10, t0);
        assert!(refused.retry_after.is_some() && refused.headers.is_empty());
    }
}
