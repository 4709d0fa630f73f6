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

/* four 1-bit flags (bits 0..3 of `bits`) as 0/1 in the four bytes of a word */
static inline uint32_t spread4(uint32_t bits) { return ((bits & 15u) * 0x00204081u) & 0x01010101u; }

/* Values 4g..4g+3 of unit u of a stored row (unit_value for l = 4g..4g+3), byte b = value 4g + b. */
static inline uint32_t unit_word(int64_t format, const uint8_t *row, int64_t u, int g) {
    const int64_t bytes = format_block_bytes(format);
    const uint32_t low4 = 0x0F0F0F0Fu;
    if (format == Q8_0) return load_u32(row + u * bytes + 2 + 4 * g) ^ 0x80808080u;
    if (format_block_values(format) == UNIT) {
        const int64_t qs = format == Q4_0 ? 2 : (format == Q4_1 ? 4 : (format == Q5_0 ? 6 : 8));
        const uint8_t *p = row + u * bytes + qs;
        const uint32_t word = load_u32(p + 4 * (g % 4)), nibbles = (g < 4 ? word : word >> 4) & low4;
        if (format != Q5_0 && format != Q5_1) return nibbles;
        return nibbles | spread4(load_u32(p - 4) >> (4 * g)) << 4;
    }
    const int64_t j = u % 8;
    const uint8_t *p = row + (u / 8) * bytes;
    if (format == Q6_K) {
        const int64_t h = j / 4, t = j % 4;
        const uint32_t low = (load_u32(p + 64 * h + 32 * (t % 2) + 4 * g) >> (4 * (t / 2))) & low4;
        return low | ((load_u32(p + 128 + 32 * h + 4 * g) >> (2 * t)) & 0x03030303u) << 4;
    }
    const uint32_t low = (load_u32(p + (format == Q4_K ? 16 : 48) + 32 * (j / 2) + 4 * g) >> (4 * (j % 2))) & low4;
    return format == Q4_K ? low : low | ((load_u32(p + 16 + 4 * g) >> j) & 0x01010101u) << 4;
}

static inline void store_u32(uint8_t *p, uint32_t word) {
    for (int b = 0; b < 4; b++) p[b] = (uint8_t)(word >> (8 * b));
}

/* rows[c] = the stored row of output column c (16 of them); units [u0, u0 + units), u0 and units whole
   super-blocks for the K formats; row_bytes: every row's length (nothing past it is read). */
void unpack_chunk(int64_t format, const uint8_t *const *rows, int64_t row_bytes, int64_t u0, int64_t units, qpanel *p) {
#if defined(DETINF_Q_AVX512)
    unpack_chunk_avx512(format, rows, row_bytes, u0, units, p);
#else
    const int64_t bytes_per_unit = format_block_bytes(format) / (format_block_values(format) / UNIT);
    for (int c = 0; c < QCOLS; c++) {
        for (int64_t uu = 0; uu < units; uu++) {
            /* the next panel's bytes at this place: 16 short streams are more than prefetchers follow */
            __builtin_prefetch(rows[c] + (u0 + uu) * bytes_per_unit + ACC_COLS * row_bytes);
            for (int g = 0; g < 8; g++) store_u32(p->w + uu * UNIT_BYTES + g * 64 + c * 4, unit_word(format, rows[c], u0 + uu, g));
        }
        unpack_scales(format, rows[c], c, u0, units, p);
    }
#endif
}
