//! The run store's schema: versioned SQL migrations kept in `migrations/`, embedded in the
//! binary, applied at start-up in one transaction under a PostgreSQL advisory lock, so any
//! number of replicas starting at once apply each migration exactly once and none sees a half
//! migrated schema.
//!
//! Each applied migration is recorded with a checksum of its text; a released migration that
//! was edited afterwards is refused at start-up rather than silently diverging.

use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio_postgres::Client;

use super::error::{StoreError, classify};

/// One migration: its number, its name (the file name without `.sql`) and its SQL.
pub(super) struct Migration {
    pub version: i32,
    pub name: &'static str,
    pub sql: &'static str,
}

/// Every migration, in order. A new one is a new file in `migrations/` and a line here.
pub(super) const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "0001_run_store",
        sql: include_str!("../../migrations/0001_run_store.sql"),
    },
    Migration {
        version: 2,
        name: "0002_run_attempts",
        sql: include_str!("../../migrations/0002_run_attempts.sql"),
    },
    Migration {
        version: 3,
        name: "0003_open_runs",
        sql: include_str!("../../migrations/0003_open_runs.sql"),
    },
    Migration {
        version: 4,
        name: "0004_model_pace",
        sql: include_str!("../../migrations/0004_model_pace.sql"),
    },
];

/// The advisory lock every starting worker takes before looking at the schema: a fixed key,
/// "abadamig" in ASCII, shared by every replica of every version.
const MIGRATION_LOCK: i64 = 0x6162_6164_616d_6967;

/// How long a starting worker waits for another one's migration, and how long a migration may
/// run: far longer than a transaction of the store, since only start-up waits for it.
pub(super) const MIGRATION_TIMEOUT: Duration = Duration::from_secs(60);

/// The migrations this call applied (empty when another replica had applied them already).
pub(super) async fn apply(
    client: &mut Client,
    store: &str,
) -> Result<Vec<&'static str>, StoreError> {
    let pg = |e: tokio_postgres::Error| classify(store, &e);
    let tx = client.transaction().await.map_err(pg)?;
    let limit_ms = MIGRATION_TIMEOUT.as_millis();
    tx.batch_execute(&format!(
        "SET LOCAL lock_timeout = {limit_ms}; SET LOCAL statement_timeout = {limit_ms}; \
         SET LOCAL client_min_messages = warning"
    ))
    .await
    .map_err(pg)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .await
        .map_err(pg)?;
    // Looked up first: CREATE ... IF NOT EXISTS would need the CREATE right on the schema even
    // when the table exists, and after the first start the role needs no more than DML rights.
    let exists: bool = tx
        .query_one(
            "SELECT to_regclass('abada_agent_store_migrations') IS NOT NULL",
            &[],
        )
        .await
        .map_err(pg)?
        .get(0);
    if !exists {
        tx.batch_execute(
            "CREATE TABLE abada_agent_store_migrations (
                 version    integer     PRIMARY KEY,
                 name       text        NOT NULL,
                 checksum   text        NOT NULL,
                 applied_at timestamptz NOT NULL DEFAULT now()
             )",
        )
        .await
        .map_err(pg)?;
    }
    let rows = tx
        .query(
            "SELECT version, name, checksum FROM abada_agent_store_migrations ORDER BY version",
            &[],
        )
        .await
        .map_err(pg)?;
    let mut applied_before = Vec::new();
    for row in rows {
        let (version, name, checksum): (i32, String, String) = (row.get(0), row.get(1), row.get(2));
        if let Some(known) = MIGRATIONS.iter().find(|m| m.version == version) {
            if checksum != checksum_of(known.sql) {
                return Err(StoreError::Internal(format!(
                    "migration {name} in the run store at {store} differs from the one this worker carries (checksum); a released migration was edited: restore it and add a new one"
                )));
            }
        } else {
            tracing::warn!(
                store,
                migration = %name,
                "the run store has a migration this worker does not know (a newer worker applied it); carrying on with the schema as it is"
            );
        }
        applied_before.push(version);
    }
    let mut applied = Vec::new();
    for migration in MIGRATIONS
        .iter()
        .filter(|m| !applied_before.contains(&m.version))
    {
        tx.batch_execute(migration.sql).await.map_err(|e| {
            StoreError::Internal(format!(
                "migration {} failed in the run store at {store}: {}",
                migration.name,
                super::error::one_line(&e)
            ))
        })?;
        tx.execute(
            "INSERT INTO abada_agent_store_migrations (version, name, checksum) VALUES ($1, $2, $3)",
            &[&migration.version, &migration.name, &checksum_of(migration.sql)],
        )
        .await
        .map_err(pg)?;
        applied.push(migration.name);
    }
    tx.commit().await.map_err(pg)?;
    for name in &applied {
        tracing::info!(store, migration = %name, "applied a run-store migration");
    }
    Ok(applied)
}

fn checksum_of(sql: &str) -> String {
    Sha256::digest(sql.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_file_in_migrations_is_embedded_in_order() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
        let mut files: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".sql"))
            .collect();
        files.sort();
        let names: Vec<String> = MIGRATIONS
            .iter()
            .map(|m| format!("{}.sql", m.name))
            .collect();
        assert_eq!(
            files, names,
            "migrations/ and MIGRATIONS must list the same files"
        );
        for (i, m) in MIGRATIONS.iter().enumerate() {
            assert_eq!(m.version as usize, i + 1, "versions are contiguous from 1");
            assert!(
                m.name.starts_with(&format!("{:04}_", m.version)),
                "{}",
                m.name
            );
            let on_disk = std::fs::read_to_string(dir.join(format!("{}.sql", m.name))).unwrap();
            assert_eq!(on_disk, m.sql);
        }
    }

    #[test]
    fn the_checksum_is_the_sha256_of_the_text() {
        assert_eq!(
            checksum_of(""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
