//! The scalar reference of one query head's exact attention: the definition the fast kernel in
//! the parent module is tested against bit for bit (and the fallback for heads wider than it
//! handles). Written for clarity, not speed.

use dc_kernels::elementwise::softmax;
use dc_kernels::quant::{quantize_block, round_half_even, BLOCK, QMAX};

use super::{context_outputs, pow2, scale_for_amax_f64, sum_terms, LayerCache};

/// One query head at absolute position `pos`, value by value as NUMERICS.md §2 states it.
#[allow(clippy::too_many_arguments)]
pub(super) fn head_attention(
    cache: &LayerCache,
    qh: &[f32],
    g: usize,
    pos: usize,
    window: Option<usize>,
    scale: f32,
    out: &mut [f32],
) -> Result<(), String> {
    let (hd, hb, kvh) = (cache.head_dim, cache.hb, cache.kv_heads);
    // Quantise the query head.
    let mut qq = vec![0i8; hb * BLOCK];
    let mut qs = Vec::with_capacity(hb);
    for b in 0..hb {
        let vals = &qh[b * BLOCK..((b + 1) * BLOCK).min(hd)];
        if let Some(x) = vals.iter().find(|x| !x.is_finite()) {
            return Err(format!("query value {x} at position {pos}"));
        }
        let dst: &mut [i8; BLOCK] = (&mut qq[b * BLOCK..(b + 1) * BLOCK])
            .try_into()
            .expect("block slice is BLOCK long");
        qs.push(quantize_block(vals, dst));
    }
    let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
    let n = pos + 1 - lo;
    // Scores, exact per key, then the f32 scale.
    let mut scores = vec![0f32; n];
    let mut terms = Vec::with_capacity(hb);
    for (s, j) in scores.iter_mut().zip(lo..=pos) {
        terms.clear();
        let base = (j * kvh + g) * hb;
        for b in 0..hb {
            let d: i32 = (b * BLOCK..(b + 1) * BLOCK)
                .map(|d| qq[d] as i32 * cache.key(j, g, d) as i32)
                .sum();
            let (sq, sk) = (qs[b], cache.k_s[base + b]);
            terms.push((
                d as i64 * sq.m as i64 * sk.m as i64,
                sq.e as i32 + sk.e as i32,
            ));
        }
        let dot = sum_terms(&terms)
            .ok_or_else(|| format!("score of key {j} overflows f32 at position {pos}"))?;
        *s = dot * scale;
    }
    softmax(&mut scores);
    // P' = P · 2^e_v, exact in f64, quantised in blocks of absolute key positions.
    let first_block = lo / BLOCK;
    let last_block = pos / BLOCK;
    let mut acc = vec![0i32; hd];
    // The block terms of every output in one allocation, output-major: `blocks` places per
    // output, of which the first `used` are filled (a block of all-zero P' adds no term to any
    // output), in block order.
    let blocks = last_block + 1 - first_block;
    let mut ctx_terms = vec![(0i64, 0i32); hd * blocks];
    let mut used = 0;
    let mut pv: Vec<f64> = Vec::with_capacity(BLOCK);
    for b in first_block..=last_block {
        let (j0, j1) = ((b * BLOCK).max(lo), ((b + 1) * BLOCK - 1).min(pos));
        pv.clear();
        pv.extend(
            (j0..=j1).map(|j| scores[j - lo] as f64 * pow2(cache.value_exponent(j, g) as i32)),
        );
        let amax = pv.iter().fold(0f64, |m, &x| m.max(x));
        if amax == 0.0 {
            continue;
        }
        let s = scale_for_amax_f64(amax);
        let inv = pow2(-(s.e as i32));
        let m = s.m as f64;
        acc.fill(0);
        for (j, &p) in (j0..=j1).zip(&pv) {
            // (p · 2^-e) is exact; the quotient by m is correctly rounded and, p having at most
            // 24 significant bits, cannot create or destroy a tie.
            let qp = round_half_even((p * inv) / m).min(QMAX as f64) as i32;
            if qp == 0 {
                continue;
            }
            for (d, a) in acc.iter_mut().enumerate() {
                *a += qp * cache.value(j, g, d) as i32;
            }
        }
        for (t, &a) in ctx_terms.chunks_exact_mut(blocks).zip(&acc) {
            t[used] = (a as i64 * s.m as i64, s.e as i32);
        }
        used += 1;
    }
    context_outputs(out, &ctx_terms, blocks, used, pos)
}
