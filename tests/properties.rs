//! Seeded property tests of what parses untrusted input: the `Idempotency-Key`
//! header, canonical JSON for fingerprints, and problem documents. Each test
//! prints its seed; `IDEM_TEST_SEED=<seed>` repeats a run, `IDEM_TEST_CASES`
//! runs more cases (the default keeps `cargo test` quick).

use std::time::Duration;

use axum::http::StatusCode;
use axum::response::IntoResponse;
use http_body_util::BodyExt;
use idem_runtime::fingerprint::canonical_json;
use idem_runtime::{FingerprintBuilder, IdempotencyKey, Problem};
use serde_json::Value;

mod common;
use common::respell::respell;

fn rng(test: &str) -> fastrand::Rng {
    let seed = std::env::var("IDEM_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..));
    println!("{test}: seed {seed} (IDEM_TEST_SEED={seed} repeats it)");
    fastrand::Rng::with_seed(seed)
}

fn cases() -> usize {
    std::env::var("IDEM_TEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(500)
}

// --- keys ---------------------------------------------------------------------

/// Printable ASCII, spaces included.
fn printable(rng: &mut fastrand::Rng, max: usize) -> String {
    let n = rng.usize(1..=max);
    (0..n).map(|_| rng.u8(0x20..=0x7e) as char).collect()
}

#[test]
fn any_key_written_as_a_structured_string_reads_back_as_itself() {
    let mut rng = rng("structured keys");
    for _ in 0..cases() {
        let key = printable(&mut rng, 60).trim().to_owned();
        if key.is_empty() {
            continue;
        }
        let quoted = format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""));
        let parsed = IdempotencyKey::parse(&quoted)
            .unwrap_or_else(|e| panic!("{quoted:?} was refused: {e}"));
        assert_eq!(parsed.as_str(), key, "{quoted:?}");
        // A bare token of the same characters is the same key, where one is allowed
        // (a value that starts with a quote is read as a structured string).
        if key.starts_with('"') {
            continue;
        }
        if let Ok(bare) = IdempotencyKey::parse(&key) {
            assert_eq!(bare, parsed, "{key:?}");
        }
    }
}

#[test]
fn arbitrary_bytes_give_a_key_or_an_error_that_does_not_show_them() {
    let mut rng = rng("arbitrary key bytes");
    for _ in 0..cases() {
        let n = rng.usize(0..300);
        let bytes: Vec<u8> = (0..n).map(|_| rng.u8(..)).collect();
        match IdempotencyKey::parse(&bytes) {
            Ok(key) => {
                assert!(!key.as_str().is_empty());
                assert!(key.as_str().len() <= idem_runtime::key::MAX_KEY_LEN);
                assert!(key.as_str().bytes().all(|b| (0x20..=0x7e).contains(&b)));
            }
            Err(e) => {
                let text = format!("{e} {e:?}");
                if let Ok(s) = std::str::from_utf8(&bytes)
                    && s.trim().len() >= 8
                {
                    assert!(!text.contains(s.trim()), "the error shows the key: {text}");
                }
            }
        }
    }
}

// --- canonical JSON -----------------------------------------------------------

fn json_string(rng: &mut fastrand::Rng) -> String {
    const PIECES: &[&str] = &[
        "a", "Z", "0", " ", "\"", "\\", "/", "\n", "\t", "\u{1}", "é", "€", "𝄞", "\u{2028}", "{}",
        "[]", ":", ",",
    ];
    let n = rng.usize(0..8);
    (0..n).map(|_| PIECES[rng.usize(..PIECES.len())]).collect()
}

fn json_value(rng: &mut fastrand::Rng, depth: usize) -> Value {
    let kind = if depth == 0 { rng.u8(..5) } else { rng.u8(..7) };
    match kind {
        0 => Value::Null,
        1 => Value::Bool(rng.bool()),
        2 => match rng.u8(..4) {
            0 => Value::from(rng.i64(..)),
            1 => Value::from(rng.u64(..)),
            2 => Value::from(rng.i32(-1000..1000)),
            _ => serde_json::Number::from_f64(rng.f64() * 1e6 - 5e5)
                .map(Value::Number)
                .unwrap_or(Value::Null),
        },
        3 | 4 => Value::String(json_string(rng)),
        5 => Value::Array(
            (0..rng.usize(0..4))
                .map(|_| json_value(rng, depth - 1))
                .collect(),
        ),
        _ => Value::Object(
            (0..rng.usize(0..4))
                .map(|_| (json_string(rng), json_value(rng, depth - 1)))
                .collect(),
        ),
    }
}

#[test]
fn equivalent_json_gives_equal_fingerprints() {
    let mut rng = rng("equivalent JSON");
    for _ in 0..cases() {
        let value = json_value(&mut rng, 3);
        let mut text = String::new();
        respell(&mut rng, &value, &mut text);
        let reread: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("respelled JSON does not parse: {e}: {text}"));
        assert_eq!(
            canonical_json(&value).unwrap(),
            canonical_json(&reread).unwrap(),
            "{value} respelled as {text}"
        );
        let fp = |v: &Value| {
            FingerprintBuilder::new("t", "op", "POST", "/x")
                .body(v)
                .unwrap()
                .finish()
        };
        assert_eq!(fp(&value), fp(&reread), "{text}");
    }
}

#[test]
fn different_json_gives_different_fingerprints() {
    let mut rng = rng("different JSON");
    for _ in 0..cases() {
        let a = json_value(&mut rng, 3);
        let b = json_value(&mut rng, 3);
        if a == b {
            continue;
        }
        assert_ne!(
            canonical_json(&a).unwrap(),
            canonical_json(&b).unwrap(),
            "{a} and {b}"
        );
        let fp = |v: &Value| {
            FingerprintBuilder::new("t", "op", "POST", "/x")
                .body(v)
                .unwrap()
                .finish()
        };
        assert_ne!(fp(&a), fp(&b), "{a} and {b}");
    }
}

#[test]
fn canonical_json_is_json_that_reads_back_as_the_same_value() {
    let mut rng = rng("canonical round trip");
    for _ in 0..cases() {
        let value = json_value(&mut rng, 3);
        let bytes = canonical_json(&value).unwrap();
        let reread: Value = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
            panic!("{e}: {}", String::from_utf8_lossy(&bytes));
        });
        // Numbers may change spelling (1e3 and 1000), not value.
        assert_eq!(canonical_json(&reread).unwrap(), bytes, "{value}");
    }
}

// --- problems -----------------------------------------------------------------

#[tokio::test]
async fn problem_documents_stay_json_whatever_their_detail_holds() {
    let mut rng = rng("problem details");
    for _ in 0..cases() {
        let detail = json_string(&mut rng) + &printable(&mut rng, 20);
        let resp = Problem::new("urn:test:problem", StatusCode::CONFLICT, "Title")
            .with_detail(detail.clone())
            .into_response();
        assert_eq!(resp.status(), StatusCode::CONFLICT);
        assert_eq!(resp.headers()["content-type"], "application/problem+json");
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let doc: Value = serde_json::from_slice(&body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&body)));
        assert_eq!(doc["detail"], detail.as_str());
        assert_eq!(doc["status"], 409);
    }
}

// --- regressions found by the fuzz targets (fuzz/README.md) ---------------------

/// `fuzz/` target `canonical_json`: `1152921504606846976` (2^60) and
/// `1152921504606846976.0` are the same number, but the integer is written
/// exactly and the double as RFC 8785's shortest spelling, `1152921504606847000`
/// (which is also another integer's exact spelling). Every integral double of
/// 2^53 or more whose shortest spelling is not exact did this; now such a double
/// is written as its exact integer.
#[test]
fn an_integral_double_beyond_2_53_and_the_same_integer_give_one_fingerprint() {
    let fp = |text: &str| {
        let v: Value = serde_json::from_str(text).unwrap();
        FingerprintBuilder::new("t", "op", "POST", "/x")
            .body(&v)
            .unwrap()
            .finish()
    };
    assert_eq!(
        fp(r#"{"n":1152921504606846976}"#),
        fp(r#"{"n":1152921504606846976.0}"#)
    );
    // 2^63, as JavaScript's JSON.stringify writes it, and exactly.
    assert_eq!(fp("[9223372036854775808]"), fp("[9.223372036854776e18]"));
}

/// `fuzz/` target `problem`: rounding the wait up to whole seconds overflows
/// (`as_secs() + 1`) when the seconds are already `u64::MAX`: a panic in debug
/// builds, `Retry-After: 1` in release ones (now it saturates). The wait comes
/// from configuration (`in_flight_wait`), not from requests.
#[test]
fn in_flight_problem_for_the_longest_wait_says_the_longest_retry_after() {
    assert_eq!(
        Problem::in_flight(Duration::MAX).retry_after,
        Some(u64::MAX)
    );
}
