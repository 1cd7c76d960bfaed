//! `infer model export-tokenizer` on the real SmolLM2 file: the directory it writes loads in
//! the `tokenizers` crate and in Python's `tokenizers` (the library under
//! `transformers.AutoTokenizer`), which encode every text as the engine does (and as
//! llama.cpp did) and decode it back; its JSON files hold what `transformers` reads; files
//! in the way are refused unless `--force`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use infer::runtime::formats::gguf::Header;
use infer::runtime::model::chat::{ChatMessage, render};
use infer::runtime::model::tokenizer::Tokenizer;
use serde_json::Value;

use crate::support::cache::tokenizers_python_package;
use crate::support::fixtures::shared_fixture;
use crate::support::model::SMOLLM2_LAYERS;
use crate::support::process::{run, stdout_ok};

/// Texts that exercise every part of a byte-level BPE tokenizer: words and punctuation,
/// digit runs (split one by one), whitespace runs, tabs and newlines, accents, scripts
/// other than Latin, emoji with joiners and modifiers, contractions, the model's special
/// tokens (whole, and broken), and the empty text.
const TEXTS: &[&str] = &[
    "Hello, world!",
    "  leading and   multiple   spaces, trailing   ",
    "tabs\tand\nnewlines\n\n\nthree\r\nCRLF",
    "digits 1234567890, 3.14159 and -42",
    "unicode: héllo naïve café Straße ΑΒΓ русский 日本語 한국어",
    "emoji 🚀🔥👍🏽 family 👨\u{200d}👩\u{200d}👧",
    "\u{a0}no-break\u{2009}thin\u{3000}ideographic spaces",
    "'s 't 're 've 'm 'll 'd CAPS'S",
    "def f(x):\n    return x**2  # square\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
    "text<|endoftext|>more text",
    "<|im_start| not quite a special token",
    "",
];

/// Runs `infer model export-tokenizer smollm2 DIR` and returns the paths it printed.
fn export(dir: &Path, extra: &[&str]) -> Vec<PathBuf> {
    let dir = dir.to_str().expect("a UTF-8 temp dir");
    let mut args = vec!["model", "export-tokenizer", "smollm2", dir];
    args.extend_from_slice(extra);
    stdout_ok(&run(&args)).lines().map(PathBuf::from).collect()
}

/// The engine's tokenizer of the embedded model, and the model's header.
fn ours() -> (Tokenizer, Header) {
    let path = crate::support::model::smollm2();
    let header = Header::read_file(&path).expect("header");
    (Tokenizer::from_gguf(&header).expect("tokenizer"), header)
}

fn json(dir: &Path, name: &str) -> Value {
    let path = dir.join(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read `{}`: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("`{name}` is not JSON: {e}"))
}

/// Every test text, the chat template's rendering of a conversation, and the prompts of
/// both llama.cpp reference fixtures, with llama.cpp's prompt ids (no BOS) where it has them.
fn cases(ours: &Tokenizer) -> Vec<(String, Option<Vec<u32>>)> {
    let mut cases: Vec<(String, Option<Vec<u32>>)> =
        TEXTS.iter().map(|t| (t.to_string(), None)).collect();
    let template = ours
        .chat_template
        .as_deref()
        .expect("SmolLM2 has a template");
    let messages = [
        ("system", "Answer in one sentence."),
        ("user", "What is 7 × 8? 🤔"),
        ("assistant", "56."),
        ("user", "And  7\t× 9?"),
    ]
    .map(|(role, content)| ChatMessage {
        role: role.into(),
        content: content.into(),
    });
    cases.push((
        render(template, &messages, true, "<|im_start|>", "<|im_end|>").expect("template"),
        None,
    ));
    let shared =
        std::fs::read_to_string(shared_fixture("smollm2_llamacpp_greedy.json")).expect("fixture");
    let more = include_str!("../fixtures/llamacpp_greedy_more.json");
    for fixture in [shared.as_str(), more] {
        let fixture: Value = serde_json::from_str(fixture).expect("JSON");
        for case in fixture["cases"].as_array().expect("cases") {
            let ids = case["prompt_tokens"]
                .as_array()
                .expect("prompt_tokens")
                .iter()
                .map(|id| id.as_u64().expect("an id") as u32)
                .collect();
            let prompt = case["prompt"].as_str().expect("prompt");
            cases.push((prompt.to_string(), Some(ids)));
        }
    }
    cases
}

#[test]
fn the_exported_tokenizer_json_encodes_as_the_engine_and_llama_cpp() {
    let dir = tempfile::tempdir().expect("temp dir");
    let written = export(dir.path(), &[]);
    let names: Vec<&str> = written
        .iter()
        .map(|p| p.file_name().and_then(|n| n.to_str()).expect("a name"))
        .collect();
    assert_eq!(
        names,
        [
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "config.json",
            "generation_config.json"
        ]
    );
    assert!(written.iter().all(|p| p.starts_with(dir.path())));
    let (ours, _) = ours();
    let theirs =
        tokenizers::Tokenizer::from_file(dir.path().join("tokenizer.json")).expect("loads");
    for (text, llama_cpp) in cases(&ours) {
        let ids = theirs.encode(text.as_str(), true).expect("encode");
        let ids = ids.get_ids();
        assert_eq!(ids, ours.encode(&text, true).expect("encode"), "{text:?}");
        assert_eq!(
            theirs
                .encode(text.as_str(), false)
                .expect("encode")
                .get_ids(),
            ours.encode(&text, false).expect("encode"),
            "{text:?}"
        );
        if let Some(llama_cpp) = llama_cpp {
            let without_bos = theirs.encode(text.as_str(), false).expect("encode");
            assert_eq!(without_bos.get_ids(), llama_cpp, "{text:?}");
        }
        assert_eq!(theirs.decode(ids, false).expect("decode"), text);
        assert_eq!(
            theirs.decode(ids, true).expect("decode"),
            ours.decode(ids, true).expect("decode"),
            "{text:?}"
        );
    }
}

#[test]
fn the_exported_json_files_hold_what_transformers_reads() {
    let dir = tempfile::tempdir().expect("temp dir");
    export(dir.path(), &[]);
    let (ours, header) = ours();
    let id_of = |key: &str| header.u64(key).expect("an id");
    let text_of = |id: u64| Value::from(ours.token(id as u32).expect("a token"));
    let context_tokens = header.u64("llama.context_length").expect("context");

    let config = json(dir.path(), "tokenizer_config.json");
    assert_eq!(
        config["chat_template"].as_str(),
        ours.chat_template.as_deref()
    );
    assert_eq!(config["tokenizer_class"], "PreTrainedTokenizerFast");
    assert_eq!(config["clean_up_tokenization_spaces"], false);
    assert_eq!(config["add_bos_token"], ours.add_bos);
    assert_eq!(config["model_max_length"], context_tokens);
    let eos = id_of("tokenizer.ggml.eos_token_id");
    assert_eq!(config["eos_token"], text_of(eos));
    assert!(ours.eos_ids.contains(&(eos as u32)));
    assert_eq!(
        config["bos_token"],
        text_of(id_of("tokenizer.ggml.bos_token_id"))
    );
    // Every special token of the vocabulary, by id, as the tokenizer matches it.
    let decoder = config["added_tokens_decoder"].as_object().expect("a map");
    let im_start = ours.id("<|im_start|>").expect("special token");
    assert_eq!(decoder[&im_start.to_string()]["content"], "<|im_start|>");
    assert_eq!(decoder[&im_start.to_string()]["special"], true);
    let tokenizer_json = json(dir.path(), "tokenizer.json");
    let added = tokenizer_json["added_tokens"]
        .as_array()
        .expect("added_tokens");
    assert_eq!(decoder.len(), added.len());
    for token in added {
        let entry = &decoder[&token["id"].to_string()];
        for flag in [
            "content",
            "lstrip",
            "rstrip",
            "normalized",
            "single_word",
            "special",
        ] {
            assert_eq!(entry[flag], token[flag], "{token}");
        }
    }

    let special = json(dir.path(), "special_tokens_map.json");
    for role in ["bos_token", "eos_token", "unk_token", "pad_token"] {
        assert_eq!(special[role], config[role], "{role}");
    }

    let model = json(dir.path(), "config.json");
    assert_eq!(model["model_type"], "llama");
    assert_eq!(model["architectures"][0], "LlamaForCausalLM");
    assert_eq!(model["num_hidden_layers"], SMOLLM2_LAYERS);
    assert_eq!(model["vocab_size"], ours.vocab_size());
    assert_eq!(model["max_position_embeddings"], context_tokens);
    assert_eq!(
        model["hidden_size"],
        header.u64("llama.embedding_length").expect("width")
    );
    assert_eq!(
        (&model["num_attention_heads"], &model["num_key_value_heads"]),
        (
            &Value::from(header.u64("llama.attention.head_count").expect("heads")),
            &Value::from(
                header
                    .u64("llama.attention.head_count_kv")
                    .expect("kv heads")
            )
        )
    );
    assert_eq!(model["eos_token_id"], eos);

    let generation = json(dir.path(), "generation_config.json");
    match ours.eos_ids.as_slice() {
        [id] => assert_eq!(generation["eos_token_id"], *id),
        ids => assert_eq!(generation["eos_token_id"], Value::from(ids.to_vec())),
    }
}

/// Python's `tokenizers` (built with another regex engine than our crate) reads the same
/// `tokenizer.json` and gives the engine's ids.
#[test]
fn python_tokenizers_encode_the_exported_directory_as_the_engine() {
    let dir = tempfile::tempdir().expect("temp dir");
    export(dir.path(), &[]);
    let (ours, _) = ours();
    let cases = cases(&ours);
    let texts: Vec<&str> = cases.iter().map(|(text, _)| text.as_str()).collect();
    let script = "import json, sys\n\
        from tokenizers import Tokenizer\n\
        tokenizer = Tokenizer.from_file(sys.argv[1])\n\
        texts = json.load(sys.stdin)\n\
        ids = [tokenizer.encode(t, add_special_tokens=True).ids for t in texts]\n\
        decoded = [tokenizer.decode(i, skip_special_tokens=False) for i in ids]\n\
        json.dump({'ids': ids, 'decoded': decoded}, sys.stdout)\n";
    let mut child = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(dir.path().join("tokenizer.json"))
        .env("PYTHONPATH", tokenizers_python_package())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3");
    serde_json::to_writer(child.stdin.take().expect("stdin"), &texts).expect("write texts");
    let output = child.wait_with_output().expect("python3 runs");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let answer: Value = serde_json::from_slice(&output.stdout).expect("JSON");
    for (i, text) in texts.iter().enumerate() {
        let ids: Vec<u32> = answer["ids"][i]
            .as_array()
            .expect("ids")
            .iter()
            .map(|id| id.as_u64().expect("an id") as u32)
            .collect();
        assert_eq!(ids, ours.encode(text, true).expect("encode"), "{text:?}");
        assert_eq!(answer["decoded"][i], *text);
    }
}

#[test]
fn files_in_the_way_are_refused_unless_forced() {
    let dir = tempfile::tempdir().expect("temp dir");
    let kept = dir.path().join("README.md");
    std::fs::write(&kept, "not ours").expect("write");
    export(dir.path(), &[]);
    let config = dir.path().join("config.json");
    std::fs::write(&config, "{}").expect("write");
    let target = dir.path().to_str().expect("UTF-8");
    let output = run(&["model", "export-tokenizer", "smollm2", target]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(output.stdout.is_empty());
    assert!(
        stderr.contains(&format!("`{}`", config.display())),
        "{stderr}"
    );
    assert!(stderr.contains("hint: pass --force"), "{stderr}");
    assert_eq!(std::fs::read_to_string(&config).expect("read"), "{}");

    export(dir.path(), &["--force"]);
    assert_eq!(json(dir.path(), "config.json")["model_type"], "llama");
    assert_eq!(std::fs::read_to_string(&kept).expect("read"), "not ours");
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .expect("list")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    // A directory or a missing file is not a GGUF model: exit 2, saying what to pass.
    for model in [dir.path().to_str().expect("UTF-8"), "no-such-model.gguf"] {
        let output = run(&["model", "export-tokenizer", model, target]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(&format!("`{model}`")), "{stderr}");
        assert!(stderr.contains("hint: pass"), "{stderr}");
    }
}
