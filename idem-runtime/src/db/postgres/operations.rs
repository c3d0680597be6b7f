//! A long operation's resource on PostgreSQL: one key's row by its primary key,
//! with its lease judged on the database's clock.

/// The row, unless it is finished and past its retention (then the key no
/// longer answers, and neither does its resource): `$1..$3` the primary key;
/// `lease_live` 1 while the lease has not lapsed on the database's clock.
macro_rules! operation_sql {
    ($body:literal) => {
        concat!(
            "SELECT state, generation, \
                    COALESCE((lease_expires_at > clock_timestamp())::int::int8, 0) AS lease_live, \
                    response_status, response_headers, ",
            $body,
            " AS response_body \
               FROM idempotency_requests \
              WHERE tenant_id = $1 AND operation = $2 AND key_digest = $3 \
                AND (state IN ('processing', 'uncertain') OR expires_at > clock_timestamp())"
        )
    };
}

pub(super) const OPERATION_STATUS_SQL: &str = operation_sql!("NULL::bytea");
pub(super) const OPERATION_RESULT_SQL: &str = operation_sql!("response_body");
