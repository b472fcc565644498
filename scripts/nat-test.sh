#!/usr/bin/env bash
# NAT traversal for real, in network namespaces (needs root, `ip` and `iptables`):
#
#   pub ── a "public" network: the relay daemon at 10.77.1.1 and 10.77.2.1
#    ├── r1 (router, MASQUERADE, public address 10.77.1.2) ── h1 (home 1, 192.168.1.2)
#    └── r2 (router, MASQUERADE, public address 10.77.2.2) ── h2 (home 2, 192.168.2.2)
#
# h1 heads and serves the first half of the layers, h2 the second; neither can be dialled
# from outside its home. Both reserve a slot on the relay (circuit relay v2) and announce the
# relayed address. Phase 1 blocks every direct packet between the two homes' routers, so the
# relay carries the activations; phase 2 lifts the block and restarts h1 and h2, so DCUtR can
# try to punch a direct connection (the relay carries the generation if it fails). Each phase
# generates and compares the tokens with a local run, and prints whether h1 reached h2
# directly or through the relay, and the decode speed; the last line counts hole punches.
#
#   scripts/nat-test.sh [MODEL] [TOKENS]    (default: the llama fixture, 32 tokens)
#   LAYERS=30 scripts/nat-test.sh ~/.local/share/dcd/models/smollm2-135m/*.gguf 64
#
# The last line is one JSON object with both phases. Only addresses inside the namespaces are
# used, and everything is torn down at the end (also on failure).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=$(realpath "${1:-../shared/fixtures/llama}")
TOKENS=${2:-32}
DCD=$(realpath "${DCD:-target/release/dcd}")
[ -x "$DCD" ] || cargo build --release --locked -p dcd
for tool in ip iptables; do
    command -v $tool >/dev/null || { echo "nat-test: needs $tool (and root)" >&2; exit 2; }
done
P=dc$$
NS=(pub r1 h1 r2 h2)
work=$(mktemp -d)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    for n in "${NS[@]}"; do
        # Whatever still runs in a namespace goes with it.
        ip netns pids "$P-$n" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
        ip netns del "$P-$n" 2>/dev/null || true
    done
    [ -n "${KEEP:-}" ] && echo "kept $work" >&2 || rm -rf "$work"
}
trap cleanup EXIT
nsx() { local n=$1; shift; ip netns exec "$P-$n" "$@"; }

# --- The networks ---------------------------------------------------------------------------
for n in "${NS[@]}"; do
    ip netns add "$P-$n"
    nsx "$n" ip link set lo up
done
link() { # ns1 if1 addr1 ns2 if2 addr2
    ip link add "$2" netns "$P-$1" type veth peer name "$5" netns "$P-$4"
    nsx "$1" ip addr add "$3" dev "$2"
    nsx "$4" ip addr add "$6" dev "$5"
    nsx "$1" ip link set "$2" up
    nsx "$4" ip link set "$5" up
}
link pub p1 10.77.1.1/24 r1 wan 10.77.1.2/24
link pub p2 10.77.2.1/24 r2 wan 10.77.2.2/24
link r1 lan 192.168.1.1/24 h1 eth 192.168.1.2/24
link r2 lan 192.168.2.1/24 h2 eth 192.168.2.2/24
# The public network routes between the two routers' public addresses (it is "the internet").
nsx pub sysctl -qw net.ipv4.ip_forward=1
for i in 1 2; do
    nsx r$i sysctl -qw net.ipv4.ip_forward=1
    nsx r$i ip route add default via 10.77.$i.1
    nsx r$i iptables -t nat -A POSTROUTING -o wan -j MASQUERADE
    # A home router: nothing gets in that the home did not ask for.
    nsx r$i iptables -A FORWARD -i wan -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
    nsx r$i iptables -A FORWARD -i wan -j DROP
    nsx h$i ip route add default via 192.168.$i.1
done
block_direct() { # add|del: packets between the two homes' public addresses
    local op=$1
    nsx pub iptables "-$op" FORWARD -s 10.77.1.2 -d 10.77.2.2 -j DROP
    nsx pub iptables "-$op" FORWARD -s 10.77.2.2 -d 10.77.1.2 -j DROP
}

# --- The daemons ----------------------------------------------------------------------------
# The layer count: LAYERS, or a Hugging Face folder's config.json (a GGUF file needs LAYERS).
L=${LAYERS:-$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['num_hidden_layers'])" \
    "$MODEL/config.json")}
H=$((L / 2))
start() { # ns name layers extra...
    local n=$1 name=$2 layers=$3
    shift 3
    # Only private addresses here: AutoNAT must not ignore them.
    # Not through nsx: a backgrounded shell function would be a subshell, and $! its pid.
    ip netns exec "$P-$n" env DCD_LOG=info,libp2p=warn DCD_AUTONAT_GLOBAL_ONLY=false \
        "$DCD" join --model "$MODEL" --layers "$layers" \
        --listen "/ip4/0.0.0.0/tcp/${PORT:-7371}" --no-mdns --api 127.0.0.1:7370 \
        --data-dir "$work/$name" --announce-secs 0.5 --no-selftest --threads 1 "$@" \
        >>"$work/$name.out" 2>>"$work/$name.err" &
    pids+=($!)
    eval "pid_$name=$!"
    for _ in $(seq 600); do
        grep -q "^serving layers" "$work/$name.out" 2>/dev/null && return
        sleep 0.1
    done
    echo "daemon $name did not start:" >&2
    tail -20 "$work/$name.err" >&2
    exit 1
}
status() { nsx "$1" curl -sf http://127.0.0.1:7370/status; }
peer_id() { grep -m1 "^peer id " "$work/$1.out" | cut -d' ' -f3; }

block_direct A
start pub relay "0..$H" --no-head --reachability public
RELAY=$(peer_id relay)
start h1 h1 "0..$H" --reachability private --bootstrap "/ip4/10.77.1.1/tcp/7371/p2p/$RELAY"
start h2 h2 "$H..$L" --no-head --reachability private \
    --bootstrap "/ip4/10.77.2.1/tcp/7371/p2p/$RELAY"
H2=$(peer_id h2)

sees_h2() { # how h1 reaches h2: direct, relayed or none
    status h1 | python3 -c "
import json, sys
s = json.load(sys.stdin)
print(next((p['connection'] for p in s['peers'] if p['peer_id'] == '$H2' and p['layers']), 'none'))"
}
wait_for_h2() { # h2 holds a relay reservation and h1 has heard its relayed address
    for _ in $(seq 300); do
        if status h2 | grep -q "p2p-circuit" && status h1 | grep -q "\"$H2\""; then
            sleep 1.2 # two announcement periods: h1 has the announcement with that address
            return
        fi
        sleep 0.2
    done
    echo "h1 never heard of h2" >&2
    tail -20 "$work/h1.err" "$work/h2.err" >&2
    exit 1
}

ARGS=(--prompt-ids 1,2,3,4,5,6,7,8 --max-new-tokens "$TOKENS" --temperature 0.8 --seed 5 --json)
local_run=$("$DCD" --threads 1 generate --model "$MODEL" --local "${ARGS[@]}")
phase() { # name
    local t0 t1 out same link
    t0=$(date +%s.%N)
    out=$(nsx h1 "$DCD" generate --api http://127.0.0.1:7370 "${ARGS[@]}")
    t1=$(date +%s.%N)
    link=$(sees_h2)
    same=$(python3 -c "
import json, sys
a, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(str(a['tokens'] == b['tokens'] and a['final_logits'] == b['final_logits']).lower())" \
        "$out" "$local_run")
    grep -q "$H2" <<<"$out" || { echo "the route did not go through h2: $out" >&2; exit 1; }
    python3 -c "print('{\"phase\": \"$1\", \"h1_to_h2\": \"$link\", \"tokens\": $TOKENS, \
\"seconds\": %.3f, \"tokens_per_s\": %.2f, \"equal_to_local\": $same}' % \
($t1 - $t0, $TOKENS / ($t1 - $t0)))"
}

warm_up() { # one token, so that connections are open before the measured run
    nsx h1 "$DCD" generate --api http://127.0.0.1:7370 --prompt-ids 1 --max-new-tokens 1 >/dev/null
}

# Phase 1: no direct path between the homes, the relay carries everything.
wait_for_h2
warm_up
p1=$(phase relayed)
echo "$p1"

# Phase 2: the path is open; h2 comes back, and the hole punch can succeed.
block_direct D
kill "$pid_h1" "$pid_h2"
wait "$pid_h1" "$pid_h2" 2>/dev/null || true
# Fresh ports: nothing of phase 1's blocked attempts is left in the routers' connection tracking.
PORT=7372
start h1 h1 "0..$H" --reachability private --bootstrap "/ip4/10.77.1.1/tcp/7371/p2p/$RELAY"
start h2 h2 "$H..$L" --no-head --reachability private \
    --bootstrap "/ip4/10.77.2.1/tcp/7371/p2p/$RELAY"
wait_for_h2
warm_up
for _ in $(seq 100); do
    [ "$(sees_h2)" = direct ] && break
    sleep 0.2
done
p2=$(phase path-open)
echo "$p2"
punched=$(cat "$work/h1.err" "$work/h2.err" | { grep -c "hole punched a direct connection" || true; })
echo "{\"phases\": [$p1, $p2], \"hole_punches\": $punched}"
python3 -c "
import json, sys
r = [json.loads(sys.argv[1]), json.loads(sys.argv[2])]
sys.exit(0 if all(p['equal_to_local'] for p in r) and r[0]['h1_to_h2'] == 'relayed' else 1)" \
    "$p1" "$p2"
