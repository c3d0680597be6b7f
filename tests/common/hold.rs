//! A hold on the examples' orders: both examples wait inside an order's
//! transaction, after its claim, while the file their `ORDERS_HOLD_FILE` names
//! exists. A suite starts a service with [`Hold::env`], lets a request reach
//! the held point, does what must happen meanwhile (the client goes away, a
//! duplicate arrives), and lets it finish with [`Hold::release`]: the order of
//! events is fixed, with no timing of the test's own to guess.
//!
//! Shared by the root suites (`common::hold`) and the gRPC example's harness,
//! which includes this file with `#[path]`.

use std::sync::atomic::{AtomicUsize, Ordering};

/// The hold file; released when dropped too.
pub struct Hold(std::path::PathBuf);

impl Hold {
    /// Holds every order of a service started with [`Hold::env`] until released.
    pub fn new() -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("idem-hold-{}-{n}", std::process::id()));
        std::fs::write(&path, b"held").unwrap();
        Hold(path)
    }

    /// The service's setting: `("ORDERS_HOLD_FILE", path)`.
    pub fn env(&self) -> (&'static str, &str) {
        ("ORDERS_HOLD_FILE", self.0.to_str().unwrap())
    }

    /// The same hold under another of the service's settings (for instance
    /// `PAYMENTS_PROVIDER_HOLD_FILE`).
    pub fn env_as<'a>(&'a self, name: &'static str) -> (&'static str, &'a str) {
        (name, self.0.to_str().unwrap())
    }

    /// Lets the held requests (and every later one) finish.
    pub fn release(&self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.release();
    }
}
