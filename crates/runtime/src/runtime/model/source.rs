//! Where a model's weights come from: a file (a GGUF file, or a Hugging Face directory where
//! a single process loads one) or random weights of a given shape ([`super::dummy`], vLLM's
//! `--load-format dummy`). What a launcher hands its ranks and a command hands its engine.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::dummy::DummyModel;
use super::llama::Llama;
use super::tokenizer::Tokenizer;
use crate::runtime::formats::gguf::{GgufFile, Header};

/// A model's weights, by where they come from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ModelSource {
    /// A `.gguf` file or a Hugging Face model directory.
    File(PathBuf),
    /// Random weights generated on the fly, never written to disk.
    Dummy(DummyModel),
}

impl ModelSource {
    /// How it is named in logs and JSON: the path, or `dummy:<name>:<dtype>`.
    pub fn name(&self) -> String {
        match self {
            ModelSource::File(path) => path.display().to_string(),
            ModelSource::Dummy(dummy) => format!("dummy:{}:{}", dummy.name, dummy.dtype.name()),
        }
    }

    /// The file, when the weights come from one.
    pub fn path(&self) -> Option<&Path> {
        match self {
            ModelSource::File(path) => Some(path),
            ModelSource::Dummy(_) => None,
        }
    }

    /// The whole model and its tokenizer (random weights generated on the current rayon
    /// pool).
    ///
    /// Errors: any load error of the model or tokenizer, naming the file.
    pub fn load(&self) -> Result<(Llama, Tokenizer)> {
        match self {
            ModelSource::File(path) if path.is_dir() => Ok((
                crate::runtime::model::safetensors::load_llama(path)?,
                Tokenizer::from_dir(path)?,
            )),
            ModelSource::File(path) => {
                let file = Arc::new(GgufFile::open(path)?);
                let model = Llama::from_gguf(&file)
                    .with_context(|| format!("failed to load `{}`", path.display()))?;
                let tokenizer = Tokenizer::from_gguf(&file.header).with_context(|| {
                    format!("failed to read the tokenizer of `{}`", path.display())
                })?;
                Ok((model, tokenizer))
            }
            ModelSource::Dummy(dummy) => Ok((dummy.build()?, dummy.tokenizer()?)),
        }
    }

    /// Its tokenizer and context in tokens (`None` when a GGUF file gives none), without
    /// loading the weights: a GGUF file's header, or the random model's shape.
    ///
    /// Errors: a header or tokenizer that does not read.
    pub fn tokenizer_and_context(&self) -> Result<(Tokenizer, Option<usize>)> {
        Ok(match self {
            ModelSource::File(path) => {
                let header = Header::read_file(path)?;
                let arch = header.str("general.architecture")?;
                let context = header.u64(&format!("{arch}.context_length")).ok();
                (Tokenizer::from_gguf(&header)?, context.map(|c| c as usize))
            }
            ModelSource::Dummy(dummy) => (dummy.tokenizer()?, Some(dummy.max_context_tokens)),
        })
    }
}
