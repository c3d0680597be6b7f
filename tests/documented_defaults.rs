//! The defaults docs/configuration.md's table states are the code's: a reader
//! who sizes a pool or a retry policy from the table gets what runs.

use std::time::Duration;

use idem_runtime::Idem;

/// The default column of the table's row for `method`.
fn documented(method: &str) -> String {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/configuration.md"
    ))
    .expect("docs/configuration.md");
    let row = text
        .lines()
        .find(|l| l.starts_with(&format!("| `{method}(")))
        .unwrap_or_else(|| panic!("no row for {method} in docs/configuration.md"));
    row.split('|')
        .nth(2)
        .expect("a default column")
        .trim()
        .to_owned()
}

fn seconds(d: Duration) -> String {
    format!("{} s", d.as_secs())
}

#[tokio::test]
async fn the_configuration_table_states_the_codes_defaults() {
    type I = Idem<sqlx::Postgres>;
    assert_eq!(
        documented("with_in_flight_wait"),
        seconds(I::DEFAULT_IN_FLIGHT_WAIT)
    );
    assert_eq!(
        documented("with_request_deadline"),
        seconds(I::DEFAULT_REQUEST_DEADLINE)
    );
    assert_eq!(
        documented("with_waiter_limits"),
        format!("{}, {}", I::DEFAULT_WAITERS_PER_KEY, I::DEFAULT_WAITERS)
    );
    assert_eq!(I::DEFAULT_MAX_RESPONSE_BYTES, 1024 * 1024);
    assert_eq!(documented("with_max_response_bytes"), "1 MiB");
    assert_eq!(
        documented("with_operations_path"),
        format!("`{}`", I::DEFAULT_OPERATIONS_PATH)
    );
    let headers = documented("with_stored_header");
    for h in idem_runtime::DEFAULT_STORED_HEADERS {
        assert!(
            headers.contains(&format!("`{h}`")),
            "{h} is not in {headers:?}"
        );
    }
    assert!(documented("with_claims_at_commit").starts_with("on"));
    assert_eq!(documented("with_checkout_test"), "on");
    let pool = sqlx::postgres::PgPoolOptions::new().connect_lazy("postgres://localhost/x");
    let idem = Idem::new(pool.expect("a lazy pool"));
    assert!(idem.claims_at_commit());
    assert!(idem.checkout_test());
}
