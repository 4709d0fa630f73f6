/* Attention over bf16 caches: the products go in pairs through VDPBF16PS (AVX512-BF16), which does 32
   multiply-adds per instruction where the fp32 path's FMA does 16, so the quadratic part of a long
   prefill takes about half the time.

   The arithmetic of one output row, fixed by this source (see attention.c for the rest of the row):
     q2[d]   = bf16(q[d])                      round to nearest even (f32_to_bf16)
     s_j     = pairs over d = (0,1), (2,3), ...: s = dpbf16_lane(s, q2[2m], q2[2m+1], k_j[2m], k_j[2m+1]),
               from +0 (common.h: the odd product first, then the even one, each a fused multiply-add
               with denormals flushed); an odd head_dim pairs its last d with a zero
     score_j = s_j * scale
     p_j     = bf16(exp(max(score_j - m, -87)))  the weights rounded to bf16, as FlashAttention does
     l       = sum_j p_j                       the rounded weights, 16 lane partial sums then the tree
     acc[d]  = pairs over keys = (0,1), (2,3), ...: dpbf16_lane(acc[d], p_2m, p_2m+1, v_2m[d], v_2m+1[d]),
               from +0; a row with an odd number of keys pairs its last key with p = 0, v = 0
     out[d]  = acc[d] / l
   A pair never leaves the row's own keys and data (the padding is zeros, never a cache slot past the
   row's last key, which may hold anything), so the row-independence argument of attention.c holds
   unchanged. With AVX512-BF16 the pair step is the instruction; elsewhere dpbf16_lane's operations lane
   by lane (tests compare the builds bit for bit). The weights are kept packed in place of their scores:
   the 16 weights of a 16-key group as 8 bf16 pairs in the group's first 32 bytes. */

#include "attention.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
typedef __m512bh pairs16; /* 16 lanes of (even, odd) bf16 pairs */

/* Word 2l <- word l, word 2l+1 <- word 16 + l: two 16-element rows into 16 (row0[l], row1[l]) pairs. */
static const uint16_t interleave_words[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                              8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

INLINE pairs16 interleave(__m512i rows) {
    return (pairs16)_mm512_permutexvar_epi16(_mm512_loadu_si512(interleave_words), rows);
}

/* Lane l = (even[l], odd[l]); odd == NULL: zeros (the padding of an odd key count). */
INLINE pairs16 load_pairs(const uint16_t *even, const uint16_t *odd) {
    const __m512i low = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)even));
    if (odd == NULL) return interleave(low);
    return interleave(_mm512_inserti64x4(low, _mm256_loadu_si256((const __m256i *)odd), 1));
}

INLINE f32x16 pair_step(f32x16 acc, uint32_t pair, pairs16 b) {
    return (f32x16)_mm512_dpbf16_ps((__m512)acc, (__m512bh)_mm512_set1_epi32((int)pair), b);
}
#else
typedef struct {
    f32x16 even, odd; /* widened to fp32, denormals flushed */
} pairs16;

INLINE f32x16 flush16(f32x16 value) {
    u32x16 bits;
    memcpy(&bits, &value, sizeof bits);
    const u32x16 tiny = (u32x16)((bits & 0x7F800000u) == 0); /* all ones where the exponent is 0 */
    bits &= ~(tiny & 0x007FFFFFu);
    memcpy(&value, &bits, sizeof value);
    return value;
}

INLINE pairs16 load_pairs(const uint16_t *even, const uint16_t *odd) {
    pairs16 pairs = {flush16(load16(even, 0, 1)), {0}};
    if (odd != NULL) pairs.odd = flush16(load16(odd, 0, 1));
    return pairs;
}

/* dpbf16_lane in 16 lanes (the same operations, so the same bits as the instruction). */
INLINE f32x16 pair_step(f32x16 acc, uint32_t pair, pairs16 b) {
    const float a_even = flush_denormal(bf16_to_f32((uint16_t)(pair & 0xFFFFu)));
    const float a_odd = flush_denormal(bf16_to_f32((uint16_t)(pair >> 16)));
    const f32x16 odd = flush16(fma16(a_odd, b.odd, flush16(acc)));
    return flush16(fma16(a_even, b.even, odd));
}
#endif

/* q2[2m] | q2[2m+1] << 16 for the pair m of an fp32 query row (an odd dim pairs its last d with 0). */
__attribute__((visibility("hidden"))) uint32_t detinf_query_pair(const float *q, int64_t m, int64_t dim) {
    const uint32_t odd = 2 * m + 1 < dim ? f32_to_bf16(q[2 * m + 1]) : 0;
    return f32_to_bf16(q[2 * m]) | odd << 16;
}

/* Scores of n rows (literal) against one 16-key block of the transposed key cache (rows d of 16 keys,
   so the rows 2m and 2m+1 are one 64-byte line): qt[m * n + i] is row i's query pair m. */
INLINE void pair_scores_n(int n, const uint32_t *qt, const uint16_t *keys_t, int64_t dim, float scale,
                          float *scores) {
    f32x16 lanes[MAX_SHARED_ROWS];
#pragma GCC unroll 12
    for (int i = 0; i < n; i++) lanes[i] = (f32x16){0};
    for (int64_t m = 0; m < dim / 2; m++) {
        const pairs16 k = load_pairs(keys_t + 2 * m * 16, keys_t + (2 * m + 1) * 16);
#pragma GCC unroll 12
        for (int i = 0; i < n; i++) lanes[i] = pair_step(lanes[i], qt[m * n + i], k);
    }
#pragma GCC unroll 12
    for (int i = 0; i < n; i++) {
        const f32x16 scaled = lanes[i] * scale;
        memcpy(scores + i * 16, &scaled, sizeof scaled);
    }
}

/* Value sums of n rows (literal) over keys 0..end-1 of one block (rows of dim values): row i's packed
   weights are the 8 words at p + i * 16 (read as pairs), its sums acc[i * dim + d]. */
INLINE void pair_values_n(int n, const float *p, const uint16_t *values, int64_t end, int64_t dim, float *acc) {
    for (int64_t d = 0; d < dim; d += 16) {
        f32x16 sums[MAX_SHARED_ROWS];
#pragma GCC unroll 12
        for (int i = 0; i < n; i++) memcpy(&sums[i], acc + i * dim + d, sizeof sums[i]);
        for (int64_t m = 0; 2 * m < end; m++) {
            const uint16_t *even = values + 2 * m * dim + d;
            const pairs16 v = load_pairs(even, 2 * m + 1 < end ? even + dim : NULL);
#pragma GCC unroll 12
            for (int i = 0; i < n; i++) {
                uint32_t pair;
                memcpy(&pair, p + i * 16 + m, sizeof pair);
                sums[i] = pair_step(sums[i], pair, v);
            }
        }
#pragma GCC unroll 12
        for (int i = 0; i < n; i++) memcpy(acc + i * dim + d, &sums[i], sizeof sums[i]);
    }
}

#define PAIR_SCORES_CASE(N) \
    case N: pair_scores_n(N, qt, keys_t, dim, scale, scores); break;
#define PAIR_VALUES_CASE(N)                                                  \
    case N:                                                                  \
        if (end == 16) pair_values_n(N, p, values, 16, dim, acc);            \
        else pair_values_n(N, p, values, end, dim, acc);                     \
        break;

__attribute__((visibility("hidden"))) void detinf_pair_scores16(int n, const uint32_t *qt, const uint16_t *keys_t,
                                                                int64_t dim, float scale, float *scores) {
    switch (n) {
        CASES_1_TO_12(PAIR_SCORES_CASE)
    default: break;
    }
}

__attribute__((visibility("hidden"))) void detinf_pair_values16(int n, const float *p, const uint16_t *values,
                                                                int64_t end, int64_t dim, float *acc) {
    switch (n) {
        CASES_1_TO_12(PAIR_VALUES_CASE)
    default: break;
    }
}

/* Weight of key j of a row whose weights exp_sum_pairs packed (16-key groups, contiguous). */
static inline float packed_weight(const float *scores, int64_t j) {
    uint16_t weight;
    memcpy(&weight, (const char *)(scores + (j / LANES) * LANES) + (j % LANES) * sizeof weight, sizeof weight);
    return bf16_to_f32(weight);
}

/* Key j of the row's sequence: its element d is at [d * block] (keys are transposed in a block). */
static inline const uint16_t *key_at(const attention_args *a, const int64_t *table, int64_t kvh, int64_t j) {
    return (const uint16_t *)a->k_cache + (table[j / a->block] * a->kv_heads + kvh) * a->head_dim * a->block +
           j % a->block;
}

static inline const uint16_t *value_at(const attention_args *a, const int64_t *table, int64_t kvh, int64_t j) {
    return (const uint16_t *)a->v_cache + ((table[j / a->block] * a->kv_heads + kvh) * a->block + j % a->block) *
                                              a->head_dim;
}

/* The definition at the top of this file, scalar, for the shapes the tile kernels do not take. */
__attribute__((visibility("hidden"))) float detinf_pair_row(const attention_args *a, int64_t r, int64_t h,
                                                            int64_t kvh, float *scores, float *acc) {
    const int64_t dim = a->head_dim, keys = a->row_keys[r], block = a->block;
    const int64_t *table = a->block_ids + a->row_table[r];
    const float *q = a->q + (r * a->heads + h) * dim;
    for (int64_t j = 0; j < keys; j++) {
        const uint16_t *k = key_at(a, table, kvh, j);
        float s = 0.0f;
        for (int64_t m = 0; 2 * m < dim; m++) {
            const uint32_t pair = detinf_query_pair(q, m, dim);
            const float k_odd = 2 * m + 1 < dim ? bf16_to_f32(k[(2 * m + 1) * block]) : 0.0f;
            s = dpbf16_lane(s, bf16_to_f32((uint16_t)(pair & 0xFFFFu)), bf16_to_f32((uint16_t)(pair >> 16)),
                            bf16_to_f32(k[2 * m * block]), k_odd);
        }
        scores[j] = s * a->scale;
    }
    const float total = exp_sum_pairs(scores, keys, LANES);
    for (int64_t d = 0; d < dim; d++) acc[d] = 0.0f;
    for (int64_t m = 0; 2 * m < keys; m++) {
        const uint16_t *even = value_at(a, table, kvh, 2 * m);
        const uint16_t *odd = 2 * m + 1 < keys ? value_at(a, table, kvh, 2 * m + 1) : NULL;
        const float p_even = packed_weight(scores, 2 * m);
        const float p_odd = odd != NULL ? packed_weight(scores, 2 * m + 1) : 0.0f;
        for (int64_t d = 0; d < dim; d++)
            acc[d] = dpbf16_lane(acc[d], p_even, p_odd, bf16_to_f32(even[d]), odd != NULL ? bf16_to_f32(odd[d]) : 0.0f);
    }
    return total;
}
