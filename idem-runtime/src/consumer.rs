//! Exactly-once effects for message consumers.
//!
//! Brokers deliver at least once: a message is redelivered when its ack is lost,
//! when the consumer crashes before acking, or when it is nacked. [`process_once`]
//! claims the message's identity in the same transaction as the message's effect,
//! so the effect and the record that it happened commit together:
//!
//! * first delivery: the effect runs and commits with the key → [`Delivery::Applied`]; ack.
//! * redelivery after a commit (lost ack, crash before ack) → [`Delivery::Duplicate`],
//!   the effect does not run; ack again.
//! * the same identity with a different payload → [`Delivery::Conflict`]: reported,
//!   never applied; dead-letter it (terminate) and alert.
//! * the effect fails → nothing commits → nack; the redelivery applies it.
//!   A constraint the database checks only at `COMMIT` (deferred) fails there,
//!   [`ConsumeError::Commit`], and again on every redelivery: dead-letter it.
//! * a concurrent delivery of the same message still running → [`ConsumeError::InFlight`]:
//!   nack with a delay; the redelivery sees the outcome.
//!
//! It works on a PostgreSQL, SQLite or MySQL / MariaDB pool (the effect's
//! transaction is of the pool's database).
//!
//! ```no_run
//! use std::time::Duration;
//! use idem_runtime::consumer::{process_once, Delivery, Message};
//!
//! # #[cfg(feature = "postgres")] // the example's pool is PostgreSQL's
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let msg = Message { scope: "billing", operation: "credit-account", id: "evt-42", payload: br#"{"amount":5}"# };
//! let result = process_once(&pool, &msg, Duration::from_secs(7 * 86400), |tx| Box::pin(async move {
//!     sqlx::query("UPDATE accounts SET balance = balance + 5 WHERE id = 1").execute(&mut **tx).await?;
//!     Ok::<_, sqlx::Error>(())
//! })).await?;
//! match result {
//!     Delivery::Applied(()) | Delivery::Duplicate => { /* ack */ }
//!     Delivery::Conflict => { /* terminate and alert */ }
//!     // `Delivery` can grow: an outcome this consumer does not know is left
//!     // unacknowledged, to be redelivered.
//!     _ => { /* nack */ }
//! }
//! # Ok(()) }
//! ```

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use sha2::{Digest, Sha256};
use sqlx::{Pool, Transaction};

use crate::db::Backend;
use crate::fingerprint::FingerprintBuilder;
use crate::key::IdempotencyKey;
use crate::model::{Claim, ClaimRequest, StoreError};
use crate::store;

/// One delivered message.
#[derive(Debug, Clone, Copy)]
pub struct Message<'a> {
    /// Whose message: a tenant, or the consumer group (keys are scoped by it).
    pub scope: &'a str,
    /// What consuming it does, such as `credit-account`.
    pub operation: &'a str,
    /// The message's identity, the same on every delivery of the message and
    /// never given to another: the producer's message id (for NATS,
    /// `Nats-Msg-Id`), or the broker's position of the message qualified by
    /// what it counts in, `stream:<name>:<created>:<stream sequence>` or
    /// `kafka:<topic id>:<partition>:<offset>`: a stream or topic created again
    /// counts from 1 again, and a bare sequence would then make a new message a
    /// duplicate (same payload, acked unapplied) or a conflict. Never a
    /// per-delivery counter (JetStream's consumer sequence, AMQP's
    /// `delivery_tag`): it changes on redelivery. Tag the kinds apart (`msg:…`,
    /// `stream:…`) so they cannot collide. It is stored as its SHA-256, so any
    /// string will do.
    pub id: &'a str,
    /// The payload bytes: a different payload under the same id is a conflict.
    pub payload: &'a [u8],
}

/// What happened to a delivery.
#[derive(Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Delivery<T> {
    /// The effect ran and committed now.
    Applied(T),
    /// The effect had already committed for this message: nothing ran. Ack it.
    Duplicate,
    /// This id was already used by a message with another payload: nothing ran.
    Conflict,
}

/// Why a delivery was not processed: nack it. Nothing committed, unless the
/// connection was lost during `COMMIT` ([`ConsumeError::Commit`]), when the
/// redelivery finds the message applied ([`Delivery::Duplicate`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumeError<E> {
    /// Another delivery of the same message is being processed right now.
    #[error("another delivery of this message is being processed; retry it later")]
    InFlight,
    /// The database stayed locked by other writers (SQLite's one write lock)
    /// longer than the claim could wait: nothing was applied; retry it later.
    #[error("the database is busy with other writers; retry the message later")]
    Busy,
    /// The effect failed; its transaction was rolled back.
    #[error("the effect failed: {0}")]
    Effect(E),
    /// The transaction's `COMMIT` failed. Either the database refused what
    /// the effect wrote at commit (a constraint declared `DEFERRABLE
    /// INITIALLY DEFERRED`, a constraint trigger: the effect's refusal, as
    /// [`ConsumeError::Effect`] is, and nothing committed), or the connection
    /// was lost during it (the transaction may have committed: the
    /// redelivery then finds it applied).
    #[error("the commit failed: {0}")]
    Commit(sqlx::Error),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The effect of a message, run in the transaction that records it.
pub type Effect<'t, T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send + 't>>;

/// The key a message id is stored under: always its SHA-256 in hex, so that no
/// two ids share a key (a key parser would trim spaces and unquote `"x"`).
pub fn message_key(id: &str) -> IdempotencyKey {
    let mut h = Sha256::new();
    h.update(b"idem-message-v1\0");
    h.update(id.as_bytes());
    IdempotencyKey::parse(hex::encode(h.finalize())).expect("hex is a valid key")
}

/// Runs `effect` at most once for the message's scope, operation and id, in one
/// transaction with the record of it; see the module docs for what to do with
/// each answer. `retention` is how long redeliveries are recognised: make it
/// longer than the broker can deliver the message again (the stream's or
/// queue's max age, the longest backlog it may hold, a replay from the start),
/// never just its duplicate window, which ends long before redeliveries and
/// re-publishes do.
///
/// # Errors
///
/// [`ConsumeError`]: the message should be redelivered. Nothing committed,
/// unless the connection was lost during `COMMIT` ([`ConsumeError::Commit`]):
/// the redelivery then finds it applied.
pub async fn process_once<DB, T, E, F>(
    pool: &Pool<DB>,
    msg: &Message<'_>,
    retention: Duration,
    effect: F,
) -> Result<Delivery<T>, ConsumeError<E>>
where
    DB: Backend,
    F: for<'t> FnOnce(&'t mut Transaction<'static, DB>) -> Effect<'t, T, E>,
{
    let key = message_key(msg.id);
    let req = ClaimRequest {
        tenant: msg.scope,
        operation: msg.operation,
        key: &key,
        fingerprint: FingerprintBuilder::new(msg.scope, msg.operation, "MESSAGE", "")
            .extra("payload", msg.payload)
            .finish(),
        retention,
        in_flight_wait: Duration::from_secs(2),
    };
    let mut tx = DB::begin(pool).await.map_err(StoreError::from)?;
    // The stored record is never read: a redelivery is a duplicate whatever
    // its record holds, even sealed with a key this process lacks.
    let execution = match store::claim_answer_unread(&mut tx, &req).await? {
        Claim::Execute(e) => e,
        Claim::Replay(_) => return Ok(Delivery::Duplicate),
        Claim::Mismatch => {
            tracing::warn!(
                operation = msg.operation,
                "idem: message id reused with another payload; not applied"
            );
            return Ok(Delivery::Conflict);
        }
        Claim::InFlight { .. } => return Err(ConsumeError::InFlight),
        Claim::Busy { .. } => return Err(ConsumeError::Busy),
    };
    let value = effect(&mut tx).await.map_err(ConsumeError::Effect)?;
    // Marked as a message's record: a rekey leaves it in clear, as it holds
    // nothing, where it would refuse an answer in clear.
    execution
        .complete(&mut tx, &crate::at_rest::message_record())
        .await?;
    tx.commit().await.map_err(ConsumeError::Commit)?;
    Ok(Delivery::Applied(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_id_has_a_key_of_its_own() {
        let long = "x".repeat(300);
        assert_eq!(message_key(&long).as_str().len(), 64);
        assert_eq!(message_key("evt-1"), message_key("evt-1"));
        for (a, b) in [("a b", "a  b"), ("x", "\"x\""), (" x", "x"), ("", " ")] {
            assert_ne!(message_key(a), message_key(b), "{a:?} vs {b:?}");
        }
    }
}
