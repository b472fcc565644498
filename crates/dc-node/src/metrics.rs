//! `GET /metrics` in Prometheus text format (to be written).

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};

use crate::node::Node;

/// The metrics page.
pub async fn handler(State(node): State<Arc<Node>>) -> Response {
    let _ = node;
    String::new().into_response()
}
