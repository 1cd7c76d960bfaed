//! Teacher-forced comparison with llama.cpp: our top-1/top-2 margin at each step of the
//! reference continuation, next to llama.cpp's. A debugging aid.
#![allow(clippy::print_stdout)]

fn main() -> anyhow::Result<()> {
    let path = infer::model::default::ensure(&mut |_| {})?;
    let model = infer::runtime::llama::Llama::open_gguf(&path)?;
    let fixture: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        "../shared/fixtures/smollm2_llamacpp_greedy.json",
    )?)?;
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_u64())
                    .map(|x| x as u32)
                    .collect()
            })
            .unwrap_or_default()
    };
    for case in fixture["cases"].as_array().unwrap_or(&Vec::new()) {
        let prompt = ids(&case["prompt_tokens"]);
        let expected = ids(&case["greedy_tokens"]);
        let margins: Vec<f64> = case["top1_top2_margin"]
            .as_array()
            .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
            .unwrap_or_default();
        let mut cache = model.new_cache();
        let mut logits = model.forward(&mut [infer::runtime::llama::SequenceInput {
            tokens: &prompt,
            cache: &mut cache,
            all_logits: false,
        }])?;
        let mut worst = 0f64;
        for (step, &want) in expected.iter().enumerate() {
            let l = &logits[0];
            let mut order: Vec<usize> = (0..l.len()).collect();
            order.sort_by(|&a, &b| l[b].total_cmp(&l[a]));
            let ours = (l[order[0]] - l[order[1]]) as f64;
            let signed = if order[0] as u32 == want {
                ours
            } else {
                -((l[order[0]] - l[want as usize]) as f64)
            };
            worst = worst.max((signed - margins[step]).abs());
            println!(
                "step {step:2}: llama.cpp margin {:7.4}  ours {signed:7.4}  diff {:+.4}",
                margins[step],
                signed - margins[step]
            );
            logits = model.forward(&mut [infer::runtime::llama::SequenceInput {
                tokens: &[want],
                cache: &mut cache,
                all_logits: false,
            }])?;
        }
        println!("{:?}: worst margin difference {worst:.4}", case["prompt"]);
    }
    Ok(())
}
