//! Tidy checks over the source tree (after rust-analyzer's `tidy.rs`): every Rust file
//! opens with a `//!` module doc saying what it owns, `src/` holds no `todo!()` stubs, and
//! every document a comment in `src/` cites by a bare name (`ARCHITECTURE.md`) is in the
//! repository.

use std::fs;
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, files: &mut Vec<PathBuf>) {
    for entry in
        fs::read_dir(dir).unwrap_or_else(|e| panic!("cannot list `{}`: {e}", dir.display()))
    {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            rust_files(&path, files);
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
}

fn all_files() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in ["src", "tests", "benches"] {
        if root.join(dir).exists() {
            rust_files(&root.join(dir), &mut files);
        }
    }
    assert!(files.len() > 5, "found too few Rust files: {files:?}");
    files
}

#[test]
fn every_rust_file_starts_with_a_module_doc() {
    let missing: Vec<String> = all_files()
        .into_iter()
        .filter(|path| {
            let text = fs::read_to_string(path).expect("readable source");
            !text.trim_start().starts_with("//!")
        })
        .map(|path| path.display().to_string())
        .collect();
    assert!(
        missing.is_empty(),
        "files without a `//!` module doc: {missing:?}"
    );
}

#[test]
fn no_stubs_in_src() {
    let stub_markers = [concat!("todo", "!("), concat!("unimplemented", "!(")];
    let stubs: Vec<String> = all_files()
        .into_iter()
        .filter(|path| path.components().any(|c| c.as_os_str() == "src"))
        .filter(|path| {
            let text = fs::read_to_string(path).expect("readable source");
            stub_markers.iter().any(|m| text.contains(m))
        })
        .map(|path| path.display().to_string())
        .collect();
    assert!(stubs.is_empty(), "stubs in: {stubs:?}");
}

/// NVRTC and cuBLAS are bound by our own code (`runtime/cuda/{nvrtc,cublas}.rs`), never
/// through cudarc, whose loader for them knows only CUDA 12 names and panics when none loads:
/// `src/` names no `cudarc::cublas` and nothing of `cudarc::nvrtc` but its `Ptx` type (which
/// carries a CUBIN to the driver), and cudarc's `cublas` feature is off.
#[test]
fn nvrtc_and_cublas_never_go_through_cudarc() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut offenders = Vec::new();
    for path in all_files()
        .into_iter()
        .filter(|path| path.starts_with(root.join("src")))
    {
        let text = fs::read_to_string(&path).expect("readable source");
        for (number, line) in text.lines().enumerate() {
            let nvrtc = line
                .match_indices("cudarc::nvrtc::")
                .any(|(at, m)| !line[at + m.len()..].starts_with("Ptx"));
            if nvrtc || line.contains("cudarc::cublas") {
                offenders.push(format!("{}:{}: {line}", path.display(), number + 1));
            }
        }
    }
    assert!(offenders.is_empty(), "{offenders:#?}");
    let manifest = fs::read_to_string(root.join("Cargo.toml")).expect("Cargo.toml");
    let cudarc = manifest
        .lines()
        .find(|line| line.starts_with("cudarc"))
        .expect("cudarc is a dependency");
    assert!(!cudarc.contains("\"cublas\""), "{cudarc}");
}

#[test]
fn documents_cited_in_src_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut missing = Vec::new();
    for path in all_files()
        .into_iter()
        .filter(|path| path.starts_with(root.join("src")))
    {
        let text = fs::read_to_string(&path).expect("readable source");
        for (number, line) in text.lines().enumerate() {
            let Some(comment) = line.trim_start().strip_prefix("//") else {
                continue;
            };
            // Bare upper-case document names (`README.md`, `DESIGN.md`) mean this
            // repository's root; a path qualified by another project says so in words.
            for word in comment
                .split(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '/')))
            {
                let Some(stem) = word.strip_suffix(".md") else {
                    continue;
                };
                if !stem.is_empty()
                    && stem.chars().all(|c| c.is_ascii_uppercase() || c == '_')
                    && !root.join(word).exists()
                {
                    missing.push(format!("{}:{}: {word}", path.display(), number + 1));
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "comments cite documents that are not in the repository: {missing:?}"
    );
}

/// The runtime's layers do not import each other both ways: the executor's step interface
/// knows no engine, the MoE block no decoder, the math functions no quantized kernels (the
/// shared pieces live below both: `exec::executor`'s generation types, `model::config`,
/// `cpu::simd`).
#[test]
fn runtime_modules_have_no_import_circles() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/runtime");
    for (file, forbidden) in [
        ("exec/executor.rs", "exec::engine"),
        ("model/moe.rs", "model::llama"),
        ("cpu/mathfn.rs", "cpu::quant"),
        ("cpu/simd.rs", "cpu::quant"),
        ("model/config.rs", "model::llama"),
    ] {
        let text = std::fs::read_to_string(root.join(file)).expect("source file");
        assert!(
            !text.contains(forbidden),
            "src/runtime/{file} refers to `{forbidden}`, which depends on it"
        );
    }
}
