//! The coordinator's Prometheus metrics: every name in one place.
//!
//! Owns: one `metrics-exporter-prometheus` recorder per coordinator (never the
//! process-wide global one: `baton up` and the tests run several components in one
//! process), and the membership view that turns member lists into join/leave/expiry
//! counts. Labels are small fixed sets (kind, reason, role, result, change), never
//! node, user or conversation IDs.

use baton_telemetry::Upkeep;
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use ::metrics::{Counter, Gauge, Histogram, Key, Label, Level, Metadata, Recorder};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusRecorder};

/// Counter: routing decisions by kind (`decode`, `prefill`) and reason.
pub const ROUTING_DECISIONS_TOTAL: &str = "baton_coordinator_routing_decisions_total";
/// Histogram: seconds to take one routing decision, by kind.
pub const ROUTING_SECONDS: &str = "baton_coordinator_routing_seconds";
/// Gauge: registered nodes by role.
pub const NODES: &str = "baton_coordinator_nodes";
/// Counter: node registrations (joins and re-joins).
pub const REGISTRATIONS_TOTAL: &str = "baton_coordinator_registrations_total";
/// Counter: membership changes by role and change (`join`, `leave`, `expire`).
pub const MEMBERSHIP_CHANGES_TOTAL: &str = "baton_coordinator_membership_changes_total";
/// Counter: lease renewals by result.
pub const LEASE_RENEWALS_TOTAL: &str = "baton_coordinator_lease_renewals_total";
/// Counter: fleet-wide conversation evictions by result (`ok`, `pending`, `failed`).
pub const EVICTIONS_TOTAL: &str = "baton_coordinator_evictions_total";
/// Gauge: tombstoned conversations (deleted, not yet evicted on every node that may hold
/// them); with etcd membership the cluster's count (every replica reports the same).
pub const TOMBSTONES: &str = "baton_coordinator_tombstones";
/// Counter: joining nodes that had tombstoned conversations to evict, by result (`ok`, `failed`).
pub const JOIN_EVICTIONS_TOTAL: &str = "baton_coordinator_join_evictions_total";
/// Gauge: active conversations placed on decode nodes.
pub const CONVERSATIONS: &str = "baton_coordinator_conversations";

/// Every routing reason, so each series exists (at 0) before its first decision.
pub const DECISION_REASONS: &[(&str, &str)] = &[
    ("decode", "home"),
    ("decode", "spilled"),
    ("decode", "sticky"),
    ("prefill", "local_short_tail"),
    ("prefill", "local_pool_saturated"),
    ("prefill", "local_no_prefill_nodes"),
    ("prefill", "remote_least_loaded"),
    ("prefill", "remote_cached_prefix"),
    ("prefill", "remote_decode_busy"),
];

const ROUTING_BUCKETS: &[f64] = &[0.000_01, 0.000_04, 0.000_16, 0.000_64, 0.002_56, 0.010_24, 0.040_96, 0.163_84, 0.655_36, 2.621_44];
const META: Metadata<'static> = Metadata::new(module_path!(), Level::INFO, Some(module_path!()));
const ROLES: [&str; 2] = ["prefill", "decode"];

/// Handles to every series, and the recorder that renders them.
pub struct Metrics {
    recorder: PrometheusRecorder,
    /// Drains the recorder's histogram samples on a bound (the busier replica grew by
    /// every routing decision while nobody scraped it).
    upkeep: Upkeep,
    registrations: Counter,
    conversations: Gauge,
    /// Members (node ID -> role) at the last look, and the IDs that deregistered
    /// since: a member that vanishes without deregistering expired.
    view: Mutex<View>,
}

#[derive(Default)]
struct View {
    members: HashMap<String, &'static str>,
    deregistered: HashSet<String>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Metrics {
    pub fn new() -> Self {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Full(ROUTING_SECONDS.into()), ROUTING_BUCKETS)
            .expect("bucket list is not empty")
            .build_recorder();
        let m = Metrics {
            registrations: counter(&recorder, REGISTRATIONS_TOTAL, "Node registrations (joins and re-joins)", &[]),
            conversations: gauge(&recorder, CONVERSATIONS, "Active conversations placed on decode nodes", &[]),
            view: Mutex::new(View::default()),
            upkeep: Upkeep::new(recorder.handle()),
            recorder,
        };
        for (kind, reason) in DECISION_REASONS {
            let _ = m.decision_counter(kind, reason);
        }
        for kind in ["decode", "prefill"] {
            let _ = m.routing_histogram(kind);
        }
        for role in ROLES {
            m.nodes(role, 0);
            for change in ["join", "leave", "expire"] {
                m.change(role, change, 0);
            }
        }
        for result in ["ok", "unknown_lease"] {
            let _ = m.renewal_counter(result);
        }
        for result in ["ok", "pending", "failed"] {
            let _ = m.eviction_counter(result);
        }
        for result in ["ok", "failed"] {
            let _ = m.join_eviction_counter(result);
        }
        m.tombstones(0);
        m
    }

    fn decision_counter(&self, kind: &'static str, reason: &'static str) -> Counter {
        counter(&self.recorder, ROUTING_DECISIONS_TOTAL, "Routing decisions by kind and reason", &[("kind", kind), ("reason", reason)])
    }

    fn routing_histogram(&self, kind: &'static str) -> Histogram {
        self.recorder.describe_histogram(ROUTING_SECONDS.into(), None, "Time to take one routing decision".into());
        self.recorder.register_histogram(&key(ROUTING_SECONDS, &[("kind", kind)]), &META)
    }

    fn renewal_counter(&self, result: &'static str) -> Counter {
        counter(&self.recorder, LEASE_RENEWALS_TOTAL, "Lease renewals by result", &[("result", result)])
    }

    fn eviction_counter(&self, result: &'static str) -> Counter {
        counter(&self.recorder, EVICTIONS_TOTAL, "Fleet-wide conversation evictions by result", &[("result", result)])
    }

    fn change(&self, role: &'static str, change: &'static str, n: u64) {
        let help = "Membership changes by role: join, leave (deregistered), expire (lease ran out)";
        counter(&self.recorder, MEMBERSHIP_CHANGES_TOTAL, help, &[("role", role), ("change", change)]).increment(n);
    }

    /// One routing decision of `kind` for `reason` that took `seconds`.
    pub fn decision(&self, kind: &'static str, reason: &'static str, seconds: f64) {
        self.decision_counter(kind, reason).increment(1);
        self.routing_histogram(kind).record(seconds);
        self.upkeep.sampled(1);
    }

    /// `n` nodes of `role` are registered.
    pub fn nodes(&self, role: &'static str, n: i64) {
        gauge(&self.recorder, NODES, "Registered nodes by role", &[("role", role)]).set(n as f64);
    }

    pub fn registration(&self) {
        self.registrations.increment(1);
    }

    pub fn renewal(&self, result: &'static str) {
        self.renewal_counter(result).increment(1);
    }

    pub fn eviction(&self, result: &'static str) {
        self.eviction_counter(result).increment(1);
    }

    pub fn tombstones(&self, n: usize) {
        gauge(&self.recorder, TOMBSTONES, "Tombstoned conversations not yet evicted on every node that may hold them", &[]).set(n as f64);
    }

    fn join_eviction_counter(&self, result: &'static str) -> Counter {
        counter(&self.recorder, JOIN_EVICTIONS_TOTAL, "Joining nodes that evicted tombstoned conversations first, by result", &[("result", result)])
    }

    /// A joining node evicted (or failed to evict) the tombstoned conversations.
    pub fn join_eviction(&self, result: &'static str) {
        self.join_eviction_counter(result).increment(1);
    }

    pub fn conversations(&self, n: u64) {
        self.conversations.set(n as f64);
    }

    /// The node `id` deregistered (its departure is a leave, not an expiry).
    pub fn deregistered(&self, id: &str) {
        self.view.lock().unwrap_or_else(|p| p.into_inner()).deregistered.insert(id.to_string());
    }

    /// The current members (ID, role `prefill` or `decode`): counts joins, leaves
    /// and expiries against the previous look and sets the per-role gauges.
    pub fn members<'a>(&self, now: impl IntoIterator<Item = (&'a str, &'static str)>) {
        let now: HashMap<String, &'static str> = now.into_iter().map(|(id, role)| (id.to_string(), role)).collect();
        let mut view = self.view.lock().unwrap_or_else(|p| p.into_inner());
        for (id, role) in &now {
            if !view.members.contains_key(id) {
                self.change(role, "join", 1);
                view.deregistered.remove(id);
            }
        }
        let gone: Vec<(String, &'static str)> =
            view.members.iter().filter(|(id, _)| !now.contains_key(*id)).map(|(id, r)| (id.clone(), *r)).collect();
        for (id, role) in gone {
            let change = if view.deregistered.remove(&id) { "leave" } else { "expire" };
            self.change(role, change, 1);
        }
        if view.deregistered.len() > 4096 {
            view.deregistered.clear();
        }
        for role in ROLES {
            self.nodes(role, now.values().filter(|r| **r == role).count() as i64);
        }
        view.members = now;
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        self.recorder.handle().render()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

fn key(name: &'static str, labels: &[(&'static str, &'static str)]) -> Key {
    Key::from_parts(name, labels.iter().map(|(k, v)| Label::new(*k, *v)).collect::<Vec<_>>())
}

fn counter(r: &PrometheusRecorder, name: &'static str, help: &'static str, labels: &[(&'static str, &'static str)]) -> Counter {
    r.describe_counter(name.into(), None, help.into());
    r.register_counter(&key(name, labels), &META)
}

fn gauge(r: &PrometheusRecorder, name: &'static str, help: &'static str, labels: &[(&'static str, &'static str)]) -> Gauge {
    r.describe_gauge(name.into(), None, help.into());
    r.register_gauge(&key(name, labels), &META)
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_telemetry::UPKEEP_EVERY;

    #[test]
    fn undrained_histogram_samples_are_bounded_and_none_is_lost() {
        // Drained at every multiple, without a scrape: the count still adds up.
        let m = Metrics::new();
        let n = 3 * UPKEEP_EVERY + 7;
        for _ in 0..n {
            m.decision("decode", "home", 0.0001);
        }
        let text = m.encode();
        assert!(text.contains(&format!("baton_coordinator_routing_seconds_count{{kind=\"decode\"}} {n}")), "{text}");
    }

    #[test]
    fn membership_changes_are_joins_leaves_and_expiries() {
        let m = Metrics::new();
        m.members([("d0", "decode"), ("d1", "decode"), ("p0", "prefill")]);
        m.deregistered("d0");
        m.members([("p0", "prefill")]);
        let text = m.encode();
        for line in [
            "baton_coordinator_membership_changes_total{role=\"decode\",change=\"join\"} 2",
            "baton_coordinator_membership_changes_total{role=\"decode\",change=\"leave\"} 1",
            "baton_coordinator_membership_changes_total{role=\"decode\",change=\"expire\"} 1",
            "baton_coordinator_membership_changes_total{role=\"prefill\",change=\"join\"} 1",
            "baton_coordinator_nodes{role=\"decode\"} 0",
            "baton_coordinator_routing_decisions_total{kind=\"prefill\",reason=\"remote_cached_prefix\"} 0",
            "baton_coordinator_routing_seconds_bucket{kind=\"decode\",le=\"0.00001\"} 0",
        ] {
            assert!(text.contains(line), "missing {line}:\n{text}");
        }
    }

    #[test]
    fn names_follow_the_style() {
        for c in [ROUTING_DECISIONS_TOTAL, REGISTRATIONS_TOTAL, MEMBERSHIP_CHANGES_TOTAL, LEASE_RENEWALS_TOTAL, EVICTIONS_TOTAL] {
            assert!(c.starts_with("baton_coordinator_") && c.ends_with("_total"), "{c}");
        }
    }
}
