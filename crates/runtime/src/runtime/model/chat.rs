//! Chat templates: the model's Jinja template (`tokenizer.chat_template` in GGUF, or
//! `tokenizer_config.json`) rendered with minijinja and Python-compatible string methods.

use anyhow::{Result, anyhow};
use serde::{Deserialize, Serialize};

use super::tokenizer::Tokenizer;

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    pub content: String,
}

/// Renders `messages` through `tokenizer`'s chat template with the assistant's turn
/// opening, its BOS and first EOS token as `bos_token`/`eos_token`; `None` when the model
/// has no chat template. Errors: a template that does not parse or raises.
pub fn render_for(tokenizer: &Tokenizer, messages: &[ChatMessage]) -> Result<Option<String>> {
    let Some(template) = tokenizer.chat_template.as_deref() else {
        return Ok(None);
    };
    let token_text = |id: Option<u32>| id.and_then(|i| tokenizer.token(i)).unwrap_or_default();
    render(
        template,
        messages,
        true,
        &token_text(tokenizer.bos_id),
        &token_text(tokenizer.eos_ids.first().copied()),
    )
    .map(Some)
}

/// Renders `messages` through `template`, ending with the assistant's turn opening when
/// `add_generation_prompt`. Errors: a template that does not parse or raises.
pub fn render(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String> {
    let mut env = minijinja::Environment::new();
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |message: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                message,
            ))
        },
    );
    env.add_template("chat", template)
        .map_err(|e| anyhow!("the model's chat template does not parse: {e}"))?;
    let rendered = env
        .get_template("chat")
        .and_then(|t| {
            t.render(minijinja::context! {
                messages => minijinja::Value::from(minijinja::value::Serde(messages)),
                add_generation_prompt => add_generation_prompt,
                bos_token => bos_token,
                eos_token => eos_token,
            })
        })
        .map_err(|e| anyhow!("the model's chat template failed: {e}"))?;
    Ok(rendered)
}
