//! The grammar of a bare `Idempotency-Key`.

use std::fmt;

/// The longest key accepted, in bytes (a valid key is ASCII, so in characters
/// too).
///
/// ```
/// assert_eq!(idem_wire::MAX_KEY_LEN, 255);
/// assert!(idem_wire::check_bare_key(&"k".repeat(idem_wire::MAX_KEY_LEN)).is_ok());
/// ```
pub const MAX_KEY_LEN: usize = 255;

/// Why a bare key breaks the grammar. No variant carries the key itself, which
/// some APIs treat as a secret.
///
/// ```
/// use idem_wire::{BareKeyError, check_bare_key};
///
/// assert_eq!(check_bare_key(""), Err(BareKeyError::Empty));
/// assert_eq!(check_bare_key("a b"), Err(BareKeyError::NotVisibleAscii { position: 1 }));
/// assert_eq!(check_bare_key("a,b"), Err(BareKeyError::Comma { position: 1 }));
/// assert_eq!(check_bare_key(&"k".repeat(256)), Err(BareKeyError::TooLong { len: 256 }));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BareKeyError {
    /// The key is empty.
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`] bytes.
    TooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// The key holds a byte outside visible ASCII (`0x21..=0x7e`): a space, a
    /// control character or a non-ASCII one.
    NotVisibleAscii {
        /// Zero-based byte position of the first offending byte.
        position: usize,
    },
    /// The key holds a comma. HTTP lets an intermediary join repeated header
    /// lines into one with commas, so a bare `a,b` may be two keys; the
    /// structured-field string spelling (`"a,b"`, RFC 8941) carries a comma
    /// unambiguously.
    Comma {
        /// Zero-based byte position of the first comma.
        position: usize,
    },
}

impl BareKeyError {
    /// The zero-based byte position of the offending byte, for the errors that
    /// have one.
    ///
    /// ```
    /// use idem_wire::check_bare_key;
    ///
    /// assert_eq!(check_bare_key("ab,c").unwrap_err().position(), Some(2));
    /// assert_eq!(check_bare_key("").unwrap_err().position(), None);
    /// ```
    pub fn position(&self) -> Option<usize> {
        match self {
            BareKeyError::NotVisibleAscii { position } | BareKeyError::Comma { position } => {
                Some(*position)
            }
            BareKeyError::Empty | BareKeyError::TooLong { .. } => None,
        }
    }
}

impl fmt::Display for BareKeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BareKeyError::Empty => f.write_str("the Idempotency-Key is empty"),
            BareKeyError::TooLong { len } => write!(
                f,
                "the Idempotency-Key is {len} characters long; at most {MAX_KEY_LEN} are allowed"
            ),
            BareKeyError::NotVisibleAscii { position } => write!(
                f,
                "the Idempotency-Key holds a character outside visible ASCII (a space, a control or a non-ASCII character) at position {position}"
            ),
            BareKeyError::Comma { position } => write!(
                f,
                "the bare Idempotency-Key holds a comma at position {position}, as two header lines joined would"
            ),
        }
    }
}

impl std::error::Error for BareKeyError {}

/// Checks a bare key (one sent as a plain token, not as an RFC 8941 string):
/// non-empty, visible ASCII (`0x21..=0x7e`) only, no comma, at most
/// [`MAX_KEY_LEN`] bytes. Returns the key as text.
///
/// The rules are checked in that order, and the first byte that breaks one is
/// reported: a key both too long and holding a space is refused for the space.
/// The caller trims optional white space around a header value first (HTTP's
/// field values allow it); a space inside is refused.
///
/// # Errors
///
/// [`BareKeyError`] names the first rule the key breaks.
///
/// ```
/// use idem_wire::{BareKeyError, check_bare_key};
///
/// assert_eq!(check_bare_key("8e03978e-40d5-43e8-bc93-6894a57f9324").map(str::len), Ok(36));
/// assert_eq!(check_bare_key("clé".as_bytes()), Err(BareKeyError::NotVisibleAscii { position: 2 }));
/// ```
pub fn check_bare_key<K: AsRef<[u8]> + ?Sized>(key: &K) -> Result<&str, BareKeyError> {
    let bytes = key.as_ref();
    if bytes.is_empty() {
        return Err(BareKeyError::Empty);
    }
    if let Some(position) = bytes.iter().position(|b| !(0x21..=0x7e).contains(b)) {
        return Err(BareKeyError::NotVisibleAscii { position });
    }
    if let Some(position) = bytes.iter().position(|&b| b == b',') {
        return Err(BareKeyError::Comma { position });
    }
    if bytes.len() > MAX_KEY_LEN {
        return Err(BareKeyError::TooLong { len: bytes.len() });
    }
    // Every byte is visible ASCII, so this never fails.
    std::str::from_utf8(bytes).map_err(|e| BareKeyError::NotVisibleAscii {
        position: e.valid_up_to(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn visible_ascii_without_a_comma_is_a_key() {
        let every_visible: String = (0x21u8..=0x7e)
            .filter(|&b| b != b',')
            .map(char::from)
            .collect();
        assert_eq!(check_bare_key(&every_visible), Ok(every_visible.as_str()));
    }

    #[test]
    fn the_length_limit_is_255_bytes() {
        assert!(check_bare_key(&"k".repeat(255)).is_ok());
        assert_eq!(
            check_bare_key(&"k".repeat(256)),
            Err(BareKeyError::TooLong { len: 256 })
        );
    }

    #[test]
    fn spaces_controls_and_non_ascii_are_refused_where_they_are() {
        for (key, position) in [
            (&b"ab\x01cd"[..], 2),
            (b"ab\x7fcd", 2),
            (b"a b", 1),
            (b" ab", 0),
            (b"ab\t", 2),
            ("clé".as_bytes(), 2),
            (b"\xff", 0),
        ] {
            assert_eq!(
                check_bare_key(key),
                Err(BareKeyError::NotVisibleAscii { position }),
                "{key:?}"
            );
        }
    }

    #[test]
    fn a_comma_is_refused_as_two_joined_header_lines_would_hold_one() {
        assert_eq!(
            check_bare_key("key,with,commas"),
            Err(BareKeyError::Comma { position: 3 })
        );
        // Two header lines joined by an intermediary: the space comes first.
        assert_eq!(
            check_bare_key("k1, k2"),
            Err(BareKeyError::NotVisibleAscii { position: 3 })
        );
    }

    #[test]
    fn the_first_rule_broken_is_reported() {
        let long_with_space = format!("{} x", "k".repeat(300));
        assert_eq!(
            check_bare_key(&long_with_space),
            Err(BareKeyError::NotVisibleAscii { position: 300 })
        );
        let long_with_comma = format!("{},x", "k".repeat(300));
        assert_eq!(
            check_bare_key(&long_with_comma),
            Err(BareKeyError::Comma { position: 300 })
        );
    }

    #[test]
    fn messages_name_the_rule_and_never_the_key() {
        let secret = "sk_live_secret";
        for bad in [
            format!("{secret} "),
            format!("{secret},"),
            secret.repeat(30),
        ] {
            let err = check_bare_key(&bad).unwrap_err();
            assert!(!err.to_string().contains(secret));
            assert!(!format!("{err:?}").contains(secret));
        }
        assert_eq!(
            check_bare_key("a b").unwrap_err().to_string(),
            "the Idempotency-Key holds a character outside visible ASCII \
             (a space, a control or a non-ASCII character) at position 1"
        );
    }
}
