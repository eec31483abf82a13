#!/usr/bin/env bash
# A LAN of home machines on one box: one Linux network namespace per node (a coordinator `c` and
# workers w1..w3), each joined to a bridge by a veth pair whose sending side `tc tbf` caps at
# 1 Gbit/s. The kernel here has no netem, so latency and loss come from shimmer-udp-relay
# processes in the coordinator's namespace, one on each coordinator→worker path: the placement
# names the relays, which delay every datagram by DELAY_MS each way and drop LOSS of them; a
# partition is a relay that drops everything (its partition file exists) or a veth taken down.
# Everything is torn down on exit, however the script ends (trap).
#
#   scripts/lan.sh check   identical greedy tokens to the single box: over the LAN (1 ms, 0.5 %
#                          loss), with worker 1 partitioned by its relay, with worker 2's link down
#   scripts/lan.sh bench   decode tok/s and network cost per token for 1–3 workers at 0/1/5 ms
#                          one way, and 8 concurrent streams (docs/benchmarks.md)
#   scripts/lan.sh rpc     the same LAN with llama.cpp's RPC backend beside shimmer (LLAMA_BIN,
#                          GGUF): decode tok/s of three workers at 0/1/5 ms, one stream and 8,
#                          round trips per token, a worker killed mid-answer
#
# Needs root (namespaces), SHIMMER_BIN and RELAY_BIN (the shimmer and shimmer-udp-relay
# binaries), python3. MODEL (default: the bundled demo). KEEP_WORK=1 keeps the logs. Exits 77 with a message when the kernel
# refuses network namespaces.
set -euo pipefail

MODE="${1:-check}"
SHIMMER="${SHIMMER_BIN:?set SHIMMER_BIN to the shimmer binary}"
RELAY="${RELAY_BIN:?set RELAY_BIN to the shimmer-udp-relay binary}"
MODEL_ARGS=()
[ -n "${MODEL:-}" ] && MODEL_ARGS=(--model "$MODEL")
TOKEN="lan-test-cluster-join-token"
ID="shm$$"                      # namespace and interface prefix, unique per run
NET="10.199.0"
WORK="$(mktemp -d)"
PIDS=()

cleanup() {
  set +e
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$ID-"); do ip netns del "$ns"; rm -rf "/etc/netns/$ns"; done
  if [ -n "${KEEP_WORK:-}" ]; then echo "logs kept in $WORK" >&2; else rm -rf "$WORK"; fi
}
trap cleanup EXIT INT TERM

if ! ip netns add "$ID-lan" 2>/dev/null; then
  echo "SKIP: this kernel (or user) refuses network namespaces: \`ip netns add\` failed; run as root" >&2
  exit 77
fi
ip -n "$ID-lan" link set lo up
ip -n "$ID-lan" link add br0 type bridge
ip -n "$ID-lan" link set br0 up

# node NAME IP: a namespace with eth0 on the bridge, its sending capped at 1 Gbit/s.
node() {
  local ns="$ID-$1"
  ip netns add "$ns"
  ip -n "$ns" link set lo up
  ip link add "$ID$1a" type veth peer name "$ID$1b"
  ip link set "$ID$1a" netns "$ns"
  ip -n "$ns" link set "$ID$1a" name eth0
  ip link set "$ID$1b" netns "$ID-lan"
  ip -n "$ID-lan" link set "$ID$1b" master br0 up
  ip -n "$ns" addr add "$2/24" dev eth0
  ip -n "$ns" link set eth0 up
  tc -n "$ns" qdisc add dev eth0 root tbf rate 1gbit burst 256kb latency 50ms
}
node c "$NET.1"
for i in 1 2 3; do node "w$i" "$NET.1$i"; done

# wait_for FILE TEXT: until a log says TEXT (60 s).
wait_for() {
  for _ in $(seq 600); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  echo "error: timed out waiting for '$2' in $1:" >&2; cat "$1" >&2; exit 1
}

# relays DELAY_MS LOSS: one relay per worker in the coordinator's namespace, $NET.1:710i → worker i.
relays() {
  for p in "${RELAY_PIDS[@]:-}"; do [ -n "$p" ] && { kill "$p"; wait "$p"; } 2>/dev/null || true; done
  RELAY_PIDS=()
  for i in 1 2 3; do
    ip netns exec "$ID-c" "$RELAY" --listen "$NET.1:710$i" --to "$NET.1$i:7070" --delay-ms "$1" --loss "$2" --seed "$i" --partition-file "$WORK/partition-$i" 2>>"$WORK/relay-$i.log" &
    RELAY_PIDS+=($!); PIDS+=($!)
  done
  sleep 0.2
}

# workers N PLACEMENT [direct]: the first N workers, each in its namespace, serving its slice
# (named by its relay's address, or by its own with `direct`).
workers() {
  for p in "${WORKER_PIDS[@]:-}"; do [ -n "$p" ] && { kill "$p"; wait "$p"; } 2>/dev/null || true; done
  WORKER_PIDS=()
  for i in $(seq "$1"); do
    : > "$WORK/worker-$i.log"
    local name="$NET.1:710$i"
    [ "${3:-}" = direct ] && name="$NET.1$i:7070"
    ip netns exec "$ID-w$i" "$SHIMMER" worker "${MODEL_ARGS[@]}" --listen "$NET.1$i:7070" --join-token "$TOKEN" --placement "$2" --name "$name" 2>"$WORK/worker-$i.log" &
    WORKER_PIDS+=($!); PIDS+=($!)
    wait_for "$WORK/worker-$i.log" "worker serving"
  done
}

# plan N REPLICAS OUT [direct]: a placement over the first N relays (or workers, with `direct`),
# every expert REPLICAS times.
plan() {
  local addrs; addrs="$(seq -s, -f "$NET.1:710%g" 1 "$1")"
  [ "${4:-}" = direct ] && addrs="$(seq -s, -f "$NET.1%g:7070" 1 "$1")"
  "$SHIMMER" plan "${MODEL_ARGS[@]}" --workers "$addrs" --replicas "$2" --replicate-fraction 1 --out "$3" >/dev/null 2>>"$WORK/plan.log"
}

PROMPT_IDS="1,5,9,2,7,3,8"
ids() { python3 -c 'import json,sys; print(json.load(sys.stdin)["output_ids"])'; }

generate_cluster() {
  ip netns exec "$ID-c" "$SHIMMER" generate "${MODEL_ARGS[@]}" --prompt-ids "$PROMPT_IDS" --max-tokens "${1:-24}" --json \
    --placement "$WORK/p.json" --join-token "$TOKEN" --worker-timeout-s 2 --connect-timeout-s 2 2>>"$WORK/coordinator.log"
}

# eight_streams PLACEMENT TOKENS: completion tokens per second of wall time of 8 concurrent chat
# completions (TOKENS each, greedy) through a coordinator in the coordinator's namespace.
eight_streams() {
  : > "$WORK/coord.log"
  ip netns exec "$ID-c" "$SHIMMER" coordinator "${MODEL_ARGS[@]}" --host 127.0.0.1 --port 0 --placement "$1" --join-token "$TOKEN" \
    --worker-timeout-s 2 --connect-timeout-s 2 >/dev/null 2>"$WORK/coord.log" &
  local cpid=$! rc=0
  wait_for "$WORK/coord.log" "http://"
  local url; url="$(grep -o 'http://[0-9.]*:[0-9]*' "$WORK/coord.log" | head -1)"
  ip netns exec "$ID-c" python3 - "$url" "$2" <<'PY' || rc=$?
import json, sys, threading, time, urllib.request
url, tokens = sys.argv[1], int(sys.argv[2])
model = json.load(urllib.request.urlopen(url + "/v1/models"))["data"][0]["id"]
done, failed = [], []
def one(i):
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": f"Verse {i}: and the LORD said"}], "max_tokens": tokens, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"content-type": "application/json"})
    try:
        done.append(json.load(urllib.request.urlopen(req, timeout=600))["usage"]["completion_tokens"])
    except Exception as e:
        failed.append(f"stream {i}: {e}")
t0 = time.time()
ts = [threading.Thread(target=one, args=(i,)) for i in range(8)]
[t.start() for t in ts]; [t.join() for t in ts]
if failed:
    sys.exit("eight streams: " + "; ".join(failed))
print(f"{sum(done) / (time.time() - t0):.1f}")
PY
  kill "$cpid"; wait "$cpid" 2>/dev/null || true
  return "$rc"
}

if [ "$MODE" = check ]; then
  want="$("$SHIMMER" generate "${MODEL_ARGS[@]}" --prompt-ids "$PROMPT_IDS" --max-tokens 24 --json 2>>"$WORK/single.log" | ids)"
  relays 1 0.005
  plan 3 2 "$WORK/p.json"
  workers 3 "$WORK/p.json"
  got="$(generate_cluster | ids)"
  [ "$got" = "$want" ] || { echo "FAIL: over the LAN $got, single box $want" >&2; cat "$WORK"/*.log >&2; exit 1; }
  echo "ok: 3 workers in namespaces, 1 Gbit/s, 1 ms one way, 0.5 % loss: the single box's tokens"
  touch "$WORK/partition-1"
  got="$(generate_cluster | ids)"
  [ "$got" = "$want" ] || { echo "FAIL: worker 1 partitioned: $got, single box $want" >&2; exit 1; }
  echo "ok: worker 1 partitioned (its relay drops everything): the same tokens from the replicas"
  rm -f "$WORK/partition-1"
  ip -n "$ID-w2" link set eth0 down
  got="$(generate_cluster | ids)"
  [ "$got" = "$want" ] || { echo "FAIL: worker 2's link down: $got, single box $want" >&2; exit 1; }
  echo "ok: worker 2's veth down: the same tokens from the replicas"
  ip -n "$ID-w2" link set eth0 up
  # A cluster found by mDNS on the LAN: the first worker starts it, the others and a client
  # coordinator find its members as `--join mdns`, with no address and no placement file.
  workers 0 none
  for i in 1 2 3; do
    : > "$WORK/member-$i.log"
    how=(--join mdns); [ "$i" = 1 ] && how=(--bootstrap)
    ip netns exec "$ID-w$i" "$SHIMMER" worker "${MODEL_ARGS[@]}" --listen "$NET.1$i:7070" --data-dir "$WORK/member-$i" "${how[@]}" \
      --join-token "$TOKEN" --no-usage 2>"$WORK/member-$i.log" &
    PIDS+=($!)
    wait_for "$WORK/member-$i.log" "control plane on"
  done
  for _ in $(seq 300); do
    placed="$(ip netns exec "$ID-c" "$SHIMMER" cluster status --json --join mdns --join-token "$TOKEN" 2>>"$WORK/status.log" \
      | python3 -c 'import json,sys; p=json.load(sys.stdin)["placements"]; print(len(p[0]["workers"]) if p and p[0]["proposed"] is None else 0)' 2>/dev/null || echo 0)"
    [ "$placed" = 3 ] && break
    sleep 0.2
  done
  [ "$placed" = 3 ] || { echo "FAIL: the mDNS cluster never placed the model over its 3 workers" >&2; cat "$WORK"/member-*.log "$WORK/status.log" >&2; exit 1; }
  got="$(ip netns exec "$ID-c" "$SHIMMER" generate "${MODEL_ARGS[@]}" --prompt-ids "$PROMPT_IDS" --max-tokens 24 --json \
    --join mdns --join-token "$TOKEN" --worker-timeout-s 2 --connect-timeout-s 2 2>>"$WORK/coordinator.log" | ids)"
  [ "$got" = "$want" ] || { echo "FAIL: over the mDNS cluster $got, single box $want" >&2; cat "$WORK/coordinator.log" >&2; exit 1; }
  echo "ok: 3 workers joined by mDNS and placed by the cluster itself, a client found by mDNS: the single box's tokens"
  # A client that finds the members by DNS SRV records (as a Kubernetes headless service's named
  # port lists its pods), asked of a real DNS server: dnsmasq on the LAN, named in the client
  # namespace's resolv.conf (`ip netns exec` mounts /etc/netns/NS/resolv.conf over the host's).
  DNSMASQ="$(command -v dnsmasq || echo /usr/sbin/dnsmasq)"
  srv=()
  for i in 1 2 3; do srv+=(--srv-host="_control._tcp.shimmer.lan,w$i.shimmer.lan,7070,0,10" --host-record="w$i.shimmer.lan,$NET.1$i"); done
  ip netns exec "$ID-c" "$DNSMASQ" --keep-in-foreground --no-resolv --no-hosts --user=root --bind-interfaces --listen-address="$NET.1" \
    --pid-file="$WORK/dnsmasq.pid" "${srv[@]}" 2>"$WORK/dnsmasq.log" &
  PIDS+=($!)
  mkdir -p "/etc/netns/$ID-c"
  echo "nameserver $NET.1" > "/etc/netns/$ID-c/resolv.conf"
  got="$(ip netns exec "$ID-c" "$SHIMMER" generate "${MODEL_ARGS[@]}" --prompt-ids "$PROMPT_IDS" --max-tokens 24 --json \
    --join dns:_control._tcp.shimmer.lan --join-token "$TOKEN" --worker-timeout-s 2 --connect-timeout-s 2 2>>"$WORK/coordinator.log" | ids)"
  [ "$got" = "$want" ] || { echo "FAIL: found by SRV records $got, single box $want" >&2; cat "$WORK/dnsmasq.log" "$WORK/coordinator.log" >&2; exit 1; }
  echo "ok: a client found the members by DNS SRV records (dnsmasq): the single box's tokens"
  # A member cut off (its link down): the majority serves on, the minority cannot write, and
  # healed, it catches up with what was committed meanwhile.
  status_of() { # status_of NS MEMBER_ADDR: one status line as that member answers it
    ip netns exec "$ID-$1" "$SHIMMER" cluster status --json --join "$2" --join-token "$TOKEN" 2>>"$WORK/status.log"
  }
  field() { python3 -c 'import json,sys; print(json.load(sys.stdin)[sys.argv[1]])' "$1"; }
  ip -n "$ID-w3" link set eth0 down
  for _ in $(seq 100); do
    ip netns exec "$ID-w1" "$SHIMMER" cluster drain "$NET.12:7070" --join "$NET.11:7070" --join-token "$TOKEN" >/dev/null 2>>"$WORK/status.log" && break
    sleep 0.2
  done
  got="$(ip netns exec "$ID-c" "$SHIMMER" generate "${MODEL_ARGS[@]}" --prompt-ids "$PROMPT_IDS" --max-tokens 24 --json \
    --join "$NET.11:7070" --join-token "$TOKEN" --worker-timeout-s 2 --connect-timeout-s 2 2>>"$WORK/coordinator.log" | ids)"
  [ "$got" = "$want" ] || { echo "FAIL: with a member cut off $got, single box $want" >&2; exit 1; }
  if ip netns exec "$ID-w3" "$SHIMMER" cluster drain "$NET.11:7070" --join "$NET.13:7070" --join-token "$TOKEN" >/dev/null 2>"$WORK/minority.log"; then
    echo "FAIL: the cut-off member committed a write" >&2; exit 1
  fi
  majority_commit="$(status_of w1 "$NET.11:7070" | field commit)"
  ip -n "$ID-w3" link set eth0 up
  for _ in $(seq 150); do
    healed="$(status_of w3 "$NET.13:7070" | field applied 2>/dev/null || echo 0)"
    [ "$healed" -ge "$majority_commit" ] 2>/dev/null && break
    sleep 0.2
  done
  [ "$healed" -ge "$majority_commit" ] || { echo "FAIL: healed, the member applied $healed of $majority_commit" >&2; cat "$WORK/minority.log" >&2; exit 1; }
  echo "ok: a member cut off: the majority wrote and served the single box's tokens, the minority refused ($(tr -d '\n' < "$WORK/minority.log" | cut -c1-80)), healed it caught up to $majority_commit"
  exit 0
fi

if [ "$MODE" = bench ]; then
  TOKENS="${TOKENS:-64}"
  moe_layers="$("$SHIMMER" plan "${MODEL_ARGS[@]}" --workers 127.0.0.1:1 --out "$WORK/probe.json" --json 2>>"$WORK/plan.log" | python3 -c 'import json,sys; print(len(json.load(open(sys.argv[1]))["layers"]))' "$WORK/probe.json")"
  single="$("$SHIMMER" generate "${MODEL_ARGS[@]}" --prompt-ids "$PROMPT_IDS" --max-tokens "$TOKENS" --json 2>>"$WORK/single.log")"
  single_tok_s="$(echo "$single" | python3 -c 'import json,sys; print(json.load(sys.stdin)["timings"]["decode_tok_s"])')"
  echo "single box: $single_tok_s tok/s decode; $moe_layers MoE layers"
  echo "| workers | one-way delay | decode tok/s | network wait / step | floor (MoE layers × RTT) | wait ÷ floor | round trips / step | bytes / token | 8 streams, tok/s |"
  echo "|---|---|---|---|---|---|---|---|---|"
  for delay in direct 0 1 5; do
    [ "$delay" = direct ] || relays "$delay" 0
    for n in 1 2 3; do
      plan "$n" 1 "$WORK/p.json" "$delay"
      workers "$n" "$WORK/p.json" "$delay"
      out="$(generate_cluster "$TOKENS")"
      agg="$(eight_streams "$WORK/p.json" "$TOKENS")"
      echo "$out" | python3 -c '
import json, sys
o = json.load(sys.stdin); t = o["timings"]; c = t["cluster"]
n, moe, agg = int(sys.argv[1]), int(sys.argv[3]), sys.argv[4]
direct = sys.argv[2] == "direct"
delay = 0.0 if direct else float(sys.argv[2])
tok = max(1, c["tokens"])
steps = t["decode_tokens"] + 1  # forward passes: the prompt in one, then one per decoded token
wait_ms = 1e3 * c["network_wait_s"] / steps
floor_ms = moe * 2 * delay
ratio = f"{wait_ms / floor_ms:.2f}" if floor_ms else "–"
b = sum(w["bytes_sent"] + w["bytes_received"] for w in c["workers"]) / tok
tok_s, trips = t["decode_tok_s"], c["round_trips"] / steps
where = "none (no relay)" if direct else f"{delay:g} ms"
print(f"| {n} | {where} | {tok_s:.1f} | {wait_ms:.2f} ms | {floor_ms:.0f} ms | {ratio} | {trips:.1f} | {b / 1e3:.1f} KB | {agg} |")
' "$n" "$delay" "$moe_layers" "$agg"
    done
  done
  exit 0
fi

if [ "$MODE" = rpc ]; then
  # shimmer's expert sharding against llama.cpp's RPC backend (its layer split) on the same LAN:
  # three workers, decode tok/s of one stream and of eight at each one-way delay, round trips per
  # token, and what each does when a worker is killed mid-answer. llama.cpp's `ggml-rpc-server`
  # runs in each worker namespace; its TCP paths get the same delay from `shimmer-udp-relay
  # --tcp` in the coordinator's namespace, which also counts their round trips. Needs LLAMA_BIN
  # (llama.cpp's build/bin with ggml-rpc-server, llama-bench and llama-batched-bench, built with
  # -DGGML_RPC=ON: bench/vs-llama-cpp/build-rpc.sh) and GGUF (the same model).
  LLAMA="${LLAMA_BIN:?set LLAMA_BIN to the build/bin of llama.cpp built with GGML_RPC=ON}"
  GGUF="${GGUF:?set GGUF to the model as GGUF}"
  TOKENS="${TOKENS:-64}"
  llama() { ip netns exec "$ID-c" env LD_LIBRARY_PATH="$LLAMA" "$LLAMA/$1" -m "$GGUF" "${@:2}"; }
  rpc_server() { # rpc_server I: worker I's ggml-rpc-server, its pid in RPC_PID[I]
    ip netns exec "$ID-w$1" env LD_LIBRARY_PATH="$LLAMA" "$LLAMA/ggml-rpc-server" -H "$NET.1$1" -p 50052 -t 1 >>"$WORK/rpc-$1.log" 2>&1 &
    RPC_PID[$1]=$!; PIDS+=($!)
  }
  trips() { cat "$WORK"/trips-* 2>/dev/null | awk '{ s += $1 } END { print s + 0 }'; }
  declare -A RPC_PID
  for i in 1 2 3; do rpc_server "$i"; done
  sleep 0.5
  echo "| one-way delay | shimmer decode tok/s (3 workers, experts sharded) | round trips / token | llama.cpp RPC decode tok/s (3 rpc-servers, layer split) | round trips / token | shimmer ÷ llama.cpp | 8 streams: shimmer tok/s | 8 streams: llama.cpp tok/s | shimmer ÷ llama.cpp |"
  echo "|---|---|---|---|---|---|---|---|---|"
  for delay in direct 0 1 5; do
    tcp=()
    rpc="$(seq -s, -f "$NET.1%g:50052" 1 3)"
    if [ "$delay" != direct ]; then
      relays "$delay" 0
      rm -f "$WORK"/trips-*
      for i in 1 2 3; do
        ip netns exec "$ID-c" "$RELAY" --tcp --listen "$NET.1:720$i" --to "$NET.1$i:50052" --delay-ms "$delay" --count-file "$WORK/trips-$i" 2>>"$WORK/tcp-relay-$i.log" &
        tcp+=($!); PIDS+=($!)
      done
      rpc="$(seq -s, -f "$NET.1:720%g" 1 3)"
      sleep 0.2
    fi
    mode=""; [ "$delay" = direct ] && mode=direct
    plan 3 1 "$WORK/p.json" "$mode"
    workers 3 "$WORK/p.json" "$mode"
    shimmer_out="$(generate_cluster "$TOKENS")"
    shimmer_eight="$(eight_streams "$WORK/p.json" "$TOKENS")"
    llama_out="$(llama llama-bench --rpc "$rpc" -ngl 99 -p 0 -n "$TOKENS" -t 2 -r 3 -o json 2>>"$WORK/llama-bench.log")"
    # llama.cpp's round trips per token: the relays' count over two runs that differ only in the
    # tokens generated, so loading the model and warming up cancel out.
    llama_trips=nan
    if [ "$delay" != direct ]; then
      sleep 0.3; t0="$(trips)"
      llama llama-bench --rpc "$rpc" -ngl 99 -p 0 -n 16 -t 2 -r 1 -o json >/dev/null 2>>"$WORK/llama-bench.log"; sleep 0.3; t1="$(trips)"
      llama llama-bench --rpc "$rpc" -ngl 99 -p 0 -n 48 -t 2 -r 1 -o json >/dev/null 2>>"$WORK/llama-bench.log"; sleep 0.3; t2="$(trips)"
      llama_trips="$(( (t2 - t1) - (t1 - t0) ))"
    fi
    # Eight sequences decoding together (16-token prompts), the same count of completion tokens
    # per wall second as shimmer's eight streams.
    llama_eight="$(llama llama-batched-bench --rpc "$rpc" -ngl 99 -npp 16 -ntg "$TOKENS" -npl 8 -c 4096 -t 2 --output-format jsonl 2>>"$WORK/llama-batched.log" | grep '^{' | tail -1)"
    for p in "${tcp[@]}"; do kill "$p"; wait "$p" 2>/dev/null || true; done
    python3 -c '
import json, sys
s, l, delay, s8, l8, ltrips = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3], float(sys.argv[4]), json.loads(sys.argv[5]), sys.argv[6]
t = s["timings"]; c = t["cluster"]
ours, theirs = t["decode_tok_s"], l[0]["avg_ts"]
trips = c["round_trips"] / max(1, c["tokens"])
their_trips = "–" if ltrips == "nan" else f"{float(ltrips) / 32:.1f}"
their8 = l8["pl"] * l8["tg"] / l8["t"]
where = "none (no relay)" if delay == "direct" else f"{delay} ms"
print(f"| {where} | {ours:.1f} | {trips:.1f} | {theirs:.1f} | {their_trips} | {ours / theirs:.2f} | {s8:.1f} | {their8:.1f} | {s8 / their8:.2f} |")
' "$shimmer_out" "$llama_out" "$delay" "$shimmer_eight" "$llama_eight" "$llama_trips"
  done
  # A worker killed mid-answer, at 1 ms one way. shimmer: every expert on two of the three
  # workers (R=2); the answer must be the single box's. llama.cpp: its layer split holds each
  # layer once; what it does is reported as it happens.
  echo
  echo "A worker killed (kill -9) mid-answer, 1 ms one way, up to $(( TOKENS * 4 )) tokens:"
  relays 1 0
  for i in 1 2 3; do
    ip netns exec "$ID-c" "$RELAY" --tcp --listen "$NET.1:720$i" --to "$NET.1$i:50052" --delay-ms 1 2>>"$WORK/tcp-relay-$i.log" &
    PIDS+=($!)
  done
  sleep 0.2
  want="$("$SHIMMER" generate "${MODEL_ARGS[@]}" --prompt-ids "$PROMPT_IDS" --max-tokens "$(( TOKENS * 4 ))" --json 2>>"$WORK/single.log" | ids)"
  plan 3 2 "$WORK/p.json"
  workers 3 "$WORK/p.json"
  generate_cluster "$(( TOKENS * 4 ))" >"$WORK/killed.json" &
  gen=$!
  sleep 0.8
  kill -9 "${WORKER_PIDS[1]}"; wait "${WORKER_PIDS[1]}" 2>/dev/null || true
  if wait "$gen" && [ "$(ids < "$WORK/killed.json")" = "$want" ]; then
    python3 -c '
import json, sys
o = json.load(open(sys.argv[1]))
n, failovers = len(o["output_ids"]), o["timings"]["cluster"]["failovers"]
print(f"- shimmer (R=2): worker 2 killed 0.8 s in; the answer completed, all {n} tokens identical to the single box ({failovers} requests answered by the other holder)")
' "$WORK/killed.json"
  else
    echo "- shimmer (R=2): worker 2 killed 0.8 s in; FAILED: $(tail -c 300 "$WORK/coordinator.log")"
  fi
  timeout 60 ip netns exec "$ID-c" env LD_LIBRARY_PATH="$LLAMA" "$LLAMA/llama-bench" -m "$GGUF" --rpc "$(seq -s, -f "$NET.1:720%g" 1 3)" \
    -ngl 99 -p 0 -n "$(( TOKENS * 16 ))" -t 2 -r 1 -o json >"$WORK/llama-killed.json" 2>"$WORK/llama-killed.log" &
  gen=$!
  sleep 1.5
  kill -9 "${RPC_PID[2]}"; wait "${RPC_PID[2]}" 2>/dev/null || true
  rc=0; wait "$gen" 2>/dev/null || rc=$?
  said="$(grep -m1 -i 'rpc' "$WORK/llama-killed.log" | sed 's|^.*/ggml-rpc/||' | cut -c1-160)"
  if [ "$rc" = 0 ]; then
    echo "- llama.cpp RPC (layer split): rpc-server 2 killed 1.5 s in; llama-bench completed (exit 0)"
  elif [ "$rc" = 124 ]; then
    echo "- llama.cpp RPC (layer split): rpc-server 2 killed 1.5 s in; llama-bench hung, stopped by a 60 s timeout: $said"
  else
    echo "- llama.cpp RPC (layer split): rpc-server 2 killed 1.5 s in; llama-bench ended with exit $rc: $said"
  fi
  exit 0
fi

echo "usage: scripts/lan.sh check|bench|rpc" >&2
exit 2
