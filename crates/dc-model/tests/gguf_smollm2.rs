//! The real SmolLM2-135M-Instruct GGUF (Q4_1, Q8_0 embedding): its layout, names, shapes and
//! the Hugging Face config built from its metadata, compared with the converted model's
//! `config.json` in the shared fixtures. A missing model is a failure, not a skip.

use std::path::{Path, PathBuf};

use dc_model::gguf::{GgmlType, GgufFile};
use dc_model::TensorSource;
use serde_json::Value as Json;

fn fixtures() -> PathBuf {
    Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/fixtures"
    ))
    .to_path_buf()
}

fn smollm2() -> GgufFile {
    let path = dc_model::store::installed_smollm2().unwrap_or_else(|| {
        panic!(
            "SmolLM2-135M GGUF not installed (looked in {:?}): run scripts/fetch-model.sh",
            dc_model::store::data_dir().ok()
        )
    });
    GgufFile::open(&path).expect("open SmolLM2")
}

#[test]
fn layout_names_and_shapes() {
    let g = smollm2();
    assert_eq!(g.version(), 3);
    assert_eq!(g.architecture(), "llama");
    assert_eq!(g.alignment(), 32);
    assert_eq!(g.gguf_tensors().len(), 272);
    let tensors = g.tensors();
    assert_eq!(tensors.len(), 272, "30 layers × 9 + embedding + final norm");
    let shape = |n: &str| g.info(n).unwrap_or_else(|| panic!("{n} missing")).shape;
    assert_eq!(shape("model.embed_tokens.weight"), [49152, 576]);
    assert_eq!(shape("model.norm.weight"), [576]);
    for l in [0, 17, 29] {
        let p = format!("model.layers.{l}");
        assert_eq!(shape(&format!("{p}.self_attn.q_proj.weight")), [576, 576]);
        assert_eq!(shape(&format!("{p}.self_attn.k_proj.weight")), [192, 576]);
        assert_eq!(shape(&format!("{p}.self_attn.v_proj.weight")), [192, 576]);
        assert_eq!(shape(&format!("{p}.self_attn.o_proj.weight")), [576, 576]);
        assert_eq!(shape(&format!("{p}.mlp.gate_proj.weight")), [1536, 576]);
        assert_eq!(shape(&format!("{p}.mlp.up_proj.weight")), [1536, 576]);
        assert_eq!(shape(&format!("{p}.mlp.down_proj.weight")), [576, 1536]);
        assert_eq!(shape(&format!("{p}.input_layernorm.weight")), [576]);
        assert_eq!(
            shape(&format!("{p}.post_attention_layernorm.weight")),
            [576]
        );
    }
    assert!(g.info("lm_head.weight").is_none(), "tied embeddings");
    assert!(g.info("model.layers.30.input_layernorm.weight").is_none());
    assert_eq!(
        g.gguf_tensor("model.embed_tokens.weight")
            .map(|t| t.ggml_type),
        Some(GgmlType::Q8_0)
    );
    assert_eq!(
        g.gguf_tensor("model.layers.3.mlp.up_proj.weight")
            .map(|t| t.ggml_type),
        Some(GgmlType::Q4_1)
    );
    // Every tensor converts, with the element count its shape says.
    for t in [
        "model.layers.5.self_attn.k_proj.weight",
        "model.layers.5.mlp.down_proj.weight",
        "model.norm.weight",
    ] {
        let v = g.load_f32(t).unwrap();
        assert_eq!(v.len(), g.info(t).unwrap().numel());
        assert!(v.iter().all(|x| x.is_finite()), "{t}");
    }
}

#[test]
fn hf_config_matches_the_converted_models_config() {
    let g = smollm2();
    let ours = g.hf_config().unwrap();
    let text = std::fs::read_to_string(fixtures().join("smollm2-135m/config.json"))
        .expect("fixture config.json");
    let reference: Json = serde_json::from_str(&text).unwrap();
    for key in [
        "architectures",
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "rope_parameters",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "attention_bias",
        "mlp_bias",
    ] {
        assert_eq!(ours[key], reference[key], "config key {key}");
    }
    // The exact f32 epsilon widened to f64, as HF holds it.
    assert_eq!(ours["rms_norm_eps"].as_f64(), Some(f64::from(1e-5f32)));
}

#[test]
fn chat_template_and_tokenizer_metadata_are_there() {
    let g = smollm2();
    let t = g.chat_template().expect("chat template");
    assert!(t.contains("<|im_start|>"), "{t}");
    assert_eq!(g.get_str("tokenizer.ggml.model").unwrap(), Some("gpt2"));
    assert_eq!(g.get_str("tokenizer.ggml.pre").unwrap(), Some("smollm"));
    assert_eq!(
        g.get_str_array("tokenizer.ggml.tokens")
            .unwrap()
            .map(<[String]>::len),
        Some(49152)
    );
}
