//! The `abada-agent-worker` binary: parses the command line and the environment, sets up
//! logging, waits for signals, and maps the result to an exit code. Everything else is in the
//! library, and, with the `devkit` feature, in the `abada-demo` crate (`demo`, `dev-engine`),
//! given the worker's adapter to start its workers with.

use std::process::ExitCode;

use std::time::Duration;

use abada_agent_worker::config::{Config, ProcessEnv};
use abada_agent_worker::telemetry::otel::{ExportSettings, SpanExport};
use abada_agent_worker::{app, telemetry};
use tokio_util::sync::CancellationToken;

const USAGE: &str = "\
usage: abada-agent-worker [COMMAND]

commands:
  (none), run   run the worker daemon, configured by ABADA_AGENT_* variables
  demo          run the embedded demo on loopback (see --help of demo; builds with the
                `devkit` feature only, the default)
  dev-engine    run the engine emulator alone (`devkit` feature only)
  help          print this help

The daemon's variables are listed in docs/OPERATIONS.md.";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        None | Some("run") => daemon(),
        #[cfg(feature = "devkit")]
        Some("demo") => abada_demo::cli_demo(
            &abada_agent_worker::devkit::demo_workers::DemoWorkers,
            &args[1..],
        ),
        #[cfg(feature = "devkit")]
        Some("dev-engine") => abada_demo::cli_dev_engine(&args[1..]),
        #[cfg(not(feature = "devkit"))]
        Some(command @ ("demo" | "dev-engine")) => {
            eprintln!(
                "abada-agent-worker: {command} is not in this build: it was built without the \
                 devkit (cargo feature `devkit`, on by default), as the container image is; \
                 build with default features to run it"
            );
            ExitCode::from(2)
        }
        Some("help" | "--help" | "-h") => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        Some("--version" | "-V") => {
            println!("abada-agent-worker {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        Some(other) => {
            eprintln!("abada-agent-worker: unknown command {other:?}\n\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

fn daemon() -> ExitCode {
    let config = match Config::from_env(&ProcessEnv) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("abada-agent-worker: configuration error: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("abada-agent-worker: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let spans = match start_span_export(&config, runtime.handle()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("abada-agent-worker: configuration error: {e}");
            return ExitCode::from(2);
        }
    };
    telemetry::init(
        config.log_format,
        &config.worker_id,
        spans.as_ref().map(SpanExport::tracer),
    );
    app::run_to_exit(runtime, async {
        let shutdown = CancellationToken::new();
        tokio::spawn(watch_signals(shutdown.clone()));
        let worker = match app::Worker::from_config(&config) {
            Ok(w) => w,
            Err(e) => {
                eprintln!("abada-agent-worker: configuration error: {e}");
                return ExitCode::from(2);
            }
        };
        tracing::info!(
            engine_url = %config.engine_url,
            topics = ?config.topics,
            max_tasks = config.max_tasks,
            lock_duration_ms = config.lock_duration.as_millis() as u64,
            "worker starting"
        );
        let mut clear = worker.credentials_in_clear.clone();
        clear.extend(
            spans
                .as_ref()
                .and_then(SpanExport::credentials_in_clear)
                .map(str::to_string),
        );
        if !clear.is_empty() {
            tracing::warn!(
                in_clear = %clear.join("; "),
                "ABADA_AGENT_ALLOW_INSECURE_HTTP=true: credentials travel in clear over http://"
            );
        }
        let code = match worker
            .run(config.http_addr, config.poll_interval, shutdown, None)
            .await
        {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!(error = %e, "worker failed");
                ExitCode::FAILURE
            }
        };
        if let Some(spans) = spans {
            spans.shutdown(SPAN_FLUSH_LIMIT).await;
        }
        code
    })
}

/// How long the exit waits for the last spans to reach the collector.
const SPAN_FLUSH_LIMIT: Duration = Duration::from_secs(3);

/// Span export, when the `OTEL_*` variables turn it on.
fn start_span_export(
    config: &Config,
    runtime: &tokio::runtime::Handle,
) -> Result<Option<SpanExport>, String> {
    let Some(settings) = ExportSettings::from_env(&ProcessEnv, config.allow_insecure_http)
        .map_err(|e| e.to_string())?
    else {
        return Ok(None);
    };
    let http = abada_agent_worker::tls::http_client_builder(config.ca_file.as_deref())
        .map_err(|e| e.to_string())?;
    SpanExport::start(&settings, http, runtime.clone())
        .map(Some)
        .map_err(|e| e.to_string())
}

/// First SIGTERM or SIGINT: staged shutdown. Second: exit at once.
async fn watch_signals(shutdown: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers; stop the worker with SIGKILL");
        return;
    };
    // Biased, SIGTERM first: when both are pending, the orchestrator's is the one named.
    let first = tokio::select! { biased; _ = term.recv() => "SIGTERM", _ = int.recv() => "SIGINT" };
    tracing::info!(
        signal = first,
        "shutdown requested: no more fetches, draining running tasks"
    );
    shutdown.cancel();
    let second =
        tokio::select! { biased; _ = term.recv() => "SIGTERM", _ = int.recv() => "SIGINT" };
    tracing::warn!(signal = second, "second signal: exiting at once");
    std::process::exit(130);
}
