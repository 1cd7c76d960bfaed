//! Forward progress of an engine `infer up --engine E` launched, read from its own
//! Prometheus `/metrics` (pure: the launcher scrapes, this judges): requests running and a
//! counter that grows with every step. Requests running and no step for `--stall-timeout`
//! is a stall, as is a `/metrics` that answers nothing for that long (llama.cpp answers it
//! from the loop that a wedged RPC call holds; an idle engine answers at once).

use super::EngineKind;

/// The series of `kind`'s `/metrics` that show progress: (requests running, a gauge;
/// steps, a counter). Names from each engine's metrics documentation: vLLM's
/// `vllm:num_requests_running` and `vllm:generation_tokens_total`, SGLang's
/// `sglang:num_running_reqs` and `sglang:generation_tokens_total`, llama.cpp's
/// `llamacpp:requests_processing` and `llamacpp:n_decode_total` (with `--metrics`; its
/// `llamacpp:tokens_predicted_total` counts a request's tokens only once it ends, so a long
/// generation would look stalled: `llama_decode` calls grow with every batch).
pub(crate) fn progress_series(kind: EngineKind) -> (&'static str, &'static str) {
    match kind {
        EngineKind::Vllm => ("vllm:num_requests_running", "vllm:generation_tokens_total"),
        EngineKind::Sglang => ("sglang:num_running_reqs", "sglang:generation_tokens_total"),
        EngineKind::Llamacpp => ("llamacpp:requests_processing", "llamacpp:n_decode_total"),
        EngineKind::Infer => ("infer_requests_running", "infer_generation_tokens_total"),
    }
}

/// The sum of every sample of series `name` in Prometheus text (over its label sets), or
/// `None` when it has none.
pub(crate) fn sum_series(text: &str, name: &str) -> Option<f64> {
    let mut found = false;
    let mut sum = 0.0;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        // `name 3` or `name{labels} 3`, not `name_other 3`.
        let value = match rest.chars().next() {
            Some(' ') => rest.split_whitespace().next(),
            Some('{') => rest
                .rsplit_once('}')
                .and_then(|(_, v)| v.split_whitespace().next()),
            _ => None,
        };
        if let Some(value) = value.and_then(|v| v.parse::<f64>().ok()) {
            found = true;
            sum += value;
        }
    }
    found.then_some(sum)
}

/// A change [`ProgressWatch::observe`] reports.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Change {
    /// No token came for `quiet_secs` while `running` requests ran (as last seen), or
    /// `/metrics` answered nothing for that long (`answered` false).
    Stalled {
        running: f64,
        quiet_secs: f64,
        answered: bool,
    },
    /// Tokens come again (or nothing runs any more).
    Resumed,
}

/// An engine's progress between scrapes, in seconds of the launcher's clock.
#[derive(Clone, Debug)]
pub(crate) struct ProgressWatch {
    tokens: Option<f64>,
    running: f64,
    /// When it last progressed (a new token, or nothing running).
    progress_at_secs: f64,
    stalled: bool,
}

impl ProgressWatch {
    /// A watch starting at `now_secs`.
    pub(crate) fn new(now_secs: f64) -> ProgressWatch {
        ProgressWatch {
            tokens: None,
            running: 0.0,
            progress_at_secs: now_secs,
            stalled: false,
        }
    }

    /// Takes one scrape at `now_secs` (`None`: `/metrics` did not answer; else requests
    /// running and tokens generated) and reports a stall as it begins and when it ends:
    /// requests running without a new token, or no answer, for longer than
    /// `stall_timeout_secs`.
    pub(crate) fn observe(
        &mut self,
        scrape: Option<(f64, f64)>,
        now_secs: f64,
        stall_timeout_secs: f64,
    ) -> Option<Change> {
        if let Some((running, tokens)) = scrape {
            if running == 0.0 || self.tokens != Some(tokens) {
                self.progress_at_secs = now_secs;
            }
            self.tokens = Some(tokens);
            self.running = running;
        }
        let quiet_secs = now_secs - self.progress_at_secs;
        let stalled = (self.running > 0.0 || scrape.is_none()) && quiet_secs > stall_timeout_secs;
        let change = match (stalled, self.stalled) {
            (true, false) => Some(Change::Stalled {
                running: self.running,
                quiet_secs,
                answered: scrape.is_some(),
            }),
            (false, true) => Some(Change::Resumed),
            _ => None,
        };
        self.stalled = stalled;
        change
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_sum_over_label_sets_and_ignore_longer_names() {
        let text = "# HELP vllm:num_requests_running x\nvllm:num_requests_running{model_name=\"a\"} 2\nvllm:num_requests_running{model_name=\"b\"} 1.0\nvllm:num_requests_running_other 9\n";
        assert_eq!(sum_series(text, "vllm:num_requests_running"), Some(3.0));
        assert_eq!(
            sum_series("llamacpp:n_decode_total 42\n", "llamacpp:n_decode_total"),
            Some(42.0)
        );
        assert_eq!(sum_series(text, "vllm:generation_tokens_total"), None);
    }

    #[test]
    fn running_requests_without_new_tokens_past_the_timeout_stall_and_tokens_resume() {
        let mut watch = ProgressWatch::new(0.0);
        assert_eq!(watch.observe(Some((1.0, 10.0)), 1.0, 5.0), None);
        assert_eq!(watch.observe(Some((1.0, 20.0)), 2.0, 5.0), None);
        assert_eq!(watch.observe(Some((1.0, 20.0)), 7.0, 5.0), None);
        assert_eq!(
            watch.observe(Some((1.0, 20.0)), 7.5, 5.0),
            Some(Change::Stalled {
                running: 1.0,
                quiet_secs: 5.5,
                answered: true
            })
        );
        assert_eq!(watch.observe(Some((1.0, 20.0)), 9.0, 5.0), None);
        assert_eq!(
            watch.observe(Some((1.0, 21.0)), 10.0, 5.0),
            Some(Change::Resumed)
        );
    }

    #[test]
    fn an_idle_engine_never_stalls_and_a_silent_one_does() {
        let mut watch = ProgressWatch::new(0.0);
        assert_eq!(watch.observe(Some((0.0, 5.0)), 1.0, 5.0), None);
        assert_eq!(watch.observe(Some((0.0, 5.0)), 100.0, 5.0), None);
        assert_eq!(watch.observe(Some((2.0, 6.0)), 101.0, 5.0), None);
        // Silent, but not for longer than the timeout yet.
        assert_eq!(watch.observe(None, 104.0, 5.0), None);
        assert_eq!(
            watch.observe(None, 107.0, 5.0),
            Some(Change::Stalled {
                running: 2.0,
                quiet_secs: 6.0,
                answered: false
            })
        );
        assert_eq!(
            watch.observe(Some((0.0, 9.0)), 108.0, 5.0),
            Some(Change::Resumed)
        );
    }
}
