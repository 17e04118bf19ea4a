//! `models compare --report DIR`: one self-contained HTML page
//! (`crate::report`) with the recommendation, the figures, and two SVG
//! charts:
//! tail latency against quality with the Pareto front, and the latency
//! distribution of every candidate.

use super::{Candidate, Comparison, share_text};
use crate::report::{STYLE, escape, svg_chart};
use plotters::prelude::*;
use std::fmt::Write;

/// The page, as one string.
pub fn html(comparison: &Comparison) -> String {
    let c = comparison;
    let mut page = String::with_capacity(64 * 1024);
    let title = "edgeinfer models compare";
    let _ = write!(
        page,
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{title}</title>\n<style>{STYLE}</style></head>\n<body>\n<h1>Model comparison</h1>\n<p>{} rows of <code>{}</code> ({} labelled), {} pass(es); latency is the model's own work per request (preprocessing and the batch-1 plan).</p>\n",
        c.rows,
        escape(&c.data),
        c.labelled_rows,
        c.passes
    );
    page.push_str("<section id=\"recommendation\">\n<h2>Recommendation</h2>\n");
    let r = &c.recommendation;
    match &r.chosen {
        Some(chosen) => {
            let _ = writeln!(
                page,
                "<p class=\"chosen\"><strong>{}</strong>: {}</p>",
                escape(chosen),
                escape(&r.why)
            );
        }
        None => {
            let _ = writeln!(
                page,
                "<p class=\"none\"><strong>No recommendation</strong>: {}</p>",
                escape(&r.why)
            );
        }
    }
    page.push_str("<ul>\n");
    for (id, reason) in &r.rejected {
        let _ = writeln!(page, "<li>not {}: {}</li>", escape(id), escape(reason));
    }
    page.push_str("</ul>\n</section>\n");
    page.push_str(&figures(c));
    page.push_str("<section id=\"charts\">\n");
    let _ = writeln!(
        page,
        "<figure id=\"pareto\">{}<figcaption>p99 latency per request against {}; the Pareto front (blue) joins the candidates no other beats on both; a grey one is beaten by one on the front.</figcaption></figure>",
        pareto_svg(c),
        quality_name(c)
    );
    let _ = writeln!(
        page,
        "<figure id=\"distribution\">{}<figcaption>Latency per request, 1st to 99th percentile, per candidate.</figcaption></figure>",
        distribution_svg(c)
    );
    page.push_str("</section>\n</body></html>\n");
    page
}

fn figures(c: &Comparison) -> String {
    let top_k = c.candidates.first().map_or(0, |m| m.top_k);
    let threads = c.candidates.first().map_or(1, |m| m.threads);
    let mut t = format!(
        "<section id=\"figures\">\n<h2>Figures</h2>\n<h3>Quality</h3>\n<table>\n<tr><th>candidate</th><th>quant</th>\
         <th>kernels</th><th>accuracy</th><th>top-{top_k}</th><th>manifest</th><th>agreement</th></tr>\n"
    );
    for m in &c.candidates {
        let _ = writeln!(
            t,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(&m.id()),
            escape(&m.quantization),
            escape(&m.kernels),
            share_text(m.accuracy),
            share_text(m.top_k_accuracy),
            share_text(m.manifest_accuracy),
            share_text(m.agreement),
        );
    }
    let _ = write!(
        t,
        "</table>\n<h3>Cost</h3>\n<table>\n<tr><th>candidate</th><th>p50 &micro;s</th><th>p95 &micro;s</th>\
         <th>p99 &micro;s</th><th>&micro;s/row @ batch</th><th>rows/s, 1 thread</th><th>rows/s, {threads} threads</th>\
         <th>peak MiB</th><th>load ms</th><th>file KiB</th></tr>\n"
    );
    for m in &c.candidates {
        let _ = writeln!(
            t,
            "<tr><td>{}</td><td>{:.1}</td><td>{:.1}</td><td>{:.1}</td><td>{:.2} @ {}</td><td>{:.0}</td><td>{:.0}</td><td>{}</td><td>{:.1}</td><td>{:.1}</td></tr>",
            escape(&m.id()),
            m.latency.p50_us,
            m.latency.p95_us,
            m.latency.p99_us,
            m.per_row_us_at_best_batch,
            m.best_batch,
            m.rows_per_s_one_thread,
            m.rows_per_s_all_threads,
            m.peak_rss_bytes.map_or("-".into(), |b| format!("{:.1}", b as f64 / (1 << 20) as f64)),
            m.load_ms,
            m.file_bytes as f64 / 1024.0
        );
    }
    t.push_str("</table>\n</section>\n");
    t
}

/// Accuracy where the data has labels, else agreement with the reference.
fn quality(c: &Comparison, m: &Candidate) -> Option<f64> {
    if c.labelled_rows > 0 { m.accuracy } else { m.agreement }
}

fn quality_name(c: &Comparison) -> String {
    match (&c.reference, c.labelled_rows) {
        (_, n) if n > 0 => "accuracy".into(),
        (Some(reference), _) => format!("agreement with {reference}"),
        (None, _) => "quality".into(),
    }
}

/// The candidates no other one beats on both p99 latency and quality, in
/// order of latency: each is better than every faster one.
pub fn pareto_front(points: &[(f64, f64)]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..points.len()).collect();
    order.sort_by(|&a, &b| points[a].0.total_cmp(&points[b].0).then(points[b].1.total_cmp(&points[a].1)));
    let mut best = f64::NEG_INFINITY;
    order
        .into_iter()
        .filter(|&i| {
            let better = points[i].1 > best;
            best = best.max(points[i].1);
            better
        })
        .collect()
}

fn pareto_svg(c: &Comparison) -> String {
    let points: Vec<(f64, f64, String)> =
        c.candidates.iter().filter_map(|m| quality(c, m).map(|q| (m.latency.p99_us, q, m.id()))).collect();
    if points.is_empty() {
        return "<p>No candidate has a quality figure to chart.</p>".into();
    }
    let xy: Vec<(f64, f64)> = points.iter().map(|p| (p.0, p.1)).collect();
    let on_front = pareto_front(&xy);
    let front: Vec<(f64, f64)> = on_front.iter().map(|&i| xy[i]).collect();
    // A step line: a faster point's quality holds until the next one's latency.
    let mut steps = Vec::new();
    for (i, &(x, y)) in front.iter().enumerate() {
        if i > 0 {
            steps.push((x, front[i - 1].1));
        }
        steps.push((x, y));
    }
    let min_quality = match (c.constraints.min_accuracy, c.constraints.max_agreement_loss, c.labelled_rows) {
        (Some(a), _, n) if n > 0 => Some(a),
        (_, Some(loss), 0) => Some(1.0 - loss),
        _ => None,
    };
    let max_p99_us = c.constraints.max_p99_ms.map(|ms| ms * 1e3);
    let x_max = xy.iter().map(|p| p.0).chain(max_p99_us).fold(0.0, f64::max) * 1.2 + 1.0;
    let y_lo = xy.iter().map(|p| p.1).chain(min_quality).fold(1.0, f64::min) - 0.02;
    let y_hi = (xy.iter().map(|p| p.1).fold(0.0, f64::max) + 0.01).min(1.0).max(y_lo + 0.03);
    let chosen = c.recommendation.chosen.as_deref();
    let title = format!("p99 latency against {}", quality_name(c));
    svg_chart(&title, 0f64..x_max, y_lo.max(0.0)..y_hi, |chart| {
        chart
            .configure_mesh()
            .x_desc("p99 latency per request (µs)")
            .y_desc(quality_name(c))
            .y_label_formatter(&|y| format!("{y:.3}"))
            .draw()?;
        if let Some(q) = min_quality {
            chart
                .draw_series(LineSeries::new([(0.0, q), (x_max, q)], RED.mix(0.5)))?
                .label("quality constraint")
                .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], RED.mix(0.5)));
        }
        if let Some(x) = max_p99_us {
            chart
                .draw_series(LineSeries::new([(x, y_lo.max(0.0)), (x, y_hi)], MAGENTA.mix(0.5)))?
                .label("p99 constraint")
                .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], MAGENTA.mix(0.5)));
        }
        chart
            .draw_series(LineSeries::new(steps, BLUE.stroke_width(2)))?
            .label("Pareto front")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLUE.stroke_width(2)));
        // Names of points that nearly coincide go one under the other.
        let near = |a: &(f64, f64, String), b: &(f64, f64, String)| {
            (a.0 - b.0).abs() < x_max * 0.08 && (a.1 - b.1).abs() < (y_hi - y_lo) * 0.06
        };
        chart.draw_series(points.iter().enumerate().map(|(i, p)| {
            let below = points[..i].iter().filter(|q| near(p, q)).count() as i32;
            let colour = if on_front.contains(&i) { BLUE.filled() } else { RGBColor(140, 140, 140).filled() };
            EmptyElement::at((p.0, p.1))
                + Circle::new((0, 0), 5, colour)
                + Text::new(p.2.clone(), (10, -18 + 15 * below), ("sans-serif", 13))
        }))?;
        chart
            .draw_series(
                points
                    .iter()
                    .filter(|p| Some(p.2.as_str()) == chosen)
                    .map(|(x, y, _)| Circle::new((*x, *y), 10, GREEN.stroke_width(3))),
            )?
            .label("recommended")
            .legend(|(x, y)| Circle::new((x + 10, y), 6, GREEN.stroke_width(3)));
        Ok(())
    })
}

fn distribution_svg(c: &Comparison) -> String {
    // The 99th percentile bounds the axis: one slow outlier would squash the rest.
    let x_max =
        c.candidates.iter().filter_map(|m| m.latency.percentiles_us.get(98).copied()).fold(0.0, f64::max)
            * 1.1
            + 1.0;
    svg_chart("Latency distribution per request", 0f64..x_max, 0f64..100f64, |chart| {
        chart.configure_mesh().x_desc("latency per request (µs)").y_desc("percentile").draw()?;
        for (i, m) in c.candidates.iter().enumerate() {
            let colour = Palette99::pick(i).to_rgba();
            let line =
                m.latency.percentiles_us.iter().take(99).enumerate().map(|(p, &us)| (us, p as f64 + 1.0));
            chart
                .draw_series(LineSeries::new(line, colour.stroke_width(2)))?
                .label(m.id())
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], colour.stroke_width(2)));
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pareto_front_keeps_only_candidates_better_than_every_faster_one() {
        // (p99, quality): b is slower than a and no better; d beats c on both.
        let points = [(10.0, 0.95), (20.0, 0.95), (30.0, 0.97), (25.0, 0.98), (50.0, 0.99)];
        assert_eq!(pareto_front(&points), [0, 3, 4]);
        assert_eq!(pareto_front(&[]), Vec::<usize>::new());
        // A tie on latency: the better one is on the front, the other not.
        assert_eq!(pareto_front(&[(5.0, 0.9), (5.0, 0.95)]), [1]);
    }
}
