//! The `idem` binary against a real PostgreSQL: every subcommand's output and exit
//! code, `--json` that parses, and the documented error cases.

#[path = "../../tests/common/mod.rs"]
mod common;

use common::TestDb;
use serde_json::Value;

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

impl std::fmt::Debug for Out {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {}\n--- stdout\n{}--- stderr\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

impl Out {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("{e}: {self:?}"))
    }

    /// The documented error shape: exactly one line on stderr, nothing on stdout,
    /// no panic.
    fn assert_error(&self, code: i32, needle: &str) {
        assert_eq!(self.code, code, "{self:?}");
        assert_eq!(self.stderr.lines().count(), 1, "{self:?}");
        assert!(self.stderr.starts_with("idem: error: "), "{self:?}");
        assert!(self.stderr.contains(needle), "{self:?}");
        assert!(self.stdout.is_empty(), "{self:?}");
        assert!(!self.stderr.contains("panicked"), "{self:?}");
    }
}

/// Runs `idem args...` with `DATABASE_URL` set to `url` (or unset).
async fn idem(url: Option<&str>, args: &[&str]) -> Out {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"));
    cmd.args(args).env_remove("DATABASE_URL");
    if let Some(url) = url {
        cmd.env("DATABASE_URL", url);
    }
    let out = cmd.output().await.expect("the idem binary runs");
    Out {
        code: out.status.code().expect("exited, not killed"),
        stdout: String::from_utf8(out.stdout).unwrap(),
        stderr: String::from_utf8(out.stderr).unwrap(),
    }
}

/// One row of each kind: a finished outcome with a recognisable body, a failed
/// one past its retention, and an execution in flight.
async fn seeded() -> TestDb {
    let db = TestDb::new().await;
    db.exec(
        r#"INSERT INTO idempotency_requests
             (tenant_id, operation, idempotency_key, fingerprint, state, response_status,
              response_headers, response_body, created_at, completed_at, expires_at)
           VALUES
             ('acme', 'create-order', 'k-done', decode(repeat('ab', 32), 'hex'), 'completed', 201,
              '[["content-type", "application/json"], ["location", "/orders/7"]]',
              '{"secret":"SECRET-BODY-123"}',
              '2026-01-02 03:04:05+00', '2026-01-02 03:04:06+00', now() + interval '1 day'),
             ('acme', 'create-order', 'k-old', decode(repeat('00', 32), 'hex'), 'failed', 404,
              NULL, 'gone', now() - interval '2 days', now() - interval '2 days',
              now() - interval '1 day'),
             ('acme', 'refund', 'k-running', decode(repeat('00', 32), 'hex'), 'processing', NULL,
              NULL, NULL, now() - interval '5 minutes', NULL, now() + interval '1 day')"#,
    )
    .await;
    db
}

#[tokio::test]
async fn a_fresh_database_says_run_migrate_and_migrate_fixes_it() {
    let db = TestDb::new().await;
    // A database without idem's table: plain CREATE DATABASE, no migration.
    let bare = format!("{}_bare", db.name);
    db.exec(&format!("CREATE DATABASE {bare}")).await;
    let url = db.url.replacen(&db.name, &bare, 1);
    let url = Some(url.as_str());

    for args in [
        &["stats"][..],
        &["show", "acme", "op", "k"],
        &["purge", "acme", "op", "k"],
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

    let out = idem(url, &["stats"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    db.exec(&format!("DROP DATABASE {bare} WITH (FORCE)")).await;
}

#[tokio::test]
async fn stats_prints_a_table_and_json() {
    let db = seeded().await;
    let url = Some(db.url.as_str());
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

#[tokio::test]
async fn show_prints_one_key_without_its_body_unless_asked() {
    let db = seeded().await;
    let url = Some(db.url.as_str());

    let out = idem(url, &["show", "acme", "create-order", "k-done"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    for expected in [
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
    assert_eq!(j["state"], "completed");
    assert_eq!(j["response_status"], 201);
    assert_eq!(j["body_bytes"], 28);
    assert_eq!(j["fingerprint"], "ab".repeat(32));
    assert_eq!(j["expired"], false);
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

    let out = idem(url, &["show", "acme", "refund", "k-running", "--json"]).await;
    let j = out.json();
    assert_eq!(j["state"], "processing");
    assert_eq!(j["response_status"], Value::Null);
    assert_eq!(j["body_bytes"], Value::Null);

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
}

#[tokio::test]
async fn purge_refuses_in_flight_rows_without_force() {
    let db = seeded().await;
    let url = Some(db.url.as_str());
    let exists = |key: &'static str| {
        let db = &db;
        async move {
            db.count(&format!(
                "SELECT count(*) FROM idempotency_requests WHERE idempotency_key = '{key}'"
            ))
            .await
        }
    };

    let out = idem(url, &["purge", "acme", "refund", "k-running"]).await;
    out.assert_error(4, "--force");
    assert!(out.stderr.contains("processing"), "{out:?}");
    assert_eq!(exists("k-running").await, 1);

    let out = idem(url, &["purge", "acme", "refund", "k-running", "--force"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    assert!(out.stdout.contains("processing (generation 1)"), "{out:?}");
    assert_eq!(exists("k-running").await, 0);

    // A finished row needs no --force.
    let out = idem(url, &["--json", "purge", "acme", "create-order", "k-old"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    let j = out.json();
    assert_eq!(j["purged"], true);
    assert_eq!(j["state"], "failed");
    assert_eq!(exists("k-old").await, 0);

    idem(url, &["purge", "acme", "create-order", "k-old"])
        .await
        .assert_error(3, "no row for tenant");

    // An uncertain row is refused as well.
    db.exec("UPDATE idempotency_requests SET state = 'uncertain', response_status = NULL WHERE idempotency_key = 'k-done'")
        .await;
    idem(url, &["purge", "acme", "create-order", "k-done"])
        .await
        .assert_error(4, "uncertain");
    assert_eq!(exists("k-done").await, 1);
}

#[tokio::test]
async fn purge_does_not_wait_forever_on_a_row_a_request_holds() {
    let db = seeded().await;
    let url = Some(db.url.as_str());
    // A request re-using the key holds the row (as a claim's transaction would).
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM idempotency_requests WHERE idempotency_key = 'k-done' FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let out = idem(url, &["purge", "acme", "create-order", "k-done", "--force"]).await;
    out.assert_error(4, "locked by a request");
    holder.rollback().await.unwrap();
    let out = idem(url, &["purge", "acme", "create-order", "k-done"]).await;
    assert_eq!(out.code, 0, "{out:?}");
}

#[tokio::test]
async fn sweep_once_deletes_the_expired_finished_rows_and_reports() {
    let db = seeded().await;
    db.exec(
        "INSERT INTO idempotency_requests \
           (tenant_id, operation, idempotency_key, fingerprint, state, response_status, \
            created_at, expires_at) \
         SELECT 'acme', 'pay', 'old-' || i, decode(repeat('00', 32), 'hex'), 'completed', 201, \
                now() - interval '2 days', now() - interval '1 day' \
           FROM generate_series(1, 4) i",
    )
    .await;

    let out = idem(url(&db), &["sweep", "--once", "--batch-size", "2"]).await;
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
    // deletes nothing in flight.
    let out = idem(
        url(&db),
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

    // --once is required: the continuous sweeper belongs in the service.
    let out = idem(url(&db), &["sweep"]).await;
    assert_eq!(out.code, 2, "{out:?}");
}

fn url(db: &TestDb) -> Option<&str> {
    Some(db.url.as_str())
}

#[tokio::test]
async fn connection_problems_are_one_clear_line() {
    // No URL at all: a usage error.
    idem(None, &["stats"])
        .await
        .assert_error(2, "--database-url or set DATABASE_URL");
    // A URL that does not parse, or is not PostgreSQL's.
    idem(None, &["--database-url", "not a url", "stats"])
        .await
        .assert_error(2, "invalid database URL");
    idem(Some("mysql://root@127.0.0.1/db"), &["stats"])
        .await
        .assert_error(2, "postgres://");
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
    // The flag wins over the environment.
    let db = TestDb::new().await;
    let out = idem(
        Some("postgres://postgres@127.0.0.1:1/postgres"),
        &["--database-url", &db.url, "stats", "--json"],
    )
    .await;
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(out.json()["rows"], 0);
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
}
