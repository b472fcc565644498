#!/usr/bin/env python3
"""DEV-ONLY TOOL: writes the expected values the GGUF tests compare against, bit for bit.

Tests never run this and never need Python. It exists so anyone can regenerate (and audit) the
files in this folder from an implementation independent of ours: gguf-py's `GGUFWriter`,
`GGUFReader` and numpy dequantisation (`gguf.quants.dequantize`), plus the Q/K un-permutation
of shared/fixtures/tools/gguf_to_hf_numpy.py.

    pip install gguf==0.19.0 numpy blake3
    python3 crates/dc-model/tests/data/make_gguf_expected.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]

Writes, next to this script:
  gguf_dtypes.gguf            a small llama-architecture GGUF (seeded random bytes) holding one
                              tensor of each type we convert: F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0
                              Q5_1 Q4_K Q5_K Q6_K; attn_q / attn_k (weights and biases) exercise
                              the un-permutation
  gguf_dtypes_expected.json   per Hugging Face tensor name: HF shape, GGML type, the first 64
                              values and 64 spread samples as f32 bit patterns, and blake3 of
                              the whole tensor as little-endian f32
  smollm2_expected.json       the same for a handful of tensors of the real SmolLM2 GGUF
                              (only when its path is given or found in the dcd store)

Un-permutation: llama.cpp's converter permutes q_proj / k_proj weights AND biases
(convert_hf_to_gguf.py LlamaModel.modify_tensors), so biases are un-permuted too; the reference
converter only handles weights because SmolLM2 has no biases.
"""
import json
import os
import re
import sys

import blake3
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

HERE = os.path.dirname(os.path.abspath(__file__))

NAME_MAP = [
    (r"^token_embd\.weight$", "model.embed_tokens.weight"),
    (r"^output_norm\.weight$", "model.norm.weight"),
    (r"^output\.weight$", "lm_head.weight"),
    (r"^blk\.(\d+)\.attn_norm\.weight$", r"model.layers.\1.input_layernorm.weight"),
    (r"^blk\.(\d+)\.ffn_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"^blk\.(\d+)\.attn_q\.(weight|bias)$", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"^blk\.(\d+)\.attn_k\.(weight|bias)$", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"^blk\.(\d+)\.attn_v\.(weight|bias)$", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"^blk\.(\d+)\.attn_output\.weight$", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"^blk\.(\d+)\.ffn_gate\.weight$", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"^blk\.(\d+)\.ffn_up\.weight$", r"model.layers.\1.mlp.up_proj.weight"),
    (r"^blk\.(\d+)\.ffn_down\.weight$", r"model.layers.\1.mlp.down_proj.weight"),
]


def hf_name(name):
    for pat, rep in NAME_MAP:
        if re.match(pat, name):
            return re.sub(pat, rep, name)
    raise KeyError(name)


def unpermute(w, n_head):
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def field(r, key):
    f = r.fields.get(key)
    return f.contents() if f is not None else None


def expected_for(path, only=None):
    r = GGUFReader(path)
    arch = field(r, "general.architecture")
    n_head = field(r, f"{arch}.attention.head_count")
    n_kv = field(r, f"{arch}.attention.head_count_kv") or n_head
    out = {}
    for t in r.tensors:
        if only is not None and t.name not in only:
            continue
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape)])
        if arch == "llama" and re.search(r"\.attn_q\.(weight|bias)$", t.name):
            w = unpermute(w, n_head)
        elif arch == "llama" and re.search(r"\.attn_k\.(weight|bias)$", t.name):
            w = unpermute(w, n_kv)
        flat = np.ascontiguousarray(w).reshape(-1)
        bits = flat.view(np.uint32)
        n = flat.size
        sample_idx = [(i * n) // 64 + (7 % max(1, n // 64)) for i in range(64)] if n >= 64 else list(range(n))
        out[hf_name(t.name)] = {
            "gguf_name": t.name,
            "ggml_type": t.tensor_type.name,
            "shape": list(w.shape),
            "head_bits": [int(x) for x in bits[:64]],
            "sample_index": sample_idx,
            "sample_bits": [int(bits[i]) for i in sample_idx],
            "blake3_f32le": blake3.blake3(flat.astype("<f4").tobytes()).hexdigest(),
        }
    return out


def random_f16(rng, n, scale):
    return (rng.standard_normal(n) * scale).astype(np.float16)


def quant_bytes(rng, qtype, rows, cols):
    """Random blocks with finite f16 scale fields (random bytes there could be NaN/inf)."""
    block, size = GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block
    b = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    scale_fields = {
        T.Q8_0: [0], T.Q4_0: [0], T.Q5_0: [0], T.Q4_1: [0, 2], T.Q5_1: [0, 2],
        T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    }[qtype]
    for off in scale_fields:
        b[:, off:off + 2] = random_f16(rng, n_blocks, 0.05).view(np.uint8).reshape(n_blocks, 2)
    # Edge scales: the smallest f16 subnormal and -0.0 in the first two blocks.
    b[0, scale_fields[0]:scale_fields[0] + 2] = np.array([0x0001], dtype="<u2").view(np.uint8)
    if n_blocks > 1:
        b[1, scale_fields[0]:scale_fields[0] + 2] = np.array([0x8000], dtype="<u2").view(np.uint8)
    return b.reshape(rows, cols // block * size)


def write_dtypes(path):
    rng = np.random.default_rng(20240611)
    w = GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_feed_forward_length(256)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)

    # (gguf name, type, HF shape [rows, cols] or [n])
    specs = [
        ("token_embd.weight", T.Q8_0, (8, 64)),
        ("output_norm.weight", T.F32, (64,)),
        ("output.weight", T.F16, (8, 64)),
        ("blk.0.attn_norm.weight", T.BF16, (64,)),
        ("blk.0.ffn_norm.weight", T.F32, (64,)),
        ("blk.0.attn_q.weight", T.Q4_0, (8, 64)),
        ("blk.0.attn_q.bias", T.F32, (8,)),
        ("blk.0.attn_k.weight", T.Q4_1, (4, 64)),
        ("blk.0.attn_k.bias", T.F16, (4,)),
        ("blk.0.attn_v.weight", T.Q5_0, (4, 64)),
        ("blk.0.attn_output.weight", T.Q5_1, (8, 64)),
        ("blk.0.ffn_gate.weight", T.Q4_K, (4, 256)),
        ("blk.0.ffn_up.weight", T.Q5_K, (4, 256)),
        ("blk.0.ffn_down.weight", T.Q6_K, (2, 512)),
    ]
    for name, qtype, shape in specs:
        rows, cols = (1, shape[0]) if len(shape) == 1 else shape
        if qtype == T.F32:
            data = rng.standard_normal(shape).astype(np.float32)
            w.add_tensor(name, data)
        elif qtype == T.F16:
            data = random_f16(rng, rows * cols, 1.0).reshape(shape)
            w.add_tensor(name, data)
        elif qtype == T.BF16:
            f = rng.standard_normal(rows * cols).astype(np.float32)
            raw = (f.view(np.uint32) >> 16).astype("<u2").view(np.uint8)
            w.add_tensor(name, raw.reshape(shape[:-1] + (shape[-1] * 2,)), raw_dtype=T.BF16)
        else:
            raw = quant_bytes(rng, qtype, rows, cols)
            if len(shape) == 1:
                raw = raw.reshape(-1)
            w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    dtypes = os.path.join(HERE, "gguf_dtypes.gguf")
    write_dtypes(dtypes)
    with open(os.path.join(HERE, "gguf_dtypes_expected.json"), "w") as f:
        json.dump(expected_for(dtypes), f, indent=1, sort_keys=True)
    print("wrote", dtypes, os.path.getsize(dtypes), "bytes")

    smol = sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser(
        "~/.local/share/dcd/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf")
    if os.path.exists(smol):
        only = {
            "token_embd.weight",            # Q8_0, 49152 x 576
            "blk.0.attn_q.weight",          # Q4_1, un-permuted with 9 heads
            "blk.0.attn_k.weight",          # Q4_1, un-permuted with 3 kv heads
            "blk.0.attn_v.weight",
            "blk.0.ffn_down.weight",
            "blk.0.attn_norm.weight",       # F32
            "blk.29.attn_q.weight",
            "blk.29.ffn_gate.weight",
            "output_norm.weight",
        }
        with open(os.path.join(HERE, "smollm2_expected.json"), "w") as f:
            json.dump(expected_for(smol, only), f, indent=1, sort_keys=True)
        print("wrote smollm2_expected.json from", smol)
    else:
        print("SmolLM2 GGUF not found; smollm2_expected.json not regenerated")


if __name__ == "__main__":
    main()
