//! Sharded SmolLM2 against the whole model: tensor parallelism between threads over the
//! transport rank processes use (TCP connections plus the shared-memory all-reduce),
//! pipeline stages chained, and the greedy tokens they produce.

use std::time::Duration;

use infer::rendezvous::{StoreClient, StoreServer, random_token};
use infer::runtime::collectives::shm::ShmComm;
use infer::runtime::collectives::{Comm, TcpComm};
use infer::runtime::model::llama::{Llama, SequenceInput, StageOutput};
use infer::runtime::model::sampling::argmax;

fn smollm2() -> Llama {
    let path = crate::support::model::smollm2();
    Llama::open_gguf(&path).expect("loads")
}

/// Greedy tokens of the sharded model (tp × pp), every shard in its own thread.
fn greedy(
    model: &Llama,
    tp: usize,
    pp: usize,
    prompt: &[u32],
    steps: usize,
) -> (Vec<u32>, Vec<f32>) {
    // Every rank on one host (host 0); the store holds the run's keys.
    let run = infer::keyring::Keyring::master(
        &random_token(),
        infer::keyring::LAUNCHER_HOST,
        vec![0; tp],
    );
    let server = StoreServer::start("127.0.0.1:0", &run).expect("store");
    let token = run.on_host(0);
    let address = server.address().to_string();
    let n_layers = model.layers.len();
    let stages: Vec<(usize, usize)> = (0..pp)
        .map(|s| {
            (
                s * n_layers / pp,
                (s + 1) * n_layers / pp - s * n_layers / pp,
            )
        })
        .collect();
    // One thread per TP rank; each runs all pipeline stages of its column in order (the
    // stages exchange hidden states through this thread, which is what send/recv would carry).
    let results: Vec<(Vec<u32>, Vec<f32>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..tp)
            .map(|tp_rank| {
                let (address, token, stages) = (address.clone(), token.clone(), stages.clone());
                scope.spawn(move || {
                    let shards: Vec<Llama> = stages
                        .iter()
                        .map(|&(first, n)| model.shard(tp_rank, tp, first, n).expect("shard"))
                        .collect();
                    let mut comms: Vec<ShmComm> = (0..pp)
                        .map(|stage| {
                            let mut store = StoreClient::connect(
                                &address,
                                &token,
                                Some(tp_rank as u64),
                                Duration::from_secs(10),
                            )
                            .expect("store");
                            TcpComm::connect(
                                &mut store,
                                &format!("tp{stage}"),
                                &(0..tp as u64).collect::<Vec<_>>(),
                                tp_rank as u64,
                                "127.0.0.1",
                                Duration::from_secs(30),
                            )
                            .and_then(ShmComm::new)
                            .expect("tp group")
                        })
                        .collect();
                    let mut caches: Vec<_> = shards.iter().map(Llama::new_cache).collect();
                    let (mut tokens, mut first_logits) = (Vec::new(), Vec::new());
                    let mut input: Vec<u32> = prompt.to_vec();
                    for _ in 0..steps {
                        let mut hidden: Option<Vec<f32>> = None;
                        let mut logits = None;
                        for (stage, shard) in shards.iter().enumerate() {
                            let mut batch = [SequenceInput {
                                tokens: &input,
                                cache: &mut caches[stage],
                                all_logits: false,
                            }];
                            let comm: Option<&mut dyn Comm> = if tp > 1 {
                                Some(&mut comms[stage])
                            } else {
                                None
                            };
                            match shard
                                .forward_stage(hidden.as_deref(), &mut batch, comm, None)
                                .expect("stage")
                            {
                                StageOutput::Hidden(h) => hidden = Some(h),
                                StageOutput::Logits(l) => logits = Some(l),
                            }
                        }
                        let logits = logits.expect("the last stage returns logits").remove(0);
                        input = record_greedy(&logits, &mut tokens, &mut first_logits);
                    }
                    (tokens, first_logits)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("tp thread"))
            .collect()
    });
    // Every TP rank computed the same tokens.
    assert!(
        results.windows(2).all(|w| w[0].0 == w[1].0),
        "TP ranks disagree"
    );
    results.into_iter().next().expect("one rank")
}

/// One greedy step of a test loop: keeps the first step's logits, appends the argmax to
/// `tokens` and returns it as the next input.
fn record_greedy(logits: &[f32], tokens: &mut Vec<u32>, first_logits: &mut Vec<f32>) -> Vec<u32> {
    if first_logits.is_empty() {
        *first_logits = logits.to_vec();
    }
    let next = argmax(logits);
    tokens.push(next);
    vec![next]
}

#[test]
fn tp_and_pp_shards_reproduce_the_whole_model() {
    let model = smollm2();
    let prompt = [
        33u32, 28, 216, 34, 28, 216, 35, 28, 216, 36, 28, 216, 37, 28,
    ]; // "1, 2, 3, 4, 5,"
    let (reference, reference_logits) = greedy(&model, 1, 1, &prompt, 12);
    for (tp, pp) in [(3, 1), (1, 2), (1, 3), (3, 2)] {
        let (tokens, logits) = greedy(&model, tp, pp, &prompt, 12);
        assert_eq!(tokens, reference, "tp={tp} pp={pp}");
        let worst = logits
            .iter()
            .zip(&reference_logits)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let mean = logits
            .iter()
            .zip(&reference_logits)
            .map(|(a, b)| (a - b).abs())
            .sum::<f32>()
            / logits.len() as f32;
        // Pipeline stages run the very same operations, and the row-parallel projections
        // continue one exact-order dot product across the TP ranks (SmolLM2's projections
        // are Q4_1/Q8_0): bit-identical logits for every layout.
        assert_eq!(worst, 0.0, "tp={tp} pp={pp}: mean difference {mean}");
    }
}

#[test]
fn misaligned_shards_are_refused() {
    let model = smollm2();
    let error = model
        .shard(0, 2, 0, 30)
        .expect_err("9 heads do not split in 2");
    assert!(error.to_string().contains("tp=2"), "{error}");
    let error = model.shard(0, 1, 25, 10).expect_err("layers out of range");
    assert!(error.to_string().contains("outside"), "{error}");
}

#[test]
fn synthetic_dense_model_agrees_at_tp_1_2_4() {
    use crate::support::synthetic::{Shape, weights, write_gguf};
    // 8 heads and 2 KV heads: TP 4 replicates each KV head on two ranks. A vocabulary of
    // 83 splits unevenly over the vocab-parallel LM head (41 + 42, 20 + 21 + 21 + 21).
    let shape = Shape {
        hidden: 64,
        intermediate: 96,
        n_layers: 2,
        n_heads: 8,
        n_kv_heads: 2,
        vocab: 83,
        qkv_bias: false,
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("dense.gguf");
    write_gguf(&path, &shape, &weights(&shape, 21));
    let model = Llama::open_gguf(&path).expect("loads");
    let prompt = [3u32, 14, 15, 9, 26, 5];
    let (reference, reference_logits) = greedy(&model, 1, 1, &prompt, 8);
    // Each TP rank of the last stage holds its rows of the LM head only.
    let last = model.shard(1, 4, 1, 1).expect("a shard");
    assert_eq!(
        last.output.n_rows,
        infer::runtime::model::llama::head_rows(1, 4, 83).len()
    );
    assert_eq!(last.output.n_rows, 21);
    // Without its TP group, a shard cannot give whole logits, and says so.
    let shard = model.shard(0, 2, 0, 2).expect("a shard");
    let mut cache = shard.new_cache();
    let mut batch = [SequenceInput {
        tokens: &prompt,
        cache: &mut cache,
        all_logits: false,
    }];
    let error = shard
        .forward(&mut batch)
        .expect_err("no TP group")
        .to_string();
    assert!(error.contains("its logits need its TP group"), "{error}");
    for tp in [2, 4] {
        for pp in [1, 2] {
            let (tokens, logits) = greedy(&model, tp, pp, &prompt, 8);
            assert_eq!(tokens, reference, "tp={tp} pp={pp}");
            // f32 weights: no activation quantization, so only summation order differs.
            let worst = logits
                .iter()
                .zip(&reference_logits)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert_eq!(logits.len(), 83, "tp={tp} pp={pp}: whole rows of logits");
            assert!(worst < 1e-3, "tp={tp} pp={pp}: logits differ by {worst}");
        }
    }
}

/// Greedy tokens of every DP replica of `tp × dp` ranks (threads) over an MoE model, experts
/// split over all ranks when `ep` (EP = TP × DP, as vLLM's expert parallelism).
fn moe_greedy(
    model: &Llama,
    tp: usize,
    dp: usize,
    ep: bool,
    prompt: &[u32],
    steps: usize,
) -> Vec<(Vec<u32>, Vec<f32>)> {
    // Every rank on one host (host 0); the store holds the run's keys.
    let run = infer::keyring::Keyring::master(
        &random_token(),
        infer::keyring::LAUNCHER_HOST,
        vec![0; tp * dp],
    );
    let server = StoreServer::start("127.0.0.1:0", &run).expect("store");
    let token = run.on_host(0);
    let address = server.address().to_string();
    let world = tp * dp;
    let n_layers = model.layers.len();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (address, token) = (address.clone(), token.clone());
                scope.spawn(move || {
                    let (tp_rank, dp_rank) = (rank % tp, rank / tp);
                    let mut shard = model.shard(tp_rank, tp, 0, n_layers).expect("shard");
                    if ep {
                        shard.shard_experts(rank, world).expect("experts");
                    }
                    let mut store = StoreClient::connect(
                        &address,
                        &token,
                        Some(rank as u64),
                        Duration::from_secs(10),
                    )
                    .expect("store");
                    let tp_members: Vec<u64> = (0..tp).map(|t| (dp_rank * tp + t) as u64).collect();
                    let mut tp_comm = TcpComm::connect(
                        &mut store,
                        &format!("tp/{dp_rank}"),
                        &tp_members,
                        rank as u64,
                        "127.0.0.1",
                        Duration::from_secs(30),
                    )
                    .and_then(ShmComm::new)
                    .expect("tp");
                    let mut ep_comm = TcpComm::connect(
                        &mut store,
                        "ep",
                        &(0..world as u64).collect::<Vec<_>>(),
                        rank as u64,
                        "127.0.0.1",
                        Duration::from_secs(30),
                    )
                    .and_then(ShmComm::new)
                    .expect("ep");
                    let mut cache = shard.new_cache();
                    let (mut tokens, mut first_logits) = (Vec::new(), Vec::new());
                    let mut input = prompt.to_vec();
                    for _ in 0..steps {
                        let mut batch = [SequenceInput {
                            tokens: &input,
                            cache: &mut cache,
                            all_logits: false,
                        }];
                        let tp_arg: Option<&mut dyn Comm> =
                            if tp > 1 { Some(&mut tp_comm) } else { None };
                        let ep_arg: Option<&mut dyn Comm> =
                            if ep { Some(&mut ep_comm) } else { None };
                        let logits = match shard
                            .forward_stage(None, &mut batch, tp_arg, ep_arg)
                            .expect("forward")
                        {
                            StageOutput::Logits(mut l) => l.remove(0),
                            StageOutput::Hidden(_) => panic!("one stage returns logits"),
                        };
                        input = record_greedy(&logits, &mut tokens, &mut first_logits);
                    }
                    (tokens, first_logits)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank"))
            .collect()
    })
}

#[test]
fn synthetic_moe_agrees_at_ep_1_2_4_with_tp_1_and_2() {
    use crate::support::synthetic::{Shape, write_gguf_moe};
    let shape = Shape::small_moe();
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("moe.gguf");
    write_gguf_moe(&path, &shape, 8, 2, 33);
    let model = Llama::open_gguf(&path).expect("the MoE model loads");
    assert!(model.layers.iter().all(|l| {
        l.moe
            .as_ref()
            .is_some_and(|m| m.experts.len() == 8 && m.top_k == 2)
    }));
    let prompt = [3u32, 14, 15, 9, 26, 5];
    // The prompt's tokens are routed to experts outside the first quarter: a rank holding only
    // experts 0-1 cannot run the layer alone, so the EP runs below really exchange rows.
    let mut quarter = model.clone();
    quarter.shard_experts(0, 4).expect("experts");
    let mut cache = quarter.new_cache();
    let error = quarter
        .forward(&mut [SequenceInput {
            tokens: &prompt,
            cache: &mut cache,
            all_logits: false,
        }])
        .expect_err("needs other shards");
    assert!(error.to_string().contains("does not hold it"), "{error}");
    let reference = moe_greedy(&model, 1, 1, false, &prompt, 8).remove(0);
    // (tp, dp, expert parallel): EP = tp × dp.
    for (tp, dp, ep) in [
        (1, 2, true),
        (1, 4, true),
        (2, 1, false),
        (2, 1, true),
        (2, 2, true),
    ] {
        for (replica, (tokens, logits)) in moe_greedy(&model, tp, dp, ep, &prompt, 8)
            .into_iter()
            .enumerate()
        {
            assert_eq!(
                tokens, reference.0,
                "tp={tp} dp={dp} ep={ep} rank {replica}"
            );
            let worst = logits
                .iter()
                .zip(&reference.1)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            // Expert parallelism alone computes every expert output exactly as one process
            // does and sums them in top-k order: bit-identical. TP changes attention sums.
            let tolerance = if tp == 1 { 0.0 } else { 1e-3 };
            assert!(
                worst <= tolerance,
                "tp={tp} dp={dp} ep={ep}: logits differ by {worst}"
            );
        }
    }
}
