#!/usr/bin/env bash
# Measures generation through a 3-daemon loopback pipeline against one process on the same
# model: time per token and tokens/s, then aggregate throughput with several concurrent
# generations through the pipeline. Prints one line per measurement.
#
#   scripts/bench-swarm.sh [--speculative] [MODEL] [TOKENS] [CONCURRENCY]
#                                                  (default: smollm2-135m 64 4)
#   LAYERS=30 sets the model's layer count (default 30, SmolLM2-135M).
#
# With --speculative it measures instead decode with and without prompt-lookup speculation,
# locally and through the pipeline, on three tasks (editing code, quoting a text, free text),
# greedy, with the tokens per lap the head kept; the tokens must be the same in every run.
set -euo pipefail
cd "$(dirname "$0")/.."
SPECULATIVE=0
if [ "${1:-}" = --speculative ]; then
    SPECULATIVE=1
    shift
fi
MODEL=${1:-smollm2-135m}
TOKENS=${2:-64}
CONC=${3:-4}
L=${LAYERS:-30}
DCD=${DCD:-target/release/dcd}
[ -x "$DCD" ] || cargo build --release --locked -p dcd
# Each daemon has its own data directory, so an installed model's name becomes its folder.
if [ ! -e "$MODEL" ]; then
    MODEL=${DCD_DATA_DIR:-${XDG_DATA_HOME:-$HOME/.local/share}/dcd}/models/$MODEL
fi
work=$(mktemp -d)
daemons=()
cleanup() {
    for p in "${daemons[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

start() { # name layers extra...
    local name=$1 layers=$2
    shift 2
    "$DCD" join --model "$MODEL" --layers "$layers" --listen /ip4/127.0.0.1/tcp/0 --no-mdns \
        --api 127.0.0.1:0 --data-dir "$work/$name" --announce-secs 0.5 --no-selftest "$@" \
        >"$work/$name.out" 2>"$work/$name.err" &
    daemons+=($!)
    for _ in $(seq 600); do
        grep -q "^serving layers" "$work/$name.out" 2>/dev/null && return
        sleep 0.1
    done
    echo "daemon $name did not start:" >&2
    cat "$work/$name.err" >&2
    exit 1
}

rate() { # command...: median decode tokens/s of 5 runs (the machine may be noisy), as the
         # generation itself timed it: from its first token to its last
    local runs=()
    for _ in 1 2 3 4 5; do
        runs+=("$("$@" | python3 -c "import json,sys; print(json.load(sys.stdin)['timing']['decode_tokens_per_s'])")")
    done
    python3 -c "import sys, statistics; print(round(statistics.median(map(float, sys.argv[1:])), 2))" "${runs[@]}"
}

a=$((L / 3))
b=$((2 * L / 3))
start a "0..$a"
boot=$(grep -m1 "listening on /ip4/127.0.0.1/tcp" "$work/a.out" | awk '{print $3}')
start b "$a..$b" --no-head --bootstrap "$boot"
start c "$b..$L" --no-head --bootstrap "$boot"
api=$(grep -m1 "control API on" "$work/a.out" | awk '{print $4}')
sleep 2

if [ "$SPECULATIVE" = 1 ]; then
    tasks=(
        "edit code|Here is a Python function:

def total(items):
    result = 0
    for item in items:
        if item.price > 0:
            result = result + item.price * item.count
    return result

The same function with result renamed to acc:

def total(items):
"
        "quote|The mayor said: \"The river rose four feet in one night, and we opened the school as a shelter for every family that needed one.\" Repeat what the mayor said, word for word: \""
        "free text|Write a short story about a lighthouse keeper who finds a message in a bottle."
    )
    guesses() { # the head's guessed and kept tokens so far
        "$DCD" status --api "$api" --json | python3 -c "import json,sys; s=json.load(sys.stdin); print(s['tokens_guessed'], s['guesses_kept'])"
    }
    for task in "${tasks[@]}"; do
        name=${task%%|*}
        text=${task#*|}
        for mode in off prompt-lookup; do
            gen() { "$DCD" generate "$@" --prompt "$text" --ignore-eos --json --speculative "$mode"; }
            # The tokens are the same in every mode, locally and through the pipeline.
            want=$(gen --model "$MODEL" --max-new-tokens "$TOKENS" | python3 -c "import json,sys; print(json.load(sys.stdin)['tokens'])")
            got=$(gen --api "$api" --max-new-tokens "$TOKENS" --audit-rate 0 | python3 -c "import json,sys; print(json.load(sys.stdin)['tokens'])")
            if [ "$want" != "$got" ]; then
                echo "$name, $mode: the pipeline's tokens differ from one process's" >&2
                exit 1
            fi
            read -r g0 k0 < <(guesses)
            rl=$(rate gen --model "$MODEL" --max-new-tokens "$TOKENS")
            rs=$(rate gen --api "$api" --max-new-tokens "$TOKENS" --audit-rate 0)
            read -r g1 k1 < <(guesses)
            python3 - "$name" "$mode" "$TOKENS" "$rl" "$rs" "$((g1 - g0))" "$((k1 - k0))" <<'PY'
import sys
name, mode = sys.argv[1:3]
n, rl, rs = int(sys.argv[3]), *map(float, sys.argv[4:6])
guessed, kept = map(int, sys.argv[6:8])
# Five generations of n tokens through the pipeline: each kept guess saved a lap.
laps = 5 * (n - 1) - kept
per_lap = 5 * (n - 1) / laps if laps > 0 else 0
print(f"{name:>9}, {mode:>13}: one process {rl:6.1f} tokens/s, 3-daemon pipeline {rs:6.1f} tokens/s "
      f"({per_lap:.2f} tokens per lap, {kept} of {guessed} guesses kept)")
PY
        done
    done
    exit 0
fi

prompt="The quick brown fox jumps over the lazy dog. Once upon a time"
# Decode tokens/s of one process and through the pipeline, each timed inside the generation.
r_local=$(rate "$DCD" generate --model "$MODEL" --prompt "$prompt" --max-new-tokens "$TOKENS" --ignore-eos --json)
r_swarm=$(rate "$DCD" generate --api "$api" --prompt "$prompt" --max-new-tokens "$TOKENS" --ignore-eos --json --audit-rate 0)
python3 - "$r_local" "$r_swarm" <<'PY'
import sys
rl, rs = map(float, sys.argv[1:])
print(f"one process:       {1000/rl:.1f} ms/token, {rl:.1f} tokens/s at decode")
print(f"3-daemon pipeline: {1000/rs:.1f} ms/token, {rs:.1f} tokens/s at decode ({rs/rl:.2f} of one process)")
PY
clients=()
s=$(date +%s.%N)
for i in $(seq "$CONC"); do
    "$DCD" generate --api "$api" --prompt "$prompt" --max-new-tokens "$TOKENS" --ignore-eos \
        --seed "$i" --temperature 0.8 --json --audit-rate 0 >/dev/null &
    clients+=($!)
done
wait "${clients[@]}"
e=$(date +%s.%N)
python3 -c "t=$e-$s; print(f'$CONC concurrent generations: {$CONC*$TOKENS} tokens in {t:.2f}s, {$CONC*$TOKENS/t:.1f} tokens/s aggregate')"
# How many hops each daemon computed stacked with another generation's (one GEMM per product).
stacked=()
for name in a b c; do
    d_api=$(grep -m1 "control API on" "$work/$name.out" | awk '{print $4}')
    stacked+=("$("$DCD" status --api "$d_api" --json | python3 -c "import json,sys; s=json.load(sys.stdin); print(f\"{s['hops_stacked']}/{s['hops_served']}\")")")
done
echo "hops stacked / served, per daemon: ${stacked[*]}"
