/* Quantized-weight GEMM of deterministic-inference: shared definitions (quant_act.c, quant_unpack.c,
   quant_gemm.c, quant_kernels.c, quant_convert.c).

   out[m, n] = sum over k of x[m, k] * w[n, k] (+ bias[n]), w kept in its GGUF block format (Q8_0, Q4_0,
   Q4_1, Q5_0, Q5_1: blocks of 32 values; Q4_K, Q5_K, Q6_K: super-blocks of 256), read in place.

   ACTIVATIONS. Each row of x (fp32, or bf16 read exactly as fp32) is quantized by itself, block by block
   (32 values for the 32-value formats, 256 for the K formats), never with a scale from another row:
     amax = the largest |x_i| of the block, taken on the bit patterns (exact, order free);
     amax = +inf or NaN: d = NaN, every q_i = 0 (so the output is NaN);
     amax < 2^-120 (0 included): d = 0, every q_i = 0 (so that 127 / amax cannot overflow);
     else d = amax / 127 (one fp32 division), s = 127 / amax (one fp32 division),
          q_i = x_i * s (one fp32 product) rounded to the nearest integer, ties to even (|q_i| <= 127).
   Integer sums of q over every 32 values (and every 16 values for the K formats) come along.

   WEIGHTS. Their integers are those of the format; their scales are fp16 numbers converted exactly.

   ONE OUTPUT, the fixed float sequence (every code path performs exactly these IEEE fp32 operations;
   fmaf = one rounding of a*b+c; (float)i = int32 -> fp32 rounding to nearest even):
     acc = +0
     32-value formats, blocks b = 0, 1, ... ascending (d_b, m_b the weight block's scale and min,
     dx_b, sx_b the activation block's scale and sum of q, isum_b = the exact int32 sum of
     w_int * q over the block with w_int = q8 (Q8_0), q4 - 8 (Q4_0), q5 - 16 (Q5_0), q4 (Q4_1), q5 (Q5_1)):
         acc = fmaf(d_b * dx_b, (float)isum_b, acc)
         Q4_1, Q5_1 only:  acc = fmaf(m_b * dx_b, (float)sx_b, acc)
     K formats, super-blocks s = 0, 1, ... ascending (dx_s the activation super-block's scale):
       Q4_K, Q5_K (d, dmin fp16; sc_j, m_j the 6-bit scale and min of the 32-value sub-block j):
         isum = sum_j sc_j * (sum over sub-block j of q_w * q_x),  msum = sum_j m_j * (sum of q_x in j)
         acc = fmaf(d * dx_s, (float)isum, acc);  acc = fmaf(-(dmin * dx_s), (float)msum, acc)
       Q6_K (d fp16; sc_j the int8 scale of the 16-value sub-block j; weights q6 - 32):
         isum = sum_j sc_j * (sum over sub-block j of (q6 - 32) * q_x)
         acc = fmaf(d * dx_s, (float)isum, acc)
     out = acc, or acc + bias[n] (one fp32 add); a NaN becomes the quiet NaN 0x7FC00000; a bf16 output
     is then rounded to nearest even.
   Every integer sum is exact in int32 (|isum| < 2^28 for every format), so the order in which a code path
   adds the integer products does not matter; the float operations above are all that round. Nothing
   depends on m, the row's position, the other rows, the thread or the ISA: columns are shared out in
   panels of 16, each output computed whole by one thread in the order above.

   Build paths: AMX-INT8 (TDPBSSD, 16 rows at a time, 32-value formats, when the CPU and kernel allow it),
   AVX512-VNNI (VPDPBUSD), AVX2 (VPMADDUBSW emulation, exact), portable C (fmaf). The bits are the same;
   tests build all of them and compare. */

#ifndef DETINF_QUANT_H
#define DETINF_QUANT_H

#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define DETINF_Q_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define DETINF_Q_AVX2 1
#endif
#if defined(DETINF_Q_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define DETINF_Q_AMX 1 /* AMX-INT8 tiles for 16 rows at a time (quant_amx.c), when the kernel grants them */
#endif
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* ggml type ids of the supported block formats */
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
/* not ggml types: Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K repacked at load into 16-column panels (quant_repack.c);
   id = format + X16 */
enum { X16 = 100 };
/* the repacked 32-value formats' layout (quant_repack.c): blocks in pairs, each pair's fp16 fields of 16
   columns, then its quant bytes */
#define X16_FIELD_BYTES 32 /* one fp16 field of one block, 16 columns */
#define X16_QS_BYTES 256   /* one 4-bit block's quant bytes, 16 columns x 16 (Q8_0: twice as many) */
/* fp16 fields per block (Q4_1: d and m; Q4_0, Q8_0: d), and quant bytes per block of 16 columns */
static inline int x16_fields(int64_t format) { return format == Q4_1 ? 2 : 1; }
static inline int64_t x16_qs_bytes(int64_t format) { return format == Q8_0 ? 2 * X16_QS_BYTES : X16_QS_BYTES; }
/* Bytes of one block of a 16-column panel (16 stored blocks' worth) */
static inline int64_t x16_block_bytes(int64_t format) {
    return X16_FIELD_BYTES * x16_fields(format) + x16_qs_bytes(format);
}
/* Where block b of a panel of `blocks` blocks starts its pair, and how many blocks that pair holds (2; the
   last one 1 when blocks is odd) */
static inline int64_t x16_pair_at(int64_t format, int64_t b) { return x16_block_bytes(format) * (b & ~(int64_t)1); }
static inline int64_t x16_pair_blocks(int64_t b, int64_t blocks) { return (b | 1) < blocks ? 2 : 1; }
/* Byte offsets in the panel of block b's fp16 field f (16 columns), and of its quant bytes */
static inline int64_t x16_field_at(int64_t format, int64_t blocks, int64_t b, int f) {
    return x16_pair_at(format, b) + X16_FIELD_BYTES * (f * x16_pair_blocks(b, blocks) + (b & 1));
}
static inline int64_t x16_qs_at(int64_t format, int64_t blocks, int64_t b) {
    return x16_pair_at(format, b) + X16_FIELD_BYTES * x16_fields(format) * x16_pair_blocks(b, blocks) +
           x16_qs_bytes(format) * (b & 1);
}

/* The stored format of a part's format id (a repacked part's id less X16) */
static inline int64_t stored_format(int64_t id) { return id >= X16 ? id - X16 : id; }

#define QCOLS 16       /* output columns per unpacked half panel */
#define ACC_COLS 32    /* output columns per panel (two halves): a panel's running sums are [rows][32] */
#define UNIT 32        /* values per unit: one 32-value block, or one sub-block of a K super-block */
#define SUPER 256      /* values per K super-block */
#define UNIT_BYTES 512 /* unpacked unit of a panel: [8 groups][16 columns][4 values] u8 */
#define CHUNK_UNITS 16 /* units unpacked at a time (8 KB of scratch) */
#define AMX_ROWS 16    /* rows per AMX tile */
#define FUSED_ROWS 4   /* rows the AVX-512 build multiplies blocks for as it reads them (quant_gemm.c: groups) */

/* test hooks (negative controls of the tests; the package never sets them) */
#define QTEST_BATCH_SCALE 1 /* activation block scales from the largest |x| over ALL rows of the call */
#define QTEST_REVERSE 2     /* blocks (chunks of 16 units) in descending order */
#define QTEST_REVERSE_ODD 4 /* the same, on odd-numbered threads only */
#define QTEST_NO_AMX 8      /* the VNNI tiles where the AMX ones would run (the tests compare the two) */
#define QTEST_AMX_UNSIGNED 16 /* the AMX tiles sum the unsigned weight bytes (formats with an offset: wrong) */

/* One stacked part of a linear, as Python's QuantLinear passes it (ctypes mirror in ops/quant.py). */
typedef struct {
    const uint8_t *data;      /* [rows][row_bytes] as stored */
    const int64_t *row_order; /* [cols]: output column j reads stored row row_order[j]; NULL = identity */
    int64_t cols;             /* output columns of this part */
    int64_t row_bytes;
    int64_t format;           /* ggml type id */
} detinf_qpart;

/* Quantized activation rows: q [m][k] int8, d [m][k / block] fp32, s32 [m][k / 32] int32 sums of q
   (and sf, the same as fp32: exact), s16 [m][k / 16] int32 (K flavour only). */
typedef struct {
    int8_t *q;
    float *d;
    int32_t *s32;
    float *sf;
    int32_t *s16;
    int64_t k;
    int block; /* 32 or 256 */
} xquant;

/* What a few-row pass over a repacked half panel asks the cache for as it goes (quant_gemm.c): its own blocks
   ahead when `own` (the first group of rows over the panel; later groups find it cached), and, spread over
   its blocks, the lines [next, next + next_bytes) of the thread's next panel (next_bytes 0: none). */
typedef struct {
    int own;
    const uint8_t *next;
    int64_t next_bytes;
} pass_prefetch;

/* One panel's unpacked chunk: units [u0, u0 + units) of 16 columns. */
typedef struct {
    uint8_t *w;  /* [units][8][16][4] u8: the format's unsigned integers (Q8_0: q + 128) */
    float *d;    /* 32-value formats: [units][16] block scale; K formats: [super-blocks][16] d */
    float *m;    /* 32-value formats: [units][16] block min (Q4_1, Q5_1); K formats: [super][16] dmin */
    int32_t *sc; /* K formats: [super-blocks][16 sub-blocks][16] scale (Q4_K/Q5_K use 8) */
    int32_t *mn; /* Q4_K, Q5_K: [super-blocks][8][16] mins */
} qpanel;

static inline int format_block_values(int64_t format) { return format >= Q4_K && format <= Q6_K ? SUPER : UNIT; }

static inline int64_t format_block_bytes(int64_t format) {
    switch (format) {
        case Q4_0: return 18;
        case Q4_1: return 20;
        case Q5_0: return 22;
        case Q5_1: return 24;
        case Q8_0: return 34;
        case Q4_K: return 144;
        case Q5_K: return 176;
        case Q6_K: return 210;
        default: return 0;
    }
}

/* Where a repacked K-format half panel (quant_repack.c) keeps super-block s's whole 16-byte piece `piece` (its
   16 columns' stored bytes 16 piece .. 16 piece + 15, 256 bytes), and its rest (the 16 columns' bytes past
   the whole pieces: Q6_K's fp16 d, 32 bytes), as byte offsets. Q4_K and Q5_K: super-block s at 16 S s, its
   pieces in stored order. Q6_K: its pieces in the order its loops read them (the scales, then for each half
   of the values its high bits and its low bits: q6k_place), and its super-blocks (16 S = 3360 bytes, not a
   whole number of 64-byte lines) in pairs, both 13 pieces of one, both of the other, then both rests, so
   that every piece starts a line (the last super-block of an odd count alone, its rest after it). */
#define Q6K_PIECES 13
static inline int64_t k_piece_at(int64_t format, int64_t s, int64_t piece) {
    static const int8_t q6k_place[Q6K_PIECES] = {3, 4, 5, 6, 9, 10, 11, 12, 1, 2, 7, 8, 0}; /* stored piece -> place */
    const int64_t bytes = 16 * format_block_bytes(format);
    if (format != Q6_K) return bytes * s + 256 * piece;
    return bytes * (s & ~(int64_t)1) + 256 * Q6K_PIECES * (s & 1) + 256 * q6k_place[piece];
}
static inline int64_t k_rest_at(int64_t format, int64_t supers, int64_t s) {
    const int64_t bytes = 16 * format_block_bytes(format);
    if (format != Q6_K) return bytes * s + 256 * (format_block_bytes(format) / 16);
    const int64_t in_pair = (s | 1) < supers ? 2 : 1;
    return bytes * (s & ~(int64_t)1) + 256 * Q6K_PIECES * in_pair + 32 * (s & 1);
}

/* The integer subtracted from every unpacked weight value of a 32-value format (Q8_0 is stored + 128). */
static inline int32_t format_offset(int64_t format) {
    return format == Q8_0 ? 128 : (format == Q4_0 ? 8 : (format == Q5_0 ? 16 : 0));
}

static inline int format_has_min(int64_t format) { return format == Q4_1 || format == Q5_1; }

static inline uint16_t load_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static inline uint32_t load_u32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* IEEE half -> single, exact (denormals normalised; a NaN keeps its payload and becomes quiet, as F16C). */
static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu, bits;
    if (exponent == 0x1F) bits = sign | 0x7F800000u | (mantissa << 13) | (mantissa ? 0x400000u : 0u);
    else if (exponent != 0) bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    else if (mantissa == 0) bits = sign;
    else {
        int shift = 0;
        while (!(mantissa & 0x400u)) { mantissa <<= 1; shift++; }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((mantissa & 0x3FFu) << 13);
    }
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline uint32_t f32_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

/* The 6-bit scale (which = 0) or min (which = 1) of sub-block j from a Q4_K/Q5_K 12-byte scale field. */
static inline int32_t k4_scale(const uint8_t *s, int j, int which) {
    if (j < 4) return s[j + 4 * which] & 63;
    return which ? (s[j + 4] >> 4) | ((s[j] >> 6) << 4) : (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
}

/* Value l (< 32) of unit u (32 values; a K super-block has 8) of a stored row, as the unsigned integer
   the scratch holds (layouts in quant_unpack.c; Q8_0 is stored + 128). */
static inline uint8_t unit_value(int64_t format, const uint8_t *row, int64_t u, int l) {
    const uint8_t *p;
    switch (format) {
        case Q8_0: return (uint8_t)(row[u * 34 + 2 + l] ^ 0x80u);
        case Q4_0: p = row + u * 18 + 2; return l < 16 ? p[l] & 15 : p[l - 16] >> 4;
        case Q4_1: p = row + u * 20 + 4; return l < 16 ? p[l] & 15 : p[l - 16] >> 4;
        case Q5_0:
        case Q5_1: {
            p = row + u * format_block_bytes(format) + (format == Q5_0 ? 2 : 4);
            const uint8_t low = l < 16 ? p[4 + l] & 15 : p[4 + l - 16] >> 4;
            return (uint8_t)(low | (((load_u32(p) >> l) & 1u) << 4));
        }
        case Q4_K: {
            const int64_t j = u % 8;
            p = row + (u / 8) * 144 + 16 + 32 * (j / 2);
            return j % 2 ? p[l] >> 4 : p[l] & 15;
        }
        case Q5_K: {
            const int64_t j = u % 8;
            p = row + (u / 8) * 176;
            const uint8_t nibbles = p[48 + 32 * (j / 2) + l];
            return (uint8_t)((j % 2 ? nibbles >> 4 : nibbles & 15) | (((p[16 + l] >> j) & 1) << 4));
        }
        default: { /* Q6_K */
            const int64_t h = (u % 8) / 4, t = u % 4;
            p = row + (u / 8) * 210;
            const uint8_t low = p[64 * h + 32 * (t % 2) + l];
            return (uint8_t)(((t / 2) ? low >> 4 : low & 15) | (((p[128 + 32 * h + l] >> (2 * t)) & 3) << 4));
        }
    }
}

/* quant_act.c */
int xquant_alloc(xquant *xq, int64_t m, int64_t k, int block);
void xquant_free(xquant *xq);
void xquant_rows(xquant *xq, const void *x, int64_t m, int x_bf16, int batch_scale);
void xquant_zero_rows(xquant *xq, int64_t m, int64_t rows);

/* quant_unpack.c: columns' row pointers rows[16], units [u0, u0 + units) of `format` into p */
void unpack_chunk(int64_t format, const uint8_t *const *rows, int64_t row_bytes, int64_t u0, int64_t units, qpanel *p);
#if defined(DETINF_Q_AVX512)
/* quant_unpack512.c: the same bytes as the portable loop */
void unpack_chunk_avx512(int64_t format, const uint8_t *const *rows, int64_t row_bytes, int64_t u0, int64_t units,
                         qpanel *p);
/* quant_unpack512.c / quant_gemv512.c: the same two paths over a repacked K-format half panel */
void unpack_k_x16_avx512(int64_t format, const uint8_t *panel, int64_t supers, int64_t u0, int64_t units,
                         qpanel *p);
void fused_k_x16_avx512(int64_t format, const uint8_t *panel, const xquant *xq, int64_t m, const pass_prefetch *pf,
                        float *acc);
/* quant_gemv512.c: rows [0, m <= FUSED_ROWS) x one 16-column half, every block; acc [m][ACC_COLS] */
void fused_half_avx512(int64_t format, const uint8_t *const *rows, int64_t row_bytes, const xquant *xq, int64_t m,
                       float *acc);
#endif

#if defined(DETINF_Q_AVX2)
void kernel_rows256(int64_t format, const xquant *xq, int64_t r0, int64_t count, int64_t u0, int64_t units,
                    const qpanel *p, int halves, float *acc);
#endif
/* quant_repack.c: one repacked 16-column panel (B blocks) of `format` (the stored one: Q4_0, Q4_1, Q8_0 or
   a K format): units [u0, u0 + units) into p, as unpack_chunk writes them; the few-row path (AVX-512) */
void unpack_x16(int64_t format, const uint8_t *panel, int64_t blocks, int64_t u0, int64_t units, qpanel *p);
#if defined(DETINF_Q_AVX512)
void fused_x16_avx512(int64_t format, const uint8_t *panel, const xquant *xq, int64_t m, const pass_prefetch *pf,
                      float *acc);
#endif
#if defined(DETINF_Q_AMX)
/* quant_amx.c: amx_usable (common.h) once per process; amx_begin / amx_end around a thread's use of the
   tiles; amx_rows: rows [r0, r0 + 16 tiles) x the chunk of a 32-value format (the bits of kernel_rows), after
   the chunk's kernel_rows: it makes the chunk's weights signed in place */
void amx_begin(void);
void amx_end(void);
void amx_rows(int64_t format, const xquant *xq, int64_t r0, int64_t tiles, int64_t u0, int64_t units, qpanel *p,
              int halves, int make_signed, float *acc);
#endif
/* quant_gemm.c: the entry point (its arguments described there) */
int detinf_quant_gemm(const void *x, int64_t m, int64_t k, int x_bf16, const detinf_qpart *parts, int64_t nparts,
                      const float *bias, void *out, int64_t n, int out_bf16, int flags);
/* quant_gemm.c: one chunk's scratch (bytes, layout from a 64-byte aligned base); the 16 columns from `first` of
   a part (stored or repacked), units [u0, u0 + count) of its `units` per row, into p */
size_t qpanel_bytes(void);
void qpanel_layout(uint8_t *base, qpanel *p);
void unpack_columns16(const detinf_qpart *part, int64_t first, int64_t units, int64_t u0, int64_t count, qpanel *p);
#if defined(DETINF_Q_AVX512) && defined(__AVX512VBMI__) /* every CPU with AMX has VBMI */
#define DETINF_Q_TILES 1
/* quant_tiles.c: units [u0, u0 + count) of a part's 16 columns from `first`, dequantised as detinf_dequantize
   does, rounded to bf16 and laid out as AMX-BF16 B tiles [count][16 pairs][16 columns][2] (the packed bf16
   weight's layout): repacked Q4_0 / Q4_1 / Q8_0 read straight from their panel, the rest unpacked into
   scratch first */
void part_bf16_tiles(const detinf_qpart *part, int64_t first, int64_t units, int64_t u0, int64_t count,
                     qpanel *scratch, uint16_t *tiles);
#endif
/* quant_kernels.c: rows [r0, r0 + count) over the chunk of 1 or 2 halves; acc [count][32] in and out */
void kernel_rows(int64_t format, const xquant *xq, int64_t r0, int64_t count, int64_t u0, int64_t units,
                 const qpanel *p, int halves, float *acc);

#endif
