/* gemm_fma.h: the bf16 GEMM of gemm.c on fp32 FMAs: the same bits as its other paths, faster where VDPBF16PS is slow.

   gemm.c defines every output as a chain from +0 that, for p = 0, 1, ..., adds x[2p+1] w[2p+1] and then
   x[2p] w[2p], each add one fp32 rounding of the exact product plus the running sum, denormal inputs read
   as zero and denormal results flushed. A bf16 number widened to fp32 is exact, so one fp32 FMA of the
   widened pair (exact product, one rounding) is exactly one of those adds; flush-to-zero and
   denormals-are-zero, set in MXCSR for the call, flush as VDPBF16PS does (tininess after rounding: the
   hardware's rule, also VDPBF16PS's). So the chain is rewritten here with two FMAs per pair, odd first,
   and nothing else changes: the order of every output's sum is the documented one, whatever the tile.

   Why it is used: on Intel Xeons with AMX (Sapphire Rapids and later) VDPBF16PS issues about one per 2.7
   cycles while the two FMA ports take two VFMADD231PS per cycle, so 16-lane FMAs do about 1.7x the
   multiply-adds per second (bench/RESULTS.md, issue 36). It is also the AVX-512 path of CPUs without
   AVX512-BF16, which otherwise ran gemm.c's scalar fmaf loop. On AMD (Zen 4/5) VDPBF16PS is the faster
   one and stays (gemm.c picks by the build's ISA macros; the bits do not depend on the choice).

   Tiles: within each 64-column panel (gemm.c's unit of work per thread) 8 rows x 2 blocks of 16 columns
   (16 accumulators; each weight line widened once serves 8 rows), fewer rows x 4 blocks for short calls,
   so at least 8 FMA chains are in flight. x is widened once per call into a buffer of fp32 rows
   [m][2 * pairs] (an odd k gets a zero, as the packed weight's padding). Included by gemm.c, after its
   store_tile; DETINF_GEMM_FMA says whether this build has the path. DETINF_TEST_NO_FMA_GEMM (tests only)
   builds without it and DETINF_TEST_FORCE_FMA_GEMM with it (where VDPBF16PS would run), for the comparisons
   between paths; DETINF_TEST_FMA_* are the negative controls. */

#ifndef DETINF_GEMM_FMA_H
#define DETINF_GEMM_FMA_H

#if defined(__AVX512F__) && !defined(DETINF_TEST_NO_FMA_GEMM) && \
    (defined(__AMX_BF16__) || !defined(__AVX512BF16__) || defined(DETINF_TEST_FORCE_FMA_GEMM))
#include <immintrin.h>

#define FMA_PANEL_BLOCKS BLOCKS_PER_PANEL
/* Calls of fewer rows run VDPBF16PS where the build has it: a row or two streams the weight from memory,
   where VDPBF16PS's one instruction per pair measured no slower (bench/bench_gemm_bf16.py, M = 1: FMA
   0.7-0.8x); from 4 rows on the FMA tiles win. The same bits either way. */
#if defined(__AVX512BF16__)
#define FMA_MIN_ROWS 4
#else
#define FMA_MIN_ROWS 1
#endif
/* The tests' negative controls (never set by the package): the even element first, or no flush-to-zero. */
#if defined(DETINF_TEST_FMA_EVEN_FIRST)
#define FMA_FIRST_ODD 0
#else
#define FMA_FIRST_ODD 1
#endif
#if defined(DETINF_TEST_FMA_NO_FTZ)
#define MXCSR_FTZ_DAZ 0u
#else
#define MXCSR_FTZ_DAZ 0x8040u
#endif

/* out[r][b * 16 + c] (row stride n) = the chain for rows [0, R) of x32 and blocks [0, B) of the panel. */
INLINE void fma_tile(const float *x32, int64_t pairs, const uint16_t *panel, int64_t block_stride, float *out,
                     int64_t n, int R, int B) {
    __m512 acc[8][FMA_PANEL_BLOCKS];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) acc[r][b] = _mm512_setzero_ps();
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    const int64_t row_stride = 2 * pairs;
    for (int64_t p = 0; p < pairs; p++) {
        __m512 w_odd[FMA_PANEL_BLOCKS], w_even[FMA_PANEL_BLOCKS];
        for (int b = 0; b < B; b++) {
            const __m512i line = _mm512_loadu_si512(panel + b * block_stride + p * 32); /* 16 (even, odd) */
            w_odd[b] = _mm512_castsi512_ps(_mm512_and_si512(line, high));
            w_even[b] = _mm512_castsi512_ps(_mm512_slli_epi32(line, 16));
        }
        for (int half = 0; half < 2; half++) { /* the odd element first (FMA_FIRST_ODD), then the even */
            const int odd = half == 0 ? FMA_FIRST_ODD : !FMA_FIRST_ODD;
            for (int r = 0; r < R; r++) {
                const __m512 xr = _mm512_set1_ps(x32[r * row_stride + 2 * p + odd]);
                for (int b = 0; b < B; b++) acc[r][b] = _mm512_fmadd_ps(xr, odd ? w_odd[b] : w_even[b], acc[r][b]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) _mm512_storeu_ps(out + r * n + b * LANES, acc[r][b]);
}

/* fma_tile with literal R and B (the accumulators stay in registers): R rows of x32, B blocks. */
static void fma_tile_any(const float *x32, int64_t pairs, const uint16_t *panel, int64_t block_stride, float *out,
                         int64_t n, int R, int B) {
#define DETINF_FMA_CASE(rows)                                                                    \
    case rows:                                                                                   \
        if (B == 4) fma_tile(x32, pairs, panel, block_stride, out, n, rows, 4);                  \
        else if (B == 2) fma_tile(x32, pairs, panel, block_stride, out, n, rows, 2);             \
        else fma_tile(x32, pairs, panel, block_stride, out, n, rows, 1);                         \
        break;
    switch (R) {
        DETINF_FMA_CASE(1)
        DETINF_FMA_CASE(2)
        DETINF_FMA_CASE(3)
        DETINF_FMA_CASE(4)
        DETINF_FMA_CASE(5)
        DETINF_FMA_CASE(6)
        DETINF_FMA_CASE(7)
        DETINF_FMA_CASE(8)
    }
#undef DETINF_FMA_CASE
}

/* x [m, k] bf16 -> x32 [m][2 * pairs] fp32: widened exactly, denormals to signed zero, an odd k padded. */
static void widen_rows(const uint16_t *x, int64_t m, int64_t k, int64_t pairs, float *x32) {
    for (int64_t r = 0; r < m; r++) {
        float *row = x32 + r * 2 * pairs;
        for (int64_t i = 0; i < k; i++) {
            uint16_t value = x[r * k + i];
            if ((value & 0x7F80u) == 0) value &= 0x8000u; /* a denormal reads as zero */
            row[i] = bf16_to_f32(value);
        }
        if (k % 2) row[k] = 0.0f;
    }
}

/* One 64-column panel (B blocks from column c0) for every row, stored by gemm.c's store_tile. 8-row tiles
   take the blocks two at a time, so a pair's weight lines stay in L2 across the row tiles; tiles of fewer
   than 4 rows take the whole panel, so at least 8 FMA chains run side by side. */
static void fma_panel(const float *x32, int64_t m, int64_t pairs, const uint16_t *panel, int64_t block_stride,
                      int B, int64_t c0, int64_t n, const float *bias, void *out, int out_bf16) {
    float tile[8 * PANEL_COLS];
    const int wide = m >= 4 ? 2 : FMA_PANEL_BLOCKS;
    for (int b0 = 0; b0 < B; b0 += wide) {
        const int width = B - b0 < wide ? B - b0 : wide;
        const int64_t first_col = c0 + b0 * LANES;
        const int64_t cols = n - first_col < width * LANES ? n - first_col : width * LANES;
        for (int64_t r0 = 0; r0 < m; r0 += 8) {
            const int R = (int)(m - r0 < 8 ? m - r0 : 8);
            const float *rows = x32 + r0 * 2 * pairs;
            if (width == wide || width == 1) {
                fma_tile_any(rows, pairs, panel + b0 * block_stride, block_stride, tile, PANEL_COLS, R, width);
            } else { /* 3 blocks of a narrow call: one at a time */
                for (int b = 0; b < width; b++)
                    fma_tile_any(rows, pairs, panel + (b0 + b) * block_stride, block_stride, tile + b * LANES,
                                 PANEL_COLS, R, 1);
            }
            store_tile(tile, R, r0, first_col, cols, n, bias, out, out_bf16);
        }
    }
}

/* gemm.c's detinf_gemm_bf16 on FMAs (same arguments, same bits). Returns 0, or -1 without touching out
   when the widened x cannot be allocated (the caller then runs its other path: the same bits again). */
static int gemm_bf16_fma(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                         const float *bias, void *out, int out_bf16) {
    const int64_t pairs = (k + 1) / 2, blocks = (n + LANES - 1) / LANES, block_stride = pairs * 32;
    const int64_t panels = (blocks + FMA_PANEL_BLOCKS - 1) / FMA_PANEL_BLOCKS;
    float *x32 = malloc((size_t)(m * 2 * pairs) * sizeof(float));
    if (!x32) return -1;
    widen_rows(x, m, k, pairs, x32);
#pragma omp parallel if (m * n * k >= (int64_t)1 << 20)
    {
        const unsigned saved = _mm_getcsr();
        _mm_setcsr(saved | MXCSR_FTZ_DAZ);
#pragma omp for schedule(static)
        for (int64_t j = 0; j < panels; j++) {
            const int64_t first_block = j * FMA_PANEL_BLOCKS;
            const int B = (int)(blocks - first_block < FMA_PANEL_BLOCKS ? blocks - first_block : FMA_PANEL_BLOCKS);
            fma_panel(x32, m, pairs, packed + first_block * block_stride, block_stride, B, first_block * LANES, n,
                      bias, out, out_bf16);
        }
        _mm_setcsr(saved);
    }
    free(x32);
    return 0;
}

#define DETINF_GEMM_FMA 1
#endif

#endif
