//! The run store's own figures (BENCHMARKS.md): the latency of an append (p50, p99) and the
//! transactions a one-turn task costs (claim with its input step, the model step, finish),
//! against the PostgreSQL that `ABADA_TEST_DATABASE_URL` names.
//!
//! `eval "$(scripts/test-postgres start)"; cargo run --release --example store_bench -- 400 8`
//! (one-turn tasks, concurrent tasks), then `scripts/test-postgres stop "$ABADA_TEST_POSTGRES_DIR"`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use abada_agent_worker::agent::journal::{input_step, model_step};
use abada_agent_worker::config::StoreConfig;
use abada_agent_worker::conversation::{AssistantMessage, Usage};
use abada_agent_worker::metrics::Metrics;
use abada_agent_worker::secret::SecretSource;
use abada_agent_worker::store::{RunEnd, RunKey, RunStore};

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let tasks: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(400);
    let concurrency: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(8);
    let url = std::env::var("ABADA_TEST_DATABASE_URL")
        .expect("ABADA_TEST_DATABASE_URL names the PostgreSQL to measure against");
    let mut config = StoreConfig::new(Arc::new(SecretSource::value(url)));
    config.pool_size = concurrency;
    let metrics = Arc::new(Metrics::new());
    let store = RunStore::connect(&config, metrics.clone())
        .await
        .expect("the store connects");
    let run = uuid::Uuid::new_v4().simple().to_string();
    let started = Instant::now();
    let mut joins = Vec::new();
    for lane in 0..concurrency {
        let store = store.clone();
        let run = run.clone();
        joins.push(tokio::spawn(async move {
            let mut appends = Vec::new();
            for i in (lane..tasks).step_by(concurrency) {
                let key = RunKey::new(format!("bench-{run}-{i}")).unwrap();
                let input = input_step(1, "You handle refund requests.", "o-1");
                let mut claim = store.claim(&key, "bench", Some(&input)).await.unwrap();
                let answer = AssistantMessage {
                    text: Some(r#"{"decision": "refunded"}"#.into()),
                    tool_calls: vec![],
                };
                let step = model_step(2, "openai/refund", &answer, Usage::default(), "stop");
                let t = Instant::now();
                store.append(&mut claim.fence, &step).await.unwrap();
                appends.push(t.elapsed());
                store.finish(&claim.fence, RunEnd::Completed).await.unwrap();
            }
            appends
        }));
    }
    let mut appends: Vec<Duration> = Vec::new();
    for j in joins {
        appends.extend(j.await.unwrap());
    }
    let took = started.elapsed();
    appends.sort();
    let pct = |p: f64| appends[((appends.len() as f64 * p) as usize).min(appends.len() - 1)];
    let text = metrics.encode();
    let count = |op: &str| -> u64 {
        let prefix =
            format!("abada_agent_store_transaction_duration_seconds_count{{operation=\"{op}\"}}");
        text.lines()
            .find(|l| l.starts_with(&prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    let transactions = count("claim") + count("append") + count("finish");
    println!(
        "one-turn tasks: {tasks}, concurrency {concurrency}, {:.0} tasks/s",
        tasks as f64 / took.as_secs_f64()
    );
    println!(
        "store transactions per one-turn task: {:.2} (claim {}, append {}, finish {})",
        transactions as f64 / tasks as f64,
        count("claim"),
        count("append"),
        count("finish")
    );
    println!(
        "append latency: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        pct(0.50).as_secs_f64() * 1e3,
        pct(0.99).as_secs_f64() * 1e3,
        appends.last().unwrap().as_secs_f64() * 1e3
    );
}
