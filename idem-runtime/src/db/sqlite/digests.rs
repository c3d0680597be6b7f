//! The conversion of rows written before keys were digested: SQLite has no
//! SHA-256 function, so the migration `20261202000010_key_digest` only renames
//! the column, and this converts the rows that still hold a raw key.
//!
//! A raw key is TEXT and a digest a BLOB, so `typeof(key_digest) = 'text'`
//! finds exactly the rows left to convert: the conversion runs after every
//! migration, does nothing once it is done, and resumes after a crash. It runs
//! before `migrate` returns, so a process never serves while a raw key it would
//! not find is left.

use sqlx::{Pool, Row, Sqlite};

use crate::key::KeyDigest;
use crate::key::downstream_key_of;
use crate::model::StoreError;

/// Rows converted per transaction: each holds SQLite's one write lock only
/// briefly, so a running service is not stalled by a large table.
const BATCH: i64 = 500;

/// Converts every row still holding a raw key; the downstream key of a leased
/// or uncertain execution is derived from the raw key first and kept.
pub(crate) async fn convert_raw_keys(pool: &Pool<Sqlite>) -> Result<(), StoreError> {
    // A plain read first: once converted, a start takes no write lock at all.
    let pending: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM idempotency_requests WHERE typeof(key_digest) = 'text')",
    )
    .fetch_one(pool)
    .await?;
    if !pending {
        return Ok(());
    }
    // Paged by rowid, so that each batch reads on from the last instead of
    // scanning the converted rows again.
    let mut after: i64 = i64::MIN;
    loop {
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
        let rows = sqlx::query(
            "SELECT rowid, tenant_id, operation, key_digest AS raw_key, \
                    owner_token IS NOT NULL OR state = 'uncertain' AS leased \
               FROM idempotency_requests \
              WHERE rowid > ? AND typeof(key_digest) = 'text' ORDER BY rowid LIMIT ?",
        )
        .bind(after)
        .bind(BATCH)
        .fetch_all(&mut *tx)
        .await?;
        if rows.is_empty() {
            tx.commit().await?;
            return Ok(());
        }
        for row in &rows {
            let rowid: i64 = row.try_get("rowid")?;
            let tenant: String = row.try_get("tenant_id")?;
            let operation: String = row.try_get("operation")?;
            let raw: String = row.try_get("raw_key")?;
            let leased: bool = row.try_get("leased")?;
            let downstream = leased.then(|| downstream_key_of(&tenant, &operation, &raw));
            let updated = sqlx::query(
                "UPDATE idempotency_requests \
                    SET key_digest = ?, downstream_key = coalesce(?, downstream_key) \
                  WHERE rowid = ?",
            )
            .bind(KeyDigest::of_raw(&raw))
            .bind(downstream)
            .bind(rowid)
            .execute(&mut *tx)
            .await;
            match updated {
                Ok(done) if done.rows_affected() == 1 => {}
                // A row of the same key already stored as its digest (written by a
                // process that served before converting): two records of one
                // key, which only a person can reconcile. Nothing is changed.
                Err(sqlx::Error::Database(db)) if db.is_unique_violation() => {
                    return Err(StoreError::Corrupt(format!(
                        "converting keys to digests: the row with rowid {rowid} has a twin \
                         already stored under its digest; resolve the two by hand"
                    )));
                }
                Ok(_) => {
                    return Err(StoreError::Corrupt(format!(
                        "converting keys to digests: the row with rowid {rowid} did not change"
                    )));
                }
                Err(e) => return Err(e.into()),
            }
            after = rowid;
        }
        tx.commit().await?;
    }
}
