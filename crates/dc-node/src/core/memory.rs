//! Memory accounting: what a layer range and the head weights cost, sizes on the command line,
//! and how many layers fit a budget.

use dc_model::{Arch, ModelConfig};

/// Bytes of packed weights per weight: 544-byte records per 512 weights, plus the per-column
/// exponent table (2 bytes per 32 weights).
const PACKED_PER_WEIGHT: f64 = 544.0 / 512.0 + 2.0 / 32.0;

/// Weights in one layer's linear maps.
fn layer_weights(cfg: &ModelConfig) -> u64 {
    let (h, ff) = (cfg.hidden_size as u64, cfg.intermediate_size as u64);
    let attn = h * cfg.q_width() as u64 * 2 + h * cfg.kv_width() as u64 * 2;
    let mlp = match cfg.arch {
        Arch::Gpt2 => 2 * h * ff,
        _ => 3 * h * ff,
    };
    attn + mlp
}

/// Estimated bytes of one loaded layer.
pub fn layer_bytes(cfg: &ModelConfig) -> u64 {
    (layer_weights(cfg) as f64 * PACKED_PER_WEIGHT) as u64 + 16 * cfg.hidden_size as u64
}

/// Estimated bytes of the head weights (f32 embeddings, packed output projection).
pub fn head_bytes(cfg: &ModelConfig) -> u64 {
    let table = (cfg.vocab_size * cfg.hidden_size) as u64;
    let positions = match cfg.arch {
        Arch::Gpt2 => (cfg.max_positions * cfg.hidden_size) as u64 * 4,
        _ => 0,
    };
    table * 4 + (table as f64 * PACKED_PER_WEIGHT) as u64 + positions
}

/// Bytes the KV cache of one layer needs per position.
pub fn kv_bytes_per_position(cfg: &ModelConfig) -> u64 {
    let w = cfg.kv_width() as u64;
    // K: int8 plus a 4-byte scale per 32, held twice (as scales and packed for the vector
    // scores); V: int8 plus a 2-byte exponent per head.
    2 * w + w / 4 + 2 * cfg.num_kv_heads as u64 + 4
}

/// Layers that fit `budget` after the head weights (if held) and a reserve for KV caches.
pub fn layers_that_fit(cfg: &ModelConfig, budget: Option<u64>, head: bool) -> u32 {
    let Some(budget) = budget else {
        return cfg.num_layers as u32;
    };
    let fixed = if head { head_bytes(cfg) } else { 0 };
    // Reserve a tenth of the budget for KV caches and scratch.
    let usable = (budget - budget / 10).saturating_sub(fixed);
    ((usable / layer_bytes(cfg).max(1)) as u32).min(cfg.num_layers as u32)
}

/// Parses sizes like `512MB`, `2GiB`, `1.5G`, `1048576`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("size {s:?}: expected a number with an optional unit, like 4GiB"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "kib" => 1024.0,
        "m" | "mb" => 1e6,
        "mib" => 1024.0 * 1024.0,
        "g" | "gb" => 1e9,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tb" => 1e12,
        "tib" => 1024f64.powi(4),
        other => {
            return Err(format!(
                "size {s:?}: unknown unit {other:?} (use B, KB, MB, GB, KiB, MiB, GiB)"
            ))
        }
    };
    let v = n * mult;
    if !v.is_finite() || !(1.0..=1e18).contains(&v) {
        return Err(format!("size {s:?} is out of range"));
    }
    Ok(v as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("1048576").unwrap(), 1 << 20);
        assert_eq!(parse_size("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_size("1.5 GB").unwrap(), 1_500_000_000);
        assert_eq!(parse_size("512mb").unwrap(), 512_000_000);
        assert!(parse_size("lots").unwrap_err().contains("lots"));
        assert!(parse_size("3 parsecs").unwrap_err().contains("unit"));
        assert!(parse_size("0").is_err());
    }
}
