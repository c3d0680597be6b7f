//! The key of one logical request.

use std::fmt;

/// The name of the header the key travels in; [`idem_wire::IDEMPOTENCY_KEY`].
///
/// ```
/// assert_eq!(idem_client::IDEMPOTENCY_KEY, "idempotency-key");
/// ```
pub const IDEMPOTENCY_KEY: &str = idem_wire::IDEMPOTENCY_KEY;

/// The `Idempotency-Key` of one logical request: sent with its first attempt and
/// every retry of it.
///
/// The middleware makes a fresh one ([`IdempotencyKey::random`], a UUID v4) for
/// each logical request unless the caller supplies one, either as a request
/// extension (which also opts a request in whatever its method) or as an
/// `Idempotency-Key` header. A key derived from a business id ("payment for
/// invoice 42") survives even a restart of the caller.
///
/// Keys are bare tokens of visible ASCII, 1 to 255 characters, with no comma
/// and no leading `"` (which a server reads as the start of a structured-field
/// string): what idem's server side accepts as a bare key ([`InvalidKey`] says
/// which rule a refused key breaks). `Debug` is redacted, since in some APIs a
/// key is as good as a capability; read it with [`IdempotencyKey::as_str`] when
/// you log it on purpose.
///
/// ```
/// use idem_client::IdempotencyKey;
///
/// let key = IdempotencyKey::new("invoice-42-payment").unwrap();
/// assert_eq!(key.as_str(), "invoice-42-payment");
/// assert_eq!(format!("{key:?}"), "IdempotencyKey(<redacted, 18 chars>)");
/// assert!(IdempotencyKey::new("two words").is_err());
/// assert_ne!(IdempotencyKey::random(), IdempotencyKey::random());
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

/// Why [`IdempotencyKey::new`] refused a key. No variant carries the key.
///
/// ```
/// use idem_client::{IdempotencyKey, InvalidKey};
///
/// assert_eq!(IdempotencyKey::new("").unwrap_err(), InvalidKey::Empty);
/// assert_eq!(IdempotencyKey::new("k".repeat(256)).unwrap_err(), InvalidKey::TooLong { len: 256 });
/// assert_eq!(
///     IdempotencyKey::new("a b").unwrap_err(),
///     InvalidKey::NotVisibleAscii { position: 1 }
/// );
/// assert_eq!(IdempotencyKey::new("\"a\"").unwrap_err(), InvalidKey::Quoted);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidKey {
    /// The key is empty.
    #[error("the Idempotency-Key is empty")]
    Empty,
    /// The key is longer than [`IdempotencyKey::MAX_LEN`].
    #[error(
        "the Idempotency-Key is {len} characters long; at most {} are allowed",
        idem_wire::MAX_KEY_LEN
    )]
    TooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// The key holds a byte outside visible ASCII (`0x21..=0x7e`).
    #[error("the Idempotency-Key holds a character outside visible ASCII at byte {position}")]
    NotVisibleAscii {
        /// Zero-based byte position of the first offending character.
        position: usize,
    },
    /// The key holds a comma, which servers refuse in a bare key (two header
    /// lines joined by an intermediary look the same).
    #[error("the Idempotency-Key holds a comma at byte {position}; servers refuse it")]
    Comma {
        /// Zero-based byte position of the first comma.
        position: usize,
    },
    /// The key starts with `"`: servers read that as a structured-field string,
    /// so the client sends bare tokens only.
    #[error("the Idempotency-Key starts with '\"'; send the bare key instead")]
    Quoted,
}

impl InvalidKey {
    /// The wire grammar's refusal of a bare key, as this crate says it.
    fn from_wire(e: idem_wire::BareKeyError) -> Self {
        use idem_wire::BareKeyError;
        match e {
            BareKeyError::Empty => InvalidKey::Empty,
            BareKeyError::TooLong { len } => InvalidKey::TooLong { len },
            BareKeyError::Comma { position } => InvalidKey::Comma { position },
            BareKeyError::NotVisibleAscii { position } => InvalidKey::NotVisibleAscii { position },
            // A rule idem-wire may add later: the nearest variant this enum has.
            other => InvalidKey::NotVisibleAscii {
                position: other.position().unwrap_or(0),
            },
        }
    }
}

impl IdempotencyKey {
    /// The longest key accepted, in characters; [`idem_wire::MAX_KEY_LEN`].
    ///
    /// ```
    /// assert_eq!(idem_client::IdempotencyKey::MAX_LEN, 255);
    /// ```
    pub const MAX_LEN: usize = idem_wire::MAX_KEY_LEN;

    /// A key chosen by the caller, e.g. derived from a business id.
    ///
    /// # Errors
    ///
    /// [`InvalidKey`] when it is empty, too long, holds anything but visible
    /// ASCII or a comma (the bare key grammar, [`idem_wire::check_bare_key`]), or
    /// starts with `"`.
    ///
    /// ```
    /// use idem_client::IdempotencyKey;
    ///
    /// let invoice = 42;
    /// let key = IdempotencyKey::new(format!("pay-invoice-{invoice}"))?;
    /// # Ok::<(), idem_client::InvalidKey>(())
    /// ```
    pub fn new(key: impl Into<String>) -> Result<Self, InvalidKey> {
        let key = key.into();
        idem_wire::check_bare_key(&key).map_err(InvalidKey::from_wire)?;
        // The client's own rule: a server reads a leading quote as the
        // structured-field string spelling, which this client never sends.
        if key.starts_with('"') {
            return Err(InvalidKey::Quoted);
        }
        Ok(IdempotencyKey(key))
    }

    /// A fresh random key: a UUID v4, what the middleware uses for a logical
    /// request that brings none.
    ///
    /// ```
    /// let key = idem_client::IdempotencyKey::random();
    /// assert_eq!(key.as_str().len(), 36);
    /// ```
    pub fn random() -> Self {
        IdempotencyKey(uuid::Uuid::new_v4().to_string())
    }

    /// The key's characters, for the caller's own logs or storage.
    ///
    /// ```
    /// let key = idem_client::IdempotencyKey::new("k-1").unwrap();
    /// assert_eq!(key.as_str(), "k-1");
    /// ```
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey(<redacted, {} chars>)", self.0.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_key_is_accepted() {
        assert!(IdempotencyKey::new("k".repeat(255)).is_ok());
    }

    #[test]
    fn a_random_key_is_a_valid_key() {
        let key = IdempotencyKey::random();
        assert_eq!(IdempotencyKey::new(key.as_str()).unwrap(), key);
    }

    #[test]
    fn control_characters_are_refused() {
        assert_eq!(
            IdempotencyKey::new("ab\n").unwrap_err(),
            InvalidKey::NotVisibleAscii { position: 2 }
        );
        assert_eq!(
            IdempotencyKey::new("é").unwrap_err(),
            InvalidKey::NotVisibleAscii { position: 0 }
        );
    }

    #[test]
    fn a_comma_is_refused_as_the_server_refuses_it() {
        assert_eq!(
            IdempotencyKey::new("pay,42").unwrap_err(),
            InvalidKey::Comma { position: 3 }
        );
    }
}
