#!/usr/bin/env bash
# Measures generation through a 3-daemon loopback pipeline against one process on the same
# model: time per token and tokens/s, then aggregate throughput with several concurrent
# generations through the pipeline. Prints one line per measurement.
#
#   scripts/bench-swarm.sh [MODEL] [TOKENS] [CONCURRENCY]     (default: smollm2-135m 64 4)
#   LAYERS=30 sets the model's layer count (default 30, SmolLM2-135M).
set -euo pipefail
cd "$(dirname "$0")/.."
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

seconds() { # command...: median wall seconds of 5 runs (the machine may be noisy)
    local s e runs=()
    for _ in 1 2 3 4 5; do
        s=$(date +%s.%N)
        "$@" >/dev/null
        e=$(date +%s.%N)
        runs+=("$(python3 -c "print($e - $s)")")
    done
    python3 -c "import sys, statistics; print(round(statistics.median(map(float, sys.argv[1:])), 3))" "${runs[@]}"
}

a=$((L / 3))
b=$((2 * L / 3))
start a "0..$a"
boot=$(grep -m1 "listening on /ip4/127.0.0.1/tcp" "$work/a.out" | awk '{print $3}')
start b "$a..$b" --no-head --bootstrap "$boot"
start c "$b..$L" --no-head --bootstrap "$boot"
api=$(grep -m1 "control API on" "$work/a.out" | awk '{print $4}')
sleep 2

prompt="The quick brown fox jumps over the lazy dog. Once upon a time"
# One process, including loading the model; and the load alone (one token), to subtract.
t_local=$(seconds "$DCD" generate --model "$MODEL" --prompt "$prompt" --max-new-tokens "$TOKENS" --ignore-eos --json)
t_load=$(seconds "$DCD" generate --model "$MODEL" --prompt "$prompt" --max-new-tokens 1 --ignore-eos --json)
t_swarm=$(seconds "$DCD" generate --api "$api" --prompt "$prompt" --max-new-tokens "$TOKENS" --ignore-eos --json --audit-rate 0)
t_swarm1=$(seconds "$DCD" generate --api "$api" --prompt "$prompt" --max-new-tokens 1 --ignore-eos --json --audit-rate 0)
python3 - "$TOKENS" "$t_local" "$t_load" "$t_swarm" "$t_swarm1" <<'PY'
import sys
n, tl, tl1, ts, ts1 = int(sys.argv[1]), *map(float, sys.argv[2:])
dl, ds = (tl - tl1) / (n - 1), (ts - ts1) / (n - 1)
print(f"one process:       {1000*dl:.1f} ms/token, {1/dl:.1f} tokens/s at decode")
print(f"3-daemon pipeline: {1000*ds:.1f} ms/token, {1/ds:.1f} tokens/s at decode ({ds/dl:.2f}x the per-token time)")
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
