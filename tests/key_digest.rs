//! Keys at rest: every store keeps the SHA-256 of a key, never the key, and the
//! migration that made it so converts the rows an older release left behind
//! without losing one (a replay still replays, an uncertain execution can still
//! be reconciled by the downstream key it was charged under).
//!
//! The shared tests are ordinary code in `key_digest/suite.rs`, written
//! against a concrete database: each database's module below sets `TestDb`
//! and its SQL, mounts the file (the module's `#[path]` makes `key_digest/`
//! its directory), and `key_digest_tests!` stamps the `#[tokio::test]`
//! wrappers, so a test is `postgres::<name>`, `sqlite::<name>` and
//! `mysql::<name>`. What only one database has is tested beside it.

#![allow(
    clippy::duplicate_mod,
    reason = "each database's module mounts the suite again, over its own `TestDb`"
)]

#[macro_use]
mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_runtime::reconcile::{Reconcile, Reconciler, Resolution, UncertainOutcome};
use idem_runtime::{
    Claim, ClaimRequest, Fingerprint, FingerprintBuilder, IdempotencyKey, StoredResponse, claim,
};

/// The migration that turned keys into digests, the same version on every
/// database.
const KEY_DIGEST_MIGRATION: i64 = 20261202000010;

fn fingerprint(body: &str) -> Fingerprint {
    FingerprintBuilder::new("acme", "create-order", "POST", "/orders")
        .raw_body(body.as_bytes())
        .finish()
}

fn request<'a>(key: &'a IdempotencyKey, fingerprint: Fingerprint) -> ClaimRequest<'a> {
    ClaimRequest {
        tenant: "acme",
        operation: "create-order",
        key,
        fingerprint,
        retention: Duration::from_secs(3600),
        in_flight_wait: Duration::from_secs(2),
    }
}

/// Records what it is asked about; the answer is always "still unknown".
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<UncertainOutcome>>>);

impl Reconcile for Recorder {
    fn operation(&self) -> &str {
        UNCERTAIN_OPERATION
    }

    async fn reconcile(&self, outcome: &UncertainOutcome) -> Resolution {
        self.0.lock().unwrap().push(outcome.clone());
        Resolution::StillUncertain
    }
}

/// Where the legacy uncertain row lives: a tenant and an operation beyond ASCII,
/// so that the length prefixes of the downstream key, computed in SQL by the
/// migration, are checked against the Rust ones on multi-byte characters.
const UNCERTAIN_TENANT: &str = "café-日本";
const UNCERTAIN_OPERATION: &str = "paiement-ü";

/// The body of the legacy completed row.
const LEGACY_BODY: &str = r#"{"id":7}"#;

/// Every test of `key_digest/suite.rs`, stamped in the database's module.
macro_rules! key_digest_tests {
    () => {
        stamp!(
            suite =>
            rows_of_an_older_release_are_found_after_the_migration,
            a_claimed_key_is_stored_as_its_digest_only,
        );
    };
}

#[path = "key_digest"]
mod postgres {
    use super::*;

    type TestDb = crate::common::TestDb;
    const LEGACY_ROW: &str = "INSERT INTO idempotency_requests \
                (tenant_id, operation, idempotency_key, fingerprint, state, response_status, \
                 response_headers, response_body, owner_token, created_at, completed_at, expires_at) \
            VALUES ($1, $2, $3, $4, $5, $6::smallint, $7::jsonb, $8, $9::uuid, now(), \
                    CASE WHEN $6 IS NOT NULL THEN now() END, now() + interval '1 day')";
    const OWNER_TOKEN: &str = "01234567-89ab-cdef-0123-456789abcdef";
    const ROWS_CONTAINING: &str = "SELECT count(*) FROM idempotency_requests t \
                            WHERE strpos(t::text, $1) > 0";

    mod suite;

    key_digest_tests!();

    /// An older release's statements fail against the converted schema (its
    /// functions took the key as text), rather than write a raw key this
    /// release would not find.
    #[tokio::test]
    async fn an_older_release_fails_closed() {
        let db = crate::common::TestDb::new().await;
        let old_claim = sqlx::query(
            "SELECT * FROM idem_claim('acme'::text, 'op'::text, 'k'::text, \
                                      decode(repeat('00', 32), 'hex'), 1000, 10)",
        )
        .execute(&db.pool)
        .await;
        let err = old_claim
            .expect_err("the text-key function is gone")
            .to_string();
        assert!(err.contains("does not exist"), "{err}");
        let old_insert = sqlx::query(
            "INSERT INTO idempotency_requests (tenant_id, operation, idempotency_key, \
                                               fingerprint, state, expires_at) \
             VALUES ('acme', 'op', 'k', decode(repeat('00', 32), 'hex'), 'processing', now())",
        )
        .execute(&db.pool)
        .await;
        assert!(old_insert.is_err(), "the raw-key column is gone");
    }
}

#[path = "key_digest"]
mod sqlite {
    use super::*;

    type TestDb = crate::common::SqliteDb;
    const LEGACY_ROW: &str = concat!(
        "INSERT INTO idempotency_requests \
                (tenant_id, operation, idempotency_key, fingerprint, state, response_status, \
                 response_headers, response_body, owner_token, created_at, completed_at, expires_at) \
             SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, t.now, \
                    CASE WHEN $6 IS NOT NULL THEN t.now END, t.now + 86400000 \
               FROM (SELECT ",
        idem_runtime::sqlite_now_ms!(),
        " AS now) t"
    );
    const OWNER_TOKEN: &str = "0123456789abcdef0123456789abcdef";
    const ROWS_CONTAINING: &str = "SELECT count(*) FROM idempotency_requests \
                            WHERE instr(CAST(key_digest AS TEXT) || tenant_id || operation \
                                        || coalesce(downstream_key, '') \
                                        || coalesce(owner_token, ''), $1) > 0";

    mod suite;

    key_digest_tests!();

    /// A digest of any other length than 32 bytes is refused, as PostgreSQL's
    /// CHECK and MySQL's VARBINARY(32) refuse it; nothing is stored.
    #[tokio::test]
    async fn a_key_digest_that_is_not_32_bytes_is_refused() {
        let db = crate::common::SqliteDb::new().await;
        // (A TEXT value is an older release's raw key, left for the conversion.)
        for digest in [
            "X'00'",
            "X'0000000000000000000000000000000000000000000000000000000000000000FF'",
            "zeroblob(31)",
        ] {
            let inserted = sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO idempotency_requests \
                    (tenant_id, operation, key_digest, fingerprint, state, created_at, expires_at) \
                 VALUES ('acme', 'op', {digest}, zeroblob(32), 'processing', 0, 1)"
            )))
            .execute(&db.pool)
            .await;
            let err = inserted.expect_err(digest).to_string();
            assert!(err.contains("32-byte"), "{digest}: {err}");
        }
        assert_eq!(
            db.count("SELECT count(*) FROM idempotency_requests").await,
            0
        );
        // An update to a wrong length is refused too.
        let key = IdempotencyKey::parse("k-len").unwrap();
        let mut tx = db.pool.begin().await.unwrap();
        let Claim::Execute(execution) = claim(&mut tx, &request(&key, fingerprint("a")))
            .await
            .unwrap()
        else {
            panic!("a new key executes");
        };
        execution
            .complete(
                &mut tx,
                &StoredResponse {
                    status: 200,
                    headers: vec![],
                    body: "ok".into(),
                },
            )
            .await
            .unwrap();
        tx.commit().await.unwrap();
        let updated = sqlx::query("UPDATE idempotency_requests SET key_digest = X'0102'")
            .execute(&db.pool)
            .await;
        assert!(
            updated
                .expect_err("a 2-byte digest")
                .to_string()
                .contains("32-byte")
        );
    }

    /// SQLite converts in Rust after the SQL migration: a row left unconverted
    /// (a crash between the two) is converted at the next start.
    #[tokio::test]
    async fn a_row_left_unconverted_is_converted_at_the_next_start() {
        let db = crate::common::SqliteDb::new().await;
        let key = IdempotencyKey::parse("left-behind").unwrap();
        // As the renamed column holds it before the conversion: TEXT.
        sqlx::query(concat!(
            "INSERT INTO idempotency_requests \
                (tenant_id, operation, key_digest, fingerprint, state, response_status, \
                 response_headers, response_body, created_at, completed_at, expires_at) \
             SELECT 'acme', 'create-order', 'left-behind', $1, 'completed', 201, '[]', \
                    CAST('x' AS BLOB), t.now, t.now, t.now + 86400000 \
               FROM (SELECT ",
            idem_runtime::sqlite_now_ms!(),
            " AS now) t"
        ))
        .bind(&fingerprint("a").as_bytes()[..])
        .execute(&db.pool)
        .await
        .unwrap();
        idem_runtime::migrate(&db.pool).await.unwrap();
        assert_eq!(
            db.count(
                "SELECT count(*) FROM idempotency_requests WHERE typeof(key_digest) <> 'blob'"
            )
            .await,
            0
        );
        let mut tx = db.pool.begin().await.unwrap();
        let replay = claim(&mut tx, &request(&key, fingerprint("a")))
            .await
            .unwrap();
        assert!(matches!(replay, Claim::Replay(_)), "{replay:?}");
    }
}

/// Two processes migrating one SQLite file at once (a deployment starting two
/// replicas): sqlx's migration lock does nothing on SQLite, so idem takes the
/// write lock first. Deterministic: a third connection holds the write lock
/// until a busy handler has seen each process wait for it.
mod sqlite_migrating_at_once {
    use std::ffi::{c_int, c_void};

    use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
    use tokio::sync::Semaphore;

    static FIRST_WAITS: Semaphore = Semaphore::const_new(0);
    static SECOND_WAITS: Semaphore = Semaphore::const_new(0);
    static STARTING_WAITS: Semaphore = Semaphore::const_new(0);

    /// Stands in for the busy timeout: says when a lock wait begins, then
    /// retries every millisecond, for ten seconds at most (then SQLITE_BUSY,
    /// not a hang).
    unsafe extern "C" fn busy(waits: *mut c_void, tries: c_int) -> c_int {
        if tries == 0 {
            // SAFETY: `waits` is one of the statics above.
            unsafe { &*waits.cast::<Semaphore>() }.add_permits(1);
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
        c_int::from(tries < 10_000)
    }

    /// A process's pool: one connection, whose lock waits signal `waits`.
    async fn process(path: &std::path::Path, waits: &'static Semaphore) -> sqlx::SqlitePool {
        let waits = std::ptr::from_ref(waits).cast_mut().cast::<c_void>() as usize;
        SqlitePoolOptions::new()
            .max_connections(1)
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    let mut handle = conn.lock_handle().await?;
                    // SAFETY: the handle is this connection's, locked; the
                    // handler and its argument are 'static.
                    unsafe {
                        libsqlite3_sys::sqlite3_busy_handler(
                            handle.as_raw_handle().as_ptr(),
                            Some(busy),
                            waits as *mut c_void,
                        );
                    }
                    Ok(())
                })
            })
            .connect_with(SqliteConnectOptions::new().filename(path))
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn two_processes_migrating_a_fresh_file_at_once_both_succeed() {
        let db = crate::common::SqliteDb::migrated_before(0).await;
        let first = process(&db.path, &FIRST_WAITS).await;
        let second = process(&db.path, &SECOND_WAITS).await;
        let holder = db.pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
        let first = tokio::spawn(async move { idem_runtime::migrate(&first).await });
        let second = tokio::spawn(async move { idem_runtime::migrate(&second).await });
        tokio::time::timeout(std::time::Duration::from_secs(60), async {
            FIRST_WAITS.acquire().await.unwrap().forget();
            SECOND_WAITS.acquire().await.unwrap().forget();
        })
        .await
        .expect("both processes wait for the write lock");
        holder.commit().await.unwrap();
        first.await.unwrap().expect("the first process migrates");
        second.await.unwrap().expect("the second process migrates");
        let migrations = idem_runtime::migrator::<sqlx::Sqlite>().iter().count();
        assert_eq!(
            db.count("SELECT count(*) FROM _idem_migrations WHERE success")
                .await,
            i64::try_from(migrations).unwrap(),
            "each migration applied once"
        );
        assert_eq!(
            db.count("SELECT count(*) FROM idempotency_requests").await,
            0
        );
    }

    /// A start on a file with every migration applied does not take the write
    /// lock, so it does not wait behind a running service's writers.
    #[tokio::test]
    async fn a_start_on_a_migrated_file_does_not_wait_for_the_write_lock() {
        let db = crate::common::SqliteDb::new().await;
        let starting = process(&db.path, &STARTING_WAITS).await;
        let holder = db.pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
        idem_runtime::migrate(&starting)
            .await
            .expect("migrated while another connection writes");
        assert_eq!(STARTING_WAITS.available_permits(), 0, "it never waited");
        holder.rollback().await.unwrap();
    }

    /// A file that a newer release migrated (a migration this build does not
    /// know) is refused, as sqlx's migrator refuses it on every database: the
    /// path that takes no lock does not start on it silently.
    #[tokio::test]
    async fn a_file_a_newer_release_migrated_is_refused() {
        let db = crate::common::SqliteDb::new().await;
        db.exec(
            "INSERT INTO _idem_migrations (version, description, success, checksum, execution_time) \
             VALUES (99990101000001, 'from a newer release', 1, x'00', 0)",
        )
        .await;
        let refused = idem_runtime::migrate(&db.pool).await.unwrap_err();
        assert!(refused.to_string().contains("99990101000001"), "{refused}");
    }
}

mod sqlite_twins {
    use super::*;

    /// A raw-key row whose key is also stored as a digest (a process served
    /// before converting): the conversion stops with a clear error naming the
    /// row, and changes nothing, rather than drop either record.
    #[tokio::test]
    async fn a_raw_key_row_with_a_digest_twin_is_a_clear_error_and_nothing_changes() {
        let db = crate::common::SqliteDb::new().await;
        let key = IdempotencyKey::parse("twin").unwrap();
        for (spelling, digest) in [(None, Some(key.digest())), (Some("twin"), None)] {
            sqlx::query(concat!(
                "INSERT INTO idempotency_requests \
                    (tenant_id, operation, key_digest, fingerprint, state, response_status, \
                     response_headers, response_body, created_at, completed_at, expires_at) \
                 SELECT 'acme', 'create-order', coalesce($1, $2), $3, 'completed', 201, '[]', \
                        CAST('x' AS BLOB), t.now, t.now, t.now + 86400000 \
                   FROM (SELECT ",
                idem_runtime::sqlite_now_ms!(),
                " AS now) t"
            ))
            .bind(spelling)
            .bind(digest)
            .bind(&fingerprint("a").as_bytes()[..])
            .execute(&db.pool)
            .await
            .unwrap();
        }
        let err = idem_runtime::migrate(&db.pool)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("twin already stored under its digest"),
            "{err}"
        );
        assert_eq!(
            db.count("SELECT count(*) FROM idempotency_requests WHERE typeof(key_digest) = 'text'")
                .await,
            1,
            "the raw-key row is left as it was"
        );
        assert_eq!(
            db.count("SELECT count(*) FROM idempotency_requests").await,
            2
        );
    }
}

#[path = "key_digest"]
mod mysql {
    use super::*;

    type TestDb = crate::common::MySqlDb;
    const LEGACY_ROW: &str = concat!(
        "INSERT INTO idempotency_requests \
                (tenant_id, operation, idempotency_key, fingerprint, state, response_status, \
                 response_headers, response_body, owner_token, created_at, completed_at, expires_at) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ",
        idem_runtime::mysql_now_ms!(),
        ", NULL, ",
        idem_runtime::mysql_now_ms!(),
        " + 86400000)"
    );
    const OWNER_TOKEN: &str = "0123456789abcdef0123456789abcdef";
    const ROWS_CONTAINING: &str = "SELECT count(*) FROM idempotency_requests \
                            WHERE LOCATE(?, CONCAT(key_digest, tenant_id, operation, \
                                                   COALESCE(downstream_key, ''), \
                                                   COALESCE(owner_token, ''))) > 0";

    mod suite;

    key_digest_tests!();

    /// MySQL commits each DDL statement on its own: a conversion stopped
    /// after its first `ALTER` (here by a trigger that refuses the digests'
    /// `UPDATE`; in life a lock wait, a lost connection, a deploy stopping
    /// the process) left the schema half-converted and the migration marked
    /// unfinished, which sqlx then refused to run past (and the file could not
    /// run again: its columns exist). The next start resumes it: the legacy
    /// row replays, no raw key is left.
    #[tokio::test]
    async fn a_conversion_stopped_part_way_is_resumed_by_the_next_start() {
        let db = TestDb::migrated_before(KEY_DIGEST_MIGRATION).await;
        let done = IdempotencyKey::parse("legacy-stopped-SECRET").unwrap();
        let fp = fingerprint("a");
        suite::insert_legacy(
            &db,
            "acme",
            "create-order",
            done.as_str(),
            fp,
            "completed",
            None,
        )
        .await;
        db.exec(
            "CREATE TRIGGER stop_the_digests BEFORE UPDATE ON idempotency_requests \
             FOR EACH ROW SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'stopped by the test'",
        )
        .await;
        let stopped = idem_runtime::migrate(&db.pool).await.unwrap_err();
        assert!(
            stopped.to_string().contains("stopped by the test"),
            "{stopped}"
        );
        assert_eq!(
            db.count(&format!(
                "SELECT count(*) FROM _idem_migrations \
                  WHERE version = {KEY_DIGEST_MIGRATION} AND NOT success"
            ))
            .await,
            1,
            "left part-way"
        );
        db.exec("DROP TRIGGER stop_the_digests").await;

        // Another process (a pool of its own): the failed run's connection
        // gave the migrator's lock back (it was closed, not pooled holding
        // it), so this one does not wait for it. The bound only ends a hang.
        let other = sqlx::MySqlPool::connect(&db.url).await.unwrap();
        tokio::time::timeout(Duration::from_secs(60), idem_runtime::migrate(&other))
            .await
            .expect("the migrator's lock was left held by the failed run")
            .unwrap();
        idem_runtime::migrate(&db.pool).await.unwrap();

        assert_eq!(
            db.count("SELECT count(*) FROM _idem_migrations WHERE NOT success")
                .await,
            0
        );
        assert_eq!(
            db.count(
                "SELECT count(*) FROM information_schema.columns \
                  WHERE table_schema = DATABASE() AND table_name = 'idempotency_requests' \
                    AND column_name = 'idempotency_key'"
            )
            .await,
            0,
            "no raw key column is left"
        );
        suite::assert_legacy_replays(&db, &done, fp).await;
    }
}
