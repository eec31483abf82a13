#version 450
// One weight row · one activation row per workgroup with integer products, in
// kernels/src/qdot.rs's canonical order: activations quantised to int8 per block of 32 (by the
// host, with the CPU's own quantiser), each block's products summed exactly as integers — int8:
// eight groups of four, one fused multiply-add each with the block's factor into 32 lanes; the
// 4-bit formats: two halves of sixteen into 8 lanes (the other 24 stay +0, which the tree's
// first two steps add exactly) — then the fixed tree [16, 8, 4, 2, 1]; int8's row scale
// multiplies the result. Built per weight format (-DFORMAT_INT8 / _INT4 / _MXFP4); see README.md.
#extension GL_EXT_spirv_intrinsics : require
#extension GL_GOOGLE_include_directive : require

spirv_execution_mode(extensions = ["SPV_KHR_float_controls"], capabilities = [4466], 4461, 32);

#include "fma.glsl"

layout(local_size_x = 32) in;

layout(std430, set = 0, binding = 0) readonly buffer Weights { uint w[]; };
// Per activation row: `blocks * 32` int8 values (4 a word), then, from `s_offset`, the rows'
// block scales (f32 bits).
layout(std430, set = 0, binding = 1) readonly buffer Input { uint x[]; };
layout(std430, set = 0, binding = 2) writeonly buffer Output { float y[]; };

layout(push_constant) uniform Params {
    uint w_byte;     // the matrix's first value byte
    uint ws_byte;    // its first scale byte
    uint rows;       // output values per activation row
    uint cols;       // the dot products' length
    uint group;      // int4's values per scale
    uint x_word;     // the first activation row's first word
    uint xs_word;    // the first activation row's first block scale (a word)
    uint y_offset;   // first output value
} p;

shared float lanes[32];

uint byte_at(uint b) {
    return (w[b >> 2] >> ((b & 3u) * 8u)) & 0xffu;
}

// 2 · e2m1(nibble), as integers.
int e2m1_twice(uint nib) {
    const int mag[8] = int[8](0, 1, 2, 3, 4, 6, 8, 12);
    int m = mag[nib & 7u];
    return (nib & 8u) != 0u ? -m : m;
}

void main() {
    uint row = gl_WorkGroupID.x;
    uint r = gl_WorkGroupID.y;
    uint l = gl_LocalInvocationID.x;
    uint blocks = (p.cols + 31u) / 32u;
    uint xrow = p.x_word + r * blocks * 8u;
    uint xs = p.xs_word + r * blocks;
#if defined(FORMAT_INT8)
    uint row_bytes = p.cols;
    // Lane 8·(b mod 4) + j takes group j (elements 32b + 4j .. +4) of the blocks b ≡ c (mod 4).
    uint c = l / 8u, j = l % 8u, h = 0u;
#else
    uint row_bytes = (p.cols + 1u) / 2u;
    // Lane 2·[0, 2, 1, 3][kb] + t (l < 8) takes half t (elements 32b + 16t .. +16) of the blocks
    // b ≡ kb (mod 4); the permutation is its own inverse. Lanes from 8 take nothing.
    const uint kb_of[4] = uint[4](0u, 2u, 1u, 3u);
    uint c = l < 8u ? kb_of[l / 2u] : blocks, j = 0u, h = l % 2u;
#endif
    uint wrow = p.w_byte + row * row_bytes;
    precise float acc = 0.0;
    for (uint b = c; b < blocks; b += 4u) {
#if defined(FORMAT_INT8)
        float ws = 1.0;
#elif defined(FORMAT_INT4)
        uint groups = (p.cols + p.group - 1u) / p.group;
        float ws = uintBitsToFloat(w[(p.ws_byte >> 2) + row * groups + b * 32u / p.group]);
#else
        // MXFP4: the e8m0 scale halved, 2^(e − 128), exactly (e ≤ 1 subnormal, 255 NaN).
        uint e = byte_at(p.ws_byte + row * blocks + b);
        float ws = e <= 1u ? uintBitsToFloat(1u << (21u + e)) : (e == 255u ? uintBitsToFloat(0x7fc00000u) : uintBitsToFloat((e - 1u) << 23));
#endif
        precise float f = ws * uintBitsToFloat(x[xs + b]);
        int sum = 0;
#if defined(FORMAT_INT8)
        for (uint t = 0u; t < 4u; t++) {
            uint i = 32u * b + 4u * j + t;
#else
        for (uint t = 0u; t < 16u; t++) {
            uint i = 32u * b + 16u * h + t;
#endif
            if (i < p.cols) {
                int q = int(((x[xrow + (i >> 2)] >> ((i & 3u) * 8u)) & 0xffu) << 24) >> 24;
#if defined(FORMAT_INT8)
                int wv = int(byte_at(wrow + i) << 24) >> 24;
#else
                uint nib = (byte_at(wrow + (i >> 1)) >> ((i & 1u) * 4u)) & 0xfu;
#if defined(FORMAT_INT4)
                int wv = int(nib) - 8;
#else
                int wv = e2m1_twice(nib);
#endif
#endif
                sum += wv * q;
            }
        }
        acc = FMA(f, float(sum), acc);
    }
    lanes[l] = acc;
    barrier();
    for (uint s = 16u; s > 0u; s >>= 1) {
        if (l < s) {
            precise float t = lanes[l] + lanes[l + s];
            lanes[l] = t;
        }
        barrier();
    }
    if (l == 0u) {
#if defined(FORMAT_INT8)
        precise float out_ = uintBitsToFloat(w[(p.ws_byte >> 2) + row]) * lanes[0];
#else
        precise float out_ = lanes[0];
#endif
        y[p.y_offset + r * p.rows + row] = out_;
    }
}
