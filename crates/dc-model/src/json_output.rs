//! JSON output: sampling constrained so that the new text is always one JSON object.
//!
//! [`JsonPrefix`] recognises the prefixes of a JSON document whose top level is an object, a
//! byte at a time, with a bounded nesting depth. [`TokenTexts`] holds every token's text, read
//! once from the tokenizer. At each position [`JsonConstraint::allowed`] runs every token's
//! text from the current state and keeps the tokens that leave a valid prefix, which can still
//! be closed within the tokens left (one token per closing character: every byte-level
//! vocabulary has a token for each of `"`, `:`, `0`, `]` and `}`). The document ends the
//! generation as soon as it is complete.
//!
//! The constraint only removes candidates before the normal sampler runs, and depends only on
//! the tokens so far, so every peer derives the same choices.

use std::fmt;

use crate::error::{ModelError, Result};
use crate::tokenizer::Tokenizer;

/// Deepest nesting of objects and arrays a document may have.
pub const MAX_DEPTH: u8 = 64;

/// Where a number is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Num {
    /// After `-`: a digit must follow.
    Minus,
    /// A leading 0: no more integer digits.
    Zero,
    /// Integer digits.
    Int,
    /// After `.`: a digit must follow.
    Dot,
    /// Fraction digits.
    Frac,
    /// After `e`: a sign or a digit.
    Exp,
    /// After the exponent's sign: a digit must follow.
    ExpSign,
    /// Exponent digits.
    ExpDigits,
}

impl Num {
    /// Whether the number may end here.
    fn complete(self) -> bool {
        matches!(self, Num::Zero | Num::Int | Num::Frac | Num::ExpDigits)
    }
}

/// Where the recogniser is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Before the document: white space or `{`.
    Start,
    /// After `{`: a key or `}`.
    ObjectFirst,
    /// After `,` in an object: a key.
    Key,
    /// After a key: `:`.
    Colon,
    /// After `[`: a value or `]`.
    ArrayFirst,
    /// After `:` or `,` in an array: a value.
    Value,
    /// After a value inside a container: `,` or the container's close.
    After,
    /// Inside a string (`key`: an object's key); `escape` counts what an escape still needs
    /// (1 after `\`, 2..=5 for the hex digits of `\u` left plus one).
    Str {
        key: bool,
        escape: u8,
    },
    Num(Num),
    /// Inside `true`, `false` or `null`: which one, and how many letters are written.
    Word {
        word: u8,
        at: u8,
    },
    /// The document is complete.
    Done,
}

const WORDS: [&[u8]; 3] = [b"true", b"false", b"null"];

/// A valid prefix of a JSON document whose top level is an object. Small and `Copy`: the open
/// containers are bits (1: object) of one integer.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct JsonPrefix {
    mode: Mode,
    depth: u8,
    /// Bit i: whether the container at depth i + 1 is an object.
    objects: u64,
}

impl fmt::Debug for JsonPrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JsonPrefix({:?}, depth {})", self.mode, self.depth)
    }
}

impl Default for JsonPrefix {
    fn default() -> Self {
        JsonPrefix::new()
    }
}

fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

impl JsonPrefix {
    /// Nothing written yet.
    pub fn new() -> JsonPrefix {
        JsonPrefix {
            mode: Mode::Start,
            depth: 0,
            objects: 0,
        }
    }

    /// Whether the text so far is a whole document.
    pub fn is_complete(&self) -> bool {
        self.mode == Mode::Done
    }

    /// Whether the next byte is inside a string and not escaped: then any text free of `"`,
    /// `\` and control characters leaves the state as it is.
    fn in_plain_string(&self) -> bool {
        matches!(self.mode, Mode::Str { escape: 0, .. })
    }

    fn in_object(&self) -> bool {
        self.depth > 0 && self.objects >> (self.depth - 1) & 1 == 1
    }

    /// Opens a container (`object`: `{`, else `[`).
    fn open(mut self, object: bool) -> Option<JsonPrefix> {
        if self.depth >= MAX_DEPTH {
            return None;
        }
        let bit = 1u64 << self.depth;
        self.objects = if object {
            self.objects | bit
        } else {
            self.objects & !bit
        };
        self.depth += 1;
        self.mode = if object {
            Mode::ObjectFirst
        } else {
            Mode::ArrayFirst
        };
        Some(self)
    }

    /// Closes the innermost container with `b` (`}` or `]`), if it is that kind.
    fn close(mut self, b: u8) -> Option<JsonPrefix> {
        if self.depth == 0 || self.in_object() != (b == b'}') {
            return None;
        }
        self.depth -= 1;
        self.mode = if self.depth == 0 {
            Mode::Done
        } else {
            Mode::After
        };
        Some(self)
    }

    /// A value just ended.
    fn value_done(mut self) -> JsonPrefix {
        self.mode = if self.depth == 0 {
            Mode::Done
        } else {
            Mode::After
        };
        self
    }

    /// The first byte of a value.
    fn start_value(mut self, b: u8) -> Option<JsonPrefix> {
        self.mode = match b {
            b'{' => return self.open(true),
            b'[' => return self.open(false),
            b'"' => Mode::Str {
                key: false,
                escape: 0,
            },
            b'-' => Mode::Num(Num::Minus),
            b'0' => Mode::Num(Num::Zero),
            b'1'..=b'9' => Mode::Num(Num::Int),
            _ => {
                let word = WORDS.iter().position(|w| w[0] == b)?;
                Mode::Word {
                    word: word as u8,
                    at: 1,
                }
            }
        };
        Some(self)
    }

    /// The state after one more byte, or `None` if the text would no longer be a prefix of a
    /// document.
    pub fn push(self, b: u8) -> Option<JsonPrefix> {
        let mut s = self;
        match self.mode {
            Mode::Start if is_space(b) => Some(s),
            Mode::Start => (b == b'{').then(|| s.open(true)).flatten(),
            Mode::ObjectFirst
            | Mode::Key
            | Mode::Colon
            | Mode::ArrayFirst
            | Mode::Value
            | Mode::After
                if is_space(b) =>
            {
                Some(s)
            }
            Mode::ObjectFirst if b == b'}' => s.close(b),
            Mode::ObjectFirst | Mode::Key => {
                s.mode = Mode::Str {
                    key: true,
                    escape: 0,
                };
                (b == b'"').then_some(s)
            }
            Mode::Colon => {
                s.mode = Mode::Value;
                (b == b':').then_some(s)
            }
            Mode::ArrayFirst if b == b']' => s.close(b),
            Mode::ArrayFirst | Mode::Value => s.start_value(b),
            Mode::After => match b {
                b',' => {
                    s.mode = if s.in_object() {
                        Mode::Key
                    } else {
                        Mode::Value
                    };
                    Some(s)
                }
                b'}' | b']' => s.close(b),
                _ => None,
            },
            Mode::Str { key, escape } => {
                s.mode = match (escape, b) {
                    (0, b'"') if key => Mode::Colon,
                    (0, b'"') => return Some(s.value_done()),
                    (0, b'\\') => Mode::Str { key, escape: 1 },
                    (0, 0..=0x1f) => return None,
                    (0, _) => Mode::Str { key, escape: 0 },
                    (1, b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => {
                        Mode::Str { key, escape: 0 }
                    }
                    (1, b'u') => Mode::Str { key, escape: 5 },
                    (2..=5, _) if b.is_ascii_hexdigit() => Mode::Str {
                        key,
                        escape: if escape == 2 { 0 } else { escape - 1 },
                    },
                    _ => return None,
                };
                Some(s)
            }
            Mode::Num(n) => {
                let next = match (n, b) {
                    (Num::Minus, b'0') => Num::Zero,
                    (Num::Minus, b'1'..=b'9') => Num::Int,
                    (Num::Int, b'0'..=b'9') => Num::Int,
                    (Num::Zero | Num::Int, b'.') => Num::Dot,
                    (Num::Dot | Num::Frac, b'0'..=b'9') => Num::Frac,
                    (Num::Zero | Num::Int | Num::Frac, b'e' | b'E') => Num::Exp,
                    (Num::Exp, b'+' | b'-') => Num::ExpSign,
                    (Num::Exp | Num::ExpSign | Num::ExpDigits, b'0'..=b'9') => Num::ExpDigits,
                    // Anything else ends the number, if it may end, and counts after it.
                    _ if n.complete() => return s.value_done().push(b),
                    _ => return None,
                };
                s.mode = Mode::Num(next);
                Some(s)
            }
            Mode::Word { word, at } => {
                let w = WORDS[word as usize];
                if w[at as usize] != b {
                    return None;
                }
                if at as usize + 1 == w.len() {
                    return Some(s.value_done());
                }
                s.mode = Mode::Word { word, at: at + 1 };
                Some(s)
            }
            Mode::Done => None,
        }
    }

    /// The state after `text`, if it keeps the document a valid prefix.
    pub fn push_all(self, text: &[u8]) -> Option<JsonPrefix> {
        text.iter().try_fold(self, |s, &b| s.push(b))
    }

    /// The shortest text that completes the document from here (for the budget; tested
    /// against [`JsonPrefix::closing_len`]).
    pub fn closing(&self) -> String {
        let mut out = String::new();
        match self.mode {
            Mode::Start => out.push('{'),
            Mode::Key => out.push_str("\"\":0"),
            Mode::Colon => out.push_str(":0"),
            Mode::Value => out.push('0'),
            Mode::Str { key, escape } => {
                match escape {
                    0 => {}
                    1 => out.push('n'),
                    n => out.extend(std::iter::repeat_n('0', n as usize - 1)),
                }
                out.push('"');
                if key {
                    out.push_str(":0");
                }
            }
            Mode::Num(n) if !n.complete() => out.push('0'),
            Mode::Word { word, at } => {
                let w = WORDS[word as usize];
                out.push_str(std::str::from_utf8(&w[at as usize..]).unwrap_or_default());
            }
            Mode::ObjectFirst | Mode::ArrayFirst | Mode::After | Mode::Num(_) | Mode::Done => {}
        }
        let depth = if self.mode == Mode::Start {
            1
        } else {
            self.depth
        };
        for i in (0..depth).rev() {
            let object = self.mode == Mode::Start || self.objects >> i & 1 == 1;
            out.push(if object { '}' } else { ']' });
        }
        out
    }

    /// The length of [`JsonPrefix::closing`], without building it.
    pub fn closing_len(&self) -> usize {
        let current = match self.mode {
            Mode::Start => 2,
            Mode::Key => 4,
            Mode::Colon => 2,
            Mode::Value => 1,
            Mode::Str { key, escape } => {
                let escape = if escape <= 1 {
                    escape as usize
                } else {
                    escape as usize - 1
                };
                escape + 1 + if key { 2 } else { 0 }
            }
            Mode::Num(n) if !n.complete() => 1,
            Mode::Word { word, at } => WORDS[word as usize].len() - at as usize,
            Mode::ObjectFirst | Mode::ArrayFirst | Mode::After | Mode::Num(_) | Mode::Done => 0,
        };
        current + self.depth as usize
    }
}

/// Every token's text, as the tokenizer decodes it in context (a SentencePiece token's leading
/// space included), read once per model.
pub struct TokenTexts {
    texts: Vec<Box<[u8]>>,
    /// Per token: whether its text is plain string content (no `"`, `\\` or control
    /// characters), which changes nothing inside a string.
    plain: Vec<bool>,
    /// The tokens by the first byte of their text: a state that refuses that byte refuses
    /// them all at once.
    by_first: Vec<Vec<u32>>,
}

impl fmt::Debug for TokenTexts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TokenTexts({} tokens)", self.texts.len())
    }
}

impl TokenTexts {
    /// Reads every token's text from `tok`, with special tokens as empty texts (they are
    /// never allowed in a document).
    pub fn new(tok: &Tokenizer) -> Result<TokenTexts> {
        // Decoding a token after an anchor and removing the anchor's text keeps what decoding
        // a token alone would strip (the space a SentencePiece "▁" stands for).
        let anchor = tok.encode("a", false)?.first().copied();
        let anchor_text = match anchor {
            Some(a) => tok.decode(&[a], true)?,
            None => String::new(),
        };
        let mut texts = Vec::with_capacity(tok.vocab_size());
        for id in 0..tok.vocab_size() as u32 {
            let alone = tok.decode(&[id], true).unwrap_or_default();
            let text = match anchor {
                Some(a) if !alone.is_empty() => {
                    let both = tok.decode(&[a, id], true).unwrap_or_default();
                    both.strip_prefix(&anchor_text)
                        .map_or(alone, str::to_string)
                }
                _ => alone,
            };
            texts.push(text);
        }
        Ok(TokenTexts::from_texts(texts))
    }

    /// Texts given directly (tests, and vocabularies read some other way).
    pub fn from_texts(texts: impl IntoIterator<Item = String>) -> TokenTexts {
        let texts: Vec<Box<[u8]>> = texts
            .into_iter()
            .map(|t| t.into_bytes().into_boxed_slice())
            .collect();
        let plain = texts
            .iter()
            .map(|t| !t.is_empty() && t.iter().all(|&b| b >= 0x20 && b != b'"' && b != b'\\'))
            .collect();
        let mut by_first = vec![Vec::new(); 256];
        for (id, t) in texts.iter().enumerate() {
            if let Some(&b) = t.first() {
                by_first[b as usize].push(id as u32);
            }
        }
        TokenTexts {
            texts,
            plain,
            by_first,
        }
    }

    /// How many tokens there are.
    pub fn len(&self) -> usize {
        self.texts.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.texts.is_empty()
    }

    /// The text of token `id` (empty for special tokens and ids out of range).
    pub fn text(&self, id: u32) -> &[u8] {
        self.texts.get(id as usize).map_or(&[], |t| &t[..])
    }
}

/// The JSON constraint of one generation: the document so far.
#[derive(Clone, Debug)]
pub struct JsonConstraint {
    texts: std::sync::Arc<TokenTexts>,
    state: JsonPrefix,
}

impl JsonConstraint {
    /// A constraint over the vocabulary `texts`, nothing written yet.
    pub fn new(texts: std::sync::Arc<TokenTexts>) -> JsonConstraint {
        JsonConstraint {
            texts,
            state: JsonPrefix::new(),
        }
    }

    /// Whether the document is complete.
    pub fn is_complete(&self) -> bool {
        self.state.is_complete()
    }

    /// Which of `vocab` tokens may come next when at most `left` more tokens may follow it:
    /// those whose text keeps the document a valid prefix that can close in `left` tokens.
    pub fn allowed(&self, vocab: usize, left: usize) -> Result<Vec<bool>> {
        // Inside a string most tokens are plain text, which leaves the state as it is.
        let in_string = self.state.in_plain_string();
        let plain_fits = in_string && self.state.closing_len() <= left;
        let mut allowed = vec![false; vocab];
        for (first, ids) in self.texts.by_first.iter().enumerate() {
            let Some(after_first) = self.state.push(first as u8) else {
                continue;
            };
            for &id in ids.iter().filter(|&&id| (id as usize) < vocab) {
                let i = id as usize;
                allowed[i] = if in_string && self.texts.plain[i] {
                    plain_fits
                } else {
                    after_first
                        .push_all(&self.texts.texts[i][1..])
                        .is_some_and(|s| s.closing_len() <= left)
                };
            }
        }
        if !allowed.contains(&true) {
            return Err(ModelError::Input(format!(
                "JSON output: no token continues the document within {left} more tokens \
                 (at least {} characters are needed to close it)",
                self.state.closing_len()
            )));
        }
        Ok(allowed)
    }

    /// Takes the chosen token.
    pub fn push(&mut self, id: u32) -> Result<()> {
        self.state = self.state.push_all(self.texts.text(id)).ok_or_else(|| {
            ModelError::Input(format!(
                "JSON output: token {id} does not continue the document"
            ))
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn accepts(text: &str) -> Option<JsonPrefix> {
        JsonPrefix::new().push_all(text.as_bytes())
    }

    #[test]
    fn documents_are_accepted_and_complete() {
        for doc in [
            "{}",
            " {\"a\": 1}",
            "{\"a\":[1,-2.5e+3,0.0,true,false,null,\"x\\u00e9\\n\"],\"b\":{\"c\":{}}}",
            "{\"é😀\": [[], [[]], {\"\": -0}]}",
            "{\n  \"k\": 1E5\n}",
        ] {
            let s = accepts(doc).unwrap_or_else(|| panic!("refused {doc:?}"));
            assert!(s.is_complete(), "{doc:?}");
            serde_json::from_str::<serde_json::Value>(doc).expect("valid JSON");
        }
    }

    #[test]
    fn what_is_not_json_is_refused() {
        for bad in [
            "[1]",
            "\"top\"",
            "{,}",
            "{\"a\" 1}",
            "{\"a\":01}",
            "{\"a\":1,}",
            "{\"a\":[1,]}",
            "{\"a\":.5}",
            "{\"a\":1.}",
            "{\"a\":tru }",
            "{\"a\":\"\\x\"}",
            "{\"a\":\"\u{1}\"}",
            "{\"a\":1]",
            "{} ",
            "{}{}",
            "{'a':1}",
            "{\"a\":-}",
        ] {
            assert!(
                accepts(bad).is_none_or(|s| !s.is_complete() && s.push_all(b"}").is_none()),
                "accepted {bad:?}"
            );
        }
        let deep = format!("{{\"a\":{}", "[".repeat(MAX_DEPTH as usize - 1));
        assert!(accepts(&deep).is_some());
        assert!(accepts(&format!("{deep}[")).is_none(), "too deep");
    }

    /// JSON objects of any shape, written compactly or pretty.
    fn json_object() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::Bool),
            any::<i64>().prop_map(|n| serde_json::json!(n)),
            (-1e6f64..1e6).prop_map(|f| serde_json::json!(f)),
            "[a-z\"\\\\/\n\té😀 ]{0,8}".prop_map(serde_json::Value::String),
        ];
        let value = leaf.prop_recursive(4, 32, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::Array),
                prop::collection::btree_map("[a-z\"é]{0,4}", inner, 0..4)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        });
        prop::collection::btree_map("[a-z]{0,4}", value, 0..4)
            .prop_map(|m| serde_json::Value::Object(m.into_iter().collect()))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Every prefix of a document is accepted, only the whole is complete, and every
        /// prefix closes with `closing()` (whose length `closing_len` gives) into valid JSON.
        #[test]
        fn prefixes_close_into_valid_json(v in json_object(), pretty in any::<bool>()) {
            let doc = if pretty {
                serde_json::to_string_pretty(&v).unwrap()
            } else {
                serde_json::to_string(&v).unwrap()
            };
            let mut s = JsonPrefix::new();
            for (i, &b) in doc.as_bytes().iter().enumerate() {
                prop_assert!(!s.is_complete());
                let closing = s.closing();
                prop_assert_eq!(closing.len(), s.closing_len(), "{:?}", s);
                let closed = s.push_all(closing.as_bytes());
                prop_assert!(closed.is_some_and(|c| c.is_complete()), "{:?} + {:?}", &doc[..i], closing);
                if doc.is_char_boundary(i) {
                    let text = format!("{}{closing}", &doc[..i]);
                    prop_assert!(serde_json::from_str::<serde_json::Value>(&text).is_ok(), "{}", text);
                }
                s = s.push(b).expect("a prefix of a document");
            }
            prop_assert!(s.is_complete());
            prop_assert_eq!(s.closing_len(), 0);
        }

        /// The shortcut for plain string content allows exactly what running each token's
        /// text through the recogniser allows.
        #[test]
        fn allowed_is_each_token_run_through(v in json_object(), cut in 0.0f64..1.0, left in 0usize..12) {
            let texts = ["a", "é", " x", "\"", "\\", "\\n", "\"}", "\":", "1", "}", "]", ",\"", "\u{1}", "{\"", "0\""];
            let vocab = std::sync::Arc::new(TokenTexts::from_texts(texts.map(String::from)));
            let doc = serde_json::to_string(&v).unwrap();
            let mut at = (doc.len() as f64 * cut) as usize;
            while !doc.is_char_boundary(at) {
                at -= 1;
            }
            let mut c = JsonConstraint::new(vocab.clone());
            c.state = JsonPrefix::new().push_all(&doc.as_bytes()[..at]).unwrap();
            if let Ok(allowed) = c.allowed(texts.len(), left) {
                for (i, t) in texts.iter().enumerate() {
                    let want = c.state.push_all(t.as_bytes()).is_some_and(|s| s.closing_len() <= left);
                    prop_assert_eq!(allowed[i], want, "{:?} after {:?}", t, &doc[..at]);
                }
            }
        }

        /// Whatever text the recogniser calls complete is valid JSON with an object on top.
        #[test]
        fn complete_means_valid(text in "[{}\\[\\]\":,0-9a-z.eE+\\- \\\\]{0,24}") {
            if accepts(&text).is_some_and(|s| s.is_complete()) {
                let v: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
                prop_assert!(v.is_object());
            }
        }
    }

    #[test]
    fn only_tokens_that_continue_and_can_close_are_allowed() {
        let texts = [
            "{", "}", "\"", "a", ":", "1", " {\"", "]", "", "\"}", "x\":",
        ];
        let vocab = std::sync::Arc::new(TokenTexts::from_texts(texts.map(String::from)));
        let mut c = JsonConstraint::new(vocab);
        let allowed = |c: &JsonConstraint, left| {
            let a = c.allowed(texts.len(), left).expect("some token");
            (0..texts.len())
                .filter(|&i| a[i])
                .map(|i| texts[i])
                .collect::<Vec<_>>()
        };
        assert_eq!(allowed(&c, 10), ["{", " {\""]);
        c.push(0).unwrap();
        // A key may hold any character, `}` too.
        assert_eq!(allowed(&c, 10), ["}", "\"", "\"}"]);
        // With nothing left after it, only the closing brace.
        assert_eq!(allowed(&c, 0), ["}"]);
        c.push(2).unwrap();
        assert_eq!(
            allowed(&c, 10),
            ["{", "}", "\"", "a", ":", "1", " {\"", "]", "x\":"]
        );
        // `"` leaves `:0}` to write, `a` `":0}`, `x":` only `0}`.
        assert_eq!(allowed(&c, 3), ["\"", " {\"", "x\":"]);
        assert_eq!(allowed(&c, 2), ["x\":"]);
        c.push(10).unwrap();
        assert_eq!(allowed(&c, 1), ["1"]);
        c.push(5).unwrap();
        assert!(!c.is_complete());
        c.push(1).unwrap();
        assert!(c.is_complete());
        assert!(
            c.allowed(texts.len(), 5).is_err(),
            "nothing follows a whole document"
        );
        assert!(c.push(1).is_err());
    }
}
