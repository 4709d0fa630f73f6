/* Activation quantization of the quantized-weight GEMM (definitions in quant.h): every row of x is cut
   into blocks of 32 (or 256) values and each block is quantized to int8 from its own values only. All
   operations are exact except the two fp32 divisions and the product x_i * s, which are single IEEE
   operations, so the code below gives the same bytes whether the compiler vectorises it or not. */

#include "quant.h"

int xquant_alloc(xquant *xq, int64_t m, int64_t k, int block) {
    xq->k = k;
    xq->block = block;
    xq->q = malloc((size_t)(m * k) + 64);
    xq->d = malloc(sizeof(float) * (size_t)(m * (k / block) + 1));
    xq->s32 = malloc(sizeof(int32_t) * (size_t)(m * (k / 32) + 1));
    xq->sf = malloc(sizeof(float) * (size_t)(m * (k / 32) + 1));
    xq->s16 = block == SUPER ? malloc(sizeof(int32_t) * (size_t)(m * (k / 16) + 1)) : NULL;
    if (!xq->q || !xq->d || !xq->s32 || !xq->sf || (block == SUPER && !xq->s16)) {
        xquant_free(xq);
        return 1;
    }
    return 0;
}

void xquant_free(xquant *xq) {
    free(xq->q);
    free(xq->d);
    free(xq->s32);
    free(xq->sf);
    free(xq->s16);
    xq->q = NULL;
    xq->d = NULL;
    xq->s32 = NULL;
    xq->sf = NULL;
    xq->s16 = NULL;
}

/* values [0, n) of row r as fp32 (bf16 widened exactly) */
static inline void load_block(const void *x, int64_t offset, int n, int x_bf16, float *out) {
    if (x_bf16) {
        const uint16_t *src = (const uint16_t *)x + offset;
#if defined(DETINF_Q_AVX512)
        for (int i = 0; i < n; i += 16) { /* n is a multiple of 16 */
            const __m256i half = _mm256_loadu_si256((const __m256i *)(src + i));
            _mm512_storeu_si512(out + i, _mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
        }
#else
        for (int i = 0; i < n; i++) out[i] = bf16_to_f32(src[i]);
#endif
    } else {
        memcpy(out, (const float *)x + offset, sizeof(float) * (size_t)n);
    }
}

/* The largest |v_i| as a bit pattern (an unsigned max of the sign-cleared bits: exact, order free). */
static inline uint32_t amax_bits(const float *v, int n) {
#if defined(DETINF_Q_AVX512)
    __m512i best = _mm512_setzero_si512();
    for (int i = 0; i < n; i += 16)
        best = _mm512_max_epu32(best, _mm512_and_si512(_mm512_loadu_si512(v + i), _mm512_set1_epi32(0x7FFFFFFF)));
    return (uint32_t)_mm512_reduce_max_epu32(best);
#else
    uint32_t best = 0;
    for (int i = 0; i < n; i++) {
        const uint32_t bits = f32_bits(v[i]) & 0x7FFFFFFFu;
        best = bits > best ? bits : best;
    }
    return best;
#endif
}

/* q_i of one block given its largest |v| (bits); returns the block scale d. */
static inline float quantize_block(const float *v, int n, uint32_t amax, int8_t *q) {
    if (amax >= 0x7F800000u || amax < 0x03800000u) { /* not finite, or below 2^-120 */
        for (int i = 0; i < n; i++) q[i] = 0;
        const uint32_t nan_bits = 0x7FC00000u;
        float nan_value;
        memcpy(&nan_value, &nan_bits, sizeof nan_value);
        return amax >= 0x7F800000u ? nan_value : 0.0f;
    }
    float largest;
    memcpy(&largest, &amax, sizeof largest);
    const float s = 127.0f / largest;
#if defined(DETINF_Q_AVX512)
    /* the loop below 16 lanes at a time: v * s, + and - the magic, the clamp (r is never NaN here, so
       max / min select exactly what the comparisons do), truncation of an integer */
    const __m512 scale = _mm512_set1_ps(s), magic = _mm512_set1_ps(ROUND_MAGIC);
    for (int i = 0; i < n; i += 16) {
        __m512 r = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(v + i), scale), magic), magic);
        r = _mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(r)));
    }
#else
    for (int i = 0; i < n; i++) {
        float r = (v[i] * s + ROUND_MAGIC) - ROUND_MAGIC;
        r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
        q[i] = (int8_t)(int32_t)r;
    }
#endif
    return largest / 127.0f;
}

static inline int32_t sum_q(const int8_t *q, int n) {
#if defined(DETINF_Q_AVX512)
    __m512i sum = _mm512_setzero_si512(); /* n is 16 or 32; integer sums are exact in any order */
    for (int i = 0; i < n; i += 16)
        sum = _mm512_add_epi32(sum, _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + i))));
    return _mm512_reduce_add_epi32(sum);
#else
    int32_t sum = 0;
    for (int i = 0; i < n; i++) sum += q[i];
    return sum;
#endif
}

/* Row r: blocks of xq->block values; `shared_amax` (test hook only) replaces each block's own maximum. */
static void quantize_row(xquant *xq, const void *x, int64_t r, int x_bf16, const uint32_t *shared_amax) {
    const int64_t k = xq->k, blocks = k / xq->block;
    const int n = xq->block;
    float values[SUPER];
    for (int64_t b = 0; b < blocks; b++) {
        load_block(x, r * k + b * n, n, x_bf16, values);
        int8_t *q = xq->q + r * k + b * n;
        const uint32_t amax = shared_amax ? shared_amax[b] : amax_bits(values, n);
        xq->d[r * blocks + b] = quantize_block(values, n, amax, q);
    }
    for (int64_t i = 0; i < k / 32; i++) {
        xq->s32[r * (k / 32) + i] = sum_q(xq->q + r * k + i * 32, 32);
        xq->sf[r * (k / 32) + i] = (float)xq->s32[r * (k / 32) + i]; /* |sum| <= 4064: exact */
    }
    if (xq->s16)
        for (int64_t i = 0; i < k / 16; i++) xq->s16[r * (k / 16) + i] = sum_q(xq->q + r * k + i * 16, 16);
}

/* Negative-control hook: each block column's largest |x| over all m rows (what a batch-wide scale is). */
static uint32_t *batch_amax(const xquant *xq, const void *x, int64_t m, int x_bf16) {
    const int64_t blocks = xq->k / xq->block;
    uint32_t *shared = calloc((size_t)blocks + 1, sizeof(uint32_t));
    float values[SUPER];
    for (int64_t r = 0; shared && r < m; r++) {
        for (int64_t b = 0; b < blocks; b++) {
            load_block(x, r * xq->k + b * xq->block, xq->block, x_bf16, values);
            const uint32_t amax = amax_bits(values, xq->block);
            shared[b] = amax > shared[b] ? amax : shared[b];
        }
    }
    return shared;
}

/* Quantize rows [0, m) of x [m][k] (fp32, or bf16 when x_bf16). Rows are shared out between threads;
   each row is quantized whole, from its own values, by one thread. */
void xquant_rows(xquant *xq, const void *x, int64_t m, int x_bf16, int batch_scale) {
    uint32_t *shared = batch_scale ? batch_amax(xq, x, m, x_bf16) : NULL;
#pragma omp parallel for schedule(static) if (m * xq->k >= (int64_t)1 << 14)
    for (int64_t r = 0; r < m; r++) quantize_row(xq, x, r, x_bf16, shared);
    free(shared);
}

/* Rows [m, rows) as zeros (q = 0, d = 0, sums 0): the padding rows of the last AMX tile. They are computed
   and never stored; each output row depends on its own activation row only, so they change no output. */
void xquant_zero_rows(xquant *xq, int64_t m, int64_t rows) {
    if (rows <= m) return;
    const int64_t k = xq->k, blocks = k / xq->block;
    memset(xq->q + m * k, 0, (size_t)((rows - m) * k));
    memset(xq->d + m * blocks, 0, sizeof(float) * (size_t)((rows - m) * blocks));
    memset(xq->s32 + m * (k / 32), 0, sizeof(int32_t) * (size_t)((rows - m) * (k / 32)));
    memset(xq->sf + m * (k / 32), 0, sizeof(float) * (size_t)((rows - m) * (k / 32)));
    if (xq->s16) memset(xq->s16 + m * (k / 16), 0, sizeof(int32_t) * (size_t)((rows - m) * (k / 16)));
}
