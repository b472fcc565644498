#!/usr/bin/env bash
# What verification costs end to end: a 5-daemon loopback swarm (a head over the first third of
# the layers, two peers for each other third, so every remote hop has an auditor) generates with
# verification off (audit and spot-check rates 0) and at the daemon's defaults, taking turns,
# and prints wall time per token, the CPU time all five daemons spent per token (generations 2
# and 3: the first also builds the head's checkers), the ratio of that CPU time with
# verification at the defaults to without (the extra compute the checks cost the swarm), and
# the head's audit and spot-check counters.
#
#   scripts/bench-verify.sh [MODEL] [TOKENS] [ROUNDS]     (default: smollm2-135m 96 2)
#   LAYERS=30 sets the model's layer count (default 30, SmolLM2-135M).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-smollm2-135m}
TOKENS=${2:-96}
ROUNDS=${3:-2}
L=${LAYERS:-30}
DCD=${DCD:-target/release/dcd}
[ -x "$DCD" ] || cargo build --release --locked -p dcd
if [ ! -e "$MODEL" ]; then
    MODEL=${DCD_DATA_DIR:-${XDG_DATA_HOME:-$HOME/.local/share}/dcd}/models/$MODEL
fi
work=$(mktemp -d)
daemons=()
stop_all() {
    for p in "${daemons[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    daemons=()
}
trap 'stop_all; rm -rf "$work"' EXIT

start() { # dir name layers extra...
    local dir=$1 name=$2 layers=$3
    shift 3
    "$DCD" join --model "$MODEL" --layers "$layers" --listen /ip4/127.0.0.1/tcp/0 --no-mdns \
        --api 127.0.0.1:0 --data-dir "$dir/$name" --announce-secs 0.5 --no-selftest "$@" \
        >"$dir/$name.out" 2>"$dir/$name.err" &
    daemons+=($!)
    for _ in $(seq 600); do
        grep -q "^serving layers" "$dir/$name.out" 2>/dev/null && return
        sleep 0.1
    done
    echo "daemon $name did not start:" >&2
    cat "$dir/$name.err" >&2
    exit 1
}

cpu_ticks() { # user + system clock ticks so far of the head and of all daemons
    local t=0 p
    for p in "${daemons[@]}"; do
        t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat")))
    done
    echo "$(awk '{print $14 + $15}' "/proc/${daemons[0]}/stat") $t"
}
TICK=$(getconf CLK_TCK)
cpu_off=

swarm() { # off|defaults: one round of 3 generations with verification off or at the defaults
    local mode=$1 dir c0 h0 h1 t0 t1
    local spot=() audit=()
    if [ "$mode" = off ]; then
        spot=(--spot-check-rate 0)
        audit=(--audit-rate 0)
    fi
    dir=$(mktemp -d -p "$work")
    local a=$((L / 3)) b=$((2 * L / 3))
    start "$dir" head "0..$a" "${spot[@]}"
    local boot api
    boot=$(grep -m1 "listening on /ip4/127.0.0.1/tcp" "$dir/head.out" | awk '{print $3}')
    for n in 1 2; do
        start "$dir" "mid$n" "$a..$b" --no-head --bootstrap "$boot"
        start "$dir" "tail$n" "$b..$L" --no-head --bootstrap "$boot"
    done
    api=$(grep -m1 "^control API on" "$dir/head.out" | awk '{print $4}')
    sleep 3
    for seed in 1 2 3; do
        local s e
        s=$(date +%s.%N)
        "$DCD" generate --api "$api" --prompt-ids 5,17,99,3,250,41,7,0,12 \
            --max-new-tokens "$TOKENS" --ignore-eos --seed "$seed" "${audit[@]}" \
            --json >/dev/null
        e=$(date +%s.%N)
        python3 -c "print('verification $mode, generation $seed: %.1f ms/token' % (($e - $s) * 1000 / $TOKENS))"
        if [ "$seed" = 1 ]; then c0=$(cpu_ticks); fi
    done
    local cpu
    read -r h1 t1 <<<"$(cpu_ticks)"
    read -r h0 t0 <<<"$c0"
    cpu=$(python3 -c "print('%.2f' % (($t1 - $t0) * 1000 / $TICK / (2 * $TOKENS)))")
    python3 -c "print('  CPU per token, generations 2 and 3: all daemons $cpu ms, the head %.2f ms' \
        % (($h1 - $h0) * 1000 / $TICK / (2 * $TOKENS)))"
    if [ "$mode" = off ]; then
        cpu_off=$cpu
    else
        python3 -c "print('  defaults / off CPU: %.3f' % ($cpu / $cpu_off))"
    fi
    curl -s "$api/status" | python3 -c "
import json, sys
a = json.load(sys.stdin)['audits']
print('  audits', {k: a[k] for k in ['run', 'failed', 'from_cache', 'from_cache_bytes']},
      'spot checks', a['spot_checks'])"
    stop_all
}

for _ in $(seq "$ROUNDS"); do
    swarm off
    swarm defaults
done
