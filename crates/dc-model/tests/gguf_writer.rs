//! A minimal GGUF writer for tests: builds files byte by byte, including broken ones.
//!
//! Included as a module by the GGUF test files (`#[path = "gguf_writer.rs"] mod gguf_writer;`);
//! on its own it only tests itself. It follows the spec literally and shares no code with the
//! reader it tests.

#![allow(dead_code)]

/// A metadata value to write.
#[derive(Clone, Debug)]
pub enum Val {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    /// Element type tag, elements (all of that type).
    Arr(u32, Vec<Val>),
    U64(u64),
    I64(i64),
    F64(f64),
    /// Raw bytes after the type tag (for malformed values); the tag is given.
    Raw(u32, Vec<u8>),
}

impl Val {
    pub fn tag(&self) -> u32 {
        match self {
            Val::U8(_) => 0,
            Val::I8(_) => 1,
            Val::U16(_) => 2,
            Val::I16(_) => 3,
            Val::U32(_) => 4,
            Val::I32(_) => 5,
            Val::F32(_) => 6,
            Val::Bool(_) => 7,
            Val::Str(_) => 8,
            Val::Arr(..) => 9,
            Val::U64(_) => 10,
            Val::I64(_) => 11,
            Val::F64(_) => 12,
            Val::Raw(t, _) => *t,
        }
    }

    fn write_payload(&self, out: &mut Vec<u8>) {
        match self {
            Val::U8(v) => out.extend(v.to_le_bytes()),
            Val::I8(v) => out.extend(v.to_le_bytes()),
            Val::U16(v) => out.extend(v.to_le_bytes()),
            Val::I16(v) => out.extend(v.to_le_bytes()),
            Val::U32(v) => out.extend(v.to_le_bytes()),
            Val::I32(v) => out.extend(v.to_le_bytes()),
            Val::F32(v) => out.extend(v.to_le_bytes()),
            Val::Bool(v) => out.push(u8::from(*v)),
            Val::Str(s) => write_str(out, s),
            Val::Arr(t, items) => {
                out.extend(t.to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                for it in items {
                    it.write_payload(out);
                }
            }
            Val::U64(v) => out.extend(v.to_le_bytes()),
            Val::I64(v) => out.extend(v.to_le_bytes()),
            Val::F64(v) => out.extend(v.to_le_bytes()),
            Val::Raw(_, bytes) => out.extend(bytes),
        }
    }
}

pub fn s(v: &str) -> Val {
    Val::Str(v.to_string())
}

pub fn str_arr(items: &[&str]) -> Val {
    Val::Arr(8, items.iter().map(|x| s(x)).collect())
}

pub fn write_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// A tensor to write: GGUF dims (ne0 first), GGML type id, raw data bytes.
#[derive(Clone, Debug)]
pub struct Tensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: u32,
    pub data: Vec<u8>,
    /// Overrides the computed offset (for malformed files).
    pub offset: Option<u64>,
}

/// A GGUF file under construction.
#[derive(Clone, Debug)]
pub struct Gguf {
    pub version: u32,
    pub kv: Vec<(String, Val)>,
    pub tensors: Vec<Tensor>,
    /// Alignment used to lay out data (write `general.alignment` yourself to declare it).
    pub alignment: u64,
}

impl Default for Gguf {
    fn default() -> Self {
        Gguf {
            version: 3,
            kv: Vec::new(),
            tensors: Vec::new(),
            alignment: 32,
        }
    }
}

impl Gguf {
    pub fn kv(mut self, key: &str, v: Val) -> Self {
        self.kv.push((key.to_string(), v));
        self
    }

    pub fn tensor(mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) -> Self {
        self.tensors.push(Tensor {
            name: name.to_string(),
            dims: dims.to_vec(),
            ty,
            data,
            offset: None,
        });
        self
    }

    /// The header up to the end of the tensor directory, and the offsets used.
    pub fn build(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend(b"GGUF");
        out.extend(self.version.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.kv.len() as u64).to_le_bytes());
        for (k, v) in &self.kv {
            write_str(&mut out, k);
            out.extend(v.tag().to_le_bytes());
            v.write_payload(&mut out);
        }
        let a = self.alignment;
        let mut offsets = Vec::new();
        let mut off = 0u64;
        for t in &self.tensors {
            offsets.push(t.offset.unwrap_or(off));
            off += t.data.len() as u64;
            off = off.div_ceil(a) * a;
        }
        for (t, o) in self.tensors.iter().zip(&offsets) {
            write_str(&mut out, &t.name);
            out.extend((t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(t.ty.to_le_bytes());
            out.extend(o.to_le_bytes());
        }
        let data_start = (out.len() as u64).div_ceil(a) * a;
        out.resize(data_start as usize, 0);
        let mut pos = 0u64;
        for t in &self.tensors {
            let target = data_start + pos;
            out.resize(target as usize, 0);
            out.extend(&t.data);
            pos += t.data.len() as u64;
            pos = pos.div_ceil(a) * a;
        }
        if !self.tensors.is_empty() {
            let end = (out.len() as u64).div_ceil(a) * a;
            out.resize(end as usize, 0);
        }
        out
    }
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// GGML type ids.
pub mod ty {
    pub const F32: u32 = 0;
    pub const F16: u32 = 1;
    pub const Q4_0: u32 = 2;
    pub const Q4_1: u32 = 3;
    pub const Q5_0: u32 = 6;
    pub const Q5_1: u32 = 7;
    pub const Q8_0: u32 = 8;
    pub const Q4_K: u32 = 12;
    pub const Q6_K: u32 = 14;
    pub const IQ2_XS: u32 = 17;
    pub const BF16: u32 = 30;
}

/// Llama metadata for a model of `layers` layers, hidden 8, 2 heads / 1 kv head, FFN 16.
pub fn llama_meta(g: Gguf, layers: u32) -> Gguf {
    g.kv("general.architecture", s("llama"))
        .kv("llama.block_count", Val::U32(layers))
        .kv("llama.context_length", Val::U32(64))
        .kv("llama.embedding_length", Val::U32(8))
        .kv("llama.feed_forward_length", Val::U32(16))
        .kv("llama.attention.head_count", Val::U32(2))
        .kv("llama.attention.head_count_kv", Val::U32(1))
        .kv("llama.attention.layer_norm_rms_epsilon", Val::F32(1e-5))
        .kv("llama.rope.freq_base", Val::F32(10000.0))
}

/// A unique scratch file path for this test process.
pub fn scratch(name: &str) -> std::path::PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!("dc-model-gguf-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir.join(format!("{}-{name}", N.fetch_add(1, Ordering::Relaxed)))
}

/// Writes `bytes` to a scratch file and returns its path.
pub fn write_file(name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let p = scratch(name);
    std::fs::write(&p, bytes).expect("write scratch file");
    p
}

#[test]
fn writer_lays_out_aligned_data() {
    let g = Gguf::default()
        .kv("k", Val::U8(1))
        .tensor("a", &[3], ty::F32, f32_bytes(&[1.0, 2.0, 3.0]))
        .tensor("b", &[1], ty::F32, f32_bytes(&[4.0]));
    let b = g.build();
    assert_eq!(&b[..4], b"GGUF");
    assert_eq!(b.len() % 32, 0);
}
