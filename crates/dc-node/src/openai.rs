//! The OpenAI-compatible HTTP API (to be written).

use std::sync::Arc;

use axum::Router;

use crate::node::Node;

/// The `/v1/...` routes.
pub fn router() -> Router<Arc<Node>> {
    Router::new()
}
