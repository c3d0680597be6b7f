//! The handler's path on the databases that claim at commit: what every one of
//! them keeps is written once in `hot_path/suite.rs` (one finished row written
//! once, a retry of a finished key that never runs the handler, a duplicate that
//! ran beside the first rolled back and answered the first's outcome, exactly
//! one effect when many processes race, takeover of an expired key), mounted in
//! each database's module, which adds what only that database has
//! (`hot_path/postgres.rs`, `hot_path/mysql.rs`). A test is `postgres::<name>`
//! or `mysql::<name>`.

#![allow(
    clippy::duplicate_mod,
    reason = "each database's module mounts the suite again, over its own `Db`"
)]

#[macro_use]
mod common;

#[path = "hot_path/postgres.rs"]
mod postgres;

#[path = "hot_path/mysql.rs"]
mod mysql;
