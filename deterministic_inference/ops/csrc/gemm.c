/* bf16 GEMM for deterministic-inference: out[m, n] = x[m, :] . w[n, :] (+ bias[n]), bf16 inputs, fp32
   accumulation, fp32 or bf16 (round to nearest even) output. Used for every linear of a bf16 model and
   for its logits head (fp32 out).

   The order of every sum is fixed by this source: output (r, c) starts at +0 and, for p = 0, 1, ...,
   adds x[r, 2p+1] * w[c, 2p+1] and then x[r, 2p] * w[c, 2p], each add one IEEE fp32 rounding of the
   exact product plus the running sum (the product of two bf16 numbers is exact in fp32), with
   denormal inputs read as zero and denormal results flushed to zero. That is the definition of the
   AVX512-BF16 instruction VDPBF16PS, which the fast path uses on AMD; the portable path performs the same
   operations with fmaf, and gemm_fma.h (Intel's AVX-512 CPUs) with two fp32 FMAs per pair under
   flush-to-zero (tests compare the builds bit for bit). Nothing depends on m, on where the
   row sits, on the other rows or on the thread that computes it: columns are shared out in fixed
   panels of 64 and every panel is computed whole, row by row, by one thread.

   The weight is packed once (detinf_pack_bf16) as [n / 16][k / 2][16][2]: for each block of 16 output
   columns, the k pairs one after another, each pair of 16 columns one 64-byte line. n and k are padded
   with zeros to multiples of 16 and 2. */

#include "common.h"
#include "quant.h" /* the quantized weights --numerics native dequantises into tiles (gemm_amx.h) */

#define ROWS_PER_TILE 4   /* rows of x computed together (register blocking) */
#define BLOCKS_PER_PANEL 4 /* 16-column blocks per panel: a panel is 64 output columns */
#define PANEL_COLS (BLOCKS_PER_PANEL * LANES)

static inline float flush_denormal(float value) {
    return fabsf(value) < 1.17549435e-38f ? copysignf(0.0f, value) : value;
}

/* x[r, 2p] | x[r, 2p+1] << 16 as one 32-bit word (one load); the missing odd element of an odd k reads
   as zero. */
INLINE uint32_t pair_at(const uint16_t *row, int64_t p, int64_t k) {
    uint32_t pair;
    if (2 * p + 1 < k) memcpy(&pair, row + 2 * p, sizeof pair);
    else pair = row[2 * p];
    return pair;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

/* tile[r][b * 16 + c] = the sum above for rows [0, R) of x and the B blocks of one panel. ahead: NULL, or a
   block of the next panel, one line of which is asked for into the cache per pair (see detinf_gemm_bf16). */
INLINE void tile_sums(const uint16_t *x, int64_t k, const uint16_t *panel, int64_t block_stride,
                      float *tile, int R, int B, const uint16_t *ahead) {
    __m512 acc[ROWS_PER_TILE][BLOCKS_PER_PANEL];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) acc[r][b] = _mm512_setzero_ps();
    const int64_t pairs = (k + 1) / 2;
    for (int64_t p = 0; p < pairs; p++) {
        if (ahead) _mm_prefetch((const char *)(ahead + p * 32), _MM_HINT_T1);
        __m512bh w[BLOCKS_PER_PANEL];
        for (int b = 0; b < B; b++) w[b] = (__m512bh)_mm512_loadu_si512(panel + b * block_stride + p * 32);
        for (int r = 0; r < R; r++) {
            const __m512bh xr = (__m512bh)_mm512_set1_epi32((int)pair_at(x + r * k, p, k));
            for (int b = 0; b < B; b++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xr, w[b]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) _mm512_storeu_ps(tile + r * PANEL_COLS + b * LANES, acc[r][b]);
}

#else

/* The same operations as VDPBF16PS, lane by lane: odd element first, fmaf of the exact product, FTZ. */
INLINE void tile_sums(const uint16_t *x, int64_t k, const uint16_t *panel, int64_t block_stride,
                      float *tile, int R, int B, const uint16_t *ahead) {
    (void)ahead;
    for (int r = 0; r < R; r++)
        for (int c = 0; c < B * LANES; c++) tile[r * PANEL_COLS + c] = 0.0f;
    const int64_t pairs = (k + 1) / 2;
    for (int64_t p = 0; p < pairs; p++) {
        for (int r = 0; r < R; r++) {
            const uint32_t pair = pair_at(x + r * k, p, k);
            const float x_even = flush_denormal(bf16_to_f32((uint16_t)(pair & 0xFFFFu)));
            const float x_odd = flush_denormal(bf16_to_f32((uint16_t)(pair >> 16)));
            for (int b = 0; b < B; b++) {
                const uint16_t *w = panel + b * block_stride + p * 32;
                float *acc = tile + r * PANEL_COLS + b * LANES;
                for (int c = 0; c < LANES; c++) {
                    const float odd = flush_denormal(fmaf(x_odd, bf16_to_f32(w[2 * c + 1]), acc[c]));
                    acc[c] = flush_denormal(fmaf(x_even, bf16_to_f32(w[2 * c]), odd));
                }
            }
        }
    }
}

#endif

/* tile_sums with literal R and B, so the accumulators of the fast path stay in registers. */
static void tile_sums_any(const uint16_t *x, int64_t k, const uint16_t *panel, int64_t block_stride,
                          float *tile, int R, int B, const uint16_t *ahead) {
#define DETINF_TILE_CASE(rows)                                                                             \
    case rows:                                                                                             \
        if (B == BLOCKS_PER_PANEL) tile_sums(x, k, panel, block_stride, tile, rows, BLOCKS_PER_PANEL, ahead); \
        else                                                                                               \
            for (int b = 0; b < B; b++)                                                                    \
                tile_sums(x, k, panel + b * block_stride, block_stride, tile + b * LANES, rows, 1, NULL);  \
        break;
    switch (R) {
        DETINF_TILE_CASE(1)
        DETINF_TILE_CASE(2)
        DETINF_TILE_CASE(3)
        DETINF_TILE_CASE(4)
    }
#undef DETINF_TILE_CASE
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* The bf16 outputs of columns [0, cols) from c: 32 at a time by VCVTNE2PS2BF16, which rounds to nearest even
   as f32_to_bf16 does for every value but a NaN or a denormal (it quiets a NaN its own way and reads a
   denormal as zero); a run of 32 holding one of those is left to the loop below. Returns where it stopped. */
INLINE int64_t store_bf16x32(const float *sums, const float *bias, uint16_t *out, int64_t cols, int has_bias) {
    int64_t c = 0;
    for (; c + 32 <= cols; c += 32) {
        __m512 low = _mm512_loadu_ps(sums + c), high = _mm512_loadu_ps(sums + c + 16);
        if (has_bias) {
            low = _mm512_add_ps(low, _mm512_loadu_ps(bias + c));
            high = _mm512_add_ps(high, _mm512_loadu_ps(bias + c + 16));
        }
        if (_mm512_fpclass_ps_mask(low, 0xA1) | _mm512_fpclass_ps_mask(high, 0xA1)) break; /* NaN, denormal */
        _mm512_storeu_si512(out + c, (__m512i)_mm512_cvtne2ps_pbh(high, low));
    }
    return c;
}
#endif

/* out[base + c] = sums[c] (+ bias[c]) for c < cols, fp32 or rounded to bf16. Called with literal flags,
   so each variant is a branch-free loop the compiler vectorises (the conversion was the GEMM's tail). */
INLINE void store_row(const float *sums, const float *bias, void *out, int64_t base, int64_t cols, int out_bf16,
                      int has_bias) {
    int64_t first = 0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (out_bf16) first = store_bf16x32(sums, bias, (uint16_t *)out + base, cols, has_bias);
#endif
    for (int64_t c = first; c < cols; c++) {
        const float value = has_bias ? sums[c] + bias[c] : sums[c];
        if (out_bf16) ((uint16_t *)out)[base + c] = f32_to_bf16(value);
        else ((float *)out)[base + c] = value;
    }
}

/* Rows [r0, r0 + R) of the panel's columns [c0, c0 + cols): add the bias in fp32, round once. */
static void store_tile(const float *tile, int R, int64_t r0, int64_t c0, int64_t cols, int64_t n,
                       const float *bias, void *out, int out_bf16) {
    const float *panel_bias = bias ? bias + c0 : NULL;
    for (int r = 0; r < R; r++) {
        const float *sums = tile + r * PANEL_COLS;
        const int64_t base = (r0 + r) * n + c0;
        if (out_bf16 && panel_bias) store_row(sums, panel_bias, out, base, cols, 1, 1);
        else if (out_bf16) store_row(sums, NULL, out, base, cols, 1, 0);
        else if (panel_bias) store_row(sums, panel_bias, out, base, cols, 0, 1);
        else store_row(sums, NULL, out, base, cols, 0, 0);
    }
}

#include "gemm_fma.h" /* the FMA path (after store_tile, which it calls) */
#include "gemm_amx.h" /* the AMX-BF16 path of native numerics (after store_tile too) */

/* w [n, k] bf16 -> packed [ceil(n/16)][ceil(k/2)][16][2], zero padded, denormals flushed to zero. */
void detinf_pack_bf16(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed) {
    const int64_t pairs = (k + 1) / 2, blocks = (n + LANES - 1) / LANES;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t p = 0; p < pairs; p++) {
            for (int c = 0; c < LANES; c++) {
                for (int h = 0; h < 2; h++) {
                    const int64_t row = b * LANES + c, col = 2 * p + h;
                    uint16_t value = (row < n && col < k) ? w[row * k + col] : 0;
                    if ((value & 0x7F80u) == 0) value &= 0x8000u; /* a denormal reads as zero */
                    packed[((b * pairs + p) * LANES + c) * 2 + h] = value;
                }
            }
        }
    }
}

/* The block of the next panel that row tile `tile` of the panel at first_block asks for while it computes, or
   NULL. When a panel has several row tiles, its first four each bring one of the next panel's blocks into
   the cache, so that panel's first tile reads it from there rather than from memory at the rate it computes
   (a decode step's 27-32 rows: 1.04-1.10x on the 1B Llama shapes, AMD Zen 4). Speed only: no bit changes. */
static const uint16_t *next_panel_block(const uint16_t *packed, int64_t m, int64_t tile, int64_t first_block,
                                        int64_t blocks, int64_t block_stride) {
    const int64_t block = first_block + BLOCKS_PER_PANEL + tile;
    if (m <= ROWS_PER_TILE || tile >= BLOCKS_PER_PANEL || block >= blocks) return NULL;
    return packed + block * block_stride;
}

/* x [m, k] bf16 contiguous, packed from detinf_pack_bf16, bias [n] fp32 or NULL, out [m, n] fp32 or
   bf16 (out_bf16). Panels of 64 columns are shared out between torch's OpenMP threads; within a panel
   rows go 4 at a time. Neither choice changes a bit (see the top of the file). */
void detinf_gemm_bf16(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                      const float *bias, void *out, int out_bf16) {
#if defined(DETINF_GEMM_FMA)
    if (m >= FMA_MIN_ROWS && gemm_bf16_fma(x, m, k, packed, n, bias, out, out_bf16) == 0) return;
#endif
    const int64_t pairs = (k + 1) / 2, blocks = (n + LANES - 1) / LANES, block_stride = pairs * 32;
    const int64_t panels = (blocks + BLOCKS_PER_PANEL - 1) / BLOCKS_PER_PANEL;
#pragma omp parallel for schedule(static) if (m * n * k >= (int64_t)1 << 20)
    for (int64_t j = 0; j < panels; j++) {
        const int64_t first_block = j * BLOCKS_PER_PANEL;
        const int B = (int)(blocks - first_block < BLOCKS_PER_PANEL ? blocks - first_block : BLOCKS_PER_PANEL);
        const int64_t c0 = first_block * LANES;
        const int64_t cols = n - c0 < B * LANES ? n - c0 : B * LANES;
        float tile[ROWS_PER_TILE * PANEL_COLS];
        for (int64_t r0 = 0; r0 < m; r0 += ROWS_PER_TILE) {
            const int R = (int)(m - r0 < ROWS_PER_TILE ? m - r0 : ROWS_PER_TILE);
            const uint16_t *ahead = next_panel_block(packed, m, r0 / ROWS_PER_TILE, first_block, blocks, block_stride);
            tile_sums_any(x + r0 * k, k, packed + first_block * block_stride, block_stride, tile, R, B, ahead);
            store_tile(tile, R, r0, c0, cols, n, bias, out, out_bf16);
        }
    }
}

/* The path this build's GEMM runs: 2 fp32 FMAs (gemm_fma.h), 1 VDPBF16PS, 0 the portable fmaf loop.
   Tests build the paths and compare them bit for bit. */
int detinf_gemm_bf16_path(void) {
#if defined(DETINF_GEMM_FMA)
    return 2;
#elif defined(__AVX512BF16__) && defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* Whether this process can run the AMX-BF16 GEMM (native numerics): 0 yes, 1 this build has no AMX-BF16
   (the CPU lacks it, or the kernels were built for another -march), 2 the OS did not grant the tile state. */
int detinf_gemm_bf16_amx_status(void) {
#if defined(DETINF_GEMM_AMX)
    return amx_usable() ? 0 : 2;
#else
    return 1;
#endif
}

/* detinf_gemm_bf16's arguments and output layout on the AMX-BF16 tiles (gemm_amx.h): bits fixed per CPU
   class, invariant in m, row position and thread count. Returns 0, detinf_gemm_bf16_amx_status's code when
   the path cannot run, or 3 when a buffer cannot be allocated; out is untouched unless 0. */
int detinf_gemm_bf16_amx(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                         const float *bias, void *out, int out_bf16) {
    const int status = detinf_gemm_bf16_amx_status();
    if (status != 0) return status;
#if defined(DETINF_GEMM_AMX)
#if defined(DETINF_TEST_AMX_RAGGED_OTHER) /* negative control: a call's partial last row tile elsewhere */
    const int64_t whole = m / AMX_TILE_ROWS * AMX_TILE_ROWS;
    if (whole < m) {
        const size_t item = out_bf16 ? sizeof(uint16_t) : sizeof(float);
        detinf_gemm_bf16(x + whole * k, m - whole, k, packed, n, bias, (char *)out + whole * n * item, out_bf16);
        m = whole;
    }
    if (m == 0) return 0;
#endif
    return gemm_bf16_amx(x, m, k, packed, NULL, n, bias, out, out_bf16) == 0 ? 0 : 3;
#else
    (void)x, (void)m, (void)k, (void)packed, (void)n, (void)bias, (void)out, (void)out_bf16;
    return 1;
#endif
}

/* The same GEMM with a quantized weight read in place (`--numerics native` on a quantized file): its parts as
   detinf_quant_gemm takes them (checked by ops/quant.py; every part but the last a multiple of 16 columns),
   each 16-column panel dequantised into tiles as the call reaches it, with the bits of detinf_gemm_bf16_amx on
   the weight dequantised to bf16 and packed at load (quant_tiles.c). Returns as detinf_gemm_bf16_amx. */
int detinf_gemm_bf16_amx_quant(const uint16_t *x, int64_t m, int64_t k, const detinf_qpart *parts, int64_t nparts,
                               int64_t n, const float *bias, void *out, int out_bf16) {
    const int status = detinf_gemm_bf16_amx_status();
    if (status != 0) return status;
#if defined(DETINF_GEMM_AMX)
    const amx_quant quant = {parts, nparts, k / UNIT};
#if defined(DETINF_TEST_AMX_RAGGED_OTHER) /* negative control: a call's partial last row tile elsewhere */
    const int64_t whole = m / AMX_TILE_ROWS * AMX_TILE_ROWS;
    if (whole < m) {
        const size_t item = out_bf16 ? sizeof(uint16_t) : sizeof(float);
        if (detinf_quant_gemm(x + whole * k, m - whole, k, 1, parts, nparts, bias, (char *)out + whole * n * item, n,
                              out_bf16, 0))
            return 3;
        m = whole;
    }
    if (m == 0) return 0;
#endif
    return gemm_bf16_amx(x, m, k, NULL, &quant, n, bias, out, out_bf16) == 0 ? 0 : 3;
#else
    (void)x, (void)m, (void)k, (void)parts, (void)nparts, (void)n, (void)bias, (void)out, (void)out_bf16;
    return 1;
#endif
}
