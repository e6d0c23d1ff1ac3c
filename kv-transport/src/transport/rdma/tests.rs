//! RDMA tests that need no device (the failure without one) and the device gate the
//! conformance suite uses. The data path itself is covered by the conformance suite, which
//! runs over RDMA only where a device exists.

use std::sync::Arc;

use crate::certs::generate_dev_certs;
use crate::handoff::{KvReceiver, ReceiverConfig};
use crate::pool::ArenaPool;
use crate::transport::quic::QuicTuning;
use crate::transport::rdma::{probe, RdmaConnector, RdmaListener};
use crate::transport::select::RdmaConfig;
use crate::types::KvLayout;

/// Set to `1` where a device must exist (an RDMA CI runner): a missing device then fails
/// the tests instead of skipping them.
pub const REQUIRE_ENV: &str = "BATON_REQUIRE_RDMA";

/// Whether RDMA tests can run here. Without a device, says loudly that `test` was skipped,
/// or panics when [`REQUIRE_ENV`] is `1`.
pub fn device_available(test: &str) -> bool {
    let require = std::env::var(REQUIRE_ENV).as_deref() == Ok("1");
    match gate(probe(&RdmaConfig::default()), require, test) {
        Ok(run) => run,
        Err(why) => panic!("{why}"),
    }
}

/// `Ok(true)`: run; `Ok(false)`: skipped (and said so); `Err`: the test must fail.
fn gate(probed: crate::Result<String>, require: bool, test: &str) -> Result<bool, String> {
    match probed {
        Ok(_) => Ok(true),
        Err(e) if require => Err(format!("{REQUIRE_ENV}=1 but RDMA is unusable here: {e}")),
        Err(e) => {
            eprintln!("SKIPPED: no RDMA device ({e}): {test} did not run over RDMA");
            Ok(false)
        }
    }
}

const LAYOUT: KvLayout = crate::types::TEST_LAYOUT;

fn small() -> RdmaConfig {
    RdmaConfig {
        rings: 2,
        slots: 2,
        slot_payload_bytes: 64 << 10,
        ..RdmaConfig::default()
    }
}

/// Without a device both ends refuse to start, with the cause in the message. Where a
/// device exists they start instead (and the conformance suite exercises them).
#[tokio::test]
async fn without_a_device_both_ends_fail_with_the_cause() {
    let certs = generate_dev_certs("test", &["decode-0", "prefill-0"]).unwrap();
    let server = certs.node_tls("decode-0").unwrap();
    let client = certs.node_tls("prefill-0").unwrap();
    let tuning = QuicTuning::default();
    let connector = RdmaConnector::new(&small(), &client, &tuning);
    let pool = Arc::new(ArenaPool::new(LAYOUT, 4).unwrap());
    let receiver = KvReceiver::new(pool, ReceiverConfig::default()).unwrap();
    let loopback = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    let listener = RdmaListener::bind(loopback, "decode-0", &server, &tuning, &small(), receiver);
    match probe(&RdmaConfig::default()) {
        Err(cause) => {
            let cause = cause.to_string();
            assert!(cause.starts_with("RDMA transport unavailable: "), "{cause}");
            for r in [connector.err(), listener.err()] {
                let e = r.expect("no device, yet an RDMA end started");
                assert_eq!(e.label(), "rdma_unavailable");
                assert!(e.to_string().contains("RDMA device"), "{e}");
            }
            eprintln!("no RDMA device here, as expected by this test: {cause}");
        }
        Ok(name) => {
            assert!(connector.is_ok(), "device {name} exists but the connector failed");
            assert!(listener.is_ok(), "device {name} exists but the listener failed");
        }
    }
}

#[test]
fn a_device_that_does_not_exist_is_named_in_the_error() {
    let config = RdmaConfig {
        device: Some("no-such-rdma-device".into()),
        ..RdmaConfig::default()
    };
    let e = probe(&config).unwrap_err();
    assert_eq!(e.label(), "rdma_unavailable");
    // Either the machine has no RDMA at all, or it lists the devices it has.
    let msg = e.to_string();
    assert!(msg.contains("no RDMA device"), "{msg}");
}

#[test]
fn require_env_turns_a_skip_into_a_failure() {
    let none = || Err(crate::Error::RdmaUnavailable { reason: "no RDMA device: test".into() });
    assert_eq!(gate(none(), false, "gate"), Ok(false));
    let e = gate(none(), true, "gate").unwrap_err();
    assert!(e.contains("BATON_REQUIRE_RDMA=1") && e.contains("no RDMA device: test"), "{e}");
    assert_eq!(gate(Ok("mlx5_0".into()), true, "gate"), Ok(true));
}
