#version 450
// gate = silu(gate) ⊙ up, step for step as kernels/src/gating.rs defines it (no device exp or
// division: their last bits differ between GPUs). Every intermediate is `precise`: no
// contraction beyond the FMA()s written.
#extension GL_EXT_spirv_intrinsics : require
#extension GL_GOOGLE_include_directive : require
spirv_execution_mode(extensions = ["SPV_KHR_float_controls"], capabilities = [4466], 4461, 32);

#include "fma.glsl"

layout(local_size_x = 64) in;

layout(std430, set = 0, binding = 0) buffer Gate { float g[]; };
layout(std430, set = 0, binding = 1) readonly buffer Up { float u[]; };

// Dispatched as (ceil(width / 64), rows): one row of `width` values per workgroup row.
layout(push_constant) uniform Params {
    uint offset;  // first value
    uint width;   // values per row (the expert's intermediate size)
} p;

// Bit patterns, as gating.rs writes them: no decimal parsing or constant folding between.
#define EXP_MIN uintBitsToFloat(0xC2AE0000u)    // -87
#define EXP_MAX uintBitsToFloat(0x42B17217u)    // 88.72283
#define LOG2E uintBitsToFloat(0x3FB8AA3Bu)
#define ROUND uintBitsToFloat(0x4B400000u)      // 1.5 · 2^23
#define LN2_HI uintBitsToFloat(0x3F317200u)
#define LN2_LO uintBitsToFloat(0x35BFBE8Eu)
#define RECIP_MAX uintBitsToFloat(0x7E000000u)  // 2^125
#define RECIP_MAGIC 0x7EF311C3u
#define C7 uintBitsToFloat(0x39500D01u)         // 1/5040
#define C6 uintBitsToFloat(0x3AB60B61u)         // 1/720
#define C5 uintBitsToFloat(0x3C088889u)         // 1/120
#define C4 uintBitsToFloat(0x3D2AAAABu)         // 1/24
#define C3 uintBitsToFloat(0x3E2AAAABu)         // 1/6

float canonical_exp(float x) {
    precise float k = (x * LOG2E + ROUND) - ROUND;
    precise float r = FMA(-k, LN2_HI, x);
    r = FMA(-k, LN2_LO, r);
    precise float q = C7;
    q = FMA(q, r, C6);
    q = FMA(q, r, C5);
    q = FMA(q, r, C4);
    q = FMA(q, r, C3);
    q = FMA(q, r, 0.5);
    q = FMA(q, r, 1.0);
    q = FMA(q, r, 1.0);
    int kc = int(clamp(k, -126.0, 128.0));
    precise float v = q * uintBitsToFloat(uint(min(kc, 127) + 127) << 23);
    if (kc > 127) {
        v = v * 2.0;
    }
    if (x < EXP_MIN) {
        v = 0.0;
    }
    if (x > EXP_MAX) {
        v = uintBitsToFloat(0x7f800000u);
    }
    return v;
}

float canonical_recip(float d) {
    precise float y = uintBitsToFloat(RECIP_MAGIC - floatBitsToUint(d));
    for (int i = 0; i < 3; i++) {
        precise float e = FMA(-d, y, 1.0);
        y = FMA(y, e, y);
    }
    if (d > RECIP_MAX) {
        y = 0.0;
    }
    return y;
}

void main() {
    uint c = gl_GlobalInvocationID.x;
    if (c >= p.width) {
        return;
    }
    uint i = gl_WorkGroupID.y * p.width + c;
    float x = g[p.offset + i];
    precise float d = 1.0 + canonical_exp(-x);
    precise float silu = x * canonical_recip(d);
    precise float out_ = silu * u[p.offset + i];
    g[p.offset + i] = out_;
}
