//! A checker's secrets and parameters for one layer, made once from the layer's weights: the
//! checking itself is in `check.rs`. The secret `r` of each product never leaves this value.

use dc_kernels::verify::freivalds::FreivaldsKey;
use dc_kernels::Domain;
use dc_types::Point;

use crate::error::{ModelError, Result};
use crate::model::Model;
use crate::weights::{Mlp, Norm};

/// A checker's secrets and parameters for one layer: `W · r` of each weight product (with `r`
/// kept from every stage), the biases and the norms.
pub struct LayerChecker {
    pub(super) layer: usize,
    pub(super) products: Vec<(Point, FreivaldsKey, Option<Vec<f32>>)>,
    pub(super) attn_norm: Norm,
    pub(super) mlp_norm: Norm,
    pub(super) gelu: bool,
}

impl std::fmt::Debug for LayerChecker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LayerChecker(layer {})", self.layer)
    }
}

impl LayerChecker {
    /// Builds the checker of `layer` (which `model` must hold) for the secret `secret`; each
    /// product gets its own `r`. Costs one pass over the layer's weights; afterwards the
    /// weights can be dropped.
    pub fn new(model: &Model, layer: usize, secret: &[u8; 32]) -> Result<LayerChecker> {
        let l = model
            .layer(layer)
            .ok_or_else(|| ModelError::Input(format!("layer {layer} is not loaded")))??;
        let products = l
            .linear_points()
            .iter()
            .filter_map(|&p| l.linear(p).map(|lin| (p, lin)))
            .map(|(p, lin)| {
                let mut h = Domain::HopRecord.hasher();
                h.update(b"freivalds r");
                h.update(secret);
                h.update(&(layer as u64).to_le_bytes());
                h.update(&[p as u8]);
                let key = FreivaldsKey::new(&lin.w, h.finalize().as_bytes());
                (p, key, lin.bias.clone())
            })
            .collect();
        Ok(LayerChecker {
            layer,
            products,
            attn_norm: l.attn_norm.clone(),
            mlp_norm: l.mlp_norm.clone(),
            gelu: matches!(l.mlp, Mlp::Gelu { .. }),
        })
    }

    /// The layer checked.
    pub fn layer(&self) -> usize {
        self.layer
    }

    /// The unit exponents of `point`'s columns, with which a row of it revealed in units form
    /// is read (for tools and tests that read or rewrite revealed rows); `None` if the layer
    /// has no such product.
    pub fn col_units(&self, point: Point) -> Option<&[i32]> {
        self.key(point).map(|(k, _)| k.col_units())
    }

    pub(super) fn key(&self, point: Point) -> Option<(&FreivaldsKey, Option<&[f32]>)> {
        self.products
            .iter()
            .find(|(p, _, _)| *p == point)
            .map(|(_, k, b)| (k, b.as_deref()))
    }
}
