//! What the manifests promise about versions: idem-runtime requires idem-macros
//! exactly (the macro emits calls into the runtime's private items, so the two
//! must move together, as serde and serde_derive do), and nothing else is pinned
//! with `=` (docs/decisions.md, "Dependencies": caret ranges from the lowest
//! version that works).

use std::path::Path;

fn manifest(path: &str) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(root.join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The dependency lines of a manifest (`name = ..` under a dependencies table)
/// that require a version with `=`.
fn exact_requirements(text: &str) -> Vec<String> {
    let mut in_deps = false;
    let mut found = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_deps = line.contains("dependencies");
            continue;
        }
        if in_deps && !line.starts_with('#') && line.contains("version = \"=") {
            found.push(line.to_owned());
        }
    }
    found
}

#[test]
fn the_runtime_requires_the_macro_crate_exactly_and_nothing_else_is_pinned() {
    let workspace = manifest("Cargo.toml");
    let pinned = exact_requirements(&workspace);
    assert_eq!(pinned.len(), 1, "{pinned:#?}");
    assert!(
        pinned[0].starts_with("idem-macros = ")
            && pinned[0].contains(&format!("version = \"={}\"", env!("CARGO_PKG_VERSION"))),
        "{pinned:#?}"
    );
    let runtime = manifest("idem-runtime/Cargo.toml");
    assert!(
        runtime
            .lines()
            .any(|l| l.trim() == "idem-macros.workspace = true"),
        "idem-runtime takes idem-macros from the workspace's exact requirement"
    );
    for path in [
        "idem-runtime/Cargo.toml",
        "idem-macros/Cargo.toml",
        "idem-wire/Cargo.toml",
        "idem-client/Cargo.toml",
        "idem-cli/Cargo.toml",
    ] {
        let pinned = exact_requirements(&manifest(path));
        assert!(pinned.is_empty(), "{path}: {pinned:#?}");
    }
}

/// The README's dependency lines name features idem-runtime has, and each turns
/// on one database (the default `postgres` off wherever another is named).
#[test]
fn the_readmes_dependency_lines_name_real_features() {
    let readme = manifest("README.md");
    let runtime = manifest("idem-runtime/Cargo.toml");
    let features: Vec<&str> = runtime
        .split("[features]")
        .nth(1)
        .expect("idem-runtime has features")
        .lines()
        .take_while(|l| !l.starts_with('['))
        .filter_map(|l| l.split_once(" = ").map(|(name, _)| name.trim()))
        .collect();
    let lines: Vec<&str> = readme
        .lines()
        .filter(|l| l.starts_with("idem-runtime = "))
        .collect();
    assert_eq!(lines.len(), 3, "one line per database: {lines:#?}");
    for line in lines {
        let named: Vec<&str> = line
            .split("features = [")
            .nth(1)
            .map(|rest| {
                rest.split(']')
                    .next()
                    .unwrap_or_default()
                    .split(',')
                    .map(|f| f.trim().trim_matches('"'))
                    .collect()
            })
            .unwrap_or_default();
        for f in &named {
            assert!(
                features.contains(f),
                "{line}: no feature {f:?} in {features:?}"
            );
        }
        if !named.is_empty() {
            assert!(
                line.contains("default-features = false"),
                "{line}: the default postgres stays on"
            );
        }
    }
}
