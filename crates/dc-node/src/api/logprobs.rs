//! Log-probabilities in OpenAI's two shapes: chat's `logprobs.content` (one entry per token,
//! with its text, bytes and alternatives) and the legacy completions' parallel lists
//! (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).
//!
//! The values are the head's (`dc_types::TokenLogprobs`): the log-softmax of the model's own
//! logits, before temperature and penalties, the same on every peer.

use dc_model::tokenizer::Tokenizer;
use dc_types::TokenLogprobs;
use serde_json::{json, Map, Value};

/// The text of one token on its own (special tokens included; a token holding part of a
/// character shows the replacement character, its `bytes` those of that text).
fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.decode(&[id], false).unwrap_or_default()
}

/// Chat's `logprobs` object for `tokens` (each a token id and its log-probabilities).
pub fn chat(tok: &Tokenizer, tokens: &[(u32, TokenLogprobs)]) -> Value {
    let entry = |id: u32, logprob: f32| {
        let text = token_text(tok, id);
        json!({"token": text, "logprob": logprob, "bytes": text.as_bytes()})
    };
    let content: Vec<Value> = tokens
        .iter()
        .map(|(id, lp)| {
            let mut e = entry(*id, lp.logprob);
            e["top_logprobs"] = lp.top.iter().map(|&(t, l)| entry(t, l)).collect();
            e
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// The completions' `logprobs` object for `tokens`, whose text starts at byte `offset` of the
/// choice's text (moved past them).
pub fn completion(tok: &Tokenizer, tokens: &[(u32, TokenLogprobs)], offset: &mut usize) -> Value {
    let (mut texts, mut values, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    for (id, lp) in tokens {
        let text = token_text(tok, *id);
        offsets.push(*offset);
        *offset += text.len();
        texts.push(text);
        values.push(lp.logprob);
        let top: Map<String, Value> = lp
            .top
            .iter()
            .map(|&(t, l)| (token_text(tok, t), json!(l)))
            .collect();
        tops.push(Value::Object(top));
    }
    json!({
        "tokens": texts,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    })
}
