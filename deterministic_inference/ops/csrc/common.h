/* Helpers shared by the kernels of deterministic-inference (attention.c, rowwise.c): bf16 conversions,
   the fixed-order lane sum and the polynomial exp. Every function is a fixed sequence of IEEE float
   operations, so its bits depend on this source alone (see attention.c for the build flags). */

#ifndef DETINF_COMMON_H
#define DETINF_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#define LANES 16

/* Whether a row-wise kernel shares its `rows` rows of `per_row` values out between the OpenMP threads (each
   row is computed whole by one thread either way, so this changes speed, never a bit): from two rows and
   ROWWISE_PARALLEL_VALUES values. The earlier rule, 32 rows or more, left a decode step of 31 streams on
   one thread. */
#define ROWWISE_PARALLEL_VALUES 8192
static inline int rowwise_parallel(int64_t rows, int64_t per_row) {
    return rows >= 2 && rows * per_row >= ROWWISE_PARALLEL_VALUES;
}

#if defined(__AMX_TILE__)
/* What ldtilecfg reads (palette 1: per tile its bytes per row and rows). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tile_config;
/* quant_amx.c: 1 when this process may use the AMX tiles (the kernel asked once per process), else 0. */
int amx_usable(void);
#endif

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* Round to nearest even, NaN -> quiet NaN 0x7FC0: the same rule as torch's BFloat16. */
static inline uint16_t f32_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* lanes[0] + ... + lanes[15] by a fixed tree: (0+8, 1+9, ...), then (0+4, ...), (0+2, ...), (0+1). */
static inline float lane_tree(float *lanes) {
    for (int width = LANES / 2; width >= 1; width /= 2) {
        for (int l = 0; l < width; l++) lanes[l] = lanes[l] + lanes[l + width];
    }
    return lanes[0];
}

/* x[0] + ... + x[n-1]: element i goes to lane i % 16 (ascending), then lane_tree. */
static inline float lane_sum(const float *x, int64_t n) {
    float lanes[LANES] = {0};
    int64_t base = 0;
    for (; base + LANES <= n; base += LANES) {
        for (int l = 0; l < LANES; l++) lanes[l] = lanes[l] + x[base + l];
    }
    for (int l = 0; base + l < n; l++) lanes[l] = lanes[l] + x[base + l];
    return lane_tree(lanes);
}

/* One step of exp_in_range: a * b + c with one rounding. DETINF_TEST_SEPARATE_STEPS (set only by the
   tests' negative controls, never by the package) rounds the product and the sum apart, as revision 9 did:
   a build whose exp differs by an ulp now and then, which the build comparisons must see. */
#if defined(DETINF_TEST_SEPARATE_STEPS)
#define EXP_STEP(a, b, c) ((a) * (b) + (c))
#else
#define EXP_STEP(a, b, c) fmaf(a, b, c)
#endif

/* exp(x) for x in [-87, 88] (callers clamp): x = n ln2 + r, |r| <= ln2/2, exp(r) by a degree-7
   Horner polynomial, times 2^n built from the exponent bits. Every step is one fused multiply-add
   (fmaf: one rounding; a vfmadd lane where the build has FMA, libm's correctly rounded fmaf where it
   has not, so the bits are the same), 11 of them where separate products and sums took 20 roundings:
   the softmax of a long prompt's attention spends a fifth of its time here. Relative error about 1e-7. */
/* 1.5 * 2^23: for |v| < 2^22, (v + ROUND_MAGIC) - ROUND_MAGIC is v rounded to an integer, ties even */
#define ROUND_MAGIC 12582912.0f
/* exp_in_range's constants (attention.h's 16-lane twin uses them too) */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693145751953125f      /* 15 significant bits: n * EXP_LN2_HI is exact for |n| < 2^9 */
#define EXP_LN2_LO 1.428606765330187045e-06f

static inline float exp_in_range(float x) {
    const float n = EXP_STEP(x, EXP_LOG2E, ROUND_MAGIC) - ROUND_MAGIC; /* the subtraction is exact */
    const float r = EXP_STEP(-n, EXP_LN2_LO, EXP_STEP(-n, EXP_LN2_HI, x));
    float p = 1.0f / 5040.0f;
    p = EXP_STEP(p, r, 1.0f / 720.0f);
    p = EXP_STEP(p, r, 1.0f / 120.0f);
    p = EXP_STEP(p, r, 1.0f / 24.0f);
    p = EXP_STEP(p, r, 1.0f / 6.0f);
    p = EXP_STEP(p, r, 0.5f);
    p = EXP_STEP(p, r, 1.0f);
    p = EXP_STEP(p, r, 1.0f);
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* The first min(left, 16) lanes of a 16-lane operation (a row's tail under a mask). */
static inline __mmask16 lane_mask16(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
}

/* f32_to_bf16 of 16 lanes (round to nearest even, a NaN to 0x7FC0), in the low 16 bits of each lane. */
static inline __m512i bf16_bits16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_blend_epi32(nan, _mm512_srli_epi32(rounded, 16), _mm512_set1_epi32(0x7FC0));
}
#endif

#if defined(__AVX512F__) && !defined(DETINF_TEST_SEPARATE_STEPS)

/* exp_in_range of 16 lanes, each lane exactly its operations: the same fused multiply-adds, the
   truncation of the integer-valued n, and p * 2^n (VSCALEFPS rounds the exact product p * 2^n once, as
   the multiplication by the float 2^n does; 2^n is a normal float for every n here). */
static inline __m512 exp16_in_range(__m512 x) {
    const __m512 magic = _mm512_set1_ps(ROUND_MAGIC);
    const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(EXP_LOG2E), magic), magic);
    const __m512 r_hi = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r_hi);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.0f / 5040.0f), r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

/* exp(x) for any float x, clamped to [-87, 88] where exp stays a normal float. */
static inline float exp_clamped(float x) { return exp_in_range(x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x)); }

/* tanh(u) = sign(u) (1 - e) / (1 + e) with e = exp(-2 |u|) (exp_clamped: e stops at its smallest value
   for large |u|, where the quotient rounds to 1), u's sign copied (so tanh(-0) = -0). About 1e-7 absolute
   error; every operation a fixed IEEE one, so the same bits on every CPU. */
static inline float tanh_portable(float u) {
    const float e = exp_clamped(-2.0f * fabsf(u));
    return copysignf((1.0f - e) / (1.0f + e), u);
}

#endif
