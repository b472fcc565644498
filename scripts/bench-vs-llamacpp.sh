#!/usr/bin/env bash
# bench-vs-llamacpp.sh — dcd's CPU prefill/decode speed against llama.cpp and ik_llama.cpp
# on the same random-weight Llama Q8_0 GGUF (hidden 2048, 16 layers, 32/8 heads, FFN 5632,
# vocab 32000), same prompt lengths (128, 512), same decode length, 1 and 2 threads.
#
# The peers come only from PyPI, as source: the sdists of llama-cpp-python (vendors llama.cpp)
# and ik-llama-cpp-python (vendors ik_llama.cpp). Only their `llama-bench` target is built, in a
# work directory outside the repository; builds and the model file are cached, so a re-run only
# benchmarks. Nothing of theirs enters the repo.
#
# Run:   scripts/bench-vs-llamacpp.sh
# Env:   DCD_PEERS_DIR  work dir           (default ~/.cache/dcd-peers)
#        DCD_BIN        dcd binary         (default target/release/dcd of this repo)
#        ROUNDS         alternating rounds (default 2; each engine's best round is kept)
#        REPS           llama-bench -r     (default 3; dcd bench model always takes 3)
#        DECODE         decode tokens      (default 32)
#        THREADS        thread counts      (default 1,2)
#        IK_FLAGS       extra ik_llama.cpp llama-bench flags (default "-rtr 1")
# Prints a table, then LAST one JSON line of dcd/peer ratios (null where a peer is missing).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${DCD_PEERS_DIR:-$HOME/.cache/dcd-peers}
DCD_BIN=${DCD_BIN:-$REPO/target/release/dcd}
ROUNDS=${ROUNDS:-2}
REPS=${REPS:-3}
DECODE=${DECODE:-32}
THREADS=${THREADS:-1,2}
LLAMA_CPP_PY_VERSION=0.3.36
JOBS=2

log() { echo "[bench-vs-llamacpp] $*" >&2; }

case "$WORK" in "$REPO"|"$REPO"/*) log "DCD_PEERS_DIR must be outside the repository"; exit 1 ;; esac
[ -x "$DCD_BIN" ] || { log "no dcd binary at $DCD_BIN (cargo build --release first)"; exit 1; }
mkdir -p "$WORK/dl" "$WORK/src" "$WORK/build" "$WORK/results"
export PATH="$HOME/.local/bin:$PATH"

# ---------------------------------------------------------------------------- tools
if ! command -v cmake >/dev/null; then
    log "cmake absent: pip install --user cmake"
    pip install --user --quiet cmake
fi
if ! python3 -c 'import gguf, numpy' 2>/dev/null; then
    log "gguf/numpy absent: pip install --user gguf numpy"
    pip install --user --quiet gguf numpy
fi

# ---------------------------------------------------------------------------- sources
# fetch_sdist PKG [VERSION] -> prints the unpacked directory, or nothing if there is no sdist.
# `--no-binary PKG` (not `:all:`): with `:all:` pip also builds the sdist's *build* deps
# (cmake, ninja, scikit-build-core) from source just to read metadata, which takes an hour on
# 2 cores. Restricting it to the package still guarantees the package itself is the sdist.
fetch_sdist() {
    local pkg=$1 ver=${2:-} spec norm tarball dir
    spec=$pkg${ver:+==$ver}
    norm=${pkg//-/_}
    tarball=$(ls "$WORK/dl/${norm}"-${ver:-*}.tar.gz 2>/dev/null | sort -V | tail -1 || true)
    if [ -z "$tarball" ]; then
        log "pip download --no-deps --no-binary $pkg $spec"
        if ! pip download --quiet --no-deps --no-binary "$pkg" "$spec" -d "$WORK/dl" >&2; then
            log "no source distribution of $spec on PyPI"
            return 0
        fi
        tarball=$(ls "$WORK/dl/${norm}"-${ver:-*}.tar.gz 2>/dev/null | sort -V | tail -1 || true)
        [ -n "$tarball" ] || { log "$spec: pip saved no .tar.gz sdist"; return 0; }
    fi
    dir="$WORK/src/$(basename "$tarball" .tar.gz)"
    [ -d "$dir" ] || tar xzf "$tarball" -C "$WORK/src"
    echo "$dir"
}

# CPU feature flags: what /proc/cpuinfo lists, never AMX (CPUID may advertise AMX that the
# kernel does not enable; tile instructions then die with SIGILL).
has() { grep -qw "$1" /proc/cpuinfo; }
onoff() { if has "$1"; then echo ON; else echo OFF; fi; }
ISA_FLAGS=(
    -DGGML_NATIVE=OFF
    -DGGML_AVX=$(onoff avx) -DGGML_AVX2=$(onoff avx2) -DGGML_FMA=$(onoff fma) -DGGML_F16C=$(onoff f16c)
    -DGGML_BMI2=$(onoff bmi2) -DGGML_AVX_VNNI=$(onoff avx_vnni)
    -DGGML_AVX512=$(onoff avx512f) -DGGML_AVX512_VBMI=$(onoff avx512vbmi)
    -DGGML_AVX512_VNNI=$(onoff avx512_vnni) -DGGML_AVX512_BF16=$(onoff avx512_bf16)
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
)
COMMON_FLAGS=(
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_HIP=OFF -DGGML_SYCL=OFF
    -DGGML_OPENCL=OFF -DGGML_BLAS=OFF -DGGML_BACKEND_DL=OFF -DGGML_CPU_ALL_VARIANTS=OFF
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
)

# build_bench NAME SRC EXTRA... -> prints the llama-bench path (cached).
build_bench() {
    local name=$1 src=$2 bdir="$WORK/build/$1" bin t0
    shift 2
    bin="$bdir/bin/llama-bench"
    if [ -x "$bin" ]; then log "$name: cached $bin"; echo "$bin"; return; fi
    t0=$(date +%s)
    log "$name: configuring ($src)"
    cmake -S "$src" -B "$bdir" "${COMMON_FLAGS[@]}" "${ISA_FLAGS[@]}" "$@" >"$WORK/build/$name.configure.log" 2>&1 \
        || { log "$name: cmake configure failed, see $WORK/build/$name.configure.log"; tail -20 "$WORK/build/$name.configure.log" >&2; return 1; }
    log "$name: building llama-bench with -j$JOBS (log $WORK/build/$name.build.log)"
    cmake --build "$bdir" --target llama-bench -j"$JOBS" >"$WORK/build/$name.build.log" 2>&1 \
        || { log "$name: build failed, see $WORK/build/$name.build.log"; tail -30 "$WORK/build/$name.build.log" >&2; return 1; }
    [ -x "$bin" ] || bin=$(find "$bdir" -name llama-bench -type f -perm -u+x | head -1)
    log "$name: built in $(( $(date +%s) - t0 )) s"
    echo "$bin"
}

LCP_DIR=$(fetch_sdist llama-cpp-python "$LLAMA_CPP_PY_VERSION")
[ -n "$LCP_DIR" ] && [ -d "$LCP_DIR/vendor/llama.cpp" ] || { log "llama-cpp-python sdist has no vendor/llama.cpp"; exit 1; }
LLAMA_SRC="$LCP_DIR/vendor/llama.cpp"
LLAMA_COMMIT=$(awk -v v="## [$LLAMA_CPP_PY_VERSION]" '$0==v{f=1;next} f&&/^## /{exit} f&&match($0,/llama\.cpp@[0-9a-f]+/){print substr($0,RSTART+10,RLENGTH-10);exit}' "$LCP_DIR/CHANGELOG.md" 2>/dev/null || true)
LLAMA_LABEL="llama.cpp ${LLAMA_COMMIT:-unknown commit} (llama-cpp-python $LLAMA_CPP_PY_VERSION sdist)"
LLAMA_BENCH=$(build_bench llamacpp "$LLAMA_SRC" -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF)

IK_BENCH="" IK_LABEL=""
IK_DIR=$(fetch_sdist ik-llama-cpp-python)
if [ -z "$IK_DIR" ]; then
    log "ik-llama-cpp-python: no sdist on PyPI; carrying on with llama.cpp alone"
elif [ ! -d "$IK_DIR/vendor/ik_llama.cpp" ]; then
    log "ik-llama-cpp-python: $(basename "$IK_DIR") vendors no ik_llama.cpp source; carrying on with llama.cpp alone"
else
    IK_VER=${IK_DIR##*-}
    # The sdist carries no git metadata and no pinned commit for its submodule.
    IK_LABEL="ik_llama.cpp unknown commit (ik-llama-cpp-python $IK_VER sdist)"
    IK_SRC="$IK_DIR/vendor/ik_llama.cpp"
    # The sdist omits common/cmake/build-info-gen-cpp.cmake, which the build_info target runs
    # (in -P mode, from the source root); stand in for it: fill build-info.cpp.in from
    # cmake/build-info.cmake (no .git here, so the commit reads "unknown").
    if [ ! -f "$IK_SRC/common/cmake/build-info-gen-cpp.cmake" ]; then
        log "ik_llamacpp: sdist lacks common/cmake/build-info-gen-cpp.cmake; writing a stand-in"
        mkdir -p "$IK_SRC/common/cmake"
        cat >"$IK_SRC/common/cmake/build-info-gen-cpp.cmake" <<'CMAKE'
include(${CMAKE_CURRENT_SOURCE_DIR}/cmake/build-info.cmake)
configure_file(${CMAKE_CURRENT_SOURCE_DIR}/common/build-info.cpp.in ${CMAKE_CURRENT_SOURCE_DIR}/common/build-info.cpp)
CMAKE
    fi
    # ik's GGML_AVX512 adds only -mavx512f -mavx512bw, but its AVX512 code paths (v_tanh on
    # __m512, HAVE_FANCY_SIMD) need DQ and VL too: without them iqk_fa_templates.h does not
    # compile. Add the AVX512 subsets the CPU lists.
    IK_CFLAGS=""
    for f in avx512dq avx512vl avx512cd; do has "$f" && IK_CFLAGS+=" -m$f"; done
    # GGML_IQK_FA_ALL_QUANTS=OFF only trims flash-attention kernels for K/V types not used here.
    IK_BENCH=$(build_bench ik_llamacpp "$IK_SRC" -DLLAMA_BUILD_EXAMPLES=ON \
        -DGGML_IQK_FA_ALL_QUANTS=OFF -DCMAKE_C_FLAGS="$IK_CFLAGS" -DCMAKE_CXX_FLAGS="$IK_CFLAGS") \
        || { log "ik_llama.cpp build failed; carrying on without it"; IK_BENCH=""; IK_LABEL=""; }
fi

# ---------------------------------------------------------------------------- model
MODEL="$WORK/rand-llama-2048x16-q8_0.gguf"
if [ ! -s "$MODEL" ]; then
    log "writing random-weight Q8_0 model $MODEL"
    MODEL_OUT="$MODEL.tmp" python3 - <<'PY'
import os
import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

H, L, NH, NKV, FFN, V, CTX = (int(os.environ.get(k, d)) for k, d in [
    ("M_HIDDEN", 2048), ("M_LAYERS", 16), ("M_HEADS", 32), ("M_KV_HEADS", 8),
    ("M_FFN", 5632), ("M_VOCAB", 32000), ("M_CTX", 2048)])
HD = H // NH
rng = np.random.default_rng(37)
w = gguf.GGUFWriter(os.environ["MODEL_OUT"], "llama")
w.add_name("dcd-bench-random-llama")
w.add_context_length(CTX)
w.add_embedding_length(H)
w.add_block_count(L)
w.add_feed_forward_length(FFN)
w.add_head_count(NH)
w.add_head_count_kv(NKV)
w.add_rope_dimension_count(HD)
w.add_rope_freq_base(10000.0)
w.add_layer_norm_rms_eps(1e-5)
w.add_vocab_size(V)
w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)

# SentencePiece-style ("llama") vocabulary: <unk> <s> </s>, the 256 byte tokens, "▁", then
# distinct filler pieces.
toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581"]
types = [2, 3, 3] + [6] * 256 + [1]
i = 0
while len(toks) < V:
    toks.append(f"\u2581t{i}")
    types.append(1)
    i += 1
scores = [0.0] * 259 + [-float(k) for k in range(V - 259)]
w.add_tokenizer_model("llama")
w.add_tokenizer_pre("default")
w.add_token_list(toks)
w.add_token_scores(scores)
w.add_token_types(types)
w.add_unk_token_id(0)
w.add_bos_token_id(1)
w.add_eos_token_id(2)
w.add_add_bos_token(True)
w.add_add_eos_token(False)

def q8(name, rows, cols):
    x = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)
    w.add_tensor(name, quantize(x, Q.Q8_0), raw_dtype=Q.Q8_0)

def norm(name):
    w.add_tensor(name, (1.0 + 0.01 * rng.standard_normal(H, dtype=np.float32)).astype(np.float32))

q8("token_embd.weight", V, H)
for l in range(L):
    p = f"blk.{l}."
    norm(p + "attn_norm.weight")
    q8(p + "attn_q.weight", NH * HD, H)
    q8(p + "attn_k.weight", NKV * HD, H)
    q8(p + "attn_v.weight", NKV * HD, H)
    q8(p + "attn_output.weight", H, NH * HD)
    norm(p + "ffn_norm.weight")
    q8(p + "ffn_gate.weight", FFN, H)
    q8(p + "ffn_up.weight", FFN, H)
    q8(p + "ffn_down.weight", H, FFN)
norm("output_norm.weight")
q8("output.weight", V, H)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
PY
    mv "$MODEL.tmp" "$MODEL"
fi
log "model: $MODEL ($(du -h "$MODEL" | cut -f1))"

# ---------------------------------------------------------------------------- bench
RUN="$WORK/results/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$RUN"
log "raw results in $RUN"

run_dcd() {  # round
    local n
    for n in 128 512; do
        "$DCD_BIN" bench model --model "$MODEL" --thread-counts "$THREADS" \
            --prompt-tokens "$n" --decode-tokens "$DECODE" --json >"$RUN/dcd.p$n.r$1.json" 2>"$RUN/dcd.p$n.r$1.err" \
            || { log "dcd bench model failed (prompt $n), see $RUN/dcd.p$n.r$1.err"; tail -5 "$RUN/dcd.p$n.r$1.err" >&2; return 1; }
    done
}
# Weights read into memory, not mmapped: newer llama.cpp spells it `-lm none`, older ones and
# ik_llama.cpp `-mmp 0`. ik_llama.cpp also gets IK_FLAGS (default `-rtr 1`: run-time repacking
# into its interleaved row layout, its recommended CPU setting; mainline repacks by default).
IK_FLAGS=${IK_FLAGS:--rtr 1}
run_peer() {  # name binary round
    local extra help
    help=$("$2" --help 2>&1 || true)  # (not piped into grep -q: SIGPIPE + pipefail would lie)
    if [[ $help == *--load-mode* ]]; then extra=(-lm none); else extra=(-mmp 0); fi
    # shellcheck disable=SC2206
    [ "$1" = ik_llamacpp ] && extra+=($IK_FLAGS)
    echo "$2 -m $MODEL -p 128,512 -n $DECODE -t $THREADS -r $REPS ${extra[*]} -o json" >"$RUN/$1.r$3.cmd"
    "$2" -m "$MODEL" -p 128,512 -n "$DECODE" -t "$THREADS" -r "$REPS" "${extra[@]}" -o json \
        >"$RUN/$1.r$3.json" 2>"$RUN/$1.r$3.err" \
        || { log "$1 llama-bench failed, see $RUN/$1.r$3.err"; tail -5 "$RUN/$1.r$3.err" >&2; return 1; }
}

T0=$(date +%s)
for r in $(seq 1 "$ROUNDS"); do
    log "round $r/$ROUNDS: dcd";        run_dcd "$r"
    log "round $r/$ROUNDS: llama.cpp";  run_peer llamacpp "$LLAMA_BENCH" "$r"
    if [ -n "$IK_BENCH" ]; then
        log "round $r/$ROUNDS: ik_llama.cpp"; run_peer ik_llamacpp "$IK_BENCH" "$r"
    fi
done
log "benchmark took $(( $(date +%s) - T0 )) s"

# ---------------------------------------------------------------------------- report
RUN="$RUN" LLAMA_LABEL="$LLAMA_LABEL" IK_LABEL="$IK_LABEL" HAVE_IK="${IK_BENCH:+1}" \
THREADS="$THREADS" DECODE="$DECODE" ROUNDS="$ROUNDS" REPS="$REPS" MODEL="$MODEL" python3 - <<'PY'
import glob, json, os, statistics

run = os.environ["RUN"]
threads = [int(t) for t in os.environ["THREADS"].split(",")]
dec = int(os.environ["DECODE"])
# best[engine][(metric, threads)] = tokens/s; metric in pp128, pp512, tg
best = {}

def keep(engine, key, v):
    d = best.setdefault(engine, {})
    d[key] = max(d.get(key, 0.0), v)

for f in glob.glob(f"{run}/dcd.p*.r*.json"):
    n = int(os.path.basename(f).split(".")[1][1:])
    for r in json.load(open(f))["results"]:
        t = r["threads"]
        keep("dcd", (f"pp{n}", t), r["prefill_tokens_per_s"])
        if n == 128:  # decode after the 128-token prompt (llama-bench's tg starts empty)
            keep("dcd", ("tg", t), r["decode_tokens_per_s"])

for engine in ("llamacpp", "ik_llamacpp"):
    for f in glob.glob(f"{run}/{engine}.r*.json"):
        for r in json.load(open(f)):
            samples = r.get("samples_ts") or [r["avg_ts"]]
            v = statistics.median(samples)
            t = r["n_threads"]
            if r["n_prompt"] > 0 and r["n_gen"] == 0:
                keep(engine, (f"pp{r['n_prompt']}", t), v)
            elif r["n_gen"] > 0 and r["n_prompt"] == 0:
                keep(engine, ("tg", t), v)

labels = {"dcd": "dcd", "llamacpp": "llama.cpp", "ik_llamacpp": "ik_llama.cpp"}
print()
print(f"Model: {os.environ['MODEL']}")
print("  random Llama, hidden 2048, 16 layers, 32/8 heads, FFN 5632, vocab 32000, Q8_0")
print(f"Peers: {os.environ['LLAMA_LABEL']}")
print(f"       {os.environ['IK_LABEL'] or 'ik_llama.cpp: not available (see log above)'}")
print(f"tokens/s; median within a run (dcd: 3 runs, llama-bench: -r {os.environ['REPS']}), "
      f"best of {os.environ['ROUNDS']} alternating rounds; decode = {dec} tokens")
cols = [(m, t) for m in ("pp128", "pp512", "tg") for t in threads]
names = {"pp128": "prefill128", "pp512": "prefill512", "tg": f"decode{dec}"}
hdr = f"{'engine':<14}" + "".join(f"{names[m] + ' ' + str(t) + 't':>16}" for m, t in cols)
print(hdr)
print("-" * len(hdr))
for e in ("dcd", "llamacpp", "ik_llamacpp"):
    if e not in best:
        print(f"{labels[e]:<14}" + "".join(f"{'-':>16}" for _ in cols))
        continue
    print(f"{labels[e]:<14}" + "".join(
        f"{best[e][k]:>16.2f}" if k in best[e] else f"{'-':>16}" for k in cols))

def ratios(peer):
    if peer not in best or "dcd" not in best:
        return None
    out = {}
    for m, name in (("pp128", "prefill"), ("tg", "decode"), ("pp512", "prefill512")):
        for t in threads:
            a, b = best["dcd"].get((m, t)), best[peer].get((m, t))
            out[f"{name}_{t}t"] = round(a / b, 3) if a and b else None
    return out

print()
print(json.dumps({"llamacpp": ratios("llamacpp"),
                  "ik_llamacpp": ratios("ik_llamacpp") if os.environ.get("HAVE_IK") else None}))
PY
