//! The context window of a conversation: no request is sent that the model would
//! have to refuse as too long. Before each model call the request's tokens are estimated; when
//! the estimate and the room for the answer (`maxOutputTokens`) exceed the smallest window of
//! the definition's models, the oldest tool results are replaced by a stub that says so, one at
//! a time, until the request fits. The instructions, the input, every model answer, the
//! results of the latest answer and the result of every keyed write (a write, or a call a
//! person approved: its result is the only record the model has that it was performed) are
//! kept; a stub says the call was performed and must not be repeated to perform it again. When even that does not fit, the task ends with
//! [`WindowExceeded`], an incident naming the sizes, worded like a model's own refusal.
//!
//! The elision is derived, not journaled: it is a pure function of the journaled conversation,
//! the tools offered, the window and `maxOutputTokens`. The engine's journal has a fixed set of
//! step kinds (protocol.md B.2) and keeps every result whole, so a resumed attempt (or one on
//! the run store) rebuilds the same messages from its steps and elides the same results. It
//! never un-elides: the conversation only grows, so a result elided for one request is elided
//! for every later one under the same settings.
//!
//! The estimate is deliberately high, since a low one lets through a request the model
//! refuses: 3 bytes per token (BPE tokenizers average about 4 for English and 3 to 3.5 for JSON
//! and code; CJK text is about 3 bytes per token), rounded up per message, plus what chat
//! templates add around each message, tool and request. An operator who sees a model refuse
//! anyway sets the provider's `_CONTEXT_WINDOW` lower.

use std::collections::HashSet;

use crate::conversation::{Message, ToolResult};
use crate::provider::ModelRef;
use crate::provider::ModelRequest;
use crate::provider::context::ContextWindows;
use crate::provider::token_estimate::{message_bytes, tool_bytes};

/// Bytes per token of the window's estimate (see the module docs).
pub(crate) const BYTES_PER_TOKEN: u64 = 3;
/// What a chat template adds around one message (role markers, separators, a call's envelope).
pub(crate) const TOKENS_PER_MESSAGE: u64 = 8;
/// What a template adds around one tool's schema.
pub(crate) const TOKENS_PER_TOOL: u64 = 16;
/// What a template adds to every request (the system turn's markers, the tool-use preamble).
pub(crate) const TOKENS_PER_REQUEST: u64 = 128;

/// The incident's message when a conversation outgrows the window, the worker's estimate or
/// the model's own refusal alike.
pub(crate) const INCIDENT: &str = "the conversation is too long for the model's context window";

/// The request would not fit the model's window, even with every older tool result elided.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the next request to {model} needs an estimated {estimate} tokens (instructions {instructions}, tools {tools}, conversation {conversation}) plus maxOutputTokens = {output} for the answer: more than its context window of {window} tokens, with {elided} older tool results already elided; shorten the instructions or the input, lower maxOutputTokens, offer fewer tools, or use a model with a larger window (ABADA_AGENT_PROVIDER_<NAME>_CONTEXT_WINDOW)"
)]
pub(crate) struct WindowExceeded {
    pub model: String,
    pub window: u64,
    pub estimate: u64,
    pub instructions: u64,
    pub tools: u64,
    pub conversation: u64,
    pub output: u32,
    pub elided: usize,
}

/// What fitting did to a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Fitted {
    /// Tool results replaced by a stub.
    pub elided: usize,
    /// The request's estimated input tokens after that.
    pub estimate: u64,
    /// The window it was fitted to; None when no model of the chain has a known window.
    pub window: Option<u64>,
}

fn tokens(bytes: usize) -> u64 {
    (bytes as u64).div_ceil(BYTES_PER_TOKEN)
}

fn message_tokens(m: &Message) -> u64 {
    tokens(message_bytes(m)).saturating_add(TOKENS_PER_MESSAGE)
}

/// The window's estimate of a request's input tokens.
pub(crate) fn estimate(request: &ModelRequest) -> u64 {
    let (instructions, tools, conversation) = parts(request);
    instructions
        .saturating_add(tools)
        .saturating_add(conversation)
}

fn parts(request: &ModelRequest) -> (u64, u64, u64) {
    let instructions = tokens(request.system.len()).saturating_add(TOKENS_PER_REQUEST);
    let tools = request
        .tools
        .iter()
        .map(|t| tokens(tool_bytes(t)).saturating_add(TOKENS_PER_TOOL))
        .fold(0u64, u64::saturating_add);
    let conversation = request
        .messages
        .iter()
        .map(message_tokens)
        .fold(0u64, u64::saturating_add);
    (instructions, tools, conversation)
}

/// What a model reads in place of an elided result.
fn stub(tool: &str, bytes: usize, window: u64, was_error: bool) -> ToolResult {
    ToolResult {
        content: vec![serde_json::json!({
            "type": "text",
            "text": format!(
                "[elided by the worker: the call of {tool} was performed; its result ({bytes} bytes) was removed to keep the conversation within the model's context window of {window} tokens. Do not repeat the call to perform it again; a read-only lookup may be repeated only to read its data again]"
            ),
        })],
        structured_content: None,
        is_error: was_error,
    }
}

/// Fits `request` to the smallest known window of `models` (see the module docs), leaving
/// `max_output_tokens` of room for the answer; the results of the calls in `kept` (keyed
/// writes and approved calls, by call id) are never elided. A chain with no known window is
/// left as it is.
pub(crate) fn fit_to_chain(
    request: &mut ModelRequest,
    windows: &ContextWindows,
    models: &[ModelRef],
    max_output_tokens: u32,
    kept: &HashSet<String>,
) -> Result<Fitted, WindowExceeded> {
    let Some((model, window)) = windows.smallest(models) else {
        return Ok(Fitted {
            elided: 0,
            estimate: estimate(request),
            window: None,
        });
    };
    let fitted = fit(request, &model.to_string(), window, max_output_tokens, kept)?;
    if fitted.elided > 0 {
        tracing::info!(
            elided = fitted.elided,
            estimated_tokens = fitted.estimate,
            context_window = window,
            model = %model,
            "older tool results elided to fit the model's context window"
        );
    }
    Ok(fitted)
}

/// Fits `request` to `window` tokens with `max_output_tokens` of room for the answer: the
/// oldest tool results before the latest model answer are elided first, each only when its
/// stub is smaller than it; a result of a call in `kept` never is.
pub(crate) fn fit(
    request: &mut ModelRequest,
    model: &str,
    window: u64,
    max_output_tokens: u32,
    kept: &HashSet<String>,
) -> Result<Fitted, WindowExceeded> {
    let (instructions, tools, mut conversation) = parts(request);
    let fixed = instructions.saturating_add(tools);
    let room = u64::from(max_output_tokens);
    let over = |conversation: u64| fixed.saturating_add(conversation).saturating_add(room) > window;
    // The results of the latest answer are the turn the model is about to act on: kept.
    let latest_answer = request
        .messages
        .iter()
        .rposition(|m| matches!(m, Message::Assistant(_)))
        .unwrap_or(0);
    let mut elided = 0;
    for message in request.messages[..latest_answer].iter_mut() {
        if !over(conversation) {
            break;
        }
        let Message::ToolResult { call, result } = message else {
            continue;
        };
        if kept.contains(&call.call_id) {
            continue;
        }
        let bytes = result.to_model_text().len();
        let replacement = Message::ToolResult {
            call: call.clone(),
            result: stub(&call.tool, bytes, window, result.is_error),
        };
        let (before, after) = (message_tokens(message), message_tokens(&replacement));
        if after >= before {
            continue;
        }
        *message = replacement;
        conversation = conversation - before + after;
        elided += 1;
    }
    let estimate = fixed.saturating_add(conversation);
    if over(conversation) {
        return Err(WindowExceeded {
            model: model.to_string(),
            window,
            estimate,
            instructions,
            tools,
            conversation,
            output: max_output_tokens,
            elided,
        });
    }
    Ok(Fitted {
        elided,
        estimate,
        window: Some(window),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conversation::{AssistantMessage, ToolCall, ToolSpec};
    use serde_json::json;

    fn call(id: &str) -> ToolCall {
        ToolCall {
            call_id: id.into(),
            server: "docs".into(),
            tool: "read_document".into(),
            arguments: json!({"documentId": id}),
        }
    }

    fn result(bytes: usize) -> ToolResult {
        ToolResult {
            content: vec![json!({"type": "text", "text": "r".repeat(bytes)})],
            structured_content: None,
            is_error: false,
        }
    }

    /// Input, then `turns` answers each calling one tool with a `bytes`-long result.
    fn conversation(turns: usize, bytes: usize) -> Vec<Message> {
        let mut messages = vec![Message::User {
            text: "the input".into(),
        }];
        for i in 0..turns {
            let c = call(&format!("c{i}"));
            messages.push(Message::Assistant(AssistantMessage {
                text: None,
                tool_calls: vec![c.clone()],
            }));
            messages.push(Message::ToolResult {
                call: c,
                result: result(bytes),
            });
        }
        messages
    }

    fn request(messages: Vec<Message>) -> ModelRequest {
        ModelRequest {
            system: "You read documents.".into(),
            messages,
            tools: vec![ToolSpec {
                server: "docs".into(),
                tool: "read_document".into(),
                description: "Reads a document.".into(),
                input_schema: json!({"type": "object"}),
                read_only: true,
                destructive: false,
            }],
            ..Default::default()
        }
    }

    fn is_stub(m: &Message) -> bool {
        matches!(m, Message::ToolResult { result, .. } if result.to_model_text().starts_with("[elided by the worker"))
    }

    #[test]
    fn a_request_that_fits_is_left_untouched() {
        let original = request(conversation(3, 3000));
        let mut req = original.clone();
        let fitted = fit(&mut req, "local/m", 100_000, 1000, &HashSet::new()).unwrap();
        assert_eq!(fitted.elided, 0);
        assert_eq!(req, original);
        assert_eq!(fitted.estimate, estimate(&original));
    }

    #[test]
    fn the_oldest_results_are_elided_first_and_the_input_answers_and_latest_results_kept() {
        let original = request(conversation(5, 3000));
        let mut req = original.clone();
        // 5 results of ~1000 tokens each: a 3500-token window with 500 for the answer keeps 2.
        let fitted = fit(&mut req, "local/m", 3500, 500, &HashSet::new()).unwrap();
        assert_eq!(fitted.elided, 3);
        assert!(fitted.estimate + 500 <= 3500, "{fitted:?}");
        assert_eq!(fitted.estimate, estimate(&req));
        let stubs: Vec<bool> = req.messages.iter().map(is_stub).collect();
        // input, (answer, result) x 5: results 1..3 elided, 4 and 5 kept.
        assert_eq!(
            stubs,
            [
                false, false, true, false, true, false, true, false, false, false, false
            ]
        );
        // A kept result (a keyed write's) is never elided, however old.
        let mut kept_req = original.clone();
        let oldest = kept_req
            .messages
            .iter()
            .find_map(|m| match m {
                Message::ToolResult { call, .. } => Some(call.call_id.clone()),
                _ => None,
            })
            .unwrap();
        let kept: HashSet<String> = [oldest.clone()].into();
        fit(&mut kept_req, "local/m", 3500, 500, &kept).unwrap();
        assert!(kept_req.messages.iter().any(|m| matches!(m,
            Message::ToolResult { call, .. } if call.call_id == oldest && !is_stub(m))));
        // Nothing but the elided results changed; each stub keeps its call and names it.
        for (before, after) in original.messages.iter().zip(&req.messages) {
            match (before, after) {
                (
                    Message::ToolResult { call: a, .. },
                    Message::ToolResult { call: b, result: r },
                ) => {
                    assert_eq!(a, b);
                    if is_stub(after) {
                        let text = r.to_model_text();
                        assert!(
                            text.contains("read_document was performed")
                                && text.contains("(3000 bytes)")
                                && text.contains("Do not repeat the call"),
                            "{text}"
                        );
                        assert!(text.contains("context window of 3500 tokens"), "{text}");
                    }
                }
                _ => assert_eq!(before, after),
            }
        }
        assert_eq!(req.system, original.system);
        assert_eq!(req.tools, original.tools);
    }

    #[test]
    fn the_latest_answers_results_are_never_elided_so_a_request_too_big_ends_with_the_sizes() {
        // One huge result of the latest answer cannot be elided.
        let mut req = request(conversation(1, 30_000));
        let e = fit(&mut req, "local/m", 4096, 256, &HashSet::new()).unwrap_err();
        assert_eq!(e.window, 4096);
        assert_eq!(e.output, 256);
        assert_eq!(e.elided, 0);
        assert!(e.estimate > 10_000, "{e:?}");
        let text = e.to_string();
        for part in [
            "local/m",
            "context window of 4096 tokens",
            "maxOutputTokens = 256",
            &format!("needs an estimated {} tokens", e.estimate),
        ] {
            assert!(text.contains(part), "{part}: {text}");
        }
        // An input alone past the window, and a window with no room for the answer.
        let mut req = request(vec![Message::User {
            text: "x".repeat(50_000),
        }]);
        assert!(fit(&mut req, "local/m", 4096, 256, &HashSet::new()).is_err());
        let mut req = request(conversation(0, 0));
        let e = fit(&mut req, "local/m", 4096, 4096, &HashSet::new()).unwrap_err();
        assert!(e.to_string().contains("maxOutputTokens = 4096"), "{e}");
    }

    #[test]
    fn elision_is_deterministic_and_never_undone_as_the_conversation_grows() {
        let mut elided_before: Vec<bool> = Vec::new();
        for turns in 1..=12 {
            let mut a = request(conversation(turns, 2000));
            let mut b = a.clone();
            let fa = fit(&mut a, "m", 6000, 300, &HashSet::new()).unwrap();
            let fb = fit(&mut b, "m", 6000, 300, &HashSet::new()).unwrap();
            assert_eq!((fa, &a), (fb, &b), "the same journal, the same request");
            let now: Vec<bool> = a.messages.iter().map(is_stub).collect();
            for (i, was) in elided_before.iter().enumerate() {
                assert!(!was || now[i], "turn {turns}: message {i} came back");
            }
            assert!(fa.estimate + 300 <= 6000);
            elided_before = now;
        }
        assert!(elided_before.iter().filter(|s| **s).count() >= 4);
    }

    #[test]
    fn a_resumed_attempt_rebuilds_the_same_elided_request_from_the_journal() {
        use super::super::journal::{self, Replayed};
        use crate::conversation::Usage;
        // The journal of a run that read four documents, as an attempt writes it.
        let live = conversation(4, 3000);
        let mut steps = vec![journal::input_step(1, "You read documents.", "the input")];
        for m in &live[1..] {
            let seq = steps.len() as u64 + 1;
            steps.push(match m {
                Message::Assistant(a) => {
                    journal::model_step(seq, "local/m", a, Usage::default(), "tool_calls")
                }
                Message::ToolResult { call, result } => {
                    journal::tool_finished_step(seq, None, call, result)
                }
                Message::User { .. } => unreachable!("one input"),
            });
        }
        let replayed = Replayed::from_steps(&steps).unwrap();
        assert_eq!(
            replayed.messages, live,
            "the journal keeps every result whole"
        );
        let mut resumed = request(replayed.messages);
        let mut original = request(live);
        let a = fit(&mut original, "local/m", 3000, 300, &HashSet::new()).unwrap();
        let b = fit(&mut resumed, "local/m", 3000, 300, &HashSet::new()).unwrap();
        assert!(a.elided >= 2, "{a:?}");
        assert_eq!((a, original), (b, resumed));
    }

    #[test]
    fn results_smaller_than_their_stub_are_left_and_hostile_sizes_saturate() {
        let mut req = request(conversation(4, 10));
        let e = fit(&mut req, "m", 256, 200, &HashSet::new()).unwrap_err();
        assert_eq!(e.elided, 0, "eliding a tiny result would only grow it");
        let mut req = request(conversation(2, 100));
        assert!(fit(&mut req, "m", u64::MAX, u32::MAX, &HashSet::new()).is_ok());
        assert!(fit(&mut req, "m", 0, 0, &HashSet::new()).is_err());
    }

    #[test]
    fn the_estimate_is_never_below_the_budgets() {
        // The window errs high: a request the budget's estimate passes may still not fit.
        for bytes in [0, 10, 1000, 100_000] {
            let req = request(conversation(3, bytes));
            assert!(
                estimate(&req) >= crate::provider::token_estimate::estimate_request_tokens(&req)
            );
        }
    }
}
