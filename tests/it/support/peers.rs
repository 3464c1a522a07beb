//! The interop peers the tests talk to (the MCP reference server, the Python MCP SDK,
//! oauth2-mock-server), installed under `target/interop/` by `scripts/install-interop-peers` and
//! `scripts/install-oidc-peer` (`scripts/test` runs both).

use std::path::PathBuf;

/// The installed peer at `relative` under `target/interop/`. A missing peer fails the test and
/// names `installer`, unless `ABADA_SKIP_INTEROP=1` says to skip the test (then `None`).
pub fn installed(relative: &str, installer: &str) -> Option<PathBuf> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("target/interop")
        .join(relative);
    if path.exists() {
        return Some(path);
    }
    if std::env::var("ABADA_SKIP_INTEROP").as_deref() == Ok("1") {
        eprintln!(
            "skipping: {} is not installed (ABADA_SKIP_INTEROP=1)",
            path.display()
        );
        return None;
    }
    panic!(
        "{} is not installed: run {installer} (or set ABADA_SKIP_INTEROP=1 to skip the interop tests)",
        path.display()
    );
}

/// A running oauth2-mock-server on 127.0.0.1; killed when dropped.
pub struct MockIssuer {
    /// As the mock advertises itself: `http://localhost:<port>`.
    pub issuer: String,
    _child: tokio::process::Child,
}

/// Starts the mock issuer, or returns `None` when it is not installed and
/// `ABADA_SKIP_INTEROP=1` says that is fine.
pub async fn mock_issuer() -> Option<MockIssuer> {
    let entry = installed(
        "oidc/node_modules/oauth2-mock-server/dist/oauth2-mock-server.mjs",
        "scripts/install-oidc-peer",
    )?;
    let mut child = tokio::process::Command::new("node")
        .arg(&entry)
        .args(["-a", "127.0.0.1", "-p", "0"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("cannot start node: is Node.js installed?");
    let issuer = super::wait::announcement(
        child.stdout.take().unwrap(),
        std::time::Duration::from_secs(60),
        "oauth2-mock-server",
        |line| {
            line.strip_prefix("OAuth 2 issuer is ")
                .map(|issuer| issuer.trim().to_string())
        },
    )
    .await;
    Some(MockIssuer {
        issuer,
        _child: child,
    })
}
