//! `baton chaos --soak DURATION`: the chaos suite's cluster and load without faults, for a
//! long time, sampling every `--sample-every` the resident memory and open descriptors of
//! every process (the `baton` children, etcd, PostgreSQL's postmaster), every node's KV
//! blocks, the store's size on disk and etcd's database (its own `/metrics`). It fails when a process's memory grew more than
//! `--max-rss-growth` after warm-up, or when a turn was lost or stored twice or KV blocks
//! leaked at the end. Writes a table, `--report` JSON and a `--chart` SVG.

use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use baton::harness::{http_get, metric_sum, rss_and_fds};
use baton_bench::chaos::load::Load;
use baton_bench::chaos::report::{NodeLeak, Stored};
use baton_bench::chaos::soak::{growth, EtcdDb, Sample, SoakReport};
use baton_bench::load::chart::{draw_timeseries, Panel};

use super::check;
use super::cluster::{ChaosCluster, Kind};

/// One sample of everything.
fn sample(cluster: &mut ChaosCluster, load: &Load) -> Sample {
    let mut s = Sample { t_s: load.now_s(), store_bytes: cluster.postgres.data_bytes(), ..Sample::default() };
    s.turns = load.records().iter().filter(|r| r.acknowledged()).count();
    s.etcd = cluster.etcd.metrics().as_deref().and_then(EtcdDb::parse);
    let mut pids: Vec<(String, u32)> = cluster.members.iter().filter_map(|m| Some((m.name.clone(), m.proc.as_ref()?.pid()))).collect();
    pids.extend(cluster.etcd.pid().map(|p| ("etcd".to_string(), p)));
    pids.extend(cluster.postgres.pid().map(|p| ("postgres".to_string(), p)));
    for (name, pid) in pids {
        if let Some((rss, fds)) = rss_and_fds(pid) {
            s.rss_bytes.insert(name.clone(), rss);
            s.fds.insert(name, fds);
        }
    }
    for m in cluster.members.iter().filter(|m| matches!(m.kind, Kind::Prefill | Kind::Decode)) {
        if let Ok((200, text)) = http_get(&m.http, "/metrics", None, Duration::from_secs(3)) {
            let role = m.kind.name();
            let series = format!("baton_{role}_kv_blocks");
            let used = metric_sum(&text, &series, &["state=\"used\""]).unwrap_or(0.0);
            let cached = metric_sum(&text, &series, &["state=\"cached\""]).unwrap_or(0.0);
            let staging = metric_sum(&text, &format!("baton_{role}_kv_staging_blocks_used"), &[]).unwrap_or(0.0);
            let block_bytes = metric_sum(&text, &format!("baton_{role}_kv_block_bytes"), &[]).unwrap_or(0.0);
            s.kv_used_blocks.insert(m.name.clone(), used);
            s.kv_cached_blocks.insert(m.name.clone(), cached);
            s.kv_pool_bytes.insert(m.name.clone(), (used + cached + staging) * block_bytes);
        }
    }
    s
}

/// Runs the soak on a started cluster under a started load.
pub async fn run(mut cluster: ChaosCluster, load: Load, duration: Duration, warmup: Duration, every: Duration, max_growth: f64, settle: Duration) -> Result<SoakReport> {
    let mut samples = Vec::new();
    let mut next = Duration::ZERO;
    while load.now_s() < duration.as_secs_f64() {
        let wait = next.as_secs_f64() - load.now_s();
        if wait > 0.0 {
            tokio::time::sleep(Duration::from_secs_f64(wait)).await;
        }
        samples.push(tokio::task::block_in_place(|| sample(&mut cluster, &load)));
        next += every;
    }
    load.pause();
    load.wait_idle(Duration::from_secs(120)).await;
    let leaks: Vec<NodeLeak> = tokio::task::block_in_place(|| check::node_leaks(&cluster, settle));
    let duration_s = load.now_s();
    let records = load.stop().await;
    let verdicts = check::store_verdicts(&cluster.postgres.url(), &records).await?;
    let count = |v: Stored| verdicts.iter().filter(|x| **x == Some(v)).count();
    Ok(SoakReport {
        duration_s,
        warmup_s: warmup.as_secs_f64(),
        max_growth_ratio: max_growth,
        processes: growth(&samples, warmup.as_secs_f64()),
        turns: records.len(),
        failed_turns: records.iter().filter(|r| !r.acknowledged()).count(),
        lost: count(Stored::Lost),
        stored_twice: count(Stored::Twice),
        leaked_blocks: leaks.iter().map(NodeLeak::leaked).sum::<f64>() + leaks.iter().filter(|l| l.not_idle).count() as f64,
        store_bytes_start: samples.first().map_or(0, |s| s.store_bytes),
        store_bytes_end: samples.last().map_or(0, |s| s.store_bytes),
        etcd_start: samples.iter().find_map(|s| s.etcd),
        etcd_end: samples.iter().rev().find_map(|s| s.etcd),
        failed_turn_errors: records
            .iter()
            .filter(|r| !r.acknowledged())
            .map(|r| format!("{}/{}: {:?}", r.conversation, r.turn_id, r.attempts.iter().filter_map(|a| a.error.as_deref()).collect::<Vec<_>>()))
            .collect(),
        samples,
    })
}

/// The soak's chart: RSS and descriptors per process, KV blocks per node, store and etcd sizes.
pub fn chart(path: &Path, r: &SoakReport) -> Result<()> {
    fn lines<F: Fn(&Sample) -> Vec<(String, f64)>>(samples: &[Sample], f: F) -> Vec<(String, Vec<(f64, f64)>)> {
        let mut by: std::collections::BTreeMap<String, Vec<(f64, f64)>> = Default::default();
        for s in samples {
            for (k, v) in f(s) {
                by.entry(k).or_default().push((s.t_s, v));
            }
        }
        by.into_iter().collect()
    }
    let panels = vec![
        Panel { title: "resident memory".into(), y_desc: "MiB".into(), lines: lines(&r.samples, |s| s.rss_bytes.iter().map(|(k, v)| (k.clone(), *v as f64 / 1048576.0)).collect()) },
        Panel { title: "open file descriptors".into(), y_desc: "fds".into(), lines: lines(&r.samples, |s| s.fds.iter().map(|(k, v)| (k.clone(), *v as f64)).collect()) },
        Panel { title: "KV blocks pinned by sequences".into(), y_desc: "blocks".into(), lines: lines(&r.samples, |s| s.kv_used_blocks.iter().map(|(k, v)| (k.clone(), *v)).collect()) },
        Panel {
            title: "PostgreSQL data, etcd database and turns".into(),
            y_desc: "MiB / 100 turns".into(),
            lines: lines(&r.samples, |s| {
                let mut v = vec![("store MiB".into(), s.store_bytes as f64 / 1048576.0), ("turns / 100".into(), s.turns as f64 / 100.0)];
                if let Some(e) = s.etcd {
                    v.push(("etcd db MiB".into(), e.db_bytes as f64 / 1048576.0));
                    v.push(("etcd db in use MiB".into(), e.db_in_use_bytes as f64 / 1048576.0));
                }
                v
            }),
        },
    ];
    draw_timeseries(path, &panels)
}
