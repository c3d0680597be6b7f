// A supported shape: a lint expectation on the handler holds for the code the
// user wrote, and the code the attribute adds around it neither fulfils it nor
// leaves it unfulfilled.
#![deny(unfulfilled_lint_expectations)]

include!("../../idem-macros/tests/ui/prelude.rs");

#[idempotent(operation = "ping", retention = "15m")]
#[expect(
    unused_variables,
    reason = "the tenant scopes the key; the body ignores it"
)]
async fn ping(tx: &mut Tx<Postgres>, #[tenant] caller: Caller) -> &'static str {
    let _ = tx;
    "pong"
}

#[tokio::test(flavor = "current_thread")]
async fn mounts_on_a_router() {
    let _: Router = Router::new().route("/ping", post(ping)).with_state(idem());
}
