//! Membership through a real etcd: the conformance suite over `EtcdMembership`, and a
//! coordinator backed by etcd with nodes that join, die (lease expiry), and re-register
//! on their own after etcd restarts with its data lost.
//!
//! Each test starts its own `etcd` process on free loopback ports with a temporary data
//! directory. Without an `etcd` binary on PATH (or in `BATON_ETCD_BIN`) the tests are
//! skipped with a loud message; `.ci/run` installs Debian's `etcd-server` so CI runs them.

use std::net::TcpListener as StdListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use baton_coordinator::membership::conformance;
use baton_coordinator::{Config, Coordinator, EtcdMembership, MembershipConfig};
use baton_proto::common::{NodeId, NodeInfo, Role};
use baton_proto::coordinator::coordinator_client::CoordinatorClient;
use baton_proto::coordinator::ListNodesRequest;
use baton_proto::MembershipClient;

fn etcd_binary() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("BATON_ETCD_BIN") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join("etcd")).find(|p| p.is_file())
}

fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A real etcd process; killed on drop.
struct Etcd {
    bin: PathBuf,
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

impl Etcd {
    fn start() -> Option<Self> {
        let Some(bin) = etcd_binary() else {
            eprintln!("\n!!!!! SKIPPED: no `etcd` binary on PATH (apt-get install etcd-server); etcd membership is NOT tested !!!!!\n");
            return None;
        };
        let mut e = Etcd { bin, dir: tempfile::tempdir().unwrap(), client_port: free_port(), peer_port: free_port(), child: None };
        e.spawn(&e.dir.path().join("data-0"));
        Some(e)
    }

    fn endpoint(&self) -> String {
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
    fn restart_empty(&mut self, n: u32) {
        self.kill();
        let dir = self.dir.path().join(format!("data-{n}"));
        self.spawn(&dir);
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits until etcd answers requests.
    async fn ready(&self) {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_membership_passes_the_conformance_suite() {
    let Some(etcd) = Etcd::start() else { return };
    etcd.ready().await;
    let m = EtcdMembership::connect(&[etcd.endpoint()], "/conformance/", Duration::from_secs(2)).await.unwrap();
    conformance::run(m).await;
}

fn node(id: &str, role: Role) -> NodeInfo {
    NodeInfo {
        node_id: Some(NodeId { id: id.into() }),
        role: role as i32,
        grpc_addr: format!("127.0.0.1:{}", 9000 + id.len()),
        kv_endpoint: "127.0.0.1:9999".into(),
        block_tokens: 16,
        kv_blocks_total: 1000,
        load: None,
    }
}

async fn node_ids(client: &mut CoordinatorClient<tonic::transport::Channel>) -> Vec<String> {
    let nodes = client.list_nodes(ListNodesRequest { role: 0 }).await.unwrap().into_inner().nodes;
    nodes.into_iter().map(|n| n.node_id.unwrap().id).collect()
}

async fn wait_nodes(client: &mut CoordinatorClient<tonic::transport::Channel>, want: &[&str], within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let ids = node_ids(client).await;
        if ids == want {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "nodes {ids:?}, wanted {want:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_join_lease_expiry_and_reregistration_after_etcd_restart() {
    let Some(mut etcd) = Etcd::start() else { return };
    etcd.ready().await;
    let config = Config {
        membership: MembershipConfig::Etcd { endpoints: vec![etcd.endpoint()], prefix: "/baton-test/".into() },
        lease_ttl: Duration::from_secs(2),
        ..Config::default()
    };
    let coordinator = Coordinator::bind(config).await.unwrap();
    let url = format!("http://{}", coordinator.grpc_addr());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(coordinator.serve(async move {
        let _ = stop_rx.await;
    }));
    let mut client = CoordinatorClient::connect(url.clone()).await.unwrap();

    // Join.
    let d1 = MembershipClient::new(url.clone(), node("d1", Role::Decode)).spawn();
    let d2 = MembershipClient::new(url.clone(), node("d2", Role::Decode)).spawn();
    let p1 = MembershipClient::new(url.clone(), node("p1", Role::Prefill)).spawn();
    d1.wait_registered(1).await;
    d2.wait_registered(1).await;
    p1.wait_registered(1).await;
    wait_nodes(&mut client, &["d1", "d2", "p1"], Duration::from_secs(5)).await;

    // d2 dies without deregistering: its etcd lease expires and it leaves.
    d2.abort();
    wait_nodes(&mut client, &["d1", "p1"], Duration::from_secs(8)).await;

    // etcd is killed and comes back empty: the nodes hear "unknown lease" and register
    // again by themselves.
    etcd.restart_empty(1);
    etcd.ready().await;
    let d1_regs = tokio::time::timeout(Duration::from_secs(20), d1.wait_registered(2)).await;
    assert!(d1_regs.is_ok(), "d1 did not re-register: {:?}", d1.state());
    tokio::time::timeout(Duration::from_secs(20), p1.wait_registered(2)).await.expect("p1 re-registers");
    wait_nodes(&mut client, &["d1", "p1"], Duration::from_secs(10)).await;

    d1.shutdown().await;
    p1.shutdown().await;
    wait_nodes(&mut client, &[], Duration::from_secs(5)).await;
    let _ = stop_tx.send(());
    server.await.unwrap().unwrap();
}
