//! What a run of the `idem` binary gave: its exit code and both outputs, shown
//! whole when an assertion fails. Shared by the CLI's suites (`mod out;`).

use serde_json::Value;

pub struct Out {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl std::fmt::Debug for Out {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {}\n--- stdout\n{}--- stderr\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

impl Out {
    /// What `output` of the finished process holds.
    pub fn of(out: std::process::Output) -> Out {
        Out {
            code: out.status.code().expect("exited, not killed"),
            stdout: String::from_utf8(out.stdout).unwrap(),
            stderr: String::from_utf8(out.stderr).unwrap(),
        }
    }

    /// Standard output as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("{e}: {self:?}"))
    }

    /// The documented error shape: exit `code`, exactly one line on stderr
    /// naming `needle`, nothing on stdout, no panic.
    pub fn assert_error(&self, code: i32, needle: &str) {
        assert_eq!(self.code, code, "{self:?}");
        assert_eq!(self.stderr.lines().count(), 1, "{self:?}");
        assert!(self.stderr.starts_with("idem: error: "), "{self:?}");
        assert!(self.stderr.contains(needle), "{needle:?} in {self:?}");
        assert!(self.stdout.is_empty(), "{self:?}");
        assert!(!self.stderr.contains("panicked"), "{self:?}");
    }
}
