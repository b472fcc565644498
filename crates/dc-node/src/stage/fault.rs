//! Test-only misbehaviour (compiled with the `fault-injection` feature): a daemon that corrupts
//! a fraction of its hops in one of the ways below. The lies sign records consistent with
//! themselves, so the only way to catch them is a check; the last kinds break the protocol in
//! ways no proof can show, or leave, and the head must go on without them.
//!
//! - `flip-bit`: one bit of one output value.
//! - `prompt`: one bit of one output value of the last row of a prefill hop (a hop of more
//!   than one row), kept and revealed as signed; every one-row hop honest. Only a check that
//!   recomputes that row's output sees it.
//! - `skip-layer`: the last layer of the hop is not run (its commitments are made up).
//! - `other-weights`: the products are computed on other values than the committed input, as a
//!   stage with other weights would.
//! - `stale`: returns the output of an earlier hop of the same generation.
//! - `hide`: flips a bit like `flip-bit` and refuses every reveal and cache-row request, so
//!   spot checks and audits from cache rows cannot run; the head must fall back to replaying.
//! - `attention`: the last layer's attention reads a key and a value of the previous position
//!   other than the ones the stage committed (and keeps in its cache), and everything after it
//!   is computed honestly from there: every weight product is consistent with its input, so
//!   only a check that recomputes the attention sees the lie.
//! - `chain`: computes honestly but signs records off the generation's chain of inputs
//!   (`HopRecord::previous`), so that no proof could ever include them: the head must not use
//!   them (and cannot prove anything by them either).
//! - `trace`: computes and signs honestly but sends a trace other than the one it signed, which
//!   the head cannot use and cannot hold against it.
//! - `leave`: quits abruptly at a one-row hop (as a volunteer's machine switching off in the
//!   middle of a generation), so the head must go on without it.
//! - `flip-leave`: flips a bit like `flip-bit` on its prefill hops, then leaves like `leave`:
//!   the peer taking its layers over replays other outputs than the ones it signed.
//! - `corrupt-pieces`: computes honestly, but flips a byte of every piece of the model's files
//!   it sends to a peer fetching them, which must notice and fetch from another peer.
//!
//! A lying daemon also announces a far larger throughput than it measured, as a real liar
//! wanting traffic would, so that heads route through it.
//!
//! The faults wrap the stage from outside: [`Lying`] is the stage's [`HopRunner`] when a fault
//! is configured at start, and the honest path knows nothing of it.

use std::collections::HashMap;
use std::sync::Mutex;

use dc_kernels::{Commitment, Domain};
use dc_model::attention::LayerCache;
use dc_model::{Activations, KeptHop, KvCache, Model};
use dc_types::{GenerationId, HopTrace, Point};

use dc_kernels::Gemm;

use super::runner::{HopId, HopRunner};

/// How to lie.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// Flip one bit of one output.
    FlipBit,
    /// Flip one bit of the last row's output of a prefill hop.
    Prompt,
    /// Skip the last layer.
    SkipLayer,
    /// Compute with other weights.
    OtherWeights,
    /// Replay an earlier output.
    Stale,
    /// Attend over a cache other than the committed one.
    Attention,
    /// Flip a bit and refuse to reveal anything.
    Hide,
    /// Sign records off the chain of inputs.
    Chain,
    /// Send a trace other than the signed one.
    Trace,
    /// Quit in the middle of a generation.
    Leave,
    /// Lie on the prefill, then quit.
    FlipLeave,
    /// Send corrupt pieces of the model's files.
    CorruptPieces,
}

/// A configured fault.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fault {
    /// How.
    pub kind: FaultKind,
    /// On what fraction of hops.
    pub fraction: f32,
}

impl std::str::FromStr for Fault {
    type Err = String;

    fn from_str(s: &str) -> Result<Fault, String> {
        let (k, f) = s.split_once(':').unwrap_or((s, "1"));
        let kind = match k {
            "flip-bit" => FaultKind::FlipBit,
            "prompt" => FaultKind::Prompt,
            "skip-layer" => FaultKind::SkipLayer,
            "other-weights" => FaultKind::OtherWeights,
            "stale" => FaultKind::Stale,
            "attention" => FaultKind::Attention,
            "hide" => FaultKind::Hide,
            "chain" => FaultKind::Chain,
            "trace" => FaultKind::Trace,
            "leave" => FaultKind::Leave,
            "flip-leave" => FaultKind::FlipLeave,
            "corrupt-pieces" => FaultKind::CorruptPieces,
            _ => {
                return Err(format!(
                    "fault {k:?}: expected flip-bit, prompt, skip-layer, other-weights, \
                     stale, attention, hide, chain, trace, leave, flip-leave or corrupt-pieces"
                ))
            }
        };
        let fraction: f32 = f
            .parse()
            .map_err(|_| format!("fault fraction {f:?} is not a number"))?;
        if !(0.0..=1.0).contains(&fraction) {
            return Err(format!("fault fraction {fraction} must be between 0 and 1"));
        }
        Ok(Fault { kind, fraction })
    }
}

static CONFIGURED: std::sync::OnceLock<Option<Fault>> = std::sync::OnceLock::new();

/// Sets the fault (`dcd join --fault`) before the daemon serves anything; `false` if it was
/// already fixed.
pub fn set(f: Fault) -> bool {
    CONFIGURED.set(Some(f)).is_ok()
}

/// The fault set by [`set`], else the one in `DCD_FAULT` (read once).
pub fn configured() -> Option<Fault> {
    *CONFIGURED.get_or_init(|| std::env::var("DCD_FAULT").ok().and_then(|s| s.parse().ok()))
}

/// The runner of a daemon configured to lie (see the module's list of faults).
#[derive(Debug)]
pub struct Lying {
    fault: Fault,
}

/// The lying runner, if a fault of the hops is configured.
pub fn chosen() -> Option<Lying> {
    configured()
        .filter(|f| f.kind != FaultKind::CorruptPieces)
        .map(|fault| Lying { fault })
}

/// Whether this daemon corrupts the pieces it sends (`corrupt-pieces`).
pub fn corrupts_pieces() -> bool {
    configured().is_some_and(|f| f.kind == FaultKind::CorruptPieces)
}

impl HopRunner for Lying {
    fn run(
        &self,
        model: &Model,
        gemm: &Gemm,
        x: Activations,
        cache: &mut KvCache,
        trace: &mut HopTrace,
        hop: HopId,
    ) -> dc_model::Result<(Activations, KeptHop)> {
        run(self.fault, model, gemm, x, cache, trace, hop)
    }

    /// `previous`, unless this daemon breaks the chain (`chain`) on this hop.
    fn previous(&self, previous: Commitment, hop: HopId) -> Commitment {
        let (f, g, step) = (self.fault, &hop.generation, hop.step);
        if f.kind == FaultKind::Chain && coin(g, step, 1) < f.fraction as f64 {
            tracing::info!("fault: signing step {step} of generation {g} off the chain");
            return Commitment(Domain::HopRecord.hash(&previous.0).0);
        }
        previous
    }

    /// `trace`, unless this daemon sends another one (`trace`) on this hop: one product's
    /// commitment changed after signing.
    fn sent_trace(&self, mut trace: HopTrace, hop: HopId) -> HopTrace {
        let (f, g, step) = (self.fault, &hop.generation, hop.step);
        if f.kind == FaultKind::Trace && coin(g, step, 1) < f.fraction as f64 {
            tracing::info!("fault: sending step {step} of generation {g} with another trace");
            if let Some(e) = trace
                .entries
                .iter_mut()
                .find(|e| e.point != Point::Input && e.point != Point::Output)
            {
                e.commitment = Commitment(Domain::HopRecord.hash(&e.commitment.0).0);
            }
        }
        trace
    }

    /// Refuses every reveal under `hide`.
    fn reveals(&self) -> bool {
        self.fault.kind != FaultKind::Hide
    }

    fn announced_throughput(&self, measured: f32) -> f32 {
        measured * 1000.0 + 1e6
    }
}

fn last_outputs() -> &'static Mutex<HashMap<GenerationId, Activations>> {
    static M: std::sync::OnceLock<Mutex<HashMap<GenerationId, Activations>>> =
        std::sync::OnceLock::new();
    M.get_or_init(|| Mutex::new(HashMap::new()))
}

fn coin(g: &GenerationId, step: u64, salt: u8) -> f64 {
    let mut h = blake3::Hasher::new();
    h.update(&g.0);
    h.update(&step.to_le_bytes());
    h.update(&[salt]);
    let x = u64::from_le_bytes(h.finalize().as_bytes()[..8].try_into().unwrap_or([0; 8]));
    (x >> 11) as f64 / (1u64 << 53) as f64
}

fn set_output(trace: &mut HopTrace, y: &Activations) {
    let c = y.rows_from(trace.from).commitment();
    if let Some(e) = trace
        .entries
        .iter_mut()
        .rev()
        .find(|e| e.point == Point::Output)
    {
        e.commitment = c;
    }
}

/// Runs a hop, lying as `f` says on its fraction of hops. What it keeps for reveals is what it
/// honestly computed (a liar's reveals then disagree with its commitments or with the
/// checker's recomputation).
fn run(
    f: Fault,
    model: &Model,
    gemm: &Gemm,
    x: Activations,
    cache: &mut KvCache,
    trace: &mut HopTrace,
    hop: HopId,
) -> dc_model::Result<(Activations, KeptHop)> {
    let (g, step) = (hop.generation, hop.step);
    let honest_hop = (f.kind == FaultKind::Prompt && x.rows() == 1)
        || (f.kind == FaultKind::Leave && x.rows() > 1);
    if honest_hop || coin(&g, step, 1) >= f.fraction as f64 {
        let (y, kept) = model.run_layers_kept(gemm, x, cache, trace)?;
        last_outputs()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(g, y.clone());
        return Ok((y, kept));
    }
    tracing::info!(
        "fault: lying ({:?}) on step {step} of generation {g}",
        f.kind
    );
    let (y, kept) = lie(f, model, gemm, x, cache, trace, hop)?;
    last_outputs()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(g, y.clone());
    Ok((y, kept))
}

/// Computes hop `step` of `g` the way `f` lies.
fn lie(
    f: Fault,
    model: &Model,
    gemm: &Gemm,
    x: Activations,
    cache: &mut KvCache,
    trace: &mut HopTrace,
    hop: HopId,
) -> dc_model::Result<(Activations, KeptHop)> {
    let (g, step) = (hop.generation, hop.step);
    let kept;
    let layers = cache.layers();
    let y =
        match f.kind {
            FaultKind::Leave => leave(&g, step),
            FaultKind::FlipLeave if x.rows() == 1 => leave(&g, step),
            FaultKind::FlipBit | FaultKind::Hide | FaultKind::FlipLeave => {
                let (mut y, k) = model.run_layers_kept(gemm, x, cache, trace)?;
                kept = k;
                let i = (coin(&g, step, 2) * y.data.len() as f64) as usize % y.data.len().max(1);
                y.data[i] = f32::from_bits(y.data[i].to_bits() ^ (1 << 12));
                set_output(trace, &y);
                y
            }
            // Their lie is in the record they sign ([`previous`]), the trace they send
            // ([`sent_trace`]) or the pieces they send, not in what they compute.
            FaultKind::Chain | FaultKind::Trace | FaultKind::CorruptPieces => {
                let (y, k) = model.run_layers_kept(gemm, x, cache, trace)?;
                kept = k;
                y
            }
            FaultKind::Prompt => {
                let (mut y, mut k) = model.run_layers_kept(gemm, x, cache, trace)?;
                let last = (y.rows() - 1) * y.hidden;
                let i = last + (coin(&g, step, 2) * y.hidden as f64) as usize % y.hidden.max(1);
                y.data[i] = f32::from_bits(y.data[i].to_bits() ^ (1 << 12));
                set_output(trace, &y);
                // Revealed as signed: only a check of the last row recomputes it otherwise.
                k.set_output(y.clone());
                kept = k;
                y
            }
            FaultKind::SkipLayer => {
                let skipped = match cache.sub(layers.start..layers.end - 1) {
                    Some(mut c) => model.run_layers(gemm, x.clone(), &mut c)?,
                    None => x.clone(),
                };
                kept = model.run_layers_kept(gemm, x, cache, trace)?.1;
                // Made-up commitments for the layer it did not run.
                let last = (layers.end - 1) as u32;
                for e in trace.entries.iter_mut().filter(|e| {
                    e.layer == last && e.point != Point::Input && e.point != Point::Output
                }) {
                    e.commitment = Commitment(Domain::HopRecord.hash(&e.commitment.0).0);
                }
                set_output(trace, &skipped);
                skipped
            }
            FaultKind::OtherWeights => {
                let honest_input = x.rows_from(trace.from).commitment();
                let mut x2 = x;
                for v in x2.data.iter_mut().step_by(7) {
                    *v *= 1.01;
                }
                let (y, k) = model.run_layers_kept(gemm, x2, cache, trace)?;
                kept = k;
                if let Some(e) = trace.entries.iter_mut().find(|e| e.point == Point::Input) {
                    e.commitment = honest_input;
                }
                y
            }
            FaultKind::Attention => {
                let layer = layers.end - 1;
                let honest = tamper(model, cache, layer);
                let (y, k) = model.run_layers_kept(gemm, x, cache, trace)?;
                kept = k;
                if let Some(honest) = honest {
                    restore(model, cache, layer, honest)?;
                }
                y
            }
            FaultKind::Stale => {
                let (honest, k) = model.run_layers_kept(gemm, x, cache, trace)?;
                kept = k;
                let prev = last_outputs()
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(&g)
                    .cloned();
                match prev {
                    Some(p) if p.data.len() == honest.data.len() => {
                        let y = Activations {
                            start: honest.start,
                            hidden: honest.hidden,
                            data: p.data,
                        };
                        set_output(trace, &y);
                        y
                    }
                    _ => honest,
                }
            }
        };
    Ok((y, kept))
}

/// Quits the process at once, as a machine switching off would (exit code 3).
fn leave(g: &GenerationId, step: u64) -> ! {
    tracing::warn!("fault: leaving at step {step} of generation {g}");
    std::process::exit(3)
}

/// Swaps `layer`'s cache for one whose first key and first value of the last position held
/// are changed; returns the honest one (none when the cache is empty: nothing to lie about).
fn tamper(model: &Model, cache: &mut KvCache, layer: usize) -> Option<LayerCache> {
    let c = cache.layer(layer)?;
    let n = c.len();
    if n == 0 {
        return None;
    }
    let (rb, hb) = (c.row_bytes(), model.config.head_dim.div_ceil(32));
    let mut bytes = c.encode_rows(0..n);
    for offset in [0, hb * 35] {
        let b = &mut bytes[(n - 1) * rb + offset];
        *b = if (*b as i8) < 100 { *b + 20 } else { *b - 20 };
    }
    let cfg = &model.config;
    let lying = LayerCache::from_encoded(cfg.num_kv_heads, cfg.head_dim, &bytes).ok()?;
    Some(std::mem::replace(cache.layer_mut(layer)?, lying))
}

/// Puts the honest cache of `layer` back, with the rows the hop added (honest: they come from
/// the layer's input, which the lie did not touch).
fn restore(
    model: &Model,
    cache: &mut KvCache,
    layer: usize,
    honest: LayerCache,
) -> dc_model::Result<()> {
    let Some(c) = cache.layer_mut(layer) else {
        return Ok(());
    };
    let mut bytes = honest.encode_rows(0..honest.len());
    bytes.extend_from_slice(&c.encode_rows(honest.len()..c.len()));
    let cfg = &model.config;
    *c = LayerCache::from_encoded(cfg.num_kv_heads, cfg.head_dim, &bytes)?;
    Ok(())
}
