//! JSON output: sampling constrained so that the new text is always one JSON document, any
//! object or one that a [`Schema`] describes.
//!
//! [`JsonState`] recognises the prefixes of the documents of a schema, a byte at a time, with
//! a bounded nesting depth: a stack of the open objects and arrays (the keys each object has
//! written, the items each array has begun) and the position inside the innermost one.
//! [`TokenTexts`] holds every token's text, read once from the tokenizer. At each position
//! [`JsonConstraint::allowed`] runs every token's text from the current state and keeps the
//! tokens that leave a valid prefix which can still be closed within the tokens left: the
//! shortest closing writes the values and required keys still missing one character per
//! token, and [`JsonOutput::new`] checks that the vocabulary has a token for every character
//! it may need. The document ends the generation as soon as it is complete.
//!
//! The constraint only removes candidates before the normal sampler runs, and depends only on
//! the tokens so far, so every peer derives the same choices.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use crate::error::{ModelError, Result};
use crate::json_schema::{kind, Node, NodeId, Schema};
use crate::tokenizer::Tokenizer;

/// Deepest nesting of objects and arrays a document may have.
pub const MAX_DEPTH: usize = 64;

/// Most digits of a number's integer part.
const MAX_INT_DIGITS: u8 = 100;

/// Where a number is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Num {
    /// After `-`: a digit must follow.
    Minus,
    /// A leading 0: no more integer digits.
    Zero,
    /// Integer digits, and how many.
    Int(u8),
    /// After `.`: a digit must follow.
    Dot,
    /// Fraction digits.
    Frac,
    /// After `e`: a sign or a digit.
    Exp,
    /// After the exponent's sign: a digit must follow.
    ExpSign,
    /// Exponent digits, and how many.
    ExpDigits(u8),
}

impl Num {
    /// Whether the number may end here.
    fn complete(self) -> bool {
        matches!(
            self,
            Num::Zero | Num::Int(_) | Num::Frac | Num::ExpDigits(_)
        )
    }

    /// The state after `b`, if `b` continues the number (`integer`: no fraction or exponent).
    /// Integer parts of up to [`MAX_INT_DIGITS`] digits and exponents of up to 2 keep every
    /// number inside an f64's range, which parsers such as serde_json require.
    fn push(self, b: u8, integer: bool) -> Option<Num> {
        Some(match (self, b) {
            (Num::Minus, b'0') => Num::Zero,
            (Num::Minus, b'1'..=b'9') => Num::Int(1),
            (Num::Int(n), b'0'..=b'9') if n < MAX_INT_DIGITS => Num::Int(n + 1),
            (Num::Zero | Num::Int(_), b'.') if !integer => Num::Dot,
            (Num::Dot | Num::Frac, b'0'..=b'9') => Num::Frac,
            (Num::Zero | Num::Int(_) | Num::Frac, b'e' | b'E') if !integer => Num::Exp,
            (Num::Exp, b'+' | b'-') => Num::ExpSign,
            (Num::Exp | Num::ExpSign, b'0'..=b'9') => Num::ExpDigits(1),
            (Num::ExpDigits(1), b'0'..=b'9') => Num::ExpDigits(2),
            _ => return None,
        })
    }
}

/// Where the recogniser is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Before the document: white space or the top level's first character.
    Start,
    /// After `{`: a key or `}`.
    ObjectFirst,
    /// After `,` in an object: a key.
    Key,
    /// Inside a key.
    KeyText(KeyText),
    /// After a key whose value has schema `node`: `:`.
    Colon {
        node: NodeId,
    },
    /// After `:`, or `,` in an array: a value of `node`.
    Value {
        node: NodeId,
    },
    /// After `[`: an item or `]`.
    ArrayFirst,
    /// After a value inside a container: `,` or the container's close.
    After,
    /// Inside a string value; `escape` counts what an escape still needs (1 after `\`,
    /// 2..=5 for the hex digits of `\u` left plus one).
    Str {
        escape: u8,
    },
    Num {
        num: Num,
        integer: bool,
    },
    /// Inside `true`, `false` or `null`: which one, and how many letters are written.
    Word {
        word: u8,
        at: u8,
    },
    /// Inside a value of `node`'s `enum`: its literals `lo..hi` begin with the `at` bytes
    /// written.
    Literal {
        node: NodeId,
        lo: u16,
        hi: u16,
        at: u16,
    },
    /// The document is complete.
    Done,
}

const WORDS: [&[u8]; 3] = [b"true", b"false", b"null"];

/// A key being written. The listed properties `lo..hi` (sorted by name) are those whose names
/// begin with the `at` bytes written (written ones too: a key may not repeat them); `free`:
/// the text may also become a key outside them. `escape` as in [`Mode::Str`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct KeyText {
    lo: u8,
    hi: u8,
    at: u16,
    free: bool,
    escape: u8,
}

/// An open object or array.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Container {
    node: NodeId,
    object: bool,
    /// An object's written listed properties (bit i: the i-th by name); an array's items
    /// begun.
    count: u64,
}

fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// A string's escape state after `b` (see [`Mode::Str`]), or `None` if `b` may not come
/// here; a `"` outside an escape is the caller's.
fn string_byte(escape: u8, b: u8) -> Option<u8> {
    match (escape, b) {
        (0, b'\\') => Some(1),
        (0, 0..=0x1f) => None,
        (0, _) => Some(0),
        (1, b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => Some(0),
        (1, b'u') => Some(5),
        (2..=5, _) if b.is_ascii_hexdigit() => Some(if escape == 2 { 0 } else { escape - 1 }),
        _ => None,
    }
}

/// The shortest text that ends a string's escape (then the string may close).
fn escape_end(escape: u8) -> &'static [u8] {
    match escape {
        0 => b"",
        1 => b"n",
        n => &b"0000"[..n as usize - 1],
    }
}

/// The part of the sorted `names[lo..hi]` (all sharing their first `at` bytes) whose byte
/// `at` is `b`.
fn narrow<'n>(
    names: impl Fn(usize) -> &'n [u8],
    lo: usize,
    hi: usize,
    at: usize,
    b: u8,
) -> (usize, usize) {
    let first = |from: usize, to: usize, past: &dyn Fn(u8) -> bool| {
        let (mut l, mut h) = (from, to);
        while l < h {
            let m = (l + h) / 2;
            if names(m).get(at).is_none_or(|&c| !past(c)) {
                l = m + 1;
            } else {
                h = m;
            }
        }
        l
    };
    let start = first(lo, hi, &|c| c >= b);
    let end = first(start, hi, &|c| c > b);
    (start, end)
}

/// Bits `lo..hi`.
fn range_bits(lo: usize, hi: usize) -> u64 {
    let upto = |n: usize| if n >= 64 { u64::MAX } else { (1u64 << n) - 1 };
    upto(hi) & !upto(lo)
}

/// Where text goes when a closing is written out: counted, or kept.
trait Sink {
    fn put(&mut self, text: &[u8]);
}

/// Counts a closing's bytes.
#[derive(Default)]
struct Count(usize);

impl Sink for Count {
    fn put(&mut self, text: &[u8]) {
        self.0 += text.len();
    }
}

impl Sink for Vec<u8> {
    fn put(&mut self, text: &[u8]) {
        self.extend_from_slice(text);
    }
}

/// The shortest closing of a container whose current value is complete: the required keys
/// it has not written (each after a `,`), or the items it still needs, then its close.
fn close_container(schema: &Schema, c: &Container, out: &mut impl Sink) {
    let n = schema.node(c.node);
    if c.object {
        for p in missing(n, c.count) {
            out.put(b",");
            entry(schema, n, p, out);
        }
        out.put(b"}");
    } else {
        for _ in c.count..u64::from(n.min_items) {
            out.put(b",");
            out.put(&schema.node(n.items).shortest);
        }
        out.put(b"]");
    }
}

/// The required properties of `n` not among `written`.
fn missing(n: &Node, written: u64) -> impl Iterator<Item = usize> {
    let mut left = n.required & !written;
    std::iter::from_fn(move || {
        (left != 0).then(|| {
            let i = left.trailing_zeros() as usize;
            left &= left - 1;
            i
        })
    })
}

/// `"name":` and the shortest value of property `p` of `n`.
fn entry(schema: &Schema, n: &Node, p: usize, out: &mut impl Sink) {
    let prop = &n.properties[p];
    out.put(b"\"");
    out.put(&prop.name);
    out.put(b"\":");
    out.put(&schema.node(prop.node).shortest);
}

/// The required keys an object still lacks, the first with no `,` before it, then `}`.
fn close_fresh_object(schema: &Schema, n: &Node, written: u64, out: &mut impl Sink) {
    for (i, p) in missing(n, written).enumerate() {
        if i > 0 {
            out.put(b",");
        }
        entry(schema, n, p, out);
    }
    out.put(b"}");
}

/// The position in a document: the open containers, and where the innermost one is. A run
/// of text works on a [`Cursor`] over it, which copies only the containers it changes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JsonState {
    mode: Mode,
    stack: Vec<Container>,
}

impl Default for JsonState {
    fn default() -> Self {
        JsonState::new()
    }
}

impl JsonState {
    /// Nothing written yet.
    pub fn new() -> JsonState {
        JsonState {
            mode: Mode::Start,
            stack: Vec::new(),
        }
    }

    /// Whether the text so far is a whole document.
    pub fn is_complete(&self) -> bool {
        self.mode == Mode::Done
    }

    /// The state after `text`, if it keeps the document a valid prefix of `schema`'s.
    pub fn push_all(&self, schema: &Schema, text: &[u8]) -> Option<JsonState> {
        let mut own = Vec::new();
        let mut c = Cursor::new(schema, self, &mut own);
        if !c.push_all(text) {
            return None;
        }
        let (kept, mode) = (c.kept, c.mode);
        let mut stack = self.stack[..kept].to_vec();
        stack.extend_from_slice(&own);
        Some(JsonState { mode, stack })
    }

    /// The shortest text that completes the document from here (tested against
    /// [`JsonState::closing_len`], which the budget uses).
    pub fn closing(&self, schema: &Schema) -> Vec<u8> {
        let mut out = Vec::new();
        let mut own = Vec::new();
        Cursor::new(schema, self, &mut own).closing(&mut out);
        out
    }

    /// The length of [`JsonState::closing`], without building it.
    pub fn closing_len(&self, schema: &Schema) -> usize {
        let mut n = Count::default();
        let mut own = Vec::new();
        Cursor::new(schema, self, &mut own).closing(&mut n);
        n.0
    }
}

/// A [`JsonState`] being run through text: the state's containers below `kept` as they are,
/// then those in `own` (copied, or opened by the text).
struct Cursor<'a> {
    schema: &'a Schema,
    base: &'a [Container],
    kept: usize,
    own: &'a mut Vec<Container>,
    mode: Mode,
}

impl<'a> Cursor<'a> {
    fn new(schema: &'a Schema, state: &'a JsonState, own: &'a mut Vec<Container>) -> Cursor<'a> {
        own.clear();
        Cursor {
            schema,
            base: &state.stack,
            kept: state.stack.len(),
            own,
            mode: state.mode,
        }
    }

    fn depth(&self) -> usize {
        self.kept + self.own.len()
    }

    fn top(&self) -> Option<&Container> {
        self.own
            .last()
            .or_else(|| self.kept.checked_sub(1).map(|i| &self.base[i]))
    }

    fn top_mut(&mut self) -> Option<&mut Container> {
        if self.own.is_empty() && self.kept > 0 {
            self.kept -= 1;
            self.own.push(self.base[self.kept]);
        }
        self.own.last_mut()
    }

    fn node(&self, id: NodeId) -> &'a Node {
        self.schema.node(id)
    }

    /// The innermost container's schema (the top level's when none is open).
    fn top_node(&self) -> &'a Node {
        let id = self.top().map_or(self.schema.root(), |c| c.node);
        self.node(id)
    }

    fn push_all(&mut self, text: &[u8]) -> bool {
        text.iter().all(|&b| self.push(b))
    }

    /// Takes one more byte; false if the text would no longer be a prefix of a document.
    fn push(&mut self, b: u8) -> bool {
        match self.mode {
            Mode::Start
            | Mode::ObjectFirst
            | Mode::Key
            | Mode::Colon { .. }
            | Mode::Value { .. }
            | Mode::ArrayFirst
            | Mode::After
                if is_space(b) =>
            {
                true
            }
            Mode::Start => self.start_value(self.schema.root(), b),
            Mode::ObjectFirst if b == b'}' => self.close(true),
            Mode::ObjectFirst | Mode::Key if b == b'"' => self.open_key(),
            Mode::ObjectFirst | Mode::Key => false,
            Mode::Colon { node } => {
                self.mode = Mode::Value { node };
                b == b':'
            }
            Mode::ArrayFirst if b == b']' => self.close(false),
            Mode::ArrayFirst => {
                let array = self.top_node();
                if array.max_items == 0 {
                    return false;
                }
                if let Some(c) = self.top_mut() {
                    c.count = 1;
                }
                self.start_value(array.items, b)
            }
            Mode::Value { node } => self.start_value(node, b),
            Mode::After => match b {
                b',' => self.next_member(),
                b'}' => self.close(true),
                b']' => self.close(false),
                _ => false,
            },
            Mode::KeyText(k) => self.key_byte(k, b),
            Mode::Str { escape } if escape == 0 && b == b'"' => self.value_done(),
            Mode::Str { escape } => match string_byte(escape, b) {
                Some(escape) => {
                    self.mode = Mode::Str { escape };
                    true
                }
                None => false,
            },
            Mode::Num { num, integer } => match num.push(b, integer) {
                Some(num) => {
                    self.mode = Mode::Num { num, integer };
                    true
                }
                // Anything else ends the number, if it may end, and counts after it.
                None => num.complete() && self.value_done() && self.push(b),
            },
            Mode::Word { word, at } => {
                let w = WORDS[word as usize];
                if w[at as usize] != b {
                    return false;
                }
                if at as usize + 1 == w.len() {
                    return self.value_done();
                }
                self.mode = Mode::Word { word, at: at + 1 };
                true
            }
            Mode::Literal { node, lo, hi, at } => {
                let lits = &self.node(node).literals;
                let (lo, hi, at) = (lo as usize, hi as usize, at as usize);
                let (l, h) = narrow(|i| &lits[i], lo, hi, at, b);
                if l < h {
                    self.literal(node, l, h, at + 1)
                } else {
                    // A number literal that is complete ends where the text stops matching.
                    lits[lo].len() == at && self.value_done() && self.push(b)
                }
            }
            Mode::Done => false,
        }
    }

    /// Inside `node`'s literals `lo..hi` after `at` bytes: done when only one is left and it
    /// is whole.
    fn literal(&mut self, node: NodeId, lo: usize, hi: usize, at: usize) -> bool {
        if hi == lo + 1 && self.node(node).literals[lo].len() == at {
            return self.value_done();
        }
        self.mode = Mode::Literal {
            node,
            lo: lo as u16,
            hi: hi as u16,
            at: at as u16,
        };
        true
    }

    /// The first byte of a value of `node`.
    fn start_value(&mut self, node: NodeId, b: u8) -> bool {
        let n = self.node(node);
        if !n.literals.is_empty() {
            let (l, h) = narrow(|i| &n.literals[i], 0, n.literals.len(), 0, b);
            return l < h && self.literal(node, l, h, 1);
        }
        let t = n.types;
        self.mode = match b {
            b'"' if t & kind::STRING != 0 => Mode::Str { escape: 0 },
            b'-' | b'0'..=b'9' if t & (kind::NUMBER | kind::INTEGER) != 0 => Mode::Num {
                num: match b {
                    b'-' => Num::Minus,
                    b'0' => Num::Zero,
                    _ => Num::Int(1),
                },
                integer: t & kind::NUMBER == 0,
            },
            b't' | b'f' if t & kind::BOOLEAN != 0 => Mode::Word {
                word: u8::from(b == b'f'),
                at: 1,
            },
            b'n' if t & kind::NULL != 0 => Mode::Word { word: 2, at: 1 },
            b'{' | b'[' if t & if b == b'{' { kind::OBJECT } else { kind::ARRAY } != 0 => {
                if self.depth() >= MAX_DEPTH {
                    return false;
                }
                let object = b == b'{';
                self.own.push(Container {
                    node,
                    object,
                    count: 0,
                });
                if object {
                    Mode::ObjectFirst
                } else {
                    Mode::ArrayFirst
                }
            }
            _ => return false,
        };
        true
    }

    /// A value just ended.
    fn value_done(&mut self) -> bool {
        self.mode = if self.depth() == 0 {
            Mode::Done
        } else {
            Mode::After
        };
        true
    }

    /// Closes the innermost container (`object`: with `}`), if it is that kind and complete.
    fn close(&mut self, object: bool) -> bool {
        let Some(&c) = self.top() else {
            return false;
        };
        let n = self.node(c.node);
        let complete = if c.object {
            n.required & !c.count == 0
        } else {
            c.count >= u64::from(n.min_items)
        };
        if c.object != object || !complete {
            return false;
        }
        if self.own.pop().is_none() {
            self.kept -= 1;
        }
        self.value_done()
    }

    /// The properties still to write, and whether another key may be one outside them.
    fn open_keys(&self) -> (u64, bool) {
        let c = self.top().copied().unwrap_or(Container {
            node: self.schema.root(),
            object: true,
            count: 0,
        });
        let n = self.node(c.node);
        let unwritten = range_bits(0, n.properties.len()) & !c.count;
        (unwritten, n.extra.is_some())
    }

    /// `"` begins a key.
    fn open_key(&mut self) -> bool {
        let (unwritten, free) = self.open_keys();
        self.mode = Mode::KeyText(KeyText {
            lo: 0,
            hi: self.top_node().properties.len() as u8,
            at: 0,
            free,
            escape: 0,
        });
        unwritten != 0 || free
    }

    /// `,` after a value: another key, if one can still be written, or another item, if the
    /// array may have one.
    fn next_member(&mut self) -> bool {
        let Some(&c) = self.top() else {
            return false;
        };
        if c.object {
            let (unwritten, free) = self.open_keys();
            self.mode = Mode::Key;
            return unwritten != 0 || free;
        }
        let n = self.node(c.node);
        if c.count >= u64::from(n.max_items) {
            return false;
        }
        if let Some(c) = self.top_mut() {
            c.count += 1;
        }
        self.mode = Mode::Value { node: n.items };
        true
    }

    /// One byte of a key.
    fn key_byte(&mut self, k: KeyText, b: u8) -> bool {
        let (lo, hi, at, escape) = (k.lo as usize, k.hi as usize, k.at as usize, k.escape);
        let n = self.top_node();
        let props = &n.properties;
        let written = self.top().map_or(0, |c| c.count);
        if b == b'"' && escape == 0 {
            // The key ends: a listed name whole (the shortest of the range sorts first), if
            // not written yet, or else a free key.
            if lo < hi && props[lo].name.len() == at {
                if let Some(c) = self.top_mut() {
                    c.count |= 1 << lo;
                }
                self.mode = Mode::Colon {
                    node: props[lo].node,
                };
                return written >> lo & 1 == 0;
            }
            self.mode = Mode::Colon {
                node: n.extra.unwrap_or_default(),
            };
            return k.free;
        }
        let Some(next_escape) = string_byte(escape, b) else {
            return false;
        };
        // A free key may not spell a listed name in other escapes than JSON's own (`\u`,
        // `\/`): then equal texts are equal keys, and a listed key is never written twice.
        let free = k.free && !(escape == 1 && matches!(b, b'u' | b'/') && !props.is_empty());
        let (l, h) = narrow(|i| &props[i].name, lo, hi, at, b);
        self.mode = Mode::KeyText(KeyText {
            lo: l as u8,
            hi: h as u8,
            at: k.at.saturating_add(1),
            free,
            escape: next_escape,
        });
        range_bits(l, h) & !written != 0 || free
    }

    /// Writes the shortest closing from here.
    fn closing(&self, out: &mut impl Sink) {
        self.close_innermost(out);
        let below = match self.own.len() {
            0 => self.kept.saturating_sub(1),
            _ => self.kept,
        };
        for c in self.own.iter().rev().skip(1) {
            close_container(self.schema, c, out);
        }
        for c in self.base[..below].iter().rev() {
            close_container(self.schema, c, out);
        }
    }

    /// The shortest text that closes the innermost container (or the document, with none).
    fn close_innermost(&self, out: &mut impl Sink) {
        let s = self.schema;
        let top = self.top().copied();
        let n = self.top_node();
        let written = top.map_or(0, |c| c.count);
        match self.mode {
            Mode::Start => out.put(&s.node(s.root()).shortest),
            Mode::Done => {}
            Mode::ObjectFirst => close_fresh_object(s, n, written, out),
            Mode::Key => {
                if n.required & !written != 0 {
                    close_fresh_object(s, n, written, out);
                } else {
                    // One more key must be written: the cheapest there is.
                    let (unwritten, free) = self.open_keys();
                    let cheapest = (0..n.properties.len())
                        .filter(|&i| unwritten >> i & 1 == 1)
                        .min_by_key(|&i| n.entry_len(i, s.nodes()));
                    let extra_len = n
                        .extra
                        .map(|e| n.free_key.len() + 3 + s.node(e).shortest.len());
                    match (cheapest, extra_len) {
                        (Some(i), e) if e.is_none_or(|e| n.entry_len(i, s.nodes()) <= e) => {
                            entry(s, n, i, out)
                        }
                        _ if free => {
                            out.put(b"\"");
                            out.put(&n.free_key);
                            out.put(b"\":");
                            out.put(&s.node(n.extra.unwrap_or_default()).shortest);
                        }
                        _ => {}
                    }
                    out.put(b"}");
                }
            }
            Mode::KeyText(k) => self.close_key(k, out),
            Mode::Colon { node } => {
                out.put(b":");
                out.put(&s.node(node).shortest);
                put_after(s, top, out);
            }
            Mode::Value { node } => {
                out.put(&s.node(node).shortest);
                put_after(s, top, out);
            }
            Mode::ArrayFirst => {
                for i in 0..n.min_items {
                    if i > 0 {
                        out.put(b",");
                    }
                    out.put(&s.node(n.items).shortest);
                }
                out.put(b"]");
            }
            Mode::After => put_after(s, top, out),
            Mode::Str { escape } => {
                out.put(escape_end(escape));
                out.put(b"\"");
                put_after(s, top, out);
            }
            Mode::Num { num, .. } => {
                if !num.complete() {
                    out.put(b"0");
                }
                put_after(s, top, out);
            }
            Mode::Word { word, at } => {
                out.put(&WORDS[word as usize][at as usize..]);
                put_after(s, top, out);
            }
            Mode::Literal { node, lo, hi, at } => {
                let lits = &s.node(node).literals;
                let shortest = lits[lo as usize..hi as usize]
                    .iter()
                    .min_by_key(|l| l.len())
                    .map_or(&[][..], |l| &l[at as usize..]);
                out.put(shortest);
                put_after(s, top, out);
            }
        }
    }

    /// The shortest end of a key and of its object: the cheapest of finishing one of the
    /// listed names `lo..hi` not yet written, or (`free`) closing the key as it is.
    fn close_key(&self, k: KeyText, out: &mut impl Sink) {
        let (lo, hi, at, escape) = (k.lo as usize, k.hi as usize, k.at as usize, k.escape);
        let written = self.top().map_or(0, |c| c.count);
        let props = &self.top_node().properties;
        // A free key ends the text as it is, with `0`s after it while it spells a listed
        // name (which the key would then be).
        let mut end = (lo, hi, at);
        let mut zeros = 0;
        for &b in escape_end(escape) {
            (end.0, end.1) = narrow(|i| &props[i].name, end.0, end.1, end.2, b);
            end.2 += 1;
        }
        while end.0 < end.1 && props[end.0].name.len() == end.2 {
            (end.0, end.1) = narrow(|i| &props[i].name, end.0, end.1, end.2, b'0');
            end.2 += 1;
            zeros += 1;
        }
        let options = (lo..hi)
            .filter(|&i| written >> i & 1 == 0)
            .map(Some)
            .chain(k.free.then_some(None));
        let cost = |o: Option<usize>| {
            let mut n = Count::default();
            self.finish_key(o, at, escape, zeros, &mut n);
            n.0
        };
        if let Some(best) = options.min_by_key(|&o| cost(o)) {
            self.finish_key(best, at, escape, zeros, out);
        }
    }

    /// Finishes the key as listed property `prop` (none: as a free key, with `zeros` `0`s
    /// after the text), writes its shortest value, and closes the object.
    fn finish_key(
        &self,
        prop: Option<usize>,
        at: usize,
        escape: u8,
        zeros: usize,
        out: &mut impl Sink,
    ) {
        let s = self.schema;
        let n = self.top_node();
        let mut written = self.top().map_or(0, |c| c.count);
        let value = match prop {
            Some(i) => {
                out.put(&n.properties[i].name[at..]);
                written |= 1 << i;
                n.properties[i].node
            }
            None => {
                out.put(escape_end(escape));
                for _ in 0..zeros {
                    out.put(b"0");
                }
                n.extra.unwrap_or_default()
            }
        };
        out.put(b"\":");
        out.put(&s.node(value).shortest);
        for p in missing(n, written) {
            out.put(b",");
            entry(s, n, p, out);
        }
        out.put(b"}");
    }
}

/// The closing of container `top` once its current value is complete.
fn put_after(schema: &Schema, top: Option<Container>, out: &mut impl Sink) {
    if let Some(c) = top {
        close_container(schema, &c, out);
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
    /// The characters some token's text is exactly.
    singles: HashSet<char>,
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
        let singles = texts
            .iter()
            .filter_map(|t| {
                let s = std::str::from_utf8(t).ok()?;
                let mut chars = s.chars();
                chars.next().filter(|_| chars.next().is_none())
            })
            .collect();
        TokenTexts {
            texts,
            plain,
            by_first,
            singles,
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

/// What JSON output needs: the vocabulary's texts and the schema the document follows.
#[derive(Clone, Debug)]
pub struct JsonOutput {
    texts: Arc<TokenTexts>,
    schema: Arc<Schema>,
}

impl JsonOutput {
    /// JSON output of `schema` over the vocabulary `texts`; refused if the vocabulary lacks a
    /// token for a character that closing a document may need (the budget counts one token
    /// per character).
    pub fn new(texts: Arc<TokenTexts>, schema: Arc<Schema>) -> Result<JsonOutput> {
        if let Some(c) = schema
            .closing_chars()
            .into_iter()
            .find(|c| !texts.singles.contains(c))
        {
            return Err(ModelError::Input(format!(
                "JSON output: the vocabulary has no token for the character {c:?}, which \
                 closing a document of this schema may need"
            )));
        }
        Ok(JsonOutput { texts, schema })
    }

    /// The length of the schema's shortest document.
    pub fn shortest_document_len(&self) -> usize {
        self.schema.shortest_document_len()
    }

    /// Any JSON object.
    pub fn any_object(texts: Arc<TokenTexts>) -> Result<JsonOutput> {
        JsonOutput::new(texts, Arc::new(Schema::any_object()))
    }
}

/// The JSON constraint of one generation: the document so far.
#[derive(Clone, Debug)]
pub struct JsonConstraint {
    output: JsonOutput,
    state: JsonState,
}

impl JsonConstraint {
    /// Nothing written yet.
    pub fn new(output: JsonOutput) -> JsonConstraint {
        JsonConstraint {
            output,
            state: JsonState::new(),
        }
    }

    /// Whether the document is complete.
    pub fn is_complete(&self) -> bool {
        self.state.is_complete()
    }

    /// Which of `vocab` tokens may come next when at most `left` more tokens may follow it:
    /// those whose text keeps the document a valid prefix that can close in `left` tokens.
    pub fn allowed(&self, vocab: usize, left: usize) -> Result<Vec<bool>> {
        let (texts, schema) = (&*self.output.texts, &*self.output.schema);
        // Inside a string value, or a key that can only be free, most tokens are plain text,
        // which leaves the state as it is.
        let in_plain_text = matches!(
            self.state.mode,
            Mode::Str { escape: 0 }
                | Mode::KeyText(KeyText {
                    lo: 0,
                    hi: 0,
                    free: true,
                    escape: 0,
                    ..
                })
        );
        let plain_fits = in_plain_text && self.state.closing_len(schema) <= left;
        let mut allowed = vec![false; vocab];
        let mut own = Vec::new();
        for (first, ids) in texts.by_first.iter().enumerate() {
            if ids.is_empty() {
                continue;
            }
            let mut probe = Cursor::new(schema, &self.state, &mut own);
            if !probe.push(first as u8) {
                continue;
            }
            // Where the first byte leaves the containers as they are (white space, most
            // bytes of a string or a number), every token of the group starts after it.
            let after_first = (probe.own.is_empty() && probe.kept == self.state.stack.len())
                .then_some(probe.mode);
            for &id in ids.iter().filter(|&&id| (id as usize) < vocab) {
                let i = id as usize;
                allowed[i] = if in_plain_text && texts.plain[i] {
                    plain_fits
                } else {
                    let mut c = Cursor::new(schema, &self.state, &mut own);
                    let rest = match after_first {
                        Some(mode) => {
                            c.mode = mode;
                            &texts.texts[i][1..]
                        }
                        None => &texts.texts[i][..],
                    };
                    c.push_all(rest) && {
                        let mut n = Count::default();
                        c.closing(&mut n);
                        n.0 <= left
                    }
                };
            }
        }
        if !allowed.contains(&true) {
            return Err(ModelError::Input(format!(
                "JSON output: no token continues the document within {left} more tokens \
                 (at least {} characters are needed to close it)",
                self.state.closing_len(schema)
            )));
        }
        Ok(allowed)
    }

    /// Takes the chosen token.
    pub fn push(&mut self, id: u32) -> Result<()> {
        let (texts, schema) = (&*self.output.texts, &*self.output.schema);
        self.state = self.state.push_all(schema, texts.text(id)).ok_or_else(|| {
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
    use serde_json::{json, Value};

    fn objects() -> Schema {
        Schema::any_object()
    }

    fn accepts(schema: &Schema, text: &str) -> Option<JsonState> {
        JsonState::new().push_all(schema, text.as_bytes())
    }

    fn schema(v: Value) -> Schema {
        Schema::parse(&v).expect("a schema")
    }

    /// JSON Schema's own meaning of the keywords [`Schema::parse`] takes (an absent
    /// `additionalProperties` allows any other key), to check documents against.
    fn validates(schema: &Value, v: &Value) -> bool {
        let Value::Object(s) = schema else {
            return schema == &Value::Bool(true);
        };
        if s.get("enum")
            .and_then(Value::as_array)
            .is_some_and(|e| !e.contains(v))
            || s.get("const").is_some_and(|c| c != v)
        {
            return false;
        }
        if let Some(t) = s.get("type") {
            let names: Vec<&str> = match t {
                Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
                one => one.as_str().into_iter().collect(),
            };
            let ok = names.iter().any(|&n| match n {
                "string" => v.is_string(),
                "number" => v.is_number(),
                "integer" => v.as_f64().is_some_and(|f| f.fract() == 0.0),
                "boolean" => v.is_boolean(),
                "null" => v.is_null(),
                "object" => v.is_object(),
                "array" => v.is_array(),
                _ => false,
            });
            if !ok {
                return false;
            }
        }
        match v {
            Value::Object(o) => {
                let props = s.get("properties").and_then(Value::as_object);
                let required = s.get("required").and_then(Value::as_array);
                if required.is_some_and(|r| r.iter().any(|k| !o.contains_key(k.as_str().unwrap())))
                {
                    return false;
                }
                o.iter().all(|(k, x)| match props.and_then(|p| p.get(k)) {
                    Some(sub) => validates(sub, x),
                    None => s
                        .get("additionalProperties")
                        .is_none_or(|extra| validates(extra, x)),
                })
            }
            Value::Array(a) => {
                let n = a.len() as u64;
                s.get("minItems")
                    .and_then(Value::as_u64)
                    .is_none_or(|m| n >= m)
                    && s.get("maxItems")
                        .and_then(Value::as_u64)
                        .is_none_or(|m| n <= m)
                    && s.get("items")
                        .is_none_or(|it| a.iter().all(|x| validates(it, x)))
            }
            _ => true,
        }
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
            let s = accepts(&objects(), doc).unwrap_or_else(|| panic!("refused {doc:?}"));
            assert!(s.is_complete(), "{doc:?}");
            serde_json::from_str::<Value>(doc).expect("valid JSON");
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
                accepts(&objects(), bad)
                    .is_none_or(|s| !s.is_complete() && s.push_all(&objects(), b"}").is_none()),
                "accepted {bad:?}"
            );
        }
        let deep = format!("{{\"a\":{}", "[".repeat(MAX_DEPTH - 1));
        assert!(accepts(&objects(), &deep).is_some());
        assert!(
            accepts(&objects(), &format!("{deep}[")).is_none(),
            "too deep"
        );
    }

    #[test]
    fn a_schema_is_followed_key_by_key() {
        let v = json!({
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "ages": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 2},
                "kind": {"enum": ["cat", "dog", 1, 10, {"a": [true]}, null]},
                "ok": {"type": ["boolean", "null"]},
            },
            "required": ["name", "kind"],
        });
        let s = schema(v.clone());
        for doc in [
            r#"{"name": "Tom", "kind": "cat"}"#,
            r#"{"kind":10,"name":"","age":-3,"ages":[1.5e3],"ok":null}"#,
            r#"{"kind": 1, "name": "x", "ok": false, "ages": [0, 2]}"#,
            r#"{"name":"\u00e9\"","kind":{"a":[true]}}"#,
            r#"{"kind":null,"name":"a"}"#,
        ] {
            let st = accepts(&s, doc).unwrap_or_else(|| panic!("refused {doc}"));
            assert!(st.is_complete(), "{doc}");
            assert!(validates(&v, &serde_json::from_str(doc).unwrap()), "{doc}");
        }
        for bad in [
            r#"{"name": "Tom"}"#,         // kind is required
            r#"{"name": 5"#,              // a string
            r#"{"age": 1.5"#,             // an integer
            r#"{"age": 1e3"#,             // an integer
            r#"{"colour""#,               // not a listed key
            r#"{"name": "a", "name""#,    // written twice
            r#"{"kind": "cow""#,          // not in the enum
            r#"{"kind": 100"#,            // not in the enum
            r#"{"kind": {"a": [ true]}"#, // enum literals are compact
            r#"{"ages": []"#,             // minItems
            r#"{"ages": [1, 2, 3"#,       // maxItems
            r#"{"ok": 0"#,                // boolean or null
            r#"{"n\u0061me""#,            // a listed key in other escapes
        ] {
            let st = accepts(&s, bad);
            assert!(
                st.as_ref()
                    .is_none_or(|st| !st.is_complete() && st.push_all(&s, b"}").is_none()),
                "accepted {bad}: {st:?}"
            );
        }
        // Free keys, where the schema allows them, may not spell a listed key in escapes.
        let s = schema(
            json!({"type": "object", "properties": {"a/b": {"type": "null"}}, "additionalProperties": true}),
        );
        assert!(accepts(&s, r#"{"x": [1], "a/b": null}"#).is_some_and(|st| st.is_complete()));
        assert!(accepts(&s, r#"{"a\/b""#).is_none());
        assert!(accepts(&s, r#"{"\u0078""#).is_none());
        assert!(accepts(&s, r#"{"x\n": 1}"#).is_some());
    }

    #[test]
    fn the_shortest_closing_writes_what_is_missing() {
        let s = schema(json!({
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "tags": {"type": "array", "items": {"enum": ["xx", "y"]}, "minItems": 2},
                "n": {"type": "integer"},
                "nested": {"type": "object", "properties": {"deep": {"const": "abc"}}, "required": ["deep"]},
            },
            "required": ["tags", "nested", "name"],
        }));
        for (prefix, closing) in [
            (
                "",
                r#"{"name":"","nested":{"deep":"abc"},"tags":["y","y"]}"#,
            ),
            (
                r#"{"nam"#,
                r#"e":"","nested":{"deep":"abc"},"tags":["y","y"]}"#,
            ),
            // `n` itself would need `":0` and then `name` too.
            (
                r#"{"n"#,
                r#"ame":"","nested":{"deep":"abc"},"tags":["y","y"]}"#,
            ),
            (
                r#"{"name":"", "n"#,
                r#"ested":{"deep":"abc"},"tags":["y","y"]}"#,
            ),
            (
                r#"{"tags": ["xx""#,
                r#","y"],"name":"","nested":{"deep":"abc"}}"#,
            ),
            (
                r#"{"nested": {"deep": "a"#,
                r#"bc"},"name":"","tags":["y","y"]}"#,
            ),
            (
                r#"{"name": "\u00"#,
                r#"00","nested":{"deep":"abc"},"tags":["y","y"]}"#,
            ),
        ] {
            let st = accepts(&s, prefix).unwrap_or_else(|| panic!("refused {prefix}"));
            assert_eq!(
                String::from_utf8(st.closing(&s)).unwrap(),
                closing,
                "{prefix}"
            );
            assert_eq!(st.closing_len(&s), closing.len());
        }
    }

    /// Schemas of every kind [`Schema::parse`] takes, with names that share prefixes and
    /// need escapes.
    fn json_schema() -> impl Strategy<Value = Value> {
        let scalar = prop_oneof![
            Just(json!({"type": "string"})),
            Just(json!({"type": "number"})),
            Just(json!({"type": "integer"})),
            Just(json!({"type": "boolean"})),
            Just(json!({"type": "null"})),
            Just(json!({"type": ["string", "null"]})),
            Just(json!({"enum": ["a", "ab", "b\"", 1, 10, -2.5, true, null]})),
            Just(json!({"type": "integer", "enum": [3, 30, "x"]})),
            Just(json!({"const": "só"})),
            Just(json!({})),
        ];
        let names = prop::sample::select(vec!["a", "ab", "abc", "b", "é", "q\"", "x\ny", "/", ""]);
        scalar.prop_recursive(3, 24, 4, move |inner| {
            prop_oneof![
                (inner.clone(), 0u64..3, prop::option::of(0u64..3)).prop_map(|(it, min, more)| {
                    let mut a = json!({"type": "array", "items": it, "minItems": min});
                    if let Some(m) = more {
                        a["maxItems"] = json!(min + m);
                    }
                    a
                }),
                (
                    prop::collection::btree_map(names.clone(), inner.clone(), 0..4),
                    any::<u8>(),
                    prop::option::of(prop_oneof![Just(json!(true)), Just(json!(false)), inner]),
                )
                    .prop_map(|(props, req, extra)| {
                        let required: Vec<&&str> = props
                            .keys()
                            .enumerate()
                            .filter(|(i, _)| req >> i & 1 == 1)
                            .map(|(_, k)| k)
                            .collect();
                        let mut o = json!({"type": "object", "properties": props, "required": required});
                        if let Some(e) = extra {
                            o["additionalProperties"] = e;
                        }
                        o
                    }),
            ]
        })
        .prop_map(|s| match s.get("type").and_then(Value::as_str) {
            Some("object" | "array") => s,
            _ => json!({"type": "array", "items": s}),
        })
    }

    /// Dice from a seed, for walks the schema decides the shape of.
    struct Dice(u64);

    impl Dice {
        fn roll(&mut self, n: usize) -> usize {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 % n.max(1) as u64) as usize
        }
    }

    /// A value of `schema` that the recogniser must take: listed keys, and others only where
    /// the schema asks for them.
    fn instance(schema: &Value, d: &mut Dice, depth: usize) -> Value {
        let s = schema.as_object().cloned().unwrap_or_default();
        if let Some(e) = s.get("enum").and_then(Value::as_array) {
            let kept: Vec<&Value> = e.iter().filter(|v| validates(schema, v)).collect();
            return kept[d.roll(kept.len())].clone();
        }
        if let Some(c) = s.get("const") {
            return c.clone();
        }
        let types: Vec<&str> = match s.get("type") {
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
            Some(t) => t.as_str().into_iter().collect(),
            None if depth > 3 => vec!["null", "number"],
            None => vec!["string", "number", "boolean", "null", "object", "array"],
        };
        match types[d.roll(types.len())] {
            "string" => json!(["", "hi \"there\"", "é\\😀", "\u{7}"][d.roll(4)]),
            "number" => json!([0.5, -12.0, 3e10, 7.0][d.roll(4)]),
            "integer" => json!([0, -1, 42, 1_000_000][d.roll(4)]),
            "boolean" => json!(d.roll(2) == 0),
            "null" => Value::Null,
            "object" => {
                let props = s.get("properties").and_then(Value::as_object);
                let required: Vec<&str> = s
                    .get("required")
                    .and_then(Value::as_array)
                    .map(|r| r.iter().filter_map(Value::as_str).collect())
                    .unwrap_or_default();
                let mut o = serde_json::Map::new();
                for (k, sub) in props.into_iter().flatten() {
                    if required.contains(&k.as_str()) || d.roll(2) == 0 {
                        o.insert(k.clone(), instance(sub, d, depth + 1));
                    }
                }
                let extra = match s.get("additionalProperties") {
                    Some(Value::Bool(false)) => None,
                    None if props.is_some() => None,
                    Some(e) => Some(e.clone()),
                    None => Some(json!({})),
                };
                if let Some(e) = extra {
                    for k in ["zz", "ünï", "a b"] {
                        if props.is_none_or(|p| !p.contains_key(k)) && d.roll(3) == 0 {
                            o.insert(k.into(), instance(&e, d, depth + 1));
                        }
                    }
                }
                Value::Object(o)
            }
            _ => {
                let min = s.get("minItems").and_then(Value::as_u64).unwrap_or(0) as usize;
                let max = s
                    .get("maxItems")
                    .and_then(Value::as_u64)
                    .map_or(min + 3, |m| m as usize);
                let items = s.get("items").cloned().unwrap_or(json!({}));
                let n = min + d.roll(max - min + 1);
                Value::Array((0..n).map(|_| instance(&items, d, depth + 1)).collect())
            }
        }
    }

    /// What a random walk tries to write: JSON's own bytes, and a two-byte letter.
    const WALK: [&str; 39] = [
        "{", "}", "[", "]", "\"", ":", ",", " ", "0", "1", "2", "5", "9", "-", ".", "e", "E", "+",
        "a", "b", "n", "q", "t", "r", "u", "f", "l", "s", "x", "y", "z", "\\", "/", "é", "\n", "c",
        "h", "i", "o",
    ];

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Every prefix of a valid document is accepted, only the whole is complete, and every
        /// prefix closes with `closing()` (whose length `closing_len` gives) into a document
        /// that validates.
        #[test]
        fn prefixes_close_into_valid_documents(v in json_schema(), seed in 1u64.., pretty in any::<bool>()) {
            let s = schema(v.clone());
            let doc = instance(&v, &mut Dice(seed), 0);
            prop_assert!(validates(&v, &doc), "the instance generator: {}", doc);
            let text = if pretty {
                serde_json::to_string_pretty(&doc).unwrap()
            } else {
                serde_json::to_string(&doc).unwrap()
            };
            let mut st = JsonState::new();
            for (i, &b) in text.as_bytes().iter().enumerate() {
                prop_assert!(!st.is_complete());
                let closing = st.closing(&s);
                prop_assert_eq!(closing.len(), st.closing_len(&s), "{:?}", st);
                let closed = st.push_all(&s, &closing);
                prop_assert!(closed.is_some_and(|c| c.is_complete()), "{:?} + {:?}", &text[..i], String::from_utf8_lossy(&closing));
                if text.is_char_boundary(i) {
                    let whole = format!("{}{}", &text[..i], String::from_utf8_lossy(&closing));
                    let parsed: Value = serde_json::from_str(&whole).map_err(|e| TestCaseError::fail(format!("{whole}: {e}")))?;
                    prop_assert!(validates(&v, &parsed), "{} does not validate against {}", whole, v);
                }
                st = st.push_all(&s, &[b]).ok_or_else(|| TestCaseError::fail(format!("refused {:?} after {:?} ({})", b as char, &text[..i], v)))?;
            }
            prop_assert!(st.is_complete());
            prop_assert_eq!(st.closing_len(&s), 0);
        }

        /// Whatever a walk through accepted bytes writes, closed, validates: the recogniser
        /// accepts nothing the schema does not.
        #[test]
        fn accepted_text_always_validates(v in json_schema(), seed in 1u64.., steps in 0usize..80) {
            let s = schema(v.clone());
            let mut d = Dice(seed);
            let mut st = JsonState::new();
            let mut text = Vec::new();
            for _ in 0..steps {
                if st.is_complete() {
                    break;
                }
                let next: Vec<&str> = WALK
                    .iter()
                    .copied()
                    .filter(|w| st.push_all(&s, w.as_bytes()).is_some())
                    .collect();
                if next.is_empty() {
                    break;
                }
                let w = next[d.roll(next.len())];
                st = st.push_all(&s, w.as_bytes()).unwrap();
                text.extend_from_slice(w.as_bytes());
            }
            let closing = st.closing(&s);
            text.extend_from_slice(&closing);
            let text = String::from_utf8(text).unwrap();
            let parsed: Value = serde_json::from_str(&text).map_err(|e| TestCaseError::fail(format!("{text}: {e}")))?;
            prop_assert!(validates(&v, &parsed), "{} does not validate against {}", text, v);
        }

        /// The shortcut for plain text allows exactly what running each token's text through
        /// the recogniser allows.
        #[test]
        fn allowed_is_each_token_run_through(v in json_schema(), seed in 1u64.., cut in 0.0f64..1.0, left in 0usize..40) {
            let texts = ["a", "é", " x", "\"", "\\", "\\n", "\"}", "\":", "1", "}", "]", ",\"", "\u{1}", "{\"", "0\"", "[", "{", ":", ",", "0", "n", "r", "u", "e", "l", "s", "b", "q", "y", "/", "ó", "t", "f"];
            let vocab = Arc::new(TokenTexts::from_texts(texts.map(String::from)));
            let s = Arc::new(schema(v.clone()));
            let doc = serde_json::to_string(&instance(&v, &mut Dice(seed), 0)).unwrap();
            let mut at = (doc.len() as f64 * cut) as usize;
            while !doc.is_char_boundary(at) {
                at -= 1;
            }
            let mut c = JsonConstraint::new(JsonOutput { texts: vocab, schema: s.clone() });
            c.state = JsonState::new().push_all(&s, &doc.as_bytes()[..at]).unwrap();
            if let Ok(allowed) = c.allowed(texts.len(), left) {
                for (i, t) in texts.iter().enumerate() {
                    let want = c.state.push_all(&s, t.as_bytes()).is_some_and(|st| st.closing_len(&s) <= left);
                    prop_assert_eq!(allowed[i], want, "{:?} after {:?}", t, &doc[..at]);
                }
            }
        }

        /// Sampling any allowed token at every step ends in a document that validates, within
        /// the budget, whenever the budget can hold the shortest document.
        #[test]
        fn constrained_generation_always_validates(v in json_schema(), seed in 1u64.., extra in 0usize..30) {
            let texts = ["a", "é", " x", "\"", "\\", "\\n", "\"}", "\":", "1", "}", "]", ",\"", "{\"", "0\"", "[", "{", ":", ",", "0", "n", "r", "u", "e", "l", "s", "b", "q", "y", "/", "ó", "t", "f", "\n", "x", "-", ".", "5", "c", "h", "i", "ü", "z", "ñ", " "];
            let vocab = Arc::new(TokenTexts::from_texts(texts.map(String::from)));
            let s = Arc::new(schema(v.clone()));
            let Ok(out) = JsonOutput::new(vocab, s.clone()) else {
                // Names with characters this vocabulary lacks.
                return Ok(());
            };
            let mut c = JsonConstraint::new(out);
            let mut d = Dice(seed);
            let budget = JsonState::new().closing_len(&s) + extra;
            let mut text = String::new();
            for step in 0..budget {
                let allowed = c.allowed(texts.len(), budget - step - 1).map_err(|e| TestCaseError::fail(format!("{text}: {e}")))?;
                let ids: Vec<usize> = (0..texts.len()).filter(|&i| allowed[i]).collect();
                let id = ids[d.roll(ids.len())];
                c.push(id as u32).unwrap();
                text.push_str(texts[id]);
                if c.is_complete() {
                    break;
                }
            }
            prop_assert!(c.is_complete(), "{} is not closed within {} tokens", text, budget);
            let parsed: Value = serde_json::from_str(&text).map_err(|e| TestCaseError::fail(format!("{text}: {e}")))?;
            prop_assert!(validates(&v, &parsed), "{} does not validate against {}", text, v);
        }

        /// Whatever the recogniser calls complete is valid JSON with an object on top.
        #[test]
        fn complete_means_valid(text in "[{}\\[\\]\":,0-9a-z.eE+\\- \\\\]{0,24}") {
            if accepts(&objects(), &text).is_some_and(|s| s.is_complete()) {
                let v: Value = serde_json::from_str(&text).expect("valid JSON");
                prop_assert!(v.is_object());
            }
        }
    }

    #[test]
    fn only_tokens_that_continue_and_can_close_are_allowed() {
        let texts = [
            "{", "}", "\"", "a", ":", "1", " {\"", "]", "", "\"}", "x\":", "0", ",", "[", "n", "r",
            "u", "e", "l", "s",
        ];
        let vocab = Arc::new(TokenTexts::from_texts(texts.map(String::from)));
        let mut c = JsonConstraint::new(JsonOutput::any_object(vocab).unwrap());
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
            [
                "{", "}", "\"", "a", ":", "1", " {\"", "]", "x\":", "0", ",", "[", "n", "r", "u",
                "e", "l", "s"
            ]
        );
        // `"` leaves `:0}` to write, `a` `":0}`, `x":` only `0}`.
        assert_eq!(allowed(&c, 3), ["\"", " {\"", "x\":"]);
        assert_eq!(allowed(&c, 2), ["x\":"]);
        c.push(10).unwrap();
        assert_eq!(allowed(&c, 1), ["1", "0"]);
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

    #[test]
    fn a_vocabulary_that_cannot_close_a_schema_is_refused() {
        let vocab = Arc::new(TokenTexts::from_texts(
            [
                "{", "}", "\"", ":", ",", "0", "[", "]", "n", "r", "u", "e", "l", "s", "a",
            ]
            .map(String::from),
        ));
        let ok = schema(
            json!({"type": "object", "properties": {"a": {"type": "number"}}, "required": ["a"]}),
        );
        assert!(JsonOutput::new(vocab.clone(), Arc::new(ok)).is_ok());
        let needs_z = schema(json!({"type": "object", "properties": {"z": {"type": "number"}}}));
        let e = JsonOutput::new(vocab, Arc::new(needs_z)).expect_err("no token for z");
        assert!(e.to_string().contains("'z'"), "{e}");
    }
}
