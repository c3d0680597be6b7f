//! Shared by the JSON targets: spelling a value the way another client might,
//! and when two JSON values mean the same.

#![allow(dead_code)] // each target uses part of it

use idem_runtime::FingerprintBuilder;
use serde_json::{Number, Value};

/// The fingerprint of a request with this JSON body.
pub fn fingerprint(v: &Value) -> idem_runtime::Fingerprint {
    FingerprintBuilder::new("tenant", "op", "POST", "/route")
        .body(v)
        .expect("every parsed JSON value has a canonical form")
        .finish()
}

/// The fuzzer's bytes: a seed for the respelling, then the JSON text.
pub fn split_seed(data: &[u8]) -> (u64, &[u8]) {
    if data.len() < 8 {
        return (0, data);
    }
    let (seed, rest) = data.split_at(8);
    (u64::from_le_bytes(seed.try_into().unwrap()), rest)
}

// The respelling is the property tests' own, shared so that both hold
// canonical JSON to the same spellings.
#[path = "../../tests/common/respell.rs"]
mod respell;
#[allow(unused_imports)] // json_distinct does not respell
pub use respell::respell;

fn int(n: &Number) -> Option<i128> {
    n.as_i64().map(i128::from).or(n.as_u64().map(i128::from))
}

/// Whether two JSON values mean the same: what canonical JSON must preserve.
/// Numbers compare by value: integers exactly, floats as doubles (so `-0.0` is
/// `0`), an integer and a float when the double is that integer, below 1e21
/// (where the canonical form writes a whole double as its exact integer; at
/// 2^53 and up it once wrote the shortest spelling, another integer's: see
/// README.md).
///
/// `None` is never answered now; it stays for a corner found again.
pub fn same(a: &Value, b: &Value) -> Option<bool> {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => match (int(x), int(y)) {
            (Some(i), Some(j)) => Some(i == j),
            (Some(i), None) => int_float(i, y.as_f64().unwrap()),
            (None, Some(j)) => int_float(j, x.as_f64().unwrap()),
            (None, None) => Some(x.as_f64() == y.as_f64()),
        },
        (Value::Array(x), Value::Array(y)) => {
            if x.len() != y.len() {
                return Some(false);
            }
            all(x.iter().zip(y).map(|(a, b)| same(a, b)))
        }
        (Value::Object(x), Value::Object(y)) => {
            if x.len() != y.len() || x.keys().any(|k| !y.contains_key(k)) {
                return Some(false);
            }
            all(x.iter().map(|(k, a)| same(a, &y[k])))
        }
        _ => Some(a == b),
    }
}

/// False if any is false (the canonical forms then differ whatever the rest
/// is), else unknown if any is unknown.
fn all(answers: impl Iterator<Item = Option<bool>>) -> Option<bool> {
    let mut known = true;
    for answer in answers {
        match answer {
            Some(false) => return Some(false),
            None => known = false,
            Some(true) => {}
        }
    }
    known.then_some(true)
}

/// A whole double below 1e21 is written as its exact integer (past 2^53 too),
/// as an integer is; from 1e21 on with an exponent, which no integer's digits
/// are.
fn int_float(i: i128, f: f64) -> Option<bool> {
    if f.abs() >= 1e21 {
        return Some(false);
    }
    Some(f.fract() == 0.0 && f as i128 == i)
}
