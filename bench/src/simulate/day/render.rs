//! The day run's report: a summary beside the targets, SLO attainment and GPUs per hour,
//! an ASCII chart of GPUs over the day, the planner's first decisions with their reasons,
//! and an SVG chart of the same.

use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::prelude::*;

use super::{DayReport, Fleet, FleetResult};

fn pct(x: f64) -> String {
    format!("{:.2}%", x * 100.0)
}

/// GPUs billed per bucket of `minutes`, from a fleet's timeline.
fn gpus_per_bucket(r: &FleetResult, gpus_per_node: f64, minutes: usize) -> Vec<f64> {
    r.timeline
        .chunks(minutes)
        .map(|c| {
            c.iter().map(|&(_, p, d)| (p + d) as f64).sum::<f64>() / c.len() as f64 * gpus_per_node
        })
        .collect()
}

/// The human-readable report.
pub fn render(r: &DayReport) -> String {
    let c = &r.config;
    let pc = &c.planner;
    let gpn = pc.cost.base.gpus_per_node as f64;
    let mut o = String::new();
    let mut line = |s: String| {
        o.push_str(&s);
        o.push('\n');
    };
    line(format!(
        "a day of traffic: peak {:.0} turns/s, mean {:.1} turns/s ({:.0}% of the nominal peak, {:.0}% of the noisy peak {:.0}); seed {}",
        c.peak_turns_per_s,
        r.traffic_mean_turns_per_s,
        r.traffic_mean_turns_per_s / c.peak_turns_per_s * 100.0,
        r.traffic_mean_turns_per_s / r.traffic_peak_turns_per_s * 100.0,
        r.traffic_peak_turns_per_s,
        c.seed
    ));
    line(format!(
        "SLO: TTFT <= {:.0} ms and ITL <= {:.0} ms per turn; model load {:.0} s; planner every {:.0} s, scale-down after {:.0} s, {} + {} spare nodes (prefill + decode)",
        pc.cost.slo.ttft_s * 1e3,
        pc.cost.slo.itl_s * 1e3,
        pc.load_time_s,
        pc.interval_s,
        pc.scale_down_delay_s,
        pc.prefill.spare,
        pc.decode.spare
    ));
    line(format!(
        "hardware truth the planner must measure: decode steps {:.2}x the roofline, prefill at {:.0}% of it; one decode node fails at {:.1} h",
        c.truth.decode_slowdown,
        c.truth.prefill_efficiency * 100.0,
        c.fail_at_s / 3_600.0
    ));
    line(String::new());
    line(format!(
        "  {:<9}{:>11}{:>9}{:>13}{:>12}{:>10}{:>10}",
        "fleet", "GPU-hours", "vs peak", "SLO attain", "worst hour", "warm hit", "lost"
    ));
    let peak = r.fleet(Fleet::Peak).gpu_hours;
    for f in &r.fleets {
        line(format!(
            "  {:<9}{:>11.0}{:>9}{:>13}{:>12}{:>10}{:>10.0}",
            f.fleet.label(),
            f.gpu_hours,
            format!("{:+.1}%", (f.gpu_hours / peak - 1.0) * 100.0),
            pct(f.attainment()),
            pct(f.worst_hour()),
            pct(f.warm_hit_rate()),
            f.lost_turns
        ));
    }
    let p = r.fleet(Fleet::Planner);
    let (save, over) = (r.savings_vs_peak(), r.over_oracle());
    line(format!(
        "  planner: SLO {} (target >= 99%: {}), {:.1}% fewer GPU-hours than peak (target >= 25%: {}), {:+.1}% vs oracle (target <= 15%: {})",
        pct(p.attainment()),
        if p.attainment() >= 0.99 { "met" } else { "MISSED" },
        save * 100.0,
        if save >= 0.25 { "met" } else { "MISSED" },
        over * 100.0,
        if over <= 0.15 { "met" } else { "MISSED" }
    ));
    line(String::new());
    line("per hour: arrival rate, then GPUs billed and SLO attainment per fleet".into());
    let mut head = format!("  {:>4}{:>9}", "hour", "turns/s");
    for f in &r.fleets {
        head.push_str(&format!("{:>17}", f.fleet.label()));
    }
    line(head);
    for h in 0..24 {
        let turns = r.fleets[0].hours[h].turns / 3_600.0;
        let mut row = format!("  {h:>4}{turns:>9.1}");
        for f in &r.fleets {
            let x = &f.hours[h];
            let att = if x.turns > 0.0 {
                x.good_turns / x.turns
            } else {
                1.0
            };
            row.push_str(&format!(
                "{:>5.0} GPU {:>7.2}%",
                x.gpu_seconds / 3_600.0,
                att * 100.0
            ));
        }
        line(row);
    }
    line(String::new());
    line("GPUs over the day (P peak, M mean, R reactive, O oracle, A planner; one column per 30 min)".into());
    let series: Vec<(char, Vec<f64>)> = [
        (Fleet::Peak, 'P'),
        (Fleet::Mean, 'M'),
        (Fleet::Reactive, 'R'),
        (Fleet::Oracle, 'O'),
        (Fleet::Planner, 'A'),
    ]
    .iter()
    .map(|&(f, ch)| (ch, gpus_per_bucket(r.fleet(f), gpn, 30)))
    .collect();
    let top = series
        .iter()
        .flat_map(|s| s.1.iter().copied())
        .fold(1.0, f64::max);
    let rows = 12;
    for row in (0..rows).rev() {
        let lo = top * row as f64 / rows as f64;
        let mut s = format!("  {:>5.0} |", lo + top / rows as f64 / 2.0);
        for col in 0..48 {
            let mut ch = ' ';
            for (c, v) in &series {
                if let Some(&g) = v.get(col) {
                    if g >= lo && g < lo + top / rows as f64 + 1e-9 {
                        ch = *c;
                    }
                }
            }
            s.push(ch);
        }
        line(s);
    }
    line(format!("        +{}", "-".repeat(48)));
    line("         0     3     6     9     12    15    18    21    24 h".into());
    line(String::new());
    line(format!(
        "planner decisions that changed a target: {} (the first 6 and the first after the node failure, with reasons)",
        p.changes.len()
    ));
    let fail_t = c.fail_at_s;
    let after_fail = p.changes.iter().position(|ch| ch.t_s >= fail_t);
    for (i, ch) in p.changes.iter().enumerate() {
        if i < 6 || Some(i) == after_fail {
            let hh = ch.t_s / 3_600.0;
            line(format!(
                "  {:02}:{:02}:{:02} prefill {} decode {}",
                hh as u32,
                (ch.t_s / 60.0) as u32 % 60,
                ch.t_s as u32 % 60,
                ch.prefill,
                ch.decode
            ));
            for w in ch.why.iter().take(3) {
                line(format!("      {w}"));
            }
        }
    }
    o
}

/// An SVG chart: GPUs billed per fleet and the arrival rate over the day (top), SLO
/// attainment per hour (bottom).
pub fn chart(path: &Path, r: &DayReport) -> Result<()> {
    let gpn = r.config.planner.cost.base.gpus_per_node as f64;
    let root = SVGBackend::new(path, (1100, 760)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let (top, bottom) = root.split_vertically(460);
    let max_gpus = r
        .fleets
        .iter()
        .flat_map(|f| gpus_per_bucket(f, gpn, 1))
        .fold(1.0, f64::max)
        * 1.1;
    let mut ch = ChartBuilder::on(&top)
        .caption(
            "GPUs billed over the day, and arrival rate (scaled to the peak fleet)",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..24.0, 0.0..max_gpus)
        .map_err(plot_err)?;
    ch.configure_mesh()
        .x_desc("hour of day")
        .y_desc("GPUs")
        .draw()
        .map_err(plot_err)?;
    let peak_gpus = gpus_per_bucket(r.fleet(Fleet::Peak), gpn, 1)
        .first()
        .copied()
        .unwrap_or(1.0);
    let colors = [
        RGBColor(120, 120, 120),
        RGBColor(214, 39, 40),
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
    ];
    for (i, f) in r.fleets.iter().enumerate() {
        let pts: Vec<(f64, f64)> = f
            .timeline
            .iter()
            .map(|&(h, p, d)| (h, (p + d) as f64 * gpn))
            .collect();
        let color = colors[i % colors.len()];
        ch.draw_series(LineSeries::new(pts, color.stroke_width(2)))
            .map_err(plot_err)?
            .label(format!(
                "{} ({:.0} GPU-h, SLO {:.2}%)",
                f.fleet.label(),
                f.gpu_hours,
                f.attainment() * 100.0
            ))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
            });
    }
    let turns: Vec<(f64, f64)> = (0..24)
        .map(|h| {
            (
                h as f64 + 0.5,
                r.fleets[0].hours[h].turns / 3_600.0 / r.config.peak_turns_per_s * peak_gpus,
            )
        })
        .collect();
    let grey = RGBColor(180, 140, 60);
    ch.draw_series(LineSeries::new(turns, grey.stroke_width(1)))
        .map_err(plot_err)?
        .label("arrival rate (hourly mean)")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], grey.stroke_width(1)));
    ch.configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()
        .map_err(plot_err)?;

    let mut ch = ChartBuilder::on(&bottom)
        .caption(
            "SLO attainment per hour (share of turns meeting TTFT and ITL)",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..24.0, 0.0..101.0)
        .map_err(plot_err)?;
    ch.configure_mesh()
        .x_desc("hour of day")
        .y_desc("%")
        .draw()
        .map_err(plot_err)?;
    for (i, f) in r.fleets.iter().enumerate() {
        let pts: Vec<(f64, f64)> = f
            .hours
            .iter()
            .enumerate()
            .map(|(h, x)| {
                (
                    h as f64 + 0.5,
                    if x.turns > 0.0 {
                        x.good_turns / x.turns * 100.0
                    } else {
                        100.0
                    },
                )
            })
            .collect();
        let color = colors[i % colors.len()];
        ch.draw_series(LineSeries::new(pts, color.stroke_width(2)))
            .map_err(plot_err)?;
    }
    root.present().map_err(plot_err)?;
    Ok(())
}

fn plot_err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("drawing the chart: {e}")
}
