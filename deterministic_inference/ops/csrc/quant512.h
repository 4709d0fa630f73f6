/* AVX-512 pieces shared by the quantized GEMM's unpacking (quant_unpack512.c), its fused few-row path
   (quant_gemv512.c) and its tiles (quant_kernels.c, quant_amx.c: x_word, as_float). Most turn GGUF
   blocks of 16 rows into vectors of 4 values of each of the 16 columns (the lanes VPDPBUSD multiplies),
   moving integers only. The core is a transpose: 16 bytes of each column's row become 4 vectors, vector
   i holding bytes 4i..4i+3 of every column in column order; fields, nibbles and high bits are then cut
   out of all 16 columns at once. */

#ifndef DETINF_QUANT512_H
#define DETINF_QUANT512_H

#include "quant.h"

#if defined(DETINF_Q_AVX512)

/* z[a] (a < 4): 128-bit lane L = the 16 bytes at off of column a + 4L's row; bytes from `valid` on
   (when valid < 16) read as zero without touching memory, so nothing is read past a row's end. */
INLINE void load_pieces(const uint8_t *const *rows, int64_t off, int64_t valid, __m512i *z) {
    const __mmask16 keep = valid >= 16 ? 0xFFFF : (__mmask16)((1u << valid) - 1u);
#pragma GCC unroll 4
    for (int a = 0; a < 4; a++) {
        __m512i v = _mm512_castsi128_si512(_mm_maskz_loadu_epi8(keep, rows[a] + off));
        v = _mm512_inserti32x4(v, _mm_maskz_loadu_epi8(keep, rows[a + 4] + off), 1);
        v = _mm512_inserti32x4(v, _mm_maskz_loadu_epi8(keep, rows[a + 8] + off), 2);
        z[a] = _mm512_inserti32x4(v, _mm_maskz_loadu_epi8(keep, rows[a + 12] + off), 3);
    }
}

/* out[i] = bytes [off + 4i, off + 4i + 4) of rows[0], ..., rows[15], for i < 4. */
INLINE void transpose16v(const uint8_t *const *rows, int64_t off, int64_t valid, __m512i *out) {
    __m512i z[4];
    if (valid >= 16) {
#pragma GCC unroll 4
        for (int a = 0; a < 4; a++) { /* z[a]: 128-bit lane L = the 16 bytes of column a + 4L */
            __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(rows[a] + off)));
            v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rows[a + 4] + off)), 1);
            v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rows[a + 8] + off)), 2);
            z[a] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rows[a + 12] + off)), 3);
        }
    } else {
        load_pieces(rows, off, valid, z);
    }
    const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    out[0] = _mm512_unpacklo_epi64(t0, t2);
    out[1] = _mm512_unpackhi_epi64(t0, t2);
    out[2] = _mm512_unpacklo_epi64(t1, t3);
    out[3] = _mm512_unpackhi_epi64(t1, t3);
}

INLINE void transpose16(const uint8_t *const *rows, int64_t off, __m512i *out) { transpose16v(rows, off, 16, out); }

/* Where a K-format half panel's 16 columns are read from: their stored rows, or (panel != NULL) a repacked
   panel (quant_repack.c) that keeps every whole 16-byte piece of the rows' super-blocks already
   transposed: the 4 vectors transpose16 makes of bytes off..off+15 at panel + 16 off. */
typedef struct {
    const uint8_t *const *rows;
    const uint8_t *panel;
    int64_t supers; /* the panel's super-blocks per column */
} qsrc;

/* transpose16 of bytes [off, off + 16) (off a multiple of 16) from either source: the same vectors */
INLINE void piece16(const qsrc *src, int64_t off, __m512i *out) {
    if (!src->panel) {
        transpose16(src->rows, off, out);
        return;
    }
#pragma GCC unroll 4
    for (int a = 0; a < 4; a++) out[a] = _mm512_loadu_si512(src->panel + 16 * off + 64 * a);
}

INLINE void piece32(const qsrc *src, int64_t off, __m512i *out) {
    piece16(src, off, out);
    piece16(src, off + 16, out + 4);
}

INLINE __m512i x_word(const int8_t *x) { /* 4 activation bytes broadcast to every lane */
    int32_t word;
    memcpy(&word, x, sizeof word);
    return _mm512_set1_epi32(word);
}

typedef int32_t __attribute__((may_alias)) word32; /* 4 activation bytes read as one word */

/* VPDPBUSD of acc, w's unsigned bytes and the 4 signed bytes at x broadcast to every lane (x_word), the
   broadcast done by the instruction's own memory operand ({1to16}): GCC 12 keeps a separate VPBROADCASTD
   for the intrinsic, and in the few-row loops, which use each broadcast once, dropping those instructions
   made Q4_0 1.03-1.11x, Q8_0 up to 1.08x and Q4_K 1.02-1.03x faster at 8-64 rows (AMD Zen 4). The same
   instruction, so the same exact integers. */
INLINE __m512i dot_x_word(__m512i acc, __m512i w, const int8_t *x) {
#if defined(__GNUC__) /* GCC and clang: extended asm */
    __asm__("vpdpbusd %[x]%{1to16%}, %[w], %[acc]" : [acc] "+v"(acc) : [w] "v"(w), [x] "m"(*(const word32 *)x));
    return acc;
#else
    return _mm512_dpbusd_epi32(acc, w, x_word(x));
#endif
}

/* init + the exact dot products of groups g[0..groups) (16 columns; groups even) with the activation bytes
   x: two chains, added exactly, so half the dependent latency of one */
INLINE __m512i dot_groups(__m512i init, const __m512i *g, const int8_t *x, int groups) {
    __m512i even = init, odd = _mm512_setzero_si512();
    for (int i = 0; i < groups; i += 2) {
        even = dot_x_word(even, g[i], x + 4 * i);
        odd = dot_x_word(odd, g[i + 1], x + 4 * i + 4);
    }
    return _mm512_add_epi32(even, odd);
}

/* int32 -> fp32, rounded to nearest even (exact below 2^24) */
INLINE __m512 as_float(__m512i v) { return _mm512_cvt_roundepi32_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

INLINE __m512i low_nibbles(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
INLINE __m512i high_nibbles(__m512i v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }

/* v + 16 in the bytes whose `bit` is set in `bits` (the fifth bit of a 5-bit value) */
INLINE __m512i add_bit4(__m512i v, __m512i bits, __m512i bit) {
    return _mm512_mask_add_epi8(v, _mm512_test_epi8_mask(bits, bit), v, _mm512_set1_epi8(16));
}

/* Q5_0 / Q5_1: add the fifth bits, qh (bit l = value l; one u32 per column) */
INLINE void add_qh32(__m512i qh, __m512i *g) {
    /* byte offset of each dword's own word within its 128-bit lane, in all four of its bytes */
    const __m512i own_word = _mm512_set_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0, 0x0C0C0C0C, 0x08080808,
                                              0x04040404, 0, 0x0C0C0C0C, 0x08080808, 0x04040404, 0,
                                              0x0C0C0C0C, 0x08080808, 0x04040404, 0);
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) { /* values 4i..4i+3: bits 4 (i % 2).. of byte i / 2 of the word */
        const __m512i pick = _mm512_add_epi32(own_word, _mm512_set1_epi32((i / 2) * 0x01010101));
        const __m512i spread = _mm512_shuffle_epi8(qh, pick);
        g[i] = add_bit4(g[i], spread, _mm512_set1_epi32((int)(0x08040201u << (4 * (i % 2)))));
    }
}

/* The bytes of pf's share of the next panel a pass of `steps` steps asks for at each step (0: no share):
   one division per pass instead of two per step. perf put ~10% of a 425-row Q4_0 GEMM's samples beside
   those divisions, but without them it measured the same (0.97-1.02x, AMD Zen 4): the core overlapped them. */
INLINE int64_t next_share_step(const pass_prefetch *pf, int64_t steps) {
    return pf->next_bytes ? (pf->next_bytes + steps - 1) / steps : 0;
}

/* Step `step` of a pass: its part (per_step bytes, next_share_step) of pf's share of the next panel, into L2
   (a few lines a step: a burst of hundreds at the start of the pass gained nothing, AMD Zen 4). */
INLINE void prefetch_next_share(const pass_prefetch *pf, int64_t per_step, int64_t step) {
    const int64_t from = per_step * step, end = from + per_step < pf->next_bytes ? from + per_step : pf->next_bytes;
    for (int64_t line = from & ~(int64_t)63; line < end; line += 64)
        _mm_prefetch((const char *)(pf->next + line), _MM_HINT_T1);
}

/* Ask for every line of [at, at + bytes) (a prefetch past a panel's end is harmless). */
INLINE void prefetch_lines(const uint8_t *at, int64_t bytes) {
    for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch((const char *)(at + line), _MM_HINT_T0);
}

/* At block b of a repacked 32-value panel (quant_repack.c), when b starts a pair: ask for the pair `ahead`
   blocks on (`ahead` even; past the panel's end: harmless) */
INLINE void prefetch_x16_pair(int64_t format, const uint8_t *panel, int64_t b, int64_t ahead) {
    if (!(b & 1)) prefetch_lines(panel + x16_pair_at(format, b + ahead), 2 * x16_block_bytes(format));
}

/* Ask for the line `ahead` bytes past `off` of every column's row: the next panel's data at the place
   this panel is read (16 short streams in parallel are more than the hardware prefetchers follow). */
INLINE void prefetch_rows(const uint8_t *const *rows, int64_t off, int64_t ahead) {
#pragma GCC unroll 16
    for (int c = 0; c < QCOLS; c++) _mm_prefetch((const char *)(rows[c] + off + ahead), _MM_HINT_T0);
}

/* Ask for the K-format super-block at byte base of either source, `supers` super-blocks ahead in a
   repacked panel (one stream) or `ahead` bytes ahead in each stored row (prefetch_rows) */
INLINE void prefetch_super(int64_t format, const qsrc *src, int64_t base, int64_t supers, int64_t ahead) {
    const int64_t bytes = format_block_bytes(format);
    if (src->panel) {
        prefetch_lines(src->panel + 16 * (base + supers * bytes), 16 * bytes);
        return;
    }
    for (int line = 0; line < 256 && line < bytes + 63; line += 64) prefetch_rows(src->rows, base + line, ahead);
}

/* 16 consecutive fp16 numbers at `at`, as fp32 (exact) */
INLINE __m512 halves16(const uint8_t *at) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)at)); }

/* 16 fp16 numbers at rows[c] + off, as fp32 (exact) */
INLINE __m512 halves_at(const uint8_t *const *rows, int64_t off) {
    uint16_t h[QCOLS];
#pragma GCC unroll 16
    for (int c = 0; c < QCOLS; c++) memcpy(&h[c], rows[c] + off, sizeof h[c]);
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
}

/* The 32-bit field at byte `at` (a multiple of 2) of dwords d[] (as load_dwords leaves them) */
INLINE __m512i field32(const __m512i *d, int at) {
    if (at % 4 == 0) return d[at / 4];
#if defined(__AVX512VBMI2__)
    return _mm512_shrdi_epi32(d[at / 4], d[at / 4 + 1], 16);
#else
    return _mm512_or_si512(_mm512_srli_epi32(d[at / 4], 16), _mm512_slli_epi32(d[at / 4 + 1], 16));
#endif
}

/* The fp16 number at byte `at` (a multiple of 2) of dwords d[], as fp32 (exact) */
INLINE __m512 half16(const __m512i *d, int at) {
    const __m512i word = at % 4 == 0 ? d[at / 4] : _mm512_srli_epi32(d[at / 4], 16);
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(word));
}

/* The bytes of `count` (1 or 2) consecutive blocks of a 32-value format at byte `base` of the rows
   (whose length is row_bytes: nothing past it is read), transposed 16 at a time into dwords d[]. */
INLINE void load_pair(int64_t format, const uint8_t *const *rows, int64_t base, int64_t row_bytes, int count,
                      __m512i *d) {
    const int pieces = (count * (int)format_block_bytes(format) + 15) / 16;
    if (base + 16 * pieces <= row_bytes) {
#pragma GCC unroll 5
        for (int piece = 0; piece < pieces; piece++) transpose16(rows, base + 16 * piece, d + 4 * piece);
        return;
    }
    for (int piece = 0; piece < pieces; piece++) { /* the row's last blocks */
        const int64_t at = base + 16 * piece, valid = row_bytes - at < 16 ? row_bytes - at : 16;
        transpose16v(rows, at, valid, d + 4 * piece);
    }
}

/* Block i (0 or 1) of the pair in d[]: its 8 groups of values g[], its scale and (Q4_1, Q5_1) min. Blocks
   are 18..34 bytes, so fields sit at even, not always 4-aligned, offsets. */
INLINE void pair_unit(int64_t format, const __m512i *d, int i, __m512i *g, __m512 *scale, __m512 *min) {
    const int o = i * (int)format_block_bytes(format);
    const int qs = format == Q8_0 || format == Q4_0 ? 2 : (format == Q4_1 ? 4 : (format == Q5_0 ? 6 : 8));
    *scale = half16(d, o);
    if (format_has_min(format)) *min = half16(d, o + 2);
    if (format == Q8_0) {
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) g[j] = _mm512_xor_si512(field32(d, o + qs + 4 * j), _mm512_set1_epi8((char)0x80));
        return;
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        const __m512i raw = field32(d, o + qs + 4 * j);
        g[j] = low_nibbles(raw);
        g[j + 4] = high_nibbles(raw);
    }
    if (format == Q5_0 || format == Q5_1) add_qh32(field32(d, o + qs - 4), g);
}

/* Q4_K / Q5_K scales of the super-block at byte base (d, dmin, 12 bytes of 6-bit scales and mins) into
   p's super-block sb: d, m (= dmin), sc[8], mn[8] of 16 columns. */
INLINE void q45k_scales(const qsrc *src, int64_t base, int64_t sb, qpanel *p) {
    __m512i t[4];
    piece16(src, base, t);
    const __m512i six = _mm512_set1_epi32(63), four = _mm512_set1_epi32(15), two = _mm512_set1_epi32(3);
    _mm512_storeu_ps(p->d + sb * QCOLS, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(t[0])));
    _mm512_storeu_ps(p->m + sb * QCOLS, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(t[0], 16))));
    int32_t *sc = p->sc + sb * 16 * QCOLS, *mn = p->mn + sb * 8 * QCOLS;
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        const unsigned at = 8u * (unsigned)i;
        const __m512i hi_sc = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(t[1], at + 6), two), 4);
        const __m512i hi_m = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(t[2], at + 6), two), 4);
        const __m512i lo_sc = _mm512_and_si512(_mm512_srli_epi32(t[3], at), four);
        const __m512i lo_m = _mm512_and_si512(_mm512_srli_epi32(t[3], at + 4), four);
        _mm512_storeu_si512(sc + i * QCOLS, _mm512_and_si512(_mm512_srli_epi32(t[1], at), six));
        _mm512_storeu_si512(mn + i * QCOLS, _mm512_and_si512(_mm512_srli_epi32(t[2], at), six));
        _mm512_storeu_si512(sc + (4 + i) * QCOLS, _mm512_or_si512(lo_sc, hi_sc));
        _mm512_storeu_si512(mn + (4 + i) * QCOLS, _mm512_or_si512(lo_m, hi_m));
    }
}

/* Q6_K's n (1 or 2) pieces from byte `at` (16 | at) of the super-block at byte base: the vectors piece16
   makes, from either source (a repacked panel keeps them where k_piece_at says; the two pieces read
   together, 8-9, 10-11 or 4h + 2 run, 4h + 2 run + 1, stay side by side there) */
INLINE void q6k_pieces(const qsrc *src, int64_t base, int64_t at, int n, __m512i *out) {
    if (!src->panel) {
        for (int i = 0; i < n; i++) piece16(src, base + at + 16 * i, out + 4 * i);
        return;
    }
    const uint8_t *place = src->panel + k_piece_at(Q6_K, base / format_block_bytes(Q6_K), at / 16);
    for (int a = 0; a < 4 * n; a++) out[a] = _mm512_loadu_si512(place + 64 * a);
}

/* Q6_K scales of the super-block at byte base (16 int8 at 192) into p's super-block sb, from either source */
INLINE void q6k_scales(const qsrc *src, int64_t base, int64_t sb, qpanel *p) {
    __m512i t[4];
    q6k_pieces(src, base, 192, 1, t);
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) {
        const __m512i scale = _mm512_srai_epi32(_mm512_slli_epi32(t[j / 4], 24u - 8u * (unsigned)(j % 4)), 24);
        _mm512_storeu_si512(p->sc + (sb * 16 + j) * QCOLS, scale);
    }
}

/* Q6_K's d (fp16 at 208) of the super-block at byte base into p's super-block sb, from either source (a
   repacked panel keeps the 16 columns' d as 16 fp16 numbers at k_rest_at; the loops read it after the
   pieces, as the panel lays them out) */
INLINE void q6k_d(const qsrc *src, int64_t base, int64_t sb, qpanel *p) {
    const __m512 d = src->panel ? halves16(src->panel + k_rest_at(Q6_K, src->supers, base / format_block_bytes(Q6_K)))
                                : halves_at(src->rows, base + 208);
    _mm512_storeu_ps(p->d + sb * QCOLS, d);
}

/* Q5_K's fifth bits (32 bytes at base + 16: bit j of byte l is value l of sub-block j), zero for Q4_K */
INLINE void q45k_high_bits(int64_t format, const qsrc *src, int64_t base, __m512i *qh) {
    if (format == Q5_K) {
        piece32(src, base + 16, qh);
        return;
    }
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) qh[i] = _mm512_setzero_si512();
}

/* Q4_K / Q5_K: the nibble bytes 32t..32t+31 of the super-block at byte base, shared by sub-blocks 2t (low
   nibbles) and 2t + 1 (high) */
INLINE void q45k_nibbles(int64_t format, const qsrc *src, int64_t base, int t, __m512i *raw) {
    piece32(src, base + (format == Q4_K ? 16 : 48) + 32 * t, raw);
}

/* Q4_K / Q5_K sub-block 2t + high of those bytes, with Q5_K's fifth bits */
INLINE void q45k_unit(int64_t format, const __m512i *raw, const __m512i *qh, int t, int high, __m512i *g) {
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) {
        g[i] = high ? high_nibbles(raw[i]) : low_nibbles(raw[i]);
        if (format == Q5_K) g[i] = add_bit4(g[i], qh[i], _mm512_set1_epi8((char)(1 << (2 * t + high))));
    }
}

/* Q6_K half h of the super-block at byte base, from either source: its 32 bytes of qh, and its 32-byte
   run `run` of ql */
INLINE void q6k_high_bits(const qsrc *src, int64_t base, int h, __m512i *qh) {
    q6k_pieces(src, base, 128 + 32 * h, 2, qh);
}

INLINE void q6k_low_bits(const qsrc *src, int64_t base, int h, int run, __m512i *ql) {
    q6k_pieces(src, base, 64 * h + 32 * run, 2, ql);
}

/* Q6_K unit 4h + t: nibble t / 2 of ql run t % 2 with bits 2t, 2t + 1 of qh above it (shifting 16-bit
   lanes moves bits across bytes; every byte then keeps only its own bits 0..3 from ql, 4..5 from qh) */
INLINE void q6k_unit(const __m512i *ql, const __m512i *qh, int t, __m512i *g) {
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) {
        const __m512i low = t / 2 ? _mm512_srli_epi16(ql[i], 4) : ql[i];
        const __m512i top = t < 3 ? _mm512_slli_epi16(qh[i], (unsigned)(4 - 2 * t)) : _mm512_srli_epi16(qh[i], 2);
        const __m512i merged = _mm512_ternarylogic_epi32(low, top, _mm512_set1_epi8(15), 0xE4); /* c ? a : b */
        g[i] = _mm512_and_si512(merged, _mm512_set1_epi8(63));
    }
}

#endif
#endif
