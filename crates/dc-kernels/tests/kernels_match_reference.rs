//! Every kernel equals the scalar reference bit for bit, at every thread count, whatever the
//! shape, magnitudes, exponent spans, zero blocks or ties (NUMERICS.md §6.1, §6.2).

use dc_kernels::conformance::{matrix, Style};
use dc_kernels::rng::SplitMix64;
use dc_kernels::verify::commit::commit_gemm;
use dc_kernels::{
    Accumulators, BlockScale, Exact, Gemm, Kernel, PackedWeights, QuantizedRows, WeightLayout,
};
use proptest::prelude::*;

fn style() -> impl Strategy<Value = Style> {
    prop_oneof![
        Just(Style::Normal),
        (0i32..=250).prop_map(Style::Span),
        Just(Style::ZeroBlocks),
        Just(Style::Ties),
        Just(Style::Tiny),
        Just(Style::Huge),
    ]
}

fn run(
    g: &Gemm,
    x: &QuantizedRows,
    w: &PackedWeights,
) -> (
    Vec<u32>,
    Result<dc_kernels::Accumulators, dc_kernels::KernelError>,
) {
    let mut y = vec![0f32; x.rows() * w.n()];
    let acc = g.matmul_exact(x, w, &mut y);
    // Without exact accumulators the kernels may round in their own (vector) code: the
    // outputs and the error must still be the same.
    let mut plain = vec![0f32; x.rows() * w.n()];
    let res = g.matmul(x, w, &mut plain);
    match (&acc, &res) {
        (Ok(_), Ok(())) => assert_eq!(
            y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            plain.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{} × {}: matmul differs from matmul_exact",
            g.kernel(),
            g.threads()
        ),
        (Err(a), Err(b)) => assert_eq!(a, b, "{}: errors differ", g.kernel()),
        (a, b) => panic!("{}: matmul_exact {a:?} but matmul {b:?}", g.kernel()),
    }
    (y.iter().map(|v| v.to_bits()).collect(), acc)
}

#[test]
fn an_engine_reusing_its_sums_buffers_changes_no_bits() {
    // An engine hands a dropped product's sums buffer, old sums and all, to its next product
    // of the same size: every product must still equal a fresh reference engine's.
    let mut rng = SplitMix64::new(5);
    let styles = [
        Style::Normal,
        Style::Span(60),
        Style::ZeroBlocks,
        Style::Huge,
    ];
    for kernel in Kernel::supported() {
        for threads in [1, 2] {
            let g = Gemm::new(kernel, threads).unwrap();
            for round in 0..24 {
                let (m, k, n) = [(1, 96, 40), (3, 64, 33)][round % 2];
                let x = matrix(&mut rng, m, k, styles[round % 4]);
                let w = matrix(&mut rng, n, k, styles[(round / 4) % 4]);
                let qx = QuantizedRows::quantize(&x, m, k, "x").expect("finite");
                let qw =
                    PackedWeights::quantize(&w, k, n, WeightLayout::NByK, "w").expect("finite");
                let (want, want_acc) = run(&Gemm::new(Kernel::Scalar, 1).unwrap(), &qx, &qw);
                let (got, got_acc) = run(&g, &qx, &qw);
                assert_eq!(want, got, "{kernel} × {threads}, round {round}");
                match (want_acc, got_acc) {
                    (Ok(a), Ok(b)) => {
                        assert_eq!(a, b, "{kernel} × {threads}, round {round}");
                        assert_eq!(commit_gemm(&a), commit_gemm(&b));
                    }
                    (Err(a), Err(b)) => assert_eq!(a, b),
                    (a, b) => panic!("{kernel}: {b:?} vs reference {a:?}"),
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn every_kernel_and_thread_count_equals_the_reference(
        m in prop_oneof![Just(1usize), 1usize..12],
        k in 1usize..320,
        n in 1usize..70,
        sx in style(),
        sw in style(),
        seed in any::<u64>(),
    ) {
        let mut rng = SplitMix64::new(seed);
        let x = matrix(&mut rng, m, k, sx);
        let w = matrix(&mut rng, n, k, sw);
        let qx = QuantizedRows::quantize(&x, m, k, "x").expect("finite");
        let qw = PackedWeights::quantize(&w, k, n, WeightLayout::NByK, "w").expect("finite");
        let reference = Gemm::new(Kernel::Scalar, 1).unwrap();
        let (want, want_acc) = run(&reference, &qx, &qw);
        for kernel in Kernel::supported() {
            for threads in [1, 2, 3] {
                let g = Gemm::new(kernel, threads).unwrap();
                let (got, got_acc) = run(&g, &qx, &qw);
                match (&want_acc, &got_acc) {
                    (Ok(a), Ok(b)) => {
                        prop_assert_eq!(&want, &got, "{} × {} threads", kernel, threads);
                        prop_assert_eq!(a, b);
                        prop_assert_eq!(commit_gemm(a), commit_gemm(b));
                    }
                    (Err(a), Err(b)) => prop_assert_eq!(a, b),
                    (a, b) => prop_assert!(false, "{kernel}: {b:?} vs reference {a:?}"),
                }
            }
        }
    }

    /// Elements at the extremes (±127, 0): the block sums reach `±32 · 127²`, and a kernel
    /// that offsets one operand to unsigned bytes carries its largest correction.
    #[test]
    fn blocks_of_extreme_elements_equal_the_reference(
        m in 1usize..12,
        k in 1usize..200,
        n in 1usize..40,
        seed in any::<u64>(),
    ) {
        let mut rng = SplitMix64::new(seed);
        let blocks = k.div_ceil(32);
        // Per row, some blocks of one value throughout and some mixed: both reach the bounds.
        let mut extreme = |rows: usize| -> Vec<i8> {
            let mut q = Vec::with_capacity(rows * blocks * 32);
            for _ in 0..rows {
                for _ in 0..blocks {
                    let whole = rng.next_u64();
                    for _ in 0..32 {
                        let draw = if whole.is_multiple_of(3) { whole >> 8 } else { rng.next_u64() };
                        q.push([127i8, -127, 0, 127, -127][(draw % 5) as usize]);
                    }
                }
                // Zero padding past k, as quantisation leaves it.
                let row = q.len() - blocks * 32;
                q[row + k..].fill(0);
            }
            q
        };
        let xq = extreme(m);
        let wq = extreme(n);
        let scale = |r: u64| BlockScale { m: 128 + (r % 128) as u8, e: (r % 9) as i16 - 4 };
        let xs: Vec<BlockScale> = (0..m * blocks).map(|_| scale(rng.next_u64())).collect();
        let ws: Vec<BlockScale> = (0..n * blocks).map(|_| scale(rng.next_u64())).collect();
        let qx = QuantizedRows::from_parts(m, k, xq, xs);
        let qw = PackedWeights::from_columns(k, n, &wq, &ws);
        let (want, want_acc) = run(&Gemm::new(Kernel::Scalar, 1).unwrap(), &qx, &qw);
        let want_acc = want_acc.expect("small exponents never overflow");
        for kernel in Kernel::supported() {
            for threads in [1, 2] {
                let (got, got_acc) = run(&Gemm::new(kernel, threads).unwrap(), &qx, &qw);
                prop_assert_eq!(&want, &got, "{} × {} threads", kernel, threads);
                prop_assert_eq!(&want_acc, &got_acc.expect("as the reference"));
            }
        }
    }

    #[test]
    fn a_row_does_not_depend_on_the_rest_of_the_batch(
        m in 2usize..14,
        k in 1usize..200,
        n in 1usize..40,
        sx in style(),
        seed in any::<u64>(),
    ) {
        let mut rng = SplitMix64::new(seed);
        let x = matrix(&mut rng, m, k, sx);
        let w = matrix(&mut rng, n, k, Style::Normal);
        let qw = PackedWeights::quantize(&w, k, n, WeightLayout::NByK, "w").unwrap();
        let qx = QuantizedRows::quantize(&x, m, k, "x").unwrap();
        for kernel in Kernel::supported() {
            let g = Gemm::new(kernel, 2).unwrap();
            let (all, all_acc) = run(&g, &qx, &qw);
            if all_acc.is_err() {
                continue;
            }
            for r in 0..m {
                let one = QuantizedRows::quantize(&x[r * k..(r + 1) * k], 1, k, "x").unwrap();
                let (alone, _) = run(&g, &one, &qw);
                prop_assert_eq!(&all[r * n..(r + 1) * n], &alone[..], "{} row {}", kernel, r);
            }
        }
    }
}

/// Rows whose blocks alternate between exponents 0 and `span`, with values of one sign per
/// row in [0.5, 1) · 2^e: the products add up instead of cancelling, so the exact sums come
/// close to the fast path's bound.
fn aligned(rng: &mut SplitMix64, rows: usize, k: usize, span: i32) -> Vec<f32> {
    let mut v = Vec::with_capacity(rows * k);
    for r in 0..rows {
        let sign = if r % 3 == 2 { -1.0 } else { 1.0 };
        for i in 0..k {
            let e = if (i / 32) % 2 == 1 { span } else { 0 };
            v.push(sign * (0.5 + 0.5 * rng.unit() as f32) * 2f32.powi(e));
        }
    }
    v
}

/// Whether `(row, panel)` takes the i64 fast path, and the bound on its sums.
/// An `m×k` by `k×n` product of [`aligned`] rows of `span` drawn from `seed`: the quantised
/// operands and the reference's exact accumulators.
fn aligned_product(
    seed: u64,
    (m, k, n): (usize, usize, usize),
    span: i32,
) -> (QuantizedRows, PackedWeights, Accumulators) {
    let mut rng = SplitMix64::new(seed);
    let x = aligned(&mut rng, m, k, span);
    let w = aligned(&mut rng, n, k, span);
    let qx = QuantizedRows::quantize(&x, m, k, "x").expect("finite x");
    let qw = PackedWeights::quantize(&w, k, n, WeightLayout::NByK, "w").expect("finite w");
    let mut y = vec![0f32; m * n];
    let acc = Gemm::new(Kernel::Scalar, 1)
        .and_then(|g| g.matmul_exact(&qx, &qw, &mut y))
        .expect("the reference product");
    (qx, qw, acc)
}

fn fast_bound(qx: &QuantizedRows, r: usize, qw: &PackedWeights, p: usize) -> Option<u128> {
    let (rm, pm) = (qx.meta(r), qw.panel_meta(p));
    let bound = (rm.bound as u128) * (pm.bound as u128);
    (rm.fast && pm.fast && bound < 1 << 63).then_some(bound)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Exponent spans just inside the i64 fast path: exact sums far above 2^51 (where the
    /// vector rounding hands over to the scalar one) up to the 2^63 bound.
    #[test]
    fn wide_fast_path_sums_equal_the_reference(
        m in 1usize..10,
        k in 32usize..300,
        n in 1usize..50,
        span_x in 0i32..=16,
        span_w in 0i32..=16,
        seed in any::<u64>(),
    ) {
        let mut rng = SplitMix64::new(seed);
        let x = aligned(&mut rng, m, k, span_x);
        let w = aligned(&mut rng, n, k, span_w);
        let qx = QuantizedRows::quantize(&x, m, k, "x").expect("finite");
        let qw = PackedWeights::quantize(&w, k, n, WeightLayout::NByK, "w").expect("finite");
        let (want, want_acc) = run(&Gemm::new(Kernel::Scalar, 1).unwrap(), &qx, &qw);
        for kernel in Kernel::supported() {
            for threads in [1, 2] {
                let (got, got_acc) = run(&Gemm::new(kernel, threads).unwrap(), &qx, &qw);
                prop_assert_eq!(&want, &got, "{} × {}", kernel, threads);
                prop_assert_eq!(want_acc.as_ref().ok(), got_acc.as_ref().ok());
            }
        }
    }
}

/// The bits of the fast path's integer at `(r, c)` (the value in units of
/// `2^(e_min,row + e_min,col)`), and whether it is negative.
fn sum_bits(
    acc: &Accumulators,
    qx: &QuantizedRows,
    qw: &PackedWeights,
    r: usize,
    c: usize,
) -> (u32, bool) {
    let unit = qx.meta(r).exp_min + qw.col_exp_min(c);
    let Exact::Small { mant, exp } = acc.get(r, c) else {
        panic!("a fast-path sum is below 2^63");
    };
    (
        64 - mant.unsigned_abs().leading_zeros() + (exp - unit) as u32,
        mant < 0,
    )
}

#[test]
fn wide_fast_path_sums_occur_in_the_test_above() {
    // The generator above does produce fast-path pairs whose exact sums exceed 2^51 (the
    // limit of the vector rounding) and come within a factor 4 of the 2^63 bound.
    let (m, k, n) = (8, 256, 32);
    let (qx, qw, acc) = aligned_product(3, (m, k, n), 12);
    let mut largest = 0u32;
    for r in 0..m {
        for c in 0..n {
            if fast_bound(&qx, r, &qw, c / 16).is_none() {
                continue;
            }
            largest = largest.max(sum_bits(&acc, &qx, &qw, r, c).0);
        }
    }
    assert!(
        (52..=63).contains(&largest),
        "largest fast-path sum has {largest} bits"
    );
    let (want, _) = run(&Gemm::new(Kernel::Scalar, 1).unwrap(), &qx, &qw);
    for kernel in Kernel::supported() {
        let (got, _) = run(&Gemm::new(kernel, 1).unwrap(), &qx, &qw);
        assert_eq!(want, got, "{kernel}");
    }
}

#[test]
fn narrow_tiles_near_2_51_and_wider_ones_occur_in_the_test_above() {
    // The IFMA kernel keeps the sums of tiles bounded below 2^51 modulo 2^52 and takes the
    // i64 path for the others: the generator above gives both, the narrow ones with sums of
    // 49 bits and more, of both signs.
    let (m, k, n) = (8, 256, 32);
    let (mut narrow_bits, mut narrow_negative, mut wider) = (0u32, false, false);
    for span in 0..=16 {
        let (qx, qw, acc) = aligned_product(span as u64, (m, k, n), span);
        for r in 0..m {
            for c in 0..n {
                let Some(bound) = fast_bound(&qx, r, &qw, c / 16) else {
                    continue;
                };
                if bound >= 1 << 51 {
                    wider = true;
                    continue;
                }
                let (bits, negative) = sum_bits(&acc, &qx, &qw, r, c);
                narrow_bits = narrow_bits.max(bits);
                narrow_negative |= negative && bits >= 49;
            }
        }
        let (want, want_acc) = run(&Gemm::new(Kernel::Scalar, 1).unwrap(), &qx, &qw);
        for kernel in Kernel::supported() {
            let (got, got_acc) = run(&Gemm::new(kernel, 1).unwrap(), &qx, &qw);
            assert_eq!(want, got, "{kernel}, span {span}");
            assert_eq!(want_acc.as_ref().ok(), got_acc.as_ref().ok(), "{kernel}");
        }
    }
    assert!(
        (49..=51).contains(&narrow_bits),
        "narrow sums reach {narrow_bits} bits"
    );
    assert!(narrow_negative && wider);
}

#[test]
fn large_products_agree_across_kernels_and_threads() {
    // Big enough for several row chunks, full tiles and every panel split.
    let (m, k, n) = (37, 1000, 131);
    let mut rng = SplitMix64::new(7);
    let x = matrix(&mut rng, m, k, Style::Span(20));
    let w = matrix(&mut rng, n, k, Style::Normal);
    let qx = QuantizedRows::quantize(&x, m, k, "x").unwrap();
    let qw = PackedWeights::quantize(&w, k, n, WeightLayout::NByK, "w").unwrap();
    let (want, want_acc) = run(&Gemm::new(Kernel::Scalar, 1).unwrap(), &qx, &qw);
    let want_acc = want_acc.unwrap();
    for kernel in Kernel::supported() {
        for threads in [1, 2, 4] {
            let (got, acc) = run(&Gemm::new(kernel, threads).unwrap(), &qx, &qw);
            assert_eq!(want, got, "{kernel} × {threads}");
            assert_eq!(want_acc, acc.unwrap(), "{kernel} × {threads}");
        }
    }
}

#[test]
fn products_from_inside_the_pool_and_from_many_threads_agree() {
    // The calling thread takes part in the work and waits only for workers that joined: run
    // products from a pool worker (nested) and from several outside threads at once, many
    // times, on shapes from one panel to many.
    let mut rng = SplitMix64::new(11);
    let cases: Vec<(QuantizedRows, PackedWeights)> = [(1, 64, 40), (3, 100, 300), (9, 33, 17)]
        .iter()
        .map(|&(m, k, n)| {
            let x = matrix(&mut rng, m, k, Style::Normal);
            let w = matrix(&mut rng, n, k, Style::Span(10));
            (
                QuantizedRows::quantize(&x, m, k, "x").unwrap(),
                PackedWeights::quantize(&w, k, n, WeightLayout::NByK, "w").unwrap(),
            )
        })
        .collect();
    let reference = Gemm::new(Kernel::Scalar, 1).unwrap();
    let want: Vec<Vec<u32>> = cases.iter().map(|(x, w)| run(&reference, x, w).0).collect();
    for kernel in Kernel::supported() {
        let g = Gemm::new(kernel, 3).unwrap();
        let nested: Vec<Vec<u32>> =
            g.install(|| cases.iter().map(|(x, w)| run(&g, x, w).0).collect());
        assert_eq!(nested, want, "{kernel} nested");
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..50 {
                        for ((x, w), want) in cases.iter().zip(&want) {
                            assert_eq!(&run(&g, x, w).0, want, "{kernel} concurrent");
                        }
                    }
                });
            }
        });
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// A packing read back from its stored bytes (the weight cache) is the same packing: the
    /// same records, scales and per-panel facts, hence the same bits from every kernel.
    #[test]
    fn stored_packings_read_back_bit_for_bit(
        m in 1usize..5,
        k in 1usize..200,
        n in 1usize..50,
        sw in style(),
        seed in any::<u64>(),
    ) {
        let mut rng = SplitMix64::new(seed);
        let x = matrix(&mut rng, m, k, Style::Normal);
        let w = matrix(&mut rng, n, k, sw);
        let qx = QuantizedRows::quantize(&x, m, k, "x").unwrap();
        let qw = PackedWeights::quantize(&w, k, n, WeightLayout::NByK, "w").unwrap();
        let bytes = qw.to_bytes();
        let back = PackedWeights::from_bytes(&bytes).unwrap();
        prop_assert_eq!(back.to_bytes(), bytes.clone());
        for p in 0..qw.panels() {
            prop_assert_eq!(back.panel_meta(p), qw.panel_meta(p));
        }
        for j in 0..n {
            prop_assert_eq!(back.col_exp_min(j), qw.col_exp_min(j));
        }
        for kernel in Kernel::supported() {
            let g = Gemm::new(kernel, 2).unwrap();
            let (a, _) = run(&g, &qx, &qw);
            let (b, _) = run(&g, &qx, &back);
            prop_assert_eq!(a, b, "{}", kernel);
        }
        // Any flipped byte is refused (the checksum, or the header it guards).
        let at = (seed as usize) % bytes.len();
        let mut bad = bytes.clone();
        bad[at] ^= 1 << (seed % 8);
        prop_assert!(PackedWeights::from_bytes(&bad).is_err());
        prop_assert!(PackedWeights::from_bytes(&bytes[..bytes.len() - 1]).is_err());
    }
}

/// Re-seals `body` with a valid checksum, as a hostile or buggy writer could.
fn sealed(mut body: Vec<u8>) -> Vec<u8> {
    body.truncate(body.len() - 32);
    let sum = blake3::hash(&body);
    body.extend_from_slice(sum.as_bytes());
    body
}

#[test]
fn stored_packings_that_break_the_layout_rules_are_refused_even_with_a_good_checksum() {
    let mut rng = SplitMix64::new(7);
    let (k, n) = (40, 20); // a partial last block and a padded last panel
    let w = matrix(&mut rng, n, k, Style::Normal);
    let qw = PackedWeights::quantize(&w, k, n, WeightLayout::NByK, "w").unwrap();
    let good = qw.to_bytes();
    assert!(PackedWeights::from_bytes(&good).is_ok());
    let record = 544;
    let blocks = 2;
    let cases: [(&str, usize, u8); 4] = [
        // An element of -128.
        ("-128", 24, 0x80),
        // A scale mantissa below 128 (column 0, block 0).
        ("scale", 24 + 512, 5),
        // A shift that disagrees with the exponents (column 0, block 0).
        ("inconsistent", 24 + 528, 77),
        // Data in the padding of the second panel (column 16 + 4 = 20 >= n), block 0.
        ("inconsistent", 24 + blocks * record + 4 * 4, 3),
    ];
    for (what, at, v) in cases {
        let mut bytes = good.clone();
        bytes[at] = v;
        let err = PackedWeights::from_bytes(&sealed(bytes))
            .unwrap_err()
            .to_string();
        assert!(err.contains(what), "{what}: {err}");
    }
    // Elements beyond k in the last block (k = 40: element 8 of block 1, column 0).
    let mut bytes = good.clone();
    bytes[24 + record + (8 / 4) * 64] = 1;
    let err = PackedWeights::from_bytes(&sealed(bytes))
        .unwrap_err()
        .to_string();
    assert!(err.contains("padding beyond k"), "{err}");
    // Header: wrong magic, a shape that does not match the length.
    let mut bytes = good.clone();
    bytes[0] = b'X';
    assert!(PackedWeights::from_bytes(&sealed(bytes)).is_err());
    let mut bytes = good.clone();
    bytes[16] = 40;
    let err = PackedWeights::from_bytes(&sealed(bytes))
        .unwrap_err()
        .to_string();
    assert!(err.contains("does not fit"), "{err}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// Committing the rows a product wrote, on the engine's threads, gives the commitment of
    /// its exact accumulators' roundings, for every starting row.
    #[test]
    fn parallel_commitments_equal_serial_ones(
        m in 1usize..40,
        k in 1usize..100,
        n in 1usize..40,
        first in 0usize..50,
        skip in 0usize..45,
        seed in any::<u64>(),
    ) {
        let mut rng = SplitMix64::new(seed);
        let x = matrix(&mut rng, m, k, Style::Normal);
        let w = matrix(&mut rng, n, k, Style::Normal);
        let qx = QuantizedRows::quantize(&x, m, k, "x").unwrap();
        let qw = PackedWeights::quantize(&w, k, n, WeightLayout::NByK, "w").unwrap();
        let mut y = vec![0f32; m * n];
        for threads in [1, 2, 3] {
            let g = Gemm::new(Kernel::best(), threads).unwrap();
            let acc = g.matmul_exact(&qx, &qw, &mut y).unwrap();
            let from = first + skip;
            prop_assert_eq!(
                g.commit_from(&y, (m, n), first, from),
                dc_kernels::verify::commit::commit_gemm_from(&acc, first, from),
                "{} threads", threads
            );
        }
    }

    /// A wide decode row commits on the engine's threads as on one, its kept leaf included.
    #[test]
    fn a_wide_row_commits_alike_on_any_threads(
        n in 2700usize..6000,
        k in 1usize..80,
        seed in any::<u64>(),
    ) {
        let mut rng = SplitMix64::new(seed);
        let x = matrix(&mut rng, 1, k, Style::Normal);
        let w = matrix(&mut rng, n, k, Style::Normal);
        let qx = QuantizedRows::quantize(&x, 1, k, "x").unwrap();
        let qw = PackedWeights::quantize(&w, k, n, WeightLayout::NByK, "w").unwrap();
        let mut y = vec![0f32; n];
        let one = Gemm::new(Kernel::best(), 1).unwrap();
        let acc = one.matmul_exact(&qx, &qw, &mut y).unwrap();
        let want = one.commit_leaves_from(&y, (1, n), 7, 7);
        prop_assert_eq!(want.0, dc_kernels::verify::commit::commit_gemm_at(&acc, 7));
        for threads in [2, 3] {
            let g = Gemm::new(Kernel::best(), threads).unwrap();
            prop_assert_eq!(&g.commit_leaves_from(&y, (1, n), 7, 7), &want, "{} threads", threads);
        }
    }
}
