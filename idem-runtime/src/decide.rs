//! The claim decisions, transactional and leased, as pure functions over a
//! snapshot of the key's row: what the database read, not how it read it. The
//! handler paths of every database, and SQLite's and MySQL's leased claims,
//! read the row with one statement and decide here; unit-tested below without a
//! database, and the oracle that `tests/decide_oracle.rs` holds every store's
//! hand-written claim to (PostgreSQL's PL/pgSQL, Redis's Lua; through
//! `test_util::decide`, feature `test-util`; not a public API).

use std::str::FromStr;
use std::time::Duration;

use crate::fingerprint::Fingerprint;
use crate::model::{Claim, LeasedOutcome, StoreError, StoredResponse};

/// The `state` column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowState {
    /// Leased mode's execution in progress (a transactional one is never seen:
    /// it is an uncommitted row, or on the handler's path no row at all).
    Processing,
    /// A finished outcome, 2xx or 3xx.
    Completed,
    /// A finished outcome, 4xx.
    Failed,
    /// Leased mode: the effect's outcome is not known.
    Uncertain,
}

impl RowState {
    /// Whether the row holds a stored outcome that can be replayed.
    pub fn is_finished(self) -> bool {
        matches!(self, RowState::Completed | RowState::Failed)
    }

    /// The column's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            RowState::Processing => "processing",
            RowState::Completed => "completed",
            RowState::Failed => "failed",
            RowState::Uncertain => "uncertain",
        }
    }
}

// The `state` column binds and reads as text on every database; a spelling the
// schema does not allow fails to decode (as `StoreError::Corrupt`'s message).
crate::model::text_column!(RowState, |text| Ok(text.parse::<RowState>()?));

impl FromStr for RowState {
    type Err = StoreError;

    fn from_str(s: &str) -> Result<Self, StoreError> {
        match s {
            "processing" => Ok(RowState::Processing),
            "completed" => Ok(RowState::Completed),
            "failed" => Ok(RowState::Failed),
            "uncertain" => Ok(RowState::Uncertain),
            other => Err(StoreError::Corrupt(format!("state {other:?}"))),
        }
    }
}

/// A key's row as one statement read it.
#[derive(Debug, Clone)]
pub struct KeySnapshot {
    /// Whether the row's fingerprint is the request's.
    pub fingerprint_matches: bool,
    /// The `state` column.
    pub state: RowState,
    /// The `generation` column.
    pub generation: i64,
    /// Whether `expires_at` is still ahead, on the database's clock.
    pub live: bool,
    /// The stored outcome of a finished, live row (an expired one's is not
    /// read: it is never answered).
    pub stored: Option<StoredResponse>,
    /// Leased mode: how long the lease has left on the database's clock, in
    /// milliseconds (zero or less: lapsed); `None` for a row without a lease.
    /// (The leased decision is SQLite's and MySQL's; PostgreSQL's and Redis's
    /// claims decide in the database.)
    #[cfg_attr(
        not(any(feature = "sqlite", feature = "mysql", feature = "test-util")),
        allow(dead_code)
    )]
    pub lease_ms_left: Option<i64>,
}

impl KeySnapshot {
    /// A snapshot from a row's columns as any database returns them: `state`,
    /// the stored `fingerprint` (compared with the request's), `generation`,
    /// `live`, and the stored outcome, read only for a finished, live row.
    pub(crate) fn read(
        state: RowState,
        stored_fingerprint: &[u8],
        request: &Fingerprint,
        generation: i64,
        live: bool,
        outcome: impl FnOnce() -> Result<StoredResponse, StoreError>,
    ) -> Result<Self, StoreError> {
        // The next execution's generation is one more, and fences the last
        // owner out only if it is greater: a row at the top of the range (or
        // below the first generation) was not written by idem.
        if !(1..i64::MAX).contains(&generation) {
            return Err(StoreError::Corrupt(format!("generation {generation}")));
        }
        Ok(KeySnapshot {
            fingerprint_matches: stored_fingerprint == request.as_bytes(),
            state,
            generation,
            live,
            stored: if state.is_finished() && live {
                Some(outcome()?)
            } else {
                None
            },
            lease_ms_left: None,
        })
    }

    /// The snapshot with the lease's time left (`lease_expires_at - now`, in
    /// milliseconds), for the leased claim.
    #[cfg_attr(
        not(any(feature = "sqlite", feature = "mysql", feature = "test-util")),
        allow(dead_code)
    )]
    pub fn with_lease(mut self, lease_ms_left: Option<i64>) -> Self {
        self.lease_ms_left = lease_ms_left;
        self
    }
}

/// What a transactional request does before its handler runs.
#[derive(Debug)]
pub enum TransactionalStep {
    /// Run the handler; its completion claims the key at `generation` (one more
    /// than an expired row's).
    Execute {
        /// The generation the claim will hold.
        generation: i64,
    },
    /// Answer without running anything.
    Answer(Claim),
}

/// The decision before the handler: a finished, unexpired outcome is replayed
/// (or `422` for another request), an expired one is executed anew, a leased
/// execution in progress or uncertain is in flight (or `422`), and a key with no
/// row is executed.
pub fn transactional(row: Option<KeySnapshot>, in_flight_wait: Duration) -> TransactionalStep {
    let Some(row) = row else {
        return TransactionalStep::Execute { generation: 1 };
    };
    if row.state.is_finished() && !row.live {
        return TransactionalStep::Execute {
            generation: row.generation + 1,
        };
    }
    TransactionalStep::Answer(held(row, in_flight_wait))
}

/// The decision after an execution found its key taken at commit: the holder's
/// finished outcome (replayed, or `422`), else in flight. Never "execute": this
/// request's handler has run already, and its transaction rolled back.
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
pub fn after_execution(row: Option<KeySnapshot>, in_flight_wait: Duration) -> Claim {
    match row {
        Some(row) if !row.state.is_finished() || row.live => held(row, in_flight_wait),
        // Gone (purged) or expired since it was found holding the key: the
        // retry decides afresh.
        _ => in_flight(in_flight_wait),
    }
}

/// Of what a key holds after an execution that did not commit: a finished
/// outcome (replayed, or `422`) answers in that execution's place; anything
/// else leaves the execution's own answer standing.
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
pub fn answers_instead(claim: Claim) -> Option<Claim> {
    match claim {
        claim @ (Claim::Replay(_) | Claim::Mismatch) => Some(claim),
        _ => None,
    }
}

/// What a leased claim does, decided under the key's row lock (or, on Redis, in
/// one script).
#[cfg_attr(
    not(any(feature = "sqlite", feature = "mysql", feature = "test-util")),
    allow(dead_code)
)]
#[derive(Debug)]
pub enum LeasedStep {
    /// No row: write one at generation 1.
    Insert,
    /// A finished outcome past its retention: a new execution, at `generation`
    /// (one more than the row's), whatever the fingerprint.
    Reclaim {
        /// The generation the new execution holds (MySQL's claim writes it;
        /// SQLite's computes it in its statement; the oracle test reads it).
        #[cfg_attr(not(any(feature = "mysql", feature = "test-util")), allow(dead_code))]
        generation: i64,
    },
    /// A `processing` row whose lease lapsed (its worker died or stalled): the
    /// execution is taken over at `generation`, which fences the old owner out.
    TakeOver {
        /// The generation the new owner holds (as `Reclaim`'s).
        #[cfg_attr(not(any(feature = "mysql", feature = "test-util")), allow(dead_code))]
        generation: i64,
    },
    /// Answer without acquiring anything: a replay, a mismatch, in flight or
    /// uncertain (never [`LeasedOutcome::Acquired`]).
    Answer(LeasedOutcome),
}

/// How long a claim that found a `processing` row without a lease asks the
/// caller to wait: only a leased claim commits such a row with a lease, so one
/// without was written by hand (or is a claim-first transactional execution);
/// it is left alone.
#[cfg_attr(
    not(any(feature = "sqlite", feature = "mysql", feature = "test-util")),
    allow(dead_code)
)]
const NO_LEASE_RETRY: Duration = Duration::from_secs(1);

/// The leased claim's decision: no row is inserted; a finished outcome past its
/// retention is reclaimed; otherwise another request is `422`; a finished
/// outcome is replayed; an uncertain one is answered as such; a live lease (or
/// none) is in flight for the time it has left; a lapsed lease is taken over.
#[cfg_attr(
    not(any(feature = "sqlite", feature = "mysql", feature = "test-util")),
    allow(dead_code)
)]
pub fn leased(row: Option<KeySnapshot>) -> LeasedStep {
    let Some(row) = row else {
        return LeasedStep::Insert;
    };
    if row.state.is_finished() && !row.live {
        return LeasedStep::Reclaim {
            generation: row.generation + 1,
        };
    }
    if !row.fingerprint_matches {
        return LeasedStep::Answer(LeasedOutcome::Mismatch);
    }
    match (row.state, row.stored) {
        (RowState::Completed | RowState::Failed, Some(stored)) => {
            LeasedStep::Answer(LeasedOutcome::Replay(stored))
        }
        (RowState::Uncertain, _) => LeasedStep::Answer(LeasedOutcome::Uncertain),
        _ => match row.lease_ms_left {
            Some(left) if left > 0 => LeasedStep::Answer(LeasedOutcome::InFlight {
                retry_after: Duration::from_millis(left.unsigned_abs()),
            }),
            Some(_) => LeasedStep::TakeOver {
                generation: row.generation + 1,
            },
            None => LeasedStep::Answer(LeasedOutcome::InFlight {
                retry_after: NO_LEASE_RETRY,
            }),
        },
    }
}

/// A key held by a row that is not to be taken over.
fn held(row: KeySnapshot, in_flight_wait: Duration) -> Claim {
    if !row.fingerprint_matches {
        return Claim::Mismatch;
    }
    match row.stored {
        Some(stored) if row.state.is_finished() => Claim::Replay(stored),
        _ => in_flight(in_flight_wait),
    }
}

fn in_flight(wait: Duration) -> Claim {
    Claim::InFlight {
        retry_after: wait.max(Duration::from_secs(1)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WAIT: Duration = Duration::from_secs(2);

    fn row(state: RowState, live: bool, matches: bool) -> KeySnapshot {
        KeySnapshot {
            fingerprint_matches: matches,
            state,
            generation: 4,
            live,
            stored: (state.is_finished() && live).then(|| StoredResponse {
                status: 201,
                headers: vec![],
                body: "done".into(),
            }),
            lease_ms_left: None,
        }
    }

    fn leased_row(lease_ms_left: Option<i64>, matches: bool) -> KeySnapshot {
        row(RowState::Processing, true, matches).with_lease(lease_ms_left)
    }

    #[test]
    fn a_leased_claim_inserts_where_there_is_no_row() {
        assert!(matches!(leased(None), LeasedStep::Insert));
    }

    #[test]
    fn a_leased_claim_reclaims_an_expired_outcome_whatever_the_fingerprint() {
        for state in [RowState::Completed, RowState::Failed] {
            for matches in [true, false] {
                assert!(matches!(
                    leased(Some(row(state, false, matches))),
                    LeasedStep::Reclaim { generation: 5 }
                ));
            }
        }
    }

    #[test]
    fn a_leased_claim_replays_a_live_outcome_and_refuses_another_request() {
        for state in [RowState::Completed, RowState::Failed] {
            match leased(Some(row(state, true, true))) {
                LeasedStep::Answer(LeasedOutcome::Replay(s)) => assert_eq!(s.body, "done"),
                other => panic!("{state:?}: {other:?}"),
            }
            assert!(matches!(
                leased(Some(row(state, true, false))),
                LeasedStep::Answer(LeasedOutcome::Mismatch)
            ));
        }
    }

    #[test]
    fn a_leased_claim_answers_uncertain_live_or_not_and_mismatch_first() {
        for live in [true, false] {
            assert!(matches!(
                leased(Some(row(RowState::Uncertain, live, true))),
                LeasedStep::Answer(LeasedOutcome::Uncertain)
            ));
            assert!(matches!(
                leased(Some(row(RowState::Uncertain, live, false))),
                LeasedStep::Answer(LeasedOutcome::Mismatch)
            ));
        }
    }

    #[test]
    fn a_live_lease_is_in_flight_for_the_time_it_has_left() {
        match leased(Some(leased_row(Some(1500), true))) {
            LeasedStep::Answer(LeasedOutcome::InFlight { retry_after }) => {
                assert_eq!(retry_after, Duration::from_millis(1500))
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            leased(Some(leased_row(Some(1500), false))),
            LeasedStep::Answer(LeasedOutcome::Mismatch)
        ));
    }

    #[test]
    fn a_lapsed_lease_is_taken_over_one_generation_on_but_not_by_another_request() {
        for left in [0, -1, -60_000] {
            assert!(matches!(
                leased(Some(leased_row(Some(left), true))),
                LeasedStep::TakeOver { generation: 5 }
            ));
            assert!(matches!(
                leased(Some(leased_row(Some(left), false))),
                LeasedStep::Answer(LeasedOutcome::Mismatch)
            ));
        }
    }

    #[test]
    fn a_processing_row_without_a_lease_is_left_alone() {
        match leased(Some(leased_row(None, true))) {
            LeasedStep::Answer(LeasedOutcome::InFlight { retry_after }) => {
                assert_eq!(retry_after, NO_LEASE_RETRY)
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_key_without_a_row_executes_at_generation_one() {
        assert!(matches!(
            transactional(None, WAIT),
            TransactionalStep::Execute { generation: 1 }
        ));
    }

    /// A request with another fingerprint is refused, whatever the row holds.
    #[track_caller]
    fn another_request_mismatches(state: RowState, live: bool) {
        assert!(matches!(
            transactional(Some(row(state, live, false)), WAIT),
            TransactionalStep::Answer(Claim::Mismatch)
        ));
    }

    #[test]
    fn a_finished_live_outcome_replays_for_the_same_request_and_refuses_another() {
        for state in [RowState::Completed, RowState::Failed] {
            match transactional(Some(row(state, true, true)), WAIT) {
                TransactionalStep::Answer(Claim::Replay(s)) => assert_eq!(s.body, "done"),
                other => panic!("{state:?}: {other:?}"),
            }
            another_request_mismatches(state, true);
        }
    }

    #[test]
    fn an_expired_outcome_executes_anew_one_generation_on_whatever_the_fingerprint() {
        for matches in [true, false] {
            assert!(matches!(
                transactional(Some(row(RowState::Completed, false, matches)), WAIT),
                TransactionalStep::Execute { generation: 5 }
            ));
        }
    }

    #[test]
    fn a_leased_execution_is_in_flight_or_a_mismatch_and_never_taken_over() {
        for state in [RowState::Processing, RowState::Uncertain] {
            for live in [true, false] {
                match transactional(Some(row(state, live, true)), WAIT) {
                    TransactionalStep::Answer(Claim::InFlight { retry_after }) => {
                        assert_eq!(retry_after, WAIT)
                    }
                    other => panic!("{state:?}: {other:?}"),
                }
                another_request_mismatches(state, live);
            }
        }
    }

    #[test]
    fn in_flight_asks_for_at_least_a_second() {
        match transactional(
            Some(row(RowState::Processing, true, true)),
            Duration::from_millis(10),
        ) {
            TransactionalStep::Answer(Claim::InFlight { retry_after }) => {
                assert_eq!(retry_after, Duration::from_secs(1))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn after_an_execution_the_holders_outcome_is_answered_and_nothing_executes() {
        assert!(matches!(
            after_execution(Some(row(RowState::Completed, true, true)), WAIT),
            Claim::Replay(_)
        ));
        assert!(matches!(
            after_execution(Some(row(RowState::Failed, true, false)), WAIT),
            Claim::Mismatch
        ));
        for gone in [
            None,
            Some(row(RowState::Completed, false, true)),
            Some(row(RowState::Processing, true, true)),
        ] {
            assert!(matches!(
                after_execution(gone, WAIT),
                Claim::InFlight { .. }
            ));
        }
    }

    #[test]
    fn states_parse_and_unknown_ones_are_corrupt() {
        for state in [
            RowState::Processing,
            RowState::Completed,
            RowState::Failed,
            RowState::Uncertain,
        ] {
            assert_eq!(state.as_str().parse::<RowState>().unwrap(), state);
        }
        assert_eq!("failed".parse::<RowState>().unwrap(), RowState::Failed);
        assert!(matches!(
            "done".parse::<RowState>(),
            Err(StoreError::Corrupt(_))
        ));
    }

    #[test]
    fn a_generation_with_no_next_is_corrupt() {
        let request = crate::fingerprint::FingerprintBuilder::new("t", "op", "POST", "/").finish();
        let read = |generation| {
            KeySnapshot::read(
                RowState::Completed,
                request.as_bytes(),
                &request,
                generation,
                false,
                || unreachable!("an expired row's outcome is not read"),
            )
        };
        for generation in [i64::MAX, 0, -1] {
            assert!(
                matches!(read(generation), Err(StoreError::Corrupt(m)) if m.contains("generation")),
                "generation {generation}"
            );
        }
        let step = transactional(Some(read(i64::MAX - 1).unwrap()), Duration::ZERO);
        assert!(matches!(
            step,
            TransactionalStep::Execute {
                generation: i64::MAX
            }
        ));
    }
}
