/* gemm_amx.h: the bf16 GEMM on AMX-BF16 tiles (TDPBF16PS), for `--numerics native` only.

   out[m, n] = x[m, :] . w[n, :] (+ bias[n]): bf16 in, fp32 sums, fp32 or bf16 out, on the weight gemm.c
   packs once at load. That layout, [n / 16][k / 2][16][2], is already the AMX B operand: 16 pairs of one
   16-column block are one B tile of 16 rows x 64 bytes (stride 64). x is copied per call into the same
   shape, tile-major ([row tile][K step][16 rows][32 values]), so every A tile is 1 KiB in one piece too.
   A quantized weight (detinf_gemm_bf16_amx_quant) is read in place instead: each thread dequantises a panel
   (or a K chunk of one) into that same layout in its scratch just before multiplying it (quant_tiles.c: the
   packer's bits, so the tiles see exactly the weight dequantised at load and packed).

   These bits are NOT gemm.c's documented sum: TDPBF16PS's internal order and rounding belong to the CPU
   (issue 17 could not reproduce them in portable C), so they are fixed per CPU class only, and the engine
   runs this path only when the user asks for native numerics (the fingerprint then records the ISA).

   Why a row's bits still do not depend on the batch, its position in it, or the thread count, on one CPU:
   - every row of every call goes through the same instructions: rows are taken 16 at a time into A tiles
     (the last tile of a call zero padded to 16 rows; padding rows are never stored), whatever m is, so a
     row alone (m = 1..3, decode) runs the very TDPBF16PS sequence it runs inside a batch of 129, never
     VDPBF16PS or another width. TDPBF16PS computes each output row from its own A row (the tests check
     it on the CPU: a row alone == the same row at the first, middle and last position of batches);
   - each 16 x 16 output block has one accumulator: zeroed, then one TDPBF16PS per 32-value K step in
     ascending order (k zero padded to a multiple of 32; a padded pair adds +0 products), then stored once:
     K is never split into sums added later. Threads share out the column blocks (N) only, each an even
     share, so 1 and 2 threads give the same bits;
   - large calls (x over AMX_CHUNKED_MIN_BYTES) walk K in chunks of AMX_CHUNK_STEPS steps so that a row
     pair's x stays in L1 while a wide panel's weights stream from L2. Between chunks an accumulator tile
     is stored to memory as fp32 and loaded back: a tile store and load move its 32-bit words unchanged,
     so the accumulator still sees the same TDPBF16PS sequence as in one pass, and a row gives the same
     bits on either path (tested across the switch);
   - the fp32 sums then take gemm.c's store_tile: the bias added once in fp32, one rounding to bf16.
   Grouping (2 row tiles x 2 blocks, or 1 row tile x 4 blocks, per pass), panel widths, chunking and
   prefetches change which tiles sit side by side and when, never an accumulator's instruction sequence.

   Included by gemm.c after store_tile. DETINF_GEMM_AMX says whether this build has the path (AMX-TILE and
   AMX-BF16 in the -march); at run time the kernel must also grant the tile state (amx_usable, once per
   process). Test-only negative controls (never set by the package): DETINF_TEST_AMX_RAGGED_OTHER sends the
   rows of a call's last, partial row tile to gemm.c's other path (or the quantized GEMM, for a quantized
   weight); DETINF_TEST_AMX_SPLIT_K splits K into
   one part per thread, each part its own tile, summed in fp32 (small calls); DETINF_TEST_AMX_CHUNK_SUMS
   starts every chunk of a large call from zero and adds its sums to the spilled ones in fp32. */

#ifndef DETINF_GEMM_AMX_H
#define DETINF_GEMM_AMX_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(DETINF_Q_TILES) /* quant.h: AVX-512 BW, VL, VBMI */
#include <immintrin.h>
#include <omp.h>

#define AMX_TILE_ROWS 16  /* rows of x per A tile */
#define AMX_K_STEP 32     /* bf16 values of K per TDPBF16PS */
#define AMX_STEP_PAIRS 16 /* pairs of K per TDPBF16PS (B tile rows) */
#define AMX_TILE_BYTES 1024
#define AMX_A_TILE_ELEMS (AMX_TILE_ROWS * AMX_K_STEP) /* bf16 values of one A tile */
#define AMX_PREFETCH_STEPS 4                           /* small calls: B tiles fetched this many steps ahead */
/* x (padded) above this: the chunked path. Below it x stays in L2 beside a panel's B, which the small calls'
   path reads from there (the default model's down_proj at 425 rows, 1.3 MiB: 12% faster on that path) */
#define AMX_CHUNKED_MIN_BYTES (3 << 19)
#define AMX_CHUNK_STEPS 8               /* K steps per chunk: a row pair's x of a chunk is 16 KiB (L1) */
#define AMX_WIDE_BLOCKS 16              /* 16-column blocks per panel of the chunked path, at most */

/* Tiles 0..3: fp32 accumulators [16 rows][16 columns]; 4, 5: x [16 rows][32 bf16]; 6, 7: w [16 pairs][16
   columns][2]. Every tile is 16 rows x 64 bytes. A constant in memory (see quant_amx.c). */
static const amx_tile_config gemm_amx_tiles = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

/* A quantized weight read in place (`--numerics native` on a quantized file): its parts as the quantized GEMM
   takes them (every part but the last a multiple of 16 columns, so no 16-column block spans two parts). */
typedef struct {
    const detinf_qpart *parts;
    int64_t nparts, units; /* units: 32-value units per row (k / 32) */
} amx_quant;

/* The operands of one call, after padding: xa [row_tiles][steps][16][32] bf16 (zero padded rows and K),
   the packed weight and, when k is not a multiple of 32, each block's last K step copied zero padded. For a
   quantized weight, `packed` holds the blocks [first_block, ...) x K steps [first_step, ...) dequantised so
   far (amx_dequant), block_stride apart. */
typedef struct {
    const uint16_t *xa;
    int64_t steps, full_steps, pairs, block_stride; /* K steps in all, those read in place, pairs per block */
    const uint16_t *packed;
    const uint16_t *tails; /* [blocks][16 pairs][32] or NULL when full_steps == steps */
    const amx_quant *quant; /* NULL: a bf16 weight packed at load */
    int64_t first_block, first_step;
} amx_operands;

/* The A tile of row tile t, K step s: 1 KiB in one piece. */
INLINE const uint16_t *amx_a(const amx_operands *op, int64_t t, int64_t s) {
    return op->xa + (t * op->steps + s) * AMX_A_TILE_ELEMS;
}

/* The B tile of block b, K step s: in place in the packed weight, or the zero padded copy of its tail. */
INLINE const uint16_t *amx_b(const amx_operands *op, int64_t b, int64_t s) {
    if (s < op->full_steps)
        return op->packed + (b - op->first_block) * op->block_stride + (s - op->first_step) * AMX_STEP_PAIRS * 32;
    return op->tails + b * AMX_TILE_BYTES / 2;
}

/* Block b's B tile AMX_PREFETCH_STEPS steps after s into L1 (small calls stream the weight from memory). */
INLINE void amx_prefetch_b(const amx_operands *op, int64_t b, int64_t s) {
    if (s + AMX_PREFETCH_STEPS >= op->full_steps) return;
    const char *tile = (const char *)amx_b(op, b, s + AMX_PREFETCH_STEPS);
    for (int line = 0; line < AMX_TILE_BYTES; line += 64) _mm_prefetch(tile + line, _MM_HINT_T0);
}

/* 16 rows (row tile t) x up to 4 blocks from block b0: C tiles 0..nb-1; A tile 4; B tiles 6, 7, each read once
   (streamed: TILELOADDT1). */
static void amx_rows16(const amx_operands *op, int64_t t, int64_t b0, int nb, float *tile) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < op->steps; s++) {
        _tile_loadd(4, amx_a(op, t, s), 64);
        _tile_stream_loadd(6, amx_b(op, b0, s), 64);
        _tile_dpbf16ps(0, 4, 6);
        if (nb > 1) {
            _tile_stream_loadd(7, amx_b(op, b0 + 1, s), 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (nb > 2) {
            _tile_stream_loadd(6, amx_b(op, b0 + 2, s), 64);
            _tile_dpbf16ps(2, 4, 6);
        }
        if (nb > 3) {
            _tile_stream_loadd(7, amx_b(op, b0 + 3, s), 64);
            _tile_dpbf16ps(3, 4, 7);
        }
    }
    const int stride = PANEL_COLS * (int)sizeof(float);
    _tile_stored(0, tile, stride);
    if (nb > 1) _tile_stored(1, tile + LANES, stride);
    if (nb > 2) _tile_stored(2, tile + 2 * LANES, stride);
    if (nb > 3) _tile_stored(3, tile + 3 * LANES, stride);
}

/* Row tiles t, t + two x blocks b0, b0 + nb - 1 (two, nb - 1 in {0, 1}; a missing partner repeats its
   neighbour, and its sums land in columns or rows the caller never reads) over K steps [s0, s1): the
   accumulators start at zero (s0 == 0) or at the fp32 sums a previous chunk left in acc, and are stored
   to acc (row stride acc_stride bytes). The small calls' path runs it over all of K (s0 = 0, s1 = steps), its
   B tiles streamed (TILELOADDT1: the panel's B is read from L2 for every row pair, and so leaves the row
   pair's A tiles in L1 for the next block pair; 8.6 -> 7.0 ns a TDPBF16PS at K = 576), and prefetched for a
   bf16 weight; the chunked path chunk by chunk (gemm_amx_chunked.h), B loaded plainly (streaming it there
   was slower). `b_loads`: AMX_B_PREFETCH, AMX_B_STREAM. C tiles 2i + j; A tiles 4, 5; B tiles 6, 7. */
#define AMX_B_PREFETCH 1
#define AMX_B_STREAM 2
#define AMX_LOAD_B(tile, pointer, b_loads)                                      \
    do {                                                                        \
        if ((b_loads) & AMX_B_STREAM) _tile_stream_loadd(tile, pointer, 64);    \
        else _tile_loadd(tile, pointer, 64);                                     \
    } while (0)
static void amx_block22(const amx_operands *op, int64_t t, int two, int64_t b0, int nb, int64_t s0, int64_t s1,
                        float *acc, int acc_stride, int b_loads) {
    float *acc1 = acc + AMX_TILE_ROWS * (acc_stride / (int)sizeof(float));
#if defined(DETINF_TEST_AMX_CHUNK_SUMS) /* negative control: every chunk from zero, added to acc in fp32 */
    const int from_zero = 1;
#else
    const int from_zero = s0 == 0;
#endif
    if (from_zero) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    } else {
        _tile_loadd(0, acc, acc_stride);
        _tile_loadd(1, acc + LANES, acc_stride);
        _tile_loadd(2, acc1, acc_stride);
        _tile_loadd(3, acc1 + LANES, acc_stride);
    }
    for (int64_t s = s0; s < s1; s++) {
        if (b_loads & AMX_B_PREFETCH) {
            amx_prefetch_b(op, b0, s);
            if (nb > 1) amx_prefetch_b(op, b0 + 1, s);
        }
        _tile_loadd(4, amx_a(op, t, s), 64);
        _tile_loadd(5, amx_a(op, t + two, s), 64);
        AMX_LOAD_B(6, amx_b(op, b0, s), b_loads);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        AMX_LOAD_B(7, amx_b(op, b0 + nb - 1, s), b_loads);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
    }
#if defined(DETINF_TEST_AMX_CHUNK_SUMS)
    float part[2 * AMX_TILE_ROWS * 2 * LANES];
    const int part_stride = 2 * LANES * (int)sizeof(float), cols = acc_stride / (int)sizeof(float);
    _tile_stored(0, part, part_stride);
    _tile_stored(1, part + LANES, part_stride);
    _tile_stored(2, part + AMX_TILE_ROWS * 2 * LANES, part_stride);
    _tile_stored(3, part + AMX_TILE_ROWS * 2 * LANES + LANES, part_stride);
    for (int r = 0; r < 2 * AMX_TILE_ROWS; r++)
        for (int c = 0; c < 2 * LANES; c++)
            acc[r * cols + c] = (s0 == 0 ? 0.0f : acc[r * cols + c]) + part[r * 2 * LANES + c];
#else
    _tile_stored(0, acc, acc_stride);
    _tile_stored(1, acc + LANES, acc_stride);
    _tile_stored(2, acc1, acc_stride);
    _tile_stored(3, acc1 + LANES, acc_stride);
#endif
}

#if defined(DETINF_TEST_AMX_SPLIT_K)
/* Negative control: each output's K steps split into `parts` ranges (the thread count), each range its own
   accumulator tile, the ranges' sums added in fp32 in range order. 16 rows x 1 block. */
static void amx_split_k(const amx_operands *op, int64_t t, int64_t b, int parts, float *tile) {
    float part_sums[AMX_TILE_ROWS * LANES];
    for (int r = 0; r < AMX_TILE_ROWS; r++)
        for (int c = 0; c < LANES; c++) tile[r * PANEL_COLS + c] = 0.0f;
    for (int part = 0; part < parts; part++) {
        _tile_zero(0);
        for (int64_t s = op->steps * part / parts; s < op->steps * (part + 1) / parts; s++) {
            _tile_loadd(4, amx_a(op, t, s), 64);
            _tile_loadd(6, amx_b(op, b, s), 64);
            _tile_dpbf16ps(0, 4, 6);
        }
        _tile_stored(0, part_sums, LANES * (int)sizeof(float));
        for (int r = 0; r < AMX_TILE_ROWS; r++)
            for (int c = 0; c < LANES; c++) tile[r * PANEL_COLS + c] += part_sums[r * LANES + c];
    }
}
#endif

/* One 64-column panel (blocks [b0, b0 + B), columns from c0) for every row tile, stored by store_tile:
   one row tile x the whole panel for calls of one tile, else two row tiles x two blocks at a time, the
   row pair outside, so its x rows stay in L2 across the panel's blocks (whose weights stay there too). */
static void amx_panel(const amx_operands *op, int64_t m, int64_t row_tiles, int64_t b0, int B, int64_t n,
                      const float *bias, void *out, int out_bf16, int split_parts) {
    float tile[2 * AMX_TILE_ROWS * PANEL_COLS] __attribute__((aligned(64)));
    const int wide = row_tiles == 1 ? BLOCKS_PER_PANEL : 2;
    for (int64_t t = 0; t < row_tiles; t += 2) {
        const int two = wide == 2 && t + 1 < row_tiles;
        const int64_t r0 = t * AMX_TILE_ROWS;
        const int64_t rows = m - r0 < (1 + two) * AMX_TILE_ROWS ? m - r0 : (1 + two) * AMX_TILE_ROWS;
        for (int bb = 0; bb < B; bb += wide) {
            const int nb = B - bb < wide ? B - bb : wide;
            const int64_t c0 = (b0 + bb) * LANES;
            const int64_t cols = n - c0 < nb * LANES ? n - c0 : nb * LANES;
            (void)split_parts;
#if defined(DETINF_TEST_AMX_SPLIT_K)
            for (int64_t tt = t; tt < t + 1 + two; tt++)
                for (int j = 0; j < nb; j++)
                    amx_split_k(op, tt, b0 + bb + j, split_parts,
                                tile + (tt - t) * AMX_TILE_ROWS * PANEL_COLS + j * LANES);
#else
            /* a quantized panel's tiles were just written to this thread's scratch: prefetching them cost ~10% */
            const int stride = PANEL_COLS * (int)sizeof(float);
            const int b_loads = AMX_B_STREAM | (op->quant ? 0 : AMX_B_PREFETCH);
            if (two) amx_block22(op, t, 1, b0 + bb, nb, 0, op->steps, tile, stride, b_loads);
            else amx_rows16(op, t, b0 + bb, nb, tile);
#endif
            store_tile(tile, (int)rows, r0, c0, cols, n, bias, out, out_bf16);
        }
    }
}

/* Where a call's outputs go (store_tile's arguments). */
typedef struct {
    int64_t n;
    const float *bias;
    void *out;
    int out_bf16;
} amx_dest;

#include "gemm_amx_quant.h"   /* a quantized weight read in place: each panel dequantised into B tiles */
#include "gemm_amx_chunked.h" /* the path of large calls (K in chunks, accumulators spilled exactly) */

/* Row tiles [t0, t1) of x [m, k] -> xa [row_tiles][steps][16][32], zero padded (rows and K): each 32-value
   piece one masked load and store (rows past m load nothing). Denormals are left as they are: TDPBF16PS reads
   them as zero. */
static void amx_pad_rows(const uint16_t *x, int64_t m, int64_t k, int64_t t0, int64_t t1, int64_t steps,
                         uint16_t *xa) {
    for (int64_t r = t0 * AMX_TILE_ROWS; r < t1 * AMX_TILE_ROWS; r++) {
        uint16_t *row = xa + (r / AMX_TILE_ROWS * steps * AMX_TILE_ROWS + r % AMX_TILE_ROWS) * AMX_K_STEP;
        const uint16_t *source = r < m ? x + r * k : x;
        for (int64_t s = 0; s < steps; s++) {
            const int64_t first = s * AMX_K_STEP, left = r < m ? k - first : 0;
            const __mmask32 live = left >= AMX_K_STEP ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << left) - 1u);
            const __m512i piece = _mm512_maskz_loadu_epi16(live, source + (r < m ? first : 0));
            _mm512_storeu_si512(row + s * AMX_A_TILE_ELEMS, piece);
        }
    }
}

/* Each block's last K step, when k is not a multiple of 32: its pairs copied into a zeroed 16-pair tile. */
static void amx_copy_tails(const amx_operands *op, int64_t blocks, uint16_t *tails) {
    const int64_t first = op->full_steps * AMX_STEP_PAIRS, count = op->pairs - first;
    memset(tails, 0, (size_t)(blocks * AMX_TILE_BYTES));
    for (int64_t b = 0; b < blocks; b++)
        memcpy(tails + b * AMX_TILE_BYTES / 2, op->packed + b * op->block_stride + first * 32,
               (size_t)(count * 64));
}

/* Thread `id` of `threads`: its share of the call's column blocks, [*lo, *hi), in whole pairs of blocks and as
   even as pairs allow (fixed 16-block panels once left one of two threads 32 of the 36 blocks of a call). */
static void amx_thread_blocks(int64_t blocks, int id, int threads, int64_t *lo, int64_t *hi) {
    const int64_t pairs = (blocks + 1) / 2;
    *lo = 2 * (pairs * id / threads);
    *hi = 2 * (pairs * (id + 1) / threads);
    if (*hi > blocks) *hi = blocks;
}

/* One thread's part of a call: pad its share of x's row tiles (then wait for the others: every thread reads
   every row tile), then compute its blocks panel by panel: 4 blocks for small calls, up to AMX_WIDE_BLOCKS
   for the chunked path. A quantized weight's panel is dequantised first (by chunk of K on the chunked path)
   into the thread's scratch. */
static void amx_thread_part(const uint16_t *x, int64_t m, int64_t k, const amx_operands *op, int64_t blocks,
                            int64_t row_tiles, int chunked, const amx_dest *dest, float *chunk_sums,
                            amx_scratch *scratch, int split_parts) {
    const int id = omp_get_thread_num(), threads = omp_get_num_threads();
    amx_pad_rows(x, m, k, row_tiles * id / threads, row_tiles * (id + 1) / threads, op->steps, (uint16_t *)op->xa);
#pragma omp barrier
    int64_t lo, hi;
    amx_thread_blocks(blocks, id, threads, &lo, &hi);
    const int64_t panel_blocks = chunked ? AMX_WIDE_BLOCKS : BLOCKS_PER_PANEL;
    for (int64_t b0 = lo; b0 < hi; b0 += panel_blocks) {
        const int B = (int)(hi - b0 < panel_blocks ? hi - b0 : panel_blocks);
        amx_operands panel_op = *op;
        if (chunked) {
            const int64_t next_blocks = hi - b0 - B < panel_blocks ? hi - b0 - B : panel_blocks;
            amx_chunked_panel(&panel_op, m, row_tiles, b0, B, next_blocks, dest, chunk_sums, scratch);
            continue;
        }
        if (op->quant) amx_dequant(&panel_op, b0, B, 0, op->steps, scratch);
        amx_panel(&panel_op, m, row_tiles, b0, B, dest->n, dest->bias, dest->out, dest->out_bf16, split_parts);
    }
}

/* detinf_gemm_bf16's arguments on the AMX tiles, the weight packed bf16 (quant NULL) or quantized (packed NULL).
   Returns 0, or -1 without touching out when a buffer cannot be allocated. The calling thread's tile
   permission is the caller's (detinf_gemm_bf16_amx). */
static int gemm_bf16_amx(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed, const amx_quant *quant,
                         int64_t n, const float *bias, void *out, int out_bf16) {
    const int64_t pairs = (k + 1) / 2, blocks = (n + LANES - 1) / LANES;
    const int64_t steps = (pairs + AMX_STEP_PAIRS - 1) / AMX_STEP_PAIRS;
    const int64_t row_tiles = (m + AMX_TILE_ROWS - 1) / AMX_TILE_ROWS;
    const size_t xa_bytes = (size_t)(row_tiles * steps * AMX_A_TILE_ELEMS) * sizeof(uint16_t);
    const int chunked = row_tiles >= 2 && xa_bytes > AMX_CHUNKED_MIN_BYTES;
    /* a quantized weight is dequantised whatever m: its work is that of 16 rows at least */
    const int64_t work_rows = quant && m < AMX_TILE_ROWS ? AMX_TILE_ROWS : m;
    const int parallel = work_rows * n * k >= (int64_t)1 << 20, threads = parallel ? omp_get_max_threads() : 1;
    amx_operands op = {NULL, steps, pairs / AMX_STEP_PAIRS, pairs, pairs * 32, packed, NULL, quant, 0, 0};
    const size_t acc_floats = chunked ? amx_chunk_sums_floats(row_tiles, AMX_WIDE_BLOCKS) : 0;
    const size_t scratch_bytes = quant ? amx_scratch_bytes(steps) : 0;
    uint16_t *xa = aligned_alloc(64, xa_bytes);
    uint16_t *tails = op.full_steps < steps ? malloc((size_t)(blocks * AMX_TILE_BYTES)) : NULL;
    float *acc = chunked ? aligned_alloc(64, (size_t)threads * acc_floats * sizeof(float)) : NULL;
    uint8_t *scratch = quant ? aligned_alloc(64, (size_t)threads * scratch_bytes) : NULL;
    if (!xa || (op.full_steps < steps && !tails) || (chunked && !acc) || (quant && !scratch)) {
        free(xa);
        free(tails);
        free(acc);
        free(scratch);
        return -1;
    }
    op.xa = xa;
    op.tails = tails;
    if (tails) amx_copy_tails(&op, blocks, tails);
    const amx_dest dest = {n, bias, out, out_bf16};
    const int split_parts = omp_get_max_threads(); /* the negative control's parts only */
#pragma omp parallel if (parallel) num_threads(threads)
    {
        _tile_loadconfig(&gemm_amx_tiles); /* the tile configuration is per thread */
        const int id = omp_get_thread_num();
        float *thread_acc = chunked ? acc + (size_t)id * acc_floats : NULL;
        amx_scratch thread_scratch = {{NULL, NULL, NULL, NULL, NULL}, NULL};
        if (quant) {
            qpanel_layout(scratch + (size_t)id * scratch_bytes, &thread_scratch.chunk);
            thread_scratch.tiles = (uint16_t *)(scratch + (size_t)id * scratch_bytes + qpanel_bytes());
        }
        amx_thread_part(x, m, k, &op, blocks, row_tiles, chunked, &dest, thread_acc, &thread_scratch, split_parts);
        _tile_release();
    }
    free(acc);
    free(xa);
    free(tails);
    free(scratch);
    return 0;
}

#define DETINF_GEMM_AMX 1
#endif

#endif
