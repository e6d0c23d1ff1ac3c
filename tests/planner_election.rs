//! `baton plan --leader-election --election-etcd`: two planner replicas against a real
//! etcd (`baton::harness::etcd`; skipped loudly without an etcd binary, which `.ci/run`
//! installs) never lead at once; a leader that falls silent loses the key after its TTL
//! and the other takes over; one that resigns hands over at once; a replica that cannot
//! reach etcd does not lead.

use std::time::{Duration, Instant};

use baton_bench::plan::etcd_election::EtcdElector;

fn etcd() -> Option<baton::harness::etcd::Etcd> {
    let e = baton::harness::etcd::Etcd::start().expect("etcd starts");
    if e.is_none() {
        eprintln!("\n!!!!! SKIPPED: no `etcd` binary on PATH (apt-get install etcd-server); the planner's election is NOT tested !!!!!\n");
    }
    e
}

/// Both replicas ask once per "interval"; returns (a leads, b leads).
async fn round(a: &mut EtcdElector, b: &mut EtcdElector) -> (bool, bool) {
    let la = a.lead().await.unwrap_or(false);
    let lb = b.lead().await.unwrap_or(false);
    (la, lb)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_planners_never_lead_at_once_and_a_silent_leader_is_replaced() {
    let Some(mut etcd) = etcd() else { return };
    etcd.wait_ready(Duration::from_secs(20)).unwrap();
    let ep = [etcd.endpoint()];
    let ttl = Duration::from_secs(2);
    let mut a = EtcdElector::connect(&ep, "planner-a".into(), ttl).await.unwrap();
    let mut b = EtcdElector::connect(&ep, "planner-b".into(), ttl).await.unwrap();

    // Steady state: exactly one leads, and the same one every interval (renewing keeps it).
    let first = round(&mut a, &mut b).await;
    assert!(first.0 ^ first.1, "exactly one replica leads: {first:?}");
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(round(&mut a, &mut b).await, first, "the leader changed while it kept renewing");
    }
    let (leader, standby) = if first.0 { (&mut a, &mut b) } else { (&mut b, &mut a) };

    // The leader falls silent (a hung or partitioned process): the standby does not
    // take over before the TTL, and does after it.
    let silent = Instant::now();
    let mut took_over = None;
    while silent.elapsed() < Duration::from_secs(10) {
        if standby.lead().await.unwrap() {
            took_over = Some(silent.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let after = took_over.expect("the standby never took over from a silent leader");
    assert!(after >= Duration::from_millis(1500), "took over after {after:?}, before the leader's 2 s TTL");
    // The old leader, back, finds its lease expired: it does not lead, then stands by.
    assert!(leader.lead().await.is_err(), "a replica whose lease expired must not lead");
    assert!(!leader.lead().await.unwrap(), "the old leader must stand by while the new one renews");
    assert!(standby.lead().await.unwrap());

    // A clean resignation hands over at once (no TTL wait).
    standby.resign().await.unwrap();
    assert!(leader.lead().await.unwrap(), "the key is free as soon as the leader resigns");

    // Without etcd nobody leads.
    etcd.kill();
    assert!(leader.lead().await.is_err() || !leader.lead().await.unwrap_or(false));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_planners_elect_one() {
    let Some(etcd) = etcd() else { return };
    etcd.wait_ready(Duration::from_secs(20)).unwrap();
    let ep = [etcd.endpoint()];
    let mut replicas = Vec::new();
    for i in 0..6 {
        replicas.push(EtcdElector::connect(&ep, format!("planner-{i}"), Duration::from_secs(5)).await.unwrap());
    }
    // All ask at the same moment.
    let asks = replicas.iter_mut().map(|r| r.lead());
    let leads: Vec<bool> = futures::future::join_all(asks).await.into_iter().map(|r| r.unwrap()).collect();
    assert_eq!(leads.iter().filter(|&&l| l).count(), 1, "exactly one of six racing replicas leads: {leads:?}");
}
