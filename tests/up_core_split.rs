//! `baton up` divides `--threads` between its two engines instead of giving each all of
//! them: the banner shows each engine's own pool size, and the process really runs only
//! that many compute workers (counted by name in /proc, not timed).

mod cluster_support;

use std::io::{BufRead, BufReader};
use std::process::Child;
use std::time::{Duration, Instant};

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `baton up` with `extra` flags; returns it and its banner's `engines` line.
fn start(dir: &std::path::Path, extra: &[&str]) -> (Killed, String) {
    let listeners = ["--listen", "127.0.0.1:0", "--coordinator-listen", "127.0.0.1:0", "--coordinator-http-listen", "127.0.0.1:0"];
    let mut child = cluster_support::up_command(&listeners, &dir.join("gateway.db"), "core-split-test-key-0123")
        .args(["--decode-http-listen", "127.0.0.1:0", "--prefill-http-listen", "127.0.0.1:0"])
        .args(extra)
        .env_remove("BATON_THREADS")
        .env_remove("BATON_DECODE_THREADS")
        .env_remove("BATON_PREFILL_THREADS")
        .spawn()
        .expect("start baton up");
    let stdout = child.stdout.take().unwrap();
    let child = Killed(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut engines = None;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx.recv_timeout(left).expect("baton up printed its banner");
        if let Some(rest) = line.trim_start().strip_prefix("engines") {
            engines = Some(rest.trim().to_string());
        }
        // The banner's last line: everything is up.
        if line.trim_start().starts_with("API key") {
            break;
        }
    }
    (child, engines.expect("an `engines` line in the banner"))
}

/// Threads of process `pid` whose name marks them as CPU compute-pool workers.
fn pool_workers(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("/proc")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with("baton-cpu-"))
        .count()
}

#[test]
fn baton_up_gives_each_engine_its_share_of_the_threads() {
    if cluster_support::model_path().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Default split of 4: prefill a quarter (1), decode the rest (3). A pool of n threads
    // is the engine's own thread and n - 1 workers: 2 + 0 in all (6 if each had all 4).
    {
        let (up, engines) = start(dir.path(), &["--threads", "4"]);
        assert!(
            engines.contains("decode-0: cpu (")
                && engines.contains(", 3 threads); prefill-0: cpu ("),
            "{engines}"
        );
        assert!(engines.ends_with(", 1 threads)"), "{engines}");
        assert_eq!(pool_workers(up.0.id()), 2, "{engines}");
    }
    // Explicit counts win.
    let (up, engines) = start(
        dir.path(),
        &[
            "--threads",
            "4",
            "--decode-threads",
            "2",
            "--prefill-threads",
            "3",
        ],
    );
    assert!(
        engines.contains(", 2 threads); prefill-0: cpu (") && engines.ends_with(", 3 threads)"),
        "{engines}"
    );
    assert_eq!(pool_workers(up.0.id()), 1 + 2, "{engines}");
}
