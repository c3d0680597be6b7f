//! Shared by the integration tests, mounted by each suite with `mod common;`.

#![allow(dead_code)]

pub mod caller;
mod db;
pub mod gate;
pub mod lease_harness;
pub mod orders;
pub mod respell;
pub mod state;

pub use db::*;
