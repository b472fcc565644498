//! The tokenizer wrapper, the streaming decoder and chat templates on small inputs built
//! here: a byte-level BPE vocabulary of single bytes plus a few merges, and templates whose
//! expected output was rendered by Python's jinja2 configured as `transformers` configures it
//! (`ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
//! extensions=[loopcontrols])`, HF's `tojson` and `raise_exception`).

#[path = "support/byte_level.rs"]
mod byte_level;

use std::path::PathBuf;

use byte_level::byte_chars;
use dc_model::tokenizer::{
    load_for_model, ChatMessage, ChatTemplate, StreamDecoder, Tokenizer, STREAM_MAX_PENDING,
};
use dc_model::ModelError;
use serde_json::json;

/// Ids 0..255 are the bytes; 256 "he", 257 "ll", 258 "hell"; 259 `<s>`, 260 `</s>`.
fn tiny_tokenizer_json() -> String {
    let chars = byte_chars();
    let mut vocab = serde_json::Map::new();
    for (b, c) in chars.iter().enumerate() {
        vocab.insert(c.to_string(), json!(b));
    }
    for (i, t) in ["he", "ll", "hell", "<s>", "</s>"].iter().enumerate() {
        vocab.insert(t.to_string(), json!(256 + i));
    }
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(259, "<s>"), special(260, "</s>")],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab,
                  "merges": [["h", "e"], ["l", "l"], ["he", "ll"]]}
    })
    .to_string()
}

fn tiny() -> Tokenizer {
    Tokenizer::from_json(&tiny_tokenizer_json()).expect("test setup")
}

fn scratch_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("dc-model-tok-tests-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("test setup");
    d
}

#[test]
fn encode_decode_and_vocabulary_lookups() {
    let t = tiny();
    assert_eq!(t.vocab_size(), 261);
    assert_eq!(
        t.encode("hello", false).unwrap(),
        vec![258, u32::from(b'o')]
    );
    assert_eq!(t.decode(&[258, 111], false).unwrap(), "hello");
    assert_eq!(t.encode("<s>he", false).unwrap(), vec![259, 256]);
    assert_eq!(t.decode(&[259, 256, 260], true).unwrap(), "he");
    assert_eq!(t.decode(&[259, 256, 260], false).unwrap(), "<s>he</s>");
    assert_eq!(t.token_to_id("hell"), Some(258));
    assert_eq!(t.token_to_id("nope"), None);
    assert_eq!(t.id_to_token(257).unwrap(), "ll");
    assert!(format!("{t:?}").contains("261"));
}

#[test]
fn unknown_ids_are_errors_naming_the_id() {
    let t = tiny();
    for id in [261, 9999, u32::MAX] {
        let e = t.decode(&[1, id], false).unwrap_err();
        assert!(matches!(e, ModelError::Tokenizer(_)));
        assert!(e.to_string().contains(&id.to_string()), "{e}");
        assert!(t
            .id_to_token(id)
            .unwrap_err()
            .to_string()
            .contains(&id.to_string()));
        let mut s = StreamDecoder::new(&t, false);
        assert!(s
            .push(id)
            .unwrap_err()
            .to_string()
            .contains(&id.to_string()));
    }
    assert!(Tokenizer::from_json("{not json").is_err());
    assert!(Tokenizer::from_json("{}").is_err());
}

#[test]
fn stream_decoder_never_splits_a_character_nor_repeats_text() {
    let t = tiny();
    let text = "hello wörld 😀 日本 ok";
    let ids = t.encode(text, false).unwrap();
    let mut s = StreamDecoder::new(&t, false);
    let mut pieces = Vec::new();
    for &id in &ids {
        pieces.push(s.push(id).unwrap());
    }
    pieces.push(s.finish().unwrap());
    assert_eq!(pieces.concat(), text);
    assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
    // 😀 is 4 single-byte tokens: three pushes complete nothing, the fourth emits it.
    let emoji = pieces.iter().position(|p| p.contains('😀')).unwrap();
    assert_eq!(pieces[emoji], "😀");
    assert_eq!(&pieces[emoji - 3..emoji], ["", "", ""]);
    // Nothing is pending after finish; a second finish adds nothing.
    assert_eq!(s.finish().unwrap(), "");
}

#[test]
fn stream_decoder_flushes_unfinished_characters_and_skips_specials() {
    let t = tiny();
    // An unfinished 3-byte character at the end: finish shows the replacement character.
    let mut s = StreamDecoder::new(&t, false);
    assert_eq!(s.push(u32::from(b'a')).unwrap(), "a");
    assert_eq!(s.push(0xE6).unwrap(), "");
    assert_eq!(s.push(0x97).unwrap(), "");
    assert_eq!(s.finish().unwrap(), "\u{FFFD}");

    // Lone continuation bytes never complete: after STREAM_MAX_PENDING tokens they are shown
    // rather than held forever, and nothing is shown twice.
    let mut s = StreamDecoder::new(&t, false);
    let mut out = String::new();
    for _ in 0..STREAM_MAX_PENDING * 3 {
        out.push_str(&s.push(0x80).unwrap());
    }
    assert!(!out.is_empty());
    out.push_str(&s.push(u32::from(b'z')).unwrap());
    out.push_str(&s.finish().unwrap());
    assert!(out.ends_with('z'));
    assert_eq!(out.matches('z').count(), 1);

    // Skipped special tokens produce nothing and do not disturb the text around them.
    let mut s = StreamDecoder::new(&t, true);
    let mut out = String::new();
    for id in [259, 258, 111, 260, 32, 256] {
        out.push_str(&s.push(id).unwrap());
    }
    out.push_str(&s.finish().unwrap());
    assert_eq!(out, "hello he");
}

fn msgs() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("user", "  Hello, wörld  "),
        ChatMessage::new("assistant", "Hi <there> & \"you\"\n"),
    ]
}

fn render(src: &str) -> String {
    ChatTemplate::new(src, Some("<s>".into()), Some("</s>".into()))
        .expect("template compiles")
        .render(&msgs(), true)
        .expect("template renders")
}

#[test]
fn templates_render_like_transformers_jinja2() {
    // Whitespace control: trim_blocks and lstrip_blocks, Python string methods.
    assert_eq!(
        render(
            "{% for m in messages %}\n  {% if m.role == 'user' %}\n    [{{ m.content.strip() }}]\n  {% endif %}\n{% endfor %}\n{{ bos_token }}|{{ eos_token }}"
        ),
        "    [Hello, wörld]\n<s>|</s>"
    );
    // Loop controls, the trim filter, add_generation_prompt.
    assert_eq!(
        render("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m['content'] | trim }};{% endfor %}{% if add_generation_prompt %}GEN{% endif %}"),
        "Hello, wörld;GEN"
    );
    // tojson as json.dumps(ensure_ascii=False): no HTML escaping, Python separators and
    // float repr, message keys in role/content order, indent.
    assert_eq!(
        render("{{ {'a': 1, 'b': [1.5, 'x<y', none, true], 'c': {'é': 1e-05}} | tojson }}\n{{ messages | tojson(indent=2) }}"),
        "{\"a\": 1, \"b\": [1.5, \"x<y\", null, true], \"c\": {\"é\": 1e-05}}\n[\n  {\n    \"role\": \"user\",\n    \"content\": \"  Hello, wörld  \"\n  },\n  {\n    \"role\": \"assistant\",\n    \"content\": \"Hi <there> & \\\"you\\\"\\n\"\n  }\n]"
    );
    // Dict literals keep insertion order, as in Python.
    assert_eq!(
        render("{{ {'z': 1, 'a': 2} | tojson }}"),
        "{\"z\": 1, \"a\": 2}"
    );
    assert_eq!(
        render("{{ {'z': 1, 'a': 2} | tojson(sort_keys=true) }}"),
        "{\"a\": 2, \"z\": 1}"
    );
    // More Python methods and namespace().
    assert_eq!(
        render("{% for m in messages %}{{ m.content.upper() }}/{% if m.content.startswith(' ') %}yes{% endif %}/{{ m.content.split(' ') | length }}/{{ m.items() | list | length }};{% endfor %}"),
        "  HELLO, WÖRLD  /yes/6/2;HI <THERE> & \"YOU\"\n//4/2;"
    );
    assert_eq!(
        render("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + m.content | length %}{% endfor %}{{ ns.n }}{{ messages[1:] | length }}"),
        "351"
    );
    // strftime_now is deliberately absent; templates that test for it fall back.
    assert_eq!(
        render("{% if strftime_now is defined %}{{ strftime_now('%Y') }}{% else %}26 Jul 2024{% endif %}"),
        "26 Jul 2024"
    );
}

#[test]
fn template_errors_are_tokenizer_errors_with_the_message() {
    let e = ChatTemplate::new("{% for x in %}", None, None).unwrap_err();
    assert!(matches!(e, ModelError::Tokenizer(_)), "{e}");
    assert!(e.to_string().contains("chat template"), "{e}");

    let t = ChatTemplate::new(
        "{% if messages[0].role != 'system' %}{{ raise_exception('Conversation must start with a system message') }}{% endif %}ok",
        None,
        None,
    )
    .unwrap();
    let e = t.render(&msgs(), false).unwrap_err();
    assert!(matches!(e, ModelError::Tokenizer(_)), "{e}");
    assert!(
        e.to_string().contains("must start with a system message"),
        "{e}"
    );
    assert_eq!(
        t.render(&[ChatMessage::new("system", "s")], false).unwrap(),
        "ok"
    );

    // A template that would run for hours runs out of fuel instead.
    let t = ChatTemplate::new(
        "{% for i in range(10000) %}{% for j in range(10000) %}{% for k in range(10000) %}{% endfor %}{% endfor %}{% endfor %}",
        None,
        None,
    )
    .unwrap();
    let start = std::time::Instant::now();
    let e = t.render(&msgs(), false).unwrap_err();
    assert!(e.to_string().contains("fuel"), "{e}");
    assert!(start.elapsed().as_secs() < 30);

    // Undefined attributes of undefined values fail as in jinja2.
    let t = ChatTemplate::new("{{ nothing.here }}", None, None).unwrap();
    assert!(t.render(&msgs(), false).is_err());
}

#[test]
fn hf_folders_load_tokenizer_template_and_every_eos() {
    let dir = scratch_dir("hf");
    std::fs::write(dir.join("tokenizer.json"), tiny_tokenizer_json()).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        json!({
            "bos_token": {"content": "<s>", "lstrip": false},
            "eos_token": "</s>",
            "chat_template": [
                {"name": "tool_use", "template": "TOOLS"},
                {"name": "default", "template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"}
            ]
        })
        .to_string(),
    )
    .unwrap();
    std::fs::write(
        dir.join("generation_config.json"),
        json!({"eos_token_id": [260, 258]}).to_string(),
    )
    .unwrap();
    std::fs::write(
        dir.join("config.json"),
        json!({"eos_token_id": 257, "bos_token_id": 259}).to_string(),
    )
    .unwrap();
    let (tok, template, special) = load_for_model(&dir).unwrap();
    assert_eq!(tok.vocab_size(), 261);
    assert_eq!(special.bos, Some(259));
    assert_eq!(special.eos, vec![260, 258, 257]);
    assert_eq!(special.eos_token.as_deref(), Some("</s>"));
    let t = template.unwrap();
    assert_eq!(
        t.render(&[ChatMessage::new("user", "x")], false).unwrap(),
        "<s>x</s>"
    );

    // chat_template.jinja takes precedence over tokenizer_config.json.
    std::fs::write(dir.join("chat_template.jinja"), "J{{ messages | length }}").unwrap();
    let (_, template, _) = load_for_model(&dir).unwrap();
    assert_eq!(template.unwrap().render(&msgs(), false).unwrap(), "J2");

    // An eos id outside the vocabulary is an error naming the file.
    std::fs::write(
        dir.join("generation_config.json"),
        json!({"eos_token_id": 5000}).to_string(),
    )
    .unwrap();
    let e = load_for_model(&dir).unwrap_err().to_string();
    assert!(
        e.contains("generation_config.json") && e.contains("5000"),
        "{e}"
    );

    // A bos_token that is not in the vocabulary is an error naming it.
    std::fs::write(dir.join("generation_config.json"), "{}").unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        json!({"bos_token": "<nope>"}).to_string(),
    )
    .unwrap();
    let e = load_for_model(&dir).unwrap_err().to_string();
    assert!(e.contains("<nope>"), "{e}");

    // Not a model at all.
    let other = dir.join("notes.txt");
    std::fs::write(&other, "hello").unwrap();
    assert!(load_for_model(&other).is_err());
    let empty = scratch_dir("empty");
    assert!(load_for_model(&empty)
        .unwrap_err()
        .to_string()
        .contains("tokenizer.json"));
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&empty);
}
