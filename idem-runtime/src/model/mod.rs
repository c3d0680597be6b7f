//! The vocabulary every layer shares, one file per concern: what a claim asks
//! and decides ([`claim`]), what a leased execution owns ([`lease`]), what the
//! sweeper and stats read ([`stats`]), one key as the admin sees it
//! ([`admin`]), a transition of the application's rows ([`transition`]), and
//! what goes wrong (here).
//!
//! The database modules ([`crate::db`]) speak it to the features above them
//! (handler, lease, sweeper, stats, reconciler, consumer, CLI), so that neither
//! side knows the other's details.

use std::time::Duration;

/// Why the store could not do its part. None of these carries a raw key.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The transaction does not run at READ COMMITTED.
    #[error(
        "idem claims need READ COMMITTED isolation; run the claim in a transaction at the default level"
    )]
    Isolation,
    /// The claim this execution held is gone (deleted, or taken over after expiry).
    #[error("the execution no longer holds its key (generation {generation}); nothing was stored")]
    LostClaim {
        /// The generation that tried to complete.
        generation: i64,
    },
    /// A stored row could not be decoded.
    #[error("a stored outcome is corrupt: {0}")]
    Corrupt(String),
    /// The handler's transaction had ended before idem stored its outcome
    /// (MySQL and MariaDB: rolled back by the server, as after a deadlock,
    /// 1213, that the handler did not return as its error, or committed by a
    /// statement that commits implicitly; SQLite: rolled back by a trigger's
    /// `RAISE(ROLLBACK)` or an error such as `SQLITE_FULL`). Nothing was
    /// stored; the retry runs the handler again. What the handler ran after its transaction ended ran
    /// outside it, each statement committing by itself.
    #[error(
        "the handler's transaction had ended before its outcome was stored (rolled back by the database after an error the handler did not return as its own, or committed by a statement that commits implicitly); nothing was stored"
    )]
    TransactionEnded,
    /// PostgreSQL: a statement of the handler's failed (a unique violation it
    /// answered `409`, say), which aborts the whole transaction, so idem's own
    /// statement could not run in it. Nothing was committed: the transaction
    /// was rolled back. A client error (4xx) the handler answered is sent as
    /// it is, as an `Err` would be, and not stored; any other answer is refused
    /// with `503`, since what it reports did not commit.
    #[error(
        "the handler's transaction was aborted by a statement that failed (PostgreSQL aborts the whole transaction; run a statement whose failure you answer inside a savepoint, or return the failure as the handler's Err); nothing was committed or stored"
    )]
    TransactionAborted,
    /// The handler left a nested transaction open on its transaction's
    /// connection (an `sqlx::Transaction` it began, then forgot with
    /// `std::mem::forget` or leaked, rather than committed or dropped), so
    /// idem's `COMMIT` would have ended only that savepoint. Nothing was
    /// stored: the connection is closed, and the database rolls back the
    /// handler's transaction with it.
    #[error(
        "the handler left a nested transaction open (began and forgot, not committed or dropped); nothing was stored"
    )]
    NestedTransactionLeftOpen,
    /// The database refused or failed.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// The migrations could not be applied.
    #[error("migration error: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A connection pooler between idem and PostgreSQL would lose what idem's
    /// statements need (found at start by [`crate::migrate`] or
    /// `check_pooler`; docs/pgbouncer.md says which settings work).
    #[error("connection pooler: {0}")]
    Pooler(String),
    /// A hand-written request that no store accepts, refused before anything
    /// is written: a lease or retention under a millisecond (every store
    /// counts whole milliseconds). The message names which.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The Redis lease store refused or failed (feature `redis`), or refused to
    /// start (see the module `idem_runtime::redis`).
    #[error("redis error: {0}")]
    Redis(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// A stored answer is sealed with a key this process's key ring does not
    /// hold, or there is no key ring (see [`crate::at_rest`]): it is neither
    /// replayed nor run again. The message names the key.
    #[error(
        "the stored answer is sealed with key {key_id:?}, which this process's key ring does not hold (Idem::with_key_ring); it is neither replayed nor run again"
    )]
    SealKeyMissing {
        /// The id of the key that sealed it.
        key_id: String,
    },
    /// A sealed stored answer did not open for its row: changed, or moved from
    /// another row (see [`crate::at_rest`]). It is neither replayed nor run
    /// again.
    #[error(
        "a sealed stored answer failed authentication (changed, or moved from another row); it is neither replayed nor run again"
    )]
    SealBroken,
}

impl StoreError {
    /// Stored headers that are not idem's `[name, value]` pairs: where the
    /// JSON stopped, never what it holds (serde_json's message quotes what it
    /// did not expect, which may be a header's value).
    pub(crate) fn unreadable_headers(what: &str, e: &serde_json::Error) -> Self {
        Self::Corrupt(format!(
            "{what}: not a list of [name, value] pairs (line {}, column {})",
            e.line(),
            e.column()
        ))
    }
}

/// A type stored as a text column: `sqlx::Type`, `Encode` and `Decode` through
/// `str`, with `as_str` to encode and `$decode` (from `&str`, fallible) to
/// decode; for every database whose driver takes `str`.
// Defined ahead of the submodules, which use it by its textual scope.
macro_rules! text_column {
    ($ty:ty, |$text:ident| $decode:expr) => {
        impl<DB: sqlx::Database> sqlx::Type<DB> for $ty
        where
            str: sqlx::Type<DB>,
        {
            fn type_info() -> DB::TypeInfo {
                <str as sqlx::Type<DB>>::type_info()
            }

            fn compatible(ty: &DB::TypeInfo) -> bool {
                <str as sqlx::Type<DB>>::compatible(ty)
            }
        }

        impl<'q, DB: sqlx::Database> sqlx::Encode<'q, DB> for $ty
        where
            for<'a> &'a str: sqlx::Encode<'q, DB>,
        {
            fn encode_by_ref(
                &self,
                buf: &mut <DB as sqlx::Database>::ArgumentBuffer,
            ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
                <&str as sqlx::Encode<'q, DB>>::encode(self.as_str(), buf)
            }
        }

        impl<'r, DB: sqlx::Database> sqlx::Decode<'r, DB> for $ty
        where
            &'r str: sqlx::Decode<'r, DB>,
        {
            fn decode(value: DB::ValueRef<'r>) -> Result<Self, sqlx::error::BoxDynError> {
                let $text = <&str as sqlx::Decode<'r, DB>>::decode(value)?;
                $decode
            }
        }
    };
}
pub(crate) use text_column;

/// Refuses a retention, or a lease, under a millisecond (zero included), the
/// same on every store, before anything is written. Every store counts whole
/// milliseconds, so either would be zero to it: a lease that lapses as it is
/// claimed (the next claim takes the execution over) or an outcome forgotten as
/// it is stored (a retry executes again). `#[idempotent]` refuses such values
/// where they are written; this holds hand-written requests to the same.
///
/// # Errors
///
/// [`StoreError::InvalidRequest`], naming the duration.
pub(crate) fn refuse_under_a_millisecond(
    retention: Duration,
    lease: Option<Duration>,
) -> Result<(), StoreError> {
    let lease = lease.map(|d| {
        (
            "lease",
            d,
            "it would lapse as it is claimed, and the next claim would take the execution over",
        )
    });
    let retention = (
        "retention",
        retention,
        "the outcome would be forgotten as it is stored, and a retry would execute again",
    );
    for (what, d, why) in lease.into_iter().chain([retention]) {
        if d < Duration::from_millis(1) {
            return Err(StoreError::InvalidRequest(format!(
                "a {what} of {d:?} is refused: idem counts durations in whole milliseconds and \
                 needs at least 1 ms; {why}"
            )));
        }
    }
    Ok(())
}

/// A duration as the milliseconds every backend's SQL takes, at most a
/// century of 365.25-day years. Saturates rather than fails: a bound of
/// centuries means "never" either way, and the time it is added to must not
/// overflow (on SQLite, `now + n` past `i64` turns into a REAL, which no
/// later read of the row takes; PostgreSQL and MySQL refuse the claim).
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).map_or(CENTURY_MS, |ms| ms.min(CENTURY_MS))
}

/// A century of 365.25-day years, in milliseconds: the longest duration
/// [`millis`] gives, and `Sweeper::MAX_STALE_AFTER`.
pub(crate) const CENTURY_MS: i64 = 3_155_760_000_000;

/// A database count as an unsigned number. A count is never negative; the
/// fallback only keeps a corrupt answer from panicking a background task.
pub(crate) fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

mod admin;
mod claim;
mod lease;
mod stats;
mod transition;

pub use admin::{
    InFlightRows, KeyAddress, KeyRecord, KeyUse, PurgeError, RekeyOptions, RekeyReport, ResealRow,
    TenantErasure,
};
pub use claim::{Claim, ClaimRequest, Execution, Finish, StoredResponse};
pub use lease::{
    Acquisition, Fence, LeaseRequest, LeasedOutcome, OperationRow, Owned, OwnerToken, Renewal,
    Renewed, UncertainOutcome, UncertainRow,
};
pub use stats::{InFlightSummary, StatsGroup, StatsSnapshot};
pub use transition::{FencedWrite, Resource};

#[cfg(test)]
mod tests {
    use super::StoreError;

    /// serde_json's own message would quote the value it did not expect.
    #[test]
    fn unreadable_headers_say_where_not_what() {
        let e = serde_json::from_str::<Vec<(String, String)>>(r#"["x-api-token: s3cret"]"#)
            .unwrap_err();
        assert!(
            e.to_string().contains("s3cret"),
            "the case this is about: {e}"
        );
        let said = StoreError::unreadable_headers("headers", &e).to_string();
        assert!(!said.contains("s3cret"), "{said}");
        assert!(said.contains("line 1, column"), "{said}");
    }
}
