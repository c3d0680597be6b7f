//! Keys this process has lately seen finished: a hint for the claim's first
//! message, never a decision.
//!
//! On PostgreSQL's session path a claim's first message is `BEGIN` with the
//! probe, which fails when the key has a row: right for a new key (no round trip
//! of idem's own), dear for a retry of a finished one (an aborted transaction,
//! an `ERROR` line in the server's log, and a second message to read the key).
//! A client's retry usually comes within seconds, and often to the process that
//! answered (or replayed) the key: for such a key the claim reads the key first
//! instead, one message and no transaction, and decides as after a probe.
//!
//! The table is a fixed array of 64-bit tags, written and read without a lock.
//! It forgets (a slot is overwritten by another key's tag) and it can be stale
//! (the row was swept, purged or has expired since): either way the claim only
//! takes the other first message, and the database decides as always. A tag
//! that matches another key by chance (one in 2^63) costs the same and no more.

use std::hash::{BuildHasher, Hasher, RandomState};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::key::KeyDigest;

/// How many keys the table can hold at once: 128 KiB of tags, allocated the
/// first time a key is recorded (only the PostgreSQL session path records).
const SLOTS: usize = 16 * 1024;

/// Keys seen finished lately by one [`crate::Idem`] and its clones.
#[derive(Debug, Default)]
pub(crate) struct Recent {
    seed: RandomState,
    slots: OnceLock<Box<[AtomicU64]>>,
    /// Records nothing (`test_util::as_another_replica`): every retry reaches
    /// this process as one that did not answer its key.
    forgetful: bool,
}

impl Recent {
    /// A table that never remembers a key (see the field).
    #[cfg(feature = "test-util")]
    pub(crate) fn forgetful() -> Self {
        Recent {
            forgetful: true,
            ..Recent::default()
        }
    }

    /// Records that `key` of `tenant`'s `operation` has a finished row (it was
    /// committed here, or replayed).
    pub(crate) fn finished(&self, tenant: &str, operation: &str, key: &KeyDigest) {
        if self.forgetful {
            return;
        }
        let tag = self.tag(tenant, operation, key);
        let slots = self
            .slots
            .get_or_init(|| (0..SLOTS).map(|_| AtomicU64::new(0)).collect());
        slots[slot(tag)].store(tag, Ordering::Relaxed);
    }

    /// Whether `key` was recorded by [`Recent::finished`] and not overwritten.
    pub(crate) fn seen_finished(&self, tenant: &str, operation: &str, key: &KeyDigest) -> bool {
        let Some(slots) = self.slots.get() else {
            return false;
        };
        let tag = self.tag(tenant, operation, key);
        slots[slot(tag)].load(Ordering::Relaxed) == tag
    }

    /// The key's tag: never 0, so that an empty slot matches nothing.
    fn tag(&self, tenant: &str, operation: &str, key: &KeyDigest) -> u64 {
        let mut h = self.seed.build_hasher();
        // 0xff never occurs in UTF-8: the parts cannot run into each other.
        h.write(tenant.as_bytes());
        h.write_u8(0xff);
        h.write(operation.as_bytes());
        h.write_u8(0xff);
        h.write(key.as_bytes());
        h.finish() | 1
    }
}

/// The slot of a tag (its low bit is always set, so it is left out).
fn slot(tag: u64) -> usize {
    // The cast keeps the low bits, which are all a slot needs.
    (tag >> 1) as usize % SLOTS
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(raw: &str) -> KeyDigest {
        crate::key::IdempotencyKey::parse(raw).unwrap().digest()
    }

    #[test]
    fn a_recorded_key_is_seen_and_no_other() {
        let recent = Recent::default();
        assert!(!recent.seen_finished("t", "op", &k("a")), "an empty table");
        recent.finished("t", "op", &k("a"));
        assert!(recent.seen_finished("t", "op", &k("a")));
        assert!(!recent.seen_finished("t", "op", &k("b")), "another key");
        assert!(!recent.seen_finished("u", "op", &k("a")), "another tenant");
        assert!(
            !recent.seen_finished("t", "op2", &k("a")),
            "another operation"
        );
        // The separator keeps `("ab", "c")` and `("a", "bc")` apart.
        recent.finished("ab", "c", &k("a"));
        assert!(!recent.seen_finished("a", "bc", &k("a")));
    }

    #[test]
    fn the_table_forgets_rather_than_grows() {
        let recent = Recent::default();
        for i in 0..4 * SLOTS {
            recent.finished("t", "op", &k(&format!("key-{i}")));
        }
        let kept = (0..4 * SLOTS)
            .filter(|i| recent.seen_finished("t", "op", &k(&format!("key-{i}"))))
            .count();
        assert!(kept <= SLOTS, "{kept} keys in {SLOTS} slots");
        // The latest keys are the likeliest kept: the last one always is.
        assert!(recent.seen_finished("t", "op", &k(&format!("key-{}", 4 * SLOTS - 1))));
    }
}
