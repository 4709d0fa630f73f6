"""Batch-invariant CPU ops: a row's result depends only on that row's data and on constants.

Ops that differ from plain torch take `batch_invariant`; False switches to the plain torch op
(benchmarks, negative controls). In invariant mode attention, the row-wise ops and the bf16
GEMM run in compiled C (`native`, sources in `csrc/`);
`selfcheck` probes the ops at a model's real shapes on this hardware.
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
#     quantized per row and block, integer dot products, one fixed fp32 scaling order per output.
OPS_REVISION = 8
