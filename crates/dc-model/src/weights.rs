//! The weights of one architecture, loaded from a [`TensorSource`] by their Hugging Face names
//! and quantised once into the kernel layout. Only the layers a stage serves (and the head
//! weights, if it holds them) are ever read.
//!
//! With a [`WeightCache`], packings come from the cache when it holds them (the source tensor is
//! then not read at all) and are stored in it otherwise.
//!
//! The file mirrors the checkpoints it reads: GPT-2's fused `c_attn` stored `[in, out]` is cut
//! into q, k and v here; Llama-family projections are stored `[out, in]`.

use std::borrow::Cow;
use std::ops::Range;

use dc_kernels::verify::commit::LeafBatch;
use dc_kernels::{Accumulators, Gemm, PackedWeights, QuantizedRows, WeightLayout};
use dc_types::Point;

use crate::config::{Arch, ModelConfig};
use crate::error::{ModelError, Result};
use crate::row_table::RowTable;
use crate::source::TensorSource;
use crate::weight_cache::{packed, WeightCache};

/// A linear layer `y = x · W + b`.
#[derive(Clone, Debug)]
pub struct Linear {
    /// Quantised weights, `k × n`.
    pub w: PackedWeights,
    /// Bias, `n`.
    pub bias: Option<Vec<f32>>,
}

impl Linear {
    /// `out = x · W (+ b)`, row-major `x.rows() × n`; the bias is added in f32 after the single
    /// rounding of the exact product.
    pub fn forward(&self, gemm: &Gemm, x: &QuantizedRows, out: &mut Vec<f32>) -> Result<()> {
        self.forward_queued(gemm, x, out, None, false).map(|_| ())
    }

    /// [`Linear::forward`], also queueing the product's committed rows (its outputs before the
    /// bias, from `(first row's position, first committed position)`) in the batch when
    /// committing, and handing back the exact accumulators when `keep` (a stage keeps them to
    /// reveal rows later, also of a product whose rows commit only through what is computed
    /// from them). Only keeping needs the exact kernel: a commitment alone hashes what the
    /// plain product wrote. A stage queues everything a layer commits and hashes it together
    /// (see [`LeafBatch`]).
    pub fn forward_queued(
        &self,
        gemm: &Gemm,
        x: &QuantizedRows,
        out: &mut Vec<f32>,
        commit: Option<((usize, usize), &mut LeafBatch)>,
        keep: bool,
    ) -> Result<Option<Accumulators>> {
        let acc = self.product(gemm, x, out, keep)?;
        if let Some(((first, from), batch)) = commit {
            batch.queue(out, (x.rows(), self.w.n()), first, from);
        }
        add_bias(self.bias.as_deref(), out);
        Ok(acc)
    }

    /// `out = x · W`, the product alone (no bias: what a commitment covers), with the exact
    /// accumulators when `keep`.
    pub fn product(
        &self,
        gemm: &Gemm,
        x: &QuantizedRows,
        out: &mut Vec<f32>,
        keep: bool,
    ) -> Result<Option<Accumulators>> {
        out.clear();
        out.resize(x.rows() * self.w.n(), 0.0);
        Ok(match keep {
            true => Some(gemm.matmul_exact(x, &self.w, out)?),
            false => {
                gemm.matmul(x, &self.w, out)?;
                None
            }
        })
    }
}

/// A committed product's exact accumulators and the leaves of its committed rows, kept so a
/// row can be revealed later.
#[derive(Debug)]
pub struct KeptProduct {
    /// The exact accumulators.
    pub acc: Accumulators,
    /// The leaves of the committed rows (from the commitment's first position).
    pub leaves: RowLeaves,
}

/// The leaves of a kept product's committed rows, a one-row (decode) hop's inline.
///
/// Why: a stage keeps a few hops and then drops the oldest, whose memory has gone cold by then;
/// glibc's free of each small buffer in it is a cache miss or more, and a kept SmolLM2 hop had
/// some fifteen such buffers per layer, which together cost a visible share of keeping.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RowLeaves {
    /// One row's leaf.
    One(dc_kernels::Commitment),
    /// Any other number of rows' leaves.
    Many(Vec<dc_kernels::Commitment>),
}

impl Default for RowLeaves {
    fn default() -> RowLeaves {
        RowLeaves::Many(Vec::new())
    }
}

impl From<&[dc_kernels::Commitment]> for RowLeaves {
    fn from(leaves: &[dc_kernels::Commitment]) -> RowLeaves {
        match leaves {
            [one] => RowLeaves::One(*one),
            more => RowLeaves::Many(more.to_vec()),
        }
    }
}

impl std::ops::Deref for RowLeaves {
    type Target = [dc_kernels::Commitment];

    fn deref(&self) -> &[dc_kernels::Commitment] {
        match self {
            RowLeaves::One(leaf) => std::slice::from_ref(leaf),
            RowLeaves::Many(leaves) => leaves,
        }
    }
}

/// Adds `bias` (if any) to every row of `out`, in f32 after the product's single rounding.
pub fn add_bias(bias: Option<&[f32]>, out: &mut [f32]) {
    if let Some(b) = bias {
        for row in out.chunks_exact_mut(b.len()) {
            for (o, &bb) in row.iter_mut().zip(b) {
                *o += bb;
            }
        }
    }
}

/// A norm's parameters: LayerNorm when it has a bias (GPT-2), RMSNorm otherwise.
#[derive(Clone, Debug)]
pub struct Norm {
    /// Scale.
    pub weight: Vec<f32>,
    /// Shift (LayerNorm only).
    pub bias: Option<Vec<f32>>,
}

/// The feed-forward part of a block.
#[derive(Clone, Debug)]
pub enum Mlp {
    /// GPT-2: `proj(gelu_tanh(fc(x)))`.
    Gelu {
        /// `c_fc`.
        fc: Linear,
        /// `c_proj`.
        proj: Linear,
    },
    /// Llama family: `down(silu(gate(x)) · up(x))`.
    SwiGlu {
        /// `gate_proj`.
        gate: Linear,
        /// `up_proj`.
        up: Linear,
        /// `down_proj`.
        down: Linear,
    },
}

/// One transformer block.
#[derive(Clone, Debug)]
pub struct Layer {
    /// Norm before attention.
    pub attn_norm: Norm,
    /// Query projection.
    pub q: Linear,
    /// Key projection.
    pub k: Linear,
    /// Value projection.
    pub v: Linear,
    /// Output projection.
    pub o: Linear,
    /// Norm before the MLP.
    pub mlp_norm: Norm,
    /// The MLP.
    pub mlp: Mlp,
}

impl Layer {
    /// The weight product committed at `point`, if the layer has one there.
    pub fn linear(&self, point: Point) -> Option<&Linear> {
        match (point, &self.mlp) {
            (Point::Q, _) => Some(&self.q),
            (Point::K, _) => Some(&self.k),
            (Point::V, _) => Some(&self.v),
            (Point::O, _) => Some(&self.o),
            (Point::Fc, Mlp::Gelu { fc, .. }) => Some(fc),
            (Point::Down, Mlp::Gelu { proj, .. }) => Some(proj),
            (Point::Gate, Mlp::SwiGlu { gate, .. }) => Some(gate),
            (Point::Up, Mlp::SwiGlu { up, .. }) => Some(up),
            (Point::Down, Mlp::SwiGlu { down, .. }) => Some(down),
            _ => None,
        }
    }

    /// Bytes of packed weights one pass over the layer streams (every weight product once).
    pub fn packed_bytes(&self) -> usize {
        self.linear_points()
            .iter()
            .filter_map(|&p| self.linear(p))
            .map(|l| l.w.packed_bytes())
            .sum()
    }

    /// The weight products in computation order.
    pub fn linear_points(&self) -> &'static [Point] {
        match self.mlp {
            Mlp::Gelu { .. } => &[
                Point::Q,
                Point::K,
                Point::V,
                Point::O,
                Point::Fc,
                Point::Down,
            ],
            Mlp::SwiGlu { .. } => &[
                Point::Q,
                Point::K,
                Point::V,
                Point::O,
                Point::Gate,
                Point::Up,
                Point::Down,
            ],
        }
    }
}

/// The head weights: what the generation's head needs to embed and read out.
#[derive(Clone, Debug)]
pub struct Head {
    /// Token embeddings, `vocab × hidden`, as stored (converted a row per token).
    pub embed: RowTable,
    /// Learned position embeddings, `positions × hidden` (GPT-2).
    pub positions: Option<Vec<f32>>,
    /// Final norm.
    pub final_norm: Norm,
    /// Output projection, `hidden × vocab` (the embedding itself when tied).
    pub lm_head: PackedWeights,
}

/// Tensor names of one architecture.
struct Names {
    prefix: &'static str,
}

fn load(src: &dyn TensorSource, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
    check_shape(src, name, shape)?;
    let v = src.load_f32(name)?;
    check_finite(src, name, &v)?;
    Ok(v)
}

/// `Err` unless `src` holds tensor `name` of shape `shape`.
fn check_shape(src: &dyn TensorSource, name: &str, shape: &[usize]) -> Result<()> {
    let info = src.info(name).ok_or_else(|| ModelError::MissingTensor {
        name: name.into(),
        path: src.path().to_path_buf(),
    })?;
    if info.shape != shape {
        return Err(ModelError::Shape {
            name: name.into(),
            expected: shape.to_vec(),
            got: info.shape,
        });
    }
    Ok(())
}

/// `Err` naming tensor `name` of `src` and the element if `v` holds a non-finite value.
fn check_finite(src: &dyn TensorSource, name: &str, v: &[f32]) -> Result<()> {
    match v.iter().position(|x| !x.is_finite()) {
        None => Ok(()),
        Some(i) => Err(ModelError::format(
            src.path(),
            format!(
                "tensor {name} holds a non-finite value {} at element {i}",
                v[i]
            ),
        )),
    }
}

fn opt_load(src: &dyn TensorSource, name: &str, shape: &[usize]) -> Result<Option<Vec<f32>>> {
    if src.info(name).is_none() {
        return Ok(None);
    }
    load(src, name, shape).map(Some)
}

/// `[out, in]` linear (Hugging Face `nn.Linear`).
fn linear_nk(
    src: &dyn TensorSource,
    cache: Option<&WeightCache>,
    name: &str,
    k: usize,
    n: usize,
    bias: bool,
) -> Result<Linear> {
    let wname = format!("{name}.weight");
    let w = packed(cache, &wname, k, n, WeightLayout::NByK, || {
        load(src, &wname, &[n, k]).map(Cow::Owned)
    })?;
    let bias = if bias {
        Some(load(src, &format!("{name}.bias"), &[n])?)
    } else {
        opt_load(src, &format!("{name}.bias"), &[n])?
    };
    Ok(Linear { w, bias })
}

/// `[in, out]` linear (GPT-2 `Conv1D`) with its bias.
fn linear_kn(
    src: &dyn TensorSource,
    cache: Option<&WeightCache>,
    name: &str,
    k: usize,
    n: usize,
) -> Result<Linear> {
    let wname = format!("{name}.weight");
    let w = packed(cache, &wname, k, n, WeightLayout::KByN, || {
        load(src, &wname, &[k, n]).map(Cow::Owned)
    })?;
    let b = load(src, &format!("{name}.bias"), &[n])?;
    Ok(Linear { w, bias: Some(b) })
}

fn norm(src: &dyn TensorSource, name: &str, width: usize, with_bias: bool) -> Result<Norm> {
    Ok(Norm {
        weight: load(src, &format!("{name}.weight"), &[width])?,
        bias: if with_bias {
            Some(load(src, &format!("{name}.bias"), &[width])?)
        } else {
            None
        },
    })
}

impl Names {
    fn for_source(cfg: &ModelConfig, src: &dyn TensorSource) -> Names {
        let prefix = match cfg.arch {
            // GPT-2 checkpoints come with and without the `transformer.` prefix.
            Arch::Gpt2 if src.info("transformer.wte.weight").is_some() => "transformer.",
            Arch::Gpt2 => "",
            _ => "model.",
        };
        Names { prefix }
    }
}

/// Loads and quantises layer `i` (packings through `cache` when given).
pub fn load_layer(
    cfg: &ModelConfig,
    src: &dyn TensorSource,
    cache: Option<&WeightCache>,
    i: usize,
) -> Result<Layer> {
    let names = Names::for_source(cfg, src);
    let h = cfg.hidden_size;
    match cfg.arch {
        Arch::Gpt2 => {
            let p = format!("{}h.{i}", names.prefix);
            // The fused q/k/v matrix is read (once) only if one of its parts is not cached.
            let mut qkv: Option<Vec<f32>> = None;
            let qkv_b = load(src, &format!("{p}.attn.c_attn.bias"), &[3 * h])?;
            let mut part = |j: usize| -> Result<Linear> {
                let name = format!("{p}.attn.c_attn[{}]", ["q", "k", "v"][j]);
                let w = packed(cache, &name, h, h, WeightLayout::KByN, || {
                    if qkv.is_none() {
                        qkv = Some(load(src, &format!("{p}.attn.c_attn.weight"), &[h, 3 * h])?);
                    }
                    let all = qkv.as_deref().unwrap_or_default();
                    let mut w = Vec::with_capacity(h * h);
                    for row in all.chunks_exact(3 * h) {
                        w.extend_from_slice(&row[j * h..(j + 1) * h]);
                    }
                    Ok(Cow::Owned(w))
                })?;
                Ok(Linear {
                    w,
                    bias: Some(qkv_b[j * h..(j + 1) * h].to_vec()),
                })
            };
            let (q, k, v) = (part(0)?, part(1)?, part(2)?);
            let ff = cfg.intermediate_size;
            Ok(Layer {
                attn_norm: norm(src, &format!("{p}.ln_1"), h, true)?,
                q,
                k,
                v,
                o: linear_kn(src, cache, &format!("{p}.attn.c_proj"), h, h)?,
                mlp_norm: norm(src, &format!("{p}.ln_2"), h, true)?,
                mlp: Mlp::Gelu {
                    fc: linear_kn(src, cache, &format!("{p}.mlp.c_fc"), h, ff)?,
                    proj: linear_kn(src, cache, &format!("{p}.mlp.c_proj"), ff, h)?,
                },
            })
        }
        Arch::Llama | Arch::Qwen2 | Arch::Mistral => {
            let p = format!("{}layers.{i}", names.prefix);
            let (qw, kvw, ff) = (cfg.q_width(), cfg.kv_width(), cfg.intermediate_size);
            Ok(Layer {
                attn_norm: norm(src, &format!("{p}.input_layernorm"), h, false)?,
                q: linear_nk(
                    src,
                    cache,
                    &format!("{p}.self_attn.q_proj"),
                    h,
                    qw,
                    cfg.qkv_bias,
                )?,
                k: linear_nk(
                    src,
                    cache,
                    &format!("{p}.self_attn.k_proj"),
                    h,
                    kvw,
                    cfg.qkv_bias,
                )?,
                v: linear_nk(
                    src,
                    cache,
                    &format!("{p}.self_attn.v_proj"),
                    h,
                    kvw,
                    cfg.qkv_bias,
                )?,
                o: linear_nk(src, cache, &format!("{p}.self_attn.o_proj"), qw, h, false)?,
                mlp_norm: norm(src, &format!("{p}.post_attention_layernorm"), h, false)?,
                mlp: Mlp::SwiGlu {
                    gate: linear_nk(src, cache, &format!("{p}.mlp.gate_proj"), h, ff, false)?,
                    up: linear_nk(src, cache, &format!("{p}.mlp.up_proj"), h, ff, false)?,
                    down: linear_nk(src, cache, &format!("{p}.mlp.down_proj"), ff, h, false)?,
                },
            })
        }
    }
}

/// Loads the `[rows, cols]` table `name`, kept as stored to convert a row at a time.
fn table(src: &dyn TensorSource, name: &str, shape: [usize; 2]) -> Result<RowTable> {
    check_shape(src, name, &shape)?;
    let table = src.load_row_table(name)?;
    // A table kept as stored is checked a row at a time as it is read (`Model::embed`).
    if let Some(values) = table.as_f32() {
        check_finite(src, name, values)?;
    }
    Ok(table)
}

/// The whole of table `name` as f32 (to pack a tied output projection): `table` itself when
/// it is held as f32, else read again.
fn table_f32<'t>(
    src: &dyn TensorSource,
    name: &str,
    table: &'t RowTable,
) -> Result<Cow<'t, [f32]>> {
    match table.as_f32() {
        Some(values) => Ok(Cow::Borrowed(values)),
        None => load(src, name, &[table.rows(), table.cols()]).map(Cow::Owned),
    }
}

/// Loads the head weights: embeddings, final norm and output projection (its packing through
/// `cache` when given).
pub fn load_head(
    cfg: &ModelConfig,
    src: &dyn TensorSource,
    cache: Option<&WeightCache>,
) -> Result<Head> {
    let names = Names::for_source(cfg, src);
    let (h, v) = (cfg.hidden_size, cfg.vocab_size);
    match cfg.arch {
        Arch::Gpt2 => {
            let p = names.prefix;
            let name = format!("{p}wte.weight");
            let embed = table(src, &name, [v, h])?;
            let lm_head = packed(
                cache,
                "wte (tied lm_head)",
                h,
                v,
                WeightLayout::NByK,
                || table_f32(src, &name, &embed),
            )?;
            Ok(Head {
                positions: Some(load(
                    src,
                    &format!("{p}wpe.weight"),
                    &[cfg.max_positions, h],
                )?),
                final_norm: norm(src, &format!("{p}ln_f"), h, true)?,
                embed,
                lm_head,
            })
        }
        _ => {
            let name = "model.embed_tokens.weight";
            let embed = table(src, name, [v, h])?;
            let lm_head = if cfg.tie_embeddings || src.info("lm_head.weight").is_none() {
                if !cfg.tie_embeddings {
                    return Err(ModelError::MissingTensor {
                        name: "lm_head.weight (tie_word_embeddings is false)".into(),
                        path: src.path().to_path_buf(),
                    });
                }
                packed(
                    cache,
                    "embed_tokens (tied lm_head)",
                    h,
                    v,
                    WeightLayout::NByK,
                    || table_f32(src, name, &embed),
                )?
            } else {
                packed(cache, "lm_head.weight", h, v, WeightLayout::NByK, || {
                    load(src, "lm_head.weight", &[v, h]).map(Cow::Owned)
                })?
            };
            Ok(Head {
                embed,
                positions: None,
                final_norm: norm(src, "model.norm", h, false)?,
                lm_head,
            })
        }
    }
}

/// Checks that a layer range is non-empty and inside the model.
pub fn check_range(cfg: &ModelConfig, range: &Range<usize>) -> Result<()> {
    if range.start >= range.end || range.end > cfg.num_layers {
        return Err(ModelError::Input(format!(
            "layer range {}..{} is not a non-empty range inside 0..{}",
            range.start, range.end, cfg.num_layers
        )));
    }
    Ok(())
}
