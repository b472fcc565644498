#!/usr/bin/env bash
# Chaos: real daemons on loopback, generations running without pause while random daemons
# (heads and stages) are killed with SIGKILL and restarted with the same identity and layers.
#
#   scripts/chaos.sh [KILLS] [MODEL]     (default: 50 kills, the llama fixture)
#
# The swarm: a gateway serving every layer without head weights (it forwards each request to
# an elected head and is never killed: it is where the client is), and five daemons that are:
# two heads over the first half of the layers, one head over all of them, and two stages
# without head weights, one per half. So every layer has at least two peers besides the
# gateway, and every head election has candidates.
#
# Each generation uses one of a few prompts and seeds whose tokens were computed locally
# first; a completed generation must equal its reference bit for bit (tokens and the hash of
# the final logits). Prints a line per kill and per failure, and last one JSON object:
# {"kills", "started", "completed", "failed", "different", "seconds", and the gateway's
# "head_failovers", "reroutes", "stages_replaced"}. Exits non-zero unless
# failed and different are both 0.
#
# TOKENS (default 48) sets each generation's length, GENERATIONS_AT_ONCE (default 2) how many
# run concurrently.
set -euo pipefail
cd "$(dirname "$0")/.."
KILLS=${1:-50}
MODEL=$(realpath "${2:-../shared/fixtures/llama}")
TOKENS=${TOKENS:-48}
AT_ONCE=${GENERATIONS_AT_ONCE:-2}
DCD=$(realpath "${DCD:-target/release/dcd}")
[ -x "$DCD" ] || cargo build --release --locked -p dcd
L=${LAYERS:-$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['num_hidden_layers'])" \
    "$MODEL/config.json")}
H=$((L / 2))
work=$(mktemp -d)
declare -A pid layers extra
cleanup() {
    for p in "${pid[@]}"; do kill -9 "$p" 2>/dev/null || true; done
    [ -n "${load_pids:-}" ] && kill $load_pids 2>/dev/null || true
    wait 2>/dev/null || true
    [ -n "${KEEP:-}" ] && echo "kept $work" >&2 || rm -rf "$work"
}
trap cleanup EXIT

start() { # name
    local name=$1 port
    # A fixed port per daemon, so that a restarted one is found where it was.
    port=$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
    [ -f "$work/$name.port" ] && port=$(cat "$work/$name.port") || echo "$port" >"$work/$name.port"
    # shellcheck disable=SC2086
    "$DCD" join --model "$MODEL" --layers "${layers[$name]}" --listen "/ip4/127.0.0.1/tcp/$port" \
        --no-mdns --api 127.0.0.1:0 --data-dir "$work/$name" --announce-secs 0.3 \
        --no-selftest --threads 1 ${extra[$name]} ${BOOT:+--bootstrap $BOOT} \
        >"$work/$name.out" 2>>"$work/$name.err" &
    pid[$name]=$!
}
wait_serving() { # name
    for _ in $(seq 600); do
        grep -q "^serving layers" "$work/$1.out" 2>/dev/null && return
        sleep 0.1
    done
    echo "daemon $1 did not start" >&2
    tail -20 "$work/$1.err" >&2
    exit 1
}

layers[gateway]="0..$L"; extra[gateway]="--no-head"
layers[head1]="0..$H"; extra[head1]=""
layers[head2]="0..$H"; extra[head2]=""
layers[head3]="0..$L"; extra[head3]=""
layers[stage1]="0..$H"; extra[stage1]="--no-head"
layers[stage2]="$H..$L"; extra[stage2]="--no-head"
BOOT=
start gateway
wait_serving gateway
API=$(grep -m1 "^control API on " "$work/gateway.out" | cut -d' ' -f4)
BOOT="$(grep -m1 "^listening on /ip4/127.0.0.1/tcp/" "$work/gateway.out" | cut -d' ' -f3)"
victims=(head1 head2 head3 stage1 stage2)
for v in "${victims[@]}"; do start "$v"; done
for v in "${victims[@]}"; do wait_serving "$v"; done
for _ in $(seq 100); do
    n=$(curl -sf "$API/status" | python3 -c "import json,sys; print(len(json.load(sys.stdin)['peers']))")
    [ "$n" -ge 5 ] && break
    sleep 0.2
done

# The references, from local runs.
PROMPTS=("1,2,3,4,5" "7,9,11,13,15,17,19" "42,17,3")
SEEDS=(1 2 3)
for i in 0 1 2; do
    "$DCD" --threads 1 generate --model "$MODEL" --local --prompt-ids "${PROMPTS[$i]}" \
        --max-new-tokens "$TOKENS" --temperature 0.8 --seed "${SEEDS[$i]}" --json \
        | python3 -c "import json,sys; r=json.load(sys.stdin); print(json.dumps([r['tokens'], r['final_logits']]))" \
        >"$work/ref$i"
done

# Generations without pause, each client recording its outcome in a file of its own.
mkdir "$work/results"
client() { # index
    local n=0 i out
    while [ ! -f "$work/stop" ]; do
        n=$((n + 1))
        i=$(((n + $1) % 3))
        if out=$(timeout 120 "$DCD" generate --api "$API" --prompt-ids "${PROMPTS[$i]}" \
            --max-new-tokens "$TOKENS" --temperature 0.8 --seed "${SEEDS[$i]}" --json \
            2>"$work/results/$1.$n.err"); then
            if [ "$(python3 -c "import json,sys; r=json.loads(sys.argv[1]); print(json.dumps([r['tokens'], r['final_logits']]))" "$out")" = "$(cat "$work/ref$i")" ]; then
                echo completed >"$work/results/$1.$n"
            else
                echo different >"$work/results/$1.$n"
                echo "generation $1.$n differs from its reference: $out" >&2
            fi
        else
            echo failed >"$work/results/$1.$n"
            echo "generation $1.$n failed: $(tail -1 "$work/results/$1.$n.err")" >&2
        fi
    done
}
load_pids=
for c in $(seq "$AT_ONCE"); do
    client "$c" &
    load_pids="$load_pids $!"
done

t0=$(date +%s)
for k in $(seq "$KILLS"); do
    sleep "$(python3 -c "import random; print(round(random.uniform(0.5, 2.0), 2))")"
    v=${victims[$((RANDOM % ${#victims[@]}))]}
    kill -9 "${pid[$v]}" 2>/dev/null || true
    wait "${pid[$v]}" 2>/dev/null || true
    echo "kill $k: $v"
    sleep "$(python3 -c "import random; print(round(random.uniform(0.5, 2.5), 2))")"
    start "$v"
    wait_serving "$v"
done
sleep 3
touch "$work/stop"
# shellcheck disable=SC2086
wait $load_pids
load_pids=
t1=$(date +%s)
count() { cat "$work"/results/*[0-9] 2>/dev/null | { grep -cx "$1" || true; }; }
started=$(find "$work/results" -type f ! -name '*.err' | wc -l)
completed=$(count completed)
failed=$(count failed)
different=$(count different)
# What the gateway did about it: heads taken over, attempts rerouted, stages replaced.
moves=$(curl -sf "$API/status" | python3 -c "
import json, sys
s = json.load(sys.stdin)
print(', '.join('\"%s\": %d' % (k, s[k]) for k in ('head_failovers', 'reroutes', 'stages_replaced')))")
echo "{\"kills\": $KILLS, \"started\": $started, \"completed\": $completed, \"failed\": $failed, \"different\": $different, \"seconds\": $((t1 - t0)), $moves}"
[ "$failed" -eq 0 ] && [ "$different" -eq 0 ]
