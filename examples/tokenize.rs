//! Tokenizes its arguments with the default model's tokenizer: a debugging aid.
#![allow(clippy::print_stdout)]
fn main() -> anyhow::Result<()> {
    let path = infer::model::default::ensure(&mut |_| {})?;
    let header = infer::runtime::gguf::Header::read_file(&path)?;
    let tokenizer = infer::runtime::tokenizer::Tokenizer::from_gguf(&header)?;
    for text in std::env::args().skip(1) {
        let ids = tokenizer.encode(&text, true)?;
        println!(
            "{text:?} -> {ids:?} -> {:?}",
            tokenizer.decode(&ids, false)?
        );
    }
    println!(
        "eos {:?} bos {:?} add_bos {}",
        tokenizer.eos_ids, tokenizer.bos_id, tokenizer.add_bos
    );
    Ok(())
}
