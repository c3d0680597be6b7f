//! Stored answers sealed at rest: a [`KeyRing`] of named 256-bit keys, one of
//! them active, with which every answer idem stores is encrypted and
//! authenticated (XChaCha20-Poly1305) before it reaches a store, and opened
//! when a retry replays it.
//!
//! Off by default: [`crate::Idem::with_key_ring`] turns it on for the
//! transactional and the leased mode on every store (and
//! [`crate::Reconciler::with_key_ring`] for the outcomes a reconciler stores).
//! What is sealed is the answer's headers and body; its status stays clear for
//! the stats, and so do the row's tenant, operation, key digest, state and
//! times, which the primary key, the sweeper and the stats read. The row's
//! identity (tenant, operation, key digest, generation), the status and the
//! key's id are the seal's associated data: an answer changed by one bit, moved
//! to another row or given another status does not open. See
//! `docs/security.md`.
//!
//! ```
//! use idem_runtime::at_rest::KeyRing;
//!
//! // `IDEM_KEY_RING="2026-12:<base64 of 32 bytes>"`, as the example service
//! // reads it; a file (`KeyRing::from_file`) or a KMS (`KeySource`) as well.
//! let ring = KeyRing::parse("2026-12:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=", None)?;
//! assert_eq!(ring.active_id(), "2026-12");
//! // Debug output names the keys, never their bytes.
//! assert_eq!(format!("{ring:?}"), r#"KeyRing { active: "2026-12", ids: ["2026-12"] }"#);
//! # Ok::<(), idem_runtime::at_rest::KeyRingError>(())
//! ```

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use base64::Engine as _;
use bytes::Bytes;
use chacha20poly1305::aead::{Aead, AeadCore, KeyInit, OsRng, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
/// Key bytes that are zeroised when dropped: what [`KeyRing::new`] takes.
pub use zeroize::Zeroizing;

use crate::key::KeyDigest;
use crate::model::{StoreError, StoredResponse};

/// How long a key is: 256 bits.
pub const KEY_BYTES: usize = 32;

/// The environment variable [`KeyRing::from_env`] reads the keys from:
/// `id:BASE64` entries separated by commas.
pub const KEY_RING_VAR: &str = "IDEM_KEY_RING";

/// The environment variable that names the active key (needed with more than
/// one key).
pub const ACTIVE_KEY_VAR: &str = "IDEM_ACTIVE_KEY";

/// The stored header that marks a sealed answer, its value the key's id. No
/// response has it: `:` cannot start an HTTP header name.
pub(crate) const SEALED: &str = ":idem-sealed";

/// The stored header of a message consumer's record (`crate::consumer`), its
/// one header, with no body: it holds no answer, no consumer reads it, and a
/// rekey leaves it in clear (see [`opened_to_reseal`]). No response has it.
const MESSAGE_RECORD: &str = ":idem-message";

/// A message consumer's record, as `consumer::process_once` writes it:
/// status 200, the mark ([`MESSAGE_RECORD`]) alone, no body.
pub(crate) fn message_record() -> StoredResponse {
    StoredResponse {
        status: 200,
        headers: vec![(MESSAGE_RECORD.to_owned(), "1".to_owned())],
        body: Bytes::new(),
    }
}

/// Whether `stored` is exactly a message consumer's record.
fn is_message_record(stored: &StoredResponse) -> bool {
    stored.status == 200
        && matches!(&stored.headers[..], [(name, v)] if name == MESSAGE_RECORD && v == "1")
        && stored.body.is_empty()
}

/// The row's generation, noted beside [`SEALED`] by the store that read the row
/// (see [`noted`]): the seal is bound to it, and only the row knows it.
const GENERATION: &str = ":idem-generation";

/// XChaCha20's nonce: 192 random bits, which never repeat in practice however
/// many answers one key seals.
const NONCE_BYTES: usize = 24;

/// What the associated data starts with, so that a format after this one
/// cannot be read as this one.
const AAD_TAG: &[u8] = b"idem-answer-v1\0";

/// A key ring: named 256-bit keys, one of them active. New answers are sealed
/// with the active key; an answer opens with whichever key sealed it, so a key
/// stays in the ring while rows sealed with it are kept.
///
/// Cheap to clone (the keys are shared). The keys are zeroised when the last
/// clone is dropped, and neither `Debug` nor any error shows their bytes.
#[derive(Clone)]
pub struct KeyRing {
    ring: Arc<Ring>,
    /// See [`KeyRing::refusing_clear_answers`].
    refuse_clear: bool,
}

struct Ring {
    /// `(id, cipher)`; the cipher zeroises its key when dropped.
    keys: Vec<(String, XChaCha20Poly1305)>,
    active: usize,
}

/// Why a key ring could not be built. The messages name key ids and line
/// numbers, never key material.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyRingError {
    /// No key at all.
    #[error("the key ring holds no key")]
    NoKeys,
    /// Several keys and none named active.
    #[error(
        "the key ring holds several keys and names none active (set IDEM_ACTIVE_KEY, or an `active ID` line)"
    )]
    NoActiveKey,
    /// The active key's id is not in the ring.
    #[error("the active key {0:?} is not in the key ring")]
    UnknownActiveKey(String),
    /// The active key's id is not a usable id (not quoted: it may be a key
    /// set where its id belongs).
    #[error(
        "the active key's id is not a usable id: an id is 1 to 64 letters, digits, '.', '_' or '-', and not a key"
    )]
    InvalidActiveId,
    /// Two keys with one id.
    #[error("the key id {0:?} appears twice in the key ring")]
    DuplicateId(String),
    /// A key that is not 32 bytes long.
    #[error("the key {id:?} is {bytes} bytes long; a key is 32 bytes (256 bits)")]
    WrongLength {
        /// The key's id.
        id: String,
        /// How long it was.
        bytes: usize,
    },
    /// A key that is not base64.
    #[error("the key {0:?} is not base64 (standard alphabet, padded)")]
    NotBase64(String),
    /// An id that is empty, longer than 64 bytes, holds other than letters,
    /// digits, `.`, `_` and `-`, or is a 256-bit key's base64 without its `=`
    /// or its hex (it is not quoted: it may be a mistyped key).
    #[error(
        "key number {0} of the ring has no usable id: an id is 1 to 64 letters, digits, '.', '_' or '-', and not a key"
    )]
    InvalidId(usize),
    /// A line of a key file that is neither `active ID` nor `ID BASE64`.
    #[error("line {0} of the key file is neither `active ID` nor `ID BASE64`")]
    Malformed(usize),
    /// A key file with a second `active ID` line (its number): which key
    /// seals is not left to the order of the lines.
    #[error("line {0} of the key file names the active key a second time; keep one `active` line")]
    ActiveTwice(usize),
    /// A key file that could not be read.
    #[error("the key file {path} could not be read: {source}")]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A [`KeySource`] of the service's own failed.
    #[error("the key source failed: {0}")]
    Source(String),
}

impl KeyRing {
    /// A ring of `keys` (`(id, 32 bytes)`), `active` the one that seals. An
    /// id names its bytes for good: never give another key an id used
    /// before (docs/security.md, "Rotation").
    ///
    /// # Errors
    ///
    /// [`KeyRingError`] for no key, an id used twice or unusable, a key that is
    /// not 32 bytes, or an `active` id the ring lacks.
    pub fn new<I, S>(active: &str, keys: I) -> Result<Self, KeyRingError>
    where
        I: IntoIterator<Item = (S, Zeroizing<Vec<u8>>)>,
        S: Into<String>,
    {
        let mut ring = Vec::new();
        for (n, (id, bytes)) in keys.into_iter().enumerate() {
            let id = id.into();
            if !usable_id(&id) {
                return Err(KeyRingError::InvalidId(n + 1));
            }
            if ring.iter().any(|(other, _)| *other == id) {
                return Err(KeyRingError::DuplicateId(id));
            }
            if bytes.len() != KEY_BYTES {
                return Err(KeyRingError::WrongLength {
                    id,
                    bytes: bytes.len(),
                });
            }
            let cipher = XChaCha20Poly1305::new_from_slice(&bytes).map_err(|_| {
                KeyRingError::WrongLength {
                    id: id.clone(),
                    bytes: bytes.len(),
                }
            })?;
            ring.push((id, cipher));
        }
        if ring.is_empty() {
            return Err(KeyRingError::NoKeys);
        }
        if !usable_id(active) {
            return Err(KeyRingError::InvalidActiveId);
        }
        let active = ring
            .iter()
            .position(|(id, _)| id == active)
            .ok_or_else(|| KeyRingError::UnknownActiveKey(active.to_owned()))?;
        Ok(KeyRing {
            ring: Arc::new(Ring { keys: ring, active }),
            refuse_clear: false,
        })
    }

    /// A ring from text: `id:BASE64` entries separated by commas (spaces
    /// around them allowed), `active` the active key's id, which may be left
    /// out when there is one key.
    ///
    /// # Errors
    ///
    /// As [`KeyRing::new`], and [`KeyRingError::NotBase64`] for a key that is
    /// not base64.
    pub fn parse(text: &str, active: Option<&str>) -> Result<Self, KeyRingError> {
        let mut keys = Vec::new();
        for (n, entry) in text.split(',').map(str::trim).enumerate() {
            if entry.is_empty() {
                continue;
            }
            let Some((id, key)) = entry.split_once(':') else {
                return Err(KeyRingError::InvalidId(n + 1));
            };
            // Checked before the key is decoded: an error about the key quotes
            // its id, which must then not be a key pasted in the id's place.
            if !usable_id(id.trim()) {
                return Err(KeyRingError::InvalidId(n + 1));
            }
            keys.push((id.trim().to_owned(), decode(id.trim(), key.trim())?));
        }
        Self::with_active(keys, active)
    }

    /// A ring from [`KEY_RING_VAR`] and [`ACTIVE_KEY_VAR`] (see
    /// [`KeyRing::parse`]); `None` when the first is unset or empty.
    ///
    /// # Errors
    ///
    /// As [`KeyRing::parse`].
    pub fn from_env() -> Result<Option<Self>, KeyRingError> {
        Self::from_env_vars(KEY_RING_VAR, ACTIVE_KEY_VAR)
    }

    /// [`KeyRing::from_env`] with other variables.
    ///
    /// # Errors
    ///
    /// As [`KeyRing::parse`].
    pub fn from_env_vars(ring_var: &str, active_var: &str) -> Result<Option<Self>, KeyRingError> {
        let Some(text) = std::env::var_os(ring_var) else {
            return Ok(None);
        };
        let text = Zeroizing::new(text.to_string_lossy().into_owned());
        if text.trim().is_empty() {
            return Ok(None);
        }
        let active = std::env::var(active_var)
            .ok()
            .filter(|a| !a.trim().is_empty());
        Self::parse(&text, active.as_deref().map(str::trim)).map(Some)
    }

    /// A ring from a file: a line `ID BASE64` per key, one line `active ID`
    /// (which may be left out when there is one key), blank lines and lines
    /// that start with `#` ignored.
    ///
    /// # Errors
    ///
    /// [`KeyRingError::Unreadable`], [`KeyRingError::Malformed`] (the line's
    /// number, never its text), [`KeyRingError::ActiveTwice`], and as
    /// [`KeyRing::parse`].
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, KeyRingError> {
        let path = path.as_ref();
        let text = Zeroizing::new(std::fs::read_to_string(path).map_err(|source| {
            KeyRingError::Unreadable {
                path: path.to_owned(),
                source,
            }
        })?);
        let mut keys = Vec::new();
        let mut active = None;
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut words = line.split_whitespace();
            match (words.next(), words.next(), words.next()) {
                // `active` names a key's id; a key after it (a key whose id is
                // `active`) would be read as the active one's name, and is
                // refused rather than quoted.
                (Some("active"), Some(_), None) if active.is_some() => {
                    return Err(KeyRingError::ActiveTwice(n + 1));
                }
                (Some("active"), Some(id), None) if usable_id(id) => active = Some(id.to_owned()),
                (Some("active"), Some(_), None) => return Err(KeyRingError::Malformed(n + 1)),
                (Some(id), Some(key), None) if usable_id(id) => {
                    keys.push((id.to_owned(), decode(id, key)?));
                }
                (Some(_), Some(_), None) => return Err(KeyRingError::InvalidId(keys.len() + 1)),
                _ => return Err(KeyRingError::Malformed(n + 1)),
            }
        }
        Self::with_active(keys, active.as_deref())
    }

    /// A ring from `source` (the environment, a file, a KMS).
    ///
    /// # Errors
    ///
    /// What the source answers.
    pub async fn load(source: &impl KeySource) -> Result<Self, KeyRingError> {
        source.load().await
    }

    /// The id of the key new answers are sealed with.
    pub fn active_id(&self) -> &str {
        &self.ring.keys[self.ring.active].0
    }

    /// The ids of every key in the ring, in the order given.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.ring.keys.iter().map(|(id, _)| id.as_str())
    }

    /// The ring, refusing answers stored in clear: a retry of a key whose row
    /// holds a clear answer is answered `503` (its outcome cannot be read; it
    /// does not run again), as for a seal that does not open. Without it, a
    /// clear answer is replayed as it is, so whoever can write the store could
    /// put in an answer of their own choosing.
    ///
    /// Turn it on once no clear answer is kept and none is written: every
    /// writer of answers carries the ring first (the service's `Idem`, a
    /// [`crate::Reconciler`] through `with_key_ring`, hand-written claims), and
    /// every row finished before has passed its retention or been sealed by a
    /// rekey with `seal_clear` (`idem rekey --seal-clear`) run with a ring that
    /// does not refuse them. A rekey with a refusing ring leaves clear answers
    /// as they are and counts them as broken: sealing them would make a clear
    /// row written since by someone without the keys replay.
    ///
    /// ```
    /// use idem_runtime::at_rest::KeyRing;
    ///
    /// let ring = KeyRing::parse("2026-12:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=", None)?
    ///     .refusing_clear_answers();
    /// assert!(ring.refuses_clear_answers());
    /// # Ok::<(), idem_runtime::at_rest::KeyRingError>(())
    /// ```
    #[must_use]
    pub fn refusing_clear_answers(mut self) -> Self {
        self.refuse_clear = true;
        self
    }

    /// Whether answers stored in clear are refused
    /// ([`KeyRing::refusing_clear_answers`]).
    pub fn refuses_clear_answers(&self) -> bool {
        self.refuse_clear
    }

    fn with_active(
        keys: Vec<(String, Zeroizing<Vec<u8>>)>,
        active: Option<&str>,
    ) -> Result<Self, KeyRingError> {
        let active = match (active, keys.as_slice()) {
            (Some(a), _) => a.to_owned(),
            (None, [(only, _)]) => only.clone(),
            (None, []) => return Err(KeyRingError::NoKeys),
            (None, _) => return Err(KeyRingError::NoActiveKey),
        };
        Self::new(&active, keys)
    }

    fn cipher(&self, id: &str) -> Option<&XChaCha20Poly1305> {
        self.ring
            .keys
            .iter()
            .find(|(k, _)| k == id)
            .map(|(_, cipher)| cipher)
    }

    /// `clear` sealed with the active key for the row `row`: the same status,
    /// the marker header naming the key, and the sealed headers and body.
    pub(crate) fn seal(
        &self,
        row: &RowId<'_>,
        clear: &StoredResponse,
    ) -> Result<StoredResponse, StoreError> {
        let (id, cipher) = &self.ring.keys[self.ring.active];
        let headers = serde_json::to_vec(&clear.headers)
            .map_err(|e| StoreError::Corrupt(format!("headers: {e}")))?;
        let headers_len = u32::try_from(headers.len())
            .map_err(|_| StoreError::Corrupt("headers over 4 GiB".into()))?;
        let mut plain = Zeroizing::new(Vec::with_capacity(4 + headers.len() + clear.body.len()));
        plain.extend_from_slice(&headers_len.to_be_bytes());
        plain.extend_from_slice(&headers);
        plain.extend_from_slice(&clear.body);
        let nonce = XChaCha20Poly1305::generate_nonce(&mut OsRng);
        let aad = associated_data(row, clear.status, id);
        let sealed = cipher
            .encrypt(
                &nonce,
                Payload {
                    msg: &plain,
                    aad: &aad,
                },
            )
            .map_err(|_| StoreError::Corrupt("an answer could not be sealed".into()))?;
        let mut body = Vec::with_capacity(NONCE_BYTES + sealed.len());
        body.extend_from_slice(&nonce);
        body.extend_from_slice(&sealed);
        Ok(StoredResponse {
            status: clear.status,
            headers: vec![(SEALED.to_owned(), id.clone())],
            body: Bytes::from(body),
        })
    }

    /// The answer `sealed` holds, for the row `row`.
    fn open(
        &self,
        row: &RowId<'_>,
        key_id: &str,
        sealed: &StoredResponse,
    ) -> Result<StoredResponse, StoreError> {
        let cipher = self
            .cipher(key_id)
            .ok_or_else(|| StoreError::SealKeyMissing {
                key_id: key_id.to_owned(),
            })?;
        let Some((nonce, text)) = sealed.body.split_at_checked(NONCE_BYTES) else {
            return Err(StoreError::SealBroken);
        };
        let nonce =
            XNonce::from(<[u8; NONCE_BYTES]>::try_from(nonce).map_err(|_| StoreError::SealBroken)?);
        let aad = associated_data(row, sealed.status, key_id);
        let plain = Zeroizing::new(
            cipher
                .decrypt(
                    &nonce,
                    Payload {
                        msg: text,
                        aad: &aad,
                    },
                )
                .map_err(|_| StoreError::SealBroken)?,
        );
        let (len, rest) = plain.split_at_checked(4).ok_or(StoreError::SealBroken)?;
        let len = usize::try_from(u32::from_be_bytes(
            len.try_into().map_err(|_| StoreError::SealBroken)?,
        ))
        .map_err(|_| StoreError::SealBroken)?;
        let (headers, body) = rest.split_at_checked(len).ok_or(StoreError::SealBroken)?;
        let headers: Vec<(String, String)> = serde_json::from_slice(headers)
            .map_err(|e| StoreError::unreadable_headers("sealed headers", &e))?;
        Ok(StoredResponse {
            status: sealed.status,
            headers,
            body: Bytes::copy_from_slice(body),
        })
    }
}

impl fmt::Debug for KeyRing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("KeyRing");
        d.field("active", &self.active_id())
            .field("ids", &self.ids().collect::<Vec<_>>());
        if self.refuse_clear {
            d.field("clear_answers", &"refused");
        }
        d.finish()
    }
}

/// Where a service's keys come from: the environment ([`EnvKeys`]), a file
/// ([`FileKeys`]), or its own (a KMS that unwraps data keys, say, then calls
/// [`KeyRing::new`]).
///
/// ```
/// use idem_runtime::at_rest::{KeyRing, KeyRingError, KeySource, Zeroizing};
///
/// struct Kms;
///
/// impl KeySource for Kms {
///     async fn load(&self) -> Result<KeyRing, KeyRingError> {
///         // Unwrap the data keys with the KMS here.
///         let key = Zeroizing::new(vec![7u8; 32]);
///         KeyRing::new("kms-1", [("kms-1", key)])
///     }
/// }
/// # let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
/// let ring = rt.block_on(KeyRing::load(&Kms))?;
/// assert_eq!(ring.active_id(), "kms-1");
/// # Ok::<(), KeyRingError>(())
/// ```
pub trait KeySource {
    /// The ring as the source holds it now.
    fn load(&self) -> impl Future<Output = Result<KeyRing, KeyRingError>> + Send;
}

/// The keys in [`KEY_RING_VAR`] and [`ACTIVE_KEY_VAR`] (see
/// [`KeyRing::from_env`]); [`KeyRingError::NoKeys`] when they are unset.
#[derive(Debug, Clone, Copy, Default)]
pub struct EnvKeys;

impl KeySource for EnvKeys {
    async fn load(&self) -> Result<KeyRing, KeyRingError> {
        KeyRing::from_env()?.ok_or(KeyRingError::NoKeys)
    }
}

/// The keys in a file (see [`KeyRing::from_file`]).
#[derive(Debug, Clone)]
pub struct FileKeys(pub PathBuf);

impl KeySource for FileKeys {
    async fn load(&self) -> Result<KeyRing, KeyRingError> {
        KeyRing::from_file(&self.0)
    }
}

/// A row's identity, which a sealed answer is bound to.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowId<'a> {
    pub(crate) tenant: &'a str,
    pub(crate) operation: &'a str,
    pub(crate) key: &'a KeyDigest,
    pub(crate) generation: i64,
}

/// `clear` as it is to be stored for `row`: sealed when there is a ring,
/// itself (not copied) when there is none.
pub(crate) fn seal<'a>(
    ring: Option<&KeyRing>,
    row: &RowId<'_>,
    clear: &'a StoredResponse,
) -> Result<Cow<'a, StoredResponse>, StoreError> {
    match ring {
        None => Ok(Cow::Borrowed(clear)),
        Some(ring) => ring.seal(row, clear).map(Cow::Owned),
    }
}

/// The key a stored answer is sealed with, if it is sealed.
pub(crate) fn sealed_with(stored: &StoredResponse) -> Option<&str> {
    match stored.headers.first() {
        Some((name, id)) if name == SEALED => Some(id),
        _ => None,
    }
}

/// `stored`, read from a row of generation `generation`, with that generation
/// noted when it is sealed (opening it needs the row's own, not one the sealed
/// bytes could carry along). Every store's decoder calls this.
pub(crate) fn noted(mut stored: StoredResponse, generation: i64) -> StoredResponse {
    if sealed_with(&stored).is_some() {
        stored.headers.truncate(1);
        stored
            .headers
            .push((GENERATION.to_owned(), generation.to_string()));
    }
    stored
}

/// The answer `stored` holds for the key `(tenant, operation, key)`: itself when
/// it is clear, opened when it is sealed.
///
/// # Errors
///
/// [`StoreError::SealKeyMissing`] when it is sealed with a key `ring` lacks (or
/// there is no ring), [`StoreError::SealBroken`] when it does not open for this
/// row (changed, or moved from another), or is clear where the ring refuses
/// clear answers. Either way it is neither replayed nor run again.
pub(crate) fn open(
    ring: Option<&KeyRing>,
    tenant: &str,
    operation: &str,
    key: &KeyDigest,
    stored: StoredResponse,
) -> Result<StoredResponse, StoreError> {
    let Some(key_id) = sealed_with(&stored) else {
        return clear(ring, stored);
    };
    let generation = match stored.headers.get(1) {
        Some((name, g)) if name == GENERATION => g
            .parse()
            .map_err(|_| StoreError::Corrupt("a sealed answer's generation".into()))?,
        _ => {
            return Err(StoreError::Corrupt(
                "a sealed answer read without its row's generation".into(),
            ));
        }
    };
    let Some(ring) = ring else {
        return Err(StoreError::SealKeyMissing {
            key_id: key_id.to_owned(),
        });
    };
    let row = RowId {
        tenant,
        operation,
        key,
        generation,
    };
    ring.open(&row, key_id, &stored)
}

/// [`open`] for a replay of `key`: a clear answer, the common case, comes back
/// as it is without the key being digested again.
pub(crate) fn open_replay(
    ring: Option<&KeyRing>,
    tenant: &str,
    operation: &str,
    key: &crate::key::IdempotencyKey,
    stored: StoredResponse,
) -> Result<StoredResponse, StoreError> {
    if sealed_with(&stored).is_none() {
        return clear(ring, stored);
    }
    open(ring, tenant, operation, &key.digest(), stored)
}

/// A clear answer: itself, unless the ring refuses clear answers (a row
/// written, or rewritten, without the ring's keys).
fn clear(ring: Option<&KeyRing>, stored: StoredResponse) -> Result<StoredResponse, StoreError> {
    if ring.is_some_and(KeyRing::refuses_clear_answers) {
        tracing::error!(
            status = stored.status,
            "idem: a stored answer is in clear where the key ring refuses clear answers; not replayed"
        );
        return Err(StoreError::SealBroken);
    }
    Ok(stored)
}

/// A rekey's open of one stored answer: the answer, or `None` when it cannot
/// be opened and is to be left (counted in `report`: a key the ring lacks, or
/// a seal that fails for its row).
///
/// # Errors
///
/// What [`open`] answers besides those two.
pub(crate) fn opened_to_reseal(
    ring: &KeyRing,
    tenant: &str,
    operation: &str,
    key: &KeyDigest,
    stored: StoredResponse,
    report: &mut crate::model::RekeyReport,
) -> Result<Option<StoredResponse>, StoreError> {
    // A message consumer's record has nothing to protect and is never
    // replayed: left in clear, and counted apart, so that a table shared with
    // a consumer can pass a rekey that refuses clear answers. (A service that
    // refuses them still refuses such a row as an answer: `open` below.)
    if is_message_record(&stored) {
        report.messages += 1;
        return Ok(None);
    }
    // A ring that refuses clear answers does not seal them either: a clear
    // row that appeared after sealing was complete (written by someone
    // without the keys) would otherwise be sealed and replayed from then on.
    // It is counted as broken (`open` refuses it as such).
    match open(Some(ring), tenant, operation, key, stored) {
        Ok(clear) => Ok(Some(clear)),
        Err(StoreError::SealKeyMissing { key_id }) => {
            *report.unreadable.entry(key_id).or_default() += 1;
            Ok(None)
        }
        Err(StoreError::SealBroken) => {
            report.broken += 1;
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Whether `id` may name a key, and so be quoted in an error: 1 to 64
/// letters, digits, `.`, `_` or `-`, and not a key itself. A 256-bit key in
/// base64 without its `=` (43 characters; a quarter of keys hold no `+` or
/// `/`, and selecting one by double-click leaves the `=` out) or in hex (64
/// digits) would pass the first rule, and be printed back where it was pasted
/// in its id's place.
fn usable_id(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        && !looks_like_a_key(id)
}

fn looks_like_a_key(id: &str) -> bool {
    use base64::engine::general_purpose::{STANDARD_NO_PAD, URL_SAFE_NO_PAD};
    let decodes_to_a_key = |engine: &base64::engine::GeneralPurpose| {
        engine
            .decode(id)
            .is_ok_and(|bytes| bytes.len() == KEY_BYTES)
    };
    (id.len() == 2 * KEY_BYTES && id.bytes().all(|b| b.is_ascii_hexdigit()))
        || decodes_to_a_key(&STANDARD_NO_PAD)
        || decodes_to_a_key(&URL_SAFE_NO_PAD)
}

fn decode(id: &str, key: &str) -> Result<Zeroizing<Vec<u8>>, KeyRingError> {
    base64::engine::general_purpose::STANDARD
        .decode(key)
        .map(Zeroizing::new)
        .map_err(|_| KeyRingError::NotBase64(id.to_owned()))
}

/// What a seal is bound to besides its text: the format, the row's identity,
/// the status and the key's id, each length-prefixed so that no two
/// identities run together.
fn associated_data(row: &RowId<'_>, status: u16, key_id: &str) -> Vec<u8> {
    let mut aad = Vec::with_capacity(
        AAD_TAG.len() + 8 + row.tenant.len() + row.operation.len() + 32 + 8 + 2 + 1 + key_id.len(),
    );
    aad.extend_from_slice(AAD_TAG);
    for part in [row.tenant, row.operation] {
        aad.extend_from_slice(&u32::try_from(part.len()).unwrap_or(u32::MAX).to_be_bytes());
        aad.extend_from_slice(part.as_bytes());
    }
    aad.extend_from_slice(row.key.as_bytes());
    aad.extend_from_slice(&row.generation.to_be_bytes());
    aad.extend_from_slice(&status.to_be_bytes());
    // Ids are at most 64 bytes.
    aad.push(u8::try_from(key_id.len()).unwrap_or(u8::MAX));
    aad.extend_from_slice(key_id.as_bytes());
    aad
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(byte: u8) -> Zeroizing<Vec<u8>> {
        Zeroizing::new(vec![byte; KEY_BYTES])
    }

    fn ring() -> KeyRing {
        KeyRing::new("k2", [("k1", key(1)), ("k2", key(2))]).unwrap()
    }

    fn answer() -> StoredResponse {
        StoredResponse {
            status: 201,
            headers: vec![("content-type".into(), "application/json".into())],
            body: Bytes::from_static(br#"{"card":"4242"}"#),
        }
    }

    fn digest() -> KeyDigest {
        crate::key::IdempotencyKey::parse("k-1").unwrap().digest()
    }

    fn row(key: &KeyDigest, generation: i64) -> RowId<'_> {
        RowId {
            tenant: "acme",
            operation: "pay",
            key,
            generation,
        }
    }

    /// What a store reads back: the sealed answer with its row's generation.
    fn read_back(sealed: &StoredResponse, generation: i64) -> StoredResponse {
        noted(sealed.clone(), generation)
    }

    #[test]
    fn a_sealed_answer_opens_for_its_row_and_hides_its_text() {
        let k = digest();
        let sealed = ring().seal(&row(&k, 3), &answer()).unwrap();
        assert_eq!(sealed.status, 201);
        assert_eq!(sealed.headers, vec![(SEALED.to_owned(), "k2".to_owned())]);
        assert!(!sealed.body.windows(4).any(|w| w == b"4242"));
        let headers = serde_json::to_vec(&answer().headers).unwrap().len();
        assert_eq!(sealed.body.len(), NONCE_BYTES + 4 + headers + 15 + 16);
        let opened = open(Some(&ring()), "acme", "pay", &k, read_back(&sealed, 3)).unwrap();
        assert_eq!(opened, answer());
    }

    #[test]
    fn a_clear_answer_passes_through_with_or_without_a_ring() {
        let k = digest();
        assert_eq!(
            open(Some(&ring()), "acme", "pay", &k, noted(answer(), 3)).unwrap(),
            answer()
        );
        assert_eq!(open(None, "acme", "pay", &k, answer()).unwrap(), answer());
        assert!(matches!(
            seal(None, &row(&k, 1), &answer()).unwrap(),
            Cow::Borrowed(_)
        ));
    }

    #[test]
    fn a_ring_refusing_clear_answers_refuses_them_and_does_not_seal_them() {
        let k = digest();
        let strict = ring().refusing_clear_answers();
        assert!(strict.refuses_clear_answers() && !ring().refuses_clear_answers());
        assert!(matches!(
            open(Some(&strict), "acme", "pay", &k, noted(answer(), 3)),
            Err(StoreError::SealBroken)
        ));
        let key = crate::key::IdempotencyKey::parse("k-1").unwrap();
        assert!(matches!(
            open_replay(Some(&strict), "acme", "pay", &key, answer()),
            Err(StoreError::SealBroken)
        ));
        // A sealed answer opens as with any ring.
        let sealed = strict.seal(&row(&k, 3), &answer()).unwrap();
        assert_eq!(
            open(Some(&strict), "acme", "pay", &k, read_back(&sealed, 3)).unwrap(),
            answer()
        );
        // A rekey with it leaves the clear answer, counted as broken; one with
        // a ring that accepts clear answers opens it, to seal it.
        let mut report = crate::model::RekeyReport::default();
        let left = opened_to_reseal(&strict, "acme", "pay", &k, answer(), &mut report);
        assert_eq!((left.unwrap(), report.broken), (None, 1));
        let opened = opened_to_reseal(&ring(), "acme", "pay", &k, answer(), &mut report);
        assert_eq!(opened.unwrap(), Some(answer()));
        assert!(format!("{strict:?}").ends_with(r#"clear_answers: "refused" }"#));
    }

    #[test]
    fn a_sealed_answer_does_not_open_for_another_row_status_or_key() {
        let k = digest();
        let other = crate::key::IdempotencyKey::parse("k-2").unwrap().digest();
        let sealed = ring().seal(&row(&k, 3), &answer()).unwrap();
        let broken = |r: Result<StoredResponse, StoreError>| {
            assert!(matches!(r, Err(StoreError::SealBroken)), "{r:?}");
        };
        let opened = |tenant: &str, operation: &str, key: &KeyDigest, generation: i64| {
            open(
                Some(&ring()),
                tenant,
                operation,
                key,
                read_back(&sealed, generation),
            )
        };
        broken(opened("globex", "pay", &k, 3));
        broken(opened("acme", "refund", &k, 3));
        broken(opened("acme", "pay", &other, 3));
        broken(opened("acme", "pay", &k, 4));
        let mut status = read_back(&sealed, 3);
        status.status = 200;
        broken(open(Some(&ring()), "acme", "pay", &k, status));
        // The same bytes under another key's name.
        let mut renamed = read_back(&sealed, 3);
        renamed.headers[0].1 = "k1".into();
        broken(open(Some(&ring()), "acme", "pay", &k, renamed));
    }

    #[test]
    fn one_flipped_byte_anywhere_is_refused() {
        let k = digest();
        let sealed = ring().seal(&row(&k, 1), &answer()).unwrap();
        for i in 0..sealed.body.len() {
            let mut body = sealed.body.to_vec();
            body[i] ^= 0x01;
            let tampered = StoredResponse {
                body: body.into(),
                ..read_back(&sealed, 1)
            };
            assert!(
                matches!(
                    open(Some(&ring()), "acme", "pay", &k, tampered),
                    Err(StoreError::SealBroken)
                ),
                "byte {i}"
            );
        }
        let short = StoredResponse {
            body: sealed.body.slice(..10),
            ..read_back(&sealed, 1)
        };
        assert!(matches!(
            open(Some(&ring()), "acme", "pay", &k, short),
            Err(StoreError::SealBroken)
        ));
    }

    #[test]
    fn a_missing_key_or_ring_is_named_and_nothing_opens() {
        let k = digest();
        let sealed = read_back(&ring().seal(&row(&k, 1), &answer()).unwrap(), 1);
        let only_k1 = KeyRing::new("k1", [("k1", key(1))]).unwrap();
        for ring in [Some(&only_k1), None] {
            match open(ring, "acme", "pay", &k, sealed.clone()) {
                Err(e @ StoreError::SealKeyMissing { .. }) => {
                    assert!(e.to_string().contains("\"k2\""), "{e}");
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn an_old_key_still_opens_after_rotation() {
        let k = digest();
        let old = KeyRing::new("k1", [("k1", key(1))]).unwrap();
        let sealed = read_back(&old.seal(&row(&k, 1), &answer()).unwrap(), 1);
        assert_eq!(
            open(Some(&ring()), "acme", "pay", &k, sealed).unwrap(),
            answer()
        );
        assert_eq!(
            sealed_with(&ring().seal(&row(&k, 1), &answer()).unwrap()),
            Some("k2")
        );
    }

    #[test]
    fn a_sealed_answer_read_without_its_generation_is_refused() {
        let k = digest();
        let sealed = ring().seal(&row(&k, 1), &answer()).unwrap();
        assert!(matches!(
            open(Some(&ring()), "acme", "pay", &k, sealed),
            Err(StoreError::Corrupt(_))
        ));
    }

    #[test]
    fn every_bad_ring_is_refused_by_name() {
        let e = |r: Result<KeyRing, KeyRingError>| r.unwrap_err().to_string();
        let none: [(&str, Zeroizing<Vec<u8>>); 0] = [];
        assert_eq!(e(KeyRing::new("k1", none)), "the key ring holds no key");
        assert!(e(KeyRing::new("k9", [("k1", key(1))])).contains("\"k9\" is not in"));
        assert!(
            e(KeyRing::new("k1", [("k1", key(1)), ("k1", key(2))]))
                .contains("\"k1\" appears twice")
        );
        for len in [31, 33] {
            let short = Zeroizing::new(vec![1; len]);
            assert!(
                e(KeyRing::new("k1", [("k1", short)])).contains(&format!("is {len} bytes long"))
            );
        }
        assert!(e(KeyRing::new("k1", [("", key(1))])).contains("key number 1"));
        assert!(e(KeyRing::new("k1", [("a b", key(1))])).contains("key number 1"));
        let b64 = |b: u8| base64::engine::general_purpose::STANDARD.encode([b; KEY_BYTES]);
        let two = format!("k1:{},k2:{}", b64(1), b64(2));
        assert!(e(KeyRing::parse(&two, None)).contains("names none active"));
        assert_eq!(KeyRing::parse(&two, Some("k2")).unwrap().active_id(), "k2");
        assert!(e(KeyRing::parse("k1:not base64!", None)).contains("\"k1\" is not base64"));
        // A key pasted without its id is not quoted back.
        let pasted = e(KeyRing::parse(&b64(1), None));
        assert!(!pasted.contains(&b64(1)[..8]), "{pasted}");
        // Nor a key and its id swapped, nor a key set as the active id.
        let swapped = e(KeyRing::parse(&format!("{}:k1", b64(1)), None));
        assert!(swapped.contains("key number 1"), "{swapped}");
        assert!(!swapped.contains(&b64(1)[..8]), "{swapped}");
        let active = e(KeyRing::parse(&format!("k1:{}", b64(1)), Some(&b64(1))));
        assert!(active.contains("not a usable id"), "{active}");
        assert!(!active.contains(&b64(1)[..8]), "{active}");
        assert_eq!(e(KeyRing::parse(" , ", None)), "the key ring holds no key");
    }

    #[test]
    fn a_key_without_its_padding_or_in_hex_is_no_id_and_is_not_quoted() {
        let e = |r: Result<KeyRing, KeyRingError>| r.unwrap_err().to_string();
        // A key whose base64 holds no '+' or '/': its 43 characters before the
        // '=' are letters and digits, as an id's are.
        let bytes: [u8; KEY_BYTES] = std::array::from_fn(|i| (i as u8).wrapping_mul(37) % 62);
        let padded = base64::engine::general_purpose::STANDARD.encode(bytes);
        let bare = padded.trim_end_matches('=');
        assert_eq!(bare.len(), 43);
        assert!(bare.bytes().all(|b| b.is_ascii_alphanumeric()), "{bare}");
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let url_safe = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode([0xfb; KEY_BYTES]);
        let ring = format!("k1:{padded}");
        for pasted in [bare, hex.as_str(), url_safe.as_str()] {
            let active = e(KeyRing::parse(&ring, Some(pasted)));
            assert!(active.contains("not a usable id"), "{active}");
            let swapped = e(KeyRing::parse(&format!("{pasted}:k1"), None));
            assert!(swapped.contains("key number 1"), "{swapped}");
            for said in [&active, &swapped] {
                assert!(!said.contains(&pasted[..8]), "{said}");
            }
        }
        // An id as long is still an id when it is no key.
        let long = "payments-2026-12-primary-rotation-after-audit";
        assert_eq!(
            KeyRing::parse(&format!("{long}:{padded}"), None)
                .unwrap()
                .active_id(),
            long
        );
    }

    #[test]
    fn a_key_file_names_its_keys_and_the_active_one() {
        let b64 = |b: u8| base64::engine::general_purpose::STANDARD.encode([b; KEY_BYTES]);
        let dir = std::env::temp_dir().join(format!("idem-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("ring");
        std::fs::write(
            &file,
            format!(
                "# rotated 2026-12\nk1 {}\n\nk2 {}\nactive k2\n",
                b64(1),
                b64(2)
            ),
        )
        .unwrap();
        let ring = KeyRing::from_file(&file).unwrap();
        assert_eq!(ring.active_id(), "k2");
        assert_eq!(ring.ids().collect::<Vec<_>>(), ["k1", "k2"]);
        std::fs::write(&file, format!("k1 {} extra\n", b64(1))).unwrap();
        let e = KeyRing::from_file(&file).unwrap_err().to_string();
        assert_eq!(
            e,
            "line 1 of the key file is neither `active ID` nor `ID BASE64`"
        );
        assert!(!e.contains(&b64(1)[..8]));
        // A key and its id swapped, and a key named `active` (read as the
        // active key's name): refused, and the key not quoted.
        for (text, said) in [
            (format!("{} k1\n", b64(1)), "key number 1"),
            (format!("active {}\n", b64(1)), "line 1 of the key file"),
        ] {
            std::fs::write(&file, text).unwrap();
            let e = KeyRing::from_file(&file).unwrap_err().to_string();
            assert!(e.contains(said), "{e}");
            assert!(!e.contains(&b64(1)[..8]), "{e}");
        }
        assert!(matches!(
            KeyRing::from_file(dir.join("missing")),
            Err(KeyRingError::Unreadable { .. })
        ));
        // Two `active` lines: which key seals is not the last line's choice.
        std::fs::write(
            &file,
            format!(
                "k1 {}
active k1
k2 {}
active k2
",
                b64(1),
                b64(2)
            ),
        )
        .unwrap();
        assert!(matches!(
            KeyRing::from_file(&file),
            Err(KeyRingError::ActiveTwice(4))
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn debug_shows_ids_and_no_key_bytes() {
        let shown = format!("{:?}", ring());
        assert_eq!(shown, r#"KeyRing { active: "k2", ids: ["k1", "k2"] }"#);
    }
}
