//! The `#[idempotent]` attribute. Use it through `idem_runtime::idempotent`; this
//! crate only forwards to `expand::idempotent` (parse → validate → expand).

mod errors;
mod expand;
mod expand_grpc;
mod parse;
#[cfg(test)]
mod surface;
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
///     tx: &mut Tx<Postgres>,                       // the transaction that holds the key
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
/// Options are written `name = "value"` (strings, quoted), flags alone
/// (`single_tenant`), and `fingerprint(...)` as a list.
///
/// ## `operation = "name"` (required)
///
/// The operation's stable name. Together with the tenant it scopes keys: the same
/// key on `create-order` and `create-refund` never collides. ASCII letters, digits
/// and `-` `_` `.` `:` `/`, at most 128 characters; with `accepted`, no empty,
/// `.` or `..` segment between `/`s (the long operation's resource URL holds
/// the name). Keep it when you rename the handler: a new name forgets every
/// stored key.
///
/// ## `retention = "24h"` (required)
///
/// How long a key and its outcome are kept, from the moment the outcome is stored:
/// `"90s"`, `"15m"`, `"24h"`, `"7d"` (humantime syntax), parsed at compile time,
/// between `1ms` and 100 years. It is stored in whole milliseconds (a fraction of a
/// millisecond is dropped). A retry within the window replays; a retry after it
/// executes anew. It changes what clients can rely on, so it has no default.
///
/// ## `fingerprint(...)`
///
/// What identifies the logical request besides the key. The tenant, the operation,
/// the method, the matched route and the concrete path and query are always part
/// of it.
///
/// * `body`: the whole body (see *The body* below for each shape).
/// * `body.field`, `body.field.sub`: only these fields (repeatable). A field that
///   does not exist is a compile error at the path in the attribute.
/// * `header = "x-currency"`: a request header (repeatable, case-insensitive,
///   checked at compile time). An absent header and an empty one differ.
/// * `ignore_body`: the body is deliberately not part of the fingerprint.
///
/// Without `fingerprint(...)`, the whole body is fingerprinted when the handler has
/// one, and nothing else. A `fingerprint(...)` on a handler with a body must say
/// what becomes of the body, `body`, `body.field` or `ignore_body`: leaving it out
/// silently would let a retry with the same key and another body replay the first
/// answer. A retry whose fingerprint differs gets `422` and nothing runs.
///
/// ## Tenant: `#[tenant]` on a parameter, or `single_tenant`
///
/// Exactly one parameter marked `#[tenant]` supplies the tenant through
/// `idem_runtime::TenantScope`, usually the application's auth extractor. The
/// runtime implements it for `Extension<T>` when `T: TenantScope` (a caller an auth
/// middleware inserted), for `Path<String>` (a tenant named by the route; check
/// the caller's membership before the handler, in a middleware: a retry is
/// answered without running the handler), and for `&T`, `Box<T>`, `Arc<T>`. Another crate's type
/// cannot implement it (the orphan rule): wrap it in a type of your own. A
/// service with one tenant writes `single_tenant` instead.
///
/// ## `in_flight_wait = "500ms"`
///
/// How long a duplicate waits for a concurrent first request to finish before it
/// gets `409` with `Retry-After`. Defaults to the `Idem` setting (2 s); between 0
/// and 60 s. Transactional mode only.
///
/// ## `lease = "30s"`, `lease_ceiling = "5m"`: leased mode
///
/// For an effect outside the database (a payment provider). The claim commits on
/// its own with an owner token; the handler takes `lease: &mut idem_runtime::Lease<Postgres>`
/// (`Lease<sqlx::Sqlite>`, `Lease<sqlx::MySql>`, or `Lease<Redis>` on a Redis lease
/// store) instead of a transaction, passes
/// `lease.downstream_key()` to the downstream system's own idempotency, and may
/// return `idem_runtime::Uncertain` when the effect's outcome is unknown. The lease
/// (between 100 ms and 100 years) is renewed every third of its length while the
/// handler runs, up to `lease_ceiling` (at least one lease; default: ten leases);
/// a worker whose lease was taken over cannot publish its result. See
/// `idem_runtime::lease`.
///
/// ## `accepted`: a long operation (with `lease`)
///
/// For work longer than a client waits (an export, provisioning): the request is
/// answered `202 Accepted` at once, with `Location` of the operation's resource
/// and `Retry-After` (a third of the lease, at least a second), while the handler
/// works on under its lease. Its answer is stored as in leased mode; every retry
/// with the key gets the same `202` while the work runs (or `409` with
/// `Retry-After`, if its claim could not read the key's row in time), and the
/// stored answer once it is done. `idem_runtime::operations::router` serves
/// the resource (`GET`: running, stalled, succeeded, failed or uncertain, and
/// the result).
/// Leased mode only: a transaction cannot stay open past its request. Set
/// `lease_ceiling` to the longest the work may take: renewals stop at the
/// ceiling (ten leases by default, a minute for `lease = "6s"`), and work still
/// running past it loses its lease, is shown `stalled`, and is taken over by
/// the next retry.
///
/// ## `key = "metadata"` or `key = "body.request_id"`: gRPC methods
///
/// On a tonic service method (idem-runtime's feature `grpc`), where the key
/// travels: the `idempotency-key` request metadata entry, or a string field of
/// the request message (AIP-155's `request_id`), which is then left out of the
/// fingerprint. Required there; refused on an HTTP handler, whose key is the
/// `Idempotency-Key` header. See *gRPC methods* below.
///
/// ## `crate = "path"`
///
/// Where the runtime is, when it is not `::idem_runtime` (a renamed dependency or a
/// re-export). The handler is then emitted through a macro found at that path, so
/// a wrong path is reported once, at the path (and the handler is then missing
/// where it is mounted), not at each of its uses; nothing else is emitted beside
/// the handler, so it may be an associated function in an `impl` block too.
///
/// # The handler
///
/// * A free `async fn`: not `unsafe`, `extern` or `const`, no `self`, no generic,
///   lifetime or const parameters, no `where` clause, no `impl Trait` or
///   `#[cfg]` parameters.
/// * One parameter `tx: &mut idem_runtime::Tx<Postgres>` (`Tx<sqlx::Sqlite>`, `Tx<sqlx::MySql>`),
///   written with its name `Tx`, which picks the backend: the transaction in which
///   the key was claimed. Write the operation's effects through it (`&mut **tx` is
///   the connection); they commit together with the stored outcome. There is no
///   commit or rollback on it. In leased mode, `lease: &mut Lease<Postgres>` instead.
/// * Any other extractors, in any order, with the body extractor last.
/// * Any return type that implements `IntoResponse`. For a `Result`, `Err` rolls
///   back and stores nothing. An `Ok` (or plain) response with a 5xx status also
///   rolls back; every other response is stored and replayed: a committed `404`
///   business rejection is replayed like a `201`.
/// * Attribute macros that read the handler as written, such as
///   `#[tracing::instrument]` and `#[utoipa::path]`, go above `#[idempotent]`:
///   they then expand first, on your signature. Below it they would see the
///   function idem writes; `#[instrument]` there is a compile error with this
///   hint.
///
/// ## The body
///
/// The body extractor is found by its type's name, by its pattern, or by a mark:
///
/// | shape | fingerprinted as |
/// | --- | --- |
/// | `Json<T>`, `Form<T>` (`T: Serialize`) | the typed value, as RFC 8785 canonical JSON (key order and white space do not matter) |
/// | `String` | the text |
/// | `Bytes`, `RawForm` | the bytes sent, byte for byte |
/// | `Option<B>` of one of these | `B`, or no body when none was sent (a different request) |
/// | `Result<B, B::Rejection>` (`Result<Json<T>, JsonRejection>`) | `B`; a rejection is answered with axum's own response for it before anything is claimed, so the handler only ever sees `Ok` |
/// | a generic type whose name ends in `Json` or `Form` (`ValidJson<T>`; `AcceptJson`, without a type argument, is placed as any other extractor), or any type marked `#[body]` | its `idem_runtime::FingerprintBody` value |
/// | an alias: `Json(cmd): OrderBody` | by the pattern's name |
/// | an alias written `cmd: OrderBody`, as the last parameter | by its type, probed at compile time: a body is fingerprinted (or refused if it cannot be), anything else is taken as an extractor of the request's parts |
/// | `Body`, `Request`, `Multipart` | streams: they cannot be fingerprinted before the claim; write `fingerprint(ignore_body)` (with headers) |
///
/// # gRPC methods
///
/// On a method of a tonic service, inside its `#[tonic::async_trait]` impl (or
/// on an inherent `async fn`), with `&self`, the `#[tenant]` (or
/// `single_tenant`), the handle (`tx: &mut Tx<..>`, or `lease: &mut Lease<..>`)
/// and the `tonic::Request<M>` last:
///
/// ```ignore
/// #[tonic::async_trait]
/// impl Orders for OrdersService {
///     #[idempotent(operation = "create-order", retention = "24h", key = "metadata")]
///     async fn create_order(&self, #[tenant] caller: Extension<Caller>, tx: &mut Tx<Postgres>,
///                           request: Request<CreateOrderRequest>) -> Result<Response<Order>, Status> {
///         // ...
///     }
/// }
/// ```
///
/// The method keeps the signature tonic declares, `create_order(&self,
/// request)`: the tenant and other parameters are read from the call
/// (`idem_runtime::grpc::FromGrpcRequest`), the handle is idem's. The service
/// must be `Clone` and provide `Idem<DB>` through `FromRef`. `fingerprint(body)`
/// is the message (the default), `body.field` its top-level fields,
/// `header = ".."` a metadata entry. A message or a decision status is
/// stored; a status a retry may get past rolls back
/// (`idem_runtime::grpc::is_stored`). The answers, the table and the client
/// half are in the repository's docs/grpc.md.
///
/// # What this expands to
///
/// Roughly, in plain Rust (`rt` is `::idem_runtime::__private`, the runtime's
/// support module; its names are not a public API):
///
/// ```ignore
/// /// <your documentation, then a section on the generated signature>
/// async fn create_order(
///     caller: Caller,
///     // key, method, route, headers and the `Idem` from the router state; the
///     // database is the one of your `&mut Tx<..>` (or `&mut Lease<..>`) parameter
///     idempotency: rt::IdemRequest<<Tx as rt::TxHandle>::Db>,
///     cmd: Json<NewOrder>, // the names your patterns bind, where one binds one
/// ) -> rt::Response {
///     // the original function, unchanged
///     async fn __idem_inner(caller: Caller, tx: &mut Tx<Postgres>, Json(cmd): Json<NewOrder>) -> Result<..> { .. }
///
///     static __IDEM_SPEC: rt::OperationSpec = rt::OperationSpec {
///         operation: "create-order",
///         retention: Duration::from_secs(86400),
///         in_flight_wait: None,
///         fingerprint_headers: &["x-currency"],
///         lease: None,          // Some(..) with `lease = ".."`
///         lease_ceiling: None,
///         accepted: false,      // true with `accepted`, which also registers the
///                               // operation for `idem_runtime::operations::router`
///     };
///     // (a `Result<B, B::Rejection>` body parameter's rejection is answered here)
///     let tenant = rt::tenant_id::<Caller>(&caller);
///     let fingerprint = rt::start_fingerprint(&idempotency, &__IDEM_SPEC, &tenant)
///         .and_then(|fp| rt::fingerprint_body(fp, &cmd));
///     let handler = rt::handler_for(&idempotency, move |tx| Box::pin(async move {
///         let out = __idem_inner(caller, tx, cmd).await;
///         // the return type picks the outcome: a `Result`'s `Err` rolls back,
///         // any other response is the answer (resolved at the return type's span)
///         (&rt::KindProbe(&out)).__idem_kind().outcome(out)
///     }));
///     rt::run(idempotency, &__IDEM_SPEC, tenant, fingerprint, handler).await
///     // leased mode: `rt::leased_handler_for`, and `run` takes the lease's mode
/// }
/// ```
///
/// The generated function keeps your documentation, to which a section
/// *Idempotency* is added: the operation, the retention, what identifies a request,
/// and the handler's signature as you wrote it. Its parameters keep the names
/// your patterns bind where a pattern binds one (`Json(cmd)` becomes `cmd`), so
/// rustdoc and IDE hovers show `create_order(caller: Caller, idempotency:
/// IdemRequest, cmd: Json<NewOrder>) -> Response`.
///
/// Extractor rejections (auth, a bad body, a missing or malformed key) happen
/// before anything else and reserve nothing; an unusable tenant id or a body
/// that cannot be fingerprinted is answered before the claim. Everything after
/// (begin, claim, the handler, store, commit) runs on a task of its own, so a
/// client that disconnects does not cancel a half-done operation.
///
/// # Errors
///
/// Every misuse is a compile error at the tokens it is about, reported once, all
/// of them at once: a bad option does not hide the signature's errors, and an
/// option that was refused is not also reported missing. When any is found, the
/// handler is replaced by a stub that axum accepts (`async fn name() {}`), so that
/// mounting it in a `Router` adds no second error (the function as written is kept
/// under a hidden name, so its body is still checked).
///
/// | rule | the error (abridged) |
/// | --- | --- |
/// | options are `name = "value"`, flags and `fingerprint(...)` | "`retention` takes a string: write `retention = \"24h\"`"; "`single_tenant` is a flag and takes no value: write `single_tenant` alone"; "a bare value: options are written `name = \"value\"`" |
/// | known options only | "unknown option `retension` ...: did you mean `retention`? the options are ..." |
/// | each option once | "`retention` is written twice: keep one" |
/// | `operation` and `retention` are given | "missing `operation`: add `operation = \"create-order\"` ..." |
/// | `operation` is a short ASCII name | "`operation` may hold ASCII letters, digits and `-` `_` `.` `:` `/` only ..." / "must not be empty" / "at most 128" / with `accepted`, "has an empty, `.` or `..` segment ..." |
/// | durations parse | "`retention` is not a duration (...): write e.g. \"90s\" ..." |
/// | `retention` between 1ms and 100 years | "`retention` must be between 1ms and 100 years, not \"500us\": a key is stored in whole milliseconds ..." |
/// | `in_flight_wait` between 0 and 60 s, transactional mode only | "`in_flight_wait` must be between 0s and 1m ..."; "`in_flight_wait` applies to the transactional mode ..." |
/// | `lease` between 100 ms and 100 years | "`lease` must be between 100ms and 100 years ...: a lease is renewed every third of its length ..." |
/// | `lease_ceiling` needs `lease` and is at least one lease | "`lease_ceiling` needs `lease = \"...\"`"; "`lease_ceiling` (10s) is shorter than `lease` (30s): the lease would never be renewed ..." |
/// | `accepted` is a flag, with `lease` | "`accepted` needs `lease = \"...\"`: a long operation answers `202 Accepted` at once and keeps working after its answer ..."; "`accepted` is a flag and takes no value: write `accepted` alone" |
/// | `crate` is a path | "`crate` must be a path such as \"::idem_runtime\" ..." (a path that does not resolve: an error at the attribute's string, and the handler missing where it is mounted) |
/// | header names are valid, not the key, listed once | "\"x currency\" is not a valid HTTP header name"; "the Idempotency-Key is the key itself ..."; "the header \"x-ok\" is listed twice" |
/// | `body` or `body.field`, not both; fields are paths that exist | "`body` already fingerprints the whole body ..."; "no field `skuu` on type `NewOrder`" |
/// | `fingerprint(body...)` needs a body | "`fingerprint(body...)` needs a body: add a body extractor ..." |
/// | a body is in the fingerprint or left out explicitly | "`fingerprint(header = \"x\")` leaves the request body out of the fingerprint ...: write `fingerprint(body, header = \"x\")` ..., or `fingerprint(header = \"x\", ignore_body)` ..."; behind an alias: "`OrderBody` reads the request body, which this `fingerprint(...)` leaves out" |
/// | `ignore_body` only with a body and without `body` | "`ignore_body`, but the handler reads no body"; "`ignore_body` contradicts `body`" |
/// | the body can be fingerprinted | "`Upload` cannot be fingerprinted as a request body" (implement `FingerprintBody`, wrap another crate's type, or `ignore_body`); a stream: "this body is a stream, which idem cannot fingerprint before the claim ..."; "the trait bound `Secret: Serialize` is not satisfied" |
/// | a last parameter idem cannot place is asked with the handler's state | "`#[idempotent]` cannot tell whether `Signed` reads the request body" (an extractor for `AppState` only, in a handler without `State<AppState>`: name the state, move a parts extractor before another parameter, or mark a body `#[body]`) |
/// | one body extractor, last | "a second body extractor ..."; "the body extractor must be the last parameter ..." |
/// | written once | "`#[idempotent]` is written twice on `create_order`: keep one" |
/// | an `async fn` | "`#[idempotent]` handlers must be async: write `async fn create_order`" |
/// | not `unsafe`, `extern` or `const` | "`#[idempotent]` handlers cannot be `unsafe fn`: ... put the unsafe operations in an `unsafe { ... }` block" |
/// | no generics | "generic handlers are not supported ..."; "lifetime parameters are not supported ...: take owned types (`String`, not `&'a str`)"; "const generic parameters ..."; "`where` clauses ..." |
/// | no `self`, `impl Trait` or `#[cfg]` parameters | "`#[idempotent]` cannot take `self` ..."; "`impl Trait` parameters are generics ..."; "conditional parameters are not supported ..." |
/// | exactly one tenant | "`create_order` has no tenant: mark ... `#[tenant]` ..., or add `single_tenant`"; "only one parameter can be the `#[tenant]`"; "`#[tenant]` contradicts `single_tenant`"; "the request body cannot be the `#[tenant]`"; "`#[tenant]` marks the parameter that identifies the caller, not the transaction" |
/// | the tenant implements `TenantScope` | "`Anonymous` does not identify a tenant" (with what works for your own type, `Extension<T>`, `Path<String>`, another crate's type) |
/// | one `&mut Tx<Postgres>` (or `&mut Lease<Postgres>` in leased mode), by name | "`create_order` takes no transaction: add a parameter `tx: &mut idem_runtime::Tx<Postgres>` ..."; "takes no lease"; "this is not idem's transaction: take `tx: &mut idem_runtime::Tx<Postgres>` ..."; "with `lease = \"...\"` the handler holds a lease, not a transaction ..."; "`Lease` is the handle of leased mode: add `lease = \"30s\"` ..."; "the handler takes two `&mut` parameters"; "take it as `tx: &mut idem_runtime::Tx<Postgres>`; other references cannot be extracted" |
/// | no `Uncertain` in a transactional handler's return type | "`Uncertain` is a leased handler's answer: ..." (with the way to leased mode) |
/// | the output is a response | "the trait bound `NotAResponse: IntoResponse` is not satisfied" |
///
/// Each is pinned by a case in `idem-macros/tests/ui/fail` (every case mounts its handler in a
/// `Router`).
///
/// # Limitations
///
/// * PostgreSQL, SQLite or MySQL / MariaDB (`Tx<..>` names the one). In the
///   transactional mode the effect must live in the same database; effects elsewhere
///   take the leased mode, on any of them or on Redis (`Lease<Redis>`).
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
/// * `Result<B, B::Rejection>` must be written out: behind an alias the attribute
///   cannot tell it from a plain body, and the handler would see the `Err` after
///   the claim.
/// * A body extractor the attribute cannot recognise (an alias or an unmarked
///   custom type) that is not the last parameter is reported by axum at the router,
///   as for any handler.
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
