//! Text in and out of the model: the tokenizer, streaming detokenisation and chat templates.
//!
//! This module owns turning text into token ids and back for the rest of the daemon. It wraps
//! Hugging Face's `tokenizers` (so a model's own `tokenizer.json` gives the ids its
//! `transformers` tokenizer gives), renders chat templates with minijinja configured like
//! `transformers` configures jinja2, and finds a model's special tokens. For a GGUF file the
//! `tokenizer.json` is synthesised from the metadata ([`crate::gguf::GgufFile::tokenizer_json`]).
//!
//! It must never panic on what a peer or a model file hands it: unknown token ids are errors
//! naming the id, and chat templates (code taken from a model file) run with a bounded amount
//! of fuel.

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use minijinja::value::{Enumerator, Kwargs, Object, ObjectRepr, Value, ValueKind};
use minijinja::{Environment, Error as JinjaError, ErrorKind as JinjaErrorKind};
use serde_json::Value as Json;

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;

/// Template instructions one chat rendering may execute. A real template spends a few dozen
/// per message; this allows conversations of many thousands of messages while stopping a
/// template that loops (a model file is untrusted input) within about a second.
pub const CHAT_TEMPLATE_FUEL: u64 = 20_000_000;

/// Tokens a [`StreamDecoder`] holds back waiting for a character to complete before it emits
/// what it has anyway. A UTF-8 character is at most 4 bytes, so 4 byte-level tokens always
/// suffice; the margin covers special tokens skipped in between.
pub const STREAM_MAX_PENDING: usize = 16;

/// A tokenizer: a Hugging Face `tokenizers::Tokenizer`, cheap to clone.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

impl Tokenizer {
    /// Reads a Hugging Face `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Tokenizer> {
        let json = fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        Tokenizer::from_json(&json)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {}", path.display(), strip_prefix(e))))
    }

    /// Parses the text of a Hugging Face `tokenizer.json`.
    pub fn from_json(json: &str) -> Result<Tokenizer> {
        let inner = json
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| ModelError::Tokenizer(format!("invalid tokenizer.json: {e}")))?;
        Ok(Tokenizer {
            inner: Arc::new(inner),
        })
    }

    /// Token ids of `text`. `add_special_tokens` applies the tokenizer's post-processor (for
    /// example a BOS token), as `transformers` does by default.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, add_special_tokens).map_err(|e| {
            ModelError::Tokenizer(format!("encoding {} bytes of text: {e}", text.len()))
        })?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`. Every id must be in the vocabulary (the library would silently drop
    /// unknown ones; for us an unknown id is a bug or a hostile peer).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.check_ids(ids)?;
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| ModelError::Tokenizer(format!("decoding {} tokens: {e}", ids.len())))
    }

    fn check_ids(&self, ids: &[u32]) -> Result<()> {
        for &id in ids {
            if self.inner.id_to_token(id).is_none() {
                return Err(self.unknown_id(id));
            }
        }
        Ok(())
    }

    fn unknown_id(&self, id: u32) -> ModelError {
        ModelError::Tokenizer(format!(
            "token id {id} is not in the vocabulary ({} tokens)",
            self.vocab_size()
        ))
    }

    /// Number of tokens, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token's text (as it appears in the vocabulary), if it has one.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The vocabulary text of token `id`.
    pub fn id_to_token(&self, id: u32) -> Result<String> {
        self.inner
            .id_to_token(id)
            .ok_or_else(|| self.unknown_id(id))
    }

    /// The wrapped `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// The `tokenizers` error type prints the file name again; keep the message short.
fn strip_prefix(e: ModelError) -> String {
    match e {
        ModelError::Tokenizer(s) => s,
        other => other.to_string(),
    }
}

/// Turns generated token ids into text as they arrive.
///
/// Byte-level BPE splits multi-byte characters across tokens, and some decoders change a
/// token's text depending on its neighbours, so a token cannot be decoded alone. The decoder
/// keeps a small window: the tokens of the last emitted piece (for context) and those not yet
/// emitted. Each push decodes the window; when the text grew and does not end in U+FFFD (an
/// incomplete character), the new part is emitted and the window moves on. Text is never
/// emitted twice and never cut inside a character, except that after
/// [`STREAM_MAX_PENDING`] tokens without a complete character the replacement characters are
/// emitted as they are (as `decode` of the whole sequence would show them) and the decoder
/// starts afresh.
#[derive(Debug, Clone)]
pub struct StreamDecoder {
    tokenizer: Tokenizer,
    skip_special_tokens: bool,
    /// The window: `ids[..prefix_len]` were already emitted, the rest are pending.
    ids: Vec<u32>,
    prefix_len: usize,
    /// Text of `ids[..prefix_len]`, as decoded on its own.
    prefix: String,
}

impl StreamDecoder {
    /// A decoder with nothing pushed yet.
    pub fn new(tokenizer: &Tokenizer, skip_special_tokens: bool) -> StreamDecoder {
        StreamDecoder {
            tokenizer: tokenizer.clone(),
            skip_special_tokens,
            ids: Vec::new(),
            prefix_len: 0,
            prefix: String::new(),
        }
    }

    /// Adds one token; returns the text it completes (often empty, never a partial character).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.tokenizer.check_ids(&[id])?;
        self.ids.push(id);
        let text = self.tokenizer.decode(&self.ids, self.skip_special_tokens)?;
        let pending = self.ids.len() - self.prefix_len;
        let complete = text.len() > self.prefix.len() && !text.ends_with('\u{FFFD}');
        if complete {
            self.emit(text)
        } else if pending >= STREAM_MAX_PENDING {
            // Give up waiting: show the replacement characters and start afresh, so bytes that
            // might still complete them are not decoded against text already shown.
            let out = self.new_part(&text)?;
            self.reset();
            Ok(out)
        } else {
            Ok(String::new())
        }
    }

    fn reset(&mut self) {
        self.ids.clear();
        self.prefix_len = 0;
        self.prefix.clear();
    }

    /// Emits whatever is pending (with U+FFFD for an unfinished character) and resets.
    pub fn finish(&mut self) -> Result<String> {
        if self.ids.len() == self.prefix_len {
            return Ok(String::new());
        }
        let text = self.tokenizer.decode(&self.ids, self.skip_special_tokens)?;
        let out = self.new_part(&text)?;
        self.reset();
        Ok(out)
    }

    fn new_part(&self, text: &str) -> Result<String> {
        text.strip_prefix(self.prefix.as_str())
            .map(str::to_string)
            .ok_or_else(|| {
                ModelError::Tokenizer(format!(
                    "stream decoding: the decoder rewrote already emitted text {:?} as {:?}",
                    self.prefix, text
                ))
            })
    }

    fn emit(&mut self, text: String) -> Result<String> {
        let out = self.new_part(&text)?;
        // The tokens just emitted become the context for the next ones.
        self.ids.drain(..self.prefix_len);
        self.prefix_len = self.ids.len();
        self.prefix = self.tokenizer.decode(&self.ids, self.skip_special_tokens)?;
        Ok(out)
    }
}

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, …
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message with `role` and `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A message as the template sees it: a map with keys in the order Python would show them.
#[derive(Debug)]
struct MessageObject(ChatMessage);

impl Object for MessageObject {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        match key.as_str()? {
            "role" => Some(Value::from(self.0.role.clone())),
            "content" => Some(Value::from(self.0.content.clone())),
            _ => None,
        }
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Str(&["role", "content"])
    }
}

/// A Jinja chat template, rendered the way `transformers` renders it (`trim_blocks`,
/// `lstrip_blocks`, loop controls, `raise_exception`, a Python-compatible `tojson`, Python
/// string and dict methods).
///
/// `strftime_now` is deliberately not provided: its output depends on the clock, and two
/// peers must render the same prompt to the same tokens. Templates that test
/// `strftime_now is defined` fall back to their fixed date.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_bytes", &self.source.len())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

const TEMPLATE_NAME: &str = "chat_template";

fn jinja_error(e: &JinjaError) -> ModelError {
    let mut msg = format!("chat template: {e}");
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        msg.push_str(&format!(": {s}"));
        src = s.source();
    }
    ModelError::Tokenizer(msg)
}

impl ChatTemplate {
    /// Compiles `source`. `bos_token` / `eos_token` are the texts the template sees under
    /// those names (empty when the model has none).
    pub fn new(
        source: impl Into<String>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<ChatTemplate> {
        let source = source.into();
        let mut env = Environment::new();
        let syntax = env
            .syntax()
            .to_builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| jinja_error(&e))?;
        env.set_syntax(syntax);
        env.set_fuel(Some(CHAT_TEMPLATE_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(|e| jinja_error(&e))?;
        Ok(ChatTemplate {
            env,
            source,
            bos_token: bos_token.unwrap_or_default(),
            eos_token: eos_token.unwrap_or_default(),
        })
    }

    /// The template's source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders a conversation. With `add_generation_prompt` the template appends what starts
    /// the assistant's turn.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| jinja_error(&e))?;
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| Value::from_object(MessageObject(m.clone())))
            .collect();
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone(),
            eos_token => self.eos_token.clone(),
        };
        tmpl.render(ctx).map_err(|e| jinja_error(&e))
    }
}

/// `raise_exception(message)`: HF templates call it to refuse a conversation.
fn raise_exception(message: String) -> std::result::Result<Value, JinjaError> {
    Err(JinjaError::new(JinjaErrorKind::InvalidOperation, message))
}

/// `tojson` as `transformers` defines it for chat templates: Python's
/// `json.dumps(x, ensure_ascii=False, indent=indent, sort_keys=sort_keys)` (minijinja's own
/// filter escapes HTML characters, which would change the prompt).
fn tojson(
    value: &Value,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> std::result::Result<Value, JinjaError> {
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(usize::try_from(v)?),
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    let mut out = String::new();
    let style = JsonStyle {
        indent,
        sort_keys,
        ensure_ascii,
    };
    write_py_json(&mut out, value, &style, 0, 0)?;
    Ok(Value::from_safe_string(out))
}

struct JsonStyle {
    indent: Option<usize>,
    sort_keys: bool,
    ensure_ascii: bool,
}

/// Deepest nesting `tojson` follows (Python would hit its recursion limit near 1000).
const MAX_JSON_DEPTH: usize = 256;

fn write_py_json(
    out: &mut String,
    v: &Value,
    style: &JsonStyle,
    level: usize,
    depth: usize,
) -> std::result::Result<(), JinjaError> {
    if depth > MAX_JSON_DEPTH {
        return Err(JinjaError::new(
            JinjaErrorKind::InvalidOperation,
            "tojson: value nested too deeply",
        ));
    }
    let (item_sep, key_sep) = if style.indent.is_some() {
        (",", ": ")
    } else {
        (", ", ": ")
    };
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = style.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number if v.is_integer() => {
            out.push_str(&i128::try_from(v.clone())?.to_string())
        }
        ValueKind::Number => out.push_str(&py_float_repr(f64::try_from(v.clone())?)),
        ValueKind::String => write_py_str(out, v.as_str().unwrap_or_default(), style.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                write_py_json(out, item, style, level + 1, depth + 1)?;
            }
            newline(out, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in v.try_iter()? {
                let val = v.get_item(&key)?;
                let key = match key.kind() {
                    ValueKind::String => key.as_str().unwrap_or_default().to_string(),
                    ValueKind::None => "null".to_string(),
                    ValueKind::Bool => if key.is_true() { "true" } else { "false" }.to_string(),
                    ValueKind::Number if key.is_integer() => {
                        i128::try_from(key.clone())?.to_string()
                    }
                    ValueKind::Number => py_float_repr(f64::try_from(key.clone())?),
                    _ => {
                        return Err(JinjaError::new(
                            JinjaErrorKind::InvalidOperation,
                            format!(
                                "tojson: keys must be str, int, float, bool or None, not {}",
                                key.kind()
                            ),
                        ))
                    }
                };
                entries.push((key, val));
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (key, val)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                write_py_str(out, key, style.ensure_ascii);
                out.push_str(key_sep);
                write_py_json(out, val, style, level + 1, depth + 1)?;
            }
            newline(out, level);
            out.push('}');
        }
        other => {
            return Err(JinjaError::new(
                JinjaErrorKind::InvalidOperation,
                format!("tojson: cannot serialise a value of kind {other}"),
            ))
        }
    }
    Ok(())
}

/// A JSON string literal as Python's `json` module writes it.
fn write_py_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !(' '..='~').contains(&c)) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: the shortest digits that round-trip, in fixed notation when the
/// exponent is in [-4, 16), else `d.ddde±XX`; `json` writes `NaN`, `Infinity`, `-Infinity`.
fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Rust's `{:e}` prints the shortest round-tripping digits, like Python's repr.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, digits) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = digits.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let n = digits.len() as i32;
        if exp < 0 {
            format!("{sign}0.{}{digits}", "0".repeat((-exp - 1) as usize))
        } else if exp + 1 >= n {
            format!("{sign}{digits}{}.0", "0".repeat((exp + 1 - n) as usize))
        } else {
            let (int, frac) = digits.split_at((exp + 1) as usize);
            format!("{sign}{int}.{frac}")
        }
    } else {
        let (first, rest) = digits.split_at(1);
        let mant = if rest.is_empty() {
            first.to_string()
        } else {
            format!("{first}.{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{mant}e{esign}{:02}", exp.abs())
    }
}

/// The parts of a Hugging Face `tokenizer_config.json` we use.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenizerConfig {
    /// The chat template (`chat_template`: a string, or the `default` entry of a list of
    /// named templates).
    pub chat_template: Option<String>,
    /// `bos_token`, as text.
    pub bos_token: Option<String>,
    /// `eos_token`, as text.
    pub eos_token: Option<String>,
}

impl TokenizerConfig {
    /// Reads `tokenizer_config.json`.
    pub fn from_file(path: &Path) -> Result<TokenizerConfig> {
        let text = fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        let json: Json = serde_json::from_str(&text)
            .map_err(|e| ModelError::format(path, format!("invalid JSON: {e}")))?;
        TokenizerConfig::from_json(&json).map_err(|detail| ModelError::format(path, detail))
    }

    /// Extracts the fields from parsed JSON; the error says which key is malformed.
    pub fn from_json(json: &Json) -> std::result::Result<TokenizerConfig, String> {
        let token = |key: &str| -> std::result::Result<Option<String>, String> {
            match json.get(key) {
                None | Some(Json::Null) => Ok(None),
                Some(Json::String(s)) => Ok(Some(s.clone())),
                Some(Json::Object(o)) => match o.get("content") {
                    Some(Json::String(s)) => Ok(Some(s.clone())),
                    _ => Err(format!("{key}: an object without a string \"content\"")),
                },
                Some(other) => Err(format!(
                    "{key}: expected a string or an object, found {other}"
                )),
            }
        };
        let chat_template = match json.get("chat_template") {
            None | Some(Json::Null) => None,
            Some(Json::String(s)) => Some(s.clone()),
            Some(Json::Array(list)) => Some(pick_named_template(list)?),
            Some(other) => {
                return Err(format!(
                    "chat_template: expected a string or a list, found {}",
                    kind_of(other)
                ))
            }
        };
        Ok(TokenizerConfig {
            chat_template,
            bos_token: token("bos_token")?,
            eos_token: token("eos_token")?,
        })
    }
}

fn kind_of(j: &Json) -> &'static str {
    match j {
        Json::Null => "null",
        Json::Bool(_) => "a bool",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "a list",
        Json::Object(_) => "an object",
    }
}

/// `[{"name": ..., "template": ...}, ...]`: the one named `default` (what `transformers` uses
/// when no name is asked for), or the only one.
fn pick_named_template(list: &[Json]) -> std::result::Result<String, String> {
    let mut named = BTreeMap::new();
    for (i, entry) in list.iter().enumerate() {
        let name = entry.get("name").and_then(Json::as_str);
        let template = entry.get("template").and_then(Json::as_str);
        match (name, template) {
            (Some(n), Some(t)) => {
                named.insert(n.to_string(), t.to_string());
            }
            _ => {
                return Err(format!(
                    "chat_template[{i}]: expected {{\"name\": string, \"template\": string}}"
                ))
            }
        }
    }
    if let Some(t) = named.get("default") {
        return Ok(t.clone());
    }
    if named.len() == 1 {
        if let Some(t) = named.values().next() {
            return Ok(t.clone());
        }
    }
    Err(format!(
        "chat_template: no template named \"default\" among {:?}",
        named.keys().collect::<Vec<_>>()
    ))
}

/// A model's special tokens.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// Beginning of sequence.
    pub bos: Option<u32>,
    /// Every token that ends generation (the tokenizer's EOS, `generation_config.json`'s and
    /// `config.json`'s `eos_token_id`, a GGUF file's EOS / EOT / EOM), without duplicates.
    pub eos: Vec<u32>,
    /// Text of the BOS token (what chat templates see as `bos_token`).
    pub bos_token: Option<String>,
    /// Text of the first EOS token (what chat templates see as `eos_token`).
    pub eos_token: Option<String>,
}

impl SpecialTokens {
    /// Whether `id` ends generation.
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos.contains(&id)
    }

    fn add_eos(&mut self, id: u32) {
        if !self.eos.contains(&id) {
            self.eos.push(id);
        }
    }
}

/// Loads the tokenizer, chat template and special tokens of a model: a Hugging Face folder
/// (`tokenizer.json`, plus `tokenizer_config.json`, `chat_template.jinja`,
/// `generation_config.json` and `config.json` when present) or a `.gguf` file (everything
/// synthesised from its metadata).
pub fn load_for_model(path: &Path) -> Result<(Tokenizer, Option<ChatTemplate>, SpecialTokens)> {
    if path.is_dir() {
        load_hf_folder(path)
    } else if is_gguf(path)? {
        load_gguf(path)
    } else {
        Err(ModelError::Input(format!(
            "{}: neither a Hugging Face model folder nor a GGUF file",
            path.display()
        )))
    }
}

fn is_gguf(path: &Path) -> Result<bool> {
    use std::io::Read;
    let mut f = fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
    let mut magic = [0u8; 4];
    match f.read_exact(&mut magic) {
        Ok(()) => Ok(&magic == crate::gguf::MAGIC),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(ModelError::io(path, e)),
    }
}

fn load_gguf(path: &Path) -> Result<(Tokenizer, Option<ChatTemplate>, SpecialTokens)> {
    let g = GgufFile::open(path)?;
    let tokenizer = Tokenizer::from_json(&g.tokenizer_json()?)
        .map_err(|e| ModelError::Tokenizer(format!("{}: {}", path.display(), strip_prefix(e))))?;
    let mut special = SpecialTokens::default();
    let text_of = |id: u32| tokenizer.id_to_token(id);
    if let Some(id) = g.get_u64("tokenizer.ggml.bos_token_id")? {
        let id = token_id(path, "tokenizer.ggml.bos_token_id", id)?;
        special.bos_token = Some(text_of(id)?);
        special.bos = Some(id);
    }
    for key in [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ] {
        if let Some(id) = g.get_u64(key)? {
            let id = token_id(path, key, id)?;
            if special.eos_token.is_none() {
                special.eos_token = Some(text_of(id)?);
            }
            special.add_eos(id);
        }
    }
    let template = g
        .chat_template()
        .map(|src| ChatTemplate::new(src, special.bos_token.clone(), special.eos_token.clone()))
        .transpose()?;
    Ok((tokenizer, template, special))
}

fn token_id(path: &Path, key: &str, id: u64) -> Result<u32> {
    u32::try_from(id)
        .map_err(|_| ModelError::format(path, format!("{key} = {id} is not a token id")))
}

fn read_json_if_present(path: &Path) -> Result<Option<Json>> {
    match fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| ModelError::format(path, format!("invalid JSON: {e}"))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ModelError::io(path, e)),
    }
}

/// `eos_token_id` / `bos_token_id` as an integer or a list of integers.
fn ids_from_json(path: &Path, json: &Json, key: &str) -> Result<Vec<u32>> {
    let bad = || {
        ModelError::format(
            path,
            format!("{key}: expected a token id or a list of them"),
        )
    };
    let one = |v: &Json| {
        v.as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .ok_or_else(bad)
    };
    match json.get(key) {
        None | Some(Json::Null) => Ok(Vec::new()),
        Some(Json::Array(list)) => list.iter().map(one).collect(),
        Some(v) => Ok(vec![one(v)?]),
    }
}

fn load_hf_folder(dir: &Path) -> Result<(Tokenizer, Option<ChatTemplate>, SpecialTokens)> {
    let tokenizer_path = dir.join("tokenizer.json");
    if !tokenizer_path.is_file() {
        return Err(ModelError::Tokenizer(format!(
            "{}: no tokenizer.json in the model folder",
            dir.display()
        )));
    }
    let tokenizer = Tokenizer::from_file(&tokenizer_path)?;
    let config_path = dir.join("tokenizer_config.json");
    let tcfg = if config_path.is_file() {
        TokenizerConfig::from_file(&config_path)?
    } else {
        TokenizerConfig::default()
    };
    let id_of = |text: &str, key: &str| -> Result<u32> {
        tokenizer.token_to_id(text).ok_or_else(|| {
            ModelError::format(
                &config_path,
                format!("{key} {text:?} is not a token of tokenizer.json"),
            )
        })
    };

    let mut special = SpecialTokens::default();
    if let Some(t) = &tcfg.bos_token {
        special.bos = Some(id_of(t, "bos_token")?);
        special.bos_token = Some(t.clone());
    }
    if let Some(t) = &tcfg.eos_token {
        special.add_eos(id_of(t, "eos_token")?);
        special.eos_token = Some(t.clone());
    }
    let generation_path = dir.join("generation_config.json");
    let model_config_path = dir.join("config.json");
    for p in [&generation_path, &model_config_path] {
        if let Some(json) = read_json_if_present(p)? {
            for id in ids_from_json(p, &json, "eos_token_id")? {
                tokenizer.id_to_token(id).map_err(|e| {
                    ModelError::format(p, format!("eos_token_id: {}", strip_prefix(e)))
                })?;
                special.add_eos(id);
            }
            if special.bos.is_none() {
                if let Some(&id) = ids_from_json(p, &json, "bos_token_id")?.first() {
                    special.bos_token = Some(tokenizer.id_to_token(id).map_err(|e| {
                        ModelError::format(p, format!("bos_token_id: {}", strip_prefix(e)))
                    })?);
                    special.bos = Some(id);
                }
            }
        }
    }
    if special.eos_token.is_none() {
        if let Some(&id) = special.eos.first() {
            special.eos_token = Some(tokenizer.id_to_token(id)?);
        }
    }

    // Newer `transformers` save the template as its own file, which takes precedence.
    let jinja_path: PathBuf = dir.join("chat_template.jinja");
    let source = match fs::read_to_string(&jinja_path) {
        Ok(s) => Some(s),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => tcfg.chat_template.clone(),
        Err(e) => return Err(ModelError::io(&jinja_path, e)),
    };
    let template = source
        .map(|s| ChatTemplate::new(s, special.bos_token.clone(), special.eos_token.clone()))
        .transpose()?;
    Ok((tokenizer, template, special))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_like_python_repr() {
        let cases = [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (123456.789, "123456.789"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (1e15, "1000000000000000.0"),
            (-2.25, "-2.25"),
            (0.1, "0.1"),
            (f64::INFINITY, "Infinity"),
            (0.0, "0.0"),
            (-0.0, "-0.0"),
        ];
        for (f, want) in cases {
            assert_eq!(py_float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn strings_escape_like_python_json() {
        let mut s = String::new();
        write_py_str(&mut s, "a\"b\\c\nd\u{1}é<>&", false);
        assert_eq!(s, r#""a\"b\\c\nd\u0001é<>&""#);
        let mut s = String::new();
        write_py_str(&mut s, "é😀", true);
        assert_eq!(s, r#""\u00e9\ud83d\ude00""#);
    }

    #[test]
    fn named_templates_pick_default() {
        let cfg: Json = serde_json::json!({
            "chat_template": [
                {"name": "tool_use", "template": "T"},
                {"name": "default", "template": "D"}
            ],
            "bos_token": {"content": "<s>", "lstrip": false},
            "eos_token": "</s>"
        });
        let t = TokenizerConfig::from_json(&cfg).unwrap();
        assert_eq!(t.chat_template.as_deref(), Some("D"));
        assert_eq!(t.bos_token.as_deref(), Some("<s>"));
        assert_eq!(t.eos_token.as_deref(), Some("</s>"));
        let bad: Json = serde_json::json!({"chat_template": [{"name": "a", "template": "A"}, {"name": "b", "template": "B"}]});
        assert!(TokenizerConfig::from_json(&bad).is_err());
        let bad: Json = serde_json::json!({"eos_token": 5});
        assert!(TokenizerConfig::from_json(&bad).is_err());
    }
}
