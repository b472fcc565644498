//! Model configuration: one normalised description of every supported architecture, parsed
//! from a Hugging Face `config.json` (GGUF files are first turned into the same JSON).
//!
//! Unknown or unsupported settings are errors naming the key: a model that would silently run
//! with the wrong maths is worse than one that refuses to load.

use serde::Serialize;
use serde_json::Value;

use crate::error::{ModelError, Result};

/// The architectures the runtime implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// GPT-2: LayerNorm, learned positions, fused QKV, tanh-GELU MLP, tied embeddings.
    Gpt2,
    /// Llama (and SmolLM): RMSNorm, RoPE half-split, SwiGLU, grouped-query attention.
    Llama,
    /// Qwen2: Llama with biases on q, k and v.
    Qwen2,
    /// Mistral: Llama with a sliding attention window.
    Mistral,
}

impl Arch {
    /// The name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Gpt2 => "gpt2",
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Mistral => "mistral",
        }
    }
}

/// Everything the runtime needs to know about a model's shape and maths.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModelConfig {
    /// Architecture.
    pub arch: Arch,
    /// Vocabulary size (rows of the embedding, columns of the logits).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Number of transformer layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (equal to `num_heads` without grouped-query attention).
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Width of the MLP's inner layer.
    pub intermediate_size: usize,
    /// Largest number of positions (prompt plus generated tokens).
    pub max_positions: usize,
    /// Epsilon of the norms.
    pub norm_eps: f32,
    /// RoPE base θ (Llama family only).
    pub rope_theta: f64,
    /// Whether the output head reuses the token embedding.
    pub tie_embeddings: bool,
    /// Attention window: a query at position i sees keys j with `i - window < j <= i`.
    pub sliding_window: Option<usize>,
    /// Whether q, k and v projections carry biases.
    pub qkv_bias: bool,
    /// Beginning-of-sequence token, if the model has one.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence tokens (generation stops on any of them).
    pub eos_token_ids: Vec<u32>,
}

fn get<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    v.get(key).filter(|x| !x.is_null())
}

fn usize_key(v: &Value, key: &str) -> Result<usize> {
    let x = get(v, key).ok_or_else(|| ModelError::Config {
        key: key.into(),
        detail: "missing".into(),
    })?;
    let n = x.as_u64().ok_or_else(|| ModelError::Config {
        key: key.into(),
        detail: format!("expected a non-negative integer, found {x}"),
    })?;
    if n == 0 || n > (1 << 31) {
        return Err(ModelError::Config {
            key: key.into(),
            detail: format!("{n} is out of range"),
        });
    }
    Ok(n as usize)
}

fn opt_usize(v: &Value, key: &str) -> Result<Option<usize>> {
    match get(v, key) {
        None => Ok(None),
        Some(_) => usize_key(v, key).map(Some),
    }
}

fn f64_key(v: &Value, key: &str) -> Result<Option<f64>> {
    match get(v, key) {
        None => Ok(None),
        Some(x) => x
            .as_f64()
            .filter(|f| f.is_finite())
            .map(Some)
            .ok_or_else(|| ModelError::Config {
                key: key.into(),
                detail: format!("expected a number, found {x}"),
            }),
    }
}

fn bool_key(v: &Value, key: &str, default: bool) -> Result<bool> {
    match get(v, key) {
        None => Ok(default),
        Some(x) => x.as_bool().ok_or_else(|| ModelError::Config {
            key: key.into(),
            detail: format!("expected true or false, found {x}"),
        }),
    }
}

fn token_ids(v: &Value, key: &str) -> Result<Vec<u32>> {
    let bad = |x: &Value| ModelError::Config {
        key: key.into(),
        detail: format!("expected a token id or a list of them, found {x}"),
    };
    match get(v, key) {
        None => Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| bad(x))
            })
            .collect(),
        Some(x) => Ok(vec![x
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| bad(x))?]),
    }
}

impl ModelConfig {
    /// Parses a Hugging Face `config.json`.
    pub fn from_hf_json(v: &Value) -> Result<ModelConfig> {
        let model_type = get(v, "model_type").and_then(Value::as_str).unwrap_or("");
        let arch_name = get(v, "architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .unwrap_or("");
        let arch = match (model_type, arch_name) {
            ("gpt2", _) | (_, "GPT2LMHeadModel") => Arch::Gpt2,
            ("llama", _) | (_, "LlamaForCausalLM") => Arch::Llama,
            ("qwen2", _) | (_, "Qwen2ForCausalLM") => Arch::Qwen2,
            ("mistral", _) | (_, "MistralForCausalLM") => Arch::Mistral,
            _ => {
                return Err(ModelError::Unsupported {
                    what: "architecture",
                    value: format!("model_type {model_type:?}, architectures[0] {arch_name:?}"),
                })
            }
        };
        let bos_token_id = token_ids(v, "bos_token_id")?.first().copied();
        let eos_token_ids = token_ids(v, "eos_token_id")?;
        let cfg = match arch {
            Arch::Gpt2 => Self::gpt2(v, bos_token_id, eos_token_ids)?,
            _ => Self::llama_family(v, arch, bos_token_id, eos_token_ids)?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn gpt2(v: &Value, bos: Option<u32>, eos: Vec<u32>) -> Result<ModelConfig> {
        let hidden = usize_key(v, "n_embd")?;
        let heads = usize_key(v, "n_head")?;
        let act = get(v, "activation_function")
            .and_then(Value::as_str)
            .unwrap_or("gelu_new");
        if !matches!(act, "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast") {
            return Err(ModelError::Unsupported {
                what: "activation_function",
                value: act.into(),
            });
        }
        if bool_key(v, "scale_attn_by_inverse_layer_idx", false)? {
            return Err(ModelError::Unsupported {
                what: "scale_attn_by_inverse_layer_idx",
                value: "true".into(),
            });
        }
        if !bool_key(v, "scale_attn_weights", true)? {
            return Err(ModelError::Unsupported {
                what: "scale_attn_weights",
                value: "false".into(),
            });
        }
        if !hidden.is_multiple_of(heads) {
            return Err(ModelError::Config {
                key: "n_head".into(),
                detail: format!("{heads} does not divide n_embd {hidden}"),
            });
        }
        Ok(ModelConfig {
            arch: Arch::Gpt2,
            vocab_size: usize_key(v, "vocab_size")?,
            hidden_size: hidden,
            num_layers: usize_key(v, "n_layer")?,
            num_heads: heads,
            num_kv_heads: heads,
            head_dim: hidden / heads,
            intermediate_size: opt_usize(v, "n_inner")?.unwrap_or(4 * hidden),
            max_positions: opt_usize(v, "n_positions")?
                .or(opt_usize(v, "n_ctx")?)
                .unwrap_or(1024),
            norm_eps: f64_key(v, "layer_norm_epsilon")?.unwrap_or(1e-5) as f32,
            rope_theta: 0.0,
            tie_embeddings: true,
            sliding_window: None,
            qkv_bias: true,
            bos_token_id: bos,
            eos_token_ids: eos,
        })
    }

    fn llama_family(v: &Value, arch: Arch, bos: Option<u32>, eos: Vec<u32>) -> Result<ModelConfig> {
        let hidden = usize_key(v, "hidden_size")?;
        let heads = usize_key(v, "num_attention_heads")?;
        let kv = opt_usize(v, "num_key_value_heads")?.unwrap_or(heads);
        if !heads.is_multiple_of(kv) {
            return Err(ModelError::Config {
                key: "num_key_value_heads".into(),
                detail: format!("{kv} does not divide num_attention_heads {heads}"),
            });
        }
        let head_dim = match opt_usize(v, "head_dim")? {
            Some(d) => d,
            None if hidden.is_multiple_of(heads) => hidden / heads,
            None => {
                return Err(ModelError::Config {
                    key: "head_dim".into(),
                    detail: format!(
                    "missing, and num_attention_heads {heads} does not divide hidden_size {hidden}"
                ),
                })
            }
        };
        if !head_dim.is_multiple_of(2) {
            return Err(ModelError::Config {
                key: "head_dim".into(),
                detail: format!("{head_dim} is odd; RoPE needs an even head width"),
            });
        }
        let act = get(v, "hidden_act")
            .and_then(Value::as_str)
            .unwrap_or("silu");
        if act != "silu" {
            return Err(ModelError::Unsupported {
                what: "hidden_act",
                value: act.into(),
            });
        }
        // RoPE: the newer `rope_parameters` form or the older top-level `rope_theta`; only the
        // default (unscaled) rotation is implemented.
        let params = get(v, "rope_parameters").or(get(v, "rope_scaling"));
        if let Some(p) = params {
            let kind = p
                .get("rope_type")
                .or(p.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("default");
            if kind != "default" {
                return Err(ModelError::Unsupported {
                    what: "rope_type",
                    value: kind.into(),
                });
            }
        }
        let rope_theta = match params
            .and_then(|p| p.get("rope_theta"))
            .and_then(Value::as_f64)
        {
            Some(t) => t,
            None => f64_key(v, "rope_theta")?.unwrap_or(10_000.0),
        };
        if rope_theta.is_nan() || rope_theta <= 1.0 {
            return Err(ModelError::Config {
                key: "rope_theta".into(),
                detail: format!("{rope_theta} must be greater than 1"),
            });
        }
        if bool_key(v, "mlp_bias", false)? {
            return Err(ModelError::Unsupported {
                what: "mlp_bias",
                value: "true".into(),
            });
        }
        let sliding_window = match arch {
            Arch::Mistral => opt_usize(v, "sliding_window")?,
            Arch::Qwen2 if bool_key(v, "use_sliding_window", false)? => {
                return Err(ModelError::Unsupported {
                    what: "use_sliding_window",
                    value: "true (per-layer windows of Qwen2)".into(),
                })
            }
            _ => None,
        };
        let qkv_bias = match arch {
            Arch::Qwen2 => true,
            _ => bool_key(v, "attention_bias", false)?,
        };
        Ok(ModelConfig {
            arch,
            vocab_size: usize_key(v, "vocab_size")?,
            hidden_size: hidden,
            num_layers: usize_key(v, "num_hidden_layers")?,
            num_heads: heads,
            num_kv_heads: kv,
            head_dim,
            intermediate_size: usize_key(v, "intermediate_size")?,
            max_positions: opt_usize(v, "max_position_embeddings")?.unwrap_or(2048),
            norm_eps: f64_key(v, "rms_norm_eps")?.unwrap_or(1e-6) as f32,
            rope_theta,
            tie_embeddings: bool_key(v, "tie_word_embeddings", false)?,
            sliding_window,
            qkv_bias,
            bos_token_id: bos,
            eos_token_ids: eos,
        })
    }

    fn validate(&self) -> Result<()> {
        if self.num_layers > 4096 || self.num_heads > 4096 || self.head_dim > 4096 {
            return Err(ModelError::Config {
                key: "num_hidden_layers/num_attention_heads/head_dim".into(),
                detail: "implausibly large".into(),
            });
        }
        if self.vocab_size > u32::MAX as usize {
            return Err(ModelError::Config {
                key: "vocab_size".into(),
                detail: format!("{} does not fit token ids", self.vocab_size),
            });
        }
        if !(self.norm_eps >= 0.0 && self.norm_eps.is_finite()) {
            return Err(ModelError::Config {
                key: "norm eps".into(),
                detail: format!("{} is not a finite non-negative number", self.norm_eps),
            });
        }
        Ok(())
    }

    /// Query heads per key/value head.
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// Width of all query heads together.
    pub fn q_width(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Width of all key (or value) heads together.
    pub fn kv_width(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn both_rope_forms_and_defaults() {
        let base = json!({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100});
        let mut a = base.clone();
        a["rope_theta"] = json!(5e5);
        assert_eq!(ModelConfig::from_hf_json(&a).unwrap().rope_theta, 5e5);
        let mut b = base.clone();
        b["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 1e5});
        let c = ModelConfig::from_hf_json(&b).unwrap();
        assert_eq!((c.rope_theta, c.num_kv_heads, c.head_dim), (1e5, 4, 16));
        let mut s = base.clone();
        s["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0});
        let err = ModelConfig::from_hf_json(&s).unwrap_err().to_string();
        assert!(err.contains("rope_type") && err.contains("llama3"), "{err}");
    }

    #[test]
    fn bad_values_name_their_key() {
        let v = json!({"model_type": "llama", "hidden_size": "wide"});
        let err = ModelConfig::from_hf_json(&v).unwrap_err().to_string();
        assert!(err.contains("hidden_size"), "{err}");
        let v = json!({"model_type": "bert"});
        assert!(ModelConfig::from_hf_json(&v)
            .unwrap_err()
            .to_string()
            .contains("bert"));
    }
}
