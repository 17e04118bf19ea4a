//! What the HTML reports share (`models compare --report`, `models
//! ab-report --report`): one self-contained page (no external assets, so
//! it opens from a USB stick on a site laptop), its style, text escaped for
//! it, and SVG charts drawn with plotters.

use plotters::prelude::*;

/// The page's style sheet, inline.
pub const STYLE: &str = "body{font-family:sans-serif;margin:2em;max-width:72em;color:#222}\
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #bbb;padding:.3em .6em;text-align:right}\
td:first-child,th:first-child{text-align:left}.chosen{background:#e6f4ea;padding:.5em}\
.none{background:#fdecea;padding:.5em}figure{margin:1.5em 0}figcaption{color:#555}";

/// A chart's size in pixels.
pub const WIDTH: u32 = 760;
pub const HEIGHT: u32 = 420;

/// One chart as SVG: the frame with `title` over the ranges `x` and `y`,
/// what `draw` puts in it, then the legend of its labelled series. A chart
/// that cannot be drawn is a sentence saying why.
pub fn svg_chart(
    title: &str,
    x: std::ops::Range<f64>,
    y: std::ops::Range<f64>,
    draw: impl FnOnce(&mut Chart<'_, '_>) -> Result<(), Box<dyn std::error::Error>>,
) -> String {
    let mut svg = String::new();
    let drawn = (|| -> Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(x, y)?;
        draw(&mut chart)?;
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    })();
    drawn
        .map(|()| svg)
        .unwrap_or_else(|e| format!("<p>The chart could not be drawn: {}</p>", escape(&e.to_string())))
}

pub type Chart<'a, 'b> = ChartContext<
    'a,
    SVGBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// Text as HTML, so a model or file name cannot break the page.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for ch in text.chars() {
        match ch {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            _ => out.push(ch),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_in_the_page_are_escaped() {
        assert_eq!(escape("<a href=\"x\">&'"), "&lt;a href=&quot;x&quot;&gt;&amp;&#39;");
    }
}
