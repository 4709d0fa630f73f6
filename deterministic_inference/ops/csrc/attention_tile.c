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

/* The regroupings below that only pay with 32 vector registers (the prefill key pass in halves against
   two blocks, the value pass in halves of two slices) are compiled for AVX-512 builds only. They change
   no bit, and without AVX-512 the extra variants doubled the compile time of this file (x86-64: 253 ->
   513 s, 1.5 -> 2.9 GB of compiler memory) for no speed. */
#if defined(__AVX512F__)
#define REGROUP 1
#else
#define REGROUP 0
#endif

/* Scores of n rows (literal 1..MAX_SHARED_ROWS) against one 16-key block, the rows' queries
   interleaved (qt[d * n + i] = q_i[d]) and their scores one after another (scores[i * 16 + l]): one base
   pointer each, so the n broadcasts and stores need no registers of their own. The cache format fmt is a
   literal too, so the inner loop has no branch. */
INLINE void scores_n(int n, int fmt, const float *qt, const void *keys_t, int64_t offset, int64_t dim,
                     float scale, float *scores) {
    f32x16 lanes[MAX_SHARED_ROWS];
#pragma GCC unroll 12
    for (int i = 0; i < n; i++) lanes[i] = (f32x16){0};
    for (int64_t d = 0; d < dim; d++) {
        const f32x16 k = key16(fmt, keys_t, offset, d, dim);
#pragma GCC unroll 12
        for (int i = 0; i < n; i++) lanes[i] = fma16(qt[d * n + i], k, lanes[i]);
    }
#pragma GCC unroll 12
    for (int i = 0; i < n; i++) {
        const f32x16 scaled = lanes[i] * scale;
        memcpy(scores + i * 16, &scaled, sizeof scaled);
    }
}

/* scores_n over two blocks at once (offsets o0, o1; scores to s0, s1), for n <= MAX_SHARED_ROWS / 2 rows
   whose queries are interleaved `qstride` apart (qt[d * qstride + i] = q_i[d]: a whole chunk, or half of
   one). A lane's score is a chain of dependent fused multiply-adds (d ascending), so a few rows against
   one block wait on the FMA latency (decode: 3 rows); two blocks put 2 n chains in flight. A chunk of
   more rows goes in two halves, each against both blocks: half the query broadcasts per FMA of the whole
   chunk against one block. Each key's score is the same sequence as scores_n's: the same bits. */
INLINE void scores2_n(int n, int fmt, const float *qt, int64_t qstride, const void *keys_t, int64_t o0, int64_t o1,
                      int64_t dim, float scale, float *s0, float *s1, const ahead_lines *ahead) {
    f32x16 lanes[2][MAX_SHARED_ROWS / 2];
#pragma GCC unroll 6
    for (int i = 0; i < n; i++) lanes[0][i] = lanes[1][i] = (f32x16){0};
    for (int64_t d = 0; d < dim; d++) {
        if (ahead && d < ahead->lines) {
            if (ahead->at[0]) __builtin_prefetch(ahead->at[0] + 64 * d, 0, 2);
            if (ahead->at[1]) __builtin_prefetch(ahead->at[1] + 64 * d, 0, 2);
        }
        const f32x16 k0 = key16(fmt, keys_t, o0, d, dim), k1 = key16(fmt, keys_t, o1, d, dim);
#pragma GCC unroll 6
        for (int i = 0; i < n; i++) {
            lanes[0][i] = fma16(qt[d * qstride + i], k0, lanes[0][i]);
            lanes[1][i] = fma16(qt[d * qstride + i], k1, lanes[1][i]);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < n; i++) {
        const f32x16 scaled0 = lanes[0][i] * scale, scaled1 = lanes[1][i] * scale;
        memcpy(s0 + i * 16, &scaled0, sizeof scaled0);
        memcpy(s1 + i * 16, &scaled1, sizeof scaled1);
    }
}

/* Value sums of n rows (literal) over keys first..end-1 of one block: p[i * 16 + l] is row i's weight of
   key l, acc[i * dim + d] its sum. `per` (literal) 16-dim slices of every row are summed side by side: a
   sum is a chain of dependent fused multiply-adds (one per key), so with few rows one slice at a time
   waits on the FMA latency; n * per chains in flight keep the FMA units busy. Each (row, dim) still adds
   its keys ascending: the same bits for any `per`. */
INLINE void values_n(int n, int per, int fmt, const float *p, const void *v_cache, int64_t offset, int64_t first,
                     int64_t end, int64_t dim, float *acc) {
    for (int64_t d = 0; d < dim; d += 16 * per) {
        f32x16 sums[MAX_SHARED_ROWS]; /* sums[i * per + c]: row i, dims d + 16 c .. */
#pragma GCC unroll 12
        for (int s = 0; s < n * per; s++) memcpy(&sums[s], acc + s / per * dim + d + 16 * (s % per), sizeof sums[s]);
        if (first == 0 && end == 16) { /* a whole block: the key loop unrolled, no exit branch to mispredict */
#pragma GCC unroll 16
            for (int64_t l = 0; l < 16; l++) {
#pragma GCC unroll 4
                for (int c = 0; c < per; c++) {
                    const f32x16 v = value16(fmt, v_cache, offset, l, d + 16 * c, dim);
#pragma GCC unroll 12
                    for (int i = 0; i < n; i++) sums[i * per + c] = fma16(p[i * 16 + l], v, sums[i * per + c]);
                }
            }
        } else {
            for (int64_t l = first; l < end; l++) {
#pragma GCC unroll 4
                for (int c = 0; c < per; c++) {
                    const f32x16 v = value16(fmt, v_cache, offset, l, d + 16 * c, dim);
#pragma GCC unroll 12
                    for (int i = 0; i < n; i++) sums[i * per + c] = fma16(p[i * 16 + l], v, sums[i * per + c]);
                }
            }
        }
#pragma GCC unroll 12
        for (int s = 0; s < n * per; s++) memcpy(acc + s / per * dim + d + 16 * (s % per), &sums[s], sizeof sums[s]);
    }
}

/* values_n with as many slices side by side as the registers hold (n * per <= MAX_SHARED_ROWS) and dim
   allows; n and fmt literal, so only the branches that fit are compiled. More than half the rows: two
   halves of two slices each, one after the other. Each value load then serves half as many rows, but
   each broadcast weight two slices: on Zen 5 (two 512-bit FMA pipes) 12 rows x 1 slice ran at 167 and
   two halves at 184-207 GFLOP/s (one thread, a 6k context's block slices in L2). */
INLINE void values_wide(int n, int fmt, const float *p, const void *v_cache, int64_t offset, int64_t first,
                        int64_t end, int64_t dim, float *acc) {
    if (REGROUP && 2 * n > MAX_SHARED_ROWS && dim % 32 == 0) {
        const int half = n / 2;
        values_n(half, 2, fmt, p, v_cache, offset, first, end, dim, acc);
        values_n(n - half, 2, fmt, p + half * 16, v_cache, offset, first, end, dim, acc + half * dim);
    } else if (4 * n <= MAX_SHARED_ROWS && dim % 64 == 0) values_n(n, 4, fmt, p, v_cache, offset, first, end, dim, acc);
    else if (2 * n <= MAX_SHARED_ROWS && dim % 32 == 0) values_n(n, 2, fmt, p, v_cache, offset, first, end, dim, acc);
    else values_n(n, 1, fmt, p, v_cache, offset, first, end, dim, acc);
}

#define SCORES_CASE(N)                                                              \
    case N:                                                                         \
        if (fmt == KV_BF16) scores_n(N, KV_BF16, qt, keys_t, offset, dim, scale, scores); \
        else scores_n(N, KV_F32, qt, keys_t, offset, dim, scale, scores);           \
        break;
/* the query stride literal where it is N (a whole chunk: decode); halves of a chunk pass it (a literal 2 N
   for even chunks measured the same at 2k and 6k) */
#define SCORES2_STRIDE(N, QS)                                                               \
    if (fmt == KV_BF16) scores2_n(N, KV_BF16, qt, QS, keys_t, o0, o1, dim, scale, s0, s1, ahead);  \
    else scores2_n(N, KV_F32, qt, QS, keys_t, o0, o1, dim, scale, s0, s1, ahead);
#define SCORES2_CASE(N)                                                                     \
    case N:                                                                                 \
        if (fmt == KV_Q8) scores2_n(N, KV_Q8, qt, N, keys_t, o0, o1, dim, scale, s0, s1, ahead); \
        else if (!REGROUP || qstride == N) {                                                \
            SCORES2_STRIDE(N, N)                                                            \
        } else {                                                                            \
            SCORES2_STRIDE(N, qstride)                                                      \
        }                                                                                   \
        break;
#define VALUES_CASE(N)                                                                 \
    case N:                                                                            \
        if (fmt == KV_BF16) values_wide(N, KV_BF16, p, v_cache, offset, first, end, dim, acc); \
        else values_wide(N, KV_F32, p, v_cache, offset, first, end, dim, acc);         \
        break;
#define VALUES_Q8_CASE(N)                                                              \
    case N:                                                                            \
        values_wide(N, KV_Q8, p, v_cache, offset, first, end, dim, acc);               \
        break;
/* One case per row count 1..MAX_SHARED_ROWS (12 or 6, attention.h), and 1..MAX_SHARED_ROWS / 2 for the
   two-block scores. */
#define CASES_1_TO_3(CASE) CASE(1) CASE(2) CASE(3)
#define CASES_1_TO_6(CASE) CASES_1_TO_3(CASE) CASE(4) CASE(5) CASE(6)
#if MAX_SHARED_ROWS == 12
#define CASES_ALL_ROWS(CASE) CASES_1_TO_6(CASE) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)
#define CASES_HALF_ROWS(CASE) CASES_1_TO_6(CASE)
#elif MAX_SHARED_ROWS == 6
#define CASES_ALL_ROWS(CASE) CASES_1_TO_6(CASE)
#define CASES_HALF_ROWS(CASE) CASES_1_TO_3(CASE)
#else
#error "MAX_SHARED_ROWS must be 12 or 6"
#endif

__attribute__((visibility("hidden"))) void detinf_rows_scores16(int n, const float *qt, const void *keys_t,
                                                                int64_t offset, int64_t dim, int fmt, float scale,
                                                                float *scores) {
    switch (n) {
        CASES_ALL_ROWS(SCORES_CASE)
    default: break;
    }
}

__attribute__((visibility("hidden"))) void detinf_rows_scores16x2(int n, const float *qt, int64_t qstride,
                                                                  const void *keys_t, int64_t o0, int64_t o1,
                                                                  int64_t dim, int fmt, float scale, float *s0,
                                                                  float *s1, const ahead_lines *ahead) {
    switch (n) {
        CASES_HALF_ROWS(SCORES2_CASE)
    default: break;
    }
}

__attribute__((visibility("hidden"))) void detinf_rows_values16(int n, const float *p, const void *v_cache,
                                                                int64_t offset, int64_t first, int64_t end,
                                                                int64_t dim, int fmt, float *acc) {
    if (fmt == KV_Q8) {
        switch (n) {
            CASES_HALF_ROWS(VALUES_Q8_CASE)
        default: break;
        }
        return;
    }
    switch (n) {
        CASES_ALL_ROWS(VALUES_CASE)
    default: break;
    }
}

/* Blocks are scattered through the cache pool, so the hardware prefetchers lose the stream at every
   block boundary, and decode attention (which reads the whole cache from memory at every step) waited
   on memory: 25 ms per 30 layers at 32 rows x 192 keys, against 10 ms with a warm cache. Asking for the
   block two ahead (keys, then values) into L2 brought it to 17 ms. Prefetches change no value. */
#define LOOKAHEAD_BLOCKS 2

/* Bytes of one KV head's keys (or values) in one cache block, as stored (bf16, fp32 or q8_0) */
static inline int64_t slice_bytes(const attention_args *a) {
    return a->q8 ? q8_row_bytes(a->head_dim) * 16 : a->head_dim * 16 * (a->bf16 ? 2 : 4);
}

/* Where KV head kvh's keys (or values) of cache block block_id start, as stored: slices of every layout
   follow one another, block by block and KV head by KV head */
static inline const char *slice_at(const attention_args *a, int64_t block_id, int64_t kvh, int values) {
    return (const char *)(values ? a->v_cache : a->k_cache) + (block_id * a->kv_heads + kvh) * slice_bytes(a);
}

/* Asks for every line of the slice at `base` (NULL: none) into L2 (locality 2), all at once. GCC deletes a
   loop whose body is only __builtin_prefetch as an empty loop; the empty volatile asm that uses the
   address keeps it (it emits no instruction). */
static inline void prefetch_whole(const attention_args *a, const char *base) {
    if (!base) return;
    for (int64_t line = 0; line < slice_bytes(a); line += 64) {
        __builtin_prefetch(base + line, 0, 2);
        __asm__ __volatile__("" : : "r"(base + line));
    }
}

/* prefetch_whole of one KV head's keys or values in one cache block */
static inline void prefetch_slice(const attention_args *a, int64_t block_id, int64_t kvh, int values) {
    prefetch_whole(a, slice_at(a, block_id, kvh, values));
}

/* The slice the key pass asks for at block b: the keys LOOKAHEAD_BLOCKS ahead, near the end the first
   value blocks (NULL: none). */
static inline const char *key_pass_ahead(const attention_args *a, const int64_t *table, int64_t num_blocks, int64_t b,
                                         int64_t kvh) {
    const int64_t ahead = b + LOOKAHEAD_BLOCKS;
    if (ahead < num_blocks) return slice_at(a, table[ahead], kvh, 0);
    if (ahead - num_blocks < num_blocks) return slice_at(a, table[ahead - num_blocks], kvh, 1);
    return NULL;
}

/* The paired key pass's prefetch at blocks b, b + 1: their two slices, asked for a line or two per step of
   the scores' loop over d (scores2_n) instead of all at once. The 64 requests of a burst fill the core's
   miss buffers and stall the work behind them: perf put ~40% of the tile function's own time on the burst
   loops, and spread out 30 layers' decode attention at 32 x 192 keys took 0.96-0.97x the time (AMD Zen 4,
   2 threads, caches from memory; bench/RESULTS.md). */
static inline ahead_lines key_pass_lines(const attention_args *a, const int64_t *table, int64_t num_blocks, int64_t b,
                                         int64_t kvh) {
    const ahead_lines ahead = {{key_pass_ahead(a, table, num_blocks, b, kvh),
                                key_pass_ahead(a, table, num_blocks, b + 1, kvh)},
                               (slice_bytes(a) + 63) / 64};
    return ahead;
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

/* The queries of one chunk interleaved (qt[d * n + i] = q_i[d]) at its rows' place in w->tile. With
   AVX-512, 16 dims of every row at a time, transposed in registers (the scalar loop's strided stores took
   a quarter of a prefill tile's time); the same values in the same places either way. */
static void chunk_queries(const attention_args *a, int64_t r0, int64_t tokens, chunk c, const workspace *w) {
    const int64_t dim = a->head_dim, n = c.count;
    float *qt = w->tile + c.scratch * dim;
    const float *rows[MAX_SHARED_ROWS];
    for (int64_t i = 0; i < n; i++) rows[i] = a->q + (r0 * a->heads + query_row(a, tokens, c.first + i)) * dim;
#if defined(__AVX512F__)
    const __mmask16 live = (__mmask16)((1u << n) - 1);
    for (int64_t d = 0; d < dim; d += 16) { /* dim is a multiple of 16 on this path */
        __m512 r[16];
        for (int64_t i = 0; i < 16; i++) r[i] = i < n ? _mm512_loadu_ps(rows[i] + d) : _mm512_setzero_ps();
        transpose16x16(r);
        for (int64_t l = 0; l < 16; l++) _mm512_mask_storeu_ps(qt + (d + l) * n, live, r[l]);
    }
#else
    for (int64_t i = 0; i < n; i++)
        for (int64_t d = 0; d < dim; d++) qt[d * n + i] = rows[i][d];
#endif
}

/* Key pass of one chunk over block b of the tile, whose keys of the chunk's KV head are `keys_b`.
   Lanes past a row's last key are computed into its scratch and never read. */
static void chunk_scores(const attention_args *a, kv_slice keys_b, int64_t b, chunk c, int64_t stride,
                         const workspace *w) {
    const int64_t dim = a->head_dim, n = c.count;
    float *scores = w->scores + c.scratch * stride + b * n * 16;
    detinf_rows_scores16((int)n, w->tile + c.scratch * dim, keys_b.base, keys_b.offset, dim, keys_b.fmt,
                         a->scale, scores);
}

/* chunk_scores over blocks b and b + 1 at once (keys at `keys_b` and at offset `next` of the same base),
   in halves of at most MAX_SHARED_ROWS / 2 rows: the same scores, the same places. */
static void chunk_scores2(const attention_args *a, kv_slice keys_b, int64_t next, int64_t b, chunk c,
                          int64_t stride, const workspace *w, const ahead_lines *ahead) {
    const int64_t dim = a->head_dim, n = c.count, half = n > MAX_SHARED_ROWS / 2 ? (n + 1) / 2 : n;
    float *scores = w->scores + c.scratch * stride + b * n * 16;
    const float *qt = w->tile + c.scratch * dim;
    for (int64_t first = 0; first < n; first += half) {
        const int64_t rows = n - first < half ? n - first : half;
        detinf_rows_scores16x2((int)rows, qt + first, n, keys_b.base, keys_b.offset, next, dim, keys_b.fmt,
                               a->scale, scores + first * 16, scores + (n + first) * 16, first == 0 ? ahead : NULL);
    }
}

/* Value pass of one chunk over block b, whose values of the chunk's KV head are `values_b`. A block every
   row of the tile sees whole (b * 16 + 16 <= min_keys) is shared; in the tile's last blocks each row adds
   exactly its own keys, alone. */
static void chunk_values(const attention_args *a, kv_slice values_b, int64_t b, int64_t tokens, chunk c,
                         const int64_t *keys, int64_t min_keys, int64_t stride, const workspace *w) {
    const int64_t dim = a->head_dim, n = c.count, group = a->heads / a->kv_heads, per_kvh = tokens * group;
    const float *p = w->scores + c.scratch * stride + b * n * 16;
    float *acc = w->acc + c.scratch * dim;
    if ((b + 1) * 16 <= min_keys) {
        detinf_rows_values16((int)n, p, values_b.base, values_b.offset, 0, 16, dim, values_b.fmt, acc);
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        const int64_t left = keys[(c.first + i) % per_kvh / group] - b * 16;
        if (left > 0)
            detinf_rows_values16(1, p + i * 16, values_b.base, values_b.offset, 0, left < 16 ? left : 16, dim,
                                 values_b.fmt, acc + i * dim);
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
                                                                int64_t kvh, const workspace *w,
                                                                const next_item *next) {
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
    /* two blocks at a time: one chunk of few rows (decode: a token's query heads of the KV head) on every
       build, and any chunks (prefill, in halves) where REGROUP */
    const int paired = REGROUP || (per_head == 1 && per_kvh <= MAX_SHARED_ROWS / 2);
    /* decode over a q8_0 cache (one chunk of a few rows): blocks read in place, dequantized in registers
       (prefill chunks share each dequantized scratch slice between more rows) */
    const int in_place = a->q8 && per_head == 1 && per_kvh <= MAX_SHARED_ROWS / 2;
    for (int64_t b = 0; b < num_blocks;) { /* every chunk while the blocks are in L1 */
        if (paired && b + 1 < num_blocks) {
            const ahead_lines ahead = key_pass_lines(a, table, num_blocks, b, kvh);
            /* the second block, from the same base: the cache, or for q8_0 the workspace's second slice */
            const kv_slice keys_b = in_place ? cached_slice(a, table[b], kvh, 0)
                                             : read_slice(a, table[b], kvh, 0, w->slices);
            int64_t next = cached_slice(a, table[b + 1], kvh, 0).offset;
            if (a->q8 && !in_place) {
                read_slice(a, table[b + 1], kvh, 0, w->slices + 16 * dim);
                next = 16 * dim;
            }
            for (int64_t index = first_chunk; index < end_chunk; index++)
                chunk_scores2(a, keys_b, next, b, nth_chunk(per_kvh, index), stride, w,
                              index == first_chunk ? &ahead : NULL);
            b += 2;
            continue;
        }
        const kv_slice keys_b = read_slice(a, table[b], kvh, 0, w->slices);
        prefetch_whole(a, key_pass_ahead(a, table, num_blocks, b, kvh)); /* unpaired: all at once */
        for (int64_t index = first_chunk; index < end_chunk; index++)
            chunk_scores(a, keys_b, b, nth_chunk(per_kvh, index), stride, w);
        b += 1;
    }
    for (int64_t index = first_chunk; index < end_chunk; index++) {
        const chunk c = nth_chunk(per_kvh, index);
        for (int64_t i = 0; i < c.count; i++) {
            const int64_t token = (c.first + i) % per_kvh / group;
            w->totals[c.scratch + i] = exp_and_sum(w->scores + c.scratch * stride + i * 16, keys[token], c.count * 16);
        }
    }
    memset(w->acc, 0, sizeof(float) * (size_t)(per_kvh * dim));
    for (int64_t b = 0; b < num_blocks; b++) { /* values ahead; in the last blocks, the next item's first keys */
        if (b + LOOKAHEAD_BLOCKS < num_blocks) prefetch_slice(a, table[b + LOOKAHEAD_BLOCKS], kvh, 1);
        else if (next->table && b + LOOKAHEAD_BLOCKS - num_blocks < next->blocks)
            prefetch_slice(a, next->table[b + LOOKAHEAD_BLOCKS - num_blocks], next->kvh, 0);
        const kv_slice values_b =
            in_place ? cached_slice(a, table[b], kvh, 1) : read_slice(a, table[b], kvh, 1, w->slices);
        for (int64_t index = first_chunk; index < end_chunk; index++)
            chunk_values(a, values_b, b, tokens, nth_chunk(per_kvh, index), keys, min_keys, stride, w);
    }
    for (int64_t k = 0; k < per_kvh; k++) {
        float *dst = a->out + (r0 * heads + query_row(a, tokens, kvh * per_kvh + k)) * dim;
        const float *acc = w->acc + k * dim;
#if defined(__AVX512F__)
        /* one IEEE division per element, 16 at a time (GCC chose 8) */
        const __m512 total = _mm512_set1_ps(w->totals[k]);
        for (int64_t d = 0; d < dim; d += 16) _mm512_storeu_ps(dst + d, _mm512_div_ps(_mm512_loadu_ps(acc + d), total));
#else
        for (int64_t d = 0; d < dim; d++) dst[d] = acc[d] / w->totals[k];
#endif
    }
}
