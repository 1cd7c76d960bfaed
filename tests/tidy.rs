//! Tidy checks over the source tree (after rust-analyzer's `tidy.rs`): every Rust file
//! opens with a `//!` module doc saying what it owns, the source folders ([`SOURCE_ROOTS`])
//! hold no `todo!()` stubs, every document a comment in them cites by a bare name
//! (`ARCHITECTURE.md`) is in the repository, and the integration tests' modules share
//! helpers only through their tree's `support/` (`tests/it/`, `crates/runtime/tests/it/`).

use std::collections::{HashMap, HashSet};
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

/// The source folders of the workspace's two crates: `infer` (`src/`) and `infer-runtime`
/// (`crates/runtime/src/`). `infer` re-exports each module of `infer-runtime` at its root, so
/// a file's path under its folder is its `crate::` path in either crate, and the checks below
/// read both folders as one tree.
const SOURCE_ROOTS: [&str; 2] = ["src", "crates/runtime/src"];

/// The source folder `path` is under, if any.
fn source_root_of(path: &Path) -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    SOURCE_ROOTS
        .iter()
        .map(|dir| root.join(dir))
        .find(|dir| path.starts_with(dir))
}

fn all_files() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in SOURCE_ROOTS
        .into_iter()
        .chain(["tests", "benches", "crates/runtime/tests"])
    {
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
        .filter(|path| source_root_of(path).is_some())
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
/// no source folder names `cudarc::cublas`, nor anything of `cudarc::nvrtc` but its `Ptx`
/// type (which carries a CUBIN to the driver), and cudarc's `cublas` feature is off.
#[test]
fn nvrtc_and_cublas_never_go_through_cudarc() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut offenders = Vec::new();
    for path in all_files()
        .into_iter()
        .filter(|path| source_root_of(path).is_some())
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
    let manifest = fs::read_to_string(root.join("crates/runtime/Cargo.toml")).expect("manifest");
    let cudarc = manifest
        .lines()
        .find(|line| line.starts_with("cudarc"))
        .expect("cudarc is a dependency of the runtime");
    assert!(!cudarc.contains("\"cublas\""), "{cudarc}");
}

#[test]
fn documents_cited_in_src_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut missing = Vec::new();
    for path in all_files()
        .into_iter()
        .filter(|path| source_root_of(path).is_some())
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

/// The layers of `src/` and `crates/runtime/src/`, bottom first: each unit (a folder of
/// `src/`, a folder or file of `runtime/`, or a top-level file) with the units it may import.
/// `rendezvous`, `runtime/*` and the leaves are the crate `infer-runtime`, below the rest. A
/// unit may only name units listed before it, so the list is a DAG by construction;
/// ARCHITECTURE.md draws it.
/// `lib` is the crate root (`ExitStatus`, `run`).
const LAYERS: &[(&str, &[&str])] = &[
    ("topology", &[]),
    ("rendezvous", &[]),
    ("ui", &[]),
    ("plan", &["topology"]),
    ("runtime/formats", &[]),
    ("runtime/libraries", &[]),
    ("runtime/cpu", &["runtime/formats"]),
    ("runtime/collectives", &["rendezvous", "runtime/libraries"]),
    (
        "runtime/model",
        &["runtime/formats", "runtime/cpu", "runtime/collectives"],
    ),
    (
        "runtime/backend",
        &["runtime/formats", "runtime/cpu", "runtime/model"],
    ),
    (
        "runtime/cuda",
        &[
            "runtime/formats",
            "runtime/libraries",
            "runtime/cpu",
            "runtime/collectives",
            "runtime/model",
            "runtime/backend",
        ],
    ),
    (
        "runtime/exec",
        &[
            "rendezvous",
            "runtime/formats",
            "runtime/libraries",
            "runtime/cpu",
            "runtime/collectives",
            "runtime/model",
            "runtime/backend",
            "runtime/cuda",
        ],
    ),
    ("runtime", &[]),
    ("model", &["plan", "runtime/formats", "runtime/model"]),
    ("inventory", &["topology", "plan", "runtime/exec"]),
    ("serving_engines", &["topology", "plan"]),
    ("doctor", &["topology", "plan", "runtime/collectives"]),
    (
        "serve",
        &[
            "rendezvous",
            "ui",
            "runtime/cpu",
            "runtime/model",
            "runtime/exec",
            "runtime/collectives",
        ],
    ),
    (
        "launch",
        &[
            "topology",
            "rendezvous",
            "plan",
            "runtime/formats",
            "runtime/libraries",
            "runtime/cpu",
            "runtime/model",
            "runtime/cuda",
            "runtime/exec",
            "runtime/collectives",
            "model",
            "inventory",
            "serving_engines",
            "doctor",
            "serve",
        ],
    ),
    ("cli", &["runtime/cpu", "runtime/model", "serving_engines"]),
    ("commands", &["*"]),
];

/// Modules every layer may use, which use nothing of the crate but the leaves listed before
/// them (so they form no cycle): the names of the environment variables, the parallel
/// degrees, a run's keys, the handshake keyed by them.
const LEAVES: &[&str] = &["envvars", "degrees", "keyring", "handshake"];

/// The unit a module path (`runtime::cuda::gpu`, without `crate::`) belongs to.
fn unit_of(segments: &[&str]) -> String {
    const RUNTIME_PARTS: [&str; 8] = [
        "backend",
        "collectives",
        "cpu",
        "cuda",
        "exec",
        "formats",
        "libraries",
        "model",
    ];
    match segments {
        ["runtime", part, ..] if RUNTIME_PARTS.contains(part) => format!("runtime/{part}"),
        [first, ..] if LEAVES.contains(first) || LAYERS.iter().any(|(unit, _)| unit == first) => {
            first.to_string()
        }
        // Anything else after `crate::` is an item of the crate root.
        _ => "lib".to_string(),
    }
}

/// The source of `text` without its comments and without its test module (a
/// `#[cfg(test)]` followed by a `mod`, which ends every file that has one).
fn code_of(text: &str) -> String {
    let mut code = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        if line.trim() == "#[cfg(test)]"
            && lines
                .peek()
                .is_some_and(|next| next.trim_start().starts_with("mod "))
        {
            break;
        }
        let line = match line.find("//") {
            Some(at) if !line[..at].contains('"') => &line[..at],
            _ => line,
        };
        code.push_str(line);
        code.push('\n');
    }
    code
}

/// Every path a `use crate::…` names (braces expanded) and every inline `crate::…` path,
/// as module segments after `crate::`.
fn crate_paths(code: &str) -> Vec<Vec<String>> {
    rooted_paths(code, "crate")
}

/// Every path a `use ROOT::…` names (braces expanded) and every inline `ROOT::…` path, as
/// module segments after `ROOT::` (`root` is `crate` or `super`).
fn rooted_paths(code: &str, root: &str) -> Vec<Vec<String>> {
    fn expand(tree: &str, prefix: &str, out: &mut Vec<String>) {
        let tree = tree.trim();
        let Some(open) = tree.find('{') else {
            out.push(format!("{prefix}{tree}"));
            return;
        };
        let head = &tree[..open];
        let inner = tree[open + 1..]
            .strip_suffix('}')
            .unwrap_or(&tree[open + 1..]);
        let (mut depth, mut start) = (0, 0);
        for (at, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    expand(&inner[start..at], &format!("{prefix}{head}"), out);
                    start = at + 1;
                }
                _ => {}
            }
        }
        if !inner[start..].trim().is_empty() {
            expand(&inner[start..], &format!("{prefix}{head}"), out);
        }
    }
    let segments = |path: &str| -> Vec<String> {
        path.split("::")
            .map(|s| s.split_whitespace().next().unwrap_or("").to_string())
            .filter(|s| !s.is_empty())
            .collect()
    };
    let (statement, prefix) = (format!("use {root}::"), format!("{root}::"));
    let mut paths = Vec::new();
    let mut rest = code.to_string();
    // `use crate::…;` statements, which may span lines and nest braces.
    while let Some(at) = rest.find(&statement) {
        let end = rest[at..].find(';').map_or(rest.len(), |e| at + e);
        let mut expanded = Vec::new();
        expand(&rest[at + statement.len()..end], "", &mut expanded);
        paths.extend(expanded.iter().map(|p| segments(p)));
        rest.replace_range(at..end, "");
    }
    // Inline paths: `crate::a::b::Item`.
    for (at, _) in rest.match_indices(&prefix) {
        if rest[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            continue;
        }
        let path: String = rest[at + prefix.len()..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
            .collect();
        paths.push(segments(&path));
    }
    paths
}

/// No unit of the source folders imports a unit its layer does not list ([`LAYERS`]), and the list
/// itself only points down: the folders form a DAG, and `use crate::…` or an inline
/// `crate::…` path that closes a circle fails here.
#[test]
fn the_layers_only_import_downwards() {
    for (at, (unit, allowed)) in LAYERS.iter().enumerate() {
        for dependency in allowed.iter().filter(|d| **d != "*") {
            assert!(
                LAYERS[..at].iter().any(|(u, _)| u == dependency),
                "LAYERS: `{unit}` may import `{dependency}`, which is not listed below it"
            );
        }
    }
    let repository = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut offenders = Vec::new();
    let mut units_seen = std::collections::BTreeSet::new();
    for path in all_files() {
        let Some(src) = source_root_of(&path) else {
            continue;
        };
        let relative = path.strip_prefix(&src).expect("under its source folder");
        let shown = path.strip_prefix(repository).expect("in the repository");
        let mut module: Vec<&str> = relative
            .iter()
            .map(|c| c.to_str().expect("UTF-8 path"))
            .collect();
        let file = module.pop().expect("a file name");
        let stem = file.trim_end_matches(".rs");
        if module.is_empty() && matches!(stem, "lib" | "main") {
            continue;
        }
        if stem != "mod" {
            module.push(stem);
        }
        let unit = unit_of(&module);
        if let Some(position) = LEAVES.iter().position(|leaf| *leaf == unit) {
            let text = fs::read_to_string(&path).expect("readable source");
            for imported in crate_paths(&code_of(&text)) {
                let segments: Vec<&str> = imported.iter().map(String::as_str).collect();
                if LEAVES[..position].contains(&unit_of(&segments).as_str()) {
                    continue;
                }
                offenders.push(format!(
                    "{}: `{unit}` is a leaf but imports `crate::{}`",
                    shown.display(),
                    imported.join("::")
                ));
            }
            continue;
        }
        units_seen.insert(unit.clone());
        let Some((_, allowed)) = LAYERS.iter().find(|(u, _)| *u == unit) else {
            offenders.push(format!(
                "{}: unit `{unit}` is not in LAYERS",
                shown.display()
            ));
            continue;
        };
        let text = fs::read_to_string(&path).expect("readable source");
        for imported in crate_paths(&code_of(&text)) {
            let segments: Vec<&str> = imported.iter().map(String::as_str).collect();
            let target = unit_of(&segments);
            // The crate root serves only the commands; the leaves every layer.
            let root_ok =
                (target == "lib" && unit == "commands") || LEAVES.contains(&target.as_str());
            if target != unit
                && !root_ok
                && !allowed.contains(&"*")
                && !allowed.contains(&target.as_str())
            {
                offenders.push(format!(
                    "{}: `{unit}` imports `crate::{}` of `{target}`",
                    shown.display(),
                    imported.join("::")
                ));
            }
        }
    }
    offenders.sort();
    offenders.dedup();
    assert!(
        offenders.is_empty(),
        "imports against the layers (tests/tidy.rs LAYERS; move the shared piece down \
         instead of adding an edge up):\n{}",
        offenders.join("\n")
    );
    // Every unit listed is a real one, so the list stays the map of the tree.
    for (unit, _) in LAYERS {
        assert!(
            units_seen.contains(*unit),
            "LAYERS lists `{unit}`, which has no file"
        );
    }
}

/// The bottom of the layers is its own crate, `infer-runtime` (`runtime/*`, `rendezvous` and
/// the leaves), so Cargo refuses any import from it up into `infer`; and its manifest names
/// none of the crates of the layers above (command line, TOML, SSH, HTTP, async runtime,
/// NVML), so "the runtime knows nothing of clap, TOML or SSH" is a build fact.
#[test]
fn the_runtime_crate_depends_on_nothing_above_it() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let manifest =
        fs::read_to_string(root.join("crates/runtime/Cargo.toml")).expect("its manifest");
    let mut section = "";
    let mut dependencies = Vec::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line;
        } else if section.contains("dependencies")
            && let Some((name, _)) = line.split_once('=')
        {
            dependencies.push(name.trim().to_string());
        }
    }
    assert!(dependencies.len() > 5, "{dependencies:?}");
    let above = [
        "infer",
        "clap",
        "toml",
        "russh",
        "tokio",
        "axum",
        "hyper",
        "hyper-util",
        "ureq",
        "nvml-wrapper",
        "indicatif",
        "comfy-table",
    ];
    let offenders: Vec<&String> = dependencies
        .iter()
        .filter(|d| above.contains(&d.as_str()))
        .collect();
    assert!(
        offenders.is_empty(),
        "crates/runtime/Cargo.toml depends on crates of the layers above it: {offenders:?}"
    );
}

/// The identifiers `code` names (maximal runs of letters, digits and `_`).
fn identifiers(code: &str) -> HashSet<&str> {
    code.split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .filter(|word| !word.is_empty())
        .collect()
}

/// Whether `name` appears in `code` inside a public signature: a `pub` item's or field's text
/// since the last `;`, `{` or `}` (a `pub fn`'s parameters and return type, a `pub` field's
/// type), or a trait impl's `type X = …`.
fn named_in_a_public_signature(code: &str, name: &str) -> bool {
    let is_ident = |c: char| c.is_alphanumeric() || c == '_';
    code.match_indices(name).any(|(at, _)| {
        let whole_word =
            !code[..at].ends_with(is_ident) && !code[at + name.len()..].starts_with(is_ident);
        let start = code[..at].rfind([';', '{', '}']).map_or(0, |i| i + 1);
        let fragment = code[start..at].trim_start();
        let declares = ["struct ", "enum ", "trait ", "type "]
            .iter()
            .any(|kind| fragment.ends_with(kind));
        whole_word
            && !declares
            && (fragment.starts_with("pub ")
                || fragment.contains("\npub ")
                || fragment.contains(" pub ")
                || fragment.starts_with("type "))
    })
}

/// Dead-code detection for `pub` items: rustc never calls a `pub` item of a library dead, and
/// both crates are libraries (`infer`'s for its binary, tests and benches; `infer-runtime`'s
/// for `infer`). So every `pub` item of the source folders is named outside its own file (by
/// another source file, a test, bench or fuzz target) or, for a type, in a public signature of
/// its own file. Anything else is `pub(crate)` or private, where the compiler reports it when
/// it falls out of use.
#[test]
fn every_public_item_is_used_outside_its_file() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = all_files();
    rust_files(&root.join("fuzz/fuzz_targets"), &mut files);
    let codes: Vec<(PathBuf, String)> = files
        .into_iter()
        .map(|path| {
            let text = fs::read_to_string(&path).expect("readable source");
            let code = code_of(&text);
            (path, code)
        })
        .collect();
    // How many files name each identifier: once per file, counted once for all.
    let per_file: Vec<HashSet<&str>> = codes.iter().map(|(_, code)| identifiers(code)).collect();
    let mut files_naming: HashMap<&str, usize> = HashMap::new();
    for names in &per_file {
        for name in names {
            *files_naming.entry(name).or_default() += 1;
        }
    }
    let mut offenders = Vec::new();
    let mut checked = 0;
    for ((path, code), own) in codes
        .iter()
        .zip(&per_file)
        .filter(|((path, _), _)| source_root_of(path).is_some())
    {
        for line in code.lines() {
            let Some(rest) = line.trim_start().strip_prefix("pub ") else {
                continue;
            };
            let rest = rest.strip_prefix("unsafe ").unwrap_or(rest);
            let rest = rest.strip_prefix("const fn ").unwrap_or(rest);
            let Some((kind, rest)) = [
                "fn ", "struct ", "enum ", "trait ", "type ", "const ", "static ",
            ]
            .into_iter()
            .find_map(|kind| rest.strip_prefix(kind).map(|rest| (kind, rest))) else {
                continue;
            };
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            checked += 1;
            let a_type = matches!(kind, "struct " | "enum " | "trait " | "type ");
            let in_own = usize::from(own.contains(name.as_str()));
            let elsewhere = files_naming.get(name.as_str()).copied().unwrap_or(0) > in_own;
            let used = elsewhere || (a_type && named_in_a_public_signature(code, &name));
            if !used {
                offenders.push(format!(
                    "{}: `pub {kind}{name}`",
                    path.strip_prefix(root).unwrap_or(path).display()
                ));
            }
        }
    }
    assert!(checked > 600, "found too few public items: {checked}");
    assert!(
        offenders.is_empty(),
        "public items named nowhere outside their file (make them \
         pub(crate) or private, so the compiler sees when they fall out of use, or remove them):\n{}",
        offenders.join("\n")
    );
}

/// The parser of the layer test sees what a `use` tree names.
#[test]
fn the_layer_parser_expands_use_trees_and_inline_paths() {
    let code = "use crate::runtime::{cpu::quant::{A, B}, model::kv::KvPool};\n\
                fn f() { let x = crate::plan::Plan::new(); }\n\
                pub use crate::ui::Printer as P;\n";
    let paths: Vec<String> = crate_paths(&code_of(code))
        .into_iter()
        .map(|p| p.join("::"))
        .collect();
    assert_eq!(
        paths,
        [
            "runtime::cpu::quant::A",
            "runtime::cpu::quant::B",
            "runtime::model::kv::KvPool",
            "ui::Printer",
            "plan::Plan::new"
        ]
    );
    assert_eq!(unit_of(&["runtime", "cuda", "gpu"]), "runtime/cuda");
    assert_eq!(unit_of(&["ExitStatus"]), "lib");
    let relative: Vec<String> = rooted_paths(
        "use super::{run, stdout_ok};\nfn f() { super::cluster::TestCluster::start(2, 1); }\n",
        "super",
    )
    .into_iter()
    .map(|p| p.join("::"))
    .collect();
    assert_eq!(
        relative,
        ["run", "stdout_ok", "cluster::TestCluster::start"]
    );
    let without_tests = code_of("use crate::a;\n#[cfg(test)]\nmod tests {\n use crate::b;\n}\n");
    assert!(!without_tests.contains("crate::b"), "{without_tests}");
}

/// The integration tests' modules never import each other: what two of them share lives in
/// their tree's `support/`. In `tests/it/*.rs` and `crates/runtime/tests/it/*.rs` (but
/// `main.rs`), a `crate::X` or `super::X` path (in a `use` tree or inline) whose `X` is another
/// test module of the same tree fails here.
#[test]
fn test_modules_import_only_support() {
    let mut offenders = Vec::new();
    for tree in ["tests/it", "crates/runtime/tests/it"] {
        let it = Path::new(env!("CARGO_MANIFEST_DIR")).join(tree);
        let mut modules = Vec::new();
        let mut files = Vec::new();
        for entry in
            fs::read_dir(&it).unwrap_or_else(|e| panic!("cannot list `{}`: {e}", it.display()))
        {
            let path = entry.expect("directory entry").path();
            let name = path
                .file_stem()
                .and_then(|n| n.to_str())
                .expect("a UTF-8 name")
                .to_string();
            if path.is_dir() {
                modules.push(name);
            } else if path.extension().is_some_and(|e| e == "rs") && name != "main" {
                modules.push(name.clone());
                files.push((name, path));
            }
        }
        modules.retain(|m| m != "support" && m != "snapshots");
        assert!(
            files.len() > 2,
            "found too few test modules in {tree}: {files:?}"
        );
        for (own, path) in &files {
            let text = fs::read_to_string(path).expect("readable source");
            let code = code_of(&text);
            for root in ["crate", "super"] {
                for imported in rooted_paths(&code, root) {
                    let Some(first) = imported.first() else {
                        continue;
                    };
                    if first != own && modules.contains(first) {
                        offenders.push(format!(
                            "{tree}/{own}.rs: `{root}::{}` imports the test module `{first}`",
                            imported.join("::")
                        ));
                    }
                }
            }
        }
    }
    offenders.sort();
    offenders.dedup();
    assert!(
        offenders.is_empty(),
        "test modules importing each other (move what they share to the tree's support/):\n{}",
        offenders.join("\n")
    );
}

/// The launcher→rank contract and every other `INFER_*` variable are named once: no code in
/// the source folders outside `envvars.rs` (the names) and `runtime/exec/rank_env.rs` (the
/// typed contract) spells an `INFER_` name, so every reader and writer goes through a constant.
#[test]
fn infer_variables_are_named_only_in_envvars() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/runtime/src");
    let allowed = [src.join("envvars.rs"), src.join("runtime/exec/rank_env.rs")];
    let mut offenders = Vec::new();
    for path in all_files()
        .into_iter()
        .filter(|p| source_root_of(p).is_some())
    {
        if allowed.contains(&path) {
            continue;
        }
        let text = fs::read_to_string(&path).expect("readable source");
        for (number, line) in code_of(&text).lines().enumerate() {
            let spelled = line.match_indices("INFER_").any(|(at, _)| {
                line[at + "INFER_".len()..]
                    .chars()
                    .next()
                    .is_some_and(|c| c.is_ascii_uppercase())
            });
            if spelled {
                offenders.push(format!(
                    "{}:{}: {}",
                    path.display(),
                    number + 1,
                    line.trim()
                ));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "`INFER_*` names spelled outside envvars.rs (use its constants):\n{}",
        offenders.join("\n")
    );
}
