/* The attention kernel's fast path (16-key cache blocks, head_dim a multiple of 16): a tile of query
   tokens of one sequence is computed against each loaded key and value block, so a block is read once
   per tile instead of once per token, and up to MAX_SHARED_ROWS rows (token x head of one KV head)
   share each loaded vector.

   Why the bits are those of one row computed alone: every row keeps its own accumulators and its own
   order (keys lane by lane, d ascending for a score; keys ascending for each value sum; see attention.c).
   A row joins a block's shared load only for its own keys: in the key pass for the blocks it sees (lanes
   past its last key are computed into its scratch and never read), in the value pass for exactly its
   keys of the block (rows whose last block ends earlier finish that block alone). So which rows share a
   tile, how many tokens a tile has and which thread runs it change no bit. Build flags: see attention.c. */

#include "attention.h"

/* Scores of n rows (literal 1..MAX_SHARED_ROWS) against one 16-key block, the rows' queries
   interleaved (qt[d * n + i] = q_i[d]) and their scores one after another (scores[i * 16 + l]): one base
   pointer each, so the n broadcasts and stores need no registers of their own. bf16 is a literal too,
   so the inner loop has no branch. */
INLINE void scores_n(int n, int bf16, const float *qt, const void *keys_t, int64_t offset, int64_t dim,
                     float scale, float *scores) {
    f32x16 lanes[MAX_SHARED_ROWS];
#pragma GCC unroll 12
    for (int i = 0; i < n; i++) lanes[i] = (f32x16){0};
    for (int64_t d = 0; d < dim; d++) {
        const f32x16 k = load16(keys_t, offset + d * 16, bf16);
#pragma GCC unroll 12
        for (int i = 0; i < n; i++) lanes[i] = fma16(qt[d * n + i], k, lanes[i]);
    }
#pragma GCC unroll 12
    for (int i = 0; i < n; i++) {
        const f32x16 scaled = lanes[i] * scale;
        memcpy(scores + i * 16, &scaled, sizeof scaled);
    }
}

/* Value sums of n rows (literal) over keys first..end-1 of one block: p[i * 16 + l] is row i's weight of
   key l, acc[i * dim + d] its sum. */
INLINE void values_n(int n, int bf16, const float *p, const void *v_cache, int64_t offset, int64_t first,
                     int64_t end, int64_t dim, float *acc) {
    for (int64_t d = 0; d < dim; d += 16) {
        f32x16 sums[MAX_SHARED_ROWS];
#pragma GCC unroll 12
        for (int i = 0; i < n; i++) memcpy(&sums[i], acc + i * dim + d, sizeof sums[i]);
        if (first == 0 && end == 16) { /* a whole block: the key loop unrolled, no exit branch to mispredict */
#pragma GCC unroll 16
            for (int64_t l = 0; l < 16; l++) {
                const f32x16 v = load16(v_cache, offset + l * dim + d, bf16);
#pragma GCC unroll 12
                for (int i = 0; i < n; i++) sums[i] = fma16(p[i * 16 + l], v, sums[i]);
            }
        } else {
            for (int64_t l = first; l < end; l++) {
                const f32x16 v = load16(v_cache, offset + l * dim + d, bf16);
#pragma GCC unroll 12
                for (int i = 0; i < n; i++) sums[i] = fma16(p[i * 16 + l], v, sums[i]);
            }
        }
#pragma GCC unroll 12
        for (int i = 0; i < n; i++) memcpy(acc + i * dim + d, &sums[i], sizeof sums[i]);
    }
}

#define SCORES_CASE(N)                                                       \
    case N:                                                                  \
        if (bf16) scores_n(N, 1, qt, keys_t, offset, dim, scale, scores);    \
        else scores_n(N, 0, qt, keys_t, offset, dim, scale, scores);         \
        break;
#define VALUES_CASE(N)                                                       \
    case N:                                                                  \
        if (bf16) values_n(N, 1, p, v_cache, offset, first, end, dim, acc);  \
        else values_n(N, 0, p, v_cache, offset, first, end, dim, acc);       \
        break;
#define CASES_1_TO_12(CASE) \
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)

__attribute__((visibility("hidden"))) void detinf_rows_scores16(int n, const float *qt, const void *keys_t,
                                                                int64_t offset, int64_t dim, int bf16, float scale,
                                                                float *scores) {
    switch (n) {
        CASES_1_TO_12(SCORES_CASE)
    default: break;
    }
}

__attribute__((visibility("hidden"))) void detinf_rows_values16(int n, const float *p, const void *v_cache,
                                                                int64_t offset, int64_t first, int64_t end,
                                                                int64_t dim, int bf16, float *acc) {
    switch (n) {
        CASES_1_TO_12(VALUES_CASE)
    default: break;
    }
}

/* Blocks are scattered through the cache pool, so the hardware prefetchers lose the stream at every
   block boundary, and decode attention (which reads the whole cache from memory at every step) waited
   on memory: 25 ms per 30 layers at 32 rows x 192 keys, against 10 ms with a warm cache. Asking for the
   block two ahead (keys, then values) into L2 brought it to 17 ms. Prefetches change no value. */
#define LOOKAHEAD_BLOCKS 2

/* Asks for the lines of one KV head's keys or values in one cache block into L2 (locality 2). GCC
   deletes a loop whose body is only __builtin_prefetch as an empty loop; the empty volatile asm that
   uses the address keeps it (it emits no instruction). */
static inline void prefetch_slice(const attention_args *a, int64_t block_id, int64_t kvh, int values) {
    const int64_t bytes = a->head_dim * 16 * (a->bf16 ? 2 : 4);
    const char *base = (const char *)(values ? a->v_cache : a->k_cache) + (block_id * a->kv_heads + kvh) * bytes;
    for (int64_t line = 0; line < bytes; line += 64) {
        __builtin_prefetch(base + line, 0, 2);
        __asm__ __volatile__("" : : "r"(base + line));
    }
}

/* The tile's rows (query token x head) are taken KV head by KV head, in (token, head) order, and cut
   into chunks of up to MAX_SHARED_ROWS rows that share each loaded key or value vector. Row k of the
   tile (k = kvh * tokens * group + token * group + g) is query token r0 + token, head kvh * group + g.
   A thread computes one KV head of a tile at a time; the head's rows are rows 0.. of its workspace
   (k' = k - kvh * tokens * group): acc + k' * dim, totals[k'], and the scores of its chunk, block by
   block: chunk rows k' = s..s+n-1 keep block b's 16 scores at scores + s * stride + (b * n + i) * 16. */
typedef struct {
    int64_t first, count; /* tile rows first..first+count-1, all of one KV head */
    int64_t scratch;      /* rows of the workspace: the KV head's rows are numbered from 0 */
} chunk;

/* Query row (token * heads + head, counted from the tile's first token) of tile row k. */
static inline int64_t query_row(const attention_args *a, int64_t tokens, int64_t k) {
    const int64_t group = a->heads / a->kv_heads, per_kvh = tokens * group;
    return (k % per_kvh) / group * a->heads + k / per_kvh * group + k % group;
}

/* The queries of one chunk interleaved (qt[d * n + i] = q_i[d]) at its rows' place in w->tile. */
static void chunk_queries(const attention_args *a, int64_t r0, int64_t tokens, chunk c, const workspace *w) {
    const int64_t dim = a->head_dim, n = c.count;
    float *qt = w->tile + c.scratch * dim;
    for (int64_t i = 0; i < n; i++) {
        const float *q = a->q + (r0 * a->heads + query_row(a, tokens, c.first + i)) * dim;
        for (int64_t d = 0; d < dim; d++) qt[d * n + i] = q[d];
    }
}

/* Key pass of one chunk over block b of the tile, whose keys of the chunk's KV head start at `offset`.
   Lanes past a row's last key are computed into its scratch and never read. */
static void chunk_scores(const attention_args *a, int64_t offset, int64_t b, chunk c, int64_t stride,
                         const workspace *w) {
    const int64_t dim = a->head_dim, n = c.count;
    float *scores = w->scores + c.scratch * stride + b * n * 16;
    detinf_rows_scores16((int)n, w->tile + c.scratch * dim, a->k_cache, offset, dim, a->bf16, a->scale, scores);
}

/* Value pass of one chunk over block b. A block every row of the tile sees whole (b * 16 + 16 <=
   min_keys) is shared; in the tile's last blocks each row adds exactly its own keys, alone. */
static void chunk_values(const attention_args *a, int64_t block_id, int64_t b, int64_t tokens, chunk c,
                         const int64_t *keys, int64_t min_keys, int64_t stride, const workspace *w) {
    const int64_t dim = a->head_dim, n = c.count, group = a->heads / a->kv_heads, per_kvh = tokens * group;
    const int64_t offset = (block_id * a->kv_heads + c.first / per_kvh) * 16 * dim;
    const float *p = w->scores + c.scratch * stride + b * n * 16;
    float *acc = w->acc + c.scratch * dim;
    if ((b + 1) * 16 <= min_keys) {
        detinf_rows_values16((int)n, p, a->v_cache, offset, 0, 16, dim, a->bf16, acc);
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        const int64_t left = keys[(c.first + i) % per_kvh / group] - b * 16;
        if (left > 0)
            detinf_rows_values16(1, p + i * 16, a->v_cache, offset, 0, left < 16 ? left : 16, dim, a->bf16,
                                 acc + i * dim);
    }
}

/* Chunk number `index` of the tile: KV head by KV head, MAX_SHARED_ROWS rows at a time. */
static inline chunk nth_chunk(int64_t per_kvh, int64_t index) {
    const int64_t per_head = (per_kvh + MAX_SHARED_ROWS - 1) / MAX_SHARED_ROWS, within = index % per_head;
    const int64_t first = within * MAX_SHARED_ROWS;
    const chunk c = {index / per_head * per_kvh + first,
                     per_kvh - first < MAX_SHARED_ROWS ? per_kvh - first : MAX_SHARED_ROWS, first};
    return c;
}

/* KV head kvh of the tile (its query heads for every token): two passes over the tile's blocks, scores
   of every row (chunk by chunk, each over all blocks), each row's softmax weights and their sum, then the
   value sums block by block; out = acc / sum. The KV heads of a tile are independent work items. */
__attribute__((visibility("hidden"))) void detinf_attend_tile16(const attention_args *a, int64_t r0, int64_t tokens,
                                                                int64_t kvh, const workspace *w) {
    const int64_t heads = a->heads, dim = a->head_dim, group = heads / a->kv_heads, per_kvh = tokens * group;
    const int64_t per_head = (per_kvh + MAX_SHARED_ROWS - 1) / MAX_SHARED_ROWS; /* chunks of one KV head */
    const int64_t *table = a->block_ids + a->row_table[r0];
    int64_t keys[MAX_TILE_TOKENS], num_blocks = 0, min_keys = a->row_keys[r0];
    for (int64_t i = 0; i < tokens; i++) {
        keys[i] = a->row_keys[r0 + i];
        num_blocks = (keys[i] + 15) / 16 > num_blocks ? (keys[i] + 15) / 16 : num_blocks;
        min_keys = keys[i] < min_keys ? keys[i] : min_keys;
    }
    const int64_t stride = num_blocks * 16, first_chunk = kvh * per_head, end_chunk = first_chunk + per_head;
    for (int64_t index = first_chunk; index < end_chunk; index++)
        chunk_queries(a, r0, tokens, nth_chunk(per_kvh, index), w);
    for (int64_t b = 0; b < num_blocks; b++) { /* every chunk while the block is in L1 */
        const int64_t ahead = b + LOOKAHEAD_BLOCKS; /* near the end: the first value blocks */
        if (ahead < num_blocks) prefetch_slice(a, table[ahead], kvh, 0);
        else if (ahead - num_blocks < num_blocks) prefetch_slice(a, table[ahead - num_blocks], kvh, 1);
        const int64_t offset = (table[b] * a->kv_heads + kvh) * dim * 16;
        for (int64_t index = first_chunk; index < end_chunk; index++)
            chunk_scores(a, offset, b, nth_chunk(per_kvh, index), stride, w);
    }
    for (int64_t index = first_chunk; index < end_chunk; index++) {
        const chunk c = nth_chunk(per_kvh, index);
        for (int64_t i = 0; i < c.count; i++) {
            const int64_t token = (c.first + i) % per_kvh / group;
            w->totals[c.scratch + i] = exp_and_sum(w->scores + c.scratch * stride + i * 16, keys[token], c.count * 16);
        }
    }
    memset(w->acc, 0, sizeof(float) * (size_t)(per_kvh * dim));
    for (int64_t b = 0; b < num_blocks; b++) {
        if (b + LOOKAHEAD_BLOCKS < num_blocks) prefetch_slice(a, table[b + LOOKAHEAD_BLOCKS], kvh, 1);
        for (int64_t index = first_chunk; index < end_chunk; index++)
            chunk_values(a, table[b], b, tokens, nth_chunk(per_kvh, index), keys, min_keys, stride, w);
    }
    for (int64_t k = 0; k < per_kvh; k++) {
        float *dst = a->out + (r0 * heads + query_row(a, tokens, kvh * per_kvh + k)) * dim;
        for (int64_t d = 0; d < dim; d++) dst[d] = w->acc[k * dim + d] / w->totals[k];
    }
}
