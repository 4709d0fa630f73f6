/* Row-wise decoder ops for deterministic-inference: RMSNorm (with the residual add), the gated-MLP
   activations (SiLU, GELU-tanh), logit soft-capping and the rotary embedding with the KV-cache write.

   Same promise as attention.c: every output element is a fixed sequence of IEEE float operations on
   its own row (the only reduction, RMSNorm's sum of squares, runs in 16 lane partial sums over the
   row then a fixed tree), built without reassociation or contraction, so neither the batch, the row's
   position, the thread nor the ISA flags can change a bit. Rows are shared out between torch's OpenMP
   threads (each row whole on one thread). `model_bf16` selects the model dtype:
   activations are then bf16 in memory, computed in fp32 and rounded to nearest even after the same
   operations torch performs in bf16 (each bf16 op computes in fp32 and rounds once). */

/* Wider vectors where the build has AVX-512 (gcc's default for -march=native there is 256 bits): every
   loop here is elementwise or keeps its 16 lane sums explicit, so the width changes speed only. */
#if defined(__x86_64__) && defined(__AVX512F__)
#pragma GCC target("prefer-vector-width=512")
#endif

#include "common.h"
#include "kv_q8.h"

/* Read element i of an activation tensor as fp32 / round a value the way the model dtype stores it. */
static inline float load_act(const void *base, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline float round_act(float value, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(value)) : value; }

static inline void store_act(void *base, int64_t i, float value, int bf16) {
    if (bf16) ((uint16_t *)base)[i] = f32_to_bf16(value);
    else ((float *)base)[i] = value;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && !defined(DETINF_TEST_SEPARATE_STEPS)
#define ROWWISE_BF16_512 1
/* RMSNorm's bf16 rows on 16-lane AVX-512 registers: lane l holds element base + l, every lane op the
   scalar one below (the integer round-to-nearest-even of f32_to_bf16 with its NaN rule, IEEE adds and
   multiplies), the 16 lane sums kept in one register, tails under a mask. So the bits are the scalar
   loops'; the tests compare builds with and without AVX-512. (SiLU's computed loop gains nothing from
   this, bound by the divides; its table loop below uses these helpers.) */
static inline __m512 load_bf16x16(const uint16_t *p, __mmask16 live) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

static inline __m512 round_bf16x16(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16)); }

static inline void store_bf16x16(uint16_t *p, __m512 v, __mmask16 live) {
    _mm256_mask_storeu_epi16(p, live, _mm512_cvtepi32_epi16(bf16_bits16(v)));
}

/* add_rms_norm_row's bf16 arithmetic (below), on one row of `width` */
static void add_rms_norm_row_bf16(uint16_t *hidden, const uint16_t *delta, const uint16_t *weight, uint16_t *out,
                                  int64_t width, float eps) {
    __m512 lanes = _mm512_setzero_ps();
    for (int64_t i = 0; i < width; i += 16) {
        const __mmask16 live = lane_mask16(width - i);
        __m512 x = load_bf16x16(hidden + i, live);
        if (delta != NULL) {
            x = round_bf16x16(_mm512_add_ps(x, load_bf16x16(delta + i, live)));
            store_bf16x16(hidden + i, x, live);
        }
        lanes = _mm512_mask_add_ps(lanes, live, lanes, _mm512_mul_ps(x, x));
    }
    float sums[LANES];
    _mm512_storeu_ps(sums, lanes);
    const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(lane_tree(sums) / (float)width + eps));
    for (int64_t j = 0; j < width; j += 16) {
        const __mmask16 live = lane_mask16(width - j);
        const __m512 normed = round_bf16x16(_mm512_mul_ps(load_bf16x16(hidden + j, live), inv));
        store_bf16x16(out + j, _mm512_mul_ps(load_bf16x16(weight + j, live), normed), live);
    }
}
#endif

/* hidden[r] (+)= delta[r] (when delta is given), then out[r] = weight * round(hidden[r] * rsqrt(mean(
   hidden[r]^2) + eps)): HF Llama's RMSNorm on the residual stream, for row r of width `width`. hidden,
   delta, out, weight in the model dtype; hidden is updated in place. The exported functions call the
   row functions with a literal model_bf16, so each dtype gets its own branch-free (vectorisable) loops;
   the arithmetic is the same either way. */
/* hidden[i] after the residual add (stored back when delta is given), as fp32. */
INLINE float residual_at(void *hidden, const void *delta, int64_t i, int model_bf16) {
    float x = load_act(hidden, i, model_bf16);
    if (delta != NULL) {
        x = round_act(x + load_act(delta, i, model_bf16), model_bf16);
        store_act(hidden, i, x, model_bf16);
    }
    return x;
}

INLINE void add_rms_norm_row(void *hidden, const void *delta, const void *weight, void *out, int64_t r,
                             int64_t width, float eps, int model_bf16) {
    const int64_t base = r * width;
    float lanes[LANES] = {0}; /* element i of the row goes to lane i % 16, in ascending order */
    int64_t i = 0;
    for (; i + LANES <= width; i += LANES) {
        for (int l = 0; l < LANES; l++) {
            const float x = residual_at(hidden, delta, base + i + l, model_bf16);
            lanes[l] = lanes[l] + x * x;
        }
    }
    for (int l = 0; i + l < width; l++) {
        const float x = residual_at(hidden, delta, base + i + l, model_bf16);
        lanes[l] = lanes[l] + x * x;
    }
    const float inv = 1.0f / sqrtf(lane_tree(lanes) / (float)width + eps);
    for (int64_t j = 0; j < width; j++) {
        const float normed = round_act(load_act(hidden, base + j, model_bf16) * inv, model_bf16);
        store_act(out, base + j, load_act(weight, j, model_bf16) * normed, model_bf16);
    }
}

void detinf_add_rms_norm(void *hidden, const void *delta, const void *weight, void *out, int64_t rows,
                         int64_t width, float eps, int model_bf16) {
#pragma omp parallel for schedule(static) if (rowwise_parallel(rows, width))
    for (int64_t r = 0; r < rows; r++) {
#if defined(ROWWISE_BF16_512)
        if (model_bf16) {
            add_rms_norm_row_bf16((uint16_t *)hidden + r * width, delta ? (const uint16_t *)delta + r * width : NULL,
                                  (const uint16_t *)weight, (uint16_t *)out + r * width, width, eps);
            continue;
        }
#endif
        if (model_bf16) add_rms_norm_row(hidden, delta, weight, out, r, width, eps, 1);
        else add_rms_norm_row(hidden, delta, weight, out, r, width, eps, 0);
    }
}

/* silu(g) = g / (1 + exp(-g)) in fp32, rounded as the model dtype stores it (ops/activation.py did this with
   torch ops). */
INLINE float silu_act(float gate, int model_bf16) {
    return round_act(gate / (exp_clamped(-gate) + 1.0f), model_bf16);
}

/* table[h] = silu_act of the bf16 value with bits h, as bf16 bits, for every h (and table[65536] = 0, so a
   32-bit gather at h = 65535 stays inside): SILU_TABLE_ENTRIES values, ops/native.py builds it once per
   loaded library. A bf16 gate has only 65536 values, and silu_act of one is a fixed function of its bits,
   so looking it up gives the bits of computing it (the tests compare both ways over every gate). */
#define SILU_TABLE_ENTRIES 65537
void detinf_silu_table(uint16_t *table) {
    for (int32_t bits = 0; bits < SILU_TABLE_ENTRIES - 1; bits++)
        table[bits] = f32_to_bf16(silu_act(bf16_to_f32((uint16_t)bits), 1));
    table[SILU_TABLE_ENTRIES - 1] = 0;
}

/* out[r, j] = round(silu(gate[r, j])) * up[r, j] with gate = gate_up[r, :inter], up = gate_up[r, inter:]. */
INLINE void silu_mul_row(const void *gate_up, void *out, int64_t r, int64_t inter, int model_bf16) {
    const int64_t in_base = r * 2 * inter, out_base = r * inter;
    for (int64_t j = 0; j < inter; j++) {
        const float act = silu_act(load_act(gate_up, in_base + j, model_bf16), model_bf16);
        store_act(out, out_base + j, act * load_act(gate_up, in_base + inter + j, model_bf16), model_bf16);
    }
}

/* silu_mul_row of a bf16 row with silu_act read from detinf_silu_table's `table`: the same bits, without the
   division and exp that bound the computed loop (~2 cycles a value). 16 lanes at a time where the build has
   AVX-512 (a gather of the 16 gates' entries; the product and its rounding lane by lane as below). */
static void silu_mul_row_table(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t inter,
                               const uint16_t *table) {
    int64_t j = 0;
#if defined(ROWWISE_BF16_512)
    for (; j + 16 <= inter; j += 16) {
        const __m512i index = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(gate + j)));
        const __m512i entry = _mm512_i32gather_epi32(index, (const void *)table, 2); /* low 16 bits: table[g] */
        const __m512 act = _mm512_castsi512_ps(_mm512_slli_epi32(entry, 16));
        store_bf16x16(out + j, _mm512_mul_ps(act, load_bf16x16(up + j, 0xFFFF)), 0xFFFF);
    }
#endif
    for (; j < inter; j++) out[j] = f32_to_bf16(bf16_to_f32(table[gate[j]]) * bf16_to_f32(up[j]));
}

/* gate_up [rows, 2 inter] -> out [rows, inter], rows shared out between the threads (each row whole on one).
   `table`: detinf_silu_table's, or NULL to compute every value (bf16 models only read it). */
void detinf_silu_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int model_bf16,
                     const uint16_t *table) {
#pragma omp parallel for schedule(static) if (rowwise_parallel(rows, 2 * inter))
    for (int64_t r = 0; r < rows; r++) {
        if (model_bf16 && table != NULL) {
            const uint16_t *row = (const uint16_t *)gate_up + r * 2 * inter;
            silu_mul_row_table(row, row + inter, (uint16_t *)out + r * inter, inter, table);
        } else if (model_bf16) silu_mul_row(gate_up, out, r, inter, 1);
        else silu_mul_row(gate_up, out, r, inter, 0);
    }
}

/* out[r, j] = round(gelu_tanh(gate[r, j])) * up[r, j] (GeGLU: Gemma's MLP), with torch's tanh
   approximation written out in fp32 in its order: inner = sqrt(2/pi) * (g + 0.044715 * g^3),
   gelu = 0.5 * g * (1 + tanh(inner)). */
INLINE void gelu_tanh_mul_row(const void *gate_up, void *out, int64_t r, int64_t inter, int model_bf16) {
    const int64_t in_base = r * 2 * inter, out_base = r * inter;
    const float beta = 0.7978845608028654f, kappa = 0.044715f;
    for (int64_t j = 0; j < inter; j++) {
        const float g = load_act(gate_up, in_base + j, model_bf16);
        const float inner = beta * (g + kappa * (g * g * g));
        const float act = round_act(0.5f * g * (1.0f + tanh_portable(inner)), model_bf16);
        store_act(out, out_base + j, act * load_act(gate_up, in_base + inter + j, model_bf16), model_bf16);
    }
}

void detinf_gelu_tanh_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int model_bf16) {
#pragma omp parallel for schedule(static) if (rowwise_parallel(rows, 2 * inter))
    for (int64_t r = 0; r < rows; r++) {
        if (model_bf16) gelu_tanh_mul_row(gate_up, out, r, inter, 1);
        else gelu_tanh_mul_row(gate_up, out, r, inter, 0);
    }
}

/* tanh(x / cap) * cap elementwise over n fp32 values in place (Gemma 2's logit soft-capping). */
void detinf_softcap(float *x, int64_t n, float cap) {
#pragma omp parallel for schedule(static) if (n >= 65536)
    for (int64_t i = 0; i < n; i++) x[i] = tanh_portable(x[i] / cap) * cap;
}

/* One head's rotation (rotate-half layout): out[d] = round(round(x[d] * c[d]) + round(rot[d] * s[d]))
   with rot = (-x[half:], x[:half]) and c, s the fp32 tables rounded to the model dtype (`cos_r`, `sin_r`:
   rounded once per token by the caller), as HF computes it in bf16. `out` is fp32 scratch of `dim`
   values. The two halves run as two loops (partner -x[d + half], then x[d - half]) so each vectorises;
   every element is the same three rounded operations either way. */
INLINE void rotate_half(const void *x, int64_t offset, const float *cos_r, const float *sin_r, int64_t from,
                        int64_t to, int64_t shift, int negate, int bf16, float *out) {
    for (int64_t d = from; d < to; d++) {
        const float value = load_act(x, offset + d, bf16);
        const float other = load_act(x, offset + d + shift, bf16);
        const float partner = negate ? -other : other;
        const float a = round_act(value * cos_r[d], bf16);
        const float b = round_act(partner * sin_r[d], bf16);
        out[d] = round_act(a + b, bf16);
    }
}

INLINE void rotate(const void *x, int64_t offset, const float *cos_r, const float *sin_r, int64_t dim, int bf16,
                   float *out) {
    const int64_t half = dim / 2;
    rotate_half(x, offset, cos_r, sin_r, 0, half, half, 1, bf16, out);
    rotate_half(x, offset, cos_r, sin_r, half, dim, -half, 0, bf16, out);
}

/* KV head h's rotated key and value (model-dtype values as fp32, [dim]) into slot `off` of block `blk`:
   copies for fp32 and bf16 caches (bf16 rounds to nearest even), kv_q8.h's quantizer for q8_0. */
static void store_kv(void *k_cache, void *v_cache, const float *key, const float *value, int64_t blk, int64_t off,
                     int64_t h, int64_t kv_heads, int64_t dim, int64_t block, int cache_dtype) {
    const int64_t slice = blk * kv_heads + h;
    if (cache_dtype == KV_Q8) {
        const int64_t row_bytes = q8_row_bytes(dim);
        q8_store_key((int8_t *)k_cache + slice * row_bytes * block, key, dim, block, off);
        q8_store_value((int8_t *)v_cache + (slice * block + off) * row_bytes, value, dim);
        return;
    }
    const int bf16 = cache_dtype == KV_BF16;
    for (int64_t d = 0; d < dim; d++) {
        store_act(k_cache, (slice * dim + d) * block + off, key[d], bf16);
        store_act(v_cache, (slice * block + off) * dim + d, value[d], bf16);
    }
}

#if defined(ROWWISE_BF16_512)
/* rotate's bf16 arithmetic, 16 lanes at a time (dim a multiple of 32): lane l of a step holds dims d + l
   and d + half + l, each the scalar's three rounded operations (the negation flips the sign bit, as the
   scalar's does). */
static void rotate_bf16x16(const uint16_t *x, const float *cos_r, const float *sin_r, int64_t dim, float *out) {
    const int64_t half = dim / 2;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t d = 0; d < half; d += 16) {
        const __m512 lo = load_bf16x16(x + d, 0xFFFF), hi = load_bf16x16(x + d + half, 0xFFFF);
        const __m512 lo_cos = round_bf16x16(_mm512_mul_ps(lo, _mm512_loadu_ps(cos_r + d)));
        const __m512 hi_sin = round_bf16x16(_mm512_mul_ps(_mm512_xor_ps(hi, sign), _mm512_loadu_ps(sin_r + d)));
        _mm512_storeu_ps(out + d, round_bf16x16(_mm512_add_ps(lo_cos, hi_sin)));
        const __m512 hi_cos = round_bf16x16(_mm512_mul_ps(hi, _mm512_loadu_ps(cos_r + d + half)));
        const __m512 lo_sin = round_bf16x16(_mm512_mul_ps(lo, _mm512_loadu_ps(sin_r + d + half)));
        _mm512_storeu_ps(out + d + half, round_bf16x16(_mm512_add_ps(hi_cos, lo_sin)));
    }
}

/* rotary_write_kv_token for a bf16 model and a bf16 cache, dim a multiple of 32: the same values to the same
   places (a key's bf16 bits are f32_to_bf16 of the rotated value, a value's those of its copy, as store_kv). */
static void rotary_write_kv_token_bf16(const uint16_t *qkv, const float *cos_row, const float *sin_row, float *q_out,
                                       uint16_t *k_cache, uint16_t *v_cache, int64_t t, int64_t blk, int64_t off,
                                       int64_t heads, int64_t kv_heads, int64_t dim, int64_t block) {
    const uint16_t *row = qkv + t * (heads + 2 * kv_heads) * dim;
    float cos_r[1024], sin_r[1024], rotated[1024];
    uint16_t key[1024];
    for (int64_t d = 0; d < dim; d += 16) {
        _mm512_storeu_ps(cos_r + d, round_bf16x16(_mm512_loadu_ps(cos_row + d)));
        _mm512_storeu_ps(sin_r + d, round_bf16x16(_mm512_loadu_ps(sin_row + d)));
    }
    for (int64_t h = 0; h < heads; h++) rotate_bf16x16(row + h * dim, cos_r, sin_r, dim, q_out + (t * heads + h) * dim);
    for (int64_t h = 0; h < kv_heads; h++) {
        const int64_t slice = blk * kv_heads + h;
        rotate_bf16x16(row + (heads + h) * dim, cos_r, sin_r, dim, rotated);
        for (int64_t d = 0; d < dim; d += 16) {
            store_bf16x16(key + d, _mm512_loadu_ps(rotated + d), 0xFFFF);
            const __m512 value = load_bf16x16(row + (heads + kv_heads + h) * dim + d, 0xFFFF);
            store_bf16x16(v_cache + (slice * block + off) * dim + d, value, 0xFFFF);
        }
        for (int64_t d = 0; d < dim; d++) k_cache[(slice * dim + d) * block + off] = key[d];
    }
}
#endif

/* One token: q rotated into q_out, k rotated and v written to the caches. */
INLINE void rotary_write_kv_token(const void *qkv, const int64_t *positions, const float *cos_table,
                                  const float *sin_table, const int64_t *write_blocks, const int64_t *write_offsets,
                                  float *q_out, void *k_cache, void *v_cache, int64_t t, int64_t heads,
                                  int64_t kv_heads, int64_t dim, int64_t block, int model_bf16, int cache_dtype) {
    const int64_t width = (heads + 2 * kv_heads) * dim;
    float rotated[1024], value[1024], cos_r[1024], sin_r[1024];
    const float *cos_row = cos_table + positions[t] * dim, *sin_row = sin_table + positions[t] * dim;
    const int64_t row = t * width, blk = write_blocks[t], off = write_offsets[t];
    for (int64_t d = 0; d < dim; d++) {
        cos_r[d] = round_act(cos_row[d], model_bf16);
        sin_r[d] = round_act(sin_row[d], model_bf16);
    }
    for (int64_t h = 0; h < heads; h++) {
        rotate(qkv, row + h * dim, cos_r, sin_r, dim, model_bf16, q_out + (t * heads + h) * dim);
    }
    for (int64_t h = 0; h < kv_heads; h++) {
        rotate(qkv, row + (heads + h) * dim, cos_r, sin_r, dim, model_bf16, rotated);
        for (int64_t d = 0; d < dim; d++) value[d] = load_act(qkv, row + (heads + kv_heads + h) * dim + d, model_bf16);
        store_kv(k_cache, v_cache, rotated, value, blk, off, h, kv_heads, dim, block, cache_dtype);
    }
}

/* From the fused projection qkv [T, (H + 2 KVH) * D] (model dtype): q rotated -> q_out [T, H, D] fp32
   (exact copies of model-dtype values); k rotated and v written to the caches at (block, offset) of
   each token: k_cache [blocks, KVH, D, block] (transposed), v_cache [blocks, KVH, block, D], in the cache
   dtype (KV_F32, KV_BF16, or KV_Q8: kv_q8.h's layouts, quantized per token and KV head).
   Returns 0, or 1 without writing anything when a position, block or offset is out of range. */
int detinf_rotary_write_kv(const void *qkv, const int64_t *positions, const float *cos_table,
                           const float *sin_table, const int64_t *write_blocks, const int64_t *write_offsets,
                           float *q_out, void *k_cache, void *v_cache, int64_t tokens, int64_t heads,
                           int64_t kv_heads, int64_t dim, int64_t block, int64_t num_blocks, int64_t table_rows,
                           int model_bf16, int cache_dtype) {
    if (dim > 1024 || (cache_dtype == KV_Q8 && dim % Q8_GROUP != 0)) return 1;
    for (int64_t t = 0; t < tokens; t++) {
        if (positions[t] < 0 || positions[t] >= table_rows || write_blocks[t] < 0 || write_blocks[t] >= num_blocks ||
            write_offsets[t] < 0 || write_offsets[t] >= block)
            return 1;
    }
#pragma omp parallel for schedule(static) if (rowwise_parallel(tokens, (heads + 2 * kv_heads) * dim))
    for (int64_t t = 0; t < tokens; t++) {
#if defined(ROWWISE_BF16_512)
        if (model_bf16 && cache_dtype == KV_BF16 && dim % 32 == 0) {
            const int64_t at = positions[t] * dim;
            rotary_write_kv_token_bf16((const uint16_t *)qkv, cos_table + at, sin_table + at, q_out,
                                       (uint16_t *)k_cache, (uint16_t *)v_cache, t, write_blocks[t], write_offsets[t],
                                       heads, kv_heads, dim, block);
            continue;
        }
#endif
        if (model_bf16)
            rotary_write_kv_token(qkv, positions, cos_table, sin_table, write_blocks, write_offsets, q_out, k_cache,
                                  v_cache, t, heads, kv_heads, dim, block, 1, cache_dtype);
        else
            rotary_write_kv_token(qkv, positions, cos_table, sin_table, write_blocks, write_offsets, q_out, k_cache,
                                  v_cache, t, heads, kv_heads, dim, block, 0, cache_dtype);
    }
    return 0;
}
