//! The target (the request a client would send, as the arguments describe it),
//! sending one request with a key of the checker's choosing, and the record of
//! what was sent and what came back.

use std::time::{Duration, Instant};

use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};
use reqwest::{Method, Url};
use serde::Serialize;

use super::CheckArgs;
use super::redact;
use crate::Failure;

/// The most of an answer's body kept (and compared): far beyond what an API
/// answers to a create, and a bound on what a misbehaving server can make the
/// checker hold.
const MAX_BODY: usize = 4 << 20;

/// The request under test, and where effects are counted.
#[derive(Clone)]
pub(crate) struct Target {
    client: reqwest::Client,
    pub(crate) url: Url,
    pub(crate) method: Method,
    /// The `-H` headers (and a default `Content-Type` for a JSON body).
    pub(crate) headers: HeaderMap,
    /// The `--tenant-header` headers, which replace those of the same name.
    pub(crate) tenant_headers: HeaderMap,
    pub(crate) body: Option<Vec<u8>>,
    pub(crate) effects: Option<Url>,
    pub(crate) timeout: Duration,
}

/// Which body a request carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyKind {
    /// The request's own (`--body`).
    Original,
    /// The same JSON value, its members reordered and respaced.
    Equivalent,
    /// Another body (`--other-body`, or derived).
    Other,
}

/// Whose request it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tenant {
    /// With the `-H` headers.
    First,
    /// With `--tenant-header` in place of the `-H` headers of the same names.
    Second,
}

/// A request as sent, credentials redacted.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Sent {
    pub(crate) method: String,
    pub(crate) url: String,
    /// The `Idempotency-Key` sent, if any, as its characters (control
    /// characters escaped).
    pub(crate) key: Option<String>,
    /// Every header sent, credentials redacted.
    pub(crate) headers: Vec<(String, String)>,
    /// Which body, and its size.
    pub(crate) body: Option<String>,
}

/// What came back.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) headers: Vec<(String, String)>,
    /// The body as text (invalid UTF-8 replaced), for reports.
    pub(crate) body: String,
    #[serde(skip)]
    pub(crate) bytes: Vec<u8>,
    pub(crate) elapsed_ms: u128,
}

impl Answer {
    /// The first value of a header (names are lower case).
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    pub(crate) fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }

    /// `Idempotent-Replayed: true`, as idem and Stripe mark a replay.
    pub(crate) fn replayed(&self) -> bool {
        self.header(idem_wire::IDEMPOTENT_REPLAYED)
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
    }

    /// The status with a hint of the body: `201`, `422 urn:...:mismatch`.
    pub(crate) fn short(&self) -> String {
        let problem_type = self
            .header("content-type")
            .filter(|ct| idem_wire::problem::is_problem_content_type(ct))
            .and_then(|_| serde_json::from_slice::<serde_json::Value>(&self.bytes).ok())
            .and_then(|doc| doc.get("type").and_then(|t| t.as_str()).map(str::to_owned));
        match problem_type {
            Some(t) => format!("{} {t}", self.status),
            None => self.status.to_string(),
        }
    }
}

/// One request and its answer (or why there was none).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Exchange {
    pub(crate) request: Sent,
    #[serde(flatten)]
    pub(crate) result: Outcome,
}

/// An answer, or the error that stood in its way.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Outcome {
    Answer(Answer),
    Error(String),
}

impl Exchange {
    pub(crate) fn answer(&self) -> Option<&Answer> {
        match &self.result {
            Outcome::Answer(a) => Some(a),
            Outcome::Error(_) => None,
        }
    }

    /// The answer's short form, or the error.
    pub(crate) fn short(&self) -> String {
        match &self.result {
            Outcome::Answer(a) => a.short(),
            Outcome::Error(e) => format!("no answer ({e})"),
        }
    }
}

impl Target {
    /// The target the arguments describe, or a usage error that says which
    /// argument is wrong and why (never echoing a header's value).
    pub(crate) fn from_args(args: &CheckArgs) -> Result<Target, Failure> {
        let url = parse_url("--url", &args.url)?;
        let effects = args
            .effects
            .as_deref()
            .map(|u| parse_url("--effects", u))
            .transpose()?;
        let method = Method::from_bytes(args.method.as_bytes()).map_err(|_| {
            Failure::Usage(format!(
                "--method {:?}: not an HTTP method (e.g. POST, PUT, PATCH)",
                args.method
            ))
        })?;
        let mut headers = HeaderMap::new();
        for h in &args.headers {
            let (name, value) = parse_header("-H", h)?;
            headers.append(name, value);
        }
        let mut tenant_headers = HeaderMap::new();
        for h in &args.tenant_header {
            let (name, value) = parse_header("--tenant-header", h)?;
            tenant_headers.append(name, value);
        }
        let body = args.body.as_deref().map(read_body).transpose()?;
        if let Some(b) = &body
            && !headers.contains_key(CONTENT_TYPE)
            && super::body::is_json(b)
        {
            headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        }
        let client = client(args.timeout).map_err(Failure::Other)?;
        Ok(Target {
            client,
            url,
            method,
            headers,
            tenant_headers,
            body,
            effects,
            timeout: args.timeout,
        })
    }

    /// The `-H` headers for a request without a body (no `Content-Type`).
    fn bodiless_headers(&self) -> HeaderMap {
        let mut headers = self.headers.clone();
        headers.remove(CONTENT_TYPE);
        headers
    }

    /// The same target on an HTTP client of its own, whose connections no
    /// other request shares.
    pub(crate) fn on_own_client(&self) -> Result<Target, String> {
        Ok(Target {
            client: client(self.timeout)?,
            ..self.clone()
        })
    }

    /// Opens this client's connection before it is needed: an `OPTIONS`
    /// request to the URL (a safe method, RFC 9110: no key, no body, no
    /// effect), its answer read whole so that the connection waits idle for
    /// the next request. `Err` says why no connection is known to wait: no
    /// answer, or one that closes it.
    pub(crate) async fn open_connection(&self) -> Result<(), String> {
        let answer = fetch(
            self.client
                .request(Method::OPTIONS, self.url.clone())
                .headers(self.bodiless_headers()),
        )
        .await?;
        match answer.header("connection") {
            Some(v) if v.to_ascii_lowercase().contains("close") => Err(format!(
                "the OPTIONS answer ({}) closes its connection",
                answer.status
            )),
            _ => Ok(()),
        }
    }

    /// Sends the request with `key` (raw bytes: the malformed ones are the
    /// point of some scenarios), `body` and `tenant`'s headers.
    pub(crate) async fn send(
        &self,
        key: Option<&[u8]>,
        body: Option<(BodyKind, &[u8])>,
        tenant: Tenant,
    ) -> Exchange {
        let mut headers = self.headers.clone();
        if tenant == Tenant::Second {
            for name in self.tenant_headers.keys() {
                headers.remove(name);
            }
            for (name, value) in &self.tenant_headers {
                headers.append(name, value.clone());
            }
        }
        let key_value = key.map(HeaderValue::from_bytes);
        let sent = Sent {
            method: self.method.to_string(),
            url: redact::url(&self.url),
            key: key.map(shown_key),
            headers: redact::headers(&headers, &self.tenant_headers),
            body: body.map(|(kind, b)| {
                let which = match kind {
                    BodyKind::Original => "the body",
                    BodyKind::Equivalent => "the body, reordered and respaced",
                    BodyKind::Other => "another body",
                };
                format!("{which} ({} bytes)", b.len())
            }),
        };
        match key_value {
            Some(Ok(v)) => {
                headers.insert(HeaderName::from_static(idem_wire::IDEMPOTENCY_KEY), v);
            }
            // The keys are the checker's own; none that HTTP cannot carry is made.
            Some(Err(_)) => {
                return Exchange {
                    request: sent,
                    result: Outcome::Error("the key cannot be sent as a header value".into()),
                };
            }
            None => {}
        }
        let mut req = self
            .client
            .request(self.method.clone(), self.url.clone())
            .headers(headers);
        if let Some((_, b)) = body {
            req = req.body(b.to_vec());
        }
        let result = match fetch(req).await {
            Ok(answer) => Outcome::Answer(answer),
            Err(e) => Outcome::Error(e),
        };
        Exchange {
            request: sent,
            result,
        }
    }

    /// Sends again until `deadline` while the service is not back after a
    /// restart: a connection error (nothing reached the service), or a
    /// gateway's `502`, `503` or `504` (a proxy in front of it, which answers
    /// for it while it starts).
    pub(crate) async fn send_when_up(
        &self,
        key: &[u8],
        body: Option<(BodyKind, &[u8])>,
        deadline: Instant,
    ) -> Exchange {
        loop {
            let ex = self.send(Some(key), body, Tenant::First).await;
            let down = match &ex.result {
                Outcome::Error(e) => e.starts_with(CONNECT),
                Outcome::Answer(a) => matches!(a.status, 502..=504),
            };
            if !down || Instant::now() >= deadline {
                return ex;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The effects counted now, as `--effects` answers: a number, or a JSON
    /// array's length.
    pub(crate) async fn count_effects(&self) -> Result<u64, String> {
        let Some(url) = &self.effects else {
            return Err("no --effects URL".into());
        };
        let answer = fetch(
            self.client
                .get(url.clone())
                .headers(self.bodiless_headers()),
        )
        .await?;
        if !answer.is_success() {
            return Err(format!("GET answered {}", answer.short()));
        }
        match serde_json::from_slice::<serde_json::Value>(&answer.bytes) {
            Ok(serde_json::Value::Number(n)) if n.as_u64().is_some() => Ok(n.as_u64().unwrap_or(0)),
            Ok(serde_json::Value::Array(a)) => Ok(a.len() as u64),
            _ => Err(format!(
                "the GET's answer is neither a whole number nor a JSON array: {}",
                super::report::excerpt(&answer.body, 120)
            )),
        }
    }
}

/// The checker's HTTP client: every request bounded by `timeout`, no redirect
/// followed (only the URLs given are reached; a `3xx` is reported).
fn client(timeout: Duration) -> Result<reqwest::Client, String> {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(timeout)
        .user_agent(concat!("idem-check/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| format!("cannot build the HTTP client: {e}"))
}

/// How a connection error's message starts ([`Target::send_when_up`] retries those).
const CONNECT: &str = "cannot connect";

/// Sends a request and reads its answer, at most [`MAX_BODY`] of it.
async fn fetch(req: reqwest::RequestBuilder) -> Result<Answer, String> {
    let started = Instant::now();
    let mut resp = req.send().await.map_err(describe)?;
    let status = resp.status().as_u16();
    let headers = resp
        .headers()
        .iter()
        .map(|(n, v)| {
            let value = if n == reqwest::header::SET_COOKIE {
                redact::REDACTED.to_owned()
            } else {
                String::from_utf8_lossy(v.as_bytes()).into_owned()
            };
            (n.as_str().to_owned(), value)
        })
        .collect();
    let mut bytes = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(describe)? {
        if bytes.len() + chunk.len() > MAX_BODY {
            return Err(format!("the answer's body is over {} MiB", MAX_BODY >> 20));
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok(Answer {
        status,
        headers,
        body: String::from_utf8_lossy(&bytes).into_owned(),
        bytes,
        elapsed_ms: started.elapsed().as_millis(),
    })
}

/// reqwest's error as one line: what failed and the innermost cause.
fn describe(e: reqwest::Error) -> String {
    let what = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        CONNECT
    } else if e.is_body() || e.is_decode() {
        "the body broke off"
    } else {
        "the request failed"
    };
    let mut source: &dyn std::error::Error = &e;
    while let Some(inner) = source.source() {
        source = inner;
    }
    format!("{what}: {source}")
}

/// A key as a report shows it: control characters escaped, a long one in full
/// (its length matters).
fn shown_key(key: &[u8]) -> String {
    String::from_utf8_lossy(key).escape_debug().to_string()
}

fn parse_url(flag: &str, raw: &str) -> Result<Url, Failure> {
    let url = Url::parse(raw.trim()).map_err(|e| {
        Failure::Usage(format!(
            "{flag}: not a URL ({e}); write it whole, e.g. https://staging.example.com/orders"
        ))
    })?;
    match url.scheme() {
        "http" => Ok(url),
        #[cfg(feature = "tls")]
        "https" => Ok(url),
        #[cfg(not(feature = "tls"))]
        "https" => Err(Failure::Usage(format!(
            "{flag}: this idem was built without TLS, so it cannot reach https:// URLs: \
             rebuild it with the cargo feature `tls` (cargo install idem-cli --features tls)"
        ))),
        other => Err(Failure::Usage(format!(
            "{flag}: the scheme {other}: is not http: or https:"
        ))),
    }
}

/// `Name: value`, as curl's `-H` takes it. The value is never echoed: it may
/// be a credential.
fn parse_header(flag: &str, raw: &str) -> Result<(HeaderName, HeaderValue), Failure> {
    let Some((name, value)) = raw.split_once(':') else {
        return Err(Failure::Usage(format!(
            "{flag}: a header is 'Name: value'; one has no colon"
        )));
    };
    let name = HeaderName::from_bytes(name.trim().as_bytes()).map_err(|_| {
        Failure::Usage(format!(
            "{flag}: {:?} is not a header name (letters, digits and !#$%&'*+-.^_`|~ only)",
            name.trim()
        ))
    })?;
    if name.as_str() == idem_wire::IDEMPOTENCY_KEY {
        return Err(Failure::Usage(format!(
            "{flag}: leave Idempotency-Key out: the check makes its own keys, one per scenario"
        )));
    }
    let value = HeaderValue::from_str(value.trim()).map_err(|_| {
        Failure::Usage(format!(
            "{flag}: the value of {name} holds a character a header cannot carry (a control \
             character or a line break)"
        ))
    })?;
    Ok((name, value))
}

/// The body file's bytes, or standard input's for `-`.
fn read_body(path: &str) -> Result<Vec<u8>, Failure> {
    use std::io::Read;
    if path == "-" {
        let mut buf = Vec::new();
        std::io::stdin()
            .read_to_end(&mut buf)
            .map_err(|e| Failure::Usage(format!("--body -: cannot read standard input: {e}")))?;
        return Ok(buf);
    }
    std::fs::read(path).map_err(|e| Failure::Usage(format!("--body {path}: cannot read it: {e}")))
}

/// Reads `--other-body`.
pub(crate) fn read_other_body(path: &str) -> Result<Vec<u8>, Failure> {
    std::fs::read(path)
        .map_err(|e| Failure::Usage(format!("--other-body {path}: cannot read it: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_parse_as_curl_writes_them() {
        let (n, v) = parse_header("-H", "Authorization: Bearer a:b").unwrap();
        assert_eq!(n, "authorization");
        assert_eq!(v, "Bearer a:b");
        let e = parse_header("-H", "Authorization Bearer x").unwrap_err();
        assert!(e.message().contains("no colon"), "{}", e.message());
        assert!(!e.message().contains("Bearer"));
        let e = parse_header("-H", "Bad Name: x").unwrap_err();
        assert!(e.message().contains("not a header name"));
        let e = parse_header("-H", "Idempotency-Key: k").unwrap_err();
        assert!(e.message().contains("makes its own keys"));
        let e = parse_header("-H", "X-A: a\u{1}b").unwrap_err();
        assert!(e.message().contains("cannot carry"));
        assert!(!e.message().contains("a\u{1}b"));
    }

    #[test]
    fn urls_must_be_http() {
        assert!(parse_url("--url", "http://127.0.0.1:3000/orders").is_ok());
        let e = parse_url("--url", "127.0.0.1:3000/orders").unwrap_err();
        assert_eq!(e.code(), 2);
        let e = parse_url("--url", "ftp://example.com/x").unwrap_err();
        assert!(e.message().contains("ftp"), "{}", e.message());
        assert!(parse_url("--url", "not a url").is_err());
    }
}
