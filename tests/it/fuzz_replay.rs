//! Every cargo-fuzz target's property (`fuzz/props.rs`) run briefly under `cargo test`, so CI
//! checks each on every change without nightly or libFuzzer: for each target, a fixed number of
//! proptest cases of arbitrary bytes, of JSON and text shaped toward its decoder, and a few seed
//! inputs of the right shape that must reach the property's deeper branches. A longer run is
//! cargo-fuzz's (fuzz/README.md).

#[path = "../../fuzz/props.rs"]
mod props;

use proptest::prelude::*;

/// Cases per target and input shape: 14 targets x 3 shapes x 128 cases run in a few seconds.
const CASES: u32 = 128;

/// A target's input: raw bytes, JSON text, or text with the decoder's own words in it.
fn input() -> impl Strategy<Value = Vec<u8>> {
    let words = prop::sample::select(vec![
        "{",
        "}",
        "[",
        "]",
        ":",
        ",",
        "\"id\"",
        "\"tasks\"",
        "\"steps\"",
        "\"seq\"",
        "\"kind\"",
        "\"tool\"",
        "\"model\"",
        "\"content\"",
        "\"text\"",
        "\"type\"",
        "\"tool_use\"",
        "\"tool_calls\"",
        "\"function\"",
        "\"name\"",
        "\"arguments\"",
        "\"input\"",
        "${x}",
        "$",
        "1",
        "0",
        "null",
        "true",
        "\"orders__issue_refund\"",
        "\"issue_refund\"",
        "=",
        "\n",
        "MAX_TASKS",
        "ENGINE_URL",
        "<bpmn:serviceTask id=\"a\">",
        "<tool_call>",
        "</tool_call>",
        "```json\n",
        "\"parameters\"",
        "\"lookup_order\"",
        "</bpmn:serviceTask>",
        "camunda:topic=\"abada:agent\"",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "\u{e9}",
        "\0",
    ]);
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..512),
        prop::collection::vec(words, 0..64).prop_map(|w| w.concat().into_bytes()),
        prop::collection::vec(any::<char>(), 0..128)
            .prop_map(|c| c.into_iter().collect::<String>().into_bytes()),
    ]
}

/// Inputs of the right shape for each target, so that its property is met on a decoded value
/// and not only on refusals.
fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let locked =
        br#"[{"id":"t-1","topicName":"abada:agent","workerId":"w","attempt":1,"variables":{}}]"#;
    let mut limited = vec![0x10, 0x00];
    limited.extend_from_slice(locked);
    let mut error = vec![0x00, 0x09, 0x01, b'2'];
    error.extend_from_slice(br#"{"code":"WORKER_LOCK_NOT_OWNED","message":"no"}"#);
    let mut result = vec![0x00, 0x08];
    result.extend_from_slice(br#"{"content":[{"type":"text","text":"a long enough text"}]}"#);
    vec![
        ("answer_shape", b"\x01```json\n{\"name\": \"lookup_order\", \"arguments\": \"{\\\"orderId\\\": \\\"o-1\\\"}}\"}\n```".to_vec()),
        ("agent_definition", br#"{"model":"openai/m","input":"order ${orderId}","orderId":"o-1"}"#.to_vec()),
        ("agents_file", b"[agents.refund]\nmodel = \"openai/m\"\ninput = \"x\"\n".to_vec()),
        ("config", b"MAX_TASKS=4\nLOCK_DURATION_MS=nope\n".to_vec()),
        ("engine_error", error),
        ("engine_fetch_limited", limited),
        ("engine_fetch_response", locked.to_vec()),
        ("engine_journal", br#"{"attempt":1,"steps":[]}"#.to_vec()),
        ("headers", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_vec()),
        ("provider_response", br#"{"choices":[{"message":{"role":"assistant","tool_calls":[{"id":"c1","type":"function","function":{"name":"orders__issue_refund","arguments":"{}"}}]},"finish_reason":"tool_calls"}]}"#.to_vec()),
        ("template", b"\x01order ${orderId}\0{\"orderId\":\"o-1\"}".to_vec()),
        ("tool_listing", b"\x04caf\xc3\xa9 au lait".to_vec()),
        ("tool_result", result),
        ("bpmn_agents", br#"<definitions><serviceTask id="a" camunda:topic="abada:agent"/></definitions>"#.to_vec()),
    ]
}

fn run(target: &str, data: &[u8]) {
    match target {
        "agent_definition" => props::agent_definition(data),
        "answer_shape" => props::answer_shape(data),
        "agents_file" => props::agents_file(data),
        "bpmn_agents" => props::bpmn_agents(data),
        "config" => props::config(data),
        "engine_error" => props::engine_error(data),
        "engine_fetch_limited" => props::engine_fetch_limited(data),
        "engine_fetch_response" => props::engine_fetch_response(data),
        "engine_journal" => props::engine_journal(data),
        "headers" => props::headers(data),
        "provider_response" => props::provider_response(data),
        "template" => props::template(data),
        "tool_listing" => props::tool_listing(data),
        "tool_result" => props::tool_result(data),
        other => panic!("no fuzz target {other}"),
    }
}

/// The targets, as `fuzz/Cargo.toml` lists them: a target added there and not here fails.
#[test]
fn every_fuzz_target_is_replayed() {
    let manifest = include_str!("../../fuzz/Cargo.toml");
    let listed: Vec<&str> = manifest
        .lines()
        .filter_map(|l| l.strip_prefix("name = \""))
        .filter_map(|l| l.strip_suffix('"'))
        .filter(|n| *n != "abada-agent-worker-fuzz")
        .collect();
    let mut replayed: Vec<&str> = seeds().into_iter().map(|(t, _)| t).collect();
    let mut listed_sorted = listed.clone();
    listed_sorted.sort_unstable();
    replayed.sort_unstable();
    assert_eq!(listed_sorted, replayed);
}

#[test]
fn every_fuzz_target_holds_on_its_seeds() {
    for (target, data) in seeds() {
        run(target, &data);
    }
}

macro_rules! replay {
    ($($name:ident),* $(,)?) => {
        proptest! {
            #![proptest_config(ProptestConfig { cases: CASES, failure_persistence: None, ..ProptestConfig::default() })]
            $(
                #[test]
                fn $name(data in input()) {
                    run(stringify!($name), &data);
                }
            )*
        }
    };
}

replay!(
    agent_definition,
    answer_shape,
    agents_file,
    bpmn_agents,
    config,
    engine_error,
    engine_fetch_limited,
    engine_fetch_response,
    engine_journal,
    headers,
    provider_response,
    template,
    tool_listing,
    tool_result,
);
