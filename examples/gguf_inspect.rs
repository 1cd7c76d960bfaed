//! Prints a GGUF file's metadata (arrays summarized) and tensor infos: a debugging aid.
#![allow(clippy::print_stdout)]

fn main() -> anyhow::Result<()> {
    let path = std::env::args()
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("usage: gguf_inspect FILE.gguf"))?;
    let header = infer::runtime::gguf::Header::read_file(std::path::Path::new(&path))?;
    println!(
        "version {} alignment {}",
        header.version, header.alignment_bytes
    );
    for (key, value) in &header.metadata {
        match value {
            infer::runtime::gguf::Value::Array(items) => println!(
                "{key}: array of {} (first: {:?})",
                items.len(),
                items.iter().take(3).collect::<Vec<_>>()
            ),
            infer::runtime::gguf::Value::String(s) if s.len() > 200 => {
                println!("{key}: string of {} bytes: {:?}…", s.len(), &s[..200])
            }
            other => println!("{key}: {other:?}"),
        }
    }
    for tensor in &header.tensors {
        println!(
            "{} {:?} {} offset {}",
            tensor.name,
            tensor.dims,
            tensor.type_name(),
            tensor.offset_bytes
        );
    }
    Ok(())
}
