/* quant_tiles.c: a chunk of unpacked quantized weights (quant.h's qpanel) as bf16 AMX-BF16 B tiles, for
   `--numerics native` on a quantized file: gemm_amx.h dequantises each panel of weights as it reaches it and
   multiplies the tiles as it does a bf16 weight packed at load, so the blocks stay in memory as stored.

   Why the tiles hold exactly the bits of dequantising at load (detinf_dequantize, bf16 out) and then packing
   (detinf_pack_bf16): each value goes through detinf_dequantize's fp32 operations, lane by lane (a lane is
   one of the 16 output columns, with its own scales):
     Q8_0  d * q (the stored int8)     Q4_0  d * (q - 8)        Q5_0  d * (q - 16)
     Q4_1, Q5_1  (d * q) + m                        Q4_K, Q5_K  ((d * sc_j) * q) - (dmin * m_j)
     Q6_K  (d * sc) * (q - 32)
   each product or sum one IEEE fp32 rounding (the kernels are built with -ffp-contract=off; the one fused
   multiply-add written here, in `dequantised`, rounds an exact product and a sum once, as the two
   operations do), the integers converted exactly; then rounded to bf16 as f32_to_bf16 does
   (bf16_bits16, lane by lane), and a bf16 denormal becomes a signed zero as the packer makes it. The tests
   compare the tiles' GEMM with the GEMM on the dequantised, packed weight, bit for bit; their negative
   control, DETINF_TEST_TILES_TRUNCATE (never set by the package), cuts each value to bf16 instead of
   rounding it. */

#include "quant512.h" /* quant.h, and halves16 */

#if defined(DETINF_Q_TILES) /* quant.h: AVX-512 BW, VL, VNNI and VBMI (one byte permutation per half row) */

/* The per-unit factors of 16 columns: value = scale[half] * (q - offset), then + add or - subtract. */
typedef struct {
    __m512 scale[2]; /* for values 0..15 and 16..31 of the unit (they differ for Q6_K only) */
    __m512 minimum;  /* Q4_1, Q5_1: m (added); Q4_K, Q5_K: dmin * m_j (subtracted) */
} unit_factors;

INLINE unit_factors factors_of(int64_t format, const qpanel *p, int64_t u0, int64_t uu) {
    unit_factors f;
    f.minimum = _mm512_setzero_ps();
    if (format_block_values(format) == UNIT) {
        f.scale[0] = f.scale[1] = _mm512_loadu_ps(p->d + uu * QCOLS);
        if (format_has_min(format)) f.minimum = _mm512_loadu_ps(p->m + uu * QCOLS);
        return f;
    }
    const int64_t sb = (u0 + uu) / 8 - u0 / 8, j = (u0 + uu) % 8; /* super-block in the chunk, unit in it */
    const __m512 d = _mm512_loadu_ps(p->d + sb * QCOLS);
    if (format == Q6_K) {
        for (int h = 0; h < 2; h++) {
            const __m512i sc = _mm512_loadu_si512(p->sc + (sb * 16 + 2 * j + h) * QCOLS);
            f.scale[h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
        }
        return f;
    }
    const __m512i sc = _mm512_loadu_si512(p->sc + (sb * 16 + j) * QCOLS);
    const __m512i mn = _mm512_loadu_si512(p->mn + (sb * 8 + j) * QCOLS);
    f.scale[0] = f.scale[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
    f.minimum = _mm512_mul_ps(_mm512_loadu_ps(p->m + sb * QCOLS), _mm512_cvtepi32_ps(mn));
    return f;
}

/* Value l of the unit for the 16 columns, from its unsigned integers q, in fp32 (the operations above).
   Where a sum follows the product (Q4_1, Q5_1, Q4_K, Q5_K), one fused multiply-add gives the same bits as
   the two roundings: the product is exact, so its rounding changes nothing. An fp16 scale has at most 11
   significant bits and q at most 5 (Q4_K / Q5_K: d * sc_j is exact too, 11 + 6 bits, then times q, 22
   bits), all within fp32's 24, and no product can overflow or fall below fp32's normals. */
INLINE __m512 dequantised(int64_t format, __m512i q, int32_t offset, const unit_factors *f, int l) {
    const __m512i shifted = offset ? _mm512_sub_epi32(q, _mm512_set1_epi32(offset)) : q;
    const __m512 scale = f->scale[l / 16], integer = _mm512_cvtepi32_ps(shifted);
    if (format_has_min(format)) return _mm512_fmadd_ps(scale, integer, f->minimum);
    if (format == Q4_K || format == Q5_K) return _mm512_fmsub_ps(scale, integer, f->minimum);
    return _mm512_mul_ps(scale, integer);
}

/* The packer's bf16 bits of a value (low 16 bits of each lane): f32_to_bf16, a denormal to a signed zero. */
INLINE __m512i packed_bits(__m512 value) {
    const __m512i bits = bf16_bits16(value);
    const __mmask16 denormal = _mm512_testn_epi32_mask(bits, _mm512_set1_epi32(0x7F80));
    return _mm512_mask_and_epi32(bits, denormal, bits, _mm512_set1_epi32(0x8000));
}

/* The 32 words of a tile row: the low 16 bits of each lane of `a`, then those of `b`. */
INLINE __m512i low_words32(__m512i a, __m512i b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(a)), _mm512_cvtepi32_epi16(b), 1);
}

/* One tile row (16 columns x a pair of K values) from its values in the tile's own order: lane 2c + j of `a`
   holds value j of the pair for column c (columns 0..7), the same lane of `b` for column c + 8. So the 32
   bf16 words are a's lanes then b's.
   `finite`: the unit's factors are finite, so every value is a finite multiple of 2^-24 (the fp16 scales'
   quantum times integers), never NaN nor below bf16's smallest normal: then VCVTNE2PS2BF16's rounding (to
   nearest even; it reads denormals as zero and quiets NaNs its own way, neither of which can occur) gives
   f32_to_bf16's bits. Otherwise the bits are computed lane by lane as the packer's. */
INLINE __m512i tile_row(__m512 a, __m512 b, int finite) {
#if defined(DETINF_TEST_TILES_TRUNCATE) /* negative control (tests only): bf16 by truncation, not rounding */
    return low_words32(_mm512_srli_epi32(_mm512_castps_si512(a), 16), _mm512_srli_epi32(_mm512_castps_si512(b), 16));
#endif
    if (finite) return (__m512i)_mm512_cvtne2ps_pbh(b, a);
    return low_words32(packed_bits(a), packed_bits(b));
}

/* Whether the format's values add or subtract a per-unit minimum (unit_factors.minimum). */
INLINE int has_minimum(int64_t format) { return format_has_min(format) || format == Q4_K || format == Q5_K; }

/* Whether every factor of the unit is finite (one class test per vector: NaN or infinity). */
INLINE int factors_finite(int64_t format, const unit_factors *f) {
    __mmask16 bad = _mm512_fpclass_ps_mask(f->scale[0], 0x99) | _mm512_fpclass_ps_mask(f->scale[1], 0x99);
    if (has_minimum(format)) bad |= _mm512_fpclass_ps_mask(f->minimum, 0x99);
    return bad == 0;
}

/* A unit's factors in tile_row's lane order: half[0] for columns 0..7 (lanes 2c and 2c + 1: column c),
   half[1] for columns 8..15. Only Q6_K has a second scale, and only the formats with a minimum permute it. */
typedef struct {
    unit_factors half[2];
} paired_factors;

INLINE paired_factors pair_factors(int64_t format, const unit_factors *f) {
    paired_factors paired;
    for (int h = 0; h < 2; h++) {
        const __m512i column = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
        const __m512i index = _mm512_add_epi32(column, _mm512_set1_epi32(8 * h));
        unit_factors *half = &paired.half[h];
        half->scale[0] = _mm512_permutexvar_ps(index, f->scale[0]);
        half->scale[1] = format == Q6_K ? _mm512_permutexvar_ps(index, f->scale[1]) : half->scale[0];
        half->minimum = has_minimum(format) ? _mm512_permutexvar_ps(index, f->minimum) : _mm512_setzero_ps();
    }
    return paired;
}

/* unit_tile's rows with `finite` a literal: each case its own unrolled loop, so the scale of each value is
   known at compile time and no test of `finite` sits in the loop. One byte permutation puts the integers of
   a tile row's half (8 columns x 2 values, from 8 of the 32-bit lanes of words[g]) in the lane order of
   tile_row, zero extended. */
INLINE void unit_tile_rows(int64_t format, const paired_factors *f, const __m512i *words, uint16_t *tile,
                           int finite) {
    const int32_t offset = format == Q6_K ? 32 : format_offset(format);
    const __mmask64 low_bytes = 0x1111111111111111ull;
    __m512i pick[2][2]; /* [value pair h of the 4 in a lane][column half]: byte 4 (c + 8 half) + 2 h + j */
    for (int h = 0; h < 2; h++)
        for (int half = 0; half < 2; half++) {
            int8_t bytes[64] = {0};
            for (int lane = 0; lane < 16; lane++)
                bytes[4 * lane] = (int8_t)(4 * (lane / 2 + 8 * half) + 2 * h + lane % 2);
            pick[h][half] = _mm512_loadu_si512(bytes);
        }
#pragma GCC unroll 8
    for (int g = 0; g < 8; g++) { /* tile rows 2g + h: values 4g + 2h, 4g + 2h + 1 of every column */
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            __m512 value[2];
#pragma GCC unroll 2
            for (int half = 0; half < 2; half++) {
                const __m512i q = _mm512_maskz_permutexvar_epi8(low_bytes, pick[h][half], words[g]);
                value[half] = dequantised(format, q, offset, &f->half[half], 4 * g + 2 * h);
            }
            _mm512_storeu_si512(tile + (2 * g + h) * 32, tile_row(value[0], value[1], finite));
        }
    }
}

/* One unit's B tile [16 pairs][16 columns][2] from its 8 groups of values (words[g]: values 4g .. 4g + 3 of each
   column, one byte each, in the column's 32-bit lane: the unpacked layout of quant.h). */
INLINE void unit_tile(int64_t format, const unit_factors *f, const __m512i *words, uint16_t *tile) {
    const paired_factors paired = pair_factors(format, f);
    if (factors_finite(format, f)) unit_tile_rows(format, &paired, words, tile, 1);
    else unit_tile_rows(format, &paired, words, tile, 0);
}

INLINE void format_tiles(int64_t format, const qpanel *p, int64_t u0, int64_t count, uint16_t *tiles) {
    for (int64_t uu = 0; uu < count; uu++) {
        const unit_factors f = factors_of(format, p, u0, uu);
        __m512i words[8];
        for (int g = 0; g < 8; g++) words[g] = _mm512_loadu_si512(p->w + uu * UNIT_BYTES + g * 64);
        unit_tile(format, &f, words, tiles + uu * 512);
    }
}

#define X16_AHEAD 8 /* units prefetched ahead */

/* The same tiles straight from a repacked Q4_0 / Q4_1 / Q8_0 panel of 16 columns (quant_repack.c's layout,
   `units` blocks per row), units [u0, u0 + count): the values unpack_x16 would write, taken in registers. */
INLINE void x16_format_tiles(int64_t format, const uint8_t *panel, int64_t units, int64_t u0, int64_t count,
                             uint16_t *tiles) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t u = u0; u < u0 + count; u++) {
        unit_factors f;
        f.scale[0] = f.scale[1] = halves16(panel + x16_field_at(format, units, u, 0));
        f.minimum = x16_fields(format) == 2 ? halves16(panel + x16_field_at(format, units, u, 1)) : _mm512_setzero_ps();
        const uint8_t *q = panel + x16_qs_at(format, units, u);
        /* the pair X16_AHEAD units on, into L1: at a few dozen rows the GEMM streams the weights from memory */
        prefetch_x16_pair(format, panel, u, X16_AHEAD);
        __m512i words[8];
        for (int t = 0; t < 4; t++) {
            const __m512i v = _mm512_loadu_si512(q + 64 * t);
            if (format == Q8_0) {
                words[t] = v;
                words[t + 4] = _mm512_loadu_si512(q + 64 * (t + 4));
            } else { /* low nibbles: group t; high nibbles: group t + 4 */
                words[t] = _mm512_and_si512(v, low);
                words[t + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
        }
        unit_tile(format, &f, words, tiles + (u - u0) * 512);
    }
}

/* `count` units of the unpacked chunk p (unit u0 first) as B tiles. */
static void qpanel_bf16_tiles(int64_t format, const qpanel *p, int64_t u0, int64_t count, uint16_t *tiles) {
    switch (format) { /* each case its own loop, the format's operations fixed at compile time */
        case Q4_0: format_tiles(Q4_0, p, u0, count, tiles); break;
        case Q4_1: format_tiles(Q4_1, p, u0, count, tiles); break;
        case Q5_0: format_tiles(Q5_0, p, u0, count, tiles); break;
        case Q5_1: format_tiles(Q5_1, p, u0, count, tiles); break;
        case Q8_0: format_tiles(Q8_0, p, u0, count, tiles); break;
        case Q4_K: format_tiles(Q4_K, p, u0, count, tiles); break;
        case Q5_K: format_tiles(Q5_K, p, u0, count, tiles); break;
        default: format_tiles(Q6_K, p, u0, count, tiles); break;
    }
}

/* Units [u0, u0 + count) of a part's 16 columns from `first` as B tiles (quant.h): straight
   from a repacked Q4_0 / Q4_1 / Q8_0 panel, else through the GEMM's unpacking into `scratch`. */
void part_bf16_tiles(const detinf_qpart *part, int64_t first, int64_t units, int64_t u0, int64_t count,
                     qpanel *scratch, uint16_t *tiles) {
    const int64_t format = stored_format(part->format);
    const uint8_t *panel = part->data + first * part->row_bytes;
    if (part->format >= X16 && format == Q4_0) x16_format_tiles(Q4_0, panel, units, u0, count, tiles);
    else if (part->format >= X16 && format == Q4_1) x16_format_tiles(Q4_1, panel, units, u0, count, tiles);
    else if (part->format >= X16 && format == Q8_0) x16_format_tiles(Q8_0, panel, units, u0, count, tiles);
    else {
        unpack_columns16(part, first, units, u0, count, scratch);
        qpanel_bf16_tiles(format, scratch, u0, count, tiles);
    }
}

#endif
