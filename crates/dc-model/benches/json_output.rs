//! What JSON output costs at the head, next to the model's own decode step, in the same run:
//! reading every token's text once per model, and one position's check of the whole
//! vocabulary against the document so far (at the start, inside a string, after a value,
//! inside a number, and with a schema inside a key and an enum). SmolLM2-135M (vocabulary
//! 49 152), one thread.
//! `cargo bench -p dc-model --bench json_output` (needs `scripts/fetch-model.sh`).

#![allow(clippy::unwrap_used)] // a benchmark: a panic is the failure report

use std::sync::Arc;
use std::time::Instant;

use dc_kernels::{Gemm, Kernel};
use dc_model::generate::LocalPipeline;
use dc_model::json_output::{JsonConstraint, JsonOutput, TokenTexts};
use dc_model::json_schema::Schema;
use dc_model::tokenizer::load_for_model;
use dc_model::{LoadOptions, Model};

/// Median of `runs` timings of `f`, in milliseconds.
fn median_ms(runs: usize, mut f: impl FnMut()) -> f64 {
    let mut t: Vec<f64> = (0..runs)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[runs / 2]
}

fn main() {
    let Some(path) = dc_model::store::installed_smollm2() else {
        eprintln!("SmolLM2 is not installed: run scripts/fetch-model.sh");
        return;
    };
    let (tok, _, _) = load_for_model(&path).expect("the tokenizer");
    let start = Instant::now();
    let texts = Arc::new(TokenTexts::new(&tok).expect("token texts"));
    let read_ms = start.elapsed().as_secs_f64() * 1e3;
    let vocab = texts.len();

    let model = Model::load(&path, &LoadOptions::default()).expect("the model");
    let gemm = Gemm::new(Kernel::best(), 1).expect("one thread");
    let mut p = LocalPipeline::new(&model, 1).expect("a pipeline");
    let prompt = tok.encode("The JSON object for a cat is", false).unwrap();
    p.prefill(&gemm, &prompt, 64).unwrap();
    let decode_ms = median_ms(15, || {
        p.forward(&gemm, &[13], false).unwrap();
    });

    println!("vocabulary {vocab}, token texts read once in {read_ms:.0} ms");
    println!(
        "one decode step of the model: {decode_ms:.2} ms (1 thread, {:?})",
        Kernel::best()
    );
    let any = Arc::new(Schema::any_object());
    let cat = Arc::new(
        Schema::from_text(
            r#"{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                "nickname": {"type": "string"}, "colour": {"enum": ["black", "white", "ginger", "grey"]}},
                "required": ["name", "age", "colour"]}"#,
        )
        .unwrap(),
    );
    println!(
        "| schema | document so far | check of the whole vocabulary | share of a decode step |"
    );
    println!("|---|---|---|---|");
    for (label, schema, what, prefix) in [
        ("any object", &any, "nothing", ""),
        ("any object", &any, "inside a string", "{\"name\": \"Fel"),
        ("any object", &any, "after a value", "{\"name\": \"Felix\""),
        ("any object", &any, "inside a number", "{\"age\": 12"),
        ("a cat", &cat, "nothing", ""),
        ("a cat", &cat, "inside a key", "{\"n"),
        ("a cat", &cat, "inside a string", "{\"name\": \"Fel"),
        ("a cat", &cat, "after a value", "{\"name\": \"Felix\""),
        ("a cat", &cat, "inside an enum", "{\"colour\": \"g"),
    ] {
        let output = JsonOutput::new(texts.clone(), schema.clone()).expect("JSON output");
        let mut c = JsonConstraint::new(output);
        for id in tok.encode(prefix, false).unwrap() {
            c.push(id).expect("a valid prefix");
        }
        let ms = median_ms(15, || {
            std::hint::black_box(c.allowed(vocab, 64).unwrap());
        });
        println!(
            "| {label} | {what} | {ms:.2} ms | {:.1} % |",
            ms / decode_ms * 100.0
        );
    }
}
