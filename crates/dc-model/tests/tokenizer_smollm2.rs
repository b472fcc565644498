//! The tokenizer synthesised from the real SmolLM2 GGUF against the Hugging Face oracle: the
//! token ids of the shared fixtures (`text/reference_logits.safetensors`,
//! `expected_generation.json`), the fixture `tokenizer.json` itself, decoding, streaming and
//! the chat template. A missing model is a failure, not a skip.

use std::path::{Path, PathBuf};

use dc_model::gguf::GgufFile;
use dc_model::tokenizer::{load_for_model, ChatMessage, StreamDecoder, Tokenizer};
use serde_json::Value as Json;

fn fixtures() -> PathBuf {
    Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/fixtures"
    ))
    .to_path_buf()
}

fn smollm2_path() -> PathBuf {
    dc_model::store::installed_smollm2().unwrap_or_else(|| {
        panic!(
            "SmolLM2-135M GGUF not installed (looked in {:?}): run scripts/fetch-model.sh",
            dc_model::store::data_dir().ok()
        )
    })
}

fn text_txt() -> String {
    std::fs::read_to_string(fixtures().join("smollm2-135m/text/text.txt"))
        .expect("text.txt")
        .trim()
        .to_string()
}

/// `input_ids` (int64) of the reference perplexity run.
fn reference_ids() -> Vec<u32> {
    let bytes = std::fs::read(fixtures().join("smollm2-135m/text/reference_logits.safetensors"))
        .expect("reference_logits.safetensors");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let t = st.tensor("input_ids").expect("input_ids");
    assert_eq!(t.dtype(), safetensors::Dtype::I64);
    t.data()
        .chunks_exact(8)
        .map(|c| {
            let v = i64::from_le_bytes(c.try_into().expect("8 bytes"));
            u32::try_from(v).expect("token id")
        })
        .collect()
}

fn prompt_cases() -> Vec<(String, Vec<u32>)> {
    let text = std::fs::read_to_string(fixtures().join("smollm2-135m/expected_generation.json"))
        .expect("expected_generation.json");
    let j: Json = serde_json::from_str(&text).expect("valid JSON");
    j["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| {
            let ids = c["prompt_ids"]
                .as_array()
                .expect("prompt_ids")
                .iter()
                .map(|x| x.as_u64().expect("id") as u32)
                .collect();
            (c["prompt"].as_str().expect("prompt").to_string(), ids)
        })
        .collect()
}

fn synthesised() -> Tokenizer {
    let g = GgufFile::open(&smollm2_path()).expect("open SmolLM2");
    Tokenizer::from_json(&g.tokenizer_json().expect("tokenizer.json")).expect("parse")
}

#[test]
fn text_tokenises_to_the_reference_ids() {
    let (tok, _, _) = load_for_model(&smollm2_path()).unwrap();
    let want = reference_ids();
    assert_eq!(want.len(), 295);
    let text = text_txt();
    assert_eq!(tok.encode(&text, false).unwrap(), want);
    // SmolLM2 adds no BOS: `add_special_tokens` changes nothing, as in the fixture.
    assert_eq!(tok.encode(&text, true).unwrap(), want);
    assert_eq!(tok.decode(&want, false).unwrap(), text);
}

#[test]
fn prompts_tokenise_to_the_reference_prompt_ids() {
    let tok = synthesised();
    let cases = prompt_cases();
    assert_eq!(cases.len(), 2);
    for (prompt, ids) in cases {
        assert_eq!(tok.encode(&prompt, true).unwrap(), ids, "{prompt:?}");
        assert_eq!(tok.decode(&ids, true).unwrap(), prompt);
    }
}

/// The synthesised tokenizer.json equals the fixture one ("rebuilt from the GGUF metadata")
/// in every part that tokenises, and both tokenise hard strings identically.
#[test]
fn synthesised_tokenizer_equals_the_fixture_tokenizer() {
    let g = GgufFile::open(&smollm2_path()).unwrap();
    let ours: Json = serde_json::from_str(&g.tokenizer_json().unwrap()).unwrap();
    let fixture_path = fixtures().join("smollm2-135m/tokenizer.json");
    let theirs: Json =
        serde_json::from_str(&std::fs::read_to_string(&fixture_path).unwrap()).unwrap();
    for key in ["added_tokens", "normalizer", "pre_tokenizer", "decoder"] {
        assert_eq!(ours[key], theirs[key], "{key}");
    }
    for key in [
        "type",
        "vocab",
        "merges",
        "ignore_merges",
        "byte_fallback",
        "unk_token",
        "continuing_subword_prefix",
        "end_of_word_suffix",
        "fuse_unk",
    ] {
        assert_eq!(ours["model"][key], theirs["model"][key], "model.{key}");
    }
    // The fixture's post-processor is a TemplateProcessing that adds nothing; ours is null.
    assert_eq!(
        theirs["post_processor"]["special_tokens"],
        serde_json::json!({})
    );
    assert!(ours["post_processor"].is_null());

    let a = synthesised();
    let b = Tokenizer::from_file(&fixture_path).unwrap();
    assert_eq!(a.vocab_size(), 49152);
    assert_eq!(a.vocab_size(), b.vocab_size());
    let hard = [
        "Hello world! 123",
        "12345678901234567890",
        "3.14159 and 2,718 and ١٢٣ (Arabic digits)",
        "Café déjà vu — naïve façade",
        "  multiple   spaces\n\n\ttabs\r\nand CRLF",
        "emoji 😀👍🏽 and CJK 日本語のテキスト, 한국어",
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
        "fn main() { println!(\"{}\", x.len()); } // code",
        "don't won't I'm you're we've they'll he'd",
        "",
        " ",
        "\u{0}\u{1}\u{7f}",
    ];
    for s in hard {
        for special in [false, true] {
            let ia = a.encode(s, special).unwrap();
            assert_eq!(ia, b.encode(s, special).unwrap(), "{s:?}");
            for skip in [false, true] {
                assert_eq!(a.decode(&ia, skip).unwrap(), b.decode(&ia, skip).unwrap());
            }
        }
        assert_eq!(a.decode(&a.encode(s, false).unwrap(), false).unwrap(), s);
    }
    // Special tokens are single ids and can be skipped.
    let ids = a.encode("<|im_start|>user<|im_end|>", false).unwrap();
    assert_eq!(ids.first(), Some(&1));
    assert_eq!(ids.last(), Some(&2));
    assert_eq!(a.decode(&ids, true).unwrap(), "user");
}

#[test]
fn streaming_the_reference_text_reproduces_it() {
    let tok = synthesised();
    let text = format!("{} Ünïcödé: 日本語 😀👍🏽.", text_txt());
    let ids = tok.encode(&text, false).unwrap();
    let mut s = StreamDecoder::new(&tok, false);
    let mut out = String::new();
    let mut held = 0;
    for &id in &ids {
        let piece = s.push(id).unwrap();
        assert!(
            !piece.contains('\u{FFFD}'),
            "half a character emitted: {piece:?}"
        );
        if piece.is_empty() {
            held += 1;
        }
        out.push_str(&piece);
    }
    out.push_str(&s.finish().unwrap());
    assert_eq!(out, text);
    assert!(held > 0, "some multi-byte characters span several tokens");
}

#[test]
fn chat_template_renders_a_conversation() {
    let (tok, template, special) = load_for_model(&smollm2_path()).unwrap();
    let template = template.expect("SmolLM2 carries a chat template");
    assert_eq!(special.bos, Some(1));
    assert_eq!(special.eos, vec![2]);
    assert_eq!(special.bos_token.as_deref(), Some("<|im_start|>"));
    assert_eq!(special.eos_token.as_deref(), Some("<|im_end|>"));
    assert!(special.is_eos(2) && !special.is_eos(1));

    let rendered = template
        .render(&[ChatMessage::new("user", "What is 2+2?")], true)
        .unwrap();
    assert_eq!(
        rendered,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging \
         Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    );
    let convo = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hi"),
        ChatMessage::new("assistant", "Hello!"),
        ChatMessage::new("user", "Bye"),
    ];
    let rendered = template.render(&convo, false).unwrap();
    assert_eq!(
        rendered,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
    );
    let ids = tok.encode(&rendered, false).unwrap();
    assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 4);
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 4);
    assert_eq!(tok.decode(&ids, false).unwrap(), rendered);
}

#[test]
fn the_fixture_hf_folder_loads_too() {
    let (tok, template, special) = load_for_model(&fixtures().join("smollm2-135m")).unwrap();
    assert_eq!(tok.vocab_size(), 49152);
    assert!(
        template.is_none(),
        "the fixture's tokenizer_config.json has no template"
    );
    assert_eq!(special.bos, Some(1));
    assert_eq!(special.eos, vec![2]);
    assert_eq!(tok.encode(&text_txt(), true).unwrap(), reference_ids());
}
