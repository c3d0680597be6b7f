//! A long operation's resource on SQLite: one key's row by its primary key, with
//! its lease judged on SQLite's clock.

use sqlx::{Row, Sqlite, SqlitePool};

use super::now_ms;
use super::transactional::stored_from_row;
use crate::model::{KeyAddress, OperationRow, StoreError};

/// The row, unless it is finished and past its retention (then the key no
/// longer answers, and neither does its resource). `$1..$3` the primary key.
macro_rules! operation_sql {
    ($body:literal) => {
        concat!(
            "SELECT state, COALESCE(lease_expires_at > t.now, 0) AS lease_live, \
                    response_status, response_headers, ",
            $body,
            " AS response_body \
               FROM idempotency_requests, (SELECT ",
            now_ms!(),
            " AS now) t \
              WHERE tenant_id = $1 AND operation = $2 AND key_digest = $3 \
                AND (state IN ('processing', 'uncertain') OR expires_at > t.now)"
        )
    };
}

const STATUS_SQL: &str = operation_sql!("NULL");
const RESULT_SQL: &str = operation_sql!("response_body");

impl crate::db::stores::OperationRows for Sqlite {
    async fn operation(
        pool: &SqlitePool,
        key: &KeyAddress<'_>,
        with_body: bool,
    ) -> Result<Option<OperationRow>, StoreError> {
        let row = sqlx::query(if with_body { RESULT_SQL } else { STATUS_SQL })
            .bind(key.tenant)
            .bind(key.operation)
            .bind(key.digest)
            .fetch_optional(pool)
            .await?;
        let Some(row) = row else { return Ok(None) };
        let state: String = row.try_get("state")?;
        let finished = matches!(state.as_str(), "completed" | "failed");
        let lease_live: i64 = row.try_get("lease_live")?;
        Ok(Some(OperationRow {
            lease_live: lease_live != 0,
            outcome: if finished {
                Some(stored_from_row(&row)?)
            } else {
                None
            },
            state,
        }))
    }
}
