//! A bar chart of the batch latency percentiles per strategy, and below it,
//! when the run has a breakdown, where each strategy's worker time per event
//! goes, as SVG text (no plotting dependency: a few rectangles and labels).

use std::fmt::Write as _;

use super::breakdown::BackendTimes;
use super::report::Report;

const WIDTH: f64 = 760.0;
const HEIGHT: f64 = 420.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 56.0;
const BOTTOM: f64 = 60.0;
const SERIES: [(&str, &str); 3] = [("p50", "#4c78a8"), ("p95", "#f58518"), ("p99", "#e45756")];

/// The states of the breakdown's stacked bars, left to right.
const STATES: [(&str, &str); 5] = [
    ("running", "#4c78a8"),
    ("lock wait", "#e45756"),
    ("other wait", "#f58518"),
    ("idle in transaction", "#9d9d9d"),
    ("idle between transactions", "#d6d6d6"),
];
/// Height of one strategy's bar in the breakdown, spacing included.
const ROW: f64 = 30.0;

fn states(b: &BackendTimes) -> [f64; 5] {
    [
        b.running_us,
        b.lock_wait_us,
        b.other_wait_us,
        b.idle_in_transaction_us,
        b.idle_us,
    ]
}

/// The latency percentiles (p50, p95, p99) of every strategy of `report`, as
/// grouped bars on a logarithmic millisecond axis; below them, for the
/// strategies with a breakdown, their worker time per event as stacked
/// horizontal bars by backend state, each labelled with its total and the
/// client's CPU per event.
pub fn latency_svg(report: &Report) -> String {
    let rows: Vec<(&str, [f64; 5], Option<f64>)> = report
        .outcomes
        .iter()
        .filter_map(|o| {
            let b = o.breakdown.as_ref()?;
            Some((o.strategy.name(), states(&b.backends?), b.client_cpu_us))
        })
        .collect();
    let panel_h = if rows.is_empty() {
        0.0
    } else {
        70.0 + ROW * rows.len() as f64 + 40.0
    };
    let total_h = HEIGHT + panel_h;
    let values: Vec<(&str, [f64; 3])> = report
        .outcomes
        .iter()
        .map(|o| (o.strategy.name(), [o.p50_ms, o.p95_ms, o.p99_ms]))
        .collect();
    let all = values.iter().flat_map(|(_, v)| v.iter().copied());
    let max = all.clone().fold(0.0_f64, f64::max).max(1.0);
    let min = all.fold(f64::INFINITY, f64::min).clamp(0.01, max);
    let lo = 10f64.powf(min.log10().floor());
    let hi = 10f64.powf(max.log10().ceil());
    let plot_h = HEIGHT - TOP - BOTTOM;
    let y = |ms: f64| {
        TOP + plot_h * (1.0 - (ms.max(lo).log10() - lo.log10()) / (hi.log10() - lo.log10()))
    };

    let mut s = String::new();
    let _ = writeln!(
        s,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{total_h}" viewBox="0 0 {WIDTH} {total_h}" font-family="Helvetica, Arial, sans-serif" font-size="12">"##
    );
    let _ = writeln!(s, r##"<rect width="100%" height="100%" fill="white"/>"##);
    let _ = writeln!(
        s,
        r##"<text x="{}" y="22" text-anchor="middle" font-size="15" font-weight="bold">Batch latency per strategy (ms, log scale)</text>"##,
        WIDTH / 2.0
    );
    let _ = writeln!(
        s,
        r##"<text x="{}" y="40" text-anchor="middle" fill="#555">{} workers × batches of {}, {:.0}% duplicates arriving together, PostgreSQL {}, {} cores</text>"##,
        WIDTH / 2.0,
        report.workers,
        report.batch,
        report.duplicate_rate * 100.0,
        escape(&report.server_version),
        report.cores
    );
    // Grid: 1, 2, 5 × each decade.
    let mut decade = lo;
    while decade <= hi * 1.0001 {
        for m in [1.0, 2.0, 5.0] {
            let v = decade * m;
            if v > hi * 1.0001 {
                break;
            }
            let yy = y(v);
            let (stroke, dash) = if m == 1.0 {
                ("#bbb", "")
            } else {
                ("#e3e3e3", r##" stroke-dasharray="3,3""##)
            };
            let _ = writeln!(
                s,
                r##"<line x1="{LEFT}" x2="{}" y1="{yy:.1}" y2="{yy:.1}" stroke="{stroke}"{dash}/>"##,
                WIDTH - RIGHT
            );
            let _ = writeln!(
                s,
                r##"<text x="{}" y="{:.1}" text-anchor="end" fill="#333">{}</text>"##,
                LEFT - 6.0,
                yy + 4.0,
                fmt_ms(v)
            );
        }
        decade *= 10.0;
    }
    let _ = writeln!(
        s,
        r##"<text transform="translate(18,{:.1}) rotate(-90)" text-anchor="middle" fill="#333">milliseconds</text>"##,
        TOP + plot_h / 2.0
    );
    // Bars.
    let plot_w = WIDTH - LEFT - RIGHT;
    let group_w = plot_w / values.len().max(1) as f64;
    let bar_w = (group_w * 0.7 / 3.0).min(60.0);
    for (g, (name, v)) in values.iter().enumerate() {
        let center = LEFT + group_w * (g as f64 + 0.5);
        for (i, ((_, color), ms)) in SERIES.iter().zip(v).enumerate() {
            let x = center + (i as f64 - 1.5) * bar_w;
            let top = y(*ms);
            let _ = writeln!(
                s,
                r##"<rect x="{x:.1}" y="{top:.1}" width="{:.1}" height="{:.1}" fill="{color}"/>"##,
                bar_w - 2.0,
                (HEIGHT - BOTTOM - top).max(0.0)
            );
            let _ = writeln!(
                s,
                r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="11">{}</text>"##,
                x + bar_w / 2.0 - 1.0,
                top - 4.0,
                fmt_ms(*ms)
            );
        }
        let _ = writeln!(
            s,
            r##"<text x="{center:.1}" y="{:.1}" text-anchor="middle" font-size="13">{}</text>"##,
            HEIGHT - BOTTOM + 20.0,
            escape(name)
        );
    }
    let _ = writeln!(
        s,
        r##"<line x1="{LEFT}" x2="{}" y1="{:.1}" y2="{:.1}" stroke="#333"/>"##,
        WIDTH - RIGHT,
        HEIGHT - BOTTOM,
        HEIGHT - BOTTOM
    );
    // Legend.
    for (i, (label, color)) in SERIES.iter().enumerate() {
        let x = WIDTH / 2.0 - 110.0 + i as f64 * 80.0;
        let yy = HEIGHT - 18.0;
        let _ = writeln!(
            s,
            r##"<rect x="{x:.1}" y="{:.1}" width="12" height="12" fill="{color}"/><text x="{:.1}" y="{yy:.1}">{label}</text>"##,
            yy - 10.0,
            x + 16.0
        );
    }
    if !rows.is_empty() {
        breakdown_panel(&mut s, &rows, report.workers);
    }
    s.push_str("</svg>\n");
    s
}

/// The breakdown's stacked bars, on a linear µs axis, below the latency
/// chart.
fn breakdown_panel(s: &mut String, rows: &[(&str, [f64; 5], Option<f64>)], workers: usize) {
    let top = HEIGHT + 10.0;
    let left = 120.0;
    let right = 150.0;
    let plot_w = WIDTH - left - right;
    let max = rows
        .iter()
        .map(|(_, v, _)| v.iter().sum::<f64>())
        .fold(0.0_f64, f64::max)
        .max(1.0);
    let _ = writeln!(
        s,
        r##"<text x="{}" y="{:.1}" text-anchor="middle" font-size="15" font-weight="bold">Where the time goes: worker time per event (µs), by backend state</text>"##,
        WIDTH / 2.0,
        top + 12.0
    );
    let _ = writeln!(
        s,
        r##"<text x="{}" y="{:.1}" text-anchor="middle" fill="#555">{workers} workers × wall time / events, split by pg_stat_activity samples; right: total, and this process's CPU per event</text>"##,
        WIDTH / 2.0,
        top + 30.0
    );
    let bars_top = top + 50.0;
    for (i, (name, values, cpu)) in rows.iter().enumerate() {
        let y = bars_top + ROW * i as f64;
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="end" font-size="13">{}</text>"##,
            left - 8.0,
            y + 15.0,
            escape(name)
        );
        let mut x = left;
        for ((_, color), us) in STATES.iter().zip(values) {
            let w = us / max * plot_w;
            if w > 0.0 {
                let _ = writeln!(
                    s,
                    r##"<rect x="{x:.1}" y="{y:.1}" width="{w:.1}" height="{:.1}" fill="{color}"/>"##,
                    ROW - 8.0
                );
            }
            x += w;
        }
        let total: f64 = values.iter().sum();
        let cpu = cpu.map_or_else(String::new, |c| format!(", CPU {}", fmt_ms(c)));
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" font-size="11">{}{cpu}</text>"##,
            x + 6.0,
            y + 15.0,
            fmt_ms(total)
        );
    }
    let legend_y = bars_top + ROW * rows.len() as f64 + 20.0;
    let mut x = 40.0;
    for (label, color) in STATES {
        let _ = writeln!(
            s,
            r##"<rect x="{x:.1}" y="{:.1}" width="12" height="12" fill="{color}"/><text x="{:.1}" y="{legend_y:.1}">{label}</text>"##,
            legend_y - 10.0,
            x + 16.0
        );
        x += 36.0 + 6.5 * label.len() as f64;
    }
}

fn fmt_ms(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ingest::reading::tests::{outcome, report};
    use crate::ingest::{BackendTimes, Breakdown, Strategy};

    /// The breakdown panel is drawn for the strategies that have one, and
    /// only then; the SVG grows to hold it.
    #[test]
    fn the_breakdown_panel_follows_the_report() {
        let plain = latency_svg(&report(vec![outcome(Strategy::Advisory, 1.0)]));
        assert!(!plain.contains("Where the time goes"), "{plain}");
        assert!(plain.contains(&format!(r#"height="{HEIGHT}""#)));
        let mut with = outcome(Strategy::HandAdvisory, 1.0);
        with.breakdown = Some(Breakdown {
            worker_us: 100.0,
            client_cpu_us: Some(7.5),
            backends: Some(BackendTimes {
                samples: 10,
                running_us: 50.0,
                lock_wait_us: 25.0,
                other_wait_us: 0.0,
                idle_in_transaction_us: 15.0,
                idle_us: 10.0,
            }),
            ..Breakdown::default()
        });
        let svg = latency_svg(&report(vec![outcome(Strategy::Advisory, 1.0), with]));
        assert!(svg.contains("Where the time goes"), "{svg}");
        assert!(svg.contains(">100, CPU 7.50<"), "{svg}");
        // The red of p99 and of lock waits: two p99 bars and a legend
        // swatch above, one lock-wait segment and a swatch below.
        assert_eq!(
            svg.matches(r##"fill="#e45756"/>"##).count(),
            2 + 1 + 1 + 1,
            "{svg}"
        );
        assert!(svg.contains(&format!(r#"height="{}""#, HEIGHT + 70.0 + ROW + 40.0)));
    }
}
