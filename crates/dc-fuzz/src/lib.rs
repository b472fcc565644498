//! What hostile bytes may do to each of `dcd`'s decoders: nothing but be refused. Every
//! function here is the body of one fuzz target (the `fuzz/` crate calls them from
//! `cargo fuzz`) and of its regression suite (`tests/regressions.rs` replays every input a
//! fuzzer ever crashed, and the seeds, in the normal test run).
//!
//! A body takes any bytes and runs them through the same code a daemon runs on what a peer, a
//! file or a client hands it: the wire decoders and the checks that follow them, the model
//! file parsers, the config file, the tokenizer and chat template, fraud-proof files and the
//! HTTP request bodies. It must not panic, hang or allocate beyond the input's bounds; where
//! something must hold of what is accepted (a decoded message encodes back to the same
//! bytes, a fast decoder agrees with its scalar reference), the body asserts it.

use std::fmt::Debug;
use std::path::PathBuf;
use std::sync::OnceLock;

use serde::de::DeserializeOwned;
use serde::Serialize;

pub mod files;
pub mod http;
pub mod proof;
pub mod reveal;
pub mod seeds;
pub mod text;
pub mod wire;

/// One fuzz target: its name (the fuzz binary's, and its folder's under `fuzz/regressions`)
/// and its body.
pub type Target = (&'static str, fn(&[u8]));

/// Every target.
pub const TARGETS: &[Target] = &[
    ("stage_request", wire::stage_request),
    ("stage_response", wire::stage_response),
    ("gossip", wire::gossip),
    ("generation_request", wire::generation_request),
    ("generation_events", wire::generation_events),
    ("revealed_row", reveal::revealed_row),
    ("gguf", files::gguf),
    ("safetensors", files::safetensors),
    ("model_config", files::model_config),
    ("tokenizer", text::tokenizer),
    ("chat_template", text::chat_template),
    ("config_file", text::config_file),
    ("swarm_key", text::swarm_key),
    ("json_schema", text::json_schema),
    ("fraud_proof", proof::fraud_proof),
    ("openai_body", http::openai_body),
    ("control_body", http::control_body),
];

/// The largest input a target decodes (fuzz inputs are far smaller; the daemon's own caps are
/// tested where they are set).
pub(crate) const LIMIT: usize = 1 << 24;

/// Decodes `data` as a `T`; what decodes must encode back to bytes that decode to the same
/// encoding (compared as bytes: activations may hold NaNs, which equal nothing).
pub(crate) fn decode_and_reencode<T>(data: &[u8]) -> Option<T>
where
    T: Serialize + DeserializeOwned + Debug,
{
    let msg: T = dc_types::decode(data, LIMIT).ok()?;
    let bytes = dc_types::encode(&msg, usize::MAX).expect("a decoded message encodes");
    let again: T = dc_types::decode(&bytes, usize::MAX).expect("an encoded message decodes");
    let twice = dc_types::encode(&again, usize::MAX).expect("a decoded message encodes");
    assert_eq!(bytes, twice, "{msg:?} does not survive a round trip");
    Some(msg)
}

/// The shared fixtures (`../shared/fixtures` beside the checkout; `DC_FIXTURES` overrides).
pub fn fixtures() -> PathBuf {
    std::env::var_os("DC_FIXTURES").map_or_else(
        || {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../../shared/fixtures"
            ))
        },
        PathBuf::from,
    )
}

/// The fixture SmolLM2 folder's tokenizer, chat template and special tokens, loaded once.
pub(crate) fn smollm2() -> &'static (
    dc_model::tokenizer::Tokenizer,
    Option<dc_model::tokenizer::ChatTemplate>,
    dc_model::tokenizer::SpecialTokens,
) {
    static LOADED: OnceLock<(
        dc_model::tokenizer::Tokenizer,
        Option<dc_model::tokenizer::ChatTemplate>,
        dc_model::tokenizer::SpecialTokens,
    )> = OnceLock::new();
    LOADED.get_or_init(|| {
        let dir = fixtures().join("smollm2-135m");
        dc_model::tokenizer::load_for_model(&dir)
            .unwrap_or_else(|e| panic!("the SmolLM2 fixture's tokenizer ({}): {e}", dir.display()))
    })
}

/// One product engine for every target (the best kernel, one thread), made once.
pub(crate) fn gemm() -> &'static dc_kernels::Gemm {
    static GEMM: OnceLock<dc_kernels::Gemm> = OnceLock::new();
    GEMM.get_or_init(|| {
        dc_kernels::Gemm::new(dc_kernels::Kernel::best(), 1).expect("the best kernel runs here")
    })
}

/// A scratch folder for the files a target writes, one per thread: the loaders map the files
/// they open, and a file rewritten under another thread's mapping would fault that thread
/// (SIGBUS) when the test harness runs targets side by side.
pub(crate) fn scratch() -> PathBuf {
    thread_local! {
        static DIR: tempfile::TempDir = tempfile::tempdir().expect("a scratch folder");
    }
    DIR.with(|dir| dir.path().to_path_buf())
}

/// Splits fuzz input into a selector byte and the rest (for targets that cover several
/// shapes of input with one corpus).
pub(crate) fn split_first(data: &[u8]) -> (u8, &[u8]) {
    match data.split_first() {
        Some((&b, rest)) => (b, rest),
        None => (0, data),
    }
}
