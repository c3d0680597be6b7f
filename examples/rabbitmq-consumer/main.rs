//! `rabbitmq-consumer`: applies ledger credits from a RabbitMQ queue to PostgreSQL
//! exactly once, with `idem_runtime::consumer::process_once` (the JetStream
//! example's twin, on the same tables).
//!
//! RabbitMQ delivers at least once. Each message's identity, its AMQP
//! `message_id` property (the publisher sets it, and sets the same one when it
//! retries), is claimed in the same transaction as the credit, and the message
//! is acked only after that transaction committed:
//!
//! * crash before commit: nothing committed; the broker requeues the unacked
//!   message when the connection drops, and the credit is applied then;
//! * crash after commit, before ack (or a lost ack): the redelivery is recognised
//!   as a duplicate, nothing is applied again, and it is acked;
//! * no `message_id`, a malformed payload, or the same `message_id` with another
//!   payload: nothing is applied, and the message is rejected without requeue,
//!   which dead-letters it (a message without an identity cannot be told from its
//!   redelivery, so applying it would risk applying it twice);
//! * an effect the database refuses (a data exception, a constraint, an
//!   exception a trigger raised: SQLSTATE 22, 23 or P0001): rejected with
//!   requeue after `CONSUMER_RETRY_DELAY_MS`. A message refused every time (a
//!   poison message) is dead-lettered by the broker after its first delivery
//!   and `CONSUMER_DELIVERY_LIMIT` redeliveries have failed (a requeue after a
//!   crash counts as a failed delivery too);
//! * any other failure (the store, a lost connection, a deadlock), or a
//!   concurrent delivery of the same message still running: nacked with
//!   requeue after the same delay. RabbitMQ 4.3 and later
//!   count a `basic.reject` against the limit but not a `basic.nack`, so there
//!   an outage of the database dead-letters nothing; earlier versions count
//!   both.
//!
//! The queue is a quorum queue: RabbitMQ counts its deliveries (the
//! `x-delivery-count` header) and enforces `x-delivery-limit`, dead-lettering
//! through the default exchange to the dead-letter queue. Both queues are
//! declared at start; an existing queue declared with other arguments is an error
//! (`PRECONDITION_FAILED`): delete it or keep its settings.
//!
//! Environment:
//!
//! | variable | default | meaning |
//! | --- | --- | --- |
//! | `DATABASE_URL` | `postgres://postgres@127.0.0.1:5432/postgres` | the database |
//! | `AMQP_URL` | `amqp://guest:guest@127.0.0.1:5672/%2f` | the broker |
//! | `CONSUMER_QUEUE` | `ledger.credits` | the queue; also the idempotency scope |
//! | `CONSUMER_DEAD_LETTER_QUEUE` | `<queue>.dead` | where rejected and poison messages go |
//! | `CONSUMER_DELIVERY_LIMIT` | `5` | redeliveries allowed before a message is dead-lettered |
//! | `CONSUMER_RETRY_DELAY_MS` | `1000` | how long a failed delivery waits before its requeue |
//! | `CONSUMER_PREFETCH` | `16` | unacked messages the broker sends ahead |
//! | `CONSUMER_CRASH_AFTER_COMMIT` | `0` | test aid: exit right after the N-th commit, before acking it |
//!
//! A message is JSON: `{"account": "acct-1", "amount_cents": 500}`, with a
//! `message_id` property.

use std::time::Duration;

use futures_util::StreamExt;
#[path = "../shared/ledger.rs"]
mod ledger;

use idem_runtime::consumer::Delivery;
use lapin::message::Delivery as AmqpDelivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions, BasicRejectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};
use ledger::{Credit, env, env_u64};

/// How long a message id is remembered: longer than a message waits in the
/// queue here. RabbitMQ has no bound of its own (no message TTL is set): a
/// message requeued after its key was swept would be applied again.
const RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// The quorum queue's arguments: the broker counts deliveries and dead-letters a
/// message past the limit, and every rejected message, to `dead_letter_queue`.
fn queue_arguments(dead_letter_queue: &str, delivery_limit: u64) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    args.insert(
        "x-delivery-limit".into(),
        AMQPValue::LongLongInt(i64::try_from(delivery_limit).unwrap_or(i64::MAX)),
    );
    // The default exchange routes by queue name: no exchange to declare or delete.
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString("".into()),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(dead_letter_queue.into()),
    );
    args
}

/// The broker's count of earlier deliveries (`x-delivery-count`, set by quorum
/// queues on redeliveries), for the logs.
fn earlier_deliveries(delivery: &AmqpDelivery) -> i64 {
    let Some(headers) = delivery.properties.headers() else {
        return 0;
    };
    match headers.inner().get("x-delivery-count") {
        Some(AMQPValue::LongLongInt(n)) => *n,
        Some(AMQPValue::LongInt(n)) => (*n).into(),
        Some(AMQPValue::LongUInt(n)) => (*n).into(),
        _ => 0,
    }
}

/// What to tell the broker about a delivery.
enum Answer {
    Ack,
    /// Dead-letter it: nothing was applied and a redelivery cannot change that.
    Reject,
    /// Requeue it after the retry delay: nothing was applied, and a later
    /// delivery may succeed. `counted`: with `basic.reject`, which counts
    /// against `x-delivery-limit` on every RabbitMQ version (the database
    /// refused the credit: a poison message is dead-lettered at the limit); else with
    /// `basic.nack`, which RabbitMQ 4.3 and later do not count (the store
    /// failed, or the message is in flight elsewhere: an outage dead-letters
    /// nothing there; earlier versions count both).
    Retry {
        counted: bool,
    },
}

async fn run() -> Result<(), String> {
    let amqp_url = env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f");
    let queue = env("CONSUMER_QUEUE", "ledger.credits");
    let dead_letter_queue = env("CONSUMER_DEAD_LETTER_QUEUE", &format!("{queue}.dead"));
    let delivery_limit = env_u64("CONSUMER_DELIVERY_LIMIT", 5)?;
    let retry_delay = Duration::from_millis(env_u64("CONSUMER_RETRY_DELAY_MS", 1000)?);
    let prefetch = u16::try_from(env_u64("CONSUMER_PREFETCH", 16)?)
        .map_err(|_| "CONSUMER_PREFETCH must be at most 65535".to_owned())?;
    let crash_after = env_u64("CONSUMER_CRASH_AFTER_COMMIT", 0)?;

    let pool = ledger::connect().await?;

    let connection = Connection::connect(&amqp_url, ConnectionProperties::default())
        .await
        .map_err(|e| format!("cannot connect to AMQP_URL: {e}"))?;
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| format!("cannot open a channel: {e}"))?;
    let durable = QueueDeclareOptions::durable();
    let mut dead_letter_args = FieldTable::default();
    dead_letter_args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    channel
        .queue_declare(dead_letter_queue.as_str().into(), durable, dead_letter_args)
        .await
        .map_err(|e| format!("cannot declare the queue {dead_letter_queue}: {e}"))?;
    channel
        .queue_declare(
            queue.as_str().into(),
            durable,
            queue_arguments(&dead_letter_queue, delivery_limit),
        )
        .await
        .map_err(|e| format!("cannot declare the queue {queue}: {e}"))?;
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await
        .map_err(|e| format!("basic.qos failed: {e}"))?;
    let mut deliveries = channel
        .basic_consume(
            queue.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| format!("cannot consume from {queue}: {e}"))?;
    tracing::info!(queue = %queue, dead_letter_queue = %dead_letter_queue, "consumer ready");

    let mut commits = 0u64;
    while let Some(next) = deliveries.next().await {
        let delivery = next.map_err(|e| format!("the broker connection failed: {e}"))?;
        let attempt = earlier_deliveries(&delivery) + 1;
        let message_id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.as_str().to_owned())
            .filter(|id| !id.is_empty());
        let answer = match message_id {
            None => {
                tracing::error!(
                    attempt,
                    "consumer: no message_id; dead-lettered, not applied"
                );
                Answer::Reject
            }
            Some(message_id) => match serde_json::from_slice::<Credit>(&delivery.data) {
                Err(e) => {
                    tracing::error!(id = %message_id, error = %e, "consumer: malformed payload; dead-lettered, not applied");
                    Answer::Reject
                }
                Ok(credit) => {
                    // Tagged, as the JetStream example tags its kinds of identity.
                    let id = format!("msg:{message_id}");
                    match ledger::apply(&pool, &queue, &id, &delivery.data, &credit, RETENTION)
                        .await
                    {
                        Ok(Delivery::Applied(())) => {
                            commits += 1;
                            tracing::info!(attempt, id = %message_id, "consumer: applied");
                            if crash_after > 0 && commits == crash_after {
                                tracing::warn!(
                                    "consumer: simulated crash after commit, before ack"
                                );
                                std::process::exit(3);
                            }
                            Answer::Ack
                        }
                        Ok(Delivery::Duplicate) => {
                            tracing::info!(attempt, id = %message_id, "consumer: duplicate; already applied");
                            Answer::Ack
                        }
                        Ok(Delivery::Conflict) => {
                            tracing::error!(attempt, id = %message_id, "consumer: message_id reused with another payload; dead-lettered, not applied");
                            Answer::Reject
                        }
                        // An outcome this consumer does not know (Delivery can
                        // grow): redelivered later rather than acknowledged.
                        Ok(_) => Answer::Retry { counted: false },
                        Err(e) => {
                            tracing::warn!(attempt, id = %message_id, error = %e, "consumer: not applied; to be redelivered");
                            Answer::Retry {
                                counted: ledger::refused(&e),
                            }
                        }
                    }
                }
            },
        };
        let acker = delivery.acker;
        match answer {
            Answer::Ack => {
                if let Err(e) = acker.ack(BasicAckOptions::default()).await {
                    // The effect is committed; the redelivery will be recognised.
                    tracing::warn!(error = %e, "consumer: ack failed");
                }
            }
            Answer::Reject => {
                if let Err(e) = acker.reject(BasicRejectOptions { requeue: false }).await {
                    tracing::warn!(error = %e, "consumer: reject failed");
                }
            }
            Answer::Retry { counted } => {
                // Off the loop, so that other messages go on meanwhile; the message
                // stays unacked (and counts against the prefetch) until then.
                tokio::spawn(async move {
                    tokio::time::sleep(retry_delay).await;
                    let requeued = if counted {
                        acker.reject(BasicRejectOptions { requeue: true }).await
                    } else {
                        let requeue = BasicNackOptions {
                            multiple: false,
                            requeue: true,
                        };
                        acker.nack(requeue).await
                    };
                    if let Err(e) = requeued {
                        tracing::warn!(error = %e, "consumer: requeue failed");
                    }
                });
            }
        }
    }
    Err("the broker cancelled the consumer".to_owned())
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    ledger::main_with(run()).await
}
