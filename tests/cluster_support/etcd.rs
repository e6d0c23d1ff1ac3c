//! A real etcd process for the tests: free loopback ports, a temporary data
//! directory, killed on drop. Without an `etcd` binary on PATH (or in
//! `BATON_ETCD_BIN`) `Etcd::start` says loudly that the test is skipped;
//! `.ci/run` installs Debian's `etcd-server` so CI runs them.

use std::net::TcpListener as StdListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

fn etcd_binary() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("BATON_ETCD_BIN") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join("etcd")).find(|p| p.is_file())
}

pub fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A real etcd process; killed on drop.
pub struct Etcd {
    bin: PathBuf,
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

impl Etcd {
    pub fn start() -> Option<Self> {
        let Some(bin) = etcd_binary() else {
            eprintln!("\n!!!!! SKIPPED: no `etcd` binary on PATH (apt-get install etcd-server); etcd membership is NOT tested !!!!!\n");
            return None;
        };
        let mut e = Etcd { bin, dir: tempfile::tempdir().unwrap(), client_port: free_port(), peer_port: free_port(), child: None };
        e.spawn(&e.dir.path().join("data-0"));
        Some(e)
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    fn spawn(&mut self, data_dir: &Path) {
        let client = self.endpoint();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::File::create(self.dir.path().join("etcd.log")).unwrap();
        let child = Command::new(&self.bin)
            .args(["--name", "baton-test"])
            .arg("--data-dir")
            .arg(data_dir)
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("baton-test={peer}")])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("etcd starts");
        self.child = Some(child);
    }

    /// kill -9, then start again on the same ports with an empty data directory (every
    /// lease and record is gone, as after losing the store).
    pub fn restart_empty(&mut self, n: u32) {
        self.kill();
        let dir = self.dir.path().join(format!("data-{n}"));
        self.spawn(&dir);
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits until etcd answers requests.
    pub async fn ready(&self) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(mut c) = etcd_client::Client::connect([self.endpoint()], None).await {
                if c.get("ready-probe", None).await.is_ok() {
                    return;
                }
            }
            assert!(tokio::time::Instant::now() < deadline, "etcd did not become ready");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}
