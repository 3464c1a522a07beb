//! Determinism by construction, and its proof across processes.
//!
//! - Every `tokio::select!` in the worker's sources (and the simulator's) is `biased;` (its branches polled in the
//!   order written, each order chosen and said where it stands), so no race is settled by
//!   tokio's random pick.
//! - No `tokio::sync::watch` where the simulator runs: a watch wakes its receivers in a random
//!   order (each waits on one of eight notifiers that tokio's unseeded generator picks), so two
//!   tasks waiting on one value (the runner and the task on a lease's expiry) would see it in
//!   another order in each process.
//! - No randomness in the worker's sources but through `random::Random`, the seam the
//!   composition root injects (`app::Seams::random`): the operating system's in production, a
//!   generator seeded from the seed in the simulator.
//! - A seed run in a new process (this test binary, started again) gives the trace hash it gives
//!   here, the workers' log lines, span fields and metrics included: nothing of the process
//!   (hash seeds, addresses, the OS's randomness, tokio's own) reaches a seed's run.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Every `.rs` file under `dir`, with its text.
fn sources(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("the sources are readable") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).expect("a source file is UTF-8");
                out.push((path, text));
            }
        }
    }
    out.sort();
    out
}

/// The worker's sources and the simulator's (`sim/src`: its world runs beside the workers, on
/// the same runtime, so the same rules hold there).
fn worker_sources() -> Vec<(PathBuf, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut out = sources(&root.join("src"));
    out.extend(sources(&root.join("sim/src")));
    out
}

/// A line without its `//` comment (doc comments included).
fn code(line: &str) -> &str {
    line.split("//").next().unwrap_or("")
}

/// The places of `select!` macros whose first token is not `biased;`.
fn unbiased_selects(path: &Path, text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut found = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let line = code(line);
        let Some(at) = line.find("select!") else {
            continue;
        };
        let inside = line[at..]
            .split_once('{')
            .map_or("", |(_, rest)| rest.trim_start());
        let biased = if inside.is_empty() {
            lines[i + 1..]
                .iter()
                .map(|l| code(l).trim())
                .find(|l| !l.is_empty())
                .is_some_and(|l| l.starts_with("biased;"))
        } else {
            inside.starts_with("biased;")
        };
        if !biased {
            found.push(format!("{}:{}", path.display(), i + 1));
        }
    }
    found
}

#[test]
fn every_select_in_the_worker_is_biased() {
    let found: Vec<String> = worker_sources()
        .iter()
        .flat_map(|(path, text)| unbiased_selects(path, text))
        .collect();
    assert!(
        found.is_empty(),
        "tokio::select! without `biased;` (tokio then polls its branches in a random order, so a \
         seed's run is not replayable): make it biased, in the order that is right, and say why: \
         {found:#?}"
    );
}

#[test]
fn the_select_check_finds_an_unbiased_select_and_passes_a_biased_one() {
    let unbiased = "    tokio::select! {\n        _ = a => {}\n        _ = b => {}\n    }\n";
    let biased = "    tokio::select! {\n        biased;\n        _ = a => {}\n    }\n";
    let one_line = "let x = tokio::select! { biased; _ = a => 1, _ = b => 2 };\n";
    let commented = "/// it can race the loop's waits in `select!`.\n";
    let p = Path::new("x.rs");
    assert_eq!(unbiased_selects(p, unbiased), ["x.rs:1"]);
    assert!(unbiased_selects(p, biased).is_empty());
    assert!(unbiased_selects(p, one_line).is_empty());
    assert!(unbiased_selects(p, commented).is_empty());
}

/// Where a `tokio::sync::watch` may stay, and why.
const WATCHES_ALLOWED: [(&str, &str); 2] = [
    (
        "src/auth/token.rs",
        "the OIDC token's publication (the simulator's workers have no OIDC)",
    ),
    (
        "src/devkit/freeze.rs",
        "the demo's freeze of a worker's engine calls",
    ),
];

#[test]
fn no_watch_channel_where_the_simulator_runs() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = Vec::new();
    for (path, text) in worker_sources() {
        let relative = path.strip_prefix(root).unwrap_or(&path).to_string_lossy();
        if WATCHES_ALLOWED.iter().any(|(file, _)| *file == relative) {
            continue;
        }
        for (i, line) in text.lines().enumerate() {
            if code(line).contains("watch::") {
                found.push(format!("{relative}:{}", i + 1));
            }
        }
    }
    assert!(
        found.is_empty(),
        "a tokio watch channel wakes its receivers in a random order: use a Notify (FIFO) \
         beside the value: {found:#?}"
    );
}

/// Draws of randomness that bypass the worker's `Random`.
const DRAWS: [&str; 9] = [
    "rand::random",
    "rand::rng(",
    "rand::fill",
    "thread_rng",
    "OsRng",
    "from_entropy",
    "from_os_rng",
    "Uuid::new_v4",
    "Uuid::now_v7",
];

/// The draws allowed outside `random.rs`, each with why it is not the worker's behaviour.
const ALLOWED: [(&str, &str, &str); 3] = [
    (
        "src/config.rs",
        "Uuid::new_v4",
        "the default worker id, drawn once while the configuration is read (the simulator and \
         the tests name their workers)",
    ),
    (
        "src/provider/openai.rs",
        "Uuid::new_v4",
        "an id for a tool call the model sent without one, in the OpenAI adapter (the simulator \
         replaces the adapters)",
    ),
    (
        "src/devkit/workers.rs",
        "Uuid::new_v4",
        "the name of a test's scratch directory",
    ),
];

#[test]
fn no_randomness_in_the_worker_bypasses_its_random_seam() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = Vec::new();
    for (path, text) in worker_sources() {
        let relative = path.strip_prefix(root).unwrap_or(&path).to_string_lossy();
        if relative == "src/random.rs" {
            continue;
        }
        // Unit tests sit at the end of a file, after `#[cfg(test)]`.
        for (i, line) in text
            .lines()
            .take_while(|l| !l.trim_start().starts_with("#[cfg(test)]"))
            .enumerate()
        {
            for draw in DRAWS {
                let allowed = ALLOWED
                    .iter()
                    .any(|(file, what, _)| *file == relative && *what == draw);
                if code(line).contains(draw) && !allowed {
                    found.push(format!("{relative}:{}: {draw}", i + 1));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "randomness drawn around the worker's `random::Random` (the simulator cannot seed it): \
         take the worker's `Random` instead: {found:#?}"
    );
}

/// The variable that makes [`prints_the_trace_hash_of_the_seeds_named`] run the seeds it names.
const REPLAY_SEEDS: &str = "ABADA_TEST_REPLAY_SEEDS";

/// Runs the seeds `ABADA_TEST_REPLAY_SEEDS` names (comma-separated) and prints each one's hash;
/// without the variable it does nothing. [`a_seed_replayed_in_a_new_process_gives_the_same_trace`]
/// starts this test binary again with it.
#[test]
fn prints_the_trace_hash_of_the_seeds_named() {
    let Ok(seeds) = std::env::var(REPLAY_SEEDS) else {
        return;
    };
    for seed in seeds.split(',') {
        let seed: u64 = seed.trim().parse().expect("a seed is a number");
        let report = crate::sim::seed(seed);
        println!(
            "replayed seed {seed}: hash {} lines {}",
            report.hash, report.emitted_lines
        );
    }
}

/// Seeds 0 and 1 keep their journals in the engine and play approval round trips (their request
/// ids are drawn from the workers' seeded randomness), seed 7 keeps them in the run store; in
/// seed 4 a task and the runner meet its lease's local expiry at one instant (which of them
/// sees it first once depended on tokio's random wake order).
#[test]
fn a_seed_replayed_in_a_new_process_gives_the_same_trace() {
    let seeds = [0u64, 1, 4, 7];
    let here: Vec<(u64, String, usize)> = seeds
        .iter()
        .map(|&s| {
            let report = crate::sim::seed(s);
            (s, report.hash, report.emitted_lines)
        })
        .collect();
    for (seed, _, lines) in &here {
        assert!(
            *lines > 0,
            "seed {seed}: the workers' lines are in the trace"
        );
    }
    let list: Vec<String> = seeds.iter().map(u64::to_string).collect();
    let child = Command::new(std::env::current_exe().expect("this test binary"))
        .args([
            "--exact",
            "determinism::prints_the_trace_hash_of_the_seeds_named",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(REPLAY_SEEDS, list.join(","))
        .output()
        .expect("the test binary starts again");
    let stdout = String::from_utf8_lossy(&child.stdout);
    assert!(
        child.status.success(),
        "the replay failed: {stdout}\n{}",
        String::from_utf8_lossy(&child.stderr)
    );
    for (seed, hash, lines) in &here {
        let expected = format!("replayed seed {seed}: hash {hash} lines {lines}");
        assert!(
            // (libtest may print the test's name at the start of the first line.)
            stdout.lines().any(|l| l.ends_with(&expected)),
            "seed {seed} replayed in a new process gave another trace; here: {expected:?}, \
             there: {stdout}"
        );
    }
}
