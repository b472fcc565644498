//! The quantised-weight cache: every packed matrix a stage loads is also written to
//! `<data dir>/weight-cache/<source fingerprint>/<matrix key>.pack`, so a restart (or a new
//! layer range over the same file) reads the packing back instead of dequantising and
//! quantising again.
//!
//! The fingerprint covers the source files' paths, sizes and modification times, so an edited
//! or replaced checkpoint gets a fresh directory. Entries are checked on every read (checksum,
//! layout rules; see `PackedWeights::from_bytes`); a bad one is quantised again and rewritten.
//! Writes go through a temporary file and a rename, so a crash never leaves half an entry. The
//! cache is only an optimisation: failing to read or write it never fails a load.

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use dc_kernels::{PackedWeights, WeightLayout};

use crate::error::Result;
use crate::identity::source_fingerprint;

/// Bumped whenever what quantisation produces changes, so stale entries are never read.
const QUANT_VERSION: &str = "q1";

/// The packed-weight cache of one model source.
#[derive(Clone, Debug)]
pub struct WeightCache {
    dir: PathBuf,
}

impl WeightCache {
    /// The cache of the model at `model` inside `data_dir`.
    pub fn for_model(model: &Path, data_dir: &Path) -> Result<WeightCache> {
        let fp = source_fingerprint(model)?;
        Ok(WeightCache {
            dir: data_dir
                .join("weight-cache")
                .join(format!("{}-{QUANT_VERSION}", fp.to_hex())),
        })
    }

    /// Where the cache of this source lives.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn entry(&self, name: &str, k: usize, n: usize, layout: WeightLayout) -> PathBuf {
        let mut h = blake3::Hasher::new();
        h.update(name.as_bytes());
        h.update(&[0]);
        h.update(&(k as u64).to_le_bytes());
        h.update(&(n as u64).to_le_bytes());
        h.update(&[matches!(layout, WeightLayout::KByN) as u8]);
        self.dir
            .join(format!("{}.pack", &h.finalize().to_hex()[..32]))
    }

    /// The packing of matrix `name` (`k × n`, stored as `layout`): from the cache if it holds a
    /// valid one, else `load()`ed (borrowed when the caller already holds the values, as for a
    /// tied output projection), quantised and stored.
    pub fn packed<'w>(
        &self,
        name: &str,
        k: usize,
        n: usize,
        layout: WeightLayout,
        load: impl FnOnce() -> Result<Cow<'w, [f32]>>,
    ) -> Result<PackedWeights> {
        let file = self.entry(name, k, n, layout);
        if let Some(bytes) = map(&file) {
            match PackedWeights::from_bytes(&bytes) {
                Ok(p) if p.k() == k && p.n() == n => return Ok(p),
                Ok(p) => tracing::warn!(
                    "{}: cached {name} is {} × {}, expected {k} × {n}; quantising again",
                    file.display(),
                    p.k(),
                    p.n()
                ),
                Err(e) => tracing::warn!("{}: {e}; quantising {name} again", file.display()),
            }
        }
        let p = PackedWeights::quantize(&load()?, k, n, layout, name)?;
        if let Err(e) = self.store(&file, &p) {
            tracing::debug!("weight cache {}: {e}", file.display());
        }
        Ok(p)
    }

    fn store(&self, file: &Path, p: &PackedWeights) -> std::io::Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        // Unique per process and call: concurrent loads of one model never share a file.
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = file.with_extension(format!("tmp{}-{n}", std::process::id()));
        std::fs::write(&tmp, p.to_bytes())?;
        std::fs::rename(&tmp, file)
    }
}

/// The entry `file`, memory-mapped (read once into the packing, without a copy in between).
fn map(file: &Path) -> Option<memmap2::Mmap> {
    let f = std::fs::File::open(file).ok()?;
    // SAFETY: read-only. An entry is replaced by a rename, never written in place, so the
    // mapped file does not change underneath; a damaged one fails the checksum.
    unsafe { memmap2::Mmap::map(&f) }.ok()
}

/// Packs `name` through `cache` when there is one.
pub(crate) fn packed<'w>(
    cache: Option<&WeightCache>,
    name: &str,
    k: usize,
    n: usize,
    layout: WeightLayout,
    load: impl FnOnce() -> Result<Cow<'w, [f32]>>,
) -> Result<PackedWeights> {
    match cache {
        Some(c) => c.packed(name, k, n, layout, load),
        None => Ok(PackedWeights::quantize(&load()?, k, n, layout, name)?),
    }
}
