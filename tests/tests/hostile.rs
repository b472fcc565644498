//! Hostile or broken peers: messages over the size cap, another model id, another protocol
//! version, activations of the wrong length or with NaN. Each is refused (with an error to the
//! sender where there is one), logged, and the daemon keeps serving others. Peers asking it to
//! head more generations than it allows are refused, and a head streaming more than was asked
//! for is cut off.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::time::Duration;

use dc_net::{NetConfig, NetEvent};
use dc_tests::*;
use dc_types::*;

/// A bare network node of our own, speaking the protocol directly.
async fn intruder(
    topic: String,
    bootstrap: &str,
    max_bytes: usize,
) -> (dc_net::Client, tokio::sync::mpsc::Receiver<NetEvent>) {
    let cfg = NetConfig {
        listen: vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()],
        bootstrap: vec![bootstrap.parse().unwrap()],
        max_request_bytes: max_bytes,
        max_response_bytes: max_bytes,
        max_gossip_bytes: 1 << 20,
        request_timeout: Duration::from_secs(20),
        agent: "intruder".into(),
        ..NetConfig::new(libp2p::identity::Keypair::generate_ed25519(), topic)
    };
    let (client, events, ev_loop) = dc_net::start(cfg).unwrap();
    tokio::spawn(ev_loop.run());
    (client, events)
}

/// The model `d` serves, its swarm's gossip topic, and an intruder in that swarm.
async fn intrude(
    d: &Daemon,
) -> (
    ModelId,
    String,
    dc_net::Client,
    tokio::sync::mpsc::Receiver<NetEvent>,
) {
    let status = d.status();
    let model_id = ModelId(Commitment::from_hex(status["model_id"].as_str().unwrap()).unwrap());
    let topic = format!(
        "daisychain/announce/{PROTOCOL_VERSION}/{}",
        model_id.short()
    );
    let (client, events) = intruder(topic.clone(), &d.addr, 8 << 20).await;
    (model_id, topic, client, events)
}

fn hop(model: ModelId, start: u32, hidden: u32, data: Vec<f32>) -> StageRequest {
    StageRequest::Hop(HopRequest {
        model_id: model,
        generation: GenerationId::new_random(),
        step: 0,
        layers: "0..2".parse().unwrap(),
        activations: WireActivations {
            start,
            hidden,
            data,
        },
    })
}

fn refused(r: Result<StageResponse, dc_net::NetError>) -> (HopErrorKind, String) {
    match r {
        Ok(StageResponse::Hop(h)) => match *h {
            HopResponse::Refused { kind, message } => (kind, message),
            other => panic!("expected a refusal, got {other:?}"),
        },
        other => panic!("expected a hop response, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_messages_are_refused_and_the_daemon_keeps_serving() {
    let model = fixtures().join("llama");
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(
        dir.path(),
        "victim",
        &model,
        &["--layers", "0..4", "--max-message-bytes", "1048576"],
    );
    let (model_id, topic, client, _events) = intrude(&d).await;
    let victim: libp2p::PeerId = d.peer_id.parse().unwrap();

    // Another model id.
    let other = ModelId(Commitment([7; 32]));
    let (kind, msg) = refused(
        client
            .stage_request(victim, hop(other, 0, 64, vec![0.5; 64]))
            .await,
    );
    assert_eq!(kind, HopErrorKind::WrongModel, "{msg}");
    // Activations of the wrong length and width.
    let (kind, msg) = refused(
        client
            .stage_request(victim, hop(model_id, 0, 64, vec![0.5; 100]))
            .await,
    );
    assert_eq!(kind, HopErrorKind::BadActivations);
    assert!(msg.contains("not whole rows of 64"), "{msg}");
    let (kind, msg) = refused(
        client
            .stage_request(victim, hop(model_id, 0, 63, vec![0.5; 63]))
            .await,
    );
    assert!(
        kind == HopErrorKind::BadActivations && msg.contains("63 wide"),
        "{msg}"
    );
    // NaN.
    let mut data = vec![0.5f32; 128];
    data[70] = f32::NAN;
    let (kind, msg) = refused(
        client
            .stage_request(victim, hop(model_id, 0, 64, data))
            .await,
    );
    assert!(
        kind == HopErrorKind::BadActivations
            && msg.contains("non-finite")
            && msg.contains("position 1, channel 6"),
        "{msg}"
    );
    // A position the cache cannot continue from.
    let (kind, msg) = refused(
        client
            .stage_request(victim, hop(model_id, 5, 64, vec![0.5; 64]))
            .await,
    );
    assert!(
        kind == HopErrorKind::BadActivations && msg.contains("no cache"),
        "{msg}"
    );
    // Layers it does not serve.
    let mut h = hop(model_id, 0, 64, vec![0.5; 64]);
    if let StageRequest::Hop(r) = &mut h {
        r.layers = "3..9".parse().unwrap();
    }
    let (kind, _) = refused(client.stage_request(victim, h).await);
    assert_eq!(kind, HopErrorKind::WrongLayers);
    // Reveals: of a hop it served, fine; of anything else, an error naming what is wrong.
    let good = hop(model_id, 0, 64, vec![0.5; 64]);
    let StageRequest::Hop(served) = &good else {
        unreachable!()
    };
    let generation = served.generation;
    let answer = client.stage_request(victim, good.clone()).await.unwrap();
    assert!(
        matches!(&answer, StageResponse::Hop(h) if matches!(**h, HopResponse::Done { .. })),
        "{answer:?}"
    );
    let reveal_of = |step: u64, picks: Vec<(u32, u32)>| RevealRequest {
        generation,
        step,
        picks: picks
            .into_iter()
            .map(|(layer, position)| RevealPick {
                layer,
                position,
                positions: 1,
                cache_from: 0,
                checks: CheckSet(u16::MAX),
            })
            .collect(),
    };
    let reveal = |step, picks| StageRequest::Reveal(reveal_of(step, picks));
    let revealed = |r: Result<StageResponse, dc_net::NetError>| match r {
        Ok(StageResponse::Reveal(r)) => r,
        other => panic!("expected a reveal answer, got {other:?}"),
    };
    let ok = revealed(client.stage_request(victim, reveal(0, vec![(1, 0)])).await).unwrap();
    // Every committed product's row but the KV cache's (q, k, v, context, o, the MLP's hidden
    // row, down) and the MLP's first products' (gate, up; the scores commit through the
    // context), and the layer's cache rows of the hop's one position.
    assert_eq!((ok.len(), ok[0].layer, ok[0].rows.len()), (1, 1, 9));
    let cfg = dc_model::Model::load(&model, &Default::default())
        .unwrap()
        .config;
    let row_bytes =
        dc_model::attention::LayerCache::new(cfg.num_kv_heads, cfg.head_dim).row_bytes();
    assert_eq!(ok[0].cache.len(), row_bytes);
    for (step, picks, why) in [
        (0, vec![(1, 0), (1, 0)], "layer 1 is picked twice"),
        (0, vec![(9, 0)], "layer 9 is not in this hop"),
        (0, vec![(1, 5)], "position 5 is not in this hop"),
        (3, vec![(1, 0)], "is not kept here"),
        (0, vec![], "0 picks"),
        (0, vec![(1, 0); 257], "257 picks"),
    ] {
        let err = revealed(client.stage_request(victim, reveal(step, picks)).await).unwrap_err();
        assert!(err.contains(why), "{err}");
    }
    // Several hops in one exchange: one answer per hop, in order, each as if asked alone.
    let revealed_hops = |r: Result<StageResponse, dc_net::NetError>| match r {
        Ok(StageResponse::RevealHops(r)) => r,
        other => panic!("expected a several-hop reveal answer, got {other:?}"),
    };
    let both =
        StageRequest::RevealHops(vec![reveal_of(0, vec![(1, 0)]), reveal_of(3, vec![(1, 0)])]);
    let answers = revealed_hops(client.stage_request(victim, both).await).unwrap();
    assert_eq!(answers.len(), 2);
    assert_eq!(answers[0].as_ref(), Ok(&ok));
    let err = answers[1].as_ref().unwrap_err();
    assert!(
        err.contains("step 3") && err.contains("is not kept here"),
        "{err}"
    );
    for (n, why) in [(0, "0 hops"), (5, "5 hops: expected 1 to 4")] {
        let many = StageRequest::RevealHops(vec![reveal_of(0, vec![(1, 0)]); n]);
        let err = revealed_hops(client.stage_request(victim, many).await).unwrap_err();
        assert!(err.contains(why), "{err}");
    }
    // Rows past the hop's (it has one), none, or more than one pick may ask: refused by name.
    for (positions, why) in [
        (0, "0 positions from 0 are not rows of this hop"),
        (2, "2 positions from 0 are not rows of this hop"),
        (65, "65 positions in one pick: at most 64"),
        (u32::MAX, "positions in one pick: at most 64"),
    ] {
        let mut wide = reveal(0, vec![(1, 0)]);
        if let StageRequest::Reveal(r) = &mut wide {
            r.picks[0].positions = positions;
        }
        let err = revealed(client.stage_request(victim, wide).await).unwrap_err();
        assert!(err.contains(why), "{err}");
    }
    // Cache rows from past the hop's first position cannot be revealed with it.
    let mut past = reveal(0, vec![(1, 0)]);
    if let StageRequest::Reveal(r) = &mut past {
        r.picks[0].cache_from = 1;
    }
    let err = revealed(client.stage_request(victim, past).await).unwrap_err();
    assert!(err.contains("past the hop's first position"), "{err}");
    // Cache rows: of positions it holds, every layer it runs; of others, an error.
    let rows = |generation, end| {
        StageRequest::CacheRows(CacheRowsRequest {
            generation,
            from: 0,
            end,
        })
    };
    let cache_rows = |r: Result<StageResponse, dc_net::NetError>| match r {
        Ok(StageResponse::CacheRows(r)) => r,
        other => panic!("expected a cache rows answer, got {other:?}"),
    };
    let got = cache_rows(client.stage_request(victim, rows(generation, 1)).await).unwrap();
    assert_eq!(got.len(), served.layers.as_range().len());
    assert!(got.iter().all(|r| r.len() == row_bytes));
    let err = cache_rows(client.stage_request(victim, rows(generation, 2)).await).unwrap_err();
    assert!(err.contains("fewer than 2 positions"), "{err}");
    let backwards = StageRequest::CacheRows(CacheRowsRequest {
        generation,
        from: 1,
        end: 0,
    });
    let err = cache_rows(client.stage_request(victim, backwards).await).unwrap_err();
    assert!(err.contains("backwards"), "{err}");
    let stranger = dc_types::GenerationId([7; 16]);
    let err = cache_rows(client.stage_request(victim, rows(stranger, 1)).await).unwrap_err();
    assert!(err.contains("no cache rows"), "{err}");

    // A second peer that learnt the generation's id (any stage of its route does) can neither
    // continue it, nor start it over (the stage would sign a second run under the id), nor
    // end it, nor read its kept hops or cache rows: they are its head's alone.
    let (other_peer, _other_events) = intruder(topic.clone(), &d.addr, 8 << 20).await;
    let mut next = hop(model_id, 1, 64, vec![0.25; 64]);
    let mut again = hop(model_id, 0, 64, vec![0.25; 64]);
    for h in [&mut next, &mut again] {
        if let StageRequest::Hop(r) = h {
            r.generation = generation;
        }
    }
    for h in [next, again] {
        let (kind, msg) = refused(other_peer.stage_request(victim, h).await);
        assert!(
            kind == HopErrorKind::BadActivations && msg.contains("another peer"),
            "{msg}"
        );
    }
    let err = revealed(
        other_peer
            .stage_request(victim, reveal(0, vec![(1, 0)]))
            .await,
    )
    .unwrap_err();
    assert!(err.contains("is not kept here"), "{err}");
    let err = cache_rows(other_peer.stage_request(victim, rows(generation, 1)).await).unwrap_err();
    assert!(err.contains("no cache rows"), "{err}");
    let ended = other_peer
        .stage_request(victim, StageRequest::End { generation })
        .await;
    assert!(matches!(ended, Ok(StageResponse::Ack)), "{ended:?}");
    // Untouched: its head still reads what it asked for before.
    let still = revealed(client.stage_request(victim, reveal(0, vec![(1, 0)])).await).unwrap();
    assert_eq!(still, ok);

    // Over the size cap: 2 MB of activations against a 1 MiB limit. The daemon refuses to read
    // it; the sender sees the request fail.
    let big = hop(model_id, 0, 64, vec![0.5; 512 * 1024]);
    assert!(
        client.stage_request(victim, big).await.is_err(),
        "an oversized request must not be served"
    );

    // Announcements with another protocol version and another model id.
    let bad = |version: u32, model: ModelId| Announcement {
        protocol_version: version,
        software: "intruder".into(),
        model_id: model,
        layers: Some("0..4".parse().unwrap()),
        head: true,
        throughput: 1e9,
        free_memory: 0,
        state: PeerState::Serving,
        active_generations: 0,
        seq: 1,
        listen_addrs: vec![],
    };
    let me = client.local_peer_id().to_string();
    let mut seen_version = false;
    let mut seen_model = false;
    for _ in 0..100 {
        let _ = client
            .publish(encode(&Gossip::Announcement(bad(99, model_id)), 1 << 16).unwrap())
            .await;
        let _ = client
            .publish(encode(&Gossip::Announcement(bad(PROTOCOL_VERSION, other)), 1 << 16).unwrap())
            .await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let log = d.log_text();
        seen_version |= log.contains(&format!(
            "ignoring peer {me}: it speaks protocol version 99"
        ));
        seen_model |= log.contains(&format!(
            "ignoring peer {me}: it serves model {}",
            other.short()
        ));
        if seen_version && seen_model {
            break;
        }
    }
    assert!(
        seen_version && seen_model,
        "the daemon did not log why it ignored the intruder: {}",
        d.log_text()
    );
    // Garbage on the gossip topic.
    let _ = client.publish(vec![0xff; 100]).await;
    // Proof claims by the dozen, from a peer of its own: the daemon fetches (and would check)
    // one at a time from one peer, however many it hears. The claimant never answers, so the
    // fetch it gets waits for its timeout; before the bound, every claim was fetched at once.
    // Claims go out in rounds of 40 until the gossip mesh carries them, then 3 s are watched.
    let (claimant, mut claimant_events) = intruder(topic.clone(), &d.addr, 8 << 20).await;
    let (mut fetches, mut unanswered, mut watched_from) = (0, Vec::new(), None);
    let start = tokio::time::Instant::now();
    for round in 0u8.. {
        let now = tokio::time::Instant::now();
        if watched_from.is_some_and(|t| now > t + Duration::from_secs(3))
            || now > start + Duration::from_secs(20)
        {
            break;
        }
        if watched_from.is_none() {
            for i in 0..40u8 {
                let mut id = [0u8; 32];
                (id[0], id[1]) = (round, i);
                let claim = Gossip::Proof {
                    id: Commitment(id),
                    accused: "12D3KooWSomebodyElse".into(),
                };
                let _ = claimant.publish(encode(&claim, 1 << 16).unwrap()).await;
            }
        }
        let until = tokio::time::Instant::now() + Duration::from_millis(500);
        while let Ok(Some(ev)) = tokio::time::timeout_at(until, claimant_events.recv()).await {
            if let NetEvent::StageRequest {
                request: StageRequest::GetProof { .. },
                channel,
                ..
            } = ev
            {
                fetches += 1;
                unanswered.push(channel);
                watched_from.get_or_insert(tokio::time::Instant::now());
            }
        }
    }
    assert_eq!(fetches, 1, "proof fetches from one announcing peer at once");
    let status = d.status();
    assert!(
        status["peers"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["peer_id"] != me.as_str()),
        "the intruder must not be listed"
    );
    wait_until(
        "the oversized request to be logged",
        Duration::from_secs(10),
        || d.log_text().contains("refused a stage request"),
    );

    // And it still serves, bit-identical to the local run.
    let api = d.api.clone();
    let m = model.to_str().unwrap().to_string();
    tokio::task::spawn_blocking(move || {
        let a = generate_json(&[
            "--api",
            &api,
            "--prompt-ids",
            "3,1,4,1,5",
            "--max-new-tokens",
            "6",
            "--ignore-eos",
        ]);
        let b = generate_json(&[
            "--model",
            &m,
            "--prompt-ids",
            "3,1,4,1,5",
            "--max-new-tokens",
            "6",
            "--ignore-eos",
        ]);
        assert_eq!(a["tokens"], b["tokens"]);
        assert_eq!(a["final_logits"], b["final_logits"]);
    })
    .await
    .unwrap();
}

/// A generation request as a peer forwards it to the head it elected.
fn forwarded(model_id: ModelId, max_new_tokens: u32) -> GenerationRequest {
    GenerationRequest {
        model_id,
        generation: GenerationId::new_random(),
        prompt: vec![1, 2, 3],
        max_new_tokens,
        sampling: WireSampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        },
        stop_tokens: vec![],
        chunk: 64,
        verify: VerifyMode::Sampled(0.0),
        resume: vec![],
        speculative: dc_types::Speculation::Off,
        top_logprobs: None,
        output: dc_types::OutputFormat::Text,
    }
}

/// Opens a generation stream to `peer`, sends `req` and returns the stream with the head's
/// first event.
async fn ask_to_head(
    client: &dc_net::Client,
    peer: libp2p::PeerId,
    req: &GenerationRequest,
) -> (libp2p::Stream, GenerationEvent) {
    const MAX: usize = 4 << 20;
    let wait = Duration::from_secs(60);
    let mut s = client.open_generation_stream(peer).await.unwrap();
    dc_net::frames::send(&mut s, req, MAX, wait).await.unwrap();
    let first = dc_net::frames::recv(&mut s, MAX, wait).await.unwrap();
    (s, first)
}

/// Peers asking a daemon to head generations get at most `--max-generations` at once, and a
/// peer that hangs up frees its slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_cannot_make_a_daemon_head_more_generations_than_it_allows() {
    let model = dc_model::store::installed_smollm2()
        .expect("SmolLM2 is not installed: run scripts/fetch-model.sh");
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(
        dir.path(),
        "head",
        &model,
        &["--layers", "0..30", "--max-generations", "1"],
    );
    let (model_id, _, client, _events) = intrude(&d).await;
    let victim: libp2p::PeerId = d.peer_id.parse().unwrap();

    // A long generation that is never read from: it holds the one slot.
    let (long, first) = ask_to_head(&client, victim, &forwarded(model_id, 4000)).await;
    assert!(
        matches!(first, GenerationEvent::Started { .. }),
        "{first:?}"
    );
    let (_, refused) = ask_to_head(&client, victim, &forwarded(model_id, 2)).await;
    match refused {
        GenerationEvent::Failed { message } => assert!(
            message.contains("already heading 1 generations"),
            "{message}"
        ),
        other => panic!("a second generation was headed: {other:?}"),
    }
    // Hanging up frees the slot.
    drop(long);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (_, ev) = ask_to_head(&client, victim, &forwarded(model_id, 2)).await;
        if matches!(ev, GenerationEvent::Started { .. }) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the slot stayed taken after the hang-up: {ev:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A peer that wins head elections and streams more tokens than were asked for: the daemon
/// that forwarded the request cuts it off with an error naming the head and what it did,
/// instead of relaying tokens without end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_streaming_more_than_was_asked_is_cut_off() {
    let model = fixtures().join("llama");
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "victim", &model, &["--layers", "0..4"]);
    let (model_id, _, client, _events) = intrude(&d).await;
    let me = client.local_peer_id().to_string();

    // It claims every layer and the head weights, again and again (gossip needs a mesh first).
    let announcer = client.clone();
    tokio::spawn(async move {
        for seq in 1.. {
            let a = Announcement {
                protocol_version: PROTOCOL_VERSION,
                software: "intruder".into(),
                model_id,
                layers: Some("0..4".parse().unwrap()),
                head: true,
                throughput: 1e6,
                free_memory: 0,
                state: PeerState::Serving,
                active_generations: 0,
                seq,
                listen_addrs: vec![],
            };
            let bytes = encode(&Gossip::Announcement(a), 64 << 10).unwrap();
            let _ = announcer.publish(bytes).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    });
    // Headed generations get their route, then tokens without end.
    let mut incoming = client.accept_generation_streams().unwrap();
    tokio::spawn(async move {
        use futures::StreamExt;
        while let Some((_, mut s)) = incoming.next().await {
            tokio::spawn(async move {
                const MAX: usize = 4 << 20;
                let wait = Duration::from_secs(10);
                let req: GenerationRequest = dc_net::frames::recv(&mut s, MAX, wait).await?;
                let started = GenerationEvent::Started {
                    head: "intruder".into(),
                    route: vec![],
                };
                dc_net::frames::send(&mut s, &started, MAX, wait).await?;
                for index in 0..req.max_new_tokens + 100 {
                    let t = GenerationEvent::Token {
                        index,
                        id: 5,
                        logprobs: None,
                    };
                    dc_net::frames::send(&mut s, &t, MAX, wait).await?;
                }
                Ok::<(), dc_net::NetError>(())
            });
        }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !d.status()["peers"].to_string().contains(&me) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the victim never heard the intruder's announcements"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Elections are by generation id: some generations elect the intruder.
    let api = d.api.clone();
    let cut_off = tokio::task::spawn_blocking(move || {
        for _ in 0..40 {
            let out = std::process::Command::new(dcd())
                .args(["generate", "--api", &api, "--prompt-ids", "1,2,3"])
                .args(["--max-new-tokens", "2", "--json"])
                .output()
                .unwrap();
            if !out.status.success() {
                return String::from_utf8_lossy(&out.stderr).into_owned();
            }
        }
        String::new()
    })
    .await
    .unwrap();
    assert!(
        cut_off.contains(&format!("the head {me} broke the protocol"))
            && cut_off.contains("it sent token 2 of at most 2"),
        "{cut_off}"
    );
}

/// A hop starting a new generation over `layers` of the llama fixture (hidden 64).
fn first_hop(model: ModelId, g: GenerationId, layers: &str) -> StageRequest {
    StageRequest::Hop(HopRequest {
        model_id: model,
        generation: g,
        step: 0,
        layers: layers.parse().unwrap(),
        activations: WireActivations {
            start: 0,
            hidden: 64,
            data: vec![0.25; 64],
        },
    })
}

/// A peer that starts generations at a stage and never finishes them cannot lock honest heads
/// out (the stage drops the hoarder's idle caches beyond its fair share), and a flood of
/// reveal and cache-row requests is answered a few at a time while the stage goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hoarding_stage_caches_or_flooding_reveals_does_not_lock_others_out() {
    let model = fixtures().join("llama");
    let dir = tempfile::tempdir().unwrap();
    let head = Daemon::start(dir.path(), "head", &model, &["--layers", "0..2"]);
    let stage = Daemon::start(
        dir.path(),
        "stage",
        &model,
        &[
            "--layers",
            "2..4",
            "--no-head",
            "--max-generations",
            "4",
            "--bootstrap",
            &head.addr,
        ],
    );
    wait_until("the two to see each other", Duration::from_secs(30), || {
        head.sees_serving(1) && stage.sees_serving(1)
    });
    let (model_id, _, client, _events) = intrude(&stage).await;
    let victim: libp2p::PeerId = stage.peer_id.parse().unwrap();

    // The intruder takes every slot and never ends a generation.
    let hoarded: Vec<GenerationId> = (0..4).map(|_| GenerationId::new_random()).collect();
    for g in &hoarded {
        match client
            .stage_request(victim, first_hop(model_id, *g, "2..4"))
            .await
        {
            Ok(StageResponse::Hop(h)) => {
                assert!(matches!(*h, HopResponse::Done { .. }), "{h:?}")
            }
            other => panic!("{other:?}"),
        }
    }
    let (kind, msg) = refused(
        client
            .stage_request(
                victim,
                first_hop(model_id, GenerationId::new_random(), "2..4"),
            )
            .await,
    );
    assert_eq!(kind, HopErrorKind::Overloaded, "{msg}");

    // A flood of reveals and cache rows, all at once.
    let mut flood = Vec::new();
    for i in 0..48u32 {
        let c = client.clone();
        let g = hoarded[i as usize % hoarded.len()];
        let req = if i % 2 == 0 {
            StageRequest::CacheRows(CacheRowsRequest {
                generation: g,
                from: 0,
                end: 1,
            })
        } else {
            StageRequest::Reveal(RevealRequest {
                generation: g,
                step: 0,
                picks: vec![RevealPick {
                    layer: 2,
                    position: 0,
                    positions: 1,
                    cache_from: 0,
                    checks: CheckSet(u16::MAX),
                }],
            })
        };
        flood.push(tokio::spawn(
            async move { c.stage_request(victim, req).await },
        ));
    }
    for f in flood {
        let answer = f.await.unwrap();
        assert!(
            matches!(
                answer,
                Ok(StageResponse::CacheRows(_)) | Ok(StageResponse::Reveal(_))
            ),
            "{answer:?}"
        );
    }
    let peak = stage.status()["reveals_peak"].as_u64().unwrap();
    assert!((1..=4).contains(&peak), "{peak} reveals at once");

    // An honest generation through the full stage: the hoarder's oldest idle cache makes room.
    let args = [
        "--prompt-ids",
        "1,2,3,4",
        "--max-new-tokens",
        "5",
        "--seed",
        "2",
        "--temperature",
        "0.7",
    ];
    let mut swarm_args = vec!["--api", head.api.as_str()];
    swarm_args.extend_from_slice(&args);
    let swarm = generate_json(&swarm_args);
    let mut local_args = vec!["--model", model.to_str().unwrap(), "--local"];
    local_args.extend_from_slice(&args);
    assert_eq!(swarm["tokens"], generate_json(&local_args)["tokens"]);
    assert!(swarm["routes"].to_string().contains(&stage.peer_id));
    assert!(
        stage.log_text().contains("more than its share"),
        "{}",
        stage.log_text()
    );
}

/// The connection limits hold against a crowd: a daemon allowing 3 connections, 2 per peer,
/// is dialled twice each by six intruders and twice more by one of them; it keeps at most 3
/// connections and 2 with any one peer, logs the refusals once, and goes on generating.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_limits_hold_against_a_crowd_of_intruders() {
    let model = fixtures().join("llama");
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start_with_env(
        dir.path(),
        "victim",
        &model,
        &["--layers", "0..4"],
        &[
            ("DCD_MAX_CONNECTIONS", "3"),
            ("DCD_MAX_CONNECTIONS_PER_PEER", "2"),
        ],
    );
    let victim: libp2p::PeerId = d.peer_id.parse().unwrap();
    let addr: libp2p::Multiaddr = d.addr.parse().unwrap();
    let mut crowd = Vec::new();
    for _ in 0..6 {
        let (client, events) = bare_node("crowd");
        for _ in 0..2 {
            let _ = client.dial(addr.clone()).await;
        }
        crowd.push((client, events));
    }
    for _ in 0..2 {
        let _ = crowd[0].0.dial(addr.clone()).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let open = d.status()["connections"]["open"].as_u64().unwrap();
    assert!((1..=3).contains(&open), "{open} connections open");
    let mut connected = 0;
    for (client, _) in &crowd {
        let with_victim = client
            .connections()
            .await
            .unwrap()
            .iter()
            .filter(|c| c.peer == victim)
            .count();
        assert!(with_victim <= 2, "{with_victim} connections with one peer");
        connected += usize::from(with_victim > 0);
    }
    assert!(connected <= 3, "{connected} intruders connected");
    let refusals = d
        .log_text()
        .lines()
        .filter(|l| l.contains("refused a connection from"))
        .count();
    assert_eq!(refusals, 1, "{}", d.log_text());
    // Still serving: a generation through its own layers.
    let out = generate_json(&[
        "--api",
        &d.api,
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "3",
    ]);
    assert_eq!(out["tokens"].as_array().unwrap().len(), 3);
}
