// The CUDA kernels of the VRAM tier: the same arithmetic as the Vulkan shaders (../shaders/),
// step for step, so an expert gives the CPU's bits (kernels/src/dot.rs, qdot.rs, gating.rs).
//
// Compiled at run time by NVRTC (or ahead, to PTX) with --fmad=false: no multiply and add is
// contracted behind our back; every fused multiply-add is an explicit __fmaf_rn and every other
// float operation an explicit round-to-nearest intrinsic. Nothing divides (the integer formats'
// activations arrive quantised by the host, with the CPU's own quantiser). Subnormals are kept
// (no -ftz). `check_ptx.py` compiles this file for sm_80 and sm_90 and checks it with ptxas.
//
// Launch shapes: the float matvec kernels take blocks of 64 threads, one block per (output row,
// activation row) — grid (rows, n); the integer ones blocks of 32; swiglu blocks of 64 over
// (ceil(width / 64), n).

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

__device__ __forceinline__ float bits_to_float(u32 b) { return __uint_as_float(b); }

// --- the float formats: the exact f32 value of element `col` of weight row `row` ---

struct F32Row {
    const float* w;
    __device__ float get(u32 row, u32 cols, u32 col) const { return w[(size_t)row * cols + col]; }
};

struct Bf16Row {
    const u16* w;
    __device__ float get(u32 row, u32 cols, u32 col) const { return bits_to_float((u32)w[(size_t)row * cols + col] << 16); }
};

struct F16Row {
    const u16* w;
    __device__ float get(u32 row, u32 cols, u32 col) const {
        // Widened by hand, exactly (a subnormal half is a normal float).
        u32 h = w[(size_t)row * cols + col];
        u32 sign = (h & 0x8000u) << 16, ex = (h >> 10) & 0x1fu, man = h & 0x3ffu;
        if (ex == 0u) return bits_to_float(__float_as_uint(__fmul_rn((float)man, 5.9604644775390625e-8f)) | sign);
        if (ex == 31u) return bits_to_float(sign | 0x7f800000u | (man << 13));
        return bits_to_float(sign | ((ex + 112u) << 23) | (man << 13));
    }
};

struct Fp8Row {
    const u8* w;
    const float* scales;  // ceil(rows / row_block) × ceil(cols / block)
    u32 block;
    u32 row_block;
    __device__ float get(u32 row, u32 cols, u32 col) const {
        // e4m3fn by bits (S.1111.111 is NaN), then times the block's scale, rounded once.
        u32 b = w[(size_t)row * cols + col];
        u32 ex = (b >> 3) & 0xfu, man = b & 7u;
        float v;
        if (ex == 0xfu && man == 7u) v = bits_to_float(0x7fc00000u);
        else if (ex == 0u) v = __fmul_rn((float)man, 0.001953125f);
        else v = bits_to_float(((ex + 120u) << 23) | (man << 20));
        if ((b & 0x80u) != 0u && !isnan(v)) v = -v;
        u32 groups = (cols + block - 1u) / block;
        return __fmul_rn(v, scales[(row / row_block) * groups + col / block]);
    }
};

// One weight row · one activation row: 64 lanes, each a chain of fused multiply-adds over its
// elements (zero-padded to a multiple of 64; the padded fma is done, as on the CPU), then the
// fixed tree 32, 16, …, 1.
template <typename Row>
__device__ void matvec(Row w, const float* x, float* y, u32 rows, u32 cols) {
    __shared__ float lanes[64];
    u32 row = blockIdx.x, r = blockIdx.y, l = threadIdx.x;
    u32 padded = (cols + 63u) / 64u * 64u;
    const float* xr = x + (size_t)r * cols;
    float acc = 0.0f;
    for (u32 i = l; i < padded; i += 64u) {
        float wv = i < cols ? w.get(row, cols, i) : 0.0f;
        float xv = i < cols ? xr[i] : 0.0f;
        acc = __fmaf_rn(wv, xv, acc);
    }
    lanes[l] = acc;
    __syncthreads();
    for (u32 s = 32u; s > 0u; s >>= 1) {
        if (l < s) lanes[l] = __fadd_rn(lanes[l], lanes[l + s]);
        __syncthreads();
    }
    if (l == 0u) y[(size_t)r * rows + row] = lanes[0];
}

extern "C" __global__ void matvec_f32(const float* w, const float* x, float* y, u32 rows, u32 cols) { matvec(F32Row{w}, x, y, rows, cols); }
extern "C" __global__ void matvec_bf16(const u16* w, const float* x, float* y, u32 rows, u32 cols) { matvec(Bf16Row{w}, x, y, rows, cols); }
extern "C" __global__ void matvec_f16(const u16* w, const float* x, float* y, u32 rows, u32 cols) { matvec(F16Row{w}, x, y, rows, cols); }
extern "C" __global__ void matvec_fp8(const u8* w, const float* scales, u32 block, u32 row_block, const float* x, float* y, u32 rows, u32 cols) {
    matvec(Fp8Row{w, scales, block, row_block}, x, y, rows, cols);
}

// --- the integer formats (kernels/src/qdot.rs) ---

// 2 · e2m1(nibble), as integers.
__device__ __forceinline__ int e2m1_twice(u32 nib) {
    const int mag[8] = {0, 1, 2, 3, 4, 6, 8, 12};
    int m = mag[nib & 7u];
    return (nib & 8u) ? -m : m;
}

enum QFormat { INT8 = 0, INT4 = 1, MXFP4 = 2 };

// One weight row · one quantised activation row (kernels/src/qdot.rs's order): per block of 32,
// the products summed exactly as integers — int8: eight groups of four, one fused multiply-add
// each with the block's factor f = ws · d into 32 lanes; the 4-bit formats: two halves of
// sixteen into 8 lanes (the other 24 stay +0, which the tree's first two steps add exactly) —
// the fixed tree 16…1; int8's row scale multiplies the result. `q` holds each row's
// `blocks · 32` int8 values, `d` its block scales.
template <int F>
__device__ void qmatvec(const u8* w, const void* ws, u32 group, const signed char* q, const float* d, float* y, u32 rows, u32 cols) {
    __shared__ float lanes[32];
    u32 row = blockIdx.x, r = blockIdx.y, l = threadIdx.x;
    u32 blocks = (cols + 31u) / 32u;
    const signed char* qr = q + (size_t)r * blocks * 32u;
    const float* dr = d + (size_t)r * blocks;
    u32 c, j, h;
    size_t row_bytes;
    if (F == INT8) {
        c = l / 8u; j = l % 8u; h = 0u;
        row_bytes = cols;
    } else {
        // Lane 2·[0, 2, 1, 3][kb] + t (l < 8) takes half t of the blocks b ≡ kb (mod 4); the
        // permutation is its own inverse. Lanes from 8 take nothing.
        const u32 kb_of[4] = {0u, 2u, 1u, 3u};
        c = l < 8u ? kb_of[l / 2u] : blocks; j = 0u; h = l % 2u;
        row_bytes = (cols + 1u) / 2u;
    }
    const u8* wr = w + (size_t)row * row_bytes;
    float acc = 0.0f;
    for (u32 b = c; b < blocks; b += 4u) {
        float wsb;
        if (F == INT8) {
            wsb = 1.0f;
        } else if (F == INT4) {
            u32 groups = (cols + group - 1u) / group;
            wsb = ((const float*)ws)[(size_t)row * groups + b * 32u / group];
        } else {
            // The e8m0 scale halved, 2^(e − 128), exactly (e ≤ 1 subnormal, 255 NaN).
            u32 e = ((const u8*)ws)[(size_t)row * blocks + b];
            wsb = e <= 1u ? bits_to_float(1u << (21u + e)) : (e == 255u ? bits_to_float(0x7fc00000u) : bits_to_float((e - 1u) << 23));
        }
        float f = __fmul_rn(wsb, dr[b]);
        int sum = 0;
        for (u32 t = 0u; t < (F == INT8 ? 4u : 16u); t++) {
            u32 i = F == INT8 ? 32u * b + 4u * j + t : 32u * b + 16u * h + t;
            if (i < cols) {
                int wv;
                if (F == INT8) {
                    wv = (int)(signed char)wr[i];
                } else {
                    u32 nib = (wr[i >> 1] >> ((i & 1u) * 4u)) & 0xfu;
                    wv = F == INT4 ? (int)nib - 8 : e2m1_twice(nib);
                }
                sum += wv * (int)qr[i];
            }
        }
        acc = __fmaf_rn(f, (float)sum, acc);
    }
    lanes[l] = acc;
    __syncthreads();
    for (u32 s = 16u; s > 0u; s >>= 1) {
        if (l < s) lanes[l] = __fadd_rn(lanes[l], lanes[l + s]);
        __syncthreads();
    }
    if (l == 0u) {
        float out = lanes[0];
        if (F == INT8) out = __fmul_rn(((const float*)ws)[row], out);
        y[(size_t)r * rows + row] = out;
    }
}

extern "C" __global__ void qmatvec_int8(const u8* w, const float* row_scales, const signed char* q, const float* d, float* y, u32 rows, u32 cols) {
    qmatvec<INT8>(w, row_scales, 32u, q, d, y, rows, cols);
}
extern "C" __global__ void qmatvec_int4(const u8* w, const float* group_scales, u32 group, const signed char* q, const float* d, float* y, u32 rows, u32 cols) {
    qmatvec<INT4>(w, group_scales, group, q, d, y, rows, cols);
}
extern "C" __global__ void qmatvec_mxfp4(const u8* w, const u8* e8m0, const signed char* q, const float* d, float* y, u32 rows, u32 cols) {
    qmatvec<MXFP4>(w, e8m0, 32u, q, d, y, rows, cols);
}

// --- SwiGLU gating (kernels/src/gating.rs): g = silu(g) · u, from correctly rounded steps ---

__device__ float canonical_exp(float x) {
    const float EXP_MIN = bits_to_float(0xC2AE0000u), EXP_MAX = bits_to_float(0x42B17217u);
    const float LOG2E = bits_to_float(0x3FB8AA3Bu), ROUND = bits_to_float(0x4B400000u);
    const float LN2_HI = bits_to_float(0x3F317200u), LN2_LO = bits_to_float(0x35BFBE8Eu);
    float k = __fsub_rn(__fadd_rn(__fmul_rn(x, LOG2E), ROUND), ROUND);
    float r = __fmaf_rn(-k, LN2_HI, x);
    r = __fmaf_rn(-k, LN2_LO, r);
    float p = bits_to_float(0x39500D01u);
    p = __fmaf_rn(p, r, bits_to_float(0x3AB60B61u));
    p = __fmaf_rn(p, r, bits_to_float(0x3C088889u));
    p = __fmaf_rn(p, r, bits_to_float(0x3D2AAAABu));
    p = __fmaf_rn(p, r, bits_to_float(0x3E2AAAABu));
    p = __fmaf_rn(p, r, 0.5f);
    p = __fmaf_rn(p, r, 1.0f);
    p = __fmaf_rn(p, r, 1.0f);
    int kc = (int)fminf(fmaxf(k, -126.0f), 128.0f);
    float v = __fmul_rn(p, bits_to_float((u32)(min(kc, 127) + 127) << 23));
    if (kc > 127) v = __fmul_rn(v, 2.0f);
    if (x < EXP_MIN) v = 0.0f;
    if (x > EXP_MAX) v = bits_to_float(0x7f800000u);
    if (isnan(x)) v = x;
    return v;
}

__device__ float canonical_recip(float d) {
    float y = bits_to_float(0x7EF311C3u - __float_as_uint(d));
    for (int i = 0; i < 3; i++) {
        float e = __fmaf_rn(-d, y, 1.0f);
        y = __fmaf_rn(y, e, y);
    }
    if (d > bits_to_float(0x7E000000u)) y = 0.0f;
    return y;
}

extern "C" __global__ void swiglu(float* g, const float* u, u32 width) {
    u32 c = blockIdx.x * 64u + threadIdx.x;
    if (c >= width) return;
    size_t i = (size_t)blockIdx.y * width + c;
    float x = g[i];
    float silu = __fmul_rn(x, canonical_recip(__fadd_rn(1.0f, canonical_exp(-x))));
    g[i] = __fmul_rn(silu, u[i]);
}
