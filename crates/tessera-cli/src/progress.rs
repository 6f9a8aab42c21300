//! Progress bars for long operations (rebuild, scrub, resync, bench), drawn on stderr and
//! only when stderr is a terminal: a CI log or a pipe gets the final line alone, never a
//! stream of carriage returns.

use std::io::IsTerminal as _;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

/// A bar on the terminal, or nothing at all.
pub struct Bar(Option<ProgressBar>);

impl Bar {
    /// A bar of `len` steps counted in `unit` (e.g. "units", "s"), labelled `what`.
    pub fn new(what: &str, len: u64, unit: &str) -> Bar {
        if !std::io::stderr().is_terminal() {
            return Bar(None);
        }
        let template = format!("{{prefix}} [{{bar:30}}] {{pos}}/{{len}} {unit} {{msg}}");
        let style = ProgressStyle::with_template(&template)
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("#>.");
        let bar = ProgressBar::new(len).with_style(style);
        bar.set_prefix(what.to_string());
        bar.enable_steady_tick(Duration::from_millis(250));
        Bar(Some(bar))
    }

    /// Move to `pos` of `len` with `msg` after the counts.
    pub fn set(&self, pos: u64, len: u64, msg: String) {
        if let Some(b) = &self.0 {
            b.set_length(len);
            b.set_position(pos);
            b.set_message(msg);
        }
    }

    /// Remove the bar; what follows is printed on a clean line.
    pub fn finish(&self) {
        if let Some(b) = &self.0 {
            b.finish_and_clear();
        }
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        self.finish();
    }
}
