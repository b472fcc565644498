//! The model's files shared through the swarm: this daemon serves its manifest and the pieces
//! it holds to peers (`serve.rs`), and a daemon started with only a model id fetches the
//! manifest and then exactly the pieces of the layers it serves (`fetch.rs`), each checked
//! against the manifest's hash before it is used. A peer that sends a piece whose hash is
//! wrong is named and never asked again by this daemon.
//!
//! A daemon with the model's files holds every piece; a fetched one holds what it fetched
//! (`dc_model::fetched`), and serves those to others in turn.

mod fetch;
mod serve;

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use dc_model::fetched::FetchedModel;
use dc_model::manifest::Manifest;
use serde::Serialize;
use tokio::sync::Semaphore;

use crate::core::Node;

pub use fetch::{fetch_skeleton, Skeleton};

/// Pieces read for peers at once; more requests wait their turn.
const READS_AT_ONCE: usize = 4;

/// How a fetch is going, for status.
#[derive(Clone, Debug, Default, Serialize)]
pub struct FetchStatus {
    /// Bytes fetched and checked so far.
    pub done_bytes: u64,
    /// Bytes this fetch needs.
    pub total_bytes: u64,
    /// Pieces fetched and checked so far.
    pub done_pieces: usize,
    /// Pieces this fetch needs.
    pub total_pieces: usize,
    /// Peers that sent a piece whose hash was wrong (never asked again).
    pub corrupt_peers: Vec<String>,
    /// Whether the fetch is over.
    pub finished: bool,
}

/// The model's files as this daemon shares them.
#[derive(Debug)]
pub struct Weights {
    node: Arc<Node>,
    manifest: Manifest,
    manifest_bytes: Vec<u8>,
    /// Where the model is opened from (the files' folder, or the GGUF file).
    model_path: PathBuf,
    /// For a model fetched from peers: the pieces it holds. `None`: every file is here.
    fetched: Option<FetchedModel>,
    reads: Semaphore,
    /// One fetch at a time (a move and a referee's layer may both want pieces).
    fetching: tokio::sync::Mutex<()>,
    status: Mutex<Option<FetchStatus>>,
    /// Peers that sent corrupt pieces.
    avoided: Mutex<HashSet<String>>,
}

impl Weights {
    /// The files of `node`'s model, whose manifest is `manifest_bytes` (checked against the
    /// node's model id by whoever made it), never asking the peers in `avoided` for a piece.
    pub fn new(
        node: Arc<Node>,
        manifest_bytes: Vec<u8>,
        avoided: HashSet<String>,
    ) -> Result<Weights, String> {
        let manifest = Manifest::decode(&manifest_bytes).map_err(|e| e.to_string())?;
        let model_path = node.cfg.model.clone();
        let fetched = match dc_model::fetched::fetched_folder(&model_path) {
            Some(dir) => Some(FetchedModel::open(&dir).map_err(|e| e.to_string())?),
            None => None,
        };
        Ok(Weights {
            node,
            manifest,
            manifest_bytes,
            model_path,
            fetched,
            reads: Semaphore::new(READS_AT_ONCE),
            fetching: tokio::sync::Mutex::new(()),
            status: Mutex::new(None),
            avoided: Mutex::new(avoided),
        })
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Whether this daemon fetched its model from peers.
    pub fn is_fetched(&self) -> bool {
        self.fetched.is_some()
    }

    /// Whether piece `i` is here to be read.
    fn holds(&self, i: u32) -> bool {
        match &self.fetched {
            Some(f) => f.holds(i),
            None => (i as usize) < self.manifest.pieces.len(),
        }
    }

    /// The last fetch's progress, if this daemon fetched anything.
    pub fn status(&self) -> Option<FetchStatus> {
        self.status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}
