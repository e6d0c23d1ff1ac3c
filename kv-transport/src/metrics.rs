//! Statistics of KV transfers, and the names under which they are exported.
//!
//! Owns: [`TransportStats`], a plain struct of atomic counters that every sender and
//! receiver updates, and the metric-name constants a later exporter publishes them under.
//! Invariants: counters only grow, except the `reservations_live` gauge, which equals
//! created - completed - released at every quiescent point; labels are bounded sets
//! (transport, side, failure kind), never reservation, turn or user IDs.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Side, KINDS};

/// Label: transport name (`inproc`, `quic`, `tls_tcp`, `rdma`).
pub const LABEL_TRANSPORT: &str = "transport";
/// Label: `sender` or `receiver`.
pub const LABEL_SIDE: &str = "side";
/// Label: [`Error::label`].
pub const LABEL_KIND: &str = "kind";

/// Counter: frame bytes (header, payload, checksum) sent or received.
pub const BYTES_TOTAL: &str = "baton_kv_transport_bytes_total";
/// Counter: frames sent or received.
pub const FRAMES_TOTAL: &str = "baton_kv_transport_frames_total";
/// Counter: block-layers sent (sender) or installed (receiver).
pub const BLOCK_LAYERS_TOTAL: &str = "baton_kv_transport_block_layers_total";
/// Counter: frames a receiver rejected (unknown, expired, corrupt, out of range...).
pub const REJECTED_FRAMES_TOTAL: &str = "baton_kv_transport_rejected_frames_total";
/// Counter: transfers that completed.
pub const TRANSFERS_TOTAL: &str = "baton_kv_transport_transfers_total";
/// Histogram: seconds from the start of a transfer to its completion.
pub const TRANSFER_DURATION_SECONDS: &str = "baton_kv_transport_transfer_duration_seconds";
/// Counter: failed transfers, by kind.
pub const FAILURES_TOTAL: &str = "baton_kv_transport_failures_total";
/// Gauge: reservations granted and not yet completed or released.
pub const RESERVATIONS_LIVE: &str = "baton_kv_transport_reservations_live";
/// Counter: reservations granted.
pub const RESERVATIONS_CREATED_TOTAL: &str = "baton_kv_transport_reservations_created_total";
/// Counter: reservations whose deadline passed (a subset of released).
pub const RESERVATIONS_EXPIRED_TOTAL: &str = "baton_kv_transport_reservations_expired_total";
/// Counter: reservations whose blocks the transport returned to the pool.
pub const RESERVATIONS_RELEASED_TOTAL: &str = "baton_kv_transport_reservations_released_total";
/// Counter: reservations completed and handed to the pool's owner.
pub const RESERVATIONS_COMPLETED_TOTAL: &str = "baton_kv_transport_reservations_completed_total";

/// Upper bounds, in seconds, of the transfer-duration histogram buckets (plus +Inf).
pub const DURATION_BUCKETS_SECONDS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

/// Counters of one sender or receiver on one transport.
#[derive(Debug)]
pub struct TransportStats {
    pub transport: &'static str,
    pub side: Side,
    pub bytes: AtomicU64,
    pub frames: AtomicU64,
    pub block_layers: AtomicU64,
    pub rejected_frames: AtomicU64,
    pub transfers: AtomicU64,
    pub reservations_live: AtomicI64,
    pub reservations_created: AtomicU64,
    pub reservations_expired: AtomicU64,
    pub reservations_released: AtomicU64,
    pub reservations_completed: AtomicU64,
    /// Cumulative bucket counts for [`DURATION_BUCKETS_SECONDS`], last one is +Inf.
    pub duration_buckets: [AtomicU64; DURATION_BUCKETS_SECONDS.len() + 1],
    pub duration_sum_nanos: AtomicU64,
    /// Failures indexed like [`KINDS`].
    pub failures: [AtomicU64; KINDS.len()],
}

/// A copy of [`TransportStats`] at one moment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub transport: &'static str,
    pub side: Side,
    pub bytes: u64,
    pub frames: u64,
    pub block_layers: u64,
    pub rejected_frames: u64,
    pub transfers: u64,
    pub transfer_seconds_count: u64,
    pub transfer_seconds_sum_nanos: u64,
    pub reservations_live: i64,
    pub reservations_created: u64,
    pub reservations_expired: u64,
    pub reservations_released: u64,
    pub reservations_completed: u64,
    /// Non-zero failure counts by kind.
    pub failures: Vec<(&'static str, u64)>,
}

impl TransportStats {
    pub fn new(transport: &'static str, side: Side) -> Self {
        TransportStats {
            transport,
            side,
            bytes: AtomicU64::new(0),
            frames: AtomicU64::new(0),
            block_layers: AtomicU64::new(0),
            rejected_frames: AtomicU64::new(0),
            transfers: AtomicU64::new(0),
            reservations_live: AtomicI64::new(0),
            reservations_created: AtomicU64::new(0),
            reservations_expired: AtomicU64::new(0),
            reservations_released: AtomicU64::new(0),
            reservations_completed: AtomicU64::new(0),
            duration_buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            duration_sum_nanos: AtomicU64::new(0),
            failures: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    pub(crate) fn add_frame(&self, bytes: usize) {
        self.frames.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub(crate) fn add(&self, counter: &AtomicU64, n: u64) {
        // Takes the counter so call sites read as `stats.add(&stats.x, 1)` and stay greppable.
        let _ = self;
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn record_failure(&self, e: &Error) {
        self.failures[e.code() as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn record_transfer(&self, took: Duration) {
        self.transfers.fetch_add(1, Ordering::Relaxed);
        let secs = took.as_secs_f64();
        let i = DURATION_BUCKETS_SECONDS
            .iter()
            .position(|&b| secs <= b)
            .unwrap_or(DURATION_BUCKETS_SECONDS.len());
        for bucket in &self.duration_buckets[i..] {
            bucket.fetch_add(1, Ordering::Relaxed);
        }
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.duration_sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// Failures of one kind so far.
    pub fn failures_of(&self, kind: &str) -> u64 {
        KINDS
            .iter()
            .position(|k| *k == kind)
            .map_or(0, |i| self.failures[i].load(Ordering::Relaxed))
    }

    pub fn snapshot(&self) -> StatsSnapshot {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StatsSnapshot {
            transport: self.transport,
            side: self.side,
            bytes: r(&self.bytes),
            frames: r(&self.frames),
            block_layers: r(&self.block_layers),
            rejected_frames: r(&self.rejected_frames),
            transfers: r(&self.transfers),
            transfer_seconds_count: r(&self.duration_buckets[DURATION_BUCKETS_SECONDS.len()]),
            transfer_seconds_sum_nanos: r(&self.duration_sum_nanos),
            reservations_live: self.reservations_live.load(Ordering::Relaxed),
            reservations_created: r(&self.reservations_created),
            reservations_expired: r(&self.reservations_expired),
            reservations_released: r(&self.reservations_released),
            reservations_completed: r(&self.reservations_completed),
            failures: KINDS
                .iter()
                .zip(&self.failures)
                .filter_map(|(k, c)| {
                    let n = r(c);
                    (n > 0).then_some((*k, n))
                })
                .collect(),
        }
    }
}

/// Renders transport statistics as Prometheus text under the names above:
/// traffic, transfers and failures per link kind (`transport`, `side`), reservations
/// of this node's receiver (`transport="all"`).
pub fn render_prometheus(out: &mut String, links: &[Arc<TransportStats>], receiver: &TransportStats) {
    use std::fmt::Write;
    let lab = |s: &TransportStats| format!("transport=\"{}\",side=\"{}\"", s.transport, s.side);
    let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
    fn family(out: &mut String, name: &str, kind: &str, help: &str, rows: Vec<(String, f64)>) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, v) in rows {
            let _ = writeln!(out, "{name}{{{labels}}} {v}");
        }
        out.push('\n');
    }
    let per = |f: &dyn Fn(&TransportStats) -> u64| links.iter().map(|s| (lab(s), f(s) as f64)).collect::<Vec<_>>();
    family(out, BYTES_TOTAL, "counter", "KV frame bytes sent or received", per(&|s| load(&s.bytes)));
    family(out, FRAMES_TOTAL, "counter", "KV frames sent or received", per(&|s| load(&s.frames)));
    family(out, BLOCK_LAYERS_TOTAL, "counter", "Block-layers sent or installed", per(&|s| load(&s.block_layers)));
    family(out, REJECTED_FRAMES_TOTAL, "counter", "Frames a receiver rejected", per(&|s| load(&s.rejected_frames)));
    family(out, TRANSFERS_TOTAL, "counter", "KV transfers completed", per(&|s| load(&s.transfers)));
    let mut rows = Vec::new();
    for s in links.iter().map(|s| s.as_ref()).chain([receiver]) {
        for kind in KINDS {
            rows.push((format!("{},kind=\"{kind}\"", lab(s)), s.failures_of(kind) as f64));
        }
    }
    family(out, FAILURES_TOTAL, "counter", "KV transfer failures by kind", rows);
    let name = TRANSFER_DURATION_SECONDS;
    let _ = writeln!(out, "# HELP {name} Seconds from the start of a KV transfer to its completion\n# TYPE {name} histogram");
    for s in links {
        let l = lab(s);
        for (i, le) in DURATION_BUCKETS_SECONDS.iter().enumerate() {
            let _ = writeln!(out, "{name}_bucket{{{l},le=\"{le}\"}} {}", load(&s.duration_buckets[i]));
        }
        let count = load(&s.duration_buckets[DURATION_BUCKETS_SECONDS.len()]);
        let _ = writeln!(out, "{name}_bucket{{{l},le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "{name}_sum{{{l}}} {}", load(&s.duration_sum_nanos) as f64 / 1e9);
        let _ = writeln!(out, "{name}_count{{{l}}} {count}");
    }
    out.push('\n');
    let l = lab(receiver);
    let live = receiver.reservations_live.load(Ordering::Relaxed) as f64;
    family(out, RESERVATIONS_LIVE, "gauge", "Reservations granted and not yet completed or released", vec![(l.clone(), live)]);
    for (name, help, c) in [
        (RESERVATIONS_CREATED_TOTAL, "Reservations granted", &receiver.reservations_created),
        (RESERVATIONS_EXPIRED_TOTAL, "Reservations whose deadline passed", &receiver.reservations_expired),
        (RESERVATIONS_RELEASED_TOTAL, "Reservations whose blocks went back to the pool", &receiver.reservations_released),
        (RESERVATIONS_COMPLETED_TOTAL, "Reservations completed and handed over", &receiver.reservations_completed),
    ] {
        family(out, name, "counter", help, vec![(l.clone(), load(c) as f64)]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::ReservationId;

    #[test]
    fn names_follow_the_style() {
        for name in [
            BYTES_TOTAL,
            FRAMES_TOTAL,
            BLOCK_LAYERS_TOTAL,
            REJECTED_FRAMES_TOTAL,
            TRANSFERS_TOTAL,
            FAILURES_TOTAL,
            RESERVATIONS_CREATED_TOTAL,
            RESERVATIONS_EXPIRED_TOTAL,
            RESERVATIONS_RELEASED_TOTAL,
            RESERVATIONS_COMPLETED_TOTAL,
        ] {
            assert!(name.starts_with("baton_kv_transport_") && name.ends_with("_total"));
        }
        assert!(TRANSFER_DURATION_SECONDS.ends_with("_seconds"));
    }

    #[test]
    fn histogram_is_cumulative() {
        let s = TransportStats::new("inproc", Side::Sender);
        s.record_transfer(Duration::from_millis(3));
        s.record_transfer(Duration::from_secs(60));
        s.record_failure(&Error::ReservationExpired { reservation: ReservationId(1) });
        let snap = s.snapshot();
        assert_eq!(snap.transfers, 2);
        assert_eq!(snap.transfer_seconds_count, 2);
        assert_eq!(s.duration_buckets[0].load(Ordering::Relaxed), 0);
        assert_eq!(s.duration_buckets[2].load(Ordering::Relaxed), 1);
        assert_eq!(snap.failures, vec![("reservation_expired", 1)]);
    }

    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn transport_stats_render_as_prometheus_families() {
        let link = Arc::new(TransportStats::new("quic", Side::Receiver));
        link.bytes.fetch_add(4096, Ordering::Relaxed);
        link.duration_buckets[3].fetch_add(1, Ordering::Relaxed);
        link.duration_buckets[DURATION_BUCKETS_SECONDS.len()].fetch_add(1, Ordering::Relaxed);
        let all = TransportStats::new("all", Side::Receiver);
        all.reservations_live.fetch_add(2, Ordering::Relaxed);
        all.reservations_expired.fetch_add(1, Ordering::Relaxed);
        let mut out = String::new();
        render_prometheus(&mut out, &[link], &all);
        let l = "transport=\"quic\",side=\"receiver\"";
        assert_eq!(value(&out, &format!("baton_kv_transport_bytes_total{{{l}}}")), Some(4096.0), "{out}");
        assert_eq!(value(&out, &format!("baton_kv_transport_transfer_duration_seconds_bucket{{{l},le=\"+Inf\"}}")), Some(1.0), "{out}");
        assert_eq!(value(&out, &format!("baton_kv_transport_failures_total{{{l},kind=\"reservation_expired\"}}")), Some(0.0), "{out}");
        let a = "transport=\"all\",side=\"receiver\"";
        assert_eq!(value(&out, &format!("baton_kv_transport_reservations_live{{{a}}}")), Some(2.0), "{out}");
        assert_eq!(value(&out, &format!("baton_kv_transport_reservations_expired_total{{{a}}}")), Some(1.0), "{out}");
        for family in out.split("\n\n").filter(|f| !f.trim().is_empty()) {
            assert_eq!(family.matches("# TYPE ").count(), 1, "one TYPE per family:\n{family}");
        }
    }
}
