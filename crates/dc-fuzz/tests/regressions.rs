//! The fuzz targets in the normal test run: every input a fuzzer ever crashed
//! (`fuzz/regressions/<target>/`, kept when the crash was fixed) and every seed, replayed; then
//! property tests that mutate the seeds (truncations, byte flips, splices) and feed each
//! target, so that what the fuzzers check keeps holding without a nightly toolchain.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::path::PathBuf;

use dc_fuzz::{seeds::seeds, TARGETS};
use proptest::prelude::*;

fn target(name: &str) -> fn(&[u8]) {
    TARGETS
        .iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("no fuzz target {name}"))
        .1
}

fn regressions() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/regressions")
}

#[test]
fn every_target_has_a_fuzz_binary_and_seeds() {
    let bins = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/fuzz_targets");
    let seeds = seeds();
    for (name, _) in TARGETS {
        assert!(
            bins.join(format!("{name}.rs")).is_file(),
            "fuzz/fuzz_targets/{name}.rs is missing"
        );
        assert!(seeds.iter().any(|(n, _)| n == name), "no seed for {name}");
    }
    for (name, _) in &seeds {
        target(name);
    }
}

#[test]
fn every_kept_crash_is_refused_cleanly() {
    let mut replayed = 0;
    for entry in std::fs::read_dir(regressions()).unwrap() {
        let dir = entry.unwrap().path();
        if !dir.is_dir() {
            continue;
        }
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let run = target(&name);
        for input in std::fs::read_dir(&dir).unwrap() {
            let path = input.unwrap().path();
            let data = std::fs::read(&path).unwrap();
            eprintln!("replaying {}", path.display());
            run(&data);
            replayed += 1;
        }
    }
    eprintln!("{replayed} kept crashes replayed");
}

#[test]
fn seeds_run_and_wire_seeds_decode() {
    for (name, data) in seeds() {
        target(name)(&data);
    }
    // The wire seeds are real messages: they must decode, or the fuzzers start from nothing.
    for (name, data) in seeds() {
        let ok = match name {
            "stage_request" => dc_types::decode::<dc_types::StageRequest>(&data, 1 << 24).is_ok(),
            "stage_response" => dc_types::decode::<dc_types::StageResponse>(&data, 1 << 24).is_ok(),
            "gossip" => dc_types::decode::<dc_types::Gossip>(&data, 1 << 24).is_ok(),
            "generation_request" => {
                dc_types::decode::<dc_types::GenerationRequest>(&data, 1 << 24).is_ok()
            }
            _ => true,
        };
        assert!(ok, "a {name} seed does not decode");
    }
}

/// A seed mutated: cut, bytes overwritten, a run of bytes repeated or dropped.
fn mutated() -> impl Strategy<Value = (usize, Vec<u8>)> {
    let n = seeds().len();
    (
        0..n,
        any::<u64>(),
        prop::collection::vec((any::<u16>(), any::<u8>()), 0..8),
        0u8..4,
    )
        .prop_map(|(i, cut, edits, shape)| {
            let mut data = seeds()[i].1.clone();
            for (at, b) in edits {
                if !data.is_empty() {
                    let at = at as usize % data.len();
                    data[at] = b;
                }
            }
            let len = data.len().max(1);
            let at = (cut as usize) % len;
            match shape {
                0 => data.truncate(at),
                1 => {
                    let run: Vec<u8> = data[at.min(data.len())..]
                        .iter()
                        .take(16)
                        .copied()
                        .collect();
                    data.splice(at.min(data.len())..at.min(data.len()), run);
                }
                2 => {
                    let end = (at + 1 + (cut as usize >> 32) % 16).min(data.len());
                    data.drain(at.min(end)..end);
                }
                _ => {}
            }
            (i, data)
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn mutated_seeds_never_panic_a_target((i, data) in mutated()) {
        let (name, _) = seeds()[i];
        target(name)(&data);
    }

    #[test]
    fn random_bytes_never_panic_a_target(t in 0..TARGETS.len(), data in prop::collection::vec(any::<u8>(), 0..256)) {
        (TARGETS[t].1)(&data);
    }
}
