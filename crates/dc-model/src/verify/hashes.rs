//! The hashes a check takes of what was revealed, gathered and hashed together where the hash
//! lanes pay, then compared in order so the first mismatch is the one named.

use dc_kernels::verify::commit::{product_row_leaf, quantized_row_leaf, LeafBatch};
use dc_kernels::verify::reveal::Opening;
use dc_kernels::Commitment;
use dc_types::Point;

use super::revealed::RevealedValues;
use crate::activations::Activations;

/// The hashes a check takes of what was revealed (the activations entering and leaving the
/// layer, each opened row's leaf), gathered so that [`Hashes::verify`] can hash them together
/// where that pays (a decode check's few rows of a few KB each leave the hash lanes mostly idle
/// one at a time) and compare them in the order they were gathered, so the first mismatch is
/// the one named.
#[derive(Default)]
pub(super) struct Hashes<'a> {
    gathered: Vec<(Message<'a>, Want<'a>)>,
}

/// A message a check hashes.
pub(super) enum Message<'a> {
    /// Revealed activations (their commitment).
    Activations(&'a Activations),
    /// The leaf of the row at position `pos` of a product whose rounded values are
    /// `values[index]` of [`Hashes::verify`].
    ProductRow(usize),
    /// The leaf of a quantised row of `k` values at position `pos`, its canonical bytes.
    QuantizedRow(usize, &'a [u8]),
}

/// What a gathered hash must be.
pub(super) enum Want<'a> {
    /// The commitment of the revealed input (`None`: the trace has none, which nothing
    /// matches).
    Input(Option<Commitment>),
    /// The same of the revealed output.
    Output(Option<Commitment>),
    /// The leaf of an opened row of a product or a quantised row.
    Opens(Opening<'a>, Point),
}

impl<'a> Hashes<'a> {
    pub(super) fn push(&mut self, message: Message<'a>, want: Want<'a>) {
        self.gathered.push((message, want));
    }

    /// Hashes what was gathered and compares each hash with what it must be, in order (the
    /// rows being layer `l`'s at position `pos`, product rows' values in `values`); leaves
    /// nothing gathered.
    pub(super) fn verify(
        &mut self,
        l: u32,
        pos: usize,
        values: &[RevealedValues],
    ) -> std::result::Result<(), String> {
        // Bytes of each message (its 16-byte head and its body), to see whether the lanes pay.
        let len = |m: &Message| match m {
            Message::Activations(a) => 16 + 4 * a.data.len(),
            Message::ProductRow(i) => 16 + 4 * values[*i].rounded.len(),
            Message::QuantizedRow(_, bytes) => 16 + bytes.len(),
        };
        let hashes: Vec<Commitment> = match dc_kernels::verify::hash_many::lanes_pay(
            self.gathered.iter().map(|(m, _)| len(m)),
        ) {
            true => {
                let mut batch = LeafBatch::default();
                for (m, _) in &self.gathered {
                    match m {
                        Message::Activations(a) => batch.activations(a.start, a.hidden, &a.data),
                        Message::ProductRow(i) => {
                            batch.product_row_message(pos, &values[*i].rounded)
                        }
                        Message::QuantizedRow(k, bytes) => {
                            batch.quantized_row_message(pos, *k, bytes)
                        }
                    }
                }
                batch.finish_sets(false).commitments
            }
            false => self
                .gathered
                .iter()
                .map(|(m, _)| match m {
                    Message::Activations(a) => a.commitment(),
                    Message::ProductRow(i) => product_row_leaf(pos, &values[*i].rounded),
                    Message::QuantizedRow(k, bytes) => quantized_row_leaf(pos, *k, bytes),
                })
                .collect(),
        };
        for ((_, want), hash) in self.gathered.drain(..).zip(hashes) {
            let error = match want {
                Want::Input(c) if c != Some(hash) => {
                    "the revealed input is not the committed one".into()
                }
                Want::Output(c) if c != Some(hash) => {
                    "the revealed output is not the committed one".into()
                }
                Want::Opens(opening, p) if !opening.holds_for(&hash) => {
                    format!("the {p:?} row at position {pos} does not open its commitment")
                }
                _ => continue,
            };
            return Err(format!("layer {l}: {error}"));
        }
        Ok(())
    }
}
