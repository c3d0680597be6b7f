//! What the database modules share: statements that read the same on every
//! database, and the store traits whose bodies differ only in their statement
//! texts, implemented once over a small trait each database module implements
//! with its texts ([`SqlUpkeep`], [`SqlTransitions`], [`SqlAdmin`]; leased
//! mode's is `leases::SqlLeases`). sqlx's executor and encoding bounds are
//! written once, on each of those implementations. MySQL, whose statements
//! bind in another order or take two round trips, implements the store traits
//! itself and calls what it shares ([`applied_versions`]).
//!
//! Their SQL is written with `$n` placeholders, which MySQL does not have:
//! MySQL takes the statements numbered in the order they appear through
//! `dialect::question_marks!`, and writes its own where the text differs.
#![cfg_attr(
    not(any(feature = "postgres", feature = "sqlite")),
    allow(dead_code, unused_imports, unused_macros)
)]

use std::future::Future;
use std::time::Duration;

use sqlx::query::{Query, QueryScalar};
use sqlx::{ColumnIndex, Database, Decode, Encode, Executor, IntoArguments, Pool, Row, Type};

use super::leases::SqlLeases;
use super::stores::{Admin, Purge, Rekey, Transitions, Upkeep};
use super::tx::ClosedIfDropped;
use crate::key::KeyDigest;
use crate::model::{
    FencedWrite, InFlightSummary, KeyAddress, KeyRecord, KeyUse, PurgeError, ResealRow, Resource,
    StatsSnapshot, StoreError, StoredResponse, count, millis,
};

/// Binds the three parameters by which a statement finds a key's row: tenant,
/// operation and digest, in that order.
pub(crate) trait BindKey<'q>: Sized {
    fn bind_key(self, tenant: &'q str, operation: &'q str, digest: KeyDigest) -> Self;
}

impl<'q, DB> BindKey<'q> for Query<'q, DB, DB::Arguments>
where
    DB: Database,
    &'q str: Encode<'q, DB> + Type<DB>,
    KeyDigest: Encode<'q, DB> + Type<DB>,
{
    fn bind_key(self, tenant: &'q str, operation: &'q str, digest: KeyDigest) -> Self {
        self.bind(tenant).bind(operation).bind(digest)
    }
}

impl<'q, DB, O> BindKey<'q> for QueryScalar<'q, DB, O, DB::Arguments>
where
    DB: Database,
    &'q str: Encode<'q, DB> + Type<DB>,
    KeyDigest: Encode<'q, DB> + Type<DB>,
{
    fn bind_key(self, tenant: &'q str, operation: &'q str, digest: KeyDigest) -> Self {
        self.bind(tenant).bind(operation).bind(digest)
    }
}

pub(crate) const CURRENT_SQL: &str = "SELECT fingerprint, generation, response_status, response_headers, response_body \
       FROM idempotency_requests \
      WHERE tenant_id = $1 AND operation = $2 AND key_digest = $3 \
        AND state IN ('completed', 'failed')";

// A resolution applies to the execution it was asked about and no other: a
// generation alone could match a later one (a released key starts again at 1),
// its owner token cannot.
pub(crate) const FORGET_SQL: &str = "DELETE FROM idempotency_requests \
      WHERE tenant_id = $1 AND operation = $2 AND key_digest = $3 \
        AND generation = $4 AND state = 'uncertain' AND CAST(owner_token AS text) = $5";

/// Deletes a key's row (the admin purge).
/// How many rows a tenant has (`$1`), in every operation and state.
pub(crate) const TENANT_ROWS_SQL: &str =
    "SELECT count(*) FROM idempotency_requests WHERE tenant_id = $1";

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
/// `state:` is the condition on the row's state (`= 'processing'` unless
/// given).
macro_rules! owned_row {
    ($t:literal, $o:literal, $k:literal, $tok:literal, $cast:literal) => {
        $crate::db::shared::owned_row!($t, $o, $k, $tok, $cast, state: "= 'processing'")
    };
    ($t:literal, $o:literal, $k:literal, $tok:literal, $cast:literal, state: $state:literal) => {
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
            " AND state ",
            $state
        )
    };
}
pub(crate) use owned_row;

/// [`owned_row`] for the fenced store of an outcome: the owned execution's
/// row while it runs, and also once it is finished under this owner token.
/// A store sent again after its answer was lost (it had committed) then finds
/// the outcome it wrote and is the same store, not a stale owner's (as
/// Redis's script says). Only this owner's store finishes a row under its
/// token, and it sends one outcome: a takeover or a lapse gives the row a
/// fresh token, and a reconciler's resolution (`RESOLVE_SQL`) clears it, so
/// that a store of this owner arriving after the row was marked uncertain
/// and resolved finds nothing to write.
macro_rules! stored_row {
    ($t:literal, $o:literal, $k:literal, $tok:literal, $cast:literal) => {
        $crate::db::shared::owned_row!(
            $t,
            $o,
            $k,
            $tok,
            $cast,
            state: "IN ('processing', 'completed', 'failed')"
        )
    };
}
pub(crate) use stored_row;

/// Leased mode's two fenced statements that write no value, in a `SqlLeases`
/// impl: the execution marked uncertain, and released (its row deleted). The
/// owned row's placeholders and token cast as [`owned_row`] takes them.
macro_rules! uncertain_and_release_sql {
    ($t:literal, $o:literal, $k:literal, $tok:literal, $cast:literal) => {
        // This very mark, sent again after its answer was lost (it had
        // committed), finds the execution's row uncertain already, and is the
        // same mark (as Redis's script says).
        const UNCERTAIN_SQL: &'static str = concat!(
            "UPDATE idempotency_requests SET state = 'uncertain', lease_expires_at = NULL WHERE",
            $crate::db::shared::owned_row!(
                $t,
                $o,
                $k,
                $tok,
                $cast,
                state: "IN ('processing', 'uncertain')"
            )
        );

        const RELEASE_SQL: &'static str = concat!(
            "DELETE FROM idempotency_requests WHERE",
            $crate::db::shared::owned_row!($t, $o, $k, $tok, $cast)
        );
    };
}
pub(crate) use uncertain_and_release_sql;

/// A long operation's row by its primary key (`$1..$3`) where timestamps are
/// Unix milliseconds (SQLite, MySQL), `$now` the database's clock: the row
/// unless it is finished and past its retention, `lease_live` 1 while the lease
/// has not lapsed, and `$body` as the body (`NULL` when not asked for).
#[cfg(any(feature = "sqlite", feature = "mysql"))]
macro_rules! ms_operation_sql {
    ($now:expr, $body:literal) => {
        concat!(
            "SELECT state, generation, COALESCE(lease_expires_at > t.now, 0) AS lease_live, \
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

/// The stats' ages where timestamps are Unix milliseconds (SQLite, MySQL):
/// `$now` the database's clock, read once by this statement and returned as
/// `now_ms` so that the groups query compares against the same instant;
/// `$taken_at` and `$oldest_valid` format `$now` and the oldest live row's
/// `created_at` as RFC 3339 in the database's dialect.
#[cfg(any(feature = "sqlite", feature = "mysql"))]
macro_rules! ms_ages_sql {
    ($now:expr, $taken_at:expr, $oldest_valid:expr) => {
        concat!(
            "SELECT ",
            $now,
            " AS now_ms, ",
            $taken_at,
            " AS taken_at, ",
            $oldest_valid,
            " AS oldest_valid, (",
            $now,
            " - min(CASE WHEN expires_at > ",
            $now,
            " THEN created_at END)) / 1000e0 AS oldest_valid_age, (",
            $now,
            " - min(CASE WHEN state IN ('processing', 'uncertain') THEN created_at END)) \
               / 1000e0 AS oldest_in_flight \
               FROM idempotency_requests"
        )
    };
}
#[cfg(any(feature = "sqlite", feature = "mysql"))]
pub(crate) use ms_ages_sql;

/// How a database purges one key: `begin` opens the transaction, `select`
/// reads the row's `state, generation` holding it against every request (each
/// database locks its own way), `delete` deletes it.
pub(crate) struct PurgeSql {
    pub(crate) begin: String,
    pub(crate) select: &'static str,
    pub(crate) delete: &'static str,
}

/// One key's purge on `conn`, as `sql` spells it: `allow` is asked about the
/// row's state before it is deleted, and the transaction commits; the deleted
/// row's state and generation. `locked` turns the error of a lock not had
/// within the wait into [`PurgeError::Locked`].
pub(crate) async fn purge_row<DB, E>(
    conn: &mut DB::Connection,
    sql: PurgeSql,
    key: &KeyAddress<'_>,
    allow: impl FnOnce(&str) -> Result<(), E>,
    locked: fn(sqlx::Error) -> PurgeError<E>,
) -> Result<Option<(String, i64)>, PurgeError<E>>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> i64: Decode<'q, DB> + Type<DB>,
    for<'q> String: Decode<'q, DB> + Type<DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB> + ColumnIndex<DB::Row>,
    for<'q> KeyDigest: Encode<'q, DB> + Type<DB>,
{
    let mut tx = sqlx::Connection::begin_with(conn, sqlx::AssertSqlSafe(sql.begin))
        .await
        .map_err(locked)?;
    let row = sqlx::query(sql.select)
        .bind_key(key.tenant, key.operation, key.digest)
        .fetch_optional(&mut *tx)
        .await
        .map_err(locked)?;
    let purged = match row {
        None => None,
        Some(row) => {
            let state: String = row.try_get("state").map_err(StoreError::from)?;
            let generation: i64 = row.try_get("generation").map_err(StoreError::from)?;
            allow(&state).map_err(PurgeError::Refused)?;
            sqlx::query(sql.delete)
                .bind_key(key.tenant, key.operation, key.digest)
                .execute(&mut *tx)
                .await
                .map_err(locked)?;
            Some((state, generation))
        }
    };
    // In SQLite's rollback-journal mode the commit also waits for readers to
    // finish; past the wait nothing is deleted, and that too is a refusal.
    tx.commit().await.map_err(locked)?;
    Ok(purged)
}

/// What a database module gives the sweeper's and the stats' statements:
/// their texts, and the snapshot, which is its own.
pub trait SqlUpkeep: SqlLeases {
    /// Deletes a batch of finished, expired rows: `limit`.
    const DELETE_BATCH_SQL: &'static str;
    /// Counts the finished, expired rows.
    const BACKLOG_SQL: &'static str;
    /// The in-flight summary: `stale_after` in milliseconds.
    const IN_FLIGHT_SQL: &'static str;
    /// The stats' two queries and the transaction that holds them.
    const SNAPSHOT: SnapshotSql;
}

/// How a database reads the stats in one consistent snapshot: `ages` (the
/// table's ages, and `now_ms` where `groups` needs the clock) then `groups` (a
/// row per operation and state), both inside the transaction `begin` opens.
pub struct SnapshotSql {
    /// Begins a read-only transaction whose reads agree with each other.
    pub begin: &'static str,
    /// One row: `taken_at`, `oldest_valid`, `oldest_valid_age`, `oldest_in_flight`.
    pub ages: &'static str,
    /// A row per operation and state: `operation`, `state`, `rows`, `bytes`, `expired`.
    pub groups: &'static str,
    /// Whether `groups` takes the `now_ms` that `ages` read as `$1`, for a
    /// database whose clock moves between two statements of one transaction.
    pub groups_at_now: bool,
}

/// The sweeper's three round trips and the stats, once for the databases that
/// give [`SqlUpkeep`].
impl<DB> Upkeep for DB
where
    DB: SqlUpkeep,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> i64: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> f64: Decode<'q, DB> + Type<DB>,
    for<'q> String: Decode<'q, DB> + Type<DB>,
    for<'q> &'q str: ColumnIndex<DB::Row>,
    usize: ColumnIndex<DB::Row>,
{
    async fn delete_batch(pool: &Pool<DB>, limit: u32) -> Result<u64, StoreError> {
        let done = sqlx::query(DB::DELETE_BATCH_SQL)
            .bind(i64::from(limit))
            .execute(pool)
            .await?;
        Ok(DB::rows_affected(&done))
    }

    async fn backlog(pool: &Pool<DB>) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar(DB::BACKLOG_SQL).fetch_one(pool).await?;
        Ok(count(n))
    }

    async fn in_flight(
        pool: &Pool<DB>,
        stale_after: Duration,
    ) -> Result<InFlightSummary, StoreError> {
        let row = sqlx::query(DB::IN_FLIGHT_SQL)
            .bind(millis(stale_after))
            .fetch_one(pool)
            .await?;
        Ok(InFlightSummary {
            stale_processing: count(row.try_get("stale_processing")?),
            stale_uncertain: count(row.try_get("stale_uncertain")?),
            uncertain: count(row.try_get("uncertain")?),
            oldest_seconds: row.try_get("oldest_seconds")?,
        })
    }

    fn snapshot(pool: &Pool<DB>) -> impl Future<Output = Result<StatsSnapshot, StoreError>> + Send {
        stats_snapshot(pool, &DB::SNAPSHOT)
    }
}

/// The stats as `sql` reads them, on any database.
pub(crate) async fn stats_snapshot<DB>(
    pool: &Pool<DB>,
    sql: &SnapshotSql,
) -> Result<StatsSnapshot, StoreError>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> i64: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> f64: Decode<'q, DB> + Type<DB>,
    for<'q> String: Decode<'q, DB> + Type<DB>,
    for<'q> &'q str: ColumnIndex<DB::Row>,
{
    // Dropped before it is over (a caller's timeout), the connection is closed:
    // MySQL's driver counts a transaction only once `BEGIN` is answered, so one
    // dropped before then would go back to the pool inside this read-only one.
    let mut conn = ClosedIfDropped::new(pool.acquire().await?);
    let mut tx =
        sqlx::Connection::begin_with(&mut **conn.conn(), sqlx::AssertSqlSafe(sql.begin)).await?;
    let ages = sqlx::query(sql.ages).fetch_one(&mut *tx).await?;
    let mut groups = sqlx::query(sql.groups);
    if sql.groups_at_now {
        groups = groups.bind(ages.try_get::<i64, _>("now_ms")?);
    }
    let groups = groups.fetch_all(&mut *tx).await?;
    let snapshot = super::rows::snapshot(&ages, &groups)?;
    // Read only: there is nothing to commit.
    tx.rollback().await?;
    drop(conn.release());
    Ok(snapshot)
}

/// What a database module gives a transition's two statements: the locking
/// read (a function of the resource), and how it spells an untyped `$2` in
/// `$2 IS NULL`.
pub trait SqlTransitions: Database {
    /// `$2` as the database takes it untyped in `$2 IS NULL`.
    const NULL_PARAM: &'static str;

    /// The statement that reads `state, version` of a resource and holds it
    /// against other transitions until the transaction ends.
    fn transition_read_sql(resource: &Resource) -> String;
}

/// A transition's locking read and fenced write, once for the databases that
/// give [`SqlTransitions`].
impl<DB> Transitions for DB
where
    DB: SqlTransitions,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> i64: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> String: Decode<'q, DB> + Type<DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> Option<&'q str>: Encode<'q, DB>,
    usize: ColumnIndex<DB::Row>,
{
    fn lock_state<'c>(
        conn: &'c mut DB::Connection,
        resource: &'c Resource,
        id: i64,
        scope: Option<&'c str>,
    ) -> impl Future<Output = Result<Option<(String, i64)>, sqlx::Error>> + Send + 'c {
        read_state(conn, DB::transition_read_sql(resource), id, scope)
    }

    async fn write_state<'c>(
        conn: &'c mut DB::Connection,
        w: FencedWrite<'c>,
    ) -> Result<Option<i64>, sqlx::Error> {
        sqlx::query_scalar(sqlx::AssertSqlSafe(write_sql(w.resource, DB::NULL_PARAM)))
            .bind(w.id)
            .bind(w.scope)
            .bind(w.to)
            .bind(w.version)
            .bind(w.from)
            .fetch_optional(conn)
            .await
    }
}

/// A transition's locking read: `read_sql` (the resource's `state, version`,
/// bound to `id` and `scope`) on `conn`, on any database.
pub(crate) async fn read_state<DB>(
    conn: &mut DB::Connection,
    read_sql: String,
    id: i64,
    scope: Option<&str>,
) -> Result<Option<(String, i64)>, sqlx::Error>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> i64: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> String: Decode<'q, DB> + Type<DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> Option<&'q str>: Encode<'q, DB>,
    usize: ColumnIndex<DB::Row>,
{
    let row = sqlx::query(sqlx::AssertSqlSafe(read_sql))
        .bind(id)
        .bind(scope)
        .fetch_optional(conn)
        .await?;
    Ok(match row {
        Some(row) => Some((row.try_get::<String, _>(0)?, row.try_get::<i64, _>(1)?)),
        None => None,
    })
}

/// What a database module gives the admin reads: the `show` statement
/// (`tenant, operation, digest, with_body`) and the tenant's erasure; its purge
/// is its own ([`Purge`]).
pub trait SqlAdmin: SqlLeases + Purge {
    /// One key's row as `show` prints it.
    const SHOW_SQL: &'static str;

    /// Deletes at most `$2` rows of tenant `$1` in one statement, skipping rows
    /// a running transaction holds: the finished ones, or every one when `$3`.
    const ERASE_TENANT_SQL: &'static str;
}

/// The admin reads, once for the databases that give [`SqlAdmin`].
impl<DB> Admin for DB
where
    DB: SqlAdmin + Rekey,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> i64: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> String: Decode<'q, DB> + Type<DB>,
    for<'q> Vec<u8>: Decode<'q, DB> + Type<DB>,
    for<'q> bool: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB> + ColumnIndex<DB::Row>,
    for<'q> crate::key::KeyDigest: Encode<'q, DB> + Type<DB>,
    usize: ColumnIndex<DB::Row>,
{
    fn applied_versions(
        pool: &Pool<DB>,
    ) -> impl Future<Output = Result<Vec<i64>, StoreError>> + Send {
        applied_versions(pool)
    }

    async fn erase_tenant_batch(
        pool: &Pool<DB>,
        tenant: &str,
        limit: u32,
        all: bool,
    ) -> Result<u64, StoreError> {
        let done = sqlx::query(DB::ERASE_TENANT_SQL)
            .bind(tenant)
            .bind(i64::from(limit))
            .bind(all)
            .execute(pool)
            .await?;
        Ok(DB::rows_affected(&done))
    }

    async fn tenant_rows(pool: &Pool<DB>, tenant: &str) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar(TENANT_ROWS_SQL)
            .bind(tenant)
            .fetch_one(pool)
            .await?;
        Ok(crate::model::count(n))
    }

    async fn fetch_record(
        pool: &Pool<DB>,
        key: &KeyAddress<'_>,
        with_body: bool,
    ) -> Result<Option<KeyRecord>, StoreError> {
        let row = sqlx::query(DB::SHOW_SQL)
            .bind(key.tenant)
            .bind(key.operation)
            .bind(key.digest)
            .bind(with_body)
            .fetch_optional(pool)
            .await?;
        row.as_ref().map(super::rows::key_record).transpose()
    }
}

/// The rekey's statements over `$key_id` (the SQL expression of a sealed
/// answer's key id, NULL for a clear one) and `$p` (the placeholders, in the
/// order the generic code binds them: `$1` to `$8`, or MySQL's `?`), with
/// `$cols` the address's columns as selected and `$after` the empty value of
/// each (`''` and an empty digest) that comes before every row, and `$cursor`
/// how the page's resume point is written (`row`, a row comparison, or
/// `expanded`, column by column: see the arms below). The page is
/// ordered by the table's columns, named with the table: where the address is
/// selected as an expression under the column's name (MySQL's VARBINARY read
/// back as text), the bare name would order by that text's collation while the
/// resume point compares the column's bytes, and a page that ended on `acme`
/// would never reach `Zeta`.
#[allow(unused_macros)]
macro_rules! rekey_sql {
    (
        key_id: $key_id:literal,
        body: $body:literal,
        tenant: $tenant:literal,
        operation: $operation:literal,
        empty_digest: $empty:literal,
        created: $created:literal,
        cursor: $cursor:ident,
        params: [$p1:literal, $p2:literal, $p3:literal, $p4:literal, $p5:literal, $p6:literal, $p7:literal, $p8:literal] $(,)?
    ) => {
        const REKEY_PAGE_SQL: &'static str = concat!(
            "SELECT ",
            $tenant,
            " AS tenant_id, ",
            $operation,
            " AS operation, key_digest, generation, ",
            $created,
            " AS created, response_status, response_headers, response_body \
               FROM idempotency_requests",
            $crate::db::shared::rekey_sql!(
                @after $cursor,
                key_id: $key_id,
                empty_digest: $empty,
                params: [$p1, $p2, $p3, $p4, $p5],
            ),
            " ORDER BY idempotency_requests.tenant_id, idempotency_requests.operation, \
                       idempotency_requests.key_digest LIMIT ",
            $p6
        );
        const RESEAL_SQL: &'static str = concat!(
            "UPDATE idempotency_requests SET response_headers = ",
            $p1,
            ", response_body = ",
            $p2,
            " WHERE tenant_id = ",
            $p3,
            " AND operation = ",
            $p4,
            " AND key_digest = ",
            $p5,
            " AND generation = ",
            $p6,
            " AND state IN ('completed', 'failed') AND ",
            $body,
            " = ",
            $p7,
            " AND ",
            $created,
            " = ",
            $p8
        );
        const KEYS_IN_USE_SQL: &'static str = concat!(
            "SELECT ",
            $key_id,
            " AS key_id, count(*) AS n FROM idempotency_requests \
              WHERE state IN ('completed', 'failed') GROUP BY 1 ORDER BY 1"
        );
    };
    // The page's condition, after `FROM idempotency_requests`: finished rows
    // not under the active key (`$p1`; in clear only when `$p2`), after the
    // resume point (`$p3`, `$p4`, `$p5`). Here as a row comparison, which
    // PostgreSQL and SQLite serve from the primary key's range.
    (
        @after row,
        key_id: $key_id:literal,
        empty_digest: $empty:literal,
        params: [$p1:literal, $p2:literal, $p3:literal, $p4:literal, $p5:literal] $(,)?
    ) => {
        concat!(
            " WHERE state IN ('completed', 'failed') \
                AND CASE WHEN ",
            $key_id,
            " IS NOT NULL THEN ",
            $key_id,
            " <> ",
            $p1,
            " ELSE ",
            $p2,
            " END \
                AND (tenant_id, operation, key_digest) > \
                    (COALESCE(",
            $p3,
            ", ''), COALESCE(",
            $p4,
            ", ''), COALESCE(",
            $p5,
            ", ",
            $empty,
            "))"
        )
    };
    // The resume point spelt out column by column, for MySQL and MariaDB:
    // MariaDB uses no index for a row comparison, so each page read the table
    // from its start (a run over n rows read about n²/2). Its values come
    // from a one-row derived table, each placeholder once and in the order
    // they are bound (MySQL's `?` are positional), which the optimizer reads
    // as constants: the primary key's range serves the page.
    (
        @after expanded,
        key_id: $key_id:literal,
        empty_digest: $empty:literal,
        params: [$p1:literal, $p2:literal, $p3:literal, $p4:literal, $p5:literal] $(,)?
    ) => {
        concat!(
            ", (SELECT ",
            $p1,
            " AS active, ",
            $p2,
            " AS clear, COALESCE(",
            $p3,
            ", '') AS t, COALESCE(",
            $p4,
            ", '') AS o, COALESCE(",
            $p5,
            ", ",
            $empty,
            ") AS k) AS page \
              WHERE state IN ('completed', 'failed') \
                AND CASE WHEN ",
            $key_id,
            " IS NOT NULL THEN ",
            $key_id,
            " <> page.active ELSE page.clear END \
                AND (idempotency_requests.tenant_id > page.t \
                     OR (idempotency_requests.tenant_id = page.t \
                         AND (idempotency_requests.operation > page.o \
                              OR (idempotency_requests.operation = page.o \
                                  AND idempotency_requests.key_digest > page.k))))"
        )
    };
}
pub(crate) use rekey_sql;

/// What a database module gives the rekey: its statements, which differ in
/// how they read the key id out of the headers column's JSON.
pub trait SqlRekey: SqlLeases {
    /// Finished rows whose answer is sealed with another key than `$1` (or in
    /// clear when `$2`), after (`$3`, `$4`, `$5`) in primary key order, at most
    /// `$6`: `tenant_id, operation, key_digest, generation, created` (when the
    /// execution began, in the database's units) and the answer's columns.
    const REKEY_PAGE_SQL: &'static str;
    /// Writes headers `$1` and body `$2` over the row (`$3`, `$4`, `$5`) if it
    /// is finished, of generation `$6`, still holds body `$7` and was created
    /// at `$8` (the same execution: a row swept and run again since, at
    /// generation 1 with the same body, has another time).
    const RESEAL_SQL: &'static str;
    /// `key_id` (NULL for a clear answer) and `n` rows, over the finished rows.
    const KEYS_IN_USE_SQL: &'static str;
}

/// The rekey's reads and writes, once for the databases that give
/// [`SqlRekey`].
impl<DB> Rekey for DB
where
    DB: SqlRekey,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> i64: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> String: Decode<'q, DB> + Type<DB>,
    for<'q> bool: Encode<'q, DB> + Type<DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB> + ColumnIndex<DB::Row>,
    for<'q> Option<&'q str>: Encode<'q, DB>,
    for<'q> &'q [u8]: Encode<'q, DB> + Type<DB>,
    for<'q> Option<&'q [u8]>: Encode<'q, DB>,
    for<'q> KeyDigest: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
{
    async fn rekey_page(
        pool: &Pool<DB>,
        active: &str,
        clear: bool,
        after: Option<&ResealRow>,
        limit: u32,
    ) -> Result<Vec<ResealRow>, StoreError> {
        let rows = sqlx::query(DB::REKEY_PAGE_SQL)
            .bind(active)
            .bind(clear)
            .bind(after.map(|a| a.at.0.as_str()))
            .bind(after.map(|a| a.at.1.as_str()))
            .bind(after.map(|a| &a.at.2.as_bytes()[..]))
            .bind(i64::from(limit))
            .fetch_all(pool)
            .await?;
        rows.iter()
            .map(|row| {
                Ok(ResealRow {
                    at: (
                        row.try_get("tenant_id")?,
                        row.try_get("operation")?,
                        row.try_get("key_digest")?,
                    ),
                    generation: row.try_get("generation")?,
                    created: row.try_get("created")?,
                    // One row that does not read (spoiled by hand) is that
                    // row's loss, counted as broken, not the whole run's.
                    stored: DB::stored_from_row(row).ok(),
                })
            })
            .collect()
    }

    async fn reseal(
        pool: &Pool<DB>,
        row: &ResealRow,
        sealed: &StoredResponse,
    ) -> Result<u64, StoreError> {
        let (_, headers) = DB::encode(sealed)?;
        let done = sqlx::query(DB::RESEAL_SQL)
            .bind(headers)
            .bind(&sealed.body[..])
            .bind_key(&row.at.0, &row.at.1, row.at.2)
            .bind(row.generation)
            // A row whose answer did not read is never re-sealed; were it, a
            // NULL body would match no row.
            .bind(row.stored.as_ref().map(|s| &s.body[..]))
            .bind(row.created)
            .execute(pool)
            .await?;
        Ok(DB::rows_affected(&done))
    }

    async fn keys_in_use(pool: &Pool<DB>) -> Result<Vec<KeyUse>, StoreError> {
        let rows = sqlx::query(DB::KEYS_IN_USE_SQL).fetch_all(pool).await?;
        rows.iter()
            .map(|row| {
                Ok(KeyUse {
                    key_id: row.try_get("key_id")?,
                    rows: count(row.try_get("n")?),
                })
            })
            .collect()
    }
}

/// The versions idem's migration table records as applied; none before the
/// first (no history table yet).
pub(crate) async fn applied_versions<DB>(pool: &Pool<DB>) -> Result<Vec<i64>, StoreError>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> i64: Decode<'q, DB> + Type<DB>,
    usize: ColumnIndex<DB::Row>,
{
    match sqlx::query_scalar(sqlx::AssertSqlSafe(applied_versions_sql()))
        .fetch_all(pool)
        .await
    {
        Ok(v) => Ok(v),
        Err(e) if super::is_undefined_table(&e) => Ok(vec![]),
        Err(e) => Err(e.into()),
    }
}
