//! Progress of a long command (train, pretrain, eval, capacity, build-default) for a person
//! at a terminal and for a log file alike.
//!
//! On a terminal it is indicatif's bar, redrawn in place. When stderr is not a terminal
//! (`nohup`, Slurm, `2> log`) a bar draws nothing, so a 12-minute run would be silent until
//! its end; there it writes one plain line instead,
//!
//! ```text
//! progress: train 120/1000 (12%) loss 3.214 | elapsed 1m02s, ETA 7m35s
//! ```
//!
//! at every tenth of the total and at least every [`DEFAULT_EVERY`] (a ticker thread
//! writes the line when a single step takes longer than that), so a log shows the run is
//! alive and how far it got. `DUALEDIT_PROGRESS_SECS` changes the interval.
use std::io::IsTerminal;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The longest a plain-line reporter stays silent.
pub const DEFAULT_EVERY: Duration = Duration::from_secs(30);

/// Where progress goes.
pub struct Progress {
    inner: Inner,
}

enum Inner {
    Hidden,
    Bar(indicatif::ProgressBar),
    Lines { state: Arc<(Mutex<LineState>, Condvar)>, ticker: Option<JoinHandle<()>> },
}

/// What a plain-line reporter knows between lines.
struct LineState {
    what: String,
    total: u64,
    pos: u64,
    message: String,
    start: Instant,
    last_line: Instant,
    /// The last tenth (0..=10) a line was written for.
    last_tenth: u64,
    finished: bool,
    every: Duration,
}

impl LineState {
    fn line(&self) -> String {
        let elapsed = self.start.elapsed();
        let pct = if self.total > 0 { 100 * self.pos.min(self.total) / self.total } else { 0 };
        let eta = if self.pos > 0 && self.total > self.pos {
            format_duration(elapsed.mul_f64((self.total - self.pos) as f64 / self.pos as f64))
        } else if self.pos >= self.total && self.total > 0 {
            "0s".into()
        } else {
            "unknown".into()
        };
        let msg = if self.message.is_empty() { String::new() } else { format!(" {}", self.message) };
        format!("progress: {} {}/{} ({pct}%){msg} | elapsed {}, ETA {eta}", self.what, self.pos, self.total, format_duration(elapsed))
    }

    fn tenth(&self) -> u64 {
        if self.total == 0 { 0 } else { (10 * self.pos.min(self.total)) / self.total }
    }

    fn emit(&mut self) {
        eprintln!("{}", self.line());
        self.last_line = Instant::now();
        self.last_tenth = self.tenth();
    }
}

/// `1h02m03s`, `4m05s`, `7s`.
pub fn format_duration(d: Duration) -> String {
    let s = d.as_secs();
    match (s / 3600, (s / 60) % 60, s % 60) {
        (0, 0, sec) => format!("{sec}s"),
        (0, m, sec) => format!("{m}m{sec:02}s"),
        (h, m, sec) => format!("{h}h{m:02}m{sec:02}s"),
    }
}

fn interval() -> Duration {
    std::env::var("DUALEDIT_PROGRESS_SECS")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .map(Duration::from_secs_f64)
        .unwrap_or(DEFAULT_EVERY)
}

impl Progress {
    /// Progress of `what` over `total` units (steps, records): a bar on a terminal, plain
    /// lines otherwise, nothing when `show` is false (a step of a larger command that
    /// reports itself, `--json` output).
    pub fn new(what: &str, total: usize, show: bool) -> Self {
        if !show {
            return Self { inner: Inner::Hidden };
        }
        if std::io::stderr().is_terminal() {
            let bar = indicatif::ProgressBar::new(total as u64);
            bar.set_style(
                indicatif::ProgressStyle::with_template("{prefix} {bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            bar.set_prefix(what.to_string());
            return Self { inner: Inner::Bar(bar) };
        }
        Self::lines(what, total, interval())
    }

    /// Plain lines whatever stderr is, at least every `every` (for tests and logs).
    pub fn lines(what: &str, total: usize, every: Duration) -> Self {
        let now = Instant::now();
        let state = Arc::new((
            Mutex::new(LineState {
                what: what.to_string(),
                total: total as u64,
                pos: 0,
                message: String::new(),
                start: now,
                last_line: now,
                last_tenth: 0,
                finished: false,
                every,
            }),
            Condvar::new(),
        ));
        let shared = state.clone();
        // The ticker writes a line when nothing else did for `every`; a failure to start it
        // only loses those lines (the tenths still come), so it is logged, not fatal.
        let ticker = std::thread::Builder::new()
            .name("dualedit-progress".into())
            .spawn(move || {
                let (lock, cv) = &*shared;
                let Ok(mut s) = lock.lock() else { return };
                loop {
                    if s.finished {
                        return;
                    }
                    let wait = s.every.saturating_sub(s.last_line.elapsed());
                    if wait.is_zero() {
                        s.emit();
                        continue;
                    }
                    s = match cv.wait_timeout(s, wait) {
                        Ok((g, _)) => g,
                        Err(_) => return,
                    };
                }
            })
            .map_err(|e| tracing::warn!(error = %e, "progress ticker not started"))
            .ok();
        Self { inner: Inner::Lines { state, ticker } }
    }

    fn with_state(&self, f: impl FnOnce(&mut LineState)) {
        if let Inner::Lines { state, .. } = &self.inner {
            if let Ok(mut s) = state.0.lock() {
                f(&mut s);
            }
        }
    }

    /// Units done so far; a plain line when a new tenth of the total is reached.
    pub fn set_position(&self, pos: u64) {
        match &self.inner {
            Inner::Bar(b) => b.set_position(pos),
            _ => self.with_state(|s| {
                s.pos = pos;
                if s.tenth() > s.last_tenth {
                    s.emit();
                }
            }),
        }
    }

    /// The total, where it is known only once the work started (records read).
    pub fn set_total(&self, total: usize) {
        match &self.inner {
            Inner::Bar(b) => b.set_length(total as u64),
            _ => self.with_state(|s| s.total = total as u64),
        }
    }

    /// The figure that says how it goes (`loss 3.214`), shown from the next line on.
    pub fn set_message(&self, msg: impl Into<String>) {
        let msg = msg.into();
        match &self.inner {
            Inner::Bar(b) => b.set_message(msg),
            _ => self.with_state(|s| s.message = msg),
        }
    }

    /// Ends the progress: the bar is cleared; plain lines end with the final one (unless
    /// the last line already said 100 %).
    pub fn finish_and_clear(&self) {
        match &self.inner {
            Inner::Hidden => {}
            Inner::Bar(b) => b.finish_and_clear(),
            Inner::Lines { state, .. } => {
                if let Ok(mut s) = state.0.lock() {
                    if !s.finished {
                        s.finished = true;
                        if s.last_tenth < 10 || s.pos < s.total {
                            s.emit();
                        }
                    }
                }
                state.1.notify_all();
            }
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        // An early return (an error) stops the ticker without a final line.
        if let Inner::Lines { state, ticker } = &mut self.inner {
            if let Ok(mut s) = state.0.lock() {
                s.finished = true;
            }
            state.1.notify_all();
            if let Some(t) = ticker.take() {
                let _ = t.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_people_write_them() {
        assert_eq!(format_duration(Duration::from_secs(7)), "7s");
        assert_eq!(format_duration(Duration::from_secs(245)), "4m05s");
        assert_eq!(format_duration(Duration::from_secs(3723)), "1h02m03s");
    }

    #[test]
    fn a_line_at_every_tenth_and_the_ticker_stops() {
        let p = Progress::lines("test", 20, Duration::from_secs(3600));
        for i in 1..=20 {
            p.set_message(format!("loss {i}"));
            p.set_position(i as u64);
        }
        let line = p.with_state_line();
        assert!(line.contains("test 20/20 (100%) loss 20"), "{line}");
        assert!(line.contains("ETA 0s"), "{line}");
        p.finish_and_clear();
    }

    impl Progress {
        fn with_state_line(&self) -> String {
            let mut out = String::new();
            self.with_state(|s| {
                assert_eq!(s.last_tenth, 10);
                out = s.line();
            });
            out
        }
    }
}
