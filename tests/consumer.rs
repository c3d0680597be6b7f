//! Exactly-once message consumption: the runtime API against every database (a
//! real PostgreSQL, a SQLite file and MySQL / MariaDB), and the `consumer`
//! example process against a real NATS JetStream and PostgreSQL. Behind the
//! root package's feature `nats` (async-nats), as the example is:
//! `cargo test --features nats --test consumer`.
//!
//! The runtime API's tests are ordinary code in `consumer/suite.rs`: each
//! database's module below sets `TestDb` and its SQL, mounts the file (the
//! module's `#[path]` makes `consumer/` its directory), and `consumer_tests!`
//! stamps the `#[tokio::test]` wrappers, so a test is `postgres::<name>`,
//! `sqlite::<name>` and `mysql::<name>`.

#![allow(
    clippy::duplicate_mod,
    reason = "each database's module mounts the suite again, over its own `TestDb`"
)]

#[macro_use]
mod common;

use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use common::TestDb;
use idem_runtime::consumer::{ConsumeError, Delivery, Message, process_once};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const WEEK: Duration = Duration::from_secs(7 * 24 * 3600);

/// Every test of `consumer/suite.rs`, stamped in the database's module.
macro_rules! consumer_tests {
    () => {
        stamp!(
            suite =>
            five_deliveries_of_one_message_apply_it_once,
            another_payload_under_the_same_identity_is_reported_not_applied,
            a_failed_effect_commits_nothing_and_the_redelivery_applies_it,
            a_record_sealed_by_a_rekey_is_still_a_duplicate,
            a_rekey_refusing_clear_answers_leaves_a_message_record_alone,
        );
    };
}

#[path = "consumer"]
mod postgres {
    use super::*;

    type TestDb = crate::common::TestDb;
    const CREDITS_DDL: &str = "CREATE TABLE credits (id bigserial PRIMARY KEY, account text NOT NULL, amount bigint NOT NULL)";
    const INSERT_CREDIT: &str =
        "INSERT INTO credits (account, amount) VALUES ('a', 5) RETURNING id";

    mod suite;

    consumer_tests!();
}

#[path = "consumer"]
mod sqlite {
    use super::*;

    type TestDb = crate::common::SqliteDb;
    const CREDITS_DDL: &str = "CREATE TABLE credits (id INTEGER PRIMARY KEY AUTOINCREMENT, account TEXT NOT NULL, amount INTEGER NOT NULL)";
    const INSERT_CREDIT: &str =
        "INSERT INTO credits (account, amount) VALUES ('a', 5) RETURNING id";

    mod suite;

    consumer_tests!();
}

#[path = "consumer"]
mod mysql {
    use super::*;

    type TestDb = crate::common::MySqlDb;
    const CREDITS_DDL: &str = "CREATE TABLE credits (id BIGINT AUTO_INCREMENT PRIMARY KEY, account VARCHAR(64) NOT NULL, amount BIGINT NOT NULL) ENGINE = InnoDB";
    const INSERT_CREDIT: &str = "INSERT INTO credits (account, amount) VALUES ('a', 5)";

    mod suite;

    consumer_tests!();
}

// ---- the consumer example against JetStream ----

static STREAMS: AtomicU32 = AtomicU32::new(0);

struct Bus {
    js: jetstream::Context,
    stream: String,
    subject: String,
    durable: String,
}

impl Bus {
    async fn new() -> Bus {
        let client = async_nats::connect(common::nats_url()).await.expect(
            "NATS with JetStream must run on 127.0.0.1:4222 (see README: running the tests)",
        );
        let n = STREAMS.fetch_add(1, Ordering::Relaxed);
        let tag = format!("T{}X{n}", std::process::id());
        Bus {
            js: jetstream::new(client),
            stream: format!("IDEM_{tag}"),
            subject: format!("idem.{tag}.credits"),
            durable: format!("worker-{tag}"),
        }
    }

    async fn publish(&self, id: &str, payload: &str) {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", id);
        self.js
            .publish_with_headers(self.subject.clone(), headers, payload.to_owned().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }

    /// Deletes the test's stream and the dead-letter stream the consumer made
    /// beside it (not in Drop: that cannot await).
    async fn delete(self) {
        self.js.delete_stream(&self.stream).await.ok();
        self.js.delete_stream(self.dead_stream()).await.ok();
    }

    /// The stream the consumer dead-letters to (`<stream>_DEAD`).
    fn dead_stream(&self) -> String {
        format!("{}_DEAD", self.stream)
    }

    /// The messages the dead-letter stream holds now.
    async fn dead_lettered(&self) -> u64 {
        match self.js.get_stream(self.dead_stream()).await {
            Ok(mut stream) => stream.info().await.unwrap().state.messages,
            Err(_) => 0,
        }
    }

    /// Deliveries the consumer has made so far, redeliveries included.
    async fn deliveries(&self) -> u64 {
        let stream = self.js.get_stream(&self.stream).await.unwrap();
        let mut consumer = stream
            .get_consumer::<jetstream::consumer::pull::Config>(&self.durable)
            .await
            .unwrap();
        consumer.info().await.unwrap().delivered.consumer_sequence
    }

    /// Waits until the consumer has every message acked: nothing pending, nothing
    /// awaiting an ack.
    async fn until_all_acked(&self, messages: u64) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let stream = self.js.get_stream(&self.stream).await.unwrap();
            if let Ok(mut consumer) = stream
                .get_consumer::<jetstream::consumer::pull::Config>(&self.durable)
                .await
            {
                let info = consumer.info().await.unwrap();
                if info.num_pending == 0
                    && info.num_ack_pending == 0
                    && info.ack_floor.stream_sequence >= messages
                {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "messages never all acked");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The `consumer` example's command for the test's database and bus, with
/// `env` besides.
fn consumer_command(db: &TestDb, bus: &Bus, env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(common::example_binary("consumer"));
    cmd.env("DATABASE_URL", &db.url)
        .env("NATS_URL", common::nats_url())
        .env("CONSUMER_STREAM", &bus.stream)
        .env("CONSUMER_SUBJECT", &bus.subject)
        .env("CONSUMER_DURABLE", &bus.durable)
        .env("CONSUMER_ACK_WAIT_MS", "300")
        .env("NO_COLOR", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

async fn start_consumer(db: &TestDb, bus: &Bus, env: &[(&str, &str)]) -> Child {
    let mut child = consumer_command(db, bus, env).spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    loop {
        let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .expect("the consumer gets ready within 60 s")
            .unwrap()
            .expect("the consumer exited before it was ready");
        if line.contains("consumer ready") {
            break;
        }
    }
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    child
}

#[tokio::test]
async fn a_crash_between_commit_and_ack_does_not_apply_the_redelivery_again() {
    let db = TestDb::new().await;
    let bus = Bus::new().await;
    let mut first = start_consumer(&db, &bus, &[("CONSUMER_CRASH_AFTER_COMMIT", "1")]).await;
    bus.publish("credit-1", r#"{"account":"acct-1","amount_cents":500}"#)
        .await;
    // It commits the credit and dies before acking.
    let status = tokio::time::timeout(Duration::from_secs(60), first.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(3));
    assert_eq!(db.count("SELECT count(*) FROM ledger_entries").await, 1);

    // Restarted, it gets the redelivery, recognises it, and acks it.
    let _second = start_consumer(&db, &bus, &[]).await;
    bus.publish("credit-2", r#"{"account":"acct-1","amount_cents":250}"#)
        .await;
    bus.until_all_acked(2).await;
    assert_eq!(db.count("SELECT count(*) FROM ledger_entries").await, 2);
    assert_eq!(
        db.count("SELECT balance_cents FROM balances WHERE account = 'acct-1'")
            .await,
        750
    );
    bus.delete().await;
}

/// JetStream's shortest deduplication window for `Nats-Msg-Id`.
const BROKER_DEDUP_WINDOW: Duration = Duration::from_millis(100);

/// Creates the test's stream before the consumer does, with JetStream's own
/// deduplication of `Nats-Msg-Id` cut to its minimum, so that a message
/// republished after it really reaches the consumers and idem is what keeps it
/// single.
async fn stream_without_broker_dedup(bus: &Bus) {
    bus.js
        .create_stream(jetstream::stream::Config {
            name: bus.stream.clone(),
            subjects: vec![bus.subject.clone()],
            duplicate_window: BROKER_DEDUP_WINDOW,
            // The example's: below the keys' retention.
            max_age: Duration::from_secs(6 * 24 * 3600),
            ..Default::default()
        })
        .await
        .unwrap();
}

/// A stream made elsewhere without a max age (by an operator, or an earlier
/// version of the example) could deliver a credit again after its key is
/// forgotten: the example refuses to start on it, saying what to set, and
/// changes nothing (a shorter max age would drop unconsumed credits).
#[tokio::test]
async fn a_stream_without_a_max_age_is_refused_at_start() {
    let db = TestDb::new().await;
    let bus = Bus::new().await;
    bus.js
        .create_stream(jetstream::stream::Config {
            name: bus.stream.clone(),
            subjects: vec![bus.subject.clone()],
            ..Default::default()
        })
        .await
        .unwrap();
    let out = consumer_command(&db, &bus, &[]).output();
    let out = tokio::time::timeout(Duration::from_secs(60), out)
        .await
        .expect("the consumer exits within 60 s")
        .unwrap();
    assert!(!out.status.success(), "{out:?}");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("keeps messages for ever"), "{said}");
    assert!(said.contains("--max-age 6d"), "{said}");
    assert!(
        said.contains("the keys' retention (7 days) allows"),
        "{said}"
    );
    let mut stream = bus.js.get_stream(&bus.stream).await.unwrap();
    assert_eq!(stream.info().await.unwrap().config.max_age, Duration::ZERO);
    bus.delete().await;
}

#[tokio::test]
async fn two_consumers_and_a_republished_message_apply_each_credit_once() {
    let db = TestDb::new().await;
    let bus = Bus::new().await;
    stream_without_broker_dedup(&bus).await;
    let _a = start_consumer(&db, &bus, &[]).await;
    let _b = start_consumer(&db, &bus, &[]).await;
    for i in 0..10 {
        bus.publish(
            &format!("credit-{i}"),
            &format!(r#"{{"account":"acct-{}","amount_cents":100}}"#, i % 3),
        )
        .await;
    }
    // A producer retry republishes with the same id, after the broker's window
    // (the publish of credit-3 was acknowledged before this wait began, so the
    // broker saw it at least the window earlier); the broker keeps both.
    tokio::time::sleep(BROKER_DEDUP_WINDOW + Duration::from_millis(50)).await;
    bus.publish("credit-3", r#"{"account":"acct-0","amount_cents":100}"#)
        .await;
    let stored = bus
        .js
        .get_stream(&bus.stream)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .messages;
    assert_eq!(stored, 11, "the republish must reach the consumers");
    bus.until_all_acked(11).await;
    assert_eq!(db.count("SELECT count(*) FROM ledger_entries").await, 10);
    assert_eq!(
        db.count("SELECT sum(balance_cents)::bigint FROM balances")
            .await,
        1000
    );
    bus.delete().await;
}

/// A refusal PostgreSQL makes only at `COMMIT` (a deferred constraint
/// trigger) is the commit's error, not the store's: `ConsumeError::Commit`
/// with the trigger's SQLSTATE, and nothing committed, neither the effect nor
/// the message's record.
#[tokio::test]
async fn a_refusal_at_commit_is_the_commits_error_and_commits_nothing() {
    let db = TestDb::new().await;
    db.exec(REFUSE_POISON_FN).await;
    db.exec("CREATE TABLE credits (account text NOT NULL)")
        .await;
    db.exec(
        "CREATE CONSTRAINT TRIGGER refuse_poison AFTER INSERT ON credits \
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse_poison()",
    )
    .await;
    let msg = Message {
        scope: "billing",
        operation: "credit",
        id: "poison-1",
        payload: b"{}",
    };
    let err = process_once(&db.pool, &msg, WEEK, |tx| {
        Box::pin(async move {
            sqlx::query("INSERT INTO credits (account) VALUES ('poison')")
                .execute(&mut **tx)
                .await?;
            Ok::<_, sqlx::Error>(())
        })
    })
    .await
    .unwrap_err();
    let ConsumeError::Commit(sqlx::Error::Database(e)) = &err else {
        panic!("{err:?}")
    };
    assert_eq!(e.code().as_deref(), Some("P0001"), "{err}");
    assert_eq!(db.count("SELECT count(*) FROM credits").await, 0);
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests").await,
        0
    );
}

/// A trigger function that refuses the `poison` account.
const REFUSE_POISON_FN: &str = "CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$ \
     BEGIN IF NEW.account = 'poison' THEN RAISE EXCEPTION 'poisoned account'; END IF; \
     RETURN NEW; END $$";

/// A credit the database refuses on every delivery (a trigger: a poison
/// message) is dead-lettered once its delivery reaches the limit: published,
/// with its id and the error, to the dead-letter stream, then terminated;
/// never applied, and the credit beside it is applied as ever.
#[tokio::test]
async fn a_credit_the_database_always_refuses_is_dead_lettered_not_applied() {
    a_refused_credit_is_dead_lettered(
        "CREATE TRIGGER refuse_poison BEFORE INSERT ON ledger_entries \
         FOR EACH ROW EXECUTE FUNCTION refuse_poison()",
    )
    .await;
}

/// So is one the database refuses only at `COMMIT` (a deferred constraint
/// trigger): the commit's refusal is the credit's, not the store's, which
/// would be nacked for ever.
#[tokio::test]
async fn a_credit_refused_at_commit_is_dead_lettered_not_applied() {
    a_refused_credit_is_dead_lettered(
        "CREATE CONSTRAINT TRIGGER refuse_poison AFTER INSERT ON ledger_entries \
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse_poison()",
    )
    .await;
}

/// The poison credit refused by the trigger `create_trigger` makes (over
/// `refuse_poison()`) is dead-lettered at the delivery limit; the credit
/// beside it is applied.
async fn a_refused_credit_is_dead_lettered(create_trigger: &str) {
    let db = TestDb::new().await;
    let bus = Bus::new().await;
    let _consumer = start_consumer(
        &db,
        &bus,
        &[
            ("CONSUMER_DELIVERY_LIMIT", "3"),
            ("CONSUMER_RETRY_DELAY_MS", "20"),
        ],
    )
    .await;
    db.exec(REFUSE_POISON_FN).await;
    db.exec(create_trigger).await;
    bus.publish("poison-1", r#"{"account":"poison","amount_cents":500}"#)
        .await;
    bus.publish("credit-1", r#"{"account":"acct-1","amount_cents":250}"#)
        .await;
    bus.until_all_acked(2).await;
    assert_eq!(bus.dead_lettered().await, 1);
    let dead = bus
        .js
        .get_stream(bus.dead_stream())
        .await
        .unwrap()
        .get_raw_message(1)
        .await
        .unwrap();
    assert_eq!(
        &dead.payload[..],
        br#"{"account":"poison","amount_cents":500}"#
    );
    let headers = dead.headers;
    assert_eq!(
        headers.get("Nats-Msg-Id").map(|v| v.as_str()),
        Some("poison-1")
    );
    let why = headers.get("Idem-Error").map(|v| v.as_str().to_owned());
    assert!(
        why.as_deref()
            .is_some_and(|w| w.contains("poisoned account")),
        "{why:?}"
    );
    assert_eq!(db.count("SELECT count(*) FROM ledger_entries").await, 1);
    assert_eq!(
        db.count("SELECT count(*) FROM balances WHERE account = 'poison'")
            .await,
        0
    );
    bus.delete().await;
}

/// A store that fails for more deliveries than the limit, and than any
/// `max_deliver` (idem's table gone for 25 deliveries, as in an outage),
/// loses nothing: the message is redelivered until the store is back, then
/// applied once, and nothing is dead-lettered. (JetStream itself would stop
/// redelivering at a `max_deliver`, which the durable leaves unset.)
#[tokio::test]
async fn a_store_outage_longer_than_the_delivery_limit_loses_nothing() {
    let db = TestDb::new().await;
    let bus = Bus::new().await;
    let _consumer = start_consumer(
        &db,
        &bus,
        &[
            ("CONSUMER_DELIVERY_LIMIT", "2"),
            ("CONSUMER_RETRY_DELAY_MS", "20"),
        ],
    )
    .await;
    db.exec("ALTER TABLE idempotency_requests RENAME TO idempotency_requests_away")
        .await;
    bus.publish("credit-1", r#"{"account":"acct-1","amount_cents":500}"#)
        .await;
    let deadline = Instant::now() + Duration::from_secs(60);
    // Past 20: the `max_deliver` the durable used to have, at which
    // JetStream stops redelivering.
    while bus.deliveries().await < 25 {
        assert!(Instant::now() < deadline, "the message was not redelivered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    db.exec("ALTER TABLE idempotency_requests_away RENAME TO idempotency_requests")
        .await;
    bus.until_all_acked(1).await;
    assert_eq!(
        db.count("SELECT balance_cents FROM balances WHERE account = 'acct-1'")
            .await,
        500
    );
    assert_eq!(db.count("SELECT count(*) FROM ledger_entries").await, 1);
    assert_eq!(bus.dead_lettered().await, 0);
    bus.delete().await;
}
