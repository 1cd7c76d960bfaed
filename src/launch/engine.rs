//! Running other serving engines (vLLM, SGLang, llama.cpp) from the launches `engines/`
//! writes: the scripts of `infer plan --engine E --emit DIR`, and `infer up --engine E`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::engines::{self, EngineLaunch};

/// Writes one executable run script per node into `dir` (created if needed) and
/// `launch.json` (the whole launch), and returns the scripts' paths, head first.
///
/// Errors: the directory or a file cannot be written.
pub fn emit(launch: &EngineLaunch, dir: &Path) -> Result<Vec<PathBuf>> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create the directory `{}`", dir.display()))?;
    let mut written = Vec::with_capacity(launch.nodes.len());
    for node in &launch.nodes {
        let path = dir.join(engines::script_name(node));
        std::fs::write(&path, engines::script(launch, node))
            .with_context(|| format!("cannot write `{}`", path.display()))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
            .with_context(|| format!("cannot make `{}` executable", path.display()))?;
        written.push(path);
    }
    let json = dir.join("launch.json");
    std::fs::write(&json, serde_json::to_vec_pretty(launch)?)
        .with_context(|| format!("cannot write `{}`", json.display()))?;
    Ok(written)
}
