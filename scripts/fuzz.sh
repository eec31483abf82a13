#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ from its corpus (fuzz/corpus/TARGET, kept in the repo)
# for SECONDS each (or RUNS inputs, whichever ends first), with a memory and a per-input time
# limit: a crash, a leak of the limits or a slow input fails the run, and libFuzzer leaves the
# input in fuzz/artifacts/TARGET. New inputs that add coverage go to a scratch copy of the corpus
# unless --keep, which merges them (minimized) into fuzz/corpus — what a campaign does. With
# --sample K a run starts from K inputs of the kept corpus picked at random (each run a different
# slice) instead of all of it: a short run then spends its seconds fuzzing rather than replaying
# thousands of kept inputs.
#
#   scripts/fuzz.sh [--seconds S] [--runs N] [--sample K] [--keep] [--optimized] [TARGET...]
#                                                       (default: every target, 5 s each)
#
# The targets are built once, coverage-instrumented without a sanitizer (Rust is memory-safe
# outside `unsafe`, and the build is what a short run costs) with debug assertions on (overflow
# checks): unoptimized for a short run (`--dev`: the quickest build), optimized with
# `--optimized` (a campaign: many more inputs a second). `cargo fuzz` wants nightly flags;
# RUSTC_BOOTSTRAP=1 lets the pinned stable toolchain take them.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
seconds=5 runs=0 sample=0 keep="" optimized=""
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds="$2"; shift 2 ;;
    --runs) runs="$2"; shift 2 ;;
    --sample) sample="$2"; shift 2 ;;
    --keep) keep=1; shift ;;
    --optimized) optimized=1; shift ;;
    -*) echo "error: unknown option $1 (see the header of $0)" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
export RUSTC_BOOTSTRAP=1
# The fuzz workspace builds in its own directory: CARGO_TARGET_DIR would put its instrumented
# objects beside the workspace's (and cargo fuzz would not find its binaries). A cache directory
# named by CARGO_TARGET_DIR (CI's) gets a `fuzz/` of its own, which both cargo fuzz verbs are told.
target_dir="${CARGO_TARGET_DIR:+$CARGO_TARGET_DIR/fuzz}"
unset CARGO_TARGET_DIR
flags=(--dev --sanitizer none)
[ -n "$optimized" ] && flags=(--sanitizer none)
[ -n "$target_dir" ] && flags+=(--target-dir "$target_dir")
[ ${#targets[@]} -gt 0 ] || mapfile -t targets < <(cargo fuzz list)
cargo fuzz build "${flags[@]}" >&2
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t" "artifacts/$t"
  scratch="$(mktemp -d)"
  args=(-max_total_time="$seconds" -rss_limit_mb=2048 -malloc_limit_mb=1024 -timeout=30 -print_final_stats=1)
  [ "$runs" -gt 0 ] && args+=(-runs="$runs")
  echo "== fuzz $t: ${seconds} s$([ "$runs" -gt 0 ] && echo ", at most $runs runs")" >&2
  seeds="corpus/$t"
  if [ "$sample" -gt 0 ]; then
    seeds="$(mktemp -d)"
    # libFuzzer replays every seed before it looks at the clock: a target whose inputs are whole
    # requests through the engine (~0.3 s each in this unoptimised build) starts from a tenth.
    take="$sample"
    case "$t" in api_request) take=$(( (sample + 9) / 10 )) ;; esac
    find "corpus/$t" -type f | shuf -n "$take" | xargs -r cp -t "$seeds"
  fi
  # New inputs land in the scratch directory (first), the seeds are read from the other.
  if ! cargo fuzz run "${flags[@]}" "$t" "$scratch" "$seeds" -- "${args[@]}" 2>"$scratch.log"; then
    tail -40 "$scratch.log" >&2
    echo "error: fuzz target $t failed; the input is in fuzz/artifacts/$t" >&2
    rm -rf "$scratch" "$scratch.log"
    [ "$seeds" = "corpus/$t" ] || rm -rf "$seeds"
    exit 1
  fi
  grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$scratch.log" | sed "s/^/  $t: /" >&2 || true
  if [ -n "$keep" ]; then
    # Minimized merge: only inputs that add coverage to what the kept corpus has.
    cargo fuzz run "${flags[@]}" "$t" "corpus/$t" "$scratch" -- -merge=1 -rss_limit_mb=2048 -timeout=30 2>>"$scratch.log" >&2 || true
  fi
  rm -rf "$scratch" "$scratch.log"
  [ "$seeds" = "corpus/$t" ] || rm -rf "$seeds"
done
