/* Pieces shared by the attention kernel's two files: attention.c (the entry point, the bounds check and
   the generic loops for any block size and head_dim) and attention_tile.c (the 16-key-block path that
   computes a tile of query rows against each loaded block).

   The arithmetic of one output row (one query token x one query head) is spelled out in attention.c;
   every helper here is a fixed sequence of IEEE float operations applied to that row's own data, so
   sharing a load between rows (the n-row kernels) never changes a row's bits. */

#ifndef DETINF_ATTENTION_H
#define DETINF_ATTENTION_H

#include "common.h"
#include "kv_q8.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Most rows (query token x query head of one KV head) that share one loaded key or value vector. With
   12 the load and bf16 widening of each vector are spread over 12 fused multiply-adds and the kernels
   run at 97% of this machine's FMA peak (Zen 4: 3.5 of 3.6 G 16-lane FMAs/s per core, data in L1);
   from 16 rows GCC no longer keeps every accumulator in a register and the rate falls to ~2 G/s.
   Without AVX-512 a 16-float vector takes two AVX2 registers (of 16) or four SSE ones, so 12 rows'
   accumulators spill whatever the count; 6 rows keep AVX2's in registers, and halve the tile cases the
   compiler specialises (attention_tile.c compiled for minutes at -march=x86-64-v3 and x86-64: see
   bench/RESULTS.md, issue 37). Rows never share arithmetic, so the count changes speed only. */
#if defined(__AVX512F__)
#define MAX_SHARED_ROWS 12
#else
#define MAX_SHARED_ROWS 6
#endif
/* Most query tokens in one tile (rows of one sequence computed together). */
#define MAX_TILE_TOKENS 8

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

/* Sixteen floats as one value (GCC/Clang vector extension): each operation is the same IEEE operation
   applied lane by lane, so results are those of scalar code, whatever the target ISA. */
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

/* a * b + c per lane with one rounding (one vfmadd on AVX-512, fmaf calls elsewhere: same bits). With
   AVX-512 the intrinsic is spelled out so that GCC broadcasts `a` from memory inside the FMA: left to
   itself it loaded 16 neighbouring floats and broadcast one from a register, a shuffle per FMA. */
INLINE f32x16 fma16(float a, f32x16 b, f32x16 c) {
#if defined(__AVX512F__)
    return (f32x16)_mm512_fmadd_ps(_mm512_set1_ps(a), (__m512)b, (__m512)c);
#else
    f32x16 broadcast, result;
    for (int l = 0; l < 16; l++) broadcast[l] = a;
    for (int l = 0; l < 16; l++) result[l] = fmaf(broadcast[l], b[l], c[l]);
    return result;
#endif
}

INLINE f32x16 load16(const void *base, int64_t index, int bf16) {
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

/* 16 int8 values at `at`, each times its lane's scale: (float)q * scale, one fp32 multiply, as kv_q8.h's
   dequantized slices hold them (int8 -> fp32 is exact) */
INLINE f32x16 q8_times16(const int8_t *at, f32x16 scale) {
    f32x16 value;
#if defined(__AVX512F__)
    const __m512 product = q8_times16_512(_mm_loadu_si128((const __m128i *)at), (__m512)scale);
    memcpy(&value, &product, sizeof value);
    return value;
#else
    for (int l = 0; l < 16; l++) value[l] = (float)at[l];
    return value * scale;
#endif
}

/* Keys d of the 16-key slice at `offset` (elements; q8_0: bytes) of a transposed key cache in format fmt
   (kv_q8.h's KV_F32, KV_BF16, KV_Q8): a q8_0 slice keeps int8 [dim][16], then fp32 scales [dim / 32][16] */
INLINE f32x16 key16(int fmt, const void *keys_t, int64_t offset, int64_t d, int64_t dim) {
    if (fmt != KV_Q8) return load16(keys_t, offset + d * 16, fmt == KV_BF16);
    const int8_t *slice = (const int8_t *)keys_t + offset;
    f32x16 scale;
    memcpy(&scale, slice + dim * 16 + 64 * (d / Q8_GROUP), sizeof scale);
    return q8_times16(slice + d * 16, scale);
}

/* Values d..d+15 (d a multiple of 16) of key l of the 16-key slice at `offset` (elements; q8_0: bytes) of a
   value cache in format fmt: a q8_0 key keeps its dim int8 values, then its fp32 scales [dim / 32] */
INLINE f32x16 value16(int fmt, const void *v_cache, int64_t offset, int64_t l, int64_t d, int64_t dim) {
    if (fmt != KV_Q8) return load16(v_cache, offset + l * dim + d, fmt == KV_BF16);
    const int8_t *row = (const int8_t *)v_cache + offset + l * q8_row_bytes(dim);
    float scale;
    memcpy(&scale, row + dim + 4 * (d / Q8_GROUP), sizeof scale);
    f32x16 scales;
#if defined(__AVX512F__)
    const __m512 broadcast = _mm512_set1_ps(scale); /* GCC made the loop below 16 masked broadcasts */
    memcpy(&scales, &broadcast, sizeof scales);
#else
    for (int l = 0; l < 16; l++) scales[l] = scale;
#endif
    return q8_times16(row + d, scales);
}

#if defined(__AVX512F__)
/* The 16 x 16 floats in r transposed in registers (r[c] lane i <- r[i] lane c): unpacks of 32-bit then
   64-bit pairs inside 128-bit lanes, then two rounds of 128-bit lane shuffles. Moves only. */
static inline void transpose16x16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) { /* t[i] lane k: r[i][4k], r[i+1][4k], r[i][4k+1], r[i+1][4k+1] */
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int g = 0; g < 16; g += 4) { /* r[g + j] lane k: column 4k + j of rows g..g+3 */
        r[g] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[g]), _mm512_castps_pd(t[g + 2])));
        r[g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[g]), _mm512_castps_pd(t[g + 2])));
        r[g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[g + 1]), _mm512_castps_pd(t[g + 3])));
        r[g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[g + 1]), _mm512_castps_pd(t[g + 3])));
    }
    for (int j = 0; j < 4; j++) { /* t[j] / t[4 + j]: lanes 0,1 / 2,3 of rows 0..7; t[8 + j] / t[12 + j] rows 8..15 */
        t[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x44);
        t[4 + j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xEE);
        t[8 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x44);
        t[12 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xEE);
    }
    for (int j = 0; j < 4; j++) { /* column 4k + j: lane k of each group of four rows */
        r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
        r[4 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD);
        r[8 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88);
        r[12 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xDD);
    }
}
#endif

/* A row's scores lie in blocks of 16 keys, `step` floats apart (16: one contiguous row): key j is
   scores[(j / 16) * step + j % 16]. */
#define KEY_AT(scores, step, j) ((scores)[((j) / LANES) * (step) + (j) % LANES])

/* max over the row's keys 0..keys-1, the value of the sequential loop
       m = s[0]; for j >= 1: m = s[j] > m ? s[j] : m
   computed in 16 lanes (each started at s[0]) then across them. A NaN never wins a comparison, so the
   result is NaN exactly when s[0] is, else the largest non-NaN score; only the sign of a zero maximum
   can differ from the sequential loop's, and exp(s - m) is the same for m = +0 and m = -0 (s - m is the
   same for s != 0, and exp(+0) = exp(-0) = 1), so the softmax weights are bit for bit the loop's. */
static inline float row_max(const float *scores, int64_t keys, int64_t step) {
    float lanes[LANES];
    int64_t j = 0;
#if defined(__AVX512F__)
    /* MAXPS is defined as (a > b ? a : b), lane by lane: the loop below, exactly (GCC left it scalar) */
    __m512 best = _mm512_set1_ps(scores[0]);
    for (; j + LANES <= keys; j += LANES) best = _mm512_max_ps(_mm512_loadu_ps(scores + (j / LANES) * step), best);
    _mm512_storeu_ps(lanes, best);
#else
    for (int l = 0; l < LANES; l++) lanes[l] = scores[0];
    for (; j + LANES <= keys; j += LANES) {
        const float *x = scores + (j / LANES) * step;
        for (int l = 0; l < LANES; l++) lanes[l] = x[l] > lanes[l] ? x[l] : lanes[l];
    }
#endif
    for (; j < keys; j++) lanes[0] = KEY_AT(scores, step, j) > lanes[0] ? KEY_AT(scores, step, j) : lanes[0];
    float m = lanes[0];
    for (int l = 1; l < LANES; l++) m = lanes[l] > m ? lanes[l] : m;
    return m;
}

#if defined(__AVX512F__) && !defined(DETINF_TEST_SEPARATE_STEPS)
/* exp(s - m) of the 16 scores at x, s - m clamped below at -87 (MAXPS(-87, d) is -87 > d ? -87 : d: the
   scalar clamp, NaN included), written back in place */
static inline __m512 exp16_shifted(float *x, __m512 m) {
    const __m512 e = exp16_in_range(_mm512_max_ps(_mm512_set1_ps(-87.0f), _mm512_sub_ps(_mm512_loadu_ps(x), m)));
    _mm512_storeu_ps(x, e);
    return e;
}
#endif

/* In place over the row's keys: s -> exp(s - max), clamped below at -87. Returns their sum, as
   lane_sum (common.h) would over the contiguous row: key j goes to lane j % 16, then lane_tree. The
   AVX-512 path computes four vectors of keys at once (their exps are independent, so the core overlaps
   them) and adds them to the lanes in key order: the same operations in the same order. */
__attribute__((noinline)) static float exp_and_sum(float *scores, int64_t keys, int64_t step) {
    const float m = row_max(scores, keys, step);
    float lanes[LANES] = {0};
    int64_t j = 0;
#if defined(__AVX512F__) && !defined(DETINF_TEST_SEPARATE_STEPS)
    const __m512 max = _mm512_set1_ps(m);
    __m512 sums = _mm512_setzero_ps();
    for (; j + 4 * LANES <= keys; j += 4 * LANES) {
        float *x = scores + (j / LANES) * step;
        const __m512 e0 = exp16_shifted(x, max), e1 = exp16_shifted(x + step, max);
        const __m512 e2 = exp16_shifted(x + 2 * step, max), e3 = exp16_shifted(x + 3 * step, max);
        sums = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(_mm512_add_ps(sums, e0), e1), e2), e3);
    }
    for (; j + LANES <= keys; j += LANES) sums = _mm512_add_ps(sums, exp16_shifted(scores + (j / LANES) * step, max));
    _mm512_storeu_ps(lanes, sums);
#else
    for (; j + LANES <= keys; j += LANES) {
        float *x = scores + (j / LANES) * step;
        for (int l = 0; l < LANES; l++) {
            const float shifted = x[l] - m;
            x[l] = exp_nonpositive(shifted < -87.0f ? -87.0f : shifted);
            lanes[l] = lanes[l] + x[l];
        }
    }
#endif
    float *x = scores + (j / LANES) * step;
    for (int l = 0; j + l < keys; l++) {
        const float shifted = x[l] - m;
        x[l] = exp_nonpositive(shifted < -87.0f ? -87.0f : shifted);
        lanes[l] = lanes[l] + x[l];
    }
    return lane_tree(lanes);
}

/* The caches of one layer hold blocks of `block` slots (slot = block_id * block + offset):
     keys   [num_blocks, KVH, D, block]   a head's keys transposed inside a block (key index fastest)
     values [num_blocks, KVH, block, D]
   (a q8_0 cache: kv_q8.h's int8 layouts, dequantized a block slice at a time by read_slice, or value by
   value in registers by key16 / value16 on the 16-key kernels' decode path.)
   Row r is query token r (row r of q and out); it sees keys row_first[r]..row_keys[r]-1 (row_first NULL:
   from key 0; a sliding window otherwise) of the sequence whose block table starts at
   block_ids[row_table[r]]. q, out: [T, H, D] fp32. */
typedef struct {
    const float *q;
    const void *k_cache;
    const void *v_cache;
    int bf16; /* the cache is bf16 (else fp32, or q8_0 when q8) */
    int q8;   /* the cache is q8_0 (kv_q8.h): read_slice / cached_slice say how its slices are read */
    const int64_t *block_ids;
    const int64_t *row_table;
    const int64_t *row_keys;
    const int64_t *row_first; /* NULL, or [T]: the first key each row sees (its window's start) */
    int64_t heads, kv_heads, head_dim, block;
    float scale;
    float softcap; /* > 0: scores -> tanh(s / softcap) * softcap before the softmax (Gemma 2); 0: none */
    float *out;
    int64_t end_row; /* rows [first_row, end_row) are computed: their block tables were checked */
} attention_args;

/* Workspace of one thread, for R rows (one KV head's query heads x a tile's tokens on the fast path,
   every head of one token on the generic path):
     scores [R][keys rounded up to the block]   acc [R][D]   totals [R]
   tile: one key block (generic loops) or every chunk's interleaved queries (fast path: chunk rows s..s+n-1
   at tile + s * D, [D][n]), whichever is larger.
   slices: a q8_0 cache's dequantized slices, two blocks of max(block, 16) x D (NULL for other caches). */
typedef struct {
    float *scores;
    float *tile;
    float *acc;
    float *totals;
    float *slices;
} workspace;

/* Where the kernels read one block's keys or values of one KV head: `base` + `offset` elements (q8_0:
   bytes) in format fmt (KV_F32, KV_BF16, KV_Q8). */
typedef struct {
    const void *base;
    int64_t offset;
    int fmt;
} kv_slice;

/* KV head kvh's keys (values when `values`) of cache block block_id: the cache itself for fp32 and bf16
   caches; for a q8_0 cache the slice dequantized into `scratch` (block x D floats, each q * scale: one fp32
   multiply), which the same fp32 loops then read, so each row's arithmetic is unchanged. */
static inline kv_slice read_slice(const attention_args *a, int64_t block_id, int64_t kvh, int values,
                                  float *scratch) {
    const int64_t slice = block_id * a->kv_heads + kvh;
    if (a->q8) {
        if (values) q8_values_slice((const int8_t *)a->v_cache, slice, a->head_dim, a->block, scratch);
        else q8_keys_slice((const int8_t *)a->k_cache, slice, a->head_dim, a->block, scratch);
        const kv_slice dequantized = {scratch, 0, KV_F32};
        return dequantized;
    }
    const kv_slice cached = {values ? a->v_cache : a->k_cache, slice * a->head_dim * a->block,
                             a->bf16 ? KV_BF16 : KV_F32};
    return cached;
}

/* The same slice read in place, whatever the cache's format (the 16-key kernels' q8_0 decode path: each
   value dequantized in registers by key16 / value16, the same multiply as read_slice's scratch) */
static inline kv_slice cached_slice(const attention_args *a, int64_t block_id, int64_t kvh, int values) {
    if (!a->q8) return read_slice(a, block_id, kvh, values, NULL);
    const kv_slice in_place = {values ? a->v_cache : a->k_cache,
                               (block_id * a->kv_heads + kvh) * q8_row_bytes(a->head_dim) * a->block, KV_Q8};
    return in_place;
}

/* scores[i * 16 + l] = (sum over d ascending of q_i[d] * k_l[d]) * scale for n (1..MAX_SHARED_ROWS)
   rows against the 16 keys of one block of the transposed key cache at `offset`; the queries
   interleaved: qt[d * n + i] = q_i[d] (for n = 1, the query row itself). attention_tile.c. */
void detinf_rows_scores16(int n, const float *qt, const void *keys_t, int64_t offset, int64_t dim, int fmt,
                          float scale, float *scores);

/* Lines a kernel asks the cache for as it goes, a line of each address per step: `lines` 64-byte lines from
   each non-NULL at[i]. Speed only. */
typedef struct {
    const char *at[2];
    int64_t lines;
} ahead_lines;

/* detinf_rows_scores16 for n (1..MAX_SHARED_ROWS / 2) rows against two blocks at once (offsets o0, o1;
   scores to s0, s1), the queries qstride apart (qt[d * qstride + i] = q_i[d]), each key's score the same
   sequence: the same bits. ahead (or NULL): lines to ask for, line d of each at step d (lines past dim are
   not asked for). fmt KV_Q8 (slices read in place): qstride == n only. attention_tile.c. */
void detinf_rows_scores16x2(int n, const float *qt, int64_t qstride, const void *keys_t, int64_t o0, int64_t o1,
                            int64_t dim, int fmt, float scale, float *s0, float *s1, const ahead_lines *ahead);

/* acc[i * dim + d] += p[i * 16 + l] * v_l[d] for l = first..end-1 ascending (fused multiply-adds, each d
   on its own), n (1..MAX_SHARED_ROWS) rows sharing the value loads of one block at `offset` (n = 1: p is
   the row's weights, any number of keys). fmt KV_Q8 (slices read in place): n <= MAX_SHARED_ROWS / 2 only.
   attention_tile.c. */
void detinf_rows_values16(int n, const float *p, const void *v_cache, int64_t offset, int64_t first,
                          int64_t end, int64_t dim, int fmt, float *acc);

/* The work item a thread likely computes after the current one: its sequence's block table (NULL: none), its KV
   head and how many blocks its rows see (detinf_attend_tile16 asks for its first key blocks). */
typedef struct {
    const int64_t *table;
    int64_t kvh, blocks;
} next_item;

/* Query tokens r0..r0+tokens-1 of one sequence, the query heads of KV head kvh; 16-key blocks, head_dim a
   multiple of 16. next: the thread's likely next item (speed only). */
void detinf_attend_tile16(const attention_args *a, int64_t r0, int64_t tokens, int64_t kvh, const workspace *w,
                          const next_item *next);

#endif
