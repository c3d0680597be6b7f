//! Compile-time behaviour of `#[idempotent]` on tonic service methods (the
//! feature `grpc`): every misuse fails with the message pinned in its `.stderr`
//! (the supported shapes, inside a `#[tonic::async_trait]` impl of a service
//! trait or an inherent `impl`, are ordinary test code: the root package's
//! `tests/attribute_shapes`, its `grpc_` modules). The cases share
//! `tests/ui/grpc/prelude.rs`. Regenerate with
//! `TRYBUILD=overwrite cargo test -p idem-macros --test ui_grpc`.

#[test]
fn ui_grpc() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/grpc/fail/*.rs");
}

/// Every failing case implements the service trait (so that the `impl`, not a
/// stray function, is what fails) and pins one error each time.
#[test]
fn grpc_fail_cases_implement_the_service_and_pin_each_error_once() {
    let mut cases = 0;
    for entry in std::fs::read_dir("tests/ui/grpc/fail").unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "rs") {
            cases += 1;
            let src = std::fs::read_to_string(&path).unwrap();
            assert!(
                src.contains("impl Orders for Service"),
                "{} does not implement the service",
                path.display()
            );
            let stderr = std::fs::read_to_string(path.with_extension("stderr"))
                .unwrap_or_else(|_| panic!("{} has no .stderr", path.display()));
            let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error")).collect();
            let mut unique = errors.clone();
            unique.dedup();
            assert_eq!(
                errors.len(),
                unique.len(),
                "{}: an error repeats",
                path.display()
            );
        }
    }
    assert!(cases >= 8, "only {cases} gRPC failing cases");
}
