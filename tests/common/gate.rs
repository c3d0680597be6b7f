//! A gate a test's handler stops at until the test lets it through: races made
//! deterministic. Arrivals and passes are counted, so neither side can miss
//! the other, whichever comes first.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

use tokio::sync::Semaphore;

/// Where a handler waits for its test.
pub struct Gate {
    visits: AtomicU64,
    arrived: Semaphore,
    passes: Semaphore,
}

impl Gate {
    /// A gate of its own, for a test that hands it to its handler (in the
    /// router's state).
    pub fn new() -> Arc<Gate> {
        Arc::new(Gate {
            visits: AtomicU64::new(0),
            arrived: Semaphore::new(0),
            passes: Semaphore::new(0),
        })
    }

    /// The gate called `name`, for handlers that find theirs by a name in the
    /// request (each test uses names of its own).
    pub fn named(name: &str) -> Arc<Gate> {
        static GATES: LazyLock<Mutex<HashMap<String, Arc<Gate>>>> = LazyLock::new(Default::default);
        GATES
            .lock()
            .unwrap()
            .entry(name.to_owned())
            .or_insert_with(Gate::new)
            .clone()
    }

    /// Counts a run that reaches the gate; `true` for the first.
    pub fn first_visit(&self) -> bool {
        self.visits.fetch_add(1, Ordering::SeqCst) == 0
    }

    /// In a handler: says it has arrived, then waits until the test lets it
    /// through.
    pub async fn stop(&self) {
        self.arrived.add_permits(1);
        self.passes.acquire().await.unwrap().forget();
    }

    /// In the test: waits until a run has arrived (each arrival is seen once).
    pub async fn arrival(&self) {
        self.arrived.acquire().await.unwrap().forget();
    }

    /// In the test: lets `n` runs through, now or when they arrive.
    pub fn open(&self, n: usize) {
        self.passes.add_permits(n);
    }
}
