//! The command line, as clap types. Only parsing: resolving settings and doing work happens in
//! `cmd`.

use clap::{Args, Parser, Subcommand};

/// DaisyChain: run large language models across volunteers' machines, exactly.
#[derive(Debug, Parser)]
#[command(name = "dcd", version, about, propagate_version = true)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

/// Options every command takes.
#[derive(Debug, Args)]
pub struct Global {
    /// GEMM kernel: auto, scalar, avx2, avx512 or avx512-ifma (every kernel gives the same bits)
    /// [env: DCD_KERNEL; default: auto].
    #[arg(long = "kernel", global = true, value_name = "KERNEL")]
    pub kernel_flag: Option<String>,
    // The kernel after resolving the flag, DCD_KERNEL, the config file and the default
    // (`cmd::run` sets it).
    #[arg(skip = String::from("auto"))]
    pub kernel: String,
    // Whether `dcd generate` guesses ahead, resolved the same way (`cmd::run` sets it).
    #[arg(skip)]
    pub speculative: dc_model::speculative::Speculation,
    /// Worker threads for the maths [env: DCD_THREADS; default: all cores].
    // `cmd::run` replaces the flag with the resolved value.
    #[arg(long, global = true)]
    pub threads: Option<usize>,
    /// Config file [default: ~/.config/dcd/dcd.toml, if present]. Precedence: flags, then
    /// DCD_* variables, then this file, then defaults (`dcd config show`).
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,
    /// More log output.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// Less output.
    #[arg(short, long, global = true)]
    pub quiet: bool,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Check the numeric core on this CPU: golden vectors and every kernel against the
    /// scalar reference, bit for bit.
    Selftest(SelftestArgs),
    /// Measure this machine.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Generate text from a prompt (streams it).
    Generate(GenerateArgs),
    /// Write the logits of every position of a token sequence to a safetensors file.
    Logits(LogitsArgs),
    /// Teacher-forced perplexity of a text file.
    Perplexity(PerplexityArgs),
    /// Print the token ids of a text.
    Tokenize(TokenizeArgs),
    /// Run the daemon: join the swarm and serve layers until SIGINT or SIGTERM.
    Join(JoinArgs),
    /// Check a fraud proof with your own copy of the model's weights.
    VerifyProof(VerifyProofArgs),
    /// Private swarms' pre-shared keys.
    #[command(subcommand)]
    SwarmKey(SwarmKeyCommand),
    /// Show the local daemon's status: a live dashboard, or one JSON snapshot.
    Status(StatusArgs),
    /// Inspect the configuration.
    #[command(subcommand)]
    Config(ConfigCommand),
}

/// Every `join` option also comes from a `DCD_*` variable or the config file (`--max-memory`:
/// `DCD_MAX_MEMORY`, `max_memory = ...`); `dcd config show` prints the result.
#[derive(Debug, Args)]
pub struct JoinArgs {
    /// A Hugging Face model folder, a GGUF file, the name of an installed model, an org/name
    /// in the local Hugging Face cache, or a model id (64 hex digits: `dcd status` of a peer
    /// shows it) whose layers are fetched from the peers [env: DCD_MODEL; config: model].
    #[arg(long, short = 'm')]
    pub model: Option<String>,
    /// Layers to serve: a half-open range A..B (0..2 serves layers 0 and 1), or auto
    /// [default: auto].
    #[arg(long)]
    pub layers: Option<String>,
    /// Addresses to listen on (multiaddrs; repeatable) [default: TCP and QUIC on port 7371].
    #[arg(long)]
    pub listen: Vec<String>,
    /// Peers to dial at start (multiaddrs; repeatable).
    #[arg(long)]
    pub bootstrap: Vec<String>,
    /// Do not discover peers on the local network.
    #[arg(long)]
    pub no_mdns: bool,
    /// A private swarm: the pre-shared key file (`dcd swarm-key new FILE` writes one). Only
    /// daemons holding the same key can connect; a private swarm runs over TCP only (QUIC is
    /// off) [env: DCD_SWARM_KEY; config: swarm_key].
    #[arg(long, value_name = "FILE")]
    pub swarm_key: Option<std::path::PathBuf>,
    /// Do not relay for peers behind NAT (by default a daemon relays, within limits, once
    /// AutoNAT finds it publicly reachable).
    #[arg(long)]
    pub no_relay_service: bool,
    /// What this daemon's reachability is, when the operator knows: private (behind a NAT:
    /// reserve slots on relays at once and announce the relayed addresses) or public (relay
    /// for others at once); auto lets AutoNAT find out [default: auto].
    #[arg(long, value_name = "auto|private|public")]
    pub reachability: Option<String>,
    /// Do not hold the head weights (embeddings, final norm, output projection).
    #[arg(long)]
    pub no_head: bool,
    /// Data directory (identity key, caches) [default: the platform data directory].
    #[arg(long)]
    pub data_dir: Option<std::path::PathBuf>,
    /// Control API address HOST:PORT, loopback unless a token is set [default: 127.0.0.1:7370].
    #[arg(long)]
    pub api: Option<String>,
    /// Bearer token the control API requires (prefer DCD_API_TOKEN or the config file: flags
    /// show in `ps`).
    #[arg(long)]
    pub api_token: Option<String>,
    /// Memory budget for weights and caches (e.g. 4GiB) [default: none].
    #[arg(long)]
    pub max_memory: Option<String>,
    /// Generations served at once [default: 8].
    #[arg(long)]
    pub max_generations: Option<usize>,
    /// Seconds between announcements [default: 2].
    #[arg(long)]
    pub announce_secs: Option<f64>,
    /// Seconds between shard re-checks (auto layers) [default: 10].
    #[arg(long)]
    pub rebalance_secs: Option<f64>,
    /// Skip the numeric self-test at start.
    #[arg(long)]
    pub no_selftest: bool,
    /// Largest stage message (request or response) accepted or sent, bytes or a size like
    /// 64MiB [default: 64MiB].
    #[arg(long)]
    pub max_message_bytes: Option<String>,
    /// Serve only while the machine is otherwise idle: pause new work while other processes
    /// keep the CPU busy.
    #[arg(long)]
    pub idle_only: bool,
    /// With --idle-only: other processes' CPU use (0.01 to 1, share of all cores) that pauses
    /// new work [default: 0.5].
    #[arg(long)]
    pub idle_threshold: Option<f64>,
    /// Share of hops to audit by replay on another peer when this daemon heads a
    /// generation (0 to 1; 1 audits every hop) [default: 0.01].
    #[arg(long)]
    pub audit_rate: Option<f64>,
    /// Probability of testing each part (each weight product, the attention, the output) of
    /// each layer of a remote hop by a spot check when this daemon heads a generation: the
    /// stage reveals the rows the drawn parts need at each row of the hop, weight products are
    /// checked by Freivalds' test, the attention recomputed (0 to 1; 1 tests everything; auto:
    /// per stage, the least rate at which a stage corrupting 1 % of its GEMMs in a 256-token
    /// generation escapes with probability at most 10⁻⁶, 0.058 for a 10-layer stage; a prefill
    /// chunk's drawn parts are tested at every row) [default: auto].
    #[arg(long, value_name = "RATE|auto")]
    pub spot_check_rate: Option<dc_node::SpotRate>,
    /// Test builds only (the fault-injection feature): lie on FRACTION of the hops (default
    /// all) by flip-bit, prompt, skip-layer, other-weights, stale, attention, hide, chain,
    /// trace, leave or flip-leave.
    #[arg(long, value_name = "KIND[:FRACTION]", hide = !dc_node::FAULT_INJECTION)]
    pub fault: Option<String>,
}

#[derive(Debug, Args)]
pub struct VerifyProofArgs {
    /// The proof (JSON, as a daemon writes it to `<data dir>/proofs/`).
    pub file: std::path::PathBuf,
    /// Your copy of the model (folder, GGUF file or installed name).
    #[arg(long, short = 'm')]
    pub model: String,
    /// Print the verdict as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// The daemon's control API, a URL or HOST:PORT [default: the `api` setting,
    /// http://127.0.0.1:7370].
    #[arg(long)]
    pub api: Option<String>,
    /// Print the status JSON once.
    #[arg(long, conflicts_with = "once")]
    pub json: bool,
    /// Print the dashboard once as text and exit (the default when stdout is not a terminal).
    #[arg(long)]
    pub once: bool,
}

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Print the resolved configuration and where each value came from (flag, env DCD_*,
    /// file, default).
    Show(ConfigShowArgs),
}

#[derive(Debug, Subcommand)]
pub enum SwarmKeyCommand {
    /// Write a new random pre-shared key for a private swarm to FILE (readable by its owner
    /// only; an existing file is never overwritten). Give the file to every member's
    /// `dcd join --swarm-key FILE`.
    New(SwarmKeyNewArgs),
}

#[derive(Debug, Args)]
pub struct SwarmKeyNewArgs {
    /// Where to write the key.
    pub file: std::path::PathBuf,
}

#[derive(Debug, Args)]
pub struct ConfigShowArgs {
    /// Print {"config_file", "settings": {key: {"value", "source"}}} as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Which model to use.
#[derive(Debug, Args, Clone)]
pub struct ModelArg {
    /// A Hugging Face model folder, a GGUF file, the name of an installed model
    /// (`scripts/fetch-model.sh` installs `smollm2-135m`), or an org/name in the local Hugging
    /// Face cache.
    #[arg(long, short = 'm')]
    pub model: String,
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// A Hugging Face model folder, a GGUF file, the name of an installed model or an org/name
    /// in the local Hugging Face cache (runs in this process).
    #[arg(
        long,
        short = 'm',
        required_unless_present = "api",
        conflicts_with = "api"
    )]
    pub model: Option<String>,
    /// Generate through the swarm via this daemon's control API (http://HOST:PORT).
    #[arg(long)]
    pub api: Option<String>,
    /// Run in this process (the default with --model; here for symmetry with --api).
    #[arg(long, conflicts_with = "api")]
    pub local: bool,
    /// The prompt text.
    #[arg(
        long,
        conflicts_with = "prompt_ids",
        required_unless_present = "prompt_ids"
    )]
    pub prompt: Option<String>,
    /// The prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Upper bound on new tokens.
    #[arg(long, default_value_t = 128)]
    pub max_new_tokens: usize,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep only the k most likely tokens.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Keep the most likely tokens up to this total probability.
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Keep only the tokens at least this fraction as likely as the most likely one.
    #[arg(long)]
    pub min_p: Option<f32>,
    /// Divide positive logits (multiply negative ones) of tokens in the prompt or output by
    /// this (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Subtract this from the logit of every token already generated (-2 to 2).
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    pub presence_penalty: f32,
    /// Subtract this times its count so far from every generated token's logit (-2 to 2).
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    pub frequency_penalty: f32,
    /// Seed of the per-position draws.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Cut the layers into this many stages in this process (the swarm's split, no network).
    #[arg(long, default_value_t = 1)]
    pub stages: usize,
    /// Prefill chunk size in positions.
    #[arg(long, default_value_t = 64)]
    pub chunk: usize,
    /// Print {"prompt_ids", "tokens", "text", "timing": {"first_token_ms",
    /// "decode_tokens_per_s"}, ...} as JSON at the end instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// Constrain the output to one JSON object (it ends the generation once complete).
    #[arg(long)]
    pub json_output: bool,
    /// Constrain the output to one JSON document of the JSON schema in FILE (objects, arrays,
    /// strings, numbers, booleans, enums and required keys; implies --json-output).
    #[arg(long, value_name = "FILE")]
    pub json_schema: Option<std::path::PathBuf>,
    /// Guess tokens ahead by prompt lookup and check each guess in the same pass (the tokens
    /// are the same either way) [env: DCD_SPECULATIVE; default: prompt-lookup; with --api: the
    /// daemon's].
    #[arg(long)]
    pub speculative: Option<dc_model::speculative::Speculation>,
    /// With --json: add "logprobs", each token's log-probability and those of the N most
    /// likely tokens at its position (N at most 20).
    #[arg(long, requires = "json", value_parser = clap::value_parser!(u8).range(0..=20))]
    pub top_logprobs: Option<u8>,
    /// With --api: `all` re-runs every hop on a second peer before its token is released;
    /// `sample` (default) audits random hops.
    #[arg(long, requires = "api")]
    pub verify: Option<String>,
    /// With --api: probability of auditing each remote hop (default: the daemon's).
    #[arg(long, requires = "api")]
    pub audit_rate: Option<f32>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
}

#[derive(Debug, Args)]
pub struct LogitsArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Comma-separated token ids.
    #[arg(long, value_delimiter = ',', required = true)]
    pub ids: Vec<u32>,
    /// Output safetensors file (one f32 tensor `logits`, shape [N, vocab]).
    #[arg(long)]
    pub out: std::path::PathBuf,
    /// Stages to cut the layers into (the result is the same for any value).
    #[arg(long, default_value_t = 1)]
    pub stages: usize,
}

#[derive(Debug, Args)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// The text file.
    #[arg(long)]
    pub file: std::path::PathBuf,
    /// Print {"tokens", "ppl"} as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct TokenizeArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// The text.
    #[arg(long)]
    pub text: String,
    /// Print {"ids": [...]} as JSON.
    #[arg(long)]
    pub json: bool,
    /// Add the model's special tokens (BOS) as its tokenizer would.
    #[arg(long)]
    pub add_special_tokens: bool,
}

#[derive(Debug, Args)]
pub struct SelftestArgs {
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// int8 peak, memory bandwidth and the exact GEMM at decode and prefill shapes.
    Gemm(BenchGemmArgs),
    /// Prefill and decode tokens per second of a model at several thread counts; decode also
    /// as the weights it streams per token against the memory read bandwidth (a model that
    /// fits the last-level cache can exceed 100 %).
    Model(BenchModelArgs),
    /// Decode speed with and without prompt-lookup speculation, on repetitive and free text.
    Speculative(BenchSpeculativeArgs),
    /// Prefill and decode with the layers a memory budget does not hold streamed from the
    /// weight cache, at several budgets.
    Stream(BenchStreamArgs),
    /// Decode hops of several generations at one stage, one after another and stacked into
    /// one pass.
    Stack(BenchStackArgs),
}

#[derive(Debug, Args)]
pub struct BenchStackArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Numbers of generations to measure.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 2, 4, 8])]
    pub generations: Vec<usize>,
    /// Prompt length each generation is prefilled with first.
    #[arg(long, default_value_t = 64)]
    pub prompt_tokens: usize,
    /// Decode steps measured.
    #[arg(long, default_value_t = 16)]
    pub decode_tokens: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct BenchStreamArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Budgets to measure, as fractions of the layers' packed size (1 holds every layer).
    #[arg(long, value_delimiter = ',', default_values_t = [1.0, 0.5, 0.25])]
    pub budgets: Vec<f64>,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Tokens to decode for the decode measurement.
    #[arg(long, default_value_t = 16)]
    pub decode_tokens: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct BenchSpeculativeArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Upper bound on new tokens per generation.
    #[arg(long, default_value_t = 128)]
    pub max_new_tokens: usize,
    /// Runs of each mode per task (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct BenchModelArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Thread counts to measure (default: 1 and all cores).
    #[arg(long, value_delimiter = ',')]
    pub thread_counts: Option<Vec<usize>>,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Tokens to decode for the decode measurement.
    #[arg(long, default_value_t = 32)]
    pub decode_tokens: usize,
    /// Also measure with every product committed (what a stage does for a signed hop record).
    #[arg(long)]
    pub commit: bool,
    /// Also measure spot checks on decode hops: what keeping a hop costs the stage, and per
    /// checked layer the stage's reveal, the checker's work and the bytes on the wire; and
    /// what checks at a rate cost when every hop's parts are drawn as a head draws them and
    /// revealed and checked a batch of hops at a time as a head asks about them.
    #[arg(long)]
    pub spot_check: bool,
    /// The rate `--spot-check` draws parts at (0 to 1, or auto: the rate that meets the
    /// detection goal for a stage of all the model's layers) [default: the daemon's, auto].
    #[arg(long, value_name = "RATE|auto")]
    pub spot_check_rate: Option<dc_node::SpotRate>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct BenchGemmArgs {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Thread counts to measure (default: 1 and all cores).
    #[arg(long, value_delimiter = ',')]
    pub thread_counts: Option<Vec<usize>>,
    /// Kernels to measure (default: every supported SIMD kernel; scalar on decode shapes only).
    #[arg(long, value_delimiter = ',')]
    pub kernels: Option<Vec<String>>,
    /// Seconds to spend on each measurement.
    #[arg(long, default_value_t = 1.0)]
    pub seconds: f64,
    /// Only these shapes, as MxKxN (default: the standard decode and prefill shapes).
    #[arg(long, value_delimiter = ',')]
    pub shapes: Option<Vec<String>>,
    /// Also measure what a stage's commitment adds to each product: keeping the exact
    /// accumulators (for reveals), and hashing the output rows (blake3 leaves, Merkle root),
    /// each as a share of the plain product measured in the same run.
    #[arg(long)]
    pub commit: bool,
}
