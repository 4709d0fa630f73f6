/* Row-at-a-time causal attention over a paged KV cache, for deterministic-inference.

   Every output row (one query token x one query head) is computed by the same sequence of IEEE
   float operations, fixed by this source alone:
     scores[j] = dot(q, k_j) * scale          dot: fused multiply-adds (fmaf) over d ascending, from 0
     m         = max_j scores[j]               exact
     p[j]      = exp(max(scores[j] - m, -87))  exp below: range reduction + degree-7 polynomial
     l         = sum_j p[j]                    16 lane partial sums over j, then a fixed tree
     acc[d]    = sum_j p[j] * v_j[d]           fused multiply-adds over j ascending, each d on its own
     out[d]    = acc[d] / l
   where j runs over the row's own keys 0..n-1 and nothing else. No row reads another row's data, so
   a row's bits cannot depend on the batch, the chunk it is in, the number of rows per call or the
   thread that computes it.

   Build flags must keep that promise: no -ffast-math (no reassociation) and -ffp-contract=off (the
   compiler fuses nothing on its own). Fused multiply-adds appear only where the source asks for one
   (fmaf: IEEE fma, one rounding, the same in an FMA instruction, a vector lane or libm's software
   fmaf on a CPU without FMA). So a vectorised loop body and its scalar tail round identically, and
   the ISA flags change speed, not bits. */

#include "common.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* exp(x) for x in [-87, 0] (the softmax numerators). */
static inline float exp_nonpositive(float x) { return exp_in_range(x); }

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
   block: each key is a lane, so every key's sum is the same sequence of fused multiply-adds, vectorised
   or not. The 16-key version is the same arithmetic with the lanes held in registers. */
static inline void block_scores(const float *q, const float *keys_t, int64_t dim, int64_t block,
                                float scale, float *scores) {
    for (int64_t l = 0; l < block; l++) scores[l] = 0.0f;
    for (int64_t d = 0; d < dim; d++) {
        const float qd = q[d];
        const float *k = keys_t + d * block;
        for (int64_t l = 0; l < block; l++) scores[l] = fmaf(qd, k[l], scores[l]);
    }
    for (int64_t l = 0; l < block; l++) scores[l] = scores[l] * scale;
}

/* Sixteen floats as one value (GCC/Clang vector extension): each operation is the same IEEE operation
   applied lane by lane, so results are those of the scalar code above, whatever the target ISA. */
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

/* a * b + c per lane with one rounding (one vfmadd on AVX-512, fmaf calls elsewhere: same bits). */
static inline __attribute__((always_inline)) f32x16 fma16(float a, f32x16 b, f32x16 c) {
    f32x16 broadcast, result;
    for (int l = 0; l < 16; l++) broadcast[l] = a;
    for (int l = 0; l < 16; l++) result[l] = fmaf(broadcast[l], b[l], c[l]);
    return result;
}

static inline f32x16 load16(const void *base, int64_t index, int bf16) {
    f32x16 value;
    if (bf16) {
#if defined(__AVX512F__)
        const __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index));
        const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16);
        memcpy(&value, &bits, sizeof value);
#else
        u16x16 half;
        memcpy(&half, (const uint16_t *)base + index, sizeof half);
        u32x16 bits = __builtin_convertvector(half, u32x16) << 16;
        memcpy(&value, &bits, sizeof value);
#endif
    } else {
        memcpy(&value, (const float *)base + index, sizeof value);
    }
    return value;
}

/* block_scores for 16-key blocks straight from the cache, for n (1..4) query rows at once: the rows
   share each loaded key vector but keep their own lanes, so each row's arithmetic is unchanged. Called
   with a literal n, so the row loops unroll and the lanes stay in registers. */
INLINE void block_scores16(int n, const float *const *q, const void *keys_t, int64_t offset, int64_t dim,
                           int bf16, float scale, float *const *scores) {
    f32x16 lanes0 = {0}, lanes1 = {0}, lanes2 = {0}, lanes3 = {0}; /* rows 0..n-1; n is a literal */
    for (int64_t d = 0; d < dim; d++) {
        const f32x16 k = load16(keys_t, offset + d * 16, bf16);
        lanes0 = fma16(q[0][d], k, lanes0);
        if (n > 1) lanes1 = fma16(q[1][d], k, lanes1);
        if (n > 2) lanes2 = fma16(q[2][d], k, lanes2);
        if (n > 3) lanes3 = fma16(q[3][d], k, lanes3);
    }
    const f32x16 lanes[4] = {lanes0 * scale, lanes1 * scale, lanes2 * scale, lanes3 * scale};
    for (int i = 0; i < n; i++) memcpy(scores[i], &lanes[i], sizeof lanes[i]);
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
    int64_t end_row; /* rows [first_row, end_row) are computed: their block tables were checked */
} attention_args;

/* Workspace of one thread: scores [H][keys rounded up to block], one key block, H accumulators, H sums. */
typedef struct {
    float *scores;
    float *tile;
    float *acc;
    float *totals;
} workspace;

/* acc[i][d] += sum over the block's keys l < count, ascending, of p[i][l] * v_l[d] for n (1..4) rows
   sharing the value loads: fused multiply-adds, each d on its own, so vector lanes and scalar code round
   alike. Called block after block on zeroed acc, it gives the sums over all keys in ascending order. */
INLINE void block_values16(int n, const void *v_cache, int64_t offset, int64_t count, int64_t dim, int bf16,
                           const float *const *p, float *const *acc) {
    for (int64_t d = 0; d < dim; d += 16) {
        f32x16 sums0, sums1 = {0}, sums2 = {0}, sums3 = {0}; /* rows 0..n-1; n is a literal */
        memcpy(&sums0, acc[0] + d, sizeof sums0);
        if (n > 1) memcpy(&sums1, acc[1] + d, sizeof sums1);
        if (n > 2) memcpy(&sums2, acc[2] + d, sizeof sums2);
        if (n > 3) memcpy(&sums3, acc[3] + d, sizeof sums3);
        for (int64_t l = 0; l < count; l++) {
            const f32x16 v = load16(v_cache, offset + l * dim + d, bf16);
            sums0 = fma16(p[0][l], v, sums0);
            if (n > 1) sums1 = fma16(p[1][l], v, sums1);
            if (n > 2) sums2 = fma16(p[2][l], v, sums2);
            if (n > 3) sums3 = fma16(p[3][l], v, sums3);
        }
        const f32x16 sums[4] = {sums0, sums1, sums2, sums3};
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
        for (int64_t d = 0; d < dim; d++) acc[d] = fmaf(p[j], tile[d], acc[d]);
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
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t offset = (table[b] * a->kv_heads + kvh) * dim * block;
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
    for (int64_t i = 0; i < n; i++) memset(rows_acc[i], 0, sizeof(float) * (size_t)dim);
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t offset = (table[b] * a->kv_heads + kvh) * block * dim;
        const int64_t count = keys - b * block < block ? keys - b * block : block;
        const float *block_p[4];
        for (int64_t i = 0; i < n; i++) block_p[i] = rows_p[i] + b * block;
        switch (n) {
        case 4: block_values16(4, a->v_cache, offset, count, dim, a->bf16, block_p, rows_acc); break;
        case 3: block_values16(3, a->v_cache, offset, count, dim, a->bf16, block_p, rows_acc); break;
        case 2: block_values16(2, a->v_cache, offset, count, dim, a->bf16, block_p, rows_acc); break;
        default: block_values16(1, a->v_cache, offset, count, dim, a->bf16, block_p, rows_acc); break;
        }
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

/* Rows n (literal 1..4) of the query heads starting at head h0 (all of one KV head), over one block. */
static void block_rows(const attention_args *a, int64_t r, int64_t h0, int64_t n, int64_t block_id, int64_t first_key,
                       int64_t count, int64_t stride, const workspace *w, int values) {
    const int64_t dim = a->head_dim, kvh = h0 / (a->heads / a->kv_heads);
    const float *rows_q[4];
    float *rows_scores[4], *rows_acc[4];
    for (int64_t i = 0; i < n; i++) {
        rows_q[i] = a->q + (r * a->heads + h0 + i) * dim;
        rows_scores[i] = w->scores + (h0 + i) * stride + first_key;
        rows_acc[i] = w->acc + (h0 + i) * dim;
    }
    const int64_t offset = (block_id * a->kv_heads + kvh) * dim * 16;
    const float *const *rows_p = (const float *const *)rows_scores;
    switch (values * 4 + n) {
    case 1: block_scores16(1, rows_q, a->k_cache, offset, dim, a->bf16, a->scale, rows_scores); break;
    case 2: block_scores16(2, rows_q, a->k_cache, offset, dim, a->bf16, a->scale, rows_scores); break;
    case 3: block_scores16(3, rows_q, a->k_cache, offset, dim, a->bf16, a->scale, rows_scores); break;
    case 4: block_scores16(4, rows_q, a->k_cache, offset, dim, a->bf16, a->scale, rows_scores); break;
    case 5: block_values16(1, a->v_cache, offset, count, dim, a->bf16, rows_p, rows_acc); break;
    case 6: block_values16(2, a->v_cache, offset, count, dim, a->bf16, rows_p, rows_acc); break;
    case 7: block_values16(3, a->v_cache, offset, count, dim, a->bf16, rows_p, rows_acc); break;
    default: block_values16(4, a->v_cache, offset, count, dim, a->bf16, rows_p, rows_acc); break;
    }
}

/* Blocks are scattered through the cache pool, so the hardware prefetchers lose the stream at every
   block boundary, and decode attention (which reads the whole cache from memory at every step) waited
   on memory: 25 ms per 30 layers at 32 rows x 192 keys, against 10 ms with a warm cache. Asking for the
   block two ahead (keys, then values, then the next row's keys) into L2 brought it to 17 ms. Prefetches
   change no value. */
#define LOOKAHEAD_BLOCKS 2

/* Asks for the lines of one cache block (every KV head: keys or values) into L2 (locality 2). GCC
   deletes a loop whose body is only __builtin_prefetch as an empty loop; the empty volatile asm that
   uses the address keeps it (it emits no instruction). */
static inline void prefetch_block(const attention_args *a, int64_t block_id, int values) {
    const int64_t bytes = a->kv_heads * a->head_dim * 16 * (a->bf16 ? 2 : 4);
    const char *base = (const char *)(values ? a->v_cache : a->k_cache) + block_id * bytes;
    for (int64_t line = 0; line < bytes; line += 64) {
        __builtin_prefetch(base + line, 0, 2);
        __asm__ __volatile__("" : : "r"(base + line));
    }
}

/* During block b of a pass: the block LOOKAHEAD_BLOCKS further on; near the end of the key pass, the
   first value blocks; near the end of the value pass, the first key blocks of row r + 1. */
static inline void prefetch_ahead(const attention_args *a, int64_t r, const int64_t *table, int64_t num_blocks,
                                  int64_t b, int values) {
    const int64_t ahead = b + LOOKAHEAD_BLOCKS;
    if (ahead < num_blocks) {
        prefetch_block(a, table[ahead], values);
    } else if (!values) {
        if (ahead - num_blocks < num_blocks) prefetch_block(a, table[ahead - num_blocks], 1);
    } else if (r + 1 < a->end_row && ahead - num_blocks < (a->row_keys[r + 1] + 15) / 16) {
        prefetch_block(a, a->block_ids[a->row_table[r + 1] + ahead - num_blocks], 0);
    }
}

/* Every head of row r with 16-key blocks and head_dim a multiple of 16: the same arithmetic as attend(),
   but block by block over all KV heads, so each block's keys (then values) are read as one contiguous
   run of memory instead of one slice per KV head. */
static void attend_row16(const attention_args *a, int64_t r, const workspace *w) {
    const int64_t heads = a->heads, group = heads / a->kv_heads, dim = a->head_dim, keys = a->row_keys[r];
    const int64_t *table = a->block_ids + a->row_table[r];
    const int64_t num_blocks = (keys + 15) / 16, stride = num_blocks * 16;
    for (int values = 0; values < 2; values++) {
        if (values) {
            for (int64_t h = 0; h < heads; h++) w->totals[h] = exp_and_sum(w->scores + h * stride, keys);
            memset(w->acc, 0, sizeof(float) * (size_t)(heads * dim));
        }
        for (int64_t b = 0; b < num_blocks; b++) {
            const int64_t count = keys - b * 16 < 16 ? keys - b * 16 : 16;
            prefetch_ahead(a, r, table, num_blocks, b, values);
            for (int64_t h0 = 0; h0 < heads; h0 += group) {
                for (int64_t first = 0; first < group; first += 4) {
                    const int64_t n = group - first < 4 ? group - first : 4;
                    block_rows(a, r, h0 + first, n, table[b], b * 16, count, stride, w, values);
                }
            }
        }
    }
    for (int64_t h = 0; h < heads; h++) {
        float *dst = a->out + (r * heads + h) * dim;
        for (int64_t d = 0; d < dim; d++) dst[d] = w->acc[h * dim + d] / w->totals[h];
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

/* Computes rows [first_row, end_row), every head. Returns 0; 1 when a workspace could not be allocated
   (some rows are then not written); 2 when an index is out of range (nothing is written). */
int detinf_attention(const float *q, const void *k_cache, const void *v_cache, int cache_is_bf16,
                     const int64_t *block_ids, int64_t num_ids, const int64_t *row_table,
                     const int64_t *row_keys, int64_t first_row, int64_t end_row, int64_t heads,
                     int64_t kv_heads, int64_t head_dim, int64_t block, int64_t num_blocks, float scale,
                     float *out) {
    if (rows_out_of_range(block_ids, num_ids, row_table, row_keys, first_row, end_row, block, num_blocks))
        return 2;
    const attention_args a = {q,     k_cache,  v_cache,  cache_is_bf16, block_ids, row_table, row_keys,
                              heads, kv_heads, head_dim, block,         scale,     out, end_row};
    int64_t max_keys = 1;
    for (int64_t r = first_row; r < end_row; r++) max_keys = a.row_keys[r] > max_keys ? a.row_keys[r] : max_keys;
    const size_t stride = (size_t)((max_keys + block - 1) / block * block);
    const int fast = block == 16 && head_dim % 16 == 0;
    int status = 0;
    /* Rows are shared out between torch's OpenMP threads (the process's one libgomp, so no second
       thread pool); each row is computed whole by one thread, so the split never changes a bit. */
#pragma omp parallel reduction(| : status)
    {
        workspace w = {malloc(sizeof(float) * (size_t)heads * stride), malloc(sizeof(float) * (size_t)(head_dim * block)),
                       malloc(sizeof(float) * (size_t)(heads * head_dim)), malloc(sizeof(float) * (size_t)heads)};
        const int ready = w.scores != NULL && w.tile != NULL && w.acc != NULL && w.totals != NULL;
#pragma omp for schedule(dynamic, 4)
        for (int64_t r = first_row; r < end_row; r++) {
            if (!ready) {
                status |= 1;
            } else if (fast) {
                attend_row16(&a, r, &w);
            } else {
                for (int64_t kvh = 0; kvh < kv_heads; kvh++) attend(&a, r, kvh, &w);
            }
        }
        free(w.scores);
        free(w.tile);
        free(w.acc);
        free(w.totals);
    }
    return status;
}

/* The kernel's exp, exposed so tests can compare it with a float64 reference. */
float detinf_exp_nonpositive(float x) { return exp_nonpositive(x); }
