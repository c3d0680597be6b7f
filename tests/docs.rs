//! The Markdown names only what exists. Rustdoc checks the intra-doc links of
//! the code (`.ci/run` builds the API docs with warnings denied); this is the
//! same check for the prose: README.md, ARCHITECTURE.md, docs/*.md and every
//! crate's README.md. Each idem item they name in backticks (`Idem::new`,
//! `idem_runtime::transition::States`, `Reconciler::<_, Redis>::on_store`) must
//! be a public item of idem's crates, or the test fails with the file, the line
//! and the missing name.
//!
//! It is text-based and pragmatic:
//!
//! * The public names come from the crates' sources (idem-runtime, idem-macros,
//!   idem-client, idem-wire): `pub fn`, `pub struct`, `pub enum` and its variants, `pub
//!   trait` and its items, `pub type`, `pub const`, `pub static`, `pub mod`,
//!   `pub` fields, `pub use` re-exports (not of the standard library's items,
//!   which the hidden `__private` module re-exports for the attribute's
//!   expansion) and exported `macro_rules!`. It checks names, not whole paths:
//!   each segment of a path must be a public name of idem (of that crate, for a
//!   path that starts with the crate's name), not necessarily at that place.
//! * What a doc names: in inline code, a path that starts with `idem_runtime`,
//!   `idem_client`, `idem_macros` or `idem_wire`, a path into one of idem's
//!   public modules (`consumer::process_once`), and every CamelCase name, which
//!   must be idem's or listed in [`OTHERS`] (axum's, sqlx's, the examples'
//!   own...). In code
//!   blocks, where the examples define types of their own, only the paths that
//!   start with a crate name or with one of idem's types. After such a path, the
//!   methods of its call chain (`Sweeper::new(pool).spawn()`) must be idem's
//!   public functions too.
//!
//! `the_check_reports_a_name_that_does_not_exist` proves, on a made-up page,
//! that a missing name fails.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The crates whose public names the docs may use, by their Rust name.
const CRATES: &[(&str, &str)] = &[
    ("idem_runtime", "idem-runtime/src"),
    ("idem_macros", "idem-macros/src"),
    ("idem_client", "idem-client/src"),
    ("idem_wire", "idem-wire/src"),
];

/// CamelCase names in the docs' inline code that are not idem's: the standard
/// library's, other crates' (axum, sqlx, serde, reqwest, redis), the examples'
/// own types, and words that only look like names. A name that idem does not
/// export and that is not here fails the check: if it is someone else's, add it
/// here; if it is idem's, fix the doc.
#[rustfmt::skip]
const OTHERS: &[&str] = &[
    // the standard library's
    "Debug", "Display", "Duration", "Err", "Ok", "Option", "Result", "String", "Clone",
    "BTreeMap",
    // the fingerprint's tokens for the floats JSON has no spelling for
    "NaN", "Infinity",
    "HashMap", "Arc", "HashSet", "BTreeSet", "Vec",
    // gRPC's: google.rpc's error details, and the gRPC example's methods and types
    "RetryInfo", "ErrorInfo", "PreconditionFailure", "BadRequest",
    "CreateOrder", "CreateRefund", "CreatePayment", "GetOrder", "CountOrders", "Caller", "Service",
    // axum's
    "Body", "Bytes", "Form", "FromRef", "IntoResponse", "Json", "JsonRejection", "RawForm",
    "Request", "OriginalUri", "Router", "FromRequest", "State",
    // sqlx's
    "MySql", "MySqlPool", "PgPool", "PgPoolOptions", "Pool", "Postgres", "Sqlite", "SqlitePool",
    "Transaction",
    "SqliteConnectOptions",
    // tower-http's
    "TraceLayer",
    // serde's, reqwest's, redis-rs's
    "Deserialize", "Serialize", "RequestBuilder", "ConnectionManager", "Script",
    "ConnectionManagerConfig", "ClusterClient",
    // the docs' example types, and the tests' helpers (tests/common)
    "AppState", "NewOrder", "OrderBody", "OrdersAnswers", "Payment", "SqliteDb", "Step",
    "TestDb", "SweepDb",
    // not a name: `Authorization: Bearer <tenant>`
    "Bearer",
    // HTTP's: a reason phrase (`202 Accepted`) and a header (`Location`)
    "Accepted", "Location",
];

/// Methods of other crates' traits that the docs call on idem's values.
const OTHER_METHODS: &[&str] = &["into_response"];

// ---------------------------------------------------------------- the names

/// The public names of one crate, read from its sources.
#[derive(Default)]
struct Names {
    /// Every public name.
    all: BTreeSet<String>,
    /// The names of public modules (a path may start with one).
    modules: BTreeSet<String>,
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_'
}

fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The identifier at the start of `s`, if there is one.
fn leading_ident(s: &str) -> Option<&str> {
    let end = s.find(|c: char| !is_ident_char(c)).unwrap_or(s.len());
    let ident = &s[..end];
    (!ident.is_empty() && ident.starts_with(is_ident_start)).then_some(ident)
}

fn indent(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

/// The names a `pub use` tree makes public: its leaves, or their aliases.
fn use_leaves(tree: &str, out: &mut BTreeSet<String>) {
    let mut tokens: Vec<String> = Vec::new();
    let mut chars = tree.chars().peekable();
    while let Some(&c) = chars.peek() {
        if is_ident_start(c) {
            let mut ident = String::new();
            while let Some(&c) = chars.peek().filter(|c| is_ident_char(**c)) {
                ident.push(c);
                chars.next();
            }
            tokens.push(ident);
        } else {
            if !c.is_whitespace() {
                tokens.push(c.to_string());
            }
            chars.next();
        }
    }
    for (i, token) in tokens.iter().enumerate() {
        let next = tokens.get(i + 1).map(String::as_str);
        if token.starts_with(is_ident_start)
            && token != "self"
            && token != "as"
            && matches!(next, None | Some("," | "}" | ";"))
        {
            out.insert(token.clone());
        }
    }
}

/// Reads the public names of the crate whose sources are in `dir`.
fn names_in(dir: &Path) -> Names {
    let mut names = Names::default();
    let mut files = Vec::new();
    rust_files(dir, &mut files);
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let mut i = 0;
        while i < lines.len() {
            let line = lines[i];
            let trimmed = line.trim_start();
            if let Some(rest) = trimmed.strip_prefix("macro_rules! ") {
                let exported = lines[i.saturating_sub(3)..i]
                    .iter()
                    .any(|l| l.contains("#[macro_export]"));
                if let (true, Some(name)) = (exported, leading_ident(rest)) {
                    names.all.insert(name.to_owned());
                }
            }
            let Some(mut rest) = trimmed.strip_prefix("pub ") else {
                i += 1;
                continue;
            };
            if let Some(tree) = rest.strip_prefix("use ")
                && !["std::", "core::", "alloc::"]
                    .iter()
                    .any(|p| tree.starts_with(p))
            {
                // A `pub use` may run over several lines, up to its `;`.
                let mut tree = tree.to_owned();
                while !tree.contains(';') && i + 1 < lines.len() {
                    i += 1;
                    tree.push(' ');
                    tree.push_str(lines[i].trim());
                }
                use_leaves(&tree, &mut names.all);
                i += 1;
                continue;
            }
            for qualifier in ["async ", "unsafe ", "extern \"C\" "] {
                rest = rest.strip_prefix(qualifier).unwrap_or(rest);
            }
            if let Some(after) = rest.strip_prefix("const ")
                && !after.starts_with("fn ")
            {
                rest = after;
                if let Some(name) = leading_ident(rest) {
                    names.all.insert(name.to_owned());
                }
                i += 1;
                continue;
            }
            rest = rest.strip_prefix("const ").unwrap_or(rest);
            let keyword = leading_ident(rest).unwrap_or_default();
            let after = rest[keyword.len()..].trim_start();
            match keyword {
                "fn" | "struct" | "type" | "static" | "union" | "mod" => {
                    if let Some(name) = leading_ident(after) {
                        names.all.insert(name.to_owned());
                        if keyword == "mod" {
                            names.modules.insert(name.to_owned());
                        }
                    }
                }
                "enum" | "trait" => {
                    if let Some(name) = leading_ident(after) {
                        names.all.insert(name.to_owned());
                    }
                    // The body, as rustfmt lays it out: items one level in,
                    // from the line that opens it (after a `where` clause, say)
                    // up to the closing brace at the item's own indentation. A
                    // body on one line (`{}`) has no items to read.
                    let own = indent(line);
                    let close = format!("{}}}", " ".repeat(own));
                    let mut j = i;
                    while j < lines.len() && !lines[j].trim_end().ends_with('{') {
                        if lines[j].contains('}') || lines[j].trim_end().ends_with(';') {
                            j = lines.len();
                        }
                        j += 1;
                    }
                    j += 1;
                    while j < lines.len() && lines[j].trim_end() != close {
                        let inner = lines[j];
                        if indent(inner) == own + 4 {
                            let item = inner.trim_start();
                            if keyword == "enum" {
                                // `Name,`, `Name(..)`, `Name { .. }`, `Name = 1,`
                                if item.starts_with(|c: char| c.is_ascii_uppercase())
                                    && let Some(variant) = leading_ident(item)
                                    && matches!(
                                        item[variant.len()..].chars().next(),
                                        None | Some(',' | '(' | ' ')
                                    )
                                {
                                    names.all.insert(variant.to_owned());
                                }
                            } else {
                                let item = item.strip_prefix("async ").unwrap_or(item);
                                for kind in ["fn ", "const ", "type "] {
                                    if let Some(name) =
                                        item.strip_prefix(kind).and_then(leading_ident)
                                    {
                                        names.all.insert(name.to_owned());
                                    }
                                }
                            }
                        }
                        j += 1;
                    }
                }
                // A public field: `pub name: Type`.
                name if !name.is_empty() && after.starts_with(':') && !after.starts_with("::") => {
                    names.all.insert(name.to_owned());
                }
                _ => {}
            }
            i += 1;
        }
    }
    names
}

/// Every crate's names, and their union.
struct Public {
    crates: Vec<(&'static str, Names)>,
    any: Names,
}

impl Public {
    fn read(root: &Path) -> Public {
        let crates: Vec<(&'static str, Names)> = CRATES
            .iter()
            .map(|(name, dir)| (*name, names_in(&root.join(dir))))
            .collect();
        let mut any = Names::default();
        for (name, names) in &crates {
            any.all.insert((*name).to_owned());
            any.all.extend(names.all.iter().cloned());
            any.modules.extend(names.modules.iter().cloned());
        }
        Public { crates, any }
    }

    fn of_crate(&self, name: &str) -> Option<&Names> {
        self.crates
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, names)| names)
    }
}

// ---------------------------------------------------------------- the docs

/// A name a doc uses that idem does not have.
#[derive(Debug, PartialEq)]
struct Missing {
    line: usize,
    name: String,
    context: String,
}

/// Where a path was found: inline code is checked strictly, a code block only for
/// paths that are clearly idem's.
#[derive(Clone, Copy, PartialEq)]
enum Context {
    Inline,
    Block,
}

fn is_camel_case(s: &str) -> bool {
    s.starts_with(|c: char| c.is_ascii_uppercase()) && s.chars().any(|c| c.is_ascii_lowercase())
}

/// Skips a balanced `open`..`close` group starting at `chars[i]` (which is
/// `open`); returns the index after it.
fn skip_group(chars: &[char], mut i: usize, open: char, close: char) -> usize {
    let mut depth = 0;
    while i < chars.len() {
        if chars[i] == open {
            depth += 1;
        } else if chars[i] == close {
            depth -= 1;
            if depth == 0 {
                return i + 1;
            }
        }
        i += 1;
    }
    i
}

/// Reads the identifier at `chars[i]`; returns it and the index after it.
fn read_ident(chars: &[char], mut i: usize) -> (String, usize) {
    let mut ident = String::new();
    while i < chars.len() && is_ident_char(chars[i]) {
        ident.push(chars[i]);
        i += 1;
    }
    (ident, i)
}

/// The methods called along a chain that starts at `chars[i]`, right after a
/// path: `(..).spawn()`, `(..).await?.idem()`, across lines and `//` comments.
fn chain_methods(chars: &[char], mut i: usize) -> Vec<String> {
    let mut methods = Vec::new();
    loop {
        while i < chars.len() && chars[i].is_whitespace() {
            i += 1;
        }
        if chars[i..].starts_with(&['/', '/']) {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
            continue;
        }
        match chars.get(i) {
            Some('(') => i = skip_group(chars, i, '(', ')'),
            Some('?') => i += 1,
            Some('.') if chars.get(i + 1).is_some_and(|c| is_ident_start(*c)) => {
                let (ident, after) = read_ident(chars, i + 1);
                i = after;
                if chars[i..].starts_with(&[':', ':', '<']) {
                    i = skip_group(chars, i + 2, '<', '>');
                }
                if ident != "await" && chars.get(i) == Some(&'(') {
                    methods.push(ident);
                }
            }
            _ => return methods,
        }
    }
}

/// Checks the Rust paths in one piece of code (an inline span or a code block)
/// that starts on line `line` of its file.
fn check_code(code: &str, line: usize, context: Context, public: &Public, out: &mut Vec<Missing>) {
    let chars: Vec<char> = code.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        // A name glued to what precedes it is part of something else: a longer
        // word, a hyphenated header (`Retry-After`), a path, URL or URN, a method
        // (read with its chain below), a lifetime, a shell variable, a URL's
        // query (`a=1&b=2`). `&mut Tx` is Rust.
        let glued = i > 0
            && match chars[i - 1] {
                p if is_ident_char(p) => true,
                '-' | '/' | '.' | '\'' | '$' | '@' | '%' | ':' => true,
                '&' => i > 1 && is_ident_char(chars[i - 2]),
                _ => false,
            };
        if !is_ident_start(c) || glued {
            i += 1;
            continue;
        }
        let start = i;
        let mut segments = Vec::new();
        let (first, mut j) = read_ident(&chars, i);
        segments.push(first);
        while chars[j..].starts_with(&[':', ':']) {
            let mut k = j + 2;
            if chars.get(k) == Some(&'<') {
                k = skip_group(&chars, k, '<', '>');
                if !chars[k..].starts_with(&[':', ':']) {
                    break;
                }
                k += 2;
            }
            if !chars.get(k).is_some_and(|c| is_ident_start(*c)) {
                break;
            }
            let (ident, after) = read_ident(&chars, k);
            segments.push(ident);
            j = after;
        }
        i = j;
        // Hyphenated words (`Idempotency-Key`), URLs, and for a lone word: a file
        // name (`Cargo.toml`) or a header (`Location: /orders/7`).
        let next = chars.get(j).copied();
        let after_next = chars.get(j + 1).copied();
        let lone = segments.len() == 1;
        if matches!(next, Some('-' | '/' | '@'))
            || (lone && next == Some('.') && after_next.is_some_and(|c| c.is_ascii_lowercase()))
            || (lone && next == Some(':') && after_next != Some(':'))
        {
            continue;
        }
        let text: String = chars[start..j].iter().collect();
        let root = segments[0].as_str();
        let mut report = |name: &str| {
            out.push(Missing {
                line: line + chars[..start].iter().filter(|c| **c == '\n').count(),
                name: name.to_owned(),
                context: text.clone(),
            })
        };
        let (names, strong) = if let Some(names) = public.of_crate(root) {
            (names, true)
        } else if is_camel_case(root) {
            if public.any.all.contains(root) {
                (&public.any, true)
            } else {
                if context == Context::Inline && !OTHERS.contains(&root) {
                    report(root);
                }
                continue;
            }
        } else if context == Context::Inline
            && segments.len() > 1
            && public.any.modules.contains(root)
        {
            (&public.any, false)
        } else {
            continue;
        };
        for segment in &segments[1..] {
            if !names.all.contains(segment) {
                report(segment);
            }
        }
        if strong {
            for method in chain_methods(&chars, j) {
                if !public.any.all.contains(&method) && !OTHER_METHODS.contains(&method.as_str()) {
                    report(&method);
                }
            }
        }
    }
}

/// Every name `markdown` uses that idem does not have.
fn check_markdown(markdown: &str, public: &Public) -> Vec<Missing> {
    let mut missing = Vec::new();
    // Code blocks first; their lines are then blanked out of the prose, which
    // keeps its line numbers.
    let mut prose = String::new();
    let mut block: Option<(usize, String)> = None;
    for (n, line) in markdown.lines().enumerate() {
        let fence = line.trim_start().starts_with("```") || line.trim_start().starts_with("~~~");
        match (&mut block, fence) {
            (None, true) => block = Some((n + 2, String::new())),
            (Some((first, code)), true) => {
                check_code(code, *first, Context::Block, public, &mut missing);
                block = None;
            }
            (Some((_, code)), false) => {
                code.push_str(line);
                code.push('\n');
            }
            (None, false) => prose.push_str(line),
        }
        prose.push('\n');
    }
    // Inline code: a run of backticks up to the next run of the same length,
    // within a paragraph.
    let bytes = prose.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'`' {
            i += 1;
            continue;
        }
        let run = bytes[i..].iter().take_while(|b| **b == b'`').count();
        let open = i + run;
        let mut j = open;
        let mut close = None;
        while j < bytes.len() {
            if bytes[j] == b'`' {
                let r = bytes[j..].iter().take_while(|b| **b == b'`').count();
                if r == run {
                    close = Some(j);
                    break;
                }
                j += r;
            } else {
                j += 1;
            }
        }
        match close {
            Some(end) if !prose[open..end].contains("\n\n") => {
                let line = 1 + prose[..open].matches('\n').count();
                check_code(
                    &prose[open..end],
                    line,
                    Context::Inline,
                    public,
                    &mut missing,
                );
                i = end + run;
            }
            _ => i = open,
        }
    }
    missing.sort_by_key(|m| m.line);
    missing
}

/// The Markdown files the check covers.
fn markdown_files(root: &Path) -> Vec<PathBuf> {
    let mut files = vec![root.join("README.md"), root.join("ARCHITECTURE.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    let mut readmes: Vec<PathBuf> = std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.is_dir()
                && p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("idem-"))
        })
        .map(|p| p.join("README.md"))
        .filter(|p| p.is_file())
        .collect();
    readmes.sort();
    files.extend(readmes);
    files
}

#[test]
fn every_idem_item_the_markdown_names_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let public = Public::read(root);
    // Guard the reader itself: a handful of names it must find.
    for name in [
        "Idem",
        "with_in_flight_wait",
        "process_once",
        "Applied",
        "tenant_id",
        "idempotent",
        "IdempotencyMiddleware",
        "sqlite_now_ms",
        "key_digest",
    ] {
        assert!(
            public.any.all.contains(name),
            "the source reader misses {name}"
        );
    }
    let files = markdown_files(root);
    assert!(files.len() >= 10, "{files:?}");
    let mut report = String::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for m in check_markdown(&text, &public) {
            report.push_str(&format!(
                "{}:{}: `{}` names `{}`, which is no public item of idem{}\n",
                file.strip_prefix(root).unwrap().display(),
                m.line,
                m.context,
                m.name,
                if is_camel_case(&m.name) && !m.context.contains("::") {
                    " (if it is another crate's, add it to OTHERS in tests/docs.rs)"
                } else {
                    ""
                }
            ));
        }
    }
    assert!(
        report.is_empty(),
        "names in the docs that do not exist:\n{report}"
    );
}

/// The check on a made-up page: what exists passes, what does not is reported
/// with its line.
#[test]
fn the_check_reports_a_name_that_does_not_exist() {
    let public = Public::read(Path::new(env!("CARGO_MANIFEST_DIR")));
    let page = "# A page\n\
        \n\
        Build an `Idem<Sqlite>` with `Idem::new(pool).with_in_flight_wait(d)`, and\n\
        `Reconciler::<_, Redis>::on_store`; see `idem_runtime::transition::States`.\n\
        See `idem_runtime::transition::TransitionBackend` and `Idem::with_magic`.\n\
        \n\
        ```rust\n\
        let sweeper = Sweeper::new(pool)\n    .with_interval(d) // every minute\n    .spawn_forever();\n\
        let mine = MyOwnType::whatever();\n\
        ```\n\
        \n\
        An `UnknownThing` and a `consumer::process_twice`.\n";
    let found: Vec<(usize, String)> = check_markdown(page, &public)
        .into_iter()
        .map(|m| (m.line, m.name))
        .collect();
    assert_eq!(
        found,
        [
            (5, "TransitionBackend".to_owned()),
            (5, "with_magic".to_owned()),
            (8, "spawn_forever".to_owned()),
            (14, "UnknownThing".to_owned()),
            (14, "process_twice".to_owned()),
        ]
    );
}

// ---------------------------------------------------------------- the links

/// The anchor GitHub gives a heading: lowercase, punctuation dropped (but `-`
/// and `_`), spaces as `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown file: its headings' slugs (outside code blocks),
/// numbered `-1`, `-2` when a heading repeats, as GitHub numbers them.
fn anchors(markdown: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut in_code = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code || !line.starts_with('#') {
            continue;
        }
        let base = slug(line.trim_start_matches('#'));
        let mut candidate = base.clone();
        let mut n = 0;
        while out.contains(&candidate) {
            n += 1;
            candidate = format!("{base}-{n}");
        }
        out.insert(candidate);
    }
    out
}

/// The relative links of a Markdown file, outside code blocks: `(line, target)`
/// for each `](target)` that is not a URL.
fn relative_links(markdown: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut in_code = false;
    for (i, line) in markdown.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            let target = &after[..end];
            if !target.contains("://") && !target.starts_with("mailto:") {
                out.push((i + 1, target.to_owned()));
            }
            rest = &after[end..];
        }
    }
    out
}

/// Each broken link of one file, described.
fn broken_links(root: &Path, file: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(file).unwrap();
    let dir = file.parent().unwrap();
    let mut out = Vec::new();
    for (line, target) in relative_links(&text) {
        let (path, anchor) = match target.split_once('#') {
            Some((p, a)) => (p, Some(a)),
            None => (target.as_str(), None),
        };
        let resolved = if path.is_empty() {
            file.to_path_buf()
        } else {
            dir.join(path)
        };
        let shown = file.strip_prefix(root).unwrap().display();
        if !resolved.exists() {
            out.push(format!("{shown}:{line}: `{target}`: no such file"));
            continue;
        }
        if let Some(anchor) = anchor
            && resolved.extension().is_some_and(|e| e == "md")
        {
            let headings = anchors(&std::fs::read_to_string(&resolved).unwrap());
            if !headings.contains(anchor) {
                out.push(format!(
                    "{shown}:{line}: `{target}`: no heading has that anchor"
                ));
            }
        }
    }
    out
}

/// Every relative link of the docs reaches a file, and every anchor a heading
/// of it: moving a section into docs/ cannot leave a link behind.
#[test]
fn every_link_of_the_markdown_reaches_its_file_and_heading() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = markdown_files(root);
    files.extend(
        ["BENCHMARKS.md", "CHANGELOG.md", "fuzz/README.md"]
            .iter()
            .map(|f| root.join(f)),
    );
    let mut links = 0;
    let mut report = Vec::new();
    for file in &files {
        links += relative_links(&std::fs::read_to_string(file).unwrap()).len();
        report.extend(broken_links(root, file));
    }
    assert!(links >= 50, "the link reader finds too few links: {links}");
    assert!(report.is_empty(), "broken links:\n{}", report.join("\n"));
}

/// The link check on made-up pages: a missing file and a missing anchor are
/// reported, a present one is not.
#[test]
fn the_link_check_reports_a_missing_file_and_a_missing_anchor() {
    let dir = std::env::temp_dir().join(format!("idem-docs-links-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("b.md"), "# B page\n\n## Two words: here\n").unwrap();
    std::fs::write(
        dir.join("a.md"),
        "# A\n\n[ok](b.md#two-words-here) [gone](c.md) [bad](b.md#nowhere) [self](#a)\n\
         ```\n[in code](x.md)\n```\n",
    )
    .unwrap();
    let found = broken_links(&dir, &dir.join("a.md"));
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(
        found,
        [
            "a.md:3: `c.md`: no such file".to_owned(),
            "a.md:3: `b.md#nowhere`: no heading has that anchor".to_owned(),
        ]
    );
}

/// The README is a guide a newcomer reads through: reference material goes to docs/.
#[test]
fn the_readme_stays_a_guide_of_at_most_350_lines() {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(
        lines <= 350,
        "README.md has {lines} lines; move reference material into docs/"
    );
}

/// The first ```rust block after `heading` in `markdown`.
fn rust_block_after(markdown: &str, heading: &str) -> String {
    let from = markdown
        .find(heading)
        .unwrap_or_else(|| panic!("no heading {heading:?}"));
    let rest = &markdown[from..];
    let open = rest.find("```rust\n").expect("a rust block") + "```rust\n".len();
    let len = rest[open..].find("```").expect("the block ends");
    rest[open..open + len].to_owned()
}

/// The leased handler README.md and docs/leased-mode.md show is the one
/// `tests/attribute_shapes/readme_leased.rs` compiles and mounts, so the
/// snippet a newcomer copies builds against the API as it is.
#[test]
fn the_leased_handler_the_docs_show_is_a_shape_that_compiles() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let read = |p: &str| std::fs::read_to_string(root.join(p)).unwrap();
    let shape = read("tests/attribute_shapes/readme_leased.rs");
    let begin =
        shape.find("// README: begin\n").expect("begin marker") + "// README: begin\n".len();
    let end = shape.find("// README: end\n").expect("end marker");
    let compiled = &shape[begin..end];
    for (file, heading) in [
        ("README.md", "## Leased mode"),
        ("docs/leased-mode.md", "## The handler"),
    ] {
        assert_eq!(
            rust_block_after(&read(file), heading),
            compiled,
            "{file}'s leased handler is not the one tests/attribute_shapes/readme_leased.rs compiles"
        );
    }
}
