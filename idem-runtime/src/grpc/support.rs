//! What the code `#[idempotent]` generates for a gRPC method calls. Not a
//! public API: names and signatures here change without notice.

use axum::extract::FromRef;
use axum::response::Response;
use tonic::Status;

pub use super::FromGrpcRequest;
pub use super::call::KeySource;
use crate::config::Idem;
use crate::fingerprint::{FingerprintBuilder, FingerprintError};
use crate::handler::{HandlerOutcome, IdemRequest};
use crate::lease::LeaseBackend;

/// The service, owned: the method's body runs on a task of its own, which
/// cannot borrow `&self`.
pub fn service<S: Clone>(service: &S) -> S {
    service.clone()
}

/// A field of the message, reached the one way the expansion names it (so that
/// a field the message lacks is one error, at the attribute).
pub type Field<M, F> = for<'m> fn(&'m mut M) -> &'m mut F;

/// The accessor of the key field of `M` (`M` inferred from the message).
pub fn key_field<M>(_: &M, field: Field<M, String>) -> Field<M, String> {
    field
}

/// The idempotency request of a call: the key (from `source`, through `field`
/// when the key is a field of the message), the method's name (`method`) as
/// its route, and its metadata when the operation fingerprints some, with the
/// service's [`Idem`].
///
/// # Errors
///
/// `INVALID_ARGUMENT` for a missing or malformed key.
#[allow(clippy::result_large_err)]
pub fn request<DB, const HEADERS: bool, S, M>(
    service: &S,
    call: &mut tonic::Request<M>,
    method: &'static str,
    source: KeySource,
    field: Option<Field<M, String>>,
) -> Result<IdemRequest<DB, HEADERS>, Status>
where
    DB: LeaseBackend,
    Idem<DB>: FromRef<S>,
{
    let key = match field {
        Some(field) => super::call::key(
            source,
            &tonic::metadata::MetadataMap::new(),
            Some(field(call.get_mut()).as_str()),
        )?,
        None => super::call::key(source, call.metadata(), None)?,
    };
    let path = super::call::path(method);
    let uri = axum::http::Uri::try_from(path.as_str())
        .unwrap_or_else(|_| axum::http::Uri::from_static("/"));
    Ok(IdemRequest::from_parts(
        Idem::from_ref(service),
        key,
        axum::http::Method::POST,
        uri,
        || call.metadata().clone().into_headers(),
    ))
}

/// A parameter read from the call (see [`FromGrpcRequest`]).
///
/// # Errors
///
/// The parameter's refusal.
#[allow(clippy::result_large_err)]
pub fn param<T: FromGrpcRequest, M>(call: &tonic::Request<M>) -> Result<T, Status> {
    T::from_grpc_request(call.metadata(), call.extensions())
}

/// Adds the whole message, in its canonical encoding.
///
/// # Errors
///
/// Never; the signature chains with the HTTP steps.
pub fn message<M: prost::Message>(
    fp: FingerprintBuilder,
    message: &M,
) -> Result<FingerprintBuilder, FingerprintError> {
    Ok(fp.raw_body(&message.encode_to_vec()))
}

/// Adds the whole message less its key field (left at its default while the
/// message is encoded, and put back).
///
/// # Errors
///
/// Never.
pub fn message_without<M: prost::Message>(
    fp: FingerprintBuilder,
    message: &mut M,
    key_field: Field<M, String>,
) -> Result<FingerprintBuilder, FingerprintError> {
    let key = std::mem::take(key_field(message));
    let encoded = message.encode_to_vec();
    *key_field(message) = key;
    Ok(fp.raw_body(&encoded))
}

/// A message of the type of `message` with every field at its default, into
/// which `fingerprint(body.a, body.b)` copies its fields.
pub fn projection<M: prost::Message + Default>(_: &M) -> M {
    M::default()
}

/// Copies one field from `from` into `to`.
pub fn copy_field<M, F: Clone>(from: &mut M, to: &mut M, field: Field<M, F>) {
    let value = field(from).clone();
    *field(to) = value;
}

/// The method's result as the pipeline settles it; `leased`: in leased mode,
/// where an [`uncertain`](super::uncertain) status marks the outcome.
pub fn outcome<T: prost::Message>(
    result: Result<tonic::Response<T>, Status>,
    leased: bool,
) -> HandlerOutcome {
    super::answer::outcome(result, leased)
}

/// The pipeline's answer as tonic sends it.
///
/// # Errors
///
/// The method's stored or returned status, or idem's own answer as a status.
pub async fn answer<T: prost::Message + Default>(
    response: Response,
) -> Result<tonic::Response<T>, Status> {
    super::answer::answer(response).await
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use prost::Message as _;

    use super::*;

    #[derive(Clone, PartialEq, prost::Message)]
    struct Order {
        #[prost(string, tag = "1")]
        sku: String,
        #[prost(int32, tag = "2")]
        quantity: i32,
        #[prost(string, tag = "3")]
        request_id: String,
        #[prost(btree_map = "string, string", tag = "4")]
        labels: BTreeMap<String, String>,
    }

    fn print(m: &Order) -> crate::Fingerprint {
        message(FingerprintBuilder::new("t", "op", "POST", "/op"), m)
            .unwrap()
            .finish()
    }

    /// Two encodings of one message: fields in another order, a default
    /// written out, an unknown field, map entries in another order.
    #[test]
    fn two_encodings_of_one_message_are_one_request() {
        let plain = Order {
            sku: "a".into(),
            quantity: 3,
            request_id: String::new(),
            labels: [
                ("x".to_owned(), "1".to_owned()),
                ("y".to_owned(), "2".to_owned()),
            ]
            .into(),
        };
        let entry = |k: &str, v: &str| {
            let mut e = vec![0x0a, k.len() as u8];
            e.extend(k.as_bytes());
            e.extend([0x12, v.len() as u8]);
            e.extend(v.as_bytes());
            let mut f = vec![0x22, e.len() as u8];
            f.extend(e);
            f
        };
        let mut respelled = vec![0x10, 3]; // quantity first
        respelled.extend(entry("y", "2")); // the map's entries in the other order
        respelled.extend([0x1a, 0]); // request_id = "" written out
        respelled.extend([0x0a, 1, b'a']); // then sku
        respelled.extend(entry("x", "1"));
        respelled.extend([0x48, 7]); // field 9, which this message does not know
        let decoded = Order::decode(respelled.as_slice()).unwrap();
        assert_ne!(
            respelled,
            plain.encode_to_vec(),
            "the spellings differ on the wire"
        );
        assert_eq!(print(&decoded), print(&plain));
        let other = Order {
            quantity: 4,
            ..plain.clone()
        };
        assert_ne!(print(&other), print(&plain));
    }

    #[test]
    fn the_key_field_is_left_out_and_put_back() {
        let without = |m: &mut Order| {
            message_without(FingerprintBuilder::new("t", "op", "POST", "/op"), m, |m| {
                &mut m.request_id
            })
            .unwrap()
            .finish()
        };
        let mut a = Order {
            sku: "a".into(),
            request_id: "k-1".into(),
            ..Order::default()
        };
        let mut b = Order {
            request_id: "k-2".into(),
            ..a.clone()
        };
        assert_eq!(without(&mut a), without(&mut b));
        assert_eq!(a.request_id, "k-1", "the key is put back");
        let mut p = projection(&a);
        copy_field(&mut a, &mut p, |m| &mut m.sku);
        assert_eq!(p.sku, "a");
        assert!(p.request_id.is_empty());
    }

    /// A layer that records the call's gRPC path (`tonic::GrpcMethod`), added
    /// or removed in a deploy, must not change the fingerprint: every retry of
    /// a key in its retention would be refused as another request's.
    #[cfg(feature = "postgres")]
    #[tokio::test]
    async fn a_recorded_grpc_path_does_not_change_the_fingerprint() {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://localhost/none")
            .unwrap();
        let idem = Idem::new(pool);
        let spec = crate::handler::OperationSpec::named("create-order");
        let print = |recorded: bool| {
            let mut call = tonic::Request::new(Order::default());
            call.metadata_mut()
                .insert("idempotency-key", "k1".parse().unwrap());
            if recorded {
                call.extensions_mut()
                    .insert(tonic::GrpcMethod::new("orders.v1.Orders", "CreateOrder"));
            }
            let req = request::<sqlx::Postgres, false, _, _>(
                &idem,
                &mut call,
                "create_order",
                KeySource::Metadata,
                None,
            )
            .unwrap();
            req.fingerprint(&spec, "acme").finish()
        };
        assert_eq!(print(true), print(false));
    }
}
