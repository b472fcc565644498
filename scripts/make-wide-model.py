#!/usr/bin/env python3
"""Writes a Llama-architecture Hugging Face folder with random weights and the layer shapes of
a large model (default: Llama-2-7B's — hidden 4096, 32 heads of 128, FFN 11008) but only a few
layers and a small vocabulary, so `dcd bench model` can measure per-layer costs (commitments,
spot checks) at those widths on a machine that could not hold the real model. Needs numpy.

    scripts/make-wide-model.py OUT_DIR [--layers 2] [--hidden 4096] [--heads 32]
                                       [--kv-heads 32] [--ffn 11008] [--vocab 2048]
"""
import argparse
import json
import os
import struct

import numpy as np


def write_safetensors(path, tensors):
    """The safetensors layout: u64 header length, JSON header, then the raw little-endian data."""
    header, offset = {}, 0
    for name, a in tensors:
        header[name] = {"dtype": "F16", "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, a in tensors:
            f.write(a.astype("<f2").tobytes())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=32)
    p.add_argument("--ffn", type=int, default=11008)
    p.add_argument("--vocab", type=int, default=2048)
    a = p.parse_args()
    if a.hidden % a.heads or a.heads % a.kv_heads:
        p.error("hidden must be a multiple of heads, and heads of kv-heads")
    hd = a.hidden // a.heads
    rng = np.random.default_rng(7)

    def w(*shape, std=0.02):
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float16)

    tensors = [("model.embed_tokens.weight", w(a.vocab, a.hidden, std=1.0))]
    for i in range(a.layers):
        pre = f"model.layers.{i}."
        tensors += [
            (pre + "input_layernorm.weight", np.ones(a.hidden, np.float16)),
            (pre + "self_attn.q_proj.weight", w(a.hidden, a.hidden)),
            (pre + "self_attn.k_proj.weight", w(a.kv_heads * hd, a.hidden)),
            (pre + "self_attn.v_proj.weight", w(a.kv_heads * hd, a.hidden)),
            (pre + "self_attn.o_proj.weight", w(a.hidden, a.hidden)),
            (pre + "post_attention_layernorm.weight", np.ones(a.hidden, np.float16)),
            (pre + "mlp.gate_proj.weight", w(a.ffn, a.hidden)),
            (pre + "mlp.up_proj.weight", w(a.ffn, a.hidden)),
            (pre + "mlp.down_proj.weight", w(a.hidden, a.ffn)),
        ]
    tensors += [("model.norm.weight", np.ones(a.hidden, np.float16)),
                ("lm_head.weight", w(a.vocab, a.hidden))]
    os.makedirs(a.out, exist_ok=True)
    write_safetensors(os.path.join(a.out, "model.safetensors"), tensors)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": a.hidden, "intermediate_size": a.ffn, "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "head_dim": hd,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "vocab_size": a.vocab, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16",
    }
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    print(f"{a.out}: {a.layers} layers, hidden {a.hidden}, {a.heads}/{a.kv_heads} heads, "
          f"FFN {a.ffn}, vocab {a.vocab}")


if __name__ == "__main__":
    main()
