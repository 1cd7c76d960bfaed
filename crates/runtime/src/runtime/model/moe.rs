//! Mixtral-style mixture-of-experts blocks: routing (top-k of the router logits, softmax over
//! the selected), SwiGLU experts, and expert parallelism — experts split over the EP group,
//! token rows dispatched to their experts' owners and the outputs combined with two
//! all-to-all exchanges. Outputs are summed in top-k order, so every EP degree gives the
//! same result as one process.

use anyhow::{Context, Result, bail};

use crate::runtime::collectives::Comm;
use crate::runtime::cpu::mathfn::swiglu;
use crate::runtime::formats::gguf::GgufFile;
use crate::runtime::model::config::LlamaConfig;
use crate::runtime::model::weights::Weight;

/// Loads layer `layer`'s MoE block from GGUF's stacked tensors (`ffn_gate_inp`,
/// `ffn_{gate,up,down}_exps`). Errors: missing tensors or shapes that disagree with the config.
pub fn load_gguf(
    file: &std::sync::Arc<GgufFile>,
    layer: usize,
    config: &LlamaConfig,
) -> Result<MoeFfn> {
    let (n_experts, hidden, width) = (
        config.n_experts,
        config.hidden_size,
        config.intermediate_size,
    );
    if n_experts == 0 || config.n_experts_used == 0 || config.n_experts_used > n_experts {
        bail!(
            "layer {layer} is a MoE layer but the metadata says {n_experts} experts, {} used",
            config.n_experts_used
        );
    }
    let name = |suffix: &str| format!("blk.{layer}.{suffix}");
    let load = |suffix: &str, rows: usize, cols: usize| -> Result<Weight> {
        let weight = Weight::from_gguf(file, &name(suffix))?;
        if (weight.n_rows, weight.n_cols) != (rows, cols) {
            bail!(
                "tensor `{}` is {}×{} but the metadata implies {rows}×{cols}",
                name(suffix),
                weight.n_rows,
                weight.n_cols
            );
        }
        Ok(weight)
    };
    let router = load("ffn_gate_inp.weight", n_experts, hidden)?;
    let gates = load("ffn_gate_exps.weight", n_experts * width, hidden)?;
    let ups = load("ffn_up_exps.weight", n_experts * width, hidden)?;
    let downs = load("ffn_down_exps.weight", n_experts * hidden, width)?;
    let experts = (0..n_experts)
        .map(|e| -> Result<Option<Expert>> {
            Ok(Some(Expert {
                gate: gates.rows(e * width, width)?,
                up: ups.rows(e * width, width)?,
                down: downs.rows(e * hidden, hidden)?,
            }))
        })
        .collect::<Result<_>>()?;
    Ok(MoeFfn {
        router,
        experts,
        top_k: config.n_experts_used,
    })
}

/// The `top_k` experts of each token and their weights: `(n_tokens, top_k)` pairs, experts
/// by descending router logit (ties: lower index), weights the softmax of those logits.
fn route(moe: &MoeFfn, x: &[f32], n_tokens: usize) -> Vec<Vec<(usize, f32)>> {
    let n_experts = moe.experts.len();
    let mut logits = vec![0f32; n_tokens * n_experts];
    moe.router.matmul(x, n_tokens, &mut logits);
    logits
        .chunks_exact(n_experts)
        .map(|row| top_k_experts(row, moe.top_k))
        .collect()
}

/// The `top_k` experts of one token's router logits (`(n_experts)`) and their weights:
/// experts by descending logit (ties: lower index), weights the softmax of those logits.
pub fn top_k_experts(logits: &[f32], top_k: usize) -> Vec<(usize, f32)> {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    order.truncate(top_k);
    let Some(&first) = order.first() else {
        return Vec::new();
    };
    let max = logits[first];
    let exps: Vec<f32> = order.iter().map(|&e| (logits[e] - max).exp()).collect();
    let total: f32 = exps.iter().sum();
    order
        .into_iter()
        .zip(exps)
        .map(|(e, v)| (e, v / total))
        .collect()
}

/// Runs expert `expert` on `rows` (`(n, hidden)`), returning `(n, hidden)`.
fn run_expert(expert: &Expert, rows: &[f32], n: usize) -> Vec<f32> {
    let width = expert.gate.n_rows;
    let (mut gate, mut up) = (vec![0f32; n * width], vec![0f32; n * width]);
    expert.gate.matmul(rows, n, &mut gate);
    expert.up.matmul(rows, n, &mut up);
    swiglu(&mut gate, &up);
    let mut out = vec![0f32; n * expert.down.n_rows];
    expert.down.matmul(&gate, n, &mut out);
    out
}

/// Runs the experts this process holds on `requests` (`(expert, row)` pairs), batching rows
/// per expert; returns one output row per request, in request order.
fn serve(moe: &MoeFfn, requests: &[(usize, &[f32])], hidden: usize) -> Result<Vec<Vec<f32>>> {
    let mut outputs = vec![Vec::new(); requests.len()];
    for (e, expert) in moe.experts.iter().enumerate() {
        let mine: Vec<usize> = (0..requests.len())
            .filter(|&i| requests[i].0 == e)
            .collect();
        if mine.is_empty() {
            continue;
        }
        let expert = expert
            .as_ref()
            .with_context(|| format!("expert {e} was routed to a rank that does not hold it"))?;
        let rows: Vec<f32> = mine
            .iter()
            .flat_map(|&i| requests[i].1.iter().copied())
            .collect();
        let out = run_expert(expert, &rows, mine.len());
        for (j, &i) in mine.iter().enumerate() {
            outputs[i] = out[j * hidden..(j + 1) * hidden].to_vec();
        }
    }
    Ok(outputs)
}

/// The MoE block on `x` (`(n_tokens, hidden)`, already normed); returns `(n_tokens, hidden)`.
/// With `ep`, this process holds experts `[r·E/P, (r+1)·E/P)` and every member of the EP
/// group must call this (with its own tokens) for the same layer.
///
/// Errors: a failed exchange, or a routing to an expert no rank holds.
pub fn forward<'c>(
    moe: &MoeFfn,
    x: &[f32],
    n_tokens: usize,
    ep: Option<&mut (dyn Comm + 'c)>,
) -> Result<Vec<f32>> {
    let hidden = moe.router.n_cols;
    let routes = route(moe, x, n_tokens);
    let row = |t: usize| &x[t * hidden..(t + 1) * hidden];
    // Expert output per (token, slot), filled locally or from the owners.
    let mut results: Vec<Vec<Vec<f32>>> =
        routes.iter().map(|r| vec![Vec::new(); r.len()]).collect();
    match ep {
        None => {
            let requests: Vec<(usize, &[f32])> = routes
                .iter()
                .enumerate()
                .flat_map(|(t, r)| r.iter().map(move |&(e, _)| (e, row(t))))
                .collect();
            let mut outputs = serve(moe, &requests, hidden)?.into_iter();
            for slots in results.iter_mut() {
                for slot in slots.iter_mut() {
                    *slot = outputs.next().context("missing expert output")?;
                }
            }
        }
        Some(comm) => {
            let size = comm.size();
            let per_rank = moe.experts.len() / size;
            // Dispatch: to each owner, `[expert id, row…]` per (token, slot) it serves.
            let mut sends: Vec<Vec<f32>> = vec![Vec::new(); size];
            let mut order: Vec<Vec<(usize, usize)>> = vec![Vec::new(); size];
            for (t, r) in routes.iter().enumerate() {
                for (slot, &(e, _)) in r.iter().enumerate() {
                    let owner = e / per_rank;
                    sends[owner].push(e as f32);
                    sends[owner].extend_from_slice(row(t));
                    order[owner].push((t, slot));
                }
            }
            let received = comm.all_to_all_v(&sends)?;
            let mut replies = Vec::with_capacity(size);
            for incoming in &received {
                let requests: Vec<(usize, &[f32])> = incoming
                    .chunks_exact(hidden + 1)
                    .map(|c| (c[0] as usize, &c[1..]))
                    .collect();
                replies.push(serve(moe, &requests, hidden)?.concat());
            }
            // Combine: each owner answers in the order it was asked.
            let answers = comm.all_to_all_v(&replies)?;
            for (owner, answer) in answers.iter().enumerate() {
                if answer.len() != order[owner].len() * hidden {
                    bail!(
                        "EP rank {owner} answered {} values for {} rows",
                        answer.len(),
                        order[owner].len()
                    );
                }
                for (chunk, &(t, slot)) in answer.chunks_exact(hidden).zip(&order[owner]) {
                    results[t][slot] = chunk.to_vec();
                }
            }
        }
    }
    // Weighted sum in top-k order: the same arithmetic whatever the EP degree.
    let mut out = vec![0f32; n_tokens * hidden];
    for (t, r) in routes.iter().enumerate() {
        let target = &mut out[t * hidden..(t + 1) * hidden];
        for (slot, &(_, weight)) in r.iter().enumerate() {
            for (o, v) in target.iter_mut().zip(&results[t][slot]) {
                *o += weight * v;
            }
        }
    }
    Ok(out)
}

/// A Mixtral-style MoE block: a router picks `top_k` experts per token, their SwiGLU
/// outputs are summed with softmax weights over the selected router logits. With expert
/// parallelism a rank holds only `experts[first..first + n]`; the others are `None`.
#[derive(Clone, Debug)]
pub struct MoeFfn {
    /// Router `(n_experts, hidden)`.
    pub router: Weight,
    pub experts: Vec<Option<Expert>>,
    pub top_k: usize,
}

/// One expert's SwiGLU MLP.
#[derive(Clone, Debug)]
pub struct Expert {
    pub gate: Weight,
    pub up: Weight,
    pub down: Weight,
}
