//! The bodies the checker derives from the request's: the same JSON value
//! written differently (members reversed, spaces added), and another value
//! (its first integer incremented, or else its first string value changed).
//!
//! Both keep every scalar exactly as written (a number's spelling, a string's
//! escapes): a JSON parser into values would round numbers and reorder members
//! its own way, and another value is only "another" if nothing else changed.

/// Whether the body is one JSON text.
pub(crate) fn is_json(body: &[u8]) -> bool {
    serde_json::from_slice::<serde::de::IgnoredAny>(body).is_ok()
}

/// The same JSON value, bytes that differ: objects' members in reverse order,
/// a space after every `:` and `,`, a line break at the end. `None` if the body
/// is not JSON, or if an object names a member twice: reversed, the other of
/// the two would win where the last one does (as in most parsers), another
/// value.
pub(crate) fn equivalent(body: &[u8]) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(body).ok()?;
    let node = parse(text)?;
    if repeats_a_name(&node) {
        return None;
    }
    let mut out = String::new();
    write_reordered(&node, &mut out);
    out.push('\n');
    if out.as_bytes() == body {
        out.insert(0, ' ');
    }
    Some(out.into_bytes())
}

/// Another JSON value: the first integer (not a key) plus one, or else the
/// first string value with `-2` appended. `None` if the body is not JSON or
/// holds neither.
pub(crate) fn other(body: &[u8]) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(body).ok()?;
    let node = parse(text)?;
    let scalars = {
        let mut all = Vec::new();
        values(&node, &mut all);
        all
    };
    let at = |s: &str| s.as_ptr() as usize - text.as_ptr() as usize;
    if let Some(n) = scalars.iter().find(|s| is_integer(s)) {
        let start = at(n);
        let replaced = increment(n);
        return Some(splice(text, start, n.len(), &replaced));
    }
    let s = scalars.iter().find(|s| s.starts_with('"'))?;
    // Before the closing quote.
    let end = at(s) + s.len() - 1;
    Some(splice(text, end, 0, "-2"))
}

fn splice(text: &str, start: usize, len: usize, with: &str) -> Vec<u8> {
    let mut out = String::with_capacity(text.len() + with.len());
    out.push_str(&text[..start]);
    out.push_str(with);
    out.push_str(&text[start + len..]);
    out.into_bytes()
}

fn is_integer(s: &str) -> bool {
    let digits = s.strip_prefix('-').unwrap_or(s);
    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
}

/// An integer literal plus one, in decimal arithmetic on its digits (so any
/// length works); `-1` becomes `0`.
fn increment(s: &str) -> String {
    if let Some(abs) = s.strip_prefix('-') {
        // -n + 1 = -(n - 1)
        let smaller = decrement(abs);
        return if smaller == "0" {
            smaller
        } else {
            format!("-{smaller}")
        };
    }
    let mut digits: Vec<u8> = s.bytes().collect();
    for d in digits.iter_mut().rev() {
        if *d == b'9' {
            *d = b'0';
        } else {
            *d += 1;
            return String::from_utf8(digits).unwrap_or_default();
        }
    }
    let mut out = String::from("1");
    out.push_str(std::str::from_utf8(&digits).unwrap_or_default());
    out
}

/// A positive integer literal minus one.
fn decrement(s: &str) -> String {
    let mut digits: Vec<u8> = s.bytes().collect();
    for d in digits.iter_mut().rev() {
        if *d == b'0' {
            *d = b'9';
        } else {
            *d -= 1;
            break;
        }
    }
    let text = String::from_utf8(digits).unwrap_or_default();
    let trimmed = text.trim_start_matches('0');
    if trimmed.is_empty() {
        "0".to_owned()
    } else {
        trimmed.to_owned()
    }
}

/// A JSON text's structure; every slice borrows from the text.
enum Node<'a> {
    Object(Vec<(&'a str, Node<'a>)>),
    Array(Vec<Node<'a>>),
    /// A string (with its quotes), number, `true`, `false` or `null`, as written.
    Scalar(&'a str),
}

/// Parses a JSON text that serde_json accepts; `None` for any other.
fn parse(text: &str) -> Option<Node<'_>> {
    if !is_json(text.as_bytes()) {
        return None;
    }
    let mut p = Parser { text, at: 0 };
    let node = p.value()?;
    p.space();
    (p.at == text.len()).then_some(node)
}

struct Parser<'a> {
    text: &'a str,
    at: usize,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.at).copied()
    }

    fn space(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    fn eat(&mut self, b: u8) -> Option<()> {
        self.space();
        (self.peek()? == b).then(|| self.at += 1)
    }

    fn value(&mut self) -> Option<Node<'a>> {
        self.space();
        match self.peek()? {
            b'{' => {
                self.at += 1;
                let mut members = Vec::new();
                self.space();
                if self.peek()? == b'}' {
                    self.at += 1;
                    return Some(Node::Object(members));
                }
                loop {
                    self.space();
                    let key = self.string()?;
                    self.eat(b':')?;
                    members.push((key, self.value()?));
                    self.space();
                    match self.peek()? {
                        b',' => self.at += 1,
                        b'}' => {
                            self.at += 1;
                            return Some(Node::Object(members));
                        }
                        _ => return None,
                    }
                }
            }
            b'[' => {
                self.at += 1;
                let mut items = Vec::new();
                self.space();
                if self.peek()? == b']' {
                    self.at += 1;
                    return Some(Node::Array(items));
                }
                loop {
                    items.push(self.value()?);
                    self.space();
                    match self.peek()? {
                        b',' => self.at += 1,
                        b']' => {
                            self.at += 1;
                            return Some(Node::Array(items));
                        }
                        _ => return None,
                    }
                }
            }
            b'"' => self.string().map(Node::Scalar),
            _ => {
                let start = self.at;
                while matches!(self.peek(), Some(b) if b.is_ascii_alphanumeric() || b"+-.".contains(&b))
                {
                    self.at += 1;
                }
                (self.at > start).then(|| Node::Scalar(&self.text[start..self.at]))
            }
        }
    }

    /// A string with its quotes, escapes as written.
    fn string(&mut self) -> Option<&'a str> {
        let start = self.at;
        if self.peek()? != b'"' {
            return None;
        }
        self.at += 1;
        loop {
            match self.peek()? {
                b'\\' => self.at += 2,
                b'"' => {
                    self.at += 1;
                    return Some(&self.text[start..self.at]);
                }
                _ => self.at += 1,
            }
        }
    }
}

/// Whether an object in `node` names a member twice (names compared as the
/// strings they spell, escapes decoded).
fn repeats_a_name(node: &Node<'_>) -> bool {
    match node {
        Node::Scalar(_) => false,
        Node::Array(items) => items.iter().any(repeats_a_name),
        Node::Object(members) => {
            let mut names = std::collections::HashSet::new();
            members.iter().any(|(key, _)| {
                !names.insert(
                    serde_json::from_str::<String>(key).unwrap_or_else(|_| (*key).to_owned()),
                )
            }) || members.iter().any(|(_, value)| repeats_a_name(value))
        }
    }
}

fn write_reordered(node: &Node<'_>, out: &mut String) {
    match node {
        Node::Scalar(s) => out.push_str(s),
        Node::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_reordered(item, out);
            }
            out.push(']');
        }
        Node::Object(members) => {
            out.push_str("{ ");
            for (i, (key, value)) in members.iter().rev().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                out.push_str(key);
                out.push_str(": ");
                write_reordered(value, out);
            }
            out.push_str(" }");
        }
    }
}

/// The scalars that are values (not keys), in document order.
fn values<'a>(node: &Node<'a>, out: &mut Vec<&'a str>) {
    match node {
        Node::Scalar(s) => out.push(s),
        Node::Array(items) => items.iter().for_each(|i| values(i, out)),
        Node::Object(members) => members.iter().for_each(|(_, v)| values(v, out)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn value(b: &[u8]) -> Value {
        serde_json::from_slice(b).unwrap()
    }

    #[test]
    fn the_equivalent_body_is_the_same_value_in_other_bytes() {
        for body in [
            r#"{"sku":"A-1","quantity":2,"amount_cents":1250,"note":"a \"b\", c"}"#,
            r#"{"a":{"x":[1,2.50,{"k":null}],"y":true},"b":"é"}"#,
            r#"[1,2,3]"#,
            r#"7"#,
            r#" { } "#,
        ] {
            let eq = equivalent(body.as_bytes()).unwrap();
            assert_ne!(eq, body.as_bytes());
            assert_eq!(
                value(&eq),
                value(body.as_bytes()),
                "{}",
                String::from_utf8_lossy(&eq)
            );
        }
        let eq = equivalent(br#"{"a":1,"b":2.50}"#).unwrap();
        assert_eq!(eq, b"{ \"b\": 2.50, \"a\": 1 }\n", "numbers as written");
        assert_eq!(equivalent(b"not json"), None);
        assert_eq!(equivalent(b"{\"a\":1} x"), None);
        // A name repeated, however spelled and however deep: reversed, the
        // other value would win.
        assert_eq!(equivalent(br#"{"a":1,"a":2}"#), None);
        assert_eq!(equivalent(br#"{"a":1,"\u0061":2}"#), None);
        assert_eq!(equivalent(br#"[{"b":{"a":1,"a":2}}]"#), None);
        assert!(equivalent(br#"{"a":{"a":1},"b":{"a":2}}"#).is_some());
    }

    #[test]
    fn the_other_body_changes_one_value_and_nothing_else() {
        let other = other(br#"{"sku":"A-1","quantity":2,"amount_cents":1250}"#).unwrap();
        assert_eq!(other, br#"{"sku":"A-1","quantity":3,"amount_cents":1250}"#);
        // Keys are not values; numbers with fractions are left alone.
        let other = super::other(br#"{"2":1.5,"n":[-1]}"#).unwrap();
        assert_eq!(other, br#"{"2":1.5,"n":[0]}"#);
        let other = super::other(br#"{"sku":"A-\"1\"","f":1.5}"#).unwrap();
        assert_eq!(other, br#"{"sku":"A-\"1\"-2","f":1.5}"#);
        assert_eq!(super::other(br#"{"f":1.5,"b":true}"#), None);
        assert_eq!(super::other(b"not json"), None);
    }

    #[test]
    fn integers_increment_in_decimal() {
        assert_eq!(increment("0"), "1");
        assert_eq!(increment("199"), "200");
        assert_eq!(
            increment("99999999999999999999999"),
            "100000000000000000000000"
        );
        assert_eq!(increment("-1"), "0");
        assert_eq!(increment("-10"), "-9");
        assert_eq!(increment("-200"), "-199");
    }
}
