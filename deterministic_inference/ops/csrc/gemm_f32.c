/* fp32 GEMM for deterministic-inference: out[m, n] = x[m, :] . w[n, :] (+ bias[n]), all fp32. Used for
   every dense linear of an fp32 model and its logits head, in place of oneDNN / MKL, whose kernels
   (and so whose summation orders) depend on the CPU's ISA and on the GEMM's shape.

   The order of every sum is fixed by this source: output (r, c) starts at +0 and, for p = 0, 1, ...,
   k - 1, becomes fmaf(x[r, p], w[c, p], sum): one fused multiply-add, one IEEE rounding, whether it
   runs as VFMADD on 16 lanes (AVX-512 path) or as the portable loop the compiler vectorises to any
   width (fmaf is exact by definition on every target). The bias is added after the sum, one more
   rounding. Nothing depends on m, on the row's position, on the other rows or on the thread: columns
   are shared out in fixed panels of 64, each computed whole by one thread, rows 4 at a time.

   The weight is packed once (detinf_pack_f32) as [n / 16][k][16]: for each block of 16 output columns,
   the k rows of 16 weights one after another (64-byte lines), n padded with zeros to a multiple of 16. */

#include "common.h"

#define F32_ROWS_PER_TILE 4
#define F32_BLOCKS_PER_PANEL 4
#define F32_PANEL_COLS (F32_BLOCKS_PER_PANEL * LANES)

#if defined(__AVX512F__)
#include <immintrin.h>

INLINE void f32_tile_sums(const float *x, int64_t k, const float *panel, int64_t block_stride, float *tile,
                          int R, int B) {
    __m512 acc[F32_ROWS_PER_TILE][F32_BLOCKS_PER_PANEL];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t p = 0; p < k; p++) {
        __m512 w[F32_BLOCKS_PER_PANEL];
        for (int b = 0; b < B; b++) w[b] = _mm512_loadu_ps(panel + b * block_stride + p * LANES);
        for (int r = 0; r < R; r++) {
            const __m512 xr = _mm512_set1_ps(x[r * k + p]);
            for (int b = 0; b < B; b++) acc[r][b] = _mm512_fmadd_ps(xr, w[b], acc[r][b]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) _mm512_storeu_ps(tile + r * F32_PANEL_COLS + b * LANES, acc[r][b]);
}

#else

/* The same fused multiply-adds lane by lane. */
INLINE void f32_tile_sums(const float *x, int64_t k, const float *panel, int64_t block_stride, float *tile,
                          int R, int B) {
    for (int r = 0; r < R; r++)
        for (int c = 0; c < B * LANES; c++) tile[r * F32_PANEL_COLS + c] = 0.0f;
    for (int64_t p = 0; p < k; p++) {
        for (int r = 0; r < R; r++) {
            const float xv = x[r * k + p];
            for (int b = 0; b < B; b++) {
                const float *w = panel + b * block_stride + p * LANES;
                float *acc = tile + r * F32_PANEL_COLS + b * LANES;
                for (int c = 0; c < LANES; c++) acc[c] = fmaf(xv, w[c], acc[c]);
            }
        }
    }
}

#endif

/* f32_tile_sums with literal R and B, so the accumulators of the fast path stay in registers. */
static void f32_tile_sums_any(const float *x, int64_t k, const float *panel, int64_t block_stride, float *tile,
                              int R, int B) {
#define DETINF_F32_TILE_CASE(rows)                                                                      \
    case rows:                                                                                          \
        if (B == F32_BLOCKS_PER_PANEL) f32_tile_sums(x, k, panel, block_stride, tile, rows, F32_BLOCKS_PER_PANEL); \
        else                                                                                            \
            for (int b = 0; b < B; b++)                                                                 \
                f32_tile_sums(x, k, panel + b * block_stride, block_stride, tile + b * LANES, rows, 1); \
        break;
    switch (R) {
        DETINF_F32_TILE_CASE(1)
        DETINF_F32_TILE_CASE(2)
        DETINF_F32_TILE_CASE(3)
        DETINF_F32_TILE_CASE(4)
    }
#undef DETINF_F32_TILE_CASE
}

/* w [n, k] fp32 -> packed [ceil(n/16)][k][16], zero padded. */
void detinf_pack_f32(const float *w, int64_t n, int64_t k, float *packed) {
    const int64_t blocks = (n + LANES - 1) / LANES;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t p = 0; p < k; p++) {
            for (int c = 0; c < LANES; c++) {
                const int64_t row = b * LANES + c;
                packed[(b * k + p) * LANES + c] = row < n ? w[row * k + p] : 0.0f;
            }
        }
    }
}

/* x [m, k] fp32 contiguous, packed from detinf_pack_f32, bias [n] fp32 or NULL, out [m, n] fp32. */
void detinf_gemm_f32(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *bias,
                     float *out) {
    const int64_t blocks = (n + LANES - 1) / LANES, block_stride = k * LANES;
    const int64_t panels = (blocks + F32_BLOCKS_PER_PANEL - 1) / F32_BLOCKS_PER_PANEL;
#pragma omp parallel for schedule(static) if (m * n * k >= (int64_t)1 << 20)
    for (int64_t j = 0; j < panels; j++) {
        const int64_t first_block = j * F32_BLOCKS_PER_PANEL;
        const int B = (int)(blocks - first_block < F32_BLOCKS_PER_PANEL ? blocks - first_block : F32_BLOCKS_PER_PANEL);
        const int64_t c0 = first_block * LANES;
        const int64_t cols = n - c0 < B * LANES ? n - c0 : B * LANES;
        float tile[F32_ROWS_PER_TILE * F32_PANEL_COLS];
        for (int64_t r0 = 0; r0 < m; r0 += F32_ROWS_PER_TILE) {
            const int R = (int)(m - r0 < F32_ROWS_PER_TILE ? m - r0 : F32_ROWS_PER_TILE);
            f32_tile_sums_any(x + r0 * k, k, packed + first_block * block_stride, block_stride, tile, R, B);
            for (int r = 0; r < R; r++) {
                const float *sums = tile + r * F32_PANEL_COLS;
                float *dst = out + (r0 + r) * n + c0;
                if (bias != NULL)
                    for (int64_t c = 0; c < cols; c++) dst[c] = sums[c] + bias[c0 + c];
                else
                    for (int64_t c = 0; c < cols; c++) dst[c] = sums[c];
            }
        }
    }
}
