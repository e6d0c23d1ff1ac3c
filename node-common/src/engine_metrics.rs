//! Registering series in a node's own Prometheus recorder, and the series
//! both node roles derive from their engine and KV transport at scrape time
//! (prompt tokens by source, prefix hits by tier, engine work, queue, KV blocks
//! by state and tier, transfers). Each role names them under its own prefix.

use std::sync::atomic::{AtomicU64, Ordering};

use ::metrics::{Counter, Gauge, Histogram, Key, Label, Level, Metadata, Recorder};
use baton_engine::Engine;
use metrics_exporter_prometheus::PrometheusRecorder;

use crate::kv::KvNode;

const META: Metadata<'static> = Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

fn key(name: &'static str, labels: &[(&'static str, &'static str)]) -> Key {
    Key::from_parts(name, labels.iter().map(|(k, v)| Label::new(*k, *v)).collect::<Vec<_>>())
}

pub fn counter(r: &PrometheusRecorder, name: &'static str, help: &'static str, labels: &[(&'static str, &'static str)]) -> Counter {
    r.describe_counter(name.into(), None, help.into());
    r.register_counter(&key(name, labels), &META)
}

pub fn gauge(r: &PrometheusRecorder, name: &'static str, help: &'static str, labels: &[(&'static str, &'static str)]) -> Gauge {
    r.describe_gauge(name.into(), None, help.into());
    r.register_gauge(&key(name, labels), &META)
}

pub fn histogram(r: &PrometheusRecorder, name: &'static str, help: &'static str) -> Histogram {
    r.describe_histogram(name.into(), None, help.into());
    r.register_histogram(&key(name, &[]), &META)
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
    pub fn new(r: &PrometheusRecorder, name: &'static str, help: &'static str) -> Self {
        Count { handle: counter(r, name, help, &[]), value: AtomicU64::new(0) }
    }

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

/// One role's names of the engine-derived series.
pub struct EngineSeries {
    /// Counter: prompt tokens by source (`cached_tier1`, `cached_tier2`, `imported`, `computed`).
    pub prompt_tokens: &'static str,
    /// Its help text: what `imported` means for this role.
    pub prompt_tokens_help: &'static str,
    /// Counter: prefix-cache hit tokens by tier (`1`, `2`).
    pub prefix_hit_tokens: &'static str,
    /// Counter: seconds the engine spent computing steps.
    pub busy_seconds: &'static str,
    /// Counter: tokens computed by phase (`prefill`, `decode`).
    pub engine_tokens: &'static str,
    pub preemptions: &'static str,
    /// Counter: prefix-cache hash collisions refused (tokens or scope differed).
    pub hash_collisions: &'static str,
    pub queue_depth: &'static str,
    pub running: &'static str,
    pub swapped: &'static str,
    /// Gauge: KV blocks by state (`free`, `used`, `cached`) and tier (`1`, `2`).
    pub kv_blocks: &'static str,
    pub kv_block_bytes: &'static str,
    pub staging_blocks_used: &'static str,
}

impl EngineSeries {
    /// Refreshes the engine- and transport-derived series in `r`, then renders
    /// everything `r` holds in the Prometheus text format. `imported` counts the
    /// prompt tokens this node received from another node instead of computing.
    pub fn render(&self, r: &PrometheusRecorder, engine: &Engine, kv: Option<&KvNode>, imported: u64) -> String {
        let st = engine.stats();
        let bt = engine.info.kv_layout.block_tokens.max(1) as u64;
        let cached = st.cached_prompt_tokens;
        let tier2 = st.cached_tier2_prompt_tokens.min(cached);
        let imported = imported.min(st.prompt_tokens - cached.min(st.prompt_tokens));
        let computed = st.prompt_tokens.saturating_sub(cached + imported);
        for (source, n) in [("cached_tier1", cached - tier2), ("cached_tier2", tier2), ("imported", imported), ("computed", computed)] {
            counter(r, self.prompt_tokens, self.prompt_tokens_help, &[("source", source)]).absolute(n);
        }
        let help = "Prompt tokens matched in the prefix cache, by tier";
        counter(r, self.prefix_hit_tokens, help, &[("tier", "1")]).absolute(st.kv.primary_hits * bt);
        counter(r, self.prefix_hit_tokens, help, &[("tier", "2")]).absolute(st.kv.tier2_hits * bt);
        let help = "Tokens the engine computed, by phase";
        counter(r, self.engine_tokens, help, &[("phase", "prefill")]).absolute(st.prefill_tokens);
        counter(r, self.engine_tokens, help, &[("phase", "decode")]).absolute(st.decode_tokens);
        counter(r, self.preemptions, "Sequences preempted to make room", &[]).absolute(st.preemptions);
        let help = "Prefix-cache lookups that met another block under the same hash (refused: tokens or scope differed)";
        counter(r, self.hash_collisions, help, &[]).absolute(st.kv.hash_collisions);
        gauge(r, self.queue_depth, "Sequences waiting for admission", &[]).set(st.waiting as f64);
        gauge(r, self.running, "Sequences running", &[]).set(st.running as f64);
        gauge(r, self.swapped, "Sequences swapped out to the second tier", &[]).set(st.swapped as f64);
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
            gauge(r, self.kv_blocks, "KV blocks by state and tier", &[("state", state), ("tier", tier)]).set(n as f64);
        }
        gauge(r, self.kv_block_bytes, "Bytes of one KV block (all layers, K and V)", &[]).set(engine.info.kv_layout.block_bytes() as f64);
        if let Some(kv) = kv {
            gauge(r, self.staging_blocks_used, "Staging blocks held by in-flight KV imports", &[]).set(kv.staging_used() as f64);
        }
        let mut out = r.handle().render();
        float_counter(&mut out, self.busy_seconds, "Seconds the engine spent computing steps", st.busy_seconds);
        if let Some(kv) = kv {
            let mut stats = kv.receiver.transport_stats();
            stats.push(kv.sender.stats().clone());
            baton_kv_transport::metrics::render_prometheus(&mut out, &stats, kv.receiver.stats());
            kv.render_info(&mut out);
        }
        out
    }
}
