//! The exactness invariants of NUMERICS.md §6, bit for bit, on every tiny fixture model:
//! any split into stages, any prefill chunking, token-by-token decode with the KV cache and
//! full recomputation, every kernel and thread count give the same logits.

#![allow(clippy::unwrap_used)] // test helpers: a panic is the failure report

mod common;

use common::*;
use dc_kernels::{Gemm, Kernel, PackedWeights, WeightLayout};
use dc_model::generate::{generate, GenerateRequest, LocalPipeline};
use dc_model::sampling::{Penalties, SamplingParams};
use dc_model::{LoadOptions, Model};

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The 40-token fixture sequence (longer than Mistral's window of 16).
fn sequence(model: &str) -> Vec<u32> {
    expected_logits(model).pop().unwrap().0
}

fn load(model: &str) -> Model {
    Model::load(&fixtures().join(model), &LoadOptions::default()).unwrap()
}

#[test]
fn any_split_gives_the_same_logits() {
    for name in TINY {
        let model = load(name);
        let gemm = Gemm::new(Kernel::best(), 2).unwrap();
        let ids = sequence(name);
        let one = bits(
            &LocalPipeline::new(&model, 1)
                .unwrap()
                .prefill_all(&gemm, &ids, 64)
                .unwrap(),
        );
        for ranges in [
            vec![0..2, 2..4],
            vec![0..1, 1..3, 3..4],
            vec![0..1, 1..2, 2..3, 3..4],
            vec![0..3, 3..4],
        ] {
            let mut p = LocalPipeline::with_ranges(&model, &ranges);
            let got = bits(&p.prefill_all(&gemm, &ids, 64).unwrap());
            assert_eq!(one, got, "{name}: split {ranges:?}");
        }
    }
}

#[test]
fn chunked_prefill_decode_and_recomputation_agree_at_every_position() {
    for name in TINY {
        let model = load(name);
        let gemm = Gemm::new(Kernel::best(), 2).unwrap();
        let ids = sequence(name);
        let full = bits(
            &LocalPipeline::new(&model, 2)
                .unwrap()
                .prefill_all(&gemm, &ids, ids.len())
                .unwrap(),
        );
        for chunk in [1, 3, 7, 16, 17, 33] {
            let got = bits(
                &LocalPipeline::new(&model, 2)
                    .unwrap()
                    .prefill_all(&gemm, &ids, chunk)
                    .unwrap(),
            );
            assert_eq!(full, got, "{name}: chunk {chunk}");
        }
        // Recomputation from scratch of every prefix equals the row the long pass produced.
        let vocab = model.config.vocab_size;
        for n in [1, 15, 16, 17, 31, 40] {
            let mut p = LocalPipeline::new(&model, 1).unwrap();
            let last = bits(&p.prefill(&gemm, &ids[..n], n).unwrap());
            assert_eq!(
                &full[(n - 1) * vocab..n * vocab],
                &last[..],
                "{name}: prefix {n}"
            );
        }
    }
}

#[test]
fn generation_with_the_cache_equals_recomputation() {
    for name in TINY {
        let model = load(name);
        let gemm = Gemm::new(Kernel::best(), 1).unwrap();
        let prompt = sequence(name)[..9].to_vec();
        for sampling in [
            SamplingParams::default(),
            SamplingParams {
                temperature: 0.8,
                top_k: Some(40),
                top_p: Some(0.95),
                seed: 11,
                ..Default::default()
            },
            SamplingParams {
                temperature: 0.9,
                min_p: Some(0.05),
                penalties: Penalties {
                    repetition: 1.3,
                    presence: 0.4,
                    frequency: 0.6,
                },
                seed: 5,
                ..Default::default()
            },
        ] {
            let req = GenerateRequest {
                prompt: prompt.clone(),
                max_new_tokens: 30,
                sampling,
                stop_tokens: vec![],
                chunk: 4,
                json: None,
                speculative: dc_model::speculative::Speculation::Off,
            };
            let mut p = LocalPipeline::new(&model, 3).unwrap();
            let out = generate(&mut p, &gemm, &req, |_, _| {}).unwrap();
            assert_eq!(out.tokens.len(), 30);
            // Recompute all logits of prompt + generated in one pass; the generation's final
            // logits are those of its last position.
            let mut all = prompt.clone();
            all.extend_from_slice(&out.tokens[..out.tokens.len() - 1]);
            let mut q = LocalPipeline::new(&model, 1).unwrap();
            let last = q.prefill(&gemm, &all, all.len()).unwrap();
            assert_eq!(bits(&out.final_logits), bits(&last), "{name}");
        }
    }
}

#[test]
fn every_kernel_and_thread_count_gives_the_same_bits() {
    for name in TINY {
        let model = load(name);
        let ids = sequence(name);
        let want = bits(
            &LocalPipeline::new(&model, 1)
                .unwrap()
                .prefill_all(&Gemm::new(Kernel::Scalar, 1).unwrap(), &ids, 13)
                .unwrap(),
        );
        for kernel in Kernel::supported() {
            for threads in [1, 2] {
                let gemm = Gemm::new(kernel, threads).unwrap();
                let got = bits(
                    &LocalPipeline::new(&model, 2)
                        .unwrap()
                        .prefill_all(&gemm, &ids, 40)
                        .unwrap(),
                );
                assert_eq!(want, got, "{name}: {kernel} × {threads}");
            }
        }
    }
}

#[test]
fn loading_only_a_stage_gives_the_same_bits() {
    for name in TINY {
        let full = load(name);
        let ids = sequence(name);
        let gemm = Gemm::new(Kernel::best(), 2).unwrap();
        let want = bits(
            &LocalPipeline::new(&full, 1)
                .unwrap()
                .prefill_all(&gemm, &ids, 40)
                .unwrap(),
        );
        let dir = fixtures().join(name);
        let head = Model::load(
            &dir,
            &LoadOptions {
                layers: Some(0..1),
                head: true,
                cache_in: None,
            },
        )
        .unwrap();
        let mid = Model::load(
            &dir,
            &LoadOptions {
                layers: Some(1..3),
                head: false,
                cache_in: None,
            },
        )
        .unwrap();
        let tail = Model::load(
            &dir,
            &LoadOptions {
                layers: Some(3..4),
                head: false,
                cache_in: None,
            },
        )
        .unwrap();
        assert!(
            mid.embed(&ids, 0).is_err(),
            "a stage without the head cannot embed"
        );
        let mut caches = [
            dc_model::KvCache::new(&full.config, 0..1),
            dc_model::KvCache::new(&full.config, 1..3),
            dc_model::KvCache::new(&full.config, 3..4),
        ];
        let mut x = head.embed(&ids, 0).unwrap();
        x = head.run_layers(&gemm, x, &mut caches[0]).unwrap();
        x = mid.run_layers(&gemm, x, &mut caches[1]).unwrap();
        x = tail.run_layers(&gemm, x, &mut caches[2]).unwrap();
        assert_eq!(want, bits(&head.readout(&gemm, &x).unwrap()), "{name}");
    }
}

/// Packings read back from the weight cache give the same bits as freshly quantised ones; the
/// cache is really read (a planted entry changes the result); a corrupt entry is ignored and
/// rewritten.
#[test]
fn the_weight_cache_gives_the_same_bits_and_is_really_used() {
    for name in TINY {
        let dir = fixtures().join(name);
        let data = tempfile::tempdir().unwrap();
        let cached = LoadOptions {
            cache_in: Some(data.path().to_path_buf()),
            ..LoadOptions::default()
        };
        let ids = sequence(name);
        let gemm = Gemm::new(Kernel::best(), 2).unwrap();
        let logits = |m: &Model| {
            bits(
                &LocalPipeline::new(m, 2)
                    .unwrap()
                    .prefill_all(&gemm, &ids, 40)
                    .unwrap(),
            )
        };
        let want = logits(&load(name));
        let cold = Model::load(&dir, &cached).unwrap();
        assert_eq!(logits(&cold), want, "{name}: cold cache");
        let cache = dc_model::weight_cache::WeightCache::for_model(&dir, data.path()).unwrap();
        let mut entries: Vec<_> = std::fs::read_dir(cache.dir())
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort();
        // Four layers of 6 (GPT-2) or 7 products, and the output projection.
        let per_layer = if name == "gpt2" { 6 } else { 7 };
        assert_eq!(entries.len(), 4 * per_layer + 1, "{name}: {entries:?}");
        let warm = Model::load(&dir, &cached).unwrap();
        assert_eq!(logits(&warm), want, "{name}: warm cache");

        // A corrupt entry is ignored (same bits) and rewritten.
        let victim = &entries[0];
        let good = std::fs::read(victim).unwrap();
        let mut bad = good.clone();
        bad[100] ^= 0x10;
        std::fs::write(victim, &bad).unwrap();
        assert_eq!(logits(&Model::load(&dir, &cached).unwrap()), want, "{name}");
        assert_eq!(
            std::fs::read(victim).unwrap(),
            good,
            "{name}: entry rewritten"
        );

        // A planted valid entry is used: the cache is really read.
        let p = PackedWeights::from_bytes(&good).unwrap();
        let zeros = vec![0f32; p.k() * p.n()];
        let planted =
            PackedWeights::quantize(&zeros, p.k(), p.n(), WeightLayout::NByK, "zeros").unwrap();
        std::fs::write(victim, planted.to_bytes()).unwrap();
        assert_ne!(logits(&Model::load(&dir, &cached).unwrap()), want, "{name}");
    }
}

#[test]
fn guessing_tokens_ahead_changes_no_token_and_no_bit() {
    use dc_model::speculative::{Speculation, SpeculationStats};
    let (mut accepted, mut missed) = (0, 0);
    for name in TINY {
        let model = load(name);
        let gemm = Gemm::new(Kernel::best(), 2).unwrap();
        let ids = sequence(name);
        // The fixture text, and one that repeats itself (prompt lookup finds matches in it).
        let mut looped = ids[..7].to_vec();
        looped.extend_from_within(..);
        looped.extend_from_within(..5);
        for (p, prompt) in [ids[..12].to_vec(), looped].into_iter().enumerate() {
            for (s, sampling) in [
                SamplingParams::default(),
                SamplingParams {
                    temperature: 0.7,
                    top_k: Some(20),
                    seed: 3 + p as u64,
                    ..Default::default()
                },
                SamplingParams {
                    temperature: 1.1,
                    min_p: Some(0.02),
                    penalties: Penalties {
                        repetition: 1.2,
                        presence: 0.3,
                        frequency: 0.1,
                    },
                    seed: 17,
                    ..Default::default()
                },
            ]
            .into_iter()
            .enumerate()
            {
                let run = |speculative, stages| {
                    let req = GenerateRequest {
                        prompt: prompt.clone(),
                        max_new_tokens: 24,
                        sampling: sampling.clone(),
                        stop_tokens: vec![],
                        chunk: 5,
                        json: None,
                        speculative,
                    };
                    let mut p = LocalPipeline::new(&model, stages).unwrap();
                    let mut streamed = Vec::new();
                    let out = generate(&mut p, &gemm, &req, |t, row| {
                        streamed.push((t, bits(row)));
                    })
                    .unwrap();
                    (out, streamed, p.len())
                };
                let (plain, plain_rows, plain_len) = run(Speculation::Off, 1);
                assert_eq!(plain.speculation.drafted, 0);
                for stages in [1, 3] {
                    let (spec, spec_rows, spec_len) = run(Speculation::PromptLookup, stages);
                    let what = format!("{name} prompt {p} sampling {s} stages {stages}");
                    assert_eq!(spec.tokens, plain.tokens, "{what}");
                    assert_eq!(spec.stop, plain.stop, "{what}");
                    assert!(spec_rows == plain_rows, "{what}: the rows tokens came from");
                    assert_eq!(
                        bits(&spec.final_logits),
                        bits(&plain.final_logits),
                        "{what}"
                    );
                    assert_eq!(spec_len, plain_len, "{what}: the caches end where they did");
                    let SpeculationStats {
                        passes,
                        drafted,
                        accepted: a,
                    } = spec.speculation;
                    assert!(
                        a <= drafted && passes + a + 1 >= plain.tokens.len(),
                        "{what}"
                    );
                    accepted += a;
                    missed += drafted - a;
                }
            }
        }
    }
    // Both paths ran: guesses kept, and guesses dropped with the caches rewound past them.
    assert!(
        accepted > 20 && missed > 10,
        "accepted {accepted}, missed {missed}"
    );
}

/// A stage that streams layers from the weight cache computes the same bits and the same
/// commitments as one holding them all: prefill and decode, traced, through two stages; and it
/// really streams (its layers are read from disk as hops reach them, at most a window at once).
#[test]
fn streamed_layers_give_the_same_bits_and_commitments_as_resident_ones() {
    for name in TINY {
        let dir = fixtures().join(name);
        let data = tempfile::tempdir().unwrap();
        let opts = LoadOptions {
            cache_in: Some(data.path().to_path_buf()),
            ..LoadOptions::default()
        };
        let ids = sequence(name);
        let gemm = Gemm::new(Kernel::best(), 2).unwrap();
        let resident = load(name);
        let streamed = Model::load_streaming(&dir, &opts, 1).unwrap();
        let stats = streamed.stream_stats();
        assert_eq!((stats.layers, stats.reads), (vec![1, 2, 3], 0), "{name}");
        assert_eq!(streamed.loaded_layers(), vec![0, 1, 2, 3], "{name}");
        let logits = |m: &Model| {
            bits(
                &LocalPipeline::new(m, 2)
                    .unwrap()
                    .prefill_all(&gemm, &ids, 7)
                    .unwrap(),
            )
        };
        assert_eq!(logits(&streamed), logits(&resident), "{name}: logits");
        assert!(
            streamed.stream_stats().reads >= 3,
            "{name}: layers really read from disk"
        );

        // Hop by hop, traced: prefill then single positions, outputs and trace roots equal.
        let run = |m: &Model| {
            let mut cache = dc_model::KvCache::new(&m.config, 0..4);
            let mut out = Vec::new();
            let mut pos = 0;
            for n in [5, 1, 1, 3] {
                let x = resident.embed(&ids[pos..pos + n], pos).unwrap();
                let mut trace = dc_model::trace::HopTrace::from_position(pos);
                let (y, _) = m.run_layers_kept(&gemm, x, &mut cache, &mut trace).unwrap();
                out.push((bits(&y.data), trace.root()));
                pos += n;
            }
            out
        };
        assert_eq!(run(&streamed), run(&resident), "{name}: hops");
    }
}

/// One generation's hops through layers 0..4: `(output bits, trace)` per hop.
type Hops = Vec<(Vec<u32>, dc_model::trace::HopTrace)>;

#[test]
fn hops_of_several_generations_stacked_give_each_its_own_bits_and_commitments() {
    for name in TINY {
        let model = load(name);
        let gemm = Gemm::new(Kernel::best(), 2).unwrap();
        let ids = sequence(name);
        // Three generations: (first token, tokens per hop); prompts of different lengths and
        // places, then single tokens, one generation dropping out before the last step.
        let plans: [(usize, &[usize]); 3] =
            [(0, &[5, 1, 1, 1]), (3, &[7, 1, 1]), (9, &[1, 1, 1, 1])];
        let embed = |g: usize, pos: usize, n: usize| {
            let at = plans[g].0 + pos;
            model.embed(&ids[at..at + n], pos).unwrap()
        };
        let alone: Vec<Hops> = (0..3)
            .map(|g| {
                let mut cache = dc_model::KvCache::new(&model.config, 0..4);
                let mut pos = 0;
                plans[g]
                    .1
                    .iter()
                    .map(|&n| {
                        let mut trace = dc_model::trace::HopTrace::from_position(pos);
                        let x = embed(g, pos, n);
                        let (y, _) = model
                            .run_layers_kept(&gemm, x, &mut cache, &mut trace)
                            .unwrap();
                        pos += n;
                        (bits(&y.data), trace)
                    })
                    .collect()
            })
            .collect();
        let mut caches: Vec<_> = (0..3)
            .map(|_| dc_model::KvCache::new(&model.config, 0..4))
            .collect();
        let mut pos = [0usize; 3];
        let mut stacked: Vec<Hops> = vec![Vec::new(); 3];
        for step in 0..4 {
            let live: Vec<usize> = (0..3).filter(|&g| step < plans[g].1.len()).collect();
            let mut traces: Vec<_> = live
                .iter()
                .map(|&g| dc_model::trace::HopTrace::from_position(pos[g]))
                .collect();
            let hops = caches
                .iter_mut()
                .enumerate()
                .filter(|(g, _)| live.contains(g))
                .zip(traces.iter_mut())
                .map(|((g, cache), trace)| dc_model::HopInput {
                    x: embed(g, pos[g], plans[g].1[step]),
                    cache,
                    trace,
                    // The second generation's hops are not kept (a head's own, say).
                    keep: g != 1,
                })
                .collect();
            let out = model.run_hops_kept(&gemm, hops).unwrap();
            for ((&g, (y, kept)), trace) in live.iter().zip(out).zip(traces) {
                assert_eq!(
                    kept.bytes() > 0,
                    g != 1,
                    "{name}: generation {g} kept or not"
                );
                pos[g] += plans[g].1[step];
                stacked[g].push((bits(&y.data), trace));
            }
        }
        for g in 0..3 {
            assert_eq!(stacked[g].len(), alone[g].len(), "{name}: generation {g}");
            for (step, (s, a)) in stacked[g].iter().zip(&alone[g]).enumerate() {
                assert_eq!(s.0, a.0, "{name}: generation {g}, hop {step}: output bits");
                assert_eq!(s.1, a.1, "{name}: generation {g}, hop {step}: trace");
            }
        }
    }
}

#[test]
fn a_failed_stack_leaves_every_hop_able_to_run_alone() {
    let name = TINY[0];
    let model = load(name);
    let gemm = Gemm::new(Kernel::best(), 2).unwrap();
    let ids = sequence(name);
    let mut good = dc_model::KvCache::new(&model.config, 0..4);
    let mut bad = dc_model::KvCache::new(&model.config, 0..4);
    let x = model.embed(&ids[..4], 0).unwrap();
    let mut nan = model.embed(&ids[4..6], 0).unwrap();
    nan.data[3] = f32::NAN;
    let (mut t1, mut t2) = (
        dc_model::trace::HopTrace::from_position(0),
        dc_model::trace::HopTrace::from_position(0),
    );
    let hops = vec![
        dc_model::HopInput {
            x: x.clone(),
            cache: &mut good,
            trace: &mut t1,
            keep: true,
        },
        dc_model::HopInput {
            x: nan,
            cache: &mut bad,
            trace: &mut t2,
            keep: true,
        },
    ];
    let err = model.run_hops_kept(&gemm, hops).unwrap_err().to_string();
    assert!(err.contains("NaN"), "the error names the bad value: {err}");
    // The good hop, run again alone on the same cache, gives what it gives on a fresh one.
    let mut trace = dc_model::trace::HopTrace::from_position(0);
    let (again, _) = model
        .run_layers_kept(&gemm, x.clone(), &mut good, &mut trace)
        .unwrap();
    let mut fresh_cache = dc_model::KvCache::new(&model.config, 0..4);
    let mut fresh_trace = dc_model::trace::HopTrace::from_position(0);
    let (fresh, _) = model
        .run_layers_kept(&gemm, x, &mut fresh_cache, &mut fresh_trace)
        .unwrap();
    assert_eq!(bits(&again.data), bits(&fresh.data));
    assert_eq!(trace, fresh_trace);
}
