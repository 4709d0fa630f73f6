/* The quantized-weight GEMM's entry point (arithmetic defined in quant.h): quantize the activation rows,
   share the output columns out between threads in fixed panels of 32 columns of one part, and compute
   each panel whole, chunk by chunk of 16 units in ascending order, for every row. Which thread takes a
   panel, how many rows there are and where a row sits change no operation of any output. */

#include <omp.h>

#include "quant.h"

typedef struct {
    int64_t part;      /* index into the parts */
    int64_t first_col; /* the panel's first column within its part */
    int64_t out_col;   /* the same column in the output */
} panel_ref;

typedef struct {
    const xquant *x32;  /* activations in 32-value blocks (NULL when no part needs them) */
    const xquant *x256; /* activations in 256-value blocks (K formats) */
    int64_t m, n;
    const float *bias; /* [n] or NULL */
    void *out;         /* [m][n] fp32, or bf16 when out_bf16 */
    int out_bf16;
    int flags;         /* QTEST_* (tests only) */
    int64_t amx_tiles; /* 32-value formats: rows [0, 16 amx_tiles) go through the AMX tiles (quant_amx.c) */
    int64_t acc_rows;  /* rows of running sums: m, or 16 amx_tiles when the last tile has padding rows */
} gemm_call;

/* Per-thread work space: one chunk of the two halves of a panel, and the running sums of every row. */
typedef struct {
    qpanel halves[2];
    float *acc; /* [m][32] */
    void *block;
} workspace;

/* One unpacked chunk's arrays (quant.h's qpanel), in this order: each a multiple of 64 bytes. */
#define QPANEL_W_BYTES ((size_t)CHUNK_UNITS * UNIT_BYTES)
#define QPANEL_F_BYTES ((size_t)CHUNK_UNITS * QCOLS * sizeof(float))
#define QPANEL_SC_BYTES ((size_t)(CHUNK_UNITS / 8) * 16 * QCOLS * sizeof(int32_t))
#define QPANEL_MN_BYTES ((size_t)(CHUNK_UNITS / 8) * 8 * QCOLS * sizeof(int32_t))

/* Bytes of one unpacked chunk's scratch (qpanel_layout), a multiple of 64. */
size_t qpanel_bytes(void) { return QPANEL_W_BYTES + 2 * QPANEL_F_BYTES + QPANEL_SC_BYTES + QPANEL_MN_BYTES; }

/* p's arrays laid out in qpanel_bytes() bytes from base (64-byte aligned). */
void qpanel_layout(uint8_t *base, qpanel *p) {
    p->w = base;
    p->d = (float *)(base + QPANEL_W_BYTES);
    p->m = (float *)(base + QPANEL_W_BYTES + QPANEL_F_BYTES);
    p->sc = (int32_t *)(base + QPANEL_W_BYTES + 2 * QPANEL_F_BYTES);
    p->mn = (int32_t *)(base + QPANEL_W_BYTES + 2 * QPANEL_F_BYTES + QPANEL_SC_BYTES);
}

static int workspace_alloc(workspace *ws, int64_t m) {
    const size_t half = qpanel_bytes();
    uint8_t *block = aligned_alloc(64, 2 * half + ((size_t)m * ACC_COLS * sizeof(float) + 63) / 64 * 64);
    ws->block = block;
    if (!block) return 1;
    for (int h = 0; h < 2; h++) qpanel_layout(block + h * half, &ws->halves[h]);
    ws->acc = (float *)(block + 2 * half);
    return 0;
}

#if defined(DETINF_Q_AVX512)
/* 16 columns of one row (the first `cols` of them): the scalar loop's operations, lane by lane. */
INLINE void store16(const gemm_call *call, const float *acc, int64_t at, int64_t bias_at, int64_t cols) {
    const __mmask16 keep = lane_mask16(cols);
    __m512 value = _mm512_loadu_ps(acc);
    if (call->bias) value = _mm512_add_ps(value, _mm512_maskz_loadu_ps(keep, call->bias + bias_at));
    value = _mm512_mask_mov_ps(value, _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q),
                               _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
    if (!call->out_bf16) {
        _mm512_mask_storeu_ps((float *)call->out + at, keep, value);
        return;
    }
    _mm256_mask_storeu_epi16((uint16_t *)call->out + at, keep, _mm512_cvtepi32_epi16(bf16_bits16(value)));
}
#endif

/* acc -> out columns [out_col, out_col + cols): + bias (one fp32 add), NaN made canonical, bf16 rounding. */
static void store_panel(const gemm_call *call, const float *acc, int64_t out_col, int64_t cols) {
    for (int64_t r = 0; r < call->m; r++) {
#if defined(DETINF_Q_AVX512)
        for (int64_t c = 0; c < cols; c += 16)
            store16(call, acc + r * ACC_COLS + c, r * call->n + out_col + c, out_col + c, cols - c);
#else
        const uint32_t quiet_nan = 0x7FC00000u;
        for (int64_t c = 0; c < cols; c++) {
            float value = acc[r * ACC_COLS + c];
            if (call->bias) value = value + call->bias[out_col + c];
            if (value != value) memcpy(&value, &quiet_nan, sizeof value);
            const int64_t at = r * call->n + out_col + c;
            if (call->out_bf16) ((uint16_t *)call->out)[at] = f32_to_bf16(value);
            else ((float *)call->out)[at] = value;
        }
#endif
    }
}

/* rows[c] = the stored row read by the panel's column c (< 32); columns past the part's end repeat its
   last one (computed, never stored). */
static void panel_rows(const detinf_qpart *part, const panel_ref *ref, int64_t cols, const uint8_t **rows) {
    for (int c = 0; c < ACC_COLS; c++) {
        const int64_t j = ref->first_col + (c < cols ? c : cols - 1);
        rows[c] = part->data + (part->row_order ? part->row_order[j] : j) * part->row_bytes;
    }
}

/* Where a panel's weights come from: a repacked part's 16-column panels (quant_repack.c: the panel of
   output column j, a multiple of 16, at j * row_bytes), or the stored rows its columns read. */
typedef struct {
    int64_t format;                /* the stored format (a repacked part's id less X16) */
    const uint8_t *panel;          /* repacked: the panel's first half; stored: NULL */
    const uint8_t *rows[ACC_COLS]; /* stored: the row each column reads */
    int64_t half_bytes;            /* repacked: bytes of one 16-column half */
} panel_source;

/* *src = the source of the panel `ref` of a part, whose first `cols` columns are real (the rest repeat the
   last). */
static void panel_source_of(const detinf_qpart *part, const panel_ref *ref, int64_t cols, panel_source *src) {
    src->format = stored_format(part->format);
    src->panel = part->format >= X16 ? part->data + ref->first_col * part->row_bytes : NULL;
    src->half_bytes = QCOLS * part->row_bytes;
    if (!src->panel) panel_rows(part, ref, cols, src->rows);
}

static void unpack_half(const panel_source *src, int h, int64_t row_bytes, int64_t units, int64_t u0, int64_t count,
                        qpanel *p) {
    if (src->panel) unpack_x16(src->format, src->panel + h * src->half_bytes, units, u0, count, p);
    else unpack_chunk(src->format, src->rows + h * QCOLS, row_bytes, u0, count, p);
}

/* Units [u0, u0 + count) of the 16 output columns [first, first + 16) of a part (first a multiple of 16;
   columns past the part's end repeat its last) into p, as the GEMM unpacks them; units: the part's per row. */
void unpack_columns16(const detinf_qpart *part, int64_t first, int64_t units, int64_t u0, int64_t count, qpanel *p) {
    const panel_ref ref = {0, first, 0};
    panel_source src;
    panel_source_of(part, &ref, part->cols - first, &src);
    unpack_half(&src, 0, part->row_bytes, units, u0, count, p);
}

/* The rows [r0, m) of xq as an xquant of their own (a view: the same arrays). */
static xquant xquant_from_row(const xquant *xq, int64_t r0) {
    const int64_t k = xq->k;
    xquant view = *xq;
    view.q += r0 * k;
    view.d += r0 * (k / xq->block);
    view.s32 += r0 * (k / 32);
    view.sf += r0 * (k / 32);
    if (view.s16) view.s16 += r0 * (k / 16);
    return view;
}

/* Up to how many rows a repacked panel of `format` goes through the few-row loops FUSED_ROWS rows at a time,
   re-reading the panel (from cache) for each group, rather than being unpacked once for all rows. The loops
   split the nibbles in registers and overlap the next panel's stream with their compute (pass_prefetch_of);
   against the unpacked path (bench_gemm_quant with weights read from memory, AMD Zen 4, 2 threads) they were
   faster at every row count for Q4_0 (1.12-1.89x at 8-64 rows, 1.03-1.05x at 96-512), Q4_1 (1.11-1.28x,
   1.01-1.05x) and Q8_0 (1.33-2.19x at 8-32, 1.03-1.27x at 48-512); Q4_K up to 128 rows (256 even, 425
   1.03x slower); Q5_K and Q6_K up to 32 (1.1x slower at 48: their sub-block scales cost more per group).
   Speed only: both give quant.h's sequence. */
static int64_t fused_row_limit(int64_t format) {
    switch (format) {
    case Q4_K: return 128;
    case Q5_K: return 32;
    case Q6_K: return 32;
    default: return INT64_MAX; /* Q4_0, Q4_1, Q8_0 */
    }
}

#if defined(DETINF_Q_AVX512)
/* From how many rows a call's few-row passes over repacked panels ask for the thread's next panel as they go
   (pass_prefetch_of). Several groups of rows always did; a single group of 3 or 4 rows did not, and its own
   requests alone (in bursts) left it slower than two groups of 8 rows for the K formats. Asking for the next
   panel (whose passes then skip their own requests: `covered`) made 3-4 rows 1.23-1.5x faster for Q4_K, Q5_K
   and Q6_K, 1.02-1.6x for Q4_0, 1.25-1.37x for Q8_0, Q4_1 the same or up to 1.1x (bench_gemm_quant, AMD Zen 4,
   1 and 2 threads). At 1 and 2 rows it made Q6_K 1.3-1.6x slower: a pass that short streams its own blocks at
   the memory's rate, and the next panel's compete. */
#define NEXT_PANEL_FROM_ROWS 3

/* Whether a pass that streams its own panel from memory is faster asking for its blocks ahead. Not below
   NEXT_PANEL_FROM_ROWS rows, except for Q6_K: such a pass over a repacked Q4_0, Q4_1, Q8_0 (quant_repack.c),
   Q4_K or Q5_K panel reads it as one ascending stream, which the hardware prefetchers keep ahead of, and
   requests of its own only held it back (16 layers of the 1B shapes at 1 row, back to back, one thread, AMD
   Zen 4: 1.17x slower with them in Q4_0, 1.27x in Q4_K). A Q6_K pass reads each super-block's high bits
   before its low ones and needs them (2.6x slower without). */
static int own_requests_help(int64_t format, int64_t m) { return m >= NEXT_PANEL_FROM_ROWS || format == Q6_K; }

/* What pass (group, h) of a panel's few-row passes (`groups` groups of FUSED_ROWS rows x `halves` halves) asks
   the cache for: its own blocks ahead in the first group only (later groups find the panel cached), and
   (share_next: from NEXT_PANEL_FROM_ROWS rows) its share of the next panel's bytes (a repacked one), so that
   the next panel's first group reads from cache instead of streaming from memory at the rate it computes
   (one Zen 4 core streams ~19 GB/s; a group of 4 rows of Q4_0 consumes ~23). The omp schedule is static:
   the next panel in the list is this thread's next (or none). skip_own: the pass asks for none of its own
   blocks. So does a panel the thread's previous panel asked for this way: they found the lines in cache and
   only cost issue slots (skipping them made the default model's Q8_0 logits head 1.08-1.17x faster at 8-27
   rows, Q4_K 1.02-1.10x, AMD Zen 4); and a lone pass of 1-2 rows over a 32-value panel (own_requests_help).
   Speed only. */
static pass_prefetch pass_prefetch_of(const detinf_qpart *next_part, const panel_ref *next_ref, int64_t group,
                                      int64_t groups, int h, int halves, int skip_own, int share_next) {
    pass_prefetch pf = {group == 0 && !skip_own, NULL, 0};
    if (!next_part || next_part->format < X16 || !share_next) return pf;
    const int64_t cols = next_part->cols - next_ref->first_col;
    const int64_t bytes = (cols > QCOLS ? 2 : 1) * QCOLS * next_part->row_bytes;
    const int64_t pass = group * halves + h, passes = groups * halves;
    const int64_t from = bytes * pass / passes;
    pf.next = next_part->data + next_ref->first_col * next_part->row_bytes + from;
    pf.next_bytes = bytes * (pass + 1) / passes - from;
    return pf;
}
#endif

/* One panel of the GEMM; next_part / next_ref: the panel this thread computes next (NULL: none), covered:
   whether the panel before asked for this one (both for pass_prefetch_of). Returns whether this panel's
   passes asked for the next one. */
static int compute_panel(const gemm_call *call, const detinf_qpart *part, const panel_ref *ref,
                         const detinf_qpart *next_part, const panel_ref *next_ref, int covered, workspace *ws) {
    const int64_t cols = part->cols - ref->first_col < ACC_COLS ? part->cols - ref->first_col : ACC_COLS;
    const int halves = cols > QCOLS ? 2 : 1;
    panel_source src;
    panel_source_of(part, ref, cols, &src);
    const xquant *xq = format_block_values(src.format) == SUPER ? call->x256 : call->x32;
    const int64_t units = xq->k / UNIT, chunks = (units + CHUNK_UNITS - 1) / CHUNK_UNITS;
    const int reverse =
        (call->flags & QTEST_REVERSE) || ((call->flags & QTEST_REVERSE_ODD) && omp_get_thread_num() % 2);
#if defined(DETINF_Q_AVX512)
    /* few rows: blocks multiplied as they are read, FUSED_ROWS rows at a time (the AMX tiles' rows excepted) */
    const int64_t fused_rows = src.panel ? fused_row_limit(src.format) : FUSED_ROWS;
    if (call->m <= fused_rows && !(xq == call->x32 && call->amx_tiles) && !reverse) {
        const int64_t groups = (call->m + FUSED_ROWS - 1) / FUSED_ROWS;
        const int share_next = call->m >= NEXT_PANEL_FROM_ROWS;
        const int skip_own = covered || !own_requests_help(src.format, call->m);
        int asked = 0;
        for (int64_t r0 = 0; r0 < call->m; r0 += FUSED_ROWS) {
            const xquant rows = xquant_from_row(xq, r0);
            const int64_t R = call->m - r0 < FUSED_ROWS ? call->m - r0 : FUSED_ROWS;
            for (int h = 0; h < halves; h++) {
                float *acc = ws->acc + r0 * ACC_COLS + h * QCOLS;
                const pass_prefetch pf =
                    pass_prefetch_of(next_part, next_ref, r0 / FUSED_ROWS, groups, h, halves, skip_own, share_next);
                asked |= src.panel && pf.next_bytes > 0; /* the stored rows' loops ask for their own lines */
                if (src.panel) fused_x16_avx512(src.format, src.panel + h * src.half_bytes, &rows, R, &pf, acc);
                else fused_half_avx512(src.format, src.rows + h * QCOLS, part->row_bytes, &rows, R, acc);
            }
        }
        store_panel(call, ws->acc, ref->out_col, cols);
        return asked;
    }
#else
    (void)covered;
#endif
    /* rows the AMX tiles take (32-value formats only); the rest go through kernel_rows, with the same bits */
    const int64_t amx_done = xq == call->x32 ? call->amx_tiles * AMX_ROWS : 0; /* may pass m: padding rows */
    const int64_t vnni_rows = call->m > amx_done ? call->m - amx_done : 0;
    memset(ws->acc, 0, sizeof(float) * (size_t)((amx_done + vnni_rows) * ACC_COLS)); /* acc = +0 */
    for (int64_t i = 0; i < chunks; i++) {
        const int64_t chunk = reverse ? chunks - 1 - i : i;
        const int64_t u0 = chunk * CHUNK_UNITS;
        const int64_t count = units - u0 < CHUNK_UNITS ? units - u0 : CHUNK_UNITS;
        for (int h = 0; h < halves; h++) unpack_half(&src, h, part->row_bytes, units, u0, count, &ws->halves[h]);
        kernel_rows(src.format, xq, amx_done, vnni_rows, u0, count, ws->halves, halves, ws->acc + amx_done * ACC_COLS);
#if defined(DETINF_Q_AMX) /* after kernel_rows: amx_rows turns the chunk's weights signed */
        if (amx_done)
            amx_rows(src.format, xq, 0, call->amx_tiles, u0, count, ws->halves, halves,
                     !(call->flags & QTEST_AMX_UNSIGNED), ws->acc);
#endif
    }
    store_panel(call, ws->acc, ref->out_col, cols);
    return 0;
}

/* The panels of every part, in output order: -> count, or -1 when out of memory. */
static int64_t list_panels(const detinf_qpart *parts, int64_t nparts, panel_ref **out) {
    int64_t count = 0, out_col = 0;
    for (int64_t p = 0; p < nparts; p++) count += (parts[p].cols + ACC_COLS - 1) / ACC_COLS;
    panel_ref *refs = malloc(sizeof(panel_ref) * (size_t)(count + 1));
    if (!refs) return -1;
    count = 0;
    for (int64_t p = 0; p < nparts; p++) {
        for (int64_t first = 0; first < parts[p].cols; first += ACC_COLS) {
            refs[count++] = (panel_ref){p, first, out_col + first};
        }
        out_col += parts[p].cols;
    }
    *out = refs;
    return count;
}

static int run_panels(const gemm_call *call, const detinf_qpart *parts, const panel_ref *refs, int64_t count,
                      int64_t k) {
    int status = 0;
#pragma omp parallel reduction(| : status) if (call->m * call->n * k >= (int64_t)1 << 20)
    {
        workspace ws;
        const int failed = workspace_alloc(&ws, call->acc_rows);
        status |= failed;
#if defined(DETINF_Q_AMX)
        if (call->amx_tiles) amx_begin(); /* the tile configuration is per thread */
#endif
        int covered = 0; /* the thread's previous panel asked for this one */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < count; i++) {
            const panel_ref *next = i + 1 < count ? &refs[i + 1] : NULL;
            const detinf_qpart *next_part = next ? &parts[next->part] : NULL;
            if (!failed) covered = compute_panel(call, &parts[refs[i].part], &refs[i], next_part, next, covered, &ws);
        }
#if defined(DETINF_Q_AMX)
        if (call->amx_tiles) amx_end();
#endif
        free(ws.block);
    }
    return status;
}

/* How many 16-row tiles of an m-row call the AMX path takes, when this build has it, the kernel grants it
   and the tests did not switch it off (else 0): m / 16, and one more whose last rows are padding when
   PAD_FROM or more rows are left over (a tile costs as much for 11 rows as for 16: at 27 rows a padded
   second tile was 1.05-1.11x faster than 11 rows of VNNI tiles at issue 36's shapes, at 24 rows
   0.91-1.06x). Speed only: the bits are those of kernel_rows. */
#define PAD_FROM 10
static int64_t amx_tile_count(int64_t m, int flags) {
#if defined(DETINF_Q_AMX)
    if (m >= AMX_ROWS && !(flags & QTEST_NO_AMX) && amx_usable())
        return m / AMX_ROWS + (m % AMX_ROWS >= PAD_FROM);
#endif
    (void)m, (void)flags;
    return 0;
}

/* 1 when this build and process run the AMX tiles for calls of 16 rows or more, else 0. */
int detinf_quant_uses_amx(void) { return amx_tile_count(AMX_ROWS, 0) > 0; }

/* out [m][n] = x [m][k] (fp32, or bf16 when x_bf16) times the parts' rows stacked (n = their columns),
   + bias [n] fp32 (or NULL); out fp32, or bf16 when out_bf16. Inputs were checked by ops/quant.py.
   Returns 0, or 1 when memory ran out. flags: QTEST_* hooks for the tests' negative controls, else 0. */
int detinf_quant_gemm(const void *x, int64_t m, int64_t k, int x_bf16, const detinf_qpart *parts, int64_t nparts,
                      const float *bias, void *out, int64_t n, int out_bf16, int flags) {
    int need32 = 0, need256 = 0;
    for (int64_t p = 0; p < nparts; p++) {
        if (format_block_values(stored_format(parts[p].format)) == SUPER) need256 = 1;
        else need32 = 1;
    }
    xquant x32 = {0}, x256 = {0};
    panel_ref *refs = NULL;
    const int64_t amx_tiles = need32 ? amx_tile_count(m, flags) : 0;
    const int64_t rows32 = amx_tiles * AMX_ROWS > m ? amx_tiles * AMX_ROWS : m; /* with the padding rows */
    int status = (need32 && xquant_alloc(&x32, rows32, k, UNIT)) || (need256 && xquant_alloc(&x256, m, k, SUPER));
    const int64_t count = status ? 0 : list_panels(parts, nparts, &refs);
    if (count < 0) status = 1;
    if (!status) {
        if (need32) xquant_rows(&x32, x, m, x_bf16, flags & QTEST_BATCH_SCALE);
        if (need32) xquant_zero_rows(&x32, m, rows32);
        if (need256) xquant_rows(&x256, x, m, x_bf16, flags & QTEST_BATCH_SCALE);
        const gemm_call call = {&x32, &x256, m, n, bias, out, out_bf16, flags, amx_tiles, rows32};
        status = run_panels(&call, parts, refs, count, k);
    }
    free(refs);
    xquant_free(&x32);
    xquant_free(&x256);
    return status;
}
