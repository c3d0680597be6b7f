//! The `Idempotency-Key` request header: parsing and validation.
//!
//! Two spellings are accepted, because clients in the wild use both:
//!
//! * a bare token, as Stripe and most payment APIs document it:
//!   `Idempotency-Key: 8e03978e-40d5-43e8-bc93-6894a57f9324`
//! * an RFC 8941 structured-field string, as the IETF
//!   `draft-ietf-httpapi-idempotency-key-header` specifies it:
//!   `Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"`
//!
//! Both spellings of the same characters name the same key. The raw key never
//! appears in a `Debug` or `Display` output of this module's types, so it cannot
//! leak into logs by accident.

use std::fmt;

use sha2::{Digest, Sha256};

/// The name of the request header that carries the key;
/// [`idem_wire::IDEMPOTENCY_KEY`].
pub const HEADER_NAME: &str = idem_wire::IDEMPOTENCY_KEY;

/// The longest key accepted, in characters (all keys are ASCII);
/// [`idem_wire::MAX_KEY_LEN`].
pub const MAX_KEY_LEN: usize = idem_wire::MAX_KEY_LEN;

/// A validated idempotency key.
///
/// It can only be built by [`IdempotencyKey::parse`], so holding one proves the
/// key is non-empty, at most [`MAX_KEY_LEN`] characters and ASCII without control
/// characters: visible ASCII, and spaces where the structured-string spelling holds
/// them.
/// Its `Debug` output is redacted: keys are bearer-like secrets in some APIs.
///
/// ```
/// use idem_runtime::IdempotencyKey;
///
/// let bare = IdempotencyKey::parse("order-42").unwrap();
/// let quoted = IdempotencyKey::parse("\"order-42\"").unwrap();
/// assert_eq!(bare, quoted);
/// assert_eq!(bare.as_str(), "order-42");
/// assert_eq!(format!("{bare:?}"), "IdempotencyKey(<redacted, 8 chars>)");
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey {
    key: String,
    /// Computed once, at parsing: every store binds it, a lease's every fenced
    /// write names it, so a request would otherwise hash its key several times.
    digest: KeyDigest,
}

/// Why a key was refused. None of the variants carries the key itself.
///
/// Its text names the HTTP header (`the Idempotency-Key is empty`);
/// [`KeyError::rule`] says what is wrong in words that fit a key from anywhere,
/// for a transport that names the key's source itself (gRPC's metadata entry or
/// message field).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The request has no `Idempotency-Key` header.
    #[error("the request has no Idempotency-Key header")]
    Missing,
    /// The header appears more than once.
    #[error("the Idempotency-Key header {}", self.rule())]
    Repeated,
    /// The key is empty (or only white space).
    #[error("the Idempotency-Key {}", self.rule())]
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`] characters.
    #[error("the Idempotency-Key {}", self.rule())]
    TooLong {
        /// The length that was sent.
        len: usize,
    },
    /// A bare key holds a character outside visible ASCII (`0x21..=0x7e`): a
    /// space, a control character or a non-ASCII one. (A space is allowed only
    /// inside the structured-string spelling, `"a b"`.)
    #[error("the Idempotency-Key {}", self.rule())]
    NotPrintableAscii {
        /// Zero-based byte position of the first offending character.
        position: usize,
    },
    /// A bare key holds a comma. HTTP lets an intermediary join repeated header
    /// lines into one with commas, so `a,b` may be two keys sent twice; the
    /// structured-string spelling (`"a,b"`) carries a comma unambiguously.
    #[error(
        "the bare Idempotency-Key {}, as two header lines joined would; send a key with a comma as a structured-field string (\"a,b\")",
        self.rule()
    )]
    Comma {
        /// Zero-based byte position of the first comma.
        position: usize,
    },
    /// The key starts with `"` but is not a valid RFC 8941 string item.
    #[error("the Idempotency-Key {}", self.rule())]
    MalformedStructuredString,
}

impl KeyError {
    /// True when the header is absent, false when it is present but unusable.
    pub fn is_missing(&self) -> bool {
        matches!(self, KeyError::Missing)
    }

    /// What is wrong with the key, as the rest of a sentence whose subject is
    /// the key (`is empty`, `appears more than once`): the one wording of each
    /// rule, which the error's own text (the HTTP header's) and gRPC's refusals
    /// (the metadata entry's, a field's) both say. Two are worded apart: a key
    /// that was not sent (`was not sent` here; the header's text says the
    /// request has no header, and gRPC names where to send one), and the advice
    /// after a comma, which depends on where the key came from (a header can
    /// quote it, a message field cannot hold one).
    ///
    /// ```
    /// use idem_runtime::{IdempotencyKey, KeyError};
    ///
    /// let e = IdempotencyKey::parse("").unwrap_err();
    /// assert_eq!(e.rule(), "is empty");
    /// assert_eq!(e.to_string(), "the Idempotency-Key is empty");
    /// ```
    pub fn rule(&self) -> String {
        match self {
            KeyError::Missing => "was not sent".to_owned(),
            KeyError::Repeated => "appears more than once".to_owned(),
            KeyError::Empty => "is empty".to_owned(),
            KeyError::TooLong { len } => {
                format!("is {len} characters long; at most {MAX_KEY_LEN} are allowed")
            }
            KeyError::NotPrintableAscii { position } => format!(
                "holds a character outside visible ASCII (a space, a control or a non-ASCII character) at position {position}"
            ),
            KeyError::Comma { position } => format!("holds a comma at position {position}"),
            KeyError::MalformedStructuredString => {
                "starts with '\"' but is not a valid structured-field string (RFC 8941)".to_owned()
            }
        }
    }
}

impl IdempotencyKey {
    /// Parses one header value.
    ///
    /// A value that starts with `"` must be a structured-field string item without
    /// parameters; anything else is a bare token of visible ASCII (`0x21..=0x7e`)
    /// without a comma (which a joined pair of header lines would hold).
    /// Surrounding spaces and tabs are ignored, as HTTP field values allow them.
    ///
    /// # Errors
    ///
    /// [`KeyError`] names the rule that the value breaks.
    pub fn parse(value: impl AsRef<[u8]>) -> Result<Self, KeyError> {
        let raw = trim_ows(value.as_ref());
        if raw.is_empty() {
            return Err(KeyError::Empty);
        }
        let key = if raw[0] == b'"' {
            parse_structured(raw)?
        } else {
            // The bare spelling's grammar is idem's wire contract (idem-wire),
            // which the client checks its keys against too.
            idem_wire::check_bare_key(raw)
                .map_err(bare_key_error)?
                .to_owned()
        };
        if key.trim().is_empty() {
            return Err(KeyError::Empty);
        }
        if key.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong { len: key.len() });
        }
        Ok(IdempotencyKey {
            digest: KeyDigest::of_raw(&key),
            key,
        })
    }

    /// Reads the key from a request's headers.
    ///
    /// # Errors
    ///
    /// [`KeyError::Missing`] without the header, [`KeyError::Repeated`] when it is
    /// sent twice, otherwise whatever [`IdempotencyKey::parse`] says.
    pub fn from_headers(headers: &axum::http::HeaderMap) -> Result<Self, KeyError> {
        let mut values = headers.get_all(HEADER_NAME).iter();
        let first = values.next().ok_or(KeyError::Missing)?;
        if values.next().is_some() {
            return Err(KeyError::Repeated);
        }
        Self::parse(first.as_bytes())
    }

    /// The key's characters. Compare them; do not log or store them (stores keep
    /// [`IdempotencyKey::digest`]).
    pub fn as_str(&self) -> &str {
        &self.key
    }

    /// The key's SHA-256 digest: what every store keeps and binds in its place, so
    /// the key itself never leaves the process (no slow-query log, error log or
    /// backup of the database shows it).
    ///
    /// ```
    /// use idem_runtime::IdempotencyKey;
    ///
    /// let key = IdempotencyKey::parse("order-42").unwrap();
    /// // What `printf %s order-42 | sha256sum` prints.
    /// assert_eq!(
    ///     key.digest().to_string(),
    ///     "3bf8b157c4238eefe5ae4a66eca81c6b887d4dcedb58dd674271859f4dc2edfd"
    /// );
    /// ```
    pub fn digest(&self) -> KeyDigest {
        self.digest
    }
}

/// The SHA-256 digest of an [`IdempotencyKey`], as stores keep it.
///
/// Plain SHA-256 of the key's characters (the structured-field spelling already
/// unquoted), so an operator can compute it with any tool. A digest hides a random
/// key (a UUID); a guessable key (`order-42`) stays guessable from its digest, which
/// is one more reason for clients to send random keys. `Display` is lower-case hex.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyDigest([u8; 32]);

/// A digest given as text was not 64 hexadecimal digits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a key digest is 64 hexadecimal digits (SHA-256)")]
pub struct DigestParseError;

impl KeyDigest {
    /// The digest of a key's characters, validated or not (rows written before
    /// keys were digested hold them as they were stored).
    pub(crate) fn of_raw(key: &str) -> Self {
        KeyDigest(Sha256::digest(key.as_bytes()).into())
    }

    /// The digest's 32 bytes, as bound to the database.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// A digest read back from a store.
    ///
    /// # Errors
    ///
    /// [`DigestParseError`] unless `bytes` holds exactly 32 bytes.
    pub fn from_slice(bytes: &[u8]) -> Result<Self, DigestParseError> {
        Ok(KeyDigest(bytes.try_into().map_err(|_| DigestParseError)?))
    }

    /// Parses the hex spelling (either case), as an operator copies it from
    /// `idem show` or from the database.
    ///
    /// # Errors
    ///
    /// [`DigestParseError`] unless `text` is 64 hexadecimal digits.
    pub fn from_hex(text: &str) -> Result<Self, DigestParseError> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(text.trim(), &mut out).map_err(|_| DigestParseError)?;
        Ok(KeyDigest(out))
    }
}

// A digest binds as its 32 bytes (`bytea`, `BLOB`, `BINARY(32)`), on every
// database whose driver binds byte slices.
impl<DB: sqlx::Database> sqlx::Type<DB> for KeyDigest
where
    Vec<u8>: sqlx::Type<DB>,
{
    fn type_info() -> DB::TypeInfo {
        <Vec<u8> as sqlx::Type<DB>>::type_info()
    }

    fn compatible(ty: &DB::TypeInfo) -> bool {
        <Vec<u8> as sqlx::Type<DB>>::compatible(ty)
    }
}

impl<'q, DB: sqlx::Database> sqlx::Encode<'q, DB> for KeyDigest
where
    for<'a> &'a [u8]: sqlx::Encode<'q, DB>,
{
    fn encode_by_ref(
        &self,
        buf: &mut <DB as sqlx::Database>::ArgumentBuffer,
    ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
        <&[u8] as sqlx::Encode<'q, DB>>::encode(self.0.as_slice(), buf)
    }

    fn size_hint(&self) -> usize {
        self.0.len()
    }
}

// ... and reads back from the same columns; anything but 32 bytes fails to
// decode.
impl<'r, DB: sqlx::Database> sqlx::Decode<'r, DB> for KeyDigest
where
    &'r [u8]: sqlx::Decode<'r, DB>,
{
    fn decode(value: DB::ValueRef<'r>) -> Result<Self, sqlx::error::BoxDynError> {
        let bytes = <&[u8] as sqlx::Decode<'r, DB>>::decode(value)?;
        Ok(KeyDigest::from_slice(bytes)?)
    }
}

impl fmt::Display for KeyDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl fmt::Debug for KeyDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyDigest({self})")
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey(<redacted, {} chars>)", self.key.len())
    }
}

fn trim_ows(mut raw: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = raw {
        raw = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = raw {
        raw = rest;
    }
    raw
}

/// The wire grammar's refusal of a bare key, as this crate's [`KeyError`] says it.
fn bare_key_error(e: idem_wire::BareKeyError) -> KeyError {
    use idem_wire::BareKeyError;
    match e {
        BareKeyError::Empty => KeyError::Empty,
        BareKeyError::TooLong { len } => KeyError::TooLong { len },
        BareKeyError::Comma { position } => KeyError::Comma { position },
        BareKeyError::NotVisibleAscii { position } => KeyError::NotPrintableAscii { position },
        // A rule idem-wire may add later: the nearest variant this enum has.
        other => KeyError::NotPrintableAscii {
            position: other.position().unwrap_or(0),
        },
    }
}

fn parse_structured(raw: &[u8]) -> Result<String, KeyError> {
    let item: sfv::Item = sfv::Parser::new(raw)
        .parse()
        .map_err(|_| KeyError::MalformedStructuredString)?;
    if !item.params.is_empty() {
        return Err(KeyError::MalformedStructuredString);
    }
    let s = item
        .bare_item
        .as_string()
        .ok_or(KeyError::MalformedStructuredString)?;
    Ok(s.as_str().to_owned())
}

/// The key to give the downstream system's own idempotency mechanism: derived from
/// tenant, operation and key, the same for every owner and generation, and for
/// the key's next use once its retention has passed (a provider that keeps its
/// keys longer then sees it again: keep idempotency keys single-use).
pub fn downstream_key(tenant: &str, operation: &str, key: &IdempotencyKey) -> String {
    downstream_key_of(tenant, operation, key.as_str())
}

/// [`downstream_key`] of a key's characters. The stores' migrations compute the
/// same in SQL for rows written before keys were digested: change neither.
pub(crate) fn downstream_key_of(tenant: &str, operation: &str, key: &str) -> String {
    let mut h = Sha256::new();
    for part in ["idem-downstream-v1", tenant, operation, key] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    hex::encode(&h.finalize()[..16])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `input` is refused as `error`.
    #[track_caller]
    fn assert_refused(input: impl AsRef<[u8]>, error: KeyError) {
        assert_eq!(IdempotencyKey::parse(input), Err(error));
    }

    #[test]
    fn bare_and_structured_spellings_name_the_same_key() {
        let a = IdempotencyKey::parse("abc-123").unwrap();
        let b = IdempotencyKey::parse("\"abc-123\"").unwrap();
        assert_eq!(a, b);
        assert_eq!(a.as_str(), "abc-123");
    }

    #[test]
    fn surrounding_white_space_is_ignored() {
        assert_eq!(IdempotencyKey::parse("  k1\t").unwrap().as_str(), "k1");
    }

    #[test]
    fn structured_string_may_hold_spaces_and_escapes() {
        let k = IdempotencyKey::parse(r#""a b \"c\"""#).unwrap();
        assert_eq!(k.as_str(), "a b \"c\"");
    }

    #[test]
    fn a_bare_key_with_a_comma_is_refused_and_a_structured_one_carries_it() {
        assert_refused("key,with,commas", KeyError::Comma { position: 3 });
        // Two header lines joined by an intermediary.
        assert_refused("k1, k2", KeyError::NotPrintableAscii { position: 3 });
        assert_refused("k1,k2", KeyError::Comma { position: 2 });
        let k = IdempotencyKey::parse(r#""key,with,commas""#).unwrap();
        assert_eq!(k.as_str(), "key,with,commas");
    }

    #[test]
    fn empty_keys_are_refused() {
        assert_refused("", KeyError::Empty);
        assert_refused("   ", KeyError::Empty);
        assert_refused("\"\"", KeyError::Empty);
        assert_refused("\"   \"", KeyError::Empty);
    }

    #[test]
    fn length_limit_is_255() {
        assert!(IdempotencyKey::parse("k".repeat(255)).is_ok());
        assert_refused("k".repeat(256), KeyError::TooLong { len: 256 });
        let quoted = format!("\"{}\"", "k".repeat(256));
        assert_refused(quoted, KeyError::TooLong { len: 256 });
    }

    #[test]
    fn control_characters_and_non_ascii_are_refused() {
        assert_refused("ab\x01cd", KeyError::NotPrintableAscii { position: 2 });
        assert_refused("ab\x7fcd", KeyError::NotPrintableAscii { position: 2 });
        assert_refused(
            "clé".as_bytes(),
            KeyError::NotPrintableAscii { position: 2 },
        );
        assert_refused("a b", KeyError::NotPrintableAscii { position: 1 });
    }

    /// The refusals' words are what a `400` problem's detail says: each is
    /// the header's subject and [`KeyError::rule`], worded as before the rule
    /// was kept apart for gRPC.
    #[test]
    fn each_refusal_keeps_its_words() {
        for (e, text) in [
            (
                KeyError::Missing,
                "the request has no Idempotency-Key header",
            ),
            (
                KeyError::Repeated,
                "the Idempotency-Key header appears more than once",
            ),
            (KeyError::Empty, "the Idempotency-Key is empty"),
            (
                KeyError::NotPrintableAscii { position: 4 },
                "the Idempotency-Key holds a character outside visible ASCII (a space, a control \
                 or a non-ASCII character) at position 4",
            ),
            (
                KeyError::TooLong { len: 300 },
                "the Idempotency-Key is 300 characters long; at most 255 are allowed",
            ),
            (
                KeyError::Comma { position: 2 },
                "the bare Idempotency-Key holds a comma at position 2, as two header lines \
                 joined would; send a key with a comma as a structured-field string (\"a,b\")",
            ),
            (
                KeyError::MalformedStructuredString,
                "the Idempotency-Key starts with '\"' but is not a valid structured-field \
                 string (RFC 8941)",
            ),
        ] {
            assert_eq!(e.to_string(), text);
        }
    }

    #[test]
    fn the_refusal_of_a_space_says_what_the_rule_is() {
        // A space is printable but not visible: the message must not say
        // "printable", or a key with a space looks as if it should pass.
        let message = IdempotencyKey::parse("a b").unwrap_err().to_string();
        assert_eq!(
            message,
            "the Idempotency-Key holds a character outside visible ASCII \
             (a space, a control or a non-ASCII character) at position 1"
        );
    }

    #[test]
    fn malformed_structured_strings_are_refused() {
        for bad in [
            "\"unterminated",
            "\"bad \\x escape\"",
            "\"tab\tinside\"",
            "\"x\";param=1",
            "\"x\" trailing",
            "\"clé\"",
        ] {
            assert_eq!(
                IdempotencyKey::parse(bad),
                Err(KeyError::MalformedStructuredString),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn errors_and_debug_never_show_the_key() {
        let secret = "sk_live_secret_value";
        let key = IdempotencyKey::parse(secret).unwrap();
        assert!(!format!("{key:?}").contains(secret));
        let err = IdempotencyKey::parse(format!("{secret}\u{1}")).unwrap_err();
        assert!(!err.to_string().contains(secret));
        assert!(!format!("{err:?}").contains(secret));
    }

    #[test]
    fn digests_are_sha256_and_round_trip_through_hex() {
        let key = IdempotencyKey::parse("\"abc\"").unwrap();
        let d = key.digest();
        assert_eq!(
            d.to_string(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(KeyDigest::from_hex(&d.to_string().to_uppercase()), Ok(d));
        assert_eq!(KeyDigest::from_slice(d.as_bytes()), Ok(d));
        assert_eq!(KeyDigest::from_hex("abc"), Err(DigestParseError));
        assert_eq!(KeyDigest::from_slice(&[0; 31]), Err(DigestParseError));
        assert_ne!(IdempotencyKey::parse("abd").unwrap().digest(), d);
    }

    #[test]
    fn header_map_reading() {
        use axum::http::{HeaderMap, HeaderValue};
        let mut h = HeaderMap::new();
        assert_eq!(IdempotencyKey::from_headers(&h), Err(KeyError::Missing));
        h.insert("Idempotency-Key", HeaderValue::from_static("k"));
        assert_eq!(IdempotencyKey::from_headers(&h).unwrap().as_str(), "k");
        h.append("idempotency-key", HeaderValue::from_static("k2"));
        assert_eq!(IdempotencyKey::from_headers(&h), Err(KeyError::Repeated));
    }
}
