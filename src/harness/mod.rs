//! Real processes of a cluster on this machine, for the tests in `tests/` and for
//! `baton chaos`: `baton` children (each role prints one `key=value` line once it
//! listens), a real etcd and PostgreSQL, readiness probes and `/metrics` scrapes over
//! plain HTTP on loopback, and signals (kill -9, SIGSTOP, SIGCONT) as faults.
//!
//! Every child is killed when its handle drops, so a harness that fails or is stopped
//! leaves nothing running.

pub mod etcd;
pub mod postgres;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

pub use etcd::free_port;

/// How to start one `baton` child again and again (a supervisor's restart).
#[derive(Clone, Debug)]
pub struct Spec {
    /// The `baton` binary.
    pub bin: PathBuf,
    pub args: Vec<String>,
    /// Its stderr is appended here (`None`: inherited).
    pub log: Option<PathBuf>,
    /// Whether it prints an address line on stdout (roles do; the gateway does not).
    pub prints_addresses: bool,
}

/// One running `baton` child; killed (SIGKILL) when dropped.
pub struct BatonProc {
    pub child: Child,
    /// `key=value` pairs of the line it printed once listening.
    pub addrs: HashMap<String, String>,
    stopped: bool,
}

impl BatonProc {
    /// Starts `spec`, and reads its address line if it prints one.
    pub fn spawn(spec: &Spec) -> Result<BatonProc> {
        let stderr = match &spec.log {
            Some(path) => Stdio::from(std::fs::OpenOptions::new().create(true).append(true).open(path).with_context(|| format!("opening {}", path.display()))?),
            None => Stdio::inherit(),
        };
        let mut child = Command::new(&spec.bin)
            .args(&spec.args)
            .env("BATON_LOG", std::env::var("BATON_LOG").unwrap_or_else(|_| "warn".into()))
            .stdout(if spec.prints_addresses { Stdio::piped() } else { Stdio::null() })
            .stderr(stderr)
            .spawn()
            .with_context(|| format!("starting {} {:?}", spec.bin.display(), spec.args))?;
        let mut addrs = HashMap::new();
        if let Some(stdout) = child.stdout.take() {
            let mut out = BufReader::new(stdout);
            let mut line = String::new();
            out.read_line(&mut line).context("reading the address line")?;
            if line.is_empty() {
                let _ = child.kill();
                let status = child.wait().ok();
                // Its own words, when its stderr went to a log.
                let said = spec.log.as_ref().and_then(|l| std::fs::read_to_string(l).ok()).map(|t| {
                    let lines: Vec<&str> = t.lines().collect();
                    format!(": {}", lines[lines.len().saturating_sub(5)..].join(" | "))
                });
                bail!("baton {:?} exited ({status:?}) before listening{}", spec.args.first(), said.unwrap_or_default());
            }
            // Keep draining stdout so the child never blocks on a full pipe.
            std::thread::spawn(move || {
                let mut sink = Vec::new();
                let _ = out.read_to_end(&mut sink);
            });
            addrs = line.split_whitespace().filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect();
        }
        Ok(BatonProc { child, addrs, stopped: false })
    }

    pub fn try_addr(&self, key: &str) -> Result<String> {
        self.addrs.get(key).cloned().with_context(|| format!("no {key} in {:?}", self.addrs))
    }

    /// The address printed under `key`. Panics if the line had none (tests' shorthand).
    pub fn addr(&self, key: &str) -> String {
        self.try_addr(key).unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, as a crash; waits for the exit.
    pub fn kill9(&mut self) {
        if self.stopped {
            self.sigcont();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Whether it is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGSTOP: the process freezes (no lease renewals, no replies) until [`BatonProc::sigcont`].
    pub fn sigstop(&mut self) -> Result<()> {
        signal(self.pid(), "STOP")?;
        self.stopped = true;
        Ok(())
    }

    pub fn sigcont(&mut self) {
        if signal(self.pid(), "CONT").is_ok() {
            self.stopped = false;
        }
    }
}

impl Drop for BatonProc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Sends `SIG<name>` to `pid` (through kill(1): this crate has no libc binding).
pub fn signal(pid: u32, name: &str) -> Result<()> {
    let st = Command::new("kill").arg(format!("-{name}")).arg(pid.to_string()).status().context("running kill")?;
    if !st.success() {
        bail!("kill -{name} {pid} failed");
    }
    Ok(())
}

/// One HTTP/1.1 GET on loopback; the status and body. `bearer`: an Authorization header.
pub fn http_get(addr: &str, path: &str, bearer: Option<&str>, timeout: Duration) -> std::io::Result<(u16, String)> {
    let mut s = std::net::TcpStream::connect_timeout(&addr.parse().map_err(std::io::Error::other)?, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let auth = bearer.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Connection: close\r\n\r\n")?;
    let mut resp = Vec::new();
    s.read_to_end(&mut resp)?;
    let resp = String::from_utf8_lossy(&resp).into_owned();
    let status = resp.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = resp.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Ok((status, dechunk(&body)))
}

/// The body of a `Transfer-Encoding: chunked` response (or the body itself if it is not chunked).
fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    loop {
        let Some((size, after)) = rest.split_once("\r\n") else { return body.to_string() };
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else { return body.to_string() };
        if n == 0 {
            return out;
        }
        let Some(chunk) = after.get(..n) else { return body.to_string() };
        out.push_str(chunk);
        rest = after.get(n + 2..).unwrap_or("");
    }
}

/// Polls `GET path` until it answers 200.
pub fn wait_ok(addr: &str, path: &str, within: Duration) -> Result<()> {
    let deadline = Instant::now() + within;
    loop {
        if matches!(http_get(addr, path, None, Duration::from_secs(2)), Ok((200, _))) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{addr}{path} did not answer 200 within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The value of a Prometheus series in `text`: the sum over every line of `name` whose
/// labels include each of `labels` (`key="value"`), or `None` if there is no such line.
pub fn metric_sum(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some((series, value)) = line.rsplit_once(' ') else { continue };
        let (n, l) = match series.split_once('{') {
            Some((n, l)) => (n, l.trim_end_matches('}')),
            None => (series, ""),
        };
        if n != name {
            continue;
        }
        let have: Vec<&str> = l.split(',').map(str::trim).collect();
        if labels.iter().all(|want| have.contains(want)) {
            if let Ok(v) = value.trim().parse::<f64>() {
                *found.get_or_insert(0.0) += v;
            }
        }
    }
    found
}

/// Resident memory (bytes) and open file descriptors of a process, from /proc.
pub fn rss_and_fds(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: u64 = status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64;
    Some((kib * 1024, fds))
}

/// Development certificates (a fresh CA, one certificate per name) written to `dir`;
/// the CA's key is dropped, so nothing else can join the cluster.
pub fn write_certs(dir: &Path, cluster: &str, names: &[&str]) -> Result<()> {
    let certs = baton_kv_transport::generate_dev_certs(cluster, names).context("generating certificates")?;
    certs.write_to_dir(dir, false).with_context(|| format!("writing certificates to {}", dir.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_sums_match_labels() {
        let text = "# HELP x\nbaton_decode_kv_blocks{state=\"used\",tier=\"1\"} 3\nbaton_decode_kv_blocks{state=\"used\",tier=\"2\"} 2\nbaton_decode_kv_blocks{state=\"free\",tier=\"1\"} 9\nbaton_decode_running_sequences 0\n";
        assert_eq!(metric_sum(text, "baton_decode_kv_blocks", &["state=\"used\""]), Some(5.0));
        assert_eq!(metric_sum(text, "baton_decode_running_sequences", &[]), Some(0.0));
        assert_eq!(metric_sum(text, "baton_decode_queue_depth", &[]), None);
    }

    #[test]
    fn chunked_bodies_are_joined() {
        assert_eq!(dechunk("5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"), "hello world");
        assert_eq!(dechunk("plain"), "plain");
    }
}
