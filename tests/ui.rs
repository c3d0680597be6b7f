//! Compile-time behaviour of `#[idempotent]`: every supported shape compiles and
//! mounts on a router; every misuse fails with the message pinned in its `.stderr`.
//! Every case, failing ones included, mounts its handler in a `Router` (with the
//! shared `tests/ui/prelude.rs`), as a real service does: a misuse must fail with
//! the attribute's own error only, never with axum's `Handler<_, _>` error too,
//! and no `.stderr` may hold an error twice.
//! The `.stderr` files are pinned to the toolchain of the project's machines
//! (rustc 1.95); regenerate with `TRYBUILD=overwrite cargo test --test ui`.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass/*.rs");
    t.compile_fail("tests/ui/fail/*.rs");
}
