//! Kernels against llama.cpp's Python reference (`gguf` 0.19.0 on PyPI): every supported
//! type dequantizes to the reference values (the repository's
//! `tests/fixtures/quant_reference.json`, made by `scripts/gen_quant_fixtures.py`), and the
//! integer dot kernels agree with them. Here, beside the kernels, so that
//! `cargo test -p infer-runtime` checks a kernel edit against the reference.

use infer_runtime::runtime::cpu::quant::{Numerics, dequantize_row, dot_q8, quantize_row_q8};
use infer_runtime::runtime::formats::ggml::GgmlType;
use infer_runtime::runtime::model::weights::Weight;
use serde_json::Value;

fn reference() -> Vec<(GgmlType, Vec<u8>, Vec<f32>)> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/quant_reference.json"
    );
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("JSON");
    json["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|case| {
            let ty = match case["type"].as_str().expect("type") {
                "F32" => GgmlType::F32,
                "F16" => GgmlType::F16,
                "BF16" => GgmlType::Bf16,
                "Q4_0" => GgmlType::Q4_0,
                "Q4_1" => GgmlType::Q4_1,
                "Q8_0" => GgmlType::Q8_0,
                "Q4_K" => GgmlType::Q4K,
                "Q5_K" => GgmlType::Q5K,
                "Q6_K" => GgmlType::Q6K,
                other => panic!("unexpected type {other}"),
            };
            let hex = case["bytes_hex"].as_str().expect("hex");
            let bytes = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
                .collect();
            let values = case["values"]
                .as_array()
                .expect("values")
                .iter()
                .map(|v| v.as_f64().expect("number") as f32)
                .collect();
            (ty, bytes, values)
        })
        .collect()
}

#[test]
fn every_type_dequantizes_like_llama_cpp() {
    let cases = reference();
    assert_eq!(cases.len(), 9, "F32 F16 BF16 Q4_0 Q4_1 Q8_0 Q4_K Q5_K Q6_K");
    for (ty, bytes, expected) in cases {
        assert_eq!(
            ty.row_bytes(expected.len()).expect("whole blocks"),
            bytes.len(),
            "{ty:?}"
        );
        let mut out = vec![0f32; expected.len()];
        dequantize_row(ty, &bytes, &mut out);
        for (i, (got, want)) in out.iter().zip(&expected).enumerate() {
            assert!(
                (got - want).abs() <= 1e-6 * want.abs().max(1.0),
                "{ty:?}[{i}]: {got} vs {want}"
            );
        }
    }
}

#[test]
fn integer_dots_agree_with_the_reference_values() {
    for (ty, bytes, weights) in reference()
        .into_iter()
        .filter(|(ty, _, _)| matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0))
    {
        let x: Vec<f32> = (0..weights.len())
            .map(|i| ((i * 7919 % 257) as f32 - 128.0) / 64.0)
            .collect();
        let mut xq = Vec::new();
        quantize_row_q8(&x, &mut xq);
        let exact: f32 = weights.iter().zip(&x).map(|(w, v)| w * v).sum();
        let norm: f32 = weights.iter().zip(&x).map(|(w, v)| (w * v).abs()).sum();
        // The matrix product (packed SIMD kernels where the CPU has them) and the one-row
        // reference.
        let mut matrix = Weight::from_bytes(ty, 1, weights.len(), bytes.clone()).expect("one row");
        for numerics in [Numerics::Exact, Numerics::Fast] {
            matrix.set_numerics(numerics);
            let mut product = [0f32];
            matrix.matmul(&x, 1, &mut product);
            for (name, got) in [
                ("matmul", product[0]),
                ("reference", dot_q8(ty, &bytes, &xq, numerics)),
            ] {
                // Activation quantization costs at most half a step per element.
                assert!(
                    (got - exact).abs() <= 0.01 * norm,
                    "{ty:?} {numerics:?} {name}: {got} vs {exact} (scale {norm})"
                );
            }
        }
    }
}
