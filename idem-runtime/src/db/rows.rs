//! Row decoding shared by the database modules: their queries return the same
//! column names and, as Rust types, the same column types, so each row shape is
//! decoded once here.

use sqlx::{ColumnIndex, Decode, Row, Type};

#[cfg(any(feature = "sqlite", feature = "mysql"))]
use crate::decide::{self, KeySnapshot, LeasedStep, RowState};
#[cfg(any(feature = "sqlite", feature = "mysql"))]
use crate::fingerprint::Fingerprint;
use crate::key::KeyDigest;
use crate::model::StoredResponse;
use crate::model::{KeyRecord, OperationRow};
use crate::model::{OwnerToken, StatsGroup, StatsSnapshot, StoreError, UncertainRow, count};

/// A row that reads a column of type `T` by name, as `sqlx::Row::try_get`
/// does: the bounds sqlx asks for that (the row, the column index, and the
/// type's `Decode` and `Type` for the row's database) said once, here, for every
/// row of every database, so a decoder below names only the types it reads.
pub(crate) trait Column<T> {
    /// The column `name`, which must not be `NULL`.
    fn column(&self, name: &str) -> Result<T, sqlx::Error>;

    /// The column `name`, `None` where it is `NULL`.
    fn nullable(&self, name: &str) -> Result<Option<T>, sqlx::Error>;
}

impl<R, T> Column<T> for R
where
    R: Row,
    for<'r> &'r str: ColumnIndex<R>,
    for<'r> T: Decode<'r, R::Database> + Type<R::Database>,
{
    fn column(&self, name: &str) -> Result<T, sqlx::Error> {
        self.try_get(name)
    }

    fn nullable(&self, name: &str) -> Result<Option<T>, sqlx::Error> {
        self.try_get(name)
    }
}

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
    R: Column<String> + Column<i64> + Column<Vec<u8>> + Column<RowState>,
{
    let snapshot = match row {
        None => None,
        Some(row) => {
            let now: i64 = row.column("now")?;
            let fingerprint: Vec<u8> = row.column("fingerprint")?;
            let expires_at: i64 = row.column("expires_at")?;
            let lease_expires_at: Option<i64> = row.nullable("lease_expires_at")?;
            Some(
                KeySnapshot::read(
                    row.column("state")?,
                    &fingerprint,
                    request,
                    row.column("generation")?,
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
    R: Column<String> + Column<i64> + Column<Vec<u8>>,
{
    let status: i64 = row.column("response_status")?;
    let headers: Option<String> = row.nullable("response_headers")?;
    let body: Option<Vec<u8>> = row.nullable("response_body")?;
    let headers = match headers {
        Some(text) => serde_json::from_str(&text)
            .map_err(|e| StoreError::unreadable_headers("headers", &e))?,
        None => Vec::new(),
    };
    let stored = StoredResponse {
        status: u16::try_from(status)
            .map_err(|_| StoreError::Corrupt(format!("status {status}")))?,
        headers,
        body: bytes::Bytes::from(body.unwrap_or_default()),
    };
    with_generation(row, stored)
}

/// `stored`, read from `row`, with the row's `generation` noted when it is
/// sealed (see [`crate::at_rest::noted`]): every statement that reads an
/// answer selects `generation` too, which only a sealed answer needs.
pub(crate) fn with_generation<R>(
    row: &R,
    stored: StoredResponse,
) -> Result<StoredResponse, StoreError>
where
    R: Column<i64>,
{
    if crate::at_rest::sealed_with(&stored).is_none() {
        return Ok(stored);
    }
    Ok(crate::at_rest::noted(stored, row.column("generation")?))
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
    R: Column<String> + Column<i64> + Column<f64>,
{
    let groups = groups
        .iter()
        .map(|row| {
            Ok(StatsGroup {
                operation: row.column("operation")?,
                state: row.column("state")?,
                rows: count(row.column("rows")?),
                stored_bytes: count(row.column("bytes")?),
                expired_unswept: count(row.column("expired")?),
            })
        })
        .collect::<Result<Vec<_>, sqlx::Error>>()?;
    Ok(StatsSnapshot {
        taken_at: ages.column("taken_at")?,
        groups,
        oldest_valid_created_at: ages.nullable("oldest_valid")?,
        oldest_valid_age_seconds: ages.nullable("oldest_valid_age")?,
        oldest_in_flight_seconds: ages.nullable("oldest_in_flight")?,
    })
}

/// An `uncertain` row with `tenant_id`, `key_digest`, `downstream_key`,
/// `generation`, `owner_token` (text) and `created` (the paging position, an
/// integer).
pub(crate) fn uncertain<R>(row: &R) -> Result<UncertainRow, StoreError>
where
    R: Column<String> + Column<i64> + Column<KeyDigest> + Column<OwnerToken>,
{
    let downstream = row.nullable("downstream_key")?;
    Ok(UncertainRow {
        tenant: row.column("tenant_id")?,
        key: row.column("key_digest")?,
        downstream_key: downstream,
        generation: row.column("generation")?,
        token: row.nullable("owner_token")?,
        created: row.column("created")?,
    })
}

/// One key's row as the admin `show` reads it.
pub(crate) fn key_record<R>(row: &R) -> Result<KeyRecord, StoreError>
where
    R: Column<String> + Column<i64> + Column<bool> + Column<Vec<u8>>,
{
    Ok(KeyRecord {
        state: row.column("state")?,
        generation: row.column("generation")?,
        fingerprint: row.column("fingerprint")?,
        created_at: row.column("created_at")?,
        completed_at: row.nullable("completed_at")?,
        expires_at: row.column("expires_at")?,
        expired: row.column("expired")?,
        lease_expires_at: row.nullable("lease_expires_at")?,
        response_status: row.nullable("response_status")?,
        body_bytes: row.nullable("body_bytes")?,
        response_headers: row.nullable("response_headers")?,
        body: row.nullable("body")?,
    })
}

/// A long operation's row from `state`, `lease_live` (an integer, 1 while the
/// lease has not lapsed) and, for a finished row, its stored outcome (`stored`).
pub(crate) fn operation<R>(
    row: &R,
    stored: impl FnOnce() -> Result<crate::model::StoredResponse, StoreError>,
) -> Result<OperationRow, StoreError>
where
    R: Column<crate::decide::RowState> + Column<i64>,
{
    let state: crate::decide::RowState = row.column("state")?;
    let lease_live: i64 = row.column("lease_live")?;
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
