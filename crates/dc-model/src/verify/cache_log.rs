//! The KV cache rows a stage produced in a generation, logged for reveals, and the checker's
//! test that revealed cache rows are exactly the ones each hop committed.

use std::sync::Arc;

use dc_kernels::verify::commit::LeafBatch;
use dc_types::{HopTrace, Point};

use crate::attention::{queue_cache_rows, LayerCache};
use crate::kv_cache::KvCache;

/// Positions per chunk of a layer's [`CacheLog`].
const LOG_CHUNK: usize = 64;

/// The KV cache rows a stage produced in a generation, per layer, in canonical encoding: what
/// it reveals so a checker can recompute attention. Kept apart from the live cache, which a
/// running hop holds while a reveal of the previous hop may be asked for.
#[derive(Clone, Debug, Default)]
pub struct CacheLog {
    first_layer: usize,
    /// Per layer, the rows of positions `0..` in chunks of [`LOG_CHUNK`] positions, each
    /// shared with reveals in flight: a clone of the log copies no rows, and an append copies
    /// at most the chunk it writes into, if a reveal still holds that (with the layer's rows in
    /// one block, an append during a reveal copied all of them: a cost that grew with the
    /// generation).
    rows: Vec<Vec<Arc<Vec<u8>>>>,
    row_bytes: usize,
    len: usize,
}

impl CacheLog {
    /// Appends what `cache` holds beyond the positions logged so far.
    pub fn record(&mut self, cache: &KvCache) {
        let layers = cache.layers();
        if self.rows.is_empty() {
            self.first_layer = layers.start;
            self.rows = layers.clone().map(|_| Vec::new()).collect();
        }
        let end = cache.len();
        for (l, chunks) in layers.zip(self.rows.iter_mut()) {
            if let Some(c) = cache.layer(l) {
                let rb = c.row_bytes();
                self.row_bytes = rb;
                for pos in self.len..end {
                    let full = |chunk: &Arc<Vec<u8>>| chunk.len() >= LOG_CHUNK * rb;
                    if chunks.last().is_none_or(full) {
                        chunks.push(Arc::new(Vec::with_capacity(LOG_CHUNK * rb)));
                    }
                    if let Some(last) = chunks.last_mut() {
                        c.encode_row(pos, Arc::make_mut(last));
                    }
                }
            }
        }
        self.len = self.len.max(end);
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.rows.iter().flatten().map(|c| c.len()).sum()
    }

    /// Bytes of one position's row in one layer (0 before anything is logged).
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// The rows of `layer` at positions `0..end`, if logged.
    pub fn rows(&self, layer: usize, end: usize) -> Option<Vec<u8>> {
        self.rows_between(layer, 0, end)
    }

    /// The rows of `layer` at positions `from..end`, if logged.
    pub fn rows_between(&self, layer: usize, from: usize, end: usize) -> Option<Vec<u8>> {
        let chunks = self.rows.get(layer.checked_sub(self.first_layer)?)?;
        let rb = self.row_bytes;
        let held: usize = chunks.iter().map(|c| c.len()).sum();
        if from > end || end.checked_mul(rb)? > held {
            return None;
        }
        let mut out = Vec::with_capacity((end - from) * rb);
        let mut pos = from;
        // (Nothing to copy when no row has bytes.)
        while pos < end && rb > 0 {
            // Every chunk but the last is full, so position `pos` is in chunk `pos / LOG_CHUNK`.
            let (chunk, at) = (pos / LOG_CHUNK, pos % LOG_CHUNK);
            let take = (LOG_CHUNK - at).min(end - pos);
            out.extend_from_slice(&chunks[chunk][at * rb..(at + take) * rb]);
            pos += take;
        }
        Some(out)
    }
}

/// Checks that `bytes` are `layer`'s KV cache rows of the positions of `hops` from `from` on
/// — `hops` being all the hops a stage served in a generation, in order from position 0, as
/// (signed trace, rows), and `from` where one of them starts (or their end) — exactly as each
/// hop committed them.
pub fn check_cache_rows(
    cfg: &crate::ModelConfig,
    layer: usize,
    hops: &[(&HopTrace, usize)],
    from: usize,
    bytes: &[u8],
) -> std::result::Result<(), String> {
    let l = layer as u32;
    let rb = LayerCache::new(cfg.num_kv_heads, cfg.head_dim).row_bytes();
    let mut end = 0;
    for &(t, n) in hops {
        if t.from != end {
            return Err(format!(
                "the hops do not cover the generation: one starts at {} after {end}",
                t.from
            ));
        }
        end += n;
    }
    if from != end && hops.iter().all(|(t, _)| t.from != from) {
        return Err(format!("layer {l}: no hop starts at position {from}"));
    }
    if bytes.len() != (end - from.min(end)) * rb {
        return Err(format!(
            "layer {l}: {} bytes of cache rows revealed, not positions {from}..{end}",
            bytes.len()
        ));
    }
    // Every hop's rows hashed together (a decode hop's one row is too short to fill the hash
    // lanes alone), each hop's commitment then compared in order.
    let revealed: Vec<(&HopTrace, usize)> = hops
        .iter()
        .copied()
        .filter(|(t, _)| t.from >= from)
        .collect();
    let mut batch = LeafBatch::default();
    for &(t, n) in &revealed {
        let rows = &bytes[(t.from - from) * rb..(t.from - from + n) * rb];
        queue_cache_rows(&mut batch, t.from, rb, rows);
    }
    for (&(t, n), (commitment, _)) in revealed.iter().zip(batch.finish(false)) {
        if t.get(l, Point::KvCache) != Some(commitment) {
            return Err(format!(
                "layer {l}: the revealed cache rows of positions {}..{} are not the committed \
                 ones",
                t.from,
                t.from + n
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a panic is the failure report

    use super::*;
    use crate::config::ModelConfig;

    /// Appends positions `from..to` to both layers of `cache`, each row's values made from its
    /// position and layer.
    fn fill(cfg: &ModelConfig, cache: &mut KvCache, from: usize, to: usize) {
        let w = cfg.kv_width();
        for pos in from..to {
            for l in 0..2 {
                let value =
                    |i: usize, salt: usize| ((pos * 7 + i * 3 + l + salt) % 23) as f32 - 11.0;
                let k: Vec<f32> = (0..w).map(|i| value(i, 0)).collect();
                let v: Vec<f32> = (0..w).map(|i| value(i, 5)).collect();
                cache.layer_mut(l).unwrap().append(&k, &v).unwrap();
            }
        }
    }

    #[test]
    fn the_cache_log_reads_across_chunks_and_copies_only_the_chunk_it_writes_into() {
        let cfg = ModelConfig::from_hf_json(&serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 32, "max_position_embeddings": 512, "rms_norm_eps": 1e-5
        }))
        .unwrap();
        let mut cache = KvCache::new(&cfg, 0..2);
        let mut log = CacheLog::default();
        fill(&cfg, &mut cache, 0, 100);
        log.record(&cache);
        // A reveal in flight holds the log while the next hop appends.
        let held = log.clone();
        fill(&cfg, &mut cache, 100, 150);
        log.record(&cache);
        for l in 0..2 {
            let c = cache.layer(l).unwrap();
            for (a, b) in [
                (0, 150),
                (0, 64),
                (63, 65),
                (64, 128),
                (99, 101),
                (127, 150),
                (7, 7),
            ] {
                assert_eq!(
                    log.rows_between(l, a, b).unwrap(),
                    c.encode_rows(a..b),
                    "layer {l}, {a}..{b}"
                );
            }
            assert!(log.rows(l, 151).is_none() && log.rows_between(l, 5, 4).is_none());
            // The held log still reads what it held, and no more.
            assert_eq!(held.rows(l, 100).unwrap(), c.encode_rows(0..100));
            assert!(held.rows(l, 101).is_none());
            // The full chunk stays shared; the one written into was copied for the log alone.
            assert!(Arc::ptr_eq(&held.rows[l][0], &log.rows[l][0]));
            assert!(!Arc::ptr_eq(&held.rows[l][1], &log.rows[l][1]));
        }
        assert_eq!(log.bytes(), 2 * 150 * log.row_bytes());
        assert!(log.rows(2, 1).is_none(), "no such layer");
    }
}
