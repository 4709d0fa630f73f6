/* Inner kernels of the quantized-weight GEMM: a tile of activation rows against one unpacked chunk of a
   16-column panel (quant_unpack.c), performing exactly the float sequence defined in quant.h. The
   integer dot products are exact whatever order they are added in; each path then performs the same
   fp32 operations per output (vector lanes are output columns, never partial sums of one output).
   Paths: AVX-512 VNNI (VPDPBUSD: unsigned weight bytes x signed activation bytes, 4 products per int32
   lane), AVX2 (quant_kernels256.c, whole row counts at once), portable C below. */

#include "quant512.h" /* x_word, as_float */

#if defined(DETINF_Q_AVX512)
#define ROW_TILE 4 /* rows per register tile, times 2 halves of 16 columns (accumulators: 3 x 8 zmm at most) */
#elif defined(DETINF_Q_AVX2)
#define ROW_TILE 64 /* kernel_rows256 tiles the rows itself */
#else
#define ROW_TILE 1
#endif

/* ---------------------------------------------------------------- portable C: one row at a time */

INLINE int32_t group_dot(const uint8_t *w, int c, const int8_t *x) {
    int32_t sum = 0;
    for (int b = 0; b < 4; b++) sum += (int32_t)w[c * 4 + b] * x[b];
    return sum;
}

/* sum over groups [g0, g1) of unit `w` (scratch) for column c, against activations x (the unit's) */
INLINE int32_t unit_dot(const uint8_t *w, int c, const int8_t *x, int g0, int g1) {
    int32_t sum = 0;
    for (int g = g0; g < g1; g++) sum += group_dot(w + g * 64, c, x + 4 * g);
    return sum;
}

static void row_blocks_c(int64_t format, const xquant *xq, int64_t row, int64_t u0, int64_t units,
                         const qpanel *p, float *acc) {
    const int64_t k = xq->k, blocks = k / UNIT;
    const int32_t offset = format_offset(format);
    for (int64_t uu = 0; uu < units; uu++) {
        const int64_t u = u0 + uu;
        const int8_t *x = xq->q + row * k + u * UNIT;
        const float dx = xq->d[row * blocks + u];
        const int32_t sx = xq->s32[row * blocks + u];
        for (int c = 0; c < QCOLS; c++) {
            const int32_t isum = unit_dot(p->w + uu * UNIT_BYTES, c, x, 0, 8) - offset * sx;
            acc[c] = fmaf(p->d[uu * QCOLS + c] * dx, (float)isum, acc[c]);
            if (format_has_min(format)) acc[c] = fmaf(p->m[uu * QCOLS + c] * dx, (float)sx, acc[c]);
        }
    }
}

static void row_super_c(int64_t format, const xquant *xq, int64_t row, int64_t u0, int64_t units,
                        const qpanel *p, float *acc) {
    const int64_t k = xq->k;
    for (int64_t sb = 0; sb < units / 8; sb++) {
        const int64_t s = u0 / 8 + sb;
        const int8_t *x = xq->q + row * k + s * SUPER;
        const float dx = xq->d[row * (k / SUPER) + s];
        for (int c = 0; c < QCOLS; c++) {
            int32_t isum = 0, msum = 0;
            for (int j = 0; j < (format == Q6_K ? 16 : 8); j++) {
                const int32_t scale = p->sc[(sb * 16 + j) * QCOLS + c];
                if (format == Q6_K) {
                    const uint8_t *unit = p->w + (sb * 8 + j / 2) * UNIT_BYTES;
                    const int32_t dot = unit_dot(unit, c, x + 32 * (j / 2), 4 * (j % 2), 4 * (j % 2) + 4);
                    isum += scale * (dot - 32 * xq->s16[row * (k / 16) + s * 16 + j]);
                } else {
                    isum += scale * unit_dot(p->w + (sb * 8 + j) * UNIT_BYTES, c, x + 32 * j, 0, 8);
                    msum += p->mn[(sb * 8 + j) * QCOLS + c] * xq->s32[row * (k / 32) + s * 8 + j];
                }
            }
            acc[c] = fmaf(p->d[sb * QCOLS + c] * dx, (float)isum, acc[c]);
            if (format != Q6_K) acc[c] = fmaf(-(p->m[sb * QCOLS + c] * dx), (float)msum, acc[c]);
        }
    }
}

/* ---------------------------------------------------------------- AVX-512 VNNI: R rows x 16 columns */
#if defined(DETINF_Q_AVX512)

/* The per-row factors of a tile's rows over units [u0, u0 + units) (units <= CHUNK_UNITS), copied side by
   side so that one pointer reaches them all: the activation scale d, the integer correction of the
   format's offset (-offset * s32, as the scalar sequence computes it: int32, exact) and sf. Copies only. */
typedef struct {
    float d[ROW_TILE][CHUNK_UNITS];
    int32_t corr[ROW_TILE][CHUNK_UNITS];
    float sf[ROW_TILE][CHUNK_UNITS];
} block_factors;

INLINE void gather_factors(const xquant *xq, int64_t r0, const int R, int64_t u0, int64_t units, int32_t offset,
                           block_factors *bf) {
    const int64_t blocks = xq->k / UNIT;
    const __mmask16 mask = (__mmask16)((1u << units) - 1u);
    for (int r = 0; r < R; r++) {
        const int64_t at = (r0 + r) * blocks + u0;
        _mm512_storeu_ps(bf->d[r], _mm512_maskz_loadu_ps(mask, xq->d + at));
        const __m512i sums = _mm512_maskz_loadu_epi32(mask, xq->s32 + at);
        _mm512_storeu_si512(bf->corr[r], _mm512_mullo_epi32(sums, _mm512_set1_epi32(-offset)));
        _mm512_storeu_ps(bf->sf[r], _mm512_maskz_loadu_ps(mask, xq->sf + at));
    }
}

/* rows [r0, r0 + R) x H halves of 16 columns (p[0], p[1]) over a chunk of 32-value blocks; acc [R][32].
   Each integer sum runs as two chains of 4 VPDPBUSD (groups 0..3 and 4..7) added at the end, not one of 8:
   exact integers, so the same sum, and half the dependent latency per unit (AMD Zen 4, weights read from
   memory: Q4_0 1.01-1.05x at 128-425 rows). The second set of chains needs the registers the rows'
   pointers took, hence block_factors. */
INLINE void tile_blocks(int64_t format, const xquant *xq, int64_t r0, const int R, const int H, int64_t u0,
                        int64_t units, const qpanel *p, float *acc) {
    const int64_t k = xq->k;
    block_factors bf;
    gather_factors(xq, r0, R, u0, units, format_offset(format), &bf);
    __m512 f[2][ROW_TILE];
    __m512i s[2][ROW_TILE];
    for (int h = 0; h < H; h++)
        for (int r = 0; r < R; r++) f[h][r] = _mm512_loadu_ps(acc + r * ACC_COLS + h * QCOLS);
    for (int64_t uu = 0; uu < units; uu++) {
        const int8_t *x = xq->q + r0 * k + (u0 + uu) * UNIT;
        __m512i s2[2][ROW_TILE]; /* groups 4..7 */
        for (int r = 0; r < R; r++)
            for (int h = 0; h < H; h++) s[h][r] = s2[h][r] = _mm512_setzero_si512();
        for (int g = 0; g < 4; g++) {
            __m512i w[2], w2[2];
            for (int h = 0; h < H; h++) {
                const __m512i *unit = (const __m512i *)(p[h].w + uu * UNIT_BYTES);
                w[h] = _mm512_load_si512(unit + g);
                w2[h] = _mm512_load_si512(unit + g + 4);
            }
            for (int r = 0; r < R; r++) {
                const __m512i xg = x_word(x + r * k + 4 * g), xg2 = x_word(x + r * k + 4 * g + 16);
                for (int h = 0; h < H; h++) s[h][r] = _mm512_dpbusd_epi32(s[h][r], w[h], xg);
                for (int h = 0; h < H; h++) s2[h][r] = _mm512_dpbusd_epi32(s2[h][r], w2[h], xg2);
            }
        }
        for (int r = 0; r < R; r++) {
            const __m512i correction = _mm512_set1_epi32(bf.corr[r][uu]);
            for (int h = 0; h < H; h++) s[h][r] = _mm512_add_epi32(s[h][r], _mm512_add_epi32(s2[h][r], correction));
        }
        for (int h = 0; h < H; h++) {
            const __m512 dw = _mm512_loadu_ps(p[h].d + uu * QCOLS);
            for (int r = 0; r < R; r++) {
                const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(bf.d[r][uu]));
                f[h][r] = _mm512_fmadd_ps(scale, as_float(s[h][r]), f[h][r]);
            }
            if (!format_has_min(format)) continue;
            const __m512 mw = _mm512_loadu_ps(p[h].m + uu * QCOLS);
            for (int r = 0; r < R; r++) {
                const __m512 scale = _mm512_mul_ps(mw, _mm512_set1_ps(bf.d[r][uu]));
                f[h][r] = _mm512_fmadd_ps(scale, _mm512_set1_ps(bf.sf[r][uu]), f[h][r]);
            }
        }
    }
    for (int h = 0; h < H; h++)
        for (int r = 0; r < R; r++) _mm512_storeu_ps(acc + r * ACC_COLS + h * QCOLS, f[h][r]);
}

/* sum_j sc_j * dot_j over one super-block's sub-blocks (Q4_K, Q5_K: 8 of 32 values; Q6_K: 16 of 16) */
INLINE void super_isum(int64_t format, const xquant *xq, int64_t r0, const int R, const int H, int64_t sb,
                       int64_t s, const qpanel *p, __m512i isum[2][ROW_TILE]) {
    const int64_t k = xq->k;
    const int subs = format == Q6_K ? 16 : 8, groups = format == Q6_K ? 4 : 8;
    __m512i t[2][ROW_TILE];
    for (int h = 0; h < H; h++)
        for (int r = 0; r < R; r++) isum[h][r] = _mm512_setzero_si512();
    for (int j = 0; j < subs; j++) {
        const int8_t *x = xq->q + r0 * k + s * SUPER + j * 4 * groups;
        for (int r = 0; r < R; r++) {
            const __m512i init = format == Q6_K ? _mm512_set1_epi32(-32 * xq->s16[(r0 + r) * (k / 16) + s * 16 + j])
                                                : _mm512_setzero_si512();
            for (int h = 0; h < H; h++) t[h][r] = init;
        }
        for (int g = 0; g < groups; g++) {
            __m512i w[2];
            for (int h = 0; h < H; h++)
                w[h] = _mm512_load_si512((const __m512i *)(p[h].w + sb * 8 * UNIT_BYTES) + j * groups + g);
            for (int r = 0; r < R; r++) {
                const __m512i xg = x_word(x + r * k + 4 * g);
                for (int h = 0; h < H; h++) t[h][r] = _mm512_dpbusd_epi32(t[h][r], w[h], xg);
            }
        }
        for (int h = 0; h < H; h++) {
            const __m512i scale = _mm512_loadu_si512(p[h].sc + (sb * 16 + j) * QCOLS);
            for (int r = 0; r < R; r++) isum[h][r] = _mm512_add_epi32(isum[h][r], _mm512_mullo_epi32(t[h][r], scale));
        }
    }
}

/* msum = sum_j m_j * (sum of q_x over sub-block j), for Q4_K / Q5_K */
INLINE __m512i super_msum(const xquant *xq, int64_t row, int64_t sb, int64_t s, const qpanel *p) {
    __m512i msum = _mm512_setzero_si512();
    for (int j = 0; j < 8; j++) {
        const __m512i sums = _mm512_set1_epi32(xq->s32[row * (xq->k / 32) + s * 8 + j]);
        msum = _mm512_add_epi32(msum, _mm512_mullo_epi32(_mm512_loadu_si512(p->mn + (sb * 8 + j) * QCOLS), sums));
    }
    return msum;
}

INLINE void tile_super(int64_t format, const xquant *xq, int64_t r0, const int R, const int H, int64_t u0,
                       int64_t units, const qpanel *p, float *acc) {
    const int64_t supers = xq->k / SUPER;
    __m512 f[2][ROW_TILE];
    __m512i isum[2][ROW_TILE];
    for (int h = 0; h < H; h++)
        for (int r = 0; r < R; r++) f[h][r] = _mm512_loadu_ps(acc + r * ACC_COLS + h * QCOLS);
    for (int64_t sb = 0; sb < units / 8; sb++) {
        const int64_t s = u0 / 8 + sb;
        super_isum(format, xq, r0, R, H, sb, s, p, isum);
        for (int h = 0; h < H; h++) {
            const __m512 dw = _mm512_loadu_ps(p[h].d + sb * QCOLS);
            for (int r = 0; r < R; r++) {
                const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(xq->d[(r0 + r) * supers + s]));
                f[h][r] = _mm512_fmadd_ps(scale, as_float(isum[h][r]), f[h][r]);
            }
            if (format == Q6_K) continue;
            const __m512 mw = _mm512_loadu_ps(p[h].m + sb * QCOLS);
            for (int r = 0; r < R; r++) {
                const __m512 scale = _mm512_mul_ps(mw, _mm512_set1_ps(xq->d[(r0 + r) * supers + s]));
                const __m512i msum = super_msum(xq, r0 + r, sb, s, &p[h]);
                f[h][r] = _mm512_fnmadd_ps(scale, as_float(msum), f[h][r]); /* = fmaf(-scale, msum, f) */
            }
        }
    }
    for (int h = 0; h < H; h++)
        for (int r = 0; r < R; r++) _mm512_storeu_ps(acc + r * ACC_COLS + h * QCOLS, f[h][r]);
}

/* The tiles with a literal row count and format family, so their accumulators stay in registers. */
static void tile_any(int64_t format, const xquant *xq, int64_t r0, int R, int H, int64_t u0, int64_t units,
                     const qpanel *p, float *acc) {
#define DETINF_QTILE(rows, halves)                                                                  \
    if (R == rows && H == halves) {                                                                 \
        if (format >= Q4_K) tile_super(format, xq, r0, rows, halves, u0, units, p, acc);            \
        else tile_blocks(format, xq, r0, rows, halves, u0, units, p, acc);                          \
        return;                                                                                     \
    }
    DETINF_QTILE(1, 1) DETINF_QTILE(2, 1) DETINF_QTILE(3, 1) DETINF_QTILE(4, 1)
    DETINF_QTILE(1, 2) DETINF_QTILE(2, 2) DETINF_QTILE(3, 2) DETINF_QTILE(4, 2)
#undef DETINF_QTILE
}

#endif

/* Rows [r0, r0 + count) against the chunk of `halves` (1 or 2) 16-column halves p[0], p[1] (units <=
   CHUNK_UNITS: one chunk); acc [count][32] (columns of half h at 16 h) holds the running sums in and out. */
void kernel_rows(int64_t format, const xquant *xq, int64_t r0, int64_t count, int64_t u0, int64_t units,
                 const qpanel *p, int halves, float *acc) {
    for (int64_t r = 0; r < count; r += ROW_TILE) {
        const int64_t R = count - r < ROW_TILE ? count - r : ROW_TILE;
#if defined(DETINF_Q_AVX512)
        tile_any(format, xq, r0 + r, (int)R, halves, u0, units, p, acc + r * ACC_COLS);
#elif defined(DETINF_Q_AVX2)
        kernel_rows256(format, xq, r0 + r, R, u0, units, p, halves, acc + r * ACC_COLS);
#else
        for (int h = 0; h < halves; h++) {
            float *row_acc = acc + r * ACC_COLS + h * QCOLS;
            if (format >= Q4_K) row_super_c(format, xq, r0 + r, u0, units, &p[h], row_acc);
            else row_blocks_c(format, xq, r0 + r, u0, units, &p[h], row_acc);
        }
        (void)R;
#endif
    }
}
