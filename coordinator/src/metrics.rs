//! The coordinator's Prometheus metrics: every name in one place.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

pub const ROUTING_DECISIONS_TOTAL: &str = "baton_coordinator_routing_decisions";
pub const ROUTING_SECONDS: &str = "baton_coordinator_routing_seconds";
pub const NODES: &str = "baton_coordinator_nodes";
pub const REGISTRATIONS_TOTAL: &str = "baton_coordinator_registrations";
pub const LEASE_RENEWALS_TOTAL: &str = "baton_coordinator_lease_renewals";
pub const EVICTIONS_TOTAL: &str = "baton_coordinator_evictions";
pub const CONVERSATIONS: &str = "baton_coordinator_conversations";
// prometheus-client appends `_total` to counters when encoding.

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    pub kind: &'static str,
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RoleLabels {
    pub role: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: &'static str,
}

/// Handles to every metric, and the registry that encodes them.
#[derive(Debug)]
pub struct Metrics {
    pub registry: Registry,
    pub decisions: Family<DecisionLabels, Counter>,
    pub routing_seconds: Family<KindLabels, Histogram>,
    pub nodes: Family<RoleLabels, Gauge>,
    pub registrations: Counter,
    pub renewals: Family<ResultLabels, Counter>,
    pub evictions: Family<ResultLabels, Counter>,
    pub conversations: Gauge,
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let decisions = Family::<DecisionLabels, Counter>::default();
        registry.register(ROUTING_DECISIONS_TOTAL, "Routing decisions by kind and reason", decisions.clone());
        let routing_seconds = Family::<KindLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.000_01, 4.0, 10))
        });
        registry.register(ROUTING_SECONDS, "Time to take one routing decision", routing_seconds.clone());
        let nodes = Family::<RoleLabels, Gauge>::default();
        registry.register(NODES, "Registered nodes by role", nodes.clone());
        let registrations = Counter::default();
        registry.register(REGISTRATIONS_TOTAL, "Node registrations (joins and re-joins)", registrations.clone());
        let renewals = Family::<ResultLabels, Counter>::default();
        registry.register(LEASE_RENEWALS_TOTAL, "Lease renewals by result", renewals.clone());
        let evictions = Family::<ResultLabels, Counter>::default();
        registry.register(EVICTIONS_TOTAL, "Fleet-wide conversation evictions by result", evictions.clone());
        let conversations = Gauge::default();
        registry.register(CONVERSATIONS, "Active conversations placed on decode nodes", conversations.clone());
        Self { registry, decisions, routing_seconds, nodes, registrations, renewals, evictions, conversations }
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
