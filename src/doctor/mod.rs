//! `infer doctor`: finds what breaks distributed inference, from offline evidence (NCCL
//! logs, recorded topologies) and this host. Each check lives in `checks/<id>.rs` with a
//! stable id; checks collect [`Finding`]s rather than failing on the first problem.

pub mod checks;
pub(crate) mod evidence;
pub(crate) mod gather;
pub mod nccl_log;

use comfy_table::Table;
use comfy_table::presets::NOTHING;
use serde::Serialize;

/// How bad a finding is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// Checked and healthy, or a fact worth knowing.
    Ok,
    /// Works, but slower or more fragile than it should be.
    Warn,
    /// Broken, or far slower than the hardware allows: `infer doctor` exits 1.
    Error,
}

/// One diagnosis. `--json` `findings[]`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Finding {
    /// Stable check id (`nccl-tcp-fallback`).
    pub check: &'static str,
    pub severity: Severity,
    /// Host the evidence came from, when known.
    pub host: Option<String>,
    /// What is wrong (or right), stating what was expected.
    pub message: String,
    /// The log line or matrix cell seen, with where it was (`file:line: text`).
    pub evidence: Vec<String>,
    /// The exact fix: an env var, a command, a plan change. Empty for `ok`.
    pub hint: String,
}

/// A [`Finding`] as it travels from a host's agent to the launcher (check ids as text).
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct WireFinding {
    /// The check's id.
    pub check: String,
    /// As [`Finding::severity`].
    pub severity: Severity,
    /// As [`Finding::message`].
    pub message: String,
    /// As [`Finding::evidence`].
    pub evidence: Vec<String>,
    /// As [`Finding::hint`].
    pub hint: String,
}

impl WireFinding {
    /// The finding to send.
    pub fn from_finding(finding: &Finding) -> WireFinding {
        WireFinding {
            check: finding.check.to_string(),
            severity: finding.severity,
            message: finding.message.clone(),
            evidence: finding.evidence.clone(),
            hint: finding.hint.clone(),
        }
    }

    /// The finding received from `host` (an id this build does not know reads `remote`).
    pub fn into_finding(self, host: &str) -> Finding {
        Finding {
            check: checks::known_id(&self.check).unwrap_or("remote"),
            severity: self.severity,
            host: Some(host.to_string()),
            message: self.message,
            evidence: self.evidence,
            hint: self.hint,
        }
    }
}

/// The `--json` output of `infer doctor`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    pub findings: Vec<Finding>,
    pub errors: usize,
    pub warnings: usize,
    /// The cross-host reachability matrix of `--cluster` (absent otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub matrix: Option<evidence::Matrix>,
    /// The all-reduce of `--cluster --bandwidth` (absent otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allreduce: Option<evidence::AllreduceProbe>,
    /// What `--cluster --engine E` found of the engine on each host (absent otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine: Option<evidence::EngineEvidence>,
}

impl Report {
    /// Counts severities of `findings`.
    pub fn new(findings: Vec<Finding>) -> Report {
        let errors = findings
            .iter()
            .filter(|f| f.severity == Severity::Error)
            .count();
        let warnings = findings
            .iter()
            .filter(|f| f.severity == Severity::Warn)
            .count();
        Report {
            findings,
            errors,
            warnings,
            matrix: None,
            allreduce: None,
            engine: None,
        }
    }
}

/// The human table: `severity check [host] message`, then evidence and hint lines.
pub fn render(report: &Report) -> String {
    // Findings about hosts are grouped under each host's name (in the order the hosts first
    // appear), the cluster-wide ones after them; without hosts, one table.
    let mut hosts: Vec<&str> = Vec::new();
    for finding in &report.findings {
        if let Some(host) = finding.host.as_deref()
            && !hosts.contains(&host)
        {
            hosts.push(host);
        }
    }
    let mut body = String::new();
    if hosts.is_empty() {
        body.push_str(&render_findings(report.findings.iter()));
    } else {
        for host in &hosts {
            body.push_str(&format!("{host}\n"));
            body.push_str(&indent(&render_findings(
                report
                    .findings
                    .iter()
                    .filter(|f| f.host.as_deref() == Some(host)),
            )));
            body.push_str("\n\n");
        }
        let rest: Vec<&Finding> = report
            .findings
            .iter()
            .filter(|f| f.host.is_none())
            .collect();
        if !rest.is_empty() {
            body.push_str("across hosts\n");
            body.push_str(&indent(&render_findings(rest.into_iter())));
            body.push_str("\n\n");
        }
        body.truncate(body.trim_end().len());
    }
    let matrix = report
        .matrix
        .as_ref()
        .map(|m| format!("\n\n{}", evidence::render_matrix(m)))
        .unwrap_or_default();
    let allreduce = report
        .allreduce
        .as_ref()
        .filter(|probe| !probe.rows.is_empty())
        .map(|probe| {
            format!(
                "\n\n# all-reduce (sum, float32): {} ranks, one per host ({}), {}\n{}",
                probe.hosts.len(),
                probe.hosts.join(", "),
                probe.transport,
                crate::runtime::collectives::nccl_tests_table(&probe.rows, probe.hosts.len())
                    .trim_end()
            )
        })
        .unwrap_or_default();
    format!(
        "{body}{matrix}{allreduce}\n\n{} error(s), {} warning(s)\n",
        report.errors, report.warnings
    )
}

/// Findings as a table of severity, check id and detail (evidence and hint below it).
fn render_findings<'a>(findings: impl Iterator<Item = &'a Finding>) -> String {
    let mut table = Table::new();
    table.load_style(NOTHING);
    for finding in findings {
        let severity = match finding.severity {
            Severity::Ok => "ok",
            Severity::Warn => "warn",
            Severity::Error => "fail",
        };
        let mut detail = finding.message.clone();
        for evidence in &finding.evidence {
            detail.push_str(&format!("\n  seen: {evidence}"));
        }
        if !finding.hint.is_empty() {
            detail.push_str(&format!("\n  hint: {}", finding.hint));
        }
        table.add_row([severity.to_string(), finding.check.to_string(), detail]);
    }
    table
        .to_string()
        .lines()
        .map(|l| l.trim_end().to_string())
        .collect::<Vec<_>>()
        .join("\n")
}

/// `text` with every line indented by two spaces.
fn indent(text: &str) -> String {
    text.lines()
        .map(|l| {
            if l.is_empty() {
                String::new()
            } else {
                format!("  {l}")
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// `origin:line: text` for a finding's evidence.
pub fn cite(origin: &str, evidence: &nccl_log::Evidence) -> String {
    format!("{origin}:{}: {}", evidence.line_no, evidence.text)
}
