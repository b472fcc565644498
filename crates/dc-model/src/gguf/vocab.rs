//! A Hugging Face `tokenizer.json` rebuilt from a GGUF file's `tokenizer.ggml.*` metadata.
//!
//! This module owns the mapping from llama.cpp's tokenizer description (token list, token
//! types, merges, pre-tokenizer name) to the JSON the `tokenizers` library reads. The target
//! is Hugging Face's own tokenizer for the model: the pre-tokenizers below are the ones the
//! models' published `tokenizer.json` files use (llama.cpp's `llama-vocab.cpp` implements the
//! same splits by hand). It must never guess: a tokenizer model or pre-tokenizer we do not
//! know is an error, because a silently different tokenisation changes every output.

use std::path::Path;

use serde_json::{json, Map, Value as Json};

use super::GgufFile;
use crate::error::{ModelError, Result};

/// llama.cpp token types (`llama_token_type`) that become Hugging Face added tokens.
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Llama 3's split regex, as in its `tokenizer.json`.
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split regex: Llama 3's with single digits.
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// What a `tokenizer.ggml.pre` value turns into.
struct PreTokenizer {
    normalizer: Json,
    pre_tokenizer: Json,
    /// BPE `ignore_merges`: whole pre-tokens found in the vocabulary are not merged further.
    ignore_merges: bool,
    /// Whether llama.cpp adds BOS for this pre-tokenizer when the file does not say.
    default_add_bos: bool,
}

fn byte_level(use_regex: bool) -> Json {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

fn split_then_bytes(regex: &str) -> Json {
    json!({
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            byte_level(false),
        ]
    })
}

fn pre_tokenizer(g: &GgufFile, pre: Option<&str>) -> Result<PreTokenizer> {
    let plain = |pre_tokenizer| PreTokenizer {
        normalizer: Json::Null,
        pre_tokenizer,
        ignore_merges: false,
        default_add_bos: false,
    };
    Ok(match pre {
        // StarCoder-family vocabularies (SmolLM included): digits one by one, then GPT-2.
        Some("smollm" | "starcoder") => plain(json!({
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level(true),
            ]
        })),
        // GPT-2's own regex, built into the ByteLevel pre-tokenizer. llama.cpp also uses it
        // (with a warning) when a file has no pre-tokenizer name at all.
        None | Some("gpt-2" | "gpt2" | "default") => plain(byte_level(true)),
        Some("llama-bpe" | "llama3" | "llama-v3") => PreTokenizer {
            normalizer: Json::Null,
            pre_tokenizer: split_then_bytes(LLAMA3_REGEX),
            ignore_merges: true,
            default_add_bos: true,
        },
        // Qwen2's published tokenizer.json normalises to NFC before splitting (llama.cpp
        // does not); we follow Hugging Face, the reference our outputs are checked against.
        Some("qwen2" | "deepseek-r1-qwen") => PreTokenizer {
            normalizer: json!({"type": "NFC"}),
            pre_tokenizer: split_then_bytes(QWEN2_REGEX),
            ignore_merges: false,
            default_add_bos: false,
        },
        Some(other) => {
            return Err(ModelError::Unsupported {
                what: "GGUF pre-tokenizer",
                value: format!(
                    "tokenizer.ggml.pre = {other:?} in {} (supported: smollm, starcoder, gpt-2, \
                     llama-bpe/llama3, qwen2)",
                    g.path.display()
                ),
            })
        }
    })
}

/// Builds the `tokenizer.json` text for a `gpt2` (byte-level BPE) vocabulary. The file's
/// parts are read and refused in a fixed order (model, pre-tokenizer, tokens, merges, special
/// tokens), so a malformed file always names the same fault first.
pub(super) fn tokenizer_json(g: &GgufFile) -> Result<String> {
    let path = g.file_path();
    require_byte_level_bpe(g)?;
    let pre = pre_tokenizer(g, g.get_str("tokenizer.ggml.pre")?)?;
    let tokens = g
        .get_str_array("tokenizer.ggml.tokens")?
        .ok_or_else(|| g.missing("tokenizer.ggml.tokens"))?;
    let merges = g
        .get_str_array("tokenizer.ggml.merges")?
        .ok_or_else(|| g.missing("tokenizer.ggml.merges"))?;
    let types = g.get_i64_array("tokenizer.ggml.token_type")?;
    if let Some(t) = &types {
        if t.len() != tokens.len() {
            return Err(ModelError::format(
                path,
                format!(
                    "tokenizer.ggml.token_type has {} entries for {} tokens",
                    t.len(),
                    tokens.len()
                ),
            ));
        }
    }
    let vocab = vocab_ids(path, tokens)?;
    let pairs = merge_pairs(path, merges)?;
    let special = special_tokens(g, tokens, types.as_deref())?;

    let add_bos = g
        .get_bool("tokenizer.ggml.add_bos_token")?
        .unwrap_or(pre.default_add_bos);
    let add_eos = g.get_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    let post_processor = post_processor(
        g,
        tokens,
        add_bos.then_some(special.bos),
        add_eos.then_some(special.eos),
    )?;

    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": special.added,
        "normalizer": pre.normalizer,
        "pre_tokenizer": pre.pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": pre.ignore_merges,
            "vocab": vocab,
            "merges": pairs,
        }
    });
    serde_json::to_string(&tokenizer).map_err(|e| {
        ModelError::Tokenizer(format!(
            "{}: serialising tokenizer.json: {e}",
            path.display()
        ))
    })
}

/// Refuses a vocabulary that is not byte-level BPE (`tokenizer.ggml.model = gpt2`), naming
/// the way out for SentencePiece ones.
fn require_byte_level_bpe(g: &GgufFile) -> Result<()> {
    let model = g.require_str("tokenizer.ggml.model")?;
    if model == "gpt2" {
        return Ok(());
    }
    let detail = if model == "llama" {
        "llama (SentencePiece) vocabularies are not supported yet; use the model's \
         Hugging Face tokenizer.json"
            .to_string()
    } else {
        model.to_string()
    };
    Err(ModelError::Unsupported {
        what: "GGUF tokenizer model",
        value: format!("{detail} (in {})", g.file_path().display()),
    })
}

/// The BPE model's `vocab`: each token to its id. A token listed twice is refused (the second
/// id would silently shadow the first).
fn vocab_ids(path: &Path, tokens: &[String]) -> Result<Map<String, Json>> {
    let mut vocab = Map::with_capacity(tokens.len());
    for (id, tok) in tokens.iter().enumerate() {
        if let Some(prev) = vocab.insert(tok.clone(), json!(id)) {
            return Err(ModelError::format(
                path,
                format!(
                    "token {tok:?} appears twice in tokenizer.ggml.tokens (ids {prev} and {id})"
                ),
            ));
        }
    }
    Ok(vocab)
}

/// The BPE model's `merges` as `[left, right]` pairs from llama.cpp's `"left right"` strings.
fn merge_pairs(path: &Path, merges: &[String]) -> Result<Vec<Json>> {
    let mut pairs = Vec::with_capacity(merges.len());
    for (i, m) in merges.iter().enumerate() {
        // llama.cpp splits at the first space after the first byte, so a merge whose left
        // part is itself a space still parses.
        // A space is one byte and never part of a multi-byte character, so both halves are
        // valid UTF-8.
        let split = m.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1);
        let Some(p) = split else {
            return Err(ModelError::format(
                path,
                format!(
                    "tokenizer.ggml.merges[{i}] = {m:?} is not two tokens separated by a space"
                ),
            ));
        };
        pairs.push(json!([&m[..p], &m[p + 1..]]));
    }
    Ok(pairs)
}

/// The special tokens of a vocabulary: the declared BOS and EOS ids (for the post-processor)
/// and the `added_tokens` entries.
struct SpecialTokens {
    bos: Option<u32>,
    eos: Option<u32>,
    added: Vec<Json>,
}

/// The declared special ids (each refused unless it is a token id) and the tokens matched
/// whole before pre-tokenisation.
fn special_tokens(g: &GgufFile, tokens: &[String], types: Option<&[i64]>) -> Result<SpecialTokens> {
    let special_id = |key: &str| -> Result<Option<u32>> {
        match g.get_u64(key)? {
            None => Ok(None),
            Some(id) if (id as usize) < tokens.len() => Ok(Some(id as u32)),
            Some(id) => Err(ModelError::format(
                g.file_path(),
                format!(
                    "{key} = {id} is not a token id (vocabulary has {} tokens)",
                    tokens.len()
                ),
            )),
        }
    };
    let bos = special_id("tokenizer.ggml.bos_token_id")?;
    let eos = special_id("tokenizer.ggml.eos_token_id")?;
    let unk = special_id("tokenizer.ggml.unknown_token_id")?;
    let pad = special_id("tokenizer.ggml.padding_token_id")?;

    // Control and user-defined tokens are matched whole before pre-tokenisation and are
    // special (skipped by `decode(.., skip_special_tokens = true)`). Files without token
    // types still get their declared special tokens.
    let mut special: Vec<u32> = match types {
        Some(t) => t
            .iter()
            .enumerate()
            .filter(|(_, &ty)| ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED)
            .map(|(id, _)| id as u32)
            .collect(),
        None => [bos, eos, unk, pad].into_iter().flatten().collect(),
    };
    special.sort_unstable();
    special.dedup();
    let added = special
        .iter()
        .map(|&id| {
            json!({
                "id": id,
                "content": tokens[id as usize],
                "single_word": false,
                "lstrip": false,
                "rstrip": false,
                "normalized": false,
                "special": true,
            })
        })
        .collect();
    Ok(SpecialTokens { bos, eos, added })
}

/// `null` when nothing is added, else a TemplateProcessing that adds BOS and/or EOS the way
/// the model's Hugging Face tokenizer does with `add_special_tokens = true`.
///
/// `bos` / `eos` are `Some(id)` when the file asks for the token to be added (the inner
/// `Option` is the declared id, which must then exist).
fn post_processor(
    g: &GgufFile,
    tokens: &[String],
    bos: Option<Option<u32>>,
    eos: Option<Option<u32>>,
) -> Result<Json> {
    let need = |which: Option<Option<u32>>, key: &str| -> Result<Option<(String, u32)>> {
        match which {
            None => Ok(None),
            Some(Some(id)) => Ok(Some((tokens[id as usize].clone(), id))),
            Some(None) => Err(ModelError::Config {
                key: key.to_string(),
                detail: format!(
                    "{} asks to add this token but does not declare it",
                    g.file_path().display()
                ),
            }),
        }
    };
    let bos = need(bos, "tokenizer.ggml.bos_token_id")?;
    let eos = need(eos, "tokenizer.ggml.eos_token_id")?;
    if bos.is_none() && eos.is_none() {
        return Ok(Json::Null);
    }
    let mut single = Vec::new();
    let mut pair = Vec::new();
    let mut specials = Map::new();
    if let Some((tok, id)) = &bos {
        single.push(json!({"SpecialToken": {"id": tok, "type_id": 0}}));
        pair.push(json!({"SpecialToken": {"id": tok, "type_id": 0}}));
        specials.insert(
            tok.clone(),
            json!({"id": tok, "ids": [id], "tokens": [tok]}),
        );
    }
    single.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
    pair.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
    if let Some((tok, _)) = &eos {
        single.push(json!({"SpecialToken": {"id": tok, "type_id": 0}}));
        pair.push(json!({"SpecialToken": {"id": tok, "type_id": 0}}));
    }
    if let Some((tok, _)) = &bos {
        pair.push(json!({"SpecialToken": {"id": tok, "type_id": 1}}));
    }
    pair.push(json!({"Sequence": {"id": "B", "type_id": 1}}));
    if let Some((tok, id)) = &eos {
        pair.push(json!({"SpecialToken": {"id": tok, "type_id": 1}}));
        specials.insert(
            tok.clone(),
            json!({"id": tok, "ids": [id], "tokens": [tok]}),
        );
    }
    Ok(json!({
        "type": "TemplateProcessing",
        "single": single,
        "pair": pair,
        "special_tokens": specials,
    }))
}
