//! `baton up --autoscale` under a ramp of `baton bench load` (2 conversations, then 6,
//! then 2), with real processes on loopback: the planner starts a decode node while the
//! measured batch per node is above `--autoscale-batch`, and after the ramp drains it
//! (its warm conversations handed over) and stops it; every decision is printed with its
//! reasons, no pool goes above `--max-nodes` or below one node, and no turn of the load
//! fails or is lost.

mod cluster_support;

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const KEY: &str = "autoscale-test-key-0123456789";

/// The decision lines (`autoscale t=...`) with their reason lines.
fn decisions(log: &str) -> Vec<Vec<&str>> {
    let mut out: Vec<Vec<&str>> = Vec::new();
    for line in log.lines() {
        if line.starts_with("autoscale t=") {
            out.push(vec![line]);
        } else if line.starts_with("  ") && (line.contains(" [") && (line.trim_start().starts_with("decode") || line.trim_start().starts_with("prefill"))) {
            if let Some(d) = out.last_mut() {
                d.push(line);
            }
        }
    }
    out
}

/// `decode A -> B` of a decision line.
fn decode_target(line: &str) -> (u32, u32) {
    let rest = line.split("decode ").nth(1).unwrap();
    let mut it = rest.split(|c: char| !c.is_ascii_digit()).filter(|s| !s.is_empty());
    (it.next().unwrap().parse().unwrap(), it.next().unwrap().parse().unwrap())
}

#[test]
fn autoscale_adds_a_decode_node_under_the_ramp_and_drains_it_after() {
    let Some(model) = cluster_support::TestModel::smollm2() else { return };
    let dir = tempfile::tempdir().unwrap();
    let log_path = dir.path().join("up.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let listeners = ["--listen", "127.0.0.1:0", "--coordinator-listen", "127.0.0.1:0", "--coordinator-http-listen", "127.0.0.1:0"];
    let mut up = cluster_support::up_command_with(&model.path, &listeners, &dir.path().join("gateway.db"), KEY)
        .args(["--decode-http-listen", "127.0.0.1:0", "--prefill-http-listen", "127.0.0.1:0", "--threads", "2"])
        .args(["--autoscale", "--max-nodes", "3", "--autoscale-interval", "1s", "--autoscale-batch", "2.5"])
        .args(["--autoscale-scale-down-delay", "4s", "--autoscale-itl-target", "10s", "--autoscale-ttft-target", "60s"])
        .env("BATON_KV_STAGING_MIB", "32")
        .stderr(Stdio::from(log))
        .spawn()
        .expect("start baton up");
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut stdout = up.stdout.take().unwrap();
    let mut up = Kill(up);
    // The banner's web line gives the gateway.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut all = String::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 {
                break;
            }
            all.push_str(&String::from_utf8_lossy(&buf[..n]));
            if let Some(l) = all.lines().find(|l| l.trim_start().starts_with("web chat")) {
                let _ = tx.send(l.split_whitespace().last().unwrap().trim_end_matches('/').to_string());
            }
        }
    });
    let gateway = rx.recv_timeout(Duration::from_secs(180)).expect("baton up printed its banner");
    let read_log = || std::fs::read_to_string(&log_path).unwrap();

    // The ramp: 2 conversations, 6, then 2 again, each making 6 turns.
    let report = dir.path().join("load.json");
    let load = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["bench", "load", "--url", &format!("{gateway}/v1"), "--levels", "2,6,2", "--turns", "6", "--think-time", "300ms"])
        .args(["--max-tokens", "24", "--system-words", "60", "--long-doc-probability", "0", "--conversation-header"])
        .arg("--json")
        .arg(&report)
        .env("BATON_API_KEY", KEY)
        .output()
        .expect("run baton bench load");
    assert!(load.status.success(), "bench load failed: {}\n{}", String::from_utf8_lossy(&load.stderr), read_log());
    let run: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    for level in run["levels"].as_array().unwrap() {
        let (convs, turns, errors) = (level["conversations"].as_u64().unwrap(), level["turns"].as_u64().unwrap(), level["errors"].as_u64().unwrap());
        assert_eq!(errors, 0, "level {convs}: {}\n{}", level["errors_by_kind"], read_log());
        assert_eq!(turns, convs * 6, "level {convs}: every turn answered\n{}", read_log());
    }

    // After the ramp the pool goes back to one decode node.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !read_log().contains("autoscale: drained decode-") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(500));
    }
    let text = read_log();
    let ds = decisions(&text);
    assert!(!ds.is_empty(), "no decisions printed:\n{text}");
    // Every decision says why, with a known reason label.
    for d in &ds {
        assert!(d.len() >= 2, "a decision without reasons: {d:?}");
        for r in &d[1..] {
            let kind = r.split('[').nth(1).unwrap().split(']').next().unwrap();
            assert!(baton_bench::planner::REASON_KINDS.contains(&kind), "unknown reason {kind} in {r}");
            assert!(r.contains("why: "), "{r}");
        }
    }
    // A decision raised the decode pool on the measured batch, then a node started.
    let up_at = ds.iter().position(|d| {
        let (now, to) = decode_target(d[0]);
        to > now && d.iter().any(|r| r.contains("decode [batch]"))
    });
    let up_at = up_at.unwrap_or_else(|| panic!("no scale-up on the measured batch:\n{text}"));
    let started = text.find("autoscale: started decode-").unwrap_or_else(|| panic!("no decode node started:\n{text}"));
    assert!(text.find(ds[up_at][0]).unwrap() < started, "the node started before its decision:\n{text}");
    // Then one went down after the delay, drained with nothing failed, and stopped.
    let drained = text.lines().find(|l| l.starts_with("autoscale: drained decode-")).unwrap_or_else(|| panic!("no drain after the ramp:\n{text}"));
    assert!(drained.contains("failed 0") && drained.ends_with("stopped"), "{drained}");
    assert!(ds.iter().any(|d| d.iter().any(|r| r.contains("decode [scale_down]"))), "the drain has no scale_down reason:\n{text}");
    // Within the limits at every decision.
    for d in &ds {
        let (_, to) = decode_target(d[0]);
        assert!((1..=3).contains(&to), "{}", d[0]);
    }
    assert!(!text.contains("exited on its own"), "a started node died:\n{text}");

    // The decisions as metrics and on the explain page.
    let at = text.lines().find_map(|l| l.strip_prefix("autoscale: decisions at http://")).unwrap_or_else(|| panic!("no listener line:\n{text}"));
    let addr = at.split('/').next().unwrap();
    let (status, metrics) = baton::harness::http_get(addr, "/metrics", None, Duration::from_secs(5)).unwrap();
    assert_eq!(status, 200);
    assert_eq!(baton::harness::metric_sum(&metrics, "baton_planner_target_nodes", &["pool=\"decode\""]), Some(1.0), "{metrics}");
    assert!(baton::harness::metric_sum(&metrics, "baton_planner_reasons_total", &["pool=\"decode\"", "reason=\"batch\""]).unwrap() >= 1.0, "{metrics}");
    assert!(baton::harness::metric_sum(&metrics, "baton_planner_reasons_total", &["pool=\"decode\"", "reason=\"scale_down\""]).unwrap() >= 1.0, "{metrics}");
    // Taken after the log was read: at least every decision it shows.
    assert!(baton::harness::metric_sum(&metrics, "baton_planner_decisions_total", &[]).unwrap() >= ds.len() as f64, "{metrics}");
    let (status, page) = baton::harness::http_get(addr, "/decisions", None, Duration::from_secs(5)).unwrap();
    assert_eq!(status, 200);
    assert!(page.contains("decode [batch] why: decode batch"), "{page}");
    assert_eq!(baton::harness::http_get(addr, "/anything", None, Duration::from_secs(5)).unwrap().0, 404);
    // The log, for whoever reads the test's output.
    eprintln!("{}", text.lines().filter(|l| l.starts_with("autoscale") || l.starts_with("  ")).collect::<Vec<_>>().join("\n"));

    // SIGTERM stops baton up and the nodes it started.
    baton::harness::signal(up.0.id(), "TERM").unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while up.0.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "baton up did not stop:\n{}", read_log());
        std::thread::sleep(Duration::from_millis(100));
    }
}
