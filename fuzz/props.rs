//! The properties the fuzz targets check, one function per target, shared by the libFuzzer
//! targets (`fuzz_targets/*.rs`, each `#[path]`-includes this file) and by the replay under
//! `cargo test` (`tests/it/fuzz_replay.rs`), which runs every one of them on generated and seed
//! inputs in CI. Each function takes the raw input and panics when its property fails; every
//! decoder must also never panic on its own.

#![allow(dead_code)]

use std::time::{Duration, SystemTime};

use abada_agent_worker::conversation::ToolSpec;
use abada_agent_worker::decoders;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};
use serde_json::{Map, Value};

/// An agent definition as the engine sends it, and its templates rendered with the definition's
/// own JSON as the variables: a template without `$` renders to itself, exactly.
pub fn agent_definition(data: &[u8]) {
    let Ok(value) = serde_json::from_slice::<Value>(data) else {
        if let Ok(text) = std::str::from_utf8(data) {
            let rendered = decoders::render_template(text, &Map::new());
            if !text.contains('$') {
                assert_eq!(
                    rendered.as_deref(),
                    Ok(text),
                    "a template without $ changed"
                );
            }
        }
        return;
    };
    let _ = decoders::agent_definition(&value);
    if let Some(object) = value.as_object() {
        for template in object.values().filter_map(Value::as_str) {
            let rendered = decoders::render_template(template, object);
            if !template.contains('$') {
                assert_eq!(
                    rendered.as_deref(),
                    Ok(template),
                    "a template without $ changed"
                );
            }
        }
    }
}

/// The text of an agents file: decoding is a function of the text (the same answer twice, the
/// same error message), and an error says what is wrong.
pub fn agents_file(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let first = decoders::agents_file(text);
    let second = decoders::agents_file(text);
    match (&first, &second) {
        (Ok(a), Ok(b)) => assert_eq!(format!("{a:?}"), format!("{b:?}")),
        (Err(a), Err(b)) => {
            assert_eq!(a, b);
            assert!(!a.trim().is_empty(), "an empty error message");
        }
        _ => panic!("the same agents file decoded once and failed once"),
    }
}

/// BPMN XML as the engine serves it: every agent found names a task id written in the XML
/// (the decoder invents none).
pub fn bpmn_agents(data: &[u8]) {
    let Ok(xml) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(agents) = decoders::bpmn_agents(xml) {
        for (id, _) in &agents {
            if !id.contains('&') {
                assert!(
                    xml.contains(id.as_str()),
                    "agent id {id:?} is not in the XML"
                );
            }
        }
    }
}

/// The configuration from `NAME=value` lines (short names expanded to `ABADA_AGENT_<NAME>`): a
/// refused configuration names the variable at fault.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Err(e) = decoders::config(&config_vars(text)) {
        let message = e.to_string();
        assert!(
            message.contains("ABADA_AGENT_"),
            "a configuration error that names no variable: {message}"
        );
    }
}

/// The variables of a `config` input: `NAME=value` lines, short names expanded to
/// `ABADA_AGENT_<NAME>`, beside an engine URL.
fn config_vars(text: &str) -> std::collections::HashMap<String, String> {
    let mut vars = std::collections::HashMap::new();
    vars.insert(
        "ABADA_AGENT_ENGINE_URL".to_string(),
        "http://127.0.0.1:5601/api".to_string(),
    );
    for line in text.lines() {
        if let Some((name, value)) = line.split_once('=') {
            let name = if name.starts_with("ABADA_AGENT_") {
                name.to_string()
            } else {
                format!("ABADA_AGENT_{name}")
            };
            vars.insert(name, value.to_string());
        }
    }
    vars
}

/// A non-success engine answer (status from the first two bytes, a `Retry-After` from the next
/// length-prefixed bytes, the rest the body): a lost lease only from 400, 403 or 409; a retry
/// only for 401, 429 or a 5xx; never both; and a message.
pub fn engine_error(data: &[u8]) {
    if data.len() < 3 {
        return;
    }
    let status = 400 + u16::from_be_bytes([data[0], data[1]]) % 200;
    let n = (data[2] as usize).min(data.len() - 3);
    let (header, body) = data[3..].split_at(n);
    let mut headers = HeaderMap::new();
    if let Ok(value) = HeaderValue::from_bytes(header) {
        headers.insert(RETRY_AFTER, value);
    }
    for op in ["complete", "fetch-and-lock", "heartbeat"] {
        let Some(error) = decoders::engine_error(op, status, headers.clone(), body) else {
            panic!("status {status} is HTTP");
        };
        let lost = error.lease_lost().is_some();
        let retry = error.is_retryable();
        assert!(
            !(lost && retry),
            "{status}: both a lost lease and worth a retry"
        );
        if lost {
            assert!(matches!(status, 400 | 403 | 409), "{status}: a lost lease");
        }
        if retry {
            assert!(
                status == 401 || status == 429 || status >= 500,
                "{status}: worth a retry"
            );
        }
        assert!(!error.to_string().is_empty());
    }
}

/// A fetch response read task by task under a per-task limit (first two bytes): a task is taken
/// or too large, never both; with a limit above the whole body nothing is too large; and every
/// task taken is one the whole-body decoder reads too.
pub fn engine_fetch_limited(data: &[u8]) {
    if data.len() < 2 {
        return;
    }
    let limit = u16::from_be_bytes([data[0], data[1]]) as usize;
    let body = &data[2..];
    let Ok((tasks, _rejected, oversized)) = decoders::engine_fetch_response_limited(body, limit)
    else {
        return;
    };
    for (id, _) in &oversized {
        assert!(
            !tasks.iter().any(|t| &t.id == id),
            "task {id} both taken and too large"
        );
    }
    if limit >= body.len() {
        assert!(
            oversized.is_empty(),
            "a task larger than the whole body: {oversized:?}"
        );
    }
    if let Ok((all, _)) = decoders::engine_fetch_response(body) {
        for t in &tasks {
            assert!(
                all.iter().any(|a| a.id == t.id),
                "task {} taken by the limited read only",
                t.id
            );
        }
    }
}

/// A fetch response: no task with a blank id is accepted.
pub fn engine_fetch_response(data: &[u8]) {
    if let Ok((tasks, _rejected)) = decoders::engine_fetch_response(data) {
        for task in tasks {
            assert!(
                !task.id.trim().is_empty(),
                "a task with a blank id was accepted"
            );
            let _ = task.task_ref();
        }
    }
}

/// A journal read and its replay: the next step to write is at least 1.
pub fn engine_journal(data: &[u8]) {
    if let Ok(journal) = decoders::engine_journal(data)
        && let Ok(replayed) = decoders::journal_replay(&journal.steps)
    {
        assert!(replayed.next_seq >= 1);
    }
    let _ = decoders::journal_replay_json(data);
    let _ = decoders::engine_tool_credential(data);
}

/// Header decoders: a provider's wait is bounded (`retry-after-ms` is read only below 10^12
/// ms), and a `traceparent` read is written back the same (55 characters, its trace id 32
/// lowercase hex digits).
pub fn headers(data: &[u8]) {
    let half = data.len() / 2;
    let (a, b) = data.split_at(half);
    let mut headers = HeaderMap::new();
    if let Ok(v) = HeaderValue::from_bytes(a) {
        headers.insert(RETRY_AFTER, v);
    }
    if let Ok(v) = HeaderValue::from_bytes(b) {
        headers.insert(HeaderName::from_static("retry-after-ms"), v);
    }
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
    if let Some(wait) = decoders::provider_retry_after(&headers, now) {
        assert!(wait <= Duration::from_millis(1_000_000_000_000), "{wait:?}");
    }
    if let Ok(text) = std::str::from_utf8(data)
        && let Some(tp) = decoders::trace_parent(text)
    {
        let header = tp.header();
        assert_eq!(header.len(), 55, "{header}");
        let again = decoders::trace_parent(&header).expect("a header written is read back");
        assert_eq!(again.header(), header);
        let trace_id = tp.trace_id();
        assert!(
            trace_id.len() == 32
                && trace_id
                    .chars()
                    .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)),
            "{trace_id}"
        );
        let _ = tp.child_header(&abada_agent_worker::random::Random::os());
    }
}

fn offered_tools() -> Vec<ToolSpec> {
    ["lookup_order", "issue_refund"]
        .into_iter()
        .map(|tool| ToolSpec {
            server: "orders".into(),
            tool: tool.into(),
            description: String::new(),
            input_schema: serde_json::json!({"type": "object"}),
            read_only: tool == "lookup_order",
            destructive: false,
        })
        .collect()
}

/// A provider's response in both wire formats, two tools offered: a call that names a server
/// names an offered tool on it (a name nobody offered keeps an empty server), and arguments are
/// an object or the raw text.
pub fn provider_response(data: &[u8]) {
    let tools = offered_tools();
    for response in [
        decoders::openai_response(data, &tools),
        decoders::anthropic_response(data, &tools),
    ]
    .into_iter()
    .flatten()
    {
        for call in &response.message.tool_calls {
            if !call.server.is_empty() {
                assert!(
                    tools
                        .iter()
                        .any(|t| t.server == call.server && t.tool == call.tool),
                    "a call of {}/{}, which nobody offered",
                    call.server,
                    call.tool
                );
            }
            assert!(
                call.arguments.is_object() || call.arguments.is_string(),
                "arguments {}",
                call.arguments
            );
        }
    }
}

/// Templates rendered under a cap (first byte × 64) with `template\0variables-as-JSON`: a fenced
/// rendering stays within its cap.
pub fn template(data: &[u8]) {
    let Some((&cap, rest)) = data.split_first() else {
        return;
    };
    let cap = usize::from(cap) * 64;
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let (template, vars) = text.split_once('\0').unwrap_or((text, "{}"));
    let variables = serde_json::from_str::<Value>(vars)
        .ok()
        .and_then(|v| v.as_object().cloned())
        .unwrap_or_default();
    let _ = decoders::render_template(template, &variables);
    if let Ok(out) = decoders::render_fenced(template, &variables, cap) {
        assert!(out.len() <= cap, "a fenced template over its cap");
    }
}

/// A model's final answer examined for a tool call written as text (`agent::answer_shape`); the
/// first byte chooses `parse` (odd) or `repair`. Under `repair` nothing becomes a call: the
/// answer is kept, or sent back with a reason. Under `parse` a call names an offered tool, and
/// its arguments are an object or the raw text; an answer left whole has no reason.
pub fn answer_shape(data: &[u8]) {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(rest);
    let parse = first % 2 == 1;
    let (calls, reason, kept) = decoders::answer_shape(&text, parse);
    if !parse {
        assert!(calls.is_empty(), "a call made of text under repair");
        assert_eq!(
            kept.as_deref(),
            Some(&*text),
            "the answer changed under repair"
        );
    }
    for call in &calls {
        assert!(
            call.server == "orders" && (call.tool == "lookup_order" || call.tool == "issue_refund"),
            "a call of a tool nobody offered: {call:?}"
        );
        assert!(
            call.arguments.is_object() || call.arguments.is_string(),
            "arguments neither an object nor text: {call:?}"
        );
    }
    if calls.is_empty() && reason.is_none() {
        assert_eq!(
            kept.as_deref(),
            Some(&*text),
            "an answer kept whole changed"
        );
    }
}

/// A `tools/list` entry, and text cut at a limit (first byte): text within the limit is kept
/// whole; longer text keeps its longest prefix within the limit that ends on a character
/// boundary (at most 3 bytes short), followed by the note saying how much was shown.
pub fn tool_listing(data: &[u8]) {
    let _ = decoders::tool_listing_entry(data);
    if let Some((first, rest)) = data.split_first() {
        let text = String::from_utf8_lossy(rest);
        let limit = *first as usize;
        let cut = decoders::truncate_text(&text, limit);
        if text.len() <= limit {
            assert_eq!(cut, text, "text within the limit was cut");
            return;
        }
        let kept = (limit.saturating_sub(3)..=limit)
            .rev()
            .find(|n| text.is_char_boundary(*n))
            .expect("a character boundary within 3 bytes");
        assert_eq!(
            cut,
            format!("{}… [{kept} of {} bytes shown]", &text[..kept], text.len())
        );
    }
}

/// An MCP tool result, capped to a size from the first two bytes: a result within the cap is
/// kept as it is; a larger one keeps at most about the cap.
pub fn tool_result(data: &[u8]) {
    if data.len() < 2 {
        return;
    }
    let cap = u16::from_be_bytes([data[0], data[1]]) as usize;
    if let Ok(result) = decoders::tool_result(&data[2..]) {
        let size = |r: &abada_agent_worker::conversation::ToolResult| {
            r.content.iter().map(|b| b.to_string().len()).sum::<usize>()
        };
        let capped = decoders::cap_tool_result(result.clone(), cap);
        if size(&result) <= cap {
            assert_eq!(capped, result, "a result within its cap changed");
        } else {
            assert!(
                size(&capped) <= cap * 2 + 200,
                "{} bytes kept for a cap of {cap}",
                size(&capped)
            );
        }
    }
}

/// Whether `data` is a seed worth its place for `target`: it decodes, so its property is met on
/// a decoded value rather than on a refusal (a seed that does not decode starts the fuzzer where
/// arbitrary bytes already are). `Err` says what the decoder answered.
pub fn decodes(target: &str, data: &[u8]) -> Result<(), String> {
    let text = || std::str::from_utf8(data).map_err(|e| format!("not UTF-8: {e}"));
    let json = || serde_json::from_slice::<Value>(data).map_err(|e| format!("not JSON: {e}"));
    let non_empty = |n: usize, what: &str| {
        if n == 0 {
            Err(format!("decoded, but no {what}"))
        } else {
            Ok(())
        }
    };
    match target {
        "agent_definition" => decoders::agent_definition(&json()?).map(|_| ()),
        "answer_shape" => {
            let (&first, rest) = data.split_first().ok_or("empty: no mode byte")?;
            let text = std::str::from_utf8(rest).map_err(|e| format!("not UTF-8: {e}"))?;
            non_empty(decoders::answer_shape(text, first % 2 == 1).0.len(), "call")
        }
        "agents_file" => decoders::agents_file(text()?).map(|_| ()),
        "bpmn_agents" => non_empty(decoders::bpmn_agents(text()?)?.len(), "agent"),
        "config" => {
            let text = text()?;
            if !text.lines().any(|l| l.contains('=')) {
                return Err("no NAME=value line".into());
            }
            decoders::config(&config_vars(text))
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
        "engine_error" => {
            if data.len() < 3 {
                return Err("shorter than its status and header length".into());
            }
            let n = (data[2] as usize).min(data.len() - 3);
            let body = &data[3 + n..];
            let answer: Value =
                serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
            let code = answer["code"]
                .as_str()
                .ok_or("the body has no engine error code")?;
            let status = 400 + u16::from_be_bytes([data[0], data[1]]) % 200;
            let error = decoders::engine_error("complete", status, HeaderMap::new(), body)
                .ok_or("no HTTP status")?;
            let lost = error
                .lease_lost()
                .map(|r| r.to_string())
                .unwrap_or_default();
            if error.to_string().contains(code) || lost.contains(code) {
                Ok(())
            } else {
                Err(format!("the code {code} was not read: {error}"))
            }
        }
        "engine_fetch_limited" => {
            if data.len() < 2 {
                return Err("shorter than its limit".into());
            }
            let limit = u16::from_be_bytes([data[0], data[1]]) as usize;
            let (tasks, _, _) = decoders::engine_fetch_response_limited(&data[2..], limit)?;
            non_empty(tasks.len(), "task taken")
        }
        "engine_fetch_response" => {
            non_empty(decoders::engine_fetch_response(data)?.0.len(), "task")
        }
        "engine_journal" => {
            let journal = decoders::engine_journal(data)?;
            decoders::journal_replay(&journal.steps)
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
        "headers" => {
            let traceparent = std::str::from_utf8(data)
                .ok()
                .and_then(decoders::trace_parent);
            if traceparent.is_some() {
                return Ok(());
            }
            let half = data.len() / 2;
            let mut headers = HeaderMap::new();
            if let Ok(v) = HeaderValue::from_bytes(&data[..half]) {
                headers.insert(RETRY_AFTER, v);
            }
            let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
            decoders::provider_retry_after(&headers, now)
                .map(|_| ())
                .ok_or_else(|| "neither a traceparent nor a Retry-After".to_string())
        }
        "provider_response" => {
            let tools = offered_tools();
            let openai = decoders::openai_response(data, &tools);
            let anthropic = decoders::anthropic_response(data, &tools);
            match (openai, anthropic) {
                (Ok(_), _) | (_, Ok(_)) => Ok(()),
                (Err(a), Err(b)) => Err(format!("OpenAI: {a}; Anthropic: {b}")),
            }
        }
        "template" => {
            let (&cap, rest) = data.split_first().ok_or("empty")?;
            let text = std::str::from_utf8(rest).map_err(|e| format!("not UTF-8: {e}"))?;
            let (template, vars) = text.split_once('\0').unwrap_or((text, "{}"));
            let variables = serde_json::from_str::<Value>(vars)
                .ok()
                .and_then(|v| v.as_object().cloned())
                .ok_or("the variables are not a JSON object")?;
            decoders::render_fenced(template, &variables, usize::from(cap) * 64).map(|_| ())
        }
        "tool_listing" => {
            if let Ok(Some(_)) = decoders::tool_listing_entry(data) {
                return Ok(());
            }
            // Else the truncation's input: a limit byte, then text longer than the limit.
            let (&limit, rest) = data.split_first().ok_or("empty")?;
            match std::str::from_utf8(rest) {
                Ok(text) if limit > 0 && text.len() > usize::from(limit) => Ok(()),
                Ok(_) => Err("neither a tool listing nor text longer than its limit".into()),
                Err(e) => Err(format!("neither a tool listing nor text: {e}")),
            }
        }
        "tool_result" => {
            if data.len() < 2 {
                return Err("shorter than its cap".into());
            }
            decoders::tool_result(&data[2..]).map(|_| ())
        }
        other => Err(format!("no fuzz target {other}")),
    }
}
