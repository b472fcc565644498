//! The fast attention kernel, with its per-key loops in AVX2 (where the CPU has it) and one
//! key at a time, against the reference, bit for bit: outputs (and errors), over random shapes
//! (head widths that are and are not whole blocks, grouped queries, sliding windows), hop
//! lengths, positions and value ranges (tiny, huge, scores past the f32 range, all-zero
//! heads: every exact-sum path); heads run on the calling thread and on a two-thread pool
//! alike.

use dc_model::attention::{attend_with, AttentionKernel, AttentionShape, LayerCache};
use proptest::prelude::*;

/// Deterministic values from `seed`: mostly about ±`scale`, some zeros, a few 2^±20 outliers.
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let x = ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale;
            match s % 23 {
                0 => 0.0,
                1 => x * 1048576.0,
                2 => x / 1048576.0,
                _ => x,
            }
        })
        .collect()
}

#[derive(Debug, Clone)]
struct Case {
    kv_heads: usize,
    group: usize,
    head_dim: usize,
    window: Option<usize>,
    cached: usize,
    rows: usize,
    scale: f32,
    zero_head: bool,
    seed: u64,
}

fn cases() -> impl Strategy<Value = Case> {
    (
        1usize..4,
        1usize..4,
        // 264: past the widest head the fast kernel takes (it hands those to the reference).
        prop::sample::select(vec![8usize, 32, 40, 64, 80, 128, 264]),
        prop::option::of(1usize..80),
        // Some contexts of up to ten blocks of keys.
        prop_oneof![0usize..100, 100usize..300],
        1usize..6,
        // 1e17: with the 2^20 outliers, scores past the f32 range (an error naming the key).
        prop::sample::select(vec![1e-3f32, 1.0, 30.0, 1e4, 1e17]),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(
            |(kv_heads, group, head_dim, window, cached, rows, scale, zero_head, seed)| Case {
                kv_heads,
                group,
                head_dim,
                window,
                cached,
                rows,
                scale,
                zero_head,
                seed,
            },
        )
}

impl Case {
    fn shape(&self) -> AttentionShape {
        AttentionShape {
            heads: self.kv_heads * self.group,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            window: self.window,
        }
    }
}

fn run(c: &Case, kernel: AttentionKernel) -> (Vec<u32>, String) {
    let shape = c.shape();
    let n = c.cached + c.rows;
    let kv = c.kv_heads * c.head_dim;
    let mut k = values(n * kv, c.seed, c.scale);
    let mut v = values(n * kv, c.seed ^ 1, c.scale);
    if c.zero_head {
        // A position whose first kv head is all zeros (zero scales, zero exponent).
        let p = c.seed as usize % n;
        k[p * kv..p * kv + c.head_dim].fill(0.0);
        v[p * kv..p * kv + c.head_dim].fill(0.0);
    }
    let mut cache = LayerCache::new(c.kv_heads, c.head_dim);
    cache.append(&k, &v).expect("append");
    let q = values(c.rows * shape.heads * c.head_dim, c.seed ^ 2, c.scale);
    let mut out = vec![0f32; q.len()];
    let summary = match attend_with(kernel, shape, &cache, &q, c.cached, &mut out, 3) {
        Ok(()) => "ok".to_string(),
        Err(e) => format!("error: {e}"),
    };
    (out.iter().map(|x| x.to_bits()).collect(), summary)
}

/// A two-thread pool: inside one the heads run in parallel, outside they run in order.
fn pool() -> &'static rayon::ThreadPool {
    static POOL: std::sync::OnceLock<rayon::ThreadPool> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("a two-thread pool")
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn the_fast_kernels_are_the_reference_bit_for_bit(c in cases()) {
        let (ref_out, reference) = run(&c, AttentionKernel::Reference);
        for kernel in [AttentionKernel::Fast, AttentionKernel::Scalar] {
            let (fast_out, fast) = run(&c, kernel);
            prop_assert_eq!(&fast, &reference, "{:?}", kernel);
            prop_assert_eq!(&fast_out, &ref_out, "{:?}", kernel);
            let (par_out, par) = pool().install(|| run(&c, kernel));
            prop_assert_eq!(&par, &fast, "{:?}", kernel);
            prop_assert_eq!(&par_out, &fast_out, "{:?}", kernel);
        }
    }
}

#[test]
fn every_kernel_refuses_a_non_finite_query_alike() {
    let c = Case {
        kv_heads: 1,
        group: 2,
        head_dim: 64,
        window: None,
        cached: 3,
        rows: 1,
        scale: 1.0,
        zero_head: false,
        seed: 7,
    };
    let shape = AttentionShape {
        heads: 2,
        kv_heads: 1,
        head_dim: 64,
        window: None,
    };
    let mut cache = LayerCache::new(1, 64);
    cache
        .append(&values(4 * 64, 1, 1.0), &values(4 * 64, 2, 1.0))
        .expect("append");
    let mut q = values(128, 3, 1.0);
    q[70] = f32::NAN;
    let errors: Vec<String> = [
        AttentionKernel::Fast,
        AttentionKernel::Scalar,
        AttentionKernel::Reference,
    ]
    .into_iter()
    .map(|kernel| {
        let mut out = vec![0f32; 128];
        attend_with(kernel, shape, &cache, &q, c.cached, &mut out, 3)
            .expect_err("a NaN query is refused")
            .to_string()
    })
    .collect();
    assert!(errors[0].contains("query value NaN"), "{}", errors[0]);
    assert_eq!(errors[0], errors[1]);
    assert_eq!(errors[0], errors[2]);
}
