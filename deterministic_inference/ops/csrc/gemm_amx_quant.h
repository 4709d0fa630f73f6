/* gemm_amx_quant.h: gemm_amx.h's reading of a quantized weight in place (`--numerics native` on a quantized
   file): each thread dequantises the panel (or the K chunk of one) it is about to multiply into B tiles of
   the packed bf16 layout in its own scratch (quant_tiles.c gives the packer's bits, so the tiles hold exactly
   the weight dequantised at load and packed). Included by gemm_amx.h after amx_operands. */

#ifndef DETINF_GEMM_AMX_QUANT_H
#define DETINF_GEMM_AMX_QUANT_H

/* A thread's scratch for a quantized weight: one unpacked chunk, and the dequantised B tiles. */
typedef struct {
    qpanel chunk;
    uint16_t *tiles;
} amx_scratch;

/* Blocks [b0, b0 + B) x K steps [s0, s1) of op's quantized weight dequantised into scratch->tiles as B tiles
   [B][s1 - s0][16 pairs][16][2] (the packed bf16 layout: part_bf16_tiles gives the packer's bits), and op
   pointed at them. A K step is one 32-value unit; s0 is a multiple of 8 (a K super-block) on both paths. */
static void amx_dequant(amx_operands *op, int64_t b0, int B, int64_t s0, int64_t s1, amx_scratch *scratch) {
    const amx_quant *q = op->quant;
    for (int j = 0; j < B; j++) {
        int64_t first = (b0 + j) * LANES, part = 0; /* the block's first column, within its part */
        while (part + 1 < q->nparts && first >= q->parts[part].cols) first -= q->parts[part++].cols;
        for (int64_t u = s0; u < s1; u += CHUNK_UNITS) {
            const int64_t count = s1 - u < CHUNK_UNITS ? s1 - u : CHUNK_UNITS;
            part_bf16_tiles(&q->parts[part], first, q->units, u, count, &scratch->chunk,
                            scratch->tiles + (j * (s1 - s0) + u - s0) * (AMX_TILE_BYTES / 2));
        }
    }
    op->packed = scratch->tiles;
    op->block_stride = (s1 - s0) * AMX_STEP_PAIRS * 32;
    op->first_block = b0;
    op->first_step = s0;
}

/* Per-thread scratch of a quantized weight's calls: the unpacked chunk, then the dequantised B tiles of a
   panel (all of K, 4 blocks) or of a chunk (AMX_CHUNK_STEPS steps, up to AMX_WIDE_BLOCKS blocks). */
static size_t amx_scratch_bytes(int64_t steps) {
    const int64_t panel = BLOCKS_PER_PANEL * steps, chunk = AMX_WIDE_BLOCKS * AMX_CHUNK_STEPS;
    return qpanel_bytes() + (size_t)(panel > chunk ? panel : chunk) * AMX_TILE_BYTES;
}

#endif
