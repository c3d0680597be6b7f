//! A counting proxy between the profile server's pool and PostgreSQL.

use std::sync::atomic::{AtomicBool, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::*;

/// Frontend (client to server) protocol messages, and round trips: a burst of
/// client bytes after the server last spoke.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct Stats {
    pub round_trips: u64,
    /// Lone `Sync` messages: sqlx's liveness pings (on acquire, and on release).
    pub pings: u64,
    pub parse: u64,
    pub bind: u64,
    pub execute: u64,
    pub simple_query: u64,
    pub sync: u64,
    pub bytes_up: u64,
    pub bytes_down: u64,
    /// Executions (extended protocol `Execute`, or simple `Query`) by SQL text.
    pub statements: BTreeMap<String, u64>,
    /// `Parse` messages by SQL text: a statement parsed per request is unprepared.
    pub parsed: BTreeMap<String, u64>,
}

pub async fn start(
    upstream: String,
    stats: Arc<Mutex<Stats>>,
) -> std::io::Result<std::net::SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let stats = stats.clone();
            let upstream = upstream.clone();
            tokio::spawn(async move {
                if let Err(e) = relay(client, &upstream, stats).await {
                    eprintln!("proxy: {e}");
                }
            });
        }
    });
    Ok(addr)
}

async fn relay(client: TcpStream, upstream: &str, stats: Arc<Mutex<Stats>>) -> std::io::Result<()> {
    let server = TcpStream::connect(upstream).await?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let client_spoke_last = Arc::new(AtomicBool::new(true));
    let up = {
        let stats = stats.clone();
        let last = client_spoke_last.clone();
        async move {
            let mut parser = Parser::default();
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = cr.read(&mut buf).await?;
                if n == 0 {
                    return sw.shutdown().await;
                }
                {
                    let mut s = stats.lock().unwrap_or_else(|e| e.into_inner());
                    if !last.swap(true, Ordering::AcqRel) {
                        s.round_trips += 1;
                    }
                    s.bytes_up += n as u64;
                    if buf[..n] == [b'S', 0, 0, 0, 4] {
                        s.pings += 1;
                    }
                    parser.feed(&buf[..n], &mut s);
                }
                sw.write_all(&buf[..n]).await?;
            }
        }
    };
    let down = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = sr.read(&mut buf).await?;
            if n == 0 {
                return cw.shutdown().await;
            }
            client_spoke_last.store(false, Ordering::Release);
            stats.lock().unwrap_or_else(|e| e.into_inner()).bytes_down += n as u64;
            cw.write_all(&buf[..n]).await?;
        }
    };
    tokio::try_join!(up, down).map(|_| ())
}

#[derive(Default)]
struct Parser {
    buf: Vec<u8>,
    started: bool,
    names: HashMap<String, String>,
    unnamed: String,
    bound: String,
}

fn cstr(b: &[u8]) -> (String, &[u8]) {
    match b.iter().position(|&c| c == 0) {
        Some(i) => (String::from_utf8_lossy(&b[..i]).into_owned(), &b[i + 1..]),
        None => (String::from_utf8_lossy(b).into_owned(), &[]),
    }
}

fn norm(sql: &str) -> String {
    let flat = sql.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.chars().count() > 96 {
        let cut: String = flat.chars().take(93).collect();
        format!("{cut}...")
    } else {
        flat
    }
}

impl Parser {
    fn feed(&mut self, data: &[u8], s: &mut Stats) {
        self.buf.extend_from_slice(data);
        let mut at = 0;
        loop {
            let rest = &self.buf[at..];
            if !self.started {
                // StartupMessage: length, then protocol and parameters; no type byte.
                if rest.len() < 4 {
                    break;
                }
                let len = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
                if rest.len() < len {
                    break;
                }
                at += len;
                self.started = true;
                continue;
            }
            if rest.len() < 5 {
                break;
            }
            let ty = rest[0];
            let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
            if rest.len() < 1 + len {
                break;
            }
            let body = &rest[5..1 + len];
            match ty {
                b'P' => {
                    let (name, tail) = cstr(body);
                    let (sql, _) = cstr(tail);
                    let sql = norm(&sql);
                    s.parse += 1;
                    *s.parsed.entry(sql.clone()).or_default() += 1;
                    if name.is_empty() {
                        self.unnamed = sql;
                    } else {
                        self.names.insert(name, sql);
                    }
                }
                b'B' => {
                    let (_portal, tail) = cstr(body);
                    let (name, _) = cstr(tail);
                    s.bind += 1;
                    self.bound = if name.is_empty() {
                        self.unnamed.clone()
                    } else {
                        self.names
                            .get(&name)
                            .cloned()
                            .unwrap_or_else(|| name.clone())
                    };
                }
                b'E' => {
                    s.execute += 1;
                    *s.statements.entry(self.bound.clone()).or_default() += 1;
                }
                b'Q' => {
                    let (sql, _) = cstr(body);
                    s.simple_query += 1;
                    *s.statements.entry(norm(&sql)).or_default() += 1;
                }
                b'S' => s.sync += 1,
                _ => {}
            }
            at += 1 + len;
        }
        self.buf.drain(..at);
    }
}
