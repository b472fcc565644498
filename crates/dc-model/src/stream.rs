//! Layers streamed from the weight cache, so that a stage can serve more layers than its
//! memory holds. A streamed layer's packings stay on disk in the weight cache; a hop that
//! reaches the layer reads them (memory-mapped, checked as every cache read is), and while it
//! computes, the next streamed layer is read on another thread. At most [`WINDOW`] streamed
//! layers are held at once; the oldest is dropped for the next.
//!
//! A streamed layer is the packing the resident path would hold (the same cache entries, from
//! the same quantisation), so a streamed stage computes the same bits.

use std::collections::{BTreeSet, VecDeque};
use std::ops::Deref;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::source::TensorSource;
use crate::weight_cache::WeightCache;
use crate::weights::{load_layer, Layer};

/// Streamed layers held at once: the one computing and the next, read ahead.
pub const WINDOW: usize = 2;

/// The layers of a model that stay on disk.
pub(crate) struct Streamed {
    config: ModelConfig,
    src: Box<dyn TensorSource>,
    cache: WeightCache,
    layers: BTreeSet<usize>,
    state: Mutex<Window>,
    changed: Condvar,
}

/// The streamed layers in memory now, and those being read.
#[derive(Default)]
struct Window {
    held: VecDeque<(usize, Arc<Layer>)>,
    reading: BTreeSet<usize>,
    /// Layers read from disk so far (status, and the tests of the window).
    reads: u64,
    /// Time spent reading them (on whichever thread read).
    read_time: std::time::Duration,
}

/// What streaming has done so far.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StreamStats {
    /// The streamed layers.
    pub layers: Vec<usize>,
    /// Layers read from the weight cache so far.
    pub reads: u64,
    /// Seconds those reads took.
    pub read_seconds: f64,
}

impl std::fmt::Debug for Streamed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streamed")
            .field("layers", &self.layers)
            .finish()
    }
}

/// A layer to compute with: one the model holds, or one streamed in for the while.
pub(crate) enum LayerRef<'a> {
    /// Held for the model's life.
    Resident(&'a Layer),
    /// Read from the weight cache; dropped when the window moves on and this is gone.
    Streamed(Arc<Layer>),
}

impl Deref for LayerRef<'_> {
    type Target = Layer;

    fn deref(&self) -> &Layer {
        match self {
            LayerRef::Resident(l) => l,
            LayerRef::Streamed(l) => l,
        }
    }
}

impl Streamed {
    /// Streams `layers` of the model in `src`, whose packings `cache` holds (or will: each is
    /// quantised and stored here once, so that every later read is a cache read).
    pub(crate) fn new(
        config: ModelConfig,
        src: Box<dyn TensorSource>,
        cache: WeightCache,
        layers: BTreeSet<usize>,
    ) -> Result<Streamed> {
        for &i in &layers {
            load_layer(&config, src.as_ref(), Some(&cache), i)?;
        }
        Ok(Streamed {
            config,
            src,
            cache,
            layers,
            state: Mutex::new(Window::default()),
            changed: Condvar::new(),
        })
    }

    /// Whether layer `i` is streamed.
    pub(crate) fn has(&self, i: usize) -> bool {
        self.layers.contains(&i)
    }

    /// The streamed layers.
    pub(crate) fn layers(&self) -> impl Iterator<Item = usize> + '_ {
        self.layers.iter().copied()
    }

    /// What streaming has done so far.
    pub(crate) fn stats(&self) -> StreamStats {
        let w = self.lock();
        StreamStats {
            layers: self.layers.iter().copied().collect(),
            reads: w.reads,
            read_seconds: w.read_time.as_secs_f64(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Window> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Layer `i`, from the window or read now (waiting for a read ahead already under way).
    pub(crate) fn get(&self, i: usize) -> Result<Arc<Layer>> {
        if !self.has(i) {
            return Err(ModelError::Input(format!(
                "layer {i} is not loaded in this stage"
            )));
        }
        let mut w = self.lock();
        loop {
            if let Some((_, l)) = w.held.iter().find(|(j, _)| *j == i) {
                return Ok(l.clone());
            }
            if !w.reading.contains(&i) {
                break;
            }
            w = self.changed.wait(w).unwrap_or_else(|e| e.into_inner());
        }
        w.reading.insert(i);
        drop(w);
        let started = std::time::Instant::now();
        let read = self.read(i);
        self.finish(i, read.as_ref().ok().cloned(), started);
        read
    }

    /// Starts reading layer `i` on another thread, unless it is held, being read, or not
    /// streamed.
    pub(crate) fn read_ahead(self: &Arc<Self>, i: usize) {
        if !self.has(i) {
            return;
        }
        {
            let mut w = self.lock();
            if w.reading.contains(&i) || w.held.iter().any(|(j, _)| *j == i) {
                return;
            }
            w.reading.insert(i);
        }
        let me = self.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("dcd read layer {i}"))
            .spawn(move || {
                // A failed read ahead is retried by the hop that needs the layer, which then
                // reports the error.
                let started = std::time::Instant::now();
                let read = me.read(i).ok();
                me.finish(i, read, started);
            });
        if spawned.is_err() {
            self.finish(i, None, std::time::Instant::now());
        }
    }

    fn read(&self, i: usize) -> Result<Arc<Layer>> {
        load_layer(&self.config, self.src.as_ref(), Some(&self.cache), i).map(Arc::new)
    }

    fn finish(&self, i: usize, layer: Option<Arc<Layer>>, started: std::time::Instant) {
        let mut w = self.lock();
        w.reading.remove(&i);
        if let Some(l) = layer {
            w.reads += 1;
            w.read_time += started.elapsed();
            if w.held.len() >= WINDOW {
                w.held.pop_front();
            }
            w.held.push_back((i, l));
        }
        drop(w);
        self.changed.notify_all();
    }
}
