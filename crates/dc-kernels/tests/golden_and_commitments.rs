//! The shared golden vectors pass on every kernel, and GEMM commitments let one row be checked
//! alone.

use std::path::PathBuf;

use dc_kernels::conformance::{matrix, Style};
use dc_kernels::rng::SplitMix64;
use dc_kernels::verify::commit::{
    commit_gemm, gemm_commitment, merkle_proof, merkle_root, product_row_leaf, row_leaf,
    row_leaves, verify_merkle,
};
use dc_kernels::verify::freivalds::FreivaldsKey;
use dc_kernels::{golden, Exact, Gemm, Kernel, PackedWeights, QuantizedRows, WeightLayout};

#[test]
fn golden_vectors_pass_on_every_kernel() {
    let rep = golden::run(&Kernel::supported());
    assert!(rep.sets >= 11, "only {} sets", rep.sets);
    assert!(rep.checks > 500, "only {} checks", rep.checks);
    assert!(rep.failures.is_empty(), "{:#?}", rep.failures);
}

#[test]
fn embedded_golden_vectors_are_the_shared_ones() {
    let shared = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/numerics/golden_vectors_m7.json");
    match std::fs::read_to_string(&shared) {
        Ok(s) => assert_eq!(
            s,
            golden::GOLDEN_JSON,
            "the embedded copy drifted from {}",
            shared.display()
        ),
        Err(_) => eprintln!(
            "{} not present; embedded copy not compared",
            shared.display()
        ),
    }
}

#[test]
fn conformance_sweep_passes() {
    let rep = dc_kernels::conformance::sweep(&Kernel::supported(), &[1, 2], 42);
    assert!(rep.gemms > 40 && rep.quantised > 10_000);
    assert!(rep.failures.is_empty(), "{:#?}", rep.failures);
}

#[test]
fn one_row_is_checkable_alone_and_any_change_is_caught() {
    let (m, k, n) = (9, 100, 21);
    let mut rng = SplitMix64::new(3);
    let qx = QuantizedRows::quantize(&matrix(&mut rng, m, k, Style::Span(40)), m, k, "x").unwrap();
    let qw = PackedWeights::quantize(
        &matrix(&mut rng, n, k, Style::Normal),
        k,
        n,
        WeightLayout::NByK,
        "w",
    )
    .unwrap();
    let mut y = vec![0.0; m * n];
    let acc = Gemm::new(Kernel::best(), 2)
        .unwrap()
        .matmul_exact(&qx, &qw, &mut y)
        .unwrap();
    let leaves = row_leaves(&acc);
    let root = merkle_root(&leaves);
    assert_eq!(gemm_commitment(m, n, &root), commit_gemm(&acc));
    for r in 0..m {
        let proof = merkle_proof(&leaves, r);
        assert!(verify_merkle(&root, &row_leaf(&acc, r), r, m, &proof));
    }
    // Change one output of row 4 by one bit: its row leaf and the GEMM commitment change.
    let leaf = |out: &[f32], r: usize| product_row_leaf(r, &out[r * n..(r + 1) * n]);
    assert_eq!(
        leaf(&y, 4),
        leaves[4],
        "the leaf hashes what the product wrote"
    );
    let mut lie = y.clone();
    lie[4 * n + 3] = f32::from_bits(lie[4 * n + 3].to_bits() ^ 1);
    assert_ne!(leaf(&lie, 4), leaves[4]);
    assert!(!verify_merkle(
        &root,
        &leaf(&lie, 4),
        4,
        m,
        &merkle_proof(&leaves, 4)
    ));
    let lied: Vec<_> = (0..m).map(|r| leaf(&lie, r)).collect();
    assert_ne!(
        gemm_commitment(m, n, &merkle_root(&lied)),
        commit_gemm(&acc)
    );
    // An accumulator changed so that its rounding changes (its sign): the leaf changes too.
    let mut bad = acc.clone();
    let (c, mant, exp) = (0..n)
        .find_map(|c| match acc.get(4, c) {
            Exact::Small { mant, exp } if mant != 0 => Some((c, mant, exp)),
            _ => None,
        })
        .unwrap();
    bad.set(4, c, Exact::Small { mant: -mant, exp });
    assert_ne!(row_leaf(&bad, 4), leaves[4]);
    assert_ne!(commit_gemm(&bad), commit_gemm(&acc));
    // One changed too little to move its rounding keeps the leaf (the commitment binds the
    // outputs), but is no longer the product: Freivalds' test of the revealed row refuses it.
    let key = FreivaldsKey::new(&qw, &[9; 32]);
    assert!(key.check_row(&qx, 4, &acc));
    let mut quiet = acc.clone();
    let (c, mant, exp) = (0..n)
        .find_map(|c| match acc.get(4, c) {
            Exact::Small { mant, exp } if mant.unsigned_abs() >= 1 << 40 => Some((c, mant, exp)),
            _ => None,
        })
        .expect("a wide-span row has long mantissas");
    quiet.set(
        4,
        c,
        Exact::Small {
            mant: mant ^ 2,
            exp,
        },
    );
    assert_eq!(row_leaf(&quiet, 4), leaves[4]);
    assert!(!key.check_row(&qx, 4, &quiet));
}
