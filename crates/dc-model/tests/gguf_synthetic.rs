//! GGUF reading on files written by test code: metadata of every type, alignment, every
//! dtype with hand-built blocks and values computed from the spec, the Q/K un-permutation,
//! and the Hugging Face config (tied and untied embeddings).

#[path = "gguf_writer.rs"]
mod gguf_writer;

use dc_model::gguf::{GgufArray, GgufFile, GgufValue};
use dc_model::{ModelError, TensorSource};
use gguf_writer::{f32_bytes, llama_meta, s, str_arr, ty, write_file, Gguf, Val};
use half::f16;

fn f16b(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_bits().to_le_bytes()
}

fn f16v(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

fn open(name: &str, g: &Gguf) -> GgufFile {
    let p = write_file(name, &g.build());
    let f = GgufFile::open(&p).unwrap_or_else(|e| panic!("{name}: {e}"));
    // The mapping outlives the directory entry (on Unix); do not leave files behind.
    let _ = std::fs::remove_file(&p);
    f
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn metadata_of_every_type_reads_back_in_v2_and_v3() {
    for version in [2u32, 3] {
        let mut g = llama_meta(Gguf::default(), 1)
            .kv("t.u8", Val::U8(200))
            .kv("t.i8", Val::I8(-100))
            .kv("t.u16", Val::U16(60000))
            .kv("t.i16", Val::I16(-30000))
            .kv("t.u32", Val::U32(4_000_000_000))
            .kv("t.i32", Val::I32(-2_000_000_000))
            .kv("t.u64", Val::U64(u64::MAX))
            .kv("t.i64", Val::I64(i64::MIN))
            .kv("t.f32", Val::F32(0.1))
            .kv("t.f64", Val::F64(0.1))
            .kv("t.true", Val::Bool(true))
            .kv("t.false", Val::Bool(false))
            .kv("t.str", s("héllo ✓"))
            .kv("t.empty", s(""))
            .kv("t.arr_i32", Val::Arr(5, vec![Val::I32(-1), Val::I32(7)]))
            .kv(
                "t.arr_f32",
                Val::Arr(6, vec![Val::F32(0.5), Val::F32(-2.0)]),
            )
            .kv(
                "t.arr_bool",
                Val::Arr(7, vec![Val::Bool(true), Val::Bool(false)]),
            )
            .kv(
                "t.arr_u64",
                Val::Arr(10, vec![Val::U64(1), Val::U64(u64::MAX)]),
            )
            .kv("t.arr_str", str_arr(&["a", "b c", ""]))
            .kv("t.arr_empty", Val::Arr(4, vec![]))
            .kv(
                "t.nested",
                Val::Arr(
                    9,
                    vec![
                        Val::Arr(0, vec![Val::U8(1), Val::U8(2)]),
                        Val::Arr(8, vec![s("x")]),
                        Val::Arr(9, vec![Val::Arr(12, vec![Val::F64(2.5)])]),
                    ],
                ),
            );
        g.version = version;
        let f = open(&format!("meta-v{version}"), &g);
        assert_eq!(f.version(), version);
        assert_eq!(f.metadata("t.u8"), Some(&GgufValue::U8(200)));
        assert_eq!(f.metadata("t.i8"), Some(&GgufValue::I8(-100)));
        assert_eq!(f.metadata("t.u16"), Some(&GgufValue::U16(60000)));
        assert_eq!(f.metadata("t.i16"), Some(&GgufValue::I16(-30000)));
        assert_eq!(f.metadata("t.u32"), Some(&GgufValue::U32(4_000_000_000)));
        assert_eq!(f.metadata("t.i32"), Some(&GgufValue::I32(-2_000_000_000)));
        assert_eq!(f.metadata("t.u64"), Some(&GgufValue::U64(u64::MAX)));
        assert_eq!(f.metadata("t.i64"), Some(&GgufValue::I64(i64::MIN)));
        assert_eq!(f.metadata("t.f32"), Some(&GgufValue::F32(0.1)));
        assert_eq!(f.metadata("t.f64"), Some(&GgufValue::F64(0.1)));
        assert_eq!(f.metadata("t.true"), Some(&GgufValue::Bool(true)));
        assert_eq!(f.metadata("t.false"), Some(&GgufValue::Bool(false)));
        assert_eq!(f.get_str("t.str").unwrap(), Some("héllo ✓"));
        assert_eq!(f.get_str("t.empty").unwrap(), Some(""));
        assert_eq!(
            f.metadata("t.arr_i32"),
            Some(&GgufValue::Array(GgufArray::I32(vec![-1, 7])))
        );
        assert_eq!(
            f.metadata("t.arr_f32"),
            Some(&GgufValue::Array(GgufArray::F32(vec![0.5, -2.0])))
        );
        assert_eq!(
            f.metadata("t.arr_bool"),
            Some(&GgufValue::Array(GgufArray::Bool(vec![true, false])))
        );
        assert_eq!(
            f.metadata("t.arr_u64"),
            Some(&GgufValue::Array(GgufArray::U64(vec![1, u64::MAX])))
        );
        assert_eq!(
            f.get_str_array("t.arr_str").unwrap(),
            Some(&["a".to_string(), "b c".to_string(), String::new()][..])
        );
        assert_eq!(
            f.metadata("t.arr_empty"),
            Some(&GgufValue::Array(GgufArray::U32(vec![])))
        );
        assert_eq!(
            f.metadata("t.nested"),
            Some(&GgufValue::Array(GgufArray::Array(vec![
                GgufArray::U8(vec![1, 2]),
                GgufArray::String(vec!["x".into()]),
                GgufArray::Array(vec![GgufArray::F64(vec![2.5])]),
            ])))
        );
        assert_eq!(f.metadata("t.absent"), None);
        // Metadata order is file order.
        assert_eq!(f.metadata_entries()[0].0, "general.architecture");

        // Typed helpers accept any integer width and refuse other types by name.
        assert_eq!(f.get_u64("t.u8").unwrap(), Some(200));
        assert_eq!(f.get_u64("t.u16").unwrap(), Some(60000));
        assert_eq!(f.get_u64("t.u64").unwrap(), Some(u64::MAX));
        assert_eq!(f.get_i64("t.i8").unwrap(), Some(-100));
        assert_eq!(f.get_i64("t.i64").unwrap(), Some(i64::MIN));
        assert_eq!(f.get_i64("t.u32").unwrap(), Some(4_000_000_000));
        assert!(f.get_u64("t.i8").is_err(), "negative value as u64");
        assert!(f.get_i64("t.u64").is_err(), "u64::MAX does not fit i64");
        assert_eq!(f.get_f64("t.f32").unwrap(), Some(f64::from(0.1f32)));
        assert_eq!(f.get_f64("t.f64").unwrap(), Some(0.1));
        assert_eq!(f.get_f64("t.u32").unwrap(), Some(4e9));
        assert_eq!(f.get_bool("t.true").unwrap(), Some(true));
        assert_eq!(f.get_i64_array("t.arr_i32").unwrap(), Some(vec![-1, 7]));
        assert_eq!(f.get_f64_array("t.arr_f32").unwrap(), Some(vec![0.5, -2.0]));
        assert_eq!(f.get_u64("t.absent").unwrap(), None);
        let err = f.get_u64("t.str").unwrap_err().to_string();
        assert!(err.contains("t.str") && err.contains("string"), "{err}");
        assert!(f.get_str("t.u8").is_err());
        assert!(f.get_str_array("t.arr_i32").is_err());
        assert!(f.require_u64("t.absent").is_err());
    }
}

#[test]
fn tensor_data_honours_the_declared_alignment() {
    for alignment in [None, Some(1u32), Some(64), Some(256)] {
        let mut g = llama_meta(Gguf::default(), 1);
        if let Some(a) = alignment {
            g = g.kv("general.alignment", Val::U32(a));
            g.alignment = u64::from(a);
        }
        let norm: Vec<f32> = (0..8).map(|i| i as f32 * 0.5 - 1.0).collect();
        let other: Vec<f32> = (0..8).map(|i| 100.0 + i as f32).collect();
        let g = g
            .tensor("blk.0.attn_norm.weight", &[8], ty::F32, f32_bytes(&norm))
            .tensor("blk.0.ffn_norm.weight", &[8], ty::F32, f32_bytes(&other));
        let f = open("align", &g);
        let a = u64::from(alignment.unwrap_or(32));
        assert_eq!(f.alignment(), a);
        assert_eq!(f.data_start() % a, 0);
        for t in f.gguf_tensors() {
            assert_eq!(t.offset % a, 0, "{}", t.name);
        }
        assert_eq!(
            f.load_f32("model.layers.0.input_layernorm.weight").unwrap(),
            norm
        );
        assert_eq!(
            f.load_f32("model.layers.0.post_attention_layernorm.weight")
                .unwrap(),
            other
        );
    }
    // Alignment must be a power of two.
    let g = llama_meta(Gguf::default(), 1).kv("general.alignment", Val::U32(24));
    let p = write_file("align-bad", &g.build());
    let err = GgufFile::open(&p).unwrap_err();
    assert!(matches!(err, ModelError::Format { .. }), "{err}");
    assert!(err.to_string().contains("24"), "{err}");
}

/// One tensor per dtype with hand-built blocks; expected values straight from the block
/// layouts in the GGUF spec / ggml-common.h.
#[test]
fn every_dtype_converts_to_the_values_its_blocks_encode() {
    // F32, F16, BF16 (as output_norm / norms of length 32).
    let f32s: Vec<f32> = (0..32).map(|i| (i as f32 - 16.0) * 0.37).collect();
    let f16_bits: Vec<u16> = (0..32u16)
        .map(|i| match i {
            0 => 0x0001, // smallest subnormal 2^-24
            1 => 0x8000, // -0.0
            2 => 0x7bff, // 65504
            3 => 0x03ff, // largest subnormal
            4 => 0xfc00, // -inf
            _ => 0x3c00 + i * 37,
        })
        .collect();
    let bf16_bits: Vec<u16> = (0..32u16).map(|i| 0x3f80 ^ (i * 0x0123)).collect();

    // Q8_0: d = 0.5, q = i*8 - 128 (wrapping) for one block of 32.
    let mut q8 = f16b(0.5).to_vec();
    let q8_vals: Vec<i8> = (0..32).map(|i| (i * 8 - 128) as i8).collect();
    q8.extend(q8_vals.iter().map(|&q| q as u8));
    let q8_expect: Vec<f32> = q8_vals.iter().map(|&q| f32::from(q) * 0.5).collect();

    // Q4_0: d = 0.25; byte j = j | (15 - j) << 4 → element j = j - 8, element j+16 = 7 - j.
    let mut q40 = f16b(0.25).to_vec();
    q40.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let mut q40_expect = vec![0f32; 32];
    for j in 0..16 {
        q40_expect[j] = 0.25 * (j as f32 - 8.0);
        q40_expect[j + 16] = 0.25 * (7.0 - j as f32);
    }

    // Q4_1: d = 0.1 (rounded to f16), m = -1.3 (rounded to f16); value d*q + m.
    let (d41, m41) = (f16v(0.1), f16v(-1.3));
    let mut q41 = f16b(0.1).to_vec();
    q41.extend(f16b(-1.3));
    q41.extend((0..16u8).map(|j| (j * 7 % 16) | ((j * 3 % 16) << 4)));
    let mut q41_expect = vec![0f32; 32];
    for j in 0..16 {
        q41_expect[j] = d41 * ((j * 7 % 16) as f32) + m41;
        q41_expect[j + 16] = d41 * ((j * 3 % 16) as f32) + m41;
    }

    // Q5_0: d = 2.0; qh = 0xA5A5_0F0F; q = low nibble | bit << 4, minus 16.
    let qh: u32 = 0xA5A5_0F0F;
    let mut q50 = f16b(2.0).to_vec();
    q50.extend(qh.to_le_bytes());
    let lows: Vec<u8> = (0..16u8)
        .map(|j| (j * 5 % 16) | ((j * 11 % 16) << 4))
        .collect();
    q50.extend(&lows);
    let mut q50_expect = vec![0f32; 32];
    for j in 0..16 {
        let lo = i32::from(lows[j] & 15) | (((qh >> j) & 1) as i32) << 4;
        let hi = i32::from(lows[j] >> 4) | (((qh >> (j + 16)) & 1) as i32) << 4;
        q50_expect[j] = 2.0 * (lo - 16) as f32;
        q50_expect[j + 16] = 2.0 * (hi - 16) as f32;
    }

    // Q5_1: d = 0.03, m = 0.7; value d*q + m.
    let (d51, m51) = (f16v(0.03), f16v(0.7));
    let mut q51 = f16b(0.03).to_vec();
    q51.extend(f16b(0.7));
    q51.extend(qh.to_le_bytes());
    q51.extend(&lows);
    let mut q51_expect = vec![0f32; 32];
    for j in 0..16 {
        let lo = u32::from(lows[j] & 15) | ((qh >> j) & 1) << 4;
        let hi = u32::from(lows[j] >> 4) | ((qh >> (j + 16)) & 1) << 4;
        q51_expect[j] = d51 * lo as f32 + m51;
        q51_expect[j + 16] = d51 * hi as f32 + m51;
    }

    let g = llama_meta(Gguf::default(), 1)
        .tensor("output_norm.weight", &[32], ty::F32, f32_bytes(&f32s))
        .tensor(
            "blk.0.attn_norm.weight",
            &[32],
            ty::F16,
            f16_bits.iter().flat_map(|b| b.to_le_bytes()).collect(),
        )
        .tensor(
            "blk.0.ffn_norm.weight",
            &[32],
            ty::BF16,
            bf16_bits.iter().flat_map(|b| b.to_le_bytes()).collect(),
        )
        .tensor("blk.0.attn_v.weight", &[32], ty::Q8_0, q8)
        .tensor("blk.0.attn_output.weight", &[32], ty::Q4_0, q40)
        .tensor("blk.0.ffn_gate.weight", &[32], ty::Q4_1, q41)
        .tensor("blk.0.ffn_up.weight", &[32], ty::Q5_0, q50)
        .tensor("blk.0.ffn_down.weight", &[32], ty::Q5_1, q51);
    let f = open("dtypes", &g);

    assert_eq!(bits(&f.load_f32("model.norm.weight").unwrap()), bits(&f32s));
    let f16_expect: Vec<f32> = f16_bits
        .iter()
        .map(|&b| f16::from_bits(b).to_f32())
        .collect();
    assert_eq!(
        bits(&f.load_f32("model.layers.0.input_layernorm.weight").unwrap()),
        bits(&f16_expect)
    );
    assert_eq!(f16_expect[0], 2f32.powi(-24));
    assert_eq!(f16_expect[2], 65504.0);
    let bf16_expect: Vec<f32> = bf16_bits
        .iter()
        .map(|&b| f32::from_bits(u32::from(b) << 16))
        .collect();
    assert_eq!(
        bits(
            &f.load_f32("model.layers.0.post_attention_layernorm.weight")
                .unwrap()
        ),
        bits(&bf16_expect)
    );
    let cases = [
        ("model.layers.0.self_attn.v_proj.weight", q8_expect),
        ("model.layers.0.self_attn.o_proj.weight", q40_expect),
        ("model.layers.0.mlp.gate_proj.weight", q41_expect),
        ("model.layers.0.mlp.up_proj.weight", q50_expect),
        ("model.layers.0.mlp.down_proj.weight", q51_expect),
    ];
    for (name, expect) in cases {
        assert_eq!(bits(&f.load_f32(name).unwrap()), bits(&expect), "{name}");
    }
}

/// Q4_1's `d·q + m` rounds only in the addition (d·q is exact), so it equals the fused
/// multiply-add: llama.cpp built with or without FP contraction gives the same bits.
#[test]
fn q4_1_equals_its_fused_multiply_add() {
    let mut state = 0x1234_5678_9abc_def0u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut blocks = Vec::new();
    let mut expect = Vec::new();
    for _ in 0..64 {
        let d = f16::from_bits((next() % 0x7c00) as u16);
        let m = f16::from_bits((next() % 0x7c00) as u16 | (0x8000 * (next() % 2) as u16));
        blocks.extend(d.to_bits().to_le_bytes());
        blocks.extend(m.to_bits().to_le_bytes());
        let qs: Vec<u8> = (0..16).map(|_| next() as u8).collect();
        let mut vals = vec![0f32; 32];
        for j in 0..16 {
            vals[j] = d.to_f32().mul_add(f32::from(qs[j] & 15), m.to_f32());
            vals[j + 16] = d.to_f32().mul_add(f32::from(qs[j] >> 4), m.to_f32());
        }
        blocks.extend(qs);
        expect.extend(vals);
    }
    let g =
        llama_meta(Gguf::default(), 1).tensor("blk.0.ffn_up.weight", &[32, 64], ty::Q4_1, blocks);
    let f = open("q41-fma", &g);
    let got = f.load_f32("model.layers.0.mlp.up_proj.weight").unwrap();
    assert_eq!(bits(&got), bits(&expect));
}

/// The Q/K rows come back in Hugging Face order: checked against the index formula of
/// `w.reshape(n_head, rows/n_head/2, 2, cols).swapaxes(1, 2).reshape(rows, cols)`.
#[test]
fn llama_q_and_k_rows_are_unpermuted_and_qwen2_rows_are_not() {
    // q: 2 heads × 4 rows (rows = 8), k: 1 kv head × 4 rows; 8 columns; biases too.
    let (rows_q, rows_k, cols) = (8usize, 4usize, 8usize);
    let q: Vec<f32> = (0..rows_q * cols).map(|i| i as f32).collect();
    let k: Vec<f32> = (0..rows_k * cols).map(|i| 1000.0 + i as f32).collect();
    let qb: Vec<f32> = (0..rows_q).map(|i| -(i as f32)).collect();
    let kb: Vec<f32> = (0..rows_k).map(|i| 50.0 + i as f32).collect();
    let v: Vec<f32> = (0..rows_k * cols).map(|i| 7.0 * i as f32).collect();
    let build = |arch: &str| {
        let mut g = llama_meta(Gguf::default(), 1);
        if arch == "qwen2" {
            g.kv =
                g.kv.into_iter()
                    .map(|(k, v)| (k.replace("llama.", "qwen2."), v))
                    .collect();
            g.kv[0].1 = s("qwen2");
        }
        g.tensor(
            "blk.0.attn_q.weight",
            &[cols as u64, rows_q as u64],
            ty::F32,
            f32_bytes(&q),
        )
        .tensor(
            "blk.0.attn_k.weight",
            &[cols as u64, rows_k as u64],
            ty::F32,
            f32_bytes(&k),
        )
        .tensor(
            "blk.0.attn_q.bias",
            &[rows_q as u64],
            ty::F32,
            f32_bytes(&qb),
        )
        .tensor(
            "blk.0.attn_k.bias",
            &[rows_k as u64],
            ty::F32,
            f32_bytes(&kb),
        )
        .tensor(
            "blk.0.attn_v.weight",
            &[cols as u64, rows_k as u64],
            ty::F32,
            f32_bytes(&v),
        )
    };
    // Straightforward index computation: HF row r = h*2*half + j*half + i comes from GGUF row
    // h*2*half + 2*i + j.
    let expect = |w: &[f32], rows: usize, cols: usize, heads: usize| {
        let half = rows / heads / 2;
        let mut out = vec![0f32; rows * cols];
        for r in 0..rows {
            let (h, rest) = (r / (2 * half), r % (2 * half));
            let (j, i) = (rest / half, rest % half);
            let src = h * 2 * half + 2 * i + j;
            for c in 0..cols {
                out[r * cols + c] = w[src * cols + c];
            }
        }
        out
    };

    let f = open("perm-llama", &build("llama"));
    assert_eq!(
        f.info("model.layers.0.self_attn.q_proj.weight")
            .unwrap()
            .shape,
        vec![rows_q, cols]
    );
    let got_q = f
        .load_f32("model.layers.0.self_attn.q_proj.weight")
        .unwrap();
    assert_eq!(got_q, expect(&q, rows_q, cols, 2));
    assert_ne!(got_q, q, "the test must be able to see a permutation");
    assert_eq!(
        f.load_f32("model.layers.0.self_attn.k_proj.weight")
            .unwrap(),
        expect(&k, rows_k, cols, 1)
    );
    assert_eq!(
        f.load_f32("model.layers.0.self_attn.q_proj.bias").unwrap(),
        expect(&qb, rows_q, 1, 2)
    );
    assert_eq!(
        f.load_f32("model.layers.0.self_attn.k_proj.bias").unwrap(),
        expect(&kb, rows_k, 1, 1)
    );
    assert_eq!(
        f.load_f32("model.layers.0.self_attn.v_proj.weight")
            .unwrap(),
        v
    );

    let f = open("perm-qwen2", &build("qwen2"));
    assert_eq!(
        f.load_f32("model.layers.0.self_attn.q_proj.weight")
            .unwrap(),
        q
    );
    assert_eq!(
        f.load_f32("model.layers.0.self_attn.k_proj.weight")
            .unwrap(),
        k
    );
    assert_eq!(
        f.load_f32("model.layers.0.self_attn.q_proj.bias").unwrap(),
        qb
    );
}

fn tiny_model(tied: bool) -> Gguf {
    let embd: Vec<f32> = (0..8 * 10).map(|i| i as f32 / 10.0).collect();
    let mut g = llama_meta(Gguf::default(), 2)
        .kv("tokenizer.ggml.bos_token_id", Val::U32(1))
        .kv("tokenizer.ggml.eos_token_id", Val::U32(2))
        .tensor("token_embd.weight", &[8, 10], ty::F32, f32_bytes(&embd))
        .tensor("output_norm.weight", &[8], ty::F32, f32_bytes(&[1.0; 8]));
    if !tied {
        g = g.tensor("output.weight", &[8, 10], ty::F32, f32_bytes(&embd));
    }
    for l in 0..2 {
        g = g.tensor(
            &format!("blk.{l}.attn_norm.weight"),
            &[8],
            ty::F32,
            f32_bytes(&[1.0; 8]),
        );
    }
    g
}

#[test]
fn hf_config_reports_tied_and_untied_embeddings() {
    for tied in [true, false] {
        let f = open("cfg", &tiny_model(tied));
        let c = f.hf_config().unwrap();
        assert_eq!(c["tie_word_embeddings"], tied);
        assert_eq!(c["architectures"][0], "LlamaForCausalLM");
        assert_eq!(c["model_type"], "llama");
        assert_eq!(c["vocab_size"], 10);
        assert_eq!(c["hidden_size"], 8);
        assert_eq!(c["intermediate_size"], 16);
        assert_eq!(c["num_hidden_layers"], 2);
        assert_eq!(c["num_attention_heads"], 2);
        assert_eq!(c["num_key_value_heads"], 1);
        assert_eq!(c["head_dim"], 4);
        assert_eq!(c["hidden_act"], "silu");
        assert_eq!(c["max_position_embeddings"], 64);
        assert_eq!(c["rms_norm_eps"], f64::from(1e-5f32));
        assert_eq!(c["rope_theta"], 10000.0);
        assert_eq!(c["bos_token_id"], 1);
        assert_eq!(c["eos_token_id"], 2);
        assert_eq!(c["attention_bias"], false);
        let names: Vec<String> = f.tensors().into_iter().map(|t| t.name).collect();
        assert_eq!(names.contains(&"lm_head.weight".to_string()), !tied);
        assert_eq!(
            f.info("model.embed_tokens.weight").unwrap().shape,
            vec![10, 8]
        );
    }
}

#[test]
fn unknown_names_architectures_and_types_are_refused_by_name() {
    let g = tiny_model(true).tensor(
        "blk.0.attn_q_norm.weight",
        &[8],
        ty::F32,
        f32_bytes(&[0.0; 8]),
    );
    let err = GgufFile::open(&write_file("unk-name", &g.build())).unwrap_err();
    assert!(matches!(err, ModelError::Unsupported { .. }), "{err}");
    assert!(
        err.to_string().contains("blk.0.attn_q_norm.weight"),
        "{err}"
    );

    let g = tiny_model(true).tensor("rope_freqs.weight", &[4], ty::F32, f32_bytes(&[1.0; 4]));
    let err = GgufFile::open(&write_file("rope-freqs", &g.build())).unwrap_err();
    assert!(err.to_string().contains("rope_freqs.weight"), "{err}");

    let mut g = tiny_model(true);
    g.kv[0].1 = s("phi3");
    let err = GgufFile::open(&write_file("unk-arch", &g.build())).unwrap_err();
    assert!(err.to_string().contains("phi3"), "{err}");

    let g = tiny_model(true).tensor(
        "blk.2.attn_norm.weight",
        &[8],
        ty::F32,
        f32_bytes(&[0.0; 8]),
    );
    let err = GgufFile::open(&write_file("layer-oob", &g.build())).unwrap_err();
    assert!(err.to_string().contains("blk.2.attn_norm.weight"), "{err}");

    // A type we can lay out but not convert: opens, and loading names tensor and type.
    let g = tiny_model(true).tensor("blk.1.ffn_up.weight", &[256], ty::IQ2_XS, vec![0u8; 74]);
    let f = open("iq2", &g);
    let err = f.load_f32("model.layers.1.mlp.up_proj.weight").unwrap_err();
    assert!(matches!(err, ModelError::Unsupported { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("IQ2_XS") && msg.contains("blk.1.ffn_up.weight"),
        "{msg}"
    );

    // A type id nobody knows: refused at open, naming it.
    let g = tiny_model(true).tensor("blk.1.ffn_up.weight", &[32], 99, vec![0u8; 32]);
    let err = GgufFile::open(&write_file("type99", &g.build())).unwrap_err();
    assert!(err.to_string().contains("99"), "{err}");

    let f = open("missing", &tiny_model(true));
    let err = f.load_f32("model.layers.0.mlp.up_proj.weight").unwrap_err();
    assert!(matches!(err, ModelError::MissingTensor { .. }), "{err}");
}

#[test]
fn hf_config_needs_its_metadata() {
    let mut g = tiny_model(true);
    g.kv.retain(|(k, _)| k != "llama.feed_forward_length");
    let f = open("cfg-missing", &g);
    let err = f.hf_config().unwrap_err();
    assert!(
        err.to_string().contains("llama.feed_forward_length"),
        "{err}"
    );

    let g = tiny_model(true).kv("llama.rope.scaling.type", s("yarn"));
    let f = open("cfg-yarn", &g);
    assert!(f.hf_config().unwrap_err().to_string().contains("yarn"));
}
