//! The proxy between a bench server's pool and PostgreSQL, in the server process.
//!
//! Two uses, one relay:
//! * the statement profile counts every protocol message and round trip
//!   ([`Stats`]);
//! * the networked-database runs delay every chunk from PostgreSQL to the server
//!   by a fixed round-trip time, as a database on another machine would.
//!
//! One thread, named `dbproxy-loop` so the driver can tell its CPU time from the
//! server's (`/proc/<pid>/task`), relays every connection: an epoll loop over
//! the connections' sockets and a timer (`timerfd`, nanosecond resolution;
//! tokio's timer, at 1 ms, is too coarse for a 500 us RTT). The server's bytes go
//! up at once; each chunk from PostgreSQL is queued with its due time (arrival +
//! RTT), and the timer is armed for the oldest. The delay is the same for every
//! chunk, so one queue in arrival order is in due order for all connections, a
//! delay never throttles a connection nor holds up another, and a connection's
//! chunks keep their order.
//!
//! One thread rather than three per connection (a reader each way and a writer
//! sleeping until each chunk is due, as until issue 34's last measurements):
//! the proxy stands for the network, which costs the server's machine no CPU,
//! and the threads' hand-offs and wake-ups cost the bench's two cores about as
//! much CPU per request as the server itself; one loop picks up several
//! connections' chunks per wake-up under load.
//!
//! The timer wakes the thread late (the scheduler's wake-up latency, tens of
//! microseconds on a busy VM, hundreds on an idle one); the loop aims early by
//! the median of its own oversleeping, tracked in steps of 2 us (at most half
//! the RTT), and writes every chunk due within that margin, so that the typical
//! chunk is written at its due time; [`DelayReport`] says how far from it they
//! were.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Prefix of the proxy's thread names (`/proc/<pid>/task/<tid>/comm`).
pub const THREAD_PREFIX: &str = "dbproxy";

/// Frontend (client to server) protocol messages, and round trips: a burst of
/// client bytes after the server last spoke.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct Stats {
    /// Bursts of the client's bytes that follow bytes of the server's.
    pub round_trips: u64,
    /// Lone `Sync` messages: sqlx's liveness pings (on acquire, and on release).
    pub pings: u64,
    /// `Parse` messages (a statement prepared).
    pub parse: u64,
    /// `Bind` messages.
    pub bind: u64,
    /// `Execute` messages (extended protocol).
    pub execute: u64,
    /// `Query` messages (simple protocol).
    pub simple_query: u64,
    /// `Sync` messages, pings included.
    pub sync: u64,
    /// Bytes from the client to PostgreSQL.
    pub bytes_up: u64,
    /// Bytes from PostgreSQL to the client.
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
    /// The delay the proxy was set to.
    pub rtt_us: u64,
    /// Chunks delayed.
    pub chunks: u64,
    /// Mean of (written - due), in microseconds: positive is late.
    pub off_us_mean: f64,
    /// Mean of |written - due|.
    pub off_us_abs_mean: f64,
    /// The most any chunk was late.
    pub late_us_max: u64,
}

/// Starts the proxy and answers its address. Each accepted connection gets its
/// own connection to `upstream`; one thread relays them all (see the module
/// docs).
pub fn start(upstream: String, options: Options) -> std::io::Result<std::net::SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let mut relay = Relay::new(listener, upstream, options)?;
    std::thread::Builder::new()
        .name(format!("{THREAD_PREFIX}-loop"))
        .spawn(move || {
            if let Err(e) = relay.run() {
                eprintln!("proxy: {e}");
            }
        })?;
    Ok(addr)
}

/// `CLOCK_MONOTONIC` in nanoseconds: the clock the timer is armed on.
fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec, which `ts` is.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn check(ret: libc::c_int) -> std::io::Result<libc::c_int> {
    if ret < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// Epoll tokens: the listener, the timer, and per connection its two sockets
/// (`id * 2` the pool's side, `id * 2 + 1` PostgreSQL's).
const LISTENER: u64 = u64::MAX;
const TIMER: u64 = u64::MAX - 1;

/// One relayed connection.
struct Conn {
    /// The bench server's side (a pool connection).
    client: TcpStream,
    /// PostgreSQL's side.
    server: TcpStream,
    parser: Parser,
    /// Whether the pool's side spoke last: its next burst starts a round trip.
    client_spoke_last: bool,
    client_open: bool,
    server_open: bool,
}

/// A chunk from PostgreSQL waiting for its due time (empty: the end of the
/// stream, delayed like the rest).
struct Due {
    at_ns: u64,
    conn: u64,
    chunk: Vec<u8>,
}

/// The proxy's one thread: an epoll loop over every connection's two sockets,
/// and a timer armed for the oldest queued chunk.
struct Relay {
    epoll: OwnedFd,
    timer: OwnedFd,
    listener: TcpListener,
    upstream: String,
    options: Options,
    rtt_ns: u64,
    conns: HashMap<u64, Conn>,
    next_id: u64,
    /// Every connection's queued chunks in one queue: the delay is the same
    /// for all, so arrival order is due order.
    queue: std::collections::VecDeque<Due>,
    /// The timer's expiry, if armed.
    armed_ns: Option<u64>,
    /// How late the timer wakes the thread, tracked as in the module docs.
    oversleep_ns: u64,
    buf: Vec<u8>,
}

impl Relay {
    fn new(listener: TcpListener, upstream: String, options: Options) -> std::io::Result<Self> {
        // SAFETY: both calls take flags only and return a new descriptor
        // (checked), which the `OwnedFd`s then own.
        let (epoll, timer) = unsafe {
            let epoll = check(libc::epoll_create1(libc::EPOLL_CLOEXEC))?;
            let epoll = OwnedFd::from_raw_fd(epoll);
            let timer = check(libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            ))?;
            (epoll, OwnedFd::from_raw_fd(timer))
        };
        let rtt_ns = u64::try_from(options.rtt.as_nanos()).unwrap_or(u64::MAX);
        let relay = Relay {
            epoll,
            timer,
            listener,
            upstream,
            options,
            rtt_ns,
            conns: HashMap::new(),
            next_id: 0,
            queue: Default::default(),
            armed_ns: None,
            oversleep_ns: 0,
            buf: vec![0u8; 64 * 1024],
        };
        relay.watch(relay.listener.as_raw_fd(), LISTENER)?;
        relay.watch(relay.timer.as_raw_fd(), TIMER)?;
        Ok(relay)
    }

    fn watch(&self, fd: RawFd, token: u64) -> std::io::Result<()> {
        let mut event = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: token,
        };
        // SAFETY: `event` lives across the call; the kernel copies it.
        check(unsafe {
            libc::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut event)
        })
        .map(drop)
    }

    fn run(&mut self) -> std::io::Result<()> {
        // SAFETY: PR_SET_TIMERSLACK takes one integer argument and changes only
        // the calling thread's timer slack.
        unsafe {
            libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong);
        }
        let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 64];
        loop {
            // SAFETY: `events` has room for the count passed.
            let n = unsafe {
                libc::epoll_wait(
                    self.epoll.as_raw_fd(),
                    events.as_mut_ptr(),
                    events.len() as libc::c_int,
                    -1,
                )
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            for event in &events[..n as usize] {
                // A copy: the struct is packed, its field cannot be borrowed.
                let token = event.u64;
                match token {
                    LISTENER => self.accept(),
                    TIMER => self.timer_fired(),
                    token if token % 2 == 0 => self.up(token / 2),
                    token => self.down(token / 2),
                }
            }
            self.write_due();
        }
    }

    fn accept(&mut self) {
        while let Ok((client, _)) = self.listener.accept() {
            let connected = TcpStream::connect(&self.upstream).and_then(|server| {
                for s in [&client, &server] {
                    s.set_nodelay(true)?;
                    s.set_nonblocking(true)?;
                }
                Ok(server)
            });
            let server = match connected {
                Ok(server) => server,
                Err(e) => {
                    eprintln!("proxy: {e}");
                    continue;
                }
            };
            let id = self.next_id;
            self.next_id += 1;
            if let Err(e) = self
                .watch(client.as_raw_fd(), id * 2)
                .and_then(|()| self.watch(server.as_raw_fd(), id * 2 + 1))
            {
                eprintln!("proxy: {e}");
                continue;
            }
            let conn = Conn {
                client,
                server,
                parser: Parser::default(),
                client_spoke_last: true,
                client_open: true,
                server_open: true,
            };
            self.conns.insert(id, conn);
        }
    }

    /// The bench server to PostgreSQL, at once, counted for the profile.
    fn up(&mut self, id: u64) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        let Some(n) = read_some(&conn.client, &mut self.buf) else {
            return;
        };
        if n == 0 {
            conn.client_open = false;
            unwatch(&self.epoll, conn.client.as_raw_fd());
            let _ = conn.server.shutdown(Shutdown::Write);
            self.forget_if_done(id);
            return;
        }
        let data = &self.buf[..n];
        if let Some(stats) = &self.options.stats {
            let mut s = stats.lock().unwrap_or_else(|e| e.into_inner());
            if !std::mem::replace(&mut conn.client_spoke_last, true) {
                s.round_trips += 1;
            }
            s.bytes_up += n as u64;
            if data == [b'S', 0, 0, 0, 4] {
                s.pings += 1;
            }
            conn.parser.feed(data, &mut s);
        }
        if write_all(&conn.server, data).is_err() {
            self.close(id);
        }
    }

    /// PostgreSQL to the bench server: queued with its due time.
    fn down(&mut self, id: u64) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        let Some(n) = read_some(&conn.server, &mut self.buf) else {
            return;
        };
        conn.client_spoke_last = false;
        if let Some(stats) = &self.options.stats {
            stats.lock().unwrap_or_else(|e| e.into_inner()).bytes_down += n as u64;
        }
        if n == 0 {
            conn.server_open = false;
            unwatch(&self.epoll, conn.server.as_raw_fd());
        }
        // At RTT 0 the chunk is due at once: `write_due`, after this turn's
        // events, writes it.
        self.queue.push_back(Due {
            at_ns: now_ns() + self.rtt_ns,
            conn: id,
            chunk: self.buf[..n].to_vec(),
        });
    }

    fn timer_fired(&mut self) {
        let mut expirations = [0u8; 8];
        // SAFETY: a timerfd read takes 8 bytes, which the buffer has.
        unsafe { libc::read(self.timer.as_raw_fd(), expirations.as_mut_ptr().cast(), 8) };
        let Some(aim) = self.armed_ns.take() else {
            return;
        };
        // The timer was aimed early by `oversleep_ns`: woken after the chunk's
        // due time, aim earlier next time; before it, later.
        const STEP_NS: u64 = 2_000;
        if now_ns() > aim + self.oversleep_ns {
            self.oversleep_ns = (self.oversleep_ns + STEP_NS).min(self.rtt_ns / 2);
        } else {
            self.oversleep_ns = self.oversleep_ns.saturating_sub(STEP_NS);
        }
    }

    /// Writes every chunk due by now (aimed early as the timer is), then arms
    /// the timer for the next.
    fn write_due(&mut self) {
        let now = now_ns();
        while let Some(due) = self.queue.front() {
            if due.at_ns > now + self.oversleep_ns {
                break;
            }
            let due = self.queue.pop_front().expect("a front");
            if self.rtt_ns > 0 {
                delay_stats().record(now_ns() as i64 - due.at_ns as i64);
            }
            let Some(conn) = self.conns.get_mut(&due.conn) else {
                continue;
            };
            let sent = if due.chunk.is_empty() {
                conn.client.shutdown(Shutdown::Write)
            } else {
                write_all(&conn.client, &due.chunk)
            };
            if sent.is_err() {
                self.close(due.conn);
            } else if due.chunk.is_empty() {
                self.forget_if_done(due.conn);
            }
        }
        let Some(next) = self.queue.front().map(|d| d.at_ns) else {
            return;
        };
        let aim = next.saturating_sub(self.oversleep_ns);
        if self.armed_ns == Some(aim) {
            return;
        }
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: (aim / 1_000_000_000) as libc::time_t,
                tv_nsec: (aim % 1_000_000_000) as libc::c_long,
            },
        };
        // SAFETY: `spec` lives across the call; no old value is asked for.
        unsafe {
            libc::timerfd_settime(
                self.timer.as_raw_fd(),
                libc::TFD_TIMER_ABSTIME,
                &spec,
                std::ptr::null_mut(),
            )
        };
        self.armed_ns = Some(aim);
    }

    /// Drops a connection whose both directions have ended.
    fn forget_if_done(&mut self, id: u64) {
        if let Some(conn) = self.conns.get(&id)
            && !conn.client_open
            && !conn.server_open
        {
            self.conns.remove(&id);
        }
    }

    /// Drops a connection at once (a write failed: its peer is gone).
    fn close(&mut self, id: u64) {
        if let Some(conn) = self.conns.remove(&id) {
            unwatch(&self.epoll, conn.client.as_raw_fd());
            unwatch(&self.epoll, conn.server.as_raw_fd());
            let _ = conn.client.shutdown(Shutdown::Both);
            let _ = conn.server.shutdown(Shutdown::Both);
        }
    }
}

/// What a non-blocking socket has: `None` if nothing yet (the loop hears of it
/// again), `Some(0)` at its end or on an error (the peer is gone either way).
fn read_some(mut socket: &TcpStream, buf: &mut [u8]) -> Option<usize> {
    match socket.read(buf) {
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
            ) =>
        {
            None
        }
        Ok(n) => Some(n),
        Err(_) => Some(0),
    }
}

/// Stops watching a socket (before it is dropped, or at its end of stream).
fn unwatch(epoll: &OwnedFd, fd: RawFd) {
    // SAFETY: a null event is allowed for EPOLL_CTL_DEL.
    unsafe {
        libc::epoll_ctl(
            epoll.as_raw_fd(),
            libc::EPOLL_CTL_DEL,
            fd,
            std::ptr::null_mut(),
        )
    };
}

/// How long a write waits for room in a full socket before the connection is
/// dropped.
const STUCK_MS: libc::c_int = 10_000;

/// Writes the whole chunk to a non-blocking socket, waiting for room if it is
/// full (never, for the protocol's small messages; the loop then waits too), but
/// not for longer than [`STUCK_MS`]: a peer that stops reading is dropped
/// rather than hold up every connection.
fn write_all(mut socket: &TcpStream, mut data: &[u8]) -> std::io::Result<()> {
    while !data.is_empty() {
        match socket.write(data) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => data = &data[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let mut fd = libc::pollfd {
                    fd: socket.as_raw_fd(),
                    events: libc::POLLOUT,
                    revents: 0,
                };
                // SAFETY: one pollfd, which `fd` is.
                if unsafe { libc::poll(&mut fd, 1, STUCK_MS) } == 0 {
                    return Err(std::io::ErrorKind::TimedOut.into());
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
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

/// The process's delay statistics, which every proxy records into.
pub fn delay_stats() -> &'static DelayStats {
    static STATS: std::sync::OnceLock<DelayStats> = std::sync::OnceLock::new();
    STATS.get_or_init(DelayStats::default)
}

impl DelayStats {
    /// Records one chunk written `off_ns` after its due time (negative: before).
    fn record(&self, off_ns: i64) {
        let off = off_ns / 1_000;
        self.chunks.fetch_add(1, Ordering::Relaxed);
        self.off_us_total.fetch_add(off, Ordering::Relaxed);
        self.off_us_abs_total
            .fetch_add(off.unsigned_abs(), Ordering::Relaxed);
        self.late_us_max
            .fetch_max(off.max(0).unsigned_abs(), Ordering::Relaxed);
    }

    /// The statistics so far, for a proxy set to `rtt`.
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
    /// Set on bytes that cannot be the protocol (a length shorter than its own
    /// field): the connection's counting stops there, its relaying does not.
    lost: bool,
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

/// The codes of the requests that may precede the startup message.
const SSL_REQUEST: u32 = 80_877_103;
const GSSENC_REQUEST: u32 = 80_877_104;

impl Parser {
    /// Stops counting this connection, saying so once on stderr (the bench's
    /// log), rather than panic on a slice and take the relay thread down.
    fn lose(&mut self, why: &str) {
        eprintln!("proxy: {why}: this connection is no longer counted");
        self.lost = true;
        self.buf = Vec::new();
    }

    fn feed(&mut self, data: &[u8], s: &mut Stats) {
        if self.lost {
            return;
        }
        self.buf.extend_from_slice(data);
        let mut at = 0;
        loop {
            let rest = &self.buf[at..];
            if !self.started {
                // StartupMessage: length, then protocol and parameters; no type
                // byte. An SSL or GSSAPI encryption request (the same layout,
                // answered with one byte) may come first.
                if rest.len() < 8 {
                    break;
                }
                let len = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
                if len < 8 {
                    return self.lose("a startup message shorter than 8 bytes");
                }
                if rest.len() < len {
                    break;
                }
                let code = u32::from_be_bytes([rest[4], rest[5], rest[6], rest[7]]);
                self.started = !matches!(code, SSL_REQUEST | GSSENC_REQUEST);
                at += len;
                continue;
            }
            if rest.len() < 5 {
                break;
            }
            let ty = rest[0];
            let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
            if len < 4 {
                return self.lose("a message shorter than its length field");
            }
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

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::time::Instant;

    use super::*;

    /// Long enough that a test fails rather than hangs when the proxy loses
    /// bytes; never reached when it works.
    const NEVER: Duration = Duration::from_secs(30);

    /// A stand-in for PostgreSQL on one connection: it answers every read with
    /// `reply` of what it read, at once, and closes when the proxy does.
    fn upstream(reply: impl Fn(&[u8]) -> Vec<u8> + Send + 'static) -> String {
        serving_one(move |mut socket| {
            let mut buf = vec![0u8; 256 * 1024];
            loop {
                let n = match socket.read(&mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                if socket.write_all(&reply(&buf[..n])).is_err() {
                    return;
                }
            }
        })
    }

    /// The address of a listener whose first connection `serve` takes, on a
    /// thread of its own.
    fn serving_one(serve: impl FnOnce(TcpStream) + Send + 'static) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        std::thread::spawn(move || serve(listener.accept().unwrap().0));
        addr
    }

    /// An upstream that reads to the end of the stream, then sends back all it
    /// read and closes. The two directions never carry bytes at once: the
    /// relay's one thread, blocked writing to a full socket, could otherwise
    /// wait on a peer that waits on it (an echo writing back while the client
    /// still writes), and the test would depend on the kernel's buffer sizes.
    fn echo_after_end() -> String {
        serving_one(|mut socket| {
            let mut read = Vec::new();
            if socket.read_to_end(&mut read).is_ok() {
                let _ = socket.write_all(&read);
            }
        })
    }

    fn client(upstream: String, options: Options) -> TcpStream {
        let socket = TcpStream::connect(start(upstream, options).unwrap()).unwrap();
        socket.set_read_timeout(Some(NEVER)).unwrap();
        socket
    }

    /// A frontend message: its type, its length (itself included), its body.
    fn message(ty: u8, body: &[u8]) -> Vec<u8> {
        let mut m = vec![ty];
        m.extend_from_slice(&(4 + body.len() as u32).to_be_bytes());
        m.extend_from_slice(body);
        m
    }

    /// The startup message of protocol 3.0, which has no type byte.
    const STARTUP: [u8; 8] = [0, 0, 0, 8, 0, 3, 0, 0];

    /// Writes `bytes` and waits for the answer, so that each call is one burst
    /// and one round trip.
    fn exchange(socket: &mut TcpStream, bytes: &[u8]) {
        socket.write_all(bytes).unwrap();
        let mut answer = [0u8; 64];
        assert!(socket.read(&mut answer).unwrap() > 0, "no answer");
    }

    #[test]
    fn relays_every_byte_both_ways_in_order_and_the_end_of_the_stream() {
        // More than the relay's 64 KiB buffer, so that it takes many chunks.
        let sent: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let mut socket = client(echo_after_end(), Options::default());
        socket.write_all(&sent).unwrap();
        // The upstream sees the end of the stream only if the proxy passes it on.
        socket.shutdown(Shutdown::Write).unwrap();
        let mut echoed = Vec::new();
        // Ends only when the proxy passes the upstream's close on.
        socket.read_to_end(&mut echoed).unwrap();
        assert_eq!(echoed.len(), sent.len());
        assert!(echoed == sent, "the bytes came back changed or reordered");
    }

    #[test]
    fn an_answer_is_held_back_by_the_rtt_less_at_most_its_half() {
        let rtt = Duration::from_millis(100);
        let before = delay_stats().report(rtt).chunks;
        let mut socket = client(upstream(|_| b"pong".to_vec()), Options { stats: None, rtt });
        for _ in 0..3 {
            let asked = Instant::now();
            socket.write_all(b"ping").unwrap();
            let mut answer = [0u8; 4];
            socket.read_exact(&mut answer).unwrap();
            // The loop writes a chunk up to its oversleeping margin before it
            // is due, and the margin is at most half the RTT.
            assert!(
                asked.elapsed() >= rtt / 2,
                "answered after {:?}",
                asked.elapsed()
            );
            assert_eq!(&answer, b"pong");
        }
        // Every answer was a delayed chunk (other tests may add their own).
        assert!(delay_stats().report(rtt).chunks >= before + 3);
    }

    #[test]
    fn the_profile_counts_messages_statements_pings_and_round_trips() {
        let stats = Arc::new(Mutex::new(Stats::default()));
        let mut socket = client(
            upstream(|_| b"Z".to_vec()),
            Options {
                stats: Some(stats.clone()),
                rtt: Duration::ZERO,
            },
        );
        let prepared = [
            message(b'P', b"\0SELECT  $1::int\0\0\0"),
            message(b'B', b"\0\0\0\0\0\0\0\0"),
            message(b'E', b"\0\0\0\0\0"),
            message(b'S', b""),
        ]
        .concat();
        let simple = message(b'Q', b"SELECT 1 WHERE x = E'it''s \\' here' AND y = 'b'\0");
        let ping = message(b'S', b"");
        // The startup is the client's first burst: no round trip yet.
        for burst in [&STARTUP[..], &prepared, &simple, &ping] {
            exchange(&mut socket, burst);
        }
        let s = stats.lock().unwrap().clone();
        assert_eq!(s.round_trips, 3);
        assert_eq!(
            (s.parse, s.bind, s.execute, s.sync, s.simple_query),
            (1, 1, 1, 2, 1)
        );
        assert_eq!(
            s.pings, 1,
            "a lone Sync is a ping, the one after Execute is not"
        );
        assert_eq!(
            s.statements,
            BTreeMap::from([
                ("SELECT $1::int".to_owned(), 1),
                ("SELECT N WHERE x = ? AND y = ?".to_owned(), 1),
            ])
        );
        assert_eq!(s.parsed, BTreeMap::from([("SELECT $1::int".to_owned(), 1)]));
        let up = STARTUP.len() + prepared.len() + simple.len() + ping.len();
        assert_eq!(s.bytes_up, up as u64);
        // An answer a burst, or more if the stand-in read one in pieces.
        assert!(s.bytes_down >= 4, "{} bytes down", s.bytes_down);
    }

    #[test]
    fn a_message_split_across_reads_is_counted_once_whole() {
        let mut parser = Parser::default();
        let mut s = Stats::default();
        parser.feed(&STARTUP[..3], &mut s);
        parser.feed(&STARTUP[3..], &mut s);
        let query = message(b'Q', b"SELECT 1\0");
        parser.feed(&query[..3], &mut s);
        assert_eq!(s.simple_query, 0, "counted before its end arrived");
        parser.feed(&query[3..], &mut s);
        assert_eq!(s.simple_query, 1);
        assert_eq!(s.statements.get("SELECT N"), Some(&1));
    }

    #[test]
    fn an_encryption_request_before_the_startup_message_is_not_taken_for_it() {
        let mut parser = Parser::default();
        let mut s = Stats::default();
        let ssl_request = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];
        parser.feed(&ssl_request, &mut s);
        parser.feed(&STARTUP, &mut s);
        parser.feed(&message(b'Q', b"SELECT 1\0"), &mut s);
        assert_eq!(s.simple_query, 1);
        assert_eq!(s.statements.get("SELECT N"), Some(&1));
    }

    #[test]
    fn bytes_that_are_not_the_protocol_stop_the_count_without_a_panic() {
        let mut parser = Parser::default();
        let mut s = Stats::default();
        parser.feed(&STARTUP, &mut s);
        // A length of 2, shorter than the length field itself.
        parser.feed(&[b'Q', 0, 0, 0, 2], &mut s);
        parser.feed(&message(b'Q', b"SELECT 1\0"), &mut s);
        assert_eq!(s.simple_query, 0, "counted after the stream was lost");
        assert!(parser.lost && parser.buf.is_empty());

        let mut parser = Parser::default();
        parser.feed(&[0, 0, 0, 3, 0, 3, 0, 0], &mut s);
        assert!(parser.lost, "a startup message shorter than 8 bytes");
    }

    #[test]
    fn literals_become_placeholders_and_names_keep_their_digits() {
        assert_eq!(
            without_literals("SELECT 'a''b', E'c\\'d', 42, 3.5 FROM t1 WHERE idem_probe_3(x)"),
            "SELECT ?, ?, N, N FROM t1 WHERE idem_probe_3(x)"
        );
    }
}
