//! `pp-bubble`: a pipeline whose stages idle for much of each round.
//!
//! What it checks: the plan's estimated pipeline bubble, `(pp−1)/(m+pp−1)` for `m`
//! micro-batches (GPipe, Huang et al. 2019).
//! Why it matters: above 30% a third of every GPU's time is spent waiting for the stage
//! before it: PP is costing more than it gives.
//! How to fix: fewer stages (more TP inside a node, if heads allow), or more sequences in
//! flight so there are more micro-batches per round.

use crate::doctor::{Finding, Severity};
use crate::plan::Plan;

/// Id of this check.
pub(crate) const ID: &str = "pp-bubble";

/// Bubble fraction above which the check warns.
pub(crate) const MAX_BUBBLE_FRACTION: f64 = 0.30;

/// A warning above [`MAX_BUBBLE_FRACTION`]; nothing without PP.
pub(crate) fn check(plan: &Plan) -> Option<Finding> {
    if plan.parallel.pp <= 1 {
        return None;
    }
    let bubble = plan.estimate.pp_bubble_fraction;
    let over = bubble > MAX_BUBBLE_FRACTION;
    Some(Finding {
        check: ID,
        severity: if over { Severity::Warn } else { Severity::Ok },
        host: None,
        message: format!(
            "PP{} pipeline bubble is an estimated {:.0}% of each round{}",
            plan.parallel.pp,
            bubble * 100.0,
            if over {
                format!(", above {:.0}%", MAX_BUBBLE_FRACTION * 100.0)
            } else {
                String::new()
            }
        ),
        evidence: vec![format!(
            "estimate.pp_bubble_fraction = {bubble:.3} at {} sequences per replica",
            plan.estimate.batch_per_replica
        )],
        hint: if over {
            "use fewer PP stages (more TP inside a node) or keep more sequences in flight"
                .to_string()
        } else {
            String::new()
        },
    })
}
