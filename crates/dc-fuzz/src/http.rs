//! HTTP request bodies: the OpenAI API's (`/v1/completions`, `/v1/chat/completions`) and the
//! control API's `/generate`, translated into a generation as the daemon translates them,
//! against the SmolLM2 fixture's tokenizer and chat template.

use std::sync::OnceLock;

use dc_model::tokenizer::ChatTemplate;
use dc_node::api::control::{to_request, GenerateBody};
use dc_node::api::openai::{translate, Endpoint};
use dc_node::api::served::Served;
use dc_types::{GenerationRequest, ModelId};

/// SmolLM2's chat template (ChatML, as its GGUF carries it; the fixture folder has none).
const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

fn chatml() -> &'static ChatTemplate {
    static TEMPLATE: OnceLock<ChatTemplate> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        ChatTemplate::new(
            CHATML,
            Some("<|im_start|>".into()),
            Some("<|im_end|>".into()),
        )
        .expect("the ChatML template compiles")
    })
}

/// The served model: SmolLM2's tokenizer and template, a short context so that bounds bite.
fn served() -> Served<'static> {
    let (tokenizer, _, special) = crate::smollm2();
    Served {
        name: "smollm2-135m".into(),
        model_id: ModelId(dc_types::Commitment([7; 32])),
        max_positions: 256,
        vocab_size: tokenizer.vocab_size(),
        tokenizer: Some(tokenizer),
        chat: Some(chatml()),
        eos: &special.eos,
        chunk: 64,
        audit_rate: 0.01,
        speculative: dc_types::Speculation::PromptLookup,
    }
}

/// What every accepted request must be: a prompt that fits with room for a token, ids in the
/// vocabulary, a bounded answer and sampling the head accepts.
fn check_accepted(s: &Served, r: &GenerationRequest) {
    assert!(
        !r.prompt.is_empty() && r.prompt.len() < s.max_positions,
        "prompt of {}",
        r.prompt.len()
    );
    assert!(
        r.prompt.iter().all(|&t| (t as usize) < s.vocab_size),
        "a token beyond the vocabulary"
    );
    assert!(r.max_new_tokens as usize <= s.max_positions);
    assert!(r.chunk >= 1);
    dc_node::head::sampling(r)
        .validate()
        .expect("accepted sampling settings are valid");
}

/// A body for one of the OpenAI endpoints (the first byte chooses which).
pub fn openai_body(data: &[u8]) {
    let (sel, body) = crate::split_first(data);
    let Ok(body) = serde_json::from_slice::<serde_json::Value>(body) else {
        return;
    };
    let endpoint = if sel & 1 == 0 {
        Endpoint::Completion
    } else {
        Endpoint::Chat
    };
    let s = served();
    match translate(&s, endpoint, body) {
        Ok(t) => {
            check_accepted(&s, &t.request);
            assert!(t.stop.len() <= dc_node::api::openai::MAX_STOP_STRINGS);
        }
        Err(e) => assert!(e.status.is_client_error() || e.status.is_server_error()),
    }
}

/// A body for the control API's `POST /generate`.
pub fn control_body(data: &[u8]) {
    let Ok(body) = serde_json::from_slice::<GenerateBody>(data) else {
        return;
    };
    let s = served();
    if let Ok(r) = to_request(&s, body) {
        check_accepted(&s, &r);
    }
}
