//! The wire messages: every decoder a peer's bytes reach (stage requests and responses over
//! request-response, gossip, the generation stream's request and events), each followed by the
//! checks a daemon runs on what it decoded.

use std::sync::Arc;
use std::time::Instant;

use dc_model::generate::{GenerateRequest, TokenLoop};
use dc_model::json_output::{JsonOutput, TokenTexts};
use dc_model::json_schema::Schema;
use dc_node::core::view::SwarmView;
use dc_node::core::wire::from_wire;
use dc_node::head::bounds::EventBounds;
use dc_types::{
    GenerationEvent, GenerationRequest, Gossip, HopResponse, ModelId, StageRequest, StageResponse,
    WireActivations, HOP_RECORD_KIND,
};

/// The shape activations are checked against (the tiny fixture models').
const HIDDEN: usize = 64;
const POSITIONS: usize = 128;

fn check_activations(w: &WireActivations) {
    if let Ok(a) = from_wire(w.clone(), HIDDEN, POSITIONS) {
        assert_eq!(a.hidden, HIDDEN);
        assert!(
            a.start + a.rows() <= POSITIONS,
            "activations past the model's positions"
        );
    }
}

/// A request a stage receives.
pub fn stage_request(data: &[u8]) {
    let Some(req) = crate::decode_and_reencode::<StageRequest>(data) else {
        return;
    };
    match &req {
        StageRequest::Hop(h) => check_activations(&h.activations),
        StageRequest::Audit(a) => a.hops.iter().for_each(check_activations),
        _ => {}
    }
}

/// A stage's answer, as the head (or an auditor) receives it.
pub fn stage_response(data: &[u8]) {
    let Some(resp) = crate::decode_and_reencode::<StageResponse>(data) else {
        return;
    };
    match resp {
        StageResponse::Hop(h) => {
            if let HopResponse::Done {
                activations,
                record,
                trace,
            } = *h
            {
                check_activations(&activations);
                if dc_net::signing::verify(HOP_RECORD_KIND, &record).is_ok() {
                    let _ = dc_node::check::proof::check_consistency(&record.body, &trace);
                }
                let _ = trace.root();
            }
        }
        StageResponse::Reveal(Ok(reveals)) => crate::reveal::check_reveals(&reveals),
        StageResponse::RevealHops(Ok(hops)) => hops
            .iter()
            .flatten()
            .for_each(|r| crate::reveal::check_reveals(r)),
        StageResponse::Proof(p) => {
            if let Some(p) = *p {
                crate::proof::judge(&p);
            }
        }
        StageResponse::Manifest(Ok(bytes)) => {
            // A manifest a fetching daemon accepts encodes to one it accepts again, and every
            // question the fetch asks of it is answered without a panic.
            if let Ok(m) = dc_model::manifest::Manifest::decode(&bytes) {
                let again = m.encode().map(|b| dc_model::manifest::Manifest::decode(&b));
                assert!(matches!(again, Ok(Ok(ref n)) if *n == m), "{m:?}");
                let needed = m.needed(0..3, true);
                let _ = (m.bytes_of(&needed), m.meta_pieces());
                for f in 0..m.files.len() as u32 {
                    let _ = m.file_path(std::path::Path::new("/m"), f);
                }
                let _ = m.model_path(std::path::Path::new("/m"));
            }
        }
        _ => {}
    }
}

/// A gossip message: announcements go into a peer table, as the daemon's do.
pub fn gossip(data: &[u8]) {
    let Some(Gossip::Announcement(mut ann)) = crate::decode_and_reencode::<Gossip>(data) else {
        return;
    };
    for a in &ann.listen_addrs {
        let _ = a.parse::<dc_net::Multiaddr>();
    }
    let model = ModelId(dc_types::Commitment([7; 32]));
    let mut view = SwarmView::default();
    let now = Instant::now();
    // Once as sent, once for our model and protocol so the table's own checks run.
    let _ = view.update("fuzz-peer", ann.clone(), &model, now);
    ann.model_id = model;
    ann.protocol_version = dc_types::PROTOCOL_VERSION;
    let _ = view.update("fuzz-peer", ann.clone(), &model, now);
    let _ = view.update("other-peer", ann, &model, now);
    // The planner over whatever layer ranges the table took in.
    let serving = view.serving();
    let coverage = dc_node::core::view::coverage(4, &serving);
    let gaps = dc_node::core::view::uncovered(&coverage);
    let g = dc_types::GenerationId([1; 16]);
    let _ = dc_node::core::view::elect_head(&g, &serving);
    if let Ok(route) = dc_node::core::view::plan_route(&g, 4, "fuzz-peer", &serving) {
        assert!(gaps.is_empty(), "a route over uncovered layers {gaps:?}");
        let mut at = 0;
        for hop in &route {
            assert_eq!(hop.layers.start, at, "a route with a hole: {route:?}");
            at = hop.layers.end;
        }
        assert_eq!(at, 4, "a route that stops short: {route:?}");
    }
}

/// A generation request a head receives from another peer; what it accepts is run through the
/// sampling loop the head would run it with (its JSON schema compiled over a vocabulary of
/// printable characters), on logits the input also chooses.
pub fn generation_request(data: &[u8]) {
    let Some(req) = crate::decode_and_reencode::<GenerationRequest>(data) else {
        return;
    };
    let greq = GenerateRequest {
        prompt: req.prompt.clone(),
        max_new_tokens: req.max_new_tokens as usize,
        sampling: dc_node::head::sampling(&req),
        stop_tokens: req.stop_tokens.clone(),
        chunk: req.chunk.max(1) as usize,
        json: json_output(&req.output),
        speculative: dc_model::speculative::Speculation::Off,
    };
    let Ok(mut tl) = TokenLoop::new(&greq, POSITIONS) else {
        return;
    };
    let logits: Vec<f32> = data
        .chunks(4)
        .take(512)
        .map(|c| f32::from(c[0]) - f32::from(*c.last().unwrap_or(&0)))
        .collect();
    for _ in 0..4 {
        match tl.next(&logits) {
            Ok(dc_model::generate::Next::Feed(t)) => assert!((t as usize) < logits.len()),
            _ => break,
        }
    }
}

/// The JSON output `format` asks for over 512 tokens, each a printable ASCII character.
fn json_output(format: &dc_types::OutputFormat) -> Option<JsonOutput> {
    let schema = Schema::for_format(format).ok()??;
    let texts = (0..512u32).map(|i| char::from(b' ' + (i % 95) as u8).to_string());
    JsonOutput::new(Arc::new(TokenTexts::from_texts(texts)), Arc::new(schema)).ok()
}

/// The events a head streams back, in order, through the bounds the requester keeps. The
/// input is a sequence of frames, each a 2-byte length then the event; the first two bytes
/// are the request's `max_new_tokens`.
pub fn generation_events(data: &[u8]) {
    let (max, mut rest) = match data {
        [a, b, rest @ ..] => (u32::from(u16::from_le_bytes([*a, *b])), rest),
        _ => return,
    };
    let mut bounds = EventBounds::new(max, Some(dc_types::MAX_TOP_LOGPROBS));
    while let [a, b, tail @ ..] = rest {
        let len = usize::from(u16::from_le_bytes([*a, *b])).min(tail.len());
        let (frame, next) = tail.split_at(len);
        rest = next;
        let Some(ev) = crate::decode_and_reencode::<GenerationEvent>(frame) else {
            continue;
        };
        if bounds.admit(&ev).is_err() {
            return;
        }
        if let GenerationEvent::Done { tokens, .. } = &ev {
            assert!(
                tokens.len() <= max as usize,
                "a Done past the request's bounds"
            );
        }
    }
}
