#!/usr/bin/env bash
# Builds the SPIR-V the Vulkan backend embeds from the GLSL beside it. Its output is committed,
# so building shimmer needs no shader compiler; `cargo test -p shimmer-gpu` (shaders_match_their_source)
# runs this into a temporary directory and compares. Needs Debian's `glslc` (shaderc).
#
#   bash worker/gpu/shaders/build.sh [OUT_DIR]     (default: this directory)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here}"
cc() { glslc --target-env=vulkan1.2 -O -I "$here" "$@"; }
for format in f32 bf16 f16 fp8; do
    upper="$(echo "$format" | tr a-z A-Z)"
    cc -DFORMAT_"$upper" "$here/matvec.comp" -o "$out/matvec_$format.spv"
    cc -DFORMAT_"$upper" -DEXACT_FMA "$here/matvec.comp" -o "$out/matvec_${format}_exact.spv"
done
for format in int8 int4 mxfp4; do
    upper="$(echo "$format" | tr a-z A-Z)"
    cc -DFORMAT_"$upper" "$here/qmatvec.comp" -o "$out/qmatvec_$format.spv"
    cc -DFORMAT_"$upper" -DEXACT_FMA "$here/qmatvec.comp" -o "$out/qmatvec_${format}_exact.spv"
done
cc "$here/swiglu.comp" -o "$out/swiglu.spv"
cc -DEXACT_FMA "$here/swiglu.comp" -o "$out/swiglu_exact.spv"
