//! A bar chart of the batch latency percentiles per strategy, as SVG text
//! (no plotting dependency: a few rectangles and labels).

use std::fmt::Write as _;

use super::report::Report;

const WIDTH: f64 = 760.0;
const HEIGHT: f64 = 420.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 56.0;
const BOTTOM: f64 = 60.0;
const SERIES: [(&str, &str); 3] = [("p50", "#4c78a8"), ("p95", "#f58518"), ("p99", "#e45756")];

/// The latency percentiles (p50, p95, p99) of every strategy of `report`, as
/// grouped bars on a logarithmic millisecond axis.
pub fn latency_svg(report: &Report) -> String {
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
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="Helvetica, Arial, sans-serif" font-size="12">"##
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
    s.push_str("</svg>\n");
    s
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
