/* The sampler's floating-point arithmetic for deterministic-inference: log_softmax (the raw logprobs),
   softmax (top-p / min-p probabilities) and cumulative sums (the top-p cut), over rows of fp32 values.

   Every row is computed alone, whole, by one thread, in an order fixed by this source: the maximum by
   a sequential scan; the sum of exp(x - max) with element i added to lane i % 16 in ascending order,
   then the lanes by a fixed tree (lane_tree); exp by pm_expf and the log of the sum by pm_log
   (portable_math.h). So a row's bits depend on that row alone: not on the other rows, their number,
   the thread count, the CPU's ISA or the build's -march (torch's own softmax kernels dispatch on the
   CPU: AVX-512, AVX2 and scalar builds give different bits). Rows holding a NaN come out all NaN. */

#include "portable_math.h"

/* The row's maximum (-inf for an empty or all -inf row), element i compared into lane i % 16 in
   ascending order, then the lanes in order (explicit lanes vectorise; the maximum is the same value in
   any order, and this order also fixes which zero wins among -0.0 and +0.0); *has_nan set when a NaN
   is in the row. */
INLINE float row_max_scalar(const float *x, int64_t n, int *has_nan) {
    float lanes[LANES];
    int nan[LANES] = {0};
    for (int l = 0; l < LANES; l++) lanes[l] = -INFINITY;
    int64_t base = 0;
    for (; base + LANES <= n; base += LANES) {
        for (int l = 0; l < LANES; l++) {
            const float value = x[base + l];
            lanes[l] = value > lanes[l] ? value : lanes[l];
            nan[l] |= value != value;
        }
    }
    for (int l = 0; base + l < n; l++) {
        const float value = x[base + l];
        lanes[l] = value > lanes[l] ? value : lanes[l];
        nan[l] |= value != value;
    }
    float best = lanes[0];
    int any_nan = nan[0];
    for (int l = 1; l < LANES; l++) {
        best = lanes[l] > best ? lanes[l] : best;
        any_nan |= nan[l];
    }
    *has_nan = any_nan;
    return best;
}

/* exp(x[i] - max) for the 16 elements of one block, into terms[]: a fixed-width block the compiler maps
   onto vector registers (16 lanes, or 2 x 8, 4 x 4: the same per-element operations). */
INLINE void block_terms(const float *x, float max, float *terms) {
    for (int l = 0; l < LANES; l++) terms[l] = pm_expf(x[l] - max);
}

/* sum over i of exp(x[i] - max): element i added to lane i % 16 in ascending order, then lane_tree;
   with `out` (store = 1), the terms are stored there too. */
INLINE float exp_sum_scalar(const float *x, int64_t n, float max, float *out, int store) {
    float lanes[LANES] = {0}, terms[LANES];
    int64_t base = 0;
    for (; base + LANES <= n; base += LANES) {
        block_terms(x + base, max, terms);
        for (int l = 0; l < LANES; l++) lanes[l] = lanes[l] + terms[l];
        if (store) memcpy(out + base, terms, sizeof terms);
    }
    for (int l = 0; base + l < n; l++) {
        const float term = pm_expf(x[base + l] - max);
        if (store) out[base + l] = term;
        lanes[l] = lanes[l] + term;
    }
    return lane_tree(lanes);
}

#if defined(__AVX512F__) && !defined(DETINF_TEST_SEPARATE_STEPS)
/* The AVX-512 twins of row_max_scalar and exp_sum_scalar: lane l of one register is lanes[l] (element
   base + l goes to it, the tail under a mask), every lane op the scalar one (a compare-and-blend for
   `value > lane ? value : lane`, pm_expf16 for pm_expf, one add per term), then the same scalar
   reductions of the 16 lanes. So their bits are the scalar loops'; the tests compare builds with and
   without AVX-512. */
INLINE float row_max(const float *x, int64_t n, int *has_nan) {
    __m512 lanes = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (int64_t base = 0; base < n; base += LANES) {
        const __mmask16 live = lane_mask16(n - base);
        const __m512 value = _mm512_maskz_loadu_ps(live, x + base);
        const __mmask16 greater = _mm512_mask_cmp_ps_mask(live, value, lanes, _CMP_GT_OQ);
        lanes = _mm512_mask_blend_ps(greater, lanes, value);
        nan |= _mm512_mask_cmp_ps_mask(live, value, value, _CMP_UNORD_Q);
    }
    float stored[LANES];
    _mm512_storeu_ps(stored, lanes);
    float best = stored[0];
    for (int l = 1; l < LANES; l++) best = stored[l] > best ? stored[l] : best;
    *has_nan = nan != 0;
    return best;
}

/* pm_expf of 16 lanes: the same clamps and selects around exp16_in_range. */
static inline __m512 pm_expf16(__m512 x) {
    const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __mmask16 low = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    const __mmask16 high = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.0f), _CMP_GT_OQ);
    __m512 clamped = _mm512_mask_blend_ps(high, x, _mm512_set1_ps(88.0f));
    clamped = _mm512_mask_blend_ps(low, clamped, _mm512_set1_ps(-87.0f));
    clamped = _mm512_mask_blend_ps(is_nan, clamped, _mm512_setzero_ps());
    __m512 y = exp16_in_range(clamped);
    y = _mm512_mask_blend_ps(low, y, _mm512_setzero_ps());
    y = _mm512_mask_blend_ps(high, y, _mm512_set1_ps(INFINITY));
    return _mm512_mask_blend_ps(is_nan, y, x);
}

INLINE float exp_sum(const float *x, int64_t n, float max, float *out, int store) {
    const __m512 shift = _mm512_set1_ps(max);
    __m512 lanes = _mm512_setzero_ps();
    for (int64_t base = 0; base < n; base += LANES) {
        const __mmask16 live = lane_mask16(n - base);
        const __m512 terms = pm_expf16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, x + base), shift));
        lanes = _mm512_mask_add_ps(lanes, live, lanes, terms);
        if (store) _mm512_mask_storeu_ps(out + base, live, terms);
    }
    float stored[LANES];
    _mm512_storeu_ps(stored, lanes);
    return lane_tree(stored);
}

/* The lowest index below n - 1 holding `max` (compared with ==), else n - 1. */
INLINE int64_t first_max(const float *x, int64_t n, float max) {
    const __m512 target = _mm512_set1_ps(max);
    for (int64_t base = 0; base < n - 1; base += LANES) {
        const int64_t left = n - 1 - base;
        const __mmask16 live = lane_mask16(left);
        const __mmask16 equal = _mm512_mask_cmp_ps_mask(live, _mm512_maskz_loadu_ps(live, x + base), target, _CMP_EQ_OQ);
        if (equal) return base + __builtin_ctz(equal);
    }
    return n - 1;
}
#else
INLINE float row_max(const float *x, int64_t n, int *has_nan) { return row_max_scalar(x, n, has_nan); }

INLINE float exp_sum(const float *x, int64_t n, float max, float *out, int store) {
    return exp_sum_scalar(x, n, max, out, store);
}

/* The lowest index below n - 1 holding `max` (compared with ==), else n - 1. */
INLINE int64_t first_max(const float *x, int64_t n, float max) {
    int64_t token = 0;
    while (token < n - 1 && !(x[token] == max)) token++; /* -0.0 == +0.0, as torch.argmax compares */
    return token;
}
#endif

static void fill_nan(float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = NAN;
}

/* out[i] = (x[i] - max) - log(sum_j exp(x[j] - max)), the log rounded once from double to float. */
static void log_softmax_row(const float *x, int64_t n, float *out) {
    int has_nan;
    const float max = row_max(x, n, &has_nan);
    if (has_nan) {
        fill_nan(out, n);
        return;
    }
    const float log_sum = (float)pm_log((double)exp_sum(x, n, max, out, 1)); /* terms overwritten below */
    for (int64_t i = 0; i < n; i++) out[i] = (x[i] - max) - log_sum;
}

/* out[i] = exp(x[i] - max) / sum_j exp(x[j] - max). */
static void softmax_row(const float *x, int64_t n, float *out) {
    int has_nan;
    const float max = row_max(x, n, &has_nan);
    if (has_nan) {
        fill_nan(out, n);
        return;
    }
    const float sum = exp_sum(x, n, max, out, 1);
    for (int64_t i = 0; i < n; i++) out[i] = out[i] / sum;
}

/* out[i] = x[0] + ... + x[i], accumulated in double in ascending order, each prefix rounded to float. */
static void cumsum_row(const float *x, int64_t n, float *out) {
    double running = 0.0;
    for (int64_t i = 0; i < n; i++) {
        running = running + (double)x[i];
        out[i] = (float)running;
    }
}

/* x [rows, cols] fp32 contiguous -> out [rows, cols]; op 0 = log_softmax, 1 = softmax, 2 = cumsum.
   Rows are shared out between torch's OpenMP threads, each row whole on one thread. */
void detinf_rows(const float *x, float *out, int64_t rows, int64_t cols, int op) {
#pragma omp parallel for schedule(static) if (rows * cols >= ((int64_t)1 << 16) && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * cols;
        float *dst = out + r * cols;
        if (op == 0) log_softmax_row(row, cols, dst);
        else if (op == 1) softmax_row(row, cols, dst);
        else cumsum_row(row, cols, dst);
    }
}

/* Plain greedy rows of x [rows, cols]: per row the lowest index of its maximum (tokens[r]) and that
   token's raw logprob (logprobs[r]), bitwise log_softmax_row's value at that index (the same row_max,
   exp_sum and log, in the same order) without writing the row's other logprobs; usable[r] = 0 for a
   row holding a NaN (nothing else written for it). Rows are shared out as in detinf_rows. */
void detinf_greedy_rows(const float *x, int64_t rows, int64_t cols, int64_t *tokens, float *logprobs,
                        uint8_t *usable) {
#pragma omp parallel for schedule(static) if (rows * cols >= ((int64_t)1 << 16) && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * cols;
        int has_nan;
        const float max = row_max(row, cols, &has_nan);
        usable[r] = (uint8_t)!has_nan;
        if (has_nan) continue;
        const int64_t token = first_max(row, cols, max); /* -0.0 == +0.0, as torch.argmax compares */
        const float log_sum = (float)pm_log((double)exp_sum(row, cols, max, NULL, 0));
        tokens[r] = token;
        logprobs[r] = (row[token] - max) - log_sum;
    }
}

/* Test hooks: the portable functions one value at a time (tests compare them with float64 references
   and across builds). */
float detinf_test_expf(float x) { return pm_expf(x); }
double detinf_test_exp(double x) { return pm_exp(x); }
double detinf_test_log(double x) { return pm_log(x); }
double detinf_test_sincos(double x, int want_cos) {
    double s, c;
    pm_sincos(x, &s, &c);
    return want_cos ? c : s;
}
