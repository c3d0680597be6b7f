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

fn ws(rng: &mut fastrand::Rng, out: &mut String) {
    for _ in 0..rng.usize(0..3) {
        out.push([' ', '\n', '\t', '\r'][rng.usize(..4)]);
    }
}

/// The same value as another client would send it: keys in another order, white
/// space wherever it is allowed, strings with other (equivalent) escapes, numbers
/// in other (equal) notations.
pub fn respell(rng: &mut fastrand::Rng, v: &Value, out: &mut String) {
    ws(rng, out);
    match v {
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                respell(rng, item, out);
            }
            ws(rng, out);
            out.push(']');
        }
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            rng.shuffle(&mut entries);
            out.push('{');
            for (i, (k, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                ws(rng, out);
                respell_string(rng, k, out);
                ws(rng, out);
                out.push(':');
                respell(rng, item, out);
            }
            ws(rng, out);
            out.push('}');
        }
        Value::String(s) => respell_string(rng, s, out),
        Value::Number(n) => respell_number(rng, n, out),
        other => out.push_str(&other.to_string()),
    }
    ws(rng, out);
}

fn respell_string(rng: &mut fastrand::Rng, s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        let short = match c {
            '"' => Some("\\\""),
            '\\' => Some("\\\\"),
            '/' => Some("\\/"),
            '\u{8}' => Some("\\b"),
            '\u{c}' => Some("\\f"),
            '\n' => Some("\\n"),
            '\r' => Some("\\r"),
            '\t' => Some("\\t"),
            _ => None,
        };
        let must = c == '"' || c == '\\' || (c as u32) < 0x20;
        match rng.u8(..4) {
            0 => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    if rng.bool() {
                        out.push_str(&format!("\\u{unit:04x}"));
                    } else {
                        out.push_str(&format!("\\u{unit:04X}"));
                    }
                }
            }
            1 if short.is_some() => out.push_str(short.unwrap()),
            _ if must => out.push_str(&format!("\\u{:04x}", c as u32)),
            _ => out.push(c),
        }
    }
    out.push('"');
}

/// 2^53: integers up to it are exact as doubles too.
const EXACT: u64 = 1 << 53;

fn respell_number(rng: &mut fastrand::Rng, n: &Number, out: &mut String) {
    let int = n.as_i64().map(i128::from).or(n.as_u64().map(i128::from));
    match int {
        // Written exactly, by design: only float spellings of doubles' exact
        // integers are the same number.
        Some(i) if i.unsigned_abs() <= u128::from(EXACT) => {
            let spellings = [
                format!("{i}"),
                format!("{i}.0"),
                format!("{i}e0"),
                format!("{i}.000E+0"),
                if i == 0 {
                    "-0.0e7".to_owned()
                } else {
                    format!("{i}00e-2")
                },
                if i == 0 {
                    "-0".to_owned()
                } else {
                    format!("{:e}", i as f64)
                },
            ];
            out.push_str(&spellings[rng.usize(..spellings.len())]);
        }
        Some(i) => out.push_str(&i.to_string()),
        None => {
            let f = n.as_f64().unwrap();
            let sci = format!("{f:e}");
            // The same digits with the point moved to the end: "1.25e-3" -> "125e-5".
            let (mantissa, exp) = sci.split_once('e').unwrap();
            let exp: i32 = exp.parse().unwrap();
            let shifted = match mantissa.split_once('.') {
                Some((whole, frac)) => {
                    format!("{whole}{frac}e{}", exp - i32::try_from(frac.len()).unwrap())
                }
                None => sci.clone(),
            };
            // A trailing zero in the mantissa: "1.5e3" -> "1.50e3", "1e3" -> "1.0e3".
            let padded = if mantissa.contains('.') {
                format!("{mantissa}0e{exp}")
            } else {
                format!("{mantissa}.0e{exp}")
            };
            let spellings = [
                n.to_string(),
                sci,
                format!("{f:E}"),
                format!("{f}"),
                shifted,
                padded,
            ];
            out.push_str(&spellings[rng.usize(..spellings.len())]);
        }
    }
}

fn int(n: &Number) -> Option<i128> {
    n.as_i64().map(i128::from).or(n.as_u64().map(i128::from))
}

/// 2^53 as a double: from there on every double is an integer, and the canonical
/// form's shortest spelling of one may be another integer's exact spelling.
const EXACT_F: f64 = 9_007_199_254_740_992.0;

/// Whether two JSON values mean the same: what canonical JSON must preserve.
/// Numbers compare by value: integers exactly, floats as doubles (so `-0.0` is
/// `0`), an integer and a float below 2^53 when the double is that integer.
///
/// `None` where an integer meets a float of 2^53 or more: found by these
/// targets, the canonical form does not keep exact values there (a float of
/// 2^60 is written `1152921504606847000`, another integer's spelling; see
/// README.md), so no answer is checked.
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

fn int_float(i: i128, f: f64) -> Option<bool> {
    if f.abs() >= EXACT_F {
        return None;
    }
    Some(f.fract() == 0.0 && f as i128 == i)
}
