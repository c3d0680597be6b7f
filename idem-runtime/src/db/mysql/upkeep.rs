//! Retention and numbers on MySQL and MariaDB: the sweeper's statements and the
//! stats snapshot. "Now" is the database's clock, in Unix milliseconds.

use sqlx::mysql::MySqlArguments;
use sqlx::{Connection, MySql, MySqlPool, Row};

use super::{BEGIN_READ_COMMITTED, now_ms};
use crate::db::shared::SnapshotSql;
use crate::db::tx::ClosedIfDropped;
use crate::model::StoreError;

/// A Unix-milliseconds expression as RFC 3339 text in UTC, whole seconds,
/// without the session's time zone (`FROM_UNIXTIME` would apply it).
macro_rules! rfc3339 {
    ($ms:expr) => {
        concat!(
            "DATE_FORMAT(TIMESTAMPADD(MICROSECOND, (",
            $ms,
            ") * 1000, '1970-01-01 00:00:00'), '%Y-%m-%dT%H:%i:%sZ')"
        )
    };
}
pub(super) use rfc3339;

// A DELETE cannot skip locked rows, and one that meets a row a claim holds (a
// re-claim of an expired key, say) would wait for it. So the batch is chosen
// first with a locking read that skips locked rows (MySQL 8, MariaDB 10.6+),
// in a READ COMMITTED transaction (no gap locks: claims of new keys go on),
// through the expiry index, and then deleted by primary key; sweepers on several
// replicas share the work. The DELETE then reaches the chosen rows by primary
// key.
const CHOOSE_BATCH_SQL: &str = concat!(
    "SELECT CONVERT(tenant_id USING utf8mb4), CONVERT(operation USING utf8mb4), \
            key_digest FROM idempotency_requests \
      WHERE expires_at <= ",
    now_ms!(),
    " AND state IN ('completed', 'failed') \
      ORDER BY expires_at LIMIT ? FOR UPDATE SKIP LOCKED"
);

pub(super) const BACKLOG_SQL: &str = concat!(
    "SELECT count(*) FROM idempotency_requests \
      WHERE expires_at <= ",
    now_ms!(),
    " AND state IN ('completed', 'failed')"
);

// count() skips the NULL a CASE without ELSE gives, so each count is of its own
// rows. Dividing by a DOUBLE literal (1000e0) makes the age a DOUBLE, not a
// DECIMAL. On no rows, min() is NULL and so is the age.
pub(super) const IN_FLIGHT_SQL: &str = concat!(
    "SELECT \
        count(CASE WHEN state = 'processing' AND created_at <= ",
    now_ms!(),
    " - ? THEN 1 END) AS stale_processing, \
        count(CASE WHEN state = 'uncertain' AND created_at <= ",
    now_ms!(),
    " - ? THEN 1 END) AS stale_uncertain, \
        count(CASE WHEN state = 'uncertain' THEN 1 END) AS uncertain, \
        (",
    now_ms!(),
    " - min(created_at)) / 1000e0 AS oldest_seconds \
      FROM idempotency_requests WHERE state IN ('processing', 'uncertain')"
);

// As on SQLite, the clock is read once (here) and the groups query is given that
// instant, so every comparison of the snapshot is against the same "now".
const AGES_SQL: &str = crate::db::shared::ms_ages_sql!(
    now_ms!(),
    rfc3339!(now_ms!()),
    rfc3339!(concat!(
        "min(CASE WHEN expires_at > ",
        now_ms!(),
        " THEN created_at END)"
    ))
);

// `rows` is a reserved word in MySQL 8. The operation is VARBINARY, read back
// as text. LENGTH() counts bytes; sum() gives a
// DECIMAL, cast back to a BIGINT.
const BY_GROUP_SQL: &str = "SELECT CONVERT(operation USING utf8mb4) AS operation, state, count(*) AS `rows`, \
        CAST(coalesce(sum(coalesce(length(response_body), 0) \
                          + coalesce(length(response_headers), 0)), 0) AS SIGNED) AS bytes, \
        count(CASE WHEN expires_at <= ? AND state IN ('completed', 'failed') THEN 1 END) AS expired \
      FROM idempotency_requests GROUP BY operation, state";

/// Deletes one batch: chosen and locked under `SKIP LOCKED`, deleted by key,
/// committed.
pub(super) async fn delete_batch(pool: &MySqlPool, limit: u32) -> Result<u64, StoreError> {
    delete_chosen(pool, sqlx::query(CHOOSE_BATCH_SQL).bind(i64::from(limit))).await
}

/// Deletes, in one transaction, the rows `choose` selects (tenant, operation
/// and key digest, `FOR UPDATE SKIP LOCKED`, so that it waits on no running
/// request): by primary key only, the chosen rows being locked by this
/// transaction until it commits.
pub(super) async fn delete_chosen(
    pool: &MySqlPool,
    choose: sqlx::query::Query<'_, MySql, MySqlArguments>,
) -> Result<u64, StoreError> {
    // Dropped before it is over (a sweeper stopped), the connection is closed:
    // the driver counts the transaction only once `BEGIN` is answered, so one
    // dropped before then would go back to the pool inside it.
    let mut conn = ClosedIfDropped::new(pool.acquire().await?);
    let mut tx = conn.conn().begin_with(BEGIN_READ_COMMITTED).await?;
    let keys = choose.fetch_all(&mut *tx).await?;
    if keys.is_empty() {
        tx.rollback().await?;
        drop(conn.release());
        return Ok(0);
    }
    // The keys drive the join (STRAIGHT_JOIN) and reach the table through its
    // primary key, one row each: a `WHERE` over the table itself (an `IN` list,
    // equalities joined by `OR`, a condition on expires_at) may be read with a
    // scan on a small table, and a scan waits for the rows skipped above. A
    // statement takes at most 65,535 placeholders, three a key: a larger batch
    // is deleted in several statements, in the same transaction.
    let mut deleted = 0;
    for chunk in keys.chunks(DELETE_KEYS_PER_STATEMENT) {
        let sql = format!(
            "DELETE r FROM (SELECT ? AS t, ? AS o, ? AS k{}) v \
             STRAIGHT_JOIN idempotency_requests r \
                ON r.tenant_id = v.t AND r.operation = v.o AND r.key_digest = v.k",
            " UNION ALL SELECT ?, ?, ?".repeat(chunk.len() - 1)
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for row in chunk {
            query = query
                .bind(row.try_get::<String, _>(0)?)
                .bind(row.try_get::<String, _>(1)?)
                .bind(row.try_get::<Vec<u8>, _>(2)?);
        }
        deleted += query.execute(&mut *tx).await?.rows_affected();
    }
    tx.commit().await?;
    drop(conn.release());
    Ok(deleted)
}

/// The keys one `DELETE` of [`delete_chosen`] names: three placeholders each,
/// under the protocol's 65,535 a statement.
const DELETE_KEYS_PER_STATEMENT: usize = 20_000;

/// Both queries in one `REPEATABLE READ, READ ONLY` transaction with a
/// consistent snapshot taken at its start.
pub(super) const SNAPSHOT: SnapshotSql = SnapshotSql {
    begin: "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ; \
            START TRANSACTION READ ONLY, WITH CONSISTENT SNAPSHOT",
    ages: AGES_SQL,
    groups: BY_GROUP_SQL,
    groups_at_now: true,
};
