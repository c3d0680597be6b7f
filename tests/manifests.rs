//! What the manifests promise about versions: idem-runtime requires idem-macros
//! exactly (the macro emits calls into the runtime's private items, so the two
//! must move together, as serde and serde_derive do), and nothing else is pinned
//! with `=` (docs/decisions.md, "Dependencies": caret ranges from the lowest
//! version that works). And what `cargo run --example orders` builds: neither the
//! bench's crates nor those of the other examples (docs/testing.md, "What the
//! quickstart builds").

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
    for line in readme_lines_per_database(&readme, "idem-runtime = ") {
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

/// The README's sqlx lines ask for the sqlx the workspace requires (0.9.1 on:
/// docs/decisions.md says why), so a user who copies them reads the floor idem
/// needs.
#[test]
fn the_readmes_sqlx_lines_name_the_workspaces_floor() {
    let version = |line: &str| -> String {
        line.split("version = \"")
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .unwrap_or_default()
            .to_owned()
    };
    let workspace = manifest("Cargo.toml");
    let floor = workspace
        .lines()
        .find(|l| l.starts_with("sqlx = "))
        .map(version)
        .expect("the workspace requires sqlx");
    assert!(!floor.is_empty(), "the workspace's sqlx line has a version");
    let readme = manifest("README.md");
    for line in readme_lines_per_database(&readme, "sqlx = ") {
        assert_eq!(version(line), floor, "{line}");
    }
}

/// The README's dependency lines that start with `prefix`: one per database
/// (PostgreSQL, SQLite, MySQL).
fn readme_lines_per_database<'a>(readme: &'a str, prefix: &str) -> Vec<&'a str> {
    let lines: Vec<&str> = readme.lines().filter(|l| l.starts_with(prefix)).collect();
    assert_eq!(
        lines.len(),
        3,
        "one {prefix:?} line per database: {lines:#?}"
    );
    lines
}

/// The lines of a manifest's table `[name]` (or of each `[[name]]` block, joined),
/// comments and blank lines left out.
fn table<'a>(text: &'a str, name: &str) -> Vec<&'a str> {
    let (single, array) = (format!("[{name}]"), format!("[[{name}]]"));
    let mut inside = false;
    let mut lines = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            inside = line == single || line == array;
            if line == array {
                lines.push(line);
            }
            continue;
        }
        if inside && !line.is_empty() && !line.starts_with('#') {
            lines.push(line);
        }
    }
    lines
}

/// Whether a table's lines declare the dependency `name`.
fn declares(lines: &[&str], name: &str) -> bool {
    lines.iter().any(|l| {
        l.split(['=', '.'])
            .next()
            .is_some_and(|key| key.trim() == name)
    })
}

/// The crates only the bench needs: its peer (axum-idempotent, set up with ruts and
/// tower-cookies).
const BENCH_ONLY: [&str; 3] = ["axum-idempotent", "ruts", "tower-cookies"];

/// The root package's features, each the crates one example (and its tests) needs
/// and `orders` does not, with those targets.
const EXAMPLE_FEATURES: [(&str, &[&str], &str, &str); 3] = [
    ("nats", &["async-nats"], "consumer", "consumer"),
    ("rabbitmq", &["lapin"], "rabbitmq-consumer", "rabbitmq"),
    (
        "client",
        &["idem-client", "reqwest-middleware", "async-trait"],
        "client",
        "client",
    ),
];

/// `cargo run --example orders`, the quickstart, builds the root
/// package's dependencies and every one of its dev-dependencies. So the bench is
/// a crate of its own (benches/idem, its dependencies its own), and what only
/// the broker consumers and the client example use is optional, behind a feature
/// of the root package that those examples and their tests require; the README's
/// test command (`--all-features`) still builds and runs them all.
#[test]
fn the_quickstart_builds_neither_the_benchs_nor_the_other_examples_crates() {
    let root = manifest("Cargo.toml");
    let deps = table(&root, "dependencies");
    let dev = table(&root, "dev-dependencies");
    let features = table(&root, "features");
    let examples = table(&root, "example");
    let tests = table(&root, "test");

    for name in BENCH_ONLY {
        assert!(
            !declares(&deps, name) && !declares(&dev, name),
            "{name}: only the bench needs it, in benches/idem/Cargo.toml"
        );
    }
    for (feature, crates, example, test) in EXAMPLE_FEATURES {
        let line = features
            .iter()
            .find(|l| l.starts_with(&format!("{feature} = ")))
            .unwrap_or_else(|| panic!("no feature {feature:?}: {features:#?}"));
        for name in crates {
            assert!(
                !declares(&dev, name),
                "{name}: a dev-dependency is always built"
            );
            assert!(
                deps.iter()
                    .any(|l| l.starts_with(&format!("{name} = ")) && l.contains("optional = true")),
                "{name}: an optional dependency of the root package"
            );
            assert!(line.contains(&format!("\"dep:{name}\"")), "{line}: {name}");
        }
        for (kind, blocks, target) in [("example", &examples, example), ("test", &tests, test)] {
            let block: Vec<&str> = blocks
                .split(|l| *l == format!("[[{kind}]]"))
                .find(|b| b.contains(&format!("name = \"{target}\"").as_str()))
                .unwrap_or_else(|| panic!("no [[{kind}]] {target:?}"))
                .to_vec();
            assert!(
                block.contains(&format!("required-features = [\"{feature}\"]").as_str()),
                "[[{kind}]] {target}: {block:#?}"
            );
        }
    }

    // The bench: not a target of the root package, but a default member of the
    // workspace, so `cargo bench --bench idem` finds it from the root.
    assert!(
        table(&root, "bench").is_empty(),
        "the bench is benches/idem's"
    );
    let package = table(&root, "package");
    assert!(package.contains(&"autobenches = false"), "{package:#?}");
    let workspace = table(&root, "workspace");
    let default_members = workspace
        .iter()
        .find(|l| l.starts_with("default-members = "))
        .expect("default-members");
    assert!(
        default_members.contains("\".\"") && default_members.contains("\"benches/idem\""),
        "{default_members}"
    );
    assert!(
        workspace
            .iter()
            .any(|l| l.starts_with("members = ") && l.contains("\"benches/idem\"")),
        "{workspace:#?}"
    );
    let bench = manifest("benches/idem/Cargo.toml");
    let bench_package = table(&bench, "package");
    for line in [
        "name = \"idem-bench\"",
        "publish = false",
        "version.workspace = true",
        "edition.workspace = true",
        "license.workspace = true",
    ] {
        assert!(bench_package.contains(&line), "{line}: {bench_package:#?}");
    }
    let bench_dev = table(&bench, "dev-dependencies");
    for name in BENCH_ONLY {
        assert!(declares(&bench_dev, name), "benches/idem: {name}");
    }
    let target = table(&bench, "bench");
    for line in ["name = \"idem\"", "harness = false"] {
        assert!(target.contains(&line), "{line}: {target:#?}");
    }
}

/// Issue 38, item 7: the README's quickstart runs `cargo run --example quickstart`
/// and `cargo run --example orders` as written, so neither may require a feature.
#[test]
fn the_readmes_examples_run_without_a_feature() {
    let root = manifest("Cargo.toml");
    let readme = manifest("README.md");
    let examples = table(&root, "example");
    for name in ["quickstart", "orders"] {
        assert!(
            readme.contains(&format!("cargo run --example {name}")),
            "the README does not run {name}"
        );
        let block = examples
            .split(|l| *l == "[[example]]")
            .find(|b| b.contains(&format!("name = \"{name}\"").as_str()));
        assert!(
            block.is_none_or(|b| !b.iter().any(|l| l.starts_with("required-features"))),
            "[[example]] {name} requires a feature: {block:#?}"
        );
    }
}

/// The Rust files of a directory and its subdirectories.
fn rust_files(dir: &Path, found: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, found);
        } else if path.extension().is_some_and(|e| e == "rs") {
            found.push(path);
        }
    }
}

/// Whether `file` is in an example that is a crate of its own (a manifest of its
/// own, its own dependencies: `examples/grpc-orders`).
fn own_crate(root: &Path, file: &Path) -> bool {
    file.ancestors()
        .take_while(|dir| *dir != root)
        .any(|dir| dir != file && dir.join("Cargo.toml").is_file())
}

/// `--all-features` builds every target with every feature, so it would not see a
/// test or example that uses a feature's crate without requiring the feature (it
/// would break `cargo run --example orders` or a plain `cargo test`): only the
/// feature's own example and test name its crates.
#[test]
fn only_a_features_own_example_and_test_use_its_crates() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in ["examples", "tests", "src"] {
        rust_files(&root.join(dir), &mut files);
    }
    for (feature, crates, example, test) in EXAMPLE_FEATURES {
        let allowed = [
            root.join("examples").join(example),
            root.join("tests").join(format!("{test}.rs")),
        ];
        for file in &files {
            if allowed.iter().any(|a| file.starts_with(a)) || own_crate(root, file) {
                continue;
            }
            let text = std::fs::read_to_string(file).unwrap();
            for name in crates {
                let ident = name.replace('-', "_");
                let used = text.lines().any(|l| {
                    let code = l.trim_start();
                    !code.starts_with("//")
                        && (code.contains(&format!("{ident}::"))
                            || code.starts_with(&format!("use {ident}")))
                });
                assert!(
                    !used,
                    "{}: uses {name}, which only the feature {feature:?} brings in",
                    file.strip_prefix(root).unwrap().display()
                );
            }
        }
    }
}
