//! What every Baton process's Prometheus recorder shares.
//!
//! `metrics-exporter-prometheus` keeps every histogram sample until a scrape (or
//! `run_upkeep`) folds it into the buckets, so a process nobody scrapes grew by every
//! sample: a gateway by every token's inter-token latency (about 40 KB a minute in the
//! 30-minute soak), a coordinator by every routing decision, a decode node by every
//! token. [`Upkeep`] counts a recorder's histogram samples and drains it every
//! [`UPKEEP_EVERY`], so at most that many are held whether or not anything scrapes.

use metrics_exporter_prometheus::PrometheusHandle;
use std::sync::atomic::{AtomicU64, Ordering};

/// Histogram samples held at most between two drains, over all of a recorder's histograms.
pub const UPKEEP_EVERY: u64 = 4096;

/// Whether `n` samples recorded after `before` cross a multiple of [`UPKEEP_EVERY`].
fn upkeep_due(before: u64, n: u64) -> bool {
    before / UPKEEP_EVERY != (before + n) / UPKEEP_EVERY
}

/// Counts one recorder's histogram samples and drains it every [`UPKEEP_EVERY`].
pub struct Upkeep {
    samples: AtomicU64,
    handle: PrometheusHandle,
}

impl Upkeep {
    pub fn new(handle: PrometheusHandle) -> Upkeep {
        Upkeep {
            samples: AtomicU64::new(0),
            handle,
        }
    }

    /// `n` histogram samples were recorded.
    pub fn sampled(&self, n: u64) {
        if upkeep_due(self.samples.fetch_add(n, Ordering::Relaxed), n) {
            self.handle.run_upkeep();
        }
    }

    /// Histogram samples recorded so far.
    pub fn samples(&self) -> u64 {
        self.samples.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_drain_is_due_where_the_count_crosses_a_multiple() {
        assert!(
            !upkeep_due(0, 1)
                && !upkeep_due(UPKEEP_EVERY - 2, 1)
                && !upkeep_due(UPKEEP_EVERY - 3, 2)
        );
        assert!(upkeep_due(UPKEEP_EVERY - 1, 1) && upkeep_due(UPKEEP_EVERY - 1, 2));
        assert!(upkeep_due(2 * UPKEEP_EVERY - 1, 1) && upkeep_due(5 * UPKEEP_EVERY - 2, 2));
    }
}
