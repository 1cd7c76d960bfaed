//! `engine`: the serving engine `infer up --engine E` would launch is there, the same
//! everywhere, and its ports are free.
//!
//! What it checks (with `infer doctor --cluster hosts.toml --engine E`): on every host, the
//! engine's programs run (`vllm --version`; `python3 -c 'import sglang'`; `llama-server
//! --version` and, on the other hosts, `ggml-rpc-server`), the version each reports, torch
//! and NCCL for vLLM and SGLang, and whether the ports the engine takes by default are free
//! (the head's HTTP port and rendezvous port; SGLang's NCCL port; llama.cpp's RPC port on
//! the other hosts).
//! Why it matters: hosts on different engine, torch or NCCL versions hang or fail in their
//! first collective, often minutes after start; a port in use fails the launch on one host
//! while the others wait.
//! How to fix: install the same versions everywhere (one venv image), stop what holds the
//! port or pick others (`--port`, `--dist-port`).

use crate::doctor::evidence::ClusterEvidence;
use crate::doctor::{Finding, Severity};

pub(crate) const ID: &str = "engine";

/// Errors for unusable engines, differing versions and ports in use; one `ok` line when
/// all is well.
pub(crate) fn check(evidence: &ClusterEvidence) -> Vec<Finding> {
    let Some(engine) = &evidence.engine else {
        return Vec::new();
    };
    let mut findings = Vec::new();
    for host in &engine.hosts {
        if let Some(error) = &host.error {
            let (message, hint) = error.split_once("\nhint: ").unwrap_or((error, ""));
            findings.push(Finding {
                check: ID,
                severity: Severity::Error,
                host: Some(host.host.clone()),
                message: message.to_string(),
                evidence: Vec::new(),
                hint: hint.to_string(),
            });
        }
        for (port, purpose, why) in &host.ports_taken {
            findings.push(Finding {
                check: ID,
                severity: Severity::Error,
                host: Some(host.host.clone()),
                message: format!("port {port} ({purpose} of {}) is in use: {why}", engine.engine),
                evidence: Vec::new(),
                hint: format!(
                    "stop what holds it (`ss -ltnp 'sport = :{port}'` names it), or launch with `--port` / `--dist-port`"
                ),
            });
        }
    }
    for (what, value) in [
        (
            "engine version",
            &(|h: &crate::doctor::evidence::EngineHostEvidence| h.version.clone())
                as &dyn Fn(&_) -> Option<String>,
        ),
        (
            "torch / NCCL",
            &|h: &crate::doctor::evidence::EngineHostEvidence| h.torch.clone(),
        ),
    ] {
        let values: Vec<(String, String)> = engine
            .hosts
            .iter()
            .filter_map(|h| value(h).map(|v| (h.host.clone(), v)))
            .collect();
        if values.windows(2).any(|w| w[0].1 != w[1].1) {
            findings.push(Finding {
                check: ID,
                severity: Severity::Error,
                host: None,
                message: format!("the hosts run different {} {what}s", engine.engine),
                evidence: values.iter().map(|(h, v)| format!("{h}: {v}")).collect(),
                hint: "install the same versions on every host (the engine's processes must speak one protocol)".into(),
            });
        }
    }
    if findings.is_empty() {
        let first = engine.hosts.first();
        findings.push(Finding {
            check: ID,
            severity: Severity::Ok,
            host: None,
            message: format!(
                "{} {} on every host{}, its ports free",
                engine.engine,
                first
                    .and_then(|h| h.version.as_deref())
                    .unwrap_or("(version unknown)"),
                first
                    .and_then(|h| h.torch.as_deref())
                    .map_or(String::new(), |t| format!(" ({t})"))
            ),
            evidence: Vec::new(),
            hint: String::new(),
        });
    }
    findings
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::evidence::{EngineEvidence, EngineHostEvidence};

    fn evidence(hosts: Vec<EngineHostEvidence>) -> ClusterEvidence {
        ClusterEvidence {
            hosts: Vec::new(),
            unreachable: Vec::new(),
            data: Ok(Vec::new()),
            matrix: None,
            bandwidth: None,
            allreduce: None,
            engine: Some(EngineEvidence {
                engine: "vllm".into(),
                hosts,
            }),
        }
    }

    fn host(name: &str, version: &str) -> EngineHostEvidence {
        EngineHostEvidence {
            host: name.into(),
            version: Some(version.into()),
            torch: Some("torch 2.14.0, NCCL 2.28.3".into()),
            error: None,
            ports_taken: Vec::new(),
        }
    }

    #[test]
    fn same_versions_and_free_ports_are_ok() {
        let findings = check(&evidence(vec![host("a", "0.33.0"), host("b", "0.33.0")]));
        assert_eq!(findings.len(), 1);
        assert_eq!(findings[0].severity, Severity::Ok);
        assert!(findings[0].message.contains("vllm 0.33.0 on every host"));
    }

    #[test]
    fn different_versions_a_missing_engine_and_a_taken_port_are_errors() {
        let mut broken = host("c", "0.33.0");
        broken.version = None;
        broken.torch = None;
        broken.error = Some("`vllm` is not usable on `c`: not on PATH\nhint: install it".into());
        let mut busy = host("b", "0.32.1");
        busy.ports_taken = vec![(8000, "the HTTP API".into(), "Address in use".into())];
        let findings = check(&evidence(vec![host("a", "0.33.0"), busy, broken]));
        let errors: Vec<&Finding> = findings
            .iter()
            .filter(|f| f.severity == Severity::Error)
            .collect();
        assert_eq!(errors.len(), 3, "{findings:#?}");
        assert!(
            errors
                .iter()
                .any(|f| f.host.as_deref() == Some("c") && f.hint == "install it")
        );
        assert!(errors.iter().any(|f| f.message.contains("port 8000")));
        let versions = errors
            .iter()
            .find(|f| f.message.contains("engine versions"))
            .expect("a version finding");
        assert_eq!(versions.evidence, ["a: 0.33.0", "b: 0.32.1"]);
    }
}
