//! Row decoding shared by the database modules: their queries return the same
//! column names and, as Rust types, the same column types, so each row shape is
//! decoded once here.

use sqlx::{ColumnIndex, Decode, Row, Type};

#[cfg(any(feature = "sqlite", feature = "mysql"))]
use crate::decide::{self, KeySnapshot, LeasedStep, RowState};
#[cfg(any(feature = "sqlite", feature = "mysql"))]
use crate::fingerprint::Fingerprint;
use crate::key::KeyDigest;
#[cfg(any(feature = "sqlite", feature = "mysql"))]
use crate::model::StoredResponse;
use crate::model::{KeyRecord, OperationRow};
use crate::model::{OwnerToken, StatsGroup, StatsSnapshot, StoreError, UncertainRow, count};

/// What the leased claim decides over a key's row, if it has one (`state`,
/// `fingerprint`, `generation`, `expires_at`, `lease_expires_at` and `now`, the
/// database's clock, all in the same integer unit: SQLite's and MySQL's
/// milliseconds); `stored` reads the outcome of a finished, live row.
#[cfg(any(feature = "sqlite", feature = "mysql"))]
pub(crate) fn leased_step<R>(
    row: Option<&R>,
    request: &Fingerprint,
    stored: impl FnOnce(&R) -> Result<StoredResponse, StoreError>,
) -> Result<LeasedStep, StoreError>
where
    R: Row,
    for<'r> &'r str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> RowState: Decode<'r, R::Database> + Type<R::Database>,
{
    let snapshot = match row {
        None => None,
        Some(row) => {
            let now: i64 = row.try_get("now")?;
            let fingerprint: Vec<u8> = row.try_get("fingerprint")?;
            let expires_at: i64 = row.try_get("expires_at")?;
            let lease_expires_at: Option<i64> = row.try_get("lease_expires_at")?;
            Some(
                KeySnapshot::read(
                    row.try_get("state")?,
                    &fingerprint,
                    request,
                    row.try_get("generation")?,
                    expires_at > now,
                    || stored(row),
                )?
                .with_lease(lease_expires_at.map(|until| until - now)),
            )
        }
    };
    Ok(decide::leased(snapshot))
}

/// A stored outcome from a row whose `response_status` is an integer,
/// `response_headers` JSON text and `response_body` bytes (SQLite, MySQL).
#[cfg(any(feature = "sqlite", feature = "mysql"))]
pub(crate) fn stored_from_text<R>(row: &R) -> Result<StoredResponse, StoreError>
where
    R: Row,
    for<'r> &'r str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
{
    let status: i64 = row.try_get("response_status")?;
    let headers: Option<String> = row.try_get("response_headers")?;
    let body: Option<Vec<u8>> = row.try_get("response_body")?;
    let headers = match headers {
        Some(text) => {
            serde_json::from_str(&text).map_err(|e| StoreError::Corrupt(e.to_string()))?
        }
        None => Vec::new(),
    };
    Ok(StoredResponse {
        status: u16::try_from(status)
            .map_err(|_| StoreError::Corrupt(format!("status {status}")))?,
        headers,
        body: bytes::Bytes::from(body.unwrap_or_default()),
    })
}

/// An outcome's status and headers as [`stored_from_text`]'s columns take them
/// (an integer, JSON text).
#[cfg(any(feature = "sqlite", feature = "mysql"))]
pub(crate) fn encode_text(response: &StoredResponse) -> Result<(i64, String), StoreError> {
    let headers =
        serde_json::to_string(&response.headers).map_err(|e| StoreError::Corrupt(e.to_string()))?;
    Ok((i64::from(response.status), headers))
}

/// The stats snapshot from the ages row and the (operation, state) groups.
pub(crate) fn snapshot<R>(ages: &R, groups: &[R]) -> Result<StatsSnapshot, StoreError>
where
    R: Row,
    for<'r> &'r str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> f64: Decode<'r, R::Database> + Type<R::Database>,
{
    let groups = groups
        .iter()
        .map(|row| {
            Ok(StatsGroup {
                operation: row.try_get("operation")?,
                state: row.try_get("state")?,
                rows: count(row.try_get("rows")?),
                stored_bytes: count(row.try_get("bytes")?),
                expired_unswept: count(row.try_get("expired")?),
            })
        })
        .collect::<Result<Vec<_>, sqlx::Error>>()?;
    Ok(StatsSnapshot {
        taken_at: ages.try_get("taken_at")?,
        groups,
        oldest_valid_created_at: ages.try_get("oldest_valid")?,
        oldest_valid_age_seconds: ages.try_get("oldest_valid_age")?,
        oldest_in_flight_seconds: ages.try_get("oldest_in_flight")?,
    })
}

/// An `uncertain` row with `tenant_id`, `key_digest`, `downstream_key`,
/// `generation`, `owner_token` (text) and `created` (the paging position, an
/// integer).
pub(crate) fn uncertain<R>(row: &R) -> Result<UncertainRow, StoreError>
where
    R: Row,
    for<'r> &'r str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> KeyDigest: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> OwnerToken: Decode<'r, R::Database> + Type<R::Database>,
{
    let downstream = row.try_get("downstream_key")?;
    Ok(UncertainRow {
        tenant: row.try_get("tenant_id")?,
        key: row.try_get("key_digest")?,
        downstream_key: downstream,
        generation: row.try_get("generation")?,
        token: row.try_get("owner_token")?,
        created: row.try_get("created")?,
    })
}

/// One key's row as the admin `show` reads it.
pub(crate) fn key_record<R>(row: &R) -> Result<KeyRecord, StoreError>
where
    R: Row,
    for<'r> &'r str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> bool: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(KeyRecord {
        state: row.try_get("state")?,
        generation: row.try_get("generation")?,
        fingerprint: row.try_get("fingerprint")?,
        created_at: row.try_get("created_at")?,
        completed_at: row.try_get("completed_at")?,
        expires_at: row.try_get("expires_at")?,
        expired: row.try_get("expired")?,
        lease_expires_at: row.try_get("lease_expires_at")?,
        response_status: row.try_get("response_status")?,
        body_bytes: row.try_get("body_bytes")?,
        response_headers: row.try_get("response_headers")?,
        body: row.try_get("body")?,
    })
}

/// A long operation's row from `state`, `lease_live` (an integer, 1 while the
/// lease has not lapsed) and, for a finished row, its stored outcome (`stored`).
pub(crate) fn operation<R>(
    row: &R,
    stored: impl FnOnce() -> Result<crate::model::StoredResponse, StoreError>,
) -> Result<OperationRow, StoreError>
where
    R: Row,
    for<'r> &'r str: ColumnIndex<R>,
    for<'r> crate::decide::RowState: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let state: crate::decide::RowState = row.try_get("state")?;
    let lease_live: i64 = row.try_get("lease_live")?;
    Ok(OperationRow {
        lease_live: lease_live != 0,
        outcome: if state.is_finished() {
            Some(stored()?)
        } else {
            None
        },
        state,
    })
}
