/* Rotary position tables for deterministic-inference: the inverse frequencies theta^(-2j/D) and the
   cos / sin of every (position, frequency) angle, with bits fixed by this source (portable_math.h)
   instead of torch's pow / cos / sin kernels, which dispatch on the CPU's ISA.

   Same formulation as HF Llama: exponent 2j/D and position * inv_freq are fp32 operations; theta^e
   is computed in double (exp(e log theta)) and rounded to fp32, then 1 / that in fp32; cos and sin are
   computed in double from the fp32 angle and rounded to fp32. Every entry depends on (j, position)
   alone, so the tables are the same whatever the thread count. */

#include "portable_math.h"

/* out[j] = 1 / fp32(theta^(fp32(2j) / fp32(dim))) for j in [0, dim / 2). */
void detinf_inverse_frequencies(double theta, int64_t dim, float *out) {
    const double log_theta = pm_log(theta);
    for (int64_t j = 0; j < dim / 2; j++) {
        const float exponent = (float)(2 * j) / (float)dim;
        const float power = (float)pm_exp((double)exponent * log_theta);
        out[j] = 1.0f / power;
    }
}

/* 1 when an angle of the first `positions` positions is too large for the reduction (|angle| >= 2^20,
   or NaN), else 0: the tables' own guard, callable before a table of that size is made. */
int detinf_rotary_out_of_range(const float *inv_freq, int64_t positions, int64_t dim) {
    for (int64_t j = 0; j < dim / 2; j++) {
        const float largest = (float)(positions > 0 ? positions - 1 : 0) * inv_freq[j];
        if (!(largest < 0x1p20f && largest > -0x1p20f)) return 1;
    }
    return 0;
}

/* inv_freq [dim / 2] fp32 -> cos_out, sin_out [positions, dim] fp32: angle(p, j) = fp32(p) * inv_freq[j]
   (one fp32 product), written at columns j and j + dim / 2 (rotate-half layout). Returns 1 without
   writing when an angle is too large for the reduction (detinf_rotary_out_of_range), else 0. */
int detinf_rotary_tables(const float *inv_freq, int64_t positions, int64_t dim, float *cos_out,
                         float *sin_out) {
    const int64_t half = dim / 2;
    if (detinf_rotary_out_of_range(inv_freq, positions, dim)) return 1;
#pragma omp parallel for schedule(static) if (positions * dim >= ((int64_t)1 << 16))
    for (int64_t p = 0; p < positions; p++) {
        for (int64_t j = 0; j < half; j++) {
            const float angle = (float)p * inv_freq[j];
            double s, c;
            pm_sincos((double)angle, &s, &c);
            cos_out[p * dim + j] = cos_out[p * dim + j + half] = (float)c;
            sin_out[p * dim + j] = sin_out[p * dim + j + half] = (float)s;
        }
    }
    return 0;
}
