//! The GGUF container: header, metadata and tensor directory, parsed from untrusted bytes.
//!
//! This module owns the rule that nothing in a file is believed before it is checked: every
//! count, length and offset is compared with the bytes that are actually left (and with the
//! caps in [`super`]) before anything is allocated or indexed, and all arithmetic on file
//! values is overflow-checked. It never panics on any input and never allocates more than a
//! small multiple of the file's size. It knows nothing of model architectures.

use std::collections::{HashMap, HashSet};

use super::dequant::GgmlType;
use super::value::{GgufArray, GgufType, GgufValue};
use super::{
    DEFAULT_ALIGNMENT, MAX_ALIGNMENT, MAX_ARRAY_DEPTH, MAX_ARRAY_LEN, MAX_DIMS, MAX_KEY_LEN,
    MAX_KV_COUNT, MAX_STRING_LEN, MAX_TENSOR_COUNT, MAX_TENSOR_NAME_LEN,
};

/// The magic bytes every GGUF file starts with.
pub const MAGIC: &[u8; 4] = b"GGUF";

/// What went wrong reading a file; the caller adds the path.
#[derive(Debug)]
pub(crate) enum ParseError {
    /// The bytes are not a valid GGUF file.
    Format(String),
    /// Valid, but uses something we do not read (version, big-endian, tensor type).
    Unsupported { what: &'static str, value: String },
}

type Result<T> = std::result::Result<T, ParseError>;

fn bad(detail: impl Into<String>) -> ParseError {
    ParseError::Format(detail.into())
}

/// One entry of the tensor directory, validated against the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufTensorInfo {
    /// The tensor's name in the file (llama.cpp naming, e.g. `blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions in GGUF order: `dims[0]` (ne0) is the fastest-varying axis.
    pub dims: Vec<u64>,
    /// Element type.
    pub ggml_type: GgmlType,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
    /// Absolute offset of the data in the file.
    pub file_offset: u64,
    /// Size of the data in bytes.
    pub n_bytes: u64,
}

impl GgufTensorInfo {
    /// Number of elements (product of the dimensions; checked not to overflow when parsed).
    pub fn numel(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A parsed and validated file layout.
#[derive(Debug)]
pub(crate) struct Container {
    pub version: u32,
    pub metadata: Vec<(String, GgufValue)>,
    pub tensors: Vec<GgufTensorInfo>,
    pub alignment: u64,
    pub data_start: u64,
}

/// A read position over the file's bytes.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(bad(format!(
                "{} at byte {} needs {n} bytes, but only {} are left in the file ({} bytes)",
                what(),
                self.pos,
                self.remaining(),
                self.buf.len()
            )));
        }
        // n <= remaining <= usize::MAX, so the cast is lossless.
        let n = n as usize;
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A length-prefixed UTF-8 string of at most `max` bytes.
    fn string(&mut self, max: u64, what: &dyn Fn() -> String) -> Result<String> {
        let at = self.pos;
        let len = self.u64(&|| format!("{} length", what()))?;
        if len > max {
            return Err(bad(format!(
                "{} at byte {at}: length {len} exceeds the limit of {max} bytes",
                what()
            )));
        }
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|e| bad(format!("{} at byte {at}: not UTF-8 ({e})", what())))
    }

    /// Refuses `count` elements of at least `min_size` bytes each when they cannot fit in
    /// what is left of the file: this is what bounds every allocation by the file's size.
    fn check_fits(&self, count: u64, min_size: u64, what: &dyn Fn() -> String) -> Result<()> {
        match count.checked_mul(min_size) {
            Some(need) if need <= self.remaining() => Ok(()),
            _ => Err(bad(format!(
                "{}: {count} entries of at least {min_size} bytes cannot fit in the {} bytes left \
                 at byte {} (file is {} bytes)",
                what(),
                self.remaining(),
                self.pos,
                self.buf.len()
            ))),
        }
    }
}

/// Parses and validates the whole layout of a GGUF v2/v3 file held in `buf`.
pub(crate) fn parse(buf: &[u8]) -> Result<Container> {
    let mut c = Cursor { buf, pos: 0 };
    let magic: [u8; 4] = c.array(&|| "magic".into())?;
    if &magic != MAGIC {
        return Err(bad(format!(
            "not a GGUF file: starts with {magic:02x?}, expected \"GGUF\""
        )));
    }
    let version = c.u32(&|| "version".into())?;
    match version {
        2 | 3 => {}
        1 => {
            return Err(ParseError::Unsupported {
                what: "GGUF version",
                value: "1 (32-bit counts; re-convert the model with a current llama.cpp)".into(),
            })
        }
        v if (1..=3).contains(&v.swap_bytes()) => {
            return Err(ParseError::Unsupported {
                what: "GGUF byte order",
                value: format!("big-endian (version field {v:#010x})"),
            })
        }
        v => return Err(bad(format!("unknown GGUF version {v}"))),
    }
    let tensor_count = c.u64(&|| "tensor count".into())?;
    let kv_count = c.u64(&|| "metadata count".into())?;
    if tensor_count > MAX_TENSOR_COUNT {
        return Err(bad(format!(
            "tensor count {tensor_count} exceeds the limit of {MAX_TENSOR_COUNT}"
        )));
    }
    if kv_count > MAX_KV_COUNT {
        return Err(bad(format!(
            "metadata count {kv_count} exceeds the limit of {MAX_KV_COUNT}"
        )));
    }
    // Smallest key-value: key length (8) + type (4) + a one-byte value.
    c.check_fits(kv_count, 13, &|| "metadata".into())?;

    let mut metadata = Vec::with_capacity(kv_count as usize);
    let mut seen_keys = HashSet::with_capacity(kv_count as usize);
    for i in 0..kv_count {
        let key = c.string(MAX_KEY_LEN, &|| format!("metadata key #{i}"))?;
        let type_at = c.pos;
        let type_id = c.u32(&|| format!("type of metadata {key:?}"))?;
        let ty = GgufType::from_id(type_id).ok_or_else(|| {
            bad(format!(
                "metadata {key:?}: unknown value type {type_id} at byte {type_at}"
            ))
        })?;
        let value = read_value(&mut c, ty, &key)?;
        if !seen_keys.insert(key.clone()) {
            return Err(bad(format!("metadata key {key:?} appears twice")));
        }
        metadata.push((key, value));
    }

    let alignment = alignment(&metadata)?;

    // Smallest tensor info: name length (8) + n_dims (4) + one dim (8) + type (4) + offset (8).
    c.check_fits(tensor_count, 32, &|| "tensor directory".into())?;
    let mut raw = Vec::with_capacity(tensor_count as usize);
    for i in 0..tensor_count {
        raw.push(read_tensor_info(&mut c, i)?);
    }
    let header_end = c.pos as u64;
    let file_len = buf.len() as u64;
    // `alignment` is a power of two no larger than MAX_ALIGNMENT and header_end is at most
    // the file length, so neither the addition nor the rounding can overflow u64.
    let data_start = header_end.div_ceil(alignment) * alignment;
    if !raw.is_empty() && data_start > file_len {
        return Err(bad(format!(
            "data section would start at byte {data_start} (header ends at {header_end}, \
             alignment {alignment}), past the end of the file ({file_len} bytes)"
        )));
    }

    let mut tensors = Vec::with_capacity(raw.len());
    let mut names = HashSet::with_capacity(raw.len());
    for t in raw {
        if !names.insert(t.name.clone()) {
            return Err(bad(format!("tensor {} appears twice", t.name)));
        }
        tensors.push(place_tensor(t, alignment, data_start, file_len)?);
    }
    check_no_overlap(&tensors)?;

    Ok(Container {
        version,
        metadata,
        tensors,
        alignment,
        data_start,
    })
}

/// `general.alignment`: a power of two (llama.cpp refuses anything else), default 32.
fn alignment(metadata: &[(String, GgufValue)]) -> Result<u64> {
    let Some((_, v)) = metadata.iter().find(|(k, _)| k == "general.alignment") else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    let a = v.as_u64().ok_or_else(|| {
        bad(format!(
            "general.alignment must be an unsigned integer, found {}",
            v.describe()
        ))
    })?;
    if a == 0 || !a.is_power_of_two() || a > MAX_ALIGNMENT {
        return Err(bad(format!(
            "general.alignment {a} is not a power of two between 1 and {MAX_ALIGNMENT}"
        )));
    }
    Ok(a)
}

fn read_value(c: &mut Cursor<'_>, ty: GgufType, key: &str) -> Result<GgufValue> {
    let what = || format!("value of metadata {key:?}");
    Ok(match ty {
        GgufType::U8 => GgufValue::U8(u8::from_le_bytes(c.array(&what)?)),
        GgufType::I8 => GgufValue::I8(i8::from_le_bytes(c.array(&what)?)),
        GgufType::U16 => GgufValue::U16(u16::from_le_bytes(c.array(&what)?)),
        GgufType::I16 => GgufValue::I16(i16::from_le_bytes(c.array(&what)?)),
        GgufType::U32 => GgufValue::U32(u32::from_le_bytes(c.array(&what)?)),
        GgufType::I32 => GgufValue::I32(i32::from_le_bytes(c.array(&what)?)),
        GgufType::U64 => GgufValue::U64(u64::from_le_bytes(c.array(&what)?)),
        GgufType::I64 => GgufValue::I64(i64::from_le_bytes(c.array(&what)?)),
        GgufType::F32 => GgufValue::F32(f32::from_le_bytes(c.array(&what)?)),
        GgufType::F64 => GgufValue::F64(f64::from_le_bytes(c.array(&what)?)),
        GgufType::Bool => {
            let at = c.pos;
            GgufValue::Bool(to_bool(c.array::<1>(&what)?[0], at, key)?)
        }
        GgufType::String => GgufValue::String(c.string(MAX_STRING_LEN, &what)?),
        GgufType::Array => GgufValue::Array(read_array(c, key, 1)?),
    })
}

fn to_bool(b: u8, at: usize, key: &str) -> Result<bool> {
    match b {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(bad(format!(
            "metadata {key:?}: bool at byte {at} is {b}, not 0 or 1"
        ))),
    }
}

fn read_array(c: &mut Cursor<'_>, key: &str, depth: usize) -> Result<GgufArray> {
    if depth > MAX_ARRAY_DEPTH {
        return Err(bad(format!(
            "metadata {key:?}: arrays nested deeper than {MAX_ARRAY_DEPTH} levels"
        )));
    }
    let what = || format!("array element of metadata {key:?}");
    let type_at = c.pos;
    let type_id = c.u32(&|| format!("array type of metadata {key:?}"))?;
    let et = GgufType::from_id(type_id).ok_or_else(|| {
        bad(format!(
            "metadata {key:?}: unknown array element type {type_id} at byte {type_at}"
        ))
    })?;
    let n = c.u64(&|| format!("array length of metadata {key:?}"))?;
    if n > MAX_ARRAY_LEN {
        return Err(bad(format!(
            "metadata {key:?}: array length {n} exceeds the limit of {MAX_ARRAY_LEN}"
        )));
    }
    // Strings take at least their 8-byte length, nested arrays their 12-byte header.
    let min_size = et
        .fixed_size()
        .unwrap_or(if et == GgufType::String { 8 } else { 12 });
    c.check_fits(n, min_size, &|| format!("array of metadata {key:?}"))?;
    // n * min_size bytes are present, so n fits in usize and every Vec below is bounded.
    let n_usize = n as usize;

    macro_rules! fixed {
        ($variant:ident, $t:ty) => {{
            let bytes = c.take(n * min_size, &what)?;
            GgufArray::$variant(
                bytes
                    .chunks_exact(std::mem::size_of::<$t>())
                    .map(|b| {
                        let mut a = [0u8; std::mem::size_of::<$t>()];
                        a.copy_from_slice(b);
                        <$t>::from_le_bytes(a)
                    })
                    .collect(),
            )
        }};
    }

    Ok(match et {
        GgufType::U8 => GgufArray::U8(c.take(n, &what)?.to_vec()),
        GgufType::I8 => fixed!(I8, i8),
        GgufType::U16 => fixed!(U16, u16),
        GgufType::I16 => fixed!(I16, i16),
        GgufType::U32 => fixed!(U32, u32),
        GgufType::I32 => fixed!(I32, i32),
        GgufType::U64 => fixed!(U64, u64),
        GgufType::I64 => fixed!(I64, i64),
        GgufType::F32 => fixed!(F32, f32),
        GgufType::F64 => fixed!(F64, f64),
        GgufType::Bool => {
            let at = c.pos;
            let bytes = c.take(n, &what)?;
            let mut v = Vec::with_capacity(n_usize);
            for (i, &b) in bytes.iter().enumerate() {
                v.push(to_bool(b, at + i, key)?);
            }
            GgufArray::Bool(v)
        }
        GgufType::String => {
            let mut v = Vec::with_capacity(n_usize);
            for i in 0..n {
                v.push(c.string(MAX_STRING_LEN, &|| {
                    format!("string #{i} of metadata {key:?}")
                })?);
            }
            GgufArray::String(v)
        }
        GgufType::Array => {
            let mut v = Vec::with_capacity(n_usize);
            for _ in 0..n {
                v.push(read_array(c, key, depth + 1)?);
            }
            GgufArray::Array(v)
        }
    })
}

/// A directory entry before it is placed in the data section.
struct RawTensor {
    name: String,
    dims: Vec<u64>,
    type_id: u32,
    offset: u64,
}

fn read_tensor_info(c: &mut Cursor<'_>, i: u64) -> Result<RawTensor> {
    let name = c.string(MAX_TENSOR_NAME_LEN, &|| format!("name of tensor #{i}"))?;
    let n_dims = c.u32(&|| format!("dimension count of tensor {name}"))?;
    if n_dims == 0 || n_dims > MAX_DIMS {
        return Err(bad(format!(
            "tensor {name}: {n_dims} dimensions, expected 1 to {MAX_DIMS}"
        )));
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for d in 0..n_dims {
        dims.push(c.u64(&|| format!("dimension {d} of tensor {name}"))?);
    }
    let type_id = c.u32(&|| format!("type of tensor {name}"))?;
    let offset = c.u64(&|| format!("data offset of tensor {name}"))?;
    Ok(RawTensor {
        name,
        dims,
        type_id,
        offset,
    })
}

/// Checks a tensor's type, shape and data range against the file and computes its size.
fn place_tensor(
    t: RawTensor,
    alignment: u64,
    data_start: u64,
    file_len: u64,
) -> Result<GgufTensorInfo> {
    let name = &t.name;
    let ty = GgmlType::from_id(t.type_id).ok_or_else(|| ParseError::Unsupported {
        what: "GGML tensor type",
        value: format!("id {} (tensor {name})", t.type_id),
    })?;
    if let Some(d) = t.dims.iter().position(|&d| d == 0) {
        return Err(bad(format!(
            "tensor {name}: dimension {d} is 0 (dims {:?})",
            t.dims
        )));
    }
    let numel = t
        .dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| {
            bad(format!(
                "tensor {name}: element count of dims {:?} overflows",
                t.dims
            ))
        })?;
    let (block, block_bytes) = ty.block_layout();
    if !t.dims[0].is_multiple_of(block) {
        return Err(bad(format!(
            "tensor {name}: first dimension {} is not a multiple of the {ty} block size {block}",
            t.dims[0]
        )));
    }
    let n_bytes = (numel / block).checked_mul(block_bytes).ok_or_else(|| {
        bad(format!(
            "tensor {name}: byte size of {numel} {ty} values overflows"
        ))
    })?;
    if !t.offset.is_multiple_of(alignment) {
        return Err(bad(format!(
            "tensor {name}: data offset {} is not a multiple of the alignment {alignment}",
            t.offset
        )));
    }
    let end = data_start
        .checked_add(t.offset)
        .and_then(|s| s.checked_add(n_bytes));
    match end {
        Some(end) if end <= file_len => {}
        _ => {
            return Err(bad(format!(
                "tensor {name}: data offset {} + {n_bytes} bytes runs past the end of the file \
                 ({file_len} bytes, data section starts at byte {data_start})",
                t.offset
            )))
        }
    }
    // Both sizes are bounded by the file, so the f32 copy fits in memory terms a caller can
    // decide on; still make sure the element count is addressable on this platform.
    if usize::try_from(numel).is_err() {
        return Err(bad(format!(
            "tensor {name}: {numel} elements do not fit in memory"
        )));
    }
    Ok(GgufTensorInfo {
        name: t.name,
        dims: t.dims,
        ggml_type: ty,
        offset: t.offset,
        file_offset: data_start + t.offset,
        n_bytes,
    })
}

/// Two tensors may not share bytes: a file that aliases data is corrupt or crafted.
fn check_no_overlap(tensors: &[GgufTensorInfo]) -> Result<()> {
    let mut order: Vec<&GgufTensorInfo> = tensors.iter().collect();
    order.sort_by_key(|t| t.offset);
    for w in order.windows(2) {
        let (a, b) = (w[0], w[1]);
        // Both ends were checked to lie inside the file, so this cannot overflow.
        if a.offset + a.n_bytes > b.offset {
            return Err(bad(format!(
                "tensors {} (bytes {}..{}) and {} (from byte {}) overlap in the data section",
                a.name,
                a.offset,
                a.offset + a.n_bytes,
                b.name,
                b.offset
            )));
        }
    }
    Ok(())
}

/// Index from key to position in `metadata`.
pub(crate) fn index_metadata(metadata: &[(String, GgufValue)]) -> HashMap<String, usize> {
    metadata
        .iter()
        .enumerate()
        .map(|(i, (k, _))| (k.clone(), i))
        .collect()
}
