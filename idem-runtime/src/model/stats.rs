//! What the sweeper and `idem stats` read of the table, before they add it up.

/// The in-flight rows as one sweep sees them.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct InFlightSummary {
    /// `processing` rows created at least the stale threshold ago.
    pub(crate) stale_processing: u64,
    /// `uncertain` rows created at least the stale threshold ago.
    pub(crate) stale_uncertain: u64,
    /// All `uncertain` rows, however young.
    pub(crate) uncertain: u64,
    /// Seconds since the oldest in-flight row was created, as the database
    /// computed it; `None` when no row is in flight. Left raw (it may be negative
    /// for a row created "in the future") so that the sweeper clamps it in one
    /// place for every backend.
    pub(crate) oldest_seconds: Option<f64>,
}

/// The raw numbers of one stats snapshot, before [`crate::stats()`] adds them up.
#[derive(Debug, Clone, PartialEq)]
pub struct StatsSnapshot {
    /// "Now" of the snapshot, by the database clock (RFC 3339, UTC, whole seconds).
    pub(crate) taken_at: String,
    /// One entry per (operation, state) pair present in the table, in any order.
    pub(crate) groups: Vec<StatsGroup>,
    pub(crate) oldest_valid_created_at: Option<String>,
    pub(crate) oldest_valid_age_seconds: Option<f64>,
    pub(crate) oldest_in_flight_seconds: Option<f64>,
}

/// The rows of one operation in one state, as a [`StatsSnapshot`] holds them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatsGroup {
    pub(crate) operation: String,
    /// The state as stored; stats refuse one the schema does not allow.
    pub(crate) state: String,
    pub(crate) rows: u64,
    /// Bytes of its stored outcomes: bodies plus the text of their headers.
    pub(crate) stored_bytes: u64,
    /// Its finished rows (`completed`, `failed`) past `expires_at`.
    pub(crate) expired_unswept: u64,
}
