//! All terminal output: data to stdout, notes, warnings and errors to stderr. The only module
//! (with `main.rs`) allowed to print, so `--json` stdout stays clean.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::io::{IsTerminal, Write};

use anyhow::{Context, Result};
use serde::Serialize;

/// Writes to the terminal. Output reads correctly without colour; `NO_COLOR` is respected.
#[derive(Clone, Debug)]
pub struct Printer {
    /// Whether stderr may carry ANSI colour: a terminal and `NO_COLOR` unset.
    color: bool,
}

impl Printer {
    /// A printer configured from the environment (`NO_COLOR`, whether stderr is a terminal).
    pub fn from_env() -> Printer {
        let color = std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
            && std::io::stderr().is_terminal();
        Printer { color }
    }

    /// Writes data (a table, a plan) to stdout, ending with a newline.
    pub fn data(&self, text: &str) {
        let mut stdout = std::io::stdout().lock();
        // A closed pipe (`infer topo | head`) is not an error worth reporting.
        let _ = write!(stdout, "{text}");
        if !text.ends_with('\n') {
            let _ = writeln!(stdout);
        }
    }

    /// Writes a piece of streamed text to stdout as it comes (no newline added).
    pub fn stream(&self, text: &str) {
        let mut stdout = std::io::stdout().lock();
        let _ = write!(stdout, "{text}");
        let _ = stdout.flush();
    }

    /// Writes `value` as pretty JSON to stdout. Errors: `value` cannot be serialized.
    pub fn json<T: Serialize>(&self, value: &T) -> Result<()> {
        let text =
            serde_json::to_string_pretty(value).context("failed to serialize JSON output")?;
        self.data(&text);
        Ok(())
    }

    /// A progress or informational line on stderr.
    pub fn note(&self, text: &str) {
        eprintln!("{}: {}", self.paint("note", "36"), escape_controls(text));
    }

    /// A progress display of `total` steps on stderr: an indicatif bar when stderr is a
    /// terminal, plain `note:` lines otherwise (logs, CI, pipes).
    pub fn progress(&self, total: u64) -> Progress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = indicatif::ProgressBar::new(total);
            let style = indicatif::ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
            bar.set_style(style);
            bar.enable_steady_tick(std::time::Duration::from_millis(120));
            bar
        });
        Progress {
            bar,
            printer: self.clone(),
        }
    }

    /// A warning on stderr.
    pub fn warn(&self, text: &str) {
        eprintln!("{}: {}", self.paint("warning", "33"), escape_controls(text));
    }

    /// `line` as a warning when it starts with "warning: " (the runtime's convention for
    /// the lines it returns), else as a note.
    pub fn note_or_warn(&self, line: &str) {
        match line.strip_prefix("warning: ") {
            Some(warning) => self.warn(warning),
            None => self.note(line),
        }
    }

    /// An error and its causes on stderr, in the layout
    /// `error: …` / `  caused by: …`, with any `hint: …` lines at the end.
    pub fn error(&self, error: &anyhow::Error) {
        let mut hints = Vec::new();
        let mut lines = Vec::new();
        for (depth, cause) in error.chain().enumerate() {
            let text = escape_controls(&cause.to_string()).into_owned();
            let mut parts = text.split("\nhint: ");
            let message = parts.next().unwrap_or_default();
            hints.extend(parts.map(str::to_string));
            if depth == 0 {
                lines.push(format!("{}: {message}", self.paint("error", "31")));
            } else {
                lines.push(format!("  caused by: {message}"));
            }
        }
        for hint in hints {
            lines.push(String::new());
            lines.push(format!("{}: {hint}", self.paint("hint", "32")));
        }
        eprintln!("{}", lines.join("\n"));
    }

    fn paint(&self, word: &str, ansi: &str) -> String {
        if self.color {
            format!("\x1b[1;{ansi}m{word}\x1b[0m")
        } else {
            word.to_string()
        }
    }
}

/// See [`Printer::progress`].
pub struct Progress {
    bar: Option<indicatif::ProgressBar>,
    printer: Printer,
}

impl Progress {
    /// Moves to step `position` with `message` (a plain line when not on a terminal).
    pub fn update(&self, position: u64, message: &str) {
        match &self.bar {
            Some(bar) => {
                bar.set_position(position);
                bar.set_message(message.to_string());
            }
            None => self.printer.note(message),
        }
    }

    /// Whether this is a terminal bar (every step shows) rather than plain lines.
    pub fn is_bar(&self) -> bool {
        self.bar.is_some()
    }

    /// A `note:` line that does not disturb the bar.
    pub fn note(&self, text: &str) {
        match &self.bar {
            Some(bar) => bar.println(format!(
                "{}: {}",
                self.printer.paint("note", "36"),
                escape_controls(text)
            )),
            None => self.printer.note(text),
        }
    }

    /// Removes the bar (plain mode: nothing).
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}

/// `text` with every control character but newline and tab written as an escape
/// (`\u{1b}`): a rank's or an engine's output line, or an error quoting input, cannot move
/// the cursor, recolour the terminal or rewrite a line already printed.
pub fn escape_controls(text: &str) -> std::borrow::Cow<'_, str> {
    if !text
        .chars()
        .any(|c| c.is_control() && c != '\n' && c != '\t')
    {
        return std::borrow::Cow::Borrowed(text);
    }
    std::borrow::Cow::Owned(
        text.chars()
            .map(|c| match c {
                '\n' | '\t' => c.to_string(),
                c if c.is_control() => c.escape_unicode().to_string(),
                c => c.to_string(),
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn control_characters_are_escaped_but_lines_and_tabs_kept() {
        assert_eq!(
            super::escape_controls("a\u{1b}[2K\rnote: [rank 3] ok\n\tnext"),
            "a\\u{1b}[2K\\u{d}note: [rank 3] ok\n\tnext"
        );
        assert!(matches!(
            super::escape_controls("plain"),
            std::borrow::Cow::Borrowed("plain")
        ));
    }
}
