//! Retention and numbers on PostgreSQL: the sweeper's statements and the stats
//! snapshot. "Now" is the database's clock.

use sqlx::Postgres;

use crate::db::shared::{SnapshotSql, SqlUpkeep};

// Both queries run in one REPEATABLE READ snapshot so that their numbers agree
// with each other (and now() is the transaction's start, the same instant for
// both).
pub(super) const BY_GROUP_SQL: &str = "SELECT operation, state, count(*) AS rows, \
        coalesce(sum(coalesce(octet_length(response_body), 0)::bigint \
                     + coalesce(octet_length(response_headers::text), 0)), 0)::bigint AS bytes, \
        count(*) FILTER (WHERE expires_at <= now() AND state IN ('completed', 'failed')) AS expired \
      FROM idempotency_requests GROUP BY operation, state";

pub(super) const AGES_SQL: &str = "SELECT \
        to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') AS taken_at, \
        to_char(min(created_at) FILTER (WHERE expires_at > now()) AT TIME ZONE 'UTC', \
                'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') AS oldest_valid, \
        extract(epoch FROM now() - min(created_at) FILTER (WHERE expires_at > now()))::float8 \
            AS oldest_valid_age, \
        extract(epoch FROM now() - min(created_at) FILTER (WHERE state IN ('processing', 'uncertain')))::float8 \
            AS oldest_in_flight \
      FROM idempotency_requests";

/// The sweeper's statements and the stats snapshot on PostgreSQL: batches
/// claimed with `FOR UPDATE SKIP LOCKED`, so sweepers on several replicas share
/// the work and none waits on a row a claim holds.
impl SqlUpkeep for Postgres {
    // The inner SELECT runs once (an InitPlan) and locks its batch; the DELETE then
    // reaches those rows by ctid, a TID scan whose cost is the batch size whatever the
    // backlog (a join on the primary key let the planner hash the whole expired
    // range). The ctids are stable because the rows stay locked until the statement
    // ends. The outer conditions repeat the inner ones so that a row changed between
    // the snapshot and the lock (re-claimed, say) is left alone.
    const DELETE_BATCH_SQL: &'static str = "DELETE FROM idempotency_requests \
          WHERE ctid = ANY(ARRAY( \
                SELECT ctid FROM idempotency_requests \
                 WHERE expires_at <= now() AND state IN ('completed', 'failed') \
                 ORDER BY expires_at \
                 LIMIT $1 \
                 FOR UPDATE SKIP LOCKED)) \
            AND expires_at <= now() AND state IN ('completed', 'failed')";

    const BACKLOG_SQL: &'static str = "SELECT count(*) FROM idempotency_requests \
          WHERE expires_at <= now() AND state IN ('completed', 'failed')";

    const IN_FLIGHT_SQL: &'static str = "SELECT \
            count(*) FILTER (WHERE state = 'processing' AND created_at <= now() - $1 * interval '1 millisecond') AS stale_processing, \
            count(*) FILTER (WHERE state = 'uncertain' AND created_at <= now() - $1 * interval '1 millisecond') AS stale_uncertain, \
            count(*) FILTER (WHERE state = 'uncertain') AS uncertain, \
            extract(epoch FROM now() - min(created_at))::float8 AS oldest_seconds \
          FROM idempotency_requests WHERE state IN ('processing', 'uncertain')";

    /// Both queries in one `REPEATABLE READ, READ ONLY` transaction.
    const SNAPSHOT: SnapshotSql = SnapshotSql {
        begin: "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY",
        ages: AGES_SQL,
        groups: BY_GROUP_SQL,
        groups_at_now: false,
    };
}
