//! The gateway's Prometheus metrics, all in one place.
//!
//! Owns: the gateway's own `metrics-exporter-prometheus` recorder. It is never
//! installed as the process-wide global recorder (`baton up` runs every role in one
//! process, each with its own recorder); the gateway keeps its handles in one static
//! because errors are counted where no request state is at hand (`IntoResponse`).
//! Invariants: names are constants; labels are small bounded sets (route, kind,
//! outcome, limit, reason), never user, conversation or turn IDs. Per-user metering
//! is exported without user labels: a histogram of tokens per user turn and a count
//! of recently active users.

use baton_telemetry::Upkeep;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use ::metrics::{Counter, Gauge, Histogram, Key, Label, Level, Metadata, Recorder};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusRecorder};

use baton_text::Usage;

use crate::slo::{SloOutcome, TurnClock};

/// Counter: HTTP requests by route.
pub const REQUESTS_TOTAL: &str = "baton_gateway_requests_total";
/// Counter: error responses by type.
pub const ERRORS_TOTAL: &str = "baton_gateway_errors_total";
/// Counter: tokens by kind (`prompt`, `cached`, `completion`).
pub const TOKENS_TOTAL: &str = "baton_gateway_tokens_total";
/// Counter: turns and completions by outcome.
pub const TURNS_TOTAL: &str = "baton_gateway_turns_total";
/// Counter: replies ended, by finish reason.
pub const FINISHED_TOTAL: &str = "baton_gateway_finished_total";
/// Counter: requests refused by a per-user limit, by limit.
pub const RATE_LIMITED_TOTAL: &str = "baton_gateway_rate_limited_total";
/// Gauge: generations in progress.
pub const OPEN_STREAMS: &str = "baton_gateway_open_streams";
/// Histogram: time from request to first token.
pub const TTFT: &str = "baton_gateway_time_to_first_token_seconds";
/// Histogram: time between consecutive tokens of one reply, as the gateway sees them.
pub const ITL: &str = "baton_gateway_inter_token_latency_seconds";
/// Histogram: time from request to the end of the reply.
pub const TURN_DURATION: &str = "baton_gateway_turn_duration_seconds";
/// Histogram: tokens metered per user turn, by kind (`prompt`, `completion`).
pub const USER_TURN_TOKENS: &str = "baton_gateway_user_turn_tokens";
/// Gauge: distinct users with a metered turn in the last five minutes.
pub const ACTIVE_USERS: &str = "baton_gateway_active_users";
/// Counter: metering writes that failed.
pub const METERING_FAILURES_TOTAL: &str = "baton_gateway_metering_failures_total";
/// Client connections open now.
pub const OPEN_CONNECTIONS: &str = "baton_gateway_open_connections";
/// Client connections closed on accept, by the limit they hit.
pub const CONNECTIONS_REFUSED_TOTAL: &str = "baton_gateway_connections_refused_total";
/// Idle client connections closed to make room for a new one (the table was full).
pub const CONNECTIONS_EVICTED_TOTAL: &str = "baton_gateway_connections_evicted_total";
/// Gauge: deleted conversations whose KV some node may still hold (tombstones in the store).
pub const EVICTION_TOMBSTONES: &str = "baton_gateway_eviction_tombstones";
/// Counter: eviction attempts, by `when` (`delete`, `retry`) and `result` (`complete`,
/// `owed`, `error`, `store_error`).
pub const EVICTION_ATTEMPTS_TOTAL: &str = "baton_gateway_eviction_attempts_total";
/// Counter: node acknowledgements of evictions.
pub const EVICTION_ACKS_TOTAL: &str = "baton_gateway_eviction_acks_total";

/// Counter: delivered replies judged against the SLO targets, by outcome (`met`,
/// `missed_ttft`, `missed_itl`; a turn that misses both is `missed_ttft`).
pub const TURNS_SLO_TOTAL: &str = "baton_gateway_turns_slo_total";

/// Counter: conversation summaries the input check refused (not stored, not used).
pub const SUMMARIES_REFUSED_TOTAL: &str = "baton_gateway_summaries_refused_total";
/// Counter: conversation summaries taken from the store instead of asking the model (the
/// retry of a turn refused or failed after its summary was made).
pub const SUMMARIES_REUSED_TOTAL: &str = "baton_gateway_summaries_reused_total";

/// Gauge: 1 while no coordinator answers and turns are routed on the last known
/// membership (degraded routing), else 0.
pub const ROUTING_DEGRADED: &str = "baton_gateway_routing_degraded";
/// Counter: turns routed on the last known membership because no coordinator answered.
pub const DEGRADED_TURNS_TOTAL: &str = "baton_gateway_degraded_turns_total";

/// Counter: turns by where their prompt KV came from, as the decode node reported it on the
/// first token (`outcome`, `reason`: `baton_proto::kv_source::PAIRS`, or `unknown`).
pub const KV_SOURCE_TOTAL: &str = "baton_gateway_kv_source_total";

/// The window of [`ACTIVE_USERS`].
pub const ACTIVE_WINDOW: Duration = Duration::from_secs(300);

const TTFT_BUCKETS: &[f64] = &[0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0];
const ITL_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5];
const DURATION_BUCKETS: &[f64] = &[0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0];
const TOKEN_BUCKETS: &[f64] = &[16.0, 64.0, 256.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0, 65536.0, 131072.0];
const META: Metadata<'static> = Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

pub struct Metrics {
    recorder: PrometheusRecorder,
    open_streams: Gauge,
    ttft: Histogram,
    itl: Histogram,
    turn_duration: Histogram,
    metering_failures: Counter,
    /// Hash of each recently metered user -> when; only the count is exported.
    active: Mutex<HashMap<u64, Instant>>,
    hasher: std::collections::hash_map::RandomState,
    /// Drains the recorder's histogram samples on a bound (a gateway nobody scrapes grew
    /// by every token's ITL).
    upkeep: Upkeep,
}

fn build() -> Metrics {
    let mut b = PrometheusBuilder::new();
    for (name, buckets) in [(TTFT, TTFT_BUCKETS), (ITL, ITL_BUCKETS), (TURN_DURATION, DURATION_BUCKETS), (USER_TURN_TOKENS, TOKEN_BUCKETS)] {
        b = b.set_buckets_for_metric(Matcher::Full(name.into()), buckets).expect("bucket lists are not empty");
    }
    let r = b.build_recorder();
    let m = Metrics {
        open_streams: gauge(&r, OPEN_STREAMS, "Generations in progress"),
        ttft: histogram(&r, TTFT, "Time from request to first token", &[]),
        itl: histogram(&r, ITL, "Time between consecutive tokens of one reply", &[]),
        turn_duration: histogram(&r, TURN_DURATION, "Time from request to the end of the reply", &[]),
        metering_failures: counter(&r, METERING_FAILURES_TOTAL, "Metering writes that failed", &[]),
        active: Mutex::new(HashMap::new()),
        hasher: Default::default(),
        upkeep: Upkeep::new(r.handle()),
        recorder: r,
    };
    for kind in ["prompt", "cached", "completion"] {
        let _ = token_counter(&m.recorder, kind);
    }
    for kind in ["prompt", "completion"] {
        let _ = user_tokens(&m.recorder, kind);
    }
    for outcome in ["completed", "failed", "started"] {
        let _ = turn_counter(&m.recorder, outcome);
    }
    for outcome in SloOutcome::ALL {
        let _ = slo_counter(&m.recorder, outcome);
    }
    for route in ["chat_completions", "completions", "models"] {
        let _ = request_counter(&m.recorder, route);
    }
    for when in ["delete", "retry"] {
        for result in ["complete", "owed", "error"] {
            let _ = eviction_counter(&m.recorder, when, result);
        }
    }
    let _ = counter(&m.recorder, EVICTION_ACKS_TOTAL, "Node acknowledgements of evictions", &[]);
    gauge(&m.recorder, EVICTION_TOMBSTONES, "Deleted conversations whose KV some node may still hold").set(0.0);
    set_routing_degraded(&m.recorder, false);
    let _ = degraded_turns(&m.recorder);
    for &(outcome, reason) in baton_proto::kv_source::PAIRS {
        let _ = kv_source_counter(&m.recorder, outcome, reason);
    }
    m
}

fn kv_source_counter(r: &PrometheusRecorder, outcome: &'static str, reason: &'static str) -> Counter {
    counter(r, KV_SOURCE_TOTAL, "Turns by where their prompt KV came from, as the decode node reported it", &[("outcome", outcome), ("reason", reason)])
}

/// A decode node said where a turn's prompt KV came from (labels from
/// `baton_proto::kv_source::labels`: a fixed set whatever the node sent).
pub fn kv_source(outcome: &'static str, reason: &'static str) {
    kv_source_counter(&get().recorder, outcome, reason).increment(1);
}

fn set_routing_degraded(r: &PrometheusRecorder, degraded: bool) {
    gauge(r, ROUTING_DEGRADED, "1 while no coordinator answers and turns route on the last known membership").set(if degraded { 1.0 } else { 0.0 });
}

fn degraded_turns(r: &PrometheusRecorder) -> Counter {
    counter(r, DEGRADED_TURNS_TOTAL, "Turns routed on the last known membership because no coordinator answered", &[])
}

/// Whether turns are being routed without a coordinator.
pub fn routing_degraded(degraded: bool) {
    set_routing_degraded(&get().recorder, degraded);
}

/// A turn was routed on the last known membership.
pub fn degraded_turn() {
    degraded_turns(&get().recorder).increment(1);
}

/// The process's gateway metrics.
pub fn get() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(build)
}

fn request_counter(r: &PrometheusRecorder, route: &'static str) -> Counter {
    counter(r, REQUESTS_TOTAL, "HTTP requests by route", &[("route", route)])
}

fn token_counter(r: &PrometheusRecorder, kind: &'static str) -> Counter {
    counter(r, TOKENS_TOTAL, "Tokens by kind (prompt, cached, completion)", &[("kind", kind)])
}

fn turn_counter(r: &PrometheusRecorder, outcome: &'static str) -> Counter {
    counter(r, TURNS_TOTAL, "Turns and completions by outcome", &[("outcome", outcome)])
}

fn slo_counter(r: &PrometheusRecorder, outcome: SloOutcome) -> Counter {
    counter(r, TURNS_SLO_TOTAL, "Delivered replies judged against the TTFT and per-turn p95 ITL targets, by outcome", &[("outcome", outcome.label())])
}

/// A delivered reply was judged against the SLO.
pub fn turn_slo(outcome: SloOutcome) {
    slo_counter(&get().recorder, outcome).increment(1);
}

fn user_tokens(r: &PrometheusRecorder, kind: &'static str) -> Histogram {
    histogram(r, USER_TURN_TOKENS, "Tokens metered per user turn, by kind (no user label)", &[("kind", kind)])
}

fn eviction_counter(r: &PrometheusRecorder, when: &'static str, result: &'static str) -> Counter {
    counter(r, EVICTION_ATTEMPTS_TOTAL, "Eviction attempts of deleted conversations, by when and result", &[("when", when), ("result", result)])
}

/// One eviction attempt ended (`when`: at the delete or a retry).
pub fn eviction_attempt(when: &'static str, result: &'static str) {
    eviction_counter(&get().recorder, when, result).increment(1);
}

/// Nodes acknowledged an eviction.
pub fn eviction_acks(n: usize) {
    counter(&get().recorder, EVICTION_ACKS_TOTAL, "Node acknowledgements of evictions", &[]).increment(n as u64);
}

/// Tombstones outstanding in the store.
pub fn set_tombstones(n: u64) {
    gauge(&get().recorder, EVICTION_TOMBSTONES, "Deleted conversations whose KV some node may still hold").set(n as f64);
}

/// A summary failed the input check.
pub fn summary_refused() {
    counter(&get().recorder, SUMMARIES_REFUSED_TOTAL, "Conversation summaries the input check refused", &[]).increment(1);
}

/// A stored summary served a turn at its boundary.
pub fn summary_reused() {
    counter(&get().recorder, SUMMARIES_REUSED_TOTAL, "Conversation summaries reused from the store", &[]).increment(1);
}

pub fn request(route: &'static str) {
    request_counter(&get().recorder, route).increment(1);
}

pub fn error(kind: &'static str) {
    counter(&get().recorder, ERRORS_TOTAL, "Error responses by type", &[("kind", kind)]).increment(1);
}

pub fn turn(outcome: &'static str) {
    turn_counter(&get().recorder, outcome).increment(1);
}

pub fn set_open_connections(n: usize) {
    gauge(&get().recorder, OPEN_CONNECTIONS, "Client connections open now").set(n as f64);
}

pub fn connection_refused(reason: &'static str) {
    counter(&get().recorder, CONNECTIONS_REFUSED_TOTAL, "Client connections closed on accept, by the limit they hit", &[("reason", reason)]).increment(1);
}

pub fn connection_evicted() {
    counter(&get().recorder, CONNECTIONS_EVICTED_TOTAL, "Idle client connections closed to make room for a new one", &[]).increment(1);
}

pub fn rate_limited(limit: &'static str) {
    counter(&get().recorder, RATE_LIMITED_TOTAL, "Requests refused by a per-user limit, by limit", &[("limit", limit)]).increment(1);
}

pub fn tokens(prompt: usize, cached: usize, completion: usize) {
    let r = &get().recorder;
    token_counter(r, "prompt").increment(prompt as u64);
    token_counter(r, "cached").increment(cached as u64);
    token_counter(r, "completion").increment(completion as u64);
}

pub fn stream_opened() {
    get().open_streams.increment(1.0);
}

/// A reply ended: its stream, finish reason and duration.
pub fn stream_closed(finish_reason: &'static str, started: Instant) {
    let m = get();
    m.open_streams.decrement(1.0);
    counter(&m.recorder, FINISHED_TOTAL, "Replies ended, by finish reason", &[("reason", finish_reason)]).increment(1);
    m.turn_duration.record(started.elapsed().as_secs_f64());
    m.upkeep.sampled(1);
}

/// A token reached the gateway: the first one is the TTFT, the others an ITL.
pub fn token(clock: &mut TurnClock) {
    let m = get();
    match clock.token() {
        Ok(ttft) => m.ttft.record(ttft.as_secs_f64()),
        Err(gap) => m.itl.record(gap.as_secs_f64()),
    }
    m.upkeep.sampled(1);
}

/// One user's turn was metered.
pub fn metered(user: &str, usage: &Usage) {
    let m = get();
    user_tokens(&m.recorder, "prompt").record(usage.prompt_tokens as f64);
    user_tokens(&m.recorder, "completion").record(usage.completion_tokens as f64);
    m.upkeep.sampled(2);
    let mut h = m.hasher.build_hasher();
    h.write(user.as_bytes());
    let mut active = m.active.lock().unwrap_or_else(|p| p.into_inner());
    if active.len() >= 1_000_000 {
        prune(&mut active);
    }
    active.insert(h.finish(), Instant::now());
}

pub fn metering_failed() {
    get().metering_failures.increment(1);
}

fn prune(active: &mut HashMap<u64, Instant>) {
    active.retain(|_, at| at.elapsed() < ACTIVE_WINDOW);
}

/// The text exposition.
pub fn encode() -> String {
    let m = get();
    let users = {
        let mut active = m.active.lock().unwrap_or_else(|p| p.into_inner());
        prune(&mut active);
        active.len()
    };
    gauge(&m.recorder, ACTIVE_USERS, "Distinct users with a metered turn in the last five minutes").set(users as f64);
    m.recorder.handle().render()
}

fn key(name: &'static str, labels: &[(&'static str, &'static str)]) -> Key {
    Key::from_parts(name, labels.iter().map(|(k, v)| Label::new(*k, *v)).collect::<Vec<_>>())
}

fn counter(r: &PrometheusRecorder, name: &'static str, help: &'static str, labels: &[(&'static str, &'static str)]) -> Counter {
    r.describe_counter(name.into(), None, help.into());
    r.register_counter(&key(name, labels), &META)
}

fn gauge(r: &PrometheusRecorder, name: &'static str, help: &'static str) -> Gauge {
    r.describe_gauge(name.into(), None, help.into());
    r.register_gauge(&key(name, &[]), &META)
}

fn histogram(r: &PrometheusRecorder, name: &'static str, help: &'static str, labels: &[(&'static str, &'static str)]) -> Histogram {
    r.describe_histogram(name.into(), None, help.into());
    r.register_histogram(&key(name, labels), &META)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_histograms_and_counts_users_without_labels() {
        let mut clock = TurnClock::start(Instant::now());
        token(&mut clock);
        token(&mut clock);
        turn_slo(clock.outcome(crate::slo::SloTargets { ttft: Duration::from_secs(60), itl: Duration::from_secs(60) }));
        let usage = Usage { prompt_tokens: 100, cached_tokens: 64, completion_tokens: 8 };
        metered("alice", &usage);
        metered("alice", &usage);
        metered("bob", &usage);
        let text = encode();
        assert!(text.contains("baton_gateway_inter_token_latency_seconds_bucket{le=\"0.05\"}"), "{text}");
        assert!(text.contains("baton_gateway_time_to_first_token_seconds_count"), "{text}");
        assert!(text.contains("baton_gateway_turns_slo_total{outcome=\"met\"} 1"), "{text}");
        assert!(text.contains("baton_gateway_turns_slo_total{outcome=\"missed_itl\"} 0"), "{text}");
        assert!(!text.contains("alice") && !text.contains("bob"), "{text}");
        let users = text.lines().find(|l| l.starts_with("baton_gateway_active_users ")).expect("active users");
        let n: f64 = users.split(' ').nth(1).and_then(|v| v.parse().ok()).expect("a number");
        assert!(n >= 2.0, "{users}");
        assert!(text.contains("baton_gateway_user_turn_tokens_bucket{kind=\"prompt\",le=\"256\"}"), "{text}");
    }
}
