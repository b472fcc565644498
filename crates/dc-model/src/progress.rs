//! Progress bars for slow loading steps: drawn on a terminal, silent otherwise (so logs and
//! tests stay clean).

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

/// A bar of `len` steps with a message, hidden unless stderr is a terminal.
pub fn bar(len: u64, msg: &'static str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    if let Ok(style) = ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} ({elapsed})") {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_message(msg);
    pb
}
