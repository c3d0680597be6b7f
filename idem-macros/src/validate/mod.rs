//! Validate: the written arguments and the handler's signature, checked together
//! into a [`Config`] that expansion can trust. Every error is collected, each at
//! its own tokens, so the user sees all of them at once; the signature is checked
//! even when an option could not be read.
//!
//! The checks live by what they check: `signature` (the function itself),
//! `options` (the attribute's options), `parameters` (tenant, handle and body,
//! each parameter placed by `extractors`) and `fingerprint`.

use std::time::Duration;

use proc_macro2::Span;
use syn::ItemFn;

use crate::errors::Errors;
use crate::parse::{RawArgs, Written};

mod extractors;
mod fingerprint;
mod grpc;
mod options;
mod parameters;
mod signature;
#[cfg(test)]
mod tests;

pub(crate) use extractors::{first_type_arg, last_segment};
#[cfg(test)]
pub use grpc::async_trait_output;
pub use grpc::{GrpcConfig, Key, is_grpc_method, request_param, validate_grpc};
pub use signature::{is_idempotent_attr, is_instrument_attr};

/// A checked attribute, ready to expand.
#[derive(Debug)]
pub struct Config {
    pub operation: String,
    pub retention: Duration,
    pub in_flight_wait: Option<Duration>,
    /// Leased mode: the lease and the renewal ceiling.
    pub lease: Option<Duration>,
    pub lease_ceiling: Option<Duration>,
    /// Leased mode, a long operation: `202` at once, the work goes on.
    pub accepted: bool,
    pub headers: Vec<String>,
    pub body: BodyPrint,
    pub tenant: Tenant,
    /// Index into the handler's parameters.
    pub tx: usize,
    /// The parameter before which the idempotency request goes (the body, or a
    /// last parameter that may be one); `None`: last.
    pub request_before: Option<usize>,
    /// The body is a `Result<B, B::Rejection>`: a rejection is answered first.
    pub body_result: Option<usize>,
    /// A last parameter the attribute cannot place (see `BodyPrint::Probe`):
    /// its type decides, before the claim, whether it is a `Result` body whose
    /// rejection is the answer.
    pub probed: Option<usize>,
    /// `None`: `::idem_runtime`. Its tokens carry the span of the string it was
    /// written in, where an unresolved path is then reported.
    pub krate: Option<syn::Path>,
}

/// What of the body goes into the fingerprint, and from which parameter.
#[derive(Debug)]
pub enum BodyPrint {
    None,
    Whole(usize),
    /// Field paths (segments) and the span of the attribute token they came from.
    Fields(usize, Vec<(Vec<String>, Span)>),
    /// The last parameter's type cannot be named (an alias): its type decides
    /// whether it is a body, fingerprinted whole.
    Probe(usize),
    /// Likewise, with `fingerprint(header = ..)` only: a body there is refused.
    ProbeLeftOut(usize),
    /// Likewise, named by `fingerprint(body)`: an extractor of the parts there
    /// is refused (there is no body to take).
    ProbeNamed(usize),
}

/// Where the tenant comes from.
#[derive(Debug)]
pub enum Tenant {
    Param(usize),
    Single,
}

/// Checks everything. `errors` collects what is wrong; the result is `None` when
/// anything was.
// The checks run in this order so that the errors are reported in it.
pub fn validate(
    mut args: RawArgs,
    written: &Written,
    func: &ItemFn,
    errors: &mut Errors,
) -> Option<Config> {
    let sig = &func.sig;
    signature::check_written_once(func, errors);
    signature::check_attrs_below(func, errors);
    signature::check_signature(sig, errors);
    let options = options::check_options(&args, written, errors);
    if args.lease.is_none() {
        signature::refuse_uncertain(sig, errors);
    }
    if let Some(key) = args.key.as_ref() {
        errors.push_at(
            key.span(),
            "`key` names where a gRPC method's key comes from; an HTTP handler's key is the `Idempotency-Key` header: remove `key`",
        );
    }
    let params = parameters::check_parameters(&args, written, sig, errors);
    let (body_param, maybe_body) = parameters::check_body(sig, &params, errors);
    let body = fingerprint::Body {
        param: body_param.map(|(i, c)| (i, c, parameters::typed(sig, i))),
        maybe: maybe_body,
    };
    let (headers, body) = fingerprint::check_fingerprint(args.fingerprint.take(), &body, errors);
    let body_result = parameters::check_body_result(sig, body_param, errors);
    if !errors.is_empty() {
        return None;
    }
    Some(Config {
        operation: options.operation?,
        retention: options.retention?,
        in_flight_wait: options.in_flight_wait,
        lease: options.lease,
        lease_ceiling: options.lease_ceiling,
        accepted: options.accepted,
        headers,
        body,
        tenant: params.tenant?,
        tx: params.tx?,
        request_before: body_param.map(|(i, _)| i).or(maybe_body),
        body_result,
        probed: maybe_body,
        krate: options.krate,
    })
}
