#!/usr/bin/env bash
# A real model across three daemons on loopback, two of which start with nothing but the
# model id and fetch their layers from the first: load time, peak memory and decode speed of
# each, against one process on the same file, and the tokens compared bit for bit.
#
#   scripts/bench-fetched-swarm.sh [NAME] [TOKENS]      (default: qwen2.5-coder-1.5b 32)
#
# NAME is a model scripts/fetch-model.sh installs (installed first if missing). Prints one
# line per measurement, then one JSON line.
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=${1:-qwen2.5-coder-1.5b}
TOKENS=${2:-32}
DCD=${DCD:-target/release/dcd}
[ -x "$DCD" ] || cargo build --release --locked -p dcd
scripts/fetch-model.sh "$NAME" >/dev/null
store=${DCD_DATA_DIR:-${XDG_DATA_HOME:-$HOME/.local/share}/dcd}/models/$NAME
MODEL=$(ls "$store"/*.gguf)
PROMPT="Write a Python function that checks whether a number is prime."
work=$(mktemp -d)
daemons=()
cleanup() {
    for p in "${daemons[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

peak_mb() { awk '/VmHWM/ {printf "%.0f", $2 / 1024}' "/proc/$1/status"; }

start() { # name model layers extra...: starts a daemon, prints its seconds to serving
    local name=$1 model=$2 layers=$3
    shift 3
    local s
    s=$(date +%s.%N)
    "$DCD" join --model "$model" --layers "$layers" --listen /ip4/127.0.0.1/tcp/0 --no-mdns \
        --api 127.0.0.1:0 --data-dir "$work/$name" --announce-secs 0.5 --no-selftest "$@" \
        >"$work/$name.out" 2>"$work/$name.err" &
    daemons+=($!)
    echo $! >"$work/$name.pid"
    for _ in $(seq 3000); do
        if grep -q "^serving layers" "$work/$name.out" 2>/dev/null; then
            echo "$(date +%s.%N) - $s" | bc
            return
        fi
        sleep 0.1
    done
    echo "daemon $name did not start:" >&2
    cat "$work/$name.err" >&2
    exit 1
}

layers=$(python3 - "$MODEL" <<'PY'
import sys
from gguf import GGUFReader
r = GGUFReader(sys.argv[1])
arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
print(int(r.fields[f"{arch}.block_count"].parts[-1][0]))
PY
)
a=$((layers / 3))
b=$((2 * layers / 3))

# One process: load (cold, then with the weight cache) and decode.
local_json() {
    "$DCD" generate --model "$MODEL" --local --prompt "$PROMPT" --max-new-tokens "$TOKENS" \
        --ignore-eos --json
}
s=$(date +%s.%N)
DCD_DATA_DIR=$work/local /usr/bin/time -f "%M" -o "$work/local.rss" "$DCD" generate --model "$MODEL" \
    --local --prompt "$PROMPT" --max-new-tokens "$TOKENS" --ignore-eos --json >"$work/local.json"
local_s=$(echo "$(date +%s.%N) - $s" | bc)
local_rss=$(($(cat "$work/local.rss") / 1024))
local_decode=$("$DCD" bench model --model "$MODEL" --thread-counts 2 --prompt-tokens 16 \
    --decode-tokens "$TOKENS" --json | python3 -c \
    "import json,sys; print(round(json.load(sys.stdin)['results'][0]['decode_tokens_per_s'], 2))")
echo "local: generate in ${local_s}s (load included), peak ${local_rss} MB, decode ${local_decode} tokens/s"

# The swarm: the first daemon has the file; the others only the model id.
t_a=$(start a "$MODEL" "0..$a")
addr=$(grep -m1 "listening on /ip4/127.0.0.1/tcp/" "$work/a.out" | cut -d' ' -f3)
api=$(grep -m1 "control API on" "$work/a.out" | cut -d' ' -f4)
id=$(curl -s "$api/status" | python3 -c "import json,sys; print(json.load(sys.stdin)['model_id'])")
t_b=$(start b "$id" "$a..$b" --no-head --bootstrap "$addr")
t_c=$(start c "$id" "$b..$layers" --no-head --bootstrap "$addr")
for _ in $(seq 300); do
    n=$(curl -s "$api/status" | python3 -c "import json,sys; print(sum(p['state']=='serving' for p in json.load(sys.stdin)['peers']))")
    [ "$n" = 2 ] && break
    sleep 0.2
done
fetched_b=$(du -sm "$work/b/models" | cut -f1)
fetched_c=$(du -sm "$work/c/models" | cut -f1)
s=$(date +%s.%N)
"$DCD" generate --api "$api" --prompt "$PROMPT" --max-new-tokens "$TOKENS" --ignore-eos --json >"$work/swarm.json"
swarm_s=$(echo "$(date +%s.%N) - $s" | bc)
swarm_decode=$(echo "scale=2; $TOKENS / $swarm_s" | bc)
same=$(python3 - "$work/local.json" "$work/swarm.json" <<'PY'
import json, sys
l, s = (json.load(open(p)) for p in sys.argv[1:])
print(str(l["tokens"] == s["tokens"] and l["final_logits"] == s["final_logits"]).lower())
PY
)
for d in a b c; do
    echo "daemon $d: serving after $(eval echo \$t_$d)s, peak $(peak_mb "$(cat "$work/$d.pid")") MB"
done
echo "b and c fetched ${fetched_b} MB and ${fetched_c} MB of the model from a"
echo "swarm: $TOKENS tokens in ${swarm_s}s (prefill included): ${swarm_decode} tokens/s; bit-identical to local: $same"
python3 - <<PY
import json
print(json.dumps({"model": "$NAME", "layers": $layers, "tokens": $TOKENS,
  "local": {"seconds": $local_s, "peak_mb": $local_rss, "decode_tokens_per_s": $local_decode},
  "daemons": {d: {"ready_s": float(t), "peak_mb": int(m)} for d, t, m in
     [("a", "$t_a", "$(peak_mb "$(cat "$work/a.pid")")"), ("b", "$t_b", "$(peak_mb "$(cat "$work/b.pid")")"),
      ("c", "$t_c", "$(peak_mb "$(cat "$work/c.pid")")")]},
  "fetched_mb": {"b": $fetched_b, "c": $fetched_c},
  "swarm": {"seconds": $swarm_s, "tokens_per_s": $swarm_decode}, "bit_identical": "$same" == "true"}))
PY
[ "$same" = true ]
