/* AVX-512 unpacking of GGUF blocks into a panel's scratch: the same bytes as the portable loop of
   quant_unpack.c (integer moves only), in fewer instructions. The core is a transpose: 16 bytes of each
   of the 16 columns' rows become 4 vectors, vector i holding bytes 4i..4i+3 of every column in column
   order; nibbles and high bits are then split off all 16 columns at once. */

#include "quant.h"

#if defined(DETINF_Q_AVX512)

/* z[a] (a < 4): 128-bit lane L = the 16 bytes at off of column a + 4L's row; bytes from `valid` on
   (when valid < 16) read as zero without touching memory, so nothing is read past a row's end. */
INLINE void load_pieces(const uint8_t *const *rows, int64_t off, int64_t valid, __m512i *z) {
    const __mmask16 keep = valid >= 16 ? 0xFFFF : (__mmask16)((1u << valid) - 1u);
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

INLINE void transpose32(const uint8_t *const *rows, int64_t off, __m512i *out) {
    transpose16(rows, off, out);
    transpose16(rows, off + 16, out + 4);
}

INLINE __m512i low_nibbles(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
INLINE __m512i high_nibbles(__m512i v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }

/* v + 16 in the bytes whose `bit` is set in `bits` (the fifth bit of a 5-bit value) */
INLINE __m512i add_bit4(__m512i v, __m512i bits, __m512i bit) {
    return _mm512_mask_add_epi8(v, _mm512_test_epi8_mask(bits, bit), v, _mm512_set1_epi8(16));
}

/* 16 nibble bytes at `off` (value i low nibble of byte i, value i + 16 high) -> the 8 groups of a unit */
INLINE void nibble_unit(const uint8_t *const *rows, int64_t off, __m512i *g) {
    __m512i raw[4];
    transpose16(rows, off, raw);
    for (int i = 0; i < 4; i++) {
        g[i] = low_nibbles(raw[i]);
        g[i + 4] = high_nibbles(raw[i]);
    }
}

/* Q5_0 / Q5_1: add the fifth bits, qh (bit l = value l; one u32 per column) */
INLINE void add_qh32(__m512i qh, __m512i *g) {
    /* byte offset of each dword's own word within its 128-bit lane, in all four of its bytes */
    const __m512i own_word = _mm512_set_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0, 0x0C0C0C0C, 0x08080808,
                                              0x04040404, 0, 0x0C0C0C0C, 0x08080808, 0x04040404, 0,
                                              0x0C0C0C0C, 0x08080808, 0x04040404, 0);
    for (int i = 0; i < 8; i++) { /* values 4i..4i+3: bits 4 (i % 2).. of byte i / 2 of the word */
        const __m512i pick = _mm512_add_epi32(own_word, _mm512_set1_epi32((i / 2) * 0x01010101));
        const __m512i spread = _mm512_shuffle_epi8(qh, pick);
        g[i] = add_bit4(g[i], spread, _mm512_set1_epi32((int)(0x08040201u << (4 * (i % 2)))));
    }
}

INLINE void store_unit(uint8_t *w, const __m512i *g) {
    for (int i = 0; i < 8; i++) _mm512_store_si512((__m512i *)(w + i * 64), g[i]);
}

/* Ask for the line `ahead` bytes past `off` of every column's row: the next panel's data at the place
   this panel is read (16 short streams in parallel are more than the hardware prefetchers follow). */
INLINE void prefetch_rows(const uint8_t *const *rows, int64_t off, int64_t ahead) {
    for (int c = 0; c < QCOLS; c++) _mm_prefetch((const char *)(rows[c] + off + ahead), _MM_HINT_T0);
}

/* 16 fp16 numbers at rows[c] + off, as fp32 (exact) */
INLINE __m512 halves_at(const uint8_t *const *rows, int64_t off) {
    uint16_t h[QCOLS];
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

/* Two consecutive blocks (or one: count 1) of a 32-value format at byte `base` of the rows, whose
   bytes end at row_bytes, into units uu, uu + 1 of the scratch. The blocks' bytes are transposed
   16 at a time; fields are then cut out of the dwords (blocks are 18..34 bytes: fields sit at even,
   not always 4-aligned, offsets). */
INLINE void unpack_pair(int64_t format, const uint8_t *const *rows, int64_t base, int64_t row_bytes, int count,
                        int64_t uu, qpanel *p) {
    const int bytes = (int)format_block_bytes(format), pieces = (count * bytes + 15) / 16;
    const int qs = format == Q8_0 || format == Q4_0 ? 2 : (format == Q4_1 ? 4 : (format == Q5_0 ? 6 : 8));
    __m512i d[20];
    if (base + 16 * pieces <= row_bytes) {
#pragma GCC unroll 5
        for (int piece = 0; piece < pieces; piece++) transpose16(rows, base + 16 * piece, d + 4 * piece);
    } else { /* the row's last blocks: nothing past its end is read */
        for (int piece = 0; piece < pieces; piece++) {
            const int64_t at = base + 16 * piece, valid = row_bytes - at < 16 ? row_bytes - at : 16;
            transpose16v(rows, at, valid, d + 4 * piece);
        }
    }
#pragma GCC unroll 2
    for (int i = 0; i < count; i++) {
        const int o = i * bytes;
        __m512i g[8];
        _mm512_storeu_ps(p->d + (uu + i) * QCOLS, half16(d, o));
        if (format_has_min(format)) _mm512_storeu_ps(p->m + (uu + i) * QCOLS, half16(d, o + 2));
        if (format == Q8_0) {
            for (int j = 0; j < 8; j++) g[j] = _mm512_xor_si512(field32(d, o + qs + 4 * j), _mm512_set1_epi8((char)0x80));
        } else {
            for (int j = 0; j < 4; j++) {
                const __m512i raw = field32(d, o + qs + 4 * j);
                g[j] = low_nibbles(raw);
                g[j + 4] = high_nibbles(raw);
            }
            if (format == Q5_0 || format == Q5_1) add_qh32(field32(d, o + qs - 4), g);
        }
        store_unit(p->w + (uu + i) * UNIT_BYTES, g);
    }
}

INLINE void unpack_blocks_of(int64_t format, const uint8_t *const *rows, int64_t row_bytes, int64_t u0,
                             int64_t units, qpanel *p) {
    const int64_t bytes = format_block_bytes(format), ahead = ACC_COLS * row_bytes;
    int64_t uu = 0;
    for (; uu + 2 <= units; uu += 2) {
        const int64_t base = (u0 + uu) * bytes;
        prefetch_rows(rows, base, ahead); /* every line: pairs of blocks advance <= 64 bytes (Q8_0: 68) */
        if (2 * bytes > 64) prefetch_rows(rows, base + 64, ahead);
        unpack_pair(format, rows, base, row_bytes, 2, uu, p);
    }
    if (uu < units) unpack_pair(format, rows, (u0 + uu) * bytes, row_bytes, 1, uu, p);
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

/* Q4_K / Q5_K scales of super-block s: bytes 0..15 = d, dmin, 12 bytes of 6-bit scales and mins */
static void q45k_scales(const uint8_t *const *rows, int64_t base, int64_t sb, qpanel *p) {
    __m512i t[4];
    transpose16(rows, base, t);
    const __m512i six = _mm512_set1_epi32(63), four = _mm512_set1_epi32(15), two = _mm512_set1_epi32(3);
    _mm512_storeu_ps(p->d + sb * QCOLS, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(t[0])));
    _mm512_storeu_ps(p->m + sb * QCOLS, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(t[0], 16))));
    for (int i = 0; i < 4; i++) {
        const unsigned at = 8u * (unsigned)i;
        const __m512i hi_sc = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(t[1], at + 6), two), 4);
        const __m512i hi_m = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(t[2], at + 6), two), 4);
        int32_t *sc = p->sc + sb * 16 * QCOLS, *mn = p->mn + sb * 8 * QCOLS;
        _mm512_storeu_si512(sc + i * QCOLS, _mm512_and_si512(_mm512_srli_epi32(t[1], at), six));
        _mm512_storeu_si512(mn + i * QCOLS, _mm512_and_si512(_mm512_srli_epi32(t[2], at), six));
        _mm512_storeu_si512(sc + (4 + i) * QCOLS, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(t[3], at), four), hi_sc));
        _mm512_storeu_si512(mn + (4 + i) * QCOLS, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(t[3], at + 4), four), hi_m));
    }
}

/* Q6_K scales of super-block s: 16 int8 at 192, d at 208 */
static void q6k_scales(const uint8_t *const *rows, int64_t base, int64_t sb, qpanel *p) {
    __m512i t[4];
    transpose16(rows, base + 192, t);
    for (int j = 0; j < 16; j++) {
        const __m512i scale = _mm512_srai_epi32(_mm512_slli_epi32(t[j / 4], 24u - 8u * (unsigned)(j % 4)), 24);
        _mm512_storeu_si512(p->sc + (sb * 16 + j) * QCOLS, scale);
    }
    _mm512_storeu_ps(p->d + sb * QCOLS, halves_at(rows, base + 208));
}

/* Q4_K / Q5_K: super-block s's 8 units; sub-blocks 2t and 2t + 1 share the nibble bytes 32t.. */
static void unpack_q45k(int64_t format, const uint8_t *const *rows, int64_t s, int64_t ahead, uint8_t *w) {
    const int64_t base = s * format_block_bytes(format), qs = base + (format == Q4_K ? 16 : 48);
    for (int line = 0; line < 192; line += 64) prefetch_rows(rows, base + line, ahead);
    __m512i qh[8];
    if (format == Q5_K) transpose32(rows, base + 16, qh);
    else
        for (int i = 0; i < 8; i++) qh[i] = _mm512_setzero_si512();
    for (int t = 0; t < 4; t++) {
        __m512i raw[8], low[8], high[8];
        transpose32(rows, qs + 32 * t, raw);
        for (int i = 0; i < 8; i++) {
            low[i] = low_nibbles(raw[i]);
            high[i] = high_nibbles(raw[i]);
            if (format == Q5_K) {
                low[i] = add_bit4(low[i], qh[i], _mm512_set1_epi8((char)(1 << (2 * t))));
                high[i] = add_bit4(high[i], qh[i], _mm512_set1_epi8((char)(1 << (2 * t + 1))));
            }
        }
        store_unit(w + (2 * t) * UNIT_BYTES, low);
        store_unit(w + (2 * t + 1) * UNIT_BYTES, high);
    }
}

/* Q6_K: unit 4h + t = nibble t / 2 of ql[64h + 32 (t % 2) ..] with bits 2t, 2t + 1 of qh[32h ..] above */
static void unpack_q6k(const uint8_t *const *rows, int64_t s, int64_t ahead, uint8_t *w) {
    const int64_t base = s * 210;
    for (int line = 0; line < 256; line += 64) prefetch_rows(rows, base + line, ahead);
    for (int h = 0; h < 2; h++) {
        __m512i ql[2][8], qh[8];
        transpose32(rows, base + 64 * h, ql[0]);
        transpose32(rows, base + 64 * h + 32, ql[1]);
        transpose32(rows, base + 128 + 32 * h, qh);
        for (int t = 0; t < 4; t++) {
            __m512i g[8];
            for (int i = 0; i < 8; i++) {
                const __m512i low = t / 2 ? high_nibbles(ql[t % 2][i]) : low_nibbles(ql[t % 2][i]);
                const __m512i top = _mm512_and_si512(_mm512_srli_epi16(qh[i], 2 * t), _mm512_set1_epi8(3));
                g[i] = _mm512_or_si512(low, _mm512_slli_epi16(top, 4));
            }
            store_unit(w + (4 * h + t) * UNIT_BYTES, g);
        }
    }
}

void unpack_chunk_avx512(int64_t format, const uint8_t *const *rows, int64_t row_bytes, int64_t u0, int64_t units,
                         qpanel *p) {
    const int64_t ahead = ACC_COLS * row_bytes;
    if (format_block_values(format) == UNIT) {
        unpack_blocks(format, rows, row_bytes, u0, units, p);
        return;
    }
    for (int64_t sb = 0; sb < units / 8; sb++) {
        const int64_t s = u0 / 8 + sb, base = s * format_block_bytes(format);
        uint8_t *w = p->w + sb * 8 * UNIT_BYTES;
        if (format == Q6_K) {
            unpack_q6k(rows, s, ahead, w);
            q6k_scales(rows, base, sb, p);
        } else {
            unpack_q45k(format, rows, s, ahead, w);
            q45k_scales(rows, base, sb, p);
        }
    }
}

#endif
