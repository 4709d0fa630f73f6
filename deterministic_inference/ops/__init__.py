"""Batch-invariant CPU ops: a row's result depends only on that row's data and on constants.

The model calls its ops through an ops backend (`backend.py`), picked once when the model is built:
in invariant mode attention, the row-wise ops and the bf16 GEMM run in compiled C (`native`, sources
in `csrc/`); `batch_invariant=False` selects plain torch ops (benchmarks, negative controls).
`selfcheck` probes the ops (`probes.py`) at a model's real shapes on this hardware.
"""

# Bumped whenever a change to these ops can change output bits (formulation, summation order), so the
# engine fingerprint changes with it: two builds with the same package version but different kernels
# must not claim the same fingerprint. 2 = all-tiles attention with an exact row max, exp-based silu.
# 3 = row-at-a-time compiled attention kernel (ops/csrc/attention.c), K cache transposed per block.
# 4 = RMSNorm (fused with the residual add), silu_mul and rotary + KV write compiled (ops/csrc/rowwise.c).
# 5 = attention dot products and value sums as explicit fused multiply-adds (fmaf).
# 6 = top-p without a full sort: probabilities are the softmax of the whole row in token order, summed
#     over the best tokens in (-value, id) order (was: softmax of the sorted row).
# 7 = bf16 linears and the logits head of bf16 models in the compiled GEMM (ops/csrc/gemm.c: fixed-order
#     fp32 sums, VDPBF16PS or the same operations portably; the head sums bf16 products, was fp32 GEMM).
# 8 = quantized-weight linears (ops/csrc/quant*.c, ops/quant.py): GGUF blocks read in place, activations
#     quantized per row and block, integer dot products, one fixed fp32 scaling order per output; GGUF
#     weights computed as stored (--quantization auto): the embedding dequantised row by row, the tied
#     logits head over the quantized table; the per-tensor formats enter the numerics too.
# 9 = portable numerics: every rounding operation on the invariant path in our kernels, none in torch's
#     ISA-dispatched ones: log_softmax / softmax / cumulative sums of the sampler (ops/csrc/sampling.c),
#     rotary tables from our own pow / sin / cos (rotary_tables.c, portable_math.h), fp32 linears in a
#     fixed-order FMA GEMM (gemm_f32.c, was oneDNN), Qwen3's q/k norms in the RMSNorm kernel.
# 10 = the float exp of the kernels (common.h exp_in_range: the attention softmax, silu, the sampler's
#     log_softmax through pm_expf, MoE routing) takes every step as one fmaf, 11 roundings where 20 were:
#     the same degree-7 polynomial, a long prompt's attention ~10% faster.
OPS_REVISION = 10
