/* Q4_0 weights repacked once at load into 16-column panels (format Q4_0_X16), so the GEMM reads them in
   the order VPDPBUSD consumes them instead of transposing 16 rows' blocks on every call.

   LAYOUT of a part with N output columns (N a multiple of 16) of K = 32 * B values: panel p holds output
   columns 16p .. 16p + 15 (after the row order) in 16 * row_bytes bytes (row_bytes = 18 * B, so the
   repacked part is exactly as large as the stored one):
     scales [B][16] fp16      block b's scale of column c at 32 b + 2 c
     qs     [B][4][16][4] u8  at 32 B + 256 b + 64 t + 4 c + j: byte 4 t + j of column c's block b
   A byte still holds value 4 t + j in its low nibble and value 16 + 4 t + j in its high nibble, so the
   low nibbles of the 64 bytes at t are group t of the unpacked unit and the high nibbles group t + 4.

   Only integers move: each output is still the float sequence of quant.h for Q4_0 (blocks ascending,
   fmaf(d_b * dx_b, (float)isum_b, acc)), so a repacked part gives the stored part's bits; builds that do
   not repack (detinf_quant_repacks) read the stored layout and give the same bits too. */

#include "quant.h"

#define X16_SCALE_BYTES 32 /* one block's 16 fp16 scales */
#define X16_QS_BYTES 256   /* one block's 16 columns x 16 bytes */

/* 1 when this build reads `format` faster repacked (the AVX-512 few-row path), else 0. */
int detinf_quant_repacks(int64_t format) {
#if defined(DETINF_Q_AVX512)
    return format == Q4_0;
#else
    (void)format;
    return 0;
#endif
}

/* Output columns [col0, col0 + cols) (multiples of 16) of a stored Q4_0 part -> their panels in dst (the
   whole repacked part; panel p at 16 p row_bytes). Column j reads stored row row_order[j] (NULL: j). */
void detinf_repack_q4_0(const uint8_t *src, const int64_t *row_order, int64_t row_bytes, int64_t col0, int64_t cols,
                        uint8_t *dst) {
    const int64_t blocks = row_bytes / 18;
    for (int64_t panel = col0 / QCOLS; panel < (col0 + cols) / QCOLS; panel++) {
        uint8_t *scales = dst + panel * QCOLS * row_bytes, *qs = scales + X16_SCALE_BYTES * blocks;
        for (int c = 0; c < QCOLS; c++) {
            const int64_t column = panel * QCOLS + c;
            const uint8_t *row = src + (row_order ? row_order[column] : column) * row_bytes;
            for (int64_t b = 0; b < blocks; b++) {
                memcpy(scales + X16_SCALE_BYTES * b + 2 * c, row + 18 * b, 2);
                for (int t = 0; t < 4; t++) memcpy(qs + X16_QS_BYTES * b + 64 * t + 4 * c, row + 18 * b + 2 + 4 * t, 4);
            }
        }
    }
}

/* Units [u0, u0 + units) of one 16-column panel (B blocks) into p, the bytes unpack_chunk writes for Q4_0. */
void unpack_q4_0_x16(const uint8_t *panel, int64_t blocks, int64_t u0, int64_t units, qpanel *p) {
    const uint8_t *scales = panel + X16_SCALE_BYTES * u0, *qs = panel + X16_SCALE_BYTES * blocks + X16_QS_BYTES * u0;
    for (int64_t u = 0; u < units; u++) {
        for (int c = 0; c < QCOLS; c++) p->d[u * QCOLS + c] = f16_to_f32(load_u16(scales + X16_SCALE_BYTES * u + 2 * c));
        const uint8_t *q = qs + X16_QS_BYTES * u;
        uint8_t *w = p->w + u * UNIT_BYTES;
        for (int i = 0; i < X16_QS_BYTES; i++) {
            w[i] = q[i] & 15;
            w[X16_QS_BYTES + i] = q[i] >> 4;
        }
    }
}

#if defined(DETINF_Q_AVX512)
#include <immintrin.h>

static inline __m512i x16_word(const int8_t *x) { /* 4 activation bytes broadcast to every lane */
    int32_t word;
    memcpy(&word, x, sizeof word);
    return _mm512_set1_epi32(word);
}

/* Rows [0, R) x one panel, every block; acc rows of ACC_COLS floats (quant.h's sequence for Q4_0). */
static inline __attribute__((always_inline)) void fused_x16(const uint8_t *panel, const xquant *xq, const int R,
                                                             float *acc) {
    const int64_t k = xq->k, blocks = k / UNIT;
    const uint8_t *scales = panel, *qs = panel + X16_SCALE_BYTES * blocks;
    const __m512i nibble = _mm512_set1_epi8(15);
    __m512 f[FUSED_ROWS];
    for (int r = 0; r < R; r++) f[r] = _mm512_setzero_ps(); /* acc = +0 */
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *q = qs + X16_QS_BYTES * b;
        _mm_prefetch((const char *)(q + 4 * X16_QS_BYTES), _MM_HINT_T0);
        _mm_prefetch((const char *)(q + 4 * X16_QS_BYTES + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(q + 4 * X16_QS_BYTES + 128), _MM_HINT_T0);
        _mm_prefetch((const char *)(q + 4 * X16_QS_BYTES + 192), _MM_HINT_T0);
        const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + X16_SCALE_BYTES * b)));
        __m512i g[8];
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            const __m512i v = _mm512_loadu_si512(q + 64 * t);
            g[t] = _mm512_and_si512(v, nibble);
            g[t + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        }
        for (int r = 0; r < R; r++) {
            const int8_t *x = xq->q + r * k + b * UNIT;
            __m512i even = _mm512_set1_epi32(-8 * xq->s32[r * blocks + b]), odd = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int i = 0; i < 8; i += 2) { /* two chains, added exactly */
                even = _mm512_dpbusd_epi32(even, g[i], x16_word(x + 4 * i));
                odd = _mm512_dpbusd_epi32(odd, g[i + 1], x16_word(x + 4 * i + 4));
            }
            const __m512i isum = _mm512_add_epi32(even, odd);
            const __m512 dx = _mm512_set1_ps(xq->d[r * blocks + b]);
            const __m512 product = _mm512_cvt_roundepi32_ps(isum, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            f[r] = _mm512_fmadd_ps(_mm512_mul_ps(scale, dx), product, f[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(acc + r * ACC_COLS, f[r]);
}

/* Rows [0, m) (m <= FUSED_ROWS) of one repacked panel; acc [m][ACC_COLS] at the panel's first column. */
void fused_q4_0_x16_avx512(const uint8_t *panel, const xquant *xq, int64_t m, float *acc) {
    switch (m) { /* each row count with its constants folded */
        case 1: fused_x16(panel, xq, 1, acc); break;
        case 2: fused_x16(panel, xq, 2, acc); break;
        case 3: fused_x16(panel, xq, 3, acc); break;
        default: fused_x16(panel, xq, 4, acc); break;
    }
}
#endif
