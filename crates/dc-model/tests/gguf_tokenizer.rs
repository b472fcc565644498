//! `tokenizer.json` synthesis from `tokenizer.ggml.*` metadata on small vocabularies written by
//! test code: each supported pre-tokenizer's distinguishing behaviour, BOS handling, special
//! tokens, and refusal of what we cannot build.

#[path = "support/byte_level.rs"]
mod byte_level;
#[path = "gguf_writer.rs"]
mod gguf_writer;

use dc_model::gguf::GgufFile;
use dc_model::tokenizer::{load_for_model, ChatMessage, Tokenizer};
use dc_model::ModelError;
use gguf_writer::{f32_bytes, llama_meta, s, str_arr, ty, write_file, Gguf, Val};

const EXTRA: [&str; 8] = ["12", "123", "Ġw", "Ġwo", "Ġwor", "<bos>", "<eos>", "<tool>"];
const BOS: u32 = 261;
const EOS: u32 = 262;
const TOOL: u32 = 263;

/// Tokens: 256 bytes, "12", "123", "Ġw", "Ġwo", "Ġwor", then `<bos>` `<eos>` (control) and
/// `<tool>` (user-defined).
fn vocab_meta(g: Gguf, pre: Option<&str>) -> Gguf {
    let mut tokens: Vec<String> = byte_level::byte_chars()
        .iter()
        .map(char::to_string)
        .collect();
    tokens.extend(EXTRA.iter().map(|x| x.to_string()));
    let refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
    let mut types = vec![Val::I32(1); 256 + 5];
    types.extend([Val::I32(3), Val::I32(3), Val::I32(4)]);
    let mut g = g
        .kv("tokenizer.ggml.model", s("gpt2"))
        .kv("tokenizer.ggml.tokens", str_arr(&refs))
        .kv("tokenizer.ggml.token_type", Val::Arr(5, types))
        .kv(
            "tokenizer.ggml.merges",
            str_arr(&["1 2", "12 3", "Ġ w", "Ġw o", "Ġwo r"]),
        )
        .kv("tokenizer.ggml.bos_token_id", Val::U32(BOS))
        .kv("tokenizer.ggml.eos_token_id", Val::U32(EOS))
        .kv(
            "tokenizer.chat_template",
            s("{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"),
        );
    if let Some(p) = pre {
        g = g.kv("tokenizer.ggml.pre", s(p));
    }
    g
}

fn model(pre: Option<&str>, extra: &[(&str, Val)]) -> std::path::PathBuf {
    let mut g = vocab_meta(llama_meta(Gguf::default(), 1), pre);
    for (k, v) in extra {
        g = g.kv(k, v.clone());
    }
    let g = g.tensor(
        "blk.0.attn_norm.weight",
        &[8],
        ty::F32,
        f32_bytes(&[1.0; 8]),
    );
    write_file("tok", &g.build())
}

fn tokenizer(pre: Option<&str>, extra: &[(&str, Val)]) -> Tokenizer {
    let g = GgufFile::open(&model(pre, extra)).expect("test setup");
    Tokenizer::from_json(&g.tokenizer_json().expect("test setup")).expect("test helper")
}

fn b(c: char) -> u32 {
    c as u32
}

#[test]
fn gpt2_pre_tokenizer_merges_digits_and_words() {
    for pre in [None, Some("gpt-2")] {
        let t = tokenizer(pre, &[]);
        assert_eq!(t.vocab_size(), 264);
        // GPT-2 keeps digit runs together, so "123" merges; " wor" merges to one token.
        assert_eq!(
            t.encode("123 world", false).unwrap(),
            vec![257, 260, b('l'), b('d')]
        );
        assert_eq!(
            t.encode("123 world", true).unwrap(),
            vec![257, 260, b('l'), b('d')]
        );
        assert_eq!(t.decode(&[257, 260, 108, 100], false).unwrap(), "123 world");
    }
}

#[test]
fn smollm_pre_tokenizer_splits_digits_one_by_one() {
    let t = tokenizer(Some("smollm"), &[]);
    assert_eq!(
        t.encode("123 world", false).unwrap(),
        vec![b('1'), b('2'), b('3'), 260, b('l'), b('d')]
    );
}

#[test]
fn llama3_pre_tokenizer_groups_three_digits_and_adds_bos() {
    let t = tokenizer(Some("llama-bpe"), &[]);
    // \p{N}{1,3}: "12345" is "123" + "45"; BOS added by default for llama3 vocabularies.
    assert_eq!(t.encode("12345", false).unwrap(), vec![257, b('4'), b('5')]);
    assert_eq!(
        t.encode("12345", true).unwrap(),
        vec![BOS, 257, b('4'), b('5')]
    );
    let t = tokenizer(
        Some("llama3"),
        &[("tokenizer.ggml.add_bos_token", Val::Bool(false))],
    );
    assert_eq!(t.encode("12345", true).unwrap(), vec![257, b('4'), b('5')]);
    // The file can ask for EOS too.
    let t = tokenizer(
        Some("gpt-2"),
        &[("tokenizer.ggml.add_eos_token", Val::Bool(true))],
    );
    assert_eq!(t.encode("12", true).unwrap(), vec![256, EOS]);
}

#[test]
fn qwen2_pre_tokenizer_normalises_to_nfc_and_splits_digits() {
    let t = tokenizer(Some("qwen2"), &[]);
    assert_eq!(
        t.encode("123", false).unwrap(),
        vec![b('1'), b('2'), b('3')]
    );
    let composed = t.encode("é", false).unwrap();
    assert_eq!(t.encode("e\u{301}", false).unwrap(), composed);
    assert_eq!(composed, vec![0xC3, 0xA9]);
}

#[test]
fn control_and_user_defined_tokens_are_special() {
    let t = tokenizer(Some("gpt-2"), &[]);
    let ids = t.encode("<bos>12<tool><eos>", false).unwrap();
    assert_eq!(ids, vec![BOS, 256, TOOL, EOS]);
    assert_eq!(t.decode(&ids, true).unwrap(), "12");
    assert_eq!(t.decode(&ids, false).unwrap(), "<bos>12<tool><eos>");
}

#[test]
fn load_for_model_reads_a_gguf_file() {
    let p = model(
        Some("gpt-2"),
        &[("tokenizer.ggml.eot_token_id", Val::U32(TOOL))],
    );
    let (t, template, special) = load_for_model(&p).unwrap();
    assert_eq!(t.vocab_size(), 264);
    assert_eq!(special.bos, Some(BOS));
    assert_eq!(special.eos, vec![EOS, TOOL]);
    assert_eq!(special.bos_token.as_deref(), Some("<bos>"));
    assert_eq!(special.eos_token.as_deref(), Some("<eos>"));
    let out = template
        .unwrap()
        .render(&[ChatMessage::new("user", "hi")], false)
        .unwrap();
    assert_eq!(out, "<bos>hi<eos>");
}

fn synth_err(g: Gguf) -> ModelError {
    let g = g.tensor(
        "blk.0.attn_norm.weight",
        &[8],
        ty::F32,
        f32_bytes(&[1.0; 8]),
    );
    let f = GgufFile::open(&write_file("tok-bad", &g.build())).expect("test setup");
    f.tokenizer_json()
        .expect_err("the metadata cannot make a tokenizer")
}

#[test]
fn what_cannot_be_built_is_refused_by_name() {
    let base = || llama_meta(Gguf::default(), 1);

    let e = synth_err(vocab_meta(base(), Some("deepseek-llm")));
    assert!(matches!(e, ModelError::Unsupported { .. }), "{e}");
    assert!(e.to_string().contains("deepseek-llm"), "{e}");

    let mut g = vocab_meta(base(), Some("gpt-2"));
    g.kv.iter_mut()
        .find(|(k, _)| k == "tokenizer.ggml.model")
        .unwrap()
        .1 = s("llama");
    let e = synth_err(g);
    assert!(matches!(e, ModelError::Unsupported { .. }), "{e}");
    assert!(e.to_string().contains("SentencePiece"), "{e}");

    let mut g = vocab_meta(base(), Some("gpt-2"));
    g.kv.iter_mut()
        .find(|(k, _)| k == "tokenizer.ggml.merges")
        .unwrap()
        .1 = str_arr(&["1 2", "nospace"]);
    let e = synth_err(g).to_string();
    assert!(e.contains("merges[1]") && e.contains("nospace"), "{e}");

    let mut g = vocab_meta(base(), Some("gpt-2"));
    g.kv.iter_mut()
        .find(|(k, _)| k == "tokenizer.ggml.tokens")
        .unwrap()
        .1 = str_arr(&["a", "b", "a"]);
    g.kv.retain(|(k, _)| {
        k != "tokenizer.ggml.token_type"
            && k != "tokenizer.ggml.bos_token_id"
            && k != "tokenizer.ggml.eos_token_id"
    });
    let e = synth_err(g).to_string();
    assert!(
        e.contains("\"a\" appears twice") && e.contains("ids 0 and 2"),
        "{e}"
    );

    let mut g = vocab_meta(base(), Some("gpt-2"));
    g.kv.iter_mut()
        .find(|(k, _)| k == "tokenizer.ggml.token_type")
        .unwrap()
        .1 = Val::Arr(5, vec![Val::I32(1); 3]);
    let e = synth_err(g).to_string();
    assert!(e.contains("token_type has 3 entries for 264 tokens"), "{e}");

    let mut g = vocab_meta(base(), Some("gpt-2"));
    g.kv.iter_mut()
        .find(|(k, _)| k == "tokenizer.ggml.bos_token_id")
        .unwrap()
        .1 = Val::U32(5000);
    let e = synth_err(g).to_string();
    assert!(e.contains("bos_token_id = 5000"), "{e}");

    let mut g = vocab_meta(base(), Some("gpt-2"));
    g.kv.retain(|(k, _)| k != "tokenizer.ggml.merges");
    let e = synth_err(g).to_string();
    assert!(e.contains("tokenizer.ggml.merges"), "{e}");

    let mut g = vocab_meta(base(), Some("gpt-2"));
    g.kv.iter_mut()
        .find(|(k, _)| k == "tokenizer.ggml.tokens")
        .unwrap()
        .1 = Val::Arr(4, vec![Val::U32(1)]);
    let e = synth_err(g);
    assert!(matches!(e, ModelError::Format { .. }), "{e}");
    assert!(e.to_string().contains("tokenizer.ggml.tokens"), "{e}");
}
