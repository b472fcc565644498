//! Prompt-lookup speculation on a real model: `dcd generate` with `--speculative prompt-lookup`
//! gives the tokens, log-probabilities and final logits of `--speculative off` on real prompts
//! that repeat themselves and on free text, greedy and seeded, and guesses are both kept and
//! dropped along the way (so both paths ran).

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use dc_tests::*;

const PROMPTS: &[&str] = &[
    "def area(width, height):\n    return width * height\n\nThe same function with width \
     renamed to w and height renamed to h:\n\ndef area(",
    "\"The river rose four feet in one night,\" said the mayor. \"We opened the school as a \
     shelter.\" Quote the mayor exactly: \"",
    "List the days of the week, then list them again in the same order: Monday, Tuesday,",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Translate to French: The cat is on the table. The dog is under the table. The bird is",
];

#[test]
fn guesses_change_no_token_of_a_real_model() {
    let model = dc_model::store::installed_smollm2()
        .expect("SmolLM2 is installed (scripts/setup-tests.sh)");
    let m = model.to_str().unwrap();
    let (mut kept, mut dropped) = (0, 0);
    for (p, prompt) in PROMPTS.iter().enumerate() {
        for (t, seed) in [("0", "0"), ("0.8", "1"), ("1.2", "9")] {
            let run = |mode: &str| {
                generate_json(&[
                    "--model",
                    m,
                    "--prompt",
                    prompt,
                    "--max-new-tokens",
                    "40",
                    "--temperature",
                    t,
                    "--top-p",
                    "0.95",
                    "--seed",
                    seed,
                    "--top-logprobs",
                    "2",
                    "--speculative",
                    mode,
                ])
            };
            let (off, on) = (run("off"), run("prompt-lookup"));
            let what = format!("prompt {p}, temperature {t}, seed {seed}");
            assert_eq!(on["tokens"], off["tokens"], "{what}");
            assert_eq!(on["logprobs"], off["logprobs"], "{what}");
            assert_eq!(on["final_logits"], off["final_logits"], "{what}");
            assert_eq!(on["stop"], off["stop"], "{what}");
            assert_eq!(off["speculation"]["drafted"], 0, "{what}");
            let s = &on["speculation"];
            let (drafted, accepted) = (s["drafted"].as_u64(), s["accepted"].as_u64());
            let (drafted, accepted) = (drafted.unwrap(), accepted.unwrap());
            assert!(accepted <= drafted, "{what}: {s}");
            kept += accepted;
            dropped += drafted - accepted;
        }
    }
    assert!(
        kept >= 30 && dropped >= 10,
        "kept {kept}, dropped {dropped}"
    );
}
