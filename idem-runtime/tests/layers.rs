//! The runtime's layers have no circle: the database modules (`db/`) and the
//! vocabulary they speak sit at the bottom and import nothing of idem's above
//! them (ARCHITECTURE.md, "Layers").
//!
//! ```text
//! handler/, lease/, redis/, reconcile, sweeper, stats, admin, transition,
//! consumer, config (Idem), flight, replay_cache, openapi, ...     above
//! ------------------------------------------------------------------------
//! db/ (every statement, the Backend trait, Tx)                      the bottom
//! model (requests, outcomes, records, addresses, errors), key,
//! fingerprint, decide (the claim's pure decisions), metrics (names),
//! at_rest (sealing stored answers), recent (keys seen finished: a hint)
//! ```
//!
//! The check reads the source: every `crate::x` (or `$crate::x`) path in code,
//! not in comments, of a file at the bottom must name a module at the bottom.
//! Run it with `cargo test -p idem-runtime --test layers`.

use std::path::{Path, PathBuf};

/// The modules at the bottom, and the macros defined there.
const BOTTOM: &[&str] = &[
    "at_rest",
    "db",
    "model",
    "key",
    "fingerprint",
    "decide",
    "metrics",
    "recent",
    "mysql_now_ms",
    "sqlite_now_ms",
];

/// The files of the bottom layer, relative to `src/`.
fn is_bottom(file: &str) -> bool {
    file.starts_with("db/")
        || file.starts_with("model/")
        || [
            "model.rs",
            "key.rs",
            "fingerprint.rs",
            "decide.rs",
            "metrics.rs",
            "at_rest.rs",
            "recent.rs",
        ]
        .contains(&file)
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The first segment of every `crate::` path in the code of `source` (line
/// comments and doc comments left out), with its line number.
fn crate_paths(source: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    for (n, line) in source.lines().enumerate() {
        let code = match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        };
        let mut rest = code;
        while let Some(i) = rest.find("crate::") {
            let after = &rest[i + "crate::".len()..];
            let segment: String = after
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            // `use crate::{a, b}` names several.
            if segment.is_empty() && after.starts_with('{') {
                let group = &after[1..after.find('}').unwrap_or(after.len())];
                for part in group.split(',') {
                    let name: String = part
                        .trim()
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    if !name.is_empty() {
                        found.push((n + 1, name));
                    }
                }
            } else if !segment.is_empty() {
                found.push((n + 1, segment));
            }
            rest = after;
        }
    }
    found
}

#[test]
fn no_module_at_the_bottom_imports_one_above_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut bottom_files = 0;
    let mut upward = Vec::new();
    for path in files {
        let rel = path
            .strip_prefix(&src)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        if !is_bottom(&rel) {
            continue;
        }
        bottom_files += 1;
        let source = std::fs::read_to_string(&path).unwrap();
        for (line, module) in crate_paths(&source) {
            if !BOTTOM.contains(&module.as_str()) {
                upward.push(format!("src/{rel}:{line}: crate::{module}"));
            }
        }
    }
    // The walk found the layer (a moved `src/` would make the test vacuous).
    assert!(bottom_files > 20, "only {bottom_files} files at the bottom");
    assert!(
        upward.is_empty(),
        "the bottom layer imports from above it:\n{}",
        upward.join("\n")
    );
}

#[test]
fn the_check_sees_every_spelling_of_an_import() {
    let source = "use crate::config::Idem;\n\
                  use crate::{key::KeyDigest, transition::Resource};\n\
                  fn f(x: &$crate::admin::KeyAddress<'_>) {}\n\
                  /// [`crate::handler`] in a doc comment is not an import\n\
                  let y = 1; // crate::lease in a comment neither\n";
    let names: Vec<String> = crate_paths(source).into_iter().map(|(_, m)| m).collect();
    assert_eq!(names, ["config", "key", "transition", "admin"]);
}
