//! The `idem` binary against real databases: every subcommand's output and exit
//! code, `--json` that parses, and the documented error cases. What holds on
//! PostgreSQL, SQLite and MySQL alike is written once, as an ordinary test
//! generic over `CliDb`, and stamped per backend by `cli_suite!` (`mod
//! postgres`, `mod sqlite`, `mod mysql` with the feature `mysql`); what only one
//! backend has (a server to reach, a file to find) is tested beside it.

// The suite runs both databases, so it needs the CLI built with both
// (`cargo test --workspace --all-features`).
#![cfg(all(feature = "postgres", feature = "sqlite"))]

#[path = "../../tests/common/db.rs"]
mod common;
mod out;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use common::{SqliteDb, TestDb};
use out::Out;
use serde_json::Value;

/// Runs `idem args...` with `DATABASE_URL` set to `url` (or unset).
async fn idem(url: Option<&str>, args: &[&str]) -> Out {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"));
    cmd.args(args).env_remove("DATABASE_URL");
    if let Some(url) = url {
        cmd.env("DATABASE_URL", url);
    }
    Out::of(cmd.output().await.expect("the idem binary runs"))
}

/// A migrated test database as the CLI sees it, on either backend.
/// [`idem`] with `env` set besides `DATABASE_URL`.
async fn idem_with(url: Option<&str>, args: &[&str], env: &[(&str, &str)]) -> Out {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"));
    cmd.args(args)
        .env_remove("DATABASE_URL")
        .env_remove("IDEM_KEY_RING")
        .env_remove("IDEM_ACTIVE_KEY");
    if let Some(url) = url {
        cmd.env("DATABASE_URL", url);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    Out::of(cmd.output().await.expect("the idem binary runs"))
}

/// Keys of 32 bytes of `1`, `2` and `3`, in base64.
const K1: &str = "k1:MTExMTExMTExMTExMTExMTExMTExMTExMTExMTExMTE=";
const K2: &str = "k2:MjIyMjIyMjIyMjIyMjIyMjIyMjIyMjIyMjIyMjIyMjI=";
const K3: &str = "k3:MzMzMzMzMzMzMzMzMzMzMzMzMzMzMzMzMzMzMzMzMzM=";

/// A finished answer of `acme`'s `pay` under `key`, sealed with `ring`.
async fn sealed_answer<DB: idem_runtime::Backend>(
    pool: &sqlx::Pool<DB>,
    ring: &idem_runtime::KeyRing,
    key: &str,
) {
    use idem_runtime::{Claim, ClaimRequest, FingerprintBuilder, IdempotencyKey, StoredResponse};
    let key = IdempotencyKey::parse(key).unwrap();
    let req = ClaimRequest {
        tenant: "acme",
        operation: "pay",
        key: &key,
        fingerprint: FingerprintBuilder::new("acme", "pay", "POST", "/pay").finish(),
        retention: std::time::Duration::from_secs(3600),
        in_flight_wait: std::time::Duration::from_secs(2),
    };
    let mut tx = DB::begin(pool).await.unwrap();
    let Claim::Execute(execution) = idem_runtime::claim_with_key_ring(&mut tx, &req, ring)
        .await
        .unwrap()
    else {
        panic!("a new key executes");
    };
    let paid = StoredResponse {
        status: 201,
        headers: vec![],
        body: "paid with card 4242".into(),
    };
    execution.complete(&mut tx, &paid).await.unwrap();
    tx.commit().await.unwrap();
}

/// A message consumer's record, as `consumer::process_once` leaves one for
/// message `id`: in clear, with no answer.
async fn message_record<DB: idem_runtime::Backend>(pool: &sqlx::Pool<DB>, id: &str) {
    use idem_runtime::consumer::{Delivery, Message, process_once};
    let msg = Message {
        scope: "ledger",
        operation: "credit",
        id,
        payload: b"{}",
    };
    let applied = process_once(pool, &msg, std::time::Duration::from_secs(3600), |_tx| {
        Box::pin(async { Ok::<_, std::convert::Infallible>(()) })
    })
    .await
    .unwrap();
    assert!(matches!(applied, Delivery::Applied(())), "{applied:?}");
}

trait CliDb: Sized {
    /// A fresh database of its own, with idem's migrations applied.
    async fn create() -> Self;
    /// The URL to give the CLI.
    fn url(&self) -> String;
    /// Makes a second database of this backend, without idem's table (as an
    /// application's own database before `idem migrate`), and returns its URL.
    async fn bare(&self) -> String;
    /// Removes what [`CliDb::bare`] made.
    async fn drop_bare(&self);
    /// One row of each kind: a finished outcome with a recognisable body
    /// (created 2026-01-02T03:04:05Z, completed a second later, fingerprint
    /// 0xab * 32, headers content-type and location), a failed one past its
    /// retention, and an execution in flight for five minutes.
    const SEED: &'static str;
    /// An `UPDATE`'s assignments of an answer that would drive a terminal: the
    /// body `a ESC [2J b LF TAB c` (clear the screen), and a header `x-note`
    /// of `n ESC ]0;owned BEL` (set its title), in this database's literals.
    const TERMINAL_CONTROL_ANSWER: &'static str;
    /// Four completed rows of operation `pay`, keys old-1..4, expired a day ago.
    const EXPIRED_ROWS: &'static str;
    /// Runs statements.
    async fn exec(&self, sql: &str);
    /// The single integer a query returns.
    async fn count(&self, sql: &str) -> i64;
    /// The SQL literal of `raw`'s digest, to find its row in `key_digest`.
    fn key(&self, raw: &str) -> String;
    /// A finished answer of `acme`'s `pay` under `key`, sealed with `ring`.
    async fn sealed_answer(&self, ring: &idem_runtime::KeyRing, key: &str);
    /// A message consumer's record for message `id` ([`message_record`]).
    async fn message_record(&self, id: &str);
    /// Runs `during` while a transaction holds `key`'s row as a claim leaves it
    /// (PostgreSQL and MySQL: the row's lock; SQLite: the write lock), then
    /// rolls that transaction back.
    async fn while_held<T>(&self, key: &str, during: impl std::future::Future<Output = T>) -> T;
}

/// The [`CliDb`] methods that are the same on every backend's pool.
macro_rules! through_the_pool {
    () => {
        async fn exec(&self, sql: &str) {
            Self::exec(self, sql).await
        }

        async fn count(&self, sql: &str) -> i64 {
            Self::count(self, sql).await
        }

        fn key(&self, raw: &str) -> String {
            Self::key(self, raw)
        }

        async fn sealed_answer(&self, ring: &idem_runtime::KeyRing, key: &str) {
            sealed_answer(&self.pool, ring, key).await
        }

        async fn message_record(&self, id: &str) {
            message_record(&self.pool, id).await
        }

        async fn while_held<T>(
            &self,
            key: &str,
            during: impl std::future::Future<Output = T>,
        ) -> T {
            let mut holder = self.pool.begin().await.unwrap();
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "UPDATE idempotency_requests SET generation = generation \
                 WHERE key_digest = {}",
                Self::key(self, key)
            )))
            .execute(&mut *holder)
            .await
            .unwrap();
            let out = during.await;
            holder.rollback().await.unwrap();
            out
        }
    };
}

impl CliDb for TestDb {
    through_the_pool!();

    const TERMINAL_CONTROL_ANSWER: &'static str = r#"response_body = '\x611b5b324a620a0963'::bytea, response_headers = '[["x-note", "n\u001b]0;owned\u0007"]]'"#;
    const SEED: &'static str = r#"INSERT INTO idempotency_requests
         (tenant_id, operation, key_digest, fingerprint, state, response_status,
          response_headers, response_body, created_at, completed_at, expires_at)
       VALUES
         ('acme', 'create-order', sha256('k-done'::bytea), decode(repeat('ab', 32), 'hex'), 'completed', 201,
          '[["content-type", "application/json"], ["location", "/orders/7"]]',
          '{"secret":"SECRET-BODY-123"}',
          '2026-01-02 03:04:05+00', '2026-01-02 03:04:06+00', now() + interval '1 day'),
         ('acme', 'create-order', sha256('k-old'::bytea), decode(repeat('00', 32), 'hex'), 'failed', 404,
          NULL, 'gone', now() - interval '2 days', now() - interval '2 days',
          now() - interval '1 day'),
         ('acme', 'refund', sha256('k-running'::bytea), decode(repeat('00', 32), 'hex'), 'processing', NULL,
          NULL, NULL, now() - interval '5 minutes', NULL, now() + interval '1 day')"#;

    const EXPIRED_ROWS: &'static str = "INSERT INTO idempotency_requests \
           (tenant_id, operation, key_digest, fingerprint, state, response_status, \
            created_at, expires_at) \
         SELECT 'acme', 'pay', sha256(convert_to('old-' || i, 'UTF8')), decode(repeat('00', 32), 'hex'), 'completed', 201, \
                now() - interval '2 days', now() - interval '1 day' \
           FROM generate_series(1, 4) i";

    async fn create() -> Self {
        TestDb::new().await
    }

    fn url(&self) -> String {
        self.url.clone()
    }

    /// A plain CREATE DATABASE, no migration.
    async fn bare(&self) -> String {
        let bare = format!("{}_bare", self.name);
        self.exec(&format!("CREATE DATABASE {bare}")).await;
        self.url.replacen(&self.name, &bare, 1)
    }

    async fn drop_bare(&self) {
        self.exec(&format!("DROP DATABASE {}_bare WITH (FORCE)", self.name))
            .await;
    }
}

impl CliDb for SqliteDb {
    through_the_pool!();

    // The same rows in SQLite's columns: Unix milliseconds, BLOBs, JSON text.
    const TERMINAL_CONTROL_ANSWER: &'static str = r#"response_body = X'611b5b324a620a0963', response_headers = '[["x-note", "n\u001b]0;owned\u0007"]]'"#;
    const SEED: &'static str = concat!(
        r#"INSERT INTO idempotency_requests
             (tenant_id, operation, key_digest, fingerprint, state, response_status,
              response_headers, response_body, created_at, completed_at, expires_at)
           VALUES
             ('acme', 'create-order', X'62d2861dc10d138f44e7beb5074f0b7ce605922b403bf067c1f4eb3ccfa016c8', unhex(replace(hex(zeroblob(32)), '00', 'AB')),
              'completed', 201,
              '[["content-type","application/json"],["location","/orders/7"]]',
              CAST('{"secret":"SECRET-BODY-123"}' AS BLOB),
              unixepoch('2026-01-02 03:04:05') * 1000, unixepoch('2026-01-02 03:04:06') * 1000,
              "#,
        idem_runtime::sqlite_now_ms!(),
        r#" + 86400000),
             ('acme', 'create-order', X'b084ac54ffa13c78a77dce7bad936a19c66c287b91ca9d540bf59770474f2a5c', zeroblob(32), 'failed', 404,
              NULL, CAST('gone' AS BLOB), "#,
        idem_runtime::sqlite_now_ms!(),
        r#" - 2 * 86400000,
              "#,
        idem_runtime::sqlite_now_ms!(),
        r#" - 2 * 86400000, "#,
        idem_runtime::sqlite_now_ms!(),
        r#" - 86400000),
             ('acme', 'refund', X'e19536511e72950fbf054914c0b86cda66dc77e9dd6db7c47176fcd2bdec947c', zeroblob(32), 'processing', NULL,
              NULL, NULL, "#,
        idem_runtime::sqlite_now_ms!(),
        r#" - 300000, NULL, "#,
        idem_runtime::sqlite_now_ms!(),
        r#" + 86400000)"#
    );

    // A recursive CTE stands in for generate_series.
    const EXPIRED_ROWS: &'static str = concat!(
        "WITH RECURSIVE seq(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM seq WHERE i < 4) \
         INSERT INTO idempotency_requests \
           (tenant_id, operation, key_digest, fingerprint, state, response_status, \
            created_at, expires_at) \
         SELECT 'acme', 'pay', CAST(printf('%-32s', 'old-' || i) AS BLOB), zeroblob(32), 'completed', 201, ",
        idem_runtime::sqlite_now_ms!(),
        " - 2 * 86400000, ",
        idem_runtime::sqlite_now_ms!(),
        " - 86400000 FROM seq"
    );

    async fn create() -> Self {
        SqliteDb::new().await
    }

    fn url(&self) -> String {
        format!("sqlite:{}", self.path.display())
    }

    /// An application's SQLite file with a table of its own, not idem's.
    async fn bare(&self) -> String {
        let path = self.bare_path();
        let opts = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true);
        let pool = sqlx::SqlitePool::connect_with(opts).await.unwrap();
        sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
            .execute(&pool)
            .await
            .unwrap();
        pool.close().await;
        format!("sqlite:{}", path.display())
    }

    async fn drop_bare(&self) {
        remove_sqlite_files(&self.bare_path());
    }
}

#[cfg(feature = "mysql")]
impl CliDb for common::MySqlDb {
    through_the_pool!();

    // The same rows in MySQL's columns: Unix milliseconds (2026-01-02T03:04:05Z
    // is 1767323045000), VARBINARY, JSON text.
    // MySQL's string literals take a backslash as an escape: doubled.
    const TERMINAL_CONTROL_ANSWER: &'static str = r#"response_body = X'611b5b324a620a0963', response_headers = '[["x-note", "n\\u001b]0;owned\\u0007"]]'"#;
    const SEED: &'static str = concat!(
        r#"INSERT INTO idempotency_requests
             (tenant_id, operation, key_digest, fingerprint, state, response_status,
              response_headers, response_body, created_at, completed_at, expires_at)
           VALUES
             ('acme', 'create-order', UNHEX(SHA2('k-done', 256)), UNHEX(REPEAT('AB', 32)), 'completed', 201,
              '[["content-type","application/json"],["location","/orders/7"]]',
              '{"secret":"SECRET-BODY-123"}', 1767323045000, 1767323046000,
              "#,
        idem_runtime::mysql_now_ms!(),
        r#" + 86400000),
             ('acme', 'create-order', UNHEX(SHA2('k-old', 256)), UNHEX(REPEAT('00', 32)), 'failed', 404,
              NULL, 'gone', "#,
        idem_runtime::mysql_now_ms!(),
        r#" - 2 * 86400000,
              "#,
        idem_runtime::mysql_now_ms!(),
        r#" - 2 * 86400000, "#,
        idem_runtime::mysql_now_ms!(),
        r#" - 86400000),
             ('acme', 'refund', UNHEX(SHA2('k-running', 256)), UNHEX(REPEAT('00', 32)), 'processing', NULL,
              NULL, NULL, "#,
        idem_runtime::mysql_now_ms!(),
        r#" - 300000, NULL, "#,
        idem_runtime::mysql_now_ms!(),
        r#" + 86400000)"#
    );

    const EXPIRED_ROWS: &'static str = concat!(
        "INSERT INTO idempotency_requests \
           (tenant_id, operation, key_digest, fingerprint, state, response_status, \
            created_at, expires_at) \
         SELECT 'acme', 'pay', UNHEX(SHA2(CONCAT('old-', i), 256)), UNHEX(REPEAT('00', 32)), 'completed', 201, ",
        idem_runtime::mysql_now_ms!(),
        " - 2 * 86400000, ",
        idem_runtime::mysql_now_ms!(),
        " - 86400000 FROM (SELECT 1 AS i UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4) seq"
    );

    async fn create() -> Self {
        common::MySqlDb::new().await
    }

    fn url(&self) -> String {
        self.url.clone()
    }

    /// A plain CREATE DATABASE, no migration.
    async fn bare(&self) -> String {
        let bare = format!("{}_bare", self.name);
        self.exec(&format!("CREATE DATABASE {bare}")).await;
        self.url.replacen(&self.name, &bare, 1)
    }

    async fn drop_bare(&self) {
        self.exec(&format!("DROP DATABASE IF EXISTS {}_bare", self.name))
            .await;
    }
}

impl SqliteDb {
    fn bare_path(&self) -> PathBuf {
        self.path.with_extension("bare.db")
    }
}

/// Removes a SQLite file and the files SQLite keeps beside it.
fn remove_sqlite_files(path: &Path) {
    for suffix in ["", "-wal", "-shm", "-journal"] {
        let mut p = path.to_owned().into_os_string();
        p.push(suffix);
        let _ = std::fs::remove_file(p);
    }
}

// The behaviour every backend shares, written once as generic tests over
// [`CliDb`] and stamped per backend by `cli_suite!`.

async fn seeded<Db: CliDb>() -> Db {
    let db = Db::create().await;
    db.exec(Db::SEED).await;
    db
}

async fn a_fresh_database_says_run_migrate_and_migrate_fixes_it<Db: CliDb>() {
    let db = Db::create().await;
    let url = db.bare().await;
    let url = Some(url.as_str());

    for args in [
        &["stats"][..],
        &["show", "acme", "op", "k"],
        &["purge", "acme", "op", "k"],
        &["sweep"],
        &["sweep", "--once"],
        &["--json", "stats"],
    ] {
        let out = idem(url, args).await;
        out.assert_error(6, "run `idem migrate`");
    }

    let out = idem(url, &["migrate"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    assert!(out.stdout.contains("idempotency requests"), "{out:?}");
    assert!(out.stdout.contains("applied now"), "{out:?}");
    assert!(!out.stdout.contains("  already applied"), "{out:?}");

    // Again: nothing to do, and the JSON says so.
    let out = idem(url, &["migrate", "--json"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    let migrations = out.json()["migrations"].as_array().unwrap().clone();
    assert!(!migrations.is_empty());
    assert!(
        migrations
            .iter()
            .all(|m| m["applied_now"] == false && m["version"].is_i64())
    );

    let out = idem(url, &["stats", "--json"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(out.json()["rows"], 0);
    db.drop_bare().await;
}

async fn stats_prints_a_table_and_json<Db: CliDb>() {
    let db = seeded::<Db>().await;
    let url = db.url();
    let url = Some(url.as_str());
    let out = idem(url, &["stats"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    let line = |label: &str| {
        out.stdout
            .lines()
            .find(|l| l.starts_with(label))
            .unwrap_or_else(|| panic!("no {label:?} line: {out:?}"))
            .split_whitespace()
            .collect::<Vec<_>>()
    };
    assert_eq!(line("rows"), ["rows", "3"]);
    assert_eq!(
        line("expired, not swept"),
        ["expired,", "not", "swept", "1"]
    );
    assert_eq!(
        line("oldest valid row")[3],
        "2026-01-02T03:04:05Z",
        "{out:?}"
    );
    assert!(out.stdout.contains("OPERATION"), "{out:?}");
    let create = line("create-order");
    // OPERATION ROWS PROCESSING COMPLETED FAILED UNCERTAIN EXPIRED BYTES
    assert_eq!(create[..7], ["create-order", "2", "0", "1", "1", "0", "1"]);
    assert_eq!(line("refund")[..3], ["refund", "1", "1"]);

    // --json after the subcommand works as well as before it.
    for args in [&["stats", "--json"][..], &["--json", "stats"]] {
        let out = idem(url, args).await;
        assert_eq!(out.code, 0, "{out:?}");
        let j = out.json();
        assert_eq!(j["rows"], 3);
        assert_eq!(j["by_state"]["completed"], 1);
        assert_eq!(j["by_state"]["processing"], 1);
        assert_eq!(j["expired_unswept"], 1);
        assert_eq!(j["oldest_valid_created_at"], "2026-01-02T03:04:05Z");
        assert_eq!(j["by_operation"][0]["operation"], "create-order");
        assert!(j["stored_bytes"].as_u64().unwrap() > 0);
    }
}

async fn show_prints_one_key_without_its_body_unless_asked<Db: CliDb>() {
    let db = seeded::<Db>().await;
    let url = db.url();
    let url = Some(url.as_str());

    let out = idem(url, &["show", "acme", "create-order", "k-done"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    for expected in [
        "key digest        62d2861dc10d138f44e7beb5074f0b7ce605922b403bf067c1f4eb3ccfa016c8",
        "state             completed",
        "generation        1",
        "created at        2026-01-02T03:04:05Z",
        "completed at      2026-01-02T03:04:06Z",
        "status            201",
        "body bytes        28",
        "headers           content-type, location",
    ] {
        assert!(out.stdout.contains(expected), "{expected:?} in {out:?}");
    }
    assert!(!out.stdout.contains("SECRET-BODY-123"), "{out:?}");
    assert!(!out.stdout.contains("/orders/7"), "{out:?}");

    let out = idem(url, &["show", "acme", "create-order", "k-done", "--json"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    let j = out.json();
    assert_eq!(
        j["key_digest"],
        "62d2861dc10d138f44e7beb5074f0b7ce605922b403bf067c1f4eb3ccfa016c8"
    );
    assert!(j.get("key").is_none(), "the key itself is never shown: {j}");
    assert_eq!(j["state"], "completed");
    assert_eq!(j["response_status"], 201);
    assert_eq!(j["body_bytes"], 28);
    assert_eq!(j["fingerprint"], "ab".repeat(32));
    assert_eq!(j["expired"], false);
    assert_eq!(
        j["expires_at"].as_str().unwrap().len(),
        "2026-01-02T03:04:05Z".len()
    );
    assert_eq!(j["lease_expires_at"], Value::Null);
    assert_eq!(j["header_names"][1], "location");
    assert!(j.get("body").is_none() && j.get("headers").is_none(), "{j}");
    assert!(!out.stdout.contains("SECRET-BODY-123"));

    let out = idem(url, &["show", "acme", "create-order", "k-done", "--body"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    assert!(
        out.stdout.contains("{\"secret\":\"SECRET-BODY-123\"}"),
        "{out:?}"
    );
    assert!(out.stdout.contains("location: /orders/7"), "{out:?}");

    let out = idem(
        url,
        &["--json", "show", "acme", "create-order", "k-done", "--body"],
    )
    .await;
    let j = out.json();
    assert_eq!(j["body"], "{\"secret\":\"SECRET-BODY-123\"}");
    assert_eq!(j["headers"][1][1], "/orders/7");

    // What a response echoed from a client reaches the operator's terminal
    // escaped (its lines and tabs kept); the JSON document holds it as it is.
    db.exec(&format!(
        "UPDATE idempotency_requests SET {} WHERE key_digest = {}",
        Db::TERMINAL_CONTROL_ANSWER,
        db.key("k-done")
    ))
    .await;
    let out = idem(url, &["show", "acme", "create-order", "k-done", "--body"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    assert!(!out.stdout.contains(['\u{1b}', '\u{7}']), "{out:?}");
    assert!(out.stdout.contains("a\\u{1b}[2Jb\n\tc"), "{out:?}");
    assert!(
        out.stdout.contains("x-note: n\\u{1b}]0;owned\\u{7}"),
        "{out:?}"
    );
    let out = idem(
        url,
        &["--json", "show", "acme", "create-order", "k-done", "--body"],
    )
    .await;
    let j = out.json();
    assert_eq!(j["body"], "a\u{1b}[2Jb\n\tc");
    assert_eq!(j["headers"][0][1], "n\u{1b}]0;owned\u{7}");

    let out = idem(url, &["show", "acme", "refund", "k-running", "--json"]).await;
    let j = out.json();
    assert_eq!(j["state"], "processing");
    assert_eq!(j["response_status"], Value::Null);
    assert_eq!(j["body_bytes"], Value::Null);
    assert_eq!(j["completed_at"], Value::Null);

    let out = idem(url, &["show", "acme", "create-order", "k-old", "--json"]).await;
    assert_eq!(out.json()["expired"], true);

    // The key is scoped by tenant and operation: each part must match.
    for args in [
        &["show", "acme", "create-order", "nope"][..],
        &["show", "globex", "create-order", "k-done"],
        &["show", "acme", "refund", "k-done"],
        &["show", "acme", "create-order", "nope", "--json"],
    ] {
        idem(url, args).await.assert_error(3, "no row for tenant");
    }

    // Headers that are JSON but not idem's pairs (written by another tool):
    // a row the CLI cannot read, and nothing of what they hold in the error.
    db.exec(&format!(
        "UPDATE idempotency_requests SET response_headers = '[\"x-api-token: s3cret\"]' \
          WHERE key_digest = {}",
        db.key("k-done")
    ))
    .await;
    let out = idem(url, &["show", "acme", "create-order", "k-done"]).await;
    out.assert_error(1, "stored headers unreadable");
    assert!(!out.stderr.contains("s3cret"), "{out:?}");
}

/// The table holds digests: the CLI digests the key it is given (either
/// spelling), or takes the digest itself, and never echoes a bad key.
async fn keys_are_digested_or_given_as_digests<Db: CliDb>() {
    let db = seeded::<Db>().await;
    let url = db.url();
    let url = Some(url.as_str());
    let digest = "62d2861dc10d138f44e7beb5074f0b7ce605922b403bf067c1f4eb3ccfa016c8";
    for args in [
        &["--json", "show", "acme", "create-order", "\"k-done\""][..],
        &["--json", "show", "acme", "create-order", digest, "--digest"],
        &[
            "--json",
            "show",
            "acme",
            "create-order",
            &digest.to_uppercase(),
            "--digest",
        ],
    ] {
        let out = idem(url, args).await;
        assert_eq!(out.code, 0, "{args:?}: {out:?}");
        assert_eq!(out.json()["key_digest"], digest, "{args:?}");
    }
    // The key itself, given as if it were a digest, is not one.
    let out = idem(url, &["show", "acme", "create-order", "k-done", "--digest"]).await;
    out.assert_error(2, "64 hexadecimal digits");
    // A key no client could send is refused, and not echoed.
    let out = idem(
        url,
        &["show", "acme", "create-order", "sk_live_bad\u{1}key"],
    )
    .await;
    out.assert_error(2, "not a valid key");
    assert!(!out.stderr.contains("sk_live_bad"), "{out:?}");
    // A row that is not there is named by its digest, not by its key.
    let out = idem(url, &["show", "acme", "create-order", "sk_live_absent"]).await;
    out.assert_error(3, "key digest");
    assert!(!out.stderr.contains("sk_live_absent"), "{out:?}");
    // Purge by digest, then the row is gone.
    let out = idem(
        url,
        &[
            "purge",
            "acme",
            "create-order",
            digest,
            "--digest",
            "--json",
        ],
    )
    .await;
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(out.json()["key_digest"], digest);
    assert_eq!(exists(&db, "k-done").await, 0);
}

async fn exists<Db: CliDb>(db: &Db, key: &str) -> i64 {
    db.count(&format!(
        "SELECT count(*) FROM idempotency_requests WHERE key_digest = {}",
        db.key(key)
    ))
    .await
}

async fn purge_refuses_in_flight_rows_without_force<Db: CliDb>() {
    let db = seeded::<Db>().await;
    let url = db.url();
    let url = Some(url.as_str());

    let out = idem(url, &["purge", "acme", "refund", "k-running"]).await;
    out.assert_error(4, "--force");
    assert!(out.stderr.contains("processing"), "{out:?}");
    assert_eq!(exists(&db, "k-running").await, 1);

    let out = idem(url, &["purge", "acme", "refund", "k-running", "--force"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    assert!(out.stdout.contains("processing (generation 1)"), "{out:?}");
    assert_eq!(exists(&db, "k-running").await, 0);

    // A finished row needs no --force.
    let out = idem(url, &["--json", "purge", "acme", "create-order", "k-old"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    let j = out.json();
    assert_eq!(j["purged"], true);
    assert_eq!(j["state"], "failed");
    assert_eq!(exists(&db, "k-old").await, 0);

    idem(url, &["purge", "acme", "create-order", "k-old"])
        .await
        .assert_error(3, "no row for tenant");

    // An uncertain row is refused as well.
    db.exec(&format!(
        "UPDATE idempotency_requests SET state = 'uncertain', response_status = NULL \
         WHERE key_digest = {}",
        db.key("k-done")
    ))
    .await;
    idem(url, &["purge", "acme", "create-order", "k-done"])
        .await
        .assert_error(4, "uncertain");
    assert_eq!(exists(&db, "k-done").await, 1);
}

/// `purge --tenant` erases every row of the tenant but those in flight,
/// says how many it left (exit 4), and takes them too with --force;
/// another tenant's rows stay.
async fn purge_tenant_erases_every_row_of_one_tenant<Db: CliDb>() {
    let db = seeded::<Db>().await;
    let url = db.url();
    let url = Some(url.as_str());
    db.exec(&format!(
        "INSERT INTO idempotency_requests \
            (tenant_id, operation, key_digest, fingerprint, state, response_status, \
             created_at, expires_at) \
         SELECT 'globex', operation, key_digest, fingerprint, state, response_status, \
                created_at, expires_at \
           FROM idempotency_requests WHERE key_digest = {}",
        db.key("k-done")
    ))
    .await;
    let rows_of = |tenant: &'static str| {
        let db = &db;
        async move {
            db.count(&format!(
                "SELECT count(*) FROM idempotency_requests WHERE tenant_id = '{tenant}'"
            ))
            .await
        }
    };

    // k-done and k-old go; k-running, in flight, is left and counted, in
    // the JSON document too (printed with the refusal's exit 4).
    let out = idem(url, &["--json", "purge", "--tenant", "acme"]).await;
    assert_eq!(out.code, 4, "{out:?}");
    assert!(
        out.stderr
            .starts_with("idem: error: erased 2 rows of tenant \"acme\"; 1 were left"),
        "{out:?}"
    );
    assert!(out.stderr.contains("--force"), "{out:?}");
    let j = out.json();
    assert_eq!(
        (j["erased"].as_u64(), j["left"].as_u64()),
        (Some(2), Some(1))
    );
    assert_eq!(rows_of("acme").await, 1);
    let out = idem(url, &["purge", "--tenant", "acme"]).await;
    out.assert_error(4, "erased 0 rows of tenant \"acme\"; 1 were left");
    assert!(out.stdout.is_empty(), "a table only on success: {out:?}");
    assert_eq!(exists(&db, "k-running").await, 1);

    let out = idem(url, &["--json", "purge", "--tenant", "acme", "--force"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    let j = out.json();
    assert_eq!(
        (j["erased"].as_u64(), j["left"].as_u64()),
        (Some(1), Some(0))
    );
    assert_eq!(rows_of("acme").await, 0);
    assert_eq!(rows_of("globex").await, 1, "another tenant's row stays");

    // Nothing left: a plain table, exit 0.
    let out = idem(url, &["purge", "--tenant", "acme", "--wait", "1"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    assert!(out.stdout.contains("erased"), "{out:?}");

    // One key or a whole tenant, never both; --wait only with --tenant.
    for args in [
        &[
            "purge",
            "acme",
            "create-order",
            "k-done",
            "--tenant",
            "acme",
        ][..],
        &["purge", "globex", "create-order", "k-done", "--wait", "1"],
        &[
            "purge",
            "--tenant",
            "globex",
            "--wait",
            "18446744073709551615",
        ],
        // An empty tenant is no tenant: a usage error, not a database one.
        &["purge", "--tenant", ""],
    ] {
        let out = idem(url, args).await;
        assert_eq!(out.code, 2, "{args:?}: {out:?}");
    }
    assert_eq!(rows_of("globex").await, 1);
}

async fn rekey_reseals_answers_under_the_active_key_and_names_what_it_cannot<Db: CliDb>() {
    let db = Db::create().await;
    let url = db.url();
    let url = Some(url.as_str());
    let k1 = idem_runtime::KeyRing::parse(K1, None).unwrap();
    for key in ["r-1", "r-2", "r-3"] {
        db.sealed_answer(&k1, key).await;
    }
    let rotated = format!("{K1},{K2}");
    let env = [
        ("IDEM_KEY_RING", rotated.as_str()),
        ("IDEM_ACTIVE_KEY", "k2"),
    ];
    let out = idem_with(url, &["rekey", "--batch-size", "2"], &env).await;
    assert_eq!(out.code, 0, "{out:?}");
    assert!(out.stdout.contains("rows under key k2"), "{out:?}");
    assert!(!out.stdout.contains("rows under key k1"), "{out:?}");
    assert!(out.stderr.contains("rekey: page 2: 3 re-sealed"), "{out:?}");

    // Again: nothing to do, and the JSON says where every row is.
    let out = idem_with(url, &["--json", "rekey"], &env).await;
    assert_eq!(out.code, 0, "{out:?}");
    let j = out.json();
    assert_eq!(j["resealed"], 0);
    assert_eq!(
        j["rows_by_key"],
        serde_json::json!([{"key_id": "k2", "rows": 3}])
    );

    // A ring without the key that sealed them: named, and left alone.
    let out = idem_with(url, &["rekey"], &[("IDEM_KEY_RING", K3)]).await;
    assert_eq!(out.code, 4, "{out:?}");
    assert!(out.stdout.is_empty(), "{out:?}");
    assert!(out.stderr.contains("rekey: page 1: 0 re-sealed"), "{out:?}");
    assert!(
        out.stderr
            .contains("3 sealed with key \"k2\", which the ring lacks"),
        "{out:?}"
    );
    // With --json, the report of what was done comes with the refusal.
    let out = idem_with(url, &["--json", "rekey"], &[("IDEM_KEY_RING", K3)]).await;
    assert_eq!(out.code, 4, "{out:?}");
    assert!(out.stderr.contains("which the ring lacks"), "{out:?}");
    let j = out.json();
    assert_eq!(
        (&j["resealed"], &j["unreadable"]),
        (&0.into(), &serde_json::json!({"k2": 3})),
        "{out:?}"
    );
    let out = idem_with(url, &["--json", "rekey"], &env).await;
    assert_eq!(out.json()["rows_by_key"][0]["rows"], 3, "{out:?}");

    // A key file: its `active` line decides; an IDEM_ACTIVE_KEY that names
    // another key is a usage error, not silently overruled.
    let file = std::env::temp_dir().join(format!(
        "idem-cli-ring-{}-{:x}",
        std::process::id(),
        std::hash::BuildHasher::hash_one(&std::hash::RandomState::new(), url)
    ));
    let line = |k: &str| k.replacen(':', " ", 1);
    std::fs::write(&file, format!("{}\n{}\nactive k1\n", line(K1), line(K2))).unwrap();
    let path = file.to_str().unwrap();
    let out = idem_with(
        url,
        &["rekey", "--key-ring-file", path],
        &[("IDEM_ACTIVE_KEY", "k2")],
    )
    .await;
    out.assert_error(
        2,
        "IDEM_ACTIVE_KEY names \"k2\" but the key file's active key is \"k1\"",
    );
    // A key pasted where its id belongs is not echoed into a log.
    let pasted = K2.split_once(':').unwrap().1;
    let out = idem_with(
        url,
        &["rekey", "--key-ring-file", path],
        &[("IDEM_ACTIVE_KEY", pasted)],
    )
    .await;
    out.assert_error(
        2,
        "IDEM_ACTIVE_KEY names a key id the key file does not hold but the key file's active key is \"k1\"",
    );
    assert!(!out.stderr.contains(pasted), "{out:?}");
    let out = idem_with(url, &["--json", "rekey", "--key-ring-file", path], &[]).await;
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(
        out.json()["rows_by_key"],
        serde_json::json!([{"key_id": "k1", "rows": 3}])
    );
    std::fs::remove_file(&file).unwrap();

    // No ring at all, or a broken one: usage errors.
    let out = idem_with(url, &["rekey"], &[]).await;
    out.assert_error(2, "needs the key ring");
    let out = idem_with(url, &["rekey"], &[("IDEM_KEY_RING", "k1:c2hvcnQ=")]).await;
    out.assert_error(2, "\"k1\" is 5 bytes long");
}

/// `rekey --refuse-clear` treats answers stored in clear as a ring that
/// refuses them does: counted as broken and left in clear, never sealed, even
/// with `--seal-clear` (exit 4); `--seal-clear` alone seals them. A message
/// consumer's record is left in clear and counted apart, not broken.
async fn rekey_refuse_clear_leaves_clear_answers_unsealed<Db: CliDb>() {
    let db = seeded::<Db>().await;
    let url = db.url();
    let url = Some(url.as_str());
    let env = [("IDEM_KEY_RING", K1)];
    let out = idem_with(url, &["rekey", "--seal-clear", "--refuse-clear"], &env).await;
    assert_eq!(out.code, 4, "{out:?}");
    assert!(out.stderr.contains("2 that do not open"), "{out:?}");
    assert!(out.stderr.contains("in clear and refused"), "{out:?}");
    let out = idem_with(url, &["--json", "rekey"], &env).await;
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(
        out.json()["rows_by_key"],
        serde_json::json!([{"key_id": null, "rows": 2}])
    );
    let out = idem_with(url, &["--json", "rekey", "--seal-clear"], &env).await;
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(
        out.json()["rows_by_key"],
        serde_json::json!([{"key_id": "k1", "rows": 2}])
    );
    // A message consumer's record holds no answer: left in clear and counted
    // apart, never refused.
    db.message_record("evt-1").await;
    let out = idem_with(url, &["--json", "rekey", "--refuse-clear"], &env).await;
    assert_eq!(out.code, 0, "{out:?}");
    let report = out.json();
    assert_eq!(
        (&report["messages"], &report["broken"]),
        (&1.into(), &0.into())
    );
    let out = idem_with(url, &["rekey", "--refuse-clear"], &env).await;
    assert_eq!(out.code, 0, "{out:?}");
    assert!(
        out.stdout.contains("message records (left in clear)"),
        "{out:?}"
    );
}

/// `idem [first..] purge --tenant acme --wait 120` over the seeded rows,
/// running, once its first pass has erased the finished ones (`k-done`) and
/// left the one in flight (`k-running`) to wait for.
async fn past_the_first_pass<Db: CliDb>(
    db: &Db,
    first: &[&str],
) -> tokio::task::JoinHandle<std::io::Result<std::process::Output>> {
    let waiting = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(first)
        .args(["purge", "--tenant", "acme", "--wait", "120"])
        .env("DATABASE_URL", db.url())
        .output();
    let waiting = tokio::spawn(waiting);
    tokio::time::timeout(std::time::Duration::from_secs(60), async {
        while exists(db, "k-done").await == 1 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the first pass ran");
    waiting
}

/// `purge --tenant --wait` erases a row in flight once it finishes: the
/// first pass leaves it (the finished rows going show the pass ran), the
/// row is then completed, and a later pass takes it.
async fn purge_tenant_waits_for_rows_in_flight_to_finish<Db: CliDb>() {
    let db = seeded::<Db>().await;
    let waiting = past_the_first_pass(&db, &["--json"]).await;
    assert!(!waiting.is_finished(), "it waits while a row is in flight");
    db.exec(&format!(
        "UPDATE idempotency_requests SET state = 'completed', response_status = 201 \
         WHERE key_digest = {}",
        db.key("k-running")
    ))
    .await;
    let out = Out::of(waiting.await.unwrap().unwrap());
    assert_eq!(out.code, 0, "{out:?}");
    let j = out.json();
    assert_eq!(
        (j["erased"].as_u64(), j["left"].as_u64()),
        (Some(3), Some(0))
    );
    assert_eq!(exists(&db, "k-running").await, 0);
}

async fn purge_does_not_wait_forever_on_a_running_request<Db: CliDb>() {
    let db = seeded::<Db>().await;
    let url = db.url();
    let url = Some(url.as_str());
    // A request re-using the key is in the middle of its transaction, as a
    // claim leaves it: on PostgreSQL it holds the row, on SQLite the
    // database's write lock. It stays so until the CLI has exited.
    let out = db
        .while_held(
            "k-done",
            idem(url, &["purge", "acme", "create-order", "k-done", "--force"]),
        )
        .await;
    out.assert_error(4, "locked by a request that is running now");
    assert!(out.stderr.contains("nothing was purged"), "{out:?}");
    assert_eq!(exists(&db, "k-done").await, 1);

    let out = idem(url, &["purge", "acme", "create-order", "k-done"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(exists(&db, "k-done").await, 0);
}

async fn sweep_deletes_the_expired_finished_rows_once_and_reports<Db: CliDb>() {
    let db = seeded::<Db>().await;
    db.exec(Db::EXPIRED_ROWS).await;
    let url = db.url();
    let url = Some(url.as_str());

    // An age past a century is a usage error, before anything is deleted.
    let out = idem(
        url,
        &["sweep", "--stale-after-secs", "18446744073709551615"],
    )
    .await;
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("--stale-after-secs"), "{out:?}");
    assert!(out.stderr.contains("3155760000"), "{out:?}");
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests").await,
        7
    );

    // One pass, then exit: no flag needed for that.
    let out = idem(url, &["sweep", "--batch-size", "2"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    let field = |label: &str| {
        out.stdout
            .lines()
            .find_map(|l| l.strip_prefix(label))
            .unwrap_or_else(|| panic!("no {label:?} in {out:?}"))
            .trim()
            .to_owned()
    };
    // 5 expired finished rows (k-old and old-1..4), two per batch: 2 + 2 + 1.
    assert_eq!(field("deleted"), "5");
    assert_eq!(field("batches"), "3");
    assert_eq!(field("backlog"), "0");
    assert_eq!(field("stale in flight"), "0");
    // The running row was created five minutes ago.
    assert!(field("oldest in flight").starts_with("5m "), "{out:?}");
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests").await,
        2
    );

    // --stale-after-secs below the running row's age reports it, and still
    // deletes nothing in flight. `--once`, which the command used to
    // require, is still accepted and changes nothing.
    let out = idem(
        url,
        &["sweep", "--once", "--stale-after-secs", "60", "--json"],
    )
    .await;
    assert_eq!(out.code, 0, "{out:?}");
    let j = out.json();
    assert_eq!(j["deleted"], 0);
    assert_eq!(j["batches"], 1);
    assert_eq!(j["stale_in_flight"], 1);
    assert!(j["oldest_in_flight_seconds"].as_f64().unwrap() >= 300.0);
    assert_eq!(
        db.count("SELECT count(*) FROM idempotency_requests").await,
        2
    );

    // Nothing left: a plain `idem sweep` is one pass too, and returns.
    let out = idem(url, &["sweep", "--json"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(out.json()["deleted"], 0);
    assert_eq!(out.json()["batches"], 1);
}

async fn the_flag_wins_over_the_environment<Db: CliDb>() {
    let db = Db::create().await;
    let out = idem(
        Some("postgres://postgres@127.0.0.1:1/postgres"),
        &["--database-url", &db.url(), "stats", "--json"],
    )
    .await;
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(out.json()["rows"], 0);
}

/// A standard error closed by its reader (`2>&1 | head -3`, a log reader
/// that quit) does not stop a rotation half-way: every row is re-sealed and
/// the report is printed, exit 0.
async fn rekey_goes_on_when_its_standard_error_is_closed<Db: CliDb>() {
    let db = Db::create().await;
    let k1 = idem_runtime::KeyRing::parse(K1, None).unwrap();
    for key in ["e-1", "e-2", "e-3"] {
        db.sealed_answer(&k1, key).await;
    }
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["--json", "rekey", "--batch-size", "1"])
        .env("DATABASE_URL", db.url())
        .env("IDEM_KEY_RING", format!("{K1},{K2}"))
        .env("IDEM_ACTIVE_KEY", "k2")
        .stdout(std::process::Stdio::piped())
        // Spawned, not `output()`, which would pipe standard error anew.
        .stderr(std::process::Stdio::from(writer))
        .spawn()
        .expect("the idem binary runs")
        .wait_with_output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["resealed"], 3, "{report}");
}

/// Stamps each shared test once per backend: `postgres::<name>`,
/// `sqlite::<name>` and, with the feature `mysql`, `mysql::<name>`.
macro_rules! cli_suite {
    ($($test:ident),* $(,)?) => {
        mod postgres {
            $(
                #[tokio::test]
                async fn $test() {
                    super::$test::<crate::common::TestDb>().await
                }
            )*
        }
        mod sqlite {
            $(
                #[tokio::test]
                async fn $test() {
                    super::$test::<crate::common::SqliteDb>().await
                }
            )*
        }
        #[cfg(feature = "mysql")]
        mod mysql {
            $(
                #[tokio::test]
                async fn $test() {
                    super::$test::<crate::common::MySqlDb>().await
                }
            )*
        }
    };
}

cli_suite!(
    a_fresh_database_says_run_migrate_and_migrate_fixes_it,
    stats_prints_a_table_and_json,
    show_prints_one_key_without_its_body_unless_asked,
    keys_are_digested_or_given_as_digests,
    purge_refuses_in_flight_rows_without_force,
    purge_tenant_erases_every_row_of_one_tenant,
    rekey_reseals_answers_under_the_active_key_and_names_what_it_cannot,
    rekey_refuse_clear_leaves_clear_answers_unsealed,
    rekey_goes_on_when_its_standard_error_is_closed,
    purge_tenant_waits_for_rows_in_flight_to_finish,
    purge_does_not_wait_forever_on_a_running_request,
    sweep_deletes_the_expired_finished_rows_once_and_reports,
    the_flag_wins_over_the_environment,
);

/// What only SQLite allows: a value of another type in a typed column (it
/// does not enforce them). A row the CLI cannot read (exit 1, as documented),
/// not a database error, and the value is not echoed.
#[tokio::test]
async fn sqlite_a_column_of_another_type_is_a_row_the_cli_cannot_read() {
    let db = seeded::<common::SqliteDb>().await;
    db.exec(&format!(
        "UPDATE idempotency_requests SET generation = 'gen-s3cret' WHERE key_digest = {}",
        db.key("k-done")
    ))
    .await;
    let url = db.url();
    let out = idem(Some(&url), &["show", "acme", "create-order", "k-done"]).await;
    out.assert_error(1, "a stored row the CLI cannot read");
    assert!(!out.stderr.contains("s3cret"), "{out:?}");
}

/// What only PostgreSQL has: a server to reach and to authenticate with.
#[tokio::test]
async fn postgres_connection_problems_are_one_clear_line() {
    // Nothing listens on port 1; the password must not be echoed.
    let out = idem(
        None,
        &[
            "--database-url",
            "postgres://postgres:hunter2@127.0.0.1:1/postgres",
            "stats",
        ],
    )
    .await;
    out.assert_error(5, "cannot reach the database");
    assert!(!out.stderr.contains("hunter2"), "{out:?}");
    // The server answers, but the database does not exist.
    let admin = common::admin_url();
    let (server, _) = admin.rsplit_once('/').unwrap();
    let missing = format!("{server}/idem_no_such_database");
    idem(Some(&missing), &["show", "a", "b", "c"])
        .await
        .assert_error(5, "does not exist");
}

/// What only a MySQL server has: a database that may not exist, and
/// `mariadb://` for the same protocol.
#[cfg(feature = "mysql")]
#[tokio::test]
async fn mysql_connection_problems_are_one_clear_line() {
    let out = idem(
        None,
        &[
            "--database-url",
            "mysql://root:hunter2@127.0.0.1:1/x",
            "stats",
        ],
    )
    .await;
    out.assert_error(5, "cannot reach the database");
    assert!(!out.stderr.contains("hunter2"), "{out:?}");
    let admin = common::mysql_admin_url();
    let (server, _) = admin.rsplit_once('/').unwrap();
    idem(
        Some(&format!("{server}/idem_no_such_database")),
        &["show", "a", "b", "c"],
    )
    .await
    .assert_error(5, "Unknown database");
    let db = common::MySqlDb::new().await;
    let mariadb = db.url.replacen("mysql://", "mariadb://", 1);
    let out = idem(Some(&mariadb), &["--json", "stats"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(out.json()["rows"], 0);
}

/// A path of its own in the temporary directory, with nothing there; whatever
/// SQLite might leave there is removed when the test ends.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        static N: AtomicU32 = AtomicU32::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let path = std::env::temp_dir().join(format!(
            "idem_cli_{tag}_{}_{}_{nanos}.db",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        assert!(!path.exists());
        Scratch(path)
    }

    /// The file and the files SQLite keeps beside it that exist now.
    fn present(&self) -> Vec<PathBuf> {
        ["", "-wal", "-shm", "-journal"]
            .iter()
            .map(|suffix| {
                let mut p = self.0.clone().into_os_string();
                p.push(suffix);
                PathBuf::from(p)
            })
            .filter(|p| p.exists())
            .collect()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        remove_sqlite_files(&self.0);
    }
}

#[tokio::test]
async fn a_missing_sqlite_file_is_reported_and_never_created() {
    let missing = Scratch::new("missing");
    let path = missing.0.display().to_string();
    for url in [format!("sqlite:{path}"), format!("sqlite://{path}")] {
        for args in [
            &["stats"][..],
            &["--json", "stats"],
            &["show", "acme", "op", "k"],
            &["purge", "acme", "op", "k", "--force"],
            &["sweep", "--once"],
        ] {
            let out = idem(Some(&url), args).await;
            out.assert_error(5, "does not exist");
            // Which file, and what would create it.
            assert!(out.stderr.contains(&path), "{out:?}");
            assert!(out.stderr.contains("idem migrate"), "{out:?}");
            assert_eq!(missing.present(), Vec::<PathBuf>::new(), "after {args:?}");
        }
    }
    // Even when the URL asks SQLite to create it (sqlx's `mode=rwc`).
    let out = idem(Some(&format!("sqlite:{path}?mode=rwc")), &["stats"]).await;
    out.assert_error(5, "does not exist");
    assert_eq!(missing.present(), Vec::<PathBuf>::new());
}

#[tokio::test]
async fn migrate_creates_a_missing_sqlite_file() {
    let file = Scratch::new("created");
    let url = format!("sqlite://{}", file.0.display());
    let out = idem(Some(&url), &["migrate"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    assert!(out.stdout.contains("idempotency requests"), "{out:?}");
    assert!(file.0.is_file());
    let out = idem(Some(&url), &["--json", "stats"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(out.json()["rows"], 0);
}

#[tokio::test]
async fn a_file_that_is_not_a_sqlite_database_is_a_database_error() {
    let file = Scratch::new("not_sqlite");
    std::fs::write(
        &file.0,
        "not a database, but long enough to hold a header: ".repeat(4),
    )
    .unwrap();
    idem(Some(&format!("sqlite:{}", file.0.display())), &["stats"])
        .await
        .assert_error(5, "file is not a database");
}

/// What can be refused without the database is refused before it is
/// reached: the same usage error (exit 2) with no server there, where
/// reading them after connecting made each one exit 5, a connect timeout
/// later.
#[tokio::test]
async fn arguments_are_refused_before_the_database_is_reached() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let nowhere = format!("postgres://idem@127.0.0.1:{port}/nowhere");
    let cases: [(&[&str], &str); 4] = [
        (&["show", "acme", "pay", "has space"], "not a valid key"),
        (&["show", "acme", "pay", "zz", "--digest"], "--digest"),
        (
            &["purge", "acme", "pay", "k1", "--wait", "5"],
            "--wait goes with --tenant",
        ),
        (&["rekey"], "needs the key ring"),
    ];
    for (args, needle) in cases {
        idem(Some(&nowhere), args).await.assert_error(2, needle);
    }
}

/// A pass that fails after earlier passes erased rows says how many stay
/// erased (each pass commits its own): a record of the erasure is not left
/// at nothing done. Here deletes are refused (a trigger) while the erasure
/// waits for a row in flight, which then finishes.
#[tokio::test]
async fn purge_tenant_says_what_it_erased_before_a_failure() {
    let db = seeded::<crate::common::TestDb>().await;
    let waiting = past_the_first_pass(&db, &[]).await;
    db.exec(
        "CREATE FUNCTION refuse_deletes() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN RAISE EXCEPTION 'deletes refused'; END $$",
    )
    .await;
    db.exec(
        "CREATE TRIGGER refuse_deletes BEFORE DELETE ON idempotency_requests \
         FOR EACH ROW EXECUTE FUNCTION refuse_deletes()",
    )
    .await;
    db.exec(&format!(
        "UPDATE idempotency_requests SET state = 'completed', response_status = 201 \
         WHERE key_digest = {}",
        db.key("k-running")
    ))
    .await;
    let out = Out::of(waiting.await.unwrap().unwrap());
    out.assert_error(
        5,
        "after erasing 2 rows in earlier passes, which stay erased",
    );
    assert!(out.stderr.contains("deletes refused"), "{out:?}");
}

#[tokio::test]
async fn urls_that_cannot_work_are_usage_errors() {
    // No URL at all, or an empty variable (which counts as unset).
    idem(None, &["stats"])
        .await
        .assert_error(2, "--database-url or set DATABASE_URL");
    idem(Some(""), &["stats"])
        .await
        .assert_error(2, "--database-url or set DATABASE_URL");
    // A URL that does not parse, or is of neither backend.
    idem(None, &["--database-url", "not a url", "stats"])
        .await
        .assert_error(2, "invalid database URL");
    let out = idem(Some("redis://127.0.0.1/0"), &["stats"]).await;
    out.assert_error(2, "postgres://");
    assert!(out.stderr.contains("sqlite:"), "{out:?}");
    assert!(out.stderr.contains("mysql://"), "{out:?}");
    // SQLite without a file: nothing to inspect, and migrating it would vanish.
    for url in [
        "sqlite::memory:",
        "sqlite://:memory:",
        "sqlite:app.db?mode=memory",
    ] {
        idem(Some(url), &["migrate"])
            .await
            .assert_error(2, "in-memory");
    }
    for url in ["sqlite:", "sqlite://"] {
        idem(Some(url), &["stats"])
            .await
            .assert_error(2, "no file path");
    }
    idem(Some("sqlite:app.db?journal=off"), &["stats"])
        .await
        .assert_error(2, "invalid database URL");
}

#[tokio::test]
async fn usage_errors_are_clap_s_exit_2_and_help_is_0() {
    let out = idem(None, &["frobnicate"]).await;
    assert_eq!(out.code, 2, "{out:?}");
    let out = idem(None, &["show", "only-tenant"]).await;
    assert_eq!(out.code, 2, "{out:?}");
    let out = idem(None, &["--help"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    for cmd in ["migrate", "stats", "show", "purge", "sweep"] {
        assert!(out.stdout.contains(cmd), "{cmd} in {out:?}");
    }
    // The help says where the URL comes from when the flag is left out.
    assert!(out.stdout.contains("DATABASE_URL"), "{out:?}");
}

/// `idem check` speaks HTTP: its help does not offer the database's
/// `--database-url`, which every database command's help does.
#[tokio::test]
async fn check_does_not_offer_a_database_url() {
    let out = idem(None, &["check", "--help"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    assert!(out.stdout.contains("--url <URL>"), "{out:?}");
    assert!(!out.stdout.contains("--database-url"), "{out:?}");
    for cmd in ["show", "stats", "sweep"] {
        let out = idem(None, &[cmd, "--help"]).await;
        assert!(out.stdout.contains("--database-url"), "{cmd}: {out:?}");
    }
}

/// `DATABASE_URL` provides the URL: no usage line may then present
/// `--database-url` as a required argument (clap lists every argument it took
/// from the environment in the usage line of its errors).
#[tokio::test]
async fn the_environment_does_not_make_the_flag_look_required() {
    let url = Some("postgres://postgres@127.0.0.1:1/postgres");
    for args in [&["show", "only-tenant"][..], &["purge"], &["frobnicate"]] {
        let out = idem(url, args).await;
        assert_eq!(out.code, 2, "{args:?}: {out:?}");
        assert!(out.stderr.contains("Usage: idem"), "{args:?}: {out:?}");
        assert!(!out.stderr.contains("--database-url"), "{args:?}: {out:?}");
    }
    for args in [&["sweep", "--help"][..], &["show", "--help"]] {
        let out = idem(url, args).await;
        assert_eq!(out.code, 0, "{args:?}: {out:?}");
        let usage = out
            .stdout
            .lines()
            .find(|l| l.starts_with("Usage: "))
            .unwrap_or_else(|| panic!("no usage line: {out:?}"));
        assert!(!usage.contains("--database-url"), "{usage}");
        // Nothing in `sweep` is required: it runs one pass.
        assert!(!usage.contains("--once"), "{usage}");
    }
}
