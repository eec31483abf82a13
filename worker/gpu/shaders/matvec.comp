#version 450
// One weight row · one activation row per workgroup, in kernels/src/dot.rs's canonical order:
// 64 lanes (one per invocation), each a chain of fused multiply-adds over its elements
// (l, l + 64, …, zero-padded to a multiple of 64), then the fixed tree [32, 16, 8, 4, 2, 1].
// Built once per weight format (-DFORMAT_F32 / _BF16 / _F16 / _FP8); see shaders/README.md.
#extension GL_EXT_spirv_intrinsics : require
#extension GL_GOOGLE_include_directive : require

// SignedZeroInfNanPreserve for 32-bit floats (SPV_KHR_float_controls): the driver may not
// assume away infinities, NaNs or the sign of zero.
spirv_execution_mode(extensions = ["SPV_KHR_float_controls"], capabilities = [4466], 4461, 32);

#include "fma.glsl"

layout(local_size_x = 64) in;

layout(std430, set = 0, binding = 0) readonly buffer Weights { uint w[]; };
layout(std430, set = 0, binding = 1) readonly buffer Input { float x[]; };
layout(std430, set = 0, binding = 2) writeonly buffer Output { float y[]; };

layout(push_constant) uniform Params {
    uint w_offset;   // the matrix's first element, in elements of its format
    uint rows;       // output values per activation row
    uint cols;       // the dot products' length
    uint x_offset;   // first activation value
    uint y_offset;   // first output value
    uint s_offset;   // fp8: the block scales' first word
    uint block;      // fp8: columns per scale
    uint row_block;  // fp8: rows per scale
} p;

shared float lanes[64];

// Element `col` of weight row `row`, as the format defines its exact f32 value.
float weight(uint row, uint col) {
    uint e = p.w_offset + row * p.cols + col;
#if defined(FORMAT_F32)
    return uintBitsToFloat(w[e]);
#elif defined(FORMAT_BF16)
    uint h = (w[e >> 1] >> ((e & 1u) * 16u)) & 0xffffu;
    return uintBitsToFloat(h << 16);
#elif defined(FORMAT_F16)
    // Widened by hand, exactly (subnormal halves become normal floats; no device conversion
    // that might flush them).
    uint h = (w[e >> 1] >> ((e & 1u) * 16u)) & 0xffffu;
    uint sign = (h & 0x8000u) << 16;
    uint ex = (h >> 10) & 0x1fu;
    uint man = h & 0x3ffu;
    if (ex == 0u) {
        precise float v = float(man) * 5.9604644775390625e-8; // man · 2^-24, exact
        return uintBitsToFloat(floatBitsToUint(v) | sign);
    }
    if (ex == 31u) {
        return uintBitsToFloat(sign | 0x7f800000u | (man << 13));
    }
    return uintBitsToFloat(sign | ((ex + 112u) << 23) | (man << 13));
#elif defined(FORMAT_FP8)
    // e4m3fn: exact by bits (subnormal e4m3 are normal floats), NaN for S.1111.111; then times
    // the block's scale, rounded once (shimmer_common::quant::fp8_e4m3_to_f32 × scale).
    uint b = (w[e >> 2] >> ((e & 3u) * 8u)) & 0xffu;
    uint ex = (b >> 3) & 0xfu;
    uint man = b & 7u;
    float v;
    if (ex == 0xfu && man == 7u) {
        v = uintBitsToFloat(0x7fc00000u);
    } else if (ex == 0u) {
        precise float m = float(man) * 0.001953125; // man / 8 · 2^-6, exact
        v = m;
    } else {
        v = uintBitsToFloat(((ex + 120u) << 23) | (man << 20));
    }
    if ((b & 0x80u) != 0u && !isnan(v)) {
        v = -v;
    }
    uint groups = (p.cols + p.block - 1u) / p.block;
    precise float scaled = v * uintBitsToFloat(w[p.s_offset + (row / p.row_block) * groups + col / p.block]);
    return scaled;
#else
#error "define FORMAT_F32, FORMAT_BF16, FORMAT_F16 or FORMAT_FP8"
#endif
}

void main() {
    uint row = gl_WorkGroupID.x;
    uint r = gl_WorkGroupID.y;
    uint l = gl_LocalInvocationID.x;
    uint padded = (p.cols + 63u) / 64u * 64u;
    uint xbase = p.x_offset + r * p.cols;
    precise float acc = 0.0;
    for (uint i = l; i < padded; i += 64u) {
        // Past the row's end both sides are 0, as in the CPU's zero padding (which turns a lane's
        // −0 into +0: the padded fma is done, not skipped).
        float wv = i < p.cols ? weight(row, i) : 0.0;
        float xv = i < p.cols ? x[xbase + i] : 0.0;
        acc = FMA(wv, xv, acc);
    }
    lanes[l] = acc;
    barrier();
    for (uint s = 32u; s > 0u; s >>= 1) {
        if (l < s) {
            precise float t = lanes[l] + lanes[l + s];
            lanes[l] = t;
        }
        barrier();
    }
    if (l == 0u) {
        y[p.y_offset + r * p.rows + row] = lanes[0];
    }
}
