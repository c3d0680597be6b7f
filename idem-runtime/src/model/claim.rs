//! A transactional claim: what it asks, what it decided, the execution it
//! hands the handler, and the outcome as stored and replayed.

use std::time::Duration;

use bytes::Bytes;

use super::StoreError;
use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, KeyDigest};

/// Everything a claim needs to know.
#[derive(Debug, Clone)]
pub struct ClaimRequest<'a> {
    /// The caller's tenant id (see [`crate::TenantScope`]).
    pub tenant: &'a str,
    /// The operation's stable name, such as `create-order`.
    pub operation: &'a str,
    /// The validated key.
    pub key: &'a IdempotencyKey,
    /// The logical request's fingerprint.
    pub fingerprint: Fingerprint,
    /// How long the key and its outcome are kept after completion: at least
    /// 1 ms (less is refused), at most a century (more is taken as that).
    pub retention: Duration,
    /// How long a duplicate waits for a concurrent first request to finish.
    pub in_flight_wait: Duration,
}

/// What a claim decided. Exactly one of these; nothing else is possible.
#[derive(Debug)]
#[must_use = "a claim that is not acted on leaves the transaction holding the key"]
#[non_exhaustive]
pub enum Claim {
    /// The caller owns the key: run the operation in the same transaction, then
    /// [`Execution::complete`] it and commit.
    Execute(Execution),
    /// The operation already ran with the same fingerprint: answer with this.
    Replay(StoredResponse),
    /// The key was used for a different request (another fingerprint). Nothing ran.
    Mismatch,
    /// Another request with this key is still running. Nothing ran; ask the client
    /// to retry after `retry_after`.
    InFlight {
        /// A hint for the `Retry-After` header.
        retry_after: Duration,
    },
    /// The database stayed locked by other writers for longer than the claim
    /// could wait (SQLite's one write lock, held for another key): the key was
    /// not looked at and nothing ran. Ask the client to retry after
    /// `retry_after`; this says nothing about the key.
    Busy {
        /// A hint for the `Retry-After` header.
        retry_after: Duration,
    },
}

/// Proof that this transaction owns a key. Consumed by [`Execution::complete`].
#[derive(Debug)]
#[must_use = "an execution must be completed before the transaction commits"]
pub struct Execution {
    pub(crate) tenant: String,
    pub(crate) operation: String,
    /// The key's digest: all the completion needs (the key itself stays with
    /// the request).
    pub(crate) key: KeyDigest,
    pub(crate) generation: i64,
    pub(crate) retention: Duration,
    /// The request's fingerprint, which a claim made at commit stores.
    #[cfg_attr(
        not(any(feature = "postgres", feature = "sqlite", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fingerprint: Fingerprint,
    /// How long a claim made at commit waits for another holder of the key.
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) in_flight_wait: Duration,
    /// Whether the key is claimed by the completion itself (the PostgreSQL and
    /// MySQL handler paths) rather than by a row written before the handler ran.
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) at_commit: bool,
    /// Whether its transaction began with idem's statements prepared in the
    /// session (PostgreSQL), so that its finished row rides with `COMMIT`.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) in_session: bool,
    /// When the execution began, in Unix milliseconds on the database's clock
    /// (SQLite's handler path, which writes `created_at` only at commit).
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub(crate) started_ms: i64,
    /// What [`Execution::complete`] seals the outcome with: the key ring a
    /// hand-written claim was given (`claim_with_key_ring`); the handler's
    /// path seals before it completes.
    pub(crate) ring: Option<crate::at_rest::KeyRing>,
}

impl Execution {
    /// A completion that wrote `rows` rows: stored when it wrote this
    /// execution's claim row, lost when the row was no longer its own.
    pub(crate) fn completed(&self, rows: u64) -> Result<(), StoreError> {
        if rows == 1 {
            Ok(())
        } else {
            Err(StoreError::LostClaim {
                generation: self.generation,
            })
        }
    }

    /// The execution of `req` at `generation`, whose claim row exists.
    pub(crate) fn new(req: &ClaimRequest<'_>, generation: i64) -> Self {
        Execution {
            tenant: req.tenant.to_owned(),
            operation: req.operation.to_owned(),
            key: req.key.digest(),
            generation,
            retention: req.retention,
            fingerprint: req.fingerprint,
            in_flight_wait: req.in_flight_wait,
            at_commit: false,
            in_session: false,
            started_ms: 0,
            ring: None,
        }
    }

    /// The execution of `req` at `generation`, whose key is claimed by its
    /// completion.
    #[cfg_attr(
        not(any(feature = "postgres", feature = "sqlite", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fn at_commit(req: &ClaimRequest<'_>, generation: i64) -> Self {
        Execution {
            at_commit: true,
            ..Execution::new(req, generation)
        }
    }

    /// The execution's generation: 1 for a new key, one more each time an expired
    /// key is executed anew.
    pub fn generation(&self) -> i64 {
        self.generation
    }

    /// The row this execution writes, which a sealed answer is bound to.
    pub(crate) fn row_id(&self) -> crate::at_rest::RowId<'_> {
        crate::at_rest::RowId {
            tenant: &self.tenant,
            operation: &self.operation,
            key: &self.key,
            generation: self.generation,
        }
    }
}

/// An outcome as stored and replayed: status, allow-listed headers and body.
///
/// ```
/// use idem_runtime::StoredResponse;
///
/// let declined = StoredResponse { status: 402, headers: vec![], body: "declined".into() };
/// assert_eq!(declined.state(), "failed"); // a 4xx is stored as `failed`, and replayed alike
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The HTTP status code.
    pub status: u16,
    /// Header names (lower case) and values, in response order.
    pub headers: Vec<(String, String)>,
    /// The body bytes, exactly as first sent.
    pub body: Bytes,
}

impl StoredResponse {
    /// Whether this outcome is stored as `failed` (4xx) rather than `completed`.
    pub fn is_failure(&self) -> bool {
        self.status >= 400
    }

    /// The row state this outcome is stored under: `failed` for a 4xx, else
    /// `completed`.
    pub fn state(&self) -> &'static str {
        if self.is_failure() {
            "failed"
        } else {
            "completed"
        }
    }
}

/// How the handler's path ended a transaction: stored and committed, or not.
#[doc(hidden)]
#[derive(Debug)]
pub enum Finish {
    /// Stored and committed.
    Committed,
    /// Nothing was committed: neither the effect nor its record.
    NotStored(StoreError),
    /// The commit may or may not have happened (the connection failed on the way);
    /// a retry with the same key replays or executes, either way safely.
    Unknown(StoreError),
    /// Nothing was committed: another execution holds the key (its key was to be
    /// claimed at commit). The request answers this instead of its own outcome.
    Taken(Claim),
    /// Nothing was committed, and another execution holds the key, or may
    /// (the handler's statement may have failed on its row), but what it holds
    /// could not be read: the request's own answer could contradict it, so
    /// the answer is that the outcome is unknown, and a retry with the same
    /// key learns it.
    Overtaken(StoreError),
}
