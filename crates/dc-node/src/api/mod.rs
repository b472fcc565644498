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

/// Whether `max_new_tokens` (named `name` in the request) can hold the shortest document
/// `output` asks for.
pub(crate) fn check_output_budget(
    output: &dc_types::OutputFormat,
    max_new_tokens: u32,
    name: &str,
) -> Result<(), String> {
    let schema = dc_model::json_schema::Schema::for_format(output).map_err(|e| e.to_string())?;
    match schema.map(|s| s.shortest_document_len()) {
        Some(need) if need > max_new_tokens as usize => Err(format!(
            "{name} = {max_new_tokens} cannot hold the shortest JSON document of the requested \
             format ({need} characters, which JSON output may need one token each for)"
        )),
        _ => Ok(()),
    }
}

/// The output format of a request that gives a JSON schema: compiled here, so that a schema
/// the head could not enforce is refused before the generation starts.
pub(crate) fn json_schema_output(
    schema: &serde_json::Value,
) -> Result<dc_types::OutputFormat, String> {
    let text = schema.to_string();
    dc_model::json_schema::Schema::from_text(&text).map_err(|e| e.to_string())?;
    Ok(dc_types::OutputFormat::JsonSchema(text))
}
