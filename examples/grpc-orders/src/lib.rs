//! `grpc-orders`: the orders service over gRPC (tonic), whose `Create*`
//! methods are safe to retry, built with `#[idempotent]` on the methods of its
//! tonic service. `cargo run -p grpc-orders` runs it; `tests/e2e.rs` drives it
//! with a tonic client over a real socket, and `tests/grpcio_client.py` with
//! Python's grpcio.
//!
//! Environment:
//!
//! | variable | default | meaning |
//! | --- | --- | --- |
//! | `DATABASE_URL` | unset: the SQLite file `idem-grpc-orders.db` in the working directory | `postgres://...` for PostgreSQL, `mysql://...` for MySQL / MariaDB, `sqlite:PATH` for another SQLite file |
//! | `IDEM_LEASE_STORE` | unset: the database of `DATABASE_URL` | `redis://HOST:PORT[/DB]`: `CreatePayment`'s leases live in Redis |
//! | `IDEM_LEASE_STORE_PREFIX` | `idem` | with `IDEM_LEASE_STORE`: the prefix of every Redis key |
//! | `IDEM_ADDR` | `127.0.0.1:50051` | listen address (`127.0.0.1:0` picks a free port; the first line on standard output says which) |
//! | `ORDERS_LATENCY_MS` | `0` | slow work inside `CreateOrder`'s transaction, after the insert |
//! | `ORDERS_HOLD_FILE` | unset | a path: while the file exists, `CreateOrder` waits inside its transaction after the insert (the tests hold a call mid-way and release it by removing the file) |
//! | `PAYMENTS_PROVIDER_LATENCY_MS` | `0` | the simulated provider's latency per charge |
//! | `PAYMENTS_PROVIDER_HOLD_FILE` | unset | a path: while the file exists, `CreatePayment` waits after its charge, holding its lease (the tests hold a payment mid-way and release it by removing the file) |
//! | `PAYMENTS_PROVIDER_TIMEOUT_AFTER_CHARGE` | `0` | the provider's next N charges time out after charging: the payment's outcome is uncertain until the reconciler asks |
//! | `PAYMENTS_RECONCILE_INTERVAL_MS` | `5000` | how often uncertain payments are reconciled (1 to 3600000) |
//! | `IDEM_IN_FLIGHT_WAIT_MS` | `1000` | how long a duplicate waits for the first (at most 5000) |
//! | `IDEM_KEY_RING` | unset: answers are stored in clear | `ID:BASE64` keys of 32 bytes, separated by commas: every answer idem stores (a method's message or status, on every store) is sealed with the active key and opened when a retry replays it (docs/security.md); a malformed ring stops the service at start |
//! | `IDEM_ACTIVE_KEY` | the only key | with several keys in `IDEM_KEY_RING`: the id of the one that seals new answers |

pub mod auth;
pub mod reconcile;
pub mod server;
pub mod service;
pub mod store;

/// The messages, server and client `build.rs` generates from
/// `proto/orders.proto`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod pb {
    tonic::include_proto!("orders.v1");
}
