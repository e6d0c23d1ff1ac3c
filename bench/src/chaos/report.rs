//! The chaos report's arithmetic, pure: turns and attempts are attributed to the fault
//! window they started in, and each window gets its counts, its recovery time, its p95
//! TTFT beside the baseline's, the store's verdict on its acknowledged turns and the KV
//! blocks leaked on the nodes once its load quiesced. [`ChaosReport::passed`] is the gate.
//!
//! Definitions (docs/operations.md, "Chaos"):
//! - **failed**: a turn not acknowledged before its deadline, every retry included.
//! - **succeeded on retry**: acknowledged after at least one failed attempt (same turn ID).
//! - **lost**: acknowledged to the client, but the store holds no finished turn with that
//!   ID and reply. **stored twice**: the store holds the turn's ID more than once, its
//!   token log repeats or misses an index, or the log's text is not the stored reply.
//! - **recovery**: from the fault's injection to the end of the last failed attempt that
//!   ended in its window (0 when no attempt failed).
//! - **leaked KV blocks** of a node, measured once no turn runs and the node reports no
//!   running, waiting or swapped sequence: blocks still pinned (`used`, any tier), staging
//!   blocks still held, and receiver reservations still live. Cached prefix blocks are not
//!   leaks (the cache owns them and evicts them on demand).

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use super::load::TurnRecord;

/// A stretch of the run: the baseline, or a fault from its injection to the end of its
/// recovery period.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Window {
    pub fault: String,
    /// Seconds since the load started.
    pub start_s: f64,
    pub end_s: f64,
}

/// What the store says about one acknowledged turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Stored {
    Once,
    Lost,
    Twice,
}

/// Leaked KV blocks of one node after a window's load quiesced.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NodeLeak {
    pub node: String,
    /// Pinned (`used`) blocks of every tier.
    pub used_blocks: f64,
    pub staging_blocks: f64,
    pub live_reservations: f64,
    /// The node did not reach an idle state (sequences still running) in time.
    pub not_idle: bool,
}

impl NodeLeak {
    pub fn leaked(&self) -> f64 {
        self.used_blocks + self.staging_blocks + self.live_reservations
    }
}

/// One row of the report.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FaultRow {
    pub fault: String,
    pub turns: usize,
    pub failed: usize,
    pub succeeded_on_retry: usize,
    pub lost: usize,
    pub stored_twice: usize,
    pub recovery_s: f64,
    pub leaked_blocks: f64,
    pub nodes: Vec<NodeLeak>,
    pub p95_ttft_ms: Option<f64>,
    pub p95_ttft_baseline_ms: Option<f64>,
    /// Datagrams the KV relays forwarded and dropped in the window (set by the harness):
    /// KV crossed them, and the kv-loss fault dropped some.
    #[serde(default)]
    pub kv_relay_forwarded: u64,
    #[serde(default)]
    pub kv_relay_dropped: u64,
    /// Anything the harness wants an operator to know (a node that did not get idle...).
    pub notes: Vec<String>,
}

/// The whole report (`--report PATH` writes it as JSON).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ChaosReport {
    pub rows: Vec<FaultRow>,
    pub conversations: usize,
    pub duration_s: f64,
}

impl ChaosReport {
    /// The gate: no turn lost or stored twice and no block leaked, in any window.
    pub fn passed(&self) -> bool {
        self.rows.iter().all(|r| r.lost == 0 && r.stored_twice == 0 && r.leaked_blocks == 0.0 && r.nodes.iter().all(|n| !n.not_idle))
    }
}

/// p95 of `xs` (nearest rank), `None` if empty.
pub fn p95(xs: &mut [f64]) -> Option<f64> {
    if xs.is_empty() {
        return None;
    }
    xs.sort_by(f64::total_cmp);
    let rank = ((0.95 * xs.len() as f64).ceil() as usize).clamp(1, xs.len());
    Some(xs[rank - 1])
}

/// The window a time falls in (the last one starting at or before it).
fn window_of(windows: &[Window], t: f64) -> Option<usize> {
    windows.iter().rposition(|w| w.start_s <= t)
}

/// Builds a row per window. `verdicts[i]` is the store's verdict on `records[i]` (for
/// acknowledged turns; ignored otherwise); `leaks[w]` the nodes measured after window `w`.
/// The first window is the baseline every row's TTFT is compared with.
pub fn rows(windows: &[Window], records: &[TurnRecord], verdicts: &[Option<Stored>], leaks: &[Vec<NodeLeak>]) -> Vec<FaultRow> {
    let mut rows: Vec<FaultRow> = windows
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let nodes = leaks.get(i).cloned().unwrap_or_default();
            FaultRow {
                fault: w.fault.clone(),
                turns: 0,
                failed: 0,
                succeeded_on_retry: 0,
                lost: 0,
                stored_twice: 0,
                recovery_s: 0.0,
                leaked_blocks: nodes.iter().map(NodeLeak::leaked).sum(),
                notes: nodes.iter().filter(|n| n.not_idle).map(|n| format!("{} did not get idle", n.node)).collect(),
                nodes,
                p95_ttft_ms: None,
                p95_ttft_baseline_ms: None,
                kv_relay_forwarded: 0,
                kv_relay_dropped: 0,
            }
        })
        .collect();
    let mut ttfts: Vec<Vec<f64>> = vec![Vec::new(); windows.len()];
    for (i, r) in records.iter().enumerate() {
        let Some(w) = window_of(windows, r.start_s) else { continue };
        let row = &mut rows[w];
        row.turns += 1;
        if !r.acknowledged() {
            row.failed += 1;
            let errors: Vec<&str> = r.attempts.iter().filter_map(|a| a.error.as_deref()).collect();
            row.notes.push(format!("{}/{} failed after {} attempts: {errors:?}", r.conversation, r.turn_id, r.attempts.len()));
        } else if r.succeeded_on_retry() {
            row.succeeded_on_retry += 1;
        }
        if r.acknowledged() {
            match verdicts.get(i).copied().flatten() {
                Some(Stored::Lost) => row.lost += 1,
                Some(Stored::Twice) => row.stored_twice += 1,
                _ => {}
            }
        }
        if let Some(t) = r.ttft_s {
            ttfts[w].push(t * 1e3);
        }
    }
    // Recovery: a failed attempt counts where its error was seen (a turn begun before
    // the fault can fail inside it).
    for r in records {
        for a in r.attempts.iter().filter(|a| a.error.is_some()) {
            if let Some(w) = window_of(windows, a.end_s) {
                let since = a.end_s - windows[w].start_s;
                rows[w].recovery_s = rows[w].recovery_s.max(since);
            }
        }
    }
    let baseline = ttfts.first().cloned().map(|mut v| p95(&mut v)).unwrap_or(None);
    for (row, mut t) in rows.iter_mut().zip(ttfts) {
        row.p95_ttft_ms = p95(&mut t);
        row.p95_ttft_baseline_ms = baseline;
    }
    rows
}

/// The report as a table.
pub fn table(report: &ChaosReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<18} {:>6} {:>7} {:>9} {:>5} {:>7} {:>10} {:>7} {:>16} {:>16}",
        "fault", "turns", "failed", "retry-ok", "lost", "twice", "recovery", "leaked", "p95 TTFT ms", "KV relay fwd/drop"
    );
    for r in &report.rows {
        let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0}"));
        let _ = writeln!(
            out,
            "{:<18} {:>6} {:>7} {:>9} {:>5} {:>7} {:>9.1}s {:>7} {:>16} {:>16}",
            r.fault,
            r.turns,
            r.failed,
            r.succeeded_on_retry,
            r.lost,
            r.stored_twice,
            r.recovery_s,
            r.leaked_blocks,
            format!("{} vs {}", ms(r.p95_ttft_ms), ms(r.p95_ttft_baseline_ms)),
            format!("{}/{}", r.kv_relay_forwarded, r.kv_relay_dropped),
        );
        for n in &r.notes {
            let _ = writeln!(out, "  note: {n}");
        }
    }
    let _ = writeln!(out, "{} conversations, {:.0} s; gate: {}", report.conversations, report.duration_s, if report.passed() { "PASSED (nothing lost, stored twice or leaked)" } else { "FAILED" });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chaos::load::AttemptRecord;

    fn turn(start: f64, attempts: &[(f64, f64, bool)], ack: bool, ttft: f64) -> TurnRecord {
        TurnRecord {
            conversation: "c".into(),
            turn_id: format!("t{start}"),
            start_s: start,
            end_s: attempts.last().map_or(start, |a| a.1),
            attempts: attempts.iter().map(|&(s, e, failed)| AttemptRecord { gateway: 0, start_s: s, end_s: e, error: failed.then(|| "transport".into()) }).collect(),
            reply: ack.then(|| "hi".into()),
            ttft_s: Some(ttft),
        }
    }

    #[test]
    fn turns_attempts_and_verdicts_land_in_their_windows() {
        let windows = vec![
            Window { fault: "baseline".into(), start_s: 0.0, end_s: 10.0 },
            Window { fault: "kill-gateway".into(), start_s: 10.0, end_s: 20.0 },
        ];
        let records = vec![
            turn(1.0, &[(1.0, 1.5, false)], true, 0.1),
            // Begun before the fault, failed inside it, acknowledged on retry.
            turn(9.5, &[(9.5, 10.5, true), (10.6, 13.0, false)], true, 0.2),
            turn(11.0, &[(11.0, 12.0, true), (12.1, 14.5, true)], false, 0.3),
            turn(15.0, &[(15.0, 15.4, false)], true, 0.4),
        ];
        let verdicts = vec![Some(Stored::Once), Some(Stored::Once), None, Some(Stored::Lost)];
        let leaks = vec![vec![], vec![NodeLeak { node: "decode-0".into(), used_blocks: 2.0, staging_blocks: 0.0, live_reservations: 1.0, not_idle: false }]];
        let rows = rows(&windows, &records, &verdicts, &leaks);
        assert_eq!((rows[0].turns, rows[0].failed, rows[0].succeeded_on_retry), (2, 0, 1));
        assert_eq!(rows[0].recovery_s, 0.0, "the failed attempt's error came in the fault's window");
        assert_eq!((rows[1].turns, rows[1].failed, rows[1].lost), (2, 1, 1));
        assert!((rows[1].recovery_s - 4.5).abs() < 1e-9, "{}", rows[1].recovery_s);
        assert_eq!(rows[1].leaked_blocks, 3.0);
        assert_eq!(rows[1].p95_ttft_baseline_ms, Some(200.0));
        assert_eq!(rows[1].p95_ttft_ms, Some(400.0));
        let report = ChaosReport { rows, conversations: 1, duration_s: 20.0 };
        assert!(!report.passed());
        assert!(table(&report).contains("kill-gateway"));
    }

    #[test]
    fn a_clean_run_passes() {
        let windows = vec![Window { fault: "baseline".into(), start_s: 0.0, end_s: 10.0 }];
        let records = vec![turn(1.0, &[(1.0, 1.5, false)], true, 0.1)];
        let leaks = vec![vec![NodeLeak { node: "d".into(), used_blocks: 0.0, staging_blocks: 0.0, live_reservations: 0.0, not_idle: false }]];
        let report = ChaosReport { rows: rows(&windows, &records, &[Some(Stored::Once)], &leaks), conversations: 1, duration_s: 10.0 };
        assert!(report.passed(), "{}", table(&report));
    }

    #[test]
    fn p95_is_the_nearest_rank() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(p95(&mut v), Some(95.0));
        assert_eq!(p95(&mut []), None);
        assert_eq!(p95(&mut [3.0]), Some(3.0));
    }
}
