//! The e2e suite's harness: the example as a child process on a port of its
//! own, its log, a tonic client, and a database of its own per test. Shared by
//! the suites, each of which uses part of it.
#![allow(dead_code)]

use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use grpc_orders::pb::orders_client::OrdersClient;
use sqlx::Connection as _;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::watch;
use tonic::transport::Channel;

/// The tenant every call speaks for.
pub const TENANT: &str = "acme";

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A name no other test (or run) uses.
pub fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!(
        "{prefix}_{}_{}_{nanos}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// A call as the example expects it: the caller's bearer token, the currency,
/// and the key when one is given.
pub fn call<M>(key: Option<&str>, message: M) -> tonic::Request<M> {
    let mut request = tonic::Request::new(message);
    let metadata = request.metadata_mut();
    metadata.insert("authorization", format!("Bearer {TENANT}").parse().unwrap());
    metadata.insert("x-currency", "EUR".parse().unwrap());
    if let Some(key) = key {
        metadata.insert("idempotency-key", key.parse().unwrap());
    }
    request
}

/// The example, running.
pub struct Server {
    child: Child,
    addr: String,
    log: watch::Receiver<Vec<String>>,
}

impl Server {
    /// Starts the example on `url` with `env`, on a free port, and waits for
    /// it to listen.
    pub async fn start(url: &str, env: &[(&str, &str)]) -> Server {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_grpc-orders"));
        cmd.env("DATABASE_URL", url)
            .env("IDEM_ADDR", "127.0.0.1:0")
            .env("RUST_LOG", "info,idem_runtime=debug")
            .env_remove("IDEM_LEASE_STORE")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("the grpc-orders binary starts");
        let (tx, log) = watch::channel(Vec::new());
        let stderr = child.stderr.take().unwrap();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                tx.send_modify(|l| l.push(line));
            }
        });
        let mut stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = tokio::time::timeout(Duration::from_secs(60), stdout.next_line())
            .await
            .expect("the service says where it listens within a minute")
            .unwrap();
        let Some(addr) = first.and_then(|l| {
            l.strip_prefix("grpc-orders listening on ")
                .map(str::to_owned)
        }) else {
            panic!("the service did not start: {:?}", log.borrow().join("\n"));
        };
        Server { child, addr, log }
    }

    /// Where it listens (`127.0.0.1:PORT`).
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// A client on a connection of its own.
    pub async fn client(&self) -> OrdersClient<Channel> {
        OrdersClient::connect(format!("http://{}", self.addr))
            .await
            .expect("the service accepts connections")
    }

    /// Waits until the service has logged `needle` `n` times.
    pub async fn wait_for_log(&self, needle: &str, n: usize) {
        let mut log = self.log.clone();
        let seen = tokio::time::timeout(
            Duration::from_secs(60),
            log.wait_for(|lines| lines.iter().filter(|l| l.contains(needle)).count() >= n),
        )
        .await;
        assert!(
            matches!(seen, Ok(Ok(_))),
            "the service never logged {needle:?} {n} time(s)"
        );
    }

    /// Waits until the `n`th execution holds its key: the method now runs
    /// inside its open transaction (or holding its lease).
    pub async fn wait_until_executing(&self, n: usize) {
        self.wait_for_log("idem: execute", n).await;
    }

    /// Waits until `n` duplicates have joined the waiting room of a key whose
    /// first call runs in this process (idem's debug line `idem: duplicate
    /// waits`).
    pub async fn wait_until_waiting(&self, n: usize) {
        self.wait_for_log("idem: duplicate waits", n).await;
    }

    /// SIGKILL: a crash.
    pub async fn kill(&mut self) {
        let _ = self.child.kill().await;
    }
}

/// The root suites' hold on the examples' orders: `CreateOrder` waits inside
/// its transaction while it is held.
#[path = "../../../../tests/common/hold.rs"]
mod hold;
#[allow(unused_imports, reason = "each suite uses part of the harness")]
pub use hold::Hold;

/// A database of the test's own.
pub trait Db: Sized {
    /// Creates it (the service migrates it).
    async fn create() -> Self;
    /// The `DATABASE_URL` the service gets.
    fn url(&self) -> String;
    /// Waits until no transaction of a killed service holds anything.
    async fn wait_until_no_open_transaction(&self);
    /// Every stored answer in idem's table, as the row holds it: the headers'
    /// text and the body.
    async fn answers(&self) -> Vec<(String, Vec<u8>)>;
    /// Drops it.
    async fn drop(self);
}

/// [`Db::answers`] where the headers are text already (SQLite, MySQL).
const ANSWERS_AS_TEXT: &str = "SELECT response_headers, response_body FROM idempotency_requests \
     WHERE response_body IS NOT NULL";

/// A SQLite file in the temporary directory.
pub struct SqliteDb {
    path: std::path::PathBuf,
}

impl Db for SqliteDb {
    async fn create() -> Self {
        SqliteDb {
            path: std::env::temp_dir().join(format!("{}.db", unique("idem_t_grpc"))),
        }
    }
    fn url(&self) -> String {
        format!("sqlite://{}", self.path.display())
    }
    /// The write lock of a dead process is gone with it: taking it proves it.
    async fn wait_until_no_open_transaction(&self) {
        let mut conn = sqlx::SqliteConnection::connect(&self.url()).await.unwrap();
        sqlx::raw_sql("BEGIN IMMEDIATE; ROLLBACK")
            .execute(&mut conn)
            .await
            .unwrap();
    }
    async fn answers(&self) -> Vec<(String, Vec<u8>)> {
        let mut conn = sqlx::SqliteConnection::connect(&self.url()).await.unwrap();
        sqlx::query_as(ANSWERS_AS_TEXT)
            .fetch_all(&mut conn)
            .await
            .unwrap()
    }
    async fn drop(self) {
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", self.path.display()));
        }
    }
}

fn pg_admin() -> String {
    std::env::var("IDEM_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

fn mysql_admin() -> String {
    std::env::var("IDEM_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

/// Replaces the database of `url` with `name`.
fn with_database(url: &str, name: &str) -> String {
    let base = url.rsplit_once('/').map_or(url, |(b, _)| b);
    format!("{base}/{name}")
}

/// A PostgreSQL database on the machine's server.
pub struct PgDb {
    name: String,
}

impl Db for PgDb {
    async fn create() -> Self {
        let name = unique("idem_t_grpc");
        let mut conn = sqlx::PgConnection::connect(&pg_admin())
            .await
            .expect("PostgreSQL runs on 127.0.0.1:5432");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut conn)
            .await
            .unwrap();
        PgDb { name }
    }
    fn url(&self) -> String {
        with_database(&pg_admin(), &self.name)
    }
    async fn wait_until_no_open_transaction(&self) {
        let mut conn = sqlx::PgConnection::connect(&self.url()).await.unwrap();
        for _ in 0..600 {
            let open: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE datname = current_database() AND pid <> pg_backend_pid()",
            )
            .fetch_one(&mut conn)
            .await
            .unwrap();
            if open == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("a killed service's connection stayed open for a minute");
    }
    async fn answers(&self) -> Vec<(String, Vec<u8>)> {
        let mut conn = sqlx::PgConnection::connect(&self.url()).await.unwrap();
        sqlx::query_as(
            "SELECT response_headers::text, response_body FROM idempotency_requests \
              WHERE response_body IS NOT NULL",
        )
        .fetch_all(&mut conn)
        .await
        .unwrap()
    }
    async fn drop(self) {
        let mut conn = sqlx::PgConnection::connect(&pg_admin()).await.unwrap();
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        )))
        .execute(&mut conn)
        .await;
    }
}

impl PgDb {
    /// Refuses new connections to the database and ends the open ones (or
    /// lets them in again): the service's store is out of reach.
    pub async fn refuse_connections(&self, refuse: bool) {
        let mut conn = sqlx::PgConnection::connect(&pg_admin()).await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "ALTER DATABASE {} ALLOW_CONNECTIONS {}",
            self.name, !refuse
        )))
        .execute(&mut conn)
        .await
        .unwrap();
        if refuse {
            sqlx::query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1",
            )
            .bind(&self.name)
            .execute(&mut conn)
            .await
            .unwrap();
        }
    }
}

/// A MySQL / MariaDB database on the machine's server.
pub struct MySqlDb {
    name: String,
}

impl Db for MySqlDb {
    async fn create() -> Self {
        let name = unique("idem_t_grpc");
        let mut conn = sqlx::MySqlConnection::connect(&mysql_admin())
            .await
            .expect("MariaDB runs on 127.0.0.1:3306");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut conn)
            .await
            .unwrap();
        MySqlDb { name }
    }
    fn url(&self) -> String {
        with_database(&mysql_admin(), &self.name)
    }
    async fn wait_until_no_open_transaction(&self) {
        let mut conn = sqlx::MySqlConnection::connect(&mysql_admin())
            .await
            .unwrap();
        for _ in 0..600 {
            let open: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE DB = ?",
            )
            .bind(&self.name)
            .fetch_one(&mut conn)
            .await
            .unwrap();
            if open == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("a killed service's connection stayed open for a minute");
    }
    async fn answers(&self) -> Vec<(String, Vec<u8>)> {
        let mut conn = sqlx::MySqlConnection::connect(&self.url()).await.unwrap();
        sqlx::query_as(ANSWERS_AS_TEXT)
            .fetch_all(&mut conn)
            .await
            .unwrap()
    }
    async fn drop(self) {
        let mut conn = sqlx::MySqlConnection::connect(&mysql_admin())
            .await
            .unwrap();
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {}",
            self.name
        )))
        .execute(&mut conn)
        .await;
    }
}
