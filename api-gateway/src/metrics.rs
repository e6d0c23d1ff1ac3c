//! The gateway's Prometheus metrics, all in one place. Names are constants;
//! counters are registered without `_total` because the OpenMetrics encoder
//! appends it (`baton_gateway_requests` is exported as
//! `baton_gateway_requests_total`). Labels are small bounded sets, never
//! user, conversation or turn IDs.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::OnceLock;

pub const REQUESTS: &str = "baton_gateway_requests";
pub const ERRORS: &str = "baton_gateway_errors";
pub const TOKENS: &str = "baton_gateway_tokens";
pub const TURNS: &str = "baton_gateway_turns";
pub const RATE_LIMITED: &str = "baton_gateway_rate_limited";
pub const OPEN_STREAMS: &str = "baton_gateway_open_streams";
pub const TTFT: &str = "baton_gateway_time_to_first_token_seconds";
pub const TURN_DURATION: &str = "baton_gateway_turn_duration_seconds";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub route: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: &'static str,
}

pub struct Metrics {
    pub registry: Registry,
    pub requests: Family<RouteLabels, Counter>,
    pub errors: Family<KindLabels, Counter>,
    pub tokens: Family<KindLabels, Counter>,
    pub turns: Family<KindLabels, Counter>,
    pub rate_limited: Family<KindLabels, Counter>,
    pub open_streams: Gauge,
    pub ttft: Histogram,
    pub turn_duration: Histogram,
}

fn build() -> Metrics {
    let mut registry = Registry::default();
    let requests = Family::<RouteLabels, Counter>::default();
    let errors = Family::<KindLabels, Counter>::default();
    let tokens = Family::<KindLabels, Counter>::default();
    let turns = Family::<KindLabels, Counter>::default();
    let rate_limited = Family::<KindLabels, Counter>::default();
    let open_streams = Gauge::default();
    let ttft = Histogram::new(exponential_buckets(0.005, 2.0, 14));
    let turn_duration = Histogram::new(exponential_buckets(0.01, 2.0, 14));
    registry.register(REQUESTS, "HTTP requests by route", requests.clone());
    registry.register(ERRORS, "Error responses by type", errors.clone());
    registry.register(TOKENS, "Tokens by kind (prompt, cached, completion)", tokens.clone());
    registry.register(TURNS, "Turns and completions by outcome", turns.clone());
    registry.register(RATE_LIMITED, "Requests refused by a per-user limit, by limit", rate_limited.clone());
    registry.register(OPEN_STREAMS, "Generations in progress", open_streams.clone());
    registry.register(TTFT, "Time from request to first token", ttft.clone());
    registry.register(TURN_DURATION, "Time from request to the end of the reply", turn_duration.clone());
    Metrics { registry, requests, errors, tokens, turns, rate_limited, open_streams, ttft, turn_duration }
}

/// The process-wide metrics.
pub fn get() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(build)
}

pub fn request(route: &'static str) {
    get().requests.get_or_create(&RouteLabels { route }).inc();
}

pub fn error(kind: &'static str) {
    get().errors.get_or_create(&KindLabels { kind }).inc();
}

pub fn turn(outcome: &'static str) {
    get().turns.get_or_create(&KindLabels { kind: outcome }).inc();
}

pub fn rate_limited(limit: &'static str) {
    get().rate_limited.get_or_create(&KindLabels { kind: limit }).inc();
}

pub fn tokens(prompt: usize, cached: usize, completion: usize) {
    let m = get();
    m.tokens.get_or_create(&KindLabels { kind: "prompt" }).inc_by(prompt as u64);
    m.tokens.get_or_create(&KindLabels { kind: "cached" }).inc_by(cached as u64);
    m.tokens.get_or_create(&KindLabels { kind: "completion" }).inc_by(completion as u64);
}

/// The text exposition.
pub fn encode() -> String {
    let mut out = String::new();
    if prometheus_client::encoding::text::encode(&mut out, &get().registry).is_err() {
        out.clear();
    }
    out
}
