"""Batch-invariant CPU ops: a row's result depends only on that row's data and on constants.

Each op takes `batch_invariant`; False switches to the plain torch op (benchmarks, negative controls).
`selfcheck` probes the ops at a model's real shapes on this hardware.
"""
