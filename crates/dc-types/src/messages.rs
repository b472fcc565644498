//! The messages daemons exchange: announcements (gossip), hops (one stage's work on one
//! generation step), and generation streams (a request forwarded to the elected head and the
//! tokens it streams back).

use serde::{Deserialize, Serialize};

use crate::ids::{GenerationId, LayerRange, ModelId};
use crate::trace::HopTrace;
use crate::Commitment;

/// What a daemon is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PeerState {
    /// Loading or quantising weights; not serving yet.
    Loading,
    /// Serving its layers.
    Serving,
    /// Moving to another layer range.
    Moving,
    /// Shutting down: finishing what it serves, taking nothing new.
    Leaving,
}

impl PeerState {
    /// Lower-case name for status output.
    pub fn name(self) -> &'static str {
        match self {
            PeerState::Loading => "loading",
            PeerState::Serving => "serving",
            PeerState::Moving => "moving",
            PeerState::Leaving => "leaving",
        }
    }
}

/// A daemon's periodic announcement of what it serves (gossiped; the gossip layer signs it
/// with the sender's identity, so the sender cannot be forged).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Announcement {
    /// [`crate::PROTOCOL_VERSION`] of the sender.
    pub protocol_version: u32,
    /// The `dcd` version string.
    pub software: String,
    /// The model served.
    pub model_id: ModelId,
    /// Layers served (none while loading).
    pub layers: Option<LayerRange>,
    /// Whether it holds the head weights (embeddings, final norm, output projection).
    pub head: bool,
    /// Measured throughput of its layer range, in tokens per second at decode.
    pub throughput: f32,
    /// Memory it could still give, in bytes.
    pub free_memory: u64,
    /// What it is doing.
    pub state: PeerState,
    /// Generations it is serving now.
    pub active_generations: u32,
    /// Increases with every announcement (lets peers drop stale ones).
    pub seq: u64,
    /// Addresses the sender listens on (so peers that only heard of it by gossip can dial it).
    pub listen_addrs: Vec<String>,
}

/// Activations on the wire: `rows` positions from `start`, `hidden` wide, little-endian f32.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WireActivations {
    /// First absolute position.
    pub start: u32,
    /// Row width.
    pub hidden: u32,
    /// Values, row-major.
    pub data: Vec<f32>,
}

/// One hop: a stage runs its layers on the activations of one step of a generation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HopRequest {
    /// The model (a stage refuses other models).
    pub model_id: ModelId,
    /// The generation (selects the stage's KV cache).
    pub generation: GenerationId,
    /// Step number within the generation (0 for the first prefill chunk).
    pub step: u64,
    /// The layers to run (inside the stage's range).
    pub layers: LayerRange,
    /// Input activations.
    pub activations: WireActivations,
}

/// A stage's signed statement of what it computed for one hop.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HopRecord {
    /// The generation.
    pub generation: GenerationId,
    /// The step.
    pub step: u64,
    /// The layers run.
    pub layers: LayerRange,
    /// Commitment to the input activations.
    pub input: Commitment,
    /// Commitment to the output activations.
    pub output: Commitment,
    /// Root of the per-GEMM commitments (zero when not computed).
    pub gemms: Commitment,
    /// The stage's chain of this generation's inputs before this hop: [`HopRecord::FIRST`] for
    /// the hop at position 0, then each record's [`HopRecord::chain`]. It ties the record to
    /// the one sequence of inputs that built the stage's cache: the same generation id run
    /// twice (a head may start one over at position 0) yields two chains, so records of the
    /// two runs cannot be spliced into a proof against an honest stage.
    pub previous: Commitment,
}

impl HopRecord {
    /// The chain before a generation's first hop.
    pub const FIRST: Commitment = Commitment([0; 32]);

    /// The chain after this hop: what the stage's next record of the generation names as
    /// `previous`.
    pub fn chain(&self) -> Commitment {
        dc_kernels::Domain::InputChain.hash_parts(&[&self.previous.0, &self.input.0])
    }
}

/// A message with its signer's public key and signature (encoding and checking live in the
/// network crate, which owns the keys).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Signed<T> {
    /// The message.
    pub body: T,
    /// The signer's public key (libp2p protobuf encoding).
    pub public_key: Vec<u8>,
    /// Signature over the canonical encoding of `body`.
    pub signature: Vec<u8>,
}

/// Why a hop was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum HopErrorKind {
    /// Another model id.
    WrongModel,
    /// Layers this stage does not serve.
    WrongLayers,
    /// Malformed or inconsistent activations (wrong width, NaN, wrong position).
    BadActivations,
    /// Too busy or out of memory for another generation.
    Overloaded,
    /// The stage is leaving.
    Leaving,
    /// Anything else.
    Internal,
}

/// A stage's answer to a hop.
// `Done` is the common case and is built once per hop; boxing it would only add an allocation.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum HopResponse {
    /// The output activations, the signed record, and the trace whose root the record signs.
    Done {
        /// Output activations.
        activations: WireActivations,
        /// What the stage commits to.
        record: Signed<HopRecord>,
        /// The commitments of every product, in order (their root is `record.gemms`).
        trace: HopTrace,
    },
    /// Refused, with a reason.
    Refused {
        /// Category.
        kind: HopErrorKind,
        /// Human-readable reason.
        message: String,
    },
}

/// A request to a stage outside the hop itself.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum StageRequest {
    /// Run a hop.
    Hop(HopRequest),
    /// The generation is over: drop its KV cache.
    End {
        /// The generation.
        generation: GenerationId,
    },
    /// Re-run layers over a whole input history (fresh caches) and return the trace of the
    /// positions from `from` on: an audit of another stage's hop.
    Audit(AuditRequest),
    /// Send the full fraud proof with this id (announced by gossip).
    GetProof {
        /// The proof's id.
        id: Commitment,
    },
    /// Reveal rows of a hop this stage just served, for a spot check of its products.
    Reveal(RevealRequest),
    /// Reveal this stage's KV cache rows of a generation (every layer it runs), for an audit
    /// that starts from them instead of replaying.
    CacheRows(CacheRowsRequest),
    /// Reveal rows of several hops this stage served (at most [`MAX_REVEAL_HOPS`], each still
    /// kept), one answer per hop in order: a head asks for its spot checks of a stage's
    /// consecutive hops in one exchange rather than one per hop.
    RevealHops(Vec<RevealRequest>),
    /// Send the manifest of this model (see `dc_model::manifest`): a daemon that knows only
    /// the model id fetches it to learn the model's files.
    Manifest {
        /// The model asked for.
        model_id: ModelId,
    },
    /// Send bytes of one piece of the model's files (at most [`MAX_PIECE_CHUNK`]).
    Piece(PieceRequest),
}

/// Most bytes of a piece one answer carries.
pub const MAX_PIECE_CHUNK: u32 = 1 << 20;

/// Bytes `offset..offset + len` of piece `piece` of a model's manifest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PieceRequest {
    /// The model.
    pub model_id: ModelId,
    /// Index into the manifest's pieces.
    pub piece: u32,
    /// First byte, from the piece's start.
    pub offset: u64,
    /// Bytes asked for (at most [`MAX_PIECE_CHUNK`]).
    pub len: u32,
}

/// The KV cache rows of positions `from..end` of every layer a stage runs for `generation`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheRowsRequest {
    /// The generation.
    pub generation: GenerationId,
    /// The first position wanted.
    pub from: u32,
    /// One past the last position wanted.
    pub end: u32,
}

/// Cache rows of positions `from..` for every layer of a stage, one entry per layer, each the
/// rows' canonical encodings concatenated.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheRows {
    /// The first position.
    pub from: u32,
    /// Per layer, the rows.
    pub rows: Vec<Vec<u8>>,
}

/// Most (layer, position) picks one reveal request may ask for.
pub const MAX_REVEAL_PICKS: usize = 256;

/// Most consecutive rows one pick may ask for (`RevealPick::positions`): 64 rows of a full check
/// of a Llama-2-7B-sized layer are about 14 MB, within half the default message limit with the
/// hop's activations and cache rows, and bound what one pick makes a stage assemble.
pub const MAX_REVEAL_ROWS: usize = 64;

/// Most hops one [`StageRequest::RevealHops`] may ask about: a stage keeps its last this many
/// hops of each generation for reveals.
pub const MAX_REVEAL_HOPS: usize = 4;

/// A spot check's request: for each pick, the rows at `position` of the products of `layer`
/// in hop `step` of `generation` that the pick's checks need.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RevealRequest {
    /// The generation.
    pub generation: GenerationId,
    /// The hop's step (as in its signed record).
    pub step: u64,
    /// What to reveal.
    pub picks: Vec<RevealPick>,
}

/// One layer to reveal at one or more consecutive positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevealPick {
    /// The layer.
    pub layer: u32,
    /// The absolute position (a row of the hop): the first one revealed.
    pub position: u32,
    /// How many consecutive rows from `position` (1 for a decode hop; a prefill hop's drawn
    /// parts are checked at every row, so a lie in one row is caught like a lie in a decode
    /// hop).
    pub positions: u32,
    /// The first position whose cache rows to reveal (the checker holds the earlier ones,
    /// verified by an earlier check); at most the hop's first position. Only used when
    /// `checks` recomputes the attention.
    pub cache_from: u32,
    /// The parts of the layer the head will test: the stage reveals what they need.
    pub checks: crate::trace::CheckSet,
}

/// What a stage reveals of one layer at one position of a hop: the activations entering the
/// layer and leaving it (every row of the hop, as committed), the row of each product at that
/// position with its Merkle path, and the layer's KV cache up to the end of the hop (so the
/// checker can recompute the row's attention).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerReveal {
    /// The layer.
    pub layer: u32,
    /// The position.
    pub position: u32,
    /// The activations entering the layer (the hop's committed rows).
    pub input: WireActivations,
    /// The activations leaving it (the next layer's input, or the hop's output).
    pub next: WireActivations,
    /// The row of each product the pick's checks need, in computation order. The attention
    /// products' rows carry no encoding (the checker recomputes them), only their root and
    /// path — except the context row when the output projection is tested without
    /// recomputing the attention (its quantised bytes are that product's input).
    pub rows: Vec<RevealedRow>,
    /// The layer's KV cache rows of positions `cache_from..` the end of the hop, each in its
    /// canonical encoding (`dc_model::LayerCache::encode_row`), committed hop by hop as
    /// `KvCache`; empty unless the checks recompute the attention. (Bytes on the wire as one
    /// block, not byte by byte: the same bincode bytes, copied instead of visited.)
    #[serde(with = "serde_bytes")]
    pub cache: Vec<u8>,
}

impl LayerReveal {
    /// Bytes of what it carries: activations, cache rows, row encodings and Merkle hashes (the
    /// measure a stage's reveal limit and a head's byte count use).
    pub fn payload_bytes(&self) -> usize {
        (self.input.data.len() + self.next.data.len()) * 4
            + self.cache.len()
            + self
                .rows
                .iter()
                .map(|x| x.encoding.len() + 32 * (x.path.len() + 1))
                .sum::<usize>()
    }
}

/// One row of one committed product.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RevealedRow {
    /// Which product.
    pub point: crate::trace::Point,
    /// Values in the row.
    pub cols: u32,
    /// A weight product's row in units form: the row's unit exponent, `encoding` then holding
    /// each value's `i64` sum (8 bytes, little-endian), column `c` worth `sum · 2^(unit +
    /// u_c)` with `u_c` the smallest block exponent of the weights' column `c`, which the
    /// checker takes from its own copy (`dc_kernels::verify::reveal::row_for_reveal`). `None` for the
    /// other encodings.
    pub unit: Option<i32>,
    /// A weight product's row: its exact accumulators, in units form (`unit`) or, when a value
    /// has no `i64` sum in the row's units, in canonical encoding (NUMERICS.md §5); its leaf
    /// hashes their f32 roundings. The attention context's and the MLP's hidden row: the row
    /// quantised as the next product takes it (`QuantizedRows::encode_row`). As one block of
    /// bytes like `cache`.
    #[serde(with = "serde_bytes")]
    pub encoding: Vec<u8>,
    /// The Merkle root of the product's rows.
    pub root: Commitment,
    /// The row's Merkle path.
    pub path: Vec<Commitment>,
}

/// An audit: the inputs the audited stage received for this generation, in its hops, ending
/// with the audited hop. The auditor replays them into the cache it keeps for `session`: from
/// scratch when the first hop starts at position 0, otherwise continuing the positions it
/// already holds (a head auditing one stage several times sends each input once).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AuditRequest {
    /// The model.
    pub model_id: ModelId,
    /// The layers to run.
    pub layers: LayerRange,
    /// The audited hop's first position.
    pub from: u32,
    /// The auditor's cache for this (generation, stage): a secret of the head's choosing.
    pub session: GenerationId,
    /// Each hop's input, in order (contiguous positions), ending with the audited hop.
    pub hops: Vec<WireActivations>,
    /// `None` for a replay. Otherwise the audited stage's committed KV cache rows (checked by
    /// the head against the stage's commitments) of the positions after those the session's
    /// cache holds (from 0: a fresh cache) up to `from`: the auditor appends them and runs
    /// only the audited hop, the one entry of `hops`.
    pub cache: Option<CacheRows>,
}

/// A stage's answer to a [`StageRequest`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum StageResponse {
    /// Answer to a hop (boxed: it carries the activations).
    Hop(Box<HopResponse>),
    /// Acknowledged.
    Ack,
    /// The auditor's trace of the audited positions, or why it could not run them.
    Audit(Result<HopTrace, String>),
    /// The requested proof, if this peer has it.
    Proof(Box<Option<FraudProof>>),
    /// The revealed rows, or why they cannot be.
    Reveal(Result<Vec<LayerReveal>, String>),
    /// The cache rows, one entry per layer, or why they cannot be revealed.
    CacheRows(Result<Vec<Vec<u8>>, String>),
    /// Per hop asked about, in order, its revealed rows or why they cannot be; or why the
    /// request as a whole is refused.
    RevealHops(Result<Vec<Result<Vec<LayerReveal>, String>>, String>),
    /// The encoded manifest, or why this peer cannot send it.
    Manifest(Result<Vec<u8>, String>),
    /// The piece's bytes asked for, or why this peer cannot send them (it does not hold the
    /// piece, or the request is out of range).
    Piece(Result<Vec<u8>, String>),
}

/// What makes a fraud proof.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ProofKind {
    /// The accused's signed record contradicts its own trace (or the trace is malformed):
    /// checkable without any weights.
    Inconsistent,
    /// Re-running one layer from inputs the accused committed to gives commitments other than
    /// the ones it signed.
    Recompute {
        /// The layer to re-run.
        layer: u32,
    },
}

/// Self-contained evidence that a peer signed a wrong statement. Anyone with the model's
/// weights checks it by re-running at most one layer; nobody is excluded on less.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FraudProof {
    /// The model.
    pub model_id: ModelId,
    /// The accused (base58 peer id); every record must be signed by it.
    pub accused: String,
    /// What kind of proof.
    pub kind: ProofKind,
    /// The accused's signed records for one generation and layer range, steps in order from
    /// the first; the last one is disputed.
    pub records: Vec<Signed<HopRecord>>,
    /// The traces those records sign (same order).
    pub traces: Vec<HopTrace>,
    /// For `Recompute`: the activations entering the disputed layer in each of those hops,
    /// each equal to what the accused committed for it.
    pub layer_inputs: Vec<WireActivations>,
}

/// Messages on the gossip topic.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Gossip {
    /// A daemon's announcement.
    Announcement(Announcement),
    /// A fraud proof exists: fetch it from the sender with `GetProof`, check it, exclude.
    Proof {
        /// Its id.
        id: Commitment,
        /// Who it accuses.
        accused: String,
    },
}

/// How much of a generation is checked by a second peer.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum VerifyMode {
    /// Random audits: each remote hop with this probability.
    Sampled(f32),
    /// Every hop re-run by a second peer before its token is released.
    All,
}

/// Sampling settings on the wire.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WireSampling {
    /// 0: greedy.
    pub temperature: f32,
    /// Top-k (0: off).
    pub top_k: u32,
    /// Top-p (1: off).
    pub top_p: f32,
    /// Min-p (0: off).
    pub min_p: f32,
    /// Repetition penalty over the prompt and the new tokens (1: off).
    pub repetition_penalty: f32,
    /// Presence penalty over the new tokens (0: off).
    pub presence_penalty: f32,
    /// Frequency penalty over the new tokens (0: off).
    pub frequency_penalty: f32,
    /// Seed of the per-position draws.
    pub seed: u64,
}

/// What the new text must be.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum OutputFormat {
    /// Any text.
    #[default]
    Text,
    /// One JSON object.
    JsonObject,
    /// One JSON document that validates against this JSON schema (its text, at most
    /// [`MAX_SCHEMA_BYTES`]; the head compiles it, and refuses what it cannot enforce).
    JsonSchema(String),
}

/// Longest JSON schema a generation request may carry.
pub const MAX_SCHEMA_BYTES: usize = 64 * 1024;

/// Whether the head guesses tokens ahead.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Speculation {
    /// One token per pass.
    Off,
    /// Guesses copied from earlier in the prompt or the output (prompt lookup).
    #[default]
    PromptLookup,
}

impl std::str::FromStr for Speculation {
    type Err = String;

    fn from_str(s: &str) -> Result<Speculation, String> {
        match s {
            "off" => Ok(Speculation::Off),
            "prompt-lookup" => Ok(Speculation::PromptLookup),
            other => Err(format!(
                "unknown speculation {other:?}: expected off or prompt-lookup"
            )),
        }
    }
}

impl std::fmt::Display for Speculation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Speculation::Off => "off",
            Speculation::PromptLookup => "prompt-lookup",
        })
    }
}

/// A generation request, as the receiving daemon forwards it to the elected head.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GenerationRequest {
    /// The model.
    pub model_id: ModelId,
    /// The generation's id (also the input of the head election).
    pub generation: GenerationId,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Upper bound on new tokens.
    pub max_new_tokens: u32,
    /// Sampling.
    pub sampling: WireSampling,
    /// Tokens that end the generation.
    pub stop_tokens: Vec<u32>,
    /// Prefill chunk size.
    pub chunk: u32,
    /// How much is verified.
    pub verify: VerifyMode,
    /// With each new token, its log-probability and those of this many most likely tokens
    /// (none: no log-probabilities; at most [`MAX_TOP_LOGPROBS`]).
    pub top_logprobs: Option<u8>,
    /// Free text, or JSON constrained at the head (which needs the model's tokenizer).
    pub output: OutputFormat,
    /// Whether the head guesses tokens ahead and checks each guess in the same lap (the tokens
    /// are the same either way).
    pub speculative: Speculation,
    /// The new tokens the client already holds (empty for a new generation): the next head
    /// takes a generation over from here when its head dies. The head re-derives them before
    /// it streams anything new, and corrects the client if they are not what it computes.
    pub resume: Vec<u32>,
}

/// One stage of a route: a peer (libp2p id, base58) and the layers it runs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteHop {
    /// The peer.
    pub peer: String,
    /// Its layers in this generation.
    pub layers: LayerRange,
}

/// Most alternatives a generation may ask log-probabilities of, per token (OpenAI's bound).
pub const MAX_TOP_LOGPROBS: u8 = 20;

/// The log-probabilities at one new token: natural logarithms of the softmax of the model's
/// own logits at that position (before temperature, truncation and penalties).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprobs {
    /// The chosen token's.
    pub logprob: f32,
    /// The most likely tokens and theirs, most likely first (ties: the lower id first).
    pub top: Vec<(u32, f32)>,
}

/// What the head streams back for a generation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum GenerationEvent {
    /// The head accepted and chose a route.
    Started {
        /// The head (base58 peer id).
        head: String,
        /// The stages, in order.
        route: Vec<RouteHop>,
    },
    /// A new token.
    Token {
        /// Index among the new tokens.
        index: u32,
        /// Token id.
        id: u32,
        /// Its log-probabilities, when the request asked for them.
        logprobs: Option<TokenLogprobs>,
    },
    /// The generation ended.
    Done {
        /// All new tokens.
        tokens: Vec<u32>,
        /// Why it ended: "stop", "length" or "context".
        stop: String,
        /// blake3 of the final logits (little-endian f32), to compare runs bit for bit.
        final_logits: Commitment,
    },
    /// A peer was proven to have lied; the generation was recomputed without it and tokens
    /// already sent changed from index `from` on. The stream goes on from the corrected
    /// tokens.
    Corrected {
        /// First changed index.
        from: u32,
        /// The corrected tokens from `from` on (the new sequence so far).
        tokens: Vec<u32>,
        /// Their log-probabilities, one per token, when the request asked for them (else
        /// empty).
        logprobs: Vec<TokenLogprobs>,
        /// The proven liar.
        liar: String,
    },
    /// The generation failed.
    Failed {
        /// Why.
        message: String,
    },
}
