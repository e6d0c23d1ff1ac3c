//! An SVG chart of latency percentiles over offered load, one line per run and
//! percentile, so two servers measured with the same traffic sit on one picture.

use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::prelude::*;

use super::RunReport;

const COLORS: [RGBColor; 4] = [RGBColor(31, 119, 180), RGBColor(214, 39, 40), RGBColor(44, 160, 44), RGBColor(148, 103, 189)];

/// Draws TTFT (left) and ITL (right) p50/p95/p99 against open conversations.
pub fn draw(path: &Path, runs: &[RunReport]) -> Result<()> {
    let root = SVGBackend::new(path, (1200, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let (left, right) = root.split_horizontally(600);
    panel(&left, runs, "time to first token (ms)", |l| [l.ttft_ms.p50, l.ttft_ms.p95, l.ttft_ms.p99])?;
    panel(&right, runs, "inter-token latency (ms)", |l| [l.itl_ms.p50, l.itl_ms.p95, l.itl_ms.p99])?;
    root.present().map_err(plot_err)?;
    Ok(())
}

fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    runs: &[RunReport],
    title: &str,
    pick: impl Fn(&super::report::LevelReport) -> [f64; 3],
) -> Result<()> {
    let max_x = runs.iter().flat_map(|r| r.levels.iter().map(|l| l.conversations)).max().unwrap_or(1) as f64;
    let max_y = runs.iter().flat_map(|r| r.levels.iter().flat_map(&pick)).fold(1.0f64, f64::max) * 1.1;
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..max_x * 1.05, 0.0..max_y)
        .map_err(plot_err)?;
    chart.configure_mesh().x_desc("open conversations").y_desc("ms").draw().map_err(plot_err)?;
    for (i, run) in runs.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        for (q, name) in ["p50", "p95", "p99"].iter().enumerate() {
            let points: Vec<(f64, f64)> = run.levels.iter().map(|l| (l.conversations as f64, pick(l)[q])).collect();
            let style = ShapeStyle { color: color.mix(1.0 - 0.3 * q as f64), filled: q == 0, stroke_width: if q == 1 { 3 } else { 1 } };
            chart
                .draw_series(LineSeries::new(points.clone(), style))
                .map_err(plot_err)?
                .label(format!("{} {name}", run.label))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], style));
            chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, style))).map_err(plot_err)?;
        }
    }
    chart.configure_series_labels().border_style(BLACK).background_style(WHITE.mix(0.8)).draw().map_err(plot_err)?;
    Ok(())
}

fn plot_err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("drawing the chart: {e}")
}

/// One panel of [`draw_timeseries`]: a title, the y axis's unit, and named lines of
/// (seconds, value) points.
pub struct Panel {
    pub title: String,
    pub y_desc: String,
    pub lines: Vec<(String, Vec<(f64, f64)>)>,
}

/// Draws panels side by side (two per row), each with lines over time (seconds): the
/// soak's memory, descriptors, KV blocks and store size.
pub fn draw_timeseries(path: &Path, panels: &[Panel]) -> Result<()> {
    let rows = panels.len().div_ceil(2).max(1);
    let root = SVGBackend::new(path, (1200, 420 * rows as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let areas = root.split_evenly((rows, 2));
    for (panel, area) in panels.iter().zip(areas.iter()) {
        let max_x = panel.lines.iter().flat_map(|(_, p)| p.iter().map(|q| q.0)).fold(1.0f64, f64::max);
        let max_y = panel.lines.iter().flat_map(|(_, p)| p.iter().map(|q| q.1)).fold(1.0f64, f64::max) * 1.1;
        let mut chart = ChartBuilder::on(area)
            .caption(&panel.title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d(0.0..max_x * 1.02, 0.0..max_y)
            .map_err(plot_err)?;
        chart.configure_mesh().x_desc("seconds").y_desc(panel.y_desc.as_str()).draw().map_err(plot_err)?;
        for (i, (name, points)) in panel.lines.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
                .map_err(plot_err)?
                .label(name.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
        }
        chart.configure_series_labels().border_style(BLACK).background_style(WHITE.mix(0.8)).draw().map_err(plot_err)?;
    }
    root.present().map_err(plot_err)?;
    Ok(())
}
