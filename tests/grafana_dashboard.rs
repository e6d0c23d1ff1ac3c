//! The Grafana dashboard (`deploy/grafana/baton-dashboard.json`) cannot drift from the
//! metrics: it parses, every panel queries the Prometheus datasource variable, and every
//! `baton_*` series a panel's expression names is documented in `docs/metrics.md` (a
//! histogram's `_bucket`/`_sum`/`_count` by its base name).

use std::collections::BTreeSet;
use std::path::Path;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr", serde_json::Value::String(e)) => out.push(e.clone()),
                    _ => exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| exprs(v, out)),
        _ => {}
    }
}

/// The `baton_*` identifiers in a PromQL expression.
fn names(expr: &str) -> Vec<String> {
    let mut found = Vec::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while let Some(at) = expr[i..].find("baton_") {
        let start = i + at;
        let word = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b':';
        if start > 0 && word(bytes[start - 1]) {
            i = start + 1;
            continue;
        }
        let end = expr[start..].find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).map_or(expr.len(), |n| start + n);
        found.push(expr[start..end].to_string());
        i = end;
    }
    found
}

/// Every name in the first column of the table in docs/metrics.md.
fn documented() -> BTreeSet<String> {
    let doc = std::fs::read_to_string(root().join("docs/metrics.md")).expect("docs/metrics.md");
    doc.lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .filter(|n| n.starts_with("baton_"))
        .map(str::to_string)
        .collect()
}

#[test]
fn the_dashboard_uses_only_documented_series() {
    let text = std::fs::read_to_string(root().join("deploy/grafana/baton-dashboard.json")).expect("the dashboard");
    let dash: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    assert!(dash["schemaVersion"].as_u64().is_some_and(|v| v >= 36), "schemaVersion");
    assert!(dash["templating"]["list"].as_array().unwrap().iter().any(|v| v["name"] == "DS_PROMETHEUS" && v["type"] == "datasource"));

    let docs = documented();
    assert!(docs.len() > 40, "the metrics table looks empty: {docs:?}");
    let mut all = Vec::new();
    exprs(&dash, &mut all);
    assert!(all.len() >= 20, "too few queries: {all:?}");
    let mut used = BTreeSet::new();
    for e in &all {
        for n in names(e) {
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| n.strip_suffix(s).filter(|b| docs.contains(*b)))
                .unwrap_or(&n)
                .to_string();
            assert!(docs.contains(&base), "the dashboard queries {n} (in `{e}`), which docs/metrics.md does not list");
            used.insert(base);
        }
    }
    // The capacity picture is there.
    for must in [
        "baton_gateway_tokens_total",
        "baton_decode_prompt_tokens_total",
        "baton_prefill_busy_seconds_total",
        "baton_decode_busy_seconds_total",
        "baton_gateway_time_to_first_token_seconds",
        "baton_gateway_turns_slo_total",
        "baton_decode_inter_token_latency_seconds",
        "baton_decode_kv_blocks",
        "baton_prefill_queue_depth",
        "baton_decode_queue_depth",
        "baton_coordinator_routing_decisions_total",
        "baton_kv_transport_bytes_total",
        "baton_kv_transport_failures_total",
        "baton_planner_target_nodes",
        "baton_planner_ready_nodes",
        "baton_planner_reasons_total",
    ] {
        assert!(used.contains(must), "no panel shows {must}");
    }
    for p in dash["panels"].as_array().unwrap().iter().filter(|p| p["type"] != "row") {
        assert_eq!(p["datasource"]["uid"], "${DS_PROMETHEUS}", "panel {} has another datasource", p["title"]);
    }
    let thresholds: Vec<f64> = dash["panels"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["fieldConfig"]["defaults"]["thresholds"]["steps"].as_array())
        .filter_map(|s| s.last()?["value"].as_f64())
        .collect();
    assert!(thresholds.contains(&1.0) && thresholds.contains(&0.05), "TTFT/ITL target lines: {thresholds:?}");
}

#[test]
fn names_are_found_in_promql() {
    assert_eq!(
        names(r#"sum(rate(baton_a_total{x="baton_not"}[5m])) / on(i) group_left baton_b_bytes"#),
        vec!["baton_a_total", "baton_not", "baton_b_bytes"]
    );
}
