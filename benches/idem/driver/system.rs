//! The server children, what `/proc` says about them, the machine, and the
//! databases' creation and removal.

use tokio::io::AsyncBufReadExt;

use super::*;

/// A bench server child process.
pub struct Server {
    child: tokio::process::Child,
    pub pid: u32,
    pub base: String,
    /// The PostgreSQL database, to find its backends' CPU time (none for SQLite).
    pub database: Option<String>,
    /// The redis-server processes its records are in (Redis scenarios), whose
    /// CPU time takes the proxy's column.
    pub redis_pids: Vec<u32>,
}

impl Server {
    /// Starts this binary as a server on `database_url` (a `postgres://` URL, or a
    /// `sqlite:` file with `IDEM_BENCH_BACKEND=sqlite` in `extra_env`).
    pub async fn start(database_url: &str, extra_env: &[(&str, String)]) -> Result<Server, String> {
        Self::start_as("server", LISTENING, database_url, extra_env).await
    }

    /// Starts this binary in `role` (`server`, or `grpc` for the grpc-orders
    /// example), which prints `listening` and its address once it listens.
    pub async fn start_as(
        role: &str,
        listening: &str,
        database_url: &str,
        extra_env: &[(&str, String)],
    ) -> Result<Server, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        // `IDEM_BENCH_SERVER_WRAPPER="valgrind --tool=callgrind"` profiles the server.
        let wrapper = std::env::var("IDEM_BENCH_SERVER_WRAPPER").unwrap_or_default();
        let mut words = wrapper.split_whitespace();
        let mut cmd = match words.next() {
            Some(program) => {
                let mut c = tokio::process::Command::new(program);
                c.args(words).arg(exe);
                c
            }
            None => tokio::process::Command::new(exe),
        };
        cmd.env(ROLE_ENV, role)
            .env("DATABASE_URL", database_url)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .kill_on_drop(true);
        for (k, v) in extra_env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start the server: {e}"))?;
        let pid = child.id().ok_or("the server exited at once")?;
        let stdout = child.stdout.take().ok_or("no server stdout")?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let addr = tokio::time::timeout(Duration::from_secs(60), async {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(addr) = line.strip_prefix(listening) {
                    return Some(addr.trim().to_owned());
                }
            }
            None
        })
        .await
        .ok()
        .flatten()
        .ok_or("the server did not report its address")?;
        let database = database_url.starts_with("postgres").then(|| {
            database_url
                .split('?')
                .next()
                .and_then(|u| u.rsplit('/').next())
                .unwrap_or_default()
                .to_owned()
        });
        Ok(Server {
            child,
            pid,
            base: format!("http://{addr}"),
            database,
            redis_pids: Vec::new(),
        })
    }

    /// What [`cpu_snapshot`] reads, detached from the child (for a spawned task).
    pub fn probe(&self) -> Probe {
        Probe {
            pid: self.pid,
            database: self.database.clone(),
            redis_pids: self.redis_pids.clone(),
        }
    }

    pub async fn stop(mut self) {
        drop(self.child.stdin.take());
        if tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

/// `VmRSS` and `VmHWM` of a process, in KiB.
pub fn memory_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Resets a process's peak RSS to its current RSS (Linux `clear_refs` 5).
pub fn reset_peak(pid: u32) {
    let _ = std::fs::write(format!("/proc/{pid}/clear_refs"), "5");
}

/// Name and user plus system CPU in clock ticks (USER_HZ, 100 on Linux) of a
/// process (`/proc/<pid>/stat`) or of one thread (`/proc/<pid>/task/<tid>/stat`).
fn cpu_ticks(stat_path: &str) -> Option<(String, u64)> {
    let stat = std::fs::read_to_string(stat_path).ok()?;
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat[open + 1..close].to_owned();
    let fields: Vec<&str> = stat[close + 2..].split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((comm, utime + stime))
}

/// CPU ticks of the server's threads named `dbproxy*`: the proxy's.
fn proxy_ticks(server_pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{server_pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| cpu_ticks(&format!("{}/stat", t.path().display())))
        .filter(|(comm, _)| comm.starts_with(proxy::THREAD_PREFIX))
        .map(|(_, ticks)| ticks)
        .sum()
}

/// CPU ticks of the PostgreSQL backends serving `database` (their process title
/// names it: `postgres: user database host(port) state`). Backends of other
/// databases, whatever else runs on the machine, and PostgreSQL's background
/// processes are not counted.
fn backend_ticks(database: &str) -> u64 {
    let needle = format!(" {database} ");
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let mut pg = 0;
    for entry in dir.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.bytes().all(|b| b.is_ascii_digit())
            && let Some((comm, ticks)) = cpu_ticks(&format!("/proc/{name}/stat"))
            && comm == "postgres"
            && std::fs::read(format!("/proc/{name}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&needle))
        {
            pg += ticks;
        }
    }
    pg
}

/// A server's pid, database and Redis servers.
#[derive(Clone)]
pub struct Probe {
    pid: u32,
    database: Option<String>,
    redis_pids: Vec<u32>,
}

/// CPU ticks of: the server without its proxy threads, the PostgreSQL backends of
/// its database, this driver, and the server's proxy threads plus the
/// redis-server processes of a Redis scenario (which has no proxy).
pub fn cpu_snapshot(server: &Probe) -> [u64; 4] {
    let total = cpu_ticks(&format!("/proc/{}/stat", server.pid)).map_or(0, |c| c.1);
    let proxy = proxy_ticks(server.pid);
    let pg = server.database.as_deref().map_or(0, backend_ticks);
    let me = cpu_ticks("/proc/self/stat").map_or(0, |c| c.1);
    let redis: u64 = server
        .redis_pids
        .iter()
        .filter_map(|pid| cpu_ticks(&format!("/proc/{pid}/stat")))
        .map(|(_, ticks)| ticks)
        .sum();
    [total.saturating_sub(proxy), pg, me, proxy + redis]
}

pub const TICK_SECS: f64 = 0.01;

pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

pub fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|m| m.trim_start_matches([' ', '\t', ':']).to_owned())
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem_kib: u64 = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    format!(
        "{cores} cores ({model}), {:.1} GiB memory",
        mem_kib as f64 / 1024.0 / 1024.0
    )
}

pub fn database_url(admin: &str, name: &str) -> String {
    let (base, query) = match admin.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (admin, None),
    };
    let authority_end = base
        .find("://")
        .map(|i| i + 3)
        .and_then(|start| base[start..].find('/').map(|j| start + j))
        .unwrap_or(base.len());
    let mut url = format!("{}/{name}", &base[..authority_end]);
    if let Some(q) = query {
        url.push('?');
        url.push_str(q);
    }
    url
}

pub async fn admin_exec(admin: &str, sql: String) -> Result<(), String> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(admin)
        .await
        .map_err(|e| format!("PostgreSQL at {admin}: {e}"))?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(&mut conn)
        .await
        .map_err(|e| e.to_string())?;
    conn.close().await.ok();
    Ok(())
}

/// Drops `idem_bench_<pid>` databases and removes `idem_bench_<pid>.db` SQLite
/// files whose process is gone (a killed run).
pub async fn drop_stale(admin: &str) -> Result<(), String> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(admin)
        .await
        .map_err(|e| format!("PostgreSQL at {admin}: {e}"))?;
    let names: Vec<String> =
        sqlx::query_scalar("SELECT datname FROM pg_database WHERE datname LIKE 'idem\\_bench\\_%'")
            .fetch_all(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
    conn.close().await.ok();
    let gone = |pid: &str| !std::path::Path::new(&format!("/proc/{pid}")).exists();
    for name in names {
        if gone(name.trim_start_matches("idem_bench_")) {
            admin_exec(
                admin,
                format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
            )
            .await?;
        }
    }
    if let Ok(dir) = std::fs::read_dir(std::env::temp_dir()) {
        for entry in dir.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(rest) = name.strip_prefix("idem_bench_")
                && let Some((pid, _)) = rest.split_once(".db")
                && gone(pid)
            {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    Ok(())
}

/// The SQLite file of this run (`idem_bench_<pid>.db` in the temp directory).
pub fn sqlite_path() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("idem_bench_{}.db", std::process::id()))
}

/// Removes the SQLite file and its WAL and shared-memory files.
pub fn remove_sqlite(path: &std::path::Path) {
    for suffix in ["", "-wal", "-shm"] {
        let mut p = path.as_os_str().to_owned();
        p.push(suffix);
        let _ = std::fs::remove_file(p);
    }
}

pub fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}
