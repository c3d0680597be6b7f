//! Credentials never reach a report: header values that authenticate (by name,
//! and every `--tenant-header`), a URL's user and password, and query
//! parameters named like secrets. Keys are shown: they are the checker's own,
//! made for this run, and a failure is found by them in the service's logs.

use reqwest::Url;
use reqwest::header::HeaderMap;

/// What a redacted value is replaced by.
pub(crate) const REDACTED: &str = "<redacted>";

/// Whether a header or query parameter of this name carries a credential.
pub(crate) fn is_secret(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    if name == idem_wire::IDEMPOTENCY_KEY {
        return false;
    }
    matches!(
        name.as_str(),
        "cookie" | "proxy-authorization" | "authorization"
    ) || [
        "auth",
        "token",
        "secret",
        "password",
        "passwd",
        "key",
        "session",
        "signature",
        "credential",
        "jwt",
    ]
    .iter()
    .any(|word| name.contains(word))
}

/// The headers as a report shows them: secrets and the tenant's headers redacted.
pub(crate) fn headers(headers: &HeaderMap, tenant: &HeaderMap) -> Vec<(String, String)> {
    headers
        .iter()
        .map(|(name, value)| {
            let shown = if is_secret(name.as_str()) || tenant.contains_key(name) {
                REDACTED.to_owned()
            } else {
                String::from_utf8_lossy(value.as_bytes()).into_owned()
            };
            (name.as_str().to_owned(), shown)
        })
        .collect()
}

/// The URL without its user and password, and with secret-looking query
/// parameters' values redacted.
pub(crate) fn url(url: &Url) -> String {
    let mut shown = url.clone();
    let had_credentials = !shown.username().is_empty() || shown.password().is_some();
    let _ = shown.set_username("");
    let _ = shown.set_password(None);
    if shown.query().is_some() {
        let pairs: Vec<(String, String)> = shown
            .query_pairs()
            .map(|(k, v)| {
                let v = if is_secret(&k) {
                    REDACTED.to_owned()
                } else {
                    v.into_owned()
                };
                (k.into_owned(), v)
            })
            .collect();
        shown.query_pairs_mut().clear().extend_pairs(pairs);
    }
    let text = shown.to_string();
    let prefix = format!("{}://", shown.scheme());
    match text.strip_prefix(&prefix) {
        // The URL still says that it had credentials.
        Some(rest) if had_credentials => format!("{prefix}{REDACTED}@{rest}"),
        _ => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::{HeaderName, HeaderValue};

    #[test]
    fn credentials_are_redacted_and_keys_shown() {
        let mut h = HeaderMap::new();
        for (n, v) in [
            ("authorization", "Bearer acme"),
            ("x-api-key", "sk_live_1"),
            ("cookie", "sid=1"),
            ("x-tenant", "globex"),
            ("x-currency", "EUR"),
            ("idempotency-key", "idem-check-1"),
        ] {
            h.append(HeaderName::from_static(n), HeaderValue::from_static(v));
        }
        let mut tenant = HeaderMap::new();
        tenant.insert("x-tenant", HeaderValue::from_static("other"));
        let shown = headers(&h, &tenant);
        let text = format!("{shown:?}");
        for secret in ["acme", "sk_live_1", "sid=1", "globex"] {
            assert!(!text.contains(secret), "{secret} in {text}");
        }
        assert!(
            text.contains("EUR") && text.contains("idem-check-1"),
            "{text}"
        );
    }

    #[test]
    fn urls_lose_their_credentials() {
        let u = Url::parse("https://user:pw@api.example.com/orders?token=t0k&x=1").unwrap();
        let shown = url(&u);
        assert!(!shown.contains("pw") && !shown.contains("user") && !shown.contains("t0k"));
        assert!(
            shown.contains("api.example.com/orders") && shown.contains("x=1"),
            "{shown}"
        );
        let plain = Url::parse("http://127.0.0.1:3000/orders").unwrap();
        assert_eq!(url(&plain), "http://127.0.0.1:3000/orders");
    }
}
