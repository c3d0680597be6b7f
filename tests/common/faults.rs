//! A TCP proxy in front of the test PostgreSQL server that fails chosen
//! statements as a network would, so that a test can put a real server behind
//! a lost answer: a statement that ran and committed while its client was told
//! the connection broke.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use sqlx::postgres::{PgConnectOptions, PgSslMode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

/// What happens to the next statement whose text holds the marker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The statement runs, and commits if it runs outside a transaction; its
    /// answer never reaches the client, whose connection is cut once the
    /// server is ready again (after the commit).
    AnswerLost,
    /// The connection is cut as the statement is sent: it never runs.
    NeverSent,
}

#[derive(Default)]
struct Plan {
    marker: Vec<u8>,
    faults: VecDeque<Fault>,
}

/// The proxy; connections through it are cut when [`Faults::on`] says so.
pub struct Faults {
    pub addr: SocketAddr,
    plan: Arc<Mutex<Plan>>,
}

impl Faults {
    /// Listens on a port of its own, passing every connection on to the
    /// server of [`super::admin_url`].
    pub async fn start() -> Faults {
        let admin = PgConnectOptions::from_str(&super::admin_url()).unwrap();
        let upstream = format!("{}:{}", admin.get_host(), admin.get_port());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let plan = Arc::new(Mutex::new(Plan::default()));
        let shared = plan.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let server = TcpStream::connect(&upstream).await.unwrap();
                tokio::spawn(relay(client, server, shared.clone()));
            }
        });
        Faults { addr, plan }
    }

    /// The next statements sent with `marker` in their text (found in the
    /// message that prepares them: a statement the connection prepared
    /// before is not seen) meet `faults`, one each, in order; the others pass.
    pub fn on(&self, marker: &str, faults: impl IntoIterator<Item = Fault>) {
        let mut plan = self.plan.lock().unwrap();
        plan.marker = marker.as_bytes().to_vec();
        plan.faults = faults.into_iter().collect();
    }

    /// How many of the faults [`Faults::on`] planned no statement has met yet.
    pub fn left(&self) -> usize {
        self.plan.lock().unwrap().faults.len()
    }

    /// Options for `database` through the proxy (no TLS: it reads the
    /// server's messages).
    pub fn options(&self, database: &str) -> PgConnectOptions {
        let admin = PgConnectOptions::from_str(&super::admin_url()).unwrap();
        admin
            .host("127.0.0.1")
            .port(self.addr.port())
            .database(database)
            .ssl_mode(PgSslMode::Disable)
    }
}

/// One connection: the client's writes are searched for the marker, and the
/// server's messages are read one by one, so that a lost answer is cut where
/// the statement's execution begins to answer (`BindComplete`) and the
/// connection closed once the server is ready again (`ReadyForQuery`).
async fn relay(client: TcpStream, server: TcpStream, plan: Arc<Mutex<Plan>>) {
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let cut = Arc::new(Notify::new());
    let lose = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (cut_up, lose_up) = (cut.clone(), lose.clone());
    tokio::spawn(async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match cr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let fault = {
                let mut plan = plan.lock().unwrap();
                let marked = !plan.faults.is_empty()
                    && buf[..n]
                        .windows(plan.marker.len())
                        .any(|w| w == plan.marker.as_slice());
                if marked {
                    plan.faults.pop_front()
                } else {
                    None
                }
            };
            match fault {
                Some(Fault::NeverSent) => {
                    cut_up.notify_one();
                    break;
                }
                Some(Fault::AnswerLost) => lose_up.store(true, std::sync::atomic::Ordering::SeqCst),
                None => {}
            }
            if sw.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    });
    // The server's messages: a type byte and a length that counts itself.
    let mut pending: Vec<u8> = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut swallowing = false;
    loop {
        let n = tokio::select! {
            read = sr.read(&mut buf) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            () = cut.notified() => return,
        };
        pending.extend_from_slice(&buf[..n]);
        let mut out = Vec::new();
        let mut at = 0;
        while pending.len() - at >= 5 {
            let len = u32::from_be_bytes(pending[at + 1..at + 5].try_into().unwrap()) as usize;
            if pending.len() - at < 1 + len {
                break;
            }
            let kind = pending[at];
            if kind == b'2' && lose.swap(false, std::sync::atomic::Ordering::SeqCst) {
                swallowing = true;
            }
            if !swallowing {
                out.extend_from_slice(&pending[at..at + 1 + len]);
            } else if kind == b'Z' {
                // The statement has run (and committed, outside a
                // transaction): its client hears nothing more.
                let _ = cw.write_all(&out).await;
                return;
            }
            at += 1 + len;
        }
        pending.drain(..at);
        if cw.write_all(&out).await.is_err() {
            return;
        }
    }
}
