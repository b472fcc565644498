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

use dc_kernels::commit::{exact_row_leaf, gemm_commitment, merkle_root};
use dc_kernels::elementwise::softmax_with;
use dc_kernels::exact::{exact_sum, round_i64_fast, Exact};
use dc_kernels::int8;
use dc_kernels::quant::{quantize_block, round_half_even, BlockScale, BLOCK, QMAX};
use dc_kernels::reveal::{leaf_of_encoding, values_encoding};
use dc_kernels::{Commitment, Domain};
use rayon::prelude::*;

use crate::error::{ModelError, Result};

mod reference;

/// The quantised keys and values of one layer for one generation.
#[derive(Clone, Debug)]
pub struct LayerCache {
    kv_heads: usize,
    head_dim: usize,
    /// Blocks per head vector.
    hb: usize,
    /// `[pos][kv_head][hb · 32]`.
    k_q: Vec<i8>,
    /// `[pos][kv_head][hb]`.
    k_s: Vec<BlockScale>,
    /// `[pos][kv_head][head_dim]`.
    v_q: Vec<i8>,
    /// `[pos][kv_head]`: V's power-of-two exponent.
    v_e: Vec<i16>,
    len: usize,
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
            k_q: Vec::new(),
            k_s: Vec::new(),
            v_q: Vec::new(),
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
        self.k_q.len() + self.v_q.len() + self.k_s.len() * 4 + self.v_e.len() * 2
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
            for &q in &self.k_q[base * BLOCK..(base + hb) * BLOCK] {
                out.push(q as u8);
            }
            for s in &self.k_s[base..base + hb] {
                out.push(s.m);
                out.extend_from_slice(&s.e.to_le_bytes());
            }
            for &q in &self.v_q[(pos * kvh + g) * hd..(pos * kvh + g + 1) * hd] {
                out.push(q as u8);
            }
            out.extend_from_slice(&self.v_e[pos * kvh + g].to_le_bytes());
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

    /// Keeps only the first `len` positions.
    pub fn truncate(&mut self, len: usize) {
        if len < self.len {
            let per = self.kv_heads;
            self.k_q.truncate(len * per * self.hb * BLOCK);
            self.k_s.truncate(len * per * self.hb);
            self.v_q.truncate(len * per * self.head_dim);
            self.v_e.truncate(len * per);
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
        c.k_q.reserve_exact(n * kv_heads * hb * BLOCK);
        c.k_s.reserve_exact(n * kv_heads * hb);
        c.v_q.reserve_exact(n * kv_heads * head_dim);
        c.v_e.reserve_exact(n * kv_heads);
        let first = c.len;
        let bad = |what: &str, pos: usize| {
            ModelError::Input(format!(
                "the cache row at position {} has {what}",
                first + pos
            ))
        };
        let exponent_ok = |e: i16| (-MAX_CACHE_EXPONENT..=MAX_CACHE_EXPONENT).contains(&e);
        for (pos, row) in bytes.chunks_exact(rb).enumerate() {
            // `append` never writes -128 (int8 values are clamped to ±127).
            if row.contains(&0x80) {
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
            for _ in 0..kv_heads {
                let k = &row[at..at + hb * BLOCK];
                c.k_q.extend(k.iter().map(|&b| b as i8));
                at += hb * BLOCK;
                for s in row[at..at + hb * 3].chunks_exact(3) {
                    let e = i16::from_le_bytes([s[1], s[2]]);
                    if s[0] < 128 || !exponent_ok(e) {
                        return Err(bad("a key scale out of range", pos));
                    }
                    c.k_s.push(BlockScale { m: s[0], e });
                }
                at += hb * 3;
                c.v_q
                    .extend(row[at..at + head_dim].iter().map(|&b| b as i8));
                at += head_dim;
                let e = i16::from_le_bytes([row[at], row[at + 1]]);
                if !exponent_ok(e) {
                    return Err(bad("a value exponent out of range", pos));
                }
                c.v_e.push(e);
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
                    self.k_s.push(quantize_block(vals, &mut q));
                    self.k_q.extend_from_slice(&q);
                }
                let vh = &vr[g * self.head_dim..(g + 1) * self.head_dim];
                let amax = vh.iter().fold(0f32, |m, x| m.max(x.abs()));
                let e = v_exponent(amax);
                let inv = pow2(-e);
                for &x in vh {
                    // x · 2^-e is exact in f64; one rounding, ties to even.
                    let q = round_half_even(x as f64 * inv).clamp(-QMAX as f64, QMAX as f64);
                    self.v_q.push(q as i8);
                }
                self.v_e.push(e as i16);
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
    let leaves: Vec<Commitment> = bytes
        .chunks_exact(row_bytes)
        .enumerate()
        .map(|(i, r)| cache_row_leaf(first + i, r))
        .collect();
    gemm_commitment(leaves.len(), row_bytes, &merkle_root(&leaves))
}

/// Sums a handful of block terms exactly: the rounded f32 and, when asked, the exact value.
#[inline]
fn sum_terms(terms: &[(i64, i32)], want_exact: bool) -> Option<(f32, Option<Exact>)> {
    let emin = terms.iter().map(|t| t.1).min()?;
    let emax = terms.iter().map(|t| t.1).max()?;
    // Terms are below 2^35; with a span of at most 24 bits and at most 8 terms the shifted sum
    // stays below 2^62.
    if emax - emin <= 24 && terms.len() <= 8 {
        let s: i64 = terms.iter().map(|&(t, e)| t << (e - emin)).sum();
        let v = round_i64_fast(s, emin);
        return v
            .is_finite()
            .then(|| (v, want_exact.then(|| Exact::from_i64(s, emin))));
    }
    let e = exact_sum(terms);
    let v = e.to_f32()?;
    Some((v, want_exact.then_some(e)))
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

/// Commitments to both attention products of one layer over a hop's rows: per query position,
/// one leaf over every head's exact scores, one over every head's exact context values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionCommitments {
    /// `Q · Kᵀ`.
    pub scores: dc_kernels::Commitment,
    /// `P' · V`.
    pub context: dc_kernels::Commitment,
}

/// Exact values of one (position, head), kept only when committing. `ExactRow`s free their
/// buffers without visiting every value (they are nearly always all small).
#[derive(Default)]
struct HeadExact {
    scores: dc_kernels::exact::ExactRow,
    context: dc_kernels::exact::ExactRow,
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
    attend_committed(shape, cache, q, start, out, layer, None, None).map(|_| ())
}

/// The Merkle leaves of both attention products' committed rows (a stage keeps them to open a
/// row later; a checker compares its own).
#[derive(Clone, Debug, Default)]
pub struct AttentionLeaves {
    /// One per committed position of `Q · Kᵀ`.
    pub scores: Vec<Commitment>,
    /// One per committed position of `P' · V`.
    pub context: Vec<Commitment>,
    /// The canonical encoding of each committed row of `P' · V` (what its leaf hashes): a
    /// stage reveals it when a check tests the output projection without the attention.
    pub context_rows: Vec<Vec<u8>>,
}

/// Per-head attention kernels. Every kernel gives the same bits (property-tested against the
/// reference); the choice is for tests and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionKernel {
    /// The value-by-value definition (NUMERICS.md §2).
    Reference,
    /// Scratch buffers reused per worker, each `exp` once, the per-key int8 loops of
    /// [`dc_kernels::int8`].
    #[default]
    Fast,
}

/// [`attend`], also committing to the exact values of both products for the positions from
/// `commit_from` on, when given; `leaves` receives each committed row's leaves.
#[allow(clippy::too_many_arguments)]
pub fn attend_committed(
    shape: AttentionShape,
    cache: &LayerCache,
    q: &[f32],
    start: usize,
    out: &mut [f32],
    layer: usize,
    commit_from: Option<usize>,
    leaves: Option<&mut AttentionLeaves>,
) -> Result<Option<AttentionCommitments>> {
    attend_committed_with(
        AttentionKernel::Fast,
        shape,
        cache,
        q,
        start,
        out,
        layer,
        commit_from,
        leaves,
    )
}

/// [`attend_committed`] with a chosen per-head kernel.
#[allow(clippy::too_many_arguments)]
pub fn attend_committed_with(
    kernel: AttentionKernel,
    shape: AttentionShape,
    cache: &LayerCache,
    q: &[f32],
    start: usize,
    out: &mut [f32],
    layer: usize,
    commit_from: Option<usize>,
    leaves: Option<&mut AttentionLeaves>,
) -> Result<Option<AttentionCommitments>> {
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
        let mut ex = commit_from
            .is_some_and(|f| start + t >= f)
            .then(HeadExact::default);
        let (g, pos, window) = (h / group, start + t, shape.window);
        match kernel {
            AttentionKernel::Reference => {
                reference::head_attention(cache, qh, g, pos, window, scale, o, ex.as_mut())
            }
            AttentionKernel::Fast => {
                head_attention(cache, qh, g, pos, window, scale, o, ex.as_mut(), scratch)
            }
        }?;
        Ok(ex)
    };
    // Heads run in parallel on the rayon pool this is called from (`Gemm::install`); called
    // from outside any pool (a one-thread engine, a test) they run on the calling thread, so a
    // daemon told to use one thread uses one.
    let results: Vec<Result<Option<HeadExact>, String>> = if rayon::current_thread_index().is_some()
    {
        out.par_chunks_mut(hd)
            .enumerate()
            .map_init(HeadScratch::default, one)
            .collect()
    } else {
        let mut scratch = HeadScratch::default();
        out.chunks_mut(hd)
            .enumerate()
            .map(|head| one(&mut scratch, head))
            .collect()
    };
    let mut exact = Vec::with_capacity(results.len());
    for r in results {
        match r {
            Ok(e) => exact.push(e),
            Err(detail) => {
                return Err(ModelError::NonFinite {
                    stage: format!("attention of layer {layer}"),
                    layer: layer.to_string(),
                    detail,
                })
            }
        }
    }
    let Some(from) = commit_from else {
        return Ok(None);
    };
    let (mut sl, mut cl) = (Vec::with_capacity(rows), Vec::with_capacity(rows));
    let (keep_rows, mut context_rows) = (leaves.is_some(), Vec::new());
    for (t, row) in exact.chunks(heads).enumerate() {
        if start + t < from {
            continue;
        }
        let mut s = Vec::new();
        let mut c = Vec::new();
        for e in row.iter().flatten() {
            s.extend_from_slice(&e.scores);
            c.extend_from_slice(&e.context);
        }
        sl.push(exact_row_leaf(start + t, &s));
        if keep_rows {
            let encoding = values_encoding(&c);
            cl.push(leaf_of_encoding(start + t, c.len(), &encoding));
            context_rows.push(encoding);
        } else {
            cl.push(exact_row_leaf(start + t, &c));
        }
    }
    let commitments = AttentionCommitments {
        scores: gemm_commitment(sl.len(), heads, &merkle_root(&sl)),
        context: gemm_commitment(cl.len(), heads * hd, &merkle_root(&cl)),
    };
    if let Some(l) = leaves {
        l.scores = sl;
        l.context = cl;
        l.context_rows = context_rows;
    }
    Ok(Some(commitments))
}

/// Widest head the fast kernel takes, in blocks (head_dim 256); wider heads use the reference.
const FAST_MAX_BLOCKS: usize = 8;

/// Buffers one worker reuses across the heads it runs.
#[derive(Default)]
struct HeadScratch {
    qq: Vec<i8>,
    qs: Vec<BlockScale>,
    scores: Vec<f32>,
    exps: Vec<f64>,
    acc: Vec<i32>,
    ctx_terms: Vec<(i64, i32)>,
}

/// One query head at absolute position `pos`: the same values as
/// [`reference::head_attention`] (property-tested bit for bit), without its per-head
/// allocations, with each `exp` taken once and the inner loops shaped for vector units.
#[allow(clippy::too_many_arguments)]
fn head_attention(
    cache: &LayerCache,
    qh: &[f32],
    g: usize,
    pos: usize,
    window: Option<usize>,
    scale: f32,
    out: &mut [f32],
    mut exact: Option<&mut HeadExact>,
    scratch: &mut HeadScratch,
) -> Result<(), String> {
    let (hd, hb, kvh) = (cache.head_dim, cache.hb, cache.kv_heads);
    if hb > FAST_MAX_BLOCKS {
        return reference::head_attention(cache, qh, g, pos, window, scale, out, exact);
    }
    let HeadScratch {
        qq,
        qs,
        scores,
        exps,
        acc,
        ctx_terms,
    } = scratch;
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
    let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
    let n = pos + 1 - lo;
    if let Some(e) = exact.as_deref_mut() {
        e.scores.reserve_exact(n);
        e.context.reserve_exact(hd);
    }
    // Scores: per key, hb block products, summed exactly, then the f32 scale.
    let want_exact = exact.is_some();
    let key_bytes = hb * BLOCK;
    let keys = &cache.k_q[(lo * kvh + g) * key_bytes..];
    let key_scales = &cache.k_s[(lo * kvh + g) * hb..];
    let stride = kvh * key_bytes;
    scores.clear();
    for i in 0..n {
        let kq = &keys[i * stride..i * stride + key_bytes];
        let ks = &key_scales[i * kvh * hb..i * kvh * hb + hb];
        let mut terms = [(0i64, 0i32); FAST_MAX_BLOCKS];
        for (b, (t, (qb, kb))) in terms
            .iter_mut()
            .zip(qq.chunks_exact(BLOCK).zip(kq.chunks_exact(BLOCK)))
            .enumerate()
        {
            let d = int8::block_dot(
                qb.try_into().expect("BLOCK long"),
                kb.try_into().expect("BLOCK long"),
            );
            let (sq, sk) = (qs[b], ks[b]);
            *t = (
                d as i64 * (sq.m as i64 * sk.m as i64),
                sq.e as i32 + sk.e as i32,
            );
        }
        let (dot, ex) = sum_terms(&terms[..hb], want_exact)
            .ok_or_else(|| format!("score of key {} overflows f32 at position {pos}", lo + i))?;
        if let (Some(e), Some(v)) = (exact.as_deref_mut(), ex) {
            e.scores.push(v);
        }
        scores.push(dot * scale);
    }
    softmax_with(scores, exps);
    // P' = P · 2^e_v, exact in f64, quantised in blocks of absolute key positions.
    let (first_block, last_block) = (lo / BLOCK, pos / BLOCK);
    let blocks = last_block + 1 - first_block;
    acc.clear();
    acc.resize(hd, 0);
    ctx_terms.clear();
    ctx_terms.resize(hd * blocks, (0, 0));
    let mut used = 0;
    for b in first_block..=last_block {
        let (j0, j1) = ((b * BLOCK).max(lo), ((b + 1) * BLOCK - 1).min(pos));
        let mut pv = [0f64; BLOCK];
        let mut amax = 0f64;
        for (p, j) in pv.iter_mut().zip(j0..=j1) {
            *p = scores[j - lo] as f64 * pow2(cache.v_e[j * kvh + g] as i32);
            amax = amax.max(*p);
        }
        if amax == 0.0 {
            continue;
        }
        let s = scale_for_amax_f64(amax);
        let inv = pow2(-(s.e as i32));
        let m = s.m as f64;
        acc.fill(0);
        for (j, &p) in (j0..=j1).zip(&pv) {
            // As in the reference: exact scaling, one correctly rounded division.
            let qp = round_half_even((p * inv) / m).min(QMAX as f64) as i8;
            if qp == 0 {
                continue;
            }
            let vrow = &cache.v_q[(j * kvh + g) * hd..(j * kvh + g + 1) * hd];
            int8::add_scaled(acc, qp, vrow);
        }
        for (t, &a) in ctx_terms.chunks_exact_mut(blocks).zip(acc.iter()) {
            t[used] = (a as i64 * s.m as i64, s.e as i32);
        }
        used += 1;
    }
    context_outputs(out, ctx_terms, blocks, used, pos, exact)
}

/// Each output of one head's context from its block terms (`blocks` places per output, the
/// first `used` filled): summed exactly, rounded to f32 into `out`, kept when committing.
fn context_outputs(
    out: &mut [f32],
    ctx_terms: &[(i64, i32)],
    blocks: usize,
    used: usize,
    pos: usize,
    mut exact: Option<&mut HeadExact>,
) -> Result<(), String> {
    for (o, t) in out.iter_mut().zip(ctx_terms.chunks_exact(blocks)) {
        let e = context_sum(&t[..used]);
        *o = e
            .to_f32()
            .ok_or_else(|| format!("context overflows f32 at position {pos}"))?;
        if let Some(x) = exact.as_deref_mut() {
            x.context.push(e);
        }
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
        // Beyond the f32 range: still the smallest admissible scale.
        let a = 1e-300f64;
        let s = scale_for_amax_f64(a);
        assert!(a / (s.m as f64 * pow2(s.e as i32)) <= 127.0);
    }
}
