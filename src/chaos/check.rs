//! The two checks after each fault: what PostgreSQL holds against what clients were
//! acknowledged, and the KV blocks each live node still holds once nothing runs.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use baton::harness::{http_get, metric_sum};
use baton_api_gateway::store::{ConversationStore, PostgresStore, TurnState};
use baton_bench::chaos::load::TurnRecord;
use baton_bench::chaos::report::{NodeLeak, Stored};

use super::cluster::{ChaosCluster, Kind};

/// The store's verdict on every acknowledged record (`None` for failed turns): stored
/// once (one row with that turn ID, finished, with the acknowledged reply, and a token
/// log whose indices are 0..n once each and whose text is that reply), lost, or twice.
pub async fn store_verdicts(url: &str, records: &[TurnRecord]) -> Result<Vec<Option<Stored>>> {
    let store = PostgresStore::connect(url).await.context("connecting to PostgreSQL")?;
    let mut turns_of = HashMap::new();
    let mut out = Vec::with_capacity(records.len());
    for r in records {
        let Some(reply) = &r.reply else {
            out.push(None);
            continue;
        };
        if !turns_of.contains_key(&r.conversation) {
            turns_of.insert(r.conversation.clone(), store.list_turns(&r.conversation).await?);
        }
        let rows: Vec<_> = turns_of[&r.conversation].iter().filter(|t| t.turn_id == r.turn_id).collect();
        let verdict = match rows.as_slice() {
            [] => Stored::Lost,
            [t] if !matches!(t.state, TurnState::Done | TurnState::Stopped) || &t.reply_text != reply => Stored::Lost,
            [_] => {
                let log = store.read_log(&r.conversation, &r.turn_id, 0).await?;
                let indices_once = log.iter().enumerate().all(|(i, e)| e.index == i as i64);
                let text: String = log.iter().map(|e| e.text.as_str()).collect();
                // A turn whose log was compacted away keeps only its row; a log that is
                // there must be the reply, once.
                if log.is_empty() || (indices_once && &text == reply) {
                    Stored::Once
                } else {
                    Stored::Twice
                }
            }
            _ => Stored::Twice,
        };
        out.push(Some(verdict));
    }
    Ok(out)
}

/// What a node's `/metrics` says about its KV blocks.
struct Blocks {
    busy: f64,
    leak: NodeLeak,
}

fn read_blocks(name: &str, role: &str, http: &str) -> Option<Blocks> {
    let (status, text) = http_get(http, "/metrics", None, Duration::from_secs(3)).ok()?;
    if status != 200 {
        return None;
    }
    let m = |series: &str, labels: &[&str]| metric_sum(&text, &format!("baton_{role}_{series}"), labels).unwrap_or(0.0);
    let busy = m("running_sequences", &[]) + m("queue_depth", &[]) + m("swapped_sequences", &[]);
    let leak = NodeLeak {
        node: name.to_string(),
        used_blocks: m("kv_blocks", &["state=\"used\""]),
        staging_blocks: m("kv_staging_blocks_used", &[]),
        live_reservations: metric_sum(&text, "baton_kv_transport_reservations_live", &[]).unwrap_or(0.0),
        not_idle: false,
    };
    Some(Blocks { busy, leak })
}

/// Every live node's leaked blocks, once it is idle: polled until each reports no
/// sequence and nothing held, or `within` passes (reservations are released by their
/// deadline, so `within` should exceed the nodes' `--kv-deadline`).
pub fn node_leaks(cluster: &ChaosCluster, within: Duration) -> Vec<NodeLeak> {
    let nodes: Vec<(String, &'static str, String)> = cluster
        .members
        .iter()
        .filter(|m| matches!(m.kind, Kind::Prefill | Kind::Decode) && m.proc.is_some())
        .map(|m| (m.name.clone(), m.kind.name(), m.http.clone()))
        .collect();
    let deadline = Instant::now() + within;
    let mut out = Vec::new();
    for (name, role, http) in nodes {
        let mut last = None;
        loop {
            if let Some(b) = read_blocks(&name, role, &http) {
                let clean = b.busy == 0.0 && b.leak.leaked() == 0.0;
                last = Some(b);
                if clean {
                    break;
                }
            }
            if Instant::now() > deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        match last {
            Some(b) => out.push(NodeLeak { not_idle: b.busy > 0.0, ..b.leak }),
            None => out.push(NodeLeak { node: name, used_blocks: 0.0, staging_blocks: 0.0, live_reservations: 0.0, not_idle: true }),
        }
    }
    out
}
