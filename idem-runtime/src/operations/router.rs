//! The routes of the operation resources: `GET` of an operation's document
//! and of its stored result, for the caller's tenant only.

use std::collections::HashMap;
use std::sync::Arc;

use axum::Router;
use axum::extract::rejection::PathRejection;
use axum::extract::{FromRef, FromRequestParts, Path, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::address::{Address, json};
use super::{AcceptedRegistration, Status, poll_interval};
use crate::config::Idem;
use crate::handler::OperationSpec;
use crate::key::KeyDigest;
use crate::lease::LeaseBackend;
use crate::model::KeyAddress;
use crate::problem::{self, Problem};
use crate::tenant::{TenantError, TenantScope};

/// The operations served: those of every `accepted` handler in the program.
type Registry = HashMap<&'static str, &'static OperationSpec>;

fn registered() -> Registry {
    let mut registry = Registry::new();
    for r in inventory::iter::<AcceptedRegistration>() {
        registry.entry(r.spec.operation).or_insert(r.spec);
    }
    registry
}

/// The routes of the operation resources, for the service to nest at
/// [`Idem::operations_path`] (default `/operations`):
///
/// * `GET {path}/{operation}/{digest}`: `200` with an [`Operation`](super::Operation) document
///   (`Cache-Control: no-store`; `Retry-After` while not done);
/// * `GET {path}/{operation}/{digest}/result`: once done, the stored answer
///   exactly as a retry of the request would get it (`Idempotent-Replayed:
///   true`); before, `409` problem `request-in-flight` with `Retry-After`;
/// * anything else, and any operation the caller's tenant does not have: `404`
///   problem [`problem::OPERATION_NOT_FOUND`], the same every time.
///
/// Every answer says `Cache-Control: no-store`, the result's too (whatever
/// the stored answer said): an address names the operation and the key's
/// digest, not the tenant, so two tenants' operations under one key share it,
/// and a shared cache must never hand one tenant's answer to the other.
///
/// `T` is the caller, extracted as the handlers' `#[tenant]` parameter is (its
/// rejection is its own answer), or [`SingleTenant`](crate::SingleTenant) for a
/// single-tenant service; `DB` is where the operations' leases live (the `Idem<DB>`
/// taken from the state `S`). Only operations of handlers written with
/// `accepted` are served. A tenant taken from the path (`Path<String>`) cannot
/// be `T`: the router's own path parameter is there too; wrap the caller in a
/// type of your own.
pub fn router<T, DB, S>() -> Router<S>
where
    T: FromRequestParts<S> + TenantScope + Send + 'static,
    DB: LeaseBackend,
    Idem<DB>: FromRef<S>,
    S: Clone + Send + Sync + 'static,
{
    let registry = Arc::new(registered());
    if registry.is_empty() {
        tracing::warn!(
            "idem: operations::router serves no operation: no handler in this program is `#[idempotent(.., accepted)]`"
        );
    }
    Router::new()
        .route(
            "/{*__idem_operation}",
            axum::routing::get(
                move |caller: T,
                      State(idem): State<Idem<DB>>,
                      params: Result<Path<HashMap<String, String>>, PathRejection>| {
                    let registry = registry.clone();
                    async move {
                        // A path that does not decode (`%FF`) names no operation.
                        let Ok(Path(params)) = params else {
                            return uncached(not_found());
                        };
                        let rest = params
                            .get("__idem_operation")
                            .map(String::as_str)
                            .unwrap_or_default();
                        uncached(
                            show(
                                &registry,
                                &idem,
                                crate::tenant::caller_tenant_id(&caller),
                                rest,
                            )
                            .await,
                        )
                    }
                },
            ),
        )
        // The path itself, which the catch-all above does not match.
        .route("/", axum::routing::get(|| async { uncached(not_found()) }))
}

/// `resp` with `Cache-Control: no-store` (see [`router`]).
fn uncached(mut resp: Response) -> Response {
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

/// The answer of `GET {path}/{rest}` for `tenant`, as checked for the
/// caller's type (a single-tenant service's caller is `*`).
async fn show<DB: LeaseBackend>(
    registry: &Registry,
    idem: &Idem<DB>,
    tenant: Result<&str, TenantError>,
    rest: &str,
) -> Response {
    let tenant = match tenant {
        Ok(tenant) => tenant,
        Err(e) => {
            tracing::error!(error = %e, "idem: unusable tenant id");
            return Problem::new(
                problem::INVALID_TENANT,
                StatusCode::INTERNAL_SERVER_ERROR,
                "Unusable tenant id",
            )
            .into_response();
        }
    };
    let rest = rest.trim_start_matches('/');
    let (id, wants_result) = match rest.strip_suffix("/result") {
        Some(id) => (id, true),
        None => (rest, false),
    };
    let Some((operation, hex)) = id.rsplit_once('/') else {
        return not_found();
    };
    let Some(spec) = registry.get(operation).copied() else {
        return not_found();
    };
    // Only the spelling idem writes: one resource, one address.
    let digest = match KeyDigest::from_hex(hex) {
        Ok(d) if d.to_string() == hex => d,
        _ => return not_found(),
    };
    let key = KeyAddress {
        tenant,
        operation,
        digest,
    };
    let row = match DB::lease_operation(idem.lease_store(), &key, wants_result).await {
        Ok(Some(row)) => row,
        Ok(None) => return not_found(),
        Err(e) => {
            tracing::error!(operation, error = %e, "idem: cannot read an operation");
            // Not "nothing was stored": the operation may have run, and
            // a client that believed it might send it anew under a new key.
            return Problem::store_unavailable()
                .with_detail("the operation could not be read; ask again later")
                .into_response();
        }
    };
    // A state the schema does not allow failed to read above (503).
    let status = Status::of(&row);
    let address = Address::new(idem.operations_path(), spec, &digest);
    match (wants_result, row.outcome) {
        (true, Some(stored)) if status.done() => {
            match crate::at_rest::open(idem.key_ring(), tenant, operation, &digest, stored) {
                Ok(stored) => crate::response::replay(stored),
                Err(e) => {
                    tracing::error!(operation, error = %e, "idem: cannot open an operation's result");
                    Problem::outcome_unreadable().into_response()
                }
            }
        }
        (true, _) => {
            let detail = match status {
                Status::Stalled => {
                    "the operation stopped before it finished; send the original request again with the same key to resume it"
                }
                _ => "the operation has no result yet; ask again later",
            };
            let mut resp = Problem::in_flight(poll_interval(spec))
                .with_detail(detail)
                .into_response();
            address.locate(&mut resp);
            resp
        }
        (false, outcome) => {
            let doc = address.document(status, outcome.map(|o| o.status));
            json(StatusCode::OK, &doc)
        }
    }
}

/// The one answer for every operation the caller cannot see: nothing in it
/// depends on why.
fn not_found() -> Response {
    Problem::new(
        problem::OPERATION_NOT_FOUND,
        StatusCode::NOT_FOUND,
        "No such operation",
    )
    .into_response()
}
