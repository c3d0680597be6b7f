//! Compile-time behaviour of `#[idempotent]`: every misuse fails with the message
//! pinned in its `.stderr` (the supported shapes, which compile and mount on a
//! router, are ordinary test code: the root package's `tests/attribute_shapes`).
//! Every case mounts its handler in a `Router` (with the
//! shared `tests/ui/prelude.rs`), as a real service does: a misuse must fail with
//! the attribute's own error only, never with axum's `Handler<_, _>` error too,
//! and no `.stderr` may hold an error twice.
//! The `.stderr` files are pinned to the toolchain of the project's machines
//! (rustc 1.95); regenerate with `TRYBUILD=overwrite cargo test -p idem-macros --test ui`.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/fail/*.rs");
}

/// What the cases promise, checked on the files: at
/// least 45 failing cases (the count only grows; a case is deleted only with
/// the misuse it pins), each mounting its handler in a `Router`, and no pinned
/// `.stderr` with axum's `Handler<_, _>` error or an error that repeats another.
#[test]
fn fail_cases_mount_their_handler_and_pin_one_error_each_time() {
    let mut cases = 0;
    for entry in std::fs::read_dir("tests/ui/fail").unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "rs") {
            cases += 1;
            let src = std::fs::read_to_string(&path).unwrap();
            assert!(
                src.contains("Router::new()") && src.contains("post("),
                "{} does not mount its handler",
                path.display()
            );
            let stderr = std::fs::read_to_string(path.with_extension("stderr"))
                .unwrap_or_else(|_| panic!("{} has no .stderr", path.display()));
            assert!(
                !stderr.contains("Handler<_, _>"),
                "{}: axum's Handler error",
                path.display()
            );
            let headlines: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error")).collect();
            let mut unique = headlines.clone();
            unique.sort();
            unique.dedup();
            assert_eq!(
                headlines.len(),
                unique.len(),
                "{}: an error repeats",
                path.display()
            );
        }
    }
    assert!(cases >= 45, "only {cases} failing cases");
}
