//! JSON spelled as another client would send the same value: keys in another
//! order, white space wherever it is allowed, strings with other (equivalent)
//! escapes, numbers in other (equal) notations. Shared by the property tests
//! (`tests/properties.rs`) and the fuzz targets (`fuzz/fuzz_targets/json.rs`
//! mounts this file), so both hold canonical JSON to the same respellings.

use serde_json::{Number, Value};

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
                // Rust writes a whole double without a point ("1e18" as
                // "1000000000000000000"), which would read as an integer: from
                // 2^53 up, another number.
                match format!("{f}") {
                    plain if plain.contains(['.', 'e', 'E']) => plain,
                    plain => format!("{plain}.0"),
                },
                shifted,
                padded,
            ];
            out.push_str(&spellings[rng.usize(..spellings.len())]);
        }
    }
}
