/* Causal attention over a paged KV cache, for deterministic-inference.

   Every output row (one query token x one query head) is computed by the same sequence of IEEE
   float operations, fixed by this source alone:
     scores[j] = dot(q, k_j) * scale          dot: fused multiply-adds (fmaf) over d ascending, from 0
     m         = max_j scores[j]               exact
     p[j]      = exp(max(scores[j] - m, -87))  exp below: range reduction + degree-7 polynomial,
                                                each step one fmaf (common.h exp_in_range)
     l         = sum_j p[j]                    16 lane partial sums over j, then a fixed tree
     acc[d]    = sum_j p[j] * v_j[d]           fused multiply-adds over j ascending, each d on its own
     out[d]    = acc[d] / l
   where j runs over the row's own keys and nothing else: 0..n-1, or under a sliding window the keys
   f..n-1 of the window alone (the same operations with the window's keys counted from f: key f + i goes
   to lane i % 16 of the sum; the scores and value sums still visit the cache blocks in ascending order,
   from the block holding key f).
   With a soft cap c > 0 (Gemma 2) each score becomes tanh(scores[j] / c) * c (common.h's tanh) before m. No row reads another row's data, so
   a row's bits cannot depend on the batch, the chunk it is in, the number of rows per call or the
   thread that computes it. With 16-key blocks and head_dim a multiple of 16 (attention_tile.c), rows of
   up to a few consecutive tokens of one sequence share each loaded key and value vector (a tile), each
   keeping its own accumulators and order, so tiles change speed only; this file holds the entry point,
   the bounds check and the generic loops for other shapes.

   Build flags must keep that promise: no -ffast-math (no reassociation) and -ffp-contract=off (the
   compiler fuses nothing on its own). Fused multiply-adds appear only where the source asks for one
   (fmaf: IEEE fma, one rounding, the same in an FMA instruction, a vector lane or libm's software
   fmaf on a CPU without FMA). So a vectorised loop body and its scalar tail round identically, and
   the ISA flags change speed, not bits. */

#include <omp.h>

#include "attention.h"

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

/* The first key row r sees: 0, or its sliding window's start. */
static inline int64_t first_key(const attention_args *a, int64_t r) {
    return a->row_first == NULL ? 0 : a->row_first[r];
}

/* The same sums for any head_dim, one row at a time: keys first..keys-1, p[j - base] the weight of key j. */
static void values_any(const attention_args *a, const int64_t *table, int64_t kvh, int64_t first, int64_t keys,
                       int64_t base, const float *p, float *acc, float *tile) {
    const int64_t dim = a->head_dim, block = a->block;
    memset(acc, 0, sizeof(float) * (size_t)dim);
    for (int64_t j = first; j < keys; j++) {
        load_row(a->v_cache, ((table[j / block] * a->kv_heads + kvh) * block + j % block) * dim, tile, dim,
                 a->bf16);
        for (int64_t d = 0; d < dim; d++) acc[d] = fmaf(p[j - base], tile[d], acc[d]);
    }
}

/* Scores and value sums of rows first..first+n-1 of the group (n literal 1..4 where the kernels allow) over
   keys window..keys-1: the blocks from the one holding key `window` (fb), ascending; the scores of block b
   at (b - fb) * block in the row's scratch, so key j at j - fb * block. */
static void attend_rows(const attention_args *a, const int64_t *table, int64_t kvh, int64_t window, int64_t keys,
                        int64_t stride, const float *q, int64_t first, int64_t n, const workspace *w) {
    const int64_t dim = a->head_dim, block = a->block, num_blocks = (keys + block - 1) / block;
    const int64_t fb = window / block, skip = window - fb * block; /* keys of block fb before the window */
    const float *rows_q[4];
    float *rows_scores[4], *rows_acc[4];
    for (int64_t i = 0; i < n; i++) {
        rows_q[i] = q + (first + i) * dim;
        rows_acc[i] = w->acc + (first + i) * dim;
    }
    for (int64_t b = fb; b < num_blocks; b++) {
        const kv_slice keys_b = read_slice(a, table[b], kvh, 0, w->slices);
        for (int64_t i = 0; i < n; i++) rows_scores[i] = w->scores + (first + i) * stride + (b - fb) * block;
        if (block == 16) {
            for (int64_t i = 0; i < n; i++)
                detinf_rows_scores16(1, rows_q[i], keys_b.base, keys_b.offset, dim, keys_b.fmt, a->scale,
                                     rows_scores[i]);
        } else {
            load_row(keys_b.base, keys_b.offset, w->tile, dim * block, keys_b.fmt == KV_BF16);
            for (int64_t i = 0; i < n; i++) block_scores(rows_q[i], w->tile, dim, block, a->scale, rows_scores[i]);
        }
    }
    const float *rows_p[4];
    if (a->softcap > 0.0f) {
        for (int64_t i = 0; i < n; i++) {
            float *row = w->scores + (first + i) * stride + skip;
            for (int64_t j = 0; j < keys - window; j++) row[j] = tanh_portable(row[j] / a->softcap) * a->softcap;
        }
    }
    for (int64_t i = 0; i < n; i++) {
        float *row = w->scores + (first + i) * stride;
        w->totals[first + i] = exp_and_sum(row + skip, keys - window, LANES);
        rows_p[i] = row;
    }
    if (dim % 16 != 0) {
        for (int64_t i = 0; i < n; i++)
            values_any(a, table, kvh, window, keys, fb * block, rows_p[i], rows_acc[i], w->tile);
        return;
    }
    for (int64_t i = 0; i < n; i++) memset(rows_acc[i], 0, sizeof(float) * (size_t)dim);
    for (int64_t b = fb; b < num_blocks; b++) {
        const kv_slice values_b = read_slice(a, table[b], kvh, 1, w->slices);
        const int64_t count = keys - b * block < block ? keys - b * block : block;
        const float *block_p[4];
        for (int64_t i = 0; i < n; i++) block_p[i] = rows_p[i] + (b - fb) * block;
        for (int64_t i = 0; i < n; i++)
            detinf_rows_values16(1, block_p[i], values_b.base, values_b.offset, b == fb ? skip : 0, count, dim,
                                 values_b.fmt, rows_acc[i]);
    }
}

/* All query heads of KV head kvh for row r: G output rows of D values, in groups of up to 4 rows. */
static void attend(const attention_args *a, int64_t r, int64_t kvh, const workspace *w) {
    const int64_t heads = a->heads, kv_heads = a->kv_heads, dim = a->head_dim, block = a->block;
    const int64_t group = heads / kv_heads, keys = a->row_keys[r], window = first_key(a, r);
    const int64_t *table = a->block_ids + a->row_table[r];
    const int64_t stride = (keys - window / block * block + block - 1) / block * block;
    const float *q = a->q + (r * heads + kvh * group) * dim; /* the group's heads are consecutive */
    for (int64_t first = 0; first < group; first += 4) {
        attend_rows(a, table, kvh, window, keys, stride, q, first, group - first < 4 ? group - first : 4, w);
    }
    for (int64_t g = 0; g < group; g++) {
        float *dst = a->out + (r * heads + kvh * group + g) * dim;
        for (int64_t d = 0; d < dim; d++) dst[d] = w->acc[g * dim + d] / w->totals[g];
    }
}

/* 1 when a row sees no key (its window starts at or past its last key), or the blocks of its keys in its
   block table run past block_ids or name a block outside the cache (blocks before its window are not read). */
static int rows_out_of_range(const int64_t *block_ids, int64_t num_ids, const int64_t *row_table,
                             const int64_t *row_keys, const int64_t *row_first, int64_t first_row, int64_t end_row,
                             int64_t block, int64_t num_blocks) {
    for (int64_t r = first_row; r < end_row; r++) {
        const int64_t needed = (row_keys[r] + block - 1) / block, first = row_first == NULL ? 0 : row_first[r];
        if (row_keys[r] < 1 || first < 0 || first >= row_keys[r]) return 1;
        if (row_table[r] < 0 || row_table[r] + needed > num_ids) return 1;
        for (int64_t b = first / block; b < needed; b++) {
            const int64_t id = block_ids[row_table[r] + b];
            if (id < 0 || id >= num_blocks) return 1;
        }
    }
    return 0;
}

/* Query tokens per tile on the fast path: enough that a tile's rows of one KV head fill the
   MAX_SHARED_ROWS accumulators (SmolLM2, 3 heads per KV head: 4 tokens), at least 1; `requested`
   (1..MAX_TILE_TOKENS) overrides it (tests, benchmarks). The choice changes speed only. Two chunks per
   tile (8 tokens here) stream a long context's cache half as often but double the scores' scratch; side
   by side on the Intel machine neither was faster beyond the noise (6k prefill, threads 1), so one. */
static int64_t tile_tokens(int64_t group, int64_t requested) {
    if (requested >= 1) return requested < MAX_TILE_TOKENS ? requested : MAX_TILE_TOKENS;
    const int64_t fit = MAX_SHARED_ROWS / group;
    return fit < 1 ? 1 : fit < MAX_TILE_TOKENS ? fit : MAX_TILE_TOKENS;
}

/* Splits rows [first_row, end_row) into tiles of up to `tokens` consecutive rows of one sequence (the
   same block table); starts[t] is tile t's first row, starts[count] = end_row. Returns the count. */
static int64_t split_tiles(const int64_t *row_table, int64_t first_row, int64_t end_row, int64_t tokens,
                           int64_t *starts) {
    int64_t count = 0;
    for (int64_t r = first_row; r < end_row; count++) {
        starts[count] = r;
        const int64_t first = r;
        for (r++; r < end_row && r - first < tokens && row_table[r] == row_table[first]; r++) {
        }
    }
    starts[count] = end_row;
    return count;
}

/* 1 when some row of [first_row, end_row) starts past key 0 (a sliding window cuts its keys). */
static int any_window(const int64_t *row_first, int64_t first_row, int64_t end_row) {
    if (row_first == NULL) return 0;
    for (int64_t r = first_row; r < end_row; r++)
        if (row_first[r] > 0) return 1;
    return 0;
}

/* Fast-path item `item` (tile item % tiles of KV head item / tiles; none when item >= items), as the
   thread likely to take it next prefetches it */
static next_item next_item_of(const attention_args *a, const int64_t *starts, int64_t tiles, int64_t items,
                              int64_t item) {
    next_item next = {NULL, 0, 0};
    if (item >= items) return next;
    const int64_t t = item % tiles;
    int64_t most = 0;
    for (int64_t r = starts[t]; r < starts[t + 1]; r++) most = a->row_keys[r] > most ? a->row_keys[r] : most;
    next.table = a->block_ids + a->row_table[starts[t]];
    next.kvh = item / tiles;
    next.blocks = (most + 15) / 16;
    return next;
}

/* Computes rows [first_row, end_row), every head, `tile` query tokens of a sequence at a time on the
   fast path (0: the kernel's choice); row r over keys row_first[r]..row_keys[r]-1 (row_first NULL: from
   key 0), its scores soft-capped when softcap > 0. Soft-capped calls and rows cut by a window take the
   generic loops (the tiles share key loads between rows that see the same keys from 0; a row that sees
   them from 0 uncapped has the same bits on either path). Returns 0; 1 when a workspace could not be
   allocated (some rows are then not written); 2 when an index is out of range or a q8_0 cache's head_dim is
   not a multiple of 32 (nothing is written). cache_dtype: KV_F32, KV_BF16 or KV_Q8 (kv_q8.h). */
int detinf_attention_window(const float *q, const void *k_cache, const void *v_cache, int cache_dtype,
                            const int64_t *block_ids, int64_t num_ids, const int64_t *row_table,
                            const int64_t *row_keys, const int64_t *row_first, int64_t first_row, int64_t end_row,
                            int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block, int64_t num_blocks,
                            float scale, float softcap, float *out, int64_t tile) {
    if (rows_out_of_range(block_ids, num_ids, row_table, row_keys, row_first, first_row, end_row, block,
                          num_blocks) ||
        (cache_dtype == KV_Q8 && head_dim % Q8_GROUP != 0))
        return 2;
    const attention_args a = {q,         k_cache,   v_cache,  cache_dtype == KV_BF16, cache_dtype == KV_Q8,
                              block_ids, row_table, row_keys, row_first,              heads,
                              kv_heads,  head_dim,  block,    scale,                  softcap,
                              out,       end_row};
    int64_t max_keys = 1;
    for (int64_t r = first_row; r < end_row; r++) max_keys = a.row_keys[r] > max_keys ? a.row_keys[r] : max_keys;
    const size_t stride = (size_t)((max_keys + block - 1) / block * block);
    const int64_t group = heads / kv_heads;
    const int fast = block == 16 && head_dim % 16 == 0 && group <= MAX_TILE_TOKENS * MAX_SHARED_ROWS &&
                     softcap == 0.0f && !any_window(row_first, first_row, end_row);
    const int64_t tokens = fast ? tile_tokens(group, tile) : 1;
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(end_row - first_row + 1));
    if (starts == NULL) return 1;
    const int64_t tiles = split_tiles(row_table, first_row, end_row, tokens, starts);
    const size_t rows = (size_t)(fast ? tokens * group : heads); /* workspace rows of one item */
    int status = 0;
    /* Work items (a tile on the fast path, with one of its KV heads; a row otherwise) are shared out
       between torch's OpenMP threads (the process's one libgomp, so no second thread pool); each item is
       computed whole by one thread, so the split never changes a bit. KV heads as separate items let a
       single decoding sequence use every thread. Items go KV head by KV head (every tile of KV head 0,
       then of head 1, ...): the threads' consecutive tiles then read the same keys and values, which
       stay in L2; tile by tile, a long context's slices of all KV heads did not fit (SmolLM2 at 6k
       tokens: 3 x 1.5 MB against a 4 MB L2; one 512-token chunk's attention 4.7% faster). They are handed
       out one at a time as threads come free (dynamic, 1), and a thread asks for the first key blocks of
       the item `threads` places on (the one it takes next when items cost alike) while it reads its current
       item's last value blocks (next_item_of): a decode step's items are a dozen blocks each, and their
       first two otherwise came from memory unrequested. A wrong guess costs one item's first lines fetched
       for another core. Dealt round robin instead (static, 1), a long sequence among short ones put all
       its KV heads on one thread whenever the tiles were even in number (30 layers' decode attention, 31
       streams at 192 keys and one at 4096: 1.16-1.27x the time), and a thread that started late held the
       others up even where all items are alike (one layer with its cache in L3: 1.57x; 30 from memory:
       1.03x; AMD Zen 4, 2 threads). */
    const int64_t items = fast ? tiles * kv_heads : tiles;
#pragma omp parallel reduction(| : status)
    {
        const size_t tile_floats = (size_t)head_dim * ((size_t)block > rows ? (size_t)block : rows);
        const size_t slice_floats = 2 * (size_t)head_dim * (size_t)(block > 16 ? block : 16);
        workspace w = {malloc(sizeof(float) * rows * stride), malloc(sizeof(float) * tile_floats),
                       malloc(sizeof(float) * rows * (size_t)head_dim), malloc(sizeof(float) * rows),
                       a.q8 ? malloc(sizeof(float) * slice_floats) : NULL};
        const int ready = w.scores != NULL && w.tile != NULL && w.acc != NULL && w.totals != NULL &&
                          (!a.q8 || w.slices != NULL);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (!ready) {
                status |= 1;
            } else if (fast) {
                const int64_t t = item % tiles;
                const next_item next = next_item_of(&a, starts, tiles, items, item + omp_get_num_threads());
                detinf_attend_tile16(&a, starts[t], starts[t + 1] - starts[t], item / tiles, &w, &next);
            } else {
                for (int64_t kvh = 0; kvh < kv_heads; kvh++) attend(&a, starts[item], kvh, &w);
            }
        }
        free(w.scores);
        free(w.tile);
        free(w.acc);
        free(w.totals);
        free(w.slices);
    }
    free(starts);
    return status;
}

/* detinf_attention_window with every row's keys from key 0 (no sliding window). */
int detinf_attention(const float *q, const void *k_cache, const void *v_cache, int cache_dtype,
                     const int64_t *block_ids, int64_t num_ids, const int64_t *row_table,
                     const int64_t *row_keys, int64_t first_row, int64_t end_row, int64_t heads,
                     int64_t kv_heads, int64_t head_dim, int64_t block, int64_t num_blocks, float scale,
                     float *out, int64_t tile) {
    return detinf_attention_window(q, k_cache, v_cache, cache_dtype, block_ids, num_ids, row_table, row_keys,
                                   NULL, first_row, end_row, heads, kv_heads, head_dim, block, num_blocks, scale,
                                   0.0f, out, tile);
}

/* The kernel's exp, exposed so tests can compare it with a float64 reference. */
float detinf_exp_nonpositive(float x) { return exp_nonpositive(x); }
