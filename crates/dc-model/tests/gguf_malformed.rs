//! Hostile and broken GGUF files: every truncation, random byte flips, absurd counts, lengths
//! and offsets. Opening must fail with an error naming what is wrong, never panic, and never
//! allocate much more than the file's size; this test binary's allocator records the largest
//! allocation to check the last point.

#[path = "gguf_writer.rs"]
mod gguf_writer;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};

use dc_model::gguf::GgufFile;
use dc_model::{ModelError, TensorSource};
use gguf_writer::{f32_bytes, llama_meta, s, str_arr, ty, write_file, write_str, Gguf, Val};

/// Records the largest single allocation made by each thread (each test runs on its own
/// thread, so one test's failure report cannot spoil another's measurement).
struct Recording;

thread_local! {
    // A const-initialised Cell has no destructor and never allocates, so it is safe to touch
    // from inside the allocator.
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn record(size: usize) {
    let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
}

// SAFETY: forwards every call unchanged to the system allocator; only records sizes.
unsafe impl GlobalAlloc for Recording {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        record(layout.size());
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        record(layout.size());
        // SAFETY: same contract as ours.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        record(new_size);
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Recording = Recording;

/// Every file here is a few KiB; nothing should ever need a MiB.
const ALLOCATION_LIMIT: usize = 1 << 20;

fn assert_small_allocations() {
    let largest = LARGEST.with(Cell::get);
    assert!(
        largest < ALLOCATION_LIMIT,
        "an allocation of {largest} bytes was made for a file of a few KiB"
    );
}

/// A valid file whose every section ends on a 32-byte boundary, so no strict prefix of it is
/// a valid file (there is no trailing padding to lose).
fn valid() -> Gguf {
    let embd: Vec<f32> = (0..80).map(|i| i as f32).collect();
    llama_meta(Gguf::default(), 1)
        .kv("general.name", s("tiny"))
        .kv("tokenizer.ggml.tokens", str_arr(&["a", "b", "c"]))
        .kv(
            "tokenizer.ggml.token_type",
            Val::Arr(5, vec![Val::I32(1); 3]),
        )
        .kv(
            "t.nested",
            Val::Arr(9, vec![Val::Arr(4, vec![Val::U32(1)])]),
        )
        .kv("t.flag", Val::Bool(true))
        .tensor("token_embd.weight", &[8, 10], ty::F32, f32_bytes(&embd))
        .tensor(
            "blk.0.attn_norm.weight",
            &[8],
            ty::F32,
            f32_bytes(&[1.0; 8]),
        )
}

/// Opens `bytes` as a file; returns the error (panicking, with `what`, if it opened).
fn open_err(what: &str, bytes: &[u8]) -> ModelError {
    let p = write_file("bad", bytes);
    let r = catch_unwind(AssertUnwindSafe(|| GgufFile::open(&p)))
        .unwrap_or_else(|_| panic!("{what}: opening panicked"));
    let _ = std::fs::remove_file(&p);
    match r {
        Ok(_) => panic!("{what}: a malformed file opened"),
        Err(e) => e,
    }
}

fn expect_format(what: &str, bytes: &[u8], needle: &str) {
    let e = open_err(what, bytes);
    assert!(
        matches!(e, ModelError::Format { .. }),
        "{what}: expected a format error, got {e}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains(needle),
        "{what}: {msg:?} does not mention {needle:?}"
    );
    assert!(
        msg.contains("dc-model-gguf-tests"),
        "{what}: {msg:?} does not name the file"
    );
}

#[test]
fn every_truncation_of_a_valid_file_is_an_error() {
    let bytes = valid().build();
    assert_eq!(bytes.len() % 32, 0);
    let full = write_file("full", &bytes);
    let f = GgufFile::open(&full).expect("the untruncated file opens");
    assert_eq!(f.tensors().len(), 2);
    for len in 0..bytes.len() {
        let _ = open_err(&format!("prefix of {len} bytes"), &bytes[..len]);
    }
    assert_small_allocations();
}

/// A cheap deterministic generator (xorshift64), so failures reproduce.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn random_header_byte_flips_never_panic() {
    let bytes = valid().build();
    let header_len = {
        let p = write_file("flip-base", &bytes);
        GgufFile::open(&p).expect("base opens").data_start() as usize
    };
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let (mut opened, mut refused) = (0, 0);
    for iter in 0..3000 {
        let mut b = bytes.clone();
        let flips = 1 + rng.next() % 3;
        for _ in 0..flips {
            let at = (rng.next() % header_len as u64) as usize;
            let bit = 1u8 << (rng.next() % 8);
            // Sometimes replace the byte entirely with an extreme value.
            b[at] = if rng.next().is_multiple_of(4) {
                0xff
            } else {
                b[at] ^ bit
            };
        }
        let p = write_file("flip", &b);
        let outcome = catch_unwind(AssertUnwindSafe(|| match GgufFile::open(&p) {
            Err(_) => false,
            Ok(f) => {
                // Whatever opened must also be safe to use.
                for t in f.tensors() {
                    let _ = f.load_f32(&t.name);
                }
                let _ = f.hf_config();
                let _ = f.tokenizer_json();
                true
            }
        }));
        let _ = std::fs::remove_file(&p);
        match outcome {
            Ok(true) => opened += 1,
            Ok(false) => refused += 1,
            Err(_) => panic!("iteration {iter}: panicked on a flipped header"),
        }
    }
    // Flips inside string contents can leave a valid file; most flips must be caught.
    assert!(refused > opened, "refused {refused}, opened {opened}");
    assert_small_allocations();
}

/// A header with given counts followed by `rest`.
fn header(version: u32, tensors: u64, kvs: u64, rest: &[u8]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(version.to_le_bytes());
    b.extend(tensors.to_le_bytes());
    b.extend(kvs.to_le_bytes());
    b.extend(rest);
    b.resize(b.len().max(64), 0);
    b
}

fn kv_raw(key: &str, tag: u32, payload: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    write_str(&mut b, key);
    b.extend(tag.to_le_bytes());
    b.extend(payload);
    b
}

#[test]
fn absurd_counts_and_lengths_are_refused_without_allocating() {
    expect_format("empty file", &[], "too short");
    expect_format("3 bytes", b"GGU", "too short");
    expect_format(
        "wrong magic",
        &header(3, 0, 0, &[])
            .iter()
            .enumerate()
            .map(|(i, &b)| if i == 0 { b'X' } else { b })
            .collect::<Vec<_>>(),
        "not a GGUF file",
    );
    expect_format("version 4", &header(4, 0, 0, &[]), "version 4");
    for (what, bytes) in [
        ("version 1", header(1, 0, 0, &[])),
        ("big-endian", header(0x0300_0000, 0, 0, &[])),
    ] {
        let e = open_err(what, &bytes);
        assert!(matches!(e, ModelError::Unsupported { .. }), "{what}: {e}");
    }

    expect_format(
        "tensor count u64::MAX",
        &header(3, u64::MAX, 0, &[]),
        "tensor count",
    );
    expect_format("tensor count 2^17", &header(3, 1 << 17, 0, &[]), "131072");
    expect_format(
        "tensor count 1000 in 64 bytes",
        &header(3, 1000, 0, &[]),
        "tensor directory",
    );
    expect_format(
        "kv count u64::MAX",
        &header(3, 0, u64::MAX, &[]),
        "metadata count",
    );
    expect_format("kv count 10^6", &header(3, 0, 1_000_000, &[]), "1000000");
    expect_format(
        "kv count 100 in 64 bytes",
        &header(3, 0, 100, &[]),
        "metadata",
    );

    // Key length absurd.
    let mut rest = u64::MAX.to_le_bytes().to_vec();
    rest.extend(b"key");
    expect_format("key length u64::MAX", &header(3, 0, 1, &rest), "length");
    let mut rest = (1u64 << 40).to_le_bytes().to_vec();
    rest.extend([b'k'; 8]);
    expect_format("key length 2^40", &header(3, 0, 1, &rest), "metadata key");

    // String value length absurd.
    let rest = kv_raw("s", 8, &(u64::MAX - 3).to_le_bytes());
    expect_format(
        "string length",
        &header(3, 0, 1, &rest),
        "value of metadata \"s\"",
    );
    let rest = kv_raw("s", 8, &(1u64 << 30).to_le_bytes());
    expect_format("string length 2^30", &header(3, 0, 1, &rest), "1073741824");

    // Array lengths absurd, for a fixed-size, a string and a nested element type.
    for (elem, what) in [(4u32, "u32"), (8, "string"), (9, "array"), (0, "u8")] {
        for n in [u64::MAX, 1 << 24 | 1, 1_000_000, 1000] {
            let mut payload = elem.to_le_bytes().to_vec();
            payload.extend(n.to_le_bytes());
            let rest = kv_raw("arr", 9, &payload);
            expect_format(
                &format!("array of {n} {what}"),
                &header(3, 0, 1, &rest),
                "\"arr\"",
            );
        }
    }

    // Nesting deeper than the limit: 100 levels of one-element arrays.
    let mut payload = Vec::new();
    for _ in 0..100 {
        payload.extend(9u32.to_le_bytes());
        payload.extend(1u64.to_le_bytes());
    }
    payload.extend(4u32.to_le_bytes());
    payload.extend(0u64.to_le_bytes());
    expect_format(
        "deep nesting",
        &header(3, 0, 1, &kv_raw("deep", 9, &payload)),
        "nested deeper",
    );

    expect_format(
        "value type 13",
        &header(3, 0, 1, &kv_raw("t", 13, &[0; 8])),
        "unknown value type 13",
    );
    let mut payload = 99u32.to_le_bytes().to_vec();
    payload.extend(0u64.to_le_bytes());
    expect_format(
        "array type 99",
        &header(3, 0, 1, &kv_raw("t", 9, &payload)),
        "unknown array element type 99",
    );
    expect_format(
        "bool 2",
        &header(3, 0, 1, &kv_raw("b", 7, &[2])),
        "not 0 or 1",
    );
    let mut key = Vec::new();
    key.extend(2u64.to_le_bytes());
    key.extend([0xff, 0xfe]);
    key.extend(4u32.to_le_bytes());
    key.extend(0u32.to_le_bytes());
    expect_format("non-UTF-8 key", &header(3, 0, 1, &key), "not UTF-8");

    let dup = Gguf::default()
        .kv("a", Val::U8(1))
        .kv("a", Val::U8(2))
        .build();
    expect_format("duplicate key", &dup, "appears twice");
    let zero_align = llama_meta(Gguf::default(), 1)
        .kv("general.alignment", Val::U32(0))
        .build();
    expect_format("alignment 0", &zero_align, "general.alignment 0");
    let str_align = llama_meta(Gguf::default(), 1)
        .kv("general.alignment", s("32"))
        .build();
    expect_format("string alignment", &str_align, "general.alignment");
    assert_small_allocations();
}

fn one_tensor(dims: &[u64], ty: u32, data: Vec<u8>, offset: Option<u64>) -> Vec<u8> {
    let mut g = llama_meta(Gguf::default(), 1).tensor("blk.0.attn_norm.weight", dims, ty, data);
    g.tensors[0].offset = offset;
    g.build()
}

#[test]
fn absurd_tensor_shapes_and_offsets_are_refused() {
    let ok = f32_bytes(&[1.0; 8]);
    expect_format(
        "0 dims",
        &one_tensor(&[], ty::F32, ok.clone(), None),
        "0 dimensions",
    );
    expect_format(
        "5 dims",
        &one_tensor(&[1, 1, 1, 1, 8], ty::F32, ok.clone(), None),
        "5 dimensions",
    );
    expect_format(
        "zero dim",
        &one_tensor(&[8, 0], ty::F32, ok.clone(), None),
        "dimension 1 is 0",
    );
    expect_format(
        "overflowing dims",
        &one_tensor(&[u64::MAX, 2], ty::F32, ok.clone(), None),
        "overflows",
    );
    expect_format(
        "huge dims",
        &one_tensor(&[1 << 20, 1 << 20], ty::F32, ok.clone(), None),
        "runs past the end",
    );
    expect_format(
        "byte size overflow",
        &one_tensor(&[1 << 62], ty::F32, ok.clone(), None),
        "overflows",
    );
    expect_format(
        "offset past end",
        &one_tensor(&[8], ty::F32, ok.clone(), Some(1 << 20)),
        "data offset 1048576 + 32 bytes runs past the end of the file",
    );
    expect_format(
        "offset u64::MAX",
        &one_tensor(&[8], ty::F32, ok.clone(), Some(u64::MAX - 31)),
        "runs past the end",
    );
    expect_format(
        "unaligned offset",
        &one_tensor(&[8], ty::F32, ok.clone(), Some(4)),
        "not a multiple of the alignment 32",
    );
    expect_format(
        "partial block",
        &one_tensor(&[16], ty::Q4_0, vec![0; 18], None),
        "block size 32",
    );
    expect_format(
        "data short by one byte",
        &{
            let mut b = one_tensor(&[8], ty::F32, ok.clone(), None);
            b.truncate(b.len() - 1);
            b
        },
        "runs past the end",
    );

    // Dims far beyond the file: the directory entry must be refused before any allocation.
    let mut g =
        llama_meta(Gguf::default(), 1).tensor("blk.0.attn_norm.weight", &[8], ty::F32, ok.clone());
    g.tensors[0].dims = vec![1 << 40];
    expect_format("2^40 floats", &g.build(), "runs past the end");

    // n_dims u32::MAX
    let mut g =
        llama_meta(Gguf::default(), 1).tensor("blk.0.attn_norm.weight", &[8], ty::F32, ok.clone());
    g.tensors[0].dims = vec![];
    let mut b = g.build();
    let needle = b"blk.0.attn_norm.weight";
    let pos = b
        .windows(needle.len())
        .position(|w| w == needle)
        .expect("name in header")
        + needle.len();
    b[pos..pos + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    expect_format("n_dims u32::MAX", &b, "4294967295 dimensions");

    // Two tensors sharing bytes.
    let mut g = llama_meta(Gguf::default(), 1)
        .tensor("blk.0.attn_norm.weight", &[8], ty::F32, ok.clone())
        .tensor("blk.0.ffn_norm.weight", &[8], ty::F32, ok.clone());
    g.tensors[1].offset = Some(0);
    expect_format("overlap", &g.build(), "overlap");
    let g = llama_meta(Gguf::default(), 1)
        .tensor("blk.0.attn_norm.weight", &[8], ty::F32, ok.clone())
        .tensor("blk.0.attn_norm.weight", &[8], ty::F32, ok.clone());
    expect_format("duplicate tensor", &g.build(), "appears twice");

    // Name length absurd.
    let mut g = llama_meta(Gguf::default(), 1).tensor(&"x".repeat(300), &[8], ty::F32, ok);
    g.tensors[0].offset = None;
    expect_format("long name", &g.build(), "exceeds the limit of 256");
    assert_small_allocations();
}

/// The array-length cap holds even when the bytes are there: a 2^24 + 1 element u8 array
/// (a 16 MiB file) is refused for its length, not for running out of file.
#[test]
fn array_length_cap_applies_to_arrays_that_fit_in_the_file() {
    let n: u64 = (1 << 24) + 1;
    let mut payload = 0u32.to_le_bytes().to_vec();
    payload.extend(n.to_le_bytes());
    payload.resize(payload.len() + n as usize, 7);
    let bytes = header(3, 0, 1, &kv_raw("big", 9, &payload));
    expect_format(
        "2^24 + 1 bytes",
        &bytes,
        "array length 16777217 exceeds the limit",
    );
}
