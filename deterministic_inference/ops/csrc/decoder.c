/* The decoder layers of one step in one call (ops/fused.py): for each layer, the same entry points the
   per-op path calls from Python, with the same arguments, in the same order:

     normed = add_rms_norm(hidden += pending, input_norm)
     qkv    = linear(normed)                      (quantized GEMM, or the bf16 GEMM)
     q      = rotary_write_kv(qkv)                (k, v into the layer's cache)
     att    = attention(q) -> model dtype         (fp32 -> bf16 by f32_to_bf16, torch's rounding)
     delta  = linear(att)
     normed = add_rms_norm(hidden += delta, post_attention_norm)
     pending = linear(silu_mul(linear(normed)))   (gate_up, then down)

   So every output bit is the per-op path's: this file adds no arithmetic of its own except the
   fp32 -> bf16 rounding of the attention output, which is torch's round-to-nearest-even (a NaN may get
   another payload than torch's, and the next GEMM turns any NaN into its canonical quiet NaN). What it
   removes is ~10 Python calls, their checks and their tensor allocations per layer. */

#include <time.h>

#include "quant.h"

void detinf_add_rms_norm(void *hidden, const void *delta, const void *weight, void *out, int64_t rows,
                         int64_t width, float eps, int model_bf16);
void detinf_silu_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int model_bf16,
                     const uint16_t *table);
int detinf_rotary_write_kv(const void *qkv, const int64_t *positions, const float *cos_table,
                           const float *sin_table, const int64_t *write_blocks, const int64_t *write_offsets,
                           float *q_out, void *k_cache, void *v_cache, int64_t tokens, int64_t heads,
                           int64_t kv_heads, int64_t dim, int64_t block, int64_t num_blocks, int64_t table_rows,
                           int model_bf16, int cache_dtype);
int detinf_attention(const float *q, const void *k_cache, const void *v_cache, int cache_dtype,
                     const int64_t *block_ids, int64_t num_ids, const int64_t *row_table,
                     const int64_t *row_keys, int64_t first_row, int64_t end_row, int64_t heads,
                     int64_t kv_heads, int64_t head_dim, int64_t block, int64_t num_blocks, float scale,
                     float *out, int64_t tile);
void detinf_gemm_bf16(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                      const float *bias, void *out, int out_bf16);
int detinf_gemm_bf16_amx(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                         const float *bias, void *out, int out_bf16);
int detinf_gemm_bf16_amx_quant(const uint16_t *x, int64_t m, int64_t k, const detinf_qpart *parts, int64_t nparts,
                               int64_t n, const float *bias, void *out, int out_bf16);

enum { LINEAR_QUANT = 1, LINEAR_BF16 = 2, LINEAR_BF16_AMX = 3, LINEAR_QUANT_AMX = 4 }; /* AMX: --numerics native */
/* status codes (ops/fused.py raises the per-op path's errors for them) */
enum { FUSED_OK = 0, FUSED_ROTARY_RANGE = 1, FUSED_ATTENTION_RANGE = 2, FUSED_ATTENTION_MEMORY = 3,
       FUSED_GEMM_MEMORY = 4, FUSED_BAD_LINEAR = 5 };

/* One linear as ops/linear.py built it (ctypes mirror in ops/fused.py). */
typedef struct {
    int64_t kind;               /* LINEAR_QUANT, LINEAR_BF16 or LINEAR_BF16_AMX */
    const detinf_qpart *parts;  /* quantized: the parts table of ops/quant.py's QuantLinear */
    int64_t nparts;
    const uint16_t *packed;     /* bf16: detinf_pack_bf16's layout */
    const float *bias;          /* [n] fp32 or NULL */
    int64_t n, k;
} detinf_linear;

/* One decoder layer's weights and KV cache. */
typedef struct {
    const void *input_norm, *post_norm; /* [hidden] model dtype */
    detinf_linear qkv, o_proj, gate_up, down;
    void *k_cache, *v_cache;            /* [blocks, KVH, D, block], [blocks, KVH, block, D] (kv_dtype) */
} detinf_layer;

/* The step: shapes, attention metadata (shared by every layer) and scratch buffers. */
typedef struct {
    int64_t tokens, hidden, heads, kv_heads, head_dim, inter;
    float eps, scale;
    int64_t model_bf16, flags;          /* flags: QTEST_* for the tests' negative controls, else 0 */
    int64_t kv_dtype;                   /* the caches': 0 fp32, 1 bf16, 2 q8_0 (kv_q8.h) */
    const int64_t *positions;           /* [T] */
    const float *cos, *sin;             /* [table_rows, D] fp32 */
    int64_t table_rows;
    const int64_t *write_blocks, *write_offsets, *block_ids, *row_table, *row_keys;
    int64_t num_ids, num_blocks, block_size;
    void *normed;                       /* [T, hidden] model dtype */
    void *qkv;                          /* [T, (H + 2 KVH) D] model dtype */
    float *q32, *att32;                 /* [T, H, D] fp32 */
    void *att;                          /* [T, H D] model dtype (unused for fp32 models: att32 is read) */
    void *delta;                        /* [T, hidden] model dtype */
    void *gate_up;                      /* [T, 2 I] model dtype */
    void *act;                          /* [T, I] model dtype */
    double *phase_seconds;              /* NULL, or [PHASE_COUNT] seconds added per phase (profiling) */
    const uint16_t *silu_table;         /* detinf_silu_table's (rowwise.c), or NULL */
} detinf_step;

/* The phases bench/profile_engine.py reports: wall seconds of each call, summed over the layers. */
enum { PHASE_NORM, PHASE_QKV, PHASE_ROTARY, PHASE_ATTENTION, PHASE_ATT_ROUND, PHASE_O_PROJ, PHASE_GATE_UP,
       PHASE_SILU, PHASE_DOWN, PHASE_COUNT };

static double seconds_now(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
}

/* `statement`, its wall time added to phase_seconds[phase] when the step asks for timings (timing never
   touches the arithmetic). */
#define PHASE(step, phase, statement)                                        \
    do {                                                                     \
        if ((step)->phase_seconds == NULL) {                                 \
            statement;                                                       \
        } else {                                                             \
            const double start_ = seconds_now();                             \
            statement;                                                       \
            (step)->phase_seconds[phase] += seconds_now() - start_;          \
        }                                                                    \
    } while (0)

static int run_linear(const detinf_linear *linear, const void *x, int64_t m, int model_bf16, void *out, int flags) {
    if (linear->kind == LINEAR_QUANT) {
        return detinf_quant_gemm(x, m, linear->k, model_bf16, linear->parts, linear->nparts, linear->bias, out,
                                 linear->n, model_bf16, flags)
                   ? FUSED_GEMM_MEMORY
                   : FUSED_OK;
    }
    if (!model_bf16) return FUSED_BAD_LINEAR;
    if (linear->kind == LINEAR_QUANT_AMX) /* the per-op path's QuantLinear.on_tiles, the same call */
        return detinf_gemm_bf16_amx_quant((const uint16_t *)x, m, linear->k, linear->parts, linear->nparts, linear->n,
                                          linear->bias, out, 1)
                   ? FUSED_GEMM_MEMORY
                   : FUSED_OK;
    if (linear->kind == LINEAR_BF16_AMX) /* the per-op path's native GEMM, the same call */
        return detinf_gemm_bf16_amx((const uint16_t *)x, m, linear->k, linear->packed, linear->n, linear->bias,
                                    out, 1)
                   ? FUSED_GEMM_MEMORY
                   : FUSED_OK;
    if (linear->kind != LINEAR_BF16) return FUSED_BAD_LINEAR;
    detinf_gemm_bf16((const uint16_t *)x, m, linear->k, linear->packed, linear->n, linear->bias, out, 1);
    return FUSED_OK;
}

/* out = att rounded to bf16 (f32_to_bf16: torch's rounding), [rows, width]; rows shared out between the
   OpenMP threads, each element on its own. */
static void round_rows(const float *att, uint16_t *out, int64_t rows, int64_t width) {
#pragma omp parallel for schedule(static) if (rowwise_parallel(rows, width))
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = r * width; i < (r + 1) * width; i++) out[i] = f32_to_bf16(att[i]);
    }
}

static int attention_block(const detinf_layer *layer, const detinf_step *s, int bf16) {
    const int64_t t = s->tokens;
    int status;
    PHASE(s, PHASE_ROTARY,
          status = detinf_rotary_write_kv(s->qkv, s->positions, s->cos, s->sin, s->write_blocks, s->write_offsets,
                                          s->q32, layer->k_cache, layer->v_cache, t, s->heads, s->kv_heads,
                                          s->head_dim, s->block_size, s->num_blocks, s->table_rows, bf16,
                                          (int)s->kv_dtype));
    if (status) return FUSED_ROTARY_RANGE;
    /* tile 0: the kernel's choice; never changes a bit */
    PHASE(s, PHASE_ATTENTION,
          status = detinf_attention(s->q32, layer->k_cache, layer->v_cache, (int)s->kv_dtype, s->block_ids,
                                    s->num_ids, s->row_table, s->row_keys, 0, t, s->heads, s->kv_heads, s->head_dim,
                                    s->block_size, s->num_blocks, s->scale, s->att32, 0));
    if (status == 2) return FUSED_ATTENTION_RANGE;
    if (status) return FUSED_ATTENTION_MEMORY;
    if (!bf16) return FUSED_OK;
    PHASE(s, PHASE_ATT_ROUND, round_rows(s->att32, (uint16_t *)s->att, t, s->heads * s->head_dim));
    return FUSED_OK;
}

static int run_layer(const detinf_layer *layer, const detinf_step *s, void *hidden, void *pending, int has_pending) {
    const int bf16 = (int)s->model_bf16, flags = (int)s->flags;
    const int64_t t = s->tokens;
    PHASE(s, PHASE_NORM, detinf_add_rms_norm(hidden, has_pending ? pending : NULL, layer->input_norm, s->normed, t,
                                             s->hidden, s->eps, bf16));
    int status;
    PHASE(s, PHASE_QKV, status = run_linear(&layer->qkv, s->normed, t, bf16, s->qkv, flags));
    if (!status) status = attention_block(layer, s, bf16);
    if (!status) {
        void *att = bf16 ? s->att : (void *)s->att32;
        PHASE(s, PHASE_O_PROJ, status = run_linear(&layer->o_proj, att, t, bf16, s->delta, flags));
    }
    if (status) return status;
    PHASE(s, PHASE_NORM, detinf_add_rms_norm(hidden, s->delta, layer->post_norm, s->normed, t, s->hidden, s->eps, bf16));
    PHASE(s, PHASE_GATE_UP, status = run_linear(&layer->gate_up, s->normed, t, bf16, s->gate_up, flags));
    if (status) return status;
    PHASE(s, PHASE_SILU, detinf_silu_mul(s->gate_up, s->act, t, s->inter, bf16, s->silu_table));
    PHASE(s, PHASE_DOWN, status = run_linear(&layer->down, s->act, t, bf16, pending, flags));
    return status;
}

/* Layers [0, count) of one step. hidden [T, hidden] (the residual stream, updated in place) and pending
   [T, hidden] (the previous layer's MLP output, not yet added; has_pending 0 before the first layer)
   are in the model dtype; on return pending holds the last layer's MLP output. Returns FUSED_*. */
int detinf_decoder_layers(const detinf_layer *layers, int64_t count, const detinf_step *step, void *hidden,
                          void *pending, int has_pending) {
    for (int64_t i = 0; i < count; i++) {
        const int status = run_layer(&layers[i], step, hidden, pending, has_pending || i > 0);
        if (status) return status;
    }
    return FUSED_OK;
}
