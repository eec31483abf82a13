// FMA(a, b, c): a · b + c rounded once, as the CPU kernels' `mul_add` gives it.
//
// Vulkan lets a driver compute GLSL's fma() as a multiply and an add, each rounded (Mesa's
// lavapipe does; NVIDIA, AMD, Intel and Apple GPUs fuse it in hardware). So each shader is built
// twice: with the device's fma(), used where the start-up self-test shows it fused, and with
// EXACT_FMA, an exact emulation through binary64 for devices that do not fuse but have
// shaderFloat64. The device's own choice is never trusted without the self-test.
#ifdef EXACT_FMA
float exact_fma(float a, float b, float c) {
    // a · b is exact in binary64 (48 significant bits, no overflow or underflow from binary32
    // operands); s is its sum with c rounded to 53 bits, and t the exact rest (TwoSum).
    precise double p = double(a) * double(b);
    precise double dc = double(c);
    precise double s = p + dc;
    precise double v = s - p;
    precise double t = (p - (s - v)) + (dc - v);
    float r = float(s);
    // Rounding s to 24 bits is the correct rounding of s + t except when s lies exactly halfway
    // between two floats and t is not 0: then the exact value is past the midpoint, toward t.
    // (No test of s for inf or NaN: then r is inf or NaN and stays so, as the comparisons fail.)
    if (t != 0.0lf && double(r) != s) {
        uint rb = floatBitsToUint(r);
        float o;
        double mid;
        if (isinf(r)) {
            // Overflowed: the other candidate is the largest float; the threshold 2^128 − 2^103.
            o = uintBitsToFloat((rb & 0x80000000u) | 0x7f7fffffu);
            mid = (s > 0.0lf ? 1.0lf : -1.0lf) * packDouble2x32(uvec2(0xf0000000u, 0x47efffffu));
        } else {
            // The float on s's other side: one step away from zero if |r| < |s|, else toward it.
            o = uintBitsToFloat(abs(double(r)) < abs(s) ? rb + 1u : rb - 1u);
            mid = (double(r) + double(o)) * 0.5lf;
        }
        if (s == mid && ((t > 0.0lf) == (double(o) > double(r)))) {
            r = o;
        }
    }
    return r;
}
#define FMA(a, b, c) exact_fma(a, b, c)
#else
#define FMA(a, b, c) fma(a, b, c)
#endif
