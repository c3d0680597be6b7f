//! The service's edges: how connections are accepted, bounded in time and shut
//! down, and what the HTTP layer answers before and around the handlers.
//!
//! `axum::serve` has no header-read timeout, so a client that opens a connection
//! and never finishes its request head (or idles after an answer) holds a file
//! descriptor for as long as it likes. The accept loop here serves each
//! connection with hyper's HTTP/1 builder, whose header-read timeout closes
//! both (in hyper 1.x it restarts after every answer, so it is the keep-alive
//! idle bound too), and drains in-flight requests on `SIGTERM` and `SIGINT`.
//!
//! It also bounds the rest of a connection's life: a client that stops reading
//! its answer is cut off after the write timeout ([`WriteTimeout`]), and at most
//! `max_connections` connections are served at once (more wait in the listen
//! backlog until one closes).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use idem_runtime::Executions;
use idem_runtime::Problem;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;

/// The request head the service accepts: at most this many header fields...
pub const MAX_HEADERS: usize = 100;
/// ...and this many bytes of request line and header fields. Larger heads are
/// `431` problem+json, answered by [`edges`].
pub const MAX_HEAD_BYTES: usize = 32 * 1024;
/// hyper's own limits, well above the service's so that [`edges`] answers with
/// a problem document. A head beyond these is refused by hyper itself with a
/// bare `431` before any service code runs (there is no request to answer).
const HYPER_MAX_HEADERS: usize = 500;
const HYPER_MAX_HEAD_BYTES: usize = 256 * 1024;

/// `Retry-After` for a `503` that does not say: long enough not to hammer a
/// recovering database or provider.
pub const RETRY_AFTER_SECS: u64 = 5;

/// What [`edges`] needs per request.
#[derive(Debug, Clone, Copy)]
pub struct Edges {
    /// `ORDERS_BODY_TIMEOUT_MS`: how long a request body may take to arrive.
    pub body_timeout: Duration,
}

/// Read by `ValidJson`: a body that has not arrived in this time is `408`.
#[derive(Debug, Clone, Copy)]
pub struct BodyTimeout(pub Duration);

/// The layer between hyper and the routes: refuses oversized heads with `431`,
/// hands the body timeout to the extractors, and makes every error answer
/// problem+json (axum's own `404`, `405` and path rejections are plain or
/// empty) and every `503` carry `Retry-After`.
pub async fn edges(State(edges): State<Edges>, mut req: Request, next: Next) -> Response {
    let head_bytes = req.method().as_str().len()
        + req.uri().path_and_query().map_or(1, |pq| pq.as_str().len())
        + " HTTP/1.1\r\n".len()
        + req
            .headers()
            .iter()
            .map(|(n, v)| n.as_str().len() + v.len() + ": \r\n".len())
            .sum::<usize>();
    if req.headers().len() > MAX_HEADERS || head_bytes > MAX_HEAD_BYTES {
        let mut resp = Problem::new(
            "urn:orders:problem:headers-too-large",
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "Request header fields too large",
        )
        .with_detail(format!(
            "send at most {MAX_HEADERS} header fields and {} KiB of request line and headers",
            MAX_HEAD_BYTES / 1024
        ))
        .into_response();
        // The rest of the request is never read: do not keep the connection.
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        return resp;
    }
    req.extensions_mut().insert(BodyTimeout(edges.body_timeout));
    let resp = next.run(req).await;
    let mut resp = if resp.status().is_client_error() || resp.status().is_server_error() {
        as_problem(resp).await
    } else {
        resp
    };
    if resp.status() == StatusCode::SERVICE_UNAVAILABLE
        && !resp.headers().contains_key(header::RETRY_AFTER)
    {
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECS));
    }
    resp
}

/// An error answer as problem+json: problem documents pass unchanged; anything
/// else (axum's empty `404`/`405`, its plain-text rejections) becomes an
/// `about:blank` problem of the same status, its text kept as the detail and its
/// other headers (`Allow`) kept.
async fn as_problem(resp: Response) -> Response {
    let is_problem = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes() == idem_runtime::problem::CONTENT_TYPE.as_bytes());
    if is_problem {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    let is_text = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/plain"));
    let detail = if is_text {
        axum::body::to_bytes(body, 4096)
            .await
            .ok()
            .and_then(|b| String::from_utf8(b.to_vec()).ok())
            .filter(|s| !s.is_empty())
    } else {
        None
    };
    let title = parts.status.canonical_reason().unwrap_or("Error");
    let mut problem = Problem::new("about:blank", parts.status, title);
    if let Some(d) = detail {
        problem = problem.with_detail(d);
    }
    let fresh = problem.into_response();
    parts.headers.remove(header::CONTENT_LENGTH);
    for name in [header::CONTENT_TYPE, header::RETRY_AFTER] {
        if let Some(v) = fresh.headers().get(&name) {
            parts.headers.insert(name, v.clone());
        }
    }
    Response::from_parts(parts, Body::new(fresh.into_body()))
}

/// How the accept loop treats connections.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// `ORDERS_HEADER_TIMEOUT_MS`: a connection that has not sent a whole request
    /// head within this time (since it opened, or since its last answer) is closed.
    pub header_timeout: Duration,
    /// `ORDERS_SHUTDOWN_GRACE_MS`: on a signal, how long requests in flight may
    /// take to finish before the process exits anyway.
    pub shutdown_grace: Duration,
    /// `ORDERS_WRITE_TIMEOUT_MS`: a write to a client that makes no progress
    /// for this long (the client stopped reading, and the socket's buffers are
    /// full) closes the connection.
    pub write_timeout: Duration,
    /// `ORDERS_MAX_CONNECTIONS`: at most this many connections are served at
    /// once; the accept loop waits for one to close before it accepts another.
    pub max_connections: usize,
}

/// A connection whose writes may stall for at most `timeout`: when the peer
/// stops reading, the kernel's buffers fill and a write stays pending; once it
/// has made no progress for `timeout`, it fails with `TimedOut`, which ends the
/// connection (hyper gives up on it and drops it). Every byte written restarts
/// the clock, so a slow reader that keeps reading is never cut off. (hyper's
/// HTTP/1 builder has a header-read timeout, none for writes.)
pub struct WriteTimeout<S> {
    inner: S,
    timeout: Duration,
    /// Running while a write is pending; `None` after any progress.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<S> WriteTimeout<S> {
    pub fn new(inner: S, timeout: Duration) -> Self {
        WriteTimeout {
            inner,
            timeout,
            stalled: None,
        }
    }

    /// What to answer for a pending write: still pending, or the error once it
    /// has been pending for the whole timeout.
    fn pending<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        let timeout = self.timeout;
        let stalled = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match stalled.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(()) => {
                tracing::info!(
                    "orders: a client stopped reading its answer for {timeout:?}; closing its \
                     connection (ORDERS_WRITE_TIMEOUT_MS)"
                );
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client stopped reading its answer",
                )))
            }
        }
    }

    /// A write's result: progress stops the clock.
    fn progress<T>(
        &mut self,
        result: Poll<io::Result<T>>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<T>> {
        match result {
            Poll::Pending => self.pending(cx),
            ready => {
                self.stalled = None;
                ready
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteTimeout<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteTimeout<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.progress(result, cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.progress(result, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let result = Pin::new(&mut self.inner).poll_flush(cx);
        self.progress(result, cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let result = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.progress(result, cx)
    }
}

/// A slot for one more connection: at once while fewer than the cap are open;
/// else, once, a log line, and a wait for one to close.
async fn slot(slots: &Arc<Semaphore>, max: usize) -> OwnedSemaphorePermit {
    if let Ok(permit) = slots.clone().try_acquire_owned() {
        return permit;
    }
    tracing::info!(
        "orders: {max} connections open, the cap (ORDERS_MAX_CONNECTIONS); new ones wait in \
         the listen backlog until one closes"
    );
    let permit = slots
        .clone()
        .acquire_owned()
        .await
        .expect("the semaphore is never closed");
    tracing::info!("orders: below the connection cap again; accepting");
    permit
}

/// Serves `app` on `listener` until `SIGTERM` or `SIGINT`, then stops accepting,
/// lets the requests in flight finish, and idem's `executions` too (work whose
/// client has gone runs on), at most `shutdown_grace` in all, and returns.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    executions: Executions,
) -> Result<(), String> {
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_headers(HYPER_MAX_HEADERS)
        .max_header_size(HYPER_MAX_HEAD_BYTES);
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let mut signal = std::pin::pin!(shutdown_signal()?);
    loop {
        // A slot first: at the cap, new connections wait in the kernel's
        // listen backlog, not in this process.
        let permit = tokio::select! {
            permit = slot(&slots, limits.max_connections) => permit,
            () = &mut signal => break,
        };
        tokio::select! {
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        // Out of descriptors (EMFILE) or a connection reset before
                        // it was accepted: the timeouts free descriptors, so wait a
                        // little instead of spinning on the same error.
                        tracing::warn!(error = %e, "orders: accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let conn = http.serve_connection(
                    TokioIo::new(WriteTimeout::new(stream, limits.write_timeout)),
                    TowerToHyperService::new(app.clone()),
                );
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!(error = %e, "orders: connection ended with an error");
                    }
                    drop(permit);
                });
            }
            () = &mut signal => break,
        }
    }
    drop(listener);
    tracing::info!(
        "orders: shutting down; waiting for {} connection(s)",
        graceful.count()
    );
    let drained = async {
        graceful.shutdown().await;
        executions.drained().await;
    };
    tokio::select! {
        () = drained => {
            tracing::info!("orders: every request in flight finished");
        }
        () = tokio::time::sleep(limits.shutdown_grace) => {
            tracing::warn!(
                running = executions.running(),
                "orders: requests still in flight after {:?}; exiting anyway (their work rolls back)",
                limits.shutdown_grace
            );
        }
    }
    Ok(())
}

/// Resolves on the first `SIGTERM` (what orchestrators send) or `SIGINT` (Ctrl-C).
fn shutdown_signal() -> Result<impl Future<Output = ()>, String> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term =
        signal(SignalKind::terminate()).map_err(|e| format!("cannot watch SIGTERM: {e}"))?;
    let mut int =
        signal(SignalKind::interrupt()).map_err(|e| format!("cannot watch SIGINT: {e}"))?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("orders: SIGTERM"),
            _ = int.recv() => tracing::info!("orders: SIGINT"),
        }
    })
}
