//! The deterministic simulator (docs/SIMULATION.md): runs seeds of workers against the in-memory
//! world on a paused current-thread runtime and checks the invariants after each.
//!
//! ```text
//! cargo run -p abada-sim --release --example simulate -- --seeds 1000       # seeds 0..1000
//! cargo run -p abada-sim --release --example simulate -- --seed 17 --trace  # replay one, traced
//! cargo run -p abada-sim --release --example simulate -- --seeds 200 --workers 3
//! cargo run -p abada-sim --release --features sim-bugs --example simulate -- --seeds 1000 --bug fence-removed
//! cargo run -p abada-sim --features sim-bugs --example simulate -- --every-bug  # CI: each bug
//! ```
//!
//! Exits 1 on the first violated seed (after printing its replay command), 2 on bad arguments.
//! `--every-bug` (a `sim-bugs` build) runs, for each reintroduced bug, seeds from `--from` until
//! the invariant the bug names fires (at most `--seeds`, default 1000), and exits 1 when one
//! is not caught so.

use std::process::ExitCode;
use std::time::Instant;

use abada_sim::{SimOptions, run_seed};

struct Args {
    seeds: u64,
    first: u64,
    one: Option<u64>,
    trace: bool,
    workers: Option<usize>,
    #[cfg_attr(not(feature = "sim-bugs"), allow(dead_code))]
    bug: Option<String>,
    /// Go on after a violated seed and count them (for the bug catch counts).
    keep_going: bool,
    every_bug: bool,
    seeds_given: bool,
}

fn usage() -> ExitCode {
    eprintln!(
        "usage: simulate [--seeds N] [--from S] [--seed N] [--trace] [--workers N] [--keep-going] [--bug NAME | --every-bug]"
    );
    ExitCode::from(2)
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        seeds: 100,
        first: 0,
        one: None,
        trace: false,
        workers: None,
        bug: None,
        keep_going: false,
        every_bug: false,
        seeds_given: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        let number = |name: &str, v: String| {
            v.parse::<u64>()
                .map_err(|_| format!("{name}: {v:?} is not a number"))
        };
        match a.as_str() {
            "--seeds" => {
                args.seeds = number("--seeds", value("--seeds")?)?;
                args.seeds_given = true;
            }
            "--every-bug" => args.every_bug = true,
            "--from" => args.first = number("--from", value("--from")?)?,
            "--seed" => args.one = Some(number("--seed", value("--seed")?)?),
            "--workers" => {
                args.workers = Some(number("--workers", value("--workers")?)?.max(1) as usize)
            }
            "--trace" => args.trace = true,
            "--keep-going" => args.keep_going = true,
            "--bug" => args.bug = Some(value("--bug")?),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(args)
}

fn paused_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a current-thread runtime without I/O builds")
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("simulate: {e}");
            return usage();
        }
    };
    if args.every_bug {
        return every_bug(&args);
    }
    let mut options = SimOptions {
        workers: args.workers,
        keep_trace: args.trace,
        ..SimOptions::default()
    };
    if let Some(name) = &args.bug {
        #[cfg(feature = "sim-bugs")]
        match abada_agent_worker::sim_bugs::Bug::parse(name) {
            Some(b) => options.bug = Some(b),
            None => {
                eprintln!("simulate: unknown bug {name:?}");
                return usage();
            }
        }
        #[cfg(not(feature = "sim-bugs"))]
        {
            eprintln!("simulate: --bug {name} needs a build with --features sim-bugs");
            return usage();
        }
    }
    let seeds: Vec<u64> = match args.one {
        Some(s) => vec![s],
        None => (args.first..args.first + args.seeds).collect(),
    };
    let started = Instant::now();
    let mut failed = Vec::new();
    let mut events = 0usize;
    let mut in_store = 0usize;
    for (n, &seed) in seeds.iter().enumerate() {
        options.seed = seed;
        let report = run_seed(paused_runtime(), &options);
        events += report.events;
        in_store += usize::from(report.store_journal);
        if let Some(trace) = &report.trace {
            print!("{trace}");
        }
        if args.one.is_some() {
            println!(
                "seed {seed}: {} events, {:.1} s simulated, journals in the {}, hash {}, faults {:?}",
                report.events,
                report.sim_time.as_secs_f64(),
                if report.store_journal {
                    "run store"
                } else {
                    "engine"
                },
                report.hash,
                report.injected
            );
        }
        if !report.violations.is_empty() {
            println!(
                "seed {seed} violated {} invariant(s) (after {} seeds):",
                report.violations.len(),
                n + 1
            );
            for v in report.violations.iter().take(5) {
                println!("  {v}");
            }
            match &args.bug {
                // The bug is compiled in only with the feature, and active only when named.
                Some(bug) => println!(
                    "replay: {} --bug {bug}",
                    report.replay_command().replacen(
                        "--release",
                        "--release --features sim-bugs",
                        1
                    )
                ),
                None => println!("replay: {}", report.replay_command()),
            }
            failed.push(seed);
            if !args.keep_going {
                break;
            }
        }
    }
    let took = started.elapsed().as_secs_f64();
    let ran = if args.keep_going || failed.is_empty() {
        seeds.len()
    } else {
        seeds
            .iter()
            .position(|s| Some(s) == failed.first())
            .unwrap_or(0)
            + 1
    };
    println!(
        "{ran} seeds in {took:.1} s: {:.1} seeds/s, {events} events, {in_store} with the journals in the run store; {} violated",
        ran as f64 / took.max(1e-9),
        failed.len()
    );
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// `--every-bug`: each reintroduced bug caught by the invariant it names.
#[cfg(feature = "sim-bugs")]
fn every_bug(args: &Args) -> ExitCode {
    use abada_agent_worker::sim_bugs::Bug;
    let limit = if args.seeds_given { args.seeds } else { 1000 };
    let started = Instant::now();
    let mut missed = Vec::new();
    let mut ran = 0u64;
    // `--bug NAME` narrows the run to that bug.
    let only = args.bug.as_deref();
    for bug in Bug::ALL
        .into_iter()
        .filter(|b| only.is_none_or(|name| name == b.name()))
    {
        let invariant = abada_sim::bugs::caught_by(bug);
        let mut caught = None;
        for seed in args.first..args.first + limit {
            let report = run_seed(
                paused_runtime(),
                &SimOptions {
                    seed,
                    workers: args.workers,
                    bug: Some(bug),
                    ..SimOptions::default()
                },
            );
            ran += 1;
            if report.violations.iter().any(|v| v.invariant == invariant) {
                caught = Some(seed);
                break;
            }
        }
        match caught {
            Some(seed) => println!(
                "{}: caught at seed {seed} ({} seeds) by \"{invariant}\"",
                bug.name(),
                seed - args.first + 1
            ),
            None => {
                println!(
                    "{}: NOT caught by \"{invariant}\" in seeds {}..{}",
                    bug.name(),
                    args.first,
                    args.first + limit
                );
                missed.push(bug.name());
            }
        }
    }
    println!(
        "{} bugs, {ran} seeds in {:.1} s; {} not caught by their invariant",
        Bug::ALL.len(),
        started.elapsed().as_secs_f64(),
        missed.len()
    );
    if missed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

#[cfg(not(feature = "sim-bugs"))]
fn every_bug(_: &Args) -> ExitCode {
    eprintln!("simulate: --every-bug needs a build with --features sim-bugs");
    usage()
}
