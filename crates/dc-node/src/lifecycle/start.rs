//! Start-up and exit: the self-test, the model's id, the identity, the network, the rooms
//! (node, stage, checks), the control API, the layers chosen and loaded, the tasks that run
//! while the daemon serves, and the graceful exit on SIGINT/SIGTERM (announce leaving, finish
//! what is served, announce again).

use std::sync::Arc;
use std::time::{Duration, Instant};

use dc_kernels::{Gemm, Kernel};
use dc_model::tokenizer::{load_for_model, SpecialTokens};
use dc_net::NetConfig;
use dc_types::{LayerRange, ModelId, PeerState, PROTOCOL_VERSION};
use tokio::sync::watch;

use super::events::{on_net_event, spawn_event_handler, spawn_generation_streams};
use super::gossip::announce;
use super::shards::{choose_auto, load, measure_throughput, periodic};
use crate::core::memory::{head_bytes, layer_bytes, layers_that_fit};
use crate::core::{LayerChoice, Node, NodeConfig, NodeParts, MAX_ANNOUNCEMENT};
use crate::daemon::Daemon;
use crate::stage::HopRunner;

/// Starts the daemon and runs it until SIGINT or SIGTERM.
pub async fn run(cfg: NodeConfig) -> Result<(), String> {
    if cfg.selftest {
        selftest()?;
        println!("self-test passed ({} kernels)", Kernel::supported().len());
    }
    let s = start_node(cfg).await?;
    let (node, events) = (s.node, s.events);
    let weights = crate::weights::Weights::new(node.clone(), s.manifest, s.corrupt_peers)?;
    let d = Daemon::new(node.clone(), runner(), weights);
    for ev in s.held_back {
        on_net_event(&d, ev);
    }
    println!("peer id {}", node.local);
    println!(
        "model {} (model id {})",
        node.cfg.model.display(),
        node.model_id
    );
    spawn_event_handler(&d, events);
    spawn_generation_streams(&d)?;
    let api = crate::api::serve(d.clone()).await?;
    *node.api_addr.lock().unwrap_or_else(|e| e.into_inner()) = Some(api);
    println!("control API on http://{api}");

    serve_layers(&d).await?;
    sd_notify("READY=1");
    if node.cfg.idle_only {
        crate::idle::spawn(node.clone());
    }
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(periodic(d.clone(), stop_rx));

    wait_for_signal().await;
    leave(&d).await;
    let _ = stop_tx.send(true);
    println!("left");
    Ok(())
}

/// How this daemon computes its hops: honestly, unless a test build was told to lie.
fn runner() -> Arc<dyn HopRunner> {
    #[cfg(feature = "fault-injection")]
    if let Some(lying) = crate::stage::fault::chosen() {
        return Arc::new(lying);
    }
    Arc::new(crate::stage::Honest)
}

/// What start-up hands on.
struct Started {
    node: Arc<Node>,
    /// The network's events.
    events: tokio::sync::mpsc::Receiver<dc_net::NetEvent>,
    /// The model's manifest, encoded.
    manifest: Vec<u8>,
    /// Events that arrived while the model's skeleton was fetched.
    held_back: Vec<dc_net::NetEvent>,
    /// Peers that sent corrupt pieces of the skeleton.
    corrupt_peers: std::collections::HashSet<String>,
}

/// The node: the model's shape and id, the identity, the tokenizer, and the network started.
/// A model to fetch gets its manifest and headers from peers first (unless its folder holds
/// them from an earlier start).
async fn start_node(mut cfg: NodeConfig) -> Result<Started, String> {
    let keypair = dc_net::identity::load_or_create(&cfg.data_dir.join("identity.key"))?;
    let local = match cfg.fetch {
        Some(id) => fetched_so_far(&mut cfg, id)?,
        None => Some(
            dc_model::identity::model_manifest(&cfg.model, &cfg.data_dir)
                .map_err(|e| e.to_string())?,
        ),
    };
    let model_id = match (&local, cfg.fetch) {
        (Some((_, id)), _) => ModelId(*id),
        (None, Some(id)) => id,
        (None, None) => return Err("no model".into()),
    };
    let topic = format!(
        "daisychain/announce/{PROTOCOL_VERSION}/{}",
        model_id.short()
    );
    let net = NetConfig {
        listen: cfg.listen.clone(),
        bootstrap: cfg.bootstrap.clone(),
        mdns: cfg.mdns,
        max_request_bytes: cfg.max_message_bytes,
        max_response_bytes: cfg.max_message_bytes,
        max_gossip_bytes: MAX_ANNOUNCEMENT,
        request_timeout: cfg.request_timeout,
        agent: format!("dcd/{}", env!("CARGO_PKG_VERSION")),
        swarm_key: cfg.swarm_key,
        relay_service: cfg.relay_service,
        nat: cfg.nat.clone(),
        max_connections: cfg.max_connections,
        max_connections_per_peer: cfg.max_connections_per_peer,
        ..NetConfig::new(keypair.clone(), topic)
    };
    let (client, mut events, event_loop) = dc_net::start(net)?;
    tokio::spawn(event_loop.run());
    let mut held_back = Vec::new();
    let mut corrupt_peers = std::collections::HashSet::new();
    let manifest = match local {
        Some((bytes, _)) => bytes,
        None => {
            let skeleton = crate::weights::fetch_skeleton(
                &client,
                &mut events,
                &mut held_back,
                model_id,
                &cfg.model,
                cfg.max_message_bytes,
                cfg.request_timeout,
            )
            .await?;
            corrupt_peers = skeleton.corrupt_peers;
            cfg.model = skeleton.model.model_path();
            skeleton.model.manifest_bytes().to_vec()
        }
    };
    let (model_cfg, _) = dc_model::open::open_source(&cfg.model).map_err(|e| e.to_string())?;
    let (tokenizer, chat, special) = match load_for_model(&cfg.model) {
        Ok((t, c, s)) => (Some(t), c, s),
        Err(_) => (
            None,
            None,
            SpecialTokens {
                bos: model_cfg.bos_token_id,
                eos: model_cfg.eos_token_ids.clone(),
                ..SpecialTokens::default()
            },
        ),
    };
    let gemm = Gemm::new(cfg.kernel, cfg.threads).map_err(|e| e.to_string())?;
    let node = Node::new(NodeParts {
        cfg,
        model_cfg,
        model_id,
        client,
        keypair,
        gemm,
        tokenizer,
        chat,
        special,
    });
    Ok(Started {
        node: Arc::new(node),
        events,
        manifest,
        held_back,
        corrupt_peers,
    })
}

/// For a model to fetch into the folder `cfg.model`: its manifest and id if the folder holds
/// the manifest of `id` and every header (then `cfg.model` becomes the model inside it), or
/// `None` when the skeleton must come from peers.
fn fetched_so_far(
    cfg: &mut NodeConfig,
    id: ModelId,
) -> Result<Option<(Vec<u8>, dc_kernels::Commitment)>, String> {
    let dir = cfg.model.clone();
    let Ok(f) = dc_model::fetched::FetchedModel::open(&dir) else {
        return Ok(None);
    };
    if ModelId(f.id()) != id {
        return Err(format!(
            "{} holds the fetched model {}, not {id}: remove the folder to fetch another model there",
            dir.display(),
            f.id()
        ));
    }
    if !f.missing(&f.manifest().meta_pieces()).is_empty() {
        return Ok(None);
    }
    cfg.model = f.model_path();
    Ok(Some((f.manifest_bytes().to_vec(), f.id())))
}

/// Chooses our layers, loads them (with the head weights if they fit), measures them and
/// announces that we serve.
async fn serve_layers(d: &Daemon) -> Result<(), String> {
    let node = &d.node;
    let layers = match node.cfg.layers {
        LayerChoice::Fixed(r) => {
            if r.end as usize > node.model_cfg.num_layers {
                return Err(format!(
                    "--layers {r}: the model has {} layers",
                    node.model_cfg.num_layers
                ));
            }
            r
        }
        LayerChoice::Auto => {
            tokio::time::sleep(node.cfg.discovery_wait).await;
            choose_auto(node)?
        }
    };
    let fits_head = node.cfg.head && head_fits(node, layers);
    if node.cfg.head && !fits_head {
        println!("the head weights do not fit the memory budget: serving without them");
    }
    node.set_serving(load(d, layers, fits_head).await?);
    node.set_throughput(measure_throughput(node).await);
    node.set_state(PeerState::Serving);
    let streamed = node
        .serving()
        .map_or(0, |s| s.model.stream_stats().layers.len());
    println!(
        "serving layers {layers} of {}{}{}",
        node.model_cfg.num_layers,
        if fits_head {
            " with the head weights"
        } else {
            ""
        },
        if streamed > 0 {
            format!(" ({streamed} streamed from the weight cache)")
        } else {
            String::new()
        }
    );
    announce(d).await;
    Ok(())
}

/// Whether the head weights fit the memory budget next to `layers`, or next to the window of
/// layers streamed when `layers` do not all fit.
fn head_fits(node: &Node, layers: LayerRange) -> bool {
    let cfg = &node.model_cfg;
    let least = (layers.len() as usize).min(dc_model::stream::WINDOW);
    node.cfg.max_memory.is_none_or(|m| {
        head_bytes(cfg) + layers.len() as u64 * layer_bytes(cfg) <= m
            || layers_that_fit(cfg, Some(m), true) as usize >= least
    })
}

/// Leaves gracefully: announces it, finishes what we serve (15 s at most), announces again.
async fn leave(d: &Daemon) {
    let node = &d.node;
    println!("leaving: finishing what we serve");
    sd_notify("STOPPING=1");
    node.set_state(PeerState::Leaving);
    announce(d).await;
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline && node.active_generations() > 0 {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    announce(d).await;
    // Give the gossip a moment to leave the machine.
    tokio::time::sleep(Duration::from_millis(300)).await;
}

/// Runs the numeric self-test (golden vectors, every kernel against the reference).
fn selftest() -> Result<(), String> {
    let kernels = Kernel::supported();
    let gold = dc_kernels::golden::run(&kernels);
    let conf = dc_kernels::conformance::sweep(&kernels, &[1, 2], 0xDA15_7C4A_1100_0001);
    if !gold.failures.is_empty() || !conf.failures.is_empty() {
        return Err(format!(
            "self-test failed: {}",
            gold.failures
                .iter()
                .chain(&conf.failures)
                .take(3)
                .cloned()
                .collect::<Vec<_>>()
                .join("; ")
        ));
    }
    Ok(())
}

/// Tells systemd about our state when run as a `Type=notify` service (no-op otherwise).
fn sd_notify(state: &str) {
    #[cfg(unix)]
    if let Some(path) = std::env::var_os("NOTIFY_SOCKET") {
        let sock = match std::os::unix::net::UnixDatagram::unbound() {
            Ok(s) => s,
            Err(_) => return,
        };
        let path = std::path::PathBuf::from(path);
        let _ = sock.send_to(state.as_bytes(), &path);
    }
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            let _ = tokio::signal::ctrl_c().await;
            return;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
