//! Canonical JSON for the fingerprint tells values apart exactly: two JSON texts
//! (the fuzzer's bytes split at the first 0xff, which no JSON text holds) give
//! equal canonical bytes, and equal fingerprints, if and only if they mean the
//! same value.

#![no_main]

use idem_runtime::fingerprint::canonical_json;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

mod json;

fuzz_target!(|data: &[u8]| {
    let Some(at) = data.iter().position(|&b| b == 0xff) else {
        return;
    };
    let (Ok(a), Ok(b)) = (
        serde_json::from_slice::<Value>(&data[..at]),
        serde_json::from_slice::<Value>(&data[at + 1..]),
    ) else {
        return;
    };
    let (ca, cb) = (canonical_json(&a).unwrap(), canonical_json(&b).unwrap());
    let Some(same) = json::same(&a, &b) else {
        return;
    };
    assert_eq!(
        ca == cb,
        same,
        "{a} and {b}: canonical {} and {}",
        String::from_utf8_lossy(&ca),
        String::from_utf8_lossy(&cb)
    );
    assert_eq!(
        json::fingerprint(&a) == json::fingerprint(&b),
        same,
        "{a} and {b}"
    );
});
