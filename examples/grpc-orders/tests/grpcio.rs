//! Python's grpcio drives the example (`tests/grpcio_client.py`), with stubs
//! generated from `proto/orders.proto` by grpcio-tools: a client nobody here
//! wrote. The virtualenv (grpcio and grpcio-tools, pinned, from PyPI) is made
//! once, under `IDEM_GRPCIO_VENV` (default `/tmp/idem-grpcio-venv`).

mod harness;

use std::path::{Path, PathBuf};
use std::process::Command;

use harness::{Db, Server};

const GRPCIO: &str = "1.85.1";

/// The virtualenv's python, with grpcio and grpcio-tools at [`GRPCIO`].
fn python() -> PathBuf {
    let venv = PathBuf::from(
        std::env::var("IDEM_GRPCIO_VENV").unwrap_or_else(|_| "/tmp/idem-grpcio-venv".into()),
    );
    let python = venv.join("bin/python");
    let ready = || {
        Command::new(&python)
            .args(["-c", "import grpc, grpc_tools; print(grpc.__version__)"])
            .output()
            .is_ok_and(|o| {
                o.status.success() && String::from_utf8_lossy(&o.stdout).trim() == GRPCIO
            })
    };
    if !ready() {
        let _ = std::fs::remove_dir_all(&venv);
        let made = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .expect("python3 runs");
        assert!(made.success(), "python3 -m venv {} failed", venv.display());
        let installed = Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .arg(format!("grpcio=={GRPCIO}"))
            .arg(format!("grpcio-tools=={GRPCIO}"))
            .status()
            .expect("pip runs");
        assert!(installed.success(), "pip could not install grpcio {GRPCIO}");
        assert!(
            ready(),
            "grpcio {GRPCIO} is not importable from {}",
            venv.display()
        );
    }
    python
}

#[tokio::test]
async fn pythons_grpcio_gets_the_promise_from_the_proto_alone() {
    let python = tokio::task::spawn_blocking(python).await.unwrap();
    let db = harness::SqliteDb::create().await;
    let server = Server::start(&db.url(), &[]).await;
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = tokio::process::Command::new(python)
        .arg(root.join("tests/grpcio_client.py"))
        .arg(server.addr())
        .arg(root.join("proto"))
        .output()
        .await
        .expect("the grpcio client runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the grpcio client failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("6 passed, 0 failed"), "{stdout}");
    db.drop().await;
}
