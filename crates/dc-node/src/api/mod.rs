//! The daemon's HTTP face, above every other room: the control API (`control.rs`: status,
//! generate, the bearer token), the OpenAI-compatible API (`openai.rs`, its log-probabilities
//! in `logprobs.rs`), the served model as
//! both see it (`served.rs`), the status document
//! (`status.rs`) and the Prometheus metrics (`metrics.rs`).

pub mod control;
pub mod logprobs;
pub mod metrics;
pub mod openai;
pub mod served;
pub mod status;

pub use control::serve;
