//! The KV hand-off of prefill/decode disaggregation between two threads of this process
//! (an `Outbox` and an `Inbox` on loopback): a prompt's KV for one shard sent in parts of
//! 8 layers, as a prefill rank streams it, then taken, once through the shared ring (the
//! decode rank on this host) and once over TCP (`INFER_SHM_DISABLE=1`, or another host on
//! loopback). Prints GB/s (bytes of KV per second from the first send to the take) for
//! SmolLM2's geometry (30 layers, 3 KV heads of 64 dims: 23,040 bytes a position) and a
//! Llama-3-8B TP 1 shard's (32 layers, 8 KV heads of 128 dims: 131,072 bytes a position).
#![allow(clippy::print_stdout)]

use std::time::{Duration, Instant};

use infer::runtime::exec::handoff::{Inbox, Outbox};
use infer::runtime::model::kv::KvTransfer;

/// Layers a prefill rank sends in one part (as the worker does).
const LAYERS_PER_PART: usize = 8;

/// The parts of a `positions`-token prompt's KV over `layers` layers.
fn parts(layers: usize, kv_heads: usize, head_dim: usize, positions: usize) -> Vec<KvTransfer> {
    (0..layers)
        .step_by(LAYERS_PER_PART)
        .map(|first| {
            let range = first..(first + LAYERS_PER_PART).min(layers);
            KvTransfer {
                tokens: (0..positions as u32).collect(),
                first_position: 0,
                prompt_tokens: positions,
                values: (0..range.len() * 2 * kv_heads * positions * head_dim)
                    .map(|v| v as u16)
                    .collect(),
                layers: range,
                n_kv_heads: kv_heads,
                head_dim,
            }
        })
        .collect()
}

/// Seconds to send and take `parts` `rounds` times (best round), through shared memory or
/// TCP.
fn time(parts: &[KvTransfer], layers: usize, shm: bool, rounds: u64) -> f64 {
    // Rank 0 (prefill) sends to rank 1 (decode), both on this host.
    let keys = infer::keyring::Keyring::master("bench", infer::keyring::LAUNCHER_HOST, vec![0, 0])
        .on_host(0);
    let inbox = Inbox::bind("127.0.0.1", &keys, 1, &[0]).expect("inbox");
    let address = inbox.address().to_string();
    let mut outbox = Outbox::new(&keys, 0).expect("outbox");
    outbox.add_inbox(&address, 1);
    if shm {
        outbox.on_this_host(&address);
    }
    let mut best = f64::INFINITY;
    for id in 0..rounds {
        let copies = parts.to_vec();
        let started = Instant::now();
        for part in copies {
            outbox.send(&address, id, part);
        }
        outbox.finish(id).expect("sent");
        inbox
            .take(id, layers, Duration::from_secs(60))
            .expect("taken");
        best = best.min(started.elapsed().as_secs_f64());
    }
    let sent = outbox.sent();
    assert_eq!(sent.shm_bytes > 0, shm, "the transport asked for");
    best
}

fn main() {
    println!(
        "{:<28} {:>9} {:>10} {:>14} {:>14}",
        "geometry", "positions", "KV MiB", "TCP GB/s", "shm GB/s"
    );
    for (name, layers, kv_heads, head_dim) in [
        ("SmolLM2-135M (30×3×64)", 30, 3, 64),
        ("Llama-3-8B TP1 (32×8×128)", 32, 8, 128),
    ] {
        for positions in [512, 2048] {
            let parts = parts(layers, kv_heads, head_dim, positions);
            let bytes: usize = parts.iter().map(KvTransfer::kv_bytes).sum();
            let tcp = time(&parts, layers, false, 5);
            let shm = time(&parts, layers, true, 5);
            println!(
                "{name:<28} {positions:>9} {:>10.1} {:>14.2} {:>14.2}",
                bytes as f64 / (1 << 20) as f64,
                bytes as f64 / tcp / 1e9,
                bytes as f64 / shm / 1e9
            );
        }
    }
}
