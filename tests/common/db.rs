//! A fresh database per test (PostgreSQL, SQLite, MySQL), so tests run in
//! parallel without seeing each other's rows; and where the example binaries
//! and the brokers are. idem-cli's tests mount this file alone, so it needs
//! nothing but sqlx and idem-runtime.

#![allow(dead_code)]

use std::sync::atomic::{AtomicU32, Ordering};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool};

/// Runs statements on an admin connection (CREATE, DROP, KILL), on either
/// server. A macro: a generic function over the connection type does not make
/// a `Send` future for the drop's thread.
macro_rules! run {
    ($conn:expr, $sql:expr) => {
        sqlx::raw_sql(sqlx::AssertSqlSafe($sql))
            .execute($conn)
            .await
            .map(|_| ())
    };
}

/// The path of an example binary built by `cargo test --workspace --all-features`
/// (cargo builds the examples for tests; `consumer`, `rabbitmq-consumer` and
/// `client` need their features), next to this test binary's directory.
pub fn example_binary(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/<test>-<hash> -> target/<profile>/examples/<name>
    let dir = exe.parent().unwrap().parent().unwrap();
    let bin = dir
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.exists(),
        "{} is missing: run `cargo test --workspace --all-features`, or `cargo build --all-features --example {name}` first",
        bin.display()
    );
    bin
}

/// The NATS server the tests use; `NATS_URL` overrides it.
pub fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

/// The server the tests use; `IDEM_TEST_DATABASE_URL` overrides it.
pub fn admin_url() -> String {
    std::env::var("IDEM_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// A database of its own for one test, with idem's migrations applied.
pub struct TestDb {
    pub pool: PgPool,
    pub name: String,
    pub url: String,
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A name no other test of any run uses at the same time: `idem_t_` (what
/// `.ci/run` sweeps up), the process, a counter and the clock's nanoseconds.
fn unique_name() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!(
        "idem_t_{}_{}_{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed),
        nanos
    )
}

/// idem's migrations: all of them (`idem_runtime::migrate`), or those before
/// `before` only.
async fn migrate<DB: idem_runtime::Backend>(pool: &sqlx::Pool<DB>, before: Option<i64>)
where
    DB::Connection: sqlx::migrate::Migrate,
{
    let Some(version) = before else {
        idem_runtime::migrate(pool).await.unwrap();
        return;
    };
    let mut migrator = idem_runtime::migrator::<DB>();
    let older: Vec<_> = migrator
        .migrations
        .iter()
        .filter(|m| m.version < version)
        .cloned()
        .collect();
    migrator.migrations = older.into();
    migrator.run(pool).await.unwrap();
}

/// The hex SHA-256 of a key: what idem stores in `key_digest` instead of it.
pub fn digest_hex(raw: &str) -> String {
    idem_runtime::IdempotencyKey::parse(raw)
        .unwrap()
        .digest()
        .to_string()
}

/// `exec` and `count` for a helper with a `pool`, the same for both backends.
macro_rules! statements {
    () => {
        /// Runs statements (DDL for a test's business tables, or setup).
        pub async fn exec(&self, sql: &str) {
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
                .execute(&self.pool)
                .await
                .unwrap();
        }

        /// The single integer a query returns (a `count(*)`, say).
        pub async fn count(&self, sql: &str) -> i64 {
            sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
                .fetch_one(&self.pool)
                .await
                .unwrap()
        }
    };
}

impl TestDb {
    /// The SQL literal of `raw`'s digest, to find its row in `key_digest`.
    #[allow(dead_code)]
    pub fn key(&self, raw: &str) -> String {
        format!("'\\x{}'::bytea", digest_hex(raw))
    }

    /// Creates the database and migrates it.
    pub async fn new() -> TestDb {
        Self::with_pool_size(20).await
    }

    /// As [`TestDb::new`], with a pool of `size` connections.
    pub async fn with_pool_size(size: u32) -> TestDb {
        Self::create(size, None).await
    }

    /// A database migrated only up to (not including) idem's migration
    /// `version`: the schema an older release left behind.
    #[allow(dead_code)]
    pub async fn migrated_before(version: i64) -> TestDb {
        Self::create(4, Some(version)).await
    }

    async fn create(size: u32, before: Option<i64>) -> TestDb {
        let admin = admin_url();
        let name = unique_name();
        let mut conn = PgConnection::connect(&admin)
            .await
            .expect("PostgreSQL must run on 127.0.0.1:5432 (see README: running the tests)");
        run!(&mut conn, format!("CREATE DATABASE {name}")).unwrap();
        conn.close().await.ok();
        let opts: PgConnectOptions = admin.parse().unwrap();
        let opts = opts.database(&name);
        let mut url = replace_database(&admin, &name);
        // The suites can run through a connection pooler in front of the same
        // server (`.ci/run` runs the PostgreSQL suites through PgBouncer too):
        // the database is created directly, the test's connections go through it.
        let opts = match pooler_port() {
            Some(port) => {
                url = replace_port(&url, port);
                opts.port(port)
            }
            None => opts,
        };
        let pool = PgPoolOptions::new()
            .max_connections(size)
            .connect_with(opts)
            .await
            .unwrap();
        migrate(&pool, before).await;
        TestDb { pool, name, url }
    }

    statements!();
}

/// Drops the database when the test ends (set `IDEM_KEEP_TEST_DBS=1` to keep it for
/// a post-mortem). Drop cannot await, so a short-lived thread does the work.
impl Drop for TestDb {
    fn drop(&mut self) {
        if std::env::var_os("IDEM_KEEP_TEST_DBS").is_some() {
            return;
        }
        let name = self.name.clone();
        // The pool is not closed here: its connections belong to the test's runtime,
        // which this drop blocks. FORCE ends them from the server side instead.
        on_a_runtime_of_its_own(async move {
            let mut conn = PgConnection::connect(&admin_url()).await.ok()?;
            run!(
                &mut conn,
                format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            )
            .ok()
        });
    }
}

/// A SQLite database file of its own for one test, with idem's migrations applied
/// (WAL mode, so readers never wait for the writer). Removed when the test ends.
pub struct SqliteDb {
    pub pool: sqlx::SqlitePool,
    pub path: std::path::PathBuf,
}

impl SqliteDb {
    /// The SQL literal of `raw`'s digest, to find its row in `key_digest`.
    #[allow(dead_code)]
    pub fn key(&self, raw: &str) -> String {
        format!("X'{}'", digest_hex(raw))
    }

    /// Creates the file and migrates it.
    pub async fn new() -> SqliteDb {
        Self::with_pool_size(20).await
    }

    /// As [`SqliteDb::new`], with a pool of `size` connections.
    pub async fn with_pool_size(size: u32) -> SqliteDb {
        Self::create(size, None).await
    }

    /// See [`TestDb::migrated_before`].
    #[allow(dead_code)]
    pub async fn migrated_before(version: i64) -> SqliteDb {
        Self::create(4, Some(version)).await
    }

    async fn create(size: u32, before: Option<i64>) -> SqliteDb {
        use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
        let path = std::env::temp_dir().join(format!("{}.db", unique_name()));
        let opts = SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(std::time::Duration::from_secs(5));
        let pool = SqlitePoolOptions::new()
            .max_connections(size)
            .connect_with(opts)
            .await
            .unwrap();
        migrate(&pool, before).await;
        SqliteDb { pool, path }
    }

    statements!();
}

impl Drop for SqliteDb {
    fn drop(&mut self) {
        if std::env::var_os("IDEM_KEEP_TEST_DBS").is_some() {
            return;
        }
        for suffix in ["", "-wal", "-shm"] {
            let mut p = self.path.clone().into_os_string();
            p.push(suffix);
            let _ = std::fs::remove_file(p);
        }
    }
}

/// The MySQL or MariaDB server the tests use; `IDEM_TEST_MYSQL_URL` overrides it.
pub fn mysql_admin_url() -> String {
    std::env::var("IDEM_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

/// A MySQL (or MariaDB) database of its own for one test, with idem's migrations
/// applied, dropped when the test ends. Its connections begin transactions READ
/// COMMITTED, as docs/mysql.md recommends for a pool whose transactions claim
/// keys (InnoDB's default, REPEATABLE READ, takes gap locks).
pub struct MySqlDb {
    pub pool: sqlx::MySqlPool,
    pub name: String,
    pub url: String,
}

impl MySqlDb {
    /// The SQL literal of `raw`'s digest, to find its row in `key_digest`.
    #[allow(dead_code)]
    pub fn key(&self, raw: &str) -> String {
        format!("X'{}'", digest_hex(raw))
    }

    /// Creates the database and migrates it.
    pub async fn new() -> MySqlDb {
        Self::with_pool_size(20).await
    }

    /// As [`MySqlDb::new`], with a pool of `size` connections.
    pub async fn with_pool_size(size: u32) -> MySqlDb {
        Self::with_isolation(size, Some("READ COMMITTED")).await
    }

    /// See [`TestDb::migrated_before`].
    #[allow(dead_code)]
    pub async fn migrated_before(version: i64) -> MySqlDb {
        Self::create(4, Some("READ COMMITTED"), Some(version)).await
    }

    /// Waits until a statement of this database whose text is `LIKE like`
    /// runs on another connection, polling over `on` (a pool the statement
    /// does not hold up). A statement that waits for a row lock shows there
    /// while it waits; the process list is read live, where MariaDB's
    /// `INNODB_TRX` is a cache refreshed only after 100 ms without reads.
    #[allow(dead_code)]
    pub async fn until_running(&self, on: &sqlx::MySqlPool, like: &str) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let running: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM information_schema.PROCESSLIST \
                  WHERE DB = ? AND ID <> CONNECTION_ID() AND INFO LIKE ?",
            )
            .bind(&self.name)
            .bind(like)
            .fetch_one(on)
            .await
            .unwrap();
            if running > 0 {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no statement like {like:?} ever ran"
            );
            // A poll interval: what is awaited is the condition above.
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    /// Rows the session of `one` (a pool of one connection) has read so far,
    /// by an index scan and by a table scan: whichever plan the server picks.
    #[allow(dead_code)]
    pub async fn rows_read(one: &sqlx::MySqlPool) -> u64 {
        let counters: Vec<(String, String)> = sqlx::query_as(
            "SHOW SESSION STATUS WHERE Variable_name IN \
               ('Handler_read_next', 'Handler_read_rnd_next')",
        )
        .fetch_all(one)
        .await
        .unwrap();
        assert_eq!(counters.len(), 2, "{counters:?}");
        counters
            .iter()
            .map(|(_, n)| n.parse::<u64>().unwrap())
            .sum()
    }

    /// As [`MySqlDb::new`], with the server's default isolation (REPEATABLE
    /// READ) when `isolation` is `None`.
    pub async fn with_isolation(size: u32, isolation: Option<&'static str>) -> MySqlDb {
        Self::create(size, isolation, None).await
    }

    async fn create(size: u32, isolation: Option<&'static str>, before: Option<i64>) -> MySqlDb {
        use sqlx::Executor;
        use sqlx::mysql::{MySqlConnectOptions, MySqlConnection, MySqlPoolOptions};
        let admin = mysql_admin_url();
        let name = unique_name();
        let mut conn = MySqlConnection::connect(&admin)
            .await
            .expect("MySQL or MariaDB must run on 127.0.0.1:3306 (see README: running the tests)");
        run!(&mut conn, format!("CREATE DATABASE {name}")).unwrap();
        conn.close().await.ok();
        let opts: MySqlConnectOptions = admin.parse().unwrap();
        let opts = opts.database(&name);
        let url = replace_database(&admin, &name);
        let pool = MySqlPoolOptions::new()
            .max_connections(size)
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    if let Some(level) = isolation {
                        conn.execute(sqlx::AssertSqlSafe(format!(
                            "SET SESSION TRANSACTION ISOLATION LEVEL {level}"
                        )))
                        .await?;
                    }
                    Ok(())
                })
            })
            .connect_with(opts)
            .await
            .unwrap();
        migrate(&pool, before).await;
        MySqlDb { pool, name, url }
    }

    statements!();
}

impl Drop for MySqlDb {
    fn drop(&mut self) {
        if std::env::var_os("IDEM_KEEP_TEST_DBS").is_some() {
            return;
        }
        let name = self.name.clone();
        // As for PostgreSQL: the pool belongs to the test's runtime, so a thread
        // of its own drops the database (MySQL waits for the metadata locks of
        // open transactions on its tables; the pool's idle connections hold none).
        on_a_runtime_of_its_own(async move {
            let mut conn = sqlx::mysql::MySqlConnection::connect(&mysql_admin_url())
                .await
                .ok()?;
            // MySQL has no DROP DATABASE ... FORCE: end the test's connections
            // first, so that a transaction left open cannot hold the drop up.
            let ids: Vec<i64> = sqlx::query_scalar(
                "SELECT CAST(id AS SIGNED) FROM information_schema.PROCESSLIST WHERE db = ?",
            )
            .bind(&name)
            .fetch_all(&mut conn)
            .await
            .ok()?;
            for id in ids {
                let _ = run!(&mut conn, format!("KILL {id}"));
            }
            run!(&mut conn, format!("DROP DATABASE IF EXISTS {name}")).ok()
        });
    }
}

/// Runs `work` to its end on a thread and runtime of its own, and waits for it:
/// a `Drop` cannot await, and blocking the test's own runtime would deadlock it.
fn on_a_runtime_of_its_own<T: Send + 'static>(
    work: impl std::future::Future<Output = Option<T>> + Send + 'static,
) {
    let _ = std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .ok()?
            .block_on(work)
    })
    .join();
}

/// The port of a connection pooler the PostgreSQL tests' connections go
/// through (`IDEM_TEST_PGBOUNCER_PORT`), if any.
pub fn pooler_port() -> Option<u16> {
    std::env::var("IDEM_TEST_PGBOUNCER_PORT").ok().map(|p| {
        p.parse()
            .expect("IDEM_TEST_PGBOUNCER_PORT is a port number")
    })
}

/// `url` with its port replaced (or added after the host).
fn replace_port(url: &str, port: u16) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let (userinfo, hostport) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    let host = match hostport.rsplit_once(':') {
        Some((h, p)) if p.chars().all(|c| c.is_ascii_digit()) => h,
        _ => hostport,
    };
    let userinfo = userinfo.map(|u| format!("{u}@")).unwrap_or_default();
    format!("{scheme}://{userinfo}{host}:{port}/{path}")
}

fn replace_database(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let base = match base.rsplit_once('/') {
        Some((head, _)) if head.contains("://") && !head.ends_with(":/") => head,
        _ => base,
    };
    match query {
        Some(q) => format!("{base}/{name}?{q}"),
        None => format!("{base}/{name}"),
    }
}
