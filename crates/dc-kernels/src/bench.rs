//! Machine measurements for `dcd bench gemm`: the int8 peak of a register-resident
//! microkernel, the memory read bandwidth, and timings of the exact product.
//!
//! Peak and bandwidth are measured in the same run as the product, because the machines we run
//! on are shared: only ratios measured together mean anything.

use std::hint::black_box;
use std::time::{Duration, Instant};

use crate::buffer::AlignedBytes;
use crate::gemm::{Gemm, Kernel};
use crate::pack::{PackedWeights, WeightLayout};
use crate::quant::QuantizedRows;
use crate::rng::SplitMix64;

/// Runs `f(thread_index)` on `threads` threads at once and returns each one's result.
fn on_threads<T: Send>(threads: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn({
                    let f = &f;
                    move || f(t)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("benchmark thread"))
            .collect()
    })
}

/// The multiply-accumulates one iteration of a peak loop performs, and the loop itself.
#[cfg(target_arch = "x86_64")]
mod micro {
    use std::arch::asm;

    /// MACs per iteration of [`avx2_loop`]: 8 chains × 32 byte products.
    pub const AVX2_MACS: u64 = 8 * 32;
    /// MACs per iteration of [`avx512_loop`]: 12 chains × 64 byte products.
    pub const AVX512_MACS: u64 = 12 * 64;

    /// `vpmaddubsw` → `vpmaddwd` → `vpaddd` on 8 independent chains: the exact int8 dot product
    /// sequence of AVX2, operands in registers.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn avx2_loop(iters: u64) {
        // SAFETY: register-only instructions, AVX2 present per the caller.
        unsafe {
            asm!(
                "vpxor ymm12, ymm12, ymm12",
                "vpxor ymm13, ymm13, ymm13",
                "vpxor ymm14, ymm14, ymm14",
                "vpxor ymm15, ymm15, ymm15",
                "2:",
                "vpmaddubsw ymm0, ymm12, ymm13",
                "vpmaddubsw ymm1, ymm12, ymm14",
                "vpmaddubsw ymm2, ymm13, ymm14",
                "vpmaddubsw ymm3, ymm13, ymm12",
                "vpmaddubsw ymm4, ymm14, ymm12",
                "vpmaddubsw ymm5, ymm14, ymm13",
                "vpmaddubsw ymm6, ymm12, ymm12",
                "vpmaddubsw ymm7, ymm13, ymm13",
                "vpmaddwd ymm0, ymm0, ymm15",
                "vpmaddwd ymm1, ymm1, ymm15",
                "vpmaddwd ymm2, ymm2, ymm15",
                "vpmaddwd ymm3, ymm3, ymm15",
                "vpmaddwd ymm4, ymm4, ymm15",
                "vpmaddwd ymm5, ymm5, ymm15",
                "vpmaddwd ymm6, ymm6, ymm15",
                "vpmaddwd ymm7, ymm7, ymm15",
                "vpaddd ymm8, ymm8, ymm0",
                "vpaddd ymm9, ymm9, ymm1",
                "vpaddd ymm10, ymm10, ymm2",
                "vpaddd ymm11, ymm11, ymm3",
                "vpaddd ymm8, ymm8, ymm4",
                "vpaddd ymm9, ymm9, ymm5",
                "vpaddd ymm10, ymm10, ymm6",
                "vpaddd ymm11, ymm11, ymm7",
                "dec {n}",
                "jnz 2b",
                n = inout(reg) iters => _,
                out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
                out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
                out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
                out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
                options(nomem, nostack),
            );
        }
    }

    /// MACs per iteration of [`avx2_signed_loop`]: 8 chains × 32 byte products.
    pub const AVX2_SIGNED_MACS: u64 = 8 * 32;

    /// `vpsignb` → `vpmaddubsw` → `vpmaddwd` → `vpaddd` on 8 independent chains: the sequence
    /// an exact product of two *signed* int8 operands needs on AVX2 (`vpmaddubsw` multiplies
    /// unsigned by signed bytes, so one operand's signs move to the other first). One
    /// instruction more per 32 MACs than [`avx2_loop`], and `vpsignb` competes for the same
    /// execution ports, so this is the realistic register-resident ceiling of the kernel.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn avx2_signed_loop(iters: u64) {
        // SAFETY: register-only instructions, AVX2 present per the caller.
        unsafe {
            asm!(
                "vpxor ymm12, ymm12, ymm12",
                "vpxor ymm13, ymm13, ymm13",
                "vpxor ymm14, ymm14, ymm14",
                "vpxor ymm15, ymm15, ymm15",
                "2:",
                "vpsignb ymm0, ymm14, ymm12",
                "vpsignb ymm1, ymm14, ymm13",
                "vpsignb ymm2, ymm15, ymm12",
                "vpsignb ymm3, ymm15, ymm13",
                "vpmaddubsw ymm0, ymm13, ymm0",
                "vpmaddubsw ymm1, ymm12, ymm1",
                "vpmaddubsw ymm2, ymm13, ymm2",
                "vpmaddubsw ymm3, ymm12, ymm3",
                "vpmaddwd ymm0, ymm0, ymm15",
                "vpmaddwd ymm1, ymm1, ymm15",
                "vpmaddwd ymm2, ymm2, ymm15",
                "vpmaddwd ymm3, ymm3, ymm15",
                "vpaddd ymm8, ymm8, ymm0",
                "vpaddd ymm9, ymm9, ymm1",
                "vpaddd ymm10, ymm10, ymm2",
                "vpaddd ymm11, ymm11, ymm3",
                "vpsignb ymm4, ymm14, ymm12",
                "vpsignb ymm5, ymm14, ymm13",
                "vpsignb ymm6, ymm15, ymm12",
                "vpsignb ymm7, ymm15, ymm13",
                "vpmaddubsw ymm4, ymm13, ymm4",
                "vpmaddubsw ymm5, ymm12, ymm5",
                "vpmaddubsw ymm6, ymm13, ymm6",
                "vpmaddubsw ymm7, ymm12, ymm7",
                "vpmaddwd ymm4, ymm4, ymm15",
                "vpmaddwd ymm5, ymm5, ymm15",
                "vpmaddwd ymm6, ymm6, ymm15",
                "vpmaddwd ymm7, ymm7, ymm15",
                "vpaddd ymm8, ymm8, ymm4",
                "vpaddd ymm9, ymm9, ymm5",
                "vpaddd ymm10, ymm10, ymm6",
                "vpaddd ymm11, ymm11, ymm7",
                "dec {n}",
                "jnz 2b",
                n = inout(reg) iters => _,
                out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
                out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
                out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
                out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
                options(nomem, nostack),
            );
        }
    }

    /// `vpdpbusd` on 12 independent accumulators (enough to cover its latency).
    ///
    /// # Safety
    /// The CPU must support AVX-512 F and VNNI.
    #[target_feature(enable = "avx512f,avx512vnni")]
    pub unsafe fn avx512_loop(iters: u64) {
        // SAFETY: register-only instructions, features present per the caller.
        unsafe {
            asm!(
                "vpxord zmm14, zmm14, zmm14",
                "vpxord zmm15, zmm15, zmm15",
                "2:",
                "vpdpbusd zmm0, zmm14, zmm15",
                "vpdpbusd zmm1, zmm14, zmm15",
                "vpdpbusd zmm2, zmm14, zmm15",
                "vpdpbusd zmm3, zmm14, zmm15",
                "vpdpbusd zmm4, zmm14, zmm15",
                "vpdpbusd zmm5, zmm14, zmm15",
                "vpdpbusd zmm6, zmm14, zmm15",
                "vpdpbusd zmm7, zmm14, zmm15",
                "vpdpbusd zmm8, zmm14, zmm15",
                "vpdpbusd zmm9, zmm14, zmm15",
                "vpdpbusd zmm10, zmm14, zmm15",
                "vpdpbusd zmm11, zmm14, zmm15",
                "dec {n}",
                "jnz 2b",
                n = inout(reg) iters => _,
                out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
                out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
                out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                out("zmm14") _, out("zmm15") _,
                options(nomem, nostack),
            );
        }
    }
}

/// The int8 multiply-accumulate peak of this machine in GOPS (2 operations per MAC), with
/// `threads` threads each running the best register-resident loop the CPU has (VNNI if present,
/// else AVX2). `None` when the CPU has neither.
pub fn int8_peak_gops(threads: usize, time: Duration) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        let (run, macs): (unsafe fn(u64), u64) = if Kernel::Avx512.is_supported() {
            (micro::avx512_loop, micro::AVX512_MACS)
        } else if Kernel::Avx2.is_supported() {
            (micro::avx2_loop, micro::AVX2_MACS)
        } else {
            return None;
        };
        let per_thread = on_threads(threads, |_| {
            let iters = 1 << 20;
            // SAFETY: the feature was detected above.
            unsafe { run(iters / 8) }; // warm the core up to speed
            let mut best = 0f64;
            let start = Instant::now();
            while start.elapsed() < time {
                let t = Instant::now();
                // SAFETY: as above.
                unsafe { run(iters) };
                best = best.max((iters * macs) as f64 / t.elapsed().as_secs_f64());
            }
            best
        });
        Some(per_thread.iter().sum::<f64>() * 2.0 / 1e9)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (threads, time);
        None
    }
}

/// The register-resident peak of the exact *signed* int8 sequence of AVX2 (`vpsignb`,
/// `vpmaddubsw`, `vpmaddwd`, `vpaddd`) in GOPS, with `threads` threads: what an exact kernel
/// with both operands signed can reach before any load, store or block epilogue. Reported next
/// to [`int8_peak_gops`] (which stays the unsigned-by-signed peak). `None` without AVX2.
pub fn int8_signed_peak_gops(threads: usize, time: Duration) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        if !Kernel::Avx2.is_supported() {
            return None;
        }
        let per_thread = on_threads(threads, |_| {
            let iters = 1 << 20;
            // SAFETY: AVX2 detected above.
            unsafe { micro::avx2_signed_loop(iters / 8) };
            let mut best = 0f64;
            let start = Instant::now();
            while start.elapsed() < time {
                let t = Instant::now();
                // SAFETY: as above.
                unsafe { micro::avx2_signed_loop(iters) };
                best =
                    best.max((iters * micro::AVX2_SIGNED_MACS) as f64 / t.elapsed().as_secs_f64());
            }
            best
        });
        Some(per_thread.iter().sum::<f64>() * 2.0 / 1e9)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (threads, time);
        None
    }
}

/// The AVX2 kernel's 4-row tile alone (its block loop with the exact i64 epilogue) on
/// L1-resident data, in GOPS with `threads` threads: the ceiling of the exact product on this
/// machine, since everything else a product does (streaming, rounding, scheduling) only adds
/// to it. `None` without AVX2.
pub fn exact_tile_gops(threads: usize, time: Duration) -> Option<f64> {
    let per_thread = on_threads(threads, |_| crate::gemm::avx2_tile_macs_per_second(time));
    per_thread
        .into_iter()
        .sum::<Option<f64>>()
        .map(|macs| macs * 2.0 / 1e9)
}

/// Sustained read bandwidth in GB/s with `threads` threads streaming disjoint parts of a
/// `bytes`-long, huge-page backed buffer (far larger than the last-level cache).
pub fn read_bandwidth_gbs(threads: usize, bytes: usize, time: Duration) -> f64 {
    let mut buf = AlignedBytes::zeroed(bytes);
    // Touch every page so the timing does not include page faults.
    for (i, b) in buf.as_mut_slice().iter_mut().enumerate().step_by(4096) {
        *b = i as u8;
    }
    let part = bytes / threads / 64 * 64;
    let data = buf.as_slice();
    let rates = on_threads(threads, |t| {
        let slice = &data[t * part..(t + 1) * part];
        let mut best = 0f64;
        let start = Instant::now();
        while start.elapsed() < time {
            let s = Instant::now();
            black_box(sum_words(slice));
            best = best.max(slice.len() as f64 / s.elapsed().as_secs_f64());
        }
        best
    });
    rates.iter().sum::<f64>() / 1e9
}

/// Reads every byte, with the widest loads the CPU has.
fn sum_words(s: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if Kernel::Avx2.is_supported() {
        // SAFETY: AVX2 detected.
        return unsafe { sum_words_avx2(s) };
    }
    let mut acc = [0u64; 4];
    for c in s.chunks_exact(32) {
        for (i, w) in c.chunks_exact(8).enumerate() {
            acc[i] = acc[i].wrapping_add(u64::from_le_bytes(w.try_into().expect("8 bytes")));
        }
    }
    acc.iter().fold(0, |a, b| a ^ b)
}

/// Four independent 256-bit OR chains per 128 bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_words_avx2(s: &[u8]) -> u64 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_si256(); 4];
    for c in s.chunks_exact(128) {
        for (i, a) in acc.iter_mut().enumerate() {
            // SAFETY: c is 128 bytes long; each load reads 32 of them.
            let v = unsafe { _mm256_loadu_si256(c.as_ptr().add(32 * i) as _) };
            *a = _mm256_or_si256(*a, v);
        }
    }
    let v = _mm256_or_si256(
        _mm256_or_si256(acc[0], acc[1]),
        _mm256_or_si256(acc[2], acc[3]),
    );
    let mut out = [0u64; 4];
    // SAFETY: out is 32 bytes.
    unsafe { _mm256_storeu_si256(out.as_mut_ptr() as _, v) };
    out.iter().fold(0, |a, b| a | b)
}

/// One timed product shape.
#[derive(Clone, Debug)]
pub struct GemmTiming {
    /// Kernel.
    pub kernel: Kernel,
    /// Threads.
    pub threads: usize,
    /// Rows of X.
    pub m: usize,
    /// Reduction length.
    pub k: usize,
    /// Columns of W.
    pub n: usize,
    /// Median seconds per product (activations already quantised).
    pub seconds: f64,
    /// Median seconds to quantise the activations (not included in `seconds`).
    pub quantise_seconds: f64,
    /// Bytes of packed weights one product streams.
    pub weight_bytes: usize,
}

impl GemmTiming {
    /// Integer operations per second, in G (2 per multiply-accumulate).
    pub fn gops(&self) -> f64 {
        2.0 * (self.m * self.k * self.n) as f64 / self.seconds / 1e9
    }
    /// Weight bytes streamed per second, in GB.
    pub fn weight_gbs(&self) -> f64 {
        self.weight_bytes as f64 / self.seconds / 1e9
    }
}

/// Deterministic activations (`m × k`, unquantised) and packed weights (`k × n`) for a timed
/// product of that shape.
fn operands(m: usize, k: usize, n: usize) -> crate::Result<(Vec<f32>, PackedWeights)> {
    let mut rng = SplitMix64::new((m * 31 + k * 7 + n) as u64);
    let x: Vec<f32> = (0..m * k).map(|_| rng.normal()).collect();
    let w: Vec<f32> = (0..k * n).map(|_| rng.normal() * 0.05).collect();
    let packed = PackedWeights::quantize(&w, k, n, WeightLayout::NByK, "bench")?;
    Ok((x, packed))
}

/// Times `x · w` for an `m × k × n` product: the median of repeated runs over at least `time`.
/// Weights rotate through enough copies to exceed `cold_bytes`, so decode shapes are timed
/// from memory, not from a warm cache.
pub fn time_gemm(
    gemm: &Gemm,
    m: usize,
    k: usize,
    n: usize,
    cold_bytes: usize,
    time: Duration,
) -> crate::Result<GemmTiming> {
    let (x, packed) = operands(m, k, n)?;
    let copies = cold_bytes.div_ceil(packed.packed_bytes()).max(1);
    let ws: Vec<PackedWeights> = (0..copies).map(|_| packed.clone()).collect();
    let mut qtimes = Vec::new();
    let mut qx = QuantizedRows::quantize(&x, m, k, "bench")?;
    let mut out = vec![0f32; m * n];
    gemm.matmul(&qx, &ws[0], &mut out)?; // warm up
    let mut times = Vec::new();
    let start = Instant::now();
    let mut i = 0;
    while start.elapsed() < time || times.len() < 3 {
        let t = Instant::now();
        qx = QuantizedRows::quantize(&x, m, k, "bench")?;
        qtimes.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        gemm.matmul(&qx, &ws[i % copies], &mut out)?;
        times.push(t.elapsed().as_secs_f64());
        i += 1;
    }
    black_box(&out);
    Ok(GemmTiming {
        kernel: gemm.kernel(),
        threads: gemm.threads(),
        m,
        k,
        n,
        seconds: median(&mut times),
        quantise_seconds: median(&mut qtimes),
        weight_bytes: packed.packed_bytes(),
    })
}

/// What committing costs one product shape: the plain product, the product keeping its exact
/// accumulators, and that plus the commitment a stage signs (row encodings, blake3 leaves,
/// Merkle root), each the median seconds of runs taking turns.
#[derive(Clone, Debug)]
pub struct CommitTiming {
    /// Plain product (f32 out only).
    pub plain: f64,
    /// The product also handing back its exact accumulators.
    pub exact: f64,
    /// The plain product and its commitment (hashing its f32 output rows).
    pub committed: f64,
}

impl CommitTiming {
    /// Extra time of keeping exact accumulators, as a fraction of the plain product.
    pub fn exact_share(&self) -> f64 {
        self.exact / self.plain - 1.0
    }
    /// Extra time of hashing the output rows into a commitment, as a fraction of the plain
    /// product.
    pub fn hash_share(&self) -> f64 {
        (self.committed - self.plain) / self.plain
    }
}

/// Times a product of `m × k × n` three ways, taking turns so the machine's drift hits each
/// alike (see [`CommitTiming`]); weights warm (a prefill's cost is what commitments add to).
pub fn time_commitment(
    gemm: &Gemm,
    m: usize,
    k: usize,
    n: usize,
    time: Duration,
) -> crate::Result<CommitTiming> {
    let (x, packed) = operands(m, k, n)?;
    let qx = QuantizedRows::quantize(&x, m, k, "bench")?;
    let mut out = vec![0f32; m * n];
    gemm.matmul(&qx, &packed, &mut out)?; // warm up
    let (mut plain, mut exact, mut committed) = (Vec::new(), Vec::new(), Vec::new());
    let start = Instant::now();
    while start.elapsed() < time || plain.len() < 3 {
        let t = Instant::now();
        gemm.matmul(&qx, &packed, &mut out)?;
        plain.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        black_box(gemm.matmul_exact(&qx, &packed, &mut out)?);
        exact.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        gemm.matmul(&qx, &packed, &mut out)?;
        black_box(gemm.commit_from(&out, (m, n), 0, 0));
        committed.push(t.elapsed().as_secs_f64());
    }
    black_box(&out);
    Ok(CommitTiming {
        plain: median(&mut plain),
        exact: median(&mut exact),
        committed: median(&mut committed),
    })
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
