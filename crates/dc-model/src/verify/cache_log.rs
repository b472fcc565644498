//! The KV cache rows a stage produced in a generation, logged for reveals, and the checker's
//! test that revealed cache rows are exactly the ones each hop committed.

use std::borrow::Cow;
use std::collections::BTreeMap;
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
    /// Every hop logged, in order: its first position and its rows.
    hops: Vec<(usize, usize)>,
    /// The rows of a hop past the start of the hop after it (a speculative pass whose guess
    /// missed: the next hop starts inside it and overwrites them), per hop index, per layer.
    /// Gone from the cache, but a check of the hop's commitment needs every row it committed.
    tails: BTreeMap<usize, Vec<Vec<u8>>>,
}

impl CacheLog {
    /// Logs a hop that continued where the log ends ([`Self::record_hop`]).
    pub fn record(&mut self, cache: &KvCache) {
        // A cache shorter than the log logs nothing.
        let _ = self.record_hop(self.len, cache);
    }

    /// Logs a hop that ran from position `start` and left `cache` as it is: the rows it wrote.
    /// A hop that starts before the logged rows end (inside the hop before it, which must start
    /// before it) cuts that hop's rows past `start` away into its tail first, as the cache did.
    pub fn record_hop(&mut self, start: usize, cache: &KvCache) -> std::result::Result<(), String> {
        let layers = cache.layers();
        if self.rows.is_empty() {
            self.first_layer = layers.start;
            self.rows = layers.clone().map(|_| Vec::new()).collect();
        }
        let end = cache.len();
        if start > self.len || end < start {
            return Err(format!(
                "a hop of positions {start}..{end} after {} logged positions",
                self.len
            ));
        }
        if start < self.len {
            let last = self.hops.len().checked_sub(1);
            match last.map(|i| (i, self.hops[i].0)) {
                Some((i, first)) if first < start => {
                    let tail = (0..self.rows.len())
                        .map(|k| {
                            self.rows_between(self.first_layer + k, start, self.len)
                                .unwrap_or_default()
                        })
                        .collect();
                    self.tails.insert(i, tail);
                    self.truncate(start);
                }
                _ => {
                    return Err(format!(
                        "a hop from position {start} does not start inside the hop before it"
                    ))
                }
            }
        }
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
        self.len = end;
        self.hops.push((start, end - start));
        Ok(())
    }

    /// Keeps the rows of positions `0..len` (a chunk a reveal in flight still holds is copied,
    /// not changed under it).
    fn truncate(&mut self, len: usize) {
        let rb = self.row_bytes;
        for chunks in &mut self.rows {
            chunks.truncate(len.div_ceil(LOG_CHUNK));
            if let Some(last) = chunks.last_mut() {
                let keep = (len - (len.div_ceil(LOG_CHUNK).max(1) - 1) * LOG_CHUNK) * rb;
                if last.len() > keep {
                    Arc::make_mut(last).truncate(keep);
                }
            }
        }
        self.len = self.len.min(len);
    }

    /// How many rows [`Self::hop_rows`] returns (before copying any).
    pub fn hop_rows_count(&self, from: usize, end: usize) -> usize {
        let starting = self.hops.iter().filter(|h| h.0 >= from && h.0 < end);
        starting.map(|h| h.1).sum()
    }

    /// Every row of each hop that starts in `from..end`, in hop order, each hop's rows whole
    /// (its tail too, when the next hop started inside it): what a check of their commitments
    /// needs ([`check_cache_rows`]). `None` if `from` is neither a hop's start nor `end`, if
    /// fewer than `end` positions are logged, or if the layer is not.
    pub fn hop_rows(&self, layer: usize, from: usize, end: usize) -> Option<Vec<u8>> {
        let k = layer.checked_sub(self.first_layer)?;
        self.rows.get(k)?;
        let starts = |p: usize| self.hops.iter().any(|h| h.0 == p);
        if from > end || end > self.len || (from != end && !starts(from)) {
            return None;
        }
        let mut out = Vec::new();
        for (i, &(start, rows)) in self.hops.iter().enumerate() {
            if start < from || start >= end {
                continue;
            }
            let tail = self.tails.get(&i).map(|t| &t[k]);
            let cut = tail.map_or(0, |t| t.len() / self.row_bytes.max(1));
            out.extend(self.rows_between(layer, start, start + rows - cut)?);
            if let Some(t) = tail {
                out.extend_from_slice(t);
            }
        }
        Some(out)
    }

    /// Positions logged (the cache's length after the last hop).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is logged.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        let tails: usize = self.tails.values().flatten().map(Vec::len).sum();
        self.rows.iter().flatten().map(|c| c.len()).sum::<usize>() + tails
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

/// Checks that `bytes` are `layer`'s KV cache rows exactly as each hop committed them, and
/// returns the rows of positions `from..end` the cache held after them. `hops` are all the
/// hops a stage served in a generation up to the one checked, in order from position 0, as
/// (signed trace, rows); each starts after the one before and no later than its end (inside
/// it, when a speculative guess missed: its rows from there on were cut). `bytes` hold every
/// row of each hop that starts in `from..end`, whole and in order ([`CacheLog::hop_rows`]);
/// `from` is where one of them starts (or `end`), and `end` is within the last hop's rows.
pub fn check_cache_rows<'b>(
    cfg: &crate::ModelConfig,
    layer: usize,
    hops: &[(&HopTrace, usize)],
    from: usize,
    end: usize,
    bytes: &'b [u8],
) -> std::result::Result<Cow<'b, [u8]>, String> {
    let l = layer as u32;
    let rb = LayerCache::new(cfg.num_kv_heads, cfg.head_dim).row_bytes();
    let mut last: Option<(usize, usize)> = None;
    for &(t, n) in hops {
        let fits = match last {
            None => t.from == 0,
            Some((start, rows)) => t.from > start && t.from <= start + rows,
        };
        if !fits || n == 0 {
            return Err(format!(
                "the hops do not cover the generation: one of {n} rows starts at {} after {last:?}",
                t.from
            ));
        }
        last = Some((t.from, n));
    }
    let covered = last.map_or(0, |(start, rows)| start + rows);
    if from > end || end > covered {
        return Err(format!(
            "layer {l}: cache rows {from}..{end} of hops that cover 0..{covered}"
        ));
    }
    if from != end && hops.iter().all(|(t, _)| t.from != from) {
        return Err(format!("layer {l}: no hop starts at position {from}"));
    }
    let revealed: Vec<(&HopTrace, usize)> = hops
        .iter()
        .copied()
        .filter(|(t, _)| t.from >= from && t.from < end)
        .collect();
    let total: usize = revealed.iter().map(|(_, n)| n).sum();
    if bytes.len() != total * rb {
        return Err(format!(
            "layer {l}: {} bytes of cache rows revealed, not the {total} rows of the hops from \
             {from} to {end}",
            bytes.len()
        ));
    }
    // Every hop's rows hashed together (a decode hop's one row is too short to fill the hash
    // lanes alone), each hop's commitment then compared in order.
    let mut batch = LeafBatch::default();
    let mut at = 0;
    for &(t, n) in &revealed {
        queue_cache_rows(&mut batch, t.from, rb, &bytes[at * rb..(at + n) * rb]);
        at += n;
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
    // What the cache held: each hop's rows up to where the next one started, up to `end`.
    let kept = |i: usize| {
        let (t, n) = revealed[i];
        let next = revealed.get(i + 1).map_or(end, |(u, _)| u.from);
        (next.min(t.from + n) - t.from, n)
    };
    if (0..revealed.len()).all(|i| kept(i).0 == kept(i).1) {
        return Ok(Cow::Borrowed(bytes));
    }
    let mut out = Vec::with_capacity((end - from) * rb);
    let mut at = 0;
    for i in 0..revealed.len() {
        let (keep, n) = kept(i);
        out.extend_from_slice(&bytes[at * rb..(at + keep) * rb]);
        at += n;
    }
    Ok(Cow::Owned(out))
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

    /// A two-layer model's config (its caches are all these tests need).
    fn two_layers() -> ModelConfig {
        ModelConfig::from_hf_json(&serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 32, "max_position_embeddings": 512, "rms_norm_eps": 1e-5
        }))
        .unwrap()
    }

    #[test]
    fn the_cache_log_reads_across_chunks_and_copies_only_the_chunk_it_writes_into() {
        let cfg = two_layers();
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

    #[test]
    fn a_hop_that_starts_inside_the_one_before_keeps_the_cut_rows_as_its_tail() {
        let cfg = two_layers();
        let mut cache = KvCache::new(&cfg, 0..2);
        let mut log = CacheLog::default();
        fill(&cfg, &mut cache, 0, 70);
        log.record_hop(0, &cache).unwrap();
        fill(&cfg, &mut cache, 70, 75);
        log.record_hop(70, &cache).unwrap();
        let guessed: Vec<Vec<u8>> = (0..2)
            .map(|l| cache.layer(l).unwrap().encode_rows(72..75))
            .collect();
        // The next hop starts at 72, inside the one before: the cache is cut back to 72 and
        // gets other rows there (made here from other positions).
        cache.truncate(72);
        let held = log.clone();
        fill(&cfg, &mut cache, 80, 82);
        log.record_hop(72, &cache).unwrap();
        let rb = log.row_bytes();
        for l in 0..2 {
            let c = cache.layer(l).unwrap();
            // Positions read as the cache holds them; the hops whole, the tail after its hop.
            assert_eq!(log.rows(l, 74).unwrap(), c.encode_rows(0..74));
            let mut whole = c.encode_rows(70..72);
            whole.extend_from_slice(&guessed[l]);
            assert_eq!(log.hop_rows(l, 70, 71).unwrap(), whole);
            whole.extend_from_slice(&c.encode_rows(72..74));
            assert_eq!(log.hop_rows(l, 70, 73).unwrap(), whole);
            assert_eq!(log.hop_rows(l, 0, 73).unwrap().len(), (70 + 5 + 2) * rb);
            assert!(log.hop_rows(l, 71, 73).is_none(), "no hop starts at 71");
            assert_eq!(log.hop_rows(l, 72, 72).unwrap(), Vec::<u8>::new());
            // A reveal holding the log from before still reads the guessed rows.
            let mut before = c.encode_rows(0..72);
            before.extend_from_slice(&guessed[l]);
            assert_eq!(held.rows(l, 75).unwrap(), before);
        }
        assert_eq!(log.bytes(), 2 * (74 + 3) * rb);
        // A hop must start inside the last one, after its start, and not past the log's end.
        assert!(log.record_hop(72, &cache).is_err());
        assert!(log.record_hop(75, &cache).is_err());
        let mut short = cache.clone();
        short.truncate(73);
        assert!(log.record_hop(73, &short).is_ok());
    }
}
