//! Rounding, quantisation and error paths at their edges: every fast routine against its
//! exact reference, and bad input refused with errors that say where.

use dc_kernels::exact::{exact_sum, round_i64_fast, round_limbs, round_u64};
use dc_kernels::quant::{quantize_block, quantize_element_reference, BlockScale};
use dc_kernels::{Gemm, Kernel, KernelError, PackedWeights, QuantizedRows, WeightLayout};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

    #[test]
    fn fast_rounding_equals_exact_rounding(sum in any::<i64>(), exp in -420i32..260, small in any::<bool>()) {
        let sum = if small { sum >> 40 } else { sum };
        let want = round_u64(sum < 0, sum.unsigned_abs(), exp);
        let fast = round_i64_fast(sum, exp);
        match want {
            Some(v) => prop_assert_eq!(fast.to_bits(), v.to_bits()),
            None => prop_assert!(fast.is_infinite()),
        }
        let limbs = round_limbs(sum < 0, &[sum.unsigned_abs()], exp);
        prop_assert_eq!(limbs.map(f32::to_bits), want.map(f32::to_bits));
    }

    #[test]
    fn fast_quantiser_equals_exact_quantiser(bits in proptest::collection::vec(any::<u32>(), 1..33)) {
        let vals: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).filter(|v| v.is_finite()).collect();
        prop_assume!(!vals.is_empty());
        let mut q = [0i8; 32];
        let s = quantize_block(&vals, &mut q);
        let amax = vals.iter().fold(0f32, |m, v| m.max(v.abs()));
        prop_assert!((128..=255).contains(&s.m) || amax == 0.0);
        for (i, &v) in vals.iter().enumerate() {
            prop_assert_eq!(q[i], quantize_element_reference(v, s), "{:e} with {:?}", v, s);
            prop_assert!(q[i] != i8::MIN);
        }
    }

    #[test]
    fn row_quantiser_equals_exact_quantiser(
        bits in proptest::collection::vec(any::<u32>(), 1..200),
        rows in 1usize..4,
        style in 0u8..4,
        shift in -160i32..128,
    ) {
        // Random bit patterns (every exponent), then blocks rescaled to extreme exponents,
        // then exact ties of the block's own scale.
        let k = bits.len().div_ceil(rows).max(1);
        let mut x: Vec<f32> = (0..rows * k)
            .map(|i| f32::from_bits(bits[i % bits.len()].rotate_left(i as u32)))
            .map(|v| if v.is_finite() { v } else { 1.5 })
            .collect();
        match style {
            1 => x.iter_mut().for_each(|v| *v = (*v as f64 * 2f64.powi(shift)).clamp(-3e38, 3e38) as f32),
            2 => x.iter_mut().for_each(|v| *v = f32::from_bits(v.to_bits() & 0x807f_ffff)),
            3 => x.iter_mut().enumerate().for_each(|(i, v)| {
                let t = (bits[i % bits.len()] % 255) as f32 - 127.0;
                *v = (t + 0.5) * 2f32.powi(shift.clamp(-120, 100)) * if i % 7 == 0 { 1.0 } else { 0.25 };
            }),
            _ => {}
        }
        let qx = QuantizedRows::quantize(&x, rows, k, "x").expect("finite");
        for r in 0..rows {
            for b in 0..qx.blocks() {
                let vals = &x[r * k + b * 32..r * k + ((b + 1) * 32).min(k)];
                let mut want = [0i8; 32];
                let s = quantize_block(vals, &mut want);
                prop_assert_eq!(qx.scale(r, b), s);
                prop_assert_eq!(qx.block(r, b), &want[..]);
                for (i, &v) in vals.iter().enumerate() {
                    prop_assert_eq!(qx.block(r, b)[i], quantize_element_reference(v, s), "{:e} with {:?}", v, s);
                }
            }
        }
        // The kernels' per-row facts do not depend on how the rows were quantised.
        let again = QuantizedRows::from_parts(
            rows,
            k,
            (0..rows).flat_map(|r| qx.row_q(r).to_vec()).collect(),
            (0..rows).flat_map(|r| qx.row_scales(r).to_vec()).collect(),
        );
        for r in 0..rows {
            prop_assert_eq!(again.meta(r), qx.meta(r));
        }
    }

    #[test]
    fn exact_sum_is_order_independent(mut terms in proptest::collection::vec((any::<i64>().prop_map(|t| t >> 28), -300i32..300), 0..40)) {
        let a = exact_sum(&terms);
        terms.reverse();
        prop_assert_eq!(exact_sum(&terms), a);
    }
}

#[test]
fn row_quantiser_at_the_exponent_extremes() {
    // Every block of this row has a different magnitude, from the smallest subnormal to
    // f32::MAX, with exact ties and near-ties of its own scale inside.
    let mut x = Vec::new();
    for e in (-149..=127).step_by(3) {
        let base = 2f64.powi(e);
        for t in 0..32 {
            let v = base * (1.0 + t as f64 / 7.0) * if t % 3 == 0 { -1.0 } else { 1.0 };
            x.push(v.clamp(-f32::MAX as f64, f32::MAX as f64) as f32);
        }
        let n = x.len();
        x[n - 5] = f32::from_bits(1);
        x[n - 6] = -0.0;
    }
    x.push(f32::MAX);
    let k = x.len();
    let qx = QuantizedRows::quantize(&x, 1, k, "x").unwrap();
    for b in 0..qx.blocks() {
        let vals = &x[b * 32..((b + 1) * 32).min(k)];
        let s = qx.scale(0, b);
        let mut q = [0i8; 32];
        assert_eq!(quantize_block(vals, &mut q), s);
        for (i, &v) in vals.iter().enumerate() {
            assert_eq!(
                qx.block(0, b)[i],
                quantize_element_reference(v, s),
                "{v:e} {s:?}"
            );
        }
    }
    // Exact ties at the top of a block: (n + 1/2) · s for every n, s = 129 · 2^-10.
    let s = 129.0 * 2f64.powi(-10);
    let mut x: Vec<f32> = (0..127).map(|n| ((n as f64 + 0.5) * s) as f32).collect();
    x.push((127.0 * s) as f32);
    let qx = QuantizedRows::quantize(&x, 4, 32, "x").unwrap();
    for (i, &v) in x.iter().enumerate() {
        let (r, c) = (i / 32, i % 32);
        let sc = qx.scale(r, 0);
        assert_eq!(
            qx.block(r, 0)[c],
            quantize_element_reference(v, sc),
            "{v:e} {sc:?}"
        );
    }
}

#[test]
fn row_quantiser_at_every_tie_and_its_neighbours() {
    // For every mantissa m, blocks whose scale is exactly m · 2^e (the amax element fixes it)
    // filled with the ties (n + 1/2) · m · 2^e and the f32 values right next to them: a
    // quantiser that rounds the quotient twice, or multiplies by a rounded 1/m, fails here.
    for e in [-140i32, -20, 0, 90] {
        for m in 128u32..=255 {
            let s = m as f64 * 2f64.powi(e);
            let mut vals = Vec::new();
            for n in 0..127 {
                let tie = ((n as f64 + 0.5) * s) as f32;
                let up = f32::from_bits(tie.to_bits() + 1);
                let down = f32::from_bits(tie.to_bits() - 1);
                vals.extend([tie, up, -down]);
            }
            let mut x = Vec::new();
            for chunk in vals.chunks(31) {
                x.push((127.0 * s) as f32);
                x.extend_from_slice(chunk);
                x.resize(x.len().next_multiple_of(32), 0.0);
            }
            let rows = x.len() / 32;
            let qx = QuantizedRows::quantize(&x, rows, 32, "x").unwrap();
            for (i, &v) in x.iter().enumerate() {
                let (r, c) = (i / 32, i % 32);
                let sc = qx.scale(r, 0);
                assert_eq!(sc.to_f64(), s, "scale of row {r}");
                assert_eq!(
                    qx.block(r, 0)[c],
                    quantize_element_reference(v, sc),
                    "{v:e} {sc:?}"
                );
            }
        }
    }
}

#[test]
fn scale_boundaries_and_subnormals() {
    // 127 · m · 2^e exactly: the boundary belongs to that scale.
    let s = BlockScale::for_amax(127.0 * 200.0 * 2f32.powi(-20));
    assert_eq!((s.m, s.e), (200, -20));
    // The smallest subnormal.
    let tiny = f32::from_bits(1);
    let s = BlockScale::for_amax(tiny);
    assert!(s.to_f64() >= tiny as f64 / 127.0);
    let want = (tiny as f64 / s.to_f64()).round_ties_even() as i8;
    assert_eq!(quantize_element_reference(tiny, s), want);
    assert!(want >= 64, "the amax element keeps at least 7 bits: {want}");
}

#[test]
fn non_finite_input_is_refused_with_its_position() {
    let mut x = vec![0.5f32; 3 * 40];
    x[2 * 40 + 33] = f32::NEG_INFINITY;
    match QuantizedRows::quantize(&x, 3, 40, "layer 7 input") {
        Err(KernelError::NonFinite {
            tensor, row, col, ..
        }) => {
            assert_eq!((tensor.as_str(), row, col), ("layer 7 input", 2, 33));
        }
        other => panic!("expected NonFinite, got {other:?}"),
    }
    let mut w = vec![0.1f32; 40 * 5];
    w[40 * 4 + 1] = f32::NAN;
    let err = PackedWeights::quantize(&w, 40, 5, WeightLayout::NByK, "wq").unwrap_err();
    assert!(
        matches!(err, KernelError::NonFinite { row: 4, col: 1, .. }),
        "{err}"
    );
}

#[test]
fn shape_mismatches_are_errors_not_panics() {
    let x = QuantizedRows::quantize(&[1.0; 64], 2, 32, "x").unwrap();
    let w = PackedWeights::quantize(&[1.0; 33 * 4], 33, 4, WeightLayout::NByK, "w").unwrap();
    for kernel in Kernel::supported() {
        let g = Gemm::new(kernel, 2).unwrap();
        let mut y = vec![0.0; 8];
        let err = g.matmul(&x, &w, &mut y).unwrap_err();
        assert!(err.to_string().contains("k = 32 but w has k = 33"), "{err}");
        let w = PackedWeights::quantize(&[1.0; 32 * 4], 32, 4, WeightLayout::NByK, "w").unwrap();
        let mut short = vec![0.0; 7];
        assert!(matches!(
            g.matmul(&x, &w, &mut short),
            Err(KernelError::Shape { .. })
        ));
    }
    assert!(QuantizedRows::quantize(&[1.0; 5], 2, 3, "x").is_err());
    assert!(PackedWeights::quantize(&[1.0; 5], 0, 5, WeightLayout::NByK, "w").is_err());
}

#[test]
fn made_up_extreme_scales_take_the_exact_path() {
    // Scales no f32 quantisation produces (exponents in the thousands), built by hand: every
    // kernel must still agree with the reference, values and errors alike.
    let (m, k, n) = (5, 64, 20);
    let q: Vec<i8> = (0..m * k).map(|i| (i * 37 % 255) as i8 / 2).collect();
    for e in [-3000i16, -1100, -500, 300, 450, 3000] {
        let scales: Vec<BlockScale> = (0..m * 2)
            .map(|i| BlockScale {
                m: 128 + i as u8,
                e: if i % 2 == 0 { e } else { e + 3 },
            })
            .collect();
        let x = QuantizedRows::from_parts(m, k, q.clone(), scales);
        let wq: Vec<i8> = (0..n * k).map(|i| (i * 11 % 251) as i8 / 2).collect();
        let ws: Vec<BlockScale> = (0..n * 2)
            .map(|i| BlockScale {
                m: 200,
                e: -(i as i16 % 3) - e / 2,
            })
            .collect();
        let w = PackedWeights::from_columns(k, n, &wq, &ws);
        let mut want = vec![0f32; m * n];
        let want_res = Gemm::new(Kernel::Scalar, 1)
            .unwrap()
            .matmul(&x, &w, &mut want);
        for kernel in Kernel::supported() {
            let mut got = vec![0f32; m * n];
            let res = Gemm::new(kernel, 2).unwrap().matmul(&x, &w, &mut got);
            assert_eq!(res, want_res, "{kernel}, e = {e}");
            if res.is_ok() {
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{kernel}, e = {e}");
            }
        }
    }
}

#[test]
fn overflow_is_an_error_naming_the_first_element() {
    let x = QuantizedRows::quantize(&[3e38f32; 64], 2, 32, "x").unwrap();
    let w = PackedWeights::quantize(&[3e38f32; 32 * 20], 32, 20, WeightLayout::NByK, "w").unwrap();
    for kernel in Kernel::supported() {
        for threads in [1, 2] {
            let mut y = vec![0.0; 40];
            let err = Gemm::new(kernel, threads)
                .unwrap()
                .matmul(&x, &w, &mut y)
                .unwrap_err();
            assert_eq!(
                err,
                KernelError::Overflow {
                    op: "gemm",
                    row: 0,
                    col: 0
                },
                "{kernel}"
            );
        }
    }
}

#[test]
fn bad_kernel_and_thread_settings_are_named() {
    assert!(Kernel::parse("avx9")
        .unwrap_err()
        .to_string()
        .contains("avx9"));
    assert_eq!(Kernel::parse("scalar").unwrap(), Kernel::Scalar);
    assert_eq!(Kernel::parse("auto").unwrap(), Kernel::best());
    assert!(Gemm::new(Kernel::Scalar, 0).is_err());
    if !Kernel::Avx512.is_supported() {
        assert_eq!(
            Kernel::parse("avx512").unwrap_err(),
            KernelError::Unsupported("avx512")
        );
    }
}
