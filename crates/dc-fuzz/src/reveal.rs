//! Revealed product rows: the bytes a stage sends for a spot check, decoded by the checker.
//! Each fast decoder must agree with the definition it speeds up, bit for bit, on whatever it
//! accepts, and refuse what the definition refuses.

use dc_kernels::verify::freivalds::exact_mod;
use dc_kernels::verify::reveal::{
    decode_for_check, decode_row, decode_small, decode_small_scalar, decode_units_for_check,
    decode_units_small, decode_units_small_scalar, revealed_values, Decode,
};
use dc_kernels::Exact;
use dc_types::LayerReveal;

/// The unit exponents a units-form row may have (the decoders' own bound).
const UNITS_EXP: std::ops::RangeInclusive<i32> = -(1 << 20)..=(1 << 20);

/// Every row of a stage's reveal, decoded as the checker would.
pub(crate) fn check_reveals(reveals: &[LayerReveal]) {
    for r in reveals {
        for row in &r.rows {
            let cols = row.cols as usize;
            match row.unit {
                None => {
                    let _ = decode_for_check(&row.encoding, cols, Decode::BOTH);
                }
                // The checker's column units come from its own weights; zeros stand in.
                Some(unit) if cols <= row.encoding.len() => {
                    let _ =
                        decode_units_for_check(unit, &row.encoding, &vec![0; cols], Decode::BOTH);
                }
                Some(_) => {}
            }
        }
    }
}

/// The definition's answer for a row: each value's residue and rounding, or why not.
fn definition(values: Result<Vec<Exact>, String>) -> Option<(Vec<u64>, Vec<f32>)> {
    let values = values.ok()?;
    let rounded = values
        .iter()
        .map(Exact::to_f32)
        .collect::<Option<Vec<f32>>>()?;
    Some((values.iter().map(exact_mod).collect(), rounded))
}

fn assert_agrees(
    fast: Result<dc_kernels::verify::reveal::CheckedRow, String>,
    def: Option<(Vec<u64>, Vec<f32>)>,
) {
    match (fast, def) {
        (Ok(row), Some((residues, rounded))) => {
            assert_eq!(
                row.residues, residues,
                "residues differ from the definition"
            );
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&row.rounded), bits(&rounded), "roundings differ");
        }
        (Err(_), None) => {}
        (Ok(_), None) => panic!("the fast decoder accepts a row the definition refuses"),
        (Err(e), Some(_)) => panic!("the fast decoder refuses a row the definition accepts: {e}"),
    }
}

/// One row in either form. The first byte chooses the form and the number of columns; in
/// units form the next 4 bytes are the unit, and each column's unit is drawn from the bytes.
pub fn revealed_row(data: &[u8]) {
    let (sel, rest) = crate::split_first(data);
    if sel & 1 == 0 {
        let cols = if sel & 2 == 0 {
            rest.len() / 12
        } else {
            usize::from(sel >> 2)
        };
        assert_agrees(
            decode_for_check(rest, cols, Decode::BOTH),
            definition(decode_row(rest, cols)),
        );
        let whole = &rest[..rest.len() / 12 * 12];
        let n = whole.len() / 12;
        let (mut r1, mut f1) = (vec![0; n], vec![0.0; n]);
        let (mut r2, mut f2) = (vec![0; n], vec![0.0; n]);
        let ok = decode_small(whole, &mut r1, &mut f1);
        assert_eq!(
            ok,
            decode_small_scalar(whole, &mut r2, &mut f2),
            "decode_small"
        );
        if ok {
            assert_eq!(r1, r2);
            assert!(f1.iter().zip(&f2).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
        return;
    }
    let (unit, bytes) = match rest {
        [a, b, c, d, tail @ ..] => (i32::from_le_bytes([*a, *b, *c, *d]), tail),
        _ => return,
    };
    // Column units as a product's are: small, from the weights' block scales.
    let col_units: Vec<i32> = bytes
        .chunks(8)
        .map(|c| i32::from(c[0] as i8) - 20)
        .collect();
    let cols = if sel & 2 == 0 {
        col_units.len()
    } else {
        usize::from(sel >> 2).min(col_units.len())
    };
    let col_units = &col_units[..cols];
    assert_agrees(
        decode_units_for_check(unit, bytes, col_units, Decode::BOTH),
        definition(revealed_values(Some(unit), bytes, col_units)),
    );
    if bytes.len() == cols * 8 && UNITS_EXP.contains(&unit) {
        let (mut r1, mut f1) = (vec![0; cols], vec![0.0; cols]);
        let (mut r2, mut f2) = (vec![0; cols], vec![0.0; cols]);
        let ok = decode_units_small(bytes, unit, col_units, &mut r1, &mut f1);
        assert_eq!(
            ok,
            decode_units_small_scalar(bytes, unit, col_units, &mut r2, &mut f2),
            "decode_units_small"
        );
        if ok {
            assert_eq!(r1, r2);
            assert!(f1.iter().zip(&f2).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }
}
