//! Text a user or a model file hands the daemon: the tokenizer's input, a chat template, the
//! config file (with `DCD_*` variables), a swarm key file and a JSON schema for the output.

use std::collections::BTreeMap;
use std::path::PathBuf;

use dc_model::json_output::JsonState;
use dc_model::json_schema::Schema;
use dc_model::tokenizer::{ChatMessage, ChatTemplate, StreamDecoder};
use dc_net::SwarmKey;
use dcd::config::{resolve, ConfigFile, Flags};

/// Text to encode (with and without special tokens), and the bytes read as token ids to
/// decode, whole and streamed, as the API's answers are.
pub fn tokenizer(data: &[u8]) {
    let (tok, _, _) = crate::smollm2();
    let text = String::from_utf8_lossy(data);
    for special in [false, true] {
        if let Ok(ids) = tok.encode(&text, special) {
            assert!(ids.iter().all(|&t| (t as usize) < tok.vocab_size()));
            let _ = tok.decode(&ids, true);
        }
    }
    // Ids from the bytes, some beyond the vocabulary on purpose.
    let ids: Vec<u32> = data
        .chunks(3)
        .map(|c| {
            u32::from_le_bytes([
                c[0],
                *c.get(1).unwrap_or(&0),
                *c.get(2).unwrap_or(&0) & 1,
                0,
            ])
        })
        .collect();
    let whole = tok.decode(&ids, true);
    let mut stream = StreamDecoder::new(tok, true);
    let mut streamed = String::new();
    let mut failed = false;
    for &id in &ids {
        match stream.push(id) {
            Ok(piece) => streamed.push_str(&piece),
            Err(_) => failed = true,
        }
    }
    if !failed {
        if let Ok(rest) = stream.finish() {
            streamed.push_str(&rest);
            if let Ok(whole) = whole {
                assert_eq!(
                    streamed, whole,
                    "streamed text differs from the whole decode"
                );
            }
        }
    }
}

/// A chat template's source (a model file carries it), rendered over a short conversation.
pub fn chat_template(data: &[u8]) {
    let source = String::from_utf8_lossy(data);
    let Ok(t) = ChatTemplate::new(source, Some("<s>".into()), Some("</s>".into())) else {
        return;
    };
    let conversation = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hello {{ there }}"),
        ChatMessage::new("assistant", "Hi."),
    ];
    let _ = t.render(&conversation, true);
    let _ = t.render(&[], false);
}

/// A config file. After a NUL byte, lines `NAME=value` are the process's `DCD_*` variables.
pub fn config_file(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let (file, env_text) = text.split_once('\0').unwrap_or((&text, ""));
    let env: BTreeMap<String, String> = env_text
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let file = ConfigFile {
        path: PathBuf::from("fuzz.toml"),
        text: file.to_string(),
    };
    let Ok(resolved) = resolve(&Flags::default(), &env, Some(&file)) else {
        return;
    };
    let _ = resolved.warnings();
    let _ = resolved
        .settings
        .node_config(PathBuf::from("model.gguf"), PathBuf::from("data"));
}

/// A swarm key file: read from disk as `--swarm-key` reads it; what parses writes back to the
/// same key.
pub fn swarm_key(data: &[u8]) {
    let path = crate::scratch().join("swarm.key");
    std::fs::write(&path, data).expect("writing the key file");
    let read = SwarmKey::read(&path);
    let Ok(text) = std::str::from_utf8(data) else {
        assert!(read.is_err(), "a key file that is not UTF-8 was read");
        return;
    };
    let parsed = SwarmKey::parse(text);
    // Reading refuses files over 4 KiB before parsing them.
    if data.len() <= 4096 {
        assert_eq!(read.is_ok(), parsed.is_ok(), "reading and parsing disagree");
    }
    if let Ok(key) = parsed {
        let again = SwarmKey::parse(&key.to_file_text()).expect("a written key parses");
        assert_eq!(again.as_bytes(), key.as_bytes());
    }
}

/// A JSON schema a request carries (up to the first NUL byte), then text run through the
/// recogniser it compiles to: every accepted prefix must close, with exactly the closing whose
/// length the budget counts, into a complete document.
pub fn json_schema(data: &[u8]) {
    let (schema, text) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let Ok(schema) = Schema::from_text(&String::from_utf8_lossy(schema)) else {
        return;
    };
    let mut state = JsonState::new();
    for ch in String::from_utf8_lossy(text).chars().take(4096) {
        let mut buf = [0; 4];
        let Some(next) = state.push_all(&schema, ch.encode_utf8(&mut buf).as_bytes()) else {
            continue;
        };
        state = next;
        let closing = state.closing(&schema);
        assert_eq!(closing.len(), state.closing_len(&schema), "{state:?}");
        let closed = state
            .push_all(&schema, &closing)
            .expect("the closing is accepted");
        assert!(closed.is_complete(), "the closing leaves {closed:?}");
        if state.is_complete() {
            break;
        }
    }
}
