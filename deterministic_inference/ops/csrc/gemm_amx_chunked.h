/* gemm_amx_chunked.h: gemm_amx.h's path for large calls (x over AMX_CHUNKED_MIN_BYTES, e.g. a 512-token
   prefill chunk): K walked in chunks of AMX_CHUNK_STEPS steps, so that a row pair's x of one chunk (16 KiB)
   stays in L1 while it meets every block of a wide panel, whose chunk of weights stays in L2 for every row
   pair. Without chunks a call this size reads its A and B tiles from L2 or L3 at every step.

   Why the bits equal the small calls' path (gemm_amx.h, tested across the switch): an accumulator tile is
   zeroed at the first chunk, stored to `acc` as fp32 after each chunk and loaded back for the next one; a
   tile store and load move its 32-bit words unchanged, so each accumulator sees one TDPBF16PS per K step
   in ascending order from zero, the same sequence as in one pass. Included by gemm_amx.h after its
   operands and tile helpers. */

#ifndef DETINF_GEMM_AMX_CHUNKED_H
#define DETINF_GEMM_AMX_CHUNKED_H

/* floats of one thread's spill buffer: every row tile (+1, the odd last pair's unread partner) x the panel's
   blocks rounded up to even (the odd last block's unread partner). */
static size_t amx_chunk_sums_floats(int64_t row_tiles, int panel_blocks) {
    return (size_t)((row_tiles + 1) * AMX_TILE_ROWS) * (size_t)(((panel_blocks + 1) & ~1) * LANES);
}

/* Accumulators of row tiles t, t + two x blocks b0, b0 + nb - 1 (two, nb - 1 in {0, 1}; a missing partner
   repeats its neighbour and lands in acc's unread margin) over K steps [s0, s1): zeroed when s0 == 0, else
   loaded from acc; stored back to acc. C tiles 2i + j; A tiles 4, 5; B tiles 6, 7. */
static void amx_chunk22(const amx_operands *op, int64_t t, int two, int64_t b0, int nb, int64_t s0, int64_t s1,
                        float *acc, int acc_stride) {
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
        _tile_loadd(4, amx_a(op, t, s), 64);
        _tile_loadd(5, amx_a(op, t + two, s), 64);
        _tile_loadd(6, amx_b(op, b0, s), 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        _tile_loadd(7, amx_b(op, b0 + nb - 1, s), 64);
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

/* A panel of B blocks from b0 for every row tile, K in chunks (for each chunk: row pairs x block pairs),
   then every row's sums taken by store_tile 64 columns at a time. acc: amx_chunk_sums_floats floats. */
static void amx_chunked_panel(const amx_operands *op, int64_t m, int64_t row_tiles, int64_t b0, int B, int64_t n,
                              const float *bias, void *out, int out_bf16, float *acc) {
    const int acc_cols = ((B + 1) & ~1) * LANES, acc_stride = acc_cols * (int)sizeof(float);
    for (int64_t s0 = 0; s0 < op->steps; s0 += AMX_CHUNK_STEPS) {
        const int64_t s1 = op->steps - s0 < AMX_CHUNK_STEPS ? op->steps : s0 + AMX_CHUNK_STEPS;
        for (int64_t t = 0; t < row_tiles; t += 2)
            for (int g = 0; g < B; g += 2)
                amx_chunk22(op, t, t + 1 < row_tiles, b0 + g, B - g < 2 ? 1 : 2, s0, s1,
                            acc + t * AMX_TILE_ROWS * acc_cols + g * LANES, acc_stride);
    }
    float tile[AMX_TILE_ROWS * PANEL_COLS] __attribute__((aligned(64)));
    for (int64_t t = 0; t < row_tiles; t++) {
        const int64_t r0 = t * AMX_TILE_ROWS;
        const int rows = (int)(m - r0 < AMX_TILE_ROWS ? m - r0 : AMX_TILE_ROWS);
        for (int g = 0; g < B; g += BLOCKS_PER_PANEL) {
            const int64_t c0 = (b0 + g) * LANES;
            const int nb = B - g < BLOCKS_PER_PANEL ? B - g : BLOCKS_PER_PANEL;
            const int64_t cols = n - c0 < nb * LANES ? n - c0 : nb * LANES;
            for (int r = 0; r < rows; r++)
                memcpy(tile + r * PANEL_COLS, acc + (r0 + r) * acc_cols + g * LANES, (size_t)cols * sizeof(float));
            store_tile(tile, rows, r0, c0, cols, n, bias, out, out_bf16);
        }
    }
}

#endif
