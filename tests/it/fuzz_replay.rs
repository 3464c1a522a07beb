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

/// The seeds of every target (`fuzz/seeds/<target>/*`, cargo-fuzz's starting corpus too):
/// inputs of the right shape, so that each property is met on a decoded value and not only on
/// refusals.
fn seeds() -> Vec<(String, String, Vec<u8>)> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds");
    let mut seeds = Vec::new();
    for target in std::fs::read_dir(&root).expect("fuzz/seeds") {
        let target = target.unwrap().path();
        let name = target.file_name().unwrap().to_string_lossy().into_owned();
        for seed in std::fs::read_dir(&target).unwrap() {
            let seed = seed.unwrap().path();
            let data = std::fs::read(&seed).unwrap();
            let file = seed.file_name().unwrap().to_string_lossy().into_owned();
            seeds.push((name.clone(), file, data));
        }
    }
    seeds.sort();
    seeds
}

/// The targets, as `fuzz/Cargo.toml` lists them.
fn targets() -> Vec<&'static str> {
    let manifest = include_str!("../../fuzz/Cargo.toml");
    let mut listed: Vec<&str> = manifest
        .lines()
        .filter_map(|l| l.strip_prefix("name = \""))
        .filter_map(|l| l.strip_suffix('"'))
        .filter(|n| *n != "abada-agent-worker-fuzz")
        .collect();
    listed.sort_unstable();
    listed
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

/// Every target `fuzz/Cargo.toml` lists has seeds, and every seed belongs to a target: a
/// target added there without seeds, or seeds of a target gone, fails.
#[test]
fn every_fuzz_target_has_seeds() {
    let mut seeded: Vec<String> = seeds().into_iter().map(|(t, ..)| t).collect();
    seeded.dedup();
    assert_eq!(targets(), seeded);
}

#[test]
fn every_fuzz_target_holds_on_its_seeds() {
    for (target, _, data) in seeds() {
        run(&target, &data);
    }
}

/// Every seed decodes: a seed its decoder refuses starts the fuzzer where arbitrary bytes
/// already are, and its property is met only on a refusal.
#[test]
fn every_fuzz_seed_decodes() {
    let refused: Vec<String> = seeds()
        .into_iter()
        .filter_map(|(target, file, data)| {
            props::decodes(&target, &data)
                .err()
                .map(|why| format!("fuzz/seeds/{target}/{file}: {why}"))
        })
        .collect();
    assert!(
        refused.is_empty(),
        "seeds that do not decode:\n{}",
        refused.join("\n")
    );
}

/// The check above can fail: for every target, an input that is no value of its decoder is
/// refused.
#[test]
fn a_seed_that_does_not_decode_is_refused() {
    for target in targets() {
        for junk in [&b"\x00\x01{not"[..], b"\xff\xfe\xfd"] {
            assert!(
                props::decodes(target, junk).is_err(),
                "{target}: {junk:?} passed as a decoded seed"
            );
        }
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
