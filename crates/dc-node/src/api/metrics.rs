//! `GET /metrics`: the daemon's counters and gauges in the Prometheus text exposition format
//! (version 0.0.4), for scraping by Prometheus or anything that reads it.
//!
//! This module owns the metric names (all prefixed `dcd_`), their help texts and the text
//! format. It only reads what the node already keeps (the same sources as [`crate::status`]);
//! it never changes state and never blocks on more than the short-lived locks status takes.
//! The format is simple enough that a plain text builder beats a dependency.

use std::fmt::Write as _;
use std::sync::atomic::Ordering;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use dc_types::PeerState;

use crate::core::view::coverage;
use crate::daemon::Daemon;

/// The content type Prometheus expects for the text format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Every peer state, so that each `dcd_peers` series exists (at 0) before a peer is in it:
/// a series that appears and disappears breaks `rate()` and alerting on absence.
const PEER_STATES: [PeerState; 4] = [
    PeerState::Loading,
    PeerState::Serving,
    PeerState::Moving,
    PeerState::Leaving,
];

/// The kind of a metric family.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Counter,
    Gauge,
}

/// Builds an exposition: families (`# HELP`, `# TYPE`) followed by their samples.
#[derive(Debug, Default)]
struct Exposition {
    out: String,
}

impl Exposition {
    /// Starts a family. `name` must be a valid metric name (they are all constants here).
    fn family(&mut self, name: &str, kind: Kind, help: &str) -> &mut Self {
        let kind = match kind {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
        };
        // Writing to a String cannot fail.
        let _ = writeln!(self.out, "# HELP {name} {}", escape_help(help));
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
        self
    }

    /// One sample of the family just started.
    fn sample(
        &mut self,
        name: &str,
        labels: &[(&str, &str)],
        value: impl Into<Value>,
    ) -> &mut Self {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{k}=\"{}\"", escape_label(v));
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {}", value.into());
        self
    }

    /// A family with a single unlabelled sample.
    fn single(&mut self, name: &str, kind: Kind, help: &str, value: impl Into<Value>) {
        self.family(name, kind, help).sample(name, &[], value);
    }
}

/// A sample value: integers print exactly (a u64 counter past 2^53 would lose digits as f64).
#[derive(Clone, Copy, Debug)]
enum Value {
    Int(u64),
    Float(f64),
}

impl From<u64> for Value {
    fn from(v: u64) -> Value {
        Value::Int(v)
    }
}

impl From<u32> for Value {
    fn from(v: u32) -> Value {
        Value::Int(u64::from(v))
    }
}

impl From<bool> for Value {
    fn from(v: bool) -> Value {
        Value::Int(u64::from(v))
    }
}

impl From<f64> for Value {
    fn from(v: f64) -> Value {
        Value::Float(v)
    }
}

impl std::fmt::Display for Value {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Value::Int(v) => write!(f, "{v}"),
            // Rust prints "inf" and "NaN"; the format spells them "+Inf", "-Inf", "NaN".
            Value::Float(v) if v.is_nan() => f.write_str("NaN"),
            Value::Float(v) if v == f64::INFINITY => f.write_str("+Inf"),
            Value::Float(v) if v == f64::NEG_INFINITY => f.write_str("-Inf"),
            Value::Float(v) => write!(f, "{v}"),
        }
    }
}

/// Label values escape backslash, double quote and newline.
fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Help texts escape backslash and newline.
fn escape_help(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n")
}

/// The exposition text of the daemon's metrics.
pub fn render(d: &Daemon) -> String {
    let mut e = Exposition::default();
    identity(&mut e, d);
    work(&mut e, d);
    swarm(&mut e, d);
    layers(&mut e, d);
    resources(&mut e, d);
    e.out
}

/// What this daemon is and serves.
fn identity(e: &mut Exposition, d: &Daemon) {
    let node = &d.node;
    let serving = node.serving();
    e.family(
        "dcd_info",
        Kind::Gauge,
        "Constant 1, labelled with what this daemon is and serves.",
    )
    .sample(
        "dcd_info",
        &[
            ("version", env!("CARGO_PKG_VERSION")),
            ("peer_id", &node.local),
            ("model_id", &node.model_id.to_string()),
            ("kernel", node.gemm.kernel().name()),
            (
                "layers",
                &serving
                    .as_ref()
                    .map(|s| s.layers.to_string())
                    .unwrap_or_default(),
            ),
        ],
        1u64,
    );
}

/// The work it has done and does now.
fn work(e: &mut Exposition, d: &Daemon) {
    let (node, stats) = (&d.node, &d.node.stats);
    e.single(
        "dcd_tokens_generated_total",
        Kind::Counter,
        "Tokens this daemon sampled as the head of a generation.",
        stats.tokens.load(Ordering::Relaxed),
    );
    e.single(
        "dcd_hops_served_total",
        Kind::Counter,
        "Hops (one pass of activations through our layers) served, for any head.",
        stats.hops.load(Ordering::Relaxed),
    );
    e.single(
        "dcd_hops_stacked_total",
        Kind::Counter,
        "Hops computed stacked with other generations' hops, one GEMM per product for all.",
        stats.stacked_hops.load(Ordering::Relaxed),
    );
    e.single(
        "dcd_positions_served_total",
        Kind::Counter,
        "Positions (token rows) run through our layers.",
        stats.positions.load(Ordering::Relaxed),
    );
    e.single(
        "dcd_generation_requests_total",
        Kind::Counter,
        "Generations started through this daemon's local API (control or OpenAI).",
        stats.requests.load(Ordering::Relaxed),
    );
    e.single(
        "dcd_active_generations",
        Kind::Gauge,
        "Generations this daemon serves now, as head or stage.",
        node.active_generations(),
    );
    e.single(
        "dcd_max_generations",
        Kind::Gauge,
        "Generations this daemon accepts at once (--max-generations).",
        node.cfg.max_generations as u64,
    );
}

/// The peers it knows, and its own state.
fn swarm(e: &mut Exposition, d: &Daemon) {
    let node = &d.node;
    // Count peers by state under the lock, write after releasing it.
    let mut by_state = [0u64; PEER_STATES.len()];
    {
        let view = node.view.lock().unwrap_or_else(|e| e.into_inner());
        for (_, p) in view.peers() {
            if let Some(i) = PEER_STATES.iter().position(|s| *s == p.announcement.state) {
                by_state[i] += 1;
            }
        }
    }
    e.family(
        "dcd_peers",
        Kind::Gauge,
        "Other peers this daemon knows (same model and protocol), by their announced state.",
    );
    for (s, n) in PEER_STATES.iter().zip(by_state) {
        e.sample("dcd_peers", &[("state", s.name())], n);
    }

    e.family(
        "dcd_state",
        Kind::Gauge,
        "1 for this daemon's current state, 0 for the others.",
    );
    let state = node.state();
    for s in PEER_STATES {
        e.sample("dcd_state", &[("state", s.name())], s == state);
    }
}

/// The model's layers: which it serves, and how the swarm covers them.
fn layers(e: &mut Exposition, d: &Daemon) {
    let node = &d.node;
    let serving = node.serving();
    e.single(
        "dcd_model_layers",
        Kind::Gauge,
        "Layers in the model.",
        node.model_cfg.num_layers as u64,
    );
    e.single(
        "dcd_layers_served",
        Kind::Gauge,
        "Layers this daemon has loaded and serves (0 while loading).",
        serving.as_ref().map_or(0, |s| s.layers.len()),
    );
    e.single(
        "dcd_head_weights",
        Kind::Gauge,
        "1 if this daemon holds the head weights (embedding and output) and can head generations.",
        serving.as_ref().is_some_and(|s| s.head),
    );
    let cov = coverage(node.model_cfg.num_layers as u32, &node.participants());
    e.family(
        "dcd_layer_coverage",
        Kind::Gauge,
        "Healthy serving peers (this daemon included) that hold each layer; 0 means the swarm cannot run the model.",
    );
    for (layer, n) in cov.iter().enumerate() {
        e.sample("dcd_layer_coverage", &[("layer", &layer.to_string())], *n);
    }
}

/// Memory, throughput, uptime and pausing.
fn resources(e: &mut Exposition, d: &Daemon) {
    let node = &d.node;
    e.single(
        "dcd_weights_bytes",
        Kind::Gauge,
        "Memory the loaded weights take (estimate), bytes.",
        node.weights_bytes(),
    );
    e.single(
        "dcd_kv_cache_bytes",
        Kind::Gauge,
        "Memory the KV caches of the generations we serve take, bytes.",
        d.stage.cache_bytes() as u64,
    );
    // No sample when there is no budget: 0 would read as "nothing allowed".
    e.family(
        "dcd_memory_budget_bytes",
        Kind::Gauge,
        "Memory budget for weights and caches (--max-memory), bytes; absent when unlimited.",
    );
    if let Some(m) = node.cfg.max_memory {
        e.sample("dcd_memory_budget_bytes", &[], m);
    }
    e.single(
        "dcd_throughput_tokens_per_second",
        Kind::Gauge,
        "Measured decode throughput of our layers at start-up.",
        f64::from(node.throughput()),
    );
    e.single(
        "dcd_uptime_seconds",
        Kind::Gauge,
        "Seconds since the daemon started.",
        node.started.elapsed().as_secs_f64(),
    );
    e.single(
        "dcd_paused",
        Kind::Gauge,
        "1 while new work is paused (idle-only mode and the machine is busy).",
        node.paused(),
    );
}

/// The metrics page.
pub async fn handler(State(d): State<Daemon>) -> Response {
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], render(&d)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_and_escapes() {
        let mut e = Exposition::default();
        e.family("dcd_x", Kind::Gauge, "a\nb")
            .sample("dcd_x", &[("l", "q\"\\\n")], 3u64)
            .sample("dcd_x", &[], f64::INFINITY)
            .sample("dcd_x", &[("a", "1"), ("b", "2")], 0.5);
        assert_eq!(
            e.out,
            "# HELP dcd_x a\\nb\n# TYPE dcd_x gauge\ndcd_x{l=\"q\\\"\\\\\\n\"} 3\ndcd_x +Inf\ndcd_x{a=\"1\",b=\"2\"} 0.5\n"
        );
    }

    #[test]
    fn big_counters_print_exactly() {
        assert_eq!(Value::from(u64::MAX).to_string(), "18446744073709551615");
        assert_eq!(Value::from(f64::NAN).to_string(), "NaN");
    }
}
