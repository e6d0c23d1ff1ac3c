//! A real etcd process for the tests, over the harness's one implementation
//! (`baton::harness::etcd`, shared with `baton chaos`). Without an `etcd` binary on
//! PATH (or in `BATON_ETCD_BIN`) `Etcd::start` says loudly that the test is skipped;
//! `.ci/run` installs Debian's `etcd-server` so CI runs them.

use std::time::Duration;

pub fn free_port() -> u16 {
    baton::harness::etcd::free_port().unwrap()
}

/// A real etcd process; killed on drop.
pub struct Etcd(baton::harness::etcd::Etcd);

impl Etcd {
    pub fn start() -> Option<Self> {
        match baton::harness::etcd::Etcd::start().expect("etcd starts") {
            Some(e) => Some(Etcd(e)),
            None => {
                eprintln!("\n!!!!! SKIPPED: no `etcd` binary on PATH (apt-get install etcd-server); etcd membership is NOT tested !!!!!\n");
                None
            }
        }
    }

    pub fn endpoint(&self) -> String {
        self.0.endpoint()
    }

    /// kill -9, then start again on the same ports with an empty data directory (every
    /// lease and record is gone, as after losing the store).
    pub fn restart_empty(&mut self, n: u32) {
        self.0.restart_empty(n).expect("etcd restarts");
    }

    pub fn kill(&mut self) {
        self.0.kill()
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
