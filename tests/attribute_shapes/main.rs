//! Every supported shape of `#[idempotent]` compiles and mounts: each module is
//! one shape, a handler mounted on a `Router` with the prelude the attribute's
//! trybuild cases share (`idem-macros/tests/ui/prelude.rs`; the gRPC shapes: a
//! service implementing its trait, with `idem-macros/tests/ui/grpc/prelude.rs`),
//! and its test builds that router (axum checks the routes as they are added).
//!
//! The shapes are ordinary test code, built with the rest of the suite, and not
//! trybuild pass cases: trybuild builds its cases in a target directory of its
//! own, and a single pass case makes it build (rather than check) every
//! dependency there, which on a fresh machine was the suite's largest cost. The
//! misuses stay trybuild cases (idem-macros' `tests/ui.rs` and
//! `tests/ui_grpc.rs`), which then only check.

// The prelude gives every shape the same extractors and types, each uses some;
// and a shape is the parameters a handler takes, which its body need not use.
#![allow(unused_imports, dead_code, unused_variables)]

mod accepted;
mod body_shapes;
mod crate_rename;
mod durations;
mod field_fingerprint;
mod form_body;
mod from_macro_rules;
mod impl_into_response;
mod json_body;
mod json_named_parts_extractor;
mod leased;
mod leased_sqlite;
mod lint_expectations;
mod no_body;
mod readme_leased;
mod single_tenant;
mod sqlite_backend;
mod state_and_path;
mod state_bound_last_extractor;
mod tenant_extractors;
mod unknown_last_parts_extractor;

#[cfg(feature = "grpc")]
mod grpc_inherent_and_fields;
#[cfg(feature = "grpc")]
mod grpc_leased;
#[cfg(feature = "grpc")]
mod grpc_transactional;
