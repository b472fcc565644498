//! Commitments are part of the wire contract: the same product must always hash to the same
//! leaves and roots, and its exact accumulators encode to the same bytes, whatever code path
//! computes them. These tests pin values computed by the plain (value-by-value) definitions,
//! so any change of bytes fails here. (The leaves hash each row's f32 roundings since
//! protocol 5, whose pins replaced those of the accumulators' encodings; the encoding pins,
//! still what a reveal carries, are the original ones.)

#![allow(clippy::unwrap_used)] // test helpers: a panic is the failure report

use dc_kernels::conformance::{matrix, Style};
use dc_kernels::rng::SplitMix64;
use dc_kernels::verify::commit::{
    commit_gemm, commit_gemm_at, commit_gemm_from, encode_exact, encode_row, encode_values,
    exact_row_leaf, gemm_commitment, merkle_root, rounded_row, row_leaf, row_leaf_at, Commitment,
    Domain,
};
use dc_kernels::verify::reveal::leaf_of_encoding;
use dc_kernels::{
    Accumulators, Exact, Gemm, Kernel, PackedWeights, QuantizedRows, WeightLayout, BLOCK,
};
use proptest::prelude::*;

/// `rows × k` activations mixing every kind of row: normal, wide exponent spans (wide
/// accumulators), zero blocks, an all-zero row, ties.
fn mixed_x(rng: &mut SplitMix64, rows: usize, k: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(rows * k);
    for r in 0..rows {
        let row = match r % 6 {
            0 => matrix(rng, 1, k, Style::Normal),
            1 => matrix(rng, 1, k, Style::Span(180)),
            2 => matrix(rng, 1, k, Style::ZeroBlocks),
            3 => vec![0.0; k],
            4 => matrix(rng, 1, k, Style::Ties),
            _ => matrix(rng, 1, k, Style::Span(24)),
        };
        v.extend_from_slice(&row);
    }
    v
}

/// Weights with an all-zero column (zero accumulators in every row) and one with a wide span.
fn mixed_w(rng: &mut SplitMix64, n: usize, k: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(n * k);
    for c in 0..n {
        let col = match c % 9 {
            4 => vec![0.0; k],
            7 => matrix(rng, 1, k, Style::Span(40)),
            _ => matrix(rng, 1, k, Style::Normal),
        };
        v.extend_from_slice(&col);
    }
    v
}

/// A product's exact accumulators and the f32 output the plain product wrote (the same as
/// the exact product's, bit for bit: asserted).
fn product(
    m: usize,
    k: usize,
    n: usize,
    seed: u64,
    kernel: Kernel,
    threads: usize,
) -> (Accumulators, Vec<f32>) {
    let mut rng = SplitMix64::new(seed);
    let x = mixed_x(&mut rng, m, k);
    let w = mixed_w(&mut rng, n, k);
    let qx = QuantizedRows::quantize(&x, m, k, "x").unwrap();
    let qw = PackedWeights::quantize(&w, k, n, WeightLayout::NByK, "w").unwrap();
    let g = Gemm::new(kernel, threads).unwrap();
    let (mut y, mut plain) = (vec![0f32; m * n], vec![0f32; m * n]);
    let acc = g.matmul_exact(&qx, &qw, &mut y).unwrap();
    g.matmul(&qx, &qw, &mut plain).unwrap();
    assert_eq!(bits(&y), bits(&plain), "{kernel} × {threads}");
    (acc, plain)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn kinds(acc: &Accumulators) -> (usize, usize, usize) {
    let (mut zero, mut small, mut wide) = (0, 0, 0);
    for r in 0..acc.rows {
        for c in 0..acc.cols {
            match acc.get(r, c) {
                Exact::Wide { .. } => wide += 1,
                e if e.is_zero() => zero += 1,
                _ => small += 1,
            }
        }
    }
    (zero, small, wide)
}

/// blake3 (in the row domain) of every row's canonical encoding, concatenated.
fn encoding_digest(acc: &Accumulators) -> String {
    let mut bytes = Vec::new();
    for r in 0..acc.rows {
        encode_row(acc, r, &mut bytes);
    }
    Domain::GemmRow.hash(&bytes).to_hex()
}

/// The pinned values of one product, as hex: encoding digest, whole commitment, commitment of
/// the rows from position 9 of a GEMM starting at position 5, and leaf of row 3 at position 5.
fn pins(acc: &Accumulators) -> [String; 4] {
    [
        encoding_digest(acc),
        commit_gemm(acc).to_hex(),
        commit_gemm_from(acc, 5, 9).to_hex(),
        row_leaf_at(acc, 3.min(acc.rows - 1), 5).to_hex(),
    ]
}

const PREFILL: [&str; 4] = [
    "bc982cc6cdf5d91f191acdbab464af25f87ec5544a98d7ca8149c541aa5cbb27",
    "e3c05889ab5a77c44cfec48d0c4ff241594fcb8c0b0b493381c726e06a0148e5",
    "d7da744fa3d3e28db5e3640cec21d58f6bd52b84facfe5c18b07a8b77cf09621",
    "98c74eea10bf2b149856c127a52c3033341bcbb007e38ce532a875eeab420694",
];
const DECODE: [&str; 4] = [
    "28b9dc120cee544277c3575f3c18cf4b7b66178c831771adbab13900a2afdeb8",
    "f9625dac7dbaae8c809bd80204cfabcc5ecef347aa7067ff17e44f02a9facad8",
    "ca6ea74eb448c37a792076d8cd7ca930cd30c7a05153f7ee38635d9c4606245c",
    "796f082ef96eb3be724e8579669aee5d3e7ccfb105ff4351e201cadc0d31626a",
];

#[test]
fn gemm_commitments_are_pinned_bit_for_bit() {
    // 23 rows: several 4-row tiles, leftover rows, fallback rows; 41 columns: a partial panel.
    let (m, k, n) = (23, 5 * BLOCK + 7, 41);
    for kernel in Kernel::supported() {
        for threads in [1, 2] {
            let (acc, y) = product(m, k, n, 11, kernel, threads);
            let (zero, small, wide) = kinds(&acc);
            assert!(zero > 0 && small > 0 && wide > 0, "{zero} {small} {wide}");
            assert_eq!(
                pins(&acc),
                PREFILL.map(String::from),
                "{kernel} × {threads}"
            );
            // What a stage commits: the rows its product wrote, hashed on its threads.
            let g = Gemm::new(kernel, threads).unwrap();
            assert_eq!(g.commit_from(&y, (m, n), 5, 9).to_hex(), PREFILL[2]);
            assert_eq!(g.commit_from(&y, (m, n), 0, 0), commit_gemm(&acc));
            assert_eq!(commit_gemm_at(&acc, 0), commit_gemm(&acc));
            for r in 0..m {
                assert_eq!(row_leaf(&acc, r), row_leaf_at(&acc, r, 0));
            }
        }
    }
    // One row (decode): wide values too (the row is a wide-span row).
    let (acc, _) = product(2, k, n, 12, Kernel::Scalar, 1);
    let row1: Vec<Exact> = (0..n).map(|c| acc.get(1, c)).collect();
    let one = Accumulators::from_values(1, n, &row1);
    let (_, _, wide) = kinds(&one);
    assert!(wide > 0);
    for kernel in Kernel::supported() {
        let mut rng = SplitMix64::new(12);
        let x = mixed_x(&mut rng, 2, k);
        let w = mixed_w(&mut rng, n, k);
        let qx = QuantizedRows::quantize(&x[k..], 1, k, "x").unwrap();
        let qw = PackedWeights::quantize(&w, k, n, WeightLayout::NByK, "w").unwrap();
        let mut y = vec![0f32; n];
        let got = Gemm::new(kernel, 1)
            .unwrap()
            .matmul_exact(&qx, &qw, &mut y)
            .unwrap();
        assert_eq!(got, one, "{kernel}");
        assert_eq!(pins(&got), DECODE.map(String::from), "{kernel}");
        let g = Gemm::new(kernel, 1).unwrap();
        assert_eq!(
            g.commit_from(&y, (1, n), 5, 5),
            commit_gemm_at(&got, 5),
            "{kernel}"
        );
    }
}

const EXACT_LEAF: &str = "757a57ae62320eb3954b8e5df1d874bd0063daf354b697d56aa88d31f998608d";
const EXACT_ENCODING: &str = "3cfd3a956b6e1307e31b3e6e13ea57e06f82ab29f655dab4698450ba8f2735e7";

#[test]
fn exact_row_leaves_and_encodings_are_pinned() {
    let values = [
        Exact::ZERO,
        Exact::from_i64(1, 0),
        Exact::from_i64(-3, -140),
        Exact::from_i64(i64::MAX, 90),
        Exact::from_i64(i64::MIN, -7),
        Exact::from_i128(-(1i128 << 100) - 1, -20),
        Exact::from_i128((1i128 << 64) + 1, 3),
        Exact::Wide {
            neg: false,
            mag: vec![5, 0, 1 << 40],
            exp: -400,
        },
        Exact::from_i64(12345, 17),
    ];
    assert!(matches!(values[5], Exact::Wide { .. }));
    assert_eq!(exact_row_leaf(77, &values).to_hex(), EXACT_LEAF);
    let mut bytes = Vec::new();
    for v in &values {
        encode_exact(v, &mut bytes);
    }
    assert_eq!(Domain::GemmRow.hash(&bytes).to_hex(), EXACT_ENCODING);
    assert_eq!(exact_row_leaf(0, &[]).to_hex(), EMPTY_LEAF);
}

const EMPTY_LEAF: &str = "12f4909e4b66c45c0fae352478c0c029732325102954eb58411035cadd79439f";

// ---- The fast encoders and leaves against the plain definitions, value by value. ----

/// The plain definition of a row's encoding: every value through `encode_exact`.
fn plain_row(acc: &Accumulators, row: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for c in 0..acc.cols {
        encode_exact(&acc.get(row, c), &mut out);
    }
    out
}

/// The plain definition of a row's leaf: position, column count, then each value rounded to
/// f32 (infinity past the f32 range) as little-endian bytes.
fn plain_leaf(position: usize, values: &[Exact]) -> Commitment {
    let mut bytes = (position as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&(values.len() as u64).to_le_bytes());
    for v in values {
        let f = v.to_f32().unwrap_or(f32::INFINITY);
        bytes.extend_from_slice(&f.to_le_bytes());
    }
    Domain::ProductRow.hash(&bytes)
}

fn row_values(acc: &Accumulators, row: usize) -> Vec<Exact> {
    (0..acc.cols).map(|c| acc.get(row, c)).collect()
}

fn wide_value() -> impl Strategy<Value = Exact> {
    (
        any::<bool>(),
        proptest::collection::vec(any::<u64>(), 1..4),
        any::<i32>(),
    )
        .prop_map(|(neg, mut mag, exp)| {
            // Odd, at least 2^63, no leading zero limb: the canonical wide form.
            mag[0] |= 1;
            let top = mag.len() - 1;
            if mag[top] == 0 || (top == 0 && mag[0] >> 63 == 0) {
                mag[top] |= 1 << 63;
            }
            Exact::Wide { neg, mag, exp }
        })
}

fn small_value() -> impl Strategy<Value = Exact> {
    prop_oneof![
        Just(Exact::ZERO),
        (any::<i64>(), -1000i32..1000).prop_map(|(m, e)| Exact::from_i64(m, e)),
        (any::<i64>(), any::<i32>())
            .prop_map(|(m, e)| Exact::from_i64(m, e.max(i32::MIN + 64) / 2)),
    ]
}

fn value() -> impl Strategy<Value = Exact> {
    prop_oneof![8 => small_value(), 1 => wide_value()]
}

/// Accumulators holding `values`: small ones in their slots, wide ones in the table.
fn accumulators(rows: usize, values: Vec<Exact>) -> Accumulators {
    let cols = values.len() / rows.max(1);
    Accumulators::from_values(rows, cols, &values[..rows * cols])
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn row_encodings_and_leaves_equal_the_plain_definition(
        rows in 1usize..5,
        values in proptest::collection::vec(value(), 0..120),
        prefix in proptest::collection::vec(any::<u8>(), 0..20),
        first in 0usize..1000,
        skip in 0usize..6,
    ) {
        let acc = accumulators(rows, values);
        for r in 0..acc.rows {
            let mut got = prefix.clone();
            encode_row(&acc, r, &mut got);
            let mut want = prefix.clone();
            want.extend_from_slice(&plain_row(&acc, r));
            prop_assert_eq!(&got, &want);
            prop_assert_eq!(row_leaf_at(&acc, r, first), plain_leaf(first + r, &row_values(&acc, r)));
        }
        let from = first + skip;
        let leaves: Vec<Commitment> = (skip.min(acc.rows)..acc.rows)
            .map(|r| plain_leaf(first + r, &row_values(&acc, r)))
            .collect();
        let want = gemm_commitment(leaves.len(), acc.cols, &merkle_root(&leaves));
        prop_assert_eq!(commit_gemm_from(&acc, first, from), want);
        // The same from the rows' roundings hashed on any number of threads.
        let out: Vec<f32> = (0..acc.rows).flat_map(|r| rounded_row(&acc, r)).collect();
        for threads in [1, 2, 3] {
            let g = Gemm::new(Kernel::Scalar, threads).unwrap();
            prop_assert_eq!(g.commit_from(&out, (acc.rows, acc.cols), first, from), want);
        }
    }

    #[test]
    fn value_encodings_and_exact_leaves_equal_the_plain_definition(
        values in proptest::collection::vec(value(), 0..80),
        prefix in proptest::collection::vec(any::<u8>(), 0..20),
        position in any::<u32>(),
    ) {
        let mut want = prefix.clone();
        for v in &values {
            encode_exact(v, &mut want);
        }
        let mut got = prefix.clone();
        encode_values(&values, &mut got);
        prop_assert_eq!(&got, &want);
        prop_assert_eq!(
            exact_row_leaf(position as usize, &values),
            plain_leaf(position as usize, &values)
        );
        // A revealed encoding opens to the same leaf (when it decodes: a value past the f32
        // range is refused).
        let opened = leaf_of_encoding(position as usize, values.len(), &want[prefix.len()..]);
        match values.iter().all(|v| v.to_f32().is_some()) {
            true => prop_assert_eq!(opened, Ok(plain_leaf(position as usize, &values))),
            false => prop_assert!(opened.is_err()),
        }
    }
}
