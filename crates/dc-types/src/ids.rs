//! Identifiers: models, generations and layer ranges.

use std::fmt;
use std::str::FromStr;

use dc_kernels::Commitment;
use serde::{Deserialize, Serialize};

/// A model's identity: a blake3 hash over its configuration and weights as loaded. Peers serve
/// the same model exactly when their ids are equal.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Default)]
pub struct ModelId(pub Commitment);

impl fmt::Display for ModelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl fmt::Debug for ModelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ModelId({})", &self.0.to_hex()[..16])
    }
}

impl ModelId {
    /// The first 16 hex digits, for topics and logs.
    pub fn short(&self) -> String {
        self.0.to_hex()[..16].to_string()
    }
}

/// A generation's identity, chosen at random by the daemon that received the request.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GenerationId(pub [u8; 16]);

impl GenerationId {
    /// A fresh random id (from blake3 of the time, the process and a counter: unique, not a
    /// secret).
    pub fn new_random() -> GenerationId {
        use std::sync::atomic::{AtomicU64, Ordering};
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let mut h = blake3::Hasher::new();
        h.update(&now.to_le_bytes());
        h.update(&std::process::id().to_le_bytes());
        h.update(&COUNTER.fetch_add(1, Ordering::Relaxed).to_le_bytes());
        let mut out = [0u8; 16];
        out.copy_from_slice(&h.finalize().as_bytes()[..16]);
        GenerationId(out)
    }

    /// Hex form.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl fmt::Display for GenerationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for GenerationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gen({})", &self.to_hex()[..8])
    }
}

/// A half-open range of layers `start..end`, as in Rust (`0..2` is layers 0 and 1). Never
/// empty: decoding refuses `start >= end` as [`LayerRange::new`] does, so no peer's message
/// can hand the code an empty or inverted range.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "RawLayerRange")]
pub struct LayerRange {
    /// First layer.
    pub start: u32,
    /// One past the last layer.
    pub end: u32,
}

/// A [`LayerRange`] as it travels, before it is checked (same fields, same encoding).
#[derive(Deserialize)]
struct RawLayerRange {
    start: u32,
    end: u32,
}

impl TryFrom<RawLayerRange> for LayerRange {
    type Error = String;

    fn try_from(r: RawLayerRange) -> Result<LayerRange, String> {
        LayerRange::new(r.start, r.end)
            .ok_or_else(|| format!("the layer range {}..{} is empty", r.start, r.end))
    }
}

impl LayerRange {
    /// `start..end`; `None` unless `start < end`.
    pub fn new(start: u32, end: u32) -> Option<LayerRange> {
        (start < end).then_some(LayerRange { start, end })
    }

    /// Number of layers.
    pub fn len(&self) -> u32 {
        self.end - self.start
    }

    /// Never empty by construction; here for clippy's sake.
    pub fn is_empty(&self) -> bool {
        self.end <= self.start
    }

    /// Whether layer `l` is in the range.
    pub fn contains(&self, l: u32) -> bool {
        self.start <= l && l < self.end
    }

    /// Whether `other` lies inside this range.
    pub fn covers(&self, other: &LayerRange) -> bool {
        self.start <= other.start && other.end <= self.end
    }

    /// As a `std::ops::Range<usize>`.
    pub fn as_range(&self) -> std::ops::Range<usize> {
        self.start as usize..self.end as usize
    }
}

impl fmt::Display for LayerRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}..{}", self.start, self.end)
    }
}

impl fmt::Debug for LayerRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}..{}", self.start, self.end)
    }
}

impl FromStr for LayerRange {
    type Err = String;

    fn from_str(s: &str) -> Result<LayerRange, String> {
        let (a, b) = s
            .split_once("..")
            .ok_or_else(|| format!("layer range {s:?}: expected A..B, for example 0..12"))?;
        let a: u32 = a
            .trim()
            .parse()
            .map_err(|_| format!("layer range {s:?}: {a:?} is not a layer number"))?;
        let b: u32 = b
            .trim()
            .parse()
            .map_err(|_| format!("layer range {s:?}: {b:?} is not a layer number"))?;
        LayerRange::new(a, b)
            .ok_or_else(|| format!("layer range {s:?} is empty (A..B needs A < B)"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_ranges_parse_like_rust() {
        let r: LayerRange = "0..2".parse().unwrap();
        assert_eq!((r.start, r.end, r.len()), (0, 2, 2));
        assert!(r.contains(1) && !r.contains(2));
        assert!("2..2".parse::<LayerRange>().unwrap_err().contains("empty"));
        assert!("a..3".parse::<LayerRange>().is_err());
        assert!("3".parse::<LayerRange>().is_err());
        assert_eq!(r.to_string(), "0..2");
    }

    #[test]
    fn an_empty_layer_range_off_the_wire_is_refused_and_the_encoding_is_two_numbers() {
        // A peer's message is decoded field by field; the range must not skip `new`'s check.
        for (start, end) in [(2u32, 2u32), (5, 2), (u32::MAX, 0)] {
            let bytes = crate::encode(&(start, end), 64).unwrap();
            let err = crate::decode::<LayerRange>(&bytes, 64).unwrap_err();
            assert!(err.to_string().contains("empty"), "{start}..{end}: {err}");
        }
        let r = LayerRange::new(3, 7).unwrap();
        let bytes = crate::encode(&r, 64).unwrap();
        assert_eq!(bytes, crate::encode(&(3u32, 7u32), 64).unwrap());
        assert_eq!(crate::decode::<LayerRange>(&bytes, 64).unwrap(), r);
    }

    #[test]
    fn generation_ids_are_unique() {
        assert_ne!(GenerationId::new_random(), GenerationId::new_random());
    }
}
