#!/usr/bin/env bash
# Leader election after kill -9: three `shimmer worker` members on 127.0.0.2-4 (the demo model),
# then ROUNDS times: kill -9 the leader, time until `shimmer cluster status` from a survivor names
# a new leader, restart the killed node on its --data-dir and wait until all three are up again.
# Prints each round's seconds, then the median and the maximum. Usage:
#   bench/control-plane/election.sh [ROUNDS]   (default 20; SHIMMER_BIN=… to pick the binary)
set -euo pipefail
rounds="${1:-20}"
bin="${SHIMMER_BIN:-$(dirname "$0")/../../target/release/shimmer}"
work="$(mktemp -d)"
export SHIMMER_JOIN_TOKEN="election-bench-cluster-token"
pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT
addr() { echo "127.0.0.$(( $1 + 2 )):7411"; }
start() { # start I [flags…]
  local i="$1"; shift
  "$bin" worker --listen "$(addr "$i")" --data-dir "$work/d$i" --no-usage "$@" 2>"$work/w$i.log" &
  pids[$i]=$!
  until grep -q "control plane on" "$work/w$i.log"; do sleep 0.05; done
}
all="$(addr 0),$(addr 1),$(addr 2)"
status() { "$bin" cluster status --json --join "$1" 2>/dev/null || true; }
start 0 --bootstrap
start 1 --join "$(addr 0)"
start 2 --join "$(addr 0)"
until [ "$(status "$all" | grep -o '"role":"voter","up":true' | wc -l)" = 3 ]; do sleep 0.1; done
times=()
for r in $(seq 1 "$rounds"); do
  leader="$(status "$all" | sed -n 's/.*"leader":"\([^"]*\)".*/\1/p')"
  survivors=""
  for i in 0 1 2; do
    if [ "$(addr "$i")" = "$leader" ]; then k=$i; else survivors+="$(addr "$i"),"; fi
  done
  t0=$(date +%s.%N)
  kill -9 "${pids[$k]}"; wait "${pids[$k]}" 2>/dev/null || true
  until s="$(status "${survivors%,}")"; [[ "$s" == *'"leader":"'* && "$s" != *"\"leader\":\"$leader\""* ]]; do sleep 0.02; done
  t=$(echo "$(date +%s.%N) - $t0" | bc)
  times+=("$t"); echo "round $r: killed $leader, new leader after $t s"
  start "$k"
  until [ "$(status "$all" | grep -o '"role":"voter","up":true' | wc -l)" = 3 ]; do sleep 0.1; done
done
printf '%s\n' "${times[@]}" | sort -n | awk '{a[NR]=$1} END {printf "median %.2f s, max %.2f s over %d kills\n", (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2), a[NR], NR}'
