//! Token embeddings kept as stored and converted a row at a time give every row exactly the
//! values converting the whole tensor gives it: for every two-dimensional tensor of every
//! GGUF type we read (seeded random blocks), of the installed SmolLM2 (a real Q8_0
//! embedding), of f16 and bf16 safetensors, and of the f32 fixtures; and the encoded types
//! are held at their stored size, not as f32.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::path::Path;

use dc_model::gguf::GgufFile;
use dc_model::hf::SafetensorsSource;
use dc_model::TensorSource;
use safetensors::tensor::TensorView;
use safetensors::Dtype;

/// Checks every two-dimensional tensor of `src`; returns how many were held encoded.
fn rows_equal_whole_tensors(src: &dyn TensorSource) -> usize {
    let mut encoded = 0;
    for info in src.tensors() {
        let [rows, cols] = info.shape[..] else {
            continue;
        };
        let whole = src.load_f32(&info.name).unwrap();
        let table = src.load_row_table(&info.name).unwrap();
        assert_eq!((table.rows(), table.cols()), (rows, cols), "{}", info.name);
        let mut got = Vec::new();
        for r in 0..rows {
            table.push_row(r, &mut got).unwrap();
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&whole), "{}", info.name);
        assert!(table.push_row(rows, &mut got).is_err());
        if table.as_f32().is_none() {
            assert!(table.bytes() < rows * cols * 4, "{}", info.name);
            encoded += 1;
        }
    }
    encoded
}

#[test]
fn gguf_rows_convert_as_their_whole_tensors() {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/gguf_dtypes.gguf");
    let g = GgufFile::open(&data).unwrap();
    // F16, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K held as stored; the Q4_0 and Q4_1 tensors
    // are this Llama file's Q and K, whose rows are un-permuted, so they come as f32.
    assert_eq!(rows_equal_whole_tensors(&g), 7);
    let smollm2 = dc_model::store::installed_smollm2()
        .expect("SmolLM2-135M GGUF not installed: run scripts/fetch-model.sh");
    let g = GgufFile::open(&smollm2).unwrap();
    let embed = g.load_row_table("model.embed_tokens.weight").unwrap();
    assert!(
        embed.as_f32().is_none(),
        "the Q8_0 embedding is kept as stored"
    );
    assert!(rows_equal_whole_tensors(&g) > 0);
}

#[test]
fn safetensors_rows_convert_as_their_whole_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let (rows, cols) = (7, 12);
    let halves: Vec<u8> = (0..rows * cols)
        .flat_map(|i| half::f16::from_f32((i as f32 - 40.0) * 0.37).to_le_bytes())
        .collect();
    let brains: Vec<u8> = (0..rows * cols)
        .flat_map(|i| half::bf16::from_f32((i as f32 - 40.0) * -1.7).to_le_bytes())
        .collect();
    let tensors = [
        (
            "f16",
            TensorView::new(Dtype::F16, vec![rows, cols], &halves).unwrap(),
        ),
        (
            "bf16",
            TensorView::new(Dtype::BF16, vec![rows, cols], &brains).unwrap(),
        ),
    ];
    let file = safetensors::serialize(tensors, None).unwrap();
    std::fs::write(dir.path().join("model.safetensors"), file).unwrap();
    let src = SafetensorsSource::open_dir(dir.path()).unwrap();
    assert_eq!(rows_equal_whole_tensors(&src), 2);

    // f32 fixtures stay f32, and their rows are theirs too.
    let llama = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures/llama");
    let (_, src) = dc_model::open::open_source(&llama).unwrap();
    rows_equal_whole_tensors(&*src);
}
