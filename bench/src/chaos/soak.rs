//! The soak's arithmetic, pure: samples of every process's resident memory and open file
//! descriptors, every node's KV blocks, the store's and etcd's sizes over a long run
//! without faults, and the gate: no process's memory grows more than a bound after warm-up.
//!
//! Growth is measured between the mean of the first three samples after warm-up and the
//! mean of the last three, so one sample taken mid-allocation does not decide it.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

/// One sampling instant.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Sample {
    /// Seconds since the load started.
    pub t_s: f64,
    /// Resident memory in bytes, per process name.
    pub rss_bytes: BTreeMap<String, u64>,
    /// Open file descriptors, per process name.
    pub fds: BTreeMap<String, u64>,
    /// KV blocks pinned by sequences, per node.
    pub kv_used_blocks: BTreeMap<String, f64>,
    /// KV blocks held by the prefix cache, per node.
    pub kv_cached_blocks: BTreeMap<String, f64>,
    /// Bytes of a node's KV pools in use now: (pinned + cached blocks + staging blocks)
    /// x block bytes. The pools are allocated at start but their pages are touched on
    /// first use (blocks are reused last-freed first), so their high-water mark is memory
    /// a node may add without leaking.
    #[serde(default)]
    pub kv_pool_bytes: BTreeMap<String, f64>,
    /// Bytes of PostgreSQL's data directory.
    pub store_bytes: u64,
    /// Turns acknowledged so far.
    pub turns: usize,
    /// etcd's database, from its own `/metrics` (absent when etcd did not answer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd: Option<EtcdDb>,
}

/// etcd's database at one instant, as etcd reports it on `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EtcdDb {
    /// `etcd_mvcc_db_total_size_in_bytes`: the database file, free pages included.
    pub db_bytes: u64,
    /// `etcd_mvcc_db_total_size_in_use_in_bytes`: its pages in use.
    pub db_in_use_bytes: u64,
    /// `etcd_debugging_mvcc_current_revision`: every write so far (kept until compacted).
    pub revision: u64,
    /// `etcd_debugging_mvcc_keys_total`: live keys.
    pub keys: u64,
}

impl EtcdDb {
    /// Reads the series from etcd's `/metrics` text; `None` without the database size.
    pub fn parse(metrics: &str) -> Option<Self> {
        let value = |name: &str| {
            metrics.lines().find_map(|l| {
                let (series, v) = l.split_once(' ')?;
                (series == name).then(|| v.trim().parse::<f64>().ok()).flatten()
            })
        };
        Some(EtcdDb {
            db_bytes: value("etcd_mvcc_db_total_size_in_bytes")? as u64,
            db_in_use_bytes: value("etcd_mvcc_db_total_size_in_use_in_bytes").unwrap_or(0.0) as u64,
            revision: value("etcd_debugging_mvcc_current_revision").unwrap_or(0.0) as u64,
            keys: value("etcd_debugging_mvcc_keys_total").unwrap_or(0.0) as u64,
        })
    }
}

/// One process over the soak.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ProcessGrowth {
    pub process: String,
    pub rss_start_bytes: f64,
    pub rss_end_bytes: f64,
    /// Growth of the KV pools' high-water mark over the same span (0 for non-nodes).
    pub kv_high_water_growth_bytes: f64,
    /// (end - start - KV high-water growth) / start.
    pub rss_growth_ratio: f64,
    pub fds_start: f64,
    pub fds_end: f64,
}

/// The soak's report (`--report PATH` writes it as JSON).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SoakReport {
    pub duration_s: f64,
    pub warmup_s: f64,
    /// The largest RSS growth allowed after warm-up.
    pub max_growth_ratio: f64,
    pub processes: Vec<ProcessGrowth>,
    pub turns: usize,
    pub failed_turns: usize,
    pub lost: usize,
    pub stored_twice: usize,
    pub leaked_blocks: f64,
    pub store_bytes_start: u64,
    pub store_bytes_end: u64,
    /// etcd's database at the first and the last sample that read it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd_start: Option<EtcdDb>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd_end: Option<EtcdDb>,
    /// Why turns failed: `conversation/turn: error labels of its attempts`.
    #[serde(default)]
    pub failed_turn_errors: Vec<String>,
    pub samples: Vec<Sample>,
}

impl SoakReport {
    /// The gate: no process grew past the bound, nothing lost, stored twice or leaked.
    pub fn passed(&self) -> bool {
        self.processes.iter().all(|p| p.rss_growth_ratio <= self.max_growth_ratio) && self.lost == 0 && self.stored_twice == 0 && self.leaked_blocks == 0.0
    }
}

fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        0.0
    } else {
        xs.iter().sum::<f64>() / xs.len() as f64
    }
}

/// Growth of every process seen in the samples after `warmup_s`, net of its KV pools'
/// high-water growth over the same span. A process must appear in at least two samples
/// after warm-up to be judged.
pub fn growth(samples: &[Sample], warmup_s: f64) -> Vec<ProcessGrowth> {
    let first_after = samples.iter().position(|s| s.t_s >= warmup_s).unwrap_or(samples.len());
    let after: Vec<&Sample> = samples[first_after..].iter().collect();
    let mut names: Vec<&String> = after.iter().flat_map(|s| s.rss_bytes.keys()).collect();
    names.sort();
    names.dedup();
    let mut out = Vec::new();
    for name in names {
        let rss: Vec<f64> = after.iter().filter_map(|s| s.rss_bytes.get(name)).map(|&v| v as f64).collect();
        let fds: Vec<f64> = after.iter().filter_map(|s| s.fds.get(name)).map(|&v| v as f64).collect();
        if rss.len() < 2 {
            continue;
        }
        let k = (rss.len() / 2).clamp(1, 3);
        let (start, end) = (mean(&rss[..k]), mean(&rss[rss.len() - k..]));
        let kf = (fds.len() / 2).clamp(1, 3).min(fds.len());
        // The pools' high-water mark (from the first sample on) where the start window
        // ends, and at the end.
        let high_water = |upto: usize| samples[..upto].iter().filter_map(|s| s.kv_pool_bytes.get(name)).fold(0.0f64, |a, &b| a.max(b));
        let start_index = samples[first_after..].iter().enumerate().filter(|(_, s)| s.rss_bytes.contains_key(name)).nth(k - 1).map_or(first_after, |(i, _)| first_after + i);
        let kv = (high_water(samples.len()) - high_water(start_index + 1)).max(0.0);
        out.push(ProcessGrowth {
            process: name.clone(),
            rss_start_bytes: start,
            rss_end_bytes: end,
            kv_high_water_growth_bytes: kv,
            rss_growth_ratio: if start > 0.0 { (end - start - kv) / start } else { 0.0 },
            fds_start: mean(&fds[..kf]),
            fds_end: mean(&fds[fds.len() - kf..]),
        });
    }
    out
}

/// The report as a table.
pub fn table(r: &SoakReport) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{:<16} {:>13} {:>12} {:>12} {:>8} {:>9} {:>9}", "process", "RSS start MiB", "RSS end MiB", "KV HW +MiB", "growth", "fds start", "fds end");
    for p in &r.processes {
        let flag = if p.rss_growth_ratio > r.max_growth_ratio { "  <- over the bound" } else { "" };
        let _ = writeln!(
            out,
            "{:<16} {:>13.1} {:>12.1} {:>12.1} {:>7.1}% {:>9.0} {:>9.0}{flag}",
            p.process,
            p.rss_start_bytes / 1048576.0,
            p.rss_end_bytes / 1048576.0,
            p.kv_high_water_growth_bytes / 1048576.0,
            p.rss_growth_ratio * 100.0,
            p.fds_start,
            p.fds_end
        );
    }
    for e in &r.failed_turn_errors {
        let _ = writeln!(out, "  failed turn {e}");
    }
    let _ = writeln!(
        out,
        "{} turns ({} failed), lost {}, stored twice {}, leaked KV blocks {}; store {:.1} -> {:.1} MiB; {:.0} s (warm-up {:.0} s); gate (RSS growth <= {:.0}%): {}",
        r.turns,
        r.failed_turns,
        r.lost,
        r.stored_twice,
        r.leaked_blocks,
        r.store_bytes_start as f64 / 1048576.0,
        r.store_bytes_end as f64 / 1048576.0,
        r.duration_s,
        r.warmup_s,
        r.max_growth_ratio * 100.0,
        if r.passed() { "PASSED" } else { "FAILED" }
    );
    if let (Some(a), Some(b)) = (r.etcd_start, r.etcd_end) {
        let mib = |b: u64| b as f64 / 1048576.0;
        let _ = writeln!(
            out,
            "etcd db {:.2} -> {:.2} MiB (in use {:.2} -> {:.2} MiB), revision {} -> {}, keys {} -> {}",
            mib(a.db_bytes),
            mib(b.db_bytes),
            mib(a.db_in_use_bytes),
            mib(b.db_in_use_bytes),
            a.revision,
            b.revision,
            a.keys,
            b.keys
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(t: f64, rss: u64) -> Sample {
        let mut s = Sample { t_s: t, ..Sample::default() };
        s.rss_bytes.insert("decode-0".into(), rss);
        s.fds.insert("decode-0".into(), 40);
        s
    }

    #[test]
    fn growth_is_judged_after_warm_up_between_smoothed_ends() {
        // Warm-up grows memory twentyfold (ignored); afterwards it creeps up under 2%.
        let mut samples = vec![sample(0.0, 50), sample(10.0, 100)];
        samples.extend((0..10).map(|i| sample(20.0 + 10.0 * i as f64, 1000 + 2 * i)));
        let g = growth(&samples, 20.0);
        assert_eq!(g.len(), 1);
        assert!((g[0].rss_start_bytes - 1002.0).abs() < 1e-9, "{g:?}");
        assert!((g[0].rss_end_bytes - 1016.0).abs() < 1e-9, "{g:?}");
        let report = SoakReport {
            duration_s: 110.0,
            warmup_s: 20.0,
            max_growth_ratio: 0.05,
            processes: g,
            turns: 10,
            failed_turns: 0,
            lost: 0,
            stored_twice: 0,
            leaked_blocks: 0.0,
            store_bytes_start: 0,
            store_bytes_end: 0,
            etcd_start: None,
            etcd_end: None,
            failed_turn_errors: vec![],
            samples: vec![],
        };
        assert!(report.passed(), "{}", table(&report));
    }

    #[test]
    fn growth_of_the_kv_pools_high_water_is_not_a_leak() {
        // RSS grows 300 bytes as the KV pool's high-water mark grows 300: not judged.
        let samples: Vec<Sample> = (0..10)
            .map(|i| {
                let mut s = sample(10.0 * i as f64, 1000 + if i >= 5 { 300 } else { 0 });
                s.kv_pool_bytes.insert("decode-0".into(), if i >= 5 { 400.0 } else { 100.0 });
                s
            })
            .collect();
        let g = growth(&samples, 0.0);
        assert!((g[0].kv_high_water_growth_bytes - 300.0).abs() < 1e-9, "{g:?}");
        assert!(g[0].rss_growth_ratio.abs() < 1e-9, "{g:?}");
    }

    #[test]
    fn etcd_db_is_read_off_its_metrics() {
        let text = "# HELP etcd_mvcc_db_total_size_in_bytes x\netcd_mvcc_db_total_size_in_bytes 1.2288e+06\n\
                    etcd_mvcc_db_total_size_in_use_in_bytes 1.0e+06\netcd_debugging_mvcc_current_revision 4567\n\
                    etcd_debugging_mvcc_keys_total 12\netcd_mvcc_db_open_read_transactions 1\n";
        assert_eq!(EtcdDb::parse(text), Some(EtcdDb { db_bytes: 1_228_800, db_in_use_bytes: 1_000_000, revision: 4567, keys: 12 }));
        assert_eq!(EtcdDb::parse("etcd_mvcc_db_total_size_in_use_in_bytes 1\n"), None);
    }

    #[test]
    fn a_leaking_process_fails_the_gate() {
        let samples: Vec<Sample> = (0..10).map(|i| sample(10.0 * i as f64, 1000 + 100 * i)).collect();
        let g = growth(&samples, 0.0);
        let report = SoakReport {
            duration_s: 90.0,
            warmup_s: 0.0,
            max_growth_ratio: 0.05,
            processes: g,
            turns: 1,
            failed_turns: 0,
            lost: 0,
            stored_twice: 0,
            leaked_blocks: 0.0,
            store_bytes_start: 0,
            store_bytes_end: 0,
            etcd_start: None,
            etcd_end: None,
            failed_turn_errors: vec![],
            samples: vec![],
        };
        assert!(!report.passed(), "{}", table(&report));
        assert!(table(&report).contains("over the bound"));
    }
}
