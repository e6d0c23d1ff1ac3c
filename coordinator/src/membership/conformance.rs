//! One conformance suite for every [`Membership`] implementation.

use std::sync::Arc;
use std::time::Duration;

use baton_proto::common::{NodeId, NodeInfo, Role};

use super::Membership;

pub fn info(id: &str, role: Role) -> NodeInfo {
    NodeInfo {
        node_id: Some(NodeId { id: id.into() }),
        role: role as i32,
        grpc_addr: format!("127.0.0.1:1{}", id.len()),
        ..Default::default()
    }
}

async fn ids(m: &dyn Membership) -> Vec<String> {
    m.members().await.unwrap().iter().map(|m| m.id().to_string()).collect()
}

/// Join, renew, replace, leave, and expiry of a node that stops renewing.
pub async fn run(m: Arc<dyn Membership>) {
    let mut gen = m.subscribe();
    let g0 = *gen.borrow_and_update();
    let a = m.register(info("a", Role::Decode)).await.unwrap();
    let b = m.register(info("b", Role::Prefill)).await.unwrap();
    assert_ne!(a.id, b.id);
    assert!(a.ttl >= Duration::from_millis(1));
    // Watchers (etcd) may lag a moment behind the write.
    wait_for(&*m, &["a", "b"]).await;
    assert!(*gen.borrow_and_update() > g0, "registration bumps the generation");
    let members = m.members().await.unwrap();
    assert_eq!(members[0].info.role, Role::Decode as i32);
    assert_eq!(members[1].lease_id, b.id);

    assert!(m.keep_alive(a.id).await.unwrap());
    assert!(!m.keep_alive(a.id ^ 0x5555_0000).await.unwrap(), "unknown lease");

    // Re-registering replaces the node's lease.
    let a2 = m.register(info("a", Role::Decode)).await.unwrap();
    wait_until(&*m, |ms| ms.iter().any(|x| x.id() == "a" && x.lease_id == a2.id)).await;
    assert!(!m.keep_alive(a.id).await.unwrap(), "replaced lease is gone");
    assert_eq!(ids(&*m).await, vec!["a", "b"]);

    assert!(m.deregister(b.id).await.unwrap());
    assert!(!m.deregister(b.id).await.unwrap());
    wait_for(&*m, &["a"]).await;

    // Expiry: c never renews, a keeps renewing.
    let c = m.register(info("c", Role::Decode)).await.unwrap();
    wait_for(&*m, &["a", "c"]).await;
    let deadline = tokio::time::Instant::now() + c.ttl * 2 + Duration::from_secs(3);
    loop {
        assert!(m.keep_alive(a2.id).await.unwrap(), "a stays alive while renewing");
        if ids(&*m).await == vec!["a"] {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "c's lease did not expire");
        tokio::time::sleep(c.ttl / 6).await;
    }
    assert!(!m.keep_alive(c.id).await.unwrap());
}

pub async fn wait_for(m: &dyn Membership, want: &[&str]) {
    wait_until(m, |ms| ms.iter().map(|x| x.id()).collect::<Vec<_>>() == want).await
}

pub async fn wait_until(m: &dyn Membership, f: impl Fn(&[super::Member]) -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let ms = m.members().await.unwrap();
        if f(&ms) {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "membership never reached the expected state: {ms:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
