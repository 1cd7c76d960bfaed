//! What `infer up` prints while it serves: the launcher's events and progress, through the
//! printer.

use crate::launch::Progress;
use crate::launch::events::UpEvent;
use crate::ui::{self, Printer};

/// Prints `infer up`'s events: a bar while the gang starts (on a terminal), plain lines
/// once serving.
pub(super) struct UpReporter<'a> {
    pub(super) printer: &'a Printer,
    /// The id `/v1/models` lists, named in the notes.
    pub(super) model_id: &'a str,
    /// The start-up bar, until the gang is ready.
    pub(super) bar: Option<ui::Progress>,
    /// Whether the gang is ready (rank output then goes out as plain lines).
    pub(super) serving: bool,
}

impl UpReporter<'_> {
    /// Prints one event.
    pub(super) fn report(&mut self, event: UpEvent) {
        let printer = self.printer;
        match event {
            UpEvent::Note(text) => printer.note_or_warn(&text),
            UpEvent::Listening(address) => printer.note(&format!(
                "loading `{}`; http://{address} answers 503 until it is ready",
                self.model_id
            )),
            UpEvent::Gang(event) if self.serving => report_progress_plain(printer, &event),
            UpEvent::Gang(event) => {
                if let Progress::Started { world_size, .. } = &event
                    && self.bar.is_none()
                {
                    self.bar = Some(printer.progress(2 * *world_size as u64 + 1));
                }
                match &self.bar {
                    Some(bar) => super::super::report_progress(bar, &event, true),
                    None => report_progress_plain(printer, &event),
                }
            }
            UpEvent::Ready {
                address,
                world_size,
                layout,
                ready_secs,
            } => {
                if let Some(bar) = self.bar.take() {
                    if bar.is_bar() {
                        bar.update(2 * world_size as u64 + 1, "ready");
                    }
                    bar.finish();
                }
                self.serving = true;
                let message = match world_size {
                    1 => format!(
                        "serving `{}` on http://{address} (ready in {ready_secs:.2} s); Ctrl-C stops",
                        self.model_id
                    ),
                    n => format!(
                        "serving `{}` on http://{address} with {n} ranks ({layout}), ready in {ready_secs:.2} s; Ctrl-C stops",
                        self.model_id
                    ),
                };
                printer.note(&message);
            }
        }
    }
}

/// After the bar is gone: rank output as plain `[rank N]` lines.
pub(super) fn report_progress_plain(printer: &Printer, event: &Progress) {
    match event {
        Progress::RankLine { label, line, .. } => {
            let line = line.strip_prefix("note: ").unwrap_or(line);
            printer.note(&format!("[{label}] {line}"));
        }
        Progress::Host { host, stage } => printer.note(&format!("[{host}] {stage}")),
        _ => {}
    }
}
