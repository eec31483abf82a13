#!/usr/bin/env bash
# llama.cpp's RPC backend for `scripts/lan.sh rpc` (docs/benchmarks.md): builds ggml-rpc-server,
# llama-bench and llama-batched-bench with -DGGML_RPC=ON into $LLAMA/build-rpc, converts the demo
# model to bf16 GGUF with llama.cpp's converter, builds shimmer and the relay (release), and
# prints the command that runs the comparison (as root: it makes network namespaces).
#
#   bench/vs-llama-cpp/build-rpc.sh          # WORK=~/.cache/shimmer-vs-llama-cpp
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
WORK="${WORK:-$HOME/.cache/shimmer-vs-llama-cpp}"
. "$HERE/llama-cpp.sh"
llama_cpp_tools
llama_cpp_build build-rpc -DGGML_RPC=ON -DLLAMA_BUILD_SERVER=OFF -- ggml-rpc-server llama-bench llama-batched-bench
if [ ! -f "$WORK/demo.bf16.gguf" ]; then
  say "demo → GGUF (llama.cpp's converter)"
  "$PY" "$HERE/convert_with_known_pretokenizer.py" "$LLAMA" "$ROOT/models/demo" --outtype bf16 --outfile "$WORK/demo.bf16.gguf" 2>/dev/null
fi
say "building shimmer and shimmer-udp-relay (release)"
(cd "$ROOT" && cargo build --release --locked -q -p shimmer-coordinator --bin shimmer -p shimmer-tests --bin shimmer-udp-relay)
target="${CARGO_TARGET_DIR:-$ROOT/target}/release"
echo "SHIMMER_BIN=$target/shimmer RELAY_BIN=$target/shimmer-udp-relay LLAMA_BIN=$LLAMA/build-rpc/bin GGUF=$WORK/demo.bf16.gguf TOKENS=64 scripts/lan.sh rpc"
