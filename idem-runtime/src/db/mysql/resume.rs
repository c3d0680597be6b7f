//! A migration that stopped part-way, resumed.
//!
//! MySQL commits each DDL statement on its own, so a migration of several
//! statements that fails between two of them (a lock wait, a lost connection,
//! a process stopped during a deploy) stays half-applied, its row in idem's
//! migration table marked unfinished. sqlx then refuses to run anything
//! (`MigrateError::Dirty`), and the file could not run again anyway: its first
//! statement would add columns that exist. idem's one such migration,
//! `key_digest`, is written to be resumed: its statements are each skipped
//! where the schema shows them done, or can run twice.

use sqlx::migrate::{Migrate, MigrateError, Migrator};
use sqlx::{AssertSqlSafe, MySqlConnection, MySqlPool};

use crate::db::MIGRATIONS_TABLE;
use crate::model::StoreError;

/// `20261202000010_key_digest.sql`.
const KEY_DIGEST: i64 = 20261202000010;

/// Runs `migrator` on one connection of `pool` (see `close_if_failed`),
/// first finishing `key_digest` where an earlier run stopped in it.
pub(super) async fn run(migrator: &Migrator, pool: &MySqlPool) -> Result<(), StoreError> {
    let mut conn = pool.acquire().await?;
    let ran = run_on(migrator, &mut conn).await;
    crate::db::close_if_failed(&mut conn, &ran);
    ran
}

/// Through `run_direct` (what `run` calls once it has a connection), as
/// SQLite's `run_on` says why.
async fn run_on(migrator: &Migrator, conn: &mut MySqlConnection) -> Result<(), StoreError> {
    match migrator.run_direct(None, &mut *conn, false).await {
        // Answered holding the migrator's lock: processes starting at once
        // wait for it, and then find the migration done.
        Err(MigrateError::Dirty(KEY_DIGEST)) => {
            resume_key_digest(migrator, conn).await?;
            conn.unlock().await?;
            migrator.run_direct(None, conn, false).await?;
            Ok(())
        }
        ran => Ok(ran?),
    }
}

async fn resume_key_digest(
    migrator: &Migrator,
    conn: &mut MySqlConnection,
) -> Result<(), StoreError> {
    let migration = migrator
        .iter()
        .find(|m| m.version == KEY_DIGEST)
        .ok_or_else(|| StoreError::Corrupt("the key_digest migration is missing".into()))?;
    // A statement ends a line; a checkout with CRLF line ends too.
    let sql = migration.sql.as_str().replace("\r\n", "\n");
    let statements: Vec<&str> = sql
        .split(";\n")
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    let [add_columns, downstream_keys, digests, swap_keys] = statements[..] else {
        return Err(StoreError::Corrupt(
            "the key_digest migration is not the four statements idem resumes".into(),
        ));
    };
    tracing::warn!(
        version = KEY_DIGEST,
        "idem: resuming the key_digest migration, which an earlier run left part-way"
    );
    // One `ALTER` adds both columns (InnoDB's DDL is atomic), and the last
    // one drops the raw key: what is there says what ran.
    if !has_column(conn, "key_digest").await? {
        run_statement(conn, add_columns).await?;
    }
    if has_column(conn, "idempotency_key").await? {
        // Each fills only what is still empty.
        run_statement(conn, downstream_keys).await?;
        run_statement(conn, digests).await?;
        run_statement(conn, swap_keys).await?;
    }
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {MIGRATIONS_TABLE} SET success = TRUE WHERE version = ?"
    )))
    .bind(KEY_DIGEST)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

async fn has_column(conn: &mut MySqlConnection, column: &str) -> Result<bool, StoreError> {
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.columns \
          WHERE table_schema = DATABASE() AND table_name = 'idempotency_requests' \
            AND column_name = ?",
    )
    .bind(column)
    .fetch_one(&mut *conn)
    .await?;
    Ok(n > 0)
}

async fn run_statement(conn: &mut MySqlConnection, statement: &str) -> Result<(), StoreError> {
    sqlx::raw_sql(AssertSqlSafe(statement.to_owned()))
        .execute(&mut *conn)
        .await?;
    Ok(())
}
