//! How the CLI shows things: aligned tables for people, JSON lines for
//! scripts, and progress on stderr for walks that take a while.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::CliError;

/// Column alignment.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Align {
    Left,
    Right,
}

/// A table with aligned columns; printed all at once so widths fit.
pub struct Table {
    headers: Vec<(&'static str, Align)>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(headers: &[(&'static str, Align)]) -> Self {
        Table {
            headers: headers.to_vec(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        debug_assert_eq!(cells.len(), self.headers.len());
        self.rows.push(cells);
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    pub fn print(&self, out: &mut dyn Write) -> Result<(), CliError> {
        let mut widths: Vec<usize> = self
            .headers
            .iter()
            .map(|(h, _)| h.chars().count())
            .collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let line = |cells: &mut dyn Iterator<Item = &str>| -> String {
            let mut s = String::new();
            for (i, cell) in cells.enumerate() {
                let (w, align) = (widths[i], self.headers[i].1);
                let pad = w - cell.chars().count();
                if i > 0 {
                    s.push_str("  ");
                }
                let last = i + 1 == widths.len();
                match align {
                    Align::Right => {
                        s.extend(std::iter::repeat_n(' ', pad));
                        s.push_str(cell);
                    }
                    Align::Left => {
                        s.push_str(cell);
                        if !last {
                            s.extend(std::iter::repeat_n(' ', pad));
                        }
                    }
                }
            }
            s.truncate(s.trim_end().len());
            s
        };
        writeln!(out, "{}", line(&mut self.headers.iter().map(|(h, _)| *h)))?;
        for row in &self.rows {
            writeln!(out, "{}", line(&mut row.iter().map(String::as_str)))?;
        }
        Ok(())
    }
}

/// One JSON value on one line.
pub fn json_line(out: &mut dyn Write, value: &impl serde::Serialize) -> Result<(), CliError> {
    serde_json::to_writer(&mut *out, value)
        .map_err(|e| CliError::io(format!("writing JSON: {e}")))?;
    writeln!(out)?;
    Ok(())
}

/// `1234567` → `1,234,567`.
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Micros as a decimal amount: `1250` → `0.00125`.
pub fn micros(n: u64) -> String {
    let s = format!("{}.{:06}", n / 1_000_000, n % 1_000_000);
    let s = s.trim_end_matches('0');
    s.strip_suffix('.')
        .map(|w| w.to_string())
        .unwrap_or_else(|| s.to_string())
}

/// Bytes as `12.3 MiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// A counter on stderr for a walk: invisible for its first second (most
/// walks finish sooner) and whenever stderr is not a terminal.
pub struct Progress {
    bar: ProgressBar,
    started: Instant,
    shown: bool,
    enabled: bool,
}

const SHOW_AFTER: Duration = Duration::from_secs(1);

impl Progress {
    /// A counter of `what` (e.g. "entries exported").
    pub fn new(what: &str) -> Self {
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::hidden());
        let style = ProgressStyle::with_template("{spinner} {human_pos} {msg} ({elapsed})")
            .unwrap_or_else(|_| ProgressStyle::default_spinner());
        bar.set_style(style);
        bar.set_message(what.to_string());
        Progress {
            bar,
            started: Instant::now(),
            shown: false,
            enabled: std::io::stderr().is_terminal(),
        }
    }

    /// Counts `n` more; shows the bar once the walk has taken a second.
    pub fn inc(&mut self, n: u64) {
        self.bar.inc(n);
        if self.enabled && !self.shown && self.started.elapsed() >= SHOW_AFTER {
            self.shown = true;
            self.bar.set_draw_target(ProgressDrawTarget::stderr());
            self.bar.enable_steady_tick(Duration::from_millis(120));
        }
    }

    /// Removes the bar.
    pub fn finish(self) {
        self.bar.finish_and_clear();
    }
}

/// Runs one long call (verify, stats) with a spinner that appears only
/// when the call takes more than a second and stderr is a terminal.
pub fn with_spinner<T>(what: &str, f: impl FnOnce() -> T) -> T {
    if !std::io::stderr().is_terminal() {
        return f();
    }
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let what = what.to_string();
    let spinner = std::thread::spawn(move || {
        // Waiting for the call to end, up to a second, decides whether a
        // spinner is worth drawing at all.
        if done_rx.recv_timeout(SHOW_AFTER).is_ok() {
            return;
        }
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template("{spinner} {msg} ({elapsed})")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        bar.set_message(what);
        bar.enable_steady_tick(Duration::from_millis(120));
        let _ = done_rx.recv();
        bar.finish_and_clear();
    });
    let out = f();
    let _ = done_tx.send(());
    let _ = spinner.join();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_numbers() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(micros(0), "0");
        assert_eq!(micros(1_250), "0.00125");
        assert_eq!(micros(3_000_000), "3");
        assert_eq!(micros(3_500_000), "3.5");
        assert_eq!(bytes(10), "10 B");
        assert_eq!(bytes(1536), "1.5 KiB");
    }

    #[test]
    fn aligns_columns() {
        let mut t = Table::new(&[
            ("NAME", Align::Left),
            ("N", Align::Right),
            ("NOTE", Align::Left),
        ]);
        t.row(vec!["a".into(), "10".into(), "x".into()]);
        t.row(vec!["long".into(), "2".into(), "".into()]);
        let mut out = Vec::new();
        t.print(&mut out).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "NAME   N  NOTE\na     10  x\nlong   2\n"
        );
    }
}
