//! Determinism by construction, and its proof across processes.
//!
//! - Every `tokio::select!` in the worker's sources is `biased;` (its branches polled in the
//!   order written, each order chosen and said where it stands), so no race is settled by
//!   tokio's random pick.
//! - No `tokio::sync::watch` where the simulator runs: a watch wakes its receivers in a random
//!   order (each waits on one of eight notifiers that tokio's unseeded generator picks), so two
//!   tasks waiting on one value (the runner and the task on a lease's expiry) would see it in
//!   another order in each process.
//! - No randomness in the worker's sources but through `random::Random`, the seam the
//!   composition root injects (`app::Seams::random`): the operating system's in production.

use std::path::{Path, PathBuf};

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

fn worker_sources() -> Vec<(PathBuf, String)> {
    sources(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"))
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
        if relative.starts_with("src/demo")
            || WATCHES_ALLOWED.iter().any(|(file, _)| *file == relative)
        {
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
        if relative == "src/random.rs" || relative.starts_with("src/demo") {
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
