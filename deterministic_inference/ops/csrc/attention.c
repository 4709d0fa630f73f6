/* Row-at-a-time causal attention over a paged KV cache, for deterministic-inference.

   Every output row (one query token x one query head) is computed by the same sequence of IEEE
   float operations, fixed by this source alone:
     scores[j] = dot(q, k_j) * scale          dot: 16 lane partial sums over head_dim, then a fixed tree
     m         = max_j scores[j]               exact
     p[j]      = exp(max(scores[j] - m, -87))  exp below: range reduction + degree-7 polynomial
     l         = sum_j p[j]                    16 lane partial sums over j, then the same fixed tree
     acc[d]    = sum_j p[j] * v_j[d]           ascending j, each d on its own
     out[d]    = acc[d] / l
   where j runs over the row's own keys 0..n-1 and nothing else. No row reads another row's data, so
   a row's bits cannot depend on the batch, the chunk it is in, the number of rows per call or the
   thread that computes it.

   Build flags must keep that promise: no -ffast-math (no reassociation) and -ffp-contract=off (no
   fused multiply-add, which would round differently from mul + add). With those, a vectorised loop
   body and its scalar tail round identically, so the ISA flags change speed, not bits. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

static inline float lane_tree(float *lanes) {
    for (int width = LANES / 2; width >= 1; width /= 2) {
        for (int l = 0; l < width; l++) lanes[l] = lanes[l] + lanes[l + width];
    }
    return lanes[0];
}

static inline float lane_sum(const float *x, int64_t n) {
    float lanes[LANES] = {0};
    int64_t base = 0;
    for (; base + LANES <= n; base += LANES) {
        for (int l = 0; l < LANES; l++) lanes[l] = lanes[l] + x[base + l];
    }
    for (int l = 0; base + l < n; l++) lanes[l] = lanes[l] + x[base + l];
    return lane_tree(lanes);
}

/* exp(x) for x in [-87, 0]: x = n ln2 + r, |r| <= ln2/2, exp(r) by Horner, times 2^n from the bits.
   Relative error about 1e-7. */
static inline float exp_nonpositive(float x) {
    const float log2e = 1.44269504088896341f;
    const float round_magic = 12582912.0f; /* 1.5 * 2^23: adding and subtracting rounds to an integer */
    const float ln2_hi = 0.693145751953125f;
    const float ln2_lo = 1.428606765330187045e-06f;
    float n = (x * log2e + round_magic) - round_magic;
    float r = (x - n * ln2_hi) - n * ln2_lo;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline void load_bf16(const uint16_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits = (uint32_t)src[i] << 16;
        memcpy(&dst[i], &bits, sizeof bits);
    }
}

static inline void load_row(const void *base, int64_t offset, float *dst, int64_t n, int bf16) {
    if (bf16) load_bf16((const uint16_t *)base + offset, dst, n);
    else memcpy(dst, (const float *)base + offset, (size_t)n * sizeof(float));
}

/* scores[l] = (sum over d ascending of q[d] * keys_t[d][l]) * scale for the `block` keys of one cache
   block: each key is a lane, so every key's sum is the same sequence of mul + add, vectorised or not.
   The 16-key version is the same arithmetic with the lanes held in registers. */
static inline void block_scores(const float *q, const float *keys_t, int64_t dim, int64_t block,
                                float scale, float *scores) {
    for (int64_t l = 0; l < block; l++) scores[l] = 0.0f;
    for (int64_t d = 0; d < dim; d++) {
        const float qd = q[d];
        const float *k = keys_t + d * block;
        for (int64_t l = 0; l < block; l++) scores[l] = scores[l] + qd * k[l];
    }
    for (int64_t l = 0; l < block; l++) scores[l] = scores[l] * scale;
}

/* Sixteen floats as one value (GCC/Clang vector extension): each operation is the same IEEE operation
   applied lane by lane, so results are those of the scalar code above, whatever the target ISA. */
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

static inline f32x16 load16(const void *base, int64_t index, int bf16) {
    f32x16 value;
    if (bf16) {
        u16x16 half;
        memcpy(&half, (const uint16_t *)base + index, sizeof half);
        u32x16 bits = __builtin_convertvector(half, u32x16) << 16;
        memcpy(&value, &bits, sizeof value);
    } else {
        memcpy(&value, (const float *)base + index, sizeof value);
    }
    return value;
}

#define INLINE static inline __attribute__((always_inline))

/* block_scores for 16-key blocks straight from the cache, for n (1..4) query rows at once: the rows
   share each loaded key vector but keep their own lanes, so each row's arithmetic is unchanged. Called
   with a literal n, so the row loops unroll and the lanes stay in registers. */
INLINE void block_scores16(int n, const float *const *q, const void *keys_t, int64_t offset, int64_t dim,
                           int bf16, float scale, float *const *scores) {
    f32x16 lanes[4] = {{0}};
    for (int64_t d = 0; d < dim; d++) {
        const f32x16 k = load16(keys_t, offset + d * 16, bf16);
        for (int i = 0; i < n; i++) lanes[i] = lanes[i] + q[i][d] * k;
    }
    for (int i = 0; i < n; i++) {
        const f32x16 scaled = lanes[i] * scale;
        memcpy(scores[i], &scaled, sizeof scaled);
    }
}

/* In place: scores[0..keys) -> exp(score - max), clamped below at -87. Returns their sum. */
static inline float exp_and_sum(float *scores, int64_t keys) {
    float m = scores[0];
    for (int64_t j = 1; j < keys; j++) m = scores[j] > m ? scores[j] : m;
    for (int64_t j = 0; j < keys; j++) {
        const float shifted = scores[j] - m;
        scores[j] = exp_nonpositive(shifted < -87.0f ? -87.0f : shifted);
    }
    return lane_sum(scores, keys);
}

/* The caches of one layer hold blocks of `block` slots (slot = block_id * block + offset):
     keys   [num_blocks, KVH, D, block]   a head's keys transposed inside a block (key index fastest)
     values [num_blocks, KVH, block, D]
   Row r is query token r (row r of q and out); it sees keys 0..row_keys[r]-1 of the sequence whose
   block table starts at block_ids[row_table[r]]. q, out: [T, H, D] fp32. */
typedef struct {
    const float *q;
    const void *k_cache;
    const void *v_cache;
    int bf16;
    const int64_t *block_ids;
    const int64_t *row_table;
    const int64_t *row_keys;
    int64_t heads, kv_heads, head_dim, block;
    float scale;
    float *out;
} attention_args;

/* Workspace of one thread: scores [G][keys rounded up to block], one key block, G accumulators, G sums. */
typedef struct {
    float *scores;
    float *tile;
    float *acc;
    float *totals;
} workspace;

/* acc[i][d] = sum over keys j ascending of p[i][j] * v_j[d] for n (1..4) rows sharing the value loads;
   each d on its own, accumulated from 0 in ascending j, so vector lanes and scalar code round alike. */
INLINE void values16(int n, const attention_args *a, const int64_t *table, int64_t kvh, int64_t keys,
                     const float *const *p, float *const *acc) {
    const int64_t dim = a->head_dim, block = a->block;
    for (int64_t d = 0; d < dim; d += 16) {
        f32x16 sums[4] = {{0}};
        for (int64_t j = 0; j < keys; j++) {
            const int64_t offset = ((table[j / block] * a->kv_heads + kvh) * block + j % block) * dim;
            const f32x16 v = load16(a->v_cache, offset + d, a->bf16);
            for (int i = 0; i < n; i++) sums[i] = sums[i] + p[i][j] * v;
        }
        for (int i = 0; i < n; i++) memcpy(acc[i] + d, &sums[i], sizeof sums[i]);
    }
}

/* The same sums for any head_dim, one row at a time. */
static void values_any(const attention_args *a, const int64_t *table, int64_t kvh, int64_t keys,
                       const float *p, float *acc, float *tile) {
    const int64_t dim = a->head_dim, block = a->block;
    memset(acc, 0, sizeof(float) * (size_t)dim);
    for (int64_t j = 0; j < keys; j++) {
        load_row(a->v_cache, ((table[j / block] * a->kv_heads + kvh) * block + j % block) * dim, tile, dim,
                 a->bf16);
        for (int64_t d = 0; d < dim; d++) acc[d] = acc[d] + p[j] * tile[d];
    }
}

/* Scores and value sums of rows first..first+n-1 of the group (n literal 1..4 where the kernels allow). */
static void attend_rows(const attention_args *a, const int64_t *table, int64_t kvh, int64_t keys, int64_t stride,
                        const float *q, int64_t first, int64_t n, const workspace *w) {
    const int64_t dim = a->head_dim, block = a->block, num_blocks = (keys + block - 1) / block;
    const float *rows_q[4];
    float *rows_scores[4], *rows_acc[4];
    for (int64_t i = 0; i < n; i++) {
        rows_q[i] = q + (first + i) * dim;
        rows_acc[i] = w->acc + (first + i) * dim;
    }
    const int64_t element = a->bf16 ? 2 : 4;
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t offset = (table[b] * a->kv_heads + kvh) * dim * block;
        if (b + 1 < num_blocks) { /* the next key block, while this one is computed (speed only) */
            const char *next = (const char *)a->k_cache + (table[b + 1] * a->kv_heads + kvh) * dim * block * element;
            for (int64_t byte = 0; byte < dim * block * element; byte += 64) __builtin_prefetch(next + byte);
        }
        for (int64_t i = 0; i < n; i++) rows_scores[i] = w->scores + (first + i) * stride + b * block;
        if (block == 16) {
            switch (n) {
            case 4: block_scores16(4, rows_q, a->k_cache, offset, dim, a->bf16, a->scale, rows_scores); break;
            case 3: block_scores16(3, rows_q, a->k_cache, offset, dim, a->bf16, a->scale, rows_scores); break;
            case 2: block_scores16(2, rows_q, a->k_cache, offset, dim, a->bf16, a->scale, rows_scores); break;
            default: block_scores16(1, rows_q, a->k_cache, offset, dim, a->bf16, a->scale, rows_scores); break;
            }
        } else {
            load_row(a->k_cache, offset, w->tile, dim * block, a->bf16);
            for (int64_t i = 0; i < n; i++) block_scores(rows_q[i], w->tile, dim, block, a->scale, rows_scores[i]);
        }
    }
    const float *rows_p[4];
    for (int64_t i = 0; i < n; i++) {
        float *row = w->scores + (first + i) * stride;
        w->totals[first + i] = exp_and_sum(row, keys);
        rows_p[i] = row;
    }
    if (dim % 16 != 0) {
        for (int64_t i = 0; i < n; i++) values_any(a, table, kvh, keys, rows_p[i], rows_acc[i], w->tile);
        return;
    }
    switch (n) {
    case 4: values16(4, a, table, kvh, keys, rows_p, rows_acc); break;
    case 3: values16(3, a, table, kvh, keys, rows_p, rows_acc); break;
    case 2: values16(2, a, table, kvh, keys, rows_p, rows_acc); break;
    default: values16(1, a, table, kvh, keys, rows_p, rows_acc); break;
    }
}

/* All query heads of KV head kvh for row r: G output rows of D values, in groups of up to 4 rows. */
static void attend(const attention_args *a, int64_t r, int64_t kvh, const workspace *w) {
    const int64_t heads = a->heads, kv_heads = a->kv_heads, dim = a->head_dim, block = a->block;
    const int64_t group = heads / kv_heads, keys = a->row_keys[r];
    const int64_t *table = a->block_ids + a->row_table[r];
    const int64_t stride = (keys + block - 1) / block * block;
    const float *q = a->q + (r * heads + kvh * group) * dim; /* the group's heads are consecutive */
    for (int64_t first = 0; first < group; first += 4) {
        attend_rows(a, table, kvh, keys, stride, q, first, group - first < 4 ? group - first : 4, w);
    }
    for (int64_t g = 0; g < group; g++) {
        float *dst = a->out + (r * heads + kvh * group + g) * dim;
        for (int64_t d = 0; d < dim; d++) dst[d] = w->acc[g * dim + d] / w->totals[g];
    }
}

/* Computes rows [first_row, end_row), every head. */
/* Ask for the next row's keys and values while this row is computed (speed only: no value changes).
   A block of one layer's cache holds every KV head, [KVH, D, block] keys then [KVH, block, D] values. */
static void prefetch_row(const attention_args *a, int64_t r) {
    const int64_t block_bytes = a->kv_heads * a->head_dim * a->block * (a->bf16 ? 2 : 4);
    const int64_t *table = a->block_ids + a->row_table[r];
    for (int64_t b = 0; b < (a->row_keys[r] + a->block - 1) / a->block; b++) {
        const char *keys = (const char *)a->k_cache + table[b] * block_bytes;
        const char *values = (const char *)a->v_cache + table[b] * block_bytes;
        for (int64_t byte = 0; byte < block_bytes; byte += 64) {
            __builtin_prefetch(keys + byte);
            __builtin_prefetch(values + byte);
        }
    }
}

/* 1 when a row sees no key, or its block table runs past block_ids or names a block outside the cache. */
static int rows_out_of_range(const int64_t *block_ids, int64_t num_ids, const int64_t *row_table,
                             const int64_t *row_keys, int64_t first_row, int64_t end_row, int64_t block,
                             int64_t num_blocks) {
    for (int64_t r = first_row; r < end_row; r++) {
        const int64_t needed = (row_keys[r] + block - 1) / block;
        if (row_keys[r] < 1 || row_table[r] < 0 || row_table[r] + needed > num_ids) return 1;
        for (int64_t b = 0; b < needed; b++) {
            const int64_t id = block_ids[row_table[r] + b];
            if (id < 0 || id >= num_blocks) return 1;
        }
    }
    return 0;
}

/* Returns 0; 1 when the workspace could not be allocated; 2 when an index is out of range (nothing is
   written in either case). */
int detinf_attention(const float *q, const void *k_cache, const void *v_cache, int cache_is_bf16,
                     const int64_t *block_ids, int64_t num_ids, const int64_t *row_table,
                     const int64_t *row_keys, int64_t first_row, int64_t end_row, int64_t heads,
                     int64_t kv_heads, int64_t head_dim, int64_t block, int64_t num_blocks, float scale,
                     float *out) {
    if (rows_out_of_range(block_ids, num_ids, row_table, row_keys, first_row, end_row, block, num_blocks))
        return 2;
    const attention_args a = {q,     k_cache,  v_cache,  cache_is_bf16, block_ids, row_table, row_keys,
                              heads, kv_heads, head_dim, block,         scale,     out};
    const int64_t group = heads / kv_heads;
    int64_t max_keys = 1;
    for (int64_t r = first_row; r < end_row; r++) max_keys = a.row_keys[r] > max_keys ? a.row_keys[r] : max_keys;
    const size_t stride = (size_t)((max_keys + block - 1) / block * block);
    workspace w = {malloc(sizeof(float) * (size_t)group * stride), malloc(sizeof(float) * (size_t)(head_dim * block)),
                   malloc(sizeof(float) * (size_t)(group * head_dim)), malloc(sizeof(float) * (size_t)group)};
    int status = 1;
    if (w.scores != NULL && w.tile != NULL && w.acc != NULL && w.totals != NULL) {
        for (int64_t r = first_row; r < end_row; r++) {
            if (r + 1 < end_row) prefetch_row(&a, r + 1);
            for (int64_t kvh = 0; kvh < kv_heads; kvh++) attend(&a, r, kvh, &w);
        }
        status = 0;
    }
    free(w.scores);
    free(w.tile);
    free(w.acc);
    free(w.totals);
    return status;
}

/* The kernel's exp, exposed so tests can compare it with a float64 reference. */
float detinf_exp_nonpositive(float x) { return exp_nonpositive(x); }
