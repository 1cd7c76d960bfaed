//! Prints the first values of a few tensors: a debugging aid.
#![allow(clippy::print_stdout)]
use std::sync::Arc;
fn main() -> anyhow::Result<()> {
    let path = infer::model::default::ensure(&mut |_| {})?;
    let file = Arc::new(infer::runtime::gguf::GgufFile::open(&path)?);
    println!("data offset {}", file.header.data_offset_bytes);
    for name in [
        "token_embd.weight",
        "blk.0.attn_norm.weight",
        "blk.0.attn_q.weight",
    ] {
        let w = infer::runtime::weights::Weight::from_gguf(&file, name)?;
        let mut row = vec![0f32; w.n_cols];
        w.dequantize_row(0, &mut row);
        let first: Vec<f32> = row[..4].to_vec();
        w.dequantize_row(w.n_rows.min(1605) - 1, &mut row);
        println!("{name} {:?} {first:?} row1604: {:?}", w, &row[..4]);
    }
    Ok(())
}
