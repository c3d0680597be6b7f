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
/// or a float that is NaN or infinite, which JSON cannot represent).
#[derive(Debug, thiserror::Error)]
#[error("the request body cannot be encoded as canonical JSON: {0}")]
pub struct FingerprintError(#[from] serde_json::Error);

#[derive(PartialEq, Eq, PartialOrd, Ord)]
enum Part {
    Header {
        name: String,
        values: Option<Vec<Vec<u8>>>,
    },
    Body(Vec<u8>),
    BodyField {
        path: String,
        json: Vec<u8>,
    },
    Extra {
        name: String,
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
    pub fn header(mut self, name: &str, headers: &HeaderMap) -> Self {
        let name = name.to_ascii_lowercase();
        let values: Vec<Vec<u8>> = headers
            .get_all(name.as_str())
            .iter()
            .map(|v| v.as_bytes().to_vec())
            .collect();
        let values = (!values.is_empty()).then_some(values);
        self.parts.push(Part::Header { name, values });
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
            name: name.to_owned(),
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
                Part::Header { name, values } => {
                    h.update(b"H");
                    put(&mut h, name.as_bytes());
                    match values {
                        None => h.update(b"-"),
                        Some(values) => {
                            h.update(b"+");
                            h.update((values.len() as u64).to_be_bytes());
                            for v in values {
                                put(&mut h, v);
                            }
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
/// # Errors
///
/// [`FingerprintError`] when the value has no JSON form (a map with non-string
/// keys).
///
/// # Limitations
///
/// A NaN or infinite float becomes `null`, as in `serde_json`: JSON bodies cannot
/// carry one, but a form body can (`amount=inf`). Do not carry amounts in floats.
pub fn canonical_json<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, FingerprintError> {
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
}
