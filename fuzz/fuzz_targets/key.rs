//! `IdempotencyKey::parse` against an independent model of its rules: a bare
//! token of visible ASCII, or an RFC 8941 string item (`"..."`, escapes `\"` and
//! `\\` only, no parameters), surrounding spaces and tabs ignored, not blank, at
//! most 255 characters. Any difference, in the key or in the error, is a crash.
//! Accepted keys also read back as themselves in both spellings, and no error
//! shows the value it refused.

#![no_main]

use std::sync::LazyLock;

use idem_runtime::{IdempotencyKey, KeyError};
use libfuzzer_sys::fuzz_target;

const MAX_KEY_LEN: usize = 255;

fn trim_ows(mut raw: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = raw {
        raw = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = raw {
        raw = rest;
    }
    raw
}

/// RFC 8941 §4.2.5, for an item that must be a string and nothing more.
fn sf_string(raw: &[u8]) -> Option<String> {
    let mut out = String::new();
    let mut rest = raw.strip_prefix(b"\"")?;
    loop {
        match rest {
            [b'\\', c @ (b'"' | b'\\'), tail @ ..] => {
                out.push(char::from(*c));
                rest = tail;
            }
            [b'"', tail @ ..] => return tail.is_empty().then_some(out),
            [c @ 0x20..=0x7e, tail @ ..] if *c != b'\\' => {
                out.push(char::from(*c));
                rest = tail;
            }
            _ => return None,
        }
    }
}

fn model(input: &[u8]) -> Result<String, KeyError> {
    let raw = trim_ows(input);
    if raw.is_empty() {
        return Err(KeyError::Empty);
    }
    let key = if raw[0] == b'"' {
        sf_string(raw).ok_or(KeyError::MalformedStructuredString)?
    } else if let Some(position) = raw.iter().position(|b| !(0x21..=0x7e).contains(b)) {
        return Err(KeyError::NotPrintableAscii { position });
    } else if let Some(position) = raw.iter().position(|&b| b == b',') {
        return Err(KeyError::Comma { position });
    } else {
        String::from_utf8(raw.to_vec()).unwrap()
    };
    if key.bytes().all(|b| b == b' ') {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong { len: key.len() });
    }
    Ok(key)
}

/// Every byte any refusal's text can hold: an input with a byte outside this set
/// cannot appear in one.
static ERROR_BYTES: LazyLock<[bool; 256]> = LazyLock::new(|| {
    let mut seen = [false; 256];
    let errors = [
        KeyError::Missing,
        KeyError::Repeated,
        KeyError::Empty,
        KeyError::TooLong { len: 1234567890 },
        KeyError::NotPrintableAscii {
            position: 1234567890,
        },
        KeyError::Comma {
            position: 1234567890,
        },
        KeyError::MalformedStructuredString,
    ];
    for e in errors {
        for b in format!("{e} {e:?}").bytes() {
            seen[usize::from(b)] = true;
        }
    }
    seen
});

fuzz_target!(|input: &[u8]| {
    let parsed = IdempotencyKey::parse(input);
    let expected = model(input);
    match (&parsed, &expected) {
        (Ok(key), Ok(want)) => assert_eq!(key.as_str(), want, "input {input:?}"),
        (Err(got), Err(want)) => assert_eq!(got, want, "input {input:?}"),
        _ => panic!("input {input:?}: parse gave {parsed:?}, the rules say {expected:?}"),
    }
    match parsed {
        Ok(key) => {
            let s = key.as_str();
            assert!(!s.is_empty() && s.len() <= MAX_KEY_LEN);
            assert!(s.bytes().all(|b| (0x20..=0x7e).contains(&b)));
            // The structured spelling of any key is that key.
            let quoted = format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""));
            assert_eq!(
                IdempotencyKey::parse(&quoted).as_ref(),
                Ok(&key),
                "{quoted:?}"
            );
            // And so is its bare spelling, where it has one.
            if !s.starts_with('"') && !s.contains(' ') {
                assert_eq!(IdempotencyKey::parse(s).as_ref(), Ok(&key));
            }
            // Its Debug form is redacted.
            assert_eq!(
                format!("{key:?}"),
                format!("IdempotencyKey(<redacted, {} chars>)", s.len())
            );
        }
        Err(e) => {
            let seen = &*ERROR_BYTES;
            let raw = trim_ows(input);
            if raw.iter().any(|&b| !seen[usize::from(b)]) {
                let text = format!("{e} {e:?}");
                assert!(
                    !text.as_bytes().windows(raw.len()).any(|w| w == raw),
                    "{text}"
                );
            }
        }
    }
});
