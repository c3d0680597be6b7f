//! A `serde_json::value::RawValue`'s text in the fingerprint: whether
//! `serde_json` reads it without loss, and its text less the whitespace
//! between tokens where it does not.
//!
//! `serde_json` (without `arbitrary_precision`) reads a number into a `u64`,
//! an `i64` or an `f64`, and of a key given twice in an object keeps the
//! last: `1.000000000000000001` and `1.000000000000000002` are one tree, as
//! are `{"a":10,"a":100}` and `{"a":100}`. A handler that takes a `RawValue`
//! reads the text itself, so such texts must not be one request.

use std::collections::HashSet;

/// Whether `text`, valid JSON, reads as a tree that holds all it says: no key
/// repeats within an object, and every number is the value it is read as, to
/// the digit. Linear in the text.
pub(super) fn reads_exactly(text: &str) -> bool {
    let b = text.as_bytes();
    // Per open container: the keys of an object so far, `None` for an array.
    let mut open: Vec<Option<HashSet<String>>> = Vec::new();
    let mut key_next = false;
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'{' => {
                open.push(Some(HashSet::new()));
                key_next = true;
                i += 1;
            }
            b'[' => {
                open.push(None);
                key_next = false;
                i += 1;
            }
            b'}' | b']' => {
                open.pop();
                key_next = false;
                i += 1;
            }
            b',' => {
                key_next = matches!(open.last(), Some(Some(_)));
                i += 1;
            }
            b'"' => {
                let end = string_end(b, i);
                if key_next {
                    key_next = false;
                    // Keys compare as the strings they spell (`"a"` and
                    // `"\u0061"` are one key).
                    let Ok(key) = serde_json::from_str::<String>(&text[i..end]) else {
                        return false;
                    };
                    if let Some(Some(keys)) = open.last_mut()
                        && !keys.insert(key)
                    {
                        return false;
                    }
                } else if text[i..end].contains("\\u")
                    && serde_json::from_str::<String>(&text[i..end]).is_err()
                {
                    // An escape that is no character (a lone surrogate,
                    // which serde_json's `RawValue` lets through and its
                    // `Value` refuses): written as its text.
                    return false;
                }
                i = end;
            }
            b'-' | b'0'..=b'9' => {
                let end = b[i..]
                    .iter()
                    .position(|c| !matches!(c, b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9'))
                    .map_or(b.len(), |n| i + n);
                if !number_reads_exactly(&text[i..end]) {
                    return false;
                }
                i = end;
            }
            // `:`, whitespace, and the letters of `true`, `false`, `null`.
            _ => {
                if b[i] == b':' {
                    key_next = false;
                }
                i += 1;
            }
        }
    }
    true
}

/// The index just past the string that opens at `start`.
fn string_end(b: &[u8], start: usize) -> usize {
    let mut j = start + 1;
    while j < b.len() {
        match b[j] {
            b'\\' => j += 2,
            b'"' => return j + 1,
            _ => j += 1,
        }
    }
    b.len()
}

/// Whether the number `token` is, to the digit, what `serde_json` reads it as
/// and the fingerprint then writes.
pub(super) fn number_reads_exactly(token: &str) -> bool {
    let integer = !token.contains(['.', 'e', 'E']);
    if integer && (token.parse::<u64>().is_ok() || token.parse::<i64>().is_ok()) {
        return true;
    }
    // Anything else is read as a double (correctly rounded, as the runtime's
    // `serde_json` is built with `float_roundtrip`), and written as the
    // shortest spelling that reads back as it (or its exact integer).
    let Ok(read) = token.parse::<f64>() else {
        return false;
    };
    let Ok(written) = super::canonical_json(&read) else {
        return false;
    };
    let written = String::from_utf8_lossy(&written);
    matches!((decimal(token), decimal(&written)), (Some(a), Some(b)) if a == b)
}

/// A number's value as (negative, significant digits, power of ten), zero as
/// `(false, "", 0)`; `None` for an exponent past `i64`.
fn decimal(token: &str) -> Option<(bool, String, i64)> {
    let (negative, rest) = match token.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, token),
    };
    let (mantissa, exponent) = match rest.find(['e', 'E']) {
        Some(at) => (&rest[..at], rest[at + 1..].parse::<i64>().ok()?),
        None => (rest, 0),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits = format!("{whole}{fraction}");
    let leading = digits.trim_start_matches('0');
    let significant = leading.trim_end_matches('0');
    if significant.is_empty() {
        return Some((false, String::new(), 0));
    }
    let fraction_len = i64::try_from(fraction.len()).ok()?;
    let trailing = i64::try_from(leading.len() - significant.len()).ok()?;
    let power = exponent.checked_sub(fraction_len)?.checked_add(trailing)?;
    Some((negative, significant.to_owned(), power))
}

/// Appends `text`, valid JSON, without the whitespace between its tokens.
pub(super) fn minify(text: &str, out: &mut Vec<u8>) {
    let b = text.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'"' => {
                let end = string_end(b, i);
                out.extend_from_slice(&b[i..end]);
                i = end;
            }
            b' ' | b'\t' | b'\n' | b'\r' => i += 1,
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_serde_json_reads_without_loss_is_told_apart() {
        for exact in [
            r#"{"b":1.50,"a":[1E2,-0.0,18446744073709551615,-9223372036854775808,"\u00e9"]}"#,
            "0.1",
            "1e21",
            "9007199254740993",
            "123456789012345678",
            "5e-324",
            r#"{"a":{"a":1},"b":[{"a":1},{"a":2}]}"#,
            r#"{"k\"ey":1,"k":2}"#,
            "[true,false,null]",
        ] {
            assert!(reads_exactly(exact), "{exact}");
        }
        for lossy in [
            "1.000000000000000001",
            "20000000000000000001",
            "-9223372036854775809",
            "0.10000000000000000001",
            r#"{"a":10,"a":100}"#,
            r#"{"a":1,"\u0061":2}"#,
            r#"[{"x":{"a":1,"a":1}}]"#,
            "1e99999999999999999999",
        ] {
            assert!(!reads_exactly(lossy), "{lossy}");
        }
    }

    #[test]
    fn minifying_keeps_strings_as_they_are() {
        let mut out = Vec::new();
        minify(" { \"a b\" : [ 1 ,\t\"x\\\" y\" ]\n} ", &mut out);
        assert_eq!(out, br#"{"a b":[1,"x\" y"]}"#);
    }
}
