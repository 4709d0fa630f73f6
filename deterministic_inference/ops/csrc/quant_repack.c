/* Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K weights repacked once at load into 16-column panels (format id + X16),
   so the GEMM reads them in the order VPDPBUSD consumes them instead of transposing 16 rows' blocks on
   every call.

   LAYOUT of a part with N output columns (N a multiple of 16) of K = 32 * B values: panel p holds output
   columns 16p .. 16p + 15 (after the row order) in 16 * row_bytes bytes (the repacked part is exactly as
   large as the stored one). With H = 1 (Q4_0, Q8_0: d) or 2 (Q4_1: d, m) fp16 fields per block and
   Q = 16 (Q4_0, Q4_1) or 32 (Q8_0) quant bytes per column and block, a block takes P = 32 H + 16 Q bytes
   (x16_block_bytes), and the blocks go in pairs: pair i (blocks 2i + e, e < n; n = 2, or 1 for the last
   block when B is odd) at 2 P i holds
     fields [H][n][16] fp16       field f of column c's block 2i + e at 2 P i + 32 (f n + e) + 2 c
     qs     [n][Q/4][16][4] u8    at 2 P i + 32 H n + 16 Q e + 64 t + 4 c + j: byte 4 t + j of column c's Q
                                  bytes
   (quant.h's x16_field_at, x16_qs_at). A pass over the blocks so reads its panel as one ascending stream,
   every pair from a 64-byte line (2P = 576, 640, 1088). With all of a panel's fields ahead of all its
   quants, two streams, one thread read Q4_0 panels at ~2/3 of the rate it streams memory (1 row, AMD Zen
   4: the hardware prefetchers did not keep both ahead; prefetch instructions did not make up for it).
   Q4_0 / Q4_1: a byte still holds value 4 t + j in its low nibble and value 16 + 4 t + j in its high
   nibble, so the low nibbles of the 64 bytes at t are group t of the unpacked unit and the high nibbles
   group t + 4. Q8_0: a byte holds value 4 t + j plus 128 (its sign bit flipped), the unsigned integer the
   unpacked unit holds, so the 64 bytes at t are group t as they are.

   K formats (super-blocks of S = 144, 176 and 210 bytes): the panel's 16 rows take 16 S bytes per
   super-block. Each whole 16-byte piece P of super-block s (9, 11, 13 of them) is 4 vectors of 64 bytes,
   byte 4 i + j of column c's piece at k_piece_at(s, P) + 64 i + 4 c + j: the vectors the stored path's
   transposition makes (quant512.h, piece16), which the K paths then take apart exactly as before. The
   bytes past the last whole piece (Q6_K's fp16 d, 2 bytes) go column by column, as 16 fp16 numbers at
   k_rest_at(s). Q4_K and Q5_K keep super-block s at 16 S s in stored order, so the stored byte offset o
   (16 | o) is read at 16 o. Q6_K's pieces are placed in the order its loops read them, its super-blocks in
   pairs whose pieces start 64-byte lines (quant.h, k_piece_at): stored in order, with every other
   super-block 32 bytes off a line, one thread read Q6_K panels at ~2/3 of its memory rate (AMD Zen 4).

   Only integers move: each output is still the float sequence of quant.h for the format (blocks
   ascending, the same operations), so a repacked part gives the stored part's bits; builds that do not
   repack (detinf_quant_repacks) read the stored layout and give the same bits too. */

#include "quant512.h"

/* 1 when this build reads `format` faster repacked (the AVX-512 paths), else 0. */
int detinf_quant_repacks(int64_t format) {
#if defined(DETINF_Q_AVX512)
    return format == Q4_0 || format == Q4_1 || format == Q8_0 || format_block_values(format) == SUPER;
#else
    (void)format;
    return 0;
#endif
}

/* K formats: each super-block's whole 16-byte pieces transposed, then its remaining bytes column by
   column (the layout above) */
static void repack_supers(int64_t format, const uint8_t *src, const int64_t *row_order, int64_t row_bytes,
                          int64_t col0, int64_t cols, uint8_t *dst) {
    const int64_t bytes = format_block_bytes(format), pieces = bytes / 16, rest = bytes % 16;
    const int64_t supers = row_bytes / bytes;
    for (int64_t panel = col0 / QCOLS; panel < (col0 + cols) / QCOLS; panel++) {
        uint8_t *out = dst + panel * QCOLS * row_bytes;
        for (int c = 0; c < QCOLS; c++) {
            const int64_t column = panel * QCOLS + c;
            const uint8_t *row = src + (row_order ? row_order[column] : column) * row_bytes;
            for (int64_t s = 0; s < supers; s++) {
                const uint8_t *super = row + bytes * s;
                for (int64_t piece = 0; piece < pieces; piece++) {
                    uint8_t *place = out + k_piece_at(format, s, piece) + 4 * c;
                    for (int i = 0; i < 4; i++) memcpy(place + 64 * i, super + 16 * piece + 4 * i, 4);
                }
                memcpy(out + k_rest_at(format, supers, s) + rest * c, super + 16 * pieces, (size_t)rest);
            }
        }
    }
}

/* Output columns [col0, col0 + cols) (multiples of 16) of a stored Q4_0 / Q4_1 / Q8_0 / K-format part
   -> their panels in dst (the whole repacked part; panel p at 16 p row_bytes). Column j reads stored row
   row_order[j] (NULL: j). */
void detinf_repack(int64_t format, const uint8_t *src, const int64_t *row_order, int64_t row_bytes, int64_t col0,
                   int64_t cols, uint8_t *dst) {
    if (format_block_values(format) == SUPER) {
        repack_supers(format, src, row_order, row_bytes, col0, cols, dst);
        return;
    }
    const int fields = x16_fields(format);
    const int64_t block_bytes = format_block_bytes(format), blocks = row_bytes / block_bytes;
    const int64_t qs_bytes = x16_qs_bytes(format);
    const uint8_t flip = format == Q8_0 ? 0x80 : 0; /* Q8_0: q + 128, the unsigned integer VPDPBUSD reads */
    for (int64_t panel = col0 / QCOLS; panel < (col0 + cols) / QCOLS; panel++) {
        uint8_t *head = dst + panel * QCOLS * row_bytes;
        for (int c = 0; c < QCOLS; c++) {
            const int64_t column = panel * QCOLS + c;
            const uint8_t *row = src + (row_order ? row_order[column] : column) * row_bytes;
            for (int64_t b = 0; b < blocks; b++) {
                const uint8_t *block = row + block_bytes * b;
                for (int f = 0; f < fields; f++)
                    memcpy(head + x16_field_at(format, blocks, b, f) + 2 * c, block + 2 * f, 2);
                uint8_t *qs = head + x16_qs_at(format, blocks, b);
                for (int t = 0; t < qs_bytes / 64; t++)
                    for (int j = 0; j < 4; j++) qs[64 * t + 4 * c + j] = block[2 * fields + 4 * t + j] ^ flip;
            }
        }
    }
}

/* Column c of one repacked panel (at `panel`) back in the stored layout: row [row_bytes] gets the stored
   row's bytes, each moved back from where detinf_repack put it. */
static void unrepack_column(int64_t format, const uint8_t *panel, int64_t row_bytes, int c, uint8_t *row) {
    const int64_t bytes = format_block_bytes(format);
    if (format_block_values(format) == SUPER) {
        const int64_t pieces = bytes / 16, rest = bytes % 16;
        const int64_t supers = row_bytes / bytes;
        for (int64_t s = 0; s < supers; s++) {
            uint8_t *super = row + bytes * s;
            for (int64_t piece = 0; piece < pieces; piece++)
                for (int i = 0; i < 4; i++)
                    memcpy(super + 16 * piece + 4 * i, panel + k_piece_at(format, s, piece) + 64 * i + 4 * c, 4);
            memcpy(super + 16 * pieces, panel + k_rest_at(format, supers, s) + rest * c, (size_t)rest);
        }
        return;
    }
    const int fields = x16_fields(format);
    const int64_t blocks = row_bytes / bytes, qs_bytes = x16_qs_bytes(format);
    const uint8_t flip = format == Q8_0 ? 0x80 : 0;
    for (int64_t b = 0; b < blocks; b++) {
        uint8_t *block = row + bytes * b;
        for (int f = 0; f < fields; f++) memcpy(block + 2 * f, panel + x16_field_at(format, blocks, b, f) + 2 * c, 2);
        const uint8_t *qs = panel + x16_qs_at(format, blocks, b);
        for (int t = 0; t < qs_bytes / 64; t++)
            for (int j = 0; j < 4; j++) block[2 * fields + 4 * t + j] = qs[64 * t + 4 * c + j] ^ flip;
    }
}

/* Stored rows rows[0..count) (each in [0, N), checked by ops/repack.py) of a part detinf_repack wrote
   without a row order -> out [count][row_bytes], byte for byte the stored rows: the embedding lookup of a
   tied table reads them here instead of the file's pages the repack gave back. */
void detinf_unrepack_rows(int64_t format, const uint8_t *panels, int64_t row_bytes, const int64_t *rows,
                          int64_t count, uint8_t *out) {
    for (int64_t i = 0; i < count; i++)
        unrepack_column(format, panels + rows[i] / QCOLS * QCOLS * row_bytes, row_bytes, (int)(rows[i] % QCOLS),
                        out + i * row_bytes);
}

/* One unit's 16 fp16 fields at `at` -> 16 fp32 at out (exact conversions, so any path gives the same). */
static inline void x16_fields_f32(const uint8_t *at, float *out) {
#if defined(DETINF_Q_AVX512)
    _mm512_storeu_ps(out, halves16(at)); /* GCC left this as 16 scalar conversions */
#else
    for (int c = 0; c < QCOLS; c++) out[c] = f16_to_f32(load_u16(at + 2 * c));
#endif
}

/* One 4-bit unit's 256 repacked bytes q -> its unpacked unit w: the low nibbles are groups 0-3, the high
   nibbles groups 4-7 (the layout above). */
static inline void unpack_nibbles(const uint8_t *q, uint8_t *w) {
#if defined(DETINF_Q_AVX512)
    const __m512i low_mask = _mm512_set1_epi8(0x0F);
    for (int t = 0; t < X16_QS_BYTES / 64; t++) {
        const __m512i v = _mm512_loadu_si512(q + 64 * t);
        _mm512_storeu_si512(w + 64 * t, _mm512_and_si512(v, low_mask));
        _mm512_storeu_si512(w + X16_QS_BYTES + 64 * t, _mm512_and_si512(_mm512_srli_epi16(v, 4), low_mask));
    }
#else
    for (int i = 0; i < X16_QS_BYTES; i++) {
        w[i] = q[i] & 15;
        w[X16_QS_BYTES + i] = q[i] >> 4;
    }
#endif
}

/* Units [u0, u0 + units) of one 16-column panel (B blocks) into p: the bytes unpack_chunk writes for the
   stored format. */
void unpack_x16(int64_t format, const uint8_t *panel, int64_t blocks, int64_t u0, int64_t units, qpanel *p) {
#if defined(DETINF_Q_AVX512)
    if (format_block_values(format) == SUPER) { /* only AVX-512 builds repack K formats */
        unpack_k_x16_avx512(format, panel, blocks / 8, u0, units, p);
        return;
    }
#endif
    for (int64_t u = 0; u < units; u++) {
        const int64_t b = u0 + u;
#if defined(DETINF_Q_AVX512) /* one chunk ahead: at a few dozen rows the GEMM streams the weights from memory here */
        prefetch_x16_pair(format, panel, b, CHUNK_UNITS);
#endif
        x16_fields_f32(panel + x16_field_at(format, blocks, b, 0), p->d + u * QCOLS);
        if (x16_fields(format) == 2) x16_fields_f32(panel + x16_field_at(format, blocks, b, 1), p->m + u * QCOLS);
        const uint8_t *q = panel + x16_qs_at(format, blocks, b);
        uint8_t *w = p->w + u * UNIT_BYTES;
        if (format == Q8_0) { /* already the unit's bytes (UNIT_BYTES of them) */
            memcpy(w, q, UNIT_BYTES);
            continue;
        }
        unpack_nibbles(q, w);
    }
}

#if defined(DETINF_Q_AVX512)

/* Blocks the few-row loops below ask for ahead of the one they read, when they stream a panel's blocks
   themselves (pass_prefetch's `own`: from NEXT_PANEL_FROM_ROWS rows, the first panel a thread takes). Before
   its loop a panel asks for its first FUSED_AHEAD blocks (the loop's own requests never cover them), and in
   the loop, at each pair, the pair FUSED_AHEAD blocks on (prefetch_x16_pair). */
#define FUSED_AHEAD 16

/* Before a panel's loop: its first FUSED_AHEAD blocks (fields and quants, one run of bytes) */
INLINE void prefetch_x16_head(int64_t format, const uint8_t *panel, int64_t blocks) {
    prefetch_lines(panel, x16_block_bytes(format) * (blocks < FUSED_AHEAD ? blocks : FUSED_AHEAD));
}

/* Rows [0, R) x one panel, every block; acc rows of ACC_COLS floats (quant.h's sequence for the format:
   acc = fmaf(d_b * dx_b, (float)isum_b, acc), then for Q4_1 acc = fmaf(m_b * dx_b, (float)sx_b, acc)). */
INLINE void fused_x16(const uint8_t *panel, const xquant *xq, const int R, const int has_min, const pass_prefetch *pf,
                      float *acc) {
    const int64_t k = xq->k, blocks = k / UNIT, format = has_min ? Q4_1 : Q4_0;
    const int32_t offset = has_min ? 0 : 8; /* Q4_0's weights are q - 8 */
    const __m512i low_mask = _mm512_set1_epi8(0x0F), high_mask = _mm512_set1_epi8((char)0xF0);
    __m512 f[FUSED_ROWS];
    for (int r = 0; r < R; r++) f[r] = _mm512_setzero_ps(); /* acc = +0 */
    if (pf->own) prefetch_x16_head(format, panel, blocks);
    const int64_t share_step = next_share_step(pf, blocks);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *q = panel + x16_qs_at(format, blocks, b);
        if (pf->own) prefetch_x16_pair(format, panel, b, FUSED_AHEAD);
        prefetch_next_share(pf, share_step, b);
        const __m512 scale = halves16(panel + x16_field_at(format, blocks, b, 0));
        const __m512 min = has_min ? halves16(panel + x16_field_at(format, blocks, b, 1)) : _mm512_setzero_ps();
        __m512i low[4], high[4]; /* values 4t..4t+3, and 16 times values 16+4t..16+4t+3, of every column */
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            const __m512i v = _mm512_loadu_si512(q + 64 * t);
            low[t] = _mm512_and_si512(v, low_mask);
            high[t] = _mm512_and_si512(v, high_mask);
        }
        for (int r = 0; r < R; r++) {
            const int8_t *x = xq->q + r * k + b * UNIT;
            /* exact int32 sums; the high chain is 16 times the high nibbles' dot, shifted back exactly */
            __m512i sum_low = _mm512_set1_epi32(-offset * xq->s32[r * blocks + b]);
            __m512i sum_high = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                sum_low = dot_x_word(sum_low, low[t], x + 4 * t);
                sum_high = dot_x_word(sum_high, high[t], x + 16 + 4 * t);
            }
            const __m512i isum = _mm512_add_epi32(sum_low, _mm512_srai_epi32(sum_high, 4));
            const __m512 dx = _mm512_set1_ps(xq->d[r * blocks + b]);
            f[r] = _mm512_fmadd_ps(_mm512_mul_ps(scale, dx), as_float(isum), f[r]);
            if (has_min)
                f[r] = _mm512_fmadd_ps(_mm512_mul_ps(min, dx), _mm512_set1_ps(xq->sf[r * blocks + b]), f[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(acc + r * ACC_COLS, f[r]);
}

/* Q8_0 rows [0, R) x one panel (quant.h: acc = fmaf(d_b * dx_b, (float)isum_b, acc)); the stored bytes
   are q + 128, so isum_b = sum (q + 128) x - 128 sx_b, exact in int32 like every dot product here. */
INLINE void fused_x16_q8(const uint8_t *panel, const xquant *xq, const int R, const pass_prefetch *pf, float *acc) {
    const int64_t k = xq->k, blocks = k / UNIT;
    __m512 f[FUSED_ROWS];
    for (int r = 0; r < R; r++) f[r] = _mm512_setzero_ps(); /* acc = +0 */
    if (pf->own) prefetch_x16_head(Q8_0, panel, blocks);
    const int64_t share_step = next_share_step(pf, blocks);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *q = panel + x16_qs_at(Q8_0, blocks, b);
        if (pf->own) prefetch_x16_pair(Q8_0, panel, b, FUSED_AHEAD);
        prefetch_next_share(pf, share_step, b);
        const __m512 scale = halves16(panel + x16_field_at(Q8_0, blocks, b, 0));
        __m512i w[8]; /* group t: values 4t..4t+3 (+ 128) of every column */
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) w[t] = _mm512_loadu_si512(q + 64 * t);
        for (int r = 0; r < R; r++) {
            const int8_t *x = xq->q + r * k + b * UNIT;
            const __m512i isum = dot_groups(_mm512_set1_epi32(-128 * xq->s32[r * blocks + b]), w, x, 8);
            const __m512 dx = _mm512_set1_ps(xq->d[r * blocks + b]);
            f[r] = _mm512_fmadd_ps(_mm512_mul_ps(scale, dx), as_float(isum), f[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(acc + r * ACC_COLS, f[r]);
}

/* Rows [0, m) (m <= FUSED_ROWS) of one repacked panel of `format` (Q4_0, Q4_1 or Q8_0); acc [m][ACC_COLS]
   at the panel's first column. Each row count and format with its constants folded. */
void fused_x16_avx512(int64_t format, const uint8_t *panel, const xquant *xq, int64_t m, const pass_prefetch *pf,
                      float *acc) {
    if (format_block_values(format) == SUPER) {
        fused_k_x16_avx512(format, panel, xq, m, pf, acc);
        return;
    }
#define DETINF_X16(rows_)                                                          \
    case rows_:                                                                    \
        if (format == Q4_1) fused_x16(panel, xq, rows_, 1, pf, acc);              \
        else if (format == Q8_0) fused_x16_q8(panel, xq, rows_, pf, acc);          \
        else fused_x16(panel, xq, rows_, 0, pf, acc);                              \
        break;
    switch (m) {
        DETINF_X16(1)
        DETINF_X16(2)
        DETINF_X16(3)
        default: DETINF_X16(4)
    }
#undef DETINF_X16
}
#endif
