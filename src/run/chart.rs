//! Memory timeline charts: a run's per-device memory samples as a PNG picture.
//!
//! One line per device (roles sharing a device, such as main and sub on a single-device
//! run, share one line since they are one sample), allocated MiB over the seconds since
//! the run started, with the peak as a dashed line of the same colour and every phase
//! boundary marked by a vertical line and, where a font is available, the phase name.
//!
//! Text needs a TrueType font, read at run time (plotters' pure-Rust `ab_glyph` backend,
//! no fontconfig): `$DUALEDIT_CHART_FONT`, else a few well-known system paths, else the
//! first `.ttf` under `/usr/share/fonts`. Without one the chart is drawn without text.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::prelude::*;

use crate::device::memory::{PhaseSample, SAMPLED_PHASE};
use crate::{Error, Result};

/// Chart size in pixels.
pub const WIDTH: u32 = 1280;
pub const HEIGHT: u32 = 720;

const MIB: f64 = 1024.0 * 1024.0;
const FONT_FAMILY: &str = "sans-serif";
/// Size of the phase names along the boundary lines.
const LABEL_PX: i32 = 14;
/// Rows of phase names at the top of the plot, and the least gap between two names in a row.
const LANES: usize = 3;
const LABEL_GAP: i32 = 6;

/// Places a font is usually found; the first readable one wins.
const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
    "/Library/Fonts/Arial.ttf",
];

/// What a rendered chart contains.
#[derive(Debug, Clone, PartialEq)]
pub struct ChartInfo {
    pub path: PathBuf,
    /// One per device: its label and number of samples.
    pub series: Vec<(String, usize)>,
    pub phase_marks: usize,
    /// Whether text (title, axes, legend, phase names) was drawn.
    pub labelled: bool,
}

/// Registers a font with plotters once per process; false when none could be found.
fn font_available() -> bool {
    static FONT: OnceLock<bool> = OnceLock::new();
    *FONT.get_or_init(|| {
        let from_env = std::env::var_os("DUALEDIT_CHART_FONT").map(PathBuf::from);
        let candidates = from_env.into_iter().chain(FONT_CANDIDATES.iter().map(PathBuf::from)).chain(find_ttf(Path::new("/usr/share/fonts"), 4));
        for path in candidates {
            let Ok(bytes) = crate::io::read_regular_capped(&path, 256 << 20) else { continue };
            // plotters keeps fonts for the life of the process, so the bytes are leaked once.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if plotters::style::register_font(FONT_FAMILY, FontStyle::Normal, bytes).is_ok() {
                tracing::debug!(font = %path.display(), "chart font");
                return true;
            }
        }
        tracing::debug!("no TrueType font found; memory charts are drawn without text");
        false
    })
}

/// The first `.ttf` file under `dir`, at most `depth` levels down.
fn find_ttf(dir: &Path, depth: usize) -> Option<PathBuf> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir).ok()?.filter_map(|e| e.ok().map(|e| e.path())).collect();
    entries.sort();
    for p in &entries {
        if p.extension().is_some_and(|e| e.eq_ignore_ascii_case("ttf")) && p.is_file() {
            return Some(p.clone());
        }
    }
    if depth == 0 {
        return None;
    }
    entries.iter().filter(|p| p.is_dir()).find_map(|p| find_ttf(p, depth - 1))
}

/// One device's line: label and (seconds, current MiB, peak MiB) points.
struct Series {
    label: String,
    points: Vec<(f64, f64, f64)>,
}

/// Groups samples by device: roles on one device are sampled together, so they share a line.
fn series_of(samples: &[PhaseSample]) -> Vec<Series> {
    type Roles = Vec<String>;
    type Points = Vec<(f64, f64, f64)>;
    let mut by_device: BTreeMap<String, (Roles, Points)> = BTreeMap::new();
    let mut order: Vec<String> = Vec::new();
    for s in samples {
        let entry = by_device.entry(s.device.clone()).or_insert_with(|| {
            order.push(s.device.clone());
            (Vec::new(), Vec::new())
        });
        if !entry.0.contains(&s.role) {
            entry.0.push(s.role.clone());
        }
        let t = s.elapsed_ms / 1e3;
        let point = (t, s.sample.current_allocated_bytes as f64 / MIB, s.sample.peak_allocated_bytes as f64 / MIB);
        // Several roles on one device give the same sample at the same instant: keep one.
        if entry.1.last().map(|p| p.0) != Some(t) {
            entry.1.push(point);
        }
    }
    order
        .into_iter()
        .map(|dev| {
            let (roles, points) = by_device.remove(&dev).unwrap_or_default();
            let process = samples.iter().any(|s| s.device == dev && s.sample.process_wide);
            let what = if process { ", process RSS" } else { "" };
            Series { label: format!("{} ({dev}{what})", roles.join("+")), points }
        })
        .collect()
}

/// Distinct phase boundaries `(seconds, phase)` in time order (the sampler's steady
/// samples are no boundary).
fn phase_marks(samples: &[PhaseSample]) -> Vec<(f64, String)> {
    let mut marks: Vec<(f64, String)> = Vec::new();
    for s in samples.iter().filter(|s| s.phase != SAMPLED_PHASE) {
        let t = s.elapsed_ms / 1e3;
        if !marks.iter().any(|(mt, p)| *mt == t && *p == s.phase) {
            marks.push((t, s.phase.clone()));
        }
    }
    marks.sort_by(|a, b| a.0.total_cmp(&b.0));
    marks
}

const COLOURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

/// Draws `samples` (a tracker's timeline) to a PNG at `path`, written atomically.
pub fn render_timeline_png(samples: &[PhaseSample], path: &Path) -> Result<ChartInfo> {
    render(samples, path, font_available())
}

/// As [`render_timeline_png`], never drawing text (what happens when no font is found).
pub fn render_timeline_png_without_text(samples: &[PhaseSample], path: &Path) -> Result<ChartInfo> {
    render(samples, path, false)
}

fn render(samples: &[PhaseSample], path: &Path, text: bool) -> Result<ChartInfo> {
    if samples.is_empty() {
        return Err(Error::file(path, "no memory samples to draw"));
    }
    let series = series_of(samples);
    let marks = phase_marks(samples);
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("chart.png");
    // Same folder, so the rename is atomic; `.png` last so the encoder picks the format.
    let tmp = path.with_file_name(format!(".{name}.{}.tmp.png", std::process::id()));
    let result = draw(&series, &marks, &tmp, text).map_err(|e| Error::file(path, format!("cannot draw the memory chart: {e}")));
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io(path, e)
    })?;
    Ok(ChartInfo {
        path: path.to_path_buf(),
        series: series.iter().map(|s| (s.label.clone(), s.points.len())).collect(),
        phase_marks: marks.len(),
        labelled: text,
    })
}

/// The row for a label spanning pixels `[x, x + w]`: the first whose last label ends at
/// least [`LABEL_GAP`] before `x` (then that row ends at `x + w`), `None` when none has room.
fn place_label(lane_ends: &mut [i32], x: i32, w: i32) -> Option<usize> {
    let lane = lane_ends.iter().position(|&end| x > end.saturating_add(LABEL_GAP))?;
    lane_ends[lane] = x + w;
    Some(lane)
}

type DrawResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn draw(series: &[Series], marks: &[(f64, String)], path: &Path, text: bool) -> DrawResult<()> {
    let t_max = series.iter().flat_map(|s| s.points.iter().map(|p| p.0)).fold(0.0f64, f64::max);
    let y_max = series.iter().flat_map(|s| s.points.iter().map(|p| p.1.max(p.2))).fold(0.0f64, f64::max);
    let x_hi = if t_max > 0.0 { t_max * 1.03 } else { 1.0 };
    // Headroom above the highest line for the rows of phase names.
    let y_hi = if y_max > 0.0 { y_max * 1.2 } else { 1.0 };

    let root = BitMapBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut builder = ChartBuilder::on(&root);
    builder.margin(20);
    if text {
        builder.caption("memory per device over the run", (FONT_FAMILY, 26)).x_label_area_size(50).y_label_area_size(80);
    } else {
        builder.x_label_area_size(8).y_label_area_size(8);
    }
    let mut chart = builder.build_cartesian_2d(0.0..x_hi, 0.0..y_hi)?;
    let x_fmt = |v: &f64| if x_hi < 10.0 { format!("{v:.2}") } else { format!("{v:.0}") };
    let y_fmt = |v: &f64| format!("{v:.0}");
    {
        let mut mesh = chart.configure_mesh();
        mesh.light_line_style(RGBColor(244, 244, 244)).bold_line_style(RGBColor(215, 215, 215)).max_light_lines(2);
        if text {
            mesh.x_desc("seconds since start")
                .y_desc("allocated (MiB)")
                .label_style((FONT_FAMILY, 15))
                .axis_desc_style((FONT_FAMILY, 17))
                .y_label_formatter(&y_fmt)
                .x_label_formatter(&x_fmt);
        } else {
            mesh.x_labels(0).y_labels(0);
        }
        mesh.draw()?;
    }

    // Phase boundaries: a grey vertical line each, and its phase name written across,
    // just right of the line, in the first of `LANES` rows at the top where it clears the
    // names already there; a name that fits no row is left out rather than overprinted.
    let grey = RGBColor(150, 150, 150);
    let top = chart.backend_coord(&(0.0, y_hi)).1;
    let font = TextStyle::from((FONT_FAMILY, LABEL_PX).into_font()).color(&RGBColor(80, 80, 80));
    let mut lane_ends: [i32; LANES] = [i32::MIN; LANES];
    for (t, _) in marks {
        chart.draw_series(DashedLineSeries::new([(*t, 0.0), (*t, y_hi)], 4, 4, grey.stroke_width(1)))?;
    }
    for (t, phase) in marks {
        if text {
            let (px, _) = chart.backend_coord(&(*t, y_hi));
            let (w, h) = root.estimate_text_size(phase, &font)?;
            let (x, w, h) = (px + 3, w as i32, h as i32);
            if let Some(lane) = place_label(&mut lane_ends, x, w) {
                let y = top + 4 + lane as i32 * (LABEL_PX + 4);
                root.draw(&Rectangle::new([(x - 1, y - 1), (x + w + 1, y + h + 1)], WHITE.mix(0.85).filled()))?;
                root.draw(&Text::new(phase.clone(), (x, y), font.clone()))?;
            }
        }
    }

    for (i, s) in series.iter().enumerate() {
        let c = COLOURS[i % COLOURS.len()];
        // Dots only where the samples are few (phase marks); a sampled run is a line.
        let dot = if s.points.len() <= 60 { 4 } else { 0 };
        let current = chart.draw_series(LineSeries::new(s.points.iter().map(|p| (p.0, p.1)), c.stroke_width(3)).point_size(dot))?;
        if text {
            current.label(format!("{} allocated", s.label)).legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], c.stroke_width(3)));
        }
        let peak = chart.draw_series(DashedLineSeries::new(s.points.iter().map(|p| (p.0, p.2)), 8, 5, c.mix(0.6).stroke_width(2)))?;
        if text {
            peak.label(format!("{} peak", s.label)).legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], c.mix(0.6).stroke_width(2)));
        }
    }
    if text {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(180, 180, 180))
            .label_font((FONT_FAMILY, 15))
            .draw()?;
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_in_a_row_never_overlap() {
        let mut lanes = [i32::MIN; LANES];
        // Boundaries 10 px apart with 80 px names: three rows, then one is left out until
        // the first row has room again.
        let placed: Vec<Option<usize>> = (0..6).map(|i| place_label(&mut lanes, 100 + 10 * i, 80)).collect();
        assert_eq!(placed, [Some(0), Some(1), Some(2), None, None, None]);
        assert_eq!(place_label(&mut lanes, 100 + 80 + LABEL_GAP + 1, 80), Some(0));
        // Every placed pair in one row is apart.
        let mut lanes = [i32::MIN; LANES];
        let mut rows: Vec<Vec<(i32, i32)>> = vec![Vec::new(); LANES];
        for i in 0..200 {
            let (x, w) = (i * 7, 30 + (i * 13) % 70);
            if let Some(l) = place_label(&mut lanes, x, w) {
                rows[l].push((x, x + w));
            }
        }
        for row in rows {
            assert!(row.windows(2).all(|p| p[1].0 > p[0].1 + LABEL_GAP), "{row:?}");
        }
    }

    #[test]
    fn sampled_points_are_no_phase_boundaries() {
        let sample = crate::device::memory::MemorySample {
            current_allocated_bytes: 1,
            peak_allocated_bytes: 1,
            current_reserved_bytes: 1,
            peak_reserved_bytes: 1,
            process_wide: true,
        };
        let at = |phase: &str, ms: f64| PhaseSample { phase: phase.into(), role: "main".into(), device: "cpu".into(), elapsed_ms: ms, sample };
        let tl = [at("load", 0.0), at(SAMPLED_PHASE, 250.0), at(SAMPLED_PHASE, 500.0), at("eval", 600.0), at("end", 900.0)];
        assert_eq!(phase_marks(&tl).iter().map(|m| m.1.as_str()).collect::<Vec<_>>(), ["load", "eval", "end"]);
        assert_eq!(series_of(&tl)[0].points.len(), 5);
    }
}
