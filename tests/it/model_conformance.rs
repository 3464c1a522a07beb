//! One conformance suite for the model stand-ins, held to what the real providers document,
//! not to what the worker expects:
//!
//! - On the wire (`wire::`), the devkit's scripted model (`devkit/src/model.rs`) in both of its
//!   formats. OpenAI's answers, headers and error bodies are validated against OpenAI's own
//!   OpenAPI document (`CreateChatCompletionResponse`, `ErrorResponse`, the `TooManyRequests`
//!   response's `Retry-After`): its schemas, copied verbatim from `shared/specs/openai-openapi.json`
//!   by `scripts/extract-openai-schemas` into `tests/data/openai/` and held to the document.
//!   Anthropic publishes no OpenAPI document: its Messages shapes are written below as JSON
//!   Schema from its SDK's types (generated from Anthropic's own spec: `anthropic-sdk-python`,
//!   `src/anthropic/types/message.py`, `usage.py`, `stop_reason.py`, `text_block.py`,
//!   `tool_use_block.py`) and its errors page (<https://docs.anthropic.com/en/api/errors>:
//!   `{"type": "error", "error": {"type", "message"}}`, each status with its one error type).
//!   Rate-limit headers are checked for their documented names and formats only
//!   (<https://platform.openai.com/docs/guides/rate-limits>,
//!   <https://docs.anthropic.com/en/api/rate-limits>), not for a pacing, which is the
//!   stand-in's own business.
//! - Through the worker's provider seam (`seam::`), what the core relies on from any model: the
//!   devkit model through the real OpenAI and Anthropic adapters, and the simulator's in-process
//!   model (`src/devkit/world/model.rs`), where it applies (its own script language, no faults
//!   this suite can schedule).
//!
//! `flaws::` shows the suite can fail: each deliberate departure ([`Flaw`]), played by a proxy
//! that rewrites the stand-in's answer as a stand-in could get it wrong, fails the cases named
//! for it.
//!
//! Departures the suite found, left as they are (other streams own the model stand-in) and kept
//! out of the cases: the devkit's `Overloaded` fault answers 529 in the OpenAI format (OpenAI
//! documents 429, 500 and 503, never 529), and its `ServiceUnavailable` fault answers 503 in the
//! Anthropic format (Anthropic documents 500 `api_error` and 529 `overloaded_error`, no 503).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use abada_agent_worker::conversation::{Message, ToolSpec};
use abada_agent_worker::devkit::model::{
    Fault, FaultTimes, RateLimit, Script, ScriptedModel, Turn, WireFormat,
};
use abada_agent_worker::provider::{
    ModelProvider, ModelRequest, ProviderError, ProviderKind, ProviderRegistry, ProviderSettings,
};
use abada_agent_worker::secret::SecretSource;
use abada_sim::world::{FaultPlan, World, WorldModel, WorldOptions};
use serde_json::{Value, json};

// ---- the documents ---------------------------------------------------------------------------

/// The schemas of OpenAI's OpenAPI document this suite validates against, with every schema they
/// reference, copied verbatim by `scripts/extract-openai-schemas` into `tests/data/openai/`
/// (so the suite runs on a clone without the whole 3.4 MB document);
/// [`the_extract_is_the_official_documents`] holds the copy to the document.
fn openai_spec() -> &'static Value {
    static SPEC: OnceLock<Value> = OnceLock::new();
    SPEC.get_or_init(|| {
        serde_json::from_str(include_str!("../data/openai/openapi-schemas.json"))
            .expect("the extract of OpenAI's OpenAPI document is JSON")
    })
}

/// The official document, where one is at hand: `ABADA_SPECS_DIR`, else `shared/specs/` beside
/// the repository or beside a folder above it (a worktree's).
fn official_openai_document() -> Option<(std::path::PathBuf, Vec<u8>)> {
    let path = match std::env::var("ABADA_SPECS_DIR") {
        Ok(dir) => Some(std::path::PathBuf::from(dir).join("openai-openapi.json")),
        Err(_) => std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .ancestors()
            .skip(1)
            .map(|dir| dir.join("shared/specs/openai-openapi.json"))
            .find(|path| path.is_file()),
    }?;
    let bytes =
        std::fs::read(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    Some((path, bytes))
}

/// The extract is the official document's schemas, verbatim: the same SHA-256 of the document,
/// and every schema reachable from the roots equal to the document's. Where no document is at
/// hand (a clone without `shared/`), only the extract's own closure is checked: every `$ref` in
/// it resolves inside it.
#[test]
fn the_extract_is_the_official_documents() {
    use sha2::{Digest, Sha256};
    let extract = openai_spec();
    let schemas = extract["components"]["schemas"]
        .as_object()
        .expect("the extract has components.schemas");
    let refs = |v: &Value| -> Vec<String> {
        let text = v.to_string();
        text.split("\"#/components/schemas/")
            .skip(1)
            .map(|rest| rest.split('"').next().unwrap_or_default().to_owned())
            .collect()
    };
    for (name, schema) in schemas {
        for r in refs(schema) {
            assert!(
                schemas.contains_key(&r),
                "{name} refers to {r}, which the extract lacks"
            );
        }
    }
    let Some((path, bytes)) = official_openai_document() else {
        eprintln!("OpenAI's OpenAPI document is not at hand: checked the extract's closure only");
        return;
    };
    let digest: String = Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(
        extract["sha256"].as_str(),
        Some(digest.as_str()),
        "{} changed since the extract was made: run scripts/extract-openai-schemas",
        path.display()
    );
    let document: Value = serde_json::from_slice(&bytes).expect("the document is JSON");
    let mut seen = std::collections::BTreeSet::new();
    let mut todo: Vec<String> = extract["roots"]
        .as_array()
        .expect("the extract names its roots")
        .iter()
        .map(|r| r.as_str().expect("a root is a name").to_owned())
        .collect();
    while let Some(name) = todo.pop() {
        if seen.insert(name.clone()) {
            let schema = &document["components"]["schemas"][&name];
            assert_eq!(
                &schemas[&name], schema,
                "the extract's {name} is not the document's"
            );
            todo.extend(refs(schema));
        }
    }
    assert_eq!(
        seen.len(),
        schemas.len(),
        "the extract holds schemas the roots do not reach"
    );
}

/// A validator of the OpenAPI document's `components/schemas/{name}` (OpenAPI 3.1 schemas are
/// JSON Schema 2020-12; the document's other components resolve its `$ref`s).
fn openai_schema(name: &str) -> jsonschema::Validator {
    let spec = openai_spec();
    let root = json!({
        "$ref": format!("#/components/schemas/{name}"),
        "components": spec["components"],
    });
    jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .offline()
        .build(&root)
        .unwrap_or_else(|e| panic!("the OpenAPI schema {name} compiles: {e}"))
}

/// Anthropic's Message and error shapes, from its SDK's generated types and its errors page (see
/// the module docs).
fn anthropic_schema(name: &str) -> jsonschema::Validator {
    let schema = match name {
        "Message" => json!({
            "type": "object",
            "required": ["id", "type", "role", "content", "model", "stop_reason", "stop_sequence", "usage"],
            "properties": {
                "id": {"type": "string", "minLength": 1},
                "type": {"const": "message"},
                "role": {"const": "assistant"},
                "model": {"type": "string"},
                "content": {"type": "array", "items": {"oneOf": [
                    {"type": "object", "required": ["type", "text"],
                     "properties": {"type": {"const": "text"}, "text": {"type": "string"},
                                    "citations": {"type": ["array", "null"]}}},
                    {"type": "object", "required": ["type", "id", "name", "input"],
                     "properties": {"type": {"const": "tool_use"}, "id": {"type": "string", "minLength": 1},
                                    "name": {"type": "string", "minLength": 1}, "input": {"type": "object"}}}
                ]}},
                "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use",
                                         "pause_turn", "refusal", "model_context_window_exceeded", null]},
                "stop_sequence": {"type": ["string", "null"]},
                "usage": {"type": "object", "required": ["input_tokens", "output_tokens"],
                          "properties": {"input_tokens": {"type": "integer", "minimum": 0},
                                         "output_tokens": {"type": "integer", "minimum": 0},
                                         "cache_creation_input_tokens": {"type": ["integer", "null"]},
                                         "cache_read_input_tokens": {"type": ["integer", "null"]}}}
            }
        }),
        "Error" => json!({
            "type": "object",
            "required": ["type", "error"],
            "properties": {
                "type": {"const": "error"},
                "error": {"type": "object", "required": ["type", "message"],
                          "properties": {"type": {"enum": [
                              "invalid_request_error", "authentication_error", "billing_error",
                              "permission_error", "not_found_error", "request_too_large",
                              "rate_limit_error", "api_error", "timeout_error", "overloaded_error"]},
                                         "message": {"type": "string"}}},
                "request_id": {"type": ["string", "null"]}
            }
        }),
        other => panic!("no Anthropic schema {other}"),
    };
    jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .offline()
        .build(&schema)
        .expect("the Anthropic schema compiles")
}

/// The one error type Anthropic's errors page gives each status.
fn anthropic_error_type(status: u16) -> Option<&'static str> {
    Some(match status {
        400 => "invalid_request_error",
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        500 => "api_error",
        504 => "timeout_error",
        529 => "overloaded_error",
        _ => return None,
    })
}

/// The statuses OpenAI's error-code guide documents for the API
/// (<https://platform.openai.com/docs/guides/error-codes>).
const OPENAI_STATUSES: [u16; 7] = [400, 401, 403, 404, 429, 500, 503];

fn valid(validator: &jsonschema::Validator, what: &str, body: &Value) -> Result<(), String> {
    let errors: Vec<String> = validator
        .iter_errors(body)
        .take(5)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{what} breaks the document: {}\n{body}",
            errors.join("; ")
        ))
    }
}

// ---- the subject: a stand-in on the wire, maybe behind a flaw --------------------------------

/// A deliberate departure from the documents, played on the stand-in's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flaw {
    /// OpenAI: a tool call's `arguments` sent as a JSON object instead of a string.
    ArgumentsAsObject,
    /// OpenAI: `finish_reason` worded as Anthropic's `tool_use`.
    FinishReasonMisworded,
    /// OpenAI: the choice without its `index`.
    ChoiceWithoutIndex,
    /// OpenAI: an error body without `param` and `code` (the document requires both, null or
    /// not).
    ErrorWithoutParam,
    /// Both: a 429 whose `retry-after` says 0 (the document's minimum is 1 s).
    RetryAfterZero,
    /// Anthropic: a `tool_use` block without its `id`.
    ToolUseWithoutId,
    /// Anthropic: `stop_reason` worded as OpenAI's `tool_calls`.
    StopReasonMisworded,
    /// Anthropic: an error whose type is not the one its status documents.
    ErrorTypeOffStatus,
    /// Both: the rate-limit reset in a format the provider does not use (seconds as a number
    /// for OpenAI's Go duration, for Anthropic's RFC 3339 instant).
    ResetMisformatted,
}

const FLAWS: [Flaw; 9] = [
    Flaw::ArgumentsAsObject,
    Flaw::FinishReasonMisworded,
    Flaw::ChoiceWithoutIndex,
    Flaw::ErrorWithoutParam,
    Flaw::RetryAfterZero,
    Flaw::ToolUseWithoutId,
    Flaw::StopReasonMisworded,
    Flaw::ErrorTypeOffStatus,
    Flaw::ResetMisformatted,
];

/// One answer as the client got it.
struct Answer {
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: Value,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

struct Subject {
    model: ScriptedModel,
    client: reqwest::Client,
    flaw: Option<Flaw>,
}

impl Subject {
    async fn start(flaw: Option<Flaw>) -> Subject {
        let model = ScriptedModel::start()
            .await
            .expect("the scripted model starts");
        Subject {
            model,
            client: reqwest::Client::new(),
            flaw,
        }
    }

    /// Posts `body` in `format` and reads the answer, through the flaw if any.
    async fn post(&self, format: WireFormat, body: Value) -> Answer {
        let url = match format {
            WireFormat::OpenAi => format!("{}/chat/completions", self.model.base_url_openai()),
            WireFormat::Anthropic => format!("{}/v1/messages", self.model.base_url_anthropic()),
        };
        let response = self
            .client
            .post(url)
            .header("authorization", "Bearer sk-test")
            .header("x-api-key", "sk-ant-test")
            .header("anthropic-version", "2023-06-01")
            .json(&body)
            .send()
            .await
            .expect("the stand-in answers");
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let text = response.text().await.expect("a body");
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        let mut answer = Answer {
            status,
            headers,
            body,
        };
        if let Some(flaw) = self.flaw {
            apply(flaw, format, &mut answer);
        }
        answer
    }
}

fn apply(flaw: Flaw, format: WireFormat, a: &mut Answer) {
    use reqwest::header::HeaderValue;
    let openai = format == WireFormat::OpenAi;
    match flaw {
        Flaw::ArgumentsAsObject if openai => {
            if let Some(calls) = a.body.pointer_mut("/choices/0/message/tool_calls") {
                for call in calls.as_array_mut().into_iter().flatten() {
                    let text = call["function"]["arguments"].as_str().unwrap_or("{}");
                    call["function"]["arguments"] = serde_json::from_str(text).unwrap_or(json!({}));
                }
            }
        }
        Flaw::FinishReasonMisworded if openai => {
            if let Some(reason) = a.body.pointer_mut("/choices/0/finish_reason")
                && reason == "tool_calls"
            {
                *reason = json!("tool_use");
            }
        }
        Flaw::ChoiceWithoutIndex if openai => {
            if let Some(choice) = a
                .body
                .pointer_mut("/choices/0")
                .and_then(Value::as_object_mut)
            {
                choice.remove("index");
            }
        }
        Flaw::ErrorWithoutParam if openai => {
            if let Some(error) = a.body.pointer_mut("/error").and_then(Value::as_object_mut) {
                error.remove("param");
                error.remove("code");
            }
        }
        Flaw::RetryAfterZero if a.status == 429 => {
            a.headers
                .insert("retry-after", HeaderValue::from_static("0"));
        }
        Flaw::ToolUseWithoutId if !openai => {
            for block in a
                .body
                .pointer_mut("/content")
                .and_then(Value::as_array_mut)
                .into_iter()
                .flatten()
            {
                if block["type"] == "tool_use"
                    && let Some(b) = block.as_object_mut()
                {
                    b.remove("id");
                }
            }
        }
        Flaw::StopReasonMisworded if !openai => {
            if let Some(reason) = a.body.pointer_mut("/stop_reason")
                && reason == "tool_use"
            {
                *reason = json!("tool_calls");
            }
        }
        Flaw::ErrorTypeOffStatus if !openai => {
            if let Some(kind) = a.body.pointer_mut("/error/type") {
                *kind = json!("api_error");
                if a.status == 500 {
                    *kind = json!("overloaded_error");
                }
            }
        }
        Flaw::ResetMisformatted => {
            for name in [
                "x-ratelimit-reset-requests",
                "anthropic-ratelimit-requests-reset",
            ] {
                if a.headers.contains_key(name) {
                    a.headers.insert(name, HeaderValue::from_static("12"));
                }
            }
        }
        _ => {}
    }
}

// ---- requests ---------------------------------------------------------------------------------

const OFFERED: [&str; 2] = ["orders__get_order", "orders__issue_refund"];

fn openai_request(model: &str) -> Value {
    json!({
        "model": model,
        "messages": [
            {"role": "system", "content": "You handle refunds."},
            {"role": "user", "content": "Order o-9 arrived broken."}
        ],
        "tools": OFFERED.iter().map(|name| json!({
            "type": "function",
            "function": {"name": name, "description": "an order tool",
                         "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}}}
        })).collect::<Vec<_>>(),
        "max_completion_tokens": 256
    })
}

fn anthropic_request(model: &str) -> Value {
    json!({
        "model": model,
        "max_tokens": 256,
        "system": "You handle refunds.",
        "messages": [{"role": "user", "content": "Order o-9 arrived broken."}],
        "tools": OFFERED.iter().map(|name| json!({
            "name": name, "description": "an order tool",
            "input_schema": {"type": "object", "properties": {"order_id": {"type": "string"}}}
        })).collect::<Vec<_>>()
    })
}

fn request(format: WireFormat, model: &str) -> Value {
    match format {
        WireFormat::OpenAi => openai_request(model),
        WireFormat::Anthropic => anthropic_request(model),
    }
}

// ---- the cases ----------------------------------------------------------------------------------

type Verdict = Result<(), String>;

fn check(ok: bool, what: impl FnOnce() -> String) -> Verdict {
    if ok { Ok(()) } else { Err(what()) }
}

/// A 200 answer is the format's response document, `application/json`.
fn answer_document(format: WireFormat, a: &Answer) -> Verdict {
    check(a.status == 200, || {
        format!("status {}: {}", a.status, a.body)
    })?;
    let content_type = a.header("content-type").unwrap_or_default();
    check(content_type.starts_with("application/json"), || {
        format!("content-type {content_type:?}")
    })?;
    match format {
        WireFormat::OpenAi => valid(
            &openai_schema("CreateChatCompletionResponse"),
            "the chat completion",
            &a.body,
        ),
        WireFormat::Anthropic => valid(&anthropic_schema("Message"), "the message", &a.body),
    }
}

/// A final answer: the document, stopped naturally, with its text.
async fn text_answer(s: &Subject, format: WireFormat) -> Verdict {
    s.model
        .set_script("m-text", Script::new(vec![Turn::text("Refunded.")]));
    let a = s.post(format, request(format, "m-text")).await;
    answer_document(format, &a)?;
    let (reason, text) = match format {
        WireFormat::OpenAi => (
            &a.body["choices"][0]["finish_reason"],
            &a.body["choices"][0]["message"]["content"],
        ),
        WireFormat::Anthropic => (&a.body["stop_reason"], &a.body["content"][0]["text"]),
    };
    let natural = match format {
        WireFormat::OpenAi => "stop",
        WireFormat::Anthropic => "end_turn",
    };
    check(reason == natural, || {
        format!("stopped {reason}, not {natural}")
    })?;
    check(text == "Refunded.", || format!("text {text}"))
}

/// A tool-calling answer: the document, stopped for the tools, each call naming an offered
/// function with JSON-object arguments (OpenAI: a string of JSON; Anthropic: an object).
async fn tool_answer(s: &Subject, format: WireFormat) -> Verdict {
    s.model.set_script(
        "m-tool",
        Script::new(vec![
            Turn::say_and_call("Looking it up.", "get_order", json!({"order_id": "o-9"})),
            Turn::text("done"),
        ]),
    );
    let a = s.post(format, request(format, "m-tool")).await;
    answer_document(format, &a)?;
    let calls: Vec<(String, Value)> = match format {
        WireFormat::OpenAi => {
            let reason = &a.body["choices"][0]["finish_reason"];
            check(reason == "tool_calls", || format!("stopped {reason}"))?;
            a.body["choices"][0]["message"]["tool_calls"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .iter()
                .map(|c| {
                    let args = c["function"]["arguments"]
                        .as_str()
                        .and_then(|t| serde_json::from_str(t).ok())
                        .unwrap_or(Value::Null);
                    (
                        c["function"]["name"].as_str().unwrap_or("").to_string(),
                        args,
                    )
                })
                .collect()
        }
        WireFormat::Anthropic => {
            let reason = &a.body["stop_reason"];
            check(reason == "tool_use", || format!("stopped {reason}"))?;
            a.body["content"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .iter()
                .filter(|b| b["type"] == "tool_use")
                .map(|b| {
                    (
                        b["name"].as_str().unwrap_or("").to_string(),
                        b["input"].clone(),
                    )
                })
                .collect()
        }
    };
    check(calls.len() == 1, || format!("calls {calls:?}"))?;
    let (name, args) = &calls[0];
    check(OFFERED.contains(&name.as_str()), || {
        format!("a call of {name}, not offered")
    })?;
    check(args == &json!({"order_id": "o-9"}), || {
        format!("arguments {args}")
    })
}

/// An answer cut by the output limit: OpenAI `length`, Anthropic `max_tokens`.
async fn cut_answer(s: &Subject, format: WireFormat) -> Verdict {
    s.model
        .set_script("m-cut", Script::new(vec![Turn::Cut("Refun".into())]));
    let a = s.post(format, request(format, "m-cut")).await;
    answer_document(format, &a)?;
    let (reason, want) = match format {
        WireFormat::OpenAi => (&a.body["choices"][0]["finish_reason"], "length"),
        WireFormat::Anthropic => (&a.body["stop_reason"], "max_tokens"),
    };
    check(reason == want, || format!("stopped {reason}, not {want}"))
}

/// Each error the stand-in can answer in `format` is a documented status with the format's
/// error body; a 429 says when to come back the way the document does.
async fn errors(s: &Subject, format: WireFormat) -> Verdict {
    let mut faults = vec![
        (
            "m-429",
            Some(Fault::RateLimited {
                retry_after: Some(Duration::from_millis(1500)),
            }),
        ),
        ("m-500", Some(Fault::ServerError)),
        ("m-ctx", Some(Fault::ContextExceeded)),
        ("m-unknown", None),
    ];
    match format {
        WireFormat::OpenAi => faults.push(("m-503", Some(Fault::ServiceUnavailable))),
        WireFormat::Anthropic => faults.push(("m-529", Some(Fault::Overloaded))),
    }
    for (model, fault) in faults {
        if let Some(fault) = fault {
            s.model
                .set_script(model, Script::new(vec![Turn::text("never")]));
            s.model.inject_fault(model, fault, FaultTimes::Always);
        }
        let a = s.post(format, request(format, model)).await;
        let what = format!("{model}: the {} error", a.status);
        match format {
            WireFormat::OpenAi => {
                check(OPENAI_STATUSES.contains(&a.status), || {
                    format!("{what}: not a status OpenAI documents")
                })?;
                valid(&openai_schema("ErrorResponse"), &what, &a.body)?;
            }
            WireFormat::Anthropic => {
                valid(&anthropic_schema("Error"), &what, &a.body)?;
                let want = anthropic_error_type(a.status);
                check(want.is_some(), || {
                    format!("{what}: not a status Anthropic documents")
                })?;
                check(a.body["error"]["type"] == want.unwrap_or_default(), || {
                    format!(
                        "{what}: type {} for status {}",
                        a.body["error"]["type"], a.status
                    )
                })?;
            }
        }
        if a.status == 429 {
            // OpenAI's `TooManyRequests`: `Retry-After` an integer of at least 1; Anthropic's
            // rate-limit page: `retry-after`, seconds to wait.
            let retry = a.header("retry-after").unwrap_or("none");
            check(retry.parse::<u64>().is_ok_and(|n| n >= 1), || {
                format!("{what}: retry-after {retry:?}")
            })?;
        }
    }
    Ok(())
}

/// A rate-limited model states its limit on every answer, in the names and formats the
/// provider documents: OpenAI `x-ratelimit-{limit,remaining}-requests` integers and
/// `x-ratelimit-reset-requests` a duration (`1s`, `6m0s`, `20ms`); Anthropic
/// `anthropic-ratelimit-requests-{limit,remaining}` integers and `-reset` an RFC 3339 instant.
async fn rate_limit_headers(s: &Subject, format: WireFormat) -> Verdict {
    s.model
        .set_script("m-limited", Script::new(vec![Turn::text("ok")]));
    s.model
        .set_rate_limit("m-limited", RateLimit::per_minute(60));
    let a = s.post(format, request(format, "m-limited")).await;
    answer_document(format, &a)?;
    let (limit, remaining, reset) = match format {
        WireFormat::OpenAi => (
            "x-ratelimit-limit-requests",
            "x-ratelimit-remaining-requests",
            "x-ratelimit-reset-requests",
        ),
        WireFormat::Anthropic => (
            "anthropic-ratelimit-requests-limit",
            "anthropic-ratelimit-requests-remaining",
            "anthropic-ratelimit-requests-reset",
        ),
    };
    let number = |name: &str| a.header(name).and_then(|v| v.parse::<u64>().ok());
    let (Some(l), Some(r)) = (number(limit), number(remaining)) else {
        return Err(format!(
            "{limit} {:?}, {remaining} {:?}",
            a.header(limit),
            a.header(remaining)
        ));
    };
    check(r <= l, || format!("{r} remaining of {l}"))?;
    let reset_value = a.header(reset).unwrap_or_default();
    let formatted = match format {
        WireFormat::OpenAi => go_duration(reset_value),
        WireFormat::Anthropic => chrono::DateTime::parse_from_rfc3339(reset_value).is_ok(),
    };
    check(formatted, || format!("{reset} {reset_value:?}"))
}

/// A Go duration as OpenAI writes its resets: numbers with units `h`, `m`, `s`, `ms`, `us`,
/// `ns`, at least one.
fn go_duration(text: &str) -> bool {
    let mut rest = text;
    let mut parts = 0;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if digits == 0 {
            return false;
        }
        rest = &rest[digits..];
        let Some(unit) = ["ms", "us", "µs", "ns", "h", "m", "s"]
            .into_iter()
            .find(|u| rest.starts_with(u))
        else {
            return false;
        };
        rest = &rest[unit.len()..];
        parts += 1;
    }
    parts > 0
}

type Case = for<'a> fn(
    &'a Subject,
    WireFormat,
)
    -> std::pin::Pin<Box<dyn std::future::Future<Output = Verdict> + Send + 'a>>;

const CASES: [(&str, Case); 5] = [
    ("text_answer", |s, f| Box::pin(text_answer(s, f))),
    ("tool_answer", |s, f| Box::pin(tool_answer(s, f))),
    ("cut_answer", |s, f| Box::pin(cut_answer(s, f))),
    ("errors", |s, f| Box::pin(errors(s, f))),
    ("rate_limit_headers", |s, f| {
        Box::pin(rate_limit_headers(s, f))
    }),
];

fn format_name(f: WireFormat) -> &'static str {
    match f {
        WireFormat::OpenAi => "openai",
        WireFormat::Anthropic => "anthropic",
    }
}

/// Every case in both formats against a stand-in with `flaw`: the failures, as `format/case`.
async fn failures(flaw: Option<Flaw>) -> Vec<(String, String)> {
    let mut failed = Vec::new();
    for format in [WireFormat::OpenAi, WireFormat::Anthropic] {
        for (name, case) in CASES {
            let subject = Subject::start(flaw).await;
            if let Err(why) = case(&subject, format).await {
                failed.push((format!("{}/{name}", format_name(format)), why));
            }
            subject.model.shutdown().await;
        }
    }
    failed
}

mod wire {
    /// The devkit's scripted model answers every case as OpenAI's OpenAPI document and
    /// Anthropic's documented shapes say.
    #[tokio::test]
    async fn the_scripted_model_answers_as_the_providers_document() {
        let failed = super::failures(None).await;
        assert!(failed.is_empty(), "{failed:#?}");
    }
}

mod flaws {
    use super::*;

    /// Each deliberate departure fails the cases written for it (and the sound stand-in passes
    /// them all, `wire::`).
    #[tokio::test]
    async fn every_departure_from_the_documents_fails_its_cases() {
        let expected: [(Flaw, &[&str]); 9] = [
            (Flaw::ArgumentsAsObject, &["openai/tool_answer"]),
            (Flaw::FinishReasonMisworded, &["openai/tool_answer"]),
            (
                Flaw::ChoiceWithoutIndex,
                &[
                    "openai/text_answer",
                    "openai/tool_answer",
                    "openai/cut_answer",
                ],
            ),
            (Flaw::ErrorWithoutParam, &["openai/errors"]),
            (Flaw::RetryAfterZero, &["openai/errors", "anthropic/errors"]),
            (Flaw::ToolUseWithoutId, &["anthropic/tool_answer"]),
            (Flaw::StopReasonMisworded, &["anthropic/tool_answer"]),
            (Flaw::ErrorTypeOffStatus, &["anthropic/errors"]),
            (
                Flaw::ResetMisformatted,
                &["openai/rate_limit_headers", "anthropic/rate_limit_headers"],
            ),
        ];
        assert_eq!(expected.len(), FLAWS.len(), "a flaw without its cases");
        let mut report = Vec::new();
        for (flaw, cases) in expected {
            let failed: Vec<String> = failures(Some(flaw))
                .await
                .into_iter()
                .map(|(case, _)| case)
                .collect();
            for case in cases {
                assert!(
                    failed.iter().any(|f| f == case),
                    "{flaw:?}: {case} passed; failed: {failed:?}"
                );
            }
            report.push(format!("{flaw:?}: {failed:?}"));
        }
        eprintln!("{}", report.join("\n"));
    }
}

// ---- through the provider seam -------------------------------------------------------------

/// Tools of `server`, the first read-only.
fn offered_tools(server: &str, tools: [&str; 2]) -> Vec<ToolSpec> {
    tools
        .into_iter()
        .enumerate()
        .map(|(i, tool)| ToolSpec {
            server: server.into(),
            tool: tool.into(),
            description: "a tool".into(),
            input_schema: json!({"type": "object"}),
            read_only: i == 0,
            destructive: false,
        })
        .collect()
}

fn seam_request(model: &str, input: &str, tools: Vec<ToolSpec>) -> ModelRequest {
    ModelRequest {
        model: model.into(),
        system: "You handle refunds.".into(),
        messages: vec![Message::User { text: input.into() }],
        tools,
        max_output_tokens: Some(256),
        traceparent: None,
        output: None,
    }
}

/// What the core relies on from any model's answer to a conversation with tools offered: a
/// tool-calling answer names an offered tool (or, with no server, one nobody offered, which the
/// agent answers with an error result), with object arguments and distinct non-blank call ids,
/// and says it stopped for tools; a final answer has text and no calls; usage is reported.
async fn seam_answers(
    provider: &dyn ModelProvider,
    model: &str,
    input: &str,
    tools: Vec<ToolSpec>,
) -> Verdict {
    let mut req = seam_request(model, input, tools.clone());
    let mut saw_call = false;
    for _turn in 0..4 {
        let answer = provider
            .complete(&req)
            .await
            .map_err(|e| format!("the call failed: {e}"))?;
        let usage = answer.usage.ok_or("no usage reported")?;
        check(usage.input_tokens > 0 && usage.output_tokens > 0, || {
            format!("usage {usage:?}")
        })?;
        let calls = &answer.message.tool_calls;
        if calls.is_empty() {
            check(answer.message.text.is_some(), || {
                "a final answer without text".into()
            })?;
            return check(saw_call, || "no tool call before the final answer".into());
        }
        saw_call = true;
        check(
            ["tool_calls", "tool_use"].contains(&answer.stop_reason.as_str()),
            || format!("stopped {} with calls", answer.stop_reason),
        )?;
        let mut ids: Vec<&str> = calls.iter().map(|c| c.call_id.as_str()).collect();
        ids.sort_unstable();
        ids.dedup();
        check(
            ids.len() == calls.len() && ids.iter().all(|i| !i.trim().is_empty()),
            || format!("call ids {ids:?}"),
        )?;
        for call in calls {
            check(
                call.server.is_empty()
                    || tools
                        .iter()
                        .any(|t| t.server == call.server && t.tool == call.tool),
                || format!("a call of {}/{}, not offered", call.server, call.tool),
            )?;
            check(call.arguments.is_object() || call.server.is_empty(), || {
                format!("arguments {}", call.arguments)
            })?;
        }
        req.messages
            .push(Message::Assistant(answer.message.clone()));
        for call in &answer.message.tool_calls {
            req.messages.push(Message::ToolResult {
                call: call.clone(),
                result: abada_agent_worker::conversation::ToolResult {
                    content: vec![json!({"type": "text", "text": "{\"status\":\"delivered\"}"})],
                    structured_content: None,
                    is_error: false,
                },
            });
        }
    }
    Err("no final answer in 4 turns".into())
}

fn adapter(kind: ProviderKind, base_url: String) -> Arc<dyn ModelProvider> {
    ProviderRegistry::new(
        vec![ProviderSettings {
            name: kind.as_str().to_string(),
            kind,
            base_url,
            api_key: Some(Arc::new(SecretSource::value("sk-test"))),
            max_concurrency: None,
            request_timeout: Duration::from_secs(10),
            structured_output: Default::default(),
        }],
        reqwest::Client::new(),
    )
    .get(kind.as_str())
    .expect("the adapter is registered")
}

mod seam {
    use super::*;

    /// The devkit model through the real adapters, in both formats: a 429 is a deferral's
    /// `Unavailable` carrying the provider's wait.
    #[tokio::test]
    async fn the_scripted_model_through_both_adapters() {
        let model = ScriptedModel::start().await.unwrap();
        model.set_script(
            "m",
            Script::new(vec![
                Turn::call("get_order", json!({"order_id": "o-9"})),
                Turn::text("Refunded."),
            ]),
        );
        model.set_script("m-429", Script::new(vec![Turn::text("never")]));
        model.inject_fault(
            "m-429",
            Fault::RateLimited {
                retry_after: Some(Duration::from_secs(2)),
            },
            FaultTimes::Always,
        );
        for (kind, base) in [
            (ProviderKind::OpenAi, model.base_url_openai()),
            (ProviderKind::Anthropic, model.base_url_anthropic()),
        ] {
            let provider = adapter(kind, base);
            let orders = offered_tools("orders", ["get_order", "issue_refund"]);
            seam_answers(
                provider.as_ref(),
                "m",
                "Order o-9 arrived broken.",
                orders.clone(),
            )
            .await
            .unwrap_or_else(|e| panic!("{kind:?}: {e}"));
            match provider.complete(&seam_request("m-429", "x", orders)).await {
                Err(ProviderError::Unavailable {
                    status: Some(429),
                    retry_after: Some(wait),
                    ..
                }) => assert_eq!(wait, Duration::from_secs(2), "{kind:?}"),
                other => panic!("{kind:?}: a 429 answered {other:?}"),
            }
        }
        model.shutdown().await;
    }

    /// The simulator's in-process model, on its own scripts: a lookup, a keyed write and an
    /// unknown tool before its final answer.
    #[tokio::test(start_paused = true)]
    async fn the_simulators_model() {
        let world = World::new(WorldOptions {
            seed: 1,
            lock_duration: Duration::from_secs(30),
            faults: FaultPlan::default(),
            store_journal: false,
        });
        let provider = WorldModel::new(world, "w1");
        for steps in ["r", "rw", "urw"] {
            let script = abada_sim::world::ModelScript {
                task: "k1".into(),
                steps: steps.into(),
                hostile: false,
                finals: String::new(),
            };
            let tools = offered_tools(abada_sim::world::tools::SERVER, ["sim_lookup", "sim_write"]);
            seam_answers(&provider, "m", &script.input(), tools)
                .await
                .unwrap_or_else(|e| panic!("steps {steps}: {e}"));
        }
    }
}
