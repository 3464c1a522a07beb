//! The demo's timeline: events stamped with seconds since the scenario started, printed as they
//! happen (aligned lines for people, colour only on a terminal; or one JSON object per line),
//! and the closing summary table and verdict.

use std::io::Write;

use serde::Serialize;
use serde_json::{Map, Value};
use tokio::time::Instant;

use super::{Check, DemoReport, WorkerSummary};

/// Where and how the demo prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// Aligned lines; ANSI colour when `color`.
    Human { color: bool },
    /// One JSON object per event, then one summary object.
    Json,
    /// Nothing (tests).
    Silent,
}

/// One thing that happened.
#[derive(Clone, Debug, Serialize)]
pub struct Event {
    /// Seconds since the scenario started.
    pub t: f64,
    /// `W1`, `W2`, `engine`, `tools`, `model` or `demo`.
    pub actor: String,
    /// A short machine name, e.g. `claimed`, `task_ended`, `call_refused`.
    pub event: String,
    /// The line people read.
    pub text: String,
    /// Facts of the event for tools (task ids, counts, codes).
    #[serde(flatten)]
    pub data: Map<String, Value>,
}

pub(crate) struct Timeline {
    start: Instant,
    output: Output,
    events: Vec<Event>,
}

const RESET: &str = "\x1b[0m";

fn actor_colour(actor: &str) -> &'static str {
    match actor {
        "W1" => "\x1b[36m",
        "W2" => "\x1b[35m",
        "engine" => "\x1b[33m",
        "tools" | "model" => "\x1b[34m",
        _ => "\x1b[1m",
    }
}

impl Timeline {
    pub(crate) fn new(output: Output) -> Timeline {
        Timeline {
            start: Instant::now(),
            output,
            events: Vec::new(),
        }
    }

    pub(crate) fn seconds(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Records and prints one event. `data` should be a JSON object (anything else is ignored).
    pub(crate) fn emit(&mut self, actor: &str, event: &str, text: impl Into<String>, data: Value) {
        let data = match data {
            Value::Object(m) => m,
            _ => Map::new(),
        };
        let event = Event {
            t: (self.seconds() * 10.0).round() / 10.0,
            actor: actor.to_string(),
            event: event.to_string(),
            text: text.into(),
            data,
        };
        match self.output {
            Output::Human { color } => {
                let actor = if color {
                    format!("{}{:<6}{RESET}", actor_colour(&event.actor), event.actor)
                } else {
                    format!("{:<6}", event.actor)
                };
                let t = format!("t={:.1}s", event.t);
                print_line(&format!("{t:<8} {actor} {}", event.text));
            }
            Output::Json => {
                if let Ok(line) = serde_json::to_string(&event) {
                    print_line(&line);
                }
            }
            Output::Silent => {}
        }
        self.events.push(event);
    }

    pub(crate) fn into_events(self) -> Vec<Event> {
        self.events
    }

    /// Prints the summary table and the verdict (or the JSON summary object).
    pub(crate) fn print_summary(output: Output, report: &DemoReport) {
        match output {
            Output::Human { color } => print_line(&render_summary(report, color)),
            Output::Json => {
                let summary = serde_json::json!({
                    "event": "summary",
                    "scenario": report.scenario,
                    "passed": report.passed(),
                    "wallSeconds": report.wall_seconds,
                    "workers": report.workers,
                    "checks": report.checks,
                    "facts": report.facts,
                });
                print_line(&summary.to_string());
            }
            Output::Silent => {}
        }
    }
}

fn print_line(line: &str) {
    let mut out = std::io::stdout().lock();
    // A closed stdout (e.g. piped into `head`) must not end the demo with a panic.
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// The per-worker table, the checks and the verdict line.
pub(crate) fn render_summary(report: &DemoReport, color: bool) -> String {
    let mut s = String::new();
    s.push('\n');
    if !report.workers.is_empty() {
        s.push_str(&table(&report.workers));
        s.push('\n');
    }
    for check in &report.checks {
        s.push_str(&check_line(check, color));
        s.push('\n');
    }
    let passed = report.checks.iter().filter(|c| c.passed).count();
    let verdict = if report.passed() { "PASS" } else { "FAIL" };
    let verdict = if color {
        let c = if report.passed() {
            "\x1b[1;32m"
        } else {
            "\x1b[1;31m"
        };
        format!("{c}{verdict}{RESET}")
    } else {
        verdict.to_string()
    };
    s.push_str(&format!(
        "verdict: {verdict} ({passed}/{} checks, scenario {}, {:.1}s)",
        report.checks.len(),
        report.scenario,
        report.wall_seconds
    ));
    s
}

fn check_line(check: &Check, color: bool) -> String {
    let mark = match (check.passed, color) {
        (true, true) => format!("\x1b[32m{:<4}{RESET}", "ok"),
        (false, true) => format!("\x1b[31m{:<4}{RESET}", "FAIL"),
        (true, false) => format!("{:<4}", "ok"),
        (false, false) => format!("{:<4}", "FAIL"),
    };
    format!("{mark}  {}: {}", check.name, check.detail)
}

fn table(workers: &[WorkerSummary]) -> String {
    let headers = [
        "worker",
        "claimed",
        "completed",
        "most running",
        "heartbeats",
        "model calls",
        "tool calls",
        "keyed writes",
    ];
    let rows: Vec<[String; 8]> = workers
        .iter()
        .map(|w| {
            [
                w.worker.clone(),
                w.claimed.to_string(),
                w.completed.to_string(),
                w.max_running.to_string(),
                w.heartbeats.to_string(),
                w.model_calls.to_string(),
                w.tool_calls.to_string(),
                w.keyed_writes.to_string(),
            ]
        })
        .collect();
    let widths: Vec<usize> = (0..headers.len())
        .map(|i| {
            rows.iter()
                .map(|r| r[i].len())
                .chain([headers[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut s = String::new();
    let line = |cells: Vec<&str>| -> String {
        cells
            .iter()
            .enumerate()
            .map(|(i, c)| {
                if i == 0 {
                    format!("{c:<w$}", w = widths[i])
                } else {
                    format!("{c:>w$}", w = widths[i])
                }
            })
            .collect::<Vec<_>>()
            .join("  ")
    };
    s.push_str(&line(headers.to_vec()));
    s.push('\n');
    for r in &rows {
        s.push_str(&line(r.iter().map(String::as_str).collect()));
        s.push('\n');
    }
    s
}
