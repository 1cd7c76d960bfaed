//! Greedy tokens for the llama.cpp reference prompts, from their token ids: a debugging aid.
#![allow(clippy::print_stdout)]

fn main() -> anyhow::Result<()> {
    let path = infer::model::default::ensure(&mut |_| {})?;
    let model = infer::runtime::llama::Llama::open_gguf(&path)?;
    let fixture: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        "../shared/fixtures/smollm2_llamacpp_greedy.json",
    )?)?;
    for case in fixture["cases"].as_array().unwrap_or(&Vec::new()) {
        let prompt: Vec<u32> = case["prompt_tokens"]
            .as_array()
            .unwrap_or(&Vec::new())
            .iter()
            .filter_map(|v| v.as_u64())
            .map(|v| v as u32)
            .collect();
        let expected: Vec<u64> = case["greedy_tokens"]
            .as_array()
            .unwrap_or(&Vec::new())
            .iter()
            .filter_map(|v| v.as_u64())
            .collect();
        let mut cache = model.new_cache();
        let start = std::time::Instant::now();
        let mut logits = model.forward(&mut [infer::runtime::llama::SequenceInput {
            tokens: &prompt,
            cache: &mut cache,
            all_logits: false,
        }])?;
        let mut got = Vec::new();
        for _ in 0..expected.len() {
            let next = logits[0]
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map(|(i, _)| i as u32)
                .unwrap_or(0);
            let step = got.len();
            if let Some(&want) = expected.get(step)
                && want as u32 != next
            {
                println!(
                    "step {step}: ours {next} ({:.4}) vs llama.cpp {want} ({:.4})",
                    logits[0][next as usize], logits[0][want as usize]
                );
            }
            got.push(next as u64);
            if got.last().copied() != expected.get(step).copied() {
                break;
            }
            logits = model.forward(&mut [infer::runtime::llama::SequenceInput {
                tokens: &[next],
                cache: &mut cache,
                all_logits: false,
            }])?;
        }
        println!(
            "{:?}\nexpected {expected:?}\ngot      {got:?}\nmatch {} in {:.2?}",
            case["prompt"],
            got == expected,
            start.elapsed()
        );
    }
    Ok(())
}
