/* AVX-512 unpacking of GGUF blocks into a panel's scratch: the same bytes as the portable loop of
   quant_unpack.c (integer moves only, quant512.h), in fewer instructions. */

#include "quant512.h"

#if defined(DETINF_Q_AVX512)

INLINE void store_unit(uint8_t *w, const __m512i *g) {
    for (int i = 0; i < 8; i++) _mm512_store_si512((__m512i *)(w + i * 64), g[i]);
}

INLINE void unpack_blocks_of(int64_t format, const uint8_t *const *rows, int64_t row_bytes, int64_t u0,
                             int64_t units, qpanel *p) {
    const int64_t bytes = format_block_bytes(format), ahead = ACC_COLS * row_bytes;
    for (int64_t uu = 0; uu < units; uu += 2) {
        const int64_t base = (u0 + uu) * bytes;
        const int count = units - uu >= 2 ? 2 : 1;
        prefetch_rows(rows, base, ahead); /* every line: pairs of blocks advance <= 64 bytes (Q8_0: 68) */
        if (2 * bytes > 64) prefetch_rows(rows, base + 64, ahead);
        __m512i d[20];
        load_pair(format, rows, base, row_bytes, count, d);
#pragma GCC unroll 2
        for (int i = 0; i < count; i++) {
            __m512i g[8];
            __m512 scale, min = _mm512_setzero_ps();
            pair_unit(format, d, i, g, &scale, &min);
            _mm512_storeu_ps(p->d + (uu + i) * QCOLS, scale);
            if (format_has_min(format)) _mm512_storeu_ps(p->m + (uu + i) * QCOLS, min);
            store_unit(p->w + (uu + i) * UNIT_BYTES, g);
        }
    }
}

static void unpack_blocks(int64_t format, const uint8_t *const *rows, int64_t row_bytes, int64_t u0, int64_t units,
                          qpanel *p) {
    switch (format) { /* each format with its offsets as constants */
        case Q4_0: unpack_blocks_of(Q4_0, rows, row_bytes, u0, units, p); break;
        case Q4_1: unpack_blocks_of(Q4_1, rows, row_bytes, u0, units, p); break;
        case Q5_0: unpack_blocks_of(Q5_0, rows, row_bytes, u0, units, p); break;
        case Q5_1: unpack_blocks_of(Q5_1, rows, row_bytes, u0, units, p); break;
        default: unpack_blocks_of(Q8_0, rows, row_bytes, u0, units, p); break;
    }
}

static void unpack_q45k(int64_t format, const qsrc *src, int64_t base, uint8_t *w) {
    __m512i qh[8];
    q45k_high_bits(format, src, base, qh);
    for (int t = 0; t < 4; t++) {
        __m512i raw[8];
        q45k_nibbles(format, src, base, t, raw);
        for (int high = 0; high < 2; high++) {
            __m512i g[8];
            q45k_unit(format, raw, qh, t, high, g);
            store_unit(w + (2 * t + high) * UNIT_BYTES, g);
        }
    }
}

static void unpack_q6k(const qsrc *src, int64_t base, uint8_t *w) {
    for (int h = 0; h < 2; h++) {
        __m512i qh[8];
        q6k_high_bits(src, base, h, qh);
        for (int run = 0; run < 2; run++) {
            __m512i ql[8];
            q6k_low_bits(src, base, h, run, ql);
            for (int t = run; t < 4; t += 2) {
                __m512i g[8];
                q6k_unit(ql, qh, t, g);
                store_unit(w + (4 * h + t) * UNIT_BYTES, g);
            }
        }
    }
}

/* Super-blocks of units [u0, u0 + units) of a K format from either source */
static void unpack_supers(int64_t format, const qsrc *src, int64_t ahead, int64_t u0, int64_t units, qpanel *p) {
    for (int64_t sb = 0; sb < units / 8; sb++) {
        const int64_t base = (u0 / 8 + sb) * format_block_bytes(format);
        uint8_t *w = p->w + sb * 8 * UNIT_BYTES;
        prefetch_super(format, src, base, 2, ahead); /* a repacked panel: two super-blocks ahead */
        if (format == Q6_K) {
            unpack_q6k(src, base, w);
            q6k_scales(src, base, sb, p);
            q6k_d(src, base, sb, p);
        } else {
            unpack_q45k(format, src, base, w);
            q45k_scales(src, base, sb, p);
        }
    }
}

void unpack_chunk_avx512(int64_t format, const uint8_t *const *rows, int64_t row_bytes, int64_t u0, int64_t units,
                         qpanel *p) {
    if (format_block_values(format) == UNIT) {
        unpack_blocks(format, rows, row_bytes, u0, units, p);
        return;
    }
    const qsrc src = {rows, NULL, 0};
    unpack_supers(format, &src, ACC_COLS * row_bytes, u0, units, p);
}

/* The same bytes from a repacked Q4_K / Q5_K / Q6_K half panel (quant_repack.c) */
void unpack_k_x16_avx512(int64_t format, const uint8_t *panel, int64_t supers, int64_t u0, int64_t units,
                         qpanel *p) {
    const qsrc src = {NULL, panel, supers};
    unpack_supers(format, &src, 0, u0, units, p);
}

#endif
