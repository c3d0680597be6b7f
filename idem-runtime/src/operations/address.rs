//! A long operation's address (its name and its key's digest, below the
//! service's operations path) and the answers that point to it: the `202` of
//! a running operation and the `Location` of the others.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::{Operation, Status, poll_interval};
use crate::handler::OperationSpec;
use crate::key::KeyDigest;

/// One operation's address: its name, its key's digest, and where its resource is.
pub struct Address {
    spec: &'static OperationSpec,
    id: String,
    href: String,
}

impl Address {
    /// The resource of `spec`'s operation under `digest`, below `path`
    /// ([`Idem::operations_path`](crate::Idem::operations_path)).
    pub(crate) fn new(path: &str, spec: &'static OperationSpec, digest: &KeyDigest) -> Self {
        let id = format!("{}/{digest}", spec.operation);
        Address {
            spec,
            href: format!("{path}/{id}"),
            id,
        }
    }

    pub(super) fn document(&self, status: Status, response_status: Option<u16>) -> Operation {
        Operation {
            id: self.id.clone(),
            operation: self.spec.operation.to_owned(),
            status,
            href: self.href.clone(),
            response_status: response_status.filter(|_| status.done()),
            result: status.done().then(|| format!("{}/result", self.href)),
            retry_after: (!status.done())
                .then(|| idem_wire::retry_after_seconds(poll_interval(self.spec))),
        }
    }

    /// The `202 Accepted` of a running operation: the first request's answer,
    /// and every retry's while the work runs, the same each time.
    pub(crate) fn accepted(&self) -> Response {
        let mut resp = json(StatusCode::ACCEPTED, &self.document(Status::Running, None));
        self.locate(&mut resp);
        resp
    }

    /// Adds `Location` (the resource) to an answer about the operation.
    pub(crate) fn locate(&self, resp: &mut Response) {
        if let Ok(v) = HeaderValue::from_str(&self.href) {
            resp.headers_mut().insert(header::LOCATION, v);
        }
    }
}

/// A document as JSON, with `Retry-After` when it has one.
pub(super) fn json(status: StatusCode, doc: &Operation) -> Response {
    let mut resp = (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        serde_json::to_vec(doc).unwrap_or_default(),
    )
        .into_response();
    if let Some(secs) = doc.retry_after {
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    resp
}
