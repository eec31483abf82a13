#!/usr/bin/env bash
# shimmer against llama.cpp on the same weights, side by side in one run (bench/vs-llama-cpp/README.md).
#
#   bench/vs-llama-cpp/run.sh            # THREADS=2 RUNS=5 PROMPT=64 GEN=32 REPS=1 WORK=~/.cache/shimmer-vs-llama-cpp
#
# Builds llama.cpp's converter, quantiser and llama-bench from the llama.cpp tree inside the PyPI
# source package of llama-cpp-python (pinned), makes a ~1.6B-parameter random Qwen3-MoE model with a
# tokenizer the converter knows, converts it (and the demo model) to GGUF Q8_0 / Q4_0 with
# llama.cpp's tools and to shimmer containers int8 / int4-g32 (dense int8) and int4-g32 with dense
# int4-g32 (Q4_0's 4.5 bits a weight; embedding and head int8; against Q4_0 too) and int4-g128
# experts with int6-g32 dense weights and head (int4-g128+int6-g32+int6-g32: Q4_0's bytes a token,
# of better quality than Q4_0 on the demo), then alternates the
# two engines RUNS times per format on the same prompt length and thread count and prints the
# shimmer ÷ llama.cpp ratios for prefill and decode (min / median / max), and for the aggregate
# decode of PARALLEL sequences at once (llama-batched-bench -npl against shimmer bench --parallel).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
WORK="${WORK:-$HOME/.cache/shimmer-vs-llama-cpp}"
THREADS="${THREADS:-2}"
RUNS="${RUNS:-5}"
PROMPT="${PROMPT:-64}"
GEN="${GEN:-32}"
PARALLEL="${PARALLEL:-16}"
# Timed repetitions inside each engine's run (llama-bench -r, shimmer bench --repetitions); each
# side's speed is the median of its repetitions.
REPS="${REPS:-1}"
# 1-2. Tools (cmake, a compiler, a pinned Python environment) and llama.cpp (llama-cpp.sh).
. "$HERE/llama-cpp.sh"
llama_cpp_tools
llama_cpp_build build -DLLAMA_BUILD_SERVER=OFF -- llama-bench llama-quantize llama-batched-bench
BIN="$LLAMA/build/bin"

# 3. shimmer.
say "building shimmer (release)"
(cd "$ROOT" && cargo build --release --locked -q)
SHIMMER="${CARGO_TARGET_DIR:-$ROOT/target}/release/shimmer"

# 4. Models: a random Qwen3-MoE of ~1.6B parameters (GPT-2's tokenizer, rebuilt from llama.cpp's
#    own vocabulary file), and the demo model.
if [ ! -f "$WORK/gpt2tok/tokenizer.json" ]; then
  "$PY" "$HERE/tokenizer_from_gguf.py" "$LLAMA/models/ggml-vocab-gpt-2.gguf" "$WORK/gpt2tok"
fi
if [ ! -f "$WORK/m1b/model.safetensors.index.json" ]; then
  say "random Qwen3-MoE: hidden 1024, 16 layers, 64 experts of 512, top-8"
  "$PY" "$ROOT/bench/make_random_moe.py" --out "$WORK/m1b" --layers 16 --hidden 1024 --heads 16 --kv-heads 4 \
    --head-dim 64 --experts 64 --expert-intermediate 512 --top-k 8 --tokenizer-dir "$WORK/gpt2tok"
fi
for model in m1b demo; do
  src="$WORK/$model"; [ "$model" = demo ] && src="$ROOT/models/demo"
  if [ ! -f "$WORK/$model.bf16.gguf" ]; then
    say "$model → GGUF (llama.cpp's converter)"
    "$PY" "$HERE/convert_with_known_pretokenizer.py" "$LLAMA" "$src" --outtype bf16 --outfile "$WORK/$model.bf16.gguf" 2>/dev/null
  fi
  for q in Q8_0 Q4_0; do
    [ -f "$WORK/$model.$q.gguf" ] || "$BIN/llama-quantize" "$WORK/$model.bf16.gguf" "$WORK/$model.$q.gguf" "$q" "$THREADS" >/dev/null 2>&1
  done
  for q in int8 int4-g32 int4-g32+int4-g32 int4-g128+int6-g32+int6-g32; do
    # A finished conversion asked again is a no-op; one this build cannot read (an older container
    # version) is converted again. `q` is EXPERTS[+DENSE[+HEAD]] (dense int8 where not given).
    IFS=+ read -r experts dense head <<< "$q"
    convert() { "$SHIMMER" convert --from "$src" --to "$WORK/$model-$q" --quant "$experts" \
      --dense-quant "${dense:-int8}" ${head:+--head-quant "$head"} --quiet; }
    convert 2>/dev/null || { say "$model-$q: converting again"; rm -rf "${WORK:?}/$model-$q"; convert; }
  done
done

# 5. Alternating runs: llama-bench (pp = prefill of PROMPT tokens, tg = GEN tokens generated), then
#    shimmer bench with the same counts and threads, RUNS times per format.
RESULTS="$WORK/results.jsonl"
: > "$RESULTS"
for model in m1b demo; do
  # A shimmer format is the experts' quantisation, then `+` and the dense weights' where not int8,
  # then `+` and the LM head's where chosen apart.
  for pair in "Q8_0 int8" "Q4_0 int4-g32" "Q4_0 int4-g32+int4-g32" "Q4_0 int4-g128+int6-g32+int6-g32"; do
    set -- $pair
    for i in $(seq "$RUNS"); do
      say "$model $1 vs $2, run $i/$RUNS"
      "$BIN/llama-bench" -m "$WORK/$model.$1.gguf" -p "$PROMPT" -n "$GEN" -t "$THREADS" -r "$REPS" -o json 2>/dev/null \
        | "$PY" -c "import sys, json, statistics; [print(json.dumps({'model': '$model', 'format': '$1 / $2', 'engine': 'llama.cpp', 'test': 'prefill' if r['n_prompt'] else 'decode', 'tok_s': statistics.median(r.get('samples_ts') or [r['avg_ts']])})) for r in json.load(sys.stdin)]" >> "$RESULTS"
      # PARALLEL sequences of PROMPT random tokens each, prefilled in one batch, then GEN tokens
      # each, all sequences in every step (its "S_TG t/s").
      # (Once in a dozen runs here it ended without a result; that pair then has no batched row.)
      if "$BIN/llama-batched-bench" -m "$WORK/$model.$1.gguf" -c $((PARALLEL * (PROMPT + GEN))) -b 2048 -ub 512 -npp "$PROMPT" \
        -ntg "$GEN" -npl "$PARALLEL" -t "$THREADS" --output-format jsonl > "$WORK/batched.out" 2> "$WORK/batched.err" \
        && grep -q '^{' "$WORK/batched.out"; then
        grep '^{' "$WORK/batched.out" \
          | "$PY" -c "import sys, json; [print(json.dumps({'model': '$model', 'format': '$1 / $2', 'engine': 'llama.cpp', 'test': 'batched', 'tok_s': json.loads(l)['speed_tg']})) for l in sys.stdin]" >> "$RESULTS"
      else
        say "llama-batched-bench gave no result (exit $?): $(tail -n 2 "$WORK/batched.err" | tr '\n' ' ')"
      fi
      "$SHIMMER" bench --model "$WORK/$model-$2" --ram-gb 64 --no-usage --threads "$THREADS" --prompt-tokens "$PROMPT" \
        --gen-tokens "$GEN" --disk-probe-mb 1 --preload --warmup 1 --repetitions "$REPS" --parallel "$PARALLEL" --json 2>/dev/null \
        | "$PY" -c "import sys, json; r = json.load(sys.stdin); [print(json.dumps({'model': '$model', 'format': '$1 / $2', 'engine': 'shimmer', 'test': t, 'tok_s': v, 'roofline': r['fraction_of_roofline']})) for t, v in (('prefill', r['prefill_tok_s']), ('decode', r['decode_tok_s']), ('batched', r['batched']['decode_tok_s']))]" >> "$RESULTS"
    done
  done
done

# 6. Ratios.
"$PY" - "$RESULTS" "$THREADS" "$PARALLEL" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"shimmer ÷ llama.cpp, {sys.argv[2]} threads (min / median / max over paired runs; batched: {sys.argv[3]} sequences, all of them)")
print(f"{'model':6} {'format':26} {'test':8} {'llama.cpp tok/s':>16} {'shimmer tok/s':>14} {'ratio min/med/max':>22} {'shimmer of roofline':>20}")
for model in ("m1b", "demo"):
    for fmt in ("Q8_0 / int8", "Q4_0 / int4-g32", "Q4_0 / int4-g32+int4-g32", "Q4_0 / int4-g128+int6-g32+int6-g32"):
        for test in ("prefill", "decode", "batched"):
            l = [r["tok_s"] for r in rows if (r["model"], r["format"], r["engine"], r["test"]) == (model, fmt, "llama.cpp", test)]
            s = [r for r in rows if (r["model"], r["format"], r["engine"], r["test"]) == (model, fmt, "shimmer", test)]
            if not l or not s:
                continue
            ratios = sorted(a["tok_s"] / b for a, b in zip(s, l))
            label = fmt
            roof = statistics.median(r["roofline"] for r in s) if test == "decode" else float("nan")
            print(f"{model:6} {label:26} {test:8} {statistics.median(l):16.2f} {statistics.median(r['tok_s'] for r in s):14.2f} "
                  f"{ratios[0]:6.2f} / {statistics.median(ratios):5.2f} / {ratios[-1]:5.2f} {roof:20.3f}")
PY
