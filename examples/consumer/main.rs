//! `consumer`: applies ledger credits from NATS JetStream to PostgreSQL exactly
//! once, with `idem_runtime::consumer::process_once`.
//!
//! JetStream delivers at least once. Each message's identity (its `Nats-Msg-Id`
//! header, else its stream, the stream's creation time and its sequence) is claimed in the same transaction as the
//! credit, and the message is acked only after that transaction committed:
//!
//! * crash before commit: nothing committed; JetStream redelivers after `ack_wait`
//!   and the credit is applied then;
//! * crash after commit, before ack (or a lost ack): the redelivery is recognised
//!   as a duplicate, nothing is applied again, and it is acked;
//! * the same identity with a different payload: not applied, terminated (no more
//!   redeliveries) and logged as an error;
//! * a malformed payload: terminated without reserving anything;
//! * any other failure (the store, a lost connection, a deadlock, a refusal
//!   before the limit) or a concurrent delivery still running: nacked with a
//!   delay (`CONSUMER_RETRY_DELAY_MS`), and redelivered, however often: the
//!   durable has no `max_deliver`, so JetStream never drops a message this
//!   consumer did not settle (a database outage of any length loses nothing);
//! * an effect the database refuses (a data exception, a constraint, an
//!   exception a trigger raised: SQLSTATE 22, 23 or P0001 from the credit's own
//!   statements) on delivery `CONSUMER_DELIVERY_LIMIT` or later: a poison
//!   message, published to the dead-letter subject (its stream `<stream>_DEAD`
//!   is created at start) with its headers (JetStream's `Nats-*` directives
//!   left out, its `Nats-Msg-Id` kept) and the error in `Idem-Error`, then
//!   terminated and logged as an error; never applied. Where that publish
//!   fails, the message is nacked, as above, and dead-lettered on a later try.
//!
//! Before any of this, JetStream drops a message published with a `Nats-Msg-Id`
//! the stream already stored within its duplicate window (`duplicate_window`,
//! left here at the server's default, two minutes), whatever its payload: such a
//! re-publish is never delivered, so idem sees only redeliveries and re-publishes
//! after the window.
//!
//! Environment:
//!
//! | variable | default | meaning |
//! | --- | --- | --- |
//! | `DATABASE_URL` | `postgres://postgres@127.0.0.1:5432/postgres` | the database |
//! | `NATS_URL` | `nats://127.0.0.1:4222` | the NATS server (JetStream enabled) |
//! | `CONSUMER_STREAM` | `LEDGER` | the stream, created if missing |
//! | `CONSUMER_SUBJECT` | `ledger.credits` | the subject it holds |
//! | `CONSUMER_DURABLE` | `ledger-worker` | the durable pull consumer; also the idempotency scope |
//! | `CONSUMER_ACK_WAIT_MS` | `30000` | JetStream's redelivery timeout |
//! | `CONSUMER_RETRY_DELAY_MS` | `1000` | how long a failed delivery waits before its redelivery |
//! | `CONSUMER_DELIVERY_LIMIT` | `20` | the delivery from which an effect the database refuses is dead-lettered (at least 1) |
//! | `CONSUMER_DEAD_LETTER_SUBJECT` | `<subject>.dead` | where poison messages go |
//! | `CONSUMER_CRASH_AFTER_COMMIT` | `0` | test aid: exit right after the N-th commit, before acking it |
//!
//! A message is JSON: `{"account": "acct-1", "amount_cents": 500}`.

use std::time::Duration;

use async_nats::jetstream::{self, AckKind, consumer::pull, stream};
use futures_util::StreamExt;
#[path = "../shared/ledger.rs"]
mod ledger;

use idem_runtime::consumer::{ConsumeError, Delivery};
use ledger::{Credit, env, env_u64};

/// Longer than JetStream keeps or redelivers a message here.
const RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

async fn run() -> Result<(), String> {
    let nats_url = env("NATS_URL", "nats://127.0.0.1:4222");
    let stream_name = env("CONSUMER_STREAM", "LEDGER");
    let subject = env("CONSUMER_SUBJECT", "ledger.credits");
    let durable = env("CONSUMER_DURABLE", "ledger-worker");
    let ack_wait = Duration::from_millis(env_u64("CONSUMER_ACK_WAIT_MS", 30_000)?);
    let retry_delay = Duration::from_millis(env_u64("CONSUMER_RETRY_DELAY_MS", 1000)?);
    // Compared with JetStream's delivery count, an i64.
    let delivery_limit = i64::try_from(env_u64("CONSUMER_DELIVERY_LIMIT", 20)?)
        .ok()
        .filter(|n| *n >= 1)
        .ok_or("CONSUMER_DELIVERY_LIMIT must be a whole number from 1")?;
    let dead_subject = env("CONSUMER_DEAD_LETTER_SUBJECT", &format!("{subject}.dead"));
    let crash_after = env_u64("CONSUMER_CRASH_AFTER_COMMIT", 0)?;

    let pool = ledger::connect().await?;

    let client = async_nats::connect(&nats_url)
        .await
        .map_err(|e| format!("cannot connect to NATS_URL: {e}"))?;
    let js = jetstream::new(client);
    // Shorter than RETENTION: a message is never delivered after its key has
    // been forgotten (a replay from the start included).
    let max_age = RETENTION - Duration::from_secs(24 * 3600);
    let stream = js
        .get_or_create_stream(stream::Config {
            name: stream_name.clone(),
            subjects: vec![subject.clone()],
            max_age,
            ..Default::default()
        })
        .await
        .map_err(|e| format!("cannot create the stream {stream_name}: {e}"))?;
    // A stream that was there already keeps its own settings. One made
    // without a max age, or a longer one (by an operator, or an earlier
    // version of this example), could deliver a credit again after its key
    // is forgotten (a durable recreated replays from the start): refused.
    // Not changed here: a shorter max age drops the messages past it at
    // once, unconsumed credits included, which is the operator's call.
    let kept = stream.cached_info().config.max_age;
    if kept.is_zero() || kept > max_age {
        let days = |d: Duration| d.as_secs() / 86400;
        let kept = if kept.is_zero() {
            "for ever".to_owned()
        } else {
            format!("{} s", kept.as_secs())
        };
        let (retention, most) = (days(RETENTION), days(max_age));
        return Err(format!(
            "the stream {stream_name} keeps messages {kept}, longer than the keys' retention \
             ({retention} days) allows: a replay from the start would apply old credits again. \
             Give it a max age of at most {most} days (nats stream edit {stream_name} \
             --max-age {most}d), once its backlog is consumed"
        ));
    }
    let dead_stream = format!("{stream_name}_DEAD");
    js.get_or_create_stream(stream::Config {
        name: dead_stream.clone(),
        subjects: vec![dead_subject.clone()],
        ..Default::default()
    })
    .await
    .map_err(|e| format!("cannot create the dead-letter stream {dead_stream}: {e}"))?;
    let consumer: jetstream::consumer::PullConsumer = stream
        // Created, or updated where it exists: a durable made by an earlier
        // version of this example has `max_deliver: 20`.
        .create_consumer(pull::Config {
            durable_name: Some(durable.clone()),
            ack_wait,
            // No limit: JetStream would drop a message past it, with nothing
            // but an advisory; this consumer dead-letters what keeps failing
            // itself, and retries the rest for as long as it takes.
            max_deliver: -1,
            ..Default::default()
        })
        .await
        .map_err(|e| format!("cannot create the consumer {durable}: {e}"))?;
    let stream_created = stream.cached_info().created.unix_timestamp_nanos();
    let mut messages = consumer.messages().await.map_err(|e| e.to_string())?;
    tracing::info!(stream = %stream_name, durable = %durable, "consumer ready");

    let mut commits = 0u64;
    while let Some(next) = messages.next().await {
        let message = match next {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "consumer: receive failed");
                continue;
            }
        };
        let info = message.info().map_err(|e| e.to_string())?;
        // The producer's id when it sent one; else the stream position, which
        // includes the stream's creation time because a recreated stream starts
        // counting again.
        let id = match message
            .headers
            .as_ref()
            .and_then(|h| h.get("Nats-Msg-Id"))
            .map(|v| v.as_str())
            .filter(|v| !v.is_empty())
        {
            Some(producer_id) => format!("msg:{producer_id}"),
            None => format!(
                "seq:{}:{stream_created}:{}",
                info.stream, info.stream_sequence
            ),
        };
        let delivered = info.delivered;
        let credit: Credit = match serde_json::from_slice(&message.payload) {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(error = %e, "consumer: malformed payload; terminated");
                message.ack_with(AckKind::Term).await.ok();
                continue;
            }
        };
        let ack = match ledger::apply(&pool, &durable, &id, &message.payload, &credit, RETENTION)
            .await
        {
            Ok(Delivery::Applied(())) => {
                commits += 1;
                tracing::info!(delivered, "consumer: applied");
                if crash_after > 0 && commits == crash_after {
                    tracing::warn!("consumer: simulated crash after commit, before ack");
                    std::process::exit(3);
                }
                AckKind::Ack
            }
            Ok(Delivery::Duplicate) => {
                tracing::info!(delivered, "consumer: duplicate delivery; already applied");
                AckKind::Ack
            }
            Ok(Delivery::Conflict) => {
                tracing::error!(
                    "consumer: message id reused with another payload; not applied, terminated"
                );
                AckKind::Term
            }
            // An outcome this consumer does not know (Delivery can grow):
            // not acknowledged, so redelivered later.
            Ok(_) => AckKind::Nak(Some(retry_delay)),
            Err(ConsumeError::InFlight) => AckKind::Nak(Some(retry_delay)),
            Err(e) if delivered >= delivery_limit && ledger::refused(&e) => {
                let why = e.to_string();
                match dead_letter(&js, &dead_subject, &message, &why).await {
                    Ok(()) => {
                        tracing::error!(delivered, error = %why, subject = %dead_subject, "consumer: the database refused the credit; dead-lettered, not applied");
                        AckKind::Term
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "consumer: dead-lettering failed; will be redelivered");
                        AckKind::Nak(Some(retry_delay))
                    }
                }
            }
            Err(e) => {
                tracing::warn!(delivered, error = %e, "consumer: not applied; will be redelivered");
                AckKind::Nak(Some(retry_delay))
            }
        };
        if let Err(e) = message.ack_with(ack).await {
            // The effect is committed; a redelivery will be recognised.
            tracing::warn!(error = %e, "consumer: ack failed");
        }
    }
    Ok(())
}

/// Publishes `message` (its payload and headers, `Nats-Msg-Id` included, so a
/// second try within the dead-letter stream's window is dropped there) to
/// `subject`, with why in `Idem-Error`, and waits for the stream to store it.
async fn dead_letter(
    js: &jetstream::Context,
    subject: &str,
    message: &jetstream::Message,
    why: &str,
) -> Result<(), String> {
    // Its own headers but JetStream's directives (`Nats-Expected-*` would
    // make every publish to the dead-letter stream fail, `Nats-Rollup` purge
    // it), the producer's id kept.
    let mut headers = async_nats::HeaderMap::new();
    if let Some(own) = &message.headers {
        for (name, values) in own.iter() {
            let name: &str = name.as_ref();
            if name.starts_with("Nats-") && name != "Nats-Msg-Id" {
                continue;
            }
            for value in values {
                headers.append(name, value.as_str());
            }
        }
    }
    // A header value is one line.
    let why: String = why
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    headers.insert("Idem-Error", why.as_str());
    js.publish_with_headers(subject.to_owned(), headers, message.payload.clone())
        .await
        .map_err(|e| e.to_string())?
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    ledger::main_with(run()).await
}
