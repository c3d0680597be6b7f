//! A long operation's resource on SQLite: one key's row by its primary key, with
//! its lease judged on SQLite's clock.

use sqlx::Sqlite;

use super::now_ms;
use super::transactional::stored_from_row;
use crate::db::shared::operation_statements;

/// The row, unless it is finished and past its retention (then the key no
/// longer answers, and neither does its resource): `$1..$3` the primary key;
/// `lease_live` 1 while the lease has not lapsed on the database's clock.
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

const OPERATION_STATUS_SQL: &str = operation_sql!("NULL");
const OPERATION_RESULT_SQL: &str = operation_sql!("response_body");

impl crate::db::stores::OperationRows for Sqlite {
    operation_statements!();
}
