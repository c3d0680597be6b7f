//! Canonical JSON for the fingerprint: any JSON text, respelled as another client
//! would send the same value (keys reordered, white space, escapes, number
//! notations), gives the same canonical bytes and the same fingerprint; and the
//! canonical bytes are JSON that canonicalises to themselves.

#![no_main]

use idem_runtime::fingerprint::canonical_json;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

mod json;

fuzz_target!(|data: &[u8]| {
    let (seed, text) = json::split_seed(data);
    let Ok(value) = serde_json::from_slice::<Value>(text) else {
        return;
    };
    let canonical = canonical_json(&value).expect("a parsed value has a canonical form");

    let reread: Value = serde_json::from_slice(&canonical).unwrap_or_else(|e| {
        panic!(
            "canonical JSON does not parse: {e}: {}",
            String::from_utf8_lossy(&canonical)
        )
    });
    assert_ne!(
        json::same(&value, &reread),
        Some(false),
        "{value} became {reread}"
    );
    assert_eq!(
        canonical_json(&reread).unwrap(),
        canonical,
        "not a fixed point: {value}"
    );

    let mut rng = fastrand::Rng::with_seed(seed);
    let mut respelled = String::new();
    json::respell(&mut rng, &value, &mut respelled);
    let other: Value = serde_json::from_str(&respelled)
        .unwrap_or_else(|e| panic!("the respelling does not parse: {e}: {respelled}"));
    assert_eq!(
        String::from_utf8_lossy(&canonical_json(&other).unwrap()),
        String::from_utf8_lossy(&canonical),
        "{value} respelled as {respelled}"
    );
    assert_eq!(
        json::fingerprint(&value),
        json::fingerprint(&other),
        "{respelled}"
    );
});
