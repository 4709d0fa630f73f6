/* AMX-INT8 path of the quantized GEMM for the 32-value formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1): 16 rows
   of activations at a time against one unpacked chunk (quant_unpack.c / quant_repack.c), on CPUs with
   AMX tiles whose kernel grants the process their state (Linux arch_prctl ARCH_REQ_XCOMP_PERM).

   Why the bits are those of quant.h (and of the VNNI, AVX2 and portable paths): a unit's unpacked bytes
   [8 groups][16 columns][4 values] are exactly an AMX B tile of 8 rows x 64 bytes, and TDPBSUD sums the
   products signed activation byte x unsigned weight byte of one 32-value block into one int32 per
   (row, column), exactly (|sum| < 2^28, no saturation). One tile product per block (K = 32), never two
   blocks in one sum; then every output takes the same fp32 operations, block by block ascending, as
   tile_blocks in quant_kernels.c: acc = fmaf(d_w * d_x, (float)(isum - offset * s_x), acc) and, for
   Q4_1 / Q5_1, acc = fmaf(m_w * d_x, (float)s_x, acc). Lanes are output columns, never partial sums.

   Speed (Intel Xeon, Emerald Rapids VM, one thread, SmolLM2-shaped Q4_1 at M = 512 / 32: 1.2-1.4x the
   VNNI tiles): the float scaling, not the tile products, bounds it, so it runs on EPI_ROWS rows x both
   halves at once; one (row, half) at a time waited on the latency of its dependent fused multiply-adds
   and made the whole path slower than VNNI (0.5-1.0x). */

#include "quant512.h" /* as_float */

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

#define AMX_GROUP 4 /* units whose tile products are stored before their float operations run */

/* The tiles: 0, 1 = the int32 sums of the two halves [16 rows][16 columns]; 2 = activations [16 rows][32
   bytes]; 3, 4 = the two halves' unit [8 rows][64 bytes]. A constant in memory: GCC 12 drops stores to a
   local configuration that only ldtilecfg reads. */
static const amx_tile_config amx_config = {
    .palette = 1,
    .colsb = {64, 64, UNIT, 64, 64, 64, UNIT, 64},
    .rows = {AMX_ROWS, AMX_ROWS, AMX_ROWS, 8, AMX_ROWS, AMX_ROWS, AMX_ROWS, 8},
};

void amx_begin(void) { _tile_loadconfig(&amx_config); }

void amx_end(void) { _tile_release(); }

/* One unit's products into C tiles c0, c1 (halves 0, 1) from A tile a and B tiles 3, 7, then stored. */
#define AMX_UNIT(c0, c1, a, x, w0, w1, out, halves)     \
    do {                                                  \
        _tile_loadd(a, x, k);                             \
        _tile_zero(c0);                                   \
        _tile_loadd(3, w0, 64);                           \
        _tile_dpbsud(c0, a, 3);                           \
        if ((halves) == 2) {                              \
            _tile_zero(c1);                               \
            _tile_loadd(7, w1, 64);                       \
            _tile_dpbsud(c1, a, 7);                       \
        }                                                 \
        _tile_stored(c0, out, 64);                        \
        if ((halves) == 2) _tile_stored(c1, (out) + AMX_ROWS * QCOLS, 64); \
    } while (0)

/* sums [i][h][16 rows][16 columns] = the exact int32 block sums of units [uu, uu + n) of the chunk, rows
   [r0, r0 + 16). Even and odd units use their own C and A tiles, so one unit's sums are stored while the
   next one's are computed. */
static void tile_sums(const xquant *xq, int64_t r0, int64_t u0, int64_t uu, int n, const qpanel *p, int halves,
                      int32_t *sums) {
    const int64_t k = xq->k;
    const int8_t *x = xq->q + r0 * k + (u0 + uu) * UNIT;
    const uint8_t *w0 = p[0].w + uu * UNIT_BYTES, *w1 = p[halves - 1].w + uu * UNIT_BYTES;
    for (int i = 0; i < n; i++) {
        int32_t *out = sums + i * 2 * AMX_ROWS * QCOLS;
        if (i % 2 == 0) AMX_UNIT(0, 1, 2, x + i * UNIT, w0 + i * UNIT_BYTES, w1 + i * UNIT_BYTES, out, halves);
        else AMX_UNIT(4, 5, 6, x + i * UNIT, w0 + i * UNIT_BYTES, w1 + i * UNIT_BYTES, out, halves);
    }
}

/* EPI_ROWS rows x H halves of acc += units [uu, uu + n): the float sequence of quant.h from the stored sums,
   each output's operations in unit order; the rows and halves are independent chains side by side (one
   (row, half) at a time waited on the FMA latency). R, H literal. */
#define EPI_ROWS 4
INLINE void scale_rows(int64_t format, const xquant *xq, int64_t first, int r0, const int R, const int H,
                       int64_t u0, int64_t uu, int n, const qpanel *p, const int32_t *sums, float *acc) {
    const int64_t blocks = xq->k / UNIT;
    const int32_t offset = format_offset(format);
    __m512 f[EPI_ROWS][2];
    for (int r = 0; r < R; r++)
        for (int h = 0; h < H; h++) f[r][h] = _mm512_loadu_ps(acc + r * ACC_COLS + h * QCOLS);
    for (int i = 0; i < n; i++) {
        const int64_t u = u0 + uu + i;
        for (int h = 0; h < H; h++) {
            const __m512 dw = _mm512_loadu_ps(p[h].d + (uu + i) * QCOLS);
            for (int r = 0; r < R; r++) {
                const int64_t at = (first + r0 + r) * blocks + u;
                const __m512i isum = _mm512_sub_epi32(
                    _mm512_load_si512(sums + ((i * 2 + h) * AMX_ROWS + r0 + r) * QCOLS),
                    _mm512_set1_epi32(offset * xq->s32[at]));
                const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(xq->d[at]));
                f[r][h] = _mm512_fmadd_ps(scale, as_float(isum), f[r][h]);
            }
            if (!format_has_min(format)) continue;
            const __m512 mw = _mm512_loadu_ps(p[h].m + (uu + i) * QCOLS);
            for (int r = 0; r < R; r++) {
                const int64_t at = (first + r0 + r) * blocks + u;
                const __m512 min_scale = _mm512_mul_ps(mw, _mm512_set1_ps(xq->d[at]));
                f[r][h] = _mm512_fmadd_ps(min_scale, _mm512_set1_ps(xq->sf[at]), f[r][h]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int h = 0; h < H; h++) _mm512_storeu_ps(acc + r * ACC_COLS + h * QCOLS, f[r][h]);
}

/* The 16 rows of one tile, EPI_ROWS at a time, with the format's offset and min term as constants where
   they decide the code: Q4_1 stands for Q5_1 too (both: no offset, a min term), Q8_0 for its offset of 128;
   Q4_0 and Q5_0 read theirs at run time. */
static void scale_tile(int64_t format, const xquant *xq, int64_t first, int64_t u0, int64_t uu, int n,
                       const qpanel *p, int halves, const int32_t *sums, float *acc) {
    for (int r = 0; r < AMX_ROWS; r += EPI_ROWS) {
        float *at = acc + r * ACC_COLS;
        if (format_has_min(format)) {
            if (halves == 2) scale_rows(Q4_1, xq, first, r, EPI_ROWS, 2, u0, uu, n, p, sums, at);
            else scale_rows(Q4_1, xq, first, r, EPI_ROWS, 1, u0, uu, n, p, sums, at);
        } else if (format == Q8_0) {
            if (halves == 2) scale_rows(Q8_0, xq, first, r, EPI_ROWS, 2, u0, uu, n, p, sums, at);
            else scale_rows(Q8_0, xq, first, r, EPI_ROWS, 1, u0, uu, n, p, sums, at);
        } else {
            if (halves == 2) scale_rows(format, xq, first, r, EPI_ROWS, 2, u0, uu, n, p, sums, at);
            else scale_rows(format, xq, first, r, EPI_ROWS, 1, u0, uu, n, p, sums, at);
        }
    }
}

/* Rows [r0, r0 + tiles * 16) against the chunk's units [u0, u0 + units) of 1 or 2 halves; acc [rows][32]
   holds the running sums in and out. The calling thread has run amx_begin. */
void amx_rows(int64_t format, const xquant *xq, int64_t r0, int64_t tiles, int64_t u0, int64_t units,
              const qpanel *p, int halves, float *acc) {
    int32_t sums[AMX_GROUP * 2 * AMX_ROWS * QCOLS] __attribute__((aligned(64)));
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t first = r0 + t * AMX_ROWS;
        for (int64_t uu = 0; uu < units; uu += AMX_GROUP) {
            const int n = units - uu < AMX_GROUP ? (int)(units - uu) : AMX_GROUP;
            tile_sums(xq, first, u0, uu, n, p, halves, sums);
            scale_tile(format, xq, first, u0, uu, n, p, halves, sums, acc + t * AMX_ROWS * ACC_COLS);
        }
    }
}

#endif
