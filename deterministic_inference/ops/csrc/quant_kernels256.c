/* AVX2 kernels of the quantized-weight GEMM: the same tiles as quant_kernels.c's AVX-512 ones on the same
   scratch, 8 output columns per 256-bit vector, performing exactly the float sequence of quant.h. The
   4-byte dot products use AVX-VNNI's VPDPBUSD where the build has it, else VPMADDUBSW + VPMADDWD, which
   is exact while each pair of products fits int16: true for weights below 64 (|2 * 63 * 127| < 2^15);
   Q8_0's stored bytes (up to 255) are split into nibbles, w = 16 hi + lo, two exact products. */

#include "quant.h"

#if defined(DETINF_Q_AVX2)

#define ROW_TILE256 4

/* acc + the 4-byte dot products of w (unsigned) and x (signed) per int32 lane, exactly */
INLINE __m256i dot4(__m256i acc, __m256i w, __m256i x, int wide) {
#if defined(__AVXVNNI__)
    (void)wide;
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
    const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(15);
    if (!wide) return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble), low = _mm256_and_si256(w, nibble);
    const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(high, x), _mm256_set1_epi16(16)),
                                         _mm256_madd_epi16(_mm256_maddubs_epi16(low, x), ones));
    return _mm256_add_epi32(acc, sum);
#endif
}

INLINE __m256i x_group8(const int8_t *x) {
    int32_t word;
    memcpy(&word, x, sizeof word);
    return _mm256_set1_epi32(word);
}

/* (float)v per lane: rounded by MXCSR, to nearest even, as the C conversion of the portable path */
INLINE __m256 to_float8(__m256i v) { return _mm256_cvtepi32_ps(v); }

/* rows [r0, r0 + R) x the 8 columns at `col` (0 or 8) of half p over a chunk of 32-value blocks; acc
   rows of 32 floats, this group's 8 at acc + col. */
INLINE void tile8_blocks(int64_t format, const xquant *xq, int64_t r0, const int R, int64_t u0, int64_t units,
                         const qpanel *p, int col, float *acc) {
    const int64_t k = xq->k, blocks = k / UNIT;
    const int32_t offset = format_offset(format);
    const int wide = format == Q8_0;
    __m256 f[ROW_TILE256];
    __m256i s[ROW_TILE256];
    for (int r = 0; r < R; r++) f[r] = _mm256_loadu_ps(acc + r * ACC_COLS + col);
    for (int64_t uu = 0; uu < units; uu++) {
        const int64_t u = u0 + uu;
        const int8_t *x = xq->q + r0 * k + u * UNIT;
        for (int r = 0; r < R; r++) s[r] = _mm256_set1_epi32(-offset * xq->s32[(r0 + r) * blocks + u]);
        for (int g = 0; g < 8; g++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(p->w + uu * UNIT_BYTES + g * 64 + col * 4));
            for (int r = 0; r < R; r++) s[r] = dot4(s[r], w, x_group8(x + r * k + 4 * g), wide);
        }
        const __m256 dw = _mm256_loadu_ps(p->d + uu * QCOLS + col);
        for (int r = 0; r < R; r++) {
            const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(xq->d[(r0 + r) * blocks + u]));
            f[r] = _mm256_fmadd_ps(scale, to_float8(s[r]), f[r]);
        }
        if (!format_has_min(format)) continue;
        const __m256 mw = _mm256_loadu_ps(p->m + uu * QCOLS + col);
        for (int r = 0; r < R; r++) {
            const __m256 scale = _mm256_mul_ps(mw, _mm256_set1_ps(xq->d[(r0 + r) * blocks + u]));
            f[r] = _mm256_fmadd_ps(scale, _mm256_set1_ps(xq->sf[(r0 + r) * blocks + u]), f[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(acc + r * ACC_COLS + col, f[r]);
}

/* one row's isum (sum_j sc_j dot_j) and msum (Q4_K, Q5_K) of super-block s, 8 columns at `col` */
INLINE void super8_sums(int64_t format, const xquant *xq, int64_t row, int64_t sb, int64_t s, const qpanel *p,
                        int col, __m256i *isum, __m256i *msum) {
    const int64_t k = xq->k;
    const int subs = format == Q6_K ? 16 : 8, groups = format == Q6_K ? 4 : 8;
    const int8_t *x = xq->q + row * k + s * SUPER;
    *isum = _mm256_setzero_si256();
    *msum = _mm256_setzero_si256();
    for (int j = 0; j < subs; j++) {
        __m256i t = format == Q6_K ? _mm256_set1_epi32(-32 * xq->s16[row * (k / 16) + s * 16 + j]) : _mm256_setzero_si256();
        for (int g = 0; g < groups; g++) {
            const uint8_t *w = p->w + sb * 8 * UNIT_BYTES + (j * groups + g) * 64 + col * 4;
            t = dot4(t, _mm256_loadu_si256((const __m256i *)w), x_group8(x + j * 4 * groups + 4 * g), 0);
        }
        const __m256i scale = _mm256_loadu_si256((const __m256i *)(p->sc + (sb * 16 + j) * QCOLS + col));
        *isum = _mm256_add_epi32(*isum, _mm256_mullo_epi32(t, scale));
        if (format == Q6_K) continue;
        const __m256i mins = _mm256_loadu_si256((const __m256i *)(p->mn + (sb * 8 + j) * QCOLS + col));
        *msum = _mm256_add_epi32(*msum, _mm256_mullo_epi32(mins, _mm256_set1_epi32(xq->s32[row * (k / 32) + s * 8 + j])));
    }
}

INLINE void row8_super(int64_t format, const xquant *xq, int64_t row, int64_t u0, int64_t units, const qpanel *p,
                       int col, float *acc) {
    const int64_t supers = xq->k / SUPER;
    __m256 f = _mm256_loadu_ps(acc + col);
    for (int64_t sb = 0; sb < units / 8; sb++) {
        const int64_t s = u0 / 8 + sb;
        __m256i isum, msum;
        super8_sums(format, xq, row, sb, s, p, col, &isum, &msum);
        const __m256 dx = _mm256_set1_ps(xq->d[row * supers + s]);
        f = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(p->d + sb * QCOLS + col), dx), to_float8(isum), f);
        if (format == Q6_K) continue;
        const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(p->m + sb * QCOLS + col), dx);
        f = _mm256_fnmadd_ps(scale, to_float8(msum), f); /* = fmaf(-scale, msum, f) */
    }
    _mm256_storeu_ps(acc + col, f);
}

static void tile8_any(int64_t format, const xquant *xq, int64_t r0, int R, int64_t u0, int64_t units,
                      const qpanel *p, int col, float *acc) {
    if (format >= Q4_K) {
        for (int r = 0; r < R; r++) row8_super(format, xq, r0 + r, u0, units, p, col, acc + r * ACC_COLS);
        return;
    }
    switch (R) {
        case 1: tile8_blocks(format, xq, r0, 1, u0, units, p, col, acc); break;
        case 2: tile8_blocks(format, xq, r0, 2, u0, units, p, col, acc); break;
        case 3: tile8_blocks(format, xq, r0, 3, u0, units, p, col, acc); break;
        default: tile8_blocks(format, xq, r0, 4, u0, units, p, col, acc); break;
    }
}

/* quant_kernels.c's kernel_rows for AVX2 builds: each half's two groups of 8 columns in turn */
void kernel_rows256(int64_t format, const xquant *xq, int64_t r0, int64_t count, int64_t u0, int64_t units,
                    const qpanel *p, int halves, float *acc) {
    for (int64_t r = 0; r < count; r += ROW_TILE256) {
        const int R = (int)(count - r < ROW_TILE256 ? count - r : ROW_TILE256);
        for (int h = 0; h < halves; h++)
            for (int col = 0; col < QCOLS; col += 8)
                tile8_any(format, xq, r0 + r, R, u0, units, &p[h], col, acc + r * ACC_COLS + h * QCOLS);
    }
}

#endif
