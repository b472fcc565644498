//! The shared vocabulary of DaisyChain: identifiers, layer ranges, the messages peers exchange
//! and their bounded binary encoding. No async runtime and no networking live here, so every
//! other crate (and any tool) can speak the protocol.

#![deny(missing_docs)]

pub mod ids;
pub mod messages;
pub mod trace;
pub mod wire;

pub use dc_kernels::Commitment;
pub use ids::{GenerationId, LayerRange, ModelId};
pub use messages::*;
pub use trace::{CheckSet, Entry as TraceEntry, HopTrace, Point};
pub use wire::{decode, encode, WireError};

/// Version of the peer protocol. Peers with another version are ignored (and say why).
/// 2: traces commit each layer's new KV cache rows; reveals carry the cache; cached audits.
/// 3: several hops' reveals in one exchange (`StageRequest::RevealHops`).
/// 4: a pick reveals a layer at several consecutive rows (`RevealPick::positions`).
/// 5: a product's row leaf hashes its f32 outputs, not its exact accumulators' encoding (a
///    revealed row still carries the accumulators); a revealed context row is its f32 values.
/// 6: the MLP's first products commit through its hidden row as the down projection takes it,
///    quantised (`Point::Hidden`), not their f32 outputs, the attention scores through the
///    context and k and v through the cache rows; a check of one of a pair tests both.
/// 7: the attention context commits as the output projection takes it, quantised (leaf
///    `H_quantized_row`, like the hidden row), not as its f32 outputs; a revealed context row
///    is its quantised bytes.
/// 8: a revealed product row travels in units form (`RevealedRow::unit`: the row's unit and
///    each value's `i64` sum, 8 bytes a value instead of the canonical encoding's 12); the
///    commitments and hop records are protocol 7's.
/// 9: a hop record chains the generation's inputs at the stage (`HopRecord::previous`), so a
///    proof's records must be one run's; records are signed as `"hop record, protocol 9"`.
/// 10: a generation request carries the tokens the client already holds (`resume`), so the
///    next head in the rendezvous order can take a generation over when its head dies; hop
///    records and commitments are protocol 9's.
/// 11: a generation request's sampling carries min-p and the repetition, presence and
///    frequency penalties (`WireSampling`), and the request may ask for log-probabilities,
///    which token and correction events then carry, and JSON output; hop records and
///    commitments are protocol 9's.
/// 12: a hop may start inside the one before it (after its first position): the head's guess
///    of the tokens after the one it sampled missed there, and every peer running or replaying
///    the stage's hops first cuts its KV cache back to the hop's start; revealed cache rows
///    carry each hop's rows whole, the cut ones too, so that every hop's commitment can be
///    checked; a generation request says whether its head guesses (`speculative`). Hop
///    records and commitments are protocol 9's.
/// 13: a generation request's output format (`OutputFormat`) is text, any JSON object, or a
///    JSON document of a schema it carries; hop records and commitments are protocol 9's.
/// 14: the model id is the hash of the model's manifest (its files and the hash of every
///    piece as stored), and a stage serves the manifest and the pieces it holds
///    (`StageRequest::Manifest`, `StageRequest::Piece`) so that a daemon with no files can fetch
///    its layers from peers; hop records and commitments are protocol 9's.
pub const PROTOCOL_VERSION: u32 = 14;

/// The signing kind of a hop record (`dc_net::signing`). It names the protocol whose
/// commitments the record's trace root covers, so a record signed under other commitments (an
/// honest peer's from before an upgrade) never verifies here: replayed against a recomputation
/// with this protocol's leaves it would otherwise look like a lie.
pub const HOP_RECORD_KIND: &str = "hop record, protocol 9";
