//! The `#[idempotent]` attribute. Use it through `idem_runtime::idempotent`; this
//! crate only forwards to [`expand::idempotent`] (parse → validate → expand).

mod errors;
mod expand;
mod parse;
mod validate;

use proc_macro::TokenStream;

/// Makes an Axum handler safe to retry: for one tenant, one operation and one
/// `Idempotency-Key`, the handler runs at most once within the retention window,
/// and every retry gets the stored answer.
///
/// ```ignore
/// use idem_runtime::{idempotent, Tx};
///
/// #[idempotent(operation = "create-order", retention = "24h", fingerprint(body, header = "x-currency"))]
/// async fn create_order(
///     #[tenant] caller: Caller,          // your auth extractor; implements TenantScope
///     tx: &mut Tx,                       // the transaction that holds the key
///     Json(cmd): Json<NewOrder>,         // the body, last as always in axum
/// ) -> Result<(StatusCode, Json<Order>), ApiError> {
///     let order = insert_order(&mut **tx, &caller, &cmd).await?;
///     Ok((StatusCode::CREATED, Json(order)))
/// }
///
/// // mounted like any handler; the router state must provide an `Idem` via `FromRef`
/// let app = Router::new().route("/orders", post(create_order)).with_state(state);
/// ```
///
/// # Options
///
/// ## `operation = "name"` (required)
///
/// The operation's stable name. Together with the tenant it scopes keys: the same
/// key on `create-order` and `create-refund` never collides. ASCII letters, digits
/// and `-` `_` `.` `:` `/`, at most 128 characters. Keep it when you rename the
/// handler: a new name forgets every stored key.
///
/// ## `retention = "24h"` (required)
///
/// How long a key and its outcome are kept, from the claim: `"90s"`, `"15m"`,
/// `"24h"`, `"7d"` (humantime syntax), parsed at compile time, never zero. A retry
/// within the window replays; a retry after it executes anew. It changes what
/// clients can rely on, so it has no default.
///
/// ## `fingerprint(...)`
///
/// What identifies the logical request besides the key. The tenant, the operation,
/// the method and the matched route are always part of it.
///
/// * `body`: the whole typed body, canonicalised (RFC 8785) from the value the
///   handler receives, so key order, white space and omitted `#[serde(default)]`
///   fields do not matter. The body type must implement `serde::Serialize`.
/// * `body.field`, `body.field.sub`: only these fields (repeatable). A field that
///   does not exist is a compile error at the path in the attribute.
/// * `header = "x-currency"`: a request header (repeatable, case-insensitive,
///   checked at compile time). An absent header and an empty one differ.
///
/// Without `fingerprint(...)`, the whole body is fingerprinted when the handler has
/// a body extractor, and nothing else otherwise. A retry whose fingerprint differs
/// gets `422` and nothing runs.
///
/// ## Tenant: `#[tenant]` on a parameter, or `single_tenant`
///
/// Exactly one parameter marked `#[tenant]` supplies the tenant through
/// `idem_runtime::TenantScope`, usually the application's auth extractor. A service
/// with one tenant writes `single_tenant` instead. Neither is a compile error.
///
/// ## `in_flight_wait = "500ms"`
///
/// How long a duplicate waits for a concurrent first request to finish before it
/// gets `409` with `Retry-After`. Defaults to the `Idem` setting (2 s); at most 60 s.
///
/// ## `lease = "30s"`, `lease_ceiling = "5m"`: leased mode
///
/// For an effect outside the database (a payment provider). The claim commits on
/// its own with an owner token; the handler takes `lease: &mut idem_runtime::Lease`
/// (`&mut Lease<sqlx::Sqlite>` on SQLite) instead of a transaction, passes
/// `lease.downstream_key()` to the downstream system's own idempotency, and may
/// return `idem_runtime::Uncertain` when the effect's outcome is unknown. The lease is renewed in the background while the
/// handler runs, up to `lease_ceiling` (default: ten leases); a worker whose lease
/// was taken over cannot publish its result. See `idem_runtime::lease`.
///
/// ## `crate = "path"`
///
/// Where the runtime is, when it is not `::idem_runtime` (a renamed dependency or a
/// re-export).
///
/// # The handler
///
/// * `async fn`, no `self`, no generics.
/// * One parameter `&mut idem_runtime::Tx`: the transaction in which the key was
///   claimed. Write the operation's effects through it (`&mut **tx` is a
///   `PgConnection`); they commit together with the stored outcome. There is no
///   commit or rollback on it.
/// * Any other extractors, in any order, with the body extractor last. A body
///   extractor is `Json`, `Form`, `Bytes`, `String`, `Body`, `Request`,
///   `Multipart`, `RawForm`, any type whose name ends in `Json` or `Form`, or a
///   parameter marked `#[body]`. To fingerprint a custom body type, implement
///   `idem_runtime::FingerprintBody` for it.
/// * Any return type that implements `IntoResponse`. For a `Result`, `Err` rolls
///   back and stores nothing. An `Ok` (or plain) response with a 5xx status also
///   rolls back; every other response is stored and replayed: a committed `404`
///   business rejection is replayed like a `201`.
///
/// # What this expands to
///
/// Roughly, in plain Rust:
///
/// ```ignore
/// async fn create_order(
///     caller: Caller,
///     request: idem_runtime::IdemRequest,   // key, method, route, headers, Idem from state
///     body: Json<NewOrder>,
/// ) -> axum::response::Response {
///     // the original function, unchanged
///     async fn inner(caller: Caller, tx: &mut Tx, Json(cmd): Json<NewOrder>) -> Result<..> { .. }
///
///     static SPEC: OperationSpec = OperationSpec {
///         operation: "create-order",
///         retention: Duration::from_secs(86400),
///         in_flight_wait: None,
///         fingerprint_headers: &["x-currency"],
///     };
///     let tenant = TenantScope::tenant_id(&caller).to_owned();
///     let fingerprint = Ok(request.fingerprint(&SPEC, &tenant)).and_then(|fp| fp.body(&body.0));
///     idem_runtime::run(request, &SPEC, tenant, fingerprint, Box::new(move |tx| Box::pin(async move {
///         HandlerOutcome::from_result(inner(caller, tx, body).await)
///     }))).await
/// }
/// ```
///
/// `run` begins a transaction, claims the key, and runs the handler on its own task
/// (so a client that disconnects does not cancel a half-done operation), then
/// stores, commits and answers. Extractor rejections (auth, a bad body, a missing
/// or malformed key) happen before the claim and reserve nothing.
///
/// # Errors
///
/// Every misuse is a compile error at the offending token, all reported at once:
/// missing or repeated arguments, unknown ones (with a suggestion), bad or zero
/// durations, invalid header names, missing body fields, no tenant or two, a
/// tenant type without `TenantScope`, a body that is not `Serialize`, no
/// transaction parameter, a body extractor that is not last, two body extractors,
/// a non-`async` function, `self`, generics, and a return type that is not
/// `IntoResponse`.
///
/// # Limitations
///
/// * PostgreSQL, or SQLite with `tx: &mut Tx<Sqlite>`. In the transactional mode
///   the effect must live in the same database; effects elsewhere take the leased
///   mode (either database).
/// * The body is buffered by its extractor before the claim, and the response is
///   buffered before it is stored (limit: `Idem::with_max_response_bytes`, 1 MiB by
///   default; a larger response rolls back and answers `500`; in leased mode, where
///   the effect happened elsewhere, the row becomes `uncertain` and the answer is
///   `202`).
/// * Replays carry only the stored response headers (`content-type`, `location`,
///   `etag`, ... and those added with `Idem::with_stored_header`), never
///   `set-cookie`.
/// * A handler declared `-> impl IntoResponse` is a plain response to idem even
///   when the hidden type is a `Result`: the opaque type hides the `Err`, so only a
///   5xx rolls back. Declare `-> Result<impl IntoResponse, E>` to roll back on `Err`.
/// * The bounded in-flight wait applies to each lock wait: a duplicate that waits
///   behind a first request which rolls back, and then behind the next one, may
///   wait the bound more than once.
/// * The handler body is moved into a nested function, so it cannot use `Self` or
///   the generics of an enclosing `impl`.
/// * Nothing stops the handler from sending `COMMIT` through the transaction by
///   hand; doing so breaks the promise.
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(args.into(), item.into()).into()
}
