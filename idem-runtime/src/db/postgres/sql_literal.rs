//! SQL literals for the statements idem sends together with `BEGIN` and `COMMIT`.
//!
//! Those travel as one simple query each (several statements in one message),
//! and a simple query takes no parameters, so values are written into the text.
//! Every text value is an escape-string literal (`E'...'`), whose meaning does not
//! depend on the server's `standard_conforming_strings`; the connection's client
//! encoding is UTF-8 (sqlx sets it), and Rust strings are valid UTF-8.

use std::fmt::Write;

/// Appends `text` as `E'...'`, or answers `None` if it holds a NUL character:
/// PostgreSQL text cannot hold one, and in a simple query it would end the message.
/// Callers then take the parameterised path, where the database refuses the value
/// as it always did.
pub(crate) fn push_text(sql: &mut String, text: &str) -> Option<()> {
    if text.contains('\0') {
        return None;
    }
    sql.reserve(text.len() + 3);
    sql.push_str("E'");
    for c in text.chars() {
        match c {
            '\'' => sql.push_str("''"),
            '\\' => sql.push_str("\\\\"),
            c => sql.push(c),
        }
    }
    sql.push('\'');
    Some(())
}

/// Appends `bytes` as a `bytea` literal in hex form.
pub(crate) fn push_bytea(sql: &mut String, bytes: &[u8]) {
    sql.reserve(bytes.len() * 2 + 16);
    // `\\x` inside E'' is the two characters `\x` that start bytea's hex format.
    sql.push_str("E'\\\\x");
    for b in bytes {
        // Writing to a String cannot fail.
        let _ = write!(sql, "{b:02x}");
    }
    sql.push_str("'::bytea");
}

/// Appends an integer.
pub(crate) fn push_int(sql: &mut String, n: i64) {
    let _ = write!(sql, "{n}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_doubles_quotes_and_backslashes() {
        let mut s = String::new();
        push_text(&mut s, r"it's a \ test").unwrap();
        assert_eq!(s, r"E'it''s a \\ test'");
    }

    #[test]
    fn text_with_nul_is_refused() {
        let mut s = String::new();
        assert!(push_text(&mut s, "a\0b").is_none());
        assert!(s.is_empty(), "nothing written for refused text");
    }

    #[test]
    fn bytea_is_hex() {
        let mut s = String::new();
        push_bytea(&mut s, &[0, 0xab, 0x10]);
        assert_eq!(s, r"E'\\x00ab10'::bytea");
    }
}
