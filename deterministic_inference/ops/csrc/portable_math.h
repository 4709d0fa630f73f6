/* Elementary functions of deterministic-inference written out as fixed sequences of IEEE operations, so
   their bits depend on this source alone: not on libm, not on the vector width the compiler picks, not on
   the ISA the library is built for (the build forbids contraction and reassociation; see native.py).

   - pm_expf (float): the kernels' exp_in_range with its range handled (underflow to 0, overflow to
     inf, NaN kept); vectorisable, used by the sampler's softmax / log_softmax.
   - pm_exp, pm_log (double): range reduction by powers of two and a polynomial; used where one value
     per row or per table entry is needed (the log of a softmax sum, the rotary frequencies).
   - pm_sincos (double): reduction by pi/2 with a three-part constant, Taylor polynomials on
     [-pi/4, pi/4]; for the rotary tables (arguments below 2^20 * pi/2).

   Accuracy (tests/ops/test_portable_math.py compares with float64 / libm): pm_expf about 1e-7
   relative, the double functions a few 1e-16. They are not correctly rounded, and need not be: what
   matters is that every machine computes the same bits. */

#ifndef DETINF_PORTABLE_MATH_H
#define DETINF_PORTABLE_MATH_H

#include "common.h"

/* exp(x) for any float: exp_in_range on [-87, 88], 0 below (the true value is below FLT_MIN there),
   +inf above, NaN for NaN. Branch-free selects, so loops over it vectorise. */
static inline float pm_expf(float x) {
    const int is_nan = x != x;
    float clamped = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    clamped = is_nan ? 0.0f : clamped;
    float y = exp_in_range(clamped);
    y = x < -87.0f ? 0.0f : y;
    y = x > 88.0f ? INFINITY : y;
    return is_nan ? x : y;
}

/* 2^n as a double for integer n in [-1022, 1023]. */
static inline double pm_pow2i(int64_t n) {
    const uint64_t bits = (uint64_t)(n + 1023) << 52;
    double value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* exp(x) for x in [-700, 700] (NaN for NaN; callers stay in range): x = n ln2 + r with ln2 in two
   parts (n * LN2_HI exact for |n| < 2^21), |r| <= ln2 / 2, exp(r) by a degree-13 Taylor polynomial. */
static inline double pm_exp(double x) {
    const double inv_ln2 = 0x1.71547652b82fep+0;
    const double ln2_hi = 0x1.62e42ffp-1;     /* ln 2 rounded to 32 significant bits */
    const double ln2_lo = -0x1.718432a1b0e26p-35; /* ln 2 - ln2_hi */
    const double round_magic = 0x1.8p52;       /* adding and subtracting rounds to an integer */
    if (x != x) return x;
    const double n = (x * inv_ln2 + round_magic) - round_magic;
    const double r = (x - n * ln2_hi) - n * ln2_lo;
    double p = 1.0 / 6227020800.0; /* 1/13! */
    p = p * r + 1.0 / 479001600.0;
    p = p * r + 1.0 / 39916800.0;
    p = p * r + 1.0 / 3628800.0;
    p = p * r + 1.0 / 362880.0;
    p = p * r + 1.0 / 40320.0;
    p = p * r + 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    return p * pm_pow2i((int64_t)n);
}

/* Natural log of a double: NaN for NaN or x < 0, -inf for 0, +inf for +inf. x = m 2^e with m in
   [sqrt(1/2), sqrt(2)), log m = 2 atanh(s), s = (m - 1) / (m + 1), |s| < 0.172, series to s^23.
   Subnormal x is scaled by 2^54 first. */
static inline double pm_log(double x) {
    const double ln2 = 0x1.62e42fefa39efp-1;
    if (x != x || x < 0.0) return NAN;
    if (x == 0.0) return -INFINITY;
    if (x == INFINITY) return x;
    int64_t extra = 0;
    if (x < 0x1p-1022) {
        x = x * 0x1p54;
        extra = -54;
    }
    uint64_t bits;
    memcpy(&bits, &x, sizeof bits);
    int64_t exponent = (int64_t)(bits >> 52) - 1023 + extra;
    bits = (bits & ((UINT64_C(1) << 52) - 1)) | (UINT64_C(1023) << 52);
    double m;
    memcpy(&m, &bits, sizeof m); /* in [1, 2) */
    if (m > 0x1.6a09e667f3bcdp+0) { /* sqrt(2) */
        m = m * 0.5;
        exponent += 1;
    }
    const double s = (m - 1.0) / (m + 1.0), s2 = s * s;
    double series = 1.0 / 23.0;
    for (int odd = 21; odd >= 1; odd -= 2) series = series * s2 + 1.0 / (double)odd;
    return (s * series) * 2.0 + (double)exponent * ln2;
}

/* sin(x) and cos(x) for |x| < 2^20 * pi/2 (the rotary tables' angles): k = nearest integer to
   x * 2/pi, r = x - k pi/2 with pi/2 in three parts (the first two of 33 significant bits, so k times
   them is exact), then Taylor polynomials of sin (to r^17) and cos (to r^18) on |r| <= pi/4 and the
   quadrant k mod 4. */
static inline void pm_sincos(double x, double *sin_out, double *cos_out) {
    const double two_over_pi = 0x1.45f306dc9c883p-1;
    const double pio2_1 = 0x1.921fb544p+0, pio2_2 = 0x1.0b4611a6p-34, pio2_3 = 0x1.3198a2e037073p-69;
    const double round_magic = 0x1.8p52;
    const double k = (x * two_over_pi + round_magic) - round_magic;
    const double r = ((x - k * pio2_1) - k * pio2_2) - k * pio2_3;
    const double r2 = r * r;
    double s = -1.0 / 355687428096000.0; /* -1/17! */
    s = s * r2 + 1.0 / 1307674368000.0;
    s = s * r2 - 1.0 / 6227020800.0;
    s = s * r2 + 1.0 / 39916800.0;
    s = s * r2 - 1.0 / 362880.0;
    s = s * r2 + 1.0 / 5040.0;
    s = s * r2 - 1.0 / 120.0;
    s = s * r2 + 1.0 / 6.0;
    const double sin_r = r - (r * r2) * s;
    double c = 1.0 / 6402373705728000.0; /* 1/18! */
    c = c * r2 - 1.0 / 20922789888000.0;
    c = c * r2 + 1.0 / 87178291200.0;
    c = c * r2 - 1.0 / 479001600.0;
    c = c * r2 + 1.0 / 3628800.0;
    c = c * r2 - 1.0 / 40320.0;
    c = c * r2 + 1.0 / 720.0;
    c = c * r2 - 1.0 / 24.0;
    c = c * r2 + 0.5;
    const double cos_r = 1.0 - r2 * c;
    switch ((int64_t)k & 3) {
        case 0: *sin_out = sin_r; *cos_out = cos_r; break;
        case 1: *sin_out = cos_r; *cos_out = -sin_r; break;
        case 2: *sin_out = -sin_r; *cos_out = -cos_r; break;
        default: *sin_out = -cos_r; *cos_out = sin_r; break;
    }
}

#endif
