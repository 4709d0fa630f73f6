/* Unpacking of GGUF blocks into a panel's scratch (layouts in quant.h): for 16 output columns (rows of
   the stored weight) and a run of 32-value units, each value becomes the format's unsigned integer in
   [8 groups of 4 values][16 columns][4 values] order, so one 64-byte line holds 4 values of each of the
   16 columns (what one VPDPBUSD multiplies against 4 broadcast activation bytes); the block scales
   become fp32 (exact). Unpacking only moves integers, so the AVX-512 path (quant_unpack512.c) and the
   portable one below produce the same bytes.

   Byte layouts (ggml-common.h; fp16 little endian):
     Q8_0  [d][32 x int8]                     Q4_0 [d][16 x two nibbles: value i low, i + 16 high]
     Q4_1  [d][m][16 nibble bytes]             Q5_0 [d][qh: u32, bit i = 5th bit of value i][16 nibbles]
     Q5_1  [d][m][qh][16 nibble bytes]
     Q4_K  [d][dmin][12 bytes: 8 6-bit scales and mins][128 bytes: sub-blocks 2t, 2t+1 = low, high nibbles
           of bytes 32t..32t+31]
     Q5_K  as Q4_K with [32 bytes qh: bit j of byte l = 5th bit of value l of sub-block j] before the nibbles
     Q6_K  [128 bytes ql][64 bytes qh][16 int8 scales][d]: value 128h + 32t + l (t < 4, l < 32) is the
           nibble t / 2 of ql[64h + 32 (t % 2) + l] with bits 2t, 2t + 1 of qh[32h + l] above it. */

#include "quant.h"

/* Scales of one column for the chunk: 32-value formats per unit, K formats per super-block. */
static void unpack_scales(int64_t format, const uint8_t *row, int c, int64_t u0, int64_t units, qpanel *p) {
    const int64_t bytes = format_block_bytes(format);
    if (format_block_values(format) == UNIT) {
        for (int64_t uu = 0; uu < units; uu++) {
            const uint8_t *block = row + (u0 + uu) * bytes;
            p->d[uu * QCOLS + c] = f16_to_f32(load_u16(block));
            if (format_has_min(format)) p->m[uu * QCOLS + c] = f16_to_f32(load_u16(block + 2));
        }
        return;
    }
    for (int64_t sb = 0; sb < units / 8; sb++) {
        const uint8_t *block = row + (u0 / 8 + sb) * bytes;
        if (format == Q6_K) {
            p->d[sb * QCOLS + c] = f16_to_f32(load_u16(block + 208));
            for (int j = 0; j < 16; j++) p->sc[(sb * 16 + j) * QCOLS + c] = (int8_t)block[192 + j];
            continue;
        }
        p->d[sb * QCOLS + c] = f16_to_f32(load_u16(block));
        p->m[sb * QCOLS + c] = f16_to_f32(load_u16(block + 2));
        for (int j = 0; j < 8; j++) {
            p->sc[(sb * 16 + j) * QCOLS + c] = k4_scale(block + 4, j, 0);
            p->mn[(sb * 8 + j) * QCOLS + c] = k4_scale(block + 4, j, 1);
        }
    }
}

/* rows[c] = the stored row of output column c (16 of them); units [u0, u0 + units), u0 and units whole
   super-blocks for the K formats; row_bytes: every row's length (nothing past it is read). */
void unpack_chunk(int64_t format, const uint8_t *const *rows, int64_t row_bytes, int64_t u0, int64_t units, qpanel *p) {
#if defined(DETINF_Q_AVX512)
    unpack_chunk_avx512(format, rows, row_bytes, u0, units, p);
#else
    (void)row_bytes;
    for (int c = 0; c < QCOLS; c++) {
        for (int64_t uu = 0; uu < units; uu++) {
            uint8_t *unit = p->w + uu * UNIT_BYTES + c * 4;
            for (int l = 0; l < UNIT; l++) unit[(l / 4) * 64 + l % 4] = unit_value(format, rows[c], u0 + uu, l);
        }
        unpack_scales(format, rows[c], c, u0, units, p);
    }
#endif
}
