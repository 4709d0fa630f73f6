/* The q8_0 KV cache (--kv-cache-dtype q8_0): its byte layout, the quantizer the cache write uses and the
   dequantizer the attention kernels read through.

   Each (token, KV head) vector of D values (D a multiple of 32) is cut into D / 32 groups of 32 along
   head_dim; a group is 32 int8 values and one fp32 scale. One layer's caches are int8 tensors:
     keys   [num_blocks, KVH, D * 9 / 8, block]: per (block, KV head) slice, the int8 values transposed
            ([D][block], key index fastest) then the scales as fp32 [D / 32][block]
     values [num_blocks, KVH, block, D * 9 / 8]: per token, its D int8 values then its D / 32 fp32 scales
   (D * 9 / 8 = D + 4 * D / 32 bytes; every scale starts on a 4-byte boundary.)

   Quantize (one group x[0..31], the values as the model dtype stores them, read as fp32):
     amax  = max |x[i]|           exact (NaN ignored)
     scale = amax / 127           one IEEE fp32 division
     q[i]  = scale == 0 ? 0 : round_to_nearest_even(clamp(x[i] / scale, -127, 127))   (NaN -> 0)
   Dequantize: x'[i] = (float)q[i] * scale, ONE fp32 multiply (int8 -> float is exact). Both are fixed
   sequences of IEEE operations on the token's own values: the cache's bytes and the values the kernels
   compute with are the same on every CPU and for every batch, chunk or thread. The kernels dequantize
   a block's slice into fp32 scratch and run their fp32 loops over it (decode rows instead dequantize each
   value in registers as they read it: attention.h's key16 / value16, the same multiply), so every
   attention row keeps the order and the bits argument of attention.c. */

#ifndef DETINF_KV_Q8_H
#define DETINF_KV_Q8_H

#include "common.h"

#define Q8_GROUP 32

#if defined(__AVX512F__)
/* 16 int8 values as fp32 (exact), each times its lane's scale: the dequantization, one fp32 multiply a value
   (the slices below, and attention.h's in-register reads) */
static inline __m512 q8_times16_512(__m128i bytes, __m512 scale) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), scale);
}
#endif

/* Cache dtype codes of the attention and cache-write kernels (ops/native.py). */
enum { KV_F32 = 0, KV_BF16 = 1, KV_Q8 = 2 };

/* Bytes of one stored vector of `dim` values: the int8 values and their fp32 scales. */
static inline int64_t q8_row_bytes(int64_t dim) { return dim + 4 * (dim / Q8_GROUP); }

/* The scale of one group of 32 values, `stride` floats apart. */
static inline float q8_scale(const float *x, int64_t stride) {
    float amax = 0.0f;
    for (int64_t i = 0; i < Q8_GROUP; i++) {
        const float a = fabsf(x[i * stride]);
        amax = a > amax ? a : amax;
    }
    return amax / 127.0f;
}

/* One value quantized with its group's scale. */
static inline int8_t q8_value(float x, float scale) {
    if (scale == 0.0f) return 0;
    float r = x / scale;
    if (r != r) return 0;
    r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
    return (int8_t)(int)((r + ROUND_MAGIC) - ROUND_MAGIC);
}

static inline void store_scale(int8_t *at, float scale) { memcpy(at, &scale, sizeof scale); }

/* Key `x` [dim] of slot `offset` into the key slice at `slice` (block `block` slots). */
static inline void q8_store_key(int8_t *slice, const float *x, int64_t dim, int64_t block, int64_t offset) {
    for (int64_t g = 0; g < dim / Q8_GROUP; g++) {
        const float scale = q8_scale(x + g * Q8_GROUP, 1);
        for (int64_t i = 0; i < Q8_GROUP; i++)
            slice[(g * Q8_GROUP + i) * block + offset] = q8_value(x[g * Q8_GROUP + i], scale);
        store_scale(slice + dim * block + 4 * (g * block + offset), scale);
    }
}

/* Value `x` [dim] into its token's row `row` (q8_row_bytes(dim) bytes). */
static inline void q8_store_value(int8_t *row, const float *x, int64_t dim) {
    for (int64_t g = 0; g < dim / Q8_GROUP; g++) {
        const float scale = q8_scale(x + g * Q8_GROUP, 1);
        for (int64_t i = 0; i < Q8_GROUP; i++) row[g * Q8_GROUP + i] = q8_value(x[g * Q8_GROUP + i], scale);
        store_scale(row + dim + 4 * g, scale);
    }
}

/* out[d * block + l] = q * scale for the key slice of (block id, KV head) number `slice`. AVX-512 builds
   take 16 slots at a time: the int8 -> fp32 conversions are exact and each value is one fp32 multiply, so
   the lanes hold the scalar loop's bits (the scalar loop, which GCC left unvectorised, made the q8_0 cache
   2-4x slower than bf16 in attention alone). */
static inline void q8_keys_slice(const int8_t *cache, int64_t slice, int64_t dim, int64_t block, float *out) {
    const int8_t *base = cache + slice * q8_row_bytes(dim) * block;
    const int8_t *scales = base + dim * block; /* fp32 [dim / 32][block], read with memcpy (no aliasing) */
    for (int64_t d = 0; d < dim; d++) {
        const int8_t *q = base + d * block, *group = scales + 4 * (d / Q8_GROUP) * block;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
        for (int64_t l = 0; l < block; l += 16) { /* the last run of a block under a mask */
            const __mmask16 lanes = lane_mask16(block - l);
            const __m512 scale = _mm512_maskz_loadu_ps(lanes, group + 4 * l);
            const __m128i bytes = _mm_maskz_loadu_epi8(lanes, q + l);
            _mm512_mask_storeu_ps(out + d * block + l, lanes, q8_times16_512(bytes, scale));
        }
#else
        for (int64_t l = 0; l < block; l++) {
            float scale;
            memcpy(&scale, group + 4 * l, sizeof scale);
            out[d * block + l] = (float)q[l] * scale;
        }
#endif
    }
}

/* out[l * dim + d] = q * scale for the `block` value rows of (block id, KV head) number `slice` (AVX-512:
   a group's 32 values as two 16-lane multiplies, the same bits as the scalar loop). */
static inline void q8_values_slice(const int8_t *cache, int64_t slice, int64_t dim, int64_t block, float *out) {
    const int64_t row_bytes = q8_row_bytes(dim);
    for (int64_t l = 0; l < block; l++) {
        const int8_t *row = cache + (slice * block + l) * row_bytes;
        for (int64_t g = 0; g < dim / Q8_GROUP; g++) {
            float scale;
            memcpy(&scale, row + dim + 4 * g, sizeof scale);
            const int8_t *q = row + g * Q8_GROUP;
            float *group_out = out + l * dim + g * Q8_GROUP;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
            const __m512 scales = _mm512_set1_ps(scale);
            for (int half = 0; half < 2; half++) {
                const __m128i bytes = _mm_loadu_si128((const __m128i *)(q + 16 * half));
                _mm512_storeu_ps(group_out + 16 * half, q8_times16_512(bytes, scales));
            }
#else
            for (int64_t i = 0; i < Q8_GROUP; i++) group_out[i] = (float)q[i] * scale;
#endif
        }
    }
}

#endif
