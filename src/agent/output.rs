//! Structured output: an agent's `outputSchema`, compiled once per definition under bounds, the
//! native structured-output request it allows, and the verdict on every final answer: accepted
//! (the validated JSON value is what the task stores), or rejected with the bounded repair
//! message the model reads next (`outputRepairTurns`), or, past those, an incident naming the
//! schema path.
//!
//! A final answer cut by the output limit (OpenAI `finish_reason: "length"`, Anthropic
//! `stop_reason: "max_tokens"`) is never accepted, schema or not.
//!
//! A schema is a program its author hands the worker, so its cost is bounded by construction before
//! it is compiled: its size and depth; only the keywords of one list (`keywords`: what the walker
//! counts is what the validator applies, checked against the validator; any other keyword holding
//! an object or array is refused, naming it and where, and so are the keywords whose cost no bound
//! holds); only references inside the document, no recursion; and its weight (its subschemas with
//! every `$ref` inlined, plus its `enum` values). Each schema's answer cap is the
//! [`VALIDATION_WORK`] budget divided by its weight, so the worst answer against the worst schema
//! is a measured, small cost (docs/benchmarks-history.md, "Validating a final answer: the worst
//! schemas the bounds allow": 4 MiB and under 0.1 s of CPU on a debug build). Its `pattern`s run on
//! the linear-time `regex` engine with size limits; nothing is fetched. A refused answer's one
//! error comes from a reporting copy of the schema (`report`) that never builds every branch's
//! errors. The validation runs off the async runtime ([`judge_off_runtime`]: a blocking thread,
//! [`VALIDATIONS_AT_ONCE`] at a time) and is given up at [`VALIDATION_DEADLINE`]; an answer that
//! needs it is journaled before it is judged (`agent::judging`), so no validation can crash the
//! worker in a loop.

use std::sync::{Arc, LazyLock};

use tokio::sync::Semaphore;

#[cfg(test)]
use serde_json::Map;
use serde_json::{Value, json};

use crate::provider::OutputFormat;

mod keywords;
mod report;

/// How many repair turns a definition gets when it sets none.
pub(crate) const DEFAULT_REPAIR_TURNS: u32 = 1;
/// The most `outputRepairTurns` may ask: every repair is one more paid model call.
pub(crate) const MAX_REPAIR_TURNS: u32 = 5;
/// The largest `outputSchema`, as compact JSON.
const MAX_SCHEMA_BYTES: usize = 64 * 1024;
/// The deepest nesting of a schema document (objects and arrays).
const MAX_SCHEMA_DEPTH: usize = 32;
/// The most subschemas a schema may have with every `$ref` inlined: what bounds the work of one
/// validation (a few `$ref`s to a `$ref`-heavy definition multiply otherwise).
const MAX_EXPANDED_NODES: usize = 500;
/// The largest final answer validated against a schema; a longer one is told to be shorter. A
/// heavy schema allows less ([`VALIDATION_WORK`]).
const MAX_ANSWER_BYTES: usize = 64 * 1024;
/// What validating one answer may cost, in answer bytes times schema weight (subschemas with
/// every `$ref` inlined, plus `enum` values): each value of an answer is checked at most once
/// per subschema and per enum value. A schema's answer cap is this divided by its weight, at
/// most [`MAX_ANSWER_BYTES`]: a schema of up to 32 weights keeps the whole 64 KiB; the heaviest
/// one allowed ([`MIN_ANSWER_BYTES`]) gets 1 KiB.
const VALIDATION_WORK: usize = 2 * 1024 * 1024;
/// The smallest answer cap a schema may leave: a heavier schema (weight over
/// `VALIDATION_WORK / MIN_ANSWER_BYTES`, 2,048) is refused when the definition is read.
const MIN_ANSWER_BYTES: usize = 1024;
/// Final answers validated at once, each on a blocking thread (never on the async runtime's).
const VALIDATIONS_AT_ONCE: usize = 2;
/// How long a task waits for one validation before it gives up and the task becomes an incident
/// naming the schema. The bounds make the worst answer against the worst schema cost well under a
/// second of CPU on a debug build (docs/benchmarks-history.md, "Validating a final answer: the
/// worst schemas the bounds allow"); this deadline is the second line, for what no measurement
/// foresaw, with room for a loaded machine.
pub(crate) const VALIDATION_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);
/// The compiled size of one `pattern` regex, and its lazy DFA's cache.
const MAX_PATTERN_BYTES: usize = 256 * 1024;
/// How many characters of the walk path an [`SchemaError::Expansion`] names (its start: the
/// keyword under the root where the heavy part begins).
const MAX_VIA_CHARS: usize = 160;
/// How many characters of the validation error a repair message or an incident quotes (an error
/// quotes the answer, which the model may have made huge). Only the first error is reported.
const MAX_ERROR_CHARS: usize = 300;

/// Why an `outputSchema` cannot be used; the definition is invalid.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SchemaError {
    #[error("outputSchema is {bytes} bytes, over the {limit}-byte cap; simplify it")]
    TooLarge { bytes: usize, limit: usize },
    #[error("outputSchema nests deeper than {limit} levels at {pointer}; flatten it")]
    TooDeep { pointer: String, limit: usize },
    #[error(
        "outputSchema has {what} at {pointer}; only references inside the schema (\"#\" or \"#/$defs/...\") are supported, nothing is fetched"
    )]
    Reference { pointer: String, what: String },
    #[error(
        "outputSchema is recursive: {pointer} refers back to {target}; an output schema must not refer to itself"
    )]
    Recursive { pointer: String, target: String },
    #[error(
        "outputSchema has more than {limit} subschemas with its $refs inlined (the count passed {limit} at {via}); use fewer references to large definitions"
    )]
    Expansion { limit: usize, via: String },
    #[error(
        "outputSchema has the keyword {keyword:?} at {pointer} with an object or array value; the worker validates only the keywords it knows (JSON Schema's, listed in docs/OPERATIONS.md), and an unknown one may hold subschemas it cannot bound: remove it, or make it a plain value"
    )]
    UnknownKeyword { keyword: String, pointer: String },
    #[error("outputSchema uses {keyword:?} at {pointer}, which the worker refuses: {why}")]
    Unsupported {
        keyword: String,
        pointer: String,
        why: &'static str,
    },
    #[error(
        "outputSchema weighs {weight} (subschemas with $refs inlined, plus enum values), over the {limit} a validated answer of at least {MIN_ANSWER_BYTES} bytes allows; use fewer or shorter enums or subschemas"
    )]
    TooHeavy { weight: usize, limit: usize },
    #[error("outputSchema does not compile as a JSON Schema: {reason}")]
    Invalid { reason: String },
}

/// A compiled `outputSchema`: compiled once per definition, shared by every task that uses it.
#[derive(Clone)]
pub struct OutputSchema {
    schema: Arc<Value>,
    validator: Arc<jsonschema::Validator>,
    /// The reporting copy, compiled: where a refused answer's one error is found (`report`).
    reporter: Arc<jsonschema::Validator>,
    /// `Ok` when OpenAI's strict structured output accepts the schema as it is; else why not.
    strict: Result<(), String>,
    /// The largest answer validated against it: [`VALIDATION_WORK`] over its weight.
    answer_limit: usize,
}

impl std::fmt::Debug for OutputSchema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutputSchema")
            .field("schema", &self.schema)
            .field("strict", &self.strict)
            .field("answer_limit", &self.answer_limit)
            .finish()
    }
}

/// Two compiled schemas are the same when their documents are.
impl PartialEq for OutputSchema {
    fn eq(&self, other: &Self) -> bool {
        self.schema == other.schema
    }
}

impl OutputSchema {
    /// Bounds and compiles `schema` (a JSON object or boolean).
    pub fn compile(schema: &Value) -> Result<Self, SchemaError> {
        let weight = check_bounds(schema)?;
        let limit = VALIDATION_WORK / MIN_ANSWER_BYTES;
        if weight > limit {
            return Err(SchemaError::TooHeavy { weight, limit });
        }
        let validator = build_validator(schema)?;
        let reporter = build_validator(&report::reporting_copy(schema))?;
        Ok(OutputSchema {
            schema: Arc::new(schema.clone()),
            validator: Arc::new(validator),
            reporter: Arc::new(reporter),
            strict: strict_eligible(schema),
            answer_limit: (VALIDATION_WORK / weight.max(1)).min(MAX_ANSWER_BYTES),
        })
    }

    /// The largest final answer validated against it, in bytes: [`VALIDATION_WORK`] over its
    /// weight, at most [`MAX_ANSWER_BYTES`].
    pub fn answer_limit(&self) -> usize {
        self.answer_limit
    }

    /// The schema document.
    pub fn value(&self) -> &Value {
        &self.schema
    }

    /// Whether OpenAI's strict mode accepts the schema; `Err` says why not.
    pub fn strict(&self) -> Result<(), &str> {
        self.strict.as_ref().map(|_| ()).map_err(String::as_str)
    }

    /// What a model request carries for this schema, for agent `agent`.
    pub fn format(&self, agent: &str) -> OutputFormat {
        OutputFormat {
            name: format_name(agent),
            schema: (*self.schema).clone(),
            strict: self.strict.is_ok(),
            instruction: instruction(&self.schema),
        }
    }
}

/// The validator of a bounded schema: offline (no `$ref` is ever fetched), `pattern`s on the
/// linear-time `regex` engine under size limits.
fn build_validator(schema: &Value) -> Result<jsonschema::Validator, SchemaError> {
    jsonschema::options()
        .offline()
        .with_pattern_options(
            jsonschema::PatternOptions::regex()
                .size_limit(MAX_PATTERN_BYTES)
                .dfa_size_limit(MAX_PATTERN_BYTES),
        )
        .build(schema)
        .map_err(|e| SchemaError::Invalid {
            reason: cut(&e.to_string(), MAX_ERROR_CHARS),
        })
}

/// OpenAI's `json_schema.name`: `a-zA-Z0-9_-`, at most 64 characters.
fn format_name(agent: &str) -> String {
    let name: String = agent
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect();
    if name.is_empty() {
        "agent_output".into()
    } else {
        name
    }
}

/// The system-prompt paragraph that asks for the schema where no provider enforces it.
pub fn instruction(schema: &Value) -> String {
    format!(
        "Your final answer must be one JSON value, with no other text and no Markdown fence, that matches this JSON Schema:\n{schema}"
    )
}

/// Why a final answer is not stored: a closed set (the metric's `reason` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RejectReason {
    /// Cut by the output limit.
    Truncated,
    /// Not JSON at all.
    NotJson,
    /// Over the schema's answer cap (`OutputSchema`'s `answer_limit`).
    TooLarge,
    /// JSON that does not match the schema.
    Schema,
}

impl RejectReason {
    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::Truncated => "truncated",
            RejectReason::NotJson => "not_json",
            RejectReason::TooLarge => "too_large",
            RejectReason::Schema => "schema",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        [
            RejectReason::Truncated,
            RejectReason::NotJson,
            RejectReason::TooLarge,
            RejectReason::Schema,
        ]
        .into_iter()
        .find(|r| r.as_str() == s)
    }
}

/// A final answer that is not stored: why, where in the answer and the schema (for an
/// incident), and the message that tells the model (bounded).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    pub reason: RejectReason,
    /// The first error's place: `instance /decision, schema /properties/decision/enum`.
    pub(crate) location: Option<String>,
    /// What is wrong, for the model and the incident (at most a few bounded errors).
    pub detail: String,
}

impl Rejection {
    /// The user message of the repair turn.
    pub(crate) fn repair_message(&self) -> String {
        match self.reason {
            RejectReason::Truncated => format!(
                "Your answer was cut off at the output limit ({}). Answer again, shorter: give only the final answer, in full, and nothing else.",
                self.detail
            ),
            RejectReason::TooLarge => format!(
                "Your answer is too long ({}). Answer again, shorter: give only the final answer.",
                self.detail
            ),
            RejectReason::NotJson => format!(
                "Your final answer is not valid JSON ({}). Answer again with only the JSON value the output schema asks for, with no other text.",
                self.detail
            ),
            RejectReason::Schema => format!(
                "Your final answer does not match the output schema: {}. Answer again with only a JSON value that matches the schema.",
                self.detail
            ),
        }
    }

    /// The incident's details once no repair turn is left.
    pub(crate) fn incident_details(&self, agent: &str, repairs: u32) -> String {
        let place = self
            .location
            .as_deref()
            .map(|l| format!(" at {l}"))
            .unwrap_or_default();
        let after = match repairs {
            0 => "with no repair turn allowed (outputRepairTurns = 0)".to_string(),
            n => format!("after {n} repair turn(s) (outputRepairTurns)"),
        };
        match self.reason {
            RejectReason::Truncated => format!(
                "agent {agent:?}: the final answer was cut by the output limit {after}: {}; raise maxOutputTokens or ask for a shorter answer in the instructions; the cut answer was not stored",
                self.detail
            ),
            RejectReason::TooLarge => format!(
                "agent {agent:?}: the final answer is over the byte cap of an answer validated against its outputSchema (at most {MAX_ANSWER_BYTES}, less for a heavy schema) {after}: {}",
                self.detail
            ),
            RejectReason::NotJson => format!(
                "agent {agent:?}: the final answer is not JSON {after}: {}; the outputSchema asks for JSON",
                self.detail
            ),
            RejectReason::Schema => format!(
                "agent {agent:?}: the final answer does not match its outputSchema{place} {after}: {}",
                self.detail
            ),
        }
    }
}

/// Whether an answer's stop reason says the output limit cut it (OpenAI `length`, Anthropic
/// `max_tokens`).
fn was_cut(stop_reason: &str) -> bool {
    // SIM-BUG (feature `sim-bugs`, selected at run time): the stop reason not read.
    #[cfg(feature = "sim-bugs")]
    if crate::sim_bugs::active(crate::sim_bugs::Bug::CutAnswerStored) {
        return false;
    }
    matches!(stop_reason, "length" | "max_tokens")
}

/// The verdict on a final answer: the value to store, or why not. Without a schema, a JSON
/// answer is stored as JSON and any other as its text; with one, only a JSON value that
/// matches it. A cut answer is never stored.
pub fn judge(
    schema: Option<&OutputSchema>,
    text: &str,
    stop_reason: &str,
    output_cap: Option<u32>,
) -> Result<Value, Rejection> {
    if was_cut(stop_reason) {
        return Err(Rejection {
            reason: RejectReason::Truncated,
            location: None,
            detail: match output_cap {
                Some(cap) => format!("{cap} tokens"),
                None => "the model's own limit".into(),
            },
        });
    }
    let Some(schema) = schema else {
        return Ok(parse_answer(text));
    };
    if text.len() > schema.answer_limit {
        return Err(Rejection {
            reason: RejectReason::TooLarge,
            location: None,
            detail: format!("{} bytes, over {}", text.len(), schema.answer_limit),
        });
    }
    let value = match serde_json::from_str::<Value>(unfenced(text)) {
        Ok(v) => v,
        Err(e) => {
            return Err(Rejection {
                reason: RejectReason::NotJson,
                location: None,
                detail: cut(&e.to_string(), MAX_ERROR_CHARS),
            });
        }
    };
    // A yes or no first (no error is built, the first failure ends it); then one error, from
    // the reporting copy, whose failed `anyOf`s and `oneOf`s report no branch (`report`):
    // collecting the schema's own errors builds one per failed branch of every `anyOf`, for
    // every item, which cost a minute of CPU, or gigabytes (docs/benchmarks-history.md).
    if schema.validator.is_valid(&value) {
        return Ok(value);
    }
    // SIM-BUG (feature `sim-bugs`, selected at run time): any JSON answer stored.
    #[cfg(feature = "sim-bugs")]
    if crate::sim_bugs::active(crate::sim_bugs::Bug::OffSchemaStored) {
        return Ok(value);
    }
    let Some((instance, schema_path, message)) = report::first_error(&schema.reporter, &value)
    else {
        // Cannot happen (the copy agrees with the schema); store nothing rather than guess.
        return Err(Rejection {
            reason: RejectReason::Schema,
            location: None,
            detail: "the validator gave no error for an answer it refused".into(),
        });
    };
    Err(Rejection {
        reason: RejectReason::Schema,
        location: Some(format!(
            "instance {}, schema {}",
            pointer_or_root(&instance),
            pointer_or_root(&schema_path)
        )),
        detail: format!(
            "at {}: {}",
            pointer_or_root(&instance),
            cut(&message, MAX_ERROR_CHARS)
        ),
    })
}

/// The blocking threads' permits: at most [`VALIDATIONS_AT_ONCE`] validations run at once in the
/// process, whichever tasks asked.
static VALIDATIONS: LazyLock<Arc<Semaphore>> =
    LazyLock::new(|| Arc::new(Semaphore::new(VALIDATIONS_AT_ONCE)));

/// Why a final answer that needed the validator got no verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Unjudged {
    /// The validation ran past its deadline ([`VALIDATION_DEADLINE`]): given up, never waited
    /// for again (its thread runs to its end, bounded by the schema's weight, keeping its
    /// permit).
    OverBudget { limit: std::time::Duration },
    /// The runtime is shutting down.
    ShuttingDown,
}

/// Whether judging `text` needs the validator: a schema, an answer not cut, within the
/// schema's answer cap. Any other answer is judged at once, at no cost ([`judge`]).
pub(crate) fn needs_validator(
    schema: Option<&OutputSchema>,
    text: &str,
    stop_reason: &str,
) -> bool {
    schema.is_some_and(|s| !was_cut(stop_reason) && text.len() <= s.answer_limit)
}

/// [`judge`], with the schema's validation on a blocking thread, [`VALIDATIONS_AT_ONCE`] at a
/// time, given up at `deadline` (from when it starts; the wait for a permit is not counted): the
/// async runtime's threads (heartbeats, the poll loop, every other task) never wait for it,
/// and the task does not wait past the deadline. What needs no validation is judged here at
/// once. The permit travels with the validation, so a task stopped while it waits, or one
/// that gave up, frees nothing early: the bound holds for validations still running for no
/// one. The caller races this with its stop (a dropped future abandons the validation).
pub(crate) async fn judge_off_runtime(
    schema: Option<&OutputSchema>,
    text: &str,
    stop_reason: &str,
    output_cap: Option<u32>,
    deadline: std::time::Duration,
) -> Result<Result<Value, Rejection>, Unjudged> {
    let Some(schema) = schema.filter(|_| needs_validator(schema, text, stop_reason)) else {
        return Ok(judge(schema, text, stop_reason, output_cap));
    };
    let (schema, text, stop_reason) = (schema.clone(), text.to_string(), stop_reason.to_string());
    off_runtime(
        move || judge(Some(&schema), &text, &stop_reason, output_cap),
        deadline,
    )
    .await
}

/// Runs `job` on a blocking thread under one of the [`VALIDATIONS`] permits (held until the job
/// ends, whoever waits), waiting for it at most `deadline`.
async fn off_runtime<T: Send + 'static>(
    job: impl FnOnce() -> T + Send + 'static,
    deadline: std::time::Duration,
) -> Result<T, Unjudged> {
    let permit = VALIDATIONS
        .clone()
        .acquire_owned()
        .await
        .expect("the validations' semaphore is never closed");
    let judged = tokio::time::timeout(
        deadline,
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            job()
        }),
    )
    .await;
    match judged {
        Ok(Ok(done)) => Ok(done),
        Err(_) => Err(Unjudged::OverBudget { limit: deadline }),
        // The job panicked: a bug, not the model's; surface it as a panic here.
        Ok(Err(e)) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Ok(Err(_)) => Err(Unjudged::ShuttingDown),
    }
}

/// What becomes of a model answer (`run::Attempt::call_model`).
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// Tool calls, or a final answer to store.
    Accepted,
    /// A rejected final answer with a repair turn left: journaled with its repair message, and
    /// the model is asked again.
    Repair(Rejection),
    /// A rejected final answer with no repair turn left: journaled with its repair message (a
    /// retry of the incident resumes there), then the incident.
    Exhausted(Rejection),
}

impl Verdict {
    pub fn rejection(&self) -> Option<&Rejection> {
        match self {
            Verdict::Accepted => None,
            Verdict::Repair(r) | Verdict::Exhausted(r) => Some(r),
        }
    }

    /// The verdict on a judgement, with `repairs_spent` of `allowed` repair turns used.
    pub(crate) fn of(judged: Result<Value, Rejection>, repairs_spent: u32, allowed: u32) -> Self {
        match judged {
            Ok(_) => Verdict::Accepted,
            Err(r) if repairs_spent < allowed => Verdict::Repair(r),
            // SIM-BUG (feature `sim-bugs`, selected at run time): never exhausted.
            #[cfg(feature = "sim-bugs")]
            Err(r) if crate::sim_bugs::active(crate::sim_bugs::Bug::RepairsUnbounded) => {
                Verdict::Repair(r)
            }
            Err(r) => Verdict::Exhausted(r),
        }
    }
}

/// The verdict on one answer that needs no validator ([`needs_validator`]: tool calls, no
/// schema, a cut answer, one over the schema's answer cap), judged at once: only a final one
/// is judged; `repairs_spent` are the repair turns the run already used, of `allowed`. An
/// answer that needs the validator is journaled first and judged by `agent::judging`.
pub fn verdict(
    schema: Option<&OutputSchema>,
    message: &crate::conversation::AssistantMessage,
    stop_reason: &str,
    output_cap: Option<u32>,
    repairs_spent: u32,
    allowed: u32,
) -> Verdict {
    if !message.tool_calls.is_empty() {
        return Verdict::Accepted;
    }
    let text = message.text.as_deref().unwrap_or_default();
    debug_assert!(!needs_validator(schema, text, stop_reason));
    Verdict::of(
        judge(schema, text, stop_reason, output_cap),
        repairs_spent,
        allowed,
    )
}

fn pointer_or_root(p: &str) -> &str {
    if p.is_empty() { "/" } else { p }
}

/// The answer's text without a Markdown code fence around it.
fn unfenced(text: &str) -> &str {
    let trimmed = text.trim();
    trimmed
        .strip_prefix("```json")
        .or_else(|| trimmed.strip_prefix("```"))
        .and_then(|rest| rest.strip_suffix("```"))
        .map(str::trim)
        .unwrap_or(trimmed)
}

/// The final answer as a process variable when no schema asks for more: parsed JSON when it is
/// JSON (also inside a Markdown code fence), else the text.
pub(crate) fn parse_answer(text: &str) -> Value {
    let unfenced = unfenced(text);
    match serde_json::from_str::<Value>(unfenced) {
        Ok(v) if !unfenced.is_empty() => v,
        _ => Value::String(text.to_string()),
    }
}

/// `text` cut to `max` characters, saying so.
fn cut(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        None => text.to_string(),
        Some((at, _)) => format!("{}… (cut)", &text[..at]),
    }
}

/// The journal's record of a rejected final answer, on its model step (`data.outputRepair`):
/// a field the engine keeps and ignores (protocol.md B.2), so the step keeps its kind and a
/// resumed run replays the repair turn exactly.
pub(crate) const JOURNAL_FIELD: &str = "outputRepair";

pub(crate) fn journal_record(rejection: &Rejection) -> Value {
    json!({
        "reason": rejection.reason.as_str(),
        "message": rejection.repair_message(),
    })
}

/// A repair turn read back from a model step: its reason and the message the model read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct JournaledRepair {
    pub reason: Option<RejectReason>,
    pub message: String,
}

/// The repair recorded on a model step's data, if any.
pub(crate) fn journaled_repair(data: &Value) -> Result<Option<JournaledRepair>, String> {
    let Some(record) = data.get(JOURNAL_FIELD) else {
        return Ok(None);
    };
    let message = record
        .get("message")
        .and_then(Value::as_str)
        .ok_or_else(|| format!("{JOURNAL_FIELD} has no message"))?;
    Ok(Some(JournaledRepair {
        reason: record
            .get("reason")
            .and_then(Value::as_str)
            .and_then(RejectReason::parse),
        message: message.to_string(),
    }))
}

// ---- bounds ----------------------------------------------------------------------------------

/// Checks the bounds; returns the schema's weight (subschemas with every `$ref` inlined, plus
/// the values of the `enum`s among them).
fn check_bounds(schema: &Value) -> Result<usize, SchemaError> {
    let depth = document_depth(schema, 0);
    if depth > MAX_SCHEMA_DEPTH {
        return Err(SchemaError::TooDeep {
            pointer: "(the document)".into(),
            limit: MAX_SCHEMA_DEPTH,
        });
    }
    let bytes = serde_json::to_vec(schema).map_or(usize::MAX, |b| b.len());
    if bytes > MAX_SCHEMA_BYTES {
        return Err(SchemaError::TooLarge {
            bytes,
            limit: MAX_SCHEMA_BYTES,
        });
    }
    // Only keywords on the one list reach the walk below and the validator.
    keywords::check(schema, "").map_err(SchemaError::from)?;
    let mut walk = Walk {
        root: schema,
        stack: Vec::new(),
        budget: MAX_EXPANDED_NODES,
        enum_values: 0,
    };
    walk.expand(schema, "", "")?;
    Ok(MAX_EXPANDED_NODES - walk.budget + walk.enum_values)
}

impl From<keywords::KeywordRefusal> for SchemaError {
    fn from(refusal: keywords::KeywordRefusal) -> Self {
        match refusal {
            keywords::KeywordRefusal::Unknown { keyword, pointer } => {
                SchemaError::UnknownKeyword { keyword, pointer }
            }
            keywords::KeywordRefusal::Refused {
                keyword,
                pointer,
                why,
            } => SchemaError::Unsupported {
                keyword,
                pointer,
                why,
            },
            keywords::KeywordRefusal::NestedIdentifier { keyword, pointer } => {
                SchemaError::Reference {
                    pointer,
                    what: format!("a nested {keyword}"),
                }
            }
        }
    }
}

/// How deep `v` nests, stopping one past the cap (a TOML agents file has no depth limit of its
/// own, so this walk must not follow a hostile document to the bottom).
fn document_depth(v: &Value, depth: usize) -> usize {
    if depth > MAX_SCHEMA_DEPTH {
        return depth;
    }
    let children: Box<dyn Iterator<Item = &Value>> = match v {
        Value::Array(a) => Box::new(a.iter()),
        Value::Object(o) => Box::new(o.values()),
        _ => return depth,
    };
    children
        .map(|c| document_depth(c, depth + 1))
        .max()
        .unwrap_or(depth)
}

/// The walk of a schema with every `$ref` inlined, by the keyword list: one of `budget` per
/// subschema, the `enum` values met counted in `enum_values`; `stack` holds where the `$ref`s
/// being inlined are (a reference to a node that contains one of them is recursion).
struct Walk<'a> {
    root: &'a Value,
    stack: Vec<String>,
    budget: usize,
    enum_values: usize,
}

impl<'a> Walk<'a> {
    /// Walks `node`, which is at `pointer` in the document and was reached along `via` (the
    /// path from the root through every `$ref` followed, which the error names).
    fn expand(&mut self, node: &'a Value, pointer: &str, via: &str) -> Result<(), SchemaError> {
        self.budget = self
            .budget
            .checked_sub(1)
            .ok_or_else(|| SchemaError::Expansion {
                limit: MAX_EXPANDED_NODES,
                via: cut(pointer_or_root(via), MAX_VIA_CHARS),
            })?;
        let Value::Object(schema) = node else {
            return Ok(());
        };
        if let Some(Value::Array(values)) = schema.get("enum") {
            self.enum_values = self.enum_values.saturating_add(values.len());
        }
        let at = || pointer_or_root(pointer).to_string();
        if let Some(reference) = schema.get("$ref") {
            let target = local_target(reference).ok_or_else(|| SchemaError::Reference {
                pointer: at(),
                what: format!("$ref {}", cut(&reference.to_string(), 80)),
            })?;
            // Recursion: the target contains a node on the way here (this `$ref`, or one of
            // the `$ref`s being inlined).
            let below = format!("{target}/");
            let inside = |p: &str| p == target || p.starts_with(&below);
            if inside(pointer) || self.stack.iter().any(|site| inside(site)) {
                return Err(SchemaError::Recursive {
                    pointer: at(),
                    target: pointer_or_root(&target).to_string(),
                });
            }
            let resolved = self
                .root
                .pointer(&target)
                .ok_or_else(|| SchemaError::Reference {
                    pointer: at(),
                    what: format!("$ref {target:?}, which points nowhere"),
                })?;
            self.stack.push(pointer.to_string());
            let r = self.expand(resolved, &target, &format!("{via}/$ref"));
            self.stack.pop();
            r?;
        }
        for child in keywords::children(schema) {
            // Definitions are walked where they are used, not where they are defined.
            if child.shape == keywords::Shape::Definitions {
                continue;
            }
            self.expand(
                child.schema,
                &format!("{pointer}/{}", child.segment),
                &format!("{via}/{}", child.segment),
            )?;
        }
        Ok(())
    }
}

/// The JSON pointer of a `$ref` inside the document (`#` or `#/...`), unescaped of nothing
/// percent-encoded; `None` for any other reference.
fn local_target(reference: &Value) -> Option<String> {
    let r = reference.as_str()?;
    let fragment = r.strip_prefix('#')?;
    if fragment.contains('%') || !(fragment.is_empty() || fragment.starts_with('/')) {
        return None;
    }
    Some(fragment.to_string())
}

// ---- strict eligibility -------------------------------------------------------------------

/// The keywords OpenAI's strict structured output supports (its Structured Outputs guide:
/// types, `enum`, `anyOf`, `$ref`/`$defs`, string `pattern`/`format`, number and array bounds,
/// descriptions); anything else makes the request non-strict.
const STRICT_KEYWORDS: &[&str] = &[
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "enum",
    "anyOf",
    "$ref",
    "$defs",
    "definitions",
    "description",
    "title",
    "pattern",
    "format",
    "multipleOf",
    "maximum",
    "exclusiveMaximum",
    "minimum",
    "exclusiveMinimum",
    "minItems",
    "maxItems",
];
/// OpenAI's bounds on a strict schema.
const STRICT_MAX_OBJECT_DEPTH: usize = 10;
const STRICT_MAX_PROPERTIES: usize = 5_000;
const STRICT_MAX_ENUM_VALUES: usize = 1_000;

/// `Ok` when OpenAI's strict mode accepts `schema` as it is: an object at the root, every
/// object closed (`additionalProperties: false`) with every property required, and only the
/// supported keywords; else the first reason it is not.
fn strict_eligible(schema: &Value) -> Result<(), String> {
    let Value::Object(root) = schema else {
        return Err("the schema is a boolean, not an object schema".into());
    };
    if root.get("type") != Some(&json!("object")) {
        return Err("the root is not {\"type\": \"object\"}".into());
    }
    let mut properties = 0;
    strict_node(schema, "", 0, &mut properties)
}

fn strict_node(
    node: &Value,
    pointer: &str,
    object_depth: usize,
    properties: &mut usize,
) -> Result<(), String> {
    let Value::Object(schema) = node else {
        return Err(format!("{}: a boolean schema", pointer_or_root(pointer)));
    };
    let at = pointer_or_root(pointer);
    if let Some(k) = schema
        .keys()
        .find(|k| !STRICT_KEYWORDS.contains(&k.as_str()))
    {
        return Err(format!(
            "{at}: keyword {k:?} is not supported in strict mode"
        ));
    }
    let is_object = match schema.get("type") {
        Some(Value::String(t)) => t == "object",
        Some(Value::Array(ts)) => ts.iter().any(|t| t == "object"),
        _ => schema.contains_key("properties"),
    };
    let mut object_depth = object_depth;
    if is_object {
        object_depth += 1;
        if object_depth > STRICT_MAX_OBJECT_DEPTH {
            return Err(format!(
                "{at}: objects nest deeper than {STRICT_MAX_OBJECT_DEPTH}"
            ));
        }
        if schema.get("additionalProperties") != Some(&Value::Bool(false)) {
            return Err(format!("{at}: additionalProperties is not false"));
        }
        let names: Vec<&String> = schema
            .get("properties")
            .and_then(Value::as_object)
            .map(|p| p.keys().collect())
            .unwrap_or_default();
        *properties += names.len();
        if *properties > STRICT_MAX_PROPERTIES {
            return Err(format!("more than {STRICT_MAX_PROPERTIES} properties"));
        }
        let required: Vec<&str> = schema
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        if let Some(missing) = names.iter().find(|n| !required.contains(&n.as_str())) {
            return Err(format!("{at}: property {missing:?} is not required"));
        }
    }
    if schema
        .get("enum")
        .and_then(Value::as_array)
        .is_some_and(|e| e.len() > STRICT_MAX_ENUM_VALUES)
    {
        return Err(format!(
            "{at}: an enum of more than {STRICT_MAX_ENUM_VALUES} values"
        ));
    }
    for child in keywords::children(schema) {
        // `additionalProperties: false`, checked above, is the one boolean schema allowed.
        if child.segment == "additionalProperties" {
            continue;
        }
        strict_node(
            child.schema,
            &format!("{pointer}/{}", child.segment),
            object_depth,
            properties,
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routing() -> Value {
        json!({
            "type": "object",
            "properties": {
                "decision": {"type": "string", "enum": ["refund", "reject", "escalate"]},
                "amountCents": {"type": "integer", "minimum": 0}
            },
            "required": ["decision", "amountCents"],
            "additionalProperties": false
        })
    }

    #[test]
    fn without_a_schema_answers_that_are_json_become_json() {
        assert_eq!(
            parse_answer("{\"approved\": true}"),
            json!({"approved": true})
        );
        assert_eq!(parse_answer("```json\n{\"a\": 1}\n```"), json!({"a": 1}));
        assert_eq!(parse_answer("  [1, 2] "), json!([1, 2]));
        assert_eq!(parse_answer("Refund approved."), json!("Refund approved."));
        assert_eq!(parse_answer(""), json!(""));
    }

    #[test]
    fn a_matching_answer_is_the_validated_value_not_a_string() {
        let s = OutputSchema::compile(&routing()).unwrap();
        let v = judge(
            Some(&s),
            "```json\n{\"decision\": \"refund\", \"amountCents\": 1500}\n```",
            "stop",
            Some(100),
        )
        .unwrap();
        assert_eq!(v, json!({"decision": "refund", "amountCents": 1500}));
    }

    #[test]
    fn an_off_schema_answer_names_the_instance_and_schema_path() {
        let s = OutputSchema::compile(&routing()).unwrap();
        let r = judge(
            Some(&s),
            r#"{"decision": "maybe", "amountCents": 1}"#,
            "stop",
            None,
        )
        .unwrap_err();
        assert_eq!(r.reason, RejectReason::Schema);
        assert_eq!(
            r.location.as_deref(),
            Some("instance /decision, schema /properties/decision/enum")
        );
        assert!(r.repair_message().contains("at /decision"), "{r:?}");
        let incident = r.incident_details("refund-agent", 1);
        assert!(
            incident.contains("at instance /decision, schema /properties/decision/enum")
                && incident.contains("after 1 repair turn"),
            "{incident}"
        );
        let r = judge(Some(&s), "I think we should refund.", "end_turn", None).unwrap_err();
        assert_eq!(r.reason, RejectReason::NotJson);
    }

    #[test]
    fn a_cut_answer_is_never_accepted_with_or_without_a_schema() {
        for stop in ["length", "max_tokens"] {
            let r = judge(None, "{\"decision\": \"ref", stop, Some(64)).unwrap_err();
            assert_eq!(r.reason, RejectReason::Truncated);
            assert!(r.repair_message().contains("64 tokens"), "{r:?}");
            assert!(r.repair_message().contains("shorter"));
            // Even a cut answer that happens to be valid JSON.
            assert!(judge(None, "{}", stop, None).is_err());
        }
        assert_eq!(judge(None, "plain", "stop", None), Ok(json!("plain")));
    }

    #[test]
    fn repair_messages_and_incidents_are_bounded_for_a_huge_answer() {
        let s =
            OutputSchema::compile(&json!({"type": "array", "items": {"type": "integer"}})).unwrap();
        // Many errors, each quoting a long string: at most a few, each cut.
        let items: Vec<String> = (0..500)
            .map(|_| format!("\"{}\"", "h-".repeat(500)))
            .collect();
        let answer = format!("[{}]", items.join(","));
        assert!(answer.len() < MAX_ANSWER_BYTES * 10);
        let r = judge(Some(&s), &answer, "stop", None).unwrap_err();
        if answer.len() > MAX_ANSWER_BYTES {
            assert_eq!(r.reason, RejectReason::TooLarge);
        }
        let small: Vec<String> = (0..50)
            .map(|_| format!("\"{}\"", "h-".repeat(500)))
            .collect();
        let r = judge(Some(&s), &format!("[{}]", small.join(",")), "stop", None).unwrap_err();
        assert_eq!(r.reason, RejectReason::Schema);
        assert!(
            r.repair_message().len() < 2 * 1024,
            "{}",
            r.repair_message().len()
        );
        assert_eq!(r.detail.matches("at /").count(), 1, "{r:?}");
        let huge = "x".repeat(MAX_ANSWER_BYTES + 1);
        let r = judge(Some(&s), &huge, "stop", None).unwrap_err();
        assert_eq!(r.reason, RejectReason::TooLarge);
        assert!(r.repair_message().len() < 300);
    }

    #[test]
    fn strict_only_when_every_object_is_closed_and_fully_required() {
        assert_eq!(strict_eligible(&routing()), Ok(()));
        let mut open = routing();
        open.as_object_mut().unwrap().remove("additionalProperties");
        assert!(
            strict_eligible(&open)
                .unwrap_err()
                .contains("additionalProperties")
        );
        let mut optional = routing();
        optional["required"] = json!(["decision"]);
        assert!(
            strict_eligible(&optional)
                .unwrap_err()
                .contains("\"amountCents\" is not required")
        );
        let mut unsupported = routing();
        unsupported["properties"]["decision"]["minLength"] = json!(1);
        assert!(
            strict_eligible(&unsupported)
                .unwrap_err()
                .contains("minLength")
        );
        let nested_open = json!({
            "type": "object", "additionalProperties": false, "required": ["a"],
            "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}}
        });
        assert!(
            strict_eligible(&nested_open)
                .unwrap_err()
                .starts_with("/properties/a")
        );
        assert!(strict_eligible(&json!({"type": "array"})).is_err());
        assert!(strict_eligible(&json!(true)).is_err());
        let with_defs = json!({
            "type": "object", "additionalProperties": false, "required": ["d"],
            "properties": {"d": {"$ref": "#/$defs/decision"}},
            "$defs": {"decision": {"type": "string", "enum": ["a", "b"]}}
        });
        assert_eq!(strict_eligible(&with_defs), Ok(()));
        let s = OutputSchema::compile(&with_defs).unwrap();
        assert!(s.format("refund agent/v2").strict);
        assert_eq!(s.format("refund agent/v2").name, "refund_agent_v2");
        assert!(!OutputSchema::compile(&open).unwrap().format("a").strict);
    }

    #[test]
    fn schema_bombs_and_remote_references_are_refused_before_compiling() {
        // Exponential $ref fan-out: each level refers twice to the next.
        let mut defs = Map::new();
        for i in 0..30 {
            defs.insert(
                format!("l{i}"),
                json!({"allOf": [{"$ref": format!("#/$defs/l{}", i + 1)}, {"$ref": format!("#/$defs/l{}", i + 1)}]}),
            );
        }
        defs.insert("l30".into(), json!({"type": "integer"}));
        let bomb = json!({"$ref": "#/$defs/l0", "$defs": defs});
        assert!(matches!(
            OutputSchema::compile(&bomb).unwrap_err(),
            SchemaError::Expansion { limit: MAX_EXPANDED_NODES, via } if via.starts_with("/$ref/allOf/0/$ref/allOf/0/$ref")
        ));
        // Deep nesting.
        let mut deep = json!({"type": "string"});
        for _ in 0..200 {
            deep = json!({"items": deep});
        }
        assert!(matches!(
            OutputSchema::compile(&deep).unwrap_err(),
            SchemaError::TooDeep { .. }
        ));
        // Recursion, direct and through $defs.
        let direct = json!({"type": "object", "properties": {"child": {"$ref": "#"}}});
        assert!(matches!(
            OutputSchema::compile(&direct).unwrap_err(),
            SchemaError::Recursive { .. }
        ));
        let cycle = json!({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"items": {"$ref": "#/$defs/a"}}}});
        assert!(matches!(
            OutputSchema::compile(&cycle).unwrap_err(),
            SchemaError::Recursive { .. }
        ));
        // Nothing is fetched.
        for reference in [
            "https://example.com/schema.json",
            "file:///etc/passwd",
            "other.json#/x",
            "#anchor",
        ] {
            let e = OutputSchema::compile(&json!({"$ref": reference})).unwrap_err();
            assert!(
                matches!(e, SchemaError::Reference { .. }),
                "{reference}: {e}"
            );
        }
        assert!(matches!(
            OutputSchema::compile(&json!({"$ref": "#/$defs/nope"})).unwrap_err(),
            SchemaError::Reference { .. }
        ));
        // Too large.
        let big = json!({"enum": vec!["x".repeat(100); 1000]});
        assert!(matches!(
            OutputSchema::compile(&big).unwrap_err(),
            SchemaError::TooLarge { .. }
        ));
        // Not a schema.
        assert!(matches!(
            OutputSchema::compile(&json!({"type": "nothing"})).unwrap_err(),
            SchemaError::Invalid { .. }
        ));
        // A property named like a keyword is a property, not a reference.
        let named = json!({"type": "object", "properties": {"$ref": {"type": "string"}}});
        assert!(OutputSchema::compile(&named).is_ok());
    }

    #[test]
    fn patterns_run_on_a_linear_engine() {
        // Catastrophic backtracking on a backtracking engine; linear on `regex`.
        let s = OutputSchema::compile(&json!({"type": "string", "pattern": "^(a+)+$"})).unwrap();
        let evil = format!("\"{}b\"", "a".repeat(50_000));
        let started = std::time::Instant::now();
        assert!(judge(Some(&s), &evil, "stop", None).is_err());
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        // A look-around only a backtracking engine supports is a schema that does not compile.
        assert!(matches!(
            OutputSchema::compile(&json!({"type": "string", "pattern": "(?=a)a"})).unwrap_err(),
            SchemaError::Invalid { .. }
        ));
    }

    /// The heaviest schema the subschema bound allows (about 440 subschemas with the `$ref`s
    /// inlined: ten references to a 42-branch `anyOf` whose last branch alone takes an integer,
    /// so every integer item meets all of them), and an array answer of `bytes` of one-digit
    /// integers (the most values per byte) but its last item, which matches no branch: the
    /// whole answer is checked before the one error is found.
    fn heaviest_by_subschemas(bytes: usize) -> (Value, String) {
        let mut branches: Vec<Value> = (0..(MAX_EXPANDED_NODES / 11 - 4))
            .map(|i| json!({"type": "string", "minLength": i}))
            .collect();
        branches.push(json!({"type": "integer"}));
        let refs: Vec<Value> = (0..10).map(|_| json!({"$ref": "#/$defs/d"})).collect();
        let schema = json!({
            "type": "array",
            "items": {"allOf": refs},
            "$defs": {"d": {"anyOf": branches}}
        });
        let items = (bytes.saturating_sub(6) / 2).max(1);
        let mut answer = vec!["1"; items];
        answer.push("true");
        (schema, format!("[{}]", answer.join(",")))
    }

    /// The heaviest schema by `enum` values the weight bound allows, of mixed types (so the
    /// validator compares one by one; an enum of only strings or only integers is hashed), and
    /// a `bytes` answer of one-digit items, in it as its last value, but the last item, which is
    /// not: every item is compared with every value.
    fn heaviest_by_enum(bytes: usize) -> (Value, String) {
        let mut values: Vec<Value> = (0..(VALIDATION_WORK / MIN_ANSWER_BYTES - 5))
            .map(|i| json!(i as f64 + 0.5))
            .collect();
        values.push(json!(1));
        let schema = json!({"type": "array", "items": {"enum": values}});
        let items = (bytes.saturating_sub(6) / 2).max(1);
        let mut answer = vec!["1"; items];
        answer.push("-1");
        (schema, format!("[{}]", answer.join(",")))
    }

    #[test]
    fn a_heavy_schema_validates_shorter_answers_and_the_heaviest_is_refused() {
        let light = OutputSchema::compile(&routing()).unwrap();
        assert_eq!(light.answer_limit, MAX_ANSWER_BYTES);

        let (schema, _) = heaviest_by_subschemas(0);
        let heavy = OutputSchema::compile(&schema).unwrap();
        assert!(heavy.answer_limit >= MIN_ANSWER_BYTES);
        assert!(heavy.answer_limit * 400 <= VALIDATION_WORK, "{heavy:?}");
        // The answer that cost seconds of CPU before: refused by its size, before any work.
        let (_, answer) = heaviest_by_subschemas(MAX_ANSWER_BYTES);
        let r = judge(Some(&heavy), &answer, "stop", None).unwrap_err();
        assert_eq!(r.reason, RejectReason::TooLarge);
        assert!(r.detail.contains(&heavy.answer_limit.to_string()), "{r:?}");

        let (schema, _) = heaviest_by_enum(0);
        let by_enum = OutputSchema::compile(&schema).unwrap();
        assert_eq!(
            by_enum.answer_limit,
            VALIDATION_WORK / (VALIDATION_WORK / MIN_ANSWER_BYTES - 2)
        );
        let values: Vec<Value> = (0..VALIDATION_WORK / MIN_ANSWER_BYTES)
            .map(|i| json!(i))
            .collect();
        let refused = OutputSchema::compile(&json!({"type": "array", "items": {"enum": values}}));
        assert!(
            matches!(refused, Err(SchemaError::TooHeavy { .. })),
            "{refused:?}"
        );
        // An enum counts once per place it is used, as a subschema does.
        let values: Vec<Value> = (0..600).map(|i| json!(i)).collect();
        let reused = json!({
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/e"}, "b": {"$ref": "#/$defs/e"}, "c": {"$ref": "#/$defs/e"}, "d": {"$ref": "#/$defs/e"}},
            "$defs": {"e": {"enum": values}}
        });
        assert!(matches!(
            OutputSchema::compile(&reused),
            Err(SchemaError::TooHeavy { .. })
        ));
    }

    /// A validation, however slow, does not hold the async runtime: on a one-thread runtime, a
    /// heartbeat-like timer keeps firing while the worst answer the bounds allow is validated.
    /// (Validated inline, as before, the validation ran to its end at the first yield, and the
    /// timer fired not once meanwhile.)
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_worst_case_validation_does_not_stall_other_tasks() {
        use std::sync::atomic::{AtomicU32, Ordering};
        let (schema, _) = heaviest_by_subschemas(0);
        let schema = OutputSchema::compile(&schema).unwrap();
        let (_, answer) = heaviest_by_subschemas(schema.answer_limit);
        let beats = Arc::new(AtomicU32::new(0));
        let heartbeat = tokio::spawn({
            let beats = beats.clone();
            async move {
                let mut every = tokio::time::interval(std::time::Duration::from_millis(10));
                loop {
                    every.tick().await;
                    beats.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
        tokio::task::yield_now().await;
        let validation = tokio::spawn(async move {
            // No deadline here: this test moves the clock by hand, past any.
            let never = std::time::Duration::from_secs(86_400);
            judge_off_runtime(Some(&schema), &answer, "stop", None, never).await
        });
        let mut beats_meanwhile = 0;
        while !validation.is_finished() {
            tokio::time::advance(std::time::Duration::from_millis(10)).await;
            tokio::task::yield_now().await;
            if !validation.is_finished() {
                beats_meanwhile = beats.load(Ordering::SeqCst);
            }
        }
        let verdict = validation.await.unwrap().unwrap();
        heartbeat.abort();
        assert_eq!(verdict.unwrap_err().reason, RejectReason::Schema);
        assert!(
            beats_meanwhile >= 3,
            "the timer fired {beats_meanwhile} times while the answer was validated"
        );
    }

    /// The figures in docs/benchmarks-history.md ("Validating a final answer"): the worst answers against
    /// the heaviest schemas, before (the 64 KiB cap alone, validated directly) and with the
    /// weight bound (`cargo test --lib output::tests::figure -- --ignored --nocapture`, in the
    /// build profile the figure names).
    #[test]
    #[ignore = "a figure, not a check: seconds of CPU per run; run it with --ignored --nocapture"]
    fn figure_worst_case_validation_time() {
        let time = |what: &str, s: &OutputSchema, answer: &str, direct: bool| {
            for round in 0..3 {
                let started = std::time::Instant::now();
                let valid = if direct {
                    let v: Value = serde_json::from_str(answer).unwrap();
                    s.validator.iter_errors(&v).next().is_none()
                } else {
                    judge(Some(s), answer, "stop", None).is_ok()
                };
                println!(
                    "{what}, round {round}: {} bytes against answer cap {}: {:?} (valid: {valid})",
                    answer.len(),
                    s.answer_limit,
                    started.elapsed(),
                );
            }
        };
        let (schema, _) = heaviest_by_subschemas(0);
        let s = OutputSchema::compile(&schema).unwrap();
        // Before: every error collected, for an answer whose every item fails every branch.
        let invalid = format!("[{}]", vec!["[]"; MAX_ANSWER_BYTES / 3 - 1].join(","));
        time(
            "442 subschemas, 64 KiB of failing items, every error (before)",
            &s,
            &invalid,
            true,
        );
        let (_, before) = heaviest_by_subschemas(MAX_ANSWER_BYTES);
        time(
            "442 subschemas, 64 KiB failing at the end, every error (before)",
            &s,
            &before,
            true,
        );
        let (_, after) = heaviest_by_subschemas(s.answer_limit);
        time(
            "442 subschemas, its answer cap, failing at the end (after)",
            &s,
            &after,
            false,
        );
        let invalid = format!("[{}]", vec!["[]"; s.answer_limit / 3 - 1].join(","));
        time(
            "442 subschemas, its answer cap of failing items (after)",
            &s,
            &invalid,
            false,
        );
        let (schema, _) = heaviest_by_enum(0);
        let s = OutputSchema::compile(&schema).unwrap();
        let (_, before) = heaviest_by_enum(MAX_ANSWER_BYTES);
        time("2,044 enum values, 64 KiB (before)", &s, &before, true);
        let (_, after) = heaviest_by_enum(s.answer_limit);
        time(
            "2,044 enum values, its answer cap (after)",
            &s,
            &after,
            false,
        );
    }

    /// The schema that crashed replicas: a chain of `anyOf`s of two `$ref`s to the next
    /// level, `levels` deep (24: 1.5 KB), used under `keyword` (`then` and `else` beside an
    /// `if`, `additionalItems` beside an `items` array).
    pub(crate) fn chain_under(keyword: &str, levels: usize) -> Value {
        let mut defs = Map::new();
        for i in 0..levels {
            let next = json!({"$ref": format!("#/$defs/l{}", i + 1)});
            defs.insert(format!("l{i}"), json!({"anyOf": [next.clone(), next]}));
        }
        defs.insert(format!("l{levels}"), json!({"type": "integer"}));
        let head = json!({"$ref": "#/$defs/l0"});
        let mut schema = match keyword {
            "dependencies" | "dependentSchemas" | "properties" | "patternProperties" => {
                json!({keyword: {"a": head}})
            }
            "then" | "else" => json!({"if": {"type": "object"}, keyword: head}),
            "additionalItems" => json!({"items": [{}], "additionalItems": head}),
            "allOf" | "anyOf" | "oneOf" => json!({keyword: [head]}),
            _ => json!({keyword: head}),
        };
        schema["$defs"] = Value::Object(defs);
        schema
    }

    /// Every place the chain can hide is refused when the definition is read, naming where:
    /// `dependencies` (which the walker once did not know: weight 1, then 3.1 GB to report an
    /// error at 20 levels), and every other applicator (counted, and over the bound), and the
    /// keywords refused outright.
    #[test]
    fn the_any_of_chain_is_refused_under_every_keyword_naming_where() {
        for keyword in [
            "dependencies",
            "not",
            "if",
            "then",
            "else",
            "propertyNames",
            "contains",
            "additionalItems",
            "unevaluatedItems",
            "unevaluatedProperties",
            "items",
            "dependentSchemas",
            "additionalProperties",
            "allOf",
            "oneOf",
        ] {
            let schema = chain_under(keyword, 24);
            assert!(serde_json::to_vec(&schema).unwrap().len() < 2048);
            let e = OutputSchema::compile(&schema).unwrap_err();
            let named = format!("/{keyword}");
            let message = e.to_string();
            match &e {
                SchemaError::Expansion { via, .. } => {
                    assert!(via.starts_with(&named), "{keyword}: {e}");
                }
                SchemaError::Unsupported { keyword: k, .. } => assert_eq!(k, keyword),
                other => panic!("{keyword}: {other}"),
            }
            assert!(message.contains(keyword), "{message}");
        }
        // An unknown keyword holding it is refused as unknown.
        let hidden = chain_under("x-hidden", 24);
        assert_eq!(
            OutputSchema::compile(&hidden).unwrap_err(),
            SchemaError::UnknownKeyword {
                keyword: "x-hidden".into(),
                pointer: "/".into()
            }
        );
        // And a short chain, under the bound, still compiles.
        assert!(OutputSchema::compile(&chain_under("dependencies", 4)).is_ok());
    }

    /// The reporting copy finds the error the schema's own validator reports first (same
    /// places, same message), for every keyword it rewrites and the ones it leaves alone.
    #[test]
    fn the_reported_error_is_the_schemas_first_error() {
        let cases = [
            (routing(), json!({"decision": "maybe", "amountCents": 1})),
            (
                json!({"anyOf": [{"type": "string"}, {"type": "integer"}]}),
                json!([1]),
            ),
            (
                json!({"properties": {"a": {"anyOf": [{"$ref": "#/$defs/s"}, {"minimum": 3}]}},
                       "$defs": {"s": {"type": "string"}}}),
                json!({"a": 1}),
            ),
            (
                json!({"items": {"anyOf": [{"$ref": "#/anyOf/0"}, {"type": "null"}]},
                       "anyOf": [{"type": "array"}, {"type": "object"}]}),
                json!([true]),
            ),
            (
                json!({"properties": {"a": {"$ref": "#/$defs/n/oneOf/1"}},
                       "$defs": {"n": {"oneOf": [{"type": "null"}, {"anyOf": [{"type": "integer"}]}]}}}),
                json!({"a": "x"}),
            ),
            (
                json!({"dependencies": {"a": {"required": ["b"]}, "c": ["d"]}}),
                json!({"a": 1}),
            ),
            (
                json!({"if": {"properties": {"k": {"const": 1}}}, "then": {"required": ["x"]}}),
                json!({"k": 1}),
            ),
        ];
        for (schema, answer) in cases {
            let s = OutputSchema::compile(&schema).unwrap();
            let expected = s.validator.validate(&answer).unwrap_err();
            let (instance, path, message) = report::first_error(&s.reporter, &answer).unwrap();
            assert_eq!(instance, expected.instance_path().as_str(), "{schema}");
            assert_eq!(path, expected.schema_path().as_str(), "{schema}");
            assert_eq!(message, expected.to_string(), "{schema}");
        }
        // A oneOf says what it can without its branches.
        let s = OutputSchema::compile(&json!({"oneOf": [{"type": "integer"}, {"minimum": 0}]}))
            .unwrap();
        let r = judge(Some(&s), "3", "stop", None).unwrap_err();
        assert_eq!(r.location.as_deref(), Some("instance /, schema /oneOf"));
        assert!(r.detail.contains("none, or more than one"), "{r:?}");
        // A not says so without quoting the copy's subschema.
        let s = OutputSchema::compile(&json!({"not": {"anyOf": [{"type": "string"}]}})).unwrap();
        let r = judge(Some(&s), "\"s\"", "stop", None).unwrap_err();
        assert_eq!(r.location.as_deref(), Some("instance /, schema /not"));
        assert!(r.detail.contains("matches the schema under 'not'"), "{r:?}");
        assert!(!r.detail.contains("anyOf"), "{r:?}");
    }

    /// A failed `anyOf` costs one error to report, not one per branch: against a weight the
    /// bounds allow, the schema's own validator builds an error tree of thousands of nodes for
    /// one answer; the reporting copy, one error with one branch.
    #[test]
    fn a_failed_any_of_reports_one_error_not_its_branches() {
        fn size(e: &jsonschema::ValidationError<'_>) -> usize {
            use jsonschema::error::ValidationErrorKind as K;
            let context = match e.kind() {
                K::AnyOf { context }
                | K::OneOfNotValid { context }
                | K::OneOfMultipleValid { context } => context,
                _ => return 1,
            };
            1 + context.iter().flatten().map(size).sum::<usize>()
        }
        // Six levels of two-branch anyOfs (weight about 2^8, under the bound), and an answer
        // no branch takes: the full report doubles with every level.
        let schema = chain_under("items", 6);
        let s = OutputSchema::compile(&schema).unwrap();
        let answer = json!(["no"]);
        let full = s.validator.validate(&answer).unwrap_err();
        let reported = s.reporter.validate(&answer).unwrap_err();
        assert!(size(&full) >= 127, "{}", size(&full));
        assert_eq!(size(&reported), 2);
        let r = judge(Some(&s), "[\"no\"]", "stop", None).unwrap_err();
        assert_eq!(
            r.location.as_deref(),
            Some("instance /0, schema /$defs/l0/anyOf")
        );
    }

    /// The deepest chain of `$ref`s the bounds allow (each level `{"anyOf": [{...}, {"$ref":
    /// next}]}`: about 165 levels) is read on a thread of tokio's default stack (2 MiB: the
    /// runtime's and the blocking pool's) and judged on a blocking thread without overflowing it,
    /// on the debug build (the largest frames): an answer that went down every level, and one
    /// refused at the bottom (the reporting copy's path).
    #[test]
    fn the_deepest_chain_the_bounds_allow_fits_a_default_thread_stack() {
        type Level = fn(Value) -> Value;
        let shapes: [(&str, Level); 4] = [
            // Down the answer too: 120 arrays deep (serde_json stops at 128).
            ("items", |next| json!({"type": "array", "items": next})),
            (
                "anyOf",
                |next| json!({"anyOf": [{"type": "string", "maxLength": 0}, next]}),
            ),
            ("$ref", |next| next),
            ("allOf", |next| json!({"allOf": [next]})),
        ];
        for (shape, level) in shapes {
            let chain = |levels: usize| {
                let mut defs = Map::new();
                for i in 0..levels {
                    let next = json!({"$ref": format!("#/$defs/l{}", i + 1)});
                    defs.insert(format!("l{i}"), level(next));
                }
                defs.insert(format!("l{levels}"), json!({"type": "integer"}));
                json!({"type": "array", "items": {"$ref": "#/$defs/l0"}, "$defs": defs})
            };
            // The most levels the bounds take (they take every count below it).
            let (mut levels, mut over) = (1, 600);
            while over - levels > 1 {
                let mid = (levels + over) / 2;
                if check_bounds(&chain(mid)).is_ok() {
                    levels = mid;
                } else {
                    over = mid;
                }
            }
            let schema = chain(levels);
            assert!(levels > 150, "{shape}: {levels}");
            let verdicts = std::thread::Builder::new()
                .stack_size(2 * 1024 * 1024)
                .spawn(move || {
                    let s = OutputSchema::compile(&schema).unwrap();
                    let deep = format!("{}{}", "[".repeat(120), "]".repeat(120));
                    let deep_off = format!("{}true{}", "[".repeat(120), "]".repeat(120));
                    let (valid, refused) = if shape == "items" {
                        (deep, deep_off)
                    } else {
                        ("[1, 2, 3]".to_string(), "[1, true]".to_string())
                    };
                    (
                        judge(Some(&s), &valid, "stop", None),
                        judge(Some(&s), &refused, "stop", None),
                    )
                })
                .unwrap()
                .join()
                .unwrap();
            assert!(verdicts.0.is_ok(), "{shape}: {verdicts:?}");
            assert_eq!(verdicts.1.unwrap_err().reason, RejectReason::Schema);
        }
    }

    /// A validation past its deadline is given up: the task gets `OverBudget` at the deadline
    /// (on the paused clock, which does not move by itself while a blocking job runs), not when
    /// the job ends; and the job keeps its permit until it does end.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_validation_past_its_deadline_is_given_up() {
        let (release, held) = std::sync::mpsc::channel::<()>();
        let deadline = std::time::Duration::from_secs(10);
        let waiting = tokio::spawn(off_runtime(
            move || {
                let _ = held.recv();
                "done"
            },
            deadline,
        ));
        tokio::task::yield_now().await;
        tokio::time::advance(deadline - std::time::Duration::from_millis(1)).await;
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        tokio::time::advance(std::time::Duration::from_millis(2)).await;
        assert_eq!(
            waiting.await.unwrap(),
            Err(Unjudged::OverBudget { limit: deadline })
        );
        release.send(()).unwrap();
    }

    #[test]
    fn repairs_round_trip_through_the_journal_record() {
        let r = Rejection {
            reason: RejectReason::Truncated,
            location: None,
            detail: "10 tokens".into(),
        };
        let data = json!({ JOURNAL_FIELD: journal_record(&r) });
        let back = journaled_repair(&data).unwrap().unwrap();
        assert_eq!(back.reason, Some(RejectReason::Truncated));
        assert_eq!(back.message, r.repair_message());
        assert_eq!(journaled_repair(&json!({})), Ok(None));
        assert!(journaled_repair(&json!({ JOURNAL_FIELD: {} })).is_err());
    }
}
