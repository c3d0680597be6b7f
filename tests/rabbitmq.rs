//! The `rabbitmq-consumer` example process against a real RabbitMQ (quorum
//! queues, dead-lettering) and PostgreSQL: a crash between commit and ack, a
//! poison message, and the messages it must refuse. Behind the root package's
//! feature `rabbitmq` (lapin), as the example is: `cargo test --features rabbitmq
//! --test rabbitmq`.

mod common;

use std::process::Stdio;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::TestDb;
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// Generous: the machine may be slow, and nothing here waits for a timeout.
const PATIENCE: Duration = Duration::from_secs(60);

fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

static QUEUES: AtomicU32 = AtomicU32::new(0);

/// The test's queues (named apart from every other test's) and a publishing
/// channel with publisher confirms.
struct Broker {
    _connection: Connection,
    channel: Channel,
    queue: String,
    dead_letter_queue: String,
}

/// A message as it sits in the dead-letter queue.
struct DeadLetter {
    message_id: Option<String>,
    payload: Vec<u8>,
    /// Why it was dead-lettered: `rejected`, `delivery_limit`...
    reason: String,
}

impl Broker {
    async fn new() -> Broker {
        let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .expect(
                "RabbitMQ must run on 127.0.0.1:5672, guest/guest (see README: running the tests)",
            );
        let channel = connection.create_channel().await.unwrap();
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let n = QUEUES.fetch_add(1, Ordering::Relaxed);
        let queue = format!("idem.t{}x{n}.credits", std::process::id());
        Broker {
            _connection: connection,
            channel,
            dead_letter_queue: format!("{queue}.dead"),
            queue,
        }
    }

    /// Publishes a persistent message to the queue and waits for the broker's confirm.
    async fn publish(&self, message_id: Option<&str>, payload: &str) {
        let mut props = BasicProperties::default().with_delivery_mode(2);
        if let Some(id) = message_id {
            props = props.with_message_id(id.into());
        }
        let confirm = self
            .channel
            .basic_publish(
                "".into(),
                self.queue.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                payload.as_bytes(),
                props,
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(confirm.is_ack(), "the broker refused the message");
        // `mandatory`: a message no queue took comes back instead of vanishing.
        assert!(
            confirm.take_message().is_none(),
            "no queue took the message"
        );
    }

    /// Waits for the next message in the dead-letter queue and acks it.
    async fn next_dead_letter(&self) -> DeadLetter {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let got = self
                .channel
                .basic_get(
                    self.dead_letter_queue.as_str().into(),
                    BasicGetOptions::default(),
                )
                .await
                .unwrap();
            if let Some(msg) = got {
                let msg = msg.delivery;
                msg.acker.ack(BasicAckOptions::default()).await.unwrap();
                return DeadLetter {
                    message_id: msg.properties.message_id().as_ref().map(|s| s.to_string()),
                    payload: msg.data,
                    reason: death_reason(msg.properties.headers()),
                };
            }
            assert!(Instant::now() < deadline, "nothing was dead-lettered");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// How many messages wait in a queue, unacked ones not counted.
    async fn ready(&self, queue: &str) -> u32 {
        let options = lapin::options::QueueDeclareOptions::durable().passive();
        self.channel
            .queue_declare(queue.into(), options, FieldTable::default())
            .await
            .unwrap()
            .message_count()
    }

    /// Deletes the test's queues (not in Drop: that cannot await).
    async fn delete(self) {
        for q in [&self.queue, &self.dead_letter_queue] {
            self.channel
                .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await
                .ok();
        }
    }
}

/// The `reason` of the first `x-death` entry RabbitMQ adds when it dead-letters.
fn death_reason(headers: &Option<FieldTable>) -> String {
    let deaths = headers.as_ref().and_then(|h| h.inner().get("x-death"));
    let Some(AMQPValue::FieldArray(deaths)) = deaths else {
        return String::new();
    };
    match deaths.as_slice().first() {
        Some(AMQPValue::FieldTable(death)) => match death.inner().get("reason") {
            Some(AMQPValue::LongString(s)) => s.to_string(),
            Some(AMQPValue::ShortString(s)) => s.to_string(),
            _ => String::new(),
        },
        _ => String::new(),
    }
}

/// The consumer process and the lines it logged so far.
struct Consumer {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Consumer {
    async fn start(db: &TestDb, broker: &Broker, env: &[(&str, &str)]) -> Consumer {
        let mut cmd = Command::new(common::example_binary("rabbitmq-consumer"));
        cmd.env("DATABASE_URL", &db.url)
            .env("AMQP_URL", amqp_url())
            .env("CONSUMER_QUEUE", &broker.queue)
            .env("CONSUMER_DEAD_LETTER_QUEUE", &broker.dead_letter_queue)
            .env("CONSUMER_RETRY_DELAY_MS", "20")
            .env("NO_COLOR", "1")
            .env("RUST_LOG", "info,sqlx=warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
        loop {
            let line = tokio::time::timeout(PATIENCE, out.next_line())
                .await
                .expect("the consumer gets ready within 60 s")
                .unwrap()
                .expect("the consumer exited before it was ready");
            if line.contains("consumer ready") {
                break;
            }
        }
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = out.next_line().await {
                println!("consumer: {line}");
                sink.lock().unwrap().push(line);
            }
        });
        Consumer { child, lines }
    }

    /// How many logged lines say `event` about message `id`.
    fn count(&self, event: &str, id: &str) -> usize {
        let field = format!("id={id}");
        self.lines
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(event) && l.split_whitespace().any(|w| w == field))
            .count()
    }

    /// Waits until it has logged `event` about message `id` `n` times.
    async fn until(&self, event: &str, id: &str, n: usize) {
        let deadline = Instant::now() + PATIENCE;
        while self.count(event, id) < n {
            assert!(
                Instant::now() < deadline,
                "the consumer never logged {event:?} for {id} {n} times"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until the process has exited; its exit code.
    async fn exit_code(&mut self) -> Option<i32> {
        tokio::time::timeout(PATIENCE, self.child.wait())
            .await
            .expect("the consumer exits within 60 s")
            .unwrap()
            .code()
    }
}

async fn ledger_db() -> TestDb {
    TestDb::new().await
}

#[tokio::test]
async fn a_crash_between_commit_and_ack_does_not_apply_the_redelivery_again() {
    let db = ledger_db().await;
    let broker = Broker::new().await;
    let mut first = Consumer::start(&db, &broker, &[("CONSUMER_CRASH_AFTER_COMMIT", "1")]).await;
    broker
        .publish(
            Some("credit-1"),
            r#"{"account":"acct-1","amount_cents":500}"#,
        )
        .await;
    // It commits the credit and dies before acking: the broker requeues it.
    assert_eq!(first.exit_code().await, Some(3));
    assert_eq!(db.count("SELECT count(*) FROM ledger_entries").await, 1);

    // Restarted, it gets the redelivery, recognises it, and acks it.
    let second = Consumer::start(&db, &broker, &[]).await;
    broker
        .publish(
            Some("credit-2"),
            r#"{"account":"acct-1","amount_cents":250}"#,
        )
        .await;
    second.until("consumer: duplicate", "credit-1", 1).await;
    second.until("consumer: applied", "credit-2", 1).await;
    assert_eq!(second.count("consumer: applied", "credit-1"), 0);
    assert_eq!(db.count("SELECT count(*) FROM ledger_entries").await, 2);
    assert_eq!(
        db.count("SELECT balance_cents FROM balances WHERE account = 'acct-1'")
            .await,
        750
    );
    assert_eq!(broker.ready(&broker.dead_letter_queue).await, 0);
    broker.delete().await;
}

#[tokio::test]
async fn a_poison_message_is_dead_lettered_after_the_delivery_limit_and_never_applied() {
    let db = ledger_db().await;
    let broker = Broker::new().await;
    let consumer = Consumer::start(&db, &broker, &[("CONSUMER_DELIVERY_LIMIT", "2")]).await;
    // Valid JSON, but PostgreSQL refuses a NUL in text: the effect fails on
    // every delivery, as a poison message does.
    let poison = r#"{"account":"acct-\u0000","amount_cents":100}"#;
    broker.publish(Some("poison-1"), poison).await;
    broker
        .publish(
            Some("credit-1"),
            r#"{"account":"acct-1","amount_cents":100}"#,
        )
        .await;

    let dead = broker.next_dead_letter().await;
    assert_eq!(dead.message_id.as_deref(), Some("poison-1"));
    assert_eq!(dead.payload, poison.as_bytes());
    assert_eq!(dead.reason, "delivery_limit");
    // The first delivery and one per allowed redelivery, each failing: no more
    // (the log lines come in through their own reader: waited for first).
    consumer.until("consumer: not applied", "poison-1", 3).await;
    assert_eq!(consumer.count("consumer: not applied", "poison-1"), 3);
    consumer.until("consumer: applied", "credit-1", 1).await;
    assert_eq!(consumer.count("consumer: applied", "poison-1"), 0);
    assert_eq!(db.count("SELECT count(*) FROM ledger_entries").await, 1);
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests").await,
        1
    );
    broker.delete().await;
}

#[tokio::test]
async fn messages_without_an_identity_or_reusing_one_are_dead_lettered_not_applied() {
    let db = ledger_db().await;
    let broker = Broker::new().await;
    let consumer = Consumer::start(&db, &broker, &[]).await;
    let credit = r#"{"account":"acct-1","amount_cents":100}"#;
    broker.publish(Some("credit-1"), credit).await;
    // A producer retry: same id, same payload; acked as a duplicate.
    broker.publish(Some("credit-1"), credit).await;
    // The same id for another payload.
    let other = r#"{"account":"acct-1","amount_cents":999}"#;
    broker.publish(Some("credit-1"), other).await;
    // No identity at all: a redelivery of it could not be recognised.
    let anonymous = r#"{"account":"acct-2","amount_cents":5}"#;
    broker.publish(None, anonymous).await;
    // An identity, but not a credit.
    broker.publish(Some("credit-2"), r#"{"account":1}"#).await;

    // The broker delivers a queue's messages in order and rejects go straight to
    // the dead-letter queue, so they arrive there in the order published.
    let conflict = broker.next_dead_letter().await;
    assert_eq!(conflict.message_id.as_deref(), Some("credit-1"));
    assert_eq!(conflict.payload, other.as_bytes());
    assert_eq!(conflict.reason, "rejected");
    let unnamed = broker.next_dead_letter().await;
    assert_eq!(unnamed.message_id, None);
    assert_eq!(unnamed.payload, anonymous.as_bytes());
    assert_eq!(unnamed.reason, "rejected");
    let malformed = broker.next_dead_letter().await;
    assert_eq!(malformed.message_id.as_deref(), Some("credit-2"));
    assert_eq!(malformed.reason, "rejected");

    // The log lines come in through their own reader: waited for first.
    consumer.until("consumer: applied", "credit-1", 1).await;
    consumer.until("consumer: duplicate", "credit-1", 1).await;
    assert_eq!(consumer.count("consumer: applied", "credit-1"), 1);
    assert_eq!(consumer.count("consumer: duplicate", "credit-1"), 1);
    assert_eq!(db.count("SELECT count(*) FROM ledger_entries").await, 1);
    assert_eq!(
        db.count("SELECT sum(balance_cents)::bigint FROM balances")
            .await,
        100
    );
    assert_eq!(broker.ready(&broker.queue).await, 0);
    broker.delete().await;
}
