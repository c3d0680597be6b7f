//! A gate a test's handler stops at until the test lets it go: races made
//! deterministic, one gate per name (each test names its own).

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, LazyLock, Mutex};

/// A handler stopped at a gate of its test's, until let go.
pub struct Gate {
    /// How many runs reached the gate.
    pub visits: AtomicU64,
    /// Notified when a run reaches the gate.
    pub reached: tokio::sync::Notify,
    /// Notified to let a waiting run through.
    pub release: tokio::sync::Notify,
}

impl Gate {
    /// The gate called `name`, one per test.
    pub fn named(name: &str) -> Arc<Gate> {
        static GATES: LazyLock<Mutex<HashMap<String, Arc<Gate>>>> = LazyLock::new(Default::default);
        GATES
            .lock()
            .unwrap()
            .entry(name.to_owned())
            .or_insert_with(|| {
                Arc::new(Gate {
                    visits: AtomicU64::new(0),
                    reached: tokio::sync::Notify::new(),
                    release: tokio::sync::Notify::new(),
                })
            })
            .clone()
    }
}
