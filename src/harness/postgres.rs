//! A throwaway PostgreSQL server: `initdb` into a temporary directory, `postgres` on a
//! free loopback port, readiness by `pg_isready`, fast shutdown on drop. Binaries come
//! from `BATON_PG_BIN_DIR`, PATH, or Debian's `/usr/lib/postgresql/<version>/bin`
//! (`scripts/setup.sh test` installs them). As root (PostgreSQL refuses to run as root)
//! the server runs as the `postgres` system user.
//!
//! One implementation for `baton chaos` and every test that needs a real server (the
//! gateway crate's own tests include this file by path; it depends only on std, anyhow
//! and tempfile for that reason).
#![allow(dead_code)]

use std::net::TcpListener as StdListener;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// The directory holding `initdb`, `postgres` and `pg_isready`.
pub fn bin_dir() -> Option<PathBuf> {
    let has = |d: &Path| ["initdb", "postgres", "pg_isready"].iter().all(|b| d.join(b).is_file());
    if let Some(d) = std::env::var_os("BATON_PG_BIN_DIR") {
        return Some(PathBuf::from(d));
    }
    if let Some(path) = std::env::var_os("PATH") {
        if let Some(d) = std::env::split_paths(&path).find(|d| has(d)) {
            return Some(d);
        }
    }
    // Debian: /usr/lib/postgresql/<major>/bin, newest first.
    let mut dirs: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse::<u32>().ok()?, e.path().join("bin"))))
        .filter(|(_, d)| has(d))
        .collect();
    dirs.sort();
    dirs.pop().map(|(_, d)| d)
}

fn free_port() -> Result<u16> {
    Ok(StdListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn is_root() -> bool {
    std::fs::metadata("/proc/self").map(|m| m.uid() == 0).unwrap_or(false)
}

/// uid and gid of the `postgres` system user.
fn postgres_user() -> Option<(u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    let line = passwd.lines().find(|l| l.starts_with("postgres:"))?;
    let f: Vec<&str> = line.split(':').collect();
    Some((f.get(2)?.parse().ok()?, f.get(3)?.parse().ok()?))
}

/// Why no server could be started: PostgreSQL is not installed here (a test skips,
/// loudly), as opposed to an installed server that failed (an error).
#[derive(Debug)]
pub struct NotInstalled(pub &'static str);

impl std::fmt::Display for NotInstalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for NotInstalled {}

/// A running PostgreSQL server; stopped (fast shutdown) on drop.
pub struct TempPostgres {
    bin: PathBuf,
    dir: tempfile::TempDir,
    pub port: u16,
    run_as: Option<(u32, u32)>,
    child: Option<Child>,
    /// Serving TLS only (`start_tls`): the server's certificate and key files.
    tls: Option<(PathBuf, PathBuf)>,
}

impl TempPostgres {
    /// Starts a fresh server. Without PostgreSQL the error is a [`NotInstalled`].
    pub fn start() -> Result<Self> {
        let Some(bin) = bin_dir() else {
            return Err(NotInstalled("no PostgreSQL (initdb/postgres/pg_isready) on PATH, in BATON_PG_BIN_DIR or /usr/lib/postgresql/*/bin (apt-get install postgresql)").into());
        };
        let run_as = if is_root() {
            Some(postgres_user().ok_or(NotInstalled("running as root and there is no `postgres` user to run PostgreSQL as"))?)
        } else {
            None
        };
        let dir = tempfile::Builder::new().prefix("baton-pg-").tempdir()?;
        if let Some((uid, gid)) = run_as {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid))?;
        }
        let mut pg = TempPostgres { bin, dir, port: free_port()?, run_as, child: None, tls: None };
        let out = pg
            .command("initdb")
            .arg("-D")
            .arg(pg.data())
            .args(["-U", "postgres", "--auth=trust", "-E", "UTF8", "--locale=C", "--no-sync"])
            .output()
            .context("running initdb")?;
        if !out.status.success() {
            bail!("initdb failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        pg.spawn()?;
        Ok(pg)
    }

    /// Starts a fresh server that accepts TCP clients only over TLS (`hostssl` in
    /// `pg_hba.conf`, no plaintext line), presenting `cert_pem` (its chain) and `key_pem`.
    pub fn start_tls(cert_pem: &str, key_pem: &str) -> Result<Self> {
        let mut pg = Self::start()?;
        pg.stop();
        let (cert, key) = (pg.dir.path().join("server.crt"), pg.dir.path().join("server.key"));
        std::fs::write(&cert, cert_pem)?;
        std::fs::write(&key, key_pem)?;
        // PostgreSQL refuses a key file others may read, and must own it.
        std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
        if let Some((uid, gid)) = pg.run_as {
            for f in [&cert, &key] {
                std::os::unix::fs::chown(f, Some(uid), Some(gid))?;
            }
        }
        let hba = "local all all trust\nhostssl all all 127.0.0.1/32 trust\nhostssl all all ::1/128 trust\n";
        std::fs::write(pg.data().join("pg_hba.conf"), hba)?;
        pg.tls = Some((cert, key));
        pg.spawn()?;
        Ok(pg)
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn command(&self, name: &str) -> Command {
        let mut c = Command::new(self.bin.join(name));
        c.current_dir(self.dir.path());
        if let Some((uid, gid)) = self.run_as {
            c.uid(uid).gid(gid);
        }
        c
    }

    /// `postgres://` URL of the server's `postgres` database.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The server's process ID, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The data directory's size in bytes (what the store holds on disk).
    pub fn data_bytes(&self) -> u64 {
        fn walk(p: &Path) -> u64 {
            let Ok(entries) = std::fs::read_dir(p) else { return 0 };
            entries
                .flatten()
                .map(|e| match e.metadata() {
                    Ok(m) if m.is_dir() => walk(&e.path()),
                    Ok(m) => m.len(),
                    Err(_) => 0,
                })
                .sum()
        }
        walk(&self.data())
    }

    /// Starts the server (on the same port and data) and waits until it accepts connections.
    pub fn spawn(&mut self) -> Result<()> {
        if self.child.is_some() {
            bail!("postgres is already running");
        }
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.path().join("postgres.log"))?;
        let mut postgres = self.command("postgres");
        if let Some((cert, key)) = &self.tls {
            postgres.args(["-c", "ssl=on", "-c"]).arg(format!("ssl_cert_file={}", cert.display()));
            postgres.arg("-c").arg(format!("ssl_key_file={}", key.display()));
        }
        let child = postgres
            .arg("-D")
            .arg(self.data())
            .arg("-k")
            .arg(self.dir.path())
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-F", "-c", "max_connections=100"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting postgres")?;
        self.child = Some(child);
        self.wait_ready()
    }

    fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                self.child = None;
                bail!("postgres exited ({status}) before it was ready:\n{}", self.log());
            }
            let ready = self
                .command("pg_isready")
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", "postgres", "-t", "1"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if ready {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("postgres not ready after 60 s:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("postgres.log")).unwrap_or_default()
    }

    /// Fast shutdown (clients are disconnected), waiting until it exited.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else { return };
        let signalled = Command::new("kill").args(["-INT", &child.id().to_string()]).status().map(|s| s.success()).unwrap_or(false);
        if !signalled {
            let _ = child.kill();
        }
        let _ = child.wait();
    }
}

impl Drop for TempPostgres {
    fn drop(&mut self) {
        self.stop();
    }
}
