//! A running `orders` example process, for the suites that drive the real
//! service (the end-to-end suite, the client's, the history checker), and
//! through [`Server::spawn`] the `quickstart` example's (tests/quickstart.rs).
//! Included with `#[path]`: the CLI's tests share `common` and never start it.

// Each suite uses a part of it.
#![allow(dead_code)]

use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::watch;

/// A running `orders` process, killed when dropped.
pub struct Server {
    pub child: Child,
    /// `http://127.0.0.1:<port>`.
    pub base: String,
    /// Everything it logged so far.
    pub log: watch::Receiver<Vec<String>>,
    /// How many executions it has begun (its log line `idem: execute`).
    pub executions: watch::Receiver<usize>,
}

/// The key ring of the servers [`seal_answers_on`] names (`IDEM_KEY_RING`).
pub const TEST_KEY_RING: &str = "e2e-1:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";

/// The databases whose servers seal their answers.
static SEALED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Every server [`Server::start`] starts on `database_url` from now on seals
/// its answers at rest ([`TEST_KEY_RING`]); each test has a database of its
/// own, so the others are unaffected.
pub fn seal_answers_on(database_url: &str) {
    SEALED.lock().unwrap().push(database_url.to_owned());
}

impl Server {
    /// Starts the example on `database_url` with `env`, and waits until it listens.
    pub async fn start(database_url: &str, env: &[(&str, &str)]) -> Server {
        let mut cmd = Command::new(crate::common::example_binary("orders"));
        cmd.env("DATABASE_URL", database_url);
        if SEALED.lock().unwrap().iter().any(|u| u == database_url) {
            cmd.env("IDEM_KEY_RING", TEST_KEY_RING);
        }
        Self::spawn(cmd, env).await
    }

    /// Starts the example as configured by `cmd` and `env`, and waits until it
    /// listens (at most 120 s; the panic says what it logged meanwhile).
    pub async fn spawn(mut cmd: Command, env: &[(&str, &str)]) -> Server {
        cmd.env("IDEM_ADDR", "127.0.0.1:0")
            // idem's debug line "idem: execute" says a request claimed its key.
            .env("RUST_LOG", "info,sqlx=warn,idem_runtime=debug")
            .env("NO_COLOR", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("start the example");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let deadline = Instant::now() + Duration::from_secs(120);
        let (log_tx, log) = watch::channel(Vec::new());
        let (count, executions) = watch::channel(0);
        let base = loop {
            let line = tokio::time::timeout_at(deadline.into(), lines.next_line())
                .await
                .unwrap_or_else(|_| {
                    panic!(
                        "the server did not listen within 120 s; it logged {:#?}",
                        log_tx.borrow()
                    )
                })
                .unwrap()
                .unwrap_or_else(|| {
                    panic!(
                        "the server exited before it was ready; it logged {:#?}",
                        log_tx.borrow()
                    )
                });
            log_tx.send_modify(|log| log.push(line.clone()));
            if let Some(at) = line.find("listening on http://") {
                break line[at + "listening on ".len()..]
                    .chars()
                    .take_while(|c| !c.is_whitespace() && *c != '\x1b')
                    .collect::<String>();
            }
        };
        // Keep draining its output so the process never blocks on a full pipe.
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                if line.contains("idem: execute") {
                    count.send_modify(|n| *n += 1);
                }
                log_tx.send_modify(|log| log.push(line));
            }
        });
        Server {
            child,
            base,
            log,
            executions,
        }
    }

    /// Waits until `n` log lines contain `needle`.
    pub async fn wait_for_log(&self, needle: &str, n: usize) {
        let mut log = self.log.clone();
        let seen = tokio::time::timeout(
            Duration::from_secs(60),
            log.wait_for(|lines| lines.iter().filter(|l| l.contains(needle)).count() >= n),
        )
        .await;
        assert!(
            matches!(seen, Ok(Ok(_))),
            "the server never logged {needle:?} {n} time(s)"
        );
    }

    /// Waits until the server has claimed a key for its `n`th execution: the
    /// request now works inside its open transaction.
    pub async fn wait_until_executing(&self, n: usize) {
        self.wait_for_log("idem: execute", n).await;
    }

    /// Waits until `n` duplicates have joined the waiting room of a key whose
    /// first request runs in this process (idem's debug line `idem: duplicate
    /// waits`).
    pub async fn wait_until_waiting(&self, n: usize) {
        self.wait_for_log("idem: duplicate waits", n).await;
    }

    /// SIGKILL: no shutdown hooks, no graceful rollback — a crash. (An error only
    /// says it is dead already.)
    pub async fn kill(&mut self) {
        let _ = self.child.kill().await;
    }
}
