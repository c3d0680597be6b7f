//! What the database modules share: statements that read the same on every
//! database, and method bodies that differ only in the statements and encodings
//! they are expanded with. Those are macros: sqlx's executor and encoding bounds
//! would make the same code, generic over the database, unreadable.
//!
//! Their SQL is written with `$n` placeholders, which MySQL does not have:
//! MySQL takes the statements numbered in the order they appear through
//! `dialect::question_marks!`, and writes its own where the text differs.
#![cfg_attr(
    not(any(feature = "postgres", feature = "sqlite")),
    allow(dead_code, unused_imports, unused_macros)
)]

use crate::model::Resource;

pub(crate) const CURRENT_SQL: &str = "SELECT fingerprint, response_status, response_headers, response_body \
       FROM idempotency_requests \
      WHERE tenant_id = $1 AND operation = $2 AND key_digest = $3 \
        AND state IN ('completed', 'failed')";

// A resolution applies to the execution it was asked about and no other: a
// generation alone could match a later one (a released key starts again at 1),
// its owner token cannot.
pub(crate) const FORGET_SQL: &str = "DELETE FROM idempotency_requests \
      WHERE tenant_id = $1 AND operation = $2 AND key_digest = $3 \
        AND generation = $4 AND state = 'uncertain' AND CAST(owner_token AS text) = $5";

/// Reads a key's state and generation (the admin purge, under its lock).
pub(crate) const SELECT_STATE_SQL: &str = "SELECT state, generation FROM idempotency_requests \
      WHERE tenant_id = $1 AND operation = $2 AND key_digest = $3";

/// Deletes a key's row (the admin purge).
pub(crate) const DELETE_SQL: &str = "DELETE FROM idempotency_requests \
      WHERE tenant_id = $1 AND operation = $2 AND key_digest = $3";

/// The versions idem's migration table records as applied.
pub(crate) fn applied_versions_sql() -> String {
    format!(
        "SELECT version FROM {} WHERE success ORDER BY version",
        super::MIGRATIONS_TABLE
    )
}

/// `AND <scope> = $2`, or a condition that binds `$2` without using it (each
/// transition statement binds the same parameters whether or not the resource is
/// scoped).
pub(crate) fn scope_sql(resource: &Resource, null_param: &str) -> String {
    match resource.scope_column {
        Some(col) => format!(" AND {col} = $2"),
        None => format!(" AND {null_param} IS NULL"),
    }
}

/// A transition's fenced write: the new state if the version is still the one
/// read.
pub(crate) fn write_sql(resource: &Resource, null_param: &str) -> String {
    format!(
        "UPDATE {table} SET {state} = $3, {version_col} = {version_col} + 1 \
          WHERE {id_col} = $1{scope} AND {version_col} = $4 AND {state} = $5 \
          RETURNING {version_col}",
        table = resource.table,
        state = resource.state_column,
        version_col = resource.version_column,
        id_col = resource.id_column,
        scope = scope_sql(resource, null_param),
    )
}

/// The row a leased execution owns, as every fenced statement matches it: its
/// primary key and owner token as the four placeholders given (every database
/// binds them after the values the statement sets), `$cast` how the database
/// reads the bound token as the column's type (`"::uuid"` on PostgreSQL).
macro_rules! owned_row {
    ($t:literal, $o:literal, $k:literal, $tok:literal, $cast:literal) => {
        concat!(
            " tenant_id = ",
            $t,
            " AND operation = ",
            $o,
            " AND key_digest = ",
            $k,
            " AND owner_token = ",
            $tok,
            $cast,
            " AND state = 'processing'"
        )
    };
}
pub(crate) use owned_row;

/// The transactional mode's claim and completion in the caller's transaction,
/// the same on every database but for the functions of its `transactional`
/// module (`claim_on`, `complete_on`).
macro_rules! transactional_statements {
    () => {
        async fn claim(
            tx: &mut sqlx::Transaction<'_, Self>,
            req: &ClaimRequest<'_>,
        ) -> Result<Claim, StoreError> {
            transactional::claim_on(tx, req).await
        }

        async fn complete(
            execution: Execution,
            tx: &mut sqlx::Transaction<'_, Self>,
            response: &StoredResponse,
        ) -> Result<(), StoreError> {
            transactional::complete_on(execution, tx, response).await
        }
    };
}
pub(crate) use transactional_statements;

/// A long operation's row by its primary key (`$1..$3`) where timestamps are
/// Unix milliseconds (SQLite, MySQL), `$now` the database's clock: the row
/// unless it is finished and past its retention, `lease_live` 1 while the lease
/// has not lapsed, and `$body` as the body (`NULL` when not asked for).
#[cfg(any(feature = "sqlite", feature = "mysql"))]
macro_rules! ms_operation_sql {
    ($now:expr, $body:literal) => {
        concat!(
            "SELECT state, COALESCE(lease_expires_at > t.now, 0) AS lease_live, \
                    response_status, response_headers, ",
            $body,
            " AS response_body \
               FROM idempotency_requests, (SELECT ",
            $now,
            " AS now) t \
              WHERE tenant_id = $1 AND operation = $2 AND key_digest = $3 \
                AND (state IN ('processing', 'uncertain') OR expires_at > t.now)"
        )
    };
}
#[cfg(any(feature = "sqlite", feature = "mysql"))]
pub(crate) use ms_operation_sql;

/// The sweeper's three round trips, the same on every database but for their
/// SQL: expanded inside each `impl Backend` with that database's statements.
macro_rules! sweep_statements {
    ($delete_batch:expr, $backlog:expr, $in_flight:expr) => {
        async fn snapshot(
            pool: &sqlx::Pool<Self>,
        ) -> Result<$crate::model::StatsSnapshot, StoreError> {
            upkeep::snapshot(pool).await
        }

        async fn delete_batch(pool: &Pool<Self>, limit: u32) -> Result<u64, StoreError> {
            let done = sqlx::query($delete_batch)
                .bind(i64::from(limit))
                .execute(pool)
                .await?;
            Ok(done.rows_affected())
        }

        async fn backlog(pool: &Pool<Self>) -> Result<u64, StoreError> {
            let n: i64 = sqlx::query_scalar($backlog).fetch_one(pool).await?;
            Ok($crate::model::count(n))
        }

        async fn in_flight(
            pool: &Pool<Self>,
            stale_after: Duration,
        ) -> Result<$crate::model::InFlightSummary, StoreError> {
            let row = sqlx::query($in_flight)
                .bind($crate::model::millis(stale_after))
                .fetch_one(pool)
                .await?;
            Ok($crate::model::InFlightSummary {
                stale_processing: $crate::model::count(row.try_get("stale_processing")?),
                stale_uncertain: $crate::model::count(row.try_get("stale_uncertain")?),
                uncertain: $crate::model::count(row.try_get("uncertain")?),
                oldest_seconds: row.try_get("oldest_seconds")?,
            })
        }
    };
}
pub(crate) use sweep_statements;

/// A transition's two statements: `$read_sql` (a function of the resource) reads
/// and holds the row, the shared fenced write moves it; `$null_param` is how the
/// database spells an untyped `$2` in `$2 IS NULL`.
macro_rules! transition_statements {
    ($read_sql:path, $null_param:expr) => {
        async fn lock_state<'c>(
            conn: &'c mut Self::Connection,
            resource: &'c $crate::model::Resource,
            id: i64,
            scope: Option<&'c str>,
        ) -> Result<Option<(String, i64)>, sqlx::Error> {
            let row = sqlx::query(sqlx::AssertSqlSafe($read_sql(resource)))
                .bind(id)
                .bind(scope)
                .fetch_optional(conn)
                .await?;
            Ok(match row {
                Some(row) => Some((row.try_get::<String, _>(0)?, row.try_get::<i64, _>(1)?)),
                None => None,
            })
        }

        async fn write_state<'c>(
            conn: &'c mut Self::Connection,
            w: $crate::model::FencedWrite<'c>,
        ) -> Result<Option<i64>, sqlx::Error> {
            sqlx::query_scalar(sqlx::AssertSqlSafe($crate::db::shared::write_sql(
                w.resource,
                $null_param,
            )))
            .bind(w.id)
            .bind(w.scope)
            .bind(w.to)
            .bind(w.version)
            .bind(w.from)
            .fetch_optional(conn)
            .await
        }
    };
}
pub(crate) use transition_statements;

/// The admin reads that are the same on every database but for the `SHOW_SQL`
/// of the database's module, and its `admin::purge`.
macro_rules! admin_statements {
    () => {
        async fn purge<E: Send>(
            pool: &sqlx::Pool<Self>,
            key: &$crate::model::KeyAddress<'_>,
            wait: std::time::Duration,
            allow: impl FnOnce(&str) -> Result<(), E> + Send,
        ) -> Result<Option<(String, i64)>, $crate::model::PurgeError<E>> {
            admin::purge(pool, key, wait, allow).await
        }

        async fn applied_versions(pool: &sqlx::Pool<Self>) -> Result<Vec<i64>, StoreError> {
            match sqlx::query_scalar(sqlx::AssertSqlSafe(
                $crate::db::shared::applied_versions_sql(),
            ))
            .fetch_all(pool)
            .await
            {
                Ok(v) => Ok(v),
                // No history table yet: nothing was ever applied.
                Err(e) if $crate::db::is_undefined_table(&e) => Ok(vec![]),
                Err(e) => Err(e.into()),
            }
        }

        async fn fetch_record(
            pool: &sqlx::Pool<Self>,
            key: &$crate::model::KeyAddress<'_>,
            with_body: bool,
        ) -> Result<Option<$crate::model::KeyRecord>, StoreError> {
            let row = sqlx::query(SHOW_SQL)
                .bind(key.tenant)
                .bind(key.operation)
                .bind(key.digest)
                .bind(with_body)
                .fetch_optional(pool)
                .await?;
            row.as_ref().map($crate::db::rows::key_record).transpose()
        }
    };
}
pub(crate) use admin_statements;

/// The part of a purge every database shares, in the transaction `$tx` that
/// holds the key's row: given the row `SELECT_STATE_SQL` read (`None` when there
/// is none), ask `$allow` about its state, delete it, and evaluate to
/// `Some((state, generation))`; the caller commits.
macro_rules! delete_if_allowed {
    ($tx:expr, $row:expr, $key:expr, $allow:expr) => {{
        match $row {
            None => None,
            Some(row) => {
                let state: String = row.try_get("state").map_err(StoreError::from)?;
                let generation: i64 = row.try_get("generation").map_err(StoreError::from)?;
                $allow(&state).map_err($crate::model::PurgeError::Refused)?;
                sqlx::query($crate::db::shared::DELETE_SQL)
                    .bind($key.tenant)
                    .bind($key.operation)
                    .bind($key.digest)
                    .execute(&mut *$tx)
                    .await
                    .map_err(StoreError::from)?;
                Some((state, generation))
            }
        }
    }};
}
pub(crate) use delete_if_allowed;
