//! Reading Redis's `CLIENT LIST`, for the tests that make `WAIT`s block.
//! Mounted by `tests/common` and, with `#[path]`, by `tests/redis_cluster.rs`
//! (which has no use for the rest of `common`).

/// The ids of the clients `list` (`CLIENT LIST`'s answer) shows blocked in a
/// `WAIT` (`flags` with `b`, the command `wait`).
pub fn waiting_ids(list: &str) -> Vec<u64> {
    list.lines()
        .filter(|l| {
            l.split(' ').any(|f| f == "cmd=wait")
                && l.split(' ')
                    .any(|f| f.strip_prefix("flags=").is_some_and(|fl| fl.contains('b')))
        })
        .filter_map(|l| {
            l.split(' ')
                .find_map(|f| f.strip_prefix("id="))
                .and_then(|id| id.parse().ok())
        })
        .collect()
}
