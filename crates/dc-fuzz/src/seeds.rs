//! The seed inputs of every target: one or more valid inputs each (encoded messages, a small
//! model file, request bodies, a config file, a key file), from which the fuzzers and the
//! property tests mutate. `scripts/fuzz.sh` writes them out as the fuzzers' starting corpora.

use dc_types::{
    Announcement, CacheRowsRequest, Commitment, GenerationEvent, GenerationId, GenerationRequest,
    Gossip, HopRecord, HopRequest, HopResponse, HopTrace, LayerRange, LayerReveal, ModelId,
    PeerState, Point, RevealPick, RevealRequest, RevealedRow, RouteHop, Signed, StageRequest,
    StageResponse, TraceEntry, VerifyMode, WireActivations, WireSampling,
};
use serde::Serialize;
use serde_json::json;

fn encoded<T: Serialize>(msg: &T) -> Vec<u8> {
    dc_types::encode(msg, usize::MAX).expect("a seed encodes")
}

fn with_selector(sel: u8, rest: &[u8]) -> Vec<u8> {
    let mut v = vec![sel];
    v.extend_from_slice(rest);
    v
}

fn activations(start: u32, rows: usize) -> WireActivations {
    WireActivations {
        start,
        hidden: 64,
        data: (0..rows * 64).map(|i| i as f32 * 0.01 - 0.3).collect(),
    }
}

fn layers() -> LayerRange {
    LayerRange { start: 1, end: 3 }
}

fn record() -> HopRecord {
    HopRecord {
        generation: GenerationId([3; 16]),
        step: 0,
        layers: layers(),
        input: Commitment([1; 32]),
        output: Commitment([2; 32]),
        gemms: Commitment([4; 32]),
        previous: HopRecord::FIRST,
    }
}

fn signed(body: HopRecord) -> Signed<HopRecord> {
    Signed {
        body,
        public_key: vec![8; 36],
        signature: vec![9; 64],
    }
}

fn trace() -> HopTrace {
    HopTrace {
        from: 0,
        entries: vec![
            TraceEntry {
                layer: 1,
                point: Point::Input,
                commitment: Commitment([5; 32]),
            },
            TraceEntry {
                layer: 1,
                point: Point::Down,
                commitment: Commitment([6; 32]),
            },
        ],
    }
}

/// A small-valued canonical row (12 bytes a value) of `cols` values.
fn canonical_row(cols: usize) -> Vec<u8> {
    (0..cols)
        .flat_map(|i| {
            let mut v = ((i as i64) * 977 - 3000).to_le_bytes().to_vec();
            v.extend_from_slice(&(-20i32).to_le_bytes());
            v
        })
        .collect()
}

fn reveal() -> LayerReveal {
    LayerReveal {
        layer: 1,
        position: 4,
        input: activations(4, 1),
        next: activations(4, 1),
        rows: vec![
            RevealedRow {
                point: Point::Down,
                cols: 8,
                unit: None,
                encoding: canonical_row(8),
                root: Commitment([6; 32]),
                path: vec![Commitment([1; 32]); 3],
            },
            RevealedRow {
                point: Point::Up,
                cols: 4,
                unit: Some(-24),
                encoding: (0..4i64)
                    .flat_map(|i| (i * 1000 - 1500).to_le_bytes())
                    .collect(),
                root: Commitment([7; 32]),
                path: vec![],
            },
        ],
        cache: vec![0; 48],
    }
}

fn generation_request() -> GenerationRequest {
    GenerationRequest {
        model_id: ModelId(Commitment([7; 32])),
        generation: GenerationId([3; 16]),
        prompt: vec![1, 42, 300, 7],
        max_new_tokens: 8,
        sampling: WireSampling {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.05,
            repetition_penalty: 1.1,
            presence_penalty: 0.5,
            frequency_penalty: -0.25,
            seed: 11,
        },
        stop_tokens: vec![2],
        chunk: 64,
        verify: VerifyMode::Sampled(0.1),
        resume: vec![5],
        speculative: dc_types::Speculation::PromptLookup,
        top_logprobs: Some(3),
        output: dc_types::OutputFormat::JsonSchema(
            r#"{"type":"object","properties":{"a":{"enum":[1,10]},"b":{"type":"array","items":{"type":"string"}}},"required":["a"]}"#.into(),
        ),
    }
}

fn frames(max_new_tokens: u16, events: &[GenerationEvent]) -> Vec<u8> {
    let mut v = max_new_tokens.to_le_bytes().to_vec();
    for e in events {
        let b = encoded(e);
        v.extend_from_slice(&(b.len() as u16).to_le_bytes());
        v.extend_from_slice(&b);
    }
    v
}

/// A minimal GGUF file: the header and one metadata entry, no tensors.
fn gguf() -> Vec<u8> {
    let mut v = b"GGUF".to_vec();
    v.extend_from_slice(&3u32.to_le_bytes());
    v.extend_from_slice(&0u64.to_le_bytes());
    v.extend_from_slice(&1u64.to_le_bytes());
    let key = b"general.architecture";
    v.extend_from_slice(&(key.len() as u64).to_le_bytes());
    v.extend_from_slice(key);
    v.extend_from_slice(&8u32.to_le_bytes());
    v.extend_from_slice(&5u64.to_le_bytes());
    v.extend_from_slice(b"llama");
    v
}

/// A small safetensors file: one f32 tensor.
fn safetensors() -> Vec<u8> {
    let header = br#"{"model.norm.weight":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
    let mut v = (header.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(header);
    v.extend(std::iter::repeat_n(0x3f, 16));
    v
}

/// Every target's seeds, by target name.
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let mut all = wire_seeds();
    all.extend(file_and_body_seeds());
    all
}

/// A fraud proof of every part's shape.
fn fraud_proof() -> dc_types::FraudProof {
    dc_types::FraudProof {
        model_id: ModelId(Commitment([7; 32])),
        accused: "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo".into(),
        kind: dc_types::ProofKind::Recompute { layer: 1 },
        records: vec![signed(record())],
        traces: vec![trace()],
        layer_inputs: vec![activations(0, 3)],
    }
}

/// The wire messages' seeds.
/// A two-file model's manifest: a header and a small file, and two tensors.
fn manifest() -> dc_model::manifest::Manifest {
    use dc_model::manifest::{Manifest, ManifestFile, Piece, PieceTensor, MANIFEST_VERSION};
    let tensor = |name: &str, layer| PieceTensor {
        name: name.into(),
        dtype: "Q8_0".into(),
        shape: vec![64, 32],
        layer,
    };
    let piece = |file, offset, len, tensor| Piece {
        file,
        offset,
        len,
        hash: [5; 32],
        tensor,
    };
    Manifest {
        version: MANIFEST_VERSION,
        files: vec![
            ManifestFile {
                name: "config.json".into(),
                len: 100,
            },
            ManifestFile {
                name: "model.safetensors".into(),
                len: 5000,
            },
        ],
        pieces: vec![
            piece(0, 0, 100, None),
            piece(1, 0, 200, None),
            piece(
                1,
                200,
                2176,
                Some(tensor("model.layers.0.mlp.up_proj.weight", Some(0))),
            ),
            piece(1, 2376, 2176, Some(tensor("lm_head.weight", None))),
        ],
    }
}

fn wire_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let hop = HopRequest {
        model_id: ModelId(Commitment([7; 32])),
        generation: GenerationId([3; 16]),
        step: 2,
        layers: layers(),
        activations: activations(5, 2),
    };
    let reveal_request = RevealRequest {
        generation: GenerationId([3; 16]),
        step: 2,
        picks: vec![RevealPick {
            layer: 1,
            position: 5,
            positions: 1,
            cache_from: 0,
            checks: dc_types::CheckSet(0b1011),
        }],
    };
    let announcement = Announcement {
        protocol_version: dc_types::PROTOCOL_VERSION,
        software: "dcd 0.1.0".into(),
        model_id: ModelId(Commitment([7; 32])),
        layers: Some(LayerRange { start: 0, end: 2 }),
        head: true,
        throughput: 12.5,
        free_memory: 1 << 30,
        state: PeerState::Serving,
        active_generations: 1,
        seq: 9,
        listen_addrs: vec![
            "/ip4/127.0.0.1/tcp/7000".into(),
            "/ip4/10.0.0.1/udp/7000/quic-v1".into(),
        ],
    };
    let done = HopResponse::Done {
        activations: activations(5, 2),
        record: signed(record()),
        trace: trace(),
    };
    let started = GenerationEvent::Started {
        head: "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo".into(),
        route: vec![RouteHop {
            peer: "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo".into(),
            layers: LayerRange { start: 0, end: 4 },
        }],
    };
    vec![
        ("stage_request", encoded(&StageRequest::Hop(hop))),
        (
            "stage_request",
            encoded(&StageRequest::RevealHops(vec![reveal_request.clone(); 2])),
        ),
        (
            "stage_request",
            encoded(&StageRequest::Reveal(reveal_request)),
        ),
        (
            "stage_request",
            encoded(&StageRequest::CacheRows(CacheRowsRequest {
                generation: GenerationId([3; 16]),
                from: 0,
                end: 4,
            })),
        ),
        (
            "stage_request",
            encoded(&StageRequest::Audit(dc_types::AuditRequest {
                model_id: ModelId(Commitment([7; 32])),
                layers: layers(),
                from: 3,
                session: GenerationId([4; 16]),
                hops: vec![activations(0, 3), activations(3, 1)],
                cache: None,
            })),
        ),
        (
            "stage_response",
            encoded(&StageResponse::Hop(Box::new(done))),
        ),
        (
            "stage_response",
            encoded(&StageResponse::Reveal(Ok(vec![reveal()]))),
        ),
        (
            "stage_response",
            encoded(&StageResponse::Proof(Box::new(Some(fraud_proof())))),
        ),
        (
            "stage_response",
            encoded(&StageResponse::Manifest(Ok(manifest()
                .encode()
                .unwrap_or_default()))),
        ),
        (
            "stage_request",
            encoded(&StageRequest::Piece(dc_types::PieceRequest {
                model_id: ModelId(Commitment([7; 32])),
                piece: 1,
                offset: 4096,
                len: 1 << 20,
            })),
        ),
        (
            "stage_request",
            encoded(&StageRequest::Manifest {
                model_id: ModelId(Commitment([7; 32])),
            }),
        ),
        ("gossip", encoded(&Gossip::Announcement(announcement))),
        (
            "gossip",
            encoded(&Gossip::Proof {
                id: Commitment([3; 32]),
                accused: "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo".into(),
            }),
        ),
        ("generation_request", encoded(&generation_request())),
        (
            "generation_events",
            frames(
                4,
                &[
                    started,
                    GenerationEvent::Token {
                        index: 0,
                        id: 5,
                        logprobs: None,
                    },
                    GenerationEvent::Token {
                        index: 1,
                        id: 6,
                        logprobs: Some(dc_types::TokenLogprobs {
                            logprob: -0.25,
                            top: vec![(6, -0.25), (9, -2.0)],
                        }),
                    },
                    GenerationEvent::Corrected {
                        from: 1,
                        tokens: vec![7],
                        logprobs: vec![],
                        liar: "x".into(),
                    },
                    GenerationEvent::Done {
                        tokens: vec![5, 7],
                        stop: "stop".into(),
                        final_logits: Commitment([1; 32]),
                    },
                ],
            ),
        ),
    ]
}

/// The seeds of the file parsers, the texts and the HTTP bodies.
fn file_and_body_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let proof = fraud_proof();
    let chat = json!({"model": "smollm2-135m", "messages": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}
    ], "max_tokens": 16, "temperature": 0.5, "top_p": 0.9, "seed": -3, "stop": ["\n", "."],
       "stream": true, "stream_options": {"include_usage": true}, "logprobs": true,
       "top_logprobs": 2, "response_format": {"type": "json_object"}});
    let completion = json!({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
        "top_k": 5, "ignore_eos": true, "n": 1, "logit_bias": {}, "logprobs": 3,
        "presence_penalty": 0.5, "min_p": 0.1});
    vec![
        ("revealed_row", with_selector(0, &canonical_row(6))),
        ("revealed_row", with_selector(2 | (5 << 2), &canonical_row(5))),
        ("revealed_row", {
            let mut v = vec![1];
            v.extend_from_slice(&(-30i32).to_le_bytes());
            v.extend((0..6i64).flat_map(|i| (i * 12345 - 30000).to_le_bytes()));
            v
        }),
        ("gguf", gguf()),
        ("safetensors", safetensors()),
        (
            "model_config",
            br#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":176,"num_hidden_layers":4,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":512,"max_position_embeddings":128,"rms_norm_eps":1e-6,"rope_theta":10000.0,"tie_word_embeddings":false}"#.to_vec(),
        ),
        ("tokenizer", "The capital of France is <|im_start|>Paris 1234 ✓\n\tüñî".as_bytes().to_vec()),
        (
            "chat_template",
            b"{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}{% if not loop.last %}\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}{{ bos_token ~ eos_token }}".to_vec(),
        ),
        (
            "config_file",
            b"max_memory = \"2GiB\"\nthreads = 2\nlisten = [\"/ip4/0.0.0.0/tcp/7000\"]\nreachability = \"auto\"\n\0DCD_API=127.0.0.1:9000\nDCD_NOPE=1\n".to_vec(),
        ),
        (
            "swarm_key",
            b"/key/swarm/psk/1.0.0/\n/base16/\n00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff\n".to_vec(),
        ),
        (
            "json_schema",
            br#"{"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}, "kind": {"enum": ["a", "ab", 1, 10]}, "tags": {"type": "array", "items": {"type": ["number", "null"]}, "minItems": 1}}, "required": ["name", "kind"], "additionalProperties": {"type": "boolean"}}"#
                .iter()
                .chain(b"\0{\"name\": \"x\\u00e9\", \"kind\": 10, \"tags\": [1.5e3, null], \"zz\": true}")
                .copied()
                .collect(),
        ),
        ("fraud_proof", with_selector(0, &serde_json::to_vec(&proof).expect("JSON"))),
        ("fraud_proof", with_selector(1, &encoded(&proof))),
        ("openai_body", with_selector(1, chat.to_string().as_bytes())),
        ("openai_body", with_selector(0, completion.to_string().as_bytes())),
        (
            "control_body",
            br#"{"prompt": "Hello", "max_new_tokens": 4, "temperature": 0.8, "top_k": 3, "seed": 5, "verify": "sample", "audit_rate": 0.5, "chunk": 2, "top_logprobs": 2, "json_output": true}"#.to_vec(),
        ),
        ("control_body", br#"{"prompt_ids": [1, 2, 3], "verify": "all"}"#.to_vec()),
    ]
}
