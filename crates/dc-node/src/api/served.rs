//! The served model as the HTTP APIs see it: a narrow view of the node (name, id, shape,
//! tokenizer, chat template, defaults), so that turning a request body into a generation is a
//! pure function of the body and this view, testable and fuzzable without a swarm.

use dc_model::tokenizer::{ChatTemplate, Tokenizer};
use dc_types::ModelId;

use crate::core::Node;

/// What translating a request needs to know of the model this daemon serves: a narrow view
/// of the node, so that the translation is a pure function (and can be fuzzed without a swarm).
#[derive(Debug)]
pub struct Served<'a> {
    /// The model's name as the API lists it ([`model_name`]).
    pub name: String,
    /// The DaisyChain model id.
    pub model_id: ModelId,
    /// The model's positions.
    pub max_positions: usize,
    /// The model's vocabulary size.
    pub vocab_size: usize,
    /// The tokenizer, if the model has one.
    pub tokenizer: Option<&'a Tokenizer>,
    /// The chat template, if the model has one.
    pub chat: Option<&'a ChatTemplate>,
    /// End-of-sequence token ids.
    pub eos: &'a [u32],
    /// Prompt rows per hop (`--chunk`).
    pub chunk: usize,
    /// The share of hops audited.
    pub audit_rate: f32,
    /// Whether its generations guess tokens ahead.
    pub speculative: dc_types::Speculation,
}

impl<'a> Served<'a> {
    /// The view of `node`.
    pub fn of(node: &'a Node) -> Served<'a> {
        Served {
            name: model_name(node),
            model_id: node.model_id,
            max_positions: node.model_cfg.max_positions,
            vocab_size: node.model_cfg.vocab_size,
            tokenizer: node.tokenizer.as_ref(),
            chat: node.chat.as_ref(),
            eos: &node.special.eos,
            chunk: node.cfg.chunk,
            speculative: node.cfg.speculative,
            audit_rate: node.cfg.audit_rate,
        }
    }

    /// Whether `requested` names this model: its name or its DaisyChain model id.
    pub fn is(&self, requested: &str) -> bool {
        requested == self.name || requested.eq_ignore_ascii_case(&self.model_id.to_string())
    }
}

/// The name the API serves the model under: the model file's name without `.gguf` (the
/// folder's name for a Hugging Face folder). It depends on nothing but the path, so it stays
/// the same across restarts, and daemons of one swarm started from the same file agree on it.
pub fn model_name(node: &Node) -> String {
    let name = node
        .cfg
        .model
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    let name = match name.len().checked_sub(".gguf".len()) {
        Some(cut) if name.is_char_boundary(cut) && name[cut..].eq_ignore_ascii_case(".gguf") => {
            &name[..cut]
        }
        _ => name,
    };
    if name.is_empty() {
        format!("dcd-{}", node.model_id.short())
    } else {
        name.to_string()
    }
}
