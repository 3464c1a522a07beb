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
