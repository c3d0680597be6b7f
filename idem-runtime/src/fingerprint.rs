//! What identifies a logical request besides its key.
//!
//! A fingerprint is SHA-256 over a versioned, length-prefixed encoding of the
//! tenant, the operation, the method and route, the selected headers and the body.
//! The body is hashed as RFC 8785 canonical JSON of the *typed* value the handler
//! received, so key order, white space and fields omitted in favour of their
//! `#[serde(default)]` do not change it, while any changed value does.
//!
//! The encoding is versioned ([`FINGERPRINT_VERSION`]): a change to it is a change
//! of version, and a retry across such a change reports a mismatch rather than
//! silently matching the wrong request.

use std::fmt;

use axum::http::HeaderMap;
use serde::Serialize;
use sha2::{Digest, Sha256};

mod raw;

/// The version of the encoding hashed into every fingerprint.
pub const FINGERPRINT_VERSION: &str = "idem-fingerprint-v1";

/// The SHA-256 fingerprint of one logical request.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The 32 digest bytes, as stored in the `fingerprint` column.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Builds a fingerprint from stored digest bytes.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Fingerprint(bytes)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", hex::encode(self.0))
    }
}

/// The body could not be canonicalised (for example a map with non-string keys,
/// or a map key that is a NaN or infinite float).
#[derive(Debug, thiserror::Error)]
#[error("the request body cannot be encoded as canonical JSON: {0}")]
pub struct FingerprintError(#[from] serde_json::Error);

#[derive(PartialEq, Eq, PartialOrd, Ord)]
enum Part {
    Header {
        name: String,
        /// Its lines combined into one (see [`FingerprintBuilder::header`]).
        value: Option<Vec<u8>>,
    },
    Body(Vec<u8>),
    BodyField {
        path: String,
        json: Vec<u8>,
    },
    Extra {
        // The runtime's own names are literals: borrowed, not copied.
        name: std::borrow::Cow<'static, str>,
        value: Vec<u8>,
    },
    // Last, so that adding it left every earlier fingerprint unchanged.
    RawBody(Vec<u8>),
}

/// Collects the parts of a request that identify it and hashes them.
///
/// Parts are sorted before hashing, so the order in which headers or body fields
/// are added does not matter; what they are does.
///
/// ```
/// use idem_runtime::FingerprintBuilder;
/// use serde_json::json;
///
/// let a = FingerprintBuilder::new("acme", "create-order", "POST", "/orders")
///     .body(&json!({"sku": "A", "qty": 1}))
///     .unwrap()
///     .finish();
/// let b = FingerprintBuilder::new("acme", "create-order", "POST", "/orders")
///     .body(&json!({"qty": 1, "sku": "A"}))
///     .unwrap()
///     .finish();
/// assert_eq!(a, b);
/// ```
pub struct FingerprintBuilder {
    /// The version and the scope, hashed as they come: they lead the encoding
    /// in a fixed order, so nothing of them needs keeping (no copy per request).
    head: Sha256,
    parts: Vec<Part>,
}

impl FingerprintBuilder {
    /// Starts a fingerprint for one tenant, operation, method and route template
    /// (the matched route such as `/orders/{id}`, not the concrete path).
    pub fn new(tenant: &str, operation: &str, method: &str, route: &str) -> Self {
        let mut head = Sha256::new();
        put(&mut head, FINGERPRINT_VERSION.as_bytes());
        for s in [tenant, operation, method, route] {
            put(&mut head, s.as_bytes());
        }
        FingerprintBuilder {
            head,
            parts: Vec::new(),
        }
    }

    /// Adds a request header by name. All of its values count, in order; an absent
    /// header and an empty one are different requests.
    ///
    /// A header sent on several lines counts as those lines combined into one,
    /// as HTTP lets any intermediary combine them (RFC 9110, section 5.3: joined
    /// by `, `; `cookie` by `; `, as HTTP/2 splits it): a retry whose proxy
    /// combined the lines its first attempt sent apart is the same request.
    pub fn header(mut self, name: &str, headers: &HeaderMap) -> Self {
        let name = name.to_ascii_lowercase();
        let mut lines = headers.get_all(name.as_str()).iter();
        let value = lines.next().map(|first| {
            let mut value = first.as_bytes().to_vec();
            let separator: &[u8] = if name == "cookie" { b"; " } else { b", " };
            for line in lines {
                value.extend_from_slice(separator);
                value.extend_from_slice(line.as_bytes());
            }
            value
        });
        self.parts.push(Part::Header { name, value });
        self
    }

    /// Adds the whole typed body, canonicalised per RFC 8785.
    ///
    /// # Errors
    ///
    /// [`FingerprintError`] when the value has no JSON form.
    pub fn body<T: Serialize + ?Sized>(mut self, value: &T) -> Result<Self, FingerprintError> {
        self.parts.push(Part::Body(canonical_json(value)?));
        Ok(self)
    }

    /// Adds the body as the bytes that were sent, for a body without a typed value
    /// (`Bytes`, `RawForm`): every byte counts, white space and key order included.
    pub fn raw_body(mut self, bytes: &[u8]) -> Self {
        self.parts.push(Part::RawBody(bytes.to_vec()));
        self
    }

    /// Adds one field of the typed body under its path (`"customer.id"`),
    /// canonicalised per RFC 8785.
    ///
    /// # Errors
    ///
    /// [`FingerprintError`] when the value has no JSON form.
    pub fn body_field<T: Serialize + ?Sized>(
        mut self,
        path: &str,
        value: &T,
    ) -> Result<Self, FingerprintError> {
        let json = canonical_json(value)?;
        self.parts.push(Part::BodyField {
            path: path.to_owned(),
            json,
        });
        Ok(self)
    }

    /// Adds any other named value the application considers part of the request
    /// (a path parameter, a query string, a message payload's raw bytes).
    pub fn extra(mut self, name: &str, value: impl AsRef<[u8]>) -> Self {
        self.parts.push(Part::Extra {
            name: name.to_owned().into(),
            value: value.as_ref().to_vec(),
        });
        self
    }

    /// [`Self::extra`] under a name that lives for the program (the runtime's
    /// own parts, added to every request's fingerprint): the same digest.
    pub(crate) fn extra_static(mut self, name: &'static str, value: impl AsRef<[u8]>) -> Self {
        self.parts.push(Part::Extra {
            name: name.into(),
            value: value.as_ref().to_vec(),
        });
        self
    }

    /// Hashes everything added so far.
    pub fn finish(mut self) -> Fingerprint {
        self.parts.sort();
        let mut h = self.head;
        for part in &self.parts {
            match part {
                Part::Header { name, value } => {
                    h.update(b"H");
                    put(&mut h, name.as_bytes());
                    match value {
                        None => h.update(b"-"),
                        Some(value) => {
                            // A count of values, always 1 since the lines are
                            // combined: kept, so stored digests still match.
                            h.update(b"+");
                            h.update(1u64.to_be_bytes());
                            put(&mut h, value);
                        }
                    }
                }
                Part::Body(json) => {
                    h.update(b"B");
                    put(&mut h, json);
                }
                Part::BodyField { path, json } => {
                    h.update(b"F");
                    put(&mut h, path.as_bytes());
                    put(&mut h, json);
                }
                Part::Extra { name, value } => {
                    h.update(b"X");
                    put(&mut h, name.as_bytes());
                    put(&mut h, value);
                }
                Part::RawBody(bytes) => {
                    h.update(b"R");
                    put(&mut h, bytes);
                }
            }
        }
        Fingerprint(h.finalize().into())
    }
}

/// Length-prefixing makes the encoding injective: ("ab","c") and ("a","bc") differ.
fn put(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_be_bytes());
    h.update(bytes);
}

/// A body extractor whose typed value `#[idempotent]` can canonicalise into the
/// fingerprint.
///
/// Implemented for `axum::Json<T>`, `axum::Form<T>` (with `T: Serialize`) and
/// `String`. (`Bytes` and `RawForm` are fingerprinted byte for byte, and
/// `Option<B>` and `Result<B, B::Rejection>` as the `B` they hold.) Implement it for
/// your own body extractor, such as a validating JSON wrapper:
///
/// ```
/// use idem_runtime::FingerprintBody;
///
/// struct ValidJson<T>(pub T);
///
/// impl<T: serde::Serialize> FingerprintBody for ValidJson<T> {
///     type Value = T;
///     fn fingerprint_value(&self) -> &T {
///         &self.0
///     }
/// }
/// ```
///
/// Another crate's extractor cannot implement it here (the orphan rule): wrap it in
/// a type of your own, or take the body as `Bytes`, `Json<T>` or `Form<T>`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be fingerprinted as a request body",
    label = "`#[idempotent]` fingerprints this parameter as the request body",
    note = "the fingerprint takes the body's typed value: `Json<T>` or `Form<T>` (with `T: serde::Serialize`), `String`, or `Bytes` (byte for byte)",
    note = "for an extractor of your own, implement `idem_runtime::FingerprintBody` for it; for another crate's, wrap it in a type of your own",
    note = "to leave the body out of the fingerprint, write `fingerprint(ignore_body)` (with `header = \"...\"` to identify the request by its headers)"
)]
pub trait FingerprintBody {
    /// The typed value behind the extractor.
    type Value: Serialize + ?Sized;
    /// Borrows it.
    fn fingerprint_value(&self) -> &Self::Value;
}

impl<T: Serialize> FingerprintBody for axum::Json<T> {
    type Value = T;
    fn fingerprint_value(&self) -> &T {
        &self.0
    }
}

impl<T: Serialize> FingerprintBody for axum::Form<T> {
    type Value = T;
    fn fingerprint_value(&self) -> &T {
        &self.0
    }
}

impl FingerprintBody for String {
    type Value = str;
    fn fingerprint_value(&self) -> &str {
        self
    }
}

/// Canonical JSON (RFC 8785) of a value, as it is hashed into fingerprints.
///
/// One deliberate deviation: integers are written exactly. RFC 8785 reads every
/// number as an IEEE 754 double, so `9007199254740993` and `9007199254740992` would
/// canonicalise alike, and two requests for different 64-bit ids would share a
/// fingerprint. For the same reason a whole double from 2^53 up to 1e21 is written
/// as its exact integer (so `2^60` and `2^60` as a double agree, and no double
/// takes another integer's spelling). For every number up to 2^53 in magnitude,
/// for every non-integer and from 1e21 up, the output is exactly RFC 8785's.
///
/// The value is written as it serializes, without an intermediate
/// `serde_json::Value`; what it writes is what `serde_json::to_value` followed by
/// canonicalisation of that tree would (the same numbers, strings, `null`s and
/// errors; of two members with the same key, the later one), but for two
/// things the tree would lose: an integer past 64 bits, which `to_value`
/// refuses, is written exactly; and a `serde_json::value::RawValue` whose text
/// does not read as a tree without loss (a number past a double's precision,
/// a key given twice) is written as its text, less the whitespace between
/// tokens, since the handler reads that text.
///
/// # Errors
///
/// [`FingerprintError`] when the value has no JSON form (a map with non-string
/// keys).
///
/// # Limitations
///
/// A NaN or infinite float, which JSON cannot carry but a form body can
/// (`amount=inf`), is written `NaN`, `Infinity` or `-Infinity`: outside JSON,
/// so that it matches no other value (`serde_json` writes `null`, the same as
/// an absent `Option`). Do not carry amounts in floats.
pub fn canonical_json<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, FingerprintError> {
    let mut writer = Canonical {
        out: Vec::with_capacity(128),
        members: Vec::new(),
        keys: String::new(),
    };
    value.serialize(&mut writer)?;
    Ok(writer.out)
}

/// Writes canonical JSON as a value serializes.
///
/// Arrays and scalars go straight to `out`. An object's members cannot: they
/// arrive in the value's order and are written in their keys' order, so each
/// member's value is written to `out` where it comes, its key kept aside
/// (`members`, `keys`), and at the object's end the members are sorted and the
/// object written again, in order, over where its values were.
struct Canonical {
    out: Vec<u8>,
    /// The members of every object still open, innermost last: an object nested
    /// in a member's value ends (and takes its own members off) before that
    /// member is pushed.
    members: Vec<Member>,
    /// The text of map keys that are not `&'static str`, as a stack like
    /// `members`.
    keys: String,
}

#[derive(Clone, Copy)]
struct Member {
    key: KeyText,
    /// The member's canonical value is `out[value..end]`.
    value: usize,
    end: usize,
}

#[derive(Clone, Copy)]
enum KeyText {
    /// A struct's field name.
    Static(&'static str),
    /// A map key, `keys[start..end]`.
    Buffered(usize, usize),
}

impl KeyText {
    fn text<'a>(&self, keys: &'a str) -> &'a str {
        match *self {
            KeyText::Static(s) => s,
            KeyText::Buffered(start, end) => &keys[start..end],
        }
    }
}

/// RFC 8785 §3.2.3 orders properties by their UTF-16 code units. UTF-8 bytes sort
/// in code point order, and so do UTF-16 units except that U+E000–U+FFFF (one
/// unit each) sort after the supplementary planes, which UTF-16 writes as
/// surrogates (0xD800–0xDFFF). In UTF-8 those characters lead with 0xEE or 0xEF,
/// the supplementary planes with 0xF0–0xF4; at the first byte where two keys
/// differ both bytes lead a character, or both continue characters with the same
/// lead byte, so lifting 0xEE and 0xEF above 0xF4 there gives the UTF-16 order
/// without decoding.
fn utf16_order(a: &str, b: &str) -> std::cmp::Ordering {
    fn lift(byte: u8) -> u16 {
        match byte {
            0xEE | 0xEF => u16::from(byte) + 0x100,
            _ => u16::from(byte),
        }
    }
    let (a, b) = (a.as_bytes(), b.as_bytes());
    match a.iter().zip(b).position(|(x, y)| x != y) {
        Some(i) => lift(a[i]).cmp(&lift(b[i])),
        None => a.len().cmp(&b.len()),
    }
}

/// The error `serde_json::to_value` gives for the same value, by message and
/// category.
fn refused(message: &'static str) -> serde_json::Error {
    <serde_json::Error as serde::ser::Error>::custom(message)
}

/// 2^53: from here up to 1e21 a whole double is written as its exact integer.
const EXACT_FROM: f64 = 9_007_199_254_740_992.0;

impl Canonical {
    /// Integers, exactly (as `serde_json` writes them).
    fn integer(&mut self, n: impl Serialize) -> Result<(), serde_json::Error> {
        n.serialize(&mut serde_json::Serializer::new(&mut self.out))
    }

    fn float(&mut self, f: f64) {
        if !f.is_finite() {
            // JSON has no spelling for it (a form body can carry one:
            // `amount=inf`). `serde_json` writes `null`, which would make
            // `inf`, `-inf`, `NaN` and an absent `Option` one request; these
            // tokens are outside JSON, so they match nothing else.
            self.out.extend_from_slice(if f.is_nan() {
                b"NaN".as_slice()
            } else if f > 0.0 {
                b"Infinity"
            } else {
                b"-Infinity"
            });
        } else if f.fract() == 0.0 && f.abs() >= EXACT_FROM && f.abs() < 1e21 {
            // The shortest spelling RFC 8785 asks for (2^60 as
            // 1152921504606847000) is not the value, while integers are written
            // exactly: the same number as an integer and as a double would
            // differ, and an integer that is the shortest spelling would collide
            // with a double it is not. Below 2^53 both forms already agree.
            use std::io::Write as _;
            let _ = write!(self.out, "{f:.0}");
        } else {
            let mut buffer = ryu_js::Buffer::new();
            self.out
                .extend_from_slice(buffer.format_finite(f).as_bytes());
        }
    }

    /// A JSON string as `serde_json` escapes it, which is RFC 8785's escaping
    /// (two-character escapes where JSON has them, `\u00xx` in lower case for the
    /// other controls, everything else as it is).
    fn string(&mut self, s: &str) -> Result<(), serde_json::Error> {
        serde::Serializer::serialize_str(&mut serde_json::Serializer::new(&mut self.out), s)
    }

    /// Opens an object of one member whose value follows (an enum variant's).
    fn open_variant(&mut self, variant: &'static str) -> Result<(), serde_json::Error> {
        self.out.push(b'{');
        self.string(variant)?;
        self.out.push(b':');
        Ok(())
    }

    fn object(&mut self, len: Option<usize>, close_variant: bool) -> Object<'_> {
        self.members.reserve(len.unwrap_or(0));
        Object {
            start: self.out.len(),
            first: self.members.len(),
            keys_start: self.keys.len(),
            next_key: None,
            close_variant,
            w: self,
        }
    }

    fn array(&mut self, close: &'static [u8]) -> Array<'_> {
        self.out.push(b'[');
        Array {
            w: self,
            first: true,
            close,
        }
    }
}

/// A `Serializer`'s methods for the scalar types listed, each handing its
/// value to the one method of `self` named first.
macro_rules! scalars_through {
    ($write:ident: $($method:ident($scalar:ty)),* $(,)?) => {$(
        fn $method(self, v: $scalar) -> Result<(), serde_json::Error> {
            self.$write(v)
        }
    )*};
}

impl<'a> serde::Serializer for &'a mut Canonical {
    type Ok = ();
    type Error = serde_json::Error;
    type SerializeSeq = Array<'a>;
    type SerializeTuple = Array<'a>;
    type SerializeTupleStruct = Array<'a>;
    type SerializeTupleVariant = Array<'a>;
    type SerializeMap = Object<'a>;
    type SerializeStruct = Struct<'a>;
    type SerializeStructVariant = Object<'a>;

    scalars_through!(
        integer:
        serialize_i8(i8),
        serialize_i16(i16),
        serialize_i32(i32),
        serialize_i64(i64),
        serialize_u8(u8),
        serialize_u16(u16),
        serialize_u32(u32),
        serialize_u64(u64),
    );

    fn serialize_bool(self, v: bool) -> Result<(), serde_json::Error> {
        self.out
            .extend_from_slice(if v { b"true" } else { b"false" });
        Ok(())
    }

    fn serialize_i128(self, v: i128) -> Result<(), serde_json::Error> {
        // Exactly, as every integer: `serde_json::to_value` refuses one past 64
        // bits, which would make a valid request (an amount in wei) a `500`.
        self.integer(v)
    }

    fn serialize_u128(self, v: u128) -> Result<(), serde_json::Error> {
        self.integer(v)
    }

    fn serialize_f32(self, v: f32) -> Result<(), serde_json::Error> {
        // Widened, as `serde_json::Value` keeps an f32.
        self.float(f64::from(v));
        Ok(())
    }

    fn serialize_f64(self, v: f64) -> Result<(), serde_json::Error> {
        self.float(v);
        Ok(())
    }

    fn serialize_char(self, v: char) -> Result<(), serde_json::Error> {
        self.string(v.encode_utf8(&mut [0; 4]))
    }

    fn serialize_str(self, v: &str) -> Result<(), serde_json::Error> {
        self.string(v)
    }

    fn serialize_bytes(self, v: &[u8]) -> Result<(), serde_json::Error> {
        // An array of numbers, as `serde_json` writes bytes.
        let mut array = self.array(b"]");
        for byte in v {
            serde::ser::SerializeSeq::serialize_element(&mut array, byte)?;
        }
        serde::ser::SerializeSeq::end(array)
    }

    fn serialize_none(self) -> Result<(), serde_json::Error> {
        self.serialize_unit()
    }

    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), serde_json::Error> {
        value.serialize(self)
    }

    fn serialize_unit(self) -> Result<(), serde_json::Error> {
        self.out.extend_from_slice(b"null");
        Ok(())
    }

    fn serialize_unit_struct(self, _name: &'static str) -> Result<(), serde_json::Error> {
        self.serialize_unit()
    }

    fn serialize_unit_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
    ) -> Result<(), serde_json::Error> {
        self.string(variant)
    }

    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        value: &T,
    ) -> Result<(), serde_json::Error> {
        value.serialize(self)
    }

    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<(), serde_json::Error> {
        self.open_variant(variant)?;
        value.serialize(&mut *self)?;
        self.out.push(b'}');
        Ok(())
    }

    fn serialize_seq(self, _len: Option<usize>) -> Result<Array<'a>, serde_json::Error> {
        Ok(self.array(b"]"))
    }

    fn serialize_tuple(self, _len: usize) -> Result<Array<'a>, serde_json::Error> {
        Ok(self.array(b"]"))
    }

    fn serialize_tuple_struct(
        self,
        _name: &'static str,
        _len: usize,
    ) -> Result<Array<'a>, serde_json::Error> {
        Ok(self.array(b"]"))
    }

    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        _len: usize,
    ) -> Result<Array<'a>, serde_json::Error> {
        self.open_variant(variant)?;
        Ok(self.array(b"]}"))
    }

    fn serialize_map(self, len: Option<usize>) -> Result<Object<'a>, serde_json::Error> {
        Ok(self.object(len, false))
    }

    fn serialize_struct(
        self,
        name: &'static str,
        len: usize,
    ) -> Result<Struct<'a>, serde_json::Error> {
        if name == RAW_VALUE_TOKEN {
            // `serde_json::value::RawValue` (JSON text kept as it came): its
            // one field is the text (see `Struct::Raw`).
            return Ok(Struct::Raw(self, None));
        }
        if name == NUMBER_TOKEN {
            // A `serde_json::Number` where any crate in the build turned on
            // `serde_json`'s `arbitrary_precision`: its one field is its text.
            return Ok(Struct::Number(self, None));
        }
        Ok(Struct::Object(self.object(Some(len), false)))
    }

    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Object<'a>, serde_json::Error> {
        self.open_variant(variant)?;
        Ok(self.object(Some(len), true))
    }

    fn collect_str<T: fmt::Display + ?Sized>(self, value: &T) -> Result<(), serde_json::Error> {
        // `serde_json` escapes the text as it is formatted, without a `String`.
        serde::Serializer::collect_str(&mut serde_json::Serializer::new(&mut self.out), value)
    }
}

/// The name under which `serde_json::value::RawValue` serializes itself.
const RAW_VALUE_TOKEN: &str = "$serde_json::private::RawValue";

/// The name under which `serde_json::Number` serializes itself where
/// `serde_json`'s `arbitrary_precision` is on (in any crate of the build).
const NUMBER_TOKEN: &str = "$serde_json::private::Number";

/// An array being written; `close` ends it (`]`, or `]}` for a tuple variant).
struct Array<'a> {
    w: &'a mut Canonical,
    first: bool,
    close: &'static [u8],
}

impl Array<'_> {
    fn element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), serde_json::Error> {
        if !std::mem::take(&mut self.first) {
            self.w.out.push(b',');
        }
        value.serialize(&mut *self.w)
    }

    fn close(self) -> Result<(), serde_json::Error> {
        self.w.out.extend_from_slice(self.close);
        Ok(())
    }
}

/// `SerializeSeq`, `SerializeTuple`, `SerializeTupleStruct` and
/// `SerializeTupleVariant` for [`Array`]: each writes an element and closes the
/// array, under its own trait's method name (as `serde_json` stamps them).
macro_rules! array_serializers {
    ($($serializer:ident::$method:ident),* $(,)?) => {$(
        impl serde::ser::$serializer for Array<'_> {
            type Ok = ();
            type Error = serde_json::Error;
            fn $method<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), Self::Error> {
                self.element(v)
            }
            fn end(self) -> Result<(), Self::Error> {
                self.close()
            }
        }
    )*};
}

array_serializers!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field,
    SerializeTupleVariant::serialize_field,
);

/// An object being written: its values in `out` from `start`, its members in
/// `members` from `first`.
struct Object<'a> {
    w: &'a mut Canonical,
    start: usize,
    first: usize,
    keys_start: usize,
    next_key: Option<KeyText>,
    /// A struct variant's object, inside `{"Variant":…}`.
    close_variant: bool,
}

impl Object<'_> {
    fn member<T: Serialize + ?Sized>(
        &mut self,
        key: KeyText,
        value: &T,
    ) -> Result<(), serde_json::Error> {
        let start = self.w.out.len();
        value.serialize(&mut *self.w)?;
        self.w.members.push(Member {
            key,
            value: start,
            end: self.w.out.len(),
        });
        Ok(())
    }

    fn close(self) -> Result<(), serde_json::Error> {
        let Canonical { out, members, keys } = self.w;
        let object = &mut members[self.first..];
        // Stable: of members with one key, the last written stays last.
        object.sort_by(|a, b| utf16_order(a.key.text(keys), b.key.text(keys)));
        let written = out.len();
        out.push(b'{');
        let mut comma = false;
        for (i, member) in object.iter().enumerate() {
            let key = member.key.text(keys);
            // `serde_json`'s map keeps the value inserted last under a key.
            if object
                .get(i + 1)
                .is_some_and(|next| next.key.text(keys) == key)
            {
                continue;
            }
            if std::mem::replace(&mut comma, true) {
                out.push(b',');
            }
            serde::Serializer::serialize_str(&mut serde_json::Serializer::new(&mut *out), key)?;
            out.push(b':');
            out.extend_from_within(member.value..member.end);
        }
        out.push(b'}');
        if self.close_variant {
            out.push(b'}');
        }
        // The object in order replaces the values as they came.
        out.copy_within(written.., self.start);
        out.truncate(self.start + (out.len() - written));
        members.truncate(self.first);
        keys.truncate(self.keys_start);
        Ok(())
    }
}

impl serde::ser::SerializeMap for Object<'_> {
    type Ok = ();
    type Error = serde_json::Error;

    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), Self::Error> {
        let start = self.w.keys.len();
        key.serialize(MapKey {
            keys: &mut self.w.keys,
        })?;
        self.next_key = Some(KeyText::Buffered(start, self.w.keys.len()));
        Ok(())
    }

    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Self::Error> {
        let key = self
            .next_key
            .take()
            .ok_or_else(|| refused("serialize_value called before serialize_key"))?;
        self.member(key, value)
    }

    fn end(self) -> Result<(), Self::Error> {
        self.close()
    }
}

impl serde::ser::SerializeStructVariant for Object<'_> {
    type Ok = ();
    type Error = serde_json::Error;

    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), Self::Error> {
        self.member(KeyText::Static(key), value)
    }

    fn end(self) -> Result<(), Self::Error> {
        self.close()
    }
}

/// A struct: an object, or a `RawValue`'s text. The text is written as the
/// tree `serde_json` reads from it, like any other value, where that reading
/// loses nothing; else as it is, less the whitespace between its tokens (a
/// number past a double's precision, a key given twice: the handler reads the
/// text, and two texts read alike must not be one request).
///
/// A `serde_json::Number` that serializes as its text (`arbitrary_precision`)
/// is written as the number that text reads as without that feature where it
/// reads exactly, else as its text (two amounts past a double's precision
/// stay two requests).
enum Struct<'a> {
    Object(Object<'a>),
    Raw(&'a mut Canonical, Option<String>),
    Number(&'a mut Canonical, Option<String>),
}

impl serde::ser::SerializeStruct for Struct<'_> {
    type Ok = ();
    type Error = serde_json::Error;

    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), Self::Error> {
        match self {
            Struct::Object(object) => object.member(KeyText::Static(key), value),
            Struct::Raw(_, text) | Struct::Number(_, text) => {
                let _ = key;
                match value.serialize(serde_json::value::Serializer)? {
                    serde_json::Value::String(s) => {
                        *text = Some(s);
                        Ok(())
                    }
                    _ => Err(refused("a RawValue without its text")),
                }
            }
        }
    }

    fn end(self) -> Result<(), Self::Error> {
        match self {
            Struct::Object(object) => object.close(),
            Struct::Raw(w, text) => {
                let text = text.ok_or_else(|| refused("a RawValue without its text"))?;
                // A `RawValue` is read without serde_json's depth limit, a
                // tree with it: text nested past 128 levels, which the handler
                // took, is written as it came rather than failing every try.
                match raw::reads_exactly(&text)
                    .then(|| serde_json::from_str::<serde_json::Value>(&text).ok())
                    .flatten()
                {
                    Some(tree) => tree.serialize(w),
                    None => {
                        raw::minify(&text, &mut w.out);
                        Ok(())
                    }
                }
            }
            Struct::Number(w, text) => {
                let text = text.ok_or_else(|| refused("a number without its text"))?;
                if !raw::number_reads_exactly(&text) {
                    // Past a double's precision (a `Decimal` at wei, say, or
                    // `1e400`): the text itself, as a lossy `RawValue`'s.
                    w.out.extend_from_slice(text.as_bytes());
                    return Ok(());
                }
                if let Ok(u) = text.parse::<u64>() {
                    w.integer(u)
                } else if let Ok(i) = text.parse::<i64>() {
                    w.integer(i)
                } else {
                    let f = text
                        .parse::<f64>()
                        .map_err(|_| refused("a number that is not one"))?;
                    w.float(f);
                    Ok(())
                }
            }
        }
    }
}

/// Writes a map key's text as `serde_json` makes a key of it: strings, and
/// numbers, `bool`s, `char`s and unit variants as their text; nothing else.
struct MapKey<'a> {
    keys: &'a mut String,
}

impl MapKey<'_> {
    fn display(self, v: impl fmt::Display) -> Result<(), serde_json::Error> {
        use fmt::Write as _;
        write!(self.keys, "{v}").map_err(|_| refused("a map key could not be formatted"))
    }
}

fn key_must_be_a_string() -> serde_json::Error {
    refused("key must be a string")
}

impl serde::Serializer for MapKey<'_> {
    type Ok = ();
    type Error = serde_json::Error;
    type SerializeSeq = serde::ser::Impossible<(), serde_json::Error>;
    type SerializeTuple = serde::ser::Impossible<(), serde_json::Error>;
    type SerializeTupleStruct = serde::ser::Impossible<(), serde_json::Error>;
    type SerializeTupleVariant = serde::ser::Impossible<(), serde_json::Error>;
    type SerializeMap = serde::ser::Impossible<(), serde_json::Error>;
    type SerializeStruct = serde::ser::Impossible<(), serde_json::Error>;
    type SerializeStructVariant = serde::ser::Impossible<(), serde_json::Error>;

    scalars_through!(
        display:
        serialize_bool(bool),
        serialize_i8(i8),
        serialize_i16(i16),
        serialize_i32(i32),
        serialize_i64(i64),
        serialize_i128(i128),
        serialize_u8(u8),
        serialize_u16(u16),
        serialize_u32(u32),
        serialize_u64(u64),
        serialize_u128(u128),
    );

    fn serialize_f32(self, v: f32) -> Result<(), serde_json::Error> {
        if !v.is_finite() {
            return Err(refused("float key must be finite (got NaN or +/-inf)"));
        }
        // `serde_json`'s own spelling of the float (a rare key: one allocation).
        self.keys.push_str(&serde_json::to_string(&v)?);
        Ok(())
    }
    fn serialize_f64(self, v: f64) -> Result<(), serde_json::Error> {
        if !v.is_finite() {
            return Err(refused("float key must be finite (got NaN or +/-inf)"));
        }
        self.keys.push_str(&serde_json::to_string(&v)?);
        Ok(())
    }
    fn serialize_char(self, v: char) -> Result<(), serde_json::Error> {
        self.keys.push(v);
        Ok(())
    }
    fn serialize_str(self, v: &str) -> Result<(), serde_json::Error> {
        self.keys.push_str(v);
        Ok(())
    }
    fn serialize_bytes(self, _: &[u8]) -> Result<(), serde_json::Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_none(self) -> Result<(), serde_json::Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_some<T: Serialize + ?Sized>(self, _: &T) -> Result<(), serde_json::Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_unit(self) -> Result<(), serde_json::Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<(), serde_json::Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_unit_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
    ) -> Result<(), serde_json::Error> {
        self.keys.push_str(variant);
        Ok(())
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        value: &T,
    ) -> Result<(), serde_json::Error> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: &T,
    ) -> Result<(), serde_json::Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Self::SerializeSeq, serde_json::Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_tuple(self, _: usize) -> Result<Self::SerializeTuple, serde_json::Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_tuple_struct(
        self,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleStruct, serde_json::Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleVariant, serde_json::Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Self::SerializeMap, serde_json::Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_struct(
        self,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeStruct, serde_json::Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeStructVariant, serde_json::Error> {
        Err(key_must_be_a_string())
    }
    fn collect_str<T: fmt::Display + ?Sized>(self, value: &T) -> Result<(), serde_json::Error> {
        self.display(value)
    }
}

/// The canonicaliser as it was first written, through a `serde_json::Value`: the
/// oracle [`canonical_json`] is held to.
#[cfg(test)]
mod oracle {
    use super::FingerprintError;
    use serde::Serialize;

    pub(super) fn canonical_json<T: Serialize + ?Sized>(
        value: &T,
    ) -> Result<Vec<u8>, FingerprintError> {
        let tree = serde_json::to_value(value)?;
        let mut out = Vec::with_capacity(128);
        write_canonical(&tree, &mut out)?;
        Ok(out)
    }

    fn write_canonical(v: &serde_json::Value, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
        use serde_json::Value;
        match v {
            Value::Number(n) if n.is_i64() || n.is_u64() => {
                out.extend_from_slice(n.to_string().as_bytes())
            }
            // A whole double from 2^53 up to RFC 8785's switch to exponents (1e21):
            // the shortest spelling RFC 8785 asks for (2^60 as 1152921504606847000)
            // is not the value, while integers are written exactly; so the same
            // number as an integer and as a double would differ, and an integer that
            // is the shortest spelling would collide with a double it is not. Written
            // exactly instead, as its integer (below 2^53 both forms already agree).
            Value::Number(n)
                if n.as_f64().is_some_and(|f| {
                    f.is_finite()
                        && f.fract() == 0.0
                        && f.abs() >= 9_007_199_254_740_992.0
                        && f.abs() < 1e21
                }) =>
            {
                let f = n.as_f64().unwrap_or_default();
                out.extend_from_slice(format!("{f:.0}").as_bytes())
            }
            Value::Null | Value::Bool(_) | Value::Number(_) | Value::String(_) => {
                serde_jcs::to_writer(&mut *out, v)?;
            }
            Value::Array(items) => {
                out.push(b'[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    write_canonical(item, out)?;
                }
                out.push(b']');
            }
            Value::Object(map) => {
                // RFC 8785 §3.2.3: properties sorted by their UTF-16 code units.
                let mut entries: Vec<(&String, &Value)> = map.iter().collect();
                entries.sort_by(|(a, _), (b, _)| a.encode_utf16().cmp(b.encode_utf16()));
                out.push(b'{');
                for (i, (k, val)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    serde_jcs::to_writer(&mut *out, k)?;
                    out.push(b':');
                    write_canonical(val, out)?;
                }
                out.push(b'}');
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    fn base() -> FingerprintBuilder {
        FingerprintBuilder::new("t", "create-order", "POST", "/orders")
    }

    fn of_json(text: &str) -> Fingerprint {
        let v: serde_json::Value = serde_json::from_str(text).unwrap();
        base().body(&v).unwrap().finish()
    }

    #[test]
    fn key_order_and_white_space_do_not_matter() {
        assert_eq!(
            of_json(r#"{"a":1,"b":[1,2,{"y":true,"x":null}]}"#),
            of_json("{ \"b\" : [1, 2, {\"x\": null, \"y\": true}],\n \"a\": 1 }"),
        );
    }

    #[test]
    fn changed_values_matter() {
        let a = of_json(r#"{"sku":"A","amount":100}"#);
        assert_ne!(a, of_json(r#"{"sku":"A","amount":101}"#));
        assert_ne!(a, of_json(r#"{"sku":"B","amount":100}"#));
        assert_ne!(a, of_json(r#"{"sku":"A","amount":"100"}"#));
        assert_ne!(a, of_json(r#"{"sku":"A"}"#));
    }

    /// A form body can carry what JSON cannot (`amount=inf`, `amount=-inf`,
    /// `amount=NaN`, as `str::parse` reads them): each is a request of its
    /// own, and none is the request without the amount.
    #[test]
    fn non_finite_amounts_are_requests_of_their_own() {
        #[derive(Deserialize, Serialize)]
        struct Order {
            amount: Option<f64>,
        }
        let of_form = |form: &str| {
            let order: Order = serde_urlencoded::from_str(form).unwrap();
            base().body(&order).unwrap().finish()
        };
        let all = ["amount=inf", "amount=-inf", "amount=NaN", "", "amount=0"].map(of_form);
        for (i, a) in all.iter().enumerate() {
            for b in &all[..i] {
                assert_ne!(a, b);
            }
        }
        assert_eq!(of_form("amount=inf"), of_form("amount=infinity"));
    }

    #[test]
    fn equal_numbers_in_other_spellings_are_the_same() {
        assert_eq!(of_json(r#"{"n":4.50}"#), of_json(r#"{"n":4.5}"#));
        assert_eq!(of_json(r#"{"n":1E30}"#), of_json(r#"{"n":1e+30}"#));
    }

    #[derive(Serialize, Deserialize)]
    struct Order {
        sku: String,
        quantity: u32,
        #[serde(default)]
        note: Option<String>,
        #[serde(default = "one")]
        priority: u8,
    }

    fn one() -> u8 {
        1
    }

    fn of_typed(text: &str) -> Fingerprint {
        let v: Order = serde_json::from_str(text).unwrap();
        base().body(&v).unwrap().finish()
    }

    #[test]
    fn omitted_defaults_are_the_same_request() {
        let full = of_typed(r#"{"sku":"A","quantity":1,"note":null,"priority":1}"#);
        assert_eq!(full, of_typed(r#"{"sku":"A","quantity":1}"#));
        assert_eq!(
            full,
            of_typed(r#"{"quantity":1,   "sku":"A","priority":1}"#)
        );
        assert_ne!(full, of_typed(r#"{"sku":"A","quantity":1,"priority":2}"#));
        assert_ne!(full, of_typed(r#"{"sku":"A","quantity":1,"note":"gift"}"#));
    }

    /// The encoding is what stored rows were fingerprinted with: a retry after
    /// an upgrade must find the same digest. Computed independently of this code
    /// (version and scope length-prefixed, then `B` and the canonical body).
    #[test]
    fn the_encoding_is_pinned() {
        let fp = FingerprintBuilder::new("acme", "create-order", "POST", "/orders")
            .body(&serde_json::json!({"sku": "A", "qty": 1}))
            .unwrap()
            .finish();
        assert_eq!(
            hex::encode(fp.as_bytes()),
            "ec0bfa9fcda1f8f9a0a8c67908dbba74739c50497c0e3fea390070dea5911013"
        );
    }

    #[test]
    fn scope_is_part_of_the_fingerprint() {
        let body = serde_json::json!({"a": 1});
        let f = |t, o, m, r| {
            FingerprintBuilder::new(t, o, m, r)
                .body(&body)
                .unwrap()
                .finish()
        };
        let a = f("t", "op", "POST", "/x");
        assert_ne!(a, f("u", "op", "POST", "/x"));
        assert_ne!(a, f("t", "op2", "POST", "/x"));
        assert_ne!(a, f("t", "op", "PUT", "/x"));
        assert_ne!(a, f("t", "op", "POST", "/y"));
    }

    #[test]
    fn absent_and_empty_headers_differ_and_values_count() {
        let mut h = HeaderMap::new();
        let absent = base().header("x-currency", &h).finish();
        h.insert("x-currency", "".parse().unwrap());
        let empty = base().header("x-currency", &h).finish();
        h.insert("x-currency", "EUR".parse().unwrap());
        let eur = base().header("X-Currency", &h).finish();
        h.insert("x-currency", "USD".parse().unwrap());
        let usd = base().header("x-currency", &h).finish();
        assert_ne!(absent, empty);
        assert_ne!(empty, eur);
        assert_ne!(eur, usd);
        // Header names are case-insensitive.
        assert_eq!(usd, base().header("X-CURRENCY", &h).finish());
    }

    #[test]
    fn a_header_on_several_lines_is_those_lines_combined() {
        let combined = |name: &str, lines: &[&str]| {
            let mut h = HeaderMap::new();
            for line in lines {
                h.append(
                    axum::http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                    line.parse().unwrap(),
                );
            }
            base().header(name, &h).finish()
        };
        assert_eq!(
            combined("x-tags", &["a", "b"]),
            combined("x-tags", &["a, b"])
        );
        assert_eq!(
            combined("cookie", &["a=1", "b=2"]),
            combined("cookie", &["a=1; b=2"])
        );
        // The order of the lines and what they hold still count.
        assert_ne!(
            combined("x-tags", &["a", "b"]),
            combined("x-tags", &["b", "a"])
        );
        assert_ne!(
            combined("x-tags", &["a", "b"]),
            combined("x-tags", &["a", "c"])
        );
        assert_ne!(combined("x-tags", &["a", ""]), combined("x-tags", &["a"]));
    }

    /// A header on one line is encoded as it always was (computed
    /// independently: `H`, the name, `+`, a count of 1, the value, each
    /// length-prefixed as in `the_encoding_is_pinned`), so combining
    /// several lines changed no stored digest of a header sent on one.
    #[test]
    fn a_header_on_one_line_fingerprints_as_before() {
        let mut h = HeaderMap::new();
        h.insert("x-currency", "EUR".parse().unwrap());
        let fp = FingerprintBuilder::new("acme", "create-order", "POST", "/orders")
            .header("x-currency", &h)
            .finish();
        assert_eq!(
            hex::encode(fp.as_bytes()),
            "ab3fd9895abc7f2a47772d49da34713d0488c77e774297c29081884ebe1ce6a8"
        );
    }

    #[test]
    fn order_of_parts_does_not_matter_but_boundaries_do() {
        let mut h = HeaderMap::new();
        h.insert("a", "1".parse().unwrap());
        h.insert("b", "2".parse().unwrap());
        let ab = base().header("a", &h).header("b", &h).finish();
        let ba = base().header("b", &h).header("a", &h).finish();
        assert_eq!(ab, ba);
        assert_ne!(
            base().extra("ab", "c").finish(),
            base().extra("a", "bc").finish()
        );
    }

    /// The runtime's borrowed names hash as the public builder's copied ones,
    /// and sort among other parts alike.
    #[test]
    fn a_static_extra_is_the_same_part_as_an_extra() {
        let copied = base()
            .extra("path", "/o/1")
            .extra("zz", "1")
            .extra("query", "a=1");
        let borrowed = base()
            .extra("zz", "1")
            .extra_static("query", "a=1")
            .extra_static("path", "/o/1");
        assert_eq!(copied.finish(), borrowed.finish());
    }

    /// A handler that takes a `RawValue` reads its text: two texts that
    /// `serde_json` reads as one tree (a number past a double's precision, a
    /// key given twice) are two requests; spellings of one value are one.
    #[test]
    fn raw_values_that_read_alike_are_not_one_request() {
        #[derive(Serialize)]
        struct Forwarded {
            amount: Box<serde_json::value::RawValue>,
        }
        let c = |text: &str| {
            let amount = serde_json::value::RawValue::from_string(text.to_owned()).unwrap();
            String::from_utf8(canonical_json(&Forwarded { amount }).unwrap()).unwrap()
        };
        assert_ne!(c("1.000000000000000001"), c("1.000000000000000002"));
        assert_ne!(c("20000000000000000001"), c("20000000000000000000"));
        assert_ne!(c(r#"{"a":10,"a":100}"#), c(r#"{"a":100}"#));
        assert_eq!(
            c(" { \"x\" : [ 1.000000000000000001 ] } "),
            r#"{"amount":{"x":[1.000000000000000001]}}"#,
            "written as it came, less whitespace"
        );
        assert_eq!(
            c(r#" { "b" : 1.50, "a" : 1E2 } "#),
            c(r#"{"a":100,"b":1.5}"#)
        );
        assert_eq!(c(r#"{"b":1.5,"a":100}"#), r#"{"amount":{"a":100,"b":1.5}}"#);
        // A lone surrogate (a string cut inside an emoji) is text a
        // `RawValue` takes and a `Value` refuses: written as it came, not a
        // fingerprint failure (a 500 on every retry).
        assert_eq!(
            c(r#"{ "memo" : "\ud83d" }"#),
            r#"{"amount":{"memo":"\ud83d"}}"#
        );
        assert_ne!(c(r#""\ud83d""#), c(r#""\ud83e""#));
        // Nested past serde_json's depth limit for a tree (128), which a
        // `RawValue` is read without: written as it came, not a failure.
        let deep = |leaf: &str| format!("{}{leaf}{}", "[ ".repeat(200), " ]".repeat(200));
        assert_eq!(
            c(&deep("1")),
            format!(r#"{{"amount":{}1{}}}"#, "[".repeat(200), "]".repeat(200))
        );
        assert_ne!(c(&deep("1")), c(&deep("2")));
    }

    /// `serde_json::Number` as it serializes where a crate of the build turns
    /// on `arbitrary_precision`: a struct of one field, its text.
    struct PreciseNumber(&'static str);

    impl Serialize for PreciseNumber {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            use serde::ser::SerializeStruct as _;
            let mut st = s.serialize_struct(NUMBER_TOKEN, 1)?;
            st.serialize_field(NUMBER_TOKEN, self.0)?;
            st.end()
        }
    }

    #[test]
    fn a_number_kept_as_its_text_is_written_as_the_number_it_reads_as_where_exact() {
        for (text, plain) in [
            ("1.50", serde_json::json!(1.5)),
            ("15e-1", serde_json::json!(1.5)),
            ("18446744073709551615", serde_json::json!(u64::MAX)),
            ("-42", serde_json::json!(-42)),
            (
                "1152921504606846976.0",
                serde_json::json!(1_152_921_504_606_846_976.0_f64),
            ),
        ] {
            assert_eq!(
                canonical_json(&PreciseNumber(text)).unwrap(),
                canonical_json(&plain).unwrap(),
                "{text}"
            );
        }
        // Past a double's precision: two numbers stay two, and none is `null`.
        let c = |text| String::from_utf8(canonical_json(&PreciseNumber(text)).unwrap()).unwrap();
        assert_ne!(c("1.000000000000000001"), c("1.000000000000000002"));
        assert_ne!(c("18446744073709551617"), c("18446744073709551616"));
        assert_eq!(c("1e400"), "1e400");
    }

    #[test]
    fn integers_past_64_bits_are_written_exactly() {
        let past = u128::from(u64::MAX) + 1;
        assert_eq!(canonical_json(&past).unwrap(), b"18446744073709551616");
        assert_eq!(
            canonical_json(&i128::MIN).unwrap(),
            b"-170141183460469231731687303715884105728"
        );
        assert_ne!(
            canonical_json(&past).unwrap(),
            canonical_json(&(past + 1)).unwrap()
        );
        // Within 64 bits as before.
        assert_eq!(
            canonical_json(&7_u128).unwrap(),
            canonical_json(&7_u64).unwrap()
        );
        assert_eq!(
            canonical_json(&-7_i128).unwrap(),
            canonical_json(&-7_i64).unwrap()
        );
    }

    #[test]
    fn integers_beyond_two_to_the_53_stay_distinct() {
        let a = of_json(r#"{"order_id":1234567890123456789}"#);
        let b = of_json(r#"{"order_id":1234567890123456788}"#);
        assert_ne!(a, b);
        assert_eq!(
            canonical_json(&serde_json::json!({"id": u64::MAX, "neg": i64::MIN, "n": -5})).unwrap(),
            br#"{"id":18446744073709551615,"n":-5,"neg":-9223372036854775808}"#
        );
        // Within 2^53 an integer and the equal double are the same number.
        assert_eq!(of_json(r#"{"n":4}"#), of_json(r#"{"n":4.0}"#));
    }

    #[test]
    fn raw_bodies_count_every_byte_and_differ_from_typed_ones() {
        let raw = |b: &[u8]| base().raw_body(b).finish();
        assert_eq!(raw(b"abc"), raw(b"abc"));
        assert_ne!(raw(b"abc"), raw(b"abc "));
        assert_ne!(raw(b""), base().finish(), "an empty body is still a body");
        // The same text as a typed `String` body is another part.
        assert_ne!(raw(b"\"abc\""), base().body("abc").unwrap().finish());
    }

    #[test]
    fn non_json_values_are_errors_not_panics() {
        let mut m = std::collections::HashMap::new();
        m.insert((1, 2), "tuple keys have no JSON form");
        assert!(base().body(&m).is_err());
    }

    /// RFC 8785 §3.2.2: the sample input and its canonical form.
    #[test]
    fn rfc8785_sample() {
        let input = r#"{
          "numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
          "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
          "literals": [null, true, false]
        }"#;
        let v: serde_json::Value = serde_json::from_str(input).unwrap();
        let out = String::from_utf8(canonical_json(&v).unwrap()).unwrap();
        assert_eq!(
            out,
            r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#
        );
    }

    /// RFC 8785 §3.2.3: properties sort by UTF-16 code units, not by UTF-8 bytes.
    #[test]
    fn rfc8785_property_sorting() {
        let input = r#"{
          "\u20ac": "Euro Sign",
          "\r": "Carriage Return",
          "\ufb33": "Hebrew Letter Dalet With Dagesh",
          "1": "One",
          "\ud83d\ude00": "Emoji: Grinning Face",
          "\u0080": "Control",
          "\u00f6": "Latin Small Letter O With Diaeresis"
        }"#;
        let v: serde_json::Value = serde_json::from_str(input).unwrap();
        let out = String::from_utf8(canonical_json(&v).unwrap()).unwrap();
        let order: Vec<&str> = [
            "Carriage Return",
            "One",
            "Control",
            "Latin Small Letter O With Diaeresis",
            "Euro Sign",
            "Emoji: Grinning Face",
            "Hebrew Letter Dalet With Dagesh",
        ]
        .to_vec();
        let positions: Vec<usize> = order.iter().map(|s| out.find(s).unwrap()).collect();
        let mut sorted = positions.clone();
        sorted.sort();
        assert_eq!(positions, sorted, "{out}");
    }

    /// RFC 8785 Appendix B: number serialisation (ECMAScript rules).
    #[test]
    fn rfc8785_numbers() {
        for (bits, expected) in [
            (0x0000000000000000u64, "0"),
            (0x8000000000000000, "0"),
            (0x0000000000000001, "5e-324"),
            (0x8000000000000001, "-5e-324"),
            (0x7fefffffffffffff, "1.7976931348623157e+308"),
            (0xffefffffffffffff, "-1.7976931348623157e+308"),
            (0x4340000000000000, "9007199254740992"),
            (0xc340000000000000, "-9007199254740992"),
            // Whole doubles from 2^53 up to 1e21 are written exactly, as integers
            // are, where RFC 8785 writes the shortest spelling
            // ("295147905179352830000"): the same number must fingerprint alike
            // as an integer and as a double, and no double may take another
            // integer's spelling.
            (0x4430000000000000, "295147905179352825856"),
            (0x44b52d02c7e14af5, "9.999999999999997e+22"),
            (0x44b52d02c7e14af6, "1e+23"),
            (0x44b52d02c7e14af7, "1.0000000000000001e+23"),
            (0x444b1ae4d6e2ef4e, "999999999999999737856"),
            (0x444b1ae4d6e2ef4f, "999999999999999868928"),
            (0x444b1ae4d6e2ef50, "1e+21"),
            (0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"),
            (0x3eb0c6f7a0b5ed8d, "0.000001"),
            (0x41b3de4355555553, "333333333.3333332"),
            (0x41b3de4355555554, "333333333.33333325"),
            (0x41b3de4355555555, "333333333.3333333"),
            (0x41b3de4355555556, "333333333.3333334"),
            (0x41b3de4355555557, "333333333.33333343"),
            (0xbecbf647612f3696, "-0.0000033333333333333333"),
            (0x43143ff3c1cb0959, "1424953923781206.2"),
        ] {
            let out = String::from_utf8(canonical_json(&f64::from_bits(bits)).unwrap()).unwrap();
            assert_eq!(out, expected, "{bits:#x}");
        }
    }

    // --- the writer held to the oracle --------------------------------------------
    //
    // Seeded: each test prints its seed; `IDEM_TEST_SEED=<seed>` repeats a run,
    // `IDEM_TEST_CASES` runs more cases.

    use serde_json::Value;
    use serde_json::value::RawValue;
    use std::collections::BTreeMap;

    /// Runs `case` `IDEM_TEST_CASES` times (2000 unless set), times `times`, on
    /// one generator seeded from `IDEM_TEST_SEED` (random unless set, and
    /// printed, so that a failure can be repeated).
    fn each_case(test: &str, times: usize, mut case: impl FnMut(&mut fastrand::Rng)) {
        let seed = std::env::var("IDEM_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| fastrand::u64(..));
        println!("{test}: seed {seed} (IDEM_TEST_SEED={seed} repeats it)");
        let mut rng = fastrand::Rng::with_seed(seed);
        let cases: usize = std::env::var("IDEM_TEST_CASES")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(2000);
        for _ in 0..cases * times {
            case(&mut rng);
        }
    }

    /// The same bytes as the oracle, or an error with the same message.
    #[track_caller]
    fn same_as_oracle<T: Serialize + ?Sized + fmt::Debug>(value: &T) {
        let written = canonical_json(value).map_err(|e| e.to_string());
        let oracle = oracle::canonical_json(value).map_err(|e| e.to_string());
        let text = |r: Result<Vec<u8>, String>| r.map(|b| String::from_utf8(b).unwrap());
        // The oracle's tree holds a NaN or infinite float as `null`; the
        // writer spells each (`float`), and is otherwise the oracle.
        assert_eq!(
            text(written).map(|t| non_finite_as_null(&t)),
            text(oracle),
            "{value:?}"
        );
    }

    /// `text` (canonical JSON but for `NaN`, `Infinity` and `-Infinity`)
    /// with those tokens, outside strings, written `null`.
    fn non_finite_as_null(text: &str) -> String {
        let mut out = String::with_capacity(text.len());
        let (mut in_string, mut escaped) = (false, false);
        let mut rest = text;
        while let Some(c) = rest.chars().next() {
            if !in_string {
                if let Some(token) = ["-Infinity", "Infinity", "NaN"]
                    .into_iter()
                    .find(|t| rest.starts_with(t))
                {
                    out.push_str("null");
                    rest = &rest[token.len()..];
                    continue;
                }
                in_string = c == '"';
            } else if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
        out
    }

    /// Characters where escaping and the UTF-16 order have edges: every control,
    /// what JSON escapes, the last of the BMP before the surrogates and the first
    /// after, the private use area and U+FFFF (which sort after the supplementary
    /// planes in UTF-16, before them in UTF-8), and astral characters.
    const EDGES: &[char] = &[
        'a',
        'b',
        'Z',
        '0',
        '1',
        ' ',
        '"',
        '\\',
        '/',
        '\u{7f}',
        '\u{80}',
        'é',
        'ö',
        '€',
        '\u{2028}',
        '\u{d7ff}',
        '\u{e000}',
        '\u{fb33}',
        '\u{fffd}',
        '\u{ffff}',
        '😀',
        '𝄞',
        '\u{10000}',
        '\u{10ffff}',
    ];

    fn char_of(rng: &mut fastrand::Rng) -> char {
        match rng.u8(..10) {
            0 => char::from(rng.u8(..0x20)),
            1 => rng.char(..),
            _ => EDGES[rng.usize(..EDGES.len())],
        }
    }

    fn text(rng: &mut fastrand::Rng, max: usize) -> String {
        (0..rng.usize(0..=max)).map(|_| char_of(rng)).collect()
    }

    /// Short keys from a few characters, so that keys share prefixes and differ
    /// where the orders do.
    fn key(rng: &mut fastrand::Rng) -> String {
        const KEY: &[char] = &['a', 'b', '\n', '"', 'é', '\u{e000}', '\u{ffff}', '😀'];
        (0..rng.usize(0..4))
            .map(|_| KEY[rng.usize(..KEY.len())])
            .collect()
    }

    fn float(rng: &mut fastrand::Rng) -> f64 {
        let f = match rng.u8(..9) {
            0 => f64::from_bits(rng.u64(..)),
            // Whole doubles from 2^53 up to 1e21 and beyond, written exactly up to 1e21.
            1 => (2f64).powi(rng.i32(50..75)) * if rng.bool() { 1.0 } else { -3.0 },
            2 => (rng.u64(1 << 53..) as f64) * f64::from(rng.u32(1..100_000)),
            3 => {
                let edge = [1e21, 9_007_199_254_740_992.0, 1e-7, 1e-6, 5e-324];
                let f: f64 = edge[rng.usize(..edge.len())];
                f64::from_bits(f.to_bits().wrapping_add(rng.u64(..3)).wrapping_sub(1))
            }
            4 => -0.0,
            5 => f64::from(rng.i32(..)) / 8.0,
            6 => rng.f64() * 10f64.powi(rng.i32(-30..30)),
            7 => [f64::NAN, f64::INFINITY, f64::NEG_INFINITY][rng.usize(..3)],
            _ => rng.f64() * 1e6 - 5e5,
        };
        if rng.bool() { f } else { -f }
    }

    fn number(rng: &mut fastrand::Rng) -> Value {
        match rng.u8(..6) {
            0 => Value::from(rng.i64(..)),
            1 => Value::from(rng.u64(..)),
            2 => Value::from(rng.i64(-1000..1000)),
            3 => {
                let edge = [1i128 << 53, (1 << 53) + 1, i64::MIN.into(), u64::MAX.into()];
                let n = edge[rng.usize(..edge.len())] - i128::from(rng.u8(..2));
                let n = if rng.bool() { n } else { -n };
                serde_json::to_value(n).unwrap_or(Value::Null)
            }
            _ => serde_json::Number::from_f64(float(rng))
                .map(Value::Number)
                .unwrap_or(Value::Null),
        }
    }

    fn value(rng: &mut fastrand::Rng, depth: usize) -> Value {
        match rng.u8(..if depth == 0 { 5 } else { 8 }) {
            0 => Value::Null,
            1 => Value::Bool(rng.bool()),
            2 => number(rng),
            3 | 4 => Value::String(text(rng, 8)),
            5 => Value::Array(
                (0..rng.usize(0..5))
                    .map(|_| value(rng, depth - 1))
                    .collect(),
            ),
            _ => Value::Object(
                (0..rng.usize(0..6))
                    .map(|_| (key(rng), value(rng, depth - 1)))
                    .collect(),
            ),
        }
    }

    #[test]
    fn json_values_are_written_as_the_oracle_writes_them() {
        each_case("JSON values against the oracle", 1, |rng| {
            same_as_oracle(&value(rng, 4));
        });
    }

    #[test]
    fn scalars_are_written_as_the_oracle_writes_them() {
        each_case("scalars against the oracle", 1, |rng| {
            let f = float(rng);
            same_as_oracle(&f);
            same_as_oracle(&(f as f32));
            same_as_oracle(&f32::from_bits(rng.u32(..)));
            same_as_oracle(&rng.i64(..));
            same_as_oracle(&rng.u64(..));
            same_as_oracle(&(rng.i8(..), rng.u16(..), rng.i32(..)));
            // Within i64 or u64 as the oracle; beyond them (which its tree
            // refuses) the integer's own digits.
            let wide = i128::from(rng.i64(..)) * i128::from(rng.i32(..));
            let unsigned = u128::from(rng.u64(..)) * u128::from(rng.u8(..4));
            if i64::try_from(wide).is_ok() || u64::try_from(wide).is_ok() {
                same_as_oracle(&wide);
            } else {
                assert_eq!(canonical_json(&wide).unwrap(), wide.to_string().as_bytes());
            }
            if u64::try_from(unsigned).is_ok() {
                same_as_oracle(&unsigned);
            } else {
                assert_eq!(
                    canonical_json(&unsigned).unwrap(),
                    unsigned.to_string().as_bytes()
                );
            }
            same_as_oracle(&char_of(rng));
            same_as_oracle(&text(rng, 12));
        });
    }

    /// A map as the value's `Serialize` writes it: any keys, in any order, the
    /// same key more than once.
    #[derive(Debug)]
    struct Entries(Vec<(MapKey, Value)>);

    #[derive(Debug, Clone, Serialize)]
    enum Variant {
        Plain,
        Other,
    }

    #[derive(Debug, Clone, Serialize)]
    struct Id(String);

    /// Every kind of map key `serde_json` takes, and some it refuses.
    #[derive(Debug, Clone)]
    enum MapKey {
        Str(String),
        Char(char),
        Bool(bool),
        Int(i64),
        Wide(i128),
        Unsigned(u128),
        Float(f64),
        Single(f32),
        Variant(Variant),
        Newtype(Id),
        Shown(Shown),
        Unit,
        Missing(Option<String>),
        Pair((u8, u8)),
    }

    impl Serialize for MapKey {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            match self {
                MapKey::Str(v) => v.serialize(s),
                MapKey::Char(v) => v.serialize(s),
                MapKey::Bool(v) => v.serialize(s),
                MapKey::Int(v) => v.serialize(s),
                MapKey::Wide(v) => v.serialize(s),
                MapKey::Unsigned(v) => v.serialize(s),
                MapKey::Float(v) => v.serialize(s),
                MapKey::Single(v) => v.serialize(s),
                MapKey::Variant(v) => v.serialize(s),
                MapKey::Newtype(v) => v.serialize(s),
                MapKey::Shown(v) => v.serialize(s),
                MapKey::Unit => ().serialize(s),
                MapKey::Missing(v) => v.serialize(s),
                MapKey::Pair(v) => v.serialize(s),
            }
        }
    }

    impl Serialize for Entries {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            use serde::ser::SerializeMap;
            let mut map = s.serialize_map(Some(self.0.len()))?;
            for (k, v) in &self.0 {
                map.serialize_entry(k, v)?;
            }
            map.end()
        }
    }

    /// Text given by `Display`, in pieces (`collect_str`).
    #[derive(Debug, Clone)]
    struct Shown(String, String);

    impl fmt::Display for Shown {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "{}{}", self.0, self.1)
        }
    }

    impl Serialize for Shown {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.collect_str(self)
        }
    }

    /// Bytes as `serialize_bytes`.
    #[derive(Debug)]
    struct Bytes(Vec<u8>);

    impl Serialize for Bytes {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_bytes(&self.0)
        }
    }

    fn map_key(rng: &mut fastrand::Rng) -> MapKey {
        match rng.u8(..16) {
            0 => MapKey::Char(char_of(rng)),
            1 => MapKey::Bool(rng.bool()),
            2 => MapKey::Int(rng.i64(-20..20)),
            3 => MapKey::Wide(i128::from(rng.i64(..)) * i128::from(rng.i64(..))),
            4 => MapKey::Unsigned(u128::from(rng.u64(..)) << rng.u32(..64)),
            5 => MapKey::Float(float(rng)),
            6 => MapKey::Single(float(rng) as f32),
            7 => MapKey::Variant([Variant::Plain, Variant::Other][rng.usize(..2)].clone()),
            8 => MapKey::Newtype(Id(key(rng))),
            9 => MapKey::Shown(Shown(key(rng), key(rng))),
            10 if rng.u8(..8) == 0 => MapKey::Unit,
            11 if rng.u8(..8) == 0 => MapKey::Missing(Some(key(rng))),
            12 if rng.u8(..8) == 0 => MapKey::Pair((1, 2)),
            // Numbers and their text collide: `1` and `"1"` are one key.
            13 => MapKey::Str(rng.i64(-20..20).to_string()),
            _ => MapKey::Str(key(rng)),
        }
    }

    #[test]
    fn maps_with_any_keys_are_written_as_the_oracle_writes_them() {
        each_case("maps against the oracle", 1, |rng| {
            let entries = (0..rng.usize(0..8))
                .map(|_| (map_key(rng), value(rng, 1)))
                .collect();
            same_as_oracle(&Entries(entries));
        });
    }

    #[derive(Debug, Serialize)]
    enum Kind {
        Unit,
        Newtype(String),
        Tuple(i8, f64),
        Struct { b: Option<String>, a: u32 },
    }

    #[derive(Debug, Serialize)]
    struct Unit;

    #[derive(Debug, Serialize)]
    struct Wrapped(u16);

    #[derive(Debug, Serialize)]
    struct Typed {
        id: u64,
        #[serde(skip_serializing_if = "Option::is_none")]
        note: Option<String>,
        maybe: Option<i32>,
        amount: f64,
        small: f32,
        wide: i128,
        flag: bool,
        letter: char,
        nothing: (),
        unit: Unit,
        wrapped: Wrapped,
        pair: (u8, String),
        tags: Vec<String>,
        kind: Kind,
        kinds: Vec<Kind>,
        by_number: BTreeMap<i32, bool>,
        bytes: Bytes,
        shown: Shown,
        raw: Box<RawValue>,
        #[serde(rename = "Ünïcode key")]
        renamed: String,
        nested: Option<Box<Typed>>,
        // Flattened, the struct is written as a map, and these keys may repeat
        // its fields'.
        #[serde(flatten)]
        extra: BTreeMap<String, Value>,
    }

    fn kind(rng: &mut fastrand::Rng) -> Kind {
        match rng.u8(..4) {
            0 => Kind::Unit,
            1 => Kind::Newtype(text(rng, 4)),
            2 => Kind::Tuple(rng.i8(..), float(rng)),
            _ => Kind::Struct {
                b: rng.bool().then(|| text(rng, 3)),
                a: rng.u32(..),
            },
        }
    }

    fn typed(rng: &mut fastrand::Rng, depth: usize) -> Typed {
        const FIELDS: &[&str] = &["id", "note", "amount", "zzz", "a", "Ünïcode key"];
        let fixed = r#" { "b" : 1.50, "a" : [ 1E2, -0.0, 18446744073709551615, "\u00e9" ] } "#;
        let raw = match rng.u8(..3) {
            0 => fixed.to_owned(),
            1 => serde_json::to_string_pretty(&value(rng, 2)).unwrap(),
            _ => serde_json::to_string(&value(rng, 2)).unwrap(),
        };
        // The oracle reads a `RawValue` through a tree, as the fingerprint does
        // only where that loses nothing (`serde_json` spells a whole double
        // past 2^53 shortest, `1.152921504606847e18`, which is not its value):
        // the others are `raw`'s own tests'.
        let raw = if raw::reads_exactly(&raw) {
            raw
        } else {
            fixed.to_owned()
        };
        Typed {
            id: rng.u64(..),
            note: rng.bool().then(|| text(rng, 6)),
            maybe: rng.bool().then(|| rng.i32(..)),
            amount: float(rng),
            small: float(rng) as f32,
            // Within 64 bits: the oracle's tree refuses wider integers, which
            // the fingerprint writes exactly (`integers_past_64_bits_are_written_exactly`).
            wide: i128::from(rng.i64(..)),
            flag: rng.bool(),
            letter: char_of(rng),
            nothing: (),
            unit: Unit,
            wrapped: Wrapped(rng.u16(..)),
            pair: (rng.u8(..), text(rng, 3)),
            tags: (0..rng.usize(0..3)).map(|_| text(rng, 4)).collect(),
            kind: kind(rng),
            kinds: (0..rng.usize(0..3)).map(|_| kind(rng)).collect(),
            by_number: (0..rng.usize(0..4))
                .map(|_| (rng.i32(-5..5), rng.bool()))
                .collect(),
            bytes: Bytes((0..rng.usize(0..4)).map(|_| rng.u8(..)).collect()),
            shown: Shown(text(rng, 3), text(rng, 3)),
            raw: RawValue::from_string(raw).unwrap(),
            renamed: text(rng, 3),
            nested: (depth > 0 && rng.bool()).then(|| Box::new(typed(rng, depth - 1))),
            extra: (0..rng.usize(0..3))
                .map(|_| {
                    let k = if rng.bool() {
                        FIELDS[rng.usize(..FIELDS.len())].to_owned()
                    } else {
                        key(rng)
                    };
                    (k, value(rng, 1))
                })
                .collect(),
        }
    }

    #[test]
    fn typed_values_are_written_as_the_oracle_writes_them() {
        each_case("typed values against the oracle", 1, |rng| {
            same_as_oracle(&typed(rng, 2));
        });
    }

    #[test]
    fn what_has_no_json_form_is_refused_as_the_oracle_refuses_it() {
        let mut tuple_keys = std::collections::HashMap::new();
        tuple_keys.insert((1, 2), "tuple keys have no JSON form");
        same_as_oracle(&tuple_keys);
        assert!(canonical_json(&tuple_keys).is_err());
        for key in [
            MapKey::Float(f64::NAN),
            MapKey::Single(f32::INFINITY),
            MapKey::Unit,
            MapKey::Missing(None),
            MapKey::Pair((0, 0)),
        ] {
            let entries = Entries(vec![
                (MapKey::Str("a".into()), Value::Null),
                (key, Value::Null),
            ]);
            same_as_oracle(&entries);
            assert!(canonical_json(&entries).is_err(), "{entries:?}");
        }
        // Integers past 64 bits, which the oracle's tree refuses, have a JSON
        // form: `integers_past_64_bits_are_written_exactly`.
        // Not an error, and not `null` (as `serde_json` writes them): each its
        // own token outside JSON, so that `inf`, `-inf`, `NaN` and an absent
        // value are four requests.
        assert_eq!(
            canonical_json(&[f64::NAN, -f64::NAN, f64::INFINITY, f64::NEG_INFINITY]).unwrap(),
            b"[NaN,NaN,Infinity,-Infinity]"
        );
        assert_eq!(
            canonical_json(&[Some(f32::INFINITY), None]).unwrap(),
            b"[Infinity,null]"
        );
        same_as_oracle(&[f64::NAN, f64::INFINITY]);
    }

    #[test]
    fn a_repeated_key_keeps_its_last_value() {
        let entries = Entries(vec![
            (MapKey::Str("b".into()), Value::from(1)),
            (MapKey::Int(1), Value::from("number")),
            (MapKey::Str("b".into()), Value::from(2)),
            (MapKey::Str("1".into()), Value::from("text")),
            (MapKey::Str("a".into()), Value::from(3)),
        ]);
        same_as_oracle(&entries);
        assert_eq!(
            canonical_json(&entries).unwrap(),
            br#"{"1":"text","a":3,"b":2}"#
        );
    }

    #[test]
    fn utf16_order_is_the_order_of_code_units() {
        each_case("UTF-16 order", 10, |rng| {
            let (a, b) = (text(rng, 4), text(rng, 4));
            assert_eq!(
                utf16_order(&a, &b),
                a.encode_utf16().cmp(b.encode_utf16()),
                "{a:?} {b:?}"
            );
        });
    }
}
