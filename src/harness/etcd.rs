//! A real etcd process: free loopback ports, a data directory of its own, killed on
//! drop. The binary is `BATON_ETCD_BIN` or `etcd` on PATH (`scripts/setup.sh test`
//! installs Debian's `etcd-server`). One implementation for `baton chaos` and the tests
//! (`tests/cluster_support/etcd.rs`); it depends only on std, anyhow and tempfile. It
//! compacts and bounds its space as the deployed etcd does ([`DEPLOYED_FLAGS`]).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpListener as StdListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// The deployed etcd's compaction and space settings, which the harness's etcd runs with
/// too, so a soak judges etcd as deployed: `deploy/k8s/base/etcd.yaml` and
/// `deploy/docker/compose.yaml` pass the same flags (a test below reads both manifests).
/// Periodic compaction with a 1 h retention first compacts an hour after start, so a run
/// shorter than that sees every revision kept, as a deployed etcd does in its first hour.
pub const DEPLOYED_FLAGS: &[&str] = &["--auto-compaction-mode=periodic", "--auto-compaction-retention=1h", "--quota-backend-bytes=2147483648"];

/// The etcd binary, if there is one.
pub fn etcd_binary() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("BATON_ETCD_BIN") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join("etcd")).find(|p| p.is_file())
}

/// A loopback port for a process the harness is about to start, free at the time of
/// the call and not handed out before by this process.
///
/// Not `bind(0)`: the kernel draws those ports from its ephemeral range, where the port
/// is free again the moment the probe closes, so a later call (another member of the
/// cluster, or another test's cluster running in parallel) or an outgoing connection
/// could get the same port in the seconds before the child binds it, and the child
/// would exit before listening. These come from just below the ephemeral range, which
/// the kernel never hands out by itself, in order from an offset derived from the
/// process ID, so this process's calls never repeat and parallel processes start far
/// apart; each is checked free by binding it.
pub fn free_port() -> Result<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768);
    let low = ephemeral_low.saturating_sub(12_000).max(1024);
    let span = ephemeral_low.saturating_sub(low);
    if span < 1000 {
        // An ephemeral range reaching down to the privileged ports leaves no room.
        return Ok(StdListener::bind("127.0.0.1:0")?.local_addr()?.port());
    }
    let start = std::process::id().wrapping_mul(2_654_435_761) % span;
    for _ in 0..span {
        let port = (low + (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span) as u16;
        if StdListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    bail!("no free loopback port in {low}..{ephemeral_low}")
}

/// A real etcd process; killed on drop.
pub struct Etcd {
    bin: PathBuf,
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
    /// The data directory in use (a restart may keep it or start an empty one).
    data: PathBuf,
    child: Option<Child>,
}

impl Etcd {
    /// Starts etcd with an empty data directory; `Ok(None)` without an etcd binary.
    pub fn start() -> Result<Option<Self>> {
        let Some(bin) = etcd_binary() else { return Ok(None) };
        let dir = tempfile::Builder::new().prefix("baton-etcd-").tempdir()?;
        let data = dir.path().join("data-0");
        let mut e = Etcd { bin, dir, client_port: free_port()?, peer_port: free_port()?, data, child: None };
        e.spawn()?;
        Ok(Some(e))
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// The process ID, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn spawn(&mut self) -> Result<()> {
        let client = self.endpoint();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.path().join("etcd.log"))?;
        let child = Command::new(&self.bin)
            .args(["--name", "baton-test"])
            .arg("--data-dir")
            .arg(&self.data)
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("baton-test={peer}")])
            .args(DEPLOYED_FLAGS)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", self.bin.display()))?;
        self.child = Some(child);
        Ok(())
    }

    /// kill -9, then start again on the same ports with an empty data directory (every
    /// lease and record is gone, as after losing the store).
    pub fn restart_empty(&mut self, n: u32) -> Result<()> {
        self.kill();
        self.data = self.dir.path().join(format!("data-{n}"));
        self.spawn()
    }

    /// kill -9, then start again on the same ports and data (a crash and a supervisor's
    /// restart: leases survive unless they expired meanwhile).
    pub fn restart(&mut self) -> Result<()> {
        self.kill();
        self.spawn()
    }

    /// Starts it again after [`Etcd::kill`], on the same ports and data.
    pub fn start_again(&mut self) -> Result<()> {
        if self.child.is_some() {
            bail!("etcd is already running");
        }
        self.spawn()
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits until etcd reports itself healthy (`GET /health` on the client port).
    pub fn wait_ready(&self, within: Duration) -> Result<()> {
        let addr = format!("127.0.0.1:{}", self.client_port);
        let deadline = Instant::now() + within;
        loop {
            if health(&addr).unwrap_or(false) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("etcd did not become ready within {within:?}: {}", self.log_tail());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The last lines of etcd's log.
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(5)..].join("\n")
    }

    /// etcd's own `/metrics` on the client port, as text.
    pub fn metrics(&self) -> Option<String> {
        let addr = format!("127.0.0.1:{}", self.client_port);
        let resp = get(&addr, "/metrics").ok()?;
        resp.starts_with("HTTP/1.1 200").then(|| resp.split_once("\r\n\r\n").map_or(String::new(), |(_, body)| body.to_string()))
    }

    /// Where its files live.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

/// `GET /health` answers `"health":"true"`.
fn health(addr: &str) -> std::io::Result<bool> {
    let resp = get(addr, "/health")?;
    Ok(resp.starts_with("HTTP/1.1 200") && resp.contains("\"health\":\"true\""))
}

/// The whole HTTP/1.1 response to `GET path` (etcd answers it without chunking).
fn get(addr: &str, path: &str) -> std::io::Result<String> {
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    Ok(resp)
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::{free_port, DEPLOYED_FLAGS};

    /// The compaction and quota flags a manifest passes to etcd (`- --flag=value` lines).
    fn flags(manifest: &str) -> Vec<String> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(manifest);
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let mut out: Vec<String> = text
            .lines()
            .filter_map(|l| l.trim().strip_prefix("- "))
            .filter(|f| f.starts_with("--auto-compaction-") || f.starts_with("--quota-backend-bytes"))
            .map(str::to_string)
            .collect();
        out.sort();
        out
    }

    /// The ports a cluster is given never repeat within a process and stay out of
    /// the kernel's ephemeral range (from which `bind(0)` and outgoing connections
    /// could take one before its process binds it: a chaos run's node then exited
    /// before listening).
    #[test]
    fn free_ports_never_repeat_and_stay_out_of_the_ephemeral_range() {
        let low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok().and_then(|r| r.split_whitespace().next()?.parse().ok()).unwrap_or(32768);
        let ports: Vec<u16> = (0..300).map(|_| free_port().unwrap()).collect();
        let distinct: std::collections::HashSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len(), "a port was handed out twice");
        assert!(ports.iter().all(|&p| p < low && p >= 1024), "{:?}", ports.iter().filter(|&&p| p >= low).collect::<Vec<_>>());
    }

    #[test]
    fn the_harness_runs_etcd_with_the_deployed_compaction_settings() {
        let mut ours: Vec<String> = DEPLOYED_FLAGS.iter().map(|f| f.to_string()).collect();
        ours.sort();
        for manifest in ["deploy/k8s/base/etcd.yaml", "deploy/docker/compose.yaml"] {
            assert_eq!(flags(manifest), ours, "{manifest} and the harness's DEPLOYED_FLAGS (src/harness/etcd.rs) disagree");
        }
    }
}
