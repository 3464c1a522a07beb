//! What validating one final answer costs, for the worst schemas the `outputSchema` bounds let
//! through (docs/benchmarks-history.md, "Validating a final answer: the worst schemas the bounds
//! allow"):
//! the memory allocated at the peak (a counting global allocator) and the CPU time of the
//! thread (`/proc/thread-self/schedstat`) of `agent::output::judge`, the call the worker makes
//! on its blocking thread: the yes or no, then, for a refused answer, the one error from the
//! reporting copy. Each answer is judged three times; the worst figure is printed.
//!
//! Also, "before": the schema of the finding (a chain of `anyOf`s of two `$ref`s under
//! `dependencies`), now refused when read, validated as the worker used to (the `jsonschema`
//! validator's own `validate`, which builds every branch's errors).
//!
//! ```text
//! cargo run --release --example schema_bench
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use abada_agent_worker::agent::output::{OutputSchema, judge};
use serde_json::{Map, Value, json};

/// Counts the bytes live and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                let grown = new_size - layout.size();
                let live = LIVE.fetch_add(grown, Ordering::Relaxed) + grown;
                PEAK.fetch_max(live, Ordering::Relaxed);
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// This thread's CPU time so far, in nanoseconds (Linux).
fn thread_cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|n| n.parse().ok()))
        .unwrap_or(0)
}

/// The peak bytes allocated above what was live before, and the CPU time, of `f`.
fn measure<T>(f: impl FnOnce() -> T) -> (T, usize, f64, f64) {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let (cpu, wall) = (thread_cpu_ns(), Instant::now());
    let out = f();
    let cpu_ms = (thread_cpu_ns() - cpu) as f64 / 1e6;
    let wall_ms = wall.elapsed().as_secs_f64() * 1e3;
    let peak = PEAK.load(Ordering::Relaxed).saturating_sub(base);
    (out, peak, cpu_ms, wall_ms)
}

const MIB: f64 = 1024.0 * 1024.0;

struct Worst {
    peak: usize,
    cpu_ms: f64,
    wall_ms: f64,
}

/// Judges `answer` three times against `schema`; prints the worst of each figure.
fn row(case: &str, schema: &OutputSchema, what: &str, answer: &str, overall: &mut Worst) {
    let mut worst = Worst {
        peak: 0,
        cpu_ms: 0.0,
        wall_ms: 0.0,
    };
    let mut verdict = String::new();
    for _ in 0..3 {
        let (judged, peak, cpu_ms, wall_ms) = measure(|| judge(Some(schema), answer, "stop", None));
        verdict = match judged {
            Ok(_) => "accepted".into(),
            Err(r) => format!("refused ({})", r.reason.as_str()),
        };
        worst.peak = worst.peak.max(peak);
        worst.cpu_ms = worst.cpu_ms.max(cpu_ms);
        worst.wall_ms = worst.wall_ms.max(wall_ms);
    }
    overall.peak = overall.peak.max(worst.peak);
    overall.cpu_ms = overall.cpu_ms.max(worst.cpu_ms);
    overall.wall_ms = overall.wall_ms.max(worst.wall_ms);
    println!(
        "| {case} | {what}: {} bytes (cap {}) | {verdict} | {:.2} | {:.1} | {:.1} |",
        answer.len(),
        schema.answer_limit(),
        worst.peak as f64 / MIB,
        worst.cpu_ms,
        worst.wall_ms
    );
}

/// An array answer of `items` (JSON texts) repeated to `bytes`, the last replaced by `last`.
fn array_of(item: &str, bytes: usize, last: Option<&str>) -> String {
    let mut n = (bytes.saturating_sub(2) / (item.len() + 1)).max(1);
    loop {
        let mut items = vec![item; n];
        if let Some(last) = last {
            items[n - 1] = last;
        }
        let text = format!("[{}]", items.join(","));
        if text.len() <= bytes || n == 1 {
            return text;
        }
        n -= 1;
    }
}

/// A chain of `levels` anyOfs of two `$ref`s to the next level, used by `items` (`under`) or
/// `dependencies`.
fn two_ref_chain(levels: usize, under: &str) -> Value {
    let mut defs = Map::new();
    for i in 0..levels {
        let next = json!({"$ref": format!("#/$defs/l{}", i + 1)});
        defs.insert(format!("l{i}"), json!({"anyOf": [next.clone(), next]}));
    }
    defs.insert(format!("l{levels}"), json!({"type": "integer"}));
    let head = json!({"$ref": "#/$defs/l0"});
    let mut schema = match under {
        "dependencies" => json!({"type": "object", "dependencies": {"a": head}}),
        _ => json!({"type": "array", "items": head}),
    };
    schema["$defs"] = Value::Object(defs);
    schema
}

/// One level of a chain, around the `{"$ref": next}` it is given.
type Level = fn(Value) -> Value;

/// A chain as deep as the subschema bound allows, each level `level(next)` (a `{"$ref": next}`
/// inside), an integer at the end, used by `items`: every integer item goes down every level.
fn deep_chain(level: Level) -> (Value, usize) {
    let chain = |levels: usize| {
        let mut defs = Map::new();
        for i in 0..levels {
            let next = json!({"$ref": format!("#/$defs/l{}", i + 1)});
            defs.insert(format!("l{i}"), level(next));
        }
        defs.insert(format!("l{levels}"), json!({"type": "integer"}));
        json!({"type": "array", "items": {"$ref": "#/$defs/l0"}, "$defs": defs})
    };
    let (mut levels, mut over) = (1, 600);
    while over - levels > 1 {
        let mid = (levels + over) / 2;
        if OutputSchema::compile(&chain(mid)).is_ok() {
            levels = mid;
        } else {
            over = mid;
        }
    }
    (chain(levels), levels)
}

/// The heaviest schema by subschemas (ten `$ref`s to a 42-branch `anyOf` whose last branch
/// alone takes an integer).
fn heaviest_by_subschemas() -> Value {
    let mut branches: Vec<Value> = (0..41)
        .map(|i| json!({"type": "string", "minLength": i}))
        .collect();
    branches.push(json!({"type": "integer"}));
    let refs: Vec<Value> = (0..10).map(|_| json!({"$ref": "#/$defs/d"})).collect();
    json!({"type": "array", "items": {"allOf": refs}, "$defs": {"d": {"anyOf": branches}}})
}

/// The heaviest by `enum` values: mixed types (compared one by one), the one integer last.
fn heaviest_by_enum() -> Value {
    let mut values: Vec<Value> = (0..2043).map(|i| json!(i as f64 + 0.5)).collect();
    values.push(json!(1));
    json!({"type": "array", "items": {"enum": values}})
}

/// Compiles `schema` (as a definition read does), noting what it cost.
fn compiled(case: &str, schema: &Value, compiles: &mut Vec<String>) -> OutputSchema {
    let (s, peak, cpu_ms, _) = measure(|| OutputSchema::compile(schema).unwrap());
    compiles.push(format!(
        "| {case} | {} | {:.2} | {cpu_ms:.1} |",
        schema.to_string().len(),
        peak as f64 / MIB
    ));
    s
}

fn main() {
    let mut compiles = Vec::new();
    let mut overall = Worst {
        peak: 0,
        cpu_ms: 0.0,
        wall_ms: 0.0,
    };
    println!("| schema | answer | verdict | peak MiB | CPU ms | wall ms |");
    println!("| --- | --- | --- | ---: | ---: | ---: |");

    let s = compiled("442 subschemas", &heaviest_by_subschemas(), &mut compiles);
    let cap = s.answer_limit();
    let case = "442 subschemas: 10 refs to a 42-branch anyOf";
    row(
        case,
        &s,
        "integers, the last true",
        &array_of("1", cap, Some("true")),
        &mut overall,
    );
    row(
        case,
        &s,
        "every item failing every branch",
        &array_of("[]", cap, None),
        &mut overall,
    );

    let s = compiled(
        "anyOf of two $refs, 6 levels",
        &two_ref_chain(6, "items"),
        &mut compiles,
    );
    let cap = s.answer_limit();
    let case = "anyOf of two $refs, 6 levels (253 subschemas)";
    row(
        case,
        &s,
        "integers, the last a string",
        &array_of("1", cap, Some("\"s\"")),
        &mut overall,
    );
    row(
        case,
        &s,
        "strings (every branch fails)",
        &array_of("\"s\"", cap, None),
        &mut overall,
    );

    let chains: [(&str, Level); 4] = [
        (
            "anyOf [string, $ref]",
            |next| json!({"anyOf": [{"type": "string", "maxLength": 0}, next]}),
        ),
        (
            "oneOf [string, $ref]",
            |next| json!({"oneOf": [{"type": "string", "maxLength": 0}, next]}),
        ),
        ("allOf [$ref]", |next| json!({"allOf": [next]})),
        ("$ref", |next| next),
    ];
    for (shape, level) in chains {
        let (schema, levels) = deep_chain(level);
        let s = compiled(&format!("{shape} chain"), &schema, &mut compiles);
        let cap = s.answer_limit();
        let case = format!("{shape} chain, {levels} levels");
        row(
            &case,
            &s,
            "integers, the last true",
            &array_of("1", cap, Some("true")),
            &mut overall,
        );
    }

    let s = compiled(
        "enum of 2,044 mixed values",
        &heaviest_by_enum(),
        &mut compiles,
    );
    let cap = s.answer_limit();
    let case = "enum of 2,044 mixed values";
    row(
        case,
        &s,
        "integers, the last not in it",
        &array_of("1", cap, Some("-1")),
        &mut overall,
    );

    let strings = json!({"type": "array", "items": {"type": "string", "enum": (0..2000).map(|i| format!("value-{i}")).collect::<Vec<_>>()}});
    let s = OutputSchema::compile(&strings).unwrap();
    let cap = s.answer_limit();
    row(
        "enum of 2,000 strings",
        &s,
        "strings not in it",
        &array_of("\"value-x\"", cap, None),
        &mut overall,
    );

    for pattern in [
        r"^(?:[\p{L}\p{N}]+[\s,.;:!?-]*)*$",
        r"^(?:a|ab|abc|abcd|abcde|abcdef|abcdefg)*(?:x{1,20}y{1,20}){0,20}$",
        r"(?i)^(?:[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}\s*)+$",
    ] {
        let schema = json!({"type": "string", "pattern": pattern});
        let s = OutputSchema::compile(&schema).unwrap();
        let cap = s.answer_limit();
        let text = "ab".repeat(cap / 2 - 4) + "é!";
        let answer = serde_json::to_string(&text).unwrap();
        let answer = &answer[..answer.len().min(cap)];
        row(
            &format!("pattern {pattern}"),
            &s,
            "one string",
            answer,
            &mut overall,
        );
    }
    let patterns: Map<String, Value> = (0..150)
        .map(|i| (format!("^k{i}[a-z]*[0-9]+$"), json!({"type": "integer"})))
        .collect();
    let s =
        OutputSchema::compile(&json!({"type": "object", "patternProperties": patterns})).unwrap();
    let cap = s.answer_limit();
    let n = cap / 14;
    let object: Map<String, Value> = (0..n)
        .map(|i| (format!("k{}abc{i}", i % 150), json!(1)))
        .collect();
    let answer = serde_json::to_string(&object).unwrap();
    let answer = if answer.len() > cap {
        serde_json::to_string(&object.into_iter().take(n * 8 / 10).collect::<Map<_, _>>()).unwrap()
    } else {
        answer
    };
    row(
        "150 patternProperties",
        &s,
        "an object of many keys",
        &answer,
        &mut overall,
    );

    let light = json!({"type": "array", "uniqueItems": true, "items": {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}});
    let s = OutputSchema::compile(&light).unwrap();
    let cap = s.answer_limit();
    let items: Vec<String> = (0..)
        .map(|i| format!("{{\"a\":{i}}}"))
        .scan(2usize, |len, item| {
            *len += item.len() + 1;
            (*len < cap).then_some(item)
        })
        .collect();
    row(
        "uniqueItems over objects",
        &s,
        "distinct objects",
        &format!("[{}]", items.join(",")),
        &mut overall,
    );
    let draft7 = json!({"$schema": "http://json-schema.org/draft-07/schema#", "type": "array", "items": {"type": "string", "format": "regex"}});
    let s = OutputSchema::compile(&draft7).unwrap();
    let cap = s.answer_limit();
    let nested = format!("\"{}{}\"", "(".repeat(cap / 2 - 4), ")".repeat(cap / 2 - 4));
    row(
        "draft-07 format: regex",
        &s,
        "one nested regex",
        &format!("[{nested}]"),
        &mut overall,
    );
    let nested = format!("{}1{}", "[".repeat(120), "]".repeat(120));
    row(
        "draft-07 format: regex",
        &s,
        "arrays 120 deep",
        &nested,
        &mut overall,
    );

    println!("\nCompiling them (once per definition, when it is read):");
    println!("| schema | bytes | peak MiB | CPU ms |");
    println!("| --- | ---: | ---: | ---: |");
    for line in &compiles {
        println!("{line}");
    }
    println!(
        "\nWorst answer of all: {:.2} MiB at the peak, {:.1} ms of CPU, {:.1} ms wall.",
        overall.peak as f64 / MIB,
        overall.cpu_ms,
        overall.wall_ms
    );

    println!(
        "\nBefore: the finding's schema, validated as the worker used to (validate builds every branch's errors)."
    );
    println!("| levels under dependencies | now | before: peak MiB | before: CPU ms |");
    println!("| ---: | --- | ---: | ---: |");
    for levels in [12, 14, 16] {
        let schema = two_ref_chain(levels, "dependencies");
        let now = match OutputSchema::compile(&schema) {
            Ok(_) => "accepted".to_string(),
            Err(e) => format!(
                "refused: {}",
                e.to_string().chars().take(90).collect::<String>()
            ),
        };
        let validator = jsonschema::options().offline().build(&schema).unwrap();
        let answer = json!({"a": "not an integer"});
        let (_, peak, cpu_ms, _) = measure(|| {
            let invalid = !validator.is_valid(&answer);
            invalid && validator.validate(&answer).is_err()
        });
        println!(
            "| {levels} | {now} | {:.1} | {cpu_ms:.0} |",
            peak as f64 / MIB
        );
    }

    println!(
        "\nBefore: unevaluatedProperties under a chain of anyOf [$ref, properties] (about 4 weights a level), now refused."
    );
    println!("| levels | now | before: CPU ms for a two-property answer |");
    println!("| ---: | --- | ---: |");
    for levels in [12, 14, 16, 18] {
        let mut defs = Map::new();
        for i in 0..levels {
            let next = json!({"$ref": format!("#/$defs/l{}", i + 1)});
            defs.insert(
                format!("l{i}"),
                json!({"anyOf": [next, {"properties": {format!("p{i}"): true}}], "unevaluatedProperties": false}),
            );
        }
        defs.insert(format!("l{levels}"), json!({"required": ["zz"]}));
        let schema = json!({"$ref": "#/$defs/l0", "$defs": defs});
        let now = match OutputSchema::compile(&schema) {
            Ok(_) => "accepted".to_string(),
            Err(e) => format!(
                "refused: {}",
                e.to_string().chars().take(60).collect::<String>()
            ),
        };
        let validator = jsonschema::options().offline().build(&schema).unwrap();
        let answer = json!({"a": 1, "b": 2});
        let (_, _, cpu_ms, _) = measure(|| validator.is_valid(&answer));
        println!("| {levels} | {now} | {cpu_ms:.0} |");
    }
}
