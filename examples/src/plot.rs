//! The loss-curve picture: a small, dependency-free SVG (plotters' text layout needs system fonts,
//! which a fresh machine does not have; an SVG viewer lays out text itself).

use std::fmt::Write;

/// Renders `(step, loss)` points as an SVG line chart with axes, ticks and a title.
pub fn loss_svg(title: &str, points: &[(u64, f64)]) -> String {
    let (w, h) = (720.0, 420.0);
    let (left, right, top, bottom) = (70.0, 20.0, 40.0, 50.0);
    let pw = w - left - right;
    let ph = h - top - bottom;
    let finite: Vec<(u64, f64)> = points.iter().copied().filter(|(_, l)| l.is_finite()).collect();
    let x_max = finite.iter().map(|p| p.0).max().unwrap_or(1).max(1) as f64;
    let x_min = finite.iter().map(|p| p.0).min().unwrap_or(0) as f64;
    let y_max = finite.iter().map(|p| p.1).fold(f64::MIN, f64::max).max(1e-9);
    let y_min = finite.iter().map(|p| p.1).fold(f64::MAX, f64::min).min(y_max);
    let (y_lo, y_hi) = if y_max - y_min < 1e-9 { (y_min - 0.5, y_max + 0.5) } else { (y_min - 0.05 * (y_max - y_min), y_max + 0.05 * (y_max - y_min)) };
    let x_span = (x_max - x_min).max(1.0);
    let sx = |x: f64| left + (x - x_min) / x_span * pw;
    let sy = |y: f64| top + (1.0 - (y - y_lo) / (y_hi - y_lo)) * ph;
    let mut svg = String::new();
    let _ = write!(
        svg,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{}" y="24" text-anchor="middle" font-size="15">{}</text>
<line x1="{left}" y1="{}" x2="{}" y2="{}" stroke="black"/>
<line x1="{left}" y1="{top}" x2="{left}" y2="{}" stroke="black"/>
"##,
        w / 2.0,
        escape(title),
        top + ph,
        left + pw,
        top + ph,
        top + ph
    );
    for i in 0..=5 {
        let y = y_lo + (y_hi - y_lo) * f64::from(i) / 5.0;
        let py = sy(y);
        let _ = writeln!(svg, r##"<line x1="{}" y1="{py:.1}" x2="{}" y2="{py:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{y:.3}</text>"##, left, left + pw, left - 6.0, py + 4.0);
        let x = x_min + x_span * f64::from(i) / 5.0;
        let px = sx(x);
        let _ = writeln!(svg, r##"<text x="{px:.1}" y="{}" text-anchor="middle">{}</text>"##, top + ph + 18.0, x.round());
    }
    let _ = writeln!(svg, r##"<text x="{}" y="{}" text-anchor="middle">step</text>"##, left + pw / 2.0, h - 10.0);
    let _ = writeln!(svg, r##"<text x="16" y="{}" text-anchor="middle" transform="rotate(-90 16 {})">loss</text>"##, top + ph / 2.0, top + ph / 2.0);
    if !finite.is_empty() {
        let path: Vec<String> = finite.iter().map(|(x, y)| format!("{:.1},{:.1}", sx(*x as f64), sy(*y))).collect();
        let _ = writeln!(svg, r##"<polyline fill="none" stroke="#1f77b4" stroke-width="1.8" points="{}"/>"##, path.join(" "));
    }
    svg.push_str("</svg>\n");
    svg
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_a_line_and_escapes_the_title() {
        let svg = loss_svg("loss <ddp>", &[(0, 5.5), (1, 4.0), (2, f64::NAN), (3, 3.0)]);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("loss &lt;ddp&gt;"));
        assert_eq!(svg.matches("<polyline").count(), 1);
        assert_eq!(loss_svg("empty", &[]).matches("<polyline").count(), 0);
    }
}
