/* Conversions between GGUF block formats and floats: dequantisation of whole tensors or selected rows
   (the embedding lookup), and fp32 -> Q8_0 (`--quantization q8_0`). Both follow the `gguf` package's
   numpy code (gguf/quants.py) operation for operation, so their bits equal it:
     Q8_0  q * d            Q4_0  d * (q - 8)        Q5_0  d * (q - 16)
     Q4_1  d * q + m        Q5_1  d * q + m          (two roundings: product, then sum)
     Q4_K, Q5_K  (d * sc_j) * q - (dmin * m_j)       Q6_K  (d * sc_j) * (q - 32)
   with d, m, dmin fp16 converted exactly and every product or sum one fp32 rounding. */

#include "quant.h"

/* The fp32 values of one stored block (block_values of them). */
static void dequantize_block(int64_t format, const uint8_t *block, float *out) {
    const int32_t offset = format == Q6_K ? 32 : format_offset(format);
    if (format_block_values(format) == UNIT) {
        const float d = f16_to_f32(load_u16(block));
        const float m = format_has_min(format) ? f16_to_f32(load_u16(block + 2)) : 0.0f;
        for (int l = 0; l < UNIT; l++) {
            const float q = (float)((int32_t)unit_value(format, block, 0, l) - offset);
            out[l] = format_has_min(format) ? d * q + m : d * q;
        }
        return;
    }
    const float d = f16_to_f32(load_u16(block + (format == Q6_K ? 208 : 0)));
    const float dmin = format == Q6_K ? 0.0f : f16_to_f32(load_u16(block + 2));
    for (int v = 0; v < SUPER; v++) {
        const float q = (float)((int32_t)unit_value(format, block, v / UNIT, v % UNIT) - offset);
        if (format == Q6_K) {
            out[v] = (d * (float)(int8_t)block[192 + v / 16]) * q;
        } else {
            const float scale = d * (float)k4_scale(block + 4, v / UNIT, 0);
            out[v] = scale * q - dmin * (float)k4_scale(block + 4, v / UNIT, 1);
        }
    }
}

/* out [count][k] = the stored rows rows[i] (or rows 0..count-1 when rows is NULL) of `data`, fp32 or bf16
   (the fp32 value rounded to nearest even). Row indices were checked by ops/quant.py. */
void detinf_dequantize(const uint8_t *data, int64_t row_bytes, int64_t format, const int64_t *rows, int64_t count,
                       int64_t k, void *out, int out_bf16) {
    const int values = format_block_values(format);
    const int64_t bytes = format_block_bytes(format);
#pragma omp parallel for schedule(static) if (count * k >= (int64_t)1 << 18)
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *row = data + (rows ? rows[i] : i) * row_bytes;
        float block[SUPER];
        for (int64_t b = 0; b < k / values; b++) {
            dequantize_block(format, row + b * bytes, block);
            for (int l = 0; l < values; l++) {
                const int64_t at = i * k + b * values + l;
                if (out_bf16) ((uint16_t *)out)[at] = f32_to_bf16(block[l]);
                else ((float *)out)[at] = block[l];
            }
        }
    }
}

/* fp32 -> IEEE half, round to nearest even, overflow to infinity (as numpy's astype(float16)). Finite
   inputs only. */
static uint16_t f32_to_f16(float value) {
    const uint32_t bits = f32_bits(value), sign = (bits >> 16) & 0x8000u, magnitude = bits & 0x7FFFFFFFu;
    if (magnitude >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* >= 65520 */
    if (magnitude < 0x38800000u) {                                   /* below 2^-14: a subnormal half */
        float ulps = fabsf(value) * 16777216.0f;                         /* in units of 2^-24, exact */
        ulps = (ulps + ROUND_MAGIC) - ROUND_MAGIC;                       /* to an integer, ties even */
        return (uint16_t)(sign | (uint32_t)ulps);
    }
    uint32_t half = ((magnitude >> 23) - 112) << 10 | ((magnitude >> 13) & 0x3FFu);
    const uint32_t rest = magnitude & 0x1FFFu;
    if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) half++;
    return (uint16_t)(sign | half);
}

/* Half away from zero, as gguf's np_roundf: floor(a) + floor(2 (a - floor(a))) with the sign of v. */
static inline float round_half_away(float v) {
    const float a = fabsf(v), whole = floorf(a), rounded = whole + floorf(2.0f * (a - whole));
    return v < 0.0f ? -rounded : rounded;
}

/* w [n][k] (fp32, or bf16 when w_bf16; finite, checked by ops/quant.py) -> out [n][k / 32 * 34] Q8_0: per
   block d = amax / 127, q = round_half_away(x * (1 / d)) (0 when d = 0), d stored as fp16. */
void detinf_quantize_q8_0(const void *w, int w_bf16, int64_t n, int64_t k, uint8_t *out) {
#pragma omp parallel for schedule(static) if (n * k >= (int64_t)1 << 18)
    for (int64_t r = 0; r < n; r++) {
        for (int64_t b = 0; b < k / UNIT; b++) {
            float v[UNIT], amax = 0.0f;
            for (int l = 0; l < UNIT; l++) {
                const int64_t at = r * k + b * UNIT + l;
                v[l] = w_bf16 ? bf16_to_f32(((const uint16_t *)w)[at]) : ((const float *)w)[at];
                amax = fabsf(v[l]) > amax ? fabsf(v[l]) : amax;
            }
            const float d = amax / 127.0f, inverse = d == 0.0f ? 0.0f : 1.0f / d;
            uint8_t *block = out + (r * (k / UNIT) + b) * 34;
            const uint16_t half = f32_to_f16(d);
            block[0] = (uint8_t)(half & 0xFF);
            block[1] = (uint8_t)(half >> 8);
            for (int l = 0; l < UNIT; l++) block[2 + l] = (uint8_t)(int8_t)round_half_away(v[l] * inverse);
        }
    }
}
