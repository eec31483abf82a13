#!/usr/bin/env bash
# Placement through Raft, timed: three `shimmer worker` members on 127.0.0.2-4 (the demo model),
# then ROUNDS times: a fourth worker starts on its --data-dir and joins; we time, from the moment
# its control plane is up, until the leader has proposed an epoch that includes it (commit) and
# until that epoch is active (every holder read its share and said ready), and count the experts
# it read from its disk to take its share (bytes moved = experts read × bytes per expert); then
# SIGTERM drains it and we time until it exits (its experts placed elsewhere first).
# Status is polled with `shimmer cluster status` (a process and a TLS handshake per poll: the
# figures are upper bounds at that resolution, ~0.1 s). The workers serve the demo converted to a
# container (the store reads its blobs with O_DIRECT); the baseline, measured in the same round, is
# `dd iflag=direct` reading the same number of bytes from that container's experts file — the
# disk's floor for moving the share. Usage:
#   bench/control-plane/placement.sh [ROUNDS]   (default 5; SHIMMER_BIN=… to pick the binary)
set -euo pipefail
rounds="${1:-5}"
bin="${SHIMMER_BIN:-$(dirname "$0")/../../target/release/shimmer}"
work="$(mktemp -d)"
export SHIMMER_JOIN_TOKEN="placement-bench-cluster-token"
pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT
addr() { echo "127.0.0.$(( $1 + 2 )):7421"; }
start() { # start I [flags…]
  local i="$1"; shift
  : > "$work/w$i.log"
  "$bin" worker --model "$work/model" --listen "$(addr "$i")" --data-dir "$work/d$i" --no-usage --no-mdns "$@" 2>"$work/w$i.log" &
  pids[$i]=$!
  until grep -q "health, readiness and metrics on" "$work/w$i.log"; do sleep 0.02; done
}
all="$(addr 0),$(addr 1),$(addr 2)"
placed() { # placed WORKERS: "committed" / "active" per the status, for a placement naming WORKERS
  "$bin" cluster status --json --join "$all" 2>/dev/null | python3 -c '
import json, sys
want = int(sys.argv[1])
try:
    p = json.load(sys.stdin)["placements"][0]
except Exception:
    print("none"); sys.exit()
if p["proposed"] is None and len(p["workers"]) == want: print("active")
elif p["proposed"] is not None: print("proposed")
else: print("none")' "$1"
}
now() { date +%s.%N; }
"$bin" convert --from "$(dirname "$0")/../../models/demo" --to "$work/model" --quiet
start 0 --bootstrap
start 1 --join "$(addr 0)"
start 2 --join "$(addr 0)"
until [ "$(placed 3)" = active ]; do sleep 0.1; done
expert_mb="$(sed -n 's/.*experts of \([0-9.]*\) MB.*/\1/p' "$work/w0.log" | head -1)"
echo "3 workers placed; one expert is $expert_mb MB"
commits=(); actives=(); drains=(); reads=(); floors=()
blob_bytes="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["blob_bytes"])' "$work/model/shimmer-manifest.json")"
floor() { # floor N: seconds for dd to read N blobs' bytes from the experts file with O_DIRECT
  local s; s=$(now)
  dd if="$work/model/experts.safetensors" of=/dev/null bs="$blob_bytes" count="$1" iflag=direct status=none
  echo "$(now) - $s" | bc
}
for r in $(seq 1 "$rounds"); do
  extra=(--join "$(addr 0)"); [ -d "$work/d3" ] && extra=()
  start 3 "${extra[@]}"
  t0=$(now); committed=""
  while true; do
    s="$(placed 4)"
    [ -z "$committed" ] && [ "$s" != none ] && committed=$(echo "$(now) - $t0" | bc)
    [ "$s" = active ] && break
    sleep 0.02
  done
  active=$(echo "$(now) - $t0" | bc)
  http="$(sed -n 's/.*metrics on http:\/\/\(.*\)/\1/p' "$work/w3.log" | head -1)"
  n="$(python3 -c 'import sys,urllib.request; t=urllib.request.urlopen("http://"+sys.argv[1]+"/metrics").read().decode(); print(int(float(next(l.split()[1] for l in t.splitlines() if l.startswith("shimmer_worker_disk_reads_total ")))))' "$http")"
  t1=$(now)
  kill -TERM "${pids[3]}"; wait "${pids[3]}" 2>/dev/null || true
  drained=$(echo "$(now) - $t1" | bc)
  until [ "$(placed 3)" = active ]; do sleep 0.1; done
  f="$(floor "$n")"
  commits+=("$committed"); actives+=("$active"); drains+=("$drained"); reads+=("$n"); floors+=("$f")
  echo "round $r: proposed after $committed s, active after $active s, $n experts read ($(echo "$n * $blob_bytes" | bc) bytes; dd O_DIRECT of the same bytes $f s), drained in $drained s"
done
median() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {printf "%.3f", (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
echo "median over $rounds joins: proposed $(median "${commits[@]}") s, active $(median "${actives[@]}") s, experts read $(median "${reads[@]}"), dd O_DIRECT of those bytes $(median "${floors[@]}") s, drain $(median "${drains[@]}") s"
