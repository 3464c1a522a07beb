//! `dev-engine`: the engine emulator alone, on a fixed address, so a worker with real provider
//! keys can be pointed at it and tasks created by hand with curl (the admin API is documented in
//! [`abada_devkit::engine`] and docs/DEVELOPMENT.md).

use std::future::Future;
use std::net::SocketAddr;

use super::ArgsError;
use abada_devkit::engine::{self, EmulatorError, EmulatorOptions};

pub(crate) const DEV_ENGINE_USAGE: &str = "\
usage: abada-agent-worker dev-engine [--addr 127.0.0.1:5601]

Runs the devkit engine emulator (protocol v1 + agent/1) until Ctrl-C.";

/// The `dev-engine` command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DevEngineArgs {
    /// Default `127.0.0.1:5601`.
    pub addr: SocketAddr,
}

impl DevEngineArgs {
    pub fn parse(args: &[String]) -> Result<DevEngineArgs, ArgsError> {
        let mut addr = SocketAddr::from(([127, 0, 0, 1], 5601));
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            let (flag, inline) = super::split_flag(arg);
            match flag {
                "--addr" => {
                    let value = super::flag_value("--addr", inline, &mut it)?;
                    addr = value.parse().map_err(|_| ArgsError::BadAddr(value))?;
                }
                _ => return Err(ArgsError::Unknown(arg.clone())),
            }
        }
        Ok(DevEngineArgs { addr })
    }
}

/// What `dev-engine` prints once the emulator listens.
pub(crate) fn cheat_sheet(root: &str) -> String {
    format!(
        "\
engine emulator (protocol v1 + agent/1) listening
  engine URL for workers:  {root}/api
  admin API:               {root}/admin

point a worker at it (real provider keys, no engine auth):
  ABADA_AGENT_ENGINE_URL={root}/api ABADA_AGENT_WORKER_ID=dev-1 \\
  ABADA_AGENT_PROVIDERS=openai ABADA_AGENT_PROVIDER_OPENAI_KIND=openai \\
  ABADA_AGENT_PROVIDER_OPENAI_API_KEY=sk-... cargo run --release

create an agent task, then watch it:
  curl -s -XPOST {root}/admin/tasks -H 'content-type: application/json' \\
       -d '{{\"variables\": {{\"question\": \"What is 2+2?\"}}, \"retries\": 3,
            \"agent\": {{\"name\": \"calc\", \"model\": \"openai/gpt-4o-mini\",
                       \"instructions\": \"Answer briefly.\", \"input\": \"${{question}}\"}}}}'
  curl -s {root}/admin/tasks/t-000001
  curl -s {root}/admin/calls

expire leases without waiting, inject faults, clear them:
  curl -s -XPOST {root}/admin/clock/advance -d '{{\"ms\": 130000}}'
  curl -s -XPOST {root}/admin/faults -d '{{\"kind\": \"serverError\", \"operation\": \"fetch-and-lock\", \"count\": 3}}'
  curl -s -XDELETE {root}/admin/faults

Ctrl-C stops it."
    )
}

/// Runs the emulator on `args.addr` until `stop` resolves.
pub(crate) async fn run_dev_engine(
    args: DevEngineArgs,
    stop: impl Future<Output = ()>,
) -> Result<(), EmulatorError> {
    let emulator = engine::start(EmulatorOptions {
        bind: args.addr,
        ..EmulatorOptions::default()
    })
    .await?;
    println!("{}", cheat_sheet(&emulator.root_url()));
    stop.await;
    emulator.shutdown().await;
    println!("engine emulator stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_address_defaults_to_5601_and_can_be_set() {
        assert_eq!(
            DevEngineArgs::parse(&[]).unwrap().addr.to_string(),
            "127.0.0.1:5601"
        );
        let a = DevEngineArgs::parse(&["--addr".into(), "127.0.0.1:0".into()]).unwrap();
        assert_eq!(a.addr.port(), 0);
        assert!(matches!(
            DevEngineArgs::parse(&["--addr".into(), "nowhere".into()]),
            Err(ArgsError::BadAddr(_))
        ));
    }
}
