//! The proxy between a bench server's pool and PostgreSQL, in the server process.
//!
//! Two uses, one relay:
//! * the statement profile counts every protocol message and round trip
//!   ([`Stats`]);
//! * the networked-database runs delay every chunk from PostgreSQL to the server
//!   by a fixed round-trip time, as a database on another machine would.
//!
//! Plain threads and blocking sockets, named `dbproxy*` so the driver can tell
//! their CPU time from the server's (`/proc/<pid>/task`). Per connection: one
//! thread relays the server's bytes up, one reads PostgreSQL's, and with a delay
//! a third writes them down when due. The reader queues each chunk with its due
//! time (arrival + RTT) and goes back to reading, so a delay never throttles a
//! connection nor holds up another; the writer sleeps until the oldest chunk is
//! due (`thread::sleep`: tokio's timer, with its 1 ms resolution, is too coarse
//! for a 500 us RTT) and writes it. A connection's due times only grow, so its
//! chunks keep their order.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::mpsc;

use super::*;

/// Prefix of the proxy's thread names (`/proc/<pid>/task/<tid>/comm`).
pub const THREAD_PREFIX: &str = "dbproxy";

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

/// What the proxy does besides relaying.
#[derive(Clone, Default)]
pub struct Options {
    /// Count the protocol (the statement profile).
    pub stats: Option<Arc<Mutex<Stats>>>,
    /// Delay every chunk from PostgreSQL by this much (zero: relay at once).
    pub rtt: Duration,
}

/// How far from their due time (arrival + RTT) the delayed chunks were written:
/// the mean (positive: late), the mean distance either way, the latest.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct DelayReport {
    pub rtt_us: u64,
    pub chunks: u64,
    pub off_us_mean: f64,
    pub off_us_abs_mean: f64,
    pub late_us_max: u64,
}

/// Starts the proxy and answers its address. Each accepted connection gets its
/// own connection to `upstream`.
pub fn start(upstream: String, options: Options) -> std::io::Result<std::net::SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    spawn("accept", move || {
        for client in listener.incoming() {
            let Ok(client) = client else { continue };
            let (upstream, options) = (upstream.clone(), options.clone());
            if let Err(e) = relay(client, &upstream, options) {
                eprintln!("proxy: {e}");
            }
        }
    })?;
    Ok(addr)
}

fn spawn(role: &str, f: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name(format!("{THREAD_PREFIX}-{role}"))
        .spawn(f)
        .map(drop)
}

/// Connects to PostgreSQL and starts the connection's threads.
fn relay(client: TcpStream, upstream: &str, options: Options) -> std::io::Result<()> {
    let server = TcpStream::connect(upstream)?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let client_spoke_last = Arc::new(AtomicBool::new(true));
    {
        let (from, to) = (client.try_clone()?, server.try_clone()?);
        let (stats, last) = (options.stats.clone(), client_spoke_last.clone());
        spawn("up", move || up(from, to, stats, &last))?;
    }
    let sink = if options.rtt.is_zero() {
        Sink::Direct(client)
    } else {
        let (due_tx, due_rx) = mpsc::channel();
        let rtt = options.rtt;
        spawn("wr", move || write_when_due(client, due_rx, rtt))?;
        Sink::Delayed {
            rtt: options.rtt,
            due_tx,
        }
    };
    spawn("rd", move || {
        down(server, sink, options.stats, &client_spoke_last)
    })
}

/// Server to PostgreSQL, at once, counted for the profile.
fn up(mut from: TcpStream, mut to: TcpStream, stats: Option<Arc<Mutex<Stats>>>, last: &AtomicBool) {
    let mut parser = Parser::default();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some(stats) = &stats {
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
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

/// PostgreSQL to the server: each chunk to the sink, as soon as it is read.
fn down(mut from: TcpStream, mut sink: Sink, stats: Option<Arc<Mutex<Stats>>>, last: &AtomicBool) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = from.read(&mut buf).unwrap_or(0);
        last.store(false, Ordering::Release);
        if let Some(stats) = &stats {
            stats.lock().unwrap_or_else(|e| e.into_inner()).bytes_down += n as u64;
        }
        // An empty chunk is the end of the stream, delayed like the rest.
        if sink.send(&buf[..n]).is_err() || n == 0 {
            break;
        }
    }
}

/// Where the chunks from PostgreSQL go: the server's socket at once, or the
/// connection's queue of chunks with their due times.
enum Sink {
    Direct(TcpStream),
    Delayed {
        rtt: Duration,
        due_tx: mpsc::Sender<(Instant, Vec<u8>)>,
    },
}

impl Sink {
    fn send(&mut self, chunk: &[u8]) -> std::io::Result<()> {
        match self {
            Sink::Direct(socket) if chunk.is_empty() => socket.shutdown(Shutdown::Write),
            Sink::Direct(socket) => socket.write_all(chunk),
            Sink::Delayed { rtt, due_tx } => due_tx
                .send((Instant::now() + *rtt, chunk.to_vec()))
                .map_err(|_| std::io::Error::other("the delayed writer stopped")),
        }
    }
}

/// The delayed writer of one connection: each chunk at its due time, in order.
///
/// A sleeping thread wakes late: the timer slack (set to 1 ns here) and the
/// scheduler's wake-up latency, which on this VM is tens of microseconds when
/// the cores are busy and hundreds when they idle. The writer therefore aims
/// early by the median of its own oversleeping (tracked in steps of 2 us, so
/// that a thread descheduled for milliseconds does not throw it off; at most
/// half the RTT), so that the typical chunk is written at its due time and the
/// RTT the server sees is the one configured; [`DelayReport`] says how far from
/// it they were.
fn write_when_due(mut to: TcpStream, due_rx: mpsc::Receiver<(Instant, Vec<u8>)>, rtt: Duration) {
    // SAFETY: PR_SET_TIMERSLACK takes one integer argument and changes only the
    // calling thread's timer slack.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong);
    }
    const STEP: Duration = Duration::from_micros(2);
    let mut oversleep = Duration::ZERO;
    while let Ok((due, chunk)) = due_rx.recv() {
        let aim = due - oversleep;
        let now = Instant::now();
        if aim > now {
            std::thread::sleep(aim - now);
            oversleep = if Instant::now() > aim + oversleep {
                (oversleep + STEP).min(rtt / 2)
            } else {
                oversleep.saturating_sub(STEP)
            };
        }
        delay_stats().record(due);
        if chunk.is_empty() {
            break;
        }
        if to.write_all(&chunk).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

/// When the delayed chunks were written against their due time.
#[derive(Default)]
pub struct DelayStats {
    chunks: AtomicU64,
    /// Sums of (written - due) and of its absolute value, in microseconds.
    off_us_total: AtomicI64,
    off_us_abs_total: AtomicU64,
    late_us_max: AtomicU64,
}

pub fn delay_stats() -> &'static DelayStats {
    static STATS: std::sync::OnceLock<DelayStats> = std::sync::OnceLock::new();
    STATS.get_or_init(DelayStats::default)
}

impl DelayStats {
    fn record(&self, due: Instant) {
        let now = Instant::now();
        let us = |d: Duration| i64::try_from(d.as_micros()).unwrap_or(i64::MAX);
        let off = us(now.saturating_duration_since(due)) - us(due.saturating_duration_since(now));
        self.chunks.fetch_add(1, Ordering::Relaxed);
        self.off_us_total.fetch_add(off, Ordering::Relaxed);
        self.off_us_abs_total
            .fetch_add(off.unsigned_abs(), Ordering::Relaxed);
        self.late_us_max
            .fetch_max(off.max(0).unsigned_abs(), Ordering::Relaxed);
    }

    pub fn report(&self, rtt: Duration) -> DelayReport {
        let n = self.chunks.load(Ordering::Relaxed).max(1) as f64;
        DelayReport {
            rtt_us: u64::try_from(rtt.as_micros()).unwrap_or(u64::MAX),
            chunks: self.chunks.load(Ordering::Relaxed),
            off_us_mean: self.off_us_total.load(Ordering::Relaxed) as f64 / n,
            off_us_abs_mean: self.off_us_abs_total.load(Ordering::Relaxed) as f64 / n,
            late_us_max: self.late_us_max.load(Ordering::Relaxed),
        }
    }
}

// ---------------------------------------------------------------------------------
// The frontend protocol, parsed for the statement profile.
// ---------------------------------------------------------------------------------

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

/// A simple query with its literals as `?` (strings, `E'...'` included) and `N`
/// (numbers), so that statements sent with their values inline (idem's pipelined
/// claim and completion) count as one statement, not one per request.
fn without_literals(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut chars = sql.chars().peekable();
    let mut prev = ' ';
    while let Some(c) = chars.next() {
        if c == '\'' {
            // E'...' takes backslash escapes; '' is a quote in either kind.
            let escapes = matches!(prev, 'E' | 'e');
            if escapes {
                out.pop();
            }
            while let Some(c) = chars.next() {
                match c {
                    '\\' if escapes => {
                        chars.next();
                    }
                    '\'' if chars.peek() == Some(&'\'') => {
                        chars.next();
                    }
                    '\'' => break,
                    _ => {}
                }
            }
            out.push('?');
            prev = '?';
        } else if c.is_ascii_digit() && !(prev.is_alphanumeric() || prev == '_') {
            while chars
                .peek()
                .is_some_and(|d| d.is_ascii_digit() || *d == '.')
            {
                chars.next();
            }
            out.push('N');
            prev = 'N';
        } else {
            out.push(c);
            prev = c;
        }
    }
    out
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
                    *s.statements
                        .entry(norm(&without_literals(&sql)))
                        .or_default() += 1;
                }
                b'S' => s.sync += 1,
                _ => {}
            }
            at += 1 + len;
        }
        self.buf.drain(..at);
    }
}
