//! The chaos gate, short: `baton chaos` with a small load and three faults (kill -9 of a
//! coordinator, kill -9 of a decode node, loss and latency on the KV transport) over the
//! whole multi-process cluster (2 coordinators over a real etcd, 2 gateways on a real
//! PostgreSQL, 2 prefill and 3 decode nodes). The command must pass its own gate, and its
//! JSON report must say so row by row: nothing lost, nothing stored twice, no KV block
//! leaked, and every window served turns.

mod cluster_support;

use std::process::Command;

use serde_json::Value;

#[test]
fn chaos_short_run_loses_nothing_stores_nothing_twice_and_leaks_no_block() {
    let Some(model) = cluster_support::model_path() else { return };
    if baton::harness::etcd::etcd_binary().is_none() || baton::harness::postgres::bin_dir().is_none() {
        eprintln!("\n!!!!! SKIPPED: no etcd or PostgreSQL (bash scripts/setup.sh test); the chaos gate is NOT tested !!!!!\n");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("chaos.json");
    let out = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["chaos", "--faults", "kill-coordinator,kill-decode,kv-loss", "--conversations", "3", "--max-tokens", "12"])
        .args(["--baseline", "8s", "--fault-period", "3s", "--recovery", "8s", "--keep-going"])
        .arg("--model")
        .arg(&model)
        .arg("--report")
        .arg(&report)
        .output()
        .expect("baton chaos runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "baton chaos failed its gate:\n{stdout}\n{stderr}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let rows = v["rows"].as_array().unwrap();
    let faults: Vec<&str> = rows.iter().map(|r| r["fault"].as_str().unwrap()).collect();
    assert_eq!(faults, ["baseline", "kill-coordinator", "kill-decode", "kv-loss"], "{stdout}");
    for r in rows {
        assert_eq!(r["lost"], 0, "{stdout}");
        assert_eq!(r["stored_twice"], 0, "{stdout}");
        assert_eq!(r["leaked_blocks"].as_f64(), Some(0.0), "{stdout}");
        assert!(r["turns"].as_u64().unwrap() > 0, "every window served turns: {stdout}");
        let nodes = r["nodes"].as_array().unwrap();
        assert_eq!(nodes.len(), 5, "every node measured after {}: {stdout}", r["fault"]);
        assert!(nodes.iter().all(|n| n["not_idle"] == false), "{stdout}");
    }
    // KV crossed the relays (decode nodes advertise them), and kv-loss dropped some.
    let kv = rows.iter().find(|r| r["fault"] == "kv-loss").unwrap();
    assert!(kv["kv_relay_forwarded"].as_u64().unwrap() > 0, "no KV crossed the relays: {stdout}");
    assert!(kv["kv_relay_dropped"].as_u64().unwrap() > 0, "kv-loss dropped nothing: {stdout}");
    assert!(stdout.contains("gate: PASSED"), "{stdout}");
}

/// A short soak (the same cluster and load, no faults): every process is sampled, the
/// report and chart are written, and nothing is lost, stored twice or leaked. Its memory
/// gate is 10% here, not the command's 5%: 45 s past warm-up is too short for the
/// allocators to settle (a 120 s soak measured 3.8-5.7% on decode nodes, an open
/// finding in docs/operations.md), while a leak per turn still exceeds it.
#[test]
fn short_soak_samples_every_process_and_passes_its_gate() {
    let Some(model) = cluster_support::model_path() else { return };
    if baton::harness::etcd::etcd_binary().is_none() || baton::harness::postgres::bin_dir().is_none() {
        eprintln!("\n!!!!! SKIPPED: no etcd or PostgreSQL (bash scripts/setup.sh test); the soak is NOT tested !!!!!\n");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (report, chart) = (dir.path().join("soak.json"), dir.path().join("soak.svg"));
    let out = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["chaos", "--soak", "75s", "--soak-warmup", "30s", "--sample-every", "5s", "--conversations", "2", "--max-tokens", "12", "--max-rss-growth", "0.10"])
        .arg("--model")
        .arg(&model)
        .arg("--report")
        .arg(&report)
        .arg("--chart")
        .arg(&chart)
        .output()
        .expect("baton chaos --soak runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the soak failed its gate:\n{stdout}\n{stderr}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let processes: Vec<&str> = v["processes"].as_array().unwrap().iter().map(|p| p["process"].as_str().unwrap()).collect();
    for name in ["coordinator-0", "coordinator-1", "gateway-0", "gateway-1", "prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2", "etcd", "postgres"] {
        assert!(processes.contains(&name), "{name} not sampled: {processes:?}");
    }
    assert!(v["samples"].as_array().unwrap().len() >= 12, "a sample every 5 s for 75 s");
    assert!(v["turns"].as_u64().unwrap() > 0);
    // etcd's own database size is read beside its RSS.
    for at in ["etcd_start", "etcd_end"] {
        assert!(v[at]["db_bytes"].as_u64().is_some_and(|b| b > 0), "etcd's db size not read ({at}): {stdout}");
    }
    assert_eq!((v["lost"].as_u64(), v["stored_twice"].as_u64(), v["leaked_blocks"].as_f64()), (Some(0), Some(0), Some(0.0)), "{stdout}");
    let svg = std::fs::read_to_string(&chart).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("resident memory"), "the chart is drawn");
}
