//! Which layers this daemon serves, and keeping them right: the window an auto daemon takes
//! at start (the least-served layers that fit its memory), loading them on the compute pool,
//! measuring their throughput, and the periodic work (announcements, peer and cache expiry,
//! shard re-checks that move to a better window without leaving a layer uncovered).

use std::sync::Arc;
use std::time::{Duration, Instant};

use dc_model::{LoadOptions, Model};
use dc_types::{LayerRange, PeerState};
use tokio::sync::watch;
use tracing::{info, warn};

use super::gossip::announce;
use crate::core::memory::layers_that_fit;
use crate::core::view::{coverage, least_served_window, should_move, uncovered};
use crate::core::{LayerChoice, Node, Serving};
use crate::daemon::Daemon;

/// Loads `layers` (and the head weights if `head`) on the compute pool, after fetching their
/// pieces from peers if this daemon's model is fetched. Layers beyond what `--max-memory`
/// holds are streamed from the weight cache ([`resident_layers`]).
pub async fn load(d: &Daemon, layers: LayerRange, head: bool) -> Result<Serving, String> {
    d.weights.ensure(layers, head).await?;
    let node = &d.node;
    let resident = resident_layers(node, layers, head)?;
    let (path, data_dir) = (node.cfg.model.clone(), node.cfg.data_dir.clone());
    tokio::task::spawn_blocking(move || {
        let opts = LoadOptions {
            layers: Some(layers.as_range()),
            head,
            cache_in: Some(data_dir),
        };
        let model = match resident {
            Some(r) => Model::load_streaming(&path, &opts, r),
            None => Model::load(&path, &opts),
        }
        .map_err(|e| format!("loading layers {layers}: {e}"))?;
        Ok(Serving {
            model: Arc::new(model),
            layers,
            head,
        })
    })
    .await
    .map_err(|e| e.to_string())?
}

/// How many of `layers` stay in memory when they do not all fit the memory budget (`None`:
/// they fit). The rest are streamed, with room kept for the streamed window.
fn resident_layers(node: &Node, layers: LayerRange, head: bool) -> Result<Option<usize>, String> {
    let fit = layers_that_fit(&node.model_cfg, node.cfg.max_memory, head) as usize;
    let want = layers.len() as usize;
    if want <= fit {
        return Ok(None);
    }
    if fit < dc_model::stream::WINDOW {
        return Err(format!(
            "--max-memory holds {fit} layers{}: streaming layers {layers} from disk needs room for {}",
            if head { " next to the head weights" } else { "" },
            dc_model::stream::WINDOW
        ));
    }
    Ok(Some(fit - dc_model::stream::WINDOW))
}

/// Decode tokens per second of our layers (a few single-position laps on random activations).
pub async fn measure_throughput(node: &Arc<Node>) -> f32 {
    let Some(s) = node.serving() else { return 0.0 };
    let n2 = node.clone();
    tokio::task::spawn_blocking(move || {
        let cfg = &n2.model_cfg;
        let mut cache = dc_model::KvCache::new(cfg, s.layers.as_range());
        let steps = 4.min(cfg.max_positions);
        let start = Instant::now();
        for p in 0..steps {
            let x = dc_model::Activations {
                start: p,
                hidden: cfg.hidden_size,
                data: (0..cfg.hidden_size)
                    .map(|i| ((i * 7 + p) % 13) as f32 / 13.0 - 0.5)
                    .collect(),
            };
            if s.model.run_layers(&n2.gemm, x, &mut cache).is_err() {
                return 0.0;
            }
        }
        steps as f32 / start.elapsed().as_secs_f32().max(1e-6)
    })
    .await
    .unwrap_or(0.0)
}

/// The window an auto daemon takes now.
pub fn choose_auto(node: &Node) -> Result<LayerRange, String> {
    let n = node.model_cfg.num_layers as u32;
    let fit = layers_that_fit(&node.model_cfg, node.cfg.max_memory, node.cfg.head);
    let fit = if fit == 0 {
        // The head does not fit next to even one layer: serve layers only.
        layers_that_fit(&node.model_cfg, node.cfg.max_memory, false)
    } else {
        fit
    };
    if fit == 0 {
        return Err("--max-memory is too small for even one layer".into());
    }
    let others = node
        .view
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .serving();
    let cov = coverage(n, &others);
    let w = least_served_window(n, fit, &cov);
    info!("auto layers: coverage {cov:?}, taking {w}");
    Ok(w)
}

/// Announcements, peer expiry, cache expiry and (auto layers) shard re-checks.
pub async fn periodic(d: Daemon, mut stop: watch::Receiver<bool>) {
    let node = &d.node;
    let auto = node.cfg.layers == LayerChoice::Auto;
    let mut announcing = tokio::time::interval(node.cfg.announce_every);
    // Jitter so that auto daemons seeing the same gap do not all move at once.
    let spread = node.local.bytes().fold(0u8, |a, b| a.wrapping_add(b));
    let jitter = Duration::from_millis(u64::from(spread) * 20);
    let mut rebalance = tokio::time::interval_at(
        tokio::time::Instant::now() + node.cfg.rebalance_every / 2 + jitter,
        node.cfg.rebalance_every,
    );
    // When a gap opens, an auto daemon checks at once, after a jitter within a peer timeout.
    let heal_jitter = node.cfg.peer_timeout.mul_f64(f64::from(spread) / 256.0);
    let mut heal_at: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = announcing.tick() => {
                let now = Instant::now();
                for p in node.view.lock().unwrap_or_else(|e| e.into_inner()).expire(now, node.cfg.peer_timeout) {
                    info!("peer {p} timed out");
                }
                d.stage.expire();
                announce(&d).await;
                if auto && heal_at.is_none() && has_gap(node) {
                    heal_at = Some(tokio::time::Instant::now() + heal_jitter);
                }
            }
            _ = tokio::time::sleep_until(heal_at.unwrap_or_else(tokio::time::Instant::now)), if heal_at.is_some() => {
                heal_at = None;
                if node.state() == PeerState::Serving {
                    if let Err(e) = rebalance_once(&d, true).await {
                        warn!("covering a gap: {e}");
                    }
                }
            }
            _ = rebalance.tick() => {
                if auto && node.state() == PeerState::Serving {
                    if let Err(e) = rebalance_once(&d, false).await {
                        warn!("shard re-check: {e}");
                    }
                }
            }
        }
    }
}

/// Whether some layer is served by no healthy peer (this daemon included).
fn has_gap(node: &Node) -> bool {
    let n = node.model_cfg.num_layers as u32;
    !uncovered(&coverage(n, &node.participants())).is_empty()
}

/// Moves to a better window if the swarm's weakest layer gains and nothing is left uncovered.
/// A daemon busy with generations waits for the next re-check, unless it is `healing` a gap
/// (the generations through its layers then go on at the other peers serving them: it moves
/// only if they are served elsewhere).
async fn rebalance_once(d: &Daemon, healing: bool) -> Result<(), String> {
    let node = &d.node;
    let Some(current) = node.serving() else {
        return Ok(());
    };
    if node.active_generations() > 0 && !healing {
        return Ok(());
    }
    let n = node.model_cfg.num_layers as u32;
    let others = node
        .view
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .serving();
    let cov = coverage(n, &others);
    let proposed = least_served_window(n, current.layers.len(), &cov);
    if !should_move(current.layers, proposed, &cov) {
        return Ok(());
    }
    info!(
        "moving from layers {} to {proposed} (coverage without us: {cov:?})",
        current.layers
    );
    println!("moving from layers {} to {proposed}", current.layers);
    // Keep serving the old range while the new one loads: nothing is uncovered meanwhile.
    let serving = load(d, proposed, current.head).await?;
    node.set_serving(serving);
    announce(d).await;
    println!("serving layers {proposed} of {n}");
    Ok(())
}
