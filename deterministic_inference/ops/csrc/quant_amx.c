/* AMX-INT8 path of the quantized GEMM for the 32-value formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1): 16 rows
   of activations at a time against one unpacked chunk (quant_unpack.c / quant_repack.c), on CPUs with
   AMX tiles whose kernel grants the process their state (Linux arch_prctl ARCH_REQ_XCOMP_PERM).

   Why the bits are those of quant.h (and of the VNNI, AVX2 and portable paths): a unit's unpacked bytes
   [8 groups][16 columns][4 values], made signed (w - offset: Q4_0 -8..7, Q5_0 -16..15, Q8_0 its stored
   q8; Q4_1 / Q5_1 0..15 / 0..31 as they are), are exactly an AMX B tile of 8 rows x 64 bytes, and
   TDPBSSD sums the products activation byte x weight byte of one 32-value block into one int32 per (row,
   column), exactly: isum_b of quant.h itself, |isum_b| < 2^24, with no offset correction left to do. One
   tile product per block (K = 32), never two blocks in one sum; then every output takes the same fp32
   operations, block by block ascending, as tile_blocks in quant_kernels.c: acc = fmaf(d_w * d_x,
   (float)isum, acc) and, for Q4_1 / Q5_1, acc = fmaf(m_w * d_x, (float)s_x, acc). (float)isum is exact,
   so it does not depend on the rounding mode. Lanes are output columns, never partial sums.

   Speed (Intel Xeon, Emerald Rapids VM, one thread; bench/RESULTS.md, issue 36, fourth session): the tile
   instructions of a unit (an A load, two B loads, two TDPBSSD, two 1 KB stores: ~40 ns per 16 rows x 32
   columns) and its float scaling (~37 ns) are each about half of the path's time and overlap only in
   part; unit u + 1's tile instructions are issued before unit u's sums are scaled so that they can
   (Q4_1 / Q5_1, with two more float operations, keep groups of 4 units scaled with the running sums in
   registers). The signed weights save the integer correction (a broadcast and a subtraction per row,
   half and block): 1.04-1.24x on Q4_0 at 32-512 rows. */

#include "quant512.h"

#if defined(__AMX_TILE__)

#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_granted;
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

static void amx_request(void) { amx_granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

/* 1 when this process may use the AMX tiles (asked of the kernel once per process), else 0. Shared by the
   AMX-INT8 quantized GEMM and the AMX-BF16 GEMM (gemm_amx.h). */
int amx_usable(void) {
    pthread_once(&amx_once, amx_request);
    return amx_granted;
}

#endif

#if defined(DETINF_Q_AMX)

/* The tiles: 0, 1 (even units) and 4, 5 (odd units) = the int32 sums of the two halves [16 rows][16
   columns]; 2, 6 = activations [16 rows][32 bytes]; 3, 7 = the two halves' unit [8 rows][64 bytes]. A
   constant in memory: GCC 12 drops stores to a local configuration that only ldtilecfg reads. */
static const amx_tile_config amx_config = {
    .palette = 1,
    .colsb = {64, 64, UNIT, 64, 64, 64, UNIT, 64},
    .rows = {AMX_ROWS, AMX_ROWS, AMX_ROWS, 8, AMX_ROWS, AMX_ROWS, AMX_ROWS, 8},
};

void amx_begin(void) { _tile_loadconfig(&amx_config); }

void amx_end(void) { _tile_release(); }

/* The chunk's unpacked weights of a format with an offset made signed in place: w - offset, exactly (Q4_0
   -8..7, Q5_0 -16..15, Q8_0 -128..127: the stored q8 again), so that TDPBSSD (signed x signed) sums
   x * (w - offset) = isum_b of quant.h directly and no output needs the integer correction
   - offset * s_x. Q4_1 / Q5_1 (0..15, 0..31) are the same numbers read as signed bytes. The VNNI rows of
   the chunk must have run before (they read the unsigned bytes). */
static void signed_weights(int64_t format, int64_t units, qpanel *p, int halves) {
    const int32_t offset = format_offset(format);
    if (!offset) return;
    const __m512i minus = _mm512_set1_epi8((char)offset);
    for (int h = 0; h < halves; h++) {
        __m512i *w = (__m512i *)p[h].w;
        for (int64_t i = 0; i < units * (UNIT_BYTES / 64); i++) w[i] = _mm512_sub_epi8(w[i], minus);
    }
}

/* One unit's products into C tiles c0, c1 (halves 0, 1) from A tile a (x) and B tiles 3, 7 (w0, w1),
   stored to out [2][16 rows][16 columns]. */
#define AMX_UNIT(c0, c1, a, x, w0, w1, out, halves)                        \
    do {                                                                    \
        _tile_loadd(a, x, k);                                               \
        _tile_zero(c0);                                                     \
        _tile_loadd(3, w0, 64);                                             \
        _tile_dpbssd(c0, a, 3);                                             \
        if ((halves) == 2) {                                                \
            _tile_zero(c1);                                                 \
            _tile_loadd(7, w1, 64);                                         \
            _tile_dpbssd(c1, a, 7);                                         \
        }                                                                   \
        _tile_stored(c0, out, 64);                                          \
        if ((halves) == 2) _tile_stored(c1, (out) + AMX_ROWS * QCOLS, 64); \
    } while (0)

#define TILE_SUMS (2 * AMX_ROWS * QCOLS) /* int32 sums of one unit, one 16-row tile, both halves */

/* sums [2][16 rows][16 columns] = the exact int32 sums of unit uu of the chunk (signed weights), rows
   [first, first + 16). Even and odd units use their own C and A tiles, so one unit's products run while
   the previous one's sums are stored. */
INLINE void unit_sums(const xquant *xq, int64_t first, int64_t u0, int64_t uu, const qpanel *p, int halves,
                      int32_t *sums) {
    const int64_t k = xq->k;
    const int8_t *x = xq->q + first * k + (u0 + uu) * UNIT;
    const uint8_t *w0 = p[0].w + uu * UNIT_BYTES, *w1 = p[halves - 1].w + uu * UNIT_BYTES;
    if (uu % 2 == 0) AMX_UNIT(0, 1, 2, x, w0, w1, sums, halves);
    else AMX_UNIT(4, 5, 6, x, w0, w1, sums, halves);
}

/* (float)isum of 16 stored int32 sums: exact (|isum| < 2^24 for every 32-value format), so whatever the
   rounding mode; the plain conversion can read its operand from memory. */
INLINE __m512 exact_float(const int32_t *sums) { return _mm512_cvtepi32_ps(_mm512_load_si512(sums)); }

/* acc [16 rows][32] += unit uu's block of quant.h's sequence from its stored sums [2][16 rows][16], for the
   formats without a min term (Q4_1 / Q5_1 take tile_rows_min): for each (row, half) one product of the
   scales, one conversion and one fused multiply-add; the running sums are read and written in memory
   (L1), as there are 32 of them. H literal. */
INLINE void scale_unit(const int H, const xquant *xq, int64_t first, int64_t u, int64_t uu, const qpanel *p,
                       const int32_t *sums, float *acc) {
    const int64_t blocks = xq->k / UNIT;
    __m512 dw[2];
    for (int h = 0; h < H; h++) dw[h] = _mm512_loadu_ps(p[h].d + uu * QCOLS);
    const float *dx = xq->d + first * blocks + u;
    for (int r = 0; r < AMX_ROWS; r++) {
        for (int h = 0; h < H; h++) {
            float *out = acc + r * ACC_COLS + h * QCOLS;
            const __m512 scale = _mm512_mul_ps(dw[h], _mm512_set1_ps(dx[r * blocks]));
            const __m512 f = _mm512_fmadd_ps(scale, exact_float(sums + (h * AMX_ROWS + r) * QCOLS), _mm512_load_ps(out));
            _mm512_store_ps(out, f);
        }
    }
}

/* Rows [first, first + 16) over the chunk, formats without a min term: unit uu + 1's tile products are
   issued just before unit uu's sums are scaled, so the tile unit and the vector units work side by side.
   H literal. */
INLINE void tile_rows(const int H, const xquant *xq, int64_t first, int64_t u0, int64_t units, const qpanel *p,
                      float *acc) {
    int32_t sums[2][TILE_SUMS] __attribute__((aligned(64)));
    unit_sums(xq, first, u0, 0, p, H, sums[0]);
    for (int64_t uu = 0; uu < units; uu++) {
        if (uu + 1 < units) unit_sums(xq, first, u0, uu + 1, p, H, sums[(uu + 1) % 2]);
        scale_unit(H, xq, first, u0 + uu, uu, p, sums[uu % 2], acc);
    }
}

#define MIN_GROUP 4 /* Q4_1 / Q5_1: units whose tile products are stored before they are scaled */
#define MIN_ROWS 4  /* Q4_1 / Q5_1: rows whose running sums stay in registers over a group (x 2 halves) */

/* Q4_1 / Q5_1: MIN_ROWS rows (from row r0 of the tile) x H halves of acc += the n units from uu of a group's
   stored sums [n][2][16 rows][16]: quant.h's sequence, each output's operations in unit order, the
   (row, half) chains side by side in registers. H literal. */
INLINE void scale_min_rows(const int H, const xquant *xq, int64_t first, int r0, int64_t u0, int64_t uu, int n,
                           const qpanel *p, const int32_t *sums, float *acc) {
    const int64_t blocks = xq->k / UNIT;
    __m512 f[MIN_ROWS][2];
    for (int r = 0; r < MIN_ROWS; r++)
        for (int h = 0; h < H; h++) f[r][h] = _mm512_loadu_ps(acc + (r0 + r) * ACC_COLS + h * QCOLS);
    for (int i = 0; i < n; i++) {
        const float *dx = xq->d + (first + r0) * blocks + u0 + uu + i;
        const float *sf = xq->sf + (first + r0) * blocks + u0 + uu + i;
        for (int h = 0; h < H; h++) {
            const __m512 dw = _mm512_loadu_ps(p[h].d + (uu + i) * QCOLS);
            const __m512 mw = _mm512_loadu_ps(p[h].m + (uu + i) * QCOLS);
            for (int r = 0; r < MIN_ROWS; r++) {
                const int32_t *isum = sums + i * TILE_SUMS + (h * AMX_ROWS + r0 + r) * QCOLS;
                const __m512 x_scale = _mm512_set1_ps(dx[r * blocks]);
                f[r][h] = _mm512_fmadd_ps(_mm512_mul_ps(dw, x_scale), exact_float(isum), f[r][h]);
                f[r][h] = _mm512_fmadd_ps(_mm512_mul_ps(mw, x_scale), _mm512_set1_ps(sf[r * blocks]), f[r][h]);
            }
        }
    }
    for (int r = 0; r < MIN_ROWS; r++)
        for (int h = 0; h < H; h++) _mm512_storeu_ps(acc + (r0 + r) * ACC_COLS + h * QCOLS, f[r][h]);
}

/* Q4_1 / Q5_1, rows [first, first + 16): MIN_GROUP units' tile products, then their scaling with the
   running sums in registers. With five float operations per row, half and block, the unit-by-unit loop
   of tile_rows (running sums in memory) was 2-8% slower here at 27-512 rows. H literal. */
INLINE void tile_rows_min(const int H, const xquant *xq, int64_t first, int64_t u0, int64_t units, const qpanel *p,
                          float *acc) {
    int32_t sums[MIN_GROUP * TILE_SUMS] __attribute__((aligned(64)));
    for (int64_t uu = 0; uu < units; uu += MIN_GROUP) {
        const int n = units - uu < MIN_GROUP ? (int)(units - uu) : MIN_GROUP;
        for (int i = 0; i < n; i++) unit_sums(xq, first, u0, uu + i, p, H, sums + i * TILE_SUMS);
        for (int r0 = 0; r0 < AMX_ROWS; r0 += MIN_ROWS) scale_min_rows(H, xq, first, r0, u0, uu, n, p, sums, acc);
    }
}

/* Rows [r0, r0 + tiles * 16) against the chunk's units [u0, u0 + units) of 1 or 2 halves; acc [rows][32]
   holds the running sums in and out. The calling thread has run amx_begin; the chunk's weights are made
   signed here, so the VNNI rows of the chunk (kernel_rows) must have run first. make_signed = 0 only for
   the tests' negative control (QTEST_AMX_UNSIGNED). */
void amx_rows(int64_t format, const xquant *xq, int64_t r0, int64_t tiles, int64_t u0, int64_t units, qpanel *p,
              int halves, int make_signed, float *acc) {
    if (make_signed) signed_weights(format, units, p, halves);
    const int min = format_has_min(format);
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t first = r0 + t * AMX_ROWS;
        float *tile_acc = acc + t * AMX_ROWS * ACC_COLS;
        if (min && halves == 2) tile_rows_min(2, xq, first, u0, units, p, tile_acc);
        else if (min) tile_rows_min(1, xq, first, u0, units, p, tile_acc);
        else if (halves == 2) tile_rows(2, xq, first, u0, units, p, tile_acc);
        else tile_rows(1, xq, first, u0, units, p, tile_acc);
    }
}

#endif
