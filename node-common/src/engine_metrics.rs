//! A node's own Prometheus recorder ([`NodeRecorder`]; never the process-wide
//! global one: `baton up` and the tests run several nodes in one process), the
//! handles registered in it, and the series both node roles derive from their
//! engine and KV transport at scrape time (prompt tokens by source, prefix hits
//! by tier, engine work, queue, KV blocks by state and tier, transfers). Each
//! role names them under its own prefix (`baton_decode_queue_depth`,
//! `baton_prefill_queue_depth`; docs/metrics.md lists them).
//! Invariants: labels are small fixed sets (source, state, tier, outcome,
//! transport, side), never user, conversation or turn IDs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ::metrics::{Counter, Gauge, Histogram, HistogramFn, Key, KeyName, Label, Level, Metadata, Recorder};
use baton_engine::Engine;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusRecorder};

use crate::kv::KvNode;
use baton_telemetry::Upkeep;

const META: Metadata<'static> = Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

fn key(name: &str, labels: &[(&'static str, &'static str)]) -> Key {
    Key::from_parts(KeyName::from(name.to_string()), labels.iter().map(|(k, v)| Label::new(*k, *v)).collect::<Vec<_>>())
}

fn counter(r: &PrometheusRecorder, name: &str, help: &str, labels: &[(&'static str, &'static str)]) -> Counter {
    r.describe_counter(KeyName::from(name.to_string()), None, help.to_string().into());
    r.register_counter(&key(name, labels), &META)
}

fn gauge(r: &PrometheusRecorder, name: &str, help: &'static str, labels: &[(&'static str, &'static str)]) -> Gauge {
    r.describe_gauge(KeyName::from(name.to_string()), None, help.into());
    r.register_gauge(&key(name, labels), &META)
}

/// Appends a counter with a fractional value (the `metrics` counters are integers).
pub fn float_counter(out: &mut String, name: &str, help: &str, value: f64) {
    use std::fmt::Write;
    let _ = write!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}\n\n");
}

/// A counter exported through the recorder whose value the node can also read
/// (for its gRPC `Stats`).
pub struct Count {
    handle: Counter,
    value: AtomicU64,
}

impl Count {
    pub fn inc(&self) {
        self.inc_by(1);
    }

    pub fn inc_by(&self, n: u64) {
        self.value.fetch_add(n, Ordering::Relaxed);
        self.handle.increment(n);
    }

    pub fn get(&self) -> u64 {
        self.value.load(Ordering::Relaxed)
    }
}

/// A histogram of the node's recorder whose samples count towards its upkeep.
struct Drained {
    inner: Histogram,
    upkeep: Arc<Upkeep>,
}

impl HistogramFn for Drained {
    fn record(&self, value: f64) {
        self.inner.record(value);
        self.upkeep.sampled(1);
    }

    fn record_many(&self, value: f64, count: usize) {
        self.inner.record_many(value, count);
        self.upkeep.sampled(count as u64);
    }
}

/// Latency buckets (seconds) around the 1 s TTFT target.
pub const TTFT_BUCKETS: &[f64] = &[0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0];

/// How a role's series are named: `{prefix}_queue_depth` and so on.
pub struct MetricsSpec {
    /// `baton_decode`, `baton_prefill`.
    pub prefix: &'static str,
    /// Where this role's `imported` prompt tokens come from (`imported from a prefill node`).
    pub imported: &'static str,
    /// Bucket bounds (seconds) of the role's histograms besides `time_to_first_token_seconds`
    /// (always [`TTFT_BUCKETS`]), by name under the prefix.
    pub buckets: &'static [(&'static str, &'static [f64])],
}

impl MetricsSpec {
    pub const fn new(prefix: &'static str, imported: &'static str, buckets: &'static [(&'static str, &'static [f64])]) -> Self {
        MetricsSpec { prefix, imported, buckets }
    }
}

/// One node's recorder: the role registers its series in it, and a scrape
/// refreshes the engine- and transport-derived ones before rendering.
pub struct NodeRecorder {
    recorder: PrometheusRecorder,
    upkeep: Arc<Upkeep>,
    prefix: &'static str,
    series: EngineSeries,
    /// Prompt tokens this node received from another node instead of computing.
    imported_tokens: AtomicU64,
}

impl NodeRecorder {
    pub fn new(spec: &MetricsSpec) -> Self {
        let mut builder = PrometheusBuilder::new();
        for (name, buckets) in [("time_to_first_token_seconds", TTFT_BUCKETS)].iter().chain(spec.buckets) {
            let name = format!("{}_{name}", spec.prefix);
            builder = builder.set_buckets_for_metric(Matcher::Full(name), buckets).expect("bucket lists are not empty");
        }
        let recorder = builder.build_recorder();
        let upkeep = Arc::new(Upkeep::new(recorder.handle()));
        NodeRecorder { recorder, upkeep, prefix: spec.prefix, series: EngineSeries::new(spec), imported_tokens: AtomicU64::new(0) }
    }

    fn name(&self, name: &str) -> String {
        format!("{}_{name}", self.prefix)
    }

    /// The counter `{prefix}_{name}`, which the node can also read.
    pub fn count(&self, name: &str, help: &'static str) -> Count {
        Count { handle: self.counter(name, help, &[]), value: AtomicU64::new(0) }
    }

    /// The counter `{prefix}_{name}` with `labels`.
    pub fn counter(&self, name: &str, help: &'static str, labels: &[(&'static str, &'static str)]) -> Counter {
        counter(&self.recorder, &self.name(name), help, labels)
    }

    /// The histogram `{prefix}_{name}` (its buckets are the spec's); its samples are
    /// drained every [`baton_telemetry::UPKEEP_EVERY`] recorded in the node's histograms.
    pub fn histogram(&self, name: &str, help: &'static str) -> Histogram {
        let name = self.name(name);
        self.recorder.describe_histogram(KeyName::from(name.clone()), None, help.into());
        let inner = self.recorder.register_histogram(&key(&name, &[]), &META);
        Histogram::from_arc(Arc::new(Drained { inner, upkeep: self.upkeep.clone() }))
    }

    /// `tokens` prompt tokens arrived from another node (a remote prefill's tail, a pulled prefix).
    pub fn imported(&self, tokens: u64) {
        self.imported_tokens.fetch_add(tokens, Ordering::Relaxed);
    }

    /// Renders the series registered so far, without refreshing the engine's (tests).
    pub fn render_own(&self) -> String {
        self.recorder.handle().render()
    }

    /// Refreshes the series derived from the engine and KV transport, then renders
    /// everything in the Prometheus text format.
    pub fn render(&self, engine: &Engine, kv: Option<&KvNode>) -> String {
        self.series.render(&self.recorder, engine, kv, self.imported_tokens.load(Ordering::Relaxed))
    }
}

/// One role's names of the engine-derived series.
struct EngineSeries {
    /// Counter: prompt tokens by source (`cached_tier1`, `cached_tier2`, `imported`, `computed`).
    prompt_tokens: String,
    prompt_tokens_help: String,
    /// Counter: prefix-cache hit tokens by tier (`1`, `2`).
    prefix_hit_tokens: String,
    /// Counter: seconds the engine spent computing steps.
    busy_seconds: String,
    /// Counter: tokens computed by phase (`prefill`, `decode`).
    engine_tokens: String,
    preemptions: String,
    /// Counters: decode steps queued before the previous step's tokens were read, and
    /// their rows thrown away because the stream ended at the step before.
    run_ahead_steps: String,
    run_ahead_discarded_rows: String,
    /// Counter: prefix-cache hash collisions refused (tokens or scope differed).
    hash_collisions: String,
    /// Gauge: sequences waiting for admission. The autoscaler relies on this name.
    queue_depth: String,
    running: String,
    swapped: String,
    /// Gauge: KV blocks by state (`free`, `used`, `cached`) and tier (`1`, `2`).
    kv_blocks: String,
    /// Gauge: units of a grouped arena by state (`free`, `cached`, `held`); absent for a plain one.
    kv_units: String,
    /// Gauge: bytes of one unit of a grouped arena.
    kv_unit_bytes: String,
    /// Counter: KV memory of sliding-window layers given back to other blocks.
    kv_window_reclaimed: String,
    kv_block_bytes: String,
    staging_blocks_used: String,
    /// Gauge: prefill tokens the cost model fits beside the decode rows under the ITL target.
    prefill_budget: String,
    /// Counters: the step cost model's predictions and the measured times of the same steps.
    step_predicted: String,
    step_measured: String,
    /// Gauge: p95 of recent decode steps' times.
    step_p95: String,
    /// Gauge: the ITL target the planner works to.
    itl_target: String,
}

impl EngineSeries {
    fn new(spec: &MetricsSpec) -> Self {
        let name = |suffix: &str| format!("{}_{suffix}", spec.prefix);
        EngineSeries {
            prompt_tokens: name("prompt_tokens_total"),
            prompt_tokens_help: format!("Prompt tokens by source: prefix cache (tier), {}, computed here", spec.imported),
            prefix_hit_tokens: name("prefix_cache_hit_tokens_total"),
            busy_seconds: name("busy_seconds_total"),
            engine_tokens: name("engine_tokens_total"),
            preemptions: name("preemptions_total"),
            run_ahead_steps: name("run_ahead_steps_total"),
            run_ahead_discarded_rows: name("run_ahead_discarded_rows_total"),
            hash_collisions: name("prefix_hash_collisions_total"),
            queue_depth: name("queue_depth"),
            running: name("running_sequences"),
            swapped: name("swapped_sequences"),
            kv_blocks: name("kv_blocks"),
            kv_units: name("kv_units"),
            kv_unit_bytes: name("kv_unit_bytes"),
            kv_window_reclaimed: name("kv_window_reclaimed_bytes_total"),
            kv_block_bytes: name("kv_block_bytes"),
            staging_blocks_used: name("kv_staging_blocks_used"),
            prefill_budget: name("step_prefill_budget_tokens"),
            step_predicted: name("step_predicted_seconds_total"),
            step_measured: name("step_measured_seconds_total"),
            step_p95: name("decode_step_p95_seconds"),
            itl_target: name("itl_target_seconds"),
        }
    }

    /// Refreshes the engine- and transport-derived series in `r`, then renders
    /// everything `r` holds in the Prometheus text format. `imported` counts the
    /// prompt tokens this node received from another node instead of computing.
    fn render(&self, r: &PrometheusRecorder, engine: &Engine, kv: Option<&KvNode>, imported: u64) -> String {
        let st = engine.stats();
        let bt = engine.info.kv_layout.block_tokens.max(1) as u64;
        let cached = st.cached_prompt_tokens;
        let tier2 = st.cached_tier2_prompt_tokens.min(cached);
        let imported = imported.min(st.prompt_tokens - cached.min(st.prompt_tokens));
        let computed = st.prompt_tokens.saturating_sub(cached + imported);
        for (source, n) in [("cached_tier1", cached - tier2), ("cached_tier2", tier2), ("imported", imported), ("computed", computed)] {
            counter(r, &self.prompt_tokens, &self.prompt_tokens_help, &[("source", source)]).absolute(n);
        }
        let help = "Prompt tokens matched in the prefix cache, by tier";
        counter(r, &self.prefix_hit_tokens, help, &[("tier", "1")]).absolute(st.kv.primary_hits * bt);
        counter(r, &self.prefix_hit_tokens, help, &[("tier", "2")]).absolute(st.kv.tier2_hits * bt);
        let help = "Tokens the engine computed, by phase";
        counter(r, &self.engine_tokens, help, &[("phase", "prefill")]).absolute(st.prefill_tokens);
        counter(r, &self.engine_tokens, help, &[("phase", "decode")]).absolute(st.decode_tokens);
        counter(r, &self.preemptions, "Sequences preempted to make room", &[]).absolute(st.preemptions);
        let help = "Decode steps queued on the GPU before the previous step's tokens reached the host (run-ahead decoding)";
        counter(r, &self.run_ahead_steps, help, &[]).absolute(st.run_ahead_steps);
        let help = "Rows of run-ahead steps thrown away because their stream ended at the step before (a stop, a cancel)";
        counter(r, &self.run_ahead_discarded_rows, help, &[]).absolute(st.run_ahead_discarded_rows);
        let help = "Prefix-cache lookups that met another block under the same hash (refused: tokens or scope differed)";
        counter(r, &self.hash_collisions, help, &[]).absolute(st.kv.hash_collisions);
        gauge(r, &self.queue_depth, "Sequences waiting for admission", &[]).set(st.waiting as f64);
        gauge(r, &self.running, "Sequences running", &[]).set(st.running as f64);
        gauge(r, &self.swapped, "Sequences swapped out to the second tier", &[]).set(st.swapped as f64);
        let k = &st.kv;
        let tier2_free = k.tier2_capacity.saturating_sub(k.tier2_blocks + k.swapped);
        for (state, tier, n) in [
            ("free", "1", k.free),
            ("used", "1", k.used),
            ("cached", "1", k.cached),
            ("free", "2", tier2_free),
            ("used", "2", k.swapped),
            ("cached", "2", k.tier2_blocks),
        ] {
            gauge(r, &self.kv_blocks, "KV blocks by state and tier", &[("state", state), ("tier", tier)]).set(n as f64);
        }
        gauge(r, &self.kv_block_bytes, "Bytes of one KV block (all layers, K and V)", &[]).set(engine.info.kv_layout.block_bytes() as f64);
        if let Some(unit_bytes) = engine.info.kv_unit_bytes {
            let help = "Units of the grouped KV arena (a few layers of one block each) by state: free, held by cached blocks, held by running sequences";
            let held = k.units_total - k.units_free - k.units_cached;
            for (state, n) in [("free", k.units_free), ("cached", k.units_cached), ("held", held)] {
                gauge(r, &self.kv_units, help, &[("state", state)]).set(n as f64);
            }
            gauge(r, &self.kv_unit_bytes, "Bytes of one unit of the grouped KV arena; units x this = KV memory", &[]).set(unit_bytes as f64);
            let window_layers = engine.info.layer_windows.iter().filter(|w| w.is_some()).count();
            let bytes = k.local_reclaimed * (window_layers * engine.info.kv_layout.block_layer_bytes()) as u64;
            let help = "KV memory of sliding-window layers given back to other blocks (blocks behind every window of their sequence)";
            counter(r, &self.kv_window_reclaimed, help, &[]).absolute(bytes);
        }
        let help = "Prefill tokens the step cost model fits beside the running decode rows within the ITL target (the step budget when nothing decodes)";
        gauge(r, &self.prefill_budget, help, &[]).set(st.prefill_budget_tokens as f64);
        let help = "p95 of the measured times of the last 5 s of engine steps with decode rows (0: none)";
        gauge(r, &self.step_p95, help, &[]).set(st.step_p95_seconds);
        let target = engine.info.itl_target.map_or(0.0, |t| t.as_secs_f64());
        gauge(r, &self.itl_target, "The ITL target the step planner keeps decode steps within (0: none)", &[]).set(target);
        if let Some(kv) = kv {
            gauge(r, &self.staging_blocks_used, "Staging blocks held by in-flight KV imports", &[]).set(kv.staging_used() as f64);
        }
        let mut out = r.handle().render();
        float_counter(&mut out, &self.busy_seconds, "Seconds the engine spent computing steps", st.busy_seconds);
        let help = "Sum of the step cost model's predicted step times, made before each step ran";
        float_counter(&mut out, &self.step_predicted, help, st.predicted_step_seconds);
        float_counter(&mut out, &self.step_measured, "Sum of the measured times of the same steps", st.measured_step_seconds);
        if let Some(kv) = kv {
            let mut stats = kv.receiver.transport_stats();
            stats.push(kv.sender.stats().clone());
            baton_kv_transport::metrics::render_prometheus(&mut out, &stats, kv.receiver.stats());
            kv.render_info(&mut out);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use baton_telemetry::UPKEEP_EVERY;

    const SPEC: MetricsSpec = MetricsSpec::new("baton_test", "imported", &[("other_seconds", TTFT_BUCKETS)]);

    #[test]
    fn undrained_histogram_samples_are_bounded_and_none_is_lost() {
        // Every histogram the role registers counts towards the drain, and drains without
        // a scrape lose no sample.
        let node = NodeRecorder::new(&SPEC);
        let (ttft, other) = (node.histogram("time_to_first_token_seconds", "t"), node.histogram("other_seconds", "o"));
        let n = 3 * UPKEEP_EVERY + 7;
        for i in 0..n {
            if i % 2 == 0 { &ttft } else { &other }.record(0.02);
        }
        other.record_many(0.02, 5);
        assert_eq!(node.upkeep.samples(), n + 5);
        let text = node.render_own();
        let count = |series: &str| text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse::<u64>().ok());
        assert_eq!(count("baton_test_time_to_first_token_seconds_count"), Some(n.div_ceil(2)), "{text}");
        assert_eq!(count("baton_test_other_seconds_count"), Some(n / 2 + 5), "{text}");
    }
}
