# llama.cpp as the benchmarks build it, sourced by run.sh and build-rpc.sh (set ROOT and WORK
# first). Nothing here is committed from llama.cpp: its tree comes from the PyPI source package
# of llama-cpp-python (pinned), which carries the whole of it.
#
#   llama_cpp_tools                          cmake, a compiler, the pinned venv ($PY), the tree ($LLAMA)
#   llama_cpp_build DIR [CMAKE_FLAG...] -- TARGET...
#                                            builds TARGETs into $LLAMA/DIR/bin unless all are there
LLAMA_CPP_PYTHON=0.3.36
mkdir -p "$WORK"
say() { echo "== $*" >&2; }

llama_cpp_tools() {
  if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null; then
    say "installing cmake and a C++ compiler"
    local sudo=""; [ "$(id -u)" -ne 0 ] && sudo=sudo
    $sudo apt-get update -q && $sudo apt-get install -y -q cmake build-essential python3-venv
  fi
  if [ ! -x "$WORK/venv/bin/python" ]; then
    say "Python environment (pinned: tests/oracle/requirements.txt + PyYAML)"
    python3 -m venv "$WORK/venv"
    "$WORK/venv/bin/pip" install -q -r "$ROOT/tests/oracle/requirements.txt" pyyaml==6.0.4
  fi
  PY="$WORK/venv/bin/python"
  LLAMA="$WORK/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp"
  if [ ! -d "$LLAMA" ]; then
    say "fetching llama-cpp-python $LLAMA_CPP_PYTHON (source)"
    "$WORK/venv/bin/pip" download -q --no-deps --no-binary=llama-cpp-python "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$WORK/sdist"
    tar xzf "$WORK/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$WORK"
  fi
  "$WORK/venv/bin/pip" install -q "$LLAMA/gguf-py"
}

llama_cpp_build() {
  local dir="$1"; shift
  local flags=() targets=() missing=0
  while [ $# -gt 0 ] && [ "$1" != -- ]; do flags+=("$1"); shift; done
  shift
  targets=("$@")
  for t in "${targets[@]}"; do [ -x "$LLAMA/$dir/bin/$t" ] || missing=1; done
  [ "$missing" = 0 ] && return 0
  say "building llama.cpp into $dir: ${targets[*]} (CPU, Release; ~5-10 minutes)"
  # Every x86 SIMD level the CPU has, but no AMX: on these virtual machines ggml's AMX path
  # (which -march=native would enable) crashes in ggml_backend_amx_mul_mat.
  local isa=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
  local cpu; cpu=$(grep -m1 '^flags' /proc/cpuinfo || true)
  has() { [[ " $cpu " == *" $1 "* ]]; }
  has avx && isa+=(-DGGML_AVX=ON)
  has avx2 && isa+=(-DGGML_AVX2=ON)
  has fma && isa+=(-DGGML_FMA=ON)
  has f16c && isa+=(-DGGML_F16C=ON)
  has avx_vnni && isa+=(-DGGML_AVX_VNNI=ON)
  has avx512f && isa+=(-DGGML_AVX512=ON)
  has avx512vbmi && isa+=(-DGGML_AVX512_VBMI=ON)
  has avx512_vnni && isa+=(-DGGML_AVX512_VNNI=ON)
  has avx512_bf16 && isa+=(-DGGML_AVX512_BF16=ON)
  cmake -S "$LLAMA" -B "$LLAMA/$dir" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    "${isa[@]}" "${flags[@]}" >/dev/null
  cmake --build "$LLAMA/$dir" -j"$(nproc)" --target "${targets[@]}" >/dev/null
}
