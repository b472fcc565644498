//! Time of one decode row's exact attention at several context lengths, on one thread, for
//! the fast kernel, the same with its per-key loops one key at a time (what a CPU without AVX2
//! runs) and the reference, measured in the same run (the ratios are the figures; all give the
//! same bits). Shapes: SmolLM2-135M's (9 query heads, 3 key/value heads of 64), Llama-3.2-1B's
//! (32 query heads, 8 key/value heads of 64) and Llama-2-7B's (32 heads of 128).
//! `cargo bench -p dc-model --bench attention`.

use std::time::Instant;

use dc_model::attention::{attend_with, AttentionKernel, AttentionShape, LayerCache};

const SHAPES: [(&str, AttentionShape); 3] = [
    (
        "SmolLM2-135M",
        AttentionShape {
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
            window: None,
        },
    ),
    (
        "Llama-3.2-1B",
        AttentionShape {
            heads: 32,
            kv_heads: 8,
            head_dim: 64,
            window: None,
        },
    ),
    (
        "Llama-2-7B",
        AttentionShape {
            heads: 32,
            kv_heads: 32,
            head_dim: 128,
            window: None,
        },
    ),
];

/// Deterministic values in about ±2 with a few larger ones, like real keys.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let x = (s >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0;
            if i % 17 == 0 {
                x * 6.0
            } else {
                x
            }
        })
        .collect()
}

/// Timed calls per sample.
const ROUNDS: usize = 40;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("a one-thread pool");
    for (name, shape) in SHAPES {
        measure(&pool, name, shape);
    }
}

fn measure(pool: &rayon::ThreadPool, name: &str, shape: AttentionShape) {
    let kv = shape.kv_heads * shape.head_dim;
    let qw = shape.heads * shape.head_dim;
    for ctx in [64usize, 256, 1024] {
        let mut cache = LayerCache::new(shape.kv_heads, shape.head_dim);
        cache
            .append(&values(ctx * kv, 1), &values(ctx * kv, 2))
            .expect("append");
        let q = values(qw, 3);
        {
            let time = |kernel| {
                let mut out = vec![0f32; qw];
                let samples: Vec<f64> = (0..ROUNDS)
                    .map(|_| {
                        let s = Instant::now();
                        pool.install(|| {
                            attend_with(kernel, shape, &cache, &q, ctx - 1, &mut out, 0)
                        })
                        .expect("attention");
                        s.elapsed().as_secs_f64()
                    })
                    .collect();
                median(samples)
            };
            // Interleaved so the machine's drift hits each alike.
            let (mut fast, mut scalar, mut reference) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..5 {
                reference.push(time(AttentionKernel::Reference));
                scalar.push(time(AttentionKernel::Scalar));
                fast.push(time(AttentionKernel::Fast));
            }
            let (fast, scalar, reference) = (median(fast), median(scalar), median(reference));
            println!(
                "{name} context {ctx:5}: fast {:8.1} µs per row ({:5.1} ns per head and key), \
                 its per-key loops one key at a time {:8.1} µs ({:.2}×), reference {:8.1} µs \
                 ({:.2}×)",
                fast * 1e6,
                fast * 1e9 / (ctx * shape.heads) as f64,
                scalar * 1e6,
                scalar / fast,
                reference * 1e6,
                reference / fast
            );
        }
    }
}
