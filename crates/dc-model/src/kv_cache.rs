//! The KV cache of one stage for one generation: one [`LayerCache`] per layer of the stage's
//! range. An explicit value a caller owns and passes into the forward pass (never hidden state
//! of the model), so a stage, its reveals' cache log and a checker can all hold one.

use std::ops::Range;

use crate::attention::LayerCache;
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};

/// The KV cache of one stage for one generation: one [`LayerCache`] per layer of the range.
#[derive(Clone, Debug)]
pub struct KvCache {
    layers: Range<usize>,
    /// One per layer of `layers`, in order (the forward pass runs each layer on its own).
    pub(crate) caches: Vec<LayerCache>,
}

impl KvCache {
    /// An empty cache for `layers` of a model.
    pub fn new(cfg: &ModelConfig, layers: Range<usize>) -> KvCache {
        KvCache {
            caches: layers
                .clone()
                .map(|_| LayerCache::new(cfg.num_kv_heads, cfg.head_dim))
                .collect(),
            layers,
        }
    }

    /// Positions held (the same in every layer).
    pub fn len(&self) -> usize {
        self.caches.first().map_or(0, LayerCache::len)
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.caches.iter().map(LayerCache::bytes).sum()
    }

    /// Keeps only the first `len` positions in every layer: a pass that starts at `len` runs
    /// over what a speculative pass wrote past it (see `speculative.rs`).
    pub fn truncate(&mut self, len: usize) {
        for c in &mut self.caches {
            c.truncate(len);
        }
    }

    /// Appends the positions encoded in `rows`, one entry per layer (see
    /// [`LayerCache::from_encoded`]), as a peer revealed them; on an error nothing is appended.
    pub fn extend_encoded(&mut self, rows: &[Vec<u8>]) -> Result<()> {
        if rows.len() != self.caches.len() {
            return Err(ModelError::Input(format!(
                "cache rows of {} layers for layers {}..{}",
                rows.len(),
                self.layers.start,
                self.layers.end
            )));
        }
        let held = self.len();
        let mut done = Ok(());
        for (c, r) in self.caches.iter_mut().zip(rows) {
            done = c.extend_encoded(r);
            if done.is_err() {
                break;
            }
        }
        if done.is_ok() && self.caches.iter().any(|c| c.len() != self.caches[0].len()) {
            done = Err(ModelError::Input(
                "cache rows of different lengths for different layers".into(),
            ));
        }
        if done.is_err() {
            for c in &mut self.caches {
                c.truncate(held);
            }
        }
        done
    }

    /// The cache of `layer` (an absolute layer index), if this cache serves it.
    pub fn layer(&self, layer: usize) -> Option<&LayerCache> {
        self.caches.get(layer.checked_sub(self.layers.start)?)
    }

    /// The cache of `layer`, to replace it (a test-only liar swaps in a tampered one).
    pub fn layer_mut(&mut self, layer: usize) -> Option<&mut LayerCache> {
        self.caches.get_mut(layer.checked_sub(self.layers.start)?)
    }

    /// The layers this cache serves.
    pub fn layers(&self) -> Range<usize> {
        self.layers.clone()
    }

    /// A copy of the caches of `layers` (a sub-range of ours).
    pub fn sub(&self, layers: Range<usize>) -> Option<KvCache> {
        if layers.start < self.layers.start || layers.end > self.layers.end || layers.is_empty() {
            return None;
        }
        let a = layers.start - self.layers.start;
        Some(KvCache {
            caches: self.caches[a..a + layers.len()].to_vec(),
            layers,
        })
    }
}
