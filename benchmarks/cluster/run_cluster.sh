#!/usr/bin/env bash
# Emulated multi-node cluster on one machine: one network namespace per node, a bandwidth-limited link
# between nodes (tc tbf; netem is not available), loopback inside a node. Launches one
#   deepspeed --hostfile H --no_ssh --node_rank i --master_addr <node 0> ...
# per namespace, the way a real multi-node job without ssh is started, collects the logs and tears
# everything down on exit (also on failure or Ctrl-C).
#
#   sudo benchmarks/cluster/run_cluster.sh [options] [-- train args...]
#
# Options (defaults in brackets):
#   --nodes N            nodes = namespaces [2]; 2 nodes are joined by a veth pair, more by a bridge
#   --ranks-per-node G   ranks per node [2]
#   --rate R             inter-node bandwidth per direction, tc syntax (100mbit, 1gbit, ...), or `loopback`
#                        (no limit: the veth link at full speed) [1gbit]
#   --out DIR            logs and metrics [runs/cluster-<time>]
#   --script PATH        training script [examples/train_moe.py]
#   --timeout S          kill the job after S seconds [900]
# Everything after `--` goes to the training script; by default
#   --deepspeed_config ds_config_templates/cpu_2nodes_x_2ranks.json --moe-impl deepspeed --steps 30
# and --metrics-out DIR/metrics.json is appended unless given.
#
# Needs root (CAP_NET_ADMIN) and iproute2 (installed with apt-get when `ip`/`tc` are missing).
# Addresses: 10.77.0.<node+1>/24, only inside the namespaces this script creates.
set -euo pipefail

NODES=2
RPN=2
RATE=1gbit
OUT=""
SCRIPT=examples/train_moe.py
TIMEOUT=900
TRAIN_ARGS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --nodes) NODES=$2; shift 2 ;;
        --ranks-per-node) RPN=$2; shift 2 ;;
        --rate) RATE=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --script) SCRIPT=$2; shift 2 ;;
        --timeout) TIMEOUT=$2; shift 2 ;;
        --) shift; TRAIN_ARGS=("$@"); break ;;
        -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
        *) echo "run_cluster.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO"
[[ $NODES -ge 2 ]] || { echo "--nodes must be >= 2 (got $NODES)" >&2; exit 2; }
[[ $NODES -le 200 ]] || { echo "--nodes must be <= 200 (got $NODES)" >&2; exit 2; }
[[ $(id -u) -eq 0 ]] || { echo "run_cluster.sh needs root (network namespaces, tc)" >&2; exit 1; }
if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
    echo "[cluster] installing iproute2"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null
fi
PY=${PYTHON:-$(command -v python3 || command -v python)}
DEEPSPEED=$(command -v deepspeed || true)
[[ -n "$DEEPSPEED" ]] || { echo "deepspeed launcher not found (bash scripts/setup.sh)" >&2; exit 1; }

if [[ ${#TRAIN_ARGS[@]} -eq 0 ]]; then
    TRAIN_ARGS=(--deepspeed_config ds_config_templates/cpu_2nodes_x_2ranks.json --moe-impl deepspeed --steps 30)
fi
OUT=${OUT:-runs/cluster-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [[ " ${TRAIN_ARGS[*]} " != *" --metrics-out "* ]]; then
    TRAIN_ARGS+=(--metrics-out "$OUT/metrics.json")
fi

TAG="cb$$"                  # unique per run: namespaces cb<pid>n<i>, interfaces cb<pid>a<i>/b<i>
SW="${TAG}sw"               # switch namespace holding the bridge (N > 2)
SUBNET=10.77.0
MASTER_ADDR=$SUBNET.1
MASTER_PORT=$((29500 + $$ % 1000))
HOSTFILE=$OUT/hostfile
PIDS=()
NSES=()

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    for pid in "${PIDS[@]}"; do  # each launcher runs in its own session: kill its process group
        kill -TERM -- "-$pid" 2>/dev/null || true
    done
    sleep 1
    for pid in "${PIDS[@]}"; do
        kill -KILL -- "-$pid" 2>/dev/null || true
    done
    for ns in "${NSES[@]}"; do  # deleting a namespace also deletes the veth ends inside it
        ip netns pids "$ns" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || true
    done
    echo "[cluster] torn down ${#NSES[@]} namespaces (exit $rc); logs in $OUT"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

ns_of() { echo "${TAG}n$1"; }
dev_of() { echo "${TAG}a$1"; }   # node side of node i's link
peer_of() { echo "${TAG}b$1"; }  # bridge side (N > 2)

limit() {  # limit egress of device $2 in namespace $1
    [[ $RATE == loopback ]] && return 0  # no limit
    # burst must cover at least one timer tick at the rate; 512 KiB is plenty up to a few Gbit/s
    tc -n "$1" qdisc add dev "$2" root tbf rate "$RATE" burst 512kb latency 100ms
}

echo "[cluster] $NODES nodes x $RPN ranks, inter-node rate $RATE, out $OUT"
for ((i = 0; i < NODES; i++)); do
    ns=$(ns_of "$i")
    ip netns add "$ns"
    NSES+=("$ns")
    ip -n "$ns" link set lo up
done

if [[ $NODES -eq 2 ]]; then
    ip link add "$(dev_of 0)" type veth peer name "$(dev_of 1)"
    for i in 0 1; do
        ip link set "$(dev_of "$i")" netns "$(ns_of "$i")"
    done
else
    ip netns add "$SW"
    NSES+=("$SW")
    ip -n "$SW" link add br0 type bridge
    ip -n "$SW" link set br0 up
    for ((i = 0; i < NODES; i++)); do
        ip link add "$(dev_of "$i")" type veth peer name "$(peer_of "$i")"
        ip link set "$(dev_of "$i")" netns "$(ns_of "$i")"
        ip link set "$(peer_of "$i")" netns "$SW"
        ip -n "$SW" link set "$(peer_of "$i")" master br0
        ip -n "$SW" link set "$(peer_of "$i")" up
        limit "$SW" "$(peer_of "$i")"  # download direction of node i
    done
fi
for ((i = 0; i < NODES; i++)); do
    ns=$(ns_of "$i")
    ip -n "$ns" addr add "$SUBNET.$((i + 1))/24" dev "$(dev_of "$i")"
    ip -n "$ns" link set "$(dev_of "$i")" up
    limit "$ns" "$(dev_of "$i")"  # upload direction of node i
done

: >"$HOSTFILE"
for ((i = 0; i < NODES; i++)); do
    echo "node$i slots=$RPN" >>"$HOSTFILE"
done

echo "[cluster] job: $SCRIPT ${TRAIN_ARGS[*]}"
START=$(date +%s)
for ((i = 0; i < NODES; i++)); do
    ns=$(ns_of "$i")
    # gloo picks its address from this interface; traffic to a node's own address stays on loopback.
    # This checkout is importable even where the installed ds_cobalt points elsewhere (a PYTHONPATH given, such
    # as e2e_cluster.py's --repo, comes first)
    setsid ip netns exec "$ns" env \
        GLOO_SOCKET_IFNAME="$(dev_of "$i")" OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 \
        PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$REPO" \
        "$DEEPSPEED" --hostfile "$HOSTFILE" --no_ssh --node_rank "$i" \
        --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
        "$SCRIPT" "${TRAIN_ARGS[@]}" </dev/null >"$OUT/node$i.log" 2>&1 &
    PIDS+=("$!")
done

# wait for all nodes; the first failure (or the timeout) ends the job
rc=0
while :; do
    running=0
    for idx in "${!PIDS[@]}"; do
        pid=${PIDS[$idx]}
        [[ -z "$pid" ]] && continue
        if kill -0 "$pid" 2>/dev/null; then
            running=1
        else
            wait "$pid" || { rc=$?; echo "[cluster] node $idx exited with $rc" >&2; }
            PIDS[idx]=""
        fi
    done
    [[ $running -eq 0 || $rc -ne 0 ]] && break
    if (($(date +%s) - START > TIMEOUT)); then
        echo "[cluster] timeout after ${TIMEOUT}s" >&2
        rc=124
        break
    fi
    sleep 1
done
ELAPSED=$(($(date +%s) - START))

for ((i = 0; i < NODES; i++)); do
    echo "----- node $i (tail of $OUT/node$i.log)"
    grep -v -e '\[launch.py' -e 'real_accelerator' "$OUT/node$i.log" | tail -n 12 || true
done
# bytes each node put on its inter-node link (tbf counters: everything that left the node, all traffic)
LINKS="{\"nodes\": $NODES, \"ranks_per_node\": $RPN, \"rate\": \"$RATE\", \"wall_s\": $ELAPSED, \"rc\": $rc, \"sent_bytes\": ["
for ((i = 0; i < NODES; i++)); do
    sent=$(tc -n "$(ns_of "$i")" -s qdisc show dev "$(dev_of "$i")" | sed -n 's/.*Sent \([0-9]*\) bytes.*/\1/p' | head -n 1)
    echo "[cluster] node $i sent ${sent:-?} bytes over its inter-node link"
    if [[ $i -gt 0 ]]; then LINKS+=", "; fi
    LINKS+="${sent:-null}"
done
echo "$LINKS]}" >"$OUT/links.json"
echo "[cluster] job finished in ${ELAPSED}s with exit code $rc"
exit "$rc"
