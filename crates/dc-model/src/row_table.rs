//! A table read one row at a time: the token embeddings. A head looks up a few rows per token,
//! so it keeps the table as the file stores it (bf16, f16, a GGUF block type) and converts
//! only the rows it reads, instead of holding the whole vocabulary as f32 (Qwen2.5-Coder-1.5B
//! Q4_K_M: 0.93 GB as f32 against 0.13 GB of Q4_K blocks; a 7B Qwen's f32 table is 2.2 GB).
//! A value that is not finite is found when its row is read (`Model::embed` refuses it),
//! not when the table is loaded.
//!
//! A row converts to exactly the values converting the whole table gives it: every value
//! depends only on its own element or block, and a row is whole blocks (checked when the
//! table is made; a table whose rows are not stays f32).

use crate::error::{ModelError, Result};
use crate::gguf::dequant::{dequantize_here, GgmlType};

/// How each row's bytes encode its values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowEncoding {
    /// Little-endian f16.
    F16,
    /// Little-endian bf16.
    Bf16,
    /// Whole blocks of a GGUF type.
    Ggml(GgmlType),
}

/// A `rows × cols` table, stored as f32 or as encoded rows.
#[derive(Clone, Debug)]
pub struct RowTable {
    rows: usize,
    cols: usize,
    store: Store,
}

#[derive(Clone, Debug)]
enum Store {
    F32(Vec<f32>),
    Encoded {
        encoding: RowEncoding,
        bytes: Vec<u8>,
        row_bytes: usize,
    },
}

impl RowTable {
    /// A table of f32 values, row-major.
    pub fn from_f32(values: Vec<f32>, rows: usize, cols: usize) -> Result<RowTable> {
        if rows.checked_mul(cols) != Some(values.len()) {
            return Err(ModelError::Input(format!(
                "a {rows} × {cols} table given {} values",
                values.len()
            )));
        }
        Ok(RowTable {
            rows,
            cols,
            store: Store::F32(values),
        })
    }

    /// A table of `rows` rows of `cols` values encoded as `encoding` in `bytes`, or `None`
    /// when a row is not a whole number of the encoding's units (then load it as f32).
    pub fn encoded(
        encoding: RowEncoding,
        bytes: Vec<u8>,
        rows: usize,
        cols: usize,
    ) -> Option<RowTable> {
        let row_bytes = match encoding {
            RowEncoding::F16 | RowEncoding::Bf16 => cols.checked_mul(2)?,
            RowEncoding::Ggml(ty) => {
                let (block, size) = ty.block_layout();
                let (block, size) = (usize::try_from(block).ok()?, usize::try_from(size).ok()?);
                if !ty.can_dequantize() || block == 0 || !cols.is_multiple_of(block) {
                    return None;
                }
                (cols / block).checked_mul(size)?
            }
        };
        (rows.checked_mul(row_bytes)? == bytes.len()).then_some(RowTable {
            rows,
            cols,
            store: Store::Encoded {
                encoding,
                bytes,
                row_bytes,
            },
        })
    }

    /// Rows in the table.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Values in a row.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes the table holds.
    pub fn bytes(&self) -> usize {
        match &self.store {
            Store::F32(v) => v.len() * 4,
            Store::Encoded { bytes, .. } => bytes.len(),
        }
    }

    /// The whole table, when it is held as f32.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match &self.store {
            Store::F32(v) => Some(v),
            Store::Encoded { .. } => None,
        }
    }

    /// Appends row `r`'s values to `out`.
    pub fn push_row(&self, r: usize, out: &mut Vec<f32>) -> Result<()> {
        if r >= self.rows {
            return Err(ModelError::Input(format!(
                "row {r} of a table of {} rows",
                self.rows
            )));
        }
        let c = self.cols;
        match &self.store {
            Store::F32(v) => out.extend_from_slice(&v[r * c..(r + 1) * c]),
            Store::Encoded {
                encoding,
                bytes,
                row_bytes,
            } => {
                let row = &bytes[r * row_bytes..(r + 1) * row_bytes];
                match encoding {
                    RowEncoding::F16 => out.extend(
                        row.chunks_exact(2)
                            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
                    ),
                    RowEncoding::Bf16 => out.extend(
                        row.chunks_exact(2)
                            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
                    ),
                    RowEncoding::Ggml(ty) => {
                        let at = out.len();
                        out.resize(at + c, 0.0);
                        dequantize_here(*ty, row, &mut out[at..])
                            .map_err(|e| ModelError::Input(format!("table row {r}: {e}")))?;
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a panic is the failure report

    use super::*;

    #[test]
    fn rows_that_are_not_whole_blocks_or_do_not_fill_the_bytes_are_refused() {
        // Q8_0 blocks are 32 values in 34 bytes.
        let q8 = RowEncoding::Ggml(GgmlType::Q8_0);
        assert!(RowTable::encoded(q8, vec![0; 2 * 34], 2, 32).is_some());
        assert!(RowTable::encoded(q8, vec![0; 2 * 34], 2, 48).is_none());
        assert!(RowTable::encoded(q8, vec![0; 2 * 34 + 1], 2, 32).is_none());
        assert!(RowTable::encoded(RowEncoding::Bf16, vec![0; 12], 2, 3).is_some());
        assert!(RowTable::encoded(RowEncoding::Bf16, vec![0; 12], 3, 3).is_none());
        assert!(RowTable::from_f32(vec![0.0; 5], 2, 3).is_err());
    }

    #[test]
    fn a_row_past_the_table_is_an_error() {
        let t = RowTable::from_f32((0..6).map(|i| i as f32).collect(), 2, 3).unwrap();
        let mut out = vec![9.0];
        t.push_row(1, &mut out).unwrap();
        assert_eq!(out, [9.0, 3.0, 4.0, 5.0]);
        assert!(t.push_row(2, &mut out).is_err());
    }
}
