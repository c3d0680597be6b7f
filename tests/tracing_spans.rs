//! Tracing follows the request: the handler runs on a task of its own, and its
//! events still sit inside the caller's span (a `TraceLayer`'s request span,
//! here one opened by the test) and inside idem's span for the request, which
//! names the operation and the outcome and never the key.

mod common;

use sqlx::Postgres;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use idem_runtime::{Idem, Lease, Tx, idempotent};
use tower::ServiceExt;
use tracing::Instrument;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

use common::TestDb;
use common::caller::Caller;
use common::state::AppState;

#[idempotent(operation = "traced", retention = "1h")]
async fn traced(#[tenant] _caller: Caller, tx: &mut Tx<Postgres>) -> StatusCode {
    sqlx::query("SELECT 1").execute(&mut **tx).await.unwrap();
    tracing::info!("the handler speaks");
    StatusCode::CREATED
}

/// A long operation: it speaks once answered `202`, then says it is done.
static EXPORTED: tokio::sync::Notify = tokio::sync::Notify::const_new();

#[idempotent(operation = "traced-export", retention = "1h", lease = "5s", accepted)]
async fn traced_export(#[tenant] _caller: Caller, lease: &mut Lease<Postgres>) -> StatusCode {
    let _ = lease;
    tracing::info!("the export speaks");
    EXPORTED.notify_one();
    StatusCode::CREATED
}

/// What the test subscriber saw: each event's message with the names of the
/// spans it was inside (innermost first), and every field any span recorded.
#[derive(Default)]
struct Seen {
    events: Vec<(String, Vec<String>)>,
    /// Each field a span recorded: the span's name, the field's, its value.
    span_fields: Vec<(String, String, String)>,
}

impl Seen {
    fn saw(&mut self, span: &str, fields: Vec<(String, String)>) {
        self.span_fields.extend(
            fields
                .into_iter()
                .map(|(name, value)| (span.to_owned(), name, value)),
        );
    }
}

struct Capture(Arc<Mutex<Seen>>);

struct Fields<'a>(&'a mut Vec<(String, String)>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push((field.name().to_owned(), format!("{value:?}")));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.push((field.name().to_owned(), value.to_owned()));
    }
}

impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, _: &Id, _: Context<'_, S>) {
        let mut fields = Vec::new();
        attrs.record(&mut Fields(&mut fields));
        self.0.lock().unwrap().saw(attrs.metadata().name(), fields);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let mut fields = Vec::new();
        values.record(&mut Fields(&mut fields));
        let span = ctx.span(id).map(|s| s.name()).unwrap_or_default();
        self.0.lock().unwrap().saw(span, fields);
    }

    fn on_event(&self, event: &tracing::Event<'_>, ctx: Context<'_, S>) {
        let mut fields = Vec::new();
        event.record(&mut Fields(&mut fields));
        let message = fields
            .into_iter()
            .find(|(name, _)| name == "message")
            .map(|(_, v)| v)
            .unwrap_or_default();
        let scope = ctx
            .event_scope(event)
            .map(|scope| scope.map(|span| span.name().to_owned()).collect())
            .unwrap_or_default();
        self.0.lock().unwrap().events.push((message, scope));
    }
}

/// What a test of spans holds: what the subscriber sees (set for the calling
/// test while the guard lives), the router, and its database.
struct Traced {
    seen: Arc<Mutex<Seen>>,
    router: Router,
    idem: Idem<Postgres>,
    _db: TestDb,
    _guard: tracing::subscriber::DefaultGuard,
}

/// `route` at `path`, over a fresh database, with a capturing subscriber.
async fn traced_router(path: &str, route: axum::routing::MethodRouter<AppState>) -> Traced {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let subscriber = tracing_subscriber::registry().with(Capture(seen.clone()));
    let guard = tracing::subscriber::set_default(subscriber);
    let db = TestDb::new().await;
    let idem = Idem::new(db.pool.clone());
    let router = Router::new()
        .route(path, route)
        .with_state(AppState { idem: idem.clone() });
    Traced {
        seen,
        router,
        idem,
        _db: db,
        _guard: guard,
    }
}

#[tokio::test]
async fn a_handlers_events_sit_inside_the_request_span_and_idems() {
    let Traced {
        seen,
        router,
        idem: _,
        _db,
        _guard,
    } = traced_router("/traced", post(traced)).await;
    let send = |key: &'static str| {
        let router = router.clone();
        async move {
            let req = Request::post("/traced")
                .header("authorization", "Bearer acme")
                .header("idempotency-key", key)
                .body(Body::empty())
                .unwrap();
            router
                .oneshot(req)
                .instrument(tracing::info_span!("request", request_id = 42))
                .await
                .unwrap()
        }
    };
    assert_eq!(send("sk_live_SECRET").await.status(), StatusCode::CREATED);
    let replay = send("sk_live_SECRET").await;
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert!(replay.headers().contains_key("idempotent-replayed"));

    let seen = seen.lock().unwrap();
    let spoke: Vec<&Vec<String>> = seen
        .events
        .iter()
        .filter(|(message, _)| message == "the handler speaks")
        .map(|(_, scope)| scope)
        .collect();
    assert_eq!(spoke.len(), 1, "the handler ran once: {:?}", seen.events);
    assert_eq!(
        spoke[0].iter().map(String::as_str).collect::<Vec<_>>(),
        ["idem", "request"],
        "the handler's event, inside idem's span inside the request's"
    );
    let field = |name: &str| -> Vec<&str> {
        seen.span_fields
            .iter()
            .filter(|(_, n, _)| n == name)
            .map(|(_, _, v)| v.as_str())
            .collect()
    };
    assert!(field("idem.operation").contains(&"traced"));
    assert_eq!(field("idem.outcome"), ["executed", "replayed"]);
    assert!(field("idem.replayed").contains(&"true"));
    assert!(field("idem.generation").contains(&"1"));
    assert_eq!(field("http.response.status_code"), ["201", "201"]);
    for (_, name, value) in &seen.span_fields {
        assert!(!value.contains("SECRET"), "{name} shows the key: {value}");
    }
}

/// A long operation's work, which outlives the request's `202`, runs in a span
/// of its own (no parent), not inside the request's: a span holds its parent
/// open, and the request's would stay open for as long as the work ran.
#[tokio::test]
async fn a_long_operations_work_runs_outside_the_request_span() {
    let traced = traced_router("/exports", post(traced_export)).await;
    let req = Request::post("/exports")
        .header("authorization", "Bearer acme")
        .header("idempotency-key", "x-1")
        .body(Body::empty())
        .unwrap();
    let answer = traced
        .router
        .clone()
        .oneshot(req)
        .instrument(tracing::info_span!("request", request_id = 43))
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::ACCEPTED);
    EXPORTED.notified().await;
    // The answer the work settled on is recorded once it is over.
    tokio::time::timeout(
        std::time::Duration::from_secs(60),
        traced.idem.executions().drained(),
    )
    .await
    .expect("the work settles");

    let seen = traced.seen.lock().unwrap();
    let spoke: Vec<&Vec<String>> = seen
        .events
        .iter()
        .filter(|(message, _)| message == "the export speaks")
        .map(|(_, scope)| scope)
        .collect();
    assert_eq!(
        spoke,
        [&vec!["idem.long_operation".to_owned()]],
        "the work's event, in its own span alone: {:?}",
        seen.events
    );
    // Its fields, on its own span (the request's idem span has some of the
    // same names).
    let of_the_work = |name: &str| -> Vec<&str> {
        seen.span_fields
            .iter()
            .filter(|(span, n, _)| span == "idem.long_operation" && n == name)
            .map(|(_, _, v)| v.as_str())
            .collect()
    };
    assert_eq!(of_the_work("idem.operation"), ["traced-export"]);
    assert_eq!(of_the_work("idem.mode"), ["leased"]);
    assert_eq!(of_the_work("idem.generation"), ["1"]);
    assert_eq!(of_the_work("http.response.status_code"), ["201"]);
}
