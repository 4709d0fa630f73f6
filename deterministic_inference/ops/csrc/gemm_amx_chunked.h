/* gemm_amx_chunked.h: gemm_amx.h's path for large calls (x over AMX_CHUNKED_MIN_BYTES, e.g. a 512-token
   prefill chunk): K walked in chunks of AMX_CHUNK_STEPS steps, so that a row pair's x of one chunk (16 KiB)
   stays in L1 while it meets every block of a wide panel, whose chunk of weights stays in L2 for every row
   pair. Without chunks a call this size reads its A and B tiles from L2 or L3 at every step.

   Why the bits equal the small calls' path (gemm_amx.h, tested across the switch): an accumulator tile is
   zeroed at the first chunk, stored to `acc` as fp32 after each chunk and loaded back for the next one; a
   tile store and load move its 32-bit words unchanged, so each accumulator sees one TDPBF16PS per K step
   in ascending order from zero, the same sequence as in one pass: the small calls' path runs the same
   2 x 2 tile kernel (gemm_amx.h's amx_block22) over all of K at once. Included by gemm_amx.h after it. */

#ifndef DETINF_GEMM_AMX_CHUNKED_H
#define DETINF_GEMM_AMX_CHUNKED_H

/* floats of one thread's spill buffer: every row tile (+1, the odd last pair's unread partner) x the panel's
   blocks rounded up to even (the odd last block's unread partner). */
static size_t amx_chunk_sums_floats(int64_t row_tiles, int panel_blocks) {
    return (size_t)((row_tiles + 1) * AMX_TILE_ROWS) * (size_t)(((panel_blocks + 1) & ~1) * LANES);
}

/* The B tiles of a bf16 weight packed at load that the next chunk reads (blocks [b0, b0 + blocks) x K steps
   [s0, s1)), which the current chunk fetches into L2 while it multiplies: without that, every chunk's first
   row pair waited on memory for each tile (~9% of a 1B model's gate_up at 425 rows). `blocks` is 0 when there
   is nothing to fetch: a quantized weight (its thread dequantises each chunk into L1 itself), or the thread's
   last chunk. */
typedef struct {
    int64_t b0, blocks, s0, s1;
} amx_span;

/* After the chunk ending at step s1 of the panel [b0, b0 + B): the panel's next chunk, or the first chunk of
   the thread's next panel (next_blocks blocks from b0 + B, 0 if none). Steps past full_steps (the zero padded
   tail) are left out. */
static amx_span amx_next_span(const amx_operands *op, int64_t b0, int B, int64_t next_blocks, int64_t s1) {
    amx_span span = {b0, op->quant ? 0 : B, s1, s1 + AMX_CHUNK_STEPS};
    if (s1 >= op->full_steps) span = (amx_span){b0 + B, op->quant ? 0 : next_blocks, 0, AMX_CHUNK_STEPS};
    if (span.s1 > op->full_steps) span.s1 = op->full_steps;
    if (span.s1 <= span.s0) span.blocks = 0;
    return span;
}

/* PREFETCHT1 of the line at p, written as volatile inline assembly: gcc 12 -O3 dropped _mm_prefetch calls in
   amx_chunked_panel as dead code (its mod-ref analysis; -fno-ipa-modref kept them). */
static inline void amx_prefetch_l2(const char *p) { __asm__ volatile("prefetcht1 %0" : : "m"(*p)); }

/* Lines [from, to) of the span into L2, 64 bytes each, block after block: a block's steps are contiguous in
   the packed weight, blocks block_stride values apart. A prefetch changes no bit. */
static void amx_prefetch_span(const amx_operands *op, const amx_span *span, int64_t from, int64_t to) {
    if (from >= to) return;
    const char *first = (const char *)amx_b(op, span->b0, span->s0);
    const int64_t per_block = (span->s1 - span->s0) * (AMX_TILE_BYTES / 64), block_bytes = op->block_stride * 2;
    for (int64_t line = from; line < to; line++)
        amx_prefetch_l2(first + line / per_block * block_bytes + line % per_block * 64);
}

/* A panel of B blocks from b0 for every row tile, K in chunks (for each chunk: row pairs x block pairs, each
   kernel call preceded by its share of the next chunk's prefetch; a quantized weight's chunk dequantised
   first), then every row's sums taken by store_tile 64 columns at a time. acc: amx_chunk_sums_floats floats.
   next_blocks: blocks of the thread's next panel (0: none). */
static void amx_chunked_panel(amx_operands *op, int64_t m, int64_t row_tiles, int64_t b0, int B, int64_t next_blocks,
                              const amx_dest *dest, float *acc, amx_scratch *scratch) {
    const int acc_cols = ((B + 1) & ~1) * LANES, acc_stride = acc_cols * (int)sizeof(float);
    const int64_t calls = (row_tiles + 1) / 2 * ((B + 1) / 2); /* kernel calls per chunk */
    for (int64_t s0 = 0; s0 < op->steps; s0 += AMX_CHUNK_STEPS) {
        const int64_t s1 = op->steps - s0 < AMX_CHUNK_STEPS ? op->steps : s0 + AMX_CHUNK_STEPS;
        if (op->quant) amx_dequant(op, b0, B, s0, s1, scratch);
        const amx_span next = amx_next_span(op, b0, B, next_blocks, s1);
        const int64_t lines = next.blocks * (next.s1 - next.s0) * (AMX_TILE_BYTES / 64);
        const int64_t share = (lines + calls - 1) / calls;
        int64_t fetched = 0;
        for (int64_t t = 0; t < row_tiles; t += 2)
            for (int g = 0; g < B; g += 2) {
                const int64_t upto = fetched + share < lines ? fetched + share : lines;
                amx_prefetch_span(op, &next, fetched, upto);
                fetched = upto;
                amx_block22(op, t, t + 1 < row_tiles, b0 + g, B - g < 2 ? 1 : 2, s0, s1,
                            acc + t * AMX_TILE_ROWS * acc_cols + g * LANES, acc_stride, 0);
            }
    }
    float tile[AMX_TILE_ROWS * PANEL_COLS] __attribute__((aligned(64)));
    for (int64_t t = 0; t < row_tiles; t++) {
        const int64_t r0 = t * AMX_TILE_ROWS;
        const int rows = (int)(m - r0 < AMX_TILE_ROWS ? m - r0 : AMX_TILE_ROWS);
        for (int g = 0; g < B; g += BLOCKS_PER_PANEL) {
            const int64_t c0 = (b0 + g) * LANES;
            const int nb = B - g < BLOCKS_PER_PANEL ? B - g : BLOCKS_PER_PANEL;
            const int64_t cols = dest->n - c0 < nb * LANES ? dest->n - c0 : nb * LANES;
            for (int r = 0; r < rows; r++)
                memcpy(tile + r * PANEL_COLS, acc + (r0 + r) * acc_cols + g * LANES, (size_t)cols * sizeof(float));
            store_tile(tile, rows, r0, c0, cols, dest->n, dest->bias, dest->out, dest->out_bf16);
        }
    }
}

#endif
