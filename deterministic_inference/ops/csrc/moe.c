/* Mixture-of-experts routing and the weighted sum of expert outputs, for deterministic-inference.

   Both are per token: a token's experts, weights and output are a fixed sequence of IEEE fp32
   operations on that token's own router logits and its own expert output rows (same build promise as
   attention.c: no reassociation, no contraction, exp from common.h), so neither the batch, how many
   tokens go to each expert, the token's position, the thread nor the ISA flags can change a bit.

   ROUTING of one token (logits l[0..E), k experts):
     selection: k rounds; round r takes the not yet chosen expert with the largest logit, scanning
       experts in ascending index and replacing the candidate only on a strictly larger logit, so a tie
       goes to the lower index (a NaN logit ranks below every number: it is taken only when nothing
       else is left);
     the chosen experts are listed in ascending expert index (the order of the output sum);
     weights, with m = the logit chosen in round 0 and e_i = exp(l_i - m) (exp_clamped of common.h;
       a difference below -87 gives exactly 0):
       normalize: w_j = e_j / s, s = the sum of e_j over the chosen experts in ascending index
                  (softmax over the chosen experts: Mixtral; Qwen3-MoE with norm_topk_prob);
       otherwise: w_j = e_j / s, s = the sum of e_i over ALL experts in ascending index
                  (the full softmax's probability of each chosen expert: Qwen2-MoE, Qwen3 without it).

   COMBINE of one token (k slots in the order given; the model passes ascending expert index):
     acc = +0; for each slot j: acc = acc + w_j * y_j[h]  (a product and an add, each rounded once);
     with a shared expert: acc = acc + sigmoid(g) * s[h], sigmoid(g) = 1 / (1 + exp(-g));
     out[h] = acc rounded to the model dtype. */

#include "common.h"

#define MAX_EXPERTS 4096

static inline float moe_load(const void *base, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* exp(x) for x <= 0: exactly 0 below -87 (where exp_in_range would stop being accurate). */
static inline float exp_nonpositive_or_zero(float x) { return x < -87.0f ? 0.0f : exp_in_range(x); }

static void route_token(const float *l, int64_t experts, int64_t k, int normalize, int64_t *ids, float *w) {
    unsigned char chosen[MAX_EXPERTS];
    memset(chosen, 0, (size_t)experts);
    int64_t first = -1;
    for (int64_t r = 0; r < k; r++) {
        int64_t best = -1;
        for (int64_t i = 0; i < experts; i++) {
            if (chosen[i]) continue;
            if (best < 0 || l[i] > l[best] || (l[best] != l[best] && l[i] == l[i])) best = i;
        }
        chosen[best] = 1;
        if (r == 0) first = best;
    }
    const float m = l[first];
    float s = 0.0f;
    int64_t j = 0;
    for (int64_t i = 0; i < experts; i++) {
        if (normalize && !chosen[i]) continue;
        const float e = exp_nonpositive_or_zero(l[i] - m);
        s = s + e;
        if (chosen[i]) {
            ids[j] = i;
            w[j] = e;
            j++;
        }
    }
    for (j = 0; j < k; j++) w[j] = w[j] / s;
}

/* logits [tokens][experts] fp32 -> ids [tokens][k] int64 (ascending per token), weights [tokens][k] fp32.
   Returns 0, or 1 (nothing written) when experts or k is out of range. */
int detinf_moe_route(const float *logits, int64_t tokens, int64_t experts, int64_t k, int normalize, int64_t *ids,
                     float *weights) {
    if (experts < 1 || experts > MAX_EXPERTS || k < 1 || k > experts) return 1;
#pragma omp parallel for schedule(static) if (tokens >= 64)
    for (int64_t t = 0; t < tokens; t++) {
        route_token(logits + t * experts, experts, k, normalize, ids + t * k, weights + t * k);
    }
    return 0;
}

INLINE void combine_token(const void *y, const int64_t *rows, const float *w, int64_t k, int64_t width,
                          const void *shared, const float *shared_gate, void *out, int64_t t, int bf16) {
    const int64_t *slots = rows + t * k;
    const float *weights = w + t * k;
    float gate = 0.0f;
    if (shared != NULL) {
        const float g = shared_gate[t];
        const float clamped = g > 87.0f ? 87.0f : (g < -88.0f ? -88.0f : g);
        gate = 1.0f / (1.0f + exp_in_range(-clamped));
    }
    for (int64_t h = 0; h < width; h++) {
        float acc = 0.0f;
        for (int64_t j = 0; j < k; j++) acc = acc + weights[j] * moe_load(y, slots[j] * width + h, bf16);
        if (shared != NULL) acc = acc + gate * moe_load(shared, t * width + h, bf16);
        if (bf16) ((uint16_t *)out)[t * width + h] = f32_to_bf16(acc);
        else ((float *)out)[t * width + h] = acc;
    }
}

/* out [tokens][width] = per token, the slots' expert rows y[rows[t][j]] (y [R][width]) weighted by
   w [tokens][k] and summed in slot order (+ sigmoid(shared_gate[t]) * shared[t] when shared is given);
   y, shared and out in the model dtype (bf16 when model_bf16, else fp32). Rows were checked by the
   caller (ops/moe.py). */
void detinf_moe_combine(const void *y, const int64_t *rows, const float *w, int64_t tokens, int64_t k,
                        int64_t width, const void *shared, const float *shared_gate, void *out, int model_bf16) {
#pragma omp parallel for schedule(static) if (rowwise_parallel(tokens, k * width))
    for (int64_t t = 0; t < tokens; t++) {
        if (model_bf16) combine_token(y, rows, w, k, width, shared, shared_gate, out, t, 1);
        else combine_token(y, rows, w, k, width, shared, shared_gate, out, t, 0);
    }
}
