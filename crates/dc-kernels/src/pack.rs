//! Weights quantised per output column along k and packed once into the layout the kernels
//! stream (NUMERICS.md §2).
//!
//! Columns are grouped in panels of 16. For each panel and block of 32 along k, one 544-byte
//! record holds everything the kernels read, so decode streams one contiguous run per panel:
//!
//! ```text
//! [  0..512)  q: for kg in 0..8, for column c in 0..16: q[c][32b + 4kg .. 32b + 4kg + 4]
//! [512..528)  m of each column's block scale
//! [528..544)  e - e_min(column), columns in the order 0,2,..,14, 1,3,..,15 (even lanes, odd lanes)
//! ```
//!
//! That is 8.5 bits per weight, like llama.cpp's Q8_0. Full exponents are also kept per
//! column block (`col_exp`) for the reference kernel and the wide fallback.

use rayon::prelude::*;

use crate::buffer::AlignedBytes;
use crate::error::{KernelError, Result};
use crate::quant::{check_finite, quantize_block, BlockScale, BLOCK, EXP_FAST};

/// Columns per panel.
pub const PANEL: usize = 16;
/// Bytes of quantised elements in one panel block.
pub const RECORD_Q: usize = PANEL * BLOCK;
/// Bytes of one panel block record.
pub const RECORD: usize = RECORD_Q + 2 * PANEL;
/// Largest exponent span within a column the fast kernels accept (shift amounts stay far
/// below 64 and `127 · 255 · 2^40 < 2^55`).
pub const COL_SPAN_FAST: i32 = 40;

/// How a weight matrix is stored in its source file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightLayout {
    /// `[n][k]`: one output column per row (Hugging Face `nn.Linear`, GGUF).
    NByK,
    /// `[k][n]`: row-major by input (GPT-2's `Conv1D`).
    KByN,
}

/// Per-panel facts the fast kernels check before using the i64 path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PanelMeta {
    /// Every column of the panel has exponent span at most [`COL_SPAN_FAST`].
    pub fast: bool,
    /// `max_{c,b} 127 · m · 2^(e - e_min(c))` over the panel's columns.
    pub bound: u64,
}

/// A quantised, packed weight matrix `k × n` (the right operand of `Y = X · W`).
#[derive(Clone, Debug)]
pub struct PackedWeights {
    k: usize,
    n: usize,
    blocks: usize,
    panels: usize,
    data: AlignedBytes,
    col_exp: Vec<i16>,
    /// Shared with the exact accumulators of every product (their column units).
    col_exp_min: std::sync::Arc<[i32]>,
    panel_meta: Vec<PanelMeta>,
}

impl PackedWeights {
    /// Quantises and packs `w` (`k × n` as described by `layout`). `tensor` names it in errors.
    pub fn quantize(
        w: &[f32],
        k: usize,
        n: usize,
        layout: WeightLayout,
        tensor: &str,
    ) -> Result<PackedWeights> {
        if w.len() != k * n || k == 0 || n == 0 {
            return Err(KernelError::Shape {
                op: "pack weights",
                detail: format!("{tensor}: {} values for {k} × {n}", w.len()),
            });
        }
        let blocks = k.div_ceil(BLOCK);
        // Quantise column by column into a plain column-major form, then pack.
        let columns: Vec<Result<(Vec<i8>, Vec<BlockScale>)>> = (0..n)
            .into_par_iter()
            .map(|j| {
                let col: Vec<f32> = match layout {
                    WeightLayout::NByK => w[j * k..(j + 1) * k].to_vec(),
                    WeightLayout::KByN => (0..k).map(|i| w[i * n + j]).collect(),
                };
                check_finite(&col, tensor, j)?;
                let mut q = vec![0i8; blocks * BLOCK];
                let mut s = Vec::with_capacity(blocks);
                for b in 0..blocks {
                    let vals = &col[b * BLOCK..((b + 1) * BLOCK).min(k)];
                    let dst: &mut [i8; BLOCK] = (&mut q[b * BLOCK..(b + 1) * BLOCK])
                        .try_into()
                        .expect("block slice is BLOCK long");
                    s.push(quantize_block(vals, dst));
                }
                Ok((q, s))
            })
            .collect();
        let mut q = Vec::with_capacity(n * blocks * BLOCK);
        let mut scales = Vec::with_capacity(n * blocks);
        for c in columns {
            let (cq, cs) = c?;
            q.extend_from_slice(&cq);
            scales.extend_from_slice(&cs);
        }
        Ok(Self::from_columns(k, n, &q, &scales))
    }

    /// Packs already quantised columns: `q` is `n × blocks × 32`, `scales` is `n × blocks`.
    pub fn from_columns(k: usize, n: usize, q: &[i8], scales: &[BlockScale]) -> PackedWeights {
        let blocks = k.div_ceil(BLOCK);
        assert_eq!(q.len(), n * blocks * BLOCK, "q length");
        assert_eq!(scales.len(), n * blocks, "scales length");
        let panels = n.div_ceil(PANEL);
        let n_pad = panels * PANEL;
        let mut col_exp = vec![BlockScale::ZERO_BLOCK.e; n_pad * blocks];
        for (e, s) in col_exp.iter_mut().zip(scales) {
            *e = s.e;
        }
        let (col_exp_min, col_fast) = column_facts(&col_exp, n, blocks);
        let mut data = AlignedBytes::zeroed(panels * blocks * RECORD);
        let mut panel_meta = Vec::with_capacity(panels);
        let out = data.as_mut_slice();
        for p in 0..panels {
            let mut meta = PanelMeta {
                fast: (0..PANEL).all(|c| col_fast[p * PANEL + c]),
                bound: 0,
            };
            for b in 0..blocks {
                let rec = &mut out[(p * blocks + b) * RECORD..(p * blocks + b + 1) * RECORD];
                for c in 0..PANEL {
                    let j = p * PANEL + c;
                    let (m, shift) = if j < n {
                        let s = scales[j * blocks + b];
                        let shift = (s.e as i32 - col_exp_min[j]).min(255) as u8;
                        (s.m, shift)
                    } else {
                        (BlockScale::ZERO_BLOCK.m, 0)
                    };
                    if j < n {
                        let src = &q[(j * blocks + b) * BLOCK..(j * blocks + b + 1) * BLOCK];
                        for kg in 0..BLOCK / 4 {
                            for t in 0..4 {
                                rec[kg * 64 + c * 4 + t] = src[kg * 4 + t] as u8;
                            }
                        }
                    }
                    rec[RECORD_Q + c] = m;
                    rec[RECORD_Q + PANEL + shift_slot(c)] = shift;
                    if meta.fast && j < n {
                        meta.bound = meta.bound.max((127 * m as u64) << shift);
                    }
                }
            }
            panel_meta.push(meta);
        }
        PackedWeights {
            k,
            n,
            blocks,
            panels,
            data,
            col_exp,
            col_exp_min: col_exp_min.into(),
            panel_meta,
        }
    }

    /// Reduction length.
    pub fn k(&self) -> usize {
        self.k
    }
    /// Output columns.
    pub fn n(&self) -> usize {
        self.n
    }
    /// Blocks along k.
    pub fn blocks(&self) -> usize {
        self.blocks
    }
    /// Panels of 16 columns (the last one zero padded).
    pub fn panels(&self) -> usize {
        self.panels
    }
    /// Bytes the kernels stream for one full pass over the matrix.
    pub fn packed_bytes(&self) -> usize {
        self.data.len()
    }
    /// The packed records.
    pub(crate) fn data(&self) -> &[u8] {
        self.data.as_slice()
    }
    /// The record of a panel block.
    pub(crate) fn record(&self, panel: usize, b: usize) -> &[u8] {
        let o = (panel * self.blocks + b) * RECORD;
        &self.data.as_slice()[o..o + RECORD]
    }
    /// Smallest block exponent of column `j`.
    pub fn col_exp_min(&self, j: usize) -> i32 {
        self.col_exp_min[j]
    }
    /// Smallest block exponent of every column, zero padded to whole panels.
    pub(crate) fn col_exp_mins(&self) -> &[i32] {
        &self.col_exp_min
    }

    /// The columns' smallest block exponents, shared (the units of exact accumulators).
    pub(crate) fn col_units(&self) -> std::sync::Arc<[i32]> {
        self.col_exp_min.clone()
    }
    /// Fast-path facts of a panel.
    pub fn panel_meta(&self, p: usize) -> PanelMeta {
        self.panel_meta[p]
    }
    /// The scale of column `j`, block `b`.
    pub fn scale(&self, j: usize, b: usize) -> BlockScale {
        let p = j / PANEL;
        BlockScale {
            m: self.record(p, b)[RECORD_Q + j % PANEL],
            e: self.col_exp[j * self.blocks + b],
        }
    }
    /// The 32 quantised elements of column `j`, block `b`.
    pub fn column_block(&self, j: usize, b: usize) -> [i8; BLOCK] {
        let rec = self.record(j / PANEL, b);
        let c = j % PANEL;
        let mut out = [0i8; BLOCK];
        for kg in 0..BLOCK / 4 {
            for t in 0..4 {
                out[kg * 4 + t] = rec[kg * 64 + c * 4 + t] as i8;
            }
        }
        out
    }
}

/// Per column of `col_exp` (`n_pad × blocks`, the first `n` real): the smallest block exponent
/// (the zero block's for padding) and whether the fast kernels may take it.
fn column_facts(col_exp: &[i16], n: usize, blocks: usize) -> (Vec<i32>, Vec<bool>) {
    let n_pad = col_exp.len() / blocks;
    let mut col_exp_min = vec![BlockScale::ZERO_BLOCK.e as i32; n_pad];
    let mut col_fast = vec![true; n_pad];
    for j in 0..n {
        let es = &col_exp[j * blocks..(j + 1) * blocks];
        let lo = es.iter().map(|&e| e as i32).min().unwrap_or(0);
        let hi = es.iter().map(|&e| e as i32).max().unwrap_or(0);
        col_exp_min[j] = lo;
        col_fast[j] = hi - lo <= COL_SPAN_FAST && lo >= -EXP_FAST && hi <= EXP_FAST;
    }
    (col_exp_min, col_fast)
}

/// Leads every stored packing; the digit is the format version.
const STORED_MAGIC: &[u8; 8] = b"DCPACK01";

impl PackedWeights {
    /// The packing as bytes, for a cache that spares a restart the quantisation:
    /// `"DCPACK01"`, `k` and `n` (u64 LE), the panel records, the block exponents (i16 LE) and a
    /// blake3 checksum of all that. [`PackedWeights::from_bytes`] reads it back.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(24 + self.data.len() + 2 * self.col_exp.len() + 32);
        out.extend_from_slice(STORED_MAGIC);
        out.extend_from_slice(&(self.k as u64).to_le_bytes());
        out.extend_from_slice(&(self.n as u64).to_le_bytes());
        out.extend_from_slice(self.data.as_slice());
        for e in &self.col_exp {
            out.extend_from_slice(&e.to_le_bytes());
        }
        let sum = blake3::hash(&out);
        out.extend_from_slice(sum.as_bytes());
        out
    }

    /// Reads [`PackedWeights::to_bytes`]'s output back, refusing anything it could not have
    /// written: a wrong checksum, lengths or header, scales outside `[128, 255]`, `-128`
    /// elements, shifts that disagree with the exponents, non-zero padding. The per-column and
    /// per-panel facts the kernels trust are recomputed, never read.
    pub fn from_bytes(bytes: &[u8]) -> Result<PackedWeights> {
        let bad = |why: String| KernelError::Stored(why);
        if bytes.len() < 24 + 32 || &bytes[..8] != STORED_MAGIC {
            return Err(bad("not a DCPACK01 file".into()));
        }
        let (body, sum) = bytes.split_at(bytes.len() - 32);
        if blake3::hash(body).as_bytes() != sum {
            return Err(bad("checksum mismatch".into()));
        }
        let word = |o: usize| u64::from_le_bytes(body[o..o + 8].try_into().unwrap_or([0; 8]));
        let (k, n) = (word(8), word(16));
        let too_big = || bad(format!("{k} × {n} does not fit this file"));
        let (k, n) = (
            usize::try_from(k).map_err(|_| too_big())?,
            usize::try_from(n).map_err(|_| too_big())?,
        );
        if k == 0 || n == 0 {
            return Err(bad(format!("empty shape {k} × {n}")));
        }
        let blocks = k.div_ceil(BLOCK);
        let panels = n.div_ceil(PANEL);
        let n_pad = panels * PANEL;
        let data_len = panels
            .checked_mul(blocks)
            .and_then(|x| x.checked_mul(RECORD))
            .ok_or_else(too_big)?;
        let exp_len = n_pad.checked_mul(blocks).ok_or_else(too_big)?;
        if body.len() != 24 + data_len + 2 * exp_len {
            return Err(too_big());
        }
        let data = &body[24..24 + data_len];
        let col_exp: Vec<i16> = body[24 + data_len..]
            .chunks_exact(2)
            .map(|c| i16::from_le_bytes([c[0], c[1]]))
            .collect();

        if let Some(j) = (n..n_pad).find(|j| {
            col_exp[j * blocks..(j + 1) * blocks]
                .iter()
                .any(|&e| e != BlockScale::ZERO_BLOCK.e)
        }) {
            return Err(bad(format!("padding column {j} has exponents")));
        }
        let (col_exp_min, col_fast) = column_facts(&col_exp, n, blocks);
        let mut panel_meta = Vec::with_capacity(panels);
        for p in 0..panels {
            let mut meta = PanelMeta {
                fast: (0..PANEL).all(|c| col_fast[p * PANEL + c]),
                bound: 0,
            };
            for b in 0..blocks {
                let rec = &data[(p * blocks + b) * RECORD..(p * blocks + b + 1) * RECORD];
                if rec[..RECORD_Q].contains(&0x80) {
                    return Err(bad(format!("panel {p}, block {b}: an element is -128")));
                }
                for c in 0..PANEL {
                    let j = p * PANEL + c;
                    let (m, shift) = (rec[RECORD_Q + c], rec[RECORD_Q + PANEL + shift_slot(c)]);
                    let (want_m_ok, want_shift) = if j < n {
                        let e = col_exp[j * blocks + b] as i32;
                        (m >= 128, (e - col_exp_min[j]).min(255) as u8)
                    } else {
                        let zero = (0..BLOCK / 4).all(|kg| rec[kg * 64 + c * 4..][..4] == [0; 4]);
                        (m == BlockScale::ZERO_BLOCK.m && zero, 0)
                    };
                    if !want_m_ok || shift != want_shift {
                        return Err(bad(format!("column {j}, block {b}: inconsistent scale")));
                    }
                    // The tail of the last block beyond k is zero padding.
                    if j < n && b == blocks - 1 && k % BLOCK != 0 {
                        let tail =
                            (k % BLOCK..BLOCK).any(|i| rec[(i / 4) * 64 + c * 4 + i % 4] != 0);
                        if tail {
                            return Err(bad(format!("column {j}: padding beyond k = {k}")));
                        }
                    }
                    if meta.fast && j < n {
                        meta.bound = meta.bound.max((127 * m as u64) << shift);
                    }
                }
            }
            panel_meta.push(meta);
        }
        Ok(PackedWeights {
            k,
            n,
            blocks,
            panels,
            data: AlignedBytes::from_slice(data),
            col_exp,
            col_exp_min: col_exp_min.into(),
            panel_meta,
        })
    }
}

/// Position of column `c`'s shift byte: even columns first, then odd ones, matching the lanes
/// `vpmuldq` reads (even i32 lanes) and the lanes left after a 32-bit shift (odd ones).
pub(crate) fn shift_slot(c: usize) -> usize {
    (c % 2) * (PANEL / 2) + c / 2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_pack_the_same_matrix() {
        let (k, n) = (70, 19);
        let w_kn: Vec<f32> = (0..k * n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.01)
            .collect();
        let mut w_nk = vec![0.0; k * n];
        for i in 0..k {
            for j in 0..n {
                w_nk[j * k + i] = w_kn[i * n + j];
            }
        }
        let a = PackedWeights::quantize(&w_kn, k, n, WeightLayout::KByN, "w").unwrap();
        let b = PackedWeights::quantize(&w_nk, k, n, WeightLayout::NByK, "w").unwrap();
        assert_eq!(a.data().to_vec(), b.data().to_vec());
        for j in 0..n {
            for blk in 0..a.blocks() {
                assert_eq!(a.scale(j, blk), b.scale(j, blk));
                let col = a.column_block(j, blk);
                for t in 0..BLOCK {
                    let kk = blk * BLOCK + t;
                    if kk >= k {
                        assert_eq!(col[t], 0, "padding");
                    }
                }
            }
        }
    }

    #[test]
    fn bad_shapes_and_values_are_errors() {
        assert!(PackedWeights::quantize(&[1.0; 5], 2, 3, WeightLayout::NByK, "w").is_err());
        let err = PackedWeights::quantize(&[1.0, f32::INFINITY], 2, 1, WeightLayout::NByK, "w")
            .unwrap_err();
        assert!(
            err.to_string().contains("inf in w at row 0, column 1"),
            "{err}"
        );
    }
}
