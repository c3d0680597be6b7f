//! Shared by the integration tests, mounted by each suite with `mod common;`.

#![allow(dead_code)]

pub mod caller;
pub mod client_list;
mod db;
pub mod faults;
pub mod gate;
pub mod hold;
pub mod lease_harness;
pub mod orders;
pub mod respell;
pub mod state;

pub use db::*;

/// `#[tokio::test]` wrappers for the tests a suite file (`$module`) holds, in
/// the database's module that mounts it, so the tests' paths stay
/// `<database>::<name>`. A test written in a suite file but left out of its list
/// is an unused function, which the build refuses (`-D warnings`). Reached with
/// `#[macro_use] mod common;`.
#[allow(unused_macros)]
macro_rules! stamp {
    ($module:ident => $($test:ident),* $(,)?) => {
        $(
            #[tokio::test]
            async fn $test() {
                $module::$test().await
            }
        )*
    };
    // On a runtime of two workers, for what one blocked worker must not stop.
    (two_workers $module:ident => $($test:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                $module::$test().await
            }
        )*
    };
}
