//! Retention and numbers on SQLite: the sweeper's statements and the stats
//! snapshot. "Now" is the database's clock, in Unix milliseconds.

use sqlx::Sqlite;

use super::now_ms;
use crate::db::shared::{SnapshotSql, SqlUpkeep};

// SQLite fixes 'now' for one statement only, so the ages query (the snapshot's
// first read) also returns the instant it used, and the groups query is given
// that instant ($1) rather than reading the clock again: every comparison of
// the snapshot is against the same "now", as on PostgreSQL. Timestamps are Unix
// milliseconds: ages are divided by 1000e0 (a float division, for fractional
// seconds), and strftime formats whole seconds in UTC. On no rows, min() is NULL
// and so are the ages and the oldest valid timestamp. count() skips the NULL a
// CASE without ELSE gives, so each count is of its own rows. Byte counts take
// length() of a BLOB, which is its size in bytes (of TEXT it would be
// characters), so the header text is cast to its UTF-8 bytes.
pub(super) const AGES_SQL: &str = crate::db::shared::ms_ages_sql!(
    now_ms!(),
    concat!(
        "strftime('%Y-%m-%dT%H:%M:%SZ', ",
        now_ms!(),
        " / 1000.0, 'unixepoch')"
    ),
    concat!(
        "strftime('%Y-%m-%dT%H:%M:%SZ', min(CASE WHEN expires_at > ",
        now_ms!(),
        " THEN created_at END) / 1000.0, 'unixepoch')"
    )
);

pub(super) const BY_GROUP_SQL: &str = "SELECT operation, state, count(*) AS rows, \
        coalesce(sum(coalesce(length(CAST(response_body AS BLOB)), 0) \
                     + coalesce(length(CAST(response_headers AS BLOB)), 0)), 0) AS bytes, \
        count(CASE WHEN expires_at <= $1 AND state IN ('completed', 'failed') THEN 1 END) AS expired \
      FROM idempotency_requests GROUP BY operation, state";

/// The sweeper's statements and the stats snapshot on SQLite: batches by
/// `rowid` under SQLite's single write lock, so no `SKIP LOCKED` is needed.
impl SqlUpkeep for Sqlite {
    // SQLite has no ctid and no row locks: the batch is chosen by rowid (the table is
    // not WITHOUT ROWID) through the expiry index, and the whole statement runs under
    // the database's single write lock, so no other writer can change a chosen row
    // before it is deleted and SKIP LOCKED has nothing to skip. The outer conditions
    // still repeat the inner ones so that the DELETE states by itself what it may
    // delete; they cost a comparison per chosen row. SQLite fixes 'now' for the whole
    // statement, so both conditions see the same instant.
    const DELETE_BATCH_SQL: &'static str = concat!(
        "DELETE FROM idempotency_requests \
          WHERE rowid IN ( \
                SELECT rowid FROM idempotency_requests \
                 WHERE expires_at <= ",
        now_ms!(),
        " AND state IN ('completed', 'failed') \
                 ORDER BY expires_at \
                 LIMIT $1) \
            AND expires_at <= ",
        now_ms!(),
        " AND state IN ('completed', 'failed')"
    );

    const BACKLOG_SQL: &'static str = concat!(
        "SELECT count(*) FROM idempotency_requests \
          WHERE expires_at <= ",
        now_ms!(),
        " AND state IN ('completed', 'failed')"
    );

    // No FILTER clause needed: count() skips the NULL a CASE without ELSE gives, so
    // each count is of its own rows, and an empty set counts 0. Timestamps are Unix
    // milliseconds, hence the threshold in milliseconds and the age divided by 1000.0
    // (a float division, for fractional seconds). On no rows, min() is NULL and so is
    // the age.
    const IN_FLIGHT_SQL: &'static str = concat!(
        "SELECT \
            count(CASE WHEN state = 'processing' AND created_at <= ",
        now_ms!(),
        " - $1 THEN 1 END) AS stale_processing, \
            count(CASE WHEN state = 'uncertain' AND created_at <= ",
        now_ms!(),
        " - $1 THEN 1 END) AS stale_uncertain, \
            count(CASE WHEN state = 'uncertain' THEN 1 END) AS uncertain, \
            (",
        now_ms!(),
        " - min(created_at)) / 1000.0 AS oldest_seconds \
          FROM idempotency_requests WHERE state IN ('processing', 'uncertain')"
    );

    // SQLite has no REPEATABLE READ, and needs none here: a deferred `BEGIN`
    // takes no lock, the first read starts a read transaction, and every read
    // of that transaction sees the database as it was at that first read. In
    // WAL mode (recommended for idem) that is a snapshot: writers go on
    // committing meanwhile and this transaction does not see them. In a
    // rollback-journal mode the shared lock it holds keeps writers from
    // committing until it ends, which is just as consistent (and as short).
    const SNAPSHOT: SnapshotSql = SnapshotSql {
        begin: "BEGIN",
        ages: AGES_SQL,
        groups: BY_GROUP_SQL,
        groups_at_now: true,
    };
}
