/* The quantized GEMM's path for a few rows (decode steps: M <= FUSED_ROWS), AVX-512 VNNI: each 16-column
   half of a panel is unpacked block by block into registers (quant512.h) and multiplied against every
   row at once, without the scratch round trip of the many-row path. Each output is still the float
   sequence of quant.h (blocks in ascending order, the same operations): only integer sums, which are
   exact, are formed differently. */

#include "quant512.h"

#if defined(DETINF_Q_AVX512)

/* 32-value formats: rows [0, R) x 16 columns, every block; acc rows of ACC_COLS floats */
INLINE void fused_blocks(int64_t format, const uint8_t *const *rows, int64_t row_bytes, const xquant *xq, const int R,
                         float *acc) {
    const int64_t k = xq->k, units = k / UNIT, bytes = format_block_bytes(format), ahead = ACC_COLS * row_bytes;
    const int32_t offset = format_offset(format);
    __m512 f[FUSED_ROWS];
    for (int r = 0; r < R; r++) f[r] = _mm512_setzero_ps(); /* acc = +0 */
    for (int64_t u0 = 0; u0 < units; u0 += 2) {
        const int count = units - u0 >= 2 ? 2 : 1;
        prefetch_rows(rows, u0 * bytes, ahead); /* every line: pairs of blocks advance <= 64 bytes (Q8_0: 68) */
        if (2 * bytes > 64) prefetch_rows(rows, u0 * bytes + 64, ahead);
        __m512i d[20];
        load_pair(format, rows, u0 * bytes, row_bytes, count, d);
#pragma GCC unroll 2
        for (int i = 0; i < count; i++) {
            const int64_t u = u0 + i;
            __m512i g[8];
            __m512 scale, min = _mm512_setzero_ps();
            pair_unit(format, d, i, g, &scale, &min);
            for (int r = 0; r < R; r++) {
                const __m512i init = _mm512_set1_epi32(-offset * xq->s32[r * units + u]);
                const __m512i isum = dot_groups(init, g, xq->q + r * k + u * UNIT, 8);
                const __m512 dx = _mm512_set1_ps(xq->d[r * units + u]);
                f[r] = _mm512_fmadd_ps(_mm512_mul_ps(scale, dx), as_float(isum), f[r]);
                if (format_has_min(format))
                    f[r] = _mm512_fmadd_ps(_mm512_mul_ps(min, dx), _mm512_set1_ps(xq->sf[r * units + u]), f[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(acc + r * ACC_COLS, f[r]);
}

/* isum[r] += sc * (dot of g with the activations at `at` of row r), `groups` groups of 4; for Q6_K
   (sums16: row 0's sum of q_x over the 16 values, rows k / 16 apart) the dot starts at -32 * that sum */
INLINE void add_sub_block(const xquant *xq, int64_t at, const __m512i *g, int groups, const int32_t *sc,
                          const int32_t *sums16, const int R, __m512i *isum) {
    const __m512i scale = _mm512_loadu_si512(sc);
    for (int r = 0; r < R; r++) {
        const __m512i first = _mm512_set1_epi32(sums16 ? -32 * sums16[r * (xq->k / 16)] : 0);
        const __m512i dot = dot_groups(first, g, xq->q + r * xq->k + at, groups);
        isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(dot, scale));
    }
}

/* isum[r] = sum_j sc_j dot_j over super-block s (its scales already in p, super-block 0) */
INLINE void fused_isum(int64_t format, const qsrc *src, int64_t base, const xquant *xq, int64_t s,
                       const qpanel *p, const int R, __m512i *isum) {
    for (int r = 0; r < R; r++) isum[r] = _mm512_setzero_si512();
    if (format == Q6_K) { /* unit j = the 16-value sub-blocks 2j (groups 0..3) and 2j + 1 (groups 4..7) */
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            __m512i qh[8];
            q6k_high_bits(src, base, h, qh);
#pragma GCC unroll 2
            for (int run = 0; run < 2; run++) {
                __m512i ql[8];
                q6k_low_bits(src, base, h, run, ql);
#pragma GCC unroll 2
                for (int t = run; t < 4; t += 2) {
                    __m512i g[8];
                    q6k_unit(ql, qh, t, g);
                    const int j = 4 * h + t;
                    const int32_t *sums16 = xq->s16 + s * 16 + 2 * j;
                    add_sub_block(xq, s * SUPER + 32 * j, g, 4, p->sc + 2 * j * QCOLS, sums16, R, isum);
                    add_sub_block(xq, s * SUPER + 32 * j + 16, g + 4, 4, p->sc + (2 * j + 1) * QCOLS, sums16 + 1, R,
                                  isum);
                }
            }
        }
        return;
    }
    __m512i qh[8];
    q45k_high_bits(format, src, base, qh);
    for (int t = 0; t < 4; t++) {
        __m512i raw[8];
        q45k_nibbles(format, src, base, t, raw);
        for (int high = 0; high < 2; high++) {
            __m512i g[8];
            q45k_unit(format, raw, qh, t, high, g);
            add_sub_block(xq, s * SUPER + 32 * (2 * t + high), g, 8, p->sc + (2 * t + high) * QCOLS, NULL, R, isum);
        }
    }
}

/* K formats: rows [0, R) x 16 columns, every super-block, from either source; acc rows of ACC_COLS
   floats. pf: what to ask the cache for (quant.h's pass_prefetch; the stored rows' path: own blocks only). */
INLINE void fused_super(int64_t format, const qsrc *src, int64_t row_bytes, const xquant *xq, const int R,
                        const pass_prefetch *pf, float *acc) {
    const int64_t k = xq->k, supers = k / SUPER, bytes = format_block_bytes(format), ahead = ACC_COLS * row_bytes;
    _Alignas(64) float d[QCOLS], m[QCOLS];
    _Alignas(64) int32_t sc[16 * QCOLS], mn[8 * QCOLS];
    qpanel p = {NULL, d, m, sc, mn}; /* one super-block's scales */
    __m512 f[FUSED_ROWS];
    __m512i isum[FUSED_ROWS];
    for (int r = 0; r < R; r++) f[r] = _mm512_setzero_ps(); /* acc = +0 */
    const int64_t share_step = next_share_step(pf, supers);
    for (int64_t s = 0; s < supers; s++) {
        if (pf->own) prefetch_super(format, src, s * bytes, 2, ahead); /* repacked: two super-blocks ahead */
        prefetch_next_share(pf, share_step, s);
        if (format == Q6_K) q6k_scales(src, s * bytes, 0, &p);
        else q45k_scales(src, s * bytes, 0, &p);
        fused_isum(format, src, s * bytes, xq, s, &p, R, isum);
        if (format == Q6_K) q6k_d(src, s * bytes, 0, &p);
        for (int r = 0; r < R; r++) {
            const __m512 dx = _mm512_set1_ps(xq->d[r * supers + s]);
            f[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_load_ps(d), dx), as_float(isum[r]), f[r]);
            if (format == Q6_K) continue;
            __m512i msum = _mm512_setzero_si512();
            for (int j = 0; j < 8; j++) {
                const __m512i sums = _mm512_set1_epi32(xq->s32[r * (k / 32) + s * 8 + j]);
                msum = _mm512_add_epi32(msum, _mm512_mullo_epi32(_mm512_load_si512(mn + j * QCOLS), sums));
            }
            f[r] = _mm512_fnmadd_ps(_mm512_mul_ps(_mm512_load_ps(m), dx), as_float(msum), f[r]); /* fmaf(-a, b, f) */
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(acc + r * ACC_COLS, f[r]);
}

/* Rows [0, m) (m <= FUSED_ROWS) of one 16-column half whose columns read rows[0..16); acc [m][ACC_COLS]
   at the half's first column. Each format and row count gets its own code, constants folded. */
void fused_half_avx512(int64_t format, const uint8_t *const *rows, int64_t row_bytes, const xquant *xq, int64_t m,
                       float *acc) {
    const qsrc src = {rows, NULL, 0};
    const pass_prefetch own = {1, NULL, 0};
#define DETINF_FUSED(fmt, rows_)                                                                   \
    if (format == fmt && m == rows_) {                                                             \
        if (fmt >= Q4_K) fused_super(fmt, &src, row_bytes, xq, rows_, &own, acc);                  \
        else fused_blocks(fmt, rows, row_bytes, xq, rows_, acc);                                   \
        return;                                                                                    \
    }
#define DETINF_FUSED_FORMAT(fmt) DETINF_FUSED(fmt, 1) DETINF_FUSED(fmt, 2) DETINF_FUSED(fmt, 3) DETINF_FUSED(fmt, 4)
    DETINF_FUSED_FORMAT(Q4_0) DETINF_FUSED_FORMAT(Q4_1) DETINF_FUSED_FORMAT(Q5_0) DETINF_FUSED_FORMAT(Q5_1)
    DETINF_FUSED_FORMAT(Q8_0) DETINF_FUSED_FORMAT(Q4_K) DETINF_FUSED_FORMAT(Q5_K) DETINF_FUSED_FORMAT(Q6_K)
#undef DETINF_FUSED_FORMAT
#undef DETINF_FUSED
}

/* The same for a repacked Q4_K / Q5_K / Q6_K half panel (quant_repack.c): the same vectors, so the same bits */
void fused_k_x16_avx512(int64_t format, const uint8_t *panel, const xquant *xq, int64_t m, const pass_prefetch *pf,
                        float *acc) {
    const qsrc src = {NULL, panel, xq->k / SUPER};
#define DETINF_FUSED_K(fmt, rows_)                                                                 \
    if (format == fmt && m == rows_) {                                                             \
        fused_super(fmt, &src, 0, xq, rows_, pf, acc);                                             \
        return;                                                                                    \
    }
    DETINF_FUSED_K(Q4_K, 1) DETINF_FUSED_K(Q4_K, 2) DETINF_FUSED_K(Q4_K, 3) DETINF_FUSED_K(Q4_K, 4)
    DETINF_FUSED_K(Q5_K, 1) DETINF_FUSED_K(Q5_K, 2) DETINF_FUSED_K(Q5_K, 3) DETINF_FUSED_K(Q5_K, 4)
    DETINF_FUSED_K(Q6_K, 1) DETINF_FUSED_K(Q6_K, 2) DETINF_FUSED_K(Q6_K, 3) DETINF_FUSED_K(Q6_K, 4)
#undef DETINF_FUSED_K
}

#endif
