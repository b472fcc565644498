//! Exact attention (NUMERICS.md §2): both attention products are exact integer products like
//! every other matrix product, so a query row's result never depends on other rows, on future
//! positions, or on how the sequence was chunked.
//!
//! - Scores `Q · Kᵀ`: Q quantised per (position, head) along head_dim, K per (position, kv head)
//!   once when the position is produced (the cache keeps the quantised K).
//! - Context `P · V`: V gets one power-of-two exponent per (position, kv head); it is folded into
//!   the probabilities exactly (`P'_j = P_j · 2^e_j`, held in f64 where it is always exact),
//!   and `P'` is quantised per query row in blocks aligned to absolute key positions `j / 32`.
//!   Keys outside the causal or sliding window are exact zeros.
//!
//! Neither product commits here: the scores reach nothing but the softmax that makes the
//! context's input, and the context nothing but the output projection, so both commit through
//! the context row quantised as that projection takes it (since protocol 7, in the model's
//! block), and a check of either product recomputes both.

use dc_kernels::elementwise::softmax_with;
use dc_kernels::exact::{exact_sum, round_i64_fast, Exact};
use dc_kernels::int8;
use dc_kernels::quant::{quantize_block, round_half_even, BlockScale, BLOCK, QMAX};
use dc_kernels::verify::commit::LeafBatch;
use dc_kernels::{Commitment, Domain};
use rayon::prelude::*;

use crate::error::{ModelError, Result};

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod reference;

/// The quantised keys and values of one layer for one generation.
#[derive(Clone, Debug)]
pub struct LayerCache {
    kv_heads: usize,
    head_dim: usize,
    /// Blocks per head vector.
    hb: usize,
    /// The quantised keys (each padded to whole blocks, `hb · 32` values) in blocks of
    /// [`BLOCK`] positions, per kv head by quads of values (`[pos / 32][kv_head]`, then
    /// [`int8::key_interleaved_at`]): the scores take a block's keys sixteen at a time per
    /// quad ([`int8::interleaved_block_dots`]). Whole blocks are held, the positions not yet
    /// held zero.
    k_t: Vec<i8>,
    /// `[pos][kv_head][hb]`.
    k_s: Vec<BlockScale>,
    /// `k_s` again, each scale packed in one i32 as `m | e << 16`, one column per kv head
    /// and block (`[kv_head · hb + block][pos]`): the AVX-512 scores load sixteen keys'
    /// scales of a block at once.
    k_me: Vec<Vec<i32>>,
    /// The quantised values in blocks of [`BLOCK`] positions, per kv head four positions
    /// interleaved (`[pos / 32][kv_head]`, then [`int8::interleaved_at`]): the context adds a
    /// block's value rows four at a time ([`int8::add_interleaved_rows`]). Whole blocks are
    /// held, the positions not yet held zero.
    v_t: Vec<i8>,
    /// V's power-of-two exponents in blocks of [`BLOCK`] positions (`[pos / 32][kv_head][pos %
    /// 32]`): a block's probabilities are scaled by 8 (or 4) contiguous exponents at a time.
    /// Whole blocks are held, the positions not yet held zero.
    v_e: Vec<i16>,
    len: usize,
}

/// A key block's scale packed in one i32, `m | e << 16`, as the AVX-512 scores load it.
fn pack_scale(s: BlockScale) -> i32 {
    s.m as i32 | (s.e as i32) << 16
}

/// V's exponent for a head vector with largest magnitude `amax`: `floor(log2 amax) − 6`, so
/// the largest element lands in `[64, 128]` (clamped to 127). An all-zero vector gets 0.
pub fn v_exponent(amax: f32) -> i32 {
    if amax == 0.0 {
        return 0;
    }
    let bits = amax.to_bits() & 0x7fff_ffff;
    let exp = (bits >> 23) as i32;
    let log2 = if exp == 0 {
        (31 - (bits & 0x7f_ffff).leading_zeros() as i32) - 149
    } else {
        exp - 127
    };
    log2 - 6
}

/// `2^e` as f64 for the exponent range attention can produce.
fn pow2(e: i32) -> f64 {
    f64::from_bits(((e + 1023) as u64) << 52)
}

/// The smallest scale `m · 2^e` (m in [128, 255]) with `amax / s <= 127`, for an f64 amax
/// (NUMERICS.md §1 applied to `P'`, whose values can leave the f32 range but never have more
/// than 24 significant bits). Same integer search as [`BlockScale::for_amax`].
pub fn scale_for_amax_f64(amax: f64) -> BlockScale {
    if amax == 0.0 {
        return BlockScale::ZERO_BLOCK;
    }
    let bits = amax.to_bits() & 0x7fff_ffff_ffff_ffff;
    let exp = (bits >> 52) as i32;
    let frac = bits & ((1 << 52) - 1);
    let (a, p) = if exp == 0 {
        (frac, -1074)
    } else {
        (frac | (1 << 52), exp - 1075)
    };
    const TOP: u64 = 127 * 255;
    let nbits = 64 - a.leading_zeros() as i32;
    let fits = |d: i32| -> bool {
        if d >= 0 {
            (a << d) <= TOP
        } else {
            -d >= 64 || a <= TOP.checked_shl((-d) as u32).unwrap_or(u64::MAX)
        }
    };
    let d = if fits(15 - nbits) {
        15 - nbits
    } else {
        14 - nbits
    };
    let m = if d >= 0 {
        (a << d).div_ceil(127)
    } else {
        a.div_ceil(127u64 << (-d))
    };
    BlockScale {
        m: m as u8,
        e: (p - d) as i16,
    }
}

impl LayerCache {
    /// An empty cache for `kv_heads` heads of width `head_dim`.
    pub fn new(kv_heads: usize, head_dim: usize) -> LayerCache {
        LayerCache {
            kv_heads,
            head_dim,
            hb: head_dim.div_ceil(BLOCK),
            k_t: Vec::new(),
            k_s: Vec::new(),
            k_me: vec![Vec::new(); kv_heads * head_dim.div_ceil(BLOCK)],
            v_t: Vec::new(),
            v_e: Vec::new(),
            len: 0,
        }
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    /// Head width.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.k_t.len() + self.v_t.len() + (self.k_s.len() * 2) * 4 + self.v_e.len() * 2
    }

    /// Bytes of one position's canonical encoding: per kv head, the key's int8 blocks (padded
    /// to whole blocks) and their scales (`m` then `e` as i16 little-endian), then the value's
    /// int8s and its exponent (i16 little-endian).
    pub fn row_bytes(&self) -> usize {
        self.kv_heads * (self.hb * (BLOCK + 3) + self.head_dim + 2)
    }

    /// Appends the canonical encoding of position `pos` (which must be held) to `out`.
    pub fn encode_row(&self, pos: usize, out: &mut Vec<u8>) {
        let (kvh, hb, hd) = (self.kv_heads, self.hb, self.head_dim);
        for g in 0..kvh {
            let base = (pos * kvh + g) * hb;
            // The layouts' strides (see `put_key` and `put_values`).
            let key = &self.k_t[self.key_at(pos, g, 0)..];
            out.extend((0..hb * BLOCK).map(|n| key[n / 4 * 4 * BLOCK + n % 4] as u8));
            for s in &self.k_s[base..base + hb] {
                out.push(s.m);
                out.extend_from_slice(&s.e.to_le_bytes());
            }
            let values = &self.v_t[self.value_at(pos, g, 0)..];
            out.extend(values.iter().step_by(4).take(hd).map(|&v| v as u8));
            out.extend_from_slice(&self.v_e[self.exponent_at(pos, g)].to_le_bytes());
        }
    }

    /// The canonical encodings of `positions`, concatenated.
    pub fn encode_rows(&self, positions: std::ops::Range<usize>) -> Vec<u8> {
        let mut out = Vec::with_capacity(positions.len() * self.row_bytes());
        for pos in positions {
            self.encode_row(pos, &mut out);
        }
        out
    }

    /// A cache holding the positions encoded in `bytes` (whole rows of [`Self::row_bytes`]),
    /// as revealed by a peer: refuses anything [`Self::append`] could not have produced.
    pub fn from_encoded(kv_heads: usize, head_dim: usize, bytes: &[u8]) -> Result<LayerCache> {
        let mut c = LayerCache::new(kv_heads, head_dim);
        c.extend_encoded(bytes)?;
        Ok(c)
    }

    /// Appends one key block's scale (to `k_s` and, packed, to its column of `k_me`): the
    /// scales come in `k_s`'s order, so the count so far names the kv head and block.
    fn push_key_scale(&mut self, s: BlockScale) {
        let column = self.k_s.len() % self.k_me.len();
        self.k_s.push(s);
        self.k_me[column].push(pack_scale(s));
    }

    /// Bytes of one block of one kv head's values in `v_t`.
    fn value_block_bytes(&self) -> usize {
        BLOCK * self.head_dim
    }

    /// Bytes of one block of one kv head's keys in `k_t`.
    fn key_block_bytes(&self) -> usize {
        BLOCK * self.hb * BLOCK
    }

    /// Where value `d` of the key at position `pos`, kv head `g` sits in `k_t`.
    fn key_at(&self, pos: usize, g: usize, d: usize) -> usize {
        (pos / BLOCK * self.kv_heads + g) * self.key_block_bytes()
            + int8::key_interleaved_at(pos % BLOCK, d)
    }

    /// Value `d` of the key at position `pos`, kv head `g` (`d < hb · 32`: the padding is 0).
    pub(crate) fn key(&self, pos: usize, g: usize, d: usize) -> i8 {
        self.k_t[self.key_at(pos, g, d)]
    }

    /// `k_t` from kv head `g`'s keys of the block of positions `32 b..32 b + 32` on (by
    /// quads; its next block is `kv_heads` key blocks further).
    fn key_blocks_from(&self, b: usize, g: usize) -> &[i8] {
        &self.k_t[(b * self.kv_heads + g) * self.key_block_bytes()..]
    }

    /// Writes kv head `g`'s quantised key values from `d0` on (a multiple of 4; the key is
    /// padded to whole blocks), four at a time, at position `self.len`, making room for its
    /// block when it is the block's first.
    fn put_key(&mut self, g: usize, d0: usize, quads: impl Iterator<Item = [i8; 4]>) {
        let pos = self.len;
        let through = (pos / BLOCK + 1) * self.kv_heads * self.key_block_bytes();
        if self.k_t.len() < through {
            self.k_t.resize(through, 0);
        }
        // Values `d0 + 4n..d0 + 4n + 4` are the key's slot in quad `n` after `d0`'s (`d0`
        // starts a quad): four bytes side by side, the quads a block of keys' slots apart.
        let at = self.key_at(pos, g, d0);
        for (slot, quad) in self.k_t[at..].chunks_mut(4 * BLOCK).zip(quads) {
            slot[..4].copy_from_slice(&quad);
        }
    }

    /// Where value `d` of position `pos`, kv head `g` sits in `v_t`.
    fn value_at(&self, pos: usize, g: usize, d: usize) -> usize {
        (pos / BLOCK * self.kv_heads + g) * self.value_block_bytes()
            + int8::interleaved_at(pos % BLOCK, d, self.head_dim)
    }

    /// Value `d` of position `pos`, kv head `g`.
    pub(crate) fn value(&self, pos: usize, g: usize, d: usize) -> i8 {
        self.v_t[self.value_at(pos, g, d)]
    }

    /// Kv head `g`'s values of the block of positions `32 b..32 b + 32`, four interleaved.
    fn value_block(&self, b: usize, g: usize) -> &[i8] {
        let at = (b * self.kv_heads + g) * self.value_block_bytes();
        &self.v_t[at..at + self.value_block_bytes()]
    }

    /// Writes kv head `g`'s quantised values at position `self.len` (making room for its block
    /// when it is the block's first).
    fn put_values(&mut self, g: usize, values: impl Iterator<Item = i8>) {
        let pos = self.len;
        let through = (pos / BLOCK + 1) * self.kv_heads * self.value_block_bytes();
        if self.v_t.len() < through {
            self.v_t.resize(through, 0);
        }
        // Value `d` is four bytes after value `d − 1` (`interleaved_at`).
        let at = self.value_at(pos, g, 0);
        for (slot, v) in self.v_t[at..].iter_mut().step_by(4).zip(values) {
            *slot = v;
        }
    }

    /// Where the exponent of position `pos`, kv head `g`'s values sits in `v_e`.
    fn exponent_at(&self, pos: usize, g: usize) -> usize {
        (pos / BLOCK * self.kv_heads + g) * BLOCK + pos % BLOCK
    }

    /// The exponent of position `pos`, kv head `g`'s values.
    pub(crate) fn value_exponent(&self, pos: usize, g: usize) -> i16 {
        self.v_e[self.exponent_at(pos, g)]
    }

    /// Writes kv head `g`'s value exponent at position `self.len` (making room for its block
    /// when it is the block's first).
    fn put_exponent(&mut self, g: usize, e: i16) {
        let through = (self.len / BLOCK + 1) * self.kv_heads * BLOCK;
        if self.v_e.len() < through {
            self.v_e.resize(through, 0);
        }
        let at = self.exponent_at(self.len, g);
        self.v_e[at] = e;
    }

    /// Keeps only the first `len` positions.
    pub fn truncate(&mut self, len: usize) {
        // Also when `len` is the length held: a refused extension may have written part of a
        // row past it, which must not stay in front of the next row.
        if len <= self.len {
            let per = self.kv_heads;
            self.k_t
                .truncate(len.div_ceil(BLOCK) * per * self.key_block_bytes());
            self.k_s.truncate(len * per * self.hb);
            for column in &mut self.k_me {
                column.truncate(len);
            }
            self.v_t
                .truncate(len.div_ceil(BLOCK) * per * self.value_block_bytes());
            self.v_e.truncate(len.div_ceil(BLOCK) * per * BLOCK);
            // The positions past `len` in its last block back to zero, as a fresh block is.
            for pos in len..len.div_ceil(BLOCK) * BLOCK {
                for g in 0..per {
                    for d in 0..self.hb * BLOCK {
                        let at = self.key_at(pos, g, d);
                        self.k_t[at] = 0;
                    }
                    for d in 0..self.head_dim {
                        let at = self.value_at(pos, g, d);
                        self.v_t[at] = 0;
                    }
                    let at = self.exponent_at(pos, g);
                    self.v_e[at] = 0;
                }
            }
            self.len = len;
        }
    }

    /// Appends the positions encoded in `bytes` (see [`Self::from_encoded`]); on an error
    /// nothing is appended.
    pub fn extend_encoded(&mut self, bytes: &[u8]) -> Result<()> {
        let held = self.len;
        let done = self.extend_encoded_rows(bytes);
        if done.is_err() {
            self.truncate(held);
        }
        done
    }

    fn extend_encoded_rows(&mut self, bytes: &[u8]) -> Result<()> {
        let (kv_heads, head_dim) = (self.kv_heads, self.head_dim);
        let c = self;
        let rb = c.row_bytes();
        if rb == 0 || !bytes.len().is_multiple_of(rb) {
            return Err(ModelError::Input(format!(
                "{} bytes of cache rows are not whole rows of {rb}",
                bytes.len()
            )));
        }
        let n = bytes.len() / rb;
        let hb = c.hb;
        // Amortised growth, not `reserve_exact`: a checker extends its verified cache by a
        // few rows per check, and an exact reservation would copy the whole cache each time.
        c.k_t.reserve((n + BLOCK) * kv_heads * hb * BLOCK);
        c.k_s.reserve(n * kv_heads * hb);
        for column in &mut c.k_me {
            column.reserve(n);
        }
        c.v_t.reserve((n + BLOCK) * kv_heads * head_dim);
        c.v_e.reserve((n + BLOCK) * kv_heads);
        let first = c.len;
        let bad = |what: &str, pos: usize| {
            ModelError::Input(format!(
                "the cache row at position {} has {what}",
                first + pos
            ))
        };
        let exponent_ok = |e: i16| (-MAX_CACHE_EXPONENT..=MAX_CACHE_EXPONENT).contains(&e);
        for (pos, row) in bytes.chunks_exact(rb).enumerate() {
            // `append` never writes -128 (int8 values are clamped to ±127). A fold, not
            // `contains`: it runs in vector lanes, where `contains` took an eighth of a load.
            if row.iter().fold(false, |any, &b| any | (b == 0x80)) {
                // Only the int8 parts may hold that byte; a scale or exponent may.
                let mut at = 0;
                for _ in 0..kv_heads {
                    let (k, v) = (at..at + hb * BLOCK, at + hb * (BLOCK + 3));
                    if row[k].contains(&0x80) || row[v..v + head_dim].contains(&0x80) {
                        return Err(bad("an int8 of -128", pos));
                    }
                    at = v + head_dim + 2;
                }
            }
            let mut at = 0;
            for g in 0..kv_heads {
                let k = &row[at..at + hb * BLOCK];
                c.put_key(
                    g,
                    0,
                    k.as_chunks::<4>().0.iter().map(|q| q.map(|b| b as i8)),
                );
                at += hb * BLOCK;
                for s in row[at..at + hb * 3].chunks_exact(3) {
                    let e = i16::from_le_bytes([s[1], s[2]]);
                    if s[0] < 128 || !exponent_ok(e) {
                        return Err(bad("a key scale out of range", pos));
                    }
                    c.push_key_scale(BlockScale { m: s[0], e });
                }
                at += hb * 3;
                c.put_values(g, row[at..at + head_dim].iter().map(|&b| b as i8));
                at += head_dim;
                let e = i16::from_le_bytes([row[at], row[at + 1]]);
                if !exponent_ok(e) {
                    return Err(bad("a value exponent out of range", pos));
                }
                c.put_exponent(g, e);
                at += 2;
            }
            c.len += 1;
        }
        Ok(())
    }

    /// Appends the keys and values of `rows` new positions (`rows × kv_heads · head_dim` each,
    /// RoPE already applied to the keys).
    pub fn append(&mut self, k: &[f32], v: &[f32]) -> Result<()> {
        let w = self.kv_heads * self.head_dim;
        debug_assert_eq!(k.len(), v.len());
        for (kr, vr) in k.chunks_exact(w).zip(v.chunks_exact(w)) {
            for g in 0..self.kv_heads {
                let kh = &kr[g * self.head_dim..(g + 1) * self.head_dim];
                for b in 0..self.hb {
                    let vals = &kh[b * BLOCK..((b + 1) * BLOCK).min(self.head_dim)];
                    let mut q = [0i8; BLOCK];
                    let scale = quantize_block(vals, &mut q);
                    self.push_key_scale(scale);
                    self.put_key(g, b * BLOCK, q.as_chunks::<4>().0.iter().copied());
                }
                let vh = &vr[g * self.head_dim..(g + 1) * self.head_dim];
                let amax = vh.iter().fold(0f32, |m, x| m.max(x.abs()));
                let e = v_exponent(amax);
                let inv = pow2(-e);
                // x · 2^-e is exact in f64; one rounding, ties to even.
                let quantized = vh.iter().map(|&x| {
                    round_half_even(x as f64 * inv).clamp(-QMAX as f64, QMAX as f64) as i8
                });
                self.put_values(g, quantized);
                self.put_exponent(g, e as i16);
            }
            self.len += 1;
        }
        Ok(())
    }
}

/// Largest magnitude of a cache exponent (a key scale's or a value's) a revealed row may carry:
/// finite f32 keys and values need about 160, and this keeps every `2^e` attention forms
/// within f64.
const MAX_CACHE_EXPONENT: i16 = 300;

/// The Merkle leaf of a cache row at absolute `position` encoded as `encoding`.
pub fn cache_row_leaf(position: usize, encoding: &[u8]) -> Commitment {
    let mut h = Domain::KvRow.hasher();
    h.update(&(position as u64).to_le_bytes());
    h.update(encoding);
    Commitment(*h.finalize().as_bytes())
}

/// The commitment to the cache rows of positions `first..` encoded in `bytes` (whole rows of
/// `row_bytes`): their Merkle root with the shape, as for a product.
pub fn cache_commitment(first: usize, row_bytes: usize, bytes: &[u8]) -> Commitment {
    let mut batch = LeafBatch::default();
    queue_cache_rows(&mut batch, first, row_bytes, bytes);
    batch.finish(false).pop().expect("one set queued").0
}

/// Queues the cache rows of positions `first..` encoded in `bytes` (whole rows of
/// `row_bytes`) in `batch` as one set: [`cache_row_leaf`]'s leaves, committed as
/// [`cache_commitment`] commits them.
pub fn queue_cache_rows(batch: &mut LeafBatch, first: usize, row_bytes: usize, bytes: &[u8]) {
    for (i, row) in bytes.chunks_exact(row_bytes).enumerate() {
        batch.leaf(Domain::KvRow, &[&((first + i) as u64).to_le_bytes(), row]);
    }
    batch.end_set(row_bytes);
}

/// Sums a handful of block terms exactly and rounds once to f32 (`None` past the f32 range).
#[inline]
fn sum_terms(terms: &[(i64, i32)]) -> Option<f32> {
    let emin = terms.iter().map(|t| t.1).min()?;
    let emax = terms.iter().map(|t| t.1).max()?;
    // Terms are below 2^35; with a span of at most 24 bits and at most 8 terms the shifted sum
    // stays below 2^62.
    if emax - emin <= 24 && terms.len() <= 8 {
        let s: i64 = terms.iter().map(|&(t, e)| t << (e - emin)).sum();
        let v = round_i64_fast(s, emin);
        return v.is_finite().then_some(v);
    }
    exact_sum(terms).to_f32()
}

/// What one layer's attention needs besides the cache.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// Sliding window, if any.
    pub window: Option<usize>,
}

/// Causal attention of `rows` new query rows at absolute positions `start..start + rows`
/// against every key in `cache` (which must already hold those positions).
/// `q` is `rows × heads · head_dim` (RoPE applied); the context goes to `out`, same shape.
pub fn attend(
    shape: AttentionShape,
    cache: &LayerCache,
    q: &[f32],
    start: usize,
    out: &mut [f32],
    layer: usize,
) -> Result<()> {
    attend_with(AttentionKernel::Fast, shape, cache, q, start, out, layer)
}

/// Per-head attention kernels. Every kernel gives the same bits (property-tested against the
/// reference); the choice is for tests and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionKernel {
    /// The value-by-value definition (NUMERICS.md §2).
    Reference,
    /// Scratch buffers reused per worker, each `exp` once, the per-key int8 loops of
    /// [`dc_kernels::int8`], and the per-key f64 loops (scores from block products, quantised
    /// probabilities) four keys at a time with AVX2 where the CPU has it (the scores sixteen
    /// at a time with AVX-512).
    #[default]
    Fast,
    /// [`AttentionKernel::Fast`] with its per-key f64 loops one key at a time: what a CPU
    /// without AVX2 runs (tests hold every kernel to the reference on every CPU).
    Scalar,
}

/// [`attend`] with a chosen per-head kernel.
pub fn attend_with(
    kernel: AttentionKernel,
    shape: AttentionShape,
    cache: &LayerCache,
    q: &[f32],
    start: usize,
    out: &mut [f32],
    layer: usize,
) -> Result<()> {
    let (hd, heads) = (shape.head_dim, shape.heads);
    let rows = q.len() / (heads * hd);
    if start + rows > cache.len {
        return Err(ModelError::Input(format!(
            "layer {layer}: queries up to position {} but the cache holds {}",
            start + rows,
            cache.len
        )));
    }
    let scale = (1.0 / (hd as f64).sqrt()) as f32;
    let group = heads / shape.kv_heads;
    let one = |scratch: &mut HeadScratch, (idx, o): (usize, &mut [f32])| {
        let (t, h) = (idx / heads, idx % heads);
        let qh = &q[(t * heads + h) * hd..(t * heads + h + 1) * hd];
        let (g, pos, window) = (h / group, start + t, shape.window);
        // A group's heads run one after another (on one thread, or in rayon's contiguous
        // halves), so the first reads the kv head's values from memory and the rest from cache;
        // a split inside a group only costs a head its prefetch.
        let first = h % group == 0;
        match kernel {
            AttentionKernel::Reference => {
                reference::head_attention(cache, qh, g, pos, window, scale, o)
            }
            AttentionKernel::Fast => {
                head_attention(cache, qh, g, pos, window, scale, o, scratch, true, first)
            }
            AttentionKernel::Scalar => {
                head_attention(cache, qh, g, pos, window, scale, o, scratch, false, first)
            }
        }
    };
    // Heads run in parallel on the rayon pool this is called from (`Gemm::install`); called
    // from outside any pool (a one-thread engine, a test) they run on the calling thread, so a
    // daemon told to use one thread uses one.
    let each = |head| HeadScratch::with(|scratch| one(scratch, head));
    let results: Vec<Result<(), String>> = if rayon::current_thread_index().is_some() {
        out.par_chunks_mut(hd).enumerate().map(each).collect()
    } else {
        out.chunks_mut(hd).enumerate().map(each).collect()
    };
    if let Some(detail) = results.into_iter().find_map(Result::err) {
        return Err(ModelError::NonFinite {
            stage: format!("attention of layer {layer}"),
            layer: layer.to_string(),
            detail,
        });
    }
    Ok(())
}

/// Widest head the fast kernel takes, in blocks (head_dim 256); wider heads use the reference.
const FAST_MAX_BLOCKS: usize = 8;

/// Buffers one worker reuses across the heads it runs.
#[derive(Default)]
struct HeadScratch {
    qq: Vec<i8>,
    qs: Vec<BlockScale>,
    dots: Vec<i32>,
    scores: Vec<f32>,
    exps: Vec<f64>,
    /// Per block of keys with any probability: its scale, and where its outputs' sums start
    /// in `ctx_acc` (`hd` per block).
    ctx_scales: Vec<BlockScale>,
    ctx_acc: Vec<i32>,
    context: ContextScratch,
}

thread_local! {
    /// Each thread's head buffers, kept from call to call: a decode row's heads are short
    /// (one query against the cache), so buffers allocated per call, or per rayon job, cost
    /// about as much as the arithmetic of a SmolLM2 head at a context of 64.
    static HEAD_SCRATCH: std::cell::RefCell<HeadScratch> =
        std::cell::RefCell::new(HeadScratch::default());
}

impl HeadScratch {
    /// Runs `f` with this thread's buffers (fresh ones if they are in use further up the
    /// stack, which a head never is: it calls nothing that could run another head).
    fn with<T>(f: impl FnOnce(&mut HeadScratch) -> T) -> T {
        HEAD_SCRATCH.with(|cell| match cell.try_borrow_mut() {
            Ok(mut scratch) => f(&mut scratch),
            Err(_) => f(&mut HeadScratch::default()),
        })
    }
}

/// Widest exponent span of a key's block terms that the scores' f64 path takes: each term
/// `D · m_q · m_k` is below 2^35 (`|D| <= 32 · 128²`, `m <= 255`), so with at most
/// [`FAST_MAX_BLOCKS`] = 2^3 terms on a grid of the smallest exponent, every partial sum is
/// an integer times that power of two below 2^(35 + 15 + 3) = 2^53: exact in f64 in any order.
const SCORE_F64_SPAN: i32 = 15;

/// How many blocks ahead of the one it multiplies a head prefetches the value rows.
///
/// Why: a layer's cache has gone cold by the next row (the other layers' weights stream
/// through every cache level in between), and a kv head's value blocks lie a block of every
/// other kv head apart, where the hardware's prefetchers start over at each block. The first
/// query head of a group reads them from memory. Prefetching two blocks ahead made a check
/// that recomputes a cold attention row at context 1 000 11–15 % faster at SmolLM2's,
/// Llama-3.2-1B's and Llama-2-7B's shapes, and a warm one 1–5 % slower (the prefetches'
/// own instructions). Prefetching from every head of a group cost a warm row 4–7 %, and
/// prefetching the keys as well gained about 1 %.
const VALUES_AHEAD: usize = 2;

/// Hints the CPU to bring `bytes` into its caches (it changes no value).
#[inline]
fn prefetch(bytes: &[i8]) {
    #[cfg(target_arch = "x86_64")]
    for line in bytes.chunks(64) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: a prefetch reads nothing and cannot fault; the address is inside `bytes`.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// One query head at absolute position `pos`: the same values as
/// [`reference::head_attention`] (property-tested bit for bit), without its per-head
/// allocations, with each `exp` taken once, the block dot products and value rows in vector
/// loops over the cache's blocks ([`int8::interleaved_block_dots`],
/// [`int8::add_interleaved_rows`]), a key's score summed in f64 where that is exact, and each
/// output's block terms summed once in an i64 where they fit. `simd`: the per-key f64 loops
/// four keys at a time where the CPU has AVX2 (the same bits). `fetch_values`: this head is
/// the first of its kv head's group to run here, so it prefetches the value blocks ahead.
#[allow(clippy::too_many_arguments)]
fn head_attention(
    cache: &LayerCache,
    qh: &[f32],
    g: usize,
    pos: usize,
    window: Option<usize>,
    scale: f32,
    out: &mut [f32],
    scratch: &mut HeadScratch,
    simd: bool,
    fetch_values: bool,
) -> Result<(), String> {
    let (hd, hb, kvh) = (cache.head_dim, cache.hb, cache.kv_heads);
    if hb > FAST_MAX_BLOCKS {
        return reference::head_attention(cache, qh, g, pos, window, scale, out);
    }
    let HeadScratch {
        qq,
        qs,
        dots,
        scores,
        exps,
        ctx_scales,
        ctx_acc,
        context,
    } = scratch;
    quantize_query(qh, hd, hb, pos, qq, qs)?;
    let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
    let (first_block, last_block) = (lo / BLOCK, pos / BLOCK);
    // Scores: the block products of every key of the blocks that hold keys `lo..=pos`, then
    // per key the exact sum of its block terms, rounded once to f32, then the f32 scale.
    dots.clear();
    dots.resize((last_block + 1 - first_block) * BLOCK * hb, 0);
    int8::interleaved_block_dots(
        qq,
        cache.key_blocks_from(first_block, g),
        kvh * cache.key_block_bytes(),
        last_block + 1 - first_block,
        dots,
    );
    let dots = &dots[(lo - first_block * BLOCK) * hb..(pos + 1 - first_block * BLOCK) * hb];
    let keys = KeyScales {
        scales: &cache.k_s[(lo * kvh + g) * hb..],
        packed: &cache.k_me[g * hb..(g + 1) * hb],
        stride: kvh * hb,
        first: lo,
    };
    #[cfg(target_arch = "x86_64")]
    let simd = simd && avx2::available();
    #[cfg(target_arch = "x86_64")]
    let wide = simd && avx512::available();
    #[cfg(not(target_arch = "x86_64"))]
    let wide = false;
    scores_for(hb, simd, wide, qs, dots, keys, scale, pos, scores)?;
    softmax_with(scores, exps);
    let blocks = first_block..=last_block;
    weighted_value_sums(
        cache,
        g,
        scores,
        lo,
        pos,
        blocks,
        simd,
        fetch_values,
        ctx_scales,
        ctx_acc,
    );
    context_outputs_by_block(out, ctx_scales, ctx_acc, context, pos)
}

/// The query head `qh` (`hd` values) quantised into `hb` blocks (`qq`, with their scales in
/// `qs`); a value that is not finite is refused, naming the position.
#[inline(always)]
fn quantize_query(
    qh: &[f32],
    hd: usize,
    hb: usize,
    pos: usize,
    qq: &mut Vec<i8>,
    qs: &mut Vec<BlockScale>,
) -> Result<(), String> {
    qq.clear();
    qq.resize(hb * BLOCK, 0);
    qs.clear();
    for (b, dst) in qq.chunks_exact_mut(BLOCK).enumerate() {
        let vals = &qh[b * BLOCK..((b + 1) * BLOCK).min(hd)];
        if let Some(x) = vals.iter().find(|x| !x.is_finite()) {
            return Err(format!("query value {x} at position {pos}"));
        }
        let dst: &mut [i8; BLOCK] = dst.try_into().expect("block slice is BLOCK long");
        qs.push(quantize_block(vals, dst));
    }
    Ok(())
}

/// [`head_attention`]'s scores of keys `keys.first..=pos` into `scores`, by the loop for its
/// `hb` query blocks and the CPU (`simd`: AVX2 detected and asked for; `wide`: AVX-512 as
/// well); every loop gives the same bits. Inlined (`always`) so that splitting it out of the
/// head's loop costs the hot path nothing.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn scores_for(
    hb: usize,
    simd: bool,
    wide: bool,
    qs: &[BlockScale],
    dots: &[i32],
    keys: KeyScales,
    scale: f32,
    pos: usize,
    scores: &mut Vec<f32>,
) -> Result<(), String> {
    match (hb, simd, wide) {
        // The common head widths (32, 64, 96, 128) with the block loop unrolled, sixteen keys
        // at a time where the CPU has AVX-512, four where it has AVX2.
        #[cfg(target_arch = "x86_64")]
        // SAFETY (each): AVX-512F was detected; `packed` mirrors `scales` (the cache's).
        (1, _, true) => unsafe { avx512::scores::<1>(qs, dots, keys, scale, pos, scores) },
        #[cfg(target_arch = "x86_64")]
        (2, _, true) => unsafe { avx512::scores::<2>(qs, dots, keys, scale, pos, scores) },
        #[cfg(target_arch = "x86_64")]
        (3, _, true) => unsafe { avx512::scores::<3>(qs, dots, keys, scale, pos, scores) },
        #[cfg(target_arch = "x86_64")]
        (4, _, true) => unsafe { avx512::scores::<4>(qs, dots, keys, scale, pos, scores) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY (each): AVX2 was detected.
        (1, true, _) => unsafe { avx2::scores::<1>(qs, dots, keys, scale, pos, scores) },
        #[cfg(target_arch = "x86_64")]
        (2, true, _) => unsafe { avx2::scores::<2>(qs, dots, keys, scale, pos, scores) },
        #[cfg(target_arch = "x86_64")]
        (3, true, _) => unsafe { avx2::scores::<3>(qs, dots, keys, scale, pos, scores) },
        #[cfg(target_arch = "x86_64")]
        (4, true, _) => unsafe { avx2::scores::<4>(qs, dots, keys, scale, pos, scores) },
        (1, ..) => scores_of::<1>(qs, dots, keys, scale, pos, scores),
        (2, ..) => scores_of::<2>(qs, dots, keys, scale, pos, scores),
        (3, ..) => scores_of::<3>(qs, dots, keys, scale, pos, scores),
        (4, ..) => scores_of::<4>(qs, dots, keys, scale, pos, scores),
        _ => scores_any(qs, dots, keys, scale, pos, scores),
    }
}

/// [`head_attention`]'s value side: for each block of keys in `blocks` (the keys `lo..=pos`
/// among them), the probabilities `scores` times `2^e_v` quantised, and the block's value rows
/// of kv head `g` times them summed into its own `hd` i32 sums at the end of `ctx_acc`, its
/// scale pushed onto `ctx_scales` (a block whose probabilities are all zero adds neither).
/// `fetch_values`: prefetch the value blocks ahead. Inlined (`always`) for the same reason as
/// [`scores_for`].
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn weighted_value_sums(
    cache: &LayerCache,
    g: usize,
    scores: &[f32],
    lo: usize,
    pos: usize,
    blocks: std::ops::RangeInclusive<usize>,
    simd: bool,
    fetch_values: bool,
    ctx_scales: &mut Vec<BlockScale>,
    ctx_acc: &mut Vec<i32>,
) {
    let (hd, last_block) = (cache.head_dim, *blocks.end());
    // P' = P · 2^e_v, exact in f64, quantised in blocks of absolute key positions; each
    // block's value rows times its probabilities summed into its own i32 accumulators.
    ctx_scales.clear();
    ctx_acc.clear();
    for b in blocks {
        if fetch_values && b + VALUES_AHEAD <= last_block {
            prefetch(cache.value_block(b + VALUES_AHEAD, g));
        }
        let (j0, j1) = ((b * BLOCK).max(lo), ((b + 1) * BLOCK - 1).min(pos));
        let keys = j1 + 1 - j0;
        let (probabilities, exponents) = (
            &scores[j0 - lo..=j1 - lo],
            &cache.v_e[cache.exponent_at(j0, g)..],
        );
        let mut pv = [0f64; BLOCK];
        let pv = &mut pv[..keys];
        let amax = probabilities_loops(simd).0(probabilities, exponents, pv);
        if amax == 0.0 {
            continue;
        }
        let s = scale_for_amax_f64(amax);
        let (inv, m) = (pow2(-(s.e as i32)), s.m as f64);
        // The block's weights in place by key (a key outside `j0..=j1` weighs zero).
        let mut qp = [0i32; BLOCK];
        probabilities_loops(simd).1(pv, inv, m, &mut qp[j0 % BLOCK..=j1 % BLOCK]);
        let weights = qp.map(|w| w as u8);
        let at = ctx_acc.len();
        ctx_acc.resize(at + hd, 0);
        int8::add_interleaved_rows(&mut ctx_acc[at..], cache.value_block(b, g), &weights);
        ctx_scales.push(s);
    }
}

/// [`scaled_probabilities`] and [`quantized_probabilities`]: where `simd` is asked for, their
/// AVX-512 forms where the CPU has that, their AVX2 forms where it has that; the scalar loops
/// otherwise.
#[allow(clippy::type_complexity)]
fn probabilities_loops(
    simd: bool,
) -> (
    fn(&[f32], &[i16], &mut [f64]) -> f64,
    fn(&[f64], f64, f64, &mut [i32]),
) {
    #[cfg(target_arch = "x86_64")]
    if simd && avx512::available() {
        // SAFETY: AVX-512F was detected, which is all these forms need.
        return (
            |p, e, o| unsafe { avx512::scaled_probabilities(p, e, o) },
            |p, i, m, o| unsafe { avx512::quantized_probabilities(p, i, m, o) },
        );
    }
    #[cfg(target_arch = "x86_64")]
    if simd && avx2::available() {
        // SAFETY: AVX2 was detected, which is all these forms need.
        return (
            |p, e, o| unsafe { avx2::scaled_probabilities(p, e, o) },
            |p, i, m, o| unsafe { avx2::quantized_probabilities(p, i, m, o) },
        );
    }
    let _ = simd;
    (scaled_probabilities, quantized_probabilities)
}

/// `P'_j = P_j · 2^e_j` for a block of keys into `out` (exact in f64): key `j`'s probability
/// `probabilities[j]`, its value's exponent `exponents[j]`; returns the largest.
fn scaled_probabilities(probabilities: &[f32], exponents: &[i16], out: &mut [f64]) -> f64 {
    let mut amax = 0f64;
    for ((p, &prob), &e) in out.iter_mut().zip(probabilities).zip(exponents) {
        *p = prob as f64 * pow2(e as i32);
        amax = amax.max(*p);
    }
    amax
}

/// A block's `P'` quantised with the scale `m · 2^e` (`inv = 2^−e`) into `out`: as in the
/// reference, exact scaling, one correctly rounded division, rounded half to even, at most
/// [`QMAX`] (the values are never negative).
fn quantized_probabilities(pv: &[f64], inv: f64, m: f64, out: &mut [i32]) {
    for (q, &p) in out.iter_mut().zip(pv) {
        *q = round_half_even((p * inv) / m).min(QMAX as f64) as i32;
    }
}

/// The error for a key whose score leaves the f32 range.
fn score_overflow(key: usize, pos: usize) -> String {
    format!("score of key {key} overflows f32 at position {pos}")
}

/// One head's key scales in the cache: key `i` (absolute position `first + i`) has its
/// blocks' scales at `scales[i · stride..]`.
#[derive(Clone, Copy)]
struct KeyScales<'a> {
    scales: &'a [BlockScale],
    /// The same scales packed as `m | e << 16`, one column per block (the cache's `k_me` of
    /// this kv head): key `i`'s block `b` at `packed[b][first + i]`.
    packed: &'a [Vec<i32>],
    stride: usize,
    first: usize,
}

/// The score of one key from its `HB` block dot products `d` and the query's and key's block
/// scales: the exact sum of the terms `d_b · m_q · m_k · 2^(e_q + e_k)` rounded once to f32.
/// `None` when the score is outside the f32 range.
#[inline(always)]
fn key_score<const HB: usize>(qs: &[BlockScale; HB], ks: &[BlockScale], d: &[i32]) -> Option<f32> {
    let (ks, d): (&[BlockScale; HB], &[i32; HB]) = (ks.try_into().ok()?, d.try_into().ok()?);
    let mut terms = [(0i64, 0i32); HB];
    for b in 0..HB {
        terms[b] = (
            d[b] as i64 * (qs[b].m as i64 * ks[b].m as i64),
            qs[b].e as i32 + ks[b].e as i32,
        );
    }
    let emin = terms.iter().map(|t| t.1).min().unwrap_or(0);
    let emax = terms.iter().map(|t| t.1).max().unwrap_or(0);
    if emax - emin > SCORE_F64_SPAN {
        return sum_terms(&terms);
    }
    // Exact in f64 (see SCORE_F64_SPAN); the conversion is the one rounding.
    let sum: f64 = terms.iter().map(|&(t, e)| t as f64 * pow2(e)).sum();
    let dot = sum as f32;
    dot.is_finite().then_some(dot)
}

/// Key `i`'s scaled score into `scores[i]` by the scalar path (see [`key_score`]): what the
/// vector forms redo for a key their f64 sum cannot take, or whose score leaves the f32 range
/// (then the error naming it).
#[allow(clippy::too_many_arguments)]
fn redo_key<const HB: usize>(
    qs: &[BlockScale; HB],
    dots: &[i32],
    keys: KeyScales,
    scale: f32,
    pos: usize,
    i: usize,
    scores: &mut [f32],
) -> Result<(), String> {
    let ks = &keys.scales[i * keys.stride..i * keys.stride + HB];
    let dot = key_score(qs, ks, &dots[i * HB..(i + 1) * HB])
        .ok_or_else(|| score_overflow(keys.first + i, pos))?;
    scores[i] = dot * scale;
    Ok(())
}

/// Every key's scaled score into `scores` (see [`key_score`]) for `HB` blocks per head.
fn scores_of<const HB: usize>(
    qs: &[BlockScale],
    dots: &[i32],
    keys: KeyScales,
    scale: f32,
    pos: usize,
    scores: &mut Vec<f32>,
) -> Result<(), String> {
    let qs: &[BlockScale; HB] = qs.try_into().expect("HB query blocks");
    scores_with(dots, HB, keys, scale, pos, scores, |ks, d| {
        key_score(qs, ks, d)
    })
}

/// [`scores_of`] for head widths without their own instance: the general exact sum.
fn scores_any(
    qs: &[BlockScale],
    dots: &[i32],
    keys: KeyScales,
    scale: f32,
    pos: usize,
    scores: &mut Vec<f32>,
) -> Result<(), String> {
    let hb = qs.len();
    scores_with(dots, hb, keys, scale, pos, scores, |ks, d| {
        let mut terms = [(0i64, 0i32); FAST_MAX_BLOCKS];
        for (b, t) in terms[..hb].iter_mut().enumerate() {
            *t = (
                d[b] as i64 * (qs[b].m as i64 * ks[b].m as i64),
                qs[b].e as i32 + ks[b].e as i32,
            );
        }
        sum_terms(&terms[..hb])
    })
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn scores_with(
    dots: &[i32],
    hb: usize,
    keys: KeyScales,
    scale: f32,
    pos: usize,
    scores: &mut Vec<f32>,
    score: impl Fn(&[BlockScale], &[i32]) -> Option<f32>,
) -> Result<(), String> {
    scores.clear();
    for (i, d) in dots.chunks_exact(hb).enumerate() {
        let ks = &keys.scales[i * keys.stride..i * keys.stride + hb];
        let dot = score(ks, d).ok_or_else(|| score_overflow(keys.first + i, pos))?;
        scores.push(dot * scale);
    }
    Ok(())
}

/// Widest span of block exponents summed in one i64: a block term `acc · m` is below 2^27
/// (`|acc| <= 32 · 127²`, `m <= 255`); shifted onto the grid of the group's smallest exponent
/// by at most 28 bits and summed over at most [`GROUP_BLOCKS`] = 2^7 blocks, every partial sum
/// stays below 2^62.
const CONTEXT_I64_SPAN: i32 = 28;
/// Most blocks summed in one i64 (see [`CONTEXT_I64_SPAN`]).
const GROUP_BLOCKS: usize = 128;

/// Each output of one head's context from its blocks' scales and i32 sums (`hd` per block,
/// block-major): the same exact value and rounding as [`context_outputs`]. The blocks are
/// grouped by exponent (sorted, each group spanning at most [`CONTEXT_I64_SPAN`] bits): every
/// output of a block shares its exponent, so a group's terms are summed in one i64 per output
/// with shifts found once, and only the groups' sums (few: probabilities far below the
/// largest form their own groups) are combined exactly per output.
fn context_outputs_by_block(
    out: &mut [f32],
    scales: &[BlockScale],
    sums: &[i32],
    scratch: &mut ContextScratch,
    pos: usize,
) -> Result<(), String> {
    let hd = out.len();
    let ContextScratch {
        order,
        groups,
        totals,
        terms,
    } = scratch;
    order.clear();
    order.extend(0..scales.len());
    order.sort_unstable_by_key(|&b| scales[b].e);
    groups.clear();
    for &b in order.iter() {
        let e = scales[b].e as i32;
        match groups.last_mut() {
            Some((emin, count)) if e - *emin <= CONTEXT_I64_SPAN && *count < GROUP_BLOCKS => {
                *count += 1
            }
            _ => groups.push((e, 1)),
        }
    }
    // Per group, one i64 per output.
    totals.clear();
    totals.resize(groups.len() * hd, 0);
    let mut at = 0;
    for (g, &(emin, count)) in groups.iter().enumerate() {
        let total = &mut totals[g * hd..(g + 1) * hd];
        for &b in &order[at..at + count] {
            let (m, shift) = (scales[b].m as i64, scales[b].e as i32 - emin);
            add_shifted(total, &sums[b * hd..(b + 1) * hd], m, shift);
        }
        at += count;
    }
    if let [(emin, _)] = groups[..] {
        // One group (the usual case): its sums are the exact values.
        for (o, &t) in out.iter_mut().zip(totals.iter()) {
            let v = round_i64_fast(t, emin);
            if !v.is_finite() {
                return Err(format!("context overflows f32 at position {pos}"));
            }
            *o = v;
        }
        return Ok(());
    }
    for (d, o) in out.iter_mut().enumerate() {
        terms.clear();
        terms.extend(
            groups
                .iter()
                .enumerate()
                .map(|(g, &(emin, _))| (totals[g * hd + d], emin)),
        );
        *o = exact_sum(terms)
            .to_f32()
            .ok_or_else(|| format!("context overflows f32 at position {pos}"))?;
    }
    Ok(())
}

/// `total_d += (a_d · m) << shift` for every output of a block (`shift` at most
/// [`CONTEXT_I64_SPAN`]): integer arithmetic, so every instruction set gives the same sums.
/// Compiled for AVX-512 and AVX2 too where the CPU has them: the baseline's i64 multiply has
/// no vector instruction, and this loop ran a long emulation of one per output.
fn add_shifted(total: &mut [i64], sums: &[i32], m: i64, shift: i32) {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F was detected.
            return unsafe { add_shifted_avx512(total, sums, m, shift) };
        }
        if is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was detected.
            return unsafe { add_shifted_avx2(total, sums, m, shift) };
        }
    }
    add_shifted_each(total, sums, m, shift)
}

/// [`add_shifted`]'s loop, as the baseline compiles it (and inlined into the other forms).
#[inline(always)]
fn add_shifted_each(total: &mut [i64], sums: &[i32], m: i64, shift: i32) {
    for (t, &a) in total.iter_mut().zip(sums) {
        *t += (a as i64 * m) << shift;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn add_shifted_avx512(total: &mut [i64], sums: &[i32], m: i64, shift: i32) {
    add_shifted_each(total, sums, m, shift)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn add_shifted_avx2(total: &mut [i64], sums: &[i32], m: i64, shift: i32) {
    add_shifted_each(total, sums, m, shift)
}

/// Buffers of [`context_outputs_by_block`], reused per worker.
#[derive(Default)]
struct ContextScratch {
    /// Block indices by exponent.
    order: Vec<usize>,
    /// Per group: its smallest exponent and its number of blocks.
    groups: Vec<(i32, usize)>,
    /// Per group, one exact sum per output.
    totals: Vec<i64>,
    terms: Vec<(i64, i32)>,
}

/// Each output of one head's context from its block terms (`blocks` places per output, the
/// first `used` filled): summed exactly, rounded to f32 into `out`.
fn context_outputs(
    out: &mut [f32],
    ctx_terms: &[(i64, i32)],
    blocks: usize,
    used: usize,
    pos: usize,
) -> Result<(), String> {
    for (o, t) in out.iter_mut().zip(ctx_terms.chunks_exact(blocks)) {
        *o = context_sum(&t[..used])
            .to_f32()
            .ok_or_else(|| format!("context overflows f32 at position {pos}"))?;
    }
    Ok(())
}

/// Exact sum of the P'·V block terms of one output (`|term| < 2^27`).
fn context_sum(terms: &[(i64, i32)]) -> Exact {
    let nz = terms.iter().filter(|t| t.0 != 0);
    let Some(emin) = nz.clone().map(|t| t.1).min() else {
        return Exact::ZERO;
    };
    let emax = nz.map(|t| t.1).max().unwrap_or(emin);
    // 27-bit terms, shifted by at most 90 bits, at most 2^8 blocks: below 2^126.
    if emax - emin <= 90 && terms.len() <= 256 {
        let s: i128 = terms
            .iter()
            .filter(|t| t.0 != 0)
            .map(|&(t, e)| (t as i128) << (e - emin))
            .sum();
        return Exact::from_i128(s, emin);
    }
    exact_sum(terms)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Block scales and sums for [`context_outputs_by_block`]. Modes: 0, exponents in steps
    /// around the grouping limit; 1, anywhere; 2, a crowd: one block, then every other one
    /// exactly the limit above it (the most terms one i64 takes at the widest shift).
    /// `extreme` puts every sum at the bound, all of one sign in the crowd.
    fn blocks(
        n: usize,
        hd: usize,
        seed: u64,
        mode: u8,
        extreme: bool,
    ) -> (Vec<BlockScale>, Vec<i32>) {
        let mut s = seed | 1;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let top = 32 * 127 * 127;
        let span = CONTEXT_I64_SPAN as i16;
        let scales = (0..n)
            .map(|b| {
                let r = next();
                let e = match mode {
                    0 => [0, 1, span - 1, span, span + 1, 36, 37][(r % 7) as usize] - 20,
                    1 => (r % 400) as i16 - 200,
                    _ => (b > 0) as i16 * span - 20,
                };
                let m = match extreme {
                    true => 255,
                    false => 128 + (r >> 8) as u8 % 128,
                };
                BlockScale { m, e }
            })
            .collect();
        let sums = (0..n * hd)
            .map(|_| {
                let r = next();
                match (extreme, mode) {
                    (true, 2) => top,
                    (true, _) => [top, -top, top - 1][(r % 3) as usize],
                    (false, _) => (r % (2 * top as u64 + 1)) as i32 - top,
                }
            })
            .collect();
        (scales, sums)
    }

    proptest::proptest! {
        #[test]
        fn grouped_context_sums_are_the_reference(n in 0usize..300, hd in 1usize..24,
                                                  seed in proptest::prelude::any::<u64>(),
                                                  mode in 0u8..3,
                                                  extreme in proptest::prelude::any::<bool>()) {
            let (scales, sums) = blocks(n, hd, seed, mode, extreme);
            let mut fast = vec![0f32; hd];
            let done = context_outputs_by_block(&mut fast, &scales, &sums,
                &mut ContextScratch::default(), 7);
            // The reference's output-major terms.
            let mut terms = vec![(0i64, 0i32); hd * n.max(1)];
            for (b, s) in scales.iter().enumerate() {
                for d in 0..hd {
                    terms[d * n.max(1) + b] = (sums[b * hd + d] as i64 * s.m as i64, s.e as i32);
                }
            }
            let mut slow = vec![0f32; hd];
            let want = context_outputs(&mut slow, &terms, n.max(1), n, 7);
            proptest::prop_assert_eq!(done.is_ok(), want.is_ok());
            if done.is_ok() {
                proptest::prop_assert_eq!(
                    fast.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    slow.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                );
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn every_form_of_add_shifted_is_the_loop(
            sums in proptest::collection::vec(-(32 * 127 * 127)..=32 * 127 * 127i32, 0..150),
            start in proptest::collection::vec(-(1i64 << 60)..(1i64 << 60), 150),
            m in 0i64..256,
            shift in 0..=CONTEXT_I64_SPAN,
        ) {
            let start = &start[..sums.len()];
            let want: Vec<i64> = start.iter().zip(&sums)
                .map(|(&t, &a)| t + ((a as i64 * m) << shift)).collect();
            let mut each = start.to_vec();
            add_shifted_each(&mut each, &sums, m, shift);
            proptest::prop_assert_eq!(&each, &want);
            #[cfg(target_arch = "x86_64")]
            {
                if is_x86_feature_detected!("avx512f") {
                    let mut t = start.to_vec();
                    // SAFETY: AVX-512F was detected.
                    unsafe { add_shifted_avx512(&mut t, &sums, m, shift) };
                    proptest::prop_assert_eq!(&t, &want);
                }
                if is_x86_feature_detected!("avx2") {
                    let mut t = start.to_vec();
                    // SAFETY: AVX2 was detected.
                    unsafe { add_shifted_avx2(&mut t, &sums, m, shift) };
                    proptest::prop_assert_eq!(&t, &want);
                }
            }
        }
    }

    /// A stage queues its cache rows in the layer's batch; hashed together with a product's
    /// rows, the set gets the commitment and leaves the direct functions give.
    #[test]
    fn queued_cache_rows_commit_as_the_direct_functions() {
        let mut cache = LayerCache::new(2, 8);
        for p in 0..5 {
            let kv: Vec<f32> = (0..16)
                .map(|i| ((p * 16 + i) as f32 * 0.37).sin())
                .collect();
            cache
                .append(&kv, &kv.iter().map(|x| x * 2.0).collect::<Vec<_>>())
                .unwrap();
        }
        let from = 3;
        let mut batch = LeafBatch::default();
        let product: Vec<f32> = (0..6).map(|i| i as f32).collect();
        batch.queue(&product, (2, 3), 0, 0);
        let bytes = cache.encode_rows(from..5);
        queue_cache_rows(&mut batch, from, cache.row_bytes(), &bytes);
        let done = batch.finish(false);
        assert_eq!(done.len(), 2);
        assert_eq!(done[1].0, cache_commitment(from, cache.row_bytes(), &bytes));
        assert_eq!(done[1].1.len(), 2);
        assert_eq!(done[1].1[0], cache_row_leaf(3, &bytes[..cache.row_bytes()]));
        assert_eq!(done[1].1[1], cache_row_leaf(4, &bytes[cache.row_bytes()..]));
    }

    proptest::proptest! {
        /// Each position's keys and values are stored as quantised, whatever block and kv
        /// head they fall in (read back through the canonical encoding against the
        /// quantisation done here), and a cache cut back, or refused a row half written, holds
        /// what a cache of only the rows before does, byte for byte.
        #[test]
        fn keys_and_values_come_back_as_quantised_and_a_cut_leaves_no_trace(
            kvh in 1usize..4,
            hd in proptest::sample::select(vec![8usize, 40, 64]),
            n in 1usize..80,
            cut in 0usize..80,
            seed in proptest::prelude::any::<u64>(),
        ) {
            let cut = cut % n;
            let mut state = seed | 1;
            let mut draw = |len: usize| -> Vec<f32> {
                (0..len)
                    .map(|_| {
                        state ^= state << 13;
                        state ^= state >> 7;
                        state ^= state << 17;
                        (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
                    })
                    .collect()
            };
            let (k, v) = (draw(n * kvh * hd), draw(n * kvh * hd));
            let mut whole = LayerCache::new(kvh, hd);
            whole.append(&k, &v).unwrap();
            let (rb, hb) = (whole.row_bytes(), hd.div_ceil(BLOCK));
            let rows = whole.encode_rows(0..n);
            for (pos, row) in rows.chunks_exact(rb).enumerate() {
                for g in 0..kvh {
                    let kh = &k[(pos * kvh + g) * hd..(pos * kvh + g + 1) * hd];
                    let at = g * (hb * (BLOCK + 3) + hd + 2);
                    for b in 0..hb {
                        let mut expected = [0i8; BLOCK];
                        quantize_block(&kh[b * BLOCK..((b + 1) * BLOCK).min(hd)], &mut expected);
                        let expected = expected.map(|x| x as u8);
                        let stored = &row[at + b * BLOCK..at + (b + 1) * BLOCK];
                        proptest::prop_assert_eq!(stored, &expected[..], "key at {}, kv head {}", pos, g);
                    }
                    let vh = &v[(pos * kvh + g) * hd..(pos * kvh + g + 1) * hd];
                    let e = v_exponent(vh.iter().fold(0f32, |m, x| m.max(x.abs())));
                    let expected: Vec<u8> = vh
                        .iter()
                        .map(|&x| round_half_even(x as f64 * pow2(-e)).clamp(-127.0, 127.0) as i8 as u8)
                        .collect();
                    let at = g * (hb * (BLOCK + 3) + hd + 2) + hb * (BLOCK + 3);
                    proptest::prop_assert_eq!(&row[at..at + hd], &expected[..], "position {}, kv head {}", pos, g);
                    proptest::prop_assert_eq!(&row[at + hd..at + hd + 2], &(e as i16).to_le_bytes()[..]);
                }
            }
            let before = LayerCache::from_encoded(kvh, hd, &rows[..cut * rb]).unwrap();
            let mut cut_back = whole.clone();
            cut_back.truncate(cut);
            proptest::prop_assert_eq!(&cut_back.k_t, &before.k_t);
            proptest::prop_assert_eq!(&cut_back.v_t, &before.v_t);
            proptest::prop_assert_eq!(&cut_back.v_e, &before.v_e);
            cut_back.append(&k[cut * kvh * hd..], &v[cut * kvh * hd..]).unwrap();
            proptest::prop_assert_eq!(&cut_back.k_t, &whole.k_t);
            proptest::prop_assert_eq!(&cut_back.v_t, &whole.v_t);
            proptest::prop_assert_eq!(&cut_back.v_e, &whole.v_e);
            // The row at `cut` refused at its last kv head's value exponent, after every kv
            // head's values went in.
            let mut bad = rows[cut * rb..(cut + 1) * rb].to_vec();
            bad[rb - 2..].copy_from_slice(&i16::MAX.to_le_bytes());
            let mut refused = before.clone();
            proptest::prop_assert!(refused.extend_encoded(&bad).is_err());
            proptest::prop_assert_eq!(&refused.k_t, &before.k_t);
            proptest::prop_assert_eq!(&refused.v_t, &before.v_t);
            proptest::prop_assert_eq!(&refused.v_e, &before.v_e);
            proptest::prop_assert_eq!(refused.encode_rows(0..cut), &rows[..cut * rb]);
        }
    }

    /// A cache row's int8 keys and values never hold −128 (`append` clamps to ±127, and the
    /// AVX2 block dots need it): a revealed row holding one is refused wherever in its keys
    /// (padding included) or values it is, while the same byte as a key scale's mantissa
    /// (128) is a valid row.
    #[test]
    fn a_cache_row_with_an_int8_of_minus_128_is_refused() {
        let (kvh, hd) = (2, 40);
        let mut one = LayerCache::new(kvh, hd);
        let kv: Vec<f32> = (0..kvh * hd).map(|i| (i as f32 * 0.37).cos()).collect();
        one.append(&kv, &kv).unwrap();
        let row = one.encode_rows(0..1);
        let hb = hd.div_ceil(BLOCK);
        let per_head = hb * BLOCK + hb * 3 + hd + 2;
        assert_eq!(row.len(), kvh * per_head);
        for g in 0..kvh {
            let keys = g * per_head;
            let (scales, values) = (keys + hb * BLOCK, keys + hb * (BLOCK + 3));
            for i in [keys, scales - 1, values, values + hd - 1] {
                let mut bad = row.clone();
                bad[i] = 0x80;
                let err = LayerCache::from_encoded(kvh, hd, &bad).unwrap_err();
                assert!(err.to_string().contains("-128"), "byte {i}: {err}");
            }
            let mut fine = row.clone();
            fine[scales] = 0x80;
            assert!(LayerCache::from_encoded(kvh, hd, &fine).is_ok());
        }
    }

    /// A refused row leaves nothing behind, even a row refused half way through (its key
    /// bytes read, its scale out of range): the next rows land where they belong.
    #[test]
    fn a_refused_cache_row_leaves_the_cache_as_it_was() {
        let (kvh, hd) = (2, 40);
        let mut whole = LayerCache::new(kvh, hd);
        for p in 0..4 {
            let kv: Vec<f32> = (0..kvh * hd)
                .map(|i| ((p * 97 + i) as f32 * 0.31).sin())
                .collect();
            whole
                .append(&kv, &kv.iter().map(|x| x * 3.0).collect::<Vec<_>>())
                .unwrap();
        }
        let rows = whole.encode_rows(0..4);
        let rb = whole.row_bytes();
        // Row 2 with its first key scale's mantissa below 128: refused after its key bytes.
        let mut bad = rows[2 * rb..3 * rb].to_vec();
        bad[2 * BLOCK] = 5;
        let mut cache = LayerCache::from_encoded(kvh, hd, &rows[..2 * rb]).unwrap();
        assert!(cache.extend_encoded(&bad).is_err());
        assert_eq!(cache.len(), 2);
        cache.extend_encoded(&rows[2 * rb..]).unwrap();
        assert_eq!(cache.encode_rows(0..4), rows);
        assert_eq!(cache.k_me, whole.k_me);
        assert_eq!(cache.bytes(), whole.bytes());
        // And refused after whole rows went in: back to the rows held before.
        let mut cache = LayerCache::from_encoded(kvh, hd, &rows[..2 * rb]).unwrap();
        let tail = [&rows[2 * rb..3 * rb], &bad[..]].concat();
        assert!(cache.extend_encoded(&tail).is_err());
        assert_eq!(cache.encode_rows(0..2), rows[..2 * rb]);
        cache.extend_encoded(&rows[2 * rb..]).unwrap();
        assert_eq!(cache.encode_rows(0..4), rows);
    }

    #[test]
    fn v_exponent_puts_amax_in_64_to_128() {
        for amax in [1.0f32, 0.75, 3.9, 1e-3, 1e-40, 2e30] {
            let e = v_exponent(amax);
            let scaled = amax as f64 * pow2(-e);
            assert!((64.0..128.0).contains(&scaled), "{amax}: {scaled}");
        }
    }

    #[test]
    fn f64_scale_matches_the_f32_rule_on_f32_values() {
        for a in [1e-38f32, 0.001, 0.5, 1.0, 2.5167596, 127.0, 3e38] {
            assert_eq!(scale_for_amax_f64(a as f64), BlockScale::for_amax(a), "{a}");
        }
        // Every positive finite f32 of a random stream (the rule's every mantissa path).
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..200_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let a = f32::from_bits((s >> 33) as u32);
            if a.is_finite() && a > 0.0 {
                assert_eq!(
                    scale_for_amax_f64(a as f64),
                    BlockScale::for_amax(a),
                    "{a:e}"
                );
            }
        }
        // Beyond the f32 range: still the smallest admissible scale.
        let a = 1e-300f64;
        let s = scale_for_amax_f64(a);
        assert!(a / (s.m as f64 * pow2(s.e as i32)) <= 127.0);
    }
}

/// What the tests of the vector forms of the scores and probability loops share: random
/// scales, random cases, and a form's result beside the scalar loop's.
#[cfg(all(test, target_arch = "x86_64"))]
mod scores_forms {
    use super::{pack_scale, scaled_probabilities, scores_of, BlockScale, KeyScales};

    /// A vector form of [`scaled_probabilities`].
    pub(super) type ScaledForm = unsafe fn(&[f32], &[i16], &mut [f64]) -> f64;

    /// `n` random probabilities in [0, 1] (some exactly 0 or 1; with `tiny`, some about
    /// 1e-30) and exponents anywhere a cache may hold them, through `form` and through the
    /// scalar loop: each one's maximum and values, as bits.
    pub(super) fn scaled_case(form: ScaledForm, n: usize, seed: u64, tiny: bool) -> [Vec<u64>; 2] {
        let mut next = xorshift(seed);
        let probabilities: Vec<f32> = (0..n)
            .map(|_| match next() % 7 {
                0 => 0.0,
                1 => 1.0,
                r if tiny => (r as f32) * 1e-30,
                _ => (next() >> 40) as f32 / (1u64 << 24) as f32,
            })
            .collect();
        let exponents: Vec<i16> = (0..n).map(|_| (next() % 601) as i16 - 300).collect();
        let (mut fast, mut slow) = (vec![f64::NAN; n], vec![f64::NAN; n]);
        // SAFETY: the caller checked that the CPU runs `form`.
        let a = unsafe { form(&probabilities, &exponents, &mut fast) };
        let b = scaled_probabilities(&probabilities, &exponents, &mut slow);
        let bits = |amax: f64, v: &[f64]| {
            std::iter::once(amax)
                .chain(v.iter().copied())
                .map(f64::to_bits)
                .collect()
        };
        [bits(a, &fast), bits(b, &slow)]
    }

    /// A vector form of [`scores_of`].
    pub(super) type Form = unsafe fn(
        &[BlockScale],
        &[i32],
        KeyScales,
        f32,
        usize,
        &mut Vec<f32>,
    ) -> Result<(), String>;

    /// A deterministic stream of random words from `seed`.
    pub(super) fn xorshift(seed: u64) -> impl FnMut() -> u64 {
        let mut s = seed | 1;
        move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        }
    }

    /// Random block scales: exponents near zero (`wide`: anywhere from −40 to 100, so block
    /// terms far apart and scores past the f32 range), mantissas in [128, 255].
    pub(super) fn scale(r: u64, wide: bool) -> BlockScale {
        let e = match wide {
            true => (r % 141) as i16 - 40,
            false => (r % 9) as i16 - 4,
        };
        BlockScale {
            m: 128 + (r >> 16) as u8 % 128,
            e,
        }
    }

    /// `forms[hb − 1]` (the form for `hb` blocks) against the scalar loop on a random case of
    /// `n` keys, as (result, bits) each.
    pub(super) fn random_case(
        forms: [Form; 4],
        hb: usize,
        n: usize,
        pad: usize,
        wide: bool,
        seed: u64,
    ) -> [(Result<(), String>, Vec<u32>); 2] {
        let stride = hb + pad;
        let (qs, dots, scales) = case(hb, n, stride, wide, seed);
        match hb {
            1 => against_scalar::<1>(forms[0], &qs, &dots, &scales, stride),
            2 => against_scalar::<2>(forms[1], &qs, &dots, &scales, stride),
            3 => against_scalar::<3>(forms[2], &qs, &dots, &scales, stride),
            _ => against_scalar::<4>(forms[3], &qs, &dots, &scales, stride),
        }
    }

    /// `keys` keys whose second block term is 60 binary places below the first: the f64 sum
    /// is the first term alone, an f32 tie that rounds down to even, while the exact sum is
    /// just above the tie and rounds up. `form` (for two blocks) must give the exact sum's
    /// bits for every key, as the scalar loop does.
    pub(super) fn far_apart_terms(form: Form, keys: usize) {
        let qs = [BlockScale { m: 129, e: 0 }, BlockScale { m: 128, e: -30 }];
        // 1009 · 129 · 129 = 16 790 769: 25 significant bits, odd.
        let key = [BlockScale { m: 129, e: 0 }, BlockScale { m: 128, e: -30 }];
        let scales: Vec<BlockScale> = (0..keys).flat_map(|_| key).collect();
        let dots: Vec<i32> = (0..keys).flat_map(|_| [1009, 1]).collect();
        let [fast, slow] = against_scalar::<2>(form, &qs, &dots, &scales, 2);
        assert_eq!(fast, slow);
        let exact = 16_790_770.0f32 * 0.125;
        let f64_sum = (16_790_769.0f64 + super::pow2(-46)) as f32 * 0.125;
        assert_ne!(exact, f64_sum, "the f64 sum would round the other way");
        assert!(fast.1.iter().all(|&b| b == exact.to_bits()));
        assert_eq!(fast.1.len(), keys);
    }

    /// A random case: `hb` query block scales, `n` keys of `stride` scales, their dots.
    pub(super) fn case(
        hb: usize,
        n: usize,
        stride: usize,
        wide: bool,
        seed: u64,
    ) -> (Vec<BlockScale>, Vec<i32>, Vec<BlockScale>) {
        let mut next = xorshift(seed);
        let qs = (0..hb).map(|_| scale(next(), wide)).collect();
        let scales = (0..n * stride).map(|_| scale(next(), wide)).collect();
        let top = 32 * 128 * 128;
        let dots = (0..n * hb)
            .map(|_| (next() % (2 * top as u64 + 1)) as i32 - top)
            .collect();
        (qs, dots, scales)
    }

    fn bits(r: Result<(), String>, v: &[f32]) -> (Result<(), String>, Vec<u32>) {
        (r, v.iter().map(|x| x.to_bits()).collect())
    }

    /// `form` and the scalar loop for `HB` blocks, as (result, bits); the caller checked that
    /// the CPU runs `form`.
    pub(super) fn against_scalar<const HB: usize>(
        form: Form,
        qs: &[BlockScale],
        dots: &[i32],
        scales: &[BlockScale],
        stride: usize,
    ) -> [(Result<(), String>, Vec<u32>); 2] {
        // The packed columns, key `i`'s block `b` at `[b][first + i]`.
        let first = 5;
        let packed: Vec<Vec<i32>> = (0..HB)
            .map(|b| {
                let keys = scales.chunks(stride).map(|key| pack_scale(key[b]));
                std::iter::repeat_n(0, first).chain(keys).collect()
            })
            .collect();
        let keys = KeyScales {
            scales,
            packed: &packed,
            stride,
            first,
        };
        let (mut fast, mut slow) = (Vec::new(), Vec::new());
        // SAFETY: the caller checked the CPU; `packed` mirrors `scales`.
        let f = unsafe { form(qs, dots, keys, 0.125, 9, &mut fast) };
        let s = scores_of::<HB>(qs, dots, keys, 0.125, 9, &mut slow);
        // An error leaves the scores unspecified: compare them only when both succeed.
        match (&f, &s) {
            (Ok(()), Ok(())) => [bits(f, &fast), bits(s, &slow)],
            _ => [bits(f, &[]), bits(s, &[])],
        }
    }
}
